"""Lightning's script launcher, made safe under Hydra.

Lightning starts ranks 1..N-1 by re-running `sys.argv`. Under Hydra that goes wrong twice: in a multirun the
children see `-m` and start sweeps of their own (Lightning issue 11300), and under submitit `sys.argv` is
submitit's own `_submit.py`. Here a child is started from what Hydra composed for *this* job — the job's own
overrides, pinned to the job's output directory — so it is always exactly one more rank of the same run.

A multirun's jobs run one after another in one process, so rank 0 also leaves the process as it found it: it
waits for its children, destroys the process group and restores the environment variables it set (otherwise
the next job would find `WORLD_SIZE`/`LOCAL_RANK` of the previous one, or a stale process group).

Signals (`mlplat.lightning.signals`): each child gets the write end of a pipe (`STOP_FD_ENV`); a child that gets
SIGTERM says so there, and rank 0 writes the job's one line, SIGKILLs every child and exits, as when rank 0 gets
SIGTERM itself. A child that exits with `EXIT_REQUEUED` (all ranks stop together after a preemption checkpoint)
is waited for, like one that finished.

Starting a rank: on CPU (Linux), forked from rank 0, so that it starts in a fraction of a second instead of
importing torch and Lightning again (about 10 s of CPU each; `fork_unsafe` says why forking is safe there). A
forked rank runs the launcher's `rank_job` when the run gave one (`mlplat.train` does: the same job from rank 0's
composed and checked config, under the child's own Hydra job name and log file, so that no rank composes and
checks the config again), else the same Hydra job command in-process. On GPUs, elsewhere, or with
`MLPLAT_LAUNCH_FORK=0`, each rank is a new interpreter running that command.

`slurm_sbatch_script` renders the sbatch file submitit would submit for a launcher config, without submitting.
"""
from __future__ import annotations

import copy
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Mapping, NoReturn

from lightning_fabric.plugins.environments import LightningEnvironment

from mlplat.lightning.internals import (
    ChildProcessObserver,
    SubprocessScriptLauncher,
    destroy_dist_connection,
    set_num_threads_if_needed,
)
from mlplat.lightning.ports import free_local_port
from mlplat.lightning.signals import EXIT_REQUEUED, SIGNALS, STOP_FD_ENV, Preempted, install_early

log = logging.getLogger(__name__)

CHILD_ENV = "MLPLAT_LAUNCHED_RANK"  # set in the ranks this launcher starts (value: their local rank)
BLAME_WAIT_S = 3.0  # how long rank 0, having lost a peer, waits for a dead child's exit status before its own report
CHILD_EXIT_TIMEOUT_S = 120          # how long rank 0 waits for its children after its own work is done
FORK_ENV = "MLPLAT_LAUNCH_FORK"     # 0: every rank a new interpreter, even where forking is safe

# Hydra overrides a child must not inherit: they would make it sweep, submit, or write somewhere else.
_NOT_FOR_CHILDREN = ("hydra.run", "hydra.sweep", "hydra.launcher", "hydra/launcher", "hydra.sweeper",
                     "hydra/sweeper", "hydra.mode", "hydra.job.name", "hydra.job.chdir", "hydra.job.id",
                     "hydra.job.num", "hydra.output_subdir", "hydra.callbacks", "hydra/callbacks")


def _override_key(override: str) -> str:
    return override.lstrip("~+").split("=", 1)[0]


def _quoted(value: str) -> str:
    """A Hydra override value that survives any path (spaces, commas, `=`)."""
    return "'" + value.replace("'", "\\'") + "'"


