"""Hang reports: one pipeline rank stalls past parallel.timeout_s before a send; every rank says in one line where
it is blocked, and all of them exit, non-zero, within the timeout plus 30 s."""
from __future__ import annotations

import os
import re
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch.multiprocessing as mp

TIMEOUT_S = 3
STALL_S = 60  # far past the timeout: only the hang handling can end the job in time


def _rank(rank: int, port: int, out_dir: str, die: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from mlplat.parallel.grid import ParallelGrid
    from mlplat.parallel.hang import HangWatch
    from mlplat.parallel.layout.pipeline import PipelineLayout
    from mlplat.parallel.layout.schedules import Op
    from mlplat.parallel.pipeline.engine import PipelineEngine
    from mlplat.parallel.pipeline.p2p import StageComm

    handed_on = Path(out_dir) / "rank1_posted_grad0"

    class StallingComm(StageComm):
        """Pipeline rank 0 stalls (or dies) before sending micro-batch 1's activation."""

        def post(self, messages, payload):
            if self.grid.pp_rank == 1 and any(i.op is Op.SEND_GRAD and i.micro_batch == 0 for i in messages):
                handed_on.touch()
            if self.grid.pp_rank == 0 and any(i.op is Op.SEND_ACT and i.micro_batch == 1 for i in messages):
                if die:
                    # Die only once rank 1 has used micro-batch 0 (its B is done): a socket closed under a
                    # message in flight would lose that message too, and rank 1 would wait on another one.
                    deadline = time.monotonic() + STALL_S
                    while not handed_on.exists() and time.monotonic() < deadline:
                        time.sleep(0.01)
                    os._exit(1)
                time.sleep(STALL_S)
            return super().post(messages, payload)

    class Chunk(nn.Module):
        def __init__(self, last: bool):
            super().__init__()
            self.lin, self.last = nn.Linear(4, 4), last

        def forward(self, x, labels=None):
            y = self.lin(x)
            return (y - labels).pow(2).mean() if self.last else y

    timeout = timedelta(seconds=TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timeout)
    grid = ParallelGrid(1, 2, 1, timeout=timeout)
    stream = open(Path(out_dir) / f"rank{rank}.log", "w")
    watch = HangWatch(grid, TIMEOUT_S, stream=stream)
    comm = StallingComm(grid, (2, 3, 4), torch.float32, torch.device("cpu"))
    engine = PipelineEngine({rank: Chunk(last=rank == 1)}, grid, PipelineLayout(2, 1, "1f1b"), comm, watch=watch)
    micro = [(torch.randn(2, 3, 4), torch.randn(2, 3, 4)) for _ in range(2)]
    engine.run(micro)
    print("finished", file=stream, flush=True)  # must not be reached


def _start(tmp_path, die: bool):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return [ctx.Process(target=_rank, args=(r, port, str(tmp_path), die)) for r in range(2)]


def test_a_stalled_send_is_reported_by_every_rank_and_ends_the_job(tmp_path):
    procs = _start(tmp_path, die=False)
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=TIMEOUT_S + 30 + 20)  # + process start-up (torch import) on a busy machine
    elapsed = time.monotonic() - start
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [3, 3], [p.exitcode for p in procs]
    assert elapsed < STALL_S
    waiting = (tmp_path / "rank1.log").read_text().strip().splitlines()
    stalled = (tmp_path / "rank0.log").read_text().strip().splitlines()
    assert len(waiting) == 1 and len(stalled) == 1, (waiting, stalled)
    # The seconds said are those waited: the timeout, or a little more on a loaded machine.
    said = re.match(r"rank 1 \(t0,p1,d0\) blocked (\d+) s in RECV_ACT\(chunk 1, mb 1\) from pipeline rank 0 ",
                    waiting[0])
    assert said and TIMEOUT_S <= int(said.group(1)) < STALL_S, waiting
    assert "(Timed out waiting 3000ms for recv operation to complete)" in waiting[0], waiting
    assert waiting[0].endswith("last completed: B(chunk 1, mb 0)"), waiting
    assert stalled[0].startswith("rank 0 (t0,p0,d0) blocked") and \
        "in posting SEND_ACT(chunk 0, mb 1) to pipeline rank 1; last completed: F(chunk 0, mb 1)" in stalled[0], stalled


def test_a_dead_peer_is_named_as_such(tmp_path):
    procs = _start(tmp_path, die=True)
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=TIMEOUT_S + 30 + 20)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [1, 3], [p.exitcode for p in procs]
    (line,) = (tmp_path / "rank1.log").read_text().strip().splitlines()
    assert line.startswith("rank 1 (t0,p1,d0) failed") and "in RECV_ACT(chunk 1, mb 1) from pipeline rank 0; that " \
        "peer died (" in line and line.endswith("last completed: B(chunk 1, mb 0)"), line


