"""The one gradient path after the pipeline's backward: an always-flat buffer of weights and gradients per bucket.

`ParamBuffers` owns every step from autograd's gradient to the optimizer's input, for every precision:

1. Accumulate. Each parameter's weights and gradient are views of its bucket's flat buffers (`param_flat`,
   `grad_flat`; `p.main_grad` is the gradient view). The moment autograd delivers a micro-batch's gradient a hook
   adds it into `p.main_grad` (in the main dtype: fp32 under the Megatron precisions, so the m micro-batches sum
   in fp32); the zero-bubble W step adds into `p.main_grad` directly and reports it (`grad_ready`).
2. Reduce over dp, overlapped with backward. During the last micro-batch's backward of a chunk its gradients are
   final; a bucket is launched as soon as it and every earlier bucket are (so every dp rank issues the same
   sequence of collectives): its mean all-reduced, or reduce-scattered into each rank's shard with the
   distributed optimizer, in `reduce_dtype` (`optim.grad_reduce_dtype`).
3. `reduce_tied`: the tied word embedding (a bucket of its own, laid out alike on both stages) summed between the
   first and the last pipeline stage. `reduce_shared_rows`: the rows of a key/value head held by several tp ranks
   (fewer key/value heads than t) summed over the grid's `kv_group` (each rank's gradient of the head comes from
   its own query heads only). `reduce_sequence_parallel`: the parameters applied to a sequence-parallel shard
   summed over tp (each rank saw only its tokens; forgetting it passes at t = 1 and drifts at t > 1).
4. `unscale_and_clip_`: loss scaling undone, the global gradient norm (each element once over the whole grid: a
   shared key/value head on the first rank of its kv_group only), clipping.
5. After the optimizer updated the main weights of a bucket's shard: `publish` rounds them into the weights and,
   sharded, all-gathers the other shards, waited for by the next forward of the bucket's chunk (a pre-hook).

Main weights. Under the Megatron precisions (bf16/fp16 weights) each bucket's shard has fp32 main weights of its
own; under fp32 and fp64 the main weights are views of the weights (no copy): torch's AdamW steps the weights
themselves, and `MainParamsAdamW` (`mlplat.optim.main_params`) the shard of `param_flat` it owns. When the
gradient dtype is the weights' and nothing is sharded, `p.grad` is the main-gradient view (after `finish`, and
after any backward), so any torch optimizer reads it; otherwise `p.grad` stays None.

Layout. Buckets in backward order (`backward_buckets`), cut at BUCKET_BYTES. Each parameter starts at a multiple
of ALIGN elements and a bucket is padded to a multiple of ALIGN·S (S = d with the distributed optimizer, else 1),
so shards are aligned equal ranges (what NCCL's reduce-scatter and all-gather move); the gaps hold zeros that
AdamW leaves at zero. With `whole_params` (an optimizer that reads a matrix whole) each parameter lies within one
shard instead: the parameters are dealt to the shards by the optimizer's work on each (`Optimizer.work`: Muon's
Newton–Schulz FLOPs; else their size), costliest first to the least loaded shard (`mlplat.optim.buckets.deal`), and
every shard is padded to the fullest: the step waits for the busiest rank, the collectives move the longest shard.
Within a bucket the parameters are ordered by optimizer group (decay first), then split-over-tp before replicated,
so AdamW runs on a few long slices and every tp rank lays a bucket out alike.

Collectives are called through `torch.distributed` at each call (the profiler and the hang watch wrap them
there). No Lightning and no Hydra here.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from mlplat.optim.buckets import BUCKET_BYTES, deal
from mlplat.optim.param_gather import ParamGather, alive, free, gathering_units, materialise
from mlplat.parallel.grid import ParallelGrid, dist_ready
from mlplat.parallel.mappings import all_gather_into, reduce_scatter_into
from mlplat.parallel.tensor import is_expert, shared_ranges

__all__ = ["ALIGN", "BUCKET_BYTES", "Bucket", "ParamBuffers", "Slot", "backward_buckets", "counted_once"]

ALIGN = 64  # elements: 128-byte starts in bf16, so every parameter view is aligned for vectorised kernels


def backward_buckets(chunks: dict[int, nn.Module], bucket_bytes: int,
                     alone: Iterable[nn.Parameter] = (),
                     unit_of: dict[int, int] | None = None) -> list[tuple[int, list[nn.Parameter]]]:
    """(chunk, parameters) of each bucket, in backward order: later chunks first, and within a chunk the
    parameters in reverse, cut when a bucket reaches `bucket_bytes`. A parameter of `alone` (the tied word
    embedding) gets a bucket of its own, so that both stages holding it lay it out alike; experts split over
    expert parallelism and the other parameters never share one (they are reduced over different ranks).
    A copy of the word embedding (`shared_copy`) comes first in its chunk: the logits' gradient is the first.
    `unit_of` (id of a parameter -> its gathering unit, `mlplat.optim.param_gather`): a bucket never spans two, and
    a unit's parameters are one bucket (split only between experts and the rest), gathered and reduced at once."""
    alone_ids = {id(p) for p in alone}
    unit_of = unit_of or {}
    out: list[tuple[int, list[nn.Parameter]]] = []
    for c in sorted(chunks, reverse=True):
        params = [p for p in chunks[c].parameters() if p.requires_grad]
        current: list[nn.Parameter] = []
        size = 0
        # The last stage's copy of the word embedding is the chunk's own parameter, listed before its modules',
        # but the logits' gradient is the chunk's first: its bucket goes first.
        order = sorted(reversed(params), key=lambda p: not getattr(p, "shared_copy", False))
        for p in order:
            if id(p) in alone_ids:
                out.append((c, [p]))
                continue
            if current and (is_expert(current[0]) != is_expert(p)
                            or unit_of.get(id(current[0])) != unit_of.get(id(p))):
                out.append((c, current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes and id(p) not in unit_of:
                out.append((c, current))
                current, size = [], 0
        if current:
            out.append((c, current))
    return out


def counted_once(p: nn.Parameter, grid: ParallelGrid) -> bool:
    """Count each full-model parameter once: replicated-across-tp ones on tp rank 0 only, the tied embedding's
    copy on the last stage not at all."""
    if getattr(p, "shared_copy", False):
        return False
    return getattr(p, "partition_dim", None) is not None or grid.tp_rank == 0


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _layout(sizes: Sequence[int], bins: int, costs: Sequence[float] | None = None,
            load: list[float] | None = None) -> tuple[list[int], int]:
    """(each parameter's start, the length of a bin) of a bucket of parameters of `sizes` cut into `bins` equal
    bins, each parameter within one bin (bins=1: one after the other). Every start is a multiple of ALIGN, and so is
    the bin length. The parameters are dealt by `costs` (their update's work; None: their aligned sizes), costliest
    first to the bin with the least (`deal`, from the bins' `load` of earlier buckets); within a bin they keep their
    order. Equal bins are what the
    reduce-scatter and the all-gather move: the fullest bin (in elements) sets the length, the others are padded
    with zeros."""
    owner = deal([_round_up(s, ALIGN) for s in sizes] if costs is None else costs, bins, load)
    fill = [0] * bins
    for i, size in enumerate(sizes):
        fill[owner[i]] += _round_up(size, ALIGN)
    n = _round_up(max(fill), ALIGN) if bins > 1 else 0
    starts, pos = [], [b * n for b in range(bins)]
    for i, size in enumerate(sizes):
        pos[owner[i]] = _round_up(pos[owner[i]], ALIGN)
        starts.append(pos[owner[i]])
        pos[owner[i]] += size
    return starts, (n if bins > 1 else pos[0])


@dataclass
class Slot:
    """Where one parameter lives in its bucket's flat buffers."""

    param: nn.Parameter
    start: int  # offset of its first element in the bucket
    numel: int
    group: int  # optimizer group (0: weight decay, 1: none)
    counted: bool  # counted in the gradient norm on this rank (replicated parameters once over tp)
    uncounted: list[tuple[int, int]] = field(default_factory=list)  # its element ranges another rank counts

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass
class Bucket:
    """One bucket's flat buffers; it reads as the sequence of its parameters (`bucket[0]`, `len(bucket)`)."""

    chunk: int
    slots: list[Slot]
    numel: int  # padded length of the flat buffers
    lo: int  # this rank's shard: [lo, hi) of the flat buffers
    hi: int
    param_flat: torch.Tensor  # the model's weights (model dtype); the parameters are views of it
    grad_flat: torch.Tensor  # main gradients (main dtype); p.main_grad are views of it
    main: torch.Tensor  # main weights of the shard (main dtype); a view of param_flat when the dtypes agree
    own_main: bool = False  # main weights of their own (a higher precision than the weights)
    tied: bool = False  # the tied word embedding, summed over the embedding group after the dp reduction
    group: Any = None  # the ranks holding the same weights: the d·c replicas, or an expert's edp ranks
    holders: int = 1  # their number
    shards: int = 1  # the shards of the distributed optimizer (holders, HSDP's dp_shard, or 1)
    replicate: Any = None  # HSDP: the group of the ranks holding the same shard (its gradient summed over it)
    # the shard's optimizer state by name (the optimizer's STATE), once an optimizer on the main weights allocates it
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (x, y, group) in shard coordinates
    counted: list[tuple[int, int]] = field(default_factory=list)  # shard ranges the gradient norm counts
    pending: torch.Tensor | None = None  # the buffer a reduction is running on
    gather: Any = None  # the all-gather in flight
    # Parameters sharded (optim.sharding=params): the weights' shard and the gradients' shard, the only copies kept
    # between uses; param_flat and grad_flat are then materialised only while in use (`mlplat.optim.param_gather`).
    shard: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    unit: int | None = None  # its gathering unit (a layer), None: gathered with its chunk

    @property
    def grad(self) -> torch.Tensor:
        """This rank's shard of the main gradients (after the reduction: the data-parallel mean)."""
        return self.grad_flat[self.lo:self.hi] if self.grad_shard is None else self.grad_shard

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i: int) -> nn.Parameter:
        return self.slots[i].param


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


def _minus(runs: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges `runs` with the ranges `holes` cut out (both sorted, half-open)."""
    out = []
    for x, y in runs:
        for a, b in holes:
            if a < y and b > x:
                if a > x:
                    out.append((x, a))
                x = max(x, b)
        if x < y:
            out.append((x, y))
    return out


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What global-norm clipping multiplies the gradients by: max_norm / norm when the norm is above max_norm
    (and finite; max_norm 0 = no clipping), else 1."""
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            return coef
    return 1.0


class ParamBuffers:
    """This rank's parameters in flat bucket buffers (weights, gradients, and the optimizer's main weights and
    state where it keeps it there), and every reduction between backward and step.

    groups: the optimizer's parameter groups (lists of parameters; group 0 decays; None: one group). param_dtype: the
    weights' dtype from here on (bf16 for bf16-megatron; None: as built). main_dtype: main weights, gradients and
    optimizer state (fp32 for the Megatron precisions; None: param_dtype). distributed: shard over dp (the distributed
    optimizer). whole_params: with distributed, each shard holds whole parameters (an optimizer whose update reads a
    matrix whole, `mlplat.optim.factory.Optimizer.whole_matrices`), dealt by `work` (the optimizer's cost of updating a
    parameter on this rank's grid, `Optimizer.work`; None: by size). tied: the tied word embedding's copies (a bucket
    each). sequence_parallel: parameters whose gradients are summed over tp. reduce_dtype: dtype of the data-parallel
    reduction (None: main_dtype). overlap: launch the reductions during backward (else all in `finish`).

    A step: `begin_step()`; the engine calls `before_backward(chunk, micro_batch, is_last)` before each backward
    and `grad_ready(p)` for gradients it accumulated itself; then `finish()`, `reduce_tied()`,
    `reduce_shared_rows()`, `reduce_sequence_parallel()`, `unscale_and_clip_(scaler, max_norm)`; the optimizer;
    `publish` per bucket.
    """

    def __init__(self, chunks: dict[int, nn.Module], grid: ParallelGrid,
                 groups: Sequence[Sequence[nn.Parameter]] | None = None, *, param_dtype: torch.dtype | None = None,
                 main_dtype: torch.dtype | None = None, distributed: bool = False, whole_params: bool = False,
                 work: Callable[[nn.Parameter, ParallelGrid], float] | None = None, shard_params: bool = False,
                 split_backward: bool = False, tied: Iterable[nn.Parameter] = (),
                 sequence_parallel: Iterable[nn.Parameter] = (), bucket_bytes: int = BUCKET_BYTES,
                 reduce_dtype: torch.dtype | None = None, overlap: bool = True):
        params = [p for c in chunks.values() for p in c.parameters() if p.requires_grad]
        self.grid, self.overlap = grid, overlap
        # The d·c ranks that hold these weights: context-parallel ranks computed the same weights' gradients on
        # other tokens of the same samples, so they are reduced (and the optimizer sharded) with the replicas. An
        # expert split over expert parallelism is held by its edp ranks instead (`_holders`).
        self.distributed, self.whole_params, self.work = distributed or shard_params, whole_params, work
        self.param_dtype = param_dtype or (params[0].dtype if params else torch.float32)
        self.main_dtype = main_dtype or self.param_dtype
        self.reduce_dtype = None if reduce_dtype in (None, self.main_dtype) else reduce_dtype
        self.own_main = self.main_dtype != self.param_dtype  # main weights of their own (else views of the weights)
        group_of = {id(p): g for g, ps in enumerate(groups or [params]) for p in ps}
        tied = list(tied)
        tied_ids = {id(p) for p in tied}
        self.tied = tied
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[Bucket, Slot]] = {}
        self.chunk_of: dict[int, int] = {}
        self._bucket_of: dict[int, int] = {}
        self._loads: dict[tuple[bool, int], list[float]] = {}  # whole parameters: each shard's work, bucket by bucket
        # optim.sharding=params: the weights and gradients sharded too, gathered per unit (mlplat.optim.param_gather)
        self.shard_params = shard_params
        units = gathering_units(chunks) if shard_params else []
        unit_of = {id(p): u for u, (_, m) in enumerate(units) for p in m.parameters()}
        with torch.no_grad():
            for chunk, ps in backward_buckets(chunks, bucket_bytes, alone=tied, unit_of=unit_of):
                # Decay group first, then split-over-tp before replicated (the same order on every tp rank).
                ps = sorted(ps, key=lambda p: (group_of[id(p)], getattr(p, "partition_dim", None) is None))
                for p in ps:
                    self.chunk_of[id(p)] = chunk
                    self._bucket_of[id(p)] = len(self.buckets)
                self.buckets.append(self._build(chunk, ps, group_of, id(ps[0]) in tied_ids))
                self.buckets[-1].unit = unit_of.get(id(ps[0]))
        # p.grad can be the main gradient itself only when it has the weight's dtype and all of it is reduced here.
        self.sharded = any(b.shards > 1 for b in self.buckets)
        self.grads_are_views = not self.own_main and not self.sharded
        self._reduces = any(b.group is not None for b in self.buckets) or grid.dp_cp > 1
        self.sequence_parallel = [p for p in sequence_parallel if id(p) in self._where]
        # Rows of a key/value head that every rank of the kv group holds: (parameter, its element ranges).
        self.shared = [(p, r) for b in self.buckets for p in b if (r := shared_ranges(p, grid))] \
            if grid.kv_group is not None else []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for b in self.buckets for p in b]
        self.gathers = ParamGather(self, chunks, units) if any(b.shard is not None for b in self.buckets) else None
        # Sharded gradients are reduce-scattered after every micro-batch's backward, bucket by bucket, and each
        # bucket's full buffer freed: the gradients' peak is a bucket or two, not the rank's share of the model.
        # Not under a split backward (zero bubble): W of one micro-batch comes after B of later ones, which have
        # added into the same buffers by then; those buffers live through the pass (`begin_step`).
        self.each_micro_batch = self.gathers is not None and overlap and not split_backward
        self._span: dict[int, tuple[int, int]] = {}  # chunk -> its buckets [first, end) (they are consecutive)
        for i, b in enumerate(self.buckets):
            self._span[b.chunk] = (self._span.get(b.chunk, (i, i))[0], i + 1)
        if self.sharded and self.gathers is None:  # the post-step all-gathers: waited for by the next forward
            self._chunk_of_module = {id(chunk): c for c, chunk in chunks.items()}
            self._hooks += [chunk.register_forward_pre_hook(self._before_forward) for chunk in chunks.values()]
        self._dirty = False
        self._reset_launches()

    def _holders(self, expert: bool) -> tuple[Any, int, int]:
        """(group, size, this rank's place) of the ranks holding the same weights: an expert's edp ranks, else the
        d·c replicas."""
        grid = self.grid
        return (grid.edp_group, grid.edp, grid.edp_rank) if expert else (grid.dp_cp_group, grid.dp_cp, grid.dp_cp_rank)

    def _build(self, chunk: int, params: list[nn.Parameter], group_of: dict[int, int], tied: bool) -> Bucket:
        group, holders, place = self._holders(is_expert(params[0]))
        shards, shard_rank, replicate = (holders, place, None) if self.distributed else (1, 0, None)
        grid = self.grid
        if self.distributed and not is_expert(params[0]) and grid.dp_shard < holders:  # HSDP: within a group
            group, shards, shard_rank = grid.shard_group, grid.dp_shard, grid.shard_rank
            replicate = grid.replicate_group
        first_of_kv = self.grid.rank == self.grid.kv_ranks[0]  # counts the key/value heads it shares
        whole = self.whole_params and shards > 1
        costs = [self.work(p, grid) for p in params] if whole and self.work is not None else None
        # Each shard's work over the rank's buckets so far (dense and experts apart: other ranks hold their shards),
        # so that the step's total is balanced, not each bucket's; the tied embedding's bucket on its own (both
        # stages holding it lay it out alike).
        load = None if tied or not whole else self._loads.setdefault((is_expert(params[0]), shards), [0.0] * shards)
        starts, n = _layout([p.numel() for p in params], shards if whole else 1, costs, load)
        slots = [Slot(p, start, p.numel(), group_of[id(p)], counted_once(p, self.grid),
                      [] if first_of_kv else shared_ranges(p, self.grid)) for p, start in zip(params, starts)]
        slots.sort(key=lambda s: s.start)
        numel = _round_up(max(n * (shards if whole else 1), 1), ALIGN * shards)
        n = numel // shards
        lo, hi = shard_rank * n, (shard_rank + 1) * n
        device = params[0].device
        param_flat = torch.zeros(numel, dtype=self.param_dtype, device=device)
        grad_flat = torch.zeros(numel, dtype=self.main_dtype, device=device)
        separate = self.own_main
        main = torch.zeros(n, dtype=self.main_dtype, device=device) if separate else param_flat[lo:hi]
        for s in slots:
            values = s.param.detach().reshape(-1)
            x, y = max(s.start, lo), min(s.end, hi)
            if separate and x < y:  # the main weights from the weights as built (fp32), before the cast below
                main[x - lo:y - lo].copy_(values[x - s.start:y - s.start])
            param_flat[s.start:s.end].copy_(values)
            s.param.data = param_flat[s.start:s.end].view_as(s.param)
            s.param.main_grad = grad_flat[s.start:s.end].view_as(s.param)
            s.param.grad = None
        bucket = Bucket(chunk, slots, numel, lo, hi, param_flat, grad_flat, main, own_main=separate, tied=tied,
                        group=group, holders=holders, shards=shards, replicate=replicate)
        if self.shard_params and shards > 1:  # the shards are the copies kept; the flat buffers are freed later
            bucket.shard = param_flat[lo:hi].clone()
            bucket.grad_shard = torch.zeros(n, dtype=self.main_dtype, device=device)
            if not separate:
                bucket.main = bucket.shard
        bucket.segments = _runs(slots, lambda s: s.group, lo, hi)
        holes = [(s.start + a - lo, s.start + b - lo) for s in slots for a, b in s.uncounted]
        bucket.counted = _minus([(x, y) for x, y, _ in _runs(slots, lambda s: True if s.counted else None, lo, hi)],
                                holes)
        for s in slots:
            self._where[id(s.param)] = (bucket, s)
        return bucket

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.gathers is not None:
            self.gathers.remove_hooks()

    # -- accumulation and the overlapped dp reduction ---------------------------------------------------
    def accumulate(self, p: nn.Parameter) -> None:
        """Add the gradient autograd just delivered into the main gradient (in its dtype). Where the gradients are
        views, `p.grad` becomes the main gradient itself (autograd then adds the next micro-batch into it in
        place, as into any existing `.grad`); else it is dropped."""
        g = p.grad
        if self.gathers is not None:
            b = self.where(p)[0]
            if self._in_flight is not None and self._in_flight[0] is b:  # the last micro-batch's, still reducing
                self._settle()
            self._grads_live(b)
        if g is not None and g.data_ptr() != p.main_grad.data_ptr():
            p.main_grad.add_(g)
        p.grad = p.main_grad if self.grads_are_views else None

    def zero_grad(self) -> None:
        """Main gradients to zero, no `p.grad` (a step starts from here)."""
        for b in self.buckets:
            if b.grad_shard is not None:
                b.grad_shard.zero_()
            if alive(b.grad_flat):
                b.grad_flat.zero_()
            for s in b.slots:
                s.param.grad = None
        self._dirty = False

    @staticmethod
    def _grads_live(b: Bucket) -> None:
        """A sharded bucket's full gradient buffer, at zero, for a pass (freed after its reduction)."""
        if not alive(b.grad_flat):
            materialise(b.grad_flat)
            b.grad_flat.zero_()

    def _reset_launches(self) -> None:
        self._final_chunks: set[int] = set()
        self._ready = [0] * len(self.buckets)
        self._launched = 0
        self._works: list[tuple[int, Any]] = []
        self._window: int | None = None  # each_micro_batch: the end of the backward's chunk's buckets
        self._in_flight: tuple[Bucket, Any] | None = None  # each_micro_batch: the reduce-scatter not yet added in

    def begin_step(self) -> None:
        """A step's gradient is one pipeline pass's: start from zero (unless the optimizer just zeroed)."""
        if self._dirty:
            self.zero_grad()
        if self.gathers is not None and not self.each_micro_batch:
            for b in self.gathers.sharded:  # the zero-bubble W adds into p.main_grad, a view of them, unhooked
                self._grads_live(b)
        self._reset_launches()

    def before_backward(self, chunk: int, micro_batch: int, is_last: bool) -> None:
        if self.each_micro_batch:  # this backward reduces the chunk's buckets, in order, as each is complete
            self._flush()
            first, self._window = self._span.get(chunk, (0, 0))
            self._launched = first
            for i in range(first, self._window):
                self._ready[i] = 0
        elif is_last:
            self._final_chunks.add(chunk)

    def grad_ready(self, p: torch.Tensor) -> None:
        """A gradient accumulated outside autograd (the zero-bubble W step) is final: count it like a hook."""
        self._on_grad(p)

    def _on_grad(self, p: torch.Tensor) -> None:
        self.accumulate(p)
        self._dirty = True
        if self.each_micro_batch:
            if self._window is not None:
                self._ready[self._bucket_of[id(p)]] += 1
                while (self._launched < self._window
                       and self._ready[self._launched] == len(self.buckets[self._launched])):
                    self._reduce_micro_batch(self._launched)
                    self._launched += 1
            return
        if not self._reduces or not self.overlap or self.chunk_of[id(p)] not in self._final_chunks:
            return  # an earlier micro-batch: keep accumulating locally
        self._ready[self._bucket_of[id(p)]] += 1
        # Launch in bucket order so every data-parallel rank issues the same sequence of collectives.
        while self._launched < len(self.buckets) and self._ready[self._launched] == len(self.buckets[self._launched]):
            self._launch(self._launched)
            self._launched += 1

    def _launch(self, i: int) -> None:
        """Start the data-parallel mean of bucket i: reduce-scattered into the shards, or all-reduced, over the ranks
        holding its weights. The mean is over the d·c replicas for experts too: an expert's rank has summed, by
        the dispatch, the gradients of the other ranks' tokens, and its edp ranks sum the rest."""
        b = self.buckets[i]
        b.grad_flat.div_(self.grid.dp_cp)
        if b.group is None:
            return
        b.pending = b.grad_flat if self.reduce_dtype is None else b.grad_flat.to(self.reduce_dtype)
        if b.shards > 1:  # in place: each rank's output is its own range of the input (NCCL's in-place form)
            out = b.grad_shard if b.grad_shard is not None and b.pending is b.grad_flat else b.pending[b.lo:b.hi]
            work = reduce_scatter_into(out, b.pending, b.group, async_op=True)
        else:
            work = dist.all_reduce(b.pending, group=b.group, async_op=True)
        self._works.append((i, work))

    def _reduce_micro_batch(self, i: int) -> None:
        """each_micro_batch: start reduce-scattering this micro-batch's gradients of sharded bucket i (after settling
        the previous one: two full buffers at most). A bucket no parameter of which got a gradient reduces zeros,
        so that every rank posts the same collectives. Unsharded buckets wait for `finish`."""
        b = self.buckets[i]
        if b.grad_shard is None:
            return
        self._settle()
        self._grads_live(b)
        b.grad_flat.div_(self.grid.dp_cp)
        b.pending = b.grad_flat if self.reduce_dtype is None else b.grad_flat.to(self.reduce_dtype)
        if b.pending is not b.grad_flat:  # reduced in its copy: the full main gradients go now, not at settling
            free(b.grad_flat)
        self._in_flight = (b, reduce_scatter_into(b.pending[b.lo:b.hi], b.pending, b.group, async_op=True))

    def _settle(self) -> None:
        """each_micro_batch: the reduce-scatter in flight added into its bucket's gradient shard, the full buffer
        freed."""
        if self._in_flight is not None:
            b, work = self._in_flight
            work.wait()
            b.grad_shard.add_(b.pending[b.lo:b.hi])
            b.pending, self._in_flight = None, None
            if alive(b.grad_flat):
                free(b.grad_flat)

    def _flush(self) -> None:
        """each_micro_batch: reduce what the last backward left (buckets with a parameter that got no gradient)."""
        if self._window is not None:
            while self._launched < self._window:
                self._reduce_micro_batch(self._launched)
                self._launched += 1
            self._window = None

    def finish(self) -> None:
        """Wait for the dp reductions (launching what backward did not: overlap off, unused parameters)."""
        if self.each_micro_batch:
            self._flush()
            self._settle()
            for i, b in enumerate(self.buckets):  # the unsharded buckets (an expert on its only rank, say)
                if b.grad_shard is None:
                    self._launch(i)
            self._launched = len(self.buckets)
        if self._reduces:
            while self._launched < len(self.buckets):
                self._launch(self._launched)
                self._launched += 1
            for i, work in self._works:
                work.wait()
                b = self.buckets[i]
                if b.pending is not b.grad_flat:  # reduced in another dtype: back into the main gradients
                    b.grad.copy_(b.pending[b.lo:b.hi])
                b.pending = None
        if self.gathers is not None:  # the shards hold the reduced gradients: the full buffers go until next pass
            for b in self.gathers.sharded:
                if alive(b.grad_flat):
                    free(b.grad_flat)
        # HSDP: each shard group reduced its gradients within; the sum over the groups, once per step (the mean's
        # division by d·c is done), in optim.grad_reduce_dtype, all posted before the first wait.
        works = []
        for b in self.buckets:
            if b.replicate is not None:
                sent = b.grad if self.reduce_dtype is None else b.grad.to(self.reduce_dtype)
                works.append((b, sent, dist.all_reduce(sent, group=b.replicate, async_op=True)))
        for b, sent, work in works:
            work.wait()
            if sent is not b.grad:
                b.grad.copy_(sent)
        self._reset_launches()
        self.expose()

    def expose(self) -> None:
        """Where the gradients are views, `p.grad` is the main gradient again (torch's optimizers read p.grad; a
        `zero_grad(set_to_none=True)`, Lightning's before validation among them, drops it)."""
        if self.grads_are_views:
            for b in self.buckets:
                for s in b.slots:
                    s.param.grad = s.param.main_grad

    # -- the sums over other groups -----------------------------------------------------------------------
    def reduce_tied(self) -> None:
        """Sum the tied word embedding's gradient shard over the first and last stage (same layout on both)."""
        if self.grid.embedding_group is None:
            return
        for b in self.buckets:
            if b.tied:
                dist.all_reduce(b.grad, group=self.grid.embedding_group)

    def reduce_shared_rows(self) -> None:
        """Sum the gradients of the key/value heads held by several tp ranks over the grid's kv_group, this rank's
        shard of them, in one flat all-reduce (the ranks of a kv group lay their buckets out alike)."""
        if self.shared:
            self._all_reduce_ranges([(p, a, b) for p, ranges in self.shared for a, b in ranges], self.grid.kv_group)

    def reduce_sequence_parallel(self) -> None:
        """Sum the gradients of the parameters applied to a sequence-parallel shard over tp, this rank's shard of
        them, in one flat all-reduce. Every tp rank lays its buckets out alike, so their shards hold the same
        ranges."""
        if self.grid.tp_group is None or not self.sequence_parallel:
            return
        self._all_reduce_ranges([(p, 0, p.numel()) for p in self.sequence_parallel], self.grid.tp_group)

    def _all_reduce_ranges(self, ranges: list[tuple[nn.Parameter, int, int]], group) -> None:
        """Sum over `group` the main gradients of the elements [a, b) of each parameter within this rank's shard."""
        views = []
        for p, a, e in ranges:
            b, s = self.where(p)
            x, y = max(s.start + a, b.lo), min(s.start + e, b.hi)
            if x < y:
                views.append(b.grad[x - b.lo:y - b.lo])
        if views:
            flat = torch.cat(views)
            dist.all_reduce(flat, group=group)
            offset = 0
            for v in views:
                v.copy_(flat[offset:offset + v.numel()])
                offset += v.numel()

    # -- norm, loss scaling, clipping ---------------------------------------------------------------------
    def shard_grads(self) -> list[torch.Tensor]:
        return [b.grad for b in self.buckets]

    def grad_norm(self) -> torch.Tensor:
        """The full model's gradient norm from the shards: each element once over the data-parallel shards,
        replicated-over-tp parameters once, the tied embedding's copy not at all."""
        return self.grad_norm_sq()[0].sqrt()

    def grad_norm_sq(self, async_op: bool = False):
        """(square of `grad_norm`, work): its sum over the ranks left in flight under async_op (work None
        otherwise, or in a world of one process): read the tensor only after `work.wait()`."""
        dtype = torch.float64 if self.main_dtype == torch.float64 else torch.float32
        device = self.buckets[0].grad_flat.device if self.buckets else torch.device("cpu")
        sq = torch.zeros((), dtype=dtype, device=device)
        # Summed over the whole world, one collective, so that every rank reads the same bits and takes the same
        # branch (clip or not; post-validation: redo or not). Sharded, every rank holds distinct elements (HSDP: each
        # shard group holds them all); else
        # each of a bucket's holders (the d·c replicas, an expert's edp ranks) holds the same ones and adds its
        # share.
        for b in self.buckets:
            part = sum((b.grad[x:y].to(dtype).pow(2).sum() for x, y in b.counted), torch.zeros_like(sq))
            sq += part * b.shards / b.holders if b.holders > b.shards else part  # each element's holders/shards copies
        work = None
        if dist_ready() and dist.get_world_size() > 1:
            work = dist.all_reduce(sq, async_op=async_op)
        return sq, work

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so the full model's gradient norm is at most max_norm; returns the norm before."""
        norm = self.grad_norm()
        if max_norm > 0:  # no host read of the norm when nothing clips
            self.scale_grads_(clip_coefficient(float(norm), max_norm))
        return norm

    def scale_grads_(self, coef: float) -> None:
        """Every gradient shard times coef (1: nothing to do)."""
        if coef != 1.0:
            for b in self.buckets:
                b.grad.mul_(coef)

    def unscale_and_clip_(self, loss_scaler, max_norm: float) -> tuple[bool, torch.Tensor]:
        """(found_inf, norm): the gradients divided by the loss scale (when there is a scaler), then clipped. On an
        inf/NaN on any rank nothing is clipped and the norm is inf: the caller skips the optimizer step."""
        if loss_scaler is not None and loss_scaler.unscale_grads_(self.shard_grads()):
            device = self.buckets[0].grad_flat.device if self.buckets else torch.device("cpu")
            return True, torch.full((), float("inf"), device=device)
        return False, self.clip_grad_norm_(max_norm)

    # -- weights after the step ---------------------------------------------------------------------------
    def allocate_state(self, names: Sequence[str]) -> None:
        """An optimizer's state for this rank's shards, zeros like the main weights, by name (only an optimizer on
        the main weights keeps it here)."""
        for b in self.buckets:
            for name in names:
                if name not in b.state:
                    b.state[name] = torch.zeros_like(b.main)

    def publish(self, b: Bucket) -> None:
        """The updated main weights of b's shard into the model's weights (rounded to their dtype), then the
        all-gather of the other shards, left in flight."""
        if b.shard is not None:  # sharded parameters: the shard is the weights; gathered where next used
            if b.own_main:
                b.shard.copy_(b.main)
            self.gathers.release(b)
            return
        if b.own_main:
            b.param_flat[b.lo:b.hi].copy_(b.main)
        if b.shards > 1:
            b.gather = all_gather_into(b.param_flat, b.param_flat[b.lo:b.hi], b.group, async_op=True)

    def wait(self, chunk: int | None = None) -> None:
        """Wait for the all-gathers of the buckets of chunks up to `chunk` (None: all): the forward order, so
        zbv's last chunk, which uses chunk 0's word embedding, waits for it too."""
        if self.gathers is not None:
            self.gathers.wait()
        for b in self.buckets:
            if b.gather is not None and (chunk is None or b.chunk <= chunk):
                b.gather.wait()
                b.gather = None

    def _before_forward(self, module: nn.Module, args) -> None:
        self.wait(self._chunk_of_module[id(module)])

    @contextlib.contextmanager
    def full_weights(self):
        """The model's weights whole for the length of a `with` block outside a pass (reading or copying them:
        an export, a test's comparison): with sharded parameters every bucket is gathered (collective over the
        data-parallel ranks, which must all enter) and freed again at the end; otherwise nothing to do."""
        if self.gathers is None:
            yield
            return
        with torch.no_grad():
            for b in self.gathers.sharded:
                self.gathers.gather(b)
            for b in self.gathers.sharded:
                self.gathers.ready(b)
        try:
            yield
        finally:
            for b in self.gathers.sharded:
                self.gathers.release(b)

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
        """The 1-D view of `local_range(p)` in the shard's main weights ("main") or its optimizer state `kind`."""
        b, s = self.where(p)
        a, e = self.local_range(p)
        buf = b.main if kind == "main" else b.state[kind]
        return buf[s.start + a - b.lo: s.start + e - b.lo]

    def state_tensors(self) -> list[torch.Tensor]:
        """What an optimizer on the main weights holds beyond the model: main weights (when not the weights
        themselves), its state."""
        out = []
        for b in self.buckets:
            if b.own_main:
                out.append(b.main)
            out += list(b.state.values())
        return out
