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

With `trainer.num_nodes=K > 1` the job runs one agent per node (one SLURM task per node, or one process started on
each node by hand), each starting its node's `trainer.devices` ranks, node i's being ranks i·devices onwards. The K
agents meet in one c10d rendezvous (min = max = K) at node 0's MASTER_ADDR:MASTER_PORT, whose store node 0's agent
hosts (`meeting_point`). When a rank fails anywhere, its agent stops its ranks and meets the others again; they see
the waiting agent (or their own ranks' failures: peers of the dead one) and restart too. After each meeting every
agent posts what it saw in the round's store and all read the same reports (`agree`): the same restart count, the
same failed rank (one killed by a signal first). Node 0's agent alone reads the run directory's last checkpoint and
posts the verdict, what the restart resumes and whether that is progress (`decided`): a shared file system's stale
listing on one node cannot split the agents; node 0's agent says the line. When no restart is left the failing
node's agent closes the rendezvous, the others see it closed at their next look (`monitor_interval`), stop their
ranks and they agree on the cause the same way. A node lost whole takes its agent along: the others wait for it at
the rendezvous (JOIN_TIMEOUT_S), or for its report (VERDICT_WAIT_S), and then end in one line each.
"""
from __future__ import annotations

import contextlib
import json
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


NODE_RANK_ENVS = ("SLURM_NODEID", "NODE_RANK", "GROUP_RANK")  # where a node's agent finds its node rank, first set
VERDICT_WAIT_S = 60  # how long an agent waits, after a rendezvous or at the end, for every agent's report and verdict
VERDICT_KEY = "mlplat.restart.verdict"  # in the round's store: node 0's verdict on the restart (`decided`)
ENDED_ELSEWHERE = "found the job ended by another node's agent (whose line says why)"  # where its ranks did not fail
JOIN_TIMEOUT_S = 600  # how long the agents wait for each other at a rendezvous (torch's default): a node lost whole


def node_rank() -> int | None:
    """This node's rank as the launcher set it (`NODE_RANK_ENVS`), None when none did."""
    value = next((os.environ[k] for k in NODE_RANK_ENVS if os.environ.get(k)), None)
    return None if value is None else int(value.strip())


def meeting_point(num_nodes: int) -> tuple[str, int, bool]:
    """(host, port, whether this process hosts the store) of the agents' rendezvous: this machine alone for one
    node; for K nodes node 0's MASTER_ADDR:MASTER_PORT (under SLURM, when unset: the job's first host and a port
    every task derives from the job id), hosted by node 0. A missing piece is a ConfigError naming the variable."""
    if num_nodes == 1:
        return "127.0.0.1", free_local_port(), True
    from mlplat.errors import ConfigError
    from mlplat.lightning.ports import port_for_job

    job = os.environ.get("SLURM_JOB_ID")
    asked = f"trainer.num_nodes={num_nodes} with trainer.max_restarts runs an elastic agent per node, meeting at node 0"
    rank = node_rank()
    if rank is None or not 0 <= rank < num_nodes:
        said = "is not set" if rank is None else f"is {rank}, not one of 0-{num_nodes - 1}"
        raise ConfigError(f"{asked}, but this node's rank {said}: set NODE_RANK (0 on the node that hosts the "
                          f"rendezvous; SLURM sets SLURM_NODEID)")
    host = os.environ.get("MASTER_ADDR") or _first_slurm_host()
    if not host:
        raise ConfigError(f"{asked}, but node 0's address is not set: set MASTER_ADDR (node 0's host name or address) "
                          f"and MASTER_PORT on every node")
    port = os.environ.get("MASTER_PORT") or (port_for_job(job) if job else None)
    if port is None:
        raise ConfigError(f"{asked} ({host}), but no port is set: set MASTER_PORT (the same free port on every node)")
    return host, int(port), rank == 0


def _first_slurm_host() -> str | None:
    """The first host of this SLURM job's node list (node 0 of its tasks), None outside SLURM."""
    if not os.environ.get("SLURM_JOB_NODELIST"):
        return None
    from submitit.slurm.slurm import SlurmJobEnvironment

    return SlurmJobEnvironment().hostnames[0]


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


def report(failures: dict[int, Any], done: int) -> dict:
    """What one node's agent saw of a failed group, as posted to the round's store: its failed rank (`describe`),
    ranked against the other nodes' by `cause_key`, and its restart count so far; no rank where none of its own
    failed (it restarts because another agent is waiting)."""
    if not failures:
        return {"rank": None, "done": done}
    rank, failure, why = describe(failures)
    return {"rank": rank, "pid": failure.pid, "why": why, "status": failure_status(failure.exitcode),
            "killed": failure.exitcode < 0, "raised": os.path.isfile(failure.error_file), "done": done}


def cause_key(seen: dict) -> tuple:
    """`describe`'s order across nodes: a rank killed by a signal first, then one that raised, else the lowest."""
    return not seen["killed"], not seen["raised"], seen["rank"]


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

    def __init__(self, line: str, status: int, say: bool = True):
        super().__init__(line)
        self.line, self.status, self.say = line, status, say  # say: this agent is the one that says the line


class Requeued(Exception):
    """A rank left with EXIT_REQUEUED: the group saved after a preemption notice and the job is requeued."""


class Unheard(Exception):
    """Not every agent's report (or node 0's verdict) came within its wait: an agent gone, or node 0's store."""

    def __init__(self, what: str, timeout_s: float):
        super().__init__(f"waited {timeout_s:g} s for every agent's report of the {what} and not all came")


@contextlib.contextmanager
def _waiting(store: Any, what: str, timeout_s: float):
    """The store's waits for `what` bounded by `timeout_s`, Unheard past it, and the store's own timeout back after
    (torch's waits use it; torch's `store_timeout` keeps the new one when a wait times out)."""
    from datetime import timedelta

    from torch.distributed import DistStoreError

    own = store.timeout
    store.set_timeout(timedelta(seconds=timeout_s))
    try:
        yield
    except DistStoreError as e:
        raise Unheard(what, timeout_s) from e
    finally:
        store.set_timeout(own)


def agree(store: Any, me: int, agents: int, mine: dict, what: str, timeout_s: float = VERDICT_WAIT_S) -> list[dict]:
    """Every agent's report of `what`, by node: each posts its own in the round's store and reads the others'; none
    leaves before all have read (node 0's agent hosts the store). Unheard when one does not come in `timeout_s`."""
    from torch.distributed.elastic.utils.store import barrier

    store.set(f"mlplat.{what}.{me}", json.dumps(mine))
    with _waiting(store, what, timeout_s):
        seen = [json.loads(store.get(f"mlplat.{what}.{i}")) for i in range(agents)]
        barrier(store, agents, key_prefix=f"mlplat.{what}.read", barrier_timeout=timeout_s)
    return seen


def decided(store: Any, me: int, decide: Callable[[], dict], timeout_s: float = VERDICT_WAIT_S) -> dict:
    """Node 0's `decide()`, as every agent reads it from the round's store: one answer where each node's own could
    differ (a shared file system's listing, stale or failing on one node). Unheard when it does not come."""
    if me == 0:
        store.set(VERDICT_KEY, json.dumps(decide()))
    with _waiting(store, "verdict", timeout_s):
        return json.loads(store.get(VERDICT_KEY))


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
    """In a forked rank: become this rank's Hydra job (its own job name and log file), then run `job(cfg)`."""
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    from mlplat.lightning.launcher import _as_rank_job

    rank = int(os.environ["RANK"])
    rank_zero_only.rank = rank
    if rank > 0:  # by global rank: on K nodes, local rank 1 of each would share one rank1.log in the run directory
        _as_rank_job(rank)
    job(cfg)


def _elastic_agent(cfg, run_dir: Path, job: Callable[[Any], None]):
    """torch's local elastic agent over the layout's ranks (forked, or new interpreters where forking is unsafe),
    saying each restart in one line and stopping a failed group at once, its loggers quieted."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from mlplat.checkpoint import CheckpointError
    from mlplat.checkpoint.io import find_last
    from mlplat.model.attention import device_type_for

    limit = cfg.trainer.max_restarts
    nodes = cfg.trainer.num_nodes
    first = cfg.ckpt_path

    class Agent(LocalElasticAgent):
        """torch's local agent, saying each restart in one line and stopping a failed group at once (SIGKILL: the
        survivors wait in a collective for the dead rank; a checkpoint is committed whole or not at all)."""

        failures: dict = {}  # this node's failed ranks of the group being restarted
        resumed_from: str | None = None  # what the last restart resumed: a restart from it again makes no progress
        seen: dict | None = None  # this node's report of the failure, posted once the agents have met again

        def _monitor_workers(self, worker_group):
            # The ranks that failed on their own, read before the others are stopped: torch names only the first
            # rank it finds dead, not necessarily the cause, and stops the others with SIGTERM (a line from each,
            # and up to 30 s); they wait in a collective for the dead rank, so SIGKILL them at once instead.
            causes = failed(self._pcontext, worker_group)
            self._end_without_restart(causes)
            if causes:
                kill_running(self._pcontext)
            elif nodes > 1 and worker_group.spec.rdzv_handler.is_closed():
                return self._ended_elsewhere(worker_group)
            result = super()._monitor_workers(worker_group)
            if result.failures:
                # Ranks that left between the read above and torch's own (a loaded machine): the same verdicts. Else
                # a group requeued after a preemption notice would be restarted, and the restart run to the end.
                self._end_without_restart(result.failures)
                result.failures = self.failures = causes or result.failures
            return result

        def _ended_elsewhere(self, worker_group) -> Any:
            """Another node's agent ended the job (no restart left, a refusal, a requeue) and closed the rendezvous:
            torch's loop only looks for agents waiting to join, and the ranks here would sit in collectives with
            the lost ones until their timeouts. Ranks leaving on their own (rank 0 saying a refusal, requeueing the
            job) get REFUSED_EXIT_WAIT_S; the rest are stopped and the group is over, failed."""
            wait_for_exit(self._pcontext, REFUSED_EXIT_WAIT_S)
            causes = failed(self._pcontext, worker_group)
            self._end_without_restart(causes)
            kill_running(self._pcontext)
            self.failures = causes
            return RunResult(state=WorkerState.FAILED, failures=causes)

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
            # torch lowered the count before restarting a failed group, not before a restart for a waiting agent
            self.seen = report(self.failures, limit - self._remaining_restarts)
            if nodes > 1:
                self.seen["node"] = node_rank()
            self.failures = {}
            super()._restart_workers(worker_group)

        def _assign_worker_ranks(self, store, group_rank, group_world_size, spec):
            # Node i runs ranks i·devices, ..., as SLURM numbers the tasks of one per rank: not the order the
            # rendezvous ranked the agents in (their host names, then process ids)
            return super()._assign_worker_ranks(store, self._node(group_rank), group_world_size, spec)

        def _node(self, group_rank: int) -> int:
            return group_rank if nodes == 1 else node_rank()

        def _rendezvous(self, worker_group) -> None:
            super()._rendezvous(worker_group)
            worker_group.group_rank = self._node(worker_group.group_rank)  # the ranks' GROUP_RANK, as torchrun's
            if self.seen is not None:  # a restart: every agent has posted its report on its way here
                self._restarting(worker_group.store, worker_group.group_rank, worker_group.group_world_size)

        def _restarting(self, store: Any, node: int, agents: int) -> None:
            """Every agent alike, from the same reports in the round's `store`: this restart's number (also counted
            by an agent that only saw another waiting), the failed rank; and node 0's verdict: the checkpoint to
            resume and whether that is progress. Node 0's agent says the line."""
            seen, self.seen = agree(store, node, agents, self.seen, "restart"), None
            done = max(r["done"] for r in seen)
            self._remaining_restarts = limit - done
            causes = [r for r in seen if r["rank"] is not None]
            cause = min(causes, key=cause_key) if causes else None
            where = "" if cause is None or nodes == 1 else f" on node {cause['node']}"
            who = (f"rank {cause['rank']} (pid {cause['pid']}{where}) {cause['why']}" if cause
                   else "another node's agent left the group")
            verdict = decided(store, node, self._verdict)
            resume, say = verdict["resume"], node == 0
            if verdict["again"]:  # nothing saved since the last restart
                raise NoProgress(f"mlplat: {who}, again before a new checkpoint: restart {done - 1} resumed {resume} "
                                 f"and committed none, and another would run the same steps again: stopping the job",
                                 cause["status"] if cause else 1, say)
            self.resumed_from = resume
            if say:
                print(f"mlplat: restart {done}/{limit}: {who}; every rank restarts from {resume}", file=sys.stderr,
                      flush=True)

        def _verdict(self) -> dict:
            """Node 0's: what the restart resumes (the run directory's last checkpoint, as the ranks find it) and
            whether that is again what the last restart resumed."""
            try:
                last = find_last(run_dir / "checkpoints")
            except CheckpointError:  # the restarted ranks refuse it in its one line
                last = "the run directory's last checkpoint"
            resume = str(last if last is not None else (first or "the start (no checkpoint committed yet)"))
            return {"resume": resume, "again": resume == self.resumed_from}

    # Their lines repeat ours at length, per rank; and multiprocessing's SIGTERM to a rank already SIGKILLed (above).
    for name in [*logging.root.manager.loggerDict, "torch.multiprocessing.spawn"]:  # each module's own logger
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing.spawn")):
            logging.getLogger(name).setLevel(logging.CRITICAL)

    if nodes > 1 and node_rank():  # node 0's agent keeps the run's log file, as rank 0 does (its ranks: rank<N>.log)
        from mlplat.lightning.environment import _close_file_logs

        _close_file_logs()
    device_type = device_type_for(cfg.trainer.accelerator)
    unsafe = fork_unsafe(device_type)
    os.environ[CHILD_ENV] = "1"  # the ranks are the launcher's: rank 0 holds no run lock of its own (this process does)
    if unsafe is None:
        entrypoint: Any = _rank_job
        args: tuple = (job, cfg)
        start_method = "fork"
    else:  # as torchrun starts them: the job's command line, each rank its own Hydra job name
        cmd, _ = hydra_job_command(0)
        name = "rank${local_rank}" if nodes == 1 else f"node{node_rank()}_rank${{local_rank}}"  # torch's one macro
        named = [a if not a.startswith("hydra.job.name=") else f"hydra.job.name={name}" for a in cmd[1:]]
        entrypoint, args = cmd[0], tuple(named)
        start_method = "spawn"
    host, port, hosts = meeting_point(nodes)
    # One node: a run of its own. K nodes: the same id on every node (a requeued SLURM job keeps its id, and its
    # agents meet in a new store).
    run_id = uuid.uuid4().hex if nodes == 1 else f"mlplat-{os.environ.get('SLURM_JOB_ID', 'job')}"
    rdzv = RendezvousParameters(backend="c10d", endpoint=f"{host}:{port}", run_id=run_id, min_nodes=nodes,
                                max_nodes=nodes, is_host=hosts, join_timeout=JOIN_TIMEOUT_S)
    spec = WorkerSpec(role="mlplat", local_world_size=cfg.trainer.devices, entrypoint=entrypoint, args=args,
                      rdzv_handler=get_rendezvous_handler(rdzv), max_restarts=limit, monitor_interval=0.5)
    # DIR/restarts/RUN_ID/attempt_K/RANK/error.json: a rank's exception, which the restart line quotes
    agent = Agent(spec, logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "restarts")), start_method=start_method)
    how = "forked from this process" if unsafe is None else f"started as new interpreters ({unsafe})"
    where = "" if nodes == 1 else f" on node {node_rank()} of {nodes}"
    log.info("trainer.max_restarts=%d: %d ranks%s %s under torch's elastic agent; rendezvous at %s:%d",
             limit, cfg.trainer.devices, where, how, host, port)
    return agent


