"""`python -m tests.helpers.dying_rank ARGS`: `python -m mlplat.train ARGS` in which a rank kills itself with SIGKILL
(as the OOM killer would), or raises, when it starts a given step of a given start of its group.

MLPLAT_TEST_DIE=RANK:STEP:START[:raise],...: global rank RANK dies when it starts step STEP (1-based) in the group's
start START (0 = the first, 1 = after the elastic agent's first restart: TORCHELASTIC_RESTART_COUNT); with `:raise`
it raises instead (an exception in a rank); with `:notice` (`:term`) it sends SIGUSR1, SLURM's preemption notice
(SIGTERM) to the process that started it and goes on.
"""
from __future__ import annotations

import os
import runpy
import signal

from mlplat.lightning.module import DecoderModule
from mlplat.lightning.restarts import restart_count

_step = DecoderModule.training_step


def _dying_step(self, batch, batch_idx):
    for spec in os.environ["MLPLAT_TEST_DIE"].split(","):
        rank, step, start, *how = spec.split(":")
        if (self.trainer.global_rank, self.trainer.global_step + 1, restart_count()) == (int(rank), int(step),
                                                                                         int(start)):
            if how == ["raise"]:
                raise RuntimeError(f"rank {rank} fails at step {step} on purpose")
            if how in (["notice"], ["term"]):  # SLURM's preemption notice or SIGTERM, to the launching process
                os.kill(os.getppid(), signal.SIGUSR1 if how == ["notice"] else signal.SIGTERM)
                continue
            os.kill(os.getpid(), signal.SIGKILL)
    return _step(self, batch, batch_idx)


DecoderModule.training_step = _dying_step

if __name__ == "__main__":
    runpy.run_module("mlplat.train", run_name="__main__", alter_sys=True)
