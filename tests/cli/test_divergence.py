"""A loss that goes wrong is caught: an inf/NaN loss or gradient norm skips the optimizer step and is counted, with
or without loss scaling, and optim.max_skipped_steps of them in a row stop the run with one line.

In this process: a TrainStep (float64, no loss scaler) whose embedding is poisoned with a NaN after step 2 skips
steps 3 and 4 without moving a weight and stops at step 5, synchronous and post-validated (where the inf/NaN norm is
read after the next pass and its step undone). Through the CLI: a learning rate of 1e300 makes the weights overflow
after step 1; steps 2 and 3 are skipped and the run exits 2 with one error line, its checkpoints of steps 1 and 2
complete.
"""
from __future__ import annotations

import pytest
import torch

from mlplat.errors import ConfigError, DivergenceError
from mlplat.parallel.grid import ParallelGrid
from mlplat.step import TrainStep
from tests.helpers.cli import run_train
from tests.helpers.equivalence import local_batches, make_cfg


@pytest.mark.parametrize("post_validate", [False, True])
def test_inf_nan_steps_are_skipped_counted_and_stop_the_run(post_validate):
    torch.set_num_threads(1)
    cfg = make_cfg(grad_clip=1.0, post_validate=post_validate, steps=6)
    cfg.optim.max_skipped_steps = 3
    step = TrainStep(cfg, ParallelGrid())
    batches = local_batches(cfg, 0, 6)
    records = step.run(batches[0]) + step.run(batches[1])
    records += [r for r in [step.settle()] if r is not None]
    assert [r.skipped_steps for r in records] == [None, None]  # nothing skipped yet: not logged
    good = [p.detach().clone() for p in step.parameters()]
    with torch.no_grad():
        step.chunks[0].embedding.word.weight.fill_(float("nan"))  # every token's embedding
    poisoned = [p.detach().clone() for p in step.parameters()]
    records = step.run(batches[2]) + step.run(batches[3])
    with pytest.raises(DivergenceError, match=r"^step 5: the loss or the gradient norm was inf/NaN at 3 steps in a "
                                              r"row \(optim.max_skipped_steps=3\): training stopped$"):
        records += step.run(batches[4])
        records += [r for r in [step.settle()] if r is not None]
    assert [r.step for r in records] == [3, 4] and [r.skipped_steps for r in records] == [1, 2]
    assert all(not torch.isfinite(r.loss) for r in records)
    assert step.skips.total == 3 and step.state_dict()["skipped_in_a_row"] == 3
    # No skipped step moved a weight (the poisoned ones stay as they were, the others as after step 2).
    assert all(torch.equal(a, b) for a, b in zip(step.parameters(), poisoned) if torch.isfinite(b).all())
    assert sum(not torch.equal(a, b) for a, b in zip(good, poisoned)) == 1


def test_max_skipped_steps_is_validated():
    from mlplat.config import validate

    cfg = make_cfg()
    cfg.optim.max_skipped_steps = 0
    with pytest.raises(ConfigError, match=r"^optim.max_skipped_steps=0 must be at least 1$"):
        validate(cfg, world_size=1, check_data=False)


@pytest.mark.slow
@pytest.mark.parametrize("restarts", [0, 1])
def test_a_diverging_run_exits_with_one_line_and_keeps_its_checkpoints(tmp_path, restarts):
    """Also under trainer.max_restarts: the run's own verdict is not a fault, and a restart would reach it again."""
    from mlplat.checkpoint import io

    proc = run_train(tmp_path, f"trainer.max_restarts={restarts}", "parallel=single", "model.hidden=32",
                     "model.n_heads=4", "model.seq_len=32",
                     "model.n_layers=2", "parallel.micro_batch_size=1", "parallel.global_batch_size=2",
                     "trainer.precision=64-true", "optim.lr=1e300", "optim.warmup_steps=0", "optim.grad_clip=0",
                     "optim.max_skipped_steps=2", "trainer.max_steps=6", "checkpoint.every_steps=1", "logger=none",
                     "sample.max_new_tokens=0", "trainer.val_check_interval=1000", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors == ["error: step 3: the loss or the gradient norm was inf/NaN at 2 steps in a row "
                      "(optim.max_skipped_steps=2): training stopped"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "mlplat: restart" not in proc.stderr
    root = tmp_path / "checkpoints"
    assert [step for step, _ in io.checkpoint_dirs(root)] == [1, 2]
    io.verify(io.find_last(root))


@pytest.mark.slow
def test_a_run_that_ends_inside_skipped_steps_keeps_latest_on_a_good_checkpoint(tmp_path):
    """The learning rate of 1e300 with optim.max_skipped_steps=10: steps 2-4 are skipped and the run ends inside them.
    Their checkpoints are saved (nothing lost) but not `latest`, one line each; `latest` stays step-1, the last saved
    after a step that stood; the run ends with one error line and exit status 2 (docs/checkpoints.md)."""
    from mlplat.checkpoint import io

    proc = run_train(tmp_path, "parallel=single", "model.hidden=32", "model.n_heads=4", "model.seq_len=32",
                     "model.n_layers=2", "parallel.micro_batch_size=1", "parallel.global_batch_size=2",
                     "trainer.precision=64-true", "optim.lr=1e300", "optim.warmup_steps=0", "optim.grad_clip=0",
                     "optim.max_skipped_steps=10", "trainer.max_steps=4", "checkpoint.every_steps=1", "logger=none",
                     "sample.max_new_tokens=0", "trainer.val_check_interval=1000", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors == ["error: the run ended inside 3 skipped steps (steps 2-4: an inf/NaN loss or gradient norm, "
                      "fewer in a row than optim.max_skipped_steps=10); the latest checkpoint stays step-1"], errors
    out = proc.stdout + proc.stderr
    for step, skipped in ((2, "1 skipped step"), (3, "2 skipped steps"), (4, "3 skipped steps")):
        assert f"checkpoint step-{step} was saved after {skipped} in a row (an inf/NaN loss or gradient norm): not " \
               f"recorded as the latest, which stays step-1" in out
    root = tmp_path / "checkpoints"
    assert [step for step, _ in io.checkpoint_dirs(root)] == [1, 2, 3, 4] and io.find_last(root) == root / "step-1"
