"""mlplat's parameters <-> transformers' tensors (GPT-2; GPT-NeoX; Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE,
Qwen3-MoE, GLM-4.5, DeepSeek-V2 and V3), both ways, one tensor (or one rank's shard) at a time.

Names: mlplat's full-model names (`layers.3.attn.qkv.weight`) <-> transformers' (GPT-2:
`transformer.h.3.attn.c_attn.weight`; GPT-NeoX: `gpt_neox.layers.3.attention.query_key_value.weight`; the Llama
family: `model.layers.3.self_attn.{q,k,v}_proj.weight`).

GPT-2's layouts:
- its `Conv1D` stores the weight [in, out]; mlplat's linear layers [out, in]: a transpose;
- its `c_attn` output is q|k|v blocks, each [heads·head_dim]; mlplat's QKV output is [head][q|k|v][head_dim],
  so that a tensor-parallel rank's contiguous slice is whole heads: a permutation.

GPT-NeoX's are mlplat's own: Linear [out, in]; `query_key_value`'s output is [head][q|k|v][head_dim] (it views it as
[heads, 3·head_dim] and splits the last dim in three); its RoPE is "rotate half" like mlplat's. Names only, and the
vocabulary rows; an untied output layer is `embed_out` (what transformers 5 still saves).

The Llama family's (its Linear is [out, in] like mlplat's; its RoPE is "rotate half" like mlplat's: no permutation
of q or k):
- q_proj, k_proj, v_proj -> one QKV whose output is grouped by key/value head g: [the r = n_heads/n_kv_heads query
  heads of g (q_proj rows g·r·d .. (g+1)·r·d), k_proj rows g·d .. (g+1)·d, v_proj's alike] (biases alike, Qwen2);
- gate_proj, up_proj -> fc1 with interleaved rows: row 2j is gate row j, row 2j + 1 up row j;
- o_proj -> attn.out, down_proj -> mlp.fc2, the norms, lm_head -> output (untied) as they are; Qwen3's
  self_attn.q_norm and k_norm [head_dim] -> attn.q_norm, attn.k_norm as they are.

Mixtral's mixture of experts (mlplat.model.moe.MoELayer: the E experts' matrices stacked along dim 0, expert by
expert), in the Hub's per-expert names that transformers 5 still saves, `block_sparse_moe.`:
- gate -> mlp.router [E, h] as it is;
- experts.e.w1 (gate) and experts.e.w3 (up), each [f, h] -> expert e's rows of mlp.experts.fc1 [E·2f, h]: rows
  e·2f .. e·2f + f are w1, the next f rows w3 (transformers' fused gate_up_proj, flattened);
- experts.e.w2 (down) [h, f] -> expert e's rows of mlp.experts.fc2 [E·h, f] as it is (the fused down_proj,
  flattened).
Qwen2-MoE's and Qwen3-MoE's (the `qwen_moe` names), alike under other names: mlp.gate -> mlp.router,
mlp.experts.e.gate_proj and up_proj -> expert e's rows of mlp.experts.fc1, mlp.experts.e.down_proj -> those of
mlp.experts.fc2; Qwen2-MoE's shared expert mlp.shared_expert.{gate,up,down}_proj -> mlp.shared.fc1 (interleaved as
the dense fc1) and fc2, its gate mlp.shared_expert_gate [1, h] -> mlp.shared_gate as it is.
GLM-4.5's (the `glm4_moe` names): the Qwen MoEs' experts and router; its ungated shared experts
mlp.shared_experts.{gate,up,down}_proj -> mlp.shared.fc1, fc2; its correction bias mlp.gate.e_score_correction_bias
[E] -> the layer's expert bias `layers.<i>.mlp.expert_bias` (a buffer, not a parameter: `load_into` reads it whole on
every rank holding the layer, and export writes it in float32, or float64 beside float64 weights). Its rotary
embedding turns the first half of each head in rotate-half pairs, as mlplat's partial rotary (`model.rotary_dim`):
q and k are read as they are.
DeepSeek-V3's and V2's (the `deepseek_v3` names): GLM-4.5's MoE names; the latent attention's modules are
transformers' row for row (self_attn.q_a_proj, q_a_layernorm, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
kv_b_proj, o_proj -> attn.q_down, q_norm, q_up or q, kv_down, kv_norm, kv_up, out), the rotary rows of q_up (q) and
kv_down permuted from DeepSeek's interleaved pairs (`deinterleave`).
Multi-token prediction module k of DeepSeek-V3 and of GLM-4.5 (MTP_LAYOUTS) is layer num_hidden_layers + k: its layer
under a layer's names, laid out as any layer's (an MoE layer of the family's kind), and MTP_NAMES; its copies of the
embedding and output layer (MTP_COPIES) are not read.
transformers 5's own fused layout of all three (`mlp.gate`, `mlp.experts.gate_up_proj` [E, 2f, h] with gate rows then
up rows, `mlp.experts.down_proj` [E, h, f]) is read too, when a directory holds it. Every expert tensor is read through
`HFWeights.read_experts`, given the global indices of the experts a rank holds.

All: the word embedding (and an untied output layer) holds the true vocabulary in transformers; mlplat pads it with
zero rows for tensor parallelism.

Import (`load_into`) reads, on each rank, only that rank's shard (safetensors `get_slice`): its key/value groups of
q, k and v (with fewer key/value heads than tp ranks: its query heads and the key/value head they share), its MLP
units of gate and up, its columns of o_proj and down_proj (GPT-2's and GPT-NeoX's alike: its heads, its units, its
columns), its vocabulary rows; so no rank ever materialises a full tensor of the model.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import torch

from mlplat.checkpoint import CheckpointError
from mlplat.checkpoint.hf_config import (
    LLAMA_FAMILY,
    QWEN_MOE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    attention_refusal,
    hf_class,
    model_config_of,
)
from mlplat.checkpoint.state import VOCAB_ROWS, WORD_EMBEDDING
from mlplat.config import ModelConfig
from mlplat.errors import not_regular
from mlplat.model.init import OUTPUT_LAYER
from mlplat.model.moe import expert_biases
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.tensor import full_shape_of, is_expert, partition_dim_of

log = logging.getLogger("mlplat")


class Names(NamedTuple):
    """How a transformers class names its tensors (as its CausalLM class saves them)."""

    body: str  # the CausalLM class's body prefix; a bare body's files (GPT2Model, LlamaModel, ...) have none
    layers: str  # layer N's modules are under `{layers}{N}.`
    top: dict[str, str]  # mlplat's parameters outside the layers -> their names
    layer: dict[str, list[str]]  # a layer's modules -> their names (the parts it is made of, in order)


_LLAMA_LAYER = {"ln1": ["input_layernorm"], "ln2": ["post_attention_layernorm"],
                "attn.qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                "attn.out": ["self_attn.o_proj"], "attn.q_norm": ["self_attn.q_norm"],
                "attn.k_norm": ["self_attn.k_norm"], "mlp.fc1": ["mlp.gate_proj", "mlp.up_proj"],
                "mlp.fc2": ["mlp.down_proj"]}
_LLAMA_TOP = {WORD_EMBEDDING: "model.embed_tokens.weight", OUTPUT_LAYER: "lm_head.weight",
              "final_ln.weight": "model.norm.weight"}
NAMES = {  # by layout: "gpt2", "gpt_neox", "llama" (Mistral's, Qwen2's, Qwen3's, Mixtral's), "qwen_moe"
    "gpt2": Names("transformer.", "transformer.h.",
                  {WORD_EMBEDDING: "transformer.wte.weight", "embedding.position.weight": "transformer.wpe.weight",
                   "final_ln.weight": "transformer.ln_f.weight", "final_ln.bias": "transformer.ln_f.bias"},
                  {"ln1": ["ln_1"], "ln2": ["ln_2"], "attn.qkv": ["attn.c_attn"], "attn.out": ["attn.c_proj"],
                   "mlp.fc1": ["mlp.c_fc"], "mlp.fc2": ["mlp.c_proj"]}),
    "gpt_neox": Names("gpt_neox.", "gpt_neox.layers.",
                      {WORD_EMBEDDING: "gpt_neox.embed_in.weight", OUTPUT_LAYER: "embed_out.weight",
                       "final_ln.weight": "gpt_neox.final_layer_norm.weight",
                       "final_ln.bias": "gpt_neox.final_layer_norm.bias"},
                      {"ln1": ["input_layernorm"], "ln2": ["post_attention_layernorm"],
                       "attn.qkv": ["attention.query_key_value"], "attn.out": ["attention.dense"],
                       "mlp.fc1": ["mlp.dense_h_to_4h"], "mlp.fc2": ["mlp.dense_4h_to_h"]}),
    "llama": Names("model.", "model.layers.", _LLAMA_TOP, {**_LLAMA_LAYER, "mlp.router": ["block_sparse_moe.gate"]}),
    "qwen_moe": Names("model.", "model.layers.", _LLAMA_TOP,
                      {**_LLAMA_LAYER, "mlp.router": ["mlp.gate"],
                       "mlp.shared.fc1": ["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"],
                       "mlp.shared.fc2": ["mlp.shared_expert.down_proj"],
                       "mlp.shared_gate": ["mlp.shared_expert_gate"]}),
    "glm4_moe": Names("model.", "model.layers.", _LLAMA_TOP,
                      {**_LLAMA_LAYER, "mlp.router": ["mlp.gate"],
                       "mlp.shared.fc1": ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"],
                       "mlp.shared.fc2": ["mlp.shared_experts.down_proj"]}),
    "deepseek_v3": Names("model.", "model.layers.", _LLAMA_TOP,
                         {"ln1": ["input_layernorm"], "ln2": ["post_attention_layernorm"],
                          "attn.q_down": ["self_attn.q_a_proj"], "attn.q_norm": ["self_attn.q_a_layernorm"],
                          "attn.q_up": ["self_attn.q_b_proj"], "attn.q": ["self_attn.q_proj"],
                          "attn.kv_down": ["self_attn.kv_a_proj_with_mqa"],
                          "attn.kv_norm": ["self_attn.kv_a_layernorm"], "attn.kv_up": ["self_attn.kv_b_proj"],
                          "attn.out": ["self_attn.o_proj"], "mlp.fc1": ["mlp.gate_proj", "mlp.up_proj"],
                          "mlp.fc2": ["mlp.down_proj"], "mlp.router": ["mlp.gate"],
                          "mlp.shared.fc1": ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"],
                          "mlp.shared.fc2": ["mlp.shared_experts.down_proj"]}),
}
# The layouts whose multi-token prediction module k (mlplat.model.mtp: `mtp.<k>.*`) is stored as layer
# num_hidden_layers + k (DeepSeek-V3's; GLM-4.5's the same: SGLang's and vLLM's GLM-4.5 readers take these names): its
# layer's modules under their usual names, and these (mlplat's module -> its name)
MTP_LAYOUTS = ("glm4_moe", "deepseek_v3")
MTP_NAMES = {"enorm": "enorm", "hnorm": "hnorm", "proj": "eh_proj", "norm": "shared_head.norm"}
# ... and copies of the word embedding and the output layer, which mlplat's modules share with the model: not read
# (the model's own are), written back as copies (mlplat.checkpoint.hf_export)
MTP_COPIES = {WORD_EMBEDDING: "embed_tokens.weight", OUTPUT_LAYER: "shared_head.head.weight"}
_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")
# The rotary rows DeepSeek's checkpoints store in interleaved pairs (transformers' rope_interleave): each head's last
# qk_rope_head_dim rows of q_up (q), and kv_down's last qk_rope_head_dim rows (the shared key's), permuted on the way
# in to mlplat's halves (`deinterleave`) and back on the way out
_INTERLEAVED = ("attn.q_up", "attn.q", "attn.kv_down")
# The experts, per expert e (the Hub's names), by layout: mlplat's module -> its parts' names, in order
EXPERTS = {"llama": {"mlp.experts.fc1": ["block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3"],
                     "mlp.experts.fc2": ["block_sparse_moe.experts.{e}.w2"]},
           "qwen_moe": {"mlp.experts.fc1": ["mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"],
                        "mlp.experts.fc2": ["mlp.experts.{e}.down_proj"]}}
EXPERTS["glm4_moe"] = EXPERTS["deepseek_v3"] = EXPERTS["qwen_moe"]
# The expert bias (a buffer of the MoE layer, mlplat.model.moe.expert_biases) -> its name, by layout
EXPERT_BIAS = {"glm4_moe": "mlp.gate.e_score_correction_bias", "deepseek_v3": "mlp.gate.e_score_correction_bias"}
_EXPERT_BIAS = re.compile(r"^layers\.(\d+)\.mlp\.expert_bias$")
# transformers' non-parameter buffers that older checkpoints saved (GPT-2's causal mask, NeoX's, rotary tables)
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")
# transformers 5's fused names of the same, every layout's (module -> name); the router's is `mlp.gate`
FUSED = {"mlp.router": "mlp.gate.weight", "mlp.experts.fc1": "mlp.experts.gate_up_proj",
         "mlp.experts.fc2": "mlp.experts.down_proj"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_CONV1D = ("attn.qkv", "attn.out", "mlp.fc1", "mlp.fc2")  # GPT-2 Conv1D layers: weights stored transposed
# The dense MLPs' fc1: of two parts (model.mlp's entry, mlplat.specs.mlps), gate and up, its rows interleaved unit by
# unit (mlplat.model.decoder.SwiGLUMLP), one transformers tensor each
_MLP_FC1 = ("mlp.fc1", "mlp.shared.fc1")


def layout_of(model: ModelConfig | Mapping[str, Any]) -> str:
    """The NAMES (and tensor layout) the model is written with: its transformers class's (hf_config.hf_class)."""
    cls = hf_class(model)
    if cls is None:
        raise ValueError("the model has no transformers class (see hf_config.hf_class)")
    if cls[0] in QWEN_MOE:
        return "qwen_moe"
    if cls[0] in ("glm4_moe", "deepseek_v3"):
        return cls[0]
    if cls[0] == "deepseek_v2":  # DeepSeek-V3's names, no correction bias, no multi-token prediction
        return "deepseek_v3"
    return "llama" if cls[0] in LLAMA_FAMILY else cls[0]


