"""The closed forms with multi-token prediction (mlplat.perf.flops): the modules' parameters equal the meta-device
model's, per pipeline rank and in total (the word embedding's copy on the last rank, untied too), and the FLOPs
count each module's projection, layer and pass through the output layer."""
from __future__ import annotations

import pytest

from mlplat.config import from_dict
from mlplat.perf.flops import ModelDims, gemm_parameters, model_flops_per_token, parameter_count, stage_parameters
from mlplat.perf.memory import Layout

MOE = dict(num_experts=4, top_k=2, ffn_hidden=32, dense_layers=1)
MODELS = {
    "gpt-tied-d2": dict(n_layers=6, hidden=64, n_heads=4, seq_len=32, vocab_size=1000, mtp=dict(depth=2)),
    "llama-untied-d1": dict(n_layers=6, hidden=64, n_heads=4, n_kv_heads=2, seq_len=32, vocab_size=1000,
                            arch="llama", mtp=dict(depth=1)),
    "llama-moe-d2": dict(n_layers=6, hidden=64, n_heads=4, n_kv_heads=2, seq_len=32, vocab_size=1000, arch="llama",
                         moe=MOE, mtp=dict(depth=2)),
}


@pytest.mark.parametrize("name,t,p,v,schedule,last", [("gpt-tied-d2", 2, 3, 1, "1f1b", None),
                                                       ("llama-untied-d1", 2, 3, 2, "zbv", None),
                                                       ("llama-untied-d1", 1, 2, 1, "1f1b", None),
                                                       ("llama-moe-d2", 2, 1, 1, "1f1b", None),
                                                       # the modules on a stage of their own: [3, 3, 0] layers
                                                       ("llama-moe-d2", 2, 3, 1, "1f1b", 0)])
def test_closed_form_equals_the_meta_model(name, t, p, v, schedule, last):
    from mlplat.perf.dry_run import meta_parameter_counts

    model = MODELS[name]
    lay = Layout(tp=t, pp=p, vpp=v, schedule=schedule, last_stage_layers=last)
    total, per_stage = meta_parameter_counts(from_dict({"model": model}).model, lay)
    dims = ModelDims.from_config(model)
    assert total == parameter_count(dims, t)
    assert per_stage == stage_parameters(dims, t, lay.pipeline)
    assert ModelDims.from_config(dims.config_keys()) == dims  # a plan's model section rebuilds the same dims
    without = ModelDims.from_config({k: v for k, v in model.items() if k != "mtp"})
    assert parameter_count(dims, t) > parameter_count(without, t)


def test_flops_count_each_module():
    """Per module, by hand: the projection 2h², one Llama layer's GEMMs, the output layer V·h; its attention core."""
    dims = ModelDims.from_config(MODELS["llama-untied-d1"])
    without = ModelDims.from_config({k: v for k, v in MODELS["llama-untied-d1"].items() if k != "mtp"})
    h, d = 64, 16
    layer = h * (4 + 2 * 2) * d + 4 * d * h + 3 * h * without.ffn
    assert without.layer_gemm_weights == layer
    assert gemm_parameters(dims) - gemm_parameters(without) == 2 * h * h + layer + dims.padded_vocab() * h
    extra = model_flops_per_token(dims) - model_flops_per_token(without)
    assert extra == 6.0 * (2 * h * h + layer + dims.padded_vocab() * h) + 3.0 * dims.score_flops * 32


def test_memory_counts_the_modules_on_the_last_rank():
    """The last rank holds the modules' weights (in its parameters) and, per module, a layer's activations and one
    more set of logits; the first rank holds neither."""
    from mlplat.perf.memory import layer_activation_bytes, memory_per_stage

    dims = ModelDims.from_config(MODELS["llama-untied-d1"])
    lay = Layout(tp=1, pp=2)
    first, last = memory_per_stage(dims, lay)
    assert "mtp" not in first.breakdown
    assert last.breakdown["mtp"] == layer_activation_bytes(dims, lay) + last.breakdown["logits"]


def test_the_dry_runs_model_line_names_the_modules():
    from mlplat.perf.dry_run import model_line

    assert model_line(ModelDims.from_config(MODELS["gpt-tied-d2"]).config_keys()).endswith(
        "(learned positions, LayerNorm, GeLU, tied embeddings, biases, 2 MTP modules)")


def test_the_modules_on_a_stage_of_their_own():
    """parallel.last_stage_layers=0: the last stage's time and memory are the modules' and the output layer's alone
    (no layer of the model's), its parameters the modules', the final norm and the output layer."""
    from mlplat.perf.cluster import Cluster, chunk_times, layer_costs
    from mlplat.perf.memory import memory_per_stage
    from mlplat.plan import load_group

    dims = ModelDims.from_config(MODELS["llama-moe-d2"])
    own, beside = Layout(tp=1, pp=3, last_stage_layers=0), Layout(tp=1, pp=3)
    assert own.pipeline.chunk_layers(6) == [3, 3, 0] and beside.pipeline.chunk_layers(6) == [2, 2, 2]
    gpus = Cluster.from_config(load_group("cluster", "dgx_h100"))
    costs = layer_costs(dims, own, gpus)
    (f, b), (f2, b2) = chunk_times(dims, own, costs), chunk_times(dims, beside, costs)
    assert f[2] < f2[2] and b[2] < b2[2] and f[0] > f2[0]  # two layers moved off the last stage, onto the first
    mem = memory_per_stage(dims, own)
    assert "mtp" in mem[2].breakdown and mem[2].breakdown["activations"] == 0
    assert stage_parameters(dims, 1, own.pipeline)[2] == parameter_count(dims) - sum(
        stage_parameters(dims, 1, own.pipeline)[:2]) + dims.padded_vocab() * dims.hidden  # + the embedding's copy


def test_the_step_time_models_add_the_modules_to_the_last_stage():
    """On a GPU cluster and on CPU processes, the modules' layers and heads add to the last chunk's times only, and
    an untied model with modules at pp2 sums the word embedding's gradient between its two stages."""
    from mlplat.perf.cluster import Cluster, chunk_times, layer_costs, predict
    from mlplat.perf.step import back_to_back
    from mlplat.plan import load_group

    model = MODELS["llama-untied-d1"]
    dims, without = ModelDims.from_config(model), ModelDims.from_config({k: v for k, v in model.items() if k != "mtp"})
    lay = Layout(tp=1, pp=2, micro_batch_size=1, global_batch_size=4, post_validate=True)
    gpus = Cluster.from_config(load_group("cluster", "dgx_h100"))
    costs = layer_costs(dims, lay, gpus)
    (f, b), (f0, b0) = chunk_times(dims, lay, costs), chunk_times(without, lay, costs)
    assert f[0] == f0[0] and b[0] == b0[0] and f[1] > f0[1] + costs.layer_forward and b[1] > b0[1]
    assert not back_to_back(dims, lay) and back_to_back(without, lay)
    cpu = Cluster.from_config(load_group("cluster", "local_cpu"))
    assert predict(dims, lay, cpu).seconds_per_iteration > predict(without, lay, cpu).seconds_per_iteration
