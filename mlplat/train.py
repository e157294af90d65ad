"""`python -m mlplat.train [overrides]`: compose -> validate -> preflight -> build the Trainer and PTDPStrategy -> fit.

`mlplat.config.load_config` checks what the values alone decide; `preflight` then runs every check that reads a
file or the environment (the data and its tokenizer, an init_from directory, the cluster's device table, the
checkpoint to resume, the attention backend, whether this machine can host the layout, a W&B key), all before any
process group starts, each refusal one line.

Everything a run writes goes under Hydra's run directory (`hydra.run.dir=DIR`): DIR/metrics.csv, the
W&B or CSV logs and, later, checkpoints. One run at a time: the launching process holds the directory for the
run's life, and a second run there is refused in one line (mlplat.run_lock).
"""
from __future__ import annotations

import gc
import logging
import netrc
import os
import sys
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NoReturn
from urllib.parse import urlparse

import hydra
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf

import mlplat.conf_schema  # noqa: F401  (model_schema, for a command line that replaces hydra.searchpath)
from mlplat.checkpoint import CheckpointError
from mlplat.checkpoint.hf_config import check_init_from, explain_imported
from mlplat.config import ModelConfig, RunConfig, TrainerConfig, from_raw, ring_blocks_on_gpu, validate
from mlplat.data.checks import check_data_size, check_data_source
from mlplat.errors import ConfigError, DataError, DivergenceError, RunFileError
from mlplat.precision import precision_of
from mlplat.run_lock import owns_run, refuse_another_run, run_dir_lock

log = logging.getLogger("mlplat")


