"""Sharded, atomic, verifiable checkpoints on torch.distributed.checkpoint (DCP).

A save writes into `step-N.partial-<id>/`; when every rank has written its shards, rank 0 adds the Lightning
state and a manifest (file sizes and CRC32s) and renames the folder to `step-N/` — an atomic step on POSIX,
so a checkpoint is either complete or invisible, and a save killed half-way leaves the previous one intact.
Loading checks the manifest first and turns anything wrong into one CheckpointError line.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mlplat.checkpoint.state import ADAM_MOMENTS, WORD_EMBEDDING, full_parameters, optimizer_state_of, \
    training_state

MANIFEST = "mlplat.json"
LIGHTNING_STATE = "lightning.pt"
STEP_DIR = re.compile(r"^step-(\d+)$")


from mlplat.checkpoint import CheckpointError  # noqa: E402,F401  (defined torch-free for mlplat.train)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _broadcast(obj: Any) -> Any:
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return crc


def save(path: str | Path, chunks, optimizer, grid, lightning_state: dict, layout: dict) -> Path:
    """Every rank calls this; returns the final folder."""
    final = Path(path)
    partial = Path(_broadcast(f"{final}.partial-{uuid.uuid4().hex[:8]}"))
    if dist.get_rank() == 0 if _distributed() else True:
        partial.mkdir(parents=True, exist_ok=True)
    _barrier()
    dcp.save(training_state(chunks, optimizer, grid), checkpoint_id=str(partial))
    _barrier()
    if not _distributed() or dist.get_rank() == 0:
        torch.save(lightning_state, partial / LIGHTNING_STATE)
        files = {f.name: {"bytes": f.stat().st_size, "crc32": _crc32(f)} for f in sorted(partial.iterdir())}
        manifest = {"format": "mlplat-dcp-1", "layout": layout, "files": files,
                    "step": int(lightning_state.get("global_step", -1))}
        tmp = partial / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, partial / MANIFEST)
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)  # the checkpoint becomes visible only now, complete
        for stale in final.parent.glob(f"{final.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


def verify(path: str | Path) -> dict:
    """The manifest of a complete, intact checkpoint, or a CheckpointError naming what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a folder)")
    mf = path / MANIFEST
    if not mf.exists():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (was the save interrupted?)")
    try:
        manifest = json.loads(mf.read_text())
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: {MANIFEST} is not valid JSON ({e})") from None
    for name, want in manifest.get("files", {}).items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {path} is truncated: {name} has {size} bytes, expected {want['bytes']}")
        if _crc32(f) != want["crc32"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} fails its CRC32 check")
    return manifest


def _saved_shape(path: Path, key: str) -> torch.Size:
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    if key not in meta.state_dict_metadata:
        raise CheckpointError(f"checkpoint {path} has no entry {key!r}")
    return meta.state_dict_metadata[key].size


def load(path: str | Path, chunks, optimizer, grid, vocab_size: int) -> dict:
    """Load parameters and optimizer state into this rank's chunks, whatever layout saved them; returns
    the Lightning state (loops, schedulers, callbacks)."""
    path = Path(path)
    if not _distributed() or dist.get_rank() == 0:
        error = None
        try:
            verify(path)
        except CheckpointError as e:
            error = str(e)
    else:
        error = None
    error = _broadcast(error)
    if error:
        raise CheckpointError(error)
    params = full_parameters(chunks)
    state = training_state(chunks, optimizer, grid, skip_embedding=True)
    has_embedding = WORD_EMBEDDING in params
    keys = [f"model/{WORD_EMBEDDING}"] + ([f"optim/{WORD_EMBEDDING}/{k}" for k in ADAM_MOMENTS]
                                          if optimizer is not None else [])
    if optimizer is not None and has_embedding:
        state[f"optim/{WORD_EMBEDDING}/step"] = optimizer_state_of(optimizer, params[WORD_EMBEDDING])["step"]
    full_embedding: dict[str, torch.Tensor] = {}
    if has_embedding:
        shape = _saved_shape(path, keys[0])
        for k in keys:
            full_embedding[k] = state[k] = torch.empty(shape, dtype=params[WORD_EMBEDDING].dtype)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # DCP's own errors are long; the user needs the path and the gist
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} cannot be loaded into this model: {first}") from None
    if has_embedding:
        from mlplat.parallel.tensor import shard_of

        p = params[WORD_EMBEDDING]
        for k, full in full_embedding.items():
            # Keep the real rows; the new layout's padding is zero, as at initialisation.
            rows = full[:vocab_size]
            target = p.data if k.startswith("model/") else optimizer.state[p][k.rsplit("/", 1)[1]]
            target.copy_(shard_of(rows, p, grid))
        for chunk in chunks.values():  # the last stage's tied copy gets the same values
            if hasattr(chunk, "lm_head") and chunk.lm_head is not p:
                chunk.lm_head.data.copy_(p.data)
                if optimizer is not None:
                    for k in ADAM_MOMENTS + ("step",):
                        optimizer_state_of(optimizer, chunk.lm_head)[k].copy_(optimizer.state[p][k])
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, state["optim/param_groups"]):
            group.update(saved)
    return torch.load(path / LIGHTNING_STATE, weights_only=False)


def checkpoint_dirs(root: str | Path) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def find_last(root: str | Path) -> Path | None:
    """The newest complete checkpoint under root (partial saves are never listed)."""
    dirs = checkpoint_dirs(root)
    return dirs[-1][1] if dirs else None
