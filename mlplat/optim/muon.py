"""Muon for the hidden weight matrices, AdamW for the rest (`optim.name=muon`, `optim.muon.*`).

Muon (Jordan et al., 2024, "Muon: an optimizer for hidden layers in neural networks") keeps a momentum of each
matrix's gradient and steps along its orthogonalisation: U·Vᵀ of the (Nesterov) momentum's SVD U·S·Vᵀ, approximated
by a few Newton–Schulz iterations of a quintic (`newton_schulz`), scaled so that the update's size does not depend on
the matrix's shape (`update_scale`: Moonlight's, Liu et al., "Muon is Scalable for LLM Training", 2025, makes its
RMS AdamW's, so AdamW's learning rate and weight decay carry over). Everything that is not a hidden matrix -- the word
embedding, the output layer, norms, biases, the router -- is stepped by AdamW, as in both papers.

Which parameters are hidden matrices, and which logical matrices their rows hold, is declared by the layers
(`mlplat.parallel.tensor.Matrices`, the parameter's `matrices`): the fused QKV weight is three matrices (the query,
key and value projections, each gathered from every key/value group), SwiGLU's fc1 two (gate, up), a layer's stacked
experts two or one per expert. Orthogonalising the fused weight instead would be another optimizer.

Layouts. A matrix split over tensor parallelism is all-gathered over the tp group for the iteration (the full tensor,
key/value heads shared by several ranks included, `gather_full`), every rank orthogonalises all of its logical
matrices and keeps its own shard of the result. Gathering moves (t-1)/t of the matrix once; distributing the
iteration instead needs the t partial Gram matrices X·Xᵀ (min(A, B)² each) summed in every one of the ns_steps
iterations, more bytes for any near-square matrix. An expert-parallel rank holds whole experts and orthogonalises
them alone; pipeline stages hold whole parameters. With the distributed optimizer each data-parallel rank's shard holds
whole parameters (`Optimizer.whole_matrices`), and the rank that owns a matrix orthogonalises it; they are dealt by
their Newton–Schulz FLOPs (`step_work`), so that no rank waits on a share of the big matrices.

The state per parameter is AdamW's moments and Muon's momentum (`STATE`), in the gradient buffer's flat shards like
`MainParamsAdamW`'s, so a checkpoint saves each under the parameter's full-model name and reshards it like AdamW's.
Each parameter has all three (zeros where its optimizer does not use them): simple, at a third more state.

QK-clip (`optim.muon.qk_clip`, `mlplat.model.qk_clip`): the QKV weight and bias carry a factor per row
(`qk_clip_scale`, set before the step), which the step multiplies the updated main weights of the shard by, before
publishing them.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from mlplat.optim.buffers import ParamBuffers
from mlplat.optim.main_params import ADAMW_STATE, MainParamsOptimizer, adamw_
from mlplat.optim.ns_cost import ns_flops
from mlplat.parallel.tensor import (
    Matrices,
    full_shape_of,
    gather_full,
    is_expert,
    matrix_rows,
    partition_dim_of,
    shard_of,
    slice_owners,
)

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's (a, b, c): a·X + b·(XXᵀ)X + c·(XXᵀ)²X, Jordan's
MUON_STATE = ("momentum_buffer",)


def newton_schulz(g: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """The orthogonalisation of the 2-D `g` (≈ U·Vᵀ of its SVD; singular values pushed into about [0.7, 1.2]):
    `steps` iterations of the quintic from g over its Frobenius norm, on the wide orientation (fewer rows than columns:
    X·Xᵀ is the smaller Gram matrix). In bf16 on a GPU, as its authors run it; in g's dtype otherwise (float64 in the
    proofs)."""
    a, b, c = NS_COEFFICIENTS
    dtype = torch.bfloat16 if g.is_cuda and g.dtype != torch.float64 else g.dtype
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(g.dtype)


def update_scale(kind: str, rows: int, cols: int) -> float:
    """What the orthogonalised update of a [rows, cols] matrix is multiplied by: moonlight 0.2·√max(A, B) (the RMS of
    AdamW's update, ~0.2), spectral √max(1, A/B) (Jordan's: the same spectral norm per input dimension)."""
    if kind == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    if kind == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"optim.muon.update_scale={kind!r} is not one of moonlight, spectral")


def orthogonalise(full: torch.Tensor, matrices: Matrices, steps: int, scale: str) -> torch.Tensor:
    """Each logical matrix of `full` (rows laid out as `matrices` says) orthogonalised and scaled on its own."""
    blocks = matrix_rows(matrices, full.size(0))
    if len(blocks) == 1 and blocks[0].numel() == full.size(0):  # one matrix: no copies in and out
        return newton_schulz(full, steps) * update_scale(scale, *full.shape)
    out = torch.empty_like(full)
    for rows in blocks:
        rows = rows.to(full.device)
        block = full.index_select(0, rows)
        out.index_copy_(0, rows, newton_schulz(block, steps) * update_scale(scale, *block.shape))
    return out


def is_hidden_matrix(p: torch.Tensor) -> bool:
    """Stepped by Muon: a weight its layer declares a hidden matrix (`Matrices`)."""
    return getattr(p, "matrices", None) is not None


def _gathered(p: torch.Tensor, grid) -> bool:
    """Split over tp (not whole experts over ep): the full matrix is gathered for the iteration."""
    return partition_dim_of(p) is not None and len(slice_owners(p, grid)) > 1 and not is_expert(p)


def step_work(p: torch.Tensor, grid) -> float:
    """What stepping `p` costs this rank, which the distributed optimizer's shards are balanced by
    (`Optimizer.work`): a hidden matrix's Newton–Schulz FLOPs per iteration (`mlplat.optim.ns_cost.ns_flops`: every
    iteration count scales all matrices alike), each logical matrix whole as the iteration sees it (gathered over tp;
    an expert-parallel rank's own experts); AdamW's element-wise update one per element, far below any matrix's."""
    if not is_hidden_matrix(p):
        return float(p.numel())
    shape = full_shape_of(p, grid) if _gathered(p, grid) else p.shape
    cols = math.prod(shape[1:])
    return sum(ns_flops(rows.numel(), cols, 1) for rows in matrix_rows(p.matrices, shape[0]))


class MainParamsMuon(MainParamsOptimizer):
    """Muon on the groups flagged `muon`, AdamW on the others, over the gradient buffer's main weights. Each group has
    its lr and weight_decay; betas and eps are AdamW's, momentum, nesterov, ns_steps and update_scale Muon's."""

    STATE = MUON_STATE + ADAMW_STATE

    def __init__(self, main: ParamBuffers, param_groups: list[dict], *, betas: Sequence[float], eps: float,
                 momentum: float, nesterov: bool, ns_steps: int, update_scale: str):
        super().__init__(main, param_groups, dict(lr=0.0, weight_decay=0.0, muon=False, betas=tuple(betas), eps=eps,
                                                  momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                                  update_scale=update_scale))

    def bucket_update(self):
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}

        # Every tp rank lays its buckets out alike, so the ranks of a tp group gather the same matrices in the same
        # order.
        def update(b) -> None:
            for s in b.slots:
                x, y = max(s.start, b.lo), min(s.end, b.hi)
                if x >= y:  # another data-parallel rank's
                    continue
                group, p = group_of[id(s.param)], s.param
                w, g = b.main[x - b.lo:y - b.lo], b.grad[x - b.lo:y - b.lo]
                state = {k: b.state[k][x - b.lo:y - b.lo] for k in self.STATE}
                if group["muon"]:
                    if (x, y) != (s.start, s.end):
                        raise RuntimeError("Muon needs whole matrices in a shard (ParamBuffers(whole_params=True))")
                    self._muon(p, w.view_as(p), g.view_as(p), state["momentum_buffer"].view_as(p), group)
                else:
                    beta1, beta2 = group["betas"]
                    adamw_(w, g, state["exp_avg"], state["exp_avg_sq"], step=self.steps, lr=group["lr"],
                           beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
                scale = getattr(p, "qk_clip_scale", None)
                if scale is not None:  # QK-clip (`mlplat.model.qk_clip`): each row's factor, after the update
                    w.view_as(p).mul_(scale.to(w.dtype).view(-1, *(1,) * (p.dim() - 1)))
        return update

    def _muon(self, p, w: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, group: dict) -> None:
        """One Muon update of p's main weights `w` (this rank's tp shard) from its gradient and momentum `buf`."""
        mu, lr = group["momentum"], group["lr"]
        buf.mul_(mu).add_(grad)
        update = grad.add(buf, alpha=mu) if group["nesterov"] else buf
        grid = self.main.grid
        split = _gathered(p, grid)
        full = gather_full(p, grid, update) if split else update
        out = orthogonalise(full, p.matrices, group["ns_steps"], group["update_scale"])
        if group["weight_decay"]:
            w.mul_(1 - lr * group["weight_decay"])
        w.add_(shard_of(out, p, grid) if split else out, alpha=-lr)


def build_muon(optim_cfg, grads: ParamBuffers, groups: list[dict]) -> MainParamsMuon:
    """Muon over the hidden matrices of `groups` ([decay, no decay], `mlplat.optim.factory.build_optimizer`) with
    optim.muon's lr and weight decay, AdamW over the rest with optim's."""
    muon = optim_cfg.muon
    decay, no_decay = groups
    matrices = [p for p in decay["params"] if is_hidden_matrix(p)]
    rest = [p for p in decay["params"] if not is_hidden_matrix(p)]
    stray = [p for p in no_decay["params"] if is_hidden_matrix(p)]
    if stray:
        raise ValueError(f"{len(stray)} hidden matrices in the group without weight decay")
    torch_groups = [{"params": matrices, "muon": True, "lr": optim_cfg.lr if muon.lr is None else muon.lr,
                     "weight_decay": muon.weight_decay},
                    {"params": rest, "muon": False, "lr": optim_cfg.lr, "weight_decay": decay["weight_decay"]},
                    {"params": list(no_decay["params"]), "muon": False, "lr": optim_cfg.lr, "weight_decay": 0.0}]
    # All three groups on every rank, empty ones too: the learning-rate schedule's state (one per group, saved once)
    # must fit every rank's optimizer, e.g. a middle pipeline stage's, which holds no embedding or output layer.
    return MainParamsMuon(grads, torch_groups, betas=optim_cfg.betas, eps=optim_cfg.eps,
                          momentum=muon.momentum, nesterov=muon.nesterov, ns_steps=muon.ns_steps,
                          update_scale=muon.update_scale)
