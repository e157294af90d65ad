"""The FP8 quantiser with current scaling (`mlplat.parallel.fp8`'s recipes, the experts' GEMMs, the FP8 dispatch): a
matrix in e4m3 or e5m2 with one float32 scale per block of it, the block's amax over the format's largest value (an
all-zero block keeps scale 1), each block's amax all-reduced (MAX) over the process groups holding its parts."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass
class Quantised:
    """An FP8 matrix [..., rows, C] and its float32 scales, one per block of `block` = (rows, cols) elements: x ≈
    data · scale on each block."""

    data: Tensor
    scale: Tensor
    block: tuple[int, int]

    def dequantise(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.data.to(dtype) * expand(self.scale, self.data.shape, self.block).to(dtype)


def emulated_mm(a: Quantised, b: Quantised, out_dtype: torch.dtype) -> Tensor:
    """A·Bᵀ of two quantised operands [rows, C] as their dequantised values' product: one matmul in fp32, or in
    float64 for a float64 output (the FP8 GEMMs' emulation, and what a kernel's result is checked against)."""
    wide = torch.float64 if out_dtype == torch.float64 else torch.float32
    return (a.dequantise(wide) @ b.dequantise(wide).t()).to(out_dtype)


def expand(scale: Tensor, shape, block: tuple[int, int]) -> Tensor:
    """Per-block `scale` repeated over its blocks of a [..., rows, cols] matrix (broadcastable to it; leading
    dimensions, the experts of a stacked weight, are blocked apart)."""
    (rows, cols), (rb, cb) = shape[-2:], block
    scale = scale.repeat_interleave(rb, -2)[..., :rows, :] if scale.shape[-2] > 1 else scale
    return scale.repeat_interleave(cb, -1)[..., :cols] if scale.shape[-1] > 1 else scale


def block_amax(x: Tensor, block: tuple[int, int]) -> Tensor:
    """The largest magnitude in each (rows, cols) block of the matrix `x` [..., rows, cols] (the last blocks may be
    partial; each leading index, an expert, apart), in fp32."""
    rb, cb = block
    a = F.pad(x.detach().abs().float(), (0, -x.shape[-1] % cb, 0, -x.shape[-2] % rb))
    return a.view(*a.shape[:-2], a.shape[-2] // rb, rb, a.shape[-1] // cb, cb).amax(dim=(-3, -1))


def quantise(x: Tensor, fmt: torch.dtype, block: tuple[int, int], groups=()) -> Quantised:
    """`x` [..., rows, C] in `fmt` with one scale per block; each block's amax first all-reduced (MAX) over
    `groups`, the process groups over which the block's elements are spread (none: the block lies on this rank)."""
    amax = block_amax(x, block)
    for group in groups:  # on x's device (NCCL reduces CUDA tensors); the host never reads it
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    fmax = torch.finfo(fmt).max
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))  # an all-zero block keeps scale 1
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    data = (x.detach().to(wide) / expand(scale, x.shape, block).to(wide)).clamp(-fmax, fmax).to(fmt)
    return Quantised(data.contiguous(), scale, block)
