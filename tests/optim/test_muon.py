"""Muon (`mlplat.optim.muon`): Newton–Schulz against the SVD, the update scales, the logical matrices the layers
declare, the distributed optimizer's shards dealt by Newton–Schulz FLOPs, and, in one spawn of two ranks, training
equal to one process in float64 under tp2 (sequence parallel, the key/value head replicated; also post-validated),
pp2 interleaved, pp2 zero-bubble V, FP8 tensorwise at tp2, dp2 and dp2 with the parameters sharded, a MoE model's
experts under tp2 and ep2 (with the distributed optimizer), latent attention's projections under tp2; a resume from
tp2 into dp2 (the parameters sharded) continuing the one-process trajectory; orthogonalising tp shards instead of
whole matrices leaving it; and QK-clip (a clipped head's largest logit brought to tau; clipping at tp2
post-validated, dp2 with the distributed optimizer and cp2 equal to one process)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers import equivalence as eq
from tests.helpers.dist import run_distributed

TOL = 1e-9
MQA = dict(arch="llama", n_kv_heads=1, qkv_bias=True)  # SwiGLU's fc1 and a key/value head shared at t2
STEPS = 4
MUON = dict(name="muon", muon=dict(lr=2e-2))
QK_CLIP = dict(name="muon", muon=dict(lr=2e-2, qk_clip=0.06))
TRAIN = dict(global_batch=16, grad_clip=0.43, lr=1e-2, steps=STEPS, micro=2, model=MQA, optim=MUON)
LAYOUTS = {
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2v2-interleaved": dict(pp=2, vpp=2, schedule="interleaved"),
    # the zero-bubble V: each rank two chunks, the weight gradients deferred (added into the buffers after later B's)
    "pp2-zbv": dict(pp=2, vpp=2, schedule="zbv"),
    # every step clipped: stepped first, then redone from the saved momentum
    "tp2-sp-post-validate": dict(tp=2, sequence_parallel=True, post_validate=True),
    "dp2": dict(dp=2),
    # the parameters sharded too (FSDP): whole matrices in a shard, gathered per layer for the passes
    "dp2-params": dict(dp=2, optim={**MUON, "sharding": "params"}),
    # QK-clip triggering (tau under the heads' logits from step 1 on): the key/value head shared by the two tp ranks
    # (each scales its copy by its group's worst query head), redone under post-validation; the owner of each shard
    # scaling it (distributed optimizer); the maxima over the ring's blocks (context parallelism)
    "tp2-sp-post-validate-qk-clip": dict(tp=2, sequence_parallel=True, post_validate=True, optim=QK_CLIP),
    "dp2-distributed-qk-clip": dict(dp=2, distributed=True, optim=QK_CLIP),
    "cp2-qk-clip": dict(cp=2, optim=QK_CLIP),
}
# Experts (SwiGLU: each expert's gate, up and down projections): split over tp (gathered for the iteration, with
# sequence parallelism), whole over ep (each rank its own), with the distributed optimizer.
MOE = dict(arch="llama", moe=dict(num_experts=4, top_k=2, ffn_hidden=16, dense_layers=1, shared_experts=1,
                                  aux_loss_coeff=0.05))
MOE_TRAIN = dict(global_batch=8, grad_clip=1.0, lr=1e-2, steps=3, micro=2, model=MOE, optim=MUON)
# Multi-head latent attention: its projections (q_down, q_up, kv_down, kv_up, out) each a matrix, the up-projections
# split over tp (gathered), the down-projections replicated.
MLA = dict(arch="llama", attention="mla", mla=dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=6,
                                                   qk_rope_head_dim=4, v_head_dim=8))
MLA_TRAIN = dict(TRAIN, steps=3, model=MLA)
# QK-clip on them (tau 0.03: under latent attention's smaller logits): each clipped head's q_nope, q_rope and k_nope
# rows scaled, each on the tp rank holding the head
MLA_QK_CLIP_TRAIN = dict(MLA_TRAIN, optim=dict(name="muon", muon=dict(lr=2e-2, qk_clip=0.03)))
# FP8 (tensorwise current scaling, computed wider under 64-true): the GEMMs quantised under tp2 (the scales over the
# split matrices' whole) against one process quantising alike; two key/value heads, one per tp rank (FP8's rule).
FP8_TRAIN = dict(TRAIN, steps=3, model=dict(arch="llama", n_kv_heads=2, qkv_bias=True, n_layers=2), fp8="tensorwise")
# Pipelines of three stages (six layers), QK-clip clipping: 1F1B at m = 1 and m = 8, the zero-bubble V (each rank
# two chunks, the first and last on rank 0).
# tau 0.04: under the logits of some heads at every step, m = 1's fewer tokens included.
PP3_TRAIN = dict(TRAIN, model=dict(MQA, n_layers=6), optim=dict(name="muon", muon=dict(lr=2e-2, qk_clip=0.04)))
PP3_LAYOUTS = {
    "pp3-1f1b-m1-qk-clip": dict(pp=3, global_batch=TRAIN["micro"]),
    "pp3-1f1b-m8-qk-clip": dict(pp=3),
    "pp3v2-zbv-qk-clip": dict(pp=3, vpp=2, schedule="zbv"),
}
MOE_LAYOUTS = {
    "moe-tp2-sp": dict(tp=2, sequence_parallel=True),
    "moe-ep2-dp2": dict(dp=2, ep=2),
    # ep folded over tp: each tp rank holds its own experts whole, the attention split over the same two ranks
    "moe-ep2-tp2-sp": dict(tp=2, ep=2, sequence_parallel=True),
    "moe-ep2-dp2-distributed": dict(dp=2, ep=2, distributed=True),
}


# ============================================================================================ the arithmetic


def _quintic(s: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic on singular values: Newton–Schulz acts on each of them alone (Jordan's derivation)."""
    from mlplat.optim.muon import NS_COEFFICIENTS

    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        s = a * s + b * s ** 3 + c * s ** 5
    return s


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (8, 8)])
def test_newton_schulz_is_the_quintic_on_the_singular_values(shape):
    from mlplat.optim.muon import newton_schulz

    g = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    expected = u @ torch.diag(_quintic(s / (g.norm() + 1e-7), 5)) @ vh
    out = newton_schulz(g, 5)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    sv = torch.linalg.svdvals(out)  # near the fixed point: singular values in about [0.7, 1.2]
    assert 0.6 < float(sv.min()) and float(sv.max()) < 1.25, sv
    assert out.dtype == torch.float64


