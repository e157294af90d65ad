"""metrics.csv: each figure in its own step's row.

Lightning's `callback_metrics` keep a metric's last value, so a writer reading them repeats the last profiled
step's breakdown on every later row; and under optimizer post-validation a step's loss is known one step later,
so the `train_loss` in `callback_metrics` at a step's end is the previous step's. The writer is driven here by a
fake trainer whose `callback_metrics` hold such stale values, and a fake module whose records settle on time or
one step late.
"""
from __future__ import annotations

import csv
from types import SimpleNamespace

import torch

from mlplat.lightning.callbacks import MetricsCSV, Throughput
from mlplat.parallel.profile import CATEGORIES
from mlplat.step import StepRecord


class FakeThroughput(Throughput):
    def __init__(self):
        self.current: dict[str, float] = {}


class FakeProfiler:
    def __init__(self):
        self.breakdown: dict[int, dict[str, float]] = {}


def test_profiling_columns_only_on_profiled_rows(tmp_path):
    path = tmp_path / "metrics.csv"
    writer, profiler, clock = MetricsCSV(path), FakeProfiler(), FakeThroughput()
    trainer = SimpleNamespace(global_step=0, callbacks=[clock, profiler, writer], callback_metrics={},
                              sanity_checking=False, log_every_n_steps=1, max_steps=5)
    module = SimpleNamespace(records={})
    writer.on_train_start(trainer, module)
    for step in range(1, 6):
        trainer.global_step = step
        trainer.callback_metrics["train_loss"] = torch.tensor(1.0 / step)
        module.records[step] = _record(step)
        clock.current = {"step_time_s": 0.5}
        if step in (2, 3):  # profile.steps=[2,3]: the profiler logs this step's breakdown
            profiler.breakdown[step] = {c: 0.01 * step for c in CATEGORIES}
            trainer.callback_metrics.update({f"time_{c}_s": torch.tensor(0.01 * step) for c in CATEGORIES})
        writer.on_train_batch_end(trainer, module, None, None, step - 1)
    writer.on_train_end(trainer, module)

    with open(path, newline="") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    for step, row in rows.items():
        times = [row[f"time_{c}_s"] for c in CATEGORIES]
        if step in (2, 3):
            assert [float(x) for x in times] == [0.01 * step] * len(CATEGORIES), (step, row)
        else:  # before and after the window: empty, though callback_metrics still hold step 3's values
            assert times == [""] * len(CATEGORIES), (step, row)
        assert row["train_loss"] and row["step_time_s"] == "0.5"


def _record(step: int) -> StepRecord:
    return StepRecord(step, torch.tensor(1.0 / step, dtype=torch.float64), torch.tensor(2.0 * step), 1e-3 * step,
                      eager=True, redone_steps=step // 2)


def test_a_step_settled_one_step_late_is_written_in_its_own_row(tmp_path):
    """Post-validation: step k's record appears during step k+1 (the last one at the end of training); Lightning's
    callback_metrics at step k's end still hold step k-1's loss. Every row has its own step's figures."""
    path = tmp_path / "metrics.csv"
    writer, clock = MetricsCSV(path), FakeThroughput()
    trainer = SimpleNamespace(global_step=0, callbacks=[clock, writer], callback_metrics={}, sanity_checking=False,
                              log_every_n_steps=1, max_steps=4)
    module = SimpleNamespace(records={})
    writer.on_train_start(trainer, module)
    for step in range(1, 5):
        trainer.global_step = step
        if step > 1:  # settled in this step's training_step, and self.log-ged there
            module.records[step - 1] = _record(step - 1)
            trainer.callback_metrics.update({k: torch.tensor(float(v)) for k, v in _record(step - 1).metrics().items()})
        trainer.callback_metrics["step_time_s"] = torch.tensor(0.5)  # stale: the row takes the clock's own figure
        clock.current = {"step_time_s": 0.25 * step}
        writer.on_train_batch_end(trainer, module, None, None, step - 1)
    module.records[4] = _record(4)  # settled at the end of the epoch, before on_train_end
    writer.on_train_end(trainer, module)

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    for step, row in enumerate(rows, start=1):
        assert float(row["train_loss"]) == 1.0 / step and float(row["grad_norm"]) == 2.0 * step, row
        assert float(row["lr"]) == 1e-3 * step and int(float(row["redone_steps"])) == step // 2, row
        assert float(row["step_time_s"]) == 0.25 * step, row
