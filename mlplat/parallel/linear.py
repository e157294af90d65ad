"""The one path of every GEMM of the model: `linear`, Y = X·Wᵀ + b.

The column-parallel and row-parallel layers (`mlplat.parallel.tensor`), the column-parallel GEMM behind sequence
parallelism's all-gather and the logits (`tensor.parallel_lm_logits`) all call `linear`. A linear layer and its
backward are three matrix products: the forward Y = X·Wᵀ + b, the input gradient dX = dY·W and the weight gradient
dW = dYᵀ·X. `linear` computes the three through one `Gemm`, the layer's `gemm` attribute (None: `DENSE`, torch's
products); a quantised GEMM is a `Gemm` of its own, set on the layers, and nothing else changes. Around the products:

- with a `store` that is deferring (a zero-bubble B), dW is left to the W step (`mlplat.parallel.weight_grad`);
- with `sequence_gather` (the grid: sequence parallelism's g before a column-parallel GEMM, Korthikanti et al.,
  2022, §4.2.2) X is this rank's sequence shard, all-gathered along the sequence forward. Only the shard is saved:
  backward gathers it again while dX's GEMM runs, and reduce-scatters dX while dW's GEMM runs.

With neither, and the dense GEMM, the products are torch's `F.linear` and autograd's own backward of it (no Python
in the backward: the same three products); anything else runs `_Linear`, whose backward calls the `Gemm`.

The mixture of experts' GEMMs take the same path: `grouped_linear` (rows sorted by expert, one weight per expert)
runs `grouped_mm` without a `Gemm`, and a `Gemm`'s grouped products with one, which are its own three products per
expert unless it overrides them: a recipe set on the experts (`mlplat.model.moe.ExpertWeights.gemm`) plugs in as
on a dense layer.
"""
from __future__ import annotations

from functools import partial
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor

from mlplat.parallel import dispatch
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.mappings import (
    SEQUENCE_DIM,
    all_gather,
    all_gather_from_sequence_parallel,
    start_all_gather,
    start_reduce_scatter,
)
from mlplat.parallel.weight_grad import WeightGradStore, accumulate_weight_grad
from mlplat.precision import grouped_gemm_path


