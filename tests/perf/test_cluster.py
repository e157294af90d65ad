"""mlplat.perf.cluster: the predicted time per iteration; extrapolation equals the exact simulation, interleaving
shrinks the bubble by v."""
from __future__ import annotations

import pytest

from mlplat.perf.cluster import predict
from mlplat.perf.flops import ModelDims
from mlplat.perf.memory import Layout
from tests.helpers.perf import a100


def test_extrapolated_simulation_equals_the_exact_one():
    dims = ModelDims(48, 4096, 32, 2048, 51200)
    cl = a100()
    for lay in (Layout(tp=8, pp=8, dp=1, global_batch_size=96, schedule="1f1b"),
                Layout(tp=8, pp=8, vpp=3, dp=1, global_batch_size=96, schedule="interleaved")):
        exact = predict(dims, lay, cl)
        extra = predict(dims, lay, cl, max_compute_ops=1)
        assert exact.method == "simulated" and extra.method.startswith("extrapolated")
        assert extra.seconds_per_iteration == pytest.approx(exact.seconds_per_iteration, rel=1e-9)


def test_interleaving_shrinks_the_bubble_by_v():
    dims = ModelDims(48, 4096, 32, 2048, 51200)
    cl = a100()
    base = predict(dims, Layout(tp=8, pp=8, dp=1, global_batch_size=16, schedule="1f1b"), cl)
    inter = predict(dims, Layout(tp=8, pp=8, vpp=2, dp=1, global_batch_size=16, schedule="interleaved"), cl)
    assert base.bubble_fraction == pytest.approx(7 / 16, rel=0.15)
    assert inter.bubble_fraction == pytest.approx(7 / 32, rel=0.25)
    assert inter.seconds_per_iteration < base.seconds_per_iteration
