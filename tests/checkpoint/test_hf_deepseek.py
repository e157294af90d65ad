"""Hugging Face interop for DeepSeek-V3 (`DeepseekV3ForCausalLM`: DeepSeek-V3/R1, Kimi K2, Moonlight): `init_from` a
transformers directory alone, `export --format hf` back as the same class.

The random float64 model has DeepSeek-V3's whole architecture, scaled down: multi-head latent attention with query
compression (q_lora_rank), distinct nope/rope/value head widths, the rotary rows stored interleaved (rope_interleave),
YaRN with mscale and mscale_all_dim; a dense first layer, then 8 experts in 4 groups, 2 per token from the 2 best
groups, by sigmoid scores with a random correction bias, renormalised and scaled by 2.5, one shared expert; and one
multi-token prediction layer (num_nextn_predict_layers=1) with random weights, stored as layer 4 with copies of the
embedding and output layer, as DeepSeek's release has it (transformers' class ignores it: the logits compare the
main model, the bit-identical round trip covers the module).

One 4-rank group (tp2·pp2, interleaved v=2, ep2 folded onto the tp ranks) imports it: its logits and greedy text, which
the parent compares with transformers', and a checkpoint, which the parent exports and compares tensor by tensor with
the original directory. The same group imports it again as cp2·tp2 (the ring carrying the latents) and the DeepSeek-V2
one as cp2·pp2 with ep2 on the cp ranks, for their logits. transformers' float32 norms and router are read as
float64 (tests/checkpoint/test_hf_glm).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
from tests.checkpoint.test_hf_glm import _Float32AsFloat64, hf_model
from tests.checkpoint.test_hf_llama import (
    REL,
    SEQ,
    assert_each_rank_reads_only_its_shard,
    import_cfg,
    refusal,
    tokens_for_test,
    write_config,
)
from tests.helpers.dist import run_distributed

NEW_TOKENS = 8
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.7}
DSV3 = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
            n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, vocab_size=VOCAB,
            max_position_embeddings=SEQ, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=YARN,
            num_nextn_predict_layers=1, bos_token_id=1, eos_token_id=2, pad_token_id=None)
MTP_LAYER = "model.layers.4."
# DeepSeek-V2-Lite's shape, scaled down: no query compression, a softmax router among the 2 best of 4 groups by their
# best expert (group_limited_greedy), unrenormalised, scaled by 2, two shared experts, YaRN with V2-Lite's mscale
DSV2 = dict({k: v for k, v in DSV3.items() if k not in ("num_nextn_predict_layers", "norm_topk_prob")},
            q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=2.0, n_shared_experts=2,
            rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707))


def dsv2_dir(path: Path, seed: int, std: float = 0.2) -> Path:
    """A random float64 DeepseekV2ForCausalLM saved with save_pretrained, every parameter perturbed, the router
    sharply."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**DSV2, scoring_func="softmax")).to(torch.float64)  # (as released)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((1.0 if name.endswith("mlp.gate.weight") else std) * torch.randn_like(p))
    model.save_pretrained(str(path))
    return path


