"""mlplat.perf.memory: memory per GPU by hand (weights, gradients, optimizer state, activations), and the
micro-batches in flight per rank against the simulated schedules."""
from __future__ import annotations

import pytest

from mlplat.perf.flops import ModelDims
from mlplat.perf.memory import Layout, in_flight, memory_per_gpu, stored_layers


def test_memory_by_hand():
    dims = ModelDims(n_layers=4, hidden=64, n_heads=4, seq_len=32, vocab_size=128)
    lay = Layout(tp=1, pp=2, vpp=1, dp=1, micro_batch_size=2, global_batch_size=8, schedule="1f1b",
                 recompute="full", precision="16-megatron")
    P0 = 2 * (12 * 64 * 64 + 13 * 64) + 128 * 64 + 32 * 64
    r0 = memory_per_gpu(dims, lay, 0, overhead_bytes=0)
    sbh = 32 * 2 * 64
    assert r0.parameters == P0
    assert r0.breakdown["weights"] == 2 * P0 and r0.breakdown["gradients"] == 4 * P0  # fp32 main gradients
    assert r0.breakdown["optimizer_state"] == 12 * P0
    assert r0.breakdown["activations"] == 2 * 2 * 2 * sbh  # min(p - 0, m)=2 micro-batches x 2 layers x 2sbh
    assert r0.breakdown["working_set"] == pytest.approx(sbh * (34 + 5 * 4 * 32 / 64))  # Korthikanti, t = 1
    assert r0.breakdown["logits"] == 0
    r1 = memory_per_gpu(dims, lay, 1, overhead_bytes=0)
    assert r1.breakdown["activations"] == 1 * 2 * 2 * sbh
    assert r1.breakdown["logits"] == 10 * 32 * 2 * 128
    # No recomputation with t = 2: s·b·h·(10 + 24/t + 5·a·s/(h·t)) per layer.
    lay2 = Layout(tp=2, pp=1, dp=1, micro_batch_size=2, global_batch_size=2, recompute="none",
                  precision="16-megatron", attention="unfused")
    r = memory_per_gpu(dims, lay2, 0, overhead_bytes=0)
    assert r.breakdown["activations"] == pytest.approx(4 * sbh * (10 + 12 + 5 * 4 * 32 / (64 * 2)))
    # Autocast (Lightning bf16-mixed): fp32 weights and grads, 8 bytes of Adam state, fp32 residual kept.
    r = memory_per_gpu(dims, Layout(pp=1, micro_batch_size=2, global_batch_size=2, recompute="full"), 0)
    assert r.breakdown["weights"] == 4 * r.parameters and r.breakdown["optimizer_state"] == 8 * r.parameters
    assert r.breakdown["activations"] == 4 * 4 * sbh


def test_uneven_stages_weigh_each_chunk_by_its_layers():
    """Activations are counted in layers: with an even split the in-flight micro-batches x l/p; with uneven ends the
    chunks' own layers. 1F1B over [1, 3, 3, 1] at m = 8: rank r holds min(p - r, m) micro-batches of its layers."""
    even = Layout(pp=4, micro_batch_size=1, global_batch_size=8)
    assert [stored_layers(even, 8, r)[0] for r in range(4)] == [in_flight("1f1b", 4, 1, 8, r) * 2 for r in range(4)]
    uneven = Layout(pp=4, micro_batch_size=1, global_batch_size=8, first_stage_layers=1, last_stage_layers=1)
    assert [stored_layers(uneven, 8, r)[0] for r in range(4)] == [4 * 1, 3 * 3, 2 * 3, 1 * 1]
    dims = ModelDims(n_layers=8, hidden=64, n_heads=4, seq_len=32, vocab_size=128)
    m0, m1 = memory_per_gpu(dims, uneven, 0), memory_per_gpu(dims, even, 0)
    assert m0.breakdown["activations"] == pytest.approx(m1.breakdown["activations"] / 2)  # 4 x 1 layer, not 4 x 2
    assert m0.parameters < m1.parameters  # one layer, not two


@pytest.mark.parametrize("kind,p,v,m", [("1f1b", 4, 1, 8), ("1f1b", 4, 1, 2), ("gpipe", 3, 1, 5),
                                        ("interleaved", 4, 2, 8), ("interleaved", 4, 3, 4), ("interleaved", 2, 4, 6)])
def test_in_flight_matches_the_simulated_schedule(kind, p, v, m):
    from mlplat.parallel.layout.schedules import build_schedule
    from mlplat.perf.simulator import simulate

    res = simulate(build_schedule(kind, p, v, m), v=v)
    assert [in_flight(kind, p, v, m, r) for r in range(p)] == pytest.approx(res.peak_in_flight_micro_batches)


def test_megatron_precision_and_distributed_optimizer_state():
    """bf16-megatron: 2-byte weights, 4-byte fp32 main gradients, 12 bytes of fp32 main weights and moments (18,
    Megatron's). optim.distributed divides the optimizer state, and only it, by d (64-true: 16 bytes of moments)."""
    dims = ModelDims(n_layers=4, hidden=64, n_heads=4, seq_len=32, vocab_size=128)
    base = dict(pp=1, dp=4, micro_batch_size=2, global_batch_size=8, recompute="full")
    r = memory_per_gpu(dims, Layout(precision="bf16-megatron", **base), 0, overhead_bytes=0)
    P = r.parameters
    assert (r.breakdown["weights"], r.breakdown["gradients"], r.breakdown["optimizer_state"]) == (2 * P, 4 * P, 12 * P)
    sbh = 32 * 2 * 64
    assert r.breakdown["activations"] == 4 * 2 * sbh  # bf16 residual stream, unlike autocast's fp32
    d = memory_per_gpu(dims, Layout(precision="bf16-megatron", distributed_optimizer=True, **base), 0,
                       overhead_bytes=0)
    assert d.breakdown["optimizer_state"] == 3 * P and d.breakdown["gradients"] == 4 * P
    assert d.total == r.total - 9 * P
    f64 = memory_per_gpu(dims, Layout(precision="64-true", distributed_optimizer=True, **base), 0, overhead_bytes=0)
    assert f64.breakdown["optimizer_state"] == 16 * P / 4 and f64.breakdown["weights"] == 8 * P


