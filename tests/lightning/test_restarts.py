"""The elastic agent's verdict on a group (`mlplat.lightning.restarts`), without ranks: a rank that leaves with the
requeue status (75) or a refusal (2) ends the job, also when it left between the agent's own read of the exit codes
and torch's (a loaded machine): then the group was restarted and ran to its end, exit 0 instead of 75. On several
nodes the agents agree on one cause and on node 0's verdict through the rendezvous store, and an agent whose
rendezvous another closed (the job's end) stops its ranks at once."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from mlplat.lightning import restarts
from mlplat.lightning.launcher import CHILD_ENV
from mlplat.lightning.signals import EXIT_REQUEUED


@pytest.mark.parametrize("status, verdict", [(EXIT_REQUEUED, restarts.Requeued),
                                             (restarts.EXIT_REFUSED, restarts.Refused)])
def test_a_rank_that_left_after_the_agents_own_read_still_ends_the_job(status, verdict, tmp_path, monkeypatch):
    monkeypatch.setenv(CHILD_ENV, "")  # the agent's builder sets it; restored after the test
    cfg = SimpleNamespace(trainer=SimpleNamespace(max_restarts=1, devices=2, num_nodes=1, accelerator="cpu"),
                          ckpt_path=None)
    agent = restarts._elastic_agent(cfg, tmp_path, lambda cfg: None)
    agent._pcontext = None  # no ranks: nothing to wait for
    monkeypatch.setattr(restarts, "failed", lambda pcontext, group: {})  # none had left at the agent's read
    left = {1: ProcessFailure(1, 4242, status, str(tmp_path / "none.json"))}  # torch's read, a moment later
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers",
                        lambda self, group: RunResult(state=WorkerState.FAILED, failures=left))
    with pytest.raises(verdict):
        agent._monitor_workers(SimpleNamespace(workers=[]))


def test_the_agents_of_several_nodes_agree_on_one_cause(tmp_path):
    """Each node's agent posts what it saw in the round's store and reads the others': every agent gets the same
    reports, and the cause they name is the rank killed by a signal, not the ranks that raised on losing it nor
    the agent whose ranks had not failed (it restarts because another waits)."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed import HashStore

    raised = tmp_path / "error.json"  # as torch's agent keeps a rank's exception
    raised.write_text(json.dumps({"message": {"message": "RuntimeError: Connection reset by peer",
                                              "extraInfo": {"py_callstack": "", "timestamp": "0"}}}))
    reports = [restarts.report({0: ProcessFailure(0, 11, 1, str(raised))}, 1),
               restarts.report({2: ProcessFailure(0, 12, -9, str(tmp_path / "none.json"))}, 1),
               restarts.report({}, 0)]
    store = HashStore()
    with ThreadPoolExecutor(3) as agents:
        seen = list(agents.map(lambda i: restarts.agree(store, i, 3, reports[i], "restart", 10), range(3)))
    assert seen == [reports] * 3
    cause = min((r for r in seen[0] if r["rank"] is not None), key=restarts.cause_key)
    assert (cause["rank"], cause["status"], cause["why"]) == (2, 137, "was killed by SIGKILL")
    assert reports[0]["why"] == "exited with code 1 (RuntimeError: Connection reset by peer)"


class _Rendezvous:
    """The part of a c10d rendezvous handler the agent reads between meetings."""

    def __init__(self, closed: bool = False):
        self.closed = closed

    def get_run_id(self) -> str:
        return "test"

    def is_closed(self) -> bool:
        return self.closed


