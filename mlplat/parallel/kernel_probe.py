"""What the probed FP8 kernels share (`mlplat.parallel.fp8_blockwise`, `mlplat.parallel.fp8_grouped`): the verdict
kept per key and never probed inside a run's pass, the CUDA device's name and capability, and a probe's comparison
with the emulation against the accumulation bound."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from mlplat.precision import FP8_BLOCK

# The tensor cores' accumulator inside a K tile: FP8 MMA on Hopper keeps "around 14 bits" (DeepSeek-V3 §3.3.2),
# taken as 13 mantissa bits, truncated; the kernel promotes to fp32 to apply each tile's scales. A bound of fp32's
# error alone would refuse a correct kernel for its hardware's accumulation.
TILE_ACCUMULATOR_EPS = 2.0**-13
FP32_EPS = 2.0**-24  # fp32's unit roundoff: the emulation's sums, and the kernel's sum over tiles


def accumulation_error(k: int) -> float:
    """The relative error of one of a kernel's K-long sums against the emulation's, per unit of S = |A|·|B|ᵀ: the
    kernel's in-tile accumulation 128·TILE_ACCUMULATOR_EPS, its fp32 sum over the ceil(K/128) tiles and the two
    scalings (K/128 + 2)·u, and the emulation's fp32 dot product (K + 2)·u (u = 2^-24; Higham's γ_n bounds)."""
    return FP8_BLOCK * TILE_ACCUMULATOR_EPS + (-(-k // FP8_BLOCK) + 2 + k + 2) * FP32_EPS


def cuda_name(device: torch.device) -> str:
    """"cuda:I" of a CUDA device (the current one where it names none)."""
    return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"


def capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def kept(verdicts: dict, key: tuple, missing: str, local: Callable[[], bool]) -> bool:
    """The verdict kept under `key`. A run decides and agrees every verdict it needs in setup
    (`mlplat.parallel.fp8_verdicts`), so inside a process group a missing one is a fault, raised (`missing` says
    which) rather than probed inside a pass; one process outside a run (a test, a benchmark) probes it here
    (`local`) and keeps it."""
    if key not in verdicts:
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(f"{missing}; a run decides its kernels before step 1 (mlplat.parallel.fp8_verdicts), "
                               f"never inside a pass")
        verdicts[key] = local()
    return verdicts[key]


def raised(what: str, e: Exception) -> str:
    """A probe's reason where the kernel raised: the emulation."""
    return f"the {what} kernel raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def excess(got: Tensor, ref: Tensor, bound: Tensor) -> float:
    """The largest |got - ref| over its bound, element by element (inf where a NaN shows); the kernel agrees at 1 or
    less."""
    return float(((got - ref).abs() / bound).nan_to_num(float("inf")).max())
