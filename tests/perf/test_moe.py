"""The closed forms with experts (mlplat.perf.flops): parameters equal the meta-device model's, per pipeline rank and
in total, and the FLOPs count a token's active weights (the router and its k experts, not all E)."""
from __future__ import annotations

import math

import pytest

from mlplat.config import from_dict
from mlplat.perf.dry_run import model_line
from mlplat.perf.flops import ModelDims, gemm_parameters, parameter_count, stage_parameters
from mlplat.perf.memory import Layout, memory_per_gpu
from mlplat.plan import load_group

MOE = dict(num_experts=4, top_k=2, ffn_hidden=32, shared_experts=1, shared_gate=True, dense_layers=1)
MODELS = {
    "gpt-biases": dict(n_layers=6, hidden=64, n_heads=4, seq_len=32, vocab_size=1000, moe=MOE),
    "llama-gqa": dict(n_layers=6, hidden=64, n_heads=4, n_kv_heads=2, seq_len=32, vocab_size=1000, arch="llama",
                      moe=dict(MOE, shared_experts=0, shared_gate=False, dense_layers=0)),
    "qwen3-head-dim": dict(n_layers=6, hidden=64, n_heads=4, n_kv_heads=2, head_dim=24, qk_norm=True, seq_len=32,
                           vocab_size=1000, arch="llama", moe=dict(MOE, shared_experts=0, shared_gate=False)),
}


@pytest.mark.parametrize("name,t,p,v,schedule", [("gpt-biases", 2, 3, 1, "1f1b"), ("llama-gqa", 2, 3, 2, "zbv"),
                                                  ("qwen3-head-dim", 4, 3, 1, "1f1b")])
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


def test_qwen3_release_shapes_equal_the_meta_model_and_transformers():
    """model=qwen3_30b_a3b and qwen3_235b_a22b, heads of 128 at hidden 2048 and 4096 (model.head_dim): the closed
    form, mlplat's meta-device model and transformers' Qwen3MoeForCausalLM count the released 30.5B and 235.1B; the
    active weights (embeddings included) the published 3.3B and 22.2B; the model FLOPs per token count the attention
    at its a·d width, not h."""
    pytest.importorskip("transformers")
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from mlplat.perf.dry_run import meta_parameter_counts
    from mlplat.perf.flops import model_flops_per_token

    for name, total, active in (("qwen3_30b_a3b", 30_532_122_624, 3.35), ("qwen3_235b_a22b", 235_093_634_560, 22.19)):
        m = load_group("model", name)
        moe = m["moe"]
        hf = Qwen3MoeConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden"], intermediate_size=m["ffn_hidden"],
                            num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
                            num_key_value_heads=m["n_kv_heads"], head_dim=m["head_dim"],
                            num_experts=moe["num_experts"], num_experts_per_tok=moe["top_k"],
                            moe_intermediate_size=moe["ffn_hidden"], tie_word_embeddings=False)
        with torch.device("meta"):
            theirs = sum(q.numel() for q in Qwen3MoeForCausalLM(hf).parameters())
        dims = ModelDims.from_config(m)
        assert parameter_count(dims, padded=False) == total == theirs, name
        assert meta_parameter_counts(from_dict({"model": m}).model, Layout())[0] == total, name
        h, l, ad, kvd, f = dims.hidden, dims.n_layers, m["n_heads"] * 128, m["n_kv_heads"] * 128, moe["ffn_hidden"]
        attention = h * (ad + 2 * kvd) + ad * h  # QKV, output projection: a·d = 2h
        n = l * (attention + moe["num_experts"] * h + moe["top_k"] * 3 * h * f)  # + the router, 8 experts
        norms = l * (2 * h + 2 * 128) + h
        assert round((n + 2 * dims.vocab_size * h + norms) / 1e9, 2) == active, name
        assert model_flops_per_token(dims) == 6 * (n + dims.padded_vocab() * h) + 12 * l * ad * dims.seq_len
        assert " kv=4 d=128 " in model_line(dims.config_keys())


# -- the experts' own layout (parallel.ep, parallel.etp) in the memory and time models ------------------------

def _mixtral(**moe):
    model = load_group("model", "mixtral_8x7b")
    return ModelDims.from_config({**model, "moe": {**model["moe"], **moe}})