def hydra_job_command(local_rank: int) -> tuple[list[str], str]:
    """The command (and working directory) that starts local rank `local_rank` of the current Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    cmd = [sys.executable, "-m", "mlplat.train"]
    if hc.job.config_name:
        cmd += ["--config-name", hc.job.config_name]
    extra_dirs = [s.path for s in hc.runtime.config_sources if s.provider == "command-line" and s.schema == "file"]
    if extra_dirs:
        cmd += ["--config-dir", extra_dirs[0]]
    cmd += list(hc.overrides.task)
    cmd += [o for o in hc.overrides.hydra if not _override_key(o).startswith(_NOT_FOR_CHILDREN)]
    cmd += [f"hydra.run.dir={_quoted(hc.runtime.output_dir)}", "hydra.output_subdir=null",
            f"hydra.job.name=rank{local_rank}"]
    if hc.job.chdir is not None:
        cmd.append(f"hydra.job.chdir={str(bool(hc.job.chdir)).lower()}")
    return cmd, hc.runtime.cwd


def fork_unsafe(device_type: str) -> str | None:
    """Why this process must not fork its ranks, or None. A forked child keeps only the forking thread: a lock
    another thread held stays held, and an OpenMP team that ran a parallel region is gone while its state says
    it exists (the child's first parallel region then hangs: reproduced with torch's CPU build). Before its first
    launch, rank 0 has run no tensor work (the model is built in setup, after the launch) and its only other
    thread is the signal watcher, blocked in a read; a later job of a multirun has trained in this process. CUDA
    is left to new interpreters: a context cannot cross a fork."""
    if os.environ.get(FORK_ENV, "1") == "0":
        return f"{FORK_ENV}=0"
    if HydraSafeLauncher.trained_here:
        return "an earlier job of this process ran tensor work"
    if device_type != "cpu":
        return f"{device_type} devices"
    if not hasattr(os, "fork") or sys.platform != "linux":
        return f"no fork() on {sys.platform}"
    import torch

    if torch.cuda.is_initialized():
        return "a CUDA context exists"
    return None


class _ForkedRank:
    """A rank forked from this process: the part of `subprocess.Popen` the observer and the reaper use."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()  # the observer thread and the main thread both poll

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:
                    pid, status = self.pid, 255 << 8  # reaped elsewhere: its status is lost
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run_as_main(module: str, args: list[str], env: dict[str, str], cwd: str,
                prepare: Callable[[], None] | None = None) -> NoReturn:
    """Become `python -m MODULE ARGS` in this forked process, every module it imports already loaded, and leave with
    its exit status without unwinding the caller's frames. `env` is the whole environment, `cwd` the working
    directory; `prepare()` runs first (what else the new process must not inherit)."""

    def as_main() -> None:
        # runpy warns when the module was imported by name before (it runs anew as __main__): not the program's output
        warnings.filterwarnings("ignore", ".*found in sys.modules after import of package", RuntimeWarning)
        runpy.run_module(module, run_name="__main__", alter_sys=True)

    run_and_exit(as_main, args, env, cwd, prepare)


def run_and_exit(program: Callable[[], None], args: list[str], env: dict[str, str], cwd: str,
                 prepare: Callable[[], None] | None = None) -> NoReturn:
    """Run `program()` in this forked process as a new interpreter with command-line arguments `args` would, and
    leave with its exit status (0, SystemExit's code, or 1 after an uncaught exception, printed) without unwinding
    the caller's frames. `env` is the whole environment, `cwd` the working directory; `prepare()` runs first."""
    code = 1
    try:
        if prepare is not None:
            prepare()
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = [sys.argv[0], *args]
        try:
            program()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as an interpreter reports an uncaught exception
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _as_rank_job(local_rank: int) -> None:
    """In a forked child: make rank 0's Hydra job this rank's, as the job command would have composed it (job name
    `rank<N>`, hence its log file `rank<N>.log`; no `.hydra/` of its own; a run, not a sweep), and log there."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import configure_log
    from hydra.types import RunMode
    from omegaconf import open_dict, read_write

    config = copy.deepcopy(HydraConfig.instance().cfg)  # {"hydra": ...} of rank 0's job
    hc = config.hydra
    with read_write(hc), open_dict(hc):
        hc.run.dir = hc.runtime.output_dir
        hc.output_subdir = None
        hc.job.name = f"rank{local_rank}"
        hc.mode = RunMode.RUN
    HydraConfig.instance().set_config(config)
    configure_log(hc.job_logging, hc.verbose)


def _run_forked_rank(args: list[str], cwd: str, env: dict[str, str], local_rank: int, close: int,
                     rank_job: Callable[[], None] | None) -> NoReturn:
    """In the forked child: become local rank `local_rank`: run `rank_job()` as that rank's Hydra job, or else
    the job's command line `args` (what would follow `python -m mlplat.train`), as a new interpreter would."""

    def prepare() -> None:
        os.close(close)
        from hydra.core.global_hydra import GlobalHydra
        from lightning_fabric.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = local_rank  # what a new interpreter reads from LOCAL_RANK at import: no rank-0 lines
        if rank_job is None:
            GlobalHydra.instance().clear()  # rank 0's job is still composed in this memory
        else:
            _as_rank_job(local_rank)

    if rank_job is None:
        run_as_main("mlplat.train", args, env, cwd, prepare)
    run_and_exit(rank_job, args, env, cwd, prepare)


