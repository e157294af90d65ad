"""Dynamic loss scaling for fp16 mixed precision (Micikevicius et al., 2018; Megatron's DynamicGradScaler).

fp16 has a narrow exponent range: small gradients underflow to zero. The loss is multiplied by a scale S before
backward (the pipeline engine does it on the last chunk), so every gradient is S times too large while it flows
through the fp16 parts of the graph; after the data-parallel and tied-embedding reductions the gradients are
divided by S again. If any rank found an inf or NaN, the step is skipped on every rank and S is lowered
(× backoff); after `growth_interval` clean steps in a row S is raised (× growth).

Lightning's own GradScaler is not used: the pipeline engine runs backward itself, so Lightning never sees the
loss (see `mlplat.lightning.precision`). No Lightning here; the training step drives this object.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from mlplat.parallel.grid import dist_ready


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, min_scale: float = 1.0, max_scale: float = 2.0**24):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1):
            raise ValueError("loss scaling needs growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        if not 0 < min_scale <= init_scale:
            raise ValueError(f"loss scale init_scale={init_scale} must be at least min_scale={min_scale} > 0")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self.good_steps = 0      # clean steps since the last change of scale
        self.skipped_steps = 0   # optimizer steps skipped for inf/NaN gradients, over the whole run

    def unscale_(self, params: Iterable[torch.nn.Parameter], group=None) -> bool:
        """Divide every gradient by the scale; True when any gradient on any rank of `group` (None = the whole
        world) holds an inf or NaN. Call after the gradient reductions and before clipping."""
        return self.unscale_grads_([p.grad for p in params if p.grad is not None], group)

    def unscale_grads_(self, grads: list[torch.Tensor], group=None) -> bool:
        """`unscale_` on gradient tensors themselves (e.g. the shards of flat main gradients)."""
        found, _ = self.unscale_and_flag_(grads, group)
        return bool(found.item() > 0)

    def unscale_and_flag_(self, grads: list[torch.Tensor], group=None, async_op: bool = False):
        """(flag, work): the gradients divided by the scale, and a one-element tensor > 0 when any of them on any
        rank of `group` holds an inf or NaN, its MAX all-reduce left in flight under async_op (work None
        otherwise, or without a process group): read the flag only after `work.wait()`."""
        inv = 1.0 / self.scale
        device = grads[0].device if grads else torch.device("cpu")
        found = torch.zeros(1, dtype=torch.float32, device=device)
        for g in grads:
            g.mul_(inv)
            # Accumulated on the device: no host synchronisation per tensor.
            found += torch.logical_not(torch.isfinite(g)).any().to(found.dtype)
        work = None
        if dist_ready():
            work = dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group, async_op=async_op)
        return found, work

    def update(self, found_inf: bool) -> None:
        """After the step: back off (and count the skip) on overflow, grow after growth_interval clean steps."""
        if found_inf:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale = min(self.max_scale, self.scale * self.growth_factor)
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "min_scale": self.min_scale, "max_scale": self.max_scale}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, type(getattr(self, key))(value))

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.scale:g}, good_steps={self.good_steps}, "
                f"skipped_steps={self.skipped_steps})")
