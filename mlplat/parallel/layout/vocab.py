"""Vocabulary padding for tensor parallelism (pure arithmetic: the planner in mlplat.perf uses it without torch)."""
from __future__ import annotations


def pad_vocab_size(vocab_size: int, tp: int = 1, multiple: int = 128) -> int:
    """Smallest multiple of ``multiple * tp`` that is >= vocab_size, so every shard is GEMM-friendly."""
    step = multiple * tp
    return -(-vocab_size // step) * step
