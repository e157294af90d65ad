"""Megatron-style mixed precision and the distributed optimizer, driven through TrainStep without a Trainer.

- bf16-megatron: the weights are bf16 between steps, the optimizer holds fp32 main weights and moments, the
  gradients accumulate in fp32 main gradients, a training step casts no weight (bf16-mixed's autocast does, which
  shows the check can fail), and pipeline messages are bf16; optim.grad_reduce_dtype=bf16 reduces in bf16.
- 16-megatron: fp16 weights; the loss scaler skips an overflowing step and unscales the fp32 main gradients.
- optim.distributed: the optimizer state bytes a rank holds fall as 1/dp (dp = 1, 2, 4, measured on the real
  optimizer); a float64 checkpoint saved under tp2·dp2 with the distributed optimizer resumes under dp4 (sharded)
  and under dp4 with torch's AdamW, to the loss of the uninterrupted run; and a sharded step creates nothing
  off the parallel device (run under an ambient `meta` default device).
The end-to-end proofs (per-step loss equal to one process in float64 at dp2, dp4, tp2·pp2·dp2; a bit-exact
bf16-megatron resume) are CLI runs: tests/cli/test_train.py, tests/cli/test_checkpoint.py.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlplat.optim.loss_scale import DynamicLossScaler
from mlplat.optim.main_params import MainParamsAdamW, optimizer_state_bytes
from mlplat.parallel.grid import ParallelGrid
from mlplat.step import TrainStep
from tests.helpers.dist import run_distributed
from tests.helpers.equivalence import build_module, local_batches, make_cfg
from tests.helpers.kernels import named_parameters


def _megatron_module(grid: ParallelGrid, precision: str = "bf16-megatron", distributed: bool = False,
                     grad_reduce_dtype: str = "main", **layout):
    """The tiny GPT in fp32 as built, with its optimizer configured (which casts the weights to bf16)."""
    cfg = make_cfg(grad_clip=1.0, **layout)
    cfg.trainer.precision, cfg.optim.distributed = precision, distributed
    cfg.optim.grad_reduce_dtype = grad_reduce_dtype
    module = TrainStep(cfg, grid)
    return cfg, module, module.optimizer


def _pass(module, batch, scaler=None):
    """forward_backward under `scaler` (None: unscaled)."""
    module.loss_scaler = scaler
    return module.forward_backward(batch)


def _train(module, opt, batches, scaler=None):
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss, _ = _pass(module, batch, scaler)
        opt.step()
        losses.append(float(loss))
    return losses


# -- bf16-megatron: dtypes, no weight casts ------------------------------------------------------------------
def test_bf16_megatron_weights_are_bf16_and_the_optimizer_holds_fp32():
    torch.set_num_threads(1)
    cfg, module, opt = _megatron_module(ParallelGrid())
    fp32 = {n: p.detach().clone() for n, p in named_parameters(module).items()}  # (already cast: compare via main)
    main = module.grads
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert all(t.dtype == torch.float32 for t in main.state_tensors())  # main weights, exp_avg, exp_avg_sq
    assert len(main.state_tensors()) == 3 * len(main.buckets)
    # The main weights start from the fp32 initialisation, not from its bf16 rounding.
    assert any((b.main != b.main.to(torch.bfloat16).float()).any() for b in main.buckets)
    _train(module, opt, local_batches(cfg, 0, 2))
    for p in module.parameters():
        assert p.dtype == torch.bfloat16 and p.grad is None and p.main_grad.dtype == torch.float32
    for b in main.buckets:
        # Between steps the bf16 weights are the rounding of the fp32 main weights, which keep more bits.
        assert torch.equal(b.param_flat[b.lo:b.hi], b.main.to(torch.bfloat16))
        assert (b.main != b.main.to(torch.bfloat16).float()).any()
        assert b.state["exp_avg"].abs().sum() > 0 and b.state["exp_avg_sq"].dtype == torch.float32
    assert any(not torch.equal(fp32[n], p) for n, p in named_parameters(module).items())  # it trained


def test_fp16_megatron_skips_an_overflowing_step_and_unscales_the_main_gradients():
    """16-megatron: fp16 weights, the dynamic loss scaler on the fp32 main gradients. A huge initial scale
    overflows: the step must be skipped (the caller's rule) and the scale backs off; at the lower scale the
    unscaled main gradients equal those of an unscaled step, to fp16's rounding of the backward."""
    torch.set_num_threads(1)
    cfg, module, opt = _megatron_module(ParallelGrid(), precision="16-megatron")
    assert all(p.dtype == torch.float16 for p in module.parameters())
    batch = local_batches(cfg, 0, 1)[0]
    scaler = DynamicLossScaler(init_scale=2.0**40, backoff_factor=2.0**-28)
    _, norm = _pass(module, batch, scaler)
    assert module.found_inf and math.isinf(float(norm))
    scaler.update(True)
    assert scaler.scale == 2.0**12
    opt.zero_grad()
    _pass(module, batch, scaler)
    assert not module.found_inf
    scaled = [g.clone() for g in module.grads.shard_grads()]
    opt.zero_grad()
    _pass(module, batch)
    for a, b in zip(scaled, module.grads.shard_grads()):  # (elementwise, unscaled fp16 loses small gradients)
        assert float((a - b).norm()) < 1e-2 * float(b.norm())
    _train(module, opt, [batch], scaler)
    assert all(p.dtype == torch.float16 and bool(torch.isfinite(p).all()) for p in module.parameters())


class _Casts(TorchDispatchMode):
    """Counts dtype conversions whose source is a parameter's storage (a weight cast)."""

    def __init__(self, storages: set[int]):
        super().__init__()
        self.storages, self.casts = storages, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            src = args[0]
            if src.untyped_storage().data_ptr() in self.storages and kwargs.get("dtype") not in (None, src.dtype):
                self.casts += 1
        return func(*args, **(kwargs or {}))


def _weight_casts(module, batch, autocast: bool) -> int:
    spy = _Casts({p.untyped_storage().data_ptr() for p in module.parameters()})
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with spy, ctx:
        module.forward_backward(batch)
    return spy.casts


def test_bf16_megatron_step_casts_no_weight_where_autocast_casts_every_one():
    torch.set_num_threads(1)
    cfg, module, opt = _megatron_module(ParallelGrid())
    batch = local_batches(cfg, 0, 1)[0]
    assert _weight_casts(module, batch, autocast=False) == 0
    # Lightning's bf16-mixed: fp32 weights, autocast casts them to bf16 in every forward.
    cfg32 = make_cfg()
    cfg32.trainer.precision = "32-true"
    plain = TrainStep(cfg32, ParallelGrid())
    assert plain.optimizer is not None
    assert _weight_casts(plain, batch, autocast=True) >= cfg.model.n_layers * 4  # qkv, out, fc1, fc2 at least


# -- one spawned group of 4 ranks ----------------------------------------------------------------------------
def _world4(rank, world_size, root):
    """Optimizer bytes at dp4; bf16-megatron with the distributed optimizer under pp2·dp2 (the dtype of every
    stage-to-stage message); a float64 tp2·dp2 distributed-optimizer checkpoint at step 2, resumed under dp4
    (distributed), dp4 (torch's AdamW) and dp4 (main parameters, not sharded); a sharded step under an ambient
    meta device."""
    import torch.distributed as dist

    from mlplat.checkpoint import io
    from mlplat.parallel.pipeline import p2p

    out = {}
    _, _, opt = _megatron_module(ParallelGrid(1, 1, 4), distributed=True, dp=4)
    out["bytes_dp4"] = optimizer_state_bytes(opt)

    # The gradients reduced in bf16 (optim.grad_reduce_dtype=bf16), and in fp32 for comparison.
    cfg, module, opt = _megatron_module(ParallelGrid(1, 2, 2), distributed=True, pp=2, dp=2)
    out["megatron_pp2_dp2_fp32_reduce"] = _train(module, opt, local_batches(cfg, module.grid.dp_rank, 2))
    cfg, module, opt = _megatron_module(ParallelGrid(1, 2, 2), distributed=True, grad_reduce_dtype="bf16", pp=2,
                                        dp=2)
    seen = []
    real_isend = p2p.dist.isend

    def isend(tensor, *args, **kwargs):
        seen.append(tensor.dtype)
        return real_isend(tensor, *args, **kwargs)

    p2p.dist.isend = isend
    try:
        out["megatron_pp2_dp2"] = _train(module, opt, local_batches(cfg, module.grid.dp_rank, 2))
    finally:
        p2p.dist.isend = real_isend
    out["message_dtypes"] = sorted({str(d) for d in seen})

    def run(tp, dp, optimizer, load=None, save=None, meta=False):
        cfg = make_cfg(tp=tp, dp=dp, grad_clip=1.0)
        cfg.optim.distributed = optimizer == "sharded"
        grid = ParallelGrid(tp, 1, dp)
        module = build_module(cfg, grid)  # float64
        opt = module.optimizer  # the LR stays at its first step's value: no schedule
        if optimizer == "flat":  # main parameters without sharding (what the Megatron precisions use), in float64
            opt = MainParamsAdamW(module.grads, opt.param_groups, lr=cfg.optim.lr, betas=cfg.optim.betas,
                                  eps=cfg.optim.eps)
        batches = local_batches(cfg, grid.dp_rank, 3)
        if load is not None:
            io.load(load, module.chunks, opt, grid, cfg.model.vocab_size)
            return _train(module, opt, batches[2:])
        # step 3's batch under the initial weights: what a resume that loaded nothing sees
        out["untrained"] = float(module.evaluate(batches[2]))
        losses = _train(module, opt, batches[:2])
        io.save(save, module.chunks, opt, grid, {"global_step": 2}, {"tp": tp, "dp": dp})
        losses += _train(module, opt, batches[2:])
        if meta:  # the same step again: a tensor the step creates without naming its device lands on meta
            opt.zero_grad()
            reference = module.forward_backward(batches[2])
            opt.zero_grad()
            with torch.device("meta"):
                loss, norm = module.forward_backward(batches[2])
                opt.step()
                module.grads.wait()
            out["meta"] = (float(loss), float(reference[0]), float(norm), float(reference[1]), loss.device.type,
                           all(p.device.type == "cpu" and bool(torch.isfinite(p).all()) for p in module.parameters()))
        return losses

    out["saved"] = run(2, 2, "sharded", save=root + "/step-2", meta=True)
    dist.barrier()
    out["dp4_distributed"] = run(1, 4, "sharded", load=root + "/step-2")
    out["dp4_torch_adamw"] = run(1, 4, "torch", load=root + "/step-2")
    out["dp4_flat_not_sharded"] = run(1, 4, "flat", load=root + "/step-2")
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_distributed(_world4, 4, str(tmp_path_factory.mktemp("dist_opt")), timeout=300)


def test_stage_messages_are_bf16_and_gradients_reduce_in_bf16(world4):
    for r in world4:
        assert r["message_dtypes"] == ["torch.bfloat16"]
        losses = r["megatron_pp2_dp2"]
        assert all(math.isfinite(x) for x in losses) and losses == world4[0]["megatron_pp2_dp2"]
        # A bf16 reduction of the gradients moves step 2's loss by bf16 rounding only.
        assert losses[0] == r["megatron_pp2_dp2_fp32_reduce"][0]
        assert abs(losses[1] - r["megatron_pp2_dp2_fp32_reduce"][1]) < 1e-2


def _bytes_on_rank0(dp: int) -> int:
    """The optimizer state rank 0 of a dp-way layout holds, built on a virtual grid (no processes needed: setting
    up the optimizer communicates nothing)."""
    _, _, opt = _megatron_module(ParallelGrid(1, 1, dp, rank=0, virtual=True), distributed=dp > 1, dp=dp)
    return optimizer_state_bytes(opt)


def test_optimizer_state_bytes_fall_as_one_over_dp(world4):
    """bf16-megatron with optim.distributed=true: fp32 main weights and two moments, 12 bytes per parameter at
    dp=1, 1/dp of it per rank at dp = 2, 4, up to each bucket's padding to a multiple of 64·dp elements. dp=4 is
    also measured on the 4 real ranks (each holds the same share)."""
    torch.set_num_threads(1)
    _, module, opt = _megatron_module(ParallelGrid(), distributed=True)
    one = optimizer_state_bytes(opt)
    n_params = sum(p.numel() for p in module.parameters())
    assert 12 * n_params <= one <= 12 * (n_params + 64 * (len(list(module.parameters())) + 1))  # alignment gaps
    slack = 12 * 64 * len(module.grads.buckets)  # a bucket's end padding, per dp shard
    measured = {1: one, 2: _bytes_on_rank0(2), 4: _bytes_on_rank0(4)}
    assert all(r["bytes_dp4"] == measured[4] for r in world4)
    for dp in (2, 4):
        assert abs(measured[dp] * dp - one) <= dp * slack, (dp, measured[dp], one)
    print(f"optimizer state bytes per rank: {measured}")


def test_distributed_checkpoint_resumes_under_another_dp_and_optimizer(world4):
    """Saved at step 2 under tp2·dp2 (flat-range shards of every parameter, tp-split ones at their tp offsets):
    step 3 under dp4 (sharded differently), under dp4 with torch's AdamW and under dp4 with unsharded main
    parameters (all-reduced, as bf16-megatron without optim.distributed) equals the uninterrupted step 3."""
    for r in world4:
        expected = r["saved"][2]
        for name in ("dp4_distributed", "dp4_torch_adamw", "dp4_flat_not_sharded"):
            (got,) = r[name]
            assert abs(got - expected) <= 1e-12 * abs(expected), (name, got, expected)
        assert abs(r["untrained"] - expected) > 1e-3  # the loaded weights are not the initial ones


def test_sharded_step_creates_nothing_off_the_parallel_device(world4):
    for r in world4:
        loss, ref_loss, norm, ref_norm, device, params_ok = r["meta"]
        assert device == "cpu" and params_ok
        assert loss == ref_loss and norm == ref_norm


def _singleton_groups(rank, world_size):
    """One process with a process group: bf16-megatron with the distributed optimizer, profiled, on a grid whose
    groups of one rank exist (every collective of the step runs) and on one where they are None (skipped)."""
    from mlplat.parallel.profile import Recorder

    out = {}
    for singletons in (False, True):
        grid = ParallelGrid(1, 1, 1, singleton_groups=singletons)
        cfg, module, opt = _megatron_module(grid, distributed=True)
        recorder = Recorder()
        module.watch.recorder = recorder
        with recorder.recording(grid):
            losses = _train(module, opt, local_batches(cfg, 0, 2))
        out[singletons] = (losses, sorted(f"{s.category}:{s.name}" for s in recorder.spans
                                          if s.category.endswith("_comm")), grid.dp_group is not None)
    return out


def test_singleton_groups_run_every_collective_and_change_nothing():
    """What the GPU check (MLPLAT_SINGLETON_GROUPS=1) relies on to meet NCCL's rules on one GPU."""
    out = run_distributed(_singleton_groups, 1, timeout=120)[0]
    (plain, plain_comm, plain_dp), (single, single_comm, single_dp) = out[False], out[True]
    assert plain == single and not plain_dp and single_dp
    assert len(single_comm) > len(plain_comm), (plain_comm, single_comm)
