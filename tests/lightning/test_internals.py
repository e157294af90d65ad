"""Lightning's private names that mlplat reaches (`mlplat.lightning.internals`) exist in the installed version with
the shape mlplat relies on, and no other module of mlplat/lightning reaches one: a Lightning upgrade that moves them
fails here, in one place, not in a run."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytorch_lightning as pl

from mlplat.lightning import internals

LIGHTNING = Path(internals.__file__).parent


def test_the_private_names_exist_with_the_members_mlplat_uses():
    assert callable(internals.set_num_threads_if_needed) and callable(internals.destroy_dist_connection)
    assert hasattr(internals.SubprocessScriptLauncher, "_call_children_scripts")
    assert {"register_signal_handlers", "teardown"} <= set(dir(internals.SignalConnector))
    from pytorch_lightning.callbacks import ModelCheckpoint

    parents = set(dir(ModelCheckpoint))
    assert {"_should_skip_saving_checkpoint", "_save_topk_checkpoint", "_monitor_candidates"} <= parents
    assert "_every_n_train_steps" in vars(ModelCheckpoint(every_n_train_steps=2))
    assert "trainer" in inspect.signature(internals.SignalConnector.__init__).parameters
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    assert internals.cluster_environment(trainer) is not None
    marker = internals.SignalConnector(trainer)
    internals.replace_signal_connector(trainer, marker)
    assert trainer._signal_connector is marker
    internals.skip_sigterm_broadcast(trainer)  # a no-op where the loop has no such broadcast


def test_no_other_module_reaches_a_private_lightning_name():
    private = re.compile(r"(from (pytorch_lightning|lightning_fabric)\S* import [^\n]*\b_[A-Za-z])|"
                         r"(trainer\._[a-z]|\._accelerator_connector|\._signal_connector|\._broadcast_sigterm_tensor)")
    offenders = [p.name for p in LIGHTNING.glob("*.py") if p.name != "internals.py" and private.search(p.read_text())]
    assert offenders == []