def run_with_restarts(cfg, run_dir: Path, job: Callable[[Any], None]) -> None:
    """Run `job(cfg)` on every rank of the layout under an elastic agent that restarts the ranks up to
    `cfg.trainer.max_restarts` times. Returns when every rank finished; a failure beyond the limit (or a signal to
    this process) ends the process in one line with the failed rank's status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousError

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
        if e.say:
            print(e.line, file=sys.stderr, flush=True)
        sys.exit(e.status)
    except (RendezvousError, Unheard) as e:  # a node's agent gone: waited for in vain, or node 0's store lost
        _alone(_why_alone(e, cfg.trainer.num_nodes))
    finally:
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        os.environ.pop(CHILD_ENV, None)
        if cfg.trainer.num_nodes > 1:
            # The agents of the other nodes stop waiting for this one (a closed rendezvous), as under torchrun
            with contextlib.suppress(Exception):
                agent._rdzv_handler.shutdown()
    if result.is_failed():
        seen, say = _the_end(agent, result.failures, cfg.trainer.num_nodes)
        if seen is None:  # its ranks stopped for another node's agent's end (a refusal, a requeue), not heard after
            _alone(ENDED_ELSEWHERE)
        where = f" on node {seen['node']}" if cfg.trainer.num_nodes > 1 else ""
        if say:
            print(f"mlplat: rank {seen['rank']} (pid {seen['pid']}{where}) {seen['why']}; no restart left "
                  f"(trainer.max_restarts={limit} {'used' if limit else 'off'}): stopping the job", file=sys.stderr,
                  flush=True)
        sys.exit(seen["status"])


def _alone(why: str) -> None:
    """End this node's agent in one line: it cannot go on with the others (`why`)."""
    print(f"mlplat: node {node_rank()}'s agent {why}; every rank here stopped: stopping the job (ckpt_path=last, or a "
          f"requeue, continues from the latest checkpoint)", file=sys.stderr, flush=True)
    sys.exit(1)


