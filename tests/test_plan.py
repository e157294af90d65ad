"""mlplat.plan: layout rules, the memory refusal, the best layout the planner finds, and its CLI."""
from __future__ import annotations

from dataclasses import replace

from mlplat.perf.cluster import Cluster
from mlplat.perf.flops import ModelDims
from mlplat.perf.memory import Layout, layout_errors
from tests.helpers.perf import a100


def test_layout_rules_and_memory_refusal():
    from mlplat.plan import evaluate

    dims = ModelDims(128, 25600, 160, 2048, 51200)
    assert ("model.n_layers=128 is not divisible by parallel.pp·parallel.vpp=48 "
            "(every model chunk must hold the same number of layers)") in layout_errors(
        dims, Layout(tp=8, pp=48, dp=8, global_batch_size=3072))
    assert any("multiple of parallel.pp=64" in e for e in layout_errors(
        dims, Layout(tp=8, pp=64, vpp=2, dp=6, global_batch_size=6 * 100, schedule="interleaved")))
    assert any("exceeds cluster.gpus_per_node=8" in e for e in layout_errors(
        dims, Layout(tp=16, pp=1, dp=192, global_batch_size=3072), gpus_per_node=8))
    # A trillion parameters on one GPU per replica: 16 TB of model state.
    c = evaluate(dims, Layout(tp=1, pp=1, dp=3072, global_batch_size=3072, recompute="full"), a100())
    assert not c.fits and "GiB per GPU" in c.reason
    assert evaluate(dims, Layout(tp=8, pp=64, dp=6, global_batch_size=3072, recompute="full"), a100()).fits


def test_planner_best_layout_for_tiny_on_local_cpu_is_valid():
    from mlplat.plan import load_group, search

    dims = ModelDims.from_config(load_group("model", "tiny"))
    cl = Cluster.from_config(load_group("cluster", "local_cpu"))
    best, refused = search(dims, cl, 8, 16, top=3, precision="32-true")
    assert best and sum(refused.values()) > 0
    b = best[0].layout
    assert b.gpus == 8 and best[0].fits and not layout_errors(dims, b, cl.gpus_per_node)
    assert [c.seconds for c in best] == sorted(c.seconds for c in best)
    from mlplat.config import from_dict, validate

    validate(from_dict({"model": load_group("model", "tiny"), "parallel": {
        "tp": b.tp, "pp": b.pp, "vpp": b.vpp, "dp": b.dp, "schedule": b.schedule,
        "micro_batch_size": b.micro_batch_size, "global_batch_size": b.global_batch_size,
        "sequence_parallel": b.sequence_parallel},
        "kernels": {"recompute": b.recompute}, "trainer": {"devices": 8}}))


def test_planner_cli(capsys):
    from mlplat.plan import main

    assert main(["model=tiny", "cluster=local_cpu", "gpus=8", "global_batch_size=16", "top=3"]) == 0
    out = capsys.readouterr().out
    assert "refused" in out and "best: parallel.tp=" in out


def test_planner_searches_precision_and_the_distributed_optimizer(capsys):
    """Each candidate layout comes in every precision asked for, with and without the distributed optimizer (not
    at d = 1, where it shards nothing); the sharded optimizer state is what fits the 1T model on half the pipeline
    stages, and the planner's best line says which to set."""
    from mlplat.plan import candidate_layouts, evaluate, load_group, main

    dims = ModelDims.from_config(load_group("model", "tiny"))
    cl = Cluster.from_config(load_group("cluster", "local_cpu"))
    lays = list(candidate_layouts(dims, cl, 8, 16, precision=("32-true", "bf16-megatron")))
    assert {lay.precision for lay in lays} == {"32-true", "bf16-megatron"}
    assert any(lay.distributed_optimizer for lay in lays)
    assert not any(lay.distributed_optimizer and lay.dp == 1 for lay in lays)
    assert len(lays) == 2 * len(list(candidate_layouts(dims, cl, 8, 16, precision=("32-true", "bf16-megatron"),
                                                       distributed=False))) - sum(lay.dp == 1 for lay in lays)

    one_t = ModelDims(128, 25600, 160, 2048, 51200)
    lay = Layout(tp=8, pp=32, dp=12, global_batch_size=3072, recompute="full")
    assert not evaluate(one_t, lay, a100()).fits
    assert evaluate(one_t, replace(lay, precision="bf16-megatron", distributed_optimizer=True), a100()).fits

    assert main(["model=tiny", "cluster=local_cpu", "gpus=8", "global_batch_size=16", "top=3",
                 "precision=32-true,bf16-megatron", "distributed=false,true"]) == 0
    out = capsys.readouterr().out
    assert "precision 32-true/bf16-megatron, distributed optimizer off/on" in out
    assert "trainer.precision=" in out and "optim.distributed=" in out
