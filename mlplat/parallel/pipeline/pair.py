"""A forward and a backward of two micro-batches run as one combined compute (the overlapped schedule, 1f1b_overlap).

The forward runs on the calling thread and the backward on a helper thread, never both at once: one side runs
until it has posted a collective asynchronously (an expert all-to-all, `mlplat.parallel.dispatch`), then hands
over (`Alternation.hand_over`) and the other side runs until it posts one of its own; a side waits for its
collective only when its turn comes back. So each all-to-all flies while the other micro-batch's attention or
experts compute (on gloo in gloo's own threads, on a GPU on NCCL's stream), as DeepSeek-V3's DualPipe pairs them.

The hand-overs make the order of the collectives the same on every rank: strict alternation at each post, one
post per side per turn, whatever the timing (`mlplat.parallel.layout.exchange.paired_collectives` states it and
`mlplat.perf.transport` runs it under NCCL's rules). Nothing of the computation changes, only when it runs: the
forward builds the same graph and the backward walks the same graph in the same order, so losses and gradients are
bit-identical to running the two one after the other (tests/parallel/test_moe.py).
"""
from __future__ import annotations

import threading
from typing import Callable

FORWARD, BACKWARD = "F", "B"


class PairAborted(RuntimeError):
    """Raised in a side of a pair at its next hand-over once the other side has failed: it must post no more
    collectives (its peers are alternating, so its next one would meet a peer's other pass: a hang, or on NCCL rows
    of the same width silently mixed), and the other side's error is the one `run` raises."""


class Alternation:
    """Runs pairs (`run`); between pairs `hand_over` does nothing. One per pipeline engine, handed to the
    dispatchers of its chunks' MoE layers (`TokenDispatcher.alternation`)."""

    def __init__(self):
        self._turn = {FORWARD: threading.Semaphore(0), BACKWARD: threading.Semaphore(0)}
        self._running: str | None = None  # the side whose turn it is; None: no pair running
        self._finished: set[str] = set()
        self._failed = False  # a side raised: the other stops at its next hand-over
        self.posts: list[str] | None = None  # when a list: each hand-over's side, in order (tests read it)

    def run(self, forward: Callable[[], object], backward: Callable[[], object]) -> None:
        """forward() here and backward() on a helper thread, alternating at each hand-over; both to completion. An
        exception of either is raised here once both have stopped."""
        errors: list[BaseException] = []
        # fresh turns: a pair ended by an exception inside `acquire` must not leave the next one a permit
        self._turn = {FORWARD: threading.Semaphore(0), BACKWARD: threading.Semaphore(0)}
        self._finished, self._failed = set(), False
        self._running = FORWARD
        helper = threading.Thread(target=self._side, args=(BACKWARD, backward, errors), daemon=True)
        helper.start()
        self._side(FORWARD, forward, errors, first=True)
        helper.join()
        self._running = None
        if errors:  # the failure itself, not the other side's PairAborted
            raise next((e for e in errors if not isinstance(e, PairAborted)), errors[0])

    def _side(self, side: str, fn: Callable[[], object], errors: list, first: bool = False) -> None:
        if not first:
            self._turn[side].acquire()  # the backward starts at the forward's first hand-over
        try:
            if self._failed:  # the forward failed before its first hand-over: the backward never starts
                raise PairAborted("the paired forward failed")
            fn()
        except BaseException as err:  # raised by `run`, after the other side has stopped too
            if not isinstance(err, PairAborted):
                self._failed = True
            errors.append(err)
        finally:
            self._finished.add(side)
            other = _other(side)
            if other not in self._finished:
                self._running = other
                self._turn[other].release()

    def hand_over(self) -> None:
        """Called by the running side right after posting a collective: the other side runs until its own next
        hand-over (or its end), then this one goes on. No-op outside a pair, or once the other side has finished."""
        side = self._running
        if side is None:
            return
        if self._failed:  # the other side raised: post nothing more, end this side with it
            raise PairAborted(f"the paired {'backward' if side == FORWARD else 'forward'} failed")
        if self.posts is not None:
            self.posts.append(side)
        other = _other(side)
        if other in self._finished:
            return
        self._running = other
        self._turn[other].release()
        self._turn[side].acquire()
        if self._failed:  # the other side raised in its turn
            raise PairAborted(f"the paired {'backward' if side == FORWARD else 'forward'} failed")


def _other(side: str) -> str:
    return BACKWARD if side == FORWARD else FORWARD
