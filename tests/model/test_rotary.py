"""Rotary position embedding: Llama 3.1's scaled frequencies are transformers', the tables are built once per
chunk and shape and shift with their offset, a rotated q·k depends on the positions' difference only, and a partial
rotation (model.rotary_dim) is transformers' GLM-4.5 rotation, fused or not."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from mlplat.model.rotary import Rotary, inverse_frequencies

LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
@pytest.mark.parametrize("scaling", [None, LLAMA31])
def test_frequencies_are_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "default" if scaling is None else "llama3", "rope_theta": 500000.0, **(scaling or {})}
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=rope)
    init = LlamaRotaryEmbedding.compute_default_rope_parameters if scaling is None else ROPE_INIT_FUNCTIONS["llama3"]
    theirs, _ = init(cfg)
    ours = inverse_frequencies(64, 500000.0, scaling)
    assert torch.equal(ours, theirs)
    if scaling is not None:  # the scaling acted: low frequencies divided by the factor, high ones kept
        plain = inverse_frequencies(64, 500000.0)
        assert ours[0] == plain[0] and torch.isclose(ours[-1], plain[-1] / 8)


def test_tables_are_built_once_and_shift_with_their_offset():
    rotary = Rotary(8, 10000.0)
    cos, sin = rotary.tables(6, torch.device("cpu"), torch.float64)
    assert rotary.tables(6, torch.device("cpu"), torch.float64)[0] is cos  # cached, not recomputed
    later = rotary.tables(4, torch.device("cpu"), torch.float64, offset=2)
    assert torch.equal(later[0], cos[2:]) and torch.equal(later[1], sin[2:])
    assert cos.dtype == torch.float64 and len(rotary._tables) == 2


def test_rotated_scores_depend_on_the_distance_only():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 8, generator=gen, dtype=torch.float64).expand(1, 1, 6, 8)
    k = torch.randn(1, 1, 1, 8, generator=gen, dtype=torch.float64).expand(1, 1, 6, 8)
    rq, rk = Rotary(8, 10000.0)(q, k)
    scores = (rq @ rk.transpose(-2, -1))[0, 0]  # the same q and k at every position
    for d in range(-5, 6):
        diag = torch.diagonal(scores, offset=d)
        assert torch.allclose(diag, diag[0].expand_as(diag), rtol=0, atol=1e-6), d
    assert not torch.allclose(torch.diagonal(scores, 1)[0], torch.diagonal(scores, 2)[0])


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
@pytest.mark.parametrize("fused", [False, True])
def test_partial_rotation_is_transformers_glm4_moe(fused):
    """Heads of 16, their first 8 channels turned (partial_rotary_factor 0.5): q and k equal transformers'
    Glm4MoeRotaryEmbedding + apply_rotary_pos_emb, bit for bit in float64 (both build float32 tables), at positions
    0..5 and at gathered positions; the last 8 channels pass as they are."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb

    cfg = Glm4MoeConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    theirs_emb = Glm4MoeRotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, n, 6, 16, generator=gen, dtype=torch.float64) for n in (4, 2))
    rotary = Rotary(8, 1e6)
    assert torch.equal(rotary.inv_freq, theirs_emb.inv_freq)
    for positions in (None, torch.tensor([[3, 4, 5, 9, 10, 11]])):
        ids = torch.arange(6)[None] if positions is None else positions
        cos, sin = theirs_emb(q, ids)
        want = apply_rotary_pos_emb(q, k, cos, sin)
        got = rotary(q, k, fused, *(() if positions is None else (positions, 12)))
        for a, b, x in zip(got, want, (q, k)):
            assert torch.equal(a, b) and torch.equal(a[..., 8:], x[..., 8:])
