"""A dense MLP is one registry entry (`mlplat.specs.mlps`) and its runtime: this file alone adds the squared ReLU
(So et al., "Primer", 2021: fc2(ReLU(fc1(x))²)) and checks that, with no other file edited, the config takes it and
checks its rule, the model builds and trains it, the dry run counts its parameters as the built model holds them,
the FLOP, memory and cost models charge its GEMMs, kept activations and traffic, and the Hugging Face export
refuses it in one line. The registered entries' own kept activations are checked against what autograd keeps."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mlplat.checkpoint import CheckpointError
from mlplat.config import ConfigError, KernelsConfig, load_config
from mlplat.model.decoder import ParallelMLP, build_rank_chunks, parameter_count
from mlplat.parallel.grid import ParallelGrid
from mlplat.perf.cluster import split_elementwise_units
from mlplat.perf.flops import ModelDims, model_flops_per_token
from mlplat.perf.flops import parameter_count as closed_form_count
from mlplat.perf.memory import Layout, layer_activation_bytes
from mlplat.specs import mlps
from mlplat.specs.mlps import MLP, two_gemms
from tests.helpers.equivalence import make_cfg, train_run

F64 = torch.float64
MODEL = dict(n_layers=2, hidden=32, n_heads=4, seq_len=16, vocab_size=64)


class SquaredReLUMLP(ParallelMLP):
    """fc2(ReLU(fc1(x))²): the base class builds fc1 and fc2 from the entry's GEMMs."""

    def activate(self, fc1):
        if self.fused:
            out, bias = fc1
            fc1 = out if bias is None else out + bias
        return torch.relu(fc1).square()


def _rules(model):
    if model.activation != "gelu":
        yield f"model.activation={model.activation} applies to model.mlp=gelu; model.mlp=relu2 squares a ReLU"


# ReLU reads and writes w, the square again (4); autograd keeps ReLU's output (the square's input too) and fc2's
# input (2)
RELU2 = MLP("relu2", "squared ReLU", SquaredReLUMLP, two_gemms(), lambda h: 4 * h, elementwise=4, kept=2,
            kept_fused=2, rules=_rules)


@pytest.fixture
def relu2():
    with mlps.registered(RELU2) as entry:
        yield entry


def _cfg(**model):
    return load_config({"model": dict(MODEL, **model), "kernels": dict(attention="math"), "logger": {"name": "none"}},
                       check_data=False)


def _mlp(cfg, fused: bool = False):
    torch.manual_seed(0)
    module = mlps.get(cfg.model.mlp).runtime()(cfg.model, ParallelGrid(), KernelsConfig(fused=fused), dtype=F64)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module


def test_the_model_builds_and_trains_it_and_computes_it_in_float64(relu2):
    cfg = _cfg(mlp="relu2")
    assert cfg.model.ffn == 4 * 32  # the entry's width
    x = torch.randn(2, 16, 32, dtype=F64, generator=torch.Generator().manual_seed(1))
    for fused in (False, True):
        mlp = _mlp(cfg, fused)
        out = mlp(x)
        out = out[0] + out[1] if fused else out
        hidden = torch.clamp(x @ mlp.fc1.weight.T + mlp.fc1.bias, min=0) ** 2
        torch.testing.assert_close(out, hidden @ mlp.fc2.weight.T + mlp.fc2.bias, rtol=1e-14, atol=1e-14)
    run = train_run(make_cfg(model={"mlp": "relu2"}, steps=1), ParallelGrid(), 1)
    assert torch.isfinite(torch.tensor(run["losses"])).all()


def test_the_dry_run_counts_its_parameters_as_the_model_holds_them(relu2):
    from mlplat.perf.dry_run import meta_parameter_counts

    cfg = _cfg(mlp="relu2")
    chunks = build_rank_chunks(cfg.model, ParallelGrid(), Layout().pipeline, device=torch.device("meta"))
    built = parameter_count(list(chunks.values()))
    dims = ModelDims.of(cfg.model)
    assert meta_parameter_counts(cfg.model, Layout(tp=1, pp=2))[0] == closed_form_count(dims) == built
    assert meta_parameter_counts(cfg.model, Layout(tp=2, pp=2))[0] == closed_form_count(dims, 2)  # V padded to 256
    # fc1 h·f + f, fc2 f·h + h per layer: the GeLU MLP's GEMMs and biases
    assert built == parameter_count(list(build_rank_chunks(_cfg(mlp="gelu").model, ParallelGrid(), Layout().pipeline,
                                                           device=torch.device("meta")).values()))


