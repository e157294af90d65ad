"""Export a sharded checkpoint as a transformers model directory, streaming one tensor at a time.

    python -m mlplat.checkpoint.export DIR/checkpoints/step-100 OUT --format hf

OUT gets `config.json` (from the model keys the checkpoint's manifest records: for model.arch=gpt, GPT2LMHeadModel
with learned positions and GPTNeoXForCausalLM with rotary ones, as the main job's model=tiny_rope has; for
model.arch=llama, Qwen3ForCausalLM with model.qk_norm, Qwen2ForCausalLM when the QKV projection has biases, else
LlamaForCausalLM, which is also what a Mistral without a sliding window is; a mixture of experts as
DeepseekV3ForCausalLM with model.attention=mla and the sigmoid router (its multi-token prediction modules as layers
past the last, with copies of the embedding and output layer), DeepseekV2ForCausalLM with model.attention=mla, else
Glm4MoeForCausalLM with the sigmoid router (its expert biases as e_score_correction_bias, its multi-token prediction
modules as DeepSeek-V3's are), Qwen3MoeForCausalLM with
model.qk_norm, Qwen2MoeForCausalLM with shared experts, else MixtralForCausalLM, in the Hub's per-expert names), the
weights as safetensors and, when the run used a Hugging Face tokenizer, its files (and config.json's bos/eos token
ids from them). `AutoModelForCausalLM.from_pretrained(OUT)` loads it with no custom code.

Streaming: the DCP metadata gives every tensor's full shape and dtype, so each safetensors header is written
first; then each tensor is read from the DCP shards alone (whatever layout saved them), viewed in transformers'
layout (mlplat's QKV gives three tensors, a SwiGLU fc1 two, the experts' fc1 two per expert and their fc2 one per
expert: the last tensor read is kept for its other parts), written in blocks of rows and dropped. Memory peaks at
one full tensor plus one block, whatever the model's size; no process group is needed.
Above `max_shard_bytes` the weights are split into `model-0000i-of-0000n.safetensors` plus the index transformers
reads.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp

from mlplat.checkpoint import CheckpointError
from mlplat.checkpoint.hf import MTP_COPIES, MTP_LAYOUTS, NAMES, hf_names, layout_of, to_hf_views
from mlplat.checkpoint.hf_config import (
    CAUSAL_LM,
    CONFIG_FILE,
    MOE_CLASS_RULE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    attention_refusal,
    hf_class,
    hf_config,
    model_config_of,
    moe_type,
    not_moe_class,
)
from mlplat.checkpoint.state import WORD_EMBEDDING

SAFETENSORS_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "tokenizer.model")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
WRITE_BLOCK_BYTES = 64 * 1024**2  # a transposed tensor is copied out this much at a time


def write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                      tensor_of: Callable[[str], torch.Tensor]) -> None:
    """A safetensors file whose tensors are produced one at a time by `tensor_of(name)`, in `entries` order: each
    a tensor whose row-major elements are the entry's (any shape and strides, e.g. a transposed view), copied
    out in blocks along its dim 0. The format: 8-byte little-endian header length, a JSON
    header (dtype, shape, byte range of each tensor), the raw little-endian bytes back to back."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in entries:
            t = tensor_of(name)
            if t.numel() != math.prod(shape) or t.dtype != dtype:
                raise CheckpointError(f"{name}: got {tuple(t.shape)} {t.dtype}, the header says {shape} {dtype}")
            t = t.reshape(1) if t.dim() == 0 else t
            rows = max(1, WRITE_BLOCK_BYTES // max(1, t[0].numel() * dtype.itemsize))
            for start in range(0, t.shape[0], rows):
                f.write(t[start:start + rows].contiguous().view(-1).view(torch.uint8).numpy().data)
            t = None  # dropped before the next tensor is read
    os.replace(tmp, path)


def _read_entry(ckpt: Path, key: str, meta) -> torch.Tensor:
    """One full tensor of the checkpoint, assembled by DCP from whichever shards hold it (and only those)."""
    t = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({key: t}, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=True)
    return t


def copy_tokenizer(spec: str | None, out: Path) -> str:
    """Put the run's tokenizer files into `out`; returns what was done, for the user. `byte` (mlplat's own
    byte-level ids) has no Hugging Face counterpart and is skipped; a directory's tokenizer files, or a single
    tokenizer.json, are copied; any other name is asked of transformers' AutoTokenizer (its cache or the Hub)."""
    if spec in (None, "", "byte"):
        return "tokenizer: byte-level ids 0..255 (no Hugging Face tokenizer files)"
    src = Path(str(spec)).expanduser()
    if src.is_dir():
        found = [n for n in TOKENIZER_FILES if (src / n).exists()]
        for n in found:
            shutil.copy2(src / n, out / n)
        return f"tokenizer: copied {', '.join(found) or 'nothing (no tokenizer files found)'} from {src}"
    if src.is_file():
        shutil.copy2(src, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        return f"tokenizer: copied {src} as tokenizer.json"
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(spec)).save_pretrained(str(out))
        return f"tokenizer: saved transformers' {spec!r} tokenizer"
    except Exception as e:  # noqa: BLE001 - no transformers, no cache, no network: the weights are still good
        return f"tokenizer: {spec!r} could not be saved ({type(e).__name__}); add its files to {out} by hand"


def special_token_ids(out: Path) -> tuple[int | None, int | None]:
    """(bos_token_id, eos_token_id) of the tokenizer files in `out`, as transformers' AutoTokenizer reads them; None
    where the tokenizer names no such token, or there are no tokenizer files (the byte tokenizer), or transformers
    cannot read them (the ids stay unknown rather than guessed)."""
    if not any((out / name).exists() for name in TOKENIZER_FILES):
        return None, None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    except Exception:  # noqa: BLE001 - no transformers, or files it cannot read: the weights are still good
        return None, None
    return tokenizer.bos_token_id, tokenizer.eos_token_id


def _is_expert_bias(key: str) -> bool:
    """A checkpoint entry that is an MoE layer's expert bias (`model/layers.<i>.mlp.expert_bias`), not a weight."""
    return key.endswith(".mlp.expert_bias")


def _natural(key: str) -> tuple:
    """`model/layers.10...` after `model/layers.9...`: digit runs compare as numbers."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key))


def export_hf(ckpt: str | Path, out: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
    """Write `out` as a transformers model directory from checkpoint `ckpt`; returns a summary."""
    from mlplat.checkpoint.io import verify

    ckpt, out = Path(ckpt), Path(out)
    layout = verify(ckpt).get("layout") or {}
    model = layout.get("model")
    if not model:
        raise CheckpointError(f"checkpoint {ckpt} records no model config in its manifest (saved before "
                              f"export --format hf existed); resume it and save again to export it")
    if (why := attention_refusal(model)) is not None:
        raise CheckpointError(f"checkpoint {ckpt}: {why}")
    if (model.get("moe") or {}).get("num_experts", 0) > 0 and hf_class(model) is None:
        raise CheckpointError(f"checkpoint {ckpt}'s mixture of experts has no transformers class: --format hf "
                              f"writes it as {CAUSAL_LM[moe_type(model)]} ({MOE_CLASS_RULE}), which it is not: "
                              f"{not_moe_class(model)}")
    if hf_class(model) is None:
        shown = ", ".join(f"{k}={model.get(k)}" for k in ("arch", "position", "norm", "mlp", "bias", "qkv_bias",
                                                          "qk_norm", "n_kv_heads"))
        raise CheckpointError(f"checkpoint {ckpt}'s model ({shown}) has no transformers class: --format hf "
                              f"writes GPT-2 (arch=gpt as GPT-2 has it), GPT-NeoX (arch=gpt with rope, layernorm, "
                              f"gelu, bias=true, n_kv_heads=n_heads) and Llama/Qwen2/Qwen3 (arch=llama with rope, "
                              f"rmsnorm, swiglu, bias=false; Qwen3: qk_norm without qkv_bias)")
    metadata = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    entries, source = [], {}
    for key in sorted((k for k in metadata if k.startswith("model/")), key=_natural):
        meta = metadata[key]
        probe = torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
        for part, (name, _, shape) in enumerate(to_hf_views(key[len("model/"):], probe, model)):
            entries.append((name, shape, meta.properties.dtype))
            source[name] = (key, meta, part)
    # DeepSeek-V3's and GLM-4.5's multi-token prediction layers keep copies of the embedding and the output layer, as
    # their releases have them (mlplat's modules share the model's; a tied output layer is the embedding)
    names_of = layout_of(model)
    if names_of in MTP_LAYOUTS:  # (DeepSeek-V2's depth is 0)
        config = model_config_of(model)
        written = {n: (s, d) for n, s, d in entries}
        for k in range(config.mtp.depth):
            for full, copy in MTP_COPIES.items():
                main = hf_names(full, names_of)[0]
                main = main if main in written else hf_names(WORD_EMBEDDING, names_of)[0]
                name = f"{NAMES[names_of].layers}{config.n_layers + k}.{copy}"
                shape, dtype = written[main]
                entries.append((name, shape, dtype))
                source[name] = source[main]
    dtypes = {d for name, _, d in entries if not _is_expert_bias(source[name][0])}
    if len(dtypes) != 1:
        raise CheckpointError(f"checkpoint {ckpt} mixes parameter dtypes {sorted(map(str, dtypes))}")
    # The expert biases (float64 in mlplat whatever the weights) as the releases keep them: float32, or float64
    # beside float64 weights, so that a float64 model's round trip is exact.
    bias_dtype = torch.float64 if torch.float64 in dtypes else torch.float32
    entries = [(n, shape, bias_dtype if _is_expert_bias(source[n][0]) else d) for n, shape, d in entries]
    last: dict[str, torch.Tensor] = {}  # the last full tensor read: QKV's three parts, fc1's two, read once

    def tensor_of(name: str) -> torch.Tensor:
        key, meta, part = source[name]
        if key not in last:
            last.clear()  # dropped before the next one is read
            last[key] = _read_entry(ckpt, key, meta)
        view = to_hf_views(key[len("model/"):], last[key], model)[part][1]
        return view.to(bias_dtype) if _is_expert_bias(key) else view

    shards: list[list] = [[]]
    size = 0
    for e in entries:
        nbytes = math.prod(e[1]) * e[2].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    for stale in [out / WEIGHTS_FILE, out / WEIGHTS_INDEX, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)  # a previous export's weights would shadow or mix with these
    names = [WEIGHTS_FILE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, part in zip(names, shards):
        write_safetensors(out / file, part, tensor_of)
    last.clear()
    total = sum(math.prod(s) * d.itemsize for _, s, d in entries)
    if len(shards) > 1:
        weight_map = {name: file for file, part in zip(names, shards) for name, _, _ in part}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / WEIGHTS_INDEX).write_text(json.dumps(index, indent=1))
    tokenizer = copy_tokenizer(layout.get("tokenizer"), out)
    bos, eos = special_token_ids(out) if layout.get("tokenizer") not in (None, "", "byte") else (None, None)
    dtype = str(dtypes.pop()).removeprefix("torch.")
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(model, dtype, bos, eos), indent=1))
    return {"files": names, "tensors": len(entries), "parameters": sum(math.prod(s) for _, s, _ in entries),
            "bytes": total, "tokenizer": tokenizer, "class": hf_class(model)[1]}
