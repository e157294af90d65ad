"""Small data fixtures shared by the data tests: is GPT-2's BPE installed, a tiny indexed (byte) dataset."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mlplat.data import gpt2_files
from mlplat.data.indexed import IndexedWriter
from mlplat.data.tokenizer import TokenizerError


def gpt2_available() -> bool:
    try:
        gpt2_files.find_gpt2_files()
        return True
    except TokenizerError:
        return False


def byte_prefix(path: Path, n_docs: int = 200, doc_len: int = 50) -> str:
    prefix = str(path)
    with IndexedWriter(prefix, np.uint16) as w:
        for i in range(n_docs):
            w.add_document([(i * 7 + j) % 256 for j in range(doc_len)])
    return prefix
