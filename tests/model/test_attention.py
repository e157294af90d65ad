"""Attention backends: SDPA equals the explicit math backend, dropout masks included; backend resolution.

On CPU, SDPA with dropout runs PyTorch's math kernel, which draws its mask with `at::dropout` from the default
generator, exactly as `F.dropout` does in our math backend (see mlplat/model/attention.py); the test also checks
both consume the generator identically.
"""
from __future__ import annotations

import pytest
import torch

from mlplat.model import attention
from mlplat.model.attention import math_attention, resolve_backend, sdpa_attention
from tests.helpers.kernels import DROPOUT, F64, TOL

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_sdpa_equals_math_with_dropout():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen, dtype=F64, requires_grad=True) for _ in range(3))
    outs = {}
    for p in (0.0, DROPOUT):
        for name, core in (("math", math_attention), ("sdpa", sdpa_attention)):
            torch.manual_seed(11)
            out = core(q, k, v, p, True)
            after = torch.get_rng_state()
            outs[(name, p)] = (out, torch.autograd.grad(out, (q, k, v), torch.ones_like(out)), after)
    for p in (0.0, DROPOUT):
        (om, gm, rm), (os_, gs, rs) = outs[("math", p)], outs[("sdpa", p)]
        torch.testing.assert_close(os_, om, rtol=TOL, atol=TOL)
        for a, b in zip(gs, gm):
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
        assert torch.equal(rm, rs), "sdpa and math must consume the default generator identically"
    # The dropout really acted (else the test above would prove nothing about masks).
    assert (outs[("math", DROPOUT)][0] - outs[("math", 0.0)][0]).abs().max() > 1e-2
    # Why they agree: on CPU, SDPA with dropout runs its math kernel (at::dropout on the default generator).
    choose = getattr(torch, "_fused_sdp_choice", None)  # private; checked only where it exists
    if choose is not None:
        from torch.nn.attention import SDPBackend

        assert choose(q, k, v, None, DROPOUT, True) == SDPBackend.MATH.value


def test_sdpa_takes_the_cpu_flash_kernel_with_values_narrower_than_keys():
    """MLA's values are narrower than its queries and keys: SDPA's CPU flash kernel takes one head size, so v is
    padded with zero channels (else SDPA would fall back to its math path, scores and all), and equals math."""
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 4, 16, 12, generator=gen, dtype=F64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 4, 16, 8, generator=gen, dtype=F64, requires_grad=True)
    with torch.profiler.profile() as prof:
        out = sdpa_attention(q, k, v, 0.0, True)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops, sorted(ops)
    expected = math_attention(q, k, v, 0.0, True)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=TOL, atol=TOL)
    for got, want in zip(grads, torch.autograd.grad(expected, (q, k, v), torch.ones_like(expected))):
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_backend_resolution_and_refusals(monkeypatch):
    assert resolve_backend("auto", "cpu") == "sdpa"
    assert resolve_backend("math", "cpu") == "math"
    with pytest.raises(ValueError, match=r"kernels.attention=flash cannot run: flash-attn needs a CUDA GPU.*"
                                         r"use kernels.attention=sdpa or auto"):
        resolve_backend("flash", "cpu")
    monkeypatch.setattr(attention, "flash_available", lambda: (False, "the flash-attn package is not installed"))
    with pytest.raises(ValueError, match="flash-attn package is not installed; use kernels.attention=sdpa or auto"):
        resolve_backend("flash", "cuda", "bf16-mixed")
    assert resolve_backend("auto", "cuda", "bf16-mixed") == "sdpa"
    monkeypatch.setattr(attention, "flash_available", lambda: (True, ""))
    assert resolve_backend("auto", "cuda", "bf16-mixed") == "flash"
    assert resolve_backend("auto", "cuda", "32-true") == "sdpa"  # flash-attn has no fp32 kernels
    # heads wider than flash-attn's kernels take (model.head_dim): auto is sdpa, flash refused in one line
    assert resolve_backend("auto", "cuda", "bf16-mixed", head_dim=256) == "flash"
    assert resolve_backend("auto", "cuda", "bf16-mixed", head_dim=320) == "sdpa"
    with pytest.raises(ValueError, match="heads of at most 256 channels and the model's are 320") as wide:
        resolve_backend("flash", "cuda", "bf16-mixed", head_dim=320)
    assert "\n" not in str(wide.value)
    with pytest.raises(ValueError, match="fp16/bf16 only and trainer.precision=32-true") as refused:
        resolve_backend("flash", "cuda", "32-true")
    assert "\n" not in str(refused.value)


def test_backend_resolution_under_context_parallelism():
    """Ring attention's block kernels: auto is sdpa (PyTorch's flash kernel, which returns the log-sum-exp) on CPU
    and GPUs; flash (flash-attn) is refused in one line."""
    assert resolve_backend("auto", "cpu", "bf16-mixed", cp=2) == "sdpa"
    assert resolve_backend("auto", "cuda", "bf16-mixed", cp=2) == "sdpa"
    assert resolve_backend("math", "cuda", "bf16-mixed", cp=4) == "math"
    assert resolve_backend("sdpa", "cpu", cp=2) == resolve_backend("sdpa", "cuda", cp=2) == "sdpa"
    for name, device in (("flash", "cuda"), ("flash", "cpu")):
        with pytest.raises(ValueError, match=f"kernels.attention={name} cannot run under parallel.cp=2 on {device}"
                                             ".*use kernels.attention=sdpa or auto") as refused:
            resolve_backend(name, device, "bf16-mixed", cp=2)
        assert "\n" not in str(refused.value)


@pytest.mark.gpu
@gpu
def test_gpu_backends_agree_without_dropout():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    ref = math_attention(q.double(), k.double(), v.double(), 0.0, False)
    names = ["sdpa", "math"] + (["flash"] if attention.flash_available()[0] else [])
    for name in names:
        out = attention.BACKENDS[name](q, k, v, 0.0, True)
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2, msg=name)
