"""The experts' grouped GEMM path (mlplat.precision.grouped_gemm_path, mlplat.parallel.linear.grouped_mm): the
path of every precision on CUDA and on a CPU, and the bf16-cast path run on a CPU given CUDA's kernel list (a CPU's
`_grouped_mm` takes bf16 too): the same values and gradients as one bf16 GEMM per expert, the output and the fp32
weights' gradients in fp32, the layer's GEMMs called on bf16 operands under autocast."""
from __future__ import annotations

import pytest
import torch

from mlplat import precision
from mlplat.config import ModelConfig, MoEConfig
from mlplat.model.moe import MoELayer
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.linear import grouped_mm, grouped_mm_path
from mlplat.precision import TABLE, grouped_gemm_path

# trainer.precision -> (its experts' path on CUDA, on a CPU); the operands are in the weights' dtype (autocast leaves
# `_grouped_mm` alone), the compute dtype is the precision's
PATHS = {
    "64-true": ("loop", "loop"),
    "32-true": ("loop", "grouped"),
    "bf16-mixed": ("grouped-bf16", "grouped"),
    "16-mixed": ("grouped-bf16", "grouped"),
    "bf16-true": ("grouped", "grouped"),
    "16-true": ("grouped-bf16", "grouped"),
    "bf16-megatron": ("grouped", "grouped"),
    "16-megatron": ("grouped-bf16", "grouped"),
}


def test_every_precision_takes_its_path_on_each_device():
    assert set(PATHS) == {name for name, e in TABLE.items() if e.alias_of is None}
    for name, expected in PATHS.items():
        e = TABLE[name]
        got = tuple(grouped_gemm_path(device, e.weight_dtype, e.compute_dtype) for device in ("cuda", "cpu"))
        assert got == expected, (name, got)
    assert grouped_gemm_path("mps", "float32", "float32") == "grouped"  # another device: the CPU's list
    assert grouped_gemm_path("cuda", "float64", "bfloat16") == "loop"  # nothing casts float64 down


def _cuda_kernels(monkeypatch):
    """A CPU with CUDA's `_grouped_mm` kernel list: the paths CUDA takes, run by the CPU's op."""
    monkeypatch.setitem(precision.GROUPED_KERNEL_DTYPES, "cpu", precision.GROUPED_KERNEL_DTYPES["cuda"])


def test_bf16_cast_path_equals_one_bf16_gemm_per_expert_with_fp32_gradients(monkeypatch):
    _cuda_kernels(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 5, 1])  # an expert without tokens too
    x, w = torch.randn(9, 16, generator=gen), torch.randn(4, 16, 8, generator=gen)
    grad = torch.randn(9, 8, generator=gen)
    assert grouped_mm_path(x, w) == "loop"  # 32-true: fp32 has no CUDA kernel
    outs = []
    for cast in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        if cast:
            with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16-mixed
                assert grouped_mm_path(xi, wi) == "grouped-bf16"
                y = grouped_mm(xi, wi, counts)
        else:  # the reference: one bf16 GEMM per expert, cast back
            ends = counts.cumsum(0).tolist()
            y = torch.cat([xi[e - n:e].bfloat16() @ wi[g].bfloat16() for g, (e, n) in
                           enumerate(zip(ends, counts.tolist()))]).float()
        y.backward(grad)
        outs.append((y.detach(), xi.grad, wi.grad))
    for a, b in zip(*outs):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert float(outs[0][2][1].abs().max()) == 0.0


@pytest.mark.parametrize("dtype,autocast,operands", [(torch.float32, True, torch.bfloat16),
                                                     (torch.bfloat16, False, torch.bfloat16),
                                                     (torch.float16, False, torch.bfloat16)])
def test_the_layer_runs_the_grouped_kernel_in_bf16_under_16_bit_precisions(monkeypatch, dtype, autocast, operands):
    """bf16-mixed (fp32 weights under autocast), bf16 weights (bf16-true, bf16-megatron), fp16 weights (16-megatron,
    16-true) on CUDA's kernel list: every `_grouped_mm` gets bf16 operands; the weights' gradients keep the weights'
    dtype and come within bf16's rounding of the float64 layer's."""
    _cuda_kernels(monkeypatch)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, **k: calls.append((a.dtype, b.dtype)) or real(a, b, **k))
    moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden=16)
    cfg = ModelConfig(arch="llama", mlp="swiglu", hidden=32, n_heads=4, moe=moe)
    layers = [MoELayer(cfg, ParallelGrid(), dtype=d) for d in (torch.float64, dtype)]
    gen = torch.Generator().manual_seed(0)
    for p, q in zip(*(layer.parameters() for layer in layers)):
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
            q.copy_(p)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = []
    for layer, d in zip(layers, (torch.float64, dtype)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast and d != torch.float64):
            layer(x.to(d)).float().square().sum().backward()
        grads.append(layer.experts.fc1.weight.grad)
    assert calls == [(operands, operands)] * 2  # fc1 and fc2 forward; the float64 layer loops
    assert grads[1].dtype == dtype
    torch.testing.assert_close(grads[1].double(), grads[0], rtol=0.05, atol=0.05 * float(grads[0].abs().max()))


def test_a_meta_tensor_takes_the_cpu_list_without_autocast():
    x, w = torch.empty(8, 16, device="meta"), torch.empty(2, 16, 8, device="meta")
    assert grouped_mm_path(x, w) == "grouped"
