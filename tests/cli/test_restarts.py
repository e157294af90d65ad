"""Restarts inside the job (`trainer.max_restarts`, torch's elastic agent): a rank killed with SIGKILL after a
checkpoint restarts every rank from it and the run continues as if nothing happened; a failure beyond the limit,
or any failure without restarts, ends the job in one line with the failed rank's status.

pp = 3 with m = p, float64 and dropout on: every rank's weights, optimizer and RNG streams come back from the
checkpoint; the restart that compares losses runs the three ranks as three nodes, one elastic agent each. A rank
dies on purpose through tests/helpers/dying_rank.py (`MLPLAT_TEST_DIE`).
"""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from mlplat.lightning.ports import free_local_port
from tests.helpers.cli import read_metrics, run_module, run_modules, run_train, train_losses
from tests.helpers.dist import run_distributed

pytestmark = pytest.mark.slow

RUN = ("parallel=single", "model.hidden=32", "model.n_heads=4", "model.seq_len=32", "parallel.micro_batch_size=1",
       "parallel.pp=3", "model.n_layers=3", "parallel.global_batch_size=3", "logger=none", "sample.max_new_tokens=0",
       "trainer.val_check_interval=1000", "trainer.precision=64-true", "model.dropout=0.1",
       "checkpoint.every_steps=2", "trainer.max_steps=6")
DYING = "tests.helpers.dying_rank"


