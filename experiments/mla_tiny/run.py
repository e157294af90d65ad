"""DeepSeek-V3's architecture in small against the main job: `python -m mlplat.train`, `python -m mlplat.train
model=mla_tiny` and the same under the V schedule (`parallel.schedule=zbv`), each from the command to its exit,
back to back, twice (the machine is shared: the jobs of a round see about the same load).

    python experiments/mla_tiny/run.py                 # ~9 minutes on 2 idle cores; prints the table
    python experiments/mla_tiny/run.py --write         # and rewrites results.md here
    python experiments/mla_tiny/run.py parallel.tp=1   # overrides for the mla_tiny jobs (printed, not written)

The ratios are each mla_tiny job's wall time over the main job's of the same round. mla_tiny's 3 layers and its
multi-token prediction module fill the default layout's 4 chunks one each (the split counts the module as a layer,
docs/mtp.md): interleaved, pipeline rank 1 holds the first MoE layer and the module's chunk; the V puts the module's
chunk on rank 0 beside the dense first layer and the embedding, and fills the bubble with the deferred weight
gradients. The summaries of the last round's jobs follow (mla_tiny's with its multi-token prediction losses and
expert loads).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ROUNDS = 2
MAIN: list[str] = []  # the main job: the defaults
MLA = ["model=mla_tiny"]
JOBS = {"main job": MAIN, "mla_tiny": MLA, "mla_tiny, zbv": [*MLA, "parallel.schedule=zbv"]}


def _job(overrides: list[str]) -> tuple[float, str]:
    """Wall seconds from the command to its exit, and the run summary."""
    run_dir = Path(tempfile.mkdtemp(prefix="mla-tiny-"))
    t0 = time.time()
    job = subprocess.run([sys.executable, "-m", "mlplat.train", f"hydra.run.dir={run_dir}", *overrides], cwd=REPO,
                         env=dict(os.environ, WANDB_MODE="offline"), check=True, capture_output=True, text=True)
    wall = time.time() - t0
    summary = job.stdout[job.stdout.index("--- run summary ---"):].split("\n--- sample ---")[0]
    return wall, "\n".join(line for line in summary.strip().splitlines() if not line.startswith("["))  # no log lines


def main(extra: list[str]) -> int:
    write = "--write" in extra
    extra = [e for e in extra if e != "--write"]
    rounds, summaries = [], {}
    for _ in range(ROUNDS):
        load = os.getloadavg()[0]
        wall = {}
        for name, overrides in JOBS.items():
            wall[name], summaries[name] = _job([*overrides, *(extra if name != "main job" else [])])
        rounds.append((load, wall))
        print(f"load {load:.1f}: " + ", ".join(f"{n} {s:.1f} s" for n, s in wall.items()), flush=True)
    lines = [
        "# mla_tiny against the main job",
        "",
        f"Written by `python experiments/mla_tiny/run.py --write{''.join(' ' + e for e in extra)}` on "
        f"{time.strftime('%Y-%m-%d %H:%M')}, "
        f"{os.cpu_count()} cores. Each round: `python -m mlplat.train`, then `python -m mlplat.train model=mla_tiny`, "
        "then the same with `parallel.schedule=zbv`, from the command to its exit (W&B offline), back to back.",
        "",
        "| round | load average (1 min) at its start | main job | mla_tiny | / main job | mla_tiny, zbv | / main job |",
        "|---|---|---|---|---|---|---|",
        *[f"| {i} | {load:.1f} | {w['main job']:.1f} s | {w['mla_tiny']:.1f} s | "
          f"**{w['mla_tiny'] / w['main job']:.2f}** | {w['mla_tiny, zbv']:.1f} s | "
          f"**{w['mla_tiny, zbv'] / w['main job']:.2f}** |" for i, (load, w) in enumerate(rounds, start=1)],
        "",
    ]
    for name, summary in summaries.items():
        lines += [f"{name}, the last round's summary:", "", "```text", summary, "```", ""]
    print("\n".join(lines))
    if write and not extra:
        (HERE / "results.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
