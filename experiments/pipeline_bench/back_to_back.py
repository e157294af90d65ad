"""The pipeline engine's steps back to back: nothing global between them, ZB-H1, ZB-H2 and ZB-V against 1F1B.

    python experiments/pipeline_bench/back_to_back.py          # ~8.5 minutes on 2 cores; writes back_to_back.md here
    python experiments/pipeline_bench/back_to_back.py --steps 8 --rounds 2 --no-torch --out /tmp/b.md

bench.py times one step at a time, with a barrier before each. A training step ends the same way: every rank
waits in the all-reduces of the gradient norm, the overflow flag and the logged loss, so no step starts before the
last rank has finished the one before. ZB-V then keeps its start-up wait in every step: rank r waits r chunk
forwards for its first input, (p-1)/(6m) of the step, and ZB-H2 (whose extra forwards keep a rank busy from its
first F to its last W) has ZB-H1's (p-1)/(3m). Here each rank runs K steps of bench.py's sleep stages
(F = B = W = tf/v per chunk, p = 4 unless --p) one after the other with no barrier between them, as a run whose steps
share nothing global would. The previous step's tail can then fill the next one's start.

Figures, per run (median over rounds):
  * period: the latest end of step K minus the latest end of step 1, over K - 1 (each rank stamps its step ends
    on the machine's one monotonic clock);
  * one step: the latest end of step 1 minus the earliest start;
  * simulated: `mlplat.perf.simulator.steady_state_step` on the same instruction lists at the nominal costs, under
    the ideal transport and under the engine's exchange plans on NCCL's rules, and `simulate` for one step;
  * speed-up over 1F1B back to back, against the bound: (m + p - 1)/m, 1F1B's step over the work of a rank;
  * torch.distributed.pipelining's Schedule1F1B and ScheduleZBVZeroBubble on the same stages, run back to back
    the same way in the same rounds (bench.py's `_torch_schedule`), and mlplat / torch.
Training runs its steps this way under optimizer post-validation (optim.post_validate=true, docs/precision.md):
the all-reduces of a step are read during the next one. What this leaves out is the rest of a training step on each
rank (its data-parallel reduction and its optimizer arithmetic), which no rank waits on another rank for.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _bench_module():
    """bench.py beside this file, under a name of its own (other experiments have a bench.py too)."""
    name = "pipeline_bench_bench"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "bench.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)  # its dataclasses look their module up there
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


_bench = _bench_module()
ComputeLog, Setup, _cost_model, _data = _bench.ComputeLog, _bench.Setup, _bench._cost_model, _bench._data
_mlplat_engine, _mlplat_steps, _setup = _bench._mlplat_engine, _bench._mlplat_steps, _bench._setup
_torch_schedule, TORCH_PEERS = _bench._torch_schedule, _bench.TORCH_PEERS

from mlplat.harness.launch import launch as run_distributed  # noqa: E402
from mlplat.parallel.grid import ParallelGrid  # noqa: E402
from mlplat.parallel.layout.schedules import build_schedule  # noqa: E402
from mlplat.perf.simulator import simulate, simulate_nccl, steady_state_step  # noqa: E402

RUNS = (("1f1b", "1f1b", 1), ("zb_h1", "zb_h1", 1), ("zb_h2", "zb_h2", 1), ("zbv", "zbv", 2))
TORCH = ("1f1b", "zbv")  # also run back to back by their torch.distributed.pipelining peers (bench.TORCH_PEERS)
COMMAND = "python experiments/pipeline_bench/back_to_back.py"


def _group(rank: int, world: int, s: dict, ms: list[int], steps: int, rounds: int, torch_peers: bool) -> dict:
    """Every (run, m) in one process group, taking turns round by round; per round each rank's step ends. The
    torch peers run in a group of their own with a short collective timeout, so a hang in their p2p fails."""
    s = _setup(s)
    grid = ParallelGrid(tp=1, pp=s.p, dp=1)
    log = ComputeLog()
    keys = [(label, kind, v, m) for m in ms for label, kind, v in RUNS]
    run = {key: _mlplat_steps(_mlplat_engine(s, grid, key[1], key[2], log), *_data(s, key[3]), s, log)
           for key in keys}
    if torch_peers:
        group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=s.op_timeout_s))
        for label, kind, v, m in list(keys):
            if label in TORCH:
                key = (f"torch {label}", kind, v, m)
                run[key] = _torch_schedule(s, rank, TORCH_PEERS[label], kind, v, m, group, {})
                keys.append(key)
    out = {(label, m): [] for label, _, _, m in keys}
    for rnd in range(1 + rounds):  # round 0 warms up
        for key in keys[rnd % len(keys):] + keys[: rnd % len(keys)]:
            dist.barrier()
            stamps = [time.perf_counter()]
            for _ in range(steps):
                run[key]()
                stamps.append(time.perf_counter())
            every = [torch.empty(steps + 1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, torch.tensor(stamps, dtype=torch.float64))
            if rnd > 0:
                ends = [max(float(t[k]) for t in every) for k in range(1, steps + 1)]
                start = min(float(t[0]) for t in every)
                out[(key[0], key[3])].append((ends[0] - start, (ends[-1] - ends[0]) / (steps - 1)))
    return out


def simulated(s: Setup, kind: str, v: int, m: int) -> tuple[float, float, float]:
    """(one step, back to back under the ideal transport, back to back under NCCL's rules) at nominal costs."""
    cost = _cost_model(kind, s.tf / v, s.tb_input / v, s.tw / v, 0.0)
    sched = build_schedule(kind, s.p, v, m)
    return (simulate(sched, cost, v).step_time, steady_state_step(sched, cost, v),
            steady_state_step(sched, cost, v, simulate_nccl))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tf", type=float, default=0.05, help="forward seconds per pipeline stage per micro-batch")
    ap.add_argument("--p", type=int, default=4, help="pipeline stages (one process each)")
    ap.add_argument("--m", type=int, nargs="*", default=[8, 16], help="numbers of micro-batches")
    ap.add_argument("--steps", type=int, default=5, help="steps back to back per timed run (K)")
    ap.add_argument("--rounds", type=int, default=3, help="timed runs per schedule (after one warm-up)")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining's peers")
    ap.add_argument("--out", default=str(HERE / "back_to_back.md"), help="markdown file to write ('' = none)")
    args = ap.parse_args(argv)
    s = Setup(p=args.p, tf=args.tf)
    load = os.getloadavg()[0]
    t0 = time.time()
    work = {m: m * (s.tf + s.tb) for m in args.m}
    budget = 120 + 3 * (1 + args.rounds) * args.steps * sum((m + s.p - 1) * (s.tf + s.tb) for m in args.m) * 3
    res = run_distributed(_group, s.p, asdict(s), list(args.m), args.steps, args.rounds, not args.no_torch,
                          timeout=budget * (1.5 if not args.no_torch else 1.0))[0]
    wall = time.time() - t0
    med = statistics.median
    lines = [
        "# The pipeline engine's steps back to back",
        "",
        f"Written by `{' '.join([COMMAND, *(argv if argv is not None else sys.argv[1:])]).strip()}` on "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M} in {wall:.0f} s (1-minute load {load:.1f} at the start). "
        f"p={s.p}, stage forward tf={s.tf * 1e3:.0f} ms, B = W = tf (each of a rank's v chunks: tf/v), gloo, "
        f"{s.p} processes; {args.steps} steps back to back per run, medians over {args.rounds} runs. See the "
        "docstring of back_to_back.py for what is measured.",
        "",
        "| schedule | m | work per rank (s) | one step: simulated / measured (s) | back to back, simulated: ideal / "
        "NCCL (s) | back to back, measured period (s) | measured / simulated (NCCL) | speed-up over 1F1B back to "
        "back: simulated / measured | bound (m+p-1)/m | share of the bound's gain, measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in args.m:
        base = med(p for _, p in res[("1f1b", m)])
        sim_base = simulated(s, "1f1b", 1, m)[2]
        bound = (m + s.p - 1) / m
        for label, kind, v in RUNS:
            one_sim, ideal, nccl = simulated(s, kind, v, m)
            one = med(o for o, _ in res[(label, m)])
            period = med(p for _, p in res[(label, m)])
            speed = base / period
            lines.append(
                f"| {label} | {m} | {work[m]:.3f} | {one_sim:.3f} / {one:.3f} | {ideal:.3f} / {nccl:.3f} | "
                f"{period:.3f} | {period / nccl:.3f} | "
                + (f"{sim_base / nccl:.4f} / {speed:.4f} | {bound:.4f} | {(speed - 1) / (bound - 1):.1%} |"
                   if label != "1f1b" else "- | - | - |"))
    if not args.no_torch:
        lines += ["", f"Against torch.distributed.pipelining ({torch.__version__}), its schedules run back to back "
                  "the same way in the same rounds: mlplat / torch <= 1 means mlplat is no slower.", "",
                  "| schedule (torch's peer) | m | mlplat period (s) | torch period (s) | mlplat / torch | "
                  "one step: mlplat / torch (s) |", "|---|---|---|---|---|---|"]
        for m in args.m:
            for label in TORCH:
                ours, theirs = res[(label, m)], res[(f"torch {label}", m)]
                a, b = med(p for _, p in ours), med(p for _, p in theirs)
                lines.append(f"| {label} ({TORCH_PEERS[label]}) | {m} | {a:.3f} | {b:.3f} | {a / b:.3f} | "
                             f"{med(o for o, _ in ours):.3f} / {med(o for o, _ in theirs):.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
