"""What `profile.steps` costs: the main job with steps 21-40 profiled, their step times against the others'.

    python experiments/profile_overhead/run.py        # ~1.5 minutes on 2 cores; writes results.md here

One run of `python -m mlplat.train` (the default 3D layout, t2·p2(v2)·d2 on 8 CPU processes) for 60 steps with
`profile.steps=[21,40]`. From its metrics.csv: the median `step_time_s` of the profiled steps 21-40 and of the
unprofiled steps 2-20 and 42-60 (step 41 carries the one-time writing of the profile files, reported apart),
and their ratio; also how much of each profiled step the breakdown's columns account for.
"""
from __future__ import annotations

import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FIRST, LAST, STEPS = 21, 40, 60
COLUMNS = ("compute", "bubble", "tp_comm", "dp_comm", "recompute", "optimizer", "data", "loop")


def main() -> int:
    run_dir = Path(tempfile.mkdtemp(prefix="profile-overhead-"))
    load_before = os.getloadavg()[0]
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "mlplat.train", f"hydra.run.dir={run_dir}", f"trainer.max_steps={STEPS}",
                    f"profile.steps=[{FIRST},{LAST}]", "logger=none", "sample.max_new_tokens=0",
                    "trainer.limit_val_batches=0"], cwd=REPO, check=True, capture_output=True)
    wall = time.time() - t0
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    time_of = lambda s: float(rows[s]["step_time_s"])  # noqa: E731
    profiled = [time_of(s) for s in range(FIRST, LAST + 1)]
    plain = [time_of(s) for s in [*range(2, FIRST), *range(LAST + 2, STEPS + 1)]]
    cover = [sum(float(rows[s][f"time_{c}_s"]) for c in COLUMNS) / time_of(s) for s in range(FIRST, LAST + 1)]
    ratio = statistics.median(profiled) / statistics.median(plain)
    lines = [
        "# The cost of profile.steps",
        "",
        f"Written by `python experiments/profile_overhead/run.py` on {time.strftime('%Y-%m-%d %H:%M')}: the main "
        f"job (t2·p2(v2)·d2, 8 CPU processes on {os.cpu_count()} cores) for {STEPS} steps with "
        f"profile.steps=[{FIRST},{LAST}]; {wall:.0f} s; load average (1 min) {load_before:.1f} at the start.",
        "",
        "| steps | median step_time_s | min | max |",
        "|---|---|---|---|",
        f"| profiled ({FIRST}-{LAST}) | {statistics.median(profiled):.4f} | {min(profiled):.4f} | "
        f"{max(profiled):.4f} |",
        f"| unprofiled (2-{FIRST - 1}, {LAST + 2}-{STEPS}) | {statistics.median(plain):.4f} | {min(plain):.4f} | "
        f"{max(plain):.4f} |",
        "",
        f"**Profiled / unprofiled: {ratio:.3f}.** Step {LAST + 1}, which writes the profile files (rank JSON, "
        f"trace.json, timeline.png, report.md), took {time_of(LAST + 1):.3f} s.",
        "",
        f"The breakdown's columns account for {min(cover):.1%} to {max(cover):.1%} of each profiled step's "
        f"step_time_s (median {statistics.median(cover):.1%}).",
    ]
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
