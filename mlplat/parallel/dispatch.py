"""Expert parallelism's token dispatch (Lepikhin et al., GShard, 2020; Megatron-Core's token dispatchers): each rank
holds E/ep whole experts; a rank's routed assignments reach the ranks of their experts and their outputs come back.

The runtimes of the registered dispatchers (`mlplat.specs.dispatchers`: their collectives, costs and buffers),
each a `TokenDispatcher`: `dispatch` permutes a rank's routed assignments (`permute`: sorted by expert, capacity
applied to the rank's own tokens) and hands the experts their rows; `combine` brings the weighted outputs back and
sums them per token. Equal in what they compute (each equal to one process in tests/parallel/test_moe.py and
tests/cli/test_train.py):

- `AllToAllDispatcher` (`alltoall`): the assignments, sorted by expert, go to their experts' ranks in one
  all-to-all with uneven splits, their gates in a second (the experts weigh their activation by them,
  mlplat.model.moe), and the outputs come back in a third (the reverse three in backward). The split sizes are
  data: each rank first sends every other rank its counts per local expert (a small all-to-all), and the host
  reads both sides' sizes once per layer per micro-batch (`host_read`), the layer's one read: capacity's kept rows
  are counted in it.
- `AllGatherDispatcher` (`allgather`): every rank all-gathers the ep group's tokens and their routing, runs its own
  experts on the assignments that chose them, and a reduce-scatter returns to each rank the sum of the outputs for
  its tokens. Equal-sized collectives, one host read (how many rows its own experts take); ep times the tokens on
  every rank.
- `LocalDispatcher`: every expert on the rank (no ep group, or the experts split over tp): the permutation alone,
  without a host read when dropless (one, the kept rows' number, under capacity).

With `fp8` (model.moe.fp8_dispatch; DeepSeek-V3's dispatch) each token row is quantised to e4m3 with one fp32 scale
per row and sent as h code bytes and its scale's 4 (`pack_fp8_rows`), and the experts receive the dequantised rows;
the outputs come back, and the tokens' gradient goes back, in the run's precision (the quantisation passes the
gradient straight through). A row's scale is its own, so every layout quantises the same numbers, and the local
dispatcher quantises the rows as well: ep = 1 equals ep > 1.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from mlplat.parallel.mappings import all_gather, reduce_scatter
from mlplat.parallel.quantise import E4M3, Quantised, quantise
from mlplat.specs import dispatchers
from mlplat.specs.dispatchers import FP8_ROW_SCALE_BYTES


class _Collective(torch.autograd.Function):
    """`forward(x)`, a collective on the ep group, whose gradient is `backward(grad)`: each posts its collective and
    returns (output, work); `done(work)` completes it (`_Waits.done`); `arrived(output)`, if given, is what the
    forward's output becomes once there (the FP8 rows dequantised)."""

    @staticmethod
    def forward(ctx, x: Tensor, forward, backward, done, arrived=None) -> Tensor:
        ctx.backward, ctx.done = backward, done
        out, work = forward(x)
        done(work)
        return out if arrived is None else arrived(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out, work = ctx.backward(grad.contiguous())
        ctx.done(work)
        return out, None, None, None, None


def _all_to_all(x: Tensor, send: list[int], recv: list[int], group) -> tuple[Tensor, Any]:
    """Rows of x sent in `send` sized pieces to the group's ranks, `recv` sized pieces received: posted, (output,
    work)."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    return out, dist.all_to_all_single(out, x.contiguous(), recv, send, group=group, async_op=True)


def pack_fp8_rows(x: Tensor) -> Tensor:
    """Rows x [M, h] as the FP8 dispatch sends them: e4m3 codes, one fp32 scale per row, [M, h + 4] bytes."""
    q = quantise(x, E4M3, (1, x.shape[1]))
    return torch.cat([q.data.view(torch.uint8), q.scale.view(torch.uint8)], 1)


def unpack_fp8_rows(packed: Tensor, dtype: torch.dtype) -> Tensor:
    """`pack_fp8_rows`' rows dequantised to `dtype`."""
    h = packed.shape[1] - FP8_ROW_SCALE_BYTES
    codes, scale = packed[:, :h].contiguous().view(E4M3), packed[:, h:].contiguous().view(torch.float32)
    return Quantised(codes, scale, (1, h)).dequantise(dtype)


def _fp8_round_trip(x: Tensor) -> Tensor:
    return unpack_fp8_rows(pack_fp8_rows(x), x.dtype)


class _Fp8Rows(torch.autograd.Function):
    """The rows as the FP8 dispatch delivers them, where nothing moves them (the local dispatcher); the gradient
    straight through."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return _fp8_round_trip(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad


def _sent_in_fp8(collective, x: Tensor, **kwargs) -> Tensor:
    """`collective` (rows of x to other ranks) carrying x's rows packed in FP8, dequantised on arrival."""
    return unpack_fp8_rows(collective(pack_fp8_rows(x), **kwargs), x.dtype)


def host_read(t: Tensor) -> Any:
    """Device values read on the host (`Tensor.tolist`): on a GPU a synchronisation of the current stream with the
    host, never a device-wide one, so the pipeline's posted transfers on their own streams are untouched
    (docs/gpu-nccl.md). A MoE layer's dispatch makes at most one per micro-batch, what sizes its uneven buffers
    (the experts' per-expert loop one per forward GEMM, where no grouped kernel runs: `linear.grouped_mm`);
    every other step stays on the device: counts by `count`, capacity by a sort, no boolean mask, no nonzero
    (tests/parallel/test_moe.py counts them)."""
    return t.tolist()


def count(index: Tensor, n: int) -> Tensor:
    """How many of `index`'s values are each of 0..n-1, [n] int64, on the device: `bincount` reads its input's
    min and max on the host (CUDA), a scatter-add of ones does not."""
    return torch.zeros(n, dtype=torch.int64, device=index.device).scatter_add_(0, index.reshape(-1),
                                                                              torch.ones_like(index.reshape(-1)))


def exchange_counts(counts: Tensor, ep: int, group, done=lambda work: work.wait()) -> tuple[Tensor, list[int],
                                                                                           list[int]]:
    """counts [E] (this rank's kept assignments per global expert, rank j's experts the j-th E/ep) -> (received
    [ep, E/ep]: what each rank sends this rank's experts, the rows this rank sends each rank, the rows it receives
    from each): one small all-to-all (posted, completed by `done(work)`) and the layer's one host read."""
    mine = counts.view(ep, -1)
    received = torch.empty_like(mine)
    done(dist.all_to_all_single(received, mine.contiguous(), group=group, async_op=True))
    sizes = host_read(torch.cat([mine.sum(1), received.sum(1)]))
    return received, sizes[:ep], sizes[ep:]


@dataclass
class Sorted:
    """A rank's routed assignments sorted by expert (stable: token order within an expert), those capacity keeps
    first, then those it drops: each one's index into chosen's N·k, its gate; the kept and the routed assignments per
    expert [E]; the dropped ones in token order [N·k] (None: dropless). The kept rows are the first kept.sum(): a
    number on the device, which the dispatcher reads with whatever else it reads (`host_read`)."""

    assignment: Tensor
    gate: Tensor
    kept: Tensor
    assigned: Tensor
    dropped: Tensor | None


def sort_assignments(chosen: Tensor, gates: Tensor, num_experts: int, capacity_factor: float | None) -> Sorted:
    """`chosen`, `gates` [N, k] sorted by expert; under capacity_factor c an expert keeps its first ceil(c·N·k/E)
    assignments of these tokens, in token order (capacity applies to a rank's own tokens, before any dispatch)."""
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    assigned = count(flat, num_experts)
    gate = gates.reshape(-1)
    if capacity_factor is None:
        return Sorted(order, gate[order], assigned, assigned, None)
    capacity = math.ceil(capacity_factor * flat.numel() / num_experts)
    first = assigned.cumsum(0) - assigned  # each expert's first sorted assignment
    place = torch.arange(flat.numel(), device=flat.device) - first.repeat_interleave(
        assigned, output_size=flat.numel())  # the size given: no host read
    over = place >= capacity
    dropped = torch.empty_like(over)
    dropped[order] = over  # in token order
    order = order[torch.argsort(over.to(torch.int8), stable=True)]  # the kept first, still by expert
    return Sorted(order, gate[order], assigned.clamp(max=capacity), assigned, dropped)


@dataclass
class Permuted:
    """A rank's kept assignments sorted by expert (`Sorted`'s first kept.sum()): each one's index into chosen's N·k,
    its gate, the kept and the routed assignments per expert [E]."""

    assignment: Tensor
    gate: Tensor
    kept: Tensor
    assigned: Tensor


def permute(chosen: Tensor, gates: Tensor, num_experts: int, capacity_factor: float | None) -> Permuted:
    """`sort_assignments`' kept rows alone (under capacity one host read of their number: a dispatcher that reads
    other sizes takes `Sorted` and slices with them)."""
    s = sort_assignments(chosen, gates, num_experts, capacity_factor)
    n = s.assignment.numel() if s.dropped is None else host_read(s.kept.sum())
    return Permuted(s.assignment[:n], s.gate[:n], s.kept, s.assigned)


@dataclass
class Dispatched:
    """What `dispatch` hands the experts: the rows of this rank's experts' assignments [M, h], sorted by local
    expert, their gates [M] and the rows per local expert; `handle`, what `combine` needs to bring the outputs
    back; this rank's routed and kept assignments per global expert [E] (the layer's load statistics)."""

    rows: Tensor
    gates: Tensor
    counts: Tensor
    handle: Any
    assigned: Tensor
    kept: Tensor


class TokenDispatcher(Protocol):
    """The contract of a dispatcher's runtime (its entry: `mlplat.specs.dispatchers`). Built once per MoE layer
    with the experts' layout; `dispatch` permutes a rank's routed tokens (`permute`: capacity first) and moves
    them to their experts' ranks; `combine` takes the experts' weighted outputs for those rows back and sums them
    into each token's row [N, h]. Collectives are looked up in torch.distributed at each call (the profiler wraps
    them there). The model's builder sets `watch` (a HangWatch): the built-in dispatchers run each collective,
    forward and backward, in its ep_comm block (`_Waits.waiting`), which names it in a hang report and takes its
    wait out of the straggler clock's work (mlplat.parallel.straggler). The pipeline engine sets `alternation` (a
    `mlplat.parallel.pipeline.pair.Alternation`) under a schedule that pairs passes: a dispatcher whose entry
    `hands_over` posts each collective asynchronously and hands over to the paired pass before waiting for it."""

    watch: Any
    alternation: Any

    def __init__(self, num_experts: int, capacity_factor: float | None, ep: int, ep_rank: int, group) -> None: ...

    def dispatch(self, tokens: Tensor, chosen: Tensor, gates: Tensor) -> Dispatched: ...

    def combine(self, out: Tensor, handle: Any) -> Tensor: ...


class _Waits:
    """A dispatcher's waits on its ep group (`TokenDispatcher`)."""

    watch = None  # a HangWatch, set by the model's builder
    alternation = None  # a pair.Alternation, set by the pipeline engine under a schedule that pairs passes
    fp8 = False  # the tokens dispatched in FP8 (model.moe.fp8_dispatch), set by the MoE layer

    def waiting(self, label: str) -> contextlib.AbstractContextManager:
        if self.watch is None:
            return contextlib.nullcontext()
        return self.watch.blocked_in(label, "ep_comm", completes=False)

    def done(self, label: str, work) -> None:
        """Complete a posted collective: hand over to a paired pass first (its compute runs while this one flies),
        then wait in its ep_comm block."""
        if self.alternation is not None:
            self.alternation.hand_over()
        with self.waiting(label):
            work.wait()

    def blocking(self, fn, label: str, x: Tensor) -> tuple[Tensor, None]:
        """A collective run to completion in its ep_comm block, as `_Collective` takes it (nothing to hand over)."""
        with self.waiting(label):
            return fn(x), None


class LocalDispatcher(_Waits):
    """Every expert on this rank (no ep group, or the experts split over tp): the permutation alone."""

    def __init__(self, num_experts: int, capacity_factor: float | None, ep: int = 1, ep_rank: int = 0, group=None):
        self.num_experts, self.capacity_factor = num_experts, capacity_factor

    def dispatch(self, tokens: Tensor, chosen: Tensor, gates: Tensor) -> Dispatched:
        p = permute(chosen, gates, self.num_experts, self.capacity_factor)  # under capacity, the one host read
        token = p.assignment // chosen.shape[1]
        rows = _Fp8Rows.apply(tokens[token]) if self.fp8 else tokens[token]
        return Dispatched(rows, p.gate, p.kept, (token, tokens.shape), p.assigned, p.kept)

    def combine(self, out: Tensor, handle) -> Tensor:
        token, shape = handle
        return add_rows(out.new_zeros(shape), token, out)


class AllToAllDispatcher(LocalDispatcher):
    """`alltoall` (the module docstring)."""

    def __init__(self, num_experts: int, capacity_factor: float | None, ep: int, ep_rank: int, group):
        super().__init__(num_experts, capacity_factor)
        self.ep, self.group = ep, group

    def dispatch(self, tokens: Tensor, chosen: Tensor, gates: Tensor) -> Dispatched:
        s = sort_assignments(chosen, gates, self.num_experts, self.capacity_factor)  # by global expert
        ep, group = self.ep, self.group
        received, send, recv = exchange_counts(s.kept, ep, group, partial(self.done, "the expert dispatch's "
                                                                          "counts all-to-all"))  # the one host read
        kept = s.assignment[:sum(send)]  # the kept rows' number: what this rank sends
        token = kept // chosen.shape[1]
        rows = self._all_to_all(tokens[token], send, recv, "the expert dispatch's all-to-all", self.fp8)  # by source
        gate = self._all_to_all(s.gate[:sum(send)], send, recv, "the expert dispatch's gates all-to-all")
        local = received.shape[1]
        # Regroup by local expert (source order kept within one): the grouped GEMM wants each expert's rows together.
        segment = torch.arange(ep * local, device=rows.device).repeat_interleave(received.reshape(-1),
                                                                                output_size=rows.shape[0])
        order = torch.argsort(segment % local * ep + segment // local, stable=True)
        return Dispatched(rows[order], gate[order], received.sum(0), (order, send, recv, (token, tokens.shape)),
                          s.assigned, s.kept)

    def combine(self, out: Tensor, handle) -> Tensor:
        order, send, recv, local = handle
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return super().combine(self._all_to_all(out[back], recv, send, "the expert combine's all-to-all"), local)

    def _all_to_all(self, x: Tensor, send: list[int], recv: list[int], label: str, fp8: bool = False) -> Tensor:
        """x's rows in `send` sized pieces to the ep ranks, `recv` sized ones received (in FP8 with `fp8`); the
        gradient the way back."""
        there = partial(_all_to_all, send=send, recv=recv, group=self.group)
        packed = (lambda rows: there(pack_fp8_rows(rows))) if fp8 else there
        return _Collective.apply(x, packed, partial(_all_to_all, send=recv, recv=send, group=self.group),
                                 partial(self.done, label), partial(unpack_fp8_rows, dtype=x.dtype) if fp8 else None)


class AllGatherDispatcher(_Waits):
    """`allgather` (the module docstring)."""

    def __init__(self, num_experts: int, capacity_factor: float | None, ep: int, ep_rank: int, group):
        self.num_experts, self.capacity_factor, self.group = num_experts, capacity_factor, group
        self.local = num_experts // ep
        self.first = ep_rank * self.local

    def dispatch(self, tokens: Tensor, chosen: Tensor, gates: Tensor) -> Dispatched:
        s = sort_assignments(chosen, gates, self.num_experts, self.capacity_factor)
        expert = chosen.reshape(-1)  # each assignment's global expert, -1: dropped by the capacity
        if s.dropped is not None:
            expert = expert.masked_fill(s.dropped, -1)
        group, first, k, local = self.group, self.first, chosen.shape[1], self.local
        every = self._gather_rows(tokens, "the expert dispatch's all-gather", self.fp8)
        with self.waiting("the expert dispatch's routing all-gather"):
            expert = _gather_plain(expert.view_as(chosen), group).reshape(-1)
        weight = self._gather_rows(gates, "the expert dispatch's gates all-gather").reshape(-1)
        # This rank's experts' assignments first, by local expert (stable: gathered order within one), the rest
        # (another rank's, or dropped) after them as one more key
        e = expert - first
        key = torch.where((e >= 0) & (e < local), e, local)
        counts = count(key, local + 1)[:local]
        assignment = torch.argsort(key, stable=True)[:host_read(counts.sum())]  # the layer's one host read
        token = assignment // k
        return Dispatched(every[token], weight[assignment], counts, (token, every.shape), s.assigned, s.kept)

    def combine(self, out: Tensor, handle) -> Tensor:
        token, shape = handle
        # This rank's 1/ep of the rows of the sum over the group; the gradient all-gathered
        label = "the expert combine's reduce-scatter"
        return _Collective.apply(add_rows(out.new_zeros(shape), token, out),
                                 partial(self.blocking, partial(reduce_scatter, dim=0, group=self.group), label),
                                 partial(self.blocking, partial(all_gather, dim=0, group=self.group), label),
                                 _nothing)

    def _gather_rows(self, x: Tensor, label: str, fp8: bool = False) -> Tensor:
        """The group's rows x concatenated along dim 0 (sent in FP8 with `fp8`); the gradient reduce-scattered back
        (every rank used them)."""
        gather = partial(all_gather, dim=0, group=self.group)
        return _Collective.apply(x, partial(self.blocking, partial(_sent_in_fp8, gather) if fp8 else gather, label),
                                 partial(self.blocking, partial(reduce_scatter, dim=0, group=self.group), label),
                                 _nothing)


def _nothing(work) -> None:
    """A blocking collective's completion: it has completed."""


def build_dispatcher(name: str, num_experts: int, capacity_factor: float | None, ep: int, ep_rank: int,
                     group, nodes=None) -> TokenDispatcher:
    """The registered dispatcher `name`'s runtime over the ep group `group` (and its node sub-groups `nodes`, a
    `mlplat.parallel.grid.EpNodes`, for an entry with `node_groups`), or the permutation alone without one."""
    if group is None:
        return LocalDispatcher(num_experts, capacity_factor)
    entry = dispatchers.get(name)
    if not entry.node_groups:
        return entry.runtime()(num_experts, capacity_factor, ep, ep_rank, group)
    if nodes is None:
        raise ValueError(f"model.moe.dispatcher={name} runs on the ep group's node sub-groups: the grid has none "
                         f"(built without parallel.ep_per_node)")
    return entry.runtime()(num_experts, capacity_factor, ep, ep_rank, group, nodes)


def add_rows(into: Tensor, index: Tensor, rows: Tensor) -> Tensor:
    """`into` with rows[i] added to its row index[i]: index_put's accumulation, whose backward keeps the index alone
    (index_add's keeps `rows` too: an assignment's h-wide output, which the combine must not hold)."""
    return into.index_put((index,), rows, accumulate=True)


def _gather_plain(x: Tensor, group) -> Tensor:
    """The group's x concatenated along dim 0, no gradient (indices)."""
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    parts = list(out.chunk(dist.get_world_size(group)))
    dist.all_gather(parts, x.contiguous(), group=group)
    return out
