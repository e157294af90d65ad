"""The training step as a plain object: `TrainStep` owns the model chunks, the pipeline engine, the gradient buffer,
the optimizer, the learning-rate schedule, the loss scaler and post-validation; a loop of `TrainStep.run(batch)`
trains without Lightning. No Lightning and no Hydra here."""
from mlplat.step.records import RECORD_METRICS, StepRecord
from mlplat.step.train_step import TrainStep

__all__ = ["RECORD_METRICS", "StepRecord", "TrainStep"]
