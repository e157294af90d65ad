"""FLOP formulas and the closed-form parameter count of mlplat's model, GPT (the paper's) and the Llama family.

Notation (Narayanan et al., SC21, §5.1 and Appendix): B global batch, s sequence length, l layers,
h hidden size, V (padded) vocabulary, a heads, t tensor-parallel size. For the Llama family also: k key/value
heads (grouped-query attention; k = a is multi-head attention), d the head size (h/a unless model.head_dim sets it,
as Qwen3's 128: then the queries' width a·d need not be h), f the MLP width.

FLOPs per iteration, counting only GEMMs (a multiply-add = 2 FLOPs):
  model FLOPs (forward + backward, no recomputation)  72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))
  with full activation recomputation                   96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))
The paper's Table 1 teraFLOP/s count the recomputation (the 96 formula) -- "hardware FLOPs". MFU uses the
model FLOPs (72 formula), as PaLM and everyone since define it.

Any architecture (`model_flops_per_token`): 6·N + 12·l·h·s per token, N the weights of the GEMMs (each layer's
QKV, output projection and MLP matrices, plus the output layer V·h; no embedding lookup, bias or norm) and
12·l·a·d·s the attention scores QKᵀ and their product with V over the whole s×s square (the paper's count, not
the causal half a causal kernel executes; the query width a·d, h unless model.head_dim is set, so grouped-query
attention leaves it alone).
For GPT (N = l·12h² + V·h) this is the 72 formula divided by B·s, term for term.

Multi-token prediction (model.mtp.depth D, mlplat.model.mtp) adds, per module, a layer (layer l + k - 1: an MoE
one where the model's layers there hold experts), its projection 2h·h and one more pass through the output layer, all
over the s positions: N grows by D·(2h² + N_layer + V·h) and the attention term by D layers' (`mtp_gemm_weights`).
"""
from __future__ import annotations

from dataclasses import FrozenInstanceError, asdict, fields, replace
from typing import Any, Mapping

from mlplat.config import ARCHS, ModelConfig, arch_defaults
from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.specs import attentions
from mlplat.specs.attentions import Heads


