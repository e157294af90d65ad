"""NCCL-strict mode's rules on real gloo ranks: each order below deadlocks on NCCL, deadlocks in this mode
(gloo's group timeout ends it) and runs through with torch's own functions, which is what CI would see
without the mode.

- A pair's point-to-point communicator: ranks 0, 1 and 2 of one group each send first to a different peer
  (0 -> 1, 1 -> 2, 2 -> 0), so each blocks creating a pair communicator whose other rank is creating another one.
  A barrier of the whole group at its first use (this mode before) lets them through.
- A collective's communicator: rank 0 posts an asynchronous all-reduce on a fresh group and then sends to rank 1,
  which receives before it joins the all-reduce: rank 0 blocks in the group's creation, rank 1 in its receive.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from mlplat.harness import nccl_strict
from tests.helpers.dist import run_distributed

TIMEOUT = timedelta(seconds=3)


def _original(name: str):
    fn = getattr(dist, name)
    return getattr(fn, "strict_original", fn)


def _outcome(run) -> str:
    """"ran", or "timed out" when the ranks hung until the group's timeout: a rank whose peer timed out first and
    closed its connections sees "connection closed by peer" instead, the same hang seen later."""
    try:
        run()
        return "ran"
    except RuntimeError as err:
        why = str(err).lower()
        return "timed out" if any(k in why for k in ("timed out", "timeout", "connection closed by peer")) else str(err)


def _pair_ring(rank: int, strict: bool) -> None:
    group = dist.new_group([0, 1, 2], timeout=TIMEOUT)
    isend, irecv = (dist.isend, dist.irecv) if strict else (_original("isend"), _original("irecv"))
    out, into = torch.full((4,), float(rank)), torch.zeros(4)
    works = [isend(out, (rank + 1) % 3, group=group), irecv(into, (rank - 1) % 3, group=group)]
    for w in works:
        w.wait()
    assert into[0].item() == (rank - 1) % 3


def _collective_first(rank: int, strict: bool) -> None:
    fresh = dist.new_group([0, 1], timeout=TIMEOUT)
    other = dist.new_group([0, 1], timeout=TIMEOUT)
    all_reduce, send, recv = (dist.all_reduce, dist.send, dist.recv) if strict else \
        (_original("all_reduce"), _original("send"), _original("recv"))
    x = torch.ones(2)
    if rank == 0:
        work = all_reduce(x, group=fresh, async_op=True)
        send(torch.ones(1), 1, group=other)
        work.wait()
    elif rank == 1:
        recv(torch.zeros(1), 0, group=other)
        all_reduce(x, group=fresh)


def _check(rank, world_size):
    assert nccl_strict.enabled()
    out = {}
    for strict in (False, True):  # torch's own first: the strict run's timed-out ranks are the last thing done
        out[("pair", strict)] = _outcome(lambda: _pair_ring(rank, strict))
    for strict in (False, True):
        out[("collective", strict)] = _outcome(lambda: _collective_first(rank, strict))
    return out


def test_nccl_strict_creates_a_communicator_per_pair_and_per_collective_group():
    results = run_distributed(_check, 3, timeout=120)
    assert [r[("pair", False)] for r in results] == ["ran"] * 3
    assert [r[("pair", True)] for r in results] == ["timed out"] * 3, results
    assert [r[("collective", False)] for r in results] == ["ran"] * 3
    assert results[0][("collective", True)] == results[1][("collective", True)] == "timed out", results
