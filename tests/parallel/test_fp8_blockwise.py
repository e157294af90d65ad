"""Blockwise FP8 through torch's block-scaled GEMM (`mlplat.parallel.fp8_blockwise`), proven without a GPU: the
scale layouts pass torch 2.13's own shape and stride checks (its meta kernel of `_scaled_mm_v2`, which checks as
CUDA does), the probe takes a kernel that reads those layouts as torch documents them and refuses a wrong or a
raising one with one log line, the verdict is kept and `fp8_gemm_path` answers from it, and a CPU never probes.
The kernel itself has not run here: the `gpu`-marked test runs it where one is lent."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from mlplat.parallel import fp8_blockwise as bw
from mlplat.parallel.fp8 import _scaled_mm_takes, scaled_mm
from mlplat.parallel.quantise import E4M3, Quantised, emulated_mm, quantise
from mlplat.precision import BLOCKWISE_RULE, blockwise_verdicts, fp8_gemm_path
from tests.helpers.fp8 import unprobed

KERNEL = F.scaled_mm


@pytest.fixture(autouse=True)
def no_verdicts():
    with unprobed(blockwise_verdicts):
        yield


def _operands(m: int, n: int, k: int, seed: int = 0) -> tuple[Quantised, Quantised, Quantised]:
    """A [m, k] in 1×128 tiles, W [n, k] in 128×128 blocks, X [n, k] in 1×128 tiles (dW's second operand)."""
    gen = torch.Generator().manual_seed(seed)
    a, w, x = (torch.randn(r, k, generator=gen) for r in (m, n, n))
    return quantise(a, E4M3, bw.TILE), quantise(w, E4M3, bw.BLOCK), quantise(x, E4M3, bw.TILE)


def _meta(q: Quantised) -> Quantised:
    return Quantised(q.data.to("meta"), q.scale.to("meta"), q.block)


def test_block_scales_pass_torchs_own_shape_and_stride_checks():
    """On the meta device torch 2.13 runs `_check_scaled_mm_sizes_v2`, with CUDA's checks (a meta tensor counts as
    CUDA there): every layout `kernel_scales` makes is accepted, K/128 tiles padded to a multiple of 4 in the
    128×128 scales; the same scales left in the quantiser's row-major layout are refused."""
    for m, n, k in ((48, 384, 256), (16, 128, 128), (32, 256, 640)):
        a, w, x = _operands(m, n, k)
        kt, l4 = k // 128, -(-k // 512) * 4
        sa, sw = bw.kernel_scales(a, w)
        assert sa.shape == (m, kt) and sa.stride()[0] == 1 and (kt == 1 or sa.stride(1) == m)  # one tile: any
        assert torch.equal(sa, a.scale)
        assert sw.shape == (l4, n // 128) and sw.stride() == (1, l4)
        assert torch.equal(sw[:kt].t(), w.scale) and not sw[kt:].any()  # the padding: zeros past K's tiles
        _, sx = bw.kernel_scales(a, x)
        assert sx.shape == (n, kt) and sx.stride()[0] == 1 and (kt == 1 or sx.stride(1) == n)
        assert torch.equal(sx, x.scale)
        for b in (w, x):
            out = bw.block_scaled_mm(_meta(a), _meta(b), torch.bfloat16)
            assert out.shape == (m, n) and out.device.type == "meta" and out.dtype == torch.bfloat16
            assert bw.shapes_fit(a, b)
    a, w, _ = (_meta(q) for q in _operands(48, 384, 256))
    with pytest.raises(RuntimeError, match="1x128 x 128x128 blockwise scaling"):
        KERNEL(a.data, w.data.t(), a.scale, F.ScalingType.BlockWise1x128, bw.kernel_scales(a, w)[1],
               F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    a, w, x = _operands(48, 384, 200)[0], *_operands(48, 320, 256)[1:]
    assert not bw.shapes_fit(a, x) and not bw.shapes_fit(_operands(48, 320, 256)[0], w)  # K, N not whole 128s


def _reading_kernel(wrong: bool = False, calls: list | None = None):
    """A stand-in for torch's kernel that first runs torch's own checks (on meta copies of its arguments), then
    reads the scales back from the layouts torch documents and returns the emulation of what they say. `wrong`:
    it reads the 128×128 scales without transposing them (every weight block's scale from another block)."""
    def kernel(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=torch.bfloat16, **kw):
        def meta(t):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        KERNEL(meta(mat_a), meta(mat_b), meta(scale_a), recipe_a, meta(scale_b), recipe_b, output_dtype=output_dtype)
        if calls is not None:
            calls.append((recipe_a, recipe_b))
        kt, nb = mat_a.shape[1] // 128, mat_b.shape[1] // 128
        blocks = recipe_b == F.ScalingType.BlockWise128x128
        sb = (scale_b[:nb, :kt] if wrong else scale_b[:kt].t()) if blocks else scale_b
        b = Quantised(mat_b.t(), sb, bw.BLOCK if blocks else bw.TILE)
        return emulated_mm(Quantised(mat_a, scale_a, bw.TILE), b, output_dtype)
    return kernel


def _truncating_kernel(bits: int):
    """A stand-in for a kernel on tensor cores that keep `bits` mantissa bits: each 128-product tile summed 32
    products at a time (an FP8 MMA's K), the running sum truncated after each, then scaled and added in fp32."""
    def truncate(x):
        mantissa, exponent = torch.frexp(x)
        return torch.ldexp(torch.trunc(mantissa * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), exponent)

    def kernel(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=torch.bfloat16, **kw):
        kt, a, b = mat_a.shape[1] // 128, mat_a.float(), mat_b.float()
        blocks = recipe_b == F.ScalingType.BlockWise128x128
        sb = (scale_b[:kt].t() if blocks else scale_b).repeat_interleave(128 if blocks else 1, 0)  # [N, K/128]
        out = 0
        for t in range(kt):
            acc = torch.zeros(a.shape[0], b.shape[1])
            for j in range(t * 128, (t + 1) * 128, 32):
                acc = truncate(acc + a[:, j:j + 32] @ b[j:j + 32])
            out = out + acc * scale_a[:, t:t + 1] * sb[:, t]
        return out.to(output_dtype)
    return kernel


def _raising(*args, **kwargs):
    raise RuntimeError("DeepSeek style (1x128, 128x128) scaling requires cublasLt >= 12.9")


def test_the_probe_takes_a_kernel_that_agrees_and_refuses_a_wrong_or_a_raising_one(monkeypatch):
    """`probe` on its random operands (both scale pairs): a kernel reading the layouts right is within the bound in
    every output dtype, and so is one accumulating as Hopper's tensor cores do; one reading the weight's scales
    untransposed is far outside it, one that raises is refused with its message."""
    cpu, calls = torch.device("cpu"), []
    monkeypatch.setattr(F, "scaled_mm", _reading_kernel(calls=calls))
    for out in (torch.float32, torch.bfloat16, torch.float16):
        taken, why = bw.probe(cpu, out)
        assert taken and "agrees" in why, (out, why)
    assert calls[:2] == [(F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128),
                         (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise1x128)]
    # Hopper's accumulator ("around 14 bits", DeepSeek-V3 §3.3.2) is within the bound; one of 3 bits is not
    monkeypatch.setattr(F, "scaled_mm", _truncating_kernel(13))
    assert bw.probe(cpu, torch.float32)[0] and bw.probe(cpu, torch.bfloat16)[0]
    monkeypatch.setattr(F, "scaled_mm", _truncating_kernel(3))
    assert not bw.probe(cpu, torch.float32)[0]
    monkeypatch.setattr(F, "scaled_mm", _reading_kernel(wrong=True))
    taken, why = bw.probe(cpu, torch.bfloat16)
    excess = float(why.split("emulation by ")[1].split("x the bound")[0])
    assert not taken and "1x128 by 128x128" in why and excess > 10, why  # measured 25x
    monkeypatch.setattr(F, "scaled_mm", _raising)
    taken, why = bw.probe(cpu, torch.float32)
    assert not taken and why.endswith("raised RuntimeError: DeepSeek style (1x128, 128x128) scaling requires "
                                      "cublasLt >= 12.9"), why


def test_the_verdict_is_probed_once_per_device_and_dtype_logged_and_read_by_the_path(monkeypatch, caplog):
    """The gate on a CUDA device (its capability and torch's CUDA version stood in for, the probe run on CPU
    tensors): sm90 with CUDA 12.9 probes once per (device, output dtype), logs one line saying which path and why,
    and `fp8_gemm_path` then answers from the verdict; another capability or an older CUDA is the emulation
    without a probe. Before any verdict the dry run's answer is the rule, the cost model's the device's."""
    probes, probe = [], bw.probe

    def on_cpu(device, out):
        probes.append((str(device), out))
        return probe(torch.device("cpu"), out)

    monkeypatch.setattr(bw, "probe", on_cpu)
    monkeypatch.setattr(bw, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(bw, "_cuda_version", lambda: (12, 9))
    assert fp8_gemm_path("blockwise", "cuda", "bfloat16") == BLOCKWISE_RULE
    assert fp8_gemm_path("blockwise", "cuda", "bfloat16", (9, 0)) == "torch._scaled_mm"
    assert fp8_gemm_path("blockwise", "cuda", "bfloat16", (10, 0)) == "emulated"
    assert fp8_gemm_path("blockwise", "cuda", "float64", (9, 0)) == "emulated"
    cuda0 = torch.device("cuda", 0)
    caplog.set_level(logging.INFO, logger="mlplat")
    monkeypatch.setattr(F, "scaled_mm", _reading_kernel())
    assert bw.kernel_agrees(cuda0, torch.bfloat16) and bw.kernel_agrees(cuda0, torch.bfloat16)
    monkeypatch.setattr(F, "scaled_mm", _reading_kernel(wrong=True))
    assert not bw.kernel_agrees(cuda0, torch.float16) and not bw.kernel_agrees(cuda0, torch.float64)
    assert probes == [("cuda:0", torch.bfloat16), ("cuda:0", torch.float16)]  # once each; float64 never
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "on cuda:0 into bfloat16: torch block-scaled GEMM; the probe" in lines[0]
    assert "into float16: emulated (dequantise, fp32 matmul); the 1x128 by 128x128 kernel differs" in lines[1]
    assert blockwise_verdicts == {("cuda:0", "bfloat16"): True, ("cuda:0", "float16"): False}
    assert fp8_gemm_path("blockwise", "cuda", "bfloat16") == "torch._scaled_mm"
    assert fp8_gemm_path("blockwise", "cuda", "float16", (9, 0)) == "emulated"
    for sm, cuda, why in (((8, 9), (12, 9), "sm89: torch's block-scaled kernel is sm90's only"),
                          ((9, 0), (12, 6), "the kernel needs 12.9")):
        blockwise_verdicts.clear()
        monkeypatch.setattr(bw, "_capability", lambda index, sm=sm: sm)
        monkeypatch.setattr(bw, "_cuda_version", lambda cuda=cuda: cuda)
        assert not bw.kernel_agrees(cuda0, torch.bfloat16) and why in caplog.records[-1].getMessage()
    assert len(probes) == 2


def test_a_cpu_never_probes_and_takes_the_emulation(monkeypatch):
    """On a CPU blockwise's products are the emulation, whatever the shapes; the probe never runs and no verdict is
    kept. The cost model charges blockwise at the FP8 peak on an sm90 device (the kernel's), at the fp32 peak on
    one without its capability."""
    import dataclasses

    from mlplat.perf.cluster import Cluster, fp8_gemm
    from mlplat.plan import load_group

    monkeypatch.setattr(bw, "probe", lambda *a: pytest.fail("probed on a CPU"))
    monkeypatch.setattr(F, "scaled_mm", lambda *a, **k: pytest.fail("the block-scaled kernel ran on a CPU"))
    a, w, x = _operands(48, 384, 256)
    for b in (w, x):
        for out in (torch.float32, torch.bfloat16, torch.float64):
            assert not _scaled_mm_takes(a, b, out, "blockwise")
            assert torch.equal(scaled_mm(a, b, out, "blockwise"), emulated_mm(a, b, out))
    assert blockwise_verdicts == {} and fp8_gemm_path("blockwise", "cpu", "bfloat16", (9, 0)) == "emulated"
    h100 = Cluster.from_config(load_group("cluster", "dgx_h100"))
    other = dataclasses.replace(h100, device=dataclasses.replace(h100.device, sm=(10, 0)))
    at = {name: fp8_gemm(cl, r, "bf16-megatron")(4096, 4096, 4096) for name, cl, r in
          (("tensorwise", h100, "tensorwise"), ("blockwise", h100, "blockwise"), ("sm100", other, "blockwise"))}
    assert at["blockwise"] == at["tensorwise"] and at["sm100"] > 4 * at["blockwise"], at


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_block_scaled_gemm_where_the_probe_agrees():
    """On a GPU: the verdict follows the device (sm90 with CUDA ≥ 12.9: the kernel must be taken), and where taken
    a layer-shaped product through `scaled_mm` is the kernel's and agrees with the emulation within the bound."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    taken = bw.kernel_agrees(cuda, torch.bfloat16)
    if torch.cuda.get_device_capability() == (9, 0) and bw._cuda_version() >= bw.MIN_CUDA:
        assert taken, blockwise_verdicts
    if not taken:
        pytest.skip("the block-scaled kernel is not taken on this device")
    a, w, x = (Quantised(q.data.to(cuda), q.scale.to(cuda), q.block) for q in _operands(512, 768, 1024))
    for b in (w, x):
        assert _scaled_mm_takes(a, b, torch.bfloat16, "blockwise")
        got = scaled_mm(a, b, torch.bfloat16, "blockwise").float()
        assert bool(((got - emulated_mm(a, b, torch.float32)).abs() <= bw.agreement_bound(a, b, torch.bfloat16)).all())
