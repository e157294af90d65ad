"""The largest pre-softmax logit of each attention head, max of q·kᵀ/√d over the query-key pairs the mask keeps:
QK-clip's figure (`mlplat.model.qk_clip`). No attention kernel returns it (FlashAttention and PyTorch's SDPA keep
their scores on chip and return at most the log-sum-exp, which bounds the max only loosely), so it is a pass of its
own over q·kᵀ, without gradient, one key/value group at a time: 2·b·h·s_q·s_k·d FLOPs (half the core's forward, a
sixth of its forward and backward) and a transient score block of b·(h/g)·s_q·s_k elements."""
from __future__ import annotations

import torch


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor | None, scale: float) -> torch.Tensor:
    """[heads] the largest logit of each query head over the batch and the kept pairs (-inf where none is kept), for
    q [b, heads, s_q, d] and k [b, kv_heads, s_k, d] (query head i uses key head i // (heads/kv_heads)); keep
    [b or 1, 1, s_q, s_k], True where a query attends to a key (None: every pair)."""
    per_group = q.size(1) // k.size(1)
    out = []
    for g in range(k.size(1)):
        scores = torch.matmul(q[:, g * per_group:(g + 1) * per_group], k[:, g:g + 1].transpose(-2, -1)) * scale
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        out.append(scores.amax(dim=(0, 2, 3)))
    return torch.cat(out)
