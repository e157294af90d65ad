"""ParallelDims: the rank order, the groups the grid creates, the layout a run's config, perf and a checkpoint's
manifest read, all from one object. Pure: no process group."""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from mlplat.config import ModelConfig, load_config
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.layout.dims import AXES, REPLICA_AXES, ParallelDims
from mlplat.perf.flops import ModelDims
from mlplat.perf.memory import Layout

# Every (t, c, p, d) of at most 16 ranks.
LAYOUTS = [(t, c, p, d) for t, c, p, d in itertools.product(range(1, 17), repeat=4) if t * c * p * d <= 16]


def _reference(t, c, p, d):
    """Coordinates by the paper's order written out: rank = tp + t·(cp + c·(dp + d·pp)), TP innermost."""
    return {i + t * (j + c * (k + d * q)): {"tp": i, "cp": j, "dp": k, "pp": q}
            for i in range(t) for j in range(c) for k in range(d) for q in range(p)}


def test_the_rank_order_round_trips():
    for t, c, p, d in LAYOUTS:
        dims = ParallelDims(tp=t, cp=c, pp=p, dp=d)
        ref = _reference(t, c, p, d)
        assert dims.world_size == len(ref) == t * c * p * d
        for rank, at in ref.items():
            assert dims.coords(rank)._asdict() == at and dims.rank_of(**at) == rank, (t, c, p, d, rank)
            assert dims.replica_rank(rank) == at["cp"] + c * at["dp"]  # cp inside dp, as in the rank order
        assert [dims.stride(axis) for axis in AXES] == [1, t, t * c, t * c * d]  # stages are t·c·d ranks apart
        assert dims.span("cp") == t * c and dims.replicas == d * c
        with pytest.raises(ValueError, match="outside"):
            dims.coords(dims.world_size)
        with pytest.raises(ValueError, match="pp_rank"):
            dims.rank_of(pp=p)


def test_the_grid_holds_the_groups_the_type_names():
    """Each rank's group lists are the type's; the groups of an axis partition the world, each one the group of
    its every member (what _create_groups hands to dist.new_group, on every rank alike)."""
    for t, c, p, d in LAYOUTS:
        dims = ParallelDims(tp=t, cp=c, pp=p, dp=d)
        for axes in (*AXES, REPLICA_AXES):
            groups = dims.groups(axes)
            assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
            assert all(dims.group(axes, r) == g for g in groups for r in g)
        for rank in range(dims.world_size):
            grid = ParallelGrid.of(dims, rank=rank, virtual=True)
            assert grid.dims == dims and grid.world_size == dims.world_size
            assert (grid.tp_ranks, grid.cp_ranks, grid.dp_ranks, grid.pp_ranks, grid.dp_cp_ranks) == tuple(
                dims.group(axes, rank) for axes in ("tp", "cp", "dp", "pp", REPLICA_AXES))
            assert grid.dp_cp_rank == dims.replica_rank(rank) and grid.dp_cp_ranks[grid.dp_cp_rank] == rank
            assert grid.pp_ranks == [rank % dims.stride("pp") + q * dims.stride("pp") for q in range(p)]


def _config(**parallel):
    return load_config({"model": {"vocab_size": 256, "seq_len": 64}, "parallel": parallel}, check_data=False)


def test_the_run_config_perf_and_the_manifest_read_one_layout():
    cfg = _config(tp=2, cp=2, pp=2, vpp=2, schedule="interleaved", micro_batch_size=1, global_batch_size=8,
                  sequence_parallel=True)
    dims = cfg.dims  # built once by validate: d resolved from trainer.devices = t·c·p
    assert (dims.world_size, dims.dp, dims.num_micro_batches, dims.replicas) == (8, 1, 8, 2)
    assert cfg.trainer.devices == cfg.parallel.world_size == 8 and cfg.parallel.num_micro_batches == 8
    lay = Layout.of(cfg)  # the perf models' layout is the same ParallelDims with the cost knobs added
    assert ParallelDims.of(lay) == dims and (lay.gpus, lay.replicas, lay.num_micro_batches) == (8, 2, 8)
    assert dataclasses.replace(lay, dp=3).gpus == 24


