"""mlplat.plan: layout rules, the memory refusal, the best layout the planner finds, and its CLI."""
from __future__ import annotations

from dataclasses import replace

import pytest

from mlplat.perf.cluster import Cluster
from mlplat.perf.flops import ModelDims
from mlplat.perf.memory import Layout, layout_errors
from tests.helpers.perf import a100


def test_layout_rules_and_memory_refusal():
    from mlplat.plan import evaluate

    dims = ModelDims(128, 25600, 160, 2048, 51200)
    assert any(e.startswith("model.n_layers=128 is not divisible by parallel.pp·parallel.vpp=48 (every model chunk "
                            "must hold the same number of layers) or set parallel.first_stage_layers")
               for e in layout_errors(dims, Layout(tp=8, pp=48, dp=8, global_batch_size=3072)))
    assert any("multiple of parallel.pp=64" in e for e in layout_errors(
        dims, Layout(tp=8, pp=64, vpp=2, dp=6, global_batch_size=6 * 100, schedule="interleaved")))
    assert any("exceeds cluster.gpus_per_node=8" in e for e in layout_errors(
        dims, Layout(tp=16, pp=1, dp=192, global_batch_size=3072), gpus_per_node=8))
    # A trillion parameters on one GPU per replica: 16 TB of model state.
    c = evaluate(dims, Layout(tp=1, pp=1, dp=3072, global_batch_size=3072, recompute="full"), a100())
    assert not c.fits and "GiB per GPU" in c.reason
    assert evaluate(dims, Layout(tp=8, pp=64, dp=6, global_batch_size=3072, recompute="full"), a100()).fits


def test_cpu_pre_sort_is_a_little_slower_than_the_fixed_point():
    """On CPU processes the planner pre-sorts on 6 simulations of the fixed point (every layout) and re-times the
    leaders to the full fixed point: on a sample of the tiny model's layouts the pre-sort is never faster and at most
    8% slower, so it ranks them as the full model does, to within that."""
    from itertools import islice

    from mlplat.perf.cluster import predict
    from mlplat.plan import candidate_layouts, load_group

    dims = ModelDims.from_config(load_group("model", "tiny"))
    cl = Cluster.from_config(load_group("cluster", "local_cpu"))
    ratios = []
    for lay in islice(candidate_layouts(dims, cl, 8, 16), 0, 400, 7):
        if layout_errors(dims, lay, cl.gpus_per_node):
            continue
        full = predict(dims, lay, cl).seconds_per_iteration
        ratios.append(predict(dims, lay, cl, method="analytic").seconds_per_iteration / full)
    assert len(ratios) >= 30 and min(ratios) >= 1 - 1e-9 and max(ratios) <= 1.08, ratios


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


def test_planner_searches_uneven_stages_when_p_does_not_divide_the_layers():
    """126 layers over p = 8: torchtitan's splits (15, 16 x 6, 15; interleaved 7, 8 x 14, 7); 6 layers over p = 4 on
    local CPU processes: the uneven candidates pass the config's rules, and the launch line of a best uneven layout
    names the keys."""
    from mlplat.plan import candidate_layouts, launch_line, load_group, pipeline_splits

    assert pipeline_splits(126, 8) == [(1, 15, 15), (2, 7, 7)]
    assert pipeline_splits(96, 8)[:2] == [(1, None, None), (2, None, None)]  # even when p divides
    # Two chunks: the ends are all (either one heavier); at v = 2 the middle chunks hold 2, the ends 1 and 2.
    assert pipeline_splits(7, 2) == [(1, 3, 4), (1, 4, 3), (2, 1, 2), (2, 2, 1)]
    dims = ModelDims.from_config({**load_group("model", "tiny"), "n_layers": 6})
    cl = Cluster.from_config(load_group("cluster", "local_cpu"))
    uneven = [lay for lay in candidate_layouts(dims, cl, 4, 16, precision="32-true", micro_batch_sizes=(4,),
                                               recompute=("none",), sequence_parallel=(False,), distributed=(False,))
              if lay.pp == 4]
    assert {(lay.vpp, lay.first_stage_layers, lay.last_stage_layers) for lay in uneven} == {(1, 1, 1)}
    assert all(not layout_errors(dims, lay, cl.gpus_per_node) for lay in uneven)
    assert uneven[0].pipeline.chunk_layers(6) == [1, 2, 2, 1]
    line = launch_line(uneven[0], cl, "tiny", "local_cpu", None, slurm=False)
    assert "parallel.first_stage_layers=1" in line and "parallel.last_stage_layers=1" in line, line


