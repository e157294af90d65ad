"""Plan every row of the paper's Table 1 and set the predictions beside the published figures.

    python experiments/paper_table1/run.py            # prints the tables, writes results.md and results.json

Each row is composed exactly as `python -m mlplat.train +experiment=NAME dry_run=true` composes it (Hydra),
then planned four times by `mlplat.perf.dry_run.plan`:
  paper setup   the paper's kernels and precision: fp16 weights with fp32 master copies ("16-megatron"),
                fused scale+mask+softmax attention (no flash attention, which postdates the paper), full
                recomputation, no sequence parallelism, no distributed optimizer: for reproduction
  bf16-mixed    the recipe the experiments had before: Lightning's bf16-mixed (autocast over fp32 weights), full
                recomputation, flash attention
  megatron+dist bf16-megatron (bf16 weights, fp32 main weights and gradients) and optim.distributed=true (optimizer
                state sharded over the data-parallel ranks), still full recomputation
  as typed      the experiment file itself: bf16-megatron, the distributed optimizer, and sequence parallelism
                (t > 1) with selective recomputation where the memory model (messages in flight counted) says it
                fits, else full recomputation (checked here: the other choice is planned too)
The first table counts executed FLOPs, recomputation included (the paper's 96·B·s·l·h²·(...) formula); the second
sets the experiments as typed against the paper in model FLOPs (72·B·s·l·h²·(...)), converting the paper's
measured TFLOP/s by model / executed FLOPs.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONF = HERE.parents[1] / "conf"

ROWS = ["gpt1p7b", "gpt3p6b", "gpt7p5b", "gpt18b", "gpt39b", "gpt76b", "gpt145b", "gpt310b", "gpt530b", "gpt1t"]
# Paper Table 1 (arXiv 2104.04473): achieved teraFLOP/s per GPU, % of the 312 TFLOP/s peak, aggregate
# petaFLOP/s, parameters (billions) -- as we recall them; see results.md on how sure we are.
PAPER = {
    "gpt1p7b": (137, 44, 4.4, 1.7), "gpt3p6b": (138, 44, 8.8, 3.6), "gpt7p5b": (142, 46, 18.2, 7.5),
    "gpt18b": (135, 43, 34.6, 18.4), "gpt39b": (138, 44, 70.8, 39.1), "gpt76b": (140, 45, 143.8, 76.1),
    "gpt145b": (148, 47, 227.1, 145.6), "gpt310b": (155, 50, 297.4, 310.1), "gpt530b": (163, 52, 410.2, 529.6),
    "gpt1t": (163, 52, 502.0, 1008.0),
}
# The figures an issue brief quoted for the same column; they disagree with ours in rows 3-9.
BRIEF = [137, 138, 140, 143, 152, 160, 160, 156, 161, 163]
# The bar the experiments as typed are held to (tests/perf/test_dry_run.py checks the same): more model FLOP/s per
# GPU than the paper measured, and 25% more from 145B parameters on (Korthikanti et al. 2022 measured +29% at 530B).
BIG_ROW_PARAMS, BIG_ROW_GAIN = 145e9, 1.25


def model_over_executed(model: dict) -> float:
    """The paper's model FLOPs (72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))) over its executed FLOPs with full
    recomputation (96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))): converts a measured TFLOP/s of Table 1 to model TFLOP/s."""
    s, l, h, V = model["seq_len"], model["n_layers"], model["hidden"], model["vocab_size"]
    return 72 * (1 + s / (6 * h) + V / (12 * l * h)) / (96 * (1 + s / (6 * h) + V / (16 * l * h)))


def compose(name: str):
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return hcompose(config_name="config", overrides=[f"experiment={name}"])


def main() -> int:
    from omegaconf import OmegaConf

    from mlplat.config import from_dict, load_config
    from mlplat.perf.dry_run import plan

    t0 = time.time()
    results = []
    for name in ROWS:
        cfg = compose(name)
        typed = plan(load_config(cfg), experiment=name)
        # The recomputation not chosen, to show the choice is the best that fits.
        other = load_config(cfg)
        other.kernels.recompute = "full" if other.kernels.recompute == "selective" else "selective"
        other_plan = plan(other, experiment=name)
        autocast = load_config(cfg)
        autocast.trainer.precision, autocast.optim.distributed = "bf16-mixed", False
        autocast.parallel.sequence_parallel, autocast.kernels.recompute = False, "full"
        autocast_plan = plan(autocast, experiment=name)
        megatron = load_config(cfg)
        megatron.parallel.sequence_parallel, megatron.kernels.recompute = False, "full"
        megatron_dist = plan(megatron, experiment=name)
        paper_cfg = OmegaConf.to_container(cfg, resolve=False)
        paper_cfg = {k: paper_cfg[k] for k in ("model", "parallel", "kernels", "trainer", "cluster")}
        paper_cfg["trainer"]["precision"] = "16-megatron"  # fp16 weights, fp32 main weights: a real run precision
        paper_cfg["kernels"].update(attention="unfused", fused=True, recompute="full")
        paper_cfg["parallel"]["sequence_parallel"] = False  # and no optim.distributed: the paper's setup
        paper = plan(from_dict(paper_cfg), experiment=name, use_meta=False)
        results.append({"name": name, "paper_setup": paper, "bf16_mixed": autocast_plan,
                        "megatron_distributed": megatron_dist, "as_typed": typed, "other_recompute": other_plan})
    elapsed = time.time() - t0

    head = ("| row | params (B) | t | p | v | GPUs | B | b | m | bubble | pred. s/iter | pred. TFLOP/s/GPU | "
            "pred. % peak | pred. PFLOP/s | paper TFLOP/s/GPU | paper % | paper PFLOP/s | pred./paper | "
            "bf16-mixed, full recomputation TFLOP/s (MFU) | bf16-megatron + distributed optimizer, full "
            "recomputation TFLOP/s (MFU) | as typed: recompute, s/iter, MFU, model TFLOP/s | "
            "memory GiB (paper / bf16-mixed / megatron, distributed / as typed) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        pp, ac, L = r["paper_setup"], r["bf16_mixed"], r["paper_setup"]["layout"]
        md, bp = r["megatron_distributed"], r["as_typed"]
        tf, pct, pf, nb = PAPER[r["name"]]
        lines.append(
            f"| {r['name']} | {bp['parameters_total'] / 1e9:.1f} | {L['tp']} | {L['pp']} | {L['vpp']} | {L['gpus']} | "
            f"{L['global']} | {L['micro']} | {L['micro_batches']} | {pp['bubble_fraction']:.3f} | "
            f"{pp['predicted_seconds_per_iteration']:.2f} | {pp['predicted_tflops_per_gpu']:.0f} | "
            f"{pp['predicted_tflops_per_gpu'] / 3.12:.0f}% | {pp['predicted_aggregate_pflops']:.1f} | "
            f"{tf} | {pct}% | {pf} | {pp['predicted_tflops_per_gpu'] / tf:.2f} | "
            f"{ac['predicted_tflops_per_gpu']:.0f} ({ac['predicted_mfu']:.0%}) | "
            f"{md['predicted_tflops_per_gpu']:.0f} ({md['predicted_mfu']:.0%}) | "
            f"{bp['layout']['recompute']}, {bp['predicted_seconds_per_iteration']:.2f}, {bp['predicted_mfu']:.0%}, "
            f"{bp['predicted_model_tflops_per_gpu']:.0f} | "
            f"{pp['memory_per_gpu_bytes'] / 2**30:.0f} / {ac['memory_per_gpu_bytes'] / 2**30:.0f} / "
            f"{md['memory_per_gpu_bytes'] / 2**30:.0f} / {bp['memory_per_gpu_bytes'] / 2**30:.0f} |")
    table = "\n".join(lines)

    head2 = ("| experiment (as typed) | recipe | paper TFLOP/s/GPU (executed) | paper model TFLOP/s/GPU "
             "(x model/executed) | predicted model TFLOP/s/GPU | predicted / paper | bar | memory GiB of 80 "
             "(messages in flight) | the other recomputation |")
    lines2 = [head2, "|" + "---|" * (head2.count("|") - 1)]
    for r in results:
        bp, ot = r["as_typed"], r["other_recompute"]
        L, tf = bp["layout"], PAPER[r["name"]][0]
        paper_model = tf * model_over_executed(bp["model"])
        ratio = bp["predicted_model_tflops_per_gpu"] / paper_model
        bar = BIG_ROW_GAIN if bp["parameters_total"] >= BIG_ROW_PARAMS else 1.0
        recipe = ", ".join([L["precision"]] + ["distributed optimizer"] * L["distributed_optimizer"]
                           + ["sequence parallel"] * L["sequence_parallel"] + [f"recompute={L['recompute']}"])
        lines2.append(
            f"| {r['name']} | {recipe} | {tf} | {paper_model:.1f} | {bp['predicted_model_tflops_per_gpu']:.1f} | "
            f"{ratio:.2f} | {'≥' if bar > 1 else '>'} {bar:.2f}: {'met' if ratio > bar else 'NOT MET'} | "
            f"{bp['memory_per_gpu_bytes'] / 2**30:.1f} ("
            + (f"{bp['messages_in_flight']} x {bp['message_bytes'] / 2**20:.1f} MiB" if L["pp"] > 1 else "p = 1: none")
            + f") | {ot['layout']['recompute']}: "
            f"{ot['memory_per_gpu_bytes'] / 2**30:.1f} GiB, {'fits' if ot['fits'] else 'does not fit'}, "
            f"{ot['predicted_model_tflops_per_gpu']:.1f} model TFLOP/s |")
    table2 = "\n".join(lines2)
    print(table)
    print()
    print(table2)
    print(f"\n{len(results)} rows planned in {elapsed:.1f} s")

    ratios = [r["paper_setup"]["predicted_tflops_per_gpu"] / PAPER[r["name"]][0] for r in results]
    body = [
        "# Paper Table 1, predicted by mlplat's dry run",
        "",
        "Generated by `python experiments/paper_table1/run.py` (do not edit by hand; the prose lives in run.py).",
        "",
        "## The paper's setup, and the recipes step by step",
        "",
        table,
        "",
        f"Prediction / paper (paper setup): min {min(ratios):.2f}, max {max(ratios):.2f}, "
        f"mean {sum(ratios) / len(ratios):.2f}. All {len(results)} rows planned in {elapsed:.1f} s on a 2-core CPU "
        "(each builds the real model for every pipeline stage on the meta device and simulates the real schedule).",
        "",
        "## The experiments as typed against the paper (model FLOPs)",
        "",
        "`python -m mlplat.train +experiment=NAME dry_run=true` as typed. These are predictions of the calibrated cost "
        "model, not measurements. The paper's measured TFLOP/s count executed FLOPs with full recomputation; "
        "multiplied by model / executed FLOPs (`72·(1 + s/(6h) + V/(12·l·h))` over `96·(1 + s/(6h) + V/(16·l·h))`, "
        "about 0.75) they are the paper's model TFLOP/s, the count in which selective and full recomputation "
        "compare fairly. The bar: more than the paper on every row, 25% more on the rows of 145B parameters and more "
        "(tests/perf/test_dry_run.py checks both).",
        "",
        table2,
        "",
        NOTES,
        "",
        "Figures quoted by the issue brief for the paper's TFLOP/s column, for the record: "
        + ", ".join(str(x) for x in BRIEF) + ".",
    ]
    (HERE / "results.md").write_text("\n".join(body) + "\n")
    (HERE / "results.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    return 0


NOTES = """\
## How each prediction is made

