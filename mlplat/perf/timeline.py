"""Timeline plot of a simulated pipeline schedule, drawn like Figure 4 of the paper.

Pipeline ranks are rows (pipeline rank 0 on top; a profile names each row's global rank too), time runs to the
right, each F/B box carries its micro-batch number (from 1, as in the paper); forwards are blue, backwards green,
and a rank's model chunks are told apart by shade (dark = its first chunk, lighter = later ones). White is time a
rank runs no F/B/W: in a simulation it waits on a neighbour (the bubble); in a profile also on collectives, the
optimizer or the data, and its legend says how the step divides (`gaps`).

    python -m mlplat.perf.timeline --schedule interleaved -p 4 -v 2 -m 8 -o out.png
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")  # headless: CI boxes and compute nodes have no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from mlplat.parallel.layout import registry  # noqa: E402
from mlplat.parallel.layout.schedules import Op, build_schedule  # noqa: E402
from mlplat.perf.simulator import CostModel, SimResult, simulate_nccl  # noqa: E402

_COLORS = {Op.FORWARD: ("Blues", "forward"), Op.BACKWARD: ("Greens", "backward"),
           Op.WEIGHT: ("Oranges", "weight gradients (W)")}


def _shade(cmap_name: str, slot: int, v: int):
    # Keep away from the colormap's near-white end so labels stay readable on every shade.
    cmap = plt.get_cmap(cmap_name)
    return cmap(0.8 - (0.45 * slot / (v - 1) if v > 1 else 0.0))


def plot_timeline(result: SimResult, p: int, v: int, ax=None, title: str | None = None, labels: bool = True,
                  rank_labels: list[str] | None = None, gaps: str | None = None):
    """Draw the F/B events of `result` onto `ax` (a new figure if None); return the axes. `rank_labels`: the rows'
    names (default `pipeline rank r`); `gaps`: what the white time holds, for the legend (default: its causes)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(max(8.0, 0.25 * result.step_time + 2), 0.45 * p + 1.4))
    for e in result.compute_events():
        slot = e.chunk // p  # index of the chunk among the rank's v chunks
        color = _shade(_COLORS[e.op][0], slot, v)
        ax.add_patch(Rectangle((e.start, e.rank - 0.4), e.end - e.start, 0.8,
                               facecolor=color, edgecolor="black", linewidth=0.4))
        if labels and e.end > e.start:
            ax.text((e.start + e.end) / 2, e.rank, str(e.micro_batch + 1), ha="center", va="center",
                    fontsize=7, color="white" if slot == 0 else "black")
    ax.set_xlim(0, result.step_time)
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top, like the paper
    ax.set_yticks(range(p))
    ax.set_yticklabels(rank_labels or [f"pipeline rank {r}" for r in range(p)])
    ax.set_xlabel("time")
    handles = []
    ops_drawn = {e.op for e in result.compute_events()}
    for op, (cmap, name) in _COLORS.items():
        if op not in ops_drawn:
            continue
        for slot in range(v):
            label = name if v == 1 else f"{name}, chunk {slot + 1} of rank"
            handles.append(Patch(facecolor=_shade(cmap, slot, v), edgecolor="black", label=label))
    handles.append(Patch(facecolor="white", edgecolor="lightgray",
                         label=f"no F/B/W: {gaps or 'waiting on a neighbour (the bubble)'}"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.3 if p <= 4 else -0.18),
              ncol=len(handles), fontsize=8, frameon=False,
              title="the number in a box is its micro-batch (from 1)", title_fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def draw_schedule(kind: str, p: int, v: int, m: int, path: str, cost: CostModel | None = None) -> SimResult:
    """Build, simulate and draw a schedule to `path` (PNG, SVG, ... by extension)."""
    cost = cost or CostModel()
    result = simulate_nccl(build_schedule(kind, p, v, m), cost, v)
    if result.deadlock:
        raise RuntimeError(f"{kind} p={p} v={v} m={m} deadlocks; stuck: {result.stuck}")
    spec = registry.get(kind)
    title = (f"{spec.label}, p={p}, v={v}, m={m}: bubble {result.bubble_fraction:.1%} "
             f"(paper: {spec.bubble(p, v, m):.1%}), peak activations on rank 0: "
             f"{result.peak_in_flight_micro_batches[0]:g} micro-batches")
    ax = plot_timeline(result, p, v, title=title)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=150, bbox_inches="tight")  # keep the legend below, crop the rest
    plt.close(ax.figure)
    return result


def _backward_default(args) -> float:
    if args.backward is not None:
        return args.backward
    return 1.0 if registry.get(args.schedule).split_backward else 2.0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Draw a pipeline schedule's simulated timeline.")
    ap.add_argument("--schedule", choices=registry.names(), default="interleaved")
    ap.add_argument("-p", type=int, default=4, help="pipeline-parallel size (parallel.pp)")
    ap.add_argument("-v", type=int, default=1, help="virtual stages per rank (parallel.vpp)")
    ap.add_argument("-m", type=int, default=8, help="micro-batches per pipeline per iteration")
    ap.add_argument("-o", "--output", default="timeline.png")
    ap.add_argument("--forward", type=float, default=1.0, help="forward time of one chunk")
    ap.add_argument("--backward", type=float, default=None,
                    help="backward time of one chunk (default 2; zero-bubble schedules: B alone, default 1)")
    ap.add_argument("--weight", type=float, default=1.0, help="W time of one chunk (zero-bubble schedules)")
    ap.add_argument("--transfer", type=float, default=0.0, help="time for a message between ranks")
    ap.add_argument("--hidden", type=float, default=0.0,
                    help="what a pair of a schedule that pairs passes hides (1f1b_overlap: its all-to-alls)")
    args = ap.parse_args(argv)
    try:
        result = draw_schedule(args.schedule, args.p, args.v, args.m, args.output,
                               CostModel(args.forward, _backward_default(args), args.transfer, args.weight,
                                         args.hidden))
    except ValueError as err:
        ap.error(str(err))
    print(f"{args.output}: step time {result.step_time:g}, bubble {result.bubble_fraction:.4f}, "
          f"peak in-flight chunk activations per rank {result.peak_in_flight}")


if __name__ == "__main__":
    main()
