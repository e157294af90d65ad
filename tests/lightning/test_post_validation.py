"""Optimizer post-validation (`optim.post_validate=true`, mlplat.step.post_validation) against the synchronous
step, in the same processes.

16-megatron (fp16 weights, fp32 main weights and moments, dynamic loss scaling) with the distributed optimizer
under pp2·dp2, dropout 0.1, five steps: step 1 is clipped, step 3 overflows on one rank only (an inf put into the
gradients of dp rank 1, pp rank 0 after their reduction), steps 2, 4 and 5 stand. The post-validated run steps
first and reads the checks after the next pass: it redoes step 1 on the clipped gradients and undoes step 3 (its
all-gathers were in flight), and runs passes 2 and 4 again from their RNG states; steps 2 and 4, after a rejected
step, are synchronous, and step 5 steps first and stands. It ends
bit-identical to the synchronous run on every rank: losses, norms, learning rates, the fp16 weights after every
step, the main weights and moments, the step count and the loss scaler.

The float64 proofs against one process are the 8-rank training jobs of tests/lightning/test_equivalence.py
(torch's AdamW under t2·p2(v2)·d2, the distributed optimizer under p4 zbv·d2) and a CLI run of
tests/cli/test_train.py; Lightning's count of a skipped step is tests/lightning/test_precision.py's.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from mlplat.optim.loss_scale import DynamicLossScaler
from mlplat.parallel.grid import ParallelGrid
from mlplat.step import TrainStep
from tests.helpers.dist import run_distributed
from tests.helpers.equivalence import local_batches, make_cfg

STEPS = 5
CLIP = 1.0  # above step 1's gradient norm only (1.67; then 0.73, 0.53, ...)
OVERFLOW_STEP = 3


def _run(grid: ParallelGrid, post_validate: bool) -> dict:
    cfg = make_cfg(pp=2, dp=2, grad_clip=CLIP, lr=1e-2, global_batch=8, distributed=True,
                   post_validate=post_validate, dropout=0.1)
    cfg.trainer.precision = "16-megatron"
    module = TrainStep(cfg, grid)
    opt = module.optimizer
    scaler = module.loss_scaler = DynamicLossScaler(init_scale=2.0**10)
    grads, step = module.grads, [0]
    reduce = grads.reduce_sequence_parallel

    def reduce_then_overflow():  # the last reduction before the checks: an inf on one rank of the four
        reduce()
        if step[0] == OVERFLOW_STEP and (grid.dp_rank, grid.pp_rank) == (1, 0):
            grads.buckets[0].grad[0] = float("inf")

    grads.reduce_sequence_parallel = reduce_then_overflow
    weights = {}  # step -> the weights once the step is final (settled), captured as its record is made

    def settled(record):
        grads.wait()
        weights[record.step] = [p.detach().clone() for p in module.parameters()]

    module.on_settle = settled
    records = []
    for step[0], batch in enumerate(local_batches(cfg, grid.dp_rank, STEPS), start=1):
        records += module.run(batch)
    records += [r for r in [module.settle()] if r is not None]
    grads.wait()
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    out = {"losses": [float(r.loss) for r in records], "norms": [float(r.grad_norm) for r in records],
           "lrs": [r.lr for r in records], "redone": [r.redone_steps or 0 for r in records],
           "eager": [r.eager for r in records], "weights": [weights[r.step] for r in records],
           "scales": [r.loss_scale for r in records]}
    out["state"] = [t.clone() for b in grads.buckets for t in (b.main, *b.state.values())]
    out["steps"], out["scaler"] = opt.steps, scaler.state_dict()
    return out


def _world(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    grid = ParallelGrid(1, 2, 2)
    sync, post = _run(grid, False), _run(grid, True)

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    return {
        "coords": (grid.pp_rank, grid.dp_rank),
        **{f"{k}_{name}": run[k] for name, run in (("sync", sync), ("post", post))
           for k in ("losses", "norms", "lrs", "redone", "eager", "steps", "scaler", "scales")},
        "weights_equal": [same(a, b) for a, b in zip(sync["weights"], post["weights"])],
        "state_equal": same(sync["state"], post["state"]),
        # the overflowed step moved nothing; the others moved the weights
        "moved": [not same(a, b) for a, b in zip(post["weights"], post["weights"][1:])],
        "dtypes": sorted({str(p.dtype) for p in post["weights"][-1]}),
    }


def test_post_validated_16_megatron_equals_the_synchronous_step_bit_for_bit():
    results = run_distributed(_world, 4, timeout=300)
    for r in results:
        where = f"rank (pp, dp) = {r['coords']}"
        assert r["dtypes"] == ["torch.float16"], where
        norms = r["norms_sync"]
        assert norms[0] > CLIP and all(n < CLIP for i, n in enumerate(norms[1:], 2) if i != OVERFLOW_STEP), norms
        assert math.isinf(norms[OVERFLOW_STEP - 1]), f"{where}: the injected inf reached every rank: {norms}"
        # Steps 1, 3 and 5 step first (1 and 3 are rejected); 2 and 4 follow a rejected step and are synchronous.
        assert r["eager_post"] == [True, False, True, False, True] and r["eager_sync"] == [False] * STEPS, where
        assert r["redone_sync"] == [0] * STEPS and r["redone_post"] == [1, 1, 2, 2, 2], (where, r["redone_post"])
        for key in ("losses", "norms", "lrs", "steps", "scaler", "scales"):
            assert r[f"{key}_post"] == r[f"{key}_sync"], f"{where}: {key} {r[f'{key}_post']} != {r[f'{key}_sync']}"
        assert r["steps_post"] == STEPS - 1 and r["scaler_post"]["skipped_steps"] == 1, where
        assert all(r["weights_equal"]) and r["state_equal"], f"{where}: weights after each step {r['weights_equal']}"
        assert r["moved"] == [True, False, True, True], f"{where}: steps 2-5 moved the weights: {r['moved']}"


def _snapshot_bytes(snapshot) -> int:
    return sum(copy.numel() * copy.element_size() for _, copy in snapshot.saved + snapshot.gradients) + sum(
        v.numel() * v.element_size() for st in getattr(snapshot, "state", {}).values() for v in st.values()
        if isinstance(v, torch.Tensor) and v.numel() > 1)


def test_the_saved_copy_is_what_the_memory_model_counts():
    """The copy post-validation saves before a step, measured on the real optimizers, against the memory model's
    `post_validation_copy` (Precision.step_state_bytes per parameter): 16 bytes under bf16-megatron (fp32
    gradients, main weights and moments, up to the buckets' alignment padding) and 32-true (gradients, weights and
    moments), 32 under 64-true; the distributed optimizer's share under dp2 is half."""
    from mlplat.perf.flops import ModelDims
    from mlplat.perf.memory import Layout, memory_per_gpu
    from mlplat.step.post_validation import StepSnapshot

    torch.set_num_threads(1)
    dims = ModelDims(n_layers=4, hidden=64, n_heads=4, seq_len=32, vocab_size=128)
    counted = {}
    for precision, distributed in (("bf16-megatron", False), ("32-true", False), ("64-true", False),
                                   ("bf16-megatron", True)):
        lay = Layout(precision=precision, dp=2, global_batch_size=2, distributed_optimizer=distributed,
                     post_validate=True)
        report = memory_per_gpu(dims, lay, 0, overhead_bytes=0)
        counted[precision, distributed] = report.breakdown["post_validation_copy"] / report.parameters
        assert "post_validation_copy" not in memory_per_gpu(dims, replace(lay, post_validate=False), 0).breakdown
    assert counted == {("bf16-megatron", False): 16, ("32-true", False): 16, ("64-true", False): 32,
                       ("bf16-megatron", True): 8}
    for precision in ("bf16-megatron", "32-true"):
        cfg = make_cfg(grad_clip=1.0, post_validate=True)
        cfg.trainer.precision = precision
        module = TrainStep(cfg, ParallelGrid())
        module.run(local_batches(cfg, 0, 1)[0])  # torch's AdamW has its moments after a step
        n = sum(p.numel() for p in module.parameters())
        measured = _snapshot_bytes(StepSnapshot(module.optimizer, module.grads)) / n
        assert 16 <= measured <= 16 * 1.05, (precision, measured)  # the buckets' alignment padding


