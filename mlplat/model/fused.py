"""The paper's fused element-wise operators (§4.2): bias+GeLU, bias+dropout+add, scale+mask+softmax; and
bias+SwiGLU and the rotary embedding for the Llama family.

Each operator is written once, as plain PyTorch, and run either compiled by `torch.compile` (Inductor fuses it
into one kernel per direction: C++/OpenMP on CPU, Triton on GPU) or eagerly. The eager path is the *same
function*, not a re-implementation, so the two differ only by floating-point reassociation inside the kernel.

- `kernels.fused=true` uses these (the linear layers run with `skip_bias_add=True` and hand their bias over).
- Compilation is lazy and checked: the first call for a new signature (shapes, dtypes, grad mode) compiles and
  runs the operator forward and, when gradients are wanted, backward on detached copies, with the random state
  put back afterwards. If that fails (no C++ compiler, no Triton, an Inductor bug) a one-line warning names the
  reason and the operator runs eagerly from then on, before any real work touched the compiled path.
- `MLPLAT_FUSED_IMPL=eager` (or `set_impl("eager")`) asks for the eager path outright.
- Dropout inside a compiled operator draws from PyTorch's default generator exactly as eager `F.dropout` does
  (Inductor's `fallback_random`), so masks — and hence the RNG tracker and activation recomputation — are
  unchanged by fusion, and fused training equals unfused training.
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

IMPL_ENV = "MLPLAT_FUSED_IMPL"  # compile (default) | eager
IMPLS = ("compile", "eager")


# ------------------------------------------------------------------------------------------------ operators

def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """GeLU(x + b) as the unfused MLP computes it: `approximate` "none" is the exact (erf) GeLU, "tanh" GPT-2's.

    The bias is cast to x's dtype, as autocast does inside the unfused `F.linear(x, w, b)` (a no-op in 32/64-true).
    """
    if bias is not None:
        x = x + bias.to(x.dtype)
    return F.gelu(x, approximate=approximate)


def bias_swiglu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """SiLU(gate)·up from fc1's output (+ b), whose last dim alternates gate and up (decoder.ParallelMLP)."""
    if bias is not None:
        x = x + bias.to(x.dtype)
    gate, up = x.unflatten(-1, (-1, 2)).unbind(-1)
    return F.silu(gate) * up


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by its positions' angles: x·cos + rotate_half(x)·sin, the halves of each head being the pairs
    (mlplat.model.rotary)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                     training: bool) -> torch.Tensor:
    """residual + dropout(x + b): the end of the attention and MLP sub-blocks (bias cast to x's dtype)."""
    if bias is not None:
        x = x + bias.to(x.dtype)
    return residual + F.dropout(x, p, training)


