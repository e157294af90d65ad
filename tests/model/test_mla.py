"""Multi-head latent attention (model.attention=mla, mlplat.model.mla): the runtime equals transformers'
DeepseekV3Attention with the same weights in float64 (with and without query compression, with YaRN and its mscale),
YaRN's tables equal transformers', the config refuses what MLA cannot take in one line each, and the closed-form
parameter count equals the built model's."""
from __future__ import annotations

import pytest
import torch

from mlplat.config import ConfigError, KernelsConfig, load_config
from mlplat.model.decoder import build_rank_chunks, parameter_count
from mlplat.model.rotary import Rotary, attention_factor, inverse_frequencies, softmax_factor
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.parallel.random import RNGTracker, seed_model_parallel
from mlplat.perf.flops import ModelDims, stage_parameters
from mlplat.perf.flops import parameter_count as closed_form_count

transformers = pytest.importorskip("transformers")

F64 = torch.float64
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10)
MODEL = dict(arch="llama", n_layers=2, hidden=32, n_heads=4, seq_len=16, vocab_size=64, attention="mla", mla=MLA)
YARN = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=4, beta_fast=8, beta_slow=1, mscale=0.8,
            mscale_all_dim=0.6)


def _cfg(**model):
    return load_config({"model": {**MODEL, **model}, "kernels": {"attention": "math"},
                        "trainer": {"precision": "64-true"}}, check_data=False)


def _hf_config(cfg, scaling=None):
    m, mla = cfg.model, cfg.model.mla
    rope = {"rope_type": "default", "rope_theta": m.rope_theta} if scaling is None else \
        {**{k: v for k, v in scaling.items() if k != "rope_type"}, "rope_type": "yarn", "rope_theta": m.rope_theta}
    config = transformers.DeepseekV3Config(
        hidden_size=m.hidden, num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads,
        q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim, rope_interleave=False,
        rms_norm_eps=m.norm_eps, attention_bias=False, max_position_embeddings=m.seq_len * 4, rope_parameters=rope)
    config._attn_implementation = "sdpa"  # eager takes its softmax in float32; sdpa stays in float64
    return config


# mlplat's module -> transformers' (the names the Hugging Face import maps)
HF_NAMES = {"q_down": "q_a_proj", "q_norm": "q_a_layernorm", "q_up": "q_b_proj", "q": "q_proj",
            "kv_down": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "kv_up": "kv_b_proj", "out": "o_proj"}


@pytest.mark.parametrize("q_lora, scaling", [(24, None), (None, None), (24, YARN)], ids=["v3", "v2-lite", "yarn"])
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_mla_equals_transformers_deepseek_v3_attention(q_lora, scaling, backend, monkeypatch):
    """transformers' latent norms take eps 1e-6 whatever rms_norm_eps (DeepSeek's too: model.norm_eps matches it for
    DeepSeek-V2/V3) and compute in float32: patched to the input's dtype, as mlplat's, for a float64 comparison."""
    cfg = _cfg(mla=dict(MLA, q_lora_rank=q_lora), rope_scaling=scaling, norm_eps=1e-6)
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_deepseek_v3.DeepseekV3RMSNorm, "forward", forward)

    torch.manual_seed(0)
    hf_config = _hf_config(cfg, scaling)
    theirs = DeepseekV3Attention(hf_config, 0).to(F64)
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)
    tracker = RNGTracker()
    seed_model_parallel(0, ParallelGrid(), tracker)
    chunk = build_rank_chunks(cfg.model, ParallelGrid(), PipelineLayout(1), kernels=KernelsConfig(attention=backend),
                              tracker=tracker, backend=backend, dtype=F64)[0]
    ours = chunk.layers["0"].attn
    with torch.no_grad():
        for name, module in ours.named_children():
            for pname, p in module.named_parameters():
                p.copy_(getattr(getattr(theirs, HF_NAMES[name]), pname))
    x = torch.randn(2, cfg.model.seq_len, cfg.model.hidden, dtype=F64)
    positions = torch.arange(cfg.model.seq_len)[None]
    cos_sin = DeepseekV3RotaryEmbedding(hf_config)(x, positions)
    expected = theirs(x, cos_sin, None)[0]  # sdpa: causal without a mask
    got = ours(x)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # the gradients flow to every module
    got.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ours.parameters())


