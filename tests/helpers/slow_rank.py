"""`python -m tests.helpers.slow_rank ARGS` is `python -m mlplat.train ARGS` with one rank made slower at its work:
on global rank $SLOW_RANK every transformer layer's forward first burns $SLOW_MS ms of CPU time (a slower device
doing the same work). With $HOST_EVENTS set, the straggler check times its blocks by host-timed stand-ins for CUDA
events (tests/helpers/host_events.py): a block's time then holds its waits, as a GPU's compute stream's does.
Ranks forked from this process inherit the changes. For the straggler test only."""
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
if os.environ.get("HOST_EVENTS"):
    import functools

    from mlplat.lightning import callbacks
    from tests.helpers.host_events import HostEvent

    callbacks.StepClock = functools.partial(callbacks.StepClock, event=HostEvent)
runpy.run_module("mlplat.train", run_name="__main__", alter_sys=True)
