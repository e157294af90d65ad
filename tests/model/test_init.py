"""Initialisation: the same full model under every layout, drawn one bounded tile at a time, on any device context."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlplat.config import ModelConfig
from mlplat.model.decoder import DecoderChunk
from mlplat.model.init import init_full_view
from mlplat.parallel.grid import ParallelGrid

# vocab 200 pads to 256 at tp=1 and tp=2 and to 512 at tp=4: padding rows must be zero everywhere.
CFG = ModelConfig(n_layers=2, hidden=32, n_heads=4, seq_len=16, vocab_size=200, vocab_pad_multiple=64)
TILE = (24, 20)  # deliberately not a divisor of any dimension, so tiles straddle every shard boundary


def _full_model(tp: int, tile=TILE) -> dict[str, torch.Tensor]:
    """Full-model tensors assembled from the tp ranks' shards (virtual grids: no processes needed)."""
    shards: dict[str, list[torch.Tensor]] = {}
    dims: dict[str, int | None] = {}
    for rank in range(tp):
        grid = ParallelGrid(tp=tp, rank=rank, virtual=True)
        chunk = DecoderChunk(CFG, grid, 0, 1, device="cpu", dtype=torch.float32)
        init_full_view(chunk, seed=7, tile=tile)
        for name, p in chunk.named_parameters():
            shards.setdefault(name, []).append(p.detach().clone())
            dims[name] = getattr(p, "partition_dim", None)
    full = {}
    for name, parts in shards.items():
        full[name] = torch.cat(parts, dim=dims[name]) if dims[name] is not None else parts[0]
        if name == "embedding.word.weight":
            assert not full[name][CFG.vocab_size:].any(), "vocabulary padding rows must be zero"
            full[name] = full[name][: CFG.vocab_size]
    return full


def test_same_full_model_under_every_tensor_parallel_layout():
    ref = _full_model(1)
    assert ref["layers.0.mlp.fc1.weight"].std() > 0.01
    for tp in (2, 4):
        got = _full_model(tp)
        assert got.keys() == ref.keys()
        for name in ref:
            assert torch.equal(got[name], ref[name]), (tp, name)


def test_tile_size_changes_the_draw_but_not_the_layout_independence():
    # The tile grid is part of the definition of the initial model (documented), the layout is not.
    other = _full_model(2, tile=(16, 16))
    assert torch.equal(other["layers.1.attn.qkv.weight"], _full_model(1, tile=(16, 16))["layers.1.attn.qkv.weight"])
    assert not torch.equal(other["layers.1.attn.qkv.weight"], _full_model(1)["layers.1.attn.qkv.weight"])


class _LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any operation allocates (in-place results and views are not allocations)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and not t._is_view() and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_rank_allocates_more_than_one_tile():
    grid = ParallelGrid(tp=2, rank=1, virtual=True)
    chunk = DecoderChunk(CFG, grid, 0, 1, device="cpu", dtype=torch.float32)
    fc1_full = 4 * CFG.hidden * CFG.hidden
    with _LargestAllocation() as probe:
        init_full_view(chunk, seed=7, tile=TILE)
    assert 0 < probe.largest <= TILE[0] * TILE[1] < fc1_full // 2  # a tile, not a shard, not the full tensor


def test_initialisation_under_a_foreign_default_device():
    """Lightning builds the model inside `with root_device:`; on a GPU a CPU generator would then meet CUDA
    tensors. Here the ambient device is `meta`: any tensor the initialisation creates without naming its
    device lands there and the copy into the real parameters fails."""
    grid = ParallelGrid(tp=2, rank=0, virtual=True)
    plain = DecoderChunk(CFG, grid, 0, 1, device="cpu", dtype=torch.float32)
    init_full_view(plain, seed=3)
    under_meta = DecoderChunk(CFG, grid, 0, 1, device="cpu", dtype=torch.float32)
    with torch.device("meta"):
        init_full_view(under_meta, seed=3)
    for (name, a), (_, b) in zip(plain.named_parameters(), under_meta.named_parameters()):
        assert b.device.type == "cpu" and torch.equal(a, b), name
