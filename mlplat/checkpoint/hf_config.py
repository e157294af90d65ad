"""A transformers model directory's `config.json` <-> mlplat's `model.*` keys. Torch-free: `init_from` is read and
checked by mlplat.train before the config is validated, before any process starts.

Accepted (`model_type`, the class `save_pretrained` records in `architectures`):
- gpt2 (GPT2LMHeadModel): model.arch=gpt, GPT-2's block (pre-LN, learned positions, GeLU MLP, tied embeddings);
- gpt_neox (GPTNeoXForCausalLM): model.arch=gpt with model.position=rope (the main job's model=tiny_rope), when
  its layers are sequential (use_parallel_residual=false) and the rotation covers whole heads (rotary_pct=1);
- llama (LlamaForCausalLM), mistral (MistralForCausalLM) and qwen2 (Qwen2ForCausalLM): model.arch=llama (RoPE,
  RMSNorm, SwiGLU, grouped-query attention); qwen2 adds the biases of the q, k and v projections;
- qwen3 (Qwen3ForCausalLM): a Llama with an RMSNorm on each head of q and of k (`model.qk_norm`);
- mixtral (MixtralForCausalLM): a Llama whose every MLP is a mixture of experts (`model.moe.*`: num_local_experts
  experts of intermediate_size units, num_experts_per_tok of them per token, chosen by a softmax router and their
  probabilities renormalised over those k; no shared experts, no dense layers, dropless);
- qwen2_moe (Qwen2MoeForCausalLM): num_experts experts of moe_intermediate_size units beside one shared expert of
  shared_expert_intermediate_size units behind a sigmoid gate (`model.moe.shared_experts` = that width over the
  experts', `shared_gate`), the q, k and v biases (qkv_bias), norm_topk_prob as config.json says (false by default);
- qwen3_moe (Qwen3MoeForCausalLM): Qwen3's attention, num_experts routed experts, no shared expert;
- glm4_moe (Glm4MoeForCausalLM: GLM-4.5, 4.6, 4.5-Air): grouped-query attention with q, k and v biases
  (attention_bias: model.qkv_bias; none on o_proj), q/k norms where use_qk_norm says (model.qk_norm), rotary on
  the first partial_rotary_factor of each head's channels (model.rotary_dim; 0.5 when absent, transformers' default),
  n_routed_experts experts of moe_intermediate_size units chosen by sigmoid scores among the topk_group best of
  n_group groups with the correction bias e_score_correction_bias (model.moe.router=sigmoid, n_groups, topk_groups,
  expert_bias), the chosen scores renormalised by norm_topk_prob and times routed_scaling_factor, n_shared_experts
  ungated shared experts, the first first_k_dense_replace layers dense; its num_nextn_predict_layers multi-token
  prediction modules (model.mtp.depth), read where the weights hold them;
- deepseek_v3 (DeepseekV3ForCausalLM: DeepSeek-V3, R1, Kimi K2, Moonlight): multi-head latent attention
  (model.attention=mla, model.mla.*; rotary rows interleaved), YaRN, GLM-4.5's routing, and its
  num_nextn_predict_layers multi-token prediction modules (model.mtp.depth), read where the weights hold them;
- deepseek_v2 (DeepseekV2ForCausalLM: DeepSeek-V2, V2-Lite): the same attention, a softmax router, greedy or
  group-limited by each group's best expert, unrenormalised (`_deepseek`).
Both Qwen MoE classes keep a dense MLP (intermediate_size units) in the layers decoder_sparse_step and
mlp_only_layers name; mlplat's dense layers are the first `model.moe.dense_layers`, so only a prefix of the layers
is accepted.
A config that departs from what mlplat computes (a sliding window, another activation, other rotary scalings,
biases mlplat has no place for, ...) is refused in one line rather than silently approximated.

`init_from=DIR` alone is enough: the architecture keys come from config.json (`check_init_from`). Beside it the
user may set model.seq_len (up to the directory's maximum positions), model.dropout, model.init_std and
model.vocab_pad_multiple (and, for a mixture of experts, MOE_FREE_KEYS: the balancing losses' weights, the
dispatcher and the planner's imbalance, which do not change the function; beside a correction bias, GLM-4.5's,
bias_update_rate, which moves it from the directory's values); any other model.* key they set must agree with the
directory, else it is refused naming both values.
"""
from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from mlplat.config import (
    ARCHS,
    ROPE_SCALING_KEYS,
    YARN_KEYS,
    YARN_OPTIONAL_KEYS,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    arch_defaults,
)
from mlplat.errors import ConfigError, not_regular
from mlplat.specs import attentions

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

# model_type -> the transformers class mlplat reads and writes; the bare body class (no LM head) is read too.
CAUSAL_LM = {"gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM", "llama": "LlamaForCausalLM",
             "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
             "glm4_moe": "Glm4MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
             "deepseek_v3": "DeepseekV3ForCausalLM"}
BARE = {"gpt2": "GPT2Model", "gpt_neox": "GPTNeoXModel", "llama": "LlamaModel", "mistral": "MistralModel",
        "qwen2": "Qwen2Model", "qwen3": "Qwen3Model", "mixtral": "MixtralModel", "qwen2_moe": "Qwen2MoeModel",
        "qwen3_moe": "Qwen3MoeModel", "glm4_moe": "Glm4MoeModel", "deepseek_v2": "DeepseekV2Model",
        "deepseek_v3": "DeepseekV3Model"}
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe")
QWEN_MOE = ("qwen2_moe", "qwen3_moe")  # their experts' names differ from Mixtral's (mlplat.checkpoint.hf)
DEEPSEEK = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention (mlplat.checkpoint.hf: one layout)
MOE_TYPES = ("mixtral", *QWEN_MOE, "glm4_moe", *DEEPSEEK)
QK_NORM_TYPES = ("qwen3", "qwen3_moe")  # model.qk_norm (glm4_moe: where its use_qk_norm says)
GLM_PARTIAL_ROTARY = 0.5  # Glm4MoeConfig's partial_rotary_factor when config.json has none
SUPPORTED = ", ".join(f"{t} ({c})" for t, c in CAUSAL_LM.items())
# The model.* keys that are not the architecture: free beside init_from.
FREE_KEYS = ("seq_len", "dropout", "init_std", "vocab_pad_multiple")
# The model.moe.* keys of training, not of the function (the balancing losses' weights, how tokens travel): free
# beside init_from.
MOE_FREE_KEYS = ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "dispatcher", "fp8_dispatch",
                 "plan_imbalance")

# transformers' activation_function -> model.activation. `gelu_new` and `gelu_pytorch_tanh` are the same tanh
# formula (GPT-2's default); export writes `gelu_new` for gelu_tanh.
FROM_HF_ACTIVATION = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
TO_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which mlplat's GPT-2 blocks use
DEFAULT_ROPE_THETA = 10000.0  # transformers' default for the Llama family when config.json names none
# transformers' defaults for keys a Llama-family config.json may leave out.
MAX_POSITIONS = {"gpt_neox": 2048, "llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768,
                 "mixtral": 131072, "qwen2_moe": 32768, "qwen3_moe": 32768, "glm4_moe": 131072, "deepseek_v2": 2048,
                 "deepseek_v3": 4096}
RMS_NORM_EPS = 1e-6
# transformers' defaults of the sigmoid routers' keys a config.json may leave out: n_shared_experts,
# first_k_dense_replace, n_group, topk_group, routed_scaling_factor (Glm4MoeConfig's, DeepseekV3Config's)
SIGMOID_MOE_DEFAULTS = {"glm4_moe": (1, 1, 1, 1, 1.0), "deepseek_v3": (1, 3, 8, 4, 2.5),
                        "deepseek_v2": (2, 0, 1, 1, 1.0)}  # (DeepseekV2Config's, its router a softmax)
# DeepseekV3Attention's latent norms (q_a_layernorm, kv_a_layernorm) use 1e-6 whatever rms_norm_eps says; mlplat's
# latent norms take model.norm_eps, so a DeepSeek model's norm_eps must be this (DeepSeek's releases: all 1e-6)
DEEPSEEK_LATENT_EPS = 1e-6
QWEN3_HEAD_DIM = 128  # Qwen3Config's head_dim when config.json has none (the others': hidden_size/heads)