def test_yarn_tables_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    v3 = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
              mscale=1.0, mscale_all_dim=1.0)
    for scaling, dim in ((v3, 64), (YARN, 6), (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
                                                 16)):
        config = transformers.DeepseekV3Config(
            hidden_size=128, num_attention_heads=4, qk_rope_head_dim=dim,
            max_position_embeddings=int(scaling["factor"] * scaling["original_max_position_embeddings"]),
            rope_parameters={**scaling, "rope_theta": 10000.0})
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
        assert torch.equal(inverse_frequencies(dim, 10000.0, scaling), inv)
        assert attention_factor(scaling) == factor
        assert softmax_factor(scaling) * 0.125 == pytest.approx(yarn_apply_mscale(config.rope_parameters, 0.125),
                                                                rel=1e-15)
    # cos and sin carry the attention factor, computed in float32 as transformers does
    rotary = Rotary(6, 10000.0, YARN)
    cos, _ = rotary.tables(8, torch.device("cpu"), F64)
    angles = torch.arange(8, dtype=torch.float32)[:, None] * inverse_frequencies(6, 10000.0, YARN)[None]
    assert torch.equal(cos, (torch.cat((angles, angles), -1).cos() * attention_factor(YARN)).to(F64))


REFUSED = {
    "learned": (dict(arch="gpt"), "model.attention=mla needs model.position=rope"),
    "kv-heads": (dict(n_kv_heads=2), "model.n_kv_heads=2 must be null under model.attention=mla"),
    "head-dim": (dict(head_dim=16), "model.head_dim=16 must be null under model.attention=mla"),
    "odd-rope": (dict(mla=dict(MLA, qk_rope_head_dim=5)), "model.mla.qk_rope_head_dim=5 must be even"),
    "zero-rank": (dict(mla=dict(MLA, kv_lora_rank=0)), "model.mla.kv_lora_rank=0 must be a positive integer"),
    "q-rank": (dict(mla=dict(MLA, q_lora_rank=0)), "model.mla.q_lora_rank=0 must be a positive integer"),
    "unknown": (dict(mla=dict(MLA, rank=3)), "model.mla.rank is not a known key"),
    "yarn-key": (dict(rope_scaling=dict(YARN, low_freq_factor=1)),
                 "model.rope_scaling.low_freq_factor is not a known key of rope_type=yarn"),
    "yarn-factor": (dict(rope_scaling=dict(YARN, factor=-1)), "model.rope_scaling.factor=-1 must be a positive number"),
    "rope-type": (dict(rope_scaling=dict(type="ntk", factor=2)), "model.rope_scaling.rope_type='ntk' is not supported"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_mla_config_refusals_are_one_line(case):
    model, message = REFUSED[case]
    with pytest.raises(ConfigError) as info:
        _cfg(**model)
    assert "\n" not in str(info.value) and message in str(info.value), str(info.value)


def test_flash_is_refused_for_unequal_head_sizes_and_auto_falls_back():
    from mlplat.model.attention import resolve_backend

    with pytest.raises(ValueError, match="^kernels.attention=flash cannot run: flash-attn 2's kernels take one head "
                                         "size for q, k and v, and the model's are 14 \\(q, k\\) and 10 \\(v\\)"):
        resolve_backend("flash", "cuda", "bf16-mixed", 1, 14, 10)
    assert resolve_backend("auto", "cuda", "bf16-mixed", 1, 14, 10) == "sdpa"


@pytest.mark.parametrize("q_lora", [24, None])
@pytest.mark.parametrize("tp", [1, 2])
def test_closed_form_parameter_count_equals_the_built_model(q_lora, tp):
    cfg = _cfg(mla=dict(MLA, q_lora_rank=q_lora))
    dims = ModelDims.of(cfg.model)
    built = 0
    for rank in range(tp):
        grid = ParallelGrid(tp=tp, rank=rank, virtual=True)
        chunks = build_rank_chunks(cfg.model, grid, PipelineLayout(1), dtype=F64, device="meta")
        built += parameter_count(list(chunks.values()))
    h, a, m = 32, 4, cfg.model.mla
    d = m.qk_nope_head_dim + m.qk_rope_head_dim
    attention = (((h * q_lora + q_lora + q_lora * a * d) if q_lora else h * a * d)
                 + h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
                 + m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim) + a * m.v_head_dim * h)
    assert dims.attention_gemm_weights + (q_lora or 0) + m.kv_lora_rank == attention
    assert closed_form_count(dims) == parameter_count(list(build_rank_chunks(
        cfg.model, ParallelGrid(), PipelineLayout(1), dtype=F64, device="meta").values()))
    # at tp: each rank's count (the replicated down-projections and norms on every rank)
    assert sum(stage_parameters(dims, tp, PipelineLayout(1))) * tp == built


def test_blockwise_fp8_checks_the_latent_attentions_split_widths():
    raw = {"model": {**MODEL, "hidden": 128, "mla": dict(MLA, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                                         q_lora_rank=64, kv_lora_rank=32)},
           "parallel": {"tp": 2}, "kernels": {"fp8": "blockwise"}, "trainer": {"precision": "bf16-megatron"}}
    with pytest.raises(ConfigError, match="^kernels.fp8=blockwise needs whole 128-blocks on each rank: "
                                          "model.attention=mla's q_up output=192 split by parallel.tp=2 is not a "
                                          "multiple of 128·2$"):
        load_config(raw, check_data=False)


def test_dry_run_charges_deepseek_v3s_attention_and_says_why_not_flash_attn():
    """DeepSeek-V3's attention shapes (h 7168, 128 heads, q latent 1536, kv latent 512, q/k 128+64, v 128): its GEMMs'
    weights and core FLOPs as the paper's shapes give them, the ring's latent bytes, and the dry run's layout line
    stating that SDPA runs it."""
    from mlplat.perf.dry_run import format_plan, plan
    from mlplat.perf.memory import Layout, kv_block_bytes

    v3 = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    dims = ModelDims(2, 7168, 128, 4096, 1024, arch="llama", attention="mla", mla=v3)
    assert dims.attention_gemm_weights == (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256
                                           + 128 * 128 * 7168)  # 187,105,280: DeepSeek-V3's per layer
    assert dims.score_flops == 2 * 128 * 192 + 2 * 128 * 128
    for t in (1, 8):  # the ring carries the latents: 576 elements per token at every t
        lay = Layout(tp=t, cp=2, micro_batch_size=1, precision="bf16-megatron")
        assert kv_block_bytes(dims, lay) == 2 * 2048 * (512 + 64)
    import yaml

    from tests.helpers.paths import REPO

    cluster = yaml.safe_load((REPO / "conf" / "cluster" / "dgx_h100.yaml").read_text())
    cfg = load_config({"model": dict(MODEL, n_layers=4), "parallel": {"tp": 2, "cp": 2}, "cluster": cluster,
                       "trainer": {"precision": "bf16-mixed", "accelerator": "gpu"}}, check_data=False)
    text = format_plan(plan(cfg, use_meta=False))
    assert "attention=flash (SDPA's kernels: flash-attn 2 takes one head size for q, k and v" in text
    assert "K/V block [8, 8, 16+6] (latent)" in text


@pytest.mark.parametrize("q_lora", [24, None])
def test_selective_recomputation_keeps_only_the_latents(q_lora):
    """kernels.recompute=selective recomputes the up-projections with the core: an MLA layer's forward saves for
    backward exactly what the memory model counts (`latent_kept_selective`: the latents and the output projection's
    input), against more without recomputation."""
    from mlplat.specs.attentions import latent_kept, latent_kept_selective

    b, s, h = 2, 16, 32
    units = {}
    for recompute in ("none", "selective"):
        cfg = _cfg(mla=dict(MLA, q_lora_rank=q_lora), n_layers=1)
        tracker = RNGTracker()
        seed_model_parallel(0, ParallelGrid(), tracker)
        chunk = build_rank_chunks(cfg.model, ParallelGrid(), PipelineLayout(1), kernels=KernelsConfig(
            attention="sdpa", recompute=recompute), tracker=tracker, backend="sdpa", dtype=F64)[0].train()
        weights = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
        x = torch.randn(b, s, h, dtype=F64, requires_grad=True)
        saved = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights and ptr != x.untyped_storage().data_ptr():  # the input: the layer norm's
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            chunk.layers["0"].attn(x)
        units[recompute] = sum(saved.values()) / (s * b * h) / 4  # float64: 4 times the 2-byte units
    assert units["selective"] == latent_kept_selective(cfg.model, 1)
    assert units["none"] > 2 * units["selective"] and latent_kept(cfg.model, 1) > 2 * units["selective"]
