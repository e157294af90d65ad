"""Hugging Face interop for the Llama family: `init_from` a transformers LlamaForCausalLM or Qwen2ForCausalLM
directory alone (the model keys come from its config.json), `export --format hf` back.

One 4-rank group (tp2·pp2, interleaved v=2) imports five models: a Llama (4 heads on 2 key/value heads, Llama 3.1
rope scaling, an untied output layer) and a Qwen2 (q/k/v biases, tied embeddings, 4 key/value heads) in float64,
whose logits (and the Llama's greedy text) the parent compares with transformers'; the same two in float32,
saved and exported, compared tensor by tensor with the originals; and a multi-query Llama (one key/value head, so
each of the two tp ranks holds it) in float64, whose logits the parent compares too.

transformers computes two things in float32 whatever the model's dtype, which a float64 comparison must avoid:
`LlamaRMSNorm.forward` (and Qwen2's) casts its input to float32, so the reference's norms are patched here to compute
in the input's dtype, as mlplat's do (otherwise both agree only to float32's ~1e-7); and the eager attention takes
its softmax in float32, so the reference runs `attn_implementation="sdpa"`, which stays in float64. (The rotary
tables are float32 on both sides: mlplat builds them as transformers does.)
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mlplat.errors import ConfigError
from mlplat.train import load_checked, typed_model_keys
from tests.checkpoint.test_hf import (
    PROMPT,
    VOCAB,
    assert_greedy_text_matches,
    assert_same_tensors,
    build,
    export_hf,
    needs_hf,
    pipeline_logits,
    rel_err,
)
from tests.helpers.cli import run_module
from tests.helpers.dist import run_distributed

REL = 1e-12
SEQ = 32  # the directories' max_position_embeddings: model.seq_len follows it
LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=SEQ, rms_norm_eps=1e-6, tie_word_embeddings=False,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
             bos_token_id=1, eos_token_id=2, pad_token_id=None)
MQA = dict(LLAMA, num_key_value_heads=1)  # multi-query: one key/value head, held by both ranks at tp2
QWEN2 = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
             vocab_size=VOCAB, max_position_embeddings=SEQ, rms_norm_eps=1e-6, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
COMPARED_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                 "tie_word_embeddings", "rope_parameters", "hidden_act", "bos_token_id", "eos_token_id")


def word_tokenizer(path: Path) -> None:
    """A word-level tokenizer of VOCAB tokens, <s> = 1 and </s> = 2, saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(path))


