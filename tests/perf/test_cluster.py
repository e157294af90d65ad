"""mlplat.perf.cluster: the predicted time per iteration; extrapolation equals the exact simulation, interleaving
divides the bubble by v."""
from __future__ import annotations

import pytest

from mlplat.perf.cluster import predict
from mlplat.perf.flops import ModelDims
from mlplat.perf.memory import Layout, layout_errors
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
    """Equal chunks and free messages: the simulated bubble is the paper's (p-1)/(v·m) exactly, so v chunks per rank
    divide 1F1B's by v. With the model's own costs and free links, 1F1B's bubble is the fill and drain of the ranks
    before the bottleneck (the last stage, which holds the head): Σ_{r<p-1} T_r / (m·T_{p-1}), T_r the rank's
    forward + backward of one micro-batch. With the real links, interleaving still divides it by about v."""
    import dataclasses

    from mlplat.perf.cluster import pipeline_time

    p, m = 8, 16
    bubbles = {}
    for v in (1, 2, 4):
        lay = Layout(pp=p, vpp=v, global_batch_size=m, schedule="interleaved" if v > 1 else "1f1b")
        pipe, _, busy, _, _ = pipeline_time(lay, [1.0 / v] * (p * v), [2.0 / v] * (p * v), [[0.0] * p] * p)
        bubbles[v] = (pipe - max(busy)) / max(busy)
        assert bubbles[v] == pytest.approx((p - 1) / (v * m), rel=1e-12)
    assert bubbles[1] / bubbles[2] == pytest.approx(2, rel=1e-12) and bubbles[1] / bubbles[4] == pytest.approx(4)

    dims = ModelDims(48, 4096, 32, 2048, 51200)
    cl = a100()
    free = dataclasses.replace(cl, nvlink_gbps=1e15, ib_gbps_per_gpu=1e15, nvlink_latency_s=0.0, ib_latency_s=0.0)
    one = predict(dims, Layout(tp=8, pp=p, dp=1, global_batch_size=m, schedule="1f1b"), free)
    stage = [f + b for f, b in zip(one.chunk_forward, one.chunk_backward)]
    assert max(stage) == stage[-1]
    assert one.bubble_fraction == pytest.approx(sum(stage[:-1]) / (m * stage[-1]), rel=1e-9)

    base = predict(dims, Layout(tp=8, pp=p, dp=1, global_batch_size=m, schedule="1f1b"), cl)
    inter = predict(dims, Layout(tp=8, pp=p, vpp=2, dp=1, global_batch_size=m, schedule="interleaved"), cl)
    assert base.bubble_fraction / inter.bubble_fraction == pytest.approx(2, rel=0.05)
    assert inter.seconds_per_iteration < base.seconds_per_iteration


def test_sequence_parallel_memory_and_costs():
    """Korthikanti et al. 2022, Table 2: sequence parallelism divides the LayerNorm/dropout part (10·sbh) by t
    too; stage messages are the 1/t shard with no gather; the layers' tp communication is unchanged."""
    from mlplat.perf.cluster import allgather_time, layer_costs, p2p_time
    from mlplat.perf.memory import layer_activation_bytes

    dims = ModelDims(n_layers=8, hidden=1024, n_heads=16, seq_len=2048, vocab_size=51200)
    s, b, h, a, t = 2048, 2, 1024, 16, 4
    sbh = s * b * h
    common = dict(tp=t, pp=2, micro_batch_size=b, global_batch_size=8, precision="16-megatron",
                  attention="unfused")
    for sp, per_sbh in ((False, 10 + 24 / t), (True, 34 / t)):
        lay = Layout(sequence_parallel=sp, **common)
        assert layer_activation_bytes(dims, lay, "selective") == pytest.approx(sbh * per_sbh)
        assert layer_activation_bytes(dims, lay, "none") == pytest.approx(sbh * (per_sbh + 5 * a * s / (h * t)))
        assert layer_activation_bytes(dims, lay, "full") == pytest.approx(2 * sbh / (t if sp else 1))
    cl = a100()
    plain, sp = (layer_costs(dims, Layout(sequence_parallel=x, **common), cl) for x in (False, True))
    assert sp.transfer_intra == pytest.approx(p2p_time(2 * sbh / t, cl, False))
    assert plain.transfer_intra == pytest.approx(p2p_time(2 * sbh / t, cl, False) + allgather_time(2 * sbh, t, cl))
    assert (sp.tp_forward, sp.tp_backward) == (plain.tp_forward, plain.tp_backward)
    assert sp.layer_forward < plain.layer_forward  # LayerNorm/dropout on s/t tokens
    assert any("parallel.sequence_parallel=true needs parallel.tp > 1" in e
               for e in layout_errors(dims, Layout(tp=1, sequence_parallel=True)))


