"""The attentions, one entry each (the value of `model.attention`): everything mlplat knows about an attention, in one
place, as `mlplat.specs.mlps` is for the MLPs.

Pure data, no torch. An entry declares its GEMMs (`mlplat.specs.blocks.Gemm`, their shapes functions of the hidden
size h and the head shape `Heads`: a query heads, k key/value heads, d channels each), which of them holds the K/V
heads (with fewer K/V heads than tensor-parallel ranks each rank holds a whole one, replicated), its replicated norms,
the FLOPs of its core per token and key, the activations it keeps for the backward, its rules on the other model keys,
whether the Hugging Face names map it, and where its runtime lives (`impl`). From the entry the config accepts the name
and checks its rules, the model builds it (`mlplat.model.decoder.make_attention`), the closed forms count its
parameters and FLOPs (`mlplat.perf.flops`), the cost and memory models charge its GEMMs and kept activations
(`mlplat.perf`), and the Hugging Face export and init_from refuse an attention transformers does not compute.

The runtime's contract (`mlplat.model.decoder.ParallelAttention` and `mlplat.model.mla.LatentAttention` implement
it): built as impl(cfg, grid, tracker, kernels, backend, device=, dtype=, sequence_parallel=, rotary=, ring=) with its
GEMMs as submodules named as the entry names them; forward(x, layout) is its output, with kernels.fused the pair
(output without its bias, the bias); set_kernels(kernels, backend) switches a built one's kernels.

Adding an attention is its runtime class plus one `register(Attention(...))`; `registered` adds one for the length of
a `with` block (a test's toy attention, tests/model/test_attentions.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from mlplat.specs.blocks import Gemm, no_rules
from mlplat.specs.registry import Part, Registry

ModelConfig = Any  # a mlplat.config.ModelConfig, its nulls resolved: the config imports this module

DEFAULT = "mha"


@dataclass(frozen=True)
class Heads:
    """The head shape an attention's GEMMs are functions of (their `w`)."""

    a: int  # query heads
    k: int  # key/value heads
    d: int  # channels per head

    @property
    def q(self) -> int:
        """a·d: the queries' width, the attention output's."""
        return self.a * self.d

    @property
    def kv(self) -> int:
        """k·d: the keys' width (and the values')."""
        return self.k * self.d

    @classmethod
    def of(cls, model: ModelConfig) -> "Heads":
        return cls(model.n_heads, model.kv_heads, model.head_size)


def _qk_norms(model: ModelConfig) -> tuple[int, ...]:
    """model.qk_norm (Qwen3): an RMSNorm of d channels on q and one on k, each shared by the heads."""
    return (model.head_size, model.head_size) if model.qk_norm else ()


def _score_flops(heads: Heads) -> int:
    """QKᵀ and scores·V: 2·a·d multiply-adds per token and key, over the whole s×s square (the paper's count, not the
    causal half a causal kernel executes)."""
    return 4 * heads.q


