"""The elastic agent's verdict on a group (`mlplat.lightning.restarts`), without ranks: a rank that leaves with the
requeue status (75) or a refusal (2) ends the job, also when it left between the agent's own read of the exit codes
and torch's (a loaded machine): then the group was restarted and ran to its end, exit 0 instead of 75."""
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