def scale_mask_softmax(scores: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
                       causal: bool = True) -> torch.Tensor:
    """softmax(scores·scale with masked positions at -inf) over the last dim.

    causal: position i sees keys j <= i. mask (general case): True where a score is masked out, broadcast to
    scores. Both may be combined.
    """
    scores = scores * scale
    if causal:
        sq, sk = scores.size(-2), scores.size(-1)
        upper = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(sk - sq + 1)
        scores = scores.masked_fill(upper, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


# ------------------------------------------------------------------------------------------------ compile

_impl = os.environ.get(IMPL_ENV, "compile").strip().lower() or "compile"


def set_impl(impl: str) -> None:
    """`compile` (torch.compile, eager fallback on failure) or `eager` (never compile)."""
    global _impl
    if impl not in IMPLS:
        raise ValueError(f"{IMPL_ENV}={impl!r} is not one of {', '.join(IMPLS)}")
    _impl = impl


def get_impl() -> str:
    if _impl not in IMPLS:
        raise ValueError(f"{IMPL_ENV}={_impl!r} is not one of {', '.join(IMPLS)}")
    return _impl


def compile_available(device_type: str) -> tuple[bool, str]:
    """Whether torch.compile can build kernels for `device_type` here, and if not, what is missing."""
    if not hasattr(torch, "compile"):
        return False, "this PyTorch has no torch.compile"
    try:
        import torch._dynamo as dynamo
    except Exception as e:  # noqa: BLE001 - any import failure means no compiler
        return False, f"torch._dynamo cannot be imported ({e})"
    if not dynamo.is_dynamo_supported():
        return False, "torch.compile does not support this Python version"
    if device_type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:
            return False, "Triton is not available"
        if not has_triton():
            return False, "Triton is not installed (Inductor's GPU code generator)"
    elif device_type == "cpu":
        cxx = os.environ.get("CXX") or "g++"
        if not (shutil.which(cxx) or shutil.which("c++") or shutil.which("clang++")):
            return False, f"no C++ compiler ({cxx}) for Inductor's CPU code"
    return True, ""


def _rng_state(device_type: str):
    cuda = torch.cuda.get_rng_state() if device_type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _signature(args, kwargs) -> tuple:
    def one(a):
        if torch.is_tensor(a):
            return ("T", tuple(a.shape), a.dtype, a.device.type, a.requires_grad)
        return ("V", a)
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
    return (torch.is_grad_enabled(), autocast, tuple(one(a) for a in args),
            tuple((k, one(v)) for k, v in sorted(kwargs.items())))


class FusedOp:
    """One operator: compiled on first use (verified forward and backward), eager when asked or on failure."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._compiled: Callable | None = None
        self._verified: set = set()
        self.failure: str | None = None  # why this operator runs eagerly, once compilation failed

    def reset(self) -> None:
        self._compiled, self._verified, self.failure = None, set(), None

    def _fail(self, why: str) -> None:
        self.failure = why
        log.warning("kernels.fused: torch.compile of %s failed (%s); running it eagerly (same function)",
                    self.__name__, why)

    def _compiled_fn(self) -> Callable:
        if self._compiled is None:
            # dynamic=False: shapes are fixed within a run (micro-batch, sequence, hidden/t), so each compiles once.
            # fallback_random: dropout draws from the default generator exactly as eager F.dropout does.
            self._compiled = torch.compile(self.fn, dynamic=False, options={"fallback_random": True})
        return self._compiled

    def _probe(self, args, kwargs) -> None:
        """Compile and run forward (and backward) on detached copies, leaving RNG and inputs untouched."""
        copies = [a.detach().clone().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a for a in args]
        device_type = next((a.device.type for a in args if torch.is_tensor(a)), "cpu")
        state = _rng_state(device_type)
        try:
            out = self._compiled_fn()(*copies, **kwargs)
            leaves = [c for c in copies if torch.is_tensor(c) and c.requires_grad]
            if torch.is_grad_enabled() and leaves and out.requires_grad:
                torch.autograd.grad(out, leaves, torch.ones_like(out))
        finally:
            _set_rng_state(state)

    def __call__(self, *args, **kwargs):
        if self.failure is not None or get_impl() == "eager":
            return self.fn(*args, **kwargs)
        key = _signature(args, kwargs)
        if key not in self._verified:
            device_type = next((a.device.type for a in args if torch.is_tensor(a)), "cpu")
            ok, why = compile_available(device_type)
            if not ok:
                self._fail(why)
                return self.fn(*args, **kwargs)
            try:
                self._probe(args, kwargs)
            except Exception as e:  # noqa: BLE001 - any compiler failure falls back to the same function
                self._fail(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
                return self.fn(*args, **kwargs)
            self._verified.add(key)
        return self._compiled_fn()(*args, **kwargs)


fused_bias_gelu = FusedOp(bias_gelu)
fused_bias_swiglu = FusedOp(bias_swiglu)
fused_rotary_embedding = FusedOp(rotary_embedding)
fused_bias_dropout_add = FusedOp(bias_dropout_add)
fused_scale_mask_softmax = FusedOp(scale_mask_softmax)
FUSED_OPS = (fused_bias_gelu, fused_bias_swiglu, fused_rotary_embedding, fused_bias_dropout_add,
             fused_scale_mask_softmax)


def status() -> dict[str, str]:
    """Operator name -> 'compiled', 'eager (requested)', 'eager (<why>)' or 'not used yet'."""
    out = {}
    for op in FUSED_OPS:
        if get_impl() == "eager":
            out[op.__name__] = "eager (requested)"
        elif op.failure is not None:
            out[op.__name__] = f"eager ({op.failure})"
        else:
            out[op.__name__] = "compiled" if op._verified else "not used yet"
    return out