@dataclass(frozen=True)
class Attention(Part):
    # In the order a token meets them, functions of (h, Heads); the last one is the row-parallel output projection
    gemms: tuple[Gemm, ...]
    # model -> its kept activations per token, in bytes of 2-byte tensors per h, split over the t ranks (the memory
    # model's units, `mlplat.perf.memory.sharded_activation_units`); (model, t): K/V count as max(k, t) heads
    kept: Callable[[ModelConfig, int], float]
    # The GEMM whose output rows are the K/V heads' (laid out by head group): with fewer K/V heads than t each rank
    # holds a whole one, 2d rows of it replicated on the t/k ranks sharing it
    kv_gemm: str = "qkv"
    # model -> the replicated norms' widths (each a tensor of its own)
    norms: Callable[[ModelConfig], tuple[int, ...]] = _qk_norms
    # Heads -> forward FLOPs of its core per token and key it attends (× s: per token)
    core: Callable[[Heads], int] = _score_flops
    # (model, t) -> what it keeps under kernels.recompute=selective where that recomputes more than the core (MLA: its
    # up-projections too), in `kept`'s units; None: `kept` (the core keeps nothing either way)
    kept_selective: Callable[[ModelConfig, int], float] | None = None
    # model -> what it refuses, one line each
    rules: Callable[[ModelConfig], Iterable[str]] = no_rules
    # transformers' classes compute it: mlplat.checkpoint.hf's names map its modules
    hf: bool = False
    # model -> the head shape its GEMMs and core are functions of (their `w`)
    shape: Callable[[ModelConfig], Any] = Heads.of
    # model -> the channels of a head the rotary embedding turns; None: the whole head (model.head_dim resolved)
    rotary_dim: Callable[[ModelConfig], int] | None = None
    # model -> (a query/key head's channels, a value head's): what the attention kernels are handed
    head_dims: Callable[[ModelConfig], tuple[int, int]] = lambda m: (m.head_size, m.head_size)
    # model -> the elements per token a context-parallel ring hop carries per tensor-parallel rank, over all the
    # heads (K and V: 2·max(k, t)·d at t; `mlplat.perf.memory.kv_block_bytes` divides by t)
    ring_width: Callable[[ModelConfig, int], int] = lambda m, tp: 2 * max(m.kv_heads, tp) * m.head_size
    # The GEMM a context-parallel ring runs on every block it receives, its input being what the ring carries (MLA's
    # kv_up), or None
    ring_gemm: str | None = None

    def gemm(self, name: str) -> Gemm:
        return next(g for g in self.gemms if g.name == name)

    def gemms_of(self, model: ModelConfig) -> tuple[Gemm, ...]:
        """The GEMMs `model` builds: those of a non-empty weight (MLA without query compression has no q_down)."""
        h, w = model.hidden, self.shape(model)
        return tuple(g for g in self.gemms if g.weights(h, w))

    def rotary_width(self, model: ModelConfig) -> int:
        """The channels of a head the rotary embedding turns (the chunk's `Rotary` is built for this many)."""
        return model.rotary_channels if self.rotary_dim is None else self.rotary_dim(model)

    def rows(self, gemm: Gemm, h: int, heads: Heads, tp: int = 1) -> int:
        """`gemm`'s output rows over all t ranks: the K/V GEMM's replicated K/V heads counted on each rank."""
        extra = 2 * heads.d * max(0, tp - heads.k) if gemm.name == self.kv_gemm else 0
        return gemm.out(h, heads) + extra

    def weights(self, h: int, heads: Heads) -> int:
        """Its GEMMs' weights, each once."""
        return sum(g.weights(h, heads) for g in self.gemms)

    def parameters(self, model: ModelConfig, tp: int = 1) -> tuple[int, int]:
        """(split over the t ranks, summed over them; replicated on each) of one layer's attention: its GEMMs' weights
        and a column GEMM's bias split (the K/V GEMM's replicated rows on each rank sharing them), a row GEMM's bias,
        a replicated GEMM (MLA's down-projections) and the norms replicated."""
        h, heads = model.hidden, self.shape(model)
        split = replicated = 0
        for g in self.gemms_of(model):
            rows = self.rows(g, h, heads, tp)
            if g.split == "replicated":
                replicated += rows * g.inp(h, heads) + (rows if g.has_bias(model) else 0)
                continue
            split += rows * g.inp(h, heads)
            if g.has_bias(model):
                if g.split == "column":
                    split += rows
                else:
                    replicated += rows
        return split, replicated + sum(self.norms(model))

    def tensors(self, model: ModelConfig) -> int:
        """Its parameter tensors in one layer: the GEMMs' weights, their biases, the norms."""
        return sum(1 + g.has_bias(model) for g in self.gemms_of(model)) + len(self.norms(model))

    def core_flops(self, model: ModelConfig) -> int:
        """Forward FLOPs of its core per token and key it attends."""
        return self.core(self.shape(model))

    def violations(self, model: ModelConfig) -> list[str]:
        return list(self.rules(model))


_ENTRIES: Registry[Attention] = Registry("attention", "model.attention")
register, unregister, registered = _ENTRIES.register, _ENTRIES.unregister, _ENTRIES.registered
names, get = _ENTRIES.names, _ENTRIES.get


def qkv_and_out() -> tuple[Gemm, ...]:
    """QKV h -> (a + 2k)·d, column-parallel, its bias per model.qkv_bias; the output projection a·d -> h,
    row-parallel, its bias per model.bias."""
    return (Gemm("qkv", lambda h, w: w.q + 2 * w.kv, lambda h, w: h, "column", bias_key="qkv_bias"),
            Gemm("out", lambda h, w: h, lambda h, w: w.q, "row"))


