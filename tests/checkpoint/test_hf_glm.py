"""Hugging Face interop for GLM-4.5 (`Glm4MoeForCausalLM`): `init_from` a transformers directory alone, `export
--format hf` back as the same class.

The random float64 model has GLM-4.5's whole architecture, scaled down: heads of 32 at hidden 64 (`model.head_dim`),
the rotation on the first half of each head (partial_rotary_factor 0.5: `model.rotary_dim` 16), q, k and v biases
(attention_bias; none on o_proj), q/k norms (use_qk_norm), a dense first layer (first_k_dense_replace 1), then 8
experts in 4 groups, 2 per token from the 2 best groups, by sigmoid scores with a random correction bias
(e_score_correction_bias: `model.moe.expert_bias`), renormalised and scaled by 2.5, and one ungated shared expert;
and one multi-token prediction layer (num_nextn_predict_layers 1), stored as GLM-4.5's release stores it: layer
num_hidden_layers (an MoE layer of the model's kind) with enorm, hnorm, eh_proj, shared_head.norm and copies of the
embedding and the output layer, which transformers' class does not load. One 4-rank group (tp2·pp2, interleaved
v=2) imports it twice, with expert parallelism folded onto the tp ranks (`parallel.ep=2`, each rank four of the
eight experts whole) and with each expert's width split over tp: its logits and greedy text, which the parent
compares with transformers', and a checkpoint (the multi-token prediction module with it), which the parent exports
and compares tensor by tensor with the original directory; and once more as cp2·tp2 (the ring attention over the
load-balanced split), for its logits.

transformers computes in float32 whatever the model's dtype in four places, which a float64 comparison must avoid:
its RMSNorms, its router (logits, scores), and it loads the router's weight and correction bias in float32
(`_keep_in_fp32_modules_strict`). The reference is transformers' own code with its module's `torch.float32` read as
float64 (`float64_router_and_norms`; its rotary tables stay float32, as mlplat's), the router's weight and bias
put back from the file in float64, the attention SDPA and the experts one matmul each.
"""
from __future__ import annotations

import json
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
from tests.helpers.dist import run_distributed

NEW_TOKENS = 10
GLM = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
           n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
           attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=1, vocab_size=VOCAB,
           max_position_embeddings=SEQ, rms_norm_eps=1e-6, tie_word_embeddings=False,
           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
           bos_token_id=1, eos_token_id=2, pad_token_id=None)
ROUTER_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # what transformers loads in float32
MTP_LAYER = "model.layers.4."  # the multi-token prediction layer: layer num_hidden_layers
MTP_OWN = {"mtp.0.enorm.weight": "enorm.weight", "mtp.0.hnorm.weight": "hnorm.weight",
           "mtp.0.proj.weight": "eh_proj.weight", "mtp.0.norm.weight": "shared_head.norm.weight"}


