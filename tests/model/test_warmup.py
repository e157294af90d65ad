"""The fused operators' warm-up before step 1 (mlplat.model.warmup): it meets every signature a run calls them with.

Two pipeline stages (the second one's chunk takes a stage message), with dropout, under each recomputation: the
warm-up runs when the engine is built, then a training step, validation and generation run. Compilation itself is
replaced by the eager function and each operator's first call per signature (its `_probe`) is recorded: no call of
the run may be new, since on a GPU or at p = 64 that first call would compile while transfers are posted. The warm-up
also leaves training as it was: the weights after a step equal those of a run without it, and when one rank's
compilation fails, every rank ends up eager.
"""
from __future__ import annotations

import torch

from tests.helpers.dist import run_distributed


def _config(recompute: str, fused: bool = True):
    from mlplat.train import load_checked

    return load_checked({"model": dict(n_layers=4, hidden=32, n_heads=4, seq_len=16, vocab_size=64, dropout=0.1),
                         "parallel": dict(tp=1, pp=2, dp=1, micro_batch_size=2, global_batch_size=4),
                         "kernels": dict(fused=fused, recompute=recompute, attention="math"),
                         "trainer": dict(precision="32-true"), "logger": dict(name="none"),
                         "sample": dict(max_new_tokens=2)}, world_size=2, check_data=False)


def _signatures_missed(rank, world_size):
    from mlplat.model import fused
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.step import TrainStep
    from mlplat.step.decode import generate

    phase, calls = ["warm-up"], []
    fused.FusedOp._probe = lambda self, args, kwargs: calls.append((phase[0], self.__name__))
    fused.FusedOp._compiled_fn = lambda self: self.fn  # the same function, uncompiled: only the first calls count
    batch = (torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1)),) * 2
    out = {}
    grid = ParallelGrid(1, 2, 1)
    for recompute in ("none", "selective", "full"):
        for op in fused.FUSED_OPS:
            op.reset()
        phase[0], calls[:] = "warm-up", []
        step = TrainStep(_config(recompute), grid)
        step.engine  # built on first use: the warm-up runs here
        phase[0] = "run"
        step.run(batch)
        step.evaluate(batch)
        generate(step, [1, 2, 3], 2)
        out[recompute] = ([name for when, name in calls if when == "warm-up"],
                          [name for when, name in calls if when == "run"])
    # Training is unchanged by the warm-up: one step with it equals one step without it (fused=false runs the same
    # functions eagerly; dropout draws the same masks).
    weights = []
    for on in (True, False):
        step = TrainStep(_config("none", fused=on), grid)
        step.run(batch)
        weights.append([p.detach().clone() for p in step.parameters()])
    out["same"] = all(torch.equal(a, b) for a, b in zip(*weights))
    # A compilation that fails on rank 1 only: both ranks end up eager.
    for op in fused.FUSED_OPS:
        op.reset()
    fused.FusedOp._probe = (lambda self, args, kwargs: (_ for _ in ()).throw(RuntimeError("no compiler"))) \
        if rank == 1 else (lambda self, args, kwargs: None)
    TrainStep(_config("none"), grid).engine
    out["impl"] = fused.get_impl()
    fused.set_impl("compile")
    return out


def test_the_warm_up_meets_every_signature_of_a_run_and_changes_nothing():
    for out in run_distributed(_signatures_missed, 2, timeout=300):
        for recompute in ("none", "selective", "full"):
            warmed, missed = out[recompute]
            assert warmed and missed == [], (recompute, warmed, missed)
        assert out["same"]
        assert out["impl"] == "eager"