def test_megatron_precision_and_distributed_optimizer_are_faster_where_they_should_be():
    """bf16-megatron drops autocast's weight casts and fp32 residual traffic; the distributed optimizer halves the
    exposed gradient reduction (a reduce-scatter), divides the optimizer step by d and adds a weights' all-gather
    that the next forward mostly hides."""
    dims = ModelDims(24, 2048, 16, 2048, 51200)
    cl = a100()
    base = dict(tp=1, pp=1, dp=64, micro_batch_size=2, global_batch_size=128, recompute="none", attention="flash")
    autocast = predict(dims, Layout(precision="bf16-mixed", **base), cl)
    megatron = predict(dims, Layout(precision="bf16-megatron", **base), cl)
    sharded = predict(dims, Layout(precision="bf16-megatron", distributed_optimizer=True, **base), cl)
    assert megatron.seconds_per_iteration < autocast.seconds_per_iteration
    assert megatron.dp_allgather_exposed_seconds == 0.0 < sharded.dp_allgather_exposed_seconds
    assert sharded.dp_exposed_seconds < megatron.dp_exposed_seconds
    assert sharded.optimizer_seconds == pytest.approx(megatron.optimizer_seconds / 64)
    assert sharded.seconds_per_iteration < megatron.seconds_per_iteration
    bf16_reduce = predict(dims, Layout(precision="bf16-megatron", grad_reduce_dtype="bf16", **base), cl)
    assert bf16_reduce.dp_exposed_seconds < megatron.dp_exposed_seconds


def test_post_validation_times_steps_back_to_back():
    """Under optim.post_validate the GPU model times the pipeline with steps back to back (the simulator's
    steady_state_step) and lets no rank wait for the others after its flush. 1F1B, ZB-H1 and interleaving, whose idle
    time sits inside each rank's order, gain nothing; ZB-H2 with an untied output layer loses about 40% of its bubble
    here (the rest is the last stage's head, which no order hides) and so, no faster than ZB-H1 one step at a time,
    is faster back to back; ZB-V gains a little (its rank 0 holds both the embedding and the head, the bottleneck
    either way). A tied output layer under ZB-H2 keeps the step synchronous: its gradient is summed between the
    first and the last rank at every step's end."""
    from dataclasses import replace

    from mlplat.perf.cluster import back_to_back

    tied = ModelDims(48, 4096, 32, 2048, 51200)
    untied = replace(tied, tie_embeddings=False)
    cl = a100()
    one, b2b = {}, {}
    for schedule, v in (("1f1b", 1), ("zb_h1", 1), ("zb_h2", 1), ("zbv", 2), ("interleaved", 2)):
        lay = Layout(tp=8, pp=8, vpp=v, dp=1, global_batch_size=32, schedule=schedule)
        dims = tied if schedule == "zbv" else untied
        one[schedule], b2b[schedule] = predict(dims, lay, cl), predict(dims, replace(lay, post_validate=True), cl)
        assert back_to_back(dims, replace(lay, post_validate=True)) and not back_to_back(dims, lay)
    for schedule in ("1f1b", "zb_h1", "interleaved"):
        assert b2b[schedule].seconds_per_iteration == pytest.approx(one[schedule].seconds_per_iteration, rel=1e-9)
    assert b2b["zb_h2"].bubble_fraction < 0.7 * one["zb_h2"].bubble_fraction
    assert b2b["zbv"].pipeline_seconds < one["zbv"].pipeline_seconds
    assert one["zb_h2"].pipeline_seconds >= 0.95 * one["zb_h1"].pipeline_seconds
    assert b2b["zb_h2"].seconds_per_iteration < 0.96 * b2b["zb_h1"].seconds_per_iteration
    h2 = Layout(tp=8, pp=8, dp=1, global_batch_size=32, schedule="zb_h2", post_validate=True)
    assert not back_to_back(tied, h2)
    assert predict(tied, h2, cl).seconds_per_iteration == pytest.approx(
        predict(tied, replace(h2, post_validate=False), cl).seconds_per_iteration, rel=1e-9)
