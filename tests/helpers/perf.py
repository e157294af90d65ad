"""The paper's Table 1 (Narayanan et al., SC21) and its cluster, shared by the cost-model and planner tests; the bytes
a layer keeps for its backward, shared by the memory-model tests."""
from __future__ import annotations

from mlplat.perf.cluster import Cluster

TABLE1 = ["gpt1p7b", "gpt3p6b", "gpt7p5b", "gpt18b", "gpt39b", "gpt76b", "gpt145b", "gpt310b", "gpt530b", "gpt1t"]
PAPER_PARAMS_B = [1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1, 529.6, 1008.0]
PAPER_TFLOPS = [137, 138, 142, 135, 138, 140, 148, 155, 163, 163]


def a100() -> Cluster:
    from mlplat.plan import load_group

    return Cluster.from_config(load_group("cluster", "dgx_a100"))


def saved_bytes(run, exclude) -> int:
    """Bytes of the distinct storages autograd saves while `run()` executes, those of `exclude` left out."""
    import torch

    skip = {q.untyped_storage().data_ptr() for q in exclude}
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = run()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    del out
    return sum(n for ptr, n in storages.items() if ptr not in skip)


def middle_chunk_saved_bytes(cfg, batch: int, recompute: str) -> float:
    """Bytes autograd saves per layer in the middle third of `cfg`'s layers (a DecoderChunk, chunk 1 of 3: no
    embedding, no loss), in bf16 with math attention, on one process, parameters left out."""
    import torch

    from mlplat.config import KernelsConfig
    from mlplat.model.decoder import DecoderChunk
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.parallel.random import STAGE_RNG, RNGTracker, seed_model_parallel

    grid, tracker = ParallelGrid(), RNGTracker()
    seed_model_parallel(0, grid, tracker)
    chunk = DecoderChunk(cfg, grid, 1, 3, kernels=KernelsConfig(attention="math", recompute=recompute),
                         tracker=tracker, dtype=torch.bfloat16)
    chunk.train()
    x = torch.randn(batch, cfg.seq_len, cfg.hidden, dtype=torch.bfloat16, requires_grad=True)

    def run():
        with tracker.fork(STAGE_RNG):
            return chunk(x)

    return saved_bytes(run, list(chunk.parameters())) / (cfg.n_layers // 3)
