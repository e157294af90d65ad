"""mlplat.perf.host and mlplat.perf.cpu_model: a box whose ranks are processes sharing cores, with figures measured
by experiments/calibrate/calibrate.py. No timing here: the model is checked against its own formulas."""
from __future__ import annotations

import pytest

from mlplat.config import load_config
from mlplat.perf.cluster import Cluster, predict
from mlplat.perf.flops import ModelDims, parameter_count
from mlplat.perf.memory import Layout
from tests.helpers.perf import a100

_HOST_KEYS = dict(cpu_cores=2.0, cpu_background=0.0, cpu_gemm_gflops=50.0, cpu_memory_gbps=20.0, cpu_op_us=5.0,
                  cpu_backward_op_us=6.0, cpu_optimizer_us_per_tensor=15.0, cpu_optimizer_ns_per_param=8.0,
                  cpu_idle_wakeup_us=0.0, cpu_wakeup_us=300.0, cpu_loop_us=4000.0)


def _cpu(**over) -> Cluster:
    return Cluster.from_config({"name": "local_cpu", "device": "cpu", "gpus_per_node": 8, "nvlink_gbps": 8.0,
                                "nvlink_latency_us": 100.0, "nvlink_efficiency": 1.0, **_HOST_KEYS, **over})


def test_cpu_prediction_is_the_calibrated_model_by_hand():
    """One process, one micro-batch: the step is the blocks' op, GEMM and memory terms plus optimizer and loop."""
    from mlplat.perf.host import block_work, parameter_tensors

    dims = ModelDims(n_layers=2, hidden=64, n_heads=4, seq_len=32, vocab_size=256)
    lay = Layout(micro_batch_size=2, global_batch_size=4, recompute="none", precision="32-true")
    cl = _cpu()
    assert cl.host is not None and cl.host.cores == 2.0
    w = block_work(dims, 2, 1)
    h = cl.host
    per_mb = (dims.n_layers * (h.seconds(w["layer"][0]) + h.seconds(w["layer"][1], True))
              + h.seconds(w["embedding"][0]) + h.seconds(w["embedding"][1], True)
              + h.seconds(w["head"][0]) + h.seconds(w["head"][1], True))
    params = parameter_count(dims)
    rest = h.optimizer_seconds(parameter_tensors(2, True, True, False), params) + 4000e-6
    assert predict(dims, lay, cl).seconds_per_iteration == pytest.approx(2 * per_mb + rest, rel=1e-9)
    # Each figure moves the prediction by its own term: halving the GEMM rate adds the GEMM time once more.
    gemm = 2 * sum(x.flops for x in (*w["layer"], *w["layer"])) / 50e9 + 2 * sum(
        x.flops for x in (*w["embedding"], *w["head"])) / 50e9
    slower = predict(dims, lay, _cpu(cpu_gemm_gflops=25.0)).seconds_per_iteration
    assert slower - predict(dims, lay, cl).seconds_per_iteration == pytest.approx(gemm, rel=1e-9)


def test_cpu_processes_share_the_cores():
    """dp=4 on 2 cores: each replica's compute runs 2x slower; a tp all-reduce pays its gloo time and hand-offs."""
    dims = ModelDims(n_layers=2, hidden=64, n_heads=4, seq_len=32, vocab_size=256)
    cl = _cpu(cpu_wakeup_us=0.0, cpu_loop_us=0.0, cpu_optimizer_us_per_tensor=0.0, cpu_optimizer_ns_per_param=0.0)
    one = predict(dims, Layout(micro_batch_size=1, global_batch_size=4, recompute="none", precision="32-true"), cl)
    four = predict(dims, Layout(dp=4, micro_batch_size=1, global_batch_size=16, recompute="none",
                                precision="32-true"), cl)
    assert four.pipeline_seconds == pytest.approx(2 * one.pipeline_seconds, rel=1e-9)
    two = predict(dims, Layout(dp=2, micro_batch_size=1, global_batch_size=8, recompute="none",
                               precision="32-true"), cl)
    assert two.pipeline_seconds == pytest.approx(one.pipeline_seconds, rel=1e-9)  # 2 ranks, 2 cores
    # A pipeline's ranks that idle in the bubble leave their cores to the others: pp4 on 2 cores is slower than on
    # 4, but less than 2x, as it would be if all four computed all the time.
    pp4 = Layout(pp=4, micro_batch_size=1, global_batch_size=4, recompute="none", precision="32-true")
    dims4 = ModelDims(n_layers=4, hidden=64, n_heads=4, seq_len=32, vocab_size=256)
    shared, alone = (predict(dims4, pp4, _cpu(cpu_cores=c, cpu_wakeup_us=0.0)).pipeline_seconds for c in (2.0, 4.0))
    assert alone < shared < 1.9 * alone
    # A hand-off waits for a turn only when the ranks crowd the cores, and to wake an idle core only when they don't.
    tp2 = Layout(tp=2, micro_batch_size=1, global_batch_size=4, recompute="none", precision="32-true")
    tp4 = Layout(tp=4, micro_batch_size=1, global_batch_size=4, recompute="none", precision="32-true")
    free = dict(cpu_loop_us=0.0, cpu_optimizer_us_per_tensor=0.0, cpu_optimizer_ns_per_param=0.0)
    for lay, crowded in ((tp2, False), (tp4, True)):
        quiet = predict(dims, lay, cl).seconds_per_iteration
        turns = predict(dims, lay, _cpu(**free)).seconds_per_iteration
        wakes = predict(dims, lay, _cpu(**free, cpu_wakeup_us=0.0, cpu_idle_wakeup_us=500.0)).seconds_per_iteration
        assert (turns > quiet) is crowded and (wakes > quiet) is not crowded