def hf_dir(path: Path, family: str, dtype: torch.dtype, seed: int, std: float = 0.05) -> Path:
    """A random tiny LlamaForCausalLM / Qwen2ForCausalLM saved with save_pretrained; every parameter perturbed
    (the norms' gains off 1, the biases off 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config, cls = {"llama": (LlamaConfig(**LLAMA), LlamaForCausalLM), "mqa": (LlamaConfig(**MQA), LlamaForCausalLM),
                   "qwen2": (Qwen2Config(**QWEN2), Qwen2ForCausalLM)}[family]
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(std * torch.randn_like(p))
    model.save_pretrained(str(path))
    return path


def hf_model(path):
    """transformers' own loading of `path`, in its file's dtype, attention by SDPA (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa").eval()


@pytest.fixture
def norms_in_input_dtype(monkeypatch):
    """transformers' RMSNorms computed in their input's dtype (they cast to float32), as mlplat's nn.RMSNorm."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)
    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", forward)


def reference_logits(path, tokens) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(tokens).logits


def tokens_for_test() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(12))


def import_cfg(init_from, tp=1, pp=1, vpp=1, precision="64-true", tokenizer=None, ep=1, cp=1, **model):
    """A config whose model is the directory's (nothing but init_from, unless `model` adds keys)."""
    raw = {"parallel": dict(tp=tp, pp=pp, vpp=vpp, dp=1, cp=cp, ep=ep, schedule="interleaved" if vpp > 1 else "1f1b",
                            micro_batch_size=2, global_batch_size=4),
           "kernels": dict(attention="math"), "trainer": dict(precision=precision), "logger": dict(name="none"),
           "init_from": str(init_from)}
    if model:
        raw["model"] = model
    if tokenizer is not None:
        raw["data"] = {"tokenizer": str(tokenizer)}  # recorded in the manifest: export copies it
    return load_checked(raw, world_size=tp * pp * cp, check_data=False)  # token ids of its own


def _interop(rank, world_size, dirs, ckpt_root, tokens, families=("llama", "qwen2"), vpp=2):
    """tp2·pp2 (v = vpp): each family's float64 directory imported (its logits, its greedy text), its float32 one
    imported and saved under ckpt_root/FAMILY; the multi-query directory, when given, imported with its key/value
    head on both tp ranks (its logits). (tests/checkpoint/test_hf_neox.py runs it too.)"""
    from mlplat.checkpoint import io
    from mlplat.lightning.strategy import checkpoint_layout
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.step.decode import generate

    grid = ParallelGrid(2, 2, 1)
    out = {}
    for family in families:
        imported = build(import_cfg(dirs[f"{family}64"], 2, 2, vpp), grid, torch.float64)
        out[f"{family}_logits"] = pipeline_logits(imported, grid, tokens)
        out[f"{family}_generated"] = generate(imported, PROMPT, 20)
        f32 = dirs[f"{family}32"]
        tokenizer = f32 if family == "llama" else None  # the others run with byte-level ids: no bos/eos ids
        roundtrip = build(import_cfg(f32, 2, 2, vpp, precision="32-true", tokenizer=tokenizer), grid, torch.float32)
        io.save(f"{ckpt_root}/{family}", roundtrip.chunks, None, grid, {"global_step": 0},
                checkpoint_layout(roundtrip.cfg, 1))
    if "mqa64" in dirs:
        shared = ParallelGrid(2, 2, 1, kv_replicas=2)
        out["mqa_logits"] = pipeline_logits(build(import_cfg(dirs["mqa64"], 2, 2, vpp), shared, torch.float64),
                                            shared, tokens)
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_llama")
    dirs = {"llama64": hf_dir(root / "llama64", "llama", torch.float64, seed=1, std=0.2),
            "llama32": hf_dir(root / "llama32", "llama", torch.float32, seed=2),
            "qwen264": hf_dir(root / "qwen264", "qwen2", torch.float64, seed=3, std=0.2),
            "qwen232": hf_dir(root / "qwen232", "qwen2", torch.float32, seed=4),
            "mqa64": hf_dir(root / "mqa64", "mqa", torch.float64, seed=5, std=0.2)}
    word_tokenizer(dirs["llama32"])
    return root, dirs


@pytest.fixture(scope="module")
def interop(hf_dirs):
    root, dirs = hf_dirs
    tokens = tokens_for_test()
    results = run_distributed(_interop, 4, {k: str(v) for k, v in dirs.items()}, str(root / "ckpt"), tokens,
                              timeout=300)
    last = [r for r in results if r["llama_logits"] is not None]
    assert len(last) == 2  # the two tp ranks of the last stage
    return {"root": root, "dirs": dirs, "tokens": tokens, "results": results, "last": last}


# ------------------------------------------------------------------------------------------------ import

@needs_hf
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_import_matches_transformers_in_one_process_and_under_tp2_pp2_interleaved(interop, family,
                                                                                  norms_in_input_dtype):
    from mlplat.parallel.grid import ParallelGrid

    path, tokens = interop["dirs"][f"{family}64"], interop["tokens"]
    ref = reference_logits(path, tokens)
    assert ref.dtype == torch.float64
    cfg = import_cfg(path)
    m = cfg.model
    assert (m.arch, m.n_layers, m.hidden, m.n_heads, m.kv_heads, m.ffn_hidden, m.vocab_size, m.seq_len) == \
        ("llama", 4, 64, 4, 2 if family == "llama" else 4, 96, VOCAB, SEQ)
    assert (m.tie_embeddings, m.qkv_bias, m.norm_eps) == (family == "qwen2", family == "qwen2", 1e-6)
    assert m.rope_scaling == (None if family == "qwen2" else {k: v for k, v in LLAMA["rope_parameters"].items()
                                                               if k not in ("rope_type", "rope_theta")})
    grid = ParallelGrid()
    ours = pipeline_logits(build(cfg, grid, torch.float64), grid, tokens)
    assert rel_err(ours, ref) <= REL
    for r in interop["last"]:
        assert rel_err(r[f"{family}_logits"], ref) <= REL


@needs_hf
def test_import_with_the_key_value_head_on_both_tp_ranks_matches_transformers(interop, monkeypatch,
                                                                              norms_in_input_dtype):
    """A multi-query Llama (one key/value head) under tp2·pp2: both tp ranks hold the head, read from k_proj and
    v_proj whole, and each its two query heads; the logits equal transformers' in float64. Each rank reads only
    that (k_proj and v_proj by both, the rest once)."""
    path, tokens = interop["dirs"]["mqa64"], interop["tokens"]
    ref = reference_logits(path, tokens)
    assert import_cfg(path).model.kv_heads == 1
    for r in interop["last"]:
        assert rel_err(r["mqa_logits"], ref) <= REL
    assert_each_rank_reads_only_its_shard(path, monkeypatch, {"layers.0.attn.qkv.weight", "output.weight"})


@needs_hf
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_generation_through_the_pipeline_matches_transformers(interop, family, norms_in_input_dtype):
    assert_greedy_text_matches(hf_model(interop["dirs"][f"{family}64"]), interop["results"], f"{family}_generated")


@needs_hf
def test_each_tensor_parallel_rank_reads_only_its_groups_units_and_columns(hf_dirs, monkeypatch):
    """tp=2 (one key/value group of 2 query heads per rank; 48 of the 96 MLP units; vocabulary 250 padded to 256)."""
    assert_each_rank_reads_only_its_shard(hf_dirs[1]["llama64"], monkeypatch, {
        "layers.0.attn.qkv.weight", "layers.0.mlp.fc1.weight", "layers.0.attn.out.weight", "layers.0.mlp.fc2.weight",
        "output.weight", "embedding.word.weight"})


def assert_each_rank_reads_only_its_shard(path: Path, monkeypatch, split: set[str], ep: int = 1) -> None:
    """Imported at tp=2 (with `ep`: the experts whole, split over ep = 2 ranks): every read is at most the rank's
    shard, the two ranks together read each split tensor exactly once (`split` among them; a key/value head both
    ranks hold, once by each), and each shard is the slice of the one-process import."""
    from mlplat.checkpoint import hf
    from mlplat.model.decoder import DecoderChunk
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.parallel.tensor import partition_dim_of, shard_of, shared_ranges

    reads: list[int] = []
    real_slice = hf.HFWeights.slice

    class Counted:
        def __init__(self, sl):
            self.sl = sl

        def get_shape(self):
            return self.sl.get_shape()

        def __getitem__(self, index):
            t = self.sl[index]
            reads.append(t.numel())
            return t

    monkeypatch.setattr(hf.HFWeights, "slice", lambda self, name: Counted(real_slice(self, name)))
    cfg = import_cfg(path)
    whole = build(cfg, ParallelGrid(), torch.float64).chunks[0]
    full = dict(whole.named_parameters())
    split_read: dict[str, int] = {}
    twice: dict[str, int] = {}  # elements both ranks read (a shared key/value head)
    for rank in range(2):
        grid = ParallelGrid(2, 1, 1, rank=rank, virtual=True, ep=ep)
        chunk = DecoderChunk(cfg.model, grid, 0, 1, device="meta", dtype=torch.float64)  # shapes only
        with hf.HFWeights(path, cfg.model) as src:
            for name, p in chunk.named_parameters():
                reads.clear()
                shard = src.read_shard(name, p, grid)
                assert sum(reads) <= p.numel(), name
                if partition_dim_of(p) is not None:
                    split_read[name] = split_read.get(name, 0) + sum(reads)
                    twice.setdefault(name, sum(b - a for a, b in shared_ranges(p, grid)))
                assert torch.equal(shard, shard_of(full[name].detach(), p, grid)), (name, rank)
    assert split <= set(split_read)
    for name, n in split_read.items():
        real = full[name][:VOCAB] if name in ("embedding.word.weight", "output.weight") else full[name]
        assert n == real.numel() + twice[name], name


# ------------------------------------------------------------------------------------------------ export

@needs_hf
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_round_trip_hf_mlplat_hf_is_bit_identical_in_float32(interop, family, monkeypatch):
    """Imported under tp2·pp2, saved, exported: the same class, the same config, every tensor bit-identical (the
    Qwen2's biases; its tied output embedding, which neither directory stores); the tokenizer's bos/eos ids. Each
    checkpoint tensor is read once, QKV's three parts and fc1's two from one read."""
    from transformers import AutoTokenizer

    from mlplat.checkpoint import hf_export

    loads: list[str] = []
    real_load = hf_export.dcp.load
    monkeypatch.setattr(hf_export.dcp, "load", lambda sd, **kw: (loads.extend(sd), real_load(sd, **kw))[1])
    original = interop["dirs"][f"{family}32"]
    out = export_hf(interop["root"] / "ckpt" / family, interop["root"] / f"export_{family}")
    per_layer = 6 if family == "llama" else 7  # ln1, qkv (and its bias), out, ln2, fc1, fc2
    assert len(loads) == len(set(loads)) == 4 * per_layer + (3 if family == "llama" else 2)
    after = assert_same_tensors(original, out)
    assert ("lm_head.weight" in after) == (family == "llama")
    assert ("model.layers.0.self_attn.q_proj.bias" in after) == (family == "qwen2")
    theirs, ours = (json.loads((d / "config.json").read_text()) for d in (original, out))
    assert {k: ours.get(k) for k in COMPARED_KEYS} == {k: theirs.get(k) for k in COMPARED_KEYS}
    assert ours["dtype"] == "float32"
    tokens = interop["tokens"]
    with torch.no_grad():
        assert torch.equal(hf_model(out)(tokens).logits, hf_model(original)(tokens).logits)
    assert type(hf_model(out)).__name__ == ("LlamaForCausalLM" if family == "llama" else "Qwen2ForCausalLM")
    if family == "llama":  # its run's tokenizer: copied, and config.json's bos/eos ids (compared above) from it
        assert AutoTokenizer.from_pretrained(str(out))("<s> w7 </s>")["input_ids"] == [1, 7, 2]
        assert (ours["bos_token_id"], ours["eos_token_id"]) == (1, 2)
    else:
        assert not (out / "tokenizer.json").exists() and ours["bos_token_id"] is ours["eos_token_id"] is None


# ------------------------------------------------------------------------------------------------ refusals

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "hidden_act": "silu",
                "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "head_dim": 16,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


# 3 key/value heads: at tp2 neither a multiple of the ranks nor a divisor of them (12 heads of 8, hidden 96)
ODD_KV_HEADS = dict(hidden_size=96, intermediate_size=96, num_attention_heads=12, num_key_value_heads=3, head_dim=8)


def write_config(path: Path, base: dict = LLAMA_CONFIG, **overrides) -> Path:
    """A config.json (`base`, by default a Llama's as transformers 5 writes one; an override "absent" drops its key)
    and an empty weights file: enough for the checks."""
    path.mkdir(parents=True, exist_ok=True)
    config = {**base, **overrides}
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v != "absent"}))
    (path / "model.safetensors").touch()
    return path


