"""PipelineLayout's layers per chunk: the even split, and the uneven one (parallel.first_stage_layers and
last_stage_layers fix the first and the last chunk's layers, the other chunks split the rest), and the chunks a
rank builds hold exactly those layers."""
from __future__ import annotations

import pytest
import torch

from mlplat.config import ModelConfig
from mlplat.model.decoder import build_rank_chunks
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.layout.pipeline import PipelineLayout


def test_published_uneven_layouts_of_126_layers():
    """Llama 3.1 405B's 126 layers as torchtitan splits them: 15, 16 x6, 15 over 8 stages; interleaved over 16
    chunks 7, 8 x14, 7 (the first rank's first chunk and the last rank's last chunk hold 7)."""
    one = PipelineLayout(8, 1, "1f1b", 15, 15)
    assert one.chunk_layers(126) == [15, *[16] * 6, 15]
    inter = PipelineLayout(8, 2, "interleaved", 7, 7)
    assert inter.chunk_layers(126) == [7, *[8] * 14, 7]
    assert [inter.rank_layers(r, 126) for r in range(8)] == [15, *[16] * 6, 15] and inter.max_rank_layers(126) == 16
    # The V puts chunks 0 and 15 on rank 0: it holds both light ends.
    v = PipelineLayout(8, 2, "zbv", 7, 7)
    assert [v.rank_layers(r, 126) for r in range(8)] == [14, *[16] * 7]


@pytest.mark.parametrize("layout,n_layers", [(PipelineLayout(3, 1, "1f1b", 2), 8),
                                             (PipelineLayout(4, 2, "interleaved", 2, 2), 10),
                                             (PipelineLayout(4, 2, "v_half", None, 5), 12),
                                             (PipelineLayout(2, 1, "gpipe", 3, 1), 4),
                                             (PipelineLayout(4, 1, "1f1b"), 8)])
def test_chunks_hold_consecutive_layers_and_each_layer_once(layout, n_layers):
    """Chunk c holds the layers after chunk c-1's; every layer is on one chunk; the chunks each rank builds (on the
    meta device) hold the layers `layers_of` names, whatever rank holds them."""
    held = [i for c in range(layout.num_chunks) for i in layout.layers_of(c, n_layers)]
    assert held == list(range(n_layers))
    cfg = ModelConfig(n_layers=n_layers, hidden=16, n_heads=2, seq_len=8, vocab_size=32)
    built = {}
    for rank in range(layout.pp):
        grid = ParallelGrid(pp=layout.pp, rank=rank, virtual=True)  # t = d = 1: rank r is stage r
        for c, chunk in build_rank_chunks(cfg, grid, layout, device=torch.device("meta")).items():
            built[c] = chunk.layer_ids
    assert built == {c: list(layout.layers_of(c, n_layers)) for c in range(layout.num_chunks)}
