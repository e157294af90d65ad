"""Blends and the sample index: sources drawn in proportion, deterministically, each pass a permutation."""
from __future__ import annotations

import numpy as np

from mlplat.data.sample_index import blend_order, build_sample_index


def test_blend_draws_in_proportion_deterministically():
    a = build_sample_index([500, 800], [0.3, 0.7], 10_000, seed=7)
    assert abs(np.mean(a[:, 0] == 0) - 0.3) <= 0.02 and abs(np.mean(a[:, 0] == 1) - 0.7) <= 0.02
    for i in (10, 100, 1000, 9999):  # every prefix is within one sample of the exact share
        assert abs(np.count_nonzero(a[:i, 0] == 0) - 0.3 * i) <= 1
    assert np.array_equal(a, build_sample_index([500, 800], [0.3, 0.7], 10_000, seed=7))
    assert not np.array_equal(a[:, 1], build_sample_index([500, 800], [0.3, 0.7], 10_000, seed=8)[:, 1])
    # Each pass over a source's windows is a permutation of them; the index for fewer samples is a prefix.
    first_pass = a[a[:, 0] == 0, 1][:500]
    assert sorted(first_pass.tolist()) == list(range(500))
    assert np.array_equal(build_sample_index([500, 800], [0.3, 0.7], 1234, seed=7), a[:1234])
    assert blend_order([1.0], 5).tolist() == [0] * 5
