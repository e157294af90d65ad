"""Activation memory per transformer layer: the bytes mlplat saves for backward, measured, against Korthikanti et
al. 2022 (*Reducing Activation Recomputation in Large Transformer Models*, §4 and Table 2).

    python experiments/activation_memory/measure.py      # ~1 minute on 2 cores; prints the table, writes results.md

A middle pipeline chunk of the real model (no embedding, no head) runs one training forward on its
[b, s, h] input (this rank's [b, s/t, h] shard under sequence parallelism) under
`torch.autograd.graph.saved_tensors_hooks`. Every tensor autograd saves is kept by the hook, so no storage is
freed and reused during the forward; the bytes are those of the distinct storages behind the saved tensors (a
tensor saved twice, or two views of one storage, count once), parameters excluded. Divided by the chunk's layer
count, that is one layer on one tensor-parallel rank. t = 1, 2, 4 run in one group of 4 gloo processes (t = 2 as
t2·d2), each for recomputation none / selective / full and sequence parallelism off / on, with the attention
`math` backend, unfused kernels, dropout 0.1 (its masks are part of the count) and bfloat16 weights and
activations, the paper's 2-byte tensors.

The paper's formulas, per layer, in bytes (s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size):

    recompute   tensor parallel                 + sequence parallel
    none        sbh·(10 + 24/t + 5as/(ht))      sbh·(34/t + 5as/(ht))
    selective   sbh·(10 + 24/t)                 sbh·34/t
    full        2sbh                            2sbh/t

The 34 counts 16 two-byte tensors of sbh elements (LayerNorm inputs 2, QKV input 1, Q and K 2, V 1, output
projection input 1, fc1 input 1, GeLU input 4, fc2 input 4) and two one-byte dropout masks; the 5as/h counts
the softmax output and the dropout output (2 bytes each per score) and the dropout mask (1 byte). On a CPU,
PyTorch's dropout keeps its mask as a tensor of the activation's dtype, not a byte mask: there each mask costs
2 bytes, and what mlplat saves is sbh·(36 [+ 6as/h]) before the division by t (`formula_bytes(mask_bytes=2)`).
The table gives both; the test (tests/parallel/test_sequence.py) holds the measurement to the CPU's figure within
5%. What remains is small and named: the LayerNorms' mean and 1/std (in the activation's dtype on a CPU: 8
bytes per token per layer) and, without recomputation, the causal mask that the softmax's masked_fill keeps (s²
bytes).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# s, b, h, a: as/h = 8 keeps the s² terms comparable with the sbh ones; a·b/t ≥ 16 keeps the causal mask (s²
# bytes) under 1.3% of the attention terms.
SHAPE = dict(seq_len=64, micro_batch=4, hidden=128, n_heads=16)
LAYERS = 2
DROPOUT = 0.1
RECOMPUTE = ("none", "selective", "full")
TPS = (1, 2, 4)
WORLD = 4


def formula_bytes(recompute: str, t: int, sp: bool, *, s: int, b: int, h: int, a: int, elem: int = 2,
                  mask_bytes: int = 1) -> float:
    """Korthikanti et al.'s bytes per layer on one tensor-parallel rank, with `elem`-byte activations and
    `mask_bytes`-byte dropout masks (the paper: 2 and 1, giving its 34 and 5)."""
    sbh = s * b * h
    if recompute == "full":
        return elem * sbh / (t if sp else 1)
    replicated = 2 * elem + 2 * elem + 2 * mask_bytes  # 2 LayerNorm inputs, QKV and fc1 inputs, 2 dropout masks
    split = 12 * elem  # Q, K, V, output-projection input, GeLU input (4), fc2 input (4)
    per_sbh = (replicated + split) / t if sp else replicated + split / t
    scores = (2 * elem + mask_bytes) * a * s * s * b / t if recompute == "none" else 0.0
    return per_sbh * sbh + scores


def saved_bytes(run, exclude: list) -> int:
    """Bytes of the distinct storages autograd saves while `run()` executes, those of `exclude` (parameters)
    left out."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in exclude}
    kept = []

    def pack(t):
        kept.append(t)  # alive until the end: no storage is freed and its address reused meanwhile
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    storages = {}
    for t in kept:
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.nbytes() > 0:
            storages[st.data_ptr()] = st.nbytes()
    del out
    return sum(storages.values())


