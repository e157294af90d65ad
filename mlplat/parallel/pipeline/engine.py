"""Executes one pipeline rank's instruction list on its model chunks.

The instruction list comes from `schedules.py` - the same list the simulator times and the timeline draws.
F runs a chunk's forward on a micro-batch (the last chunk returns the loss, scaled by 1/m so gradients
accumulate to the mean); B back-propagates it; SEND/RECV move activations and their gradients between stages.
Inputs and outputs of a micro-batch are dropped as soon as its backward has run; a sent output whose chunk's
backward does not read it (`frees_sent_output`: DecoderChunk, which ends in a residual add) is freed as soon as its
send completes, keeping only its place in the autograd graph (a GradientEdge), as Megatron frees it. In the
zero-bubble schedules B leaves the weight-gradient GEMMs of the linear layers to W (`mlplat.parallel.weight_grad`),
and the data-parallel reducer's "this chunk's gradients are final" moment moves from the chunk's last B to its
last W. Under a schedule that pairs passes (1f1b_overlap) a paired B runs combined with the F before it
(`pair.Alternation`: the forward here, the backward on a helper thread, handing over at each expert all-to-all).

Messages follow the rank's exchange plan (`exchange.exchange_plans`): each on the directed channel of its
direction, sends posted right after their compute (at most `exchange.SEND_WINDOW` in flight per channel),
receives posted one compute ahead (in their channel's order) and waited for right before the compute that
needs them - the order
proven free of deadlock under NCCL's rules by `mlplat.perf.transport`, so what runs here on gloo (every tag
0) is what runs on NCCL.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge

from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.hang import HangWatch
from mlplat.parallel.layout.exchange import Compute, Post, Step, exchange_plans
from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.parallel.layout.schedules import Instruction, Op, build_schedule
from mlplat.parallel.pipeline.p2p import PostedGroup, StageComm
from mlplat.parallel.pipeline.pair import Alternation
from mlplat.parallel.weight_grad import WeightGradStore

_UNWATCHED = contextlib.nullcontext()  # reusable: a run without a hang watch

# (token ids, labels) or (token ids, labels, layout): a layout (mlplat.parallel.placement.TokenLayout: context
# parallelism, packed documents) goes to every chunk's forward.
MicroBatch = tuple


def _named(ins: Instruction) -> str:
    """`RECV_GRAD(chunk 3, mb 2) from pipeline rank 2`, `F(chunk 0, mb 1)`."""
    text = f"{ins.op.value}(chunk {ins.chunk}, mb {ins.micro_batch})"
    if ins.peer is None:
        return text
    return f"{text} {'from' if ins.op in (Op.RECV_ACT, Op.RECV_GRAD) else 'to'} pipeline rank {ins.peer}"


@dataclass(frozen=True)
class _Label:
    """What a step runs under (hang reports, profiles), built once per plan: `F(chunk 3, mb 2)`, `RECV_GRAD(chunk 3,
    mb 2) from pipeline rank 2`, or the messages of a post. Computes are "compute", posts and waits "bubble"."""

    text: str
    category: str
    completes: bool  # a post is not reported as "last completed"
    args: dict       # a compute's op, chunk and micro-batch (profile spans)
    messages: str = ""  # a post's messages alone (the GPU watch on posted transfers)


def _labels(plan: list[Step]) -> list[_Label]:
    posted: dict[int, str] = {}
    out = []
    for step in plan:
        if isinstance(step, Compute):
            ins = step.instruction
            out.append(_Label(_named(ins), "compute", True,
                              {"op": ins.op.value, "chunk": ins.chunk, "micro_batch": ins.micro_batch}))
            if ins.paired:  # the pair runs under its F's block, named for both
                first = out[-2]
                out[-2] = _Label(f"{first.text} with {_named(ins)}", "compute", True,
                                 dict(first.args, paired_micro_batch=ins.micro_batch))
        elif isinstance(step, Post):
            posted[step.group] = ", ".join(map(_named, step.messages))
            out.append(_Label("posting " + posted[step.group], "bubble", False, {}, posted[step.group]))
        else:
            out.append(_Label(posted[step.group], "bubble", True, {}))
    return out


_F, _B, _W, _POST, _WAIT, _PAIR = range(6)  # what a step of a compiled plan does
_COMPUTE_KIND = {Op.FORWARD: _F, Op.BACKWARD: _B, Op.WEIGHT: _W}


class _Op(NamedTuple):
    """One step of a plan, compiled: unpacked in the engine's loop at the cost of a plain tuple."""

    kind: int  # _F, _B, _W, _POST or _WAIT
    target: int  # the chunk a compute runs on, or the message group a post or wait handles
    what: object  # a compute's micro-batch (a pair's: its F's and its B's), a post's messages, None for a wait
    block: object  # the hang-watch block it runs under (a reusable null context without a watch)
    text: str | None  # a post's messages as text (its hang-report label), None otherwise


