"""model.activation: the exact GeLU (default) or GPT-2's tanh approximation, honoured by the fused and unfused MLP."""
from __future__ import annotations

import math

import pytest
import torch

from mlplat.config import ConfigError, ModelConfig, load_config
from mlplat.lightning.module import GPTModule
from mlplat.model import fused
from mlplat.parallel.grid import ParallelGrid

F64 = torch.float64


def test_activation_is_validated_in_one_line():
    assert ModelConfig().activation == "gelu"
    assert load_config({"model": {"activation": "gelu_tanh"}}).model.activation == "gelu_tanh"
    with pytest.raises(ConfigError) as refused:
        load_config({"model": {"activation": "relu"}})
    assert str(refused.value) == "model.activation='relu' is not one of gelu, gelu_tanh"


def test_bias_gelu_tanh_is_gpt2s_formula():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 128, generator=gen, dtype=F64, requires_grad=True)
    b = torch.randn(128, generator=gen, dtype=F64, requires_grad=True)
    z = x + b
    gpt2 = 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))  # GPT-2's gelu_new
    eager = fused.bias_gelu(x, b, approximate="tanh")
    torch.testing.assert_close(eager, gpt2, rtol=1e-14, atol=1e-14)
    assert (fused.bias_gelu(x, b) - gpt2).abs().max() > 1e-5  # the exact GeLU is another function
    # The compiled operator is this same function (test_kernels proves compiled == eager; compiling again here
    # would cost ~30 s on a 2-core box), and the keyword reaches it like any other argument.
    grads = torch.autograd.grad(eager, (x, b), torch.ones_like(eager))
    ref = torch.autograd.grad(gpt2, (x, b), torch.ones_like(gpt2))
    for g, h in zip(grads, ref):
        torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12)


def _chunk_output(activation: str, fused_kernels: bool) -> torch.Tensor:
    model = dict(n_layers=2, hidden=32, n_heads=4, seq_len=16, vocab_size=64, activation=activation)
    cfg = load_config({"model": model,
                       "kernels": dict(attention="math", fused=fused_kernels), "logger": {"name": "none"}},
                      check_data=False)  # token ids of its own
    module = GPTModule(cfg)
    module.build(ParallelGrid())
    chunk = module.chunks["0"].double()
    with torch.no_grad():
        for p in chunk.parameters():  # non-zero biases, so the bias of the fused bias+GeLU matters
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=F64))
        return chunk(torch.arange(32).view(2, 16) % 64)


def test_fused_and_unfused_mlp_honour_the_activation():
    saved = fused.get_impl()
    fused.set_impl("eager")  # compiled == eager is the test above
    try:
        tanh_unfused, tanh_fused = _chunk_output("gelu_tanh", False), _chunk_output("gelu_tanh", True)
        exact_unfused, exact_fused = _chunk_output("gelu", False), _chunk_output("gelu", True)
    finally:
        fused.set_impl(saved)
    torch.testing.assert_close(tanh_fused, tanh_unfused, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(exact_fused, exact_unfused, rtol=1e-13, atol=1e-13)
    assert (tanh_unfused - exact_unfused).abs().max() > 1e-8  # 1e5 times the fused/unfused difference
