"""Point-to-point transfers between pipeline stages, on one communicator per direction.

The engine posts the operations of its exchange plan (`exchange.exchange_plans`) one by one: a message from
pipeline rank a to rank b travels on `grid.p2p_group(a, b)`, a process group of its own for that direction,
with tag 0. Nothing rests on tags: on NCCL and on gloo alike a message is matched by its place in its channel,
and the plan posts every channel's receives in the order of its sends. A channel holds one direction only, so a
send never queues behind a receive on NCCL's stream, and `mlplat.perf.transport` proves the plans free of
deadlock under NCCL's rules for every schedule.

Scatter/gather (the paper, §4.1): the activation sent between stages is identical on all t ranks of a stage, so
each tensor-parallel rank sends only its 1/t slice and the receiving stage rebuilds the whole with an all-gather
over its tensor-parallel group (when the receive is waited for, in the same order on every tensor-parallel rank).
With sequence parallelism (`parallel.sequence_parallel`) a stage's output is already its rank's sequence shard
[b, s/t, h], different on each tensor-parallel rank: the module sends it whole, with scatter/gather off.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.layout.exchange import RECV_OPS, channel
from mlplat.parallel.layout.schedules import Instruction
from mlplat.parallel.mappings import all_gather

TAG = 0  # the only tag ever used: NCCL ignores tags, so correctness must not depend on them


class PostedGroup:
    """Posted operations: `wait()` completes them and returns {receive instruction: tensor}."""

    def __init__(self, works: list, recvs: list[tuple[Instruction, torch.Tensor]], sends: list[torch.Tensor],
                 comm: "StageComm", messages: tuple[Instruction, ...] = ()):
        self.works, self.recvs, self.sends, self.comm = works, recvs, sends, comm
        self.messages = messages  # what was posted, for hang reports

    def wait(self) -> dict[Instruction, torch.Tensor]:
        for work in self.works:
            work.wait()
        # Emptied in place: the hang watch holds this same list (GPU), and ProcessGroupNCCL's Work holds its
        # tensor, so a new list would keep every buffer alive until the watch's next poll.
        self.works.clear()
        self.sends = []  # send buffers may be freed now
        return {ins: self.comm.gather(buf) for ins, buf in self.recvs}


class StageComm:
    """Sends and receives of [micro_batch, seq, hidden] tensors between the stages of one pipeline."""

    def __init__(self, grid: ParallelGrid, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 scatter_gather: bool = True, wire_dtype: torch.dtype | None = None):
        # dtype: what a stage computes on (a received tensor is handed over in it); wire_dtype: what travels, the
        # GEMMs' dtype (bf16 under bf16-mixed, whose fp32 weights make fp32 activations): half the bytes in flight.
        self.grid, self.shape, self.dtype, self.device = grid, tuple(shape), dtype, device
        self.wire_dtype = wire_dtype or dtype
        self.scatter_gather = scatter_gather and grid.tp > 1 and shape[-1] % grid.tp == 0
        self.wire_shape = self._wire_shape()
        # A message's (is a receive, peer's global rank, process group of its channel), looked up once
        self._routes: dict[Instruction, tuple[bool, int, object]] = {}

    def with_rows(self, rows: int) -> "StageComm":
        """The same channels for micro-batches of `rows` sequences (generation decodes one)."""
        other = copy.copy(self)
        other.shape = (rows,) + self.shape[1:]
        other.wire_shape = other._wire_shape()
        return other

    def _route(self, ins: Instruction) -> tuple[bool, int, object]:
        route = self._routes.get(ins)
        if route is None:
            group = self.grid.p2p_group(*channel(ins, self.grid.pp_rank))
            route = self._routes[ins] = (ins.op in RECV_OPS, self.grid.stage_rank(ins.peer), group)
        return route

    def _wire_shape(self) -> tuple[int, ...]:
        if not self.scatter_gather:
            return self.shape
        return self.shape[:-1] + (self.shape[-1] // self.grid.tp,)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach()
        if x.dtype != self.wire_dtype:
            x = x.to(self.wire_dtype)
        if self.scatter_gather:
            x = x.chunk(self.grid.tp, dim=-1)[self.grid.tp_rank]
        return x.contiguous()

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        if self.scatter_gather:
            part = all_gather(part, -1, self.grid.tp_group)
        return part if part.dtype == self.dtype else part.to(self.dtype)

    def post(self, messages: tuple[Instruction, ...], payload: dict[Instruction, torch.Tensor]) -> PostedGroup:
        """Post the operations of one step of the plan: `payload` holds the tensor of each send."""
        works, recvs, sends = [], [], []
        for ins in messages:
            is_recv, peer, group = self._route(ins)
            if is_recv:
                buf = torch.empty(self.wire_shape, dtype=self.wire_dtype, device=self.device)
                recvs.append((ins, buf))
                works.append(dist.irecv(buf, src=peer, group=group, tag=TAG))
            else:
                wire = self.scatter(payload[ins])
                sends.append(wire)
                works.append(dist.isend(wire, dst=peer, group=group, tag=TAG))
        return PostedGroup(works, recvs, sends, self, tuple(messages))
