"""`dry_run=true`: what a run will do, worked out on a laptop before it is given thousands of GPUs.

`plan(cfg)` builds the real model code for every pipeline rank on the meta device (shapes only, no memory),
counts its parameters, and combines them with the memory model (`perf.memory`), the FLOP formulas
(`perf.flops`) and the cluster cost model that times the real pipeline schedule (`perf.cluster`).
`format_plan` turns the result into a readable summary. Only this module of `perf/` touches torch.
"""
from __future__ import annotations

import dataclasses
import math
import shlex
from typing import Any, Mapping

from mlplat.config import ARCHS, ModelConfig, RunConfig
from mlplat.parallel.layout.pipeline import layer_runs
from mlplat.parallel.layout.schedules import paper_bubble
from mlplat.perf.cluster import (
    Cluster,
    cp_inter_node,
    expert_links,
    experts_fp8_forward,
    experts_gemm_path,
    predict,
    resolve_attention,
    token_collectives,
)
from mlplat.perf.devices import peak_flops
from mlplat.perf.flops import (
    ModelDims,
    hardware_flops_per_iteration,
    model_flops_per_iteration,
    parameter_count,
    stage_parameters,
)
from mlplat.perf.memory import (
    Layout,
    dispatch_buffer_bytes,
    dkv_block_bytes,
    expert_assignments,
    expert_split,
    kv_block_bytes,
    layout_errors,
    memory_per_stage,
    message_bytes,
    messages_in_flight,
    routed_tokens,
)
from mlplat.perf.preemption import NOTICE_STEPS, notice_lead
from mlplat.precision import fp8_gemm_path, precision_of
from mlplat.specs import attentions


def meta_parameter_counts(model: ModelConfig, lay: Layout) -> tuple[int, list[int]]:
    """(total, per pipeline rank on one GPU) from the real model built on the meta device.

    Each pipeline rank builds its chunks (`build_rank_chunks`) with tensor-parallel rank 0 of a virtual grid
    (d = c = 1: every replica holds the same weights). A parameter's full tensor is `full_shape_of` it (t times a
    shard tagged with `partition_dim`; the row blocks' rows when key/value heads are shared by several ranks); the
    tied word embedding held by two stages appears under one full-model name, counted once in the total.
    """
    import torch

    from mlplat.model.decoder import build_rank_chunks
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.parallel.layout.dims import ParallelDims
    from mlplat.parallel.tensor import full_shape_of

    dims = ParallelDims(tp=lay.tp, pp=lay.pp)
    full: dict[str, int] = {}
    per_rank = []
    for r in range(lay.pp):
        grid = ParallelGrid.of(dims, rank=dims.rank_of(pp=r), virtual=True)
        # Keep the rank's chunks alive while counting: ids of freed parameters get reused.
        chunks = build_rank_chunks(model, grid, lay.pipeline, device=torch.device("meta"))
        unique = {id(q): q.numel() for ch in chunks.values() for q in ch.parameters()}
        per_rank.append(sum(unique.values()))
        for ch in chunks.values():
            for name, param in ch.named_parameters():
                full[ch.full_name(name)] = math.prod(full_shape_of(param, grid))
        del chunks
    return sum(full.values()), per_rank


def _model_available() -> bool:
    try:
        import mlplat.model.decoder  # noqa: F401
        import mlplat.parallel.grid  # noqa: F401
    except ImportError:
        return False
    return True


# Layout field -> the config key that sets it: the keys a launch line names where the layout differs from the
# config that the line's other overrides compose.
LAYOUT_KEYS = {
    "tp": "parallel.tp", "cp": "parallel.cp", "pp": "parallel.pp", "vpp": "parallel.vpp", "dp": "parallel.dp",
    "schedule": "parallel.schedule", "micro_batch_size": "parallel.micro_batch_size",
    "global_batch_size": "parallel.global_batch_size", "scatter_gather": "parallel.scatter_gather",
    "sequence_parallel": "parallel.sequence_parallel", "recompute": "kernels.recompute",
    "attention": "kernels.attention", "fused": "kernels.fused", "precision": "trainer.precision",
    "sharding": "optim.sharding", "dp_shard": "parallel.dp_shard", "grad_reduce_dtype": "optim.grad_reduce_dtype",
    "post_validate": "optim.post_validate", "fp8": "kernels.fp8",
    "first_stage_layers": "parallel.first_stage_layers", "last_stage_layers": "parallel.last_stage_layers",
    "ep": "parallel.ep", "etp": "parallel.etp", "optimizer": "optim.name", "muon_ns_steps": "optim.muon.ns_steps",
    "qk_clip": "optim.muon.qk_clip",
}
_MISSING = object()


def override_key(override: str) -> str:
    """The key of a Hydra override as typed: `+experiment=gpt1t` -> experiment, `~a.b` -> a.b."""
    return override.lstrip("+~").split("=", 1)[0].strip()


def _value(x: Any) -> str:
    if isinstance(x, bool):
        return str(x).lower()
    return "null" if x is None else str(x)


