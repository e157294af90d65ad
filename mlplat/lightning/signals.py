"""Signals: SIGTERM stops every rank at once; SLURM's preemption notice saves a checkpoint between steps and requeues.

Lightning's own handling does not fit a pipeline. Its SIGTERM handler broadcasts "should stop" from inside the
handler, i.e. wherever the main thread happens to be (mid-pipeline, while the peers wait on its transfers): the
job sat `parallel.timeout_s` and died of the hang watch. Its SLURM handler saves a checkpoint (a collective) from
inside the handler too. `SignalConnector` replaces it; a handler here only records, and nothing collective ever
runs in one:

- A thread woken through `signal.set_wakeup_fd` acts on a signal at once, even while the main thread is blocked
  in a transfer or a collective (Python runs handlers in the main thread only, between bytecodes).
- **SIGTERM** (`kill`, `timeout`, SLURM at a job's end): one line ``mlplat: rank R got SIGTERM; stopping`` and
  exit status 143 (128 + 15) within a second; no collective, no traceback. A rank started by mlplat's launcher
  tells the launching process (rank 0) through a pipe instead of stopping itself; rank 0 writes the line once for
  the job, SIGKILLs the ranks it started and exits, whichever process got the signal and however many did
  (`timeout` and SLURM signal every process of the job). A rank of an external launcher (srun, torchrun) writes
  its own line and exits after `PEER_GRACE_S`, so that peers signalled with it leave quietly instead of
  reporting a dead peer.
- **SIGINT** (Ctrl-C, which the terminal sends to every process of the job) the same way, with exit status 130
  (128 + 2) and ``got SIGINT``: not a KeyboardInterrupt raised wherever each rank happens to be (a traceback per
  rank, a peer blocked on a transfer reporting a hang, statuses 1, 3 or 137). A save in progress is abandoned
  unpublished (its `.partial` folder), so the last committed checkpoint is the one `ckpt_path=last` takes.
- **Preemption** under SLURM (`#SBATCH --signal=USR1@90`: SIGUSR1, the requeue signal of Lightning's
  SLURMEnvironment; in a submitit job also submitit's own, USR2 by default, sent `signal_delay_s` ahead): the
  handler sets a flag. At the end of every step, every rank posts an all-reduce (MAX) of one int32 on the module's
  device, the same collective in the same place on every rank, and reads the one it posted a step earlier (so no
  rank waits at a step's end); when any rank had the flag, all save
  `DIR/checkpoints/step-N` together, rank 0 requeues the job (`scontrol requeue $SLURM_JOB_ID`, the `scontrol`
  found on PATH; in a submitit job submitit's own handler, which also keeps its time-out count) and every rank
  leaves with exit status 75 (`EXIT_REQUEUED`, sysexits' EX_TEMPFAIL). The requeued job sees
  SLURM_RESTART_COUNT > 0 and resumes from `ckpt_path=last` (`environment.resume_ckpt_path`), bit for bit.
  A SIGTERM that arrives while that checkpoint is written waits for it; after it, the rank leaves quietly. With
  `checkpoint.async_save` the save is written behind the step like any other, and waited for (committed) before
  the requeue; a SIGTERM outside that abandons a save in flight (its `.partial` folder is never published).
  `MLPLAT_PREEMPT_SIGNAL` overrides the signals (`USR1`, `USR2,USR1`, or `none`); outside SLURM there are none and
  no per-step collective.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist

from mlplat.lightning import internals
from mlplat.parallel.grid import dist_ready

STOPPING = (signal.SIGTERM, signal.SIGINT)  # signals that stop the job at once (exit status 128 + the signal)
EXIT_REQUEUED = 75                   # saved and requeued after a preemption notice (EX_TEMPFAIL: try again)
STOP_FD_ENV = "MLPLAT_STOP_FD"       # "FD:PID" in a rank our launcher started: tell process PID through pipe FD
PREEMPT_ENV = "MLPLAT_PREEMPT_SIGNAL"
CHILD_GRACE_S = 10.0  # a rank that told its launcher waits this long to be stopped before stopping itself
PEER_GRACE_S = 1.0    # a rank of an external launcher waits this long (silent) before it exits
EXIT_DEADLINE_S = 5.0  # stopping never takes longer than this, whatever blocks (a full stdout pipe)

RUNNING, SAVING, PREEMPTED = "running", "saving", "preempted"


class Preempted(SystemExit):
    """How every rank leaves `Trainer.fit` once the preemption checkpoint is saved (and the job requeued)."""

    def __init__(self) -> None:
        super().__init__(EXIT_REQUEUED)


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class _ProcessSignals:
    """This process's handlers, its watcher thread and the ranks it launched (one per process: `SIGNALS`)."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1
        self.state = RUNNING
        self.preemption: tuple[int, ...] = ()  # the signals that announce a preemption
        self.preempt_signum = 0                # the one this process got (0: none yet)
        self.children: list[subprocess.Popen] = []  # the ranks this process launched
        self.stopping = False
        self._originals: dict[int, Any] = {}
        self._wakeup: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._lock = threading.Lock()
        self._err = 2  # where the stop line goes (a copy of stderr once stdout/stderr are silenced)
        self._fork_guard = False

    # -- installing ----------------------------------------------------------------------------------
    def install(self, rank: int, world_size: int, preemption: tuple[int, ...] = ()) -> None:
        """SIGTERM, SIGINT and the preemption signals handled from here on (main thread only; again: updates)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.rank, self.world_size, self.preemption = rank, world_size, tuple(preemption)
        for signum in (*STOPPING, *self.preemption):
            if signum not in self._originals:
                self._originals[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handler)
        if not self._fork_guard:  # a forked DataLoader worker must not act for, or wake, this process
            os.register_at_fork(after_in_child=self._forked)
            self._fork_guard = True
        if self._wakeup is None:
            r, w = os.pipe()
            os.set_blocking(w, False)
            try:
                self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            except (ValueError, OSError):  # then the handler itself acts, in the main thread
                os.close(r)
                os.close(w)
                return
            self._wakeup = (r, w)
            threading.Thread(target=self._watch, args=(r,), name="mlplat-signals", daemon=True).start()

    def uninstall(self) -> None:
        """The handlers from before `install`; a preemption signal that was fatal by default is ignored instead
        (the run is ending: a late notice must not kill it while it writes its last rows)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, original in self._originals.items():
            if signum in self.preemption and original in (signal.SIG_DFL, None):
                original = signal.SIG_IGN
            signal.signal(signum, original if original is not None else signal.SIG_DFL)
        self._originals = {}
        if self.state == PREEMPTED:  # saved and requeued: SLURM's SIGTERM that follows must not change the status
            signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(EXIT_REQUEUED))
        self.preemption, self.preempt_signum, self.state = (), 0, RUNNING
        if self._wakeup is not None:
            r, w = self._wakeup
            self._wakeup = None
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(self._old_wakeup)
            with contextlib.suppress(OSError):
                os.write(w, b"\0")  # the watcher's cue to end (no signal is 0)
            os.close(w)

    def _forked(self) -> None:
        """In a forked child (a DataLoader worker): the default signal behaviour, no wakeup fd into the parent's
        pipe, and no launched ranks to kill."""
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)
        for signum in self._originals:
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signum, signal.SIG_DFL)
        self._originals, self.preemption, self.children, self._wakeup = {}, (), [], None

    def original(self, signum: int) -> Any:
        return self._originals.get(signum)

    # -- receiving -------------------------------------------------------------------------------------
    def _handler(self, signum: int, frame: Any) -> None:
        # The watcher thread has acted already, as a rule; acting again is harmless (a stop happens once), and
        # covers a wakeup fd that something else replaced.
        self._act(signum)

    def _watch(self, r: int) -> None:
        try:
            while True:
                data = os.read(r, 64)
                if not data or 0 in data:
                    return
                for signum in data:
                    if signum in self._originals:
                        self._act(signum)
        finally:
            os.close(r)

    def _act(self, signum: int) -> None:
        if signum in self.preemption:
            self.preempt_signum = signum  # acted on at the next step end, by every rank together
        elif signum in STOPPING:
            self.terminate(signum, self.rank)

    # -- stopping --------------------------------------------------------------------------------------
    def terminate(self, signum: int, rank: int, from_child: bool = False) -> None:
        if self.state == SAVING:
            return  # the preemption checkpoint is being written: let it finish (exit 75 follows)
        if self.state == PREEMPTED:
            self._exit(EXIT_REQUEUED)
        fd = None if from_child else _launcher_pipe()
        if fd is not None:
            try:
                os.write(fd, f"{rank} {signum}\n".encode())
            except OSError:
                pass
            else:  # the launching process says it and stops every rank, this one included
                self._silence()
                deadline = time.monotonic() + CHILD_GRACE_S
                while time.monotonic() < deadline or self.state == SAVING:
                    time.sleep(0.1)
                    if self.state == PREEMPTED:
                        self._exit(EXIT_REQUEUED)
        self.stop(rank, signum)

    def stop(self, rank: int, signum: int) -> None:
        """One line, the launched ranks killed, this process gone: at most EXIT_DEADLINE_S from now."""
        if not self._lock.acquire(blocking=False):
            return  # another thread of this process is stopping it
        self.stopping = True
        code = 128 + signum  # what a shell reports for a process that the signal ended: 143, 130
        threading.Thread(target=lambda: (time.sleep(EXIT_DEADLINE_S), os._exit(code)), daemon=True).start()
        for stream in (sys.stdout, sys.stderr):  # what was written before the line comes before it
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(OSError):
            os.write(self._err, f"\nmlplat: rank {rank} got {_name(signum)}; stopping\n".encode())
        self._silence()  # what this process would say now (a peer's closed connection, seen by the hang watch)
        for proc in self.children:
            if proc.returncode is None:
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGKILL)
        if self.world_size > 1 and not self.children:
            time.sleep(PEER_GRACE_S)  # peers signalled with this one are silenced before its connections close
        os._exit(code)

    def _silence(self) -> None:
        if self._err != 2:
            return
        with contextlib.suppress(OSError):
            self._err = os.dup(2)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            os.close(null)

    def _exit(self, code: int) -> None:
        self._silence()
        os._exit(code)

    # -- the ranks this process launched ---------------------------------------------------------------
    def watch_children(self, procs: list[subprocess.Popen], read_fd: int) -> None:
        """`procs` are killed when this process stops; a line "RANK SIGNUM" read from `read_fd` (the pipe the
        children got as STOP_FD_ENV) stops this process as if it had got that signal."""
        self.children = procs

        def read() -> None:
            buf = b""
            try:
                while chunk := os.read(read_fd, 256):
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        with contextlib.suppress(ValueError):
                            rank, signum = (int(x) for x in line.split())
                            self.terminate(signum, rank, from_child=True)
            finally:
                os.close(read_fd)

        threading.Thread(target=read, name="mlplat-rank-signals", daemon=True).start()

    def forget_children(self) -> None:
        self.children = []


