"""PipelineEngine (mlplat.parallel.pipeline.engine) on its own: toy chunks in float64, no GPT, no Lightning.

The reference is a plain loop over the micro-batches: each runs through chunks 0..n-1 and back-propagates loss/m.
The engine must give the same mean loss and the same gradients whatever its schedule, on one pipeline rank (all
chunks in this process, hand-overs without messages) and on two gloo processes (pp=2, messages on the directed
channels). It must also tell its hooks when a chunk's gradients are final: at the chunk's last B, or, in the
zero-bubble schedules, at its last W, after which every parameter's gradient is complete.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mlplat.harness import nccl_strict
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.layout import registry
from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.parallel.linear import linear
from mlplat.parallel.pipeline.engine import PipelineEngine
from mlplat.parallel.pipeline.p2p import StageComm
from tests.helpers.dist import run_distributed
from tests.helpers.schedules import TOY

F64 = torch.float64
VOCAB, HIDDEN, SEQ, MICRO = 11, 8, 5, 2  # activations between chunks: [MICRO, SEQ, HIDDEN]
TOL = 1e-12
ONE_RANK = [("gpipe", 1), ("1f1b", 1), ("interleaved", 1), ("zb_h1", 1), ("zbv", 2)]  # (schedule, v) at pp=1
TWO_RANKS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb_h1", 1), ("zbv", 2)]  # at pp=2


def make_engine(chunks, grid, kind, v, comm=None, **hooks) -> PipelineEngine:
    """The one place this file builds an engine (keep it so when the constructor's arguments change)."""
    return PipelineEngine(chunks, grid, PipelineLayout(grid.pp, v, kind), comm, **hooks)


class _Linear(nn.Module):
    """A linear layer whose weight gradient the engine can defer to W, like the tensor-parallel linears."""

    wgrad_store = None  # set by the engine under the zero-bubble schedules

    def __init__(self, n_in: int, n_out: int, gen: torch.Generator):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in, generator=gen, dtype=F64) / n_in**0.5)
        self.bias = nn.Parameter(0.1 * torch.randn(n_out, generator=gen, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.wgrad_store)


class _Chunk(nn.Module):
    """Chunk c of n: token embedding (first chunk), tanh(linear), then logits and the mean loss (last chunk)."""

    def __init__(self, c: int, n: int):
        super().__init__()
        gen = torch.Generator().manual_seed(1000 + c)  # the same weights in every process
        self.first, self.last = c == 0, c == n - 1
        if self.first:
            self.embedding = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen, dtype=F64))
        self.layer = _Linear(HIDDEN, HIDDEN, gen)
        if self.last:
            self.head = _Linear(HIDDEN, VOCAB, gen)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            x = F.embedding(x, self.embedding)
        x = self.block(x)
        if not self.last:
            return x
        logits = self.head(x)
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(x))  # tanh's backward reads its output: not to be freed once sent


class _ResidualChunk(_Chunk):
    """Ends in a residual add, like DecoderChunk: its backward does not read the output (freed once sent)."""

    frees_sent_output = True

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(x)) + x


def _micro_batches(m: int, labels: bool = True) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
        target = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
        out.append((tokens, target if labels else None))
    return out


def _reference(n: int, micro_batches, chunk_class=None) -> tuple[torch.Tensor, dict, list[torch.Tensor]]:
    """A plain loop: (mean loss, {(chunk, name): grad}, the last chunk's logits per micro-batch)."""
    chunks = [(chunk_class or _Chunk)(c, n) for c in range(n)]
    m = len(micro_batches)
    losses, logits = [], []
    for tokens, labels in micro_batches:
        x = tokens
        for chunk in chunks[:-1]:
            x = chunk(x)
        loss = chunks[-1](x, labels)
        (loss / m).backward()
        losses.append(loss.detach())
        with torch.no_grad():
            logits.append(chunks[-1](x))
    grads = {(c, name): p.grad.clone() for c, chunk in enumerate(chunks) for name, p in chunk.named_parameters()}
    return torch.stack(losses).mean(), grads, logits


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


# ---------------------------------------------------------------------------------------------- one pipeline rank


