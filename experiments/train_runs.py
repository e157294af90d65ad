"""One `python -m mlplat.train` run of an experiment script, as a user types it: shared by the scripts that compare
runs of the main job (experiments/mixed_precision/, experiments/fp8/)."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(run_dir: Path, *overrides: str) -> tuple[list[dict], float]:
    """The run's metrics.csv rows and its wall time; a failed run ends the script with its stderr's tail."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(REPO)}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "mlplat.train", f"hydra.run.dir={run_dir}", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)} failed:\n{proc.stderr[-3000:]}")
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f)), wall
