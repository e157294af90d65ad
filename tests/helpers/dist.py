"""Multi-process test harness: run a function on N CPU ranks joined by a gloo process group.

    from tests.helpers.dist import run_distributed

    def _check(rank, world_size, n):           # module level, so spawn can import it
        ...
        return some_tensor                      # picklable; comes back to the parent

    results = run_distributed(_check, 4, 3)     # list, in rank order

The package's launcher (`mlplat.parallel.local_launch`), with one addition for the tests: every rank installs
the NCCL-strict transport when MLPLAT_NCCL_STRICT is set (tests/conftest.py), so gloo blocks where NCCL's host
does. Starting processes dominates the cost (each imports torch), so run many checks inside one group.
"""

from __future__ import annotations

from mlplat.parallel.local_launch import RankFailed, launch
from mlplat.parallel.nccl_strict import install_if_enabled

DistributedTestError = RankFailed  # a rank raised; the message carries that rank's traceback


def run_distributed(fn, world_size: int, *args, timeout: float = 120, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo CPU processes.

    Returns the per-rank results in rank order. A rank's exception is re-raised here with its
    traceback text; past ``timeout`` seconds every child is killed and TimeoutError raised.
    """
    return launch(fn, world_size, *args, timeout=timeout, setup=install_if_enabled, **kwargs)
