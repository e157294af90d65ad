"""The rules of a run configuration that the values alone decide, each refused in one line naming the key, the value
and the rule (e.g. ``model.n_heads=12 is not divisible by parallel.tp=8``), and what they imply: dp,
trainer.devices, the layout facts (`mlplat.parallel.layout.dims.ParallelDims`). Nothing here reads a file or the
environment: the rules that do (the data, the tokenizer, an init_from directory, the machine, a checkpoint, a W&B
key) are `mlplat.train`'s `load_checked` and `preflight`."""
from __future__ import annotations

import math
import struct
from dataclasses import fields, replace
from typing import Any, Mapping

from mlplat.config.schema import (
    ACCELERATORS,
    ACTIVATIONS,
    ARCHS,
    ATTENTION_BACKENDS,
    CPU_KEYS,
    DATA_NAMES,
    GRAD_REDUCE_DTYPES,
    LOGGERS,
    MIN_TEMPERATURE,
    MUON_UPDATE_SCALES,
    NORMS,
    POSITIONS,
    PRECISIONS,
    RECOMPUTE,
    RING_KERNELS,
    ROPE_SCALING_KEYS,
    SHARDINGS,
    WANDB_MODES,
    WANDB_PROJECT_FORBIDDEN,
    YARN_KEYS,
    YARN_OPTIONAL_KEYS,
    ClusterConfig,
    DataConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    MuonConfig,
    ParallelConfig,
    ProfileConfig,
    RunConfig,
    SampleConfig,
    TrainerConfig,
    _require,
    from_raw,
)
from mlplat.errors import ConfigError
from mlplat.optim import factory as optimizers
from mlplat.parallel.layout import registry
from mlplat.parallel.layout.dims import ParallelDims
from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.precision import FP8_BLOCK, FP8_RECIPES
from mlplat.precision import TABLE as _PRECISION_TABLE
from mlplat.specs import attentions, dispatchers, mlps, routers


def _devices(t: TrainerConfig) -> str:
    """`trainer.devices=4`, or `trainer.devices·trainer.num_nodes=4·2=8` on several nodes."""
    if t.num_nodes == 1:
        return f"trainer.devices={t.devices}"
    return f"trainer.devices·trainer.num_nodes={t.devices}·{t.num_nodes}={t.devices * t.num_nodes}"


def _layout(p: ParallelConfig) -> str:
    """`parallel.tp·parallel.pp·parallel.dp=2·2·1=4` (with parallel.cp among them when it is over 1)."""
    keys = [("tp", p.tp)] + ([("cp", p.cp)] if p.cp > 1 else []) + [("pp", p.pp), ("dp", p.dp)]
    return (f"{'·'.join('parallel.' + k for k, _ in keys)}={'·'.join(str(v) for _, v in keys)}"
            f"={p.world_size}")


def resolve_world(cfg: RunConfig, world_size: int | None = None) -> None:
    """Fill parallel.dp and trainer.devices from the layout (and the launcher's world size, if any)."""
    parallel_cfg, trainer_cfg = cfg.parallel, cfg.trainer
    mp = ParallelDims.of(parallel_cfg, dp=1).world_size  # t·c·p: the ranks of one data-parallel replica
    ranks = (f"parallel.tp·parallel.cp·parallel.pp={parallel_cfg.tp}·{parallel_cfg.cp}·{parallel_cfg.pp}={mp}"
             if parallel_cfg.cp > 1 else f"parallel.tp·parallel.pp={parallel_cfg.tp}·{parallel_cfg.pp}={mp}")
    if parallel_cfg.dp is None:
        if world_size is not None:
            _require(world_size % mp == 0, f"the launcher's world size {world_size} is not divisible by {ranks}")
            parallel_cfg.dp = world_size // mp
        elif trainer_cfg.devices is not None:
            total = trainer_cfg.devices * trainer_cfg.num_nodes
            _require(total % mp == 0, f"{_devices(trainer_cfg)} is not divisible by {ranks} "
                                      f"(parallel.dp=null is derived from it)")
            parallel_cfg.dp = total // mp
        else:
            parallel_cfg.dp = 1
    if trainer_cfg.devices is None:
        _require(parallel_cfg.world_size % trainer_cfg.num_nodes == 0,
                 f"the layout {_layout(parallel_cfg)} is not "
                 f"divisible by trainer.num_nodes={trainer_cfg.num_nodes} (trainer.devices=null is derived from it)")
        trainer_cfg.devices = parallel_cfg.world_size // trainer_cfg.num_nodes


def shape_violations(*, n_layers: int, hidden: int, n_heads: int, ffn: int, tp: int,
                     pipeline: PipelineLayout, n_kv_heads: int | None = None) -> list[str]:
    """The layout rules on the model's shape, one line per rule broken. Shared by `validate` (which refuses the
    first) and the planner/dry run in mlplat.perf (which list them all)."""
    problems = []
    if n_heads % tp:
        problems.append(f"model.n_heads={n_heads} is not divisible by parallel.tp={tp}")
    if n_kv_heads is not None and n_kv_heads % tp and tp % n_kv_heads:
        # Each tensor-parallel rank holds whole key/value heads with their query groups, or (fewer heads than
        # ranks) the one head its queries use, replicated on the t/n_kv_heads ranks sharing it.
        problems.append(f"model.n_kv_heads={n_kv_heads} and parallel.tp={tp} do not divide one another: each "
                        f"tensor-parallel rank holds whole key/value heads, or one head shared by tp/n_kv_heads ranks")
    if hidden % tp:
        problems.append(f"model.hidden={hidden} is not divisible by parallel.tp={tp}")
    if ffn % tp:
        problems.append(f"model.ffn_hidden={ffn} is not divisible by parallel.tp={tp}")
    return problems + pipeline.violations(n_layers)


def sequence_parallel_violations(*, sequence_parallel: bool, tp: int, seq_len: int) -> list[str]:
    """The rules of parallel.sequence_parallel: it splits the sequence over the t tensor-parallel ranks."""
    if not sequence_parallel:
        return []
    if tp < 2:
        return [f"parallel.sequence_parallel=true needs parallel.tp > 1 (parallel.tp={tp}): it splits the "
                f"sequence over the tensor-parallel ranks"]
    if seq_len % tp:
        return [f"model.seq_len={seq_len} is not divisible by parallel.tp={tp} (parallel.sequence_parallel=true "
                f"splits the sequence over the tensor-parallel ranks)"]
    return []


def ring_kernel(attention: str, device_type: str | None, cp: int) -> str:
    """The block kernel ring attention runs for kernels.attention under parallel.cp=cp on `device_type` ('cpu' |
    'cuda'; None: not known yet, only the name is checked): `auto` is sdpa, PyTorch's flash kernel, which returns
    the log-sum-exp (on a GPU its blocks run in math where the CUDA build cannot take them: packed documents, 32- or
    64-bit; `mlplat.parallel.context.block_kernel`). A kernel that cannot serve is a ValueError of one line."""
    if attention == "auto":
        return "sdpa"
    devices = RING_KERNELS.get(attention, ())
    if not devices or (device_type is not None and device_type not in devices):
        where = f" on {device_type}" if device_type is not None else ""
        raise ValueError(f"kernels.attention={attention} cannot run under parallel.cp={cp}{where}: ring attention "
                         f"merges K/V blocks by their log-sum-exp, which mlplat takes from math or sdpa (PyTorch's "
                         f"flash kernel); a flash-attn block kernel is not built; use kernels.attention=sdpa or auto")
    return attention


