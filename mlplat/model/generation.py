"""Text generation through the pipeline: every rank takes part, every rank returns the same tokens.

Each new token runs one forward pass of the schedule on one sequence, not on training's micro-batches: the window
of the last seq_len tokens, right-padded (the causal mask keeps the padding out of earlier positions). The rank
holding the last chunk draws the token (`mlplat.model.sampling`) with a generator seeded alike on all its
tensor-parallel ranks, then broadcasts it over the pipeline group. Only the first data-parallel replica decodes
(every replica, when expert parallelism spans them): the others hold the same weights, so they take each token
from it.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from mlplat.config import ModelConfig
from mlplat.model.sampling import sample_next
from mlplat.parallel.pipeline.engine import PipelineEngine
from mlplat.parallel.placement import local_index, place
from mlplat.parallel.tensor import gather_from_tensor_parallel

log = logging.getLogger("mlplat")
PROGRESS_S = 10.0  # a long sample says how far it is at most this often: each token is a whole forward pass
_clock = time.monotonic


@torch.no_grad()
def generate(engine: PipelineEngine, model_cfg: ModelConfig, prompt_ids: list[int],
             max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             device: torch.device | str = "cpu", every_replica: bool = False) -> list[int]:
    """The prompt followed by `max_new_tokens` tokens, greedy at temperature 0, else drawn. `every_replica`: every
    data-parallel replica decodes (parameters sharded over them: each forward gathers with all of them)."""
    grid, layout = engine.grid, engine.layout
    last_rank = layout.owner(layout.last_chunk)
    ids = list(prompt_ids) or [0]
    gen = torch.Generator(device=device).manual_seed(seed)
    comm = engine.comm
    if comm is not None:
        engine.comm = comm.with_rows(1)
    # One replica decodes and sends each token to the others, which need not compute; unless experts are spread
    # over data-parallel ranks (parallel.ep): their dispatch needs every rank of an ep group, so all decode (the
    # first replica's token still wins, so every rank returns the same tokens).
    decodes = every_replica or grid.dp_rank == 0 or any(grid.dims.coords(r).dp != grid.dp_rank for r in grid.ep_ranks)
    start = said = _clock()
    try:
        for k in range(max_new_tokens):
            if grid.rank == 0 and k and _clock() - said >= PROGRESS_S:
                said, rate = _clock(), k / (_clock() - start)
                log.info("sample: %d of %d tokens, %.1f tokens/s, about %.0f s left", k, max_new_tokens, rate,
                         (max_new_tokens - k) / rate)
            if decodes:
                nxt = _next_token(engine, model_cfg, ids, temperature, top_k, top_p, gen, last_rank, device)
            else:
                nxt = torch.zeros(1, dtype=torch.long, device=device)
            if grid.dp > 1:  # a token at a time: no rank waits longer than one token in a collective
                dist.broadcast(nxt, src=grid.dp_ranks[0], group=grid.dp_group)
            ids.append(int(nxt[0]))
    finally:
        engine.comm = comm
    return ids


def _next_token(engine: PipelineEngine, model_cfg: ModelConfig, ids: list[int], temperature: float, top_k: int,
                top_p: float, gen: torch.Generator, last_rank: int, device) -> torch.Tensor:
    """One forward pass of the window ending at `ids`; the token drawn from its last place's logits, as a
    one-element tensor on every rank of the pipeline (read on the host once, by the caller)."""
    grid, layout = engine.grid, engine.layout
    window = ids[-model_cfg.seq_len:]
    x = torch.zeros(1, model_cfg.seq_len, dtype=torch.long, device=device)
    x[:, : len(window)] = torch.tensor(window, device=device)
    here = len(window) - 1  # the place whose logits give the next token
    x, _, placed = place(x, x[:, :0], model_cfg.seq_len, grid.cp, grid.cp_rank)
    engine.run([(x, None, placed)] * layout.min_micro_batches, forward_only=True)
    nxt = torch.zeros(1, dtype=torch.long, device=device)
    if grid.pp_rank == last_rank:
        if grid.cp == 1:
            logits = gather_from_tensor_parallel(engine.last_outputs[0][0, here], grid)
        else:  # the cp rank holding that place shares its logits, so that every cp rank draws the same token
            owner = next(r for r in range(grid.cp) if here in local_index(model_cfg.seq_len, grid.cp, r))
            dtype = next(engine.chunks[layout.last_chunk].parameters()).dtype
            logits = torch.zeros(model_cfg.padded_vocab(grid.tp), dtype=dtype, device=device)
            if grid.cp_rank == owner:
                row = int((placed.index == here).nonzero())
                logits = gather_from_tensor_parallel(engine.last_outputs[0][0, row], grid).to(dtype)
            dist.broadcast(logits, src=grid.cp_ranks[owner], group=grid.cp_group)
        nxt[0] = sample_next(logits[: model_cfg.vocab_size], temperature, top_k, top_p, gen)
    if grid.pp > 1:
        dist.broadcast(nxt, src=grid.stage_rank(last_rank), group=grid.pp_group)
    return nxt
