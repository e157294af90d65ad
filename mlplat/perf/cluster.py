"""Cluster cost model: seconds per iteration of a PTD-P layout, by timing the real schedule.

The per-chunk forward/backward times and the stage-to-stage transfer times below are fed to
`mlplat.perf.simulator.simulate_nccl`, which executes the very instruction lists (as the engine posts them) of
`mlplat.parallel.layout.schedules.build_schedule` that the engine runs; the data-parallel all-reduce and
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
- GEMM shapes follow the architecture (`ModelDims`): the QKV output is (a + 2k)·d wide under grouped-query
  attention, SwiGLU's fc1 2f (gate and up in one GEMM), fc2 f, the output projection a·d → h; the attention core's
  FLOPs depend on the query heads only (a·d, h unless model.head_dim is set), so grouped-query attention does not
  change them.
- Element-wise work (LayerNorm, softmax, dropout, bias+GeLU, residual adds) is pure memory traffic, counted
  per layer forward in bytes of 2-byte tensors: 22·sbh + 20·sbh/t + 9·a·s²·b/t with the paper's fused
  kernels (scale+mask+softmax 4, dropout 5 bytes per score), +40% on the first two terms and 17 bytes per
  score unfused; flash attention has no s² traffic. Autocast (Lightning's bf16-mixed) adds fp32
  LayerNorm/residual traffic (+28·sbh) and casts the fp32 weights to bf16 in every forward (6 bytes/param)
  and accumulates fp32 weight gradients in every backward (10 bytes/param). Backward = 2x forward traffic.
  The Llama family (`split_elementwise_units`): SwiGLU's 6f/h in place of the GeLU's 4f/h, and the rotary
  embedding's passes over Q and K; RMSNorm is counted as a LayerNorm.
- FP8 (`kernels.fp8`, `fp8_gemm`, `fp8_casts`): the layers' four GEMMs (not the logits, not the attention core) at
  the device's FP8 peak on 1-byte operands (tensorwise, rowwise: `torch._scaled_mm`; blockwise too on sm90, through
  torch's block-scaled kernel, and the emulation's fp32 GEMMs at the fp32 peak elsewhere); the casts as memory
  traffic (each reads its operand twice, writes a byte per element: X forward, dY twice and X once backward, the
  weights once per step, 1/m per micro-batch) and the amax all-reduces as latency-bound collectives
  (`fp8_amax_reductions`).
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
- Pipeline sends: the residual stream, s·b·h elements in the GEMMs' dtype (the engine casts autocast's fp32 to it),
  over IB between nodes (η = 0.9, α = 8 µs) or NVLink inside one. With scatter/gather (t > 1) each of the
  t ranks sends 1/t of it and the receiver all-gathers over NVLink; the transfer time is their sum. With
  sequence parallelism each rank sends its sequence shard, 1/t of it, and nothing is gathered.
  Stage neighbours are t·c·d global ranks apart (the rank order's stage stride, `ParallelDims.stride("pp")`), so
  they share a node only when their global ranks fall in the same one.
- Data-parallel gradient all-reduce: ring over the d replicas (IB when the t·c·d ranks its groups span exceed
  a node, each GPU on its own HCA), of the rank's gradients (2 bytes each; 4 under autocast, whose gradients are
  fp32, and under bf16-megatron/16-megatron, which reduce the fp32 main gradients, unless
  optim.grad_reduce_dtype=bf16).
  Buckets (the engine's own size, `mlplat.optim.buckets.BUCKET_BYTES`) are all-reduced while the last
  micro-batch's backward runs, so only what does not fit under one micro-batch's backward on the rank, and at
  least the last bucket, is exposed. The tied embedding's
  gradient is all-reduced between the first and last stage (exposed); an untied output layer has no such
  all-reduce, its gradient is reduced over d with the last stage's others.
- Distributed optimizer (optim.distributed): the gradients are reduce-scattered instead ((d-1)/d of the
  bytes once, half an all-reduce), exposed by the same rule; after the optimizer the updated weights (the
  weights' bytes) are all-gathered, which the next step's forward waits for chunk by chunk: exposed is what
  does not fit under one micro-batch's forward of the rank's chunks, and at least one bucket.
- Sharded parameters (optim.sharding=params, `param_gather_costs`): per layer and micro-batch the weights'
  all-gather before the forward and again before the backward, and the gradients' reduce-scatter after it (not
  under a split backward: its gradients are reduced after the flush as the distributed optimizer's), over the shard
  group (parallel.dp_shard's under HSDP, NVLink while it fits in a node), each hidden under a neighbouring layer's
  compute and exposed where longer; no all-gather after the step. HSDP adds the shards' all-reduce over the
  replica groups once per step, after the flush.
- Optimizer step: memory bound, 32 bytes of traffic per parameter held (Adam: read weight, grad, m, v;
  write weight, m, v; plus the grad-norm read), at 0.8 of HBM bandwidth; 1/d of the parameters with the
  distributed optimizer. Muon (`optim.name=muon`, `muon_costs`, `mlplat.perf.muon`) adds the busiest rank's
  Newton–Schulz GEMMs on its whole hidden matrices (bf16, each through `gemm_time`) and the tp all-gathers of the split
  ones' updates; QK-clip (`optim.muon.qk_clip`) a q·kᵀ GEMM per layer forward for the heads' largest logits.
- Memory: a layout fits when the worst GPU of `mlplat.perf.memory` stays under `usable_fraction` (0.95) of
  the device memory; the PyTorch caching allocator's fragmentation takes the rest.
- Context parallelism (parallel.cp = c, ring attention; right outside tp in the rank order of
  `mlplat.parallel.layout.dims`): each rank holds s/c tokens, so every per-token term above (GEMMs, element-wise
  traffic, the tp all-reduces, the embedding, the head, the stage messages) is that of s/c tokens, and the
  attention core 1/c of the whole: the causal split (chunks i and 2c-1-i of 2c) gives every rank its diagonal
  block plus c-1 half-dense blocks of (s/c)² (`ring_times`). The ring sends K/V blocks, 2·b·(s/c)·(k/t)·d
  elements in the activation dtype, to the next cp rank over NVLink when the t·c ranks a ring spans fit in a
  node, else over InfiniBand (the slowest hop paces a ring).
  At c = 2 a hop's send and receive go to the same peer, on one communicator and so one stream: in series, twice the
  time of one direction. Assumed: each transfer overlaps one block's attention (the kernels are c equal blocks,
  compute and copy on separate streams, no slowdown of either); the forward's first block is the rank's own, so only
  (c-1)·max(0, x - one block's forward) is exposed; in the backward each of the c-1 steps moves the next K/V and the
  previous step's dK/dV (y: the dK/dV block travels in float32 under 16-bit activations, so y = 2x there; x + y on the
  link against one block's backward) and the final dK/dV's return to their owner (y) is exposed whole; a recomputed
  forward (full or selective) runs its ring again. Not modelled: the attention kernel's lower efficiency on the
  smaller blocks, the log-sum-exp merges (element-wise, small).
  The data-parallel reduction (and the distributed optimizer's shards) then spans the d·c ranks holding a copy.
- Mixtures of experts (`moe_layer_costs`): an MoE layer's forward and backward differ from a dense layer's by
  its router, its busiest rank's experts as one grouped GEMM, its shared experts and its permutation traffic in
  place of the dense MLP, and under expert parallelism by the dispatcher's collectives (all-to-all or all-gather
  and reduce-scatter over the ep group, NVLink while its etp·ep ranks fit in a node) and the host's wait for the
  split sizes, all exposed. The experts' gradients are reduced, and their optimizer state sharded, over edp.
Not modelled: data loading, logging, Python/launch overheads, straggler noise, NCCL kernels slowing
overlapped compute. The paper's figures include all of these, so expect predictions a little optimistic.

CPU processes (the `cluster.cpu_*` figures set, measured by `experiments/calibrate/calibrate.py`): every rank is a
process on shared cores and talks gloo; `mlplat.perf.cpu_model` replaces all of the above with the measured model
of `mlplat.perf.host`. Both models end the step with `mlplat.perf.step.after_flush`; the links' collective times
are `mlplat.perf.links`'.

Large m: the simulator is exact for any m, and runs at ~1 µs per instruction (p=64, m=512: under a
second). Above `max_compute_ops` F/B instructions we simulate m1 = 2p and m2 = 3p micro-batches and
extrapolate linearly: after the warm-up, every extra group of micro-batches adds the same time (the
bottleneck stage's steady-state period), so step time, per-rank finish and busy times are affine in m.
"""
from __future__ import annotations

