"""The attention core, softmax(q·kᵀ/√d + causal mask)·v, behind interchangeable backends.

`math` is the explicit reference (with `kernels.fused=true` its scale+mask+softmax is the fused operator);
`sdpa` is PyTorch's scaled_dot_product_attention (FlashAttention-2 / memory-efficient kernels on GPUs);
`flash` is the flash-attn package (GPU, fp16/bf16 only); `auto` picks the best one available.
All take q [batch, heads, seq, head_dim] and k, v [batch, kv_heads, seq, head_dim] (grouped-query attention:
query head i attends with key/value head i // (heads/kv_heads)) and return q's shape. Packed documents (a
`layout`, mlplat.parallel.placement.TokenLayout, whose `documents` [batch, seq] give each token's document):
attention also stops at document boundaries, a block-diagonal mask for math and sdpa, flash-attn's
variable-length kernel over the documents (`cu_seqlens`) for flash. Dropout on the attention probabilities runs
inside the caller's tensor-parallel RNG region.

Dropout and the backends. On CPU, `scaled_dot_product_attention` with dropout_p > 0 dispatches to PyTorch's
math kernel (`_scaled_dot_product_attention_math`), which draws the mask with `at::dropout(attn, p, train)` from
the default generator — the same call, on the same generator, as `F.dropout` in `math_attention` — so `sdpa`
and `math` draw identical masks and agree to rounding even with dropout on (tests/model/test_kernels.py). On GPUs
the fused SDPA and flash-attn kernels generate their masks inside the kernel from Philox counters: still
reproducible from the generator state (which is what recomputation needs), but not the mask `math` draws, so
there `sdpa`/`flash` equal `math` only at dropout 0 and in distribution otherwise.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from mlplat.config import ATTENTION_BACKENDS, ring_kernel
from mlplat.model.fused import fused_scale_mask_softmax, scale_mask_softmax
from mlplat.precision import TABLE

HALF_PRECISIONS = tuple(name for name, entry in TABLE.items() if entry.half)  # what flash attention can run
FLASH_MAX_HEAD_DIM = 256  # flash-attn 2's kernels take heads of at most this many channels


def flash_available() -> tuple[bool, str]:
    """Whether the flash-attn backend can run here, and if not, what is missing."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False, "the flash-attn package is not installed (pip install 'mlplat[gpu]')"
    return True, ""


def device_type_for(accelerator: str) -> str:
    """The torch device type a `trainer.accelerator` runs on (without initialising CUDA)."""
    acc = str(accelerator).lower()
    if acc in ("gpu", "cuda"):
        return "cuda"
    if acc == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu" if acc == "cpu" else acc


def resolve_backend(name: str, device_type: str, precision: str | None = None, cp: int = 1,
                    head_dim: int | None = None, value_dim: int | None = None) -> str:
    """The backend to run for `kernels.attention=name` on `device_type` ('cpu' | 'cuda'); `head_dim`, `value_dim`: the
    model's query/key and value head sizes (its attention entry's `head_dims`), None when not known.

    `auto` picks flash-attn on a GPU when it is installed, the precision is 16-bit and the heads are at most
    FLASH_MAX_HEAD_DIM wide and of one size for q, k and v (flash-attn 2 takes no other: MLA's values are narrower
    than its queries and keys), else PyTorch's SDPA.
    `flash` where it cannot run is refused with one line saying what is missing and what to use instead.
    Under context parallelism (cp > 1) the backend computes ring attention's blocks (mlplat.parallel.context):
    `sdpa` is PyTorch's flash kernel (its CPU or CUDA build), which returns the log-sum-exp; `math` the explicit one.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"kernels.attention={name!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if cp > 1:
        return ring_kernel(name, device_type, cp)
    half = precision is None or str(precision) in HALF_PRECISIONS
    narrow = head_dim is None or head_dim <= FLASH_MAX_HEAD_DIM
    one_size = value_dim is None or head_dim is None or value_dim == head_dim
    if name == "auto":
        if device_type == "cuda" and half and narrow and one_size and flash_available()[0]:
            return "flash"
        return "sdpa"
    if name == "flash":
        if not one_size:
            raise ValueError(f"kernels.attention=flash cannot run: flash-attn 2's kernels take one head size for q, k "
                             f"and v, and the model's are {head_dim} (q, k) and {value_dim} (v) (model.attention=mla); "
                             f"use kernels.attention=sdpa or auto")
        if not narrow:
            raise ValueError(f"kernels.attention=flash cannot run: flash-attn's kernels take heads of at most "
                             f"{FLASH_MAX_HEAD_DIM} channels and the model's are {head_dim} (model.head_dim, or "
                             f"model.hidden/model.n_heads); use kernels.attention=sdpa or auto")
        if device_type != "cuda":
            raise ValueError(f"kernels.attention=flash cannot run: flash-attn needs a CUDA GPU and this run is on "
                             f"{device_type}; use kernels.attention=sdpa or auto")
        ok, why = flash_available()
        if not ok:
            raise ValueError(f"kernels.attention=flash cannot run: {why}; use kernels.attention=sdpa or auto")
        if not half:
            raise ValueError(f"kernels.attention=flash cannot run: flash-attn computes in fp16/bf16 only and "
                             f"trainer.precision={precision}; use trainer.precision=bf16-mixed or "
                             f"kernels.attention=sdpa")
    return name


def _causal_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.matmul(q, k.transpose(-2, -1))


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v with each key/value head repeated for its group of query heads (a no-op without grouping)."""
    per_group = q.size(1) // k.size(1)
    if per_group == 1:
        return k, v
    return k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)


