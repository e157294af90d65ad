"""The optimizer on main weights: AdamW on the shards of `ParamBuffers`' flat buckets.

Megatron-style mixed precision (`trainer.precision=bf16-megatron`, `16-megatron`). The model's weights *are*
bf16 (fp16) tensors: no autocast, so no per-forward cast of the weights and no fp32 copy in the forward; the
activations and the stage-to-stage messages are in that dtype too. The optimizer keeps fp32 main weights (each
bucket's shard, `mlplat.optim.buffers`), the gradients sum into fp32 main gradients, Adam updates the
main weights and the bf16 weights are their rounding. Checkpoints hold the fp32 main weights.

Distributed optimizer (`optim.distributed=true`, any precision, float64 included). Each data-parallel rank owns
1/d of every bucket: its main weights and Adam moments exist for that shard only; the buffer reduce-scatters the
gradients into the shards and all-gathers the updated weights. Under 64-true/32-true the main weights are the
weights' own shard (a view, no copy): the optimizer then holds only the moments, 1/d of them per rank.

Overlap. After a bucket's update its all-gather starts (buckets in forward order), overlapping the update of the
next buckets, and is waited for only by the next forward of its chunk. Not overlapped: the AdamW arithmetic.

No Lightning and no Hydra here (tests import this package in a fresh interpreter).
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from mlplat.optim.buffers import ParamBuffers
from mlplat.precision import TABLE

log = logging.getLogger("mlplat")
ADAMW_STATE = ("exp_avg", "exp_avg_sq")  # `adamw_`'s moments: AdamW's state per parameter, besides its step count
MEGATRON_DTYPES = {n: getattr(torch, e.weight_dtype) for n, e in TABLE.items() if e.megatron}


def megatron_dtype(precision: str) -> torch.dtype | None:
    """The weights' dtype of a Megatron-style precision (bf16-megatron, 16-megatron), None for any other."""
    return MEGATRON_DTYPES.get(str(precision))


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int,
           lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update in place, in the arithmetic of torch.optim.AdamW's single-tensor path (the float64
    proofs compare against it): decoupled weight decay, then the moments, then the bias-corrected step."""
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - beta2 ** float(step)
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


class AdamW(torch.optim.AdamW):
    """torch's AdamW, declaring its state per parameter (`mlplat.optim.factory.state_names`)."""

    STATE = ADAMW_STATE


class MainParamsOptimizer(torch.optim.Optimizer):
    """An optimizer on the gradient buffer's main weights (this rank's shards), then the model's weights from them.

    A torch Optimizer so that LambdaLR and Lightning drive it as any other: its param_groups hold the model's
    parameters and the hyper-parameters, which the update reads each step; its state (`STATE`, per element of the
    shard) lives in `main`'s flat buffers (`Bucket.state`), not in `self.state`. Every parameter steps every step
    (the model uses all of them), so one step count (`steps`) serves all.
    """

    STATE: tuple[str, ...] = ()

    def __init__(self, main: ParamBuffers, param_groups: list[dict], defaults: dict):
        super().__init__(param_groups, defaults)
        self.main = main
        main.allocate_state(self.STATE)
        self.steps = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.main.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps += 1
        update = self.bucket_update()
        # Forward order: the first chunk's weights are all-gathered first, as the next forward needs them (each
        # bucket's all-gather starts while the next ones are updated).
        for b in reversed(self.main.buckets):
            update(b)
            self.main.publish(b)
        return loss

    def bucket_update(self):
        """This step's update of one bucket's shard of the main weights (its state, from its gradients): a function
        of the bucket, made once per step from the groups' current hyper-parameters."""
        raise NotImplementedError


class MainParamsAdamW(MainParamsOptimizer):
    """AdamW on the gradient buffer's main weights (lr, betas, eps, weight_decay per group)."""

    STATE = ADAMW_STATE

    def __init__(self, main: ParamBuffers, param_groups: list[dict], lr: float, betas: Sequence[float],
                 eps: float):
        super().__init__(main, param_groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=0.0))

    def bucket_update(self):
        def update(b) -> None:
            for x, y, g in b.segments:
                group = self.param_groups[g]
                beta1, beta2 = group["betas"]
                adamw_(b.main[x:y], b.grad[x:y], *(b.state[k][x:y] for k in ADAMW_STATE), step=self.steps,
                       lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                       weight_decay=group["weight_decay"])
        return update


def log_main_params(opt: MainParamsOptimizer) -> MainParamsOptimizer:
    """The main weights' layout and the optimizer state's size, on rank 0."""
    main, grid = opt.main, opt.main.grid
    if grid.rank == 0:
        what = "weights, gradients and optimizer state" if main.shard_params else "optimizer state"
        where = f"over {grid.dp_shard} of the d·c={grid.dp_cp} replicas (HSDP)" if grid.dp_shard < grid.dp_cp \
            else f"over dp={grid.dp}" + (f" (d·c={grid.dp_cp})" if grid.cp > 1 else "")
        log.info("optimizer: main weights %s, weights %s, %s; optimizer state %.2f MiB on rank 0",
                 main.main_dtype, main.param_dtype, f"{what} sharded {where}" if main.distributed else "not sharded",
                 optimizer_state_bytes(opt) / 2**20)
    return opt


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (distinct storages; the step counters excluded)."""
    main = getattr(optimizer, "main", None)
    if isinstance(main, ParamBuffers):
        tensors = main.state_tensors()
    else:
        tensors = [t for st in optimizer.state.values() for k, t in st.items()
                   if isinstance(t, torch.Tensor) and k != "step"]
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
