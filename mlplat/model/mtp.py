"""DeepSeek-V3's multi-token prediction (report §2.2; `model.mtp.depth` D, `model.mtp.loss_coeff` λ).

D sequential modules after the last transformer layer, on the last pipeline chunk. Module k (1..D) takes, at each
position i, the previous depth's hidden state h_{k-1} (h_0: the last layer's output, before the final norm) and the
embedding of token i+k (the model's word embedding, shared), and predicts token i+k+1:

    h'_k = proj([enorm(emb(t_{i+k})); hnorm(h_{k-1})])   the embedding's half first (DeepSeek's eh_proj), 2h -> h
    h_k  = layer(h'_k)                                    one transformer layer of the model's kind
    logits_k = output(norm(h_k))                          the shared output layer

The objective is the main loss plus λ/D Σ_k L_k, each L_k the mean cross-entropy over the positions that count at
depth k. Like the mixture of experts' balancing losses, the modules' losses enter the gradient but not the value
the step reports as its loss (the language-model loss, comparable with a model without modules, and the validation
loss); each depth's loss is reported on its own, in training and in validation (`mlplat.model.mtp_step`).

Context parallelism: a rank holds two chunks of the window, so the k-ahead tokens of its positions lie in other
ranks' chunks; they and the targets are taken from the whole window's labels (`TokenLayout.labels`) at the rank's
places, and each depth's loss is the rank's share of the window's mean times c, as the language-model loss is (the
gradients are averaged over the c ranks with the replicas). The modules' layers attend through the ring.

The k-ahead tokens come from the labels on the last stage (labels[i] = token i+1: token i+k = labels[i+k-1], the
target labels[i+k]; `depth_targets`). Position i counts at depth k only if labels[i..i+k] all count: past the
window's end there is no token, and a label masked IGNORE (packed documents mask the one at each end-of-document
token, `mlplat.data.packing`) means tokens i and i+k+1 lie in different documents, or that the input token is
unknown. Packed positions whose chain is broken attend only to positions broken as well (attention stays inside a
document, and a document's positions after a break are broken too), so a counted position never reads an unknown
input.

Sequence parallelism: h and the embedding are this rank's [b, s/t, h] shard (the lookup reduce-scatters into it),
so the norms and the projection see 1/t of the tokens and their gradients are summed over the tp group like the
layers' norms. The projection is not split over tp: it is 2h² weights per module, applied where the hidden state
is replicated (or sharded along the sequence).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch import Tensor

from mlplat.labels import IGNORE
from mlplat.parallel.sequence import mark_sequence_parallel_replicated


def _ahead(labels: Tensor, k: int) -> Tensor:
    """labels[..., i + k] at position i, IGNORE past the window's end."""
    if k == 0:
        return labels
    out = torch.full_like(labels, IGNORE)
    if k < labels.size(-1):
        out[..., :-k] = labels[..., k:]
    return out


def depth_targets(labels: Tensor, depth: int) -> list[tuple[Tensor, Tensor]]:
    """Per depth k = 1..D, (the input token ids t_{i+k}, the targets t_{i+k+1}) at each position i, from the main
    labels [b, s]: targets IGNORE where position i does not count at depth k (module docstring), input ids 0 where
    the token is unknown (such a position's output is never read by one that counts)."""
    known = labels != IGNORE  # labels[i..i+k-1] all count: the input t_{i+k} is known
    out = []
    for k in range(1, depth + 1):
        inputs = _ahead(labels, k - 1).masked_fill(~known, 0)
        target = _ahead(labels, k)
        known = known & (target != IGNORE)
        out.append((inputs, target.masked_fill(~known, IGNORE)))
    return out


class MTPModule(nn.Module):
    """Module k: enorm, hnorm, proj ([h, 2h], no bias), layer (a transformer layer), norm. `norm` makes one of the
    model's norms; `layer` is built by the caller (the chunk: its kind, rotary, RNG and kernels)."""

    def __init__(self, norm: Callable[[], nn.Module], layer: nn.Module, hidden: int, device=None, dtype=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.enorm, self.hnorm = norm(), norm()
        self.proj = nn.Linear(2 * hidden, hidden, bias=False, device=device, dtype=dtype)
        self.layer = layer
        self.norm = norm()
        if sequence_parallel:  # applied to this rank's tokens only
            mark_sequence_parallel_replicated(*self.enorm.parameters(), *self.hnorm.parameters(),
                                              self.proj.weight, *self.norm.parameters())

    def forward(self, h: Tensor, emb: Tensor, run_layer: Callable[[nn.Module, Tensor], Tensor]) -> Tensor:
        """h_k from h_{k-1} and the embedding of the k-ahead tokens; `run_layer(layer, x)` runs the layer (with the
        chunk's layout and recomputation)."""
        return run_layer(self.layer, self.proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1)))


class MultiTokenPrediction(nn.ModuleList):
    """The D modules (`mtp.<k-1>.*`), and the step's statistics: each depth's loss summed over the micro-batches of
    the pass (`loss_sum`, detached, [D]) and their count, read by `mlplat.model.mtp_step.MTPStep`."""

    def __init__(self, modules: list[MTPModule], loss_coeff: float):
        super().__init__(modules)
        self.loss_coeff = loss_coeff
        self.reset_stats()

    def reset_stats(self) -> None:
        self.loss_sum: Tensor | None = None
        self.micro_batches = 0

    def forward(self, h: Tensor, labels: Tensor, embed: Callable[[Tensor], Tensor],
                loss_of: Callable[[Tensor, Tensor, Tensor | None], Tensor],
                run_layer: Callable[[nn.Module, Tensor], Tensor], window=None) -> Tensor:
        """λ/D Σ_k L_k of a micro-batch: h = h_0, `embed(ids)` the shared word embedding's lookup, `loss_of(hidden,
        targets, counted)` the shared output layer's mean cross-entropy over the counted targets (`counted`: how many
        count over the whole window, None: those given). Under context parallelism `window` is the layout
        (`mlplat.parallel.placement.TokenLayout`) holding the window's labels: the k-ahead ids and targets are taken
        from them and this rank's places kept, and each depth's mean is over the window's counted targets."""
        losses = []
        whole = window is not None and window.labels is not None
        for module, (ids, targets) in zip(self, depth_targets(window.labels if whole else labels, len(self))):
            counted = None
            if whole:
                counted = (targets != IGNORE).sum()
                ids, targets = ids[:, window.index], targets[:, window.index]
            h = module(h, embed(ids), run_layer)
            losses.append(loss_of(module.norm(h), targets, counted))
        stacked = torch.stack(losses)
        detached = stacked.detach()
        self.loss_sum = detached if self.loss_sum is None else self.loss_sum + detached
        self.micro_batches += 1
        return stacked.sum() * (self.loss_coeff / len(self))


def mtp_modules(chunks) -> list[MultiTokenPrediction]:
    """The multi-token prediction of these chunks (the last chunk's; [] on other ranks or without it)."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MultiTokenPrediction)]
