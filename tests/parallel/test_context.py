"""Context parallelism's pieces against one process, in float64: the load-balanced split, and ring attention
(forward and the gradients of q, k, v) equal to dense causal attention over the whole window, at c = 2 and 4,
with grouped-query attention, with packed documents, values narrower than the keys, and for both block kernels; MLA's
ring, which carries the latents, likewise. One 4-rank launch runs every
check (at c = 2 the four ranks are two rings)."""
from __future__ import annotations

import pytest
import torch

from mlplat.labels import IGNORE
from mlplat.parallel.placement import chunk_bounds, local_index, place, positions_of
from tests.helpers.dist import run_distributed

F64 = torch.float64


def _reference(q, k, v, documents=None):
    """Dense causal attention over the whole window (with a block-diagonal document mask), float64."""
    per = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(per, 1), v.repeat_interleave(per, 1)
    s = q.size(2)
    keep = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    if documents is not None:
        keep = keep & (documents[:, None, :, None] == documents[:, None, None, :])
    scores = (q @ k.transpose(-2, -1)) / q.size(-1) ** 0.5
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v


CASES = [  # (cp, heads, kv_heads, packed, kernel[, the values' head size: MLA's, narrower than q's and k's 8])
    (2, 4, 4, False, "math"), (2, 4, 2, True, "math"), (4, 4, 1, False, "math"), (4, 2, 2, True, "math"),
    (2, 4, 2, False, "sdpa"), (4, 4, 2, True, "sdpa"), (2, 4, 4, True, "math", 6), (4, 4, 4, False, "sdpa", 6),
    (2, 4, 4, True, "sdpa", 6),
]


KERNEL_NAMES = ("math", "sdpa")


def _inputs(heads, kv_heads, packed, dv=8, s=16, b=2, d=8):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads + 100 * packed)
    q = torch.randn(b, heads, s, d, generator=g, dtype=F64)
    k = torch.randn(b, kv_heads, s, d, generator=g, dtype=F64)
    v = torch.randn(b, kv_heads, s, dv, generator=g, dtype=F64)
    dout = torch.randn(b, heads, s, dv, generator=g, dtype=F64)
    documents = None
    if packed:  # documents of uneven lengths, some crossing the chunk boundaries, one per sample differing
        ends = torch.tensor([[3, 4, 9, 15], [6, 7, 12, 14]])
        documents = torch.zeros(b, s, dtype=torch.long)
        for i in range(b):
            for e in ends[i]:
                documents[i, e + 1:] += 1
    return q, k, v, dout, documents