# What a GPT-2 config must say for mlplat to compute the same function: key -> (required value, why).
_GPT2_REQUIRED = {
    "add_cross_attention": (False, "mlplat's GPT is decoder-only"),
    "scale_attn_by_inverse_layer_idx": (False, "mlplat scales attention by 1/sqrt(head_dim) only"),
    "scale_attn_weights": (True, "mlplat scales attention by 1/sqrt(head_dim)"),
    "tie_word_embeddings": (True, "mlplat's GPT-2 ties the output embedding to the input one"),
}
# What a GPT-NeoX config must say: key -> (required value, transformers' default when the key is absent, why).
_NEOX_REQUIRED = {
    "use_parallel_residual": (False, True, "mlplat's layer feeds the attention's sum to the MLP (sequential "
                                           "residual), not x + attn(ln1(x)) + mlp(ln2(x))"),
    "attention_bias": (True, True, "mlplat's attention output projection has a bias whenever its MLP has"),
}


def _show(value: Any) -> str:
    """A value as the user would type it: true/false, null, numbers and strings bare."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return str(value)


def read_hf_config(path: str | Path, key: str = "init_from") -> dict[str, Any]:
    """A transformers model directory's config.json, or a ConfigError naming `key`, the path and what is wrong."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"{key}={path} is not a directory (a transformers model directory with {CONFIG_FILE})")
    for name in (CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX):
        if (what := not_regular(root / name)) is not None:
            raise ConfigError(f"{key}={path}: {root / name} is {what}, not a regular file")
    try:
        hf = json.loads((root / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{key}={path} has no {CONFIG_FILE} (a transformers model directory has one)") from None
    except ValueError as e:
        raise ConfigError(f"{key}={path}: {CONFIG_FILE} is not valid JSON ({e})") from None
    model_type = hf.get("model_type")
    classes = [str(c) for c in hf.get("architectures") or []]
    if model_type not in CAUSAL_LM:
        named = f" ({', '.join(classes)})" if classes else ""
        raise ConfigError(f"{key}={path} holds model_type={model_type!r}{named}, which mlplat cannot load; "
                          f"supported: {SUPPORTED}")
    other = [c for c in classes if c not in (CAUSAL_LM[model_type], BARE[model_type])]
    known = {c: t for t in CAUSAL_LM for c in (CAUSAL_LM[t], BARE[t])}
    if other and other[0] in known:  # both supported, but not together: which one is meant is unknowable
        raise ConfigError(f"{key}={path}: architectures={other} and model_type={model_type!r} in {CONFIG_FILE} "
                          f"disagree ({other[0]} is model_type {known[other[0]]!r}, {model_type!r} is "
                          f"{CAUSAL_LM[model_type]}); fix the one that is wrong")
    if other:
        raise ConfigError(f"{key}={path} holds {other[0]} (architectures in {CONFIG_FILE}), which mlplat cannot "
                          f"load; supported: {SUPPORTED}")
    if not ((root / WEIGHTS_FILE).exists() or (root / WEIGHTS_INDEX).exists()):
        raise ConfigError(f"{key}={path} has no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX}); save the model with "
                          f"transformers' save_pretrained, which writes safetensors")
    return hf


@dataclass
class Imported:
    """What a config.json stands for: every architecture key of ModelConfig, where each came from (for the
    refusals), and the most positions the model takes."""

    values: dict[str, Any]
    sources: dict[str, str]  # model.* key -> "hidden_size=64" (the config.json key and value it came from)
    max_positions: int
    positions_key: str  # n_positions | max_position_embeddings


def _require_keys(hf: Mapping[str, Any], names: tuple[str, ...], key: str, family: str) -> None:
    missing = [k for k in names if k not in hf]
    if missing:
        raise ConfigError(f"{key}: {CONFIG_FILE} has no {missing[0]} (a {family} config has {', '.join(names)})")
    # every required key is a count or a width: a null or a string would end in int()'s TypeError
    for k in names:
        if isinstance(hf[k], bool) or not isinstance(hf[k], int):
            raise ConfigError(f"{key}: {k}={json.dumps(hf[k])} in {CONFIG_FILE} is not a whole number (a {family} "
                              f"config's {k} is a count or a width)")


def _activation(hf: Mapping[str, Any], name: str, default: str, key: str) -> str:
    """config.json's GeLU (`name`, `default` when absent), or the one-line refusal of another activation."""
    act = hf.get(name, default)
    if act not in FROM_HF_ACTIVATION:
        raise ConfigError(f"{key}: {name}={act!r} in {CONFIG_FILE} is not one of {', '.join(FROM_HF_ACTIVATION)}")
    return act


def _gpt2(hf: Mapping[str, Any], key: str) -> Imported:
    for name, (want, why) in _GPT2_REQUIRED.items():
        if name in hf and bool(hf[name]) != want:
            raise ConfigError(f"{key}: {name}={_show(hf[name])} in {CONFIG_FILE} is not supported ({why})")
    eps = hf.get("layer_norm_epsilon", LAYER_NORM_EPS)
    if eps != LAYER_NORM_EPS:
        raise ConfigError(f"{key}: layer_norm_epsilon={eps} in {CONFIG_FILE} is not supported (mlplat's "
                          f"LayerNorm uses {LAYER_NORM_EPS})")
    act = _activation(hf, "activation_function", "gelu_new", key)
    _require_keys(hf, ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size"), key, "GPT-2")
    n_embd = int(hf["n_embd"])
    inner = hf.get("n_inner")
    values = {"arch": "gpt", "n_layers": int(hf["n_layer"]), "hidden": n_embd, "n_heads": int(hf["n_head"]),
              "n_kv_heads": None, "vocab_size": int(hf["vocab_size"]), "ffn_hidden": int(inner or 4 * n_embd),
              "activation": FROM_HF_ACTIVATION[act], "position": "learned", "rope_theta": DEFAULT_ROPE_THETA,
              "rope_scaling": None, "norm": "layernorm", "norm_eps": LAYER_NORM_EPS, "mlp": "gelu",
              "tie_embeddings": True, "bias": True, "qkv_bias": True}
    sources = {"n_layers": f"n_layer={hf['n_layer']}", "hidden": f"n_embd={n_embd}",
               "n_heads": f"n_head={hf['n_head']}", "n_kv_heads": f"n_head={hf['n_head']}",
               "vocab_size": f"vocab_size={hf['vocab_size']}",
               "ffn_hidden": f"n_inner={inner}" if inner else f"n_inner=null (4·n_embd={4 * n_embd})",
               "activation": f"activation_function={act}", "tie_embeddings": "tie_word_embeddings=true"}
    return Imported(values, sources, int(hf["n_positions"]), "n_positions")


def _rope(hf: Mapping[str, Any], key: str, legacy_theta: str = "rope_theta",
          yarn: bool = False) -> tuple[float, dict | None, str, str]:
    """(rope_theta, rope_scaling, where theta came from, where the scaling came from). transformers 5 writes both
    in `rope_parameters`; older files have `legacy_theta` (GPT-NeoX: rotary_emb_base) at the top level and
    `rope_scaling` (null or a dict). `yarn`: YaRN is read too (DeepSeek's `type` yarn)."""
    params, legacy = hf.get("rope_parameters"), hf.get("rope_scaling")
    if isinstance(params, Mapping) and any(isinstance(v, Mapping) for v in params.values()):
        raise ConfigError(f"{key}: rope_parameters in {CONFIG_FILE} differ by layer type, which mlplat does not "
                          f"support (one rotary embedding for every layer)")
    if isinstance(params, Mapping):
        scaling, where = params, "rope_parameters"
        theta = params.get("rope_theta", hf.get(legacy_theta, DEFAULT_ROPE_THETA))
        theta_at = "rope_parameters.rope_theta" if "rope_theta" in params else legacy_theta
    else:
        scaling, where = legacy if isinstance(legacy, Mapping) else {}, "rope_scaling"
        theta, theta_at = hf.get(legacy_theta, DEFAULT_ROPE_THETA), legacy_theta
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None, f"{theta_at}={theta}", f"{where}.rope_type=default"
    if yarn and kind == "yarn":
        return float(theta), _yarn_scaling(scaling, where, key), f"{theta_at}={theta}", \
            f"{where}={json.dumps(dict(scaling))}"
    if kind != "llama3":
        also = " and YaRN's, rope_type yarn" if yarn else ""
        raise ConfigError(f"{key}: {where}.rope_type={kind!r} in {CONFIG_FILE} is not supported (mlplat's rotary "
                          f"embedding has the default frequencies and Llama 3.1's scaling, rope_type llama3{also})")
    missing = [k for k in ROPE_SCALING_KEYS if k not in scaling]
    if missing:
        raise ConfigError(f"{key}: {where} in {CONFIG_FILE} has rope_type llama3 but no {missing[0]}")
    rope_scaling = {k: scaling[k] for k in ROPE_SCALING_KEYS}
    return float(theta), rope_scaling, f"{theta_at}={theta}", f"{where}={json.dumps(dict(scaling))}"


def _yarn_scaling(scaling: Mapping[str, Any], where: str, key: str) -> dict[str, Any]:
    """model.rope_scaling of a YaRN config.json entry: its YARN_KEYS and the YARN_OPTIONAL_KEYS it sets; what
    mlplat's YaRN does not compute (a given attention_factor, an untruncated band) refused in one line."""
    missing = [k for k in YARN_KEYS if scaling.get(k) is None]
    if missing:  # transformers would take factor from max_position_embeddings; mlplat reads it as written
        raise ConfigError(f"{key}: {where} in {CONFIG_FILE} has rope_type yarn but no {missing[0]}")
    if scaling.get("attention_factor") is not None:
        raise ConfigError(f"{key}: {where}.attention_factor={scaling['attention_factor']} in {CONFIG_FILE} is not "
                          f"supported (mlplat derives YaRN's attention factor from factor, mscale and mscale_all_dim)")
    if scaling.get("truncate", True) is not True:
        raise ConfigError(f"{key}: {where}.truncate={_show(scaling['truncate'])} in {CONFIG_FILE} is not supported "
                          f"(mlplat rounds YaRN's band outwards, truncate=true)")
    return {"rope_type": "yarn", **{k: scaling[k] for k in (*YARN_KEYS, *YARN_OPTIONAL_KEYS)
                                    if scaling.get(k) is not None}}


def _llama(hf: Mapping[str, Any], key: str) -> Imported:
    model_type = hf["model_type"]
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    # transformers 5 saves Qwen3-MoE's num_experts as num_local_experts (Mixtral's name)
    experts_key = "num_local_experts" if model_type == "mixtral" or ("num_experts" not in hf and
                                                                     "num_local_experts" in hf) else "num_experts"
    moe_required = {"mixtral": (experts_key, "num_experts_per_tok"),
                    "qwen2_moe": (experts_key, "num_experts_per_tok", "moe_intermediate_size",
                                  "shared_expert_intermediate_size"),
                    "qwen3_moe": (experts_key, "num_experts_per_tok", "moe_intermediate_size"),
                    "glm4_moe": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
                    }.get(model_type, ())
    _require_keys(hf, required + moe_required, key, model_type)
    if model_type in QWEN_MOE and {"num_experts", "num_local_experts"} <= set(hf) and \
            hf["num_experts"] != hf["num_local_experts"]:  # transformers reads one, depending on its version
        raise ConfigError(f"{key}: num_experts={_show(hf['num_experts'])} and num_local_experts="
                          f"{_show(hf['num_local_experts'])} in {CONFIG_FILE} disagree (both name the routed experts' "
                          f"count); keep one")
    refusals = [
        ("hidden_act", "silu", "mlplat's SwiGLU gates with SiLU"),
        ("mlp_bias", False, "mlplat's SwiGLU has no biases"),
    ]
    if model_type in ("qwen2", "qwen3", *QWEN_MOE):
        refusals.append(("use_sliding_window", False, "mlplat's attention is full causal attention"))
    if model_type not in ("qwen2", "qwen2_moe", "glm4_moe"):  # theirs: biases on q, k and v alone
        # transformers' attention_bias puts a bias on o_proj too: mlplat has biases on the QKV projection alone
        # (Qwen2) or on every linear layer, not on the four attention projections only.
        refusals.append(("attention_bias", False, "mlplat has no bias on the attention's output projection alone"))
    if model_type in ("mistral", "mixtral"):
        refusals.append(("sliding_window", None, "mlplat's attention is full causal attention"))
    if model_type == "mixtral":
        refusals.append(("router_jitter_noise", 0.0, "mlplat's router has no input jitter"))
    for name, want, why in refusals:
        if name in hf and hf[name] != want:
            raise ConfigError(f"{key}: {name}={_show(hf[name])} in {CONFIG_FILE} is not supported ({why}; "
                              f"{name}={_show(want)} is)")
    sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        raise ConfigError(f"{key}: layer_types in {CONFIG_FILE} has {sliding[0]!r} layers, which mlplat does not "
                          f"support (every layer is full causal attention)")
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    # model.head_dim: set only when it differs from hidden/heads, so that a config.json spelling out the default
    # imports the same keys as one that leaves it out.
    head_dim = hf.get("head_dim") or (QWEN3_HEAD_DIM if model_type == "qwen3" else None)
    head_dim = int(head_dim) if head_dim is not None and int(head_dim) * heads != hidden else None
    kv = hf.get("num_key_value_heads")
    theta, scaling, theta_at, scaling_at = _rope(hf, key)
    eps = hf.get("rms_norm_eps", RMS_NORM_EPS)
    tied = bool(hf.get("tie_word_embeddings", False))
    qkv_bias = model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True))) or \
        (model_type == "glm4_moe" and bool(hf.get("attention_bias", False)))
    qk_norm = model_type in QK_NORM_TYPES or (model_type == "glm4_moe" and bool(hf.get("use_qk_norm", False)))
    rotary_dim, rotary_at = _partial_rotary(hf, key, head_dim or hidden // heads)
    values = {"arch": "llama", "n_layers": int(hf["num_hidden_layers"]), "hidden": hidden, "n_heads": heads,
              "n_kv_heads": int(kv) if kv is not None else None, "vocab_size": int(hf["vocab_size"]),
              "ffn_hidden": int(hf["intermediate_size"]), "activation": ModelConfig.activation,
              "position": "rope", "rope_theta": theta, "rope_scaling": scaling, "norm": "rmsnorm",
              "norm_eps": float(eps), "mlp": "swiglu", "tie_embeddings": tied, "bias": False, "qkv_bias": qkv_bias,
              "qk_norm": qk_norm, "head_dim": head_dim, "rotary_dim": rotary_dim}
    sources = {"n_layers": f"num_hidden_layers={hf['num_hidden_layers']}", "hidden": f"hidden_size={hidden}",
               "head_dim": f"head_dim={hf['head_dim']}" if hf.get("head_dim") is not None else
               f"head_dim absent ({QWEN3_HEAD_DIM}, Qwen3's default)" if head_dim else
               f"hidden_size/num_attention_heads={hidden}/{heads}",
               "n_heads": f"num_attention_heads={heads}",
               "n_kv_heads": f"num_key_value_heads={kv}" if kv is not None else f"num_attention_heads={heads}",
               "vocab_size": f"vocab_size={hf['vocab_size']}",
               "ffn_hidden": f"intermediate_size={hf['intermediate_size']}",
               "activation": f"hidden_act={hf.get('hidden_act', 'silu')}", "rope_theta": theta_at,
               "rope_scaling": scaling_at, "norm_eps": f"rms_norm_eps={eps}",
               "tie_embeddings": f"tie_word_embeddings={_show(tied)}", "rotary_dim": rotary_at,
               "qk_norm": f"use_qk_norm={_show(qk_norm)}" if model_type == "glm4_moe" else f"model_type={model_type}",
               "qkv_bias": f"qkv_bias={_show(qkv_bias)}" if model_type == "qwen2_moe" else
               f"model_type={model_type}" if qkv_bias else f"attention_bias={_show(hf.get('attention_bias', False))}"}
    if model_type == "glm4_moe":
        values["moe"], moe_sources = _glm_experts(hf, key)
        sources.update(moe_sources)
        depth = _mtp_depth(hf, key)
        values["mtp"] = MTPConfig(depth=depth)
        sources["mtp.depth"] = f"num_nextn_predict_layers={depth}"
    elif model_type in MOE_TYPES:
        values["moe"], moe_sources = _experts(hf, key, experts_key)
        sources.update(moe_sources)
    positions = int(hf.get("max_position_embeddings", MAX_POSITIONS[model_type]))
    return Imported(values, sources, positions, "max_position_embeddings")


def _partial_rotary(hf: Mapping[str, Any], key: str, head: int) -> tuple[int | None, str]:
    """(model.rotary_dim, where it came from): the rotated channels of a head of `head`, from partial_rotary_factor
    (rope_parameters' in transformers 5, the top level's before; glm4_moe's default 0.5, the others' 1); null when the
    whole head turns."""
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), Mapping) else {}
    default = GLM_PARTIAL_ROTARY if hf.get("model_type") == "glm4_moe" else 1.0
    factor, at = ((params["partial_rotary_factor"], "rope_parameters.partial_rotary_factor")
                  if "partial_rotary_factor" in params else
                  (hf.get("partial_rotary_factor", default), "partial_rotary_factor"))
    given = at.startswith("rope_parameters") or "partial_rotary_factor" in hf
    shown = f"{at}={factor}" + ("" if given else " (transformers' default)")
    rotated = int(head * float(factor))  # transformers' int(head_dim · factor)
    if hf.get("model_type") != "glm4_moe" and float(factor) != 1.0:
        raise ConfigError(f"{key}: {at}={factor} in {CONFIG_FILE} is not supported for model_type="
                          f"{hf.get('model_type')} (mlplat reads partial rotary from glm4_moe configs)")
    if rotated < 2 or rotated % 2:
        raise ConfigError(f"{key}: {at}={factor} in {CONFIG_FILE} turns {rotated} of a head's {head} channels; "
                          f"mlplat's rotation needs an even number, at least 2")
    return (None if rotated == head else rotated), shown


