"""Inputs that used to hang or end in a traceback, refused in one line instead: a FIFO where init_from's
config.json or weights or a checkpoint's mlplat.json should be (opening it for reading would block), a
cut-short model.safetensors, a null count in config.json, and a config.json whose architectures and
model_type name different supported models.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from mlplat.checkpoint import CheckpointError
from tests.checkpoint.test_hf import needs_hf
from tests.checkpoint.test_hf_llama import LLAMA_CONFIG, refusal, write_config
from tests.checkpoint.test_hf_mixtral import MIXTRAL_CONFIG

LLAMA_KEYS = dict(arch="llama", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=96,
                  head_dim=None)


@contextmanager
def fifo_at(path):
    """A FIFO at `path`. Should the code under test block on opening it, a writer comes after a few seconds, so that
    the test fails instead of hanging."""
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    done = threading.Event()

    def unblock():
        if done.wait(5):
            return
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as e:
            assert e.errno in (errno.ENXIO, errno.ENOENT)  # no reader: nothing blocked

    writer = threading.Thread(target=unblock, daemon=True)
    writer.start()
    try:
        yield path
    finally:
        done.set()
        writer.join()


@needs_hf
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "model.safetensors.index.json"])
def test_a_fifo_in_init_from_is_refused_before_it_is_opened(tmp_path, name):
    good = write_config(tmp_path / "dir")
    with fifo_at(good / name) as fifo:
        start = time.monotonic()
        assert refusal(good) == f"init_from={good}: {fifo} is a FIFO (named pipe), not a regular file"
        assert time.monotonic() - start < 4


@needs_hf
def test_a_fifo_as_weights_is_refused_where_they_are_read(tmp_path):
    from mlplat.checkpoint.hf import HFWeights

    with fifo_at(tmp_path / "model.safetensors") as fifo:
        with pytest.raises(CheckpointError) as refused:
            HFWeights(tmp_path, LLAMA_KEYS)
    assert str(refused.value) == f"init_from={tmp_path}: {fifo} is a FIFO (named pipe), not a regular file"


def test_a_fifo_as_a_checkpoints_manifest_is_refused_before_it_is_opened(tmp_path):
    from mlplat.checkpoint.io import read_manifest, verify

    ckpt = tmp_path / "step-10"
    ckpt.mkdir()
    with fifo_at(ckpt / "mlplat.json") as fifo:
        for read in (read_manifest, verify):
            with pytest.raises(CheckpointError) as refused:
                read(ckpt)
            assert str(refused.value) == f"checkpoint {ckpt}: {fifo} is a FIFO (named pipe), not a regular file"


@needs_hf
def test_a_truncated_safetensors_file_is_refused_in_one_line_naming_it(tmp_path):
    from safetensors.torch import save_file

    from mlplat.checkpoint.hf import HFWeights

    weights = tmp_path / "model.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(256, 64)}, str(weights))
    whole = weights.read_bytes()
    header = 8 + int.from_bytes(whole[:8], "little")
    weights.write_bytes(whole[:-100])  # the tensors cut short: safetensors' "incomplete metadata"
    with pytest.raises(CheckpointError) as refused:
        HFWeights(tmp_path, LLAMA_KEYS)
    assert str(refused.value).startswith(f"init_from={tmp_path}: {weights} is not a readable safetensors file (")
    assert "\n" not in str(refused.value)
    for cut in (header - 10, 5):  # the header itself cut short
        weights.write_bytes(whole[:cut])
        with pytest.raises(CheckpointError) as refused:
            HFWeights(tmp_path, LLAMA_KEYS)
        assert str(refused.value) == (f"init_from={tmp_path}: {weights} is truncated: {cut} bytes, fewer than its "
                                      f"header alone needs ({header if cut > 8 else 8}); copy or download it again")


@needs_hf
@pytest.mark.parametrize("value, shown", [(None, "null"), ("8", '"8"'), (True, "true")])
def test_a_count_in_config_json_that_is_not_a_whole_number_is_refused_naming_the_key(tmp_path, value, shown):
    odd = write_config(tmp_path / "odd", MIXTRAL_CONFIG, num_local_experts=value)
    assert refusal(odd) == (f"init_from={odd}: num_local_experts={shown} in config.json is not a whole number (a "
                            f"mixtral config's num_local_experts is a count or a width)")


@needs_hf
def test_architectures_and_model_type_that_disagree_are_named_both(tmp_path):
    odd = write_config(tmp_path / "odd", MIXTRAL_CONFIG, architectures=LLAMA_CONFIG["architectures"])
    assert refusal(odd) == (f"init_from={odd}: architectures=['LlamaForCausalLM'] and model_type='mixtral' in "
                            f"config.json disagree (LlamaForCausalLM is model_type 'llama', 'mixtral' is "
                            f"MixtralForCausalLM); fix the one that is wrong")


def test_a_fifo_as_the_latest_record_is_refused_before_it_is_opened(tmp_path):
    from mlplat.checkpoint.io import latest_name

    with fifo_at(tmp_path / "latest") as fifo:
        with pytest.raises(CheckpointError) as refused:
            latest_name(tmp_path)  # what find_last (ckpt_path=last) and the run's start read
    assert str(refused.value) == f"{fifo} is a FIFO (named pipe), not a regular file (the name of the last checkpoint)"