def refusal(path, parallel=None, **model) -> str:
    raw = {"init_from": str(path), "parallel": parallel or dict(tp=1, pp=1, dp=1), "logger": {"name": "none"}}
    if model:
        raw["model"] = model
    with pytest.raises(ConfigError) as refused:
        load_checked(raw, check_data=False)
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_a_llama_family_directory_alone_sets_the_model(tmp_path):
    base = dict(parallel=dict(tp=1, pp=1, dp=1), logger={"name": "none"})
    m = load_checked({**base, "init_from": str(write_config(tmp_path / "llama"))}, check_data=False).model
    assert (m.arch, m.n_layers, m.hidden, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.vocab_size) == \
        ("llama", 4, 64, 4, 2, 96, 256)
    assert (m.position, m.norm, m.mlp, m.bias, m.qkv_bias, m.tie_embeddings, m.norm_eps, m.rope_scaling) == \
        ("rope", "rmsnorm", "swiglu", False, False, False, 1e-5, None)
    assert m.seq_len == 64  # the default 128 cut to max_position_embeddings
    # Older files: rope_theta at the top level, rope_scaling beside it; a Mistral without a sliding window.
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    legacy = write_config(tmp_path / "legacy", rope_parameters="absent", rope_theta=500000.0, model_type="mistral",
                          architectures=["MistralForCausalLM"], sliding_window=None,
                          rope_scaling={"rope_type": "llama3", **scaling})
    m = load_checked({**base, "init_from": str(legacy), "model": {"seq_len": 32, "dropout": 0.1, "n_heads": 4}},
                     check_data=False).model  # free keys, and a typed key that agrees
    assert (m.rope_theta, m.rope_scaling, m.seq_len, m.dropout) == (500000.0, scaling, 32, 0.1)
    qwen = write_config(tmp_path / "qwen", model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                        attention_bias="absent", mlp_bias="absent", use_sliding_window=False, sliding_window=None,
                        tie_word_embeddings=True, layer_types=["full_attention"] * 4)
    m = load_checked({**base, "init_from": str(qwen)}, check_data=False).model
    assert (m.qkv_bias, m.bias, m.tie_embeddings) == (True, False, True)


