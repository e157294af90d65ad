"""Build a sample index once and share it: across ranks, across concurrent jobs, across runs.

The index is saved as `<data folder>/.mlplat-index/NAME-HASH.npy`, HASH covering everything it depends on
(the data files' sizes and times, weights, split, seq_len, seed, sample count). A file lock makes the first
caller build it while the others wait and then read it. Where the data folder is read-only, the index goes
to `data.cache_dir` (default `$MLPLAT_CACHE`, else `~/.cache/mlplat/index`).
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Callable

import numpy as np
from filelock import FileLock


def default_cache_dir() -> Path:
    return Path(os.environ.get("MLPLAT_CACHE") or "~/.cache/mlplat/index").expanduser()


def writable(folder: Path) -> bool:
    """Can files be created in folder (made if missing)? Tried for real: permission bits lie for root and
    on read-only mounts."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{uuid.uuid4().hex}"
        probe.touch()
        probe.unlink()
        return True
    except OSError:
        return False


def index_path(name: str, key: dict, data_dir: Path, cache_dir: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = data_dir / ".mlplat-index"
    if cache_dir is not None or not writable(folder):
        folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}-{digest}.npy"


def cached_index(path: Path, build: Callable[[], np.ndarray]) -> np.ndarray:
    """The array at path, built by `build()` and saved first if no one has yet (memory-mapped on read)."""
    if not path.exists():
        with FileLock(str(path) + ".lock"):
            if not path.exists():  # another rank or job may have built it while this one waited
                tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
                with open(tmp, "wb") as f:
                    np.save(f, build())
                os.replace(tmp, path)
    return np.load(path, mmap_mode="r")
