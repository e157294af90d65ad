"""Counting the model's GEMMs at the one GEMM path (`mlplat.parallel.linear`): tests/parallel/test_linear.py and
tests/parallel/test_sequence.py."""
from __future__ import annotations

from collections import Counter

from torch import nn

from mlplat.model.decoder import DecoderChunk
from mlplat.parallel.linear import Gemm


class CountingGemm(Gemm):
    """The dense products, counted by kind."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def forward(self, x, weight, bias):
        self.calls["forward"] += 1
        return super().forward(x, weight, bias)

    def input_grad(self, grad_out, weight):
        self.calls["input_grad"] += 1
        return super().input_grad(grad_out, weight)

    def weight_grad(self, grad_out, x, weight):
        self.calls["weight_grad"] += 1
        return super().weight_grad(grad_out, x, weight)


def set_on_modules(root: nn.Module, attr: str, value) -> int:
    """`value` on every module of `root` that takes `attr` (as the engine sets its W stores); how many."""
    mods = [m for m in root.modules() if hasattr(m, attr)]
    for m in mods:
        setattr(m, attr, value)
    return len(mods)


def gemms_of(chunk: DecoderChunk) -> int:
    """The GEMMs of a chunk counted from the model's structure: qkv, out, fc1, fc2 per layer, and the logits."""
    return 4 * len(chunk.layers) + int(chunk.is_last)