def _natural_name(name: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in name.split("."))


def hf_names(full: str, layout: str = "gpt2", experts: int = 0, n_layers: int | None = None) -> list[str]:
    """transformers' names (as its CausalLM class saves them) of an mlplat full-model parameter name: one, or the
    parts it is made of (q, k, v; gate, up; each of the `experts` experts' w1, w3 or w2) in that order. `layout`: a
    key of NAMES; `n_layers`: the model's layers, after which DeepSeek-V3 and GLM-4.5 store their multi-token
    prediction modules."""
    names = NAMES[layout]
    if full in names.top:
        return [names.top[full]]
    mtp = _MTP.match(full)
    if mtp is not None and layout in MTP_LAYOUTS and n_layers is not None:
        if (layer := as_layer(full, n_layers)) != full:
            return hf_names(layer, layout, experts)
        module, _, kind = mtp.group(2).rpartition(".")
        if module in MTP_NAMES:
            return [f"{names.layers}{n_layers + int(mtp.group(1))}.{MTP_NAMES[module]}.{kind}"]
    bias = _EXPERT_BIAS.match(full)
    if bias is not None and layout in EXPERT_BIAS:
        return [f"{names.layers}{bias.group(1)}.{EXPERT_BIAS[layout]}"]
    m = _LAYER.match(full)
    if m is not None and m.group(2) in EXPERTS.get(layout, {}) and experts:
        return [name for e in range(experts) for name in expert_names(full, layout, e)]
    if m is not None and m.group(2) in names.layer:
        return [f"{names.layers}{m.group(1)}.{part}.{m.group(3)}" for part in names.layer[m.group(2)]]
    raise ValueError(f"parameter {full} has no transformers counterpart (the {layout} layout)")


