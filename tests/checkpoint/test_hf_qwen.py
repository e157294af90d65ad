"""Hugging Face interop for Qwen3 (dense, `model.qk_norm`), Qwen2-MoE (a shared expert behind a sigmoid gate, q/k/v
biases, norm_topk_prob false, a dense first layer) and Qwen3-MoE (qk_norm, norm_topk_prob true): `init_from` a
transformers directory alone, `export --format hf` back as the same class.

Qwen3 with heads of 32 at hidden 64 and Qwen3-MoE with heads of 24 (`model.head_dim`: a·d ≠ h, as the released Qwen3s'
128 at hidden 2048 or 4096). One 4-rank group (tp2·pp2, interleaved v=2; Qwen2-MoE with expert parallelism folded onto
the tp ranks, each holding two of the four experts whole, `parallel.ep=2`; Qwen3-MoE with each expert's width split
over the two tp ranks, and again with ep2) imports a random float64 model of each class (4 heads on 2 key/value heads,
4 experts, 2 per token, untied output layer): its logits and greedy text, which the parent compares with
transformers', and a checkpoint, which the parent exports and compares tensor by tensor with the original directory.
The same group takes one training step of a model with qk_norm at tp2·pp2, with and without sequence parallelism, its
key/value head shared by both tp ranks: the norms' gradients, partial sums over the tp ranks, equal one process's once
summed, and differ without the sum.

As in tests/checkpoint/test_hf_mixtral.py, transformers' RMSNorms and routers are patched to compute in their input's
dtype (they cast to float32), the reference attention is SDPA and its experts one matmul each.
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
from tests.checkpoint.test_hf_llama import (
    REL,
    SEQ,
    assert_each_rank_reads_only_its_shard,
    import_cfg,
    refusal,
    tokens_for_test,
    write_config,
)
from tests.checkpoint.test_hf_mixtral import (
    fused_imports_alike,
    hf_model,
    norm_in_input_dtype,
    reference_logits,
    router_in_input_dtype,
    save_random,
)
from tests.helpers import equivalence as eq
from tests.helpers.dist import run_distributed

NEW_TOKENS = 10  # greedy tokens generated through the pipeline (three models: 20 each would double the launch)
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=SEQ, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=1, eos_token_id=2,
            pad_token_id=None)
FAMILIES = {
    # heads wider than hidden/heads (model.head_dim), as the released Qwen3s': a·d = 128 = 2h
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(BASE, head_dim=32)),
    # a shared expert two experts wide; layer 0 dense (intermediate_size 96)
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(BASE, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                       num_experts_per_tok=2, mlp_only_layers=[0], qkv_bias=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(BASE, head_dim=24, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       norm_topk_prob=True)),
}
# one training step of a model with qk_norm: layout name -> make_cfg's keys
QK_NORM_STEPS = {"tp2-pp2": dict(tp=2, pp=2, global_batch=4, model=dict(arch="llama", n_kv_heads=1, qk_norm=True))}
QK_NORM_STEPS["tp2-sp-pp2"] = dict(QK_NORM_STEPS["tp2-pp2"], sequence_parallel=True)


def qwen_dir(path: Path, family: str, seed: int, std: float = 0.2) -> Path:
    config, cls, keys = FAMILIES[family]
    return save_random(cls, config, keys, path, seed, std)


@pytest.fixture
def float32_free(monkeypatch):
    """transformers' RMSNorms (the q and k norms among them) and routers in their input's dtype, as mlplat's."""
    from transformers.models.qwen2_moe import modeling_qwen2_moe
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", norm_in_input_dtype)
    for module, prefix in ((modeling_qwen2_moe, "Qwen2Moe"), (modeling_qwen3_moe, "Qwen3Moe")):
        monkeypatch.setattr(getattr(module, f"{prefix}RMSNorm"), "forward", norm_in_input_dtype)
        monkeypatch.setattr(getattr(module, f"{prefix}TopKRouter"), "forward", router_in_input_dtype)


