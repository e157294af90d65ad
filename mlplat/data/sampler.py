"""The data-parallel split of each global batch.

Each epoch is a seeded permutation cut into global batches of micro·m·d samples (a tail that cannot fill a
global batch is left out: a pipeline step needs all m micro-batches). Data-parallel rank r takes the r-th
contiguous slice of every global batch, so the d ranks together see each sample of the epoch exactly once and
the union of a step's slices is the global batch a one-process run would see.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler


class DataParallelSampler(Sampler[int]):
    def __init__(self, num_samples: int, global_batch: int, dp: int = 1, dp_rank: int = 0,
                 shuffle: bool = True, seed: int = 0):
        if dp < 1 or not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp={dp})")
        if global_batch % dp:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp}")
        if num_samples < global_batch:
            raise ValueError(f"the data has {num_samples} samples, fewer than one global batch of {global_batch}")
        self.num_samples, self.global_batch, self.dp, self.dp_rank = num_samples, global_batch, dp, dp_rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.local_batch = global_batch // dp
        self.skip_steps = 0  # resume: global batches of the current epoch already consumed (first pass only)

    @staticmethod
    def epoch_seed(seed: int, epoch: int) -> int:
        # (seed, epoch) pairs map to distinct streams: seed 3 / epoch 1 must not replay seed 4 / epoch 0.
        return seed * 1_000_003 + epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def __len__(self) -> int:
        # What the next pass yields (a resumed first pass is shorter), so Lightning's epoch length is right.
        return (self.steps_per_epoch - min(self.skip_steps, self.steps_per_epoch)) * self.local_batch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.epoch_seed(self.seed, self.epoch))
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        lo = self.dp_rank * self.local_batch
        first, self.skip_steps = min(self.skip_steps, self.steps_per_epoch), 0
        for step in range(first, self.steps_per_epoch):
            start = step * self.global_batch + lo
            yield from order[start: start + self.local_batch]