def _other_document(layout) -> torch.Tensor | None:
    """[b, 1, s, s] True where query and key are in different documents (None: one document)."""
    if layout is None or layout.documents is None:
        return None
    documents = layout.documents
    return (documents[:, None, :, None] != documents[:, None, None, :])


def kept_pairs(s: int, layout, device) -> torch.Tensor:
    """[b or 1, 1, s, s] True where a query attends to a key: causal, and within its document when packed."""
    keep = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None, None]
    other = _other_document(layout)
    return keep if other is None else keep & ~other


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                   training: bool, layout=None, softmax: Callable = scale_mask_softmax) -> torch.Tensor:
    k, v = _expand_kv(q, k, v)
    probs = softmax(_causal_scores(q, k), 1.0 / math.sqrt(q.size(-1)), _other_document(layout))
    if training and dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, v)


def fused_math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                         training: bool, layout=None) -> torch.Tensor:
    """`math` with the paper's fused scale+mask+softmax (one kernel forward, one backward)."""
    return math_attention(q, k, v, dropout_p, training, layout, softmax=fused_scale_mask_softmax)


def sdpa_attention(q, k, v, dropout_p: float, training: bool, layout=None) -> torch.Tensor:
    mask = _other_document(layout)
    if mask is not None:  # causal within each document
        s = q.size(-2)
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril() & ~mask
    dv = v.size(-1)
    padded = q.device.type == "cpu" and dv < q.size(-1)
    if padded:
        # The CPU flash kernel takes one head size for q, k and v, else SDPA falls back to its math path (MLA's
        # values are narrower than its keys): zero channels appended to v add only zero output channels, cut off.
        v = F.pad(v, (0, q.size(-1) - dv))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p if training else 0.0,
                                         is_causal=mask is None, enable_gqa=k.size(1) != q.size(1))
    return out[..., :dv] if padded else out


def flash_attention(q, k, v, dropout_p: float, training: bool, layout=None) -> torch.Tensor:
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    # flash-attn wants [batch, seq, heads, head_dim] in fp16/bf16 (autocast hands it the linear's output dtype);
    # it takes fewer key/value heads than query heads as they are (grouped-query attention).
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    p = dropout_p if training else 0.0
    if layout is None or layout.documents is None:
        return flash_attn_func(q, k, v, dropout_p=p, causal=True).transpose(1, 2)
    # Packed documents: every document is a sequence of its own (untested here: no GPU on the test machines).
    b, s = layout.documents.shape
    cu, longest = layout.boundaries  # once per micro-batch, not per layer: it reads the device
    out = flash_attn_varlen_func(q.reshape(b * s, *q.shape[2:]), k.reshape(b * s, *k.shape[2:]),
                                 v.reshape(b * s, *v.shape[2:]), cu, cu, longest, longest, dropout_p=p, causal=True)
    return out.view(b, s, *out.shape[1:]).transpose(1, 2)


BACKENDS: dict[str, Callable] = {"math": math_attention, "sdpa": sdpa_attention, "flash": flash_attention}


def attention_core(backend: str, fused: bool = False) -> Callable:
    """The core function for a resolved backend name; `fused` only changes `math` (the others are fused
    kernels already: their softmax never leaves the kernel)."""
    if backend == "math" and fused:
        return fused_math_attention
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {', '.join(BACKENDS)} (resolve 'auto' first)")
    return BACKENDS[backend]
