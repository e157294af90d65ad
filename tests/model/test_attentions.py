"""An attention is one registry entry (`mlplat.specs.attentions`) and its runtime: this file alone adds a gated
attention (the output gate of Qwen3-Next: out(core · sigmoid(gate(x))), a column-parallel gate GEMM h -> a·d) and
checks that, with no other file edited, the config takes it and checks its rule, the model builds and trains it and
computes it as written by hand, the dry run counts its parameters as the built model holds them, the FLOP, memory and
cost models charge its extra GEMM and kept activations, and the Hugging Face export and init_from refuse it in one
line naming model.attention."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mlplat.checkpoint import CheckpointError
from mlplat.config import ConfigError, KernelsConfig, load_config
from mlplat.model.decoder import ParallelAttention, build_rank_chunks, parameter_count
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.random import RNGTracker, seed_model_parallel
from mlplat.perf.flops import ModelDims, model_flops_per_token, stage_parameters
from mlplat.perf.flops import parameter_count as closed_form_count
from mlplat.perf.memory import Layout, layer_activation_bytes, memory_per_gpu, weight_residue_bytes
from mlplat.specs import attentions
from mlplat.specs.attentions import Attention, mha_kept, qkv_and_out
from mlplat.specs.blocks import Gemm
from tests.helpers.equivalence import make_cfg, train_run

F64 = torch.float64
MODEL = dict(n_layers=2, hidden=32, n_heads=4, seq_len=16, vocab_size=64)


class GatedAttention(ParallelAttention):
    """out(core · sigmoid(gate(x))): the base class builds qkv, gate and out from the entry's GEMMs."""

    def project(self, x, ctx):
        return self.out(ctx * torch.sigmoid(self.gate(x)))


def _kept(model, tp=1):
    """Multi-head attention's, and the sigmoid's output and the gated product (out's input), a·d each."""
    return mha_kept(model, tp) + 2 * 2 * model.attention_width / model.hidden


def _rules(model):
    yield from attentions.get("mha").rules(model)
    if model.qk_norm:
        yield "model.qk_norm applies to model.attention=mha; model.attention=gated gates the heads' outputs"


QKV, OUT = qkv_and_out()
GATED = Attention("gated", "gated attention", GatedAttention,
                  (QKV, Gemm("gate", lambda h, w: w.q, lambda h, w: h, "column"), OUT), _kept, rules=_rules)


@pytest.fixture
def gated():
    with attentions.registered(GATED) as entry:
        yield entry


def _cfg(**model):
    return load_config({"model": dict(MODEL, **model), "kernels": dict(attention="math"), "logger": {"name": "none"}},
                       check_data=False)


def _reference(attn, x):
    """The gated attention written out: causal softmax(q·kᵀ/√d)·v per head, gated, projected."""
    b, s, _ = x.shape
    a, d = attn.heads, attn.head_dim
    qkv = (x @ attn.qkv.weight.T + attn.qkv.bias).view(b, s, a, 3, d)  # [head][q|k|v][d] at n_kv_heads = n_heads
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, a * d)
    gate = torch.sigmoid(x @ attn.gate.weight.T + attn.gate.bias)
    return (ctx * gate) @ attn.out.weight.T + attn.out.bias


def test_the_model_builds_and_trains_it_and_computes_it_in_float64(gated):
    cfg = _cfg(attention="gated")
    x = torch.randn(2, 16, 32, dtype=F64, generator=torch.Generator().manual_seed(1))
    for fused in (False, True):
        torch.manual_seed(0)
        tracker = RNGTracker()
        seed_model_parallel(0, ParallelGrid(), tracker)
        attn = attentions.get("gated").runtime()(cfg.model, ParallelGrid(), tracker, KernelsConfig(fused=fused),
                                                 "math", dtype=F64)
        assert [name for name, _ in attn.named_children()][:3] == ["qkv", "gate", "out"]
        with torch.no_grad():
            for p in attn.parameters():
                p.normal_(0, 0.3)
        out = attn(x)
        out = out[0] + out[1] if fused else out
        torch.testing.assert_close(out, _reference(attn, x), rtol=1e-12, atol=1e-12)
    run = train_run(make_cfg(model={"attention": "gated"}, steps=1), ParallelGrid(), 1)
    assert torch.isfinite(torch.tensor(run["losses"])).all()


def test_the_dry_run_counts_its_parameters_as_the_model_holds_them(gated):
    from mlplat.perf.dry_run import meta_parameter_counts

    h = 32
    for keys in ({}, {"n_kv_heads": 1}):  # one K/V head: at t = 2 each rank holds it whole
        cfg = _cfg(attention="gated", **keys)
        chunks = build_rank_chunks(cfg.model, ParallelGrid(), Layout().pipeline, device=torch.device("meta"))
        built = parameter_count(list(chunks.values()))
        dims = ModelDims.of(cfg.model)
        assert meta_parameter_counts(cfg.model, Layout(tp=1, pp=2))[0] == closed_form_count(dims) == built
        lay = Layout(tp=2, pp=2)
        assert meta_parameter_counts(cfg.model, lay) == (closed_form_count(dims, 2), stage_parameters(dims, 2,
                                                                                                      lay.pipeline))
        mha = build_rank_chunks(_cfg(**keys).model, ParallelGrid(), Layout().pipeline, device=torch.device("meta"))
        # the gate: h·a·d weights and a·d biases per layer (a·d = h here)
        assert built - parameter_count(list(mha.values())) == 2 * (h * h + h)


