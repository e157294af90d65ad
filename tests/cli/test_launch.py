"""Launch anywhere, for real: Hydra multirun, submitit_local, torchrun.

The CLI runs use a tiny model, 3 steps, no logger and no sample. On an idle 2-core machine the file takes about
a minute and a half; the four CLI runs are most of it. What the launchers are asked for (the child command, the
SLURM script) is tested without running anything in tests/lightning/test_launcher.py.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlplat.lightning.ports import PORT_BASE, PORT_SPAN
from tests.helpers.cli import REPO, read_metrics, read_wandb_run, run_module

# conf/hydra/launcher/submitit_*.yaml shadow the plugin's configs on purpose (train.py quiets this outside pytest)
pytestmark = pytest.mark.filterwarnings(r"ignore:\s*'hydra/launcher/submitit_\w+' is validated:UserWarning")

TINY = ["trainer.max_steps=3", "logger=none", "sample.max_new_tokens=0", "trainer.val_check_interval=50"]
TIMEOUT = 420


def _run(args: list[str], timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    for key in ("WORLD_SIZE", "LOCAL_RANK", "RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    if args[:2] == ["-m", "mlplat.train"]:  # forked from the preloaded server: the CLI without its imports
        proc = run_module(args[2:], env=env, timeout=timeout)
    else:  # torchrun: its workers are real processes of their own
        proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
                             f"\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def _steps(run_dir: Path) -> list[int]:
    return [int(r["step"]) for r in read_metrics(run_dir)]


# -- Hydra multirun with the basic launcher: one job after another in one process --------------------------------
@pytest.mark.slow
def test_local_multirun_one_job_dir_per_layout_no_nested_sweeps(tmp_path):
    # 2 ranks, then 1, then 2 again: the single-rank job must not inherit WORLD_SIZE/LOCAL_RANK from the first,
    # and the third must not find the first one's process group.
    sweep = tmp_path / "sweep"
    proc = _run(["-m", "mlplat.train", "-m", "parallel=tp2,single,pp2_interleaved", *TINY,
                 f"hydra.sweep.dir={sweep}"])
    out = proc.stdout + proc.stderr
    assert out.count("Launching 3 jobs locally") == 1, "a rank started a sweep of its own"
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "2", "multirun.yaml"]
    for num, ranks in (("0", 2), ("1", 1), ("2", 2)):
        job = sweep / num
        assert _steps(job) == [1, 2, 3], f"job {num}: one run, three steps"
        assert sorted(p.name for p in job.glob("rank*.log")) == (["rank1.log"] if ranks == 2 else [])
        assert not list(job.glob("*/multirun.yaml")) and not (job / "0").exists()
    assert "parallel=tp2" in (sweep / "0" / ".hydra" / "overrides.yaml").read_text()
    # The first job forks its rank; the third does not (this process has trained since: OpenMP after a fork).
    first = (sweep / "0" / "train.log").read_text()
    assert first.count("ranks 1-1 forked from rank 0") == 1
    # The rendezvous port of a local run is drawn below the ephemeral range (mlplat.lightning.ports).
    port = int(re.search(r"rendezvous at 127\.0\.0\.1:(\d+)", first).group(1))
    assert PORT_BASE <= port < PORT_BASE + PORT_SPAN, port
    assert "ranks 1-1 started as new interpreters (an earlier job of this process ran tensor work)" in \
        (sweep / "2" / "train.log").read_text()


@pytest.mark.slow
def test_multirun_points_share_one_wandb_group(tmp_path):
    """Each point of a sweep is its own W&B run, named from its overrides, in the group of the sweep."""
    sweep = tmp_path / "sweep"
    _run(["-m", "mlplat.train", "-m", "parallel=single", "seed=1,2", "trainer.max_steps=2", "logger=wandb",
          "sample.max_new_tokens=0", "trainer.val_check_interval=50", f"hydra.sweep.dir={sweep}"])
    runs = [read_wandb_run(sweep / num) for num in ("0", "1")]
    assert runs[0]["group"] == runs[1]["group"] == str(sweep)
    assert [r["config"]["seed"] for r in runs] == [1, 2]
    assert "seed=1" in runs[0]["name"].split(",") and "seed=2" in runs[1]["name"].split(",")


def test_a_refused_multirun_point_is_named_and_the_sweep_goes_on(tmp_path):
    """An invalid point is refused in one line that names its job and overrides, and the points after it still run
    (dry runs here); the sweep then ends with Hydra's own line for the first failed job and exit status 1."""
    sweep = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}  # as a user runs it (tests/conftest.py)
    proc = run_module(["-m", "parallel=single", "dry_run=true", "model.n_heads=5,4", f"hydra.sweep.dir={sweep}"],
                      env=env, timeout=TIMEOUT)
    line = ("error: job 0 (parallel=single,dry_run=True,model.n_heads=5): model.hidden=128 is not divisible by "
            "model.n_heads=5")
    assert proc.returncode == 1 and proc.stderr.count(line) == 2, proc.stderr[-3000:]  # as refused, and at the end
    assert "Traceback" not in proc.stderr and (sweep / "1" / "plan.json").exists()
    assert "Error executing job with overrides: ['parallel=single', 'dry_run=True', 'model.n_heads=5']" in proc.stderr


