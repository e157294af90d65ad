"""Kernel variants of the whole model: attention backend, fused operators and activation recomputation together.

Everything that claims "the same computation" is checked in float64 with dropout ON (0.1), because dropout is
where backends, fusion and recomputation can silently disagree (a different mask is a different model):
  - every variant (sdpa, fused, selective and full recomputation, and combinations) gives the loss and the
    gradients of the plain model: `checkpoint` replays the RNG streams (default generator and the
    tensor-parallel tracker) and, for mixed precision, the autocast state;
  - the same at tp=2 and at pp=2 (interleaved, v=2) on gloo processes, and through the CLI.
The single operators are checked on their own in test_attention.py (sdpa equals math) and test_fused.py (compiled
equals eager); fp16 loss scaling in tests/parallel/test_loss_scale.py and tests/lightning/test_precision.py.
Multi-process workers run the fused operators eagerly (MLPLAT_FUSED_IMPL=eager semantics via set_impl): the
eager path is the same Python function the compiled path compiles, and compiled == eager is proven in-process
(test_fused.py), once, so that no spawned process pays Inductor's C++ compile on a 2-core box.

Shapes match the CLI runs (2 layers, hidden 32, 4 heads, sequence 16, micro-batch 2) so the CLI's compiles hit
Inductor's on-disk cache filled by the in-process tests (test_fused.py runs before this file).
"""
from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile worker pool on small CI boxes

import pytest
import torch
import torch.distributed as dist

from mlplat.config import KernelsConfig
from mlplat.model import attention, fused
from mlplat.optim.loss_scale import DynamicLossScaler
from mlplat.parallel.grid import ParallelGrid
from mlplat.step import TrainStep
from mlplat.step import parts as step_parts
from tests.helpers.cli import REPO, run_train, train_losses
from tests.helpers.dist import run_distributed
from tests.helpers.kernels import (
    GLOBAL,
    MICRO,
    MODEL,
    TOL,
    VARIANTS,
    batch,
    build,
    eager_fused,
    grads_of,
    make_cfg,
    named_parameters,
    rel_diff,
)

# ============================================================================================ model, one process


def test_variants_equal_plain_with_dropout():
    """tp=pp=1, two micro-batches through the pipeline engine: loss and every gradient equal the plain run."""
    torch.set_num_threads(1)
    grid, data = ParallelGrid(), batch()
    ref_loss, ref = grads_of(make_cfg(VARIANTS["plain"]), grid, data)
    no_drop = make_cfg(VARIANTS["plain"])
    no_drop.model.dropout = 0.0
    assert abs(grads_of(no_drop, grid, data)[0] - ref_loss) > 1e-3  # dropout is on and matters
    for name, kernels in VARIANTS.items():
        if name == "plain":
            continue
        loss, grads = grads_of(make_cfg(kernels), grid, data)
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (name, loss, ref_loss)
        assert rel_diff(grads, ref) <= TOL, (name, rel_diff(grads, ref))
    # Kernels switched on a built model (the benchmark does this) behave as if built with them.
    cfg = make_cfg(VARIANTS["plain"])
    cfg.optim.grad_clip = 0.0
    module = build(cfg, grid)
    for chunk in module.chunks.values():
        chunk.set_kernels(KernelsConfig(**VARIANTS["fused_selective"]), "sdpa")
    loss, _ = module.forward_backward(data)
    assert abs(float(loss) - ref_loss) <= TOL * abs(ref_loss)
    assert rel_diff({n: p.grad for n, p in named_parameters(module).items()}, ref) <= TOL


def test_llama_variants_equal_plain_with_dropout():
    """The Llama block (RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases) under the same
    variants: fused (bias-free SwiGLU and dropout+add), sdpa with GQA, selective and full recomputation. Eager
    fused operators: compiled == eager is test_fused.py's."""
    torch.set_num_threads(1)
    grid, data = ParallelGrid(), batch()
    llama = dict(arch="llama", n_kv_heads=2, ffn_hidden=96)
    ref_loss, ref = grads_of(make_cfg(VARIANTS["plain"], model=llama), grid, data)
    with eager_fused():
        for name in ("sdpa", "selective", "full", "fused_selective", "sdpa_fused_full"):
            loss, grads = grads_of(make_cfg(VARIANTS[name], model=llama), grid, data)
            assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (name, loss, ref_loss)
            assert rel_diff(grads, ref) <= TOL, (name, rel_diff(grads, ref))
    assert {n.rsplit(".", 2)[-2] for n in ref} >= {"output", "ln1"} and not any(n.endswith(".bias") for n in ref)


def test_recompute_replays_autocast_state():
    """Mixed precision: backward (and so the recomputation) runs outside autocast, as on CUDA's backward thread.
    The recomputed layer must still run in bf16 like its forward, else its gradients differ (~1e-2)."""
    torch.set_num_threads(1)
    grid, data = ParallelGrid(), batch()
    results = {}
    for recompute in ("none", "selective", "full"):
        module = TrainStep(make_cfg(dict(attention="math", fused=False, recompute=recompute), precision="bf16-mixed"),
                           grid)
        chunk = module.chunks[0].train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = chunk(*data)
        loss.backward()
        results[recompute] = {n: p.grad.clone() for n, p in chunk.named_parameters()}
    assert rel_diff(results["selective"], results["none"]) <= 1e-6
    assert rel_diff(results["full"], results["none"]) <= 1e-6


