"""The CUDA caching allocator's retries, counted and named.

When a `cudaMalloc` fails, PyTorch's caching allocator frees its cached blocks and tries again; freeing them
(`cudaFree`) synchronises the whole device. While a pipeline rank has receives posted ahead, such a sync waits
for transfers that need a peer's next compute, as `torch.cuda.synchronize()` does: the transport model deadlocks
on it (`tests/perf/test_transport.py`). The planner keeps a layout under `usable_fraction` of the device memory so
that steady state needs no retry; a step that did retry is named in one line, and so is the count in a hang
report, since such a hang's cause is then memory, not a peer (docs/gpu-nccl.md).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger("mlplat")


class AllocatorRetries:
    """Counts `num_alloc_retries` of the caching allocator on `device` (always 0 off CUDA). `stats` reads the
    allocator's counters without touching the device (a host-side table)."""

    def __init__(self, device: torch.device, stats: Callable[[torch.device], dict] | None = None):
        self.device = device
        self.stats = stats or (torch.cuda.memory_stats if device.type == "cuda" else None)
        self.seen = 0

    def total(self) -> int:
        return int(self.stats(self.device).get("num_alloc_retries", 0)) if self.stats is not None else 0

    def since_last(self) -> int:
        """Retries since the previous call."""
        now = self.total()
        new, self.seen = now - self.seen, now
        return new

    def warn_if_retried(self, rank: int, step: int) -> None:
        """One line for a step during which the allocator retried (since the previous call)."""
        if retries := self.since_last():
            log.warning("rank %d, step %d: the CUDA caching allocator retried %d allocation(s) after freeing its "
                        "cache, each a device-wide synchronize that can stall or deadlock posted pipeline transfers "
                        "(docs/gpu-nccl.md): lower the memory per device (micro-batch, recomputation, layout)",
                        rank, step, retries)

    def note(self) -> str:
        """What a hang report adds: empty without retries."""
        n = self.total()
        return (f"; the CUDA caching allocator retried {n} allocation{'s' * (n != 1)} after freeing its cache, each "
                "a device-wide synchronize that can stall posted pipeline transfers (docs/gpu-nccl.md)") if n else ""