SIGNALS = _ProcessSignals()
# The strategies of trainers that `install_signal_handling` prepared (`install_early` acts for those only).
_PREPARED: weakref.WeakSet = weakref.WeakSet()


def _launcher_pipe() -> int | None:
    """The pipe to the process that launched this rank, when mlplat's launcher did (and it is still there)."""
    value = os.environ.get(STOP_FD_ENV, "")
    fd, _, pid = value.partition(":")
    if not (fd.isdigit() and pid.isdigit()) or os.getppid() != int(pid):
        return None
    return int(fd)


def preemption_signals(cluster_environment: Any = None) -> tuple[int, ...]:
    """The signals that announce a preemption: none outside SLURM; SIGUSR1 (or the SLURMEnvironment's
    requeue_signal) in a SLURM job, plus submitit's own signal in a submitit job; `MLPLAT_PREEMPT_SIGNAL` wins."""
    override = os.environ.get(PREEMPT_ENV)
    if override is not None:
        names = [n.strip().upper() for n in override.split(",") if n.strip()]
        if not names or names == ["NONE"]:
            return ()
        return tuple(signal.Signals[n if n.startswith("SIG") else "SIG" + n] for n in names)
    if not os.environ.get("SLURM_JOB_ID"):
        return ()
    found = [getattr(cluster_environment, "requeue_signal", None) or signal.SIGUSR1]
    if submitit_job() is not None:
        import submitit

        found.append(submitit.JobEnvironment._usr_sig())
    return tuple(dict.fromkeys(int(s) for s in found))