class _Observer(ChildProcessObserver):
    """Lightning's watchdog (a child that dies takes every rank down, said in one line), with an off switch for
    rank 0's exit; a child that left after a preemption checkpoint (`EXIT_REQUEUED`) is no failure."""

    def stop(self) -> None:
        self._finished = True

    def _run(self) -> bool:
        if SIGNALS.stopping:  # rank 0 is stopping the job itself (SIGTERM)
            return True
        for proc in self._child_processes:
            proc.poll()
        codes = [proc.returncode for proc in self._child_processes]
        if all(code in (0, EXIT_REQUEUED) for code in codes):
            return True
        failed = self._failed()
        if failed:
            self._say_and_stop(*failed)
        return False

    def _failed(self) -> tuple[int, Any, int] | None:
        """(local rank, process, exit code) of the child that failed first as far as can be told: a rank killed by a
        signal first (the others' failures are their reports of its death); None while none has failed."""
        for proc in self._child_processes:
            proc.poll()
        failed = [(local_rank, proc, proc.returncode) for local_rank, proc in enumerate(self._child_processes, start=1)
                  if proc.returncode not in (None, 0, EXIT_REQUEUED)]
        return min(failed, key=lambda f: f[2] >= 0) if failed else None

    def _say_and_stop(self, local_rank: int, proc, code: int) -> NoReturn:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        sys.stderr.write(f"mlplat: rank {local_rank} (pid {proc.pid}) {how}; stopping every rank (ckpt_path=last "
                         f"continues from the latest checkpoint)\n")  # one write, as the ranks' own reports
        sys.stderr.flush()
        self._stop_all(code)

    def blame(self, wait_s: float = BLAME_WAIT_S) -> None:
        """Rank 0 lost a peer (its hang watch's report, or an error out of training): if a child died, name it and
        stop the job with its status instead, waiting up to `wait_s` for its exit status, which reaches this
        process after the closed connection does. Rank 0 talks to its neighbours only: at pp = 3 the rank it would
        blame is the live one between it and the dead rank. Returns when no child failed."""
        deadline = time.monotonic() + wait_s
        while True:
            failed = self._failed()
            if failed is not None and (failed[2] < 0 or time.monotonic() >= deadline):
                self._say_and_stop(*failed)
                return  # (os._exit does not return, but a test's stand-in does)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def _stop_all(self, code: int) -> None:
        """Kill the other ranks and end this process with the failed rank's status: its own code (3 for a hang
        report), or 128 + N for a rank killed by signal N, as a shell reports it. Lightning's observer SIGKILLs
        rank 0 too, which a cluster user reads as the OOM killer (137) whatever the rank reported."""
        for proc in self._child_processes:
            if proc.poll() is None:
                proc.kill()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting either way
                pass
        os._exit(code if code > 0 else 128 - code)


