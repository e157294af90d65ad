"""The order in which a run draws its training (or validation) samples: pure numpy, deterministic for a seed.

Sample i of a split is the pair (source k, window j of source k):

- Sources are interleaved by weight (a blend `[w1, prefix1, w2, prefix2]`): the n-th sample of source k is
  due at time (n + 1/2)/w_k and samples are taken in order of due time (ties: lower k first). Every prefix of
  the order then holds each source within one sample of its exact share w_k·i.
- Within a source, samples go through its windows in a seeded permutation per pass (epoch), a new one for
  each pass; the permutation depends on (seed, split, source, pass) only.

Neither rule depends on the number of samples asked for, so the index for n samples is the first n rows of
the index for any larger n: a run resumed with a larger trainer.max_steps sees the same samples.
"""
from __future__ import annotations

import numpy as np


def blend_order(weights: list[float], n: int) -> np.ndarray:
    """Source of each of the first n samples (int64 [n])."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    per = np.ceil(n * w).astype(np.int64) + 2  # enough of each source that the first n are complete
    times = np.concatenate([(np.arange(c) + 0.5) / wk for c, wk in zip(per, w)])
    source = np.repeat(np.arange(len(w)), per)
    order = np.lexsort((source, times))[:n]  # by due time, then by source
    chosen = source[order]
    assert all(np.count_nonzero(chosen == k) < per[k] for k in range(len(w)))  # none ran out: a true prefix
    return chosen


def _pass_permutation(n_windows: int, seed: int, split: int, source: int, epoch: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, split, source, epoch])))
    return rng.permutation(n_windows)


def build_sample_index(window_counts: list[int], weights: list[float], n: int, seed: int,
                       split: int = 0) -> np.ndarray:
    """int64 [n, 2]: (source, window) of each sample, as described in the module docstring."""
    source = blend_order(weights, n)
    index = np.empty((n, 2), dtype=np.int64)
    index[:, 0] = source
    for k, count in enumerate(window_counts):
        rows = np.flatnonzero(source == k)
        if rows.size == 0:
            continue
        passes = -(-rows.size // count)
        windows = np.concatenate([_pass_permutation(count, seed, split, k, e) for e in range(passes)])
        index[rows, 1] = windows[: rows.size]
    return index
