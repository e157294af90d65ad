"""Ring attention for multi-head latent attention: the ring carries the compressed latent, not the keys and values.

Under context parallelism MLA's keys and values are functions of one latent per token, [c_kv | k_rope] (kv_lora_rank +
qk_rope_head_dim channels, the rotary part already rotated by the token's position), which every head's key and value
come from through the up-projection kv_up. The ring passes that latent round the cp group instead of the per-head
keys and values: kv_lora_rank + rope elements per token where the expanded form moves heads/t·(nope + rope + v)
(DeepSeek-V3: 576 against 40,960 at t = 1, 5,120 at t = 8; docs/parallelism.md weighs the two). Each rank
up-projects every block it receives with its own heads' rows of kv_up, k = [k_nope | k_rope broadcast], v, and runs the
block as `mlplat.parallel.context` does (the same hops, kernels, masks and log-sum-exp merge). Backward walks the ring
again: each block is up-projected anew, its dK and dV are taken back through the up-projection to the latent's
gradient (k_rope's summed over the heads), which travels with the block until it arrives at its owner, and this
rank's share of kv_up's weight gradient is summed over every block it saw. The extra cost is the up-projection of the
c - 1 arriving blocks, forward and backward.

The up-projection runs here in torch's own products (not the layer's `Gemm`: no FP8, and its weight gradient is not
deferred to a zero-bubble W), in the activations' dtype, accumulating in float32 under 16-bit ones.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mlplat.parallel.context import KERNELS, Ring, _accumulated, _blocks, block_kernel, merge_block
from mlplat.parallel.placement import TokenLayout


def _expanded(block: torch.Tensor, weight: torch.Tensor, heads: int, nope: int, rank: int):
    """(k [b, heads, n, nope + rope], v [b, heads, n, dv], the up-projection's input c [b, n, rank]) of a latent
    block [b, n, rank + rope]."""
    b, n, _ = block.shape
    c, k_rope = block[..., :rank], block[..., rank:]
    kv = F.linear(c, weight.to(c.dtype)).view(b, n, heads, -1).transpose(1, 2)  # per head [k_nope | v]
    k = torch.cat((kv[..., :nope], k_rope[:, None].expand(b, heads, n, k_rope.size(-1))), dim=-1)
    return k, kv[..., nope:], c


class _LatentRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, latent, weight, nope: int, rank: int, layout: TokenLayout, ring: Ring, kernel: str):
        fwd, _, flag, _ = KERNELS[kernel]  # MLA: a head's own key and value, nothing to group
        heads = q.size(1)
        scale = 1.0 / math.sqrt(q.size(-1))
        acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        b, _, n, _ = q.shape
        dv = weight.size(0) // heads - nope
        out = torch.zeros(b, n, heads, dv, dtype=acc, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        ctx.latent_dtype = latent.dtype
        latent = latent.to(q.dtype).contiguous()
        for block, row, cols, keep, causal in _blocks(latent, layout, ring, "forward", causal_flag=flag):
            k, v, _ = _expanded(block[:, :cols], weight, heads, nope, rank)
            o_blk, l_blk = fwd(q[:, :, row:], k, v, keep, scale, *([causal] if flag else []))
            merge_block(out, lse, row, o_blk, l_blk)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, latent, weight, out, lse)
        ctx.nope, ctx.rank, ctx.layout, ctx.ring, ctx.kernel = nope, rank, layout, ring, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, latent, weight, out, lse = ctx.saved_tensors
        nope, rank, layout, ring = ctx.nope, ctx.rank, ctx.layout, ctx.ring
        _, bwd, flag, _ = KERNELS[ctx.kernel]
        heads = q.size(1)
        scale = 1.0 / math.sqrt(q.size(-1))
        acc = lse.dtype
        dout = dout.contiguous()
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dweight = torch.zeros(weight.shape, dtype=acc, device=q.device)
        dblock_works = dblock_arriving = None
        for hop, (block, row, cols, keep, causal) in enumerate(_blocks(latent, layout, ring, "backward",
                                                                       every_hop=True, causal_flag=flag)):
            dblock = torch.zeros(latent.shape, dtype=acc, device=q.device)
            if cols > 0:
                k, v, c = _expanded(block[:, :cols], weight, heads, nope, rank)
                dq_b, dk_b, dv_b = bwd(q[:, :, row:], k, v, keep, scale, dout[:, :, row:], out[:, :, row:],
                                       lse[..., row:], delta[..., row:], *([causal] if flag else []))
                dq[:, :, row:] += dq_b.to(acc)
                dk_b, dv_b = _accumulated(dk_b, dv_b)
                # The up-projection's output gradient, per head [dk_nope | dv], as its rows are laid out
                dkv = torch.cat((dk_b[..., :nope], dv_b), dim=-1).transpose(1, 2).reshape(block.size(0), cols, -1)
                dblock[:, :cols, :rank] = dkv @ weight.to(acc)
                dblock[:, :cols, rank:] = dk_b[..., nope:].sum(1)  # the shared rotary key, every head's share
                c = c.to(acc)
                dweight += dkv.reshape(-1, dkv.size(-1)).t() @ c.reshape(-1, rank)
            if dblock_works is not None:  # what the earlier ranks of the ring added to this block's gradient
                ring.wait(dblock_works)
                dblock += dblock_arriving
            dblock_arriving = torch.empty_like(dblock)
            dblock_works = ring.post(dblock, dblock_arriving, f"backward d-latent hop {hop + 1} of {ring.c}")
        ring.wait(dblock_works)  # this rank's own block's gradient, back home
        return (dq.to(q.dtype), dblock_arriving.to(ctx.latent_dtype), dweight.to(weight.dtype), None, None, None,
                None, None)


def latent_ring_attention(q: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, weight: torch.Tensor,
                          nope: int, layout: TokenLayout, ring: Ring, kernel: str = "math") -> torch.Tensor:
    """softmax(q·kᵀ/√d + mask)·v over the whole window for this rank's queries q [b, heads, s/c, nope + rope], the
    keys and values up-projected by `weight` (this rank's kv_up rows, per head [k_nope | v]) from the latents c_kv
    [b, s/c, kv_lora_rank] and the rotated k_rope [b, 1, s/c, rope] of every rank, which come round the ring; returns
    [b, heads, s/c, v]."""
    if kernel not in KERNELS:
        raise ValueError(f"ring attention has no {kernel!r} block kernel (one of {', '.join(KERNELS)})")
    latent = torch.cat((c_kv, k_rope.squeeze(1).to(c_kv.dtype)), dim=-1)
    return _LatentRingAttention.apply(q, latent, weight, nope, c_kv.size(-1), layout, ring,
                                      block_kernel(kernel, q, layout))