# ============================================================================================ tp=2 and pp=2


def _bf16_grads(cfg, grid, data) -> dict[str, torch.Tensor]:
    """fp32 parameters, bf16 autocast (Lightning's bf16-mixed), dropout off: {full-model name: grad}."""
    cfg.model.dropout, cfg.optim.grad_clip = 0.0, 0.0
    module = TrainStep(cfg, grid)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module.forward_backward(data)
    # Full-model names; the tied output embedding's copy on the last stage carries the same (summed) gradient.
    return {f"{n}": p.grad.clone() for c in module.chunks.values() for n, p in c.named_parameters()
            if n != "lm_head"}


def _layouts(rank, world_size):
    """On 2 gloo ranks: every variant at tp=2 and at pp=2 (interleaved, v=2), plus the cross-rank overflow flag."""
    fused.set_impl("eager")  # see the module docstring: compiled == eager is proven in-process
    torch.set_num_threads(1)
    layouts = {"tp2": dict(tp=2), "pp2_interleaved": dict(pp=2, vpp=2, n_layers=4, schedule="interleaved")}
    out = {}
    data = batch(8)
    for lname, layout in layouts.items():
        grid = ParallelGrid(layout.get("tp", 1), layout.get("pp", 1), 1)
        out[lname] = {name: grads_of(make_cfg(k, global_batch=8, **layout), grid, data)
                      for name, k in VARIANTS.items()}
        # fp16-style loss scaling by 2^10 through the pipeline (scaled grads cross stages), exact in float64.
        out[lname]["loss_scaled"] = grads_of(make_cfg(VARIANTS["plain"], global_batch=8, **layout), grid, data,
                                             DynamicLossScaler(init_scale=2.0**10))
    # bf16-mixed across two stages: activations and their gradients cross in bf16, the GEMMs' dtype (the
    # messages' dtype follows AUTOCAST_DTYPES); and, that table emptied, in the parameters' dtype (fp32).
    bf16_cfg = make_cfg(VARIANTS["plain"], global_batch=8, precision="bf16-mixed", **layouts["pp2_interleaved"])
    out["pp2_bf16"] = _bf16_grads(bf16_cfg, ParallelGrid(1, 2, 1), data)
    saved = dict(step_parts.AUTOCAST_DTYPES)
    step_parts.AUTOCAST_DTYPES.clear()
    try:
        out["pp2_bf16_fp32_messages"] = _bf16_grads(bf16_cfg, ParallelGrid(1, 2, 1), data)
    finally:
        step_parts.AUTOCAST_DTYPES.update(saved)
    # pp=2: an inf in one rank's (one stage's) gradients only, after the reductions: every rank must see it.
    grid = ParallelGrid(1, 2, 1)
    module = build(make_cfg(VARIANTS["plain"], pp=2, global_batch=8), grid)
    scaler = DynamicLossScaler(init_scale=2.0**10)
    module.loss_scaler = scaler
    module.forward_backward(data)
    clean = module.found_inf
    if rank == 1:
        module.parameters()[0].grad.view(-1)[0] = float("inf")
    out["overflow_flag"] = (clean, scaler.unscale_(module.parameters()))
    dist.barrier()
    return out


def test_tp2_and_pp2_variants_equal_plain_with_dropout():
    results = run_distributed(_layouts, 2, timeout=300)
    worst = {}
    for rank, res in enumerate(results):
        for lname in ("tp2", "pp2_interleaved"):
            ref_loss, ref = res[lname]["plain"]
            for name, (loss, grads) in res[lname].items():
                assert abs(loss - ref_loss) <= TOL * max(1.0, abs(ref_loss)), (rank, lname, name, loss, ref_loss)
                d = rel_diff(grads, ref)
                worst[(lname, name)] = max(worst.get((lname, name), 0.0), d)
                assert d <= TOL, (rank, lname, name, d)
        assert res["overflow_flag"] == (False, True), (rank, res["overflow_flag"])
    # bf16-mixed at pp=2 (two ranks, each with half the layers) equals bf16-mixed in one process.
    torch.set_num_threads(1)
    ref = _bf16_grads(make_cfg(VARIANTS["plain"], global_batch=8, precision="bf16-mixed", n_layers=4),
                      ParallelGrid(), batch(8))
    got = {**results[0]["pp2_bf16_fp32_messages"], **results[1]["pp2_bf16_fp32_messages"]}
    worst["pp2_bf16_fp32_messages"] = rel_diff(got, ref)
    assert worst["pp2_bf16_fp32_messages"] <= 1e-5, worst["pp2_bf16_fp32_messages"]
    # With bf16 messages the residual stream is rounded to bf16 at each of the 3 stage boundaries (and its
    # gradient on the way back): close to one process, as bf16 rounding allows, and not equal to it.
    got = {**results[0]["pp2_bf16"], **results[1]["pp2_bf16"]}
    worst["pp2_bf16"] = rel_diff(got, ref)
    assert 1e-6 < worst["pp2_bf16"] <= 5e-2, worst["pp2_bf16"]
    print("worst relative gradient difference:", {k: f"{v:.1e}" for k, v in worst.items()})


