"""LossScaledFP16Precision: fp16 dynamic loss scaling through Lightning, skipped steps included."""
from __future__ import annotations

import pytest
import torch

from mlplat.lightning.module import GPTModule
from mlplat.parallel.loss_scale import DynamicLossScaler
from tests.helpers.kernels import make_cfg


@pytest.mark.parametrize("post_validate", [False, True], ids=["synchronous", "post-validated"])
def test_fp16_overflow_skips_step_lowers_scale_and_training_continues(tmp_path, post_validate):
    """16-mixed through Lightning (our plugin, fp16 autocast on CPU): a huge initial scale overflows step 1;
    that step leaves the parameters and the optimizer untouched, the scale drops, and steps 2-4 train. Under
    optim.post_validate the optimizer steps before the overflow is read and is put back: Lightning counts that
    step once, as the synchronous path's skipped step."""
    import pytorch_lightning as pl

    from mlplat.lightning.datamodule import TextDataModule
    from mlplat.lightning.precision import LossScaledFP16Precision
    from mlplat.train import build_trainer

    torch.set_num_threads(1)
    cfg = make_cfg(dict(attention="sdpa", fused=False, recompute="selective"), precision="16-mixed")
    cfg.trainer.max_steps, cfg.trainer.val_check_interval = 4, 1000
    cfg.optim.post_validate, cfg.optim.grad_clip = post_validate, 0.0  # the overflow alone can reject a step
    seen = []

    class Record(pl.Callback):
        def on_train_start(self, trainer, module):
            seen.append(("start", None, None, {n: p.detach().clone() for n, p in module.named_parameters()}))

        def on_train_batch_end(self, trainer, module, *args):
            sc = trainer.precision_plugin.loss_scaler
            seen.append((trainer.global_step, sc.scale, sc.skipped_steps,
                         {n: p.detach().clone() for n, p in module.named_parameters()}))

    trainer = build_trainer(cfg, tmp_path, extra_callbacks=[Record()])
    plugin = trainer.precision_plugin
    assert isinstance(plugin, LossScaledFP16Precision) and plugin.scaler is None  # no Lightning GradScaler
    plugin.loss_scaler = DynamicLossScaler(init_scale=2.0**40, backoff_factor=2.0**-30)
    module = GPTModule(cfg)
    trainer.fit(module, datamodule=TextDataModule(cfg))

    (_, _, _, p0), (s1, scale1, skip1, p1), *later = seen
    assert (s1, scale1, skip1) == (1, 2.0**10, 1)
    assert all(torch.equal(p0[n], p1[n]) for n in p0), "a skipped step must not change any parameter"
    prev = p1
    for step, scale, skipped, params in later:
        assert skipped == 1 and scale == 2.0**10
        assert any(not torch.equal(prev[n], params[n]) for n in params), f"step {step} did not train"
        prev = params
    assert [s for s, *_ in later] == [2, 3, 4] and trainer.global_step == 4
    opt = trainer.optimizers[0]
    assert all(int(opt.state[p]["step"]) == 3 for p in module.parameters())  # AdamW moved 3 times, not 4
    assert trainer.callback_metrics["skipped_steps"] == 1 and trainer.callback_metrics["loss_scale"] == 2.0**10
    assert plugin.state_dict()["loss_scaler"]["skipped_steps"] == 1  # saved with Lightning checkpoints
    assert module.redone_steps == (1 if post_validate else 0)
    assert ("redone_steps" in trainer.callback_metrics) == post_validate