def glm_dir(path: Path, seed: int, std: float = 0.2) -> Path:
    """A random float64 Glm4MoeForCausalLM saved with save_pretrained: every parameter perturbed, the router sharply
    (tokens choose different experts), the correction biases drawn at the sigmoid scores' scale (they change
    choices); plus a random multi-token prediction layer: a fifth layer's modules (an MoE layer), enorm, hnorm,
    eh_proj, shared_head.norm, and copies of the embedding (embed_tokens) and the output layer (shared_head.head)."""
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**dict(GLM, num_hidden_layers=5))).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((1.0 if name.endswith("mlp.gate.weight") else std) * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(str(path))  # (its saved names: the Hub's, per expert)
    Glm4MoeConfig(**GLM, architectures=["Glm4MoeForCausalLM"], dtype="float64").save_pretrained(str(path))
    saved = load_file(str(path / "model.safetensors"))
    h = GLM["hidden_size"]
    g = torch.Generator().manual_seed(seed + 1)
    saved.update({f"{MTP_LAYER}{name}": 1 + std * torch.randn(h, generator=g, dtype=torch.float64)
                  for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
    saved.update({f"{MTP_LAYER}eh_proj.weight": std * torch.randn(h, 2 * h, generator=g, dtype=torch.float64),
                  f"{MTP_LAYER}shared_head.head.weight": saved["lm_head.weight"].clone(),
                  f"{MTP_LAYER}embed_tokens.weight": saved["model.embed_tokens.weight"].clone()})
    save_file(saved, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


class _Float32AsFloat64:
    """A stand-in for the `torch` module of transformers' modeling_glm4_moe whose float32 is float64; all else is
    torch's."""

    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@pytest.fixture
def float64_router_and_norms(monkeypatch):
    from transformers.models.glm4_moe import modeling_glm4_moe

    monkeypatch.setattr(modeling_glm4_moe, "torch", _Float32AsFloat64())


_MODELS: dict[str, object] = {}


def hf_model(path, **config):
    """transformers' loading of `path` (SDPA, experts one matmul each; `config`: overrides of config.json), the
    router's weight and correction bias put back in the file's float64; once per path and overrides."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    key = f"{path}{sorted(config.items())}"
    if key not in _MODELS:
        model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa",
                                                     experts_implementation="eager", **config).eval()
        saved = load_file(str(Path(path) / "model.safetensors"))
        with torch.no_grad():
            for name, t in model.named_parameters(recurse=True):
                if name.endswith(ROUTER_FP32):
                    t.data = saved[name].clone()
            for name, t in model.named_buffers():
                if name.endswith(ROUTER_FP32):
                    module = model.get_submodule(name.rpartition(".")[0])
                    setattr(module, name.rpartition(".")[2], saved[name].clone())
        _MODELS[key] = model
    return _MODELS[key]


def reference_logits(path, tokens) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(tokens).logits


def _interop(rank, world_size, path, ckpt, tokens):
    """tp2·pp2 (v=2): the directory imported with ep2 (logits, greedy text, a checkpoint) and with the experts split
    over tp (logits); cp2·tp2 (logits)."""
    from mlplat.checkpoint import io
    from mlplat.lightning.strategy import checkpoint_layout
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.step.decode import generate

    torch.set_num_threads(1)
    grid = ParallelGrid(2, 2, 1, ep=2)
    imported = build(import_cfg(path, 2, 2, 2, ep=2), grid, torch.float64)
    out = {"ep2": pipeline_logits(imported, grid, tokens), "generated": generate(imported, PROMPT, NEW_TOKENS)}
    io.save(ckpt, imported.chunks, None, grid, {"global_step": 0}, checkpoint_layout(imported.cfg, 1))
    grid = ParallelGrid(2, 2, 1)
    out["etp2"] = pipeline_logits(build(import_cfg(path, 2, 2, 2), grid, torch.float64), grid, tokens)
    grid = ParallelGrid(2, 1, 1, cp=2)  # cp2·tp2, the experts split over tp: the ring on each rank's key/value head
    out["cp2"] = pipeline_logits(build(import_cfg(path, 2, cp=2), grid, torch.float64), grid, tokens)
    return out


@pytest.fixture(scope="module")
def interop(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_glm")
    path = glm_dir(root / "glm", seed=3)
    tokens = tokens_for_test()
    results = run_distributed(_interop, 4, str(path), str(root / "ckpt"), tokens, timeout=300)
    return {"root": root, "path": path, "tokens": tokens, "results": results}


def _last(interop, key, ranks=2) -> list:
    last = [r[key] for r in interop["results"] if r[key] is not None]
    assert len(last) == ranks  # the last stage's ranks
    return last


# ------------------------------------------------------------------------------------------------ import

@needs_hf
def test_import_matches_transformers_in_one_process_under_tp2_pp2_with_ep2_and_etp2_and_under_cp2(
        interop, float64_router_and_norms):
    from mlplat.parallel.grid import ParallelGrid

    path, tokens = interop["path"], interop["tokens"]
    ref = reference_logits(path, tokens)
    assert ref.dtype == torch.float64
    cfg = import_cfg(path)
    m = cfg.model
    assert (m.arch, m.n_layers, m.hidden, m.n_heads, m.kv_heads, m.head_dim, m.rotary_dim, m.qkv_bias, m.bias,
            m.qk_norm, m.vocab_size, m.seq_len, m.tie_embeddings, m.rope_theta) == \
        ("llama", 4, 64, 4, 2, 32, 16, True, False, True, VOCAB, SEQ, False, 1e6)
    moe = m.moe
    assert (moe.num_experts, moe.top_k, moe.ffn_hidden, moe.router, moe.norm_topk_prob, moe.routed_scaling_factor,
            moe.n_groups, moe.topk_groups, moe.expert_bias, moe.bias_update_rate, moe.shared_experts,
            moe.shared_gate, moe.dense_layers) == (8, 2, 32, "sigmoid", True, 2.5, 4, 2, True, 0.0, 1, False, 1)
    grid = ParallelGrid()
    ours = pipeline_logits(build(cfg, grid, torch.float64), grid, tokens)
    assert rel_err(ours, ref) <= REL
    for r in _last(interop, "ep2") + _last(interop, "etp2") + _last(interop, "cp2", ranks=4):
        assert rel_err(r, ref) <= REL


@needs_hf
def test_unpatched_transformers_differs_only_by_its_float32_router_and_norms(interop):
    """The reference's patches change only float32 rounding: transformers as it is agrees to float32's precision."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(interop["path"]), attn_implementation="sdpa",
                                                 experts_implementation="eager").eval()
    with torch.no_grad():
        ref = model(interop["tokens"]).logits
    assert 0 < rel_err(_last(interop, "ep2")[0], ref) <= 1e-4


@needs_hf
@pytest.mark.parametrize("mutation", ["no correction bias", "whole-head rotary", "no routed scaling"])
def test_a_wrong_mapping_is_caught(interop, mutation, float64_router_and_norms, monkeypatch):
    """The comparison above can fail: the correction bias left at 0, the rotation over the whole head, the gates
    unscaled each move the logits far from transformers'."""
    from mlplat.checkpoint import hf
    from mlplat.parallel.grid import ParallelGrid

    path, tokens = interop["path"], interop["tokens"]
    cfg = import_cfg(path)
    if mutation == "no correction bias":
        monkeypatch.setattr(hf.HFWeights, "read_whole", lambda self, full, shape: torch.zeros(shape))
    elif mutation == "whole-head rotary":
        cfg.model.rotary_dim = None
    else:
        cfg.model.moe.routed_scaling_factor = 1.0
    grid = ParallelGrid()
    ours = pipeline_logits(build(cfg, grid, torch.float64), grid, tokens)
    assert rel_err(ours, reference_logits(path, tokens)) > 1e-3


@needs_hf
def test_greedy_generation_through_the_pipeline_matches_transformers(interop, float64_router_and_norms):
    assert_greedy_text_matches(hf_model(interop["path"]), interop["results"], new_tokens=NEW_TOKENS)


@needs_hf
def test_each_tensor_parallel_rank_reads_only_its_shard(interop, monkeypatch):
    """tp=2: each rank reads its heads of q, k, v (and their biases), 16 of each expert's 32 units, 16 of the shared
    expert's 32, its half of the dense layer's units; or, under ep2, four of the eight experts whole; the
    multi-token prediction layer's alike."""
    assert_each_rank_reads_only_its_shard(interop["path"], monkeypatch, {
        "layers.1.mlp.experts.fc1.weight", "layers.1.mlp.experts.fc2.weight", "layers.1.mlp.shared.fc1.weight",
        "layers.1.mlp.shared.fc2.weight", "layers.0.mlp.fc1.weight", "layers.0.attn.qkv.weight",
        "layers.0.attn.qkv.bias", "mtp.0.layer.attn.qkv.weight", "mtp.0.layer.mlp.experts.fc2.weight"})
    assert_each_rank_reads_only_its_shard(interop["path"], monkeypatch, {
        "layers.1.mlp.experts.fc1.weight", "layers.1.mlp.experts.fc2.weight", "mtp.0.layer.mlp.experts.fc1.weight"},
        ep=2)


@needs_hf
def test_closed_form_parameter_count_equals_transformers(interop):
    """The dry run's count is transformers' (without the multi-token prediction layer, which transformers' class
    does not build)."""
    from dataclasses import replace

    from mlplat.config import MTPConfig
    from mlplat.perf.flops import ModelDims, parameter_count

    dims = ModelDims.of(replace(import_cfg(interop["path"]).model, mtp=MTPConfig()))
    assert parameter_count(dims, 1, padded=False) == sum(p.numel() for p in hf_model(interop["path"]).parameters())


# ------------------------------------------------------------------------------------------ multi-token prediction

def _chunk(path):
    """The one chunk of `path` imported in one process, in float64."""
    from mlplat.parallel.grid import ParallelGrid

    (chunk,) = build(import_cfg(path), ParallelGrid(), torch.float64).chunks.values()
    return chunk


@needs_hf
def test_every_mtp_tensor_is_read_into_its_parameter(interop, tmp_path):
    """init_from sets model.mtp.depth to the directory's one layer and reads it: enorm, hnorm, eh_proj and
    shared_head.norm into mtp.0's own modules as they are, and the layer's attention, router, correction bias,
    experts and shared expert into mtp.0.layer as a main layer's are read: tensor by tensor equal to layer 4 of the
    same tensors read as a five-layer model's (whose layers' reading the logits above prove). Every parameter of
    the module is one of these; the copies of the embedding and output layer are not read (the model's own are)."""
    from safetensors.torch import load_file, save_file

    from mlplat.model.moe import expert_biases

    path = interop["path"]
    saved = load_file(str(path / "model.safetensors"))
    five = tmp_path / "five"
    five.mkdir()
    config = json.loads((path / "config.json").read_text())
    (five / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=5, num_nextn_predict_layers=0)))
    own = {MTP_LAYER + name for name in (*MTP_OWN.values(), "shared_head.head.weight", "embed_tokens.weight")}
    save_file({k: v for k, v in saved.items() if k not in own}, str(five / "model.safetensors"))
    cfg = import_cfg(path)
    assert (cfg.model.n_layers, cfg.model.mtp.depth, cfg.model.mtp.loss_coeff) == (4, 1, 0.3)
    chunk, ref = _chunk(path), _chunk(five)
    ours = {chunk.full_name(n): p for n, p in chunk.named_parameters()}
    theirs = {ref.full_name(n): p for n, p in ref.named_parameters()}
    layer = [n for n in ours if n.startswith("mtp.0.layer.")]
    assert {n for n in ours if n.startswith("mtp.")} == {*layer, *MTP_OWN}
    assert {"mtp.0.layer.mlp.experts.fc1.weight", "mtp.0.layer.mlp.shared.fc1.weight", "mtp.0.layer.attn.qkv.bias",
            "mtp.0.layer.attn.q_norm.weight", "mtp.0.layer.mlp.router.weight"} <= set(layer)
    for name in layer:
        assert torch.equal(ours[name], theirs["layers.4." + name.removeprefix("mtp.0.layer.")]), name
    for name, hf in MTP_OWN.items():
        assert torch.equal(ours[name], saved[MTP_LAYER + hf]), name
    bias = expert_biases([chunk])["mtp.0.layer.mlp.expert_bias"]
    assert torch.equal(bias, saved[f"{MTP_LAYER}mlp.gate.e_score_correction_bias"])
    assert torch.equal(bias, expert_biases([ref])["layers.4.mlp.expert_bias"])


@needs_hf
def test_the_mtp_module_computes_glm_4_5_mtp_forward_as_transformers(interop, float64_router_and_norms):
    """In float64, mlplat's module on the main model's last hidden state h_i (before the final norm) and the token
    one ahead t_{i+1}, then its norm, equals transformers' MtpModel built on the same tensors (GLM-4.5's layer as
    SGLang's and vLLM's readers compute it: eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]), the MoE decoder layer with
    its partial rotary, q/k norms and biases, shared_head.norm), every position; and mlplat's depth-1 loss is the
    cross-entropy of transformers' MTP logits (the shared lm_head) against t_{i+2}. The comparison can fail:
    enorm and hnorm swapped moves the hidden states far."""
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpModel

    path = interop["path"]
    window = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(13))
    x, y = window[:, :-1], window[:, 1:]
    main, saved = hf_model(path), load_file(str(path / "model.safetensors"))
    mtp = MtpModel(main, 1).to(torch.float64).eval()
    layer = mtp.layers[0]
    with torch.no_grad():  # layer 4 as transformers reads a main layer, and the module's own tensors
        layer.mtp_block.load_state_dict(hf_model(path, num_hidden_layers=5).model.layers[4].state_dict())
        for module, name in ((layer.enorm, "enorm"), (layer.hnorm, "hnorm"), (layer.eh_proj, "eh_proj"),
                             (layer.post_norm, "shared_head.norm")):
            module.weight.copy_(saved[f"{MTP_LAYER}{name}.weight"])
        hidden = []
        handle = main.model.norm.register_forward_pre_hook(lambda module, args: hidden.append(args[0]))
        main(x)
        handle.remove()
        positions = torch.arange(SEQ).expand(2, SEQ)
        theirs = mtp.forward_layer(0, hidden[0], positions, None, input_ids=y)
        loss = F.cross_entropy(main.lm_head(theirs)[:, :-1].flatten(0, 1), y[:, 1:].flatten())

    chunk = _chunk(path)
    ours = []
    chunk.mtp[0].norm.register_forward_hook(lambda module, args, out: ours.append(out))
    with torch.no_grad():
        chunk(x, y)
    assert rel_err(ours[0], theirs) <= REL
    assert abs(chunk.mtp.loss_sum[0].item() - loss.item()) <= REL * loss.item()
    with torch.no_grad():  # enorm and hnorm exchanged
        enorm = chunk.mtp[0].enorm.weight.clone()
        chunk.mtp[0].enorm.weight.copy_(chunk.mtp[0].hnorm.weight)
        chunk.mtp[0].hnorm.weight.copy_(enorm)
        chunk(x, y)
    assert rel_err(ours[1], theirs) > 1e-3