def _mtp_depth(hf: Mapping[str, Any], key: str) -> int:
    """num_nextn_predict_layers (transformers 5's num_mtp_layers), 0 when absent: the multi-token prediction modules
    config.json counts (check_init_from keeps those the weights hold, mtp_layers_held)."""
    depth = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ConfigError(f"{key}: num_nextn_predict_layers={json.dumps(depth)} in {CONFIG_FILE} is not a whole "
                          f"number")
    return depth


def _glm_experts(hf: Mapping[str, Any], key: str, name: str = "GLM-4.5") -> tuple[MoEConfig, dict[str, str]]:
    """GLM-4.5's (and DeepSeek-V3's, `name`) model.moe.* keys (sigmoid routing with groups, scaling and the correction
    bias, ungated shared experts, dense first layers) and where each came from."""
    def number(name, default, kind=int):
        value = default if hf.get(name) is None else hf[name]  # (DeepSeek-V2's greedy configs: n_group null)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ConfigError(f"{key}: {name}={json.dumps(value)} in {CONFIG_FILE} is not a "
                              f"{'whole number' if kind is int else 'number'}")
        return kind(value)

    experts, k, width = (int(hf[n]) for n in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"))
    default = SIGMOID_MOE_DEFAULTS[hf["model_type"]]
    shared, dense = number("n_shared_experts", default[0]), number("first_k_dense_replace", default[1])
    groups, topk_groups = number("n_group", default[2]), number("topk_group", default[3])
    scaling, norm = number("routed_scaling_factor", default[4], float), bool(hf.get("norm_topk_prob", True))
    if shared < 1:
        raise ConfigError(f"{key}: n_shared_experts={shared} in {CONFIG_FILE} is not supported ({name}'s shared "
                          f"experts are model.moe.shared_experts >= 1 experts wide; transformers would hold empty "
                          f"tensors)")
    sources = {"moe.num_experts": f"n_routed_experts={experts}", "moe.top_k": f"num_experts_per_tok={k}",
               "moe.ffn_hidden": f"moe_intermediate_size={width}", "moe.shared_experts": f"n_shared_experts={shared}",
               "moe.dense_layers": f"first_k_dense_replace={dense}", "moe.n_groups": f"n_group={groups}",
               "moe.topk_groups": f"topk_group={topk_groups}",
               "moe.routed_scaling_factor": f"routed_scaling_factor={scaling}",
               "moe.norm_topk_prob": f"norm_topk_prob={_show(norm)}",
               "moe.expert_bias": f"model_type={hf['model_type']} (its e_score_correction_bias)"}
    return MoEConfig(num_experts=experts, top_k=k, ffn_hidden=width, shared_experts=shared, dense_layers=dense,
                     router="sigmoid", norm_topk_prob=norm, routed_scaling_factor=scaling, n_groups=groups,
                     topk_groups=topk_groups, expert_bias=True), sources


def _deepseek(hf: Mapping[str, Any], key: str) -> Imported:
    """DeepSeek-V3's (Kimi K2's, Moonlight's) config.json: multi-head latent attention (model.attention=mla,
    model.mla.*) with YaRN, GLM-4.5's routing (sigmoid scores among groups, the correction bias, scaling, ungated
    shared experts, dense first layers), and num_nextn_predict_layers multi-token prediction modules (model.mtp.depth;
    model.mtp.loss_coeff stays the config's). DeepSeek-V2's (V2-Lite's): the same attention (its rotary pairs
    interleaved too), a softmax router, greedy or among the topk_group best of n_group groups by their best expert
    (topk_method group_limited_greedy), the chosen probabilities not renormalised (transformers' DeepseekV2 never
    does), scaled; no correction bias, no multi-token prediction."""
    model_type = hf["model_type"]
    v2 = model_type == "deepseek_v2"
    _require_keys(hf, ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                       "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "kv_lora_rank",
                       "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"), key, model_type)
    heads = int(hf["num_attention_heads"])
    for name, want, default, why in [
            ("hidden_act", "silu", "silu", "mlplat's SwiGLU gates with SiLU"),
            ("attention_bias", False, False, "mlplat's latent attention has no biases"),
            ("rope_interleave", True, True, "mlplat reads DeepSeek's interleaved rotary rows, permuting them"),
            *([("scoring_func", "softmax", "softmax", "DeepSeek-V2 scores its experts by a softmax"),
               ("norm_topk_prob", False, False, "transformers' DeepseekV2 never renormalises the chosen probabilities"),
               ("mlp_bias", False, False, "mlplat's SwiGLU has no biases")] if v2 else
              [("scoring_func", "sigmoid", "sigmoid", "DeepSeek-V3 scores its experts by a sigmoid"),
               ("topk_method", "noaux_tc", "noaux_tc", "DeepSeek-V3 chooses with its correction bias")]),
            ("num_key_value_heads", heads, heads, "every latent attention head has its own key and value"),
            ("moe_layer_freq", 1, 1, "mlplat's layers after the dense first ones are all mixtures of experts"),
            ("rms_norm_eps", DEEPSEEK_LATENT_EPS, DEEPSEEK_LATENT_EPS,
             "DeepSeek-V3's latent norms use 1e-6 whatever rms_norm_eps says, mlplat's model.norm_eps")]:
        if hf.get(name, default) != want:
            raise ConfigError(f"{key}: {name}={_show(hf[name])} in {CONFIG_FILE} is not supported ({why}; "
                              f"{name}={_show(want)} is)")
    if hf.get("tie_word_embeddings", False):
        raise ConfigError(f"{key}: tie_word_embeddings=true in {CONFIG_FILE} is not supported (DeepSeek-V3's output "
                          f"layer is its own, and its multi-token prediction layers keep a copy of it)")
    theta, scaling, theta_at, scaling_at = _rope(hf, key, yarn=True)
    q_rank = hf.get("q_lora_rank")
    mla = MLAConfig(q_lora_rank=None if q_rank is None else int(q_rank), kv_lora_rank=int(hf["kv_lora_rank"]),
                    qk_nope_head_dim=int(hf["qk_nope_head_dim"]), qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
                    v_head_dim=int(hf["v_head_dim"]))
    depth = 0 if v2 else _mtp_depth(hf, key)
    hidden = int(hf["hidden_size"])
    values = {"arch": "llama", "n_layers": int(hf["num_hidden_layers"]), "hidden": hidden, "n_heads": heads,
              "n_kv_heads": None, "vocab_size": int(hf["vocab_size"]), "ffn_hidden": int(hf["intermediate_size"]),
              "activation": ModelConfig.activation, "position": "rope", "rope_theta": theta, "rope_scaling": scaling,
              "norm": "rmsnorm", "norm_eps": DEEPSEEK_LATENT_EPS, "mlp": "swiglu", "tie_embeddings": False,
              "bias": False, "qkv_bias": False, "qk_norm": False, "head_dim": None, "rotary_dim": None,
              "attention": "mla", "mla": mla, "mtp": MTPConfig(depth=depth)}
    sources = {"n_layers": f"num_hidden_layers={hf['num_hidden_layers']}", "hidden": f"hidden_size={hidden}",
               "n_heads": f"num_attention_heads={heads}", "vocab_size": f"vocab_size={hf['vocab_size']}",
               "ffn_hidden": f"intermediate_size={hf['intermediate_size']}", "rope_theta": theta_at,
               "rope_scaling": scaling_at, "norm_eps": f"rms_norm_eps={hf.get('rms_norm_eps', DEEPSEEK_LATENT_EPS)}",
               "tie_embeddings": "tie_word_embeddings=false", "mtp.depth": f"num_nextn_predict_layers={depth}",
               **{f"mla.{k}": f"{k}={_show(getattr(mla, k))}" for k in asdict(mla)}}
    values["moe"], moe_sources = _glm_experts(hf, key, "DeepSeek-V2" if v2 else "DeepSeek-V3")
    sources.update(moe_sources)
    if v2:
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"{key}: topk_method={_show(method)} in {CONFIG_FILE} is not supported (DeepSeek-V2's "
                              f"are greedy and group_limited_greedy)")
        grouped = method == "group_limited_greedy"
        values["moe"] = replace(values["moe"], router="softmax", norm_topk_prob=False, expert_bias=False,
                                n_groups=values["moe"].n_groups if grouped else 1,
                                topk_groups=values["moe"].topk_groups if grouped else 1)
        sources.update({"moe.router": "scoring_func=softmax", "moe.expert_bias": "model_type=deepseek_v2",
                        **({} if grouped else {"moe.n_groups": "topk_method=greedy",
                                               "moe.topk_groups": "topk_method=greedy"})})
    positions = int(hf.get("max_position_embeddings", MAX_POSITIONS[model_type]))
    return Imported(values, sources, positions, "max_position_embeddings")


