"""Exact resume across epoch ends, through the CLI: the resumed run's per-step losses equal the uninterrupted
run's bit for bit, and it draws the same sample ids at every step (DIR/samples.csv, data-parallel rank 0's share).

The data is cut small so that an epoch is 5 global batches of 16: the Python reference (`data=pydoc`) with all
but ~1400 tokens held out for validation (87 windows of 16 tokens), and, for `data=indexed`, ten short documents
whose train split holds 2.5 global batches of windows (of 16 tokens), so that the sample index passes over the documents
several times. Each run is resumed from a checkpoint of the straight run in the middle of an epoch (copied into
a new run directory and found by `ckpt_path=last`), and the resumed part crosses at least one epoch end; a
validation inside the resumed part is compared too. The straight run and the resumed run save at the same
steps, so they do the same work. Each resume point is one where the sampler before this fix drew other
samples within the run (its resumed epoch was cut short, or started over at sample 0).
"""
from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, read_metrics, run_train

pytestmark = pytest.mark.slow

QUIET = ("logger=none", "sample.max_new_tokens=0")
TINY = ("model.seq_len=16", "model.hidden=32", "model.n_heads=4", "model.dropout=0.1", "trainer.precision=32-true",
        "trainer.limit_val_batches=1")
PYDOC_EPOCH_OF_5 = ("data=pydoc", "data.val_fraction=0.99699", "+data.record_samples=true")


def _samples(run_dir: Path) -> list[tuple[int, str]]:
    with open(run_dir / "samples.csv", newline="") as f:
        return [(int(step), ids) for step, ids in csv.reader(f)]


def _column(run_dir: Path, name: str) -> dict[int, str]:
    return {int(r["step"]): r[name] for r in read_metrics(run_dir) if r.get(name)}


def _straight_and_resumed(tmp_path: Path, common: tuple[str, ...], total: int, every: int, resume_at: int):
    """The straight run of `total` steps (saving every `every`), and a run resumed from its step-`resume_at`."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(straight, *common, f"trainer.max_steps={total}", f"checkpoint.every_steps={every}")
    shutil.copytree(straight / "checkpoints" / f"step-{resume_at}", resumed / "checkpoints" / f"step-{resume_at}")
    proc = run_train(resumed, *common, f"trainer.max_steps={total}", f"checkpoint.every_steps={every}",
                     "ckpt_path=last")
    return straight, resumed, proc.stdout + proc.stderr


def _assert_resumed_exactly(straight: Path, resumed: Path, output: str, total: int, resume_at: int,
                            epoch_steps: int | None):
    # Lightning warns when it restores a mid-epoch loop on a loader that cannot restore its own position.
    assert "not resumable" not in output
    assert "Restored all states" in output
    rows = _samples(straight)
    assert [s for s, _ in rows] == list(range(1, total + 1))  # one row per step, no step drawn twice
    if epoch_steps is not None:  # epochs of one permutation each: an epoch draws each window once
        for e in range(total // epoch_steps):
            ids = [i for _, r in rows[e * epoch_steps:(e + 1) * epoch_steps] for i in r.split()]
            assert len(ids) == len(set(ids)), f"epoch {e} drew a sample twice"
    assert _samples(resumed) == rows[resume_at:], "the resumed run drew other samples"
    a, b = _column(straight, "train_loss"), _column(resumed, "train_loss")
    assert sorted(a) == list(range(1, total + 1)) and sorted(b) == list(range(resume_at + 1, total + 1))
    assert b == {s: a[s] for s in b}  # repr() of float32 values: equal strings are equal bits
    va, vb = _column(straight, "val_loss"), _column(resumed, "val_loss")
    assert vb and vb == {s: va[s] for s in vb}


def test_single_pydoc_resume_across_two_epoch_ends(tmp_path):
    """One process, 5 steps per epoch: 16 steps straight; resumed from step 6 (the first step of epoch 1 done)
    it crosses the ends of epochs 1 and 2 (after steps 10 and 15) and validates at steps 8, 12 and 16."""
    common = ("parallel=single", *PYDOC_EPOCH_OF_5, *QUIET, *TINY, "model.n_layers=2",
              "trainer.val_check_interval=4")
    straight, resumed, output = _straight_and_resumed(tmp_path, common, total=16, every=6, resume_at=6)
    _assert_resumed_exactly(straight, resumed, output, total=16, resume_at=6, epoch_steps=5)
    rows = dict(_samples(straight))
    assert rows[11] != rows[6] != rows[1]  # each epoch is its own permutation


def test_3d_pydoc_resume_across_an_epoch_end(tmp_path):
    """The default 3D layout (t2·p2(v2)·d2, 8 processes), 5 steps per epoch: 6 steps straight; resumed from step 2
    it crosses the end of epoch 0 (the old sampler ended the resumed epoch after step 3)."""
    common = ("parallel=3d_cpu", "parallel.micro_batch_size=4", "parallel.global_batch_size=16", *PYDOC_EPOCH_OF_5,
              *QUIET, *TINY, "model.n_layers=4",
              "trainer.val_check_interval=4")
    straight, resumed, output = _straight_and_resumed(tmp_path, common, total=6, every=2, resume_at=2)
    _assert_resumed_exactly(straight, resumed, output, total=6, resume_at=2, epoch_steps=5)
    # Each forked rank logs to its own DIR/rank<N>.log, created by its first line: no empty files.
    logs = list(resumed.glob("rank*.log"))
    assert {p.name for p in logs} <= {f"rank{k}.log" for k in range(1, 8)} and all(p.stat().st_size for p in logs)


def _tiny_indexed(tmp_path: Path) -> Path:
    """Ten documents, preprocessed with the byte tokenizer: eight of 80 bytes (the train split of
    data.split=[80,20,0]) and two of 200 (validation, at least a global batch of windows)."""
    from mlplat.data.corpus import pydoc_corpus

    text = " ".join(pydoc_corpus().split())
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(10):
        (corpus / f"doc{i}.txt").write_text(text[i * 1000: i * 1000 + (80 if i < 8 else 200)], encoding="utf-8")
    prefix = tmp_path / "data" / "tiny"
    proc = subprocess.run([sys.executable, "-m", "mlplat.data.preprocess", "--input", str(corpus), "--output-prefix",
                           str(prefix), "--tokenizer", "byte", "--workers", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return prefix


def test_single_indexed_resume_across_passes_over_the_data(tmp_path):
    """data=indexed is one pass over the cached sample index, whose order goes over the train documents' 40
    windows again and again (passes end inside steps 3, 5 and 8): 8 steps straight; resumed from step 3 it
    continues at step 4 and never starts over at sample 0 (the old sampler did after step 5)."""
    prefix = _tiny_indexed(tmp_path)
    common = ("parallel=single", "data=indexed", f"data.prefix={prefix}", "data.split=[80,20,0]",
              "data.record_samples=true", *QUIET, *TINY, "model.n_layers=2", "trainer.val_check_interval=6")
    straight, resumed, output = _straight_and_resumed(tmp_path, common, total=8, every=3, resume_at=3)
    _assert_resumed_exactly(straight, resumed, output, total=8, resume_at=3, epoch_steps=None)
    from mlplat.data.indexed_windows import open_sources

    (train,) = open_sources([(1.0, str(prefix))], "80,20,0", 16)["train"]
    assert 32 < train.count < 48  # 2-3 global batches of windows: the 8 steps pass over them three times
    rows = dict(_samples(straight))  # the ids are rows of the sample index, read in order
    assert all(rows[k].split() == [str(i) for i in range((k - 1) * 16, k * 16)] for k in rows)