# ------------------------------------------------------------------------------------------------ export

NOT_COMPARED = ("transformers_version", "bos_token_id", "eos_token_id", "_name_or_path")


@needs_hf
def test_round_trip_hf_mlplat_hf_is_bit_identical(interop, float64_router_and_norms):
    """Imported under tp2·pp2·ep2, saved, exported: Glm4MoeForCausalLM with the same config (as transformers reads
    both) and every tensor bit-identical, the correction biases among them; transformers' logits from it are its
    logits from the original, and mlplat's."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path, tokens = interop["path"], interop["tokens"]
    out = export_hf(interop["root"] / "ckpt", interop["root"] / "export")
    before, after = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(before) == sorted(after)
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in after
    for name in before:
        assert before[name].dtype == after[name].dtype == torch.float64, name
        assert torch.equal(before[name], after[name]), name
    theirs, ours = (AutoConfig.from_pretrained(str(d)).to_dict() for d in (path, out))
    assert {k: v for k, v in ours.items() if k not in NOT_COMPARED} == \
        {k: v for k, v in theirs.items() if k not in NOT_COMPARED}
    exported = hf_model(out)
    assert type(exported).__name__ == "Glm4MoeForCausalLM"
    with torch.no_grad():
        logits = exported(tokens).logits
    assert torch.equal(logits, reference_logits(path, tokens))
    assert rel_err(_last(interop, "ep2")[0], logits) <= REL


# ------------------------------------------------------------------------------------------------ configs

GLM_CONFIG = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **{
    k: v for k, v in GLM.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")},
    "hidden_act": "silu", "vocab_size": 256}
# GLM-4.5-Air's config.json on the Hub (its shapes; transformers' Glm4MoeConfig defaults are these)
GLM_4_5_AIR = dict(GLM_CONFIG, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                   num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                   n_routed_experts=128, num_experts_per_tok=8, n_group=1, topk_group=1, n_shared_experts=1,
                   first_k_dense_replace=1, routed_scaling_factor=1.0, use_qk_norm=False, vocab_size=151552,
                   max_position_embeddings=131072, rms_norm_eps=1e-5, num_nextn_predict_layers=1,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5})


def test_the_released_glm_4_5_air_shape_imports_as_its_config(tmp_path):
    """GLM-4.5-Air's config.json sets the model conf/model/glm4_5_air.yaml describes (and its multi-token prediction
    layer); transformers' Glm4MoeConfig defaults are that shape too."""
    from dataclasses import replace

    from mlplat.config import MTPConfig, from_dict
    from mlplat.plan import load_group
    from mlplat.train import load_checked

    air = load_checked({"init_from": str(write_config(tmp_path / "air", GLM_4_5_AIR)), "logger": {"name": "none"},
                        "parallel": dict(tp=1, pp=1, dp=1)}, check_data=False).model
    conf = from_dict({"model": load_group("model", "glm4_5_air")}).model
    assert air.mtp.depth == 1  # its multi-token prediction layer, which the conf leaves out (model.mtp.depth=1 adds)
    assert replace(air, mtp=MTPConfig()).weights() == conf.weights() and air.head_dim == 128 and air.rotary_dim == 64
    for key in ("num_experts", "top_k", "ffn_hidden", "router", "norm_topk_prob", "routed_scaling_factor", "n_groups",
                "topk_groups", "expert_bias", "shared_experts", "shared_gate", "dense_layers"):
        assert getattr(air.moe, key) == getattr(conf.moe, key), key
    assert (air.rope_theta, air.rotary_dim, air.qkv_bias, air.qk_norm) == \
        (conf.rope_theta, conf.rotary_dim, conf.qkv_bias, conf.qk_norm)
    pytest.importorskip("transformers")
    from transformers import Glm4MoeConfig

    defaults = Glm4MoeConfig().to_dict()
    assert {k: defaults[k] for k in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "n_routed_experts",
                                     "num_experts_per_tok", "n_group", "topk_group", "n_shared_experts",
                                     "first_k_dense_replace", "routed_scaling_factor", "vocab_size")} == \
        {k: GLM_4_5_AIR[k] for k in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "n_routed_experts",
                                     "num_experts_per_tok", "n_group", "topk_group", "n_shared_experts",
                                     "first_k_dense_replace", "routed_scaling_factor", "vocab_size")}


