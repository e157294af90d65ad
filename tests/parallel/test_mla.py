"""Multi-head latent attention (model.attention=mla, mlplat.model.mla) under every layout equals one process in
float64: per-step losses, gradient norms and the parameters after three AdamW steps. Tensor parallelism with sequence
parallelism and data parallelism with the distributed optimizer; tp·cp with sequence parallelism (the latent ring's
math blocks) and without query compression (DeepSeek-V2-Lite's `q`); cp·dp with the latent ring's sdpa blocks and
selective recomputation; tp·pp zbv with sequence parallelism and selective recomputation (the up-projections
recomputed with the core; the replicated down-projections' weight gradients deferred to W); pp·dp interleaved with
the fused kernels; pp3 1F1B at m = 1 and m = 8; with DeepSeek-V3-style experts, ep2 folded over tp2 with sequence
parallelism. Every model runs YaRN with mscale_all_dim (the softmax factor on q).
A control: with sequence parallelism, leaving out the tp sum of the down-projections' and latent norms' gradients
(each rank's is its own shard's) breaks the equality.

Two spawned worlds (4 ranks, 3 ranks) run the layouts in turn; the references run in the pytest process."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import equivalence as eq
from tests.helpers.dist import run_distributed
from tests.helpers.kernels import eager_fused

TOL = 1e-9
STEPS = 3
MICRO = 2
MLA = dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8)  # v ≠ nope + rope
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4, beta_fast=8, beta_slow=1, mscale=0.9,
            mscale_all_dim=0.7)
MODEL = dict(arch="llama", attention="mla", mla=MLA, rope_scaling=YARN)
V2_LITE = dict(MODEL, mla=dict(MLA, q_lora_rank=None))
MOE = dict(num_experts=4, top_k=2, ffn_hidden=16, router="sigmoid", n_groups=2, topk_groups=1, shared_experts=1,
           dense_layers=1, aux_loss_coeff=0.05, seq_aux_loss_coeff=0.02, bias_update_rate=0.01)

# name -> (layout, model, global batch)
JOBS = {
    4: {
        "tp2-sp-dp2-distributed": (dict(tp=2, dp=2, sequence_parallel=True, distributed=True), MODEL, 8),
        "tp2-sp-cp2-math-v2-lite": (dict(tp=2, cp=2, sequence_parallel=True), V2_LITE, 8),
        "cp2-dp2-sdpa-selective": (dict(cp=2, dp=2, attention="sdpa", recompute="selective"), MODEL, 8),
        "tp2-sp-pp2v2-zbv-selective": (dict(tp=2, pp=2, vpp=2, schedule="zbv", sequence_parallel=True,
                                            recompute="selective"), MODEL, 8),
        "pp2v2-dp2-interleaved-fused": (dict(pp=2, vpp=2, dp=2, schedule="interleaved", fused=True), MODEL, 8),
        # with DeepSeek-V3's experts: sigmoid routing in groups with the expert bias, a shared expert, ep folded over tp
        "ep2-tp2-sp-dp2-moe": (dict(tp=2, dp=2, ep=2, sequence_parallel=True), dict(MODEL, moe=MOE), 8),
    },
    3: {
        "pp3-1f1b-m1": (dict(pp=3), dict(MODEL, n_layers=6), MICRO),
        "pp3-1f1b-m8": (dict(pp=3), dict(MODEL, n_layers=6), 8 * MICRO),
    },
}
CONTROL = (dict(tp=2, dp=2, sequence_parallel=True), MODEL, 8)  # one step's gradients, with and without the tp sum


def _cfg(layout: dict, model: dict, global_batch: int):
    return eq.make_cfg(micro=MICRO, global_batch=global_batch, steps=STEPS, lr=1e-2, grad_clip=1.0, model=model,
                       **layout)


def _worker(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    with eager_fused():
        for name, job in JOBS[world_size].items():
            cfg = _cfg(*job)
            grid = eq.make_grid(cfg)
            out[name] = eq.train_run(cfg, grid, STEPS)
            eq.barrier()
        if world_size == 4:
            cfg = _cfg(*CONTROL)
            grid = eq.make_grid(cfg)
            out["grads"] = eq.grads_run(cfg, grid)
            out["control"] = eq.grads_run_without_tp_sum(cfg, grid)
    return out


_WORLDS: dict[int, list] = {}


def _world(n: int) -> list[dict]:
    if n not in _WORLDS:
        _WORLDS[n] = run_distributed(_worker, n, timeout=400)
    return _WORLDS[n]


@pytest.mark.parametrize("name", [n for jobs in JOBS.values() for n in jobs])
def test_mla_layout_equals_one_process(name):
    n = next(w for w, jobs in JOBS.items() if name in jobs)
    cfg = _cfg(*JOBS[n][name])
    ref = eq.reference(cfg, "train")
    results = [r[name] for r in _world(n)]
    for res in results:
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(res[key], dtype=torch.float64),
                                       torch.tensor(ref[key], dtype=torch.float64), rtol=0, atol=TOL,
                                       msg=lambda m, key=key: f"{name} {key}: {m}")
    merged = eq.merge(results, "params")
    assert set(merged) == set(ref["params"])
    assert any(".attn.kv_down." in n for n in merged) and any(".attn.kv_up." in n for n in merged)
    for full, copies in merged.items():
        for t in copies:
            torch.testing.assert_close(t, ref["params"][full], rtol=0, atol=TOL, msg=lambda m, f=full: f"{f}: {m}")


def test_sequence_parallel_down_projections_need_their_tp_sum():
    """Without the tp sum, each rank's down-projection and latent-norm gradients are its own shard's only: they
    differ from the one-process gradients (and the summed ones equal them)."""
    ref = eq.reference(_cfg(*CONTROL), "grads")["grads"]
    world = _world(4)
    replicated = [n for n in ref if any(f".attn.{m}." in n for m in ("q_down", "kv_down", "q_norm", "kv_norm"))]
    assert len(replicated) == 4 * 8  # four per layer
    for name in replicated:
        for res in world:
            torch.testing.assert_close(res["grads"]["grads"][name], ref[name], rtol=0, atol=1e-10)
    for name in replicated:  # off by a share of their size (the gradients are small: 1e-6 for q_norm)
        assert all((res["control"]["grads"][name] - ref[name]).abs().max() > 0.1 * ref[name].abs().max()
                   for res in world), name
