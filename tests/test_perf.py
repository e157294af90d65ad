"""mlplat.perf: FLOP/parameter/memory formulas by hand, meta-device counts, the planner, the dry run."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from mlplat.config import from_dict, load_config
from mlplat.parallel.pipeline.layout import PipelineLayout
from mlplat.perf.cluster import Cluster, predict
from mlplat.perf.devices import device_from_cuda_name, get_device, peak_flops
from mlplat.perf.flops import (ModelDims, hardware_flops_per_iteration, model_flops_per_iteration, mfu,
                               padded_vocab, parameter_count, stage_parameters)
from mlplat.perf.memory import Layout, in_flight, layout_errors, memory_per_gpu

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TABLE1 = ["gpt1p7b", "gpt3p6b", "gpt7p5b", "gpt18b", "gpt39b", "gpt76b", "gpt145b", "gpt310b", "gpt530b", "gpt1t"]
PAPER_PARAMS_B = [1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1, 529.6, 1008.0]
PAPER_TFLOPS = [137, 138, 142, 135, 138, 140, 148, 155, 163, 163]
HAS_MODEL = importlib.util.find_spec("mlplat.model.gpt") is not None
needs_model = pytest.mark.skipif(not HAS_MODEL, reason="mlplat/model/gpt.py not written yet")
_kind = lambda v: "interleaved" if v > 1 else "1f1b"  # noqa: E731
TINY = ModelDims(n_layers=1, hidden=6, n_heads=1, seq_len=2, vocab_size=12, vocab_pad_multiple=1)


# ---------------------------------------------------------------------------------------------- FLOPs

def _gemm_flops(dims: ModelDims, B: int) -> tuple[float, float]:
    """(per-layer forward, logits forward) FLOPs counted GEMM by GEMM: QKV, scores, attention·V, out, fc1, fc2."""
    s, h = dims.seq_len, dims.hidden
    layer = 2 * B * s * h * 3 * h + 2 * B * s * s * h + 2 * B * s * s * h + 2 * B * s * h * h + 2 * 2 * B * s * h * 4 * h
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
    assert padded_vocab(10, 2) == 256 and parameter_count(d, tp=2) == 244 + 1024 + 32 + 8
    assert padded_vocab(51200, 8) == 51200 and padded_vocab(50257, 8) == 51200


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
    copy1 = padded_vocab(1000, 1) * 64 if tied else 0
    assert sum(stage_parameters(dims, 1, PipelineLayout(p, v, _kind(v)))) - copy1 == parameter_count(dims, 1)
    # Any t: every layer once (as one shard), the embeddings, the final LN, the tied copy's shard.
    copy = padded_vocab(1000, t) // t * 64 if tied else 0
    assert sum(stage_parameters(dims, t, PipelineLayout(p, v, _kind(v)))) == (12 * layer_parameters(64, t) + embedding_parameters(dims, t)
                                                   + 2 * 64 + copy)
    assert layer_parameters(64, t) == (12 * 64 * 64 + 7 * 64) // t + 6 * 64


# ---------------------------------------------------------------------------------------------- memory

def test_memory_by_hand():
    dims = ModelDims(n_layers=4, hidden=64, n_heads=4, seq_len=32, vocab_size=128)
    lay = Layout(tp=1, pp=2, vpp=1, dp=1, micro_batch_size=2, global_batch_size=8, schedule="1f1b",
                 recompute="full", precision="megatron-fp16")
    P0 = 2 * (12 * 64 * 64 + 13 * 64) + 128 * 64 + 32 * 64
    r0 = memory_per_gpu(dims, lay, 0, overhead_bytes=0)
    sbh = 32 * 2 * 64
    assert r0.parameters == P0
    assert r0.breakdown["weights"] == 2 * P0 and r0.breakdown["gradients"] == 2 * P0
    assert r0.breakdown["optimizer_state"] == 12 * P0
    assert r0.breakdown["activations"] == 2 * 2 * 2 * sbh  # min(p - 0, m)=2 micro-batches x 2 layers x 2sbh
    assert r0.breakdown["working_set"] == pytest.approx(sbh * (34 + 5 * 4 * 32 / 64))  # Korthikanti, t = 1
    assert r0.breakdown["logits"] == 0
    r1 = memory_per_gpu(dims, lay, 1, overhead_bytes=0)
    assert r1.breakdown["activations"] == 1 * 2 * 2 * sbh
    assert r1.breakdown["logits"] == 10 * 32 * 2 * 128
    # No recomputation with t = 2: s·b·h·(10 + 24/t + 5·a·s/(h·t)) per layer.
    lay2 = Layout(tp=2, pp=1, dp=1, micro_batch_size=2, global_batch_size=2, recompute="none", precision="megatron-fp16",
                  attention="unfused")
    r = memory_per_gpu(dims, lay2, 0, overhead_bytes=0)
    assert r.breakdown["activations"] == pytest.approx(4 * sbh * (10 + 12 + 5 * 4 * 32 / (64 * 2)))
    # Autocast (Lightning bf16-mixed): fp32 weights and grads, 8 bytes of Adam state, fp32 residual kept.
    r = memory_per_gpu(dims, Layout(pp=1, micro_batch_size=2, global_batch_size=2, recompute="full"), 0)
    assert r.breakdown["weights"] == 4 * r.parameters and r.breakdown["optimizer_state"] == 8 * r.parameters
    assert r.breakdown["activations"] == 4 * 4 * sbh


def test_sequence_parallel_memory_and_costs():
    """Korthikanti et al. 2022, Table 2: sequence parallelism divides the LayerNorm/dropout part (10·sbh) by t
    too; stage messages are the 1/t shard with no gather; the layers' tp communication is unchanged."""
    from mlplat.perf.cluster import allgather_time, layer_costs, p2p_time
    from mlplat.perf.memory import layer_activation_bytes

    dims = ModelDims(n_layers=8, hidden=1024, n_heads=16, seq_len=2048, vocab_size=51200)
    s, b, h, a, t = 2048, 2, 1024, 16, 4
    sbh = s * b * h
    common = dict(tp=t, pp=2, micro_batch_size=b, global_batch_size=8, precision="megatron-fp16",
                  attention="unfused")
    for sp, per_sbh in ((False, 10 + 24 / t), (True, 34 / t)):
        lay = Layout(sequence_parallel=sp, **common)
        assert layer_activation_bytes(dims, lay, "selective") == pytest.approx(sbh * per_sbh)
        assert layer_activation_bytes(dims, lay, "none") == pytest.approx(sbh * (per_sbh + 5 * a * s / (h * t)))
        assert layer_activation_bytes(dims, lay, "full") == pytest.approx(2 * sbh / (t if sp else 1))
    cl = _a100()
    plain, sp = (layer_costs(dims, Layout(sequence_parallel=x, **common), cl) for x in (False, True))
    assert sp.transfer_intra == pytest.approx(p2p_time(2 * sbh / t, cl, False))
    assert plain.transfer_intra == pytest.approx(p2p_time(2 * sbh / t, cl, False) + allgather_time(2 * sbh, t, cl))
    assert (sp.tp_forward, sp.tp_backward) == (plain.tp_forward, plain.tp_backward)
    assert sp.layer_forward < plain.layer_forward  # LayerNorm/dropout on s/t tokens
    assert any("parallel.sequence_parallel=true needs parallel.tp > 1" in e
               for e in layout_errors(dims, Layout(tp=1, sequence_parallel=True)))


