"""Rotary position embedding (Su et al., RoFormer), with Llama 3.1's and YaRN's frequency scaling.

Each pair of channels (j, j + d/2) of a query or key head at position p is rotated by the angle p·θ_j, with
θ_j = rope_theta^(-2j/d): q·k then depends on positions only through their difference. The pairs are the two
halves of the head ("rotate half", the layout transformers' Llama and Qwen2 weights use), not neighbouring
channels. Llama 3.1's `rope_scaling` divides the low frequencies (wavelengths past
original_max_position_embeddings / low_freq_factor) by `factor`, keeps the high ones (wavelengths under
original_max_position_embeddings / high_freq_factor) and blends the band between.

Partial rotary (`model.rotary_dim` r < d, GLM-4.5's half of each head): the pairs (j, j + r/2) of a head's first r
channels are turned, with θ_j = rope_theta^(-2j/r), and its other d - r channels pass as they are (transformers'
Glm4Moe and GPT-NeoX's rotary_pct alike: rotate half within the first r).

YaRN (Peng et al., 2023; `rope_type` yarn, DeepSeek-V3's config names it `type`) interpolates by `factor` the pairs
that turn fewer than beta_slow times over original_max_position_embeddings, keeps those turning more than beta_fast
times, ramps linearly between (the band's ends rounded outwards, as transformers rounds them), and multiplies cos and
sin by its attention factor, 0.1·ln(factor) + 1, or with `mscale` and `mscale_all_dim` the ratio of their two such
factors (1 at DeepSeek-V3's mscale = mscale_all_dim = 1): the rotated channels' scores scale by its square.
Multi-head latent attention further multiplies every score by the square of mscale_all_dim's factor
(`softmax_factor`), as DeepSeek's reference does: transformers folds it into DeepseekV3Attention's softmax scale.

The pairs mlplat rotates are always the two halves of the rotated channels. DeepSeek-V3's released weights rotate
neighbouring channels (transformers' `rope_interleave`): the same rotation with the channels of q's and k's rotary
rows permuted, which is how those weights are read in.

The cos/sin tables are computed in float32, as transformers and Megatron-Core compute them, and cast to the
activations' dtype: an imported model then sees exactly the tables it was trained with, in any precision. One
table per chunk and (length, offset, device, dtype), built on first use for the positions that chunk sees.
"""
from __future__ import annotations

import math

import torch

from mlplat.model.fused import fused_rotary_embedding, rotary_embedding


def scaling_kind(scaling: dict | None) -> str | None:
    """model.rope_scaling's rope_type (or DeepSeek's `type`): llama3 unless it says yarn; None without scaling."""
    return None if scaling is None else scaling.get("rope_type", scaling.get("type", "llama3"))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times: 0.1·mscale·ln(factor) + 1 (1 unstretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict | None) -> float:
    """What YaRN multiplies cos and sin by (1 for other scalings)."""
    if scaling_kind(scaling) != "yarn":
        return 1.0
    factor, mscale, mscale_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


def softmax_factor(scaling: dict | None) -> float:
    """MLA's factor on every score under YaRN with mscale_all_dim: its magnitude correction squared (else 1)."""
    if scaling_kind(scaling) != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


def _yarn(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN's θ_j (module doc), float32."""
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times over the context
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(pair_turning(fast)), 0), min(math.ceil(pair_turning(slow)), dim - 1)
    if low == high:
        high += 0.001  # a band of one pair: a step, not a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 0: kept, 1: interpolated
    keep = 1 - ramp  # the blend written as transformers writes it, so that float32 rounds alike
    wavelengths = theta ** (torch.arange(0, dim, 2).float() / dim)
    kept, interpolated = 1.0 / wavelengths, 1.0 / (factor * wavelengths)
    return interpolated * (1 - keep) + kept * keep


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """θ_j for j < head_dim/2, float32, Llama 3.1- or YaRN-scaled when `scaling` is given."""
    if scaling_kind(scaling) == "yarn":
        return _yarn(head_dim, theta, scaling)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv
    scaled = torch.where(wavelength > context / low, inv / factor, inv)
    smooth = (context / wavelength - low) / (high - low)  # 0 at the low band's edge, 1 at the high band's
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(middle, blended, scaled)


class Rotary:
    """The rotation of one model chunk: shared by its layers (a plain object, not a module: no state to save)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        """`head_dim`: the channels it turns (model.rotary_dim resolved: the head or its first rotary_dim; MLA's
        rotary part)."""
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)
        self.attention_factor = attention_factor(scaling)
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, length: int, device: torch.device, dtype: torch.dtype,
               offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [length, the channels turned], for positions offset .. offset + length - 1."""
        key = (length, offset, device, dtype)
        if key not in self._tables:
            positions = torch.arange(offset, offset + length, dtype=torch.float32)
            angles = positions[:, None] * self.inv_freq[None, :]
            angles = torch.cat((angles, angles), dim=-1)
            cos, sin = angles.cos(), angles.sin()
            if self.attention_factor != 1.0:  # YaRN's, in float32 as transformers applies it
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            self._tables[key] = (cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype))
        return self._tables[key]

    def gathered(self, positions: torch.Tensor, window: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [b or 1, 1, s, head_dim] of `positions` [b or 1, s] (all < window), taken from the window's
        table; the last micro-batch's are kept, as every layer of the chunk rotates by the same positions."""
        last = self.__dict__.get("_last")
        if last is None or last[0] is not positions or last[1] != (device, dtype):
            cos, sin = self.tables(window, device, dtype)
            last = (positions, (device, dtype), cos[positions][:, None], sin[positions][:, None])
            self._last = last
        return last[2], last[3]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, fused: bool = False, positions: torch.Tensor | None = None,
                 window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [b, heads, s, d] and k [b, kv_heads, s, d], rotated by their positions: 0 .. s-1, or `positions`
        [b or 1, s] in a window of `window` tokens (context parallelism, packed documents); with `fused`, by the
        compiled operator."""
        if positions is None:
            cos, sin = self.tables(q.size(-2), q.device, q.dtype)
        else:
            cos, sin = self.gathered(positions, window, q.device, q.dtype)
        rotate = fused_rotary_embedding if fused else rotary_embedding
        r = cos.size(-1)
        if r == q.size(-1):
            return rotate(q, cos, sin), rotate(k, cos, sin)
        return tuple(torch.cat((rotate(t[..., :r], cos, sin), t[..., r:]), dim=-1) for t in (q, k))  # partial
