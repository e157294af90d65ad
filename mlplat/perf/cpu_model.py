"""The cost model of a CPU box whose ranks are processes sharing cores and talking gloo.

Used by `mlplat.perf.cluster.predict` whenever the `cluster.cpu_*` figures are set (measured by
`experiments/calibrate/calibrate.py`; the per-pass model is `mlplat.perf.host`, checked against measured runs by
`experiments/cost_model_check/`). It runs the real schedule with every pass slowed by the ranks busy beside it
(a fixed point over the simulated timeline), then the same after-the-flush sum as the GPU model
(`mlplat.perf.step.after_flush`) with gloo's costs: nothing hides a collective behind compute here. Torch-free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mlplat.optim.buckets import BUCKET_BYTES
from mlplat.optim.ns_cost import ns_flops
from mlplat.parallel.layout.exchange import exchange_plans
from mlplat.parallel.layout.schedules import Op, build_schedule
from mlplat.perf import simulator
from mlplat.perf.flops import ModelDims, stage_parameters
from mlplat.perf.host import LAYER_OPS, Host, Work, block_work, mean_concurrency, parameter_tensors
from mlplat.perf.links import Cluster, allgather_time, allreduce_time, p2p_time
from mlplat.perf.memory import Layout, dkv_block_bytes, kv_block_bytes, rank_layer_parameters
from mlplat.perf.muon import NS_OPS, muon_step
from mlplat.perf.simulator import STEADY_STEPS, CostModel, SimResult, simulate_nccl
from mlplat.perf.step import FlushCosts, LayerCosts, Prediction, after_flush, back_to_back, reduced_bytes
from mlplat.perf.transport import prepare
from mlplat.precision import precision_of


def engine_buckets(nbytes: float) -> int:
    """How many data-parallel buckets (each one collective) mlplat's engine reduces `nbytes` of gradients in."""
    return max(1, math.ceil(nbytes / BUCKET_BYTES))


@dataclass
class _Pass:
    """One chunk's forward or backward over one micro-batch on one rank (`mlplat.perf.host`)."""

    compute: float  # seconds of one thread with a core to itself
    comm: float  # blocking gloo time of its tensor-parallel collectives, alone
    handoffs: int  # their hand-offs (2(t-1) per ring all-reduce)

    def seconds(self, host: Host, busy: float) -> float:
        """With `busy` ranks of ours computing meanwhile."""
        return host.message(self.comm, self.handoffs, busy) + host.sharing(busy) * self.compute


