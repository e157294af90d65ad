"""The experts' FP8 forward (Y_g = X_g·W_gᵀ, `mlplat.parallel.fp8_experts`) through torch's grouped GEMM with
row-wise scales, where a probe finds that it runs and agrees with the emulation.

torch 2.13's `torch._scaled_grouped_mm` multiplies e4m3 operands with fp32 scales into bf16 only (its meta kernel,
torch/_meta_registrations.py `_meta_grouped_mm_common`, checks what aten/src/ATen/native/cuda/GroupedBlas.cpp
`_scaled_grouped_mm_cuda` does; the CUDA op runs on compute capability 9.0 and 10.0). For A [M, K] 2-d and B
[G, K, N] 3-d (the "2d-3d" case) with `offs`, int32 cumulative row counts of the G groups:

- A row-major, one scale per row: `scale_a` [M], contiguous;
- B column-major in its last two dimensions (Bᵀ_g contiguous: the stacked weight [G, N, K] transposed), one scale
  per column of each group: `scale_b` [G, N], contiguous in N;
- K and N multiples of 16 (the CUDA op's check; the meta kernel asks 16-byte strides); empty groups are repeated
  offsets (`shapes_fit` also keeps M > 1 and M ≠ G, shapes later PyTorch misreads).

So the forward takes X's per-row scales and W's per-expert (`tensorwise`: one scale repeated over the expert's N
rows of W, the same product) or per-row (`rowwise`) scales. Not the others:
- dX = dY·W: dY is e5m2 under these recipes, and the kernel takes e4m3 on both sides (the meta kernel's first
  check; `_f8_f8_bf16_rowwise_grouped_mm_cuda`);
- dW = dYᵀ·X, the "2d-2d" case with `offs` over the tokens (K): besides e5m2, its row-wise scales are one per
  (group, row of dYᵀ) and (group, column of X), outside the contraction, where mlplat's dW carries each token
  row's scale along the contraction (module docstring of `mlplat.parallel.fp8_experts`);
- blockwise (1×128, 128×128): the meta kernel takes fp32 scales in the row-wise shapes only (else e8m0 MX scales),
  `_scaled_grouped_mm_v2` has no meta kernel in torch 2.13, and its CUDA dispatch (`scale_grouped_kernel_dispatch`)
  lists row-wise, MXFP8, MXFP4 and NVFP4 scales (later PyTorch adds Hopper block scales through cuBLASLt, CUDA ≥
  13.4).
These stay the emulation, as do outputs other than bf16 (fp32, fp16, float64 precisions).

The kernel is chosen by a probe, not by name: per (device, output dtype, recipe), on a device of capability
`GROUPED_FP8_SM`, it multiplies a small random grouped problem (`PROBE_COUNTS`, `PROBE_SHAPE`: uneven counts, an
empty expert among them) and is taken only if it runs and agrees with the emulation within `agreement_bound`; the
verdict is logged in one line and kept (`mlplat.precision.grouped_fp8_verdicts`, which `grouped_fp8_gemm_path`
reads). A run probes in setup and keeps the verdict every rank agreed (`mlplat.parallel.fp8_verdicts`); only one
process outside a run probes on first use. Nothing probes on a CPU.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor

from mlplat.parallel.kernel_probe import accumulation_error, cuda_name, excess, kept, raised
from mlplat.parallel.kernel_probe import capability as _capability  # looked up at each call (tests stand in for it)
from mlplat.parallel.quantise import E4M3, Quantised, quantise
from mlplat.precision import GROUPED_FP8_OUT, GROUPED_FP8_RECIPES, GROUPED_FP8_SM, grouped_fp8_verdicts

log = logging.getLogger("mlplat")

OUT = getattr(torch, GROUPED_FP8_OUT)
ALIGN = 16  # K and N: the CUDA op's multiple, 16 bytes of e4m3
PROBE_COUNTS = (48, 0, 16, 96, 32)  # rows per expert: uneven, an empty expert between two others
PROBE_SHAPE = (256, 128)  # K, N


def kernel_operands(a: Quantised, w: Quantised, counts: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(mat_a, mat_b, scale_a, scale_b, offs) of X·W_gᵀ as torch's grouped kernel reads them (module docstring): X
    [M, K] with a scale per row, W [G, N, K] with a scale per expert or per row."""
    groups, n = w.data.shape[:2]
    scale_b = w.scale.reshape(groups, -1).expand(groups, n).contiguous()  # a per-expert scale on each of its rows
    offs = counts.cumsum(0).to(torch.int32)
    return a.data, w.data.transpose(1, 2), a.scale.reshape(-1), scale_b, offs


def scaled_grouped_mm(a: Quantised, w: Quantised, counts: Tensor) -> Tensor:
    """Rows of X (sorted by expert, `counts` [G] each) times their experts' W_gᵀ, in bf16, by torch's kernel."""
    mat_a, mat_b, scale_a, scale_b, offs = kernel_operands(a, w, counts)
    return torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=OUT)


