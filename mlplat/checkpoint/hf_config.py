"""GPT-2's `config.json` (Hugging Face transformers) <-> mlplat's `model.*` keys. Torch-free: `init_from` is
checked by mlplat.train's preflight, before any process starts.

mlplat's GPT is GPT-2's architecture: pre-LN blocks, learned positions, a GeLU MLP, LayerNorm eps 1e-5, the
output embedding tied to the input one. A GPT-2 config that departs from it (cross-attention, attention scaled by
layer index, another activation, untied embeddings) is refused rather than silently approximated.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Mapping

from mlplat.errors import ConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

# transformers' activation_function -> model.activation. `gelu_new` and `gelu_pytorch_tanh` are the same tanh
# formula (GPT-2's default); export writes `gelu_new` for gelu_tanh.
FROM_HF_ACTIVATION = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
TO_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which mlplat's blocks use

# What a GPT-2 config must say for mlplat to compute the same function: key -> (required value, why).
_REQUIRED = {
    "add_cross_attention": (False, "mlplat's GPT is decoder-only"),
    "scale_attn_by_inverse_layer_idx": (False, "mlplat scales attention by 1/sqrt(head_dim) only"),
    "scale_attn_weights": (True, "mlplat scales attention by 1/sqrt(head_dim)"),
    "tie_word_embeddings": (True, "mlplat ties the output embedding to the input one"),
}


def read_hf_config(path: str | Path, key: str = "init_from") -> dict[str, Any]:
    """A transformers GPT-2 directory's config.json, or a ConfigError naming `key`, the path and what is wrong."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"{key}={path} is not a directory (a transformers GPT-2 directory with {CONFIG_FILE})")
    try:
        hf = json.loads((root / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{key}={path} has no {CONFIG_FILE} (a transformers model directory has one)") from None
    except ValueError as e:
        raise ConfigError(f"{key}={path}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if hf.get("model_type") != "gpt2":
        raise ConfigError(f"{key}={path} holds model_type={hf.get('model_type')!r}; only gpt2 maps onto mlplat's GPT")
    if not ((root / WEIGHTS_FILE).exists() or (root / WEIGHTS_INDEX).exists()):
        raise ConfigError(f"{key}={path} has no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX}); save the model with "
                          f"transformers' save_pretrained, which writes safetensors")
    return hf


def model_keys(hf: Mapping[str, Any], key: str = "init_from") -> dict[str, Any]:
    """The `model.*` values a GPT-2 config stands for (ffn_hidden resolved: n_inner null means 4·n_embd)."""
    for name, (want, why) in _REQUIRED.items():
        if name in hf and bool(hf[name]) != want:
            raise ConfigError(f"{key}: {name}={hf[name]} in {CONFIG_FILE} is not supported ({why})")
    eps = hf.get("layer_norm_epsilon", LAYER_NORM_EPS)
    if eps != LAYER_NORM_EPS:
        raise ConfigError(f"{key}: layer_norm_epsilon={eps} in {CONFIG_FILE} is not supported (mlplat's "
                          f"LayerNorm uses {LAYER_NORM_EPS})")
    act = hf.get("activation_function", "gelu_new")
    if act not in FROM_HF_ACTIVATION:
        raise ConfigError(f"{key}: activation_function={act!r} in {CONFIG_FILE} is not one of "
                          f"{', '.join(FROM_HF_ACTIVATION)}")
    missing = [k for k in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size") if k not in hf]
    if missing:
        raise ConfigError(f"{key}: {CONFIG_FILE} has no {missing[0]} (a GPT-2 config has n_layer, n_embd, n_head, "
                          f"n_positions and vocab_size)")
    n_embd = int(hf["n_embd"])
    return {"n_layers": int(hf["n_layer"]), "hidden": n_embd, "n_heads": int(hf["n_head"]),
            "seq_len": int(hf["n_positions"]), "vocab_size": int(hf["vocab_size"]),
            "ffn_hidden": int(hf.get("n_inner") or 4 * n_embd), "activation": FROM_HF_ACTIVATION[act]}


_HF_NAME = {"n_layers": "n_layer", "hidden": "n_embd", "n_heads": "n_head", "seq_len": "n_positions",
            "vocab_size": "vocab_size", "ffn_hidden": "n_inner", "activation": "activation_function"}


def check_init_from(model, path: str) -> dict[str, Any]:
    """Refuse, in one line naming both values, a `model.*` key that differs from the GPT-2 directory's config."""
    hf = read_hf_config(path)
    theirs = model_keys(hf, f"init_from={path}")
    if importlib.util.find_spec("safetensors") is None:
        raise ConfigError(f"init_from={path} needs the safetensors package: pip install -e '.[hf]'")
    ours = {"n_layers": model.n_layers, "hidden": model.hidden, "n_heads": model.n_heads, "seq_len": model.seq_len,
            "vocab_size": model.vocab_size, "ffn_hidden": model.ffn_hidden or 4 * model.hidden,
            "activation": model.activation}
    for name, value in ours.items():
        if value != theirs[name]:
            raw = hf.get(_HF_NAME[name]) if name != "activation" else hf.get("activation_function", "gelu_new")
            if name == "ffn_hidden" and raw is None:
                raw = f"null (4·n_embd={theirs[name]})"
            raise ConfigError(f"model.{name}={value} does not match {_HF_NAME[name]}={raw} in "
                              f"init_from={path}/{CONFIG_FILE}; set model.{name}={theirs[name]}")
    return hf


def hf_config(model: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """A config.json for `GPT2LMHeadModel` from mlplat's model keys (the true vocabulary, no TP padding rows)."""
    hidden = int(model["hidden"])
    ffn = model.get("ffn_hidden")
    dropout = float(model.get("dropout", 0.0))
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": int(model["vocab_size"]), "n_positions": int(model["seq_len"]), "n_embd": hidden,
        "n_layer": int(model["n_layers"]), "n_head": int(model["n_heads"]),
        "n_inner": None if not ffn or int(ffn) == 4 * hidden else int(ffn),
        "activation_function": TO_HF_ACTIVATION[model.get("activation", "gelu")],
        "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout,
        "layer_norm_epsilon": LAYER_NORM_EPS, "initializer_range": float(model.get("init_std", 0.02)),
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "add_cross_attention": False, "tie_word_embeddings": True, "use_cache": True,
        # Token ids belong to the tokenizer, which the checkpoint does not know: none rather than GPT-2's 50256.
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "dtype": dtype,
    }