def _stage(ep: int, **kw) -> Layout:
    """Mixtral's reference stage: t1 p4 d16 (16 ranks a stage), b1, B256, the distributed optimizer, bf16-megatron."""
    base = dict(tp=1, pp=4, dp=16, micro_batch_size=1, global_batch_size=256, recompute="none",
                precision="bf16-megatron", distributed_optimizer=True, attention="flash", ep=ep)
    return Layout(**{**base, **kw})


def test_expert_memory_follows_ep_and_edp():
    """ep doubles: the experts' weights and gradients per GPU halve, their optimizer state does not move (ep·edp =
    t·c·d: experts / (ep·edp) whatever ep), and the rest stays; etp=1 at t2 holds every expert whole."""
    from mlplat.perf.flops import stage_expert_parameters
    from mlplat.perf.memory import expert_split, memory_per_gpu

    dims = _mixtral()
    whole = stage_expert_parameters(dims, _stage(1).pipeline)[0]  # 8 layers × 8 experts × 3·4096·14336
    assert whole == 8 * 8 * 3 * 4096 * 14336
    mem = {ep: memory_per_gpu(dims, _stage(ep)) for ep in (2, 4, 8)}
    for ep in (2, 4):
        rest, experts = expert_split(dims, _stage(ep))[0]
        rest2, experts2 = expert_split(dims, _stage(2 * ep))[0]
        assert (rest, experts) == (rest2, 2 * experts2) and experts == whole // ep
        small, big = mem[2 * ep].breakdown, mem[ep].breakdown
        assert big["weights"] - small["weights"] == 2 * whole / (2 * ep)  # bf16 weights: 2 bytes
        assert big["gradients"] - small["gradients"] == 4 * whole / (2 * ep)  # fp32 main gradients
        assert big["optimizer_state"] == pytest.approx(small["optimizer_state"], rel=1e-12)
    rest, _ = expert_split(dims, _stage(8))[0]
    assert mem[8].breakdown["optimizer_state"] == pytest.approx(12 * (rest / 16 + whole / 8 / 2), rel=1e-12)
    # the optimizer's step: the rest's 1/16 and the experts' edp shard (1/2 of the rank's one expert a layer)
    from mlplat.perf.cluster import OPTIMIZER_BYTES_PER_PARAM, predict
    from mlplat.perf.links import Cluster

    cl = Cluster.from_config(load_group("cluster", "dgx_h100"))
    held = max(a / 16 + e / 2 for a, e in expert_split(dims, _stage(8)))
    step = predict(dims, _stage(8), cl, method="analytic").optimizer_seconds
    assert step == pytest.approx(OPTIMIZER_BYTES_PER_PARAM * held / (cl.device.hbm_gbytes_per_s * 1e9 * 0.8))
    assert expert_split(dims, _stage(1, tp=2, dp=8, etp=1))[0][1] == whole  # etp=1 at t2: all experts, whole