def layout_overrides(lay: Layout, base: Mapping[str, Any], cl: Cluster | None = None) -> list[str]:
    """`key=value` for every field of `lay` whose config key holds another value in `base` (config key -> value,
    e.g. `{"parallel.tp": 8, ...}`, read from the config that the launch line's other overrides compose; a key
    missing from `base` is always named). With `cl`, attention compares as resolved on that cluster (`auto` is
    `flash` there in half precision, so a layout with flash needs no override)."""
    out = []
    for name, key in LAYOUT_KEYS.items():
        want, have = getattr(lay, name), base.get(key, _MISSING)
        if name == "attention" and cl is not None and have is not _MISSING and have is not None:
            have = resolve_attention(str(have), cl, lay.precision)
        if have is _MISSING or _value(want) != _value(have):
            out.append(f"{key}={_value(want)}")
    return out


def config_values(cfg: RunConfig) -> dict[str, Any]:
    """The LAYOUT_KEYS of a run config (config key -> value; parallel.dp as composed, null until resolved)."""
    lay = Layout.of(cfg)
    return {key: getattr(lay, name) for name, key in LAYOUT_KEYS.items()} | {"parallel.dp": cfg.parallel.dp}


def run_overrides(overrides: list[str] | None, experiment: str | None) -> list[str]:
    """The run's own command-line overrides as a launch line carries them: the experiment as `+experiment=NAME`
    (first), without `dry_run` and without Hydra's own keys (the launch line picks the launcher)."""
    out = [f"+experiment={experiment}"] if experiment else []
    for o in overrides or []:
        key = override_key(o)
        if key == "dry_run" or key.startswith(("hydra.", "hydra/")) or key == "hydra":
            continue
        if key == "experiment":
            o = "+experiment=" + o.split("=", 1)[1]
            if o in out:
                continue
        out.append(o)
    return out


def launch_command(lay: Layout, cl: Cluster, experiment: str | None = None, overrides: list[str] | None = None,
                   base: Mapping[str, Any] | None = None, slurm: bool = True) -> str:
    """The command that launches `lay`: the SLURM launch (one task per GPU, tasks_per_node = GPUs per node), or a
    local one for the nominal CPU device or with `slurm=False` (trainer.num_nodes and trainer.devices, no launcher:
    it runs on one node as it is, under an external launcher on several, and plans anywhere with dry_run=true).

    It carries the run's own overrides (`overrides`, as Hydra recorded them, and the `experiment`), the launcher's
    resources, and, when `base` is given (the config those overrides compose, as `config_values` reads it),
    every layout key in which `lay` differs from it -- so that pasted, it composes the same run and plans the
    same layout. A dry run passes no `base`: its layout is its config.
    """
    gpus_per_node = min(cl.gpus_per_node, lay.gpus)
    nodes = math.ceil(lay.gpus / gpus_per_node)
    args = ["python", "-m", "mlplat.train"]
    if cl.device.nominal:
        launcher = [f"trainer.devices={lay.gpus}"]
    elif not slurm:
        launcher = [f"trainer.num_nodes={nodes}", f"trainer.devices={gpus_per_node}"]
    else:
        args += ["-m", "hydra/launcher=submitit_slurm"]
        launcher = [f"hydra.launcher.nodes={nodes}", f"hydra.launcher.gpus_per_node={gpus_per_node}",
                    f"hydra.launcher.tasks_per_node={gpus_per_node}",
                    f"trainer.num_nodes={nodes}", f"trainer.devices={gpus_per_node}"]
    extra = layout_overrides(lay, base, cl) if base is not None else []
    mine = {override_key(o) for o in launcher + extra}
    args += [o for o in run_overrides(overrides, experiment) if override_key(o) not in mine]
    args += extra + launcher
    return " ".join(shlex.quote(a) for a in args)


def launch_overrides(command: str) -> list[str]:
    """The Hydra overrides of a printed launch line (after `python -m mlplat.train [-m]`), for composing it."""
    words = shlex.split(command)
    i = words.index("mlplat.train") + 1
    return [w for w in words[i:] if w != "-m"]


