"""Print a markdown table of simulated bubble fractions and peak activations for the three schedules.

    python experiments/schedules/bubble_table.py [--transfer 0.05]

Costs are per whole pipeline stage (forward 1, backward 2), split evenly over the v chunks of a rank,
so step times compare across v. With free transfers the simulated bubble equals the paper's formula;
the last columns repeat the step with a fixed time per message, which interleaving pays v times as often.
"""

from __future__ import annotations

import argparse

from mlplat.parallel.layout.schedules import build_schedule
from mlplat.perf.simulator import CostModel, simulate

CONFIGS = [
    ("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("interleaved", 4, 2, 8), ("interleaved", 4, 4, 8),
    ("gpipe", 8, 1, 16), ("1f1b", 8, 1, 16), ("interleaved", 8, 2, 16), ("interleaved", 8, 4, 16),
    ("1f1b", 8, 1, 64), ("interleaved", 8, 2, 64), ("interleaved", 8, 4, 64),
]


def row(kind: str, p: int, v: int, m: int, transfer: float) -> str:
    sched = build_schedule(kind, p, v, m)
    free = simulate(sched, CostModel(forward=1.0 / v, backward=2.0 / v, transfer=0.0), v)
    paid = simulate(sched, CostModel(forward=1.0 / v, backward=2.0 / v, transfer=transfer), v)
    paper = (p - 1) / (m * (v if kind == "interleaved" else 1))
    peak = free.peak_in_flight
    return (f"| {kind} | {p} | {v} | {m} | {paper:.4f} | {free.bubble_fraction:.4f} | {free.step_time:g} "
            f"| {peak[0]} / {peak[-1]} | {free.peak_in_flight_micro_batches[0]:g} "
            f"| {paid.bubble_fraction:.4f} | {paid.step_time:g} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transfer", type=float, default=0.05, help="seconds per message for the last columns")
    args = ap.parse_args()
    print("| schedule | p | v | m | paper bubble | simulated bubble | step time "
          "| peak chunk acts rank 0 / rank p-1 | peak micro-batches rank 0 "
          f"| bubble, transfer={args.transfer:g} | step time, transfer={args.transfer:g} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for cfg in CONFIGS:
        print(row(*cfg, transfer=args.transfer))


if __name__ == "__main__":
    main()
