"""The closed forms with experts (mlplat.perf.flops): parameters equal the meta-device model's, per pipeline rank and
in total, and the FLOPs count a token's active weights (the router and its k experts, not all E)."""
from __future__ import annotations

import pytest

from mlplat.config import from_dict
from mlplat.perf.dry_run import model_line
from mlplat.perf.flops import ModelDims, gemm_parameters, parameter_count, stage_parameters
from mlplat.perf.memory import Layout
from mlplat.plan import load_group

MOE = dict(num_experts=4, top_k=2, ffn_hidden=32, shared_experts=1, shared_gate=True, dense_layers=1)
MODELS = {
    "gpt-biases": dict(n_layers=6, hidden=64, n_heads=4, seq_len=32, vocab_size=1000, moe=MOE),
    "llama-gqa": dict(n_layers=6, hidden=64, n_heads=4, n_kv_heads=2, seq_len=32, vocab_size=1000, arch="llama",
                      moe=dict(MOE, shared_experts=0, shared_gate=False, dense_layers=0)),
}


@pytest.mark.parametrize("name,t,p,v,schedule", [("gpt-biases", 2, 3, 1, "1f1b"), ("llama-gqa", 2, 3, 2, "zbv")])
def test_closed_form_equals_the_meta_model(name, t, p, v, schedule):
    from mlplat.perf.dry_run import meta_parameter_counts

    model = MODELS[name]
    lay = Layout(tp=t, pp=p, vpp=v, schedule=schedule)
    total, per_stage = meta_parameter_counts(from_dict({"model": model}).model, lay)
    dims = ModelDims.from_config(model)
    assert total == parameter_count(dims, t)
    assert per_stage == stage_parameters(dims, t, lay.pipeline)
    assert ModelDims.from_config(dims.config_keys()) == dims  # a plan's model section rebuilds the same dims


def test_flops_count_the_active_experts():
    """model=moe_tiny by hand: 1 dense SwiGLU layer (f = 352) and 3 MoE layers, each token through the router
    (8·h), 2 of 8 experts and the gated shared expert (f_e = 128)."""
    dims = ModelDims.from_config(load_group("model", "moe_tiny"))
    h, attention = 128, 128 * (128 + 2 * 64) + 128 * 128
    dense = attention + 3 * h * 352
    expert = 3 * h * 128
    moe = attention + 8 * h + 2 * expert + (expert + h)
    assert gemm_parameters(dims) == dense + 3 * moe + dims.padded_vocab() * h
    assert parameter_count(dims) > gemm_parameters(dims) + 3 * 6 * expert  # the 6 idle experts per layer held
    assert model_line(dims.config_keys()).endswith("untied output, 8 experts of f=128, top-2, 1 shared, from layer 1)")