def host_costs(dims: ModelDims, lay: Layout, cl: Cluster) -> tuple[LayerCosts, list[_Pass], list[_Pass], float, int]:
    """(LayerCosts alone, forward and backward passes per chunk, stage transfer seconds alone, its hand-offs)."""
    host = cl.host
    assert host is not None
    c = lay.cp
    t, s, b, h = lay.tp, dims.seq_len / c, lay.micro_batch_size, dims.hidden  # s: this cp rank's tokens
    prec = precision_of(lay.precision)
    elem = prec.activation_bytes
    sp = lay.sequence_parallel  # the planner and validation turn it on only at t > 1
    work = block_work(dims, b, t, elem, lay.recompute, sp, c)
    sbh = s * b * h * elem

    def allreduce(nbytes: float) -> tuple[float, float, int]:
        """(compute, gloo seconds, hand-offs) of one tensor-parallel all-reduce, with the clone before it.
        Sequence parallelism's all-gather + reduce-scatter pair costs the same ring."""
        if t == 1:
            return 0.0, 0.0, 0
        clone = host.seconds(Work(0.0, 2 * nbytes, 1))
        return clone, allreduce_time(nbytes, t, cl, False), 2 * (t - 1)

    def half(nbytes: float) -> tuple[float, float, int]:
        """A lone all-gather or reduce-scatter (sequence parallelism at the embedding and the head)."""
        return 0.0, allgather_time(nbytes, t, cl), t - 1

    def passes(block: str, reductions: list, backward: bool) -> _Pass:
        w = work[block][1 if backward else 0]
        ars = [x if isinstance(x, tuple) else allreduce(x) for x in reductions]
        return _Pass(host.seconds(w, backward) + sum(a[0] for a in ars), sum(a[1] for a in ars),
                     sum(a[2] for a in ars))

    n_bwd = 2 + (2 if lay.recompute == "full" else 0)
    # The context-parallel ring on gloo blocks (no stream to hide it behind): c-1 K/V blocks in the forward; c-1
    # K/V and c dK/dV in the backward, plus the forward's again when it is recomputed.
    kv, dkv = p2p_time(kv_block_bytes(dims, lay), cl, False), p2p_time(dkv_block_bytes(dims, lay), cl, False)
    ring_f = (0.0, (c - 1) * kv, c - 1)
    n_kv_b = (c - 1) * (2 if lay.recompute in ("full", "selective") else 1)
    ring_b = (0.0, n_kv_b * kv + c * dkv, n_kv_b + c)
    rings = ([ring_f], [ring_b]) if c > 1 else ([], [])
    layer_f = passes("layer", [sbh] * 2 + rings[0], False)
    layer_b = passes("layer", [sbh] * n_bwd + rings[1], True)
    emb_f = passes("embedding", [half(sbh)] if sp else [sbh], False)
    emb_b = passes("embedding", [half(sbh)] if sp else [], True)
    # The vocab-parallel cross-entropy all-reduces the max and (sum of exp, target logit) per token; the logits'
    # input gradient is all-reduced (sequence parallel: the input all-gathered, its gradient reduce-scattered).
    tokens = s * b
    ce = [tokens * elem, 2 * tokens * elem]
    head_f = passes("head", ce + ([half(sbh)] if sp else []), False)
    head_b = passes("head", [half(sbh)] if sp else [sbh], True)

    n_chunks = lay.pipeline.num_chunks
    counts = lay.pipeline.chunk_layers(dims.n_layers)  # each chunk's layers (even, or the uneven split)

    depth = dims.mtp.depth  # the last chunk's multi-token prediction modules: a layer and the head each, once more

    def chunk(layer: _Pass, c: int, first: _Pass, last: _Pass) -> _Pass:
        per = counts[c] + (depth if c == n_chunks - 1 else 0)
        out = _Pass(per * layer.compute, per * layer.comm, per * layer.handoffs)
        for end, times in ((first, int(c == 0)), (last, (1 + depth) * (c == n_chunks - 1))):
            out = _Pass(out.compute + times * end.compute, out.comm + times * end.comm,
                        out.handoffs + times * end.handoffs)
        return out

    fwd = [chunk(layer_f, c, emb_f, head_f) for c in range(n_chunks)]
    bwd = [chunk(layer_b, c, emb_b, head_b) for c in range(n_chunks)]
    msg = s * b * h * prec.compute_bytes  # stage messages travel in the GEMMs' dtype
    xfer, xfer_handoffs = p2p_time(msg, cl, False), 1
    if sp:  # each rank sends its own sequence shard: nothing to gather
        xfer = p2p_time(msg / t, cl, False)
    elif lay.scatter_gather and t > 1:
        # Each rank sends 1/t; the receiving pass all-gathers it over its tensor-parallel group, blocking.
        xfer = p2p_time(msg / t, cl, False)
        owner = lay.pipeline.owner
        for c in range(n_chunks):
            for side, src in ((fwd, c - 1), (bwd, c + 1)):
                if 0 <= src < n_chunks and owner(src) != owner(c):
                    x = side[c]
                    side[c] = _Pass(x.compute, x.comm + allgather_time(msg, t, cl), x.handoffs + t - 1)
    costs = LayerCosts(layer_f.compute, layer_b.compute, layer_f.comm, layer_b.comm,
                       emb_f.compute + emb_f.comm, emb_b.compute, head_f.compute + head_f.comm,
                       head_b.compute + head_b.comm, xfer, xfer,
                       breakdown={"layer_forward_ops": LAYER_OPS[0] * host.op_us * 1e-6,
                                  "tp_allreduce": allreduce(sbh)[1], "attention": "cpu"})
    return costs, fwd, bwd, xfer, xfer_handoffs


FIXED_POINT_ITERATIONS = 60  # simulations at most on the way to the fixed point
PRESORT_ITERATIONS = 6  # the planner's pre-sort: a partial fixed point (its leaders are then re-timed in full)


