"""`trainer.precision=16-mixed` with mlplat's own dynamic loss scaling, and the Megatron-style precisions
`bf16-megatron` / `16-megatron` (`MegatronPrecision`).

Lightning's `MixedPrecision("16-mixed")` brings a `torch.amp.GradScaler` that only works when Lightning runs
backward: in manual optimisation its `optimizer_step` calls `scaler.unscale_(optimizer)` and `scaler.step`
although `scaler.scale(loss)` never ran (our pipeline engine calls `torch.autograd.backward` itself), and
GradScaler refuses that ("Attempted unscale_ but _scale is None"). Lightning also silently swaps 16-mixed for
bf16-mixed on CPU. This plugin keeps Lightning's fp16 autocast on any device and drops the GradScaler: loss
scaling belongs to the training step (`mlplat.step.TrainStep.loss_scaler`, a
`mlplat.optim.loss_scale.DynamicLossScaler` made from the precision table), which scales the loss in the engine,
unscales after the reductions, all-reduces an inf/NaN flag and skips or steps; its state is in the checkpoints.
"""
from __future__ import annotations

from pytorch_lightning.plugins.precision import MixedPrecision, Precision

from mlplat.precision import precision_of


class LossScaledFP16Precision(MixedPrecision):
    def __init__(self, device: str):
        super().__init__("16-mixed", device)
        self.scaler = None  # no GradScaler: Lightning neither scales nor unscales nor steps through one


class MegatronPrecision(Precision):
    """`trainer.precision=bf16-megatron` (or `16-megatron`): bf16 (fp16) weights, fp32 main weights and gradients.

    The plugin changes no dtype itself. The chunks are built and initialised in fp32; the training step's gradient
    buffer (`mlplat.optim.buffers.ParamBuffers`) takes those fp32 values as the main weights and only
    then casts the weights to bf16 (converting here, before the optimizer exists, would round the main weights to
    bf16 from the start). No autocast and no default-dtype switch: the forward runs in the weights' dtype, and the
    loss (the vocab-parallel cross-entropy) in fp32. The checkpoint holds the fp32 main weights
    (`mlplat.checkpoint.state`), so a resume or a reshard loses nothing. 16-megatron adds the training step's
    dynamic loss scaling, as 16-mixed does.
    """

    def __init__(self, precision: str = "bf16-megatron"):
        if not precision_of(precision).megatron:
            raise ValueError(f"trainer.precision={precision!r} is not bf16-megatron or 16-megatron")
        self.precision = precision  # type: ignore[assignment]  (Lightning's Literal does not know these names)


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
