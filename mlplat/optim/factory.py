"""The optimizers a run can name (`optim.name`), one entry each: the only place the training step gets its optimizer.

Adding an optimizer is one `register(Optimizer(name, build))`: from then on the config accepts the name
(`mlplat.config.rules`) and the training step builds it (`build_optimizer`); `registered` adds one for the length of
a `with` block (a test's toy optimizer). What the rest reads of an optimizer is declared by it:

- its state per parameter: the class attribute `STATE`, names of tensors shaped like the parameter (or like its
  shard of the flat buffers), which the gradient buffer allocates for an optimizer on the main weights
  (`ParamBuffers.allocate_state`), post-validation copies (`mlplat.step.post_validation`) and a checkpoint saves
  as `optim/NAME/KEY` (`mlplat.checkpoint.state`), read through `state_names`;
- whether its update reads a parameter whole (`Optimizer.whole_matrices`: Muon's orthogonalisation of a matrix),
  which the distributed optimizer's sharding follows (`ParamBuffers(whole_params=True)`: each rank's shard holds
  whole parameters), and what its update of a parameter costs (`Optimizer.work`), which the shards are balanced by.

Torch-free at import, so that the config can name the registered optimizers: an entry's `build` imports what it
builds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from mlplat.specs.registry import Registry

# (optim config, the gradient buffer `ParamBuffers`, the parameter groups [decay, no decay] as torch takes them)
Build = Callable[[Any, Any, list[dict]], Any]


@dataclass(frozen=True)
class Optimizer:
    name: str  # the value of optim.name
    build: Build
    # its update reads each parameter whole: with optim.distributed, each data-parallel rank owns whole parameters
    whole_matrices: bool = False
    # (parameter, grid) -> the work of its update on a rank: whole parameters are dealt to balance it (None: by size)
    work: Callable[[Any, Any], float] | None = None


_ENTRIES: Registry[Optimizer] = Registry("optimizer", "optim.name")
register, unregister, registered = _ENTRIES.register, _ENTRIES.unregister, _ENTRIES.registered
names, get = _ENTRIES.names, _ENTRIES.get


def state_names(optimizer) -> tuple[str, ...]:
    """The state per parameter that `optimizer` declares (its class's `STATE`)."""
    state = getattr(optimizer, "STATE", None)
    if state is None:
        raise TypeError(f"{type(optimizer).__name__} declares no STATE (the names of its state per parameter)")
    return tuple(state)


def param_groups(params: Sequence) -> list[list]:
    """[decay, no decay]: no weight decay on biases and LayerNorm gains, as in Megatron/GPT-2."""
    return [[p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]]


def build_optimizer(optim_cfg, grads, groups: Sequence[Sequence]):
    """optim.name's optimizer over `groups` (`param_groups`), whose gradients `grads` reduces (its weights already
    in the flat buckets), with optim.weight_decay on the first group."""
    torch_groups = [{"params": list(groups[0]), "weight_decay": optim_cfg.weight_decay},
                    {"params": list(groups[1]), "weight_decay": 0.0}]
    return get(optim_cfg.name).build(optim_cfg, grads, torch_groups)


def _adamw(optim_cfg, grads, groups: list[dict]):
    """torch's AdamW on the weights (the gradients are views of the buffer), or, for the Megatron-style precisions
    and the distributed optimizer, `MainParamsAdamW` on the buffer's main weights (its shards)."""
    from mlplat.optim.main_params import AdamW, MainParamsAdamW, log_main_params

    if grads.own_main or grads.distributed:
        return log_main_params(MainParamsAdamW(grads, groups, lr=optim_cfg.lr, betas=optim_cfg.betas,
                                               eps=optim_cfg.eps))
    return AdamW(groups, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps)


def _muon(optim_cfg, grads, groups: list[dict]):
    """Muon on the hidden matrices, AdamW on the rest, on the buffer's main weights (`mlplat.optim.muon`)."""
    from mlplat.optim.main_params import log_main_params
    from mlplat.optim.muon import build_muon

    return log_main_params(build_muon(optim_cfg, grads, groups))


def _muon_work(p, grid) -> float:
    from mlplat.optim.muon import step_work

    return step_work(p, grid)


register(Optimizer("adamw", _adamw))
register(Optimizer("muon", _muon, whole_matrices=True, work=_muon_work))
DEFAULT = "adamw"  # the optimizer of a config that names none
