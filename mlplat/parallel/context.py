"""Ring attention: context parallelism's attention over the load-balanced split of `mlplat.parallel.placement`.

Everything outside attention is per token and runs on the rank's own tokens as it is; attention needs every earlier
key, so the ranks pass their K/V blocks around the ring (only the KV heads travel: grouped-query attention moves
n_kv_heads/n_heads of the queries' bytes). Each rank attends its queries to one block at a time and merges the
partial results by their log-sum-exp: for blocks a and b, lse = log(exp(lse_a) + exp(lse_b)) and out = exp(lse_a -
lse)·out_a + exp(lse_b - lse)·out_b, which is exactly softmax attention over both. The next block's transfer is
posted before the current block is computed, so it travels while the rank computes. Backward walks the ring again:
K/V travel as in forward and each block's dK/dV travel with it, gathering every rank's contribution, until after c
hops the sum arrives back at the block's owner.

Of a non-diagonal block only the part the causal mask leaves is computed: the local tokens are ascending in the
window, so the queries that see any of a block's keys are a suffix and the keys seen by any query a prefix (half
of the block, for the load-balanced split: Megatron-Core's halves fall out of it), and where every query of that
part sees every key, as in all but the diagonal block of the split, without a mask. Packed documents
(`TokenLayout.documents`) add their mask inside the block.

Messages (docs/gpu-nccl.md): every send and receive is on the cp group, in the same order on every rank: the hops'
FIFO per direction is what NCCL matches without tags. At c = 2 both directions are one pair of ranks (one NCCL
stream), so even ranks post their send first and odd ranks their receive first. Every buffer a send reads is
kept until its wait. The ring's waits are labelled (`cp_comm` in profiles, and in hang reports).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mlplat.parallel.logit_max import head_max_logits
from mlplat.parallel.placement import TokenLayout

# ----------------------------------------------------------------------------------------------- the ring

class Ring:
    """The cp group's ring: this rank sends to the next rank and receives from the previous one."""

    def __init__(self, grid, watch=None):
        self.group, self.c, self.rank = grid.cp_group, grid.cp, grid.cp_rank
        self.next = grid.cp_ranks[(self.rank + 1) % self.c]
        self.prev = grid.cp_ranks[(self.rank - 1) % self.c]
        self.watch = watch  # a HangWatch: the waits are labelled (set by whoever owns one)
        self.live_bytes = self.peak_bytes = 0
        # When a list: every post and wait, in order ("post"/"wait", hop, [(send/recv, cp peer)]), for the transport
        # model (tests/parallel/test_context.py runs the recorded order under NCCL's rules).
        self.log: list | None = None

    def post(self, send: torch.Tensor, recv: torch.Tensor, what: str) -> tuple:
        """Send `send` on and receive the previous rank's tensor into `recv` (the hop `what`, the same name on
        every rank); returns what `wait` takes."""
        ops = [("send", dist.isend, send, self.next, (self.rank + 1) % self.c),
               ("recv", dist.irecv, recv, self.prev, (self.rank - 1) % self.c)]
        if self.rank % 2:  # at c = 2 one stream carries both directions: the two ranks' FIFOs must match
            ops.reverse()
        works = [fn(t, peer, group=self.group) for _, fn, t, peer, _ in ops]
        if self.watch is not None and self.returns_early(send):  # the host will not block in its wait
            self.watch.posted(f"the context-parallel ring ({what})", works)
        if self.log is not None:  # the peers as cp ranks
            self.log.append(("post", what, [(kind, cp_peer) for kind, _, _, _, cp_peer in ops]))
        # The ring's buffers in flight (both ends of each hop), the memory context parallelism adds to a layer.
        size = send.nbytes + recv.nbytes
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return works, send, size, what  # send: kept alive until the wait

    @staticmethod
    def returns_early(tensor: torch.Tensor) -> bool:
        """Whether a wait returns before the transfer has run (NCCL: the stream waits, not the host), so that only
        the hang watch's poll of the posted works can see one that never completes."""
        return tensor.is_cuda

    def wait(self, posted: tuple) -> None:
        works, _, size, what = posted
        if self.watch is None:
            for w in works:
                w.wait()
        else:
            with self.watch.blocked_in(f"the context-parallel ring ({what})", "cp_comm"):
                for w in works:
                    w.wait()
        works.clear()  # in place: the hang watch holds this list, and a Work holds its buffer
        if self.log is not None:
            self.log.append(("wait", what, None))
        self.live_bytes -= size


