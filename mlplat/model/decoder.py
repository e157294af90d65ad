"""The decoder-only transformer, built from tensor-parallel layers and cut into pipeline chunks.

`model.arch=gpt` is the paper's GPT: pre-LayerNorm blocks, learned position embeddings, causal self-attention, a
GeLU MLP of width 4h (`model.activation`: the exact GeLU, or GPT-2's tanh approximation), input and output
embeddings tied. `model.arch=llama` is the Llama family: RMSNorm, rotary positions (`mlplat.model.rotary`),
grouped-query attention (`model.n_kv_heads`), a SwiGLU MLP, no biases (Qwen2: on the QKV projection), an untied
output layer (Qwen3 adds norms on q and k, `model.qk_norm`). Each key can also be set on its own
(mlplat.config.ARCHS; a chunk fills the nulls with `arch_defaults`). The L layers are spread over p·v chunks as
the pipeline layout says (`PipelineLayout.layers_of`: evenly, or the first and the last chunk holding a set number);
chunk 0 also holds the word embedding, the last chunk the final norm and the output layer (the tied word embedding,
or `output.weight`), and with `model.mtp.depth` the multi-token prediction modules (`mlplat.model.mtp`). Parameter
names are those of the full model (`layers.<global index>.…`), so initialisation and checkpoints do not depend on
the layout.

Kernels (`kernels.*`): the attention backend; `fused` runs the linear layers with `skip_bias_add` and hands
their bias to the fused bias+GeLU and bias+dropout+add operators (`mlplat.model.fused`); `recompute`
`selective` recomputes the attention core in backward, `full` each transformer layer, both through
`mlplat.parallel.random.checkpoint`, which replays the forward's dropout masks; `fp8` runs the layers' four
GEMMs in FP8 (`mlplat.parallel.fp8`).

Sequence parallelism (`parallel.sequence_parallel`, `mlplat.parallel.sequence`): between the tensor-parallel
GEMMs (LayerNorms, dropouts, residual adds) each tensor-parallel rank holds 1/t of the sequence, [b, s/t, h].
The embedding is reduce-scattered straight into that shard; the stages exchange shards; the last chunk applies
the final LayerNorm to its shard and all-gathers the sequence only inside the logits GEMM, which needs every
token against this rank's vocabulary slice (so the LayerNorm runs on 1/t of the tokens and keeps 1/t of its
input, and the logits [b, s, V/t] line up with the full labels). Dropout on a shard draws from the tracker's
tensor-parallel stream: the shards are different tokens, so their masks must differ.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from mlplat.config import KernelsConfig, ModelConfig, arch_defaults
from mlplat.labels import IGNORE
from mlplat.model.attention import attention_core, kept_pairs
from mlplat.model.fused import bias_swiglu, fused_bias_dropout_add, fused_bias_gelu, fused_bias_swiglu
from mlplat.model.init import WORD_EMBEDDING
from mlplat.model.moe import MoELayer
from mlplat.model.mtp import MTPModule, MultiTokenPrediction
from mlplat.model.rotary import Rotary
from mlplat.parallel.context import Ring, ring_attention
from mlplat.parallel.cross_entropy import vocab_parallel_cross_entropy
from mlplat.parallel.fp8 import use_fp8
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.parallel.logit_max import head_max_logits
from mlplat.parallel.placement import TokenLayout
from mlplat.parallel.random import RNGTracker, checkpoint
from mlplat.parallel.sequence import mark_sequence_parallel_replicated
from mlplat.parallel.tensor import (
    ColumnParallelLinear,
    Matrices,
    RowBlock,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelOutput,
    parallel_lm_logits,
    vocab_parallel_embedding,
)
from mlplat.specs.attentions import Heads

GELU_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}  # model.activation -> F.gelu's `approximate`


def sequence_rng(tracker: RNGTracker, on: bool):
    """The tracker's tensor-parallel stream while `on` (dropout on a sequence shard), else nothing."""
    return tracker.fork() if on else contextlib.nullcontext()