def measure(t: int, recompute: str, sp: bool, dtype_name: str = "bfloat16") -> float:
    """Saved bytes per layer of a middle chunk on this process's tensor-parallel rank (a process group of
    world WORLD is running; t·(WORLD/t) = WORLD)."""
    import torch

    from mlplat.config import KernelsConfig, ModelConfig
    from mlplat.model.decoder import DecoderChunk
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.parallel.random import STAGE_RNG, RNGTracker, seed_model_parallel

    dtype = getattr(torch, dtype_name)
    s, b, h, a = SHAPE["seq_len"], SHAPE["micro_batch"], SHAPE["hidden"], SHAPE["n_heads"]
    grid = ParallelGrid(tp=t, pp=1, dp=WORLD // t) if torch.distributed.is_initialized() else ParallelGrid()
    cfg = ModelConfig(n_layers=3 * LAYERS, hidden=h, n_heads=a, seq_len=s, vocab_size=256, dropout=DROPOUT)
    tracker = RNGTracker()
    seed_model_parallel(0, grid, tracker)
    chunk = DecoderChunk(cfg, grid, 1, 3, kernels=KernelsConfig(attention="math", recompute=recompute),
                        tracker=tracker, dtype=dtype, sequence_parallel=sp)  # the middle of three chunks
    chunk.train()
    x = torch.randn(b, s // t if sp and t > 1 else s, h, dtype=dtype, requires_grad=True)

    def run():
        with tracker.fork(STAGE_RNG):
            return chunk(x)

    return saved_bytes(run, list(chunk.parameters())) / LAYERS


def _worker(rank: int, world_size: int, dtype_name: str) -> dict:
    import torch.distributed as dist

    out = {}
    for t in TPS:
        for sp in ((False, True) if t > 1 else (False,)):
            for recompute in RECOMPUTE:
                out[(t, sp, recompute)] = measure(t, recompute, sp, dtype_name)
                dist.barrier()
    return out


def table(measured: dict) -> tuple[list[dict], str]:
    """Rows (t, sp, recompute, measured, the paper's formula, the CPU's formula, ratios) and their markdown."""
    s, b, h, a = SHAPE["seq_len"], SHAPE["micro_batch"], SHAPE["hidden"], SHAPE["n_heads"]
    rows = []
    for (t, sp, recompute), got in sorted(measured.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                             RECOMPUTE.index(kv[0][2]))):
        paper = formula_bytes(recompute, t, sp, s=s, b=b, h=h, a=a)
        cpu = formula_bytes(recompute, t, sp, s=s, b=b, h=h, a=a, mask_bytes=2)
        rows.append(dict(t=t, sp=sp, recompute=recompute, measured=got, paper=paper, cpu=cpu,
                         vs_paper=got / paper, vs_cpu=got / cpu))
    lines = ["| t | sequence parallel | recompute | measured (KiB) | paper, 1-byte masks (KiB) | measured / paper "
             "| CPU, 2-byte masks (KiB) | measured / CPU |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['t']} | {'on' if r['sp'] else 'off'} | {r['recompute']} | {r['measured'] / 1024:.1f} | "
                     f"{r['paper'] / 1024:.1f} | {r['vs_paper']:.3f} | {r['cpu'] / 1024:.1f} | {r['vs_cpu']:.3f} |")
    return rows, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results.md"), help="results file ('' = do not write)")
    args = parser.parse_args(argv)
    from tests.dist import run_distributed

    start = time.perf_counter()
    measured = run_distributed(_worker, WORLD, "bfloat16", timeout=600)[0]  # tp rank 0 (ranks of a group agree)
    rows, text = table(measured)
    print(text)
    worst = max(abs(r["vs_cpu"] - 1) for r in rows)
    print(f"\nworst |measured / CPU formula - 1| = {worst:.2%} ({time.perf_counter() - start:.0f} s)")
    if args.out:
        Path(args.out).write_text(RESULTS.format(shape=", ".join(f"{k}={v}" for k, v in SHAPE.items()),
                                                 layers=LAYERS, table=text, worst=f"{worst:.2%}"))
        print(f"written to {args.out}")
    return 0


RESULTS = """# Activation memory per transformer layer: measured vs Korthikanti et al. 2022

Written by `python experiments/activation_memory/measure.py` (see its docstring for the method).
Shape: {shape}; {layers} layers in a middle chunk; dropout 0.1; bfloat16; attention `math`,
unfused; one tensor-parallel rank's bytes per layer per micro-batch.

{table}

Worst deviation from the CPU column: {worst}.

- *paper*: Korthikanti et al.'s Table 2 with their byte sizes: sbh·(10 + 24/t + 5as/(ht)) under tensor
  parallelism, sbh·(34/t + 5as/(ht)) with sequence parallelism too; selective recomputation drops the 5as/h term;
  full recomputation keeps the layer input, 2sbh (2sbh/t with sequence parallelism).
- *CPU*: the same count with the dropout masks as PyTorch keeps them on a CPU, a tensor of the activation's dtype
  (2 bytes) rather than the 1-byte mask of the paper's fused kernels: 36 instead of 34, 6 instead of 5. This is
  what mlplat saves, up to the LayerNorms' mean and 1/std (8 bytes per token per layer, 0.2% here) and, without
  recomputation, the causal mask that masked_fill keeps (s² bytes per layer, 0.2-0.6% here).
- Sequence parallelism divides everything by t: at t = 4 the none/selective rows keep 1/t of the
  t = 1 bytes, where tensor parallelism alone keeps 10·sbh whatever t.
- The planner's memory model (`mlplat/perf/memory.py`, `layer_activation_bytes`) uses the paper's columns.
"""

if __name__ == "__main__":
    raise SystemExit(main())