class ModelDims(ModelConfig):
    """A resolved `ModelConfig`, frozen: every null set as a run sets it (model.arch's defaults, `arch_defaults`, an
    unknown arch taking GPT's; the MLP width; the KV heads; the byte tokenizer's vocabulary of 256 while the data's
    is not resolved), plus the shape facts the formulas read. Built from the keys, the paper's l, h, a, s, V first
    (`ModelDims(48, 4096, 32, 2048, 51200)`, the paper's GPT by default), or from a run's `model.*` (`of`,
    `from_config`)."""

    def __init__(self, n_layers: int, hidden: int, n_heads: int, seq_len: int, vocab_size: int | None = None,
                 **keys: Any):
        model = ModelConfig(n_layers=n_layers, hidden=hidden, n_heads=n_heads, seq_len=seq_len,
                            vocab_size=256 if vocab_size is None else vocab_size, **keys)
        known = arch_defaults(model if model.arch in ARCHS else replace(model, arch="gpt"))
        self.__dict__.update(known.__dict__, arch=model.arch, ffn_hidden=known.ffn, n_kv_heads=known.kv_heads)

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __hash__(self) -> int:
        return hash(repr(self))

    @property
    def kv_width(self) -> int:
        """k·d: the width of the key projection (and of the value projection)."""
        return self.kv_heads * self.head_size

    @property
    def qkv_width(self) -> int:
        """(a + 2k)·d: the QKV projection's output width (3h without grouped-query attention)."""
        return self.attention_width + 2 * self.kv_width

    @property
    def heads(self) -> Heads:
        """The attention's head shape, its GEMMs' `w` (multi-head: `Heads`; MLA: `attentions.Latent`)."""
        return self.attention_entry.shape(self)

    @property
    def score_flops(self) -> int:
        """Forward FLOPs of the attention core per token and key (4·a·d: QKᵀ and scores·V)."""
        return self.attention_entry.core_flops(self)

    def gemm_shapes(self) -> list[tuple[int, int, bool | None]]:
        """(out, in, column) of each of a dense layer's GEMMs, whole, attention's then the MLP's in the order a token
        meets them (their entries', the ones this model builds); `column`: its out is split over the t ranks, False
        its in, None neither (a replicated GEMM, MLA's down-projections)."""
        attention = self.attention_entry.gemms_of(self)
        return [(g.out(self.hidden, w), g.inp(self.hidden, w),
                 None if g.split == "replicated" else g.split == "column")
                for gemms, w in ((attention, self.heads), (self.mlp_entry.gemms, self.ffn)) for g in gemms]

    @property
    def fc1_width(self) -> int:
        """fc1's output width: f (gelu), 2f (swiglu: gate and up in one GEMM)."""
        return self.mlp_entry.fc1_width(self.hidden, self.ffn)

    @property
    def has_qkv_bias(self) -> bool:
        return bool(self.qkv_bias)  # resolved: model.bias when null

    @property
    def norm_parameters(self) -> int:
        """One norm over h: weight, and a bias for a LayerNorm with model.bias."""
        return self.hidden * (2 if self.norm == "layernorm" and self.bias else 1)

    @property
    def attention_gemm_weights(self) -> int:
        """The attention's GEMMs (its entry's): QKV and the output projection, h·(a + 2k)·d + a·d·h."""
        return self.attention_entry.weights(self.hidden, self.heads)

    @property
    def layer_gemm_weights(self) -> int:
        """Weights of one dense layer's GEMMs: h·(a + 2k)·d + a·d·h + the MLP's (h·(f or 2f) + f·h; 12h² for the
        paper's GPT)."""
        return self.attention_gemm_weights + self.mlp_entry.weights(self.hidden, self.ffn)

    # -- mixture of experts (model.moe.*, mlplat.model.moe) ---------------------------------------------------
    @property
    def moe_layers(self) -> int:
        """Layers holding experts: l - model.moe.dense_layers, 0 without experts."""
        return self.n_layers - self.moe.dense_layers if self.moe.enabled else 0

    @property
    def expert_gemm_weights(self) -> int:
        """One expert's fc1 and fc2: h·(f_e or 2f_e) + f_e·h (f_e = model.moe.ffn_hidden resolved)."""
        return self.mlp_entry.weights(self.hidden, self.expert_ffn)

    @property
    def moe_layer_gemm_weights(self) -> int:
        """The GEMM weights one token of an MoE layer multiplies: attention, the router E·h, its k experts, the
        shared experts (and their gate h)."""
        moe = self.moe
        shared = moe.shared_experts * self.expert_gemm_weights + (self.hidden if moe.shared_gate else 0)
        return (self.attention_gemm_weights + moe.num_experts * self.hidden + moe.top_k * self.expert_gemm_weights
                + shared)

    @property
    def active_gemm_weights(self) -> int:
        """Σ over the l layers of the GEMM weights a token multiplies (the active ones in MoE layers)."""
        dense = self.n_layers - self.moe_layers
        return dense * self.layer_gemm_weights + self.moe_layers * self.moe_layer_gemm_weights

    # -- multi-token prediction (model.mtp.*, mlplat.model.mtp) ---------------------------------------------
    @property
    def mtp_gemm_weights(self) -> int:
        """The GEMM weights a token multiplies in one multi-token prediction module, the output layer aside: its
        projection 2h·h and its layer's (layer l + k - 1: the active ones where the model's layers there hold
        experts)."""
        layer = self.moe_layer_gemm_weights if self.is_moe_layer(self.n_layers) else self.layer_gemm_weights
        return 2 * self.hidden * self.hidden + layer

    @property
    def embedding_at_head(self) -> bool:
        """Whether the last chunk reads the word embedding (the tied output layer, or the modules' input embedding):
        a copy of it when the last chunk lives on another pipeline rank than the first."""
        return bool(self.tie_embeddings) or self.mtp.enabled

    @property
    def is_paper_gpt(self) -> bool:
        """Layers of the paper's shape (12h² GEMM weights: multi-head attention, a GeLU MLP of 4h), for which the
        paper's closed FLOP formulas are used as printed (not with multi-token prediction modules)."""
        return (self.layer_gemm_weights == 12 * self.hidden * self.hidden and self.attention_width == self.hidden
                and self.attention == attentions.DEFAULT and not self.moe_layers and not self.mtp.enabled)

    @property
    def label(self) -> str:
        """The architecture's name in a summary line: GPT, Llama."""
        return {"gpt": "GPT", "llama": "Llama"}.get(self.arch, self.arch)

    @classmethod
    def of(cls, model: ModelConfig) -> "ModelDims":
        """A run's `model.*`, resolved (model.vocab_size null: 256 until the data's tokenizer resolves it)."""
        return cls(**{f.name: getattr(model, f.name) for f in fields(ModelConfig)})

    @classmethod
    def from_config(cls, model: Mapping[str, Any]) -> "ModelDims":
        """From a `model.*` mapping (e.g. a conf/model/ file), read as the run config reads it."""
        from mlplat.config import from_dict

        return cls.of(from_dict({"model": dict(model)}).model)

    def config_keys(self) -> dict[str, Any]:
        """The `model.*` keys that rebuild these dims through `from_config` (a plan's "model" section)."""
        return {"arch": self.arch, "n_layers": self.n_layers, "hidden": self.hidden, "n_heads": self.n_heads,
                "n_kv_heads": self.kv_heads, **({"head_dim": self.head_dim} if self.head_dim else {}),
                "seq_len": self.seq_len, "vocab_size": self.vocab_size,
                "ffn_hidden": self.ffn, "vocab_pad_multiple": self.vocab_pad_multiple, "position": self.position,
                "norm": self.norm, "mlp": self.mlp, "tie_embeddings": self.tie_embeddings, "bias": self.bias,
                "qkv_bias": self.has_qkv_bias, "dropout": self.dropout, **({"qk_norm": True} if self.qk_norm else {}),
                **({"rotary_dim": self.rotary_dim} if self.rotary_dim else {}),
                **({"attention": self.attention} if self.attention != attentions.DEFAULT else {}),
                **({"mla": asdict(self.mla)} if self.attention == "mla" else {}),
                **({"moe": asdict(self.moe)} if self.moe.enabled else {}),
                **({"mtp": asdict(self.mtp)} if self.mtp.enabled else {})}


