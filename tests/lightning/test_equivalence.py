"""Proofs that parallel == one process: tensor, pipeline (GPipe, 1F1B, interleaved) and data parallelism, and
their 3D composition, give the single-process run's logits, loss, gradients, gradient norm and — after several
AdamW steps — parameters, in float64 on gloo, to ~1e-10.

The reference is the same RunConfig at tp=pp=dp=1, computed in this (the pytest) process; the parallel runs
happen in one spawned group per world size (2, 4, 8) that runs every layout of that size in turn (a
ParallelGrid needs world == tp·pp·dp, and all four 3D layouts have 8 ranks). Every rank brings its parameters
and gradients back as full tensors (gathered over tp, vocabulary padding cut off, the last stage's tied copy of
the word embedding under its full name); every copy of a parameter (tp ranks, dp replicas, tied copies) must
equal the reference.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from tests.helpers import equivalence as eq
from tests.helpers.dist import run_distributed
from tests.helpers.kernels import eager_fused

TOL = 1e-10        # one step: loss, logits, gradients, gradient norm
TOL_TRAIN = 1e-9   # after TRAIN_STEPS AdamW steps


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    return float((a - b).abs().max()) if a.numel() else 0.0


_WORST: dict[str, float] = {}  # largest |parallel - reference| per quantity, printed at the end (pytest -s)


def _assert_close(a, b, tol, what, key=None):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    key = key or what.split(" on ")[0]
    _WORST[key] = max(_WORST.get(key, 0.0), _max_diff(a, b))
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module", autouse=True)
def _report_worst():
    yield
    for key, value in sorted(_WORST.items()):
        print(f"\nmax |diff| {key}: {value:.3g}", end="")


def _assert_copies(merged: dict, ref: dict, tol: float, what: str) -> None:
    """Every name of the reference is held by some rank, and every copy equals the reference."""
    assert set(merged) == set(ref), f"{what}: names differ: {sorted(set(merged) ^ set(ref))}"
    for name, copies in merged.items():
        for t in copies:
            _assert_close(t, ref[name], tol, f"{what} {name}", key=what)


# ======================================================================================= jobs
# name -> (kind, layout kwargs for make_cfg, run options). Kinds: "grads" (one forward_backward), "train" (TRAIN_STEPS
# AdamW steps), "reducer" (one step with the data-parallel reducer instrumented).

# p -> [(schedule, v, m)] with m valid for the schedule (interleaved: v >= 2, m % p == 0); zbv at p = 4, m = 9 ends
# in a partial round of one micro-batch, whose forwards alternate with ready backwards (zero_bubble.py)
PIPELINE_CASES = {
    2: [("gpipe", 1, 1), ("gpipe", 1, 3), ("gpipe", 1, 4), ("1f1b", 1, 1), ("1f1b", 1, 3), ("1f1b", 1, 4),
        ("interleaved", 2, 2), ("interleaved", 2, 4), ("interleaved", 2, 6), ("zb_h1", 1, 1), ("zb_h1", 1, 4),
        ("zb_h2", 1, 1), ("zb_h2", 1, 4), ("zbv", 2, 1), ("zbv", 2, 4), ("v_half", 2, 1), ("v_half", 2, 4)],
    4: [("gpipe", 1, 2), ("gpipe", 1, 5), ("1f1b", 1, 1), ("1f1b", 1, 2), ("1f1b", 1, 5),
        ("interleaved", 2, 4), ("interleaved", 2, 8), ("zb_h1", 1, 2), ("zb_h1", 1, 8),
        ("zb_h2", 1, 1), ("zb_h2", 1, 7), ("zb_h2", 1, 16), ("zbv", 2, 3), ("zbv", 2, 9),
        ("v_half", 2, 1), ("v_half", 2, 3), ("v_half", 2, 16)],
}
MICRO = 2


def _pipeline_jobs(p: int) -> dict:
    return {f"pp{p}-{s}-v{v}-m{m}": ("grads", dict(pp=p, vpp=v, schedule=s, global_batch=MICRO * m), {})
            for s, v, m in PIPELINE_CASES[p]}


TRAIN_LAYOUTS = {  # the 3D layouts of 8 ranks; global batch 16, micro-batch 2
    "tp2-pp2v2-dp2": dict(tp=2, pp=2, vpp=2, dp=2, schedule="interleaved"),
    "tp1-pp4v2-dp2": dict(tp=1, pp=4, vpp=2, dp=2, schedule="interleaved"),
    "tp4-pp2-dp1": dict(tp=4, pp=2, dp=1, schedule="1f1b"),
    "tp2-pp1-dp4": dict(tp=2, pp=1, dp=4, schedule="1f1b"),
    "tp2-pp2-dp2-zb_h1": dict(tp=2, pp=2, dp=2, schedule="zb_h1"),
}
TRAIN_STEPS = 3
# Optimizer post-validation (step first, check after, redo a rejected step), with torch's AdamW and with the
# distributed optimizer (its all-gathers in flight when a step is redone). Clipping step 0 only: step 0 steps first
# and is redone, step 1 (after a clipped step) is synchronous, step 2 steps first and stands.
POST_VALIDATED = {
    "tp2-pp2v2-dp2-post-validate": dict(TRAIN_LAYOUTS["tp2-pp2v2-dp2"], post_validate=True, grad_clip=0.6),
    "pp4v2-dp2-zbv-distributed-post-validate": dict(pp=4, vpp=2, dp=2, schedule="zbv", distributed=True,
                                                    post_validate=True, grad_clip=0.6),
}
TRAIN = dict(global_batch=16, grad_clip=0.43, lr=1e-2, steps=TRAIN_STEPS)  # clips steps 0 and 1 only

# Fewer key/value heads than tp ranks: the heads replicated on the ranks sharing them (multi-query at t2, with a
# bias on QKV as Qwen2's; two heads at t4 with sequence parallelism).
MQA = dict(arch="llama", n_kv_heads=1, qkv_bias=True)
GQA2 = dict(arch="llama", n_kv_heads=2)
# Heads wider than hidden/heads (model.head_dim, Qwen3's): a·d = 48 at h = 32, with the q and k norms over d.
WIDE_HEADS = dict(arch="llama", n_kv_heads=2, qk_norm=True, head_dim=12)

TEN_LAYERS = dict(n_layers=10)
SMALL_BUCKET = 16 * 1024  # bytes: several buckets per chunk (a layer of the tiny model holds ~100 KiB)

JOBS = {
    2: {
        "tp2": ("grads", dict(tp=2), {"logits": True}),
        "tp2-mqa": ("grads", dict(tp=2, model=MQA), {"logits": True}),
        "tp2-wide-heads": ("grads", dict(tp=2, model=WIDE_HEADS), {"logits": True}),
        "train-tp2-mqa": ("train", dict(tp=2, model=MQA, **TRAIN), {}),
        **_pipeline_jobs(2),
        "pp2-1f1b-m4-full-recompute": ("grads", dict(pp=2, global_batch=8, recompute="full"), {}),
        "dp2-overlap": ("reducer", dict(dp=2, global_batch=8), {"overlap": True}),
        "dp2-overlap-small-buckets": ("reducer", dict(dp=2, global_batch=8),
                                      {"overlap": True, "bucket_bytes": SMALL_BUCKET}),
        "dp2-no-overlap": ("reducer", dict(dp=2, global_batch=8), {"overlap": False}),
        # Full recomputation runs each layer's backward as a nested backward: the reducer's hooks fire inside it.
        "dp2-full-recompute-overlap": ("reducer", dict(dp=2, global_batch=8, recompute="full"), {"overlap": True}),
    },
    4: {
        "tp4": ("grads", dict(tp=4), {"logits": True}),
        "tp4-sp-gqa2": ("grads", dict(tp=4, sequence_parallel=True, model=GQA2), {"logits": True}),
        # the distributed optimizer: the key/value head's gradient summed over the kv group on each dp shard
        "train-tp2-dp2-mqa-distributed": ("train", dict(tp=2, dp=2, distributed=True, model=MQA, **TRAIN), {}),
        **_pipeline_jobs(4),
        **{f"tp2-pp2-{s}-v{v}-sg{int(sg)}": ("grads", dict(tp=2, pp=2, vpp=v, schedule=s, scatter_gather=sg,
                                                           global_batch=MICRO * m), {})
           for sg in (True, False) for s, v, m in (("1f1b", 1, 3), ("interleaved", 2, 4))},
        # Uneven stages (parallel.first_stage_layers / last_stage_layers): m = 1 through 1F1B's [1, 3, 3, 1]; ten
        # layers with m >> p through the V ([1 x7, 3]: both ends on rank 0), interleaving ([2, 1 x6, 2]) and
        # V-Half ([3, 1 x7]).
        "pp4-1f1b-m1-uneven": ("grads", dict(pp=4, global_batch=MICRO, first_stage_layers=1, last_stage_layers=1),
                               {}),
        "pp4-zbv-m16-uneven": ("grads", dict(pp=4, vpp=2, schedule="zbv", global_batch=MICRO * 16, first_stage_layers=1,
                                             last_stage_layers=3, model=TEN_LAYERS), {}),
        "pp4-interleaved-m8-uneven": ("grads", dict(pp=4, vpp=2, schedule="interleaved", global_batch=MICRO * 8,
                                                    first_stage_layers=2, last_stage_layers=2, model=TEN_LAYERS), {}),
        "pp4-v_half-m4-uneven": ("grads", dict(pp=4, vpp=2, schedule="v_half", global_batch=MICRO * 4,
                                               first_stage_layers=3, model=TEN_LAYERS), {}),
        # and the other schedules: GPipe over [2, 2, 2, 4], ZB-H1 over [1, 3, 3, 3], ZB-H2 over [1, 3, 3, 1]
        "pp4-gpipe-m5-uneven": ("grads", dict(pp=4, schedule="gpipe", global_batch=MICRO * 5, last_stage_layers=4,
                                              model=TEN_LAYERS), {}),
        "pp4-zb_h1-m8-uneven": ("grads", dict(pp=4, schedule="zb_h1", global_batch=MICRO * 8, first_stage_layers=1,
                                              model=TEN_LAYERS), {}),
        "pp4-zb_h2-m7-uneven": ("grads", dict(pp=4, schedule="zb_h2", global_batch=MICRO * 7, first_stage_layers=1,
                                              last_stage_layers=1), {}),
        "tp2-pp2-1f1b-m3-selective-recompute": ("grads", dict(tp=2, pp=2, global_batch=6, recompute="selective"),
                                                {}),
        "tp2-pp2-1f1b-m3-fused-kernels": ("grads", dict(tp=2, pp=2, global_batch=6, fused=True), {}),
        # Zero bubble: the deferred weight GEMMs under tensor parallelism, recomputation and the fused kernels.
        "tp2-pp2-zb_h1-m3-selective-fused": ("grads", dict(tp=2, pp=2, schedule="zb_h1", global_batch=6,
                                                           recompute="selective", fused=True), {}),
        "tp2-pp2v2-zbv-m3-full-recompute": ("grads", dict(tp=2, pp=2, vpp=2, schedule="zbv", global_batch=6,
                                                          recompute="full"), {}),
        "tp2-pp2v2-v_half-m4-selective-fused": ("grads", dict(tp=2, pp=2, vpp=2, schedule="v_half", global_batch=8,
                                                              recompute="selective", fused=True), {}),
        # The reducer's "chunk final" moment at the chunk's last W: small buckets, overlap on.
        "pp2v2-dp2-zbv-overlap-small-buckets": ("reducer", dict(pp=2, vpp=2, dp=2, schedule="zbv", global_batch=8),
                                                {"overlap": True, "bucket_bytes": SMALL_BUCKET}),
        "pp2-dp2-zb_h1-overlap": ("reducer", dict(pp=2, dp=2, schedule="zb_h1", global_batch=8), {"overlap": True}),
        "pp2v2-dp2-overlap": ("reducer", dict(pp=2, vpp=2, dp=2, schedule="interleaved", global_batch=8),
                              {"overlap": True}),
        "pp2v2-dp2-overlap-small-buckets": ("reducer", dict(pp=2, vpp=2, dp=2, schedule="interleaved",
                                                            global_batch=8),
                                            {"overlap": True, "bucket_bytes": SMALL_BUCKET}),
        "pp2v2-dp2-no-overlap": ("reducer", dict(pp=2, vpp=2, dp=2, schedule="interleaved", global_batch=8),
                                 {"overlap": False}),
    },
    8: {
        **{f"grads-{name}": ("grads", dict(layout, global_batch=16), {}) for name, layout in TRAIN_LAYOUTS.items()},
        **{f"train-{name}": ("train", dict(layout, **TRAIN), {}) for name, layout in TRAIN_LAYOUTS.items()},
        **{f"train-{name}": ("train", dict(TRAIN, **layout), {}) for name, layout in POST_VALIDATED.items()},
    },
}


def _cfg(kw: dict):
    return eq.make_cfg(micro=MICRO, **kw)


def _reducer_run(cfg, grid, overlap: bool, bucket_bytes: int | None = None) -> dict:
    """One step with the data-parallel reducer instrumented: the engine's before_backward calls, each bucket
    launch and the call of `finish()` are logged in the order they happen."""
    module = eq.build_module(cfg, grid, overlap=overlap, bucket_bytes=bucket_bytes)
    dpg, engine = module.grads, module.engine
    events: list[tuple] = []
    before_backward, launch, finish = engine.before_backward, dpg._launch, dpg.finish

    def logged_before_backward(chunk, micro_batch, is_last):
        events.append(("B", chunk, micro_batch, is_last))
        before_backward(chunk, micro_batch, is_last)

    def logged_launch(i):
        events.append(("launch", i, dpg.chunk_of[id(dpg.buckets[i][0])]))
        launch(i)

    def logged_finish():
        events.append(("finish",))
        finish()

    engine.before_backward, dpg._launch, dpg.finish = logged_before_backward, logged_launch, logged_finish
    tokens, labels = eq.local_batches(cfg, grid.dp_rank, 1)[0]
    loss, norm = module.forward_backward((tokens, labels))
    grads, pad = eq.full_tensors(module, grid, "grad")
    return {"loss": float(loss), "norm": float(norm), "grads": grads, "grad_pad": pad, "events": events,
            "n_buckets": len(dpg.buckets), "n_chunks": len(module.chunks),
            "m": cfg.parallel.num_micro_batches}




def _worker(rank: int, world_size: int) -> dict:
    with eager_fused():
        return _jobs(world_size)


def _jobs(world_size: int) -> dict:
    out = {}
    for name, (kind, kw, opts) in JOBS[world_size].items():
        cfg = _cfg(kw)
        grid = eq.make_grid(cfg)
        if kind == "grads":
            with eq.sent_bytes() as sent:
                res = eq.grads_run(cfg, grid, **opts)
            res["sent"] = sent
        elif kind == "reducer":
            res = _reducer_run(cfg, grid, **opts)
        else:
            res = eq.train_run(cfg, grid, TRAIN_STEPS)
        res["coords"] = (grid.tp_rank, grid.pp_rank, grid.dp_rank)
        out[name] = res
        eq.barrier()
    return out


_WORLDS: dict[int, list | BaseException] = {}


def _world(n: int) -> list[dict]:
    """The results of world n, spawned once; a failed spawn is remembered, not retried by every test."""
    if n not in _WORLDS:
        try:
            _WORLDS[n] = run_distributed(_worker, n, timeout=480)
        except Exception as err:  # noqa: BLE001 - re-raised for every test that needs this world
            _WORLDS[n] = err
    if isinstance(_WORLDS[n], BaseException):
        raise _WORLDS[n]
    return _WORLDS[n]


def _results(name: str) -> tuple[str, dict, list[dict]]:
    n = next(w for w, jobs in JOBS.items() if name in jobs)
    kind, kw, _ = JOBS[n][name]
    return kind, kw, [r[name] for r in _world(n)]


def _ids(world: int, kind: str | tuple) -> list[str]:
    kinds = (kind,) if isinstance(kind, str) else kind
    return [name for name, job in JOBS[world].items() if job[0] in kinds]


ALL_GRADS = [n for w in JOBS for n in _ids(w, ("grads", "reducer"))]


# ======================================================================================= the reference itself


def test_reference_is_plain_autograd():
    """The tp=pp=dp=1 forward_backward equals a plain loop: mean of the micro-batch losses, one backward."""
    ref = eq.reference(_cfg(dict(global_batch=8)), "grads")
    _assert_close(ref["loss"], ref["plain_loss"], TOL, "reference vs plain autograd: loss")
    for name, g in ref["plain_grads"].items():
        _assert_close(ref["grads"][name], g, TOL, f"reference vs plain autograd: grad {name}",
                      key="reference vs plain autograd: grads")
    _assert_close(ref["norm"], ref["torch_norm"], TOL, "reference grad norm vs torch")
    assert ref["grad_pad"] == 0.0


# ======================================================================================= one step: loss, grads, norm


@pytest.mark.parametrize("name", ALL_GRADS)
def test_one_step_equals_one_process(name):
    """Loss (on every rank), every parameter's gradient (every copy, full tensors), vocabulary padding gradient
    zero, and the global gradient norm (each parameter counted once) equal the single-process run."""
    kind, kw, results = _results(name)
    ref = eq.reference(_cfg(kw), "grads")
    for res in results:
        _assert_close(res["loss"], ref["loss"], TOL, f"one-step loss on rank {res['coords']}")
        if "val_loss" in res:
            _assert_close(res["val_loss"], ref["loss"], TOL, f"forward-only loss on rank {res['coords']}")
        _assert_close(res["norm"], ref["norm"], TOL, f"one-step grad norm on rank {res['coords']}")
        assert res["grad_pad"] == 0.0, f"padding rows of the word embedding got gradient {res['grad_pad']}"
    _assert_copies(eq.merge(results, "grads"), ref["grads"], TOL, "one-step grads")


@pytest.mark.parametrize("name", ["tp2", "tp4", "tp2-mqa", "tp4-sp-gqa2", "tp2-wide-heads"])
def test_tensor_parallel_logits(name):
    """The whole GPT's logits at tp=2/4 (and the Llama's with fewer key/value heads than tp ranks, and with heads
    wider than hidden/heads), gathered over the vocabulary shards, equal tp=1."""
    _, kw, results = _results(name)
    ref = eq.reference(_cfg(kw), "grads")
    for res in results:
        _assert_close(res["logits"], ref["logits"], TOL, f"logits on rank {res['coords']}")


@pytest.mark.parametrize("name", [n for w in JOBS for n in _ids(w, "grads")])
def test_grad_norm_counts_each_parameter_once(name):
    """grad_norm equals torch's total norm of the single process's gradients and the norm of the gathered full
    gradients (LayerNorms replicated over tp and the embedding tied across stages counted once)."""
    _, kw, results = _results(name)
    ref = eq.reference(_cfg(kw), "grads")
    full = {n: copies[0] for n, copies in eq.merge(results, "grads").items()}
    from_full = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in full.values()])))
    for res in results:
        _assert_close(res["norm"], ref["torch_norm"], TOL, "grad norm vs torch.nn.utils.get_total_norm")
        _assert_close(res["norm"], from_full, TOL, "grad norm vs norm of gathered gradients")


def test_tied_embedding_on_two_stages():
    """With pp > 1 the word embedding is held by the first and (as lm_head) the last stage; after
    reduce_tied_grads both copies carry the full single-process gradient."""
    for name in ("pp2-1f1b-v1-m3", "pp4-interleaved-v2-m4", "tp2-pp2-interleaved-v2-sg1"):
        _, kw, results = _results(name)
        ref = eq.reference(_cfg(kw), "grads")["grads"][eq.WORD_EMBEDDING]
        holders = [r for r in results if eq.WORD_EMBEDDING in r["grads"]]
        assert {r["coords"][1] for r in holders} == {0, kw["pp"] - 1}
        for r in holders:
            _assert_close(r["grads"][eq.WORD_EMBEDDING], ref, TOL, f"tied embedding grad on {r['coords']} ({name})")


@pytest.mark.parametrize("sg", [True, False])
def test_scatter_gather_setting_reaches_the_wire(sg):
    """parallel.scatter_gather decides whether stages exchange 1/t slices (checked equal above either way): every
    send carries b·s·h/t float64 values with it and b·s·h without, and the other setting sends as many messages
    of t times (or 1/t of) the bytes."""
    for name in (f"tp2-pp2-1f1b-v1-sg{int(sg)}", f"tp2-pp2-interleaved-v2-sg{int(sg)}"):
        _, kw, results = _results(name)
        _, _, others = _results(name.replace(f"sg{int(sg)}", f"sg{int(not sg)}"))
        cfg = _cfg(kw)
        t = cfg.parallel.tp
        full = MICRO * cfg.model.seq_len * cfg.model.hidden * torch.finfo(torch.float64).bits // 8
        for res, other in zip(results, others):
            assert res["scatter_gather"] is sg
            assert res["sent"] and set(res["sent"]) == {full // t if sg else full}, (name, res["sent"])
            assert len(res["sent"]) == len(other["sent"])
            assert sum(res["sent"]) * (t if sg else 1) == sum(other["sent"]) * (1 if sg else t)


# ======================================================================================= data-parallel reducer


REDUCER_GROUPS = {
    "dp2": ["dp2-overlap", "dp2-overlap-small-buckets", "dp2-no-overlap"],
    "pp2v2-dp2": ["pp2v2-dp2-overlap", "pp2v2-dp2-overlap-small-buckets", "pp2v2-dp2-no-overlap"],
}


@pytest.mark.parametrize("group", list(REDUCER_GROUPS))
def test_reducer_overlap_does_not_change_grads(group):
    """Overlapped (one or several buckets per chunk) and non-overlapped reductions give identical gradients."""
    runs = [_results(n)[2] for n in REDUCER_GROUPS[group]]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a["coords"] == b["coords"]
            for name in a["grads"]:
                assert torch.equal(a["grads"][name], b["grads"][name]), f"{group}: {name} differs"


@pytest.mark.parametrize("name", [n for w in JOBS for n in _ids(w, "reducer")])
def test_reducer_launch_timing(name):
    """With overlap, every bucket is all-reduced during the backward of its chunk's last micro-batch (so all are
    in flight before finish()), in the same bucket order on every rank; nothing is reduced for earlier
    micro-batches. Without overlap, everything is launched by finish(). Zero-bubble schedules (split backward):
    the B's flag nothing, and the chunk's last W flags it final (one more call, after its last B)."""
    _, _, results = _results(name)
    overlap = "no-overlap" not in name
    split = "zb" in name
    for res in results:
        events, n_buckets = res["events"], res["n_buckets"]
        launches = [e for e in events if e[0] == "launch"]
        assert [e[1] for e in launches] == list(range(n_buckets))
        finish_at = events.index(("finish",))
        assert all(e[0] != "B" for e in events[finish_at:])
        if "small-buckets" in name:
            assert n_buckets > res["n_chunks"], "small buckets should split each chunk"
        if not overlap:
            assert all(events.index(e) > finish_at for e in launches)
            continue
        assert all(events.index(e) < finish_at for e in launches), "a bucket waited for finish()"
        backwards = [e for e in events if e[0] == "B"]
        for chunk in {e[1] for e in backwards}:
            mine = [e for e in backwards if e[1] == chunk]
            # The engine flags exactly the chunk's m-th (last) backward, which is micro-batch m-1 (with a split
            # backward: m unflagged B's, then the last W's flag).
            flags = [False] * (res["m"] - int(not split)) + [True]
            assert len(mine) == len(flags) and [e[3] for e in mine] == flags
            assert mine[-1][2] == res["m"] - 1
        current, final = None, set()
        for e in events[:finish_at]:
            if e[0] == "B":
                current = e
                if e[3]:
                    final.add(e[1])
            elif split:  # launched in bucket order: after its own chunk turned final, maybe with a later one
                assert e[2] in final, f"bucket {e[1]} of chunk {e[2]} launched before its chunk's last W"
            else:  # a launch: it must happen inside the last backward of the bucket's own chunk
                assert current is not None and current[1] == e[2] and current[3], (
                    f"bucket {e[1]} of chunk {e[2]} launched during backward {current}, "
                    "not during its chunk's last micro-batch")


# ======================================================================================= 3D equals 1D


@pytest.mark.parametrize("name", [*TRAIN_LAYOUTS, *POST_VALIDATED])
def test_3d_training_equals_one_process(name):
    """Three AdamW steps (LambdaLR warm-up and decay, global-norm clipping active in some steps) on data split
    across dp ranks by DataParallelSampler: per-step loss, grad norm, learning rate and the final full parameters (every
    copy: tp ranks, dp replicas, the tied embedding on the last stage) equal the single-process run. Post-validated
    runs (step first, read the checks after, redo a clipped step; after one, a synchronous step) equal the
    synchronous one-process run too, on every rank through the same branches."""
    _, kw, results = _results(f"train-{name}")
    ref = eq.reference(_cfg(kw), "train")
    clipped = [n > kw["grad_clip"] for n in ref["norms"]]
    assert any(clipped) and not all(clipped), f"grad_clip should clip in some steps only: norms {ref['norms']}"
    post = kw.get("post_validate", False)
    eager = [post and not before for before in [False, *clipped[:-1]]]  # after a clipped step: synchronous
    redone = list(itertools.accumulate(e and c for e, c in zip(eager, clipped)))
    if post:
        assert eager == [True, False, True] and redone == [1, 1, 1], "a redone step and a standing one"
    for res in results:
        assert res["eager"] == eager and res["redone"] == redone, (res["coords"], res["eager"], res["redone"])
        _assert_close(res["losses"], ref["losses"], TOL_TRAIN, f"3D losses on rank {res['coords']}")
        _assert_close(res["norms"], ref["norms"], TOL_TRAIN, f"3D grad norms on rank {res['coords']}")
        _assert_close(res["lrs"], ref["lrs"], 0.0, "learning rates")
        assert res["param_pad"] == 0.0, "padding rows of the word embedding moved"
    _assert_copies(eq.merge(results, "params"), ref["params"], TOL_TRAIN, f"params after {TRAIN_STEPS} AdamW steps")


@pytest.mark.parametrize("name", ["train-tp2-mqa", "train-tp2-dp2-mqa-distributed"])
def test_replicated_kv_heads_train_as_one_process(name):
    """Multi-query attention at t2 (the key/value head, with its QKV bias, on both ranks; with the distributed
    optimizer over d2 too): three AdamW steps equal the one-process run, and every rank's copy of the shared rows
    stays bit-identical (one parameter of the full model: same initialisation, summed gradients, same update)."""
    _, kw, results = _results(name)
    ref = eq.reference(_cfg(kw), "train")
    for res in results:
        _assert_close(res["losses"], ref["losses"], TOL_TRAIN, f"MQA losses on rank {res['coords']}")
        _assert_close(res["norms"], ref["norms"], TOL_TRAIN, f"MQA grad norms on rank {res['coords']}")
    _assert_copies(eq.merge(results, "params"), ref["params"], TOL_TRAIN, "MQA params after AdamW steps")
    first = results[0]["shared_rows"]
    assert len(first) == 2 * eq.MODEL["n_layers"]  # the QKV weight and bias of each layer
    for res in results[1:]:
        assert res["shared_rows"].keys() == first.keys()
        for n in first:
            assert first[n].numel() and torch.equal(res["shared_rows"][n], first[n]), f"{n} differs on {res['coords']}"
