"""`python -m tests.helpers.full_disk ARGS`: `python -m mlplat.train ARGS` on a disk that fills at a given step.

MLPLAT_TEST_FULL=STEP: when rank 0 writes optimizer step STEP's row of metrics.csv, the disk is full: that file's
writes go to /dev/full (ENOSPC, as a full disk answers), and so do the log files' (a line is logged then). Ranks
forked from this process inherit the change.
"""
from __future__ import annotations

import logging
import os
import runpy

from mlplat.lightning.callbacks import MetricsCSV

FULL_FROM = int(os.environ["MLPLAT_TEST_FULL"])
_append = MetricsCSV._append


class _FullStream:
    """A log file's stream on a full disk."""

    def __init__(self, stream):
        self.stream, self.full = stream, os.open("/dev/full", os.O_WRONLY)

    def fileno(self):
        return self.full

    def __getattr__(self, name):  # encoding, errors: the file's
        return getattr(self.stream, name)

    def flush(self):
        pass

    def close(self):
        os.close(self.full)
        self.stream.close()


def _append_on_a_full_disk(self, row: dict) -> None:
    if int(row["step"]) >= FULL_FROM:
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                handler.stream = _FullStream(handler.stream or handler._open())
        logging.getLogger("mlplat").info("the disk is full from here")  # the log file's write fails
        logging.getLogger("mlplat").info("and stays full")  # said once
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, self._fd)
        os.close(full)
    _append(self, row)


MetricsCSV._append = _append_on_a_full_disk

if __name__ == "__main__":
    runpy.run_module("mlplat.train", run_name="__main__", alter_sys=True)
