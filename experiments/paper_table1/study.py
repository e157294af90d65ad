"""Two of the paper's studies, predicted by mlplat's cost model on simulated DGX A100 nodes.

    python experiments/paper_table1/study.py     # writes fig12_interleaved_vs_1f1b.png, fig13_tp_vs_pp.png, study.md

Fig. 12-like: a GPT-3-175B-shaped model (96 layers, h = 12288, 96 heads) on 96 GPUs, t = 8, p = 12, d = 1,
micro-batch 1: throughput of the 1F1B and the interleaved (v = 2) schedules as the batch grows.
Fig. 13-like: the same model on 64 GPUs, d = 1, micro-batch 1: every split t × p = 64, for three batch
sizes (t = 16 and 32 put tensor parallelism across nodes, over InfiniBand).
Both use the paper's setup (fp16 weights + fp32 master, fused softmax attention, full recomputation) and
count executed FLOPs (the 96·B·s·l·h² formula) as the paper does.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mlplat.perf.cluster import Cluster, predict  # noqa: E402
from mlplat.perf.flops import ModelDims, hardware_flops_per_iteration  # noqa: E402
from mlplat.perf.memory import Layout, memory_per_stage  # noqa: E402
from mlplat.plan import load_group  # noqa: E402

HERE = Path(__file__).resolve().parent
GPT3 = ModelDims(n_layers=96, hidden=12288, n_heads=96, seq_len=2048, vocab_size=51200)
PAPER = dict(precision="16-megatron", attention="unfused", fused=True, recompute="full")


def tflops(lay: Layout, cl: Cluster) -> tuple[float, float, float]:
    """(TFLOP/s per GPU, bubble fraction, worst memory GiB)."""
    pred = predict(GPT3, lay, cl)
    hw = hardware_flops_per_iteration(GPT3, lay.global_batch_size, lay.recompute, lay.tp)
    mem = max(r.total for r in memory_per_stage(GPT3, lay, overhead_bytes=cl.overhead_gib * 2**30)) / 2**30
    return hw / pred.seconds_per_iteration / lay.gpus / 1e12, pred.bubble_fraction, mem


def fig12(cl: Cluster) -> list[str]:
    batches = list(range(12, 132, 12))
    rows = ["| batch | m | 1F1B TFLOP/s | bubble | interleaved (v=2) TFLOP/s | bubble | gain "
            "| memory GiB (1F1B / interleaved) |",
            "|---|---|---|---|---|---|---|---|"]
    a, b = [], []
    for B in batches:
        common = dict(tp=8, pp=12, dp=1, micro_batch_size=1, global_batch_size=B, **PAPER)
        base = Layout(vpp=1, schedule="1f1b", **common)
        inter = Layout(vpp=2, schedule="interleaved", **common)
        (x, bx, mx), (y, by, my) = tflops(base, cl), tflops(inter, cl)
        a.append(x)
        b.append(y)
        rows.append(f"| {B} | {B} | {x:.1f} | {bx:.3f} | {y:.1f} | {by:.3f} | {y / x - 1:+.1%} | {mx:.0f} / {my:.0f} |")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, a, "o-", label="non-interleaved (1F1B)")
    ax.plot(batches, b, "s-", label="interleaved 1F1B, v = 2")
    ax.set_xlabel("batch size")
    ax.set_ylabel("predicted TFLOP/s per GPU")
    ax.set_title("GPT-3 175B, 96 A100s, t=8 p=12 (cf. paper Fig. 12)")
    ax.set_ylim(0, 200)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "fig12_interleaved_vs_1f1b.png", dpi=120)
    plt.close(fig)
    return rows


def fig13(cl: Cluster) -> tuple[list[str], dict]:
    splits = [(2, 32), (4, 16), (8, 8), (16, 4), (32, 2)]
    batches = [32, 128, 512]
    rows = ["| (t, p) | " + " | ".join(f"batch {B} TFLOP/s (bubble)" for B in batches) + " | memory GiB (batch 32) |",
            "|---|" + "---|" * (len(batches) + 1)]
    data = {}
    for t, p in splits:
        cells, mem = [], 0.0
        for B in batches:
            lay = Layout(tp=t, pp=p, vpp=1, dp=1, micro_batch_size=1, global_batch_size=B, schedule="1f1b", **PAPER)
            x, bub, m = tflops(lay, cl)
            mem = mem or m
            data[(t, p, B)] = x
            cells.append(f"{x:.1f} ({bub:.2f})")
        rows.append(f"| ({t}, {p}) | " + " | ".join(cells) + f" | {mem:.0f} |")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    width = 0.8 / len(splits)
    for i, (t, p) in enumerate(splits):
        xs = [j + (i - len(splits) / 2 + 0.5) * width for j in range(len(batches))]
        ax.bar(xs, [data[(t, p, B)] for B in batches], width, label=f"(t, p) = ({t}, {p})")
    ax.set_xticks(range(len(batches)), [str(B) for B in batches])
    ax.set_xlabel("batch size")
    ax.set_ylabel("predicted TFLOP/s per GPU")
    ax.set_title("GPT-3 175B on 64 A100s: tensor vs pipeline (cf. paper Fig. 13)")
    ax.set_ylim(0, 230)
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "fig13_tp_vs_pp.png", dpi=120)
    plt.close(fig)
    best = {B: max(splits, key=lambda tp: data[(*tp, B)]) for B in batches}
    return rows, best


def main() -> None:
    cl = Cluster.from_config(load_group("cluster", "dgx_a100"))
    r12, (r13, best) = fig12(cl), fig13(cl)
    best13 = "Best split predicted: " + ", ".join(f"batch {B}: (t, p) = {tp}" for B, tp in best.items()) + "."
    text = "\n".join([
        "# Studies (predicted)", "",
        "Generated by `python experiments/paper_table1/study.py`; the model and the method are in its docstring.", "",
        "## Interleaved vs non-interleaved schedule (cf. paper Fig. 12)", "",
        "![fig12](fig12_interleaved_vs_1f1b.png)", "", *r12, "",
        "The interleaved schedule divides the bubble by v, at the price of v times more stage-to-stage messages; "
        "the gain is largest at small batch (few micro-batches per pipeline) and fades as m grows, the shape "
        "the paper reports (10+% at small batch).", "",
        "## Tensor vs pipeline parallelism at fixed 64 GPUs (cf. paper Fig. 13)", "",
        "![fig13](fig13_tp_vs_pp.png)", "", *r13, "",
        "Large p pays the pipeline bubble (p-1)/m at small batch; t beyond a node (16, 32) pays all-reduces over "
        "InfiniBand in every layer and is never competitive. " + best13 + " As we recall it, the paper found "
        "t = 8 (the node size) with the rest in p best at these sizes (its takeaway #1); where our model prefers "
        "t < 8 at large batch it is because it charges little for deep pipelines (no per-stage imbalance or "
        "stragglers) and finds the wider h/t GEMMs of small t more efficient -- a point to check on hardware.", "",
    ])
    (HERE / "study.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
