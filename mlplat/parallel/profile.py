"""Where a step's time goes, measured: spans of every instruction, collective and phase a rank runs.

A `Recorder` collects spans `(name, category, start, end)` on the monotonic clock. Three sources feed it while
`recorder.recording(grid)` is active:
- the labelled steps of `hang.HangWatch` (the engine's F/B/W, its receive and send waits and posts, the
  gradient reductions and the optimizer step of the training step);
- every torch.distributed collective, wrapped for the duration (category from its process group: tensor-,
  data- or pipeline-parallel), so the collectives inside a forward are told apart from its compute;
- recomputation in backward (`random.checkpoint` reports it through `note_recompute`).

Spans nest (a tensor-parallel all-reduce inside a forward inside nothing else); `breakdown` charges each
moment of a step to its innermost span, so the categories add up to the time the spans cover, and what no
span covers is left out (the step total is measured separately and compared).
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch.distributed as dist

from mlplat.parallel.grid import ParallelGrid

# The breakdown's columns, in the order they are reported.
# data: from the end of the previous step to this one's start (the batch fetch and Lightning's loop between
# steps); loop: the step's own logging and Lightning's work after the training step.
CATEGORIES = ("compute", "bubble", "tp_comm", "dp_comm", "recompute", "optimizer", "data", "loop")
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                "barrier", "reduce_scatter")
_active: list["Recorder"] = []  # the recorder of the steps being profiled (autograd may run in other threads)


@dataclass
class Span:
    name: str  # e.g. "F(chunk 1, mb 0)", "all_reduce", "the data-parallel gradient reduction"
    category: str  # one of CATEGORIES
    start: float  # time.perf_counter() seconds (CLOCK_MONOTONIC: one clock for all processes of a machine)
    end: float
    args: dict = field(default_factory=dict)  # F/B/W: op, chunk, micro_batch


def note_recompute(start: float) -> None:
    """Called by the recomputation of an activation checkpoint, at its end."""
    if _active:
        _active[0].add("recompute", "recompute", start, _active[0].now())


@dataclass
class Recorder:
    spans: list[Span] = field(default_factory=list)
    # On a GPU, kernels and NCCL calls return before they ran: with sync = torch.cuda.synchronize every span ends
    # only when its work is done (profiled steps only; it serialises the streams, as Megatron's timers do).
    sync: Callable[[], None] | None = None

    def now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def add(self, name: str, category: str, start: float, end: float, **args) -> None:
        self.spans.append(Span(name, category, start, end, args))

    @contextlib.contextmanager
    def recording(self, grid: ParallelGrid) -> Iterator[None]:
        """While active: every collective is timed (categorised by its group) and recomputation reported."""
        groups = {id(grid.tp_group): "tp_comm", id(grid.dp_group): "dp_comm", id(grid.pp_group): "bubble",
                  id(grid.embedding_group): "dp_comm", id(grid.model_parallel_group): "dp_comm"}
        saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

        def timed(name, fn):
            @functools.wraps(fn)
            def call(*args, **kwargs):
                start = self.now()
                try:
                    return fn(*args, **kwargs)
                finally:
                    group = kwargs.get("group")
                    category = groups.get(id(group), "dp_comm") if group is not None else "dp_comm"
                    if kwargs.get("async_op"):  # the wait is timed where it happens (a labelled step)
                        category = None
                    if category is not None:
                        self.add(name, category, start, self.now())
            return call

        for name, fn in saved.items():
            setattr(dist, name, timed(name, fn))
        _active.insert(0, self)
        try:
            yield
        finally:
            _active.remove(self)
            for name, fn in saved.items():
                setattr(dist, name, fn)


def exclusive_times(spans: list[Span], start: float, end: float) -> dict[str, float]:
    """Seconds per category of the spans inside [start, end], each span's time less that of the spans nested in
    it (spans nest: one thread records them, a collective inside a forward inside nothing else)."""
    inside = sorted((s for s in spans if s.start >= start and s.end <= end), key=lambda s: (s.start, -s.end))
    out = {c: 0.0 for c in CATEGORIES}
    stack: list[list] = []  # [span, time of its direct children]
    for s in inside:
        while stack and stack[-1][0].end <= s.start:
            done, children = stack.pop()
            out[done.category] += done.end - done.start - children
        if stack:
            stack[-1][1] += s.end - s.start
        stack.append([s, 0.0])
    while stack:
        done, children = stack.pop()
        out[done.category] += done.end - done.start - children
    return out
