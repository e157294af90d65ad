"""mlplat.perf.dry_run: meta-device parameter counts equal the closed form, the dry run of every experiment, the
experiments as typed ahead of the paper, the paper's setup predicted near Table 1, and the launch line, which
pasted into a second dry run plans the same run."""
from __future__ import annotations

import pytest

from mlplat.config import from_dict, load_config
from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.perf.flops import ModelDims, parameter_count, stage_parameters
from mlplat.perf.memory import Layout
from tests.helpers.paths import CONF
from tests.helpers.perf import PAPER_PARAMS_B, PAPER_TFLOPS, TABLE1


@pytest.mark.parametrize("t,p,v,schedule", [(1, 1, 1, "1f1b"), (2, 2, 1, "1f1b"), (2, 2, 3, "interleaved"),
                                            (2, 3, 2, "zbv")])
def test_meta_counts_equal_the_closed_form(t, p, v, schedule):
    """Also under zbv, whose V puts the first and the last chunk (one shared word embedding) on rank 0."""
    from mlplat.perf.dry_run import meta_parameter_counts

    model = dict(n_layers=12, hidden=64, n_heads=4, seq_len=32, vocab_size=1000, dropout=0.0)
    lay = Layout(tp=t, pp=p, vpp=v, schedule=schedule)
    total, per_stage = meta_parameter_counts(from_dict({"model": model}).model, lay)
    dims = ModelDims.from_config(model)
    assert total == parameter_count(dims, t)
    assert per_stage == stage_parameters(dims, t, lay.pipeline)


REQUIRED = ("parameters_total", "parameters_per_gpu_max", "memory_per_gpu_bytes", "flops_per_iteration",
            "predicted_seconds_per_iteration", "predicted_tflops_per_gpu", "bubble_fraction", "layout")


@pytest.fixture(scope="module")
def experiment_plans():
    """name -> the plan of `python -m mlplat.train +experiment=NAME dry_run=true`, composed as that composes it."""
    from hydra import compose, initialize_config_dir

    from mlplat.perf.dry_run import plan

    plans = {}
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        for name in TABLE1:
            raw = compose(config_name="config", overrides=[f"experiment={name}", "dry_run=true"])
            plans[name] = plan(load_config(raw), experiment=name, overrides=[f"experiment={name}", "dry_run=true"])
    return plans


def test_dry_run_of_every_experiment(experiment_plans):
    """Composed as `+experiment=NAME dry_run=true` composes it; meta-device counts equal the closed form."""
    import json

    from mlplat.perf.dry_run import format_plan

    plans = experiment_plans
    for name, billions in zip(TABLE1, PAPER_PARAMS_B):
        pl = plans[name]
        assert all(k in pl for k in REQUIRED), name
        assert set(pl["layout"]) >= {"tp", "pp", "vpp", "dp", "micro", "global", "gpus", "nodes"}
        assert pl["parameters_source"] == "meta-device model"
        assert pl["parameters_total"] == pl["parameters_closed_form"]
        assert round(pl["parameters_total"] / 1e9, 1) == billions
        L = pl["layout"]
        dims = ModelDims.from_config(pl["model"])
        pipeline = PipelineLayout(L["pp"], L["vpp"], L["schedule"])
        assert pl["parameters_per_stage"] == stage_parameters(dims, L["tp"], pipeline)
        assert L["tp"] * L["pp"] * L["dp"] == L["gpus"] and pl["fits"], name
        assert not pl["warnings"], pl["warnings"]
        json.dumps(pl)
    one_t = plans["gpt1t"]
    assert one_t["layout"]["nodes"] == 384
    assert "hydra/launcher=submitit_slurm" in one_t["slurm_command"]
    assert "+experiment=gpt1t" in one_t["slurm_command"] and "hydra.launcher.nodes=384" in one_t["slurm_command"]
    assert "dry_run" not in one_t["slurm_command"]
    text = format_plan(one_t)
    assert "DOES NOT FIT" not in text
    assert one_t["memory_breakdown_bytes"]["messages"] == one_t["messages_in_flight"] * one_t["message_bytes"] > 0
    assert f"messages    {one_t['messages_in_flight']} in flight" in text


