"""The experts' FP8 forward through torch's grouped GEMM (`mlplat.parallel.fp8_grouped`), proven without a GPU: the
operands' layouts pass torch 2.13's own checks (its meta kernel of `_scaled_grouped_mm`), an empty expert
included; the probe takes a stand-in kernel that reads those layouts as torch documents them and refuses one that
shifts the offsets, reads another expert's scales or raises; the verdict is kept, logged once and read by
`grouped_fp8_gemm_path`; a CPU never probes; the cost model charges the forward at the FP8 peak where the kernel is
taken. The kernel itself has not run here: the `gpu`-marked test runs it where one is lent."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from mlplat.parallel import fp8_grouped as fg
from mlplat.parallel.fp8_experts import GroupedFp8Gemm
from mlplat.parallel.quantise import E4M3, E5M2, quantise
from mlplat.precision import GROUPED_FP8_RULE, grouped_fp8_gemm_path, grouped_fp8_verdicts
from tests.helpers.fp8 import unprobed

KERNEL = torch._scaled_grouped_mm


@pytest.fixture(autouse=True)
def no_verdicts():
    with unprobed(grouped_fp8_verdicts):
        yield


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def test_the_layouts_pass_torchs_own_checks_an_empty_expert_included():
    """On the meta device torch 2.13 runs `_meta_grouped_mm_common`'s checks (CUDA's): X row-major with [M] scales,
    W_gᵀ column-major with [G, N] scales, int32 offsets, for both recipes and an empty expert (first, between,
    last); its output is [M, N] bf16. The quantiser's own scale shapes, e5m2 gradients and an fp32 output are
    refused, which is why dX and the other outputs stay the emulation."""
    for recipe in ("tensorwise", "rowwise"):
        a, w, counts = fg.probe_operands(torch.device("cpu"), recipe)
        mat_a, mat_b, scale_a, scale_b, offs = fg.kernel_operands(a, w, counts)
        assert offs.dtype == torch.int32 and offs.tolist() == [48, 48, 64, 160, 192]
        assert mat_b.stride()[1] == 1 and scale_b.shape == (5, 128) and scale_b.is_contiguous()
        assert torch.equal(scale_b, w.scale.reshape(5, -1).expand(5, 128))
        for shift in (counts, counts.roll(1), counts.roll(-1)):  # the empty expert first, between, last
            out = KERNEL(*map(_meta, fg.kernel_operands(a, w, shift)[:4]), offs=_meta(shift.cumsum(0).int()),
                         out_dtype=torch.bfloat16)
            assert out.shape == (192, 128) and out.dtype == torch.bfloat16
        meta = list(map(_meta, (mat_a, mat_b, scale_a, scale_b, offs)))
        with pytest.raises(RuntimeError, match="scale_a to be 1D"):
            KERNEL(meta[0], meta[1], _meta(a.scale), meta[3], offs=meta[4], out_dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="non-batch dimension"):
            KERNEL(meta[0], meta[1], meta[2], _meta(w.scale.reshape(5, -1)[:, :1]), offs=meta[4])
        with pytest.raises(RuntimeError, match="E4M3"):
            KERNEL(_meta(mat_a.to(E5M2)), meta[1], meta[2], meta[3], offs=meta[4])
        with pytest.raises(RuntimeError, match="must be torch.bfloat16"):
            KERNEL(*meta[:4], offs=meta[4], out_dtype=torch.float32)
        assert fg.shapes_fit(a, w)
    x = quantise(torch.randn(8, 40), E4M3, (1, 40))
    assert not fg.shapes_fit(x, quantise(torch.randn(2, 32, 40), E4M3, (1, 40)))  # K not a multiple of 16
    blocks = quantise(torch.randn(2, 128, 128), E4M3, (128, 128))
    assert not fg.shapes_fit(quantise(torch.randn(8, 256), E4M3, (1, 128)), blocks)  # blockwise tiles: emulated
    w = quantise(torch.randn(4, 32, 64), E4M3, (1, 64))
    fits = {m: fg.shapes_fit(quantise(torch.randn(m, 64), E4M3, (1, 64)), w) for m in (0, 1, 2, 4, 5)}
    assert fits == {0: False, 1: False, 2: True, 4: False, 5: True}  # [1] and [G] scales: shapes later torch misreads


def _reading_kernel(wrong: str | None = None, calls: list | None = None):
    """A stand-in for torch's kernel: torch's own checks on meta copies of its arguments, then the product the
    layouts say, each group's rows of A·scale_a times its B·scale_b. `wrong`: "offs" reads each group's rows one
    late (the offsets shifted by one), "scales" each group's scales from the next expert."""
    def kernel(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=torch.bfloat16, **kw):
        KERNEL(_meta(mat_a), _meta(mat_b), _meta(scale_a), _meta(scale_b), offs=_meta(offs), out_dtype=out_dtype)
        if calls is not None:
            calls.append(offs.tolist())
        ends = (offs + 1).clamp(max=mat_a.shape[0]) if wrong == "offs" else offs
        scale_b = scale_b.roll(1, 0) if wrong == "scales" else scale_b
        out, start = torch.zeros(mat_a.shape[0], mat_b.shape[2]), 0
        for g, end in enumerate(ends.tolist()):
            out[start:end] = (mat_a[start:end].float() * scale_a[start:end, None]) @ (mat_b[g].float() * scale_b[g])
            start = end
        return out.to(out_dtype)
    return kernel


