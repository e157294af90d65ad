"""Layout planner: which (t, p, v, micro-batch, recomputation, sequence parallelism, precision, distributed
optimizer; with experts ep and etp) to use for a model on a cluster.

    python -m mlplat.plan model=gpt1t cluster=dgx_a100 gpus=3072 [global_batch_size=3072] [top=10]
        [micro_batch_sizes=1,2,4,8,16] [recompute=none,selective,full] [sequence_parallel=false,true] [max_vpp=8]
        [precision=bf16-mixed,bf16-megatron] [sharding=none,optim,params] [attention=auto] [fused=true]
        [seq_len=2048] [cp=auto] [max_cp=8] [post_validate=false,true] [fp8=none] [optim=adamw]
        [dispatcher=alltoall,node_alltoall]

`cp` (parallel.cp, context parallelism) is `auto` or a list such as `1,2,4`. `auto` keeps c = 1 for sequences
under LONG_SEQUENCE (32,768) tokens, where ring attention rarely pays for its K/V traffic, unless nothing fits at
c = 1; then, and for long sequences always, it also tries every c > 1 that divides the GPUs left by t·p, up to
`max_cp` (8) and down to MIN_CP_TOKENS (4,096) tokens per rank (smaller ring blocks hide no transfer), under the
rules of `mlplat.config.context_parallel_violations`. Searching c on every model would multiply the search (and
the planner's time) for layouts that lose.

`precision` and `sharding` (optim.sharding) are lists searched like the others: on a GPU cluster by default
Lightning's bf16-mixed and Megatron-style bf16-megatron (32-true on the nominal CPU device), each with nothing
sharded over the data-parallel ranks, the optimizer state sharded (the distributed optimizer) and the parameters
sharded too (ZeRO-3; not under the autocast precisions, which the config refuses with it); sharded parameters are
also tried under HSDP, shard groups of the replicas a node holds (parallel.dp_shard = GPUs per node / t) where that
is fewer than all of them. `distributed=false,true` (the
older key) searches none,optim.
So is `post_validate` (optim.post_validate, default false): with it both cost models time
steps back to back, where ZB-V and ZB-H2 lose their bubble, and the memory model counts the step's saved copy.
`fp8` (kernels.fp8, one recipe, default none) plans every layout with the layers' GEMMs in FP8: only on a device
with an FP8 peak, without the autocast precisions (the config refuses them with FP8) and, for blockwise, only where
each rank holds whole 128-blocks (`mlplat.config.fp8_violations`).
`dispatcher` (model.moe.dispatcher, a list, default the model's own): on an MoE model every layout is weighed with
each, e.g. `dispatcher=alltoall,node_alltoall` (docs/moe.md: the node dispatcher pays where an ep group spans nodes).
`optim` (optim.name, one optimizer, default adamw): `muon` plans every layout with Muon's Newton–Schulz and tp
gathers in the optimizer step and its momentum in the memory (`mlplat.perf.muon`).

`model` and `cluster` name files of conf/model and conf/cluster (or are paths to YAML files); the search reads
them without Hydra. The last lines are the commands for the best layout (`python -m mlplat.train model=...
cluster=... trainer=gpu` and every key in which the layout differs from the config those compose, by Hydra): the
launch through SLURM; when the layout fits one node, the launch on that node without a launcher; and the dry run
that plans the same layout on any machine (the SLURM line would need SLURM's srun, even with `dry_run=true`).
Every registered pipeline schedule (`mlplat.parallel.layout.registry`) is weighed at every v its chunk rule
allows (`pipeline_schedules`). Every candidate is checked against the divisibility rules and the memory model; the
survivors are ranked
by the analytic cost model (on CPU processes: a partial fixed point of their simulation), and the best few are
re-timed by simulating the real pipeline schedule.
The search follows the paper's advice only through the cost model: t stays inside a node (a rule),
everything else is left to the numbers.
"""
from __future__ import annotations