def test_the_flop_memory_and_cost_models_read_its_entry(relu2):
    h, f, s, b, t = 32, 128, 16, 4, 2
    dims = {name: ModelDims.of(_cfg(mlp=name, ffn_hidden=f).model) for name in ("relu2", "gelu", "swiglu")}
    # GEMMs: GeLU's two; SwiGLU's fc1 has one more h·f matrix, 6 FLOPs per weight and token
    assert model_flops_per_token(dims["relu2"]) == model_flops_per_token(dims["gelu"])
    assert model_flops_per_token(dims["swiglu"]) - model_flops_per_token(dims["relu2"]) == 6 * 2 * h * f
    # kept activations: 2f per token as GeLU's; SwiGLU's 4f unfused, 3f fused (2-byte activations under bf16-mixed)
    for fused, swiglu in ((False, 4), (True, 3)):
        lay = Layout(tp=t, micro_batch_size=b, recompute="none", precision="bf16-mixed", fused=fused)
        act = {name: layer_activation_bytes(d, lay) for name, d in dims.items()}
        assert act["relu2"] == act["gelu"]
        assert act["swiglu"] - act["relu2"] == pytest.approx(2 * s * b * (swiglu - 2) * f / t, rel=1e-12)
    # element-wise traffic: two passes over w where GeLU has one (bytes of 2-byte tensors per s·b·h)
    assert split_elementwise_units(dims["relu2"]) - split_elementwise_units(dims["gelu"]) == \
        pytest.approx(2 * (4 - 2) * f / h, rel=1e-12)


def test_the_dry_run_plans_it(relu2):
    """`python -m mlplat.train model=tiny model.mlp=relu2 dry_run=true` as that composes it: the meta-device model's
    count is the closed form's, and beside GeLU's plan only the activation's traffic differs (its GEMMs, parameters
    and kept activations are GeLU's)."""
    from hydra import compose, initialize_config_dir

    from mlplat.perf.dry_run import format_plan, plan
    from tests.helpers.paths import CONF

    plans = {}
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        for name in ("relu2", "gelu"):
            raw = compose(config_name="config", overrides=["model=tiny", "model.vocab_size=256", f"model.mlp={name}",
                                                           "trainer=gpu", "cluster=dgx_h100", "dry_run=true"])
            plans[name] = plan(load_config(raw), method="analytic")
    relu2, gelu = plans["relu2"], plans["gelu"]
    assert relu2["parameters_source"] == "meta-device model"
    assert relu2["parameters_total"] == relu2["parameters_closed_form"] == gelu["parameters_total"]
    assert relu2["model_flops_per_iteration"] == gelu["model_flops_per_iteration"]
    assert relu2["memory_breakdown_bytes"]["activations"] == gelu["memory_breakdown_bytes"]["activations"]
    assert relu2["time_breakdown_seconds"]["layer_forward"] > gelu["time_breakdown_seconds"]["layer_forward"]
    assert "squared ReLU" in format_plan(relu2).splitlines()[0]


@pytest.mark.parametrize("name", ["gelu", "swiglu", "relu2"])
def test_each_entry_keeps_what_autograd_keeps(relu2, name):
    """The activation tensors an unfused MLP saves for its backward, besides its input and its weights, are its
    entry's `kept` elements per token and unit of width."""
    cfg = _cfg(mlp=name)
    mlp = _mlp(cfg)
    x = torch.randn(2, 16, 32, dtype=F64, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in mlp.parameters()} | {x.untyped_storage().data_ptr()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    assert sum(saved.values()) == mlps.get(name).kept * cfg.model.ffn * 2 * 16


def test_the_config_refuses_what_its_rule_refuses_in_one_line(relu2):
    with pytest.raises(ConfigError) as bad:
        _cfg(mlp="relu2", activation="gelu_tanh")
    assert str(bad.value) == "model.activation=gelu_tanh applies to model.mlp=gelu; model.mlp=relu2 squares a ReLU"
    with pytest.raises(ConfigError, match=r"the experts compute model.mlp=gelu\|swiglu .*not model.mlp=relu2"):
        _cfg(mlp="relu2", arch="llama", moe=dict(num_experts=4, top_k=2))


def test_unregistered_it_is_refused():
    with pytest.raises(ConfigError, match=r"model.mlp='relu2' is not one of gelu, swiglu"):
        _cfg(mlp="relu2")


def test_the_hugging_face_export_refuses_it_in_one_line(relu2, tmp_path, monkeypatch):
    import mlplat.checkpoint.io
    from mlplat.checkpoint.hf_config import hf_class
    from mlplat.checkpoint.hf_export import export_hf

    model = dataclasses.asdict(_cfg(mlp="relu2").model)
    assert hf_class(model) is None
    monkeypatch.setattr(mlplat.checkpoint.io, "verify", lambda ckpt: {"layout": {"model": model}})
    with pytest.raises(CheckpointError, match=r"model \(arch=gpt, .*mlp=relu2, .*\) has no transformers class"):
        export_hf(tmp_path, tmp_path / "out")
