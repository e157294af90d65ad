"""Every private name of Lightning that mlplat reaches, in this one adapter: the rest of mlplat/lightning imports
them from here and sets no attribute of Lightning's objects itself.

Checked against pytorch-lightning and lightning-fabric 2.4 to 2.6 (pyproject's range; tests/lightning/
test_internals.py fails on an installed version that lacks one of them). Why each is needed:

- `SubprocessScriptLauncher` and `ChildProcessObserver`: mlplat's launcher forks its ranks instead of re-running
  `sys.argv` (Hydra's multirun would start a sweep in each child, Lightning issue 11300), and watches them;
- `set_num_threads_if_needed`, `destroy_dist_connection`: what Lightning's launcher does around its children;
- `SignalConnector`: mlplat's preemption handlers replace Lightning's, whose SIGTERM handling is collective;
- `replace_signal_connector`: the trainer's connector slot, and the fit loop's per-step broadcast of its
  SIGTERM flag, which is always False under mlplat's handlers (one world-wide collective a step saved);
- `cluster_environment`: the trainer's cluster environment, which the public API only exposes through the
  strategy once it is set up.

Three subclasses of Lightning's call their parent's protected members: `launcher.HydraSafeLauncher`
(`_call_children_scripts`), `signals.SignalConnector` (`_original_handlers`) and `checkpointing.StepCheckpoint`
(`_should_skip_saving_checkpoint`, `_save_topk_checkpoint`, `_monitor_candidates`, `_every_n_train_steps`: the
last step saved at the loop's point of the periodic saves). The test checks those members too.
"""
from __future__ import annotations

from typing import Any

from lightning_fabric.strategies.launchers.subprocess_script import _ChildProcessObserver as ChildProcessObserver
from lightning_fabric.utilities.distributed import _destroy_dist_connection as destroy_dist_connection
from lightning_fabric.utilities.distributed import _set_num_threads_if_needed as set_num_threads_if_needed
from pytorch_lightning.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)
from pytorch_lightning.trainer.connectors.signal_connector import _SignalConnector as SignalConnector

__all__ = ["ChildProcessObserver", "SignalConnector", "SubprocessScriptLauncher", "cluster_environment",
           "destroy_dist_connection", "replace_signal_connector", "set_num_threads_if_needed"]


def cluster_environment(trainer: Any) -> Any:
    return trainer._accelerator_connector.cluster_environment


def replace_signal_connector(trainer: Any, connector: Any) -> None:
    """`connector` in place of the trainer's signal connector."""
    trainer._signal_connector = connector


def skip_sigterm_broadcast(trainer: Any) -> None:
    """The fit loop's broadcast of the SIGTERM flag before every step, made a no-op (where the version has it)."""
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    if loop is not None and hasattr(loop, "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = lambda: None
