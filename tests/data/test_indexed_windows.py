"""Training windows over an indexed dataset: the sample index is built once and cached, windows cross documents."""
from __future__ import annotations

import numpy as np
import pytest
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


def test_an_id_past_the_vocabulary_beyond_the_preflight_scan_stops_in_one_line(tmp_path):
    """The preflight reads a bounded head of each source: an id past the vocabulary later on is refused as its
    sample is read, in one line naming the data, the token and the vocabulary, also from a DataLoader worker."""
    from torch.utils.data import DataLoader

    from mlplat.data.indexed_windows import indexed_samples
    from mlplat.errors import DataError

    prefix = byte_prefix(tmp_path / "d")
    clean = indexed_samples([(1.0, prefix)], "969,30,1", "train", seq_len=16, n_samples=64, seed=1, vocab_size=256)
    assert all(clean[i][0].max() < 256 for i in range(len(clean)))
    j = int(clean.index[5, 1])
    window = clean.windows[0]
    at = window.start + 16 * j + 3
    data = np.memmap(prefix + ".bin", dtype=window.data.tokens.dtype, mode="r+")
    data[at] = 300  # past a byte tokenizer's 256 ids
    data.flush()
    bad = indexed_samples([(1.0, prefix)], "969,30,1", "train", seq_len=16, n_samples=64, seed=1, vocab_size=256)
    for workers in (0, 1):
        batches = iter(DataLoader(bad, batch_size=8, num_workers=workers))
        with pytest.raises(DataError) as caught:
            for _ in batches:
                pass
        del batches  # its workers shut down here, not in a later test's garbage collection
        line = str(caught.value)
        assert "\n" not in line and line.startswith("data: ") and f"token id 300 at token {at:,}" in line, line
        assert "vocabulary of 256" in line
