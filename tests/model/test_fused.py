"""Fused operators: torch.compile'd equals eager (dropout included: Inductor's `fallback_random` draws from the
eager RNG), the fallback to eager when compilation fails, and GPT-2's tanh GeLU.

compiled == eager is proven here, in-process and once, so that no spawned process pays Inductor's C++ compile on a
2-core box; it also fills Inductor's on-disk cache for the CLI run of tests/model/test_kernels.py (same shapes).
"""
from __future__ import annotations

import logging
import math
import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile worker pool on small CI boxes

import pytest
import torch

from mlplat.model import fused
from tests.helpers.kernels import DROPOUT, F64, TOL

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _op_inputs():
    """The shapes the model uses (micro-batch 2, sequence 16, hidden 32, ffn 128, 4 heads), float64."""
    gen = torch.Generator().manual_seed(5)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64, requires_grad=True)

    return {
        fused.fused_bias_gelu: ((leaf(2, 16, 128), leaf(128)), {}),
        fused.fused_bias_swiglu: ((leaf(2, 16, 256), None), {}),  # the Llama MLP has no biases
        fused.fused_rotary_embedding: ((leaf(2, 4, 16, 8), leaf(16, 8), leaf(16, 8)), {}),  # q, cos, sin
        fused.fused_bias_dropout_add: ((leaf(2, 16, 32), leaf(32), leaf(2, 16, 32), DROPOUT, True), {}),
        fused.fused_scale_mask_softmax: ((leaf(2, 4, 16, 16), 0.125), {}),
    }


def test_fused_ops_compiled_equal_eager():
    ok, why = fused.compile_available("cpu")
    for op, (args, kwargs) in _op_inputs().items():
        leaves = [a for a in args if torch.is_tensor(a)]
        results = []
        for fn in (op, op.fn):  # compiled (verified on first use), then the plain function
            torch.manual_seed(21)
            out = fn(*args, **kwargs)
            grads = torch.autograd.grad(out, leaves, torch.cos(out.detach()))
            results.append((out.detach(), grads, torch.get_rng_state()))
        (oc, gc, rc), (oe, ge, re) = results
        torch.testing.assert_close(oc, oe, rtol=TOL, atol=TOL)
        for a, b in zip(gc, ge):
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
        assert torch.equal(rc, re), f"{op.__name__}: compiled dropout must draw from the generator like eager"
        if ok and fused.get_impl() == "compile":
            assert op.failure is None and fused.status()[op.__name__] == "compiled", fused.status()
        else:
            assert fused.status()[op.__name__].startswith("eager"), (why, fused.status())


def test_fused_falls_back_to_eager_when_compile_fails(monkeypatch, caplog):
    def broken_compile(fn, **kwargs):
        def run(*a, **k):
            raise RuntimeError("simulated Inductor failure")
        return run

    monkeypatch.setattr(fused.torch, "compile", broken_compile)
    monkeypatch.setattr(fused, "compile_available", lambda device_type: (True, ""))
    op = fused.FusedOp(fused.bias_gelu)
    x, b = torch.randn(3, 8, dtype=F64), torch.randn(8, dtype=F64)
    with caplog.at_level(logging.WARNING, logger="mlplat.model.fused"):
        out = op(x, b)
    torch.testing.assert_close(out, fused.bias_gelu(x, b), rtol=0, atol=0)
    assert op.failure and "simulated Inductor failure" in op.failure
    assert "running it eagerly" in caplog.text
    # On request: never compiled at all.
    calls = []
    monkeypatch.setattr(fused.torch, "compile", lambda *a, **k: calls.append(1))
    fused.set_impl("eager")
    try:
        op2 = fused.FusedOp(fused.bias_gelu)
        torch.testing.assert_close(op2(x, b), fused.bias_gelu(x, b), rtol=0, atol=0)
        assert calls == [] and fused.status()["bias_gelu"] == "eager (requested)"
    finally:
        fused.set_impl("compile")
    with pytest.raises(ValueError, match="MLPLAT_FUSED_IMPL='jit' is not one of compile, eager"):
        fused.set_impl("jit")


def test_bias_swiglu_is_silu_gate_times_up_on_alternating_rows():
    x = torch.randn(3, 8, dtype=F64)
    gate, up = x[:, 0::2], x[:, 1::2]
    torch.testing.assert_close(fused.bias_swiglu(x, None), torch.nn.functional.silu(gate) * up, rtol=0, atol=0)
    b = torch.randn(8, dtype=F64)
    torch.testing.assert_close(fused.bias_swiglu(x, b), fused.bias_swiglu(x + b, None), rtol=0, atol=0)


def test_bias_gelu_tanh_is_gpt2s_formula():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 128, generator=gen, dtype=F64, requires_grad=True)
    b = torch.randn(128, generator=gen, dtype=F64, requires_grad=True)
    z = x + b
    gpt2 = 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))  # GPT-2's gelu_new
    eager = fused.bias_gelu(x, b, approximate="tanh")
    torch.testing.assert_close(eager, gpt2, rtol=1e-14, atol=1e-14)
    assert (fused.bias_gelu(x, b) - gpt2).abs().max() > 1e-5  # the exact GeLU is another function
    # The compiled operator is this same function (test_fused_ops_compiled_equal_eager proves compiled == eager;
    # compiling again here would cost ~30 s on a 2-core box), and the keyword reaches it like any other argument.
    grads = torch.autograd.grad(eager, (x, b), torch.ones_like(eager))
    ref = torch.autograd.grad(gpt2, (x, b), torch.ones_like(gpt2))
    for g, h in zip(grads, ref):
        torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@gpu
def test_gpu_fused_ops_compiled_equal_eager():
    for op, (args, kwargs) in _op_inputs().items():
        args = tuple(a.detach().float().cuda().requires_grad_() if torch.is_tensor(a) else a for a in args)
        leaves = [a for a in args if torch.is_tensor(a)]
        res = []
        for fn in (op, op.fn):
            torch.cuda.manual_seed(3)
            out = fn(*args, **kwargs)
            res.append((out.detach(), torch.autograd.grad(out, leaves, torch.ones_like(out))))
        torch.testing.assert_close(res[0][0], res[1][0], rtol=1e-5, atol=1e-6)
        for a, b in zip(res[0][1], res[1][1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