def test_the_flop_memory_and_cost_models_read_its_entry(gated):
    from mlplat.perf.cluster import layer_costs
    from tests.helpers.perf import a100

    h, s, b, t, l = 32, 16, 4, 2, 2
    dims = {name: ModelDims.of(_cfg(attention=name).model) for name in ("gated", "mha")}
    # its GEMM: 6 FLOPs per weight and token, forward and backward
    assert model_flops_per_token(dims["gated"]) - model_flops_per_token(dims["mha"]) == 6 * l * h * h
    for fused in (False, True):
        lay = Layout(tp=t, micro_batch_size=b, global_batch_size=b, recompute="none", precision="bf16-mixed",
                     fused=fused)
        # kept: the entry's two a·d tensors per token, 2-byte, split over t
        assert layer_activation_bytes(dims["gated"], lay) - layer_activation_bytes(dims["mha"], lay) == \
            pytest.approx(2 * 2 * s * b * h / t, rel=1e-12)
        # a pending W keeps its input h and its output's gradient a·d/t
        assert weight_residue_bytes(dims["gated"], lay) - weight_residue_bytes(dims["mha"], lay) == \
            pytest.approx(2 * s * b * (h + h / t), rel=1e-12)
        # weights, gradients and Adam: 16 bytes per parameter under bf16-mixed, the gate split over t
        mem = {name: memory_per_gpu(d, lay) for name, d in dims.items()}
        assert mem["gated"].parameters - mem["mha"].parameters == l * (h * h + h) // t
    lay = Layout(tp=t, micro_batch_size=b, global_batch_size=b)
    costs = {name: layer_costs(d, lay, a100()) for name, d in dims.items()}
    assert costs["gated"].breakdown["dense_gemm_forward"] > costs["mha"].breakdown["dense_gemm_forward"]


def test_the_dry_run_plans_it(gated):
    """`python -m mlplat.train model=tiny model.attention=gated dry_run=true` as that composes it: the meta-device
    model's count is the closed form's, and the summary names it."""
    from hydra import compose, initialize_config_dir

    from mlplat.perf.dry_run import format_plan, plan
    from tests.helpers.paths import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        raw = compose(config_name="config", overrides=["model=tiny", "model.vocab_size=256", "model.attention=gated",
                                                       "trainer=gpu", "cluster=dgx_h100", "dry_run=true"])
        pl = plan(load_config(raw), method="analytic")
    assert pl["parameters_source"] == "meta-device model"
    assert pl["parameters_total"] == pl["parameters_closed_form"]
    assert "gated attention" in format_plan(pl).splitlines()[0]


def test_the_config_refuses_what_its_rules_refuse_in_one_line(gated):
    with pytest.raises(ConfigError) as bad:
        _cfg(attention="gated", qk_norm=True)
    assert str(bad.value) == \
        "model.qk_norm applies to model.attention=mha; model.attention=gated gates the heads' outputs"
    with pytest.raises(ConfigError, match=r"^model.n_heads=4 is not divisible by model.n_kv_heads=3 \(each"):
        _cfg(attention="gated", n_kv_heads=3)


def test_unregistered_it_is_refused():
    with pytest.raises(ConfigError, match=r"^model.attention='gated' is not one of mha, mla$"):
        _cfg(attention="gated")


def test_the_hugging_face_export_and_init_from_refuse_it_in_one_line(gated, tmp_path, monkeypatch):
    import mlplat.checkpoint.io
    from mlplat.checkpoint.hf import HFWeights
    from mlplat.checkpoint.hf_config import check_init_from, hf_class
    from mlplat.checkpoint.hf_export import export_hf

    model = _cfg(attention="gated").model
    assert hf_class(model) is None
    why = ("model.attention=gated has no Hugging Face names (transformers computes model.attention=mha, "
           "model.attention=mla)")
    monkeypatch.setattr(mlplat.checkpoint.io, "verify", lambda ckpt: {"layout": {"model": dataclasses.asdict(model)}})
    with pytest.raises(CheckpointError) as bad:
        export_hf(tmp_path, tmp_path / "out")
    assert str(bad.value) == f"checkpoint {tmp_path}: {why}"
    with pytest.raises(ConfigError) as bad:
        check_init_from(model, str(tmp_path))
    assert str(bad.value) == f"init_from={tmp_path}: {why}"
    with pytest.raises(CheckpointError) as bad:
        HFWeights(tmp_path, model)
    assert str(bad.value) == f"init_from={tmp_path}: {why}"
