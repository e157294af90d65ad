"""One run at a time in a run directory: the process that owns a run holds an exclusive lock on it for the run's life;
and one run per run directory: a new run is refused where an earlier one left checkpoints or metrics
(`refuse_another_run`).

Two runs in one `hydra.run.dir` at once would interleave `metrics.csv`, the logs and the checkpoints (and
`ckpt_path=last` could not tell whose is whose). The lock is `flock` on `DIR/.mlplat.lock`: the kernel drops it
when its holder exits, however it dies (kill -9 included), so a crashed run never leaves its directory locked.
Only the process that owns the run takes it, once (`owns_run`): rank 0 of mlplat's launcher, not the ranks it
starts, and global rank 0 under an external launcher. A file system without `flock` (Lustre mounted without
`-o flock`) runs unlocked, with a warning.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hydra.experimental.callback import Callback as HydraCallback

from mlplat.errors import ConfigError, os_error

LOCK_FILE = ".mlplat.lock"
# Where an external launcher puts this process's global rank: torchrun, srun, submitit's local executor.
RANK_ENVS = ("RANK", "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID")

log = logging.getLogger("mlplat")
# The lock's file in the process that holds it. A process forked from it (a rank of mlplat's launcher, a data-loading
# worker) inherits the file and, with it, the lock, which would outlive the run's process by as long as the child
# lives: each forked child closes its copy at once (the holder keeps the lock).
_held: int | None = None


def _drop_in_child() -> None:
    global _held
    if _held is not None:
        os.close(_held)
        _held = None


os.register_at_fork(after_in_child=_drop_in_child)


def owns_run() -> bool:
    """True in the process that owns the run: neither a rank that mlplat's launcher started (rank 0 holds the lock
    for them) nor a rank other than 0 of an external launcher, nor the elastic agent of a node other than 0."""
    from mlplat.lightning.launcher import CHILD_ENV
    from mlplat.lightning.restarts import node_rank

    if os.environ.get(CHILD_ENV):
        return False
    return launched_rank() == 0 and not node_rank()


def launched_rank() -> int:
    """This process's global rank as an external launcher set it (`RANK_ENVS`), 0 when none did."""
    return int(next((os.environ[k] for k in RANK_ENVS if os.environ.get(k)), "0").strip())


@contextmanager
def run_dir_lock(run_dir: str | Path) -> Iterator[None]:
    """Hold `run_dir` for the run (in the process that owns it), or refuse in one line when another run holds it."""
    if not owns_run():
        yield
        return
    path = Path(run_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                log.warning("%s cannot be locked (%s): nothing keeps another run out of this directory", path, e)
            else:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                if not _own_requeue(holder):
                    raise ConfigError(f"hydra.run.dir={run_dir} is in use by another run ({holder}): wait for it to "
                                      f"end, or choose another hydra.run.dir") from None
                log.warning("%s is still locked by this SLURM job's previous run (%s), on a node that is gone (a "
                            "shared file system keeps a dead node's lock until its lease ends): this requeued run "
                            "takes the directory over, unlocked", path, holder)
        else:
            os.ftruncate(fd, 0)
            job = os.environ.get("SLURM_JOB_ID")
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}{f', SLURM job {job}' if job else ''}\n"
                      .encode(), 0)
        global _held
        _held = fd
        yield
    finally:
        _held = None
        os.close(fd)  # releases the lock


def _own_requeue(holder: str) -> bool:
    """Whether the lock's holder is this SLURM job itself before its requeue (SLURM keeps the job id and counts the
    restarts): a node lost under it leaves its lock on a shared file system (NFS, Lustre) until the lease ends, and
    the requeued job would be refused as "in use" by its own dead self."""
    job, restarts = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0")
    return bool(job) and restarts.isdigit() and int(restarts) > 0 and holder.endswith(f", SLURM job {job}")


