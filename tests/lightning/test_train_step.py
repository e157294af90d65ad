"""The training step without Lightning: a plain loop of `TrainStep.run(batch)` trains, and equals the Trainer's run.

One process, float64, dropout 0.1 (so the RNG streams must match too), the main job's data: 4 steps through
`trainer.fit` (the LightningModule adapting the same TrainStep, validation after step 2) and 4 steps of a plain
loop over the DataModule's batches. Every step's loss, gradient norm and learning rate, and the final weights,
are equal bit for bit; synchronous, and post-validated with clipping (steps redone). The multi-rank layouts of
`TrainStep.run` equal one process in tests/lightning/test_equivalence.py (its training jobs on 8 ranks).
"""
from __future__ import annotations

import pytest
import torch

from mlplat.parallel.grid import ParallelGrid
from mlplat.step import TrainStep
from tests.helpers.kernels import VARIANTS, make_cfg, named_parameters

STEPS = 4


def _cfg(post_validate: bool):
    cfg = make_cfg(VARIANTS["plain"], global_batch=8)
    cfg.trainer.max_steps, cfg.trainer.val_check_interval, cfg.trainer.limit_val_batches = STEPS, 2, 1
    cfg.optim.post_validate, cfg.optim.grad_clip, cfg.optim.lr = post_validate, 0.5, 1e-2
    return cfg


def _trainer_run(cfg, tmp_path) -> tuple[list, dict]:
    from mlplat.lightning.datamodule import TextDataModule
    from mlplat.lightning.module import DecoderModule
    from mlplat.train import build_trainer

    trainer = build_trainer(cfg, tmp_path)
    module = DecoderModule(cfg)
    trainer.fit(module, datamodule=TextDataModule(cfg))
    assert trainer.global_step == STEPS
    return [module.records[s] for s in range(1, STEPS + 1)], named_parameters(module.step)


def _plain_loop(cfg) -> tuple[list, dict]:
    from mlplat.lightning.datamodule import TextDataModule

    data = TextDataModule(cfg)
    data.setup("fit")
    step = TrainStep(cfg, ParallelGrid())
    records = []
    for _, batch in zip(range(STEPS), data.train_dataloader()):
        records += step.run(batch)
    records += [r for r in [step.settle()] if r is not None]  # the last step, under post-validation
    return records, named_parameters(step)


@pytest.mark.parametrize("post_validate", [False, True])
def test_a_plain_loop_of_train_step_equals_the_trainer(tmp_path, post_validate):
    torch.set_num_threads(1)
    cfg = _cfg(post_validate)
    trained, trainer_weights = _trainer_run(cfg, tmp_path)
    looped, loop_weights = _plain_loop(_cfg(post_validate))
    assert [r.step for r in looped] == list(range(1, STEPS + 1))
    for a, b in zip(looped, trained):
        assert (float(a.loss), float(a.grad_norm), a.lr, a.eager, a.redone_steps) == (
            float(b.loss), float(b.grad_norm), b.lr, b.eager, b.redone_steps), (a, b)
    assert trainer_weights.keys() == loop_weights.keys()
    assert all(torch.equal(trainer_weights[n], loop_weights[n]) for n in loop_weights)
    assert looped[0].loss.dtype == torch.float64 and float(looped[0].loss) - float(looped[-1].loss) > 0.1  # trained
    clipped = [float(r.grad_norm) > cfg.optim.grad_clip for r in looped]
    assert any(clipped)
    if post_validate:
        assert looped[-1].redone_steps >= 1 and any(r.eager for r in looped)


def test_a_step_the_caching_allocator_retried_in_is_named(caplog):
    """A retry frees the allocator's cache, a device-wide synchronize while pipeline receives are posted: the
    step says so in one line, and a hang report adds the count (its cause is then memory). CUDA's counter is
    stood in for: the CPU has no caching allocator."""
    from mlplat.lightning.datamodule import TextDataModule
    from mlplat.parallel.allocator import AllocatorRetries

    counter = {"num_alloc_retries": 0}
    cfg = _cfg(post_validate=False)
    data = TextDataModule(cfg)
    data.setup("fit")
    step = TrainStep(cfg, ParallelGrid())
    step.allocator = step.watch.allocator = AllocatorRetries(step.device, stats=lambda device: counter)
    batches = iter(data.train_dataloader())
    with caplog.at_level("WARNING", logger="mlplat"):
        step.run(next(batches))
        assert not [r for r in caplog.records if "allocator" in r.getMessage()]
        counter["num_alloc_retries"] = 3
        step.run(next(batches))
    (line,) = [r.getMessage() for r in caplog.records if "allocator" in r.getMessage()]
    assert line.startswith("rank 0, step 2: the CUDA caching allocator retried 3 allocation(s)"), line
    assert step.watch.allocator.note().startswith("; the CUDA caching allocator retried 3 allocations")
    assert AllocatorRetries(torch.device("cpu")).total() == 0


def test_a_resumed_run_does_not_read_its_init_from_directory(tmp_path, caplog):
    """With a checkpoint to resume (ckpt_path, resolved), init_from's weights would be read only to be replaced by
    the run's own weights and optimizer: the directory is not read (here it does not even exist), and one line says
    so; without one it is read."""
    cfg = _cfg(post_validate=False)
    cfg.init_from, cfg.ckpt_path = str(tmp_path / "no-such-hf-dir"), str(tmp_path / "checkpoints" / "step-2")
    with caplog.at_level("INFO", logger="mlplat"):
        TrainStep(cfg, ParallelGrid())
    assert f"init_from={cfg.init_from} not read: ckpt_path={cfg.ckpt_path} resumes the run's own weights and " \
           f"optimizer" in caplog.text
    cfg.ckpt_path = None
    with pytest.raises(Exception, match="no-such-hf-dir"):
        TrainStep(cfg, ParallelGrid())