def test_dispatch_buffers_and_activations_at_an_imbalance():
    """alltoall: the permuted assignments and their outputs (2·X·h, X = routed·k·imbalance on the busiest rank)
    and the rank's own sent out and back (2·routed·k·h), 2 bytes each; allgather holds 2·ep·routed·h instead of
    the latter. The MoE layer's kept activations grow with the imbalance by X's tensors alone."""
    from mlplat.perf.memory import dispatch_buffer_bytes, moe_layer_activation_bytes

    h, routed = 4096, 4096  # b1 · s4096 / t1
    balanced, skewed = _mixtral(), _mixtral(plan_imbalance=1.5)
    lay = _stage(8)
    assert dispatch_buffer_bytes(balanced, lay) == 2 * (2 * routed * 2 + 2 * routed * 2) * h
    assert dispatch_buffer_bytes(skewed, lay) == 2 * (2 * routed * 2 * 1.5 + 2 * routed * 2) * h
    gather = _mixtral(dispatcher="allgather")
    assert dispatch_buffer_bytes(gather, lay) == 2 * (2 * routed * 2 + 2 * 8 * routed) * h
    per_assignment = 2 * (h + 3 * 14336 + 1)  # fc1's input, gate and up, fc2's input, the gate: no SiLU, no output
    grown = moe_layer_activation_bytes(skewed, lay) - moe_layer_activation_bytes(balanced, lay)
    assert grown == pytest.approx(0.5 * routed * 2 * per_assignment, rel=1e-12)
    assert moe_layer_activation_bytes(skewed, _stage(8, recompute="full")) == \
        moe_layer_activation_bytes(balanced, _stage(8, recompute="full"))  # the layer's input alone


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_saved_activation_bytes_of_an_moe_layer(arch):
    """A middle chunk of real MoE layers (bf16, dropout 0, math attention, selective recomputation, one process)
    keeps what `moe_layer_activation_bytes` says once the dense layer's CPU differences are put in (test_llama: no
    dropout masks, -2·sbh; the decomposed RMSNorm's fp32 copies, +6·sbh per norm). One more expert per token adds
    exactly one assignment's bytes: fc1's input (h), fc1's output and fc2's input (3f for SwiGLU, 2f for GeLU), its
    gate and three int64 indices; neither the expert's output nor its SiLU is kept."""
    from mlplat.config import ModelConfig, MoEConfig
    from mlplat.perf.memory import moe_layer_activation_bytes
    from tests.helpers.perf import middle_chunk_saved_bytes

    s, b, h, a, f = 64, 4, 128, 8, 96
    kv = {"n_kv_heads": 2} if arch == "llama" else {}

    def measure(top_k: int) -> tuple[float, ModelDims]:
        cfg = ModelConfig(arch=arch, n_layers=6, hidden=h, n_heads=a, seq_len=s, vocab_size=256, ffn_hidden=352,
                          dropout=0.0, moe=MoEConfig(num_experts=8, top_k=top_k, ffn_hidden=f), **kv)
        return middle_chunk_saved_bytes(cfg, b, "selective"), ModelDims.of(cfg)

    (got, dims), (one, _) = measure(2), measure(1)
    lay = Layout(micro_batch_size=b, precision="bf16-megatron", recompute="selective", fused=False, attention="math")
    cpu = (-2 + (2 * 6 if arch == "llama" else 0)) * s * b * h
    assert got == pytest.approx(moe_layer_activation_bytes(dims, lay) + cpu, rel=0.01)
    width = 3 * f if arch == "llama" else 2 * f
    assert got - one == (2 * (h + width + 1) + 24) * s * b


def test_alltoall_time_scales_with_tokens_top_k_and_hidden():
    """One all-to-all's bandwidth term is linear in routed·k·h (and the imbalance), over NVLink while the ep group
    fits in a node, crossing InfiniBand (slower) once it does not; the expert GEMMs of the busiest rank grow with
    the imbalance, and so does the predicted step."""
    from mlplat.perf.cluster import layer_costs, predict
    from mlplat.perf.links import Cluster

    cl = Cluster.from_config(load_group("cluster", "dgx_h100"))
    lat = 7 * cl.nvlink_latency_s

    def dispatch(dims, lay):
        return layer_costs(dims, lay, cl).breakdown["moe_dispatch"] - lat

    base = dispatch(_mixtral(), _stage(8))
    assert dispatch(_mixtral(), _stage(8, micro_batch_size=2)) == pytest.approx(2 * base, rel=1e-9)
    assert dispatch(_mixtral(top_k=1), _stage(8)) == pytest.approx(base / 2, rel=1e-9)
    assert dispatch(_mixtral(plan_imbalance=1.2), _stage(8)) == pytest.approx(1.2 * base, rel=1e-9)
    assert dispatch(ModelDims.from_config({**load_group("model", "mixtral_8x7b"), "hidden": 8192}),
                    _stage(8)) == pytest.approx(2 * base, rel=1e-9)
    # 8 experts over 16 ranks of a stage: ep=8 fits a node of 8; on nodes of 4 half the bytes cross InfiniBand
    four = Cluster.from_config({**load_group("cluster", "dgx_h100"), "gpus_per_node": 4})
    assert layer_costs(_mixtral(), _stage(8), four).breakdown["moe_dispatch"] > base + lat
    # the host's wait for the split sizes, once per forward, beside a tiny all-to-all of counts; none without ep
    from mlplat.perf.cluster import SPLIT_SYNC_S

    assert layer_costs(_mixtral(), _stage(8), cl).breakdown["moe_split_sync"] == pytest.approx(SPLIT_SYNC_S + lat,
                                                                                               rel=1e-4)
    one = layer_costs(_mixtral(), _stage(1), cl).breakdown
    assert one["moe_split_sync"] == one["moe_dispatch"] == 0.0
    costs = {i: layer_costs(_mixtral(plan_imbalance=i), _stage(8), cl) for i in (1.0, 1.2)}
    assert costs[1.2].breakdown["moe_expert_gemm_forward"] > 1.15 * costs[1.0].breakdown["moe_expert_gemm_forward"]
    steps = {i: predict(_mixtral(plan_imbalance=i), _stage(8, vpp=8, schedule="interleaved"), cl,
                        max_compute_ops=20_000).seconds_per_iteration for i in (1.0, 1.2)}
    assert steps[1.2] > 1.1 * steps[1.0]


