"""Hang reports: a rank stuck past parallel.timeout_s says where, in one line, and the job exits.

The engine (and the training step around it) runs every blocking piece of work inside `HangWatch.blocked_in(label)`,
labels like ``RECV_GRAD(chunk 3, mb 2) from pipeline rank 2``. Two ways out of a hang, both ending in the same
line on stderr and a non-zero exit of this process (`os._exit`: a rank blocked in a collective cannot unwind):

- the backend gives up first (gloo's recv, a collective timing out, or a peer's closed connection): the error is
  caught at the label and reported, naming the peer as dead when the error says its connection closed;
- a watchdog thread finds the current wait older than the timeout. Computes are not timed: a forward may
  legitimately take minutes on a CPU, and a collective inside one times out in the backend;
- on a GPU, where NCCL returns to the host at once and the host blocks later, somewhere unlabelled, the watchdog
  also polls the pipeline's posted transfers (`posted`: `Work.is_completed()`, which does not block): one still
  incomplete past the timeout is reported by its own label and peer. The strategy gives NCCL's own watchdog a
  longer timeout, so this report comes first (untested here: no GPU).

The same labels, with a category, are the spans of a profiled step (`mlplat.parallel.profile`).

    rank 5 (t1,p1,d0) blocked 120 s in RECV_GRAD(chunk 3, mb 2) from pipeline rank 2; last completed: F(chunk 3, mb 3)
"""
from __future__ import annotations

import collections
import os
import re
import sys
import threading
import time
from typing import Callable, TextIO

from mlplat.parallel.allocator import AllocatorRetries
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.layout.dims import coords_label
from mlplat.parallel.profile import Recorder

EXIT_CODE = 3  # a hang or a dead peer
WAITS = ("bubble", "tp_comm", "dp_comm")  # categories of blocks that wait on other ranks
_PEER_DIED = ("connection closed", "connection reset", "broken pipe", "end of file", "connection refused")
_COMM_ERROR = ("timed out", "timeout", "gloo", "nccl", "connection", "broken pipe", "peer")


class HangWatch:
    """Tracks what this rank is blocked in; reports and exits when that lasts longer than `timeout_s`."""

    def __init__(self, grid: ParallelGrid, timeout_s: float, *, grace_s: float = 2.0, poll_s: float = 0.5,
                 stream: TextIO | None = None):
        self.grid, self.timeout_s, self.grace_s, self.poll_s = grid, timeout_s, grace_s, poll_s
        self.stream = stream
        self.label: str | None = None
        self.since = 0.0
        self.waits = False  # the current block is a wait (the watchdog times it)
        self.last_completed = "nothing yet"
        self.recorder: Recorder | None = None  # set during profiled steps
        self.clock = None  # a straggler.StepClock during the steps the straggler check times
        self._thread: threading.Thread | None = None
        self._posted: collections.deque = collections.deque()  # (label, since, works) of transfers, oldest first
        self._posted_lock = threading.Lock()
        self.allocator: AllocatorRetries | None = None  # set on GPUs: a hang report names the allocator's retries
        # Called before a report, by the process that started the others (rank 0 of a local launch): when a rank it
        # started died, it names that rank and ends the job itself, not this report naming the neighbour that
        # passed the failure on
        self.before_report: Callable[[], None] | None = None

    def posted(self, label: str, works: list) -> None:
        """Transfers just posted (GPU): the watchdog reports them by `label` if they stay incomplete too long."""
        with self._posted_lock:
            self._posted.append((label, time.monotonic(), works))
        self._start()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="mlplat-hang-watch", daemon=True)
            self._thread.start()

    def where(self) -> str:
        g = self.grid
        return f"rank {g.rank} ({coords_label(g.tp_rank, g.pp_rank, g.dp_rank, g.cp_rank if g.cp > 1 else None)})"

    def blocked_in(self, label: str, category: str = "compute", completes: bool = True, **args) -> Block:
        """Run the block as `label`: a communication error inside it is reported as a hang line (and exits).

        category: a `profile.CATEGORIES` name; the watchdog times only waits (bubble, *_comm), not computes, which
        may legitimately run long on a CPU. completes=False: not reported as "last completed" (a post). While a
        recorder is set (profiled steps), the block is recorded as a span with `args`."""
        return Block(self, label, category, completes, args)

    def _failed(self, err: BaseException, label: str) -> None:
        """A block's error: a communication failure is reported and exits; anything else returns (re-raised)."""
        text = str(err).lower()
        if not isinstance(err, Exception) or not any(k in text for k in _COMM_ERROR):
            return
        waited = time.monotonic() - self.since
        died = any(k in text for k in _PEER_DIED)
        reason = "; that peer died" if died else ""
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        first = re.sub(r"^\[[^\]]*\]\s*", "", first)[:200]  # gloo prefixes its source location
        self._report(f"{self.where()} {'failed' if died else 'blocked'} {waited:.0f} s in {label}{reason} "
                     f"({first}); last completed: {self.last_completed}")

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            label, since, waits = self.label, self.since, self.waits
            if label is not None and waits and time.monotonic() - since > self.timeout_s + self.grace_s:
                self._report(f"{self.where()} blocked {time.monotonic() - since:.0f} s in {label}; "
                             f"last completed: {self.last_completed}")
            with self._posted_lock:  # every completed transfer dropped (and its buffers with it), not only the head
                self._posted = collections.deque(e for e in self._posted if not all(w.is_completed() for w in e[2]))
                head = self._posted[0] if self._posted else None
            if head is not None and time.monotonic() - head[1] > self.timeout_s + self.grace_s:
                label, since, _ = head
                self._report(f"{self.where()} waited {time.monotonic() - since:.0f} s for {label} (posted, never "
                             f"completed); last completed: {self.last_completed}")

    def _report(self, line: str) -> None:
        if self.before_report is not None:
            self.before_report()
        self._exit(line + (self.allocator.note() if self.allocator is not None else ""))

    def _exit(self, line: str) -> None:
        stream = self.stream or sys.stderr
        stream.write(line + "\n")  # one write: the other ranks' lines on the same stderr do not split it
        stream.flush()
        os._exit(EXIT_CODE)


class Block:
    """A labelled block of a `HangWatch` (`with watch.blocked_in(...)`). Reusable one use at a time: the engine
    builds one per step of a plan, once, so a step costs two attribute swaps, not a generator."""

    __slots__ = ("watch", "label", "category", "waits", "completes", "args", "outer", "start", "mark")

    def __init__(self, watch: HangWatch, label: str, category: str, completes: bool, args: dict):
        self.watch, self.label, self.category, self.completes, self.args = watch, label, category, completes, args
        self.waits = category in WAITS

    def __enter__(self) -> None:
        w = self.watch
        if w._thread is None:
            w._start()
        self.outer = w.label, w.since, w.waits
        w.label, w.since, w.waits = self.label, time.monotonic(), self.waits
        if w.recorder is not None:
            self.start = w.recorder.now()
        self.mark = w.clock.enter(self.category) if w.clock is not None else None

    def __exit__(self, kind, err, tb) -> bool:
        w = self.watch
        if w.clock is not None:
            w.clock.exit(self.category, self.mark)
        if err is not None:
            w._failed(err, self.label)  # a communication failure exits here; the rest propagates
            return False
        if w.recorder is not None:
            w.recorder.add(self.label, self.category, self.start, w.recorder.now(), **self.args)
        w.label, w.since, w.waits = self.outer
        if self.completes:
            w.last_completed = self.label
        return False