class Gemm:
    """The three products of a linear layer. A subclass changes how they are computed (a quantised GEMM converts
    the operands and rescales the product); an instance per layer may keep that layer's state (its scales)."""

    def forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """Y = X·Wᵀ + b: [..., in] -> [..., out]."""
        return F.linear(x, weight, bias)

    def output_grad(self, grad_out: Tensor) -> Tensor:
        """dY as both backward products take it, called once per backward: dY itself (a recipe may first make
        whole what each rank holds a share of)."""
        return grad_out

    def input_grad(self, grad_out: Tensor, weight: Tensor) -> Tensor:
        """dX = dY·W: [..., out] -> [..., in], in dY's dtype."""
        return grad_out.matmul(weight.to(grad_out.dtype))

    def weight_grad(self, grad_out: Tensor, x: Tensor, weight: Tensor) -> Tensor:
        """dW = dYᵀ·X over every token, in the weight's dtype."""
        g = grad_out.reshape(-1, grad_out.shape[-1])
        return g.t().mm(x.reshape(-1, x.shape[-1]).to(g.dtype)).to(weight.dtype)


    # The experts' products (a grouped GEMM: rows of x sorted by group, `counts` [G] rows each, weight [G, out, in]),
    # one of the layer's own products per group: any recipe runs on experts as on a dense layer.
    def grouped_forward(self, x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
        """Y_g = X_g·W_gᵀ: [M, in] -> [M, out]."""
        return _per_group(counts, x.new_zeros(0, weight.shape[1]),
                          lambda g, rows: self.forward(x[rows], weight[g], None))

    def grouped_input_grad(self, grad_out: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
        """dX_g = dY_g·W_g: [M, out] -> [M, in]."""
        return _per_group(counts, grad_out.new_zeros(0, weight.shape[2]),
                          lambda g, rows: self.input_grad(grad_out[rows], weight[g]))

    def grouped_weight_grad(self, grad_out: Tensor, x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
        """dW_g = dY_gᵀ·X_g: [G, out, in] (zero for a group without rows)."""
        return torch.stack([self.weight_grad(grad_out[rows], x[rows], weight[g])
                            for g, rows in enumerate(group_rows(counts))])


DENSE = Gemm()
GROUPED_ALIGN_BYTES = 16  # torch._grouped_mm's operands' strides must be multiples of 16 bytes


def group_rows(counts: Tensor) -> list[slice]:
    """Each group's rows: the counts read on the host once (a loop over the groups needs them)."""
    sizes = dispatch.host_read(counts)
    return [slice(end - n, end) for end, n in zip(accumulate(sizes), sizes)]


def _per_group(counts: Tensor, empty: Tensor, product) -> Tensor:
    out = [product(g, rows) for g, rows in enumerate(group_rows(counts))]
    return torch.cat(out) if out else empty


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def grouped_mm_path(x: Tensor, weight: Tensor) -> str:
    """`mlplat.precision.grouped_gemm_path` for these operands on their device, the precision's compute dtype
    autocast's where it is on (bf16-mixed, 16-mixed: it leaves `_grouped_mm` alone), else the operands'; a grouped
    path whose widths are not 16-byte aligned in the dtype it would run in takes the loop."""
    device = x.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)  # not on meta
    compute = torch.get_autocast_dtype(device) if autocast else x.dtype
    path = grouped_gemm_path(device, _dtype_name(x.dtype), _dtype_name(compute))
    size = 2 if path == "grouped-bf16" else x.element_size()
    align = GROUPED_ALIGN_BYTES // size
    if path != "loop" and (x.shape[1] % align or weight.shape[2] % align):
        return "loop"
    return path


def grouped_mm(x: Tensor, weight: Tensor, counts: Tensor, path: str | None = None) -> Tensor:
    """Rows of x [M, K] sorted by group, counts [G] rows per group, weight [G, K, N]: y[rows of g] = x[rows of g]·W_g,
    in x's dtype, by `path` (None: `grouped_mm_path`'s; mlplat.precision.GROUPED_PATHS): torch._grouped_mm in x's
    dtype, or on bf16 copies of the operands (their gradients cast back by autograd), or one matmul per group (the
    counts read on the host once; the paths are proven equal by tests/model/test_moe.py)."""
    path = path or grouped_mm_path(x, weight)
    if path == "loop":
        return _per_group(counts, x.new_zeros(0, weight.shape[2]), lambda g, rows: x[rows] @ weight[g])
    offs = counts.cumsum(0).to(torch.int32)
    if path == "grouped-bf16":
        return torch._grouped_mm(x.to(torch.bfloat16), weight.to(torch.bfloat16), offs=offs).to(x.dtype)
    return torch._grouped_mm(x, weight, offs=offs)


def _deferred_weight_grad(gemm: Gemm, weight: Tensor, grad_out: Tensor, x: Tensor) -> None:
    accumulate_weight_grad(weight, gemm.weight_grad(grad_out, x, weight))


class _Linear(torch.autograd.Function):
    """Y = gather(X)·Wᵀ + b (gather: the identity without a group), its three products through `gemm`."""

    @staticmethod
    def forward(ctx, x, weight, bias, gemm: Gemm, store: WeightGradStore | None, group):
        ctx.save_for_backward(x, weight)
        ctx.gemm, ctx.store, ctx.group = gemm, store, group
        return gemm.forward(x if group is None else all_gather(x, SEQUENCE_DIM, group), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        gemm, store, group = ctx.gemm, ctx.store, ctx.group
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gathering = None if group is None else start_all_gather(x, SEQUENCE_DIM, group)
        grad = gemm.output_grad(grad_out) if need_x or need_w else grad_out  # the bias takes dY itself
        grad_x = gemm.input_grad(grad, weight) if need_x else None
        full, scattering = x, None
        if gathering is not None:
            gathering.wait()
            full = gathering.result()
            if need_x:
                scattering = start_reduce_scatter(grad_x, SEQUENCE_DIM, group)
        grad_w = None
        if need_w:
            if store is not None and store.key is not None:  # a zero-bubble B: dW waits for W
                store.defer(partial(_deferred_weight_grad, gemm, weight, grad.detach(), full.detach()))
            else:
                grad_w = gemm.weight_grad(grad, full, weight)
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if need_b else None
        if scattering is not None:
            grad_x = scattering.result()
        return (None if grad_x is None else grad_x.to(x.dtype)), grad_w, grad_b, None, None, None


class _GroupedLinear(torch.autograd.Function):
    """The experts' Y_g = X_g·W_gᵀ, its three products through `gemm`."""

    @staticmethod
    def forward(ctx, x, weight, counts, gemm: Gemm):
        ctx.save_for_backward(x, weight, counts)
        ctx.gemm = gemm
        return gemm.grouped_forward(x, weight, counts)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, counts = ctx.saved_tensors
        gemm = ctx.gemm
        grad_x = gemm.grouped_input_grad(grad_out, weight, counts).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = gemm.grouped_weight_grad(grad_out, x, weight, counts) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None


def grouped_linear(x: Tensor, weight: Tensor, counts: Tensor, gemm: Gemm | None = None) -> Tensor:
    """The experts' GEMM: rows of x [M, in] sorted by expert (`counts` [E] rows each) times their expert's
    weight [E, out, in] transposed: [M, out]. `gemm` None: `grouped_mm` and autograd's own backward of it; a
    `Gemm` (a recipe's, as a dense layer's `gemm`): its grouped products, forward and backward."""
    if gemm is None:
        return grouped_mm(x, weight.transpose(1, 2), counts)
    if not torch.is_grad_enabled() or not (weight.requires_grad or x.requires_grad):
        return gemm.grouped_forward(x, weight, counts)
    return _GroupedLinear.apply(x, weight, counts, gemm)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, store: WeightGradStore | None = None, *,
           gemm: Gemm | None = None, sequence_gather: ParallelGrid | None = None) -> Tensor:
    """Y = X·Wᵀ + b through `gemm` (None: `DENSE`), the weight gradient left to `store` while it defers, X first
    all-gathered along the sequence over `sequence_gather`'s tensor-parallel group when given (t > 1)."""
    if sequence_gather is not None and sequence_gather.tp > 1:
        if sequence_gather.tp_group is not None and torch.is_grad_enabled():
            return _Linear.apply(x, weight, bias, gemm or DENSE, store, sequence_gather.tp_group)
        x = all_gather_from_sequence_parallel(x, sequence_gather)  # no backward, or virtual mode (no groups)
    if (gemm is None and store is None) or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight, bias) if gemm is None else gemm.forward(x, weight, bias)
    return _Linear.apply(x, weight, bias, gemm or DENSE, store, None)
