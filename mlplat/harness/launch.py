"""Run a function on N local CPU processes joined by a gloo process group, and collect what each returns.

    from mlplat.harness.launch import launch

    def check(rank, world_size, n):        # module level, so that spawned processes can import it
        ...
        return some_tensor                  # picklable; comes back to the parent

    results = launch(check, 4, 3)           # one result per rank, in rank order

The one process-spawning helper of the tests (tests/helpers/dist.py), the experiments and the calibration tool.
Starting processes dominates the cost (each imports torch), so run many checks inside one launch. Each process
gets one intra-op thread; a rank's exception comes back with its traceback, a crash without one (a segfault, an
OOM kill) and a hang past `timeout` are reported too, and every child is killed before `launch` returns or raises.
Nothing is kept between launches.
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PORT_RETRIES = 3  # a free port can be taken between probing it and binding it (other runs on the machine)


class RankFailed(RuntimeError):
    """A rank raised or died; the message carries that rank's traceback when it had one."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, setup, args, kwargs, results, env):
    os.environ.clear()  # the launching process's environment now, as a spawned process gets it (not the server's)
    os.environ.update(env)
    torch.set_num_threads(1)
    initialized = False
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        initialized = True
        if setup is not None:
            setup()
        out = fn(rank, world_size, *args, **kwargs)
        # Pickled here: torch's queue would otherwise share tensors through file descriptors that die with us.
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


def _start(procs) -> None:
    # One intra-op thread per process on small boxes; set before spawning so that the children inherit it.
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


def _launch_once(fn, world_size, setup, args, kwargs, timeout, preload) -> list:
    if preload:  # forked from one server that imported `preload` once (it never runs tensor work: fork-safe)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
    else:
        ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, setup, args, kwargs, results, env),
                         daemon=True) for r in range(world_size)]
    _start(procs)
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks exceeded {timeout}s (ranks {missing} "
                                   f"unfinished)")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    time.sleep(0.2)  # its report may still be in the pipe
                    if results.empty():
                        raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} without "
                                         f"reporting") from None
                continue
            if not ok:  # the other ranks are probably blocked in a collective: stop them now
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{payload}")
            out[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        _kill(procs)
        results.close()
    return [out[r] for r in range(world_size)]


def launch(fn: Callable, world_size: int, *args, timeout: float = 120, setup: Callable[[], Any] | None = None,
           preload: Sequence[str] = (), **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh gloo CPU processes; the results in
    rank order. ``setup()`` (picklable, e.g. a module-level function) runs in every process once the group exists.
    With ``preload`` (module names) the processes are forked from multiprocessing's forkserver, which imports those
    modules once for every launch of this process (the first launch's list counts), instead of each new
    interpreter importing them. A rank's exception is raised here as `RankFailed` with its traceback; past
    ``timeout`` seconds every process is killed and TimeoutError raised."""
    for attempt in range(PORT_RETRIES):
        try:
            return _launch_once(fn, world_size, setup, args, kwargs, timeout, preload)
        except RankFailed as err:
            if "address already in use" in str(err).lower() and attempt + 1 < PORT_RETRIES:
                continue
            raise
    raise AssertionError("unreachable")