def test_measured_imbalance_from_expert_counts():
    from mlplat.perf.memory import expert_imbalance

    counts = [30, 10, 10, 10, 10, 10, 10, 10]  # one hot expert: 30 of 100 assignments
    assert expert_imbalance(counts, 8) == pytest.approx(2.4)  # 30 / (100/8)
    assert expert_imbalance(counts, 4) == pytest.approx(1.6)  # ranks of 2 experts: 40 / 25
    assert expert_imbalance(counts, 1) == 1.0


def test_planner_finds_expert_parallelism_for_mixtral_on_64_gpus():
    """The search over ep (divisors of E dividing t·c·d) and etp ∈ {1, t} puts ep > 1 first for Mixtral 8x7B on 64
    H100, as Megatron-Core's reference layout does (TP1 EP8 PP4)."""
    from mlplat.perf.links import Cluster
    from mlplat.plan import expert_layouts, search

    dims = _mixtral()
    assert expert_layouts(dims, 16, 2) == [(1, None), (1, 1), (2, None), (4, None), (8, None)]
    assert expert_layouts(ModelDims.from_config(load_group("model", "llama_tiny")), 16, 2) == [(1, None)]
    cl = Cluster.from_config(load_group("cluster", "dgx_h100"))
    best, _ = search(dims, cl, 64, 256, top=3, simulate_top=3, micro_batch_sizes=(1,), recompute=("none",),
                     precision="bf16-megatron", distributed=True, max_vpp=2, sequence_parallel=(False,))
    assert best and best[0].layout.ep > 1 and best[0].layout.expert_tp == 1, [c.layout for c in best]


def test_the_overlapped_schedule_is_weighed_and_timed_where_experts_are_dispatched():
    """1f1b_overlap: the planner weighs it only under expert parallelism, at p = 1 too; the cluster model takes the
    all-to-alls a pair hides off the step (each pass's, at most the other pass's compute), the same step as 1f1b
    when nothing is dispatched between ranks."""
    from dataclasses import replace

    from mlplat.perf.cluster import layer_costs, paired_hidden, predict
    from mlplat.perf.links import Cluster
    from mlplat.plan import candidate_layouts

    dims, cl = _mixtral(), Cluster.from_config(load_group("cluster", "dgx_h100"))
    paired = {(lay.ep, lay.pp) for lay in candidate_layouts(
        dims, cl, 64, 256, micro_batch_sizes=(1,), recompute=("none",), precision="bf16-megatron", distributed=True,
        max_vpp=1, sequence_parallel=(False,)) if lay.schedule == "1f1b_overlap"}
    assert paired and all(ep > 1 for ep, _ in paired) and {1, 4} <= {pp for _, pp in paired}
    lay = _stage(8, vpp=1, schedule="1f1b")
    over = replace(lay, schedule="1f1b_overlap")
    costs = layer_costs(dims, over, cl)
    assert costs.breakdown["moe_a2a_forward"] > 0 and costs.breakdown["moe_a2a_backward"] > 0
    assert all(h > 0 for h in paired_hidden(dims, over, costs, [1.0] * 4, [2.0] * 4))
    assert predict(dims, over, cl).seconds_per_iteration < predict(dims, lay, cl).seconds_per_iteration
    single = replace(lay, ep=1)
    assert predict(dims, replace(single, schedule="1f1b_overlap"), cl).pipeline_seconds == pytest.approx(
        predict(dims, single, cl).pipeline_seconds)


