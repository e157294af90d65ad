"""Where a step's time goes, measured: spans of every instruction, collective and phase a rank runs.

A `Recorder` collects spans `(name, category, start, end)` on the monotonic clock. Three sources feed it while
`recorder.recording(grid, tracker)` is active:
- the labelled steps of `hang.HangWatch` (the engine's F/B/W, its receive and send waits and posts, the
  gradient reductions and the optimizer step of the training step), through `watch.recorder`;
- every collective of torch.distributed (`COLLECTIVES`), categorised by its process group (tensor-, data- or
  pipeline-parallel), so that the collectives inside a forward are told apart from its compute. An asynchronous
  one (`async_op=True`: the distributed optimizer's reduce-scatters and all-gathers, sequence parallelism's
  overlapped ones in backward, the data-parallel buckets) is timed where its work is waited for;
- recomputation in backward: `random.checkpoint` runs it inside `recomputation(tracker)`, and the RNG tracker the
  model passes to every checkpoint carries the recorder during recording.

The one hook point for collectives is `recording`: for its duration it replaces the collectives of the
`torch.distributed` namespace by timed ones. So every caller must look a collective up there when it calls it
(`dist.all_reduce(...)`, or `getattr(dist, ...)` inside the function): a function bound at import is the
untimed original (tests/parallel/test_profile.py scans mlplat for both faults: a collective missing from
`COLLECTIVES`, a collective bound at import). There is no module-level recorder: the recorder is reached through
objects that are passed (the closures of the timed functions, the tracker, the hang watch), which also holds in
autograd's worker thread, where backward runs on a GPU (on a CPU it runs in the calling thread). A ContextVar set
by the step would not be seen there in every torch version (pytorch/pytorch#186583, #191777).

Ending a span: on a GPU kernels and NCCL calls return before they ran, so `Recorder.sync` (`span_sync`) makes the
host wait for the **current (compute) stream** at both ends of a span, never the device: `torch.cuda.synchronize`
also waits for the NCCL streams, whose receives are posted one compute ahead and need the peer's next compute,
which deadlocks the pipeline at pp > 1. The compute stream depends only on the kernels queued before and on the
NCCL works the host itself waited for (ProcessGroupNCCL makes the current stream wait on a work in `wait()`), and
every operation posted later is queued behind that point anyway, so waiting for it cannot block a peer. Spans
stay host timestamps, on the clock of the "data" and "loop" spans and of Throughput's step window, and a step's
categories add up to its step_time_s; the price is that the host cannot run ahead of the compute stream during
profiled steps (CUDA events would let it, but their device times would need mapping onto the host clock each
step and would still need a stream sync at the step's end to compare with the host's step window).

Spans nest (a tensor-parallel all-reduce inside a forward inside nothing else); `breakdown` charges each
moment of a step to its innermost span, so the categories add up to the time the spans cover, and what no
span covers is left out (the step total is measured separately and compared).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from mlplat.parallel.grid import ParallelGrid

# The breakdown's columns, in the order they are reported.
# data: from the end of the previous step to this one's start (the batch fetch and Lightning's loop between
# steps); loop: the step's own logging and Lightning's work after the training step.
CATEGORIES = ("compute", "bubble", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "recompute", "optimizer", "data",
              "loop")
# Every collective of torch.distributed, the newer names (reduce_scatter_single, all_gather_single: torch 2.13),
# the deprecated ones and the object collectives included; those a torch lacks are skipped. Point-to-point
# transfers are not here: the engine labels their posts and waits (`HangWatch`).
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_single", "all_gather_into_tensor",
               "_all_gather_base", "all_gather_coalesced", "all_gather_object", "reduce_scatter",
               "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all",
               "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object",
               "scatter", "scatter_object_list", "barrier", "monitored_barrier")
# A collective's category, by the grid's group it runs on; any other group (the world, file I/O) is dp_comm. The
# expert groups come first: where one is an attention group's communicator too (ep = t), that group's name wins.
_GROUP_CATEGORIES = (("ep_group", "ep_comm"), ("edp_group", "dp_comm"), ("tp_group", "tp_comm"),
                     ("cp_group", "cp_comm"), ("dp_group", "dp_comm"), ("dp_cp_group", "dp_comm"),
                     ("pp_group", "bubble"), ("embedding_group", "dp_comm"))


@dataclass
class Span:
    name: str  # e.g. "F(chunk 1, mb 0)", "all_reduce", "the data-parallel gradient reduction"
    category: str  # one of CATEGORIES
    start: float  # time.perf_counter() seconds (CLOCK_MONOTONIC: one clock for all processes of a machine)
    end: float
    args: dict = field(default_factory=dict)  # F/B/W: op, chunk, micro_batch


def span_sync(device) -> Callable[[], None] | None:
    """What ends a span on `device`: on CUDA, waiting for the current stream of the calling thread (looked up at each
    call: autograd's worker thread runs backward on the forward's stream), never `torch.cuda.synchronize`; on a CPU
    nothing (the host ran the work)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None

    def sync() -> None:
        torch.cuda.current_stream(device).synchronize()
    return sync


