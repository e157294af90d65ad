"""A profiled run's files: the Chrome trace of every rank, the measured timeline above the simulated one, and a
report comparing the measured step with the simulator's prediction calibrated by the measured durations.

Input: one `rank-K.json` per rank under DIR/profile/, written by the training callback
(`mlplat.lightning.profiling`): {rank, coords [t, p, d] (or [t, p, d, c] with context parallelism), offset (s,
added to align the clocks), steps [[step, start, end], ...], spans [[name, category, start, end, args], ...],
breakdown {step: {category: s}}}.
The columns and the trace's lanes are `mlplat.parallel.profile.CATEGORIES` (cp_comm among them: the ring of context
parallelism); a category missing from an older file's breakdown reads 0.
"""
from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

from mlplat.parallel.layout.dims import coords_label
from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.parallel.layout.schedules import Op, build_schedule
from mlplat.parallel.profile import CATEGORIES
from mlplat.perf.simulator import CostModel, Event, SimResult, simulate_nccl

# Up to this many ranks, the trace holds every rank; beyond, rank 0 reads only the files of the pipeline it draws
# (thousands of span files read on one rank while the others wait would take many minutes); each file stays there.
TRACE_ALL_RANKS = 64


def load_ranks(folder: Path, only: list[int] | None = None) -> list[dict]:
    """The rank files of `folder`: every one, or those of the global ranks `only`."""
    paths = (sorted(Path(folder).glob("rank-*.json")) if only is None
             else [Path(folder) / f"rank-{k}.json" for k in only])
    return sorted((json.loads(p.read_text()) for p in paths), key=lambda r: r["rank"])


