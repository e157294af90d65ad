"""The multi-process harness itself (tests/helpers/dist.py): a rank's error and a hang reach the parent."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from tests.helpers.dist import run_distributed


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 blocks here; the harness must not wait for it
    return rank


def _sleep_forever(rank, world_size):
    time.sleep(600)


def test_harness_reraises_rank_error():
    with pytest.raises(RuntimeError, match="(?s)rank 1.*ValueError: boom from rank one"):
        run_distributed(_raise_on_rank_one, 2, timeout=60)


def test_harness_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        run_distributed(_sleep_forever, 1, timeout=6)
    assert time.monotonic() - start < 30
