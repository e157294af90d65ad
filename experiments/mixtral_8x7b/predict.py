"""Megatron-Core's published MoE runs predicted by mlplat's dry run, side by side with their figures.

    python experiments/mixtral_8x7b/predict.py      # ~10 s on 2 cores; prints the table and writes predictions.md

Each row is composed as `python -m mlplat.train +experiment=NAME [OVERRIDES] dry_run=true` composes it and planned
by `mlplat.perf.dry_run.plan` (closed-form parameter counts, equal to the meta-device model's): the memory model and
the cluster cost model timing the real interleaved schedule, with the experts' layout (parallel.ep, parallel.etp)
and one MoE layer's dispatch (`mlplat.perf.cluster.moe_layer_costs`). **The mlplat columns are predictions; no GPU
ran them.** Each experiment is planned at perfect balance (model.moe.plan_imbalance=1), at 1.2 (a round assumption)
and at 1.3, measured: the busiest expert rank's tokens over the mean. With one expert per rank (ep = E = 8) that is
the most loaded expert's share of the assignments over 1/8, which mlplat logs per layer and step (`moe_load_max`,
docs/moe.md). 1.3 is its mean over the last 20 steps of `python -m mlplat.train model=moe_tiny` (8 experts, top-2,
the balancing loss at 0.01, like Mixtral's router; steps 101-120 of 120, the busiest of the 3 MoE layers at each
step; 1.11-1.22 per layer at step 120): a small model's learned router, not Mixtral's. Megatron-Core's README warns
of severe imbalance in a dropless run's first few hundred steps from scratch and measures throughput after 500, but
publishes no steady-state figure; `mlplat.perf.memory.expert_imbalance` turns a run's per-expert counts into the
factor. The published
TFLOP/s are model FLOPs (no recomputation in these runs), compared with mlplat's model TFLOP/s per GPU
(6·N_active + 12·l·a·d·s per token, `mlplat.perf.flops`, a·d the queries' width: h for Mixtral, 2h for Qwen3's
heads of 128; the router's E·h adds 0.01% to Mixtral's N_active).

Like for like? The layout, batch, sequence, precision, dropless routing, all-to-all dispatcher and distributed
optimizer are the reference's. Megatron-Core overlaps the data-parallel reduction and the weights' all-gather with
compute (`--overlap-grad-reduce --overlap-param-gather`), as mlplat's model assumes; it fuses the permutation
(`--moe-permute-fusion`), which mlplat's model charges as four passes over the assignments; nothing of Mixtral's
all-to-all is overlapped on either side. The Qwen3-235B recipe does overlap it (`moe_a2a_overlap`: one micro-batch's
dispatch beside another's compute), which mlplat builds and models at one chunk per rank only (`1f1b_overlap`,
experiments/moe_bench/results.md), not over this layout's interleaved chunks: its prediction charges the all-to-all
exposed, a lower bound on that count. The imbalance Megatron-Core's runs had is not published: if the model is
right and that imbalance was between 1 and 1.2, its figure falls between those two predictions.
Memory: Qwen3-235B's pipeline rank 1 holds 111 layer-activations of its interleaved warm-up (37 chunks of 3
layers), 0.48 GiB each, most of it the 8 assignments per token: fc1's input, fc1's output and fc2's input, what
mlplat's experts keep (their gate weighs the activation, which recomputes itself in the backward, as Megatron-Core's
experts weigh theirs) and what tests/perf/test_moe.py measures a CPU layer keeping. The memory column is the dry
run's worst GPU against the 95% of 80 GB it may use; it charges fp32 main gradients where the Qwen3 recipe reduces
them in bf16 (grad_reduce_in_fp32=False: 2.5 GiB less there).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from dry_runs import plan_of  # noqa: E402  (experiments/dry_runs.py)

# experiment -> (published figure, where it comes from)
PUBLISHED = {
    "mixtral_8x7b": (468.0, "Megatron-Core v0.9, megatron/core/transformer/moe/README.md: 468 TFLOP/s for Mixtral 8x7B "
                            "bf16; layout from its Reference Best Parallel Mapping (64 H100, TP1 EP8 PP4 VP8, MBS 1, "
                            "GBS 256, s 4096, dropless, all-to-all)"),
    "qwen3_235b_a22b": (276.0, "issue 41's figure for Megatron-Core's Qwen3-235B-A22B on 256 H100; layout from "
                               "Megatron Bridge's performance preset QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_BF16_V1 "
                               "(scripts/performance/configs/qwen/qwen3_workload_base_configs.py: TP2 PP8 VP4 EP32, "
                               "MBS 1, GBS 2048, s 4096, all-to-all overlapped, no recomputation)"),
}
ROWS = [("mixtral_8x7b", []), ("mixtral_8x7b", ["++model.moe.plan_imbalance=1.2"]),
        ("mixtral_8x7b", ["++model.moe.plan_imbalance=1.3"]),
        ("mixtral_8x7b", ["model.moe.dispatcher=allgather"]),
        ("qwen3_235b_a22b", []), ("qwen3_235b_a22b", ["++model.moe.plan_imbalance=1.2"])]


def row(name: str, extra: list[str]) -> str:
    published, _ = PUBLISHED[name]
    what = ", ".join(extra) or "as typed"
    pl = plan_of(name, extra)
    L, x = pl["layout"], pl["experts"]
    tflops = pl["predicted_model_tflops_per_gpu"]
    return (f"| {name} | {what} | {published:g} | t{L['tp']} p{L['pp']} v{L['vpp']} d{L['dp']} ep{x['ep']} "
            f"etp{x['etp']} edp{x['edp']}, {L['schedule']}, b{L['micro']} B{L['global']}, recompute={L['recompute']} "
            f"| {x['imbalance']:g} | {x['dispatcher']}, {x['dispatch_seconds'] * 1e3:.2f} ms x 4 per layer "
            f"({x['link']}) | {pl['memory_per_gpu_bytes'] / 2**30:.1f} ({'fits' if pl['fits'] else 'DOES NOT FIT'}) "
            f"| {tflops:.0f} | {tflops / published:.2f} |")


def main() -> int:
    t0 = time.time()
    head = ("| experiment | overrides | published model TFLOP/s/GPU | mlplat layout | imbalance (max/mean) | "
            "dispatch | memory GiB of 80 | predicted model TFLOP/s/GPU | predicted / published |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, extra in ROWS:
        lines.append(row(name, extra))
        print(lines[-1], flush=True)
    sources = [f"- {name}: {src}" for name, (_, src) in PUBLISHED.items()]
    body = ["# Megatron-Core's MoE runs, predicted by the dry run", "",
            "Generated by `python experiments/mixtral_8x7b/predict.py` (do not edit by hand; the prose lives there). "
            f"{len(ROWS)} rows planned in {time.time() - t0:.0f} s.", "", __doc__.split("\n\n", 2)[2].strip(), "",
            "\n".join(lines), "", "Sources of the published figures:", "", *sources, ""]
    (HERE / "predictions.md").write_text("\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