import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from mlplat.config import (
    RECOMPUTE,
    SHARDINGS,
    attention_splits,
    context_parallel_violations,
    fp8_expert_violations,
    fp8_violations,
    paired_schedule_violations,
)
from mlplat.optim import factory as optimizers
from mlplat.parallel.layout import registry
from mlplat.perf.cluster import Cluster, Prediction, predict, resolve_attention
from mlplat.perf.devices import peak_flops
from mlplat.perf.flops import ModelDims, hardware_flops_per_iteration, model_flops_per_iteration, stage_parameters
from mlplat.perf.memory import Layout, layout_errors, memory_per_stage
from mlplat.precision import FP8_RECIPES, precision_of
from mlplat.specs import dispatchers

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def load_group(group: str, name: str, conf_dir: Path | str | None = None) -> dict:
    """conf/<group>/<name>.yaml (or `name` itself if it is a YAML path) as a plain dict, over the options of its
    group that its `defaults:` list builds on (model=moe_tiny on llama_tiny), as Hydra composes them."""
    from omegaconf import OmegaConf

    path = Path(name)
    if path.suffix not in (".yaml", ".yml"):
        path = Path(conf_dir or CONF_DIR) / group / f"{name}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{group}={name}: no file {path}")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    base: dict = {}
    for option in raw.pop("defaults", None) or []:
        if isinstance(option, str) and option != "_self_":
            base.update(load_group(group, str(path.parent / f"{option}.yaml")))  # an option beside it
    return {**base, **raw}  # type: ignore[return-value]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


LONG_SEQUENCE = 32768  # from here on `cp=auto` searches context parallelism whether or not c = 1 fits
MIN_CP_TOKENS = 4096  # tokens per cp rank below which `cp=auto` does not go (ring blocks of 2048)
MAX_CP = 8


