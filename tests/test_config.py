"""The config contract: every file under conf/ composes and validates, and every invalid
configuration is refused before any process starts, with one line that names the key, the value and the rule.

Fast and in-process (Hydra's compose API), except a few CLI checks that the user really sees that one line.
The conf/ tree is enumerated when the tests are collected, so new model/experiment/cluster files are covered
without touching this file.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mlplat.config import ModelConfig, RunConfig, from_dict, load_config
from mlplat.errors import ConfigError
from mlplat.train import load_checked, preflight, typed_model_keys
from tests.helpers.cli import run_module

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

# Groups whose every file must validate on top of the defaults as they are (a layout, a logger, ...).
# `model` files are checked under `parallel=single`: a paper-sized model need not split over the default
# CPU layout (e.g. 30 layers over p·v=4), and that refusal is tested on its own below.
EXPERIMENT, CLUSTER, LAUNCHER = "experiment", "cluster", "hydra/launcher"


def _options(group: str) -> list[str]:
    folder = CONF / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def _groups() -> list[str]:
    return sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in (EXPERIMENT, "hydra"))


GROUP_CHOICES = [(g, o) for g in _groups() for o in _options(g)]
EXPERIMENTS = _options(EXPERIMENT)
SUBMITIT_LAUNCHERS = ["submitit_local", "submitit_slurm"]  # from hydra-submitit-launcher
LOCAL_LAUNCHERS = _options(LAUNCHER)


@pytest.fixture(scope="module")
def hydra_conf():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def _compose(*overrides: str, hydra_cfg: bool = False):
    return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra_cfg)


def _load(*overrides: str, world_size: int | None = None) -> RunConfig:
    """The config as a run means it: validated, and its inputs (data, tokenizer, init_from, device) checked."""
    return load_checked(_compose(*overrides), world_size=world_size)


def _preflight(run_dir: Path, *overrides: str) -> RunConfig:
    """load_checked then every check that reads a file or the environment, as `python -m mlplat.train` runs them."""
    return preflight(load_checked(_compose(*overrides)), run_dir)


def _refusal(*overrides: str, world_size: int | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        _load(*overrides, world_size=world_size)
    message = str(info.value)
    assert "\n" not in message, f"not one line: {message!r}"
    return message


# -- every config composes and validates -------------------------------------------------------------------
def test_conf_tree_has_the_contract_groups():
    assert {"model", "parallel", "kernels", "data", "optim", "trainer", "logger"} <= set(_groups())
    assert "tiny" in _options("model") and "gpt1t" in EXPERIMENTS


def test_defaults_validate(hydra_conf):
    cfg = _load()
    p = cfg.parallel
    assert p.dp is not None and cfg.trainer.devices * cfg.trainer.num_nodes == p.world_size
    single = _load("parallel=single")
    assert (single.parallel.tp, single.parallel.pp, single.parallel.dp, single.trainer.devices) == (1, 1, 1, 1)
    assert not cfg.optim.distributed and cfg.optim.grad_reduce_dtype == "main"
    megatron = _load("trainer.precision=bf16-megatron", "optim.distributed=true", "optim.grad_reduce_dtype=bf16")
    assert megatron.optim.distributed and megatron.trainer.precision == "bf16-megatron"
    # optim.distributed=true is optim.sharding=optim's alias; params sharding includes the distributed optimizer
    assert cfg.optim.sharding == "none" and megatron.optim.sharding == "optim"
    assert _load("optim.sharding=optim").optim.distributed
    params = _load("optim.sharding=params", "parallel.dp_shard=2")
    assert params.optim.distributed and params.optim.sharding == "params" and params.parallel.dp_shard == 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A text file big enough for the default batch and sequence length (validation checks its size)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("A line of a user's own text, long enough to fill some windows.\n" * 2000)
    return path


@pytest.fixture(scope="module")
def indexed_prefix(tmp_path_factory) -> str:
    """Indexed data (byte tokens) big enough for the default batch and sequence length in train and valid."""
    from mlplat.data.indexed import IndexedWriter

    prefix = str(tmp_path_factory.mktemp("indexed") / "docs")
    with IndexedWriter(prefix, "uint16") as w:
        for i in range(1000):
            w.add_document([(i + j) % 256 for j in range(100)])
    return prefix


@pytest.mark.parametrize("group,option", GROUP_CHOICES, ids=[f"{g}={o}" for g, o in GROUP_CHOICES])
def test_group_choice_composes_and_validates(hydra_conf, corpus, indexed_prefix, group, option):
    overrides = [f"{group}={option}"]
    if group == "model":
        overrides.append("parallel=single")
    if group == "data" and option == "text":
        overrides.append(f"data.path={corpus}")
    if group == "data" and option == "indexed":
        overrides += [f"data.prefix={indexed_prefix}", "data.tokenizer=byte"]
    raw = _compose(*overrides)
    if group == CLUSTER:
        from mlplat.perf.cluster import Cluster

        cluster = Cluster.from_config(OmegaConf.to_container(raw.cluster, resolve=True))
        assert cluster.gpus_per_node >= 1
    cfg = load_checked(raw)
    if group in ("model", "parallel", "kernels", "optim", "trainer", "data"):
        # What the file says is what the run gets (no key silently dropped).
        section = OmegaConf.to_container(raw[group], resolve=True)
        for key, value in section.items():
            got = getattr(getattr(cfg, group), key)
            if dataclasses.is_dataclass(got):  # a group of keys of its own (model.moe)
                got = dataclasses.asdict(got)
            if value is not None:
                assert got == (tuple(value) if isinstance(got, tuple) else value) or str(got) == str(value), key
    if group == "logger":
        assert cfg.logger.name == option


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_validates(hydra_conf, name):
    raw = _compose(f"experiment={name}")
    cfg = load_config(raw)
    p, t = cfg.parallel, cfg.trainer
    assert t.devices * t.num_nodes == p.world_size
    # Every chunk holds layers: evenly, or the uneven split of llama3_405b's 126 over p·v = 16 (7, 8 x14, 7); but the
    # loss's chunk of DeepSeek-V3's (1, 2 x30, 0), whose MTP module is its work.
    counts = p.pipeline.chunk_layers(cfg.model.n_layers)
    assert len(counts) == p.pp * p.vpp and sum(counts) == cfg.model.n_layers and min(counts[:-1], default=1) >= 1
    assert counts[-1] >= 1 or cfg.model.mtp.enabled


@pytest.mark.parametrize("launcher", sorted(set(SUBMITIT_LAUNCHERS + LOCAL_LAUNCHERS)))
def test_hydra_launcher_composes(hydra_conf, launcher):
    import mlplat.train  # noqa: F401  (registers the resolvers conf/hydra/launcher/*.yaml use)

    raw = _compose(f"hydra/launcher={launcher}", hydra_cfg=True)
    cfg = load_config(raw)
    launch = raw.hydra.launcher
    assert launch._target_
    if "submitit" in launch._target_:
        # One task per rank: the resources follow the layout (8 ranks for the default 3D CPU layout).
        assert launch.tasks_per_node == cfg.trainer.devices and launch.nodes == cfg.trainer.num_nodes


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_on_slurm_asks_for_one_task_per_gpu(hydra_conf, name):
    import mlplat.train  # noqa: F401

    raw = _compose(f"experiment={name}", "hydra/launcher=submitit_slurm", hydra_cfg=True)
    cfg = load_config(raw)
    launch = raw.hydra.launcher
    assert launch.nodes == cfg.trainer.num_nodes and launch.tasks_per_node == cfg.trainer.devices
    if cfg.trainer.accelerator == "gpu":  # under SLURM, tasks per node must equal GPUs per node
        assert launch.tasks_per_node == launch.gpus_per_node


# -- every invalid configuration: one line naming key, value and rule ---------------------------------------
ONE = "parallel=single"
INVALID = {
    # id: (overrides, world size from a launcher, fragments the message must contain)
    "unknown-attention": ([ONE, "kernels.attention=foo"], None,
                          ["kernels.attention", "foo", "is not one of", "flash", "sdpa", "math"]),
    "heads-not-dividing-hidden": ([ONE, "model.n_heads=5"], None,
                                  ["model.hidden=128", "model.n_heads=5", "not divisible"]),
    "data-text-without-path": ([ONE, "data=text"], None, ["data.path", "missing"]),
    "data-path-missing-file": ([ONE, "data=text", "data.path=/nonexistent/corpus.txt"], None,
                               ["data.path=/nonexistent/corpus.txt", "does not exist"]),
    "negative-lr": ([ONE, "optim.lr=-0.1"], None, ["optim.lr=-0.1", "positive"]),
    "heads-not-divisible-by-tp": ([ONE, "parallel.tp=8"], None,
                                  ["model.n_heads=4", "parallel.tp=8", "not divisible"]),
    # hidden = k·n_heads and n_heads = j·t, so hidden % t is implied; the FFN width is the one that can fail.
    "ffn-not-divisible-by-tp": ([ONE, "parallel.tp=4", "model.ffn_hidden=102"], None,
                                ["model.ffn_hidden=102", "parallel.tp=4", "not divisible"]),
    "more-devices-than-layout": ([ONE, "parallel.tp=2", "parallel.dp=1", "trainer.devices=4"], None,
                                 ["trainer.devices=4", "does not equal", "parallel.tp·parallel.pp·parallel.dp",
                                  "2·1·1=2"]),
    "fewer-devices-than-layout": ([ONE, "parallel.tp=2", "parallel.dp=1", "trainer.devices=1"], None,
                                  ["trainer.devices=1", "does not equal", "2·1·1=2"]),
    "devices-not-divisible-by-tp-pp": ([ONE, "parallel.tp=2", "trainer.devices=3"], None,
                                       ["trainer.devices=3", "not divisible", "parallel.tp·parallel.pp", "=2"]),
    "nodes-times-devices": ([ONE, "parallel.tp=2", "parallel.dp=2", "trainer.devices=2", "trainer.num_nodes=3"],
                            None, ["trainer.devices·trainer.num_nodes=2·3=6", "does not equal", "2·1·2=4"]),
    "world-size-not-layout": ([ONE, "parallel.tp=2", "parallel.dp=1"], 4,
                              ["world size 4", "does not equal", "parallel.tp·parallel.pp·parallel.dp=2·1·1=2"]),
    "world-size-not-divisible": ([ONE, "parallel.tp=2"], 3, ["world size 3", "not divisible", "parallel.tp"]),
    "global-not-divisible-by-micro-dp": ([ONE, "parallel.micro_batch_size=4", "parallel.global_batch_size=12",
                                          "parallel.dp=2", "trainer.devices=2"], None,
                                         ["parallel.global_batch_size=12", "not divisible",
                                          "parallel.micro_batch_size·parallel.dp=4·2=8"]),
    "interleaved-m-not-multiple-of-pp": ([ONE, "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved",
                                          "parallel.micro_batch_size=2", "parallel.global_batch_size=6"], None,
                                         ["parallel.schedule=interleaved", "parallel.global_batch_size",
                                          "6/(2·1)=3", "multiple of parallel.pp=2"]),
    "layers-not-divisible-by-pp-vpp": ([ONE, "parallel.pp=2", "parallel.vpp=3", "parallel.schedule=interleaved"],
                                       None, ["model.n_layers=4", "parallel.pp·parallel.vpp=6", "not divisible"]),
    "layers-not-divisible-by-pp": ([ONE, "parallel.pp=3"], None,
                                   ["model.n_layers=4", "parallel.pp·parallel.vpp=3", "not divisible"]),
    "vpp-with-1f1b": ([ONE, "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=1f1b"], None,
                      ["parallel.vpp=2", "parallel.schedule=interleaved", "1f1b"]),
    "vpp-with-gpipe": ([ONE, "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=gpipe"], None,
                       ["parallel.vpp=2", "parallel.schedule=interleaved", "gpipe"]),
    "vpp-without-pipeline": ([ONE, "parallel.pp=1", "parallel.vpp=2", "parallel.schedule=interleaved"], None,
                             ["parallel.vpp=2", "parallel.pp", "parallel.pp=1"]),
    "unknown-schedule": ([ONE, "parallel.schedule=zigzag"], None, ["parallel.schedule", "zigzag", "is not one of"]),
    "unknown-precision": ([ONE, "trainer.precision=8-true"], None, ["trainer.precision", "8-true", "is not one of"]),
    "unknown-grad-reduce-dtype": ([ONE, "optim.grad_reduce_dtype=fp8"], None,
                                  ["optim.grad_reduce_dtype", "fp8", "is not one of", "main", "bf16"]),
    "bf16-reduce-without-bf16-megatron": ([ONE, "optim.grad_reduce_dtype=bf16"], None,
                                          ["optim.grad_reduce_dtype=bf16", "needs trainer.precision=bf16-megatron",
                                           "trainer.precision=32-true"]),
    "post-validate-with-nothing-to-validate": ([ONE, "optim.post_validate=true", "optim.grad_clip=0"], None,
                                               ["optim.post_validate=true", "nothing to validate",
                                                "optim.grad_clip=0", "trainer.precision=32-true"]),
    "unknown-optimizer": ([ONE, "optim.name=lion"], None, ["optim.name='lion' is not one of adamw"]),
    "unknown-sharding": ([ONE, "optim.sharding=zero3"], None,
                         ["optim.sharding='zero3' is not one of none, optim, params"]),
    "dp-shard-without-sharding": (["parallel=single", "parallel.dp=4", "parallel.micro_batch_size=4",
                                   "parallel.dp_shard=2"], 4,
                                  ["parallel.dp_shard=2 shards nothing with optim.sharding=none"]),
    "dp-shard-not-dividing": (["parallel=single", "parallel.dp=4", "parallel.micro_batch_size=4",
                               "parallel.dp_shard=3", "optim.sharding=params"], 4,
                              ["parallel.dp_shard=3 does not divide the 4 replicas", "parallel.dp·parallel.cp=4·1"]),
    "dp-shard-of-one": ([ONE, "parallel.dp_shard=1", "optim.sharding=params"], None,
                        ["parallel.dp_shard=1 must be an integer of at least 2"]),
    "params-sharding-under-autocast": ([ONE, "optim.sharding=params", "trainer.precision=bf16-mixed"], None,
                                       ["optim.sharding=params with trainer.precision=bf16-mixed",
                                        "use trainer.precision=bf16-megatron"]),
    "distributed-optimizer-not-a-bool": ([ONE, "optim.distributed=maybe"], None,
                                         ["optim.distributed", "maybe", "true or false"]),
    "unknown-logger": ([ONE, "logger.name=tensorboard"], None, ["logger.name", "tensorboard", "is not one of"]),
    "zero-tp": ([ONE, "parallel.tp=0"], None, ["parallel.tp=0", "at least 1"]),
    "not-an-integer": ([ONE, "parallel.tp=two"], None, ["parallel.tp", "two", "integer"]),
    "optional-not-an-integer": ([ONE, "parallel.dp=two"], None, ["parallel.dp", "two", "integer"]),
    "null-for-required": ([ONE, "parallel.pp=null"], None, ["parallel.pp=null", "needs a value"]),
    "unknown-key": ([ONE, "+parallel.tpp=2"], None, ["parallel.tpp", "not a known key"]),
    "seed-not-an-integer": ([ONE, "seed=abc"], None, ["seed", "abc", "integer"]),
    "dropout-out-of-range": ([ONE, "model.dropout=1.5"], None, ["model.dropout=1.5", "[0, 1)"]),
    "betas-not-a-list": ([ONE, "optim.betas=0.9"], None, ["optim.betas=0.9", "must be a list"]),
    "val-check-interval-zero": ([ONE, "trainer.val_check_interval=0"], None,
                                ["trainer.val_check_interval=0", "at least 1"]),
    "sequence-parallel-without-tp": ([ONE, "parallel.sequence_parallel=true"], None,
                                     ["parallel.sequence_parallel=true", "needs parallel.tp > 1", "parallel.tp=1"]),
    "sequence-parallel-seq-len-not-divisible": ([ONE, "parallel.tp=4", "parallel.sequence_parallel=true",
                                                 "model.seq_len=126"], None,
                                                ["model.seq_len=126", "not divisible", "parallel.tp=4",
                                                 "parallel.sequence_parallel=true"]),
    "sequence-parallel-not-a-bool": ([ONE, "parallel.tp=2", "parallel.sequence_parallel=maybe"], None,
                                     ["parallel.sequence_parallel", "maybe", "true or false"]),
    # Once accepted silently: an MLP of width 0 trained, an unknown W&B mode ran, interleaving one chunk ran 1F1B.
    "ffn-hidden-zero": ([ONE, "model.ffn_hidden=0"], None,
                        ["model.ffn_hidden=0", "at least 1", "null = 4·model.hidden"]),
    "ffn-hidden-negative": ([ONE, "model.ffn_hidden=-512"], None, ["model.ffn_hidden=-512", "at least 1"]),
    "logger-mode-unknown": ([ONE, "logger.mode=bogus"], None, ["logger.mode='bogus'", "is not one of online, offline"]),
    "interleaved-one-chunk": (["parallel.schedule=interleaved", "parallel.vpp=1"], None,
                              ["parallel.schedule=interleaved needs parallel.vpp >= 2", "parallel.vpp=1",
                               "parallel.schedule=1f1b"]),
    "profile-steps-not-a-range": ([ONE, "profile.steps=[3]"], None,
                                  ["profile.steps=[3]", "[FROM, TO]", "one step N"]),
    "profile-steps-not-a-number": ([ONE, "profile.steps=abc"], None, ["profile.steps='abc'", "[FROM, TO]"]),
    # Context parallelism: 2·c chunks per sequence, a block kernel that returns the log-sum-exp, no dropout.
    "cp-seq-len-not-divisible": ([ONE, "parallel.cp=3"], None,
                                 ["model.seq_len=128", "not divisible by 2·parallel.cp=6", "2·c chunks"]),
    "cp-with-flash": ([ONE, "parallel.cp=2", "kernels.attention=flash"], None,
                      ["kernels.attention=flash", "parallel.cp=2", "log-sum-exp", "kernels.attention=sdpa or auto"]),
    "cp-with-dropout": ([ONE, "parallel.cp=2", "model.dropout=0.1"], None,
                        ["model.dropout=0.1", "must be 0 under parallel.cp=2"]),
    "cp-sequence-parallel-not-divisible": ([ONE, "parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true",
                                            "model.seq_len=20"], None,
                                           ["model.seq_len/parallel.cp=10", "not divisible by parallel.tp=4"]),
    "cp-zero": ([ONE, "parallel.cp=0"], None, ["parallel.cp=0", "positive integer"]),
    "cp-world-size": ([ONE, "parallel.cp=2", "parallel.tp=2"], 2,
                      ["world size 2", "not divisible by parallel.tp·parallel.cp·parallel.pp=2·2·1=4"]),
    "pack-not-a-bool": ([ONE, "data.pack=maybe"], None, ["data.pack", "maybe", "true or false"]),
    # FP8: a known recipe, a precision whose GEMMs it can replace, blockwise blocks whole on each rank.
    "fp8-unknown": ([ONE, "kernels.fp8=e4m3"], None, ["kernels.fp8='e4m3'", "is not one of", "blockwise"]),
    "fp8-delayed-not-built": ([ONE, "kernels.fp8=delayed"], None,
                              ["kernels.fp8=delayed", "amax history", "not built", "current scaling", "rowwise"]),
    "fp8-under-autocast": ([ONE, "kernels.fp8=tensorwise", "trainer.precision=bf16-mixed"], None,
                           ["kernels.fp8=tensorwise", "trainer.precision=bf16-mixed", "autocast", "bf16-megatron"]),
    "fp8-blockwise-shard-splits-a-block": ([ONE, "kernels.fp8=blockwise", "parallel.tp=2"], None,
                                           ["kernels.fp8=blockwise", "model.hidden=128", "parallel.tp=2",
                                            "multiple of 128·2"]),
    # replicated K/V heads: a rank's QKV rows are its queries and the shared heads, whole blocks only at d % 128 = 0
    "fp8-blockwise-replicated-kv-heads-split-a-block": (
        [ONE, "model=llama_tiny", "model.n_kv_heads=1", "parallel.tp=2", "kernels.fp8=blockwise",
         "trainer.precision=64-true"], None,
        ["kernels.fp8=blockwise with model.n_kv_heads=1 < parallel.tp=2", "multiple of 128", "head size 32"]),
    "fp8-blockwise-cp-chunk-splits-a-block": ([ONE, "kernels.fp8=blockwise", "parallel.cp=2", "model.hidden=256"],
                                              None, ["kernels.fp8=blockwise", "model.seq_len=128",
                                                     "2·parallel.cp=4", "multiple of 128·4"]),
    # Keys that would be ignored without a word.
    "data-path-without-text": ([ONE, "data.path=/tmp/mine.txt"], None,
                               ["data.path=/tmp/mine.txt is read by data=text only", "data=pydoc", "add data=text"]),
    "activation-on-swiglu": ([ONE, "model=llama_tiny", "model.activation=gelu_tanh"], None,
                             ["model.activation=gelu_tanh applies to model.mlp=gelu", "SiLU"]),
    "vocab-pad-zero": ([ONE, "model.vocab_pad_multiple=0"], None, ["model.vocab_pad_multiple=0", "at least 1"]),
    "vocab-pad-negative": ([ONE, "model.vocab_pad_multiple=-3"], None, ["model.vocab_pad_multiple=-3"]),
    "accelerator-unknown": ([ONE, "trainer.accelerator=tpu"], None,
                            ["trainer.accelerator='tpu' is not one of cpu, gpu, cuda, auto"]),
    "seed-too-large": ([ONE, "seed=36893488147419103232"], None, ["seed=36893488147419103232", "[0, 2^63)"]),
    "wandb-project-slash": ([ONE, "logger.project=team/proj"], None,
                            ["logger.project=team/proj may not contain", "logger.entity"]),
    "gpu-dry-run-on-cpu-cluster": (["model=gpt125m", "trainer=gpu", "parallel=single", "parallel.tp=2",
                                    "dry_run=true"], None,
                                   ["dry_run=true with trainer.accelerator=gpu would plan GPUs on cluster=local_cpu",
                                    "cluster=dgx_h100"]),
    # Uneven pipeline stages: the other chunks must split the rest evenly, each end holds a layer, a pipeline.
    "uneven-rest-not-split": ([ONE, "parallel.pp=3", "model.n_layers=8", "parallel.first_stage_layers=3"], None,
                              ["parallel.first_stage_layers=3 leaves model.n_layers-3=5 layers for the other 2",
                               "parallel.pp·parallel.vpp=3", "split the rest evenly"]),
    "uneven-ends-take-all": ([ONE, "parallel.pp=4", "parallel.vpp=2", "parallel.schedule=zbv",
                              "parallel.first_stage_layers=2", "parallel.last_stage_layers=2"], None,
                             ["parallel.first_stage_layers=2, parallel.last_stage_layers=2 leave "
                              "model.n_layers-2-2=0 layers for the other 6"]),
    "uneven-zero-layers": ([ONE, "parallel.pp=2", "parallel.first_stage_layers=0"], None,
                           ["parallel.first_stage_layers=0 must be an integer >= 1"]),
    "uneven-negative-layers": ([ONE, "parallel.pp=2", "parallel.last_stage_layers=-1"], None,
                               ["parallel.last_stage_layers=-1 must be an integer >= 0"]),
    "uneven-two-chunks-sum": ([ONE, "parallel.pp=2", "parallel.first_stage_layers=1",
                               "parallel.last_stage_layers=1"], None,
                              ["must add up to model.n_layers=4", "parallel.pp·parallel.vpp=2"]),
    "uneven-without-pipeline": ([ONE, "parallel.first_stage_layers=2"], None,
                                ["parallel.first_stage_layers=2 needs parallel.pp > 1"]),
    "tags-not-a-list": ([ONE, "logger.tags=notalist"], None,
                        ["logger.tags='notalist' must be a list", "logger.tags=[notalist]"]),
    # Restarts inside the job: a count, and only with saves to resume from.
    "max-restarts-negative": ([ONE, "trainer.max_restarts=-1"], None,
                              ["trainer.max_restarts=-1 must be a non-negative integer"]),
    "max-restarts-without-saves": ([ONE, "trainer.max_restarts=2", "checkpoint.every_steps=0"], None,
                                   ["trainer.max_restarts=2 needs checkpoint.every_steps > 0 (got 0)",
                                    "resumes from the last checkpoint"]),
    "zero-bubble-without-a-pipeline": ([ONE, "parallel.schedule=zb_h2"], None,
                                       ["parallel.schedule=zb_h2 schedules the stages of a pipeline and "
                                        "parallel.pp=1 has one"]),
    "v-shape-without-a-pipeline": ([ONE, "parallel.schedule=zbv", "parallel.vpp=2"], None,
                                   ["parallel.schedule=zbv schedules the stages of a pipeline"]),
    "moe-top-k-over-experts": ([ONE, "model=moe_tiny", "model.moe.top_k=9"], None,
                               ["model.moe.top_k=9 must be in [1, model.moe.num_experts=8]"]),
    "moe-unknown-key": ([ONE, "model=moe_tiny", "+model.moe.experts=4"], None,
                        ["model.moe.experts is not a known key", "num_experts"]),
}

# model.moe.* (mlplat.config.rules._check_moe): each bad value refused in one line naming the key and the rule.
MOE = dict(num_experts=4, top_k=2)
SMALL_BATCH = {"micro_batch_size": 1, "global_batch_size": 4}
MOE_INVALID = {
    "num_experts=-1": (dict(num_experts=-1), {}, "model.moe.num_experts=-1 must be non-negative"),
    "top_k=0": (dict(MOE, top_k=0), {}, "model.moe.top_k=0 must be in [1, model.moe.num_experts=4]"),
    "router": (dict(MOE, router="relu"), {}, "model.moe.router='relu' is not one of softmax, sigmoid"),
    "routed_scaling_factor": (dict(MOE, router="sigmoid", routed_scaling_factor=0.0), {},
                              "model.moe.routed_scaling_factor=0.0 must be positive (the routed experts' gates are "
                              "multiplied by it; 1 = as the router gives them)"),
    "dense_layers": (dict(MOE, dense_layers=4), {}, "model.moe.dense_layers=4 must be in [0, model.n_layers=4)"),
    "shared_gate": (dict(MOE, shared_gate=True), {}, "model.moe.shared_gate=true gates the shared experts"),
    "aux_loss_coeff": (dict(MOE, aux_loss_coeff=-0.1), {}, "model.moe.aux_loss_coeff=-0.1 must be non-negative"),
    "z_loss_coeff": (dict(MOE, z_loss_coeff=-1.0), {}, "model.moe.z_loss_coeff=-1.0 must be non-negative"),
    "capacity_factor": (dict(MOE, capacity_factor=0.0), {},
                        "model.moe.capacity_factor=0.0 must be in (0, model.moe.num_experts/model.moe.top_k=2]"),
    # past E/k nothing can drop, and ceil(c·T·k/E) overflowed at 1e308
    "capacity_factor-huge": (dict(MOE, capacity_factor=1e308), {},
                             "model.moe.capacity_factor=1e+308 must be in (0, model.moe.num_experts/model.moe.top_k"),
    # on a dense model the keys would change nothing, silently
    "dense-model-moe-keys": (dict(router="relu", top_k=-3, dispatcher="carrier_pigeon"), {},
                             "model.moe.top_k=-3, model.moe.router=relu, model.moe.dispatcher=carrier_pigeon set on a "
                             "dense model (model.moe.num_experts=0)"),
    "etp-not-1-or-t": (MOE, {"parallel": {"tp": 2, "etp": 3}}, "parallel.etp=3 must be 1 or parallel.tp=2 (or null)"),
    "ffn-tp": (dict(MOE, ffn_hidden=30), {"parallel": {"tp": 4}},
               "model.moe.ffn_hidden=30 is not divisible by parallel.etp=4"),
    "dispatcher": (dict(MOE, dispatcher="deepep"), {}, "model.moe.dispatcher='deepep' is not one of alltoall"),
    "seq-etp1": (MOE, {"parallel": {"tp": 2, "etp": 1}, "model": {"seq_len": 63}},
                 "model.seq_len=63 is not divisible by parallel.tp·parallel.cp=2·1"),
    # Expert parallelism (rules.expert_parallel_violations), after the layout is resolved.
    "ep-stage": (MOE, {"parallel": {"ep": 3, "dp": 2}}, "parallel.ep=3 does not divide the 2 ranks of a pipeline"),
    "ep-experts": (MOE, {"parallel": {"ep": 8, "dp": 8, "micro_batch_size": 1, "global_batch_size": 8}},
                   "model.moe.num_experts=4 is not divisible by parallel.ep=8"),
    "ep-etp": (MOE, {"parallel": {"ep": 2, "tp": 2, "etp": 2}}, "parallel.etp=2 with parallel.ep=2 is not built"),
    "etp-value": (MOE, {"parallel": {"tp": 4, "etp": 2}}, "parallel.etp=2 must be 1 or parallel.tp=4"),
    "ep-dense": ({}, {"parallel": {"ep": 2, "dp": 2}}, "parallel.ep=2 lays out experts, but model.moe.num_experts=0"),
    "fp8-blockwise-etp-splits-a-block": (dict(MOE, ffn_hidden=128), {"kernels": {"fp8": "blockwise"},
                                                                     "parallel": {"tp": 2, "etp": 2},
                                                                     "model": {"hidden": 256, "ffn_hidden": 512}},
                                         "kernels.fp8=blockwise needs whole 128-blocks on each rank: "
                                         "model.moe.ffn_hidden=128 split by parallel.etp=2 is not a multiple of "
                                         "128·2"),
    "bias-post-validate": (dict(MOE, bias_update_rate=0.001), {"optim": {"post_validate": True}},
                           "model.moe.bias_update_rate > 0 with optim.post_validate=true"),
    "type": (dict(MOE, top_k="two"), {}, "model.moe.top_k='two' must be an integer"),
    # The overlapped schedule hides the expert all-to-alls (rules.paired_schedule_violations).
    "overlap-dense": ({}, {"parallel": {"schedule": "1f1b_overlap"}},
                      "parallel.schedule=1f1b_overlap overlaps the expert all-to-alls, but model.moe.num_experts=0"),
    "overlap-ep1": (MOE, {"parallel": {"schedule": "1f1b_overlap", "dp": 2, "ep": 1}},
                    "parallel.schedule=1f1b_overlap overlaps the expert all-to-alls, but parallel.ep=1 posts none"),
    "overlap-allgather": (dict(MOE, dispatcher="allgather"), {"parallel": {"schedule": "1f1b_overlap", "ep": 2,
                                                                          "dp": 2}},
                          "(model.moe.dispatcher=alltoall, node_alltoall), not model.moe.dispatcher=allgather"),
    # The node dispatcher's nodes (rules.ep_node_violations).
    "ep_per_node-alltoall": (MOE, {"parallel": {"ep": 2, "dp": 2, "ep_per_node": 1}},
                             "parallel.ep_per_node=1 splits the ep group into nodes for a dispatcher that runs on them "
                             "(node_alltoall), not model.moe.dispatcher=alltoall: set it to null"),
    "ep_per_node-divides": (dict(MOE, dispatcher="node_alltoall"), {"parallel": {"ep": 4, "dp": 4, "ep_per_node": 3,
                                                                                 **SMALL_BATCH}},
                            "parallel.ep_per_node=3 must divide parallel.ep=4 and trainer.devices=4"),
    "ep_per_node-groups": (dict(MOE, dispatcher="node_alltoall", router="sigmoid", n_groups=2),
                           {"parallel": {"ep": 4, "dp": 4, "ep_per_node": 1, **SMALL_BATCH}},
                           "model.moe.n_groups=2 with model.moe.dispatcher=node_alltoall: a node's "
                           "parallel.ep_per_node·num_experts/parallel.ep=1 experts are not whole groups of 2"),
    "overlap-params": (MOE, {"parallel": {"schedule": "1f1b_overlap", "ep": 2, "dp": 2},
                             "optim": {"sharding": "params"}},
                       "parallel.schedule=1f1b_overlap with optim.sharding=params"),
    "overlap-full-recompute-dropout": (MOE, {"parallel": {"schedule": "1f1b_overlap", "ep": 2, "dp": 2},
                                             "kernels": {"recompute": "full"}, "model": {"dropout": 0.1}},
                                       "parallel.schedule=1f1b_overlap with kernels.recompute=full and "
                                       "model.dropout=0.1"),
}


def test_the_node_dispatchers_nodes_default_to_the_ep_ranks_a_node_holds():
    """parallel.ep_per_node=null under node_alltoall: gcd(ep, trainer.devices), a node's run of consecutive ep ranks;
    left null under another dispatcher."""
    for dispatcher, nodes, want in (("node_alltoall", 1, 4), ("node_alltoall", 2, 2), ("alltoall", 1, None)):
        raw = {"model": {"vocab_size": 256, "moe": dict(MOE, dispatcher=dispatcher)},
               "parallel": {"ep": 4, "dp": 4, **SMALL_BATCH}, "trainer": {"num_nodes": nodes}}
        assert load_config(raw, world_size=None, check_data=False).parallel.ep_per_node == want


@pytest.mark.parametrize("case", list(MOE_INVALID))
def test_invalid_moe_config_is_refused_in_one_line(case):
    moe, sections, message = MOE_INVALID[case]
    raw = {**sections, "model": {"vocab_size": 256, "moe": moe, **sections.get("model", {})}}
    with pytest.raises(ConfigError) as info:
        load_config(raw, world_size=None, check_data=False)
    assert "\n" not in str(info.value) and message in str(info.value), str(info.value)


def test_the_fp8_dispatch_needs_a_dispatcher_that_sends_fp8():
    """model.moe.fp8_dispatch with a registered dispatcher whose runtime sends the run's precision only (a test's
    toy) is refused in one line; alltoall and allgather take it."""
    from mlplat.specs import dispatchers
    from tests.helpers.moe import TOY

    raw = lambda name: {"model": {"vocab_size": 256, "moe": dict(MOE, dispatcher=name, fp8_dispatch=True)}}  # noqa: E731
    with dispatchers.registered(TOY), pytest.raises(ConfigError) as info:
        load_config(raw(TOY.name), world_size=None, check_data=False)
    assert str(info.value) == (f"model.moe.fp8_dispatch=true with model.moe.dispatcher={TOY.name}: that dispatcher "
                               f"sends the tokens in the run's precision only; use alltoall or allgather, or "
                               f"model.moe.fp8_dispatch=false")
    for name in ("alltoall", "allgather"):
        assert load_config(raw(name), world_size=None, check_data=False).model.moe.fp8_dispatch


# model.mtp.* (mlplat.config.rules._check_mtp): refused in one line naming the key and the rule.
MTP_INVALID = {
    "depth": (dict(depth=-1), {}, "model.mtp.depth=-1 must be non-negative (0 = off)"),
    "loss_coeff": (dict(depth=1, loss_coeff=-0.1), {}, "model.mtp.loss_coeff=-0.1 must be a non-negative number"),
    "loss_coeff-inf": (dict(depth=1, loss_coeff=float("inf")), {}, "model.mtp.loss_coeff=inf must be a finite number"),
    "unknown": (dict(layers=2), {}, "model.mtp.layers is not a known key (known: depth, loss_coeff)"),
    "loss_coeff-without-modules": (dict(loss_coeff=0.1), {}, "model.mtp.loss_coeff=0.1 set without modules "
                                                             "(model.mtp.depth=0)"),
    "init_from": (dict(depth=1), {"init_from": "/models/llama"}, "model.mtp.depth=1 with init_from=/models/llama: "
                                                                  "the transformers checkpoints read with multi-token"),
    "type": (dict(depth="two"), {}, "model.mtp.depth='two' must be an integer"),
    # the layers neither split evenly alone nor with the modules counted as the last chunk's
    "split": (dict(depth=2), {"model": {"n_layers": 3}, "parallel": {"pp": 2, "vpp": 2, "schedule": "interleaved"}},
              "model.n_layers=3 does not split evenly over parallel.pp·parallel.vpp=4 model chunks, nor with the "
              "model.mtp.depth=2 modules counted"),
    # its keys are checked before the split that counts its modules
    "depth-before-split": (dict(depth=-1), {"model": {"n_layers": 3}, "parallel": {"pp": 2, "vpp": 2,
                                                                                   "schedule": "interleaved"}},
                           "model.mtp.depth=-1 must be non-negative"),
    # latent widths on a model without latent attention would change nothing
    "mla-keys-on-mha": (dict(), {"model": {"mla": {"q_lora_rank": 8}}},
                        "model.mla.q_lora_rank=8 set with model.attention=mha: they shape latent attention only"),
}


@pytest.mark.parametrize("case", list(MTP_INVALID))
def test_invalid_mtp_config_is_refused_in_one_line(case):
    mtp, sections, message = MTP_INVALID[case]
    raw = {**sections, "model": {"vocab_size": 256, "mtp": mtp, **sections.get("model", {})}}
    with pytest.raises(ConfigError) as info:
        load_config(raw, world_size=None, check_data=False)
    assert "\n" not in str(info.value) and message in str(info.value), str(info.value)


def test_mtp_config_is_read_as_its_own_group():
    cfg = load_config({"model": {"vocab_size": 256, "mtp": dict(depth=2)}}, check_data=False)
    assert cfg.model.mtp.depth == 2 and cfg.model.mtp.loss_coeff == 0.3
    assert cfg.model.weights()["mtp.depth"] == 2 and "mtp.depth" not in ModelConfig().weights()
    assert ModelConfig(**dataclasses.asdict(cfg.model)) == cfg.model  # a manifest's copy reads back the same


def test_moe_config_is_read_as_its_own_group():
    cfg = load_config({"model": {"vocab_size": 256, "moe": dict(MOE, router="sigmoid")}}, check_data=False)
    assert cfg.model.moe.num_experts == 4 and cfg.model.moe.router == "sigmoid" and cfg.model.is_moe_layer(0)
    assert ModelConfig(**dataclasses.asdict(cfg.model)) == cfg.model  # a manifest's copy reads back the same
    assert not load_config({"model": {"vocab_size": 256}}, check_data=False).model.is_moe_layer(0)


# -- every model.* key typed as model.KEY=VALUE on every model -------------------------------------------------------
def _model_keys(cls: type = ModelConfig, prefix: str = "") -> dict[str, object]:
    """Every `model.*` key, dotted, at its schema default: a section of keys of its own (a dataclass, such as
    model.moe) walked, whatever sections the schema has."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        default = getattr(cls(), f.name)
        if dataclasses.is_dataclass(default):
            out.update(_model_keys(type(default), f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = default
    return out


@pytest.mark.parametrize("model", _options("model"))
def test_every_model_key_is_typed_without_a_plus_on_every_model(hydra_conf, model):
    """conf/config.yaml composes model_schema (every ModelConfig key at its default, from the dataclass) under each
    model, so `model.KEY=VALUE` overrides a key the model's file omits (Hydra would refuse it as not in the config,
    asking for `+`)."""
    keys = _model_keys()
    assert {k.split(".")[0] for k in keys if "." in k} >= {"moe"}  # the nested sections are walked
    typed = [f"model.{key}={json.dumps(value)}" for key, value in keys.items()]
    composed = _compose(f"model={model}", *typed).model
    assert {key: OmegaConf.select(composed, key) for key in keys} == keys


def test_model_files_override_the_schema_defaults_and_the_command_line_both(hydra_conf):
    defaults = dataclasses.asdict(ModelConfig())
    assert OmegaConf.to_container(_compose().model.moe) == defaults["moe"]  # tiny_rope's file has no moe:
    moe = _compose("model=moe_tiny", "model.moe.top_k=4").model.moe
    assert (moe.num_experts, moe.ffn_hidden, moe.top_k, moe.dispatcher) == (8, 128, 4, "alltoall")
    mixtral = _compose("model=mixtral_8x7b", "model.dropout=0.1").model  # a key its file omits
    assert (mixtral.n_layers, mixtral.dropout, mixtral.init_std) == (32, 0.1, defaults["init_std"])


def test_moe_keys_on_the_default_model(hydra_conf):
    """The issue's commands: model.moe.num_experts=8 makes the default (dense) model a mixture of experts; moe keys
    on it without num_experts are refused in one line naming each key and value, invalid ones included."""
    raw = _compose(ONE, "model.vocab_size=256", "model.moe.num_experts=8", "model.moe.top_k=1", hydra_cfg=True)
    cfg = load_checked(raw, check_data=False)
    assert (cfg.model.moe.num_experts, cfg.model.moe.top_k, cfg.model.moe_layer_ids) == (8, 1, [0, 1, 2, 3])
    # only the keys typed count as typed (init_from checks those against config.json), not model_schema's
    assert typed_model_keys([str(o) for o in raw.hydra.overrides.task]) == \
        {"vocab_size", "moe", "moe.num_experts", "moe.top_k"}
    assert _refusal(ONE, "model.vocab_size=256", "model.moe.router=relu", "model.moe.top_k=-3",
                    "model.moe.dispatcher=carrier_pigeon") == (
        "model.moe.top_k=-3, model.moe.router=relu, model.moe.dispatcher=carrier_pigeon set on a dense model "
        "(model.moe.num_experts=0): they apply to experts only; set model.moe.num_experts, or drop them")


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_config_is_refused_in_one_line(hydra_conf, case):
    overrides, world_size, fragments = INVALID[case]
    message = _refusal(*overrides, world_size=world_size)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# Each once a NaN run that exited 0 (or a crash after training, for the temperature): refused in one line now.
NON_FINITE = {
    "optim.lr=inf": ["optim.lr=inf", "finite"],
    "optim.weight_decay=inf": ["optim.weight_decay=inf", "finite"],
    "optim.eps=inf": ["optim.eps=inf", "finite"],
    "optim.eps=0": ["optim.eps=0", "positive"],
    "optim.eps=-1e-8": ["optim.eps=-1e-08", "positive"],
    "model.norm_eps=inf": ["model.norm_eps=inf", "finite"],
    "model.rope_theta=inf": ["model.rope_theta=inf", "finite"],
    "model.init_std=nan": ["model.init_std=nan", "finite"],
    "model.init_std=-1": ["model.init_std=-1", "positive"],
    "sample.temperature=1e-320": ["sample.temperature=1e-320", "0 (greedy) or at least 0.001"],
    "trainer.precision=16-true": ["optim.eps=1e-08 is 0 in float16", "trainer.precision=16-true",
                                  "optim.eps=1e-4"],
}


@pytest.mark.parametrize("override", list(NON_FINITE))
def test_non_finite_and_out_of_range_numbers_are_refused_in_one_line(hydra_conf, override):
    message = _refusal(ONE, override)
    for fragment in NON_FINITE[override]:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_half_precision_takes_an_eps_that_float16_holds(hydra_conf):
    assert _load(ONE, "trainer.precision=16-true", "optim.eps=1e-4").optim.eps == 1e-4
    assert _load(ONE, "trainer.precision=16-megatron").optim.eps == 1e-8  # fp32 main weights and moments
    assert _load(ONE, "sample.temperature=0.001").sample.temperature == 0.001


def test_text_corpus_too_small_or_empty_is_refused(hydra_conf, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("hello world. " * 100)  # 1300 tokens: 9 windows of 128, a step needs 16
    with pytest.raises(ConfigError) as refused:  # the size is preflight's (it reads the file)
        _preflight(tmp_path, ONE, "data=text", f"data.path={small}")
    message = str(refused.value)
    for fragment in (f"data.path={small}", "too small", "1300 tokens", "model.seq_len=128",
                     "parallel.global_batch_size=16"):
        assert fragment in message, (fragment, message)
    # Smaller windows and batches make the same file usable; validation off needs no validation windows.
    _preflight(tmp_path, ONE, "data=text", f"data.path={small}", "model.seq_len=16", "parallel.micro_batch_size=2",
               "parallel.global_batch_size=4")
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    assert "holds no .txt files" in _refusal(ONE, "data=text", f"data.path={empty}")
    # A dry run plans without data: no size check.
    _preflight(tmp_path, ONE, "data=text", f"data.path={small}", "dry_run=true")


def test_packing_with_a_tokenizer_without_end_of_document_is_refused(hydra_conf, tmp_path):
    """data.pack=true needs the end-of-document token to find the documents: a tokenizer without one is refused by
    preflight (it reads the tokenizer), in one line, before any process starts."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError) as refused:
        _preflight(tmp_path, ONE, "data.pack=true", f"data.tokenizer={tmp_path / 'tokenizer.json'}")
    message = str(refused.value)
    assert "\n" not in message and "has no end-of-document token" in message, message


def test_default_layout_refuses_a_model_it_cannot_split(hydra_conf):
    """The default CPU layout has p·v=4 model chunks: a 30-layer model cannot be split evenly."""
    message = _refusal("model.n_layers=30")
    assert "model.n_layers=30" in message and "parallel.pp·parallel.vpp=4" in message


def test_valid_edge_layouts_are_accepted(hydra_conf):
    # dp derived from the launcher's world size, and from trainer.devices.
    assert _load(ONE, "parallel.tp=2", "parallel.micro_batch_size=4", world_size=8).parallel.dp == 4
    assert _load(ONE, "parallel.tp=2", "trainer.devices=4").parallel.dp == 2
    # Interleaved with m a multiple of p, and the 3D layout with n_layers=8 over p=4, v=2.
    cfg = _load(ONE, "parallel.pp=4", "parallel.vpp=2", "parallel.schedule=interleaved", "model.n_layers=8",
                "parallel.micro_batch_size=2", "parallel.global_batch_size=8")
    assert cfg.parallel.num_micro_batches == 4 and cfg.trainer.devices == 4
    assert _load(ONE, "trainer.precision=64").trainer.precision == "64"
    # Uneven stages: the ends fixed, the rest split evenly; a null end counts with the even chunks.
    cfg = _load(ONE, "parallel.pp=3", "model.n_layers=8", "parallel.first_stage_layers=2")
    assert cfg.dims.pipeline.chunk_layers(8) == [2, 3, 3] and cfg.dims.manifest()["first_stage_layers"] == 2
    cfg = _load(ONE, "parallel.pp=4", "parallel.vpp=2", "parallel.schedule=interleaved", "model.n_layers=10",
                "parallel.first_stage_layers=2", "parallel.last_stage_layers=2", "parallel.micro_batch_size=4")
    assert cfg.dims.pipeline.chunk_layers(10) == [2, 1, 1, 1, 1, 1, 1, 2]
    # the loss's chunk without layers: the output layer (and the MTP modules) a stage of their own
    assert _load(ONE, "parallel.pp=3", "model.n_layers=8", "parallel.last_stage_layers=0").dims.pipeline.chunk_layers(
        8) == [4, 4, 0]
    # An even split counting the MTP modules as layers of the loss's chunk, where the layers alone do not split
    # evenly: model=mla_tiny's 3 layers and one module over the default 4 chunks put the module on a chunk of its own
    assert _load("model=mla_tiny").dims.pipeline.chunk_layers(3) == [1, 1, 1, 0]
    assert _load(ONE, "parallel.pp=3", "model.n_layers=7", "model.mtp.depth=2").parallel.last_stage_layers == 1
    assert _load("model=mla_tiny", "model.n_layers=4").parallel.last_stage_layers is None  # even without them
    assert "model.n_layers=3 is not divisible" in _refusal("model=mla_tiny", "model.mtp.depth=0")
    # FP8 composes with the Megatron precisions; blockwise at t2 once each shard holds whole 128-blocks.
    assert _load(ONE, "kernels.fp8=rowwise", "trainer.precision=bf16-megatron").kernels.fp8 == "rowwise"
    assert _load(ONE, "kernels.fp8=blockwise", "parallel.tp=2", "model.hidden=256").kernels.fp8 == "blockwise"


# -- through the CLI: the user sees exactly one line, exit code 2, and no process starts ---------------------
CLI_CASES = ["unknown-attention", "data-text-without-path", "more-devices-than-layout",
             "interleaved-m-not-multiple-of-pp", "world-size-not-layout", "interleaved-one-chunk",
             "cp-seq-len-not-divisible", "cp-with-flash"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_refuses_with_one_line(hydra_conf, tmp_path, case):
    overrides, world_size, fragments = INVALID[case]
    expected = f"error: {_refusal(*overrides, world_size=world_size)}"
    # Start from the 8-process default layout where the case allows it: nothing may be spawned.
    cli_overrides = [o for o in overrides if o != ONE] if case == "unknown-attention" else overrides
    # A launcher's world size reaches the CLI as WORLD_SIZE (torchrun, SLURM, our own parent rank).
    env = {**os.environ, **({"WORLD_SIZE": str(world_size)} if world_size else {})}
    start = time.monotonic()
    proc = run_module([f"hydra.run.dir={tmp_path}", "logger=none", *cli_overrides], env=env, timeout=120)
    elapsed = time.monotonic() - start
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines and lines[-1] == expected, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert [line for line in lines if line.startswith("error:")] == [expected]
    # No process group, no child rank, no training: refused before Lightning is even built.
    assert "Initializing distributed" not in proc.stderr + proc.stdout
    assert not list(tmp_path.glob("rank*.log")) and not (tmp_path / "metrics.csv").exists()
    assert elapsed < 60, f"took {elapsed:.1f}s to refuse"


def test_cli_refuses_a_too_small_text_file(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("hello world. " * 100)
    proc = run_module([f"hydra.run.dir={tmp_path / 'run'}", "parallel=single", "data=text", f"data.path={small}"],
                      timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith(f"error: data.path={small} is too small"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("overrides, start", [
    (("+experiment=gpt1t",), "error: trainer.num_nodes=384: the layout needs 3072 ranks on 384 nodes"),
    (("experiment=gpt1t",), "error: trainer.num_nodes=384: the layout needs 3072 ranks on 384 nodes"),
    (("trainer=gpu", "parallel=single"), "error: trainer.devices=1 GPUs are needed by the layout"),
])
def test_cli_refuses_a_layout_this_machine_cannot_host(tmp_path, overrides, start):
    """Without a cluster launcher, a multi-node or GPU layout on a CPU box is refused and pointed at the dry run
    and the SLURM launcher — never a Lightning traceback."""
    if "trainer=gpu" in overrides:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "SLURM_NTASKS", "SLURM_JOB_ID")}
    proc = run_module([f"hydra.run.dir={tmp_path}", *overrides], env=env, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith(start), proc.stderr[-2000:]
    assert "dry_run=true" in last and "submitit_slurm" in last
    assert "Traceback" not in proc.stderr


def test_activation_is_validated_in_one_line():
    assert ModelConfig().activation == "gelu"
    assert load_config({"model": {"activation": "gelu_tanh"}}).model.activation == "gelu_tanh"
    with pytest.raises(ConfigError) as refused:
        load_config({"model": {"activation": "relu"}})
    assert str(refused.value) == "model.activation='relu' is not one of gelu, gelu_tanh"


# ---------------------------------------------------------------------------------------------- conf/ <-> config.py

def _conf_keys() -> dict[str, set[str]]:
    """section -> every key some file under conf/ sets in it ("" = the top level); experiment files are global."""
    import yaml

    keys: dict[str, set[str]] = {}
    for path in sorted(CONF.rglob("*.yaml")):
        rel = path.relative_to(CONF)
        if rel.parts[0] == "hydra":  # Hydra's own launcher configs
            continue
        data = yaml.safe_load(path.read_text()) or {}
        data.pop("defaults", None)
        if len(rel.parts) == 1 or rel.parts[0] == "experiment":  # config.yaml and the global experiment files
            for key, value in data.items():
                if key == "hydra":
                    continue
                if isinstance(value, dict):
                    keys.setdefault(key, set()).update(value)
                else:
                    keys.setdefault("", set()).add(key)
        else:
            keys.setdefault(rel.parts[0], set()).update(data)
    return keys


def _documented_fields() -> dict[str, dict[str, bool]]:
    """section -> {field: has a comment on its line or the line above} from the schema's source."""
    import ast
    import inspect

    import mlplat.config.schema as config

    out: dict[str, dict[str, bool]] = {}
    lines = inspect.getsource(config).splitlines()
    tree = ast.parse("\n".join(lines))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    sections = {"": RunConfig} | {f.name: type(f.default_factory()) for f in dataclasses.fields(RunConfig)
                                  if f.default_factory is not dataclasses.MISSING}
    for section, cls in sections.items():
        documented = {}
        for node in classes[cls.__name__].body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                here, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
                documented[node.target.id] = "#" in here or above.startswith("#")
        out[section] = {k: v for k, v in documented.items() if section or k not in sections}
    return out


def test_every_conf_key_is_a_documented_config_field_and_back():
    conf, fields_ = _conf_keys(), _documented_fields()
    assert set(conf) == set(fields_), "sections differ between conf/ and mlplat.config"
    for section, documented in fields_.items():
        name = section or "top level"
        assert conf[section] - set(documented) == set(), f"{name}: keys in conf/ without a field in mlplat.config"
        assert set(documented) - conf[section] == set(), f"{name}: fields of mlplat.config that no file in conf/ sets"
        assert [k for k, ok in documented.items() if not ok] == [], f"{name}: fields without a one-line comment"


def test_unknown_top_level_keys_are_refused(hydra_conf):
    assert _refusal("+foo=1").startswith("foo is not a known top-level key (known: model, parallel,")
    with pytest.raises(ConfigError, match="^foo is not a known top-level key"):
        from_dict({"foo": 1})


def test_cluster_keys_are_typed_and_checked(hydra_conf):
    assert _refusal("+cluster.nvlink_gpbs=1").startswith("cluster.nvlink_gpbs is not a known key (known: name,")
    assert _refusal("cluster.device=tpu").startswith("cluster.device='tpu' is not a known device")
    assert (_refusal("cluster=dgx_a100", "cluster.usable_fraction=1.5")
            == "cluster.usable_fraction=1.5 must be in (0, 1]")


def test_profile_steps_are_checked(hydra_conf):
    assert _refusal("profile.steps=[5,3]") == \
        "profile.steps=[5, 3] must be [FROM, TO] with 1 <= FROM <= TO, or one step N (optimizer steps, 1-based)"
    assert _refusal("profile.steps=[5]").startswith("profile.steps=[5] must be [FROM, TO]")
    assert _refusal("profile.steps=[5,900]") == "profile.steps=[5, 900] ends after trainer.max_steps=120"
    assert _load("profile.steps=[5,7]").profile.steps == [5, 7]
    # torch.profiler wraps the profiled steps: without them it was started and never stopped (a crash at exit)
    assert _refusal("profile.torch=true") == \
        "profile.torch=true needs profile.steps=[FROM, TO]: the steps torch.profiler wraps"


def test_straggler_keys_are_checked(hydra_conf):
    assert _refusal("straggler.every_steps=-5") == \
        "straggler.every_steps=-5 must be a number of steps >= 1, or 0 / null (off)"
    assert _refusal("straggler.threshold=0") == \
        "straggler.threshold=0 must be a positive fraction (0.2 = 20% slower)"
    assert _refusal("straggler.threshold=inf") == "straggler.threshold=inf must be a finite number"
    assert _load("straggler.every_steps=50").straggler.every_steps == 50


# -------------------------------------------------------------------------------- validation reads nothing

def test_validation_imports_and_reads_no_data_checkpoint_or_perf_module(tmp_path):
    """load_config is pure: it imports none of mlplat.data, mlplat.checkpoint, mlplat.perf (lazily or not) and
    touches no file: a data path that does not exist passes it and is refused by preflight, in one line."""
    code = ("import sys; from mlplat.config import load_config; "
            f"cfg = load_config({{'data': {{'name': 'text', 'path': {str(tmp_path / 'absent.txt')!r}}}, "
            "'cluster': {'device': 'tpu'}, 'init_from': '/nonexistent'}); "
            "under = ('mlplat.data', 'mlplat.checkpoint', 'mlplat.perf'); "
            "bad = sorted(m for m in sys.modules if m.startswith(under)); "
            "assert not bad, bad; assert cfg.model.vocab_size is None and cfg.data.tokenizer is None")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_layout_facts_are_one_frozen_object(hydra_conf):
    cfg = _load()  # the main job: t2 · p2 (interleaved, v2) · d2
    dims = cfg.dims
    assert (dims.tp, dims.pp, dims.vpp, dims.dp, dims.world_size) == (2, 2, 2, 2, 8)
    assert dims.num_micro_batches == cfg.parallel.num_micro_batches == 2 and dims.interleaved
    assert dims.pipeline.chunks_of(0) == [0, 2] and not dims.sequence_parallel
    assert cfg.parallel.world_size == dims.world_size == cfg.trainer.devices
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.dp = 4  # type: ignore[misc]
    assert _load("parallel.sequence_parallel=true").dims.sequence_parallel  # t=2: on, and validation vouches for t>1


def test_profile_steps_takes_one_step_as_an_integer(hydra_conf):
    """`profile.steps=5` (once a traceback) profiles step 5 alone: [5, 5]."""
    assert _load(ONE, "profile.steps=5").profile.steps == [5, 5]
    assert _load(ONE, "profile.steps=[2,4]").profile.steps == [2, 4]
    assert "ends after trainer.max_steps=120" in _refusal(ONE, "profile.steps=121")


# ----------------------------------------------------------------------------------------- ~ in path keys

def test_tilde_in_path_keys_is_the_home_directory(hydra_conf, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    home = str(tmp_path)
    # As typed on the command line (quoted: Hydra's grammar has no unquoted ~).
    cfg = load_config(_compose(ONE, "data=text", "data.path='~/books/'", "data.tokenizer='~/tok/tokenizer.json'",
                               "ckpt_path='~/runs/ck'", "init_from='~/gpt2'"))
    assert cfg.data.path == f"{home}/books/" and cfg.data.tokenizer == f"{home}/tok/tokenizer.json"
    assert cfg.ckpt_path == f"{home}/runs/ck" and cfg.init_from == f"{home}/gpt2"
    cfg = load_config({"data": {"name": "indexed", "prefix": "~/d/p", "cache_dir": "~/cache",
                                "blend": [0.3, "~/a", 0.7, "~/b"], "tokenizer": "gpt2"}, "ckpt_path": "last"})
    assert (cfg.data.prefix, cfg.data.cache_dir) == (f"{home}/d/p", f"{home}/cache")
    assert cfg.data.blend == [0.3, f"{home}/a", 0.7, f"{home}/b"]
    assert cfg.data.tokenizer == "gpt2" and cfg.ckpt_path == "last"  # names, not paths: unchanged
    assert load_config({"sample": {"prompt": "~/not a path"}}).sample.prompt == "~/not a path"


# ------------------------------------------------------------------------------ W&B online without a key

def _no_wandb_key(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


def test_online_wandb_without_a_key_is_refused_by_preflight(hydra_conf, monkeypatch, tmp_path):
    _no_wandb_key(monkeypatch, tmp_path)
    cfg = load_checked(_compose(ONE, "logger.mode=online"))  # the values are fine: the key is the environment's
    with pytest.raises(ConfigError) as refused:
        preflight(cfg, tmp_path)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("logger.mode=online needs a W&B API key")
    assert "wandb login" in message and "logger.mode=offline" in message
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))  # `wandb login` wrote one
    preflight(load_checked(_compose(ONE, "logger.mode=online")), tmp_path)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    preflight(load_checked(_compose(ONE, "logger.mode=offline")), tmp_path)  # offline needs none


def test_cli_refuses_online_wandb_without_a_key_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    env["NETRC"] = str(tmp_path / "no-netrc")
    proc = run_module([f"hydra.run.dir={tmp_path / 'run'}", ONE, "logger.mode=online"], env=env, timeout=120)
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: logger.mode=online needs a W&B API key") and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.csv").exists()


# ------------------------------------------------------------------------------ one source for every default
# The rule: a key's default is its field in mlplat.config. conf/config.yaml and each group's base file carry the
# field's value. A group's base file is the option the defaults list picks or, when that option builds on another
# option of its group (its own `defaults:` list, as parallel=3d_cpu builds on single), that other option. What an
# option sets on top of its base (3d_cpu's layout) and the group's other options (model=gpt1t, trainer=gpu,
# logger=csv, data=text, ...) differ on purpose and are exempt; so are conf/experiment (paper rows) and
# conf/cluster (a machine's figures; the fields' null means "the device's own").
EXEMPT_GROUPS = (EXPERIMENT, CLUSTER)


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def _base_files() -> dict[str, str]:
    """group -> its base option (see the rule above)."""
    bases = {}
    for entry in _yaml(CONF / "config.yaml")["defaults"]:
        if not isinstance(entry, dict):
            continue
        ((group, choice),) = entry.items()
        if group in EXEMPT_GROUPS or choice is None:
            continue
        inherits = [d for d in _yaml(CONF / group / f"{choice}.yaml").get("defaults", [])
                    if isinstance(d, str) and d != "_self_"]
        bases[group] = inherits[0] if inherits else choice
    return bases


def _differences(where: str, values: dict, section) -> list[str]:
    out = []
    for key, value in values.items():
        field_value = getattr(section, key)
        if dataclasses.is_dataclass(field_value):  # a group of keys of its own (model.mtp)
            field_value = dataclasses.asdict(field_value)
        same = (list(field_value) if isinstance(field_value, tuple) else field_value) == value
        if not same:
            out.append(f"{where}: {key}={value!r} but the field says {field_value!r}")
    return out


def test_conf_defaults_equal_their_dataclass_fields():
    defaults = RunConfig()
    bases = _base_files()
    assert bases == {"model": "tiny", "parallel": "single", "kernels": "default", "data": "pydoc", "optim": "adamw",
                     "trainer": "cpu", "logger": "wandb"}, bases
    wrong = []
    for group, base in bases.items():
        values = _yaml(CONF / group / f"{base}.yaml")
        values.pop("defaults", None)
        wrong += _differences(f"conf/{group}/{base}.yaml", values, getattr(defaults, group))
    root = _yaml(CONF / "config.yaml")
    for key, value in root.items():
        if key in ("defaults", "hydra"):
            continue
        if isinstance(value, dict):
            wrong += _differences(f"conf/config.yaml {key}", value, getattr(defaults, key))
        else:
            wrong += _differences("conf/config.yaml", {key: value}, defaults)
    assert wrong == [], "defaults written twice with two values:\n" + "\n".join(wrong)


def test_the_main_job_keeps_its_values(hydra_conf):
    """`python -m mlplat.train` with no overrides: the values it was tuned with (experiments/main_job/results.md:
    val loss 1.61 after 120 steps of 32 sequences on 2 cores; the README's main job)."""
    cfg = _load()
    assert (cfg.trainer.max_steps, cfg.trainer.val_check_interval) == (120, 60)
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps) == (6e-3, 6e-5, 50)
    assert cfg.model.position == "rope" and (cfg.model.hidden, cfg.model.n_layers) == (128, 4)
    assert (cfg.parallel.micro_batch_size, cfg.parallel.global_batch_size) == (8, 32)
    assert cfg.model.vocab_size == 256 and cfg.data.tokenizer == "byte"  # null followed the byte tokenizer
    assert cfg.sample.top_p == 0.95


# -- the architecture keys ------------------------------------------------------------------------------------
def test_llama_arch_sets_its_defaults_and_gpt_keeps_the_paper_block(hydra_conf):
    llama = _load("model=llama_tiny", "model.norm=null", "model.mlp=null", "model.position=null",
                  "model.bias=null", "model.tie_embeddings=null").model
    assert (llama.norm, llama.mlp, llama.position, llama.bias, llama.qkv_bias, llama.tie_embeddings) == \
        ("rmsnorm", "swiglu", "rope", False, False, False)
    assert llama.kv_heads == 2 and llama.ffn == 352
    gpt = _load("model=tiny").model  # the paper's block (the main job's tiny_rope differs in its positions alone)
    assert (gpt.arch, gpt.norm, gpt.mlp, gpt.position, gpt.bias, gpt.qkv_bias, gpt.tie_embeddings) == \
        ("gpt", "layernorm", "gelu", "learned", True, True, True)
    assert dataclasses.replace(_load().model, position="learned") == gpt  # the main job's: rotary positions only
    assert gpt.kv_heads == gpt.n_heads and gpt.ffn == 4 * gpt.hidden
    # SwiGLU's null width: Llama's 8h/3, rounded up to a multiple of 256.
    assert _load("model=llama_tiny", "model.ffn_hidden=null", "model.hidden=768", "model.n_heads=12",
                 "model.n_kv_heads=4").model.ffn == 2048
    assert _load("model=qwen2_0p5b", "dry_run=true").model.qkv_bias is True


def test_architecture_refusals_are_one_line(hydra_conf):
    # Fewer key/value heads than tp ranks are replicated when tp is a multiple of them; any other pair is refused.
    assert _load("model=llama_tiny", "model.n_kv_heads=1", "parallel.tp=2").model.kv_replicas(2) == 2
    assert _load("model=llama_tiny", "parallel.tp=4", "parallel.sequence_parallel=true").model.kv_replicas(4) == 2
    assert _refusal("model=llama_tiny", "model.n_heads=12", "model.n_kv_heads=3", "parallel.tp=2",
                    "model.hidden=96", "model.ffn_hidden=96") == (
        "model.n_kv_heads=3 and parallel.tp=2 do not divide one another: each tensor-parallel rank holds whole "
        "key/value heads, or one head shared by tp/n_kv_heads ranks")
    assert _refusal("model=llama_tiny", "model.n_kv_heads=3") == (
        "model.n_heads=4 is not divisible by model.n_kv_heads=3 (each key/value head serves a whole group of heads)")
    assert _refusal("model.arch=bert") == "model.arch='bert' is not one of gpt, llama"
    assert _refusal("model=llama_tiny", "model.norm=batchnorm") == \
        "model.norm='batchnorm' is not one of layernorm, rmsnorm"
    assert _refusal("model=llama_tiny", "model.mlp=relu") == "model.mlp='relu' is not one of gelu, swiglu"
    assert _refusal("model=tiny", "model.rope_scaling={factor:8}").startswith(
        "model.rope_scaling is set but model.position=learned")
    assert _refusal("model=llama_tiny", "model.rope_scaling={factor:8,low_freq_factor:1,high_freq_factor:4}") == (
        "model.rope_scaling.original_max_position_embeddings=None must be a positive number (Llama 3.1: factor 8, "
        "low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192)")
    assert _refusal("model=llama_tiny", "model.rope_scaling={rope_type:dynamic}") == \
        "model.rope_scaling.rope_type='dynamic' is not supported (llama3 or yarn)"
    assert _refusal("model=llama_tiny", "model.rope_scaling={rope_type:yarn}") == (
        "model.rope_scaling.factor=None must be a positive number (DeepSeek-V3: factor 40, "
        "original_max_position_embeddings 4096)")
    assert _refusal("model=llama_tiny", "model.hidden=12", "model.n_heads=4", "model.n_kv_heads=4",
                    "model.ffn_hidden=32") == \
        "model.position=rope needs an even head size, and model.hidden/model.n_heads=12/4=3"
    # model.head_dim: heads wider than h/a (Qwen3), which then need not tile h; rope still needs it even.
    wide = _load("model=llama_tiny", "model.head_dim=48", "parallel.tp=2").model
    assert (wide.head_size, wide.attention_width, wide.weights()["head_dim"]) == (48, 192, 48)
    assert _load("model=llama_tiny", "model.hidden=100", "model.head_dim=32").model.attention_width == 128
    assert _refusal("model=llama_tiny", "model.head_dim=15") == \
        "model.position=rope needs an even head size, and model.head_dim=15"
    assert _refusal("model=llama_tiny", "model.head_dim=0") == \
        "model.head_dim=0 must be a positive integer (or null = model.hidden/model.n_heads)"
    assert _refusal("model=llama_tiny", "model.hidden=102") == \
        "model.hidden=102 is not divisible by model.n_heads=4 (or set model.head_dim)"
    # model.rotary_dim: the first channels of each head turned (GLM-4.5: half), an even count within the head
    assert _load("model=llama_tiny", "model.rotary_dim=16").model.rotary_channels == 16
    assert _load("model=llama_tiny").model.rotary_channels == 32
    for bad in ("15", "0", "34"):
        assert _refusal("model=llama_tiny", f"model.rotary_dim={bad}") == (
            f"model.rotary_dim={bad} must be an even number of channels in [2, the head size 32] (null = the whole "
            f"head): the rotation turns pairs of a head's first rotary_dim channels")
    assert _refusal("model=tiny", "+model.rotary_dim=8").startswith(
        "model.rotary_dim=8 is set but model.position=learned")
    assert _refusal("model=llama_tiny", "model.head_dim=40", "kernels.fp8=blockwise", "parallel.tp=2",
                    "trainer.precision=bf16-megatron", "model.ffn_hidden=256", "model.hidden=256") == (
        "kernels.fp8=blockwise needs whole 128-blocks on each rank: the attention width "
        "model.n_heads·model.head_dim=160 split by parallel.tp=2 is not a multiple of 128·2")


def test_a_checkpoint_of_another_model_is_refused_naming_the_keys_that_differ(hydra_conf, tmp_path):
    """From the model its manifest records, before anything is built (not by an internal table's name, later);
    what does not shape a tensor (dropout, and the sequence length under rotary positions) may change."""
    import dataclasses
    import json

    saved = _load(ONE, "model=tiny")
    ckpt = tmp_path / "step-4"
    ckpt.mkdir()
    (ckpt / "mlplat.json").write_text(json.dumps({"format": "mlplat-dcp-2", "step": 4, "files": {},
                                                  "layout": {"model": dataclasses.asdict(saved.model)}}))
    assert _preflight(tmp_path, ONE, "model=tiny", f"ckpt_path={ckpt}", "model.dropout=0.1",
                      "checkpoint.every_steps=0").ckpt_path == str(ckpt)
    with pytest.raises(ConfigError) as info:
        _preflight(tmp_path, ONE, "model=tiny", f"ckpt_path={ckpt}", "model.hidden=256", "model.seq_len=64")
    assert str(info.value) == (f"ckpt_path={ckpt} holds another model: model.hidden=256 (saved: 128), "
                               f"model.ffn_hidden=1024 (saved: 512), model.seq_len=64 (saved: 128); resume with the "
                               f"model that saved it (recorded in its mlplat.json)")
    with pytest.raises(ConfigError) as info:
        _preflight(tmp_path, ONE, "model=llama_tiny", f"ckpt_path={ckpt}")
    assert "model.norm=rmsnorm (saved: layernorm)" in str(info.value) and "\n" not in str(info.value)


def test_a_checkpoint_of_another_mixture_of_experts_is_refused_naming_the_key(hydra_conf, tmp_path):
    """Every model.moe key that adds, drops or reshapes a saved tensor is refused in one line naming the key, the value
    given and the saved one: fewer experts, no shared expert, a dense model; turning the expert biases off too (they
    would be dropped). A routing key (top_k) shapes nothing and may change."""
    import dataclasses
    import json

    saved = _load(ONE, "model=moe_tiny", "model.moe.bias_update_rate=0.01")
    ckpt = tmp_path / "step-4"
    ckpt.mkdir()
    (ckpt / "mlplat.json").write_text(json.dumps({"format": "mlplat-dcp-2", "step": 4, "files": {},
                                                  "layout": {"model": dataclasses.asdict(saved.model)}}))
    resume = (ONE, f"ckpt_path={ckpt}", "checkpoint.every_steps=0")

    def refusal(*overrides: str) -> str:
        with pytest.raises(ConfigError) as info:
            _preflight(tmp_path, *resume, *overrides)
        assert "\n" not in str(info.value), str(info.value)
        assert " holds another model: " in str(info.value), str(info.value)
        return str(info.value).split(" holds another model: ")[1].split("; resume with")[0]

    assert _preflight(tmp_path, *resume, "model=moe_tiny", "model.moe.bias_update_rate=0.01",
                      "model.moe.top_k=1").ckpt_path == str(ckpt)
    assert refusal("model=moe_tiny", "model.moe.bias_update_rate=0.01", "model.moe.shared_experts=0",
                   "model.moe.shared_gate=false") == \
        "model.moe.shared_experts=0 (saved: 1)"
    assert refusal("model=moe_tiny", "model.moe.bias_update_rate=0.01", "model.moe.num_experts=4") == \
        "model.moe.num_experts=4 (saved: 8)"
    assert refusal("model=moe_tiny", "model.moe.bias_update_rate=0.01", "model.moe.ffn_hidden=64",
                   "model.moe.dense_layers=2") == \
        "model.moe.ffn_hidden=64 (saved: 128), model.moe.dense_layers=2 (saved: 1)"
    assert refusal("model=moe_tiny", "model.moe.bias_update_rate=0.01", "model.moe.shared_gate=false") == \
        "model.moe.shared_gate=False (saved: True)"
    assert refusal("model=llama_tiny") == "model.moe.num_experts=0 (saved: 8)"
    assert refusal("model=moe_tiny") == ("model.moe.expert_bias=false with model.moe.bias_update_rate=0.0 (saved: "
                                         "expert_bias=false, bias_update_rate=0.01, whose expert biases it would drop)")
    # the correction bias kept without balancing (a fine-tune of DeepSeek-V3 or GLM-4.5) keeps the saved biases
    assert _preflight(tmp_path, *resume, "model=moe_tiny", "model.moe.expert_bias=true").ckpt_path == str(ckpt)


def test_async_saves_without_a_cadence_are_said(hydra_conf, tmp_path, caplog):
    """checkpoint.async_save=true with checkpoint.every_steps=0 saves no checkpoint on a cadence (only a preemption
    notice's): one line says so."""
    with caplog.at_level("WARNING", logger="mlplat"):
        _preflight(tmp_path, ONE, "checkpoint.async_save=true", "checkpoint.every_steps=0")
    assert any("checkpoint.async_save=true with checkpoint.every_steps=0" in r.getMessage() for r in caplog.records)


def test_lightning_short_precision_names_are_aliases_of_their_full_ones(hydra_conf):
    """trainer.precision takes Lightning's short names, 16 and bf16 as 64 and 32 (16 was refused while 32 and 64
    were accepted): each is its full name's table entry, and Lightning is handed the full name (it warns at the
    short one)."""
    from mlplat.precision import precision_of
    from mlplat.train import precision_args

    for short, full in (("64", "64-true"), ("32", "32-true"), ("16", "16-mixed"), ("bf16", "bf16-mixed")):
        cfg = _load(ONE, f"trainer.precision={short}")
        assert precision_of(cfg.trainer.precision) == dataclasses.replace(precision_of(full), name=short,
                                                                          alias_of=full)
        args = precision_args(cfg.trainer)
        assert args.get("precision", full) == full  # 16-mixed: mlplat's own loss-scaling plugin instead


def test_ring_blocks_that_would_leave_the_flash_kernel_on_a_gpu_are_refused(hydra_conf, tmp_path, monkeypatch):
    """On a GPU the CUDA flash kernel takes fp16/bf16 and no mask: packed documents or fp32 under parallel.cp would
    run every hop's block in math, an (s/c)² fp32 score block; refused in one line before any process, unless
    kernels.attention=math asks for that kernel. On CPU (the kernel takes both) nothing is refused."""
    from mlplat import train

    monkeypatch.setattr(train, "check_machine_fits", lambda cfg: None)  # no GPUs here: the layout is not the point
    from mlplat.model import attention

    monkeypatch.setattr(attention, "device_type_for", lambda accelerator: "cuda")
    monkeypatch.setattr(attention, "resolve_backend", lambda *a, **k: "sdpa")
    gpu = (ONE, "parallel.cp=2", "trainer.accelerator=gpu")
    for cause, words in ((["data.pack=true", "trainer.precision=bf16-mixed"], "data.pack=true (the kernel takes no "
                                                                             "document mask)"),
                         (["trainer.precision=32-true"], "trainer.precision=32-true (the kernel computes in "
                                                        "fp16/bf16 only)")):
        with pytest.raises(ConfigError) as info:
            _preflight(tmp_path / "run", *gpu, *cause)
        line = str(info.value)
        assert "\n" not in line and line.startswith(f"parallel.cp=2 on a GPU with {words}: ring attention's blocks "
                                                    f"would run in math, an fp32 score block of "), line
        assert line.endswith("set kernels.attention=math to accept that, or drop the cause"), line
        _preflight(tmp_path / "run", *gpu, *cause, "kernels.attention=math")  # asked for by name
    _preflight(tmp_path / "run", *gpu, "trainer.precision=bf16-mixed")  # the flash kernel takes it
    monkeypatch.setattr(attention, "device_type_for", lambda accelerator: "cpu")
    _preflight(tmp_path / "run", ONE, "parallel.cp=2", "data.pack=true")  # CPU's flash kernel takes the mask


def test_a_checkpoint_resumes_only_under_an_optimizer_that_continues_it(tmp_path):
    """A checkpoint's manifest records optim.name: Muon continues AdamW's (a checkpoint older than the record is
    AdamW's, the only optimizer then), with a fresh momentum (tests/optim/test_muon.py); AdamW cannot continue Muon's
    (the hidden matrices have no moments), refused in one line before any process."""
    import json

    from mlplat.train import check_resumed_optimizer

    def saved(name, optimizer):
        folder = tmp_path / name
        folder.mkdir()
        layout = {} if optimizer is None else {"optimizer": optimizer}
        (folder / "mlplat.json").write_text(json.dumps({"files": {}, "layout": layout}))
        return str(folder)

    muon, old, toy = saved("muon", "muon"), saved("old", None), saved("toy", "toy")
    check_resumed_optimizer("muon", muon)
    check_resumed_optimizer("adamw", old)
    check_resumed_optimizer("muon", old)
    check_resumed_optimizer("muon", None)  # not resuming
    with pytest.raises(ConfigError) as info:
        check_resumed_optimizer("adamw", muon)
    assert str(info.value) == (f"optim.name=adamw cannot resume {muon}: it holds the state of optim.name=muon, the "
                               f"hidden matrices have no AdamW moments to continue (Muon kept them at zero); resume "
                               f"it with optim.name=muon")
    with pytest.raises(ConfigError, match=r"optim.name=muon cannot resume .*optim.name=toy, which another optimizer "
                                          r"cannot continue"):
        check_resumed_optimizer("muon", toy)
