"""mlplat's GPT parameters <-> transformers' GPT-2 tensors, both ways, one tensor (or one rank's shard) at a time.

Names: mlplat's full-model names (`layers.3.attn.qkv.weight`) <-> GPT-2's (`transformer.h.3.attn.c_attn.weight`).
Layouts:
- GPT-2's `Conv1D` stores its weight [in, out]; mlplat's linear layers [out, in]: a transpose.
- GPT-2's `c_attn` output is q|k|v blocks, each [heads·head_dim]; mlplat's QKV output is [head][q|k|v][head_dim],
  so that a tensor-parallel rank's contiguous slice is whole heads: a permutation.
- The word embedding: GPT-2 holds the true vocabulary; mlplat pads it with zero rows for tensor parallelism.

Import (`load_into`) reads, on each rank, only the rows or columns of that rank's shard (safetensors `get_slice`),
so no rank ever materialises a full tensor of the model.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

import torch

from mlplat.checkpoint import CheckpointError
from mlplat.checkpoint.hf_config import WEIGHTS_FILE, WEIGHTS_INDEX
from mlplat.checkpoint.state import WORD_EMBEDDING
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.tensor import partition_dim_of

HF_PREFIX = "transformer."  # GPT2LMHeadModel's body; a bare GPT2Model's files have no prefix
_TOP = {WORD_EMBEDDING: "wte.weight", "embedding.position.weight": "wpe.weight",
        "final_ln.weight": "ln_f.weight", "final_ln.bias": "ln_f.bias"}
_IN_LAYER = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.out": "attn.c_proj",
             "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_CONV1D = ("attn.qkv", "attn.out", "mlp.fc1", "mlp.fc2")  # GPT-2 Conv1D layers: weights stored transposed


def hf_name(full: str) -> str:
    """GPT-2's name (as GPT2LMHeadModel saves it) of an mlplat full-model parameter name."""
    if full in _TOP:
        return HF_PREFIX + _TOP[full]
    m = _LAYER.match(full)
    if m is None or m.group(2) not in _IN_LAYER:
        raise ValueError(f"parameter {full} has no GPT-2 counterpart")
    return f"{HF_PREFIX}h.{m.group(1)}.{_IN_LAYER[m.group(2)]}.{m.group(3)}"


def _module(full: str) -> str | None:
    m = _LAYER.match(full)
    return m.group(2) if m else None


def to_hf_view(full: str, t: torch.Tensor, n_heads: int,
               vocab_size: int) -> tuple[str, torch.Tensor, tuple[int, ...]]:
    """(GPT-2 name, a view of `t`, GPT-2's shape): the view's elements in row-major order are GPT-2's tensor, so a
    writer can copy it out in blocks along dim 0 without a full second copy. Exact (slices and permutations
    only); works on the meta device."""
    module = _module(full)
    shape = tuple(t.shape)
    if full == WORD_EMBEDDING:
        t = t[:vocab_size]  # drop the tensor-parallel padding rows
        shape = tuple(t.shape)
    elif module == "attn.qkv":
        # Output dim [head][q|k|v][head_dim] -> [q|k|v][head][head_dim]; the weight also goes [out, in] -> [in, out].
        if t.dim() == 2:
            t = t.view(n_heads, 3, -1, shape[1]).permute(3, 1, 0, 2)
            shape = (shape[1], shape[0])
        else:
            t = t.view(n_heads, 3, -1).transpose(0, 1)
    elif module in _CONV1D and t.dim() == 2:
        t = t.t()
        shape = tuple(t.shape)
    return hf_name(full), t, shape


class GPT2Weights:
    """The safetensors files of a transformers GPT-2 directory (one file, or shards with an index), opened
    lazily; tensors are read by slice. Use as a context manager."""

    def __init__(self, path: str | Path):
        self.root = Path(path)
        index = self.root / WEIGHTS_INDEX
        if (self.root / WEIGHTS_FILE).exists():
            from safetensors import safe_open

            with safe_open(str(self.root / WEIGHTS_FILE), framework="pt") as f:
                self.files = {name: WEIGHTS_FILE for name in f.keys()}
        elif index.exists():
            self.files = dict(json.loads(index.read_text())["weight_map"])
        else:
            raise CheckpointError(f"init_from={path} has no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX})")
        self._open: dict[str, object] = {}

    def __enter__(self) -> "GPT2Weights":
        return self

    def __exit__(self, *exc) -> None:
        self._open.clear()  # safe_open handles unmap when dropped

    def slice(self, name: str):
        """safetensors' lazy slice of tensor `name` (GPT2LMHeadModel's name; a GPT2Model file's bare name works)."""
        key = name if name in self.files else name.removeprefix(HF_PREFIX)
        if key not in self.files:
            raise CheckpointError(f"init_from={self.root} has no tensor {name}")
        file = self.files[key]
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = safe_open(str(self.root / file), framework="pt")
        return self._open[file].get_slice(key)

    def read_shard(self, full: str, param: torch.Tensor, grid: ParallelGrid, n_heads: int) -> torch.Tensor:
        """This tensor-parallel rank's part of mlplat parameter `full`, shaped like `param`, reading only it."""
        src = self.slice(hf_name(full))
        shape = src.get_shape()
        dim, module = partition_dim_of(param), _module(full)
        rank = grid.tp_rank if dim is not None else 0
        if full == WORD_EMBEDDING:
            rows = param.shape[0]
            start = rank * rows
            real = max(0, min(rows, shape[0] - start))  # rows past the true vocabulary are padding: zero
            t = torch.zeros(param.shape, dtype=param.dtype)
            if real:
                t[:real] = src[start:start + real]
        elif module == "attn.qkv":
            hidden = shape[0] if len(shape) == 2 else shape[0] // 3
            head_dim = hidden // n_heads
            heads = param.shape[0] // (3 * head_dim)
            lo = rank * heads * head_dim
            # This rank's heads, from each of the q, k and v blocks, back into [head][q|k|v][head_dim].
            cols = [(j * hidden + lo, j * hidden + lo + heads * head_dim) for j in range(3)]
            if len(shape) == 2:
                t = torch.stack([src[:, a:b] for a, b in cols]).view(3, hidden, heads, head_dim)
                t = t.permute(2, 0, 3, 1).reshape(param.shape)
            else:
                t = torch.stack([src[a:b] for a, b in cols]).view(3, heads, head_dim).transpose(0, 1).reshape(-1)
        elif module in _CONV1D and param.dim() == 2:
            # mlplat's weight is the transpose of GPT-2's: its split dimension is the other one there.
            size = param.shape[dim]
            lo = rank * size
            t = (src[:, lo:lo + size] if dim == 0 else src[lo:lo + size]).t()
        elif dim is not None:
            size = param.shape[dim]
            t = src[rank * size:(rank + 1) * size]
        else:
            t = src[:]
        if tuple(t.shape) != tuple(param.shape):
            raise CheckpointError(f"init_from={self.root}: {hf_name(full)} gives a {tuple(t.shape)} shard for "
                                  f"{full}, which is {tuple(param.shape)} on this rank")
        return t


@torch.no_grad()
def load_into(chunks: Iterable, path: str | Path, grid: ParallelGrid) -> None:
    """Copy a transformers GPT-2 directory's weights into this rank's model chunks (any layout); each rank reads
    only its own shards. The tied output embedding on the last stage is read like the input one."""
    with GPT2Weights(path) as src:
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                param.copy_(src.read_shard(chunk.full_name(name), param, grid, chunk.cfg.n_heads))
