"""When to checkpoint: Lightning's ModelCheckpoint, saving sharded folders `step-<N>/` every N steps and at the
run's last step (`trainer.max_steps`), so that a finished run can be continued from where it ended; with
`checkpoint.async_save` the run's end waits for the last save to be committed. Each checkpoint
records that cadence (`saved_cadence`): a resume that does not set `checkpoint.every_steps` keeps it.

A step saved again (a preemption save of the step a periodic save wrote; a branch's later steps were moved aside
before it started, mlplat.train.set_aside_branched) replaces its folder (mlplat.checkpoint.io's atomic re-save),
never Lightning's `step-<N>-v1`, which `ckpt_path=last` would not see."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from pytorch_lightning.callbacks import ModelCheckpoint

from mlplat.checkpoint.io import LIGHTNING_STATE, load_plain


class StepCheckpoint(ModelCheckpoint):
    FILE_EXTENSION = ""  # a checkpoint is a folder of DCP shards, not a file

    def __init__(self, dirpath: str | Path, every_steps: int):
        super().__init__(dirpath=str(dirpath), filename="step-{step}", auto_insert_metric_name=False,
                         every_n_train_steps=every_steps, save_top_k=-1, save_last=False,
                         save_on_train_epoch_end=False, enable_version_counter=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        # The last step, at the same point of the loop as the periodic saves (on_train_end would be after the epoch
        # loop has closed the epoch: a resume would start the next one instead of continuing this one).
        if 0 < trainer.max_steps <= trainer.global_step and not self._should_skip_saving_checkpoint(trainer):
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_end(self, trainer, pl_module) -> None:
        # A save written behind training (checkpoint.async_save) is committed before the run reports its end.
        wait = getattr(trainer.strategy, "wait_for_checkpoint", None)
        if wait is not None:
            wait()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "every_steps": self._every_n_train_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A resume into another folder (a resharded or branched run) is ordinary here, and mlplat keeps no "best"
        # checkpoints to lose: Lightning's warning that the dirpath changed, once per rank, says nothing to a user.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The dirpath has changed")
            super().load_state_dict(state_dict)


def saved_cadence(path: str | Path) -> int | None:
    """The `checkpoint.every_steps` of the run that saved the checkpoint at `path` (None: it recorded none, e.g. a
    run without periodic saves that a preemption notice saved)."""
    state = load_plain(Path(path) / LIGHTNING_STATE, Path(path))
    for key, value in (state.get("callbacks") or {}).items():
        if str(key).startswith(StepCheckpoint.__qualname__) and isinstance(value, dict) and "every_steps" in value:
            return int(value["every_steps"])
    return None
