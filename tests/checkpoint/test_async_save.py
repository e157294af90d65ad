"""Saves written behind training (`io.AsyncSaver`, `checkpoint.async_save`), in one process: the save returns while
DCP's write is still held, nothing is published before every file is written, the checkpoint holds the state of the
step it was taken at (not the weights changed after it), a failed write is raised at the next wait, and a process
killed while a write is in flight leaves the previous checkpoint the one `last` resumes."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest
import torch

from tests.checkpoint.test_io import _module
from tests.helpers.cli import REPO


def _hold_writes(monkeypatch):
    """DCP's write of every later save waits for `gate` (set by the test); `started` says it was reached."""
    from mlplat.checkpoint import io

    started, gate = threading.Event(), threading.Event()
    real = io._RecordingWriter.write_data

    def held(self, plan, planner):
        started.set()
        assert gate.wait(60), "the test never released the write"
        return real(self, plan, planner)

    monkeypatch.setattr(io._RecordingWriter, "write_data", held)
    return started, gate


def _weights(module) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.detach().clone() for i, c in module.chunks.items() for n, p in c.named_parameters()}


def test_an_async_save_is_committed_only_once_every_file_is_written(tmp_path, monkeypatch):
    from mlplat.checkpoint import io

    module, opt = _module(tp=1)
    root = tmp_path / "checkpoints"
    saver = io.AsyncSaver(module.grid)
    saver.save(root / "step-2", module.chunks, opt, module.grid, {"global_step": 2}, {"tp": 1})
    saver.wait()
    assert (root / io.LATEST).read_text().strip() == "step-2"

    started, gate = _hold_writes(monkeypatch)
    saved = _weights(module)
    saver.save(root / "step-4", module.chunks, opt, module.grid, {"global_step": 4}, {"tp": 1},
               rank_state={"rng": torch.get_rng_state()})
    assert started.wait(30) and saver.in_flight  # the save returned; its write is running behind
    with torch.no_grad():  # training goes on and changes the weights: the checkpoint keeps the step's own
        for p in module.chunks[0].parameters():
            p.add_(1.0)
    (partial,) = root.glob("step-4.partial-*")
    assert not (partial / io.MANIFEST).exists() and not (root / "step-4").exists()
    assert io.find_last(root) == root / "step-2"

    gate.set()
    saver.wait()
    manifest = io.verify(root / "step-4")  # every file it lists exists, whole, with its checksum
    assert {io.DCP_METADATA, io.LIGHTNING_STATE, "rank-0.pt"} <= set(manifest["files"])
    assert any(name.endswith(".distcp") for name in manifest["files"])
    assert (root / io.LATEST).read_text().strip() == "step-4" and not list(root.glob("*.partial-*"))
    io.load(root / "step-4", module.chunks, opt, module.grid, vocab_size=250)
    after = _weights(module)
    assert all(torch.equal(saved[k], after[k]) for k in saved)


def test_a_failed_async_write_is_raised_at_the_next_wait_and_publishes_nothing(tmp_path, monkeypatch):
    from mlplat.checkpoint import io

    module, opt = _module(tp=1)
    root = tmp_path / "checkpoints"
    saver = io.AsyncSaver(module.grid)

    def full_disk(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io._RecordingWriter, "write_data", full_disk)
    saver.save(root / "step-2", module.chunks, opt, module.grid, {"global_step": 2}, {"tp": 1})
    with pytest.raises(Exception, match="No space left on device"):
        saver.wait()
    saver.wait()  # raised once
    assert not (root / "step-2").exists() and not (root / io.LATEST).exists()


KILLED_ASYNC_SAVE = """
import os, signal, sys, threading
from mlplat.checkpoint import io
from tests.checkpoint.test_io import _module

module, opt = _module(tp=1)
saver = io.AsyncSaver(module.grid)
root = sys.argv[1]
saver.save(f"{root}/step-2", module.chunks, opt, module.grid, {"global_step": 2}, {"tp": 1})
saver.wait()
returned = threading.Event()
real = io._RecordingWriter.write_data
def dying(self, plan, planner):
    out = real(self, plan, planner)         # the shards are written behind training ...
    returned.wait(30)
    os.kill(os.getpid(), signal.SIGKILL)    # ... and the process dies before the manifest, the rename, `latest`
    return out
io._RecordingWriter.write_data = dying
saver.save(f"{root}/step-4", module.chunks, opt, module.grid, {"global_step": 4}, {"tp": 1})
print("training went on", flush=True)
returned.set()
threading.Event().wait(60)
"""


