"""Tensor model parallelism (Narayanan et al., SC21, §2.3; Shoeybi et al., 2019).

The MLP's first GEMM is split by columns and the second by rows, so a transformer block needs only
one all-reduce in the forward pass (``reduce_from_tensor_parallel``, the paper's *g*) and one in the
backward pass (``copy_to_tensor_parallel``, the paper's *f*). Attention heads are split the same way.
The word embedding is split along the vocabulary. With ``sequence_parallel`` the layers' edges all-gather and
reduce-scatter along the sequence instead (`mlplat.parallel.sequence`, Korthikanti et al.'s g and ḡ). The
mappings themselves (f, g, scatter, gather, ḡ) live in `mlplat.parallel.mappings`; every GEMM here (both linear
layers, the logits) is `mlplat.parallel.linear.linear`.

Every parameter carries ``partition_dim`` (the dimension split across the tensor-parallel ranks, or
None when replicated) so initialisation and checkpoints can work from the full, layout-independent
tensor via ``shard_of`` / ``gather_full``. A column-parallel shard that is not one even slice of the full rows
carries ``row_blocks`` too (`RowBlock`s, per tp rank): grouped-query attention's QKV when key/value heads are
fewer than the tp ranks (`mlplat.model.decoder.qkv_row_blocks`), whose key/value rows are held by every rank sharing
the head (``shared``: their gradients are summed over the grid's `kv_group`, and a checkpoint saves them once).
A hidden weight matrix carries ``matrices`` (`Matrices`): the logical matrices its rows hold, declared by the layer that
fuses them (QKV, SwiGLU's fc1, stacked experts), for an optimizer that treats each matrix whole (Muon).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.linear import linear
from mlplat.parallel.mappings import (  # noqa: F401  (the tensor-parallel mappings are part of this module's API)
    all_gather,
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_tensor_parallel,
)
from mlplat.parallel.sequence import mark_sequence_parallel_replicated

# ---------------------------------------------------------------------------------------- metadata


def partition_dim_of(param: Tensor) -> int | None:
    """The tensor-parallel split dimension of a parameter; None (replicated) for untagged ones."""
    return getattr(param, "partition_dim", None)


class RowBlock(NamedTuple):
    """Rows [local, local + rows) of a tp rank's shard are rows [full, full + rows) of the full tensor."""

    local: int
    full: int
    rows: int
    shared: bool = False  # the same full rows are on every rank of the grid's kv_group


class Matrices(NamedTuple):
    """The logical matrices in a weight's rows, as an optimizer that reads each matrix whole sees them (Muon).

    The full (tp = 1) tensor's rows, or each of its consecutive `period`-row slices (one expert each, also on an
    expert-parallel rank's own experts), hold the matrices `runs`: per matrix, its rows as (first, count) runs within
    the slice, in order. No runs: the slice is one matrix."""

    period: int = 0  # rows of a slice; 0: the whole tensor is one slice
    runs: tuple[tuple[tuple[int, int], ...], ...] = ()


@functools.lru_cache(maxsize=None)
def matrix_rows(m: Matrices, rows: int) -> list[Tensor]:
    """The row indices of each logical matrix of a tensor of `rows` rows laid out as `m` says (computed once per
    layout: an optimizer reads them every step)."""
    period = m.period or rows
    out = []
    for start in range(0, rows, period):
        for runs in m.runs or (((0, period),),):
            out.append(torch.cat([torch.arange(start + a, start + a + n) for a, n in runs]))
    return out


def row_blocks_of(param: Tensor, grid: ParallelGrid) -> list[list[RowBlock]] | None:
    """Every tp rank's row blocks of a parameter split along dim 0 (``row_blocks``, else the even slices); None
    when it is not split along its rows."""
    blocks = getattr(param, "row_blocks", None)
    if blocks is not None:
        return blocks
    if partition_dim_of(param) != 0:
        return None
    rows = param.shape[0]
    return [[RowBlock(0, t * rows, rows)] for t in range(grid.tp)]