def plan(cfg: RunConfig, *, experiment: str | None = None, overrides: list[str] | None = None,
         use_meta: bool = True, method: str = "simulate", max_compute_ops: int = 400_000,
         signal_delay_s: float | None = None) -> dict:
    """Everything `python -m mlplat.train ... dry_run=true` reports, as a JSON-able dict.

    `cfg`: the validated run config. `experiment` (the `experiment=` name) and `overrides` (the run's own
    command-line overrides, as Hydra recorded them): what the launch command carries, so that pasted it composes
    `cfg` again. `signal_delay_s`: the SLURM launcher's preemption lead, if it is the run's launcher; a lead too
    short for the notice's checkpoint is a warning. Raises ValueError naming the broken rule if the layout is
    impossible.
    """
    dims = ModelDims.of(cfg.model)
    cl = Cluster.of(cfg.cluster, cfg.trainer.accelerator)
    lay = Layout.of(cfg)
    attention = resolve_attention(lay.attention, cl, lay.precision)
    if lay.cp > 1 and cfg.data.pack and not cl.device.nominal:
        attention = "unfused"  # a GPU's ring blocks of packed documents run in math (parallel/context.block_kernel)
    lay = dataclasses.replace(lay, attention=attention)
    errors = layout_errors(dims, lay, cl.gpus_per_node)
    if lay.fp8 != "none" and "fp8" not in cl.device.peak_tflops:
        errors.append(f"kernels.fp8={lay.fp8} needs FP8 tensor cores: cluster.device={cl.device.name} has none "
                      f"(plan it on h100-sxm, h200 or another device with an fp8 peak)")
    if errors:
        raise ValueError(errors[0])
    t, p, v, m = lay.tp, lay.pp, lay.vpp, lay.num_micro_batches

    closed_total = parameter_count(dims, t)
    closed_stage = stage_parameters(dims, t, lay.pipeline)
    if use_meta and _model_available():
        total, per_stage = meta_parameter_counts(cfg.model, lay)
        source = "meta-device model"
    else:
        total, per_stage, source = closed_total, closed_stage, "closed form"

    mem = memory_per_stage(dims, lay, per_stage, overhead_bytes=cl.overhead_gib * 1024**3)
    worst = max(mem, key=lambda r: r.total)
    # Beside any other pipeline schedule, the activations (and W residue) 1F1B would hold on its worst rank.
    base = dataclasses.replace(lay, schedule="1f1b", vpp=1)
    if base.pipeline.violations(dims.n_layers):  # an uneven split of p·v chunks need not split p stages: try even
        base = dataclasses.replace(base, first_stage_layers=None, last_stage_layers=None)
    acts_1f1b = (max(r.breakdown["activations"] for r in memory_per_stage(dims, base, per_stage))
                 if p > 1 and lay.schedule != "1f1b" and not base.pipeline.violations(dims.n_layers) else None)
    n_messages, one_message = messages_in_flight(lay), message_bytes(dims, lay)
    pred = predict(dims, lay, cl, parameters=per_stage, method=method, max_compute_ops=max_compute_ops)
    secs = pred.seconds_per_iteration
    gpus = lay.gpus
    hw = hardware_flops_per_iteration(dims, lay.global_batch_size, lay.recompute, t)
    mf = model_flops_per_iteration(dims, lay.global_batch_size, t)
    peak = peak_flops(cl.device, lay.precision)
    tokens = lay.global_batch_size * dims.seq_len
    warnings = _warnings(cfg, lay, cl, worst, gpus)
    lead = notice_lead(secs, total, lay.precision, cfg.cluster.fs_write_gbps)
    if signal_delay_s is not None and (short := lead.shortfall(signal_delay_s)):
        warnings.append(short)
    costs = pred.costs
    ring = _ring_report(dims, lay, cl, costs, worst) if lay.cp > 1 else {}
    experts = _experts_report(dims, lay, cl, costs, per_stage) if dims.moe_layers else {}
    return {
        "model": dims.config_keys(),
        "cluster": {"name": cl.name, "device": cl.device.name, "gpus_per_node": cl.gpus_per_node,
                    "gpu_memory_gb": cl.gpu_memory_gb, "peak_tflops": peak / 1e12,
                    "nominal": cl.device.nominal and cl.host is None, "measured": cl.host is not None},
        "layout": _layout_report(dims, lay, cl),
        "parameters_total": int(total),
        "parameters_closed_form": int(closed_total),
        "parameters_source": source,
        "parameters_per_stage": [int(x) for x in per_stage],
        "parameters_per_gpu_max": int(max(per_stage)),
        "memory_per_gpu_bytes": int(worst.total),
        "memory_worst_pipeline_rank": worst.pipeline_rank,
        "memory_breakdown_bytes": {k: int(x) for k, x in worst.breakdown.items()},
        "memory_per_stage_bytes": [int(r.total) for r in mem],
        "activations_1f1b_bytes": None if acts_1f1b is None else int(acts_1f1b),
        "context_parallel": ring,
        "experts": experts,
        "messages_in_flight": n_messages,
        "message_bytes": int(one_message),
        "message_dtype_bytes": precision_of(lay.precision).compute_bytes,
        "gpu_memory_bytes": int(cl.memory_bytes),
        "fits": worst.total <= cl.usable_memory_bytes,
        "flops_per_iteration": hw,
        "model_flops_per_iteration": mf,
        "predicted_seconds_per_iteration": secs,
        "predicted_tflops_per_gpu": hw / secs / gpus / 1e12,
        "predicted_model_tflops_per_gpu": mf / secs / gpus / 1e12,
        "predicted_mfu": mf / secs / gpus / peak,
        "predicted_aggregate_pflops": hw / secs / 1e15,
        "predicted_tokens_per_second": tokens / secs,
        "bubble_fraction": pred.bubble_fraction,
        "bubble_fraction_formula": paper_bubble(lay.schedule, p, v, m),
        "prediction_method": pred.method,
        "time_breakdown_seconds": _time_breakdown(pred, p),
        "preemption": {"notice_steps": NOTICE_STEPS, "checkpoint_bytes": lead.checkpoint_bytes,
                       "save_seconds": lead.save_seconds, "lead_seconds": lead.seconds,
                       "signal_delay_s": signal_delay_s},
        "slurm_command": launch_command(lay, cl, experiment, overrides),
        "warnings": warnings,
    }


