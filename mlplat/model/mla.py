"""Multi-head latent attention (DeepSeek-V2 §2.1, DeepSeek-V3): model.attention=mla, its head shapes model.mla.*.

Keys and values come from one low-rank latent per token, c_kv = RMSNorm(kv_down(x))[:kv_lora_rank], up-projected per
head (kv_up: [k_nope | v] per head); queries from another, RMSNorm(q_down(x)), up-projected by q_up ([q_nope | q_rope]
per head), or without query compression (model.mla.q_lora_rank null, DeepSeek-V2-Lite) straight from x by `q`. Position
is carried by a decoupled rotary part: q_rope per head, and k_rope, the last qk_rope_head_dim channels of kv_down's
output, one head shared by every head. A head's query and key are [nope | rope] (nope + rope channels, the core's
1/√(nope + rope) scale), its value v_head_dim wide, and the output projection maps the heads' values back to h. Under
YaRN with mscale_all_dim every score is further multiplied by that magnitude correction squared
(`mlplat.model.rotary.softmax_factor`): applied to q, since the cores take their scale from q's width.

The modules are transformers' DeepseekV3Attention's row for row (q_a_proj/q_a_layernorm/q_b_proj or q_proj,
kv_a_proj_with_mqa/kv_a_layernorm/kv_b_proj, o_proj), so a checkpoint's tensors are copied, the rotary rows permuted
where the checkpoint rotates interleaved pairs (`mlplat.model.rotary`).

Tensor parallelism splits the heads: q_up (or q) and kv_up column-parallel, out row-parallel. The down-projections
and their norms are replicated. Their output, the latents [q latent | c_kv | k_rope], goes through one mapping to the
up-projections: without sequence parallelism f (identity forward; backward the gradient, which each rank computes for
its own heads only, summed over tp), so the down-projections' gradients are whole and equal on every rank; with it the
sequence all-gather (reduce-scatter backward), each rank applying the down-projections to its own sequence shard, so
their gradients are partial sums, summed over tp after the backward as the sequence-parallel norms' are.

Context parallelism: the ring carries the compressed latents [c_kv | rotated k_rope], each rank up-projecting every
block it receives (`mlplat.parallel.latent_ring`; docs/parallelism.md weighs it against the expanded keys and values,
on bytes).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from mlplat.config import KernelsConfig, ModelConfig
from mlplat.model.decoder import AttentionCore
from mlplat.model.rotary import Rotary, softmax_factor
from mlplat.parallel.context import Ring
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.latent_ring import latent_ring_attention
from mlplat.parallel.mappings import all_gather_from_sequence_parallel, copy_to_tensor_parallel
from mlplat.parallel.placement import TokenLayout
from mlplat.parallel.random import RNGTracker, checkpoint
from mlplat.parallel.sequence import mark_sequence_parallel_replicated
from mlplat.parallel.tensor import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear


class LatentAttention(AttentionCore):
    """The runtime of model.attention=mla (`mlplat.specs.attentions`), its GEMMs built as the entry declares them
    (module doc)."""

    def __init__(self, cfg: ModelConfig, grid: ParallelGrid, tracker: RNGTracker, kernels: KernelsConfig, backend: str,
                 device=None, dtype=None, sequence_parallel: bool = False, rotary: Rotary | None = None,
                 ring: Ring | None = None):
        super().__init__()
        self.ring, self.tracker, self.rotary, self.dropout = ring, tracker, rotary, cfg.dropout
        self.grid, self.sequence_parallel = grid, sequence_parallel
        self.spec = cfg.attention_entry
        w = self.shape = self.spec.shape(cfg)
        self.heads = cfg.n_heads // grid.tp
        # The model's index of each of this rank's heads (QK-clip's); every head has its own key (k_nope)
        self.head_ids = self.kv_head_ids = grid.tp_rank * self.heads + torch.arange(self.heads)
        self.factor = softmax_factor(cfg.rope_scaling)
        factory = {"device": device, "dtype": dtype}
        for gemm in self.spec.gemms_of(cfg):
            inp, out = gemm.inp(cfg.hidden, w), gemm.out(cfg.hidden, w)
            if gemm.split == "replicated":
                linear = ReplicatedLinear(inp, out, grid, bias=gemm.has_bias(cfg), **factory)
            elif gemm.split == "row":
                linear = RowParallelLinear(inp, out, grid, bias=gemm.has_bias(cfg), sequence_parallel=sequence_parallel,
                                           **factory)
            else:  # q reads x itself; the up-projections read the latents, mapped once for both (module doc)
                own = gemm.name == "q"
                linear = ColumnParallelLinear(inp, out, grid, bias=gemm.has_bias(cfg), mapped_input=not own,
                                              sequence_parallel=sequence_parallel and own, **factory)
            setattr(self, gemm.name, linear)
        self.q_norm = nn.RMSNorm(w.q_rank, eps=cfg.norm_eps, **factory) if w.q_rank else None
        self.kv_norm = nn.RMSNorm(w.kv_rank, eps=cfg.norm_eps, **factory)
        if sequence_parallel:  # applied to this rank's shard: partial gradients, summed over tp (module doc)
            downs = [self.kv_down, self.kv_norm] + ([self.q_down, self.q_norm] if w.q_rank else [])
            mark_sequence_parallel_replicated(*(p for m in downs for p in m.parameters()))
        self.set_kernels(kernels, backend)

    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(normed query latent or None, normed c_kv, k_rope) over the whole sequence, [b, s, ·], mapped for the
        up-projections by one all-gather (sequence parallelism) or one f."""
        w = self.shape
        c_kv, k_rope = self.kv_down(x).split([w.kv_rank, w.rope], dim=-1)
        parts = ([self.q_norm(self.q_down(x))] if w.q_rank else []) + [self.kv_norm(c_kv), k_rope]
        both = torch.cat(parts, dim=-1)
        both = (all_gather_from_sequence_parallel(both, self.grid) if self.sequence_parallel
                else copy_to_tensor_parallel(both, self.grid))
        q_latent, c_kv, k_rope = both.split([w.q_rank, w.kv_rank, w.rope], dim=-1)
        return (q_latent if w.q_rank else None), c_kv, k_rope

    def forward(self, x: torch.Tensor, layout: TokenLayout | None = None):
        """The attention sub-block's output; with kernels.fused the pair (output without bias, bias). Under selective
        recomputation the up-projections are recomputed in backward with the core (Megatron's MLA up-projection
        recomputation): of the attention only the latents are kept, and the output projection's input."""
        w = self.shape
        q_latent, c_kv, k_rope = self.latents(x)
        own_q = x if q_latent is None else None  # `q` reads x itself
        if self.selective and self.training and torch.is_grad_enabled():
            ctx = checkpoint(self.attention, self.tracker, own_q, q_latent, c_kv, k_rope, layout)
        else:
            ctx = self.attention(own_q, q_latent, c_kv, k_rope, layout)
        b, s = ctx.size(0), ctx.size(2)
        return self.out(ctx.transpose(1, 2).reshape(b, s, self.heads * w.v))

    def attention(self, x: torch.Tensor | None, q_latent: torch.Tensor | None, c_kv: torch.Tensor,
                  k_rope: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        """The core's output [b, heads, s, v] from the latents (x: the input, without query compression): the
        up-projections, the rotation, the core. Under context parallelism kv_up runs inside the ring on each block
        (`mlplat.parallel.latent_ring`; validation keeps dropout off under cp)."""
        w = self.shape
        q = self.q(x) if q_latent is None else self.q_up(q_latent)
        b, s = q.shape[:2]
        q_nope, q_rope = q.view(b, s, self.heads, w.d).transpose(1, 2).split([w.nope, w.rope], dim=-1)
        k_rope = k_rope.view(b, 1, s, w.rope)  # one head, shared by all
        if self.rotary is not None:
            q_rope, k_rope = (self.rotary(q_rope, k_rope, self.fused) if layout is None
                              else self.rotary(q_rope, k_rope, self.fused, layout.positions, layout.seq_len))
        q = torch.cat((q_nope, q_rope), dim=-1)
        if self.factor != 1.0:
            q = q * self.factor
        if layout is not None and layout.cp > 1:  # the ring carries the latents, up-projected per block
            return latent_ring_attention(q, c_kv, k_rope, self.kv_up.weight, w.nope, layout, self.ring, self.backend)
        kv = self.kv_up(c_kv).view(b, s, self.heads, w.nope + w.v).transpose(1, 2)
        k_nope, v = kv.split([w.nope, w.v], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(b, self.heads, s, w.rope)), dim=-1)
        return self._core(q, k, v, layout)
