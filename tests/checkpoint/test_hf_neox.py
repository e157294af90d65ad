"""Hugging Face interop for a GPT with rotary positions (the main job's `model=tiny_rope`) as GPT-NeoX:
`export --format hf` writes GPTNeoXForCausalLM, `init_from` reads it.

One 4-rank group (tp2·pp2, 1F1B; the Llama tests' worker) imports a float64 GPTNeoXForCausalLM (untied,
layer_norm_eps 1e-6, Llama 3.1 rope scaling), whose logits and greedy text the parent compares with transformers',
and a float32 one (tied, GPT-2's tanh GeLU) that it saves; the parent exports that checkpoint and compares it tensor by
tensor with the original. The main job's own checkpoint (two float64 steps of `model=tiny_rope` through the CLI)
is exported and loaded by transformers, whose logits equal mlplat's from the same checkpoint.

The reference runs `attn_implementation="sdpa"` (the eager attention's softmax is float32); GPT-NeoX's LayerNorms
are torch's own, so nothing of transformers is patched.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mlplat.train import load_checked
from tests.checkpoint.test_hf import (
    VOCAB,
    assert_greedy_text_matches,
    assert_same_tensors,
    build,
    export_hf,
    needs_hf,
    pipeline_logits,
    rel_err,
)
from tests.checkpoint.test_hf_llama import (
    REL,
    SEQ,
    _interop,
    assert_each_rank_reads_only_its_shard,
    assert_whole_shape_refused,
    hf_model,
    import_cfg,
    reference_logits,
    refusal,
    tokens_for_test,
    write_config,
)
from tests.helpers.cli import run_train
from tests.helpers.dist import run_distributed

# tiny_rope's width with 2 layers (one per pipeline stage).
NEOX = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
            max_position_embeddings=SEQ, use_parallel_residual=False, attention_bias=True,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
VARIANTS = {  # float64: what the import must follow; float32: the round trip
    "neox64": dict(tie_word_embeddings=False, layer_norm_eps=1e-6, hidden_act="gelu",
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16, "partial_rotary_factor": 1.0}),
    "neox32": dict(tie_word_embeddings=True, layer_norm_eps=1e-5, hidden_act="gelu_new",
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}),
}
COMPARED_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "vocab_size", "max_position_embeddings", "layer_norm_eps", "hidden_act",
                 "tie_word_embeddings", "rope_parameters", "use_parallel_residual", "attention_bias")


def neox_dir(path: Path, variant: str, dtype: torch.dtype, seed: int, std: float) -> Path:
    """A random GPTNeoXForCausalLM saved with save_pretrained; every parameter perturbed (LayerNorms off 1, biases
    off 0), by `std` (0.2: sharp enough for a varied greedy text)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(**NEOX, **VARIANTS[variant])).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(std * torch.randn_like(p))
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def neox_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_neox")
    return root, {"neox64": neox_dir(root / "neox64", "neox64", torch.float64, seed=1, std=0.2),
                  "neox32": neox_dir(root / "neox32", "neox32", torch.float32, seed=2, std=0.05)}


@pytest.fixture(scope="module")
def interop(neox_dirs):
    root, dirs = neox_dirs
    tokens = tokens_for_test()
    results = run_distributed(_interop, 4, {k: str(v) for k, v in dirs.items()}, str(root / "ckpt"), tokens,
                              ("neox",), 1, timeout=300)
    last = [r for r in results if r["neox_logits"] is not None]
    assert len(last) == 2  # the two tp ranks of the last stage
    return {"root": root, "dirs": dirs, "tokens": tokens, "results": results, "last": last}


# ------------------------------------------------------------------------------------------------ import