def _time_breakdown(pred, p: int) -> dict:
    """Where a step's predicted time goes: the pipeline, what of the data-parallel collectives and the optimizer is
    exposed, one layer's passes and collectives."""
    costs = pred.costs
    return {
        "pipeline": pred.pipeline_seconds, "dp_allreduce_exposed": pred.dp_exposed_seconds,
        "dp_allgather_exposed": pred.dp_allgather_exposed_seconds,
        "optimizer": pred.optimizer_seconds, "layer_forward": costs.layer_forward,
        # Muon: the busiest rank's Newton–Schulz and tp all-gathers, within "optimizer"
        **({"optimizer_newton_schulz": pred.optimizer_newton_schulz_seconds,
            "optimizer_muon_gathers": pred.optimizer_gather_seconds} if pred.optimizer_newton_schulz_seconds else {}),
        **({"qk_clip_logits_per_layer_forward": costs.breakdown["qk_clip_logits_forward"]}
           if "qk_clip_logits_forward" in costs.breakdown else {}),
        "layer_backward": costs.layer_backward, "tp_allreduce_per_layer_forward": costs.tp_forward,
        "stage_transfer": costs.transfer if p > 1 else 0.0,
        "cp_ring_exposed_per_layer_forward": costs.cp_forward,
        "cp_ring_exposed_per_layer_backward": costs.cp_backward,
        # CPU processes: the last rank's passes split into compute and blocking messages
        **{k: costs.breakdown[k] for k in ("rank_compute", "rank_messages") if k in costs.breakdown},
        # sharded parameters: a layer's weight all-gather and what of it (and of its gradients' reduce-scatter) shows
        **({"gather_per_layer": costs.breakdown["gather_per_layer"],
            "gather_exposed_per_layer_forward": costs.gather_forward,
            "gather_exposed_per_layer_backward": costs.gather_backward} if "gather_per_layer" in costs.breakdown
           else {}),
    }


def _warnings(cfg: RunConfig, lay: Layout, cl: Cluster, worst, gpus: int) -> list[str]:
    """What the plan says of the layout on its cluster: memory, nodes, the trainer's device count."""
    warnings = []
    if worst.total > cl.usable_memory_bytes:
        warnings.append(f"pipeline rank {worst.pipeline_rank} needs {worst.total / 2**30:.1f} GiB per GPU, more than "
                        f"{cl.usable_fraction:.0%} of cluster.gpu_memory_gb={cl.gpu_memory_gb:g}")
    if cl.nodes is not None and math.ceil(gpus / cl.gpus_per_node) > cl.nodes:
        warnings.append(f"the layout needs {math.ceil(gpus / cl.gpus_per_node)} nodes, cluster.nodes={cl.nodes}")
    tr = cfg.trainer
    if tr.devices is not None and tr.devices * tr.num_nodes != gpus:
        warnings.append(f"trainer.devices·trainer.num_nodes={tr.devices * tr.num_nodes} "
                        f"differs from the layout's {'t·c·p·d' if lay.cp > 1 else 't·p·d'}={gpus}")
    return warnings


def _layout_report(dims: ModelDims, lay: Layout, cl: Cluster) -> dict:
    gpus = lay.gpus
    return {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "vpp": lay.vpp, "dp": lay.dp, "micro": lay.micro_batch_size,
            "global": lay.global_batch_size, "gpus": gpus, "nodes": math.ceil(gpus / cl.gpus_per_node),
            "micro_batches": lay.num_micro_batches, "chunk_layers": lay.pipeline.chunk_layers(dims.n_layers),
            "uneven": lay.pipeline.uneven, "schedule": lay.schedule, "recompute": lay.recompute,
            "precision": lay.precision, "attention": lay.attention, "fused": lay.fused,
            "scatter_gather": lay.scatter_gather, "sequence_parallel": lay.sequence_parallel,
            "distributed_optimizer": lay.distributed_optimizer, "sharding": lay.sharding, "dp_shard": lay.dp_shard,
            "grad_reduce_dtype": lay.grad_reduce_dtype, "optimizer": lay.optimizer,
            **({"muon_ns_steps": lay.muon_ns_steps, "qk_clip": lay.qk_clip} if lay.optimizer == "muon" else {}),
            "fp8": lay.fp8, "fp8_gemms": fp8_gemm_path(lay.fp8, "cpu" if cl.device.name == "cpu" else "cuda",
                                                       precision_of(lay.precision).compute_dtype)
            if lay.fp8 != "none" else None, "ep": lay.ep, "etp": lay.expert_tp}


