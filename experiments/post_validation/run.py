"""Optimizer post-validation against the synchronous step: the main job's layout (t2·p2(v2)·d2, 8 CPU processes)
and a p4 ZB-V pipeline (4 CPU processes).

    python experiments/post_validation/run.py            # ~9 minutes on 2 cores; writes results.md here
    python experiments/post_validation/run.py --rounds 1 --steps 20

Three settings, each run with `optim.post_validate=false` and `=true`, taking turns round by round (ABAB: this
machine's load drifts):
  no clipping applies  the main job with optim.grad_clip=100: every post-validated step stands (the common case once
                       training settles); what it saves is the wait on the norm, overflow and loss all-reduces between
                       two steps (the next step's pass starts at once), what it costs is the copy of the step's state
  the main job's clip  optim.grad_clip=1.0: this model's gradient norm is above 1 in nearly every early step; the
                       first is stepped twice and its next pass run twice, and each step after a clipped one runs
                       synchronously
  p4 zbv, no clipping  8 layers, parallel=single pp=4 vpp=2 zbv, m = 8, grad_clip=100: the schedule whose ranks end
                       a step at different times, which post-validation lets run its steps back to back
Per run: the median step time over steps 6 to the end (metrics.csv's step_time_s: rank 0's time from one step's end to
the next), the steps redone, and rank 0's profiled step 10 (optimizer and dp_comm time, which holds the norm and loss
all-reduces). The figures are ratios post-validated / synchronous within a round. On 2 cores shared by 4 or 8
processes a rank's idle time is another rank's compute time, so what a GPU pipeline gains from its bubble is not what
this machine shows: pipeline_bench/back_to_back.py measures that, on stages of fixed duration.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SETTINGS = {"no clipping applies": ("optim.grad_clip=100",), "the main job's clip": ("optim.grad_clip=1.0",),
            "p4 zbv, no clipping": ("optim.grad_clip=100", "parallel=single", "parallel.pp=4", "parallel.vpp=2",
                                    "parallel.schedule=zbv", "model.n_layers=8", "parallel.micro_batch_size=4",
                                    "parallel.global_batch_size=32")}
PROFILED = 10


def run(steps: int, *overrides: str) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="post-validation-"))
    subprocess.run([sys.executable, "-m", "mlplat.train", f"hydra.run.dir={run_dir}", "logger=none",
                    "sample.max_new_tokens=0", "trainer.limit_val_batches=0", f"trainer.max_steps={steps}",
                    f"profile.steps={PROFILED}", *overrides],
                   cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), check=True, capture_output=True)
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    times = [float(r["step_time_s"]) for r in rows if r.get("step_time_s") and int(r["step"]) > 5]
    profiled = next(r for r in rows if int(r["step"]) == PROFILED)
    return {"step_s": statistics.median(times), "redone": int(float(rows[-1].get("redone_steps") or 0)),
            "optimizer_s": float(profiled.get("time_optimizer_s") or 0),
            "dp_comm_s": float(profiled.get("time_dp_comm_s") or 0),
            "loss": float(rows[-1]["train_loss"])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=HERE / "results.md")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    rows = []
    for rnd in range(1, args.rounds + 1):
        for setting, overrides in SETTINGS.items():
            sync = run(args.steps, *overrides, "optim.post_validate=false")
            post = run(args.steps, *overrides, "optim.post_validate=true")
            rows.append((rnd, setting, sync, post))
            print(f"round {rnd}, {setting}: step {sync['step_s']:.3f} s -> {post['step_s']:.3f} s "
                  f"(x{post['step_s'] / sync['step_s']:.3f}), redone {post['redone']}/{args.steps}, "
                  f"final loss {sync['loss']:.6f} / {post['loss']:.6f}", flush=True)
    lines = [
        "# Optimizer post-validation against the synchronous step",
        "",
        f"Written by `python experiments/post_validation/run.py` on {datetime.datetime.now():%Y-%m-%d %H:%M} "
        f"(1-minute load {load:.1f} at the start). The main job's layout (t2·p2(v2)·d2, 8 gloo processes on 2 "
        f"cores) and p4 zbv (4 processes), {args.steps} steps, no validation; step time = the median of "
        f"metrics.csv's step_time_s over steps 6-{args.steps}; optimizer and dp_comm = rank 0's profiled step "
        f"{PROFILED}. The post-validated steps read their checks during the next step (docs/precision.md).",
        "",
        "| round | setting | step, synchronous (s) | step, post-validated (s) | post / sync | steps redone "
        "| optimizer, sync / post (ms) | dp_comm, sync / post (ms) | final train loss, sync / post |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rnd, setting, sync, post in rows:
        lines.append(f"| {rnd} | {setting} | {sync['step_s']:.3f} | {post['step_s']:.3f} | "
                     f"{post['step_s'] / sync['step_s']:.3f} | {post['redone']} of {args.steps} | "
                     f"{1e3 * sync['optimizer_s']:.1f} / {1e3 * post['optimizer_s']:.1f} | "
                     f"{1e3 * sync['dp_comm_s']:.1f} / {1e3 * post['dp_comm_s']:.1f} | "
                     f"{sync['loss']:.9f} / {post['loss']:.9f} |")
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
