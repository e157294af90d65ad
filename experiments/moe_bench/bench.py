"""The mixture-of-experts layer's speed on CPU, side by side with its peers, in one run.

    python experiments/moe_bench/bench.py               # all three parts, ~4 minutes on 2 cores
    python experiments/moe_bench/bench.py --part a      # (a) only; --part c: the latent attention row only

(a) One process, one thread, float32, the same weights and tokens (8 experts, top-2, SwiGLU, h 256, expert width
    512, 2 x 512 tokens), forward and backward, one step of each variant in turn (rotating order, so a slow phase
    of a busy machine hits all of them alike):
      mlplat          `mlplat.model.moe.MoELayer` (tokens sorted by expert, `torch._grouped_mm`);
      hf grouped_mm   transformers' `MixtralSparseMoeBlock` with experts_implementation="grouped_mm";
      hf eager        the same block's default loop over experts;
      dense           a SwiGLU MLP of width k·f: the FLOPs each token's k experts do, with no routing or dispatch.
    Median wall time per step, and ratios: mlplat / each transformers block (≤ 1.0: mlplat no slower), mlplat /
    dense (the routing and dispatch overhead). The outputs of mlplat and the transformers blocks are compared
    (same weights: they must agree to float32 rounding).
(b) Expert parallelism on gloo processes, ep 2 and 4 (ep ranks = processes, each holding E/ep experts and routing
    its own 512 tokens): the all-to-all and all-gather dispatchers, one step of each in turn, forward and backward
    of the layer; the step time is the slowest rank's. Ratio all-to-all / all-gather.
(c) DeepSeek-V3's attention beside it (the block the experts sit behind): mlplat's multi-head latent attention
    (`mlplat.model.mla.LatentAttention`, kernels.attention=sdpa) and transformers' `DeepseekV3Attention`
    (attn_implementation="sdpa") with the same weights, causal, one process, one thread, float32, DeepSeek-V3's
    head shapes at a quarter of its widths (MLA below), forward and backward in turn as in (a). transformers' rotary
    tables are computed once outside the timed step (its model does so once for every layer); mlplat's are cached
    in the layer. Timed in the thread's CPU time (`time.thread_time`: one thread runs the forward and the CPU
    backward, and a busy machine's descheduling does not count in it), median per variant; ratio mlplat /
    transformers; the outputs are compared.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mlplat.config import ModelConfig, MoEConfig  # noqa: E402
from mlplat.harness.launch import launch  # noqa: E402
from mlplat.model.moe import MoELayer  # noqa: E402
from mlplat.parallel.grid import ParallelGrid  # noqa: E402

E, K, H, F_ = 8, 2, 256, 512
TOKENS = (2, 512)  # b, s per rank


def _cfg(dispatcher: str = "alltoall") -> ModelConfig:
    return ModelConfig(arch="llama", mlp="swiglu", hidden=H, n_heads=4,
                       moe=MoEConfig(num_experts=E, top_k=K, ffn_hidden=F_, norm_topk_prob=True,
                                     dispatcher=dispatcher))


def _fill(layer: MoELayer, seed: int = 0) -> None:
    """Weights drawn from the full tensors, so every layout's rank takes its slice of the same values."""
    gen = torch.Generator().manual_seed(seed)
    full = {"router.weight": torch.randn(E, H, generator=gen) * 0.05,
            "experts.fc1.weight": torch.randn(E * 2 * F_, H, generator=gen) * 0.05,
            "experts.fc2.weight": torch.randn(E * H, F_, generator=gen) * 0.05}
    first = layer.first_expert
    n = layer.local_experts
    with torch.no_grad():
        layer.router.weight.copy_(full["router.weight"])
        layer.experts.fc1.weight.copy_(full["experts.fc1.weight"][first * 2 * F_:(first + n) * 2 * F_])
        layer.experts.fc2.weight.copy_(full["experts.fc2.weight"][first * H:(first + n) * H])


