"""The layout-independent view of a training state: what a checkpoint holds, keyed by full-model names.

Every parameter, and each tensor of its optimizer state (the optimizer's `STATE`, `mlplat.optim.factory`), appears under
the full model's name (`model/layers.5.attn.qkv.weight`, `optim/layers.5.attn.qkv.weight/exp_avg`); so does the state
that decides the function without being trained by the optimizer (`buffer_state`: the expert biases). A tensor-parallel
shard is a DTensor over the tensor-parallel group, so torch.distributed.checkpoint records it as (offsets, sizes) of the
full tensor and can hand any other layout the slices it needs. Replicated copies (data-parallel replicas, LayerNorm on
every tp rank) are saved once by DCP's de-duplication. The word embedding and an untied output layer are special: their
padded size depends on tp, so each rank reads back only its rows of the real vocabulary (io.vocab_regions) and zeroes
the new layout's padding.

A QKV shard made of row blocks (fewer key/value heads than tp ranks: `mlplat.parallel.tensor.RowBlock`) is not one
slice of the full tensor: each block is a box at its own rows of the full (tp = 1) tensor, in a ShardedTensor. The
key/value rows that several tp ranks share are listed once, under the first rank of their kv group, and each
sharing rank gives the same box (same offsets): DCP de-duplicates it on save and each rank reads it on load, so
replicated and split layouts reshard into each other (t2 ↔ t1 with one key/value head, say).

With main parameters (`mlplat.optim.main_params`: the Megatron-style precisions, the distributed optimizer)
`model/NAME` holds the main weights (fp32 under bf16-megatron: a resume or a reshard loses no precision) and
the moments come from the flat shards. A data-parallel shard is a contiguous range of a parameter's row-major
elements, i.e. at most three boxes (a partial row, whole rows, a partial row); each is saved as a chunk of the
full tensor at its own offsets (a ShardedTensor of those boxes: DTensor cannot describe them), so DCP can again
hand any layout -- another dp, tp or pp, sharded or not -- the slices it needs, and nothing is gathered.

Device discipline: the tensor-parallel mesh takes the device type of the tensors it describes
(a CPU mesh over CUDA shards makes DTensor hand DCP CPU copies, which DCP then fills instead of the real
weights), and every tensor created here names the device it belongs on instead of relying on the default
device. tests/checkpoint/test_io.py checks both on CPU.
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn as nn

from mlplat.model.init import OUTPUT_LAYER, WORD_EMBEDDING
from mlplat.model.moe import expert_biases
from mlplat.optim.buffers import ParamBuffers
from mlplat.optim.factory import state_names
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.tensor import full_shape_of, is_expert, slice_owners, slice_rank

VOCAB_ROWS = (WORD_EMBEDDING, OUTPUT_LAYER)  # [padded vocabulary, h] tables: loaded as regions of the real rows


def full_parameters(chunks: dict[int, nn.Module]) -> dict[str, nn.Parameter]:
    """Full-model name -> this rank's parameter (a shard when partition_dim is set). The tied copy on the
    last stage maps to the same name as the first stage's embedding."""
    out: dict[str, nn.Parameter] = {}
    for chunk in chunks.values():
        for name, p in chunk.named_parameters():
            full = chunk.full_name(name)
            out.setdefault(full, p)
            if getattr(p, "shared_copy", False):
                out[full] = p
    return out


def tp_mesh(grid: ParallelGrid, device_type: str):
    """The tensor-parallel group as a 1-D DeviceMesh of `device_type` (that of the tensors it will carry:
    "cuda" for GPU shards on NCCL, "cpu" on gloo), built once per grid and device type."""
    from torch.distributed.device_mesh import DeviceMesh

    meshes = grid.__dict__.setdefault("_tp_meshes", {})
    if device_type not in meshes:
        meshes[device_type] = DeviceMesh.from_group(grid.tp_group, device_type, mesh=grid.tp_ranks)
    return meshes[device_type]


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


def as_saved(t: torch.Tensor, p: nn.Parameter, grid: ParallelGrid) -> Any:
    """A DTensor (tp-sharded parameters) on a mesh of t's own device type, or the plain tensor (replicated); the
    boxes of its row blocks (a key/value head shared by tp ranks) in a ShardedTensor."""
    dim = getattr(p, "partition_dim", None)
    if dim is None or len(slice_owners(p, grid)) == 1:
        return t
    if hasattr(p, "row_blocks"):
        owners = [(owner, r, 0, p.numel()) for r, owner in enumerate(slice_owners(p, grid))]
        return boxes_entry(t.reshape(-1), 0, p, grid, owners)
    from torch.distributed.tensor import DTensor, Shard

    shape = list(t.shape)
    shape[dim] *= grid.tp
    full = torch.Size(shape)
    return DTensor.from_local(t, tp_mesh(grid, t.device.type), [Shard(dim)], run_check=False, shape=full,
                              stride=_contiguous_stride(full))


