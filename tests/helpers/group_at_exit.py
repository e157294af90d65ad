"""`python -m tests.helpers.group_at_exit ARGS`: `python -m mlplat.train ARGS`, then one line on stderr as the
interpreter exits saying whether the default process group is still initialized (a rank torchrun, SLURM or the
elastic agent started must have destroyed it: nothing else does)."""
from __future__ import annotations

import atexit
import runpy
import sys

import torch.distributed as dist


def _say() -> None:
    state = "initialized" if dist.is_available() and dist.is_initialized() else "destroyed"
    print(f"process group at exit: {state}", file=sys.stderr, flush=True)


atexit.register(_say)

if __name__ == "__main__":
    runpy.run_module("mlplat.train", run_name="__main__", alter_sys=True)