def _experts(hf: Mapping[str, Any], key: str, experts_key: str) -> tuple[MoEConfig, dict[str, str]]:
    """A Mixtral's or a Qwen MoE's model.moe.* keys (a softmax router over every expert) and where each came from."""
    model_type = hf["model_type"]
    experts, k = int(hf[experts_key]), int(hf["num_experts_per_tok"])
    sources = {"moe.num_experts": f"{experts_key}={experts}", "moe.top_k": f"num_experts_per_tok={k}"}
    if model_type == "mixtral":  # the k chosen probabilities renormalised to sum 1
        width = int(hf["intermediate_size"])
        sources["moe.ffn_hidden"] = f"intermediate_size={width}"
        return MoEConfig(num_experts=experts, top_k=k, ffn_hidden=width, router="softmax",
                         norm_topk_prob=True), sources
    width, norm = int(hf["moe_intermediate_size"]), bool(hf.get("norm_topk_prob", False))
    sources.update({"moe.ffn_hidden": f"moe_intermediate_size={width}", "moe.norm_topk_prob":
                    f"norm_topk_prob={_show(norm)}" + ("" if "norm_topk_prob" in hf else " (transformers' default)")})
    shared = 0
    if model_type == "qwen2_moe":  # one shared expert, `shared_experts` routed experts wide, behind a sigmoid gate
        shared_width = int(hf["shared_expert_intermediate_size"])
        if shared_width <= 0 or shared_width % width:
            raise ConfigError(f"{key}: shared_expert_intermediate_size={shared_width} in {CONFIG_FILE} is not a "
                              f"positive multiple of moe_intermediate_size={width} (mlplat's shared expert is "
                              f"model.moe.shared_experts experts wide)")
        shared = shared_width // width
        sources.update({"moe.shared_experts": f"shared_expert_intermediate_size={shared_width}",
                        "moe.shared_gate": f"model_type={model_type}"})
    # transformers: layer i is dense when i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0
    layers, step = int(hf["num_hidden_layers"]), int(hf.get("decoder_sparse_step", 1))
    only = hf.get("mlp_only_layers") or []
    outside = [i for i in only if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers]
    if outside:
        raise ConfigError(f"{key}: mlp_only_layers={_show(only)} in {CONFIG_FILE} names {_show(outside[0])}, not a "
                          f"layer of the {layers} (num_hidden_layers={layers}: 0 to {layers - 1})")
    dense = [i for i in range(layers) if i in only or step < 1 or (i + 1) % step]
    first = len(dense) if dense == list(range(len(dense))) and len(dense) < layers else None
    if first is None:
        where = f"decoder_sparse_step={step}, mlp_only_layers={only}"
        raise ConfigError(f"{key}: {where} in {CONFIG_FILE} make layers {dense} dense, which mlplat does not "
                          f"support (its dense layers are the first model.moe.dense_layers, before at least one "
                          f"mixture of experts)")
    sources["moe.dense_layers"] = f"mlp_only_layers={only}"
    return MoEConfig(num_experts=experts, top_k=k, ffn_hidden=width, shared_experts=shared, shared_gate=bool(shared),
                     dense_layers=first, router="softmax", norm_topk_prob=norm), sources


