"""The planning code knows the architecture: the closed-form parameter count against the meta-device model and
transformers, the FLOP formulas, the memory model against the bytes a layer saves, the cost model's GEMMs, and the
dry runs of the Llama 3.1 experiments."""
from __future__ import annotations

import pytest

from mlplat.config import from_dict
from mlplat.parallel.layout.vocab import pad_vocab_size
from mlplat.perf.flops import (
    ModelDims,
    hardware_flops_per_iteration,
    mfu,
    model_flops_per_iteration,
    model_flops_per_token,
    parameter_count,
    stage_parameters,
)
from mlplat.perf.memory import Layout, layer_activation_bytes, memory_per_gpu, sharded_activation_units
from mlplat.plan import load_group
from tests.helpers.paths import CONF
from tests.helpers.perf import middle_chunk_saved_bytes

SMALL = dict(n_layers=12, hidden=64, n_heads=4, seq_len=32, vocab_size=1000, dropout=0.0)
ARCHS = {
    "llama": dict(arch="llama", n_kv_heads=2, ffn_hidden=160),  # GQA, RoPE, RMSNorm, SwiGLU, untied, no biases
    "qwen2": dict(arch="llama", n_kv_heads=2, qkv_bias=True, tie_embeddings=True),  # + QKV bias, tied
    "gpt-variant": dict(arch="gpt", norm="rmsnorm", bias=False, tie_embeddings=False, n_kv_heads=2),
    "llama-learned-layernorm": dict(arch="llama", position="learned", norm="layernorm", bias=True, mlp="gelu"),
    "mqa": dict(arch="llama", n_kv_heads=1, qkv_bias=True),  # at t2 each rank holds the key/value head
    "qwen3": dict(arch="llama", n_kv_heads=2, qk_norm=True),  # + norms on q and k, d each, replicated
    # heads wider than h/a (Qwen3's head_dim): QKV h·(a + 2k)·d, the output projection a·d·h, norms of d
    "qwen3-head-dim": dict(arch="llama", n_kv_heads=2, qk_norm=True, head_dim=24),
}


@pytest.mark.parametrize("t,p,v,schedule", [(1, 1, 1, "1f1b"), (2, 2, 1, "1f1b"), (2, 2, 3, "interleaved"),
                                            (2, 3, 2, "zbv")])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_closed_form_equals_the_meta_model(arch, t, p, v, schedule):
    """Summed over the pipeline ranks, each tensor-parallel shard's full tensor (the full model, tied copies once), and
    per pipeline rank on one GPU: GQA's narrower QKV (with fewer key/value heads than t, one whole on each rank),
    SwiGLU's two-in-one fc1, missing biases, RMSNorm, no position table under RoPE, the untied output layer on the
    last stage."""
    from mlplat.perf.dry_run import meta_parameter_counts

    model = {**SMALL, **ARCHS[arch]}
    lay = Layout(tp=t, pp=p, vpp=v, schedule=schedule)
    total, per_stage = meta_parameter_counts(from_dict({"model": model}).model, lay)
    dims = ModelDims.from_config(model)
    assert total == parameter_count(dims, t)
    assert per_stage == stage_parameters(dims, t, lay.pipeline)


RELEASES = ("llama3_8b", "llama3_70b", "llama3_405b", "qwen2_0p5b")


def _transformers_count(m: dict) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    qwen = bool(m.get("qkv_bias"))
    kind, model_cls = (Qwen2Config, Qwen2ForCausalLM) if qwen else (LlamaConfig, LlamaForCausalLM)
    cfg = kind(vocab_size=m["vocab_size"], hidden_size=m["hidden"], intermediate_size=m["ffn_hidden"],
               num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
               num_key_value_heads=m["n_kv_heads"], tie_word_embeddings=bool(m.get("tie_embeddings", False)))
    with torch.device("meta"):
        hf = model_cls(cfg)
    return sum(q.numel() for q in hf.parameters())  # a tied weight is one parameter


