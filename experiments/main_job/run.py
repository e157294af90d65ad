"""How the main job was tuned: its model and learning-rate schedule against the ones before, then the job itself.

    python experiments/main_job/run.py        # ~9 minutes on 2 cores; writes results.md here

The trials train the main job's model and batch (micro-batches of 8, 32 sequences of 128 bytes per step, 120 steps
on the embedded corpus) in one process each, two at a time on one thread each: one process computes what the 3D
layout does (the equivalence tests prove it), at a quarter of the cost in processes. Each row changes one thing
against the main job's values. Last, `python -m mlplat.train` itself: its wall time, from the command to its exit,
and its summary's lines.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STEPS = 120
BATCH = ["parallel.micro_batch_size=8", "parallel.global_batch_size=32", f"trainer.max_steps={STEPS}",
         f"trainer.val_check_interval={STEPS // 2}"]
MAIN = ["model.position=rope", "optim.lr=6e-3", "optim.min_lr=6e-5", "optim.warmup_steps=50"]
TRIALS = [  # (what changes against the main job, its overrides); each list spells every key it compares
    ("the main job's values: rotary positions, lr 6e-3 → 6e-5, warm-up 50", MAIN),
    ("the same, seed 7", [*MAIN, "seed=7"]),
    ("warm-up 10", ["model.position=rope", "optim.lr=6e-3", "optim.min_lr=6e-5", "optim.warmup_steps=10"]),
    ("learned positions", ["model.position=learned", "optim.lr=6e-3", "optim.min_lr=6e-5", "optim.warmup_steps=50"]),
    ("the values before: learned positions, lr 3e-3 → 3e-4, warm-up 10",
     ["model.position=learned", "optim.lr=3e-3", "optim.min_lr=3e-4", "optim.warmup_steps=10"]),
]


def _val_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["val_loss"]) for r in csv.DictReader(f) if r.get("val_loss")}


def _trial(overrides: list[str]) -> dict[int, float]:
    run_dir = Path(tempfile.mkdtemp(prefix="main-job-trial-"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "mlplat.train", "parallel=single", f"hydra.run.dir={run_dir}",
                    "logger=none", "sample.max_new_tokens=0", *BATCH, *overrides],
                   cwd=REPO, env=env, check=True, capture_output=True)
    return _val_losses(run_dir)


def main() -> int:
    load_before = os.getloadavg()[0]
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=2) as pool:  # 2 cores: two one-thread processes at a time
        curves = list(pool.map(_trial, [overrides for _, overrides in TRIALS]))
    trials_s = time.time() - t0

    run_dir = Path(tempfile.mkdtemp(prefix="main-job-"))
    t1 = time.time()
    job = subprocess.run([sys.executable, "-m", "mlplat.train", f"hydra.run.dir={run_dir}"], cwd=REPO,
                         env=dict(os.environ, WANDB_MODE="offline"), check=True, capture_output=True, text=True)
    job_s = time.time() - t1
    summary = job.stdout[job.stdout.index("--- run summary ---"):].split("\n--------------")[0]

    half = STEPS // 2
    lines = [
        "# Tuning the main job",
        "",
        f"Written by `python experiments/main_job/run.py` on {time.strftime('%Y-%m-%d %H:%M')}, "
        f"{os.cpu_count()} cores, load average (1 min) {load_before:.1f} at the start. The trials took "
        f"{trials_s:.0f} s: one process each, two at a time, micro-batches of 8, 32 sequences of 128 bytes per step, "
        f"{STEPS} steps on the embedded corpus.",
        "",
        f"| trial | val loss at step {half} | at step {STEPS} |",
        "|---|---|---|",
        *[f"| {name} | {curve.get(half, float('nan')):.3f} | {curve.get(STEPS, float('nan')):.3f} |"
          for (name, _), curve in zip(TRIALS, curves)],
        "",
        f"`python -m mlplat.train` (t2·p2(v2)·d2 on 8 CPU processes, W&B offline): **{job_s:.1f} s** from the "
        "command to its exit. Its summary and sample:",
        "",
        "```text",
        summary.strip(),
        "```",
        "",
    ]
    (HERE / "results.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
