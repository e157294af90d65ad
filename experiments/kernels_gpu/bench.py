"""Kernel benchmark on one GPU: mlplat's GPT (~1.3B: 24 layers, hidden 2048, 16 heads, sequence 2048, bf16)
under each attention backend with the fused operators off and on, next to a plain PyTorch + SDPA training loop
on the same model shape in the same run. Prints model TFLOP/s and MFU (model FLOPs, the paper's 72·B·s·l·h²·(…)
formula, against the device's dense bf16 peak: 989 TFLOP/s on H100/H200) side by side.

    python experiments/kernels_gpu/bench.py                     # the 1.3B model on cuda:0
    python experiments/kernels_gpu/bench.py --recompute selective --micro-batch 8
    python experiments/kernels_gpu/bench.py --tiny              # a toy model on CPU: exercises the script only

mlplat is driven without Lightning (TrainStep + forward_backward + AdamW, at t = p = d = 1, m micro-batches
per step through the pipeline engine), exactly as its training step does it, so the comparison with the peer
loop measures the model and its kernels, not the trainer. Both run the same optimizer (AdamW, foreach), the
same clipping (global norm 1.0), the same dropout (0.1) and the same micro-batch accumulation.
Results also go to --out (JSON). See README.md: this has not yet been run on a GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))

from peer_gpt import PeerGPT  # noqa: E402

from mlplat.config import KernelsConfig, load_config  # noqa: E402
from mlplat.model import fused as fused_ops  # noqa: E402
from mlplat.model.attention import flash_available  # noqa: E402
from mlplat.parallel.grid import ParallelGrid  # noqa: E402
from mlplat.perf.devices import DEVICES, current_device, peak_flops  # noqa: E402
from mlplat.perf.flops import ModelDims, model_flops_per_token  # noqa: E402
from mlplat.step import TrainStep  # noqa: E402

GPT_1P3B = dict(n_layers=24, hidden=2048, n_heads=16, seq_len=2048, vocab_size=51200, dropout=0.1)
TINY = dict(n_layers=2, hidden=64, n_heads=4, seq_len=64, vocab_size=256, dropout=0.1)


# ------------------------------------------------------------------------------------------ the peer: plain PyTorch

# The peer (plain PyTorch GPT) is shared with the other benchmarks: experiments/peer_gpt.py


# ------------------------------------------------------------------------------------------ timing

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, warmup: int, steps: int, device) -> tuple[float, float]:
    """(median seconds per step over `steps`, seconds spent in warm-up incl. compilation)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync(device)
    warm = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2], warm


def make_batch(args, m: dict, device):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, m["vocab_size"], (args.global_batch, m["seq_len"] + 1), generator=g)
    return data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)


def autocast(device, precision: str):
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


def bench_mlplat(module, opt, batch, args, device):
    def step():
        opt.zero_grad(set_to_none=True)
        with autocast(device, args.precision):
            module.forward_backward(batch)
        opt.step()
    return time_steps(step, args.warmup, args.steps, device)


def bench_peer(m, batch, args, device):
    model = PeerGPT(**m).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tokens, labels = batch
    n_micro = args.global_batch // args.micro_batch

    def step():
        opt.zero_grad(set_to_none=True)
        for t, y in zip(tokens.split(args.micro_batch), labels.split(args.micro_batch)):
            with autocast(device, args.precision):
                loss = model(t, y) / n_micro
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    result = time_steps(step, args.warmup, args.steps, device)
    return result


