"""Launch anywhere: Hydra multirun, submitit (local for real, SLURM rendered without submitting), torchrun.

The CLI runs use a tiny model, 3 steps, no logger and no sample. On an idle 2-core machine the file takes about
a minute and a half; the four CLI runs are most of it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, read_metrics, read_wandb_run

# conf/hydra/launcher/submitit_*.yaml shadow the plugin's configs on purpose (train.py quiets this outside pytest)
pytestmark = pytest.mark.filterwarnings(r"ignore:\s*'hydra/launcher/submitit_\w+' is validated:UserWarning")

TINY = ["trainer.max_steps=3", "logger=none", "sample.max_new_tokens=0", "trainer.val_check_interval=50"]
TIMEOUT = 420


def _run(args: list[str], timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    for key in ("WORLD_SIZE", "LOCAL_RANK", "RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
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


def test_child_command_is_one_more_rank_of_the_same_job(tmp_path):
    """What a spawned rank runs: the job's own overrides, the job's directory, no sweep/launcher settings."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    import mlplat.train  # noqa: F401  (resolvers)
    from mlplat.lightning.launcher import hydra_job_command

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", ["parallel.tp=2", "hydra/launcher=submitit_local", f"hydra.sweep.dir={tmp_path}",
                                 "+hydra.job.env_set.FOO=1"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path / "0 with space")
        cfg.hydra.job.name = "train"
    HydraConfig.instance().set_config(cfg)
    try:
        cmd, cwd = hydra_job_command(1)
    finally:
        HydraConfig.instance().cfg = None
    assert cmd[:3] == [sys.executable, "-m", "mlplat.train"] and "-m" not in cmd[3:] and "--multirun" not in cmd
    assert "parallel.tp=2" in cmd and "+hydra.job.env_set.FOO=1" in cmd
    assert not any("launcher" in c or "hydra.sweep" in c for c in cmd)
    assert f"hydra.run.dir='{tmp_path / '0 with space'}'" in cmd
    assert "hydra.job.name=rank1" in cmd and "hydra.output_subdir=null" in cmd
    assert cwd == cfg.hydra.runtime.cwd


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
    job_folders = [d for d in (sweep / ".submitit").iterdir() if list(d.glob("*_submitted.pkl"))]
    assert len(job_folders) == 2
    for folder in job_folders:  # two tasks per job, each the rank submitit says, both done
        for task in (0, 1):
            out = (folder / f"{folder.name}_{task}_log.out").read_text()
            err = (folder / f"{folder.name}_{task}_log.err").read_text()
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


# -- submitit_slurm: the gpt1t job as SLURM would get it, without a cluster ----------------------------------------
def _compose(overrides):
    from hydra import compose, initialize_config_dir

    import mlplat.train  # noqa: F401  (registers the ${mlplat.*} resolvers the launcher configs use)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides, return_hydra_config=True)


def test_gpt1t_on_slurm_asks_for_384_nodes_of_8_tasks():
    from mlplat.lightning.launcher import slurm_sbatch_script

    cfg = _compose(["experiment=gpt1t", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=batch",
                    "hydra.launcher.account=proj42", "hydra.launcher.timeout_min=720",
                    "hydra.launcher.setup=['export SLURM_CPU_BIND=none']"])
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (384, 8, 8)
    assert launcher.nodes * launcher.tasks_per_node == 3072 == 8 * 64 * 6
    script = slurm_sbatch_script(launcher)
    for line in ("#SBATCH --nodes=384", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --time=720", "#SBATCH --partition=batch", "#SBATCH --account=proj42",
                 "#SBATCH --signal=USR2@120", "export SLURM_CPU_BIND=none", "export SUBMITIT_EXECUTOR=slurm"):
        assert line in script, f"{line!r} not in\n{script}"
    srun = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    assert len(srun) == 1 and "-m submitit.core._submit" in srun[0]


def test_slurm_refuses_more_ranks_per_node_than_gpus():
    from omegaconf.errors import InterpolationResolutionError

    cfg = _compose(["experiment=gpt1t", "hydra/launcher=submitit_slurm", "trainer.num_nodes=1",
                    "trainer.devices=null"])
    with pytest.raises(InterpolationResolutionError, match="exceed cluster.gpus_per_node=8"):
        _ = cfg.hydra.launcher.tasks_per_node


