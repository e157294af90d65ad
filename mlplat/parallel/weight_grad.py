"""Deferred weight gradients for the zero-bubble schedules: the B/W split of a backward.

In B (the gradient w.r.t. a chunk's input, on the pipeline's critical path) a linear layer computes its input
gradient and its bias gradient only; its weight-gradient GEMM, dW = gᵀ·x, is recorded with the tensors it needs
(the layer's input x and output gradient g) in the chunk's `WeightGradStore` under the (chunk, micro-batch)
being back-propagated. W runs the recorded GEMMs of one (chunk, micro-batch) and accumulates them into
`weight.main_grad`, the weight's view of the flat gradient buffer (`mlplat.parallel.data_parallel`: no autograd
hook sees W, and the micro-batches must add up in the main gradient's precision). A layer that is not a
linear one defers its own weight-gradient work with `defer(fn)`. Each engine owns one store per chunk: no global
state.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class WeightGradStore:
    """The weight-gradient work of one model chunk that B recorded and W has not run yet."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None  # (chunk, micro-batch) of the B in progress; None: not deferring
        self.pending: dict[tuple[int, int], list[Callable[[], None]]] = {}

    def record(self, weight: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor) -> None:
        """A linear layer's dW = gᵀ·x, accumulated into weight.grad by W."""
        self.defer(lambda: _accumulate_linear_wgrad(weight, x, grad_out))

    def defer(self, fn: Callable[[], None]) -> None:
        """Any other weight-gradient work: `fn()` runs in W (without autograd recording), in recording order."""
        self.pending.setdefault(self.key, []).append(fn)

    @torch.no_grad()
    def run(self, key: tuple[int, int]) -> None:
        """W: the work B recorded under `key`, in the order it was recorded."""
        for fn in self.pending.pop(key, []):
            fn()


def linear_weight_grad(weight: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """dW = gᵀ·x of Y = X·Wᵀ, over every token of x [..., in] and grad_out [..., out], in the weight's dtype. The
    one place this GEMM is written: the layers' backward and the zero-bubble W step both call it."""
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    return g2.t().mm(x.reshape(-1, x.shape[-1]).to(g2.dtype)).to(weight.dtype)


def weight_and_bias_grads(weight: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor, has_bias: bool,
                          store: WeightGradStore | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dW, db) of a linear layer's backward. Inside a zero-bubble B (`store.key` set) dW is recorded for W and
    None is returned, so autograd leaves weight.grad alone."""
    grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if has_bias else None
    if store is not None and store.key is not None:
        store.record(weight, x.detach(), grad_out.detach())
        return None, grad_b
    return linear_weight_grad(weight, x, grad_out), grad_b


def _accumulate_linear_wgrad(weight: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> None:
    dw = linear_weight_grad(weight, x, g)
    main = getattr(weight, "main_grad", None)
    if main is not None:
        main.add_(dw)
    else:
        weight.grad = dw if weight.grad is None else weight.grad.add_(dw)


class _LinearDeferredWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias = store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight.to(grad_out.dtype)).to(x.dtype)
        grad_w, grad_b = weight_and_bias_grads(weight, x, grad_out, ctx.has_bias, ctx.store)
        return grad_x, grad_w, grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           store: WeightGradStore | None) -> torch.Tensor:
    """F.linear, with the weight gradient left to `store` (when one is set and autograd is recording)."""
    if store is None or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight, bias)
    return _LinearDeferredWeightGrad.apply(x, weight, bias, store)
