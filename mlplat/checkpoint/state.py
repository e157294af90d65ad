"""The layout-independent view of a training state: what a checkpoint holds, keyed by full-model names.

Every parameter, and each of its optimizer moments, appears under the full model's name
(`model/layers.5.attn.qkv.weight`, `optim/layers.5.attn.qkv.weight/exp_avg`). A tensor-parallel shard is a
DTensor over the tensor-parallel group, so torch.distributed.checkpoint records it as (offsets, sizes) of the
full tensor and can hand any other layout the slices it needs. Replicated copies (data-parallel replicas,
LayerNorm on every tp rank) are saved once by DCP's de-duplication. The word embedding is special: its padded
size depends on tp, so it is read back whole and re-padded for the new layout.

Device discipline: the tensor-parallel mesh takes the device type of the tensors it describes
(a CPU mesh over CUDA shards makes DTensor hand DCP CPU copies, which DCP then fills instead of the real
weights), and every tensor created here names the device it belongs on instead of relying on the default
device. tests/checkpoint/test_io.py checks both on CPU.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from mlplat.parallel.grid import ParallelGrid

WORD_EMBEDDING = "embedding.word.weight"
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


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
    """A DTensor (tp-sharded parameters) on a mesh of t's own device type, or the plain tensor (replicated)."""
    dim = getattr(p, "partition_dim", None)
    if dim is None or grid.tp == 1:
        return t
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
    """Adam's per-parameter state, created empty (step 0) if the optimizer has not stepped yet."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=adam_step_device(optimizer, p))
        for k in ADAM_MOMENTS:
            state[k] = torch.zeros_like(p, memory_format=torch.preserve_format, device=p.device)
    return state


def training_state(chunks: dict[int, nn.Module], optimizer: torch.optim.Optimizer | None, grid: ParallelGrid,
                   skip_embedding: bool = False) -> dict[str, Any]:
    """The tensors of a checkpoint as DCP state-dict entries (for saving, or as load targets)."""
    sd: dict[str, Any] = {}
    for name, p in full_parameters(chunks).items():
        if skip_embedding and name == WORD_EMBEDDING:
            continue
        sd[f"model/{name}"] = as_saved(p.data, p, grid)
        if optimizer is not None:
            st = optimizer_state_of(optimizer, p)
            sd[f"optim/{name}/step"] = st["step"]
            for k in ADAM_MOMENTS:
                sd[f"optim/{name}/{k}"] = as_saved(st[k], p, grid)
    if optimizer is not None:
        sd["optim/param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return sd
