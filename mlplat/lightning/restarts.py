"""Restarts inside the job (`trainer.max_restarts=N`) on torch.distributed.elastic, the agent behind torchrun.

With N > 0 the launching process does not train: it becomes a `LocalElasticAgent` that starts the ranks, watches
them and, when one fails (killed by a signal, an exception, the hang watch's exit), stops every rank of the group,
meets again (the c10d rendezvous, served in this process) and starts them all anew, at most N times. A restarted
rank resumes from the run directory's last committed checkpoint (`mlplat.train.resume_point`). Each restart is one
line: which rank, why (its signal or exit code, the exception's first line when it raised) and the checkpoint it
resumes from; a failure beyond the limit ends the job in one line with the failed rank's status, as the job
without restarts ends (128 + N for signal N, else its code). Not faults, so not restarted: a rank's one-line
refusal (exit 2: a divergence, a checkpoint refused), which a restart would only reach again, and the exit after a
preemption checkpoint (75: the job is requeued).

The ranks are forked from this process where forking is safe (`fork_unsafe`: it has run no tensor work, and only
the agent's own threads exist besides), else started as new interpreters running the job's command line, as
torchrun starts them. Either way they see the environment torchrun gives its workers (RANK, WORLD_SIZE,
TORCHELASTIC_RESTART_COUNT, ...): Lightning finds its `TorchElasticEnvironment` and the strategy joins the
agent's store under the restart's own prefix. torchrun users get the same with `torchrun --max-restarts=N`
(docs/checkpoints.md).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from mlplat.lightning.launcher import CHILD_ENV, CHILD_EXIT_TIMEOUT_S, fork_unsafe, hydra_job_command
from mlplat.lightning.ports import free_local_port
from mlplat.lightning.signals import EXIT_REQUEUED, preemption_signals

log = logging.getLogger("mlplat")
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by the elastic agent in every rank it starts: 0, 1, ...
EXIT_REFUSED = 2  # mlplat.train's one-line refusals (a divergence, a checkpoint refused while loading)
REFUSED_EXIT_WAIT_S = 10.0  # how long the other ranks get to leave with it (rank 0 writes the line) before SIGKILL


def restart_count() -> int:
    """How many times the elastic agent (ours or torchrun's) has restarted this rank's group; 0 elsewhere."""
    return int(os.environ.get(RESTART_COUNT_ENV) or 0)


def failure_status(exitcode: int) -> int:
    """A rank's end as a shell reports it: its exit code, or 128 + N when signal N killed it."""
    return exitcode if exitcode >= 0 else 128 - exitcode


def describe(failures: dict[int, Any]) -> tuple[int, Any, str]:
    """(global rank, failure, why) of the rank that brought the group down: one killed by a signal first, then one
    that raised (its error file holds the exception), else the lowest rank: the others' failures are their reports
    of its death (the hang watch's exit 3 on a peer's closed connection)."""
    rank, failure = min(failures.items(), key=lambda item: (item[1].exitcode >= 0,
                                                            not os.path.isfile(item[1].error_file), item[0]))
    if failure.exitcode < 0:
        why = f"was killed by {failure.signal_name()}"
    else:
        why = f"exited with code {failure.exitcode}"
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        if os.path.isfile(failure.error_file) and message:  # it raised: the exception's first line
            why += f" ({message.strip().splitlines()[0][:200]})"
    return rank, failure, why


def _exit_codes(pcontext: Any) -> dict[int, int | None]:
    """{local rank: exit code (negative: the signal), None while it runs} of the processes the agent started
    (forked: multiprocessing's, new interpreters: Popen's)."""
    procs = getattr(getattr(pcontext, "_pc", None), "processes", None)
    if procs is not None:
        return {i: p.exitcode for i, p in enumerate(procs)}
    return {i: h.proc.poll() for i, h in getattr(pcontext, "subprocess_handlers", {}).items()}


def kill_running(pcontext: Any) -> None:
    """SIGKILL the agent's processes that still run (not yet reaped: their pids are still theirs)."""
    pids = pcontext.pids()
    for i, code in _exit_codes(pcontext).items():
        if code is None:
            try:
                os.kill(pids[i], signal.SIGKILL)
            except ProcessLookupError:
                pass


def wait_for_exit(pcontext: Any, timeout_s: float) -> None:
    """Until every process the agent started has exited, or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while pcontext is not None and None in _exit_codes(pcontext).values() and time.monotonic() < deadline:
        time.sleep(0.05)


class Refused(Exception):
    """A rank left with EXIT_REFUSED: mlplat's one-line refusal, not a fault; the job ends with it."""


class NoProgress(Exception):
    """A group failed again before a new checkpoint: a restart would run the same steps from the same state. Carries
    the failed rank's line and its exit status."""

    def __init__(self, line: str, status: int):
        super().__init__(line)
        self.line, self.status = line, status


class Requeued(Exception):
    """A rank left with EXIT_REQUEUED: the group saved after a preemption notice and the job is requeued."""


def failed(pcontext: Any, worker_group: Any) -> dict[int, Any]:
    """{global rank: ProcessFailure} of the group's ranks that have failed."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    if pcontext is None:
        return {}
    codes = _exit_codes(pcontext)
    pids = pcontext.pids()
    return {worker_group.workers[i].global_rank: ProcessFailure(i, pids[i], code, pcontext.error_files[i])
            for i, code in codes.items() if code not in (None, 0)}


def _rank_job(job: Callable[[Any], None], cfg: Any) -> None:
    """In a forked rank: become this local rank's Hydra job (its own job name and log file), then run `job(cfg)`."""
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    from mlplat.lightning.launcher import _as_rank_job

    local_rank = int(os.environ["LOCAL_RANK"])
    rank_zero_only.rank = int(os.environ["RANK"])
    if local_rank > 0:
        _as_rank_job(local_rank)
    job(cfg)


def _elastic_agent(cfg, run_dir: Path, job: Callable[[Any], None]):
    """torch's local elastic agent over the layout's ranks (forked, or new interpreters where forking is unsafe),
    saying each restart in one line and stopping a failed group at once, its loggers quieted."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from mlplat.checkpoint import CheckpointError
    from mlplat.checkpoint.io import find_last
    from mlplat.model.attention import device_type_for

    limit = cfg.trainer.max_restarts
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    first = cfg.ckpt_path

    class Agent(LocalElasticAgent):
        """torch's local agent, saying each restart in one line and stopping a failed group at once (SIGKILL: the
        survivors wait in a collective for the dead rank; a checkpoint is committed whole or not at all)."""

        failures: dict = {}
        resumed_from: str | None = None  # what the last restart resumed: a restart from it again makes no progress

        def _monitor_workers(self, worker_group):
            # The ranks that failed on their own, read before the others are stopped: torch names only the first
            # rank it finds dead, not necessarily the cause, and stops the others with SIGTERM (a line from each,
            # and up to 30 s); they wait in a collective for the dead rank, so SIGKILL them at once instead.
            causes = failed(self._pcontext, worker_group)
            self._end_without_restart(causes)
            if causes:
                kill_running(self._pcontext)
            result = super()._monitor_workers(worker_group)
            if result.failures:
                # Ranks that left between the read above and torch's own (a loaded machine): the same verdicts. Else
                # a group requeued after a preemption notice would be restarted, and the restart run to the end.
                self._end_without_restart(result.failures)
                result.failures = Agent.failures = causes or result.failures
            return result

        def _end_without_restart(self, failures: dict) -> None:
            """Raises Requeued or Refused where a rank of `failures` left with that status."""
            if any(f.exitcode == EXIT_REQUEUED for f in failures.values()):
                # Every rank saved at the same step end and leaves (rank 0 once it requeued the job): not a failure
                wait_for_exit(self._pcontext, CHILD_EXIT_TIMEOUT_S)
                raise Requeued
            if any(f.exitcode == EXIT_REFUSED for f in failures.values()):
                # The run's own verdict (a divergence, a checkpoint refused), reached by every rank alike: a restart
                # would only reach it again. Rank 0 says it in its line.
                wait_for_exit(self._pcontext, REFUSED_EXIT_WAIT_S)
                raise Refused

        def _shutdown(self, death_sig=signal.SIGTERM, timeout: int = 30) -> None:
            super()._shutdown(signal.SIGKILL, timeout)  # after a failure, a signal to this process, or the end

        def _restart_workers(self, worker_group) -> None:
            rank, failure, why = describe(Agent.failures)
            done = limit - self._remaining_restarts  # this restart's number (the count was lowered before the call)
            try:
                last = find_last(run_dir / "checkpoints")
            except CheckpointError:  # the restarted ranks refuse it in its one line
                last = "the run directory's last checkpoint"
            resume = last if last is not None else (first or "the start (no checkpoint committed yet)")
            if done > 1 and str(resume) == Agent.resumed_from:  # the last restart began here and saved nothing since
                raise NoProgress(f"mlplat: rank {rank} (pid {failure.pid}) {why}, again before a new checkpoint: "
                                 f"restart {done - 1} resumed {resume} and committed none, and another would run the "
                                 f"same steps again: stopping the job", failure_status(failure.exitcode))
            Agent.resumed_from = str(resume)
            print(f"mlplat: restart {done}/{limit}: rank {rank} (pid {failure.pid}) {why}; every rank restarts "
                  f"from {resume}", file=sys.stderr, flush=True)
            super()._restart_workers(worker_group)

    # Their lines repeat ours at length, per rank; and multiprocessing's SIGTERM to a rank already SIGKILLed (above).
    for name in [*logging.root.manager.loggerDict, "torch.multiprocessing.spawn"]:  # each module's own logger
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing.spawn")):
            logging.getLogger(name).setLevel(logging.CRITICAL)

    device_type = device_type_for(cfg.trainer.accelerator)
    unsafe = fork_unsafe(device_type)
    os.environ[CHILD_ENV] = "1"  # the ranks are the launcher's: rank 0 holds no run lock of its own (this process does)
    if unsafe is None:
        entrypoint: Any = _rank_job
        args: tuple = (job, cfg)
        start_method = "fork"
    else:  # as torchrun starts them: the job's command line, each rank its own Hydra job name
        cmd, _ = hydra_job_command(0)
        named = [a if not a.startswith("hydra.job.name=") else "hydra.job.name=rank${local_rank}" for a in cmd[1:]]
        entrypoint, args = cmd[0], tuple(named)
        start_method = "spawn"
    port = free_local_port()
    rdzv = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id=uuid.uuid4().hex,
                                min_nodes=1, max_nodes=1)
    spec = WorkerSpec(role="mlplat", local_world_size=world, entrypoint=entrypoint, args=args,
                      rdzv_handler=get_rendezvous_handler(rdzv), max_restarts=limit, monitor_interval=0.5)
    # DIR/restarts/RUN_ID/attempt_K/RANK/error.json: a rank's exception, which the restart line quotes
    agent = Agent(spec, logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "restarts")), start_method=start_method)
    how = "forked from this process" if unsafe is None else f"started as new interpreters ({unsafe})"
    log.info("trainer.max_restarts=%d: %d ranks %s under torch's elastic agent; rendezvous at 127.0.0.1:%d",
             limit, world, how, port)
    return agent


def run_with_restarts(cfg, run_dir: Path, job: Callable[[Any], None]) -> None:
    """Run `job(cfg)` on every rank of the layout under an elastic agent that restarts the ranks up to
    `cfg.trainer.max_restarts` times. Returns when every rank finished; a failure beyond the limit (or a signal to
    this process) ends the process in one line with the failed rank's status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    limit = cfg.trainer.max_restarts
    agent = _elastic_agent(cfg, run_dir, job)
    notices = preemption_signals()

    def forward(signum: int, frame: Any) -> None:  # a preemption notice: every rank saves at its next step end
        pcontext = agent._pcontext
        for pid in (pcontext.pids().values() if pcontext is not None else ()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    # torch's agent sets its own SIGTERM, SIGINT, SIGHUP and SIGQUIT handlers: the next job of a multirun gets ours back
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                                                 signal.SIGQUIT, *notices)}
    for signum in notices:
        signal.signal(signum, forward)
    try:
        result = agent.run()
    except SignalException as e:  # torch's handler in this process: every rank is stopped (SIGKILL) already
        print(f"mlplat: the launcher got {signal.Signals(e.sigval).name}; every rank stopped", file=sys.stderr,
              flush=True)
        sys.exit(128 + int(e.sigval))
    except Requeued:  # rank 0 said so in its line
        sys.exit(EXIT_REQUEUED)
    except Refused:
        sys.exit(EXIT_REFUSED)
    except NoProgress as e:
        print(e.line, file=sys.stderr, flush=True)
        sys.exit(e.status)
    finally:
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        os.environ.pop(CHILD_ENV, None)
    if result.is_failed():
        rank, failure, why = describe(result.failures)
        print(f"mlplat: rank {rank} (pid {failure.pid}) {why}; no restart left (trainer.max_restarts={limit} "
              f"{'used' if limit else 'off'}): stopping the job", file=sys.stderr, flush=True)
        sys.exit(failure_status(failure.exitcode))
