"""mlplat.precision: every trainer.precision has an entry, and the entries say what torch and Lightning do."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlplat.config import MEGATRON_PRECISIONS, PRECISIONS
from mlplat.precision import TABLE, precision_of


def test_every_config_precision_has_an_entry_and_bad_ones_are_refused_in_one_line():
    assert set(PRECISIONS) == set(TABLE) and len(PRECISIONS) >= 10
    assert {"32", "64"} <= set(TABLE) and precision_of("32").compute_dtype == precision_of("32-true").compute_dtype
    assert set(MEGATRON_PRECISIONS) == {"bf16-megatron", "16-megatron"}
    for entry in TABLE.values():
        for dtype in (entry.compute_dtype, entry.weight_dtype, entry.main_dtype or "float32"):
            assert isinstance(getattr(torch, dtype), torch.dtype), (entry.name, dtype)
        assert entry.compute_bytes == torch.empty(0, dtype=getattr(torch, entry.compute_dtype)).element_size()
    with pytest.raises(ValueError, match=r"^trainer.precision='fp12' is not one of 64-true, 64, 32-true"):
        precision_of("fp12")


def _plugin(precision: str):
    """The plugin a run gets: mlplat's where it has one, else the one Lightning's `precision=` flag builds."""
    import pytorch_lightning as pl

    from mlplat.lightning.precision import precision_plugin

    plugin = precision_plugin(precision, "cpu")
    if plugin is not None:
        return plugin
    trainer = pl.Trainer(precision=precision, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return trainer.precision_plugin


@pytest.mark.parametrize("precision", ["64-true", "32", "bf16-mixed", "16-mixed", "bf16-true", "bf16-megatron",
                                       "16-megatron"])
def test_the_table_is_what_the_plugin_does(precision):
    """A Linear built and run under the run's precision plugin: its weights are the table's weight dtype, its output
    the table's compute dtype; autocast is on exactly where the table says (loss scaling is the training step's).
    The Megatron-style plugin changes no dtype: the main-parameter code casts the fp32-built weights
    (`main_params.megatron_dtype`)."""
    from pytorch_lightning.plugins.precision import MixedPrecision

    from mlplat.optim.main_params import megatron_dtype

    entry = precision_of(precision)
    plugin = _plugin(precision)
    with plugin.module_init_context():
        layer = nn.Linear(8, 8)
    layer = plugin.convert_module(layer)
    cast = megatron_dtype(precision)
    assert (cast is not None) == entry.megatron
    if cast is not None:
        assert layer.weight.dtype == torch.float32  # built in fp32: these values become the fp32 main weights
        assert entry.main_dtype == "float32"
        layer = layer.to(cast)
    x = plugin.convert_input(torch.randn(2, 8, dtype=layer.weight.dtype if cast is not None else torch.float32))
    with plugin.forward_context():
        y = layer(x)
    assert layer.weight.dtype == getattr(torch, entry.weight_dtype)
    assert y.dtype == getattr(torch, entry.compute_dtype)
    assert isinstance(plugin, MixedPrecision) == entry.autocast
