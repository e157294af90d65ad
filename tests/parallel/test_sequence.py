"""Sequence parallelism (`parallel.sequence_parallel=true`) equals one process in float64.

One spawned group of 4 ranks runs every job in turn: t=2 (with p=2, so the stages exchange sequence shards) and t=4,
each under every recomputation mode and with the fused kernels off and on, and t=2 under the interleaved and both
zero-bubble schedules and with data parallelism, and t=4 under FP8 with key/value heads replicated over the tp ranks
(one head on four ranks, two on two each: the QKV GEMM sums the shared heads' dY before quantising it). Each job is
one `forward_backward`; its loss, forward-only loss, gradient norm and every copy of every gradient (tensor-parallel
ranks included: a LayerNorm whose gradient were not summed over the tensor-parallel group would differ between them)
must equal the one-process run to 1e-10. A control job skips that sum and must be caught. With dropout on, the masks
of the sequence shards come from the tensor-parallel stream (the stage stream, shared by the tensor-parallel ranks,
is not drawn from), and recomputation replays them. The parameters and their checkpoint names do not depend on the
setting. One more job counts the products computed at the one GEMM path (mlplat.parallel.linear).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mlplat.checkpoint.state import full_parameters
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.linear import linear
from mlplat.parallel.mappings import reduce_scatter_to_sequence_parallel
from mlplat.parallel.random import STAGE_RNG
from tests.helpers import equivalence as eq
from tests.helpers.dist import run_distributed
from tests.helpers.gemms import CountingGemm, gemms_of, set_on_modules
from tests.helpers.kernels import eager_fused

TOL = 1e-10
MICRO = 2
SP = dict(sequence_parallel=True)
TP2_PP2 = dict(tp=2, pp=2, global_batch=6, **SP)  # 1f1b, m = 3
TP4 = dict(tp=4, global_batch=4, **SP)  # m = 2

# Every recomputation mode at each t, and the fused kernels off and on at each (each mode is proven with and without
# them across the two layouts).
GRADS = {
    **{f"tp2-pp2-{r}{'-fused' if f else ''}": dict(TP2_PP2, recompute=r, fused=f)
       for r, f in (("none", False), ("selective", True), ("full", False))},
    **{f"tp4-{r}{'-fused' if f else ''}": dict(TP4, recompute=r, fused=f)
       for r, f in (("none", True), ("selective", False), ("full", True))},
    "tp2-pp2v2-interleaved": dict(tp=2, pp=2, vpp=2, schedule="interleaved", global_batch=8, **SP),
    # Zero bubble: the gathered input of the column-parallel GEMMs waits in the W store.
    "tp2-pp2-zb_h1-selective-fused": dict(TP2_PP2, schedule="zb_h1", recompute="selective", fused=True),
    "tp2-pp2v2-zbv-full": dict(TP2_PP2, vpp=2, schedule="zbv", recompute="full"),
    "tp2-dp2": dict(tp=2, dp=2, global_batch=8, **SP),
    # FP8 with key/value heads replicated over the tp ranks: one head on all four, two heads on two ranks each
    "tp4-fp8-tensorwise-kv1": dict(TP4, fp8="tensorwise", model=dict(arch="llama", n_kv_heads=1)),
    "tp4-fp8-rowwise-kv2": dict(TP4, fp8="rowwise", model=dict(arch="llama", n_kv_heads=2)),
}
DROPOUT = {r: dict(TP2_PP2, recompute=r, dropout=0.1) for r in ("none", "selective", "full")}
SEAM = dict(TP2_PP2, schedule="zb_h1")  # every GEMM counted at the one GEMM path, the W split included


def _cfg(kw: dict):
    return eq.make_cfg(micro=MICRO, **kw)


def _grid(cfg) -> ParallelGrid:
    return eq.make_grid(cfg)


def _mappings(grid: ParallelGrid) -> dict[str, float]:
    """g + a column-parallel GEMM and ḡ against dense float64 twins: the largest error of this rank's slices of
    the outputs and of the gradients (input, weight, bias)."""
    gen = torch.Generator().manual_seed(7)  # the same draws on every rank: each knows the dense tensors
    t, r = grid.tp, grid.tp_rank
    b, s, h, o = 2, 8, 6, 4 * t
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    x, w, bias, dy = randn(b, s, h), randn(o, h), randn(o), randn(b, s, o)
    dense = [v.clone().requires_grad_() for v in (x, w, bias)]
    y_dense = F.linear(*dense)
    (y_dense * dy).sum().backward()
    rows, toks = slice(r * o // t, (r + 1) * o // t), slice(r * s // t, (r + 1) * s // t)
    mine = [v.clone().requires_grad_() for v in (x[:, toks], w[rows], bias[rows])]
    y = linear(*mine, sequence_gather=grid)
    (y * dy[..., rows]).sum().backward()
    err = lambda a, b: float((a - b).abs().max())  # noqa: E731
    out = {"g output": err(y, y_dense[..., rows]), "g input grad": err(mine[0].grad, dense[0].grad[:, toks]),
           "g weight grad": err(mine[1].grad, dense[1].grad[rows]),
           "g bias grad": err(mine[2].grad, dense[2].grad[rows])}
    partials, dz = [randn(b, s, h) for _ in range(t)], randn(b, s, h)
    p = partials[r].clone().requires_grad_()
    z = reduce_scatter_to_sequence_parallel(p, grid)
    (z * dz[:, toks]).sum().backward()
    out["ḡ output"] = err(z, sum(partials)[:, toks])
    out["ḡ input grad"] = err(p.grad, dz)
    return out


def _dropout_run(cfg, grid) -> dict:
    """One step with dropout: loss and gradients, and whether the stage stream (same on the tp ranks) moved."""
    module = eq.build_module(cfg, grid)
    tokens, labels = eq.local_batches(cfg, grid.dp_rank, 1)[0]
    before = module.tracker.get_states()[STAGE_RNG]["cpu"]
    loss, _ = module.forward_backward((tokens, labels))
    stage_moved = not torch.equal(before, module.tracker.get_states()[STAGE_RNG]["cpu"])
    grads, _ = eq.full_tensors(module, grid, "grad")
    return {"loss": float(loss), "grads": grads, "stage_moved": stage_moved}


def _parameters(cfg, grid) -> dict:
    """{checkpoint name: (shape, value)} of this rank's freshly built parameters."""
    module = eq.build_module(cfg, grid)
    return {name: p.detach().clone() for name, p in full_parameters(module.chunks).items()}


