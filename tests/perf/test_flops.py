"""mlplat.perf.flops: FLOP and parameter formulas by hand and against the paper's Table 1."""
from __future__ import annotations

import pytest

from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.parallel.layout.vocab import pad_vocab_size
from mlplat.perf.flops import (
    ModelDims,
    hardware_flops_per_iteration,
    mfu,
    model_flops_per_iteration,
    parameter_count,
    stage_parameters,
)
from tests.helpers.paths import CONF
from tests.helpers.perf import PAPER_PARAMS_B, TABLE1

_kind = lambda v: "interleaved" if v > 1 else "1f1b"  # noqa: E731
TINY = ModelDims(n_layers=1, hidden=6, n_heads=1, seq_len=2, vocab_size=12, vocab_pad_multiple=1)


# ---------------------------------------------------------------------------------------------- FLOPs

def _gemm_flops(dims: ModelDims, B: int) -> tuple[float, float]:
    """(per-layer forward, logits forward) FLOPs counted GEMM by GEMM: QKV, scores, attention·V, out, fc1, fc2."""
    s, h = dims.seq_len, dims.hidden
    layer = (2 * B * s * h * 3 * h + 2 * B * s * s * h + 2 * B * s * s * h + 2 * B * s * h * h
             + 2 * 2 * B * s * h * 4 * h)
    return layer, 2 * B * s * h * dims.vocab_size


def test_flop_formulas_match_a_gemm_by_gemm_count():
    layer, logits = _gemm_flops(TINY, 1)
    assert (layer, logits) == (1824, 288)
    # No recomputation: forward + backward (2x forward) of everything.
    assert model_flops_per_iteration(TINY, 1) == pytest.approx(3 * (layer + logits)) == pytest.approx(6336)
    # Full recomputation: one more forward of every layer, not of the logits.
    assert hardware_flops_per_iteration(TINY, 1, "full") == pytest.approx(4 * layer + 3 * logits) == pytest.approx(8160)
    assert hardware_flops_per_iteration(TINY, 1, "none") == model_flops_per_iteration(TINY, 1)
    assert hardware_flops_per_iteration(TINY, 1, "selective") == pytest.approx(6336 + 4 * 2 * 2 * 6)


def test_gpt1t_flops_and_paper_time_per_iteration():
    dims = ModelDims(128, 25600, 160, 2048, 51200)
    f = hardware_flops_per_iteration(dims, 3072, "full")
    assert f == pytest.approx(96 * 3072 * 2048 * 128 * 25600**2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600)))
    # The paper's 502 PFLOP/s means ~102 s per iteration.
    assert f / 502e15 == pytest.approx(102.4, rel=0.01)


def test_mfu_helper():
    dims = ModelDims(24, 2304, 24, 2048, 51200)
    tokens_per_s = 1e6
    per_token = model_flops_per_iteration(dims, 1) / 2048
    assert mfu(tokens_per_s, 32, dims, 312e12) == pytest.approx(tokens_per_s * per_token / 32 / 312e12)


# ---------------------------------------------------------------------------------------------- parameters

def test_parameter_count_by_hand():
    d = ModelDims(n_layers=1, hidden=4, n_heads=1, seq_len=8, vocab_size=10)
    # layer 12h²+13h = 244, word embedding 128·4 (padded to 128), positions 8·4, final LN 2·4
    assert parameter_count(d) == 244 + 512 + 32 + 8
    assert pad_vocab_size(10, 2) == 256 and parameter_count(d, tp=2) == 244 + 1024 + 32 + 8
    assert pad_vocab_size(51200, 8) == 51200 and pad_vocab_size(50257, 8) == 51200


@pytest.mark.parametrize("name,billions", list(zip(TABLE1, PAPER_PARAMS_B)))
def test_table1_parameter_counts_match_the_paper(name, billions):
    from omegaconf import OmegaConf

    dims = ModelDims.from_config(OmegaConf.load(CONF / "model" / f"{name}.yaml"))
    assert round(parameter_count(dims, 8) / 1e9, 1) == billions


@pytest.mark.parametrize("t,p,v", [(1, 1, 1), (2, 2, 1), (2, 2, 2), (4, 3, 2)])
def test_stage_counts_add_up_to_the_total(t, p, v):
    from mlplat.perf.flops import embedding_parameters, layer_parameters

    dims = ModelDims(n_layers=12, hidden=64, n_heads=4, seq_len=32, vocab_size=1000)
    tied = p * v > 1  # the last chunk then holds its own copy of the word embedding
    # t = 1: the stages are the model, plus the tied copy.
    copy1 = pad_vocab_size(1000, 1) * 64 if tied else 0
    assert sum(stage_parameters(dims, 1, PipelineLayout(p, v, _kind(v)))) - copy1 == parameter_count(dims, 1)
    # Any t: every layer once (as one shard), the embeddings, the final LN, the tied copy's shard.
    copy = pad_vocab_size(1000, t) // t * 64 if tied else 0
    assert sum(stage_parameters(dims, t, PipelineLayout(p, v, _kind(v)))) == (
        12 * layer_parameters(64, t) + embedding_parameters(dims, t) + 2 * 64 + copy)
    assert layer_parameters(64, t) == (12 * 64 * 64 + 7 * 64) // t + 6 * 64
