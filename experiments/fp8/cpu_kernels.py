"""Which kernel a CPU should run an FP8 product with, measured: torch._scaled_mm with scalar (tensorwise) scales,
torch._scaled_mm with row-wise scales, and the emulation (dequantise, then one fp32 matmul), side by side on the
same operands, with whether each result equals the emulation's bit for bit.

    python experiments/fp8/cpu_kernels.py            # a few of the main job's and Table 1's GEMM shapes
    python experiments/fp8/cpu_kernels.py --quick    # one shape

mlplat.precision.fp8_gemm_path reads the answer: on a CPU every recipe takes the emulation (the scalar-scale kernel
is 100-1000x slower, and the row-wise kernel computes the emulation's exact result at about its speed).
"""
from __future__ import annotations

import sys
import time

import torch

from mlplat.parallel.fp8 import E4M3, emulated_mm, quantise

SHAPES = [(1024, 128, 256), (2048, 256, 1024), (4096, 512, 512)]  # M, N, K: tokens, out, in


def _best(fn, repeats: int) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(args: list[str]) -> int:
    torch.set_num_threads(1)  # as a rank of a CPU run has it
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, 1 thread; seconds per product (best of 3; the scalar kernel once)")
    print("| M x N x K | scalar scales | row-wise scales | emulation | scalar / emulation | row-wise == emulation |")
    print("|---|---|---|---|---|---|")
    for m, n, k in SHAPES[:1] if "--quick" in args else SHAPES:
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        a, b = quantise(x, E4M3, (m, k)), quantise(w, E4M3, (n, k))  # one scale each: tensorwise
        rows_a, rows_b = a.scale.expand(m, 1).contiguous(), b.scale.expand(1, n).contiguous()
        scalar, _ = _best(lambda: torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale, scale_b=b.scale,
                                                   out_dtype=torch.float32), 1)
        rowwise, y_rows = _best(lambda: torch._scaled_mm(a.data, b.data.t(), scale_a=rows_a, scale_b=rows_b,
                                                         out_dtype=torch.float32), 3)
        emulated, y_emul = _best(lambda: emulated_mm(a, b, torch.float32), 3)
        print(f"| {m} x {n} x {k} | {scalar:.4f} | {rowwise:.4f} | {emulated:.4f} | {scalar / emulated:.0f}x | "
              f"{torch.equal(y_rows, y_emul)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