# ------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy model on CPU (checks the script, numbers meaningless)")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default 4; tiny 2)")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step (default 8; tiny 4)")
    ap.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    ap.add_argument("--backends", default="flash,sdpa,math", help="comma list; unavailable ones are reported")
    ap.add_argument("--fused", default="off,on", help="comma list of off/on")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (compilation happens here)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (median reported)")
    ap.add_argument("--out", default=None, help="JSON results (default experiments/kernels_gpu/results.json; "
                                                "none with --tiny)")
    args = ap.parse_args(argv)

    tiny = args.tiny
    if not tiny and not torch.cuda.is_available():
        print("error: no CUDA device; run with --tiny to exercise the script on CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if tiny else "cuda")
    m = dict(TINY if tiny else GPT_1P3B)
    args.micro_batch = args.micro_batch or (2 if tiny else 4)
    args.global_batch = args.global_batch or (4 if tiny else 8)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 3)
    args.steps = args.steps if args.steps is not None else (2 if tiny else 10)
    args.precision = "bf16-mixed"
    # --tiny writes no JSON unless asked: its numbers only show that the script runs.
    out = Path(args.out) if args.out else (None if tiny else REPO / "experiments" / "kernels_gpu" / "results.json")
    dev = current_device() if not tiny else DEVICES["cpu"]
    peak = peak_flops(dev, args.precision)
    dims = ModelDims.from_config(m)
    flops_per_token = model_flops_per_token(dims)
    tokens_per_step = args.global_batch * m["seq_len"]
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(f"device: {name} -> '{dev.name}', dense bf16 peak {peak / 1e12:g} TFLOP/s"
          f"{' (nominal)' if dev.nominal else ''}")
    print(f"model: {m['n_layers']} layers, hidden {m['hidden']}, {m['n_heads']} heads, seq {m['seq_len']}, "
          f"vocab {m['vocab_size']}; micro-batch {args.micro_batch}, global batch {args.global_batch}, "
          f"recompute={args.recompute}, {args.precision}; {flops_per_token / 1e9:.3g} GFLOP/token (model FLOPs)")

    rows = []

    def record(label, attention, fused, recompute, seconds, warm, note=""):
        tps = tokens_per_step / seconds
        tflops = tps * flops_per_token / 1e12
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        rows.append(dict(run=label, attention=attention, fused=fused, recompute=recompute, step_s=seconds,
                         warmup_s=warm, tokens_per_s=tps, model_tflops=tflops, mfu=tflops * 1e12 / peak,
                         peak_mem_gib=mem, note=note))
        print(f"  {label:<22} {seconds * 1e3:9.1f} ms/step  {tflops:8.3g} TFLOP/s  MFU {tflops * 1e12 / peak:6.1%}"
              f"  (warm-up {warm:.1f} s){'  ' + note if note else ''}", flush=True)

    batch = make_batch(args, m, device)
    raw = {"model": m, "parallel": dict(micro_batch_size=args.micro_batch, global_batch_size=args.global_batch),
           "kernels": dict(attention="sdpa"), "trainer": dict(precision=args.precision, max_steps=10**6),
           "optim": dict(lr=1e-4, min_lr=1e-5, warmup_steps=0, grad_clip=1.0), "logger": dict(name="none")}
    cfg = load_config(raw, world_size=1)
    grid = ParallelGrid()

    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        for fused_flag in [f.strip() == "on" for f in args.fused.split(",") if f.strip()]:
            label = f"mlplat {backend}{' +fused' if fused_flag else ''}"
            if backend == "flash":
                ok, why = flash_available()
                if not ok:
                    print(f"  {label:<22} skipped: {why}")
                    rows.append(dict(run=label, attention=backend, fused=fused_flag, note=f"skipped: {why}"))
                    continue
            cfg.kernels = KernelsConfig(attention=backend, fused=fused_flag, recompute=args.recompute)
            t = time.perf_counter()
            module = TrainStep(cfg, grid, device)  # the same initial weights every time: the same seed
            print(f"mlplat model built: {sum(p.numel() for p in module.parameters()) / 1e9:.3f} B parameters "
                  f"({time.perf_counter() - t:.1f} s)", flush=True)
            opt = module.optimizer
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                seconds, warm = bench_mlplat(module, opt, batch, args, device)
            except torch.OutOfMemoryError as e:
                print(f"  {label:<22} out of memory: {str(e).splitlines()[0]}")
                rows.append(dict(run=label, attention=backend, fused=fused_flag, note="out of memory"))
                continue
            finally:
                del opt, module
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            note = ""
            if fused_flag:
                status = fused_ops.status()
                eager = [k for k, v in status.items() if v.startswith("eager")]
                note = f"fused eager: {', '.join(eager)}" if eager else "fused: compiled"
            record(label, backend, fused_flag, args.recompute, seconds, warm, note)

    if not args.no_peer:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        seconds, warm = bench_peer(m, batch, args, device)
        record("plain PyTorch + SDPA", "sdpa", False, "none", seconds, warm, "peer")

    print()
    header = "| run | attention | fused | recompute | ms/step | tokens/s | model TFLOP/s | MFU | peak mem GiB |"
    print(header)
    print("|" + "---|" * 9)
    for r in rows:
        if "step_s" not in r:
            print(f"| {r['run']} | {r['attention']} | {r['fused']} | – | – | – | – | – | {r['note']} |")
            continue
        print(f"| {r['run']} | {r['attention']} | {r['fused']} | {r['recompute']} | {r['step_s'] * 1e3:.1f} | "
              f"{r['tokens_per_s']:.0f} | {r['model_tflops']:.3g} | {r['mfu']:.1%} | {r['peak_mem_gib']:.1f} |")
    if out is None:
        return 0
    out.write_text(json.dumps({"device": name, "device_entry": dev.name, "peak_tflops": peak / 1e12,
                               "model": m, "micro_batch": args.micro_batch, "global_batch": args.global_batch,
                               "precision": args.precision, "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