def test_manifests_from_old_checkpoints_still_load(tmp_path):
    """A manifest written before parallel.cp existed (no "cp" key) reads as c = 1: the same ranks as the run that
    resumes it, so the rank's own RNG streams are restored; another layout is said to be one."""
    from mlplat.checkpoint import io
    from mlplat.lightning.strategy import checkpoint_layout

    cfg = _config(tp=2, pp=2, micro_batch_size=1, global_batch_size=4)
    layout = checkpoint_layout(cfg, 1)
    assert {k: layout[k] for k in ("tp", "cp", "pp", "vpp", "dp", "schedule")} == {
        "tp": 2, "cp": 1, "pp": 2, "vpp": 1, "dp": 1, "schedule": "1f1b"}
    assert ParallelDims.from_manifest(layout).same_ranks(cfg.dims)
    old = {k: layout[k] for k in ("tp", "pp", "vpp", "dp", "schedule")}  # before cp
    (tmp_path / io.MANIFEST).write_text(json.dumps({"format": "mlplat-dcp-2", "layout": old, "files": {}}))
    assert ParallelDims.from_manifest(old) == ParallelDims.from_manifest(layout) == ParallelDims(tp=2, pp=2)
    mine, why = io.load_rank_state(tmp_path, 0, layout)
    assert mine is None and "holds no rank-0.pt" in why  # the layout matched: only the file is missing
    assert "another layout (tp=2, cp=1, dp=1, pp=2" in io.load_rank_state(tmp_path, 0, {**layout, "cp": 2})[1]


def test_model_dims_is_a_resolved_model_config():
    llama = ModelConfig(arch="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, seq_len=32)
    dims = ModelDims.of(llama)
    assert isinstance(dims, ModelConfig) and dims.vocab_size == 256  # the byte tokenizer's until resolved
    assert (dims.position, dims.norm, dims.mlp, dims.tie_embeddings, dims.bias, dims.qkv_bias) == (
        "rope", "rmsnorm", "swiglu", False, False, False)
    assert dims.ffn == llama.ffn == 256 and dims.kv_heads == 2 and dims.qkv_width == 64 + 2 * 32
    assert ModelDims.from_config(dims.config_keys()) == dims and len({dims, ModelDims.of(llama)}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.hidden = 128  # type: ignore[misc]
    paper = ModelDims(48, 4096, 32, 2048, 51200)  # l, h, a, s, V: GPT's defaults
    assert (paper.arch, paper.position, paper.qkv_bias, paper.ffn, paper.is_paper_gpt) == (
        "gpt", "learned", True, 4 * 4096, True)


@pytest.mark.parametrize("tp,cp,dp,pp,ep", [(2, 1, 2, 2, 2), (2, 1, 2, 1, 4), (1, 2, 2, 1, 4), (2, 2, 2, 1, 2),
                                            (4, 1, 2, 1, 1)])
def test_the_experts_fold_over_each_stage_once(tp, cp, dp, pp, ep):
    """etp × ep × edp over a stage's t·c·d ranks, numbered as the rank order numbers them (pp left out): every rank
    of a stage is in exactly one ep group and one edp group, both inside its stage, ep fastest; etp defaults to t
    at ep = 1 and to 1 beside expert parallelism."""
    dims = ParallelDims(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)
    assert dims.expert_tp == (tp if ep == 1 else 1) and dims.edp * dims.ep * dims.expert_tp == tp * cp * dp
    for axis in ("ep", "edp"):
        groups = dims.expert_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
        for g in groups:
            assert len({dims.coords(r).pp for r in g}) == 1  # inside one stage
    stage = tp * cp * dp
    ep_of = {r: dims.expert_coords(r)["ep"] for r in range(dims.world_size)}
    for r in range(dims.world_size):  # ep fastest over the stage's ranks in the rank order (after etp)
        assert ep_of[r] == r % stage // dims.expert_tp % ep
        assert dims.expert_group("ep", r)[ep_of[r]] == r


def test_the_grid_reuses_a_communicator_for_an_expert_group_with_its_ranks():
    """Virtual grids name the groups' ranks: ep = t makes the ep group the tp group's ranks; at etp = t (or t = 1)
    the edp group is the d·c replicas."""
    folded = ParallelGrid(2, 1, 2, ep=2, rank=3, virtual=True)
    assert folded.ep_ranks == folded.tp_ranks == [2, 3] and folded.edp_ranks == [1, 3]
    split = ParallelGrid(2, 1, 2, rank=3, virtual=True)
    assert split.etp == 2 and split.edp_ranks == split.dp_cp_ranks == [1, 3] and split.ep_ranks == [3]
    wide = ParallelGrid(2, 1, 2, ep=4, rank=3, virtual=True)
    assert wide.ep_ranks == [0, 1, 2, 3] and wide.edp_ranks == [3] and wide.ep_rank == 3