# ============================================================================================ CLI

COMMON = ["parallel=single", "trainer.max_steps=3", "trainer.precision=64-true", "sample.max_new_tokens=0",
          "logger=none", *(f"model.{k}={v}" for k, v in MODEL.items()),
          f"parallel.micro_batch_size={MICRO}", f"parallel.global_batch_size={GLOBAL}"]


@pytest.mark.slow
def test_cli_variants_equal_plain(tmp_path):
    plain = run_train(tmp_path / "plain", *COMMON)  # kernels.attention=auto (the default) -> sdpa on CPU
    assert "kernels: attention=sdpa (auto), fused=False, recompute=none" in plain.stdout + plain.stderr
    ref = train_losses(tmp_path / "plain")
    assert len(ref) == 3 and ref[0] != ref[2]
    runs = {"math_fused_selective": ["kernels.attention=math", "kernels.fused=true", "kernels.recompute=selective"],
            "sdpa_full": ["kernels.attention=sdpa", "kernels.recompute=full"]}
    for name, overrides in runs.items():
        run_train(tmp_path / name, *COMMON, *overrides)
        losses = train_losses(tmp_path / name)
        assert len(losses) == 3
        for a, b in zip(losses, ref):
            assert abs(a - b) <= 1e-9 * abs(b), (name, losses, ref)


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["cpu", "gpu"])
def test_cli_refuses_flash_before_any_process(tmp_path, trainer):
    proc = run_train(tmp_path, f"trainer={trainer}", "kernels.attention=flash", "logger=none", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: kernels.attention=flash cannot run: "), proc.stderr
    assert "use kernels.attention=sdpa or auto" in lines[0]
    assert not (tmp_path / "metrics.csv").exists()


# ============================================================================================ GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
def test_gpu_recompute_replays_kernel_dropout():
    """SDPA/flash draw dropout inside the kernel from the CUDA generator: recomputation must replay those masks.
    Their backward kernels may accumulate atomically (not bitwise reproducible), so the check is relative: the
    recomputed gradients must be far closer to `none` than gradients under other masks (other RNG seeds) are."""
    from mlplat.parallel.random import MODEL_PARALLEL_RNG

    torch.cuda.init()
    grid, data = ParallelGrid(), tuple(t.cuda() for t in batch())
    backends = ["sdpa"] + (["flash"] if attention.flash_available()[0] else [])
    for backend in backends:
        grads = {}
        for run in ("none", "selective", "full", "other_masks"):
            recompute = "none" if run == "other_masks" else run
            module = TrainStep(make_cfg(dict(attention=backend, fused=False, recompute=recompute),
                                        precision="bf16-mixed"), grid, torch.device("cuda"))
            if run == "other_masks":
                torch.manual_seed(999)
                module.tracker.reset()
                module.tracker.add(MODEL_PARALLEL_RNG, 4242)
            chunk = module.chunks[0].train()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = chunk(*data)
            loss.backward()
            grads[run] = {n: p.grad.float() for n, p in chunk.named_parameters()}
        noise = rel_diff(grads["other_masks"], grads["none"])
        for run in ("selective", "full"):
            assert rel_diff(grads[run], grads["none"]) < 0.05 * noise, (backend, run, noise)


@pytest.mark.gpu
@pytest.mark.slow
@gpu
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_gpu_cli_mixed_precision_trains(tmp_path, precision):
    """One GPU through the CLI: auto attention (flash when installed), fused operators, selective recompute."""
    proc = run_train(tmp_path, "trainer=gpu", "parallel=single", "trainer.devices=1", f"trainer.precision={precision}",
                     "trainer.max_steps=5", "sample.max_new_tokens=0", "logger=none", "kernels.fused=true",
                     "kernels.recompute=selective", "model.dropout=0.1")
    assert "kernels: attention=" in proc.stdout + proc.stderr
    losses = train_losses(tmp_path)
    assert len(losses) == 5 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


# ============================================================================================ benchmark script


def test_gpu_benchmark_script_runs_tiny_on_cpu(capsys):
    """experiments/kernels_gpu/bench.py has not run on a GPU here; --tiny at least exercises it end to end."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernels_bench", REPO / "experiments" / "kernels_gpu" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch.set_num_threads(1)
    assert bench.main(["--tiny", "--backends", "flash,sdpa", "--fused", "off", "--warmup", "0", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "mlplat flash" in out and "skipped" in out  # no CUDA: reported, not crashed
    assert "| mlplat sdpa | sdpa | False | none |" in out and "| plain PyTorch + SDPA |" in out