def test_a_posted_transfer_that_never_completes_is_reported_by_its_label():
    """The GPU path: NCCL's host never blocks in a wait, so the watchdog polls the posted transfers instead."""
    from types import SimpleNamespace

    import torch

    from mlplat.parallel.allocator import AllocatorRetries
    from mlplat.parallel.hang import HangWatch

    class Work:
        def __init__(self, done: bool):
            self.done = done

        def is_completed(self) -> bool:
            return self.done

    lines: list[str] = []

    class Watch(HangWatch):
        def _exit(self, line: str) -> None:
            lines.append(line)
            raise SystemExit  # ends the watchdog thread instead of the process

    grid = SimpleNamespace(rank=5, tp_rank=1, pp_rank=1, dp_rank=0, cp=1, cp_rank=0)
    watch = Watch(grid, timeout_s=0.3, grace_s=0.0, poll_s=0.05)
    # A device-wide synchronize of the caching allocator could be the cause: the report names it
    watch.allocator = AllocatorRetries(torch.device("cpu"), stats=lambda device: {"num_alloc_retries": 2})
    watch.posted("SEND_ACT(chunk 0, mb 0) to pipeline rank 1", [Work(True)])  # completes: never reported
    watch.posted("RECV_GRAD(chunk 3, mb 2) from pipeline rank 2", [Work(False)])
    deadline = time.monotonic() + 10
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(lines) == 1 and lines[0].startswith("rank 5 (t1,p1,d0) waited"), lines
    assert "RECV_GRAD(chunk 3, mb 2) from pipeline rank 2 (posted, never completed)" in lines[0]
    assert lines[0].endswith("; the CUDA caching allocator retried 2 allocations after freeing its cache, each a "
                             "device-wide synchronize that can stall posted pipeline transfers (docs/gpu-nccl.md)")


def test_a_waited_transfer_releases_its_buffers_at_once_not_at_the_watch_poll():
    """ProcessGroupNCCL's point-to-point Work holds its tensor. The watch keeps the posted works only until the
    engine waits for them, so the engine's bound on live message buffers holds on GPUs too."""
    import gc
    import weakref
    from types import SimpleNamespace

    import torch

    from mlplat.parallel.hang import HangWatch
    from mlplat.parallel.pipeline.p2p import PostedGroup

    class Work:  # holds its buffer, as NCCL's does
        def __init__(self, tensor):
            self.tensor = tensor

        def wait(self) -> None:
            pass

        def is_completed(self) -> bool:
            return True

    grid = SimpleNamespace(rank=0, tp_rank=0, pp_rank=0, dp_rank=0, cp=1, cp_rank=0)
    watch = HangWatch(grid, timeout_s=60, poll_s=3600)  # the watchdog does not poll during the test
    buffer = torch.ones(4)
    group = PostedGroup([Work(buffer)], [], [buffer], comm=None)
    watch.posted("SEND_ACT(chunk 0, mb 0) to pipeline rank 1", group.works)
    alive = weakref.ref(buffer)
    del buffer
    group.wait()
    gc.collect()
    assert alive() is None, "the watch kept the waited send's buffer alive"


def test_a_ring_transfer_that_never_completes_is_reported_on_gpus(monkeypatch):
    """On NCCL the ring's waits return before the transfer ran, so the context-parallel ring registers its posted
    works with the hang watch as the pipeline does: one that never completes is reported by its hop; a completed
    one is released at its wait. The Works are stood in for (no GPU here)."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from mlplat.parallel.context import Ring
    from mlplat.parallel.hang import HangWatch

    class Work:
        def __init__(self, done: bool):
            self.done = done

        def wait(self) -> None:
            pass

        def is_completed(self) -> bool:
            return self.done

    stuck = {"send": False}
    monkeypatch.setattr(dist, "isend", lambda t, peer, group=None: Work(not stuck["send"]))
    monkeypatch.setattr(dist, "irecv", lambda t, peer, group=None: Work(True))
    lines: list[str] = []

    class Watch(HangWatch):
        def _exit(self, line: str) -> None:
            lines.append(line)
            raise SystemExit

    class GpuRing(Ring):
        @staticmethod
        def returns_early(tensor) -> bool:
            return True

    grid = SimpleNamespace(rank=2, tp_rank=0, pp_rank=0, dp_rank=0, cp=4, cp_rank=1, cp_group=None,
                           cp_ranks=[0, 2, 4, 6])
    watch = Watch(grid, timeout_s=0.3, grace_s=0.0, poll_s=0.05)
    ring = GpuRing(grid, watch)
    done = ring.post(torch.ones(2), torch.zeros(2), "forward K/V hop 1 of 3")
    ring.wait(done)
    assert done[0] == []  # released at its wait, not at the watch's poll
    stuck["send"] = True
    ring.post(torch.ones(2), torch.zeros(2), "backward dK/dV hop 2 of 4")
    deadline = time.monotonic() + 10
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(lines) == 1 and "the context-parallel ring (backward dK/dV hop 2 of 4) (posted, never completed)" \
        in lines[0], lines
