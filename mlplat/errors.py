"""The errors a user sees as one line: str() names the key, the value and the rule.

A leaf module (it imports nothing of mlplat), so the config, the data checks, the Hugging Face config reader and
the tokenizers all raise the same types without importing each other.
"""
from __future__ import annotations

import errno
import os
import stat


class ConfigError(ValueError):
    """An invalid configuration; str() is the one line shown to the user."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded; str() is one line naming data.tokenizer and what to do."""


class DivergenceError(RuntimeError):
    """optim.max_skipped_steps optimizer steps in a row skipped for an inf/NaN loss or gradient norm, or a run that
    ended inside a run of skipped steps; str() is the one line naming the step and the count."""


class RunFileError(RuntimeError):
    """A file of the run that could not be written (a full disk, a quota); str() is one line naming the file and the
    operating system's error. The run stops: a run whose record is cut short is not a finished run."""


class DataError(ValueError):
    """Data found wrong while training, past what the preflight's bounded scan read (a token id outside the
    vocabulary); str() is one line naming the data, the place and the rule. The run stops: it would train on noise."""

    def __str__(self) -> str:
        # A DataLoader worker's error comes back rebuilt around the worker's traceback: keep the line itself.
        text = super().__str__()
        line = [row for row in text.splitlines() if "data: " in row][-1:] or [text]
        return line[0][line[0].find("data: "):] if "data: " in line[0] else line[0]


def os_error(e: OSError) -> str:
    """The operating system's error in a few words: `No space left on device (errno 28 ENOSPC)`."""
    what = os.strerror(e.errno) if e.errno else e.strerror or str(e)
    return f"{what} (errno {e.errno} {errno.errorcode.get(e.errno, '?')})"


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def not_regular(path: str | os.PathLike) -> str | None:
    """What `path` is when it exists but is no regular file ("a FIFO (named pipe)"), else None. Checked before a
    read: opening a FIFO for reading blocks until a writer comes, so the run would hang before any output."""
    try:
        mode = os.stat(path).st_mode  # follows links: the Hub cache's symlinked files are regular files
    except OSError:
        return None  # missing or unreadable: the caller's open says so
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")
