"""Typed run configuration and the validation that turns bad input into one clear line.

Hydra composes a DictConfig; `load_config` turns it into the dataclasses of `schema` (each key's type checked) and
`rules.validate` checks every rule that the values alone decide and derives what they imply (dp, trainer.devices,
the layout facts in `mlplat.parallel.layout.dims.ParallelDims`). Nothing here reads a file or the environment: the rules
that do (the data, the tokenizer, an init_from directory, the machine, a checkpoint, a W&B key) are
`mlplat.train`'s `load_checked` and `preflight`. This module only hands on both modules' names.
"""
# isort: skip_file
from mlplat.errors import ConfigError  # noqa: F401  (raised by every rule; callers catch it from here)
from mlplat.config.schema import (  # noqa: F401
    ACCELERATORS, ACTIVATIONS, ARCHS, ATTENTION_BACKENDS, CPU_KEYS, DATA_NAMES, GRAD_REDUCE_DTYPES,
    LOGGERS, MEGATRON_PRECISIONS, MIN_TEMPERATURE, MUON_UPDATE_SCALES, NORMS, PATH_KEYS, POSITIONS, PRECISIONS,
    RECOMPUTE, RING_KERNELS, ROPE_SCALING_KEYS, SHARDINGS, WANDB_MODES, WANDB_PROJECT_FORBIDDEN, YARN_KEYS,
    YARN_OPTIONAL_KEYS,
    CheckpointConfig, ClusterConfig, DataConfig, KernelsConfig, LoggerConfig, MLAConfig, ModelConfig, MoEConfig,
    MTPConfig, MuonConfig, OptimConfig, ParallelConfig, ProfileConfig, RunConfig, SampleConfig, TrainerConfig,
    from_dict, from_raw
)
from mlplat.config.rules import (  # noqa: F401
    arch_defaults, attention_splits, batch_violations, context_parallel_violations, expert_parallel_violations,
    fp8_expert_violations, fp8_violations, load_config, paired_schedule_violations, resolve_world, ring_blocks_on_gpu,
    ring_kernel, sequence_parallel_violations, shape_violations, validate
)
