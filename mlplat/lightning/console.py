"""What the console shows: the lines of the libraries that say nothing about an mlplat run are dropped where they
are emitted (a warnings filter, a logging filter), each with the reason it does not apply; everything else passes.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

# (message regex, why it does not apply to mlplat)
INAPPLICABLE_WARNINGS = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", "Lightning's own use of torch's pytree, once per rank"),
    (r"Using ModelCheckpoint with manual optimization", "the pipeline engine steps the optimizer itself; mlplat's "
     "checkpoint is written after the step on purpose, and its code sample is about a one-GPU module"),
    (r"You're resuming from a checkpoint that ended before the epoch ended", "mlplat's loader resumes mid-epoch"),
    (r"You called `self.log\(.*logger=True\)` but have no logger configured", "logger=none asks for exactly that"),
    (r".*does not have many workers", "token windows are sliced from memory: workers would only add processes"),
    (r"Checkpoint directory .* exists and is not empty", "a resumed run writes into its own checkpoints/ on purpose"),
    (r"It is recommended to use `self.log\('val_loss', ..., sync_dist=True\)`", "val_loss is already the mean over the "
     "data-parallel replicas (an all-reduce inside the step), on every rank"),
    (r"Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be provided",
     "a resume that changes checkpoint.every_steps: the checkpoint callback's state is its cadence (which the new "
     "value replaces on purpose) and Lightning's best-k bookkeeping, which mlplat keeps none of (no monitor)"),
    (r"torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to (save|load) in a "
     r"single process", "a one-process run (parallel=single) saves and loads its checkpoint in that one process"),
)
INAPPLICABLE_INFO = (
    ("💡 Tip: For seamless cloud logging", "an advertisement"),
    ("TPU available:", "mlplat runs on CPUs and GPUs"),
    ("HPU available:", "mlplat runs on CPUs and GPUs"),
    ("GPU available: False", "a CPU run: the layout line says where the ranks run"),
    ("`Trainer.fit` stopped: `max_steps=", "the last step's line says so"),
)


class _DropInapplicable(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(prefix) for prefix, _ in INAPPLICABLE_INFO)


_FILTER = _DropInapplicable()


def quiet_libraries() -> None:
    """Install the filters in this process (idempotent)."""
    for pattern, _ in INAPPLICABLE_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def to_log_files(text: str) -> None:
    """Write `text` to this process's log files only (train.log, a forked rank's rank<N>.log) as a record of the
    `mlplat` logger, not to the console."""
    record = logging.getLogger("mlplat").makeRecord("mlplat", logging.INFO, __file__, 0, text, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def print_and_file(text: str) -> None:
    """Print `text` to the console as it is, and write it to the log files: the summary and the sample belong in
    the run's log too, without a second copy on the console through the logger's console handler."""
    print(text, flush=True)
    to_log_files(text)


class RunLogFile(logging.FileHandler):
    """The log files' handler (Hydra's `job_logging`: train.log, a forked rank's rank<N>.log). A write the operating
    system refuses (a full disk, a quota) stops this file with one line on stderr, where logging would print a
    `--- Logging error ---` block with a traceback for every record from then on. The console keeps every line; a
    file the run needs (metrics.csv, a checkpoint) stops the run when it fails. Each line goes to the file in one
    unbuffered write: nothing is left in a buffer to fail again when the file is closed."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.failed:
            return
        try:
            if self.stream is None:  # delay=true: opened by the first line
                self.stream = self._open()
            data = (self.format(record) + self.terminator).encode(self.stream.encoding,
                                                                  self.stream.errors or "backslashreplace")
            fd = self.stream.fileno()
            while data:
                data = data[os.write(fd, data):]
        except OSError as e:
            from mlplat.errors import os_error

            self.failed = True
            print(f"mlplat: {self.baseFilename}: {os_error(e)} writing a log line: this file stops here, the console "
                  f"goes on", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - a record that cannot be formatted: logging's own report
            self.handleError(record)
