"""The next token from a vector of logits: greedy, or a draw with temperature, top-k and top-p (nucleus).

Pure and deterministic for a generator's state, so every rank that computes the same logits with the same
generator draws the same token.
"""
from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits (1-D) with the tokens outside the top-k and outside the top-p nucleus set to -inf."""
    logits = logits.clone()
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the tokens before it already reach top_p; the most likely one always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        logits[order[drop]] = float("-inf")
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> int:
    """A token id from 1-D logits: argmax when temperature is 0, else a draw from softmax(logits/temperature)
    restricted by top_k and top_p."""
    if temperature == 0:
        return int(logits.argmax())
    scaled = filter_logits(logits.double() / temperature, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
