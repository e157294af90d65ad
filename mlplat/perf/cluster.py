"""Cluster cost model: seconds per iteration of a PTD-P layout, by timing the real schedule.

The per-chunk forward/backward times and the stage-to-stage transfer times below are fed to
`mlplat.perf.simulator.simulate_nccl`, which executes the very instruction lists (as the engine posts them) of
`mlplat.parallel.pipeline.schedules.build_schedule` that the engine runs; the data-parallel all-reduce and
the optimizer step are added after the pipeline flush. All times are per GPU (one tensor-parallel rank).

How each term is modelled (and the numbers chosen):
- GEMMs. time = max(FLOPs / (peak · e · q), bytes / (0.8 · HBM bandwidth))  -- a roofline.
  e = the device's sustained large-GEMM efficiency (`Device.gemm_efficiency`: A100 0.72, H100 0.68):
  cuBLAS reaches ~80-85% of peak in isolation, a little less under a training job's power draw.
  q = tile and wave quantisation: the output is cut into tiles (we let it pick the best of
  256x128 / 128x128 / 128x64 / 64x64, smaller tiles being intrinsically less efficient: 1.0 / 0.94 /
  0.85 / 0.70) and the tiles run in waves of `sm_count`; q = useful tiles / (waves · SMs) × the padding
  waste of the last row/column of tiles. This is what makes small h/t (and small b·s) GEMMs slow.
  The attention-score GEMMs (QKᵀ and scores·V, K or N = head dim) come out memory-bound by the roofline.
- Element-wise work (LayerNorm, softmax, dropout, bias+GeLU, residual adds) is pure memory traffic, counted
  per layer forward in bytes of 2-byte tensors: 22·sbh + 20·sbh/t + 9·a·s²·b/t with the paper's fused
  kernels (scale+mask+softmax 4, dropout 5 bytes per score), +40% on the first two terms and 17 bytes per
  score unfused; flash attention has no s² traffic. Autocast (Lightning's bf16-mixed) adds fp32
  LayerNorm/residual traffic (+28·sbh) and casts the fp32 weights to bf16 in every forward (6 bytes/param)
  and accumulates fp32 weight gradients in every backward (10 bytes/param). Backward = 2x forward traffic.
- Flash attention: causal, so it executes half the score FLOPs: forward at 0.65 of peak, backward (2.5x the
  forward's FLOPs, it recomputes the scores) at 0.5 of peak (FlashAttention-2 on A100).
- Recomputation: full re-runs each layer's forward (GEMMs, element-wise work, its 2 all-reduces) in the
  backward; selective re-runs only the attention core.
- Tensor parallelism: ring all-reduce of s·b·h·2 bytes, 2 in the forward and 2 in the backward of every
  layer (+2 for the recomputed forward), time 2(t-1)·α + 2(t-1)/t · bytes / (η · NVLink), η = 0.8 (NCCL
  bus bandwidth on NVSwitch), α = 3 µs per ring step. Over InfiniBand if t spans nodes. Sequence parallelism
  replaces each all-reduce by an all-gather and a reduce-scatter (a ring all-reduce is exactly these two), so
  the layers' communication is unchanged; the embedding's forward all-reduce becomes a reduce-scatter (half) and
  its backward gains an all-gather (half), the head's input all-gather and its gradient's reduce-scatter are
  half an all-reduce each. What it saves is element-wise work: LayerNorm, dropout and the residual adds run on
  s/t tokens (the 22·sbh below become 22·sbh/t).
- Pipeline sends: the residual stream, s·b·h × (2 bytes, or 4 under autocast whose residual is fp32),
  over IB between nodes (η = 0.9, α = 8 µs) or NVLink inside one. With scatter/gather (t > 1) each of the
  t ranks sends 1/t of it and the receiver all-gathers over NVLink; the transfer time is their sum. With
  sequence parallelism each rank sends its sequence shard, 1/t of it, and nothing is gathered.
  Stage neighbours are t·d global ranks apart (grid.py: rank = tp + t·(dp + d·pp)), so they share a node
  only when t·d·(stage distance) stays inside one.
- Data-parallel gradient all-reduce: ring over the d replicas (IB when t·d exceeds a node, each GPU on
  its own HCA), of the rank's gradients (2 bytes each; 4 under autocast, whose gradients are fp32, and under
  bf16-megatron/16-megatron, which reduce the fp32 main gradients, unless optim.grad_reduce_dtype=bf16).
  Buckets are all-reduced while the last micro-batch's backward runs, so only what does not fit under one
  micro-batch's backward on the rank, and at least the last 25 MiB bucket, is exposed. The tied embedding's
  gradient is all-reduced between the first and last stage (exposed).
- Distributed optimizer (optim.distributed): the gradients are reduce-scattered instead ((d-1)/d of the
  bytes once, half an all-reduce), exposed by the same rule; after the optimizer the updated weights (the
  weights' bytes) are all-gathered, which the next step's forward waits for chunk by chunk: exposed is what
  does not fit under one micro-batch's forward of the rank's chunks, and at least one bucket.
- Optimizer step: memory bound, 32 bytes of traffic per parameter held (Adam: read weight, grad, m, v;
  write weight, m, v; plus the grad-norm read), at 0.8 of HBM bandwidth; 1/d of the parameters with the
  distributed optimizer.
- Memory: a layout fits when the worst GPU of `mlplat.perf.memory` stays under `usable_fraction` (0.95) of
  the device memory; the PyTorch caching allocator's fragmentation takes the rest.
Not modelled: data loading, logging, Python/launch overheads, straggler noise, NCCL kernels slowing
overlapped compute. The paper's figures include all of these, so expect predictions a little optimistic.

CPU processes (the `cluster.cpu_*` figures set, measured by `mlplat.perf.calibrate`): every rank is a process on
shared cores and talks gloo; `_predict_host` replaces all of the above with the measured model of
`mlplat.perf.host` (checked against measured runs by `experiments/cost_model_check/`).

Large m: the simulator is exact for any m, and runs at ~1 µs per instruction (p=64, m=512: under a
second). Above `max_compute_ops` F/B instructions we simulate m1 = 2p and m2 = 3p micro-batches and
extrapolate linearly: after the warm-up, every extra group of micro-batches adds the same time (the
bottleneck stage's steady-state period), so step time, per-rank finish and busy times are affine in m.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from mlplat.config import CPU_KEYS, ClusterConfig
from mlplat.parallel.buckets import BUCKET_BYTES
from mlplat.parallel.pipeline.layout import ZERO_BUBBLE
from mlplat.perf.devices import Device, get_device, peak_flops
from mlplat.perf.flops import ModelDims, layer_parameters, padded_vocab, stage_parameters
from mlplat.perf.host import LAYER_OPS, Host, Work, block_work, mean_concurrency, parameter_tensors
from mlplat.perf.memory import STATE_BYTES, Layout, precision_memory

MIB = 1024**2

_TILES = ((256, 128, 1.0), (128, 128, 0.94), (128, 64, 0.85), (64, 64, 0.70))
FLASH_EFFICIENCY = (0.65, 0.50)  # fraction of peak, forward / backward, on executed FLOPs
DP_BUCKET_BYTES = 25 * MIB
OPTIMIZER_BYTES_PER_PARAM = 32


@dataclass(frozen=True)
class Cluster:
    """The `cluster.*` config group: a device type and the links between devices."""

    name: str
    device: Device
    gpus_per_node: int
    gpu_memory_gb: float  # GiB per device usable by one rank
    nvlink_gbps: float  # per GPU per direction
    ib_gbps_per_gpu: float
    nodes: int | None = None  # size of the machine, if known
    nvlink_efficiency: float = 0.8
    ib_efficiency: float = 0.9
    nvlink_latency_s: float = 3e-6
    ib_latency_s: float = 8e-6
    hbm_efficiency: float = 0.8
    overhead_gib: float = 2.0  # CUDA context, NCCL buffers
    usable_fraction: float = 0.95  # the caching allocator's fragmentation eats the rest
    host: Host | None = None  # measured CPU figures (cluster.cpu_*): then ranks are processes sharing cores

    @property
    def memory_bytes(self) -> float:
        return self.gpu_memory_gb * 1024**3

    @property
    def usable_memory_bytes(self) -> float:
        """What a layout may plan to use: a layout "fits" when its worst GPU stays under this."""
        return self.usable_fraction * self.memory_bytes

    @classmethod
    def of(cls, c: ClusterConfig, accelerator: str = "gpu") -> "Cluster":
        """From the run's `cluster.*` section; no device named: a DGX A100 for GPU runs, this machine's CPU
        otherwise."""
        device = c.device or ("a100-80gb" if accelerator in ("gpu", "cuda") else "cpu")
        dev = get_device(device)
        pick = lambda value, default: default if value is None else value  # noqa: E731
        return cls(
            name=pick(c.name, "local_cpu" if dev.nominal and c.device is None else dev.name), device=dev,
            gpus_per_node=int(pick(c.gpus_per_node, dev.gpus_per_node)),
            gpu_memory_gb=float(pick(c.gpu_memory_gb, dev.memory_gib)),
            nvlink_gbps=float(pick(c.nvlink_gbps, dev.nvlink_gbps)),
            ib_gbps_per_gpu=float(pick(c.ib_gbps_per_gpu, dev.ib_gbps_per_gpu)),
            nodes=c.nodes, nvlink_efficiency=c.nvlink_efficiency, ib_efficiency=c.ib_efficiency,
            nvlink_latency_s=c.nvlink_latency_us * 1e-6, ib_latency_s=c.ib_latency_us * 1e-6,
            hbm_efficiency=c.hbm_efficiency, overhead_gib=float(pick(c.overhead_gib, 0.3 if dev.nominal else 2.0)),
            usable_fraction=c.usable_fraction,
            host=None if c.cpu_cores is None else Host(**{k.removeprefix("cpu_"): getattr(c, k) for k in CPU_KEYS}),
        )

    @classmethod
    def from_config(cls, c: Mapping[str, Any]) -> "Cluster":
        """From a `cluster.*` mapping (e.g. a conf/cluster/ file), checked as the run config checks it."""
        from mlplat.config import from_dict

        return cls.of(from_dict({"cluster": dict(c)}).cluster)


def resolve_attention(attention: str, cluster: Cluster, precision: str) -> str:
    """What the attention kernel will be: 'flash' (no s² memory) or 'unfused' (explicit scores)."""
    if attention in ("flash", "unfused"):
        return attention
    half = precision.startswith(("bf16", "16")) or precision == "megatron-fp16"
    if attention in ("auto", "sdpa") and not cluster.device.nominal and half:
        return "flash"  # flash-attn, or SDPA's flash backend on A100/H100 in half precision
    return "unfused"


# ---------------------------------------------------------------------------------------------- kernels

def gemm_time(cl: Cluster, M: int, N: int, K: int, batch: int = 1, peak: float | None = None,
              elem_bytes: int = 2) -> float:
    """Seconds for `batch` GEMMs [M,K]x[K,N] on one GPU (roofline with tile/wave quantisation)."""
    dev = cl.device
    peak = peak or peak_flops(dev, "bf16")
    q = 0.0
    for tm, tn, e in _TILES:
        tiles = math.ceil(M / tm) * math.ceil(N / tn) * batch
        waves = math.ceil(tiles / dev.sm_count)
        padding = (M * N * batch) / (tiles * tm * tn)
        q = max(q, e * padding * tiles / (waves * dev.sm_count))
    flops = 2.0 * M * N * K * batch
    compute = flops / (peak * dev.gemm_efficiency * q)
    memory = elem_bytes * batch * (M * K + K * N + M * N) / (dev.hbm_gbytes_per_s * 1e9 * cl.hbm_efficiency)
    return max(compute, memory)


def _bw(gbps: float, eff: float) -> float:
    return gbps * 1e9 / 8 * eff  # bytes/s


def allreduce_time(nbytes: float, n: int, cl: Cluster, inter_node: bool) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks."""
    if n <= 1:
        return 0.0
    bw, lat = (_bw(cl.ib_gbps_per_gpu, cl.ib_efficiency), cl.ib_latency_s) if inter_node else \
        (_bw(cl.nvlink_gbps, cl.nvlink_efficiency), cl.nvlink_latency_s)
    return 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw


