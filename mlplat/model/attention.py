"""The attention core, softmax(q·kᵀ/√d + causal mask)·v, behind three interchangeable backends.

`math` is the explicit reference; `sdpa` is PyTorch's scaled_dot_product_attention (FlashAttention kernels on
GPUs); `flash` is the flash-attn package. All take and return [batch, heads, seq, head_dim].
Dropout on the attention probabilities runs inside the caller's tensor-parallel RNG region.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F


def flash_available() -> tuple[bool, str]:
    """Whether the flash-attn backend can run here, and if not, what is missing."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False, "the flash-attn package is not installed (pip install 'mlplat[gpu]')"
    return True, ""


def resolve_backend(name: str, device_type: str) -> str:
    """`auto` picks the best available backend; `flash` without its requirements is refused in one line."""
    if name == "auto":
        if device_type == "cuda" and flash_available()[0]:
            return "flash"
        return "sdpa"
    if name == "flash":
        ok, why = flash_available()
        if not ok:
            raise ValueError(f"kernels.attention=flash cannot run: {why}; use kernels.attention=sdpa or auto")
    return name


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                   training: bool) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    s = q.size(-2)
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if training and dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, v)


def sdpa_attention(q, k, v, dropout_p: float, training: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p if training else 0.0, is_causal=True)


def flash_attention(q, k, v, dropout_p: float, training: bool) -> torch.Tensor:
    from flash_attn import flash_attn_func

    # flash-attn wants [batch, seq, heads, head_dim] in fp16/bf16.
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          dropout_p=dropout_p if training else 0.0, causal=True)
    return out.transpose(1, 2)


BACKENDS: dict[str, Callable] = {"math": math_attention, "sdpa": sdpa_attention, "flash": flash_attention}
