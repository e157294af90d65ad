"""`mlplat.parallel.linear.linear` is the model's only GEMM path: with a counting `Gemm` set on every module that
takes one (as a quantised GEMM would be), one forward and backward of a chunk computes exactly three products per
GEMM of the model (4 per layer, and the logits) through it, and the same loss and gradients as torch's own path.
Under a zero-bubble B (a deferring `WeightGradStore`, as the engine sets it) every weight gradient, the logits'
included, waits for W. The sequence-gathered path at t = 2 is counted in tests/parallel/test_sequence.py."""
from __future__ import annotations

import pytest
import torch

from mlplat.config import KernelsConfig, ModelConfig
from mlplat.model.decoder import DecoderChunk
from mlplat.model.init import init_full_view
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.random import RNGTracker, seed_model_parallel
from mlplat.parallel.weight_grad import WeightGradStore
from tests.helpers.gemms import CountingGemm, gemms_of, set_on_modules

F64 = torch.float64
TOL = 1e-12


def _chunk(cfg: ModelConfig) -> DecoderChunk:
    """One process's whole model in float64, its weights from seed 3."""
    grid, tracker = ParallelGrid(), RNGTracker()
    seed_model_parallel(0, grid, tracker)
    chunk = DecoderChunk(cfg, grid, 0, 1, kernels=KernelsConfig(attention="math"), tracker=tracker, dtype=F64)
    init_full_view(chunk, seed=3)
    return chunk


def _step(chunk: DecoderChunk, store: WeightGradStore | None = None,
          gemm: CountingGemm | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of one forward and backward; with a store, the backward is a zero-bubble B then W."""
    tokens = torch.arange(32).view(2, 16) % 61
    labels = (tokens * 7 + 3) % 61
    for p in chunk.parameters():
        p.grad = None
    loss = chunk(tokens, labels)
    if store is not None:
        store.key = (0, 0)
    loss.backward()
    if store is not None:
        store.key = None
        assert gemm.calls["weight_grad"] == 0, "a weight gradient was not deferred to W"
        store.run((0, 0))
    return float(loss.detach()), {n: p.grad.clone() for n, p in chunk.named_parameters()}


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_every_gemm_goes_through_the_seam(arch):
    chunk = _chunk(ModelConfig(arch=arch, n_layers=2, hidden=32, n_heads=4, seq_len=16, vocab_size=61, dropout=0.0))
    ref_loss, ref_grads = _step(chunk)

    gemm = CountingGemm()
    assert set_on_modules(chunk, "gemm", gemm) == gemms_of(chunk) == 9  # 4 linear layers each, and the chunk
    for store in (None, WeightGradStore()):
        set_on_modules(chunk, "wgrad_store", store)
        gemm.calls.clear()
        loss, grads = _step(chunk, store, gemm)
        n = gemms_of(chunk)
        assert gemm.calls == {"forward": n, "input_grad": n, "weight_grad": n}, (store, gemm.calls)
        assert abs(loss - ref_loss) < TOL
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")


def test_the_experts_gemms_take_the_same_seam():
    """A `Gemm` set on the experts (as a recipe would be) computes their grouped products, one of each of its three
    per expert, and the loss and every gradient equal the dense grouped GEMM's in float64: the attention's two
    GEMMs, the shared expert's two, the E experts' fc1 and fc2 per MoE layer, and the logits."""
    from mlplat.config import MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden=16, shared_experts=1)
    chunk = _chunk(ModelConfig(arch="llama", n_layers=2, hidden=32, n_heads=4, seq_len=16, vocab_size=61,
                               dropout=0.0, moe=moe))
    ref_loss, ref_grads = _step(chunk)

    gemm = CountingGemm()
    set_on_modules(chunk, "gemm", gemm)
    loss, grads = _step(chunk, None, gemm)
    n = len(chunk.layers) * (2 + 2 + 2 * moe.num_experts) + 1
    assert gemm.calls == {"forward": n, "input_grad": n, "weight_grad": n}, gemm.calls
    assert abs(loss - ref_loss) < TOL
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")
