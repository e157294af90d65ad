"""Where GPT-2's vocab.json and merges.txt are found, and the one line that says where to put them."""
from __future__ import annotations

import pytest

from mlplat.data import gpt2_files
from mlplat.data.tokenizer import TokenizerError, load_tokenizer


def test_gpt2_without_files_is_one_line_saying_where(monkeypatch, tmp_path):
    monkeypatch.setenv("MLPLAT_TOKENIZERS", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(gpt2_files, "_package_dir", lambda: None)
    monkeypatch.setattr(gpt2_files, "_hf_cache", lambda: None)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer("gpt2")
    message = str(info.value)
    assert "\n" not in message and "data.tokenizer=gpt2" in message and ".cache/mlplat/gpt2" in message


def test_gpt2_files_from_the_documented_folder(monkeypatch, tmp_path):
    (tmp_path / "gpt2").mkdir()
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / "gpt2" / name).write_text("{}" if name.endswith("json") else "#version: 0.2\n")
    monkeypatch.setenv("MLPLAT_TOKENIZERS", str(tmp_path))
    assert gpt2_files.find_gpt2_files() == (tmp_path / "gpt2" / "vocab.json", tmp_path / "gpt2" / "merges.txt")
