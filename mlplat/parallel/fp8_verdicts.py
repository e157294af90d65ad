"""The FP8 kernels' verdicts of a run, decided before step 1 and agreed by every rank (docs/gpu-nccl.md).

Blockwise's block-scaled GEMM (`mlplat.parallel.fp8_blockwise`) and the experts' grouped forward
(`mlplat.parallel.fp8_grouped`) are taken where a probe finds they run and agree with the emulation. Left to the
first GEMM that asks, the probe would run inside step 1's first pipeline pass with receives already posted: its
host read synchronises the compute stream, its first kernel launches may load CUDA modules (a context-wide
synchronisation while NCCL's kernels spin) and its allocations may make the caching allocator free and retry. And
each rank would keep its own verdict: a probe that raised on one rank only (a transient out-of-memory) would give
replicated weights different arithmetic on different ranks.

So the training step decides, once when it is built (the communicators exist, nothing is posted), every verdict
the run will ask for: blockwise into each output dtype of its precision (the GEMMs' and the weights'), and under
`GROUPED_FP8_RECIPES` the experts' kernel where the model has experts and computes in bf16. Each rank probes its
device (any exception is that rank's "no"), then the ranks take the minimum of the int verdicts through one
all-reduce of one CUDA tensor over the world, read on the host, and keep the agreed verdicts: the kernel is taken
only where every rank's probe agreed. Every rank posts it whatever its device's capability (a rank whose GPU has no
such kernel posts its 0s), so the collectives' order is the same everywhere. A CPU run needs no verdict (its FP8
products are the emulation) and posts nothing.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist

from mlplat.parallel import fp8_blockwise, fp8_grouped
from mlplat.precision import (
    BLOCKWISE_OUT,
    GROUPED_FP8_OUT,
    GROUPED_FP8_RECIPES,
    blockwise_verdicts,
    grouped_fp8_verdicts,
    precision_of,
)

log = logging.getLogger("mlplat")

Agree = Callable[[list[int]], list[int]]  # this rank's int verdicts -> every rank's minimum, element by element


def needed(recipe: str, precision: str, experts: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The verdicts a run under kernels.fp8=`recipe` and trainer.precision=`precision` asks for: (blockwise's output
    dtypes, the experts' grouped recipes). A layer's products write the GEMMs' dtype (Y, dX) and the weights' (dW)."""
    entry = precision_of(precision)
    outs = sorted({entry.compute_dtype, entry.weight_dtype})
    blockwise = tuple(o for o in outs if o in BLOCKWISE_OUT) if recipe == "blockwise" else ()
    grouped = (recipe,) if experts and recipe in GROUPED_FP8_RECIPES and entry.compute_dtype == GROUPED_FP8_OUT \
        else ()
    return blockwise, grouped


def world_min(device: torch.device) -> Agree | None:
    """The agreement over the world group: one int32 tensor on `device` (NCCL reduces CUDA tensors only), all-reduced
    by MIN and read on the host; None outside a process group (one process: its own verdicts stand)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None

    def agree(local: list[int]) -> list[int]:
        flags = torch.tensor(local, dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        return flags.tolist()
    return agree


def decide_fp8_kernels(recipe: str, precision: str, experts: bool, device: torch.device,
                       agree: Agree | None) -> dict[tuple, bool]:
    """Probe on this rank every verdict the run needs (`needed`), agree them through `agree` (None: this process
    alone) and keep them in `mlplat.precision`'s verdicts, where the GEMMs read them; returns the agreed verdicts by
    key. On a device other than CUDA, or with nothing needed, nothing is probed and `agree` is not called."""
    blockwise, grouped = needed(recipe, precision, experts)
    if device.type != "cuda" or not (blockwise or grouped):
        return {}
    probes = [(blockwise_verdicts, fp8_blockwise.verdict_key(device, out),
               lambda out=out: fp8_blockwise.local_verdict(device, getattr(torch, out))) for out in blockwise]
    probes += [(grouped_fp8_verdicts, fp8_grouped.verdict_key(device, r),
                lambda r=r: fp8_grouped.local_verdict(device, r)) for r in grouped]
    local = [int(_probed(key, run)) for _, key, run in probes]
    agreed = agree(local) if agree is not None else local
    decided = {}
    for (verdicts, key, _), mine, every in zip(probes, local, agreed):
        verdicts[key] = decided[key] = bool(every)
        if mine and not every:
            log.warning("kernels.fp8=%s on %s (%s): emulated, as on every rank: another rank's probe did not agree",
                        recipe, key[0], ", ".join(key[1:]))
    return decided


def _probed(key: tuple, run: Callable[[], bool]) -> bool:
    """One probe's verdict on this rank; anything it raises (an out-of-memory) is this rank's no, in one line."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - every rank must still post the agreement
        log.warning("kernels.fp8 probe on %s (%s) raised %s: %s; this rank's verdict is the emulation", key[0],
                    ", ".join(key[1:]), type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return False