def test_cpu_model_times_post_validated_steps_back_to_back():
    """Under optim.post_validate the CPU model times the pipeline as the GPU model does, with steps back to back,
    at the busy counts of steps run that way: with a core per rank ZB-H2 (untied output layer) loses its bubble,
    and on 2 cores, where its idle ranks used to leave their cores to the others, gains less; 1F1B, whose idle time
    sits inside each rank's order, gains nothing in its pipeline; no rank waits for the grad-norm and loss
    all-reduces after its flush. A tied output layer keeps ZB-H2's steps synchronous."""
    from dataclasses import replace

    untied = ModelDims(n_layers=8, hidden=64, n_heads=4, seq_len=32, vocab_size=256, tie_embeddings=False)
    base = dict(pp=4, micro_batch_size=1, global_batch_size=8, recompute="none", precision="32-true")
    gain, bubble = {}, {}
    for cores in (4.0, 2.0):
        cl = _cpu(cpu_cores=cores)
        one, b2b = {}, {}
        for schedule in ("1f1b", "zb_h2"):
            lay = Layout(schedule=schedule, **base)
            one[schedule] = predict(untied, lay, cl)
            b2b[schedule] = predict(untied, replace(lay, post_validate=True), cl)
            assert b2b[schedule].seconds_per_iteration == pytest.approx(  # t = d = 1, untied: nothing else after it
                b2b[schedule].pipeline_seconds + b2b[schedule].optimizer_seconds, rel=1e-12)
        assert b2b["1f1b"].pipeline_seconds == pytest.approx(one["1f1b"].pipeline_seconds, rel=1e-4)
        assert b2b["1f1b"].seconds_per_iteration < one["1f1b"].seconds_per_iteration
        assert one["zb_h2"].bubble_fraction > 0.1
        gain[cores] = one["zb_h2"].pipeline_seconds / b2b["zb_h2"].pipeline_seconds
        bubble[cores] = b2b["zb_h2"].bubble_fraction
        assert bubble[cores] < one["zb_h2"].bubble_fraction
        h2 = Layout(schedule="zb_h2", post_validate=True, **base)
        tied = replace(untied, tie_embeddings=True)
        assert predict(tied, h2, cl).seconds_per_iteration == pytest.approx(
            predict(tied, replace(h2, post_validate=False), cl).seconds_per_iteration, rel=1e-12)
    assert gain[4.0] > gain[2.0] > 1.0
    assert bubble[4.0] == pytest.approx(0.0, abs=1e-3)


def test_gpu_predictions_do_not_use_the_cpu_model():
    """Figures of the roofline path: GPU clusters do not take the CPU model's (since the CPU model's start, the only
    changes: the stage messages in the GEMMs' dtype under autocast, bf16 as the engine sends them, 1.9806 s before;
    the last exposed gradient bucket the engine's 4 MiB, not 25 MiB, 3.2130 s before)."""
    cl = a100()
    assert cl.host is None
    dims = ModelDims(48, 4096, 32, 2048, 51200)
    lay = Layout(tp=8, pp=4, vpp=2, dp=2, global_batch_size=64, schedule="interleaved")
    assert predict(dims, lay, cl).seconds_per_iteration == pytest.approx(1.978466462210622, rel=1e-12)
    lay = Layout(tp=2, pp=1, dp=4, micro_batch_size=2, global_batch_size=32, recompute="none", precision="bf16-mixed")
    assert predict(dims, lay, cl).seconds_per_iteration == pytest.approx(3.2128649261581153, rel=1e-12)
    assert Cluster.from_config({"device": "cpu"}).host is None  # uncalibrated: the nominal cpu entry


def test_cpu_figures_are_all_set_or_none():
    from mlplat.errors import ConfigError

    with pytest.raises(ConfigError, match="cluster.cpu_background is null while other cluster.cpu_"):
        load_config({"cluster": {"cpu_cores": 2}})
    with pytest.raises(ConfigError, match="cluster.cpu_cores=0 must be positive"):
        load_config({"cluster": {**_HOST_KEYS, "cpu_cores": 0}})
    assert Cluster.from_config({"device": "cpu", **_HOST_KEYS}).host.wakeup_us == 300.0


