"""The data-parallel split of each global batch, and the data position of a resumed run.

Each epoch is a seeded permutation cut into global batches of micro·m·d samples (a tail that cannot fill a
global batch is left out: a pipeline step needs all m micro-batches). Data-parallel rank r takes the r-th
contiguous slice of every global batch, so the d ranks together see each sample of the epoch exactly once and
the union of a step's slices is the global batch a one-process run would see.

Resuming. The run's global step s (counted from 0) is step s mod L of epoch s // L (L = steps_per_epoch), or
step s of the one pass (`one_pass`: indexed data, whose cached index is already the run's order). `resume(n)`
(n samples consumed by all ranks since the run began) makes the next pass start at step n / global_batch, in
its epoch; every later pass is a full epoch again. The length stays one full epoch: Lightning restores the
batch index within the epoch itself (its fit loop's batch progress) and ends the epoch when that index reaches
len(loader), so the resumed pass yields exactly the rest of the epoch Lightning continues. Nothing here depends
on the data-parallel degree, so a run resumed under another dp draws the same global batches.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler


class DataParallelSampler(Sampler[int]):
    def __init__(self, num_samples: int, global_batch: int, dp: int = 1, dp_rank: int = 0,
                 shuffle: bool = True, seed: int = 0, one_pass: bool = False):
        if dp < 1 or not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp={dp})")
        if global_batch % dp:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp}")
        if num_samples < global_batch:
            raise ValueError(f"the data has {num_samples} samples, fewer than one global batch of {global_batch}")
        self.num_samples, self.global_batch, self.dp, self.dp_rank = num_samples, global_batch, dp, dp_rank
        self.shuffle, self.seed, self.epoch, self.one_pass = shuffle, seed, 0, one_pass
        self.local_batch = global_batch // dp
        self._resume_step: int | None = None  # the run's global step the next pass starts at (set by resume)

    @staticmethod
    def epoch_seed(seed: int, epoch: int) -> int:
        # (seed, epoch) pairs map to distinct streams: seed 3 / epoch 1 must not replay seed 4 / epoch 0.
        return seed * 1_000_003 + epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def resume(self, consumed_samples: int) -> None:
        """Continue after `consumed_samples` (global: all ranks, all epochs since the run began): the next pass
        starts at the step the uninterrupted run would draw next, in its epoch."""
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples={consumed_samples} is negative")
        step = consumed_samples // self.global_batch
        if not self.one_pass:
            self.epoch = step // self.steps_per_epoch
        self._resume_step = step

    def __len__(self) -> int:
        # Always one full epoch: Lightning reads it once and counts a resumed epoch's consumed batches itself.
        return self.steps_per_epoch * self.local_batch

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator().manual_seed(self.epoch_seed(self.seed, epoch))
        return torch.randperm(self.num_samples, generator=g).tolist()

    def batches(self) -> Iterator[tuple[int, list[int]]]:
        """The next pass as (step, this rank's ids) per global batch; step is the run's global step, from 1."""
        steps, resume = self.steps_per_epoch, self._resume_step
        self._resume_step = None  # taken when the pass starts: later passes are full epochs
        if self.one_pass:
            epoch, first = 0, min(resume or 0, steps)  # past the pass's end (a lower max_steps): nothing left
        elif resume is None:
            epoch, first = self.epoch, 0
        else:
            epoch, first = divmod(resume, steps)
        order = self._order(epoch)
        lo = self.dp_rank * self.local_batch
        for step in range(first, steps):
            start = step * self.global_batch + lo
            yield epoch * steps + step + 1, order[start: start + self.local_batch]

    def __iter__(self) -> Iterator[int]:
        for _, ids in self.batches():
            yield from ids
