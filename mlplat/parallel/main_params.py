"""Main parameters: the optimizer's copy of the weights and gradients in flat buffers, optionally sharded over the
data-parallel group (the distributed optimizer), and the AdamW that updates them.

Megatron-style mixed precision (`trainer.precision=bf16-megatron`, `16-megatron`). The model's weights *are*
bf16 (fp16) tensors: no autocast, so no per-forward cast of the weights and no fp32 copy in the forward; the
activations and the stage-to-stage messages are in that dtype too. The optimizer keeps fp32 main weights, and
each micro-batch's gradient is added into an fp32 main gradient (`p.main_grad`) the moment autograd delivers it
(`DataParallelGrads`' hook; the zero-bubble W step adds into it directly), so the m micro-batches sum in fp32.
The data-parallel reduction runs on the fp32 main gradients (or in bf16, `optim.grad_reduce_dtype=bf16`), Adam
updates the fp32 main weights, and the bf16 weights are their rounding. Checkpoints hold the fp32 main weights.

Distributed optimizer (`optim.distributed=true`, any precision, float64 included). Each data-parallel rank owns
1/d of every bucket: its main weights and Adam moments exist for that shard only. The bucket's gradient is
reduce-scattered (instead of all-reduced) into the shards, each rank runs AdamW on its shard, and the updated
weights are all-gathered back into the model's weights. Under 64-true/32-true the main weights are the weights'
own shard (a view, no copy): the optimizer then holds only the moments, 1/d of them per rank.

Layout. The parameters of each data-parallel bucket (`data_parallel.backward_buckets`) sit in three flat
buffers: the model's weights (`param_flat`, the model dtype; the parameters are views of it), the main gradients
(`grad_flat`), and this rank's shard [lo, hi) of the main weights and moments. Each parameter starts at a
multiple of ALIGN elements and a bucket is padded to a multiple of ALIGN·S (S = d with the distributed optimizer,
else 1), so shards are aligned equal ranges (what NCCL's reduce-scatter and all-gather move) and the gaps hold
zeros that Adam leaves at zero. Within a bucket the parameters are ordered by optimizer group (decay first),
then split-over-tp before replicated, so AdamW runs on a few long slices and every tp rank lays a bucket out alike.

Overlap. A bucket's reduce-scatter (or all-reduce) starts as soon as its gradients are final, during the last
micro-batch's backward (`DataParallelGrads`). After the step's AdamW, a bucket's all-gather starts as soon as
that bucket is updated (buckets in forward order), overlapping the update of the next buckets, and is waited for
only by the next forward of its chunk (a forward pre-hook), overlapping the forward of the chunks before it.
Not overlapped: the tied-embedding all-reduce, the gradient-norm all-reduce and the AdamW arithmetic itself.

No Lightning and no Hydra here (tests import this package in a fresh interpreter).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from mlplat.parallel.data_parallel import BUCKET_BYTES, backward_buckets, counted_once
from mlplat.parallel.grid import ParallelGrid

ALIGN = 64  # elements: 128-byte starts in bf16, so every parameter view is aligned for vectorised kernels
MEGATRON_DTYPES = {"bf16-megatron": torch.bfloat16, "16-megatron": torch.float16}


def megatron_dtype(precision: str) -> torch.dtype | None:
    """The weights' dtype of a Megatron-style precision (bf16-megatron, 16-megatron), None for any other."""
    return MEGATRON_DTYPES.get(str(precision))


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _reduce_scatter(output: torch.Tensor, source: torch.Tensor, group):
    # reduce_scatter_single is the name in newer torch; reduce_scatter_tensor in 2.4 (the same collective).
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, source, group=group, async_op=True)


def _all_gather(output: torch.Tensor, source: torch.Tensor, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, source, group=group, async_op=True)