def _dry(experiment: str, *extra: str) -> dict:
    """`python -m mlplat.train +experiment=EXPERIMENT [EXTRA] dry_run=true`'s plan (closed-form counts)."""
    from hydra import compose, initialize_config_dir

    from mlplat.config import load_config
    from mlplat.perf.dry_run import plan
    from mlplat.plan import CONF_DIR

    overrides = [f"experiment={experiment}", *extra, "dry_run=true"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        raw = compose(config_name="config", overrides=overrides)
    return plan(load_config(raw), experiment=experiment, overrides=overrides, use_meta=False, max_compute_ops=20_000)


def test_dry_run_of_the_mixtral_experiment_fits_its_gpus():
    """`+experiment=mixtral_8x7b dry_run=true`: 46.7B parameters (12.9B active), ep8 over intra-node links, fits in
    80 GB, and its line names the experts' layout; at a stated imbalance of 1.2 it is slower and holds more."""
    from mlplat.perf.dry_run import format_plan

    pl, skewed = _dry("mixtral_8x7b"), _dry("mixtral_8x7b", "model.moe.plan_imbalance=1.2")
    dims = ModelDims.from_config(pl["model"])
    total = parameter_count(dims, padded=False)
    assert round(total / 1e9, 1) == 46.7 and round((total - 6 * 32 * dims.expert_gemm_weights) / 1e9, 1) == 12.9
    assert pl["layout"]["gpus"] == 64 and (pl["layout"]["ep"], pl["layout"]["etp"]) == (8, 1)
    assert pl["fits"] and skewed["fits"] and not pl["warnings"]
    x = pl["experts"]
    assert (x["edp"], x["local_experts"], x["link"]) == (2, 1, "intra-node")
    assert pl["memory_breakdown_bytes"]["dispatch_buffers"] == x["dispatch_buffer_bytes"] > 0
    assert "experts     etp=1 ep=8 edp=2: 1 experts per GPU" in format_plan(pl)
    assert "one grouped GEMM (torch._grouped_mm) in bfloat16;" in format_plan(pl)  # bf16-megatron
    assert "parallel.ep" not in pl["slurm_command"]  # the experiment sets it: the launch line carries +experiment
    assert skewed["predicted_model_tflops_per_gpu"] < pl["predicted_model_tflops_per_gpu"]
    assert skewed["memory_per_gpu_bytes"] > pl["memory_per_gpu_bytes"]


def test_dry_run_of_the_qwen3_235b_experiment_fits_its_gpus():
    """`+experiment=qwen3_235b_a22b dry_run=true`, Megatron Bridge's layout (256 H100, t2 p8 v4, ep32 over 4 nodes):
    its fullest GPU is pipeline rank 1, whose 4 chunks of 3 layers hold the interleaved warm-up's 37 chunks, 111
    layer-activations, and it fits under 95% of 80 GB. Each rank's GPU holds 4 of every one of its own layers' 128
    experts: rank 1's 12 layers' there, the 11 of rank 0's (its first chunk holds 2 layers), not anybody else's."""
    from mlplat.perf.memory import stored_layers

    pl = _dry("qwen3_235b_a22b")
    assert pl["fits"] and pl["memory_worst_pipeline_rank"] == 1 and not pl["warnings"]
    assert pl["memory_per_gpu_bytes"] < 0.95 * 80 * 2**30
    x = pl["experts"]
    assert (x["ep"], x["etp"], x["edp"], x["local_experts"], x["link"]) == (32, 1, 1, 4, "inter-node")
    dims = ModelDims.from_config(pl["model"])
    lay = Layout(tp=2, pp=8, vpp=4, dp=16, ep=32, schedule="interleaved", micro_batch_size=1,
                 global_batch_size=2048, first_stage_layers=2, last_stage_layers=2, recompute="none",
                 precision="bf16-megatron", distributed_optimizer=True, attention="flash", sequence_parallel=True)
    assert stored_layers(lay, dims.n_layers, 1) == (111, 0)
    per_layer = 4 * dims.expert_gemm_weights
    attention = dims.attention_gemm_weights // 2 + dims.moe.num_experts * dims.hidden + 2 * dims.hidden + 2 * 128
    want = {1: 12 * (attention + per_layer), 0: 11 * (attention + per_layer) + dims.padded_vocab(2) * dims.hidden // 2}
    for rank, held in want.items():
        assert pl["memory_per_stage_bytes"][rank] > 0
        got = memory_per_gpu(dims, lay, rank).parameters
        assert got == pytest.approx(held, rel=1e-3), rank
    assert x["expert_parameters_per_gpu"] == 12 * per_layer


@pytest.mark.parametrize("experiment,gpus,memory_gib", [("deepseek_v3_h100", 1024, 72.1),
                                                        ("deepseek_v3_h800", 2048, 32.3)])
def test_dry_run_of_the_deepseek_v3_experiments_fits_their_gpus(experiment, gpus, memory_gib):
    """Megatron-Bridge's 1,024-H100 recipe (t2 p8 v4: 1, 2 x30 layers and the MTP module with the loss on a chunk of
    their own) and DeepSeek's 2,048 H800 (p16: 5, 4 x14, 0), both ep64 over 8 nodes with 4 experts per GPU: 682.6B
    parameters (the report's 671B and the MTP module's 11.6B), fitting under 95% of 80 GB."""
    pl = _dry(experiment)
    L, x = pl["layout"], pl["experts"]
    assert L["gpus"] == gpus and pl["fits"] and not pl["warnings"]
    assert round(pl["memory_per_gpu_bytes"] / 2**30, 1) == memory_gib
    assert L["chunk_layers"][-1] == 0 and sum(L["chunk_layers"]) == 61
    assert L["chunk_layers"] == ([1] + [2] * 30 + [0] if L["vpp"] == 4 else [5] + [4] * 14 + [0])
    assert round(pl["parameters_total"] / 1e9, 1) == 682.6
    assert (x["ep"], x["edp"], x["local_experts"], x["link"]) == (64, 2, 4, "inter-node")


@pytest.mark.parametrize("recompute,backward", [("none", 2), ("full", 4)])
def test_dispatch_collectives_per_layer_and_micro_batch(recompute, backward):
    """Slower NVLink changes an MoE layer by its dispatcher's collectives alone: two in the forward (with the gates'
    and the split sizes' exchange), two in the backward (and the gates' gradient), two more (with the gates and the
    exchange) where full recomputation re-runs the forward. The gates' all-to-all carries routed·k fp32 values, h/2
    times fewer bytes than the tokens'."""
    from mlplat.perf.cluster import layer_costs
    from mlplat.perf.links import Cluster

    fast, slow = (Cluster.from_config({**load_group("cluster", "dgx_h100"), "nvlink_gbps": g}) for g in (3600, 1800))
    lay = _stage(8, recompute=recompute)
    a, b = layer_costs(_mixtral(), lay, fast), layer_costs(_mixtral(), lay, slow)
    dispatch = b.breakdown["moe_dispatch"] - a.breakdown["moe_dispatch"]
    sync = b.breakdown["moe_split_sync"] - a.breakdown["moe_split_sync"]
    gates = b.breakdown["moe_gates"] - a.breakdown["moe_gates"]
    assert dispatch > 0 and gates == pytest.approx(dispatch * 4 / (2 * 4096), rel=1e-9)
    assert b.moe_forward - a.moe_forward == pytest.approx(2 * dispatch + gates + sync, rel=1e-9)
    assert b.moe_backward - a.moe_backward == pytest.approx(
        backward * dispatch + backward / 2 * gates + (backward - 2) / 2 * sync, rel=1e-9)


@pytest.mark.parametrize("precision,path", [("bf16-megatron", "grouped"), ("bf16-mixed", "grouped-bf16"),
                                            ("16-megatron", "grouped-bf16"), ("32-true", "loop")])
def test_the_experts_gemms_are_charged_by_their_path(precision, path):
    """On H100s the experts' GEMMs run the bf16 grouped kernel, on bf16 casts where the weights are fp32 or fp16
    (their traffic charged: bf16-mixed's forward exceeds bf16-megatron's by exactly it), and one GEMM per local
    expert at the fp32 peak under 32-true, each with its launch, and the counts' host read per forward GEMM."""
    from mlplat.perf.cluster import LOOP_GEMM_LAUNCH_S, SPLIT_SYNC_S, experts_gemm_path, gemm_time, layer_costs
    from mlplat.perf.devices import peak_flops
    from mlplat.perf.links import Cluster
    from mlplat.perf.memory import expert_assignments

    cl = Cluster.from_config(load_group("cluster", "dgx_h100"))
    dims, lay, local = _mixtral(), _stage(2, precision=precision), 4
    assert experts_gemm_path(precision, cl) == path
    bd = layer_costs(dims, lay, cl).breakdown
    reference = layer_costs(dims, _stage(2), cl)  # bf16-megatron: the grouped kernel
    x, h, f = expert_assignments(dims, lay), dims.hidden, dims.expert_ffn
    if path == "loop":
        fp32 = peak_flops(cl.device, "fp32")
        one = gemm_time(cl, x / local, 2 * f, h, 1, fp32, 4) + gemm_time(cl, x / local, h, f, 1, fp32, 4)  # SwiGLU
        assert bd["moe_expert_gemm_forward"] == pytest.approx(local * one, rel=1e-12)
        assert bd["moe_expert_loop_forward"] == pytest.approx(2 * local * LOOP_GEMM_LAUNCH_S + 2 * SPLIT_SYNC_S)
        assert bd["moe_expert_loop_backward"] == pytest.approx(4 * local * LOOP_GEMM_LAUNCH_S)
        return
    assert bd["moe_expert_loop_forward"] == bd["moe_expert_loop_backward"] == 0.0
    assert bd["moe_expert_gemm_forward"] == pytest.approx(reference.breakdown["moe_expert_gemm_forward"], rel=1e-12)
    if precision == "bf16-mixed":
        casts = (4 + 2) * (x * (2 * h + 2 * f + f) + local * 3 * f * h)
        hbm = cl.device.hbm_gbytes_per_s * 1e9 * cl.hbm_efficiency
        assert bd["moe_extra_forward"] - reference.breakdown["moe_extra_forward"] == pytest.approx(casts / hbm)


def test_the_dry_run_names_the_experts_gemm_path():
    """32-true on H100s: fp32 has no grouped kernel, so the dry run states the loop (the experiment's own
    bf16-megatron line names the grouped kernel, test_dry_run_of_the_mixtral_experiment_fits_its_gpus)."""
    from mlplat.perf.dry_run import format_plan

    line = next(s for s in format_plan(_dry("mixtral_8x7b", "trainer.precision=32-true")).splitlines()
                if s.startswith("experts "))
    assert "one GEMM per expert in float32 (no grouped kernel), the counts read on the host per forward GEMM" in line


def test_fp8_experts_and_the_fp8_dispatch_are_charged_and_named():
    """kernels.fp8 on the experts on H100s: dX and dW by the emulation's fp32 GEMMs, one per local expert (CUDA's
    grouped kernel takes bf16 only), as 32-true's loop; the forward through torch's grouped FP8 kernel (sm90, bf16
    out: tests/parallel/test_fp8_grouped.py charges it); the dry run names both paths.
    model.moe.fp8_dispatch: the tokens' forward collective carries (h + 4)/(2h) of bf16's bytes, nothing else moves."""
    from mlplat.perf.cluster import dispatch_parts, experts_gemm_path, layer_costs
    from mlplat.perf.dry_run import format_plan
    from mlplat.perf.links import Cluster
    from mlplat.perf.memory import routed_tokens
    from mlplat.precision import grouped_fp8_gemm_path

    cl = Cluster.from_config(load_group("cluster", "dgx_h100"))
    dims = _mixtral()
    assert experts_gemm_path("bf16-megatron", cl, "tensorwise") == grouped_fp8_gemm_path("cuda", "tensorwise",
                                                                                         "input_grad") == "loop"
    assert grouped_fp8_gemm_path("cpu") == "grouped"
    fp8 = layer_costs(dims, _stage(2, fp8="tensorwise"), cl).breakdown
    fp32 = layer_costs(dims, _stage(2, precision="32-true"), cl).breakdown
    assert fp8["moe_expert_loop_backward"] == fp32["moe_expert_loop_backward"] > 0
    assert fp8["moe_expert_loop_forward"] == 0 < fp32["moe_expert_loop_forward"]
    line = next(s for s in format_plan(_dry("mixtral_8x7b", "kernels.fp8=tensorwise",
                                                         "trainer.precision=bf16-megatron")).splitlines()
                if s.startswith("experts "))
    assert "FP8 tensorwise (per-expert weight scales, per-token-row activations): the forward through " \
           "torch._scaled_grouped_mm into bf16, dX and dW emulated: one GEMM per expert in float32" in line
    lay = _stage(8)
    plain, sent = (dispatch_parts(d, lay, cl, routed_tokens(d, lay), 2) for d in (dims, _mixtral(fp8_dispatch=True)))
    assert sent["forward"]["tokens"] < plain["forward"]["tokens"] and sent["backward"] == plain["backward"]
    assert sent["forward"]["routing"] == plain["forward"]["routing"]


def test_node_dispatch_sends_a_token_once_per_node_on_deepseek_v3():
    """DeepSeek-V3's layout (256 experts in 8 groups, a token's 8 from its best 4; ep64 over 8 nodes of 8 H100s):
    node_alltoall sends a token across nodes to at most topk_groups = 4 nodes (each node one group), 3.5 rows of it
    over InfiniBand where alltoall sends 7 of its 8 assignments' rows; without the groups, the expected distinct
    nodes of 8 uniform picks. Its dispatch then takes less time than alltoall's, and the analytic model a layer's
    step faster, what the planner ranks by; inside one node too, a token sent once per rank of its experts (ep8: 4
    ranks hold a token's 4 groups, 8 picks hit about 3.6 of them), not once per expert."""
    from mlplat.perf.cluster import dispatch_parts, dispatch_traffic, layer_costs
    from mlplat.perf.links import Cluster
    from mlplat.perf.memory import routed_tokens
    from mlplat.specs import dispatchers

    cl = Cluster.from_config(load_group("cluster", "dgx_h100"))
    model = load_group("model", "deepseek_v3")
    plain, node = (ModelDims.from_config({**model, "moe": {**model["moe"], "dispatcher": d}})
                   for d in ("alltoall", "node_alltoall"))
    lay = Layout(tp=1, pp=1, dp=64, ep=64, micro_batch_size=1, global_batch_size=64, precision="bf16-megatron",
                 attention="flash")
    routed, h = routed_tokens(node, lay), 7168
    t = dispatch_traffic(node, lay, cl, routed, 2)
    assert (t.nodes, t.node_limited, t.nodes_per_token) == (8, True, 4.0)
    crossing = {d: next(c for c in dispatchers.get(d).forward if c.what == "tokens").payload(t)
                for d in ("alltoall", "node_alltoall")}
    assert crossing == {"alltoall": routed * 8 * h * 2, "node_alltoall": routed * 4 * h * 2}
    assert crossing["node_alltoall"] * 7 / 8 / (crossing["alltoall"] * 56 / 64) == 0.5  # the rows over InfiniBand
    ungrouped = dispatch_traffic(ModelDims.from_config({**model, "moe": {**model["moe"], "n_groups": 1}}), lay, cl,
                                 routed, 2)
    assert ungrouped.nodes_per_token == pytest.approx(8 * (1 - math.comb(224, 8) / math.comb(256, 8)))
    assert 4 < ungrouped.nodes_per_token < 8
    parts = {d: dispatch_parts(d_, lay, cl, routed, 2) for d, d_ in (("alltoall", plain), ("node", node))}
    assert parts["node"]["forward"]["tokens"] < parts["alltoall"]["forward"]["tokens"]
    assert layer_costs(node, lay, cl).moe_forward < layer_costs(plain, lay, cl).moe_forward
    one = Layout(tp=1, pp=1, dp=8, ep=8, micro_batch_size=1, global_batch_size=8, precision="bf16-megatron",
                 attention="flash")
    inside = {d: dispatch_parts(d_, one, cl, routed_tokens(d_, one), 2)["forward"]["tokens"]
              for d, d_ in (("alltoall", plain), ("node", node))}
    # one node: nothing crosses, and a token goes once to each rank of its experts, not once per expert
    ranks = dispatch_traffic(node, one, cl, routed_tokens(node, one), 2).ranks_per_token
    assert ranks == pytest.approx(4 * (1 - math.comb(96, 8) / math.comb(128, 8))) and ranks < 8
    assert inside["node"] < inside["alltoall"]


def test_the_planner_weighs_each_dispatcher_and_picks_the_node_one_across_nodes():
    """`python -m mlplat.plan dispatcher=alltoall,node_alltoall`: each layout weighed with both. DeepSeek-V3's
    routing on 4 layers over 16 H100s (2 nodes): the fastest layout folds ep16 over both nodes and sends a token
    across them once per node, the same layout with alltoall next; the table names the dispatcher, the launch command
    sets it."""
    from mlplat.perf.links import Cluster
    from mlplat.plan import format_table, launch_line, search

    model = load_group("model", "deepseek_v3")
    dims = ModelDims.from_config({**model, "n_layers": 4, "mtp": {"depth": 0}, "moe": {**model["moe"],
                                                                                     "dense_layers": 1}})
    cl = Cluster.from_config(load_group("cluster", "dgx_h100"))
    best, _ = search(dims, cl, 16, 16, top=2, simulate_top=2, max_compute_ops=2000, cp=(1,), micro_batch_sizes=(1,),
                     recompute=("full",), sequence_parallel=(False,), max_vpp=1, precision="bf16-megatron",
                     sharding=("optim",), dispatcher=("alltoall", "node_alltoall"))
    assert [c.dispatcher for c in best] == ["node_alltoall", "alltoall"]
    assert best[0].layout == best[1].layout and best[0].layout.ep == 16 and best[0].seconds < best[1].seconds
    assert "dispatcher" in format_table(best, cl).splitlines()[0]
    assert " model.moe.dispatcher=node_alltoall " in launch_line(best[0].layout, cl, "deepseek_v3", "dgx_h100",
                                                                 dispatcher="node_alltoall")