def test_release_shapes_equal_the_meta_model_and_transformers():
    """Llama 3.1 8B/70B/405B (LlamaForCausalLM) and Qwen2-0.5B (Qwen2ForCausalLM, tied, QKV bias): the closed form,
    mlplat's meta-device model and transformers' count agree. mlplat pads the vocabulary to a multiple of 128·t:
    at t = 1 both vocabularies are multiples of 128 already; at t = 8 the padding adds its rows, once per table."""
    pytest.importorskip("transformers")
    from mlplat.perf.dry_run import meta_parameter_counts

    want = {"llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496, "llama3_405b": 405_853_388_800,
            "qwen2_0p5b": 494_032_768}  # the released models' counts
    for name in RELEASES:
        m = load_group("model", name)
        dims = ModelDims.from_config(m)
        closed = parameter_count(dims, 1, padded=False)
        assert closed == want[name] == _transformers_count(m), name
        assert meta_parameter_counts(from_dict({"model": m}).model, Layout())[0] == parameter_count(dims, 1) == closed
        tables = 1 if dims.tie_embeddings else 2
        pad = pad_vocab_size(dims.vocab_size, 8) - dims.vocab_size
        assert parameter_count(dims, 8) - closed == tables * pad * dims.hidden, name


def test_flops_general_formula_reduces_to_the_papers():
    """6·N + 12·l·h·s per token (N the GEMM weights, the output layer included; the attention term non-causal):
    for GPT the paper's 72·B·s·l·h²·(...) term for term; for Llama 3.1 8B by hand, and torchtitan's own MFU (33%
    eager at 5,762 tokens/s per GPU) comes out of it."""
    from mlplat.perf.flops import forward_flops_per_sequence

    gpt = ModelDims(24, 2304, 24, 2048, 51200)
    assert gpt.is_paper_gpt  # so model_flops_per_iteration is the printed 72 formula
    general = 3 * 4 * sum(forward_flops_per_sequence(gpt))
    assert general == pytest.approx(model_flops_per_iteration(gpt, 4), rel=1e-12)
    assert model_flops_per_token(gpt) == pytest.approx(model_flops_per_iteration(gpt, 1) / 2048, rel=1e-12)
    layers, scores, logits = forward_flops_per_sequence(gpt)
    assert 4 * 4 * (layers + scores) + 3 * 4 * logits == pytest.approx(hardware_flops_per_iteration(gpt, 4), rel=1e-12)
    d = ModelDims.from_config(load_group("model", "llama3_8b"))
    h, f, kv, V, l, s = 4096, 14336, 1024, 128256, 32, 8192
    n = l * (h * (h + 2 * kv) + h * h + h * 2 * f + f * h) + V * h
    assert model_flops_per_token(d) == 6 * n + 12 * l * h * s
    assert model_flops_per_iteration(d, 16) == pytest.approx(16 * s * model_flops_per_token(d), rel=1e-12)
    layers, logits = 2 * s * (n - V * h) + 4 * s * s * h * l, 2 * s * h * V
    assert hardware_flops_per_iteration(d, 1, "full") == pytest.approx(4 * layers + 3 * logits, rel=1e-12)
    assert 0.33 < mfu(5762 * 8, 8, d, 989e12) < 0.34


def _dims(**kw) -> ModelDims:
    return ModelDims.from_config({**load_group("model", "llama3_70b"), **kw})


def test_fewer_key_value_heads_than_t_cost_a_whole_head_per_rank():
    """8 key/value heads at t16: each rank holds (and computes) one whole head, replicated on two ranks, so its
    parameters and activations are those of a rank of the 16-head model at t16; the full model is still the
    8-head one."""
    from mlplat.perf.flops import layer_parameters_of

    kv8, kv16 = _dims(n_kv_heads=8), _dims(n_kv_heads=16)
    assert layer_parameters_of(kv8, 16) == layer_parameters_of(kv16, 16)
    assert layer_parameters_of(kv8, 8) < layer_parameters_of(kv16, 8) and \
        parameter_count(kv8, 16) < parameter_count(kv16, 16)
    lay = Layout(tp=16, micro_batch_size=1, recompute="selective", precision="bf16-megatron")
    assert layer_activation_bytes(kv8, lay) == layer_activation_bytes(kv16, lay)