def test_the_directory_is_read_by_load_checked_not_by_load_config(tmp_path):
    """`mlplat.config.load_config` is pure (it reads no file: the model keys stay the config's own); `load_checked`,
    the one way in that reads files, sets the directory's model keys before validation, and a rule they break names
    where the value came from."""
    from mlplat.config import ModelConfig, load_config

    good = write_config(tmp_path / "good")
    raw = {"init_from": str(good), "model": {"vocab_size": 256}, "parallel": dict(tp=1, pp=1, dp=1)}
    assert load_config(raw, check_data=False).model.hidden == ModelConfig().hidden
    cfg = load_checked(raw, check_data=False)
    assert (cfg.model.arch, cfg.model.hidden, cfg.model.n_kv_heads, cfg.model.seq_len) == ("llama", 64, 2, 64)
    odd = write_config(tmp_path / "odd", **ODD_KV_HEADS)
    with pytest.raises(ConfigError, match=r"model.n_kv_heads is num_key_value_heads=3 in init_from="):
        load_checked({**raw, "init_from": str(odd), "parallel": dict(tp=2, pp=1, dp=1)}, check_data=False)


def test_export_writes_only_what_transformers_computes_alike():
    from mlplat.checkpoint.hf_config import hf_class

    llama = dict(arch="llama", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=96)
    assert hf_class(llama) == ("llama", "LlamaForCausalLM")
    assert hf_class(dict(llama, qkv_bias=True, tie_embeddings=True)) == ("qwen2", "Qwen2ForCausalLM")
    assert hf_class(dict(arch="gpt", n_layers=4, hidden=32, n_heads=4, vocab_size=256)) == ("gpt2", "GPT2LMHeadModel")
    assert hf_class(dict(llama, bias=True)) is None  # biases on every linear layer: no transformers class has them
    assert hf_class(dict(llama, norm="layernorm")) is None
    assert hf_class(dict(arch="gpt", n_layers=4, hidden=32, n_heads=4, vocab_size=256, position="rope",
                         n_kv_heads=2)) is None  # GPT-NeoX has no grouped-query attention


