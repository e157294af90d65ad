"""What the launchers are asked for, without running anything: the command of a rank our launcher starts, the
submitit SLURM job of the gpt1t experiment (rendered, not submitted), submitit_local's tasks per layout.

The runs themselves (Hydra multirun, submitit_local, torchrun) are in tests/cli/test_launch.py.
"""
from __future__ import annotations

import sys

import pytest

from tests.helpers.paths import REPO

# conf/hydra/launcher/submitit_*.yaml shadow the plugin's configs on purpose (train.py quiets this outside pytest)
pytestmark = pytest.mark.filterwarnings(r"ignore:\s*'hydra/launcher/submitit_\w+' is validated:UserWarning")


# -- the command of a rank our launcher starts -------------------------------------------------------------------
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


def test_a_forked_rank_becomes_its_own_hydra_job_without_composing(tmp_path):
    """What `rank_job` runs under in a forked rank: rank 0's composed job renamed `rank<N>` (logging to rank<N>.log
    in the job's directory), a run without a `.hydra/` of its own, and no composition (GlobalHydra stays unset)."""
    import json
    import logging
    import os

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from mlplat.lightning.launcher import _as_rank_job

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", ["parallel.tp=2", "hydra.mode=MULTIRUN"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path)
        cfg.hydra.job.name = "train"
    HydraConfig.instance().set_config(cfg)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports what it became, then leaves without running pytest's teardown
        try:
            _as_rank_job(3)
            hc = HydraConfig.get()
            logging.getLogger("mlplat").warning("from rank 3")
            files = [h.baseFilename for h in logging.getLogger().handlers if hasattr(h, "baseFilename")]
            os.write(write, json.dumps([hc.job.name, hc.output_subdir, str(hc.mode), hc.run.dir, files,
                                        GlobalHydra.instance().is_initialized()]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        name, subdir, mode, run_dir, files, composed = json.loads(pipe.read())
    os.waitpid(pid, 0)
    HydraConfig.instance().cfg = None
    assert (name, subdir, mode, run_dir) == ("rank3", None, "RunMode.RUN", str(tmp_path))
    assert files == [str(tmp_path / "rank3.log")] and "from rank 3" in (tmp_path / "rank3.log").read_text()
    assert not composed



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


def test_with_restarts_slurm_runs_one_task_per_node_its_agent():
    """trainer.max_restarts > 0: one task per node, the node's elastic agent, with the node's GPUs; it starts the
    node's ranks itself (mlplat.lightning.restarts). submitit_local likewise: one task, the layout's GPUs."""
    from mlplat.lightning.launcher import slurm_sbatch_script

    cfg = _compose(["experiment=gpt1t", "hydra/launcher=submitit_slurm", "trainer.max_restarts=2"])
    launcher = cfg.hydra.launcher
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (384, 1, 8)
    script = slurm_sbatch_script(launcher)
    assert "#SBATCH --ntasks-per-node=1" in script and "#SBATCH --gpus-per-node=8" in script, script
    cfg = _compose(["hydra/launcher=submitit_local", "parallel=3d_cpu", "trainer=gpu", "trainer.max_restarts=1"])
    assert (cfg.hydra.launcher.tasks_per_node, cfg.hydra.launcher.gpus_per_node) == (1, 8)


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


# -- how a rank is started: forked on CPU, a new interpreter elsewhere ---------------------------------------------
def test_ranks_fork_only_on_cpu_before_any_training(monkeypatch):
    from mlplat.lightning.launcher import FORK_ENV, HydraSafeLauncher, fork_unsafe

    monkeypatch.setattr(HydraSafeLauncher, "trained_here", False)
    monkeypatch.delenv(FORK_ENV, raising=False)
    assert fork_unsafe("cpu") is None
    assert fork_unsafe("cuda") == "cuda devices"
    monkeypatch.setenv(FORK_ENV, "0")
    assert fork_unsafe("cpu") == f"{FORK_ENV}=0"
    monkeypatch.delenv(FORK_ENV)
    monkeypatch.setattr(HydraSafeLauncher, "trained_here", True)
    assert "earlier job" in fork_unsafe("cpu")


def test_a_forked_rank_reports_its_exit_like_popen():
    """The observer and the reaper read a forked rank through poll/wait/returncode/kill, as they read a Popen."""
    import os
    import signal
    import subprocess
    import time

    from mlplat.lightning.launcher import _ForkedRank

    pid = os.fork()
    if pid == 0:
        os._exit(3)
    done = _ForkedRank(pid)
    assert done.wait(timeout=30) == 3 and done.poll() == 3
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    running = _ForkedRank(pid)
    assert running.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        running.wait(timeout=0.1)
    running.kill()
    assert running.wait(timeout=30) == -signal.SIGKILL
    running.kill()  # gone already: no error


def test_a_failed_rank_ends_rank_0_with_that_ranks_status(monkeypatch, capsys):
    """Rank 0 ends with the failed rank's own code (3: a hang report) or 128 + N for a rank killed by signal N,
    after killing the others: not with Lightning's SIGKILL of rank 0 itself (137, read as the OOM killer)."""
    import os

    from mlplat.lightning import launcher

    class Rank:
        def __init__(self, code):
            self.returncode, self.pid, self.killed = code, 4242, False

        def poll(self):
            return self.returncode

        def kill(self):
            self.killed = True

    exits = []
    monkeypatch.setattr(launcher.os, "_exit", exits.append)
    for code, status in ((3, 3), (-9, 137)):
        running = Rank(None)
        launcher._Observer(main_pid=os.getpid(), child_processes=[Rank(code), running])._run()
        assert exits[-1] == status and running.killed
        how = "was killed by SIGKILL" if code < 0 else f"exited with code {code}"
        assert (f"mlplat: rank 1 (pid 4242) {how}; stopping every rank (ckpt_path=last continues from the latest "
                f"checkpoint)") in capsys.readouterr().err


def test_the_rank_killed_by_a_signal_is_the_one_reported(monkeypatch, capsys):
    """When a rank is killed, its peers exit 3 reporting its death: the job's status is the killed rank's."""
    import os

    from mlplat.lightning import launcher

    class Rank:
        def __init__(self, code, pid):
            self.returncode, self.pid = code, pid

        def poll(self):
            return self.returncode

        def kill(self):
            pass

    exits = []
    monkeypatch.setattr(launcher.os, "_exit", exits.append)
    launcher._Observer(main_pid=os.getpid(), child_processes=[Rank(3, 11), Rank(-9, 12), Rank(3, 13)])._run()
    assert exits == [137] and "rank 2 (pid 12) was killed by SIGKILL" in capsys.readouterr().err


def test_rank_zero_losing_a_peer_names_the_dead_rank_not_its_neighbour(monkeypatch, capsys):
    """Rank 0 sees a closed connection before the dead rank's exit status arrives, and from its neighbour (at pp = 3
    the live rank between it and the dead one, which exits 3 reporting the death): `blame` waits for the status and
    names the rank killed; with no child failed it returns (rank 0's own report follows)."""
    import os

    from mlplat.lightning import launcher

    class Rank:
        def __init__(self, codes, pid):
            self.codes, self.pid, self.returncode = list(codes), pid, None

        def poll(self):
            if self.codes:
                self.returncode = self.codes.pop(0)
            return self.returncode

        def kill(self):
            pass

    exits = []
    monkeypatch.setattr(launcher.os, "_exit", exits.append)
    # rank 1 has reported the death already; rank 2's SIGKILL status comes a few polls later
    launcher._Observer(main_pid=os.getpid(), child_processes=[Rank([3], 11), Rank([None] * 5 + [-9], 12)]).blame(2.0)
    assert exits == [137]
    assert "mlplat: rank 2 (pid 12) was killed by SIGKILL; stopping every rank" in capsys.readouterr().err
    # only a rank that exited on its own: named once the wait is over
    launcher._Observer(main_pid=os.getpid(), child_processes=[Rank([1], 11), Rank([None], 12)]).blame(0.3)
    assert exits == [137, 1] and "rank 1 (pid 11) exited with code 1" in capsys.readouterr().err
    # nobody failed: back to the caller
    launcher._Observer(main_pid=os.getpid(), child_processes=[Rank([None], 11)]).blame(0.2)
    assert exits == [137, 1] and capsys.readouterr().err == ""