def _why_alone(error: Exception, nodes: int) -> str:
    """Why an agent could not meet the others again, in a few words."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

    if isinstance(error, Unheard):
        return f"{error} (a node lost with its agent, or node 0's store)"
    if isinstance(error, RendezvousTimeoutError):
        return (f"waited {JOIN_TIMEOUT_S} s for the agents of trainer.num_nodes={nodes} and not all came (a node lost "
                f"with its agent)")
    if isinstance(error, RendezvousClosedError):
        return ENDED_ELSEWHERE
    return f"lost the rendezvous on node 0 ({type(error).__name__}: node 0's agent ended, or its node was lost)"


def _the_end(agent: Any, failures: dict, nodes: int) -> tuple[dict | None, bool]:
    """(the failed rank's report, whether this agent says it) when no restart is left: on K nodes the agents agree
    on the cause as for a restart, and node 0's agent says it; an agent that cannot hear from every other within
    VERDICT_WAIT_S says what it saw itself, None when none of its ranks failed."""
    mine = report(failures, 0)
    if nodes == 1:
        return mine, True
    mine["node"] = node_rank()
    group = agent._worker_group
    try:
        seen = agree(group.store, group.group_rank, group.group_world_size, mine, "end", VERDICT_WAIT_S)
    except Exception:  # noqa: BLE001 - an agent gone, or the store's host: say what this node saw
        return (None if mine["rank"] is None else mine), True
    return min((r for r in seen if r["rank"] is not None), key=cause_key, default=None), group.group_rank == 0
