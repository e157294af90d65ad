"""Point-to-point transfers between pipeline stages, posted the way NCCL needs them.

The engine hands over one exchange group at a time (`exchange.exchange_plan`): its sends and receives are
posted together as one `batch_isend_irecv` (one NCCL group), in the group's order, on the pipeline
group, with every tag 0. Nothing rests on tags: a message is matched by its place in the posting order of
its pair of ranks, exactly as on NCCL, and `mlplat.perf.transport` proves that order free of deadlock and of
crossed messages for every schedule. gloo runs the same posts (it has no group semantics, so it falls back to
one isend/irecv per operation, matched by order since the tags are equal).

Scatter/gather (the paper, §4.1): the activation sent between stages is identical on all t ranks of a stage, so
each tensor-parallel rank sends only its 1/t slice and the receiving stage rebuilds the whole with an all-gather
over its tensor-parallel group (when the group is waited for, in the same order on every tensor-parallel rank).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mlplat.parallel.pipeline.exchange import RECV_OPS
from mlplat.parallel.pipeline.schedules import Instruction

TAG = 0  # the only tag ever used: NCCL ignores tags, so correctness must not depend on them


class PostedGroup:
    """One posted exchange group: `wait()` completes it and returns {receive instruction: tensor}."""

    def __init__(self, works: list, recvs: list[tuple[Instruction, torch.Tensor]], sends: list[torch.Tensor],
                 comm: "StageComm"):
        self.works, self.recvs, self.sends, self.comm = works, recvs, sends, comm

    def wait(self) -> dict[Instruction, torch.Tensor]:
        for work in self.works:
            work.wait()
        self.works, self.sends = [], []  # send buffers may be freed now
        return {ins: self.comm.gather(buf) for ins, buf in self.recvs}


class StageComm:
    """Sends and receives of [micro_batch, seq, hidden] tensors between the stages of one pipeline."""

    def __init__(self, grid, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 scatter_gather: bool = True):
        self.grid, self.shape, self.dtype, self.device = grid, tuple(shape), dtype, device
        self.scatter_gather = scatter_gather and grid.tp > 1 and shape[-1] % grid.tp == 0

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

    def post(self, messages: tuple[Instruction, ...], payload: dict[Instruction, torch.Tensor]) -> PostedGroup:
        """Post one exchange group: `payload` holds the tensor of each send instruction."""
        ops, recvs, sends = [], [], []
        for ins in messages:
            peer = self.grid.stage_rank(ins.peer)
            if ins.op in RECV_OPS:
                buf = torch.empty(self._wire_shape(), dtype=self.dtype, device=self.device)
                recvs.append((ins, buf))
                ops.append(dist.P2POp(dist.irecv, buf, peer, self.grid.pp_group, TAG))
            else:
                wire = self.scatter(payload[ins])
                sends.append(wire)
                ops.append(dist.P2POp(dist.isend, wire, peer, self.grid.pp_group, TAG))
        works = dist.batch_isend_irecv(ops) if ops else []
        return PostedGroup(works, recvs, sends, self)