# ---------------------------------------------------------------------------------------------- parameters

def layer_parameters_of(dims: ModelDims, tp: int = 1, layer: int = 0) -> int:
    """Parameters of transformer layer `layer` of `dims` held by one tensor-parallel rank.

    The attention's, as model.attention's entry counts them (`Attention.parameters`; multi-head attention: QKV
    h·(a + 2k)·d + its bias split, out a·d·h split and its bias h replicated, the q/k norms d each replicated; fewer
    key/value heads than ranks, k < t: each rank holds a whole one, 2d rows of QKV, t·2d over the ranks). Split over
    the t ranks: fc1 h·f or h·2f for SwiGLU (+ bias, column-parallel), fc2 f·h (row-parallel). Replicated: the two
    norms (LayerNorm 2h with biases, h without; RMSNorm h), fc2's bias (h, with biases).
    An MoE layer (`ModelDims.is_moe_layer`) holds, instead of the MLP, E experts' fc1 and fc2 (split over t, no
    biases), the shared experts' MLP (as the dense one, of width shared_experts·f_e) and, replicated, the router
    E·h and the shared experts' gate h.
    """
    h, ffn = dims.hidden, dims.ffn
    sharded, replicated = dims.attention_entry.parameters(dims, tp)
    replicated += 2 * dims.norm_parameters  # the two norms
    if dims.is_moe_layer(layer):
        moe, f = dims.moe, dims.expert_ffn
        shared = moe.shared_experts * f  # the shared MLP's width
        sharded += (moe.num_experts + moe.shared_experts) * dims.expert_gemm_weights
        if shared and dims.bias:
            split, whole = dims.mlp_entry.biases(h, shared)  # fc1's, fc2's
            sharded, replicated = sharded + split, replicated + whole
        replicated += moe.num_experts * h + (h if moe.shared_gate else 0)
    else:
        split, whole = dims.mlp_entry.biases(h, ffn) if dims.bias else (0, 0)  # fc1's, fc2's
        sharded += dims.mlp_entry.weights(h, ffn) + split
        replicated += whole
    assert sharded % tp == 0, f"layer of hidden {h} / ffn {ffn} / heads {dims.heads} does not split over t={tp}"
    return sharded // tp + replicated