def is_expert(param: Tensor) -> bool:
    """Split over expert parallelism (``expert_parallel``: whole experts, row blocks per ep rank): its slices are
    over the ep group, its copies on the edp ranks of the experts' layout, not the tp group and the d·c replicas."""
    return getattr(param, "expert_parallel", False)


def slice_owners(param: Tensor, grid: ParallelGrid) -> list[int]:
    """The global ranks holding the slices of a split parameter that this rank holds one of, in slice order: its
    tp group, or for an expert its ep group."""
    return grid.ep_ranks if is_expert(param) else grid.tp_ranks


def slice_rank(param: Tensor, grid: ParallelGrid) -> int:
    """Which of `slice_owners` this rank is: its index into the parameter's `row_blocks`."""
    return grid.ep_rank if is_expert(param) else grid.tp_rank


def shared_ranges(param: Tensor, grid: ParallelGrid) -> list[tuple[int, int]]:
    """The row-major element ranges [a, b) of this rank's shard that every rank of the grid's kv_group holds too."""
    blocks = getattr(param, "row_blocks", None)
    if blocks is None:
        return []
    cols = math.prod(param.shape[1:])
    return [(b.local * cols, (b.local + b.rows) * cols) for b in blocks[slice_rank(param, grid)] if b.shared]


def full_shape_of(param: Tensor, grid: ParallelGrid) -> torch.Size:
    """The shape of the full (tp = 1) tensor a parameter is this rank's shard of."""
    shape = list(param.shape)
    blocks = getattr(param, "row_blocks", None)
    dim = partition_dim_of(param)
    if blocks is not None:
        shape[0] = max(b.full + b.rows for rank in blocks for b in rank)
    elif dim is not None:
        shape[dim] *= grid.tp
    return torch.Size(shape)


class _TensorParallelModule(nn.Module):
    """Keeps ``param.partition_dim`` alive.

    nn.Parameter attributes are lost when a parameter object is replaced (``to_empty`` from meta,
    ``deepcopy``, pickling, ``load_state_dict(assign=True)``), so the layer remembers them and
    re-tags after each of those.
    """

    def _set_matrices(self, **matrices: Matrices) -> None:
        """Tag weights with their logical matrices (`Matrices`): a hidden matrix of the model (Muon's)."""
        self._matrices = {**getattr(self, "_matrices", {}), **matrices}
        self._retag()

    def _set_partition_dims(self, row_blocks: list[list[RowBlock]] | None = None, expert_parallel: bool = False,
                            **dims: int | None) -> None:
        """Tag parameters with their split dimension; `row_blocks` (all split along dim 0) as well when given, indexed
        by ep rank instead of tp rank under `expert_parallel` (`slice_rank`)."""
        self._partition_dims = dict(dims)
        self._row_blocks, self._expert_parallel = row_blocks, expert_parallel
        self._retag()

    def _retag(self) -> None:
        for name, dim in getattr(self, "_partition_dims", {}).items():
            param = self._parameters.get(name)
            if param is not None:
                param.partition_dim = dim
                if getattr(self, "_row_blocks", None) is not None:
                    param.row_blocks = self._row_blocks
                if getattr(self, "_expert_parallel", False):
                    param.expert_parallel = True
        for name, m in getattr(self, "_matrices", {}).items():
            param = self._parameters.get(name)
            if param is not None:
                param.matrices = m

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._retag()
        return out

    def __setstate__(self, state):
        super().__setstate__(state)
        self._retag()

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._retag()


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what}={n} is not divisible by tp={tp}")
    return n // tp


def _init_normal(weight: Tensor, std: float) -> None:
    # Meta tensors have no storage to fill; the model initialises after materialising.
    if weight.device.type != "meta":
        with torch.no_grad():
            weight.normal_(0.0, std)


def _init_zero(bias: Tensor | None) -> None:
    if bias is not None and bias.device.type != "meta":
        with torch.no_grad():
            bias.zero_()


# ---------------------------------------------------------------------------------------- layers


