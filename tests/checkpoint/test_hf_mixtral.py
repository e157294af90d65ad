"""Hugging Face interop for a mixture of experts: `init_from` a transformers MixtralForCausalLM directory alone (the
model keys, `model.moe.*` among them, come from its config.json), `export --format hf` back as one.

One 4-rank group (tp2·pp2, interleaved v=2, with expert parallelism folded onto the tp ranks: each holds two of
the four experts whole, `parallel.ep=2`) imports a random
float64 Mixtral (4 heads on 2 key/value heads, 4 experts, 2 per token, untied output layer): its logits and greedy
text, which the parent compares with transformers', and a checkpoint, which the parent exports and compares tensor by
tensor with the original directory.

transformers computes three things in float32 whatever the model's dtype, which a float64 comparison must avoid:
its RMSNorms and its router's softmax (`MixtralTopKRouter` casts the logits to float32; mlplat's router runs in
float32 or wider, here float64) are patched here to compute in their input's dtype, and the eager attention takes
its softmax in float32, so the reference runs `attn_implementation="sdpa"`. Its default experts, a grouped GEMM,
do not run in float64 on a CPU: the reference runs `experts_implementation="eager"` (one matmul per expert).
"""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from mlplat.errors import ConfigError
from mlplat.train import load_checked, typed_model_keys
from tests.checkpoint.test_hf import (
    PROMPT,
    VOCAB,
    assert_greedy_text_matches,
    build,
    export_hf,
    needs_hf,
    pipeline_logits,
    rel_err,
)
from tests.checkpoint.test_hf_llama import (
    LLAMA_CONFIG,
    REL,
    SEQ,
    assert_each_rank_reads_only_its_shard,
    import_cfg,
    refusal,
    tokens_for_test,
    write_config,
)
from tests.helpers.dist import run_distributed

MIXTRAL = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
               rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 1000000.0},
               bos_token_id=1, eos_token_id=2, pad_token_id=None)
COMPARED_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "num_local_experts", "num_experts_per_tok",
                 "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
                 "hidden_act", "sliding_window", "router_jitter_noise")


def save_random(model_class: str, config_class: str, keys: dict, path: Path, seed: int, std: float = 0.2) -> Path:
    """A random tiny float64 transformers model saved with save_pretrained (the Hub's per-expert names); every
    parameter perturbed (the norms' gains off 1), the router sharply so that tokens choose different experts."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**keys)).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((1.0 if name.endswith("mlp.gate.weight") else std) * torch.randn_like(p))
    model.save_pretrained(str(path))
    return path


def mixtral_dir(path: Path, seed: int, std: float = 0.2) -> Path:
    return save_random("MixtralForCausalLM", "MixtralConfig", MIXTRAL, path, seed, std)


@functools.lru_cache(maxsize=None)
def hf_model(path):
    """transformers' own loading of `path`, attention by SDPA, experts one matmul each (the module docstring); once
    per path (the float32 patches act on the classes, not on a model)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa",
                                                experts_implementation="eager").eval()


def reference_logits(path, tokens) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(tokens).logits


def norm_in_input_dtype(self, x):
    """An RMSNorm's forward computed in its input's dtype (transformers' casts to float32), as mlplat's."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def router_in_input_dtype(self, hidden_states):
    """A top-k softmax router's forward in its input's dtype, the k chosen renormalised unless the router says not
    (Mixtral always; the Qwen MoEs by norm_topk_prob)."""
    import torch.nn.functional as F

    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, chosen = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
    return logits, top / top.sum(-1, keepdim=True) if getattr(self, "norm_topk_prob", True) else top, chosen


@pytest.fixture
def float32_free(monkeypatch):
    """transformers' RMSNorms and router softmax in their input's dtype (they cast to float32), as mlplat's."""
    from transformers.models.mixtral import modeling_mixtral

    monkeypatch.setattr(modeling_mixtral.MixtralRMSNorm, "forward", norm_in_input_dtype)
    monkeypatch.setattr(modeling_mixtral.MixtralTopKRouter, "forward", router_in_input_dtype)