def make_norm(cfg: ModelConfig, device=None, dtype=None) -> nn.Module:
    """model.norm: LayerNorm (with a bias when model.bias) or RMSNorm, over the hidden size."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps, device=device, dtype=dtype)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=cfg.bias, device=device, dtype=dtype)


def qkv_row_blocks(cfg: ModelConfig, tp: int) -> list[list[RowBlock]] | None:
    """Each tp rank's rows of the full QKV weight when key/value heads are replicated (n_kv_heads < t), else None
    (an even split). Rank i holds n_heads/t query heads of group g = i // (t/n_kv_heads), then g's k and v rows:
    one group of the layout below with fewer queries, and the k, v rows shared with the other ranks of g."""
    share = cfg.kv_replicas(tp)
    if share == 1:
        return None
    d = cfg.head_size
    r = cfg.n_heads // cfg.kv_heads  # query heads per group
    q = r // share  # of them on one rank
    out = []
    for i in range(tp):
        g, j = divmod(i, share)
        start = g * (r + 2) * d  # group g's first row
        out.append([RowBlock(0, start + j * q * d, q * d), RowBlock(q * d, start + r * d, 2 * d, shared=True)])
    return out


def qkv_matrices(cfg: ModelConfig) -> Matrices:
    """The query, key and value projections in the full QKV weight's rows (the layout of `ParallelAttention`): each
    a logical matrix of its own, gathered from every key/value group."""
    d, r = cfg.head_size, cfg.n_heads // cfg.kv_heads
    starts = [g * (r + 2) * d for g in range(cfg.kv_heads)]
    return Matrices(runs=(tuple((s, r * d) for s in starts), tuple((s + r * d, d) for s in starts),
                          tuple((s + (r + 1) * d, d) for s in starts)))


def interleaved_matrices(parts: int, units: int) -> Matrices:
    """A fc1 of `parts` parts whose rows alternate unit by unit (SwiGLU's gate and up): part q is rows q, q + parts,
    q + 2·parts, ..."""
    return Matrices(runs=tuple(tuple((parts * j + q, 1) for j in range(units)) for q in range(parts)))


class AttentionCore(nn.Module):
    """What the attention runtimes share: the kernels (`set_kernels`) and the core softmax(q·kᵀ/√d)·v on this rank's
    heads (`attend`: ring attention under context parallelism, recomputed in backward under selective
    recomputation). The subclass sets `tracker`, `dropout`, `ring` and its output projection `out`."""

    def set_kernels(self, kernels: KernelsConfig, backend: str) -> None:
        self.selective = kernels.recompute == "selective"
        self.fused = kernels.fused
        self.backend = backend
        self.core = attention_core(backend, kernels.fused)
        # Fused: the output projection returns (out, bias) for the layer's bias+dropout+add.
        self.out.skip_bias_add = kernels.fused

    # QK-clip (`mlplat.model.qk_clip`): the running max of each of this rank's heads' logits over a training pass,
    # [heads] float64, reset before each pass; None: not tracked (no cost)
    logit_max: torch.Tensor | None = None

    def _track(self, block_max: torch.Tensor) -> None:
        torch.maximum(self.logit_max, block_max.to(self.logit_max), out=self.logit_max)

    def _core(self, q, k, v, layout: TokenLayout | None = None):
        # Training passes only (recomputation repeats a forward: the max is the same)
        tracked = self.logit_max is not None and self.training
        if layout is not None and layout.cp > 1:  # validation keeps dropout off under context parallelism
            return ring_attention(q, k, v, layout, self.ring, self.backend, self._track if tracked else None)
        if tracked:
            self._track(head_max_logits(q, k, kept_pairs(q.size(-2), layout, q.device), 1.0 / math.sqrt(q.size(-1))))
        # Attention dropout acts on this rank's heads only: it must differ across tp ranks.
        with self.tracker.fork():
            return self.core(q, k, v, self.dropout, self.training, layout)

    def attend(self, q, k, v, layout: TokenLayout | None = None):
        """The core's output [b, heads, s, v's head size] for q, k [b, heads (k: key/value heads), s, d], v."""
        if self.selective and self.training and torch.is_grad_enabled():
            return checkpoint(self._core, self.tracker, q, k, v, layout)
        return self._core(q, k, v, layout)


class ParallelAttention(AttentionCore):
    """The runtime of model.attention=mha (`mlplat.specs.attentions`), its GEMMs built as the entry declares them: QKV
    column-parallel, output projection row-parallel; rotary embedding on q and k when model.position=rope. A subclass
    whose entry adds GEMMs gets them built too, and changes `project` (the core's output to the layer's).

    The QKV output is laid out by key/value head: [group g][its n_heads/n_kv_heads query heads, then k, then v]
    [head_dim]. A tensor-parallel rank's contiguous column slice is then n_kv_heads/t whole groups with their
    queries (grouped-query attention splits like multi-head); with n_kv_heads = n_heads it is GPT's
    [head][q|k|v][head_dim]. Query head g·r + i uses key/value head g, as in transformers' Llama.

    Fewer key/value heads than tp ranks (t a multiple of n_kv_heads): each rank holds n_heads/t query heads and
    the one key/value head they use, replicated on the t/n_kv_heads ranks sharing it (`qkv_row_blocks`); locally
    that is one group, [its queries, k, v]. The shared k and v rows are one parameter of the full model: each
    rank's gradient of them comes from its own queries only, so the gradient buffer sums them over the grid's
    `kv_group` (`ParamBuffers.reduce_shared_rows`).

    model.qk_norm (Qwen3): q and k each go through an RMSNorm over a head's d channels before the rotation, one
    weight [d] shared by every head. A rank applies it to its own heads only, so its gradient is a partial sum over
    the tensor-parallel ranks: tagged like the sequence-parallel norms, summed over the tp group after the backward."""

    def __init__(self, cfg: ModelConfig, grid: ParallelGrid, tracker: RNGTracker, kernels: KernelsConfig, backend: str,
                 device=None, dtype=None, sequence_parallel: bool = False, rotary: Rotary | None = None,
                 ring: Ring | None = None):
        super().__init__()
        self.ring = ring  # context parallelism: the cp group's ring (mlplat.parallel.context)
        h = cfg.hidden
        self.head_dim = cfg.head_size
        share = cfg.kv_replicas(grid.tp)
        if share != grid.kv_replicas and not grid.virtual:  # a virtual grid has no groups to sum over
            raise ValueError(f"model.n_kv_heads={cfg.kv_heads} at parallel.tp={grid.tp} shares each key/value head "
                             f"over {share} tp ranks, but the grid was built with kv_replicas={grid.kv_replicas}")
        self.groups = max(1, cfg.kv_heads // grid.tp)  # key/value heads on this rank
        self.per_group = cfg.n_heads // cfg.kv_heads // share  # query heads per key/value head on this rank
        self.heads = self.groups * self.per_group
        # The model's index of each of this rank's key/value heads and query heads (in q's order; QK-clip's)
        first = grid.tp_rank * self.groups if share == 1 else grid.tp_rank // share
        self.kv_head_ids = torch.arange(first, first + self.groups)
        self.head_ids = (self.kv_head_ids[:, None] * (cfg.n_heads // cfg.kv_heads) + grid.tp_rank % share
                         * self.per_group + torch.arange(self.per_group)).reshape(-1)
        self.dropout = cfg.dropout
        self.tracker = tracker
        self.rotary = rotary
        self.spec = cfg.attention_entry
        heads = Heads.of(cfg)
        for gemm in self.spec.gemms:
            linear, extra = ((ColumnParallelLinear, {"row_blocks": qkv_row_blocks(cfg, grid.tp)})
                             if gemm.name == self.spec.kv_gemm else
                             ({"column": ColumnParallelLinear, "row": RowParallelLinear}[gemm.split], {}))
            setattr(self, gemm.name, linear(gemm.inp(h, heads), gemm.out(h, heads), grid, bias=gemm.has_bias(cfg),
                                            device=device, dtype=dtype, sequence_parallel=sequence_parallel, **extra))
        getattr(self, self.spec.kv_gemm)._set_matrices(weight=qkv_matrices(cfg))  # q, k and v apart (Muon's)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps, device=device, dtype=dtype)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps, device=device, dtype=dtype)
            mark_sequence_parallel_replicated(self.q_norm.weight, self.k_norm.weight)  # partial over tp (docstring)
        self.set_kernels(kernels, backend)

    def forward(self, x: torch.Tensor, layout: TokenLayout | None = None):
        """The attention sub-block's output; with kernels.fused the pair (output without bias, bias). `layout`:
        where this rank's tokens sit (context parallelism, packed documents; None: a plain causal window)."""
        qkv = self.qkv(x)
        b, s = qkv.shape[:2]  # the whole sequence, also when x is a sequence-parallel shard
        r, d = self.per_group, self.head_dim
        qkv = qkv.view(b, s, self.groups, r + 2, d)
        q = qkv[:, :, :, :r].reshape(b, s, self.heads, d).transpose(1, 2)  # [b, heads, s, d]
        k = qkv[:, :, :, r].transpose(1, 2)  # [b, groups, s, d]
        v = qkv[:, :, :, r + 1].transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = (self.rotary(q, k, self.fused) if layout is None
                    else self.rotary(q, k, self.fused, layout.positions, layout.seq_len))
        ctx = self.attend(q, k, v, layout)
        return self.project(x, ctx.transpose(1, 2).reshape(b, s, self.heads * d))

    def project(self, x: torch.Tensor, ctx: torch.Tensor):
        """The sub-block's output from its input x and the core's output [b, s, this rank's heads·d]: the output
        projection's."""
        return self.out(ctx)