def _gpt_neox(hf: Mapping[str, Any], key: str) -> Imported:
    _require_keys(hf, ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                       "vocab_size"), key, "GPT-NeoX")
    for name, (want, default, why) in _NEOX_REQUIRED.items():
        have = hf.get(name, default)
        if have != want:
            shown = _show(have) if name in hf else f"{_show(have)} (transformers' default when absent)"
            raise ConfigError(f"{key}: {name}={shown} in {CONFIG_FILE} is not supported ({why}; "
                              f"{name}={_show(want)} is)")
    # The rotated fraction of each head: transformers 5 keeps it in rope_parameters, older files in rotary_pct.
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), Mapping) else {}
    partial, partial_at = (params["partial_rotary_factor"], "rope_parameters.partial_rotary_factor") \
        if "partial_rotary_factor" in params else (hf.get("rotary_pct", 0.25), "rotary_pct")
    if float(partial) != 1.0:
        absent = "" if partial_at != "rotary_pct" or "rotary_pct" in hf else " (transformers' default when absent)"
        raise ConfigError(f"{key}: {partial_at}={partial}{absent} in {CONFIG_FILE} is not supported (mlplat "
                          f"rotates every channel of a head; {partial_at}=1 is)")
    act = _activation(hf, "hidden_act", "gelu", key)
    theta, scaling, theta_at, scaling_at = _rope(hf, key, legacy_theta="rotary_emb_base")
    eps = hf.get("layer_norm_eps", LAYER_NORM_EPS)
    tied = bool(hf.get("tie_word_embeddings", False))
    values = {"arch": "gpt", "n_layers": int(hf["num_hidden_layers"]), "hidden": int(hf["hidden_size"]),
              "n_heads": int(hf["num_attention_heads"]), "n_kv_heads": None, "vocab_size": int(hf["vocab_size"]),
              "ffn_hidden": int(hf["intermediate_size"]), "activation": FROM_HF_ACTIVATION[act], "position": "rope",
              "rope_theta": theta, "rope_scaling": scaling, "norm": "layernorm", "norm_eps": float(eps),
              "mlp": "gelu", "tie_embeddings": tied, "bias": True, "qkv_bias": True}
    sources = {"n_layers": f"num_hidden_layers={hf['num_hidden_layers']}", "hidden": f"hidden_size={hf['hidden_size']}",
               "n_heads": f"num_attention_heads={hf['num_attention_heads']}",
               "n_kv_heads": f"num_attention_heads={hf['num_attention_heads']}",
               "vocab_size": f"vocab_size={hf['vocab_size']}",
               "ffn_hidden": f"intermediate_size={hf['intermediate_size']}", "activation": f"hidden_act={act}",
               "rope_theta": theta_at, "rope_scaling": scaling_at, "norm_eps": f"layer_norm_eps={eps}",
               "tie_embeddings": f"tie_word_embeddings={_show(tied)}"}
    positions = int(hf.get("max_position_embeddings", MAX_POSITIONS["gpt_neox"]))
    return Imported(values, sources, positions, "max_position_embeddings")


# the Llama family's otherwise
_IMPORTERS = {"gpt2": _gpt2, "gpt_neox": _gpt_neox, "deepseek_v2": _deepseek, "deepseek_v3": _deepseek}


def imported_keys(hf: Mapping[str, Any], key: str = "init_from") -> Imported:
    """The model.* values a config.json stands for (every key but FREE_KEYS), or the one-line refusal."""
    imp = _IMPORTERS.get(hf.get("model_type"), _llama)(hf, key)
    imp.values.setdefault("moe", MoEConfig())  # a dense model: no experts
    imp.values.setdefault("attention", attentions.DEFAULT)  # (DeepSeek-V3's: mla)
    imp.values.setdefault("mla", MLAConfig())
    imp.values.setdefault("qk_norm", False)
    imp.values.setdefault("head_dim", None)  # GPT-2's and GPT-NeoX's heads: hidden/heads
    imp.values.setdefault("rotary_dim", None)  # the whole head
    # arch, position, norm, mlp, bias, the router's kind: the model type decides them
    for name in [*imp.values, *(f"moe.{f.name}" for f in fields(MoEConfig))]:
        imp.sources.setdefault(name, f"model_type={hf.get('model_type')}")
    return imp