class _ParallelLinear(_TensorParallelModule):
    """What the parallel linear layers share: sizes, and a weight split along ``partition_dim`` (0: output
    columns, with the bias split alike; 1: input rows, with the bias replicated; None: whole); the options
    ``skip_bias_add``, ``init_std`` and ``sequence_parallel``, which the subclasses explain. With a `wgrad_store` (set
    by the pipeline engine for zero-bubble schedules) the weight gradient is deferred to the W step; `gemm` computes
    the layer's products (`mlplat.parallel.linear.Gemm`; None: torch's)."""

    wgrad_store = None  # mlplat.parallel.weight_grad.WeightGradStore | None
    gemm = None  # mlplat.parallel.linear.Gemm | None

    def __init__(self, in_features: int, out_features: int, grid: ParallelGrid, bias: bool, partition_dim: int | None,
                 device=None, dtype=None, *, skip_bias_add: bool = False, init_std: float = 0.02,
                 sequence_parallel: bool = False, row_blocks: list[list[RowBlock]] | None = None):
        super().__init__()
        self.grid = grid
        self.in_features = in_features
        self.out_features = out_features
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        if row_blocks is not None:
            out_local = sum(b.rows for b in row_blocks[grid.tp_rank])
        else:
            out_local = _divide(out_features, grid.tp, "out_features") if partition_dim == 0 else out_features
        in_local = _divide(in_features, grid.tp, "in_features") if partition_dim == 1 else in_features
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_local, in_local, **factory))
        self.bias = nn.Parameter(torch.empty(out_local, **factory)) if bias else None
        self._set_partition_dims(row_blocks, weight=partition_dim, bias=0 if partition_dim == 0 else None)
        self._set_matrices(weight=Matrices())  # a hidden layer's matrix (a fused one's layer declares its parts)
        _init_normal(self.weight, init_std)
        _init_zero(self.bias)


class ColumnParallelLinear(_ParallelLinear):
    """Y = XA + b with A split by columns: rank i holds A_i (weight rows ``[out/tp, in]``) and b_i.

    The output is sharded along its last dim unless ``gather_output``. With ``skip_bias_add`` the
    bias is returned instead of added, so a fused bias+GeLU can follow. With ``sequence_parallel`` the input is
    this rank's sequence shard ``[b, s/tp, in]``, all-gathered along the sequence before the GEMM. ``row_blocks``
    (per tp rank): which rows of A each rank holds, when not an even slice (some held by several ranks).
    ``mapped_input``: the caller has applied f (or sequence parallelism's all-gather) to x already, once for several
    GEMMs (MLA's latents): no communication here.
    """

    def __init__(self, in_features: int, out_features: int, grid: ParallelGrid, bias: bool = True,
                 gather_output: bool = False, device=None, dtype=None, mapped_input: bool = False, **options):
        super().__init__(in_features, out_features, grid, bias, 0, device, dtype, **options)
        self.out_features_per_partition = self.weight.shape[0]
        self.gather_output = gather_output
        self.mapped_input = mapped_input

    def forward(self, x: Tensor):
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel:
            y = linear(x, self.weight, bias, self.wgrad_store, gemm=self.gemm, sequence_gather=self.grid)
        elif self.mapped_input:
            y = linear(x, self.weight, bias, self.wgrad_store, gemm=self.gemm)
        else:
            y = linear(copy_to_tensor_parallel(x, self.grid), self.weight, bias, self.wgrad_store, gemm=self.gemm)
        if self.gather_output:
            y = gather_from_tensor_parallel(y, self.grid)
        if self.skip_bias_add:
            return y, self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.grid.tp}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(_ParallelLinear):
    """Y = XA + b with A split by rows: rank i holds A_i (weight ``[out, in/tp]``) and gets X_i.

    The partial products X_i A_i are summed over tp; the replicated bias is added once, after the
    reduction (adding it before would count it tp times). With ``skip_bias_add`` the bias is
    returned instead of added, so a fused bias+dropout+add can follow. With ``sequence_parallel`` the sum is
    reduce-scattered along the sequence (output ``[b, s/tp, out]``) and the bias, added to the shard, gets a
    partial gradient: it is tagged `sequence_parallel_replicated`, to be summed over tp after the backward.
    """

    def __init__(self, in_features: int, out_features: int, grid: ParallelGrid, bias: bool = True,
                 input_is_parallel: bool = True, device=None, dtype=None, **options):
        super().__init__(in_features, out_features, grid, bias, 1, device, dtype, **options)
        self.in_features_per_partition = self.weight.shape[1]
        self.input_is_parallel = input_is_parallel
        if self.sequence_parallel:
            mark_sequence_parallel_replicated(self.bias)

    def forward(self, x: Tensor):
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.grid)
        y = linear(x, self.weight, None, self.wgrad_store, gemm=self.gemm)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(y, self.grid)
        else:
            y = reduce_from_tensor_parallel(y, self.grid)
        if self.skip_bias_add:
            return y, self.bias
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.grid.tp}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class ReplicatedLinear(_ParallelLinear):
    """Y = XA + b with A whole on every tensor-parallel rank, applied to whatever x the rank holds (MLA's
    down-projections: the sequence shard under sequence parallelism, else the replicated input). No communication:
    the caller sums its gradient over tp where each rank's is partial (`mark_sequence_parallel_replicated`)."""

    def __init__(self, in_features: int, out_features: int, grid: ParallelGrid, bias: bool = True, device=None,
                 dtype=None, **options):
        super().__init__(in_features, out_features, grid, bias, None, device, dtype, **options)

    def forward(self, x: Tensor):
        return linear(x, self.weight, self.bias, self.wgrad_store, gemm=self.gemm)