import math
from functools import partial

from mlplat.optim.buckets import BUCKET_BYTES
from mlplat.perf.cpu_model import FIXED_POINT_ITERATIONS, PRESORT_ITERATIONS, host_costs, predict_processes
from mlplat.perf.devices import peak_flops
from mlplat.perf.flops import ModelDims, layer_parameters_of, routed_expert_parameters, stage_parameters
from mlplat.perf.links import Cluster, allgather_time, allreduce_time, alltoall_time, p2p_time
from mlplat.perf.memory import (
    Layout,
    dkv_block_bytes,
    expert_assignments,
    expert_split,
    kv_block_bytes,
    rank_layer_parameters,
    routed_tokens,
)
from mlplat.perf.muon import matrix_seconds, muon_step
from mlplat.perf.step import FlushCosts, LayerCosts, Prediction, after_flush, back_to_back, reduced_bytes
from mlplat.precision import fp8_amax_reductions, fp8_gemm_path, grouped_fp8_gemm_path, grouped_gemm_path, precision_of
from mlplat.specs import dispatchers
from mlplat.specs.dispatchers import Traffic

__all__ = ["Cluster", "LayerCosts", "Prediction", "allgather_time", "allreduce_time", "p2p_time", "predict",
           "layer_costs", "gemm_time", "resolve_attention"]

_TILES = ((256, 128, 1.0), (128, 128, 0.94), (128, 64, 0.85), (64, 64, 0.70))
FLASH_EFFICIENCY = (0.65, 0.50)  # fraction of peak, forward / backward, on executed FLOPs
OPTIMIZER_BYTES_PER_PARAM = 32


def resolve_attention(attention: str, cluster: Cluster, precision: str) -> str:
    """What the attention kernel will be: 'flash' (no s² memory) or 'unfused' (explicit scores)."""
    if attention in ("flash", "unfused"):
        return attention
    if attention in ("auto", "sdpa") and not cluster.device.nominal and precision_of(precision).half:
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



# ---------------------------------------------------------------------------------------------- the model

def split_elementwise_units(dims: ModelDims) -> float:
    """A layer forward's element-wise traffic on the tensors split over the t ranks, in bytes of 2-byte tensors per
    s·b·h: the paper's GPT 20 (bias+GeLU reads and writes f = 4h: 16; the heads' split and merge: 4). The MLP's
    activation moves its entry's `elementwise` elements per unit of f (SwiGLU reads 2f and writes f: 6f/h); rotary
    embeddings move Q and K about ten times (mlplat.model.rotary, not fused: rotate-half's negation and
    concatenation, two products and a sum, each a read and a write): 20·(a·d + k·d)/h. The heads
    are a·d wide (h unless model.head_dim is set)."""
    h, q = dims.hidden, dims.attention_width
    mlp = 2 * dims.mlp_entry.elementwise * dims.ffn / h
    rope = 20 * (q + dims.kv_width) / h if dims.position == "rope" else 0.0
    return 4 * q / h + mlp + rope