def test_mtp_depth_follows_the_layers_the_weights_hold(tmp_path):
    """num_nextn_predict_layers sets model.mtp.depth where the weights hold the layers (transformers' save_pretrained
    keeps the count but drops them: then the depth is 0 and one line says the layers are not read); the loss weight
    stays the config's; a typed depth must agree with the directory."""
    from safetensors.torch import save_file

    from mlplat.checkpoint.hf import unread_mtp_layers
    from mlplat.train import load_checked

    base = {"logger": {"name": "none"}, "parallel": dict(tp=1, pp=1, dp=1)}
    path = write_config(tmp_path / "none", GLM_CONFIG)
    save_file({"model.norm.weight": torch.ones(2)}, str(path / "model.safetensors"))
    m = load_checked({"init_from": str(path), **base}, check_data=False).model
    assert m.mtp.depth == 0
    line = unread_mtp_layers(path, m)
    assert line == (f"num_nextn_predict_layers=1 in {path}/config.json, but the weights hold 0 of those layers "
                    f"(model.layers.4.*): model.mtp.depth=0")
    save_file({f"{MTP_LAYER}eh_proj.weight": torch.ones(2)}, str(path / "model.safetensors"))
    m = load_checked({"init_from": str(path), "model": {"mtp": {"loss_coeff": 0.1}}, **base}, check_data=False).model
    assert (m.mtp.depth, m.mtp.loss_coeff) == (1, 0.1) and unread_mtp_layers(path, m) is None
    assert refusal(path, mtp={"depth": 2}) == (f"model.mtp.depth=2 does not match num_nextn_predict_layers=1 in "
                                               f"init_from={path}/config.json; drop model.mtp.depth (init_from sets "
                                               f"it)")
    none = write_config(tmp_path / "zero", GLM_CONFIG, num_nextn_predict_layers=0)
    assert load_checked({"init_from": str(none), **base}, check_data=False).model.mtp.depth == 0
    assert unread_mtp_layers(none, m) is None
    # the other families' modules are not read: refused rather than trained from scratch beside a trained model
    llama = write_config(tmp_path / "llama")
    assert refusal(llama, mtp={"depth": 1}).startswith(
        f"model.mtp.depth=1 with init_from={llama}: the transformers checkpoints read with multi-token prediction "
        f"modules are DeepSeek-V3's and GLM-4.5's")