def test_update_scale():
    from mlplat.optim.muon import update_scale

    assert update_scale("moonlight", 64, 16) == pytest.approx(0.2 * 8)
    assert update_scale("moonlight", 16, 64) == pytest.approx(0.2 * 8)
    assert update_scale("spectral", 64, 16) == pytest.approx(2.0)
    assert update_scale("spectral", 16, 64) == 1.0
    with pytest.raises(ValueError, match="update_scale"):
        update_scale("rms", 4, 4)


# ============================================================================================ logical matrices


def _one_process(model: dict):
    cfg = eq.make_cfg(model=model, optim=dict(name="muon"))
    return cfg, eq.build_module(cfg, eq.make_grid(cfg))


def test_layers_declare_their_logical_matrices():
    """QKV: the query heads of every group, then k, then v, as ParallelAttention's forward reads its rows; SwiGLU's
    fc1: the even rows (gate) and the odd (up); the embedding, output layer, norms and biases: none (AdamW)."""
    from mlplat.optim.muon import is_hidden_matrix
    from mlplat.parallel.tensor import matrix_rows

    cfg, module = _one_process(dict(arch="llama", n_kv_heads=2))
    layer = next(iter(module.chunks[0].layers.values()))
    d, r, g = cfg.model.head_size, cfg.model.n_heads // 2, 2
    rows = torch.arange(layer.attn.qkv.weight.shape[0]).view(g, r + 2, d)
    q, k, v = matrix_rows(layer.attn.qkv.weight.matrices, rows.numel())
    assert torch.equal(q, rows[:, :r].reshape(-1)) and torch.equal(k, rows[:, r].reshape(-1))
    assert torch.equal(v, rows[:, r + 1].reshape(-1))
    n = layer.mlp.fc1.weight.shape[0]
    gate, up = matrix_rows(layer.mlp.fc1.weight.matrices, n)
    assert torch.equal(gate, torch.arange(0, n, 2)) and torch.equal(up, torch.arange(1, n, 2))
    hidden = {name for name, p in module.chunks[0].named_parameters() if is_hidden_matrix(p)}
    assert hidden == {f"layers.{i}.{m}.weight" for i in range(cfg.model.n_layers)
                      for m in ("attn.qkv", "attn.out", "mlp.fc1", "mlp.fc2")}