# ----------------------------------------------------------------------------------------------- one block

def _expand(x: torch.Tensor, per_group: int) -> torch.Tensor:
    return x if per_group == 1 else x.repeat_interleave(per_group, dim=1)


def _fold(x: torch.Tensor, per_group: int) -> torch.Tensor:
    """The gradient of _expand: each key/value head's query group summed."""
    if per_group == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // per_group, per_group, s, d).sum(2)


def _accumulated(*xs: torch.Tensor) -> list[torch.Tensor]:
    """16-bit inputs in float32: backward runs outside autocast, and a block's log-sum-exp must not be rounded to
    16 bits before the merge."""
    acc = torch.float32 if xs[0].dtype in (torch.float16, torch.bfloat16) else xs[0].dtype
    return [x.to(acc) for x in xs]


def _math_forward(q, k, v, keep, scale):
    q, k, v = _accumulated(q, k, v)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)  # a row with no key in this block: probabilities 0
    return torch.matmul(torch.exp(scores - safe[..., None]), v), lse


def _math_backward(q, k, v, keep, scale, dout, out, lse, delta):
    q, k, v, dout = _accumulated(q, k, v, dout)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.exp(scores - lse[..., None])  # the final softmax's share
    dv = torch.matmul(probs.transpose(-2, -1), dout)
    dscores = probs * (torch.matmul(dout, v.transpose(-2, -1)) - delta[..., None])
    return torch.matmul(dscores, k) * scale, torch.matmul(dscores.transpose(-2, -1), q) * scale, dv


def _additive(keep: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    if keep is None:
        return None
    keep = keep.expand(q.size(0), q.size(1), -1, -1)
    return torch.zeros(keep.shape, dtype=q.dtype, device=keep.device).masked_fill(~keep, float("-inf"))


def _on_gpu(q: torch.Tensor) -> bool:
    """PyTorch's CUDA flash kernel (meta tensors take its path too: the tests check its calls' shapes there)."""
    return q.device.type in ("cuda", "meta")


def _padded(d: int, *xs: torch.Tensor) -> list[torch.Tensor]:
    """xs with zero channels appended up to d: the flash kernels take one head size for q, k and v, and zeros change
    no score (q, k) and add only zero output channels (v), cut off again (MLA's values are narrower than its keys)."""
    return [x if x.size(-1) == d else torch.nn.functional.pad(x, (0, d - x.size(-1))) for x in xs]


def _sdpa_forward(q, k, v, keep, scale, causal=False):
    # PyTorch's flash kernel, which returns the log-sum-exp beside the output (the public SDPA does not). `causal`:
    # the rank's own block, whose mask is the causal triangle (no mask is built for it); else `keep` or none.
    dv, d = v.size(-1), max(q.size(-1), v.size(-1))
    q, k, v = _padded(d, q, k, v)
    if _on_gpu(q):
        if keep is not None:
            raise ValueError("the CUDA flash kernel takes no mask: packed documents run their ring blocks in math")
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out[..., :dv], lse
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=_additive(keep, q), scale=scale)
    if keep is None:
        return out[..., :dv], lse
    # A row with no key in this block: the kernel gives output 0 and log-sum-exp 0; the merge needs -inf.
    return out[..., :dv], lse.masked_fill(~keep.expand(q.size(0), q.size(1), -1, -1).any(-1), float("-inf"))