def adam_step_device(optimizer: torch.optim.Optimizer, p: nn.Parameter) -> torch.device:
    """Where Adam keeps `step`: on the parameter's device when capturable or fused, else a CPU scalar (as
    torch.optim.Adam/AdamW create it; a CUDA step would cost a host sync per parameter in every step)."""
    group = next((g for g in optimizer.param_groups if any(q is p for q in g["params"])), {})
    return p.device if group.get("capturable") or group.get("fused") else torch.device("cpu")


def optimizer_state_of(optimizer: torch.optim.Optimizer, p: nn.Parameter) -> dict:
    """A torch optimizer's per-parameter state (its step count and its `STATE`), created empty (step 0) if the
    optimizer has not stepped yet."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=adam_step_device(optimizer, p))
        for k in state_names(optimizer):
            state[k] = torch.zeros_like(p, memory_format=torch.preserve_format, device=p.device)
    return state


def main_params_of(optimizer) -> ParamBuffers | None:
    """The gradient buffer whose main weights the optimizer steps (`MainParamsOptimizer`), None for a torch
    optimizer on the weights (or no optimizer)."""
    main = getattr(optimizer, "main", None)
    return main if isinstance(main, ParamBuffers) else None


def training_state(chunks: dict[int, nn.Module], optimizer: torch.optim.Optimizer | None, grid: ParallelGrid,
                   skip_vocab: bool = False) -> dict[str, Any]:
    """The tensors of a checkpoint as DCP state-dict entries (for saving, or as load targets)."""
    main = main_params_of(optimizer)
    if main is not None:
        return _main_params_state(chunks, optimizer, main, grid, skip_vocab)
    sd: dict[str, Any] = {}
    for name, p in full_parameters(chunks).items():
        if skip_vocab and name in VOCAB_ROWS:
            continue
        sd[f"model/{name}"] = as_saved(p.data, p, grid)
        if optimizer is not None:
            st = optimizer_state_of(optimizer, p)
            sd[f"optim/{name}/step"] = st["step"]
            for k in state_names(optimizer):
                sd[f"optim/{name}/{k}"] = as_saved(st[k], p, grid)
    if optimizer is not None:
        sd["optim/param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {**sd, **buffer_state(chunks)}


def buffer_state(chunks: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    """The state that is not a parameter but decides the model's function: each MoE layer's expert bias
    (aux-loss-free balancing: it chooses the experts), as `model/layers.<i>.mlp.expert_bias`. Every rank holding
    the layer has the same values (mlplat.model.moe.update_biases), saved once by DCP's de-duplication and read
    back by whichever ranks hold the layer under the new layout."""
    return {f"model/{name}": bias for name, bias in expert_biases(chunks.values()).items()}


def step_tensor(optimizer, device: torch.device) -> torch.Tensor:
    """Adam's step count as torch.optim.AdamW saves it (a float32 scalar), so either optimizer reads the other's."""
    return torch.full((), float(optimizer.steps), dtype=torch.float32, device=device)


def _main_params_state(chunks, optimizer, main: ParamBuffers, grid: ParallelGrid, skip_vocab: bool) -> dict:
    sd: dict[str, Any] = {}
    for name, p in full_parameters(chunks).items():
        if skip_vocab and name in VOCAB_ROWS:
            continue
        for kind, key in (("main", f"model/{name}"), *((k, f"optim/{name}/{k}") for k in state_names(optimizer))):
            entry = shard_entry(main, p, kind, grid)
            if entry is not None:  # nothing of p in this rank's shard: the ranks that hold it save it
                sd[key] = entry
        # One tensor per name (load writes each); the steps are equal, read back as their max.
        sd[f"optim/{name}/step"] = step_tensor(optimizer, torch.device("cpu"))
    sd["optim/param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {**sd, **buffer_state(chunks)}


def flat_boxes(shape: torch.Size, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    """The row-major elements [a, b) of a tensor of `shape` as boxes (offsets, sizes, first, end): at most a
    partial first row, whole rows, a partial last row. 1-D and 2-D tensors (all of the model's parameters)."""
    if len(shape) == 1:
        return [((a,), (b - a,), a, b)] if b > a else []
    if len(shape) != 2:
        raise ValueError(f"a data-parallel shard of a {len(shape)}-D tensor is not supported (1-D and 2-D only)")
    cols = shape[1]
    (r0, c0), (r1, c1) = divmod(a, cols), divmod(b, cols)
    if r0 == r1:
        return [((r0, c0), (1, c1 - c0), a, b)] if c1 > c0 else []
    out, pos = [], a
    if c0:
        out.append(((r0, c0), (1, cols - c0), pos, pos + cols - c0))
        pos, r0 = pos + cols - c0, r0 + 1
    if r1 > r0:
        out.append(((r0, 0), (r1 - r0, cols), pos, pos + (r1 - r0) * cols))
        pos += (r1 - r0) * cols
    if c1:
        out.append(((r1, 0), (1, c1), pos, b))
    return out


def shard_entry(main: ParamBuffers, p: nn.Parameter, kind: str, grid: ParallelGrid) -> Any:
    """The DCP entry of this rank's data-parallel shard of p's main weights ("main") or moment; None if empty.

    A shard holding all of p (no data-parallel sharding, or a small parameter inside one shard) is the usual
    DTensor / plain tensor. Otherwise its boxes become the local shards of a ShardedTensor whose metadata lists
    the boxes of every rank holding a piece of p (their ranges follow from the shared bucket layout), each box
    at its offset in the full (tp = 1) tensor."""
    where = main.local_range(p)
    if where is None:
        return None
    view = main.shard_view(p, kind)
    a, b = where
    if (a, b) == (0, p.numel()):
        return as_saved(view.view_as(p), p, grid)
    bucket, slot = main.where(p)
    owners = slice_owners(p, grid)
    split = getattr(p, "partition_dim", None) is not None and len(owners) > 1
    n = bucket.numel // bucket.shards
    pieces = []
    for t in range(len(owners)) if split else [slice_rank(p, grid)]:
        for d in range(bucket.shards):
            x, y = max(slot.start, d * n), min(slot.end, (d + 1) * n)
            if x < y:
                pieces.append((grid.shard_owner(owners[t], d, is_expert(p)), t, x - slot.start, y - slot.start))
    return boxes_entry(view, a, p, grid, pieces)


def _full_boxes(p: nn.Parameter, grid: ParallelGrid, t: int, x: int, y: int):
    """The elements [x, y) of tp rank t's shard of p as boxes of the full tensor: (offsets, sizes, first, end,
    listed), `listed` False for a box of rows that a lower tp rank of the same kv group holds too."""
    blocks = getattr(p, "row_blocks", None)
    if blocks is None:
        dim = getattr(p, "partition_dim", None)
        for offsets, sizes, first, end in flat_boxes(p.shape, x, y):
            at = list(offsets)
            if dim is not None and grid.tp > 1:  # row blocks place the other splits
                at[dim] += t * p.shape[dim]
            yield at, sizes, first, end, True
        return
    cols = math.prod(p.shape[1:])  # from the shape: a sharded parameter's storage may be freed
    for b in blocks[t]:
        lo, hi = b.local * cols, (b.local + b.rows) * cols
        if max(x, lo) >= min(y, hi):
            continue
        shape = torch.Size([b.rows, *p.shape[1:]])
        for offsets, sizes, first, end in flat_boxes(shape, max(x, lo) - lo, min(y, hi) - lo):
            at = [offsets[0] + b.full, *offsets[1:]]
            yield at, sizes, first + lo, end + lo, not (b.shared and t % grid.kv_replicas)


def boxes_entry(view: torch.Tensor, a: int, p: nn.Parameter, grid: ParallelGrid,
                pieces: list[tuple[int, int, int, int]]) -> Any:
    """A ShardedTensor of p's full tensor from `pieces` (owner rank, tp rank, [x, y) of that tp rank's shard):
    the boxes of every piece in its metadata, those owned by this rank (its elements [a, a + view.numel()) in
    the 1-D `view`) as its local shards."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    device = str(view.device)
    local, every, copies = [], [], []
    for owner, t, x, y in pieces:
        for at, sizes, first, end, listed in _full_boxes(p, grid, t, x, y):
            md = ShardMetadata(at, list(sizes), f"rank:{owner}/{device}")
            if listed:
                every.append(md)
            if owner == grid.rank:
                (local if listed else copies).append(Shard(view[first - a:end - a].view(sizes), md))
    meta = ShardedTensorMetadata(every, full_shape_of(p, grid), TensorProperties(dtype=view.dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "deprecating ShardedTensor": DTensor has no such boxes
        out = ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)
    # A key/value box that a lower tp rank lists: a local shard all the same (DCP saves each box once, by its
    # offsets, and fills every local shard on load), kept out of the metadata, whose boxes may not overlap.
    out.local_shards().extend(copies)
    return out