def slurm_job_id() -> str | None:
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def requeue(signum: int) -> str:
    """Requeue this SLURM job (global rank 0, once the checkpoint is saved); says what happened."""
    original = SIGNALS.original(signum)
    if callable(original) and getattr(original, "__module__", "").startswith("submitit"):
        try:  # submitit's handler: resubmission pickle, time-out count, `scontrol requeue`, then sys.exit
            original(signum, None)
        except SystemExit:
            return "requeued by submitit"
        except Exception as err:  # noqa: BLE001 - submitit's UncompletedJobError and the like: said, not raised
            return f"not requeued ({type(err).__name__}: {err})"
        return "not requeued by submitit"
    job = slurm_job_id()
    if not job:
        return "not requeued (no SLURM_JOB_ID)"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        return f"`scontrol requeue {job}` failed ({err})"
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        return f"`scontrol requeue {job}` failed (exit {done.returncode}{': ' + why[0][:200] if why else ''})"
    return f"requeued SLURM job {job}"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class PreemptionCheckpoint(pl.Callback):
    """At each step end: have all ranks agree on the preemption flag; if set, save, requeue and stop together.

    The flag's all-reduce is posted at one step's end and read at the next step's end, when every rank has long
    posted it: so no rank waits for the others at a step's end (under optimizer post-validation steps run back to
    back), and a notice is acted on one step after the step it arrived in (SLURM sends it minutes ahead)."""

    def __init__(self) -> None:
        self._posted: tuple | None = None  # (flag, work) posted at the previous step's end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not SIGNALS.preemption:
            return
        if not (dist_ready() and dist.get_world_size() > 1):
            signum = SIGNALS.preempt_signum
        else:
            signum = self._read(pl_module)
            if not signum:
                self._posted = self._post(pl_module, SIGNALS.preempt_signum)
        if signum:
            self._save_requeue_stop(trainer, pl_module, signum)

    def on_train_end(self, trainer, pl_module) -> None:
        self._read(pl_module)  # no all-reduce left in flight

    @staticmethod
    def _post(pl_module, signum: int) -> tuple:
        # On the module's device: NCCL reduces CUDA tensors only. One int, every rank, every step.
        flag = torch.tensor([signum], dtype=torch.int32, device=pl_module.device)
        return flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)

    def _read(self, pl_module) -> int:
        """The agreed flag of the previous step's end (0: none, or nothing posted)."""
        if self._posted is None:
            return 0
        (flag, work), self._posted = self._posted, None
        watch = getattr(pl_module, "watch", None)  # a dead peer: the hang watch's one line, not a traceback
        with watch.blocked_in("the preemption-flag all-reduce", "dp_comm") if watch else contextlib.nullcontext():
            work.wait()
        return int(flag.item())

    @staticmethod
    def _save_requeue_stop(trainer, pl_module, signum: int) -> None:
        SIGNALS.state = SAVING
        step = trainer.global_step
        path = Path(trainer.default_root_dir) / "checkpoints" / f"step-{step}"
        if trainer.is_global_zero:
            _say(f"\nmlplat: {_name(signum)} (preemption notice) at step {step}: saving {path}, then requeueing")
        try:
            # A step checkpoint of this very step may have been written already (the callbacks' order decides).
            if not any(getattr(cb, "_last_global_step_saved", None) == step for cb in trainer.checkpoint_callbacks):
                trainer.save_checkpoint(str(path))
            wait = getattr(trainer.strategy, "wait_for_checkpoint", None)  # a save written behind training: committed
            if wait is not None:
                wait()
            main = getattr(pl_module, "main", None)  # the distributed optimizer's last all-gathers (on_train_end)
            if main is not None and callable(getattr(main, "wait", None)):
                main.wait()
        except BaseException:
            SIGNALS.state = RUNNING  # a failed save is an ordinary failure; SIGTERM stops again
            raise
        if trainer.is_global_zero:
            _say(f"mlplat: saved {path.name}; {requeue(signum)}; exiting with status {EXIT_REQUEUED}")
        SIGNALS.state = PREEMPTED
        raise Preempted()


