"""The paper's FLOP formulas and the closed-form parameter count of mlplat's GPT.

Notation (Narayanan et al., SC21, §5.1 and Appendix): B global batch, s sequence length, l layers,
h hidden size, V (padded) vocabulary, a heads, t tensor-parallel size.

FLOPs per iteration, counting only GEMMs (a multiply-add = 2 FLOPs):
  model FLOPs (forward + backward, no recomputation)  72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))
  with full activation recomputation                   96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))
The paper's Table 1 teraFLOP/s count the recomputation (the 96 formula) -- "hardware FLOPs". MFU uses the
model FLOPs (72 formula), as PaLM and everyone since define it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from mlplat.config import ModelConfig
from mlplat.parallel.pipeline.layout import PipelineLayout
from mlplat.parallel.vocab import pad_vocab_size as padded_vocab


@dataclass(frozen=True)
class ModelDims:
    """The `model.*` keys that set the shape of the GPT."""

    n_layers: int
    hidden: int
    n_heads: int
    seq_len: int
    vocab_size: int
    ffn_hidden: int | None = None  # None = 4·hidden (the paper)
    vocab_pad_multiple: int = 128  # vocabulary padded to a multiple of this × t

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @classmethod
    def of(cls, model: ModelConfig) -> "ModelDims":
        # vocab_size null follows the data's tokenizer; not resolved yet, it is the default byte tokenizer's 256.
        return cls(n_layers=model.n_layers, hidden=model.hidden, n_heads=model.n_heads, seq_len=model.seq_len,
                   vocab_size=256 if model.vocab_size is None else model.vocab_size, ffn_hidden=model.ffn_hidden,
                   vocab_pad_multiple=model.vocab_pad_multiple)

    @classmethod
    def from_config(cls, model: Mapping[str, Any]) -> "ModelDims":
        """From a `model.*` mapping (e.g. a conf/model/ file), read as the run config reads it."""
        from mlplat.config import from_dict

        return cls.of(from_dict({"model": dict(model)}).model)


# ---------------------------------------------------------------------------------------------- parameters

def layer_parameters(h: int, tp: int = 1, ffn: int | None = None) -> int:
    """Parameters of one transformer layer held by one tensor-parallel rank.

    LN1 (2h) + QKV (3h·h + 3h, column-parallel) + attention out (h·h row-parallel, bias h replicated)
    + LN2 (2h) + MLP fc1 (h·ffn + ffn, column-parallel) + fc2 (ffn·h row-parallel, bias h replicated).
    With t = 1 and ffn = 4h: 12h² + 13h.
    """
    ffn = ffn or 4 * h
    sharded = (3 * h * h + 3 * h) + h * h + (h * ffn + ffn) + ffn * h
    replicated = 2 * h + h + 2 * h + h  # LN1, out bias, LN2, fc2 bias
    assert sharded % tp == 0, f"layer of hidden {h} / ffn {ffn} does not split over t={tp}"
    return sharded // tp + replicated


def embedding_parameters(dims: ModelDims, tp: int = 1) -> int:
    """Word embedding shard [V_pad/t, h] + learned position embedding [s, h] (replicated)."""
    v = padded_vocab(dims.vocab_size, tp, dims.vocab_pad_multiple)
    return v // tp * dims.hidden + dims.seq_len * dims.hidden


def parameter_count(dims: ModelDims, tp: int = 1) -> int:
    """Total parameters of the full model: l·(12h² + 13h) + V_pad·h + s·h + 2h (tied output embedding
    counted once). `tp` only changes the vocabulary padding."""
    h, ffn = dims.hidden, dims.ffn
    v = padded_vocab(dims.vocab_size, tp, dims.vocab_pad_multiple)
    return dims.n_layers * layer_parameters(h, 1, ffn) + v * h + dims.seq_len * h + 2 * h


def stage_parameters(dims: ModelDims, tp: int, pipeline: PipelineLayout) -> list[int]:
    """Parameters on one GPU (tensor-parallel rank 0) of each pipeline rank.

    Each rank holds its chunks of l/(p·v) layers; chunk 0 adds the embeddings, the last chunk the final LN and,
    when it lives on another rank than chunk 0, its own copy of the tied word embedding (summed with the first
    stage's gradient), so that copy counts on both GPUs but once in the total.
    """
    n_chunks = pipeline.num_chunks
    assert dims.n_layers % n_chunks == 0, f"model.n_layers={dims.n_layers} not divisible by p·v={n_chunks}"
    per_chunk = pipeline.layers_per_chunk(dims.n_layers) * layer_parameters(dims.hidden, tp, dims.ffn)
    v_shard = padded_vocab(dims.vocab_size, tp, dims.vocab_pad_multiple) // tp * dims.hidden
    first, last = pipeline.owner(0), pipeline.owner(pipeline.last_chunk)
    out = []
    for r in range(pipeline.pp):
        n = len(pipeline.chunks_of(r)) * per_chunk
        if r == first:
            n += embedding_parameters(dims, tp)
        if r == last:
            n += 2 * dims.hidden + (v_shard if last != first else 0)
        out.append(n)
    return out


# ---------------------------------------------------------------------------------------------- FLOPs

def model_flops_per_iteration(dims: ModelDims, global_batch: int, tp: int = 1) -> float:
    """72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)): forward + backward, no recomputation (use for MFU)."""
    B, s, l, h = global_batch, dims.seq_len, dims.n_layers, dims.hidden
    V = padded_vocab(dims.vocab_size, tp, dims.vocab_pad_multiple)
    return 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def hardware_flops_per_iteration(dims: ModelDims, global_batch: int, recompute: str = "full", tp: int = 1) -> float:
    """FLOPs the GPUs actually execute, the paper's convention for its teraFLOP/s.

    full:      96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) (one extra forward of every layer, not of the logits)
    selective: model FLOPs + the recomputed attention core, 4·B·s²·h per layer (QKᵀ and attention·V)
    none:      model FLOPs
    """
    B, s, l, h = global_batch, dims.seq_len, dims.n_layers, dims.hidden
    V = padded_vocab(dims.vocab_size, tp, dims.vocab_pad_multiple)
    if recompute == "full":
        return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    base = model_flops_per_iteration(dims, global_batch, tp)
    if recompute == "selective":
        return base + 4.0 * B * s * s * h * l
    if recompute == "none":
        return base
    raise ValueError(f"kernels.recompute={recompute!r} is not one of none, selective, full")


def model_flops_per_token(dims: ModelDims, tp: int = 1) -> float:
    """72·l·h²·(1 + s/(6h) + V/(12·l·h)): the model FLOPs of one token of a length-s sequence."""
    return model_flops_per_iteration(dims, 1, tp) / dims.seq_len


def tflops_per_gpu(flops: float, seconds: float, n_gpus: int) -> float:
    return flops / seconds / n_gpus / 1e12


def model_tflops_per_gpu(tokens_per_s: float, n_gpus: int, dims: ModelDims, tp: int = 1) -> float:
    """tokens/s (whole job) -> model TFLOP/s per GPU."""
    return tokens_per_s * model_flops_per_token(dims, tp) / n_gpus / 1e12


def mfu(tokens_per_s: float, n_gpus: int, dims: ModelDims, peak_flops_per_gpu: float, tp: int = 1) -> float:
    """Model FLOPs utilisation: model FLOP/s achieved / peak FLOP/s, both per GPU."""
    return model_tflops_per_gpu(tokens_per_s, n_gpus, dims, tp) * 1e12 / peak_flops_per_gpu