def test_the_refusals_are_one_line_before_any_process_starts(tmp_path):
    good = write_config(tmp_path / "good")
    cfg = f"in init_from={good}/config.json"
    assert refusal(good, hidden=128) == (f"model.hidden=128 does not match hidden_size=64 {cfg}; drop model.hidden "
                                         f"(init_from sets it)")
    assert refusal(good, n_kv_heads=4) == (f"model.n_kv_heads=4 does not match num_key_value_heads=2 {cfg}; drop "
                                           f"model.n_kv_heads (init_from sets it)")
    assert refusal(good, arch="gpt").startswith("model.arch=gpt does not match model_type=llama")
    assert refusal(good, seq_len=128) == f"model.seq_len=128 exceeds max_position_embeddings=64 {cfg}; set " \
                                         f"model.seq_len <= 64"
    # A layout rule broken by an imported key says where its value came from.
    odd = write_config(tmp_path / "odd", **ODD_KV_HEADS)
    assert refusal(odd, parallel=dict(tp=2, pp=1, dp=1)) == (
        f"model.n_kv_heads=3 and parallel.tp=2 do not divide one another: each tensor-parallel rank holds whole "
        f"key/value heads, or one head shared by tp/n_kv_heads ranks (model.n_kv_heads is num_key_value_heads=3 "
        f"in init_from={odd}/config.json)")
    supported = ("supported: gpt2 (GPT2LMHeadModel), gpt_neox (GPTNeoXForCausalLM), llama (LlamaForCausalLM), "
                 "mistral (MistralForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM), mixtral "
                 "(MixtralForCausalLM), qwen2_moe (Qwen2MoeForCausalLM), qwen3_moe (Qwen3MoeForCausalLM), glm4_moe "
                 "(Glm4MoeForCausalLM), deepseek_v2 (DeepseekV2ForCausalLM), deepseek_v3 (DeepseekV3ForCausalLM)")
    gemma = write_config(tmp_path / "gemma", model_type="gemma", architectures=["GemmaForCausalLM"])
    assert refusal(gemma) == (f"init_from={gemma} holds model_type='gemma' (GemmaForCausalLM), which mlplat "
                              f"cannot load; {supported}")
    head = write_config(tmp_path / "head", architectures=["LlamaForSequenceClassification"])
    assert refusal(head) == (f"init_from={head} holds LlamaForSequenceClassification (architectures in config.json), "
                             f"which mlplat cannot load; {supported}")
    mistral = write_config(tmp_path / "mistral", model_type="mistral", architectures=["MistralForCausalLM"],
                           sliding_window=4096)
    assert refusal(mistral) == (f"init_from={mistral}: sliding_window=4096 in config.json is not supported (mlplat's "
                                f"attention is full causal attention; sliding_window=null is)")
    qwen = write_config(tmp_path / "qwen", model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                        use_sliding_window=True, sliding_window=4096)
    assert refusal(qwen).startswith(f"init_from={qwen}: use_sliding_window=true in config.json is not supported")
    yarn = write_config(tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    assert refusal(yarn) == (f"init_from={yarn}: rope_parameters.rope_type='yarn' in config.json is not supported "
                             f"(mlplat's rotary embedding has the default frequencies and Llama 3.1's scaling, "
                             f"rope_type llama3)")
    linear = write_config(tmp_path / "linear", rope_parameters="absent", rope_scaling={"type": "linear", "factor": 2})
    assert "rope_scaling.rope_type='linear' in config.json is not supported" in refusal(linear)
    bias = write_config(tmp_path / "bias", attention_bias=True)
    assert refusal(bias).startswith(f"init_from={bias}: attention_bias=true in config.json is not supported")
    act = write_config(tmp_path / "act", hidden_act="gelu")
    assert refusal(act) == (f"init_from={act}: hidden_act=gelu in config.json is not supported (mlplat's SwiGLU "
                            f"gates with SiLU; hidden_act=silu is)")


@needs_hf
def test_a_head_dim_apart_from_hidden_over_heads_is_imported(tmp_path, norms_in_input_dtype, monkeypatch):
    """config.json's head_dim, where it is not hidden_size/num_attention_heads, is model.head_dim (Llama, Mistral,
    Qwen2 read it): a random float64 Mistral with heads of 24 at hidden 64 computes transformers' logits within
    1e-12 in one process; a head_dim of null or of hidden/heads is model.head_dim null."""
    from transformers import MistralConfig, MistralForCausalLM
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral

    from mlplat.parallel.grid import ParallelGrid

    monkeypatch.setattr(modeling_mistral.MistralRMSNorm, "forward", modeling_llama.LlamaRMSNorm.forward)
    torch.manual_seed(5)
    keys = dict(LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, head_dim=24, sliding_window=None)
    model = MistralForCausalLM(MistralConfig(**keys)).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path / "mistral"))
    cfg = import_cfg(tmp_path / "mistral")
    assert (cfg.model.head_dim, cfg.model.attention_width) == (24, 96)
    grid, tokens = ParallelGrid(), tokens_for_test()
    ours = pipeline_logits(build(cfg, grid, torch.float64), grid, tokens)
    assert rel_err(ours, reference_logits(tmp_path / "mistral", tokens)) <= REL
    for name, keys in (("llama", {}), ("qwen2", dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]))):
        wide = write_config(tmp_path / name, head_dim=32, **keys)
        assert load_checked(dict(init_from=str(wide), logger=dict(name="none")), check_data=False).model.head_dim == 32
    for head_dim in (None, 16, "absent"):
        plain = write_config(tmp_path / f"plain{head_dim}", head_dim=head_dim)
        assert load_checked(dict(init_from=str(plain), logger=dict(name="none")), check_data=False).model.head_dim \
            is None