def paper_model_tflops(name: str, model: dict) -> float:
    """Table 1's measured TFLOP/s per GPU (executed FLOPs, full recomputation: 96·B·s·l·h²·(1 + s/(6h) +
    V/(16·l·h))) converted to model FLOPs (72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))): times model / executed."""
    s, l, h, V = model["seq_len"], model["n_layers"], model["hidden"], model["vocab_size"]
    ratio = 72 * (1 + s / (6 * h) + V / (12 * l * h)) / (96 * (1 + s / (6 * h) + V / (16 * l * h)))
    return PAPER_TFLOPS[TABLE1.index(name)] * ratio


def test_experiments_as_typed_are_ahead_of_the_paper(experiment_plans):
    """These are predictions of the calibrated cost model (mlplat.perf.cluster), not measurements: the dry run of
    every experiment file as typed (bf16-megatron, the distributed optimizer, sequence parallelism with selective
    recomputation where it fits) fits in the GPU's memory with the pipeline messages in flight counted, predicts
    more model FLOP/s per GPU than the paper measured (its Table 1 TFLOP/s converted from executed FLOPs with full
    recomputation to model FLOPs), and at least 25% more on the rows of 145B parameters and more."""
    for name, pl in experiment_plans.items():
        L = pl["layout"]
        assert L["precision"] == "bf16-megatron" and L["distributed_optimizer"], name
        assert L["sequence_parallel"] == (L["tp"] > 1), name
        assert pl["fits"] and pl["memory_breakdown_bytes"]["messages"] == pl["messages_in_flight"] * pl["message_bytes"]
        assert pl["memory_per_gpu_bytes"] <= 80 * 2**30, name
        paper = paper_model_tflops(name, pl["model"])
        bar = 1.25 if pl["parameters_total"] >= 145e9 else 1.0
        assert pl["predicted_model_tflops_per_gpu"] > bar * paper, (name, pl["predicted_model_tflops_per_gpu"], paper)
    one_t = experiment_plans["gpt1t"]
    assert 122 < paper_model_tflops("gpt1t", one_t["model"]) < 123  # 163 x 0.750
    assert one_t["layout"]["recompute"] == "selective"


def _dry_plan(overrides: list[str], experiment: str | None = None) -> tuple[dict, object]:
    """(the plan, the Hydra config) of `python -m mlplat.train OVERRIDES dry_run=true`, with the overrides as Hydra
    records them; cheap settings (closed-form counts, a short simulation), the same for every plan compared."""
    from hydra import compose, initialize_config_dir

    import mlplat.train  # noqa: F401  (the resolvers of conf/hydra/launcher/)
    from mlplat.perf.dry_run import plan
    from mlplat.train import experiment_as_choice

    overrides = experiment_as_choice(overrides)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        raw = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    choice = experiment or raw.hydra.runtime.choices.get("experiment")
    return plan(load_config(raw), experiment=choice, overrides=overrides, use_meta=False,
                max_compute_ops=20_000), raw


SAME = ("layout", "parameters_per_stage", "memory_per_stage_bytes", "memory_per_gpu_bytes", "messages_in_flight",
        "predicted_seconds_per_iteration", "predicted_model_tflops_per_gpu", "fits", "model", "cluster")
LAUNCH_CASES = {
    # +experiment= and the layout changed on the command line: pp, vpp, dp, precision, optimizer, recomputation
    "experiment-and-overrides": ["+experiment=gpt145b", "parallel.pp=4", "parallel.vpp=4", "parallel.dp=48",
                                 "trainer.precision=bf16-mixed", "optim.distributed=false",
                                 "parallel.sequence_parallel=false", "kernels.recompute=full"],
    # no experiment: the groups (model=, cluster=, trainer=gpu) must travel too
    "groups-no-experiment": ["model=gpt39b", "cluster=dgx_a100", "trainer=gpu", "parallel.tp=8", "parallel.pp=2",
                             "parallel.vpp=1", "parallel.dp=32", "parallel.schedule=1f1b",
                             "parallel.micro_batch_size=4", "parallel.global_batch_size=1536",
                             "trainer.precision=bf16-megatron", "optim.distributed=true",
                             "parallel.sequence_parallel=true", "kernels.recompute=selective"],
    # the CPU processes of this machine
    "cpu": ["parallel.tp=1", "parallel.pp=4", "parallel.vpp=1", "parallel.dp=2", "parallel.schedule=1f1b",
            "model.n_layers=8"],
}


