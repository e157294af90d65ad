"""The LightningModule: adapts the training step (`mlplat.step.TrainStep`) to Lightning.

The step owns the model chunks, the engine, the gradient buffer, the optimizer, the schedule, the loss scaler and
post-validation; this module builds it in `configure_model`, runs it once per batch (manual optimisation), counts
its optimizer steps as Lightning's `global_step`, and shows its records: the progress bar and `callback_metrics`
(`self.log`), and the loggers at the step each record belongs to.
"""
from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn as nn

from mlplat.config import RunConfig
from mlplat.step import StepRecord, TrainStep


class DecoderModule(pl.LightningModule):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        self.cfg = cfg
        self.automatic_optimization = False  # the step runs backward inside the pipeline schedule
        self.step: TrainStep | None = None
        # The step's chunks, registered here so that Lightning moves, converts and switches modes of them.
        self.chunks = nn.ModuleDict()
        self._unshown: list[StepRecord] = []  # settled, not yet shown

    def configure_model(self) -> None:
        if self.step is None:
            strategy = self.trainer.strategy
            self.step = TrainStep(self.cfg, strategy.grid, strategy.root_device)
            self.step.on_settle = self._settled
            observer = getattr(strategy.launcher, "observer", None)  # rank 0 of a local launch: it started the rest
            if observer is not None:
                self.step.watch.before_report = observer.blame
            self.chunks.update({str(c): chunk for c, chunk in self.step.chunks.items()})

    @property
    def records(self) -> dict[int, StepRecord]:
        """The last settled steps' records, by step (the callbacks write metrics.csv's rows from them)."""
        return self.step.records if self.step is not None else {}

    def configure_optimizers(self):
        # Lightning sees the optimizer and the schedule (its checkpoints save the schedule); the step steps both.
        return {"optimizer": self.step.optimizer, "lr_scheduler": {"scheduler": self.step.schedule, "interval": "step"}}

    def training_step(self, batch, batch_idx):
        self.step.run(batch)  # its settled records reach `_settled`
        # Manual optimisation's global_step counts the optimizer steps taken through Lightning's wrapper; the step
        # took exactly one (skipped or not) on the optimizer itself, so it is counted here.
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()
        with self.step.watch.blocked_in("logging", "loop"):
            self._show(on_step=True)
        return None

    def _settled(self, record: StepRecord) -> None:
        """A settled step: to the loggers now, to the progress bar at the end of the training step (or with the
        next one, when it settled before validation, a checkpoint, generation or the end of training)."""
        with self.step.watch.blocked_in("logging", "loop"):
            self._send([record])
        self._unshown.append(record)

    def _show(self, on_step: bool) -> None:
        """The progress bar and callback_metrics (the loggers get the records in `_send`): every step settled
        since the last training step, oldest first; showing only the current one's would leave both holding the
        step before a settled one's figures until the next record."""
        records, self._unshown = self._unshown, []
        for record in records:
            for name, value in record.metrics().items():
                if "/" in name:  # a per-layer figure (expert load): for metrics.csv and the loggers only
                    continue
                value = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
                self.log(name, value, prog_bar=name == "train_loss", on_step=on_step, on_epoch=not on_step,
                         logger=False, rank_zero_only=True)

    def _send(self, records: list[StepRecord], final: bool = False) -> None:
        """Settled steps to the loggers on global rank 0, at the step Lightning logs that step's other metrics under
        (its batch index), every trainer.log_every_n_steps steps, and the last step at the end (`final`). A record
        can settle a step after its own (post-validation), so it is sent here and not through `self.log`, which
        would file it under the current step."""
        trainer = self._trainer
        if trainer is None or not trainer.is_global_zero:
            return
        every, kept = trainer.log_every_n_steps, self.records
        due = [r for r in records if r.step % every == 0]
        last = kept[max(kept)] if final and kept else None
        if last is not None and last.step % every != 0:
            due.append(last)
        for record in due:
            metrics = {name: float(value) for name, value in record.metrics().items()}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=record.step - 1)

    def validation_step(self, batch, batch_idx):
        loss = self.step.evaluate(batch)
        # float64 runs (64-true) log every digit, as train_loss does; the rest float32 (not bf16's 3 digits).
        dtype = torch.float64 if self.step.parameters()[0].dtype == torch.float64 else torch.float32
        self.log("val_loss", loss.to(dtype), prog_bar=True, on_epoch=True, rank_zero_only=True)
        for name, value in (self.step.validation_figures.get("mtp_loss") or {}).items():  # multi-token prediction
            self.log(f"val_{name}", value.to(dtype), on_epoch=True, rank_zero_only=True)

    # -- where a step taken before its checks must be settled: its weights or state are read next -------------
    def on_validation_start(self) -> None:
        self.step.settle()

    def on_train_epoch_end(self) -> None:
        self.step.settle()  # before any callback's on_train_end (metrics.csv's last row, the summary, the sample)
        self._show(on_step=False)  # Lightning takes no per-step values here: the epoch's, from one value

    def on_train_end(self) -> None:
        self.step.finish()  # settled, and no collective left in flight at teardown
        self._send([], final=True)  # the last step's figures, whatever trainer.log_every_n_steps