def test_typed_keys_come_from_the_command_line_overrides(tmp_path):
    """On the command line only the model.* keys typed there are checked against the directory (the composed
    defaults, e.g. model=tiny's hidden=128, give way to it); in one line, exit 2, before any process starts."""
    assert typed_model_keys(["model.hidden=64", "+model.n_kv_heads=2", "++model.rope_scaling.factor=8",
                             "model=llama_tiny", "~model.bias", "parallel.tp=2", "init_from=x"]) == \
        {"hidden", "n_kv_heads", "rope_scaling"}
    good = write_config(tmp_path / "good")
    proc = run_module([f"init_from={good}", "model.hidden=128", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: model.hidden=128 does not match hidden_size=64 in init_from={good}/config.json; drop model.hidden "
        f"(init_from sets it)")


def test_a_composed_config_checks_its_overrides_only(tmp_path):
    from hydra import compose, initialize_config_dir

    from tests.helpers.paths import REPO

    good = write_config(tmp_path / "good")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = load_checked(compose(config_name="config", overrides=[f"init_from={good}", "model.seq_len=32"],
                                   return_hydra_config=True))
        assert (cfg.model.arch, cfg.model.hidden, cfg.model.seq_len, cfg.model.vocab_size) == ("llama", 64, 32, 256)
        with pytest.raises(ConfigError, match=r"^model.n_layers=8 does not match num_hidden_layers=4 in "):
            load_checked(compose(config_name="config", overrides=[f"init_from={good}", "model.n_layers=8"],
                                 return_hydra_config=True))


@needs_hf
@pytest.mark.parametrize("name, rows", [("model.layers.0.self_attn.k_proj.weight", 48),
                                        ("model.embed_tokens.weight", 200)])
def test_a_tensor_whose_whole_shape_disagrees_with_config_json_is_refused(hf_dirs, tmp_path, name, rows):
    """A K projection with more rows than config.json's heads give it (a rank reads only its rows: the extra ones
    would be dropped) and a vocabulary table shorter than vocab_size (it would be zero-padded)."""
    assert_whole_shape_refused(hf_dirs[1]["llama32"], tmp_path / "bad", name, rows,
                               LLAMA["hidden_size"] // 2 if "k_proj" in name else VOCAB)


def assert_whole_shape_refused(original: Path, path: Path, name: str, rows: int, needed: int) -> None:
    """`original` copied to `path` with tensor `name` given `rows` rows (the model needs `needed`) is refused in one
    line naming the tensor and both shapes, at any tp."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mlplat.checkpoint import CheckpointError, hf
    from mlplat.model.decoder import DecoderChunk
    from mlplat.parallel.grid import ParallelGrid

    shutil.copytree(original, path)
    tensors = load_file(str(path / "model.safetensors"))
    cols = tensors[name].shape[1]
    tensors[name] = torch.zeros(rows, cols)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = import_cfg(path, precision="32-true")
    for tp in (1, 2):
        grid = ParallelGrid(tp, 1, 1, rank=0, virtual=True)
        chunk = DecoderChunk(cfg.model, grid, 0, 1, device="meta", dtype=torch.float32)
        with pytest.raises(CheckpointError) as err, hf.HFWeights(path, cfg.model) as src:
            for full, p in chunk.named_parameters():
                src.read_shard(full, p, grid)
        assert str(err.value) == f"init_from={path}: {name} is [{rows}, {cols}] where the model (its config.json) " \
                                 f"needs [{needed}, {cols}]"