@pytest.mark.parametrize("case", sorted(LAUNCH_CASES))
def test_launch_line_pasted_plans_the_same_run(case):
    """The dry run's launch line carries the run's own overrides: pasted into a second dry run (its overrides
    composed by Hydra, the launcher's resources included), it plans the same layout, step time and memory."""
    from mlplat.perf.dry_run import launch_overrides

    typed = LAUNCH_CASES[case]
    first, _ = _dry_plan([*typed, "dry_run=true"])
    command = first["slurm_command"]
    assert "dry_run" not in command
    for o in typed:
        assert o in command.split(), (o, command)
    second, raw = _dry_plan(launch_overrides(command))
    for key in SAME:
        assert second[key] == first[key], (key, command)
    assert second["slurm_command"] == command  # the line reproduces itself
    if "hydra/launcher=submitit_slurm" in command:
        cfg = load_config(raw)
        assert raw.hydra.launcher.nodes == cfg.trainer.num_nodes == first["layout"]["nodes"]
        assert raw.hydra.launcher.tasks_per_node == cfg.trainer.devices


def test_launch_line_of_the_1t_run_with_the_planners_layout():
    """The issue's case, as a string: +experiment=gpt1t with the planner's best layout keeps pp, vpp, the precision
    and the distributed optimizer; the launcher's keys are set once; dry_run and hydra.* are dropped."""
    from mlplat.perf.dry_run import launch_command, run_overrides
    from tests.helpers.perf import a100

    best = ["parallel.pp=32", "parallel.vpp=4", "parallel.dp=12", "parallel.schedule=interleaved",
            "trainer.precision=bf16-megatron", "optim.distributed=true", "parallel.sequence_parallel=true",
            "kernels.recompute=none"]
    overrides = ["experiment=gpt1t", *best, "trainer.num_nodes=1", "dry_run=true", "hydra.run.dir=/tmp/x"]
    lay = Layout(tp=8, pp=32, vpp=4, dp=12, global_batch_size=3072, schedule="interleaved")
    words = launch_command(lay, a100(), "gpt1t", overrides).split()
    assert words[:5] == ["python", "-m", "mlplat.train", "-m", "hydra/launcher=submitit_slurm"]
    assert words.count("+experiment=gpt1t") == 1 and "experiment=gpt1t" not in words
    assert all(o in words for o in best)
    assert "trainer.num_nodes=384" in words and "trainer.num_nodes=1" not in words
    assert not any(w.startswith(("dry_run", "hydra.run")) for w in words)
    assert run_overrides(["+experiment=gpt1t", "a.b=1"], "gpt1t") == ["+experiment=gpt1t", "a.b=1"]


def test_paper_setup_predictions_are_near_table1():
    """A guard on the cost model (not a benchmark): the paper's setup predicted within 25% of Table 1."""
    from omegaconf import OmegaConf

    from mlplat.perf.dry_run import plan

    for name, paper in zip(TABLE1, PAPER_TFLOPS):
        exp = OmegaConf.load(CONF / "experiment" / f"{name}.yaml")
        cfg = {"model": OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{name}.yaml")),
               "cluster": OmegaConf.to_container(OmegaConf.load(CONF / "cluster" / "dgx_a100.yaml")),
               # the paper's setup: no sequence parallelism (nor distributed optimizer) whatever the file types
               "parallel": {**OmegaConf.to_container(exp.parallel), "sequence_parallel": False},
               "kernels": {"recompute": "full", "attention": "unfused", "fused": True},
               "trainer": {"precision": "16-megatron", "devices": 8, "num_nodes": exp.trainer.num_nodes}}
        pl = plan(from_dict(cfg), use_meta=False, max_compute_ops=20_000)
        assert 0.75 < pl["predicted_tflops_per_gpu"] / paper < 1.25, (name, pl["predicted_tflops_per_gpu"])


