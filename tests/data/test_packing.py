"""data.pack=true for every source: the embedded corpus, text files and Megatron's indexed format give windows with
their documents; each document of the stream ends with the tokenizer's end-of-document token, whose label is not
counted. What the model does with the documents is tested in tests/model/test_packing.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from mlplat.data.indexed import IndexedWriter
from mlplat.labels import IGNORE
from mlplat.lightning.datamodule import TextDataModule
from mlplat.train import load_checked
from tests.helpers.paths import REPO

EOD = 0  # the byte tokenizer's


def _datamodule(*overrides: str) -> TextDataModule:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        raw = compose(config_name="config", overrides=["parallel=single", "data.pack=true", "model.seq_len=64",
                                                       *overrides])
    data = TextDataModule(load_checked(raw))
    data.setup("fit")
    return data


def _indexed(tmp_path) -> str:
    """60 documents of 5 to 64 byte tokens (never 0), each ended by EOD, as mlplat.data.preprocess writes them."""
    prefix = str(tmp_path / "docs")
    with IndexedWriter(prefix, np.uint16) as writer:
        for i in range(60):
            writer.add_document([1 + (i * 13 + j) % 250 for j in range(5 + (i * 17) % 60)] + [EOD])
    return prefix


def _texts(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(40):
        (folder / f"doc{i:02d}.txt").write_text(f"document {i}: " + "words " * (3 + i % 20), encoding="utf-8")
    return folder


@pytest.mark.parametrize("source", ["pydoc", "text", "indexed"])
def test_packed_windows_carry_their_documents(source, tmp_path):
    overrides = {"pydoc": [],
                 "text": ["data=text", f"data.path={_texts(tmp_path)}", "parallel.global_batch_size=4",
                          "parallel.micro_batch_size=2"],
                 "indexed": ["data=indexed", f"data.prefix={_indexed(tmp_path)}", "data.tokenizer=byte",
                             "data.split='90,10,0'", "trainer.max_steps=2", "parallel.global_batch_size=4",
                             "parallel.micro_batch_size=2", "trainer.limit_val_batches=1"]}[source]
    data = _datamodule(*overrides)
    boundaries = 0
    for i in range(min(len(data.train_set), 200)):
        x, y, documents = data.train_set[i]
        assert x.shape == y.shape == documents.shape == (64,)
        assert torch.equal(y == IGNORE, x == EOD)  # exactly the end-of-document positions are not counted
        ends = (x == EOD).long()
        assert torch.equal(documents, ends.cumsum(0) - ends)  # a new document after each end-of-document token
        boundaries += int(ends.sum())
    assert boundaries > 0, "no window held a document boundary"
    if source != "indexed":  # the stream of training and validation tokens: every document followed by EOD
        from mlplat.data.corpus import pydoc_documents

        total = sum(int((d.windows.tokens == EOD).sum()) for d in (data.train_set, data.val_set))
        assert total == (len(pydoc_documents()) if source == "pydoc" else 40)
