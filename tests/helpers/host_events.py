"""Host-timed stand-ins for the CUDA events of `StepClock(event=...)` (mlplat.parallel.straggler): a point of a
stream read on a host clock, so a block's time includes the host's waits in gloo the way a GPU's compute stream's
includes its waits on NCCL. On a CPU a process's own time leaves waits out anyway; these let a CPU run see what the
events see. For the straggler tests only."""
from __future__ import annotations

import time
from typing import Callable


class HostEvent:
    """A point of the host's (or a simulated rank's) clock `now`, in seconds; `elapsed_time` in ms as CUDA's."""

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.t = now()

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end.t - self.t) * 1e3

    def synchronize(self) -> None:
        pass
