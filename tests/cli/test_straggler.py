"""A rank made slow on purpose is named by the straggler check (`straggler.every_steps`), and only that rank: a
real tp2·pp2 run on 4 processes whose rank (t1,p1) burns CPU in every layer's forward (tests/helpers/slow_rank.py).
Its tensor-parallel partner waits for it in every all-reduce, and is not named. An even run names nobody
(tests/cli/test_train.py, the tp2-pp2-dp2-zb_h1 run).

Under expert parallelism, the same on 4 processes timed as a GPU's events time them (host-timed stand-ins, whose
blocks hold their waits: tests/helpers/host_events.py): ep4 over d4 (the ep group covers the stage, as qwen3_235b's
ep32) and ep2 within d4 (mixtral_8x7b's ep8 of 16). Timed whole, the blocks named nobody at ep4 and both ranks of
the slow rank's group at ep2; with the dispatcher's all-to-alls taken out of the work, the slowed rank alone."""
from __future__ import annotations

import pytest

from mlplat.parallel.grid import ParallelGrid
from tests.helpers.cli import read_metrics, run_train


def test_a_slowed_rank_is_named_with_its_coordinates_and_host(tmp_path):
    import socket

    slow = ParallelGrid(tp=2, pp=2, dp=1, rank=0, virtual=True).rank_of(tp_rank=1, pp_rank=1, dp_rank=0)
    # The slowed rank works about 4-5x its partner; a threshold of 1.0 keeps a loaded machine's jitter in steps of
    # ~30 ms (once 56% on stage 0, twice in a row) from naming another rank.
    proc = run_train(tmp_path, "parallel=single", "parallel.tp=2", "parallel.pp=2", "logger=csv", "model.seq_len=32",
                     "trainer.max_steps=3", "trainer.limit_val_batches=0", "sample.max_new_tokens=0",
                     "straggler.every_steps=1", "straggler.threshold=1.0", module="tests.helpers.slow_rank",
                     env={"SLOW_RANK": str(slow), "SLOW_MS": "40"})
    out = proc.stdout + proc.stderr
    named = [line.split("straggler: ", 1)[1] for line in out.splitlines() if "straggler: " in line]
    # Slow at every check (each step), named from the second on (two in a row), nobody else; in train.log too.
    assert len(named) == 2 and all(n.startswith(f"rank {slow} (t1,p1,d0) on {socket.gethostname()} worked ")
                                   for n in named), named
    assert [" in step 2, " in named[0], " in step 3, " in named[1]] == [True, True]
    assert "of the 1 other rank of pipeline stage 1" in named[0]
    assert sum("straggler: " in line for line in (tmp_path / "train.log").read_text().splitlines()) == 2
    rows = [read_metrics(tmp_path)[k] for k in range(3)]
    assert [r["straggler_rank"] for r in rows] == ["", str(slow), str(slow)]
    assert all(float(r["straggler_slowdown"]) > 1.0 for r in rows)


@pytest.mark.parametrize("ep", [4, 2], ids=["ep4-covers-the-stage", "ep2-within-d4"])
def test_under_expert_parallelism_the_slowed_rank_is_named(tmp_path, ep):
    slow = 2
    proc = run_train(tmp_path, "model=moe_tiny", "parallel=single", "parallel.dp=4", f"parallel.ep={ep}",
                     "parallel.micro_batch_size=2", "logger=csv", "model.seq_len=32", "trainer.max_steps=3",
                     "trainer.limit_val_batches=0", "sample.max_new_tokens=0", "straggler.every_steps=1",
                     "straggler.threshold=0.5", module="tests.helpers.slow_rank",
                     env={"SLOW_RANK": str(slow), "SLOW_MS": "40", "HOST_EVENTS": "1"})
    named = [line.split("straggler: ", 1)[1] for line in (proc.stdout + proc.stderr).splitlines()
             if "straggler: " in line]
    assert [n.split(" (", 1)[0] for n in named] == [f"rank {slow}"] * 2, named
    assert [r["straggler_rank"] for r in (read_metrics(tmp_path)[k] for k in range(3))] == ["", str(slow), str(slow)]


def test_stages_of_one_rank_say_no_straggler_can_be_named(caplog):
    """straggler.every_steps where every pipeline stage holds one rank (t·c·d = 1): no rank has a peer to be compared
    with, so the columns would stay empty without a word: one line says so at the start."""
    from types import SimpleNamespace

    from mlplat.lightning.callbacks import StragglerCheck

    check = StragglerCheck(every_steps=2, threshold=0.2)
    for grid, said in ((ParallelGrid(pp=2, rank=0, virtual=True), True), (ParallelGrid(tp=2, rank=0, virtual=True),
                                                                           False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="mlplat"):
            check.on_train_start(SimpleNamespace(is_global_zero=True), SimpleNamespace(step=SimpleNamespace(grid=grid)))
        assert ("no straggler can be named" in caplog.text) == said, (grid.pp, grid.tp)
