"""Signals through the CLI (`mlplat.lightning.signals`), on real gloo ranks started by mlplat's launcher.

1. SIGTERM to a 3D run (tp2·pp2(v2)·dp2, 8 processes), sent to the launching process or to one of its ranks:
   every rank is gone within 10 s, the exit status is 143, the output holds exactly one
   `mlplat: rank R got SIGTERM; stopping` line, no traceback and no hang report.
   Ctrl-C (SIGINT to every process of the job) on a run saving every step: exit status 130, one
   `mlplat: rank R got SIGINT; stopping` line, no traceback, and the checkpoint `ckpt_path=last` takes is intact;
   an earlier run's unfinished save (a `.partial` folder) was deleted when the run started.
2. The SLURM preemption notice (SIGUSR1, SLURM faked: SLURM_JOB_ID set, a fake `scontrol` first on PATH that
   records its arguments), sent to one rank of a 4-process run (pp2·dp2, float32, dropout 0.1): the ranks save
   `checkpoints/step-N` at a step end, `scontrol requeue 4242` runs once, the job exits 75; the requeued job
   (SLURM_RESTART_COUNT=1, no ckpt_path) resumes from it and its train_loss rows equal a straight run's, digit
   for digit; the same with `checkpoint.async_save=true` (the save written behind, committed before the requeue).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, read_metrics, run_train

pytestmark = pytest.mark.slow

TINY = ("model.n_layers=4", "model.hidden=32", "model.n_heads=4", "model.seq_len=32", "logger=none",
        "sample.max_new_tokens=0", "trainer.val_check_interval=1000")
THREE_D = ("parallel=3d_cpu", "parallel.micro_batch_size=1", "parallel.global_batch_size=4")  # t2·p2(v2)·d2, m=2
PP2_DP2 = ("parallel=single", "parallel.pp=2", "parallel.dp=2", "parallel.micro_batch_size=2",
           "parallel.global_batch_size=8", "model.dropout=0.1", "trainer.precision=32-true")
STOP_WITHIN_S = 10.0
EXACT_STEPS = 16


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited
    except (FileNotFoundError, IndexError):
        return False


class Run:
    """`python -m mlplat.train` in its own session, output to a file (a pipe could fill and block a rank)."""

    def __init__(self, run_dir: Path, *overrides: str, env: dict | None = None):
        self.run_dir, self.log = run_dir, run_dir.with_suffix(".out")
        cmd = [sys.executable, "-m", "mlplat.train", f"hydra.run.dir={run_dir}", *overrides]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "WANDB_MODE": "offline", **(env or {})},
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_rows(self, rows: int, timeout: float = 300) -> None:
        """Until metrics.csv holds `rows` steps (every rank is in the training loop)."""
        deadline = time.time() + timeout
        path = self.run_dir / "metrics.csv"
        while not (path.exists() and len(path.read_text().splitlines()) > rows):
            assert self.proc.poll() is None, f"the run ended early ({self.proc.returncode}):\n{self.output()[-3000:]}"
            assert time.time() < deadline, f"no {rows} steps within {timeout} s"
            time.sleep(0.1)

    def ranks(self) -> list[int]:
        """The launcher (rank 0) and the ranks it started, in local-rank order."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        children = [int(p) for p in out if "mlplat.train" in Path(f"/proc/{p}/cmdline").read_text()]
        return [self.proc.pid, *sorted(children, key=_started)]  # the launcher starts rank 1, 2, ... in turn

    def signal_and_wait(self, pid: int, signum: int, ranks: list[int], timeout: float = 120) -> float:
        """Send `signum` to `pid`; seconds until every rank is gone."""
        sent = time.time()
        os.kill(pid, signum)
        while self.proc.poll() is None or any(_alive(p) for p in ranks):
            assert time.time() - sent < timeout, f"ranks alive {timeout} s after the signal"
            time.sleep(0.02)
        return time.time() - sent

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _started(pid: int) -> tuple[int, int]:
    """When `pid` started (clock ticks since boot), then the pid: the order the launcher started its ranks in. (A
    forked rank's /proc/PID/environ still shows rank 0's environment, so LOCAL_RANK cannot be read there.)"""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19]), pid