def launched_world_size() -> int | None:
    """The world size an external launcher (torchrun, SLURM, our own parent rank) has fixed, if any."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_NTASKS" in os.environ and "SLURM_JOB_ID" in os.environ and os.environ.get("SLURM_JOB_NAME") != "bash":
        return int(os.environ["SLURM_NTASKS"])
    if int(os.environ.get("SUBMITIT_LOCAL_NTASKS") or 1) > 1:  # submitit_local: one task per rank
        return int(os.environ["SUBMITIT_LOCAL_NTASKS"])
    return None


def node_agent(max_restarts: int, num_nodes: int) -> bool:
    """Whether this process is its node's elastic agent (`trainer.max_restarts`, mlplat.lightning.restarts): restarts
    asked for, and no launcher started this process as a rank: none did (this machine, or a process started on each
    node by hand), or one started one task per node (SLURM, submitit: ntasks-per-node=1). torchrun's ranks are its
    own agent's (WORLD_SIZE), our ranks the agent's (CHILD_ENV)."""
    from mlplat.lightning.launcher import CHILD_ENV

    if max_restarts <= 0 or "WORLD_SIZE" in os.environ or os.environ.get(CHILD_ENV):
        return False
    tasks = launched_world_size()
    return tasks is None or tasks == num_nodes


def raw_node_agent(raw: Any) -> bool:
    """`node_agent` for a composed config, before it is checked (its world size decides the layout's)."""
    restarts = OmegaConf.select(raw, "trainer.max_restarts", default=0)
    nodes = OmegaConf.select(raw, "trainer.num_nodes", default=1)
    return isinstance(restarts, int) and isinstance(nodes, int) and node_agent(restarts, nodes)


# -- resolvers used by conf/hydra/launcher/*.yaml (the launcher's resources follow the run config) ------------
def _ranks_per_node(devices, num_nodes, tp, pp, dp, gpus_per_node=None) -> int:
    """`${mlplat.ranks_per_node:...}`: trainer.devices, or the layout's t·p·d / trainer.num_nodes when null."""
    from mlplat.config import from_dict, resolve_world

    cfg = from_dict({"trainer": {"devices": devices, "num_nodes": num_nodes},
                     "parallel": {"tp": tp, "pp": pp, "dp": dp}})
    resolve_world(cfg)
    if gpus_per_node is not None and cfg.trainer.devices > gpus_per_node:
        world = cfg.trainer.devices * cfg.trainer.num_nodes
        raise ConfigError(f"trainer.devices={cfg.trainer.devices} ranks per node exceed "
                          f"cluster.gpus_per_node={gpus_per_node}: "
                          f"set trainer.num_nodes={-(-world // gpus_per_node)} trainer.devices={gpus_per_node}")
    return cfg.trainer.devices


OmegaConf.register_new_resolver("mlplat.ranks_per_node", _ranks_per_node, replace=True)
# `${mlplat.tasks_per_node:RANKS,RESTARTS}`: the launcher's tasks on a node: one per rank, or with trainer.max_restarts
# one per node, the node's elastic agent, which starts its ranks itself (mlplat.lightning.restarts)
OmegaConf.register_new_resolver("mlplat.tasks_per_node", lambda ranks, restarts: 1 if restarts else ranks,
                                replace=True)
OmegaConf.register_new_resolver("mlplat.gpus_for", lambda accelerator, n: 0 if accelerator == "cpu" else n,
                                replace=True)
# Those files shadow hydra-submitit-launcher's configs of the same name on purpose (so they are checked against them).
warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/submitit_\w+' is validated against ConfigStore schema")


@dataclass(frozen=True)
class RunIdentity:
    """A run's W&B name (its command-line overrides, so the points of a sweep read apart) and group (the Hydra
    multirun's sweep directory, so they group together)."""

    name: str = "defaults"  # the overrides, comma-separated ("defaults" when none)
    group: str | None = None  # the multirun's sweep directory; None for a single run
    overrides: list[str] = field(default_factory=list)

    @classmethod
    def from_hydra(cls) -> "RunIdentity":
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        overrides = [o for o in hc.overrides.task if not o.startswith(("hydra.", "hydra/"))]
        group = str(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
        return cls(name=",".join(overrides)[:128] or "defaults", group=group, overrides=overrides)


def make_logger(cfg: RunConfig, run_dir: Path, identity: RunIdentity | None = None):
    """The `logger.name` logger; W&B runs are named from their overrides and grouped by their sweep."""
    identity = identity or RunIdentity()
    name = cfg.logger.name
    if name == "none":
        return False
    if name == "csv":
        from pytorch_lightning.loggers import CSVLogger

        # DIR/lightning_logs/: Lightning's own CSV files, named so, apart from mlplat's DIR/metrics.csv (the same steps,
        # in other columns: what Lightning logged, one row per logging call)
        return CSVLogger(save_dir=str(run_dir), name="lightning_logs")
    from pytorch_lightning.loggers import WandbLogger

    mode = wandb_mode(cfg)
    logger = WandbLogger(save_dir=str(run_dir), project=cfg.logger.project, entity=cfg.logger.entity,
                         offline=(mode == "offline"), tags=list(cfg.logger.tags), log_model=False,
                         name=identity.name, group=identity.group)
    logger._wandb_init.pop("anonymous", None)  # Lightning passes anonymous=None; W&B warns that it has no effect
    return logger


def wandb_mode(cfg: RunConfig) -> str:
    """logger.mode, or for null: online when WANDB_API_KEY is set, otherwise offline."""
    return cfg.logger.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


def wandb_key_known() -> bool:
    """An API key in WANDB_API_KEY or in the netrc file `wandb login` writes, for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def precision_args(trainer_cfg: TrainerConfig) -> dict:
    """Lightning's precision flag; for 16-mixed our plugin instead, whose loss scaler the training step drives
    (Lightning's GradScaler cannot work with a pipeline engine that runs backward itself); for the Megatron-style
    precisions (bf16-megatron, 16-megatron) mlplat's MegatronPrecision."""
    from mlplat.lightning.precision import precision_plugin
    from mlplat.model.attention import device_type_for

    plugin = precision_plugin(str(trainer_cfg.precision), device_type_for(trainer_cfg.accelerator))
    if plugin is not None:
        return {"plugins": [plugin]}
    entry = precision_of(trainer_cfg.precision)  # a short name ("bf16") as its full one: Lightning warns at the short
    return {"precision": entry.alias_of or entry.name}


def build_trainer(cfg: RunConfig, run_dir: Path, extra_callbacks=(), identity: RunIdentity | None = None,
                  rank_job: Callable[[], None] | None = None):
    """The run's Trainer. `rank_job`: what the ranks forked from this one run (mlplat.lightning.launcher);
    None: the Hydra job's command line."""
    import pytorch_lightning as pl

    from mlplat.lightning.callbacks import MetricsCSV, RunSummary, SampleText, StragglerCheck, Throughput, ValidateLast
    from mlplat.lightning.console import quiet_libraries
    from mlplat.lightning.profiling import Profiler
    from mlplat.lightning.run_record import RunRecord
    from mlplat.lightning.strategy import PTDPStrategy

    quiet_libraries()  # the libraries' lines that say nothing about this run

    trainer_cfg = cfg.trainer
    identity = identity or RunIdentity()
    throughput = Throughput(cfg, cfg.parallel.world_size)
    callbacks = [RunRecord(cfg, identity.overrides), throughput,
                 Profiler(cfg, run_dir, throughput),  # right after Throughput: their steps end together
                 *([StragglerCheck(cfg.straggler.every_steps, cfg.straggler.threshold)]
                   if cfg.straggler.every_steps else []),
                 MetricsCSV(run_dir / "metrics.csv"), RunSummary(cfg, run_dir), ValidateLast(),
                 SampleText(cfg.sample, cfg.data.tokenizer, cfg.seed), *extra_callbacks]
    every = cfg.checkpoint.every_steps or 0  # null: not resolved by preflight (a program's own Trainer): off
    if saves(cfg):
        from mlplat.lightning.checkpointing import StepCheckpoint

        callbacks.append(StepCheckpoint(run_dir / "checkpoints", every))
    from lightning_fabric.plugins.environments import TorchElasticEnvironment

    from mlplat.lightning.environment import SubmititEnvironment

    extra = precision_args(trainer_cfg)
    if SubmititEnvironment.detect():  # submitit started one task per rank: Lightning must start none
        extra["plugins"] = [*extra.get("plugins", []), SubmititEnvironment()]
    elif TorchElasticEnvironment.detect():  # a rank of an elastic agent (ours, torchrun's): its ranks, also where
        # SLURM's variables say one task per node (Lightning would read its rank from those first)
        extra["plugins"] = [*extra.get("plugins", []), TorchElasticEnvironment()]
    return pl.Trainer(
        accelerator=trainer_cfg.accelerator, devices=trainer_cfg.devices, num_nodes=trainer_cfg.num_nodes,
        strategy=PTDPStrategy(cfg.parallel, timeout=timedelta(seconds=cfg.parallel.timeout_s),
                              io_timeout=timedelta(seconds=cfg.checkpoint.timeout_s), rank_job=rank_job,
                              kv_replicas=cfg.model.kv_replicas(cfg.parallel.tp),
                              async_save=cfg.checkpoint.async_save,
                              async_mode=cfg.checkpoint.async_mode, resume=cfg.ckpt_path), **extra,
        max_steps=trainer_cfg.max_steps,
        val_check_interval=trainer_cfg.val_check_interval, check_val_every_n_epoch=None,
        limit_val_batches=trainer_cfg.limit_val_batches, num_sanity_val_steps=0,
        log_every_n_steps=trainer_cfg.log_every_n_steps,
        logger=make_logger(cfg, run_dir, identity), callbacks=callbacks, default_root_dir=str(run_dir),
        use_distributed_sampler=False, enable_checkpointing=saves(cfg), enable_model_summary=False,
        enable_progress_bar=False,  # one line per logging interval instead (MetricsCSV): as readable in a file
    )


def check_machine_fits(cfg: RunConfig) -> None:
    """With no external launcher (SLURM, torchrun, submitit), every rank runs on this machine, and a node's elastic
    agent runs its node's ranks here: refuse a layout it cannot host, in one line, before Lightning starts
    anything."""
    agent = node_agent(cfg.trainer.max_restarts, cfg.trainer.num_nodes)
    if launched_world_size() is not None and not agent:
        return
    trainer_cfg = cfg.trainer
    world = trainer_cfg.devices * trainer_cfg.num_nodes
    where = "use dry_run=true to plan it here, or -m hydra/launcher=submitit_slurm to launch it (docs/launching.md)"
    if trainer_cfg.num_nodes > 1 and not agent:
        raise ConfigError(f"trainer.num_nodes={trainer_cfg.num_nodes}: the layout needs {world} ranks on "
                          f"{trainer_cfg.num_nodes} nodes "
                          f"but no cluster launcher started this job; {where}")
    if trainer_cfg.accelerator in ("gpu", "cuda"):
        import torch

        have = torch.cuda.device_count()
        if have < trainer_cfg.devices:
            raise ConfigError(f"trainer.devices={trainer_cfg.devices} GPUs are needed by the layout but this "
                              f"machine has {have}; {where}")


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path) -> str | None:
    """`last` = the checkpoint committed last in this run directory (`find_last`; none yet: start fresh, as a
    requeued job that died before its first save must); a path must hold a complete checkpoint: its manifest and
    the sizes of its files (under an external launcher, this task's share of them) are checked here, their
    checksums once, by all ranks together, when it is loaded."""
    if ckpt_path is None:
        return None
    from mlplat.checkpoint.io import find_last, read_manifest, share_of_files, verify
    from mlplat.run_lock import launched_rank

    if ckpt_path == "last":
        last = find_last(run_dir / "checkpoints")
        if last is None:
            log.info("ckpt_path=last: no checkpoint under %s yet, starting from scratch", run_dir / "checkpoints")
            return None
        ckpt_path = str(last)
    # Each task of an external launcher checks its share of the files (the load checks them all again, together).
    world = launched_world_size() or 1
    verify(ckpt_path, checksum=[],
           present=share_of_files(read_manifest(ckpt_path)["files"], world, launched_rank() % world))
    return ckpt_path


def resume_point(ckpt_path: str | None, run_dir: Path) -> str | None:
    """The checkpoint this rank starts from, resolved and verified (`resolve_ckpt_path`): the one asked for; a
    requeued SLURM job's `last` (`resume_ckpt_path`); and in a group the elastic agent restarted (ours under
    `trainer.max_restarts`, or torchrun's `--max-restarts`) the run directory's last committed checkpoint, or, when
    none was committed yet, what the job started from."""
    from mlplat.lightning.environment import resume_ckpt_path
    from mlplat.lightning.restarts import restart_count

    if restart_count() > 0:
        from mlplat.checkpoint.io import find_last

        last = find_last(run_dir / "checkpoints")
        if last is not None:
            ckpt_path = str(last)
    return resolve_ckpt_path(resume_ckpt_path(ckpt_path), run_dir)


def check_restarts(cfg: RunConfig) -> None:
    """`trainer.max_restarts` against what the environment and the resolved checkpoint cadence decide (the values
    alone: mlplat.config.rules). The restarts are the agent's that starts the ranks: under torchrun or SLURM that
    agent is not ours."""
    from mlplat.config.rules import check_restart_cadence
    from mlplat.lightning.launcher import CHILD_ENV

    check_restart_cadence(cfg)
    n = cfg.trainer.max_restarts
    if n <= 0 or os.environ.get(CHILD_ENV):
        return
    if not node_agent(n, cfg.trainer.num_nodes):
        raise ConfigError(f"trainer.max_restarts={n} restarts ranks mlplat starts itself, but another launcher "
                          f"started this one: under torchrun use torchrun --max-restarts=N and trainer.max_restarts=0; "
                          f"under SLURM start one task per node (ntasks-per-node=1, {cfg.trainer.num_nodes} in all), "
                          f"whose agent starts the node's ranks (docs/checkpoints.md#restarts-inside-the-job)")
    from mlplat.lightning.restarts import meeting_point

    if cfg.trainer.num_nodes > 1:
        meeting_point(cfg.trainer.num_nodes)  # node 0's address, this node's rank: a ConfigError naming what is unset


# (saved optim.name, resumed optim.name): the resumed optimizer continues the saved one's state, what it lacks fresh
CONTINUES = {("adamw", "muon")}


def check_resumed_optimizer(name: str, ckpt_path: str | None) -> None:
    """A checkpoint's optimizer state is the state of the optimizer that saved it: resuming it under another
    optim.name is refused in one line, before any process, unless that optimizer can continue it. Muon continues
    AdamW's: the weights, AdamW's moments for the parameters Muon leaves to AdamW, the step count and the schedule,
    with a fresh (zero) momentum for the hidden matrices, said in one line by the load (`mlplat.checkpoint.io`).
    AdamW cannot continue Muon's: the hidden matrices' moments are zeros, from which AdamW's bias-corrected first
    update at step N is several times its size. A checkpoint older than the record was AdamW's, the only optimizer
    then."""
    if ckpt_path is None:
        return
    from mlplat.checkpoint.io import read_manifest

    saved = read_manifest(ckpt_path).get("layout", {}).get("optimizer", "adamw")
    if saved != name and (saved, name) not in CONTINUES:
        why = ("the hidden matrices have no AdamW moments to continue (Muon kept them at zero)"
               if (saved, name) == ("muon", "adamw") else "which another optimizer cannot continue")
        raise ConfigError(f"optim.name={name} cannot resume {ckpt_path}: it holds the state of optim.name={saved}, "
                          f"{why}; resume it with optim.name={saved}")


def check_resumed_model(model: ModelConfig, ckpt_path: str | None) -> None:
    """A checkpoint of another model (its manifest records the model that saved it) is refused in one line naming
    every key that differs, before anything is built."""
    if ckpt_path is None:
        return
    from mlplat.checkpoint.io import read_manifest

    saved = read_manifest(ckpt_path).get("layout", {}).get("model")
    known = {f.name for f in fields(ModelConfig)}
    if not isinstance(saved, dict):
        return  # a manifest older than the record: the load checks each table
    try:
        saved_model = ModelConfig(**{k: v for k, v in saved.items() if k in known})
        theirs = saved_model.weights()
    except (TypeError, ValueError):
        return
    mine = model.weights()
    differ = [f"model.{k}={mine[k]} (saved: {theirs.get(k)})" for k in mine if mine[k] != theirs.get(k)]
    # The expert biases are routing state, not weights: a checkpoint without them resumes with them at 0 (said by the
    # load), but a run without them (model.moe.expert_bias off, no balancing) would drop the saved ones unseen.
    if model.moe.enabled and saved_model.moe.enabled and saved_model.moe.has_expert_bias \
            and not model.moe.has_expert_bias:
        differ.append(f"model.moe.expert_bias=false with model.moe.bias_update_rate={model.moe.bias_update_rate} "
                      f"(saved: expert_bias={str(saved_model.moe.expert_bias).lower()}, bias_update_rate="
                      f"{saved_model.moe.bias_update_rate}, whose expert biases it would drop)")
    if differ:
        raise ConfigError(f"ckpt_path={ckpt_path} holds another model: {', '.join(differ)}; resume with the model "
                          f"that saved it (recorded in its mlplat.json)")


def check_resumed_step(ckpt_path: str | None, max_steps: int) -> None:
    """A resume whose trainer.max_steps lies below the checkpoint's step would train nothing and exit as if done:
    refused in one line. At the step itself (a finished run resumed, a requeued job that had saved its last step)
    there is nothing to train, said in one line."""
    if ckpt_path is None:
        return
    from mlplat.checkpoint.io import read_manifest

    step = read_manifest(ckpt_path).get("step")
    if not isinstance(step, int) or max_steps < 0:
        return
    if step > max_steps:
        raise ConfigError(f"trainer.max_steps={max_steps} is below the step of ckpt_path={ckpt_path} ({step}): the "
                          f"run would train nothing; set trainer.max_steps above {step} to train on")
    if step == max_steps:
        log.warning("ckpt_path=%s is at step %d = trainer.max_steps: nothing left to train (raise trainer.max_steps "
                    "to train on)", ckpt_path, step)


def set_aside_branched(ckpt_path: str | None, run_dir: Path) -> None:
    """A resume from a checkpoint of this run directory leaves the later steps there to the lineage it branches from:
    they move to checkpoints/abandoned/<time>/ (mlplat.checkpoint.io.set_aside_later), said in one line."""
    ckpts = (run_dir / "checkpoints").resolve()
    if ckpt_path is None or Path(ckpt_path).resolve().parent != ckpts:
        return
    from mlplat.checkpoint.io import set_aside_later

    moved = set_aside_later(ckpts / Path(ckpt_path).name)
    if moved is not None:
        aside, names = moved
        log.warning("resuming %s: the later checkpoints of the lineage it leaves (%s) moved to %s",
                    Path(ckpt_path).name, ", ".join(names), aside)


def resumed_cadence(ckpt_path: str | None, save_last: bool = True) -> int:
    """`checkpoint.every_steps=null`: the cadence the resumed checkpoint was saved at (a resume keeps saving as the
    run it continues did), said in one line; 0 when not resuming."""
    if ckpt_path is None:
        return 0
    from mlplat.lightning.checkpointing import saved_cadence

    every = saved_cadence(ckpt_path)
    if every:
        log.info("checkpoint.every_steps=%d, as %s was saved (set checkpoint.every_steps to change it)", every,
                 ckpt_path)
        return every
    log.warning("checkpoint.every_steps=0: %s records no checkpoint cadence, so this run saves %s (set "
                "checkpoint.every_steps=N to save every N steps)", ckpt_path,
                "its last step only" if save_last else "no checkpoint")
    return 0


# model.* keys that are sections of keys of their own (model.moe, ...): a key typed in one is `SECTION.KEY`
_MODEL_SECTIONS = {f.name for f in fields(ModelConfig) if is_dataclass(getattr(ModelConfig(), f.name))}


def typed_model_keys(overrides: list[str]) -> set[str]:
    """The model.* keys a list of Hydra overrides sets explicitly: `model.X=`, `+model.X=`, `++model.X=` (and
    `model.X.Y=` sets X; under a section of keys such as model.moe, also `moe.Y`); a group choice (`model=NAME`) and
    a deletion (`~model.X`) set none. Only the overrides count: conf/'s values (model_schema's defaults under every
    model, the model's file) are not typed."""
    keys = set()
    for override in overrides:
        name = override.split("=", 1)[0].lstrip("+")
        if "=" in override and name.startswith("model."):
            parts = name[len("model."):].split(".")
            keys.add(parts[0])
            if parts[0] in _MODEL_SECTIONS and len(parts) > 1:
                keys.add(f"{parts[0]}.{parts[1]}")
    return keys


def _typed_in(raw: Any) -> set[str]:
    """The model.* keys `raw` sets explicitly: a plain mapping's model keys; for a composed config, those of its
    Hydra task overrides (none when it was composed without its hydra node)."""
    if isinstance(raw, DictConfig):
        return typed_model_keys([str(o) for o in OmegaConf.select(raw, "hydra.overrides.task", default=None) or []])
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict):
        return set()
    return set(model) | {f"{s}.{k}" for s in _MODEL_SECTIONS if isinstance(model.get(s), dict) for k in model[s]}


def load_checked(raw: Any, world_size: int | None = None, check_data: bool = True,
                 typed: set[str] | None = None) -> RunConfig:
    """The config as a run means it, the one way in (python -m mlplat.train, the programs and the tests): an
    init_from directory's model keys set before validation (so the layout rules apply to the imported shape; a
    broken rule names where the value came from), then the checks that read files: the data and its tokenizer
    (resolving data.tokenizer=null and model.vocab_size=null; skipped with check_data=False, for programs that feed
    their own token ids) and cluster.device against the device table. `typed`: the model.* keys the user set
    (default: those `raw` sets); python -m mlplat.train passes its command line's."""
    cfg = from_raw(raw)
    typed = _typed_in(raw) if typed is None else typed
    imported = check_init_from(cfg.model, cfg.init_from, typed) if cfg.init_from is not None else None
    try:
        validate(cfg, world_size, check_data)
    except ConfigError as e:  # a layout rule broken by an imported key: say where the key's value came from
        if imported is None:
            raise
        raise ConfigError(explain_imported(str(e), imported, cfg.init_from, typed)) from None
    if cfg.cluster.device is not None:
        from mlplat.perf.devices import get_device  # torch-free

        try:
            get_device(cfg.cluster.device)
        except ValueError as e:  # names cluster.device and the known devices
            raise ConfigError(str(e)) from None
    if check_data:
        check_data_source(cfg)
    return cfg


def saves(cfg: RunConfig) -> bool:
    """Whether the run writes checkpoints of its own (every_steps' or its last step's; a preemption's aside)."""
    return bool(cfg.checkpoint.every_steps) or cfg.checkpoint.save_last


def check_checkpoint_folder(cfg: RunConfig, run_dir: Path) -> None:
    """DIR/checkpoints must be a folder that takes files when the run saves: a regular file there or a read-only
    mount would fail the first save after the first steps, with a traceback."""
    from mlplat.run_lock import unwritable

    if saves(cfg) and (why := unwritable(run_dir / "checkpoints")):
        raise ConfigError(f"{run_dir / 'checkpoints'} cannot hold the run's checkpoints: {why} (checkpoint.every_steps="
                          f"{cfg.checkpoint.every_steps}, checkpoint.save_last={cfg.checkpoint.save_last}); choose "
                          f"another hydra.run.dir, or set checkpoint.every_steps=0 checkpoint.save_last=false to save "
                          f"none")


def preflight(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """The checks of a run that reads the environment and its run directory, after `load_checked` and before any
    process group starts; each refusal is one ConfigError (or CheckpointError) line. What they decide is set in
    `cfg`, once: `ckpt_path` becomes the checkpoint folder to resume (a requeued job's `last` resolved and verified)
    or None, and `checkpoint.every_steps=null` the resumed checkpoint's cadence. A dry run launches nothing: it
    needs none of this."""
    if cfg.dry_run:
        return cfg
    # A requeued SLURM job and a restarted torchrun rank resume from `last`; a missing or corrupt checkpoint is one
    # line, before any process.
    cfg.ckpt_path = resume_point(cfg.ckpt_path, run_dir)
    check_resumed_model(cfg.model, cfg.ckpt_path)
    check_resumed_optimizer(cfg.optim.name, cfg.ckpt_path)
    check_resumed_step(cfg.ckpt_path, cfg.trainer.max_steps)
    if cfg.checkpoint.every_steps is None:
        cfg.checkpoint.every_steps = resumed_cadence(cfg.ckpt_path, cfg.checkpoint.save_last)
    if cfg.checkpoint.async_save and not cfg.checkpoint.every_steps:  # said, not refused: a preemption still saves
        log.warning("checkpoint.async_save=true with checkpoint.every_steps=0: no checkpoint is saved on a cadence, "
                    "only %sa preemption notice's is written behind training (set checkpoint.every_steps=N to save)",
                    "the last step's and " if cfg.checkpoint.save_last else "")
    check_checkpoint_folder(cfg, run_dir)
    check_restarts(cfg)
    from mlplat.model.attention import device_type_for, resolve_backend

    # `flash` where it cannot run (CPU, no CUDA, no flash-attn, fp32): refuse before any process starts.
    device_type = device_type_for(cfg.trainer.accelerator)
    resolve_backend(cfg.kernels.attention, device_type, cfg.trainer.precision, cfg.parallel.cp,
                    *cfg.model.attention_entry.head_dims(cfg.model))
    if device_type == "cuda" and (why := ring_blocks_on_gpu(cfg)):
        raise ConfigError(why)
    check_machine_fits(cfg)  # a layout this box cannot host, with no cluster launcher: plan it or launch it
    # After the machine check: a paper-sized layout composed with the embedded corpus is meant for a cluster (and
    # is pointed there), not refused for its data.
    check_data_size(cfg)
    if cfg.logger.name == "wandb" and wandb_mode(cfg) == "online" and not wandb_key_known():
        raise ConfigError("logger.mode=online needs a W&B API key: run `wandb login` (or set WANDB_API_KEY), or "
                          "use logger.mode=offline (logs under the run directory) or logger=csv")
    return cfg


def fit(cfg: RunConfig, run_dir: Path, identity: RunIdentity | None = None):
    from mlplat.lightning.datamodule import TextDataModule
    from mlplat.lightning.module import DecoderModule
    from mlplat.lightning.signals import install_signal_handling

    # A forked rank runs this same job from this config, checked once, here (see run_fit).
    trainer = build_trainer(cfg, run_dir, identity=identity, rank_job=lambda: run_fit(cfg, run_dir, identity))
    # SIGTERM stops every rank at once (one line, exit 143); under SLURM, the preemption signal saves at a step
    # end, requeues and exits 75 on every rank (mlplat.lightning.signals): never a collective in a handler.
    install_signal_handling(trainer)
    from pytorch_lightning.utilities.rank_zero import rank_zero_only

    if rank_zero_only.rank == 0:  # set per rank before the ranks start: the forked ones have theirs already
        log.info("run directory: %s", run_dir)
    module = DecoderModule(cfg)
    trainer.fit(module, datamodule=TextDataModule(cfg), ckpt_path=cfg.ckpt_path)  # resolved by preflight
    # The next job of a multirun (same process) starts a run of its own. Only rank 0 has one: a forked rank has not
    # imported wandb (seconds on 2 cores), and finish() without a run costs seconds too.
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()
    ended_inside_skipped_steps(module.step.skips.in_a_row, trainer.global_step, cfg, run_dir)
    return trainer, module


def ended_inside_skipped_steps(skipped: int, step: int, cfg: RunConfig, run_dir: Path) -> None:
    """A run whose last steps were skipped (inf/NaN; fewer than optim.max_skipped_steps) did not end as asked: its
    last checkpoints are not `latest` (mlplat.checkpoint.io._publish), so `ckpt_path=last` would not continue them.
    Every rank knows the count (it is read from all-reduced values): all stop with exit status 2, rank 0's one line
    naming the steps and what `latest` names."""
    if not skipped:
        return
    from mlplat.checkpoint.io import latest_name

    steps = f"steps {step - skipped + 1}-{step}" if skipped > 1 else f"step {step}"
    latest = latest_name(run_dir / "checkpoints") if saves(cfg) else None
    keep = f"; the latest checkpoint stays {latest}" if latest else ""
    raise DivergenceError(f"the run ended inside {skipped} skipped step{'s' * (skipped > 1)} ({steps}: an inf/NaN "
                          f"loss or gradient norm, fewer in a row than optim.max_skipped_steps="
                          f"{cfg.optim.max_skipped_steps}){keep}")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(raw: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with ExitStack() as held:
        try:
            typed = typed_model_keys(RunIdentity.from_hydra().overrides)  # init_from: the model keys typed here
            # A node's elastic agent was started as one task of its node, not as a rank: the layout's world stands
            world = None if raw_node_agent(raw) else launched_world_size()
            cfg = load_checked(raw, world_size=world, typed=typed)
            asked = cfg.ckpt_path  # as given: preflight resolves it
            cfg = preflight(cfg, run_dir)
            if cfg.dry_run:
                from mlplat.perf.dry_run import run_dry

                run_dry(cfg, run_dir, experiment=HydraConfig.get().runtime.choices.get("experiment"),
                        overrides=RunIdentity.from_hydra().overrides,
                        signal_delay_s=HydraConfig.get().launcher.get("signal_delay_s"))
                return
            held.enter_context(run_dir_lock(run_dir))  # another run in this directory: refused, before any process
            if owns_run():  # the lock's holder: any unfinished save there is a dead run's
                refuse_another_run(run_dir, asked)
                from mlplat.checkpoint.io import remove_unfinished

                if gone := remove_unfinished(run_dir / "checkpoints"):
                    log.info("removed %d unfinished save%s of an earlier run: %s", len(gone), "s" * (len(gone) > 1),
                             ", ".join(gone))
                set_aside_branched(cfg.ckpt_path, run_dir)
        except (ConfigError, ValueError, CheckpointError) as e:
            job_failed(e)
        identity = RunIdentity.from_hydra()
        if node_agent(cfg.trainer.max_restarts, cfg.trainer.num_nodes):
            from mlplat.lightning.restarts import run_with_restarts

            run_with_restarts(cfg, run_dir, lambda first: run_restarted(first, run_dir, identity))
            return
        run_fit(cfg, run_dir, identity)


def run_restarted(cfg: RunConfig, run_dir: Path, identity: RunIdentity) -> None:
    """`run_fit` in a rank of a group the elastic agent started, resuming where `resume_point` says when the group is
    a restart (the first start resumes what preflight resolved); a checkpoint refused is one line and exit status 2,
    which the agent does not restart."""
    from mlplat.lightning.restarts import restart_count

    if restart_count() > 0:
        try:
            cfg.ckpt_path = resume_point(cfg.ckpt_path, run_dir)
        except CheckpointError as e:
            job_failed(e)
    run_fit(cfg, run_dir, identity)


def run_fit(cfg: RunConfig, run_dir: Path, identity: RunIdentity) -> None:
    """`fit` as a program: a checkpoint refused while loading is one line and exit status 2. What the ranks
    forked from rank 0 run, with rank 0's checked config: they need not compose, validate and check it again."""
    try:
        fit(cfg, run_dir, identity)
    except CheckpointError as e:  # found while loading (a checksum, a file that is not plain data): one line
        job_failed(e)
    except RunFileError as e:  # rank 0's own record (metrics.csv) cut short: it stops, the others stop with it
        job_failed(e)
    except DataError as e:  # a token id past the vocabulary, found as its sample was read: the reading ranks say it
        job_failed(e)
    except DivergenceError as e:  # every rank stops at the same step: rank 0 says it
        from pytorch_lightning.utilities.rank_zero import rank_zero_only

        job_failed(e, say=getattr(rank_zero_only, "rank", 0) == 0)


class JobFailed(CompactHydraException):
    """A multirun job refused or stopped (its line said already): Hydra marks the job failed and runs the next; at
    the sweep's end it names the first failed job's overrides, prints this line and exits 1."""


def job_failed(e: Exception, say: bool = True) -> NoReturn:
    """One line for a run refused or stopped by a known cause, and exit status 2; in a Hydra multirun the line names
    the job (its number and overrides) and the sweep goes on with its next job, as after a crash."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    if hydra_cfg is None or hydra_cfg.mode != RunMode.MULTIRUN:
        if say:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    line = f"error: job {hydra_cfg.job.num} ({','.join(hydra_cfg.overrides.task)}): {e}"
    if say:
        print(line, file=sys.stderr, flush=True)
    raise JobFailed(line)


def experiment_as_choice(argv: list[str]) -> list[str]:
    """`+experiment=NAME` (the form the paper rows were always launched with) as `experiment=NAME`: the defaults
    list now names the group (`experiment: null`), where Hydra refuses `+` for it."""
    return [a[1:] if a.startswith("+experiment=") else a for a in argv]


if __name__ == "__main__":
    sys.argv = experiment_as_choice(sys.argv)
    try:
        main()
    finally:
        # Exit without the interpreter's last garbage collection over torch's and Lightning's millions of objects
        # (3 s on 2 cores); atexit handlers and stream flushes still run.
        gc.freeze()