EXPERT_PARALLEL = {"qwen2_moe": 2}  # family -> parallel.ep of its import (the others: experts split over tp)


def _interop(rank, world_size, dirs, ckpt_root, tokens):
    """tp2·pp2 (v=2): each float64 directory imported: its logits, its greedy text, and a checkpoint of it; then the
    qk_norm training step, summed and unsummed."""
    from mlplat.checkpoint import io
    from mlplat.lightning.strategy import checkpoint_layout
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.step.decode import generate

    torch.set_num_threads(1)
    out = {}
    for family, path in dirs.items():
        ep = EXPERT_PARALLEL.get(family, 1)
        grid = ParallelGrid(2, 2, 1, ep=ep)
        imported = build(import_cfg(path, 2, 2, 2, ep=ep), grid, torch.float64)
        out[family] = {"logits": pipeline_logits(imported, grid, tokens),
                       "generated": generate(imported, PROMPT, NEW_TOKENS)}
        io.save(f"{ckpt_root}/{family}", imported.chunks, None, grid, {"global_step": 0},
                checkpoint_layout(imported.cfg, 1))
    # Qwen3-MoE under expert parallelism too (its own logits only: the experts split over tp are its run above)
    grid = ParallelGrid(2, 2, 1, ep=2)
    folded = build(import_cfg(dirs["qwen3_moe"], 2, 2, 2, ep=2), grid, torch.float64)
    out["qwen3_moe-ep2"] = {"logits": pipeline_logits(folded, grid, tokens)}
    for name, keys in QK_NORM_STEPS.items():
        cfg = eq.make_cfg(**keys)
        out[name] = eq.grads_run(cfg, eq.make_grid(cfg))
    cfg = eq.make_cfg(**QK_NORM_STEPS["tp2-pp2"])
    out["unsummed"] = eq.grads_run_without_tp_sum(cfg, eq.make_grid(cfg))
    return out