def test_experts_are_matrices_each():
    """Stacked experts: each expert's gate, up and down projections are matrices of their own, whole on an
    expert-parallel rank's own experts too (the same period)."""
    from mlplat.model.moe import ExpertWeights
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.parallel.tensor import matrix_rows

    fc1 = ExpertWeights(4, 2 * 6, 8, ParallelGrid(), parts=2)
    fc2 = ExpertWeights(4, 8, 6, ParallelGrid(), split_out=False)
    blocks = matrix_rows(fc1.weight.matrices, fc1.weight.shape[0])
    assert [b.tolist() for b in blocks] == [list(range(e * 12 + q * 6, e * 12 + q * 6 + 6))
                                           for e in range(4) for q in range(2)]
    assert [b.tolist() for b in matrix_rows(fc2.weight.matrices, 32)] == [list(range(e * 8, e * 8 + 8))
                                                                          for e in range(4)]
    assert [b.tolist() for b in matrix_rows(fc1.weight.matrices, 24)][:2] == [list(range(6)), list(range(6, 12))]


def test_fused_weight_is_orthogonalised_per_logical_matrix():
    """The fused QKV's update is each of q, k, v orthogonalised alone, unlike the fused matrix's."""
    from mlplat.optim.muon import newton_schulz, orthogonalise, update_scale
    from mlplat.parallel.tensor import matrix_rows

    _, module = _one_process(dict(arch="llama", n_kv_heads=2))
    w = next(iter(module.chunks[0].layers.values())).attn.qkv.weight
    full = torch.randn(w.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = orthogonalise(full, w.matrices, 5, "moonlight")
    for rows in matrix_rows(w.matrices, w.shape[0]):
        block = full[rows]
        torch.testing.assert_close(out[rows], newton_schulz(block, 5) * update_scale("moonlight", *block.shape),
                                   rtol=0, atol=0)
    whole = newton_schulz(full, 5) * update_scale("moonlight", *full.shape)
    assert float((out - whole).abs().max()) > 1e-2


def test_muon_work_is_each_logical_matrix_newton_schulz():
    """What a shard owner's step costs (`step_work`): the fused QKV's query, key and value projections each (not the
    fused matrix), SwiGLU's gate and up each; AdamW's parameters one per element."""
    from mlplat.optim.muon import step_work
    from mlplat.optim.ns_cost import ns_flops
    from mlplat.parallel.grid import ParallelGrid

    cfg, module = _one_process(MQA)
    layer, grid = next(iter(module.chunks[0].layers.values())), ParallelGrid()
    h, hd, f = cfg.model.hidden, cfg.model.head_size, cfg.model.ffn
    assert step_work(layer.attn.qkv.weight, grid) == ns_flops(cfg.model.n_heads * hd, h, 1) + 2 * ns_flops(hd, h, 1)
    assert step_work(layer.mlp.fc1.weight, grid) == 2 * ns_flops(f, h, 1)
    assert step_work(layer.attn.qkv.bias, grid) == layer.attn.qkv.bias.numel()


@pytest.mark.parametrize("model", [MQA, MOE], ids=["llama", "moe"])
def test_whole_matrices_are_dealt_by_newton_schulz_flops(model):
    """A model's buckets dealt to d shards by `step_work`, costliest first to the least loaded, the shards' load
    carried from bucket to bucket: every parameter within one shard, the shard length the fullest shard's elements,
    and each shard's total within Graham's bound (the mean plus (1 - 1/d) of the costliest parameter)."""
    from mlplat.optim.buffers import ALIGN, BUCKET_BYTES, _layout, _round_up, backward_buckets
    from mlplat.optim.muon import step_work
    from mlplat.parallel.grid import ParallelGrid

    _, module = _one_process(model)
    grid, buckets = ParallelGrid(), backward_buckets(module.chunks, BUCKET_BYTES // 64)
    assert len(buckets) > 2
    for d in (2, 3, 4):
        load, total, top = [0.0] * d, [0.0] * d, 0.0
        for _, params in buckets:
            sizes, costs = [p.numel() for p in params], [step_work(p, grid) for p in params]
            starts, n = _layout(sizes, d, costs, load)
            fill = [0] * d
            for start, size, cost in zip(starts, sizes, costs):
                b = start // n
                assert start % ALIGN == 0 and start + size <= (b + 1) * n
                fill[b] += _round_up(size, ALIGN)
                total[b] += cost
            assert n == _round_up(max(fill), ALIGN)
            top = max(top, *costs)
        assert total == pytest.approx(load, rel=1e-12)
        assert max(total) <= sum(total) / d + (1 - 1 / d) * top * (1 + 1e-12)
    assert _layout([100, 300, 50], 1) == ([0, 128, 448], 498)  # one bin (AdamW, or no sharding): in order


def test_config_refuses_muon_keys_elsewhere_and_bad_values():
    from mlplat.config import ConfigError

    with pytest.raises(ConfigError, match=r"optim.muon.momentum=0.9 set with optim.name=adamw"):
        eq.make_cfg(optim=dict(muon=dict(momentum=0.9)))
    with pytest.raises(ConfigError, match=r"optim.muon.update_scale='rms' is not one of moonlight, spectral"):
        eq.make_cfg(optim=dict(name="muon", muon=dict(update_scale="rms")))
    assert eq.make_cfg(optim=dict(name="muon", muon=dict(nesterov=False))).optim.muon.nesterov is False


def test_config_refuses_qk_clip_out_of_range_or_where_it_cannot_clip():
    from mlplat.config import ConfigError

    with pytest.raises(ConfigError, match=r"optim.muon.qk_clip=0.0 must be positive"):
        eq.make_cfg(optim=dict(name="muon", muon=dict(qk_clip=0.0)))
    with pytest.raises(ConfigError, match=r"optim.muon.qk_clip=50.0 set with optim.name=adamw"):
        eq.make_cfg(optim=dict(muon=dict(qk_clip=50.0)))
    with pytest.raises(ConfigError, match=r"optim.muon.qk_clip=50.0 with model.attention=mla at parallel.cp=2: the "
                                          r"latent ring does not track"):
        eq.make_cfg(model=MLA, cp=2, optim=dict(name="muon", muon=dict(qk_clip=50.0)))
    with pytest.raises(ConfigError, match=r"optim.muon.qk_clip=50.0 with model.qk_norm=true"):
        eq.make_cfg(model=dict(arch="llama", qk_norm=True), optim=dict(name="muon", muon=dict(qk_clip=50.0)))


QK_CLIP_MODELS = {"mha": dict(arch="llama", n_kv_heads=4, qkv_bias=True),
                  "gqa": dict(arch="llama", n_kv_heads=2, qkv_bias=True),
                  "mla": MLA, "mla-no-query-latent": dict(MLA, mla=dict(MLA["mla"], q_lora_rank=None))}


def _clip_once(model: str):
    """One layer of QK_CLIP_MODELS[model]: the heads' maxima on a batch, tau their median, a step (learning rates
    ~0) that clips, and the maxima on the same batch after it: (cfg, tau, the step's record, before, after)."""
    cfg = eq.make_cfg(model=dict(QK_CLIP_MODELS[model], n_layers=1), lr=1e-14, steps=1,
                      optim=dict(name="muon", muon=dict(lr=1e-14, qk_clip=1.0)))
    module = eq.build_module(cfg, eq.make_grid(cfg))
    batch = eq.local_batches(cfg, 0, 1)[0]
    hook = module.hooks[-1]
    module.forward_backward(batch)  # the heads' maxima (in the table); tau: their median
    hook.tau = tau = float(hook.table.median())
    (record,) = module.run(batch)
    before = hook.table.clone()
    module.forward_backward(batch)  # the same batch on the clipped weights: its maxima in the table again
    return cfg, tau, record, before, hook.table.clone()


@pytest.mark.parametrize("model", list(QK_CLIP_MODELS))
def test_qk_clip_brings_each_clipped_head_to_tau(model):
    """One layer, a step that moves nothing else (learning rates ~0): each head over tau is scaled so that its
    largest logit on the same batch is tau (multi-head: exactly, its query and key rows by sqrt(tau/max) each, biases
    too; latent attention: its q_nope and k_nope rows by sqrt(tau/max), its q_rope rows by tau/max, the shared rotary
    key untouched); the others keep theirs. Grouped-query: the key of a group scaled for its worst query head, which
    ends at tau, the others below."""
    cfg, tau, record, before, after = _clip_once(model)
    kv_heads = cfg.model.kv_heads
    over = before > tau
    assert int(record.qk_clipped_heads) == int(over.sum()) and 0 < int(over.sum()) < over.numel()
    if kv_heads == cfg.model.n_heads:
        torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=0, atol=1e-12)
        torch.testing.assert_close(after[~over], before[~over], rtol=0, atol=1e-12)
    else:
        groups = over.view(1, kv_heads, -1).any(-1)  # [layers, kv heads] with a clipped query head
        worst = after.view(1, kv_heads, -1).amax(-1)
        torch.testing.assert_close(worst[groups], torch.full_like(worst[groups], tau), rtol=0, atol=1e-12)
        assert bool((after <= torch.maximum(before, torch.tensor(tau)) + 1e-12).all())


def test_latent_qk_clip_as_multi_head_attention_misses_tau(monkeypatch):
    """A control: latent attention's q_rope rows scaled by sqrt(eta), as multi-head attention's query rows (the shared
    rotary key left alone), leave each clipped head above tau."""
    import mlplat.model.qk_clip as qk_clip

    kimi = qk_clip.scale_latent_rows

    def as_mha(attn, query, key):
        kimi(attn, query, key)  # q_nope and k_nope as before
        w = attn.shape
        attn.q_up.weight.qk_clip_scale.view(attn.heads, w.nope + w.rope)[:, w.nope:] = query.sqrt()[:, None]

    monkeypatch.setattr(qk_clip, "scale_latent_rows", as_mha)
    _, tau, _, before, after = _clip_once("mla")
    over = before > tau
    assert bool((after[over] > tau + 1e-6).all()), (after[over], tau)


def test_qk_clip_changes_the_trajectory():
    """The proofs below compare runs that clip: the losses move with it."""
    clipped, plain = _reference("cp2-qk-clip"), _reference()
    assert clipped["losses"][0] == plain["losses"][0] and abs(clipped["losses"][-1] - plain["losses"][-1]) > 1e-7


# ============================================================================================ layouts


def _losses(records) -> list[float]:
    return [float(r.loss) for r in records]


def _worker(rank: int, world: int, root: str) -> dict:
    import mlplat.optim.muon as muon
    from mlplat.checkpoint import io

    torch.set_num_threads(1)
    out = {}
    for name, kw in LAYOUTS.items():
        cfg = eq.make_cfg(**{**TRAIN, **kw})
        res = eq.train_run(cfg, eq.make_grid(cfg), STEPS)
        out[name] = {"losses": res["losses"], "norms": res["norms"], "params": res["params"], "redone": res["redone"],
                     "qk_clipped": res["qk_clipped"]}
        eq.barrier()
    for name, (train, kw) in {**{n: (MOE_TRAIN, kw) for n, kw in MOE_LAYOUTS.items()},
                              "mla-tp2-sp": (MLA_TRAIN, dict(tp=2, sequence_parallel=True)),
                              "mla-tp2-sp-qk-clip": (MLA_QK_CLIP_TRAIN, dict(tp=2, sequence_parallel=True)),
                              "tp2-fp8": (FP8_TRAIN, dict(tp=2))}.items():
        cfg = eq.make_cfg(**train, **kw)
        res = eq.train_run(cfg, eq.make_grid(cfg), train["steps"])
        out[name] = {"losses": res["losses"], "norms": res["norms"], "params": res["params"],
                     "qk_clipped": res["qk_clipped"]}
        eq.barrier()
    # The tp2·dp2 checkpoint (distributed optimizer) resumed at pp2.
    out["resume-tp2dp2-pp2"] = {"losses": _resumed(eq.make_cfg(**TRAIN, pp=2), Path(root) / "tp2dp2")}
    eq.barrier()
    # Resume: two steps at tp2 (sequence parallel), saved; two more at dp2 with the parameters sharded.
    losses, schedule = _two_steps_saved(eq.make_cfg(**TRAIN, **LAYOUTS["tp2-sp"]), Path(root) / "tp2", {"tp": 2})
    cfg = eq.make_cfg(**{**TRAIN, **LAYOUTS["dp2-params"]})
    grid = eq.make_grid(cfg)
    module = eq.build_module(cfg, grid)
    io.load(Path(root) / "tp2", module.chunks, module.optimizer, grid, vocab_size=eq.VOCAB)
    module.schedule.load_state_dict(schedule)
    for batch in eq.local_batches(cfg, grid.dp_rank, STEPS)[2:]:
        losses += _losses(module.run(batch))
    module.finish()
    out["resume"] = {"losses": losses}
    eq.barrier()
    # Each tp rank orthogonalising its own shard: another optimizer (the proofs above must catch it).
    saved = muon.gather_full, muon.shard_of, muon.matrix_rows
    muon.gather_full, muon.shard_of = (lambda p, grid, value: value), (lambda out, p, grid: out)
    muon.matrix_rows = lambda matrices, rows: [torch.arange(rows)]
    try:
        cfg = eq.make_cfg(**TRAIN, **LAYOUTS["tp2-sp"])
        out["shards"] = {"losses": eq.train_run(cfg, eq.make_grid(cfg), STEPS)["losses"]}
    finally:
        muon.gather_full, muon.shard_of, muon.matrix_rows = saved
    return out


def _resumed(cfg, checkpoint: Path) -> list[float]:
    """Steps 3 and 4 of TRAIN's batches under cfg's layout, from a checkpoint of step 2 (its schedule included)."""
    from mlplat.checkpoint import io

    grid = eq.make_grid(cfg)
    module = eq.build_module(cfg, grid)
    state = io.load(checkpoint, module.chunks, module.optimizer, grid, vocab_size=eq.VOCAB)
    module.schedule.load_state_dict(state["lr_schedulers"][0])
    losses = []
    for batch in eq.local_batches(cfg, grid.dp_rank, STEPS)[2:]:
        losses += _losses(module.run(batch))
    module.finish()
    return losses


def _two_steps_saved(cfg, path: Path, layout: dict) -> tuple[list[float], dict]:
    """The first two steps of `cfg`, saved at `path` with their learning-rate schedule: the losses and the schedule."""
    from mlplat.checkpoint import io

    grid = eq.make_grid(cfg)
    module = eq.build_module(cfg, grid)
    losses = []
    for batch in eq.local_batches(cfg, grid.dp_rank, STEPS)[:2]:
        losses += _losses(module.run(batch))
    module.finish()
    schedule = module.schedule.state_dict()
    io.save(path, module.chunks, module.optimizer, grid, {"global_step": 2, "lr_schedulers": [schedule]}, layout)
    return losses, schedule


def _tp2dp2_worker(rank: int, world: int, root: str) -> list[float]:
    """Two steps at tp2·dp2 with the distributed optimizer (each data-parallel rank owning whole matrices), saved."""
    torch.set_num_threads(1)
    cfg = eq.make_cfg(**TRAIN, tp=2, dp=2, sequence_parallel=True, distributed=True)
    return _two_steps_saved(cfg, Path(root) / "tp2dp2", {"tp": 2, "dp": 2})[0]


def _pp3_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, kw in PP3_LAYOUTS.items():
        cfg = eq.make_cfg(**{**PP3_TRAIN, **kw})
        res = eq.train_run(cfg, eq.make_grid(cfg), STEPS)
        out[name] = {"losses": res["losses"], "norms": res["norms"], "params": res["params"],
                     "qk_clipped": res["qk_clipped"]}
        eq.barrier()
    return out


@pytest.fixture(scope="module")
def saved_tp2dp2(tmp_path_factory):
    """The checkpoint root (a tp2·dp2 Muon checkpoint of step 2 in it) and the saving ranks' losses."""
    root = tmp_path_factory.mktemp("muon")
    return root, run_distributed(_tp2dp2_worker, 4, str(root), timeout=240)


@pytest.fixture(scope="module")
def world(saved_tp2dp2):
    return run_distributed(_worker, 2, str(saved_tp2dp2[0]), timeout=480)


@pytest.fixture(scope="module")
def pp3_world():
    return run_distributed(_pp3_worker, 3, timeout=300)


def _reference(name: str | None = None):
    """One process's run of TRAIN, with layout `name`'s Muon keys (QK-clip's)."""
    optim = LAYOUTS[name].get("optim", MUON) if name is not None else MUON
    return eq.reference(eq.make_cfg(**{**TRAIN, "optim": dict(name="muon", muon=optim["muon"])}), "train")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_trains_as_one_process(world, name):
    """Per-step losses and gradient norms, and every copy of the final parameters, equal one process's; with
    QK-clip, the same heads clipped at every step, some at each step."""
    ref = _reference(name)
    assert ref["losses"][-1] != ref["losses"][0]
    for res in world:
        assert (res[name]["redone"][-1] > 0) == ("post-validate" in name), res[name]["redone"]  # a step redone
        assert res[name]["qk_clipped"] == ref["qk_clipped"]
        assert ("qk-clip" not in name) or min(ref["qk_clipped"]) > 0, ref["qk_clipped"]
        torch.testing.assert_close(torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]), rtol=TOL, atol=TOL)
        torch.testing.assert_close(torch.tensor(res[name]["norms"]), torch.tensor(ref["norms"]), rtol=TOL, atol=TOL)
        for full, t in res[name]["params"].items():
            torch.testing.assert_close(t, ref["params"][full], rtol=TOL, atol=TOL, msg=lambda m: f"{full}: {m}")


