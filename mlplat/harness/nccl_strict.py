"""NCCL-strict CPU runs: gloo made to block where NCCL's host blocks (`MLPLAT_NCCL_STRICT=1`).

gloo connects every group when it is created and never blocks the host in a post, so a CPU run cannot see
NCCL's host-side rules (docs/gpu-nccl.md). Installed in a process, `StrictTransport` wraps torch.distributed's
point-to-point functions and collectives so that
- the first point-to-point operation between two ranks on a process group waits until the peer reaches its own
  first one with this rank on that group, as ProcessGroupNCCL creates a 2-rank communicator per pair of a
  group (keyed low:high) at that pair's first send or receive and blocks in `ncclCommInitRank` until both are
  there. So at c >= 3 each neighbour pair of the context-parallel ring has its own rendezvous, not one for the
  whole group;
- the first collective on a group waits in a barrier of that group, as the group's collective communicator is
  created at its first collective, an asynchronous one included (the host blocks before it returns);
- `synchronize()` waits for every operation posted so far, as `torch.cuda.synchronize()` waits for NCCL's
  streams: code that calls it while receives are posted ahead stalls here as it would on a GPU.
An order of first uses that deadlocks on NCCL deadlocks here too (and the hang watch names the step).

Not modelled: one stream per communicator, on which NCCL runs a communicator's operations one after the other in
posting order (the transport model, `mlplat.perf.transport`, checks the pipeline's and the ring's plans for that);
`dist.barrier()` on NCCL is a sync of the current stream with the host, which on a CPU has nothing to wait for;
object collectives reach torch's internal collectives, not these wrappers (they ride on groups already created).

The test suite runs in this mode (tests/conftest.py); the strategy and the test harness install it in every
rank when the variable is set.
"""
from __future__ import annotations

import functools
import os
import weakref

import torch
import torch.distributed as dist

from mlplat.parallel.profile import COLLECTIVES

ENV = "MLPLAT_NCCL_STRICT"
POINT_TO_POINT = ("isend", "irecv", "send", "recv")
_RENDEZVOUS_TAG = 0x5EED  # the pair rendezvous's own token: never matched with a message of the run


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


class StrictTransport:
    """Wraps torch.distributed's point-to-point functions and collectives of this process while installed
    (`install()` ... `uninstall()`)."""

    def __init__(self):
        # Per group, the communicators that exist: "collective" and the (low, high) pairs of point-to-point. Weak,
        # so a group of an earlier run in this process (a Hydra multirun) is never mistaken for a new one that
        # reuses its address.
        self.ready: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.posted: list = []  # works posted and not yet seen completed
        self._saved: dict = {}

    def _created(self, group, key) -> bool:
        made = self.ready.setdefault(group, set())
        if key in made:
            return True
        made.add(key)
        return False

    def _first_collective(self, group) -> None:
        group = group if group is not None else dist.group.WORLD
        if not self._created(group, "collective"):
            self._saved["barrier"](group=group)  # communicator creation: blocks until every member is here

    def _first_pair(self, group, peer: int | None) -> None:
        group = group if group is not None else dist.group.WORLD
        me = dist.get_rank()
        if peer is None:  # given as a group rank: the pair is not known here, the whole group meets
            return self._first_collective(group)
        if self._created(group, (min(me, peer), max(me, peer))):
            return None
        # Both ranks of the pair block until the other is here, and no other rank of the group is involved.
        token = torch.zeros(1)
        first, second = (self._saved["send"], self._saved["recv"]) if me < peer else \
            (self._saved["recv"], self._saved["send"])
        first(token, peer, group=group, tag=_RENDEZVOUS_TAG)
        second(token, peer, group=group, tag=_RENDEZVOUS_TAG)
        return None

    def _wrap_p2p(self, fn, peer_key: str):
        @functools.wraps(fn)
        def post(tensor, *args, group=None, **kwargs):
            self._first_pair(group, args[0] if args else kwargs.get(peer_key))
            work = fn(tensor, *args, group=group, **kwargs)
            if work is not None:  # isend/irecv; send/recv have completed
                self.posted = [w for w in self.posted if not w.is_completed()] + [work]
            return work
        post.strict_original = fn
        return post

    def _wrap_collective(self, fn):
        @functools.wraps(fn)
        def collective(*args, **kwargs):
            self._first_collective(kwargs.get("group"))
            return fn(*args, **kwargs)
        collective.strict_original = fn
        return collective

    def synchronize(self) -> None:
        """What a device-wide synchronize does to the communication streams: wait for every posted operation."""
        for work in self.posted:
            work.wait()
        self.posted = []

    def install(self) -> "StrictTransport":
        if not self._saved:
            # torch's own functions, also under a transport of an earlier run that was never uninstalled
            names = [n for n in POINT_TO_POINT + COLLECTIVES if hasattr(dist, n)]
            self._saved = {n: getattr(getattr(dist, n), "strict_original", getattr(dist, n)) for n in names}
            for name, fn in self._saved.items():
                if name in POINT_TO_POINT:
                    wrapped = self._wrap_p2p(fn, "dst" if name in ("isend", "send") else "src")
                else:
                    wrapped = self._wrap_collective(fn)
                setattr(dist, name, wrapped)
        return self

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}


def install_if_enabled() -> StrictTransport | None:
    return StrictTransport().install() if enabled() else None
