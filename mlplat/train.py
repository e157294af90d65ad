"""`python -m mlplat.train [overrides]`: compose -> validate -> build the Trainer and PTDPStrategy -> fit.

Everything a run writes goes under Hydra's run directory (`hydra.run.dir=DIR`): DIR/metrics.csv, the
W&B or CSV logs and, later, checkpoints.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig

from mlplat.config import ConfigError, RunConfig, load_config

log = logging.getLogger("mlplat")


def launched_world_size() -> int | None:
    """The world size an external launcher (torchrun, SLURM, our own parent rank) has fixed, if any."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_NTASKS" in os.environ and "SLURM_JOB_ID" in os.environ and os.environ.get("SLURM_JOB_NAME") != "bash":
        return int(os.environ["SLURM_NTASKS"])
    return None


def make_logger(cfg: RunConfig, run_dir: Path):
    name = cfg.logger.name
    if name == "none":
        return False
    if name == "csv":
        from pytorch_lightning.loggers import CSVLogger

        return CSVLogger(save_dir=str(run_dir), name="csv")
    from pytorch_lightning.loggers import WandbLogger

    mode = cfg.logger.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    return WandbLogger(save_dir=str(run_dir), project=cfg.logger.project, entity=cfg.logger.entity,
                       offline=(mode == "offline"), tags=list(cfg.logger.tags), log_model=False)


def build_trainer(cfg: RunConfig, run_dir: Path, extra_callbacks=()):
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import TQDMProgressBar

    from mlplat.lightning.callbacks import MetricsCSV, SampleText
    from mlplat.lightning.strategy import PTDPStrategy

    t = cfg.trainer
    callbacks = [MetricsCSV(run_dir / "metrics.csv"), SampleText(cfg.sample.prompt, cfg.sample.max_new_tokens),
                 TQDMProgressBar(refresh_rate=max(1, t.log_every_n_steps)), *extra_callbacks]
    return pl.Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes,
        strategy=PTDPStrategy(cfg.parallel), precision=t.precision, max_steps=t.max_steps,
        val_check_interval=t.val_check_interval, check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches, num_sanity_val_steps=0, log_every_n_steps=t.log_every_n_steps,
        logger=make_logger(cfg, run_dir), callbacks=callbacks, default_root_dir=str(run_dir),
        use_distributed_sampler=False, enable_checkpointing=False, enable_model_summary=False,
    )


def fit(cfg: RunConfig, run_dir: Path):
    from mlplat.lightning.datamodule import TextDataModule
    from mlplat.lightning.module import GPTModule

    trainer = build_trainer(cfg, run_dir)
    module = GPTModule(cfg)
    trainer.fit(module, datamodule=TextDataModule(cfg))
    return trainer, module


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(raw: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        cfg = load_config(raw, world_size=launched_world_size())
        if cfg.dry_run:
            from mlplat.perf.dry_run import run_dry

            run_dry(raw, cfg, run_dir)
            return
        if cfg.trainer.accelerator == "cpu":
            from mlplat.model.attention import resolve_backend

            resolve_backend(cfg.kernels.attention, "cpu")  # `flash` on a CPU box: refuse before any process
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*Checkpoint directory.*")
    fit(cfg, run_dir)


if __name__ == "__main__":
    main()