@dataclass(frozen=True)
class _Plan:
    """A rank's exchange plan as the engine runs it, built once per (m, forward_only): the steps, and each step
    compiled to an `_Op`."""

    steps: list[Step]
    ops: list[_Op]


def _compile(steps: list[Step], labels: list[_Label], blocks: list) -> list[_Op]:
    out = []
    for step, label, block in zip(steps, labels, blocks):
        if isinstance(step, Compute):
            ins = step.instruction
            if ins.paired:  # the F before it becomes the pair
                forward = out.pop()
                out.append(_Op(_PAIR, ins.chunk, (forward.what, ins.micro_batch), forward.block, None))
                continue
            out.append(_Op(_COMPUTE_KIND[ins.op], ins.chunk, ins.micro_batch, block, None))
        elif isinstance(step, Post):
            out.append(_Op(_POST, step.group, step.messages, block, label.messages))
        else:
            out.append(_Op(_WAIT, step.group, None, block, None))
    return out


@dataclass
class _State:
    inputs: dict = field(default_factory=dict)       # (chunk, mb) -> input of the chunk (a leaf for chunks > 0)
    outputs: dict = field(default_factory=dict)      # (chunk, mb) -> output (or scaled loss on the last chunk)
    acts: dict = field(default_factory=dict)         # (chunk, mb) -> input of chunk (received or handed over)
    grads: dict = field(default_factory=dict)        # (chunk, mb) -> grad of chunk's output
    input_grads: dict = field(default_factory=dict)  # (chunk, mb) -> grad of chunk's input, to send
    groups: dict = field(default_factory=dict)       # group number -> PostedGroup
    losses: list = field(default_factory=list)


def _thread_state() -> Callable:
    """What torch keeps per thread that a pair's backward on its helper thread must share with this one: autocast
    (the backward of a pass run under it sees it on; the plain engine calls backward in the same context) and the
    current CUDA device and stream. Returns call(fn, *args) running fn under them."""
    casts = [(kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind)]
    stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def call(fn, *args):
        with contextlib.ExitStack() as stack:
            for kind, dtype in casts:
                stack.enter_context(torch.autocast(kind, dtype))
            if stream is not None:
                stack.enter_context(torch.cuda.stream(stream))
            return fn(*args)
    return call