def test_messages_in_flight_are_counted():
    """Each pipeline message is [b, s, h/t] (scatter/gather or sequence parallelism; else [b, s, h]) in the compute
    dtype: 2 bytes under every bf16/fp16 precision, 4 under 32-true, 8 under 64-true; the engine's exchange plan
    says how many a rank holds at once (`exchange.in_flight_messages`), and the total counts them."""
    from mlplat.parallel.layout.exchange import in_flight_messages
    from mlplat.perf.memory import message_bytes, messages_in_flight

    dims = ModelDims(n_layers=8, hidden=64, n_heads=4, seq_len=32, vocab_size=128)
    base = dict(tp=2, pp=4, dp=1, micro_batch_size=2, global_batch_size=16, recompute="full")
    for precision, elem in (("bf16-mixed", 2), ("bf16-megatron", 2), ("16-megatron", 2),
                            ("32-true", 4), ("64-true", 8)):
        for sg, sp, width in ((True, False, 32), (False, True, 32), (False, False, 64)):
            lay = Layout(precision=precision, scatter_gather=sg, sequence_parallel=sp, **base)
            assert message_bytes(dims, lay) == 2 * 32 * width * elem, (precision, sg, sp)
    lay = Layout(precision="bf16-megatron", **base)
    n = in_flight_messages(lay.pipeline, lay.num_micro_batches)
    assert messages_in_flight(lay) == n > 0
    r = memory_per_gpu(dims, lay, 0, overhead_bytes=0)
    assert r.breakdown["messages"] == n * 2 * 32 * 32 * 2
    assert r.total == sum(v for k, v in r.breakdown.items())
    # No pipeline, no messages.
    assert memory_per_gpu(dims, Layout(precision="bf16-megatron", **{**base, "pp": 1}), 0).breakdown["messages"] == 0


@pytest.mark.parametrize("kind,p,v", [("gpipe", 3, 1), ("1f1b", 2, 1), ("1f1b", 4, 1), ("interleaved", 2, 2),
                                      ("interleaved", 4, 3), ("zb_h1", 3, 1), ("zbv", 3, 2)])
def test_message_count_is_flat_past_2p(kind, p, v):
    """The memory model counts the messages on a schedule of min(m, 2p) micro-batches (the count of a large m
    costs seconds at p = 64): exact, because the engine's count does not grow past that."""
    from mlplat.parallel.layout.exchange import in_flight_messages
    from mlplat.parallel.layout.pipeline import PipelineLayout
    from mlplat.perf.memory import messages_in_flight

    for m in (2 * p, 3 * p, 8 * p):
        lay = Layout(pp=p, vpp=v, schedule=kind, micro_batch_size=1, global_batch_size=m)
        assert messages_in_flight(lay) == in_flight_messages(PipelineLayout(p, v, kind), m), m


def test_in_flight_counted_on_the_schedule_gives_the_papers_counts_past_the_cap():
    """Counted on a schedule of at most 4p micro-batches: 1F1B's min(p - r, m) and Megatron's interleaved warm-up
    plus one, min(2(p-r-1) + (v-1)p + 1, m·v) chunks, for m well past the cap too; GPipe holds all m."""
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 5 * p, 12 * p):
            for r in range(p):
                assert in_flight("1f1b", p, 1, m, r) == min(p - r, m)
                assert in_flight("gpipe", p, 1, m, r) == m
                for v in (2, 3):
                    assert in_flight("interleaved", p, v, m, r) == min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) / v


def test_v_half_fits_the_1t_model_where_zb_h1_does_not():
    """gpt1t (t8·p64·d6, full recomputation, bf16-megatron, distributed optimizer) on 80 GB: ZB-H1's W residue of
    p micro-batches does not fit, V-Half's p/2 does; both hold more than 1F1B, which defers no W."""
    from mlplat.perf.memory import memory_per_stage, pending_weight_gradients

    dims = ModelDims(n_layers=128, hidden=25600, n_heads=160, seq_len=2048, vocab_size=51200)
    worst = {}
    for kind, v in (("1f1b", 1), ("zb_h1", 1), ("v_half", 2)):
        lay = Layout(tp=8, pp=64, vpp=v, dp=6, micro_batch_size=1, global_batch_size=3072, schedule=kind,
                     recompute="full", precision="bf16-megatron", sequence_parallel=True,
                     distributed_optimizer=True)
        worst[kind] = max(r.total for r in memory_per_stage(dims, lay)) / 2**30
    assert worst["zb_h1"] > 80 > worst["v_half"] > worst["1f1b"], worst
    m = 512
    assert max(pending_weight_gradients("v_half", 64, 2, m, r) for r in range(64)) == 32
    assert max(in_flight("v_half", 64, 2, m, r) for r in range(64)) == 32
