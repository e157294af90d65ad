"""Blockwise FP8 (DeepSeek-V3's 1×128 and 128×128 scales) through torch's block-scaled GEMM, where a probe finds that
it runs and agrees with the emulation.

torch 2.13 takes block scales through `torch.nn.functional.scaled_mm` (the op `_scaled_mm_v2`): both operands e4m3,
fp32 scales, ScalingType BlockWise1x128 for A and BlockWise128x128 (a weight) or BlockWise1x128 (dW's Xᵀ) for B.
Its CUDA implementation runs these on compute capability 9.x only and with cuBLASLt ≥ 12.9
(aten/src/ATen/native/cuda/ScaledBlas.cpp, `_check_deepseek_support`); a CPU has no kernel for them. The layouts,
for A [M, K] row-major times mat2 = Bᵀ [K, N] column-major, are those of torch/_meta_registrations.py,
`_check_scaled_mm_sizes_v2`, branches `is_1x128_128x128` and `is_1x128_1x128` (the CUDA op checks the same):

- A's 1×128 scales: shape [M, K/128], strides (1, M): M contiguous ("outer-dim-major"), the transpose of a
  contiguous [K/128, M];
- B's 128×128 scales: shape [L4, N/128], strides (1, L4), L4 = K/128 rounded up to a multiple of 4: B's
  [N/128, K/128] scales padded in K to L4 columns, stored K contiguous;
- B's 1×128 scales: shape [N, K/128], strides (1, N), as A's.

The meta checks count K/128 and N/128 by floor, the CUDA op by ceiling: the kernel takes K (and N under 128×128
blocks) in whole multiples of 128 only, and every dimension in multiples of 16 (both checks); other shapes take
the emulation.

The kernel is chosen by a probe, not by name: per (device, output dtype), on sm90 with torch built on CUDA ≥ 12.9,
it multiplies small random operands (`PROBE`, both scale pairs) and is taken only if it runs and agrees with the
emulation within `agreement_bound`; the verdict is logged in one line and kept (`mlplat.precision.blockwise_verdicts`,
which `fp8_gemm_path` reads). A run probes in setup and keeps the verdict every rank agreed
(`mlplat.parallel.fp8_verdicts`); only one process outside a run probes on first use. Nothing probes on a CPU.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from mlplat.parallel.kernel_probe import accumulation_error, cuda_name, excess, kept, raised
from mlplat.parallel.kernel_probe import capability as _capability  # looked up at each call (tests stand in for it)
from mlplat.parallel.quantise import E4M3, Quantised, emulated_mm, expand, quantise
from mlplat.precision import BLOCKWISE_OUT, BLOCKWISE_SM, FP8_BLOCK, blockwise_verdicts

log = logging.getLogger("mlplat")

TILE, BLOCK = (1, FP8_BLOCK), (FP8_BLOCK, FP8_BLOCK)
PROBE = (256, 384, 256)  # M, N, K: two K tiles, padded to four in the 128×128 scales; N three weight blocks
MIN_CUDA = (12, 9)  # cuBLASLt's block-scaled GEMM


def kernel_scales(a: Quantised, b: Quantised) -> tuple[Tensor, Tensor]:
    """A's and B's scales of A·Bᵀ in the layouts torch's block-scaled GEMM reads (module docstring)."""
    k_tiles = a.data.shape[1] // FP8_BLOCK
    scale_a = a.scale.t().contiguous().t()  # [M, K/128], strides (1, M)
    if b.block == BLOCK:
        padded = -(-k_tiles // 4) * 4
        scale_b = F.pad(b.scale, (0, padded - k_tiles)).t()  # [L4, N/128], strides (1, L4)
    else:
        scale_b = b.scale.t().contiguous().t()  # [N, K/128], strides (1, N)
    return scale_a, scale_b


def block_scaled_mm(a: Quantised, b: Quantised, out_dtype: torch.dtype) -> Tensor:
    """A·Bᵀ in `out_dtype` through torch's block-scaled GEMM (A in 1×128 tiles; B in 128×128 blocks or 1×128 tiles)."""
    scale_a, scale_b = kernel_scales(a, b)
    kind = {TILE: F.ScalingType.BlockWise1x128, BLOCK: F.ScalingType.BlockWise128x128}
    return F.scaled_mm(a.data, b.data.t(), scale_a, kind[a.block], scale_b, kind[b.block], output_dtype=out_dtype)


def shapes_fit(a: Quantised, b: Quantised) -> bool:
    """Whether the kernel takes these operands: A in tiles, B in blocks or tiles, K (and N under blocks) in whole
    128s, every dimension a multiple of 16."""
    (m, k), n = a.data.shape, b.data.shape[0]
    if a.block != TILE or b.block not in (TILE, BLOCK) or a.data.dtype != E4M3 or b.data.dtype != E4M3:
        return False
    return k % FP8_BLOCK == 0 and n % (FP8_BLOCK if b.block == BLOCK else 16) == 0 and m % 16 == 0 and n % 16 == 0


def block_scaled_takes(a: Quantised, b: Quantised, out_dtype: torch.dtype) -> bool:
    """Whether A·Bᵀ runs through the block-scaled kernel: on CUDA, shapes it takes, and its probe's verdict there."""
    return a.data.device.type == "cuda" and shapes_fit(a, b) and kernel_agrees(a.data.device, out_dtype)


def kernel_agrees(device: torch.device, out_dtype: torch.dtype) -> bool:
    """The verdict for the block-scaled kernel on CUDA `device` into `out_dtype`, as kept. A run decides and agrees
    every verdict it needs in setup (`mlplat.parallel.fp8_verdicts`), so inside a process group a missing one is a
    fault, raised rather than probed inside a pass; one process outside a run (a test, a benchmark) probes it here."""
    out = str(out_dtype).removeprefix("torch.")
    if out not in BLOCKWISE_OUT:
        return False  # float64 (64-true) computes wider: the emulation
    key = verdict_key(device, out)
    return kept(blockwise_verdicts, key, f"kernels.fp8=blockwise: no verdict for {key[0]} into {out}",
                lambda: local_verdict(device, out_dtype))


def verdict_key(device: torch.device, out: str) -> tuple[str, str]:
    return cuda_name(device), out


def local_verdict(device: torch.device, out_dtype: torch.dtype) -> bool:
    """This process's verdict for the kernel on CUDA `device` into `out_dtype` (one of `BLOCKWISE_OUT`): probed now
    where the device and torch's CUDA allow, logged in one line, not kept."""
    name, out = verdict_key(device, str(out_dtype).removeprefix("torch."))
    sm, cuda = _capability(int(name.split(":")[1])), _cuda_version()
    if sm != BLOCKWISE_SM:
        taken, why = False, f"sm{sm[0]}{sm[1]}: torch's block-scaled kernel is sm90's only"
    elif cuda is None or cuda < MIN_CUDA:
        taken, why = False, f"torch is built with CUDA {torch.version.cuda}, the kernel needs 12.9"
    else:
        taken, why = probe(torch.device(name), out_dtype)
    path = "torch block-scaled GEMM" if taken else "emulated (dequantise, fp32 matmul)"
    log.info("kernels.fp8=blockwise on %s into %s: %s; %s", name, out, path, why)
    return taken


def probe(device: torch.device, out_dtype: torch.dtype) -> tuple[bool, str]:
    """Run the block-scaled kernel on random operands of `PROBE`'s shape (A·Wᵀ with W in blocks, A·Xᵀ with X in
    tiles) and compare it with the emulation of the same quantised operands: (taken, why)."""
    m, n, k = PROBE
    gen = torch.Generator(device=device).manual_seed(0)

    def operand(rows: int, block: tuple[int, int]) -> Quantised:
        # blocks of magnitudes 2^-3..2^3 apart, so that a scale read from another block shows (and fp16 holds A·Bᵀ)
        exponent = torch.randint(-3, 4, (rows // block[0], k // FP8_BLOCK), generator=gen, device=device)
        x = torch.randn(rows, k, generator=gen, device=device) * expand(torch.exp2(exponent.float()), (rows, k), block)
        return quantise(x, E4M3, block)

    a = operand(m, TILE)
    for b, what in ((operand(n, BLOCK), "1x128 by 128x128"), (operand(n, TILE), "1x128 by 1x128")):
        try:
            got = block_scaled_mm(a, b, out_dtype).float()
        except Exception as e:  # noqa: BLE001 - any refusal of the kernel means the emulation
            return False, raised(what, e)
        off = excess(got, emulated_mm(a, b, torch.float32), agreement_bound(a, b, out_dtype))
        if not off <= 1:
            return False, f"the {what} kernel differs from the emulation by {off:.3g}x the bound (probe {m}x{n}x{k})"
    return True, f"the probe ({m}x{n}x{k}, both scale pairs) agrees with the emulation within the accumulation bound"


def agreement_bound(a: Quantised, b: Quantised, out_dtype: torch.dtype) -> Tensor:
    """How far the kernel's A·Bᵀ may lie from the emulation's (fp32) one, element by element: each computes sums of
    the same exact products (e4m3·e4m3 is exact in fp32) times scales, so with S = |A|·|B|ᵀ (dequantised
    magnitudes) `accumulation_error`·S, plus the rounding to `out_dtype`, its eps times |result|. A scale read from
    another block is off by a power of two (`probe`'s operands) and leaves this bound by orders of magnitude."""
    s = a.dequantise().abs() @ b.dequantise().abs().t()
    ref = emulated_mm(a, b, torch.float32).abs()
    return accumulation_error(a.data.shape[1]) * s + torch.finfo(out_dtype).eps * ref + torch.finfo(torch.float32).tiny


def _cuda_version() -> tuple[int, int] | None:
    """The CUDA version torch was built with, (major, minor); None for a build without CUDA."""
    v = torch.version.cuda
    return tuple(int(p) for p in v.split(".")[:2]) if v else None
