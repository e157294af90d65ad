"""NCCL-strict CPU runs: gloo made to block where NCCL's host blocks (`MLPLAT_NCCL_STRICT=1`).

gloo connects every group when it is created and never blocks the host in a post, so a CPU run cannot see two
of NCCL's host-side rules (docs/gpu-nccl.md). Installed in a process, `StrictTransport` wraps torch.distributed's
isend and irecv so that
- the first operation on each process group waits in a barrier of that group before it is posted, as
  ProcessGroupNCCL's lazy communicator creation waits in `ncclCommInitRank` until the peer reaches its own first
  operation on the group: an order of first uses that deadlocks on NCCL deadlocks here too (and the hang watch
  names the step);
- `synchronize()` waits for every operation posted so far, as `torch.cuda.synchronize()` waits for NCCL's
  streams: code that calls it while receives are posted ahead stalls here as it would on a GPU.

The test suite runs in this mode (tests/conftest.py); the strategy and the test harness install it in every
rank when the variable is set.
"""
from __future__ import annotations

import functools
import os
import weakref

import torch.distributed as dist

ENV = "MLPLAT_NCCL_STRICT"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


class StrictTransport:
    """Wraps dist.isend / dist.irecv of this process while installed (`install()` ... `uninstall()`)."""

    def __init__(self):
        # The groups whose "communicator" exists; weak, so a group of an earlier run in this process (a Hydra
        # multirun) is never mistaken for a new one that reuses its address.
        self.ready: weakref.WeakSet = weakref.WeakSet()
        self.posted: list = []  # works posted and not yet seen completed
        self._saved: dict = {}

    def _first_use(self, group) -> None:
        group = group if group is not None else dist.group.WORLD
        if group not in self.ready:
            dist.barrier(group=group)  # the rendezvous of communicator creation: blocks until the peer is here
            self.ready.add(group)

    def _wrap(self, fn):
        @functools.wraps(fn)
        def post(tensor, *args, group=None, **kwargs):
            self._first_use(group)
            work = fn(tensor, *args, group=group, **kwargs)
            self.posted = [w for w in self.posted if not w.is_completed()] + [work]
            return work
        post.strict_original = fn
        return post

    def synchronize(self) -> None:
        """What a device-wide synchronize does to the communication streams: wait for every posted operation."""
        for work in self.posted:
            work.wait()
        self.posted = []

    def install(self) -> "StrictTransport":
        if not self._saved:
            # torch's own functions, also under a transport of an earlier run that was never uninstalled
            self._saved = {name: getattr(getattr(dist, name), "strict_original", getattr(dist, name))
                           for name in ("isend", "irecv")}
            for name, fn in self._saved.items():
                setattr(dist, name, self._wrap(fn))
        return self

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}


def install_if_enabled() -> StrictTransport | None:
    return StrictTransport().install() if enabled() else None