def dsv3_dir(path: Path, seed: int, std: float = 0.2) -> Path:
    """A random float64 DeepseekV3ForCausalLM saved with save_pretrained, every parameter perturbed (the router
    sharply, the correction biases at the sigmoid scores' scale), plus a random multi-token prediction layer: a
    fifth layer's modules (an MoE layer), enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding
    (embed_tokens) and the output layer (shared_head.head)."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**dict(DSV3, num_hidden_layers=5))).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((1.0 if name.endswith("mlp.gate.weight") else std) * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(str(path))  # (its saved names: the Hub's, per expert)
    saved = load_file(str(path / "model.safetensors"))
    mtp = {k: v for k, v in saved.items() if k.startswith(MTP_LAYER)}
    saved = {k: v for k, v in saved.items() if not k.startswith(MTP_LAYER)}
    # the main model's config, with the keys DeepSeek's release has beside transformers' (vLLM reads them)
    DeepseekV3Config(**DSV3, architectures=["DeepseekV3ForCausalLM"], dtype="float64", scoring_func="sigmoid",
                     topk_method="noaux_tc").save_pretrained(str(path))
    h = DSV3["hidden_size"]
    g = torch.Generator().manual_seed(seed + 1)
    mtp.update({f"{MTP_LAYER}enorm.weight": 1 + std * torch.randn(h, generator=g, dtype=torch.float64),
                f"{MTP_LAYER}hnorm.weight": 1 + std * torch.randn(h, generator=g, dtype=torch.float64),
                f"{MTP_LAYER}eh_proj.weight": std * torch.randn(h, 2 * h, generator=g, dtype=torch.float64),
                f"{MTP_LAYER}shared_head.norm.weight": 1 + std * torch.randn(h, generator=g, dtype=torch.float64),
                f"{MTP_LAYER}shared_head.head.weight": saved["lm_head.weight"].clone(),
                f"{MTP_LAYER}embed_tokens.weight": saved["model.embed_tokens.weight"].clone()})
    save_file({**saved, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _rotary_in_float64(xq, xk, freqs_cis):
    """transformers' DeepseekV2 rotation (neighbouring channels as complex numbers, times the float32 table) with q
    and k in float64 rather than float32."""
    freqs_cis = freqs_cis.unsqueeze(1).to(torch.complex128)
    return tuple(torch.view_as_real(torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2)) * freqs_cis)
                 .flatten(3).type_as(x) for x in (xq, xk))


class _V2Torch(_Float32AsFloat64):
    """Also DeepseekV2's rotary table as cos + i·sin, each in float32 as mlplat's (and DeepseekV3's) table has them:
    torch.polar rounds differently, by one float32 ulp."""

    @staticmethod
    def polar(magnitude, angle):
        return torch.complex(magnitude * angle.cos(), magnitude * angle.sin())


@pytest.fixture
def float64_router_and_norms(monkeypatch):
    from transformers.models.deepseek_v2 import modeling_deepseek_v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    monkeypatch.setattr(modeling_deepseek_v3, "torch", _Float32AsFloat64())
    monkeypatch.setattr(modeling_deepseek_v2, "torch", _V2Torch())
    monkeypatch.setattr(modeling_deepseek_v2, "apply_rotary_emb", _rotary_in_float64)


def reference_logits(path, tokens) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(tokens).logits


def _interop(rank, world_size, path, ckpt, tokens, v2_path, v2_ckpt):
    """tp2·pp2 (v=2) with ep2: the DeepSeek-V3 directory imported (logits, greedy text, a checkpoint), and the
    DeepSeek-V2 one (logits, a checkpoint)."""
    from mlplat.checkpoint import io
    from mlplat.lightning.strategy import checkpoint_layout
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.step.decode import generate

    torch.set_num_threads(1)
    grid = ParallelGrid(2, 2, 1, ep=2)
    imported = build(import_cfg(path, 2, 2, 2, ep=2), grid, torch.float64)
    out = {"ep2": pipeline_logits(imported, grid, tokens), "generated": generate(imported, PROMPT, NEW_TOKENS)}
    io.save(ckpt, imported.chunks, None, grid, {"global_step": 0}, checkpoint_layout(imported.cfg, 1))
    v2 = build(import_cfg(v2_path, 2, 2, 2, ep=2), grid, torch.float64)
    out["v2"] = pipeline_logits(v2, grid, tokens)
    io.save(v2_ckpt, v2.chunks, None, grid, {"global_step": 0}, checkpoint_layout(v2.cfg, 1))
    grid = ParallelGrid(2, 1, 1, cp=2, ep=2)  # cp2·tp2, ep2 on the tp ranks: the latent ring on split heads
    out["cp2"] = pipeline_logits(build(import_cfg(path, 2, cp=2, ep=2), grid, torch.float64), grid, tokens)
    grid = ParallelGrid(1, 2, 1, cp=2, ep=2)  # cp2·pp2, ep2 on the cp ranks: each its own tokens' experts
    out["v2_cp2"] = pipeline_logits(build(import_cfg(v2_path, 1, 2, cp=2, ep=2), grid, torch.float64), grid, tokens)
    return out


@pytest.fixture(scope="module")
def interop(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_dsv3")
    path, v2 = dsv3_dir(root / "dsv3", seed=5), dsv2_dir(root / "dsv2", seed=6)
    tokens = tokens_for_test()
    results = run_distributed(_interop, 4, str(path), str(root / "ckpt"), tokens, str(v2), str(root / "v2_ckpt"),
                              timeout=300)
    return {"root": root, "path": path, "v2": v2, "tokens": tokens, "results": results}


def _last(interop, key, ranks=2) -> list:
    last = [r[key] for r in interop["results"] if r[key] is not None]
    assert len(last) == ranks  # the last stage's ranks
    return last


# ------------------------------------------------------------------------------------------------ import

@needs_hf
def test_import_matches_transformers_in_one_process_and_under_tp2_pp2_ep2_and_cp2(interop, float64_router_and_norms):
    from mlplat.parallel.grid import ParallelGrid

    path, tokens = interop["path"], interop["tokens"]
    ref = reference_logits(path, tokens)
    assert ref.dtype == torch.float64
    cfg = import_cfg(path)
    m = cfg.model
    assert (m.attention, m.n_layers, m.hidden, m.n_heads, m.vocab_size, m.seq_len, m.tie_embeddings, m.norm_eps,
            m.mtp.depth, m.mtp.loss_coeff) == ("mla", 4, 64, 4, VOCAB, SEQ, False, 1e-6, 1, 0.3)
    assert (m.mla.q_lora_rank, m.mla.kv_lora_rank, m.mla.qk_nope_head_dim, m.mla.qk_rope_head_dim,
            m.mla.v_head_dim) == (24, 16, 12, 8, 10)
    assert m.rope_scaling == {k: v for k, v in YARN.items() if k != "rope_theta"}
    moe = m.moe
    assert (moe.num_experts, moe.top_k, moe.ffn_hidden, moe.router, moe.norm_topk_prob, moe.routed_scaling_factor,
            moe.n_groups, moe.topk_groups, moe.expert_bias, moe.shared_experts, moe.shared_gate, moe.dense_layers) == \
        (8, 2, 32, "sigmoid", True, 2.5, 4, 2, True, 1, False, 1)
    grid = ParallelGrid()
    ours = pipeline_logits(build(cfg, grid, torch.float64), grid, tokens)
    assert rel_err(ours, ref) <= REL
    for r in _last(interop, "ep2") + _last(interop, "cp2", ranks=4):
        assert rel_err(r, ref) <= REL


@needs_hf
def test_deepseek_v2_imports_and_exports_as_transformers_computes(interop, float64_router_and_norms):
    """DeepSeek-V2 (no query compression, the softmax router with groups): logits equal transformers' in one process,
    under tp2·pp2·ep2 and under cp2·pp2·ep2; exported, every tensor and the config as they were."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from mlplat.parallel.grid import ParallelGrid

    path, tokens = interop["v2"], interop["tokens"]
    ref = reference_logits(path, tokens)
    cfg = import_cfg(path)
    m = cfg.model
    assert (m.attention, m.mla.q_lora_rank, m.mtp.depth, m.moe.router, m.moe.n_groups, m.moe.topk_groups,
            m.moe.norm_topk_prob, m.moe.routed_scaling_factor, m.moe.expert_bias, m.moe.shared_experts) == \
        ("mla", None, 0, "softmax", 4, 2, False, 2.0, False, 2)
    grid = ParallelGrid()
    assert rel_err(pipeline_logits(build(cfg, grid, torch.float64), grid, tokens), ref) <= REL
    for r in _last(interop, "v2") + _last(interop, "v2_cp2"):
        assert rel_err(r, ref) <= REL
    out = export_hf(interop["root"] / "v2_ckpt", interop["root"] / "v2_export")
    before, after = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    theirs, ours = (AutoConfig.from_pretrained(str(d)).to_dict() for d in (path, out))
    assert {k: v for k, v in ours.items() if k not in NOT_COMPARED} == \
        {k: v for k, v in theirs.items() if k not in NOT_COMPARED}


@needs_hf
@pytest.mark.parametrize("mutation", ["rotary rows not permuted", "no softmax factor"])
def test_a_wrong_mapping_is_caught(interop, mutation, float64_router_and_norms, monkeypatch):
    """The comparison above can fail: the interleaved rotary rows read as they are, or YaRN's mscale_all_dim factor
    on every score left out, each moves the logits far from transformers'."""
    from mlplat.checkpoint import hf
    from mlplat.model import mla
    from mlplat.parallel.grid import ParallelGrid

    path, tokens = interop["path"], interop["tokens"]
    if mutation == "rotary rows not permuted":
        monkeypatch.setattr(hf, "deinterleave", lambda t, block, rope: t)
    else:
        monkeypatch.setattr(mla, "softmax_factor", lambda scaling: 1.0)
    grid = ParallelGrid()
    ours = pipeline_logits(build(import_cfg(path), grid, torch.float64), grid, tokens)
    assert rel_err(ours, reference_logits(path, tokens)) > 1e-3


@needs_hf
def test_greedy_generation_through_the_pipeline_matches_transformers(interop, float64_router_and_norms):
    assert_greedy_text_matches(hf_model(interop["path"]), interop["results"], new_tokens=NEW_TOKENS)


@needs_hf
def test_each_tensor_parallel_rank_reads_only_its_shard(interop, monkeypatch):
    """tp=2: each rank reads its heads of q_b_proj and kv_b_proj (their rotary rows permuted after the read), its
    columns of o_proj, its units of the experts, the shared expert and the dense layer, the multi-token prediction
    layer's alike; or, under ep2, four of the eight experts whole."""
    assert_each_rank_reads_only_its_shard(interop["path"], monkeypatch, {
        "layers.0.attn.q_up.weight", "layers.0.attn.kv_up.weight", "layers.0.attn.out.weight",
        "layers.0.mlp.fc1.weight", "layers.1.mlp.experts.fc1.weight", "layers.1.mlp.shared.fc1.weight",
        "mtp.0.layer.attn.q_up.weight", "mtp.0.layer.mlp.experts.fc2.weight"})
    assert_each_rank_reads_only_its_shard(interop["path"], monkeypatch, {
        "layers.1.mlp.experts.fc1.weight", "mtp.0.layer.mlp.experts.fc1.weight"}, ep=2)


# ------------------------------------------------------------------------------------------------ export

NOT_COMPARED = ("transformers_version", "bos_token_id", "eos_token_id", "_name_or_path")


@needs_hf
def test_round_trip_hf_mlplat_hf_is_bit_identical(interop, float64_router_and_norms):
    """Imported under tp2·pp2·ep2, saved, exported: DeepseekV3ForCausalLM with the same config (as transformers reads
    both) and every tensor bit-identical: the interleaved rotary rows, the correction biases, the multi-token
    prediction layer with its copies of the embedding and output layer."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path, tokens = interop["path"], interop["tokens"]
    out = export_hf(interop["root"] / "ckpt", interop["root"] / "export")
    before, after = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for name in ("model.layers.3.mlp.gate.e_score_correction_bias", f"{MTP_LAYER}eh_proj.weight",
                 f"{MTP_LAYER}mlp.gate.e_score_correction_bias", f"{MTP_LAYER}shared_head.head.weight"):
        assert name in after
    for name in before:
        assert before[name].dtype == after[name].dtype == torch.float64, name
        assert torch.equal(before[name], after[name]), name
    theirs, ours = (AutoConfig.from_pretrained(str(d)).to_dict() for d in (path, out))
    assert {k: v for k, v in ours.items() if k not in NOT_COMPARED} == \
        {k: v for k, v in theirs.items() if k not in NOT_COMPARED}
    exported = hf_model(out)
    assert type(exported).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, reference_logits(path, tokens))


# ------------------------------------------------------------------------------------------------ configs

DSV3_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
               **{k: v for k, v in DSV3.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}}


def test_what_deepseek_v3_cannot_express_is_refused_in_one_line(tmp_path):
    good = write_config(tmp_path / "good", DSV3_CONFIG)
    cfg = f"in init_from={good}/config.json"
    assert refusal(good, mla={"kv_lora_rank": 32}) == (
        f"model.mla.kv_lora_rank=32 does not match kv_lora_rank=16 {cfg}; drop model.mla.kv_lora_rank (init_from "
        f"sets it)")
    assert refusal(good, mtp={"depth": 2}) == (f"model.mtp.depth=2 does not match num_nextn_predict_layers=1 {cfg}; "
                                               f"drop model.mtp.depth (init_from sets it)")
    for change, line in [
            ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05 in config.json is not supported (DeepSeek-V3's latent norms"),
            ({"rope_interleave": False}, "rope_interleave=false in config.json is not supported"),
            ({"attention_bias": True}, "attention_bias=true in config.json is not supported"),
            ({"scoring_func": "softmax"}, "scoring_func=softmax in config.json is not supported"),
            ({"tie_word_embeddings": True}, "tie_word_embeddings=true in config.json is not supported"),
            ({"num_key_value_heads": 2}, "num_key_value_heads=2 in config.json is not supported"),
            ({"n_shared_experts": 0}, "n_shared_experts=0 in config.json is not supported (DeepSeek-V3's shared"),
            ({"rope_parameters": dict(YARN, attention_factor=1.2)}, "rope_parameters.attention_factor=1.2 in "),
            ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
             "rope_parameters.rope_type='linear' in config.json is not supported")]:
        bad = write_config(tmp_path / "bad", DSV3_CONFIG, **change)
        assert refusal(bad).startswith(f"init_from={bad}: {line}"), refusal(bad)


def test_mtp_depth_follows_the_layers_the_weights_hold(tmp_path):
    """transformers' save_pretrained keeps num_nextn_predict_layers but drops the layers: the depth is what the
    weights hold; the loss weight stays the config's."""
    from safetensors.torch import save_file

    from mlplat.train import load_checked

    path = write_config(tmp_path / "none", DSV3_CONFIG)
    save_file({"model.norm.weight": torch.ones(2)}, str(path / "model.safetensors"))
    m = load_checked({"init_from": str(path), "logger": {"name": "none"}, "parallel": dict(tp=1, pp=1, dp=1)},
                     check_data=False).model
    assert (m.mtp.depth, m.attention) == (0, "mla")
    from mlplat.checkpoint.hf import unread_mtp_layers

    assert unread_mtp_layers(path, m) == (f"num_nextn_predict_layers=1 in {path}/config.json, but the weights hold 0 "
                                          f"of those layers (model.layers.4.*): model.mtp.depth=0")
    save_file({"model.layers.4.enorm.weight": torch.ones(2)}, str(path / "model.safetensors"))
    m = load_checked({"init_from": str(path), "logger": {"name": "none"}, "parallel": dict(tp=1, pp=1, dp=1),
                      "model": {"mtp": {"loss_coeff": 0.1}}}, check_data=False).model
    assert (m.mtp.depth, m.mtp.loss_coeff) == (1, 0.1)


def test_export_writes_deepseek_v3_only_for_what_it_computes():
    from mlplat.checkpoint.hf_config import hf_class, not_moe_class

    mla = dict(arch="llama", n_layers=4, hidden=64, n_heads=4, vocab_size=256, ffn_hidden=96, attention="mla",
               norm_eps=1e-6, mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
                                       v_head_dim=10),
               moe=dict(num_experts=8, top_k=2, ffn_hidden=32, router="sigmoid", shared_experts=1, expert_bias=True))
    assert hf_class(mla) == ("deepseek_v3", "DeepseekV3ForCausalLM")
    assert hf_class(dict(mla, moe={})) is None  # a dense latent attention: no class
    v2 = dict(mla, moe=dict(mla["moe"], router="softmax", expert_bias=False, norm_topk_prob=False))
    assert hf_class(v2) == ("deepseek_v2", "DeepseekV2ForCausalLM")
    for change, why in [({"norm_eps": 1e-5}, "model.norm_eps=1e-05 (DeepSeek-V3's latent norms use 1e-6"),
                        ({"tie_embeddings": True}, "model.tie_embeddings=true (DeepSeek-V3's output layer"),
                        ({"moe": dict(mla["moe"], router="softmax")}, "model.moe.expert_bias=true (DeepSeek-V2 has no"),
                        ({"moe": dict(mla["moe"], router="softmax", expert_bias=False, norm_topk_prob=True)},
                         "model.moe.norm_topk_prob=true (transformers' DeepseekV2 never renormalises"),
                        ({"moe": dict(mla["moe"], expert_bias=False)}, "model.moe.expert_bias=false (DeepSeek-V3")]:
        other = dict(mla, **change)
        assert hf_class(other) is None and not_moe_class(other).startswith(why), not_moe_class(other)