def layer_costs(dims: ModelDims, lay: Layout, cl: Cluster) -> LayerCosts:
    if cl.host is not None:
        return host_costs(dims, lay, cl)[0]
    s, b, h, a, t = dims.seq_len, lay.micro_batch_size, dims.hidden, dims.n_heads, lay.tp
    peak = peak_flops(cl.device, lay.precision)
    prec = precision_of(lay.precision)
    elem = prec.compute_bytes
    scale = prec.activation_bytes / 2  # element-wise traffic vs 2-byte tensors
    hbm = cl.device.hbm_gbytes_per_s * 1e9 * cl.hbm_efficiency
    autocast = prec.autocast
    attention = resolve_attention(lay.attention, cl, lay.precision)
    c = lay.cp
    s_loc = s // c if s % c == 0 else s / c  # this context-parallel rank's tokens
    M, sbh = b * s_loc, s_loc * b * h

    g = lambda m_, n_, k_, bt=1: gemm_time(cl, m_, n_, k_, bt, peak, elem)  # noqa: E731
    # The layers' four GEMMs: at the FP8 peak on 1-byte operands under kernels.fp8 (`fp8_gemm`).
    lg = g if lay.fp8 == "none" else fp8_gemm(cl, lay.fp8, lay.precision)
    # The attention's and the MLP's GEMMs, as their entries declare them (`ModelDims.gemm_shapes`): QKV ((a + 2k)·d =
    # 3h without grouped-query attention), out, fc1 (f, or 2f: SwiGLU's gate and up), fc2; a column GEMM's out split
    # over t, a row GEMM's in.
    # Backward of Y = XW: dX = dY·Wᵀ and dW = Xᵀ·dY, each the forward's size. (Added in order, one by one.)
    dense_f = dense_b = 0.0
    for o, i, col in dims.gemm_shapes():
        o, i = (o // t, i) if col else (o, i // t) if col is False else (o, i)  # None: whole on every rank
        dense_f += lg(M, o, i)
        dense_b += lg(M, i, o)
        dense_b += lg(o, i, M)
    heads = b * a // t
    # The attention core of this rank's s/c queries: 1/c of the whole (with c > 1 the ring's c blocks).
    # (its entry's FLOPs per token and key, 4·a·d for multi-head attention; QKᵀ over the q/k head size, scores·V
    # over the values': MLA's differ)
    if attention == "flash":
        core_f = 0.5 * b * s * s * dims.score_flops / t / c / (peak * FLASH_EFFICIENCY[0])
        core_b = 1.25 * b * s * s * dims.score_flops / t / c / (peak * FLASH_EFFICIENCY[1])
        score_bytes = 0.0
    else:
        d_qk, d_v = dims.attention_entry.head_dims(dims)
        core_f = g(s_loc, s, d_qk, heads) + g(s_loc, d_v, s, heads)
        core_b = 2 * core_f
        score_bytes = (9 if lay.fused else 17) * a * s_loc * s * b / t * scale
    ring_gemm = dims.attention_entry.ring_gemm
    if c > 1 and ring_gemm is not None:
        # The ring carries that GEMM's input (MLA's latents): it runs again on each of the c - 1 arriving blocks, and
        # backward runs it on all c blocks before their dX and dW (the layer's own forward and backward of it are
        # charged with the GEMMs above).
        rg = dims.attention_entry.gemm(ring_gemm)
        o, i = rg.out(h, dims.heads) // t, rg.inp(h, dims.heads)
        core_f += (c - 1) * lg(M, o, i)
        core_b += c * lg(M, o, i) + (c - 1) * (lg(M, i, o) + lg(o, i, M))
    sp = lay.sequence_parallel  # the planner and validation turn it on only at t > 1
    replicated = t if sp else 1  # the LayerNorm/dropout/residual work, split along the sequence or not
    other_bytes = (22 * sbh / replicated + split_elementwise_units(dims) * sbh / t) * scale * \
        (1.0 if lay.fused else 1.4)
    if autocast:
        other_bytes += 28 * sbh / replicated
    routed = routed_expert_parameters(dims)  # layer 0's routed experts: a rank holds E/ep of them, 1/etp of each
    p_layer = layer_parameters_of(dims, t) - routed // t + routed // (lay.expert_tp * lay.ep)
    cast_f = 6 * p_layer if autocast else 0
    cast_b = 10 * p_layer if autocast else 0
    elem_f = (other_bytes + score_bytes + cast_f) / hbm
    elem_b = (2 * (other_bytes + score_bytes) + cast_b) / hbm

    casts = fp8_casts(dims, lay, cl, M, elem) if lay.fp8 != "none" else {}
    # QK-clip (optim.muon.qk_clip): each head's largest logit is a q·kᵀ pass of its own, no kernel returning it
    # (mlplat.parallel.logit_max): 2·b·a·(s/c)·s·d FLOPs per layer forward, its score block written and read.
    qk_f = g(s_loc, s, dims.attention_entry.head_dims(dims)[0], heads) if lay.qk_clip else 0.0
    fwd = dense_f + core_f + qk_f + elem_f + casts.get("cast_forward", 0.0)
    bwd = dense_b + core_b + elem_b + casts.get("cast_backward", 0.0)
    if lay.recompute == "full":
        bwd += fwd
    elif lay.recompute == "selective":
        bwd += core_f + score_bytes / hbm

    tp_inter = lay.span("tp") > cl.gpus_per_node
    ar = allreduce_time(sbh * 2, t, cl, tp_inter)  # the row-parallel outputs are bf16 under autocast too
    n_bwd = 2 + (2 if lay.recompute == "full" else 0)

    # Embedding: lookup + position add + dropout (~10 bytes per element), one all-reduce over tp (sequence
    # parallel: a reduce-scatter forward, an all-gather backward, half an all-reduce each).
    emb_f = 10 * sbh * scale / hbm + (ar / 2 if sp else ar)
    emb_b = 2 * 10 * sbh * scale / hbm + (ar / 2 if sp else 0.0)
    vocab = dims.padded_vocab(t)
    logits_f = g(M, vocab // t, h)
    logits_b = g(M, h, vocab // t) + g(vocab // t, h, M)
    ce_bytes = 16 * s_loc * b * vocab / t  # fp32 upcast, max, exp, sum, gradient of the cross-entropy
    head_f = logits_f + (ce_bytes + 8 * sbh) / hbm + (ar / 2 if sp else 0.0)  # sequence parallel: all-gather
    # The input-gradient all-reduce of the logits (sequence parallel: a reduce-scatter).
    head_b = logits_b + (ce_bytes + 16 * sbh) / hbm + (ar / 2 if sp else ar)

    msg = sbh * prec.compute_bytes  # stage messages travel in the GEMMs' dtype
    if sp:  # the stage's sequence shard, 1/t of the activation, different on each rank: nothing to gather
        x_inter, x_intra = p2p_time(msg / t, cl, True), p2p_time(msg / t, cl, False)
    elif lay.scatter_gather and t > 1:
        x_inter = p2p_time(msg / t, cl, True) + allgather_time(msg, t, cl)
        x_intra = p2p_time(msg / t, cl, False) + allgather_time(msg, t, cl)
    else:
        x_inter, x_intra = p2p_time(msg, cl, True), p2p_time(msg, cl, False)
    ring = ring_times(dims, lay, cl, core_f, core_b)
    amax_f, amax_b = casts.get("amax_forward", 0.0), casts.get("amax_backward", 0.0)
    if lay.recompute == "full":
        amax_b += amax_f
    moe = moe_layer_costs(dims, lay, cl, ar) if dims.moe_layers else {}
    gathers = param_gather_costs(dims, lay, cl, fwd + 2 * ar, bwd + n_bwd * ar)
    return LayerCosts(fwd, bwd, 2 * ar + amax_f, n_bwd * ar + amax_b, emb_f, emb_b, head_f, head_b, x_inter, x_intra,
                      breakdown={"dense_gemm_forward": dense_f, "attention_core_forward": core_f,
                                 **({"qk_clip_logits_forward": qk_f} if qk_f else {}),
                                 "elementwise_forward": elem_f, "tp_allreduce": ar,
                                 "attention": attention, **ring, **casts, **moe, **gathers},
                      cp_forward=ring.get("cp_exposed_forward", 0.0), cp_backward=ring.get("cp_exposed_backward", 0.0),
                      moe_forward=moe.get("moe_extra_forward", 0.0), moe_backward=moe.get("moe_extra_backward", 0.0),
                      gather_forward=gathers.get("gather_exposed_forward", 0.0),
                      gather_backward=gathers.get("gather_exposed_backward", 0.0))


def shard_group_inter_node(lay: Layout, cl: Cluster) -> bool:
    """Whether a shard group (parallel.dp_shard of the d·c replicas, all of them without HSDP) spans nodes."""
    return lay.span("dp") * lay.shard_size / lay.replicas > cl.gpus_per_node


def param_gather_costs(dims: ModelDims, lay: Layout, cl: Cluster, forward: float, backward: float) -> dict[str, float]:
    """Sharded parameters (optim.sharding=params), per layer and micro-batch: the all-gather of its weights over the
    shard group before its forward and again before its backward, and (unless the schedule splits its backward,
    which keeps the gradients whole through the pass) the reduce-scatter of its gradients after it; each hidden
    under the neighbouring layer's compute (the next layer's gather is posted as a layer starts), exposed where
    longer. The mean layer of the model (its experts E/ep of them)."""
    n = lay.shard_size
    if not (lay.param_sharding and lay.distributed_optimizer and n > 1):
        return {}
    grad_bytes, weight_bytes = reduced_bytes(lay)
    layers = rank_layer_parameters(dims, lay, 0) or [0]
    w = sum(layers) / len(layers)
    inter = shard_group_inter_node(lay, cl)
    gather = allgather_time(w * weight_bytes, n, cl, inter)
    scatter = 0.0 if lay.pipeline.spec.split_backward else allgather_time(w * grad_bytes, n, cl, inter)
    return {"gather_per_layer": gather, "reduce_scatter_per_layer": scatter,
            "gather_exposed_forward": max(0.0, gather - forward),
            "gather_exposed_backward": max(0.0, gather + scatter - backward)}


# The host waits for a layer's split sizes (a stream sync, docs/gpu-nccl.md) and then launches the expert kernels: the
# device idles for the copy back, the wait and the launches' latency, about this long per MoE layer forward.
SPLIT_SYNC_S = 30e-6


# The per-expert loop's host time per GEMM (the slices, the matmul's launch), which the device waits through: the
# loop starts after the host has read the counts, so nothing is queued ahead of it.
LOOP_GEMM_LAUNCH_S = 10e-6


def experts_gemm_path(precision: str, cl: Cluster, fp8: str = "none") -> str:
    """How the experts' grouped GEMM runs on the cluster's devices (`mlplat.precision.grouped_gemm_path`): its
    operands in the weights' dtype (autocast leaves `_grouped_mm` alone), the precision's compute dtype; under
    kernels.fp8 the emulation's dequantised fp32 operands (`mlplat.precision.grouped_fp8_gemm_path`)."""
    prec = precision_of(precision)
    device = "cpu" if cl.device.name == "cpu" else "cuda"
    if fp8 != "none":
        return grouped_fp8_gemm_path(device)
    return grouped_gemm_path(device, prec.weight_dtype, prec.compute_dtype)


def experts_fp8_forward(precision: str, cl: Cluster, fp8: str) -> str:
    """How the experts' forward product runs under kernels.fp8=`fp8` on the cluster's devices
    (`mlplat.precision.grouped_fp8_gemm_path`, at their compute capability): its output the experts' activations'
    dtype, the weights' (autocast leaves the experts' products alone)."""
    device = "cpu" if cl.device.name == "cpu" else "cuda"
    return grouped_fp8_gemm_path(device, fp8, "forward", precision_of(precision).weight_dtype, cl.device.sm)


def expert_links(lay: Layout, cl: Cluster) -> int:
    """The ranks of an ep group in one node: all ep when the etp·ep consecutive ranks it spans fit in a node (the
    experts' layout folds a stage's ranks innermost first, `ParallelDims.expert_group`), else a node's share."""
    return lay.ep if lay.expert_tp * lay.ep <= cl.gpus_per_node else max(1, cl.gpus_per_node // lay.expert_tp)


def moe_layer_costs(dims: ModelDims, lay: Layout, cl: Cluster, ar: float) -> dict[str, float]:
    """What an MoE layer changes against a dense layer, per micro-batch on one rank (the busiest expert rank:
    `expert_assignments` counts model.moe.plan_imbalance in), in seconds:
    - out: the dense MLP's GEMMs and element-wise traffic; with the experts whole (etp = 1) and t > 1, the MLP's
      tensor-parallel communication (sequence parallel: its all-gather and reduce-scatter, one all-reduce's worth;
      otherwise the tokens are gathered back over t after the combine, half of it);
    - in: the router's GEMM on the routed tokens (and its softmax/top-k traffic, 16·E bytes a token), the E/ep
      local experts' GEMMs on X/(E/ep) tokens each (X = `expert_assignments`, width f_e/etp) by their path
      (`experts_gemm_path`): one grouped GEMM in the compute dtype ("grouped"), in bf16 at its peak plus the casts'
      traffic (each operand, weight and output read in its dtype and written in the other, backward twice:
      "grouped-bf16"), or one GEMM per local expert at the peak of the operands' dtype, each LOOP_GEMM_LAUNCH_S of
      host time, and the counts' host read per forward GEMM (2 SPLIT_SYNC_S, "loop"); the shared experts as a dense
      MLP split over t, and the permutation's traffic (4 passes over X·h); under kernels.fp8 the dense MLP and the
      shared experts at `fp8_gemm`'s, the experts by the emulation's path (fp32 operands at the fp32 peak) plus its
      casts' traffic (each operand read, a byte written, read again and 4 bytes written), except their forward
      where torch's grouped FP8 kernel takes it (`experts_fp8_forward`): one grouped GEMM on 1-byte operands at the
      FP8 peak, no host read of the counts (the casts' traffic stays the emulation's, an upper bound);
    - the dispatcher's collectives (ep > 1), exposed (a pair of 1f1b_overlap hides some: `paired_hidden`), as its
      entry declares them
      (`dispatch_parts`): e.g. alltoall's two all-to-alls of routed·k·h per pass, their busiest receiver
      `plan_imbalance` times the mean, one of the routed·k gates (the router's dtype, 4 bytes or wider) and, per
      forward, the split sizes' exchange and the host's wait for them (SPLIT_SYNC_S).
    `moe_dispatch` reports the mean of the tokens' collectives of a forward (`token_collectives`), `moe_gates` the
    routing's,
    `moe_split_sync` the sizes' with the host's wait.
    Backward: twice the GEMMs and traffic, the dispatcher's backward collectives (the gates' gradient returns the
    way the gates came; no sync: the sizes are known); full recomputation re-runs the forward, collectives and sync
    included."""
    moe, h, t = dims.moe, dims.hidden, lay.tp
    prec = precision_of(lay.precision)
    elem, peak = prec.compute_bytes, peak_flops(cl.device, lay.precision)
    hbm = cl.device.hbm_gbytes_per_s * 1e9 * cl.hbm_efficiency
    g = lambda m_, n_, k_, bt=1: gemm_time(cl, m_, n_, k_, bt, peak, elem)  # noqa: E731
    M = lay.micro_batch_size * dims.seq_len / lay.cp
    mult = 1.0 if lay.fused else 1.4

    def mlp(tokens: float, width: float, batch: int = 1, g=g) -> tuple[float, float, float]:
        """(forward GEMMs, backward GEMMs, forward element-wise bytes) of `batch` MLPs of `width` on `tokens` each."""
        spec = dims.mlp_entry
        fc1 = spec.fc1_width(h, width)
        f = g(tokens, fc1, h, batch) + g(tokens, h, width, batch)
        b = g(tokens, h, fc1, batch) + g(fc1, h, tokens, batch) + g(tokens, width, h, batch) + \
            g(h, width, tokens, batch)
        return f, b, 2 * spec.elementwise * width * tokens * prec.activation_bytes * mult

    # the dense MLP and the shared experts: the layers' GEMMs, in FP8 under kernels.fp8 (`fp8_gemm`)
    fp8_g = None if lay.fp8 == "none" else fp8_gemm(cl, lay.fp8, lay.precision)

    def dense_g(m_: float, n_: float, k_: float, bt: int = 1) -> float:
        return g(m_, n_, k_, bt) if fp8_g is None else bt * fp8_g(m_, n_, k_)

    dense_f, dense_b, dense_e = mlp(M, dims.ffn / t, g=dense_g)
    local = moe.num_experts // lay.ep
    x = expert_assignments(dims, lay)
    width = dims.expert_ffn / lay.expert_tp
    path = experts_gemm_path(lay.precision, cl, lay.fp8)
    loop_f = loop_b = casts = 0.0
    expert_g, expert_peak, operand = g, peak, prec.weight_bytes
    if lay.fp8 != "none":  # the emulation (mlplat.parallel.fp8_experts): fp32 GEMMs, each operand cast to 1 byte
        expert_peak, operand = peak_flops(cl.device, "fp32"), 4  # and dequantised to 4
        expert_g = partial(gemm_time, cl, peak=expert_peak, elem_bytes=operand)
        fc1 = dims.mlp_entry.fc1_width(h, width)
        casts = (elem + 6) * (x * (2 * h + fc1 + width) + local * (fc1 + width) * h)
    if path == "grouped":
        exp_f, exp_b, exp_e = mlp(x / local, width, local, expert_g)
    elif path == "grouped-bf16":
        bf16 = partial(gemm_time, cl, peak=peak_flops(cl.device, "bf16"), elem_bytes=2)
        exp_f, exp_b, exp_e = mlp(x / local, width, local, bf16)
        fc1 = dims.mlp_entry.fc1_width(h, width)
        casts = (prec.weight_bytes + 2) * (x * (2 * h + fc1 + width) + local * (fc1 + width) * h)
    else:  # one GEMM after another, each expert's
        exp_f, exp_b, exp_e = mlp(x / local, width, 1, partial(gemm_time, cl, peak=expert_peak, elem_bytes=operand))
        exp_f, exp_b = local * exp_f, local * exp_b
        loop_f, loop_b = 2 * local * LOOP_GEMM_LAUNCH_S + 2 * SPLIT_SYNC_S, 4 * local * LOOP_GEMM_LAUNCH_S
    exp_e *= local
    if lay.fp8 != "none" and experts_fp8_forward(lay.precision, cl, lay.fp8) == "torch._scaled_grouped_mm":
        exp_f = mlp(x / local, width, local, partial(gemm_time, cl, peak=peak_flops(cl.device, "fp8"), elem_bytes=1))[0]
        loop_f = 0.0
    shared_f = shared_b = shared_e = 0.0
    if moe.shared_experts:
        shared_f, shared_b, shared_e = mlp(M, moe.shared_experts * dims.expert_ffn / t, g=dense_g)
    r = routed_tokens(dims, lay)
    router_f = g(r, moe.num_experts, h)
    router_b = g(r, h, moe.num_experts) + g(moe.num_experts, h, r)
    traffic = exp_e + shared_e - dense_e + 16 * moe.num_experts * r + 4 * x * h * elem + casts
    fwd = exp_f + shared_f + router_f - dense_f + traffic / hbm + loop_f
    bwd = exp_b + shared_b + router_b - dense_b + 2 * traffic / hbm + loop_b
    # the MLP's tensor-parallel communication, gone with whole experts
    tp_saved = (ar if lay.sequence_parallel else ar / 2) if lay.expert_tp == 1 and t > 1 else 0.0
    parts = {"forward": {}, "backward": {}}  # part of the communication -> seconds, per pass
    if lay.ep > 1:
        parts = dispatch_parts(dims, lay, cl, r, elem)
    dispatch, gates, sync = (parts["forward"].get(part, 0.0) for part in ("tokens", "routing", "sizes"))
    comm_f = sum(parts["forward"].values()) - tp_saved
    comm_b = sum(parts["backward"].values()) - tp_saved
    # what a pair of the overlapped schedule can hide: the all-to-alls, not the host's wait for the split sizes
    paired_f, paired_b = dispatch + gates, sum(parts["backward"].values())
    if lay.recompute == "full":
        bwd += fwd
        comm_b += comm_f
        paired_b += paired_f
    return {"moe_expert_gemm_forward": exp_f, "moe_expert_loop_forward": loop_f, "moe_expert_loop_backward": loop_b,
            "moe_router_forward": router_f, "moe_dispatch": dispatch / token_collectives(dims.moe.dispatcher)[0],
            "moe_gates": gates, "moe_split_sync": sync, "moe_tokens_busiest_rank": x,
            "moe_extra_forward": fwd + comm_f, "moe_extra_backward": bwd + comm_b,
            "moe_a2a_forward": paired_f, "moe_a2a_backward": paired_b}


def token_collectives(dispatcher: str) -> tuple[int, int]:
    """How many of a dispatcher's collectives carry token rows (part "tokens"), forward and backward: alltoall's 2
    and 2, the node dispatcher's 4 and 4 (each hop, there and back)."""
    entry = dispatchers.get(dispatcher)
    return tuple(sum(c.part == "tokens" for c in getattr(entry, phase)) for phase in ("forward", "backward"))


def dispatch_traffic(dims: ModelDims, lay: Layout, cl: Cluster, routed: float, elem: int) -> Traffic:
    """What one rank's MoE layer dispatches per micro-batch (`mlplat.specs.dispatchers.Traffic`): the gates in the
    router's dtype (4 bytes or wider), the ep group's nodes the cluster's (`expert_links`)."""
    moe = dims.moe
    return Traffic(routed, moe.top_k, dims.hidden, elem, max(4, elem), lay.ep, moe.fp8_dispatch, moe.num_experts,
                   moe.n_groups, moe.topk_groups, expert_links(lay, cl))


def dispatch_parts(dims: ModelDims, lay: Layout, cl: Cluster, routed: float, elem: int) -> dict[str, dict]:
    """Seconds of the registered dispatcher's collectives (`mlplat.specs.dispatchers`) per MoE layer and
    micro-batch on one rank, summed by part ("tokens", "routing", "sizes") for each pass: an all-to-all by
    `links.alltoall_time` over the ep group's links in and across nodes (the node dispatcher's sub-groups: across the
    nodes all over InfiniBand, within a node over NVLink), its busiest receiver `plan_imbalance` times
    the mean where the bytes follow the routing; an all-gather or reduce-scatter by `links.allgather_time`, across
    nodes once the etp·ep ranks leave one; the host's one read per forward (the entry's `host_read`) SPLIT_SYNC_S,
    in part "sizes"."""
    moe = dims.moe
    entry = dispatchers.get(moe.dispatcher)
    traffic = dispatch_traffic(dims, lay, cl, routed, elem)
    links, inter = expert_links(lay, cl), lay.expert_tp * lay.ep > cl.gpus_per_node
    # the ranks of each group a collective runs over (`Collective.over`) and how many of them share a node
    over = {"ep": (lay.ep, links), "across": (traffic.nodes, 1), "within": (links, links)}
    parts = {}
    for phase in ("forward", "backward"):
        parts[phase] = {}
        for c in getattr(entry, phase):
            payload = c.payload(traffic)
            if c.kind == "all_to_all":
                ranks, local = over[c.over]
                seconds = alltoall_time(payload, ranks, cl, local, moe.plan_imbalance if c.skewed else 1.0)
            else:
                seconds = allgather_time(payload, lay.ep, cl, inter)
            parts[phase][c.part] = parts[phase].get(c.part, 0.0) + seconds
    if entry.host_read:  # the layer's one host read per forward, counted with the sizes it reads
        parts["forward"]["sizes"] = parts["forward"].get("sizes", 0.0) + SPLIT_SYNC_S
    return parts


def fp8_gemm(cl: Cluster, recipe: str, precision: str | None = None):
    """The time of one of the layers' GEMMs [M,K]x[K,N] under `kernels.fp8`, by the path its product takes
    (`mlplat.precision.fp8_gemm_path`, its output in `precision`'s compute dtype): `torch._scaled_mm` on 1-byte
    operands at the device's FP8 peak (tensorwise; rowwise into bf16; blockwise on sm90, where torch's block-scaled
    kernel runs), else the emulation (dequantise, then multiply in fp32: blockwise elsewhere, rowwise into fp16),
    4-byte operands at the fp32 peak."""
    out = precision_of(precision).compute_dtype if precision is not None else None
    emulated = fp8_gemm_path(recipe, "cuda", out, cl.device.sm) == "emulated"
    peak, size = (peak_flops(cl.device, "fp32"), 4) if emulated else (peak_flops(cl.device, "fp8"), 1)
    return lambda m_, n_, k_: gemm_time(cl, m_, n_, k_, 1, peak, size)


def fp8_casts(dims: ModelDims, lay: Layout, cl: Cluster, tokens: float, elem: int) -> dict[str, float]:
    """Seconds per layer and micro-batch of FP8's casts and amax all-reduces (`mlplat.parallel.fp8`). A cast reads
    its operand twice (the amax, then the scaling) in the run's dtype and writes one byte per element: the forward
    casts each GEMM's X, the backward dY twice (dX's and dW's products) and X once (dW's). The weights are cast once
    per optimizer step (W, and Wᵀ: a cast of its own under rowwise, else W's cast transposed), charged here as 1/m
    of it per micro-batch. The amax all-reduces are latency-bound collectives the GEMMs wait for
    (`fp8_amax_reductions`: per phase and group; one fp32 per operand, one per row under rowwise). Key/value heads
    replicated over tp ranks add the sum of their dY columns over the replicas before the QKV GEMM's backward
    quantises them (tokens × 2·head size in the run's dtype)."""
    t, m = lay.tp, lay.num_micro_batches
    hbm = cl.device.hbm_gbytes_per_s * 1e9 * cl.hbm_efficiency
    x = dims.hidden + dims.hidden / t + dims.hidden + dims.ffn / t  # the inputs of QKV, out, fc1, fc2 per token
    dy = (dims.qkv_width + dims.fc1_width) / t + 2 * dims.hidden  # their output gradients
    per = 2 * elem + 1
    weights = dims.layer_gemm_weights / t
    w_bytes = weights * (per + (per if lay.fp8 == "rowwise" else 2))  # W's cast, and Wᵀ's (or W's transposed)
    reductions = fp8_amax_reductions(lay.fp8, t, lay.cp)
    amax_bytes = 4 * (tokens if lay.fp8 == "rowwise" else 1)

    def amax(phase: str) -> float:
        counts = reductions[phase]
        return (counts["tp"] * allreduce_time(amax_bytes, t, cl, lay.span("tp") > cl.gpus_per_node)
                + counts["cp"] * allreduce_time(amax_bytes, lay.cp, cl, cp_inter_node(lay, cl)))

    kv_sum = allreduce_time(tokens * 2 * dims.head_size * elem, dims.kv_replicas(t), cl,
                            lay.span("tp") > cl.gpus_per_node)
    return {"cast_forward": (tokens * x * per + w_bytes / m) / hbm, "cast_backward": tokens * (2 * dy + x) * per / hbm,
            "amax_forward": amax("forward") + amax("step") / m, "amax_backward": amax("backward") + kv_sum}


def cp_inter_node(lay: Layout, cl: Cluster) -> bool:
    """The cp ring leaves the node when the t·c ranks of a ring's tensor-parallel groups do not fit in one."""
    return lay.span("cp") > cl.gpus_per_node


def ring_times(dims: ModelDims, lay: Layout, cl: Cluster, core_f: float, core_b: float) -> dict[str, float]:
    """One layer's ring (c > 1), per micro-batch: the K/V block transfer x, one block's attention forward and
    backward (core / c: the load-balanced blocks are equal), and what of the ring is exposed (see the module doc):
      forward   (c-1)·max(0, x - block_f)
      backward  (c-1)·max(0, x+y - block_b) + y   (+ the forward's again under full or selective recomputation)
    with y the dK/dV block's transfer; {} without context parallelism."""
    c = lay.cp
    if c < 2:
        return {}
    inter = cp_inter_node(lay, cl)
    kv, dkv = kv_block_bytes(dims, lay), dkv_block_bytes(dims, lay)
    # At c = 2 the next and the previous rank are one peer: a hop's send and receive share the pair's communicator,
    # whose one stream runs them one after the other (half duplex), so each hop moves twice the bytes in series.
    duplex = 2 if c == 2 else 1
    kv, dkv = duplex * kv, duplex * dkv
    x, y, xy = p2p_time(kv, cl, inter), p2p_time(dkv, cl, inter), p2p_time(kv + dkv, cl, inter)
    block_f, block_b = core_f / c, core_b / c
    fwd = (c - 1) * max(0.0, x - block_f)
    bwd = (c - 1) * max(0.0, xy - block_b) + y
    if lay.recompute in ("full", "selective"):
        bwd += fwd
    return {"cp_transfer": x, "cp_transfer_dkv": y, "cp_block_forward": block_f, "cp_block_backward": block_b,
            "cp_exposed_forward": fwd, "cp_exposed_backward": bwd}


def chunk_times(dims: ModelDims, lay: Layout, c: LayerCosts) -> tuple[list[float], list[float]]:
    counts = lay.pipeline.chunk_layers(dims.n_layers)  # each chunk's layers (even, or the uneven split)
    # each chunk's MoE layers, which cost `moe_forward`/`moe_backward` more than a dense one
    moe = [sum(dims.is_moe_layer(i) for i in lay.pipeline.layers_of(ch, dims.n_layers)) for ch in range(len(counts))]
    f = [k * (c.layer_forward + c.tp_forward + c.cp_forward + c.gather_forward) + e * c.moe_forward
         for k, e in zip(counts, moe)]
    b = [k * (c.layer_backward + c.tp_backward + c.cp_backward + c.gather_backward) + e * c.moe_backward
         for k, e in zip(counts, moe)]
    f[0] += c.embedding_forward
    b[0] += c.embedding_backward
    f[-1] += c.head_forward
    b[-1] += c.head_backward
    # The last chunk's multi-token prediction modules: per module a layer (l + k - 1's kind), its projection (2h²
    # weights, at the layer's GEMM rate) and the head once more.
    depth = dims.mtp.depth
    if depth:
        moe_layer = dims.is_moe_layer(dims.n_layers)
        proj = 2 * dims.hidden * dims.hidden / dims.layer_gemm_weights
        f[-1] += depth * ((1 + proj) * c.layer_forward + c.tp_forward + moe_layer * c.moe_forward + c.head_forward)
        b[-1] += depth * ((1 + proj) * c.layer_backward + c.tp_backward + moe_layer * c.moe_backward
                          + c.head_backward)
    return f, b


def paired_hidden(dims: ModelDims, lay: Layout, c: LayerCosts, f: list[float], b: list[float]) -> list[float]:
    """Per chunk, what a pair of a schedule that pairs passes (1f1b_overlap) hides: the forward's expert all-to-alls
    behind the backward's compute and the backward's behind the forward's, each at most the other's compute
    (DeepSeek-V3's DualPipe; Megatron-Core's combined 1F1B). The simulator takes it off the paired B."""
    a2a_f, a2a_b = c.breakdown.get("moe_a2a_forward", 0.0), c.breakdown.get("moe_a2a_backward", 0.0)
    out = []
    for ch in range(len(f)):
        e = sum(dims.is_moe_layer(i) for i in lay.pipeline.layers_of(ch, dims.n_layers))
        out.append(min(e * a2a_f, b[ch] - e * a2a_b) + min(e * a2a_b, f[ch] - e * a2a_f))
    return out


def _stage_inter_node(lay: Layout, cl: Cluster, src: int, dst: int) -> bool:
    """Whether pipeline stages src and dst sit on different nodes: in the rank order stage r of global rank 0's
    pipeline is rank r·stride (stride = t·c·d), every other pipeline's r·stride plus the same offset."""
    stride, n = lay.stride("pp"), cl.gpus_per_node
    return (stride * src) // n != (stride * dst) // n or stride >= n


def _simulate(lay: Layout, m: int, f: list[float], b: list[float], xfer, back_to_back: bool = False,
              hidden: list[float] | None = None) -> tuple[float, list[float], list[float], list[int]]:
    from mlplat.parallel.layout.schedules import build_schedule
    from mlplat.perf.simulator import CostModel, simulate_nccl, steady_state_step

    sched = build_schedule(lay.schedule, lay.pp, lay.vpp, m)
    if lay.pipeline.spec.split_backward:  # W: the weight-gradient GEMMs, about a forward; B: the rest of b
        cost = CostModel(forward=lambda r, c, mb: f[c], backward=lambda r, c, mb: b[c] - f[c],
                         weight=lambda r, c, mb: f[c], transfer=lambda src, dst, kind: xfer[src][dst])
    else:
        cost = CostModel(forward=lambda r, c, mb: f[c], backward=lambda r, c, mb: b[c],
                         transfer=lambda src, dst, kind: xfer[src][dst],
                         hidden=(lambda r, c, mb: hidden[c]) if hidden else 0.0)
    res = simulate_nccl(sched, cost, lay.vpp)
    if res.deadlock:
        raise RuntimeError(f"schedule {lay.schedule} p={lay.pp} v={lay.vpp} m={m} deadlocks in the simulator")
    busy = [0.0] * lay.pp
    for e in res.compute_events():
        busy[e.rank] += e.end - e.start
    # Steps back to back (post-validation): the next step's head fills this one's tail (ZB-V, ZB-H2).
    step = steady_state_step(sched, cost, lay.vpp, simulate_nccl) if back_to_back else res.step_time
    return step, list(res.finish), busy, list(res.peak_in_flight)


def pipeline_time(lay: Layout, f: list[float], b: list[float], xfer, max_compute_ops: int = 400_000,
                  back_to_back: bool = False, hidden: list[float] | None = None):
    """(step time, per-rank finish, per-rank busy, peak in flight, method) of the pipeline part; back_to_back: the
    step time is the steady-state period of steps run one after the other; `hidden`: `paired_hidden`."""
    p, v, m = lay.pp, lay.vpp, lay.num_micro_batches
    if 2 * p * v * m <= max_compute_ops or m <= 3 * p:
        step, finish, busy, peak = _simulate(lay, m, f, b, xfer, back_to_back, hidden)
        return step, finish, busy, peak, "simulated"
    m1, m2 = 2 * p, 3 * p
    s1, f1, b1, peak = _simulate(lay, m1, f, b, xfer, back_to_back, hidden)
    s2, f2, b2, _ = _simulate(lay, m2, f, b, xfer, back_to_back, hidden)
    k = (m - m1) / (m2 - m1)
    lin = lambda x1, x2: x1 + (x2 - x1) * k  # noqa: E731
    return (lin(s1, s2), [lin(x, y) for x, y in zip(f1, f2)], [lin(x, y) for x, y in zip(b1, b2)], peak,
            f"extrapolated from m={m1},{m2}")


def predict(dims: ModelDims, lay: Layout, cl: Cluster, *, parameters: list[int] | None = None,
            method: str = "simulate", max_compute_ops: int = 400_000) -> Prediction:
    """Seconds per iteration of `lay` on `cl`. method: 'simulate' (the real schedule) or 'analytic'."""
    if cl.host is not None:  # the pre-sort ("analytic") stops short of the fixed point
        iterations = PRESORT_ITERATIONS if method == "analytic" else FIXED_POINT_ITERATIONS
        return predict_processes(dims, lay, cl, parameters, iterations=iterations)
    p, v, t, m = lay.pp, lay.vpp, lay.tp, lay.num_micro_batches
    costs = layer_costs(dims, lay, cl)
    f, b = chunk_times(dims, lay, costs)
    xfer = [[(costs.transfer if _stage_inter_node(lay, cl, i, j) else costs.transfer_intra) for j in range(p)]
            for i in range(p)]
    params = parameters or stage_parameters(dims, t, lay.pipeline)
    # (the rest, the routed experts) per rank under the experts' layout: reduced over d·c and over edp
    split = expert_split(dims, lay, params) if dims.moe_layers else [(n, 0) for n in params]
    params = [a + e for a, e in split]
    b2b = back_to_back(dims, lay)
    spec = lay.pipeline.spec
    hidden = paired_hidden(dims, lay, costs, f, b) if spec.pairs else None

    if method == "analytic" or p == 1:
        # Uniform-stage 1F1B/interleaved: (m·v + p - 1) chunk slots of the slowest rank, each paying a
        # message round trip once p > 1 (the simulator confirms this within a few % for large m).
        per_rank = [sum(f[c] + b[c] for c in lay.pipeline.chunks_of(r)) / v for r in range(p)]
        slot = max(per_rank)
        x = max(max(row) for row in xfer) if p > 1 else 0.0
        # The schedule's fill (its registry entry): 1F1B's p - 1 warm-up slots, about a third of them under zero
        # bubble (W fills the rest), none back to back (post-validation) for ZB-V and ZB-H2.
        pipe = (m * v + spec.fill(p, b2b)) * (slot + 2 * x)
        busy = [m * v * c for c in per_rank]
        if hidden:  # rank r pairs all but its 2(p - r - 1) + 1 warm-up forwards; rank 0's the fewest
            pairs = [max(0, m - 2 * (p - r - 1) - 1) for r in range(p)]
            saved = [pairs[r] * min(hidden[c] for c in lay.pipeline.chunks_of(r)) for r in range(p)]
            pipe -= min(saved)
            busy = [x_ - s_ for x_, s_ in zip(busy, saved)]
        finish = [pipe - (r * (slot + x) if spec.staggered else 0.0) for r in range(p)]
        peak, how = None, "analytic" if p > 1 else "exact (p = 1)"
    else:
        pipe, finish, busy, peak, how = pipeline_time(lay, f, b, xfer, max_compute_ops, b2b, hidden)
    bubble = (pipe - max(busy)) / max(busy) if max(busy) > 0 else 0.0

    n = lay.replicas  # d·c: the context-parallel ranks hold the same weights, their gradients summed too
    sharded = lay.distributed_optimizer and n > 1
    group = lay.shard_size if sharded else n  # HSDP: reduce-scattered within groups of parallel.dp_shard
    shard_inter = shard_group_inter_node(lay, cl)
    per_layer = costs.breakdown.get("reduce_scatter_per_layer", 0.0)
    # Reduce-scatter and all-gather each move (n-1)/n of the bytes once: the ring's two halves of an all-reduce.
    reduce = allgather_time if sharded else allreduce_time
    dp_inter = lay.span("dp") > cl.gpus_per_node  # the t·c·d ranks of a replica group's tensor-parallel groups
    hbm = cl.device.hbm_gbytes_per_s * 1e9 * cl.hbm_efficiency

    edp = lay.edp  # the ranks holding the same experts: their gradients reduced, their optimizer sharded, over it

    def over_groups(op, r: int, nbytes: float) -> float:
        """`op` of rank r's bytes, the experts' share over the edp ranks and the rest over the d·c replicas (over
        the shard groups under HSDP)."""
        share = split[r][1] / params[r] if params[r] else 0.0
        return op(nbytes * (1 - share), group, cl, shard_inter if group < n else dp_inter) + (
            op(nbytes * share, edp, cl, dp_inter) if share else 0.0)

    def reduction(r: int, g: float) -> float:
        # HSDP: the dense shards summed over the replica groups once per step, after the pass (not overlapped)
        dense = 1 - (split[r][1] / params[r] if params[r] else 0.0)
        replicas = allreduce_time(g * dense / group, n // group, cl, dp_inter) if group < n else 0.0
        if per_layer:  # sharded parameters: reduce-scattered layer by layer in backward; the last one's is left
            return per_layer + replicas
        window = sum(b[c] for c in lay.pipeline.chunks_of(r))  # the rank's last micro-batch backward
        return max(over_groups(reduce, r, g) - window, reduce(min(g, BUCKET_BYTES), group, cl, dp_inter)) + replicas

    def gather(r: int, w: float) -> float:  # the updated weights, waited for by the next forward of each chunk
        forward = sum(f[c] for c in lay.pipeline.chunks_of(r))
        return max(over_groups(allgather_time, r, w) - forward,
                   allgather_time(min(w, BUCKET_BYTES), n, cl, dp_inter))

    muon = {"newton_schulz": 0.0, "gather": 0.0}

    def optimizer(shards: int) -> float:  # sharded (shards = d·c, or dp_shard): the experts' state over edp
        held = max(a / shards + e / (edp if shards > 1 else 1) for a, e in split)
        if lay.optimizer == "muon":
            muon["newton_schulz"], muon["gather"] = muon_costs(dims, lay, cl, shards)
        return OPTIMIZER_BYTES_PER_PARAM * held / hbm + muon["newton_schulz"] + muon["gather"]

    flush = after_flush(dims, lay, params, finish, FlushCosts(
        reduction=reduction, gather=gather,
        tied=lambda nbytes: allreduce_time(nbytes, 2, cl, _stage_inter_node(lay, cl, 0, p - 1)),
        optimizer=optimizer),
        period=pipe if b2b else None)
    return Prediction(flush.end, pipe, bubble, flush.exposed, flush.optimizer, f, b, costs, how, peak, flush.gather,
                      optimizer_newton_schulz_seconds=muon["newton_schulz"], optimizer_gather_seconds=muon["gather"])


def muon_costs(dims: ModelDims, lay: Layout, cl: Cluster, shards: int) -> tuple[float, float]:
    """(Newton–Schulz seconds, the tp all-gathers' seconds) of Muon's step on the busiest rank (`muon_step`): its
    hidden matrices' GEMMs through `gemm_time` at the bf16 peak (the parameters' own under 64-true), each split
    matrix's update all-gathered over NVLink (InfiniBand when tp leaves a node)."""
    prec = precision_of(lay.precision)
    gemm_dtype, elem = ("bf16", 2) if prec.compute_dtype != "float64" else (lay.precision, 8)
    peak = peak_flops(cl.device, gemm_dtype)
    inter = lay.span("tp") > cl.gpus_per_node
    return muon_step(dims, lay, shards,
                     lambda a, b: matrix_seconds(a, b, lay.muon_ns_steps,
                                                 lambda m_, n_, k_: gemm_time(cl, m_, n_, k_, 1, peak, elem)),
                     lambda nbytes, n: allgather_time(nbytes, n, cl, inter))
