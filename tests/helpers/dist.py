"""Multi-process test harness: run a function on N CPU ranks joined by a gloo process group.

    from tests.helpers.dist import run_distributed

    def _check(rank, world_size, n):           # module level, so spawn can import it
        ...
        return some_tensor                      # picklable; comes back to the parent

    results = run_distributed(_check, 4, 3)     # list, in rank order

Starting processes dominates the cost (each imports torch), so run many checks inside one group.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mlplat.parallel.nccl_strict import install_if_enabled

_PORT_RETRIES = 3


class DistributedTestError(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, kwargs, results):
    torch.set_num_threads(1)
    initialized = False
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        initialized = True
        install_if_enabled()  # MLPLAT_NCCL_STRICT (tests/conftest.py): gloo blocks where NCCL's host does
        out = fn(rank, world_size, *args, **kwargs)
        # Pickle to bytes here: torch's queue would otherwise share tensors through file descriptors
        # that die with this process.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if initialized:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may already be gone
                pass


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def _run_once(fn, world_size, args, kwargs, timeout):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, kwargs, results), daemon=True)
        for r in range(world_size)
    ]
    # One intra-op thread per worker on small CI boxes; set before spawn so the children inherit it.
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved

    deadline = time.monotonic() + timeout
    out: dict[int, object] = {}
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks exceeded {timeout}s "
                                   f"(ranks {missing} unfinished)")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    # A crash that bypassed Python (segfault, OOM kill) leaves no traceback behind.
                    time.sleep(0.2)
                    if results.empty():
                        raise DistributedTestError(
                            f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} without reporting"
                        )
                continue
            if not ok:
                # The other ranks are probably blocked in a collective: stop them now.
                raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{payload}")
            out[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        _kill(procs)
        results.close()
    return [out[r] for r in range(world_size)]


def run_distributed(fn, world_size: int, *args, timeout: float = 120, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo CPU processes.

    Returns the per-rank results in rank order. A rank's exception is re-raised here with its
    traceback text; past ``timeout`` seconds every child is killed and TimeoutError raised.
    """
    for attempt in range(_PORT_RETRIES):
        try:
            return _run_once(fn, world_size, args, kwargs, timeout)
        except DistributedTestError as err:
            # The free port can be taken between probing and binding (other test runs on the box).
            if "address already in use" in str(err).lower() and attempt + 1 < _PORT_RETRIES:
                continue
            raise
    raise AssertionError("unreachable")