class PipelineEngine:
    """Runs the layout's schedule over the chunks this pipeline rank holds.

    chunks: global chunk id -> module, for the ids `layout.chunks_of(grid.pp_rank)`. A chunk's forward takes
    token ids (chunk 0) or a hidden state, and the last chunk's forward takes labels and returns the mean loss.
    """

    def __init__(self, chunks: dict[int, nn.Module], grid: ParallelGrid, layout: PipelineLayout,
                 comm: StageComm | None,
                 before_backward: Callable[[int, int, bool], None] | None = None,
                 grad_ready: Callable[[nn.Parameter], None] | None = None,
                 watch: HangWatch | None = None):
        if layout.pp != grid.pp or sorted(chunks) != layout.chunks_of(grid.pp_rank):
            raise ValueError(f"pipeline rank {grid.pp_rank} of {grid.pp} got chunks {sorted(chunks)}; the layout "
                             f"{layout} places {layout.chunks_of(grid.pp_rank)} there")
        self.chunks, self.grid, self.layout, self.comm = chunks, grid, layout, comm
        self.watch = watch
        self.last_chunk = layout.last_chunk
        self.before_backward = before_backward  # hook(chunk, micro_batch, gradients_of_chunk_final)
        self.grad_ready = grad_ready  # hook(param): a gradient accumulated outside autograd (W) is there
        self._plans: dict[tuple[int, bool], _Plan] = {}
        self._frees_sent_output = {c: getattr(chunk, "frees_sent_output", False) for c, chunk in chunks.items()}
        self.stores: dict[int, WeightGradStore] = {}
        self.alternation = Alternation()  # runs the paired passes of a schedule that pairs them
        if layout.spec.pairs:
            for chunk in chunks.values():
                for mod in chunk.modules():
                    if hasattr(getattr(mod, "dispatcher", None), "alternation"):
                        mod.dispatcher.alternation = self.alternation
        if layout.spec.split_backward:  # linear layers leave their weight gradients to W
            for c, chunk in chunks.items():
                self.stores[c] = WeightGradStore()
                for mod in chunk.modules():
                    if hasattr(mod, "wgrad_store"):
                        mod.wgrad_store = self.stores[c]

    def schedule(self, m: int, forward_only: bool = False) -> list[list[Instruction]]:
        """Every pipeline rank's instruction list (a rank's receives follow its peers' order of sends)."""
        sched = build_schedule(self.layout.schedule, self.layout.pp, self.layout.vpp, m)
        if forward_only:  # the same order without the backward half: validation and generation
            sched = [[i for i in ops if i.op in (Op.FORWARD, Op.SEND_ACT, Op.RECV_ACT)] for ops in sched]
        return sched

    def plan(self, m: int, forward_only: bool = False) -> list[Step]:
        """This rank's exchange plan for m micro-batches (cached, with its steps' labels)."""
        return self._plan(m, forward_only).steps

    def _plan(self, m: int, forward_only: bool) -> _Plan:
        key = (m, forward_only)
        if key not in self._plans:
            steps = exchange_plans(self.schedule(m, forward_only))[self.grid.pp_rank]
            labels = _labels(steps)
            watch = self.watch
            blocks = [_UNWATCHED if watch is None else watch.blocked_in(la.text, la.category, la.completes, **la.args)
                      for la in labels]
            self._plans[key] = _Plan(steps, _compile(steps, labels, blocks))
        return self._plans[key]

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
        weight_count: dict[int, int] = {c: 0 for c in self.chunks}
        split = bool(self.stores)
        plan = self._plan(m, forward_only)
        watch_posts = self.watch is not None and self.comm is not None and self.comm.device.type == "cuda"
        before_backward = self.before_backward
        # Every step runs under its label's block: a rank stuck past the timeout says where (hang.py).
        for kind, a, b, block, text in plan.ops:
            with block:
                if kind == _F:
                    self._forward(st, a, b, micro_batches, m, forward_only)
                elif kind == _B:
                    backward_count[a] += 1
                    if before_backward is not None:
                        before_backward(a, b, backward_count[a] == m and not split)
                    self._backward(st, a, b)
                elif kind == _PAIR:
                    forward, backward = b
                    backward_count[a] += 1
                    if before_backward is not None:
                        before_backward(a, backward, backward_count[a] == m and not split)
                    here = _thread_state()
                    self.alternation.run(lambda: self._forward(st, a, forward, micro_batches, m, forward_only),
                                         lambda: here(self._backward, st, a, backward))
                elif kind == _WAIT:
                    self._receive(st, st.groups.pop(a))
                elif kind == _POST:
                    group = self.comm.post(b, self._payload(st, b, forward_only))
                    st.groups[a] = group
                    if watch_posts:  # the host will not block in its wait
                        self.watch.posted(text, group.works)
                else:
                    weight_count[a] += 1
                    self._weight(a, b, weight_count[a] == m)
        if not st.losses:
            return None
        return torch.stack(st.losses).mean()

    def _payload(self, st: _State, messages, forward_only: bool) -> dict[Instruction, torch.Tensor]:
        out = {}
        for ins in messages:
            key = (ins.chunk, ins.micro_batch)
            if ins.op is Op.SEND_ACT:
                out[ins] = st.outputs.pop(key) if forward_only else st.outputs[key]
            elif ins.op is Op.SEND_GRAD:
                out[ins] = st.input_grads.pop(key)
        return out

    def _receive(self, st: _State, group: PostedGroup) -> None:
        for ins, tensor in group.wait().items():
            (st.acts if ins.op is Op.RECV_ACT else st.grads)[(ins.chunk, ins.micro_batch)] = tensor
        for ins in group.messages:  # a sent output is no longer read (Megatron frees it too): keep its graph node
            if ins.op is Op.SEND_ACT and self._frees_sent_output[ins.chunk]:
                key = (ins.chunk, ins.micro_batch)
                out = st.outputs.get(key)
                if isinstance(out, torch.Tensor):
                    st.outputs[key] = get_gradient_edge(out)
                    out.data = torch.empty(0, dtype=out.dtype, device=out.device)

    def _forward(self, st: _State, c: int, mb: int, micro_batches, m: int, forward_only: bool) -> None:
        tokens, labels, *rest = micro_batches[mb]
        extra = {"layout": rest[0]} if rest and rest[0] is not None else {}
        if c == 0:
            x = tokens
        else:
            x = st.acts.pop((c, mb))
            if not forward_only:
                x = x.detach().requires_grad_()
        chunk = self.chunks[c]
        if c == self.last_chunk:
            if forward_only and labels is None:
                self.last_outputs.append(chunk(x, **extra))
                return
            loss = chunk(x, labels, **extra)
            st.losses.append(loss.detach())
            out = loss / m
            if self.loss_scale != 1.0:
                out = out * self.loss_scale
        else:
            out = chunk(x, **extra)
            if c + 1 in self.chunks:  # neighbour on this rank (p = 1): hand over without a message
                st.acts[(c + 1, mb)] = out.detach()
        if not forward_only:
            st.inputs[(c, mb)] = x
            st.outputs[(c, mb)] = out
        elif c != self.last_chunk:
            st.outputs[(c, mb)] = out

    def _weight(self, c: int, mb: int, last: bool) -> None:
        """W: the deferred weight-gradient GEMMs of (c, mb). After the chunk's last W all its gradients are
        final: the data-parallel reducer is told so for every parameter of the chunk."""
        if last and self.before_backward is not None:
            self.before_backward(c, mb, True)
        self.stores[c].run((c, mb))
        if last and self.grad_ready is not None:
            for param in self.chunks[c].parameters():
                if param.requires_grad:
                    self.grad_ready(param)

    def _backward(self, st: _State, c: int, mb: int) -> None:
        x, out = st.inputs.pop((c, mb)), st.outputs.pop((c, mb))
        store = self.stores.get(c)
        if store is not None:
            store.key = (c, mb)
        try:
            if c == self.last_chunk:
                torch.autograd.backward(out)
            else:
                torch.autograd.backward(out, st.grads.pop((c, mb)))
        finally:
            if store is not None:
                store.key = None
        if c > 0:
            grad = x.grad
            if c - 1 in self.chunks:
                st.grads[(c - 1, mb)] = grad
            else:
                st.input_grads[(c, mb)] = grad
