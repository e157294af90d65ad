"""The precision table: what each `trainer.precision` means, in one place and without torch.

Config validation, the attention backend choice, the Megatron-style main weights, the Lightning plugins and the
memory and cost models all read a precision's facts here instead of interpreting its name. Dtypes are torch's
names as strings ("float32", "bfloat16"), so that `getattr(torch, entry.compute_dtype)` gives the dtype and this
module imports nothing heavy.

Three families:
- true precisions (64-true, 32-true, bf16-true, 16-true): the weights, their gradients and the GEMMs all in one
  dtype; the optimizer steps the weights themselves.
- Lightning's autocast (bf16-mixed, 16-mixed): fp32 weights and gradients, the GEMM inputs cast to bf16/fp16 in
  every forward; the residual stream and LayerNorm stay fp32. 16-mixed runs mlplat's dynamic loss scaling.
- Megatron-style (bf16-megatron, 16-megatron; `mlplat.optim.main_params`): bf16/fp16 weights and GEMMs, fp32
  main weights and main gradients that the optimizer steps; the fp32 main gradients are what data parallelism
  reduces (bf16-megatron may reduce a bf16 copy, `optim.grad_reduce_dtype=bf16`). 16-megatron scales the loss.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
HALF_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class Precision:
    """One `trainer.precision` value."""

    name: str
    compute_dtype: str  # the GEMMs' dtype, and the dtype of the stage-to-stage messages of the pipeline
    weight_dtype: str  # the module's parameters
    main_dtype: str | None  # the main weights (and gradients) the optimizer steps; None: the weights themselves
    autocast: bool  # Lightning's autocast casts the GEMM inputs to compute_dtype in every forward
    loss_scaling: bool  # dynamic loss scaling (mlplat.optim.loss_scale) runs
    grad_bytes: int  # bytes per gradient element as the data-parallel reduction moves it
    residual_bytes: int  # bytes per element of the residual stream (what full recomputation keeps per layer)
    activation_bytes: int  # bytes per element of the activations a layer keeps for its backward
    alias_of: str | None = None  # Lightning's short name ("32" for "32-true")

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def weight_bytes(self) -> int:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def half(self) -> bool:
        """The GEMMs run in 16 bits (what flash attention needs)."""
        return self.compute_dtype in HALF_DTYPES

    @property
    def megatron(self) -> bool:
        """Megatron-style: separate main weights (mlplat.optim.main_params)."""
        return self.main_dtype is not None

    @property
    def state_bytes(self) -> tuple[int, int, int]:
        """(weight, gradient, optimizer-state) bytes per parameter held: the gradients live in the main dtype (the
        main-gradient buffer) when there is one; Adam keeps the main weights, if separate, and two moments in it."""
        state = DTYPE_BYTES[self.main_dtype or self.weight_dtype]
        main = DTYPE_BYTES[self.main_dtype] if self.main_dtype else 0
        return self.weight_bytes, state, main + 2 * state

    @property
    def step_state_bytes(self) -> int:
        """Bytes per parameter an optimizer step reads and writes: its gradients, the weights it steps (the main
        weights, or the weights themselves) and Adam's two moments; what optimizer post-validation saves before
        each step (mlplat.step.post_validation)."""
        return DTYPE_BYTES[self.main_dtype or self.weight_dtype] + 3 * self.state_bytes[1]


def _true(name: str, dtype: str) -> Precision:
    size = DTYPE_BYTES[dtype]
    return Precision(name, dtype, dtype, None, False, False, size, size, size)


_64, _32 = _true("64-true", "float64"), _true("32-true", "float32")
# Autocast: fp32 weights, gradients and residual stream; the activations a layer keeps are the GEMMs' bf16/fp16
# inputs (Korthikanti's 2-byte count; the memory model adds the fp32 LayerNorm inputs).
_BF16_MIXED = Precision("bf16-mixed", "bfloat16", "float32", None, True, False, 4, 4, 2)
_16_MIXED = Precision("16-mixed", "float16", "float32", None, True, True, 4, 4, 2)
# In config.PRECISIONS' order; Lightning's short names ("64", "32", "bf16", "16") are entries of their own, alias_of
# the full one.
_ENTRIES = (
    _64, replace(_64, name="64", alias_of="64-true"),
    _32, replace(_32, name="32", alias_of="32-true"),
    _BF16_MIXED, replace(_BF16_MIXED, name="bf16", alias_of="bf16-mixed"),
    _16_MIXED, replace(_16_MIXED, name="16", alias_of="16-mixed"),
    _true("bf16-true", "bfloat16"),
    _true("16-true", "float16"),
    Precision("bf16-megatron", "bfloat16", "bfloat16", "float32", False, False, 4, 2, 2),
    Precision("16-megatron", "float16", "float16", "float32", False, True, 4, 2, 2),
)
TABLE: dict[str, Precision] = {e.name: e for e in _ENTRIES}
NAMES = tuple(TABLE)  # every value trainer.precision accepts


def precision_of(value) -> Precision:
    """The entry of a `trainer.precision` value; anything else is refused in one line naming the allowed values."""
    try:
        return TABLE[str(value)]
    except KeyError:
        raise ValueError(f"trainer.precision={value!r} is not one of {', '.join(NAMES)}") from None


# torch 2.13's `_grouped_mm` (the experts' grouped GEMM) by device type: the operand dtypes it has a kernel for. On
# CUDA one kernel, bf16 operands and output (sm90+); fp32 and fp16 go to its fallback, which copies `offs` to the host
# (a stream sync) and runs one GEMM per group, and autocast does not lower the op (no autocast kernel registered). On
# a CPU the op is that fallback in fp32, bf16 and fp16 (no sync there). float64 has none anywhere.
GROUPED_KERNEL_DTYPES = {"cuda": ("bfloat16",), "cpu": ("float32", "bfloat16", "float16")}
GROUPED_PATHS = ("grouped", "grouped-bf16", "loop")


def grouped_gemm_path(device_type: str, dtype: str, compute_dtype: str) -> str:
    """How the experts' grouped GEMM runs on operands of `dtype` on a `device_type` device under a precision that
    computes in `compute_dtype` (autocast's dtype where it is on, else the operands'):
    - "grouped": `torch._grouped_mm` in the operands' dtype, where the device has it;
    - "grouped-bf16": the operands cast to bf16 for the grouped kernel, the output cast back (autograd carries the
      gradients through both casts, in the operands' dtype: fp32 weights get fp32 gradients), where the precision
      computes in 16 bits and the device's kernel is bf16's: bf16-mixed's fp32 operands, and the fp16 precisions'
      too (16-mixed, 16-megatron, 16-true), whose rounding becomes bf16's (8 significant bits, not 11) in the
      experts: fp16's range fits in bf16's, both accumulate in fp32, and the loop it replaces costs a GEMM per
      expert and host reads;
    - "loop": one GEMM per expert in the operands' dtype (float64 verification runs; fp32 under 32-true on CUDA).
    Device types other than CUDA take the CPU's list."""
    kernels = GROUPED_KERNEL_DTYPES.get(device_type, GROUPED_KERNEL_DTYPES["cpu"])
    if dtype in kernels:
        return "grouped"
    if compute_dtype in HALF_DTYPES and "bfloat16" in kernels and dtype in ("float32", *HALF_DTYPES):
        return "grouped-bf16"
    return "loop"


# kernels.fp8: the transformer layers' GEMMs in FP8 (mlplat.parallel.fp8), current scaling per recipe.
FP8_RECIPES = ("none", "tensorwise", "rowwise", "blockwise")
FP8_BLOCK = 128  # blockwise: 1×128 tiles of activations and gradients, 128×128 blocks of weights (DeepSeek-V3)
# The operands of a linear layer's three products, each [rows, contraction] named by the layer's dimensions
# ("tokens", "out", "in"): (activation or gradient operand, second operand); the forward's and dX's second operands
# are W and Wᵀ, cast once per optimizer step; the W step's dW product has no weight operand.
FP8_PRODUCTS = {"forward": (("tokens", "in"), ("out", "in")), "input_grad": (("tokens", "out"), ("in", "out")),
                "weight_grad": (("out", "tokens"), ("in", "tokens"))}


# Blockwise's kernel: torch 2.13's block-scaled GEMM (1×128 and 128×128 scales) runs on sm90 only, with cuBLASLt
# ≥ 12.9 (mlplat.parallel.fp8_blockwise), into these output dtypes; a probe decides whether it is taken (a run's, in
# setup, agreed by every rank: mlplat.parallel.fp8_verdicts).
BLOCKWISE_SM = (9, 0)
BLOCKWISE_OUT = ("float32", "bfloat16", "float16")
BLOCKWISE_RULE = "torch._scaled_mm on sm90 if its probe agrees, else emulated"
# The probe's verdicts in this process by (device, output dtype), e.g. ("cuda:0", "bfloat16"): True where the
# block-scaled kernel ran and agreed with the emulation (in a run: on every rank; recorded by
# mlplat.parallel.fp8_verdicts or, outside a run, mlplat.parallel.fp8_blockwise; read below).
blockwise_verdicts: dict[tuple[str, str], bool] = {}


def fp8_gemm_path(recipe: str, device_type: str, out: str | None = None, sm: tuple[int, int] | None = None) -> str:
    """How a layer's product runs under kernels.fp8=`recipe` on a `device_type` device, its output in dtype `out`
    ("bfloat16", a precision's compute_dtype; None: not known): "torch._scaled_mm" on the FP8 operands, or
    "emulated" (dequantised, then one fp32 matmul). CUDA's row-wise kernel writes bf16 only: rowwise under another
    precision (16-megatron's fp16) is emulated, and the cost model charges it so. Blockwise takes the block-scaled
    kernel where its probe agreed on this process's device (`blockwise_verdicts`); before any verdict, on a device
    of compute capability `sm` (the cost model's), where that is sm90, else `BLOCKWISE_RULE` (the dry run states
    the rule). On a CPU, torch
    2.13's tensorwise (scalar-scale) kernel runs 100-1000x slower than the emulation, which equals its rowwise kernel
    bit for bit (`python experiments/fp8/cpu_kernels.py` measures the three side by side): a CPU takes the emulation
    for both scalings (mlplat.parallel.fp8.scaled_mm; the dry run names the path)."""
    if device_type == "cpu":
        return "emulated"
    if recipe == "blockwise":
        return _blockwise_path(device_type, out, sm)
    if recipe == "rowwise" and out not in (None, "bfloat16"):
        return "emulated"
    return "torch._scaled_mm"


def _blockwise_path(device_type: str, out: str | None, sm: tuple[int, int] | None) -> str:
    if out is not None and out not in BLOCKWISE_OUT:
        return "emulated"  # float64 (64-true): the kernel writes no float64
    known = {v for (device, o), v in blockwise_verdicts.items() if device.split(":")[0] == device_type and o == out}
    if len(known) == 1:
        return "torch._scaled_mm" if known.pop() else "emulated"
    if sm is not None:
        return "torch._scaled_mm" if tuple(sm) == BLOCKWISE_SM else "emulated"
    return BLOCKWISE_RULE


# The experts' FP8 kernel: torch 2.13's grouped GEMM with row-wise scales (`torch._scaled_grouped_mm`, CUTLASS on
# compute capability 9.0 and 10.0), e4m3 operands, bf16 output only (mlplat.parallel.fp8_grouped); it takes the
# forward product of these recipes (a per-expert weight scale is a row-wise one repeated over the expert's rows).
GROUPED_FP8_SM = ((9, 0), (10, 0))
GROUPED_FP8_RECIPES = ("tensorwise", "rowwise")
GROUPED_FP8_OUT = "bfloat16"
GROUPED_FP8_RULE = "forward through torch._scaled_grouped_mm on sm90/sm100 into bf16 if its probe agrees"
# The probe's verdicts in this process by (device, output dtype, recipe), e.g. ("cuda:0", "bfloat16", "rowwise"):
# True where the grouped kernel ran and agreed with the emulation (in a run: on every rank; recorded by
# mlplat.parallel.fp8_verdicts or, outside a run, mlplat.parallel.fp8_grouped).
grouped_fp8_verdicts: dict[tuple[str, str, str], bool] = {}


def grouped_fp8_gemm_path(device_type: str, recipe: str | None = None, product: str = "forward",
                          out: str | None = None, sm: tuple[int, int] | None = None) -> str:
    """How one of the experts' products (`product`: "forward", "input_grad", "weight_grad") runs under
    kernels.fp8=`recipe` (`mlplat.parallel.fp8_experts`), its output in dtype `out`: "torch._scaled_grouped_mm" on
    the FP8 operands (the forward of `GROUPED_FP8_RECIPES` into bf16, where the probe agreed on this process's
    device, `grouped_fp8_verdicts`; before any verdict, on a device of compute capability `sm` (the cost model's)
    in `GROUPED_FP8_SM`; else `GROUPED_FP8_RULE`, which the dry run states), or the emulation: its dequantised fp32
    operands through `grouped_gemm_path`'s fp32 path ("grouped" on a CPU, "loop" on CUDA, whose grouped kernel
    takes bf16 only). dX and dW are the emulation everywhere (their operand dY is e5m2, the kernel's both e4m3; dW's
    scales lie along its contraction)."""
    emulated = grouped_gemm_path(device_type, "float32", "float32")
    if device_type == "cpu" or product != "forward" or recipe not in GROUPED_FP8_RECIPES:
        return emulated
    if out is not None and out != GROUPED_FP8_OUT:
        return emulated  # the kernel writes bf16 only: fp32, fp16 and float64 outputs take the emulation
    known = {v for (device, o, r), v in grouped_fp8_verdicts.items()
             if device.split(":")[0] == device_type and o == GROUPED_FP8_OUT and r == recipe}
    if len(known) == 1:
        return "torch._scaled_grouped_mm" if known.pop() else emulated
    if sm is not None:
        return "torch._scaled_grouped_mm" if tuple(sm) in GROUPED_FP8_SM else emulated
    return GROUPED_FP8_RULE


def fp8_reduced_over(recipe: str, dims: tuple[str, str]) -> tuple[str, ...]:
    """The dimensions of an operand whose split over ranks splits its scaling blocks, so that their amax is
    all-reduced over the ranks holding the shards: both (tensorwise: one block), the contraction (rowwise: one block
    per row), none (blockwise: validation keeps the blocks inside the shards)."""
    return {"tensorwise": dims, "rowwise": dims[1:]}.get(recipe, ())


def fp8_amax_reductions(recipe: str, tp: int, cp: int) -> dict[str, dict[str, int]]:
    """The amax all-reduces of one transformer layer's FP8 GEMMs (QKV and fc1 column-parallel, the output
    projection and fc2 row-parallel) by phase ("forward", "backward" per micro-batch; "step": the weights' casts, once
    per optimizer step) and by group ("tp", "cp"). Wᵀ's cast is W's transposed unless the scales are per row."""
    out = {phase: {"tp": 0, "cp": 0} for phase in ("forward", "backward", "step")}
    for split in ("out", "out", "in", "in"):
        group = {"tokens": "cp" if cp > 1 else None, "out": "tp" if tp > 1 and split == "out" else None,
                 "in": "tp" if tp > 1 and split == "in" else None}
        operands = [("forward", FP8_PRODUCTS["forward"][0]), ("step", FP8_PRODUCTS["forward"][1]),
                    ("backward", FP8_PRODUCTS["input_grad"][0])]
        operands += [("backward", dims) for dims in FP8_PRODUCTS["weight_grad"]]
        if recipe == "rowwise":
            operands.append(("step", FP8_PRODUCTS["input_grad"][1]))
        for phase, dims in operands:
            for dim in fp8_reduced_over(recipe, dims):
                if group[dim] is not None:
                    out[phase][group[dim]] += 1
    return out