def in_use(run_dir: str | Path) -> bool:
    """Whether another process holds `run_dir`'s lock now (a shared lock is refused while it holds its exclusive one);
    only looks: the run takes the lock itself with `run_dir_lock`."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)  # releases the shared lock, if taken
    return False


def held_run(run_dir: str | Path) -> str | None:
    """What of an earlier run `run_dir` holds, as a few words: its complete checkpoints and its metrics.csv rows. None
    for a folder without either: empty, or only Hydra's `.hydra/` and log files, the lock, a run that stopped before
    its first step."""
    run_dir = Path(run_dir)
    steps = []
    if (run_dir / "checkpoints").is_dir():  # (a fresh directory imports no torch here: refusals stay fast)
        from mlplat.checkpoint.io import checkpoint_dirs

        steps = [p.name for _, p in checkpoint_dirs(run_dir / "checkpoints")]
    try:
        with open(run_dir / "metrics.csv", newline="") as f:
            rows = max(0, sum(1 for line in f if line.strip()) - 1)  # the header
    except OSError:
        rows = 0
    held = []
    if steps:
        held.append(f"checkpoints {', '.join(steps) if len(steps) <= 4 else f'{steps[0]} ... {steps[-1]}'}")
    if rows:
        held.append(f"metrics.csv with {rows} row{'s' * (rows > 1)}")
    return " and ".join(held) or None


def continues_run(run_dir: str | Path, ckpt_path: str | None) -> bool:
    """Whether a run with `ckpt_path` (as given) continues `run_dir`'s own lineage: `last` (so a requeued SLURM job
    and a group the elastic agent restarted), or a checkpoint of `run_dir`/checkpoints (a branch from it)."""
    from mlplat.lightning.environment import resume_ckpt_path
    from mlplat.lightning.restarts import restart_count

    if restart_count() > 0 or resume_ckpt_path(ckpt_path) == "last":
        return True
    own = (Path(run_dir) / "checkpoints").resolve()
    return ckpt_path is not None and Path(ckpt_path).expanduser().resolve().parent == own


def refuse_another_run(run_dir: str | Path, ckpt_path: str | None) -> None:
    """A run that does not continue the run directory's lineage (a fresh one, or one resumed from a checkpoint kept
    elsewhere) is refused in one line where an earlier run left its history: its saves would replace the earlier
    run's steps one by one and interleave with the rest, and metrics.csv would be rewritten without its rows."""
    held = held_run(run_dir)
    if held is not None and not continues_run(run_dir, ckpt_path):
        raise ConfigError(f"hydra.run.dir={run_dir} holds an earlier run ({held}): continue it with ckpt_path=last, "
                          f"or choose another hydra.run.dir for a new run")


PROBE_BYTES = 1 << 20  # what a run directory must take at once: Hydra's .hydra/ files and the first log lines are less


def unwritable(folder: str | Path) -> str | None:
    """Why files cannot be written in `folder` (made when missing, as the run does), or None: a probe file of
    PROBE_BYTES is written (and synced: some file systems report a full disk only then) in it, or in its nearest
    existing ancestor when it does not exist yet, and removed. A disk with a few KB left fails here, in one line,
    not in Hydra's first write of `.hydra/` with a traceback."""
    path = Path(folder).expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    probe = existing / f".mlplat-write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as e:
        return f"{os_error(e)} creating a file in {existing}"
    try:
        data = bytes(PROBE_BYTES)
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    except OSError as e:
        return f"{os_error(e)} writing {PROBE_BYTES >> 20} MiB in {existing}"
    finally:
        os.close(fd)
        os.unlink(probe)
    return None


class WritableRunDir(HydraCallback):
    """Hydra's callback (conf/config.yaml, `hydra.callbacks`): a run or sweep directory where no file can be written
    (a read-only file system, no permission, a full disk) is refused in one line and exit status 2, before Hydra's
    own `mkdir` or first write fails with a traceback and before anything starts; so is a run that would overwrite
    an earlier run's history (`refuse_another_run`)."""

    def on_run_start(self, config, **kwargs) -> None:
        self._check("hydra.run.dir", config)
        self._check_history(config)

    def on_multirun_start(self, config, **kwargs) -> None:
        self._check("hydra.sweep.dir", config)

    @staticmethod
    def _check(key: str, config) -> None:
        from omegaconf import OmegaConf

        folder = OmegaConf.select(config, key)
        why = unwritable(str(folder)) if folder is not None else None
        if why is not None:
            print(f"error: {key}={folder} cannot be written: {why}", file=sys.stderr, flush=True)
            raise SystemExit(2)

    @staticmethod
    def _check_history(config) -> None:
        """A run that would overwrite an earlier run's history (`refuse_another_run`), refused before Hydra writes
        its `.hydra/` over that run's. mlplat.train refuses it again under the run's lock (and a multirun's jobs,
        which come here only as a sweep); a directory held by a running run is left to that lock's line."""
        from omegaconf import OmegaConf

        run_dir = OmegaConf.select(config, "hydra.run.dir")
        if (run_dir is None or OmegaConf.select(config, "dry_run") or held_run(run_dir) is None or not owns_run()
                or in_use(run_dir)):
            return
        try:
            refuse_another_run(run_dir, OmegaConf.select(config, "ckpt_path"))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
