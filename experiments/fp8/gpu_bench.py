"""FP8 on one GPU: the GEMM's TFLOP/s and a training step's MFU, FP8 recipes beside bf16 (part of
experiments/gpu_check/run.sh).

    python experiments/fp8/gpu_bench.py --out results.json     # on cuda:0 (an FP8 device: sm_89 or later)
    python experiments/fp8/gpu_bench.py --tiny                  # on CPU: exercises the script, numbers meaningless

GEMMs: for the shapes of a 1.3B and an 8B model's layer GEMMs (tokens × out × in), a bf16 `torch.matmul` and
mlplat's FP8 product (`mlplat.parallel.fp8`: both operands quantised under the recipe, then `scaled_mm`), timed
with the casts and without them (operands already quantised: the kernel alone), in TFLOP/s against the device's
dense peaks (H100/H200: bf16 989, fp8 1,979). Each row says whether `torch._scaled_mm` ran or the emulation did
(blockwise: torch's block-scaled kernel on sm90 where its probe agrees, else the emulation).
Step: mlplat's training step (TrainStep: forward, backward, AdamW) of a 1.3B GPT in bf16-megatron with
kernels.fp8 = none, tensorwise, rowwise; model TFLOP/s per step and MFU against the bf16 peak (the convention of
the dry run's MFU), and the losses of the timed steps (FP8 must train the same numbers to about 1e-2).
Exits 2 without a CUDA device unless --tiny.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mlplat.config import KernelsConfig, load_config  # noqa: E402
from mlplat.parallel import fp8  # noqa: E402
from mlplat.parallel.grid import ParallelGrid  # noqa: E402
from mlplat.perf.devices import DEVICES, current_device, peak_flops  # noqa: E402
from mlplat.perf.flops import ModelDims, model_flops_per_token  # noqa: E402
from mlplat.step import TrainStep  # noqa: E402

SHAPES = {"1.3B qkv": (8192, 6144, 2048), "1.3B fc2": (8192, 2048, 8192), "8B fc1": (8192, 28672, 4096),
          "8B out": (8192, 4096, 4096)}
TINY_SHAPES = {"tiny": (64, 48, 32)}
GPT_1P3B = dict(n_layers=24, hidden=2048, n_heads=16, seq_len=2048, vocab_size=51200, dropout=0.0)
TINY = dict(n_layers=2, hidden=64, n_heads=4, seq_len=64, vocab_size=256, dropout=0.0)
RECIPES = ("tensorwise", "rowwise", "blockwise")


def timed(fn, device, warmup: int, reps: int) -> float:
    """Median seconds of `fn()`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def gemms(device, shapes, dev, warmup: int, reps: int) -> list[dict]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (m, n, k) in shapes.items():
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen)
        flops = 2.0 * m * n * k
        bf16 = timed(lambda: x @ w.t(), device, warmup, reps)
        rows.append(dict(shape=name, mnk=(m, n, k), recipe="bf16", path="matmul", tflops=flops / bf16 / 1e12,
                         of_peak=flops / bf16 / peak_flops(dev, "bf16")))
        for recipe in RECIPES:
            gemm = fp8.Fp8Gemm(recipe, ParallelGrid(), "out")
            a = gemm._quantise(x, fp8.FP8_PRODUCTS["forward"][0], weight=False, grad=False)
            b = gemm._quantise(w, fp8.FP8_PRODUCTS["forward"][1], weight=True, grad=False)
            path = "_scaled_mm" if fp8._scaled_mm_takes(a, b, torch.bfloat16, recipe) else "emulation"
            kernel = timed(lambda: fp8.scaled_mm(a, b, torch.bfloat16, recipe), device, warmup, reps)
            with_casts = timed(lambda: gemm.forward(x, w, None), device, warmup, reps)
            fp8_peak = peak_flops(dev, "fp8") if "fp8" in dev.peak_tflops else float("nan")
            rows.append(dict(shape=name, mnk=(m, n, k), recipe=recipe, path=path, tflops=flops / kernel / 1e12,
                             of_peak=flops / kernel / fp8_peak, tflops_with_casts=flops / with_casts / 1e12,
                             speedup_over_bf16=bf16 / with_casts))
        for r in rows[-1 - len(RECIPES):]:
            extra = (f", with casts {r['tflops_with_casts']:8.1f} ({r['speedup_over_bf16']:.2f}x bf16)"
                     if "tflops_with_casts" in r else "")
            print(f"  {r['shape']:<9} {r['recipe']:<10} {r['path']:<10} {r['tflops']:8.1f} TFLOP/s "
                  f"({r['of_peak']:.0%} of peak){extra}", flush=True)
    return rows


def steps(device, m: dict, dev, micro: int, global_batch: int, warmup: int, reps: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, m["vocab_size"], (global_batch, m["seq_len"] + 1), generator=gen)
    batch = data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)
    flops = model_flops_per_token(ModelDims.from_config(m)) * global_batch * m["seq_len"]
    peak = peak_flops(dev, "bf16")
    rows = []
    for recipe in ("none", "tensorwise", "rowwise"):
        raw = {"model": m, "parallel": dict(micro_batch_size=micro, global_batch_size=global_batch),
               "kernels": dict(attention="sdpa", fp8=recipe),
               "trainer": dict(precision="bf16-megatron", max_steps=10**6),
               "optim": dict(lr=1e-4, min_lr=1e-5, warmup_steps=0, grad_clip=1.0), "logger": dict(name="none")}
        cfg = load_config(raw, world_size=1)
        cfg.kernels = KernelsConfig(attention="sdpa", fp8=recipe)
        seconds, losses = _time_steps(TrainStep(cfg, ParallelGrid(), device), batch, device, warmup, reps)
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        rows.append(dict(recipe=recipe, step_s=seconds, model_tflops=flops / seconds / 1e12,
                         mfu=flops / seconds / peak, losses=losses, peak_mem_gib=mem))
        print(f"  step {recipe:<10} {seconds * 1e3:9.1f} ms  {flops / seconds / 1e12:8.1f} model TFLOP/s  "
              f"MFU {flops / seconds / peak:6.1%} (of bf16 peak)  losses {[round(x, 4) for x in losses]}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    return rows


def _time_steps(module: TrainStep, batch, device, warmup: int, reps: int) -> tuple[float, list[float]]:
    """Median seconds of one optimizer step of `module` (the same seed: the same initial weights every recipe),
    and the losses of every step run."""
    losses: list[float] = []
    seconds = timed(lambda: losses.extend(float(r.loss) for r in module.run(batch)), device, warmup, reps)
    return seconds, losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy shapes on CPU (checks the script, numbers meaningless)")
    ap.add_argument("--out", default=None, help="JSON results")
    args = ap.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("error: no CUDA device; run with --tiny to exercise the script on CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.tiny else "cuda")
    dev = DEVICES["cpu"] if args.tiny else current_device()
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(f"device: {name} -> '{dev.name}', dense peaks {dev.peak_tflops}")
    warmup, reps = (1, 2) if args.tiny else (3, 10)
    out = {"device": name, "entry": dev.name,
           "gemms": gemms(device, TINY_SHAPES if args.tiny else SHAPES, dev, warmup, reps),
           "steps": steps(device, TINY if args.tiny else GPT_1P3B, dev, 2, 4, 1 if args.tiny else 2,
                          1 if args.tiny else 5)}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