def _node_agent(monkeypatch, tmp_path, rdzv: _Rendezvous, last=None, nodes: int = 3, limit: int = 3):
    """A node's agent of `nodes` (node 0's environment; no store: `rdzv` stands for the rendezvous) whose listing of
    the run directory's checkpoints answers `last()`."""
    import torch.distributed.elastic.rendezvous.registry as registry

    from mlplat.checkpoint import io

    for key, value in {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", CHILD_ENV: ""}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(registry, "get_rendezvous_handler", lambda params: rdzv)
    monkeypatch.setattr(restarts, "fork_unsafe", lambda device_type: None)
    monkeypatch.setattr(io, "find_last", last or (lambda root: None))  # bound by the agent as it is built
    cfg = SimpleNamespace(trainer=SimpleNamespace(max_restarts=limit, devices=1, num_nodes=nodes, accelerator="cpu"),
                          ckpt_path=None)
    return restarts._elastic_agent(cfg, tmp_path, lambda cfg: None)


@pytest.mark.parametrize("node0", ["step-2", "step-4"])
def test_node_0_decides_whether_a_restart_makes_progress_for_every_node(node0, tmp_path, monkeypatch, capsys):
    """Restart 1 resumed step-2; rank 1 (node 1) is killed again. Each node's listing of the checkpoints differs (a
    shared file system's, stale on one node, failing on another): every agent takes node 0's verdict, all stop with
    the killed rank's status (node 0's agent alone says why) where node 0 finds step-2 again, all restart from step-4
    (one line) where node 0 finds it."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed import HashStore, PrefixStore

    from mlplat.checkpoint import CheckpointError

    def refused(root):
        raise CheckpointError("unreadable")

    listings = [lambda root: root / node0, lambda root: root / "step-4", refused]
    agents = [_node_agent(monkeypatch, tmp_path, _Rendezvous(), last) for last in listings]
    killed = restarts.report({1: ProcessFailure(0, 12, -9, str(tmp_path / "none.json"))}, 2)
    for node, agent in enumerate(agents):
        agent.resumed_from = str(tmp_path / "checkpoints" / "step-2")
        agent.seen = {**(killed if node == 1 else restarts.report({}, 1)), "node": node}
    store = PrefixStore("round-2", HashStore())

    def restart(node: int):
        try:
            agents[node]._restarting(store, node, 3)
        except restarts.NoProgress as e:
            return e.line, e.status, e.say
        return agents[node].resumed_from, agents[node]._remaining_restarts

    with ThreadPoolExecutor(3) as pool:
        verdicts = list(pool.map(restart, range(3)))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mlplat:")]
    if node0 == "step-2":
        assert [v[1:] for v in verdicts] == [(137, True), (137, False), (137, False)]
        assert len({v[0] for v in verdicts}) == 1 and verdicts[0][0].startswith(
            "mlplat: rank 1 (pid 12 on node 1) was killed by SIGKILL, again before a new checkpoint: restart 1 "
        ), verdicts
    else:
        assert verdicts == [(str(tmp_path / "checkpoints" / "step-4"), 1)] * 3
        assert lines == [f"mlplat: restart 2/3: rank 1 (pid 12 on node 1) was killed by SIGKILL; every rank restarts "
                         f"from {tmp_path / 'checkpoints' / 'step-4'}"]


def test_an_agent_that_does_not_hear_every_other_ends_in_one_line(monkeypatch):
    """An agent gone before its report (or node 0's verdict): the others' waits end as Unheard (the one-line end),
    not as the store's own error; the rendezvous store's own timeout (torch's waits) is as it was."""
    from torch.distributed import HashStore, PrefixStore

    store = PrefixStore("round-1", HashStore())
    with pytest.raises(restarts.Unheard, match="waited 0.1 s for every agent's report of the restart"):
        restarts.agree(store, 0, 2, {"rank": None, "done": 1}, "restart", 0.1)
    with pytest.raises(restarts.Unheard, match="report of the verdict"):
        restarts.decided(store, 1, dict, 0.1)
    assert store.timeout.total_seconds() == 300


@pytest.mark.parametrize("exit_code", [None, restarts.EXIT_REQUEUED])
def test_an_agent_whose_rendezvous_another_closed_stops_its_ranks(exit_code, tmp_path, monkeypatch):
    """No restart left on another node: its agent closed the rendezvous. This one stops its rank (in a collective
    with the lost ones: it would wait for their timeouts) and ends the group, failed, at its next look; a rank
    leaving on its own with a status (rank 0 requeueing the job) leaves with it first."""
    import subprocess
    import sys

    agent = _node_agent(monkeypatch, tmp_path, _Rendezvous(closed=True))
    monkeypatch.setattr(restarts, "REFUSED_EXIT_WAIT_S", 0.2 if exit_code is None else 30)
    code = "import sys, time; time.sleep(60 if sys.argv[1] == 'None' else 0.3); sys.exit(int(sys.argv[1]))"
    rank = subprocess.Popen([sys.executable, "-c", code, str(exit_code)])
    agent._pcontext = SimpleNamespace(subprocess_handlers={0: SimpleNamespace(proc=rank)}, pids=lambda: {0: rank.pid},
                                      error_files={0: str(tmp_path / "none.json")})
    group = SimpleNamespace(spec=SimpleNamespace(rdzv_handler=agent._rdzv_handler),
                            workers=[SimpleNamespace(global_rank=2)])
    try:
        if exit_code is None:
            result = agent._monitor_workers(group)
            # not a cause: the failing node's report names it (`_the_end`)
            assert (result.state, result.failures, rank.wait(5)) == (WorkerState.FAILED, {}, -9)
        else:
            with pytest.raises(restarts.Requeued):
                agent._monitor_workers(group)
            assert rank.returncode == exit_code
    finally:
        rank.kill()
        rank.wait()


def test_at_the_end_the_agents_agree_on_the_cause_or_end_as_ended_elsewhere(tmp_path, monkeypatch):
    """No restart left: the agents (node 1's rank killed, the others' stopped when they found the rendezvous closed)
    agree on node 1's rank and node 0's agent says it. An agent none of whose ranks failed that hears not every other
    has no cause of its own to say: None (its line: the job ended by another node's agent)."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed import HashStore, PrefixStore

    def agent(node: int, store):
        return SimpleNamespace(_worker_group=SimpleNamespace(store=store, group_rank=node, group_world_size=3))

    store = PrefixStore("round-3", HashStore())
    failures = [{}, {1: ProcessFailure(0, 12, -9, str(tmp_path / "none.json"))}, {}]
    with ThreadPoolExecutor(3) as pool:
        ends = list(pool.map(lambda node: restarts._the_end(agent(node, store), failures[node], 3), range(3)))
    assert [(seen["rank"], seen["status"], say) for seen, say in ends] == [(1, 137, True), (1, 137, False),
                                                                         (1, 137, False)]
    monkeypatch.setattr(restarts, "VERDICT_WAIT_S", 0.1)
    assert restarts._the_end(agent(0, PrefixStore("round-4", HashStore())), {}, 3) == (None, True)