def _ring_report(dims: ModelDims, lay: Layout, cl: Cluster, costs, worst) -> dict:
    """The context-parallel ring of one layer, per micro-batch (mlplat.perf.cluster.ring_times)."""
    bd = costs.breakdown
    return {"cp": lay.cp, "tokens_per_rank": dims.seq_len // lay.cp, "chunk_tokens": dims.seq_len // (2 * lay.cp),
            "kv_block_bytes": int(kv_block_bytes(dims, lay)), "dkv_block_bytes": int(dkv_block_bytes(dims, lay)),
            "ring_buffer_bytes": int(worst.breakdown.get("ring_buffers", 0)),
            "link": "inter-node" if cp_inter_node(lay, cl) else "intra-node",
            "transfer_seconds": bd.get("cp_transfer", 0.0),
            "block_forward_seconds": bd.get("cp_block_forward", 0.0),
            "block_backward_seconds": bd.get("cp_block_backward", 0.0),
            "exposed_forward_seconds": costs.cp_forward, "exposed_backward_seconds": costs.cp_backward}


def _experts_report(dims: ModelDims, lay: Layout, cl: Cluster, costs, per_stage) -> dict:
    """The experts' layout and one MoE layer's dispatch, per micro-batch (mlplat.perf.cluster)."""
    bd, moe = costs.breakdown, dims.moe
    return {"ep": lay.ep, "etp": lay.expert_tp, "edp": lay.edp, "local_experts": moe.num_experts // lay.ep,
            "dispatcher": moe.dispatcher, "imbalance": moe.plan_imbalance,
            "routed_tokens": routed_tokens(dims, lay), "busiest_assignments": expert_assignments(dims, lay),
            "link": "intra-node" if expert_links(lay, cl) == lay.ep else "inter-node",
            "expert_parameters_per_gpu": max(e for _, e in expert_split(dims, lay, per_stage)),
            "dispatch_buffer_bytes": int(dispatch_buffer_bytes(dims, lay)),
            "dispatch_seconds": bd.get("moe_dispatch", 0.0), "gates_seconds": bd.get("moe_gates", 0.0),
            "split_sync_seconds": bd.get("moe_split_sync", 0.0),
            "token_collectives": token_collectives(moe.dispatcher),
            "gemm_path": experts_gemm_path(lay.precision, cl, lay.fp8), "fp8": lay.fp8,
            "fp8_forward": experts_fp8_forward(lay.precision, cl, lay.fp8) if lay.fp8 != "none" else None,
            "gemm_dtype": "float32" if lay.fp8 != "none" else precision_of(lay.precision).weight_dtype,
            "loop_seconds": [bd.get("moe_expert_loop_forward", 0.0), bd.get("moe_expert_loop_backward", 0.0)],
            "extra_forward_seconds": costs.moe_forward, "extra_backward_seconds": costs.moe_backward,
            "timed": "moe_extra_forward" in bd}


