"""FP8 GEMMs with current scaling, through the one GEMM path (`mlplat.parallel.linear.Gemm`).

`kernels.fp8` picks a recipe. Each of a linear layer's three products (Y = X·Wᵀ, dX = dY·W, dW = dYᵀ·X) quantises its
two operands to FP8 and multiplies them, accumulating in fp32 (in float64 under `64-true`: quantise to FP8, compute
wider). Every product is written as A·Bᵀ, both operands [rows, C] with the contraction C last, and a scale is the
amax of a block of an operand over the format's largest value (current scaling: this tensor's own amax, no history):

- `tensorwise`: one scale per operand; X and W in e4m3, dY in e5m2 (its range).
- `rowwise`: one scale per row of each operand, along the contraction; the same formats.
- `blockwise` (DeepSeek-V3): X and dY in 1×128 tiles along the contraction (so X is tiled 1×128 forward and 128×1
  in dW's product), W in 128×128 blocks (the same blocks forward and for dX), all in e4m3.

Scales do not depend on the layout: an operand's block holds the same elements whatever the layout, and where a
layer holds only a shard of a block (tensor parallelism splits W and X's or dY's features, context parallelism
the tokens) the block's amax is all-reduced (MAX) over the ranks holding its shards. Blockwise blocks never
straddle a shard (config validation refuses a layout whose shard boundary falls inside a 128 block), so it needs
no reduction. Sequence parallelism changes no operand: the GEMMs see the gathered sequence.

Key/value heads replicated over tensor-parallel ranks (fewer heads than ranks, `mlplat.model.decoder.qkv_row_blocks`)
are the one place where a rank's operand is not a shard of one process's: each replica's dY columns of the shared
K/V rows hold only its own queries' share of dK and dV. Quantising the shares apart would give other scales and
other roundings (Q(a) + Q(b) is not Q(a + b)), so the QKV GEMM first sums those columns over the grid's `kv_group`
(`Fp8Gemm.output_grad`, one all-reduce of tokens × 2·head size per layer and micro-batch) and keeps the sum on the
group's first rank, zeros on the others: dX's product and the sum of dX over tp then see each shared column once,
whole, and the buffers' sum of the shared rows' dW over the group (`ParamBuffers.reduce_shared_rows`) adds zeros to
the whole one.

A layer's weight is cast once per optimizer step, not once per micro-batch: its two quantised forms (W forward, Wᵀ
for dX) are kept in the chunk's `WeightCasts` from their first use in a pipeline pass to its end (`TrainStep` calls
`WeightCasts.clear` before and after each pass, the redone pass of a rejected post-validated step included).
A cast is also remade when the weight tensor itself changed (its storage or version): a weight written outside a pass.
The zero-bubble W step computes dW = dYᵀ·X alone: it needs no weight cast.

The product runs through `torch._scaled_mm` where it serves the scale layout (tensorwise, rowwise; an fp32, bf16 or
fp16 output) on a GPU, through torch's block-scaled GEMM for blockwise on sm90 where a probe on first use finds it
agrees with the emulation (`mlplat.parallel.fp8_blockwise`), and otherwise through the emulation it equals:
dequantise, then multiply in fp32 or float64. A CPU takes the emulation for every recipe
(`mlplat.precision.fp8_gemm_path`: chosen by measurement).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mlplat.parallel.fp8_blockwise import block_scaled_mm, block_scaled_takes
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.linear import Gemm
from mlplat.parallel.quantise import E4M3, E5M2, Quantised, emulated_mm, quantise
from mlplat.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from mlplat.precision import FP8_BLOCK as BLOCK
from mlplat.precision import FP8_PRODUCTS, fp8_gemm_path, fp8_reduced_over

SCALED_MM_OUT = (torch.float32, torch.bfloat16, torch.float16)


def scaled_mm(a: Quantised, b: Quantised, out_dtype: torch.dtype, recipe: str) -> Tensor:
    """A·Bᵀ in `out_dtype`: torch._scaled_mm where it takes the scale layout (blockwise: torch's block-scaled GEMM
    where its probe agreed), else the emulation (dequantise, then one matmul in fp32, or in float64 for a float64
    output)."""
    if _scaled_mm_takes(a, b, out_dtype, recipe):
        if recipe == "blockwise":
            return block_scaled_mm(a, b, out_dtype)
        scale_b = b.scale.t().contiguous() if recipe == "rowwise" else b.scale  # rowwise: [1, N]
        return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale, scale_b=scale_b, out_dtype=out_dtype)
    return emulated_mm(a, b, out_dtype)


def _scaled_mm_takes(a: Quantised, b: Quantised, out_dtype: torch.dtype, recipe: str) -> bool:
    if recipe == "blockwise":  # on sm90 where its probe agreed (mlplat.parallel.fp8_blockwise)
        return block_scaled_takes(a, b, out_dtype)
    out = str(out_dtype).removeprefix("torch.")
    if fp8_gemm_path(recipe, a.data.device.type, out) != "torch._scaled_mm" or out_dtype not in SCALED_MM_OUT:
        return False
    # CUDA's kernels (untested here): dimensions in multiples of 16
    return all(n % 16 == 0 for n in (*a.data.shape, b.data.shape[0]))


class WeightCasts:
    """The FP8 casts of a chunk's weights, kept for one optimizer step: each layer's `Fp8Gemm` stores its weight's
    quantised forms here on first use and reuses them until `clear` (before and after each pipeline pass).
    `casts` counts the weight casts made."""

    def __init__(self):
        self.kept: dict[tuple[int, str], tuple[tuple, Quantised]] = {}
        self.casts = 0

    def clear(self) -> None:
        self.kept.clear()

    def get(self, owner: object, form: str, weight: Tensor, make) -> Quantised:
        """`owner`'s cast `form` of `weight`: the kept one unless the weight changed since, else `make()`."""
        stamp = (weight.data_ptr(), weight._version, tuple(weight.shape))  # a write outside a pass remakes it
        key = (id(owner), form)
        hit = self.kept.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        q = make()
        self.casts += 1
        self.kept[key] = (stamp, q)
        return q

    def drop(self, owner: object) -> None:
        """Forget `owner`'s casts: its weight is about to be freed (sharded parameters are cast once per gather)."""
        for key in [k for k in self.kept if k[0] == id(owner)]:
            del self.kept[key]

    def nbytes(self) -> int:
        """Bytes of the kept casts (codes and scales)."""
        return sum(q.data.numel() * q.data.element_size() + q.scale.numel() * 4 for _, q in self.kept.values())