@pytest.mark.parametrize("kind,v", ONE_RANK, ids=[k for k, _ in ONE_RANK])
def test_one_rank_equals_a_plain_loop_and_says_when_gradients_are_final(kind, v):
    m = 3
    chunks = {c: _Chunk(c, v) for c in range(v)}
    ref_loss, ref_grads, _ = _reference(v, _micro_batches(m))
    names = {param: (c, name) for c, chunk in chunks.items() for name, param in chunk.named_parameters()}
    calls: list[tuple[int, int, bool]] = []
    ready: dict[tuple[int, str], float] = {}  # (chunk, name) -> the gradient's difference from the reference then

    def before_backward(c, mb, final):
        calls.append((c, mb, final))

    def grad_ready(param):
        key = names[param]
        assert key not in ready, f"{key} reported twice"
        ready[key] = _max_diff(param.grad, ref_grads[key])

    engine = make_engine(chunks, ParallelGrid(), kind, v, before_backward=before_backward, grad_ready=grad_ready)
    loss = engine.run(_micro_batches(m))

    assert abs(float(loss) - float(ref_loss)) <= TOL, (float(loss), float(ref_loss))
    for (c, name), grad in ref_grads.items():
        got = dict(chunks[c].named_parameters())[name].grad
        assert _max_diff(got, grad) <= TOL, (c, name)
    split = engine.layout.spec.split_backward
    assert bool(engine.stores) == split and not any(s.pending for s in engine.stores.values())
    for c in chunks:
        flags = [final for chunk, _, final in calls if chunk == c]
        # One call per B, plus one at the chunk's last W in the zero-bubble schedules; only the last says "final".
        assert flags == [False] * (m - 1 + split) + [True], (c, flags)
    if split:  # W told the reducer about every parameter, each gradient already complete
        assert set(ready) == set(ref_grads) and max(ready.values()) <= TOL, ready
    else:
        assert not ready


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("zbv", 2)])
def test_forward_only_keeps_the_outputs_and_leaves_no_gradients(kind, v):
    m = 3
    chunks = {c: _Chunk(c, v) for c in range(v)}
    ref_loss, _, ref_logits = _reference(v, _micro_batches(m))
    engine = make_engine(chunks, ParallelGrid(), kind, v)

    loss = engine.run(_micro_batches(m), forward_only=True)  # validation: labels, a loss, no backward
    assert abs(float(loss) - float(ref_loss)) <= TOL
    assert engine.run(_micro_batches(m, labels=False), forward_only=True) is None  # generation: the logits
    assert len(engine.last_outputs) == m
    for got, ref in zip(engine.last_outputs, ref_logits):
        assert _max_diff(got, ref) <= TOL
    assert all(p.grad is None for chunk in chunks.values() for p in chunk.parameters())


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("zb_h1", 1), ("zbv", 2)])
def test_loss_scale_scales_the_gradients_not_the_loss(kind, v):
    """fp16 loss scaling: a power of two multiplies every gradient exactly; the returned loss is unscaled."""
    runs = []
    for scale in (1.0, 2.0**5):
        chunks = {c: _Chunk(c, v) for c in range(v)}
        loss = make_engine(chunks, ParallelGrid(), kind, v).run(_micro_batches(4), loss_scale=scale)
        runs.append((loss, [p.grad for chunk in chunks.values() for p in chunk.parameters()]))
    (loss1, grads1), (loss32, grads32) = runs
    assert torch.equal(loss1, loss32)
    assert all(torch.equal(g32, 32 * g1) for g1, g32 in zip(grads1, grads32))


def test_one_rank_runs_a_registered_schedule():
    """A schedule registered by a test (GPipe with its backwards last in, first out) runs as the others do."""
    with registry.registered(TOY):
        test_one_rank_equals_a_plain_loop_and_says_when_gradients_are_final(TOY.name, 1)


# ---------------------------------------------------------------------------------------------- two pipeline ranks


