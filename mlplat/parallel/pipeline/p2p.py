"""Point-to-point transfers between pipeline stages.

Every message is tagged by (kind, receiving chunk, micro-batch), sends are non-blocking and each receive is
waited for only when its data is needed. Pairs therefore always match by tag, whatever order the two sides post
them in, so the exchange cannot hang on gloo the way mismatched `batch_isend_irecv` rounds can.

Scatter/gather (the paper, §4.1): the activation sent between stages is identical on all t ranks of a stage, so
each tensor-parallel rank sends only its 1/t slice and the receiving stage rebuilds the whole with an all-gather
over its tensor-parallel group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

ACT, GRAD = 0, 1


class PendingRecv:
    """A posted receive; `wait()` returns the (gathered) tensor."""

    def __init__(self, work, buffer: torch.Tensor, comm: "StageComm"):
        self.work, self.buffer, self.comm = work, buffer, comm

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.comm.gather(self.buffer)


class StageComm:
    """Sends and receives of [micro_batch, seq, hidden] tensors between the stages of one pipeline."""

    def __init__(self, grid, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 n_chunks: int, scatter_gather: bool = True):
        self.grid, self.shape, self.dtype, self.device, self.n_chunks = grid, tuple(shape), dtype, device, n_chunks
        self.scatter_gather = scatter_gather and grid.tp > 1 and shape[-1] % grid.tp == 0
        self._sends: list = []

    def tag(self, kind: int, chunk: int, micro_batch: int) -> int:
        return (micro_batch * self.n_chunks + chunk) * 2 + kind

    def _wire_shape(self) -> tuple[int, ...]:
        if not self.scatter_gather:
            return self.shape
        return self.shape[:-1] + (self.shape[-1] // self.grid.tp,)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().to(self.dtype)
        if self.scatter_gather:
            x = x.chunk(self.grid.tp, dim=-1)[self.grid.tp_rank]
        return x.contiguous()

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        if not self.scatter_gather:
            return part
        parts = [torch.empty_like(part) for _ in range(self.grid.tp)]
        dist.all_gather(parts, part, group=self.grid.tp_group)
        return torch.cat(parts, dim=-1)

    def send(self, x: torch.Tensor, peer: int, tag: int) -> None:
        self._sends.append(dist.isend(self.scatter(x), dst=self.grid.stage_rank(peer), tag=tag))

    def recv(self, peer: int, tag: int) -> PendingRecv:
        buffer = torch.empty(self._wire_shape(), dtype=self.dtype, device=self.device)
        return PendingRecv(dist.irecv(buffer, src=self.grid.stage_rank(peer), tag=tag), buffer, self)

    def flush(self) -> None:
        """Wait for every send of this step (their buffers must live until then)."""
        for work in self._sends:
            work.wait()
        self._sends.clear()