@pytest.fixture(scope="module")
def interop(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_qwen")
    dirs = {family: qwen_dir(root / family, family, seed=i) for i, family in enumerate(FAMILIES)}
    tokens = tokens_for_test()
    results = run_distributed(_interop, 4, {k: str(v) for k, v in dirs.items()}, str(root / "ckpt"), tokens,
                              timeout=300)
    return {"root": root, "dirs": dirs, "tokens": tokens, "results": results}


def _last(interop, family) -> list[dict]:
    last = [r[family] for r in interop["results"] if r[family]["logits"] is not None]
    assert len(last) == 2  # the two tp ranks of the last stage
    return last


# ------------------------------------------------------------------------------------------------ import

@needs_hf
@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_matches_transformers_in_one_process_and_under_tp2_pp2_interleaved(interop, family, float32_free):
    from mlplat.parallel.grid import ParallelGrid

    path, tokens = interop["dirs"][family], interop["tokens"]
    ref = reference_logits(path, tokens)
    assert ref.dtype == torch.float64
    cfg = import_cfg(path)
    m = cfg.model
    assert (m.arch, m.n_layers, m.hidden, m.n_heads, m.kv_heads, m.vocab_size, m.seq_len, m.tie_embeddings,
            m.rope_theta) == ("llama", 4, 64, 4, 2, VOCAB, SEQ, False, 1e6)
    assert (m.qk_norm, m.qkv_bias) == (family != "qwen2_moe", family == "qwen2_moe")
    heads = {"qwen3": (32, 128), "qwen2_moe": (None, 64), "qwen3_moe": (24, 96)}  # model.head_dim, a·d
    assert (m.head_dim, m.attention_width) == heads[family]
    moe = m.moe
    want = {"qwen3": (0, 2, None, "softmax", False, 0, False, 0),
            "qwen2_moe": (4, 2, 32, "softmax", False, 2, True, 1),
            "qwen3_moe": (4, 2, 32, "softmax", True, 0, False, 0)}[family]
    assert (moe.num_experts, moe.top_k, moe.ffn_hidden, moe.router, moe.norm_topk_prob, moe.shared_experts,
            moe.shared_gate, moe.dense_layers) == want
    grid = ParallelGrid()
    ours = pipeline_logits(build(cfg, grid, torch.float64), grid, tokens)
    assert rel_err(ours, ref) <= REL
    for r in _last(interop, family) + (_last(interop, "qwen3_moe-ep2") if family == "qwen3_moe" else []):
        assert rel_err(r["logits"], ref) <= REL


@needs_hf
@pytest.mark.parametrize("family", list(FAMILIES))
def test_closed_form_parameter_count_equals_transformers(interop, family):
    """The q and k norms, the experts, the shared expert and its gate, the dense first layer: counted as transformers
    has them (the true vocabulary, no padding rows)."""
    from mlplat.perf.flops import ModelDims, parameter_count

    dims = ModelDims.of(import_cfg(interop["dirs"][family]).model)
    assert parameter_count(dims, 1, padded=False) == sum(p.numel() for p in hf_model(interop["dirs"][family])
                                                         .parameters())


@needs_hf
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_through_the_pipeline_matches_transformers(interop, family, float32_free):
    assert_greedy_text_matches(hf_model(interop["dirs"][family]), [r[family] for r in interop["results"]],
                               new_tokens=NEW_TOKENS)


@needs_hf
@pytest.mark.parametrize("mutation", ["q_norm<->k_norm", "gate<->up of the experts", "no shared expert gate"])
def test_a_wrong_mapping_is_caught(interop, mutation, float32_free, monkeypatch):
    """The comparison above can fail: q_norm read as k_norm (and back), the experts' gate and up read swapped, the
    shared expert's gate read as zero (a constant 1/2 gate) each move the logits far from transformers'."""
    from mlplat.checkpoint import hf
    from mlplat.parallel.grid import ParallelGrid

    family = "qwen3_moe" if mutation == "q_norm<->k_norm" else "qwen2_moe"
    if mutation == "q_norm<->k_norm":
        layer = dict(hf.NAMES["qwen_moe"].layer, **{"attn.q_norm": ["self_attn.k_norm"],
                                                    "attn.k_norm": ["self_attn.q_norm"]})
        monkeypatch.setitem(hf.NAMES, "qwen_moe", hf.NAMES["qwen_moe"]._replace(layer=layer))
    elif mutation == "gate<->up of the experts":
        fc1 = hf.EXPERTS["qwen_moe"]["mlp.experts.fc1"]
        monkeypatch.setitem(hf.EXPERTS, "qwen_moe", dict(hf.EXPERTS["qwen_moe"], **{"mlp.experts.fc1": fc1[::-1]}))
    else:
        real = hf.HFWeights.read_shard
        monkeypatch.setattr(hf.HFWeights, "read_shard", lambda self, full, p, grid: torch.zeros_like(p)
                            if full.endswith("shared_gate.weight") else real(self, full, p, grid))
    path, tokens = interop["dirs"][family], interop["tokens"]
    grid = ParallelGrid()
    ours = pipeline_logits(build(import_cfg(path), grid, torch.float64), grid, tokens)
    assert rel_err(ours, reference_logits(path, tokens)) > 1e-2


@needs_hf
def test_transformers_fused_expert_layout_is_read_alike(interop, tmp_path):
    """A Qwen2-MoE directory in transformers 5's fused names (mlp.experts.gate_up_proj [E, 2f, h],
    mlp.experts.down_proj [E, h, f]) imports to the same parameters as the Hub's per-expert one, bit for bit."""
    params = fused_imports_alike(interop["dirs"]["qwen2_moe"], tmp_path, layer=1)
    assert "layers.1.mlp.shared_gate.weight" in params


@needs_hf
def test_each_tensor_parallel_rank_reads_only_its_units_of_every_expert(interop, monkeypatch):
    """tp=2: each rank reads 16 of each expert's 32 units, 32 of the shared expert's 64; the router, its gate and the
    q and k norms whole."""
    assert_each_rank_reads_only_its_shard(interop["dirs"]["qwen2_moe"], monkeypatch, {
        "layers.1.mlp.experts.fc1.weight", "layers.1.mlp.experts.fc2.weight", "layers.1.mlp.shared.fc1.weight",
        "layers.1.mlp.shared.fc2.weight", "layers.0.mlp.fc1.weight"})
    assert_each_rank_reads_only_its_shard(interop["dirs"]["qwen3_moe"], monkeypatch, {
        "layers.0.mlp.experts.fc1.weight", "layers.0.attn.qkv.weight"})
    # ep2: each rank reads two of the four experts whole (the shared expert still split over tp)
    assert_each_rank_reads_only_its_shard(interop["dirs"]["qwen2_moe"], monkeypatch, {
        "layers.1.mlp.experts.fc1.weight", "layers.1.mlp.experts.fc2.weight", "layers.1.mlp.shared.fc1.weight"},
        ep=2)


@pytest.mark.parametrize("layout", list(QK_NORM_STEPS))
def test_qk_norm_gradients_are_summed_over_the_tensor_parallel_ranks(interop, layout):
    """tp2·pp2, with and without sequence parallelism, one key/value head shared by both tp ranks: loss, gradient
    norm and every gradient equal one process's; without the tp sum the q and k norms' gradients (each rank's heads
    only) do not."""
    ref = eq.reference(eq.make_cfg(**QK_NORM_STEPS[layout]), "grads")
    results = [r[layout] for r in interop["results"]]
    merged = eq.merge(results, "grads")
    assert set(merged) == set(ref["grads"]) and "layers.0.attn.q_norm.weight" in merged
    for res in results:
        assert abs(res["loss"] - ref["loss"]) <= 1e-12 and abs(res["norm"] - ref["norm"]) <= 1e-12 * ref["norm"]
    for name, copies in merged.items():
        for t in copies:
            torch.testing.assert_close(t, ref["grads"][name], rtol=1e-10, atol=1e-12, msg=name)
    worst = max(float((t - ref["grads"][name]).abs().max())
                for name, copies in eq.merge([r["unsummed"] for r in interop["results"]], "grads").items()
                if name.endswith(("q_norm.weight", "k_norm.weight")) for t in copies)
    assert worst > 1e-4, worst


# ------------------------------------------------------------------------------------------------ export

# config.json's keys transformers reads back alike from the original and the export (bos/eos: the run's tokenizer's)
NOT_COMPARED = ("transformers_version", "bos_token_id", "eos_token_id", "max_window_layers", "_name_or_path")


@needs_hf
@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_hf_mlplat_hf_is_bit_identical(interop, family, float32_free):
    """Imported under tp2·pp2, saved, exported: the same class with the same config (as transformers reads both)
    and every tensor bit-identical in the Hub's names; transformers' logits from it are its logits from the
    original, and mlplat's."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path, tokens = interop["dirs"][family], interop["tokens"]
    out = export_hf(interop["root"] / "ckpt" / family, interop["root"] / f"export_{family}")
    before, after = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype == torch.float64, name
        assert torch.equal(before[name], after[name]), name
    theirs, ours = (AutoConfig.from_pretrained(str(d)).to_dict() for d in (path, out))
    assert {k: v for k, v in ours.items() if k not in NOT_COMPARED} == \
        {k: v for k, v in theirs.items() if k not in NOT_COMPARED}
    exported = hf_model(out)
    assert type(exported).__name__ == FAMILIES[family][1]
    with torch.no_grad():
        logits = exported(tokens).logits
    assert torch.equal(logits, reference_logits(path, tokens))
    assert rel_err(_last(interop, family)[0]["logits"], logits) <= REL


# ------------------------------------------------------------------------------------------------ refusals

QWEN3_MOE_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
                    "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
                    "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
                    "mlp_only_layers": [], "vocab_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
                    "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
                    "use_sliding_window": False, "sliding_window": None, "rope_theta": 1000000.0}
# Qwen3-30B-A3B's config.json on the Hub (its shapes)
QWEN3_30B_A3B = dict(QWEN3_MOE_CONFIG, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960)


def test_what_the_qwen_classes_cannot_express_is_refused_in_one_line(tmp_path):
    good = write_config(tmp_path / "good", QWEN3_MOE_CONFIG)
    cfg = f"in init_from={good}/config.json"
    assert refusal(good, qk_norm=False) == (f"model.qk_norm=false does not match model_type=qwen3_moe {cfg}; drop "
                                            f"model.qk_norm (init_from sets it)")
    llama = write_config(tmp_path / "llama")
    assert refusal(llama, qk_norm=True).startswith("model.qk_norm=true does not match model_type=llama in ")
    assert refusal(good, head_dim=32) == (f"model.head_dim=32 does not match head_dim=16 {cfg}; drop model.head_dim "
                                          f"(init_from sets it)")
    bias = write_config(tmp_path / "bias", QWEN3_MOE_CONFIG, attention_bias=True)
    assert refusal(bias).startswith(f"init_from={bias}: attention_bias=true in config.json is not supported")
    for name, keys, dense in [("step", dict(decoder_sparse_step=2), [0, 2]), ("middle", dict(mlp_only_layers=[1]), [1]),
                              ("all", dict(mlp_only_layers=[0, 1, 2, 3]), [0, 1, 2, 3])]:
        odd = write_config(tmp_path / name, QWEN3_MOE_CONFIG, **keys)
        assert refusal(odd) == (
            f"init_from={odd}: decoder_sparse_step={keys.get('decoder_sparse_step', 1)}, mlp_only_layers="
            f"{keys.get('mlp_only_layers', [])} in config.json make layers {dense} dense, which mlplat does not "
            f"support (its dense layers are the first model.moe.dense_layers, before at least one mixture of experts)")
    # a layer past the model, and the experts' count given twice, differently (transformers reads one of them)
    past = write_config(tmp_path / "past", QWEN3_MOE_CONFIG, mlp_only_layers=[7])
    layers = QWEN3_MOE_CONFIG["num_hidden_layers"]
    assert refusal(past) == (f"init_from={past}: mlp_only_layers=[7] in config.json names 7, not a layer of the "
                             f"{layers} (num_hidden_layers={layers}: 0 to {layers - 1})")
    twice = write_config(tmp_path / "twice", QWEN3_MOE_CONFIG, num_local_experts=QWEN3_MOE_CONFIG["num_experts"] * 2)
    assert refusal(twice) == (f"init_from={twice}: num_experts={QWEN3_MOE_CONFIG['num_experts']} and "
                              f"num_local_experts={QWEN3_MOE_CONFIG['num_experts'] * 2} in config.json disagree (both "
                              f"name the routed experts' count); keep one")
    qwen2 = {**{k: v for k, v in QWEN3_MOE_CONFIG.items() if k not in ("head_dim", "attention_bias")},
             "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "shared_expert_intermediate_size": 48}
    odd = write_config(tmp_path / "shared", qwen2)
    assert refusal(odd) == (f"init_from={odd}: shared_expert_intermediate_size=48 in config.json is not a positive "
                            f"multiple of moe_intermediate_size=32 (mlplat's shared expert is model.moe.shared_experts "
                            f"experts wide)")
    first = load_checked_model(write_config(tmp_path / "first", qwen2, shared_expert_intermediate_size=64,
                                            mlp_only_layers=[0, 1], qkv_bias=False))
    assert (first.moe.dense_layers, first.moe.shared_experts, first.moe.shared_gate, first.qkv_bias,
            first.moe.norm_topk_prob) == (2, 2, True, False, True)


def test_the_released_qwen3_shapes_import_as_their_configs(tmp_path):
    """Qwen3-30B-A3B's config.json (heads of 128 at hidden 2048) sets the model conf/model/qwen3_30b_a3b.yaml
    describes; a dense Qwen3 without head_dim has transformers' 128; a head_dim of hidden/heads imports as null."""
    from mlplat.config import from_dict
    from mlplat.plan import load_group

    big = load_checked_model(write_config(tmp_path / "a3b", QWEN3_30B_A3B))
    conf = from_dict({"model": load_group("model", "qwen3_30b_a3b")}).model
    assert big.weights() == conf.weights() and big.head_dim == 128 and big.attention_width == 4096
    assert [getattr(big.moe, k) == getattr(conf.moe, k) for k in ("num_experts", "top_k", "ffn_hidden",
                                                                    "norm_topk_prob")] == [True] * 4
    qwen3 = load_checked_model(write_config(tmp_path / "qwen3", QWEN3_MOE_CONFIG, architectures=["Qwen3ForCausalLM"],
                                            model_type="qwen3", head_dim="absent"))
    assert (qwen3.head_dim, qwen3.attention_width) == (128, 512)
    assert load_checked_model(write_config(tmp_path / "d16", QWEN3_MOE_CONFIG)).head_dim is None


def load_checked_model(path):
    from mlplat.train import load_checked

    return load_checked({"init_from": str(path), "logger": {"name": "none"}, "parallel": dict(tp=1, pp=1, dp=1)},
                        check_data=False).model


def test_export_names_the_class_and_what_it_lacks():
    from mlplat.checkpoint.hf_config import hf_class, not_moe_class

    moe = dict(num_experts=4, top_k=2, ffn_hidden=32)
    llama = dict(arch="llama", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=96)
    assert hf_class(dict(llama, qk_norm=True)) == ("qwen3", "Qwen3ForCausalLM")
    assert hf_class(dict(llama, qk_norm=True, qkv_bias=True)) is None
    assert hf_class(dict(llama, qk_norm=True, head_dim=32)) == ("qwen3", "Qwen3ForCausalLM")
    # GPT-2's and GPT-NeoX's heads are hidden/heads wide
    gpt = dict(llama, arch="gpt", n_kv_heads=None, ffn_hidden=None)
    assert hf_class(gpt) == ("gpt2", "GPT2LMHeadModel") and hf_class(dict(gpt, head_dim=32)) is None
    assert hf_class(dict(gpt, position="rope", head_dim=32)) is None
    assert hf_class(dict(llama, qk_norm=True, moe=dict(moe, dense_layers=1))) == ("qwen3_moe", "Qwen3MoeForCausalLM")
    assert hf_class(dict(llama, qkv_bias=True, moe=dict(moe, shared_experts=1, shared_gate=True))) == \
        ("qwen2_moe", "Qwen2MoeForCausalLM")
    for model, why in [(dict(llama, qk_norm=True, moe=dict(moe, shared_experts=1, shared_gate=True)),
                        "model.moe.shared_experts=1 (Qwen3-MoE has no shared experts)"),
                       (dict(llama, qk_norm=True, qkv_bias=True, moe=moe),
                        "model.qkv_bias=true (Qwen3-MoE's q, k and v projections have no biases)"),
                       (dict(llama, moe=dict(moe, shared_experts=1)),
                        "model.moe.shared_gate=false (Qwen2-MoE gates its shared expert with a sigmoid)"),
                       (dict(llama, qk_norm=True, moe=dict(moe, routed_scaling_factor=2.5)),
                        "model.moe.routed_scaling_factor=2.5 (Qwen3-MoE does not scale its gates)"),
                       # a sigmoid router is GLM-4.5's (tests/checkpoint/test_hf_glm.py)
                       (dict(llama, qk_norm=True, moe=dict(moe, router="sigmoid")),
                        "model.moe.shared_experts=0 (GLM-4.5 has at least one shared expert)")]:
        assert hf_class(model) is None and not_moe_class(model) == why