@contextlib.contextmanager
def recomputation(tracker: Any) -> Iterator[None]:
    """Wraps an activation checkpoint's recomputation (`random.checkpoint`): a "recompute" span while the RNG
    tracker it was given carries a recorder (`Recorder.recording`)."""
    recorder = getattr(tracker, "recorder", None)
    if recorder is None or not recorder.active:
        yield
        return
    start = recorder.now()
    yield
    recorder.add("recompute", "recompute", start, recorder.now())


class _TimedWork:
    """The work of an asynchronous collective: its wait is a span of the collective's category while the recorder
    records (there the host, on a GPU the compute stream, waits for it). Anything else goes to the work."""

    def __init__(self, work, recorder: "Recorder", name: str, category: str):
        self._work, self._recorder, self._name, self._category = work, recorder, name, category

    def wait(self, *args, **kwargs):
        recorder = self._recorder
        if not recorder.active:
            return self._work.wait(*args, **kwargs)
        start = recorder.now()
        out = self._work.wait(*args, **kwargs)
        recorder.add(f"{self._name} (wait)", self._category, start, recorder.now())
        return out

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _group_and_async(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """The `group` and `async_op` of a call, passed by keyword or by position (the latter read through the
    function's signature)."""
    found = dict(kwargs)
    if args and signature is not None:
        try:
            found = {**signature.bind_partial(*args, **kwargs).arguments, **kwargs}
        except TypeError:
            pass
    return found.get("group"), bool(found.get("async_op", False))


@dataclass
class Recorder:
    spans: list[Span] = field(default_factory=list)
    # Called at both ends of every span (on a GPU the compute stream's wait, `span_sync`; None on a CPU). A test
    # mode may set another one (e.g. one that waits for every posted transfer, as a device-wide sync would).
    sync: Callable[[], None] | None = None
    active: bool = False  # inside `recording`

    def now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def add(self, name: str, category: str, start: float, end: float, **args) -> None:
        self.spans.append(Span(name, category, start, end, args))

    def _timed(self, name: str, fn: Callable, categories: dict[int, str]) -> Callable:
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            group, async_op = _group_and_async(signature, args, kwargs)
            category = categories.get(id(group), "dp_comm") if group is not None else "dp_comm"
            if async_op:  # timed where it is waited for
                work = fn(*args, **kwargs)
                return _TimedWork(work, self, name, category) if work is not None else work
            start = self.now()
            out = fn(*args, **kwargs)
            self.add(name, category, start, self.now())
            return out
        return call

    @contextlib.contextmanager
    def recording(self, grid: ParallelGrid, tracker: Any = None) -> Iterator[None]:
        """While active: every collective is timed (categorised by its group of `grid`) and the recomputations of
        the checkpoints given `tracker` (the model's RNG tracker) are recorded."""
        categories = {id(g): c for attr, c in _GROUP_CATEGORIES if (g := getattr(grid, attr, None)) is not None}
        if (nodes := getattr(grid, "ep_nodes", None)) is not None:  # the node dispatcher's sub-groups of the ep group
            for g in (nodes.across, nodes.within):  # one that is the tp (or ep) group itself keeps that group's name
                categories.setdefault(id(g), "ep_comm")
        saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        outer = getattr(tracker, "recorder", None) if tracker is not None else None
        for name, fn in saved.items():
            setattr(dist, name, self._timed(name, fn, categories))
        if tracker is not None:
            tracker.recorder = self
        was_active, self.active = self.active, True
        try:
            yield
        finally:
            self.active = was_active
            if tracker is not None:
                tracker.recorder = outer
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
