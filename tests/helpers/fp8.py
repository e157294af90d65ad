"""The probed FP8 kernels' verdict stores (`mlplat.precision`) in tests."""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def unprobed(*stores: dict) -> Iterator[None]:
    """`stores` empty while inside and restored after: a test starts from a process that has probed nothing and leaves
    the process as it found it."""
    saved = [dict(store) for store in stores]
    for store in stores:
        store.clear()
    try:
        yield
    finally:
        for store, kept in zip(stores, saved):
            store.clear()
            store.update(kept)