def test_kill_during_an_async_write_leaves_the_previous_checkpoint(tmp_path):
    from mlplat.checkpoint import io

    root = tmp_path / "checkpoints"
    proc = subprocess.run([sys.executable, "-c", KILLED_ASYNC_SAVE, str(root)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "training went on" in proc.stdout
    assert not (root / "step-4").exists() and list(root.glob("step-4.partial-*"))
    assert (root / io.LATEST).read_text().strip() == "step-2"
    assert io.find_last(root) == root / "step-2"
    assert io.verify(root / "step-2")["step"] == 2


def test_async_save_takes_true_or_false_and_async_mode_thread_or_process():
    from mlplat.config import ConfigError, load_config

    model = {"vocab_size": 256}
    assert load_config({"model": model, "checkpoint": {"async_save": True}}, world_size=1).checkpoint.async_save
    with pytest.raises(ConfigError, match=r"^checkpoint.async_save='maybe' must be true or false$"):
        load_config({"model": model, "checkpoint": {"async_save": "maybe"}}, world_size=1)
    assert load_config({"model": model, "checkpoint": {"async_mode": "process"}}, world_size=1).checkpoint.async_mode \
        == "process"
    with pytest.raises(ConfigError, match=r"^checkpoint.async_mode='fork' is not one of thread, process$"):
        load_config({"model": model, "checkpoint": {"async_mode": "fork"}}, world_size=1)


def test_the_host_arena_is_one_buffer_reused_from_save_to_save():
    """Asynchronous saves copy a rank's device tensors into views of one host buffer (pinned on GPUs), at aligned
    offsets, reused by the next save and grown only when the state grows: not one pinned block per tensor, which the
    caching host allocator would round up to a power of two and keep for the run."""
    from mlplat.checkpoint.host_arena import ALIGN, HostArena

    arena = HostArena(pin=False)  # no CUDA here: the same layout, unpinned
    state = [torch.randn(3, 5, dtype=torch.float32), torch.arange(7, dtype=torch.int64),
             torch.randn(2, 3, dtype=torch.float64).to(torch.bfloat16), torch.tensor(2.5, dtype=torch.float64),
             torch.empty(0, 4)]
    views = arena.views(state)
    for view, t in zip(views, state):
        assert view.shape == t.shape and view.dtype == t.dtype
        view.copy_(t)
    assert all(torch.equal(v, t) for v, t in zip(views, state))  # no two views overlap
    base = arena.buffer.data_ptr()
    assert all((v.data_ptr() - base) % ALIGN == 0 for v in views if v.numel())
    assert arena.nbytes == sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in state)
    again = arena.views(state)  # the next save: the same buffer
    assert arena.buffer.data_ptr() == base and [v.data_ptr() for v in again] == [v.data_ptr() for v in views]
    grown = arena.views([*state, torch.zeros(1000)])
    assert arena.nbytes >= 4000 and grown[-1].shape == (1000,)


def _sockets() -> int:
    import os

    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


def _saver_group_connections(rank: int, world_size: int) -> tuple[int, int, float]:
    import torch.distributed as dist

    from mlplat.checkpoint import io

    base = _sockets()
    eager = dist.new_group(backend="gloo")  # a gloo group as torch makes it: every pair connected now
    full_mesh = _sockets() - base
    base = _sockets()
    with io._gloo_lazy():
        lazy = dist.new_group(backend="gloo")
    dist.barrier()  # every rank's group made ...
    made = _sockets() - base
    dist.barrier()  # ... and counted before any talks on it
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=lazy)  # the pairs it needs connect now
    dist.barrier(group=lazy)
    dist.destroy_process_group(eager)
    return full_mesh, made, float(total)


def test_the_saves_gloo_group_connects_pairs_as_they_talk_not_a_full_mesh():
    """The asynchronous saver's gloo world group is made lazily: no peer connection at creation, its own listening
    socket only (a full mesh is one per peer besides, 4,095 at 4,096 ranks, held for the run); its collectives
    still work."""
    from tests.helpers.dist import run_distributed

    results = run_distributed(_saver_group_connections, 4)
    assert all(full >= 3 + 1 for full, _, _ in results), results  # eager: a socket per peer, and its listener
    assert all(made <= 1 for _, made, _ in results), results
    assert all(total == 6.0 for _, _, total in results), results