def mha_kept(model: ModelConfig, tp: int = 1) -> float:
    """What multi-head attention keeps, per s·b·h in bytes of 2-byte tensors over the t ranks: Korthikanti's 8 (Q, K,
    V: 6; the output projection's input: 2) at a·d = h without grouped-query attention. The QKV output 2·(q + 2r) (Q,
    K and V are views of it; q = a·d/h, r = max(k, t)·d/h: fewer K/V heads than t, each rank computes a whole one);
    rotary embeddings keep the rotated Q and K besides, 2·(q + r); a grouped Q without rotary is copied by its head
    regrouping, 2q; the output projection's input 2q. The score matrix (unfused kernels) is counted apart, with the
    kernel (`mlplat.perf.memory`)."""
    h = model.hidden
    q, r = model.attention_width / h, max(model.kv_heads, tp) * model.head_size / h
    qkv = 2 * (q + 2 * r)
    if model.position == "rope":
        qkv += 2 * (q + r)
    elif model.kv_heads != model.n_heads:
        qkv += 2 * q
    return qkv + 2 * q


def _mha_rules(model: ModelConfig) -> Iterable[str]:
    if model.n_kv_heads is not None and model.n_kv_heads >= 1 and model.n_heads % model.n_kv_heads:
        yield (f"model.n_heads={model.n_heads} is not divisible by model.n_kv_heads={model.n_kv_heads} (each "
               f"key/value head serves a whole group of heads)")


# Vaswani et al. 2017, with Ainslie et al. 2023's grouped key/value heads (model.n_kv_heads; 1: multi-query)
register(Attention(DEFAULT, "multi-head attention", "mlplat.model.decoder:ParallelAttention", qkv_and_out(), mha_kept,
                   rules=_mha_rules, hf=True))


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention's head shape (DeepSeek-V2 §2.1; model.mla.*): a query heads, each with q and k
    of nope + rope channels and v of its own width; the latents' widths (q_rank 0: no query compression)."""

    a: int  # query heads (every one with its own key and value head)
    q_rank: int  # the query latent's width (d'_c); 0: the queries come from h directly
    kv_rank: int  # the key/value latent's width (d_c)
    nope: int  # a query/key head's channels without rotary embedding
    rope: int  # its rotated channels (d^R_h); the key's are one head broadcast to all
    v: int  # a value head's channels

    @property
    def k(self) -> int:
        return self.a  # every head has its own key and value (the up-projection's), none replicated

    @property
    def d(self) -> int:
        return self.nope + self.rope  # a query/key head's channels

    @classmethod
    def of(cls, model: ModelConfig) -> "Latent":
        m = model.mla
        return cls(model.n_heads, m.q_lora_rank or 0, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
                   m.v_head_dim)


def latent_gemms() -> tuple[Gemm, ...]:
    """MLA's GEMMs, in transformers' DeepseekV3Attention row layout: the query's down-projection h -> q_rank
    (replicated) and up-projection q_rank -> a·(nope + rope) (column-parallel; rows per head [nope | rope]), or without
    query compression one projection h -> a·(nope + rope); the key/value down-projection h -> kv_rank + rope
    (replicated: [c_kv | k_rope]) and up-projection kv_rank -> a·(nope + v) (column-parallel; rows per head
    [k_nope | v]); the output projection a·v -> h (row-parallel, its bias per model.bias). No other biases."""
    return (Gemm("q_down", lambda h, w: w.q_rank, lambda h, w: h if w.q_rank else 0, "replicated", bias=False),
            Gemm("q_up", lambda h, w: w.a * w.d if w.q_rank else 0, lambda h, w: w.q_rank, "column", bias=False),
            Gemm("q", lambda h, w: 0 if w.q_rank else w.a * w.d, lambda h, w: h, "column", bias=False),
            Gemm("kv_down", lambda h, w: w.kv_rank + w.rope, lambda h, w: h, "replicated", bias=False),
            Gemm("kv_up", lambda h, w: w.a * (w.nope + w.v), lambda h, w: w.kv_rank, "column", bias=False),
            Gemm("out", lambda h, w: h, lambda h, w: w.a * w.v, "row"))


