"""DataParallelSampler: the data-parallel split of each global batch is the one-process global batch.

Across the d ranks every sample of an epoch is seen exactly once (except the documented dropped tail that
cannot fill a global batch); step k's slices, concatenated in data-parallel rank order, are step k's global
batch of the one-process (dp=1) sampler; epochs are permuted differently and reproducibly.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader

from mlplat.data.sampler import DataParallelSampler

CASES = [  # (num_samples, global_batch, dp)
    (64, 16, 1), (64, 16, 2), (64, 16, 4), (67, 16, 4), (100, 12, 3), (50, 8, 8), (8, 8, 2), (23, 6, 2),
]


def _ranks(n, g, dp, epoch=0, **kw):
    out = []
    for r in range(dp):
        s = DataParallelSampler(n, g, dp, r, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("n,g,dp", CASES)
@pytest.mark.parametrize("shuffle", [True, False])
def test_each_sample_once_and_steps_are_the_global_batch(n, g, dp, shuffle):
    steps = n // g
    for epoch in (0, 3):
        ranks = _ranks(n, g, dp, epoch, shuffle=shuffle, seed=7)
        (one,) = _ranks(n, g, 1, epoch, shuffle=shuffle, seed=7)
        local = g // dp
        assert all(len(r) == steps * local == len(DataParallelSampler(n, g, dp, 0)) for r in ranks)
        seen = list(itertools.chain.from_iterable(ranks))
        assert len(seen) == len(set(seen)) == steps * g, "a sample was seen twice or missed"
        # The dropped tail is exactly the end of the epoch's order, fewer than one global batch.
        g_ = torch.Generator().manual_seed(DataParallelSampler.epoch_seed(7, epoch))
        order = torch.randperm(n, generator=g_).tolist() if shuffle else list(range(n))
        assert set(order) - set(seen) == set(order[steps * g:]) and n - len(seen) < g
        for k in range(steps):
            union = list(itertools.chain.from_iterable(r[k * local:(k + 1) * local] for r in ranks))
            assert union == one[k * g:(k + 1) * g], f"step {k}: slices != one-process global batch"


def test_epochs_permute_differently_and_reproducibly():
    orders = {e: _ranks(40, 8, 2, e, seed=3) for e in range(4)}
    flat = {e: sum(o, []) for e, o in orders.items()}
    assert len({tuple(f) for f in flat.values()}) == 4, "two epochs saw the same order"
    assert _ranks(40, 8, 2, 2, seed=3) == orders[2], "an epoch's order is not reproducible"
    assert _ranks(40, 8, 2, 0, seed=4) != orders[0], "the seed does not change the order"
    assert _ranks(40, 8, 2, 0, shuffle=False) == _ranks(40, 8, 2, 5, shuffle=False)


def test_dataloader_batches_are_the_local_slices():
    """The DataModule's DataLoader(batch_size=global/dp, sampler, drop_last) yields rank r's slice per step."""
    n, g, dp = 30, 8, 2
    data = torch.arange(n)
    (one,) = _ranks(n, g, 1, seed=5)
    for r in range(dp):
        sampler = DataParallelSampler(n, g, dp, r, seed=5)
        batches = list(DataLoader(data, batch_size=g // dp, sampler=sampler, drop_last=True))
        assert len(batches) == n // g
        for k, b in enumerate(batches):
            assert b.tolist() == one[k * g + r * (g // dp): k * g + (r + 1) * (g // dp)]


def test_invalid():
    with pytest.raises(ValueError, match="not divisible by dp=3"):
        DataParallelSampler(64, 16, 3, 0)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        DataParallelSampler(10, 16, 2, 0)
    # A rank outside [0, dp) would silently read the next step's slice (another rank's samples).
    for bad in (2, -1):
        with pytest.raises(ValueError, match="dp_rank"):
            DataParallelSampler(64, 16, 2, bad)


def _global_steps(n, g, dp, passes, shuffle=True, one_pass=False, consumed=0):
    """What a loop that calls set_epoch(e) before each pass draws: {step: global batch} over `passes` passes
    (the first after resume(consumed)), the d ranks' slices concatenated in rank order."""
    samplers = [DataParallelSampler(n, g, dp, r, shuffle=shuffle, seed=11, one_pass=one_pass) for r in range(dp)]
    steps = n // g
    epoch = consumed // g // steps
    out = {}
    for p in range(passes):
        per_rank = []
        for s in samplers:
            if p == 0 and consumed:
                s.resume(consumed)
            s.set_epoch(epoch + p)
            assert len(s) == steps * (g // dp)  # always a full epoch, whatever was consumed
            per_rank.append(list(s.batches()))
        for rank_batches in zip(*per_rank):
            (step,) = {k for k, _ in rank_batches}  # every rank numbers the step alike
            assert step not in out
            out[step] = sum((ids for _, ids in rank_batches), [])
    return out


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_resume_at_any_step_continues_the_straight_run_across_epochs(dp):
    """Epochs of seeded permutations: resumed after any number c of global batches (also at an epoch's end) and
    under another dp, the next pass is the rest of c's epoch, numbered c+1.., and later passes are whole epochs:
    step by step the global batches of the uninterrupted dp=1 run."""
    n, g = 70, 8  # 8 steps per epoch, a tail of 6 left out
    steps = n // g
    straight = _global_steps(n, g, 1, passes=5)
    assert sorted(straight) == list(range(1, 5 * steps + 1))
    for c in range(0, 3 * steps + 1):
        resumed = _global_steps(n, g, dp, passes=2, consumed=c * g)
        first_pass = steps - c % steps
        assert sorted(resumed) == list(range(c + 1, c + first_pass + steps + 1)), c
        assert all(resumed[k] == straight[k] for k in resumed), f"resumed after {c} steps under dp={dp}"


@pytest.mark.parametrize("dp", [1, 2])
def test_one_pass_resume_ignores_the_epoch_number(dp):
    """Indexed data (one pass over the cached order): a resumed pass continues at the consumed step whatever epoch
    Lightning restores, and a larger data set (a larger trainer.max_steps) keeps the same numbering; past the
    end nothing is left."""
    g = 8
    straight = _global_steps(96, g, 1, passes=1, shuffle=False, one_pass=True)
    for c in (0, 1, 5, 6, 11, 12):
        s = DataParallelSampler(96, g, dp, 0, shuffle=False, one_pass=True)
        s.resume(c * g)
        s.set_epoch(7)  # what Lightning restored does not move the data position
        got = list(s.batches())
        assert [k for k, _ in got] == list(range(c + 1, 13))
        assert [ids for _, ids in got] == [straight[k][:g // dp] for k in range(c + 1, 13)]
    s = DataParallelSampler(48, g, dp, 0, shuffle=False, one_pass=True)
    s.resume(12 * g)  # a checkpoint of step 12 resumed with trainer.max_steps=6: Lightning stops at once
    assert list(s) == [] and len(s) == 6 * (g // dp)


def test_resume_is_taken_once_and_when_the_pass_starts():
    s = DataParallelSampler(40, 8, 2, 1, seed=3)
    full = [list(DataParallelSampler(40, 8, 2, 1, seed=3).batches())]
    s.resume(2 * 8)
    iter(s)  # a pass created but never started (Lightning may create the iterator twice) does not use it up
    assert [k for k, _ in s.batches()] == [3, 4, 5]
    assert list(s.batches()) == full[0]  # the next pass of epoch 0 is whole again
    with pytest.raises(ValueError, match="negative"):
        s.resume(-8)


def _lightning_draws(run_dir, n, g, max_steps, ckpt=None, one_pass=False, record=None):
    """Train a one-weight module under a real Lightning Trainer on the mlplat training loader; a checkpoint after
    every step. Returns ({step: ids drawn by training_step}, warnings, the trainer's epoch at the end)."""
    import warnings

    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    from mlplat.lightning.datamodule import RecordingSampler, TrainLoader

    class Probe(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))
            self.drawn = {}

        def training_step(self, batch, batch_idx):
            self.drawn[self.trainer.global_step + 1] = batch.tolist()
            return self.w * batch.float().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         default_root_dir=str(run_dir),
                         callbacks=[ModelCheckpoint(dirpath=str(run_dir), filename="step-{step}", save_top_k=-1,
                                                    every_n_train_steps=1, auto_insert_metric_name=False)])
    sampler = DataParallelSampler(n, g, seed=5, one_pass=one_pass, shuffle=not one_pass)
    if record is not None:
        sampler = RecordingSampler(sampler, record)
    loader = TrainLoader(torch.arange(n), lambda: trainer.global_step * g, batch_size=g, sampler=sampler,
                         drop_last=True)
    probe = Probe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(probe, train_dataloaders=loader, ckpt_path=ckpt)
    return probe.drawn, [str(w.message) for w in caught], trainer.current_epoch


def test_lightning_resume_draws_the_straight_runs_batches(tmp_path):
    """Lightning 2's own loop: resumed from the checkpoint of every step (mid-epoch and at an epoch's end), the
    batches of every later step, over two more epoch ends, are the uninterrupted run's; Lightning does not warn
    that the dataloader is not resumable; samples.csv numbers each step as Lightning does."""
    import csv

    n, g, total = 10, 3, 8  # 3 steps per epoch: epoch ends after steps 3 and 6
    straight, _, epoch = _lightning_draws(tmp_path / "straight", n, g, total)
    assert sorted(straight) == list(range(1, total + 1))
    assert straight[4] != straight[1]  # epochs are permuted differently
    for k in (1, 2, 3, 4):
        rec = tmp_path / f"samples-{k}.csv"
        drawn, caught, epoch_ = _lightning_draws(tmp_path / f"from-{k}", n, g, total,
                                                ckpt=tmp_path / "straight" / f"step-{k}.ckpt", record=rec)
        assert drawn == {s: straight[s] for s in range(k + 1, total + 1)}, f"resumed from step {k}"
        assert not [w for w in caught if "not resumable" in w], caught
        assert epoch_ == epoch  # Lightning's epoch count agrees too
        with open(rec, newline="") as f:
            assert {int(s): [int(i) for i in ids.split()] for s, ids in csv.reader(f)} == drawn


def test_lightning_resume_of_one_pass_with_a_larger_max_steps(tmp_path):
    """Indexed data: the run's data is max_steps global batches (one pass); a run of 3 steps resumed at step 2 or
    at its end with max_steps=7 (a longer pass with the same prefix) draws the 7-step run's batches."""
    g = 2
    straight, _, _ = _lightning_draws(tmp_path / "straight", 7 * g, g, 7, one_pass=True)
    _lightning_draws(tmp_path / "short", 3 * g, g, 3, one_pass=True)
    for k in (2, 3):
        drawn, caught, _ = _lightning_draws(tmp_path / f"from-{k}", 7 * g, g, 7, one_pass=True,
                                            ckpt=tmp_path / "short" / f"step-{k}.ckpt")
        assert drawn == {s: straight[s] for s in range(k + 1, 8)}, f"resumed from step {k}"
        assert not [w for w in caught if "not resumable" in w], caught