def _truncating_kernel(bits: int):
    """A stand-in for a kernel on tensor cores that keep `bits` mantissa bits: each group's products summed 32 at a
    time (an FP8 MMA's K), the running sum truncated after each, promoted to fp32 every 128, then scaled."""
    def truncate(x):
        mantissa, exponent = torch.frexp(x)
        return torch.ldexp(torch.trunc(mantissa * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), exponent)

    def kernel(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=torch.bfloat16, **kw):
        out, start = torch.zeros(mat_a.shape[0], mat_b.shape[2]), 0
        for g, end in enumerate(offs.tolist()):
            a, b, total = mat_a[start:end].float(), mat_b[g].float(), 0
            for t in range(0, a.shape[1], 128):
                acc = torch.zeros(a.shape[0], b.shape[1])
                for j in range(t, t + 128, 32):
                    acc = truncate(acc + a[:, j:j + 32] @ b[j:j + 32])
                total = total + acc
            out[start:end] = total * scale_a[start:end, None] * scale_b[g]
            start = end
        return out.to(out_dtype)
    return kernel


def _raising(*args, **kwargs):
    raise RuntimeError("torch._scaled_grouped_mm is only supported on CUDA devices with compute capability = "
                       "[9.0, 10.0], or ROCm MI300+")


def test_the_probe_takes_a_kernel_that_agrees_and_refuses_wrong_or_raising_ones(monkeypatch):
    """`probe` on its uneven counts (an empty expert among them): a kernel reading the layouts right is within the
    bound under both recipes, and so is one accumulating as Hopper's tensor cores do; one whose offsets are shifted
    by one, or that reads another expert's scales, is far outside it; one that raises is refused with its
    message."""
    cpu, calls = torch.device("cpu"), []
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _reading_kernel(calls=calls))
    for recipe in ("tensorwise", "rowwise"):
        taken, why = fg.probe(cpu, recipe)
        assert taken and "agrees" in why and "5 experts of 48/0/16/96/32 rows" in why, (recipe, why)
    assert calls == [[48, 48, 64, 160, 192]] * 2
    # Hopper's accumulator ("around 14 bits", DeepSeek-V3 §3.3.2) is within the bound; one of 3 bits is not
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _truncating_kernel(13))
    assert fg.probe(cpu, "tensorwise")[0] and fg.probe(cpu, "rowwise")[0]
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _truncating_kernel(3))
    assert not fg.probe(cpu, "rowwise")[0]
    for wrong in ("offs", "scales"):
        monkeypatch.setattr(torch, "_scaled_grouped_mm", _reading_kernel(wrong))
        for recipe in ("tensorwise", "rowwise"):
            taken, why = fg.probe(cpu, recipe)
            excess = float(why.split("emulation by ")[1].split("x the bound")[0])
            assert not taken and excess > 10, (wrong, recipe, why)  # measured 56x to 1270x
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _raising)
    taken, why = fg.probe(cpu, "rowwise")
    assert not taken and why.startswith("the grouped kernel raised RuntimeError: torch._scaled_grouped_mm is only"), why


