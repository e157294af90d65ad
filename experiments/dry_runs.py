"""The dry run of an experiment config with extra overrides, as `python -m mlplat.train +experiment=NAME dry_run=true`
computes it: shared by the scripts that set predictions beside published figures (experiments/mixtral_8x7b/,
experiments/deepseek_v3/)."""
from __future__ import annotations

from pathlib import Path

CONF = Path(__file__).resolve().parents[1] / "conf"


def plan_of(name: str, extra: list[str]) -> dict:
    from hydra import compose, initialize_config_dir

    import mlplat.train  # noqa: F401  (the resolvers of conf/hydra/launcher/)
    from mlplat.config import load_config
    from mlplat.perf.dry_run import plan

    overrides = [f"experiment={name}", *extra, "dry_run=true"]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        raw = compose(config_name="config", overrides=overrides)
    return plan(load_config(raw), experiment=name, overrides=overrides, use_meta=False, max_compute_ops=20_000)
