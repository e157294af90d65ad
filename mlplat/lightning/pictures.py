"""The pictures a run leaves beside its metrics.csv, drawn from it at the end of training (on rank 0), so a run read
without W&B (offline by default) still shows how it went: the loss curves of every run, and each MoE layer's expert
load for a model with experts. From the file, not from memory: a resumed run's picture holds the steps before it too.
"""
from __future__ import annotations

import csv
from pathlib import Path

LOSS_PICTURE = "loss.png"
EXPERT_LOAD_PICTURE = "expert_load.png"
# file -> what it shows, for the run summary's files line
PICTURES = {LOSS_PICTURE: "the loss curves per step", EXPERT_LOAD_PICTURE: "each MoE layer's expert load per step"}


def _rows(metrics: Path) -> list[dict]:
    with open(metrics, newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("step")]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless: CI boxes and compute nodes have no display
    import matplotlib.pyplot as plt

    return plt


def draw_pictures(metrics: Path) -> None:
    """The pictures metrics.csv's columns allow, beside it."""
    rows = _rows(metrics)
    if any(r.get("train_loss") for r in rows):
        draw_loss(rows, metrics.with_name(LOSS_PICTURE))
    if any(r.get("moe_load_max") for r in rows):
        draw_expert_load(rows, metrics.with_name(EXPERT_LOAD_PICTURE))


def _floats(rows: list[dict], column: str) -> tuple[list[int], list[float]]:
    kept = [r for r in rows if r.get(column) not in (None, "")]
    return [int(r["step"]) for r in kept], [float(r[column]) for r in kept]


def draw_loss(rows: list[dict], out: Path) -> None:
    """`out`: the training loss per step (and every other `*_loss` column the run wrote, e.g. the multi-token
    prediction depths'), validation loss where it was measured, the learning rate beneath."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, (top, below) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.plot(*_floats(rows, "train_loss"), label="train")
    others = [c for c in rows[0] if c.endswith("_loss") and c not in ("train_loss", "val_loss", "moe_aux_loss")]
    for column in others:
        top.plot(*_floats(rows, column), linewidth=0.8, label=column)
    val = _floats(rows, "val_loss")
    if val[0]:
        top.plot(*val, marker="o", label="validation")
    top.set_ylabel("loss")
    top.set_title("loss per step")
    top.legend(fontsize="small")
    lr = _floats(rows, "lr")
    if lr[0]:
        below.plot(*lr, color="grey")
    below.set_ylabel("learning rate")
    below.set_xlabel("step")
    below.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def draw_expert_load(rows: list[dict], out: Path) -> None:
    """`out`: per MoE layer over the steps of metrics.csv's `rows`, its most (solid) and least (dashed) loaded
    expert's share of the mean load, and below, under capacity, the share of its assignments dropped."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in rows if r.get("moe_load_max")]
    layers = [c.split("/layer")[1] for c in rows[0] if c.startswith("moe_load_max/")] if rows else []
    dropped = bool(rows) and f"moe_dropped/layer{layers[0]}" in rows[0]
    steps = [int(r["step"]) for r in rows]
    fig, axes = plt.subplots(2 if dropped else 1, 1, figsize=(9, 7 if dropped else 4.5), sharex=True, squeeze=False)
    top = axes[0][0]
    colours = plt.get_cmap("viridis")
    for k, i in enumerate(layers):
        colour = colours(k / max(1, len(layers) - 1))
        top.plot(steps, [float(r[f"moe_load_max/layer{i}"]) for r in rows], color=colour, label=f"layer {i}")
        top.plot(steps, [float(r[f"moe_load_min/layer{i}"]) for r in rows], color=colour, linestyle="--")
        if dropped:
            axes[1][0].plot(steps, [100 * float(r[f"moe_dropped/layer{i}"]) for r in rows], color=colour)
    top.axhline(1.0, color="grey", linewidth=0.8)
    top.set_ylabel("expert tokens / mean")
    top.set_title("expert load per layer: most (solid) and least (dashed) loaded expert; 1 = balanced")
    top.legend(fontsize="small", ncol=max(1, len(layers) // 12 + 1))
    if dropped:
        axes[1][0].set_ylabel("assignments dropped (%)")
    axes[-1][0].set_xlabel("step")
    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