# DeepSeek-V3's config.json on the Hub (its legacy rope_scaling; transformers' DeepseekV3Config defaults are its
# shapes), and Kimi K2's (model_type deepseek_v3)
DEEPSEEK_V3 = dict(DSV3_CONFIG, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                   num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=3,
                   routed_scaling_factor=2.5, vocab_size=129280, max_position_embeddings=163840,
                   scoring_func="sigmoid", topk_method="noaux_tc", rope_parameters="absent", rope_theta=10000,
                   rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
KIMI_K2 = dict(DEEPSEEK_V3, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384, n_group=1,
               topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827, vocab_size=163840, rope_theta=50000,
               num_nextn_predict_layers=0, max_position_embeddings=131072,
               rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})


# DeepSeek-V2-Lite's config.json on the Hub
V2_LITE = dict(DEEPSEEK_V3, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048,
               intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
               num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0,
               q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=6,
               moe_layer_freq=1, first_k_dense_replace=1, norm_topk_prob=False, scoring_func="softmax",
               vocab_size=102400, num_nextn_predict_layers="absent",
               rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})


@pytest.mark.parametrize("name,config", [("deepseek_v3", DEEPSEEK_V3), ("kimi_k2", KIMI_K2),
                                         ("deepseek_v2_lite", V2_LITE)])
