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


@pytest.mark.parametrize("skip", [0, 1, 3, 9])
def test_resume_skips_consumed_steps_once(skip):
    """skip_steps (set on resume) continues the epoch where it stopped: the remaining steps, on every dp rank, are
    those of an uninterrupted epoch; the next epoch is complete again."""
    n, g, dp = 70, 8, 2
    steps, local = n // g, g // dp
    for r in range(dp):
        full = DataParallelSampler(n, g, dp, r, seed=11)
        resumed = DataParallelSampler(n, g, dp, r, seed=11)
        resumed.skip_steps = skip
        assert list(resumed) == list(full)[min(skip, steps) * local:]
        resumed.set_epoch(1)
        full.set_epoch(1)
        assert list(resumed) == list(full)


def test_resume_position_is_the_same_global_order_under_any_dp():
    from mlplat.data.sampler import DataParallelSampler

    def global_batches(dp: int, skip: int) -> list[list[int]]:
        ranks = []
        for r in range(dp):
            s = DataParallelSampler(64, 8, dp, r, shuffle=False)
            s.skip_steps = skip
            ranks.append(list(s))
        per = 8 // dp
        return [sum((rank[k * per:(k + 1) * per] for rank in ranks), []) for k in range(len(ranks[0]) // per)]

    straight = global_batches(1, 0)
    assert global_batches(2, 3) == global_batches(4, 3) == straight[3:]