* **FLOPs per iteration**: the paper's `96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))` (full recomputation, which the
  paper's rows use); TFLOP/s per GPU = that / predicted seconds / GPUs, the paper's own convention. MFU and the
  model TFLOP/s use the model FLOPs `72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))`.
* **Seconds per iteration**: `mlplat.perf.cluster` computes each chunk's forward and backward time (a GEMM
  roofline with tile/wave quantisation at 72% sustained A100 efficiency, element-wise traffic at 80% of HBM
  bandwidth, ring all-reduces for tensor parallelism over NVLink), the stage-to-stage transfer time (IB with
  scatter/gather) and feeds them to `mlplat.perf.simulator`, which runs the very instruction lists
  (`mlplat.parallel.layout.schedules.build_schedule`) the engine executes; then it adds the exposed
  data-parallel gradient all-reduce and the optimizer step. The bubble column is the simulated
  (pipeline time - busiest rank's compute) / that compute.
* **Why bf16-megatron and not 16-megatron**: the paper's fp16 weights with fp32 main weights are
  `16-megatron`; `bf16-megatron` is the same scheme in bf16, with the same A100 GEMM peak (312 TFLOP/s) and the
  same bytes (the cost and memory models treat the two alike), but bf16 has fp32's exponent range, so it needs no
  dynamic loss scaler: no overflow-skipped steps and no scaler state to checkpoint.
* **Parameters**: counted on the real model built on the meta device for every pipeline stage; equal to the
  closed form `l·(12h² + 13h) + V·h + s·h + 2h` (checked by tests/perf/test_dry_run.py).
* No constant was fitted row by row. The GEMM efficiency (0.72 of peak on A100), the bandwidth
  efficiencies (0.8 NVLink and HBM, 0.9 IB) and the kernel byte counts come from datasheets and first
  principles and are documented in `mlplat/perf/cluster.py`; 0.72 was chosen once, before this table was
  run, with the 1T row in mind (a cuBLAS-in-isolation 0.80-0.85 would over-predict it), so this is a
  one-constant calibration, not an independent validation. The model omits data loading, logging, Python
  overhead and stragglers, which the paper's end-to-end measurement includes.
* **Memory**: `mlplat.perf.memory` per pipeline rank (the worst shown): weights, gradients, optimizer state,
  activations of the micro-batches in flight, the working set, the logits, the stage-to-stage messages in flight
  (the engine's exchange plan holds at most `in_flight_messages` buffers of [b, s, h/t] in the compute dtype at
  once, bounded independent of m: tens of MiB on these rows, see the second table) and 2 GiB of CUDA/NCCL
  overhead.
* **Paper setup vs bf16-mixed**: the experiments used to run `bf16-mixed`, which in Lightning is autocast over fp32
  weights: every forward re-casts the weights to bf16 and every backward accumulates fp32 gradients
  (memory traffic that grows with parameters per GPU and shrinks with the micro-batch), the residual stream
  and stage-to-stage messages are fp32 (twice the bytes), and the fp32 weights+gradients+Adam state cost
  16 bytes/parameter as in the paper. Flash attention (GPU default) removes the s² softmax traffic, which
  is what the small-hidden rows pay most for. So that recipe is predicted faster than the paper on the small
  models and slower on the large ones (b = 1, billions of parameters per GPU).
* **bf16-megatron + distributed optimizer**: the same rows with `trainer.precision=bf16-megatron` (bf16
  weights, fp32 main weights and main gradients: no per-forward weight cast, no fp32 gradient traffic in the
  backward, a bf16 residual stream and bf16 stage-to-stage messages) and `optim.distributed=true` (main weights
  and Adam moments sharded over the d data-parallel ranks; the fp32 gradients reduce-scattered, half an
  all-reduce's bytes; the bf16 weights all-gathered after the step, waited for by the next forward). Model
  state per parameter goes from 16 bytes (autocast) to 6 + 12/d, and the large rows recover the paper's
  throughput and more (flash attention).
* **As typed** (`conf/experiment/NAME.yaml`): the previous column with `parallel.sequence_parallel=true`
  (LayerNorm and dropout regions hold 1/t of the sequence; the tensor-parallel all-reduces become
  reduce-scatter/all-gather pairs of the same bytes) and `kernels.recompute=selective` (only attention's core
  is recomputed) where the plan still fits in memory, else full recomputation (only gpt1p7b: t = 1, micro-batch
  16, no sequence parallelism; the last column of the second table shows the choice not made). It
  removes most of the recomputation's forward (the paper's 96 becomes about 72 in the FLOP count), so the
  executed-FLOP TFLOP/s of the other columns would understate it: the column gives seconds per iteration,
  MFU and model TFLOP/s per GPU (72·B·s·l·h²·(...)), comparable across all columns through the MFU.

## The paper's numbers

The "paper" columns are Table 1 of Narayanan et al., SC21 (arXiv 2104.04473) as we recall it: 137, 138, 142,
135, 138, 140, 148, 155, 163, 163 TFLOP/s per GPU (44-52% of peak) and 4.4 ... 502.0 PFLOP/s aggregate.
We could not re-read the paper in this environment. Our recollection is self-consistent: per-GPU TFLOP/s ×
GPUs reproduces the aggregate column within rounding (e.g. 135 × 256 = 34.6 PFLOP/s, 148 × 1536 = 227
PFLOP/s). The issue brief quoted a different list (below) that disagrees with ours in rows 3-9; neither
could be checked against the PDF here, so treat the paper columns of rows 3-9 as unverified."""


if __name__ == "__main__":
    sys.exit(main())