class SignalConnector(internals.SignalConnector):
    """Lightning's signal connector, replaced: mlplat's handlers instead of its (collective) ones."""

    def register_signal_handlers(self) -> None:
        trainer = self.trainer
        self.received_sigterm = False  # stays False: Lightning's loops never raise SIGTERMException
        self._original_handlers = {}
        env = internals.cluster_environment(trainer)
        SIGNALS.install(trainer.global_rank, trainer.world_size, preemption_signals(env))
        # Lightning broadcasts `received_sigterm` from rank 0 before every step; it is always False here (the
        # preemption flag has its own all-reduce), so that is one world-wide collective per step saved.
        internals.skip_sigterm_broadcast(trainer)

    def teardown(self) -> None:
        SIGNALS.uninstall()
        self._original_handlers = {}


def install_signal_handling(trainer: pl.Trainer) -> pl.Trainer:
    """mlplat's signal handling for `trainer` (before `fit`): SIGTERM stops, preemption saves and requeues."""
    internals.replace_signal_connector(trainer, SignalConnector(trainer))
    trainer.callbacks.append(PreemptionCheckpoint())
    _PREPARED.add(trainer.strategy)  # install_early's cue
    return trainer


def install_early(strategy: Any) -> None:
    """The same handlers as soon as the process group exists (`PTDPStrategy.setup_environment`), so that setup and a
    long checkpoint load are covered too (a preemption notice then saves at the first step end); only for a
    trainer that `install_signal_handling` prepared (its connector removes them at teardown)."""
    if strategy not in _PREPARED:
        return
    SIGNALS.install(strategy.global_rank, strategy.world_size, preemption_signals(strategy.cluster_environment))


def submitit_job() -> Any | None:
    """The `submitit.JobEnvironment` of this process, or None outside a submitit job."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    try:
        import submitit

        return submitit.JobEnvironment()
    except Exception:  # noqa: BLE001 - not a job submitit knows: treat as a plain process
        return None