def test_cpu_op_counts_are_those_of_the_model_code():
    """mlplat.perf.host's op counts per block are what the real layer, embedding and head dispatch."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from mlplat.model.decoder import DecoderChunk
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.parallel.random import RNGTracker, seed_model_parallel
    from mlplat.perf.host import EMBEDDING_OPS, HEAD_OPS, LAYER_OPS

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    cfg = load_config({"model": dict(n_layers=3, hidden=32, n_heads=4, seq_len=16, vocab_size=256, dropout=0.0),
                       "kernels": {"attention": "sdpa"}, "trainer": {"precision": "32-true"}})
    grid = ParallelGrid()
    tracker = RNGTracker()
    seed_model_parallel(0, grid, tracker)
    counts = []
    for c in range(3):
        chunk = DecoderChunk(cfg.model, grid, c, 3, kernels=cfg.kernels, tracker=tracker, backend="sdpa")
        x = torch.randint(0, 256, (2, 16)) if c == 0 else torch.randn(2, 16, 32, requires_grad=True)
        labels = torch.randint(0, 256, (2, 16))
        with Count() as fwd:
            y = chunk(x, labels)
        grad = torch.ones_like(y)
        with Count() as bwd:
            y.backward(grad)
        counts.append((fwd.n, bwd.n))
    assert counts[1] == LAYER_OPS
    assert counts[0] == (LAYER_OPS[0] + EMBEDDING_OPS[0], LAYER_OPS[1] + EMBEDDING_OPS[1])
    assert counts[2] == (LAYER_OPS[0] + HEAD_OPS[0], LAYER_OPS[1] + HEAD_OPS[1])


def test_calibration_fit_and_concurrency_helpers():
    from mlplat.perf.host import alpha_beta, fit_relative, mean_concurrency

    rows = [([ops, 0.0, f, b], ops * 5e-6 + f / 40e9 + b / 10e9) for ops, f, b in
            ((30, 1e6, 1e5), (30, 1e8, 1e6), (70, 2e7, 4e6), (5, 0.0, 3e5), (28, 5e7, 1e7))]
    rows += [([0.0, 70, 2e8, 2e6], 70 * 7e-6 + 2e8 / 40e9 + 2e6 / 10e9)]
    assert fit_relative(rows) == pytest.approx([5e-6, 7e-6, 1 / 40e9, 1 / 10e9], rel=1e-6)
    alpha, bw = alpha_beta({n: 2 * 50e-6 + n / 1e9 for n in (4, 4096, 1 << 20)}, 2)  # per hand-off, bytes/s
    assert (alpha, bw) == pytest.approx((50e-6, 1e9), rel=1e-6)
    # Two ranks overlapping for half of each span: each is covered by 1.5 ranks on average.
    assert mean_concurrency([(0, 0.0, 2.0), (1, 1.0, 3.0)]) == pytest.approx([1.5, 1.5])


def test_cpu_sequence_parallel_splits_the_replicated_work():
    """The same ring per layer; LayerNorm/residual traffic over s/t tokens and no gather after a stage send."""
    dims = ModelDims(n_layers=4, hidden=64, n_heads=4, seq_len=32, vocab_size=256)
    base = dict(tp=2, pp=2, micro_batch_size=2, global_batch_size=8, recompute="none", precision="32-true")
    plain, sp = (predict(dims, Layout(**base, sequence_parallel=x), _cpu()) for x in (False, True))
    assert sp.costs.layer_forward < plain.costs.layer_forward
    assert sp.costs.tp_forward == plain.costs.tp_forward
    assert sp.seconds_per_iteration < plain.seconds_per_iteration


def test_the_cpu_model_counts_the_engines_buckets_and_every_cpu_key():
    """Host is built from the cpu_* keys by name; the CPU model counts the engine's own buckets."""
    from dataclasses import fields

    from mlplat.config import CPU_KEYS
    from mlplat.optim.buckets import BUCKET_BYTES
    from mlplat.optim.buffers import BUCKET_BYTES as ENGINE_BUCKET_BYTES
    from mlplat.perf.cpu_model import engine_buckets
    from mlplat.perf.host import Host

    assert ENGINE_BUCKET_BYTES == BUCKET_BYTES
    assert (engine_buckets(1), engine_buckets(BUCKET_BYTES), engine_buckets(BUCKET_BYTES + 1)) == (1, 1, 2)
    assert [f"cpu_{f.name}" for f in fields(Host)] == list(CPU_KEYS)
    host = Host(*range(1, len(CPU_KEYS) + 1))
    assert list(host.cluster_keys()) == list(CPU_KEYS) and Host.of(_Keys(host.cluster_keys())) == host


class _Keys:
    """A stand-in for ClusterConfig: its keys as attributes."""

    def __init__(self, keys: dict):
        self.__dict__.update(keys)