DELAY_S = 1.0  # the last pipeline rank's extra time before its first optimizer step


def _back_to_back(grid: ParallelGrid, post_validate: bool) -> dict:
    """Three steps of p4 zbv in float64, nothing clipped; the last pipeline rank takes DELAY_S longer after its first
    pass, before the step's checks. When each pass starts, when that rank was released, and the records."""
    import time

    from tests.helpers.equivalence import build_module

    cfg = make_cfg(pp=4, vpp=2, schedule="zbv", grad_clip=100.0, post_validate=post_validate, steps=3)
    module = build_module(cfg, grid)
    stamps = {"passes": [], "released": []}
    run_pass = module.engine.run

    def timed_pass(*args, **kwargs):
        stamps["passes"].append(time.perf_counter())  # one monotonic clock for every process of the machine
        return run_pass(*args, **kwargs)

    module.engine.run = timed_pass
    if grid.pp_rank == grid.pp - 1:
        reduce = module.grads.reduce_sequence_parallel  # the pass's last reduction, before the step's checks

        def late():
            reduce()
            if not stamps["released"]:
                time.sleep(DELAY_S)
                stamps["released"].append(time.perf_counter())

        module.grads.reduce_sequence_parallel = late
    records = []
    for batch in local_batches(cfg, 0, 3):
        records += module.run(batch)
    records += [r for r in [module.settle()] if r is not None]
    return {**stamps, "metrics": [(float(r.loss), float(r.grad_norm), r.lr, r.eager) for r in records],
            "params": [p.detach().clone() for p in module.parameters()]}


