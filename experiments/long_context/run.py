"""Llama 3.1 405B at long context: mlplat's dry-run predictions with context parallelism beside torchtitan's 4D runs.

    python experiments/long_context/run.py        # ~20 s on 2 cores; prints the tables (results.md holds a copy)

Every cell is composed as `python -m mlplat.train +experiment=llama3_405b_128k model.seq_len=S parallel.cp=C
parallel.dp=8/C parallel.global_batch_size=8·(8/C) dry_run=true` composes it (Hydra), then planned by
`mlplat.perf.dry_run.plan` (closed-form parameter counts, equal to the meta-device model's for this model: see
experiments/llama3_torchtitan/) on conf/cluster/h100_96gb.yaml. No GPU runs here: the mlplat figures are predictions.

torchtitan's figures: benchmarks/llama3_h100_202412_torchtitan.md, Table 6 (512 H100, TP 8, PP 8, FSDP 8/c, CP c,
local batch 8, 1F1B, full activation checkpointing, torch.compile, Float8, async TP). Its four runs lie on the
diagonal (the sequence grows with c); the other cells are mlplat's alone.

Float8: mlplat has no Float8 GEMMs, so the predictions are bf16 and are compared as they are. Beside them, an upper
bound of what Float8 could add: if every dense GEMM (the layers' QKV, output, MLP; not attention, which Float8 leaves
in bf16 in torchtitan too) ran at twice the speed (the H100's fp8 peak is 2× its bf16 peak), the step would shrink by
share/2, `share` being the dense GEMMs' part of the predicted layer time. Real Float8 gains less (torchtitan's 8B:
1.28× at 8k context, Table 1), and at long context less still, as attention's share grows.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONF = REPO / "conf"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

EXPERIMENT = "llama3_405b_128k"
SEQUENCES = (32768, 65536, 131072, 262144)
CPS = (1, 2, 4, 8)
SHARDS = 8  # torchtitan's FSDP × CP: d·c = 8 in every row
LOCAL_BATCH = 8  # sequences per data-parallel rank
FP8_SPEEDUP = 2.0  # H100 fp8 / bf16 dense peak


@dataclass(frozen=True)
class Published:
    seq_len: int
    cp: int
    tokens_per_gpu: float
    memory_gib: float


# Table 6 of benchmarks/llama3_h100_202412_torchtitan.md.
TABLE6 = {(p.seq_len, p.cp): p for p in (Published(32768, 1, 76, 75.3), Published(65536, 2, 47, 75.9),
                                         Published(131072, 4, 31, 77.1), Published(262144, 8, 16, 84.9))}


def overrides(seq_len: int, cp: int) -> list[str]:
    d = SHARDS // cp
    return [f"model.seq_len={seq_len}", f"parallel.cp={cp}", f"parallel.dp={d}",
            f"parallel.global_batch_size={LOCAL_BATCH * d}"]


def compose(extra: list[str]):
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    args = [f"experiment={EXPERIMENT}", *extra]
    if GlobalHydra.instance().is_initialized():
        return hcompose(config_name="config", overrides=args)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return hcompose(config_name="config", overrides=args)


def plan_cell(seq_len: int, cp: int) -> dict:
    """The dry run's plan of one (sequence, c) cell, plus the dense GEMMs' share of its layer time."""
    from mlplat.config import load_config
    from mlplat.perf.cluster import Cluster, layer_costs
    from mlplat.perf.dry_run import plan
    from mlplat.perf.flops import ModelDims
    from mlplat.perf.memory import Layout

    cfg = load_config(compose(overrides(seq_len, cp)))
    pl = plan(cfg, experiment=EXPERIMENT, use_meta=False)
    cl = Cluster.of(cfg.cluster, cfg.trainer.accelerator)
    costs = layer_costs(ModelDims.of(cfg.model), Layout.of(cfg), cl)
    # Full recomputation: a layer's dense GEMMs run forward, again in the backward, and twice over for dX and dW.
    dense = 4 * costs.breakdown["dense_gemm_forward"]
    layer = (costs.layer_forward + costs.layer_backward + costs.tp_forward + costs.tp_backward + costs.cp_forward
             + costs.cp_backward)
    pl["gemm_share"] = dense / layer
    pl["attention_share"] = (costs.breakdown["attention_core_forward"] * (1 + 2.5 + 1)) / layer  # fwd, bwd, recompute
    return pl


def tokens_per_gpu(pl: dict) -> float:
    return pl["predicted_tokens_per_second"] / pl["layout"]["gpus"]


def fp8_bound(pl: dict) -> float:
    return tokens_per_gpu(pl) / (1 - pl["gemm_share"] * (1 - 1 / FP8_SPEEDUP))


def diagonal_table(plans: dict) -> str:
    head = ("| sequence | torchtitan: layout (512 GPUs) | tokens/s/GPU | memory GiB | mlplat: layout | predicted "
            "tokens/s/GPU (bf16) | predicted / published | Float8 upper bound | bound / published | memory GiB "
            "of 94 | MFU | dense GEMM / attention share of a layer | ring exposed per layer fwd / bwd |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (s, c), pub in TABLE6.items():
        pl = plans[(s, c)]
        r = pl["context_parallel"]
        tok = tokens_per_gpu(pl)
        ring = (f"{r['exposed_forward_seconds'] * 1e3:.2f} / {r['exposed_backward_seconds'] * 1e3:.2f} ms"
                if r else "no ring")
        lines.append(
            f"| {s:,} | TP 8, PP 8, CP {c}, FSDP {SHARDS // c} | {pub.tokens_per_gpu:g} | {pub.memory_gib} | "
            f"{layout_text(pl)} | {tok:.1f} | {tok / pub.tokens_per_gpu:.2f} | {fp8_bound(pl):.1f} | "
            f"{fp8_bound(pl) / pub.tokens_per_gpu:.2f} | {pl['memory_per_gpu_bytes'] / 2**30:.1f} "
            f"({'fits' if pl['fits'] else 'DOES NOT FIT'}) | {pl['predicted_mfu']:.1%} | "
            f"{pl['gemm_share']:.0%} / {pl['attention_share']:.0%} | {ring} |")
    return "\n".join(lines)


def grid_table(plans: dict) -> str:
    head = "| sequence | " + " | ".join(f"c={c} (d={SHARDS // c})" for c in CPS) + " |"
    lines = [head, "|" + "---|" * (len(CPS) + 1)]
    for s in SEQUENCES:
        cells = []
        for c in CPS:
            pl = plans[(s, c)]
            mark = "" if pl["fits"] else " DOES NOT FIT"
            pub = TABLE6.get((s, c))
            cells.append(f"{tokens_per_gpu(pl):.1f}, {pl['memory_per_gpu_bytes'] / 2**30:.0f} GiB{mark}"
                         + (f" (torchtitan {pub.tokens_per_gpu:g})" if pub else ""))
        lines.append(f"| {s:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def layout_text(pl: dict) -> str:
    L = pl["layout"]
    return (f"t{L['tp']}·c{L['cp']}·p{L['pp']}·d{L['dp']} = {L['gpus']} GPUs; {L['schedule']}, b={L['micro']} "
            f"m={L['micro_batches']} B={L['global']}")


def main() -> int:
    t0 = time.time()
    plans = {(s, c): plan_cell(s, c) for s in SEQUENCES for c in CPS}
    print("Table 6's runs (the sequence grows with c), predicted tokens/s per GPU beside torchtitan's:\n")
    print(diagonal_table(plans))
    print("\nEvery (sequence, c), same recipe (d = 8/c, global batch 8·d, micro-batch 1, m = 8): predicted tokens/s "
          "per GPU (bf16), memory per GPU of 94 GiB:\n")
    print(grid_table(plans))
    print(f"\n{len(plans)} cells planned in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