def layer_parameters(h: int, tp: int = 1, ffn: int | None = None) -> int:
    """Parameters of one layer of the paper's GPT held by one tensor-parallel rank.

    LN1 (2h) + QKV (3h·h + 3h, column-parallel) + attention out (h·h row-parallel, bias h replicated)
    + LN2 (2h) + MLP fc1 (h·ffn + ffn, column-parallel) + fc2 (ffn·h row-parallel, bias h replicated).
    With t = 1 and ffn = 4h: 12h² + 13h. Other architectures: `layer_parameters_of`.
    """
    # The head count matters only below t (shared key/value heads): h heads of size 1 keep every t above it.
    return layer_parameters_of(ModelDims(1, h, h, 1, 1, ffn_hidden=ffn or 4 * h), tp)


def embedding_parameters(dims: ModelDims, tp: int = 1) -> int:
    """Word embedding shard [V_pad/t, h] + the learned position embedding [s, h] (replicated; none under RoPE)."""
    v = dims.padded_vocab(tp)
    return v // tp * dims.hidden + (dims.seq_len * dims.hidden if dims.position == "learned" else 0)


def head_parameters(dims: ModelDims, tp: int = 1) -> int:
    """The last chunk's own parameters past its layers: the final norm, the untied output layer's shard
    [V_pad/t, h] (vocab-parallel) when the embeddings are not tied, and the multi-token prediction modules
    (`mtp_parameters`). A copy of the word embedding is not counted here (`stage_parameters` adds it on the GPU
    that holds it)."""
    out = 0 if dims.tie_embeddings else dims.padded_vocab(tp) // tp * dims.hidden
    return dims.norm_parameters + out + mtp_parameters(dims, tp)


def mtp_parameters(dims: ModelDims, tp: int = 1) -> int:
    """The multi-token prediction modules' parameters on one tensor-parallel rank: each module's layer (layer
    l + k - 1 of `layer_parameters_of`), and replicated over t its projection 2h·h and three norms (0 for D = 0)."""
    own = 2 * dims.hidden * dims.hidden + 3 * dims.norm_parameters
    return sum(layer_parameters_of(dims, tp, dims.n_layers + k) + own for k in range(dims.mtp.depth))


def parameter_count(dims: ModelDims, tp: int = 1, padded: bool = True) -> int:
    """Total parameters of the full model, each once: l layers + word embedding V_pad·h + positions s·h (learned
    only) + the final norm + the output layer V_pad·h when untied (a tied one is the word embedding, counted
    once) + the multi-token prediction modules. The paper's GPT: l·(12h² + 13h) + V_pad·h + s·h + 2h. `tp` only
    changes the vocabulary padding; `padded=False` counts the tokenizer's V instead (what transformers counts: it
    pads nothing)."""
    v = dims.padded_vocab(tp) if padded else dims.vocab_size
    vocab_tables = 1 if dims.tie_embeddings else 2
    return (sum(layer_parameters_of(dims, 1, i) for i in range(dims.n_layers)) + vocab_tables * v * dims.hidden
            + (dims.seq_len * dims.hidden if dims.position == "learned" else 0) + dims.norm_parameters
            + mtp_parameters(dims))


