"""Data throughput: preprocessing MB/s (1 and 2 workers) against a plain tokenization loop with the same
library, and the training loader's tokens/s against the training step's tokens/s on the main job's layout.

    python experiments/data_bench/bench.py [--mb 8] [--train-steps 8]

Prints a Markdown table (results.md records one run). The corpus is runs of paragraphs of the embedded Python
reference, one document per file.
"""
from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def make_corpus(folder: Path, mb: float) -> float:
    from mlplat.data.corpus import pydoc_corpus

    paragraphs = pydoc_corpus().split("\n\n")
    rng = random.Random(0)
    size, i = 0, 0
    while size < mb * 1e6:
        k = rng.randrange(len(paragraphs) - 70)
        text = "\n\n".join(paragraphs[k:k + 70])
        (folder / f"doc{i:04d}.txt").write_text(text, encoding="utf-8")
        size += len(text.encode("utf-8"))
        i += 1
    return size / 1e6


def plain_loop_mb_s(folder: Path, spec: str) -> float:
    """The same library, no pipeline: read each file, encode it, keep nothing."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from mlplat.data.tokenizer import load_tokenizer

    tok = load_tokenizer(spec)
    files = sorted(folder.glob("*.txt"))
    start, size = time.perf_counter(), 0
    for f in files:
        text = f.read_text(encoding="utf-8")
        tok.encode(text)
        size += len(text.encode("utf-8"))
    return size / 1e6 / (time.perf_counter() - start)


def preprocess_mb_s(folder: Path, prefix: Path, spec: str, workers: int) -> tuple[float, float]:
    from mlplat.data.preprocess import preprocess

    s = preprocess([str(folder)], str(prefix), spec, workers=workers, progress=False)
    return s["input_bytes"] / 1e6 / s["seconds"], s["tokens"] / s["seconds"]


def loader_tokens_s(prefix: Path, seq_len: int, global_batch: int, steps: int) -> float:
    from torch.utils.data import DataLoader

    from mlplat.data.indexed_windows import indexed_samples
    from mlplat.data.sampler import DataParallelSampler

    ds = indexed_samples([(1.0, str(prefix))], "969,30,1", "train", seq_len, steps * global_batch, seed=1234)
    loader = DataLoader(ds, batch_size=global_batch, sampler=DataParallelSampler(len(ds), global_batch, shuffle=False))
    start = time.perf_counter()
    n = sum(x.numel() for x, _ in loader)
    return n / (time.perf_counter() - start)


def train_tokens_s(prefix: Path, steps: int, run_dir: Path) -> float:
    """The main job's layout (t2·p2(v2)·d2, tiny model, seq 128, batch 16) on the byte prefix; median step."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    subprocess.run([sys.executable, "-m", "mlplat.train", f"hydra.run.dir={run_dir}", "data=indexed",
                    f"data.prefix={prefix}", "logger=none", f"trainer.max_steps={steps}", "sample.max_new_tokens=0",
                    "trainer.limit_val_batches=0"], cwd=REPO, env=env, check=True, capture_output=True)
    with open(run_dir / "metrics.csv", newline="") as f:
        rates = [float(r["tokens_per_s"]) for r in csv.DictReader(f) if r.get("tokens_per_s")]
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=8.0)
    ap.add_argument("--train-steps", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "corpus").mkdir()
        mb = make_corpus(tmp / "corpus", args.mb)
        print(f"corpus: {mb:.1f} MB, {len(list((tmp / 'corpus').iterdir()))} documents; {os.cpu_count()} CPUs\n")
        print("| tokenizer | plain loop MB/s | preprocess 1 worker MB/s (ratio) | preprocess 2 workers MB/s "
              "(per worker) | tokens/s (2 workers) |")
        print("|---|---|---|---|---|")
        for spec in ("gpt2", "byte"):
            plain = plain_loop_mb_s(tmp / "corpus", spec)
            one, _ = preprocess_mb_s(tmp / "corpus", tmp / f"{spec}1", spec, 1)
            two, tok2 = preprocess_mb_s(tmp / "corpus", tmp / f"{spec}2", spec, 2)
            print(f"| {spec} | {plain:.2f} | {one:.2f} ({one / plain:.2f}) | {two:.2f} ({two / 2:.2f}) | {tok2:,.0f} |")
        loader = loader_tokens_s(tmp / "byte1", 128, 16, 200)
        train = train_tokens_s(tmp / "byte1", args.train_steps, tmp / "run")
        print(f"\ntraining loader (data=indexed, seq 128, batch 16, one process): {loader:,.0f} tokens/s")
        print(f"training step (main job layout t2·p2(v2)·d2, tiny, 8 processes): {train:,.0f} tokens/s (median step)")
        print(f"loader / step: {loader / train:,.0f}x")


if __name__ == "__main__":
    main()
