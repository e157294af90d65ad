"""Vocabulary padding: a multiple of 128·tp (Megatron's rule), so every tensor-parallel shard is equal."""

from __future__ import annotations

from mlplat.parallel.layout.vocab import pad_vocab_size


def test_pad_vocab_size():
    assert pad_vocab_size(51200, 8) == 51200
    assert pad_vocab_size(50257, 1) == 50304
    assert pad_vocab_size(50257, 8) == 51200
    assert pad_vocab_size(10, 4, multiple=4) == 16
    for tp in (1, 2, 4, 8):
        v = pad_vocab_size(50257, tp)
        assert v >= 50257 and v % (128 * tp) == 0 and v - 50257 < 128 * tp