def test_what_glm_cannot_express_is_refused_in_one_line(tmp_path):
    from mlplat.checkpoint.hf_config import hf_class, not_moe_class

    good = write_config(tmp_path / "good", GLM_CONFIG)
    cfg = f"in init_from={good}/config.json"
    assert refusal(good, moe={"routed_scaling_factor": 1.0}) == (
        f"model.moe.routed_scaling_factor=1.0 does not match routed_scaling_factor=2.5 {cfg}; drop "
        f"model.moe.routed_scaling_factor (init_from sets it)")
    assert refusal(good, rotary_dim=32) == (f"model.rotary_dim=32 does not match rope_parameters.partial_rotary_factor="
                                            f"0.5 {cfg}; drop model.rotary_dim (init_from sets it)")
    odd = write_config(tmp_path / "odd", GLM_CONFIG, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                      "partial_rotary_factor": 0.3})
    assert refusal(odd) == (f"init_from={odd}: rope_parameters.partial_rotary_factor=0.3 in config.json turns 9 of a "
                            f"head's 32 channels; mlplat's rotation needs an even number, at least 2")
    # the correction bias may move on from the directory's values (aux-loss-free balancing), weighed as typed
    from mlplat.train import load_checked

    tuned = load_checked({"init_from": str(good), "model": {"moe": {"bias_update_rate": 0.001}},
                          "logger": {"name": "none"}, "parallel": dict(tp=1, pp=1, dp=1)}, check_data=False).model
    assert (tuned.moe.bias_update_rate, tuned.moe.expert_bias, tuned.moe.routed_scaling_factor) == (0.001, True, 2.5)
    unshared = write_config(tmp_path / "unshared", GLM_CONFIG, n_shared_experts=0)
    assert refusal(unshared).startswith(f"init_from={unshared}: n_shared_experts=0 in config.json is not supported")
    # Export: a sigmoid router is written as GLM-4.5, which must have what GLM computes
    llama = dict(arch="llama", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=96)
    glm = dict(llama, qkv_bias=True, rotary_dim=8, moe=dict(num_experts=4, top_k=2, ffn_hidden=32, router="sigmoid",
                                                            shared_experts=1, expert_bias=True))
    assert hf_class(glm) == ("glm4_moe", "Glm4MoeForCausalLM")
    assert hf_class(dict(glm, moe=dict(glm["moe"], expert_bias=False, bias_update_rate=0.001))) is not None
    for change, why in [({"expert_bias": False}, "model.moe.expert_bias=false (GLM-4.5 chooses its experts with"),
                        ({"shared_experts": 0}, "model.moe.shared_experts=0 (GLM-4.5 has at least one shared"),
                        ({"shared_gate": True}, "model.moe.shared_gate=true (GLM-4.5's shared experts have no gate"),
                        ({"capacity_factor": 1.0}, "model.moe.capacity_factor=1.0 (GLM-4.5 is dropless"),
                        ({"n_groups": 4, "topk_groups": 2}, "model.moe.n_groups=4 (GLM-4.5 scores a group by its two")]:
        other = dict(glm, moe={**glm["moe"], **change})
        assert hf_class(other) is None and not_moe_class(other).startswith(why), not_moe_class(other)
    # the other classes turn the whole head
    qwen3 = dict(llama, qk_norm=True, rotary_dim=8, moe=dict(num_experts=4, top_k=2, ffn_hidden=32))
    assert hf_class(qwen3) is None and not_moe_class(qwen3) == \
        "model.rotary_dim=8 (Qwen3MoeForCausalLM turns the whole head)"
    assert hf_class(dict(llama, rotary_dim=8)) is None and hf_class(dict(llama, rotary_dim=16)) is not None
    assert json.loads(json.dumps(GLM_CONFIG))  # plain JSON
