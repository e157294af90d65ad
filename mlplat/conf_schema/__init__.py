"""The `model_schema` config: every `model.*` key (mlplat.config.schema.ModelConfig, its sections of keys such as
`model.moe` included) at its schema default, built from the dataclass rather than written in a YAML.

conf/config.yaml composes it under `model` before the model group's file, so that `model.KEY=VALUE` sets any key
on any model (Hydra refuses to override a key the composed config lacks, even one the schema has) and the model's
file still overrides what it sets. Hydra imports this package wherever it composes conf/config.yaml: the config's
`hydra.searchpath` names it (`pkg://`: Hydra imports a package to look for configs in it; it holds none, and the
node it registers is found in Hydra's ConfigStore, always searched last; a `structured://` entry would serve the
whole ConfigStore, Hydra's own configs included, ahead of their schemas, which Hydra refuses). `mlplat.train`
imports it too, for a command line that replaces hydra.searchpath. The node is a plain mapping, not a structured
config: values are typed and checked by `mlplat.config.from_raw`, whose one-line refusals users see."""
from __future__ import annotations

import dataclasses

from hydra.core.config_store import ConfigStore

from mlplat.config.schema import ModelConfig

NAME = "model_schema"

ConfigStore.instance().store(name=NAME, node=dataclasses.asdict(ModelConfig()))