def test_cli_dry_run_launch_line_carries_the_command_line(tmp_path):
    """Through the CLI the overrides come from the running Hydra job (as train.py's run identity reads them)."""
    import json
    import os
    import subprocess
    import sys

    from tests.helpers.paths import REPO

    typed = ["parallel.tp=1", "parallel.pp=4", "parallel.vpp=1", "parallel.dp=2", "parallel.schedule=1f1b"]
    proc = subprocess.run([sys.executable, "-m", "mlplat.train", *typed, "dry_run=true", f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    command = json.loads((tmp_path / "plan.json").read_text())["slurm_command"]
    assert command == "python -m mlplat.train " + " ".join(typed) + " trainer.devices=8"
    assert f"launch      {command}" in proc.stdout and "messages    " in proc.stdout


def test_dry_run_shows_the_activations_1f1b_would_hold():
    """Beside a schedule other than 1F1B, the memory line gives the activations 1F1B would hold on its worst rank
    (same model, t, p, d and micro-batches): the 1F1B plan's own; 1F1B itself shows none."""
    from hydra import compose, initialize_config_dir

    from mlplat.perf.dry_run import format_plan, plan

    keys = ["dry_run=true", "model.n_layers=8", "model.vocab_size=256", "parallel.tp=1", "parallel.dp=1",
            "parallel.pp=4"]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        plans = {kind: plan(load_config(compose(config_name="config", overrides=[*keys, *extra])))
                 for kind, extra in (("v_half", ["parallel.vpp=2", "parallel.schedule=v_half"]),
                                     ("1f1b", ["parallel.vpp=1", "parallel.schedule=1f1b"]))}
    base = plans["1f1b"]
    assert plans["v_half"]["activations_1f1b_bytes"] == base["memory_breakdown_bytes"]["activations"] > 0
    assert plans["v_half"]["memory_breakdown_bytes"]["activations"] != base["memory_breakdown_bytes"]["activations"]
    assert "(activations under 1f1b: " in format_plan(plans["v_half"])
    assert base["activations_1f1b_bytes"] is None and "under 1f1b" not in format_plan(base)


def test_a_preemption_lead_shorter_than_the_notices_checkpoint_is_a_warning():
    """gpt1t's step is predicted at about 75 s and the notice's flag is read one step after it is posted: its
    save starts up to 2 steps (150 s) after the notice, past the 120 s of lead the SLURM launcher gives."""
    from hydra import compose, initialize_config_dir

    from mlplat.perf.dry_run import format_plan, plan
    from mlplat.perf.preemption import NOTICE_STEPS, checkpoint_bytes

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = load_config(compose(config_name="config", overrides=["experiment=gpt1t", "dry_run=true"]))
    short = plan(cfg, use_meta=False, signal_delay_s=120)
    step, pr = short["predicted_seconds_per_iteration"], short["preemption"]
    # Every parameter's bf16 weight, fp32 main weight and two fp32 moments: 14 bytes, 14 TB at 1T.
    assert pr["checkpoint_bytes"] == checkpoint_bytes(short["parameters_total"], "bf16-megatron") == \
        14 * short["parameters_total"]
    assert pr["save_seconds"] is None and pr["lead_seconds"] == pytest.approx(NOTICE_STEPS * step)
    assert NOTICE_STEPS * step > 120
    (line,) = [w for w in short["warnings"] if "signal_delay_s" in w]
    assert line.startswith(f"hydra.launcher.signal_delay_s=120 is shorter than the {NOTICE_STEPS * step:.0f} s")
    assert "hydra.launcher.signal_delay_s=120" in format_plan(short).splitlines()[-1]
    # With the file system's rate the save counts too; a long enough lead is no warning.
    cfg.cluster.fs_write_gbps = 100.0
    known = plan(cfg, use_meta=False, signal_delay_s=3600)
    save = 14 * known["parameters_total"] / 100e9
    assert known["preemption"]["save_seconds"] == pytest.approx(save)
    assert known["preemption"]["lead_seconds"] == pytest.approx(NOTICE_STEPS * step + save)
    assert not known["warnings"]
    assert f"it needs {NOTICE_STEPS * step + save:.0f} s of lead" in format_plan(known)


def test_fp8_dry_run_beside_bf16():
    """`+experiment=llama3_405b kernels.fp8=...`: the layers' GEMMs at the H100's FP8 peak make the step faster, and
    the casts cost what the cost model says (rowwise's per-row amax and its own Wᵀ cast differ from tensorwise's);
    the weight casts kept over the step are 2 bytes per GEMM weight held and the plan still fits; the launch line
    carries kernels.fp8. Blockwise is planned at the FP8 peak too on the H100 (sm90: torch's block-scaled kernel). A
    device without FP8 tensor cores (gpt1t's A100) is refused in one line."""
    from mlplat.perf.devices import peak_flops
    from mlplat.precision import BLOCKWISE_RULE

    plans = {f: _dry_plan(["+experiment=llama3_405b", f"kernels.fp8={f}", "dry_run=true"])[0]
             for f in ("none", "tensorwise", "rowwise", "blockwise")}
    bf16, fp8 = plans["none"], plans["tensorwise"]
    # blockwise on the H100 (sm90): torch's block-scaled kernel at the FP8 peak, not the emulation's fp32 GEMMs
    # (342 s a step before it was wired in); the layout line states the rule the probe applies on the GPU
    assert plans["blockwise"]["layout"]["fp8_gemms"] == BLOCKWISE_RULE
    block, tensor = (plans[f]["predicted_seconds_per_iteration"] for f in ("blockwise", "tensorwise"))
    assert abs(block - tensor) < 0.05 * tensor, (block, tensor)
    assert peak_flops("h100", "fp8") == 1979e12
    assert fp8["fits"] and fp8["layout"]["fp8"] == "tensorwise" and "kernels.fp8=tensorwise" in fp8["slurm_command"]
    speedup = bf16["predicted_seconds_per_iteration"] / fp8["predicted_seconds_per_iteration"]
    assert 1.1 < speedup < 2.0, speedup  # the GEMMs at most 2x faster; attention, casts and communication are not
    assert plans["rowwise"]["predicted_seconds_per_iteration"] != fp8["predicted_seconds_per_iteration"]
    cfg = load_config(_dry_plan(["+experiment=llama3_405b"])[1])
    dims, L = ModelDims.of(cfg.model), fp8["layout"]
    casts = fp8["memory_breakdown_bytes"]["fp8_weight_casts"]
    # the layers of the worst rank's chunks (126 layers split 7, 8 x14, 7 over p·v = 16)
    held = cfg.parallel.pipeline.rank_layers(fp8["memory_worst_pipeline_rank"], dims.n_layers)
    assert casts == int(2 * held * dims.layer_gemm_weights / L["tp"])
    assert "fp8_weight_casts" not in bf16["memory_breakdown_bytes"]
    assert fp8["memory_per_gpu_bytes"] > bf16["memory_per_gpu_bytes"] + casts
    with pytest.raises(ValueError) as refused:
        _dry_plan(["+experiment=gpt1t", "kernels.fp8=tensorwise", "dry_run=true"])
    assert "kernels.fp8=tensorwise needs FP8 tensor cores: cluster.device=a100-80gb" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_fp8_with_replicated_key_value_heads_charges_their_gradient_sum():
    """Fewer key/value heads than tp ranks: the QKV GEMM's backward sums the replicas' dY columns of them (tokens ×
    2·head size) before quantising (`mlplat.parallel.fp8`); the cost model charges that all-reduce over the replicas."""
    from mlplat.perf.cluster import Cluster, layer_costs
    from mlplat.perf.links import allreduce_time
    from mlplat.plan import load_group

    cl = Cluster.from_config(load_group("cluster", "dgx_h100"))
    lay = Layout(tp=8, pp=1, dp=1, micro_batch_size=1, global_batch_size=8, precision="bf16-megatron",
                 attention="flash", fp8="tensorwise")
    dims = {kv: ModelDims(32, 4096, 32, 4096, 128256, arch="llama", n_kv_heads=kv) for kv in (8, 2)}
    backward = {kv: layer_costs(d, lay, cl).breakdown["amax_backward"] for kv, d in dims.items()}
    assert backward[2] - backward[8] == pytest.approx(allreduce_time(4096 * 2 * 128 * 2, 4, cl, False))
