"""One run at a time per run directory (mlplat.run_lock): a second run there is refused in one line, before it
starts anything; the ranks of the run that holds it do not refuse themselves."""
from __future__ import annotations

import fcntl
import os

import pytest

from mlplat.errors import ConfigError
from mlplat.run_lock import LOCK_FILE, run_dir_lock
from tests.helpers.cli import run_train


@pytest.fixture
def held(tmp_path):
    """The run directory, locked by this process as a running run's launching process would hold it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / LOCK_FILE, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.write("pid 4242 on node7\n")
        f.flush()
        yield run_dir


def test_a_run_directory_in_use_is_refused_in_one_line(held):
    proc = run_train(held, "parallel=single", "logger=none", "sample.max_new_tokens=0", "trainer.max_steps=1",
                     check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: hydra.run.dir={held} is in use by another run (pid 4242 on node7): wait for it to end, or choose "
        f"another hydra.run.dir")
    assert "Traceback" not in proc.stderr and not (held / "metrics.csv").exists()


def test_only_the_process_that_owns_the_run_takes_the_lock(held, monkeypatch):
    """A rank that mlplat's launcher started (MLPLAT_LAUNCHED_RANK) or a rank other than 0 of torchrun or srun
    runs inside the held directory; rank 0 of an external launcher is refused."""
    from mlplat.lightning.launcher import CHILD_ENV

    for key in (CHILD_ENV, "RANK", "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID"):
        monkeypatch.delenv(key, raising=False)
    for env in ({CHILD_ENV: "1"}, {"RANK": "3"}, {"SLURM_PROCID": "1"}):
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            with run_dir_lock(held):
                pass
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="is in use by another run"), run_dir_lock(held):
        pass


def test_a_requeued_slurm_job_takes_over_the_lock_its_lost_node_left(held, monkeypatch, caplog):
    """After a node loss the lock on a shared file system outlives its holder until the lease ends: the same SLURM job
    requeued (its id, a restart count) takes the directory over with a warning; another job is still refused."""
    import logging

    for key in ("RANK", "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID"):
        monkeypatch.delenv(key, raising=False)
    (held / LOCK_FILE).write_text("pid 4242 on node7, SLURM job 777\n")  # the holder's record, as a run writes it
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")  # not requeued: another run of the job's, refused
    with pytest.raises(ConfigError, match=r"in use by another run \(pid 4242 on node7, SLURM job 777\)"):
        with run_dir_lock(held):
            pass
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with caplog.at_level(logging.WARNING, logger="mlplat"), run_dir_lock(held):
        pass
    assert "still locked by this SLURM job's previous run (pid 4242 on node7, SLURM job 777)" in caplog.text
    monkeypatch.setenv("SLURM_JOB_ID", "778")  # another job
    with pytest.raises(ConfigError, match="is in use by another run"), run_dir_lock(held):
        pass


def test_the_lock_is_released_when_the_run_ends(tmp_path):
    with run_dir_lock(tmp_path):
        with pytest.raises(ConfigError):  # a second holder, even in this process (another open file)
            with run_dir_lock(tmp_path):
                pass
    with run_dir_lock(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} on ")


def test_a_process_forked_from_the_run_does_not_keep_the_lock(tmp_path):
    """The ranks forked from the run's process (and their data-loading workers) inherit the lock's file: they drop
    their copy, so a run that died does not leave its directory locked for as long as a child of it lives."""
    import signal
    import time

    ready, told = os.pipe()
    with run_dir_lock(tmp_path):
        child = os.fork()
        if child == 0:  # the fork hooks have run by the time the child's own code does
            os.write(told, b"1")
            time.sleep(30)
            os._exit(0)
        os.read(ready, 1)
    try:
        with run_dir_lock(tmp_path):  # the child is still alive
            pass
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_run_directory_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    """Before Hydra's own mkdir (a 32-line traceback) and before anything starts: the run directory, and a sweep's."""
    from mlplat.run_lock import unwritable
    from tests.helpers.cli import run_module

    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = run_train(blocker / "run", "parallel=single", "logger=none", "trainer.max_steps=1", check=False, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [f"error: hydra.run.dir={blocker / 'run'} cannot be written: {blocker} "
                                                f"is not a folder"]
    proc = run_module(["-m", f"hydra.sweep.dir={blocker / 'sweep'}", "parallel=single", "seed=1,2"], timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: hydra.sweep.dir={blocker / 'sweep'} cannot be written: {blocker} is not a folder"], proc.stderr
    assert unwritable(tmp_path / "new" / "deeper") is None and not (tmp_path / "new").exists()  # probes, makes nothing
    if os.geteuid() != 0:  # root writes anywhere its file system lets it
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert unwritable(locked / "run") == f"Permission denied (errno 13 EACCES) creating a file in {locked}"


def test_a_new_run_is_refused_where_an_earlier_run_left_its_history(tmp_path, monkeypatch):
    """What decides (the CLI's refusal: tests/cli/test_checkpoint.py). A folder holds a run once it holds a complete
    checkpoint or a metrics.csv row; a fresh run, or one resumed from a checkpoint kept elsewhere, is refused there.
    What continues the folder's own lineage is not: `last`, a checkpoint of its checkpoints/, a requeued SLURM job and
    a group the elastic agent restarted (both resume `last`)."""
    from mlplat.run_lock import held_run, refuse_another_run

    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)  # this very launch's
    (run / "checkpoints" / "step-3.partial-0123abcd").mkdir(parents=True)  # an unfinished save holds nothing
    (run / "metrics.csv").write_text("step,train_loss\n")  # a run that stopped before its first row
    (run / "train.log").write_text("a line\n")
    assert held_run(run) is None and held_run(tmp_path / "none") is None
    refuse_another_run(run, None)
    (run / "metrics.csv").write_text("step,train_loss\n1,5.5\n2,5.4\n")
    assert held_run(run) == "metrics.csv with 2 rows"
    for step in (2, 4):
        (run / "checkpoints" / f"step-{step}").mkdir()
    assert held_run(run) == "checkpoints step-2, step-4 and metrics.csv with 2 rows"
    elsewhere = tmp_path / "other" / "checkpoints" / "step-4"
    for asked in (None, str(elsewhere)):
        with pytest.raises(ConfigError) as info:
            refuse_another_run(run, asked)
        assert str(info.value) == (f"hydra.run.dir={run} holds an earlier run (checkpoints step-2, step-4 and "
                                   f"metrics.csv with 2 rows): continue it with ckpt_path=last, or choose another "
                                   f"hydra.run.dir for a new run")
    monkeypatch.chdir(tmp_path)  # a relative path to its own checkpoint is one too
    for asked in ("last", str(run / "checkpoints" / "step-2"), "run/checkpoints/step-2"):
        refuse_another_run(run, asked)
    with monkeypatch.context() as m:
        m.setenv("SLURM_JOB_ID", "42")
        m.setenv("SLURM_RESTART_COUNT", "1")
        refuse_another_run(run, None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    refuse_another_run(run, None)
