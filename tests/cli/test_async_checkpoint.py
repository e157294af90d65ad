"""`checkpoint.async_save=true` end to end: a run that saves behind training trains exactly as one that saves
synchronously, writes the same shards, and a resume from its checkpoint equals a resume from the synchronous one bit
for bit (float32, dropout on, p = 3: a middle stage that holds no embedding); a rank killed while a write is in
flight leaves a committed checkpoint that `last` resumes."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.cli.test_checkpoint import QUIET, TINY
from tests.helpers.cli import forked_ranks, read_metrics, run_train, start_endless_run, train_losses

pytestmark = pytest.mark.slow

PP3 = (*TINY, "trainer.precision=32-true", "parallel.pp=3", "model.n_layers=3", "parallel.global_batch_size=3",
       *QUIET, "model.dropout=0.1", "checkpoint.every_steps=2", "trainer.max_steps=4")


def _crcs(ckpt) -> dict[str, int]:
    """The checksums of the model's shards and the ranks' RNG states (DCP's .metadata and Lightning's state hold
    per-save details)."""
    files = json.loads((ckpt / "mlplat.json").read_text())["files"]
    return {name: e["crc32"] for name, e in files.items() if name.endswith(".distcp") or name.startswith("rank-")}


def test_resume_from_an_async_checkpoint_equals_resume_from_a_synchronous_one(tmp_path):
    runs = {}
    for mode in ("sync", "async"):
        straight, resumed = tmp_path / mode / "straight", tmp_path / mode / "resumed"
        proc = run_train(straight, *PP3, f"checkpoint.async_save={str(mode == 'async').lower()}")
        assert (straight / "checkpoints" / "latest").read_text().strip() == "step-4"
        run_train(resumed, *PP3, f"ckpt_path={straight / 'checkpoints' / 'step-2'}")
        runs[mode] = dict(straight=straight, resumed=resumed, log=proc.stdout + proc.stderr)
    assert "written behind it" in runs["async"]["log"] and "written behind it" not in runs["sync"]["log"]
    sync, asyn = runs["sync"], runs["async"]
    losses = train_losses(sync["straight"])
    assert len(losses) == 4 and train_losses(asyn["straight"]) == losses  # saving behind changes no step
    for step in ("step-2", "step-4"):
        assert _crcs(asyn["straight"] / "checkpoints" / step) == _crcs(sync["straight"] / "checkpoints" / step)
    assert [int(r["step"]) for r in read_metrics(asyn["resumed"])] == [3, 4]
    # repr() of the logged values: equal strings are equal bits
    assert train_losses(asyn["resumed"]) == train_losses(sync["resumed"]) == losses[2:]


def test_kill_of_a_rank_during_an_async_write_leaves_the_previous_checkpoint(tmp_path):
    """A save is written behind almost every step (every_steps=1); a rank is killed once a write is in flight: the
    job ends with its status in one line naming it (not rank 0's failed save and its closed connection), the
    checkpoint being written is never published, and `last` resumes a committed one."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    overrides = (*TINY, "parallel.pp=2", "model.n_layers=2", "parallel.global_batch_size=2", *QUIET,
                 "checkpoint.every_steps=1", "checkpoint.async_save=true", "parallel.timeout_s=30")
    err = tmp_path / "stderr"
    main = start_endless_run(run_dir, *overrides, err=err)
    try:
        deadline = time.time() + 180
        while not ((ckpts / "step-2" / "mlplat.json").exists() and list(ckpts.glob("*.partial-*"))):
            assert main.poll() is None, "training ended early"
            assert time.time() < deadline, "no write in flight after step-2 within 180 s"
            time.sleep(0.05)
        ranks = forked_ranks(main)
        assert len(ranks) == 1, ranks
        in_flight = {int(p.name.split("-")[1].split(".")[0]) for p in ckpts.glob("*.partial-*")}
        os.kill(ranks[0], signal.SIGKILL)  # rank 1 dies while a write is in flight
        main.wait(timeout=60)
        said = err.read_text()
        assert main.returncode == 128 + signal.SIGKILL, (main.returncode, said[-3000:])
        assert re.search(rf"mlplat: rank 1 \(pid {ranks[0]}\) was killed by SIGKILL; stopping every rank", said), \
            said[-3000:]
        assert "not saved" not in said and "Traceback" not in said, said[-3000:]
    finally:
        if main.poll() is None:
            os.killpg(main.pid, signal.SIGKILL)
    from mlplat.checkpoint import io

    last = io.find_last(ckpts)
    assert last is not None and last.name == (ckpts / io.LATEST).read_text().strip()
    io.verify(last)  # whole, every checksum right
    done = int(last.name.split("-")[1])
    # The write in flight is never published (its partial folder is left, or deleted by the failed save's cleanup)
    assert in_flight and done < min(in_flight), (done, in_flight)
    assert not any((ckpts / f"step-{n}").exists() for n in in_flight), in_flight
    run_train(run_dir, *overrides, f"trainer.max_steps={done + 1}", "ckpt_path=last")
    assert [int(r["step"]) for r in read_metrics(run_dir)][-1] == done + 1