@pytest.mark.parametrize("target", ["launcher", "rank"])
def test_sigterm_stops_every_rank_at_once_in_one_line(tmp_path, target):
    run = Run(tmp_path / "run", *THREE_D, *TINY, "trainer.max_steps=100000")
    try:
        run.wait_for_rows(2)
        ranks = run.ranks()
        assert len(ranks) == 8, ranks
        took = run.signal_and_wait(ranks[0] if target == "launcher" else ranks[5], signal.SIGTERM, ranks)
    finally:
        run.kill()
    out = run.output()
    print(f"SIGTERM to the {target}: every rank gone {took:.2f} s after the signal")
    assert took < STOP_WITHIN_S, f"{took:.1f} s"
    assert run.proc.returncode == 143, (run.proc.returncode, out[-3000:])
    lines = [line for line in out.splitlines() if "got SIGTERM" in line]
    assert lines == [f"mlplat: rank {0 if target == 'launcher' else 5} got SIGTERM; stopping"], lines
    assert "Traceback" not in out and " blocked " not in out and "peer died" not in out, out[-3000:]


def test_ctrl_c_exits_130_in_one_line_and_keeps_the_last_checkpoint(tmp_path):
    from mlplat.checkpoint.io import find_last, verify

    litter = tmp_path / "run" / "checkpoints" / "step-9.partial-0123abcd"  # an earlier run's unfinished save
    litter.mkdir(parents=True)
    run = Run(tmp_path / "run", "parallel=single", "parallel.pp=2", *TINY, "checkpoint.every_steps=1",
              "trainer.max_steps=100000")
    try:
        run.wait_for_rows(3)
        ranks = run.ranks()
        assert len(ranks) == 2, ranks
        sent = time.time()
        os.killpg(run.proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C: the whole job gets it
        while run.proc.poll() is None or any(_alive(p) for p in ranks):
            assert time.time() - sent < 60, "ranks alive 60 s after Ctrl-C"
            time.sleep(0.02)
    finally:
        run.kill()
    out = run.output()
    assert run.proc.returncode == 130, (run.proc.returncode, out[-3000:])
    assert len([line for line in out.splitlines() if "got SIGINT; stopping" in line]) == 1, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out and " s in " not in out, out[-3000:]  # a hang
    last = find_last(run.run_dir / "checkpoints")
    assert last is not None and verify(last)["step"] >= 1
    assert "removed 1 unfinished save of an earlier run: step-9.partial-0123abcd" in out and not litter.exists()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_preemption_notice_saves_requeues_and_the_requeue_resumes_exactly(tmp_path, async_save):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$FAKE_SCONTROL_LOG"\n')
    (fake / "scontrol").chmod(0o755)
    calls = tmp_path / "scontrol.log"
    slurm = {"SLURM_JOB_ID": "4242", "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
             "FAKE_SCONTROL_LOG": str(calls)}
    common = (*PP2_DP2, *TINY, f"trainer.max_steps={EXACT_STEPS}")

    straight = Run(tmp_path / "straight", *common)  # alongside the preempted job: their start-ups overlap
    # With async saves the notice's checkpoint is written behind the step and committed before the requeue.
    run = Run(tmp_path / "job", *common, f"checkpoint.async_save={str(async_save).lower()}", env=slurm)
    try:
        run.wait_for_rows(2)
        ranks = run.ranks()
        assert len(ranks) == 4, ranks
        took = run.signal_and_wait(ranks[3], signal.SIGUSR1, ranks)
        assert straight.proc.wait(timeout=600) == 0, straight.output()[-3000:]
    finally:
        run.kill()
        straight.kill()
    out = run.output()
    print(f"SIGUSR1 to rank 3: saved, requeued and every rank gone {took:.2f} s after the signal")
    assert run.proc.returncode == 75, (run.proc.returncode, out[-3000:])
    assert calls.read_text().splitlines() == ["requeue 4242"]
    assert "Traceback" not in out, out[-3000:]
    saved = sorted((run.run_dir / "checkpoints").glob("step-*"))
    assert len(saved) == 1, saved
    step = int(saved[0].name.split("-")[1])
    assert 2 <= step < EXACT_STEPS, step
    assert f"mlplat: SIGUSR1 (preemption notice) at step {step}" in out
    assert (f"checkpoint step-{step} saved: training blocked" in out) and ("written behind it" in out) == async_save

    # The requeued job: the same command, SLURM_RESTART_COUNT > 0 and no ckpt_path: it resumes from `last`.
    resumed = run_train(run.run_dir, *common, env={**slurm, "SLURM_RESTART_COUNT": "1"})
    assert f"step-{step}" in resumed.stdout + resumed.stderr
    want = {int(r["step"]): r["train_loss"] for r in read_metrics(straight.run_dir)}
    got = {int(r["step"]): r["train_loss"] for r in read_metrics(run.run_dir)}
    assert sorted(got) == list(range(1, EXACT_STEPS + 1))
    assert got == want  # float32 digits as written, bit for bit, after the resume as before it
    assert calls.read_text().splitlines() == ["requeue 4242"]  # the resumed run was not preempted