def emulated(a: Quantised, w: Quantised, counts: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The same product as the emulation computes it: each expert's rows of the dequantised X times its W_gᵀ."""
    x, weight, out = a.dequantise(dtype), w.dequantise(dtype), []
    start = 0
    for g, rows in enumerate(counts.tolist()):
        out.append(x[start:start + rows] @ weight[g].t())
        start += rows
    return torch.cat(out)


def shapes_fit(a: Quantised, w: Quantised) -> bool:
    """Whether the kernel takes these operands: both e4m3, X's scales per row, W's per expert or per row, K and N
    multiples of 16, and more rows than one and other than the experts' number (later PyTorch infers the recipe of
    `_scaled_grouped_mm`'s scales from their shapes, `infer_scaling_type`: [1] reads as one scale for all of X,
    and [M] with M = G is refused as ambiguous; the emulation takes those few rows)."""
    (m, k), (groups, n) = a.data.shape, w.data.shape[:2]
    per_row = a.block == (1, k) and w.block in ((n, k), (1, k))
    return (per_row and a.data.dtype == w.data.dtype == E4M3 and k % ALIGN == 0 and n % ALIGN == 0
            and m > 1 and m != groups)


def grouped_kernel_takes(a: Quantised, w: Quantised, out_dtype: torch.dtype, recipe: str) -> bool:
    """Whether the forward runs through the grouped kernel: on CUDA, into bf16, shapes it takes, the probe's
    verdict there."""
    return (a.data.device.type == "cuda" and out_dtype == OUT and shapes_fit(a, w)
            and kernel_agrees(a.data.device, recipe))


def kernel_agrees(device: torch.device, recipe: str) -> bool:
    """The verdict for the grouped kernel on CUDA `device` under `recipe` (into bf16), as kept. A run decides and
    agrees it in setup (`mlplat.parallel.fp8_verdicts`): inside a process group a missing one is raised, never probed
    inside a pass; one process outside a run (a test, a benchmark) probes it here."""
    if recipe not in GROUPED_FP8_RECIPES:
        return False
    key = verdict_key(device, recipe)
    return kept(grouped_fp8_verdicts, key, f"kernels.fp8={recipe}: no verdict for the experts' grouped kernel on "
                                           f"{key[0]}", lambda: local_verdict(device, recipe))


def verdict_key(device: torch.device, recipe: str) -> tuple[str, str, str]:
    return cuda_name(device), GROUPED_FP8_OUT, recipe


def local_verdict(device: torch.device, recipe: str) -> bool:
    """This process's verdict for the grouped kernel on CUDA `device` under `recipe` (one of
    `GROUPED_FP8_RECIPES`): probed now where the device allows, logged in one line, not kept."""
    name = verdict_key(device, recipe)[0]
    sm = _capability(int(name.split(":")[1]))
    if sm not in GROUPED_FP8_SM:
        taken, why = False, f"sm{sm[0]}{sm[1]}: torch's grouped FP8 kernel is sm90's and sm100's only"
    else:
        taken, why = probe(torch.device(name), recipe)
    path = "torch grouped GEMM forward" if taken else "emulated (dequantise, fp32 matmul)"
    log.info("kernels.fp8=%s experts on %s into %s: %s; %s", recipe, name, GROUPED_FP8_OUT, path, why)
    return taken


def probe_operands(device: torch.device, recipe: str) -> tuple[Quantised, Quantised, Tensor]:
    """X, W and counts of the probe: each token row and each expert (or row of W) of magnitude 2^-3..2^3 apart, so
    that a scale or a row read from another expert shows."""
    gen = torch.Generator(device=device).manual_seed(0)
    (k, n), counts = PROBE_SHAPE, torch.tensor(PROBE_COUNTS, device=device)
    groups, m = len(PROBE_COUNTS), sum(PROBE_COUNTS)

    def magnitudes(*shape):
        return torch.exp2(torch.randint(-3, 4, shape, generator=gen, device=device).float())

    x = torch.randn(m, k, generator=gen, device=device) * magnitudes(m, 1)
    w = torch.randn(groups, n, k, generator=gen, device=device) * magnitudes(groups, n if recipe == "rowwise" else 1, 1)
    w_block = (1, k) if recipe == "rowwise" else (n, k)
    return quantise(x, E4M3, (1, k)), quantise(w, E4M3, w_block), counts


def probe(device: torch.device, recipe: str) -> tuple[bool, str]:
    """Run the grouped kernel on `probe_operands` and compare it with the emulation of the same quantised operands:
    (taken, why)."""
    a, w, counts = probe_operands(device, recipe)
    shape = f"{len(PROBE_COUNTS)} experts of {'/'.join(map(str, PROBE_COUNTS))} rows, K={PROBE_SHAPE[0]}, " \
            f"N={PROBE_SHAPE[1]}"
    try:
        got = scaled_grouped_mm(a, w, counts).float()
    except Exception as e:  # noqa: BLE001 - any refusal of the kernel means the emulation
        return False, raised("grouped", e)
    ref = emulated(a, w, counts)
    if got.shape != ref.shape:
        return False, f"the grouped kernel wrote {tuple(got.shape)}, the emulation {tuple(ref.shape)}"
    off = excess(got, ref, agreement_bound(a, w, counts))
    if not off <= 1:
        return False, f"the grouped kernel differs from the emulation by {off:.3g}x the bound (probe: {shape})"
    return True, f"the probe ({shape}) agrees with the emulation within the accumulation bound"


def agreement_bound(a: Quantised, w: Quantised, counts: Tensor) -> Tensor:
    """How far the kernel's product may lie from the emulation's (fp32), element by element, as
    `mlplat.parallel.fp8_blockwise.agreement_bound` argues it: the same exact e4m3 products summed, so with S the
    product of the dequantised magnitudes `accumulation_error`·S, plus the rounding to bf16 (its eps times
    |result|)."""
    s = emulated(Quantised(a.data.abs(), a.scale, a.block), Quantised(w.data.abs(), w.scale, w.block), counts)
    return (accumulation_error(a.data.shape[1]) * s + torch.finfo(OUT).eps * emulated(a, w, counts).abs()
            + torch.finfo(torch.float32).tiny)