# -- submitit_local: every sweep point a submitit job, run for real -------------------------------------------------
@pytest.mark.slow
def test_submitit_local_sweep_one_task_per_rank(tmp_path):
    # trainer.devices=2 outside the sweep: submitit starts 2 tasks per job and SubmititEnvironment ranks them;
    # tp=1 is 2-way data parallel, tp=2 is 2-way tensor parallel.
    sweep = tmp_path / "sweep"
    _run(["-m", "mlplat.train", "-m", "hydra/launcher=submitit_local", "parallel=single", "trainer.devices=2",
          "parallel.tp=1,2", *TINY, f"hydra.sweep.dir={sweep}"])
    jobs = sorted(p.name for p in sweep.iterdir() if not p.name.startswith("."))
    assert jobs == ["0", "1", "multirun.yaml"]
    for num in ("0", "1"):
        job = sweep / num
        assert _steps(job) == [1, 2, 3]
        assert not list(job.glob("rank*.log")), "Lightning must start no process under submitit"
        assert (job / "train.log").read_text().count("Job completed successfully") == 1, "rank 0 only"
    folder = sweep / ".submitit"  # one folder, no literal `%j/` in it: each file named by its job
    assert all(p.is_file() for p in folder.iterdir()), sorted(p.name for p in folder.iterdir())
    job_ids = sorted(p.name.split("_")[0] for p in folder.glob("*_submitted.pkl"))
    assert len(job_ids) == 2
    for job_id in job_ids:  # two tasks per job, each the rank submitit says, both done
        for task in (0, 1):
            out = (folder / f"{job_id}_{task}_log.out").read_text()
            err = (folder / f"{job_id}_{task}_log.err").read_text()
            assert f"global_rank={task}(2)" in out and "Job completed successfully" in out, out[-3000:]
            assert "unrecognized arguments" not in err and "Traceback" not in err, err[-3000:]


@pytest.mark.slow
def test_submitit_local_one_task_rank0_starts_the_others(tmp_path):
    # tasks_per_node=1 for a 2-rank layout: the pitfall (Lightning re-running submitit's _submit.py) — rank 0
    # starts rank 1 from the job's Hydra overrides instead.
    sweep = tmp_path / "sweep"
    _run(["-m", "mlplat.train", "-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=1",
          "parallel=single", "parallel.tp=2", *TINY, f"hydra.sweep.dir={sweep}"])
    assert _steps(sweep / "0") == [1, 2, 3]
    assert (sweep / "0" / "rank1.log").exists()


# -- torchrun ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_torchrun_two_ranks(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                 "tests.helpers.group_at_exit", "parallel=single", "parallel.tp=2", *TINY, f"hydra.run.dir={run_dir}"])
    assert _steps(run_dir) == [1, 2, 3]
    # Each rank destroyed the group it made (Lightning's exit hook is not installed for ranks started outside it)
    said = proc.stdout + proc.stderr
    assert said.count("process group at exit: destroyed") == 2 and "at exit: initialized" not in said, said[-3000:]
    assert not list(run_dir.glob("rank*.log")), "torchrun started the ranks, Lightning must not"
    # The ranks join the store torchrun's agent serves on MASTER_PORT: no second server fails to bind there.
    assert "failed to bind" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