def allgather_time(nbytes: float, n: int, cl: Cluster, inter_node: bool = False) -> float:
    """Ring all-gather producing `nbytes` on each of `n` ranks."""
    if n <= 1:
        return 0.0
    bw, lat = (_bw(cl.ib_gbps_per_gpu, cl.ib_efficiency), cl.ib_latency_s) if inter_node else \
        (_bw(cl.nvlink_gbps, cl.nvlink_efficiency), cl.nvlink_latency_s)
    return (n - 1) * lat + (n - 1) / n * nbytes / bw


def p2p_time(nbytes: float, cl: Cluster, inter_node: bool) -> float:
    bw, lat = (_bw(cl.ib_gbps_per_gpu, cl.ib_efficiency), cl.ib_latency_s) if inter_node else \
        (_bw(cl.nvlink_gbps, cl.nvlink_efficiency), cl.nvlink_latency_s)
    return lat + nbytes / bw


# ---------------------------------------------------------------------------------------------- the model

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


def layer_costs(dims: ModelDims, lay: Layout, cl: Cluster) -> LayerCosts:
    if cl.host is not None:
        return _host_costs(dims, lay, cl)[0]
    s, b, h, a, t = dims.seq_len, lay.micro_batch_size, dims.hidden, dims.n_heads, lay.tp
    ffn, d_head = dims.ffn, dims.hidden // dims.n_heads
    peak = peak_flops(cl.device, lay.precision)
    _, residual, scale = precision_memory(lay.precision)
    elem = 2 if scale == 1.0 else int(2 * scale)
    hbm = cl.device.hbm_gbytes_per_s * 1e9 * cl.hbm_efficiency
    autocast = lay.precision in ("bf16-mixed", "16-mixed")
    attention = resolve_attention(lay.attention, cl, lay.precision)
    M, sbh = b * s, s * b * h

    g = lambda m_, n_, k_, bt=1: gemm_time(cl, m_, n_, k_, bt, peak, elem)  # noqa: E731
    dense_f = g(M, 3 * h // t, h) + g(M, h, h // t) + g(M, ffn // t, h) + g(M, h, ffn // t)
    # Backward of Y = XW: dX = dY·Wᵀ and dW = Xᵀ·dY, each the forward's size.
    dense_b = (g(M, h, 3 * h // t) + g(3 * h // t, h, M) + g(M, h // t, h) + g(h, h // t, M)
               + g(M, h, ffn // t) + g(ffn // t, h, M) + g(M, ffn // t, h) + g(h, ffn // t, M))
    heads = b * a // t
    if attention == "flash":
        core_f = 2.0 * b * s * s * h / t / (peak * FLASH_EFFICIENCY[0])
        core_b = 5.0 * b * s * s * h / t / (peak * FLASH_EFFICIENCY[1])
        score_bytes = 0.0
    else:
        core_f = g(s, s, d_head, heads) + g(s, d_head, s, heads)
        core_b = 2 * core_f
        score_bytes = (9 if lay.fused else 17) * a * s * s * b / t * scale
    sp = lay.sequence_parallel and t > 1
    replicated = t if sp else 1  # the LayerNorm/dropout/residual work, split along the sequence or not
    other_bytes = (22 * sbh / replicated + 20 * sbh / t) * scale * (1.0 if lay.fused else 1.4)
    if autocast:
        other_bytes += 28 * sbh / replicated
    p_layer = layer_parameters(h, t, ffn)
    cast_f = 6 * p_layer if autocast else 0
    cast_b = 10 * p_layer if autocast else 0
    elem_f = (other_bytes + score_bytes + cast_f) / hbm
    elem_b = (2 * (other_bytes + score_bytes) + cast_b) / hbm

    fwd = dense_f + core_f + elem_f
    bwd = dense_b + core_b + elem_b
    if lay.recompute == "full":
        bwd += fwd
    elif lay.recompute == "selective":
        bwd += core_f + score_bytes / hbm

    tp_inter = t > cl.gpus_per_node
    ar = allreduce_time(sbh * 2, t, cl, tp_inter)  # the row-parallel outputs are bf16 under autocast too
    n_bwd = 2 + (2 if lay.recompute == "full" else 0)

    # Embedding: lookup + position add + dropout (~10 bytes per element), one all-reduce over tp (sequence
    # parallel: a reduce-scatter forward, an all-gather backward, half an all-reduce each).
    emb_f = 10 * sbh * scale / hbm + (ar / 2 if sp else ar)
    emb_b = 2 * 10 * sbh * scale / hbm + (ar / 2 if sp else 0.0)
    vocab = padded_vocab(dims.vocab_size, t, dims.vocab_pad_multiple)
    logits_f = g(M, vocab // t, h)
    logits_b = g(M, h, vocab // t) + g(vocab // t, h, M)
    ce_bytes = 16 * s * b * vocab / t  # fp32 upcast, max, exp, sum, gradient of the cross-entropy
    head_f = logits_f + (ce_bytes + 8 * sbh) / hbm + (ar / 2 if sp else 0.0)  # sequence parallel: all-gather
    # The input-gradient all-reduce of the logits (sequence parallel: a reduce-scatter).
    head_b = logits_b + (ce_bytes + 16 * sbh) / hbm + (ar / 2 if sp else ar)

    msg = sbh * residual
    if sp:  # the stage's sequence shard, 1/t of the activation, different on each rank: nothing to gather
        x_inter, x_intra = p2p_time(msg / t, cl, True), p2p_time(msg / t, cl, False)
    elif lay.scatter_gather and t > 1:
        x_inter = p2p_time(msg / t, cl, True) + allgather_time(msg, t, cl)
        x_intra = p2p_time(msg / t, cl, False) + allgather_time(msg, t, cl)
    else:
        x_inter, x_intra = p2p_time(msg, cl, True), p2p_time(msg, cl, False)
    return LayerCosts(fwd, bwd, 2 * ar, n_bwd * ar, emb_f, emb_b, head_f, head_b, x_inter, x_intra,
                      breakdown={"dense_gemm_forward": dense_f, "attention_core_forward": core_f,
                                 "elementwise_forward": elem_f, "tp_allreduce": ar,
                                 "attention": attention})


@dataclass
class Prediction:
    seconds_per_iteration: float
    pipeline_seconds: float  # until the last backward (the flush)
    bubble_fraction: float  # (pipeline time - busiest rank's compute) / that compute
    dp_exposed_seconds: float
    optimizer_seconds: float
    chunk_forward: list[float]
    chunk_backward: list[float]
    costs: LayerCosts
    method: str  # "simulated" | "extrapolated (m1, m2)" | "analytic"
    peak_in_flight: list[int] | None = None
    dp_allgather_exposed_seconds: float = 0.0  # distributed optimizer: the weights' all-gather not hidden


def chunk_times(dims: ModelDims, lay: Layout, c: LayerCosts) -> tuple[list[float], list[float]]:
    n_chunks = lay.pipeline.num_chunks
    per = lay.pipeline.layers_per_chunk(dims.n_layers)
    f = [per * (c.layer_forward + c.tp_forward) for _ in range(n_chunks)]
    b = [per * (c.layer_backward + c.tp_backward) for _ in range(n_chunks)]
    f[0] += c.embedding_forward
    b[0] += c.embedding_backward
    f[-1] += c.head_forward
    b[-1] += c.head_backward
    return f, b


def _stage_inter_node(lay: Layout, cl: Cluster, src: int, dst: int) -> bool:
    stride = lay.tp * lay.dp  # global-rank distance between neighbouring pipeline stages
    return (stride * src) // cl.gpus_per_node != (stride * dst) // cl.gpus_per_node or stride >= cl.gpus_per_node


def _simulate(lay: Layout, m: int, f: list[float], b: list[float],
              xfer) -> tuple[float, list[float], list[float], list[int]]:
    from mlplat.parallel.pipeline.schedules import ZERO_BUBBLE, build_schedule
    from mlplat.perf.simulator import CostModel, simulate_nccl

    sched = build_schedule(lay.schedule, lay.pp, lay.vpp, m)
    if lay.schedule in ZERO_BUBBLE:  # W: the weight-gradient GEMMs, about a forward; B: the rest of b
        cost = CostModel(forward=lambda r, c, mb: f[c], backward=lambda r, c, mb: b[c] - f[c],
                         weight=lambda r, c, mb: f[c], transfer=lambda src, dst, kind: xfer[src][dst])
    else:
        cost = CostModel(forward=lambda r, c, mb: f[c], backward=lambda r, c, mb: b[c],
                         transfer=lambda src, dst, kind: xfer[src][dst])
    res = simulate_nccl(sched, cost, lay.vpp)
    if res.deadlock:
        raise RuntimeError(f"schedule {lay.schedule} p={lay.pp} v={lay.vpp} m={m} deadlocks in the simulator")
    busy = [0.0] * lay.pp
    for e in res.compute_events():
        busy[e.rank] += e.end - e.start
    return res.step_time, list(res.finish), busy, list(res.peak_in_flight)


def pipeline_time(lay: Layout, f: list[float], b: list[float], xfer, max_compute_ops: int = 400_000):
    """(step time, per-rank finish, per-rank busy, peak in flight, method) of the pipeline part."""
    p, v, m = lay.pp, lay.vpp, lay.num_micro_batches
    if 2 * p * v * m <= max_compute_ops or m <= 3 * p:
        step, finish, busy, peak = _simulate(lay, m, f, b, xfer)
        return step, finish, busy, peak, "simulated"
    m1, m2 = 2 * p, 3 * p
    s1, f1, b1, peak = _simulate(lay, m1, f, b, xfer)
    s2, f2, b2, _ = _simulate(lay, m2, f, b, xfer)
    k = (m - m1) / (m2 - m1)
    lin = lambda x1, x2: x1 + (x2 - x1) * k  # noqa: E731
    return (lin(s1, s2), [lin(x, y) for x, y in zip(f1, f2)], [lin(x, y) for x, y in zip(b1, b2)], peak,
            f"extrapolated from m={m1},{m2}")


def reduced_bytes(lay: Layout) -> tuple[int, int]:
    """(bytes per gradient element the data-parallel reduction moves, bytes per model weight)."""
    scheme, _, scale = precision_memory(lay.precision)
    if lay.precision in ("bf16-mixed", "16-mixed"):
        grad_bytes = 4  # autocast: fp32 gradients of fp32 weights
    elif scheme == "mixed_fp32_grad":  # bf16-megatron/16-megatron: the fp32 main gradients, or a bf16 copy
        grad_bytes = 2 if lay.grad_reduce_dtype == "bf16" else 4
    else:
        grad_bytes = int(2 * scale)
    return grad_bytes, STATE_BYTES[scheme][0]


def predict(dims: ModelDims, lay: Layout, cl: Cluster, *, parameters: list[int] | None = None,
            method: str = "simulate", max_compute_ops: int = 400_000) -> Prediction:
    """Seconds per iteration of `lay` on `cl`. method: 'simulate' (the real schedule) or 'analytic'."""
    if cl.host is not None:
        return _predict_host(dims, lay, cl, parameters)
    p, v, t, d, m = lay.pp, lay.vpp, lay.tp, lay.dp, lay.num_micro_batches
    costs = layer_costs(dims, lay, cl)
    f, b = chunk_times(dims, lay, costs)
    xfer = [[(costs.transfer if _stage_inter_node(lay, cl, i, j) else costs.transfer_intra) for j in range(p)]
            for i in range(p)]
    params = parameters or stage_parameters(dims, t, lay.pipeline)

    if method == "analytic" or p == 1:
        # Uniform-stage 1F1B/interleaved: (m·v + p - 1) chunk slots of the slowest rank, each paying a
        # message round trip once p > 1 (the simulator confirms this within a few % for large m).
        per_rank = [sum(f[c] + b[c] for c in lay.pipeline.chunks_of(r)) / v for r in range(p)]
        slot = max(per_rank)
        x = max(max(row) for row in xfer) if p > 1 else 0.0
        # Zero bubble: W fills all but about a third of the warm-up slots (Qi et al.; the simulator is exact).
        fill = (p - 1) / 3 if lay.schedule in ZERO_BUBBLE else p - 1
        slots = m * v + fill if lay.schedule != "gpipe" else m + p - 1
        pipe = slots * (slot + 2 * x)
        busy = [m * v * c for c in per_rank]
        finish = [pipe - (r * (slot + x) if lay.schedule != "gpipe" else 0.0) for r in range(p)]
        peak, how = None, "analytic" if p > 1 else "exact (p = 1)"
    else:
        pipe, finish, busy, peak, how = pipeline_time(lay, f, b, xfer, max_compute_ops)
    bubble = (pipe - max(busy)) / max(busy) if max(busy) > 0 else 0.0

    grad_bytes, weight_bytes = reduced_bytes(lay)
    sharded = lay.distributed_optimizer and d > 1
    # Reduce-scatter and all-gather each move (d-1)/d of the bytes once: the ring's two halves of an all-reduce.
    reduce = allgather_time if sharded else allreduce_time
    dp_inter = t * d > cl.gpus_per_node
    hbm = cl.device.hbm_gbytes_per_s * 1e9 * cl.hbm_efficiency
    ready, exposed_of, gather_of = [], [], []
    tied_ranks = {lay.pipeline.owner(0), lay.pipeline.owner(lay.pipeline.last_chunk)}
    for r in range(p):
        g = params[r] * grad_bytes
        ar = reduce(g, d, cl, dp_inter)
        window = sum(b[c] for c in lay.pipeline.chunks_of(r))  # the rank's last micro-batch backward
        exposed = max(ar - window, reduce(min(g, DP_BUCKET_BYTES), d, cl, dp_inter)) if d > 1 else 0.0
        if r in tied_ranks and len(tied_ranks) == 2:  # the word embedding's copies, on two ranks
            emb = padded_vocab(dims.vocab_size, t, dims.vocab_pad_multiple) // t * dims.hidden * grad_bytes
            exposed += allreduce_time(emb / (d if sharded else 1), 2, cl, _stage_inter_node(lay, cl, 0, p - 1))
        ready.append(finish[r] + exposed)
        exposed_of.append(exposed)
        if sharded:  # the updated weights, waited for by the next step's forward of each chunk
            w = params[r] * weight_bytes
            forward = sum(f[c] for c in lay.pipeline.chunks_of(r))
            gather_of.append(max(allgather_time(w, d, cl, dp_inter) - forward,
                                 allgather_time(min(w, DP_BUCKET_BYTES), d, cl, dp_inter)))
    # The global grad-norm (clipping) all-reduce makes every rank wait for the last one before stepping.
    last = max(range(p), key=lambda r: ready[r])
    opt = OPTIMIZER_BYTES_PER_PARAM * max(params) / (d if sharded else 1) / hbm
    gather = max(gather_of) if gather_of else 0.0
    end = ready[last] + opt + gather
    dp_exposed = exposed_of[last]
    return Prediction(end, pipe, bubble, dp_exposed, opt, f, b, costs, how, peak, gather)


# ---------------------------------------------------------------------------------------------- CPU processes

ENGINE_BUCKET_BYTES = BUCKET_BYTES  # the engine's own size (the GPU model's DP_BUCKET_BYTES is Megatron's)


def _engine_buckets(nbytes: float) -> int:
    """How many data-parallel buckets (each one collective) mlplat's engine reduces `nbytes` of gradients in."""
    return max(1, math.ceil(nbytes / ENGINE_BUCKET_BYTES))

@dataclass
class _Pass:
    """One chunk's forward or backward over one micro-batch on one rank (`mlplat.perf.host`)."""

    compute: float  # seconds of one thread with a core to itself
    comm: float  # blocking gloo time of its tensor-parallel collectives, alone
    handoffs: int  # their hand-offs (2(t-1) per ring all-reduce)

    def seconds(self, host: Host, busy: float) -> float:
        """With `busy` ranks of ours computing meanwhile."""
        return host.message(self.comm, self.handoffs, busy) + host.sharing(busy) * self.compute


def _host_costs(dims: ModelDims, lay: Layout, cl: Cluster) -> tuple[LayerCosts, list[_Pass], list[_Pass], float, int]:
    """(LayerCosts alone, forward and backward passes per chunk, stage transfer seconds alone, its hand-offs)."""
    host = cl.host
    assert host is not None
    t, s, b, h = lay.tp, dims.seq_len, lay.micro_batch_size, dims.hidden
    _, residual, scale = precision_memory(lay.precision)
    elem = int(2 * scale)
    sp = lay.sequence_parallel and t > 1
    work = block_work(dims, b, t, elem, lay.recompute, sp)
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
    layer_f, layer_b = passes("layer", [sbh] * 2, False), passes("layer", [sbh] * n_bwd, True)
    emb_f = passes("embedding", [half(sbh)] if sp else [sbh], False)
    emb_b = passes("embedding", [half(sbh)] if sp else [], True)
    # The vocab-parallel cross-entropy all-reduces the max and (sum of exp, target logit) per token; the logits'
    # input gradient is all-reduced (sequence parallel: the input all-gathered, its gradient reduce-scattered).
    tokens = s * b
    ce = [tokens * elem, 2 * tokens * elem]
    head_f = passes("head", ce + ([half(sbh)] if sp else []), False)
    head_b = passes("head", [half(sbh)] if sp else [sbh], True)

    n_chunks = lay.pipeline.num_chunks
    per = lay.pipeline.layers_per_chunk(dims.n_layers)

    def chunk(layer: _Pass, c: int, first: _Pass, last: _Pass) -> _Pass:
        out = _Pass(per * layer.compute, per * layer.comm, per * layer.handoffs)
        for end, on in ((first, c == 0), (last, c == n_chunks - 1)):
            if on:
                out = _Pass(out.compute + end.compute, out.comm + end.comm, out.handoffs + end.handoffs)
        return out

    fwd = [chunk(layer_f, c, emb_f, head_f) for c in range(n_chunks)]
    bwd = [chunk(layer_b, c, emb_b, head_b) for c in range(n_chunks)]
    msg = s * b * h * residual
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


def _predict_host(dims: ModelDims, lay: Layout, cl: Cluster, parameters: list[int] | None) -> Prediction:
    """`predict` for CPU processes: the real schedule, each pass slowed by the ranks busy beside it.

    A pass runs while t·d × (the pipeline ranks computing during it) of our ranks are busy: its tensor-parallel
    peers and data-parallel replicas mirror it. The pipeline is simulated with every pass at its busy count, the
    counts are taken again from the simulated timeline, and so on to a fixed point: ranks idle in the bubble
    leave their cores to the others. After the flush all N ranks are busy: the data-parallel all-reduce (gloo
    has no spare core to hide it behind the backward), the tied-embedding, grad-norm and loss all-reduces, the
    optimizer, and the Lightning loop around the step (`cpu_loop_us`).
    """
    from mlplat.parallel.pipeline.schedules import ZERO_BUBBLE, Op, build_schedule
    from mlplat.perf.simulator import CostModel, simulate_nccl

    host = cl.host
    assert host is not None
    p, v, t, d, m = lay.pp, lay.vpp, lay.tp, lay.dp, lay.num_micro_batches
    world = t * p * d
    costs, fwd, bwd, xfer, xfer_handoffs = _host_costs(dims, lay, cl)
    transfer = host.message(xfer, xfer_handoffs, world)
    sched = build_schedule(lay.schedule, p, v, m)
    split = lay.schedule in ZERO_BUBBLE
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
    for _ in range(60):
        res = simulate_nccl(sched, cost, v)
        if res.deadlock:
            raise RuntimeError(f"schedule {lay.schedule} p={p} v={v} m={m} deadlocks in the simulator")
        events = res.compute_events()
        change = 0.0
        for e, ranks in zip(events, mean_concurrency([(e.rank, e.start, e.end) for e in events])):
            key = (e.op, e.chunk, e.micro_batch)
            old = busy_of.get(key, world)
            new = 0.5 * old + 0.5 * t * d * ranks  # damped: the timeline moves with the counts
            change = max(change, abs(new - old) / old)
            busy_of[key] = new
        if change < 1e-4:
            break
    busy = [0.0] * p
    compute = [0.0] * p  # of which compute (the rest: blocking messages)
    for e in res.compute_events():
        busy[e.rank] += e.end - e.start
        k = busy_of[(e.op, e.chunk, e.micro_batch)]
        c = fwd[e.chunk].compute if e.op in (Op.FORWARD, Op.WEIGHT) else (
            bwd[e.chunk].compute - (fwd[e.chunk].compute if split else 0.0))
        compute[e.rank] += host.sharing(k) * c
    pipe = res.step_time
    bubble = (pipe - max(busy)) / max(busy) if max(busy) > 0 else 0.0

    _, _, scale = precision_memory(lay.precision)
    elem = int(2 * scale)
    params = parameters or stage_parameters(dims, t, lay.pipeline)
    first, last = lay.pipeline.owner(0), lay.pipeline.owner(lay.pipeline.last_chunk)
    per = lay.pipeline.layers_per_chunk(dims.n_layers)
    slow = host.sharing(world)
    grad_bytes, weight_bytes = reduced_bytes(lay)
    sharded = lay.distributed_optimizer and d > 1
    # Distributed optimizer: a reduce-scatter and, after the step, the weights' all-gather, each half an
    # all-reduce's ring (gloo has no spare core to hide either); the optimizer updates 1/d of the parameters.
    reduce, rounds = (allgather_time, d - 1) if sharded else (allreduce_time, 2 * (d - 1))
    ready, exposed_of, tensors, gather_of = [], [], [], []
    for r in range(p):
        g = params[r] * grad_bytes
        exposed = 0.0
        if d > 1:  # flatten, scale and copy back each bucket, and reduce it
            exposed += slow * 4 * g / (host.memory_gbps * 1e9)
            exposed += host.message(reduce(g, d, cl, False), rounds * _engine_buckets(g), world)
        if r in (first, last) and first != last:
            emb = padded_vocab(dims.vocab_size, t, dims.vocab_pad_multiple) // t * dims.hidden * grad_bytes
            exposed += host.message(allreduce_time(emb / (d if sharded else 1), 2, cl, False), 2, world)
        ready.append(res.finish[r] + exposed)
        exposed_of.append(exposed)
        chunks = lay.pipeline.chunks_of(r)
        tensors.append(parameter_tensors(per * len(chunks), first == r, last == r, last == r and first != r))
        if sharded:
            w = params[r] * weight_bytes
            gather_of.append(host.message(allgather_time(w, d, cl, False), (d - 1) * _engine_buckets(w), world))
    # The grad-norm all-reduce (model-parallel group) and the loss all-reduce (all ranks) wait for the last rank.
    sync = host.message(allreduce_time(elem, t * p, cl, False), 2 * (t * p - 1), world)
    sync += host.message(allreduce_time(8, world, cl, False), 2 * (world - 1), world)
    shard = d if sharded else 1
    opt = slow * (host.optimizer_seconds(max(tensors), max(params) // shard) + host.loop_us * 1e-6)
    gather = max(gather_of) if gather_of else 0.0
    last_rank = max(range(p), key=lambda r: ready[r])
    end = ready[last_rank] + sync + opt + gather
    f = [x.seconds(host, world) for x in fwd]
    b = [x.seconds(host, world) for x in bwd]
    messages = max(0.0, busy[last_rank] - compute[last_rank])
    costs.breakdown.update(rank_compute=compute[last_rank], rank_messages=messages, crowd=host.crowd(world))
    return Prediction(end, pipe, bubble, exposed_of[last_rank] + sync, opt, f, b, costs,
                      f"simulated, processes sharing {host.cores:g} cores", list(res.peak_in_flight), gather)
