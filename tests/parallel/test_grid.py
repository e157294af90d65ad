"""ParallelGrid: coordinates, groups and the RNG streams they seed, on real gloo groups and virtual grids.

The 8-rank group is expensive to start on a 2-core box, so it is spawned once (a module fixture) for every layout
and for the RNG tracker's cross-rank check; each check then becomes its own pytest item.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.random import RNGTracker, seed_model_parallel
from tests.helpers.dist import run_distributed

F64 = torch.float64


# ============================================================================ grid (real groups)

GRID_LAYOUTS = [(2, 2, 2, 1), (1, 4, 2, 1), (8, 1, 1, 1), (2, 2, 1, 2), (1, 2, 2, 2), (1, 1, 2, 4)]  # t, p, d, c


def _expected(world, tp, pp, dp, cp=1):
    """Independent reference: coordinates by the formula rank = t + tp*(c + cp*(d + dp*p))."""
    coords = {t + tp * (c + cp * (d + dp * p)): (t, p, d, c)
              for t in range(tp) for p in range(pp) for d in range(dp) for c in range(cp)}
    assert sorted(coords) == list(range(world))
    return coords


def _grid_worker(rank, world_size):
    out = {}
    for tp, pp, dp, cp in GRID_LAYOUTS:
        grid = ParallelGrid(tp=tp, pp=pp, dp=dp, cp=cp)
        sums = {}
        for name in ("tp_group", "cp_group", "dp_group", "dp_cp_group", "pp_group", "embedding_group"):
            group = getattr(grid, name)
            if group is None:
                sums[name] = None
                continue
            t = torch.tensor([float(rank)], dtype=F64)
            dist.all_reduce(t, group=group)
            sums[name] = (t.item(), dist.get_world_size(group), sorted(dist.get_process_group_ranks(group)))
        out[(tp, pp, dp, cp)] = {
            "sums": sums,
            "coords": (grid.tp_rank, grid.pp_rank, grid.dp_rank, grid.cp_rank),
            "lists": (grid.tp_ranks, grid.dp_ranks, grid.pp_ranks, grid.embedding_ranks, grid.cp_ranks,
                      grid.dp_cp_ranks),
        }
    # Key/value heads shared by runs of 2 of the 4 tp ranks: the kv group of each run, created with the grid.
    grid = ParallelGrid(tp=4, pp=2, dp=1, kv_replicas=2)
    t = torch.tensor([float(rank)], dtype=F64)
    dist.all_reduce(t, group=grid.kv_group)
    out["kv"] = (grid.kv_ranks, t.item(), sorted(dist.get_process_group_ranks(grid.kv_group)))
    try:
        ParallelGrid(tp=2, pp=2, dp=1)
        out["mismatch"] = None
    except ValueError as err:
        out["mismatch"] = str(err)

    # RNG: dropout identical across tp ranks of a stage outside fork, different inside fork.
    grid = ParallelGrid(tp=2, pp=2, dp=2)
    tracker = RNGTracker()
    seed_model_parallel(42, grid, tracker)
    ones = torch.ones(256, dtype=F64)
    outside = F.dropout(ones, 0.5)
    state = torch.get_rng_state()
    after_no_fork = F.dropout(ones, 0.5)
    torch.set_rng_state(state)
    with tracker.fork():
        inside = F.dropout(ones, 0.5)
    after_fork = F.dropout(ones, 0.5)  # forking must not advance the default stream
    out["rng"] = (outside, inside, torch.equal(after_fork, after_no_fork))
    return out


@pytest.fixture(scope="module")
def grid_world():
    return run_distributed(_grid_worker, 8, timeout=180)


@pytest.mark.parametrize("layout", GRID_LAYOUTS, ids=lambda lay: "tp{}pp{}dp{}cp{}".format(*lay))
def test_grid_groups(grid_world, layout):
    tp, pp, dp, cp = layout
    coords = _expected(8, tp, pp, dp, cp)
    for rank, res in enumerate(grid_world):
        got = res[layout]
        t, p, d, c = coords[rank]
        assert got["coords"] == (t, p, d, c)

        def where(keep):
            return sorted(r for r, (t2, p2, d2, c2) in coords.items() if keep(t2, p2, d2, c2))
        members = {
            "tp_group": where(lambda t2, p2, d2, c2: (p2, d2, c2) == (p, d, c)),
            "cp_group": where(lambda t2, p2, d2, c2: (t2, p2, d2) == (t, p, d)),
            "dp_group": where(lambda t2, p2, d2, c2: (t2, p2, c2) == (t, p, c)),
            # the ranks holding this rank's weights: the gradient reduction and the distributed optimizer's shards
            "dp_cp_group": where(lambda t2, p2, d2, c2: (t2, p2) == (t, p)),
            "pp_group": where(lambda t2, p2, d2, c2: (t2, d2, c2) == (t, d, c)),
            "embedding_group": where(lambda t2, p2, d2, c2: (t2, d2, c2) == (t, d, c) and p2 in (0, pp - 1))
            if pp > 1 else [rank],
        }
        for name, ranks in members.items():
            if len(ranks) == 1 or rank not in ranks:  # middle stages hold no embedding group
                assert got["sums"][name] is None, (rank, name)
            else:
                assert got["sums"][name] == (float(sum(ranks)), len(ranks), ranks), (rank, name)
        tp_ranks, dp_ranks, pp_ranks, emb_ranks, cp_ranks, dp_cp_ranks = got["lists"]
        assert tp_ranks == members["tp_group"] and dp_ranks == members["dp_group"]
        assert pp_ranks == members["pp_group"] and cp_ranks == members["cp_group"]
        assert dp_cp_ranks == members["dp_cp_group"]
        assert emb_ranks == (sorted({pp_ranks[0], pp_ranks[-1]}) if pp > 1 else [])


def test_kv_group_is_each_run_of_tp_ranks_sharing_a_key_value_head(grid_world):
    for rank, res in enumerate(grid_world):
        ranks, total, members = res["kv"]
        first = rank - rank % 2  # tp innermost: tp ranks (0, 1) and (2, 3) of each stage share a head
        assert ranks == members == [first, first + 1] and total == 2 * first + 1, (rank, res["kv"])


def test_grid_world_size_mismatch(grid_world):
    for res in grid_world:
        assert res["mismatch"] is not None and "8" in res["mismatch"] and "4" in res["mismatch"]


def test_rng_tracker_across_ranks(grid_world):
    coords = _expected(8, 2, 2, 2)
    for a in range(8):
        outside_a, inside_a, fork_kept_stream = grid_world[a]["rng"]
        assert fork_kept_stream
        for b in range(a + 1, 8):
            outside_b, inside_b, _ = grid_world[b]["rng"]
            (ta, pa, _, _), (tb, pb, _, _) = coords[a], coords[b]
            assert torch.equal(outside_a, outside_b) == (pa == pb), (a, b)
            assert torch.equal(inside_a, inside_b) == (pa == pb and ta == tb), (a, b)


# ============================================================================ grid (pure / virtual)


@pytest.mark.parametrize("layout", [(1, 1, 1, 1), (2, 3, 4, 1), (8, 64, 6, 1), (4, 1, 3, 1), (1, 5, 1, 1),
                                    (2, 3, 2, 4), (8, 7, 2, 4)])
def test_grid_coordinates_virtual(layout):
    tp, pp, dp, cp = layout
    world = tp * pp * dp * cp
    coords = _expected(world, tp, pp, dp, cp)
    for rank in sorted(set(range(0, world, max(1, world // 97))) | {world - 1}):
        grid = ParallelGrid(tp, pp, dp, rank=rank, virtual=True, cp=cp)
        assert grid.world_size == world
        assert grid.coords(rank) == (grid.tp_rank, grid.pp_rank, grid.dp_rank, grid.cp_rank) == coords[rank]
        assert grid.rank_of(*grid.coords(rank)) == rank
        assert grid.tp_group is grid.dp_group is grid.pp_group is grid.embedding_group is None
        assert grid.cp_group is grid.dp_cp_group is None
        t, p, d, c = coords[rank]
        assert grid.tp_ranks == [r for r in range(world) if coords[r][1:] == (p, d, c)]
        assert grid.cp_ranks == [r for r in range(world) if coords[r][:3] == (t, p, d)]
        assert grid.dp_cp_rank == c + cp * d and grid.dp_cp_ranks[grid.dp_cp_rank] == rank
        assert grid.pp_ranks == [grid.stage_rank(q) for q in range(pp)]
        assert grid.stage_rank(pp) == grid.pp_ranks[0]  # the last stage's "next" wraps to the first
        assert grid.stage_rank(grid.pp_rank + 1) == grid.pp_ranks[(p + 1) % pp]
        assert grid.is_first_stage == (p == 0) and grid.is_last_stage == (p == pp - 1)
        assert grid.embedding_ranks == ([grid.pp_ranks[0], grid.pp_ranks[-1]] if pp > 1 else [])
        assert f"tp={tp}" in repr(grid)
    probe = ParallelGrid(tp, pp, dp, virtual=True, cp=cp)
    assert [probe.rank_of(*probe.coords(r)) for r in range(world)] == list(range(world))


def test_grid_invalid():
    with pytest.raises(ValueError, match="tp=2"):
        ParallelGrid(tp=2)  # no process group: only the trivial grid
    with pytest.raises(ValueError):
        ParallelGrid(tp=2, rank=2, virtual=True)
    with pytest.raises(ValueError):
        ParallelGrid(tp=0, virtual=True)
    with pytest.raises(ValueError, match="kv_replicas=3 does not divide tp=4"):
        ParallelGrid(tp=4, virtual=True, kv_replicas=3)
    assert ParallelGrid(tp=8, rank=5, virtual=True, kv_replicas=4).kv_ranks == [4, 5, 6, 7]
    grid = ParallelGrid()
    assert (grid.rank, grid.tp_group, grid.embedding_group) == (0, None, None)
    assert grid.is_first_stage and grid.is_last_stage
