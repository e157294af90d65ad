"""mlplat.perf.dry_run: meta-device parameter counts equal the closed form, the dry run of every experiment, and
the paper's setup predicted near Table 1."""
from __future__ import annotations

import pytest

from mlplat.config import from_dict, load_config
from mlplat.parallel.pipeline.layout import PipelineLayout
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


def test_dry_run_of_every_experiment():
    """Composed as `+experiment=NAME dry_run=true` composes it; meta-device counts equal the closed form."""
    import json

    from hydra import compose, initialize_config_dir

    from mlplat.perf.dry_run import format_plan, plan

    plans = {}
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        for name in TABLE1:
            raw = compose(config_name="config", overrides=[f"experiment={name}", "dry_run=true"])
            plans[name] = plan(load_config(raw), experiment=name)
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
    assert "DOES NOT FIT" not in format_plan(one_t)


def test_paper_setup_predictions_are_near_table1():
    """A guard on the cost model (not a benchmark): the paper's setup predicted within 25% of Table 1."""
    from omegaconf import OmegaConf

    from mlplat.perf.dry_run import plan

    for name, paper in zip(TABLE1, PAPER_TFLOPS):
        exp = OmegaConf.load(CONF / "experiment" / f"{name}.yaml")
        cfg = {"model": OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{name}.yaml")),
               "cluster": OmegaConf.to_container(OmegaConf.load(CONF / "cluster" / "dgx_a100.yaml")),
               "parallel": OmegaConf.to_container(exp.parallel),
               "kernels": {"recompute": "full", "attention": "unfused", "fused": True},
               "trainer": {"precision": "megatron-fp16", "devices": 8, "num_nodes": exp.trainer.num_nodes}}
        pl = plan(from_dict(cfg), use_meta=False, max_compute_ops=20_000)
        assert 0.75 < pl["predicted_tflops_per_gpu"] / paper < 1.25, (name, pl["predicted_tflops_per_gpu"])