@pytest.mark.parametrize("name", list(PP3_LAYOUTS))
def test_muon_trains_three_stages_as_one_process(pp3_world, name):
    """Three stages (1F1B at m = 1 and 8, the zero-bubble V), QK-clip clipping heads at every step: losses, norms,
    clipped heads and every stage's parameters of one process."""
    cfg = eq.make_cfg(**{**PP3_TRAIN, **PP3_LAYOUTS[name]})
    ref = eq.reference(cfg, "train")
    assert min(ref["qk_clipped"]) > 0, ref["qk_clipped"]
    merged = eq.merge([r[name] for r in pp3_world], "params")
    assert set(merged) == set(ref["params"])
    for res in pp3_world:
        assert res[name]["qk_clipped"] == ref["qk_clipped"]
        torch.testing.assert_close(torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]), rtol=TOL, atol=TOL)
        torch.testing.assert_close(torch.tensor(res[name]["norms"]), torch.tensor(ref["norms"]), rtol=TOL, atol=TOL)
    for full, copies in merged.items():
        for t in copies:
            torch.testing.assert_close(t, ref["params"][full], rtol=TOL, atol=TOL, msg=lambda m, n=full: f"{n}: {m}")


@pytest.fixture(scope="module")
def moe_reference():
    cfg = eq.make_cfg(**MOE_TRAIN)
    return eq.train_run(cfg, eq.make_grid(cfg), MOE_TRAIN["steps"])


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_muon_trains_experts_as_one_process(world, moe_reference, name):
    """Experts split over tp (their matrices gathered) or whole over ep: losses, norms and parameters of one
    process."""
    ref = moe_reference
    for res in world:
        torch.testing.assert_close(torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]), rtol=TOL, atol=TOL)
        torch.testing.assert_close(torch.tensor(res[name]["norms"]), torch.tensor(ref["norms"]), rtol=TOL, atol=TOL)
    merged = eq.merge([r[name] for r in world], "params")
    assert set(merged) == set(ref["params"]) and any(".mlp.experts.fc1." in n for n in merged)
    for full, copies in merged.items():
        for t in copies:
            torch.testing.assert_close(t, ref["params"][full], rtol=TOL, atol=TOL, msg=lambda m, n=full: f"{n}: {m}")