def test_memory_model_knows_the_architecture():
    from dataclasses import replace

    lay = Layout(tp=8, micro_batch_size=1, global_batch_size=1, recompute="selective", precision="bf16-megatron",
                 sequence_parallel=True)
    assert sharded_activation_units(ModelDims(4, 64, 4, 32, 128)) == 24  # Korthikanti's, the paper's GPT unchanged
    gqa, mha = _dims(), _dims(n_kv_heads=64)
    sbh = 8192 * 8192
    # K and V at 8/64 of Q's width: the QKV output's and the rotated K's bytes shrink by 6·(1 - 1/8)·sbh / t.
    assert layer_activation_bytes(mha, lay) - layer_activation_bytes(gqa, lay) == pytest.approx(6 * (7 / 8) * sbh / 8)
    # SwiGLU keeps gate and up (2f) and fc2's input (f), and SiLU(gate) unless fused.
    unfused = replace(lay, fused=False)
    assert layer_activation_bytes(gqa, unfused) - layer_activation_bytes(gqa, lay) == pytest.approx(
        2 * 28672 / 8192 * sbh / 8)
    gelu = _dims(mlp="gelu")
    assert layer_activation_bytes(gqa, lay) - layer_activation_bytes(gelu, lay) == pytest.approx(
        2 * 28672 / 8192 * sbh / 8)
    # The untied output layer: its weights, gradients and optimizer state on the last stage only.
    pp = Layout(tp=8, pp=4, dp=2, micro_batch_size=1, global_batch_size=8, recompute="full",
                precision="bf16-megatron", distributed_optimizer=True)
    per = stage_parameters(gqa, 8, pp.pipeline)
    out = pad_vocab_size(128256, 8) // 8 * 8192
    assert per[3] - per[1] == out + 8192  # the output shard and the final RMSNorm
    assert per[0] - per[1] == out  # the word embedding, no position table
    last, middle = memory_per_gpu(gqa, pp, 3), memory_per_gpu(gqa, pp, 1)
    for kind, per_param in (("weights", 2), ("gradients", 4), ("optimizer_state", 12 / 2)):
        assert last.breakdown[kind] - middle.breakdown[kind] == pytest.approx(per_param * (out + 8192))


@pytest.mark.parametrize("kv,recompute,head_dim", [(2, "selective", None), (8, "selective", None), (2, "full", None),
                                                   (2, "selective", 32)])
def test_saved_activation_bytes_of_a_llama_layer(kv, recompute, head_dim):
    """A middle chunk of the real Llama model (bf16, dropout 0, math attention, unfused, t = 1) saves what the
    memory model says, once its two CPU-only differences are put in: no dropout masks (2·sbh) and the decomposed
    RMSNorm's fp32 copies (+6·sbh per norm). With model.head_dim = 2h/a, Q, K, V and the output projection's input
    are twice as wide."""
    from mlplat.config import ModelConfig

    s, b, h, a, layers = 64, 4, 128, 8, 2
    cfg = ModelConfig(arch="llama", n_layers=3 * layers, hidden=h, n_heads=a, n_kv_heads=kv, seq_len=s,
                      vocab_size=256, ffn_hidden=352, head_dim=head_dim)
    got = middle_chunk_saved_bytes(cfg, b, recompute)
    lay = Layout(micro_batch_size=b, precision="bf16-megatron", recompute=recompute, fused=False, attention="math")
    sbh = s * b * h
    want = layer_activation_bytes(ModelDims.of(cfg), lay)
    if recompute == "selective":
        want += -2 * sbh + 2 * 6 * sbh
    assert got == pytest.approx(want, rel=0.02)


def test_cost_model_knows_the_architecture():
    """Grouped-query attention narrows the QKV GEMMs; an untied output layer has no gradient to sum between the
    first and the last stage."""
    from mlplat.perf.cluster import Cluster, layer_costs
    from mlplat.perf.step import FlushCosts, after_flush

    cl = Cluster.from_config(load_group("cluster", "h100_96gb"))
    lay = Layout(tp=8, micro_batch_size=1, global_batch_size=1, recompute="none", precision="bf16-megatron")
    gqa, mha = layer_costs(_dims(), lay, cl), layer_costs(_dims(n_kv_heads=64), lay, cl)
    assert gqa.breakdown["dense_gemm_forward"] < 0.9 * mha.breakdown["dense_gemm_forward"]
    pp = Layout(tp=8, pp=2, dp=2, micro_batch_size=1, global_batch_size=4, precision="bf16-megatron")
    costs = FlushCosts(reduction=lambda r, g: 0.0, tied=lambda nbytes: 1.0, gather=lambda r, w: 0.0,
                       optimizer=lambda shard: 0.0)
    assert after_flush(_dims(tie_embeddings=True), pp, [1, 1], [0.0, 0.0], costs).exposed == 1.0
    assert after_flush(_dims(), pp, [1, 1], [0.0, 0.0], costs).exposed == 0.0