class HydraSafeLauncher(SubprocessScriptLauncher):
    trained_here = False  # a fact about this process's OpenMP state (see `fork_unsafe`), so kept per process
    observer: "_Observer | None" = None  # while the children run: who names a dead one (`blame`)
    _device_type = "unknown"  # set by `launch`; anything but "cpu" starts new interpreters

    def __init__(self, *args: Any, rank_job: Callable[[], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rank_job = rank_job  # what a forked rank runs as its Hydra job; None: the job's command line

    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        env = self.cluster_environment
        env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if env.creates_processes_externally:
            set_num_threads_if_needed(num_processes=self.num_processes)
            return function(*args, **kwargs)
        saved_env = dict(os.environ)
        observer = None
        ok = False
        devices = getattr(trainer.strategy, "parallel_devices", None) if trainer is not None else None
        self._device_type = devices[0].type if devices else "cpu"
        if trainer is not None:
            install_early(trainer.strategy)  # SIGTERM while the children start: one line, all stopped
        try:
            self._call_children_scripts()
            HydraSafeLauncher.trained_here = True
            observer = self.observer = _Observer(os.getpid(), self.procs, sleep_period=2)
            observer.start()
            set_num_threads_if_needed(num_processes=self.num_processes)
            out = function(*args, **kwargs)
            ok = True
            return out
        except Preempted:
            ok = True  # every rank stops at the same step end: wait for them as after a finished run
            raise
        except Exception:  # a dead peer's closed connection, out of an unlabelled collective: name the dead rank
            if observer is not None:
                observer.blame()
            raise
        finally:
            if observer is not None:
                observer.stop()
            self.observer = None
            self._reap_children(wait=ok)
            SIGNALS.forget_children()
            destroy_dist_connection()
            os.environ.clear()
            os.environ.update(saved_env)

    def _reap_children(self, wait: bool) -> None:
        for local_rank, proc in enumerate(self.procs, start=1):
            if wait:
                try:
                    proc.wait(timeout=CHILD_EXIT_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    log.warning("rank %d (pid %d) still running %ds after rank 0 finished: killing it",
                                local_rank, proc.pid, CHILD_EXIT_TIMEOUT_S)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if wait and proc.returncode not in (0, EXIT_REQUEUED):
                log.warning("rank %d (pid %d) exited with code %s", local_rank, proc.pid, proc.returncode)
        self.procs = []

    def _call_children_scripts(self) -> None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return super()._call_children_scripts()
        self._check_can_spawn_children()
        self.procs = []
        if type(self.cluster_environment) is LightningEnvironment and "MASTER_PORT" not in os.environ:
            # Lightning would probe a port in the ephemeral range, where the machine's outgoing connections can take
            # it before rank 0 binds it (EADDRINUSE): one below that range instead.
            os.environ["MASTER_PORT"] = str(free_local_port())
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        read_fd, write_fd = os.pipe()  # the children's SIGTERM notices (mlplat.lightning.signals)
        unsafe = fork_unsafe(self._device_type)
        try:
            for local_rank in range(1, self.num_processes):
                env = os.environ.copy()
                env["LOCAL_RANK"] = str(local_rank)
                env[CHILD_ENV] = str(local_rank)
                env[STOP_FD_ENV] = f"{write_fd}:{os.getpid()}"
                cmd, cwd = hydra_job_command(local_rank)
                if unsafe is None:
                    for stream in (sys.stdout, sys.stderr):  # else the child writes rank 0's buffered text again
                        stream.flush()
                    pid = os.fork()
                    if pid == 0:
                        _run_forked_rank(cmd[3:], cwd, env, local_rank, close=read_fd, rank_job=self.rank_job)
                    self.procs.append(_ForkedRank(pid))
                else:
                    self.procs.append(subprocess.Popen(cmd, env=env, cwd=cwd, pass_fds=(write_fd,)))
        finally:
            os.close(write_fd)  # the children hold it now: the reader ends when the last of them has exited
        how = "forked from rank 0" if unsafe is None else f"started as new interpreters ({unsafe})"
        log.info("ranks 1-%d %s; rendezvous at %s:%s", self.num_processes - 1, how, os.environ["MASTER_ADDR"],
                 os.environ["MASTER_PORT"])
        SIGNALS.watch_children(self.procs, read_fd)


# -- SLURM: the sbatch script of a launcher config, without submitting ------------------------------------------
def slurm_sbatch_script(launcher: Mapping[str, Any], command: str | None = None) -> str:
    """The sbatch file hydra-submitit-launcher's SlurmLauncher would submit for `launcher` (the resolved
    `hydra.launcher` node), built by submitit's own SlurmExecutor from the same parameters the plugin passes,
    so unknown keys fail here as they would on the cluster. Needs no SLURM: nothing is submitted."""
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf
    from submitit.slurm.slurm import SlurmExecutor

    class _Preview(SlurmExecutor):
        @classmethod
        def affinity(cls) -> int:  # "is srun here?": yes, for the preview
            return 1

    params = dict(OmegaConf.to_container(launcher, resolve=True) if OmegaConf.is_config(launcher) else launcher)
    params.pop("_target_", None)
    folder = params.pop("submitit_folder")
    max_num_timeout = params.pop("max_num_timeout", 0)
    generic = set(OmegaConf.structured(BaseQueueConf).keys())
    executor = _Preview(folder=folder, max_num_timeout=max_num_timeout)
    common = {k: v for k, v in params.items() if k in generic and v is not None}
    specific = {k: v for k, v in params.items() if k not in generic and v is not None}
    executor.update_parameters(**executor._convert_parameters(common), **specific)
    return executor._make_submission_file_text(command or executor._submitit_command_str, "preview")
