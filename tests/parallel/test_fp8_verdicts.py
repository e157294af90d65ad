"""The FP8 kernels' verdicts of a run (`mlplat.parallel.fp8_verdicts`), proven without a GPU (the device's capability
stood in for, the probes replaced): every verdict the run needs is probed in setup and agreed by MIN, so one rank's
failed probe gives every rank the emulation; once decided no GEMM probes, and inside a process group a verdict
left undecided is raised, not probed in a pass; a CPU run probes nothing and posts no collective."""
from __future__ import annotations

import threading

import pytest
import torch

from mlplat.parallel import fp8_blockwise as bw
from mlplat.parallel import fp8_grouped as gr
from mlplat.parallel.fp8_verdicts import decide_fp8_kernels, needed, world_min
from mlplat.precision import blockwise_verdicts, grouped_fp8_verdicts
from tests.helpers.fp8 import unprobed

CUDA0 = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def no_verdicts(monkeypatch):
    """No verdict before or after a test; an sm90 device with CUDA 12.9 stood in for."""
    monkeypatch.setattr(bw, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(bw, "_cuda_version", lambda: (12, 9))
    monkeypatch.setattr(gr, "_capability", lambda index: (9, 0))
    with unprobed(blockwise_verdicts, grouped_fp8_verdicts):
        yield


def test_the_verdicts_a_run_needs():
    """Blockwise's output dtypes are the precision's GEMM and weight dtypes (float64 has no kernel); the experts'
    grouped kernel is asked for under tensorwise and rowwise where the model has experts and computes in bf16."""
    assert needed("blockwise", "bf16-megatron", False) == (("bfloat16",), ())
    assert needed("blockwise", "32-true", True) == (("float32",), ())
    assert needed("blockwise", "64-true", True) == ((), ())
    assert needed("rowwise", "bf16-megatron", True) == ((), ("rowwise",))
    assert needed("tensorwise", "bf16-true", False) == ((), ())
    assert needed("tensorwise", "32-true", True) == ((), ())
    assert needed("none", "bf16-megatron", True) == ((), ())


def _world(n: int):
    """`n` ranks as threads: each rank's agreement posts its ints and gets the element-wise minimum of all."""
    posted, barrier, calls = {}, threading.Barrier(n), []

    def agree_for(rank: int):
        def agree(local: list[int]) -> list[int]:
            calls.append(rank)
            posted[rank] = list(local)
            barrier.wait()
            out = [min(v) for v in zip(*posted.values())]
            barrier.wait()
            return out
        return agree
    return agree_for, calls


def test_one_ranks_failed_probe_gives_every_rank_the_emulation(monkeypatch, caplog):
    """Two ranks with blockwise experts and bf16 (blockwise's verdict) and rowwise experts (the grouped one): on
    rank 0 the probes raise an out-of-memory, on rank 1 they agree. Both post one agreement of their verdicts and
    both keep the emulation; the rank whose probe agreed says so in one line."""
    def probe(device, what):
        if threading.current_thread().name == "rank0":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return True, "agrees"

    monkeypatch.setattr(bw, "probe", probe)
    monkeypatch.setattr(gr, "probe", probe)
    agree_for, calls = _world(2)
    decided = {}
    for recipe, experts in (("blockwise", False), ("rowwise", True)):
        ranks = [threading.Thread(target=lambda r=r: decided.__setitem__(r, decide_fp8_kernels(
            recipe, "bf16-megatron", experts, CUDA0, agree_for(r))), name=f"rank{r}") for r in (0, 1)]
        for t in ranks:
            t.start()
        for t in ranks:
            t.join(timeout=30)
        key = ("cuda:0", "bfloat16") if recipe == "blockwise" else ("cuda:0", "bfloat16", "rowwise")
        assert decided[0] == decided[1] == {key: False} and sorted(calls) == [0, 1], (decided, calls)
        calls.clear()
    assert blockwise_verdicts == {("cuda:0", "bfloat16"): False}
    assert grouped_fp8_verdicts == {("cuda:0", "bfloat16", "rowwise"): False}
    said = [r.getMessage() for r in caplog.records]
    assert any("raised OutOfMemoryError: CUDA out of memory" in s for s in said), said
    assert any("emulated, as on every rank: another rank's probe did not agree" in s for s in said), said


def test_once_decided_no_gemm_probes_and_an_undecided_one_is_raised_in_a_run(monkeypatch):
    """After setup's decision the GEMMs' gates read the kept verdicts, both kernels' in one agreement; no probe runs
    however often they ask. Inside a process group a verdict setup did not decide is raised, never probed; one
    process outside a run still probes on first use."""
    probes = []

    def probe(device, what):
        probes.append(what)
        return True, "agrees"

    monkeypatch.setattr(bw, "probe", probe)
    monkeypatch.setattr(gr, "probe", probe)
    agreements = []
    decided = decide_fp8_kernels("blockwise", "32-true", True, CUDA0, lambda v: agreements.append(v) or v)
    decided.update(decide_fp8_kernels("rowwise", "bf16-megatron", True, CUDA0, lambda v: agreements.append(v) or v))
    assert agreements == [[1], [1]] and all(decided.values()) and len(probes) == 2
    for _ in range(3):
        assert bw.kernel_agrees(CUDA0, torch.float32) and gr.kernel_agrees(CUDA0, "rowwise")
    assert len(probes) == 2
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="no verdict for cuda:0 into bfloat16.*never inside a pass"):
        bw.kernel_agrees(CUDA0, torch.bfloat16)
    with pytest.raises(RuntimeError, match="kernels.fp8=tensorwise: no verdict .* never inside a pass"):
        gr.kernel_agrees(CUDA0, "tensorwise")
    monkeypatch.undo()
    monkeypatch.setattr(bw, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(bw, "_cuda_version", lambda: (12, 9))
    monkeypatch.setattr(bw, "probe", probe)
    assert bw.kernel_agrees(CUDA0, torch.bfloat16) and len(probes) == 3


def test_a_cpu_run_probes_nothing_and_posts_no_collective(monkeypatch):
    """On a CPU (and with nothing needed on CUDA) no probe runs, the agreement is not called and no verdict is kept;
    without a process group there is no agreement to post."""
    monkeypatch.setattr(bw, "probe", lambda *a: pytest.fail("probed"))
    monkeypatch.setattr(gr, "probe", lambda *a: pytest.fail("probed"))

    def agree(local):
        pytest.fail("a verdict collective was posted")

    for recipe in ("blockwise", "rowwise", "tensorwise"):
        assert decide_fp8_kernels(recipe, "bf16-megatron", True, torch.device("cpu"), agree) == {}
    assert decide_fp8_kernels("blockwise", "64-true", True, CUDA0, agree) == {}
    assert decide_fp8_kernels("none", "bf16-megatron", True, CUDA0, agree) == {}
    assert blockwise_verdicts == {} and grouped_fp8_verdicts == {}
    assert world_min(torch.device("cpu")) is None  # this test process has no process group