def _effective(m: ModelConfig) -> dict[str, Any]:
    """What a ModelConfig computes: nulls resolved (the arch's defaults, n_kv_heads, ffn_hidden, head_dim)."""
    if m.arch not in ARCHS:
        return {"arch": m.arch}
    full = arch_defaults(m)
    out = asdict(full)
    out["n_kv_heads"], out["ffn_hidden"], out["head_dim"] = full.kv_heads, full.ffn, full.head_size
    out["rotary_dim"] = full.rotary_channels if full.position == "rope" else None
    if isinstance(out["rope_scaling"], Mapping):
        out["rope_scaling"] = {k: v for k, v in dict(out["rope_scaling"]).items() if k != "rope_type"}
    return out


def attention_refusal(model: ModelConfig | Mapping[str, Any]) -> str | None:
    """Why `model`'s attention has no Hugging Face names (one line naming model.attention), or None: the names map
    the attentions whose entry says transformers computes them (`Attention.hf`, mlplat.specs.attentions)."""
    name = (model.get("attention") if isinstance(model, Mapping) else model.attention) or attentions.DEFAULT
    try:
        if attentions.get(name).hf:
            return None
    except ValueError as unknown:
        return str(unknown)
    mapped = ", ".join(f"model.attention={n}" for n in attentions.names() if attentions.get(n).hf)
    return f"model.attention={name} has no Hugging Face names (transformers computes {mapped})"


def check_init_from(model: ModelConfig, path: str, typed: Iterable[str] = ()) -> dict[str, Any]:
    """Set `model`'s architecture keys from the directory's config.json (in place) and return that config.

    `typed`: the model.* keys the user set explicitly. Each of them but FREE_KEYS must agree with the directory
    (null vocab_size: follow it), else one line names both values. model.seq_len, when typed, must not exceed the
    directory's positions; left to its default it is cut to them."""
    where = f"init_from={path}"
    if (why := attention_refusal(model)) is not None:
        raise ConfigError(f"{where}: {why}")
    hf = read_hf_config(path)
    imp = imported_keys(hf, where)
    if importlib.util.find_spec("safetensors") is None:
        raise ConfigError(f"{where} needs the safetensors package: pip install -e '.[hf]'")
    # The balancing losses' weights stay the config's (the directory's function does not depend on them).
    imp.values["moe"] = replace(imp.values["moe"], **{k: getattr(model.moe, k) for k in MOE_FREE_KEYS})
    if imp.values["moe"].expert_bias:  # the directory's correction bias may move on (aux-loss-free balancing)
        imp.values["moe"] = replace(imp.values["moe"], bias_update_rate=model.moe.bias_update_rate)
    typed = set(typed)
    if "mtp" in imp.values:  # the modules the directory holds; their losses' weight stays the config's
        held = mtp_layers_held(path, imp.values["n_layers"], imp.values["mtp"].depth)
        if held != imp.values["mtp"].depth:
            imp.values["mtp"] = MTPConfig(depth=held)
            imp.sources["mtp.depth"] += f" (the weights hold {held} such layers)"
        imp.values["mtp"] = replace(imp.values["mtp"], loss_coeff=model.mtp.loss_coeff)
    for section in ("mla", "mtp"):  # a key typed in them must agree with the directory
        for name in (f.name for f in fields(getattr(model, section))):
            mine, want = getattr(getattr(model, section), name), getattr(imp.values.get(section), name, None)
            if f"{section}.{name}" in typed and f"{section}.{name}" in imp.sources and mine != want:
                raise ConfigError(f"model.{section}.{name}={_show(mine)} does not match "
                                  f"{imp.sources[f'{section}.{name}']} in {where}/{CONFIG_FILE}; drop "
                                  f"model.{section}.{name} (init_from sets it)")
    theirs = replace(model, **imp.values)
    for f in fields(ModelConfig):
        name = f.name
        if name not in typed or name in FREE_KEYS or name in ("mla", "mtp") or \
                (name == "vocab_size" and model.vocab_size is None):
            continue  # (model.mla.*, model.mtp.*: checked key by key above)
        if name == "moe":  # checked key by key, so that the refusal names one
            _check_moe_keys(model, theirs, imp, where, typed)
            continue
        mine = getattr(model, name)
        if _effective(replace(theirs, **{name: mine})) != _effective(theirs):
            raise ConfigError(f"model.{name}={_show(mine)} does not match {imp.sources[name]} in "
                              f"{where}/{CONFIG_FILE}; drop model.{name} (init_from sets it)")
    seq_len = model.seq_len
    if seq_len > imp.max_positions:
        if "seq_len" in typed:
            raise ConfigError(f"model.seq_len={seq_len} exceeds {imp.positions_key}={imp.max_positions} in "
                              f"{where}/{CONFIG_FILE}; set model.seq_len <= {imp.max_positions}")
        seq_len = imp.max_positions
    for name, value in {**imp.values, "seq_len": seq_len}.items():
        setattr(model, name, value)
    return hf