def test_the_verdict_is_probed_once_logged_and_read_by_the_path(monkeypatch, caplog):
    """The gate on a CUDA device (its capability stood in for, the probe run on CPU tensors): sm90 probes once per
    (device, bf16, recipe), logs one line, and `grouped_fp8_gemm_path` answers from the verdict; sm89 is the
    emulation without a probe; blockwise, dX and dW never take the kernel. Before any verdict the dry run's answer
    is the rule, the cost model's the device's capability."""
    probes, probe = [], fg.probe

    def on_cpu(device, recipe):
        probes.append((str(device), recipe))
        return probe(torch.device("cpu"), recipe)

    monkeypatch.setattr(fg, "probe", on_cpu)
    monkeypatch.setattr(fg, "_capability", lambda index: (9, 0))
    assert grouped_fp8_gemm_path("cuda", "rowwise") == GROUPED_FP8_RULE
    assert grouped_fp8_gemm_path("cuda", "rowwise", "forward", "bfloat16", (9, 0)) == "torch._scaled_grouped_mm"
    assert grouped_fp8_gemm_path("cuda", "tensorwise", "forward", "bfloat16", (10, 0)) == "torch._scaled_grouped_mm"
    assert grouped_fp8_gemm_path("cuda", "rowwise", "forward", "bfloat16", (8, 9)) == "loop"
    assert grouped_fp8_gemm_path("cuda", "rowwise", "forward", "float32", (9, 0)) == "loop"
    assert grouped_fp8_gemm_path("cuda", "blockwise", "forward", "bfloat16", (9, 0)) == "loop"
    assert {grouped_fp8_gemm_path("cuda", "rowwise", p, "bfloat16", (9, 0)) for p in ("input_grad", "weight_grad")} \
        == {"loop"}
    cuda0 = torch.device("cuda", 0)
    caplog.set_level(logging.INFO, logger="mlplat")
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _reading_kernel())
    assert fg.kernel_agrees(cuda0, "rowwise") and fg.kernel_agrees(cuda0, "rowwise")
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _reading_kernel("scales"))
    assert not fg.kernel_agrees(cuda0, "tensorwise") and not fg.kernel_agrees(cuda0, "blockwise")
    assert probes == [("cuda:0", "rowwise"), ("cuda:0", "tensorwise")]  # once each; blockwise never
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "kernels.fp8=rowwise experts on cuda:0 into bfloat16: torch grouped GEMM" in lines[0]
    assert "tensorwise experts on cuda:0 into bfloat16: emulated (dequantise, fp32 matmul); the grouped kernel " \
           "differs" in lines[1]
    assert grouped_fp8_verdicts == {("cuda:0", "bfloat16", "rowwise"): True, ("cuda:0", "bfloat16", "tensorwise"):
                                    False}
    assert grouped_fp8_gemm_path("cuda", "rowwise") == "torch._scaled_grouped_mm"
    assert grouped_fp8_gemm_path("cuda", "tensorwise", "forward", "bfloat16", (9, 0)) == "loop"
    grouped_fp8_verdicts.clear()
    monkeypatch.setattr(fg, "_capability", lambda index: (8, 9))
    assert not fg.kernel_agrees(cuda0, "rowwise")
    assert "sm89: torch's grouped FP8 kernel is sm90's and sm100's only" in caplog.records[-1].getMessage()
    assert len(probes) == 2


def test_the_experts_forward_goes_through_the_kernel_where_taken(monkeypatch):
    """`GroupedFp8Gemm.grouped_forward` where the gate says taken (stood in for on a CPU): one call of the kernel,
    with the offsets of the experts' counts and X's and W's codes, its bf16 result returned as it is, within the
    bound of the emulation's; dX and dW do not call it."""
    from mlplat.parallel import fp8_experts

    calls = []
    monkeypatch.setattr(fp8_experts, "grouped_kernel_takes", lambda a, w, out, recipe: out == torch.bfloat16)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _reading_kernel(calls=calls))
    counts = torch.tensor([40, 0, 24])
    x = torch.randn(64, 96, dtype=torch.bfloat16)
    weight = torch.randn(3, 48, 96, dtype=torch.bfloat16)
    for recipe in ("tensorwise", "rowwise"):
        gemm = GroupedFp8Gemm(recipe, "out")
        y = gemm.grouped_forward(x, weight, counts)
        qa, qw = gemm._rows(x, "in", grad=False), gemm._weight(weight, transposed=False)
        assert y.dtype == torch.bfloat16 and y.shape == (64, 48)
        assert bool(((y.float() - fg.emulated(qa, qw, counts)).abs() <= fg.agreement_bound(qa, qw, counts)).all())
        gemm.grouped_input_grad(torch.randn(64, 48, dtype=torch.bfloat16), weight, counts)
        gemm.grouped_weight_grad(torch.randn(64, 48, dtype=torch.bfloat16), x, weight, counts)
    assert calls == [[40, 40, 64]] * 2
    gemm.grouped_forward(x.float(), weight.float(), counts)  # an fp32 output: the emulation
    assert len(calls) == 2


