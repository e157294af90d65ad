"""`python -m tests.helpers.slow_rank ARGS` is `python -m mlplat.train ARGS` with one rank made slower at its work:
on global rank $SLOW_RANK every transformer layer's forward first burns $SLOW_MS ms of CPU time (a slower device
doing the same work). Ranks forked from this process inherit the change. For the straggler test only."""
from __future__ import annotations

import os
import runpy
import time

import torch.distributed as dist

from mlplat.model.decoder import TransformerLayer

_forward = TransformerLayer.forward


def _slowed(self, *args, **kwargs):
    if dist.is_initialized() and dist.get_rank() == int(os.environ["SLOW_RANK"]):
        end = time.process_time() + float(os.environ["SLOW_MS"]) / 1e3
        while time.process_time() < end:
            pass
    return _forward(self, *args, **kwargs)


TransformerLayer.forward = _slowed
runpy.run_module("mlplat.train", run_name="__main__", alter_sys=True)
