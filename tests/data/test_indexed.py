"""The Megatron indexed format (.bin/.idx): our writer and reader, and Megatron's, both ways."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mlplat.data.indexed import IndexedFormatError, IndexedTokens, IndexedWriter

DOCS = [[5, 6, 7], [300, 1], [9] * 1000, [65000, 0, 2]]


def test_writer_and_reader_round_trip(tmp_path):
    prefix = str(tmp_path / "d")
    with IndexedWriter(prefix, np.uint16) as w:
        for d in DOCS:
            w.add_document(d)
    data = IndexedTokens(prefix)
    assert data.num_documents == 4 and data.num_tokens == sum(map(len, DOCS))
    assert [data.document(i).tolist() for i in range(4)] == DOCS
    assert isinstance(data.tokens, np.memmap)
    Path(prefix + ".bin").write_bytes(Path(prefix + ".bin").read_bytes()[:-2])
    with pytest.raises(IndexedFormatError, match="holds"):
        IndexedTokens(prefix)
    with pytest.raises(IndexedFormatError, match="does not exist"):
        IndexedTokens(str(tmp_path / "nope"))


def test_megatron_reads_what_mlplat_writes_and_back(tmp_path):
    indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    ours = str(tmp_path / "ours")
    with IndexedWriter(ours, np.int32) as w:
        for d in DOCS:
            w.add_document(d)
    theirs = indexed_dataset.IndexedDataset(ours)
    assert len(theirs) == 4 and theirs.document_indices.tolist() == [0, 1, 2, 3, 4]
    assert [theirs[i].tolist() for i in range(4)] == DOCS
    # Megatron's builder -> our reader (a document of two sequences included).
    meg = str(tmp_path / "meg")
    builder = indexed_dataset.IndexedDatasetBuilder(meg + ".bin", dtype=np.uint16)
    for d in DOCS[:3]:
        builder.add_item(torch.tensor(d))
        builder.end_document()
    builder.add_item(torch.tensor(DOCS[3][:1]))
    builder.add_item(torch.tensor(DOCS[3][1:]))
    builder.end_document()
    builder.finalize(meg + ".idx")
    data = IndexedTokens(meg)
    assert [data.document(i).tolist() for i in range(4)] == DOCS
    assert Path(meg + ".idx").read_bytes()[:34] == Path(ours + ".idx").read_bytes()[:17] + \
        Path(meg + ".idx").read_bytes()[17:34]  # same magic and version