def test_a_cpu_never_probes_and_the_cost_model_charges_the_kernels_forward(monkeypatch):
    """On a CPU the experts' products are the emulation (the grouped forward equals `fp8_grouped.emulated` to the
    bit), no probe runs and no verdict is kept. The cost model charges the experts' forward at the FP8 peak, one
    grouped GEMM without the loop's host time, on sm90 into bf16 (bf16-megatron), and the emulation's fp32 loop on
    a device without the capability and under 16-megatron (fp16 out); the backward is the emulation's in all."""
    from mlplat.perf.cluster import experts_fp8_forward, layer_costs
    from mlplat.perf.links import Cluster
    from mlplat.plan import load_group
    from tests.perf.test_moe import _mixtral, _stage

    monkeypatch.setattr(fg, "probe", lambda *a: pytest.fail("probed on a CPU"))
    monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda *a, **k: pytest.fail("the grouped kernel ran on a CPU"))
    a, w, counts = fg.probe_operands(torch.device("cpu"), "rowwise")
    gemm = GroupedFp8Gemm("rowwise", "out")
    x = torch.randn(192, 256, dtype=torch.bfloat16)
    weight = torch.randn(5, 128, 256, dtype=torch.bfloat16)
    qa, qw = gemm._rows(x, "in", grad=False), gemm._weight(weight, transposed=False)
    assert torch.equal(gemm.grouped_forward(x, weight, counts), fg.emulated(qa, qw, counts).to(torch.bfloat16))
    assert grouped_fp8_verdicts == {} and grouped_fp8_gemm_path("cpu", "rowwise", "forward", "bfloat16", (9, 0)) \
        == "grouped"
    h100 = Cluster.from_config(load_group("cluster", "dgx_h100"))
    sm89 = dataclasses.replace(h100, device=dataclasses.replace(h100.device, sm=(8, 9)))
    dims = _mixtral()
    bd = {name: layer_costs(dims, _stage(2, fp8="rowwise", precision=p), cl).breakdown
          for name, cl, p in (("kernel", h100, "bf16-megatron"), ("sm89", sm89, "bf16-megatron"),
                              ("fp16", h100, "16-megatron"))}
    assert experts_fp8_forward("bf16-megatron", h100, "rowwise") == "torch._scaled_grouped_mm"
    assert experts_fp8_forward("bf16-megatron", sm89, "rowwise") == experts_fp8_forward("16-megatron", h100,
                                                                                        "rowwise") == "loop"
    assert bd["kernel"]["moe_expert_loop_forward"] == 0 < bd["sm89"]["moe_expert_loop_forward"]
    assert bd["sm89"]["moe_expert_gemm_forward"] > 20 * bd["kernel"]["moe_expert_gemm_forward"], bd
    assert bd["fp16"]["moe_expert_gemm_forward"] == pytest.approx(bd["sm89"]["moe_expert_gemm_forward"], rel=1e-12)
    assert bd["kernel"]["moe_expert_loop_backward"] == bd["sm89"]["moe_expert_loop_backward"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_grouped_fp8_forward_where_the_probe_agrees():
    """On a GPU: the verdict follows the device (sm90 or sm100: the kernel must be taken), and where taken the
    experts' bf16 forward is the kernel's and agrees with the emulation within the bound."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    for recipe in ("tensorwise", "rowwise"):
        taken = fg.kernel_agrees(cuda, recipe)
        if torch.cuda.get_device_capability() in ((9, 0), (10, 0)):
            assert taken, grouped_fp8_verdicts
        if not taken:
            pytest.skip("the grouped FP8 kernel is not taken on this device")
        counts = torch.tensor([300, 0, 17, 211], device=cuda)
        gemm = GroupedFp8Gemm(recipe, "out")
        x = torch.randn(528, 512, device=cuda, dtype=torch.bfloat16)
        weight = torch.randn(4, 768, 512, device=cuda, dtype=torch.bfloat16)
        qa, qw = gemm._rows(x, "in", grad=False), gemm._weight(weight, transposed=False)
        assert fg.grouped_kernel_takes(qa, qw, torch.bfloat16, recipe)
        got = gemm.grouped_forward(x, weight, counts).float()
        assert bool(((got - fg.emulated(qa, qw, counts)).abs() <= fg.agreement_bound(qa, qw, counts)).all())