@dataclass
class Slot:
    """Where one parameter lives in its bucket's flat buffers."""

    param: nn.Parameter
    start: int  # offset of its first element in the bucket
    numel: int
    group: int  # optimizer group (0: weight decay, 1: none)
    counted: bool  # counted in the gradient norm on this rank (replicated parameters once over tp)

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass
class Bucket:
    chunk: int
    slots: list[Slot]
    numel: int  # padded length of the flat buffers
    lo: int  # this rank's shard: [lo, hi) of the flat buffers
    hi: int
    param_flat: torch.Tensor  # the model's weights (model dtype); the parameters are views of it
    grad_flat: torch.Tensor  # main gradients (main dtype); p.main_grad are views of it
    main: torch.Tensor  # main weights of the shard (main dtype); a view of param_flat when the dtypes agree
    exp_avg: torch.Tensor  # Adam moments of the shard
    exp_avg_sq: torch.Tensor
    own_main: bool = False  # main weights of their own (a higher precision than the weights)
    tied: bool = False  # the tied word embedding, summed over the embedding group after the dp reduction
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (x, y, group) in shard coordinates
    counted: list[tuple[int, int]] = field(default_factory=list)  # shard ranges the gradient norm counts
    pending: torch.Tensor | None = None  # the buffer a reduction is running on
    gather: Any = None  # the all-gather in flight

    @property
    def grad(self) -> torch.Tensor:
        """This rank's shard of the main gradients (after the reduction: the data-parallel mean)."""
        return self.grad_flat[self.lo:self.hi]


def _runs(slots: Sequence[Slot], key, lo: int, hi: int) -> list[tuple[int, int, Any]]:
    """Maximal runs of consecutive slots with the same key (None: skipped), clipped to [lo, hi), relative to lo.
    A run spans the alignment gaps between its slots: they hold zeros."""
    out: list[tuple[int, int, Any]] = []
    i = 0
    while i < len(slots):
        k = key(slots[i])
        j = i
        while j + 1 < len(slots) and key(slots[j + 1]) == k:
            j += 1
        x, y = max(slots[i].start, lo), min(slots[j].end, hi)
        if k is not None and x < y:
            out.append((x - lo, y - lo, k))
        i = j + 1
    return out


