"""Muon in the cost models (`mlplat.perf.muon`): the Newton–Schulz FLOPs counted from the matmuls
`mlplat.optim.muon.orthogonalise` runs on the real layers' weights, the dry run's optimizer term (Newton–Schulz at
the peak, the tp gathers, the busiest shard), QK-clip's pass and the momentum in the memory model."""
from __future__ import annotations

import pytest

from mlplat.perf.flops import ModelDims
from mlplat.perf.memory import Layout, memory_per_gpu
from tests.helpers import equivalence as eq
from tests.perf.test_dry_run import _dry_plan

MOE = dict(arch="llama", n_kv_heads=2, moe=dict(num_experts=4, top_k=2, ffn_hidden=24, dense_layers=1,
                                                shared_experts=1))


@pytest.mark.parametrize("layer", [0, 1])  # dense (grouped-query, SwiGLU), then experts and a shared expert
def test_ns_flops_are_the_matmuls_orthogonalise_runs(layer):
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from mlplat.optim.muon import is_hidden_matrix, orthogonalise
    from mlplat.optim.ns_cost import ns_flops
    from mlplat.perf.muon import hidden_parameters

    cfg = eq.make_cfg(model=MOE, optim=dict(name="muon"))
    module = eq.build_module(cfg, eq.make_grid(cfg))
    params = [p for p in module.chunks[0].layers[str(layer)].parameters() if is_hidden_matrix(p)]
    counted = []
    for p in params:
        with FlopCounterMode(display=False) as fc:
            orthogonalise(torch.randn(p.shape, dtype=torch.float64), p.matrices, 5, "moonlight")
        counted.append(fc.get_total_flops())
    modelled = [sum(ns_flops(a, b, 5) for a, b in hp.matrices)
                for hp in hidden_parameters(ModelDims.of(cfg.model), layer, tp=1)]
    assert sorted(counted) == sorted(modelled) and len(counted) == (4 if layer == 0 else 6)


def _optimizer(plan) -> dict:
    return plan["time_breakdown_seconds"]


def test_dry_run_adds_newton_schulz_at_the_peak_and_the_tp_gathers():
    """Llama 3 8B, every rank stepping all 32 layers (no distributed optimizer): the Muon plan's optimizer term is
    AdamW's plus its Newton–Schulz (the matrices' FLOPs at the bf16 peak times the GEMM efficiency, within the
    tiles' quantisation) and, at tp2, the gathers of the split matrices' updates."""
    from mlplat.optim.ns_cost import ns_flops
    from mlplat.perf.devices import get_device, peak_flops
    from mlplat.perf.dry_run import format_plan
    from mlplat.perf.muon import hidden_parameters

    base = ["+experiment=llama3_8b", "optim.distributed=false", "parallel.tp=1"]
    adamw, _ = _dry_plan(base)
    muon, _ = _dry_plan(base + ["optim.name=muon"])
    a, m = _optimizer(adamw), _optimizer(muon)
    assert m["optimizer"] == pytest.approx(a["optimizer"] + m["optimizer_newton_schulz"], rel=1e-12)
    assert m["optimizer_muon_gathers"] == 0.0 and "optimizer_newton_schulz" not in a
    dims = ModelDims.from_config(muon["model"])
    flops = sum(ns_flops(r, c, 5) for layer in range(dims.n_layers) for hp in hidden_parameters(dims, layer, tp=1)
                for r, c in hp.matrices)
    assert flops == pytest.approx(32 * 5 * (6 * 4096 ** 3 * 2 + 2 * (4 * 1024 ** 2 * 4096 + 2 * 1024 ** 3)
                                            + 3 * (4 * 4096 ** 2 * 14336 + 2 * 4096 ** 3)))
    device = get_device(muon["cluster"]["device"])
    peak = peak_flops(device, "bf16") * device.gemm_efficiency
    assert flops / peak <= m["optimizer_newton_schulz"] <= 1.05 * flops / peak  # the tiles' waves: k, v (1024 rows)
    assert "Newton–Schulz" in format_plan(muon) and "Newton–Schulz" not in format_plan(adamw)
    tp2, _ = _dry_plan(base[:2] + ["parallel.tp=2", "parallel.dp=4", "optim.name=muon"])
    t = _optimizer(tp2)
    assert t["optimizer_muon_gathers"] > 0 and t["optimizer_newton_schulz"] == pytest.approx(
        m["optimizer_newton_schulz"], rel=1e-9)  # every tp rank orthogonalises the whole matrices