def _gib(x: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= div or unit == "KiB":
            return f"{x / div:.1f} {unit}"
    return f"{x:.0f} B"  # pragma: no cover


def _count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _messages_line(pl: Mapping[str, Any]) -> str:
    L, md = pl["layout"], pl["model"]
    n, one = pl["messages_in_flight"], pl["message_bytes"]
    if L["pp"] < 2:
        return "messages    none in flight (no pipeline)"
    split = L["scatter_gather"] or L["sequence_parallel"]
    c = L.get("cp", 1)
    seq = f"{md['seq_len']}/{c}" if c > 1 else f"{md['seq_len']}"
    shape = f"[{L['micro']}, {seq}, {md['hidden']}{'/' + str(L['tp']) if split and L['tp'] > 1 else ''}]"
    return (f"messages    {n} in flight at most on a pipeline rank (sends not yet released + receives posted ahead) "
            f"x {_gib(one)} ({shape}, {pl['message_dtype_bytes']}-byte elements) = {_gib(n * one)} per GPU, "
            "counted in memory/GPU")


def _context_line(pl: Mapping[str, Any]) -> str:
    """The context-parallel ring: the split, the K/V blocks and their link, and what of the ring is exposed."""
    L, md, r = pl["layout"], pl["model"], pl["context_parallel"]
    c, t = r["cp"], L["tp"]
    kv, d = max(1, md["n_kv_heads"] // t), md.get("head_dim") or md["hidden"] // md["n_heads"]
    block = f"[2, {L['micro']}, {r['tokens_per_rank']}, {kv}, {d}]"
    if md.get("attention") == "mla":  # the latents [c_kv | k_rope] (docs/parallelism.md)
        m = md["mla"]
        block = f"[{L['micro']}, {r['tokens_per_rank']}, {m['kv_lora_rank']}+{m['qk_rope_head_dim']}] (latent)"
    ms = lambda x: f"{x * 1e3:.2f} ms"  # noqa: E731
    return (f"context     c={c}: each rank holds {r['tokens_per_rank']:,} tokens of each sequence (chunks i and "
            f"{2 * c - 1}-i of {2 * c}, {r['chunk_tokens']:,} each); ring over the cp group ({r['link']}): "
            f"K/V block {block} = "
            f"{_gib(r['kv_block_bytes'])}, {ms(r['transfer_seconds'])} a transfer vs one block's attention "
            f"{ms(r['block_forward_seconds'])} fwd / {ms(r['block_backward_seconds'])} bwd; exposed per layer "
            f"{ms(r['exposed_forward_seconds'])} fwd ({c - 1} K/V transfers), "
            f"{ms(r['exposed_backward_seconds'])} bwd ({c - 1} K/V + {c} dK/dV"
            f"{', + the recomputed forward' if L['recompute'] in ('full', 'selective') else ''}); ring buffers "
            f"2 x {_gib(r['kv_block_bytes'])} + 2 x {_gib(r['dkv_block_bytes'])} = {_gib(r['ring_buffer_bytes'])} "
            f"per GPU (2 K/V + 2 dK/dV, these in the ring's accumulation dtype, while a layer's backward runs), "
            f"counted in memory/GPU; gradients reduced over d·c={L['dp'] * c} ranks")


def _experts_line(pl: Mapping[str, Any]) -> str:
    """The experts' layout and what one MoE layer's dispatch costs (mlplat.perf.cluster.moe_layer_costs)."""
    x, h = pl["experts"], pl["model"]["hidden"]
    ms = lambda v: f"{v * 1e3:.2f} ms"  # noqa: E731
    forward, backward = x["token_collectives"]
    dispatch = (f"{x['dispatcher']} over the ep group ({x['link']}): [{x['routed_tokens']:g} tokens x top-"
                f"{pl['model']['moe']['top_k']}, {h}] out and back, {ms(x['dispatch_seconds'])} a collective"
                f"{' (their mean)' if forward > 2 else ''}, {forward + backward} per layer and micro-batch "
                f"({forward} forward, {backward} backward) + the routing's {ms(x['gates_seconds'])} "
                f"each way + the split sizes' sync {ms(x['split_sync_seconds'])} per forward"
                if x["ep"] > 1 else "no dispatch (ep=1)")
    path, dtype = x["gemm_path"], x["gemm_dtype"]
    gemms = {"grouped": f"one grouped GEMM (torch._grouped_mm) in {dtype}",
             "grouped-bf16": f"one grouped GEMM (torch._grouped_mm) on bf16 casts of the {dtype} operands, whose "
                             f"kernel is bf16's",
             "loop": f"one GEMM per expert in {dtype} (no grouped kernel), the counts read on the host per forward "
                     f"GEMM, {ms(x['loop_seconds'][0])} fwd / {ms(x['loop_seconds'][1])} bwd of host time"}[path]
    if x.get("fp8", "none") != "none":  # mlplat.parallel.fp8_experts, mlplat.parallel.fp8_grouped
        forward = x.get("fp8_forward")
        if forward == "torch._scaled_grouped_mm":
            gemms = (f"FP8 {x['fp8']} (per-expert weight scales, per-token-row activations): the forward through "
                     f"torch._scaled_grouped_mm into bf16, dX and dW emulated: {gemms}")
        elif forward in (None, "grouped", "loop"):
            gemms = f"FP8 {x['fp8']} emulated (per-expert weight scales, per-token-row activations): {gemms}"
        else:  # before a probe's verdict, without the device's capability: the rule
            gemms = f"FP8 {x['fp8']} (per-expert weight scales, per-token-row activations): {forward}, else " \
                    f"emulated; dX and dW emulated: {gemms}"
    return (f"experts     etp={x['etp']} ep={x['ep']} edp={x['edp']}: {x['local_experts']} experts per GPU "
            f"({_count(x['expert_parameters_per_gpu'])} parameters, their optimizer state over edp), {gemms}; "
            f"{dispatch}; "
            f"busiest rank {x['busiest_assignments']:g} assignments (imbalance {x['imbalance']:g} max/mean); "
            + (f"an MoE layer costs {ms(x['extra_forward_seconds'])} fwd / {ms(x['extra_backward_seconds'])} bwd more "
               "than a dense one" if x["timed"] else "the measured CPU model does not time the experts yet")
            + f"; dispatch buffers {_gib(x['dispatch_buffer_bytes'])}, counted in memory/GPU")


def _preemption_line(pr: Mapping[str, Any]) -> str:
    """What a preemption notice's checkpoint needs of the launcher's lead (mlplat.perf.preemption)."""
    save = (f"{pr['save_seconds']:.0f} s at cluster.fs_write_gbps" if pr["save_seconds"] is not None
            else "its time unknown without cluster.fs_write_gbps")
    given = f"; hydra.launcher.signal_delay_s={pr['signal_delay_s']:g}" if pr["signal_delay_s"] is not None else ""
    return (f"preemption  a notice's checkpoint starts up to {pr['notice_steps']} steps later and writes "
            f"{pr['checkpoint_bytes'] / 1e12:.3g} TB ({save}): it needs {pr['lead_seconds']:.0f} s of lead or "
            f"more{given}")


def model_line(md: Mapping[str, Any]) -> str:
    """The model part of the summary's first line: `GPT l=.. h=.. a=.. s=.. V=..` for the paper's GPT; with the
    key/value heads, the MLP width and the architecture's choices otherwise, e.g. `Llama l=126 h=16384 a=128 kv=8
    f=53248 s=8192 V=128256 (RoPE, RMSNorm, SwiGLU, untied output)`."""
    dims = ModelDims.from_config(md)
    head = f"{dims.label} l={dims.n_layers} h={dims.hidden} a={dims.n_heads}"
    tail = f"s={dims.seq_len} V={dims.vocab_size}"
    # The paper's GPT: its GEMMs' shapes, and GPT's own MLP (another of the same weights is named below)
    if dims.arch == "gpt" and dims.is_paper_gpt and dims.mlp == ARCHS["gpt"]["mlp"] and dims.position == "learned" \
            and dims.tie_embeddings:
        return f"{head} {tail}"
    rope = f"RoPE on {dims.rotary_dim} of d" if dims.position == "rope" and dims.rotary_dim else "RoPE"  # partial
    choices = [{"rope": rope, "learned": "learned positions"}[dims.position],
               {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}[dims.norm],
               dims.mlp_entry.label,
               *([_attention_label(dims)] if dims.attention != attentions.DEFAULT else []),
               "tied embeddings" if dims.tie_embeddings else "untied output",
               *(["QKV bias"] if dims.has_qkv_bias and not dims.bias else []),
               *(["q/k norms"] if dims.qk_norm else []),
               *(["biases"] if dims.bias else [])]
    moe = dims.moe
    if dims.moe_layers:  # e.g. `8 experts of f=128, top-2, 1 shared, from layer 1`
        choices.append(f"{moe.num_experts} experts of f={dims.expert_ffn}, top-{moe.top_k}"
                       + (f" by {moe.router}" if moe.router != "softmax" else "")
                       + (f" in {moe.topk_groups} of {moe.n_groups} groups" if moe.n_groups > 1 else "")
                       + (f" scaled {moe.routed_scaling_factor:g}" if moe.routed_scaling_factor != 1 else "")
                       + (f", {moe.shared_experts} shared" if moe.shared_experts else "")
                       + (f", from layer {moe.dense_layers}" if moe.dense_layers else ""))
    if dims.mtp.enabled:  # e.g. `2 MTP modules`
        choices.append(f"{dims.mtp.depth} MTP module{'s' if dims.mtp.depth > 1 else ''}")
    d = f" d={dims.head_size}" if dims.attention_width != dims.hidden else ""  # model.head_dim set apart from h/a
    return f"{head} kv={dims.kv_heads}{d} f={dims.ffn} {tail} ({', '.join(choices)})"


def _attention_label(dims: ModelDims) -> str:
    """The attention's name, with MLA's head shapes (latents, q/k channels without and with rotary, v)."""
    if dims.attention != "mla":
        return dims.attention_entry.label
    m = dims.mla
    q = f"q latent {m.q_lora_rank}, " if m.q_lora_rank else ""
    return (f"{dims.attention_entry.label} ({q}kv latent {m.kv_lora_rank}, q/k {m.qk_nope_head_dim}+"
            f"{m.qk_rope_head_dim} rotary, v {m.v_head_dim})")


def format_plan(pl: Mapping[str, Any]) -> str:
    """A readable summary of `plan(...)`."""
    L, md, cl = pl["layout"], pl["model"], pl["cluster"]
    bd = pl["memory_breakdown_bytes"]
    tb = pl["time_breakdown_seconds"]
    lines = [
        f"mlplat dry run: {model_line(md)} on {cl['name']} "
        f"({cl['device']}{', nominal figures' if cl['nominal'] else ''}"
        f"{', figures measured on the machine' if cl.get('measured') else ''})",
        f"layout      t={L['tp']}" + (f" c={L['cp']}" if L.get("cp", 1) > 1 else "")
        + f" p={L['pp']} v={L['vpp']} d={L['dp']} = {L['gpus']} GPUs on {L['nodes']} node(s); "
        f"micro-batch {L['micro']}, global batch {L['global']}, m={L['micro_batches']} micro-batches/pipeline, "
        f"{L['schedule']}, recompute={L['recompute']}{', sequence parallel' if L['sequence_parallel'] else ''}, "
        f"{L['precision']}, attention={L['attention']}"
        # MLA: no flash-attn (one head size for q, k and v), by rule (mlplat.model.attention.resolve_backend)
        + (" (SDPA's kernels: flash-attn 2 takes one head size for q, k and v, MLA's values have their own)"
           if md.get("attention") == "mla" and L["attention"] == "flash" else "")
        + (", distributed optimizer" if L.get("sharding", "optim" if L.get("distributed_optimizer") else "none")
           == "optim" else "")
        + (", parameters sharded (ZeRO-3" + (f", HSDP over groups of {L['dp_shard']}" if L.get("dp_shard") else "")
           + ")" if L.get("sharding") == "params" else "")
        + (f", FP8 GEMMs ({L['fp8']}, {L['fp8_gemms']})" if L.get("fp8", "none") != "none" else "")
        + (f"; layers per chunk {layer_runs(L['chunk_layers'])}" if L.get("uneven") else ""),
        f"parameters  total {_count(pl['parameters_total'])} ({pl['parameters_source']}; closed form "
        f"{_count(pl['parameters_closed_form'])}), per GPU max {_count(pl['parameters_per_gpu_max'])}, "
        f"per stage [{', '.join(_count(x) for x in pl['parameters_per_stage'][:8])}"
        f"{', ...' if len(pl['parameters_per_stage']) > 8 else ''}]",
        f"memory/GPU  {_gib(pl['memory_per_gpu_bytes'])} of {_gib(pl['gpu_memory_bytes'])} on pipeline rank "
        f"{pl['memory_worst_pipeline_rank']} ({'fits' if pl['fits'] else 'DOES NOT FIT'}): "
        + ", ".join(f"{k} {_gib(x)}" for k, x in bd.items())
        + (f" (activations under 1f1b: {_gib(pl['activations_1f1b_bytes'])})"
           if pl.get("activations_1f1b_bytes") is not None else ""),
        *([_context_line(pl)] if pl.get("context_parallel") else []),
        *([_experts_line(pl)] if pl.get("experts") else []),
        _messages_line(pl),
        f"FLOPs/iter  {pl['flops_per_iteration']:.3e} executed (paper's count), "
        f"{pl['model_flops_per_iteration']:.3e} model",
        f"predicted   {pl['predicted_seconds_per_iteration']:.4g} s/iteration, {pl['predicted_tflops_per_gpu']:.4g} "
        f"TFLOP/s per GPU ({pl['predicted_tflops_per_gpu'] / cl['peak_tflops']:.0%} of {cl['peak_tflops']:g}), "
        f"MFU {pl['predicted_mfu']:.1%}, aggregate {pl['predicted_aggregate_pflops']:.4g} PFLOP/s, "
        f"{pl['predicted_tokens_per_second']:,.0f} tokens/s",
        f"bubble      {pl['bubble_fraction']:.3f} simulated ({pl['prediction_method']}); formula "
        f"{pl['bubble_fraction_formula']:.3f}",
        f"time        pipeline {tb['pipeline']:.3f} s, exposed DP "
        + (f"reduce-scatter {tb['dp_allreduce_exposed']:.3f} s, all-gather {tb['dp_allgather_exposed']:.3f} s, "
           if L.get("distributed_optimizer") else f"all-reduce {tb['dp_allreduce_exposed']:.3f} s, ")
        + f"optimizer {tb['optimizer']:.3f} s"
        + (f" (Muon: Newton–Schulz {tb['optimizer_newton_schulz']:.3f} s, tp gathers "
           f"{tb['optimizer_muon_gathers']:.3f} s)" if "optimizer_newton_schulz" in tb else "")
        + f"; per layer fwd {tb['layer_forward'] * 1e3:.2f} ms, "
        f"bwd {tb['layer_backward'] * 1e3:.2f} ms, TP all-reduces {tb['tp_allreduce_per_layer_forward'] * 1e3:.2f} ms, "
        f"stage transfer {tb['stage_transfer'] * 1e3:.2f} ms"
        + (f", cp ring exposed {tb['cp_ring_exposed_per_layer_forward'] * 1e3:.2f} ms fwd / "
           f"{tb['cp_ring_exposed_per_layer_backward'] * 1e3:.2f} ms bwd" if L.get("cp", 1) > 1 else "")
        + (f", weight gathers {tb['gather_per_layer'] * 1e3:.2f} ms per layer (exposed "
           f"{tb['gather_exposed_per_layer_forward'] * 1e3:.2f} ms fwd / "
           f"{tb['gather_exposed_per_layer_backward'] * 1e3:.2f} ms bwd)" if "gather_per_layer" in tb else ""),
        _preemption_line(pl["preemption"]),
        f"launch      {pl['slurm_command']}",
    ]
    lines += [f"WARNING     {w}" for w in pl["warnings"]]
    return "\n".join(lines)


def run_dry(cfg: RunConfig, run_dir: Any = None, *, experiment: str | None = None,
            overrides: list[str] | None = None, signal_delay_s: float | None = None) -> dict:
    """What `python -m mlplat.train ... dry_run=true` does: plan, print the summary, write plan.json.

    `experiment`: the `experiment=` choice (Hydra's runtime choices) and `overrides`: the run's own overrides
    (train.py passes those of the running Hydra job), for the launch command; `run_dir` gets plan.json when given;
    `signal_delay_s`: the SLURM launcher's preemption lead when that launcher is composed.
    """
    import json
    from pathlib import Path

    pl = plan(cfg, experiment=experiment, overrides=overrides, signal_delay_s=signal_delay_s)
    print(format_plan(pl))
    if run_dir is not None:
        path = Path(run_dir) / "plan.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(pl, indent=1) + "\n")
        print(f"plan written to {path}")
    return pl
