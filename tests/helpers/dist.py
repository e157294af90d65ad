"""Multi-process test harness: run a function on N CPU ranks joined by a gloo process group.

    from tests.helpers.dist import run_distributed

    def _check(rank, world_size, n):           # module level, so spawn can import it
        ...
        return some_tensor                      # picklable; comes back to the parent

    results = run_distributed(_check, 4, 3)     # list, in rank order

The package's launcher (`mlplat.harness.launch`), with one addition for the tests: every rank installs
the NCCL-strict transport when MLPLAT_NCCL_STRICT is set (tests/conftest.py), so gloo blocks where NCCL's host
does; and the ranks are forked from a server that imported torch, Lightning and mlplat once (`PRELOAD`), so that a
launch costs no imports. Still, run many checks inside one group.
"""

from __future__ import annotations

from mlplat.harness.launch import RankFailed, launch
from mlplat.harness.nccl_strict import install_if_enabled

# What the forkserver imports once for the whole session (the CLI runs of tests/helpers/cli.py share it): every
# module a rank of the tests would import before its first collective.
PRELOAD = ("torch", "torch.distributed", "pytorch_lightning", "hydra", "wandb", "mlplat.train",
           "mlplat.lightning.module", "mlplat.lightning.strategy", "mlplat.lightning.datamodule",
           "mlplat.lightning.callbacks", "mlplat.checkpoint.io", "tests.helpers.equivalence")

DistributedTestError = RankFailed  # a rank raised; the message carries that rank's traceback


def run_distributed(fn, world_size: int, *args, timeout: float = 120, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo CPU processes.

    Returns the per-rank results in rank order. A rank's exception is re-raised here with its
    traceback text; past ``timeout`` seconds every child is killed and TimeoutError raised.
    """
    return launch(fn, world_size, *args, timeout=timeout, setup=install_if_enabled, preload=PRELOAD, **kwargs)
