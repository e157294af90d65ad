"""Parameters sharded over data parallelism (`optim.sharding=params`, `mlplat.optim.param_gather`), measured.

- Between steps a rank keeps 1/d of the weights, the gradients, the fp32 main weights and Adam's moments:
  bf16-megatron's 18 bytes per parameter at d = 1, 18/d at d = 2, 4, 8 (up to the buckets' padding), built on
  virtual grids; the memory model counts the same.
- In passes on 4 real ranks (dp4; pp2·dp2 under 1F1B; pp2·dp2 under zbv, whose split backward keeps the full
  gradients through the pass; HSDP, 2 shards x 2 replicas, with full recomputation; pp2(v2 interleaved)·dp2 with
  FP8), the most full weights
  and full gradients materialised at once (every flat buffer's materialise and free wrapped) are within 10% of the
  memory model's; each layer is gathered once for its forward and once for its backward per micro-batch (the
  gathers counted); FP8 keeps one layer's weight casts at a time (made per gather); after a step no full buffer is
  left; and the losses equal the same layout's under optim sharding (weights whole) to 1e-12.
Equality with one process in float64 under every layout: tests/cli/test_train.py; resumes:
tests/cli/test_checkpoint.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from mlplat.parallel.grid import ParallelGrid
from mlplat.perf.flops import ModelDims
from mlplat.perf.memory import Layout, memory_per_gpu
from mlplat.step import TrainStep
from tests.helpers.dist import run_distributed
from tests.helpers.equivalence import local_batches, make_cfg

# Large enough that the layers dominate: 4 layers of ~0.8M parameters (each in one 4 MiB bucket), a 250-token
# vocabulary.
WIDE = dict(hidden=256, n_heads=4, n_layers=4)


def _kept_bytes(step: TrainStep) -> dict[str, int]:
    """What a rank keeps between steps: weights (shards, or whole buffers), gradients, optimizer state."""
    from mlplat.optim.main_params import optimizer_state_bytes
    from mlplat.optim.param_gather import alive

    grads = step.grads
    weights = sum(b.shard.numel() * b.shard.element_size() if b.shard is not None
                  else b.param_flat.untyped_storage().nbytes() for b in grads.buckets)
    gradients = sum(b.grad_shard.numel() * b.grad_shard.element_size() if b.grad_shard is not None
                    else b.grad_flat.untyped_storage().nbytes() for b in grads.buckets)
    assert all(not alive(b.param_flat) and not alive(b.grad_flat) for b in grads.buckets if b.shard is not None)
    return dict(weights=weights, gradients=gradients, optimizer_state=optimizer_state_bytes(step.optimizer))


def test_the_state_kept_between_steps_falls_as_one_over_d():
    torch.set_num_threads(1)
    kept = {}
    for d in (1, 2, 4, 8):
        cfg = make_cfg(dp=d, global_batch=16, precision="bf16-megatron", model=WIDE, optim={"sharding": "params"})
        step = TrainStep(cfg, ParallelGrid(1, 1, d, rank=0, virtual=True))
        assert step.optimizer is not None  # builds the buffers: the weights move into their shards
        kept[d] = _kept_bytes(step)
        n = sum(p.numel() for p in step.parameters())
        report = memory_per_gpu(ModelDims.of(cfg.model), Layout.of(cfg), 0, overhead_bytes=0)
        for part, per_param in (("weights", 2), ("gradients", 4), ("optimizer_state", 12)):
            # the buckets' padding: at most 64·d elements per bucket, a few per mille here
            assert per_param * n / d <= kept[d][part] <= per_param * n / d * 1.01, (d, part, kept[d])
        if d == 1:  # nothing sharded: the model's whole-weight count (at d > 1 it adds the gathered layers)
            assert report.breakdown["weights"] == pytest.approx(kept[1]["weights"], rel=0.01)
            assert report.breakdown["gradients"] == pytest.approx(kept[1]["gradients"], rel=0.01)
        assert report.breakdown["optimizer_state"] == pytest.approx(kept[d]["optimizer_state"], rel=0.01)
    for d in (2, 4, 8):
        assert sum(kept[d].values()) == pytest.approx(sum(kept[1].values()) / d, rel=0.01), kept


# (name, layout keys, world of 4); micro-batches of 2, 4 of them per pipeline
PASSES = {
    "dp4": dict(dp=4, global_batch=8),
    "pp2-dp2-1f1b": dict(pp=2, dp=2, global_batch=16),
    "pp2-dp2-zbv": dict(pp=2, vpp=2, dp=2, schedule="zbv", global_batch=16),
    # full recomputation: a layer's recomputed forward is its backward's gather (and prefetches the previous layer)
    "dp4-hsdp-recompute-full": dict(dp=4, global_batch=8, dp_shard=2, recompute="full"),
    # one layer per chunk, FP8: a layer's weight casts made per gather and dropped with its weights
    "pp2v2-dp2-interleaved-fp8": dict(pp=2, vpp=2, dp=2, schedule="interleaved", global_batch=16, fp8="tensorwise"),
}
GEMMS_PER_LAYER = 4  # QKV, out, fc1, fc2: one FP8 GEMM (a WeightCasts owner) each


def _world4(rank: int, world_size: int) -> dict:
    import mlplat.optim.param_gather as pg
    from mlplat.parallel.fp8 import WeightCasts

    torch.set_num_threads(1)
    out = {}
    for name, keys in PASSES.items():
        keys = dict(keys)
        dp_shard = keys.pop("dp_shard", None)
        losses = {}
        for sharding in ("optim", "params"):
            cfg = make_cfg(precision="64-true", model=WIDE, steps=2, grad_clip=1.0,
                           optim={"sharding": sharding}, **keys)
            cfg.parallel.dp_shard = dp_shard
            step = TrainStep(cfg, ParallelGrid.of(cfg.dims))
            opt = step.optimizer
            live = {"weights": 0, "gradients": 0}
            peak = dict(live)
            gathers = [0]
            kind = {}
            for b in step.grads.buckets:
                kind[id(b.param_flat)], kind[id(b.grad_flat)] = "weights", "gradients"
            real = (pg.materialise, pg.free, pg.all_gather_into)

            def materialise(t, real=real[0], live=live, peak=peak):
                if not pg.alive(t):
                    live[kind[id(t)]] += t.numel() * t.element_size()
                    peak.update({k: max(peak[k], live[k]) for k in live})
                real(t)

            def free(t, real=real[1], live=live):
                if pg.alive(t):
                    live[kind[id(t)]] -= t.numel() * t.element_size()
                real(t)

            def all_gather_into(*args, real=real[2], gathers=gathers, **kw):
                gathers[0] += 1
                return real(*args, **kw)

            owners = [0]  # the most GEMMs whose FP8 casts were kept at once, over every chunk's store
            held: dict[int, int] = {}
            real_casts = (WeightCasts.get, WeightCasts.drop, WeightCasts.clear)

            def counted(method, owners=owners, held=held):
                def wrapped(store, *args):
                    out = method(store, *args)
                    held[id(store)] = len({key[0] for key in store.kept})
                    owners[0] = max(owners[0], sum(held.values()))
                    return out
                return wrapped

            WeightCasts.get, WeightCasts.drop, WeightCasts.clear = map(counted, real_casts)
            pg.materialise, pg.free, pg.all_gather_into = materialise, free, all_gather_into
            import mlplat.optim.buffers as buffers
            saved = (buffers.materialise, buffers.free)
            buffers.materialise, buffers.free = materialise, free
            try:
                losses[sharding] = []
                for batch in local_batches(cfg, step.grid.dp_rank, 2):
                    opt.zero_grad()
                    gathers[0] = 0
                    loss, _ = step.forward_backward(batch)
                    opt.step()
                    losses[sharding].append(float(loss))
                    if sharding == "params":
                        sharded = [b for b in step.grads.buckets if b.shard is not None]
                        units = {b.unit for b in sharded if b.unit is not None}
                        per_unit = len([b for b in sharded if b.unit is not None]) / max(len(units), 1)
                        rest = len([b for b in sharded if b.unit is None])
                        m = cfg.parallel.num_micro_batches
                        out.setdefault(name, {})["gathers"] = (gathers[0], 2 * m * per_unit * len(units) + rest)
                        out[name]["left"] = [pg.alive(b.param_flat) or pg.alive(b.grad_flat) for b in sharded]
            finally:
                pg.materialise, pg.free, pg.all_gather_into = real
                buffers.materialise, buffers.free = saved
                WeightCasts.get, WeightCasts.drop, WeightCasts.clear = real_casts
            step.finish()
            if sharding == "params":
                report = memory_per_gpu(ModelDims.of(cfg.model), Layout.of(cfg), step.grid.pp_rank, overhead_bytes=0)
                kept = _kept_bytes(step)
                out[name]["peak"] = peak
                out[name]["model"] = {k: report.breakdown[k] - kept[k] for k in peak}
            out.setdefault(name, {}).setdefault("fp8_owners", {})[sharding] = owners[0]
        out[name]["losses"] = losses
    return out


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_world4, 4, timeout=600)


@pytest.mark.parametrize("name", list(PASSES))
def test_a_sharded_pass_gathers_each_layer_twice_and_peaks_where_the_memory_model_says(world4, name):
    for rank, r in enumerate(world4):
        got = r[name]
        a, b = got["losses"]["params"], got["losses"]["optim"]
        assert all(math.isfinite(x) for x in a) and all(abs(x - y) <= 1e-12 * abs(y) for x, y in zip(a, b)), (a, b)
        assert not any(got["left"]), (rank, got["left"])  # every full buffer freed after the step
        counted, expected = got["gathers"]
        assert counted == expected, (rank, name, counted, expected)
        for part in ("weights", "gradients"):  # the full weights and gradients materialised at once
            measured, model = got["peak"][part], got["model"][part]
            assert measured == pytest.approx(model, rel=0.10), (rank, name, part, got["peak"], got["model"])
        if "fp8" in name:  # cast per gather: one layer's casts at a time, against the rank's two layers' all kept
            assert got["fp8_owners"] == {"params": GEMMS_PER_LAYER, "optim": 2 * GEMMS_PER_LAYER}, got["fp8_owners"]