class Fp8Gemm(Gemm):
    """The three products of a tensor-parallel linear layer in FP8 under `recipe`. `split` is the weight's
    dimension split over the tensor-parallel ranks: "out" (column-parallel: W's rows, dY's features) or "in"
    (row-parallel: W's columns, X's features); context parallelism splits the tokens (X's and dY's rows). One per
    layer: its weight's casts are kept in `casts` (None: cast at every product)."""

    def __init__(self, recipe: str, grid: ParallelGrid, split: str, casts: WeightCasts | None = None,
                 shared: tuple[slice, ...] = ()):
        assert recipe in ("tensorwise", "rowwise", "blockwise") and split in ("out", "in"), (recipe, split)
        self.recipe, self.casts = recipe, casts
        tp = grid.tp_group if grid.tp > 1 else None
        cp = grid.cp_group if grid.cp > 1 else None
        # The process group that splits each of the layer's dimensions (None: whole on this rank).
        self.groups = {"tokens": cp, "out": tp if split == "out" else None, "in": tp if split == "in" else None}
        # The output features held by every rank of the kv group (replicated K/V heads' rows; module docstring)
        self.shared = shared if grid.kv_group is not None else ()
        self.kv_group, self.kv_first = grid.kv_group, grid.tp_rank % grid.kv_replicas == 0

    def output_grad(self, grad_out: Tensor) -> Tensor:
        """dY with the shared features' columns whole on the kv group's first rank and zero on the others."""
        if not self.shared:
            return grad_out
        grad = grad_out.clone()
        part = torch.cat([grad[..., cols] for cols in self.shared], dim=-1)  # K's and V's columns: one all-reduce
        dist.all_reduce(part, group=self.kv_group)
        start = 0
        for cols in self.shared:
            width = cols.stop - cols.start
            grad[..., cols] = part[..., start:start + width] if self.kv_first else 0
            start += width
        return grad

    def _quantise(self, x: Tensor, dims: tuple[str, str], weight: bool, grad: bool) -> Quantised:
        """Operand `x` [rows, C] whose rows and columns are the layer's `dims`, quantised under the recipe."""
        if self.recipe == "tensorwise":
            block = tuple(x.shape)
        elif self.recipe == "rowwise":
            block = (1, x.shape[1])
        else:  # blockwise: blocks inside shards (validation), all e4m3
            block = (BLOCK if weight else 1, BLOCK)
        fmt = E5M2 if grad and self.recipe != "blockwise" else E4M3
        spread = (self.groups[d] for d in fp8_reduced_over(self.recipe, dims))
        return quantise(x, fmt, block, [g for g in spread if g is not None])

    def _weight(self, weight: Tensor, transposed: bool) -> Quantised:
        """W [out, in] (forward) or Wᵀ [in, out] (dX's product) quantised, from `casts` when kept."""
        def make() -> Quantised:
            if not transposed:
                return self._quantise(weight, FP8_PRODUCTS["forward"][1], weight=True, grad=False)
            if self.recipe == "rowwise":  # scales along W's other dimension: a cast of its own
                return self._quantise(weight.t(), FP8_PRODUCTS["input_grad"][1], weight=True, grad=False)
            w = self._weight(weight, transposed=False)  # one scale, or 128×128 blocks: W's cast, transposed
            return Quantised(w.data.t().contiguous(), w.scale.t().contiguous(), w.block[::-1])
        return make() if self.casts is None else self.casts.get(self, "wt" if transposed else "w", weight, make)

    def forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        a = self._quantise(x2, FP8_PRODUCTS["forward"][0], weight=False, grad=False)
        b = self._weight(weight, transposed=False)
        y = scaled_mm(a, b, x.dtype, self.recipe).view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias

    def input_grad(self, grad_out: Tensor, weight: Tensor) -> Tensor:
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        a = self._quantise(g2, FP8_PRODUCTS["input_grad"][0], weight=False, grad=True)
        b = self._weight(weight, transposed=True)
        return scaled_mm(a, b, grad_out.dtype, self.recipe).view(*grad_out.shape[:-1], weight.shape[1])

    def weight_grad(self, grad_out: Tensor, x: Tensor, weight: Tensor) -> Tensor:
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1]).to(g2.dtype)
        a = self._quantise(g2.t(), FP8_PRODUCTS["weight_grad"][0], weight=False, grad=True)
        b = self._quantise(x2.t(), FP8_PRODUCTS["weight_grad"][1], weight=False, grad=False)
        return scaled_mm(a, b, weight.dtype, self.recipe)


def use_fp8(module: nn.Module, recipe: str, grid: ParallelGrid) -> WeightCasts | None:
    """Set the GEMM of `recipe` (`kernels.fp8`; none: the dense one) on every tensor-parallel linear layer under
    `module`, the transformer layers' attention and MLP projections, and on the experts' weights. What is not under
    it (the word embedding, the logits, the attention core) stays in the run's precision. Returns the store of their
    weight casts (None for none), which the caller clears before each pipeline pass."""
    casts = None if recipe == "none" else WeightCasts()
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            split = "out" if isinstance(m, ColumnParallelLinear) else "in"
            blocks = getattr(m.weight, "row_blocks", None)
            shared = tuple(slice(b.local, b.local + b.rows) for b in blocks[grid.tp_rank] if b.shared) if blocks else ()
            m.gemm = None if casts is None else Fp8Gemm(recipe, grid, split, casts, shared)
        elif hasattr(m, "use_fp8"):  # the experts' weights: a grouped GEMM of their own (mlplat.parallel.fp8_experts)
            m.use_fp8(recipe, grid, casts)
    return casts
