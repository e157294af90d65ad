"""What a predicted step is made of, for both cost models: the per-layer costs, the prediction, and the
data-parallel work after the pipeline flush.

After the last backward of a pipeline rank come the reduction of its gradients over the d·c replicas (the c
context-parallel ranks hold the same weights; what of it the backward did not hide), the tied embedding's gradient
summed between the first and the last stage (an untied output layer has none, unless multi-token prediction reads
the embedding there), the global grad-norm all-reduce,
which makes every rank wait for the last one, the optimizer step and, with the distributed optimizer, the weights'
all-gather. Under optimizer post-validation (`Layout.post_validate`) the grad-norm and overflow all-reduces are read
during the next step, so steps run back to back: no rank waits for another between steps, and a step takes the
pipeline's steady-state period plus the slowest rank's own work after its flush. `after_flush` adds these up once;
each model
(`mlplat.perf.cluster` for GPUs, `mlplat.perf.cpu_model` for CPU processes) says what each one costs on its machine.
Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from mlplat.perf.flops import ModelDims
from mlplat.perf.memory import Layout
from mlplat.precision import precision_of


@dataclass
class LayerCosts:
    """Seconds per micro-batch on one GPU."""

    layer_forward: float  # one transformer layer: GEMMs + element-wise (no communication)
    layer_backward: float  # including the recomputed forward work, if any
    tp_forward: float  # tensor-parallel all-reduces of one layer's forward
    tp_backward: float  # ... of its backward (+ recomputed forward)
    embedding_forward: float
    embedding_backward: float
    head_forward: float  # final LN, logits GEMM, vocab-parallel cross-entropy
    head_backward: float
    transfer: float  # one stage-to-stage activation (or gradient) message, inter-node
    transfer_intra: float  # same, inside a node
    breakdown: dict[str, float] = field(default_factory=dict)
    cp_forward: float = 0.0  # the context-parallel ring's exposed seconds in one layer's forward (c > 1)
    cp_backward: float = 0.0  # ... in its backward (+ the recomputed forward's ring)
    moe_forward: float = 0.0  # what an MoE layer's forward costs beyond a dense one's (mlplat.perf.cluster)
    moe_backward: float = 0.0  # ... its backward's (+ the recomputed forward)
    gather_forward: float = 0.0  # sharded parameters: a layer's weight all-gather not hidden by its neighbour's forward
    gather_backward: float = 0.0  # ... its weight all-gather and gradient reduce-scatter not hidden in backward


@dataclass
class Prediction:
    seconds_per_iteration: float
    pipeline_seconds: float  # until the last backward (the flush); back to back (post-validation): the period
    bubble_fraction: float  # (pipeline time - busiest rank's compute) / that compute
    dp_exposed_seconds: float
    optimizer_seconds: float
    chunk_forward: list[float]
    chunk_backward: list[float]
    costs: LayerCosts
    method: str  # "simulated" | "extrapolated (m1, m2)" | "analytic"
    peak_in_flight: list[int] | None = None
    dp_allgather_exposed_seconds: float = 0.0  # distributed optimizer: the weights' all-gather not hidden
    optimizer_newton_schulz_seconds: float = 0.0  # Muon: the busiest rank's Newton–Schulz, within optimizer_seconds
    optimizer_gather_seconds: float = 0.0  # Muon: its tp all-gathers of split matrices' updates, within it too



def reduced_bytes(lay: Layout) -> tuple[int, int]:
    """(bytes per gradient element the data-parallel reduction moves, bytes per model weight), from the precision
    table; bf16-megatron with optim.grad_reduce_dtype=bf16 reduces a bf16 copy of its fp32 main gradients."""
    prec = precision_of(lay.precision)
    grad_bytes = 2 if prec.megatron and lay.grad_reduce_dtype == "bf16" else prec.grad_bytes
    return grad_bytes, prec.weight_bytes


@dataclass(frozen=True)
class FlushCosts:
    """What each piece after the flush costs on one machine, in seconds exposed (not hidden by compute)."""

    reduction: Callable[[int, float], float]  # (pipeline rank, its gradient bytes) -> its data-parallel reduction
    tied: Callable[[float], float]  # bytes of the tied embedding's gradient -> its all-reduce over two stages
    gather: Callable[[int, float], float]  # (rank, its weight bytes) -> the distributed optimizer's all-gather
    optimizer: Callable[[int], float]  # the optimizer's divisor of the parameters (d if sharded, else 1) -> step
    sync: float = 0.0  # the collectives every rank waits on before stepping, beyond the grad-norm wait itself


@dataclass(frozen=True)
class AfterFlush:
    end: float  # the step's end
    exposed: float  # the last rank's exposed data-parallel seconds (with `sync`)
    optimizer: float
    gather: float  # the distributed optimizer's exposed all-gather
    rank: int  # the pipeline rank that was ready last


def after_flush(dims: ModelDims, lay: Layout, params: list[int], finish: list[float], costs: FlushCosts,
                period: float | None = None) -> AfterFlush:
    """The step's end from each pipeline rank's finish (its last backward) and `params` held per rank. `period`:
    steps run back to back (post-validation), the pipeline's steady-state time per step; the step then ends that
    long after the previous one plus the slowest rank's own reduction, step and all-gather."""
    p, t, d = lay.pp, lay.tp, lay.replicas  # gradients are reduced over the d·c ranks holding the weights
    grad_bytes, weight_bytes = reduced_bytes(lay)
    sharded = lay.distributed_optimizer and d > 1
    # Sharded parameters: no all-gather after the step (each layer is gathered before its next forward, in the
    # layer costs); the optimizer state and the tied embedding's gradient shards are 1/dp_shard.
    gathers_after = sharded and not lay.param_sharding
    shards = lay.shard_size if sharded else 1
    first, last = lay.pipeline.owner(0), lay.pipeline.owner(lay.pipeline.last_chunk)
    ready, exposed_of, gather_of = [], [], []
    for r in range(p):
        exposed = costs.reduction(r, params[r] * grad_bytes) if d > 1 else 0.0
        if r in (first, last) and first != last and dims.embedding_at_head:  # the word embedding's two copies
            emb = dims.padded_vocab(t) // t * dims.hidden * grad_bytes
            exposed += costs.tied(emb / shards)
        ready.append(finish[r] + exposed)
        exposed_of.append(exposed)
        if gathers_after:  # the updated weights, which the next step's forward waits for
            gather_of.append(costs.gather(r, params[r] * weight_bytes))
    opt = costs.optimizer(shards)
    if period is not None:  # nothing global between steps: each rank's own work after its flush adds to its cycle
        own = [exposed_of[r] + (gather_of[r] if gather_of else 0.0) for r in range(p)]
        slowest = max(range(p), key=lambda r: own[r])
        return AfterFlush(period + own[slowest] + opt, exposed_of[slowest], opt,
                          gather_of[slowest] if gather_of else 0.0, slowest)
    # The global grad-norm (clipping) all-reduce makes every rank wait for the last one before stepping.
    last_rank = max(range(p), key=lambda r: ready[r])
    gather = max(gather_of) if gather_of else 0.0
    return AfterFlush(ready[last_rank] + costs.sync + opt + gather, exposed_of[last_rank] + costs.sync, opt, gather,
                      last_rank)


def back_to_back(dims: ModelDims, lay: Layout) -> bool:
    """Steps run back to back: under optimizer post-validation, unless a tied output layer's gradient is summed
    between two pipeline ranks at every step's end (the first rank then waits for the last one, as the checks did;
    measured: experiments/post_validation/back_to_back.md)."""
    first, last = lay.pipeline.owner(0), lay.pipeline.owner(lay.pipeline.last_chunk)
    return lay.post_validate and not (dims.embedding_at_head and first != last)
