"""The mixture-of-experts layer (`model.moe.*`, docs/moe.md): a router sends each token to k of E expert MLPs, whose
outputs are summed with the router's gates (Shazeer et al., 2017; Switch, Fedus et al., 2021; GShard, Lepikhin et
al., 2020).

One MoE layer, on the tokens x [N, h] of a micro-batch:

- the router, in float32 or wider: logits = x·Wᵣᵀ [N, E]; `softmax` scores (Mixtral, Qwen) or `sigmoid` scores
  (DeepSeek-V3, GLM-4.5). The k experts are the k largest scores, plus the expert bias where the layer has one
  (`expert_bias`, DeepSeek-V3's correction bias, moved by aux-loss-free balancing under `bias_update_rate`: the bias
  chooses, it never weighs); with group-limited routing (`n_groups`, `topk_groups`) only among the experts of the
  token's best groups (`group_limited_topk`). The gates are the k chosen scores, renormalised to sum 1 with
  `norm_topk_prob`, times `routed_scaling_factor`;
- dispatch: the N·k (token, expert) assignments sorted by expert (stable: token order within an expert), the
  tokens gathered in that order; under `capacity_factor` c an expert keeps its first ceil(c·N·k/E) assignments in
  token order and drops the rest (a dropped assignment adds nothing; the token keeps its residual);
- the experts: fc1, the activation (the model's GeLU or SwiGLU) and fc2 of every expert as grouped GEMMs over the
  sorted tokens (`mlplat.parallel.linear.grouped_linear`: torch._grouped_mm where the device has a kernel for the
  operands, on bf16 casts of them under a 16-bit precision on CUDA, whose one kernel is bf16's, one GEMM per expert
  otherwise, e.g. float64: `mlplat.precision.grouped_gemm_path`; a GEMM recipe's products where one is set);
  The gate weighs the activation, fc2's input, rather than fc2's output (Megatron-Core's experts weigh by the
  routing probabilities the same way; fc2 is linear, so the sum is the same): the weighted activation keeps only
  fc1's output and the gates for the backward and recomputes the activation there (`_WeightedActivation`), so the
  expert's output is not kept for the gates' gradient. Per assignment the layer keeps fc1's input, its output and
  fc2's input (h + 3f for SwiGLU), as mlplat.perf.memory counts it (tests/perf/test_moe.py measures it);
- combine: each assignment's weighted output added into its token's row;
- shared experts (Qwen2-MoE, DeepSeek): a dense MLP every token goes through, its output added (times
  sigmoid(x·w) per token with `shared_gate`).

Two layouts of the experts (`parallel.etp`; mlplat.parallel.layout.dims):

- split over tp (etp = t, ep = 1): every expert's fc1 is split by rows and fc2 by columns over the t ranks, as the
  dense MLP's. The router runs on all of the micro-batch's tokens on every rank (identical routing), inside the
  region between f and g (Shoeybi et al.'s pair; with sequence parallelism the all-gather and the
  reduce-scatter): the experts' outputs are partial sums over the t ranks until the one g after the combine, so
  the gates' gradients, and from them the router weight's, are partial sums too;
- expert parallelism (etp = 1): E/ep whole experts per rank; each rank routes its own tokens (its shard of the
  sequence: the one sequence parallelism gives it, else its 1/t of the sequence every tp rank holds, whose
  outputs are all-gathered after the combine), and the dispatcher (mlplat.parallel.dispatch) takes each kept
  assignment to its expert's rank and back. The router's gradient is again a partial sum over the tp ranks (their
  own tokens).

The router weight is tagged so the gradient buffer sums it over the tensor-parallel group after the backward, as
the sequence-parallel LayerNorms (`mlplat.parallel.sequence`).

The balancing losses (per MoE layer, over the micro-batch's tokens; the model's loss is the mean over micro-batches
plus the sum over layers of these means; `balancing_loss` gives each rank routing part of a micro-batch its share):
  aux = E/(N·k) · Σₑ countₑ · mean_tokens(pₑ)   (Switch/GShard; 1 at perfect balance; p the router's probabilities,
                                                 the sigmoid scores normalised per token)
  seq = mean over the b sequences of the same over each sequence's s tokens (DeepSeek-V3's sequence-wise loss)
  z   = mean_tokens(logsumexp(logits)²)        (ST-MoE's router z-loss)
`expert_counts` and `balance_loss` compute aux and seq over any partition of the tokens into sets (the micro-batch:
one set; its sequences: b sets) from counts and probability sums that may be partial: a caller holding only some of
a set's tokens passes counts already summed over the ranks that hold the rest and the sets' full token counts, and
the per-rank losses then add up to the loss.
They do not travel to the last stage: `_AuxLossGrad` adds coeff·(their gradient) into the backward at the layer's
output, scaled like the language-model loss (1/m per micro-batch and the loss scale; `set_aux_loss_scale`), and
data-parallel replicas average them with every other gradient. So the gradient equals one process's under every
layout whose micro-batches are one process's micro-batches.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from mlplat.config import KernelsConfig, ModelConfig
from mlplat.parallel.dispatch import build_dispatcher, count
from mlplat.parallel.fp8 import WeightCasts
from mlplat.parallel.fp8_experts import GroupedFp8Gemm
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.linear import grouped_linear
from mlplat.parallel.mappings import (
    all_gather_from_sequence_parallel,
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
)
from mlplat.parallel.sequence import mark_sequence_parallel_replicated
from mlplat.parallel.tensor import Matrices, RowBlock, _TensorParallelModule
from mlplat.specs import routers


def group_limited_topk(choice: Tensor, top_k: int, n_groups: int, topk_groups: int,
                       group_score: Callable[[Tensor], Tensor]) -> Tensor:
    """The k experts [N, k] of the largest `choice` [N, E] among the experts of each token's `topk_groups` best groups
    (DeepSeek-V3's group-limited routing; n_groups=1: all). The E experts form n_groups groups of consecutive
    indices, each scored by the router's `group_score` (`mlplat.specs.routers`)."""
    if n_groups == 1:
        return choice.topk(top_k, dim=-1).indices
    n, e = choice.shape
    groups = choice.view(n, n_groups, e // n_groups)
    best = group_score(groups).topk(topk_groups, dim=-1).indices
    eligible = torch.zeros(n, n_groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    masked = groups.masked_fill(~eligible.unsqueeze(-1), float("-inf")).view(n, e)
    return masked.topk(top_k, dim=-1).indices


def expert_counts(chosen: Tensor, token_set: Tensor, n_sets: int, num_experts: int) -> Tensor:
    """Assignments [n_sets, E] of these tokens' `chosen` experts [N, k] per token set (`token_set` [N]: each token's
    set in [0, n_sets)), in float64 (exact). A caller with a slice of the sets' tokens all-reduces them."""
    flat = token_set.repeat_interleave(chosen.shape[1]) * num_experts + chosen.reshape(-1)
    return count(flat, n_sets * num_experts).view(n_sets, num_experts).to(torch.float64)


def balance_loss(probs: Tensor, token_set: Tensor, counts: Tensor, set_tokens: int, top_k: int) -> Tensor:
    """mean over the sets g of E/(k·T)·Σₑ counts[g, e]·P[g, e], P[g, e] = Σ_{t in g} probs[t, e] / T: the Switch/GShard
    balancing loss of each token set of T tokens (1 at perfect balance, E when one expert takes all), averaged.

    probs [N, E] and token_set [N] are the tokens held here; counts [n_sets, E] (expert_counts) and set_tokens T
    are the sets' whole: over a slice of each set's tokens, the losses of the slices add up to the loss."""
    n_sets, e = counts.shape
    prob_sums = probs.new_zeros(n_sets, e).index_add(0, token_set, probs)
    return e / (top_k * set_tokens * set_tokens * n_sets) * (counts.to(probs.dtype) * prob_sums).sum()


class _AuxLossGrad(torch.autograd.Function):
    """Identity on the layer's output; in backward it also starts the balancing loss's gradient, d(aux) = scale, so
    that loss reaches the router without being carried to the last pipeline stage."""

    @staticmethod
    def forward(ctx, out: Tensor, aux: Tensor, scale: float):
        ctx.scale, ctx.aux_dtype = scale, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


class _RouterLinear(torch.autograd.Function):
    """x·Wᵀ computed in `dtype` (float32 or wider), keeping x in its own dtype for the backward rather than its
    float32 copy (2h bytes a token in bf16, not 4h)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.to(dtype), weight.to(dtype))

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        dx = grad @ weight.to(grad.dtype) if ctx.needs_input_grad[0] else None
        dw = grad.t() @ x.to(grad.dtype) if ctx.needs_input_grad[1] else None
        return (None if dx is None else dx.to(x.dtype)), (None if dw is None else dw.to(weight.dtype)), None


class _WeightedActivation(torch.autograd.Function):
    """act(hidden) · gate per row, keeping only hidden and gate for the backward, which recomputes act: an expert's
    SiLU(gate) is never kept, and its output is not needed for the gates' gradient (Σ_j act_j · d(fc2's input)_j).
    `approximate`: None for SwiGLU (hidden = [gate units | up units]), else F.gelu's for GeLU. The backward uses
    ATen's own activation derivatives, writes both halves' gradients into one buffer and reuses one other: no graph
    rebuilt, no halves concatenated, no fresh buffer per product (on CPUs each costs its page faults)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, gate: Tensor, approximate: str | None) -> Tensor:
        ctx.approximate = approximate
        ctx.save_for_backward(hidden, gate)
        if approximate is None:
            a, up = hidden.chunk(2, dim=-1)
            return F.silu(a).mul_(up).mul_(gate.unsqueeze(1))
        return F.gelu(hidden, approximate=approximate).mul_(gate.unsqueeze(1))

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, gate = ctx.saved_tensors
        gate = gate.unsqueeze(1)
        if ctx.approximate is not None:
            act = F.gelu(hidden, approximate=ctx.approximate)
            d_gate = torch.linalg.vecdot(grad, act)
            d_act = torch.mul(grad, gate, out=act)  # act's buffer reused: fresh large buffers cost page faults
            return torch.ops.aten.gelu_backward(d_act, hidden, approximate=ctx.approximate), d_gate, None
        a, up = hidden.chunk(2, dim=-1)
        d_hidden = torch.empty_like(hidden)
        d_a, d_up = d_hidden.chunk(2, dim=-1)
        work = F.silu(a).mul_(grad)  # d(out)·SiLU(a); the one other buffer, reused below
        d_gate = torch.linalg.vecdot(work, up)
        torch.mul(work, gate, out=d_up)
        torch.mul(grad, up, out=work).mul_(gate)  # d(SiLU(a))
        torch.ops.aten.silu_backward.grad_input(work, a, grad_input=d_a)
        return d_hidden, d_gate, None