def stage_parameters(dims: ModelDims, tp: int, pipeline: PipelineLayout) -> list[int]:
    """Parameters on one GPU (tensor-parallel rank 0) of each pipeline rank.

    Each rank holds its chunks' layers (`PipelineLayout.chunk_layers`: l/(p·v) each, or uneven); chunk 0 adds
    the embeddings, the last chunk the final norm, the output layer (untied, its own [V_pad/t, h] shard) and the
    multi-token prediction modules; when the last chunk lives on another rank than chunk 0 and reads the word
    embedding (tied, or as the modules' input embedding), a copy of it (summed with the first stage's gradient),
    so that copy counts on both GPUs but once in the total.
    """
    v_shard = dims.padded_vocab(tp) // tp * dims.hidden
    first, last = pipeline.owner(0), pipeline.owner(pipeline.last_chunk)
    tied_copy = v_shard if dims.embedding_at_head and last != first else 0
    out = []
    for r in range(pipeline.pp):
        n = sum(layer_parameters_of(dims, tp, i) for c in pipeline.chunks_of(r)
                for i in pipeline.layers_of(c, dims.n_layers))
        if r == first:
            n += embedding_parameters(dims, tp)
        if r == last:
            n += head_parameters(dims, tp) + tied_copy
        out.append(n)
    return out


def routed_expert_parameters(dims: ModelDims, layer: int = 0) -> int:
    """The routed experts' weights of layer `layer`, all E of them, whole: E·(h·(f_e or 2f_e) + f_e·h) (0 in a
    dense layer). Under expert parallelism they are the part of a layer folded over etp·ep ranks, not over t."""
    return dims.moe.num_experts * dims.expert_gemm_weights if dims.is_moe_layer(layer) else 0


def stage_expert_parameters(dims: ModelDims, pipeline: PipelineLayout) -> list[int]:
    """The routed experts' weights, whole, of each pipeline rank's layers (`routed_expert_parameters`), the
    multi-token prediction modules' layers on the last chunk's rank included."""
    last = pipeline.owner(pipeline.last_chunk)
    return [sum(routed_expert_parameters(dims, i) for c in pipeline.chunks_of(r)
                for i in pipeline.layers_of(c, dims.n_layers))
            + (sum(routed_expert_parameters(dims, dims.n_layers + k) for k in range(dims.mtp.depth)) if r == last
               else 0) for r in range(pipeline.pp)]


# ---------------------------------------------------------------------------------------------- FLOPs

def forward_flops_per_sequence(dims: ModelDims, tp: int = 1) -> tuple[float, float, float]:
    """(layer GEMMs, attention scores, logits) FLOPs of one sequence's forward, all l layers, any architecture:
    2·s·l·N_layer (N_layer = `layer_gemm_weights`; with experts, Σ over layers of the active weights,
    `active_gemm_weights`: the router and the k experts a token goes to, at perfect balance, no dispatch cost),
    4·s²·a·d·l (the attention core over the s×s square, its entry's `score_flops` per token and key: QKᵀ and
    scores·V; a·d = h unless model.head_dim is set), 2·s·h·V. The D multi-token prediction modules add theirs to
    each: 2·s·D·`mtp_gemm_weights` (counted with the layers, also where full recomputation repeats the layer but
    not the projection), D layers' attention core, D more passes through the output layer."""
    s, l, h, D = dims.seq_len, dims.n_layers, dims.hidden, dims.mtp.depth
    V = dims.padded_vocab(tp)
    return (2.0 * s * (dims.active_gemm_weights + D * dims.mtp_gemm_weights),
            1.0 * s * s * dims.score_flops * (l + D), 2.0 * s * h * V * (1 + D))


