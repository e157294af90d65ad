"""One flat host buffer that asynchronous saves copy a rank's device tensors into, reused from one save to the next.

Pinning each tensor's copy on its own goes through PyTorch's caching host allocator, which rounds every block up to
a power of two and keeps it for the process's life: 1-2x the state pinned per rank for the whole run, beside the
one buffer the save needs. An `AsyncSaver` starts a save only once the previous one is written, so one buffer serves
every save: allocated at the first, grown (the smaller freed first) when the state grows, each tensor a view of it
at an offset aligned to ALIGN bytes (any dtype's element size divides it).
"""
from __future__ import annotations

import torch

ALIGN = 256  # bytes; the CUDA copy engines' and every dtype's alignment


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class HostArena:
    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin  # pinning needs a CUDA context
        self.buffer: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def views(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """An empty host tensor of each one's shape and dtype, all views of the one buffer (the previous save's
        views are overwritten: its writes must be done)."""
        total = sum(aligned(t.numel() * t.element_size()) for t in tensors)
        if self.nbytes < total:
            self.buffer = None  # freed before the larger one is taken
            self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=self.pin)
        out, offset = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            out.append(self.buffer[offset: offset + nbytes].view(t.dtype).view(t.shape))
            offset += aligned(nbytes)
        return out