@pytest.fixture(scope="module")
def llama_plans():
    from hydra import compose, initialize_config_dir

    from mlplat.config import load_config
    from mlplat.perf.dry_run import plan

    plans = {}
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        for name in ("llama3_8b", "llama3_70b", "llama3_405b"):
            overrides = [f"experiment={name}", "dry_run=true"]
            raw = compose(config_name="config", overrides=overrides)
            plans[name] = plan(load_config(raw), experiment=name, overrides=overrides, max_compute_ops=20_000)
    return plans


def test_dry_run_of_the_llama3_experiments(llama_plans):
    """`python -m mlplat.train +experiment=NAME dry_run=true` for 8B, 70B and 405B: the meta-device model's count
    equals the closed form, the layout fits the 94 GB H100, the summary names the architecture."""
    from mlplat.perf.dry_run import format_plan

    gpus = {"llama3_8b": 8, "llama3_70b": 256, "llama3_405b": 512}
    for name, pl in llama_plans.items():
        assert pl["parameters_source"] == "meta-device model"
        assert pl["parameters_total"] == pl["parameters_closed_form"]
        assert pl["fits"] and not pl["warnings"], (name, pl["warnings"])
        assert pl["layout"]["gpus"] == gpus[name] and pl["layout"]["precision"] == "bf16-megatron"
        assert f"+experiment={name}" in pl["slurm_command"]
    text = format_plan(llama_plans["llama3_405b"])
    assert text.startswith("mlplat dry run: Llama l=126 h=16384 a=128 kv=8 f=53248 s=8192 V=128256 (RoPE, RMSNorm, "
                           "SwiGLU, untied output) on h100_96gb")
    # torchtitan's published layout: t8·p8·d8 on 512 GPUs, 16 chunks of 7, 8 x 14, 7 layers, within 80 GB.
    pl = llama_plans["llama3_405b"]
    L = pl["layout"]
    assert (L["tp"], L["pp"], L["vpp"], L["dp"], L["schedule"]) == (8, 8, 2, 8, "interleaved")
    assert L["chunk_layers"] == [7, *[8] * 14, 7] and "; layers per chunk 7, 8 x14, 7" in text
    stages = pl["parameters_per_stage"]  # the 7-layer ends carry the embedding and the output layer: lighter still
    assert pl["memory_per_gpu_bytes"] < 80e9 and len(set(stages[1:7])) == 1 and max(stages[0], stages[7]) < stages[1]
    assert "hydra.launcher.nodes=64" in pl["slurm_command"]


def test_torchtitans_405b_layout_needs_its_uneven_stages():
    """p = 8 with 126 layers: no even split, said in the config's words; with the first and the last stage's
    layers set (1F1B: 15, 16 x 6, 15) the layout is valid and fits."""
    from mlplat.perf.memory import layout_errors, memory_per_stage

    dims = ModelDims.from_config(load_group("model", "llama3_405b"))
    for v, schedule in ((1, "1f1b"), (2, "interleaved")):
        errors = layout_errors(dims, Layout(tp=8, pp=8, vpp=v, dp=8, global_batch_size=256, schedule=schedule), 8)
        assert any(f"model.n_layers=126 is not divisible by parallel.pp·parallel.vpp={8 * v}" in e for e in errors)
    lay = Layout(tp=8, pp=8, dp=8, global_batch_size=256, first_stage_layers=15, last_stage_layers=15,
                 sequence_parallel=True, distributed_optimizer=True, precision="bf16-megatron")
    assert layout_errors(dims, lay, 8) == [] and lay.pipeline.chunk_layers(126) == [15, *[16] * 6, 15]
    assert max(r.total for r in memory_per_stage(dims, lay)) < 80e9
    # 8 key/value heads at t16: replicated on pairs of ranks, no longer a broken rule
    assert not any("n_kv_heads" in e for e in layout_errors(dims, Layout(tp=16, pp=7, dp=1, global_batch_size=7)))
