"""DynamicLossScaler: scaling by 2^k is exact, the scale grows and backs off, an overflow is detected (float64)."""
from __future__ import annotations

import torch

from mlplat.optim.loss_scale import DynamicLossScaler
from mlplat.parallel.grid import ParallelGrid
from tests.helpers.kernels import VARIANTS, batch, build, grads_of, make_cfg, named_parameters, rel_diff


def test_loss_scaler_is_exact_for_powers_of_two_and_detects_overflow():
    """Scaling by 2^k and unscaling is exact in float64: scaled grads equal unscaled ones bit for bit."""
    torch.set_num_threads(1)
    grid, data = ParallelGrid(), batch()
    cfg = make_cfg(VARIANTS["plain"])
    _, ref = grads_of(cfg, grid, data)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2)
    module = build(cfg, grid)
    module.loss_scaler = scaler
    module.forward_backward(data)
    assert not module.found_inf
    assert rel_diff({n: p.grad for n, p in named_parameters(module).items()}, ref) == 0.0
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 2.0**11 and scaler.skipped_steps == 0  # grew after growth_interval clean steps
    param = module.parameters()[0]
    param.grad[0] = float("nan")
    assert scaler.unscale_(module.parameters())
    scaler.update(True)
    assert scaler.scale == 2.0**10 and scaler.skipped_steps == 1 and scaler.good_steps == 0