def mtp_layers_held(path: str | Path, n_layers: int, depth: int) -> int:
    """How many of config.json's `depth` multi-token prediction layers (stored as model.layers.<n_layers + k>) the
    directory's weights hold: transformers' save_pretrained drops them while its config keeps the count. Read from
    the safetensors header or the index, no tensor."""
    if depth == 0:
        return 0
    root = Path(path)
    try:
        if (root / WEIGHTS_INDEX).exists() and not (root / WEIGHTS_FILE).exists():
            names = set(json.loads((root / WEIGHTS_INDEX).read_text()).get("weight_map", {}))
        else:
            with open(root / WEIGHTS_FILE, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                names = set(json.loads(f.read(size)))
    except (OSError, ValueError):  # unreadable: as config.json says (reading the weights says what is wrong)
        return depth
    held = 0
    while held < depth and any(n.startswith(f"model.layers.{n_layers + held}.") for n in names):
        held += 1
    return held


def _check_moe_keys(model: ModelConfig, theirs: ModelConfig, imp: Imported, where: str, typed: set[str]) -> None:
    """Each model.moe.* key the user set (`moe.Y` in `typed`), but MOE_FREE_KEYS, agrees with the directory's (a
    null ffn_hidden is model.ffn_hidden), else one line names both values."""
    for f in fields(MoEConfig):
        name = f.name
        if name in MOE_FREE_KEYS or f"moe.{name}" not in typed:
            continue
        mine, want = getattr(model.moe, name), getattr(theirs.moe, name)
        if name == "ffn_hidden":
            mine, want = mine or theirs.ffn, want or theirs.ffn
        if mine != want:
            raise ConfigError(f"model.moe.{name}={_show(getattr(model.moe, name))} does not match "
                              f"{imp.sources[f'moe.{name}']} in {where}/{CONFIG_FILE}; drop model.moe.{name} "
                              f"(init_from sets it)")


def explain_imported(message: str, hf: Mapping[str, Any], path: str, typed: Iterable[str] = ()) -> str:
    """A validation refusal that starts with a model.* key init_from set (not one the user typed), with where its
    value came from, e.g. `... (model.n_kv_heads is num_key_value_heads=2 in init_from=DIR/config.json)`."""
    m = re.match(r"model\.(\w+(?:\.\w+)?)=", message)  # model.hidden=, model.moe.ffn_hidden=
    if m is None or m.group(1) in set(typed) or m.group(1) in FREE_KEYS:
        return message
    source = imported_keys(hf, f"init_from={path}").sources.get(m.group(1))
    return f"{message} (model.{m.group(1)} is {source} in init_from={path}/{CONFIG_FILE})" if source else message


# ------------------------------------------------------------------------------------------------ export

def model_config_of(model: ModelConfig | Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig, or a manifest's model keys (ModelConfig as a dict, maybe from before some keys existed), with
    its null architecture keys resolved (arch_defaults)."""
    if not isinstance(model, ModelConfig):
        known = {f.name for f in fields(ModelConfig)}
        model = ModelConfig(**{k: v for k, v in model.items() if k in known})
    return arch_defaults(model)


def _resolved(model: Mapping[str, Any]) -> dict[str, Any]:
    """A manifest's model keys, nulls resolved, as what they compute (`_effective`)."""
    return _effective(model_config_of(model))


def hf_class(model: ModelConfig | Mapping[str, Any]) -> tuple[str, str] | None:
    """(model_type, class) transformers computes `model` (a ModelConfig, or one as a dict) with, or None. arch=gpt
    is GPT-2 with learned positions, GPT-NeoX with rotary ones (whole heads rotated, layers sequential: what
    mlplat's GPT computes; any norm_eps, tied or not). arch=llama with q/k/v biases is Qwen2, with model.qk_norm
    Qwen3; otherwise a Llama (a Mistral without a sliding window is one, and is exported as one). A mixture of
    experts is the class `moe_type` names when it is one (`not_moe_class`), else it has none."""
    if attention_refusal(model) is not None:
        return None
    m = _resolved(model)
    if m.get("attention") == "mla" and not (m.get("moe") or {}).get("num_experts", 0):
        return None  # DeepSeek-V3's class has experts
    if (m.get("moe") or {}).get("num_experts", 0) > 0:
        model_type = moe_type(model)
        return None if not_moe_class(model) else (model_type, CAUSAL_LM[model_type])
    if m.get("arch") == "gpt":
        gpt = {"norm": "layernorm", "mlp": "gelu", "bias": True, "qkv_bias": True, "n_kv_heads": m["n_heads"],
               "qk_norm": False, "head_dim": m["hidden"] / m["n_heads"]}  # GPT-2's and GPT-NeoX's heads tile h
        gpt2 = {"position": "learned", "tie_embeddings": True, "norm_eps": LAYER_NORM_EPS}
        if not all(m[k] == v for k, v in gpt.items()):
            return None
        if m["position"] == "rope":  # GPT-NeoX with rotary_pct 1: the whole head turns
            return ("gpt_neox", CAUSAL_LM["gpt_neox"]) if m["rotary_dim"] == m["head_dim"] else None
        return ("gpt2", CAUSAL_LM["gpt2"]) if all(m[k] == v for k, v in gpt2.items()) else None
    llama = {"arch": "llama", "position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False,
             "rotary_dim": m["head_dim"]}  # the dense classes turn the whole head
    if not all(m.get(k) == v for k, v in llama.items()):
        return None
    if m["qk_norm"]:  # Qwen3's q and k projections have no biases
        return None if m["qkv_bias"] else ("qwen3", CAUSAL_LM["qwen3"])
    model_type = "qwen2" if m["qkv_bias"] else "llama"
    return model_type, CAUSAL_LM[model_type]


def _moe_required(name: str, **extra: tuple[Any, str]) -> dict[str, tuple[Any, str]]:
    """What a mixture of experts must be for transformers' `name` to compute it: key -> (required value, why)."""
    return {"arch": ("llama", f"{name} is a Llama with experts"),
            "position": ("rope", f"{name}'s positions are rotary"), "norm": ("rmsnorm", f"{name}'s norms are RMSNorms"),
            "mlp": ("swiglu", f"{name}'s experts are SwiGLU MLPs"),
            "bias": (False, f"{name}'s linear layers have no biases"),
            "moe.router": ("softmax", f"{name}'s router is a softmax over the experts"),
            "moe.capacity_factor": (None, f"{name} is dropless"),
            "moe.bias_update_rate": (0.0, f"{name} has no expert bias"),
            "moe.expert_bias": (False, f"{name} has no expert bias"),
            "moe.routed_scaling_factor": (1.0, f"{name} does not scale its gates"),
            "moe.n_groups": (1, f"{name}'s router chooses among all the experts"), **extra}


_MOE_REQUIRED = {
    "mixtral": _moe_required(
        "Mixtral", qkv_bias=(False, "Mixtral's q, k and v projections have no biases"),
        qk_norm=(False, "Mixtral has no norms on q and k"),
        **{"moe.shared_experts": (0, "Mixtral has no shared experts"),
           "moe.dense_layers": (0, "every Mixtral layer is a mixture of experts"),
           "moe.norm_topk_prob": (True, "Mixtral renormalises the k chosen probabilities to sum 1")}),
    "qwen2_moe": _moe_required(
        "Qwen2-MoE", qk_norm=(False, "Qwen2-MoE has no norms on q and k"),
        **{"moe.shared_gate": (True, "Qwen2-MoE gates its shared expert with a sigmoid")}),
    "qwen3_moe": _moe_required(
        "Qwen3-MoE", qkv_bias=(False, "Qwen3-MoE's q, k and v projections have no biases"),
        **{"moe.shared_experts": (0, "Qwen3-MoE has no shared experts")}),
    # the expert bias moved by aux-loss-free balancing or kept as it is: GLM-4.5's correction bias either way
    "glm4_moe": {**{k: v for k, v in _moe_required("GLM-4.5").items() if k not in ("moe.bias_update_rate",
                                                                                     "moe.expert_bias",
                                                                                     "moe.routed_scaling_factor",
                                                                                     "moe.router", "moe.n_groups")},
                 "moe.router": ("sigmoid", "GLM-4.5's router scores each expert by a sigmoid"),
                 "moe.shared_gate": (False, "GLM-4.5's shared experts have no gate")},
}
_MOE_REQUIRED["deepseek_v3"] = {
    **{k: v for k, v in _MOE_REQUIRED["glm4_moe"].items()},
    "moe.router": ("sigmoid", "DeepSeek-V3's router scores each expert by a sigmoid"),
    "moe.shared_gate": (False, "DeepSeek-V3's shared experts have no gate"),
    "qkv_bias": (False, "DeepSeek-V3's attention has no biases"), "qk_norm": (False, "DeepSeek-V3 has no q/k norms"),
    "tie_embeddings": (False, "DeepSeek-V3's output layer is its own"),
    "norm_eps": (DEEPSEEK_LATENT_EPS, "DeepSeek-V3's latent norms use 1e-6 whatever rms_norm_eps says")}
_MOE_REQUIRED["deepseek_v2"] = {
    **{k: v for k, v in _MOE_REQUIRED["deepseek_v3"].items() if k not in ("moe.router", "moe.n_groups")},
    "moe.router": ("softmax", "DeepSeek-V2's router is a softmax over the experts"),
    "moe.expert_bias": (False, "DeepSeek-V2 has no expert bias"), "moe.bias_update_rate": (0.0, "DeepSeek-V2 has no "
                                                                                           "expert bias"),
    "moe.norm_topk_prob": (False, "transformers' DeepseekV2 never renormalises the chosen probabilities")}
MOE_CLASS_RULE = "DeepseekV3ForCausalLM with model.attention=mla and the sigmoid router, DeepseekV2ForCausalLM with " \
                 "model.attention=mla, else Glm4MoeForCausalLM with " \
                 "model.moe.router=sigmoid, else Qwen3MoeForCausalLM with model.qk_norm, " \
                 "else Qwen2MoeForCausalLM with shared experts, else MixtralForCausalLM"


def moe_type(model: ModelConfig | Mapping[str, Any]) -> str:
    """The transformers model_type a mixture of experts is written as (MOE_CLASS_RULE), whether or not it fits."""
    m = _resolved(model)
    if m.get("attention") == "mla":
        return "deepseek_v3" if (m.get("moe") or {}).get("router") == "sigmoid" else "deepseek_v2"
    if (m.get("moe") or {}).get("router") == "sigmoid":
        return "glm4_moe"
    if m.get("qk_norm"):
        return "qwen3_moe"
    return "qwen2_moe" if (m.get("moe") or {}).get("shared_experts", 0) > 0 else "mixtral"


def not_moe_class(model: ModelConfig | Mapping[str, Any]) -> str | None:
    """None when the mixture of experts `model` is what its class (`moe_type`) computes, else the first key that is
    not, its value and why (`model.moe.norm_topk_prob=false (Mixtral renormalises ...)`)."""
    m, kind = _resolved(model), moe_type(model)
    for key, (want, why) in _MOE_REQUIRED[kind].items():
        group, _, sub = key.rpartition(".")
        have = (m.get(group) or {}).get(sub) if group else m.get(key)
        if have != want:
            return f"model.{key}={_show(have)} ({why})"
    moe = m.get("moe") or {}
    if kind not in ("glm4_moe", *DEEPSEEK):
        if m.get("rotary_dim") != m.get("head_dim"):
            return f"model.rotary_dim={m.get('rotary_dim')} ({CAUSAL_LM[kind]} turns the whole head)"
        return None
    name = {"glm4_moe": "GLM-4.5", "deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3"}[kind]
    if moe.get("shared_experts", 0) < 1:
        return f"model.moe.shared_experts={moe.get('shared_experts', 0)} ({name} has at least one shared expert)"
    if kind == "deepseek_v2":  # a group's score: its best expert's
        return f"model.rope_scaling is Llama 3.1's ({name}'s rotary embedding is written with YaRN or none)" \
            if "low_freq_factor" in (m.get("rope_scaling") or {}) else None
    if moe.get("num_experts", 0) < 2 * moe.get("n_groups", 1):
        return (f"model.moe.n_groups={moe.get('n_groups')} ({name} scores a group by its two best experts: groups of "
                f"at least 2 of the model.moe.num_experts={moe.get('num_experts')})")
    if not (moe.get("expert_bias") or moe.get("bias_update_rate", 0) > 0):
        return (f"model.moe.expert_bias=false ({name} chooses its experts with its correction bias, "
                f"e_score_correction_bias; set model.moe.expert_bias=true)")
    if kind == "deepseek_v3" and "low_freq_factor" in (m.get("rope_scaling") or {}):
        return "model.rope_scaling is Llama 3.1's (DeepSeek-V3's rotary embedding is written with YaRN or none)"
    return None


def _rope_entries(m: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """config.json's rotary keys: transformers 5 reads rope_parameters (with `extra`), older versions rope_scaling
    beside a theta at the top level (the caller names it): both, alike."""
    theta = float(m["rope_theta"])
    given = m["rope_scaling"]
    if given is not None and "low_freq_factor" not in given:  # (_effective drops rope_type: llama3's has this key)
        scaling = {"rope_type": "yarn", **{k: given[k] for k in (*YARN_KEYS, *YARN_OPTIONAL_KEYS) if k in given}}
    else:
        scaling = None if given is None else {"rope_type": "llama3", **{k: given[k] for k in ROPE_SCALING_KEYS}}
    params = {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}
    return {"rope_parameters": {**params, **extra}, "rope_scaling": scaling}


def hf_config(model: Mapping[str, Any], dtype: str, bos: int | None = None, eos: int | None = None) -> dict[str, Any]:
    """A config.json for the transformers class of `hf_class(model)` from mlplat's model keys (the true vocabulary,
    no TP padding rows; its positions = model.seq_len); the token ids are the tokenizer's, when known."""
    model_type, cls = hf_class(model) or (None, None)
    if model_type is None:
        raise ValueError("the model has no transformers class (see hf_class)")
    m = _resolved(model)
    hidden, layers, heads, dropout = m["hidden"], m["n_layers"], m["n_heads"], float(m["dropout"])
    common = {"architectures": [cls], "model_type": model_type, "vocab_size": m["vocab_size"],
              "initializer_range": float(m["init_std"]), "use_cache": True, "tie_word_embeddings": m["tie_embeddings"],
              "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": None, "dtype": dtype}
    if model_type == "gpt2":
        ffn = m["ffn_hidden"]
        return {**common,
                "n_positions": m["seq_len"], "n_embd": hidden, "n_layer": layers, "n_head": heads,
                "n_inner": None if ffn == 4 * hidden else ffn,
                "activation_function": TO_HF_ACTIVATION[m["activation"]],
                "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout,
                "layer_norm_epsilon": LAYER_NORM_EPS, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                "add_cross_attention": False}
    theta = float(m["rope_theta"])
    if model_type == "gpt_neox":
        # Older transformers read rotary_pct and rotary_emb_base; transformers 5 rope_parameters (it renames them).
        return {**common,
                "hidden_size": hidden, "intermediate_size": m["ffn_hidden"], "num_hidden_layers": layers,
                "num_attention_heads": heads, "hidden_act": TO_HF_ACTIVATION[m["activation"]],
                "max_position_embeddings": m["seq_len"], "layer_norm_eps": float(m["norm_eps"]),
                "use_parallel_residual": False, "attention_bias": True, "hidden_dropout": dropout,
                "attention_dropout": dropout, **_rope_entries(m, partial_rotary_factor=1.0), "rotary_pct": 1.0,
                "rotary_emb_base": theta}
    out = {**common,
           "hidden_size": hidden, "intermediate_size": m["ffn_hidden"], "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": m["n_kv_heads"], "head_dim": m["head_dim"],
           "hidden_act": "silu", "max_position_embeddings": m["seq_len"], "rms_norm_eps": float(m["norm_eps"]),
           "attention_dropout": dropout, **_rope_entries(m), "rope_theta": theta}
    if model_type in QK_NORM_TYPES:
        out["attention_bias"] = False
    if model_type in ("qwen2", "qwen3", *QWEN_MOE):
        out.update({"use_sliding_window": False, "sliding_window": None})
    if model_type in ("qwen2", "qwen3", "qwen2_moe"):  # Qwen3-MoE's config has neither key
        out.update({"max_window_layers": layers, "layer_types": ["full_attention"] * layers})
    if model_type == "qwen2_moe" and m["head_dim"] * heads == hidden:  # its config has no head_dim key (its
        del out["head_dim"]  # attention reads one when there: hidden_size/num_attention_heads otherwise)
    moe = m["moe"]
    if model_type == "mixtral":  # intermediate_size: one expert's width; no auxiliary loss in transformers' output
        out.update({"intermediate_size": moe["ffn_hidden"] or m["ffn_hidden"], "num_local_experts": moe["num_experts"],
                    "num_experts_per_tok": moe["top_k"], "sliding_window": None, "router_jitter_noise": 0.0,
                    "output_router_logits": False})
    elif model_type in QWEN_MOE:  # intermediate_size: the dense layers' MLP width
        width = moe["ffn_hidden"] or m["ffn_hidden"]
        out.update({"moe_intermediate_size": width, "num_experts": moe["num_experts"],
                    "num_experts_per_tok": moe["top_k"], "norm_topk_prob": moe["norm_topk_prob"],
                    "decoder_sparse_step": 1, "mlp_only_layers": list(range(moe["dense_layers"])),
                    "output_router_logits": False})
        if model_type == "qwen2_moe":
            out.update({"qkv_bias": m["qkv_bias"], "shared_expert_intermediate_size": moe["shared_experts"] * width})
    elif model_type == "glm4_moe":  # intermediate_size: the dense layers' MLP width
        out.update({**_rope_entries(m, partial_rotary_factor=m["rotary_dim"] / m["head_dim"]),
                    "attention_bias": m["qkv_bias"], "use_qk_norm": m["qk_norm"],
                    "moe_intermediate_size": moe["ffn_hidden"] or m["ffn_hidden"],
                    "n_routed_experts": moe["num_experts"], "num_experts_per_tok": moe["top_k"],
                    "n_shared_experts": moe["shared_experts"], "first_k_dense_replace": moe["dense_layers"],
                    "n_group": moe["n_groups"], "topk_group": moe["topk_groups"],
                    "routed_scaling_factor": float(moe["routed_scaling_factor"]),
                    "norm_topk_prob": moe["norm_topk_prob"], "num_nextn_predict_layers": m["mtp"]["depth"],
                    "output_router_logits": False})
    elif model_type in ("llama", "mistral"):
        out.update({"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1})
    elif model_type in DEEPSEEK:  # intermediate_size: the dense layers' MLP width
        mla = m["mla"]
        del out["head_dim"]  # (transformers sets it to qk_rope_head_dim)
        out.update({**_rope_entries(m), "num_key_value_heads": heads, "attention_bias": False, "rope_interleave": True,
                    "moe_intermediate_size": moe["ffn_hidden"] or m["ffn_hidden"],
                    "n_routed_experts": moe["num_experts"], "num_experts_per_tok": moe["top_k"],
                    "n_shared_experts": moe["shared_experts"], "first_k_dense_replace": moe["dense_layers"],
                    "n_group": moe["n_groups"], "topk_group": moe["topk_groups"],
                    "routed_scaling_factor": float(moe["routed_scaling_factor"]),
                    "norm_topk_prob": moe["norm_topk_prob"], "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                    "num_nextn_predict_layers": m["mtp"]["depth"], "output_router_logits": False,
                    **{k: mla[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                           "v_head_dim")}})
        if model_type == "deepseek_v2":
            grouped = moe["n_groups"] > 1
            del out["rope_interleave"], out["num_nextn_predict_layers"]
            out.update({"scoring_func": "softmax", "topk_method": "group_limited_greedy" if grouped else "greedy",
                        "mlp_bias": False})
    return out
