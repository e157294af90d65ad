"""The elastic agent's verdict on a group (`mlplat.lightning.restarts`), without ranks: a rank that leaves with the
requeue status (75) or a refusal (2) ends the job, also when it left between the agent's own read of the exit codes
and torch's (a loaded machine): then the group was restarted and ran to its end, exit 0 instead of 75. On several
nodes the agents agree on one cause through the rendezvous store."""
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
