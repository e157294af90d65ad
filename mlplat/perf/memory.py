"""Memory per GPU of a PTD-P layout: weights, gradients, optimizer state, activations, per pipeline rank.

Model state (bytes per parameter held by the GPU), from the precision table (`mlplat.precision`,
`Precision.state_bytes`: weights, gradients in the main dtype if there is one, Adam's main weights and moments):
  bf16-megatron, 16-megatron  18 = 2 weights + 4 fp32 main grads (Megatron's accumulation buffer) + 12 fp32 Adam
                                   (main weights, m, v) (mlplat.optim.main_params); the paper's setup (its fp16
                                   gradients are 2 bytes, 16 in all) is 16-megatron here
  bf16-mixed, 16-mixed        16 = 4 fp32 weights + 4 fp32 grads + 8 Adam (m, v): Lightning's autocast keeps the
                                   model in fp32 and casts the GEMM inputs
  32-true 16 = 4 + 4 + 8;  64-true 32;  bf16-true, 16-true 8 = 2 + 2 + 4 (bf16 Adam moments)
The distributed optimizer (`optim.distributed=true`) divides the optimizer state (main weights and moments) by
d·c; weights and the main-gradient buffer stay whole (the gradients are reduce-scattered in place), as in Megatron.
Parameters sharded too (`optim.sharding=params`, ZeRO-3; `mlplat.optim.param_gather`): the weights and gradients
are held 1/d·c (1/parallel.dp_shard under HSDP; experts 1/edp) like the optimizer state, plus what is materialised
(`gathered_parameters`): the weights outside the transformer layers (embeddings, final norm, output layer) through a
pass and two layers' at a time (the one running, the next one's prefetch); the full gradients of two layers (one
accumulating, one being reduce-scattered) under every schedule but the split-backward ones (zero bubble, V), whose
W adds into the buffers after later micro-batches' B: their full gradients live through the pass.
Optimizer post-validation (`optim.post_validate=true`) adds a copy of what a step reads and writes: its gradients, the
stepped weights (main weights, or the weights themselves) and both moments, `Precision.step_state_bytes` per
parameter (16 for the Megatron precisions, 16 for 32-true, 32 for 64-true), sharded as the optimizer state is.
Muon (`optim.name=muon`) keeps a momentum besides AdamW's two moments for every parameter (zeros where its optimizer
does not read them, `mlplat.optim.muon`): one more state in the main dtype (4 bytes, 8 under 64-true) in the optimizer
state and in post-validation's copy.

Context parallelism (`parallel.cp` = c; Megatron-Core's, ring attention): the c ranks of a cp group hold the same
weights (replicated like data parallelism: the model state per GPU does not change, and the distributed optimizer
shards over the d·c ranks that hold a copy) and 1/c of every sequence (chunks i and 2c-1-i of 2c, the causal load
balance). So every per-token term below (activations, the W residue, the logits, the stage messages) is that of s/c
tokens; the s² score term of unfused attention becomes (s/c)·s (the rank's queries against every key), also 1/c.
Besides, while a layer runs its ring holds receive buffers for the K/V blocks that travel (`ring_buffer_bytes`):
two (double-buffered) in the forward, two K/V and two dK/dV in the backward, each block 2·b·(s/c)·(k/t)·d elements,
K/V in the activation dtype and dK/dV in the ring's accumulation dtype (float32 for 16-bit activations: the partial
sums travel unrounded, `mlplat.parallel.context`); only one layer runs at a time, so the backward's four blocks are
the peak ("ring_buffers").

Activations (bytes), for a micro-batch of b sequences, per layer, on one tensor-parallel rank, as in
Korthikanti et al. 2022 ("Reducing Activation Recomputation", Table 2). Tensor parallelism alone (the SC21
paper's) replicates the LayerNorm/dropout regions across the t ranks; sequence parallelism
(`parallel.sequence_parallel`) splits them along the sequence, so they are divided by t too:
  recompute  tensor parallel                    + sequence parallel
  none       s·b·h·(10 + 24/t + 5·a·s/(h·t))    s·b·h·(34/t + 5·a·s/(h·t))
  selective  s·b·h·(10 + 24/t)                  s·b·h·34/t        (attention scores/softmax/dropout recomputed)
  full       R·s·b·h                            R·s·b·h/t         (only the layer input is kept; R = bytes of
                                                                   the residual stream)
The 24/t is the tensors split over the t ranks: Q, K and V (3·sbh: 6), the output projection's input (2), the
MLP's fc1 output (GeLU's input, 8) and fc2's input (8). Other architectures (`sharded_activation_units`), in the
same units (bytes of 2-byte tensors, per sbh):
- grouped-query attention keeps K and V at k/a of Q's width: the QKV output is 2·(1 + 2k/a);
- rotary embeddings (mlplat.model.rotary) keep the rotated Q and K besides it, +2·(1 + k/a) (V, a view of the QKV
  output, keeps that alive); a grouped Q without rotary is copied by its head regrouping, +2;
- the MLP keeps fc1's output and fc2's input: 4f/h for GeLU (16 at f = 4h); for SwiGLU fc1's 2f gate-and-up,
  SiLU(gate) and fc2's input, 8f/h unfused, 6f/h fused (the compiled operator keeps fc1's output alone);
- RMSNorm keeps its input as a LayerNorm does (PyTorch's fused kernel on GPUs; on a CPU the decomposed RMSNorm
  also keeps fp32 copies of its input and its normalized output, 6·sbh more per norm, not counted);
- the dropout masks (1 byte per element, two in the 10) are counted whatever model.dropout is: at dropout 0 (the
  Llama family) that over-counts 2·sbh per layer.
tests/perf/test_llama.py holds these against the bytes a CPU run saves.
Under autocast the residual stream and the LayerNorm inputs stay fp32: R = 4 and +4·s·b·h (/t with sequence
parallelism) per layer for none/selective (Korthikanti's 34 assumes 2-byte tensors and 1-byte dropout masks, as
on GPUs; measured on CPU processes in experiments/activation_memory/, where a mask takes the activation's dtype).
Full recomputation also needs one layer's complete working set during its backward.

In-flight micro-batches on pipeline rank r, counted on the schedule itself (the engine's instruction lists: chunk
activations alive from their F to their B, each its chunk's layers: l/(p·v), or the uneven split's; the peak
is counted in layers, `stored_layers`), which gives for an even split:
  gpipe        m (all forwards before any backward)
  1f1b         min(p - r, m)
  interleaved  min(2(p-r-1) + (v-1)p + 1, m·v) chunk activations (Megatron's warm-up, plus the steady state's one)
  zb_h1, zbv   at most 1F1B's p - r, resp. p
  zb_h2        at most 2(p - r) - 1
  v_half       at most p/2 (p chunk activations, at least 2)
and besides, for these four, the pending W's (at most p micro-batches, 2p - 1 under zb_h2, p/2 under v_half):
each keeps the inputs of its layer's four weight GEMMs and their output gradients, s·b·(4h + 12h/t) elements per layer
(`weight_residue_bytes`), until its W runs (with sequence parallelism too: W needs the whole sequence, so the
gathered inputs wait for it)
so rank 0 is the worst: p micro-batches for 1f1b, p + (p-1)/v for interleaved.

FP8 (`kernels.fp8`, `fp8_bytes`): the weight casts kept over an optimizer step (W and Wᵀ of each layer's four GEMMs,
one byte per element: 2 bytes per GEMM weight held) and one GEMM's FP8 operands while it runs; the saved activations
stay in the run's precision (the layers keep their GEMM inputs unquantised).

Mixtures of experts under their own layout (`parallel.ep`, `parallel.etp`; `mlplat.parallel.layout.dims`): a GPU
holds E/ep of each MoE layer's routed experts, 1/etp of each (`expert_split`; the closed form and the meta-device
model count them split over t, as at ep = 1), their weights and gradients whole and, with the distributed optimizer,
their optimizer state sharded over the edp ranks that hold the same experts, the rest over d·c. An MoE layer keeps, in
place of the dense MLP's tensors (`moe_layer_activation_bytes`), the router's fp32 probabilities and indices, per
token-expert assignment its dispatched input, fc1's output, fc2's input and its gate (the gate weighs the
activation, which the backward recomputes: no SiLU output and no expert output kept), counted on the busiest rank:
routed tokens · k · model.moe.plan_imbalance (`expert_assignments`; the routed tokens are a rank's b·s/c, 1/t of
them with whole experts). While a layer runs its dispatch buffers are alive (`dispatch_buffer_bytes`,
"dispatch_buffers"). A rank's layers mix dense and MoE ones in proportion (`moe_share`).

Messages in flight (p > 1): each stage-to-stage message is a [b, s, h/t] buffer with scatter/gather or sequence
parallelism (else [b, s, h]) in the compute dtype (2 bytes under every bf16/fp16 precision, 4 under 32-true, 8
under 64-true). The engine's exchange plan holds at most `exchange.in_flight_messages(layout, m)` of them on a
rank at once (sends not yet released plus receives posted ahead; bounded independent of m, about 2v + 4); the
peak over the ranks is counted on every rank ("messages").
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Sequence

from mlplat.config import (
    RunConfig,
    batch_violations,
    context_parallel_violations,
    expert_parallel_violations,
    sequence_parallel_violations,
    shape_violations,
)
from mlplat.parallel.layout.dims import ParallelDims
from mlplat.parallel.layout.exchange import in_flight_messages
from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.perf.flops import (
    ModelDims,
    layer_parameters_of,
    routed_expert_parameters,
    stage_expert_parameters,
    stage_parameters,
)
from mlplat.precision import precision_of
from mlplat.specs import dispatchers
from mlplat.specs.dispatchers import Traffic

GIB = 1024**3

@dataclass(frozen=True)
class Layout(ParallelDims):
    """A PTD-P layout (`ParallelDims`: its sizes, batch split and schedule, and all they imply: the GPUs, the replicas,
    m, the rank order) plus the knobs that change its cost: the `kernels.*`, precision and optimizer keys.

    A run's layout is `Layout.of(run_config)`, which sets every field. The defaults are the paper's setup
    (full recomputation, fused kernels, bf16), for the planner's candidates and the paper studies."""

    recompute: str = "full"
    scatter_gather: bool = True
    precision: str = "bf16-mixed"
    attention: str = "auto"  # flash | sdpa | math | auto | unfused (the paper's fused-softmax attention)
    fused: bool = True
    distributed_optimizer: bool = False  # optim.distributed: optimizer state sharded over d·c
    param_sharding: bool = False  # optim.sharding=params: weights and gradients sharded too (ZeRO-3)
    grad_reduce_dtype: str = "main"  # optim.grad_reduce_dtype: main | bf16
    post_validate: bool = False  # optim.post_validate: a copy of what each optimizer step writes
    fp8: str = "none"  # kernels.fp8: the transformer layers' GEMMs in FP8 (mlplat.parallel.fp8)
    optimizer: str = "adamw"  # optim.name: muon adds Newton–Schulz and a momentum (mlplat.perf.muon)
    muon_ns_steps: int = 5  # optim.muon.ns_steps: Newton–Schulz iterations per hidden matrix and step
    qk_clip: float | None = None  # optim.muon.qk_clip: a pass over q·kᵀ per layer forward for the heads' maxima

    @property
    def gpus(self) -> int:
        """t·c·p·d."""
        return self.world_size

    @property
    def sharding(self) -> str:
        """optim.sharding: none | optim (the distributed optimizer) | params (the weights and gradients too)."""
        return "params" if self.param_sharding else "optim" if self.distributed_optimizer else "none"

    @classmethod
    def of(cls, cfg: RunConfig) -> "Layout":
        """The layout of a run config (parallel.dp as resolved by validation; 1 before)."""
        par, ker, opt = cfg.parallel, cfg.kernels, cfg.optim
        return cls(**asdict(ParallelDims.of(par, dp=par.dp or 1)), recompute=ker.recompute,
                   scatter_gather=par.scatter_gather, precision=str(cfg.trainer.precision), attention=ker.attention,
                   fused=ker.fused, distributed_optimizer=opt.distributed, param_sharding=opt.sharding == "params",
                   grad_reduce_dtype=opt.grad_reduce_dtype,
                   post_validate=opt.post_validate, fp8=ker.fp8, optimizer=opt.name,
                   muon_ns_steps=opt.muon.ns_steps, qk_clip=opt.muon.qk_clip)


