"""Training windows over an indexed dataset: the sample index is built once and cached, windows cross documents."""
from __future__ import annotations

import numpy as np
import torch

from mlplat.data.indexed import IndexedTokens
from tests.helpers.data import byte_prefix


def test_sample_index_is_cached_once_and_windows_cross_documents(tmp_path, monkeypatch):
    from mlplat.data import index_cache
    from mlplat.data.indexed_windows import indexed_samples, split_bounds

    prefix = byte_prefix(tmp_path / "d")
    ds = indexed_samples([(1.0, prefix)], "969,30,1", "train", seq_len=16, n_samples=64, seed=1)
    cached = list((tmp_path / ".mlplat-index").glob("*.npy"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    again = indexed_samples([(1.0, prefix)], [969, 30, 1], "train", seq_len=16, n_samples=64, seed=1)
    assert cached[0].stat().st_mtime_ns == stamp and np.array_equal(ds.index, again.index)
    x, y = ds[0]
    assert x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])
    # Windows are read from the stream of the split's documents: window j starts at token 16·j.
    data = IndexedTokens(prefix)
    stream = np.concatenate([data.document(i) for i in range(*split_bounds(200, (969, 30, 1))[0])])
    j = int(ds.index[0, 1])
    assert x.tolist() == stream[16 * j: 16 * j + 16].tolist()
    # A read-only data folder: the index goes to the cache folder instead.
    monkeypatch.setattr(index_cache, "writable", lambda folder: False)
    monkeypatch.setenv("MLPLAT_CACHE", str(tmp_path / "cache"))
    indexed_samples([(1.0, prefix)], "969,30,1", "valid", seq_len=16, n_samples=16, seed=1)
    assert len(list((tmp_path / "cache").glob("d-valid-*.npy"))) == 1
