"""Sharded, atomic, verifiable checkpoints on torch.distributed.checkpoint (DCP).

Saving. Every rank writes its own shards into `step-N.partial-<id>/` (DCP: `__<rank>_0.distcp`; the coordinator
adds `.metadata`) and its own `rank-<rank>.pt` (its RNG states). Then every rank checksums the files *it*
wrote, all ranks at once, and sends rank 0 only their names, sizes and CRC32s (a gather of a few hundred
bytes). Rank 0 adds the Lightning state and the manifest `mlplat.json` and renames the folder to `step-N/`.
No rank ever waits for work proportional to more than one rank's shard: verification costs a rank what its
own write cost (experiments/checkpoint_bench/).

Behind training (`AsyncSaver`, `checkpoint.async_save`): the same files and the same commit, but the step only
waits for the previous save and copies its tensors to host memory; DCP's asynchronous save writes the copy (in its
thread, or with `checkpoint.async_mode=process` in its save process of each rank), and a thread of each rank
checksums and commits it, on a process group of their own.

Atomicity. The rename makes a checkpoint visible only once complete; a save killed half-way leaves the previous
one intact. Re-saving an existing step first renames the old folder aside (`step-N.old-<id>`), renames the new
one in place, then deletes the old: at every moment a complete checkpoint of step N exists under a name that
`find_last` lists.

Order. The checkpoint that continues a run is the one committed last as its lineage's tip, not the highest step.
Each commit names itself in the folder's `latest` file (replaced atomically, after the rename), which `find_last`
follows, unless it was saved inside a run of skipped steps (`save(..., latest=False)`). A resume from an earlier
step of the same folder (a branch) first moves the later steps aside (`set_aside_later`), so that the folder holds
one lineage.

Loading. Every rank checks the manifest and the sizes of all files (cheap), then checksums its share of the
files — those it wrote when the layout is unchanged, a byte-balanced share of the rest otherwise — once; the
ranks exchange their verdicts so that all refuse together, with one CheckpointError line. mlplat's own files
(`lightning.pt`, `rank-*.pt`) are plain data read with `torch.load(weights_only=True)`: a file that would run
code when unpickled is refused. DCP's `.metadata` is a pickle that torch.distributed.checkpoint reads with
full unpickling, so a checkpoint folder must still come from a trusted source. Then one dcp.load reads
everything, on every rank the same collective whatever the rank holds (a middle stage holds no embedding): the
word embedding, whose padded size depends on tp, is requested as regions of the saved table (this rank's rows of
the real vocabulary; with the distributed optimizer its data-parallel range of them), so no rank reads the
whole table; rows past the vocabulary are zero.

Timeouts. Every collective here follows file I/O whose length differs between ranks; they run on the grid's
`io_group`, which waits `checkpoint.timeout_s` (default 30 min), not the step's `parallel.timeout_s`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
import warnings
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemWriter, LoadPlan
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: not caught by `except Exception`
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from mlplat.checkpoint.host_arena import HostArena
from mlplat.checkpoint.state import (
    VOCAB_ROWS,
    WORD_EMBEDDING,
    buffer_state,
    flat_boxes,
    full_parameters,
    main_params_of,
    optimizer_state_of,
    step_tensor,
    tp_mesh,
    training_state,
)
from mlplat.errors import not_regular, os_error
from mlplat.optim.factory import state_names
from mlplat.parallel.grid import ParallelGrid, dist_ready
from mlplat.parallel.layout.dims import ParallelDims

MANIFEST = "mlplat.json"
LIGHTNING_STATE = "lightning.pt"
DCP_METADATA = ".metadata"
RANK_STATE = "rank-{rank}.pt"
# in the state `load` returns: the optimizer state that started at zero (`fresh_state`), for the schedule's groups
FRESH_STATE = "fresh_optimizer_state"
STEP_DIR = re.compile(r"^step-(\d+)(\.old-[0-9a-f]+)?$")
LATEST = "latest"  # in a checkpoints folder: the name of the checkpoint committed there last
# a step saved again by an mlplat before `latest` (Lightning's -vK)
LIGHTNING_VERSION = re.compile(r"^step-(\d+)-v\d+$")
ABANDONED = "abandoned"  # in a checkpoints folder: <time>/step-K, the later steps of a lineage a resume branched from
BLOCK = 1 << 24  # 16 MiB per read: zlib.crc32 releases the GIL on large buffers

log = logging.getLogger("mlplat")
last_save_seconds: dict[str, float] = {}  # this rank's phases of its latest save (experiments/checkpoint_bench)

from mlplat.checkpoint import CheckpointError  # noqa: E402,F401  (defined torch-free for mlplat.train)


@contextmanager
def _quiet_sharded_tensor():
    """DCP warns on every ShardedTensor (the boxes of data-parallel shards, see state.py) that it is deprecated."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def _rank() -> int:
    return dist.get_rank() if dist_ready() else 0


def _world() -> int:
    return dist.get_world_size() if dist_ready() else 1


def io_group(grid: ParallelGrid | None):
    """The world group whose collectives may wait `checkpoint.timeout_s` (ParallelGrid.io_group): every collective
    here follows file I/O whose length differs between ranks. None (a grid built without it): the default group."""
    return getattr(grid, "io_group", None)


def _barrier(group=None) -> None:
    if dist_ready():
        dist.barrier(group=group)


def _broadcast(obj: Any, group=None) -> Any:
    if not dist_ready():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, 0, group=group)
    return box[0]


