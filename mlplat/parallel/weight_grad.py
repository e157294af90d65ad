"""Deferred weight gradients for the zero-bubble schedules: the B/W split of a backward.

In B (the gradient w.r.t. a chunk's input, on the pipeline's critical path) a linear layer computes its input
gradient and its bias gradient only; its weight-gradient GEMM, dW = gᵀ·x, is deferred with the tensors it needs
(the layer's input x and output gradient g) to the chunk's `WeightGradStore` under the (chunk, micro-batch)
being back-propagated (`mlplat.parallel.linear`, every GEMM of the model, the logits included). W runs the
deferred work of one (chunk, micro-batch) and accumulates it into `weight.main_grad`, the weight's view of the
flat gradient buffer (`mlplat.optim.buffers`: no autograd hook sees W, and the micro-batches must add up
in the main gradient's precision). A layer that is not a linear one defers its own weight-gradient work with
`defer(fn)`. Each engine owns one store per chunk: no global state.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


class WeightGradStore:
    """The weight-gradient work of one model chunk that B deferred and W has not run yet."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None  # (chunk, micro-batch) of the B in progress; None: not deferring
        self.pending: dict[tuple[int, int], list[Callable[[], None]]] = {}

    def defer(self, fn: Callable[[], None]) -> None:
        """Weight-gradient work: `fn()` runs in W (without autograd recording), in deferring order."""
        self.pending.setdefault(self.key, []).append(fn)

    @torch.no_grad()
    def run(self, key: tuple[int, int]) -> None:
        """W: the work B deferred under `key`, in the order it was deferred."""
        for fn in self.pending.pop(key, []):
            fn()


def accumulate_weight_grad(weight: torch.Tensor, dw: torch.Tensor) -> None:
    """W's gradient of `weight` added where autograd's would have gone: its main gradient, else `weight.grad`."""
    main = getattr(weight, "main_grad", None)
    if main is not None:
        main.add_(dw)
    else:
        weight.grad = dw if weight.grad is None else weight.grad.add_(dw)