def _with(*overrides: str) -> tuple[str, ...]:
    """RUN with `overrides` in place of the values RUN gives the same keys."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return (*(o for o in RUN if o.split("=", 1)[0] not in keys), *overrides)


def _dying(run_dir, die: str, *overrides: str, check: bool = True, env: dict | None = None):
    return run_train(run_dir, *_with(*overrides), module=DYING, env={"MLPLAT_TEST_DIE": die, **(env or {})},
                     check=check)


def test_restarts_that_cannot_work_are_refused_in_one_line(tmp_path):
    """Under torchrun or SLURM the ranks are that launcher's to restart; without saves there is nothing to restart
    from: one line each, before any process group."""
    proc = run_module([f"hydra.run.dir={tmp_path}", *_with("trainer.max_steps=1", "trainer.max_restarts=1")],
                      env={**os.environ, "WORLD_SIZE": "3"}, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: trainer.max_restarts=1 restarts ranks mlplat starts itself, but another launcher started this one: "
        "under torchrun use torchrun --max-restarts=N"), proc.stderr[-2000:]
    # checkpoint.every_steps=null on a fresh run resolves to 0 (no saves): a restart would start the run over.
    every = [o for o in RUN if not o.startswith("checkpoint.every_steps=")]
    proc = run_module([f"hydra.run.dir={tmp_path / 'fresh'}", *every, "trainer.max_restarts=1"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: trainer.max_restarts=1 needs checkpoint.every_steps > 0 (got 0): a restart resumes from the last "
        "checkpoint, and without saves it would train the run again from the start"), proc.stderr[-2000:]
    assert not (tmp_path / "fresh" / "metrics.csv").exists()
    # One agent per node, which meet at node 0: a node that knows neither its rank nor node 0's address cannot.
    proc = run_module([f"hydra.run.dir={tmp_path / 'nodes'}", *_with("trainer.num_nodes=3", "trainer.devices=1",
                                                                     "trainer.max_restarts=1")], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: trainer.num_nodes=3 with trainer.max_restarts runs an elastic agent per node, meeting at node 0, but "
        "this node's rank is not set: set NODE_RANK (0 on the node that hosts the rendezvous; SLURM sets "
        "SLURM_NODEID)"), proc.stderr[-2000:]


def _nodes(nodes: int, die: str) -> list[dict]:
    """The environment of each task of a SLURM job of `nodes` nodes, one task per node (faked: SLURM's variables and
    node 0's address and port, as a batch script exports them)."""
    port = str(free_local_port())
    return [{**os.environ, "MLPLAT_TEST_DIE": die, "SLURM_JOB_ID": "4243", "SLURM_JOB_NAME": "train",
             "SLURM_NTASKS": str(nodes), "SLURM_NNODES": str(nodes), "SLURM_NODEID": str(node),
             "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            for node in range(nodes)]


def test_a_killed_rank_restarts_every_node_and_the_losses_are_the_uninterrupted_runs(tmp_path, monkeypatch):
    """Three nodes of one rank each, started as SLURM starts one task per node: each task is its node's elastic agent
    and the three meet at node 0. Rank 1, node 1's, is SIGKILLed as it starts step 4 (step-2 committed): every node
    restarts from step-2, one line (node 0's agent's) says so, every agent ends with 0, and steps 1-6 lose nothing:
    float64 losses bit for bit those of a run on one node never interrupted."""
    straight = tmp_path / "straight"
    run_train(straight, *RUN)
    run_dir = tmp_path / "run"
    nodes = run_modules([f"hydra.run.dir={run_dir}", *_with("trainer.max_restarts=1", "logger=csv",
                                                            "trainer.num_nodes=3", "trainer.devices=1")],
                        _nodes(3, "1:4:0"), module=DYING)
    out = "".join(node.stdout + node.stderr for node in nodes)
    assert [node.returncode for node in nodes] == [0, 0, 0], out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("mlplat: restart")]
    assert len(lines) == 1 and lines[0] in nodes[0].stderr and re.fullmatch(
        rf"mlplat: restart 1/1: rank 1 \(pid \d+ on node 1\) was killed by SIGKILL; every rank restarts from "
        rf"{re.escape(str(run_dir / 'checkpoints' / 'step-2'))}", lines[0]), lines
    assert f"Restoring states from the checkpoint path at {run_dir / 'checkpoints' / 'step-2'}" in out
    assert "Traceback" not in out, out[-3000:]
    assert [int(r["step"]) for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert train_losses(run_dir) == train_losses(straight)  # repr() of float64 values: equal strings, equal bits
    # The restart count in the logger's hyper-parameters (W&B config, the CSV logger's hparams.yaml), per start.
    starts = sorted((run_dir / "lightning_logs").glob("version_*/hparams.yaml"))
    assert [re.search(r"^restarts: (\d+)$", p.read_text(), re.M).group(1) for p in starts] == ["0", "1"]
    # What a rank that torchrun's agent restarted (`torchrun --max-restarts`) resumes: the last committed checkpoint.
    from mlplat.train import resume_point

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume_point(None, run_dir) == str(run_dir / "checkpoints" / "step-6")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert resume_point(None, run_dir) is None


def test_sigterm_to_the_launcher_stops_every_rank_in_one_line(tmp_path):
    proc = _dying(tmp_path / "run", "2:2:0:term", "trainer.max_steps=100", "trainer.max_restarts=1", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 143, (proc.returncode, out[-3000:])
    assert [line for line in out.splitlines() if line.startswith("mlplat:")] == [
        "mlplat: the launcher got SIGTERM; every rank stopped"], out[-3000:]


def test_a_failure_beyond_the_limit_ends_the_job_in_one_line(tmp_path):
    """max_restarts=1: rank 1 killed at step 2 (nothing committed yet: the restart starts over), then rank 2 raises
    at step 2: no restart left, the job ends with that rank's status and its exception in one line."""
    proc = _dying(tmp_path / "run", "1:2:0,2:2:1:raise", "trainer.max_restarts=1",
                  check=False)
    out = proc.stdout + proc.stderr
    restarts = [line for line in out.splitlines() if line.startswith("mlplat: restart")]
    assert len(restarts) == 1 and restarts[0].endswith(
        "was killed by SIGKILL; every rank restarts from the start (no checkpoint committed yet)"), restarts
    assert proc.returncode == 1, (proc.returncode, out[-3000:])
    last = [line for line in out.splitlines() if line.startswith("mlplat: ")][-1]
    assert re.fullmatch(r"mlplat: rank 2 \(pid \d+\) exited with code 1 \(RuntimeError: rank 2 fails at step 2 on "
                        r"purpose\); no restart left \(trainer.max_restarts=1 used\): stopping the job", last), last


def test_a_restart_that_makes_no_progress_ends_the_job_in_one_line(tmp_path):
    """max_restarts=5 and rank 1 killed at step 2 of every start (a deterministic failure, before the first
    checkpoint at step 2 is committed): one restart from the start, and when the group fails again with no new
    checkpoint, the job stops with one line instead of restarting the same steps four more times."""
    proc = _dying(tmp_path / "run", "1:2:0,1:2:1,1:2:2", "trainer.max_restarts=5", check=False)
    out = proc.stdout + proc.stderr
    restarts = [line for line in out.splitlines() if line.startswith("mlplat: restart")]
    assert len(restarts) == 1, restarts
    last = [line for line in out.splitlines() if line.startswith("mlplat: ")][-1]
    assert re.fullmatch(r"mlplat: rank 1 \(pid \d+\) was killed by SIGKILL, again before a new checkpoint: restart 1 "
                        r"resumed the start \(no checkpoint committed yet\) and committed none, and another would run "
                        r"the same steps again: stopping the job", last), last
    assert proc.returncode == 128 + signal.SIGKILL, (proc.returncode, out[-3000:])


def test_without_restarts_a_killed_rank_ends_the_job_with_its_status(tmp_path):
    """max_restarts=0 (the default): the launcher's observer ends the job as before, with the killed rank's status
    (or rank 0's hang report of its dead peer, when it sees the closed connection first)."""
    proc = _dying(tmp_path / "run", "1:2:0", check=False)
    assert proc.returncode in (137, 3), (proc.returncode, proc.stderr[-3000:])
    assert "mlplat: restart" not in proc.stdout + proc.stderr


def _resume_where_rank_1_found_none(rank, world_size, root):
    from pathlib import Path

    from mlplat.checkpoint import io

    start = time.monotonic()
    try:
        io.same_resume(None if rank == 1 else Path(root) / "step-2")
    except io.CheckpointError as err:
        return str(err), time.monotonic() - start
    return "agreed", 0.0


def test_a_rank_that_finds_no_checkpoint_while_the_others_do_fails_at_once(tmp_path):
    """The strategy's first collective after the process group: every rank says what it resumes; a rank that found
    none while the others found one stops them all in one line at once, not after checkpoint.timeout_s."""
    out = run_distributed(_resume_where_rank_1_found_none, 3, str(tmp_path), timeout=120)
    lines = {line for line, _ in out}
    assert lines == {f"rank 1 found no checkpoint to resume while ranks 0, 2 resume {tmp_path.resolve() / 'step-2'}: "
                     "resume with ckpt_path=PATH (a path every rank sees)"}, lines
    assert max(took for _, took in out) < 10


def test_a_preemption_notice_to_the_launcher_saves_requeues_and_does_not_restart(tmp_path):
    """Under SLURM (faked: SLURM_JOB_ID and an `scontrol` that records its arguments) the notice reaches the
    launching process, the elastic agent: it passes it to the ranks, which save at a step end, requeue the job once
    and leave with 75; the agent ends the job with 75, no restart."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$FAKE_SCONTROL_LOG"\n')
    (fake / "scontrol").chmod(0o755)
    calls = tmp_path / "scontrol.log"
    env = {"SLURM_JOB_ID": "4242", "FAKE_SCONTROL_LOG": str(calls), "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    run_dir = tmp_path / "run"
    proc = _dying(run_dir, "1:3:0:notice", "trainer.max_steps=100", "trainer.max_restarts=1", env=env, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 75, (proc.returncode, out[-3000:])
    assert calls.read_text().splitlines() == ["requeue 4242"]
    assert "mlplat: restart" not in out and "Traceback" not in out, out[-3000:]
    saved = [p.name for p in (run_dir / "checkpoints").glob("step-*")]
    assert len(saved) == 2 and "step-2" in saved, saved  # the cadence's step-2, and the notice's
