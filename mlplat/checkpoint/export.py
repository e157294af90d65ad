"""Consolidate a sharded checkpoint into one file of full tensors with plain names, for use outside mlplat.

    python -m mlplat.checkpoint.export DIR/checkpoints/step-100 model.pt

The result is a `torch.save`d dict: full-model parameter name -> tensor (the word embedding without its
tensor-parallel padding), plus `"__mlplat__"` with the layout and step it was saved at. It runs in one
process, without a process group, using DCP's own converter.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mlplat.checkpoint.io import CheckpointError, verify
from mlplat.checkpoint.state import WORD_EMBEDDING


def consolidate(ckpt: str | Path, vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    manifest = verify(ckpt)
    with tempfile.TemporaryDirectory() as tmp:
        flat = Path(tmp) / "all.pt"
        dcp_to_torch_save(str(ckpt), str(flat))
        everything = torch.load(flat, weights_only=True)  # plain data only: tensors and optimizer settings
    weights = {k[len("model/"):]: v for k, v in everything.items() if k.startswith("model/")}
    vocab = vocab_size or manifest.get("layout", {}).get("vocab_size")
    if vocab and WORD_EMBEDDING in weights:
        weights[WORD_EMBEDDING] = weights[WORD_EMBEDDING][:vocab].clone()
    weights["__mlplat__"] = {"layout": manifest.get("layout"), "step": manifest.get("step")}
    return weights


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlplat.checkpoint.export", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a checkpoint folder, e.g. outputs/.../checkpoints/step-100")
    ap.add_argument("output", help="the .pt file to write")
    ap.add_argument("--vocab-size", type=int, default=None, help="real vocabulary (default: from the checkpoint)")
    args = ap.parse_args(argv)
    try:
        weights = consolidate(args.checkpoint, args.vocab_size)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.save(weights, args.output)
    n = sum(v.numel() for k, v in weights.items() if isinstance(v, torch.Tensor))
    print(f"wrote {args.output}: {len(weights) - 1} tensors, {n:,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
