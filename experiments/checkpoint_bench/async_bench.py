"""What a checkpoint costs the training loop: the main job with no checkpoints, synchronous saves and asynchronous
saves (`checkpoint.async_save=true`) written by a thread of each rank (`checkpoint.async_mode=thread`) or by DCP's
process of each rank (`process`), in one run of this script.

    python experiments/checkpoint_bench/async_bench.py                      # 3 runs of 40 steps, a save every 4
    python experiments/checkpoint_bench/async_bench.py --steps 24 --every 4 --rounds 2

Each mode trains the main job (`python -m mlplat.train` with its defaults: t2·p2 interleaved v=2·d2 on 8 CPU
processes) for `--steps` steps without validation or the final sample, saving every `--every` steps. It reads:

- the time the training loop was blocked per save: rank 0's line `checkpoint step-N saved: training blocked X s`
  (a synchronous save: the whole save, every rank's write and the commit; an asynchronous one: the wait for the
  previous save, the copy to host memory and starting the write behind);
- the mean step time (`step_time_s` of metrics.csv, the first `--warmup` steps left out) and its overhead against
  the run without checkpoints. The step time holds the saves' blocked time, and, for asynchronous saves, what the
  writing threads (or processes) take from the training's cores;
- the same from step `--steady` on ("steady"): DCP's save process is spawned at the first save and kept, so the
  first write in process mode includes its start (an interpreter per rank, its imports, its gloo world), which the
  next save waits for; the steady figures leave the saves and steps before `--steady` out.

With `--rounds R` the modes run R times, interleaved (none, sync, thread, process, none, ...), and every figure is
the median over the rounds. The run folders are deleted at the end.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BLOCKED = re.compile(r"checkpoint (step-\d+) saved: training blocked ([0-9.]+) s"
                     r"(?:, written behind it in ([0-9.]+) s)?")
MODES = {"none": ("checkpoint.every_steps=0",),
         "sync": ("checkpoint.async_save=false",),
         "thread": ("checkpoint.async_save=true", "checkpoint.async_mode=thread"),
         "process": ("checkpoint.async_save=true", "checkpoint.async_mode=process")}


def _run(mode: str, run_dir: Path, steps: int, every: int) -> dict:
    cmd = [sys.executable, "-m", "mlplat.train", f"hydra.run.dir={run_dir}", "logger=csv", "sample.max_new_tokens=0",
           f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps + 1000}",
           f"checkpoint.every_steps={every}", *MODES[mode]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: `{' '.join(cmd)}` exited {proc.returncode}\n{proc.stderr[-3000:]}")
    saves = BLOCKED.findall(proc.stdout + proc.stderr)
    import csv

    with open(run_dir / "metrics.csv", newline="") as f:
        times = [float(r["step_time_s"]) for r in csv.DictReader(f) if r.get("step_time_s")]
    return {"blocked": [float(b) for _, b, _ in saves], "behind": [float(w) for _, _, w in saves if w],
            "saved_at": [int(name.split("-")[1]) for name, _, _ in saves], "step_times": times, "wall": wall,
            "saves": len(saves)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the mean step time")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steady", type=int, default=13, help="the steady figures: saves and steps from this step on")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mlplat-async-bench-"))
    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        for r in range(args.rounds):
            for mode in modes:
                results[mode].append(_run(mode, root / f"{mode}-{r}", args.steps, args.every))
                print(f"round {r + 1}/{args.rounds}: {mode} done in {results[mode][-1]['wall']:.0f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def median(mode: str, fn) -> float:
        return statistics.median(fn(x) for x in results[mode])

    def step_mean(x: dict, first: int = args.warmup + 1) -> float:  # steps are numbered from 1
        return statistics.fmean(x["step_times"][first - 1:])

    def steady(x: dict, key: str) -> list[float]:
        return [v for at, v in zip(x["saved_at"], x[key]) if at >= args.steady] or [float("nan")]

    base = median("none", step_mean) if "none" in modes else float("nan")
    base_steady = median("none", lambda x: step_mean(x, args.steady)) if "none" in modes else float("nan")
    ref = median("sync", lambda x: statistics.fmean(x["blocked"])) if "sync" in modes else float("nan")
    print(f"\nthe main job, {args.steps} steps, a save every {args.every} steps, {args.rounds} round(s), "
          f"{os.cpu_count()} CPU cores (shared: timings are noisy), load average {os.getloadavg()[0]:.0f} at the end; "
          f"steady: from step {args.steady}\n")
    print("| mode | saves | blocked per save, mean (max) | blocked, steady | behind per save: first, steady "
          "| mean step time (vs none) | steady step time (vs none) | blocked vs sync |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode in modes:
        step, step_s = median(mode, step_mean), median(mode, lambda x: step_mean(x, args.steady))
        steps = (f"{step * 1e3:.0f} ms ({(step / base - 1) * 100:+.1f}%) | "
                 f"{step_s * 1e3:.0f} ms ({(step_s / base_steady - 1) * 100:+.1f}%)")
        if mode == "none":
            print(f"| none | 0 | — | — | — | {steps} | — |")
            continue
        blocked = median(mode, lambda x: statistics.fmean(x["blocked"]))
        worst = median(mode, lambda x: max(x["blocked"]))
        blocked_s = median(mode, lambda x: statistics.fmean(steady(x, "blocked")))
        behind = "—"
        if results[mode][0]["behind"]:
            first = median(mode, lambda x: x["behind"][0])
            later = median(mode, lambda x: statistics.fmean(steady(x, "behind")))
            behind = f"{first * 1e3:.0f} ms, {later * 1e3:.0f} ms"
        print(f"| {mode} | {results[mode][0]['saves']} | {blocked * 1e3:.1f} ms ({worst * 1e3:.1f} ms) | "
              f"{blocked_s * 1e3:.1f} ms | {behind} | {steps} | {'—' if ref != ref else f'{blocked / ref:.3f}'} |")


if __name__ == "__main__":
    main()