def _two_stages(rank, world_size):
    """Every schedule at pp=2 (v=2 for interleaved and zbv) on this rank's chunks; returns the worst differences
    from the plain loop: {schedule: (loss or None, gradients, forward-only logits or None, chunks held)}."""
    torch.set_num_threads(1)
    grid = ParallelGrid(tp=1, pp=2, dp=1)
    comm = StageComm(grid, (MICRO, SEQ, HIDDEN), F64, torch.device("cpu"))
    m = 4
    out = {}
    for kind, v in TWO_RANKS:
        n = 2 * v
        chunks = {c: _Chunk(c, n) for c in PipelineLayout(2, v, kind).chunks_of(grid.pp_rank)}
        ref_loss, ref_grads, ref_logits = _reference(n, _micro_batches(m))
        engine = make_engine(chunks, grid, kind, v, comm)
        loss = engine.run(_micro_batches(m))
        grads = max(_max_diff(p.grad, ref_grads[(c, name)])
                    for c, chunk in chunks.items() for name, p in chunk.named_parameters())
        engine.run(_micro_batches(m, labels=False), forward_only=True)
        logits = None
        if n - 1 in chunks:
            logits = max(_max_diff(a, b) for a, b in zip(engine.last_outputs, ref_logits, strict=True))
        out[kind] = (None if loss is None else abs(float(loss) - float(ref_loss)), grads, logits, sorted(chunks))
    return out


def test_two_stages_equal_a_plain_loop():
    results = run_distributed(_two_stages, 2, timeout=120)
    for kind, v in TWO_RANKS:
        per_rank = [res[kind] for res in results]
        held = sorted(c for _, _, _, chunks in per_rank for c in chunks)
        assert held == list(range(2 * v)), (kind, held)  # each chunk on exactly one rank
        losses = [loss for loss, _, _, _ in per_rank if loss is not None]
        logits = [lg for _, _, lg, _ in per_rank if lg is not None]
        assert len(losses) == 1 and len(logits) == 1, kind  # only the rank with the last chunk has them
        assert losses[0] <= TOL and logits[0] <= TOL, (kind, losses, logits)
        assert max(grads for _, grads, _, _ in per_rank) <= TOL, (kind, per_rank)


def test_chunks_the_layout_does_not_place_on_this_rank_are_refused():
    with pytest.raises(ValueError, match="got chunks"):
        make_engine({0: _Chunk(0, 2)}, ParallelGrid(), "zbv", 2)  # zbv at pp=1 places chunks 0 and 1 here


# ----------------------------------------------------------------------- NCCL-strict: first uses and live buffers