@needs_hf
def test_import_matches_transformers_in_one_process_and_under_tp2_pp2(interop):
    from mlplat.parallel.grid import ParallelGrid

    path, tokens = interop["dirs"]["neox64"], interop["tokens"]
    ref = reference_logits(path, tokens)
    assert ref.dtype == torch.float64
    cfg = import_cfg(path)
    m = cfg.model
    assert (m.arch, m.position, m.norm, m.mlp, m.bias, m.qkv_bias, m.tie_embeddings, m.activation) == \
        ("gpt", "rope", "layernorm", "gelu", True, True, False, "gelu")
    assert (m.n_layers, m.hidden, m.n_heads, m.kv_heads, m.ffn_hidden, m.vocab_size, m.seq_len, m.norm_eps) == \
        (2, 128, 4, 4, 512, VOCAB, SEQ, 1e-6)
    assert (m.rope_theta, m.rope_scaling) == (500000.0, {"factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 16})
    grid = ParallelGrid()
    assert rel_err(pipeline_logits(build(cfg, grid, torch.float64), grid, tokens), ref) <= REL
    for r in interop["last"]:
        assert rel_err(r["neox_logits"], ref) <= REL


@needs_hf
def test_greedy_generation_through_the_pipeline_matches_transformers(interop):
    assert_greedy_text_matches(hf_model(interop["dirs"]["neox64"]), interop["results"], "neox_generated")


@needs_hf
def test_each_tensor_parallel_rank_reads_only_its_heads_units_and_columns(neox_dirs, monkeypatch):
    """tp=2: 2 heads' q|k|v rows of query_key_value (and bias), 256 of the 512 MLP units, half the columns of
    dense and dense_4h_to_h, 128 rows of embed_in and embed_out (vocabulary 250 padded to 256)."""
    assert_each_rank_reads_only_its_shard(neox_dirs[1]["neox64"], monkeypatch, {
        "layers.0.attn.qkv.weight", "layers.0.attn.qkv.bias", "layers.0.mlp.fc1.weight", "layers.0.mlp.fc1.bias",
        "layers.0.attn.out.weight", "layers.0.mlp.fc2.weight", "output.weight", "embedding.word.weight"})


@needs_hf
@pytest.mark.parametrize("name, rows, needed", [("gpt_neox.layers.1.attention.query_key_value.weight", 396, 384),
                                                ("gpt_neox.embed_in.weight", 200, VOCAB)])
def test_a_tensor_whose_whole_shape_disagrees_with_config_json_is_refused(neox_dirs, tmp_path, name, rows, needed):
    assert_whole_shape_refused(neox_dirs[1]["neox32"], tmp_path / "bad", name, rows, needed)


# ------------------------------------------------------------------------------------------------ export

@needs_hf
def test_round_trip_hf_mlplat_hf_is_bit_identical_in_float32(interop):
    """Imported under tp2·pp2, saved, exported: the same class and config, every tensor bit-identical (the tied
    output embedding stored by neither)."""
    original = interop["dirs"]["neox32"]
    out = export_hf(interop["root"] / "ckpt" / "neox", interop["root"] / "export")
    after = assert_same_tensors(original, out)
    assert "embed_out.weight" not in after and "gpt_neox.layers.1.attention.query_key_value.bias" in after
    ours, theirs = (json.loads((d / "config.json").read_text()) for d in (out, original))
    assert {k: ours[k] for k in COMPARED_KEYS} == {k: theirs[k] for k in COMPARED_KEYS}
    model = hf_model(out)
    assert type(model).__name__ == "GPTNeoXForCausalLM"
    with torch.no_grad():
        assert torch.equal(model(interop["tokens"]).logits, hf_model(original)(interop["tokens"]).logits)


@needs_hf
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process loads the checkpoint: the intent
def test_the_main_jobs_checkpoint_exports_and_transformers_computes_its_logits(tmp_path, capsys):
    """Two float64 steps of model=tiny_rope through the CLI, exported: transformers loads GPTNeoXForCausalLM (tied,
    whole heads rotated, sequential residual) whose logits equal mlplat's own, the checkpoint loaded as a resume
    loads it, to 1e-12. The same checkpoint said to have grouped-query attention is refused in one line."""
    from mlplat.checkpoint import io
    from mlplat.checkpoint.export import main as export_main
    from mlplat.parallel.grid import ParallelGrid

    run = tmp_path / "run"
    run_train(run, "model=tiny_rope", "parallel=single", "parallel.micro_batch_size=2",
              "parallel.global_batch_size=2", "trainer.max_steps=2", "checkpoint.every_steps=2", "logger=none",
              "sample.max_new_tokens=0", "trainer.precision=64-true")
    ckpt = run / "checkpoints" / "step-2"
    out = export_hf(ckpt, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["use_parallel_residual"], config["tie_word_embeddings"]) == \
        (["GPTNeoXForCausalLM"], False, True)
    assert (config["vocab_size"], config["max_position_embeddings"], config["dtype"]) == (256, 128, "float64")
    ref_model = hf_model(out)
    assert ref_model.config.rope_parameters["partial_rotary_factor"] == 1.0

    model_keys = json.loads((ckpt / "mlplat.json").read_text())["layout"]["model"]
    cfg = load_checked({"model": model_keys, "parallel": dict(tp=1, pp=1, dp=1, micro_batch_size=2,
                                                              global_batch_size=2),
                        "kernels": dict(attention="math"), "trainer": dict(precision="64-true"),
                        "logger": dict(name="none")}, world_size=1, check_data=False)
    assert (cfg.model.position, cfg.model.vocab_size) == ("rope", 256)
    grid = ParallelGrid()
    module = build(cfg, grid, torch.float64)
    io.load(ckpt, module.chunks, None, grid, cfg.model.vocab_size)
    tokens = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = module.chunks[0](tokens)[..., :256]
        theirs = ref_model(tokens).logits
    assert theirs.dtype == torch.float64
    assert rel_err(ours, theirs) <= REL

    manifest = json.loads((ckpt / "mlplat.json").read_text())
    manifest["layout"]["model"]["n_kv_heads"] = 2  # no GPT-NeoX computes grouped-query attention
    (ckpt / "mlplat.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert export_main([str(ckpt), str(tmp_path / "gqa"), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: checkpoint {ckpt}'s model (arch=gpt, position=rope, ") and "\n" not in err
    assert "n_kv_heads=2) has no transformers class: --format hf writes GPT-2 (arch=gpt as GPT-2 has it), " \
           "GPT-NeoX (arch=gpt with rope, layernorm, gelu, bias=true, n_kv_heads=n_heads)" in err


def test_export_writes_gpt_neox_for_a_gpt_with_rotary_positions_only_when_it_computes_alike():
    from mlplat.checkpoint.hf_config import hf_class

    tiny_rope = dict(arch="gpt", n_layers=4, hidden=128, n_heads=4, vocab_size=256, position="rope")
    assert hf_class(tiny_rope) == ("gpt_neox", "GPTNeoXForCausalLM")
    assert hf_class(dict(tiny_rope, tie_embeddings=False, norm_eps=1e-6, activation="gelu_tanh")) == \
        ("gpt_neox", "GPTNeoXForCausalLM")
    for other in (dict(bias=False), dict(qkv_bias=False), dict(norm="rmsnorm"), dict(mlp="swiglu"),
                  dict(n_kv_heads=2)):
        assert hf_class(dict(tiny_rope, **other)) is None, other


# ------------------------------------------------------------------------------------------------ refusals

GPT_NEOX_CONFIG = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 64,
                   "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256,
                   "max_position_embeddings": 64, "layer_norm_eps": 1e-5, "hidden_act": "gelu",
                   "use_parallel_residual": False, "tie_word_embeddings": False,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}


def test_a_gpt_neox_directory_alone_sets_the_model(tmp_path):
    base = dict(parallel=dict(tp=1, pp=1, dp=1), logger={"name": "none"})
    path = write_config(tmp_path / "neox", GPT_NEOX_CONFIG)
    m = load_checked({**base, "init_from": str(path)}, check_data=False).model
    assert (m.arch, m.position, m.n_layers, m.hidden, m.n_heads, m.ffn_hidden, m.vocab_size, m.seq_len) == \
        ("gpt", "rope", 2, 64, 4, 256, 256, 64)
    assert (m.norm, m.norm_eps, m.mlp, m.bias, m.qkv_bias, m.tie_embeddings, m.rope_theta) == \
        ("layernorm", 1e-5, "gelu", True, True, False, 10000.0)
    assert m.head_dim is None and refusal(path, head_dim=32) == (  # its heads are hidden/heads wide
        f"model.head_dim=32 does not match model_type=gpt_neox in init_from={path}/config.json; drop model.head_dim "
        f"(init_from sets it)")
    # An older file (transformers 4): rotary_pct and rotary_emb_base at the top level, no rope_parameters.
    legacy = write_config(tmp_path / "legacy", GPT_NEOX_CONFIG, rope_parameters="absent", rotary_pct=1.0,
                          rotary_emb_base=500000, hidden_act="gelu_new", tie_word_embeddings=True)
    m = load_checked({**base, "init_from": str(legacy), "model": {"seq_len": 32, "position": "rope"}},
                     check_data=False).model  # a free key, and a typed key that agrees
    assert (m.rope_theta, m.activation, m.tie_embeddings, m.seq_len) == (500000.0, "gelu_tanh", True, 32)


def test_what_mlplat_cannot_compute_is_refused_in_one_line(tmp_path):
    def refused(name, **overrides) -> tuple[Path, str]:
        path = write_config(tmp_path / name, GPT_NEOX_CONFIG, **overrides)
        return path, refusal(path)

    path, line = refused("parallel", use_parallel_residual="absent")
    assert line == (f"init_from={path}: use_parallel_residual=true (transformers' default when absent) in config.json "
                    f"is not supported (mlplat's layer feeds the attention's sum to the MLP (sequential residual), "
                    f"not x + attn(ln1(x)) + mlp(ln2(x)); use_parallel_residual=false is)")
    path, line = refused("partial", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                     "partial_rotary_factor": 0.25})
    assert line == (f"init_from={path}: rope_parameters.partial_rotary_factor=0.25 in config.json is not supported "
                    f"(mlplat rotates every channel of a head; rope_parameters.partial_rotary_factor=1 is)")
    path, line = refused("pythia", rope_parameters="absent")  # no rotary_pct either: transformers' 0.25
    assert line.startswith(f"init_from={path}: rotary_pct=0.25 (transformers' default when absent) in config.json")
    path, line = refused("bias", attention_bias=False)
    assert line.startswith(f"init_from={path}: attention_bias=false in config.json is not supported")
    path, line = refused("relu", hidden_act="relu")
    assert line == f"init_from={path}: hidden_act='relu' in config.json is not one of gelu, gelu_new, gelu_pytorch_tanh"
    path, line = refused("yarn", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                  "partial_rotary_factor": 1.0})
    assert "rope_parameters.rope_type='yarn' in config.json is not supported" in line