@pytest.mark.parametrize("name", ["mla-tp2-sp", "mla-tp2-sp-qk-clip"])
def test_muon_trains_latent_attention_as_one_process(world, name):
    """Latent attention's projections under tp2 with sequence parallelism; with QK-clip, the same heads clipped at
    every step (some at each) and the trajectory of one process."""
    ref = eq.reference(eq.make_cfg(**(MLA_QK_CLIP_TRAIN if "qk-clip" in name else MLA_TRAIN)), "train")
    assert ("qk-clip" not in name) or min(ref["qk_clipped"]) > 0, ref["qk_clipped"]
    for res in world:
        assert res[name]["qk_clipped"] == ref["qk_clipped"]
        torch.testing.assert_close(torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]), rtol=TOL,
                                   atol=TOL)
        for full, t in res[name]["params"].items():
            torch.testing.assert_close(t, ref["params"][full], rtol=TOL, atol=TOL, msg=lambda m, n=full: f"{n}: {m}")


def test_muon_trains_fp8_as_one_process(world):
    """FP8 tensorwise at tp2 against one process running FP8 too (the cached references key no kernels)."""
    cfg = eq.make_cfg(**FP8_TRAIN)
    ref = eq.train_run(cfg, eq.make_grid(cfg), FP8_TRAIN["steps"])
    plain = eq.make_cfg(**{**FP8_TRAIN, "fp8": "none"})
    assert eq.train_run(plain, eq.make_grid(plain), 1)["losses"][0] != ref["losses"][0]  # FP8 rounds the pass
    for res in world:
        torch.testing.assert_close(torch.tensor(res["tp2-fp8"]["losses"]), torch.tensor(ref["losses"]), rtol=TOL,
                                   atol=TOL)
        torch.testing.assert_close(torch.tensor(res["tp2-fp8"]["norms"]), torch.tensor(ref["norms"]), rtol=TOL,
                                   atol=TOL)
        for full, t in res["tp2-fp8"]["params"].items():
            torch.testing.assert_close(t, ref["params"][full], rtol=TOL, atol=TOL, msg=lambda m, n=full: f"{n}: {m}")


