"""The GPT chunk's MLP honours model.activation (the exact GeLU, the default, or GPT-2's tanh approximation),
fused or not."""
from __future__ import annotations

import torch

from mlplat.config import load_config
from mlplat.parallel.grid import ParallelGrid
from mlplat.step import TrainStep
from tests.helpers.kernels import eager_fused

F64 = torch.float64


def _chunk_output(activation: str, fused_kernels: bool) -> torch.Tensor:
    model = dict(n_layers=2, hidden=32, n_heads=4, seq_len=16, vocab_size=64, activation=activation)
    cfg = load_config({"model": model,
                       "kernels": dict(attention="math", fused=fused_kernels), "logger": {"name": "none"}},
                      check_data=False)  # token ids of its own
    chunk = TrainStep(cfg, ParallelGrid()).chunks[0].double()
    with torch.no_grad():
        for p in chunk.parameters():  # non-zero biases, so the bias of the fused bias+GeLU matters
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=F64))
        return chunk(torch.arange(32).view(2, 16) % 64)


def test_fused_and_unfused_mlp_honour_the_activation():
    with eager_fused():  # compiled == eager is the test above
        tanh_unfused, tanh_fused = _chunk_output("gelu_tanh", False), _chunk_output("gelu_tanh", True)
        exact_unfused, exact_fused = _chunk_output("gelu", False), _chunk_output("gelu", True)
    torch.testing.assert_close(tanh_fused, tanh_unfused, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(exact_fused, exact_unfused, rtol=1e-13, atol=1e-13)
    assert (tanh_unfused - exact_unfused).abs().max() > 1e-8  # 1e5 times the fused/unfused difference