def _ring_worker(rank, world):
    from mlplat.parallel.context import Ring, ring_attention
    from mlplat.parallel.grid import ParallelGrid

    out = {}
    for cp in (2, 4):
        grid = ParallelGrid(1, 1, world // cp, cp=cp)
        ring = Ring(grid)
        for case in [c for c in CASES if c[0] == cp]:
            _, heads, kv_heads, packed, kernel, *dv = case
            q, k, v, dout, documents = _inputs(heads, kv_heads, packed, *dv)
            s = q.size(2)
            labels = torch.zeros(q.size(0), s, dtype=torch.long)
            _, _, layout = place(labels, labels, s, cp, grid.cp_rank, documents)
            mine = [x[:, :, layout.index].clone().requires_grad_() for x in (q, k, v)]
            o = ring_attention(*mine, layout, ring, kernel)
            o.backward(dout[:, :, layout.index])
            out[case] = (layout.index, o.detach(), *(x.grad for x in mine))
    out["latent"] = _latent_ring_worker(world)
    grid = ParallelGrid(1, 1, world // 2, cp=2)
    ring = Ring(grid)
    for kernel in KERNEL_NAMES:  # bfloat16: blocks computed and merged in float32, backward outside autocast
        q, k, v, dout, documents = _inputs(4, 2, True)
        _, _, layout = place(dout[:, 0], dout[:, 0], q.size(2), 2, grid.cp_rank, documents)
        mine = [x[:, :, layout.index].to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
        o = ring_attention(*mine, layout, ring, kernel)
        o.backward(dout[:, :, layout.index].to(torch.bfloat16))
        out[("bf16", kernel)] = (layout.index, o.detach().double(), *(x.grad.double() for x in mine))
    out["packed"] = _packed_model_worker(grid)
    out["posts"] = {cp: ring_posts(ParallelGrid(1, 1, world // cp, cp=cp)) for cp in (2, 4)}
    out["memory"] = {cp: layer_memory(ParallelGrid(1, 1, world // cp, cp=cp)) for cp in (2, 4)}
    return out


LATENT_CASES = [(2, "math", False), (2, "sdpa", True), (4, "sdpa", False), (4, "math", True)]  # (cp, kernel, packed)
NOPE, ROPE, DV, RANK = 6, 4, 5, 7  # MLA's q/k channels without and with rotary, values', the latent's


def _latent_inputs(packed, heads=3, s=16, b=2):
    """q, the latent c_kv, the rotated shared k_rope, kv_up's weight, dout, documents."""
    g = torch.Generator().manual_seed(7 + packed)
    q = torch.randn(b, heads, s, NOPE + ROPE, generator=g, dtype=F64)
    c_kv = torch.randn(b, s, RANK, generator=g, dtype=F64)
    k_rope = torch.randn(b, 1, s, ROPE, generator=g, dtype=F64)
    weight = torch.randn(heads * (NOPE + DV), RANK, generator=g, dtype=F64) / RANK ** 0.5
    dout = torch.randn(b, heads, s, DV, generator=g, dtype=F64)
    documents = _inputs(4, 4, True)[4] if packed else None
    return q, c_kv, k_rope, weight, dout, documents


def _latent_ring_worker(world):
    """MLA's ring, which carries the latents: each case's output and the gradients of q, c_kv, k_rope (this rank's
    tokens) and of kv_up's weight (this rank's share)."""
    from mlplat.parallel.context import Ring
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.parallel.latent_ring import latent_ring_attention

    out = {}
    for cp, kernel, packed in LATENT_CASES:
        grid = ParallelGrid(1, 1, world // cp, cp=cp)
        q, c_kv, k_rope, weight, dout, documents = _latent_inputs(packed)
        s = q.size(2)
        labels = torch.zeros(q.size(0), s, dtype=torch.long)
        _, _, layout = place(labels, labels, s, cp, grid.cp_rank, documents)
        mine = [q[:, :, layout.index].clone().requires_grad_(), c_kv[:, layout.index].clone().requires_grad_(),
                k_rope[:, :, layout.index].clone().requires_grad_(), weight.clone().requires_grad_()]
        o = latent_ring_attention(mine[0], mine[1], mine[2], mine[3], NOPE, layout, Ring(grid), kernel)
        o.backward(dout[:, :, layout.index])
        out[(cp, kernel, packed)] = (grid.dp_rank, layout.index, o.detach(), *(x.grad for x in mine))
    return out


def ring_posts(grid) -> list:
    """What the ring posted and waited for, in order, over two layers' forward and backward (a Llama model, packed
    window, selective recomputation: the recomputed forward walks the ring inside backward)."""
    from mlplat.config import KernelsConfig
    from mlplat.data.packing import documents_of
    from tests.model.test_packing import EOD, S, chunk_on, packed_window

    chunk = chunk_on(grid, "llama", "math").train()
    chunk.set_kernels(KernelsConfig(attention="math", recompute="selective"), "math")
    chunk.ring.log = []
    x, y = packed_window()
    xs, ys, layout = place(x, y, S, grid.cp, grid.cp_rank, documents_of(x, EOD))
    chunk(xs, ys, layout).backward()
    return chunk.ring.log


def layer_memory(grid) -> tuple[int, int, int]:
    """One Llama layer (grouped-query attention) on this rank's s/c tokens, float64, sdpa: (bytes its forward saves
    for backward, not counting weights; the ring's peak bytes in flight in forward; in backward)."""
    from tests.model.test_packing import S, chunk_on

    chunk = chunk_on(grid, "llama", "sdpa").train()
    layer = chunk.layers["0"]
    weights = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    x = torch.randn(2, S // grid.cp, 32, dtype=F64, requires_grad=True)
    tokens = torch.zeros(2, S, dtype=torch.long)
    layout = place(tokens, tokens, S, grid.cp, grid.cp_rank)[2]
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x, layout)
    ring = chunk.ring
    if ring is None:  # c = 1
        return sum(saved.values()), 0, 0
    forward_peak, ring.peak_bytes = ring.peak_bytes, 0
    y.backward(torch.ones_like(y))
    return sum(saved.values()), forward_peak, ring.peak_bytes


def _packed_model_worker(grid):
    """Each architecture's packed window on a cp = 2 ring: (held places, loss, logits, logits with one document's
    tokens changed)."""
    from mlplat.data.packing import documents_of
    from tests.model.test_packing import ARCHS, EOD, S, changed_document, chunk_on, packed_window

    results = {}
    x, y = packed_window()
    changed, _ = changed_document(x)
    for arch in ARCHS:
        chunk = chunk_on(grid, arch, "math")
        per = []
        for tokens in (x, changed):
            xs, ys, layout = place(tokens, y, S, grid.cp, grid.cp_rank, documents_of(tokens, EOD))
            with torch.no_grad():
                per.append((chunk(xs, ys, layout), chunk(xs, None, layout)))
        results[arch] = (layout.index, per[0][0], per[0][1], per[1][1])
    return results


@pytest.fixture(scope="module")
def ring_results():
    return run_distributed(_ring_worker, 4)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"cp{c[0]}-h{c[1]}kv{c[2]}-{'packed' if c[3] else 'causal'}"
                                                      f"-{c[4]}" + (f"-dv{c[5]}" if len(c) > 5 else ""))
def test_ring_attention_equals_dense(ring_results, case):
    q, k, v, dout, documents = _inputs(*case[1:4], *case[5:])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _reference(*leaves, documents)
    ref.backward(dout)
    full = {"out": torch.zeros_like(dout), "dq": torch.zeros_like(q), "dk": torch.zeros_like(k),
            "dv": torch.zeros_like(v)}
    for rank_result in ring_results:
        index, o, dq, dk, dv = rank_result[case]
        for name, part in (("out", o), ("dq", dq), ("dk", dk), ("dv", dv)):
            full[name][:, :, index] = part  # the two rings of c = 2 hold the same answer twice
    for name, want in (("out", ref.detach()), ("dq", leaves[0].grad), ("dk", leaves[1].grad),
                       ("dv", leaves[2].grad)):
        err = (full[name] - want).abs().max().item()
        assert err < 1e-12, (name, err)


@pytest.mark.parametrize("case", LATENT_CASES, ids=lambda c: f"cp{c[0]}-{c[1]}-{'packed' if c[2] else 'causal'}")
def test_latent_ring_equals_dense_latent_attention(ring_results, case):
    """MLA's ring (the latents travel, each rank up-projects every block): output and the gradients of q, the latent,
    the shared rotary key and kv_up's weight (summed over a ring's ranks) equal dense attention over the keys and
    values up-projected in one process."""
    q, c_kv, k_rope, weight, dout, documents = _latent_inputs(case[2])
    leaves = [x.clone().requires_grad_() for x in (q, c_kv, k_rope, weight)]
    b, heads, s, _ = q.shape
    kv = (leaves[1] @ leaves[3].t()).view(b, s, heads, NOPE + DV).transpose(1, 2)
    k = torch.cat((kv[..., :NOPE], leaves[2].expand(b, heads, s, ROPE)), dim=-1)
    ref = _reference(leaves[0], k, kv[..., NOPE:], documents)
    ref.backward(dout)
    full = [torch.zeros_like(x) for x in (ref, q, c_kv, k_rope)]
    dweight = torch.zeros_like(weight)
    for rank_result in ring_results:
        ring, index, o, dq, dc, dr, dw = rank_result["latent"][case]
        for whole, part, dim in zip(full, (o, dq, dc, dr), (2, 2, 1, 2)):
            whole.index_copy_(dim, index, part)  # the two rings of c = 2 hold the same answer twice
        if ring == 0:
            dweight += dw
    for got, want, name in zip((*full, dweight), (ref.detach(), *(x.grad for x in leaves)),
                               ("out", "dq", "dc_kv", "dk_rope", "dweight")):
        err = (got - want).abs().max().item()
        assert err < 1e-12, (name, err)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_packed_window_under_context_parallelism(ring_results, arch):
    """cp = 2: the packed window's loss is the documents' own (one process), the logits are one process's, and one
    document's tokens leave every other document's logits unchanged, bit for bit."""
    from tests.model.test_packing import S, changed_document, chunk_for, documents_own_loss, packed_window

    x, y = packed_window()
    _, (a, b) = changed_document(x)
    single = chunk_for(arch)
    xs, _, layout = place(x, y, S, documents=documents_of_window(x))
    with torch.no_grad():
        want_logits = single(xs, None, layout)
    ring = ring_results[:2]  # cp ranks 0 and 1 of data-parallel replica 0
    loss = sum(r["packed"][arch][1] for r in ring) / 2
    assert abs(float(loss) - float(documents_own_loss(single, x, y))) < 1e-12
    logits = torch.zeros_like(want_logits)
    for r in ring:
        index, _, got, _ = r["packed"][arch]
        logits[:, index] = got
    assert (logits - want_logits).abs().max() < 1e-12
    outside = torch.ones(S, dtype=torch.bool)
    outside[a:b] = False
    for r in ring:
        index, _, before, after = r["packed"][arch]
        keep = outside[index]
        assert torch.equal(before[:, keep], after[:, keep])
        assert keep.all() or not torch.equal(before[:, ~keep], after[:, ~keep])


def documents_of_window(x):
    from mlplat.data.packing import documents_of
    from tests.model.test_packing import EOD

    return documents_of(x, EOD)


def test_activation_memory_per_layer_is_one_cth(ring_results):
    """Measured: what a layer saves for backward at c = 2 and 4 is 1/c of c = 1's (within 2%); beside it the ring
    holds two K/V blocks in forward (the one computed on, the one arriving) and four in backward (with dK/dV)."""
    from mlplat.parallel.grid import ParallelGrid
    from tests.parallel.test_context import layer_memory as measure

    one, _, _ = measure(ParallelGrid())
    for cp in (2, 4):
        saved, forward_ring, backward_ring = ring_results[0]["memory"][cp]
        assert abs(saved * cp / one - 1) < 0.02, (cp, saved, one)
        kv_block = 2 * 2 * 2 * (48 // cp) * 8 * 8  # k and v, b=2, 2 KV heads, s/c tokens, head_dim 8, float64
        assert (forward_ring, backward_ring) == (2 * kv_block, 4 * kv_block), (cp, forward_ring, backward_ring)


def transport_plans(logs: list[list]) -> list:
    """The ranks' recorded ring posts as plans of the NCCL transport model (mlplat.perf.transport): each isend and
    irecv a group of its own, a block's compute between a hop's post and its wait; a message is named by its hop
    and its occurrence, so a send matched with the receive of another hop is a mismatch."""
    from collections import Counter

    from mlplat.parallel.layout.exchange import Compute, Post, Wait
    from mlplat.parallel.layout.schedules import Instruction, Op

    ids: dict = {}
    plans = []
    for log in logs:
        steps, posted, waited, groups, n = [], Counter(), Counter(), {}, 0
        for event, what, ops in log:
            if event == "post":
                posted[what] += 1
                key = (what, posted[what])
                ident = ids.setdefault(key, len(ids) + 1)
                groups[key] = []
                for kind, peer in ops:
                    ins = (Instruction(Op.SEND_ACT, ident - 1, 0, peer) if kind == "send"
                           else Instruction(Op.RECV_ACT, ident, 0, peer))
                    steps.append(Post(n, (ins,)))
                    groups[key].append(n)
                    n += 1
                steps.append(Compute(Instruction(Op.FORWARD, 0, ident)))
            else:
                waited[what] += 1
                steps += [Wait(g) for g in groups.pop((what, waited[what]))]
        assert not groups, f"posted and never waited for: {sorted(groups)}"
        plans.append(steps)
    return plans


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_order_is_free_of_deadlock_under_nccl_rules(ring_results, cp):
    """The order the ring really posted in (recorded on every rank: forward, backward, the recomputed forward) run
    by the transport model: one communicator per pair of ranks (both directions share it, as PyTorch's
    single-operation p2p does on the cp group), sends that block until their receive is posted, no tags. No
    deadlock and no mismatched pair; the same order with its two posts swapped on odd ranks undone deadlocks at c = 2
    (the model can see the fault the even/odd order avoids)."""
    from mlplat.perf.transport import check_plans, run_exchange

    logs = [r["posts"][cp] for r in ring_results[:cp]]  # the cp ranks of data-parallel replica 0
    assert sum(event == "post" for event, _, _ in logs[0]) == 2 * (3 * (cp - 1) + cp)  # 2 layers: fwd, re-fwd, bwd
    plans = transport_plans(logs)
    for lazy in (False, True):
        check_plans(plans, streams="pair", lazy=lazy)
    if cp == 2:  # everyone sends first: both sends queue ahead of the receives on the one pair stream
        same_order = [[(e, w, sorted(ops, key=lambda o: o[0] != "send") if ops else ops) for e, w, ops in log]
                      for log in logs]
        assert run_exchange(transport_plans(same_order), streams="pair", lazy=False).deadlock


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_ring_attention_in_bfloat16(ring_results, kernel):
    """bfloat16 q, k, v at c = 2 (packed, grouped-query): forward and backward run, and agree with float64 dense
    attention to bfloat16's precision."""
    q, k, v, dout, documents = _inputs(4, 2, True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _reference(*leaves, documents)
    ref.backward(dout)
    full = [torch.zeros_like(x) for x in (q, q, k, v)]
    for rank_result in ring_results[:2]:
        index, *parts = rank_result[("bf16", kernel)]
        for whole, part in zip(full, parts):
            whole[:, :, index] = part
    for got, want in zip(full, (ref.detach(), *(x.grad for x in leaves))):
        assert (got - want).abs().max() <= 0.03 * want.abs().max(), (got - want).abs().max()


def test_load_balanced_split():
    """2c chunks, rank i holds i and 2c-1-i: every token once, and every rank the same number of causal pairs."""
    for s, cp in ((16, 2), (32, 4), (24, 3)):
        held = torch.cat([local_index(s, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(s))
        pairs = [int((local_index(s, cp, r) + 1).sum()) for r in range(cp)]  # keys each rank's queries see
        assert len(set(pairs)) == 1, pairs
        assert chunk_bounds(s, cp, 0) == ((0, s // (2 * cp)), (s - s // (2 * cp), s))


def test_positions_restart_at_each_document():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    assert positions_of(documents).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    tokens = torch.arange(9)[None]
    labels = torch.tensor([[1, 2, IGNORE, 4, IGNORE, 6, 7, 8, 9]])
    _, _, layout = place(tokens, labels, 9, 1, 0, documents)
    assert layout.loss_tokens == 7 and layout.positions.tolist() == positions_of(documents).tolist()


def test_the_cuda_flash_block_kernel_calls_take_the_rings_blocks():
    """On a GPU the sdpa ring kernel calls PyTorch's CUDA flash kernel and its backward, which take no mask:
    the rank's own block runs as causal, a wholly visible part plain. Their calls run here on meta tensors
    (the CUDA build's shape rules): outputs and gradients of the block's shapes, the log-sum-exp in float32.
    Blocks the CUDA kernel cannot take run in math."""
    from mlplat.parallel.context import _sdpa_backward, _sdpa_forward, block_kernel

    def meta(*shape):
        return torch.empty(*shape, device="meta", dtype=torch.bfloat16)

    q, k = meta(2, 4, 16, 8), meta(2, 4, 8, 8)  # a visible part: 16 queries, 8 keys
    for causal, kv in ((True, meta(2, 4, 16, 8)), (False, k)):
        out, lse = _sdpa_forward(q, kv, kv, None, 0.35, causal)
        assert out.shape == q.shape and lse.shape == q.shape[:-1] and lse.dtype == torch.float32
        grads = _sdpa_backward(q, kv, kv, None, 0.35, out, out, lse, None, causal)
        assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]
    # grouped-query K/V as they are (2 heads for 4 queries): the kernel reads each once per group, its gradients
    # come back per K/V head, so a hop is not expanded to every query head
    grouped = meta(2, 2, 16, 8)
    out, lse = _sdpa_forward(q, grouped, grouped, None, 0.35, True)
    assert out.shape == q.shape
    assert [g.shape for g in _sdpa_backward(q, grouped, grouped, None, 0.35, out, out, lse, None, True)] == [
        q.shape, grouped.shape, grouped.shape]
    with pytest.raises(ValueError, match="takes no mask"):
        _sdpa_forward(q, k, k, torch.ones(1, 1, 16, 8, dtype=torch.bool, device="meta"), 0.35)

    class Layout:
        documents = None

    packed = Layout()
    packed.documents = torch.zeros(1)
    assert block_kernel("sdpa", q, Layout()) == "sdpa"
    assert block_kernel("sdpa", q, packed) == block_kernel("sdpa", q.float(), Layout()) == "math"
    assert block_kernel("sdpa", torch.zeros(1), packed) == "sdpa"  # the CPU build takes masks
