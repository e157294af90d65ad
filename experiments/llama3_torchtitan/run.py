"""mlplat's dry-run predictions for Llama 3.1 8B, 70B and 405B beside torchtitan's published H100 figures.

    python experiments/llama3_torchtitan/run.py        # ~15 s on 2 cores; prints the table (README.md holds a copy)

Each row is composed as `python -m mlplat.train +experiment=NAME [OVERRIDES] dry_run=true` composes it (Hydra),
then planned by `mlplat.perf.dry_run.plan`: the real model built on the meta device for every pipeline rank, the
memory model, and the cluster cost model timing the real schedule, on conf/cluster/h100_96gb.yaml (the 96 GB
HBM2e H100 at 500 W of torchtitan's runs). No GPU runs here: the mlplat columns are predictions.

torchtitan's figures (tokens/s per GPU, peak memory in GiB) are those of its repository's benchmark pages:
  benchmarks/llama3_h100_202412_torchtitan.md           8B: Table 1; 405B: Table 5
  benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md  70B: the bf16 row (memory not given there)
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONF = REPO / "conf"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PEAK_BF16 = 989e12  # H100 SXM dense bf16: torchtitan's MFU denominator, and mlplat's h100-hbm2e entry


@dataclass(frozen=True)
class Published:
    """One figure of torchtitan's benchmark pages."""

    gpus: int
    layout: str  # torchtitan's parallelism
    recipe: str  # precision, compilation, checkpointing, batch
    tokens_per_gpu: float
    memory_gib: float | None
    bf16: bool  # no Float8 GEMMs: an MFU in bf16 peak is meaningful
    source: str


@dataclass(frozen=True)
class Row:
    model: str  # conf/experiment/NAME
    label: str
    published: Published
    overrides: tuple[str, ...] = ()  # on top of the experiment file
    like_for_like: str = ""
    extra: tuple[str, ...] = field(default_factory=tuple)  # notes


T1 = "llama3_h100_202412 Table 1"
T5 = "llama3_h100_202412 Table 5"
ATP = "asyncTP_llama3_h100_2025-06"
# The experiment file is torchtitan's interleaved layout (16 chunks of 7, 8 x 14, 7 layers); its 1F1B splits the
# 126 layers 15, 16 x 6, 15 over the 8 stages.
ONE_F_ONE_B = ("parallel.vpp=1", "parallel.schedule=1f1b", "parallel.first_stage_layers=15",
               "parallel.last_stage_layers=15")
ROWS = [
    Row("llama3_8b", "8B", Published(8, "FSDP 8", "bf16, eager, selective op AC, local batch 2 (global 16)", 5762,
                                     82.4, True, T1),
        like_for_like="yes, up to the sharding: bf16 both, no compilation both; FSDP shards weights and "
                      "gradients, mlplat's distributed optimizer only the optimizer state; torchtitan's per-op "
                      "selective checkpointing vs mlplat's full recomputation"),
    Row("llama3_8b", "8B", Published(8, "FSDP 8", "bf16, torch.compile, selective op AC, local batch 2", 6667, 77.0,
                                     True, T1),
        overrides=("kernels.fused=true",),
        like_for_like="yes, as above; torch.compile vs mlplat's fused operators (kernels.fused=true)"),
    Row("llama3_70b", "70B", Published(256, "FSDP 32 x TP 8", "bf16, torch.compile, full AC, local batch 16 "
                                       "(global 512)", 597.3, None, True, ATP),
        like_for_like="yes: bf16, full recomputation, TP 8 with sequence parallelism both; FSDP vs ZeRO-1; "
                      "16 sequences per pass vs 4 micro-batches of 4"),
    Row("llama3_70b", "70B", Published(256, "FSDP 32 x TP 8", "bf16, torch.compile, full AC, async TP", 652.4,
                                       None, True, ATP),
        overrides=("kernels.recompute=selective", "parallel.micro_batch_size=1"),
        like_for_like="no: mlplat has no async TP; planned with mlplat's selective recomputation (attention core) "
                      "at micro-batch 1, the fastest recipe that fits, for reference"),
    Row("llama3_405b", "405B", Published(512, "FSDP 8 x TP 8 x PP 8, 1F1B", "Float8, torch.compile, async TP, full "
                                         "AC, local batch 32 (global 256)", 100, 82.5, False, T5),
        overrides=ONE_F_ONE_B,
        like_for_like="no: Float8 GEMMs and async TP there, bf16 here; the same 512 GPUs and uneven stages "
                      "(15, 16 x 6, 15 layers)"),
    Row("llama3_405b", "405B", Published(512, "FSDP 8 x TP 8 x PP 8, interleaved 1F1B", "Float8, torch.compile, "
                                         "async TP, full AC, local batch 32 (global 256)", 128, 72.7, False, T5),
        like_for_like="no: as above; 16 chunks of 7, 8 x 14, 7 layers both"),
    # torchtitan's default at the benchmark's commit splits the local batch into p micro-batches (here 4 sequences
    # each); the page does not say whether the run kept it. The same split, planned:
    Row("llama3_405b", "405B", Published(512, "FSDP 8 x TP 8 x PP 8, 1F1B", "as above", 100, 82.5, False, T5),
        overrides=(*ONE_F_ONE_B, "parallel.micro_batch_size=4"),
        like_for_like="no: as above, with m = p micro-batches of 4 sequences (torchtitan's default split)"),
    Row("llama3_405b", "405B", Published(512, "FSDP 8 x TP 8 x PP 8, interleaved 1F1B", "as above", 128, 72.7,
                                         False, T5),
        overrides=("parallel.micro_batch_size=4",),
        like_for_like="no: as above, with m = p micro-batches of 4 sequences (torchtitan's default split)"),
]


