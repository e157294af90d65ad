"""DeepSeek-V3 at its two published layouts, predicted by mlplat's dry run, side by side with the published figures.

    python experiments/deepseek_v3/predict.py           # ~15 s on 2 cores; prints the table
    python experiments/deepseek_v3/predict.py --write   # and rewrites results.md

Each row is composed as `python -m mlplat.train +experiment=NAME [OVERRIDES] dry_run=true` composes it and planned by
`mlplat.perf.dry_run.plan` (closed-form parameter counts, equal to the meta-device model's): the memory model and the
cluster cost model timing the real pipeline schedule, with the experts' layout and one MoE layer's dispatch
(`mlplat.perf.cluster.moe_layer_costs`). **The mlplat columns are predictions; no GPU ran them.**

- `deepseek_v3_h100`: Megatron-Bridge's recipe on 1,024 H100 (t2 p8 v4 ep64, the MTP module and the loss on a
  chunk of their own), published at 338 TFLOP/s and 1,297 tokens/s per GPU in FP8 with the experts force-balanced.
- `deepseek_v3_h800`: DeepSeek's own run on 2,048 H800 (p16 ep64, DualPipe, FP8): 180K GPU hours per trillion
  tokens, 1,543 tokens/s per GPU. mlplat runs 1F1B with full recomputation there, the one recipe of its own that
  fits in 80 GB (the conf file says why).

Each is planned at perfect balance (model.moe.plan_imbalance=1) and at two measured imbalances, the busiest expert
rank's tokens over the mean, taken as the most loaded expert's share over 1/E, what mlplat logs as `moe_load_max`
(docs/moe.md): the rank's figure with one expert per rank, an upper bound on it where a rank holds several (4 here):
- 1.3, `model=moe_tiny`'s (8 experts top-2, the balancing loss at 0.01): the busiest of its MoE layers at each of
  steps 101-120 of `python -m mlplat.train model=moe_tiny`, averaged, as experiments/mixtral_8x7b/predictions.md
  measured it;
- 3.97, `model=mla_tiny`'s (DeepSeek-V3's routing in small: 8 experts in 4 groups, top-2 by sigmoid with the
  correction bias, aux-loss-free balancing at γ = 0.001 and the sequence-wise loss at 1e-4), the same figure from
  `python -m mlplat.train model=mla_tiny model.n_layers=4` (mla_tiny as it was measured, with 4 layers; the main
  job's 3D layout, ep=4, 120 steps; per MoE layer 1.61, 3.80,
  3.97 and 2.95 for the MTP module's layer, averaged over steps 101-120; its summary at step 120: layer 1 0.46-1.69,
  layer 2 0.28-3.79, layer 3 0.26-3.81, layer 4 0.25-2.93). That router has not balanced by step 120: γ = 0.001
  moves a bias by at most 0.12 in 120 steps, less than its sigmoid scores spread, so one expert takes nearly every
  token in the deeper layers (4.0 is all of them at top-2 of 8). A stress case, not DeepSeek-V3's steady state,
  whose report shows the bias holding each layer near balance over its run.
Megatron-Bridge published its figure with the experts force-balanced: its like-for-like row is the first. Where the
recipe's memory does not fit at an imbalance (the busiest rank's expert activations grow with it), the row with
`kernels.recompute=full` is the one that does.

The last row is mlplat's planner's best layout on the same 1,024 H100 and batch (`python -m mlplat.plan
model=deepseek_v3 cluster=dgx_h100 gpus=1024 global_batch_size=8192 micro_batch_sizes=1 precision=bf16-megatron
sharding=optim`, docs/planning.md): t4 p16 ep8, the all-to-all inside a node, the MTP module on its own stage.

Two rows send the tokens to their experts in FP8 (`model.moe.fp8_dispatch=true`: e4m3 codes with a scale per row, as
DeepSeek-V3 does; the combine returns in bf16): the dispatch's bytes drop by about half.

What the predictions leave out, each making them slower than the published runs: FP8 GEMMs (both published runs are
FP8; mlplat's FP8 experts run their forward through torch's grouped FP8 GEMM on H100s, not yet run on one, and dX
and dW emulated, dequantised to fp32 one GEMM per expert, `mlplat.precision.grouped_fp8_gemm_path`, which the dry
run times at 106.3 s per step on the Bridge layout with kernels.fp8=tensorwise, 2.6 times the bf16 row, and over 80
GB with the weights' casts: so the rows run bf16 GEMMs
at 989 TFLOP/s), the all-to-all overlapped with compute (DualPipe's point, and the Bridge recipe's DeepEP/HybridEP
kernels; mlplat charges it exposed: 4 collectives per MoE layer and micro-batch), DeepSeek's node-limited dispatch
(a token to at most 4 nodes, sent once per node and forwarded over NVLink; its FP8 dispatch only in the rows so
marked), and on the H800 run the recomputation mlplat needs to fit (full, where DeepSeek recomputes RMSNorm and the
MLA up-projections and caches activations in FP8).

Model FLOPs: mlplat counts 6·N_active plus the attention's 3·(l + D)·s·2·a·(d_qk + d_v) per token (non-causal; the MTP
module's layer and head included): 291.9 GFLOP per token; Megatron-Bridge's 338 TFLOP/s at 1,297 tokens/s is
260.6 GFLOP per token, the same count with the attention halved (causal): 291.9 - 62.4 / 2 = 260.7. The ratio column
therefore compares tokens per second per GPU, which no convention changes.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[1], HERE.parent):  # mlplat, and experiments/dry_runs.py
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
from dry_runs import plan_of  # noqa: E402

MOE_TINY_IMBALANCE = 1.3  # model=moe_tiny's, measured (experiments/mixtral_8x7b/predict.py)
MLA_TINY_IMBALANCE = 3.97  # model=mla_tiny's, measured (the module doc)
FULL = "kernels.recompute=full"
FP8_DISPATCH = "model.moe.fp8_dispatch=true"
PLANNER = ("parallel.tp=4", "parallel.pp=16", "parallel.vpp=1", "parallel.dp=16", "parallel.schedule=1f1b",
           "parallel.first_stage_layers=5", "parallel.last_stage_layers=0", "parallel.ep=8")

# experiment -> (published tokens/s per GPU, published TFLOP/s per GPU or None, GPUs, where it comes from)
PUBLISHED = {
    "deepseek_v3_h100": (1297.0, 338.0, "Megatron-Bridge docs/performance-summary.md, NeMo 25.09, DGX-H100, "
                                        "DeepSeekV3 (dropless): 1,024 GPUs, GBS 8192, MBS 1, seq 4096, TP2 PP8 VP4 "
                                        "EP64, 1,297 tokens/s and 338 TFLOP/s per GPU (330 with 128x128 blockwise "
                                        "FP8), "
                                        "experts force-balanced; the recipe: scripts/performance/configs/deepseek/"
                                        "workload_base_configs.py DEEPSEEK_V3_PRETRAIN_CONFIG_H100_V1 (recompute "
                                        "mla_up_proj and mlp, layout Et|(tt|)*30mL)"),
    "deepseek_v3_h800": (1e12 / (180e3 * 3600), None, "DeepSeek-AI 2024, DeepSeek-V3 Technical Report: Table 1 and "
                                                       "§3 (180K H800 GPU hours per trillion tokens on 2,048 H800; "
                                                       "PP16, EP64 over 8 nodes, ZeRO-1, DualPipe, FP8; batch "
                                                       "ramped to 15,360 sequences of 4,096)"),
}


def imbalance(x: float) -> str:
    return f"++model.moe.plan_imbalance={x}"


ROWS = [("deepseek_v3_h100", []), ("deepseek_v3_h100", [imbalance(MOE_TINY_IMBALANCE)]),
        ("deepseek_v3_h100", [imbalance(MOE_TINY_IMBALANCE), FULL]),
        ("deepseek_v3_h100", [imbalance(MLA_TINY_IMBALANCE), FULL]), ("deepseek_v3_h100", [FP8_DISPATCH]),
        ("deepseek_v3_h800", []), ("deepseek_v3_h800", [imbalance(MOE_TINY_IMBALANCE)]),
        ("deepseek_v3_h800", [imbalance(MLA_TINY_IMBALANCE)]), ("deepseek_v3_h800", [FP8_DISPATCH]),
        ("deepseek_v3_h100", list(PLANNER))]


def row(name: str, extra: list[str]) -> str:
    from mlplat.parallel.layout.pipeline import layer_runs

    tokens_pub, tflops_pub, _ = PUBLISHED[name]
    pl = plan_of(name, extra)
    L, x = pl["layout"], pl["experts"]
    tokens = pl["predicted_tokens_per_second"] / L["gpus"]
    step_pub = L["global"] * pl["model"]["seq_len"] / (tokens_pub * L["gpus"])
    what = ("planner's best" if extra == list(PLANNER) else "+ recompute=full" if FULL in extra
            else "+ FP8 dispatch" if FP8_DISPATCH in extra else "as typed")
    return (f"| {name} ({what}) | {x['imbalance']:g} | {L['gpus']} | t{L['tp']} p{L['pp']} v{L['vpp']} d{L['dp']} "
            f"ep{x['ep']} "
            f"edp{x['edp']}, {L['schedule']}, layers {layer_runs(L['chunk_layers'])}, b{L['micro']} B{L['global']}, "
            f"recompute={L['recompute']} | {pl['memory_per_gpu_bytes'] / 2**30:.1f} "
            f"({'fits' if pl['fits'] else 'DOES NOT FIT'}) | {x['dispatch_seconds'] * 1e3:.2f} ms x 4 ({x['link']}) "
            f"| {step_pub:.1f} | {pl['predicted_seconds_per_iteration']:.1f} | {tokens_pub:,.0f} | {tokens:,.0f} "
            f"| {tflops_pub if tflops_pub else '-'} | {pl['predicted_model_tflops_per_gpu']:.0f} "
            f"| {tokens / tokens_pub:.2f} |")


def main() -> int:
    t0 = time.time()
    head = ("| experiment | imbalance (max/mean) | GPUs | mlplat layout (bf16-megatron) | memory GiB of 80 | "
            "all-to-all per layer and micro-batch | published s/step | predicted s/step | published tokens/s/GPU | "
            "predicted tokens/s/GPU | published TFLOP/s/GPU (Megatron's count) | predicted model TFLOP/s/GPU "
            "(mlplat's count) | predicted / published tokens/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, extra in ROWS:
        lines.append(row(name, extra))
        print(lines[-1], flush=True)
    sources = [f"- {name}: {src}" for name, (_, _, src) in PUBLISHED.items()]
    body = ["# DeepSeek-V3 at its published layouts, predicted by the dry run", "",
            "Generated by `python experiments/deepseek_v3/predict.py --write` (do not edit by hand; the prose lives "
            "there).", "", __doc__.split("\n\n", 2)[2].strip(), "",
            "\n".join(lines), "", "Sources of the published figures:", "", *sources, ""]
    print(f"{len(ROWS)} rows planned in {time.time() - t0:.0f} s")
    if "--write" in sys.argv[1:]:
        (HERE / "results.md").write_text("\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
