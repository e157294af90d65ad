"""The dense MLPs, one entry each (the value of `model.mlp`): everything mlplat knows about an MLP, in one place.

Pure data, no torch (as the pipeline schedules' registry, `mlplat.parallel.layout.registry`). An entry declares
its GEMMs (`mlplat.specs.blocks.Gemm`: shapes, splits, biases, fc1's parts), its default width, its rules on the
other model keys, the element-wise traffic of its activation and the activations it keeps for the backward, and
where its runtime lives (`impl`: a class, or "module:Class" imported when a layer is built). From the entry the
config accepts the name and checks its rules, the model builds it (`mlplat.model.decoder.make_mlp`, and the MoE
layer's experts their fc1 of `fc1_parts`), the closed forms count its parameters and FLOPs (`mlplat.perf.flops`),
the cost and memory models charge its GEMMs, traffic and activations (`mlplat.perf`), and the Hugging Face mapping
splits a fc1 of two parts into gate and up (`mlplat.checkpoint.hf`); nothing else branches on an MLP's name.

The runtime's contract (`mlplat.model.decoder.ParallelMLP` implements it): built as impl(cfg, grid, kernels,
device=, dtype=, sequence_parallel=) with its GEMMs as submodules named as the entry names them; forward(x) is its
output, with kernels.fused the pair (output without its bias, the bias); set_kernels(kernels) switches a built one's
kernels.

Adding an MLP is its runtime class plus one `register(MLP(...))`; `registered` adds one for the length of a `with`
block (a test's toy MLP, tests/model/test_blocks.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from mlplat.specs.blocks import Gemm, no_rules
from mlplat.specs.registry import Part, Registry

ModelConfig = Any  # a mlplat.config.ModelConfig, its nulls resolved: the config imports this module


@dataclass(frozen=True)
class MLP(Part):
    # In the order a token meets them: a column-parallel fc1 (h -> its width), a row-parallel fc2 (w -> h)
    gemms: tuple[Gemm, ...]
    width: Callable[[int], int]  # h -> w, the width of a model.ffn_hidden left null
    # Elements its activation reads and writes per token and unit of w, on fc1's output (GeLU: w in, w out)
    elementwise: int
    # Elements of fc1's output and fc2's input it keeps per token and unit of w for the backward: unfused, and
    # under kernels.fused (the compiled activation may keep fewer)
    kept: int
    kept_fused: int
    # model -> what it refuses, one line each (model.activation=gelu_tanh under SwiGLU)
    rules: Callable[[ModelConfig], Iterable[str]] = no_rules
    # The MoE layer's experts can compute it (mlplat.model.moe's gate-weighted activation: GeLU and SwiGLU)
    experts: bool = False

    def weights(self, h: int, w: int) -> int:
        """Its GEMMs' weights at width w."""
        return sum(g.weights(h, w) for g in self.gemms)

    def biases(self, h: int, w: int) -> tuple[int, int]:
        """Its biases at width w, with model.bias: (split over the t ranks, replicated on them)."""
        split, replicated = zip(*(g.biases(h, w) for g in self.gemms))
        return sum(split), sum(replicated)

    @property
    def fc1(self) -> Gemm:
        """The column-parallel GEMM that widens h to the activation's input."""
        return next(g for g in self.gemms if g.split == "column")

    @property
    def fc1_parts(self) -> int:
        return self.fc1.parts

    def fc1_width(self, h: int, w: float) -> float:
        """fc1's output width: w, or 2w for SwiGLU (gate and up in one GEMM)."""
        return self.fc1.out(h, w)

    def kept_elements(self, w: float, fused: bool = False) -> float:
        return (self.kept_fused if fused else self.kept) * w

    def violations(self, model: ModelConfig) -> list[str]:
        return list(self.rules(model))


_ENTRIES: Registry[MLP] = Registry("MLP", "model.mlp")
register, unregister, registered = _ENTRIES.register, _ENTRIES.unregister, _ENTRIES.registered
names, get = _ENTRIES.names, _ENTRIES.get


# fc1 h -> w (its parts stacked), fc2 w -> h: the two GEMMs of the MLPs below
def two_gemms(fc1_parts: int = 1) -> tuple[Gemm, ...]:
    return (Gemm("fc1", lambda h, w: fc1_parts * w, lambda h, w: h, "column", parts=fc1_parts),
            Gemm("fc2", lambda h, w: h, lambda h, w: w, "row"))


def _llama_width(h: int) -> int:
    """8h/3 rounded up to a multiple of 256: Llama's rule, as many weights as 4h in two matrices."""
    width = -(-8 * h // 3)  # ceil(8h/3)
    return -(-width // 256) * 256


def _swiglu_rules(model: ModelConfig) -> Iterable[str]:
    if model.activation != "gelu":
        yield f"model.activation={model.activation} applies to model.mlp=gelu; model.mlp=swiglu gates with SiLU"


# Vaswani et al. 2017 with Hendrycks and Gimpel's GeLU (the paper's GPT): fc2(GeLU(fc1(x))), w = 4h;
# model.activation picks the exact GeLU or GPT-2's tanh approximation. It keeps fc1's output and fc2's input.
register(MLP("gelu", "GeLU", "mlplat.model.decoder:GeLUMLP", two_gemms(), lambda h: 4 * h, elementwise=2, kept=2,
             kept_fused=2, experts=True))
# Shazeer 2020, "GLU Variants Improve Transformer" (Llama): fc2(SiLU(gate)·up), gate and up the two parts of fc1.
# Its activation reads 2w and writes w; it keeps gate and up, SiLU(gate) and fc2's input, SiLU(gate) not when fused.
register(MLP("swiglu", "SwiGLU", "mlplat.model.decoder:SwiGLUMLP", two_gemms(2), _llama_width, elementwise=3,
             kept=4, kept_fused=3, rules=_swiglu_rules, experts=True))