def test_resume_under_another_layout_keeps_the_trajectory(world):
    """Muon's momentum saved at tp2 (full-model names) and loaded at dp2 with the parameters sharded: steps 3 and
    4 (whose weights the resumed momentum moved) have the one-process losses."""
    ref = _reference()
    for res in world:
        torch.testing.assert_close(torch.tensor(res["resume"]["losses"]), torch.tensor(ref["losses"]),
                                   rtol=TOL, atol=TOL)


def test_distributed_checkpoint_resumes_at_pp2_and_in_one_process(saved_tp2dp2, world):
    """Muon saved at tp2·dp2 with the distributed optimizer (each dp rank's shard of whole matrices, each tp rank's
    rows of them): steps 1-2 there, and steps 3-4 resumed from it at pp2 and in one process, have the one-process
    losses."""
    root, saved = saved_tp2dp2
    ref = _reference()
    for losses in saved:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"][:2]), rtol=TOL, atol=TOL)
    for res in world:
        torch.testing.assert_close(torch.tensor(res["resume-tp2dp2-pp2"]["losses"]), torch.tensor(ref["losses"][2:]),
                                   rtol=TOL, atol=TOL)
    one = _resumed(eq.make_cfg(**TRAIN), root / "tp2dp2")
    torch.testing.assert_close(torch.tensor(one), torch.tensor(ref["losses"][2:]), rtol=TOL, atol=TOL)