@pytest.mark.skipif(importlib.util.find_spec("mlplat.perf.simulator") is None, reason="no simulator yet")
@pytest.mark.parametrize("kind,p,v,m", [("1f1b", 4, 1, 8), ("1f1b", 4, 1, 2), ("gpipe", 3, 1, 5),
                                        ("interleaved", 4, 2, 8), ("interleaved", 4, 3, 4), ("interleaved", 2, 4, 6)])
def test_in_flight_matches_the_simulated_schedule(kind, p, v, m):
    from mlplat.parallel.pipeline.schedules import build_schedule
    from mlplat.perf.simulator import simulate

    res = simulate(build_schedule(kind, p, v, m), v=v)
    assert [in_flight(kind, p, v, m, r) for r in range(p)] == pytest.approx(res.peak_in_flight_micro_batches)


# ---------------------------------------------------------------------------------------------- cost model

def _a100() -> Cluster:
    from mlplat.plan import load_group

    return Cluster.from_config(load_group("cluster", "dgx_a100"))


def test_devices():
    assert peak_flops("a100", "bf16-mixed") == 312e12 and peak_flops("a100", "32-true") == 19.5e12
    assert peak_flops("h100", "bf16") == peak_flops("h200", "bf16") == 989e12
    assert device_from_cuda_name("NVIDIA A100-SXM4-80GB").name == "a100-80gb"
    assert device_from_cuda_name("NVIDIA A100-SXM4-40GB").name == "a100-40gb"
    assert device_from_cuda_name("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert device_from_cuda_name("NVIDIA H200").name == "h200"
    assert get_device("cpu").nominal
    with pytest.raises(ValueError, match="not a known device"):
        get_device("tpu")


def test_extrapolated_simulation_equals_the_exact_one():
    dims = ModelDims(48, 4096, 32, 2048, 51200)
    cl = _a100()
    for lay in (Layout(tp=8, pp=8, dp=1, global_batch_size=96, schedule="1f1b"),
                Layout(tp=8, pp=8, vpp=3, dp=1, global_batch_size=96, schedule="interleaved")):
        exact = predict(dims, lay, cl)
        extra = predict(dims, lay, cl, max_compute_ops=1)
        assert exact.method == "simulated" and extra.method.startswith("extrapolated")
        assert extra.seconds_per_iteration == pytest.approx(exact.seconds_per_iteration, rel=1e-9)


def test_interleaving_shrinks_the_bubble_by_v():
    dims = ModelDims(48, 4096, 32, 2048, 51200)
    cl = _a100()
    base = predict(dims, Layout(tp=8, pp=8, dp=1, global_batch_size=16, schedule="1f1b"), cl)
    inter = predict(dims, Layout(tp=8, pp=8, vpp=2, dp=1, global_batch_size=16, schedule="interleaved"), cl)
    assert base.bubble_fraction == pytest.approx(7 / 16, rel=0.15)
    assert inter.bubble_fraction == pytest.approx(7 / 32, rel=0.25)
    assert inter.seconds_per_iteration < base.seconds_per_iteration


# ---------------------------------------------------------------------------------------------- planner

def test_layout_rules_and_memory_refusal():
    from mlplat.plan import evaluate

    dims = ModelDims(128, 25600, 160, 2048, 51200)
    assert ("model.n_layers=128 is not divisible by parallel.pp·parallel.vpp=48 "
            "(every model chunk must hold the same number of layers)") in layout_errors(
        dims, Layout(tp=8, pp=48, dp=8, global_batch_size=3072))
    assert any("multiple of parallel.pp=64" in e for e in layout_errors(
        dims, Layout(tp=8, pp=64, vpp=2, dp=6, global_batch_size=6 * 100, schedule="interleaved")))
    assert any("exceeds cluster.gpus_per_node=8" in e for e in layout_errors(
        dims, Layout(tp=16, pp=1, dp=192, global_batch_size=3072), gpus_per_node=8))
    # A trillion parameters on one GPU per replica: 16 TB of model state.
    c = evaluate(dims, Layout(tp=1, pp=1, dp=3072, global_batch_size=3072, recompute="full"), _a100())
    assert not c.fits and "GiB per GPU" in c.reason
    assert evaluate(dims, Layout(tp=8, pp=64, dp=6, global_batch_size=3072, recompute="full"), _a100()).fits


def test_planner_best_layout_for_tiny_on_local_cpu_is_valid():
    from mlplat.plan import load_group, search

    dims = ModelDims.from_config(load_group("model", "tiny"))
    cl = Cluster.from_config(load_group("cluster", "local_cpu"))
    best, refused = search(dims, cl, 8, 16, top=3, precision="32-true")
    assert best and sum(refused.values()) > 0
    b = best[0].layout
    assert b.gpus == 8 and best[0].fits and not layout_errors(dims, b, cl.gpus_per_node)
    assert [c.seconds for c in best] == sorted(c.seconds for c in best)
    if importlib.util.find_spec("mlplat.config"):
        from mlplat.config import from_dict, validate

        validate(from_dict({"model": load_group("model", "tiny"), "parallel": {
            "tp": b.tp, "pp": b.pp, "vpp": b.vpp, "dp": b.dp, "schedule": b.schedule,
            "micro_batch_size": b.micro_batch_size, "global_batch_size": b.global_batch_size,
            "sequence_parallel": b.sequence_parallel},
            "kernels": {"recompute": b.recompute}, "trainer": {"devices": 8}}))


def test_planner_cli(capsys):
    from mlplat.plan import main

    assert main(["model=tiny", "cluster=local_cpu", "gpus=8", "global_batch_size=16", "top=3"]) == 0
    out = capsys.readouterr().out
    assert "refused" in out and "best: parallel.tp=" in out


# ---------------------------------------------------------------------------------------------- meta + dry run

@needs_model
@pytest.mark.parametrize("t,p,v,schedule", [(1, 1, 1, "1f1b"), (2, 2, 1, "1f1b"), (2, 2, 3, "interleaved"),
                                            (2, 3, 2, "zbv")])
def test_meta_counts_equal_the_closed_form(t, p, v, schedule):
    """Also under zbv, whose V puts the first and the last chunk (one shared word embedding) on rank 0."""
    from mlplat.perf.dry_run import meta_parameter_counts

    model = dict(n_layers=12, hidden=64, n_heads=4, seq_len=32, vocab_size=1000, dropout=0.0)
    lay = Layout(tp=t, pp=p, vpp=v, schedule=schedule)
    total, per_stage = meta_parameter_counts(from_dict({"model": model}).model, lay)
    dims = ModelDims.from_config(model)
    assert total == parameter_count(dims, t)
    assert per_stage == stage_parameters(dims, t, lay.pipeline)


REQUIRED = ("parameters_total", "parameters_per_gpu_max", "memory_per_gpu_bytes", "flops_per_iteration",
            "predicted_seconds_per_iteration", "predicted_tflops_per_gpu", "bubble_fraction", "layout")


@needs_model
def test_dry_run_of_every_experiment():
    """Composed as `+experiment=NAME dry_run=true` composes it; meta-device counts equal the closed form."""
    import json

    from hydra import compose, initialize_config_dir

    from mlplat.perf.dry_run import format_plan, plan

    t0 = time.time()
    plans = {}
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        for name in TABLE1:
            raw = compose(config_name="config", overrides=[f"experiment={name}", "dry_run=true"])
            plans[name] = plan(load_config(raw), experiment=name)
    elapsed = time.time() - t0
    assert elapsed < 60, f"dry runs took {elapsed:.0f} s"
    for name, billions in zip(TABLE1, PAPER_PARAMS_B):
        pl = plans[name]
        assert all(k in pl for k in REQUIRED), name
        assert set(pl["layout"]) >= {"tp", "pp", "vpp", "dp", "micro", "global", "gpus", "nodes"}
        assert pl["parameters_source"] == "meta-device model"
        assert pl["parameters_total"] == pl["parameters_closed_form"]
        assert round(pl["parameters_total"] / 1e9, 1) == billions
        L = pl["layout"]
        dims = ModelDims.from_config(pl["model"])
        pipeline = PipelineLayout(L["pp"], L["vpp"], L["schedule"])
        assert pl["parameters_per_stage"] == stage_parameters(dims, L["tp"], pipeline)
        assert L["tp"] * L["pp"] * L["dp"] == L["gpus"] and pl["fits"], name
        assert not pl["warnings"], pl["warnings"]
        json.dumps(pl)
    one_t = plans["gpt1t"]
    assert one_t["layout"]["nodes"] == 384
    assert "hydra/launcher=submitit_slurm" in one_t["slurm_command"]
    assert "+experiment=gpt1t" in one_t["slurm_command"] and "hydra.launcher.nodes=384" in one_t["slurm_command"]
    assert "DOES NOT FIT" not in format_plan(one_t)


def test_paper_setup_predictions_are_near_table1():
    """A guard on the cost model (not a benchmark): the paper's setup predicted within 25% of Table 1."""
    from omegaconf import OmegaConf

    from mlplat.perf.dry_run import plan

    for name, paper in zip(TABLE1, PAPER_TFLOPS):
        exp = OmegaConf.load(CONF / "experiment" / f"{name}.yaml")
        cfg = {"model": OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{name}.yaml")),
               "cluster": OmegaConf.to_container(OmegaConf.load(CONF / "cluster" / "dgx_a100.yaml")),
               "parallel": OmegaConf.to_container(exp.parallel),
               "kernels": {"recompute": "full", "attention": "unfused", "fused": True},
               "trainer": {"precision": "megatron-fp16", "devices": 8, "num_nodes": exp.trainer.num_nodes}}
        pl = plan(from_dict(cfg), use_meta=False, max_compute_ops=20_000)
        assert 0.75 < pl["predicted_tflops_per_gpu"] / paper < 1.25, (name, pl["predicted_tflops_per_gpu"])