def _seam_run(cfg, grid) -> dict:
    """One step with a counting Gemm on every module that takes one: the products by kind, the products this
    rank's chunks should compute (three per GEMM and micro-batch), the loss and the gradients."""
    module = eq.build_module(cfg, grid)
    gemm = CountingGemm()
    for chunk in module.chunks.values():
        set_on_modules(chunk, "gemm", gemm)
    tokens, labels = eq.local_batches(cfg, grid.dp_rank, 1)[0]
    loss, _ = module.forward_backward((tokens, labels))
    grads, _ = eq.full_tensors(module, grid, "grad")
    per_kind = cfg.parallel.num_micro_batches * sum(gemms_of(c) for c in module.chunks.values())
    return {"loss": float(loss), "grads": grads, "calls": dict(gemm.calls), "per_kind": per_kind}


def _measurement():
    """experiments/activation_memory/measure.py, the activation-memory measurement (not a package)."""
    path = Path(__file__).resolve().parents[2] / "experiments" / "activation_memory" / "measure.py"
    spec = importlib.util.spec_from_file_location("activation_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _worker(rank: int, world_size: int) -> dict:
    out = {"mappings": {t: _mappings(ParallelGrid(tp=t, dp=world_size // t)) for t in (2, 4)}}
    for name, kw in GRADS.items():
        cfg = _cfg(kw)
        grid = _grid(cfg)
        with eager_fused(), eq.sent_bytes() as sent:
            out[name] = eq.grads_run(cfg, grid, logits=cfg.parallel.pp == cfg.parallel.dp == 1)
        out[name]["sent"] = sent
        eq.barrier()
    cfg = _cfg(TP2_PP2)
    out["control"] = eq.grads_run_without_tp_sum(cfg, _grid(cfg))
    for recompute, kw in DROPOUT.items():
        cfg = _cfg(kw)
        out[f"dropout-{recompute}"] = _dropout_run(cfg, _grid(cfg))
    cfg = _cfg(dict(TP2_PP2, sequence_parallel=False, dropout=0.1))
    grid = _grid(cfg)
    out["dropout-no-sp"] = _dropout_run(cfg, grid)
    out["params-sp"] = _parameters(_cfg(TP2_PP2), grid)
    out["params-no-sp"] = _parameters(cfg, grid)
    cfg = _cfg(SEAM)
    out["seam"] = _seam_run(cfg, _grid(cfg))
    out["activation_bytes"] = _measurement()._worker(rank, world_size, "bfloat16")
    return out


_RESULTS: list = []


def _results() -> list[dict]:
    """The one 4-rank launch every test here reads; a failure is kept too, so that each test reports it at once
    instead of launching again."""
    if not _RESULTS:
        try:
            _RESULTS.append(run_distributed(_worker, 4, timeout=600))
        except Exception as e:  # noqa: BLE001 - re-raised by every test that needs the results
            _RESULTS.append(e)
    if isinstance(_RESULTS[0], Exception):
        raise _RESULTS[0]
    return _RESULTS[0]


def _close(a, b, what: str) -> None:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=lambda m: f"{what}: {m}")


def test_mappings_equal_dense():
    """The all-gather + column-parallel GEMM (g) and the reduce-scatter (ḡ), forward and backward, at t = 2, 4."""
    for res in _results():
        for t, errors in res["mappings"].items():
            assert max(errors.values()) < 1e-12, (t, errors)


@pytest.mark.parametrize("name", list(GRADS))
def test_sequence_parallel_step_equals_one_process(name):
    ref = eq.reference(_cfg(GRADS[name]), "grads")
    results = [r[name] for r in _results()]
    for rank, res in enumerate(results):
        _close(res["loss"], ref["loss"], f"{name}: loss on rank {rank}")
        _close(res["val_loss"], ref["loss"], f"{name}: forward-only loss on rank {rank}")
        _close(res["norm"], ref["norm"], f"{name}: grad norm on rank {rank}")
        assert res["grad_pad"] == 0.0
        if "logits" in res:
            _close(res["logits"], ref["logits"], f"{name}: logits on rank {rank}")
    merged = eq.merge(results, "grads")
    assert set(merged) == set(ref["grads"])
    for param, copies in merged.items():
        for t in copies:
            _close(t, ref["grads"][param], f"{name}: grad {param}")


def test_every_gemm_goes_through_the_one_linear_path():
    """t = 2 with sequence parallelism, p = 2 under zb_h1: each rank's forward, input-gradient and weight-gradient
    products (the sequence-gathered GEMMs', the row-parallel ones', the logits') are all computed by the GEMM set on
    the layers, three per GEMM and micro-batch, and the step still equals one process."""
    ref = eq.reference(_cfg(SEAM), "grads")
    results = [r["seam"] for r in _results()]
    for rank, res in enumerate(results):
        n = res["per_kind"]
        assert res["calls"] == {"forward": n, "input_grad": n, "weight_grad": n}, (rank, res["calls"])
        _close(res["loss"], ref["loss"], f"seam: loss on rank {rank}")
    for param, copies in eq.merge(results, "grads").items():
        for t in copies:
            _close(t, ref["grads"][param], f"seam: grad {param}")


def test_stages_exchange_sequence_shards():
    """With p > 1 the stage-to-stage message is this rank's sequence shard [b, s/t, h], sent whole: every send
    carries b·(s/t)·h float64 values, 1/t of the activation (what scatter/gather would send, and it is off), and a
    step sends m of them each way (plus m activations in the forward-only pass)."""
    cfg = _cfg(TP2_PP2)
    m, t = cfg.parallel.num_micro_batches, cfg.parallel.tp
    shard = MICRO * (cfg.model.seq_len // t) * cfg.model.hidden * torch.finfo(torch.float64).bits // 8
    for res in _results():
        run = res["tp2-pp2-none"]
        assert run["scatter_gather"] is False
        first_stage = len(run["sent"]) == 2 * m  # activations of the forward-only pass and of the step
        assert len(run["sent"]) == (2 * m if first_stage else m), run["sent"]
        assert set(run["sent"]) == {shard}, (run["sent"], shard)
    assert sum(len(r["tp2-pp2-none"]["sent"]) for r in _results()) == 2 * (2 * m + m)  # two pipelines of two


def test_unsummed_layernorm_gradients_are_caught():
    """Without the tp all-reduce of the sequence-parallel parameters' gradients, the loss is still right but
    the LayerNorm gradients (each rank's tokens only) are not: the equivalence above would fail."""
    ref = eq.reference(_cfg(TP2_PP2), "grads")
    results = _results()
    for res in results:
        _close(res["control"]["loss"], ref["loss"], "control loss")
    worst = max(float((t - ref["grads"][name]).abs().max())
                for name, copies in eq.merge([r["control"] for r in results], "grads").items()
                if name.endswith(("ln1.weight", "ln2.bias", "final_ln.weight")) for t in copies)
    assert worst > 1e-4, worst


def test_dropout_masks_of_shards_come_from_the_tensor_parallel_stream():
    """Dropout 0.1: every recomputation mode gives the same step (the shards' masks are replayed), the masks
    acted, and only without sequence parallelism is the stage stream (shared by the tp ranks) drawn from."""
    results = _results()
    for res in results:
        base = res["dropout-none"]
        for recompute in ("selective", "full"):
            other = res[f"dropout-{recompute}"]
            _close(other["loss"], base["loss"], f"dropout loss, recompute={recompute}")
            for name, g in other["grads"].items():
                _close(g, base["grads"][name], f"dropout grad {name}, recompute={recompute}")
        assert abs(base["loss"] - res["tp2-pp2-none"]["loss"]) > 1e-4, "dropout did not act"
        assert not base["stage_moved"] and res["dropout-no-sp"]["stage_moved"]


def test_parameters_and_checkpoint_names_do_not_depend_on_sequence_parallelism():
    for res in _results():
        sp, plain = res["params-sp"], res["params-no-sp"]
        assert list(sp) == list(plain)
        for name in sp:
            assert torch.equal(sp[name], plain[name]), name


def test_saved_activation_bytes_match_korthikanti():
    """Bytes saved for backward per layer (saved_tensors_hooks, distinct storages, parameters excluded) for
    recompute none/selective/full × sequence parallelism off/on × t = 1, 2, 4, in bfloat16 with dropout on: within
    5% of Korthikanti et al.'s formulas with the CPU's 2-byte dropout masks (experiments/activation_memory/)."""
    m = _measurement()
    s, b, h, a = (m.SHAPE[k] for k in ("seq_len", "micro_batch", "hidden", "n_heads"))
    measured = _results()[0]["activation_bytes"]  # rank 0: tp rank 0 in every grid (the ranks of a group agree)
    assert len(measured) == 15
    for (t, sp, recompute), got in measured.items():
        want = m.formula_bytes(recompute, t, sp, s=s, b=b, h=h, a=a, mask_bytes=2)
        assert abs(got / want - 1) < 0.05, (t, sp, recompute, got, want)
    # Sequence parallelism keeps 1/t of the unsplit layer; tensor parallelism alone keeps its 10·sbh whatever t.
    for recompute in m.RECOMPUTE:
        assert measured[(4, True, recompute)] == pytest.approx(measured[(1, False, recompute)] / 4, rel=0.01)
