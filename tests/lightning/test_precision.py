"""16-mixed through Lightning: LossScaledFP16Precision's autocast and the training step's dynamic loss scaling,
skipped steps included."""
from __future__ import annotations

import torch

from mlplat.lightning.module import DecoderModule
from mlplat.optim.loss_scale import DynamicLossScaler
from tests.helpers.kernels import make_cfg


def _fit_overflowing(tmp_path, post_validate: bool) -> dict:
    """16-mixed through Lightning (our plugin, fp16 autocast on CPU) with a huge initial scale, 4 steps and a
    validation after step 3: what each batch end saw, the module's records, the final weights and optimizer."""
    import pytorch_lightning as pl

    from mlplat.lightning.datamodule import TextDataModule
    from mlplat.lightning.precision import LossScaledFP16Precision
    from mlplat.train import build_trainer

    torch.set_num_threads(1)
    cfg = make_cfg(dict(attention="sdpa", fused=False, recompute="selective"), precision="16-mixed")
    cfg.trainer.max_steps, cfg.trainer.val_check_interval, cfg.trainer.limit_val_batches = 4, 3, 1
    cfg.optim.post_validate, cfg.optim.grad_clip = post_validate, 0.0  # the overflow alone can reject a step
    seen, records, shown = [], {}, {}

    class Record(pl.Callback):
        def on_train_start(self, trainer, module):
            module.step.loss_scaler = DynamicLossScaler(init_scale=2.0**40, backoff_factor=2.0**-30)
            seen.append(("start", None, None, {n: p.detach().clone() for n, p in module.named_parameters()}))

        def on_train_batch_end(self, trainer, module, *args):
            sc = module.step.loss_scaler
            seen.append((trainer.global_step, sc.scale, sc.skipped_steps,
                         {n: p.detach().clone() for n, p in module.named_parameters()}))
            records.update(module.records)
            loss = trainer.callback_metrics.get("train_loss")
            shown[trainer.global_step] = None if loss is None else float(loss)

    trainer = build_trainer(cfg, tmp_path / str(post_validate), extra_callbacks=[Record()])
    plugin = trainer.precision_plugin
    assert isinstance(plugin, LossScaledFP16Precision) and plugin.scaler is None  # no Lightning GradScaler
    module = DecoderModule(cfg)
    trainer.fit(module, datamodule=TextDataModule(cfg))
    records.update(module.records)
    shown["end"] = float(trainer.callback_metrics["train_loss"])
    opt = trainer.optimizers[0]
    return {"seen": seen, "records": records, "shown": shown, "trainer": trainer, "module": module,
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "adam_steps": {int(opt.state[p]["step"]) for p in module.parameters()}}


def test_fp16_overflow_skips_step_lowers_scale_and_training_continues(tmp_path):
    """A huge initial scale overflows step 1: that step leaves the parameters and the optimizer untouched, the
    scale drops, and steps 2-4 train (the synchronous run, observed at every batch end). Under optim.post_validate
    the optimizer steps before the overflow is read, which happens in step 2: step 1 is put back and skipped, step
    2's pass runs again, and the run ends bit-identical to the synchronous one. Lightning counts the skipped step
    once either way. The progress bar's (callback_metrics') train_loss is the last settled step's: under
    post-validation one step behind, the step settled at validation shown with the next one, the last at the end."""
    sync, post = _fit_overflowing(tmp_path, False), _fit_overflowing(tmp_path, True)
    (_, _, _, p0), (s1, scale1, skip1, p1), *later = sync["seen"]
    assert (s1, scale1, skip1) == (1, 2.0**10, 1)
    assert all(torch.equal(p0[n], p1[n]) for n in p0), "a skipped step must not change any parameter"
    prev = p1
    for step, scale, skipped, params in later:
        assert skipped == 1 and scale == 2.0**10
        assert any(not torch.equal(prev[n], params[n]) for n in params), f"step {step} did not train"
        prev = params
    assert [s for s, *_ in later] == [2, 3, 4]
    for run, post_validate in ((sync, False), (post, True)):
        trainer, module = run["trainer"], run["module"]
        assert trainer.global_step == 4 and run["adam_steps"] == {3}  # AdamW moved 3 times, not 4
        assert sorted(run["records"]) == [1, 2, 3, 4]
        assert [(r.loss_scale, r.skipped_steps) for r in map(run["records"].get, [1, 2, 3, 4])] == [
            (2.0**10, 1)] * 4
        assert trainer.callback_metrics["skipped_steps"] == 1 and trainer.callback_metrics["loss_scale"] == 2.0**10
        assert module.step.state_dict()["loss_scaler"]["skipped_steps"] == 1  # saved with the checkpoints
        assert module.step.redone_steps == (1 if post_validate else 0)
        assert ("redone_steps" in trainer.callback_metrics) == post_validate
    assert [r.eager for r in map(post["records"].get, [1, 2, 3, 4])] == [True, False, True, True]
    assert all(torch.equal(sync["params"][n], post["params"][n]) for n in sync["params"])
    for step in (1, 2, 3, 4):
        a, b = sync["records"][step], post["records"][step]
        assert float(a.loss) == float(b.loss) and a.lr == b.lr, (step, a, b)
    loss = {step: float(r.loss) for step, r in sync["records"].items()}
    assert sync["shown"] == {1: loss[1], 2: loss[2], 3: loss[3], 4: loss[4], "end": loss[4]}
    assert post["shown"] == {1: None, 2: loss[2], 3: loss[2], 4: loss[3], "end": loss[4]}