def _interop(rank, world_size, path, ckpt, tokens):
    """tp2·pp2 (v=2), ep2: the float64 directory imported: its logits, its greedy text, and a checkpoint of it."""
    from mlplat.checkpoint import io
    from mlplat.lightning.strategy import checkpoint_layout
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.step.decode import generate

    grid = ParallelGrid(2, 2, 1, ep=2)
    imported = build(import_cfg(path, 2, 2, 2, ep=2), grid, torch.float64)
    out = {"logits": pipeline_logits(imported, grid, tokens), "generated": generate(imported, PROMPT, 20)}
    io.save(ckpt, imported.chunks, None, grid, {"global_step": 0}, checkpoint_layout(imported.cfg, 1))
    return out


@pytest.fixture(scope="module")
def interop(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_mixtral")
    path = mixtral_dir(root / "mixtral64", seed=1)
    tokens = tokens_for_test()
    results = run_distributed(_interop, 4, str(path), str(root / "ckpt"), tokens, timeout=300)
    last = [r for r in results if r["logits"] is not None]
    assert len(last) == 2  # the two tp ranks of the last stage
    return {"root": root, "path": path, "tokens": tokens, "results": results, "last": last}


# ------------------------------------------------------------------------------------------------ import

@needs_hf
def test_import_matches_transformers_in_one_process_and_under_tp2_pp2_interleaved(interop, float32_free):
    from mlplat.parallel.grid import ParallelGrid

    path, tokens = interop["path"], interop["tokens"]
    ref = reference_logits(path, tokens)
    assert ref.dtype == torch.float64
    cfg = import_cfg(path)
    m = cfg.model
    assert (m.arch, m.n_layers, m.hidden, m.n_heads, m.kv_heads, m.vocab_size, m.seq_len, m.tie_embeddings) == \
        ("llama", 4, 64, 4, 2, VOCAB, SEQ, False)
    moe = m.moe
    assert (moe.num_experts, moe.top_k, m.expert_ffn, moe.router, moe.norm_topk_prob, moe.shared_experts,
            moe.dense_layers, moe.capacity_factor) == (4, 2, 32, "softmax", True, 0, 0, None)
    grid = ParallelGrid()
    ours = pipeline_logits(build(cfg, grid, torch.float64), grid, tokens)
    assert rel_err(ours, ref) <= REL
    for r in interop["last"]:
        assert rel_err(r["logits"], ref) <= REL


@needs_hf
def test_unpatched_transformers_differs_only_by_its_float32_router_and_norms(interop):
    """The reference's patches change only float32 rounding: transformers as it is agrees to float32's precision."""
    ref = reference_logits(interop["path"], interop["tokens"])
    assert 0 < rel_err(interop["last"][0]["logits"], ref) <= 1e-5


@needs_hf
def test_greedy_generation_through_the_pipeline_matches_transformers(interop, float32_free):
    assert_greedy_text_matches(hf_model(interop["path"]), interop["results"])


def fused_imports_alike(path: Path, tmp_path: Path, layer: int) -> dict:
    """Directory `path` saved again in transformers 5's fused names (what its state_dict holds) imports to the
    same parameters as the Hub's per-expert names, bit for bit; the parameters, by name."""
    from safetensors.torch import save_file

    from mlplat.parallel.grid import ParallelGrid

    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(path / "config.json", fused / "config.json")
    state = {k: v.contiguous() for k, v in hf_model(path).state_dict().items()}
    assert f"model.layers.{layer}.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    grid = ParallelGrid()
    hub_params = dict(build(import_cfg(path), grid, torch.float64).chunks[0].named_parameters())
    fused_params = dict(build(import_cfg(fused), grid, torch.float64).chunks[0].named_parameters())
    assert sorted(hub_params) == sorted(fused_params)
    assert f"layers.{layer}.mlp.experts.fc1.weight" in hub_params
    for name, p in hub_params.items():
        assert torch.equal(p, fused_params[name]), name
    return hub_params


@needs_hf
def test_transformers_fused_expert_layout_is_read_alike(interop, tmp_path):
    """A directory in transformers 5's fused names (mlp.gate, mlp.experts.gate_up_proj [E, 2f, h],
    mlp.experts.down_proj [E, h, f]) imports to the same parameters as the Hub's per-expert one, bit for bit."""
    fused_imports_alike(interop["path"], tmp_path, layer=0)


@needs_hf
def test_each_tensor_parallel_rank_reads_only_its_units_of_every_expert(interop, monkeypatch):
    """tp=2: each rank reads 16 of each expert's 32 units of w1, w3 and w2, or, under ep2, two experts whole; the
    router whole."""
    assert_each_rank_reads_only_its_shard(interop["path"], monkeypatch, {
        "layers.0.mlp.experts.fc1.weight", "layers.0.mlp.experts.fc2.weight", "layers.0.attn.qkv.weight"})
    # ep2: each rank reads two of the four experts whole
    assert_each_rank_reads_only_its_shard(interop["path"], monkeypatch, {
        "layers.0.mlp.experts.fc1.weight", "layers.0.mlp.experts.fc2.weight"}, ep=2)


# ------------------------------------------------------------------------------------------------ export

@needs_hf
def test_round_trip_hf_mlplat_hf_is_bit_identical(interop, float32_free):
    """Imported under tp2·pp2, saved, exported: MixtralForCausalLM with the same config and every tensor bit-identical
    in the Hub's per-expert names; transformers' logits from it are its logits from the original, and mlplat's."""
    path, tokens = interop["path"], interop["tokens"]
    out = export_hf(interop["root"] / "ckpt", interop["root"] / "export")
    from safetensors.torch import load_file

    before, after = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(before) == sorted(after)
    assert "model.layers.3.block_sparse_moe.experts.3.w2.weight" in after
    for name in before:
        assert before[name].dtype == after[name].dtype == torch.float64, name
        assert torch.equal(before[name], after[name]), name
    theirs, ours = (json.loads((d / "config.json").read_text()) for d in (path, out))
    assert {k: ours.get(k) for k in COMPARED_KEYS} == {k: theirs.get(k) for k in COMPARED_KEYS}
    exported = hf_model(out)
    assert type(exported).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        logits = exported(tokens).logits
    assert torch.equal(logits, reference_logits(path, tokens))
    assert rel_err(interop["last"][0]["logits"], logits) <= REL


# ------------------------------------------------------------------------------------------------ refusals

MIXTRAL_CONFIG = {**{k: v for k, v in LLAMA_CONFIG.items() if k not in ("attention_bias", "mlp_bias")},
                  "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "intermediate_size": 32,
                  "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
                  "router_jitter_noise": 0.0, "router_aux_loss_coef": 0.001, "output_router_logits": False}


def test_a_mixtral_directory_alone_sets_the_mixture_of_experts(tmp_path):
    """Every model.moe.* key from config.json (the composed model=moe_tiny gives way: no shared experts, no dense
    layer); the balancing losses' weights stay the config's (the directory's function does not depend on them)."""
    from hydra import compose, initialize_config_dir

    from tests.helpers.paths import REPO

    good = write_config(tmp_path / "good", MIXTRAL_CONFIG)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = load_checked(compose(config_name="config", overrides=[
            f"init_from={good}", "model=moe_tiny", "model.moe.aux_loss_coeff=0.02", "model.moe.top_k=2"],
            return_hydra_config=True), check_data=False)
    m = cfg.model
    assert (m.hidden, m.ffn_hidden, m.expert_ffn, m.n_kv_heads) == (64, 32, 32, 2)
    assert (m.moe.num_experts, m.moe.top_k, m.moe.router, m.moe.norm_topk_prob, m.moe.shared_experts,
            m.moe.shared_gate, m.moe.dense_layers, m.moe.capacity_factor, m.moe.bias_update_rate) == \
        (4, 2, "softmax", True, 0, False, 0, None, 0.0)
    assert (m.moe.aux_loss_coeff, m.moe.z_loss_coeff) == (0.02, 0.001)  # typed; moe_tiny's
    assert typed_model_keys(["+model.moe.aux_loss_coeff=0.1", "model.moe.top_k=2", "model=moe_tiny"]) == \
        {"moe", "moe.aux_loss_coeff", "moe.top_k"}  # model.moe.* keys typed are checked one by one
    dense = load_checked({"init_from": str(write_config(tmp_path / "llama")), "logger": {"name": "none"},
                          "parallel": dict(tp=1, pp=1, dp=1)}, check_data=False).model
    assert dense.moe.num_experts == 0
    # A key config.json does not name (Mixtral has no expert bias) typed otherwise: one line, not a crash.
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        with pytest.raises(ConfigError) as info:
            load_checked(compose(config_name="config", overrides=[
                f"init_from={good}", "model=moe_tiny", "model.moe.bias_update_rate=0.01"],
                return_hydra_config=True), check_data=False)
    line = str(info.value)
    assert "\n" not in line and "model.moe.bias_update_rate=0.01 does not match model_type=mixtral" in line


def test_what_mixtral_cannot_express_is_refused_in_one_line(tmp_path, monkeypatch):
    from mlplat.checkpoint import CheckpointError, hf_export, io
    from mlplat.checkpoint.hf_config import MOE_CLASS_RULE, hf_class, not_moe_class

    good = write_config(tmp_path / "good", MIXTRAL_CONFIG)
    cfg = f"in init_from={good}/config.json"
    assert refusal(good, moe={"top_k": 3}) == (f"model.moe.top_k=3 does not match num_experts_per_tok=2 {cfg}; drop "
                                               f"model.moe.top_k (init_from sets it)")
    assert refusal(good, moe={"shared_experts": 1}) == (f"model.moe.shared_experts=1 does not match "
                                                        f"model_type=mixtral {cfg}; drop model.moe.shared_experts "
                                                        f"(init_from sets it)")
    llama = write_config(tmp_path / "llama")
    assert refusal(llama, moe={"num_experts": 8}).startswith("model.moe.num_experts=8 does not match "
                                                             "model_type=llama")
    jitter = write_config(tmp_path / "jitter", MIXTRAL_CONFIG, router_jitter_noise=0.1)
    assert refusal(jitter) == (f"init_from={jitter}: router_jitter_noise=0.1 in config.json is not supported "
                               f"(mlplat's router has no input jitter; router_jitter_noise=0.0 is)")
    window = write_config(tmp_path / "window", MIXTRAL_CONFIG, sliding_window=4096)
    assert refusal(window).startswith(f"init_from={window}: sliding_window=4096 in config.json is not supported")
    no_experts = write_config(tmp_path / "none", MIXTRAL_CONFIG, num_local_experts="absent")
    assert refusal(no_experts).startswith(f"init_from={no_experts}: config.json has no num_local_experts (a "
                                          f"mixtral config has")
    # Export: a mixture of experts transformers' Mixtral does not compute has no class, and is refused naming why.
    moe = dict(arch="llama", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=96,
               moe=dict(num_experts=4, top_k=2, ffn_hidden=32, norm_topk_prob=True))
    assert hf_class(moe) == ("mixtral", "MixtralForCausalLM") and not_moe_class(moe) is None
    # With shared experts the class is Qwen2-MoE's (tests/checkpoint/test_hf_qwen.py)
    for change, why in [({"shared_experts": 1}, "model.moe.shared_gate=false (Qwen2-MoE gates its shared expert"),
                        ({"routed_scaling_factor": 2.5}, "model.moe.routed_scaling_factor=2.5 (Mixtral does not "),
                        ({"expert_bias": True}, "model.moe.expert_bias=true (Mixtral has no expert bias)"),
                        ({"norm_topk_prob": False}, "model.moe.norm_topk_prob=false (Mixtral renormalises"),
                        ({"capacity_factor": 1.25}, "model.moe.capacity_factor=1.25 (Mixtral is dropless)"),
                        ({"dense_layers": 1}, "model.moe.dense_layers=1 (every Mixtral layer is a mixture"),
                        ({"bias_update_rate": 0.001}, "model.moe.bias_update_rate=0.001 (Mixtral has no expert"),
                        ({"n_groups": 2, "topk_groups": 1}, "model.moe.n_groups=2 (Mixtral's router chooses among")]:
        other = dict(moe, moe={**moe["moe"], **change})
        assert hf_class(other) is None and not_moe_class(other).startswith(why)
    assert not_moe_class(dict(moe, bias=True)) == "model.bias=true (Mixtral's linear layers have no biases)"
    monkeypatch.setattr(io, "verify", lambda ckpt: {"layout": {"model": dict(moe, moe={**moe["moe"],
                                                                                       "dense_layers": 1})}})
    with pytest.raises(CheckpointError) as err:
        hf_export.export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert str(err.value) == (f"checkpoint {tmp_path / 'ckpt'}'s mixture of experts has no transformers class: "
                              f"--format hf writes it as MixtralForCausalLM ({MOE_CLASS_RULE}), which it is not: "
                              f"model.moe.dense_layers=1 (every Mixtral layer is a mixture of experts)")


def test_a_layout_rule_broken_by_an_imported_expert_width_says_where_it_came_from(tmp_path):
    from mlplat.checkpoint.hf_config import explain_imported, read_hf_config

    odd = write_config(tmp_path / "odd", MIXTRAL_CONFIG, intermediate_size=30)
    with pytest.raises(ConfigError, match=r"^model.ffn_hidden=30 is not divisible by parallel.tp=4 \(model.ffn_hidden "
                                          r"is intermediate_size=30 in init_from="):
        load_checked({"init_from": str(odd), "parallel": dict(tp=4, pp=1, dp=1), "logger": {"name": "none"}},
                     check_data=False)
    rule = "model.moe.ffn_hidden=30 is not divisible by parallel.tp=4 (each expert's width is split over the ranks)"
    assert explain_imported(rule, read_hf_config(odd), str(odd)) == \
        f"{rule} (model.moe.ffn_hidden is intermediate_size=30 in init_from={odd}/config.json)"
    assert explain_imported(rule, read_hf_config(odd), str(odd), {"moe", "moe.ffn_hidden"}) == rule  # typed
    assert explain_imported(rule, read_hf_config(odd), str(odd), {"moe", "moe.top_k"}) != rule


def test_a_directory_with_a_nan_in_one_expert_is_refused_as_it_is_read(interop, tmp_path):
    """An inf/NaN in the weights would skip every step (an inf/NaN loss) without saying why: init_from refuses it in
    one line naming the parameter, as the rank reading it meets it."""
    from safetensors.torch import load_file, save_file

    from mlplat.checkpoint import CheckpointError
    from mlplat.parallel.grid import ParallelGrid

    damaged = tmp_path / "damaged"
    shutil.copytree(interop["path"], damaged)
    weights = next(damaged.glob("*.safetensors"))
    state = load_file(str(weights))
    name = next(k for k in state if ".experts.1." in k or "experts.gate_up_proj" in k)
    state[name] = state[name].clone()
    state[name].view(-1)[3] = float("nan")
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        build(import_cfg(damaged), ParallelGrid(), torch.float64)
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"init_from={damaged}: 1 inf/NaN value in the weights of layers.")
    assert ".mlp.experts.fc1.weight" in line or ".mlp.experts.fc2.weight" in line, line


def test_a_directory_with_a_tensor_its_config_does_not_name_is_refused(interop, tmp_path):
    """An expert past num_local_experts (a directory whose weights and config.json disagree) is refused in one line
    naming the tensor, not read around."""
    from safetensors.torch import load_file, save_file

    from mlplat.checkpoint import CheckpointError
    from mlplat.parallel.grid import ParallelGrid

    extra = tmp_path / "extra"
    shutil.copytree(interop["path"], extra)
    weights = next(extra.glob("*.safetensors"))
    state = load_file(str(weights))
    name = next(k for k in state if ".experts.0.w1." in k)
    state[name.replace(".experts.0.", ".experts.9.")] = state[name].clone()
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        build(import_cfg(extra), ParallelGrid(), torch.float64)
    assert str(info.value) == (f"init_from={extra} holds 1 tensor its config.json gives no place to "
                               f"({name.replace('.experts.0.', '.experts.9.')}): the weights and the config do not "
                               f"match")