def test_orthogonalising_shards_is_another_optimizer(world):
    ref = _reference()
    for res in world:
        assert math.isclose(res["shards"]["losses"][1], ref["losses"][1], abs_tol=1e-6) is False


# ============================================================================================ AdamW into Muon


def test_adamw_checkpoint_resumes_under_muon_with_a_fresh_momentum(tmp_path, caplog):
    """Two AdamW steps saved, two more under Muon from the checkpoint: the losses of a Muon optimizer given the same
    weights, AdamW moments (for the parameters Muon leaves to AdamW), step count and schedule directly, its momentum
    zero; the load says so in one line. The checkpoint's AdamW groups do not become Muon's."""
    from mlplat.checkpoint import io
    from mlplat.checkpoint.state import full_parameters
    from mlplat.optim.muon import is_hidden_matrix

    adamw = eq.make_cfg(**{**TRAIN, "optim": None})
    grid = eq.make_grid(adamw)
    batches = eq.local_batches(adamw, 0, STEPS)
    saved = eq.build_module(adamw, grid)
    for batch in batches[:2]:
        saved.run(batch)
    saved.finish()
    io.save(tmp_path / "step-2", saved.chunks, saved.optimizer, grid,
            {"global_step": 2, "lr_schedulers": [saved.schedule.state_dict()]}, {"optimizer": "adamw"})

    muon = eq.make_cfg(**TRAIN)
    resumed = eq.build_module(muon, grid)
    with caplog.at_level("WARNING", logger="mlplat"):
        state = io.load(tmp_path / "step-2", resumed.chunks, resumed.optimizer, grid, vocab_size=eq.VOCAB)
    resumed.schedule.fresh_groups = bool(state.pop(io.FRESH_STATE, ()))  # as the strategy does
    resumed.schedule.load_state_dict(state["lr_schedulers"][0])
    assert [r.message for r in caplog.records if r.name.startswith("mlplat")] == [  # (DCP logs its own)
        f"resuming {tmp_path / 'step-2'}, saved by optim.name=adamw, under another optimizer: the weights, exp_avg, "
        "exp_avg_sq, the step count and the learning-rate schedule continue; momentum_buffer starts at zero (fresh), "
        "and the parameter groups take this run's optim.* keys"]
    assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [muon.optim.muon.weight_decay,
                                                                          muon.optim.weight_decay, 0.0]

    # The reference: a Muon optimizer handed the AdamW run's state, its momentum zero.
    reference = eq.build_module(muon, grid)
    main, opt = reference.grads, reference.optimizer
    theirs = full_parameters(saved.chunks)
    for name, p in full_parameters(reference.chunks).items():
        q = theirs[name]
        main.shard_view(p, "main").copy_(q.detach().reshape(-1))
        for k in ("exp_avg", "exp_avg_sq"):
            main.shard_view(p, k).copy_(saved.optimizer.state[q][k].reshape(-1))
        assert is_hidden_matrix(p) or float(saved.optimizer.state[q]["exp_avg"].abs().sum()) > 0
    main.refresh()
    opt.steps = 2
    for _ in range(2):
        reference.schedule.last_epoch += 1
        for g, peak in zip(opt.param_groups, reference.schedule.base_lrs):
            g["lr"] = peak * reference.schedule.lr_lambdas[0](reference.schedule.last_epoch)

    losses = {n: [float(r.loss) for b in batches[2:] for r in m.run(b)] for n, m in
              (("resumed", resumed), ("reference", reference), ("adamw", saved))}
    assert losses["resumed"] == losses["reference"], losses  # the same arithmetic: bit for bit
    assert losses["resumed"][1] != losses["adamw"][1]
