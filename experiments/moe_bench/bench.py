"""The mixture-of-experts layer's speed on CPU, side by side with its peers, in one run.

    python experiments/moe_bench/bench.py               # both parts, ~2 minutes on 2 cores
    python experiments/moe_bench/bench.py --part a      # (a) only

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


def _step(module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    y.square().mean().backward()
    return time.perf_counter() - start


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("a", "b", "both"), default="both")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.part in ("a", "both"):
        part_a(args.steps)
    if args.part in ("b", "both"):
        part_b(args.steps)


if __name__ == "__main__":
    main()