def _all_gather(obj: Any, group=None) -> list:
    if not dist_ready():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def _gather_to_0(obj: Any, group=None) -> list | None:
    if not dist_ready():
        return [obj]
    out: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while block := f.read(BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def _entry(path: Path, rank: int) -> dict:
    return {"bytes": path.stat().st_size, "crc32": crc32(path), "rank": rank}


# -- plain-data pickles -----------------------------------------------------------------------------------
def load_plain(path: Path, checkpoint: Path) -> Any:
    """torch.load(weights_only=True): tensors and plain containers only; anything else is refused in one line
    (a pickle that names a callable would otherwise run it)."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {checkpoint} is incomplete: {path.name} is missing") from None
    except Exception as e:  # noqa: BLE001 - UnpicklingError for foreign objects, anything for garbage
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {checkpoint} is refused: {path.name} is not plain data (torch.load with "
                              f"weights_only=True failed: {why})") from None


def _check_plain(data: bytes, name: str) -> None:
    """That torch.save's bytes load back with weights_only=True: a type that would not is found at save time, not
    when a run tries to resume."""
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"{name} would not load with weights_only=True: {e}") from None


# -- save -------------------------------------------------------------------------------------------------
class _RecordingWriter(FileSystemWriter):
    """DCP's file-system writer that remembers which files this rank wrote (for its own checksums)."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        self.written = sorted({r.storage_data.relative_path for r in future.wait()})
        return future


def _written_by(metadata, rank: int) -> list[str]:
    """The shard files `rank` wrote, from the metadata a save returns (a save in DCP's process wrote them there: the
    writer here never ran). FileSystemWriter names rank i's files `__<i>_<n>.distcp`."""
    prefix = f"__{rank}_"
    return sorted({s.relative_path for s in metadata.storage_data.values() if s.relative_path.startswith(prefix)})


def _plain_files(lightning_state: dict, rank_state: dict | None, rank: int) -> dict[str, bytes]:
    """mlplat's own files of this rank, serialised now (the state of this very step): its RNG states, and on rank 0
    the Lightning state."""
    out = {}
    for name, obj in ((RANK_STATE.format(rank=rank), rank_state), (LIGHTNING_STATE, lightning_state if rank == 0
                                                                   else None)):
        if obj is not None:
            buf = io.BytesIO()
            torch.save(obj, buf)
            out[name] = buf.getvalue()
    return out


def _write_files(partial: Path, files: dict[str, bytes]) -> list[str]:
    for name, data in files.items():
        _check_plain(data, name)
        (partial / name).write_bytes(data)
    return list(files)


def save(path: str | Path, chunks, optimizer, grid: ParallelGrid, lightning_state: dict, layout: dict,
         rank_state: dict | None = None, skipped: int = 0) -> Path:
    """Every rank calls this (rank_state: this rank's own plain data, e.g. its RNG states); returns the folder once
    it is committed. `skipped`: the optimizer steps skipped in a row (inf/NaN) when it was saved (`_publish`)."""
    t0 = time.perf_counter()
    final = Path(path)
    rank = _rank()
    group = io_group(grid)  # every collective of a save waits checkpoint.timeout_s, not parallel.timeout_s
    partial = Path(_broadcast(f"{final}.partial-{uuid.uuid4().hex[:8]}", group))
    if rank == 0:
        partial.mkdir(parents=True, exist_ok=True)
    _barrier(group)  # nobody writes before the folder exists (rank 0's mkdir precedes this barrier)
    tw = time.perf_counter()
    mine: list[str] = []
    failed: BaseException | None = None
    try:
        mine = _write_files(partial, _plain_files(lightning_state, rank_state, rank))
    except OSError as e:  # this rank still joins DCP's collectives below: no rank is left waiting in them
        failed = e
    writer = _RecordingWriter(str(partial))
    try:
        with _quiet_sharded_tensor():
            dcp.save(training_state(chunks, optimizer, grid), storage_writer=writer, process_group=group)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises a rank's write failure on every rank
        failed = failed or e
    _commit(partial, final, mine + getattr(writer, "written", []), group, layout, lightning_state, tw,
            failed=None if failed is None else write_failure(final, partial, failed), skipped=skipped)
    blocked = time.perf_counter() - t0
    last_save_seconds["blocked"] = blocked
    if rank == 0:
        log.info("checkpoint %s saved: training blocked %.3f s (synchronous save)", final.name, blocked)
    return final


def _commit(partial: Path, final: Path, mine: list[str], group, layout: dict, lightning_state: dict,
            t0: float, failed: str | None = None, skipped: int = 0) -> None:
    """After this rank's DCP write (every rank's, as DCP's own collectives end it): each rank checksums the files it
    wrote, all at once, and sends rank 0 only their names, sizes and CRC32s; rank 0 writes the manifest last and
    publishes the folder. A rank that failed (`failed`: its one line) sends its error instead; then nothing is
    published, rank 0 deletes the partial folder (left, it would keep a full disk full) and every rank raises the
    first error, so that all stop together."""
    rank = _rank()
    t1 = time.perf_counter()
    if rank == 0:
        mine = [*mine, DCP_METADATA]  # DCP's coordinator wrote it, after every rank's shards
    entries: dict | str | None = failed
    if entries is None:
        try:
            entries = {name: _entry(partial / name, rank) for name in mine}
        except OSError as e:
            entries = f"rank {rank} could not checksum its files in {partial}: {e}"
    t2 = time.perf_counter()
    gathered = _gather_to_0(entries, group)
    if rank == 0:
        assert gathered is not None
        if not any(isinstance(e, str) for e in gathered):
            _write_manifest(partial, gathered, layout, int(lightning_state.get("global_step", -1)))
            _publish(partial, final, skipped)
        else:
            shutil.rmtree(partial, ignore_errors=True)  # every rank is done writing into it (it sent its entries)
    # Rank 0's part after the gather is O(number of files); this exchange is also the barrier after it.
    errors = sorted(e for e in _all_gather(entries if isinstance(entries, str) else None, group) if e)
    if errors:
        raise CheckpointError(errors[0])
    last_save_seconds.update(write=t1 - t0, checksum=t2 - t1, total=time.perf_counter() - t0)


def _os_error(e: BaseException | None) -> OSError | None:
    """The operating system's error behind a failure (through chained causes and DCP's per-rank failures)."""
    stack, seen = [e], set()
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno:
            return x
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        stack += [x.__cause__, x.__context__]
    return None


def _probe(folder: Path) -> OSError | None:
    """What writing 1 MiB into `folder` gets from the operating system (None: it worked)."""
    probe = folder / f".write-probe-{uuid.uuid4().hex[:8]}"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def write_failure(final: Path, partial: Path, e: BaseException) -> str:
    """A failed save in one line: the checkpoint, the operating system's error (its name, errno and file), and the
    library's own first line. A write error that the library lost (torch's zip writer reports a full disk as
    "unexpected pos 704 vs 598") is found again by a probe write into the same folder."""
    err = _os_error(e) or _probe(partial)
    what = _first_line(e)
    if err is None:
        return f"checkpoint {final} was not saved on rank {_rank()}: {what}"
    where = err.filename if err.filename else partial
    tail = "" if isinstance(e, OSError) else f" ({what})"
    return f"checkpoint {final} was not saved on rank {_rank()}: {os_error(err)} writing {where}{tail}"


def _first_line(e: BaseException) -> str:
    """The gist of a save's failure; DCP's CheckpointException carries each failed rank's own exception."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (e, _) = next(iter(sorted(failures.items())))
        return f"rank {rank}: {_first_line(e)}"
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _write_manifest(partial: Path, gathered: list[dict], layout: dict, step: int) -> None:
    files: dict[str, dict] = {}
    for part in gathered:
        files.update(part)
    for f in sorted(partial.iterdir()):  # a file no rank claimed (e.g. an empty shard): rank 0 covers it
        if f.name not in files:
            files[f.name] = _entry(f, 0)
    manifest = {"format": "mlplat-dcp-2", "layout": layout, "world_size": _world(), "step": step,
                "files": dict(sorted(files.items()))}
    tmp = partial / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, partial / MANIFEST)


def _local_tensors(obj: Any):
    """The tensors a state holds on this rank, in `_HostCopy._copy`'s order."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        for v in obj.values():
            yield from _local_tensors(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _local_tensors(v)
    elif isinstance(obj, DTensor):
        yield obj.to_local()
    elif isinstance(obj, ShardedTensor):
        yield from (s.tensor for s in obj.local_shards())
    elif isinstance(obj, torch.Tensor):
        yield obj


class _HostCopy(AsyncStager):
    """A training state (plain tensors, tp-sharded DTensors, data-parallel ShardedTensors) staged in two halves.

    `__init__`, in the training thread, copies every tensor the state holds to host memory: the only work that
    must precede the next step's update. On GPUs the copies go to one pinned buffer the saver keeps from one save to
    the next (`mlplat.checkpoint.host_arena`), issued on the current stream, which is then waited for: no
    device-wide synchronize. `stage`, which DCP's asynchronous save calls in the writing thread, wraps the copies
    back into the entries' kinds and layouts (DTensor.from_local, ShardedTensor), which costs Python time that the
    training thread need not wait for. (DCP's own stager cannot copy a DTensor here: it deep-copies the wrapper,
    whose storage is not a real one.)"""

    _synchronize_after_execute = False

    def __init__(self, state: dict, grid: ParallelGrid | None, arena: HostArena | None = None):
        self.grid = grid
        on_device = [t for t in _local_tensors(state) if t.device.type != "cpu"]
        self._slots = iter((arena or HostArena()).views(on_device))
        self.copies = {key: self._copy(value) for key, value in state.items()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()

    def _copy(self, obj: Any) -> Any:
        """obj with each tensor copied: (DTensor, its local copy), (ShardedTensor, its local shards' copies); a device
        tensor into its slot of the arena, in `_local_tensors`' order."""
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        from torch.distributed.tensor import DTensor

        if isinstance(obj, dict):
            return {k: self._copy(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._copy(v) for v in obj]
        if isinstance(obj, DTensor):
            return obj, self._copy(obj.to_local())
        if isinstance(obj, ShardedTensor):
            return obj, [self._copy(s.tensor) for s in obj.local_shards()]
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu":
                return obj.detach().clone()
            return next(self._slots).copy_(obj.detach(), non_blocking=True)
        return obj

    def stage(self, state_dict: dict) -> dict:
        return {key: self._wrap(value) for key, value in self.copies.items()}

    def _wrap(self, obj: Any) -> Any:
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        from torch.distributed.tensor import DTensor

        if isinstance(obj, dict):
            return {k: self._wrap(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._wrap(v) for v in obj]
        if isinstance(obj, tuple) and isinstance(obj[0], DTensor):
            live, local = obj
            mesh = live.device_mesh
            if mesh.device_type != "cpu":  # from_local would move the copy back to the device
                mesh = tp_mesh(self.grid, "cpu")
            return DTensor.from_local(local, mesh, live.placements, run_check=False, shape=live.shape,
                                      stride=live.stride())
        if isinstance(obj, tuple) and isinstance(obj[0], ShardedTensor):
            from torch.distributed._shard.metadata import ShardMetadata

            def host(m):
                return ShardMetadata(m.shard_offsets, m.shard_sizes, f"rank:{m.placement.rank()}/cpu")

            live, copies = obj
            md = live.metadata()
            local = [Shard(t, host(s.metadata)) for s, t in zip(live.local_shards(), copies)]
            meta = dataclasses.replace(md, shards_metadata=[host(m) for m in md.shards_metadata])
            with _quiet_sharded_tensor():
                return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)
        return obj

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _gloo_lazy():
    """Gloo groups made inside connect each pair of ranks at its first message, not all pairs at creation: a save's
    collectives (DCP's plans gathered to the coordinator and scattered back, a few all-reduces) touch a rank's
    coordinator and ring neighbours, where a full mesh would hold 4,095 sockets per rank at 4,096 ranks for the
    whole run. (torch reads TORCH_GLOO_LAZY_INIT when it builds a gloo backend.)"""
    before = os.environ.get("TORCH_GLOO_LAZY_INIT")
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TORCH_GLOO_LAZY_INIT"]
        else:
            os.environ["TORCH_GLOO_LAZY_INIT"] = before


class AsyncSaver:
    """Checkpoints written behind training (`checkpoint.async_save`), one at a time.

    `save` blocks only while it waits for the previous save, serialises mlplat's own small files and copies the
    state's tensors to host memory (`_HostCopy`). A thread of this rank then writes the small files, runs DCP's
    asynchronous save of the copy (whose own thread writes the shards), waits for it, checksums its files and
    commits the checkpoint exactly as `save` does (manifest last, atomic rename, `latest`). Every collective behind
    training runs on `group`, a gloo world group that only those threads use, one save after the other: it shares
    no communicator, and so no ordering, with the training's groups (docs/gpu-nccl.md), and DCP requires a CPU
    backend for its background collectives anyway. The next save, and `wait`, wait for the previous one; its
    error, if any, is raised there, in one line.

    `mode="process"` (`checkpoint.async_mode`): DCP plans and writes in its save process of this rank instead of its
    thread (spawned at the first save, on a gloo world of its own; `close` ends it); staging and the commit stay
    here. experiments/checkpoint_bench/results.md measures both."""

    def __init__(self, grid: ParallelGrid | None, mode: str = "thread"):
        self.mode = mode  # checkpoint.async_mode: where DCP plans and writes, a thread of this rank or its own process
        self.group = None
        if dist_ready():
            timeout = getattr(grid, "io_timeout", None)
            with _gloo_lazy():
                self.group = dist.new_group(backend="gloo", **({"timeout": timeout} if timeout else {}))
        # One name per save that every rank knows without a collective at the save: a token agreed now, a counter.
        self.token = _broadcast(uuid.uuid4().hex[:6], io_group(grid))
        self.count = 0
        self.arena = HostArena()  # the device tensors' host copies, one buffer for every save (one at a time)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, path: str | Path, chunks, optimizer, grid: ParallelGrid, lightning_state: dict, layout: dict,
             rank_state: dict | None = None, skipped: int = 0) -> None:
        t0 = time.perf_counter()
        self.wait()
        final = Path(path)
        self.count += 1
        partial = Path(f"{final}.partial-{self.token}{self.count}")
        files = _plain_files(lightning_state, rank_state, _rank())
        staged = _HostCopy(training_state(chunks, optimizer, grid), grid, self.arena)
        blocked = time.perf_counter() - t0

        def behind() -> None:
            try:
                t1 = time.perf_counter()
                partial.mkdir(parents=True, exist_ok=True)  # every rank, before any writes into it
                mine = _write_files(partial, files)
                writer = _RecordingWriter(str(partial))
                kind = AsyncCheckpointerType.PROCESS if self.mode == "process" else AsyncCheckpointerType.THREAD
                # The save process's gloo world, made at its first save, connects lazily too (spawned inside, it
                # inherits the variable).
                lazy = _gloo_lazy() if self.mode == "process" else contextlib.nullcontext()
                with _quiet_sharded_tensor(), lazy:
                    future = dcp.async_save({}, storage_writer=writer, process_group=self.group, async_stager=staged,
                                            async_checkpointer_type=kind)
                    metadata = future.result()  # every rank's shards: DCP's collectives end once each wrote its own
                written = getattr(writer, "written", None)
                if written is None:  # pickled to DCP's process: its copy recorded them
                    written = _written_by(metadata, _rank())
                _commit(partial, final, mine + written, self.group, layout, lightning_state, t1, skipped=skipped)
                last_save_seconds["blocked"] = blocked
                if _rank() == 0:
                    log.info("checkpoint %s saved: training blocked %.3f s, written behind it in %.2f s", final.name,
                             blocked, time.perf_counter() - t1)
            except BaseException as e:  # noqa: BLE001 - raised in the training thread, at the next save or the end
                if isinstance(e, CheckpointError):  # from the commit: the same line on every rank
                    self._error = e
                else:
                    self._error = CheckpointError(write_failure(final, partial, e))
                    self._error.__cause__ = e
                    if _rank() == 0:  # DCP raised it on every rank: none writes into the folder any more
                        shutil.rmtree(partial, ignore_errors=True)

        self._thread = threading.Thread(target=behind, name=f"mlplat-save-{final.name}")
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Until the save in flight is committed (or failed: its error is raised here)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self.mode == "process":
                _end_save_process()


def _end_save_process() -> None:
    """End DCP's save process of this rank (process mode), which DCP keeps for the life of the interpreter and asks to
    stop only when it collects it: a rank that exits without that (os._exit) leaves it a closed pipe and a
    traceback. DCP holds it in a private module global: there is no public way to stop it."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process, executor._CHECKPOINT_PROCESS = getattr(executor, "_CHECKPOINT_PROCESS", None), None
    child = getattr(process, "_save_process", None)
    if child is None or not child.is_alive():
        return
    with contextlib.suppress(OSError):
        process._send(executor._CheckpointSaveProcessControlOpts.TERMINATE)
    child.join(timeout=60)  # it leaves its gloo world first (DCP's own 5 s is short on a loaded host)
    if child.is_alive():
        child.terminate()
        child.join()


def _publish(partial: Path, final: Path, skipped: int = 0) -> None:
    """Rename the complete folder to its final name; an existing one is renamed aside first and deleted last. It
    becomes `latest` unless it was saved inside a run of `skipped` skipped steps (inf/NaN): a run that is diverging,
    or was when it ended, must not be what `ckpt_path=last` continues without a word; `latest` keeps naming the
    last checkpoint saved after a step that stood, and a line says so."""
    aside = None
    if final.exists():
        aside = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, aside)
    os.replace(partial, final)  # the checkpoint becomes visible only now, complete
    if not skipped:
        write_latest(final.parent, final.name)  # and the newest of its folder: what `ckpt_path=last` resumes
    else:
        log.warning("checkpoint %s was saved after %d skipped step%s in a row (an inf/NaN loss or gradient norm): not "
                    "recorded as the latest, which stays %s; resume it only by its path", final.name, skipped,
                    "s" * (skipped > 1), latest_name(final.parent) or "none")
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    for stale in [*final.parent.glob(f"{final.name}.partial-*"), *final.parent.glob(f"{final.name}.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)


# -- verify -----------------------------------------------------------------------------------------------
def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a folder)")
    mf = path / MANIFEST
    if not mf.exists():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (was the save interrupted?)")
    if (what := not_regular(mf)) is not None:
        raise CheckpointError(f"checkpoint {path}: {mf} is {what}, not a regular file")
    try:
        manifest = json.loads(mf.read_text())
        assert isinstance(manifest.get("files"), dict)
    except (ValueError, AssertionError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: {MANIFEST} is not a valid manifest ({e})") from None
    return manifest


def verify(path: str | Path, checksum: list[str] | None = None, present: list[str] | None = None) -> dict:
    """The manifest of a complete, intact checkpoint, or a CheckpointError naming what is wrong.

    `present` names the files checked for presence and size (None: every file); `checksum` those whose CRC32 is
    checked (None: all, plus a check that mlplat's own pickles are plain data — what a single process such as
    export needs). Ranks that verify together split both (`share_of_files`): at thousands of ranks, each checking
    every file would be millions of metadata operations on the shared file system."""
    path = Path(path)
    manifest = read_manifest(path)
    files = manifest["files"]
    for name, want in (files.items() if present is None else ((n, files[n]) for n in present)):
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {path} is truncated: {name} has {size} bytes, expected {want['bytes']}")
    for name in sorted(files) if checksum is None else checksum:
        if crc32(path / name) != files[name]["crc32"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} fails its CRC32 check")
    if checksum is None:
        for name in files:
            if name == LIGHTNING_STATE or name.startswith("rank-"):
                load_plain(path / name, path)
    return manifest


def share_of_files(files: dict[str, dict], world: int, rank: int) -> list[str]:
    """The files `rank` checksums on load: those it wrote (when it exists in this world), then the rest dealt out
    largest first to the least-loaded rank. Deterministic, so every rank computes the same split."""
    owners: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    rest = []
    for name, e in sorted(files.items()):
        writer = e.get("rank")
        if isinstance(writer, int) and 0 <= writer < world:
            owners[writer].append(name)
            load[writer] += e["bytes"]
        else:
            rest.append((-e["bytes"], name))
    for neg, name in sorted(rest):
        k = min(range(world), key=lambda i: (load[i], i))
        owners[k].append(name)
        load[k] -= neg
    return owners[rank]


def verify_together(path: str | Path, group=None) -> dict:
    """Collective verification: each rank checksums its share once; all ranks raise the same error, if any.
    `group`: the world group of the exchange (io_group(grid): it follows each rank's reading)."""
    path = Path(path)
    error, manifest = None, None
    try:
        manifest = read_manifest(path)
        share = share_of_files(manifest["files"], _world(), _rank())
        verify(path, checksum=share, present=share)
    except CheckpointError as e:
        error = str(e)
    errors = sorted(e for e in _all_gather(error, group) if e)
    if errors:
        raise CheckpointError(errors[0])
    assert manifest is not None
    return manifest


# -- load -------------------------------------------------------------------------------------------------
def same_resume(path: str | Path | None, group=None) -> None:
    """Every rank resolved its checkpoint on its own (`ckpt_path=last`, a restart's, a requeue's: a stale view of a
    shared file system can see another step, or none): all resume the same one, or all refuse at once in one line,
    instead of the ranks that found one waiting `checkpoint.timeout_s` in the load for one that found none. Every
    rank calls this, resuming (path) or not (None)."""
    mine = None if path is None else str(Path(path).resolve())
    seen = _all_gather(mine, group)
    if len(set(seen)) == 1:
        return
    none = [r for r, p in enumerate(seen) if p is None]
    paths = sorted({p for p in seen if p is not None})
    if none:
        some = [r for r, p in enumerate(seen) if p is not None]
        raise CheckpointError(f"rank{'s' if len(none) > 1 else ''} {_ranks(none)} found no checkpoint to resume while "
                              f"rank{'s' if len(some) > 1 else ''} {_ranks(some)} resume {paths[0]}"
                              f"{', ...' if len(paths) > 1 else ''}: resume with ckpt_path=PATH (a path every rank "
                              "sees)")
    raise CheckpointError(f"the ranks resolved different checkpoints ({paths[0]}, {paths[1]}, ...): resume from "
                          "one of them with ckpt_path=PATH")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


def fresh_state(saved: dict, optimizer) -> tuple[str, ...]:
    """The state per parameter of `optimizer` that a checkpoint holds for no parameter while it holds the rest: the
    checkpoint is another optimizer's (AdamW's moments resumed under Muon, whose momentum it lacks; which optimizers
    continue which is mlplat.train.check_resumed_optimizer's). Those start at zero (allocated so)."""
    kinds = state_names(optimizer)
    held = {key.rsplit("/", 1)[-1] for key in saved if key.startswith("optim/")}
    fresh = tuple(k for k in kinds if k not in held)
    return fresh if len(fresh) < len(kinds) else ()  # none held: not an optimizer's checkpoint, refused as before


def _saved_group_keys(saved: dict, groups: list[dict]) -> list[dict]:
    """The optimizer's param_groups cut to the keys the checkpoint holds: torch's AdamW and MainParamsAdamW
    (and torch versions) differ in their flags (amsgrad, foreach, ...); the hyper-parameters are common."""
    return [{k: v for k, v in g.items() if f"optim/param_groups.{i}.{k}" in saved} for i, g in enumerate(groups)]


class _RegionLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus targets that are regions of a saved tensor.

    `regions`: DCP key -> [(offsets, tensor)]: each tensor receives the box of the saved tensor that starts at
    `offsets` and has the tensor's shape. DCP's resharding reads only the saved chunks that overlap a box, so a
    rank that needs a slice of a large tensor never holds the whole of it (its size need not match the saved one,
    which the default planner requires of a plain tensor)."""

    def __init__(self, regions: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]):
        super().__init__()
        self.regions = regions

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        extra = []
        for key, boxes in self.regions.items():
            md = self.metadata.state_dict_metadata[key]
            chunks = [ChunkStorageMetadata(offsets=torch.Size(at), sizes=t.shape) for at, t in boxes]
            extra += create_read_items_for_chunk_list(key, md, chunks)
        return dataclasses.replace(plan, items=[*plan.items, *extra])

    def lookup_tensor(self, index):
        if index.fqn in self.regions:  # dest_index.index: the box's position in the list given above
            return self.regions[index.fqn][index.index][1]
        return super().lookup_tensor(index)


class _MetadataOnce(dcp.FileSystemReader):
    """DCP's reader, unpickling the checkpoint's metadata once: the load reads it to plan the vocabulary's regions,
    and dcp.load reads it again on every rank."""

    def read_metadata(self, *args, **kwargs):
        if not hasattr(self, "_metadata"):
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def _dcp_load(state: dict, path: Path, regions: dict | None = None, group=None,
              reader: dcp.FileSystemReader | None = None) -> None:
    try:
        with _quiet_sharded_tensor():
            dcp.load(state, storage_reader=reader or dcp.FileSystemReader(str(path)),
                     planner=_RegionLoadPlanner(regions or {}), process_group=group)
    except Exception as e:  # DCP's own errors are long; the user needs the path and the gist
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} cannot be loaded into this model: {first}") from None


def vocab_regions(path: Path, saved: dict, full: str, p: torch.nn.Parameter, optimizer, grid: ParallelGrid,
                  vocab_size: int, fresh: tuple[str, ...] = ()
                  ) -> dict[str, list[tuple[tuple[int, int], torch.Tensor]]]:
    """Where this rank's rows of vocabulary table `full` (the word embedding or an untied output layer: weights,
    or main weights, and Adam's moments) come from in the saved table: DCP key -> [(offsets in the saved table,
    view of the target)].

    The saved table is padded for the saving tp, this rank's shard for its own: only rows of the real vocabulary
    are read, each rank its own tp rows (with the distributed optimizer: its data-parallel range of them, as
    flat_boxes), and every row past the vocabulary is zeroed here. Nothing is materialised beyond the targets. The
    optimizer state in `fresh` (`fresh_state`) is not read: it starts at zero."""
    key = f"model/{full}"
    md = saved.get(key)
    if not isinstance(md, TensorStorageMetadata) or len(md.size) != 2 or md.size[1] != p.shape[1]:
        raise CheckpointError(f"checkpoint {path} has no vocabulary table {key!r} of width {p.shape[1]}"
                              + (f" (saved: {tuple(md.size)})" if isinstance(md, TensorStorageMetadata) else ""))
    rows, cols = p.shape
    first = grid.tp_rank * rows if getattr(p, "partition_dim", None) == 0 else 0  # this shard's first row
    real = max(0, min(rows, min(vocab_size, md.size[0]) - first))  # its rows that hold tokens of the vocabulary
    main = main_params_of(optimizer)
    kinds = ("main",) + tuple(k for k in (state_names(optimizer) if optimizer is not None else ()) if k not in fresh)
    out: dict[str, list] = {}
    for kind in kinds:
        name = key if kind == "main" else f"optim/{full}/{kind}"
        if kind != "main" and name not in saved:
            raise CheckpointError(f"checkpoint {path} has no entry {name!r}")
        if main is not None:  # this rank's data-parallel range of its tp shard, as flat boxes
            where = main.local_range(p)
            if where is None:
                continue
            view = main.shard_view(p, kind)
            view.zero_()
            a, b = where
            end = min(b, real * cols)
            boxes = [((r + first, c), view[x - a:y - a].view(sizes))
                     for (r, c), sizes, x, y in (flat_boxes(p.shape, a, end) if end > a else [])]
        else:
            target = p.data if kind == "main" else optimizer_state_of(optimizer, p)[kind]
            target.zero_()
            boxes = [((first, 0), target[:real])] if real else []
        if boxes:
            out[name] = boxes
    return out


def load(path: str | Path, chunks, optimizer, grid: ParallelGrid, vocab_size: int) -> dict:
    """Load parameters and optimizer state into this rank's chunks, whatever layout saved them; returns
    the Lightning state (loops, schedulers, callbacks). Every rank calls this.

    One collective, entered the same way by every rank whatever it holds: verify_together, then a single dcp.load
    of everything (the word embedding included, as regions of the saved table), both on io_group(grid)."""
    path = Path(path)
    group = io_group(grid)
    same_resume(path, group)
    verify_together(path, group)
    lightning_state = load_plain(path / LIGHTNING_STATE, path)
    params = full_parameters(chunks)
    main = main_params_of(optimizer)
    reader = _MetadataOnce(str(path))
    saved = reader.read_metadata().state_dict_metadata
    state = training_state(chunks, optimizer, grid, skip_vocab=True)
    fresh = fresh_state(saved, optimizer) if optimizer is not None else ()
    if fresh:  # another optimizer's: its groups are not this one's, which keep this run's optim.* hyper-parameters
        del state["optim/param_groups"]
        for key in [k for k in state if k.startswith("optim/") and k.rsplit("/", 1)[-1] in fresh]:
            del state[key]
    elif optimizer is not None:
        state["optim/param_groups"] = _saved_group_keys(saved, state["optim/param_groups"])
    regions: dict = {}
    error = None
    for full in VOCAB_ROWS:
        table = params.get(full)
        if table is None:
            continue
        if optimizer is not None:
            state[f"optim/{full}/step"] = (step_tensor(optimizer, torch.device("cpu")) if main is not None
                                           else optimizer_state_of(optimizer, table)["step"])
        try:
            regions.update(vocab_regions(path, saved, full, table, optimizer, grid, vocab_size, fresh))
        except CheckpointError as e:
            error = error or str(e)
    # An older checkpoint, or one of a run without expert biases, holds none: they start at 0.
    unsaved = [key for key in buffer_state(chunks) if key not in saved]
    for key in unsaved:
        del state[key]
    # Only the tables' ranks can find their entries wrong: every rank learns of it before entering dcp.load,
    # which the others would otherwise wait in for checkpoint.timeout_s.
    verdicts = _all_gather((error, len(unsaved)), group)
    errors = sorted(e for e, _ in verdicts if e)
    if errors:
        raise CheckpointError(errors[0])
    if any(n for _, n in verdicts) and _rank() == 0:
        log.warning("checkpoint %s holds no expert biases (saved before checkpoints held them, or by a run without "
                    "model.moe.expert_bias or bias_update_rate): they start at 0", path)
    _dcp_load(state, path, regions, group, reader)
    p = params.get(WORD_EMBEDDING)
    if p is not None:
        for chunk in chunks.values():  # a tied copy on this rank too (no layout has one today) gets the same values
            if hasattr(chunk, "lm_head") and chunk.lm_head is not p:
                if main is not None:  # a bucket of its own, laid out as p's: the same shard range
                    if main.local_range(p) is not None:
                        for kind in ("main",) + state_names(optimizer):
                            main.shard_view(chunk.lm_head, kind).copy_(main.shard_view(p, kind))
                    continue
                chunk.lm_head.data.copy_(p.data)
                if optimizer is not None:
                    for k in state_names(optimizer) + ("step",):
                        optimizer_state_of(optimizer, chunk.lm_head)[k].copy_(optimizer.state[p][k])
    if optimizer is not None and not fresh:
        for g, kept in zip(optimizer.param_groups, state["optim/param_groups"]):
            g.update(kept)
    if main is not None:
        steps = [v for k, v in state.items() if k.startswith("optim/") and k.endswith("/step")]
        optimizer.steps = int(max(float(v) for v in steps)) if steps else 0
        main.refresh()  # the model's weights from the loaded main weights (cast, all-gathered)
    if fresh:
        if _rank() == 0:
            held = [k for k in state_names(optimizer) if k not in fresh]
            log.warning("resuming %s, saved by optim.name=%s, under another optimizer: the weights, %s, the step count "
                        "and the learning-rate schedule continue; %s start%s at zero (fresh), and the parameter groups "
                        "take this run's optim.* keys", path,
                        read_manifest(path).get("layout", {}).get("optimizer", "adamw"), ", ".join(held),
                        ", ".join(fresh), "s" if len(fresh) == 1 else "")
        lightning_state = {**lightning_state, FRESH_STATE: fresh}
    return lightning_state


def load_rank_state(path: str | Path, rank: int, layout: dict) -> tuple[dict | None, str]:
    """This rank's own saved state (its RNG streams) when `layout` (a manifest's layout, `checkpoint_layout`) is
    the one that saved the checkpoint, else (None, why): under another layout a rank's streams have no
    counterpart."""
    path = Path(path)
    manifest = read_manifest(path)
    saved = ParallelDims.from_manifest(manifest.get("layout", {}))  # an old manifest's missing keys: their defaults
    if not saved.same_ranks(ParallelDims.from_manifest(layout)):
        was = ", ".join(f"{k}={v}" for k, v in saved.manifest().items() if v is not None)  # an even split: unsaid
        return None, f"saved under another layout ({was})"
    name = RANK_STATE.format(rank=rank)
    if name not in manifest["files"]:
        return None, f"the checkpoint holds no {name} (written before RNG states were saved)"
    return load_plain(path / name, path), ""


# -- find -------------------------------------------------------------------------------------------------
def checkpoint_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of the complete checkpoints under root, oldest first. A `step-N.old-*` folder (a re-save
    of step N caught between its two renames) stands for step N only while `step-N` itself is absent."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for p in sorted(root.iterdir()):
        m = STEP_DIR.match(p.name)
        if not m or not p.is_dir():
            continue
        step, aside = int(m.group(1)), m.group(2)
        if aside is None:
            found[step] = p
        elif step not in found and not (root / f"step-{step}").is_dir() and (p / MANIFEST).exists():
            found[step] = p
    return sorted(found.items())


def remove_unfinished(root: str | Path) -> list[str]:
    """Delete the `step-N.partial-*` folders under root: saves that never committed (a run killed, or Ctrl-C, while
    writing), which would otherwise keep their disk space for good. Only for the run that holds the run directory
    (mlplat.run_lock), before it saves: no save of another run can be writing them. `.old-*` folders are kept (one
    may stand for its step: `checkpoint_dirs`). Returns their names."""
    root = Path(root)
    gone = sorted(p.name for p in root.glob("step-*.partial-*") if p.is_dir()) if root.is_dir() else []
    for name in gone:
        shutil.rmtree(root / name, ignore_errors=True)
    return gone


def find_last(root: str | Path) -> Path | None:
    """The complete checkpoint committed last under root as the tip of its run's lineage (partial saves are never
    listed): the one `latest` names; None when root holds no checkpoint. Without that record, or when it names no
    complete checkpoint, which one continues the run cannot be told (a folder filled by hand or by an older mlplat,
    whose branches left their steps interleaved; a `latest` removed; checkpoints saved inside a run of skipped steps,
    which never become `latest`): refused in one line listing what is there, rather than guessing the highest step,
    which may be an abandoned lineage's. A folder of one checkpoint and no record (one copied into a new run
    directory) has no lineage to tell apart: that one, said in one line."""
    root = Path(root)
    dirs = dict(checkpoint_dirs(root))
    again = sorted(p.name for p in root.glob("step-*-v*") if LIGHTNING_VERSION.match(p.name)) if root.is_dir() else []
    if not dirs and not again:
        return None
    named = latest_name(root)
    m = STEP_DIR.match(named or "")
    if m and not m.group(2) and int(m.group(1)) in dirs:
        return dirs[int(m.group(1))]
    if named is None and len(dirs) == 1 and not again:  # one checkpoint (copied into a new run directory): no lineage
        (only,) = dirs.values()                           # to tell apart
        log.info("ckpt_path=last: %s holds one checkpoint and no %s record: resuming %s", root, LATEST, only.name)
        return only
    why = f"its {LATEST} record names {named}, which is not there" if named else \
        f"no {LATEST} record says which one continues the run"
    held = ", ".join([p.name for _, p in sorted(dirs.items())] + again)
    raise CheckpointError(f"ckpt_path=last: {root} holds {held} but {why}: resume one by its path, "
                          f"ckpt_path={root}/step-N")


def latest_name(root: Path) -> str | None:
    """The checkpoint name `root`'s `latest` records (None: no record)."""
    if (what := not_regular(root / LATEST)) is not None:  # reading a FIFO would block the run
        raise CheckpointError(f"{root / LATEST} is {what}, not a regular file (the name of the last checkpoint)")
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def write_latest(root: Path, name: str) -> None:
    """Record `name` as the checkpoint that continues the run (what `find_last` follows), replaced atomically."""
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(name + "\n")
    os.replace(tmp, root / LATEST)


