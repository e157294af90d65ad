"""Executes one pipeline rank's instruction list on its model chunks.

The instruction list comes from `schedules.py` — the same list the simulator times and the timeline draws.
F runs a chunk's forward on a micro-batch (the last chunk returns the loss, scaled by 1/m so gradients
accumulate to the mean); B back-propagates it; SEND/RECV move activations and their gradients between stages.
Inputs and outputs of a micro-batch are dropped as soon as its backward has run.

Receives are posted ahead of their RECV instruction: before a compute runs, the receives that the rank's next
`recv_lookahead` computes need are already posted (irecv), and each is waited for only when its compute needs
it. Gloo does not move a message before its receive is posted, so a receive posted only at its RECV would put a
rendezvous round trip (and the wake-ups of both ranks' transport threads) on the critical path of every
message; posted one compute ahead, the data lands while this rank computes. Waits stay where the schedule puts
them, so the order of blocking points (and of the tensor-parallel all-gathers of scatter/gather) is unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn as nn

from mlplat.parallel.pipeline.p2p import ACT, GRAD, PendingRecv, StageComm
from mlplat.parallel.pipeline.schedules import Instruction, Op, build_schedule

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (token ids, labels)


@dataclass
class _State:
    inputs: dict = field(default_factory=dict)       # (chunk, mb) -> input of the chunk (a leaf for chunks > 0)
    outputs: dict = field(default_factory=dict)      # (chunk, mb) -> output (or scaled loss on the last chunk)
    acts: dict = field(default_factory=dict)         # (chunk, mb) -> PendingRecv or tensor: input of chunk
    grads: dict = field(default_factory=dict)        # (chunk, mb) -> PendingRecv or tensor: grad of chunk's output
    input_grads: dict = field(default_factory=dict)  # (chunk, mb) -> grad of chunk's input, to send
    losses: list = field(default_factory=list)


class PipelineEngine:
    """Runs `kind` (gpipe | 1f1b | interleaved) over the chunks this pipeline rank holds.

    chunks: global chunk id -> module, for the ids r, r+p, … of this rank. A chunk's forward takes token ids
    (chunk 0) or a hidden state, and the last chunk's forward takes labels and returns the mean loss.
    """

    def __init__(self, chunks: dict[int, nn.Module], grid, kind: str, v: int, comm: StageComm | None,
                 before_backward: Callable[[int, int, bool], None] | None = None, recv_lookahead: int = 1):
        self.chunks, self.grid, self.kind, self.v, self.comm = chunks, grid, kind, v, comm
        self.p = grid.pp
        self.n_chunks = self.p * v
        self.before_backward = before_backward  # hook(chunk, micro_batch, is_last_backward_of_chunk)
        # Receives of the next `recv_lookahead` computes are posted before a compute runs (0: at their RECV).
        self.recv_lookahead = recv_lookahead
        self._schedules: dict[tuple[int, bool], list[Instruction]] = {}
        self._recv_plans: dict[tuple[int, bool, int], dict[int, list[int]]] = {}

    def schedule(self, m: int, forward_only: bool = False) -> list[Instruction]:
        key = (m, forward_only)
        if key not in self._schedules:
            ops = build_schedule(self.kind, self.p, self.v, m)[self.grid.pp_rank]
            if forward_only:  # the same order without the backward half: validation and generation
                ops = [i for i in ops if i.op in (Op.FORWARD, Op.SEND_ACT, Op.RECV_ACT)]
            self._schedules[key] = ops
        return self._schedules[key]

    def recv_plan(self, m: int, forward_only: bool = False) -> dict[int, list[int]]:
        """Index of a compute instruction -> indices of the RECVs to post just before it runs: those that come
        after the compute `recv_lookahead - 1` places later and before the one `recv_lookahead` places later."""
        key = (m, forward_only, self.recv_lookahead)
        if key not in self._recv_plans:
            ops = self.schedule(m, forward_only)
            computes = [i for i, ins in enumerate(ops) if ins.op in (Op.FORWARD, Op.BACKWARD)]
            plan: dict[int, list[int]] = {}
            ahead = self.recv_lookahead
            for k in range(len(computes) - ahead + 1 if ahead > 0 else 0):
                lo = computes[k + ahead - 1]
                hi = computes[k + ahead] if k + ahead < len(computes) else len(ops)
                recvs = [j for j in range(lo + 1, hi) if ops[j].op in (Op.RECV_ACT, Op.RECV_GRAD)]
                if recvs:
                    plan[computes[k]] = recvs
            self._recv_plans[key] = plan
        return self._recv_plans[key]

    def _post_recv(self, st: "_State", ins: Instruction) -> None:
        c, mb = ins.chunk, ins.micro_batch
        if ins.op is Op.RECV_ACT:
            st.acts[(c, mb)] = self.comm.recv(ins.peer, self.comm.tag(ACT, c, mb))
        else:
            st.grads[(c, mb)] = self.comm.recv(ins.peer, self.comm.tag(GRAD, c, mb))

    def run(self, micro_batches: Sequence[MicroBatch], forward_only: bool = False,
            loss_scale: float = 1.0) -> torch.Tensor | None:
        """One pass over m micro-batches. Returns the mean loss on the last stage (None elsewhere); in
        forward_only mode the last chunk's outputs are kept in `self.last_outputs`. `loss_scale` multiplies
        the loss before backward (fp16 dynamic loss scaling; the caller unscales the gradients)."""
        m = len(micro_batches)
        self.loss_scale = loss_scale
        st = _State()
        self.last_outputs: list = []
        backward_count: dict[int, int] = {c: 0 for c in self.chunks}
        ops = self.schedule(m, forward_only)
        plan = self.recv_plan(m, forward_only)
        posted: set[int] = set()  # indices of RECVs already posted ahead
        for i, ins in enumerate(ops):
            c, mb = ins.chunk, ins.micro_batch
            for j in plan.get(i, ()):
                self._post_recv(st, ops[j])
                posted.add(j)
            if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                if i not in posted:
                    self._post_recv(st, ins)
            elif ins.op is Op.FORWARD:
                self._forward(st, c, mb, micro_batches, m, forward_only)
            elif ins.op is Op.SEND_ACT:
                self.comm.send(st.outputs[(c, mb)], ins.peer, self.comm.tag(ACT, c + 1, mb))
                if forward_only:
                    st.outputs.pop((c, mb))
            elif ins.op is Op.BACKWARD:
                backward_count[c] += 1
                if self.before_backward is not None:
                    self.before_backward(c, mb, backward_count[c] == m)
                self._backward(st, c, mb)
            elif ins.op is Op.SEND_GRAD:
                self.comm.send(st.input_grads.pop((c, mb)), ins.peer, self.comm.tag(GRAD, c - 1, mb))
        if self.comm is not None:
            self.comm.flush()
        if not st.losses:
            return None
        return torch.stack(st.losses).mean()

    def _take(self, table: dict, key) -> torch.Tensor:
        item = table.pop(key)
        return item.wait() if isinstance(item, PendingRecv) else item

    def _forward(self, st: _State, c: int, mb: int, micro_batches, m: int, forward_only: bool) -> None:
        tokens, labels = micro_batches[mb]
        if c == 0:
            x = tokens
        else:
            x = self._take(st.acts, (c, mb))
            if not forward_only:
                x = x.detach().requires_grad_()
        chunk = self.chunks[c]
        if c == self.n_chunks - 1:
            if forward_only and labels is None:
                self.last_outputs.append(chunk(x))
                return
            loss = chunk(x, labels)
            st.losses.append(loss.detach())
            out = loss / m
            if self.loss_scale != 1.0:
                out = out * self.loss_scale
        else:
            out = chunk(x)
            if c + 1 in self.chunks:  # neighbour on this rank (p = 1): hand over without a message
                st.acts[(c + 1, mb)] = out.detach()
        if not forward_only:
            st.inputs[(c, mb)] = x
            st.outputs[(c, mb)] = out
        elif c != self.n_chunks - 1:
            st.outputs[(c, mb)] = out

    def _backward(self, st: _State, c: int, mb: int) -> None:
        x, out = st.inputs.pop((c, mb)), st.outputs.pop((c, mb))
        if c == self.n_chunks - 1:
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, self._take(st.grads, (c, mb)))
        if c > 0:
            grad = x.grad
            if c - 1 in self.chunks:
                st.grads[(c - 1, mb)] = grad
            else:
                st.input_grads[(c, mb)] = grad
