"""The optimizer factory (`mlplat.optim.factory`, optim.name) is the only seam between the training step and its
optimizer: a toy optimizer registered in this file is accepted by the config, built and stepped by `TrainStep`, its
declared state saved by a checkpoint and restored by post-validation, and refused once unregistered. An optimizer
that reads matrices whole gets whole parameters from the distributed optimizer's sharding, with the same training.
"""
from __future__ import annotations

import pytest
import torch

from mlplat.config import load_config
from mlplat.errors import ConfigError
from mlplat.optim import factory
from mlplat.parallel.grid import ParallelGrid
from mlplat.step import TrainStep
from tests.helpers import equivalence as eq
from tests.helpers.dist import run_distributed


class MomentumSGD(torch.optim.Optimizer):
    """SGD with heavy-ball momentum on the weights (their `.grad`), its one state tensor declared."""

    STATE = ("momentum",)

    def __init__(self, groups: list[dict], lr: float, momentum: float = 0.9):
        super().__init__(groups, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["momentum"] = torch.zeros_like(p)
                state["step"] += 1
                state["momentum"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["momentum"], alpha=-group["lr"])


def _momentum_sgd(optim_cfg, grads, groups):
    assert not (grads.own_main or grads.distributed), "a toy on the weights' own .grad"
    return MomentumSGD(groups, lr=optim_cfg.lr)


TOY = factory.Optimizer("momentum_sgd", _momentum_sgd)


def _cfg(name: str, post_validate: bool = False, grad_clip: float = 0.0, **optim):
    raw = {"model": dict(eq.MODEL, n_layers=2, dropout=0.1),
           "parallel": dict(micro_batch_size=2, global_batch_size=4),
           "kernels": dict(attention="math"),
           "optim": dict(name=name, lr=0.05, warmup_steps=0, grad_clip=grad_clip, post_validate=post_validate, **optim),
           "trainer": dict(max_steps=4, precision="64-true"), "logger": dict(name="none"), "seed": eq.SEED}
    return load_config(raw, world_size=optim.get("distributed", False) and 2 or 1, check_data=False)


def _run(cfg, steps: int):
    step = TrainStep(cfg, ParallelGrid())
    records = []
    for batch in eq.local_batches(cfg, 0, steps):
        records += step.run(batch)
    records += [r for r in [step.settle()] if r is not None]
    return step, records


def test_a_registered_optimizer_is_built_stepped_saved_and_post_validated_by_the_step_alone():
    torch.set_num_threads(1)
    with pytest.raises(ConfigError, match=r"^optim.name='momentum_sgd' is not one of adamw, muon$"):
        _cfg("momentum_sgd")
    with factory.registered(TOY):
        cfg = _cfg("momentum_sgd")
        step = TrainStep(cfg, ParallelGrid())
        assert type(step.optimizer) is MomentumSGD
        before = [p.detach().clone() for p in step.parameters()]
        lrs = [g["lr"] for g in step.optimizer.param_groups]
        (record,) = step.run(eq.local_batches(cfg, 0, 1)[0])
        # The first step is -lr·grad on every weight, no weight decay: the toy's arithmetic, not AdamW's.
        for p, p0 in zip(step.parameters(), before):
            assert torch.equal(p.detach(), p0.add(p.grad, alpha=-lrs[0])), p.shape
        # The learning-rate schedule drives it as any optimizer: the peak lr (no warm-up), then the decayed one.
        assert lrs[0] == cfg.optim.lr and record.lr == step.optimizer.param_groups[0]["lr"] < cfg.optim.lr

        from mlplat.checkpoint.state import training_state

        saved = training_state(step.chunks, step.optimizer, ParallelGrid())
        names = {k.rsplit("/", 1)[1] for k in saved if k.startswith("optim/") and k.count("/") == 2}
        assert names == {"momentum", "step"}, names

        # Post-validated with clipping (steps redone from the snapshot of the toy's state): the synchronous run.
        sync, sync_records = _run(_cfg("momentum_sgd", grad_clip=0.5), 4)
        post, post_records = _run(_cfg("momentum_sgd", post_validate=True, grad_clip=0.5), 4)
        assert post_records[-1].redone_steps >= 1
        assert [(float(r.loss), float(r.grad_norm)) for r in sync_records] == \
            [(float(r.loss), float(r.grad_norm)) for r in post_records]
        assert all(torch.equal(a, b) for a, b in zip(sync.parameters(), post.parameters()))
    with pytest.raises(ConfigError, match="optim.name='momentum_sgd'"):
        _cfg("momentum_sgd")


def _whole(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    adamw = factory.get("adamw")
    out = {}
    with factory.registered(factory.Optimizer("adamw_whole", adamw.build, whole_matrices=True)):
        for name in ("adamw", "adamw_whole"):
            cfg = _cfg(name, distributed=True)
            step = TrainStep(cfg, eq.make_grid(cfg))
            records = [r for batch in eq.local_batches(cfg, step.grid.dp_rank, 3) for r in step.run(batch)]
            step.finish()
            whole = all(step.grads.local_range(p) in (None, (0, p.numel())) for p in step.parameters())
            out[name] = ([float(r.loss) for r in records], [p.detach().clone() for p in step.parameters()], whole)
    return out


def test_an_optimizer_of_whole_matrices_trains_as_the_sharded_one_on_whole_parameters():
    """dp=2, optim.distributed: AdamW registered as reading matrices whole owns whole parameters on each rank, and
    its losses and weights equal AdamW's on the ordinary shards (elementwise: the layout changes nothing)."""
    for rank in run_distributed(_whole, 2):
        (losses, weights, whole), (w_losses, w_weights, w_whole) = rank["adamw"], rank["adamw_whole"]
        assert w_whole and not whole
        assert losses == w_losses
        assert all(torch.equal(a, b) for a, b in zip(weights, w_weights))
