"""SubmititEnvironment and the requeue hook, from submitit's environment variables (local and SLURM jobs)."""
from __future__ import annotations

import pytest

_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "MLPLAT_LAUNCHED_RANK", "SLURM_RESTART_COUNT")


def test_submitit_environment_local_job(monkeypatch):
    import mlplat.lightning.environment as environment
    from mlplat.lightning.environment import SubmititEnvironment
    from mlplat.lightning.ports import PORT_BASE, PORT_SPAN, port_for_job

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


def test_a_local_runs_port_is_free_and_below_the_ephemeral_range():
    """What the launcher tells the ranks of a run on one machine (`free_local_port`): a port nothing holds, drawn
    where the OS does not hand ports to outgoing connections."""
    import socket

    from mlplat.lightning.ports import PORT_BASE, PORT_SPAN, free_local_port

    for _ in range(20):
        port = free_local_port()
        assert PORT_BASE <= port < PORT_BASE + PORT_SPAN < 32768
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", port))  # free: binds


def test_cpu_threads_share_only_the_cores_the_machine_leaves_free():
    """Each rank's torch threads: the cores shared out, fewer when other work loads the machine (spinning OpenMP
    threads on busy cores: docs/launching.md), said in a line when fewer; never below one."""
    from mlplat.lightning.strategy import cpu_threads

    assert cpu_threads(1, cores=2, load=0.1) == (2, "")
    assert cpu_threads(8, cores=2, load=0.0) == (1, "")  # one each at most anyway
    threads, why = cpu_threads(1, cores=2, load=7.99)
    assert threads == 1 and why == ("the machine's load 8.0 leaves 0.0 of 2 cores free; OMP_NUM_THREADS=N sets it")
    assert cpu_threads(2, cores=16, load=4.0) == (6, "the machine's load 4.0 leaves 12.0 of 16 cores free; "
                                                     "OMP_NUM_THREADS=N sets it")
