"""FP8 for the experts' grouped GEMMs (`kernels.fp8` with `model.moe.num_experts` > 0): each expert's three
products (Y_g = X_g·W_gᵀ, dX_g = dY_g·W_g, dW_g = dY_gᵀ·X_g) quantised under the dense recipe of the same name
(`mlplat.parallel.fp8`), with scales that do not depend on the layout.

An expert's weight is scaled over the whole expert, never across two experts: `tensorwise` one scale per expert,
`rowwise` one per row of W_g (and of W_gᵀ for dX), `blockwise` 128×128 blocks inside each expert. Under the experts
split over tp (`parallel.etp` = t) a shard holds part of an expert's rows (fc1) or columns (fc2), so the amax over
the split dimension is all-reduced (MAX) over the tensor-parallel group, as the dense layers' is; blockwise blocks
lie inside the shards (validation: the expert width over etp a multiple of 128). Whole experts under expert
parallelism need no reduction.

The activations and gradients (X, dY) are scaled per token row in every recipe: one scale per row (`tensorwise`,
`rowwise`; its amax all-reduced over tp where etp splits the row) or per 1×128 tile of the row (`blockwise`,
DeepSeek-V3's). Which tokens an expert's GEMM holds depends on the layout (expert parallelism over data-parallel
replicas hands one expert several micro-batches' tokens at once, where one process runs them one by one), a token's
row does not: a scale over the expert's tokens (a tensor's amax, or one per feature along the tokens) would not be
one process's. So `tensorwise` on experts scales W per expert and X, dY per token row; and dW's product, whose
contraction runs over the tokens, reuses the rows' scales along it (as DeepSeek-V3's wgrad carries 1×128 scales
along its contraction) instead of quantising dYᵀ and Xᵀ again.

The forward of `tensorwise` and `rowwise` into bf16 runs through torch's grouped FP8 GEMM on CUDA where its probe
agrees (`mlplat.parallel.fp8_grouped`, which says why dX, dW and blockwise cannot); every other product runs as the
emulation (dequantise, one grouped GEMM in fp32, or float64 under `64-true`;
`mlplat.precision.grouped_fp8_gemm_path`). The weights' casts are kept per optimizer step in the chunk's
`WeightCasts`, as a dense layer's.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mlplat.parallel.fp8 import WeightCasts
from mlplat.parallel.fp8_grouped import grouped_kernel_takes, scaled_grouped_mm
from mlplat.parallel.linear import Gemm, group_rows, grouped_mm
from mlplat.parallel.quantise import E4M3, E5M2, Quantised, quantise
from mlplat.precision import FP8_BLOCK as BLOCK
from mlplat.precision import fp8_reduced_over


class GroupedFp8Gemm(Gemm):
    """The experts' products under `recipe` on one `ExpertWeights` (weight [E, out, in] stacked, rows of x sorted by
    expert, `counts` [E] rows each). `split`: the weight dimension the experts' tensor-parallel group `group`
    splits ("out": fc1's rows, "in": fc2's columns; `group` None: whole experts on this rank)."""

    def __init__(self, recipe: str, split: str, group=None, casts: WeightCasts | None = None):
        assert recipe in ("tensorwise", "rowwise", "blockwise") and split in ("out", "in"), (recipe, split)
        self.recipe, self.casts = recipe, casts
        self.groups = {"tokens": None, "out": group if split == "out" else None, "in": group if split == "in" else None}

    def _rows(self, x: Tensor, contraction: str, grad: bool) -> Quantised:
        """X [M, C] or dY [M, C], one scale per token row (1×128 tiles under blockwise); C is the layer's
        `contraction` dimension, its amax all-reduced over the group splitting it."""
        blockwise = self.recipe == "blockwise"
        block = (1, BLOCK) if blockwise else (1, x.shape[-1])
        fmt = E5M2 if grad and not blockwise else E4M3
        group = None if blockwise else self.groups[contraction]
        return quantise(x, fmt, block, [group] if group is not None else [])

    def _weight(self, weight: Tensor, transposed: bool) -> Quantised:
        """W [E, out, in] (forward) or Wᵀ [E, in, out] (dX's product), per expert, kept in `casts` for the step."""
        def make() -> Quantised:
            dims = ("in", "out") if transposed else ("out", "in")
            if transposed and self.recipe != "rowwise":  # one scale per expert or 128×128 blocks: W's, transposed
                w = self._weight(weight, transposed=False)
                return Quantised(w.data.transpose(1, 2), w.scale.transpose(1, 2), w.block[::-1])
            w = weight.transpose(1, 2) if transposed else weight
            block = {"tensorwise": tuple(w.shape[1:]), "rowwise": (1, w.shape[2])}.get(self.recipe, (BLOCK, BLOCK))
            groups = (self.groups[d] for d in fp8_reduced_over(self.recipe, dims))
            return quantise(w, E4M3, block, [g for g in groups if g is not None])
        return make() if self.casts is None else self.casts.get(self, "wt" if transposed else "w", weight, make)

    @staticmethod
    def _wide(dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if dtype == torch.float64 else torch.float32

    def grouped_forward(self, x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
        wide = self._wide(x.dtype)
        a, w = self._rows(x, "in", grad=False), self._weight(weight, transposed=False)
        if grouped_kernel_takes(a, w, x.dtype, self.recipe):
            return scaled_grouped_mm(a, w, counts)
        return grouped_mm(a.dequantise(wide), w.dequantise(wide).transpose(1, 2), counts).to(x.dtype)

    def grouped_input_grad(self, grad_out: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
        wide = self._wide(grad_out.dtype)
        g, wt = self._rows(grad_out, "out", grad=True), self._weight(weight, transposed=True)
        return grouped_mm(g.dequantise(wide), wt.dequantise(wide).transpose(1, 2), counts).to(grad_out.dtype)

    def grouped_weight_grad(self, grad_out: Tensor, x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
        wide = self._wide(grad_out.dtype)
        g = self._rows(grad_out, "out", grad=True).dequantise(wide)
        a = self._rows(x.to(grad_out.dtype), "in", grad=False).dequantise(wide)
        return torch.stack([g[rows].t() @ a[rows] for rows in group_rows(counts)]).to(weight.dtype)
