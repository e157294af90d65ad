"""The main job (`python -m mlplat.train`: t2·p2(v2)·d2 on 8 CPU processes, 120 steps) under AdamW and under Muon.

    python experiments/optimizers/run.py [RUNS_DIR]   # 18 main jobs one after the other, ~45 minutes on 2 cores
    python experiments/optimizers/run.py --write [RUNS_DIR]   # and rewrites results.md beside this file

Hydra multiruns (`-m`), one job at a time, in RUNS_DIR (default /tmp/mlplat-optimizers; a sweep whose jobs all
finished is not run again, so a second call only reports again):
  seeds          optim=adamw,muon × seed=1234,1,2 at the defaults, steps 101-119 profiled (the optimizer's share)
  lr_adamw       optim=adamw, optim.lr=3e-3,6e-3,1.2e-2 (half, the default, double), seed 1234
  lr_muon        optim=muon, optim.muon.lr=3e-3,6e-3,1.2e-2 (the hidden matrices' peak lr; the rest keep optim.lr),
                 seed 1234
  muon_tuned     optim=muon, optim.muon.lr=1.2e-2 (lr_muon's best, at its edge), seeds 1 and 2
  lr_muon_wider  optim=muon, optim.muon.lr=2.4e-2,4.8e-2, seed 1234 (past that edge)
  muon_tuned_wider  optim=muon, optim.muon.lr=2.4e-2, seeds 1 and 2
Each job's final validation loss (the mean over the main job's 4 validation batches at step 120) is read from its
metrics.csv. Then the cost model's optimizer share of a step for Llama 3 8B and DeepSeek-V3 on H100s, as the dry
run plans them (`mlplat.perf.dry_run.plan`), under each optimizer; all of it goes into results.md beside this file.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
COMMON = ("logger=none", "sample.max_new_tokens=0")
PROFILED = (101, 119)  # the optimizer's share: the mean over these steps (the last is the run summary's step)
LRS = "3e-3,6e-3,1.2e-2"
MUON_TUNED = ("1.2e-2", "2.4e-2")  # Muon's learning rates run at three seeds
SWEEPS = {
    "seeds": ("optim=adamw,muon", "seed=1234,1,2", f"profile.steps=[{PROFILED[0]},{PROFILED[1]}]"),
    "lr_adamw": ("optim=adamw", f"optim.lr={LRS}"),
    "lr_muon": ("optim=muon", f"optim.muon.lr={LRS}"),
    # Added after the sweeps: Muon's best value, 1.2e-2, is the sweep's edge. Its other two seeds, two more
    # doublings, and the other two seeds of the first of them (2.4e-2 and 4.8e-2 end alike).
    "muon_tuned": ("optim=muon", f"optim.muon.lr={MUON_TUNED[0]}", "seed=1,2"),
    "lr_muon_wider": ("optim=muon", "optim.muon.lr=2.4e-2,4.8e-2"),
    "muon_tuned_wider": ("optim=muon", f"optim.muon.lr={MUON_TUNED[1]}", "seed=1,2"),
}


def jobs(sweep_dir: Path) -> list[Path]:
    return sorted((p for p in sweep_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)) \
        if sweep_dir.is_dir() else []


def finished(sweep_dir: Path, n: int) -> bool:
    done = [j for j in jobs(sweep_dir) if (j / "metrics.csv").exists() and "--- run summary ---" in _log(j)]
    return len(done) == n


def _log(job: Path) -> str:
    return (job / "train.log").read_text() if (job / "train.log").exists() else ""


def run_sweep(name: str, sweep_dir: Path) -> float:
    """One multirun, its output in sweep_dir/../NAME.log; its wall time."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(REPO)}
    t0 = time.time()
    with open(sweep_dir.parent / f"{name}.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "mlplat.train", "-m", f"hydra.sweep.dir={sweep_dir}",
                               *COMMON, *SWEEPS[name]], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"sweep {name} failed: see {sweep_dir.parent / f'{name}.log'}")
    return time.time() - t0


def size(name: str) -> int:
    n = 1
    for override in SWEEPS[name]:
        if "[" not in override:
            n *= len(override.split("=", 1)[1].split(","))
    return n


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--write"]
    runs = Path(args[0]) if args else Path("/tmp/mlplat-optimizers")
    runs.mkdir(parents=True, exist_ok=True)
    for name in SWEEPS:
        if not finished(runs / name, size(name)):
            print(f"{name}: {size(name)} jobs ...", flush=True)
            print(f"{name}: {run_sweep(name, runs / name):.0f} s", flush=True)
    from report import write  # noqa: E402  (experiments/optimizers/report.py: reads the runs, writes results.md)
    write(runs, {name: jobs(runs / name) for name in SWEEPS}, PROFILED, MUON_TUNED, "--write" in sys.argv[1:])
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
