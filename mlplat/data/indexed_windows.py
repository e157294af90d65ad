"""Training samples from indexed data (`data=indexed`): document splits, token windows and blends.

- `data.split=969,30,1` splits each prefix's documents, in file order, into train / valid / test: the
  boundaries are the weights' cumulative fractions of the document count, rounded.
- A split's documents are one token stream (each ends in the end-of-document token); sample windows are
  seq_len+1 tokens starting every seq_len tokens, so a window may cross from one document into the next.
- The order of the samples is `mlplat.data.sample_index`, cached by `mlplat.data.index_cache`; the tokens are
  read from the memory-mapped PREFIX.bin when a sample is asked for.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from mlplat.data.index_cache import cached_index, index_path
from mlplat.data.indexed import IndexedTokens
from mlplat.data.sample_index import build_sample_index
from mlplat.errors import DataError

SPLITS = ("train", "valid", "test")


def parse_split(value) -> tuple[float, float, float]:
    """`969,30,1` or [969, 30, 1] -> three weights; ValueError (one line) otherwise."""
    parts = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else [value]
    try:
        weights = tuple(float(p) for p in parts)
    except (TypeError, ValueError):
        weights = ()
    if len(weights) != 3 or any(not np.isfinite(w) or w < 0 for w in weights) or weights[0] <= 0:
        raise ValueError(f"data.split={value} must be three non-negative numbers train,valid,test with train > 0 "
                         f"(e.g. data.split=969,30,1)")
    return weights  # type: ignore[return-value]


def parse_blend(prefix: str | None, blend) -> list[tuple[float, str]]:
    """[(weight, prefix)] from data.prefix or data.blend=[w1, prefix1, w2, prefix2, ...]."""
    if blend is None:
        if prefix is None:
            raise ValueError("data=indexed needs data.prefix=PREFIX or data.blend=[W1, PREFIX1, W2, PREFIX2]")
        return [(1.0, str(prefix))]
    if prefix is not None:
        raise ValueError(f"data.prefix={prefix} and data.blend are both set: give one of them")
    items = list(blend) if isinstance(blend, (list, tuple)) else None
    if not items or len(items) % 2:
        raise ValueError(f"data.blend={blend} must be pairs of a weight and a prefix: [W1, PREFIX1, W2, PREFIX2]")
    pairs = []
    for w, p in zip(items[::2], items[1::2]):
        ok = isinstance(w, (int, float)) and not isinstance(w, bool) and np.isfinite(w) and w > 0
        if not ok:
            raise ValueError(f"data.blend={list(items)}: the weight {w!r} of {p} must be a positive number")
        pairs.append((float(w), str(p)))
    return pairs


def split_bounds(n_docs: int, split: tuple[float, float, float]) -> list[tuple[int, int]]:
    cum = np.cumsum(split) / sum(split)
    b = [0] + [int(round(c * n_docs)) for c in cum]
    b[-1] = n_docs
    return [(b[i], b[i + 1]) for i in range(3)]


class SplitWindows:
    """The windows of one split of one prefix."""

    def __init__(self, data: IndexedTokens, docs: tuple[int, int], seq_len: int):
        self.data, self.seq_len = data, seq_len
        self.start, self.end = int(data.doc_start[docs[0]]), int(data.doc_start[docs[1]])
        self.count = max(0, (self.end - self.start - 1) // seq_len)

    def window(self, j: int) -> np.ndarray:
        lo = self.start + j * self.seq_len
        return np.asarray(self.data.tokens[lo: lo + self.seq_len + 1], dtype=np.int64)


def open_sources(sources: list[tuple[float, str]], split, seq_len: int, key: str = "data.prefix"
                 ) -> dict[str, list[SplitWindows]]:
    """split name -> the windows of that split in each source (opening reads only the indices)."""
    weights = parse_split(split)
    out: dict[str, list[SplitWindows]] = {name: [] for name in SPLITS}
    for _, prefix in sources:
        data = IndexedTokens(prefix, key)
        for name, docs in zip(SPLITS, split_bounds(data.num_documents, weights)):
            out[name].append(SplitWindows(data, docs, seq_len))
    return out


class IndexedSamples(Dataset):
    """Sample i -> (inputs, labels), each seq_len token ids, from row i of the sample index. Each window's ids are
    checked against `vocab_size` as it is read (a max over seq_len + 1 ids on the host): the preflight scans only the
    first ID_SCAN_TOKENS of a source, and an id past the vocabulary would be a zero row of a vocabulary-parallel
    embedding (t >= 2: trains on noise without a word) or an IndexError deep in the model (t = 1)."""

    def __init__(self, windows: list[SplitWindows], index: np.ndarray, vocab_size: int | None = None):
        self.windows, self.index, self.vocab_size = windows, index, vocab_size

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        source, j = self.index[i]
        windows = self.windows[int(source)]
        ids = windows.window(int(j))
        if self.vocab_size is not None and len(ids) and (ids.max() >= self.vocab_size or ids.min() < 0):
            at = int(np.argmax((ids >= self.vocab_size) | (ids < 0)))
            raise DataError(f"data: {windows.data.prefix} holds token id {int(ids[at])} at token "
                            f"{windows.start + int(j) * windows.seq_len + at:,}, outside the model's vocabulary of "
                            f"{self.vocab_size} (model.vocab_size); the data was made with another tokenizer or "
                            f"is damaged: rewrite it with python -m mlplat.data.preprocess")
        w = torch.from_numpy(ids)
        return w[:-1], w[1:]


def indexed_samples(sources: list[tuple[float, str]], split, which: str, seq_len: int, n_samples: int,
                    seed: int, cache_dir: str | None = None, vocab_size: int | None = None) -> IndexedSamples:
    """The first n_samples of split `which` (train/valid/test), in the cached order; their ids checked against
    `vocab_size` as they are read (None: not checked)."""
    windows = open_sources(sources, split, seq_len)[which]
    counts = [w.count for w in windows]
    if sum(counts) == 0 or any(c == 0 for c in counts):
        empty = [p for (_, p), c in zip(sources, counts) if c == 0]
        raise ValueError(f"the {which} split of {', '.join(empty)} holds no window of model.seq_len+1={seq_len + 1} "
                         f"tokens (data.split={split})")
    stats = [[os.path.abspath(p), os.stat(p + ".bin").st_size, os.stat(p + ".idx").st_mtime_ns] for _, p in sources]
    key = {"sources": stats, "weights": [w for w, _ in sources], "split": list(parse_split(split)),
           "which": which, "seq_len": seq_len, "seed": seed, "n": n_samples, "format": 1}
    path = index_path(f"{Path(sources[0][1]).name}-{which}", key, Path(sources[0][1]).resolve().parent,
                      Path(cache_dir).expanduser() if cache_dir else None)
    index = cached_index(path, lambda: build_sample_index(counts, [w for w, _ in sources], n_samples, seed,
                                                          SPLITS.index(which)))
    return IndexedSamples(windows, index, vocab_size)
