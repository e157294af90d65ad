"""One run at a time in a run directory: the process that owns a run holds an exclusive lock on it for the run's life.

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

from mlplat.errors import ConfigError

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
    for them) nor a rank other than 0 of an external launcher."""
    from mlplat.lightning.launcher import CHILD_ENV

    if os.environ.get(CHILD_ENV):
        return False
    return launched_rank() == 0


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
                raise ConfigError(f"hydra.run.dir={run_dir} is in use by another run ({holder}): wait for it to end, "
                                  f"or choose another hydra.run.dir") from None
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        global _held
        _held = fd
        yield
    finally:
        _held = None
        os.close(fd)  # releases the lock


def unwritable(folder: str | Path) -> str | None:
    """Why files cannot be created in `folder` (made when missing, as the run does), or None: a probe file is
    created in it, or in its nearest existing ancestor when it does not exist yet (nothing is left behind)."""
    path = Path(folder).expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    probe = existing / f".mlplat-write-probe-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as e:
        return f"{e.strerror} (errno {e.errno} {errno.errorcode.get(e.errno, '?')}) creating a file in {existing}"
    os.unlink(probe)
    return None


class WritableRunDir(HydraCallback):
    """Hydra's callback (conf/config.yaml, `hydra.callbacks`): a run or sweep directory where no file can be created
    (a read-only file system, no permission, a full disk) is refused in one line and exit status 2, before Hydra's
    own `mkdir` fails with a traceback and before anything starts."""

    def on_run_start(self, config, **kwargs) -> None:
        self._check("hydra.run.dir", config)

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