class ExpertWeights(_TensorParallelModule):
    """A rank's experts' matrices as one weight (its products: `mlplat.parallel.linear.grouped_linear` through `gemm`,
    None: the dense grouped GEMM): each expert's [out, in], as nn.Linear and transformers' fused
    experts hold it, the experts one after the other in the full [E·out, in] tensor, so initialisation and
    checkpoints see the full tensor whatever the layout. SwiGLU's fc1 is `parts` = 2: each expert's gate rows,
    then its up rows (transformers' gate_up_proj), so the activation reads two contiguous halves.

    - split over tp (etp = t), 1/t of each expert's width on each rank: fc1 (`split_out`) by rows, each part's
      units [r·f/t, (r + 1)·f/t) on tp rank r, placed by `row_blocks`; fc2 by columns, its units, `partition_dim` 1;
    - split over ep (`expert_parallel`, etp = 1): E/ep whole experts, ep rank j holding experts [j·E/ep, (j + 1)·E/ep)
      (`row_blocks` by ep rank)."""

    gemm = None  # mlplat.parallel.linear.Gemm | None: a recipe's products, as a dense layer's

    def __init__(self, experts: int, out: int, inp: int, grid: ParallelGrid, parts: int = 1, split_out: bool = True,
                 device=None, dtype=None, expert_parallel: bool = False):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        if expert_parallel:
            n, rows, cols = experts // grid.ep, out, inp
            blocks = [[RowBlock(e * out, (j * n + e) * out, out) for e in range(n)] for j in range(grid.ep)]
            self.weight = nn.Parameter(torch.empty(n * rows, cols, **factory))
            self._set_partition_dims(blocks, expert_parallel=True, weight=0)
        elif split_out:
            n, width = experts, out // parts
            units = width // grid.tp
            rows, cols = parts * units, inp
            blocks = [[RowBlock(e * rows + q * units, e * out + q * width + r * units, units)
                       for e in range(n) for q in range(parts)] for r in range(grid.tp)]
            self.weight = nn.Parameter(torch.empty(n * rows, cols, **factory))
            self._set_partition_dims(blocks, weight=0)
        else:
            n, rows, cols = experts, out, inp // grid.tp
            self.weight = nn.Parameter(torch.empty(n * rows, cols, **factory))
            self._set_partition_dims(weight=1)
        self.experts, self.rows = n, rows
        # The dimension a tensor-parallel split of the experts cuts (etp = t): fc1's rows, fc2's columns
        self.split, self.expert_parallel = "out" if split_out else "in", expert_parallel
        # Each expert's matrices apart (Muon's): `out` rows per expert, its parts (gate, then up) one after the other.
        self._set_matrices(weight=Matrices(out, tuple(((q * out // parts, out // parts),) for q in range(parts))
                                           if parts > 1 else ()))

    def use_fp8(self, recipe: str, grid: ParallelGrid, casts: WeightCasts | None) -> None:
        """kernels.fp8=`recipe` on these experts (casts None: the dense grouped GEMM), the amax of a split expert
        all-reduced over the tensor-parallel group (etp = t)."""
        group = grid.tp_group if not self.expert_parallel and grid.tp > 1 else None
        self.gemm = None if casts is None else GroupedFp8Gemm(recipe, self.split, group, casts)

    def stacked(self) -> Tensor:
        """[this rank's experts, out (/t), in (/t)]."""
        return self.weight.view(self.experts, self.rows, -1)


class MoELayer(nn.Module):
    """The layer's MLP as a mixture of experts (the module docstring). Parameters (full-model names under
    `layers.<i>.mlp.`): router.weight [E, h]; experts.fc1.weight [E·f1, h] (each expert's [f1, h]; f1 = f, or 2f
    for SwiGLU: its gate rows, then its up rows); experts.fc2.weight [E·h, f] (each expert's down projection
    [h, f]); shared.* (a dense MLP) and shared_gate.weight [1, h] when configured (`ExpertWeights`)."""

    def __init__(self, cfg: ModelConfig, grid: ParallelGrid, kernels: KernelsConfig | None = None, device=None,
                 dtype=None, sequence_parallel: bool = False, approximate: str = "none",
                 shared: nn.Module | None = None):
        """`approximate`: F.gelu's, for model.mlp=gelu; `shared`: the shared experts' dense MLP (the decoder's
        ParallelMLP of width shared_experts·f), when model.moe.shared_experts > 0."""
        super().__init__()
        moe = cfg.moe
        self.grid, self.sequence_parallel = grid, sequence_parallel
        self.num_experts, self.top_k, self.routing = moe.num_experts, moe.top_k, routers.get(moe.router)
        self.norm_topk_prob, self.capacity_factor = moe.norm_topk_prob, moe.capacity_factor
        self.routed_scaling_factor = moe.routed_scaling_factor
        self.aux_loss_coeff, self.z_loss_coeff = moe.aux_loss_coeff, moe.z_loss_coeff
        self.seq_aux_loss_coeff, self.n_groups, self.topk_groups = moe.seq_aux_loss_coeff, moe.n_groups, moe.topk_groups
        self.bias_update_rate = moe.bias_update_rate
        # fc1 of two parts, gate | up: the experts' SwiGLU (the config gives the experts GeLU or SwiGLU alone)
        parts = cfg.mlp_entry.fc1_parts
        self.swiglu = parts == 2
        self.approximate = approximate
        # Expert parallelism's path (etp = 1: whole experts, each rank routing its own tokens) or the experts split
        # over tp (etp = t; ep = 1). At t = 1 and ep = 1 the two are one.
        self.expert_parallel = grid.etp == 1
        self.local_experts = self.num_experts // grid.ep if self.expert_parallel else self.num_experts
        # The registered dispatcher wherever there is an ep group: ep > 1, or one rank's own under singleton groups
        # (the GPU check meets NCCL's rules with it on one GPU); the permutation alone otherwise.
        group = grid.ep_group if self.expert_parallel else None
        self.dispatcher = build_dispatcher(moe.dispatcher, self.num_experts, self.capacity_factor, grid.ep,
                                           grid.ep_rank, group, grid.ep_nodes)
        self.dispatcher.fp8 = moe.fp8_dispatch  # every layout quantises at the dispatch, ep = 1 included
        f = cfg.expert_ffn
        factory = {"device": device, "dtype": dtype}
        self.router = nn.Linear(cfg.hidden, self.num_experts, bias=False, **factory)
        mark_sequence_parallel_replicated(self.router.weight)  # a partial gradient on each tp rank (docstring)
        self.experts = nn.Module()
        self.experts.fc1 = ExpertWeights(self.num_experts, parts * f, cfg.hidden, grid, parts,
                                         expert_parallel=self.expert_parallel, **factory)
        self.experts.fc2 = ExpertWeights(self.num_experts, cfg.hidden, f, grid, split_out=False,
                                         expert_parallel=self.expert_parallel, **factory)
        self.shared, self.shared_gate = shared, None
        if shared is not None:
            if moe.shared_gate:
                self.shared_gate = nn.Linear(cfg.hidden, 1, bias=False, **factory)
                if sequence_parallel:  # applied to this rank's tokens only
                    mark_sequence_parallel_replicated(self.shared_gate.weight)
        # The correction bias: chooses, never weighs; moved after each step under aux-loss-free balancing
        # (`update_biases`). Not a parameter: a checkpoint saves it by name (`expert_biases`).
        self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float64, device=device)
                             if moe.has_expert_bias else None, persistent=False)
        self.aux_grad_scale = 1.0  # the loss's scale per micro-batch (1/m · loss scale): `set_aux_loss_scale`
        self.reset_stats()
        self.set_kernels(kernels or KernelsConfig())

    def _apply(self, fn, recurse=True):
        """As nn.Module's, but the expert bias stays float64 whatever the weights' dtype: its steps (bias_update_rate,
        e.g. 0.001) would round away in bf16 or drift in float32."""
        out = super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float64:
            self.expert_bias = self.expert_bias.to(torch.float64)
        return out

    def set_kernels(self, kernels: KernelsConfig) -> None:
        self.fused = kernels.fused  # the layer then takes (output, bias): there is no bias to hand over
        if self.shared is not None:
            self.shared.set_kernels(replace(kernels, fused=False))  # its output is added here, not returned

    def reset_stats(self) -> None:
        """Forget the step's statistics: the balancing loss summed over micro-batches, their count, this rank's
        [2, E] counts of each expert's assignments and of those kept (`_count`), and their sums over the step's
        tokens (`step_loads`)."""
        self.aux_sum, self.micro_batches, self.load_counts, self.loads = 0.0, 0, None, None

    # -- routing ---------------------------------------------------------------------------------------------
    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(chosen experts [N, k], their gates [N, k], the router's probabilities [N, E], logits [N, E]) of tokens
        x [N, h], in float32 or x's dtype if wider."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):  # autocast would run it in bf16/fp16
            logits = _RouterLinear.apply(x, self.router.weight, dtype)
        router = self.routing
        scores, probs = router.scores(logits)
        choice = scores if self.expert_bias is None else scores + self.expert_bias.to(dtype)
        chosen = group_limited_topk(choice, self.top_k, self.n_groups, self.topk_groups, router.group_score)
        gates = scores.gather(1, chosen)
        if self.norm_topk_prob:
            gates = gates / gates.sum(-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            gates = gates * self.routed_scaling_factor
        return chosen, gates, probs, logits

    def micro_batch_groups(self) -> list:
        """The groups over which a micro-batch's tokens are split among the ranks routing them: cp, and tp on the
        expert-parallel path (each tp rank routes its own shard)."""
        grid = self.grid
        return [g for g in ((grid.tp_group if self.expert_parallel else None), grid.cp_group) if g is not None]

    def balancing_loss(self, chosen: Tensor, probs: Tensor, logits: Tensor, batch: int) -> Tensor | None:
        """This rank's share of aux_loss_coeff·aux + seq_aux_loss_coeff·seq + z_loss_coeff·z over the micro-batch of
        `batch` sequences (the module docstring), or None when all are 0. This rank's tokens are a part of each
        sequence, sequence by sequence; each token set's counts (the micro-batch's, each sequence's) are summed over
        the ranks routing the micro-batch in one all-reduce per group, the sums over tokens are this rank's, so the
        shares over those ranks add up to the micro-batch's losses (a split over tp ranks routing the same tokens
        divides them by t). Times c, as each cp rank's language-model loss."""
        grid = self.grid
        split = (grid.tp if self.expert_parallel else 1) * grid.cp  # the ranks routing one micro-batch
        n, e = probs.shape
        sets = [(coeff, n_sets) for coeff, n_sets in ((self.aux_loss_coeff, 1), (self.seq_aux_loss_coeff, batch))
                if coeff]
        token_sets = [torch.arange(n, device=probs.device) // (n // n_sets) for _, n_sets in sets]
        counts = [expert_counts(chosen, ts, n_sets, e) for ts, (_, n_sets) in zip(token_sets, sets)]
        if counts and self.micro_batch_groups():
            flat = torch.cat([c.reshape(-1) for c in counts])
            for group in self.micro_batch_groups():
                dist.all_reduce(flat, group=group)
            counts = [c.view_as(old) for c, old in zip(flat.split([c.numel() for c in counts]), counts)]
        terms = [coeff * balance_loss(probs, ts, c, n // n_sets * split, self.top_k)
                 for (coeff, n_sets), ts, c in zip(sets, token_sets, counts)]
        if self.z_loss_coeff:
            terms.append(self.z_loss_coeff * torch.logsumexp(logits, -1).square().sum() / (n * split))
        if not terms:
            return None
        return sum(terms) * (grid.cp / (1 if self.expert_parallel else grid.tp))

    # -- the experts -----------------------------------------------------------------------------------------
    def experts_forward(self, x: Tensor, gate: Tensor, counts: Tensor) -> Tensor:
        """The experts on rows x [M, h] sorted by expert (`counts` per expert), each row weighted by its `gate` [M]:
        [M, h], this rank's partial sum."""
        fc1, fc2 = self.experts.fc1, self.experts.fc2
        # SwiGLU: its gate units, then its up units, two contiguous halves
        hidden = grouped_linear(x, fc1.stacked().to(x.dtype), counts, fc1.gemm)  # [E, f1/t, h]
        act = _WeightedActivation.apply(hidden, gate.to(hidden.dtype), None if self.swiglu else self.approximate)
        return grouped_linear(act, fc2.stacked().to(x.dtype), counts, fc2.gemm)  # [E, h, f/t]

    def forward(self, x: Tensor):
        """x: [b, s, h] (or this rank's [b, s/t, h] shard with sequence parallelism); the same shape out."""
        grid = self.grid
        if self.expert_parallel:  # each rank routes its own shard of the sequence
            local = x if self.sequence_parallel else scatter_to_sequence_parallel(x, grid)
        elif self.sequence_parallel:  # every tp rank routes the whole sequence to its slices of the experts
            local = all_gather_from_sequence_parallel(x, grid)
        else:
            local = copy_to_tensor_parallel(x, grid)
        b, s, h = local.shape
        tokens = local.reshape(b * s, h)
        chosen, gates, probs, logits = self.route(tokens)
        dispatched = self.dispatcher.dispatch(tokens, chosen, gates)
        out = self.experts_forward(dispatched.rows, dispatched.gates, dispatched.counts)
        combined = self.dispatcher.combine(out, dispatched.handle)
        combined = combined.view(b, s, h)
        if self.expert_parallel:
            y = combined if self.sequence_parallel else gather_from_sequence_parallel(combined, grid)
        elif self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(combined, grid)
        else:
            y = reduce_from_tensor_parallel(combined, grid)
        if self.training and torch.is_grad_enabled():
            self._count(dispatched.assigned, dispatched.kept)
            loss = self.balancing_loss(chosen, probs, logits, batch=b)
            if loss is not None:
                self.aux_sum = self.aux_sum + loss.detach()  # a device tensor: no host sync per layer
                y = _AuxLossGrad.apply(y, loss, self.aux_grad_scale)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(x))
            y = y + shared
        return (y, None) if self.fused else y

    def _count(self, assigned: Tensor, kept: Tensor) -> None:
        """Add a micro-batch's assignments per expert and those kept (`dispatch`'s two counts: fewer kept under
        capacity)."""
        self.micro_batches += 1
        counts = torch.stack([assigned, kept.to(assigned.dtype)]).to(torch.float64)  # exact to 2^53 tokens
        self.load_counts = counts if self.load_counts is None else self.load_counts + counts


@torch.no_grad()
def update_biases(layers: list[MoELayer], grid: ParallelGrid) -> None:
    """Aux-loss-free balancing (Wang et al., 2024; DeepSeek-V3): after a step, each expert's bias moves by
    bias_update_rate towards balance, by the sign of (mean load - its load), the loads counted over the step's
    global batch (`step_loads`: its assignments, before any capacity drop)."""
    step_loads(layers, grid)
    for layer in layers:
        if layer.bias_update_rate > 0 and layer.loads is not None:
            mine = layer.loads[0].to(layer.expert_bias.device)
            layer.expert_bias += layer.bias_update_rate * torch.sign(mine.mean() - mine)
            layer.load_counts = layer.loads = None  # moved once per step


def moe_layers(chunks) -> list[MoELayer]:
    """The MoE layers of these chunks (model chunks, or any modules)."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(layers: list[MoELayer], scale: float) -> None:
    """The balancing losses' gradient scale for the next pass: the language-model loss's per micro-batch (1/m,
    times the loss scale under fp16); every layer's step statistics start over."""
    for layer in layers:
        layer.aux_grad_scale = scale
        layer.reset_stats()


def aux_loss_of(layers: list[MoELayer]) -> Tensor | float:
    """This rank's share of the step's balancing loss: over its MoE layers, the sum of each layer's mean over the
    micro-batches of the pass (a tensor on the layers' device, 0.0 without any)."""
    return sum((layer.aux_sum / layer.micro_batches for layer in layers if layer.micro_batches), 0.0)


# -- the step's expert loads (balancing, and what a run logs of it) -------------------------------------------
def _token_groups(grid: ParallelGrid) -> list:
    """The process groups over which a layer's ranks routed different tokens of the step's global batch: its
    counts summed over each of them, one after the other, are the global batch's. The experts' ep and edp groups
    of the stage: together they span its t·c·d ranks, and where the experts are split over tp (etp = t), the etp
    ranks left out route the same tokens (the router sees the micro-batch whole)."""
    return [g for g in (grid.ep_group, grid.edp_group) if g is not None]


@torch.no_grad()
def step_loads(layers: list[MoELayer], grid: ParallelGrid) -> None:
    """Each layer's counts over the step's global batch, in `layer.loads` [2, E] (each expert's assignments, and
    those it kept), the same on every rank of the layer: this rank's counts of all its layers summed in one
    all-reduce per token group (`_token_groups`). Once per step: the layers summed already are left alone, so the
    balancing update and the logged figures share one reduction."""
    pending = [layer for layer in layers if layer.load_counts is not None and layer.loads is None]
    if not pending:
        return
    counts = torch.cat([layer.load_counts.reshape(-1) for layer in pending])
    for group in _token_groups(grid):
        dist.all_reduce(counts, group=group)
    for layer, summed in zip(pending, counts.split([layer.load_counts.numel() for layer in pending])):
        layer.loads = summed.view_as(layer.load_counts)


LOAD_FIGURES = ("min", "max", "dropped")  # `load_figures`' columns


def load_figures(layers: list[MoELayer]) -> Tensor:
    """[layers, 3] on the layers' device, from `step_loads`: the least and the most loaded expert's kept
    assignments as a share of the mean over the experts (1 = balanced), and the fraction of the assignments
    dropped (capacity_factor; 0 when dropless). Ratios of the global batch's integer counts: the same bits under
    every layout."""
    loads = torch.stack([layer.loads for layer in layers])  # [layers, 2, E]: a few kernels, however many layers
    assigned, kept = loads.sum(-1).unbind(1)  # integers: every order of summation gives the same sums
    share = loads[:, 1] / (kept / loads.shape[-1]).unsqueeze(1)
    return torch.stack([share.amin(-1), share.amax(-1), (assigned - kept) / assigned], dim=1)


def expert_biases(chunks) -> dict[str, Tensor]:
    """Full-model name (`layers.<i>.mlp.expert_bias`) -> the expert bias of each MoE layer of these chunks that
    has one (model.moe.has_expert_bias): what a checkpoint saves of it and init_from reads into it (DeepSeek-V3's and
    GLM-4.5's e_score_correction_bias), the same on every rank holding the layer."""
    return {f"{name}.expert_bias": module.expert_bias for chunk in chunks for name, module in chunk.named_modules()
            if isinstance(module, MoELayer) and module.expert_bias is not None}