def test_distributed_optimizer_counts_the_busiest_shard():
    import mlplat.optim.buffers as buffers
    import mlplat.perf.muon as model
    from mlplat.perf.muon import owned_work

    assert model.deal is buffers.deal  # one rule: the cost model deals as the gradient buffers do
    # dealt by cost, costliest first to the least loaded: [9], [5, 3], [4, 3]: the busiest by work is the third
    assert owned_work([9, 5, 4, 3, 3], [(1.0, 0.0), (2.0, 0.0), (2.0, 1.0), (1.0, 0.0), (1.0, 0.0)], 3) == (3.0, 1.0)
    one, _ = _dry_plan(["+experiment=llama3_8b", "optim.name=muon", "optim.distributed=false"])
    eight, _ = _dry_plan(["+experiment=llama3_8b", "optim.name=muon", "optim.distributed=true"])
    ns1, ns8 = _optimizer(one)["optimizer_newton_schulz"], _optimizer(eight)["optimizer_newton_schulz"]
    assert ns8 == pytest.approx(ns1 / 8, rel=1e-9)  # 32 of each of the 4 parameters dealt to 8 shards: even


def test_qk_clip_adds_a_logit_pass_to_the_layer_forward():
    base = ["+experiment=llama3_8b", "optim.name=muon"]
    plain, _ = _dry_plan(base)
    clipped, _ = _dry_plan(base + ["optim.muon.qk_clip=100"])
    p, c = _optimizer(plain), _optimizer(clipped)
    assert c["layer_forward"] == pytest.approx(p["layer_forward"] + c["qk_clip_logits_per_layer_forward"])
    assert c["qk_clip_logits_per_layer_forward"] > 0 and "qk_clip_logits_per_layer_forward" not in p


def test_muon_state_is_adamw_state_and_a_momentum():
    dims = ModelDims(n_layers=4, hidden=64, n_heads=4, seq_len=32, vocab_size=128)
    for precision, extra in (("bf16-mixed", 4), ("bf16-megatron", 4), ("64-true", 8)):
        lay = dict(pp=1, micro_batch_size=2, global_batch_size=2, precision=precision, post_validate=True)
        adamw = memory_per_gpu(dims, Layout(**lay), 0).breakdown
        muon = memory_per_gpu(dims, Layout(**lay, optimizer="muon"), 0)
        assert muon.breakdown["optimizer_state"] == adamw["optimizer_state"] + extra * muon.parameters
        assert muon.breakdown["post_validation_copy"] == adamw["post_validation_copy"] + extra * muon.parameters


def test_layout_of_a_config_carries_the_optimizer():
    from mlplat.perf.dry_run import LAYOUT_KEYS

    cfg = eq.make_cfg(optim=dict(name="muon", muon=dict(ns_steps=3, qk_clip=50.0)))
    lay = Layout.of(cfg)
    assert (lay.optimizer, lay.muon_ns_steps, lay.qk_clip) == ("muon", 3, 50.0)
    assert {LAYOUT_KEYS[k] for k in ("optimizer", "muon_ns_steps", "qk_clip")} == {
        "optim.name", "optim.muon.ns_steps", "optim.muon.qk_clip"}


def test_cpu_model_adds_newton_schulz_and_the_gathers():
    """The model of CPU processes (the default config at t2·d2): Muon's optimizer term is AdamW's plus its
    Newton–Schulz at the measured GEMM rate and the gloo all-gathers of the split matrices."""
    adamw, _ = _dry_plan(["parallel.tp=2", "parallel.dp=2"])
    muon, _ = _dry_plan(["parallel.tp=2", "parallel.dp=2", "optim.name=muon"])
    a, m = _optimizer(adamw), _optimizer(muon)
    assert muon["cluster"]["device"] == "cpu" and m["optimizer_newton_schulz"] > 0 and m["optimizer_muon_gathers"] > 0
    assert m["optimizer"] == pytest.approx(a["optimizer"] + m["optimizer_newton_schulz"] + m["optimizer_muon_gathers"],
                                           rel=1e-12)
