"""Multi-token prediction (model.mtp) under tensor (with sequence parallelism), pipeline (1F1B with m = 1 and m > p,
interleaved, zbv's V), data parallelism (the distributed optimizer) and context parallelism equals one process:
three AdamW steps' losses, each depth's loss, gradient norms and the final parameters (every copy: tp ranks,
replicas, the word embedding's copy on the last stage) within 1e-9 of the same RunConfig at tp=pp=dp=1, float64,
with tied and untied embeddings and D = 1 and 2, and DeepSeek-V3's block in small (latent attention, grouped sigmoid
experts with scaling, the correction bias, a shared expert; its MTP layer of the same kind). One spawned group per
world size (2 and 3) runs its layouts in turn; the group of 2 also saves a checkpoint of the modules at pp2 (untied:
the word embedding's copy on the last stage), which one process loads."""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers import equivalence as eq
from tests.helpers.dist import run_distributed

TOL = 1e-9
STEPS = 3
MICRO = 2
D1 = dict(depth=1, loss_coeff=0.3)
D2 = dict(depth=2, loss_coeff=0.5)
TIED = dict(mtp=D2)  # GPT: tied embeddings, learned positions, LayerNorm
UNTIED = dict(arch="llama", mtp=D1)  # an output layer of its own, rotary positions, RMSNorm, SwiGLU
UNTIED_D2 = dict(arch="llama", mtp=D2)
SIX = dict(n_layers=6)
MOE = dict(num_experts=4, top_k=2, dense_layers=1, aux_loss_coeff=0.01)  # two layers per stage at p = 3
TRAIN = dict(grad_clip=0.43, lr=1e-2, steps=STEPS)
# DeepSeek-V3's block in small: latent attention, sigmoid experts in groups with scaling, the correction bias moved by
# aux-loss-free balancing, a shared expert, the sequence-wise balancing loss, one MTP module (its layer MLA + experts)
DSV3 = dict(arch="llama", attention="mla",
            mla=dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
            moe=dict(num_experts=4, top_k=2, dense_layers=1, router="sigmoid", norm_topk_prob=True,
                     routed_scaling_factor=2.5, n_groups=2, topk_groups=1, expert_bias=True, bias_update_rate=0.01,
                     shared_experts=1, seq_aux_loss_coeff=0.001),
            mtp=D1)

JOBS = {
    2: {
        "tp2-sp-d2-tied": dict(tp=2, sequence_parallel=True, global_batch=8, model=TIED),
        # post-validated: a step taken before its checks, redone when clipped (its depths' losses from the pass
        # that stands)
        "tp2-d1-untied-post-validate": dict(tp=2, global_batch=4, post_validate=True, model=UNTIED),
        "pp2-interleaved-m4-d2-tied": dict(pp=2, vpp=2, schedule="interleaved", global_batch=8, model=TIED),
        "pp2-zbv-m4-d2-untied": dict(pp=2, vpp=2, schedule="zbv", global_batch=8, model=UNTIED_D2),
        "dp2-distributed-d1-gpt-untied": dict(dp=2, distributed=True, global_batch=8,
                                              model=dict(tie_embeddings=False, mtp=D1)),
        # the deferred weight GEMMs (the modules' layers and logits too) and the layers' recomputation
        "pp2-zb_h1-m4-d2-untied-full-recompute": dict(pp=2, schedule="zb_h1", global_batch=8, recompute="full",
                                                      model=UNTIED_D2),
        # module 1's layer holds experts as the model's layers do (its balancing loss in the gradient too)
        "pp2-1f1b-m4-d1-moe": dict(pp=2, global_batch=8, model=dict(UNTIED, moe=MOE)),
        "tp2-sp-dsv3": dict(tp=2, sequence_parallel=True, global_batch=8, model=DSV3),
        "pp2-zbv-m4-dsv3": dict(pp=2, vpp=2, schedule="zbv", global_batch=8, model=DSV3),
        "dp2-distributed-dsv3": dict(dp=2, distributed=True, global_batch=8, model=DSV3),
        # context parallelism: the k-ahead ids and targets from the window's labels at each rank's places, the
        # modules' layers through the ring (the latent ring for DeepSeek-V3's)
        "cp2-d2-untied": dict(cp=2, global_batch=8, model=UNTIED_D2),
        "cp2-dsv3": dict(cp=2, global_batch=8, model=DSV3),
        # the loss's chunk without layers (parallel.last_stage_layers=0): the modules on a stage of their own, here
        # the V's last chunk, on rank 0 beside the embedding
        "pp2-zbv-m4-dsv3-own-stage": dict(pp=2, vpp=2, schedule="zbv", global_batch=8, first_stage_layers=2,
                                          last_stage_layers=0, model=DSV3),
    },
    3: {
        "pp3-1f1b-m1-d2-tied": dict(pp=3, global_batch=MICRO, model=dict(TIED, **SIX)),
        "pp3-1f1b-m8-d1-untied": dict(pp=3, global_batch=MICRO * 8, model=dict(UNTIED, **SIX)),
        "pp3-1f1b-m1-dsv3": dict(pp=3, global_batch=MICRO, model=dict(DSV3, **SIX)),
        # the modules on a stage of their own: stage 2 holds the final norm, the output layer and the module only
        "pp3-1f1b-m2-dsv3-own-stage": dict(pp=3, global_batch=MICRO * 2, last_stage_layers=0,
                                           model=dict(DSV3, **SIX)),
    },
}