def predict_processes(dims: ModelDims, lay: Layout, cl: Cluster, parameters: list[int] | None = None,
                      iterations: int = FIXED_POINT_ITERATIONS) -> Prediction:
    """`predict` for CPU processes: the real schedule, each pass slowed by the ranks busy beside it.

    A pass runs while t·c·d × (the pipeline ranks computing during it) of our ranks are busy: its tensor-parallel
    peers, context-parallel ranks and data-parallel replicas mirror it. The pipeline is simulated with every pass
    at its busy count, the counts are taken again from the simulated timeline, and so on to a fixed point: ranks
    idle in the bubble leave their cores to the others. After the flush all N ranks are busy: the data-parallel
    all-reduce over d·c (gloo has no spare core to hide it behind the backward), the tied-embedding, grad-norm and
    loss all-reduces, the optimizer, and the Lightning loop around the step (`cpu_loop_us`). Under optimizer
    post-validation (`mlplat.perf.step.back_to_back`) the pipeline is timed back to back and no rank waits for the
    grad-norm and loss all-reduces, which run during the next step.

    iterations: simulations at most on the way to the fixed point (the first times every pass with all N ranks
    busy). On the tiny model's layouts PRESORT_ITERATIONS of them are up to a few % slower than the fixed point,
    never faster (tests/test_plan.py).
    """
    host = cl.host
    assert host is not None
    p, t = lay.pp, lay.tp
    d = lay.replicas  # d·c: the ranks that mirror a pass and hold the same weights (gradients reduced over them)
    world = lay.world_size
    costs, fwd, bwd, xfer, xfer_handoffs = host_costs(dims, lay, cl)
    res, period, busy, compute = _crowded_pipeline(dims, lay, cl, fwd, bwd, host.message(xfer, xfer_handoffs, world),
                                                   iterations)
    pipe = res.step_time if period is None else period
    # max(0, ...): back to back, three steps only approach the steady state's crowding, and a middle step's passes
    # can take a little longer than the period the last one adds.
    bubble = max(0.0, (pipe - max(busy)) / max(busy)) if max(busy) > 0 else 0.0

    elem = precision_of(lay.precision).activation_bytes
    params = parameters or stage_parameters(dims, t, lay.pipeline)
    first, last = lay.pipeline.owner(0), lay.pipeline.owner(lay.pipeline.last_chunk)
    slow = host.sharing(world)
    # Distributed optimizer: a reduce-scatter and, after the step, the weights' all-gather, each half an
    # all-reduce's ring (gloo has no spare core to hide either); the optimizer updates 1/d of the parameters.
    sharded = lay.distributed_optimizer and d > 1
    reduce, rounds = (allgather_time, d - 1) if sharded else (allreduce_time, 2 * (d - 1))

    def reduction(r: int, g: float) -> float:  # flatten, scale and copy back each bucket, and reduce it
        return slow * 4 * g / (host.memory_gbps * 1e9) + host.message(reduce(g, d, cl, False),
                                                                        rounds * engine_buckets(g), world)

    tensors = max(parameter_tensors(lay.pipeline.rank_layers(r, dims.n_layers), first == r, last == r,
                                    last == r and first != r and dims.embedding_at_head, dims) for r in range(p))
    # The grad-norm all-reduce and the loss all-reduce (all ranks, one element each) wait for the last rank.
    sync = host.message(allreduce_time(elem, world, cl, False), 2 * (world - 1), world)
    sync += host.message(allreduce_time(8, world, cl, False), 2 * (world - 1), world)
    gathers = param_gather_seconds(dims, lay, cl)
    finish = [x + g for x, g in zip(res.finish, gathers)]
    if period is not None:
        period += max(gathers)
    muon = {"newton_schulz": 0.0, "gather": 0.0}

    def optimizer(shard: int) -> float:
        if lay.optimizer == "muon":  # Newton–Schulz in the parameters' dtype at the measured GEMM rate (+ its ops)
            muon["newton_schulz"], muon["gather"] = muon_step(
                dims, lay, shard,
                lambda a, b: slow * host.seconds(Work(ns_flops(a, b, lay.muon_ns_steps), 0.0,
                                                      NS_OPS * lay.muon_ns_steps)),
                lambda nbytes, n: host.message(allgather_time(nbytes, n, cl, False), n - 1, world))
        return slow * (host.optimizer_seconds(tensors, max(params) // shard) + host.loop_us * 1e-6) + \
            muon["newton_schulz"] + muon["gather"]

    flush = after_flush(dims, lay, params, finish, FlushCosts(
        reduction=reduction,
        tied=lambda nbytes: host.message(allreduce_time(nbytes, 2, cl, False), 2, world),
        gather=lambda r, w: host.message(allgather_time(w, d, cl, False), (d - 1) * engine_buckets(w), world),
        optimizer=optimizer, sync=sync), period=period)
    last_rank = flush.rank
    f = [x.seconds(host, world) for x in fwd]
    b = [x.seconds(host, world) for x in bwd]
    messages = max(0.0, busy[last_rank] - compute[last_rank])
    costs.breakdown.update(rank_compute=compute[last_rank], rank_messages=messages, crowd=host.crowd(world))
    return Prediction(flush.end, pipe, bubble, flush.exposed, flush.optimizer, f, b, costs,
                      f"simulated, processes sharing {host.cores:g} cores", list(res.peak_in_flight), flush.gather,
                      optimizer_newton_schulz_seconds=muon["newton_schulz"], optimizer_gather_seconds=muon["gather"])


def param_gather_seconds(dims: ModelDims, lay: Layout, cl: Cluster) -> list[float]:
    """Sharded parameters (optim.sharding=params), per pipeline rank and step: every layer's weights all-gathered
    before its forward and its backward, and its gradients reduce-scattered after it (not under a split backward,
    whose reduction is the distributed optimizer's after the pass), m times, over the shard group, all of it
    exposed: gloo's processes have no spare core to hide it behind. Zero for every other layout."""
    host, n = cl.host, lay.shard_size
    if not (lay.param_sharding and lay.distributed_optimizer and n > 1):
        return [0.0] * lay.pp
    grad_bytes, weight_bytes = reduced_bytes(lay)
    scatter = 0 if lay.pipeline.spec.split_backward else 1
    world = lay.world_size

    def collective(nbytes: float) -> float:
        return host.message(allgather_time(nbytes, n, cl, False), n - 1, world)

    return [lay.num_micro_batches * sum(2 * collective(k * weight_bytes) + scatter * collective(k * grad_bytes)
                                        for k in rank_layer_parameters(dims, lay, r)) for r in range(lay.pp)]


def _crowded_pipeline(dims: ModelDims, lay: Layout, cl: Cluster, fwd: list, bwd: list, transfer: float,
                      iterations: int) -> tuple[SimResult, float | None, list[float], list[float]]:
    """The pipeline of `predict_processes` simulated to the fixed point of its busy counts: (the simulation, the
    steady-state period back to back or None, each rank's busy seconds in the timed step, of which compute)."""
    host = cl.host
    p, v, m = lay.pp, lay.vpp, lay.num_micro_batches
    world, mirrors = lay.world_size, lay.stride("pp")  # t·c·d: the ranks of one pipeline rank, running the same passes
    sched = build_schedule(lay.schedule, p, v, m)
    split = lay.pipeline.spec.split_backward
    busy_of: dict[tuple, float] = {}  # (op, chunk, micro-batch) -> our ranks busy during that pass

    def pass_time(op, c: int, mb: int) -> float:
        k = busy_of.get((op, c, mb), world)
        if op is Op.FORWARD:
            return fwd[c].seconds(host, k)
        if op is Op.WEIGHT:  # the weight-gradient GEMMs: about a forward's compute
            return host.sharing(k) * fwd[c].compute
        return bwd[c].seconds(host, k) - (host.sharing(k) * fwd[c].compute if split else 0.0)

    cost = CostModel(forward=lambda r, c, mb: pass_time(Op.FORWARD, c, mb),
                     backward=lambda r, c, mb: pass_time(Op.BACKWARD, c, mb),
                     weight=lambda r, c, mb: pass_time(Op.WEIGHT, c, mb),
                     transfer=lambda src, dst, kind: transfer if p > 1 else 0.0)

    def fixed_point(timeline) -> SimResult:
        """The simulated `timeline` once the busy counts it produces are the ones it was timed with."""
        plans = prepare(exchange_plans(timeline))  # the same messages at every iteration: only the pass times move
        for _ in range(iterations):
            res = simulate_nccl(timeline, cost, v, plans=plans)
            if res.deadlock:
                raise RuntimeError(f"schedule {lay.schedule} p={p} v={v} m={m} deadlocks in the simulator")
            events = res.compute_events()
            change = 0.0
            for e, ranks in zip(events, mean_concurrency([(e.rank, e.start, e.end) for e in events])):
                key = (e.op, e.chunk, e.micro_batch)
                old = busy_of.get(key, world)
                new = 0.5 * old + 0.5 * mirrors * ranks  # damped: the timeline moves with the counts
                change = max(change, abs(new - old) / old)
                busy_of[key] = new
            if change < 1e-4:
                break
        return res

    # Steps back to back (post-validation, `back_to_back`): the next step's head fills this one's tail, and the
    # ranks that idled there now crowd the cores. Timed as the GPU model does (`steady_state_step`), at the busy
    # counts of STEADY_STEPS steps run that way (copy k's micro-batches are k·m + mb).
    b2b = back_to_back(dims, lay)
    steps = STEADY_STEPS if b2b else 1
    res = fixed_point(simulator.back_to_back(sched, steps) if b2b else sched)
    period = simulator.steady_state_step(sched, cost, v, simulate_nccl) if b2b else None
    busy = [0.0] * p
    compute = [0.0] * p  # of which compute (the rest: blocking messages)
    for e in res.compute_events():
        if e.micro_batch // m != steps // 2:  # back to back, the middle step's: crowded at both ends
            continue
        busy[e.rank] += e.end - e.start
        k = busy_of[(e.op, e.chunk, e.micro_batch)]
        c = fwd[e.chunk].compute if e.op in (Op.FORWARD, Op.WEIGHT) else (
            bwd[e.chunk].compute - (fwd[e.chunk].compute if split else 0.0))
        compute[e.rank] += host.sharing(k) * c
    return res, period, busy, compute