def _back_to_back_world(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    grid = ParallelGrid(1, 4, 1)
    return {"sync": _back_to_back(grid, False), "post": _back_to_back(grid, True)}


def test_post_validated_steps_run_back_to_back():
    """Nothing global sits between post-validated steps: with the last pipeline rank held up before its first
    step's checks, the first pipeline rank starts step 2's pass at once, long before the last rank is released;
    the synchronous step makes it wait for that rank (the norm's all-reduce). Both runs give the same records and
    weights, bit for bit, on every rank (float64, p4 zbv, nothing clipped: every post-validated step stands)."""
    results = run_distributed(_back_to_back_world, 4, timeout=300)
    first, last = results[0], results[-1]
    released_sync, released_post = last["sync"]["released"][0], last["post"]["released"][0]
    assert first["sync"]["passes"][1] >= released_sync, "the synchronous step waits for the last rank"
    assert first["post"]["passes"][1] < released_post - DELAY_S / 2, (
        f"step 2's pass started {first['post']['passes'][1] - released_post:+.3f} s after the last rank's release")
    for r in results:
        assert [m[3] for m in r["post"]["metrics"]] == [True, True, True]
        assert [m[:3] for m in r["post"]["metrics"]] == [m[:3] for m in r["sync"]["metrics"]]
        assert all(torch.equal(a, b) for a, b in zip(r["post"]["params"], r["sync"]["params"]))


def test_a_step_redone_inside_inference_mode_trains_on():
    """Lightning runs validation's hooks under torch.inference_mode on GPUs (under no_grad on gloo), and validation
    settles a pending step. Step 1, stepped first and rejected (clipped), is redone there: torch's AdamW creates its
    state in that redo, which must be normal tensors that steps 2 and 3 update in place. The run ends equal to the
    synchronous one (float64, one process)."""
    from tests.helpers.equivalence import build_module

    torch.set_num_threads(1)
    finals = {}
    for post in (False, True):
        cfg = make_cfg(grad_clip=0.6, post_validate=post, steps=3)
        module = build_module(cfg, ParallelGrid())
        batches = local_batches(cfg, 0, 3)
        module.run(batches[0])
        with torch.inference_mode():
            module.settle()
        assert module.redone_steps == (1 if post else 0)
        for batch in batches[1:]:
            module.run(batch)
        module.settle()
        finals[post] = [p.detach().clone() for p in module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(finals[False], finals[True]))


def test_a_pass_run_again_after_a_rejected_step_casts_the_redone_weights():
    """bf16-mixed: Lightning's autocast region spans a whole training step, and autocast keeps its cast of each
    weight until the region ends. A step stepped first and rejected in the next training step is redone there, and
    that step's pass runs again on the redone weights: their casts must be made anew, not the rejected weights'
    kept ones. One process, a region per step as Lightning opens it, step 1 clipped: equal to the synchronous run."""
    from tests.helpers.equivalence import build_module

    torch.set_num_threads(1)
    out = {}
    for post in (False, True):
        cfg = make_cfg(grad_clip=0.6, post_validate=post, steps=3, precision="32-true")
        module = build_module(cfg, ParallelGrid())
        losses = []
        for batch in local_batches(cfg, 0, 3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses += [float(r.loss) for r in module.run(batch)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses += [float(r.loss) for r in [module.settle()] if r is not None]
        assert module.redone_steps == (1 if post else 0)
        out[post] = (losses, [p.detach().clone() for p in module.parameters()])
    assert out[True][0] == out[False][0]
    assert all(torch.equal(a, b) for a, b in zip(out[False][1], out[True][1]))