def _sdpa_backward(q, k, v, keep, scale, dout, out, lse, delta, causal=False):
    # Given the final output and log-sum-exp, flash's backward computes this block's share of the gradients.
    dq_, dv_, d = q.size(-1), v.size(-1), max(q.size(-1), v.size(-1))
    q, k, v, dout, out = _padded(d, q, k, v, dout, out)
    if _on_gpu(q):
        unused = torch.empty(0, dtype=torch.long, device=q.device)  # the dropout RNG's seed and offset (no dropout)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.size(2), k.size(2), 0.0, causal, unused, unused,
            scale=scale)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=_additive(keep, q), scale=scale)
    return dq[..., :dq_], dk[..., :dq_], dv[..., :dv_]


# name: (forward, backward, whether it takes the rank's own block as causal=True instead of a mask, whether it takes
# fewer key/value heads than query heads itself: the flash kernels do (grouped-query attention, each K/V head read
# once per group, its gradient summed by the kernel), so a hop's K/V block is not expanded to every query head)
KERNELS = {"math": (_math_forward, _math_backward, False, False),
           "sdpa": (_sdpa_forward, _sdpa_backward, True, True)}


# ----------------------------------------------------------------------------------------------- attention

def _blocks(kv: torch.Tensor, layout: TokenLayout, ring: Ring, what: str, every_hop: bool = False,
            causal_flag: bool = False):
    """The ring's hops, as (the K/V block held, first query row, key columns, mask or None when the part is wholly
    visible, causal) for each hop whose visible part is not empty (with every_hop, for each hop: 0 columns when
    nothing is visible). causal_flag: the kernel takes the rank's own block of an unpacked window as causal=True,
    so its mask is not built (the only block the load-balanced split leaves partly visible without documents).
    The next block's transfer is posted before a block is handed out and waited for once the caller is done."""
    for hop in range(ring.c):
        owner = (ring.rank - hop) % ring.c
        posted = None
        if hop + 1 < ring.c:
            arriving = torch.empty_like(kv)
            posted = ring.post(kv, arriving, f"{what} K/V hop {hop + 1} of {ring.c - 1}")
        row, cols, whole = layout.visible(owner)
        visible = row < layout.index.numel() and cols > 0
        causal = causal_flag and owner == ring.rank and layout.documents is None
        keep = None  # no mask: every query of the part sees every key (the load-balanced split's other blocks)
        if visible and not causal and not (whole and layout.documents is None):
            keep = layout.mask(layout.index[row:], layout.index_of(owner)[:cols])
        if visible or every_hop:
            yield kv, row, cols if visible else 0, keep, causal
        if posted is not None:
            ring.wait(posted)
            kv = arriving