def layout_errors(dims: ModelDims, lay: Layout, gpus_per_node: int | None = None) -> list[str]:
    """Every rule the layout breaks, one line each naming keys, values and the rule: the same rules (and
    words) as mlplat.config's validation, plus tensor parallelism staying inside a node."""
    e = shape_violations(n_layers=dims.n_layers, hidden=dims.hidden, n_heads=dims.n_heads, ffn=dims.ffn,
                         tp=lay.tp, pipeline=lay.pipeline, n_kv_heads=dims.kv_heads)
    if dims.head_dim is None and dims.hidden % dims.n_heads:
        e.append(f"model.hidden={dims.hidden} is not divisible by model.n_heads={dims.n_heads}")
    e += sequence_parallel_violations(sequence_parallel=lay.sequence_parallel, tp=lay.tp, seq_len=dims.seq_len)
    # The kernel rule of parallel.cp is the config's to check on the requested kernels.attention (a layout holds the
    # resolved kernel, flash on a GPU, whose cost sdpa's flash backend shares): `auto` passes it here.
    e += context_parallel_violations(cp=lay.cp, seq_len=dims.seq_len, tp=lay.tp,
                                     sequence_parallel=lay.sequence_parallel, dropout=dims.dropout)
    e += batch_violations(lay)
    e += expert_parallel_violations(lay, dims.moe.num_experts)
    if dims.moe.enabled and lay.expert_tp == 1 and dims.seq_len % (lay.tp * lay.cp):
        e.append(f"model.seq_len={dims.seq_len} is not divisible by parallel.tp·parallel.cp={lay.tp}·{lay.cp}: with "
                 f"parallel.etp=1 each tp rank routes 1/t of its sequence")
    if gpus_per_node and lay.tp > gpus_per_node:
        e.append(f"parallel.tp={lay.tp} exceeds cluster.gpus_per_node={gpus_per_node} "
                 f"(tensor parallelism stays in a node)")
    return e


