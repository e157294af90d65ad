"""A disk that fills while a run writes: one line per file that cannot be written, metrics.csv ending with a whole
row, and the run stopped with exit status 2 (no traceback, no `--- Logging error ---` block per record)."""
from __future__ import annotations

import errno
import logging
import os

import pytest

from tests.helpers.cli import read_metrics, run_train

ENOSPC = os.strerror(errno.ENOSPC)


@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_after_the_last_whole_row(tmp_path):
    """Two processes (p = 2): rank 0's disk fills as it writes step 3's row; its log file says so once, and the run
    stops with the line naming metrics.csv, which holds steps 1 and 2 whole."""
    proc = run_train(tmp_path, "parallel=single", "parallel.pp=2", "model.hidden=32", "model.n_heads=4",
                     "model.seq_len=32", "model.n_layers=2", "parallel.micro_batch_size=1",
                     "parallel.global_batch_size=2", "logger=none", "sample.max_new_tokens=0",
                     "trainer.val_check_interval=1000", "trainer.max_steps=6", module="tests.helpers.full_disk",
                     env={"MLPLAT_TEST_FULL": "3"}, check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"mlplat: {tmp_path / 'train.log'}: {ENOSPC} (errno 28 ENOSPC) writing a log line: this file stops here, the "
        f"console goes on",
        f"error: {tmp_path / 'metrics.csv'}: {ENOSPC} (errno 28 ENOSPC) writing step 3's row: training stopped (the "
        f"file ends with the last whole row)"], proc.stderr[-3000:]
    assert [int(r["step"]) for r in read_metrics(tmp_path)] == [1, 2]
    assert (tmp_path / "metrics.csv").read_bytes().endswith(b"\n")


def test_a_row_cut_short_by_a_full_disk_is_cut_back_off(tmp_path):
    """The operating system takes half a row, then refuses the rest: the file is cut back to its last whole row."""
    from mlplat.errors import RunFileError
    from mlplat.lightning.callbacks import _write_whole

    path = tmp_path / "metrics.csv"
    path.write_bytes(b"step,loss\n1,5.5\n")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    calls = []

    def half_then_full(fd, data):
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, ENOSPC)
        return os.write(fd, bytes(data[:len(data) // 2]))

    try:
        with pytest.raises(RunFileError, match=rf"^{path}: {ENOSPC} \(errno 28 ENOSPC\) writing step 2's row: "):
            _write_whole(fd, b"2,5.4\n", path, os.fstat(fd).st_size, step=2, write=half_then_full)
    finally:
        os.close(fd)
    assert calls == [6, 3] and path.read_bytes() == b"step,loss\n1,5.5\n"


def test_a_log_file_on_a_full_disk_stops_in_one_line(tmp_path, capsys):
    """mlplat's log file handler: the first refused write is one line on stderr, and the file takes no more lines
    (logging's own handler would print a traceback block for every record)."""
    from mlplat.lightning.console import RunLogFile

    handler = RunLogFile(tmp_path / "train.log", delay=True)
    log = logging.getLogger("mlplat.test_full_disk")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("written")
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, handler.stream.fileno())
        os.close(full)
        for _ in range(3):
            log.warning("lost to the full disk")
    finally:
        log.removeHandler(handler)
        handler.close()
    err = capsys.readouterr().err
    assert err.splitlines() == [f"mlplat: {tmp_path / 'train.log'}: {ENOSPC} (errno 28 ENOSPC) writing a log line: "
                                f"this file stops here, the console goes on"], err
    assert (tmp_path / "train.log").read_text() == "written\n"


def test_a_run_directory_without_room_is_refused_before_hydra_writes(tmp_path, monkeypatch):
    """A disk with a few KB left takes the probe's creation but not its 1 MiB: refused in one line (the callback's
    line), where Hydra's first write of .hydra/ would fail with a traceback."""
    from mlplat import run_lock

    write = os.write

    def full(fd, data):
        if len(data) > 8192:
            raise OSError(errno.ENOSPC, ENOSPC)
        return write(fd, data)

    monkeypatch.setattr(run_lock.os, "write", full)
    assert run_lock.unwritable(tmp_path / "run") == f"{ENOSPC} (errno 28 ENOSPC) writing 1 MiB in {tmp_path}"
    monkeypatch.undo()
    assert run_lock.unwritable(tmp_path / "run") is None and list(tmp_path.iterdir()) == []


def test_a_checkpoints_folder_that_cannot_take_files_is_refused_before_any_process(tmp_path, monkeypatch):
    """DIR/checkpoints a regular file, or on a read-only mount: refused in one line before any process starts (it
    would fail the first save, after the first steps, with a traceback); with saving off it is not needed."""
    from mlplat import run_lock
    from mlplat.config import load_config
    from mlplat.errors import ConfigError
    from mlplat.train import check_checkpoint_folder

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a folder")
    proc = run_train(run_dir, "parallel=single", "trainer.max_steps=2", check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0] == (f"error: {run_dir / 'checkpoints'} cannot hold the run's checkpoints: {run_dir / 'checkpoints'} "
                      f"is not a folder (checkpoint.every_steps=0, checkpoint.save_last=True); choose another "
                      f"hydra.run.dir, or set checkpoint.every_steps=0 checkpoint.save_last=false to save none")
    assert not (run_dir / "metrics.csv").exists()

    (run_dir / "checkpoints").unlink()
    opened = os.open

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(run_dir)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(run_lock.os, "open", read_only)
    cfg = load_config({"model": {"vocab_size": 256}}, world_size=1, check_data=False)
    cfg.checkpoint.every_steps = 5
    with pytest.raises(ConfigError, match=r"cannot hold the run's checkpoints: Read-only file system \(errno 30 "
                                          r"EROFS\) creating a file in .*checkpoint.every_steps=5"):
        check_checkpoint_folder(cfg, run_dir)
    cfg.checkpoint.every_steps, cfg.checkpoint.save_last = 0, False
    check_checkpoint_folder(cfg, run_dir)  # saves nothing: needs no folder