class ParallelMLP(nn.Module):
    """The runtime of a dense MLP entry (`mlplat.specs.mlps`, model.mlp): its GEMMs built as the entry declares them
    (a column-parallel fc1, a row-parallel fc2), fc2(activate(fc1(x))); a subclass is an MLP's activation."""

    def __init__(self, cfg: ModelConfig, grid: ParallelGrid, kernels: KernelsConfig | None = None, device=None,
                 dtype=None, sequence_parallel: bool = False):
        super().__init__()
        self.spec = cfg.mlp_entry
        linear = {"column": ColumnParallelLinear, "row": RowParallelLinear}
        for gemm in self.spec.gemms:
            setattr(self, gemm.name, linear[gemm.split](
                gemm.inp(cfg.hidden, cfg.ffn), gemm.out(cfg.hidden, cfg.ffn), grid, bias=cfg.bias and gemm.bias,
                device=device, dtype=dtype, sequence_parallel=sequence_parallel))
            if gemm.parts > 1:  # gate and up: two matrices of the model in one GEMM (Muon's)
                getattr(self, gemm.name)._set_matrices(weight=interleaved_matrices(gemm.parts, cfg.ffn))
        self.approximate = GELU_APPROXIMATE[cfg.activation]
        self.set_kernels(kernels or KernelsConfig())

    def set_kernels(self, kernels: KernelsConfig) -> None:
        self.fused = kernels.fused
        for gemm in self.spec.gemms:
            getattr(self, gemm.name).skip_bias_add = kernels.fused

    def activate(self, fc1: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """fc2's input from fc1's output: with kernels.fused the pair (output without bias, bias)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor):
        """The MLP's output; with kernels.fused the pair (output without bias, bias)."""
        return self.fc2(self.activate(self.fc1(x)))


class GeLUMLP(ParallelMLP):
    """model.mlp=gelu: fc2(GeLU(fc1(x))), model.activation's GeLU."""

    def activate(self, fc1):
        if self.fused:
            return fused_bias_gelu(*fc1, approximate=self.approximate)
        return F.gelu(fc1, approximate=self.approximate)


class SwiGLUMLP(ParallelMLP):
    """model.mlp=swiglu: fc2(SiLU(gate)·up), with gate and up both from fc1, whose output rows alternate (row 2j is
    unit j's gate, 2j + 1 its up): a contiguous column split gives each tensor-parallel rank both halves of its
    units, and one GEMM computes them."""

    def activate(self, fc1):
        return fused_bias_swiglu(*fc1) if self.fused else bias_swiglu(fc1, None)


def make_mlp(cfg: ModelConfig, grid: ParallelGrid, kernels: KernelsConfig, device=None, dtype=None,
             sequence_parallel: bool = False, layer: int = 0) -> nn.Module:
    """model.mlp: the MLP of transformer layer `layer` (its entry's runtime, `mlplat.specs.mlps`; with
    model.moe.num_experts from layer model.moe.dense_layers on, a mixture of such experts:
    `mlplat.model.moe.MoELayer`). What the layer asks of it: forward(x) is its output, with kernels.fused the pair
    (output without its bias, the bias) for the fused bias+dropout+add; set_kernels(kernels) switches a built one's
    kernels."""
    dense = cfg.mlp_entry.runtime()
    if cfg.is_moe_layer(layer):
        moe = cfg.moe
        shared = None if not moe.shared_experts else dense(
            replace(cfg, ffn_hidden=moe.shared_experts * cfg.expert_ffn), grid, device=device, dtype=dtype,
            sequence_parallel=sequence_parallel)
        return MoELayer(cfg, grid, kernels, device=device, dtype=dtype, sequence_parallel=sequence_parallel,
                        approximate=GELU_APPROXIMATE[cfg.activation], shared=shared)
    return dense(cfg, grid, kernels, device=device, dtype=dtype, sequence_parallel=sequence_parallel)


def make_attention(cfg: ModelConfig, grid: ParallelGrid, tracker: RNGTracker, kernels: KernelsConfig, backend: str,
                   device=None, dtype=None, sequence_parallel: bool = False, rotary: Rotary | None = None,
                   ring: Ring | None = None) -> nn.Module:
    """The attention of a transformer layer, beside `make_mlp`: model.attention's entry's runtime
    (`mlplat.specs.attentions`; mha: `ParallelAttention`, multi-head attention with grouped-query K/V). What the
    layer asks of it: forward(x, layout) is its output, with kernels.fused the pair (output without its bias, the
    bias); set_kernels(kernels, backend) switches a built one's kernels."""
    return cfg.attention_entry.runtime()(cfg, grid, tracker, kernels, backend, device=device, dtype=dtype,
                                                   sequence_parallel=sequence_parallel, rotary=rotary, ring=ring)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + dropout(attn(norm1(x))), then + dropout(mlp(norm2(x))). With sequence parallelism x is
    this rank's [b, s/t, h] shard."""

    def __init__(self, cfg, grid: ParallelGrid, tracker, kernels, backend, device=None, dtype=None,
                 sequence_parallel: bool = False, rotary: Rotary | None = None, ring: Ring | None = None,
                 layer: int = 0):
        super().__init__()
        sp = sequence_parallel  # validation refuses it at t < 2
        self.ln1 = make_norm(cfg, device, dtype)
        self.attn = make_attention(cfg, grid, tracker, kernels, backend, device=device, dtype=dtype,
                                   sequence_parallel=sp, rotary=rotary, ring=ring)
        self.ln2 = make_norm(cfg, device, dtype)
        self.mlp = make_mlp(cfg, grid, kernels, device=device, dtype=dtype, sequence_parallel=sp, layer=layer)
        self.dropout = cfg.dropout
        self.fused = kernels.fused
        self.tracker = tracker
        self.sequence_parallel = sp
        if sp:
            mark_sequence_parallel_replicated(*self.ln1.parameters(), *self.ln2.parameters())

    def set_kernels(self, kernels: KernelsConfig, backend: str) -> None:
        self.fused = kernels.fused
        self.attn.set_kernels(kernels, backend)
        self.mlp.set_kernels(kernels)

    def _residual_rng(self):
        # Residual dropout: the default RNG, identical on all tp ranks, where the residual stream is replicated;
        # the tensor-parallel stream where it is a sequence shard (different tokens on each rank).
        return sequence_rng(self.tracker, self.sequence_parallel and self.training and self.dropout > 0)

    def forward(self, x: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        if self.fused:
            attn = self.attn(self.ln1(x), layout)
            with self._residual_rng():
                x = fused_bias_dropout_add(*attn, x, self.dropout, self.training)
            mlp = self.mlp(self.ln2(x))
            with self._residual_rng():
                return fused_bias_dropout_add(*mlp, x, self.dropout, self.training)
        attn = self.attn(self.ln1(x), layout)
        with self._residual_rng():
            x = x + F.dropout(attn, self.dropout, self.training)
        mlp = self.mlp(self.ln2(x))
        with self._residual_rng():
            return x + F.dropout(mlp, self.dropout, self.training)


class DecoderChunk(nn.Module):
    """One model chunk (virtual pipeline stage): a contiguous run of layers, plus embeddings/head at the ends."""

    # A middle chunk's output is a residual add, whose backward does not read it: once the output is sent, the
    # pipeline engine may free its storage and keep only its place in the graph.
    frees_sent_output = True
    # The logits GEMM's, as on the linear layers (mlplat.parallel.tensor): the zero-bubble W store the engine sets,
    # and the GEMM's products. Under zbv the last chunk's W adds into the first chunk's word embedding
    # (share_embedding_with): exact, since the gradient reducer launches buckets in backward order, so the first
    # chunk's wait for the last chunk's, launched after its last W.
    wgrad_store = None
    gemm = None

    def __init__(self, cfg: ModelConfig, grid: ParallelGrid, chunk: int, n_chunks: int,
                 kernels: KernelsConfig | None = None,
                 tracker: RNGTracker | None = None, backend: str = "math", device=None, dtype=None,
                 sequence_parallel: bool = False, layers: range | None = None):
        """`layers`: the global indices of the layers this chunk holds (`PipelineLayout.layers_of`); None: the
        chunk's share of an even split."""
        super().__init__()
        if layers is None:  # the layout's even split (a ValueError naming the rule when there is none)
            layers = PipelineLayout(n_chunks).layers_of(chunk, cfg.n_layers)
        kernels = kernels or KernelsConfig()
        cfg = arch_defaults(cfg)
        self.cfg, self.grid, self.chunk, self.n_chunks = cfg, grid, chunk, n_chunks
        self.tracker = tracker or RNGTracker()
        self.is_first, self.is_last = chunk == 0, chunk == n_chunks - 1
        self.full_recompute = kernels.recompute == "full"
        self.layer_ids = list(layers)
        self.sequence_parallel = sp = sequence_parallel
        vocab = cfg.padded_vocab(grid.tp)
        self.learned_positions = cfg.position == "learned"
        # One rotation for the chunk's layers; its tables are built once, for the positions the chunk sees.
        rotary = None if self.learned_positions else Rotary(cfg.attention_entry.rotary_width(cfg), cfg.rope_theta,
                                                            cfg.rope_scaling)
        self.ring = Ring(grid) if grid.cp > 1 else None  # one per chunk: its layers take turns on it
        if self.is_first:
            self.embedding = nn.Module()
            self.embedding.word = VocabParallelEmbedding(vocab, cfg.hidden, grid, device=device, dtype=dtype,
                                                         sequence_parallel=sp)
            if self.learned_positions:
                self.embedding.position = nn.Embedding(cfg.seq_len, cfg.hidden, device=device, dtype=dtype)
                if sp:  # added to this rank's positions only
                    mark_sequence_parallel_replicated(self.embedding.position.weight)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, grid, self.tracker, kernels, backend,
                                                              device=device, dtype=dtype, sequence_parallel=sp,
                                                              rotary=rotary, ring=self.ring, layer=i)
                                     for i in self.layer_ids})
        # kernels.fp8: the layers' GEMMs only, not the embedding or logits; their weight casts kept per step
        self.weight_casts = use_fp8(self.layers, kernels.fp8, grid)
        self.mtp = None
        if self.is_last:
            self.final_ln = make_norm(cfg, device, dtype)
            if sp:
                mark_sequence_parallel_replicated(*self.final_ln.parameters())
            if not cfg.tie_embeddings:  # an output layer of its own, split along the vocabulary
                self.output = VocabParallelOutput(vocab, cfg.hidden, grid, device=device, dtype=dtype)
            if not self.is_first and (cfg.tie_embeddings or cfg.mtp.enabled):
                # The word embedding (the tied output layer, the multi-token prediction's input embedding) lives on
                # another stage; keep a copy whose gradient is all-reduced with the first stage's over the
                # embedding group.
                self.lm_head = nn.Parameter(torch.empty(vocab // grid.tp, cfg.hidden, device=device, dtype=dtype))
                self.lm_head.partition_dim = 0  # type: ignore[attr-defined]
                self.lm_head.shared_copy = True  # counted once (on the first stage) in the gradient norm
            if cfg.mtp.enabled:  # module k's layer is layer l + k - 1 of the model (an MoE one if such would be)
                self.mtp = MultiTokenPrediction(
                    [MTPModule(lambda: make_norm(cfg, device, dtype),
                               TransformerLayer(cfg, grid, self.tracker, kernels, backend, device=device, dtype=dtype,
                                                sequence_parallel=sp, rotary=rotary, ring=self.ring,
                                                layer=cfg.n_layers + k),
                               cfg.hidden, device=device, dtype=dtype, sequence_parallel=sp)
                     for k in range(cfg.mtp.depth)], cfg.mtp.loss_coeff)

    def set_kernels(self, kernels: KernelsConfig, backend: str) -> None:
        """Switch attention backend, fusion, recomputation and FP8 of a built chunk (parameters are untouched)."""
        self.full_recompute = kernels.recompute == "full"
        for layer in [*self.layers.values(), *(m.layer for m in self.mtp or ())]:
            layer.set_kernels(kernels, backend)
        self.weight_casts = use_fp8(self.layers, kernels.fp8, self.grid)

    def output_embedding(self) -> torch.Tensor:
        return self.word_embedding() if self.cfg.tie_embeddings else self.output.weight

    def word_embedding(self) -> torch.Tensor:
        """The word embedding as this chunk reads it: its own (chunk 0), the first chunk's on this rank, or the
        copy `lm_head` (the last chunk of another rank)."""
        if self.is_first:
            return self.embedding.word.weight
        owner = self.__dict__.get("_embedding_owner")  # zbv: the first chunk lives on this rank too
        return owner.embedding.word.weight if owner is not None else self.lm_head

    def share_embedding_with(self, first: "DecoderChunk") -> None:
        """The last chunk on the rank of the first (zbv's V): use its word embedding itself, no copy.
        (Kept out of the module tree, so the parameter has one name, the first chunk's.)"""
        assert self.is_last and first.is_first
        del self.lm_head
        self.__dict__["_embedding_owner"] = first
        first.__dict__["_tied_locally"] = self.__dict__["_tied_locally"] = True

    def tied_parameters(self) -> list[nn.Parameter]:
        """Parameters that are one parameter of the full model held on two stages (the word embedding: first and
        last, which reads it as the tied output layer or the multi-token prediction's input embedding)."""
        if (self.grid.pp == 1 or not (self.cfg.tie_embeddings or self.cfg.mtp.enabled)
                or not (self.is_first or self.is_last) or self.__dict__.get("_tied_locally")):
            return []
        return [self.embedding.word.weight] if self.is_first else [self.lm_head]

    def sharding_units(self) -> list[nn.Module]:
        """The modules whose weights are gathered one at a time when parameters are sharded over data parallelism
        (`mlplat.optim.param_gather`), in forward order: the transformer layers, each read by itself only."""
        return [*self.layers.values(), *(m.layer for m in self.mtp or ())]

    @staticmethod
    def full_name(name: str) -> str:
        """The full-model name of a local parameter name."""
        return WORD_EMBEDDING if name == "lm_head" else name

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                layout: TokenLayout | None = None) -> torch.Tensor:
        """First chunk: token ids [b, s] in. Middle: hidden [b, s, h] in and out ([b, s/t, h], this rank's shard,
        with sequence parallelism). Last chunk: the mean loss over tokens when labels are given, else this rank's
        vocabulary shard of the logits [b, s, V/t]. With a `layout` (context parallelism, packed documents) s is
        this rank's tokens, placed and positioned as it says, and the loss is this rank's share of the
        micro-batch's mean over its counted labels (mlplat.parallel.context)."""
        if self.is_first:
            s = x.size(1)
            pos = torch.arange(s, device=x.device) if layout is None else layout.positions
            if self.sequence_parallel:
                shard = s // self.grid.tp
                pos = pos[..., self.grid.tp_rank * shard: (self.grid.tp_rank + 1) * shard]
            x = self.embedding.word(x)
            if self.learned_positions:
                x = x + self.embedding.position(pos)
            with sequence_rng(self.tracker, self.sequence_parallel and self.training and self.cfg.dropout > 0):
                x = F.dropout(x, self.cfg.dropout, self.training)
        for layer in self.layers.values():
            x = self._run_layer(layer, x, layout)
        if not self.is_last:
            return x
        logits = self._logits(self.final_ln(x))
        if labels is None:
            return logits
        if layout is None:
            loss = vocab_parallel_cross_entropy(logits, labels, self.grid, self.cfg.vocab_size).mean()
        else:
            counted = labels != IGNORE
            losses = vocab_parallel_cross_entropy(logits, labels.masked_fill(~counted, 0), self.grid,
                                                  self.cfg.vocab_size)
            # The cp ranks' gradients are averaged with the replicas': c times this rank's share of the sum.
            loss = (losses * counted).sum() * layout.cp / layout.loss_tokens.clamp_min(1)
        if self.mtp is not None:  # validation too: its depths' losses are reported
            extra = self.mtp(x, labels, self._mtp_embed, self._mtp_loss,
                             lambda layer, h: self._run_layer(layer, h, layout), layout)
            loss = loss + (extra - extra.detach())  # in the gradient, not the value (mlplat.model.mtp)
        return loss

    def _run_layer(self, layer: nn.Module, x: torch.Tensor, layout: TokenLayout | None) -> torch.Tensor:
        if self.full_recompute and self.training and torch.is_grad_enabled():
            return checkpoint(layer, self.tracker, x, layout)
        return layer(x, layout)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return parallel_lm_logits(hidden, self.output_embedding(), self.grid, sequence_parallel=self.sequence_parallel,
                                  store=self.wgrad_store, gemm=self.gemm)

    def _mtp_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(ids, self.word_embedding(), self.grid, self.sequence_parallel)

    def _mtp_loss(self, hidden: torch.Tensor, targets: torch.Tensor, total: torch.Tensor | None) -> torch.Tensor:
        """The mean cross-entropy of the output layer on `hidden` over the targets that count; with `total` (context
        parallelism: the window's count) this rank's share of the window's mean, times c (as the main loss)."""
        counted = targets != IGNORE
        losses = vocab_parallel_cross_entropy(self._logits(hidden), targets.masked_fill(~counted, 0), self.grid,
                                              self.cfg.vocab_size)
        if total is not None:
            return (losses * counted).sum() * self.grid.cp / total.clamp_min(1)
        return (losses * counted).sum() / counted.sum().clamp_min(1)


def build_rank_chunks(cfg: ModelConfig, grid: ParallelGrid, layout: PipelineLayout, *,
                      kernels: KernelsConfig | None = None, tracker: RNGTracker | None = None, backend: str = "math",
                      device=None, dtype=None, sequence_parallel: bool = False) -> dict[int, DecoderChunk]:
    """The chunks pipeline rank `grid.pp_rank` holds under `layout` (global chunk id -> chunk), uninitialised. When
    the first and the last chunk share a rank (zbv's V) the last uses the first's word embedding itself (the tied
    output layer, the multi-token prediction's input)."""
    chunks = {c: DecoderChunk(cfg, grid, c, layout.num_chunks, kernels=kernels, tracker=tracker, backend=backend,
                              device=device, dtype=dtype, sequence_parallel=sequence_parallel,
                              layers=layout.layers_of(c, cfg.n_layers))
              for c in layout.chunks_of(grid.pp_rank)}
    first, last = chunks.get(0), chunks.get(layout.last_chunk)
    if (first is not None and last is not None and first is not last
            and (first.cfg.tie_embeddings or first.cfg.mtp.enabled)):
        last.share_embedding_with(first)
    return chunks


def parameter_count(chunks: list[DecoderChunk]) -> int:
    return sum(p.numel() for c in chunks for p in c.parameters())

