"""The tiny GPT and the kernel variants the kernel tests compare (tests/model/test_kernels.py and friends).

Shapes match the CLI runs (2 layers, hidden 32, 4 heads, sequence 16, micro-batch 2) so the CLI's compiles hit
Inductor's on-disk cache filled by the in-process tests.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from mlplat.model import fused
from mlplat.step import TrainStep
from mlplat.train import load_checked

F64 = torch.float64
DROPOUT = 0.1
MODEL = dict(n_layers=2, hidden=32, n_heads=4, seq_len=16, vocab_size=256, dropout=DROPOUT)
MICRO, GLOBAL = 2, 4
TOL = 1e-12  # float64: reassociation inside fused kernels and SDPA's split scaling stay around 1e-15

@contextlib.contextmanager
def eager_fused() -> Iterator[None]:
    """The fused operators run eagerly: the same functions, not compiled. Compiled == eager is
    tests/model/test_fused.py's proof, and the compiled operators train through the CLI in tests/model/test_kernels.py;
    compiling them again in every rank of a multi-process test costs tens of seconds of CPU each and proves no more."""
    saved = fused.get_impl()
    fused.set_impl("eager")
    try:
        yield
    finally:
        fused.set_impl(saved)


VARIANTS = {  # name -> kernels.*; "plain" is the reference
    "plain": dict(attention="math", fused=False, recompute="none"),
    "sdpa": dict(attention="sdpa", fused=False, recompute="none"),
    "selective": dict(attention="math", fused=False, recompute="selective"),
    "full": dict(attention="math", fused=False, recompute="full"),
    "fused": dict(attention="math", fused=True, recompute="none"),
    "fused_selective": dict(attention="math", fused=True, recompute="selective"),
    "sdpa_fused_full": dict(attention="sdpa", fused=True, recompute="full"),
}


def make_cfg(kernels: dict, tp=1, pp=1, vpp=1, dp=1, n_layers=2, schedule="1f1b", global_batch=GLOBAL,
             precision="64-true", model: dict | None = None):
    raw = {"model": {**MODEL, "n_layers": n_layers, **(model or {})},
           "parallel": dict(tp=tp, pp=pp, vpp=vpp, dp=dp, schedule=schedule, micro_batch_size=MICRO,
                            global_batch_size=global_batch),
           "kernels": dict(kernels), "trainer": dict(max_steps=3, precision=precision),
           "logger": dict(name="none"), "sample": dict(max_new_tokens=0), "seed": 1234}
    return load_checked(raw, world_size=tp * pp * dp)  # the tokenizer resolved, as a run has it


def batch(global_batch=GLOBAL, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, MODEL["vocab_size"], (global_batch, MODEL["seq_len"] + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def build(cfg, grid) -> TrainStep:
    step = TrainStep(cfg, grid)  # seeds the default RNG and the tracker: every variant starts from the same state
    for chunk in step.chunks.values():
        chunk.double().train()
    return step


def named_parameters(step: TrainStep) -> dict[str, torch.nn.Parameter]:
    """{chunk id.local name: parameter} of this rank's chunks."""
    return {f"{c}.{n}": p for c, chunk in step.chunks.items() for n, p in chunk.named_parameters()}


def grads_of(cfg, grid, data, loss_scaler=None) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward_backward (forward, backward, reductions; no clipping) -> (loss, {local name: grad})."""
    cfg.optim.grad_clip = 0.0
    step = build(cfg, grid)
    step.loss_scaler = loss_scaler
    loss, _ = step.forward_backward(data)
    return float(loss), {n: p.grad.detach().clone() for n, p in named_parameters(step).items()}


def rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-300)) for n in a)