def _cfg(kw: dict):
    return eq.make_cfg(micro=MICRO, **TRAIN, **kw)


CHECKPOINTED = dict(pp=2, global_batch=4, model=UNTIED_D2)  # saved after one step, loaded by one process


def _worker(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for name, kw in JOBS[world_size].items():
        cfg = _cfg(kw)
        grid = eq.make_grid(cfg)
        res = eq.train_run(cfg, grid, STEPS)
        res["coords"] = (grid.tp_rank, grid.pp_rank, grid.dp_rank)
        out[name] = res
        eq.barrier()
    if world_size == 2:
        out["checkpoint"] = _save(root)
    return out


def _save(root: str) -> dict:
    """One step at pp2, then a checkpoint of it: this rank's full parameters as saved."""
    from mlplat.checkpoint import io

    cfg = _cfg(CHECKPOINTED)
    grid = eq.make_grid(cfg)
    module = eq.build_module(cfg, grid)
    module.run(eq.local_batches(cfg, grid.dp_rank, 1)[0])
    module.finish()
    io.save(Path(root) / "step-1", module.chunks, module.optimizer, grid, {"global_step": 1}, {"pp": 2})
    return eq.full_tensors(module, grid, "param")[0]


_WORLDS: dict[int, list | BaseException] = {}
_ROOT = tempfile.mkdtemp(prefix="mtp-ckpt-")
atexit.register(shutil.rmtree, _ROOT, True)


def _world(n: int) -> list[dict]:
    if n not in _WORLDS:
        try:
            _WORLDS[n] = run_distributed(_worker, n, _ROOT, timeout=480)
        except Exception as err:  # noqa: BLE001 - re-raised for every test of this world
            _WORLDS[n] = err
    if isinstance(_WORLDS[n], BaseException):
        raise _WORLDS[n]
    return _WORLDS[n]


def _close(a, b, what):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", [n for jobs in JOBS.values() for n in jobs])
def test_mtp_training_equals_one_process(name):
    world = next(w for w, jobs in JOBS.items() if name in jobs)
    kw = JOBS[world][name]
    results = [r[name] for r in _world(world)]
    ref = eq.reference(_cfg(kw), "train")
    depth = kw["model"]["mtp"]["depth"]
    assert all(set(step) == {f"mtp_loss/depth{k}" for k in range(1, depth + 1)} for step in ref["mtp"])
    for res in results:
        where = f"{name} on rank {res['coords']}"
        _close(res["losses"], ref["losses"], f"losses, {where}")
        _close(res["norms"], ref["norms"], f"grad norms, {where}")
        for step, (got, want) in enumerate(zip(res["mtp"], ref["mtp"])):
            assert got.keys() == want.keys(), where
            for key in want:
                _close(got[key], want[key], f"{key} of step {step + 1}, {where}")
        assert res["param_pad"] == 0.0
        assert not kw.get("post_validate") or res["redone"][-1] > 0, "no step was redone"
        if "moe" in kw["model"]:  # the module's MoE layer's loads too (layer l + k - 1 = l)
            _close(res["aux"], ref["aux"], f"balancing losses, {where}")
            layers = kw["model"].get("n_layers", eq.MODEL["n_layers"])
            assert all(f"moe_load_max/layer{layers}" in step for step in res["loads"]), where
            for got, want in zip(res["loads"], ref["loads"]):
                assert got.keys() == want.keys()
                _close(list(got.values()), list(want.values()), f"expert loads, {where}")
    merged = eq.merge(results, "params")
    assert set(merged) == set(ref["params"]), sorted(set(merged) ^ set(ref["params"]))
    for full, copies in merged.items():
        for t in copies:
            _close(t, ref["params"][full], f"{full} after {STEPS} steps ({name})")
    assert any(n.startswith(f"mtp.{depth - 1}.proj") for n in merged)


def test_a_checkpoint_of_the_modules_loads_under_another_layout():
    """Saved at pp2 (the modules and the word embedding's copy on stage 1), loaded by one process: every parameter,
    the modules' and the word embedding (one name for both copies) included, as the two ranks held it."""
    from mlplat.checkpoint import io
    from mlplat.parallel.grid import ParallelGrid

    saved = eq.merge(_world(2), "checkpoint")
    cfg = _cfg(dict(CHECKPOINTED, pp=1))
    module = eq.build_module(cfg, ParallelGrid())
    io.load(Path(_ROOT) / "step-1", module.chunks, module.optimizer, module.grid, vocab_size=eq.VOCAB)
    loaded = eq.full_tensors(module, module.grid, "param")[0]
    assert set(loaded) == set(saved) and any(n.startswith("mtp.1.layer.") for n in loaded)
    assert len(saved[eq.WORD_EMBEDDING]) == 2  # the first stage's and the last stage's copy
    for name, copies in saved.items():
        for t in copies:
            assert torch.equal(loaded[name], t), name