def model_flops_per_iteration(dims: ModelDims, global_batch: int, tp: int = 1) -> float:
    """Forward + backward, no recomputation (use for MFU). The paper's GPT: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))
    as printed; any other shape: 3 × the forward's GEMMs (`forward_flops_per_sequence`), which is the same sum."""
    B, s, l, h = global_batch, dims.seq_len, dims.n_layers, dims.hidden
    V = dims.padded_vocab(tp)
    if dims.is_paper_gpt:
        return 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    return 3.0 * B * sum(forward_flops_per_sequence(dims, tp))


def hardware_flops_per_iteration(dims: ModelDims, global_batch: int, recompute: str = "full", tp: int = 1) -> float:
    """FLOPs the GPUs actually execute, the paper's convention for its teraFLOP/s.

    full:      96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) (one extra forward of every layer, not of the logits); any
               other shape: 4 × the layers' forward + 3 × the logits'
    selective: model FLOPs + the recomputed attention core, 4·B·s²·a·d per layer (QKᵀ and attention·V)
    none:      model FLOPs
    """
    B, s, l, h = global_batch, dims.seq_len, dims.n_layers, dims.hidden
    V = dims.padded_vocab(tp)
    if recompute == "full":
        if dims.is_paper_gpt:
            return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        layers, scores, logits = forward_flops_per_sequence(dims, tp)
        return B * (4.0 * (layers + scores) + 3.0 * logits)
    base = model_flops_per_iteration(dims, global_batch, tp)
    if recompute == "selective":
        return base + 1.0 * B * s * s * dims.score_flops * (l + dims.mtp.depth)
    if recompute == "none":
        return base
    raise ValueError(f"kernels.recompute={recompute!r} is not one of none, selective, full")


def gemm_parameters(dims: ModelDims, tp: int = 1) -> int:
    """N of 6·N: the weights every token multiplies, l·N_layer + V_pad·h (the output layer, tied or not; with
    experts the active ones, `active_gemm_weights`), and per multi-token prediction module its GEMMs
    (`mtp_gemm_weights`) and the output layer once more. Not counted: the word embedding's lookup (no GEMM), the
    position table, biases and norm weights."""
    D = dims.mtp.depth
    return dims.active_gemm_weights + D * dims.mtp_gemm_weights + (1 + D) * dims.padded_vocab(tp) * dims.hidden


def model_flops_per_token(dims: ModelDims, tp: int = 1) -> float:
    """6·N + 12·l·a·d·s: the model FLOPs of one token of a length-s sequence, forward and backward.

    N = `gemm_parameters` (every layer's GEMM weights and the output layer, V padded as the GEMM runs); 12·l·a·d·s
    the attention scores over the full s×s square (non-causal, the paper's convention: a causal kernel executes
    half). For the paper's GPT it equals 72·l·h²·(1 + s/(6h) + V/(12·l·h)).
    """
    return 6.0 * gemm_parameters(dims, tp) + 3.0 * (dims.n_layers + dims.mtp.depth) * dims.score_flops * dims.seq_len


def tflops_per_gpu(flops: float, seconds: float, n_gpus: int) -> float:
    return flops / seconds / n_gpus / 1e12


def model_tflops_per_gpu(tokens_per_s: float, n_gpus: int, dims: ModelDims, tp: int = 1) -> float:
    """tokens/s (whole job) -> model TFLOP/s per GPU."""
    return tokens_per_s * model_flops_per_token(dims, tp) / n_gpus / 1e12


def mfu(tokens_per_s: float, n_gpus: int, dims: ModelDims, peak_flops_per_gpu: float, tp: int = 1) -> float:
    """Model FLOPs utilisation: model FLOP/s achieved / peak FLOP/s, both per GPU."""
    return model_tflops_per_gpu(tokens_per_s, n_gpus, dims, tp) * 1e12 / peak_flops_per_gpu