# Past this many micro-batches per pipeline rank the peaks below stop growing (every schedule but GPipe reaches its
# steady state within its warm-up, at most 2p + (v-1)p chunk forwards): count them on a schedule of that length.
PEAK_SCHEDULE_CAP = 4


@lru_cache(maxsize=256)
def _schedule_peaks(schedule: str, p: int, v: int, m: int,
                    weights: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per rank, the peak chunk activations (F done, B not) and the peak pending W's, on the schedule itself; with
    `weights` (each chunk's layers) each chunk counts that many times: the peaks in layer activations."""
    from mlplat.parallel.layout.schedules import Op, build_schedule

    acts, pending = [], []
    for ops in build_schedule(schedule, p, v, m):
        alive = waiting = top_alive = top_waiting = 0
        for ins in ops:
            w = 1 if weights is None else weights[ins.chunk]
            alive += w * ((ins.op is Op.FORWARD) - (ins.op is Op.BACKWARD))
            waiting += w * ((ins.op is Op.BACKWARD) - (ins.op is Op.WEIGHT))
            top_alive, top_waiting = max(top_alive, alive), max(top_waiting, waiting)
        acts.append(top_alive)
        pending.append(top_waiting)
    return tuple(acts), tuple(pending)


def _peaks(schedule: str, p: int, v: int, m: int,
           weights: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # GPipe holds all m: no steady state
    capped = min(m, PEAK_SCHEDULE_CAP * p) if PipelineLayout(p, v, schedule).spec.steady_state else m
    return _schedule_peaks(schedule, p, v, capped, weights)


def stored_layers(lay: Layout, n_layers: int, rank: int) -> tuple[int, int]:
    """(layer activations, layer W residues) pipeline `rank` holds at its peak, in layers × micro-batches: each
    chunk's activations weighted by its layers (`PipelineLayout.chunk_layers`, the uneven split too). Even: the
    in-flight micro-batches × the rank's l/p layers."""
    weights = tuple(lay.pipeline.chunk_layers(n_layers))
    acts, pending = _peaks(lay.schedule, lay.pp, lay.vpp, lay.num_micro_batches, weights)
    return acts[rank], (pending[rank] if lay.pipeline.spec.split_backward else 0)


def pending_weight_gradients(schedule: str, p: int, v: int, m: int, rank: int) -> float:
    """Peak W's waiting on pipeline `rank`, in micro-batches of its layers (0 unless the backward is split)."""
    if not PipelineLayout(p, v, schedule).spec.split_backward:
        return 0.0
    return _peaks(schedule, p, v, m)[1][rank] / v


def weight_residue_bytes(dims: ModelDims, lay: Layout) -> float:
    """Bytes a pending W keeps per layer and micro-batch: the inputs of the layer's GEMMs (qkv, out, fc1, fc2: h,
    a·d/t, h, f/t per token) and their output gradients ((a + 2k)·d/t, h, f/t or 2f/t for SwiGLU, h), in the compute
    precision: 4h + 12h/t for the paper's GPT. A GEMM's whole side is h, its split side (a column GEMM's out, a row
    GEMM's in) split over t."""
    s, b, t = dims.seq_len / lay.cp, lay.micro_batch_size, lay.tp  # this cp rank's tokens
    shapes = dims.gemm_shapes()
    whole = sum(i if col else o for o, i, col in shapes) + sum(i for o, i, col in shapes if col is None)
    split = sum(o if col else i for o, i, col in shapes if col is not None)
    return precision_of(lay.precision).activation_bytes * s * b * (whole + split / t)


MESSAGE_SCHEDULE_CAP = 2  # count the messages on a schedule of at most 2p micro-batches: the count is flat by then


@lru_cache(maxsize=256)
def _messages_in_flight(schedule: str, p: int, v: int, m: int) -> int:
    return int(in_flight_messages(PipelineLayout(p, v, schedule), m))


def messages_in_flight(lay: Layout) -> int:
    """The most stage-to-stage message buffers a pipeline rank holds at once (0 without a pipeline); counted on
    the engine's own exchange plan for min(m, 2p) micro-batches (the count does not grow with m past that: tested
    for every schedule up to p = 8)."""
    if lay.pp < 2:
        return 0
    m = lay.num_micro_batches
    return _messages_in_flight(lay.schedule, lay.pp, lay.vpp, min(m, MESSAGE_SCHEDULE_CAP * lay.pp))


def message_bytes(dims: ModelDims, lay: Layout) -> float:
    """Bytes of one stage-to-stage message (an activation or its gradient): [b, s/c, h/t] when scatter/gather or
    sequence parallelism splits it over the t ranks, else [b, s/c, h], in the compute dtype."""
    split = lay.tp if lay.scatter_gather or lay.sequence_parallel else 1
    return precision_of(lay.precision).compute_bytes * lay.micro_batch_size * dims.seq_len / lay.cp * \
        dims.hidden / split


def kv_block_bytes(dims: ModelDims, lay: Layout) -> float:
    """One K/V block of the ring (and one dK/dV block): 2·b·(s/c)·(k/t)·d elements (the KV heads only, grouped-query
    attention's k of them; the attention entry's `ring_width`: MLA's a/t·(nope + rope + v)), in the activation dtype;
    0 without context parallelism."""
    if lay.cp < 2:
        return 0.0
    width = dims.attention_entry.ring_width(dims, lay.tp) / lay.tp  # fewer KV heads than t: each rank keeps one
    return precision_of(lay.precision).activation_bytes * lay.micro_batch_size * dims.seq_len / lay.cp * width


def dkv_block_bytes(dims: ModelDims, lay: Layout) -> float:
    """One dK/dV block of the ring's backward: a K/V block's elements in the accumulation dtype, float32 where the
    activations are 16-bit (the ring adds each hop's share to the partial sum it receives, unrounded)."""
    act = precision_of(lay.precision).activation_bytes
    return kv_block_bytes(dims, lay) * max(act, 4) / act


def ring_buffer_bytes(dims: ModelDims, lay: Layout) -> float:
    """The ring's receive buffers while one layer runs: two K/V blocks in the forward (one computed on, one
    arriving), two K/V and two dK/dV blocks in the backward: the backward's four are the peak."""
    return 2 * kv_block_bytes(dims, lay) + 2 * dkv_block_bytes(dims, lay)


def in_flight(schedule: str, p: int, v: int, m: int, rank: int) -> float:
    """Peak activations held by pipeline `rank`, in micro-batches of that rank's layers (see module doc)."""
    return _peaks(schedule, p, v, m)[0][rank] / v


def layer_activation_bytes(dims: ModelDims, lay: Layout, recompute: str | None = None) -> float:
    """Bytes one layer keeps for its backward, per micro-batch, on one tensor-parallel (and context-parallel) rank:
    every term is 1/c of the c = 1 figure (s/c tokens; unfused scores (s/c)·s)."""
    return _layer_activation_bytes(dims, lay, recompute) / lay.cp


def _layer_activation_bytes(dims: ModelDims, lay: Layout, recompute: str | None = None) -> float:
    recompute = recompute or lay.recompute
    s, b, h, a, t = dims.seq_len, lay.micro_batch_size, dims.hidden, dims.n_heads, lay.tp
    prec = precision_of(lay.precision)
    residual, scale = prec.residual_bytes, prec.activation_bytes / 2  # scale: vs Korthikanti's 2-byte tensors
    sbh = s * b * h
    # The LayerNorm/dropout regions (10·sbh, with the QKV and fc1 inputs), replicated on the t ranks unless
    # sequence parallelism splits them too.
    split = t if lay.sequence_parallel else 1
    if recompute == "full":
        return residual * sbh / split
    fp32_ln_inputs = 4 * sbh / split if prec.autocast else 0  # autocast: the LayerNorm inputs stay fp32
    base = scale * sbh * (10 / split + sharded_activation_units(dims, lay.fused, t, recompute) / t) + fp32_ln_inputs
    if recompute == "selective":
        return base
    if recompute != "none":
        raise ValueError(f"kernels.recompute={recompute!r} is not one of none, selective, full")
    # Flash attention keeps no s² score matrix either (it recomputes it in its backward).
    if _flash(lay):
        return base + scale * 2 * s * b * dims.attention_width / t  # the softmax statistics, the output it re-reads
    return base + scale * 5 * a * s * s * b / t


def sharded_activation_units(dims: ModelDims, fused: bool = False, tp: int = 1, recompute: str = "none") -> float:
    """The tensors a layer keeps split over the t ranks, in bytes of 2-byte tensors per s·b·h (Korthikanti's 24 for
    the paper's GPT): the attention's Q, K, V and output-projection input, the MLP's fc1 output and fc2 input, as
    mlplat's model keeps them (see the module doc). With fewer key/value heads than t (`tp`) each rank computes a
    whole one: K and V count as max(k, t) heads. Q and the output projection's input are a·d wide: 1 sbh each
    unless model.head_dim sets d."""
    entry = dims.attention_entry  # model.attention's (multi-head: `attentions.mha_kept`)
    kept = entry.kept_selective if recompute == "selective" and entry.kept_selective is not None else entry.kept
    attention = kept(dims, tp)
    return attention + mlp_activation_elements(dims, dims.ffn, fused) * 2 / dims.hidden


def mlp_activation_elements(dims: ModelDims, width: float, fused: bool = False) -> float:
    """Elements an MLP of `width` keeps per token, as model.mlp's entry declares them: for SwiGLU gate and up (2f),
    SiLU(gate) unless fused (f) and fc2's input (f); for GeLU its input and fc2's input (2f)."""
    return dims.mlp_entry.kept_elements(width, fused)


def _flash(lay: Layout) -> bool:
    return lay.attention == "flash"


# -- the experts under their own layout (parallel.ep, parallel.etp; mlplat.parallel.layout.dims) -------------------

def expert_imbalance(counts: Sequence[float], ep: int) -> float:
    """A measured model.moe.plan_imbalance: from one MoE layer's token assignments per expert (E counts, experts
    j·E/ep to (j+1)·E/ep - 1 on ep rank j), the busiest ep rank's assignments over the mean."""
    per = len(counts) // ep
    loads = [sum(counts[j * per:(j + 1) * per]) for j in range(ep)]
    mean = sum(loads) / ep
    return max(loads) / mean if mean else 1.0


def expert_split(dims: ModelDims, lay: Layout, parameters: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """(the rest, the routed experts) of each pipeline rank's parameters on one GPU. `parameters`: each rank's count
    with the experts split over t, as the closed form (`stage_parameters`) and the meta-device model (built at
    ep = 1) count it; the routed experts' t-shard is replaced by their etp·ep shard (E/ep experts, each 1/etp of
    its width)."""
    parameters = parameters or stage_parameters(dims, lay.tp, lay.pipeline)
    return [rank_expert_split(dims, lay, r, n) for r, n in enumerate(parameters)]


def rank_expert_split(dims: ModelDims, lay: Layout, rank: int, parameters: int) -> tuple[int, int]:
    """`expert_split` of pipeline rank `rank` alone, holding `parameters` (counted with the experts split over t)."""
    experts = stage_expert_parameters(dims, lay.pipeline)[rank]
    return parameters - experts // lay.tp, experts // (lay.expert_tp * lay.ep)


def routed_tokens(dims: ModelDims, lay: Layout) -> float:
    """Tokens one rank routes per micro-batch and MoE layer: its b·s/c, each tp rank 1/t of them when the experts
    are whole (etp = 1), all of them when the experts are split over t (etp = t)."""
    tokens = lay.micro_batch_size * dims.seq_len / lay.cp
    return tokens if lay.expert_tp > 1 else tokens / lay.tp


def expert_assignments(dims: ModelDims, lay: Layout) -> float:
    """Token-expert assignments the busiest rank's experts compute per micro-batch and MoE layer: the mean, the
    routed tokens · k (each ep rank receives its share of the ep group's), times model.moe.plan_imbalance when the
    experts are spread over ranks (ep > 1)."""
    x = routed_tokens(dims, lay) * dims.moe.top_k
    return x * dims.moe.plan_imbalance if lay.ep > 1 else x


def dispatch_buffer_bytes(dims: ModelDims, lay: Layout) -> float:
    """One MoE layer's token buffers while it runs, in the compute dtype: the permuted assignments and the experts'
    outputs (2·X·h, X = `expert_assignments`) and, under ep > 1, the dispatcher's own rows (its entry's
    `buffer_rows`, `mlplat.specs.dispatchers`: alltoall sends the rank's routed·k assignments and gets them back,
    2·routed·k·h; allgather holds the ep group's gathered tokens and the reduce-scatter's input, 2·ep·routed·h)."""
    h, x, elem = dims.hidden, 2 * expert_assignments(dims, lay), precision_of(lay.precision).compute_bytes
    if lay.ep > 1:
        moe = dims.moe
        # the routing's spread over nodes as if each rank were one (the cluster is not known here): the node
        # dispatcher's rows at their most
        x += dispatchers.get(moe.dispatcher).buffer_rows(Traffic(routed_tokens(dims, lay), moe.top_k, h, elem,
                                                                 max(4, elem), lay.ep, experts=moe.num_experts,
                                                                 n_groups=moe.n_groups, topk_groups=moe.topk_groups,
                                                                 per_node=1))
    return elem * x * h


def moe_layer_activation_bytes(dims: ModelDims, lay: Layout, recompute: str | None = None) -> float:
    """What an MoE layer keeps for its backward per micro-batch on one rank, in place of `layer_activation_bytes`:
    the same attention and norms; instead of the dense MLP's tensors, the router's (`router_bytes` per routed
    token), per assignment of the busiest rank (`expert_assignments`) its dispatched input
    (fc1's, h), fc1's output and fc2's input (`mlp_activation_elements` of f_e/etp as a fused MLP's: 3f for SwiGLU,
    2f for GeLU, whatever kernels.fused says, since the gate-weighted activation recomputes the rest in its
    backward, mlplat.model.moe) and its gate, and the shared experts' MLP (width shared·f_e, split over t as the
    dense one). Under full recomputation the layer keeps its input alone, as a dense one."""
    recompute = recompute or lay.recompute
    dense = layer_activation_bytes(dims, lay, recompute)
    if recompute == "full":
        return dense
    act, t, h = precision_of(lay.precision).activation_bytes, lay.tp, dims.hidden
    tokens = lay.micro_batch_size * dims.seq_len / lay.cp
    shared = dims.moe.shared_experts * dims.expert_ffn
    mlp = tokens / t * (mlp_activation_elements(dims, shared, lay.fused) -
                        mlp_activation_elements(dims, dims.ffn, lay.fused))
    experts = expert_assignments(dims, lay) * (
        h + mlp_activation_elements(dims, dims.expert_ffn / lay.expert_tp, fused=True) + 1)
    return dense + act * (mlp + experts) + router_bytes(dims) * routed_tokens(dims, lay)


def router_bytes(dims: ModelDims) -> float:
    """What routing keeps per routed token: the softmax's fp32 probabilities (4·E), the logits too under the z-loss
    (4·E), and three int64 indices per assignment (the chosen experts, their order by expert, each one's token:
    24·k). The sigmoid router's scores, the top-k renormalisation, group-limited routing and the balancing losses'
    token sets keep a few E or k bytes more, not counted (under 0.1% of a token's expert tensors at Mixtral's and
    Qwen3's shapes); capacity drops are not subtracted either (the busiest rank is counted dropless)."""
    moe = dims.moe
    return 4 * moe.num_experts * (2 if moe.z_loss_coeff > 0 else 1) + 24 * moe.top_k


def moe_share(dims: ModelDims, lay: Layout, rank: int) -> float:
    """The fraction of pipeline rank `rank`'s layers that hold experts."""
    layers = [i for c in lay.pipeline.chunks_of(rank) for i in lay.pipeline.layers_of(c, dims.n_layers)]
    return sum(dims.is_moe_layer(i) for i in layers) / len(layers) if layers else 0.0


@dataclass
class MemoryReport:
    pipeline_rank: int
    parameters: int
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.breakdown.values())


def memory_per_gpu(dims: ModelDims, lay: Layout, pipeline_rank: int = 0, *, parameters: int | None = None,
                   overhead_bytes: float = 2 * GIB) -> MemoryReport:
    """Bytes on one GPU of `pipeline_rank`, broken down. `parameters` overrides the closed-form count
    (e.g. with the meta-device count); `overhead_bytes` is the CUDA context, NCCL buffers and allocator
    slack, which we take as a flat 2 GiB per GPU (0.3 GiB for the CPU processes of a gloo run)."""
    t, r = lay.tp, pipeline_rank
    s, b = dims.seq_len / lay.cp, lay.micro_batch_size  # the tokens of this context-parallel rank
    if parameters is None:
        parameters = stage_parameters(dims, t, lay.pipeline)[r]
    prec = precision_of(lay.precision)
    scale = prec.activation_bytes / 2
    wb, gb, ob = prec.state_bytes
    # Muon keeps AdamW's two moments and its momentum for every parameter (zeros where its optimizer does not use
    # them: mlplat.optim.muon), one more state in the main dtype; a step's copy (post-validation) holds it too.
    extra = gb if lay.optimizer == "muon" else 0
    ob += extra
    # The routed experts: E/ep of them, 1/etp of each, their optimizer state sharded over the edp ranks holding them.
    dense, experts = rank_expert_split(dims, lay, r, parameters) if dims.moe_layers else (parameters, 0)
    parameters = dense + experts
    shards = (lay.shard_size, lay.edp) if lay.distributed_optimizer else (1, 1)
    state = dense / shards[0] + experts / shards[1]
    held = (parameters, parameters)  # the weights and gradients a rank holds at its peak, in parameters
    params_sharded = lay.param_sharding and shards[0] > 1  # (one replica: nothing to shard, nothing gathered)
    if params_sharded:
        rest, layer, at_once = gathered_parameters(dims, lay, r, parameters)
        split = lay.pipeline.spec.split_backward
        held = (state + rest + at_once * layer,
                state + (parameters if split else 2 * max(layer, rest_largest(dims, lay, r))))

    activations, residues = stored_layers(lay, dims.n_layers, r)
    share = moe_share(dims, lay, r) if dims.moe_layers else 0.0
    layer_bytes = (1 - share) * layer_activation_bytes(dims, lay) + (
        share * moe_layer_activation_bytes(dims, lay) if share else 0.0)
    stored = activations * layer_bytes + residues * weight_residue_bytes(dims, lay)
    if lay.recompute == "full":
        # The layer being recomputed and back-propagated holds its full working set.
        working = (moe_layer_activation_bytes if share else layer_activation_bytes)(dims, lay, "none")
    elif lay.recompute == "selective":
        # The recomputed scores: this rank's s/c queries against all s keys.
        working = 0.0 if _flash(lay) else scale * 5 * dims.n_heads * s * dims.seq_len * b / t
    else:
        working = 0.0
    # Last stage: this rank's vocab shard of the logits (2 bytes) and the fp32 softmax and gradient of
    # the vocab-parallel cross-entropy (4 + 4); it lives from a micro-batch's loss to its backward, about
    # one micro-batch at a time on the last rank. First stage: the embedding output, negligible.
    vocab_shard = dims.padded_vocab(t) // t
    last = r == lay.pipeline.owner(lay.pipeline.last_chunk)
    logits = (2 + 8 * scale) * s * b * vocab_shard if last else 0.0
    breakdown = {
        "weights": wb * held[0],
        "gradients": gb * held[1],
        "optimizer_state": ob * state,
        "activations": stored,
        "working_set": working,
        "logits": logits,
        "messages": messages_in_flight(lay) * message_bytes(dims, lay),
    }
    if last and dims.mtp.enabled:
        breakdown["mtp"] = mtp_activation_bytes(dims, lay, logits)
    if lay.cp > 1:
        breakdown["ring_buffers"] = ring_buffer_bytes(dims, lay)
    if share:
        breakdown["dispatch_buffers"] = dispatch_buffer_bytes(dims, lay)
    if lay.fp8 != "none":  # the casts of the layers held (sharded parameters: of those gathered, cast per gather)
        layers = at_once if params_sharded else lay.pipeline.rank_layers(r, dims.n_layers)
        breakdown.update(fp8_bytes(dims, lay, layers))
    if lay.post_validate:  # a step's gradients, stepped weights and moments, sharded as the optimizer is
        breakdown["post_validation_copy"] = (prec.step_state_bytes + extra) * state
    breakdown["overhead"] = overhead_bytes
    return MemoryReport(r, parameters, breakdown)


def rank_layer_parameters(dims: ModelDims, lay: Layout, rank: int) -> list[int]:
    """The parameters one GPU of pipeline rank `rank` holds of each of its transformer layers (the multi-token
    prediction modules' on the last chunk's rank included): split over t, the routed experts E/ep of them, 1/etp of
    each."""
    pipe = lay.pipeline
    layers = [i for c in pipe.chunks_of(rank) for i in pipe.layers_of(c, dims.n_layers)]
    if rank == pipe.owner(pipe.last_chunk):
        layers += [dims.n_layers + k for k in range(dims.mtp.depth)]
    return [layer_parameters_of(dims, lay.tp, i) - routed_expert_parameters(dims, i) // lay.tp
            + routed_expert_parameters(dims, i) // (lay.expert_tp * lay.ep) for i in layers]


def gathered_parameters(dims: ModelDims, lay: Layout, rank: int, parameters: int) -> tuple[int, int, int]:
    """Sharded parameters (`optim.sharding=params`) on a GPU of pipeline rank `rank` holding `parameters` (experts
    counted E/ep): (the parameters outside the layers, gathered through a pass; the largest layer's; how many layers
    are gathered at once: two, the running one and the next one of its chunk, where a chunk holds two)."""
    layers = rank_layer_parameters(dims, lay, rank)
    pipe = lay.pipeline
    counts = pipe.chunk_layers(dims.n_layers)
    per_chunk = max((counts[c] + (dims.mtp.depth if c == pipe.last_chunk else 0) for c in pipe.chunks_of(rank)),
                    default=0)
    return max(parameters - sum(layers), 0), max(layers, default=0), min(2, per_chunk)


def rest_largest(dims: ModelDims, lay: Layout, rank: int) -> int:
    """The largest parameter outside the layers on pipeline rank `rank` (a word embedding or output layer's vocabulary
    shard, a bucket of its own), whose gradient buffer is whole while it is reduced."""
    pipe = lay.pipeline
    ends = rank in (pipe.owner(0), pipe.owner(pipe.last_chunk))
    return dims.padded_vocab(lay.tp) // lay.tp * dims.hidden if ends else 0


def mtp_activation_bytes(dims: ModelDims, lay: Layout, logits: float) -> float:
    """What the D multi-token prediction modules keep for their backward on the last rank, one micro-batch at a time
    (they run with the loss): per module its layer's activations (layer l + k - 1's kind) and its logits' (`logits`
    bytes, as the main loss's: every depth's live until the backward)."""
    layer = (moe_layer_activation_bytes if dims.is_moe_layer(dims.n_layers) else layer_activation_bytes)(dims, lay)
    return dims.mtp.depth * (layer + logits)


def fp8_bytes(dims: ModelDims, lay: Layout, layers: int) -> dict[str, float]:
    """FP8's own bytes on a rank holding `layers` transformer layers (`kernels.fp8`): the weight casts kept over the
    step (W and Wᵀ of the four GEMMs, or of the experts', one byte per element each; the scales are 1/128² of that or
    less) and one GEMM's FP8 activation and gradient operands while it runs (the widest X and dY, one byte per
    element). The activations kept for the backward are unchanged: the layers keep their inputs in the run's
    precision."""
    t, tokens = lay.tp, dims.seq_len / lay.cp * lay.micro_batch_size
    # QKV's and fc1's input h, out's a·d/t, fc2's f/t; their outputs (a + 2k)·d/t, h, (2)f/t, h
    widest_x = max(i if col or col is None else i / t for o, i, col in dims.gemm_shapes())
    widest_dy = max(o / t if col else o for o, i, col in dims.gemm_shapes())
    per_layer = dims.layer_gemm_weights / t
    if dims.moe_layers:  # an MoE layer keeps its attention's, its local experts' and its shared experts' casts,
        moe = dims.moe  # the layers' mean taken (which of a rank's layers hold experts is the pipeline's)
        experts = (moe.num_experts // lay.ep * dims.expert_gemm_weights / lay.expert_tp
                   + moe.shared_experts * dims.expert_gemm_weights / t + dims.attention_gemm_weights / t)
        per_layer += dims.moe_layers / dims.n_layers * (experts - per_layer)
    return {"fp8_weight_casts": 2.0 * layers * per_layer, "fp8_operands": tokens * (widest_x + widest_dy)}


def memory_per_stage(dims: ModelDims, lay: Layout, parameters: list[int] | None = None, **kw) -> list[MemoryReport]:
    parameters = parameters or stage_parameters(dims, lay.tp, lay.pipeline)
    return [memory_per_gpu(dims, lay, r, parameters=parameters[r], **kw) for r in range(lay.pp)]
