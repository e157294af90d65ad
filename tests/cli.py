"""Run `python -m mlplat.train` as a user would, and read what it wrote."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_train(run_dir: Path, *overrides: str, timeout: int = 600, check: bool = True,
              env: dict | None = None, module: str = "mlplat.train") -> subprocess.CompletedProcess:
    """Run the CLI with `hydra.run.dir=run_dir`, quiet logging, W&B offline; returns the finished process."""
    full_env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    cmd = [sys.executable, "-m", module, f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
                             f"\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    with open(Path(run_dir) / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def train_losses(run_dir: Path) -> list[float]:
    return [float(r["train_loss"]) for r in read_metrics(run_dir) if r.get("train_loss")]
