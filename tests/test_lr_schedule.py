"""The learning-rate schedule: linear warm-up, then cosine decay from optim.lr to optim.min_lr at the last step."""
from __future__ import annotations

import math

import pytest

from mlplat.config import OptimConfig
from mlplat.lr_schedule import lr_factor


def test_warmup_then_cosine_to_min_lr():
    o = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    lr = [lr_factor(step, o, 110) * o.lr for step in range(120)]
    assert lr[:10] == pytest.approx([o.lr * (k + 1) / 10 for k in range(10)])  # linear warm-up to lr
    assert lr[10] == pytest.approx(o.lr)
    assert lr[60] == pytest.approx((o.lr + o.min_lr) / 2)  # half-way through the decay: cos(pi/2) = 0
    assert lr[35] == pytest.approx(o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi / 4)))
    assert lr[110] == pytest.approx(o.min_lr) and lr[119] == pytest.approx(o.min_lr)  # held after max_steps
    assert all(a >= b for a, b in zip(lr[10:], lr[11:]))


def test_no_warmup():
    o = OptimConfig(lr=2e-3, min_lr=0.0, warmup_steps=0)
    assert lr_factor(0, o, 100) == pytest.approx(1.0)
    assert lr_factor(100, o, 100) == pytest.approx(0.0)