def cp_choices(dims: ModelDims, gpus: int, cp: str | Sequence[int] = "auto", max_cp: int = MAX_CP,
               long: bool | None = None) -> tuple[int, ...]:
    """The c the search tries: a list as given, or for `auto` 1 and, when the sequence is long (or `long`), every
    c > 1 up to `max_cp` that leaves a rank MIN_CP_TOKENS tokens at least and divides `gpus`."""
    if not isinstance(cp, str):
        return tuple(cp)
    long = dims.seq_len >= LONG_SEQUENCE if long is None else long
    wide = [c for c in _divisors(gpus) if 1 < c <= max_cp and dims.seq_len // c >= MIN_CP_TOKENS] if long else []
    return (1, *wide)


@dataclass
class Candidate:
    layout: Layout
    fits: bool
    reason: str  # why it was refused; "" when it fits
    memory_bytes: float = 0.0
    prediction: Prediction | None = None
    tflops_per_gpu: float = 0.0  # executed FLOPs, the paper's convention
    mfu: float = 0.0
    dispatcher: str = ""  # model.moe.dispatcher it was weighed with ("" for the model's own: `search`)

    @property
    def seconds(self) -> float:
        return self.prediction.seconds_per_iteration if self.prediction else float("inf")


def candidate_layouts(dims: ModelDims, cl: Cluster, gpus: int, global_batch: int, *,
                      micro_batch_sizes=(1, 2, 4, 8, 16), recompute=RECOMPUTE, max_vpp: int = 8,
                      precision: str | Sequence[str] = "bf16-mixed", distributed: bool | Sequence[bool] = (False, True),
                      attention: str = "auto", fused: bool = True, sequence_parallel=(False, True),
                      cp: Sequence[int] = (1,), post_validate=(False,), fp8: str = "none",
                      sharding: Sequence[str] | None = None, optim: str = "adamw") -> Iterator[Layout]:
    """Every layout t·c·p·d = gpus with t a divisor of the node size, c in `cp` (under the rules of
    context_parallel_violations, on the requested `attention`), p | gpus, and the v and stage splits of
    `pipeline_splits` (p | n_layers: v | n_layers/p, even; otherwise uneven ends), each schedule of
    `pipeline_schedules`; sequence
    parallelism (when t > 1 and t divides the sequence) as allowed by `sequence_parallel`; in each precision, with
    and without the distributed optimizer (which changes nothing at d·c = 1: tried once there), or each of
    `sharding` (optim.sharding: none, optim, params; sharded parameters also under HSDP, `_shard_groups`); with and
    without optimizer post-validation as `post_validate` lists; the layers' GEMMs in `fp8` where its rules allow;
    stepped by `optim` (optim.name: muon adds its Newton–Schulz, gathers and momentum to the costs)."""
    if sharding is None:
        sharding = ["optim" if x else "none" for x in ([distributed] if isinstance(distributed, bool) else distributed)]
    for prec in [precision] if isinstance(precision, str) else precision:
        for shard in sharding:
            for post in [post_validate] if isinstance(post_validate, bool) else post_validate:
                for lay, dp_shard in ((lay, s) for lay in _layouts(dims, cl, gpus, global_batch, micro_batch_sizes,
                                                                   recompute, max_vpp, prec, attention, fused,
                                                                   sequence_parallel, cp)
                                      for s in _shard_groups(lay, cl, shard)):
                    if shard != "none" and lay.replicas == 1:
                        continue
                    if shard == "params" and precision_of(prec).autocast:  # refused (mlplat.config's rule)
                        continue
                    if paired_schedule_violations(lay.schedule, dims.moe.num_experts, lay.ep, dims.moe.dispatcher,
                                                  shard, lay.recompute, dims.dropout):
                        continue
                    if dims.moe.enabled and fp8_expert_violations(fp8, dims.expert_ffn, lay.expert_tp):
                        continue
                    if fp8 != "none" and fp8_violations(
                            fp8=fp8, precision=prec, hidden=dims.hidden, n_heads=dims.n_heads,
                            n_kv_heads=dims.kv_heads, ffn=dims.ffn, tp=lay.tp, cp=lay.cp, seq_len=dims.seq_len,
                            head_dim=dims.head_size, attention_splits=attention_splits(dims)):
                        continue
                    yield replace(lay, distributed_optimizer=shard != "none", param_sharding=shard == "params",
                                  dp_shard=dp_shard, post_validate=post, fp8=fp8, optimizer=optim)


def _shard_groups(lay: Layout, cl: Cluster, sharding: str) -> list[int | None]:
    """parallel.dp_shard values to weigh: null (all d·c replicas); for sharded parameters also HSDP's groups of the
    replicas one node holds (the replica places run c then d inside a node of t-rank groups), when that is at least
    2 and fewer than all of them."""
    node = cl.gpus_per_node // lay.tp
    if sharding == "params" and 2 <= node < lay.replicas and lay.replicas % node == 0:
        return [None, node]
    return [None]


def _sharding(lay: Layout) -> str:
    """What is sharded over the data-parallel ranks (`Layout.sharding`, "no" for none), with HSDP's group size."""
    if lay.sharding == "none":
        return "no"
    return lay.sharding + (f"/{lay.dp_shard}" if lay.dp_shard else "")


def _layouts(dims: ModelDims, cl: Cluster, gpus: int, global_batch: int, micro_batch_sizes, recompute, max_vpp: int,
             precision: str, attention: str, fused: bool, sequence_parallel, cps) -> Iterator[Layout]:
    kernel = resolve_attention(attention, cl, precision)
    for t in _divisors(cl.gpus_per_node):
        for p in [p for p in _divisors(gpus) if p <= dims.n_layers]:
            for c in cps:
                if gpus % (t * c * p):
                    continue
                d = gpus // (t * c * p)
                for (ep, etp), (v, first, last) in product(expert_layouts(dims, t * c * d, t),
                                                           pipeline_splits(dims.n_layers, p, max_vpp,
                                                                           dims.mtp.depth)):
                    for kind in pipeline_schedules(p, v):
                        if paired_schedule_violations(kind, dims.moe.num_experts, ep, dims.moe.dispatcher):
                            continue
                        for b in micro_batch_sizes:
                            for r in recompute:
                                for sp in sequence_parallel:
                                    if sp and (t == 1 or dims.seq_len % t):
                                        continue
                                    if c > 1 and context_parallel_violations(
                                            cp=c, seq_len=dims.seq_len, tp=t, sequence_parallel=sp,
                                            attention=attention, dropout=dims.dropout):
                                        continue
                                    yield Layout(tp=t, pp=p, vpp=v, dp=d, micro_batch_size=b,
                                                 global_batch_size=global_batch, schedule=kind, recompute=r,
                                                 sequence_parallel=sp, precision=precision, attention=kernel,
                                                 fused=fused, cp=c, first_stage_layers=first,
                                                 last_stage_layers=last, ep=ep, etp=etp)


def expert_layouts(dims: ModelDims, stage_ranks: int, t: int) -> list[tuple[int, int | None]]:
    """(ep, etp) the search tries on a stage of t·c·d ranks: without experts only (1, null); with experts the
    experts split over t (1, null: etp = t), whole on every rank (1, 1) when t > 1, and spread whole over every
    ep > 1 that divides both the experts and the stage's ranks (etp = 1, the one width built with ep > 1)."""
    if not dims.moe.enabled:
        return [(1, None)]
    spread = [(ep, None) for ep in _divisors(dims.moe.num_experts) if ep > 1 and stage_ranks % ep == 0]
    return [(1, None), *([(1, 1)] if t > 1 else []), *spread]


UNEVEN_VPP = (1, 2)  # the v an uneven split is searched at: 1F1B's stages, and the V's and interleaving's two chunks


def pipeline_splits(n_layers: int, p: int, max_vpp: int = 8,
                    mtp_depth: int = 0) -> list[tuple[int, int | None, int | None]]:
    """(v, first_stage_layers, last_stage_layers) the search tries at p pipeline ranks. When p divides the layers:
    every v dividing l/p (up to max_vpp), split evenly (None, None). When it does not (126 layers over p = 8): at
    v in UNEVEN_VPP, the most even split with ends no heavier than the rest: the p·v-2 middle chunks hold
    k = ceil(l/(p·v)) layers each and the first and the last chunk the r = l - (p·v-2)·k left, r/2 each (r odd:
    either end one more), when each end keeps a layer. With multi-token prediction (`mtp_depth` D > 0) the modules
    ride on the loss's chunk in those splits, and `mtp_stage_splits` adds the chunk of their own."""
    if p == 1:
        return [(1, None, None)]
    return _layer_splits(n_layers, p, max_vpp) + (mtp_stage_splits(n_layers, p, max_vpp) if mtp_depth else [])


def mtp_stage_splits(n_layers: int, p: int, max_vpp: int = 8) -> list[tuple[int, int | None, int | None]]:
    """The multi-token prediction modules on a stage of their own (last_stage_layers = 0: the loss's chunk holds the
    final norm, the output layer and the D modules, Megatron-Core's `mL` DeepSeek-V3 layout), at every v up to
    max_vpp: the p·v-2 middle chunks k layers each and the first chunk F = l - (p·v-2)·k ≥ 1, k chosen to make the
    heavier of k and F the lightest, kept when F ≤ 2k (a v whose chunks cannot take the layers near evenly is not
    tried). Whether that beats the modules beside the last layers (a chunk as heavy as
    D layers more, each with the output layer again) is the cost model's to say."""
    out = []
    for v in range(1, max_vpp + 1):
        middle = p * v - 2
        if middle < 1:  # two chunks: the first holds every layer
            out += [(v, n_layers, 0)] if p * v == 2 else []
            continue
        ks = range(1, (n_layers - 1) // middle + 1)
        if ks:
            k = min(ks, key=lambda k: (max(k, n_layers - middle * k), k))
            first = n_layers - middle * k
            out += [(v, first, 0)] if first <= 2 * k else []
    return out


def _layer_splits(n_layers: int, p: int, max_vpp: int) -> list[tuple[int, int | None, int | None]]:
    if n_layers % p == 0:
        return [(v, None, None) for v in _divisors(n_layers // p) if v == 1 or v <= max_vpp]
    out = []
    for v in (v for v in UNEVEN_VPP if v <= max_vpp):
        n = p * v
        if n == 2:
            ends = [(n_layers // 2, n_layers - n_layers // 2)]
        else:
            k = -(-n_layers // n)
            r = n_layers - (n - 2) * k
            ends = [(r // 2, r - r // 2)] if r >= 2 else []
        for first, last in ends:
            out += [(v, first, last)] + ([(v, last, first)] if last != first else [])
    return out


def pipeline_schedules(p: int, v: int) -> list[str]:
    """The schedules weighed at p ranks of v chunks: every registered schedule that runs v chunks per rank, less
    the one another equals at v = 1 (interleaved is 1F1B there) and those another beats on less memory (1F1B beats
    GPipe). Without a pipeline (p = 1) every schedule runs the same passes: the default one, and those that pair
    passes (1f1b_overlap: `_layouts` keeps them where experts are dispatched)."""
    if p == 1:
        return [registry.DEFAULT, *(s.name for s in registry.schedules() if s.pairs)]
    return [s.name for s in registry.schedules()
            if s.vpp in (None, v) and not (v == 1 and s.one_chunk) and s.dominated_by is None]


def evaluate(dims: ModelDims, lay: Layout, cl: Cluster, method: str = "analytic", **kw) -> Candidate:
    """Check the rules and the memory, then predict the time of one layout."""
    errors = layout_errors(dims, lay, cl.gpus_per_node)
    if errors:
        return Candidate(lay, False, errors[0])
    params = stage_parameters(dims, lay.tp, lay.pipeline)
    mem = max(r.total for r in memory_per_stage(dims, lay, params, overhead_bytes=cl.overhead_gib * 1024**3))
    if mem > cl.usable_memory_bytes:
        return Candidate(lay, False, f"needs {mem / 2**30:.1f} GiB per GPU > {cl.usable_fraction:.0%} of "
                         f"cluster.gpu_memory_gb={cl.gpu_memory_gb:g}", mem)
    pred = predict(dims, lay, cl, parameters=params, method=method, **kw)
    hw = hardware_flops_per_iteration(dims, lay.global_batch_size, lay.recompute, lay.tp)
    mf = model_flops_per_iteration(dims, lay.global_batch_size, lay.tp)
    secs = pred.seconds_per_iteration
    return Candidate(lay, True, "", mem, pred, hw / secs / lay.gpus / 1e12,
                     mf / secs / lay.gpus / peak_flops(cl.device, lay.precision))


def _reason_kind(reason: str) -> str:
    if "GiB" in reason:
        return "does not fit in memory"
    if "multiple of parallel.pp" in reason:
        return "interleaved needs m % p == 0"
    if "global_batch_size" in reason:
        return "global batch not divisible by micro·d"
    return re.sub(r"=[^ ]+", "", reason)  # the rule without the values


PROGRESS_EVERY_S = 15.0  # a long search says how far it is this often (a trillion-parameter model: minutes)


class Progress:
    """A line on stderr every PROGRESS_EVERY_S seconds of a long search (layouts weighed, fitting, the best so far),
    so minutes of planning are not minutes of silence; silent when the search ends sooner."""

    def __init__(self, every_s: float = PROGRESS_EVERY_S, out=None):
        self.every_s, self.out = every_s, out
        self.start = self.last = time.monotonic()

    def __call__(self, what: Callable[[], str]) -> None:
        """`what` builds the line: called only when one is due, not at every layout of the search."""
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            print(f"mlplat.plan: {now - self.start:.0f} s: {what()}", file=self.out or sys.stderr, flush=True)


def with_dispatcher(dims: ModelDims, dispatcher: str) -> ModelDims:
    """`dims` with model.moe.dispatcher=`dispatcher` ("": its own)."""
    return replace(dims, moe=replace(dims.moe, dispatcher=dispatcher)) if dispatcher else dims


def search(dims: ModelDims, cl: Cluster, gpus: int, global_batch: int, *, top: int = 10,
           simulate_top: int | None = None,
           max_compute_ops: int = 60_000, cp: str | Sequence[int] = "auto", max_cp: int = MAX_CP,
           progress: Progress | None = None, dispatcher: Sequence[str] = ("",),
           **kw) -> tuple[list[Candidate], Counter]:
    """(the best `top` layouts, fastest first; refusal counts by reason). `cp`: see the module doc. `dispatcher`:
    the model.moe.dispatcher values each layout of an MoE model is weighed with ("": the model's own)."""
    refused: Counter = Counter()
    ok: list[Candidate] = []
    progress = progress or Progress()
    variants = [(d, with_dispatcher(dims, d)) for d in (dispatcher if dims.moe.enabled else ("",))]

    def run(cps: Sequence[int]) -> None:
        for (name, d), lay in ((v, lay) for v in variants
                               for lay in candidate_layouts(v[1], cl, gpus, global_batch, cp=cps, **kw)):
            c = replace(evaluate(d, lay, cl), dispatcher=name)
            if c.fits:
                ok.append(c)
            else:
                refused[_reason_kind(c.reason)] += 1
            progress(lambda: f"{len(ok) + sum(refused.values()):,} layouts weighed, {len(ok):,} fit" +
                     (f", the fastest {min(o.seconds for o in ok):.3f} s/iter (analytic)" if ok else ""))

    run(cp_choices(dims, gpus, cp, max_cp))
    if not ok and cp == "auto" and dims.seq_len < LONG_SEQUENCE:  # nothing fits at c = 1: split the sequence
        run(cp_choices(dims, gpus, cp, max_cp, long=True)[1:])
    ok.sort(key=lambda c: c.seconds)
    # Re-time the leaders with the real schedule; the analytic model only pre-sorts.
    k = simulate_top if simulate_top is not None else max(3 * top, 10)
    best = []
    for i, c in enumerate(ok[:k]):
        best.append(replace(evaluate(with_dispatcher(dims, c.dispatcher), c.layout, cl, "simulate",
                                     max_compute_ops=max_compute_ops), dispatcher=c.dispatcher))
        progress(lambda: f"re-timing the {min(k, len(ok))} fastest by simulating their schedules: {i + 1} done")
    best.sort(key=lambda c: c.seconds)
    return best[:top], refused


def _ends(lay: Layout) -> str:
    """`15/15`: the first and the last chunk's layers of an uneven split (a null end: `-`); empty when even."""
    if not lay.pipeline.uneven:
        return ""
    return "/".join("-" if k is None else str(k) for k in (lay.first_stage_layers, lay.last_stage_layers))


def _sp(lay: Layout) -> str:
    """Sequence parallelism: on, off, or `-` where there is no tensor-parallel group to split the sequence over."""
    return "-" if lay.tp == 1 else "on" if lay.sequence_parallel else "off"


def format_table(cands: list[Candidate], cl: Cluster) -> str:
    """The ranked layouts, each column a key the layouts can differ in (the pipeline schedule `-` without a
    pipeline); a `c` column (context parallelism) only when one of them has c > 1, an `ends` column
    (the first and the last chunk's layers) only when one of them has uneven stages, an `ep/etp` column (the
    experts' layout) only when one of them sets it, a `dispatcher` column (model.moe.dispatcher) where they were
    weighed with several, a `pv` column (optimizer post-validation: timed back to back)
    only when one of them has it."""
    with_cp = any(c.layout.cp > 1 for c in cands)
    with_pv = any(c.layout.post_validate for c in cands)
    with_ends = any(c.layout.pipeline.uneven for c in cands)  # uneven stages: the first/last chunk's layers
    with_ep = any(c.layout.ep > 1 or c.layout.etp is not None for c in cands)  # the experts' ep/etp
    with_dispatch = len({c.dispatcher for c in cands}) > 1  # model.moe.dispatcher, where they differ
    head = f"{'#':>3} {'t':>2} " + (f"{'c':>2} " if with_cp else "") + \
           f"{'p':>3} {'v':>2} " + (f"{'ends':>5} " if with_ends else "") + (f"{'ep/etp':>6} " if with_ep else "") + \
           (f"{'dispatcher':>13} " if with_dispatch else "") + \
           f"{'d':>5} {'schedule':>11} {'b':>3} {'m':>5} {'recompute':>9} {'sp':>3} " \
           f"{'precision':>13} {'shard':>9} " + (f"{'pv':>3} " if with_pv else "") + \
           f"{'mem GiB':>8} {'s/iter':>9} {'TFLOP/s':>8} {'MFU':>6} {'bubble':>7}  timed by"
    rows = [head, "-" * len(head)]
    for i, c in enumerate(cands, 1):
        L, pr = c.layout, c.prediction
        rows.append(f"{i:>3} {L.tp:>2} " + (f"{L.cp:>2} " if with_cp else "") +
                    f"{L.pp:>3} {L.vpp:>2} " + (f"{_ends(L):>5} " if with_ends else "") +
                    (f"{f'{L.ep}/{L.expert_tp}':>6} " if with_ep else "") +
                    (f"{c.dispatcher:>13} " if with_dispatch else "") +
                    f"{L.dp:>5} {L.schedule if L.pp > 1 else '-':>11} {L.micro_batch_size:>3} "
                    f"{L.num_micro_batches:>5} {L.recompute:>9} {_sp(L):>3} {L.precision:>13} "
                    f"{_sharding(L):>9} "
                    + (f"{'on' if L.post_validate else '':>3} " if with_pv else "") +
                    f"{c.memory_bytes / 2**30:>8.1f} "
                    f"{c.seconds:>9.3f} {c.tflops_per_gpu:>8.4g} "
                    f"{c.mfu:>6.1%} {pr.bubble_fraction if pr else 0:>7.3f}  {pr.method if pr else ''}")
    return "\n".join(rows)


def _parse(argv: list[str]) -> dict[str, str]:
    out = {}
    for a in argv:
        if a in ("-h", "--help"):
            print(__doc__)
            raise SystemExit(0)
        if "=" not in a:
            raise SystemExit(f"mlplat.plan: expected key=value, got {a!r} (see --help)")
        k, v = a.split("=", 1)
        out[k.lstrip("-").replace("-", "_")] = v
    return out


def _bool(s: str, key: str) -> bool:
    if s.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise SystemExit(f"mlplat.plan: {key}={s!r} must be true or false (or a list of them)")
    return s.lower() in ("true", "1", "yes")


def _int(s: str, key: str) -> int:
    """A count of the command line: a whole number of at least 1, or one line naming the key."""
    if not s.strip().isdigit() or int(s) < 1:
        raise SystemExit(f"mlplat.plan: {key}={s!r} must be a whole number of at least 1")
    return int(s)


def _ints(s: str, key: str) -> tuple[int, ...]:
    return tuple(_int(x, key) for x in s.split(",") if x)


def _shardings(args: dict[str, str]) -> tuple[str, ...]:
    """The `sharding` list (optim.sharding values), or the older `distributed` booleans as none/optim."""
    if "distributed" in args:
        if "sharding" in args:
            raise SystemExit("mlplat.plan: give sharding= or distributed= (its older form), not both")
        return tuple("optim" if _bool(x, "distributed") else "none" for x in args["distributed"].split(","))
    out = tuple(args.get("sharding", "none,optim,params").split(","))
    for x in out:
        if x not in SHARDINGS:
            raise SystemExit(f"mlplat.plan: sharding={x!r} is not one of {', '.join(SHARDINGS)}")
    return out


def default_global_batch(model: str, gpus: int, conf_dir: Path | str | None = None) -> int:
    """The paper's batch for this model when conf/experiment/<model>.yaml exists, else one sequence per GPU."""
    path = Path(conf_dir or CONF_DIR) / "experiment" / f"{model}.yaml"
    if path.exists():
        from omegaconf import OmegaConf

        gb = OmegaConf.load(path).get("parallel", {}).get("global_batch_size")
        if gb:
            return int(gb)
    return gpus


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    known = {"model", "cluster", "gpus", "global_batch_size", "top", "micro_batch_sizes", "recompute", "max_vpp",
             "precision", "distributed", "sharding", "attention", "fused", "seq_len", "conf_dir", "sequence_parallel",
             "cp", "max_cp", "post_validate", "fp8", "optim", "dispatcher"}
    unknown = set(args) - known
    if unknown:
        raise SystemExit(f"mlplat.plan: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    conf_dir = args.get("conf_dir")
    model_name, cluster_name = args.get("model", "tiny"), args.get("cluster", "local_cpu")
    try:
        model: Mapping[str, Any] = load_group("model", model_name, conf_dir)
        cluster = load_group("cluster", cluster_name, conf_dir)
    except FileNotFoundError as e:
        raise SystemExit(f"mlplat.plan: {e}") from None
    if "seq_len" in args:
        model = {**model, "seq_len": _int(args["seq_len"], "seq_len")}
    dims = ModelDims.from_config(model)
    cl = Cluster.from_config(cluster)
    fp8 = args.get("fp8", "none")
    if fp8 not in FP8_RECIPES:
        raise SystemExit(f"mlplat.plan: fp8={fp8!r} is not one of {', '.join(FP8_RECIPES)}")
    if fp8 != "none" and "fp8" not in cl.device.peak_tflops:
        raise SystemExit(f"mlplat.plan: fp8={fp8} needs FP8 tensor cores: cluster={cluster_name} "
                         f"({cl.device.name}) has none")
    optim = args.get("optim", "adamw")
    if optim not in optimizers.names():
        raise SystemExit(f"mlplat.plan: optim={optim!r} is not one of {', '.join(optimizers.names())}")
    gpus = _int(args.get("gpus", str(cl.gpus_per_node)), "gpus")
    gb = _int(args.get("global_batch_size", str(default_global_batch(model_name, gpus, conf_dir))), "global_batch_size")
    top = _int(args.get("top", "10"), "top")
    kw = dict(micro_batch_sizes=_ints(args.get("micro_batch_sizes", "1,2,4,8,16"), "micro_batch_sizes"),
              recompute=tuple(args.get("recompute", ",".join(RECOMPUTE)).split(",")),
              sequence_parallel=tuple(x.lower() in ("1", "true", "yes")
                                      for x in args.get("sequence_parallel", "false,true").split(",")),
              max_vpp=_int(args.get("max_vpp", "8"), "max_vpp"),
              # CPU processes (gloo) train in fp32; GPUs in bf16: autocast, or Megatron-style bf16 weights.
              precision=tuple(args.get("precision", "32-true" if cl.device.nominal else
                                       "bf16-mixed,bf16-megatron").split(",")),
              sharding=_shardings(args),
              post_validate=tuple(_bool(x, "post_validate") for x in args.get("post_validate", "false").split(",")),
              attention=args.get("attention", "auto"), fused=args.get("fused", "true").lower() in ("1", "true", "yes"),
              cp="auto" if args.get("cp", "auto") == "auto" else _ints(args["cp"], "cp"),
              max_cp=_int(args.get("max_cp", str(MAX_CP)), "max_cp"), fp8=fp8, optim=optim,
              dispatcher=tuple(args.get("dispatcher", "").split(",")))
    unknown = [d for d in kw["dispatcher"] if d and d not in dispatchers.names()]
    if unknown:
        raise SystemExit(f"mlplat.plan: dispatcher={unknown[0]!r} is not one of {', '.join(dispatchers.names())}")
    best, refused = search(dims, cl, gpus, gb, top=top, **kw)
    kv = f" kv={dims.kv_heads}" if dims.kv_heads != dims.n_heads else ""
    print(f"model={model_name} ({dims.label} l={dims.n_layers} h={dims.hidden} a={dims.n_heads}{kv} s={dims.seq_len}), "
          f"cluster={cl.name} ({cl.device.name}{', nominal figures' if cl.device.nominal else ''}), "
          f"{gpus} GPUs, global batch {gb}, precision {'/'.join(kw['precision'])}, sharded over dp "
          f"{'/'.join(kw['sharding'])}, post-validation "
          f"{'/'.join('on' if x else 'off' for x in kw['post_validate'])}"
          + (f", FP8 GEMMs ({fp8})" if fp8 != "none" else "") + (f", optim.name={optim}" if optim != "adamw" else ""))
    n_ok = sum(refused.values())
    print(f"refused {n_ok} layouts: " + ("; ".join(f"{n} {why}" for why, n in refused.most_common()) or "none"))
    if not best:
        print("no layout fits: add GPUs, lower the batch or allow recomputation")
        return 1
    print(format_table(best, cl))
    b = best[0].layout
    print(f"\nbest: parallel.tp={b.tp}" + (f" parallel.cp={b.cp}" if b.cp > 1 else "")
          + f" parallel.pp={b.pp} parallel.vpp={b.vpp} parallel.dp={b.dp} "
          + (f"parallel.first_stage_layers={b.first_stage_layers} parallel.last_stage_layers={b.last_stage_layers} "
             if b.pipeline.uneven else "")
          + (f"parallel.ep={b.ep} parallel.etp={b.expert_tp} " if b.ep > 1 or b.etp is not None else "")
          + f"parallel.schedule={b.schedule} parallel.micro_batch_size={b.micro_batch_size} "
          f"parallel.global_batch_size={b.global_batch_size} kernels.recompute={b.recompute}"
          + (" parallel.sequence_parallel=true" if b.sequence_parallel else "")
          + f" trainer.precision={b.precision} optim.sharding={b.sharding}"
          + (f" parallel.dp_shard={b.dp_shard}" if b.dp_shard else "")
          + (" optim.post_validate=true" if b.post_validate else "")
          + (f" kernels.fp8={b.fp8}" if b.fp8 != "none" else "")
          + (f" optim.name={b.optimizer}" if b.optimizer != "adamw" else "")
          + (f" model.moe.dispatcher={best[0].dispatcher}" if best[0].dispatcher else ""))
    launch = launch_line(b, cl, model_name, cluster_name, args.get('seq_len'), conf_dir,
                         dispatcher=best[0].dispatcher)
    print(f"launch: {launch}")
    if launch.startswith("python "):
        local = launch_line(b, cl, model_name, cluster_name, args.get("seq_len"), conf_dir, slurm=False,
                            dispatcher=best[0].dispatcher)
        if local != launch and b.gpus <= cl.gpus_per_node:
            print(f"on one node, without SLURM: {local}")
        print(f"plan it here: {local} dry_run=true")
    return 0


def launch_line(lay: Layout, cl: Cluster, model: str, cluster: str, seq_len: str | int | None = None,
                conf_dir: Path | str | None = None, slurm: bool = True, dispatcher: str = "") -> str:
    """The `python -m mlplat.train` command that runs `lay`: the model, cluster and trainer groups, then every key
    in which the layout differs from the config those compose (Hydra, conf/), then the launcher's resources (the
    SLURM launcher's, or with `slurm=False` only trainer.num_nodes and trainer.devices: a line that launches on one
    node, and that plans the same layout anywhere with `dry_run=true`, SLURM or not). Needs group names of this
    project's conf/."""
    from mlplat.perf.dry_run import config_values, launch_command

    conf = Path(conf_dir or CONF_DIR)
    named = all((conf / group / f"{name}.yaml").exists() and Path(name).suffix not in (".yaml", ".yml")
                for group, name in (("model", model), ("cluster", cluster)))
    if not named or conf.resolve() != CONF_DIR.resolve():
        return "(model= or cluster= given as a file, or conf_dir= set: python -m mlplat.train composes conf/ " \
               "groups only; set the best: keys above on such a run)"
    overrides = [f"model={model}", f"cluster={cluster}"] + ([] if cl.device.nominal else ["trainer=gpu"])
    overrides += [f"model.seq_len={int(seq_len)}"] if seq_len is not None else []
    overrides += [f"model.moe.dispatcher={dispatcher}"] if dispatcher else []  # the one it was weighed with
    base = config_values(compose_run(overrides))
    return launch_command(lay, cl, overrides=overrides, base=base, slurm=slurm)


def compose_run(overrides: list[str]):
    """The validated run config that `python -m mlplat.train OVERRIDES` composes (without the world size checks
    of a launch: parallel.dp as composed, trainer.devices from the layout)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from mlplat.config import from_dict

    if GlobalHydra.instance().is_initialized():
        raw = compose(config_name="config", overrides=overrides)
    else:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            raw = compose(config_name="config", overrides=overrides)
    from omegaconf import OmegaConf

    return from_dict(OmegaConf.to_container(raw, resolve=True))


if __name__ == "__main__":
    raise SystemExit(main())