def aside_path(name: Callable[[str], Path]) -> Path:
    """Where something set aside goes: `name` of the time now (YYYYmmdd-HHMMSS), or of it with -2, -3, ... when an
    earlier set-aside took that name in the same second."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = name(stamp), 1
    while path.exists():
        n += 1
        path = name(f"{stamp}-{n}")
    return path


def set_aside_later(resumed: Path) -> tuple[Path, list[str]] | None:
    """Before a run resumes `resumed` in its own checkpoints folder: that folder's later steps belong to the lineage
    the resume leaves (a branch from an earlier step, or saves that never became `latest`). Left in place, the branch's
    saves would replace them step by step and leave the rest interleaved with its own; they move, with the `latest`
    they had, into `abandoned/<time>/` there, and `latest` names `resumed`, the tip of the lineage continued.
    Returns (that folder, the names moved), None when nothing is later."""
    root, m = resumed.parent, STEP_DIR.match(resumed.name)
    if m is None:
        return None
    later = []
    for p in root.iterdir():
        k = STEP_DIR.match(p.name) or LIGHTNING_VERSION.match(p.name)
        if k and p.is_dir() and int(k.group(1)) > int(m.group(1)):
            later.append((int(k.group(1)), p.name, p))
    later = [p for *_, p in sorted(later)]
    was = latest_name(root)
    if not m.group(2):  # first: from here on `last` is the resumed tip, whatever happens to the moves below
        write_latest(root, resumed.name)
    if not later:
        return None
    aside = aside_path(lambda stamp: root / ABANDONED / stamp)
    aside.mkdir(parents=True)
    if was is not None:
        write_latest(aside, was)
    for p in later:
        os.replace(p, aside / p.name)
    return aside, [p.name for p in later]