class MainParams:
    """The main weights, main gradients and Adam moments of this rank's parameters, in flat bucket buffers.

    groups: the optimizer's parameter groups (lists of parameters; group 0 decays). param_dtype: the model's
    weights after setup (bf16 for bf16-megatron; else their current dtype). main_dtype: main weights, gradients
    and moments (fp32 for the Megatron precisions, else the weights' dtype). distributed: shard over dp.
    tied: the tied word embedding's copies (a bucket each). reduce_dtype: dtype of the data-parallel reduction
    (None: main_dtype).
    """

    def __init__(self, chunks: dict[int, nn.Module], grid: ParallelGrid, groups: Sequence[Sequence[nn.Parameter]], *,
                 param_dtype: torch.dtype, main_dtype: torch.dtype, distributed: bool,
                 tied: Iterable[nn.Parameter] = (), bucket_bytes: int = BUCKET_BYTES,
                 reduce_dtype: torch.dtype | None = None):
        self.grid = grid
        self.distributed = distributed
        self.shards = grid.dp if distributed else 1
        self.shard_rank = grid.dp_rank if distributed else 0
        self.param_dtype, self.main_dtype = param_dtype, main_dtype
        self.reduce_dtype = None if reduce_dtype in (None, main_dtype) else reduce_dtype
        group_of = {id(p): g for g, params in enumerate(groups) for p in params}
        tied_ids = {id(p) for p in tied}
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[Bucket, Slot]] = {}
        with torch.no_grad():
            for chunk, params in backward_buckets(chunks, bucket_bytes, alone=tied):
                # Decay group first, then split-over-tp before replicated (the same order on every tp rank).
                params = sorted(params, key=lambda p: (group_of[id(p)], getattr(p, "partition_dim", None) is None))
                self.buckets.append(self._build(chunk, params, group_of, id(params[0]) in tied_ids))
        self._hooks = [chunk.register_forward_pre_hook(self._before_forward) for chunk in chunks.values()]
        self._chunk_of_module = {id(chunk): c for c, chunk in chunks.items()}

    def _build(self, chunk: int, params: list[nn.Parameter], group_of: dict[int, int], tied: bool) -> Bucket:
        slots, pos = [], 0
        for p in params:
            pos = _round_up(pos, ALIGN)
            slots.append(Slot(p, pos, p.numel(), group_of[id(p)], counted_once(p, self.grid)))
            pos += p.numel()
        numel = _round_up(max(pos, 1), ALIGN * self.shards)
        n = numel // self.shards
        lo, hi = self.shard_rank * n, (self.shard_rank + 1) * n
        device = params[0].device
        param_flat = torch.zeros(numel, dtype=self.param_dtype, device=device)
        grad_flat = torch.zeros(numel, dtype=self.main_dtype, device=device)
        separate = self.main_dtype != self.param_dtype
        main = torch.zeros(n, dtype=self.main_dtype, device=device) if separate else param_flat[lo:hi]
        for s in slots:
            values = s.param.detach().reshape(-1)
            x, y = max(s.start, lo), min(s.end, hi)
            if separate and x < y:  # the main weights from the weights as built (fp32), before the cast below
                main[x - lo:y - lo].copy_(values[x - s.start:y - s.start])
            param_flat[s.start:s.end].copy_(values)
            s.param.data = param_flat[s.start:s.end].view_as(s.param)
            s.param.main_grad = grad_flat[s.start:s.end].view_as(s.param)
        bucket = Bucket(chunk, slots, numel, lo, hi, param_flat, grad_flat, main, torch.zeros_like(main),
                        torch.zeros_like(main), own_main=separate, tied=tied)
        bucket.segments = _runs(slots, lambda s: s.group, lo, hi)
        bucket.counted = [(x, y) for x, y, _ in _runs(slots, lambda s: True if s.counted else None, lo, hi)]
        for s in slots:
            self._where[id(s.param)] = (bucket, s)
        return bucket

    # -- gradients ----------------------------------------------------------------------------------------
    @staticmethod
    def accumulate(p: nn.Parameter) -> None:
        """Add the gradient autograd just delivered into the main gradient (in its dtype) and drop it."""
        if p.grad is not None:
            p.main_grad.add_(p.grad)
            p.grad = None

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad_flat.zero_()
            for s in b.slots:
                s.param.grad = None

    def reduce(self, i: int):
        """Start the data-parallel mean of bucket i's main gradients: reduce-scattered into the shards, or
        all-reduced; returns the pending work (None without data parallelism)."""
        group = self.grid.dp_group
        if group is None:
            return None
        b = self.buckets[i]
        b.grad_flat.div_(self.grid.dp)
        b.pending = b.grad_flat if self.reduce_dtype is None else b.grad_flat.to(self.reduce_dtype)
        if self.shards > 1:  # in place: each rank's output is its own range of the input (NCCL's in-place form)
            return _reduce_scatter(b.pending[b.lo:b.hi], b.pending, group)
        return dist.all_reduce(b.pending, group=group, async_op=True)

    def reduced(self, i: int) -> None:
        """Bucket i's reduction has completed (its work was waited for)."""
        b = self.buckets[i]
        if b.pending is not None and b.pending is not b.grad_flat:
            b.grad.copy_(b.pending[b.lo:b.hi])
        b.pending = None

    def reduce_tied(self) -> None:
        """Sum the tied word embedding's gradient shard over the first and last stage (same layout on both)."""
        if self.grid.embedding_group is None:
            return
        for b in self.buckets:
            if b.tied:
                dist.all_reduce(b.grad, group=self.grid.embedding_group)

    def reduce_over_tp(self, params: Sequence[nn.Parameter]) -> None:
        """Sum the main gradients of `params` over the tensor-parallel group, this rank's shard of them, in one flat
        all-reduce (parameters applied to a sequence-parallel shard: `mlplat.parallel.sequence`). Every tp rank
        lays its buckets out alike, so each rank's shard holds the same ranges of them."""
        if self.grid.tp_group is None:
            return
        views = []
        for p in params:
            b, s = self.where(p)
            x, y = max(s.start, b.lo), min(s.end, b.hi)
            if x < y:
                views.append(b.grad_flat[x:y])
        if views:
            flat = torch.cat(views)
            dist.all_reduce(flat, group=self.grid.tp_group)
            offset = 0
            for v in views:
                v.copy_(flat[offset:offset + v.numel()])
                offset += v.numel()

    def shard_grads(self) -> list[torch.Tensor]:
        return [b.grad for b in self.buckets]

    def grad_norm(self) -> torch.Tensor:
        """The full model's gradient norm from the shards: each element once over the data-parallel shards,
        replicated-over-tp parameters once, the tied embedding's copy not at all."""
        dtype = torch.float64 if self.main_dtype == torch.float64 else torch.float32
        device = self.buckets[0].grad_flat.device if self.buckets else torch.device("cpu")
        sq = torch.zeros((), dtype=dtype, device=device)
        for b in self.buckets:
            for x, y in b.counted:
                sq += b.grad[x:y].to(dtype).pow(2).sum()
        # Sharded: every rank holds distinct elements, so the whole world sums; else one replica's ranks do.
        group = None if self.shards > 1 else self.grid.model_parallel_group
        if (self.shards > 1 or group is not None) and dist.is_available() and dist.is_initialized():
            dist.all_reduce(sq, group=group)
        return sq.sqrt()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the main gradients so the full model's gradient norm is at most max_norm; the norm before."""
        norm = self.grad_norm()
        if max_norm > 0 and math.isfinite(float(norm)):
            coef = max_norm / (float(norm) + 1e-6)  # the same rule as data_parallel.clip_grad_norm_
            if coef < 1.0:
                for b in self.buckets:
                    b.grad.mul_(coef)
        return norm

    # -- weights ------------------------------------------------------------------------------------------
    def publish(self, b: Bucket) -> None:
        """The updated main weights of b's shard into the model's weights (rounded to their dtype), then the
        all-gather of the other shards, left in flight."""
        if b.own_main:
            b.param_flat[b.lo:b.hi].copy_(b.main)
        if self.shards > 1:
            b.gather = _all_gather(b.param_flat, b.param_flat[b.lo:b.hi], self.grid.dp_group)

    def wait(self, chunk: int | None = None) -> None:
        """Wait for the all-gathers of the buckets of chunks up to `chunk` (None: all): the forward order, so
        zbv's last chunk, which uses chunk 0's word embedding, waits for it too."""
        for b in self.buckets:
            if b.gather is not None and (chunk is None or b.chunk <= chunk):
                b.gather.wait()
                b.gather = None

    def _before_forward(self, module: nn.Module, args) -> None:
        self.wait(self._chunk_of_module[id(module)])

    def refresh(self) -> None:
        """The model's weights from the main weights (after loading a checkpoint into the main weights)."""
        with torch.no_grad():
            for b in reversed(self.buckets):
                self.publish(b)
        self.wait()

    # -- checkpoints --------------------------------------------------------------------------------------
    def where(self, p: nn.Parameter) -> tuple[Bucket, Slot]:
        return self._where[id(p)]

    def local_range(self, p: nn.Parameter) -> tuple[int, int] | None:
        """The elements [a, b) of p (row-major, this rank's tp shard) that this rank's shard holds, or None."""
        b, s = self.where(p)
        x, y = max(s.start, b.lo), min(s.end, b.hi)
        return (x - s.start, y - s.start) if x < y else None

    def shard_view(self, p: nn.Parameter, kind: str) -> torch.Tensor:
        """The 1-D view of `local_range(p)` in the shard's main weights ("main"), "exp_avg" or "exp_avg_sq"."""
        b, s = self.where(p)
        a, e = self.local_range(p)
        buf = {"main": b.main, "exp_avg": b.exp_avg, "exp_avg_sq": b.exp_avg_sq}[kind]
        return buf[s.start + a - b.lo: s.start + e - b.lo]

    def state_tensors(self) -> list[torch.Tensor]:
        """What the optimizer holds beyond the model: main weights (when not the weights themselves), moments."""
        out = []
        for b in self.buckets:
            if b.own_main:
                out.append(b.main)
            out += [b.exp_avg, b.exp_avg_sq]
        return out

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int,
           lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update in place, in the arithmetic of torch.optim.AdamW's single-tensor path (the float64
    proofs compare against it): decoupled weight decay, then the moments, then the bias-corrected step."""
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - beta2 ** float(step)
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


class MainParamsAdamW(torch.optim.Optimizer):
    """AdamW on `MainParams`' main weights (this rank's shards), then the model's weights refreshed from them.

    A torch Optimizer so that LambdaLR and Lightning drive it as any other: its param_groups hold the model's
    parameters and the hyper-parameters (lr, betas, eps, weight_decay), which the update reads each step; the
    state lives in `main`'s flat buffers, not in `self.state`. Every parameter steps every step (the model uses
    all of them), so one step count serves all.
    """

    def __init__(self, main: MainParams, param_groups: list[dict], lr: float, betas: Sequence[float], eps: float):
        super().__init__(param_groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=0.0))
        self.main = main
        self.steps = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.main.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps += 1
        # Forward order: the first chunk's weights are all-gathered first, as the next forward needs them.
        for b in reversed(self.main.buckets):
            for x, y, g in b.segments:
                group = self.param_groups[g]
                beta1, beta2 = group["betas"]
                adamw_(b.main[x:y], b.grad[x:y], b.exp_avg[x:y], b.exp_avg_sq[x:y], step=self.steps,
                       lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                       weight_decay=group["weight_decay"])
            self.main.publish(b)
        return loss


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (distinct storages; the step counters excluded)."""
    main = getattr(optimizer, "main", None)
    if isinstance(main, MainParams):
        tensors = main.state_tensors()
    else:
        tensors = [t for st in optimizer.state.values() for k, t in st.items()
                   if isinstance(t, torch.Tensor) and k != "step"]
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
