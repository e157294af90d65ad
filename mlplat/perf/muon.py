"""Muon's optimizer step in the cost models (`optim.name=muon`, `mlplat.optim.muon`): what it adds to AdamW's
memory-bound update, per step on one rank.

- Newton–Schulz. Each hidden matrix (as the layers declare them: the query, key and value projections apart, SwiGLU's
  gate and up apart, each expert's; `hidden_parameters`) is orthogonalised by `ns_steps` iterations of the quintic on
  its wide orientation A ≤ B: X·Xᵀ (2·A²·B FLOPs), its square (2·A³) and (b·G + c·G²)·X (2·A²·B), so
  ns_steps·(4·A²·B + 2·A³) per matrix (`mlplat.optim.ns_cost.ns_flops`; the normalisation and the element-wise terms,
  O(A·B), left out).
  In bf16 on GPUs as its authors run it, in the parameter's dtype under 64-true and on CPUs.
- Who orthogonalises what. Every tensor-parallel rank orthogonalises the whole of each matrix it holds a shard of
  (redundantly: the iteration is not distributed), an expert-parallel rank its own experts. With the distributed
  optimizer each data-parallel rank owns whole parameters, dealt by their Newton–Schulz FLOPs (costliest first to the
  least loaded rank, `mlplat.optim.buckets.deal`, as `mlplat.optim.buffers` deals a bucket's; here over the stage's
  parameters at once) and the step waits for the rank with the most Newton–Schulz work (`owned_work`: the max over
  ranks).
- The gather. A matrix split over tp (etp for experts) has its update all-gathered over the group before the
  iteration, its full size in the main gradients' dtype; each rank then slices its own shard of the result (no
  collective back).
- The AdamW part (embeddings, head, norms, biases, the router) and Muon's momentum update are memory traffic, left
  in the models' per-parameter optimizer bytes.
Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mlplat.optim.buckets import deal
from mlplat.optim.ns_cost import ns_flops
from mlplat.perf.flops import ModelDims
from mlplat.perf.memory import Layout
from mlplat.precision import precision_of

# aten ops of one iteration (the CPU model's per-op cost): X·Xᵀ, G·G, b·G, c·G², their sum, that by X, a·X, the sum
NS_OPS = 8


def ns_gemms(rows: int, cols: int) -> tuple[tuple[int, int, int], ...]:
    """One iteration's matmuls as (M, N, K) of [M,K]x[K,N]: X·Xᵀ, G·G, (b·G + c·G²)·X, X on its wide orientation."""
    a, b = sorted((rows, cols))
    return (a, a, b), (a, a, a), (a, b, a)


@dataclass(frozen=True)
class HiddenParameter:
    """One parameter Muon steps, as a rank holds it: its logical matrices (rows, cols) whole, the elements the rank
    holds (its shard), and the group its update is gathered over (1: whole on the rank)."""

    matrices: tuple[tuple[int, int], ...]
    numel: int  # held by the rank
    gathered_over: int  # t for a split matrix, etp for a split expert, 1 for a whole one
    expert: bool = False


def _gemm_parameters(dims: ModelDims, gemms, w, tp: int) -> list[HiddenParameter]:
    out = []
    for g in gemms:
        rows, cols = g.out(dims.hidden, w), g.inp(dims.hidden, w)
        if not rows or not cols:
            continue
        if g.name == "qkv":  # the query, key and value projections
            parts = (w.q, w.kv, w.kv)
        else:
            parts = (rows // g.parts,) * g.parts
        split = g.split != "replicated"
        out.append(HiddenParameter(tuple((r, cols) for r in parts), rows * cols // (tp if split else 1),
                                   tp if split else 1))
    return out


def hidden_parameters(dims: ModelDims, layer: int, tp: int, ep: int = 1, etp: int = 1) -> list[HiddenParameter]:
    """The parameters of layer `layer` that Muon steps on a rank: the attention's GEMMs and the MLP's (an MoE
    layer: its E/ep routed experts, stacked as one parameter per GEMM, and its shared experts' MLP). The word
    embedding, the output layer, norms, biases and the router are AdamW's."""
    out = _gemm_parameters(dims, dims.attention_entry.gemms_of(dims), dims.heads, tp)
    if not dims.is_moe_layer(layer):
        return out + _gemm_parameters(dims, dims.mlp_entry.gemms, dims.ffn, tp)
    moe, f, h = dims.moe, dims.expert_ffn, dims.hidden
    if moe.shared_experts:
        out += _gemm_parameters(dims, dims.mlp_entry.gemms, moe.shared_experts * f, tp)
    local = moe.num_experts // ep
    for g in dims.mlp_entry.gemms:  # each expert's fc1 (its parts) and fc2, E/ep experts stacked
        rows, cols = g.out(h, f), g.inp(h, f)
        one = ((rows // g.parts, cols),) * g.parts
        out.append(HiddenParameter(one * local, local * rows * cols // etp, etp, expert=True))
    return out


def matrix_seconds(rows: int, cols: int, steps: int, gemm) -> float:
    """Seconds of Newton–Schulz on one matrix, `gemm(M, N, K)` the time of one matmul on the device."""
    return steps * sum(gemm(*mnk) for mnk in ns_gemms(rows, cols))


def owned_work(costs: list[float], work: list[tuple[float, ...]], bins: int) -> tuple[float, ...]:
    """The work of the busiest rank (its parts: the most in sum) when parameters are dealt to `bins` ranks whole by
    their `costs` (`mlplat.optim.buckets.deal`, the buffers' rule), each carrying its `work`."""
    parts = len(work[0]) if work else 0
    load = [[0.0] * parts for _ in range(max(1, bins))]
    for i, b in enumerate(deal(costs, bins)):
        load[b] = [x + y for x, y in zip(load[b], work[i])]
    return tuple(max(load, key=sum)) if parts else (0.0, 0.0)


def muon_step(dims: ModelDims, lay: Layout, shards: int, matrix: Callable[[int, int], float],
              gather: Callable[[float, int], float]) -> tuple[float, float]:
    """(Newton–Schulz seconds, gather seconds) of Muon's step on the busiest rank, `matrix(rows, cols)` the seconds
    of one matrix's iterations and `gather(bytes, ranks)` of an all-gather producing `bytes` on each rank: each
    pipeline rank's hidden parameters (its chunks' layers), a split one's update gathered whole in the main
    gradients' dtype; with the distributed optimizer (`shards` > 1) the dense parameters dealt whole over the
    shards and the experts' over edp (`owned_work`), the busiest shard of each counted (the worst case: one rank)."""
    update_bytes = precision_of(lay.precision).state_bytes[1]
    worst = (0.0, 0.0)
    for r in range(lay.pp):
        items: dict[bool, list] = {False: [], True: []}  # dense, experts
        for chunk in lay.pipeline.chunks_of(r):
            for layer in lay.pipeline.layers_of(chunk, dims.n_layers):
                for hp in hidden_parameters(dims, layer, lay.tp, lay.ep, lay.expert_tp):
                    ns = sum(matrix(a, b) for a, b in hp.matrices)
                    cost = sum(ns_flops(a, b, 1) for a, b in hp.matrices)  # what the buffers deal by
                    items[hp.expert].append((cost, (ns, gather(hp.numel * hp.gathered_over * update_bytes,
                                                                   hp.gathered_over))))
        total = (0.0, 0.0)
        for expert, held in items.items():
            bins = (lay.edp if expert else shards) if shards > 1 else 1
            ns, comm = owned_work([n for n, _ in held], [w for _, w in held], bins)
            total = (total[0] + ns, total[1] + comm)
        worst = max(worst, total, key=sum)
    return worst
