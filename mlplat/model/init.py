"""Initialisation from the full-model view, one bounded block at a time.

Every random parameter is drawn as its slice of the full (tp = 1) tensor, so the same seed gives the same full
model under any layout. The full tensor is cut into fixed tiles of `TILE` (rows x columns, a grid that
depends only on the full shape), and tile (i, j) of parameter NAME is drawn from its own generator, keyed by
the seed, NAME and (i, j). A rank draws only the tiles its shard overlaps, one at a time: nothing it
allocates is larger than one tile, so a gpt1t fc1 weight (4h x h, 10 GB in fp32) is never built whole on any
rank. The tiles are drawn on the CPU with a CPU generator, whatever the ambient default
device (Lightning builds the model inside `with root_device:`), then copied into the parameter's device.
"""
from __future__ import annotations

import math
import zlib

import torch

from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.tensor import slice_rank

WORD_EMBEDDING = "embedding.word.weight"  # the full-model name of the (tied) word embedding
OUTPUT_LAYER = "output.weight"  # the untied output layer's (model.tie_embeddings=false)
# the attentions' own norms and the multi-token prediction modules' (gains start at 1)
NORM_WEIGHTS = ("q_norm.weight", "k_norm.weight", "kv_norm.weight", "enorm.weight", "hnorm.weight", ".norm.weight")
TILE = (1024, 1024)  # rows x columns of one generator block: 4 MiB in fp32


def _seed_for(seed: int, key: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63 - 1)


def shard_range(size: int, dim_of_param: int | None, dim: int, grid: ParallelGrid) -> tuple[int, int]:
    """[start, end) of this rank's shard along `dim` of the full tensor (the whole extent if not split)."""
    if dim_of_param is None or dim_of_param != dim:
        return 0, size
    return grid.tp_rank * size, (grid.tp_rank + 1) * size


@torch.no_grad()
def fill_normal_full_view(param: torch.Tensor, name: str, std: float, seed: int, grid: ParallelGrid,
                          real_rows: int | None = None, tile: tuple[int, int] = TILE) -> None:
    """Fill `param` (a shard split along its `partition_dim`, or a whole tensor) with its slice of the full
    N(0, std²) tensor NAME. Rows at or past `real_rows` of the full tensor (vocabulary padding) are zero. A shard
    made of row blocks (`row_blocks`: a key/value head shared by several tp ranks) draws each block's rows of the
    full tensor, so every rank sharing a head gets the same values."""
    if param.dim() != 2:
        raise ValueError(f"{name}: full-view initialisation draws 2-D weights, got shape {tuple(param.shape)}")
    blocks = getattr(param, "row_blocks", None)
    if blocks is not None:
        full_rows = max(b.full + b.rows for rank in blocks for b in rank)
        for b in blocks[slice_rank(param, grid)]:
            _fill_rows(param[b.local:b.local + b.rows], name, std, seed, b.full, b.full + b.rows, full_rows,
                       param.shape[1], 0, param.shape[1], tile)
        return
    dim = getattr(param, "partition_dim", None)
    dim = None if dim is None else dim % 2
    r0, r1 = shard_range(param.shape[0], dim, 0, grid)
    c0, c1 = shard_range(param.shape[1], dim, 1, grid)
    full_rows = param.shape[0] * (grid.tp if dim == 0 else 1)
    full_cols = param.shape[1] * (grid.tp if dim == 1 else 1)
    drawn_rows = full_rows if real_rows is None else min(real_rows, full_rows)  # the rest is padding
    _fill_rows(param, name, std, seed, r0, min(r1, drawn_rows), drawn_rows, full_cols, c0, c1, tile)


def _fill_rows(param: torch.Tensor, name: str, std: float, seed: int, r0: int, end: int, drawn_rows: int,
               full_cols: int, c0: int, c1: int, tile: tuple[int, int]) -> None:
    """`param`: rows [r0, end) and columns [c0, c1) of the full tensor, drawn tile by tile (the full tensor's
    first `drawn_rows` rows are drawn, its tiles cut from them); rows at or past `end` stay zero."""
    param.zero_()
    tr, tc = tile
    for i in range(r0 // tr, math.ceil(end / tr) if end > r0 else 0):
        rows = min(tr, drawn_rows - i * tr)
        for j in range(c0 // tc, math.ceil(c1 / tc)):
            cols = min(tc, full_cols - j * tc)
            gen = torch.Generator(device="cpu").manual_seed(_seed_for(seed, f"{name}#{i},{j}"))
            block = torch.randn(rows, cols, generator=gen, dtype=torch.float32, device="cpu").mul_(std)
            a, b = max(r0, i * tr), min(end, i * tr + rows)
            c, d = max(c0, j * tc), min(c1, j * tc + cols)
            param[a - r0:b - r0, c - c0:d - c0].copy_(block[a - i * tr:b - i * tr, c - j * tc:d - j * tc])


@torch.no_grad()
def init_full_view(chunk, seed: int, tile: tuple[int, int] = TILE) -> None:
    """Initialise every parameter of a chunk: biases 0, norm gains 1, weights N(0, init_std²) with
    the residual projections scaled by 1/sqrt(2·layers) (GPT-2/Megatron); the padding rows of the word embedding
    (and of an untied output layer) stay zero, so they are inert."""
    cfg, grid = chunk.cfg, chunk.grid
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for name, param in chunk.named_parameters():
        if param.is_meta:
            continue
        full = chunk.full_name(name)
        if full.endswith(".bias"):
            param.zero_()
        elif ".ln" in full or full.startswith("final_ln") or full.endswith(NORM_WEIGHTS):
            param.fill_(1.0)
        else:
            # The residual branches' last GEMMs: the MLP's fc2, the experts' and the shared experts' (mlplat.model.moe).
            std = out_std if full.endswith(("attn.out.weight", "fc2.weight")) else cfg.init_std
            real = cfg.vocab_size if full in (WORD_EMBEDDING, OUTPUT_LAYER) else None
            fill_normal_full_view(param, full, std, seed, grid, real_rows=real, tile=tile)