def vocab_parallel_embedding(ids: Tensor, weight: Tensor, grid: ParallelGrid,
                             sequence_parallel: bool = False) -> Tensor:
    """The lookup of ``ids`` in a vocabulary-parallel table ``weight`` [V/tp, h] (this rank's rows ``[i*V/tp,
    (i+1)*V/tp)``): ids outside them look up zero rows, and the all-reduce over tp (with ``sequence_parallel`` the
    reduce-scatter along the sequence, this rank's shard) assembles the embedding. Also for a copy of the table held
    on another stage (the multi-token prediction's input embedding, `mlplat.model.mtp`)."""
    if grid.tp == 1:
        return F.embedding(ids, weight)
    start = grid.tp_rank * weight.size(0)
    outside = (ids < start) | (ids >= start + weight.size(0))
    out = F.embedding((ids - start).masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel(out, grid)
    return reduce_from_tensor_parallel(out, grid)


class VocabParallelEmbedding(_TensorParallelModule):
    """Word embedding split along the (padded) vocabulary: rank i holds rows ``[i*V/tp, (i+1)*V/tp)``.

    Ids outside this rank's slice look up zero rows; the all-reduce over tp assembles the embedding. With
    ``sequence_parallel`` a reduce-scatter along the sequence assembles this rank's shard only (half the bytes).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        grid: ParallelGrid,
        device=None,
        dtype=None,
        *,
        init_std: float = 0.02,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.grid = grid
        self.sequence_parallel = sequence_parallel
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = _divide(num_embeddings, grid.tp, "num_embeddings (padded vocabulary)")
        self.vocab_start_index = grid.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, device=device, dtype=dtype)
        )
        self._set_partition_dims(weight=0)
        _init_normal(self.weight, init_std)

    def forward(self, ids: Tensor) -> Tensor:
        return vocab_parallel_embedding(ids, self.weight, self.grid, self.sequence_parallel)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.grid.tp}"


class VocabParallelOutput(_TensorParallelModule):
    """An untied output layer: a weight ``[V/tp, h]`` split along the (padded) vocabulary like the word embedding,
    read by ``parallel_lm_logits``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, grid: ParallelGrid, device=None, dtype=None):
        super().__init__()
        rows = _divide(num_embeddings, grid.tp, "num_embeddings (padded vocabulary)")
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, device=device, dtype=dtype))
        self._set_partition_dims(weight=0)