def as_layer(full: str, n_layers: int) -> str:
    """A multi-token prediction module's layer's parameter `mtp.<k>.layer.X` as the layer stored (MTP_LAYOUTS),
    `layers.<n_layers + k>.X` (whose tensors are laid out as any layer's); any other name as it is."""
    m = _MTP.match(full)
    if m is None or not m.group(2).startswith("layer."):
        return full
    return f"layers.{n_layers + int(m.group(1))}.{m.group(2)[len('layer.'):]}"


def deinterleave(t: torch.Tensor, block: int, rope: int) -> torch.Tensor:
    """`t` (dim 0 in blocks of `block` rows, each ending in `rope` rotary rows: q_up's heads, kv_down's one) with each
    block's rotary rows, neighbouring pairs (2j, 2j + 1) in DeepSeek's checkpoints, as mlplat rotates them: the
    evens, then the odds (transformers' apply_rotary_pos_emb_interleave turns pair j into channels j and j + r/2).
    `interleave` is its inverse."""
    return _rope_rows(t, block, rope, (rope // 2, 2))


def interleave(t: torch.Tensor, block: int, rope: int) -> torch.Tensor:
    return _rope_rows(t, block, rope, (2, rope // 2))


def _rope_rows(t: torch.Tensor, block: int, rope: int, pairs: tuple[int, int]) -> torch.Tensor:
    blocks = t.reshape(-1, block, *t.shape[1:])
    rot = blocks[:, block - rope:].unflatten(1, pairs).transpose(1, 2).flatten(1, 2)
    return torch.cat((blocks[:, :block - rope], rot), dim=1).reshape(t.shape)


def expert_names(full: str, layout: str, e: int) -> list[str]:
    """transformers' names (the Hub's per-expert ones) of global expert `e`'s parts of a layer's mlp.experts.fc1
    (gate, up) or fc2 (down) weight `full`."""
    m = _LAYER.match(full)
    return [f"{NAMES[layout].layers}{m.group(1)}.{part.format(e=e)}.{m.group(3)}"
            for part in EXPERTS[layout][m.group(2)]]


def hf_name(full: str) -> str:
    """GPT-2's name (as GPT2LMHeadModel saves it) of an mlplat full-model parameter name."""
    return hf_names(full, "gpt2")[0]


def _module(full: str) -> str | None:
    m = _LAYER.match(full)
    return m.group(2) if m else None


def to_hf_views(full: str, t: torch.Tensor,
                model: ModelConfig | Mapping[str, Any]) -> list[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """[(transformers name, a view of `t`, its shape there)] for mlplat parameter `full` (one entry, or q, k, v /
    gate, up): each view's elements in row-major order are that tensor, so a writer can copy it out in blocks
    along dim 0 without a full second copy. Exact (slices and permutations only); works on the meta device.
    `model`: the model keys (a ModelConfig, or a checkpoint manifest's dict of them)."""
    m = model_config_of(model)
    layout = layout_of(m)
    full = as_layer(full, m.n_layers)
    names = hf_names(full, layout, m.moe.num_experts, m.n_layers)
    module = _module(full)
    if full in VOCAB_ROWS:
        t = t[:m.vocab_size]  # drop the tensor-parallel padding rows
        return [(names[0], t, tuple(t.shape))]
    if layout == "gpt_neox":  # mlplat's own layout
        return [(names[0], t, tuple(t.shape))]
    if layout == "gpt2":
        shape = tuple(t.shape)
        if module == "attn.qkv":
            # Output dim [head][q|k|v][head_dim] -> [q|k|v][head][head_dim]; the weight also [out, in] -> [in, out].
            if t.dim() == 2:
                t = t.view(m.n_heads, 3, -1, shape[1]).permute(3, 1, 0, 2)
                shape = (shape[1], shape[0])
            else:
                t = t.view(m.n_heads, 3, -1).transpose(0, 1)
        elif module in _CONV1D and t.dim() == 2:
            t = t.t()
            shape = tuple(t.shape)
        return [(names[0], t, shape)]
    rest = tuple(t.shape[1:])
    if layout == "deepseek_v3" and module in _INTERLEAVED:
        t = interleave(t, *_rope_block(module, m))  # a copy: these rows are not a view
        return [(names[0], t, tuple(t.shape))]
    if module == "attn.qkv":
        r, d = m.n_heads // m.kv_heads, m.head_size
        grouped = t.view(m.kv_heads, r + 2, d, *rest)  # [group][its r queries, k, v][head_dim](, in)
        parts = [(grouped[:, :r], m.n_heads * d), (grouped[:, r], m.kv_heads * d), (grouped[:, r + 1], m.kv_heads * d)]
        return [(n, p, (rows, *rest)) for n, (p, rows) in zip(names, parts)]
    if module in _MLP_FC1 and m.mlp_entry.fc1_parts == 2:
        pairs = t.view(-1, 2, *rest)  # [unit][gate, up](, in)
        return [(n, pairs[:, i], (pairs.shape[0], *rest)) for i, n in enumerate(names)]
    if module == "mlp.experts.fc1":  # [expert][gate, up][unit][in] -> w1, w3 of each expert
        pairs = t.view(m.moe.num_experts, 2, -1, *rest)
        return [(n, pairs[i // 2, i % 2], tuple(pairs.shape[2:3]) + rest) for i, n in enumerate(names)]
    if module == "mlp.experts.fc2":  # [expert][out][unit] -> w2 of each expert
        down = t.view(m.moe.num_experts, -1, *rest)
        return [(n, down[e], tuple(down.shape[1:])) for e, n in enumerate(names)]
    return [(names[0], t, tuple(t.shape))]


def _rope_block(module: str, m: ModelConfig) -> tuple[int, int]:
    """(rows of a block, its rotary rows) of an _INTERLEAVED module's weight: a head of q_up (q), or kv_down whole."""
    w = m.mla
    rope = w.qk_rope_head_dim
    return (w.kv_lora_rank if module == "attn.kv_down" else w.qk_nope_head_dim) + rope, rope


def _cols(src, lo: int, hi: int, dim: int):
    return src[lo:hi] if dim == 0 else src[:, lo:hi]


class HFWeights:
    """The safetensors files of a transformers model directory (one file, or shards with an index), opened
    lazily; tensors are read by slice. `model`: the model keys it is read into (their transformers class picks the
    names). Use as a context manager."""

    def __init__(self, path: str | Path, model: ModelConfig | Mapping[str, Any]):
        self.root = Path(path)
        self.model = model_config_of(model)
        if (why := attention_refusal(self.model)) is not None:
            raise CheckpointError(f"init_from={path}: {why}")
        self.layout = layout_of(self.model)
        self.prefix = NAMES[self.layout].body
        index = self.root / WEIGHTS_INDEX
        if (self.root / WEIGHTS_FILE).exists():
            with self._safe_open(WEIGHTS_FILE) as f:
                self.files = {name: WEIGHTS_FILE for name in f.keys()}
        elif index.exists():
            if (what := not_regular(index)) is not None:
                raise CheckpointError(f"init_from={path}: {index} is {what}, not a regular file")
            self.files = dict(json.loads(index.read_text())["weight_map"])
        else:
            raise CheckpointError(f"init_from={path} has no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX})")
        self._open: dict[str, object] = {}

    def _safe_open(self, file: str):
        """safetensors' handle on `file`, or one line naming it: a FIFO would block the open, and a cut-short file
        would end in safetensors' own traceback ("incomplete metadata")."""
        from safetensors import SafetensorError, safe_open

        path = self.root / file
        if (what := not_regular(path)) is not None:
            raise CheckpointError(f"init_from={self.root}: {path} is {what}, not a regular file")
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
        # The format: an 8-byte little-endian header length, the JSON header, then the tensors' bytes.
        need = 8 + int.from_bytes(head, "little") if len(head) == 8 else 8
        if size < need:
            raise CheckpointError(f"init_from={self.root}: {path} is truncated: {size} bytes, fewer than its "
                                  f"header alone needs ({need}); copy or download it again")
        try:
            return safe_open(str(path), framework="pt")
        except SafetensorError as e:
            raise CheckpointError(f"init_from={self.root}: {path} is not a readable safetensors file ({e}); copy "
                                  f"or download it again") from None

    def __enter__(self) -> "HFWeights":
        return self

    def __exit__(self, *exc) -> None:
        self._open.clear()  # safe_open handles unmap when dropped

    def _has(self, name: str) -> bool:
        return name in self.files or name.removeprefix(self.prefix) in self.files

    def _fused(self, full: str) -> str | None:
        """The name of Mixtral tensor `full` (the router, the experts' fc1 or fc2) in transformers 5's fused layout
        when the directory holds that layout rather than the Hub's, else None."""
        module = _module(full)
        if module not in FUSED:
            return None
        hub = hf_names(full, self.layout, self.model.moe.num_experts, self.model.n_layers)[0]
        fused = f"{NAMES[self.layout].layers}{_LAYER.match(full).group(1)}.{FUSED[module]}"
        return fused if not self._has(hub) and self._has(fused) else None

    def unexpected(self) -> list[str]:
        """The directory's tensors the model has no place for (an expert past its config's count, a module its class
        does not have): a directory that does not match its config.json, refused rather than half read. Not counted:
        transformers' non-parameter buffers, a tied model's saved output layer, the multi-token prediction layers
        (`unread_mtp_layers` says those)."""
        from mlplat.model.decoder import DecoderChunk  # (a meta-device model: its full-model names)
        from mlplat.model.moe import expert_biases

        m = self.model
        chunk = DecoderChunk(m, ParallelGrid(virtual=True), 0, 1, device="meta")
        fulls = [chunk.full_name(name) for name, _ in chunk.named_parameters()] + list(expert_biases([chunk]))
        known = set()
        for full in fulls:
            fused = self._fused(full)
            known.update([fused] if fused is not None else
                         hf_names(as_layer(full, m.n_layers), self.layout, m.moe.num_experts, m.n_layers))
        if self.layout in MTP_LAYOUTS:  # the modules' copies of the embedding and output layer: not read
            known.update(f"{NAMES[self.layout].layers}{m.n_layers + k}.{name}"
                         for k in range(m.mtp.depth) for name in MTP_COPIES.values())
        known = {name.removeprefix(self.prefix) for name in known}
        if m.tie_embeddings and OUTPUT_LAYER not in fulls and self.layout in ("llama", "qwen_moe", "glm4_moe"):
            known.add(_LLAMA_TOP[OUTPUT_LAYER].removeprefix(self.prefix))  # saved beside the tied embedding
        mtp = re.compile(rf"^(?:{re.escape(NAMES[self.layout].layers.removeprefix(self.prefix))})(\d+)\.")
        unread = m.n_layers + m.mtp.depth  # the multi-token prediction layers from here on are not read
        return [name for name in sorted(self.files, key=_natural_name) if name.removeprefix(self.prefix) not in known
                and not name.endswith(_BUFFERS)
                and not ((hit := mtp.match(name.removeprefix(self.prefix))) and int(hit.group(1)) >= unread)]

    def slice(self, name: str):
        """safetensors' lazy slice of tensor `name` (the CausalLM class's name; a bare body's file works too)."""
        key = name if name in self.files else name.removeprefix(self.prefix)
        if key not in self.files:
            raise CheckpointError(f"init_from={self.root} has no tensor {name}")
        file = self.files[key]
        if file not in self._open:
            self._open[file] = self._safe_open(file)
        return self._open[file].get_slice(key)

    def read_shard(self, full: str, param: torch.Tensor, grid: ParallelGrid) -> torch.Tensor:
        """This tensor-parallel rank's part of mlplat parameter `full`, shaped like `param`, reading only it."""
        m = self.model
        full = as_layer(full, m.n_layers)
        self._check_whole(full, param, grid)
        if self.layout == "gpt2":
            t = self._gpt2_shard(full, param, grid, m.n_heads)
        else:
            t = self._split_shard(full, param, grid, m)
            if self.layout == "deepseek_v3" and _module(full) in _INTERLEAVED and tuple(t.shape) == tuple(param.shape):
                t = deinterleave(t, *_rope_block(_module(full), m))  # whole blocks: its heads, or kv_down whole
        if tuple(t.shape) != tuple(param.shape):
            parts = " + ".join(hf_names(full, self.layout, m.moe.num_experts, m.n_layers))
            raise CheckpointError(f"init_from={self.root}: {parts} "
                                  f"gives a {tuple(t.shape)} shard for {full}, which is {tuple(param.shape)} on "
                                  f"this rank")
        return t

    def _check_whole(self, full: str, param: torch.Tensor, grid: ParallelGrid) -> None:
        """Each transformers tensor `full` is read from has, whole, the shape the model's keys give it: a rank reads
        only its rows or columns, so a larger tensor would load its first rows and a short vocabulary table would
        be zero-padded, silently. The position table may be longer than model.seq_len (its first rows are read)."""
        whole = full_shape_of(param, grid)
        fused = self._fused(full)
        if fused is not None:  # [E, h] as it is; [E, 2f, h] and [E, h, f] stacked by expert
            e = self.model.moe.num_experts
            shape = whole if _module(full) == "mlp.router" else (e, whole[0] // e, whole[1])
            views = [(fused, None, shape)]
        else:
            views = to_hf_views(full, torch.empty(whole, device="meta"), self.model)
        for name, _, shape in views:
            have = tuple(self.slice(name).get_shape())
            fits = have[1:] == shape[1:] and have[0] >= shape[0] if full == "embedding.position.weight" \
                else have == tuple(shape)
            if not fits:
                raise CheckpointError(f"init_from={self.root}: {name} is {list(have)} where the model (its "
                                      f"config.json) needs {list(shape)}")

    def _vocab_rows(self, src, param: torch.Tensor, grid: ParallelGrid) -> torch.Tensor:
        """This rank's rows of a vocabulary table; rows past the true vocabulary are padding: zero."""
        rows = param.shape[0]
        start = grid.tp_rank * rows
        real = max(0, min(rows, src.get_shape()[0] - start))
        t = torch.zeros(param.shape, dtype=param.dtype)
        if real:
            t[:real] = src[start:start + real]
        return t

    def _gpt2_shard(self, full: str, param: torch.Tensor, grid: ParallelGrid, n_heads: int) -> torch.Tensor:
        src = self.slice(hf_name(full))
        shape = src.get_shape()
        dim, module = partition_dim_of(param), _module(full)
        rank = grid.tp_rank if dim is not None else 0
        if full == WORD_EMBEDDING:
            return self._vocab_rows(src, param, grid)
        if full == "embedding.position.weight":
            return src[:param.shape[0]]  # model.seq_len may be under n_positions: the first seq_len positions
        if module == "attn.qkv":
            hidden = shape[0] if len(shape) == 2 else shape[0] // 3
            head_dim = hidden // n_heads
            heads = param.shape[0] // (3 * head_dim)
            lo = rank * heads * head_dim
            # This rank's heads, from each of the q, k and v blocks, back into [head][q|k|v][head_dim].
            cols = [(j * hidden + lo, j * hidden + lo + heads * head_dim) for j in range(3)]
            if len(shape) == 2:
                t = torch.stack([src[:, a:b] for a, b in cols]).view(3, hidden, heads, head_dim)
                return t.permute(2, 0, 3, 1).reshape(param.shape)
            return torch.stack([src[a:b] for a, b in cols]).view(3, heads, head_dim).transpose(0, 1).reshape(-1)
        if module in _CONV1D and param.dim() == 2:
            # mlplat's weight is the transpose of GPT-2's: its split dimension is the other one there.
            size = param.shape[dim]
            return _cols(src, rank * size, (rank + 1) * size, 1 - dim).t()
        if dim is not None:
            size = param.shape[dim]
            return _cols(src, rank * size, (rank + 1) * size, dim)
        return src[:]

    def _split_shard(self, full: str, param: torch.Tensor, grid: ParallelGrid, m: ModelConfig) -> torch.Tensor:
        """The Llama family's shard (q, k, v and gate, up joined) or GPT-NeoX's (mlplat's own layout: its rows or
        columns as they are)."""
        names = hf_names(full, self.layout, self.model.moe.num_experts, self.model.n_layers)
        dim, module = partition_dim_of(param), _module(full)
        rank = grid.tp_rank if dim is not None else 0
        if full in VOCAB_ROWS:
            return self._vocab_rows(self.slice(names[0]), param, grid)
        if module in ("mlp.experts.fc1", "mlp.experts.fc2"):
            # An ep rank holds its experts whole; split over tp, every rank holds its units of every expert.
            held = m.moe.num_experts // grid.ep if is_expert(param) else m.moe.num_experts
            first = grid.ep_rank * held if is_expert(param) else 0
            rows = param.shape[0] // held  # of each expert on this rank
            units = rows // 2 if module == "mlp.experts.fc1" else param.shape[1]  # of each expert's width
            lo = 0 if is_expert(param) else rank * units
            return self.read_experts(full, range(first, first + held), (lo, lo + units))
        rest = tuple(param.shape[1:])
        if module == "attn.qkv" and self.layout != "gpt_neox":
            # This rank's key/value heads (contiguous) with their query heads; with fewer key/value heads than
            # ranks, the one head it shares with the other `share` ranks of its group and 1/share of its queries.
            share = m.kv_replicas(grid.tp)
            r, d = m.n_heads // m.kv_heads, m.head_size
            qr = r // share  # query heads of a group on this rank
            groups = param.shape[0] // ((qr + 2) * d)
            g0 = rank // share * groups
            q0 = (g0 * r + rank % share * qr) * d
            q, k, v = (self.slice(n) for n in names)
            parts = [q[q0:q0 + groups * qr * d].view(groups, qr, d, *rest),
                     k[g0 * d:(g0 + groups) * d].view(groups, 1, d, *rest),
                     v[g0 * d:(g0 + groups) * d].view(groups, 1, d, *rest)]
            return torch.cat(parts, dim=1).reshape(param.shape)
        if module in _MLP_FC1 and m.mlp_entry.fc1_parts == 2:
            units = param.shape[0] // 2  # this rank's MLP units: their gate and up rows, interleaved
            gate, up = (self.slice(n)[rank * units:(rank + 1) * units] for n in names)
            return torch.stack([gate, up], dim=1).reshape(param.shape)
        src = self.slice(self._fused(full) or names[0])
        if dim is not None:
            size = param.shape[dim]
            return _cols(src, rank * size, (rank + 1) * size, dim)
        return src[:]

    def read_whole(self, full: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The one transformers tensor of mlplat name `full` whole (a layer's expert bias, held alike by every rank
        holding the layer), refused in one line unless it has `shape`."""
        name = hf_names(as_layer(full, self.model.n_layers), self.layout)[0]
        src = self.slice(name)
        if tuple(src.get_shape()) != tuple(shape):
            raise CheckpointError(f"init_from={self.root}: {name} is {list(src.get_shape())} where the model (its "
                                  f"config.json) needs {list(shape)}")
        return src[:]

    def read_experts(self, full: str, experts: Sequence[int], units: tuple[int, int]) -> torch.Tensor:
        """Global experts `experts` (in that order) of a layer's mlp.experts.fc1 or fc2 weight `full`, units
        [lo, hi) of each expert's width, in mlplat's stacking (mlplat.model.moe.ExpertWeights): fc1
        [len(experts)·2(hi - lo), h], each expert's gate rows, then its up rows; fc2 [len(experts)·h, hi - lo], each
        expert's down projection. Reads only those rows (columns of down), from the Hub's per-expert
        tensors or transformers 5's fused ones. Tensor parallelism passes every expert and its rank's units; a rank
        holding some experts whole passes those and (0, the expert's width)."""
        lo, hi = units
        module, fused = _module(full), self._fused(full)
        src = self.slice(fused) if fused is not None else None
        if module == "mlp.experts.fc1":
            if src is not None:  # [E, 2f, h]: gate rows, then up rows
                f = src.get_shape()[1] // 2
                parts = [(src[e:e + 1, lo:hi][0], src[e:e + 1, f + lo:f + hi][0]) for e in experts]
            else:
                parts = [tuple(self.slice(name)[lo:hi] for name in expert_names(full, self.layout, e))
                         for e in experts]
            return torch.cat([torch.cat(pair) for pair in parts])  # [expert][gate, up][unit][in]
        if src is not None:  # [E, h, f]
            down = [src[e:e + 1, :, lo:hi][0] for e in experts]
        else:
            down = [self.slice(expert_names(full, self.layout, e)[0])[:, lo:hi] for e in experts]
        return torch.cat(down)  # [expert][out][unit]


@torch.no_grad()
def load_into(chunks: Iterable, path: str | Path, grid: ParallelGrid) -> None:
    """Copy a transformers directory's weights into this rank's model chunks (any layout); each rank reads only its
    own shards. A tied output embedding on the last stage is read like the input one."""
    chunks = list(chunks)
    if not chunks:
        return
    with HFWeights(path, chunks[0].cfg) as src:
        if extra := src.unexpected():
            shown = ", ".join(extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
            raise CheckpointError(f"init_from={path} holds {len(extra)} tensor{'s' * (len(extra) > 1)} its "
                                  f"config.json gives no place to ({shown}): the weights and the config do not "
                                  f"match")
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                shard = src.read_shard(chunk.full_name(name), param, grid)
                if shard.is_floating_point() and not torch.isfinite(shard).all():
                    # Every step would be skipped (an inf/NaN loss) without saying why: refused as it is read
                    bad = (~torch.isfinite(shard)).sum().item()
                    raise CheckpointError(f"init_from={path}: {bad} inf/NaN value{'s' * (bad > 1)} in the "
                                          f"weights of {chunk.full_name(name)} (the part this rank reads); the "
                                          f"checkpoint is damaged: training on it would skip every step")
                param.copy_(shard)
        for full, bias in expert_biases(chunks).items():  # the correction biases: they choose the experts
            bias.copy_(src.read_whole(full, tuple(bias.shape)))
    if grid.rank == 0:  # a fine-tune must not look like a run from scratch
        log.info("init_from: the weights of %s loaded (each rank its shards); the optimizer starts fresh", path)
        if (mtp := unread_mtp_layers(path, chunks[0].cfg)) is not None:
            log.warning("init_from: %s", mtp)


def unread_mtp_layers(path: str | Path, model: ModelConfig) -> str | None:
    """The line that says a directory's multi-token prediction layers are not read, or None when it has none:
    config.json's num_nextn_predict_layers (GLM-4.5, DeepSeek-V3) layers, stored after the num_hidden_layers
    ones, which transformers' classes ignore too: those past what the weights hold (model.mtp.depth, as init_from
    set it), or a family's whose modules mlplat does not read."""
    config = Path(path) / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() else {}
    depth = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0
    if not isinstance(depth, int) or depth <= 0 or model.mtp.depth >= depth:
        return None
    first = model.n_layers
    layers = f"model.layers.{first}.*" if depth == 1 else f"model.layers.{first}..{first + depth - 1}.*"
    if hf.get("model_type") in MTP_LAYOUTS:  # read where held (hf_config.mtp_layers_held): these are not
        return (f"num_nextn_predict_layers={depth} in {config}, but the weights hold {model.mtp.depth} of those "
                f"layers ({layers}): model.mtp.depth={model.mtp.depth}")
    return (f"num_nextn_predict_layers={depth} in {config}: its multi-token prediction layers ({layers}) are not "
            f"read (mlplat reads DeepSeek-V3's and GLM-4.5's, when their weights hold them); the model and its loss "
            f"are the main model's alone")