def test_planner_searches_the_mtp_stage_and_latent_attention_under_cp():
    """Multi-token prediction: the planner weighs the modules beside the last layers (the uneven ends) and on a chunk
    of their own (last_stage_layers=0), DeepSeek-V3's 61 layers at p = 8 as Megatron-Bridge's "Et|(tt|)*30mL"
    among them. Experts no longer keep context parallelism out of the search: model=mla_tiny (MLA, MoE, MTP) at
    cp = 2 yields layouts the config accepts, their ring blocks MLA's latents."""
    from mlplat.config import from_dict, validate
    from mlplat.perf.memory import kv_block_bytes
    from mlplat.plan import candidate_layouts, load_group, mtp_stage_splits, pipeline_splits

    assert all(last != 0 for _, _, last in pipeline_splits(61, 8))
    assert pipeline_splits(61, 8, mtp_depth=1)[-3:] == mtp_stage_splits(61, 8) == [(1, 7, 0), (2, 5, 0), (4, 1, 0)]
    assert mtp_stage_splits(61, 16) == [(1, 5, 0), (2, 1, 0)]  # DeepSeek's p = 16: 5, 4 x14, 0 and 1, 2 x30, 0
    model = {**load_group("model", "mla_tiny"), "seq_len": 64}
    dims = ModelDims.from_config(model)
    cl = Cluster.from_config(load_group("cluster", "local_cpu"))
    lays = list(candidate_layouts(dims, cl, 4, 8, precision="32-true", micro_batch_sizes=(2,), recompute=("none",),
                                  sequence_parallel=(False,), distributed=(False,), cp=(1, 2), max_vpp=2))
    own = [lay for lay in lays if lay.last_stage_layers == 0]
    ring = [lay for lay in lays if lay.cp == 2]
    assert own and ring and any(lay.ep > 1 for lay in ring)
    assert {lay.pipeline.chunk_layers(dims.n_layers)[-1] for lay in own} == {0}
    for lay in (own[0], ring[0]):
        assert not layout_errors(dims, lay, cl.gpus_per_node)
        validate(from_dict({"model": model, "parallel": {
            "tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "dp": lay.dp, "cp": lay.cp, "ep": lay.ep,
            "etp": lay.etp, "schedule": lay.schedule, "micro_batch_size": lay.micro_batch_size,
            "global_batch_size": lay.global_batch_size, "first_stage_layers": lay.first_stage_layers,
            "last_stage_layers": lay.last_stage_layers}, "kernels": {"attention": "sdpa"},
            "trainer": {"devices": 4}}))
    mla = model["mla"]  # the ring carries [c_kv | k_rope] per token, whole on every tp rank, in fp32 here
    assert kv_block_bytes(dims, ring[0]) == 4 * 2 * 64 / 2 * (mla["kv_lora_rank"] + mla["qk_rope_head_dim"])


