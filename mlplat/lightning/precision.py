"""`trainer.precision=16-mixed` with mlplat's own dynamic loss scaling, and the Megatron-style precisions
`bf16-megatron` / `16-megatron` (`MegatronPrecision`).

Lightning's `MixedPrecision("16-mixed")` brings a `torch.amp.GradScaler` that only works when Lightning runs
backward: in manual optimisation its `optimizer_step` calls `scaler.unscale_(optimizer)` and `scaler.step`
although `scaler.scale(loss)` never ran (our pipeline engine calls `torch.autograd.backward` itself), and
GradScaler refuses that ("Attempted unscale_ but _scale is None"). Lightning also silently swaps 16-mixed for
bf16-mixed on CPU. This plugin keeps Lightning's fp16 autocast on any device, drops the GradScaler, and hands
scaling to `mlplat.parallel.loss_scale.DynamicLossScaler`, which the LightningModule drives (scale the loss in
the engine, unscale after the reductions, all-reduce an inf/NaN flag, skip or step). A skipped step still
goes through `optimizer.step()` from Lightning's point of view (so `global_step` counts it, as with AMP's
GradScaler), but the optimizer itself does not move. The scaler's state is saved in Lightning checkpoints.
"""
from __future__ import annotations

from typing import Any, Callable

from pytorch_lightning.plugins.precision import MixedPrecision, Precision

from mlplat.parallel.loss_scale import DynamicLossScaler
from mlplat.precision import precision_of


class SkipsOverflowedSteps:
    """The part both plugins share: a `loss_scaler` (None for bf16) saved in checkpoints, and a step the training
    step marks as overflowed (`skip_next_step`) that goes through `optimizer_step` without moving the optimizer."""

    loss_scaler: DynamicLossScaler | None = None
    skip_next_step = False  # set by the training step when the gradients overflowed

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.skip_next_step:
            self.skip_next_step = False
            # The closure and the before-optimizer-step hooks still run, as for a step GradScaler skips.
            return self._wrap_closure(model, optimizer, closure)
        return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.loss_scaler.state_dict()} if self.loss_scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loss_scaler is not None and "loss_scaler" in state_dict:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])


class LossScaledFP16Precision(SkipsOverflowedSteps, MixedPrecision):
    def __init__(self, device: str, loss_scaler: DynamicLossScaler | None = None):
        super().__init__("16-mixed", device)
        self.scaler = None  # no GradScaler: Lightning neither scales nor unscales nor steps through one
        self.loss_scaler = loss_scaler or DynamicLossScaler()


class MegatronPrecision(SkipsOverflowedSteps, Precision):
    """`trainer.precision=bf16-megatron` (or `16-megatron`): bf16 (fp16) weights, fp32 main weights and gradients.

    The plugin changes no dtype itself. The module is built and initialised in fp32; the LightningModule's
    `configure_optimizers` hands it to the gradient buffer (`mlplat.parallel.data_parallel.DataParallelGrads`), which
    takes those fp32 values as the main weights and only then casts the weights to bf16 (converting here, before
    the optimizer exists, would round the main weights to bf16 from the start). No autocast and no default-dtype
    switch: the forward runs in the weights' dtype, and the loss (the vocab-parallel cross-entropy) in fp32. The
    checkpoint holds the fp32 main weights (`mlplat.checkpoint.state`), so a resume or a reshard loses nothing.

    16-megatron adds dynamic loss scaling (the training step drives `loss_scaler`, as with
    LossScaledFP16Precision); a skipped step goes through `optimizer_step` without moving the optimizer.
    """

    def __init__(self, precision: str = "bf16-megatron", loss_scaler: DynamicLossScaler | None = None):
        if not precision_of(precision).megatron:
            raise ValueError(f"trainer.precision={precision!r} is not bf16-megatron or 16-megatron")
        self.precision = precision  # type: ignore[assignment]  (Lightning's Literal does not know these names)
        scaled = precision_of(precision).loss_scaling
        self.loss_scaler = (loss_scaler or DynamicLossScaler()) if scaled else None


def precision_plugin(precision: str, device_type: str) -> Precision | None:
    """mlplat's plugin for `trainer.precision` on `device_type` ('cpu' | 'cuda'), from the precision table: the
    Megatron-style ones get MegatronPrecision, autocast with loss scaling (16-mixed) LossScaledFP16Precision; None
    for the rest, which Lightning's own `precision=` flag serves."""
    entry = precision_of(precision)
    if entry.megatron:
        return MegatronPrecision(entry.name)
    if entry.autocast and entry.loss_scaling:
        return LossScaledFP16Precision(device_type)
    return None