def compose(name: str, overrides: tuple[str, ...] = ()):
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return hcompose(config_name="config", overrides=[f"experiment={name}", *overrides])
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return hcompose(config_name="config", overrides=[f"experiment={name}", *overrides])


def plan_row(row: Row, use_meta: bool = True) -> dict:
    """The dry run's plan of `row`'s experiment with its overrides."""
    from mlplat.config import load_config
    from mlplat.perf.dry_run import plan

    return plan(load_config(compose(row.model, row.overrides)), experiment=row.model, use_meta=use_meta)


def published_mfu(row: Row, pl: dict) -> float | None:
    """torchtitan's tokens/s per GPU as MFU: × mlplat's model FLOPs per token (6N + 12·l·h·s, the convention
    torchtitan's own MFU uses) / the bf16 peak; None for Float8 runs, whose MFU has no single peak."""
    if not row.published.bf16:
        return None
    per_token = pl["model_flops_per_iteration"] / (pl["layout"]["global"] * pl["model"]["seq_len"])
    return row.published.tokens_per_gpu * per_token / PEAK_BF16


def layout_text(pl: dict) -> str:
    L = pl["layout"]
    parts = [f"t{L['tp']}", f"p{L['pp']}"] + ([f"v{L['vpp']}"] if L["vpp"] > 1 else []) + [f"d{L['dp']}"]
    recipe = [L["schedule"], f"b={L['micro']} m={L['micro_batches']} B={L['global']}", f"recompute={L['recompute']}"]
    if L.get("uneven"):
        from mlplat.parallel.layout.pipeline import layer_runs

        recipe.insert(1, f"layers per chunk {layer_runs(L['chunk_layers'])}")
    recipe += ["SP"] * L["sequence_parallel"] + ["fused"] * L["fused"] + ["ZeRO-1"] * L["distributed_optimizer"]
    return f"{'·'.join(parts)} = {L['gpus']} GPUs; {', '.join(recipe)}"


def table(rows: list[Row], plans: list[dict]) -> str:
    head = ("| model | torchtitan: GPUs, layout | recipe | tokens/s/GPU | MFU (bf16) | memory GiB | mlplat: layout "
            "(bf16-megatron) | predicted tokens/s/GPU | predicted MFU | memory GiB of 94 | predicted / published "
            "| like for like? |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row, pl in zip(rows, plans):
        pub, L = row.published, pl["layout"]
        tokens = pl["predicted_tokens_per_second"] / L["gpus"]
        mfu = published_mfu(row, pl)
        lines.append(
            f"| {row.label} | {pub.gpus}, {pub.layout} | {pub.recipe} | {pub.tokens_per_gpu:,.1f} | "
            f"{f'{mfu:.1%}' if mfu is not None else 'n/a (Float8)'} | "
            f"{pub.memory_gib if pub.memory_gib is not None else 'not given'} | {layout_text(pl)} | {tokens:,.1f} | "
            f"{pl['predicted_mfu']:.1%} | {pl['memory_per_gpu_bytes'] / 2**30:.1f} "
            f"({'fits' if pl['fits'] else 'DOES NOT FIT'}) | {tokens / pub.tokens_per_gpu:.2f} | {row.like_for_like} |")
    return "\n".join(lines)


def main() -> int:
    t0 = time.time()
    plans = [plan_row(row) for row in ROWS]
    print(table(ROWS, plans))
    from mlplat.perf.flops import ModelDims, parameter_count

    print()
    seen = set()
    for row, pl in zip(ROWS, plans):
        if row.label in seen:
            continue
        seen.add(row.label)
        released = parameter_count(ModelDims.from_config(pl["model"]), padded=False)
        print(f"{row.label}: {pl['parameters_total']:,} parameters ({pl['parameters_source']}, vocabulary padded to "
              f"a multiple of 128·t = {128 * pl['layout']['tp']}; closed form {pl['parameters_closed_form']:,}); "
              f"{released:,} with the tokenizer's vocabulary (the released model's count)")
    print(f"\n{len(ROWS)} rows planned in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
