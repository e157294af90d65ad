"""What the blocks' entries (`mlplat.specs.mlps`, `mlplat.specs.attentions`) have in common: their GEMMs, as data.

A GEMM's weight is declared by its full shape, out × in, as functions of the model's hidden size h and the block's
width w (the MLP's f; an attention's head shape, `mlplat.specs.attentions.Heads`), and by its tensor-parallel split:
"column" splits its out rows (and its bias) over the t ranks, "row" its in columns, each rank's product a partial sum
(its bias replicated, added once). From these the parameter counts, the FLOP counts and the cost models follow, and
the runtime builds its linear layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

SPLITS = ("column", "row", "replicated")


def no_rules(model: Any) -> Iterable[str]:
    """A block that refuses nothing of the other model keys."""
    return ()


@dataclass(frozen=True)
class Gemm:
    name: str  # the runtime's submodule, hence the parameters' and checkpoints' names (fc1, fc2)
    out: Callable[[int, int], int]  # (h, w) -> the full weight's rows
    inp: Callable[[int, int], int]  # (h, w) -> its columns
    split: str  # "column" | "row" (module doc) | "replicated": whole on every rank (MLA's down-projections)
    bias: bool = True  # a bias on it when the model key `bias_key` is on
    bias_key: str = "bias"  # model.bias; model.qkv_bias for the attention's QKV
    # Row blocks that are computed in one GEMM but read apart (SwiGLU's gate and up): their rows alternate unit by
    # unit, so a contiguous column split hands each rank both parts of its units.
    parts: int = 1

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"GEMM {self.name}: split={self.split!r} is not one of {', '.join(SPLITS)}")

    def has_bias(self, model) -> bool:
        """Whether `model` (its nulls resolved) puts a bias on it."""
        return self.bias and bool(getattr(model, self.bias_key))

    def weights(self, h: int, w: int) -> int:
        return self.out(h, w) * self.inp(h, w)

    def biases(self, h: int, w: int) -> tuple[int, int]:
        """(split over the t ranks, replicated on them): a column GEMM's bias is split, a row GEMM's is not."""
        if not self.bias:
            return 0, 0
        rows = self.out(h, w)
        return (rows, 0) if self.split == "column" else (0, rows)
