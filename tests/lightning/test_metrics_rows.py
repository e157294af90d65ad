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
    requested = True  # profile.steps set: the time_*_s columns are written

    def __init__(self):
        self.breakdown: dict[int, dict[str, float]] = {}


def _module(post_validate: bool = False, loss_scaler=None, qk_clip: float | None = None) -> SimpleNamespace:
    """A LightningModule's stand-in: its step's records, loss scaler and config."""
    optim = SimpleNamespace(post_validate=post_validate, muon=SimpleNamespace(qk_clip=qk_clip))
    return SimpleNamespace(records={}, step=SimpleNamespace(loss_scaler=loss_scaler, cfg=SimpleNamespace(optim=optim)))


def test_profiling_columns_only_on_profiled_rows(tmp_path):
    path = tmp_path / "metrics.csv"
    writer, profiler, clock = MetricsCSV(path), FakeProfiler(), FakeThroughput()
    trainer = SimpleNamespace(global_step=0, callbacks=[clock, profiler, writer], callback_metrics={},
                              sanity_checking=False, log_every_n_steps=1, max_steps=5)
    module = _module()
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
    module = _module(post_validate=True)
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


def _rows(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def _run(writer, trainer, module, steps) -> None:
    writer.on_train_start(trainer, module)
    for step in steps:
        trainer.global_step = step
        module.records[step] = StepRecord(step, torch.tensor(1.0 / step), torch.tensor(1.0), 1e-3, eager=False)
        writer.on_train_batch_end(trainer, module, None, None, step - 1)
    writer.on_train_end(trainer, module)


def test_only_the_columns_the_run_can_fill_and_a_resume_keeps_the_old_ones(tmp_path):
    """No peak (CPU), no loss scaler, no post-validation, no profile: no mfu, loss_scale, redone_steps or time_*
    column; skipped_steps is 0 on every row. A resume in place with profile.steps keeps the earlier rows and adds the
    profile's columns; one without keeps the columns the file has."""
    path = tmp_path / "metrics.csv"
    clock = FakeThroughput()
    trainer = SimpleNamespace(global_step=0, callbacks=[clock], callback_metrics={}, sanity_checking=False,
                              log_every_n_steps=1, max_steps=6, limit_val_batches=2)
    _run(MetricsCSV(path), trainer, _module(), [1, 2, 3])
    columns, rows = _rows(path)
    assert columns == ["step", "train_loss", "val_loss", "grad_norm", "lr", "step_time_s", "tokens_per_s",
                       "tflops_per_device", "skipped_steps"]
    assert [r["skipped_steps"] for r in rows] == ["0"] * 3

    trainer.global_step = 2  # resumed from step 2's checkpoint, now profiled: step 3 is replayed
    writer = MetricsCSV(path)
    trainer.callbacks = [clock, FakeProfiler(), writer]
    _run(writer, trainer, _module(), [3, 4])
    columns, rows = _rows(path)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4] and "time_compute_s" in columns and "mfu" not in columns

    trainer.global_step, trainer.callbacks = 4, [clock]  # and again, unprofiled: the file's columns stay
    _run(MetricsCSV(path), trainer, _module(), [5, 6])
    columns, rows = _rows(path)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6] and "time_compute_s" in columns

    trainer.limit_val_batches = 0  # validation off, in a fresh file: no val_loss column
    _run(MetricsCSV(tmp_path / "other.csv"), trainer, _module(post_validate=True), [1])
    columns, _ = _rows(tmp_path / "other.csv")
    assert "val_loss" not in columns and "redone_steps" in columns and "qk_clipped_heads" not in columns


def test_qk_clipped_heads_column_under_qk_clip(tmp_path):
    """optim.muon.qk_clip: each step's count of clipped heads in its own column (`mlplat.model.qk_clip`)."""
    trainer = SimpleNamespace(global_step=0, callbacks=[FakeThroughput()], callback_metrics={}, sanity_checking=False,
                              log_every_n_steps=1, max_steps=2, limit_val_batches=0)
    writer, module = MetricsCSV(tmp_path / "metrics.csv"), _module(qk_clip=50.0)
    writer.on_train_start(trainer, module)
    for step in (1, 2):
        trainer.global_step = step
        module.records[step] = StepRecord(step, torch.tensor(1.0), torch.tensor(1.0), 1e-3, eager=False,
                                          qk_clipped_heads=torch.tensor(3 - step))
        writer.on_train_batch_end(trainer, module, None, None, step - 1)
    writer.on_train_end(trainer, module)
    columns, rows = _rows(tmp_path / "metrics.csv")
    assert "qk_clipped_heads" in columns and [float(r["qk_clipped_heads"]) for r in rows] == [2, 1]


def test_the_summary_of_a_resumed_post_validated_run_covers_its_own_steps(capsys):
    """Resumed from step 4 (with 1 step redone and none skipped before it), the run's steps 5-7: the summary says so,
    its loss curve starts at step 5, a single validation is one point, and the redone and skipped steps are this
    run's."""
    from mlplat.lightning.callbacks import RunSummary
    from tests.helpers.equivalence import make_cfg

    summary = RunSummary(make_cfg(post_validate=True, grad_clip=1.0, steps=7))
    step = SimpleNamespace(redone_steps=1, skipped_steps=0, device=torch.device("cpu"))
    module = SimpleNamespace(records={}, step=step)
    trainer = SimpleNamespace(global_step=4, callbacks=[], callback_metrics={}, sanity_checking=False,
                              is_global_zero=True)
    module.records[4] = StepRecord(4, torch.tensor(2.0), torch.tensor(1.0), 1e-3, eager=True, redone_steps=1)
    summary.on_train_start(trainer, module)
    for k in (5, 6, 7):
        trainer.global_step = k
        summary.on_train_batch_start(trainer, module, None, k - 1)
        module.records[k] = StepRecord(k, torch.tensor(1.0 / k), torch.tensor(1.0), 1e-3, eager=True,
                                       redone_steps=1 + (k >= 6) + (k >= 7), skipped_steps=int(k >= 7) or None)
        summary.on_train_batch_end(trainer, module, None, None, k - 1)
    trainer.callback_metrics["val_loss"] = torch.tensor(1.5)
    summary.on_validation_end(trainer, module)
    summary.on_train_end(trainer, module)
    lines = capsys.readouterr().out.split("--- run summary ---\n", 1)[1].splitlines()
    assert lines[1] == ("steps       5-7, resumed from step 4, 2 redone (post-validation: stepped before their "
                        "checks, then undone or redone), 1 skipped (an inf/NaN loss or gradient norm)"), lines
    assert lines[2] == "train loss  0.200 (step 5) -> 0.143 (step 7)" and lines[3] == "val loss    1.500 (step 7)"