def test_the_released_shapes_import_as_their_configs(tmp_path, name, config):
    """DeepSeek-V3's, Kimi K2's and DeepSeek-V2-Lite's config.json set the models conf/model/deepseek_v3.yaml,
    kimi_k2.yaml and deepseek_v2_lite.yaml describe (the weights file empty: the depth is config.json's)."""
    from dataclasses import asdict

    from mlplat.config import from_dict
    from mlplat.plan import load_group
    from mlplat.train import load_checked

    got = load_checked({"init_from": str(write_config(tmp_path / name, config)), "logger": {"name": "none"},
                        "parallel": dict(tp=1, pp=1, dp=1)}, check_data=False).model
    conf = from_dict({"model": load_group("model", name)}).model
    assert got.weights() == conf.weights()
    for key in ("n_layers", "hidden", "n_heads", "vocab_size", "ffn_hidden", "norm_eps", "rope_theta", "attention",
                "tie_embeddings", "mla"):
        assert getattr(got, key) == getattr(conf, key), key
    assert {k: float(v) for k, v in got.rope_scaling.items() if k != "rope_type"} == \
        {k: float(v) for k, v in conf.rope_scaling.items() if k != "rope_type"}
    assert got.mtp.depth == conf.mtp.depth
    moe = {k: v for k, v in asdict(got.moe).items() if k not in ("bias_update_rate", "aux_loss_coeff",
                                                                  "seq_aux_loss_coeff", "z_loss_coeff", "dispatcher",
                                                                  "plan_imbalance")}
    assert moe == {k: v for k, v in asdict(conf.moe).items() if k in moe}
    if name == "deepseek_v3":
        pytest.importorskip("transformers")
        from transformers import DeepseekV3Config

        defaults = DeepseekV3Config().to_dict()
        shape = [k for k in DEEPSEEK_V3 if k in defaults and k not in ("max_position_embeddings", "architectures",
                                                                       "model_type", "rope_parameters")
                 and not isinstance(DEEPSEEK_V3[k], dict)]
        assert {k: defaults[k] for k in shape} == {k: DEEPSEEK_V3[k] for k in shape}


@needs_hf
def test_closed_form_parameter_count_equals_transformers(interop):
    """The dry run's count is transformers' (DeepSeek-V3's without its multi-token prediction layer, which
    transformers' class does not build)."""
    from dataclasses import replace

    from mlplat.config import MTPConfig
    from mlplat.perf.flops import ModelDims, parameter_count

    for path in (interop["path"], interop["v2"]):
        model = replace(import_cfg(path).model, mtp=MTPConfig())
        assert parameter_count(ModelDims.of(model), 1, padded=False) == \
            sum(p.numel() for p in hf_model(path).parameters())
