"""Megatron-Core's indexed dataset format: `PREFIX.bin` (token ids back to back) + `PREFIX.idx` (the index).

The index, all little-endian (as `megatron.core.datasets.indexed_dataset` writes and reads it):

    9 bytes   b"MMIDIDX\\x00\\x00"
    u64       version, 1
    u8        dtype code of the token ids (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
              8 uint16)
    u64       S, the number of sequences
    u64       D, the number of document indices (documents + 1)
    int32[S]  sequence lengths in tokens
    int64[S]  sequence byte offsets into PREFIX.bin
    int64[D]  document indices: document i is sequences [doc[i], doc[i+1]); doc[0] = 0

mlplat writes one sequence per document (Megatron's preprocessing does the same unless it splits sentences)
and reads any file of this format whose sequences lie back to back in PREFIX.bin (as Megatron's builder
writes them). Token ids are uint16 below a vocabulary of 65500, int32 above, as Megatron chooses.
"""
from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


class IndexedFormatError(ValueError):
    """A prefix that is missing, unreadable or not in the indexed format; str() is one line."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class IndexedWriter:
    """Streams documents into PREFIX.bin; `close()` writes PREFIX.idx. Both appear under their names only when
    complete (written as .tmp, then renamed), so an interrupted run never leaves a readable half dataset."""

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self.prefix + ".bin.tmp", "wb")
        self.lengths = array("q")  # 8 bytes per document: the index, never the corpus, is held in memory
        self.tokens = 0

    def add_document(self, ids) -> None:
        ids = np.asarray(ids, dtype=self.dtype)
        self._bin.write(ids.tobytes(order="C"))
        self.lengths.append(ids.size)
        self.tokens += ids.size

    def close(self) -> None:
        self._bin.close()
        lengths = np.frombuffer(self.lengths, dtype=np.int64) if len(self.lengths) else np.zeros(0, np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise IndexedFormatError(f"a document of {lengths.max()} tokens does not fit the format's int32 length")
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(lengths.size + 1, dtype=np.int64)
        with open(self.prefix + ".idx.tmp", "wb") as f:
            f.write(HEADER)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODES[self.dtype]))
            f.write(struct.pack("<Q", lengths.size))
            f.write(struct.pack("<Q", documents.size))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(documents.astype("<i8").tobytes())
        os.replace(self.prefix + ".bin.tmp", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.tmp", self.prefix + ".idx")

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self._bin.close()


class IndexedTokens:
    """A prefix opened read-only: the index in memory, the tokens as a numpy memmap (nothing read up front)."""

    def __init__(self, prefix: str | Path, key: str = "data.prefix"):
        self.prefix = str(prefix)
        idx, bin_ = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        for f in (idx, bin_):
            if not f.is_file():
                raise IndexedFormatError(f"{key}={self.prefix}: {f} does not exist (run python -m "
                                         f"mlplat.data.preprocess --output-prefix {self.prefix} ...)")
            if not os.access(f, os.R_OK):
                raise IndexedFormatError(f"{key}={self.prefix}: {f} is not readable")
        raw = np.fromfile(idx, dtype=np.uint8)
        head = bytes(raw[:34])
        if len(head) < 34 or head[:9] != HEADER:
            raise IndexedFormatError(f"{key}={self.prefix}: {idx} is not a Megatron indexed-dataset index "
                                     f"(bad header)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:34])
        if version != VERSION or code not in DTYPES:
            raise IndexedFormatError(f"{key}={self.prefix}: {idx} has version {version} / dtype code {code}; "
                                     f"version 1 with a code in 1..8 is supported")
        need = 34 + n_seq * (4 + 8) + n_doc * 8
        if raw.size < need or n_doc < 1:
            raise IndexedFormatError(f"{key}={self.prefix}: {idx} is truncated ({raw.size} bytes, {need} needed)")
        self.dtype = np.dtype(DTYPES[code])
        self.lengths = raw[34: 34 + 4 * n_seq].view("<i4").astype(np.int64)
        self.pointers = raw[34 + 4 * n_seq: 34 + 12 * n_seq].view("<i8")
        self.doc_index = raw[34 + 12 * n_seq: need].view("<i8")
        total = int(self.lengths.sum())
        if bin_.stat().st_size != total * self.dtype.itemsize:
            raise IndexedFormatError(f"{key}={self.prefix}: {bin_} holds {bin_.stat().st_size} bytes, the index "
                                     f"says {total * self.dtype.itemsize}")
        self.tokens = np.memmap(bin_, dtype=self.dtype, mode="r") if total else np.zeros(0, self.dtype)
        # Token offset where each document starts (and one past the end), for sequences laid back to back.
        seq_start = self.pointers // self.dtype.itemsize
        self.doc_start = np.append(seq_start, total)[self.doc_index]

    @property
    def num_documents(self) -> int:
        return self.doc_index.size - 1

    @property
    def num_tokens(self) -> int:
        return int(self.doc_start[-1])

    def document(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.doc_start[i]: self.doc_start[i + 1]])
