"""The MoE routers, one entry each (the value of `model.moe.router`): how a router turns its logits into scores,
and how group-limited routing scores a group.

Pure data, no torch import (the functions call tensor methods), so the config's rules read the entries too. The
layer's routing (`mlplat.model.moe.MoELayer.route`) is the same for every entry: logits, then `scores`, the top-k
among the best groups (`group_limited_topk`, by `group_score`), the gates the chosen scores, renormalised to sum 1
where model.moe.norm_topk_prob says, times model.moe.routed_scaling_factor. Adding a router is one
`register(Router(...))`; `registered` adds one for the length of a `with` block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mlplat.specs.registry import Registry

Tensor = Any  # a torch.Tensor: this module imports no torch


@dataclass(frozen=True)
class Router:
    name: str  # the value of model.moe.router
    label: str  # in words, for the docs and the refusals
    # logits [N, E] -> (scores [N, E], which choose and gate; probabilities [N, E], which the balancing losses read)
    scores: Callable[[Tensor], tuple[Tensor, Tensor]]
    # choices [N, groups, E/groups] -> each group's score [N, groups], for group-limited routing
    group_score: Callable[[Tensor], Tensor]


_ENTRIES: Registry[Router] = Registry("router", "model.moe.router")
register, unregister, registered = _ENTRIES.register, _ENTRIES.unregister, _ENTRIES.registered
names, get = _ENTRIES.names, _ENTRIES.get


def _softmax(logits: Tensor) -> tuple[Tensor, Tensor]:
    probs = logits.softmax(-1)
    return probs, probs


def _sigmoid(logits: Tensor) -> tuple[Tensor, Tensor]:
    scores = logits.sigmoid()
    return scores, scores / scores.sum(-1, keepdim=True)


# Mixtral, Qwen: a softmax over the experts; a group's score its best expert's (DeepSeek-V2's group-limited routing)
register(Router("softmax", "softmax over the experts (Mixtral, Qwen)", _softmax, lambda groups: groups.amax(-1)))
# DeepSeek-V3, GLM-4.5: each expert's own sigmoid score (their releases renormalise the k chosen: norm_topk_prob); a
# group's score the sum of its two best (its one best for a group of one)
register(Router("sigmoid", "each expert's sigmoid score (DeepSeek-V3, GLM-4.5)", _sigmoid,
                lambda groups: groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)))