def parallel_lm_logits(hidden: Tensor, weight: Tensor, grid: ParallelGrid, bias: Tensor | None = None,
                       sequence_parallel: bool = False, store=None, gemm=None) -> Tensor:
    """Vocab-sharded logits ``[..., V/tp]`` from a (tied) vocab-parallel embedding weight ``[V/tp, h]``.

    The logits stay sharded: ``vocab_parallel_cross_entropy`` consumes them without a gather. With
    ``sequence_parallel`` ``hidden`` is this rank's sequence shard, all-gathered here: every rank needs every
    token against its slice of the vocabulary, and the logits ``[b, s, V/tp]`` line up with the labels. The GEMM
    is the linear layers' (`mlplat.parallel.linear.linear`): with a deferring `store` (a WeightGradStore) its
    weight gradient waits for the zero-bubble W like theirs; `gemm` computes its products.
    """
    if sequence_parallel:
        return linear(hidden, weight, bias, store, gemm=gemm, sequence_gather=grid)
    return linear(copy_to_tensor_parallel(hidden, grid), weight, bias, store, gemm=gemm)


# ---------------------------------------------------------------------------------------- full view


def shard_of(full: Tensor, param: Tensor, grid: ParallelGrid) -> Tensor:
    """The part of the full (tp=1) tensor that this rank holds for ``param``.

    ``full`` normally has the full padded shape (``param`` size along ``partition_dim`` times tp).
    It may be *shorter* along ``partition_dim`` — e.g. an embedding saved with the unpadded
    vocabulary or with another tp's padding — and the missing tail rows are then zeros (padding
    rows are never looked up and their logits are masked in the loss). Replicated parameters get
    ``full`` itself. Works in virtual mode (no communication).
    """
    blocks = getattr(param, "row_blocks", None)
    if blocks is not None:  # no padding here: the full tensor has its full shape
        if tuple(full.shape) != tuple(full_shape_of(param, grid)):
            raise ValueError(f"full shape {tuple(full.shape)} != {tuple(full_shape_of(param, grid))}, which the "
                             f"row blocks of shard {tuple(param.shape)} give")
        return torch.cat([full[b.full:b.full + b.rows] for b in blocks[slice_rank(param, grid)]])
    dim = partition_dim_of(param)
    if dim is None:
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(f"full shape {tuple(full.shape)} != replicated parameter shape {tuple(param.shape)}")
        return full
    dim = dim % param.dim()
    size = param.shape[dim]
    full_shape = list(param.shape)
    full_shape[dim] = size * grid.tp
    other = [s for i, s in enumerate(full.shape) if i != dim]
    if (full.dim() != param.dim() or other != [s for i, s in enumerate(full_shape) if i != dim]
            or full.shape[dim] > full_shape[dim]):
        raise ValueError(
            f"full shape {tuple(full.shape)} does not fit parameter shard {tuple(param.shape)} "
            f"split along dim {dim} over tp={grid.tp} (full shape {tuple(full_shape)})"
        )
    start = grid.tp_rank * size
    have = max(0, min(size, full.shape[dim] - start))
    if have == size:
        return full.narrow(dim, start, size).contiguous()
    out = full.new_zeros(param.shape)
    if have > 0:
        out.narrow(dim, 0, have).copy_(full.narrow(dim, start, have))
    return out


def gather_full(param: Tensor, grid: ParallelGrid, value: Tensor | None = None) -> Tensor:
    """All-gather a sharded parameter (or `value`, a tensor laid out like it) into its full (tp=1) tensor, over its
    tp group (its ep group for experts split over expert parallelism); replicated parameters as they are."""
    dim = partition_dim_of(param)
    group = grid.ep_group if is_expert(param) else grid.tp_group
    local = param.detach() if value is None else value
    if dim is None or len(slice_owners(param, grid)) == 1:
        return local
    if group is None:
        raise RuntimeError(f"gather_full needs tensor- and expert-parallel process groups; {grid!r} has none")
    shards = all_gather(local, dim, group)
    blocks = getattr(param, "row_blocks", None)
    if blocks is None:
        return shards
    out = shards.new_empty(full_shape_of(param, grid))
    rows = param.shape[0]
    for t, rank_blocks in enumerate(blocks):
        for b in rank_blocks:
            out[b.full:b.full + b.rows] = shards[t * rows + b.local:t * rows + b.local + b.rows]
    return out
