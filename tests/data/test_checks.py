"""Bad data and sample settings are refused before any process starts, in one line (mlplat.data.checks, run by
mlplat.train.preflight, and the config's sample section)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.data import byte_prefix, gpt2_available
from tests.helpers.paths import CONF


@pytest.fixture(scope="module")
def hydra_conf():
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def _preflight(*overrides: str):
    """As `python -m mlplat.train parallel=single OVERRIDES` checks it before starting anything."""
    from hydra import compose

    from mlplat.train import load_checked, preflight

    return preflight(load_checked(compose(config_name="config", overrides=["parallel=single", "logger=none",
                                                                           *overrides])), Path("unused-run-dir"))


def _refusal(*overrides: str) -> str:
    from mlplat.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        _preflight(*overrides)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_bad_data_and_sample_settings_are_one_line(hydra_conf, tmp_path):
    prefix = byte_prefix(tmp_path / "small", n_docs=40, doc_len=30)  # 1200 tokens: 9 windows of 128
    big = byte_prefix(tmp_path / "big", n_docs=1000, doc_len=100)
    ok = _preflight("data=indexed", f"data.prefix={big}", "data.tokenizer=byte")
    assert ok.model.vocab_size == 256
    cases = {
        ("data=indexed",): ["data.prefix=PREFIX"],
        ("data=indexed", f"data.prefix={tmp_path / 'nope'}", "data.tokenizer=byte"): ["does not exist"],
        ("data=indexed", f"data.prefix={prefix}", "data.tokenizer=byte"):
            ["too small", "training split", "gives 9 windows"],
        ("data=indexed", f"data.blend=[0.3,{big},-1,{big}]", "data.tokenizer=byte"): ["weight -1", "positive"],
        ("data=indexed", f"data.blend=[0.3,{big},0.7]", "data.tokenizer=byte"): ["pairs"],
        ("data=indexed", f"data.prefix={big}",): ["data.tokenizer=null", "PREFIX.meta.json"],
        ("data=indexed", f"data.prefix={big}", "data.tokenizer=byte", "data.split=[1,2]"): ["data.split"],
        ("data=indexed", f"data.prefix={big}", "data.tokenizer=/nope/tok.json"): ["data.tokenizer=/nope/tok.json"],
        ("sample.temperature=-1",): ["sample.temperature=-1"],
        ("sample.top_k=-2",): ["sample.top_k=-2"],
        ("sample.top_p=0",): ["sample.top_p=0"],
    }
    if gpt2_available():
        cases[("data.tokenizer=gpt2", "model.vocab_size=256")] = ["model.vocab_size=256", "50257"]
    for overrides, fragments in cases.items():
        message = _refusal(*overrides)
        for fragment in fragments:
            assert fragment in message, (overrides, message)


def _record(prefix: str, tokenizer: str, vocab_size: int, eod: int) -> None:
    """PREFIX.meta.json as mlplat.data.preprocess writes it."""
    Path(prefix + ".meta.json").write_text(json.dumps({"tokenizer": tokenizer, "vocab_size": vocab_size, "eod": eod}))


def test_data_of_another_tokenizer_is_refused(hydra_conf, tmp_path):
    """Data preprocessed with gpt2 and trained with data.tokenizer=byte once trained silently (step-1 loss 10.8, a
    sample of replacement characters): the tokenizer PREFIX.meta.json records, or for data without one the ids
    themselves, must agree with data.tokenizer."""
    from mlplat.data.indexed import IndexedWriter

    gpt2_made = byte_prefix(tmp_path / "gpt2_made", n_docs=1000, doc_len=100)
    _record(gpt2_made, "gpt2", 50257, 50256)
    message = _refusal("data=indexed", f"data.prefix={gpt2_made}", "data.tokenizer=byte")
    for fragment in ("data.tokenizer=byte is not the tokenizer", gpt2_made, "gpt2: vocabulary 50257",
                     "byte: 256, 0", "data.tokenizer=null"):
        assert fragment in message, (fragment, message)
    if gpt2_available():  # null follows the recorded tokenizer
        assert _preflight("data=indexed", f"data.prefix={gpt2_made}").data.tokenizer == "gpt2"
    # Written by another tool (no PREFIX.meta.json): ids past the tokenizer's vocabulary give it away.
    other = str(tmp_path / "other")
    with IndexedWriter(other, np.uint16) as w:
        for i in range(1000):
            w.add_document([(i * 7 + j) % 256 + 300 for j in range(100)])
    message = _refusal("data=indexed", f"data.prefix={other}", "data.tokenizer=byte")
    assert f"data.prefix: {other} holds token id 555" in message and "data.tokenizer=byte (256 tokens)" in message
    # A meta file copied from a byte-tokenized prefix does not vouch for these ids: they are read all the same.
    _record(other, "byte", 256, 0)
    assert _refusal("data=indexed", f"data.prefix={other}", "data.tokenizer=byte") == message
    # The same tokenizer under another name (its path, say) is the same vocabulary and end of document: accepted.
    same = byte_prefix(tmp_path / "same", n_docs=1000, doc_len=100)
    _record(same, "some/path/to/byte", 256, 0)
    assert _preflight("data=indexed", f"data.prefix={same}", "data.tokenizer=byte").model.vocab_size == 256


def test_packing_data_without_an_end_of_document_token_is_refused(hydra_conf, tmp_path):
    """data.pack=true on indexed data whose documents were written without the end-of-document token (Megatron's
    own tools may leave it out) would pack nothing: refused in one line; the same data trains unpacked."""
    from mlplat.data.indexed import IndexedWriter

    prefix = str(tmp_path / "no_eod")
    with IndexedWriter(prefix, np.uint16) as w:
        for i in range(1000):
            w.add_document([1 + (i * 7 + j) % 255 for j in range(100)])  # byte ids 1..255: never 0, the eod
    message = _refusal("data=indexed", f"data.prefix={prefix}", "data.tokenizer=byte", "data.pack=true")
    assert message == (f"data.pack=true: data.prefix {prefix} holds no end-of-document token (id 0) in its first "
                       f"100,000 tokens, so no document boundary is known; write it with python -m "
                       f"mlplat.data.preprocess (which ends each document with it) or set data.pack=false"), message
    assert _preflight("data=indexed", f"data.prefix={prefix}", "data.tokenizer=byte").data.pack is False


def test_a_fifo_among_the_text_files_is_refused_not_read(hydra_conf, tmp_path):
    """A FIFO named *.txt (or a device) would block data loading forever: refused in one line before any process."""
    import os

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("some text " * 5000)
    os.mkfifo(folder / "b.txt")
    assert _refusal("data=text", f"data.path={folder}") == \
        f"data.path={folder}: {folder / 'b.txt'} is a FIFO; data=text reads regular files only"
    assert _refusal("data=text", f"data.path={folder / 'b.txt'}").endswith("b.txt is a FIFO; data=text reads "
                                                                          "regular files only")
    assert "a character device" in _refusal("data=text", "data.path=/dev/zero")
