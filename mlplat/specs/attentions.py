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

The runtime's contract (`mlplat.model.decoder.ParallelAttention` implements it): built as impl(cfg, grid, tracker,
kernels, backend, device=, dtype=, sequence_parallel=, rotary=, ring=) with its GEMMs as submodules named as the
entry names them; forward(x, layout) is its output, with kernels.fused the pair (output without its bias, the bias);
set_kernels(kernels, backend) switches a built one's kernels.

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
    # model -> what it refuses, one line each
    rules: Callable[[ModelConfig], Iterable[str]] = no_rules
    # transformers' classes compute it: mlplat.checkpoint.hf's names map its modules
    hf: bool = False

    def gemm(self, name: str) -> Gemm:
        return next(g for g in self.gemms if g.name == name)

    def rows(self, gemm: Gemm, h: int, heads: Heads, tp: int = 1) -> int:
        """`gemm`'s output rows over all t ranks: the K/V GEMM's replicated K/V heads counted on each rank."""
        extra = 2 * heads.d * max(0, tp - heads.k) if gemm.name == self.kv_gemm else 0
        return gemm.out(h, heads) + extra

    def weights(self, h: int, heads: Heads) -> int:
        """Its GEMMs' weights, each once."""
        return sum(g.weights(h, heads) for g in self.gemms)

    def parameters(self, model: ModelConfig, tp: int = 1) -> tuple[int, int]:
        """(split over the t ranks, summed over them; replicated on each) of one layer's attention: its GEMMs' weights
        and a column GEMM's bias split (the K/V GEMM's replicated rows on each rank sharing them), a row GEMM's bias
        and the norms replicated."""
        h, heads = model.hidden, Heads.of(model)
        split = replicated = 0
        for g in self.gemms:
            rows = self.rows(g, h, heads, tp)
            split += rows * g.inp(h, heads)
            if g.has_bias(model):
                if g.split == "column":
                    split += rows
                else:
                    replicated += rows
        return split, replicated + sum(self.norms(model))

    def tensors(self, model: ModelConfig) -> int:
        """Its parameter tensors in one layer: the GEMMs' weights, their biases, the norms."""
        return sum(1 + g.has_bias(model) for g in self.gemms) + len(self.norms(model))

    def core_flops(self, model: ModelConfig) -> int:
        """Forward FLOPs of its core per token and key it attends."""
        return self.core(Heads.of(model))

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