class _CountingComm(StageComm):
    """Counts the send buffers alive at once: posted, and not yet released by the wait of their group."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.live = self.peak = 0

    def post(self, messages, payload):
        group = super().post(messages, payload)
        n = len(group.sends)
        self.live += n
        self.peak = max(self.peak, self.live)
        wait = group.wait

        def counted_wait():
            self.live -= n
            return wait()
        group.wait = counted_wait
        return group


STRICT_CASES = [("gpipe", 1, 1), ("gpipe", 1, 2), ("1f1b", 1, 1), ("1f1b", 1, 2), ("zb_h1", 1, 1), ("zb_h1", 1, 2),
                ("zbv", 2, 1), ("zbv", 2, 2), ("interleaved", 2, 4), ("1f1b", 1, 32), ("interleaved", 2, 32)]


def _strict_pipeline(rank, world_size):
    """pp = 4 in NCCL-strict mode: every schedule at m = 1 and 2 against the plain loop, and the most send
    buffers alive at once at m = 32; then the same m = 1 step on a grid whose communicators are left to their
    first use, which deadlocks (each rank times out in a different channel's creation)."""
    torch.set_num_threads(1)
    assert nccl_strict.enabled()
    grid = ParallelGrid(tp=1, pp=world_size, dp=1)
    out = {}
    for kind, v, m in STRICT_CASES:
        n = world_size * v
        comm = _CountingComm(grid, (MICRO, SEQ, HIDDEN), F64, torch.device("cpu"))
        chunks = {c: _Chunk(c, n) for c in PipelineLayout(world_size, v, kind).chunks_of(grid.pp_rank)}
        ref_loss, ref_grads, _ = _reference(n, _micro_batches(m))
        loss = make_engine(chunks, grid, kind, v, comm).run(_micro_batches(m))
        grads = max(_max_diff(p.grad, ref_grads[(c, name)])
                    for c, chunk in chunks.items() for name, p in chunk.named_parameters())
        out[(kind, v, m)] = (None if loss is None else abs(float(loss) - float(ref_loss)), grads, comm.peak)
    # A chunk whose output its backward does not read (a residual add, as in DecoderChunk): freed once sent.
    freed = []
    for kind, v, m in (("1f1b", 1, 8), ("zbv", 2, 8)):
        n = world_size * v
        chunks = {c: _ResidualChunk(c, n) for c in PipelineLayout(world_size, v, kind).chunks_of(grid.pp_rank)}
        ref_loss, ref_grads, _ = _reference(n, _micro_batches(m), _ResidualChunk)
        engine = make_engine(chunks, grid, kind, v, StageComm(grid, (MICRO, SEQ, HIDDEN), F64, torch.device("cpu")))
        receive = engine._receive

        def counting_receive(st, group, receive=receive):
            receive(st, group)
            freed.append(sum(1 for o in st.outputs.values() if isinstance(o, torch.autograd.graph.GradientEdge)))
        engine._receive = counting_receive
        loss = engine.run(_micro_batches(m))
        grads = max(_max_diff(p.grad, ref_grads[(c, name)])
                    for c, chunk in chunks.items() for name, p in chunk.named_parameters())
        out[("residual", kind)] = (None if loss is None else abs(float(loss) - float(ref_loss)), grads)
    out["freed"] = max(freed)
    lazy = ParallelGrid(tp=1, pp=world_size, dp=1, timeout=timedelta(seconds=4), device=None)
    comm = StageComm(lazy, (MICRO, SEQ, HIDDEN), F64, torch.device("cpu"))
    chunks = {c: _Chunk(c, world_size) for c in PipelineLayout(world_size, 1, "1f1b").chunks_of(lazy.pp_rank)}
    try:
        make_engine(chunks, lazy, "1f1b", 1, comm).run(_micro_batches(1))
        out["lazy"] = "ran"
    except RuntimeError as err:
        out["lazy"] = str(err).splitlines()[0]
    return out


def test_nccl_strict_pipeline_at_one_micro_batch_and_bounded_send_buffers():
    results = run_distributed(_strict_pipeline, 4, timeout=240)
    for kind, v, m in STRICT_CASES:
        per_rank = [res[(kind, v, m)] for res in results]
        assert [x for x, _, _ in per_rank if x is not None][0] <= TOL, (kind, m)
        assert max(g for _, g, _ in per_rank) <= TOL, (kind, m)
        if m == 32:  # at most 2·v + 2 send buffers alive on any rank (32 and 96 when sends waited at step end)
            assert 0 < max(peak for _, _, peak in per_rank) <= 2 * v + 2, (kind, per_rank)
    for kind in ("1f1b", "zbv"):
        per_rank = [res[("residual", kind)] for res in results]
        assert [x for x, _ in per_rank if x is not None][0] <= TOL and max(g for _, g in per_rank) <= TOL, kind
    assert max(res["freed"] for res in results) > 0  # sent outputs were freed before their backward
    # Left to their first use, the communicators deadlock the m = 1 step, as on NCCL: rank 0 waits in the creation
    # of channel (1 -> 0), rank 1 in that of (0 -> 1); gloo's timeout ends the wait.
    assert results[0]["lazy"] != "ran" and "timed out" in results[0]["lazy"].lower(), results[0]["lazy"]


def test_messages_travel_in_the_gemm_dtype_and_arrive_in_the_stage_dtype():
    """bf16-mixed keeps fp32 weights, so its activations are fp32: they travel as bf16 (half the bytes in flight)."""
    from mlplat.step.parts import AUTOCAST_DTYPES

    assert AUTOCAST_DTYPES == {"bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16, "16-mixed": torch.float16,
                               "16": torch.float16}  # Lightning's short names too
    comm = StageComm(ParallelGrid(), (MICRO, SEQ, HIDDEN), torch.float32, torch.device("cpu"),
                     wire_dtype=AUTOCAST_DTYPES["bf16-mixed"])
    x = torch.randn(MICRO, SEQ, HIDDEN)
    wire = comm.scatter(x)
    assert wire.dtype == torch.bfloat16 and comm._wire_shape() == (MICRO, SEQ, HIDDEN)
    got = comm.gather(wire)
    assert got.dtype == torch.float32 and torch.equal(got, x.to(torch.bfloat16).float())