def merge_block(out: torch.Tensor, lse: torch.Tensor, row: int, o_blk: torch.Tensor, l_blk: torch.Tensor) -> None:
    """Merge a block's output and log-sum-exp into the running ones from query row `row` on (in their dtype): the
    exact softmax over every block seen so far."""
    l_old = lse[..., row:]
    l_new = torch.logaddexp(l_old, l_blk.to(lse.dtype))
    out[:, :, row:] = (out[:, :, row:] * torch.exp(l_old - l_new)[..., None]
                       + o_blk.to(out.dtype) * torch.exp(l_blk.to(lse.dtype) - l_new)[..., None])
    lse[..., row:] = l_new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: TokenLayout, ring: Ring, kernel: str, track=None):
        fwd, _, flag, grouped = KERNELS[kernel]
        per_group = 1 if grouped else q.size(1) // k.size(1)
        scale = 1.0 / math.sqrt(q.size(-1))
        acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        b, h, n, _ = q.shape
        dk = k.size(-1)  # the values' head size may differ (MLA): a hop carries K and V side by side, [..., dk + dv]
        # [b, s, heads, dv] underneath, as the fused kernels lay it out: the output projection's input is then a view
        # of the output this function saves, not a second copy.
        out = torch.zeros(b, n, h, v.size(-1), dtype=acc, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        for kv, row, cols, keep, causal in _blocks(torch.cat((k, v), -1), layout, ring, "forward", causal_flag=flag):
            o_blk, l_blk = fwd(q[:, :, row:], _expand(kv[:, :, :cols, :dk], per_group),
                               _expand(kv[:, :, :cols, dk:], per_group), keep, scale, *([causal] if flag else []))
            merge_block(out, lse, row, o_blk, l_blk)
            if track is not None:  # QK-clip: each head's largest logit of this block (the own block: causal)
                track(head_max_logits(q[:, :, row:], kv[:, :, :cols, :dk],
                                      layout.mask(layout.index[row:], layout.index[:cols]) if causal else keep, scale))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.ring, ctx.kernel = layout, ring, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, ring = ctx.layout, ctx.ring
        _, bwd, flag, grouped = KERNELS[ctx.kernel]
        per_group = 1 if grouped else q.size(1) // k.size(1)
        scale = 1.0 / math.sqrt(q.size(-1))
        acc = lse.dtype
        dout = dout.contiguous()
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = k.size(-1)
        kv_shape = (*k.shape[:-1], dk + v.size(-1))
        dkv_works = dkv_arriving = None
        for hop, (kv, row, cols, keep, causal) in enumerate(_blocks(torch.cat((k, v), -1), layout, ring, "backward",
                                                                    every_hop=True, causal_flag=flag)):
            dkv = torch.zeros(kv_shape, dtype=acc, device=q.device)
            if cols > 0:
                dq_b, dk_b, dv_b = bwd(q[:, :, row:], _expand(kv[:, :, :cols, :dk], per_group),
                                       _expand(kv[:, :, :cols, dk:], per_group), keep, scale,
                                       dout[:, :, row:], out[:, :, row:], lse[..., row:], delta[..., row:],
                                       *([causal] if flag else []))
                dq[:, :, row:] += dq_b.to(acc)
                dkv[:, :, :cols, :dk] = _fold(dk_b.to(acc), per_group)
                dkv[:, :, :cols, dk:] = _fold(dv_b.to(acc), per_group)
            if dkv_works is not None:  # what the earlier ranks of the ring added to this block's gradient
                ring.wait(dkv_works)
                dkv += dkv_arriving
            dkv_arriving = torch.empty_like(dkv)
            dkv_works = ring.post(dkv, dkv_arriving, f"backward dK/dV hop {hop + 1} of {ring.c}")
        ring.wait(dkv_works)  # this rank's own block's dK/dV, back home
        return (dq.to(q.dtype), dkv_arriving[..., :dk].to(k.dtype), dkv_arriving[..., dk:].to(v.dtype), None, None,
                None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout, ring: Ring,
                   kernel: str = "math", track=None) -> torch.Tensor:
    """softmax(q·kᵀ/√d + mask)·v over the whole window, for this rank's queries q [b, heads, s/c, d] and keys and
    values k [b, kv_heads, s/c, d], v [b, kv_heads, s/c, dv] (dv: d, or MLA's own value width), the K/V of the other
    ranks coming round the ring. kernel: how one block is computed, "math" (explicit) or "sdpa" (PyTorch's flash
    kernel: its CPU build, or on a GPU its CUDA build, which takes fp16/bf16 and no mask: packed documents, or other
    dtypes, run their blocks in math there). `track`: called in the forward with each block's [heads] largest logit
    (`head_max_logits`; QK-clip), None: not computed."""
    if kernel not in KERNELS:
        raise ValueError(f"ring attention has no {kernel!r} block kernel (one of {', '.join(KERNELS)})")
    return _RingAttention.apply(q, k, v, layout, ring, block_kernel(kernel, q, layout), track)


def block_kernel(kernel: str, q: torch.Tensor, layout: TokenLayout) -> str:
    """The kernel a ring's blocks run: `sdpa` on a GPU only where the CUDA flash kernel takes them."""
    if kernel == "sdpa" and _on_gpu(q) and (layout.documents is not None
                                             or q.dtype not in (torch.float16, torch.bfloat16)):
        return "math"
    return kernel
