"""`checkpoint.async_save=true` end to end: a run that saves behind training trains exactly as one that saves
synchronously, writes the same shards, and a resume from its checkpoint equals a resume from the synchronous one bit
for bit (float32, dropout on, p = 3: a middle stage that holds no embedding)."""
from __future__ import annotations

import json

import pytest

from tests.cli.test_checkpoint import QUIET, TINY
from tests.helpers.cli import read_metrics, run_train, train_losses

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