def ring_blocks_on_gpu(cfg: RunConfig) -> str | None:
    """Why ring attention's blocks would leave the fused kernel on a GPU, or None: the CUDA flash kernel takes
    fp16/bf16 and no mask, so packed documents or 32/64-bit compute run each hop in `math`, a materialised
    [b, heads/t, s/c, s/c] fp32 score block (about 4 GiB per block at 32k tokens, c = 4, 32 heads). Refused unless
    kernels.attention=math asks for that kernel by name (`mlplat.parallel.context.block_kernel` would fall back)."""
    p, k = cfg.parallel, cfg.kernels
    if p.cp == 1 or k.attention == "math":
        return None
    causes = (["data.pack=true (the kernel takes no document mask)"] if cfg.data.pack else []) + (
        [f"trainer.precision={cfg.trainer.precision} (the kernel computes in fp16/bf16 only)"]
        if not _PRECISION_TABLE[str(cfg.trainer.precision)].half else [])
    if not causes:
        return None
    m = cfg.model
    score = p.micro_batch_size * (m.n_heads // p.tp) * (m.seq_len // p.cp) ** 2 * 4
    return (f"parallel.cp={p.cp} on a GPU with {' and '.join(causes)}: ring attention's blocks would run in math, "
            f"an fp32 score block of {score / 2**30:.2f} GiB per hop instead of the flash kernel; set "
            f"kernels.attention=math to accept that, or drop the cause")


def context_parallel_violations(*, cp: int, seq_len: int, tp: int = 1, sequence_parallel: bool = False,
                                attention: str = "auto", dropout: float = 0.0) -> list[str]:
    """The rules of parallel.cp: the load-balanced split cuts every sequence into 2·c chunks (rank i holds chunks
    i and 2c-1-i), and ring attention merges K/V blocks by their log-sum-exp (mlplat.parallel.context)."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        return [f"parallel.cp={cp!r} must be a positive integer"]
    if cp == 1:
        return []
    problems = []
    if seq_len % (2 * cp):
        problems.append(f"model.seq_len={seq_len} is not divisible by 2·parallel.cp={2 * cp} (context parallelism "
                        f"cuts each sequence into 2·c chunks for a causal load balance)")
    elif sequence_parallel and (seq_len // cp) % tp:
        problems.append(f"model.seq_len/parallel.cp={seq_len // cp} is not divisible by parallel.tp={tp} "
                        f"(sequence parallelism splits each context-parallel rank's tokens over the tensor-parallel "
                        f"ranks)")
    try:
        ring_kernel(attention, None, cp)
    except ValueError as e:
        problems.append(str(e))
    if dropout > 0:
        problems.append(f"model.dropout={dropout} must be 0 under parallel.cp={cp}: ring attention has no dropout "
                        f"on the attention probabilities")
    return problems


def fp8_violations(*, fp8: str, precision: str, hidden: int, n_heads: int, n_kv_heads: int, ffn: int, tp: int,
                   cp: int, seq_len: int, head_dim: int, attention_splits: list[tuple[str, int]] | None = None
                   ) -> list[str]:
    """The rules of kernels.fp8. Blockwise scales never span two ranks, so every tensor-parallel shard (the split
    features of the QKV and fc1 outputs, of the output projection's and fc2's inputs) and every context-parallel
    chunk (s/2c tokens, the tiles of dW's product) holds whole 128-blocks. `attention_splits`: another attention's
    split widths in place of QKV's and the output projection's (`attention_splits` below)."""
    if fp8 == "delayed":  # docs/precision.md: why current scaling only
        return [f"kernels.fp8=delayed (scales from an amax history) is not built: current scaling only, one of "
                f"{', '.join(FP8_RECIPES)}"]
    if fp8 not in FP8_RECIPES:
        return [f"kernels.fp8={fp8!r} is not one of {', '.join(FP8_RECIPES)}"]
    if fp8 == "none":
        return []
    problems = []
    if _PRECISION_TABLE[precision].autocast:
        problems.append(f"kernels.fp8={fp8} cannot run under trainer.precision={precision}: autocast casts the "
                        f"GEMMs' inputs itself; use bf16-megatron (or 64-true, 32-true to verify)")
    if fp8 == "blockwise":
        qkv = (n_heads + 2 * n_kv_heads) * head_dim  # head_dim: ModelConfig.head_size, resolved
        # The output projection's input, a·d: h itself unless model.head_dim sets d.
        width = ("model.hidden", hidden) if n_heads * head_dim == hidden else \
            ("the attention width model.n_heads·model.head_dim", n_heads * head_dim)
        attention = ((*width, "parallel.tp", tp),
                     ("the QKV width (model.n_heads+2·model.n_kv_heads)·head size", qkv, "parallel.tp", tp))
        if n_kv_heads < tp:  # a rank's QKV rows: its query heads, then the shared key and value head
            attention = attention[:1]
            if head_dim % FP8_BLOCK:
                problems.append(f"kernels.fp8=blockwise with model.n_kv_heads={n_kv_heads} < parallel.tp={tp} needs "
                                f"a head size that is a multiple of {FP8_BLOCK} (a rank's QKV rows are its query "
                                f"heads and the replicated key and value heads, whole blocks only then): "
                                f"head size {head_dim}")
        if attention_splits is not None:
            attention = tuple((key, size, "parallel.tp", tp) for key, size in attention_splits)
        split = (*attention, ("model.ffn_hidden", ffn, "parallel.tp", tp),
                 ("model.seq_len", seq_len, "2·parallel.cp", 2 * cp if cp > 1 else 1))
        for key, size, by, parts in split:
            if parts > 1 and (size % parts or (size // parts) % FP8_BLOCK):
                problems.append(f"kernels.fp8=blockwise needs whole {FP8_BLOCK}-blocks on each rank: {key}={size} "
                                f"split by {by}={parts} is not a multiple of {FP8_BLOCK}·{parts}")
    return problems


def fp8_expert_violations(fp8: str, expert_ffn: int, etp: int) -> list[str]:
    """kernels.fp8's rule on the experts (mlplat.parallel.fp8_experts): blockwise's 128-blocks of an expert split over
    tp (parallel.etp) lie inside the shards, as the dense layers' do."""
    if fp8 == "blockwise" and etp > 1 and (expert_ffn // etp) % FP8_BLOCK:
        return [f"kernels.fp8=blockwise needs whole {FP8_BLOCK}-blocks on each rank: model.moe.ffn_hidden="
                f"{expert_ffn} split by parallel.etp={etp} is not a multiple of {FP8_BLOCK}·{etp}"]
    return []


def attention_splits(model: ModelConfig) -> list[tuple[str, int]] | None:
    """For fp8_violations: the widths a non-default attention splits over tp, its column GEMMs' outputs and its
    row GEMMs' inputs, each named (None: multi-head attention's, which fp8_violations names itself)."""
    entry = model.attention_entry
    if entry.name == attentions.DEFAULT:
        return None
    h, w = model.hidden, entry.shape(model)
    return [(f"model.attention={entry.name}'s {g.name} {'output' if g.split == 'column' else 'input'}",
             g.out(h, w) if g.split == "column" else g.inp(h, w))
            for g in entry.gemms_of(model) if g.split != "replicated"]


def batch_violations(dims: ParallelDims) -> list[str]:
    """The rules on the batch split: global = micro·m·dp, and m as the schedule needs it."""
    b, B, d, m = dims.micro_batch_size, dims.global_batch_size, dims.dp, dims.num_micro_batches
    if B % (b * d):
        return [f"parallel.global_batch_size={B} is not divisible by parallel.micro_batch_size·"
                f"parallel.dp={b}·{d}={b * d}"]
    return [f"{problem} (m = parallel.global_batch_size/(parallel.micro_batch_size·parallel.dp)="
            f"{B}/({b}·{d})={m})" for problem in dims.pipeline.micro_batch_violations(m)]


def _refuse_any(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems[0])


def expert_parallel_violations(dims: ParallelDims, num_experts: int) -> list[str]:
    """parallel.ep and parallel.etp against the layout and the experts (docs/moe.md)."""
    ep, etp = dims.ep, dims.etp
    if not isinstance(ep, int) or ep < 1:
        return [f"parallel.ep={ep!r} must be a positive integer"]
    if etp is not None and etp not in (1, dims.tp):
        return [f"parallel.etp={etp} must be 1 or parallel.tp={dims.tp} (or null)"]
    if ep == 1 and (etp is None or etp == dims.tp):
        return []
    if num_experts == 0:
        what = f"parallel.ep={ep}" if ep > 1 else f"parallel.etp={etp}"
        return [f"{what} lays out experts, but model.moe.num_experts=0 (a dense model)"]
    out = []
    if dims.expert_tp > 1:
        out.append(f"parallel.etp={dims.expert_tp} with parallel.ep={ep} is not built: experts split over ep "
                   f"ranks are whole (set parallel.etp=1)")
    elif dims.stage_ranks % ep:
        out.append(f"parallel.ep={ep} does not divide the {dims.stage_ranks} ranks of a pipeline stage "
                   f"(parallel.tp·parallel.cp·parallel.dp={dims.tp}·{dims.cp}·{dims.dp})")
    elif num_experts % ep:
        out.append(f"model.moe.num_experts={num_experts} is not divisible by parallel.ep={ep}")
    return out


def ep_node_violations(per_node: int | None, ep: int, devices: int, moe, node_dispatch: bool) -> list[str]:
    """parallel.ep_per_node (the node dispatcher's nodes, docs/moe.md): with that dispatcher alone, dividing ep and
    the node's ranks (a stage's ep ranks are consecutive ranks, so a node holds whole runs of them); under group-limited
    routing each node holding whole groups, so a token's experts lie on at most model.moe.topk_groups nodes."""
    if per_node is None:
        return []
    if not node_dispatch:
        return [f"parallel.ep_per_node={per_node} splits the ep group into nodes for a dispatcher that runs on them "
                f"({', '.join(n for n in dispatchers.names() if dispatchers.get(n).node_groups)}), not "
                f"model.moe.dispatcher={moe.dispatcher}: set it to null"]
    if per_node < 1 or ep % per_node or devices % per_node:
        return [f"parallel.ep_per_node={per_node} must divide parallel.ep={ep} and trainer.devices={devices}: a node "
                f"holds whole runs of a stage's consecutive ep ranks"]
    node_experts, group = per_node * moe.num_experts // ep, moe.num_experts // moe.n_groups
    if moe.n_groups > 1 and node_experts % group:
        return [f"model.moe.n_groups={moe.n_groups} with model.moe.dispatcher={moe.dispatcher}: a node's "
                f"parallel.ep_per_node·num_experts/parallel.ep={node_experts} experts are not whole groups of {group}, "
                f"so a token's model.moe.topk_groups={moe.topk_groups} groups could span more nodes"]
    return []


def paired_schedule_violations(schedule: str, num_experts: int, ep: int, dispatcher: str, sharding: str = "none",
                               recompute: str = "none", dropout: float = 0.0) -> list[str]:
    """A schedule that pairs passes (1f1b_overlap) hides the expert all-to-alls behind the other pass's compute: it
    needs MoE layers, expert parallelism and a dispatcher that hands over (docs/moe.md). The paired F and B hand over
    inside a layer, so what keeps per-layer state for one pass at a time is refused beside it: sharded parameters
    (a unit gathered for one pass is freed by the other's hooks) and a whole layer recomputed with dropout (the
    recompute replays the layer's RNG stream, which the other pass would draw from). The config and the planner
    ask it."""
    if schedule not in registry.names() or not registry.get(schedule).pairs:
        return []
    if num_experts == 0:
        return [f"parallel.schedule={schedule} overlaps the expert all-to-alls, but model.moe.num_experts=0 (a dense "
                f"model has none): use parallel.schedule=1f1b"]
    if ep < 2:
        return [f"parallel.schedule={schedule} overlaps the expert all-to-alls, but parallel.ep={ep} posts none: use "
                f"parallel.ep > 1, or parallel.schedule=1f1b"]
    if not dispatchers.get(dispatcher).hands_over:
        able = ", ".join(n for n in dispatchers.names() if dispatchers.get(n).hands_over)
        return [f"parallel.schedule={schedule} overlaps the collectives of a dispatcher that posts them asynchronously "
                f"(model.moe.dispatcher={able}), not model.moe.dispatcher={dispatcher}"]
    if sharding == "params":
        return [f"parallel.schedule={schedule} with optim.sharding=params: the paired forward and backward hand "
                f"over inside a layer, and each would free the gathered weights the other is using; use "
                f"optim.sharding=optim or parallel.schedule=1f1b"]
    if recompute == "full" and dropout > 0:
        return [f"parallel.schedule={schedule} with kernels.recompute=full and model.dropout={dropout}: the "
                f"backward's recompute replays the layer's dropout stream, which the paired forward would draw from "
                f"when they hand over; use kernels.recompute=selective, model.dropout=0 or parallel.schedule=1f1b"]
    return []


def dp_shard_violations(dims: ParallelDims, sharding: str) -> list[str]:
    """parallel.dp_shard (HSDP) against the replicas and optim.sharding (docs/parallelism.md)."""
    s = dims.dp_shard
    if s is None:
        return []
    if not isinstance(s, int) or s < 2:
        return [f"parallel.dp_shard={s!r} must be an integer of at least 2 (or null: all d·c replicas)"]
    if sharding == "none":
        return [f"parallel.dp_shard={s} shards nothing with optim.sharding=none: set optim.sharding=params (or "
                f"optim), or drop parallel.dp_shard"]
    if dims.replicas % s:
        return [f"parallel.dp_shard={s} does not divide the {dims.replicas} replicas of a weight "
                f"(parallel.dp·parallel.cp={dims.dp}·{dims.cp})"]
    return []


def validate(cfg: RunConfig, world_size: int | None = None, check_data: bool = True) -> RunConfig:
    """Check every rule the values alone decide and derive what they imply: parallel.dp and trainer.devices from
    the layout (and the launcher's world size), profile.steps as [FROM, TO], and `cfg.dims`. No file or environment
    is read (mlplat.train.preflight does that). Raises ConfigError with one line. `check_data=False` is for
    programs that feed the model their own token ids: model.vocab_size must then be set (otherwise null may wait
    for preflight to resolve it from the tokenizer)."""
    _check_model_keys(cfg, check_data)
    _check_training_keys(cfg)
    _check_run_keys(cfg)
    _check_layout(cfg, world_size)
    return cfg


def _check_model_keys(cfg: RunConfig, check_data: bool) -> None:
    """The model's keys and the sizes every layout needs at least 1 of."""
    model_cfg, parallel_cfg, trainer_cfg = cfg.model, cfg.parallel, cfg.trainer
    _require(model_cfg.vocab_size is not None or check_data,
             "model.vocab_size=null needs the data's tokenizer to resolve it: set model.vocab_size")
    for key, value in (("model.n_layers", model_cfg.n_layers), ("model.hidden", model_cfg.hidden),
                       ("model.n_heads", model_cfg.n_heads),
                       ("model.seq_len", model_cfg.seq_len), ("model.vocab_size", model_cfg.vocab_size),
                       ("model.ffn_hidden", model_cfg.ffn_hidden),
                       ("parallel.tp", parallel_cfg.tp), ("parallel.pp", parallel_cfg.pp),
                       ("parallel.vpp", parallel_cfg.vpp),
                       ("parallel.micro_batch_size", parallel_cfg.micro_batch_size),
                       ("parallel.global_batch_size", parallel_cfg.global_batch_size),
                       ("trainer.max_steps", trainer_cfg.max_steps), ("trainer.num_nodes", trainer_cfg.num_nodes)):
        if value is not None:  # the nullable ones (vocab_size, ffn_hidden) are resolved elsewhere when null
            _require(value >= 1, f"{key}={value} must be at least 1" +
                     (" (or null = 4·model.hidden)" if key == "model.ffn_hidden" else ""))
    _require(model_cfg.head_dim is None or (isinstance(model_cfg.head_dim, int) and model_cfg.head_dim >= 1),
             f"model.head_dim={model_cfg.head_dim} must be a positive integer (or null = model.hidden/model.n_heads)")
    _require(model_cfg.head_dim is not None or model_cfg.hidden % model_cfg.n_heads == 0,
             f"model.hidden={model_cfg.hidden} is not divisible by model.n_heads={model_cfg.n_heads} (or set "
             f"model.head_dim)")
    _require(model_cfg.vocab_pad_multiple >= 1, f"model.vocab_pad_multiple={model_cfg.vocab_pad_multiple} must be at "
                                                f"least 1 (the vocabulary is padded to a multiple of it times tp)")
    _require(0.0 <= model_cfg.dropout < 1.0, f"model.dropout={model_cfg.dropout} must be in [0, 1)")
    _require(model_cfg.activation in ACTIVATIONS,
             f"model.activation={model_cfg.activation!r} is not one of {', '.join(ACTIVATIONS)}")
    _check_arch(model_cfg)
    _refuse_any(model_cfg.mlp_entry.violations(model_cfg))


def _check_muon(optim_cfg) -> None:
    """optim.muon.*: their ranges, and set only where Muon reads them (docs/precision.md)."""
    muon = optim_cfg.muon
    if optim_cfg.name != "muon":  # a key set for another optimizer would change nothing, silently
        given = [f"optim.muon.{f.name}={getattr(muon, f.name)}" for f in fields(MuonConfig)
                 if getattr(muon, f.name) != getattr(MuonConfig(), f.name)]
        _require(not given, f"{', '.join(given)} set with optim.name={optim_cfg.name}: Muon's keys apply to "
                            f"optim.name=muon only; set it, or drop them")
        return
    _require(muon.lr is None or muon.lr > 0, f"optim.muon.lr={muon.lr} must be positive (null = optim.lr)")
    _require(0 <= muon.momentum < 1, f"optim.muon.momentum={muon.momentum} must be in [0, 1)")
    _require(muon.ns_steps >= 1, f"optim.muon.ns_steps={muon.ns_steps} must be at least 1")
    _require(muon.weight_decay >= 0, f"optim.muon.weight_decay={muon.weight_decay} must be non-negative")
    _require(muon.update_scale in MUON_UPDATE_SCALES,
             f"optim.muon.update_scale={muon.update_scale!r} is not one of {', '.join(MUON_UPDATE_SCALES)}")
    _require(muon.qk_clip is None or muon.qk_clip > 0,
             f"optim.muon.qk_clip={muon.qk_clip} must be positive (null = off)")


QK_CLIP_ATTENTIONS = (attentions.DEFAULT, "mla")  # whose rows QK-clip scales (mlplat.model.qk_clip)


def _check_qk_clip(cfg: RunConfig) -> None:
    """optim.muon.qk_clip: the attentions whose logits scaling the query and key rows moves (docs/precision.md)."""
    tau, model_cfg = cfg.optim.muon.qk_clip, cfg.model
    if tau is None:
        return
    _require(model_cfg.attention in QK_CLIP_ATTENTIONS,
             f"optim.muon.qk_clip={tau} with model.attention={model_cfg.attention}: QK-clip knows the query and key "
             f"rows of {', '.join(QK_CLIP_ATTENTIONS)} only; use one of them or drop it")
    _require(model_cfg.attention != "mla" or cfg.parallel.cp == 1,
             f"optim.muon.qk_clip={tau} with model.attention=mla at parallel.cp={cfg.parallel.cp}: the latent ring "
             "does not track the heads' logits; use parallel.cp=1 or drop it")
    _require(not model_cfg.qk_norm,
             f"optim.muon.qk_clip={tau} with model.qk_norm=true: the norms on q and k undo any scaling of their "
             f"weights, so clipping would not move the logits; drop one of them")


def _check_training_keys(cfg: RunConfig) -> None:
    """The kernels, the optimizer and the precision, and how they combine."""
    model_cfg, parallel_cfg, kernels_cfg = cfg.model, cfg.parallel, cfg.kernels
    optim_cfg, trainer_cfg = cfg.optim, cfg.trainer
    _require(kernels_cfg.attention in ATTENTION_BACKENDS,
             f"kernels.attention={kernels_cfg.attention!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    _require(kernels_cfg.recompute in RECOMPUTE,
             f"kernels.recompute={kernels_cfg.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    _require(optim_cfg.name in optimizers.names(),
             f"optim.name={optim_cfg.name!r} is not one of {', '.join(optimizers.names())}")
    _check_muon(optim_cfg)
    _check_qk_clip(cfg)
    _require(optim_cfg.lr > 0, f"optim.lr={optim_cfg.lr} must be positive")
    _require(0 <= optim_cfg.min_lr <= optim_cfg.lr,
             f"optim.min_lr={optim_cfg.min_lr} must be in [0, optim.lr={optim_cfg.lr}]")
    _require(optim_cfg.weight_decay >= 0, f"optim.weight_decay={optim_cfg.weight_decay} must be non-negative")
    _require(optim_cfg.warmup_steps >= 0, f"optim.warmup_steps={optim_cfg.warmup_steps} must be non-negative")
    _require(optim_cfg.lr_decay_steps is None or optim_cfg.lr_decay_steps > optim_cfg.warmup_steps,
             f"optim.lr_decay_steps={optim_cfg.lr_decay_steps} must be past optim.warmup_steps="
             f"{optim_cfg.warmup_steps} (null = trainer.max_steps)")
    _require(optim_cfg.grad_clip >= 0, f"optim.grad_clip={optim_cfg.grad_clip} must be non-negative (0 = no clipping)")
    _require(optim_cfg.max_skipped_steps >= 1,
             f"optim.max_skipped_steps={optim_cfg.max_skipped_steps} must be at least 1")
    _require(str(trainer_cfg.precision) in PRECISIONS,
             f"trainer.precision={trainer_cfg.precision!r} is not one of {', '.join(PRECISIONS)}")
    _refuse_any(fp8_violations(fp8=kernels_cfg.fp8, precision=str(trainer_cfg.precision), hidden=model_cfg.hidden,
                               n_heads=model_cfg.n_heads, n_kv_heads=model_cfg.kv_heads, ffn=model_cfg.ffn,
                               tp=parallel_cfg.tp, cp=parallel_cfg.cp, seq_len=model_cfg.seq_len,
                               head_dim=model_cfg.head_size, attention_splits=attention_splits(model_cfg)))
    _require(optim_cfg.sharding in SHARDINGS,
             f"optim.sharding={optim_cfg.sharding!r} is not one of {', '.join(SHARDINGS)}")
    # optim.distributed=true is optim.sharding=optim's alias; both name the distributed optimizer, which sharded
    # parameters include (what reads `distributed` asks whether the optimizer state is sharded)
    if optim_cfg.distributed and optim_cfg.sharding == "none":
        optim_cfg.sharding = "optim"
    optim_cfg.distributed = optim_cfg.sharding != "none"
    # Autocast keeps its cast of every weight it meets until its region (the whole training step) ends: sharded
    # weights would each keep a whole 16-bit copy, the memory sharding is for.
    _require(optim_cfg.sharding != "params" or not _PRECISION_TABLE[str(trainer_cfg.precision)].autocast,
             f"optim.sharding=params with trainer.precision={trainer_cfg.precision}: autocast keeps a 16-bit cast of "
             f"every weight through the step, a whole copy per rank; use trainer.precision=bf16-megatron (bf16 "
             f"weights gathered, fp32 main weights sharded)")
    _require(optim_cfg.grad_reduce_dtype in GRAD_REDUCE_DTYPES,
             f"optim.grad_reduce_dtype={optim_cfg.grad_reduce_dtype!r} is not one of {', '.join(GRAD_REDUCE_DTYPES)}")
    # A bf16 reduction rounds the fp32 main gradients; only the bf16 weights' own precision makes that harmless.
    _require(optim_cfg.grad_reduce_dtype == "main" or str(trainer_cfg.precision) == "bf16-megatron",
             f"optim.grad_reduce_dtype={optim_cfg.grad_reduce_dtype} needs trainer.precision=bf16-megatron "
             f"(got trainer.precision={trainer_cfg.precision})")
    # Without clipping or loss scaling nothing can reject a step: the saved copy would be pure cost.
    _require(not optim_cfg.post_validate or optim_cfg.grad_clip > 0
             or _PRECISION_TABLE[str(trainer_cfg.precision)].loss_scaling,
             f"optim.post_validate=true has nothing to validate: optim.grad_clip=0 and trainer.precision="
             f"{trainer_cfg.precision} scales no loss")
    _require(optim_cfg.eps > 0, f"optim.eps={optim_cfg.eps} must be positive")
    state = _PRECISION_TABLE[str(trainer_cfg.precision)]
    state_dtype = state.main_dtype or state.weight_dtype  # what Adam's moments, and eps added to them, are held in
    _require(state_dtype != "float16" or struct.unpack("e", struct.pack("e", min(optim_cfg.eps, 1.0)))[0] > 0,
             f"optim.eps={optim_cfg.eps} is 0 in float16, the optimizer state's dtype under trainer.precision="
             f"{trainer_cfg.precision} (Adam would divide by 0 and the run go NaN): set optim.eps, e.g. optim.eps=1e-4")
    _require(len(optim_cfg.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in optim_cfg.betas),
             f"optim.betas={list(optim_cfg.betas)} must be two numbers in [0, 1)")


def _check_run_keys(cfg: RunConfig) -> None:
    """What the run does around training: logging, checkpoints, restarts, data, sampling, validation, the cluster
    a dry run plans for, profiling, straggler reports."""
    trainer_cfg, parallel_cfg, data_cfg = cfg.trainer, cfg.parallel, cfg.data
    _require(cfg.logger.name in LOGGERS, f"logger.name={cfg.logger.name!r} is not one of {', '.join(LOGGERS)}")
    # W&B refuses these in a project name, and only after the Trainer and every rank are up.
    _require(not any(c in str(cfg.logger.project) for c in WANDB_PROJECT_FORBIDDEN),
             f"logger.project={cfg.logger.project} may not contain any of {' '.join(WANDB_PROJECT_FORBIDDEN)} "
             f"(W&B's rule); a team goes in logger.entity")
    _require(isinstance(cfg.logger.tags, (list, tuple)),
             f"logger.tags={cfg.logger.tags!r} must be a list, e.g. logger.tags=[{cfg.logger.tags}]")
    _require(cfg.logger.mode is None or cfg.logger.mode in WANDB_MODES,
             f"logger.mode={cfg.logger.mode!r} is not one of {', '.join(WANDB_MODES)} (null = online when "
             f"WANDB_API_KEY is set, otherwise offline)")
    _require(cfg.checkpoint.every_steps is None or cfg.checkpoint.every_steps >= 0,
             f"checkpoint.every_steps={cfg.checkpoint.every_steps} must be non-negative (0 = off, null = the resumed "
             f"checkpoint's)")
    _require(cfg.checkpoint.timeout_s >= 1, f"checkpoint.timeout_s={cfg.checkpoint.timeout_s} must be at least 1")
    _require(cfg.checkpoint.async_mode in ("thread", "process"),
             f"checkpoint.async_mode={cfg.checkpoint.async_mode!r} is not one of thread, process")
    check_restart_cadence(cfg)
    _require(parallel_cfg.timeout_s >= 1, f"parallel.timeout_s={parallel_cfg.timeout_s} must be at least 1")
    _check_data(data_cfg)
    _check_sample(cfg.sample)
    _require(trainer_cfg.val_check_interval >= 1,
             f"trainer.val_check_interval={trainer_cfg.val_check_interval} must be at least 1")
    _require(trainer_cfg.limit_val_batches >= 0,
             f"trainer.limit_val_batches={trainer_cfg.limit_val_batches} must be non-negative "
                                       f"(0 = no validation)")
    _require(trainer_cfg.log_every_n_steps >= 1,
             f"trainer.log_every_n_steps={trainer_cfg.log_every_n_steps} must be at least 1")
    _require(str(trainer_cfg.accelerator).lower() in ACCELERATORS,
             f"trainer.accelerator={trainer_cfg.accelerator!r} is not one of {', '.join(ACCELERATORS)}")
    _require(0 <= cfg.seed < 2**63, f"seed={cfg.seed} must be in [0, 2^63) (torch's generators take a 64-bit seed)")

    _check_cluster(cfg.cluster)
    # The dry run times the layout on cluster.*: GPUs timed as this machine's CPU processes give nonsense (MFU > 100%).
    gpus = str(trainer_cfg.accelerator).lower() in ("gpu", "cuda")
    _require(not (cfg.dry_run and gpus and cfg.cluster.device == "cpu"),
             f"dry_run=true with trainer.accelerator={trainer_cfg.accelerator} would plan GPUs on cluster="
             f"{cfg.cluster.name} (cluster.device=cpu: this machine's processes); add a GPU cluster, e.g. "
             f"cluster=dgx_h100 (conf/cluster/)")
    _check_profile(cfg.profile, trainer_cfg.max_steps)
    every, threshold = cfg.straggler.every_steps, cfg.straggler.threshold
    _require(every is None or every >= 0,
             f"straggler.every_steps={every} must be a number of steps >= 1, or 0 / null (off)")
    _require(threshold > 0, f"straggler.threshold={threshold} must be a positive fraction (0.2 = 20% slower)")


def _resolve_mtp_split(cfg: RunConfig) -> None:
    """Where the layers alone do not split evenly over the p·v chunks and the layers with the D multi-token
    prediction modules do, the even split counts each module as a layer of the loss's chunk:
    `parallel.last_stage_layers` becomes what that leaves there (model=mla_tiny: 3 layers and one module over 4
    chunks, the module on a chunk of its own). Every other layout keeps its split; the checkpoints record the
    resolved value."""
    parallel_cfg, n_layers, depth = cfg.parallel, cfg.model.n_layers, cfg.model.mtp.depth
    chunks = parallel_cfg.pp * parallel_cfg.vpp
    if depth == 0 or parallel_cfg.first_stage_layers is not None or parallel_cfg.last_stage_layers is not None:
        return
    if n_layers % chunks and not (n_layers + depth) % chunks and (n_layers + depth) // chunks >= depth:
        parallel_cfg.last_stage_layers = (n_layers + depth) // chunks - depth
    _require(not n_layers % chunks or parallel_cfg.last_stage_layers is not None,
             f"model.n_layers={n_layers} does not split evenly over parallel.pp·parallel.vpp={chunks} model chunks, "
             f"nor with the model.mtp.depth={depth} modules counted as layers of the last chunk: set "
             f"parallel.first_stage_layers and/or parallel.last_stage_layers (the first and the last chunk's layers)")


def _check_layout(cfg: RunConfig, world_size: int | None) -> None:
    """The parallel layout, checked before any process group starts; parallel.dp, parallel.ep and trainer.devices
    resolved."""
    model_cfg, parallel_cfg, kernels_cfg, trainer_cfg = cfg.model, cfg.parallel, cfg.kernels, cfg.trainer
    _check_mtp(cfg)  # its keys before the split that counts its modules
    _resolve_mtp_split(cfg)
    _refuse_any(shape_violations(n_layers=model_cfg.n_layers, hidden=model_cfg.hidden, n_heads=model_cfg.n_heads,
                                 ffn=model_cfg.ffn, tp=parallel_cfg.tp, pipeline=parallel_cfg.pipeline,
                                 n_kv_heads=model_cfg.kv_heads))
    # A zero-bubble or V-shaped schedule orders the stages of a pipeline: on one stage it would run silently as a
    # plain loop (its W split or second chunk buying nothing).
    spec = parallel_cfg.pipeline.spec
    _require(parallel_cfg.pp > 1 or not (spec.split_backward or spec.vpp == 2),
             f"parallel.schedule={parallel_cfg.schedule} schedules the stages of a pipeline and parallel.pp=1 has "
             f"one: use parallel.schedule=1f1b, or parallel.pp > 1")
    # Interleaving one chunk per rank is 1F1B under another name: say so rather than run it silently.
    alias = parallel_cfg.pipeline.spec.one_chunk
    _require(alias is None or parallel_cfg.vpp >= 2,
             f"parallel.schedule={parallel_cfg.schedule} needs parallel.vpp >= 2 model chunks per pipeline rank (got "
             f"parallel.vpp={parallel_cfg.vpp}); set parallel.vpp=2 or parallel.schedule={alias}")
    _refuse_any(sequence_parallel_violations(sequence_parallel=parallel_cfg.sequence_parallel, tp=parallel_cfg.tp,
                                             seq_len=model_cfg.seq_len))
    _check_moe(cfg)
    _refuse_any(context_parallel_violations(cp=parallel_cfg.cp, seq_len=model_cfg.seq_len, tp=parallel_cfg.tp,
                                            sequence_parallel=parallel_cfg.sequence_parallel,
                                            attention=kernels_cfg.attention, dropout=model_cfg.dropout))
    if parallel_cfg.dp is not None:
        _require(parallel_cfg.dp >= 1, f"parallel.dp={parallel_cfg.dp} must be at least 1 (or null)")
    resolve_world(cfg, world_size)
    if parallel_cfg.ep is None:  # the widest expert parallelism a stage holds
        stage = ParallelDims.of(parallel_cfg, ep=1).stage_ranks
        parallel_cfg.ep = max(e for e in range(1, stage + 1)
                              if stage % e == 0 and (model_cfg.moe.num_experts % e == 0 if model_cfg.moe.enabled
                                                     else e == 1))
    dims = ParallelDims.of(parallel_cfg)  # the layout facts, once (RunConfig.dims)
    if world_size is not None:
        _require(world_size == dims.world_size,
                 f"the launcher's world size {world_size} does not equal {_layout(parallel_cfg)}")
    total = trainer_cfg.devices * trainer_cfg.num_nodes  # type: ignore[operator]
    _require(total == dims.world_size, f"{_devices(trainer_cfg)} does not equal the layout {_layout(parallel_cfg)}")
    _refuse_any(batch_violations(dims))
    _refuse_any(expert_parallel_violations(dims, model_cfg.moe.num_experts))
    _refuse_any(paired_schedule_violations(parallel_cfg.schedule, model_cfg.moe.num_experts, parallel_cfg.ep,
                                           model_cfg.moe.dispatcher, cfg.optim.sharding, cfg.kernels.recompute,
                                           model_cfg.dropout))
    _refuse_any(dp_shard_violations(dims, cfg.optim.sharding))
    node_dispatch = model_cfg.moe.enabled and dispatchers.get(model_cfg.moe.dispatcher).node_groups
    if node_dispatch and parallel_cfg.ep_per_node is None:  # a node's ep ranks: they are consecutive ranks
        parallel_cfg.ep_per_node = math.gcd(parallel_cfg.ep, trainer_cfg.devices)  # type: ignore[arg-type]
    _refuse_any(ep_node_violations(parallel_cfg.ep_per_node, parallel_cfg.ep, trainer_cfg.devices, model_cfg.moe,
                                   node_dispatch))


def arch_defaults(m: ModelConfig) -> ModelConfig:
    """`m` with its null architecture keys set to model.arch's defaults (ARCHS); `m` itself when none is null."""
    filled = {key: value for key, value in ARCHS[m.arch].items() if getattr(m, key) is None}
    bias = filled.get("bias", m.bias)
    if m.qkv_bias is None:
        filled["qkv_bias"] = bias
    return replace(m, **filled) if filled else m


def _check_arch(m: ModelConfig) -> None:
    """model.arch and the architecture keys; the nulls become the arch's defaults (ARCHS), in place."""
    _require(m.arch in ARCHS, f"model.arch={m.arch!r} is not one of {', '.join(ARCHS)}")
    m.__dict__.update(arch_defaults(m).__dict__)
    for key, allowed in (("position", POSITIONS), ("norm", NORMS), ("mlp", mlps.names()),
                         ("attention", attentions.names())):
        _require(getattr(m, key) in allowed, f"model.{key}={getattr(m, key)!r} is not one of {', '.join(allowed)}")
    if m.n_kv_heads is not None:
        _require(m.n_kv_heads >= 1, f"model.n_kv_heads={m.n_kv_heads} must be at least 1 (or null = model.n_heads)")
    _refuse_any(m.attention_entry.violations(m))  # its rules (mha: K/V heads that serve whole groups)
    if m.attention != "mla":  # a latent width set for another attention would change nothing, silently
        given = [f"model.mla.{f.name}={getattr(m.mla, f.name)}" for f in fields(MLAConfig)
                 if getattr(m.mla, f.name) != getattr(MLAConfig(), f.name)]
        _require(not given, f"{', '.join(given)} set with model.attention={m.attention}: they shape latent attention "
                            f"only; set model.attention=mla, or drop them")
    _require(m.norm_eps > 0, f"model.norm_eps={m.norm_eps} must be positive")
    _require(m.init_std > 0, f"model.init_std={m.init_std} must be positive (the weights' normal init)")
    if m.position != "rope":
        _require(m.rope_scaling is None, f"model.rope_scaling is set but model.position={m.position}: it scales "
                                         f"rotary embeddings (model.position=rope)")
        _require(m.rotary_dim is None, f"model.rotary_dim={m.rotary_dim} is set but model.position={m.position}: it "
                                       f"sizes rotary embeddings (model.position=rope)")
        return
    _require(m.rope_theta > 0, f"model.rope_theta={m.rope_theta} must be positive")
    if m.attention_entry.rotary_dim is None:  # the whole head rotates (else the entry's rules check its part)
        what = f"model.head_dim={m.head_dim}" if m.head_dim else \
            f"model.hidden/model.n_heads={m.hidden}/{m.n_heads}={m.head_size}"
        _require(m.head_size % 2 == 0, f"model.position=rope needs an even head size, and {what}")
        _require(m.rotary_dim is None or (isinstance(m.rotary_dim, int) and 2 <= m.rotary_dim <= m.head_size
                                          and m.rotary_dim % 2 == 0),
                 f"model.rotary_dim={m.rotary_dim} must be an even number of channels in [2, the head size "
                 f"{m.head_size}] (null = the whole head): the rotation turns pairs of a head's first rotary_dim "
                 f"channels")
    if m.rope_scaling is not None:
        _check_rope_scaling(m.rope_scaling)


def _positive(key: str, v: Any, example: str) -> None:
    _require(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf,
             f"model.rope_scaling.{key}={v!r} must be a positive number ({example})")


def _check_rope_scaling(scaling: Any) -> None:
    """model.rope_scaling: Llama 3.1's (rope_type llama3, the default) or YaRN's (rope_type yarn, DeepSeek-V3: its
    config names the type `type`), as transformers reads them (mlplat.model.rotary)."""
    _require(isinstance(scaling, Mapping), f"model.rope_scaling={scaling!r} must be a group of keys "
                                           f"({', '.join(ROPE_SCALING_KEYS)}, or rope_type=yarn with "
                                           f"{', '.join(YARN_KEYS)}) or null")
    _require(not ("rope_type" in scaling and "type" in scaling),
             "model.rope_scaling sets both rope_type and type: set one (type is DeepSeek-V3's name for rope_type)")
    kind = scaling.get("rope_type", scaling.get("type", "llama3"))
    _require(kind in ("llama3", "yarn"), f"model.rope_scaling.rope_type={kind!r} is not supported (llama3 or yarn)")
    required, optional = ((ROPE_SCALING_KEYS, ()) if kind == "llama3" else (YARN_KEYS, YARN_OPTIONAL_KEYS))
    unknown = [k for k in scaling if k not in (*required, *optional, "rope_type", "type")]
    _require(not unknown, f"model.rope_scaling.{unknown[0] if unknown else ''} is not a known key of rope_type={kind} "
                          f"(known: rope_type, {', '.join((*required, *optional))})")
    if kind == "yarn":
        for k in required:
            _positive(k, scaling.get(k), "DeepSeek-V3: factor 40, original_max_position_embeddings 4096")
        for k in optional:
            if scaling.get(k) is not None:
                _positive(k, scaling[k], "DeepSeek-V3: beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 1")
        return
    for k in required:
        _positive(k, scaling.get(k), "Llama 3.1: factor 8, low_freq_factor 1, high_freq_factor 4, "
                                     "original_max_position_embeddings 8192")
    _require(scaling["high_freq_factor"] > scaling["low_freq_factor"],
             f"model.rope_scaling.high_freq_factor={scaling['high_freq_factor']} must exceed low_freq_factor="
             f"{scaling['low_freq_factor']}")


def _check_moe(cfg: RunConfig) -> None:
    """model.moe.*: the keys' own ranges, then what the layers built so far compose with (docs/moe.md)."""
    moe, m = cfg.model.moe, cfg.model
    _require(moe.num_experts >= 0, f"model.moe.num_experts={moe.num_experts} must be non-negative (0 = dense)")
    if not moe.enabled:  # a key set on a dense model would change nothing, silently
        given = [f"model.moe.{f.name}={getattr(moe, f.name)}" for f in fields(MoEConfig)
                 if getattr(moe, f.name) != getattr(MoEConfig(), f.name)]
        _require(not given, f"{', '.join(given)} set on a dense model (model.moe.num_experts=0): they apply to "
                            f"experts only; set model.moe.num_experts, or drop them")
        return
    experts = [name for name in mlps.names() if mlps.get(name).experts]
    _require(m.mlp in experts, f"model.moe.num_experts={moe.num_experts}: the experts compute model.mlp="
                               f"{'|'.join(experts)} (mlplat.model.moe), not model.mlp={m.mlp}")
    _require(1 <= moe.top_k <= moe.num_experts,
             f"model.moe.top_k={moe.top_k} must be in [1, model.moe.num_experts={moe.num_experts}]")
    _require(moe.ffn_hidden is None or moe.ffn_hidden >= 1,
             f"model.moe.ffn_hidden={moe.ffn_hidden} must be at least 1 (or null = model.ffn_hidden)")
    _require(moe.shared_experts >= 0, f"model.moe.shared_experts={moe.shared_experts} must be non-negative")
    _require(not moe.shared_gate or moe.shared_experts > 0,
             "model.moe.shared_gate=true gates the shared experts, but model.moe.shared_experts=0")
    _require(0 <= moe.dense_layers < m.n_layers, f"model.moe.dense_layers={moe.dense_layers} must be in [0, "
                                                 f"model.n_layers={m.n_layers}) (at least one layer of experts)")
    _require(moe.router in routers.names(),
             f"model.moe.router={moe.router!r} is not one of {', '.join(routers.names())}")
    _require(moe.routed_scaling_factor > 0, f"model.moe.routed_scaling_factor={moe.routed_scaling_factor} must be "
                                            f"positive (the routed experts' gates are multiplied by it; 1 = as the "
                                            f"router gives them)")
    for key in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
        _require(getattr(moe, key) >= 0, f"model.moe.{key}={getattr(moe, key)} must be non-negative (0 = off)")
    _require(moe.n_groups >= 1 and moe.num_experts % moe.n_groups == 0,
             f"model.moe.n_groups={moe.n_groups} must divide model.moe.num_experts={moe.num_experts} (equal groups)")
    _require(1 <= moe.topk_groups <= moe.n_groups,
             f"model.moe.topk_groups={moe.topk_groups} must be in [1, model.moe.n_groups={moe.n_groups}]")
    eligible = moe.topk_groups * (moe.num_experts // moe.n_groups)
    _require(moe.top_k <= eligible, f"model.moe.top_k={moe.top_k} is more than the {eligible} experts of "
                                    f"model.moe.topk_groups={moe.topk_groups} groups of "
                                    f"{moe.num_experts // moe.n_groups} (model.moe.n_groups={moe.n_groups})")
    # Past E/k an expert's capacity ceil(c·T·k/E) holds all T tokens: nothing can drop (and c·T·k may overflow).
    _require(moe.capacity_factor is None or 0 < moe.capacity_factor <= moe.num_experts / moe.top_k,
             f"model.moe.capacity_factor={moe.capacity_factor} must be in (0, model.moe.num_experts/model.moe.top_k="
             f"{moe.num_experts / moe.top_k:g}]: past it no token can drop (null = dropless)")
    _require(moe.plan_imbalance >= 1, f"model.moe.plan_imbalance={moe.plan_imbalance} must be at least 1 (the busiest "
                                      f"expert rank's tokens over the mean)")
    _require(moe.dispatcher in dispatchers.names(),
             f"model.moe.dispatcher={moe.dispatcher!r} is not one of {', '.join(dispatchers.names())}")
    tp = cfg.parallel.tp
    _require(cfg.parallel.etp in (None, 1, tp), f"parallel.etp={cfg.parallel.etp} must be 1 or parallel.tp={tp} "
                                                f"(or null)")
    etp = ParallelDims.of(cfg.parallel, dp=1).expert_tp
    _require(m.expert_ffn % etp == 0, f"model.moe.ffn_hidden={m.expert_ffn} is not divisible by parallel.etp={etp} "
                                      f"(each expert's width is split over its tensor-parallel ranks)")
    _require(etp > 1 or tp == 1 or m.seq_len % (tp * cfg.parallel.cp) == 0,
             f"model.seq_len={m.seq_len} is not divisible by parallel.tp·parallel.cp={tp}·{cfg.parallel.cp}: with "
             f"parallel.etp=1 each tp rank routes 1/t of its sequence")
    _require(m.moe.shared_experts * m.expert_ffn % tp == 0,
             f"model.moe.shared_experts·model.moe.ffn_hidden={m.moe.shared_experts * m.expert_ffn} is not "
             f"divisible by parallel.tp={tp}")
    _refuse_any(fp8_expert_violations(cfg.kernels.fp8, m.expert_ffn, etp))
    _require(not moe.fp8_dispatch or dispatchers.get(moe.dispatcher).fp8_rows,
             f"model.moe.fp8_dispatch=true with model.moe.dispatcher={moe.dispatcher}: that dispatcher sends the "
             f"tokens in the run's precision only; use alltoall or allgather, or model.moe.fp8_dispatch=false")
    _require(moe.bias_update_rate == 0 or not cfg.optim.post_validate,
             "model.moe.bias_update_rate > 0 with optim.post_validate=true: a redone step would move the expert "
             "bias twice; turn one off")


def _check_mtp(cfg: RunConfig) -> None:
    """model.mtp.* (multi-token prediction, docs/mtp.md): the keys' ranges, then what the modules compose with."""
    mtp = cfg.model.mtp
    _require(mtp.depth >= 0, f"model.mtp.depth={mtp.depth} must be non-negative (0 = off)")
    _require(0 <= mtp.loss_coeff < math.inf, f"model.mtp.loss_coeff={mtp.loss_coeff} must be a non-negative number")
    _require(mtp.enabled or mtp.loss_coeff == MTPConfig().loss_coeff,  # it would change nothing, silently
             f"model.mtp.loss_coeff={mtp.loss_coeff} set without modules (model.mtp.depth=0): it weighs their losses; "
             f"set model.mtp.depth, or drop it")
    # init_from sets the depth from a DeepSeek-V3 directory (model.attention=mla) or a GLM-4.5 one (its experts
    # chosen by sigmoid scores, model.moe.router=sigmoid); the others' modules would start untrained beside a trained
    # model: refused
    read = cfg.model.attention == "mla" or (cfg.model.moe.num_experts > 0 and cfg.model.moe.router == "sigmoid")
    _require(not mtp.enabled or cfg.init_from is None or read,
             f"model.mtp.depth={mtp.depth} with init_from={cfg.init_from}: the transformers checkpoints read with "
             f"multi-token prediction modules are DeepSeek-V3's and GLM-4.5's (mlplat.checkpoint.hf); train them "
             f"from scratch, without init_from")


def _check_data(d: DataConfig) -> None:
    """The data keys' own rules; whether the files exist and hold enough is mlplat.data.checks' (preflight)."""
    _require(d.name in DATA_NAMES, f"data.name={d.name!r} is not one of {', '.join(DATA_NAMES)}")
    _require(d.name != "text" or d.path not in (None, "???"), "data.path is missing: data=text needs "
                                                              "data.path=FILE_OR_DIR")
    _require(d.name == "text" or d.path is None, f"data.path={d.path} is read by data=text only (data={d.name} "
                                                 f"would train without it); add data=text")
    _require(0 < d.val_fraction < 1, f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    _require(d.num_workers >= 0, f"data.num_workers={d.num_workers} must be non-negative")


def _check_sample(s: SampleConfig) -> None:
    _require(s.max_new_tokens >= 0, f"sample.max_new_tokens={s.max_new_tokens} must be non-negative (0 = no sample)")
    _require(math.isfinite(s.temperature) and s.temperature >= 0,
             f"sample.temperature={s.temperature} must be a non-negative number (0 = greedy)")
    _require(s.temperature == 0 or s.temperature >= MIN_TEMPERATURE,
             f"sample.temperature={s.temperature} must be 0 (greedy) or at least {MIN_TEMPERATURE}: a smaller one "
             f"draws greedily in effect, and logits/temperature overflows to inf (a NaN draw) near 1e-300")
    _require(s.top_k >= 0, f"sample.top_k={s.top_k} must be non-negative (0 = off)")
    _require(0 < s.top_p <= 1, f"sample.top_p={s.top_p} must be in (0, 1] (1 = off)")


def _check_profile(prof: ProfileConfig, max_steps: int) -> None:
    if prof.steps is None:
        _require(not prof.torch, "profile.torch=true needs profile.steps=[FROM, TO]: the steps torch.profiler wraps")
        return
    # One step N is [N, N]; anything else but a list of two is refused below, in one line.
    steps = [prof.steps] * 2 if isinstance(prof.steps, int) and not isinstance(prof.steps, bool) else prof.steps
    steps = list(steps) if isinstance(steps, (list, tuple)) else [steps]
    _require(len(steps) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in steps)
             and 1 <= steps[0] <= steps[1],
             f"profile.steps={prof.steps!r} must be [FROM, TO] with 1 <= FROM <= TO, or one step N "
             f"(optimizer steps, 1-based)")
    _require(steps[1] <= max_steps, f"profile.steps={steps} ends after trainer.max_steps={max_steps}")
    prof.steps = steps


def _check_cluster(c: ClusterConfig) -> None:
    """The figures' ranges; cluster.device names an entry of mlplat.perf.devices, checked by preflight."""
    for key in ("gpus_per_node", "gpu_memory_gb", "nvlink_gbps", "ib_gbps_per_gpu", "nodes", "overhead_gib"):
        value = getattr(c, key)
        _require(value is None or value > 0 or (key == "overhead_gib" and value == 0),
                 f"cluster.{key}={value} must be positive")
    for key in ("nvlink_efficiency", "ib_efficiency", "hbm_efficiency", "usable_fraction"):
        value = getattr(c, key)
        _require(0 < value <= 1, f"cluster.{key}={value} must be in (0, 1]")
    for key in ("nvlink_latency_us", "ib_latency_us"):
        _require(getattr(c, key) >= 0, f"cluster.{key}={getattr(c, key)} must be non-negative")
    cpu = {key: getattr(c, key) for key in CPU_KEYS}
    unset = [key for key, value in cpu.items() if value is None]
    _require(len(unset) in (0, len(cpu)), f"cluster.{unset[0] if unset else ''} is null while other cluster.cpu_* "
             f"keys are set: set all of them (python experiments/calibrate/calibrate.py prints them) or none")
    for key, value in cpu.items():
        rates = key in ("cpu_cores", "cpu_gemm_gflops", "cpu_memory_gbps")  # divided by: must be positive
        _require(value is None or value > 0 or (value == 0 and not rates),
                 f"cluster.{key}={value} must be {'positive' if rates else 'non-negative'}")


def load_config(raw: Any, world_size: int | None = None, check_data: bool = True) -> RunConfig:
    """From a Hydra DictConfig (or a plain mapping) to a validated RunConfig (see `validate`; no I/O: reading an
    init_from directory, the data and the environment is mlplat.train's `load_checked` and `preflight`)."""
    return validate(from_raw(raw), world_size, check_data)


def check_restart_cadence(cfg: RunConfig) -> None:
    """`trainer.max_restarts`: a count, and restarts need saves, since a restarted group resumes from the last
    checkpoint (without one every restart would train the run again from its start). `checkpoint.every_steps=null`
    (the resumed checkpoint's cadence) passes here and is checked again once preflight has resolved it."""
    n = cfg.trainer.max_restarts
    _require(isinstance(n, int) and not isinstance(n, bool) and n >= 0,
             f"trainer.max_restarts={n} must be a non-negative integer (0 = a failed rank ends the job)")
    _require(n == 0 or cfg.checkpoint.every_steps != 0,
             f"trainer.max_restarts={n} needs checkpoint.every_steps > 0 (got {cfg.checkpoint.every_steps}): a "
             "restart resumes from the last checkpoint, and without saves it would train the run again from the start")