def test_planner_cli(capsys, monkeypatch):
    """The table tells its rows apart: every key a layout can differ in is a column (the schedule; sequence
    parallelism on, off, or `-` without a tensor-parallel group), no two rows alike; a long search says how far it
    is on stderr (here at every layout)."""
    from mlplat import plan

    monkeypatch.setattr(plan.Progress.__init__, "__defaults__", (0.0, None))
    assert plan.main(["model=tiny", "cluster=local_cpu", "gpus=8", "global_batch_size=16", "top=6"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "refused" in out and "best: parallel.tp=" in out
    assert "launch: python -m mlplat.train model=tiny cluster=local_cpu " in out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#"))
    assert "schedule" in lines[head].split() and "sp" in lines[head].split()
    rows = lines[head + 2: head + 8]
    assert len(rows) == 6 and all(r.split()[9] in ("-", "on", "off") for r in rows), rows  # the sp column
    no_rank = [r.split(None, 1)[1] for r in rows]
    assert len(set(no_rank)) == len(no_rank), rows  # no two rows alike
    progress = captured.err.splitlines()
    assert progress and all(line.startswith("mlplat.plan: ") for line in progress)
    assert " layouts weighed, " in progress[0] and "re-timing the " in progress[-1]


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
    assert "precision 32-true/bf16-megatron, sharded over dp none/optim" in out
    assert "trainer.precision=" in out and "optim.sharding=" in out


@pytest.mark.parametrize("model,cluster,gpus,kw", [
    ("gpt39b", "dgx_a100", 512, dict(micro_batch_sizes=(2, 4), max_vpp=2, precision=("bf16-megatron",))),
    # optimizer post-validation: timed back to back, and carried by the launch line to the dry run
    ("gpt39b", "dgx_a100", 512, dict(micro_batch_sizes=(2,), max_vpp=2, precision=("bf16-megatron",),
                                     recompute=("selective",), post_validate=(True,))),
    ("tiny", "local_cpu", 8, dict(precision="32-true", micro_batch_sizes=(2,), recompute=("none",), max_vpp=2,
                                  sequence_parallel=(False,))),
])
def test_planner_launch_line_plans_the_same_layout(model, cluster, gpus, kw):
    """The planner's launch line (model=, cluster=, trainer=gpu, and every key in which the best layout differs from
    the config those compose), pasted into a dry run, plans the planner's best layout: the same layout, step time
    and memory per GPU."""
    from hydra import compose, initialize_config_dir

    from mlplat.config import load_config
    from mlplat.perf.dry_run import launch_overrides, plan
    from mlplat.plan import default_global_batch, launch_line, load_group, search
    from mlplat.train import experiment_as_choice
    from tests.helpers.paths import CONF

    dims = ModelDims.from_config(load_group("model", model))
    cl = Cluster.from_config(load_group("cluster", cluster))
    best, _ = search(dims, cl, gpus, default_global_batch(model, gpus), top=1, simulate_top=1, **kw)
    cand = best[0]
    command = launch_line(cand.layout, cl, model, cluster)
    words = command.split()
    assert f"model={model}" in words and f"cluster={cluster}" in words
    assert ("trainer=gpu" in words) == (not cl.device.nominal)
    assert ("optim.post_validate=true" in words) == cand.layout.post_validate
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        raw = compose(config_name="config", overrides=experiment_as_choice(launch_overrides(command)))
    pl = plan(load_config(raw), use_meta=False, max_compute_ops=60_000)
    L, b = pl["layout"], cand.layout
    assert (L["tp"], L["pp"], L["vpp"], L["dp"], L["micro"], L["global"], L["schedule"], L["recompute"],
            L["sequence_parallel"], L["precision"], L["distributed_optimizer"], L["attention"]) == (
        b.tp, b.pp, b.vpp, b.dp, b.micro_batch_size, b.global_batch_size, b.schedule, b.recompute,
        b.sequence_parallel, b.precision, b.distributed_optimizer, b.attention)
    assert pl["predicted_seconds_per_iteration"] == pytest.approx(cand.seconds, rel=1e-9)
    assert pl["memory_per_gpu_bytes"] == int(cand.memory_bytes)


def test_planner_weighs_every_pipeline_schedule():
    """Beside 1F1B: zb_h1 and zb_h2 (v = 1); interleaved, zbv and v_half (v = 2); interleaved alone for v > 2. On the 1T
    model, with full recomputation and the memory limit of an A100, the planner keeps v_half and refuses zb_h1."""
    from mlplat.plan import candidate_layouts, evaluate

    dims = ModelDims(n_layers=128, hidden=25600, n_heads=160, seq_len=2048, vocab_size=51200)
    kinds: dict[int, set[str]] = {}
    for lay in candidate_layouts(dims, a100(), 3072, 3072, micro_batch_sizes=(1,), recompute=("full",),
                                 max_vpp=4, precision="bf16-megatron", distributed=True,
                                 sequence_parallel=(True,)):
        if lay.pp > 1:
            kinds.setdefault(lay.vpp, set()).add(lay.schedule)
    assert kinds[1] == {"1f1b", "zb_h1", "zb_h2"} and kinds[2] == {"interleaved", "zbv", "v_half"} and kinds[4] == {
        "interleaved"}
    base = Layout(tp=8, pp=64, vpp=1, dp=6, micro_batch_size=1, global_batch_size=3072, recompute="full",
                  precision="bf16-megatron", sequence_parallel=True, distributed_optimizer=True)
    assert not evaluate(dims, replace(base, schedule="zb_h1"), a100()).fits
    assert evaluate(dims, replace(base, vpp=2, schedule="v_half"), a100()).fits


def test_a_one_node_plan_launches_without_slurm_and_its_dry_run_line_runs_anywhere(capsys, tmp_path):
    """Beside the SLURM line, a layout that fits one node gets a launch line without a launcher, and every plan a
    dry-run line; that line runs as printed on a machine without SLURM (the SLURM line would need srun)."""
    import shlex

    from mlplat.plan import main
    from tests.helpers.cli import run_train

    assert main(["model=gpt125m", "cluster=dgx_h100", "gpus=8", "top=1", "micro_batch_sizes=1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (slurm,) = [x for x in lines if x.startswith("launch: ")]
    (local,) = [x.split(": ", 1)[1] for x in lines if x.startswith("on one node, without SLURM: ")]
    (dry,) = [x.split(": ", 1)[1] for x in lines if x.startswith("plan it here: ")]
    assert "hydra/launcher=submitit_slurm" in slurm and "hydra" not in local and dry == f"{local} dry_run=true"
    assert local.endswith(" trainer.num_nodes=1 trainer.devices=8")
    proc = run_train(tmp_path, *shlex.split(dry)[3:])
    assert "plan written to" in proc.stdout and "srun" not in proc.stdout + proc.stderr

    assert main(["model=gpt125m", "cluster=dgx_h100", "gpus=16", "top=1", "micro_batch_sizes=1"]) == 0
    lines = capsys.readouterr().out.splitlines()  # two nodes: no line without a launcher to launch it
    assert not any(x.startswith("on one node") for x in lines)
    assert [x for x in lines if x.startswith("plan it here: ")][0].endswith("trainer.devices=8 dry_run=true")


@pytest.mark.parametrize("arg", ["gpus=0", "top=abc", "top=0", "micro_batch_sizes=0", "max_vpp=-1"])
def test_planner_refuses_a_bad_count_in_one_line(arg):
    from mlplat.plan import main

    key, value = arg.split("=")
    with pytest.raises(SystemExit, match=f"^mlplat.plan: {key}='{value}' must be a whole number of at least 1$"):
        main([arg])


def test_planner_plans_fp8(capsys):
    """`fp8=tensorwise` on H100s: every layout ranked runs the layers' GEMMs in FP8 under bf16-megatron (autocast is
    refused with FP8); for GPT 1.7B the best is faster than the best without FP8, for GPT 125M (h = 768, one
    2,048-token micro-batch) slower: its GEMMs are too small to repay the casts. The launch line carries
    kernels.fp8; an A100 cluster is refused in one line."""
    from mlplat.plan import load_group, main, search

    cl = Cluster.from_config(load_group("cluster", "dgx_h100"))
    kw = dict(top=3, simulate_top=3, micro_batch_sizes=(1,), precision=("bf16-mixed", "bf16-megatron"))
    for model, batch, faster in (("gpt1p7b", 64, True), ("gpt125m", 8, False)):
        dims = ModelDims.from_config(load_group("model", model))
        bf16, _ = search(dims, cl, 8, batch, **kw)
        fp8, _ = search(dims, cl, 8, batch, fp8="tensorwise", **kw)
        assert {c.layout.fp8 for c in fp8} == {"tensorwise"}
        assert {c.layout.precision for c in fp8} == {"bf16-megatron"}
        assert (fp8[0].seconds < bf16[0].seconds) == faster, (model, fp8[0].seconds, bf16[0].seconds)
    assert main(["model=gpt125m", "cluster=dgx_h100", "gpus=8", "top=1", "micro_batch_sizes=1", "fp8=tensorwise"]) == 0
    out = capsys.readouterr().out
    assert "FP8 GEMMs (tensorwise)" in out
    assert "kernels.fp8=tensorwise" in [x for x in out.splitlines() if x.startswith("launch: ")][0]
    with pytest.raises(SystemExit, match="^mlplat.plan: fp8=tensorwise needs FP8 tensor cores: cluster=dgx_a100"):
        main(["model=gpt125m", "cluster=dgx_a100", "gpus=8", "fp8=tensorwise"])


def test_planner_plans_muon(capsys):
    """`optim=muon`: every layout weighed with Muon's optimizer step (its Newton–Schulz, slower than AdamW's update),
    the best line and the launch line carry optim.name=muon; an unknown optimizer is refused in one line."""
    from mlplat.plan import load_group, main, search

    cl = Cluster.from_config(load_group("cluster", "dgx_h100"))
    dims = ModelDims.from_config(load_group("model", "gpt125m"))
    kw = dict(top=1, simulate_top=1, micro_batch_sizes=(1,), precision=("bf16-megatron",), recompute=("none",))
    (adamw,), _ = search(dims, cl, 8, 8, **kw)
    (muon,), _ = search(dims, cl, 8, 8, optim="muon", **kw)
    assert muon.layout.optimizer == "muon" and muon.prediction.optimizer_newton_schulz_seconds > 0
    assert muon.seconds > adamw.seconds
    assert main(["model=gpt125m", "cluster=dgx_h100", "gpus=8", "top=1", "micro_batch_sizes=1", "optim=muon"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [x for x in out if x.startswith("best: ")][0].endswith(" optim.name=muon")
    assert "optim.name=muon" in [x for x in out if x.startswith("launch: ")][0]
    with pytest.raises(SystemExit, match="^mlplat.plan: optim='sgd' is not one of adamw, muon$"):
        main(["model=gpt125m", "cluster=dgx_h100", "gpus=8", "optim=sgd"])


def test_planner_searches_parameter_sharding_and_hsdp():
    """optim.sharding=params is searched (HSDP's node-sized shard groups too), and it is what fits Llama 3 70B on 64
    H100 without a pipeline: at t8·d8 the distributed optimizer alone keeps the bf16 weights and fp32 gradients
    whole (the planner's pick there is the sharded layout: experiments/param_sharding/results.md)."""
    from mlplat.plan import _sharding, candidate_layouts, evaluate, load_group

    dims = ModelDims.from_config(load_group("model", "llama3_70b"))
    cl = Cluster.from_config(load_group("cluster", "h100_96gb"))
    lays = list(candidate_layouts(dims, cl, 64, 64, micro_batch_sizes=(2,), recompute=("none",), max_vpp=1,
                                  precision="bf16-megatron", sharding=("optim", "params")))
    hsdp = [lay for lay in lays if lay.dp_shard]
    assert hsdp and all(lay.param_sharding and lay.dp_shard * lay.tp == cl.gpus_per_node for lay in hsdp)
    # autocast keeps a cast of every weight through the step: refused with sharded parameters, not searched
    assert not any(lay.param_sharding for lay in candidate_layouts(
        dims, cl, 64, 64, micro_batch_sizes=(2,), recompute=("none",), max_vpp=1, precision="bf16-mixed",
        sharding=("params",)))
    assert {_sharding(lay) for lay in lays} >= {"optim", "params", "params/2"}
    flat = {lay.sharding: lay for lay in lays if lay.tp == 8 and lay.pp == 1 and lay.sequence_parallel}
    sharded, zero1 = evaluate(dims, flat["params"], cl), evaluate(dims, flat["optim"], cl)
    assert sharded.fits and not zero1.fits, (sharded.memory_bytes / 2**30, zero1.memory_bytes / 2**30)
