"""What makes runs comparable: the full resolved config and the planner's prediction for the run, in the logger
(W&B config and summary; `hparams.yaml` for the CSV logger). The run's name and group are set where the logger
is made (`mlplat.train.RunIdentity`)."""
from __future__ import annotations

import dataclasses

import pytorch_lightning as pl
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from mlplat.config import RunConfig


def prediction(cfg: RunConfig) -> dict[str, float]:
    """The planner's figures for this run (closed-form parameter counts, the schedule simulated under the
    cluster.* cost model): predicted step time, model TFLOP/s per device and pipeline bubble."""
    from mlplat.perf.dry_run import plan

    try:
        pl_ = plan(cfg, use_meta=False, max_compute_ops=20_000)
    except ValueError:  # a layout the cost model cannot time (the run itself was validated)
        return {}
    return {"predicted_step_time_s": pl_["predicted_seconds_per_iteration"],
            "predicted_tflops_per_device": pl_["predicted_model_tflops_per_gpu"],
            "predicted_bubble": pl_["bubble_fraction"]}


class RunRecord(pl.Callback):
    """At the start of training, the logger gets the resolved config (`model.hidden`, `parallel.tp`, ...), the
    overrides, the prediction and the restarts so far as hyper-parameters; W&B also gets the prediction in the run
    summary, where the measured metrics (`step_time_s`, `tflops_per_device`, ...) land."""

    def __init__(self, cfg: RunConfig, overrides: list[str]):
        self.cfg, self.overrides = cfg, overrides

    @rank_zero_only
    def on_fit_start(self, trainer, pl_module) -> None:
        if not trainer.loggers:
            return
        predicted = prediction(self.cfg)
        from mlplat.lightning.restarts import restart_count

        # restarts: how many times the elastic agent restarted this job's ranks before this start (trainer.max_restarts)
        params = {**dataclasses.asdict(self.cfg), "overrides": self.overrides, "prediction": predicted,
                  "restarts": restart_count()}
        for logger in trainer.loggers:
            logger.log_hyperparams(params)
            summary = getattr(getattr(logger, "experiment", None), "summary", None)
            if summary is not None and predicted:
                summary.update(predicted)
