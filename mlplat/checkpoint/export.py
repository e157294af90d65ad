"""Consolidate a sharded checkpoint into one file of full tensors with plain names, for use outside mlplat.

    python -m mlplat.checkpoint.export DIR/checkpoints/step-100 model.pt
    python -m mlplat.checkpoint.export DIR/checkpoints/step-100 OUT --format hf   # a transformers model directory

`--format hf` writes a directory that transformers loads (`mlplat.checkpoint.hf_export`, streamed one tensor
at a time). `--format torch`, the default, writes a `torch.save`d dict: full-model parameter name -> tensor
(the word embedding and output layer without their tensor-parallel padding; an MoE layer's expert bias too, which
chooses its experts: `layers.<i>.mlp.expert_bias`), plus `"__mlplat__"` with the layout and
step it was saved at. It runs in one process, without a process group, using DCP's own converter.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mlplat.checkpoint.io import CheckpointError, verify
from mlplat.checkpoint.state import VOCAB_ROWS


def consolidate(ckpt: str | Path, vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    manifest = verify(ckpt)
    with tempfile.TemporaryDirectory() as tmp:
        flat = Path(tmp) / "all.pt"
        dcp_to_torch_save(str(ckpt), str(flat))
        everything = torch.load(flat, weights_only=True)  # plain data only: tensors and optimizer settings
    weights = {k[len("model/"):]: v for k, v in everything.items() if k.startswith("model/")}
    vocab = vocab_size or manifest.get("layout", {}).get("vocab_size")
    for full in VOCAB_ROWS:
        if vocab and full in weights:
            weights[full] = weights[full][:vocab].clone()
    weights["__mlplat__"] = {"layout": manifest.get("layout"), "step": manifest.get("step")}
    return weights


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlplat.checkpoint.export", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a checkpoint folder, e.g. outputs/.../checkpoints/step-100")
    ap.add_argument("output", help="the .pt file to write (--format torch) or the directory (--format hf)")
    ap.add_argument("--vocab-size", type=int, default=None, help="real vocabulary (default: from the checkpoint)")
    ap.add_argument("--format", choices=("torch", "hf"), default="torch",
                    help="torch: one torch.save'd dict (default); hf: a transformers model directory")
    ap.add_argument("--max-shard-gb", type=float, default=5.0, help="--format hf: split the safetensors above this")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output (refused otherwise)")
    args = ap.parse_args(argv)
    problem = _refusal(args)
    if problem is not None:  # before the checkpoint is read: a load can take minutes
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.format == "hf":
        return _export_hf(args)
    try:
        weights = consolidate(args.checkpoint, args.vocab_size)
        rows = [weights[full].shape[0] for full in VOCAB_ROWS if full in weights]
        if args.vocab_size is not None and rows and args.vocab_size > rows[0]:
            raise CheckpointError(f"--vocab-size={args.vocab_size} exceeds the checkpoint's vocabulary table "
                                  f"({rows[0]} rows)")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.save(weights, args.output)
    n = sum(v.numel() for k, v in weights.items() if isinstance(v, torch.Tensor))
    print(f"wrote {args.output}: {len(weights) - 1} tensors, {n:,} parameters")
    return 0


def _refusal(args) -> str | None:
    """What is wrong with the arguments themselves, in one line; None when nothing is."""
    out = Path(args.output)
    if not (math.isfinite(args.max_shard_gb) and args.max_shard_gb > 0):  # nan and inf parse as floats
        return f"--max-shard-gb={args.max_shard_gb} must be a positive number of GB"
    if args.vocab_size is not None and args.vocab_size < 1:
        return f"--vocab-size={args.vocab_size} must be at least 1"
    if not out.parent.is_dir():
        return f"{out}: its folder {out.parent} does not exist"
    if out.exists() and not args.overwrite and (out.is_file() or any(out.iterdir())):
        return f"{out} exists; pass --overwrite to replace it"
    return None


def _export_hf(args) -> int:
    from mlplat.checkpoint.hf_export import export_hf

    if args.vocab_size is not None:
        print("error: --vocab-size applies to --format torch only (hf takes it from the checkpoint)", file=sys.stderr)
        return 2
    try:
        done = export_hf(args.checkpoint, args.output, int(args.max_shard_gb * 1024**3))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files = done["files"][0] if len(done["files"]) == 1 else f"{len(done['files'])} safetensors shards"
    print(f"wrote {args.output} ({done['class']}): {files}, {done['tensors']} tensors, "
          f"{done['parameters']:,} parameters; {done['tokenizer']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