def test_submitit_local_tasks_follow_the_layout():
    cfg = _compose(["hydra/launcher=submitit_local", "parallel=3d_cpu"])
    assert (cfg.hydra.launcher.nodes, cfg.hydra.launcher.tasks_per_node, cfg.hydra.launcher.gpus_per_node) == (1, 8, 0)
    cfg = _compose(["hydra/launcher=submitit_local", "parallel=single", "trainer.devices=2"])
    assert cfg.hydra.launcher.tasks_per_node == 2


# -- SubmititEnvironment and the requeue hook, from submitit's environment variables -------------------------------
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "MLPLAT_LAUNCHED_RANK", "SLURM_RESTART_COUNT")


def test_submitit_environment_local_job(monkeypatch):
    import mlplat.lightning.environment as environment
    from mlplat.lightning.environment import PORT_BASE, PORT_SPAN, SubmititEnvironment, port_for_job

    closed = []  # ranks other than 0 stop writing the job's train.log (their stdout/stderr stay)
    monkeypatch.setattr(environment, "_close_file_logs", lambda: closed.append(True))
    for key in _LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    for key, value in (("JOB_ID", "4242"), ("NTASKS", "2"), ("GLOBALID", "1"), ("LOCALID", "1"), ("NODEID", "0"),
                       ("JOB_NUM_NODES", "1")):
        monkeypatch.setenv(f"SUBMITIT_LOCAL_{key}", value)
    assert SubmititEnvironment.detect()
    env = SubmititEnvironment()
    assert closed == [True]
    assert env.creates_processes_externally
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (2, 1, 1, 0)
    assert env.main_address == "127.0.0.1"
    assert env.main_port == port_for_job("4242") and PORT_BASE <= env.main_port < PORT_BASE + PORT_SPAN
    env.set_world_size(2)
    env.validate_settings(num_devices=2, num_nodes=1)
    with pytest.raises(ValueError, match="needs 4 ranks but submitit started 2 tasks"):
        env.set_world_size(4)
    monkeypatch.setenv("MLPLAT_LAUNCHED_RANK", "1")  # a rank our launcher started: not submitit's business
    assert not SubmititEnvironment.detect()
    monkeypatch.delenv("MLPLAT_LAUNCHED_RANK")
    monkeypatch.setenv("SUBMITIT_LOCAL_NTASKS", "1")  # one task: Lightning's own launcher starts the ranks
    assert not SubmititEnvironment.detect()


def test_submitit_environment_slurm_job_and_requeue(monkeypatch):
    import mlplat.lightning.environment as environment
    from mlplat.lightning.environment import SubmititEnvironment, resume_ckpt_path

    monkeypatch.setattr(environment, "_close_file_logs", lambda: None)

    for key in _LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    for key, value in (("SUBMITIT_EXECUTOR", "slurm"), ("SLURM_JOB_ID", "977"), ("SLURM_NTASKS", "16"),
                       ("SLURM_JOB_NUM_NODES", "2"), ("SLURM_NODEID", "1"), ("SLURM_PROCID", "9"),
                       ("SLURM_LOCALID", "1"), ("SLURM_JOB_NODELIST", "gpu[003-004]")):
        monkeypatch.setenv(key, value)
    env = SubmititEnvironment()
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (16, 9, 1, 1)
    assert env.main_address == "gpu003"
    env.validate_settings(num_devices=8, num_nodes=2)
    assert resume_ckpt_path(None) is None  # first run
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued after preemption / time limit
    assert resume_ckpt_path(None) == "last"
    assert resume_ckpt_path("/ckpts/step-100") == "/ckpts/step-100"


# -- torchrun ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_torchrun_two_ranks(tmp_path):
    run_dir = tmp_path / "run"
    _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "mlplat.train",
          "parallel=single", "parallel.tp=2", *TINY, f"hydra.run.dir={run_dir}"])
    assert _steps(run_dir) == [1, 2, 3]
    assert not list(run_dir.glob("rank*.log")), "torchrun started the ranks, Lightning must not"