def _hf_block(layer: MoELayer, implementation: str):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=H, intermediate_size=F_, num_local_experts=E, num_experts_per_tok=K)
    config._experts_implementation = implementation
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():  # mlplat's experts are transformers' fused tensors, flattened
        block.gate.weight.copy_(layer.router.weight)
        block.experts.gate_up_proj.copy_(layer.experts.fc1.weight.detach().view(E, 2 * F_, H))
        block.experts.down_proj.copy_(layer.experts.fc2.weight.detach().view(E, H, F_))
    return block


class _Dense(torch.nn.Module):
    """A SwiGLU MLP of width K·F_: each token's active FLOPs, without routing."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.fc1 = torch.nn.Parameter(torch.randn(2 * K * F_, H, generator=gen) * 0.05)
        self.fc2 = torch.nn.Parameter(torch.randn(H, K * F_, generator=gen) * 0.05)

    def forward(self, x):
        gate, up = F.linear(x, self.fc1).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.fc2)


def _step(module, x: torch.Tensor, clock=time.perf_counter) -> float:
    start = clock()
    y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    y.square().mean().backward()
    return clock() - start


def part_a(steps: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layer = MoELayer(_cfg(), ParallelGrid())
    _fill(layer)
    variants = {"mlplat": layer, "hf grouped_mm": _hf_block(layer, "grouped_mm"), "hf eager": _hf_block(layer, "eager"),
                "dense": _Dense()}
    x = torch.randn(*TOKENS, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = layer(x)
        for name in ("hf grouped_mm", "hf eager"):
            diff = float((variants[name](x) - ref).abs().max())
            print(f"{name:<15} output vs mlplat: max |diff| {diff:.2e}")
    times = {name: [] for name in variants}
    names = list(variants)
    for i in range(steps + 2):
        for name in names[i % len(names):] + names[:i % len(names)]:
            for p in variants[name].parameters():
                p.grad = None
            t = _step(variants[name], x)
            if i >= 2:  # warm-up
                times[name].append(t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"\n(a) one process, float32, {E} experts top-{K}, h {H}, expert width {F_}, {TOKENS[0]}x{TOKENS[1]} "
          f"tokens, forward+backward, median of {steps} steps")
    print(f"{'variant':<15} {'ms/step':>9} {'mlplat / it':>12}")
    for name in names:
        print(f"{name:<15} {med[name] * 1e3:>9.2f} {med['mlplat'] / med[name]:>12.2f}")


def _ep_worker(rank: int, world: int, steps: int) -> dict:
    torch.set_num_threads(1)
    grid = ParallelGrid(dp=world, ep=world)
    layers = {}
    for dispatcher in ("alltoall", "allgather"):
        layers[dispatcher] = MoELayer(_cfg(dispatcher), grid)
        _fill(layers[dispatcher])
    x = torch.randn(*TOKENS, H, generator=torch.Generator().manual_seed(10 + rank))
    times = {d: [] for d in layers}
    order = list(layers)
    for i in range(steps + 2):
        for d in order[i % 2:] + order[:i % 2]:
            for p in layers[d].parameters():
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            _step(layers[d], x)
            end = time.perf_counter()
            span = torch.tensor([start, end], dtype=torch.float64)
            spans = [torch.zeros_like(span) for _ in range(world)]
            dist.all_gather(spans, span)
            if i >= 2:
                times[d].append(max(float(s[1]) for s in spans) - min(float(s[0]) for s in spans))
    return {d: statistics.median(ts) for d, ts in times.items()}


def part_b(steps: int) -> None:
    print(f"\n(b) expert parallelism on gloo processes, {E} experts top-{K}, {TOKENS[0]}x{TOKENS[1]} tokens per rank, "
          f"forward+backward, the slowest rank, median of {steps} steps")
    print(f"{'ep':>3} {'alltoall ms':>12} {'allgather ms':>13} {'alltoall / allgather':>21}")
    for ep in (2, 4):
        res = launch(_ep_worker, ep, steps, timeout=600)[0]
        print(f"{ep:>3} {res['alltoall'] * 1e3:>12.2f} {res['allgather'] * 1e3:>13.2f} "
              f"{res['alltoall'] / res['allgather']:>21.2f}")


# (c): DeepSeek-V3's latent attention at a quarter of its widths: h 7168 -> 512 (16 heads instead of 128), query
# latent 1536 -> 384, key/value latent 512 -> 128, heads of 128 + 64 rotary channels -> 32 + 16, values 128 -> 32
MLA = dict(q_lora_rank=384, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
MLA_H, MLA_HEADS = 512, 16


def _mla_pair():
    """(mlplat's LatentAttention, transformers' DeepseekV3Attention, its rotary tables for the sequence) with the
    same weights, float32."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from mlplat.config import KernelsConfig, MLAConfig
    from mlplat.model.decoder import build_rank_chunks
    from mlplat.parallel.layout.pipeline import PipelineLayout
    from mlplat.parallel.random import RNGTracker, seed_model_parallel

    s = TOKENS[1]
    cfg = ModelConfig(arch="llama", n_layers=1, hidden=MLA_H, n_heads=MLA_HEADS, seq_len=s, vocab_size=128,
                      attention="mla", mla=MLAConfig(**MLA), norm_eps=1e-6)
    config = DeepseekV3Config(hidden_size=MLA_H, num_attention_heads=MLA_HEADS, num_key_value_heads=MLA_HEADS,
                              rope_interleave=False, rms_norm_eps=1e-6, attention_bias=False,
                              max_position_embeddings=s, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": cfg.rope_theta}, **MLA)
    config._attn_implementation = "sdpa"
    theirs = DeepseekV3Attention(config, 0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05 if p.dim() > 1 else torch.ones(p.shape))
    tracker = RNGTracker()
    seed_model_parallel(0, ParallelGrid(), tracker)
    chunk = build_rank_chunks(cfg, ParallelGrid(), PipelineLayout(1), kernels=KernelsConfig(attention="sdpa"),
                              tracker=tracker, backend="sdpa")[0]
    ours = chunk.layers["0"].attn
    names = {"q_down": "q_a_proj", "q_norm": "q_a_layernorm", "q_up": "q_b_proj", "kv_down": "kv_a_proj_with_mqa",
             "kv_norm": "kv_a_layernorm", "kv_up": "kv_b_proj", "out": "o_proj"}
    with torch.no_grad():
        for name, module in ours.named_children():
            for pname, p in module.named_parameters():
                p.copy_(getattr(getattr(theirs, names[name]), pname))
    x = torch.zeros(TOKENS[0], s, MLA_H)
    cos_sin = DeepseekV3RotaryEmbedding(config)(x, torch.arange(s)[None])
    return ours, theirs, cos_sin


def part_c(steps: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    ours, theirs, cos_sin = _mla_pair()
    variants = {"mlplat": ours, "hf": lambda x: theirs(x, cos_sin, None)[0]}
    x = torch.randn(*TOKENS, MLA_H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        diff = float((ours(x) - variants["hf"](x)).abs().max())
    print(f"\n(c) latent attention, one process, float32, h {MLA_H}, {MLA_HEADS} heads, {MLA}, {TOKENS[0]}x{TOKENS[1]} "
          f"tokens, causal, sdpa, forward+backward, median of {steps} steps; output vs mlplat: max |diff| {diff:.2e}")
    params = {"mlplat": list(ours.parameters()), "hf": list(theirs.parameters())}
    times = {name: [] for name in variants}
    names = list(variants)
    for i in range(steps + 2):
        for name in names[i % 2:] + names[:i % 2]:
            for p in params[name]:
                p.grad = None
            t = _step(variants[name], x, time.thread_time)
            if i >= 2:
                times[name].append(t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"{'variant':<15} {'CPU ms/step':>11} {'mlplat / it':>12}")
    for name in names:
        print(f"{name:<15} {med[name] * 1e3:>11.2f} {med['mlplat'] / med[name]:>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("a", "b", "c", "all"), default="all")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.part in ("a", "all"):
        part_a(args.steps)
    if args.part in ("b", "all"):
        part_b(args.steps)
    if args.part in ("c", "all"):
        part_c(args.steps)


if __name__ == "__main__":
    main()