def chrome_trace(ranks: list[dict]) -> dict:
    """Chrome trace format (Perfetto, chrome://tracing): one process per rank, one thread per category."""
    origin = min(r["steps"][0][1] + r["offset"] for r in ranks if r["steps"])
    events = []
    for r in ranks:
        t, p, d, *c = r["coords"]
        where = coords_label(t, p, d, c[0] if c else None)
        events.append({"ph": "M", "name": "process_name", "pid": r["rank"],
                       "args": {"name": f"rank {r['rank']} ({where})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r["rank"], "args": {"sort_index": r["rank"]}})
        for i, cat in enumerate(CATEGORIES):
            events.append({"ph": "M", "name": "thread_name", "pid": r["rank"], "tid": i, "args": {"name": cat}})
        for step, start, end in r["steps"]:
            events.append({"ph": "X", "name": f"step {step}", "cat": "step", "pid": r["rank"], "tid": len(CATEGORIES),
                           "ts": (start + r["offset"] - origin) * 1e6, "dur": (end - start) * 1e6})
        for name, cat, start, end, args in r["spans"]:
            events.append({"ph": "X", "name": name, "cat": cat, "pid": r["rank"], "tid": CATEGORIES.index(cat),
                           "ts": (start + r["offset"] - origin) * 1e6, "dur": (end - start) * 1e6, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _pipeline(ranks: list[dict]) -> list[dict]:
    """The ranks of the pipeline drawn and compared: tensor-, data- (and context-) parallel rank 0, in pipeline
    order."""
    return sorted((r for r in ranks if r["coords"][0] == 0 and r["coords"][2] == 0 and not any(r["coords"][3:])),
                  key=lambda r: r["coords"][1])


def measured_pipeline(ranks: list[dict], step: int, layout: PipelineLayout) -> SimResult:
    """The F/B/W spans of one step on the pipeline's ranks, as a SimResult (times from the step's first compute)."""
    events = []
    for r in _pipeline(ranks):
        (_, start, end), = [s for s in r["steps"] if s[0] == step]
        for name, cat, s0, s1, args in r["spans"]:
            if cat == "compute" and start <= s0 and s1 <= end:
                events.append(Event(r["coords"][1], Op(args["op"]), args["chunk"], args["micro_batch"],
                                    s0 + r["offset"], s1 + r["offset"]))
    origin = min(e.start for e in events)
    for e in events:
        e.start, e.end = e.start - origin, e.end - origin
    step_time = max(e.end for e in events)
    busy = [sum(e.end - e.start for e in events if e.rank == p) for p in range(layout.pp)]
    return SimResult(step_time=step_time, bubble_fraction=(step_time - max(busy)) / max(busy), events=events,
                     peak_in_flight=[], peak_in_flight_micro_batches=[])


def calibrated_simulation(ranks: list[dict], layout: PipelineLayout, m: int) -> SimResult:
    """simulate_nccl of the run's schedule with each (rank, chunk, op)'s mean measured duration, free transfers."""
    durations: dict[tuple[str, int], list[float]] = {}
    for r in _pipeline(ranks):
        for name, cat, s0, s1, args in r["spans"]:
            if cat == "compute":
                durations.setdefault((args["op"], args["chunk"]), []).append(s1 - s0)
    cost = {key: mean(vals) for key, vals in durations.items()}
    model = CostModel(forward=lambda rank, c, mb: cost[("F", c)], backward=lambda rank, c, mb: cost[("B", c)],
                      weight=lambda rank, c, mb: cost.get(("W", c), 0.0))
    return simulate_nccl(build_schedule(layout.schedule, layout.pp, layout.vpp, m), model, layout.vpp)


IN_THE_BOXES = ("compute", "tp_comm", "cp_comm", "recompute")  # run inside an F/B/W span; the rest between them


def where_the_step_went(parts: dict[str, float]) -> str:
    """A step's breakdown as a timeline's boxes and gaps show it, largest first, as shares of the step:
    `bubble 11%, dp_comm 6% between the boxes;` and, on a line of its own, `tp_comm 65%, compute 15% inside them`."""
    total = sum(parts.values()) or 1.0

    def shares(inside: bool) -> str:
        kept = [c for c in parts if (c in IN_THE_BOXES) == inside and parts[c] / total >= 0.005]
        return ", ".join(f"{c} {parts[c] / total:.0%}" for c in sorted(kept, key=lambda c: -parts[c]))
    return f"{shares(False) or 'nothing'} between the boxes;\n{shares(True)} inside them"


def draw(measured: SimResult, simulated: SimResult, layout: PipelineLayout, path: Path, title: str,
         ranks: list[dict] | None = None, step: int | None = None) -> None:
    """The measured pipeline above the simulated one; with the rank files (`ranks`), the measured rows name their
    global ranks and the legend says where `step`'s time went on rank 0: between the boxes (the white: waits on a
    neighbour, the end-of-step reductions, the optimizer, the data) and inside them (the collectives an F/B runs)."""
    import matplotlib.pyplot as plt

    from mlplat.perf.timeline import plot_timeline

    p, v = layout.pp, layout.vpp
    names, gaps = None, None
    if ranks is not None:
        names = [f"pipeline rank {r['coords'][1]} (rank {r['rank']})" for r in _pipeline(ranks)]
        parts = ranks[0]["breakdown"].get(str(step))
        gaps = f"rank 0's step {step}: {where_the_step_went(parts)}" if parts else None
    width = max(8.0, 14.0 * max(measured.step_time, simulated.step_time) / max(simulated.step_time, 1e-9) / 1.5)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(width, 2 * (0.45 * p + 1.4) + 0.8))
    plot_timeline(measured, p, v, ax=top, title=f"measured: {title}, pipeline {measured.step_time * 1e3:.1f} ms, "
                                                 f"bubble {measured.bubble_fraction:.1%}", rank_labels=names,
                  gaps=gaps)
    plot_timeline(simulated, p, v, ax=bottom, title=f"simulated with the measured durations: pipeline "
                                                    f"{simulated.step_time * 1e3:.1f} ms, bubble "
                                                    f"{simulated.bubble_fraction:.1%}", rank_labels=names,
                  gaps="waiting on a neighbour (the bubble): transfers are free here")
    limit = max(measured.step_time, simulated.step_time)
    for ax in (top, bottom):
        ax.set_xlim(0, limit)
        ax.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_profile(folder: Path, layout: PipelineLayout, m: int, title: str,
                  pipeline_ranks: list[int] | None = None) -> dict:
    """trace.json, timeline.png and report.md from the rank files in `folder`; returns the report's figures.
    `pipeline_ranks`: the global ranks of the pipeline drawn (rank 0's), the only files read (None: all)."""
    folder = Path(folder)
    ranks = load_ranks(folder, pipeline_ranks)
    (folder / "trace.json").write_text(json.dumps(chrome_trace(ranks)))
    steps = [s[0] for s in ranks[0]["steps"]]
    simulated = calibrated_simulation(ranks, layout, m)
    measured = {step: measured_pipeline(ranks, step, layout) for step in steps}
    last = steps[-1]
    draw(measured[last], simulated, layout, folder / "timeline.png", f"step {last}, {title}", ranks, last)
    lines = [f"# Profile: {title}", "",
             f"Steps {steps[0]}-{steps[-1]}, {len(ranks)} ranks"
             + (" (rank 0's pipeline: beyond " + f"{TRACE_ALL_RANKS} ranks only its files are read, each rank's own "
                "rank-K.json is beside this)" if pipeline_ranks is not None else "")
             + "; trace.json opens in https://ui.perfetto.dev.", "",
             "## Step time, by where it went (rank 0, seconds)", "",
             "| step | measured step | " + " | ".join(CATEGORIES) + " | sum of the columns | sum / measured |",
             "|" + "---|" * (len(CATEGORIES) + 4)]
    figures: dict = {"steps": {}}
    for step, start, end in ranks[0]["steps"]:
        parts = ranks[0]["breakdown"][str(step)]
        total = sum(parts.values())
        lines.append(f"| {step} | {end - start:.4f} | " + " | ".join(f"{parts.get(c, 0.0):.4f}" for c in CATEGORIES)
                     + f" | {total:.4f} | {total / (end - start):.3f} |")
        figures["steps"][step] = {"measured": end - start, **{c: 0.0 for c in CATEGORIES}, **parts}
    lines += ["", "## The pipeline, measured against the simulator", "",
              "The simulator runs the same schedule (the engine's exchange plans under NCCL's rules) with each "
              "chunk's mean measured forward, backward and W durations and free transfers; what the measured "
              "pipeline takes beyond it is transfer time and per-instruction overhead.", "",
              "| step | measured pipeline (s) | simulated (s) | measured / simulated | measured bubble | simulated "
              "bubble |", "|---|---|---|---|---|---|"]
    for step in steps:
        res = measured[step]
        lines.append(f"| {step} | {res.step_time:.4f} | {simulated.step_time:.4f} | "
                     f"{res.step_time / simulated.step_time:.3f} | {res.bubble_fraction:.1%} | "
                     f"{simulated.bubble_fraction:.1%} |")
        figures["steps"][step]["pipeline_measured"] = res.step_time
    figures["pipeline_simulated"] = simulated.step_time
    (folder / "report.md").write_text("\n".join(lines) + "\n")
    return figures