def _latents_kept(w: Latent) -> int:
    """Elements per token MLA keeps of its latents, whole on every rank: each down-projection's output (the norm's
    input; kv_down's with k_rope), the norm's normalised output and root-mean-square (1), and the concatenated mapped
    latents the up-projections read (q_rank + kv_rank + rope)."""
    q = 3 * w.q_rank + 1 if w.q_rank else 0
    return q + 3 * w.kv_rank + 2 * w.rope + 1


def latent_kept(model: ModelConfig, tp: int = 1) -> float:
    """What MLA keeps per s·b·h, in bytes of 2-byte tensors over the t ranks. Split over t, per head: the query
    and the key assembled for the core (2·(nope + rope)), the core's output and the output projection's input (2v), and
    the key/value up-projection's output (nope + v); whole on every rank (counted t times), its latents
    (`_latents_kept`). The score matrix (unfused kernels) is counted apart, with the kernel."""
    w = Latent.of(model)
    split = w.a * (2 * w.d + w.nope + 3 * w.v)
    return 2 * (split + tp * _latents_kept(w)) / model.hidden


def latent_kept_selective(model: ModelConfig, tp: int = 1) -> float:
    """What MLA keeps under selective recomputation, which recomputes its up-projections with the core: the output
    projection's input (v per head, split over t) and its latents (`_latents_kept`, whole on every rank)."""
    w = Latent.of(model)
    return 2 * (w.a * w.v + tp * _latents_kept(w)) / model.hidden


def _latent_core(w: Latent) -> int:
    """QKᵀ over nope + rope channels and scores·V over v, per head: 2·a·(nope + rope) + 2·a·v per token and key."""
    return 2 * w.a * w.d + 2 * w.a * w.v


def _latent_rules(model: ModelConfig) -> Iterable[str]:
    m = model.mla
    if model.position != "rope":
        yield (f"model.attention=mla needs model.position=rope (model.position={model.position}): its keys' rotary "
               f"part is what carries positions")
    if model.n_kv_heads is not None:
        yield (f"model.n_kv_heads={model.n_kv_heads} must be null under model.attention=mla: every query head has "
               f"its own key and value, up-projected from the shared latent")
    if model.head_dim is not None:
        yield (f"model.head_dim={model.head_dim} must be null under model.attention=mla: its head sizes are "
               f"model.mla.qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
    if model.qk_norm:
        yield "model.qk_norm=true is not built for model.attention=mla (its latents have their own norms)"
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = getattr(m, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            yield f"model.mla.{key}={value!r} must be a positive integer"
    if m.q_lora_rank is not None and (not isinstance(m.q_lora_rank, int) or m.q_lora_rank < 1):
        yield f"model.mla.q_lora_rank={m.q_lora_rank!r} must be a positive integer (or null = no query compression)"
    if isinstance(m.qk_rope_head_dim, int) and m.qk_rope_head_dim % 2:
        yield (f"model.mla.qk_rope_head_dim={m.qk_rope_head_dim} must be even: the rotary embedding turns pairs of "
               f"channels")


def _latent_ring_width(model: ModelConfig, tp: int) -> int:
    """The ring carries the latents, kv_rank + rope on each of the t ranks (docs/parallelism.md)."""
    w = Latent.of(model)
    return tp * (w.kv_rank + w.rope)


# DeepSeek-AI 2024, DeepSeek-V2 §2.1: keys and values from one low-rank latent, queries from another, a decoupled
# rotary part whose key is shared by the heads; transformers' DeepseekV2/V3Attention
register(Attention("mla", "multi-head latent attention", "mlplat.model.mla:LatentAttention", latent_gemms(),
                   latent_kept, kv_gemm="kv_up", kept_selective=latent_kept_selective,
                   norms=lambda m: ((m.mla.q_lora_rank,) if m.mla.q_lora_rank else ()) + (m.mla.kv_lora_rank,),
                   core=_latent_core, rules=_latent_rules, shape=Latent.of,
                   rotary_dim=lambda m: m.mla.qk_rope_head_dim,
                   head_dims=lambda m: (m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim, m.mla.v_head_dim),
                   ring_width=_latent_ring_width, ring_gemm="kv_up", hf=True))
