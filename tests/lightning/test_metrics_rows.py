"""metrics.csv: the profiling columns (`time_<category>_s`) appear on the profiled rows only.

Lightning's `callback_metrics` keep a metric's last value, so a writer reading them repeats the last profiled
step's breakdown on every later row. The writer is driven here by a fake trainer whose `callback_metrics` hold
such stale values, as Lightning's do after the profiled window.
"""
from __future__ import annotations

import csv
from types import SimpleNamespace

import torch

from mlplat.lightning.callbacks import MetricsCSV
from mlplat.parallel.profile import CATEGORIES


class FakeProfiler:
    def __init__(self):
        self.breakdown: dict[int, dict[str, float]] = {}


def test_profiling_columns_only_on_profiled_rows(tmp_path):
    path = tmp_path / "metrics.csv"
    writer, profiler = MetricsCSV(path), FakeProfiler()
    trainer = SimpleNamespace(global_step=0, callbacks=[profiler, writer], callback_metrics={}, sanity_checking=False)
    writer.on_train_start(trainer, None)
    for step in range(1, 6):
        trainer.global_step = step
        trainer.callback_metrics["train_loss"] = torch.tensor(1.0 / step)
        trainer.callback_metrics["step_time_s"] = torch.tensor(0.5)
        if step in (2, 3):  # profile.steps=[2,3]: the profiler logs this step's breakdown
            profiler.breakdown[step] = {c: 0.01 * step for c in CATEGORIES}
            trainer.callback_metrics.update({f"time_{c}_s": torch.tensor(0.01 * step) for c in CATEGORIES})
        writer.on_train_batch_end(trainer, None, None, None, step - 1)
    writer.on_train_end(trainer, None)

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
