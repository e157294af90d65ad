"""Tensor-parallel layers and mappings against dense twins, with the vocab-parallel cross-entropy and the
checkpointed block (mlplat.parallel.random) that run in the same spawned group.

Everything runs in float64 on CPU. The dense reference is built from the same full weights; each
tensor-parallel shard must match the matching slice of the dense result (outputs and gradients).
Process groups are expensive to start on a 2-core box, so the 4-rank group is spawned once (a module
fixture) and every layer check runs inside it; each check then becomes its own pytest item. The grid's own
group checks are in test_grid.py, the RNG tracker's in test_random.py.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mlplat.parallel.cross_entropy import vocab_parallel_cross_entropy
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.layout.vocab import pad_vocab_size
from mlplat.parallel.mappings import (
    all_gather,
    all_gather_from_sequence_parallel,
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter,
    scatter_to_tensor_parallel,
    split,
    start_all_gather,
    start_reduce_scatter,
)
from mlplat.parallel.random import RNGTracker, checkpoint, seed_model_parallel
from mlplat.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_full,
    parallel_lm_logits,
    shard_of,
)
from mlplat.parallel.weight_grad import WeightGradStore
from tests.helpers.dist import run_distributed

F64 = torch.float64


def _close(actual, expected, tol=1e-10):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def _my_slice(full: torch.Tensor, grid: ParallelGrid, dim: int = -1) -> torch.Tensor:
    """Reference slicing written independently of the library."""
    return full.chunk(grid.tp, dim=dim)[grid.tp_rank]


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=F64)


# ============================================================================ layer checks
# Each takes a grid (tp=1 in-process, tp=2/4 in spawned ranks), builds the dense twin from a seeded
# generator (identical on every rank) and asserts the parallel layer matches it.


def _dense_reference(seed: int, h_in: int, h_out: int):
    """A dense nn.Linear twin with seeded weights, its input x, an upstream grad dy, and its backward done."""
    gen = torch.Generator().manual_seed(seed)
    dense = nn.Linear(h_in, h_out).double()
    with torch.no_grad():
        dense.weight.copy_(_randn(gen, h_out, h_in))
        dense.bias.copy_(_randn(gen, h_out))
    x, dy = _randn(gen, 2, 3, h_in), _randn(gen, 2, 3, h_out)
    x_ref = x.clone().requires_grad_()
    y_ref = dense(x_ref)
    (y_ref * dy).sum().backward()
    return dense, x, dy, x_ref, y_ref


def check_column(grid, gather_output):
    h_in, h_out = 8, 12
    dense, x, dy, x_ref, y_ref = _dense_reference(1, h_in, h_out)

    # Built in float32 then converted: .double() must keep the partition metadata.
    layer = ColumnParallelLinear(h_in, h_out, grid, gather_output=gather_output).double()
    assert layer.weight.shape == (h_out // grid.tp, h_in) and layer.weight.partition_dim == 0
    assert layer.bias.partition_dim == 0
    with torch.no_grad():
        layer.weight.copy_(shard_of(dense.weight, layer.weight, grid))
        layer.bias.copy_(shard_of(dense.bias, layer.bias, grid))
    xp = x.clone().requires_grad_()
    y = layer(xp)
    if gather_output:
        _close(y, y_ref)
        (y * dy).sum().backward()
    else:
        _close(y, _my_slice(y_ref, grid))
        (y * _my_slice(dy, grid)).sum().backward()
    _close(xp.grad, x_ref.grad)
    _close(layer.weight.grad, _my_slice(dense.weight.grad, grid, 0))
    _close(layer.bias.grad, _my_slice(dense.bias.grad, grid, 0))
    _close(gather_full(layer.weight, grid), dense.weight.detach())
    _close(gather_full(layer.bias, grid), dense.bias.detach())


def check_row(grid, input_is_parallel):
    h_in, h_out = 12, 8
    dense, x, dy, x_ref, y_ref = _dense_reference(2, h_in, h_out)

    layer = RowParallelLinear(h_in, h_out, grid, input_is_parallel=input_is_parallel, dtype=F64)
    assert layer.weight.shape == (h_out, h_in // grid.tp) and layer.weight.partition_dim == 1
    assert layer.bias.partition_dim is None
    with torch.no_grad():
        layer.weight.copy_(shard_of(dense.weight, layer.weight, grid))
        layer.bias.copy_(shard_of(dense.bias, layer.bias, grid))
    xp = (_my_slice(x, grid) if input_is_parallel else x).clone().requires_grad_()
    y = layer(xp)
    _close(y, y_ref)
    (y * dy).sum().backward()
    _close(xp.grad, _my_slice(x_ref.grad, grid) if input_is_parallel else x_ref.grad)
    _close(layer.weight.grad, _my_slice(dense.weight.grad, grid, 1))
    _close(layer.bias.grad, dense.bias.grad)  # replicated: every tp rank holds the full bias grad
    _close(gather_full(layer.weight, grid), dense.weight.detach())


def check_embedding(grid):
    gen = torch.Generator().manual_seed(3)
    vocab, hidden = 16, 6
    dense = nn.Embedding(vocab, hidden).double()
    with torch.no_grad():
        dense.weight.copy_(_randn(gen, vocab, hidden))
    # Every id of the padded vocabulary appears, so every rank's slice is hit (and repeated ids too).
    ids = torch.cat([torch.arange(vocab), torch.randint(0, vocab, (8,), generator=gen)]).view(2, 12)
    dy = _randn(gen, 2, 12, hidden)
    out_ref = dense(ids)
    (out_ref * dy).sum().backward()

    layer = VocabParallelEmbedding(vocab, hidden, grid, dtype=F64)
    assert layer.weight.shape == (vocab // grid.tp, hidden) and layer.weight.partition_dim == 0
    with torch.no_grad():
        layer.weight.copy_(shard_of(dense.weight, layer.weight, grid))
    out = layer(ids)
    _close(out, out_ref)
    (out * dy).sum().backward()
    _close(layer.weight.grad, _my_slice(dense.weight.grad, grid, 0))
    _close(gather_full(layer.weight, grid), dense.weight.detach())


def check_mappings(grid):
    gen = torch.Generator().manual_seed(4)
    x, dy = _randn(gen, 3, 8), _randn(gen, 3, 8)
    # scatter then gather is the identity both ways.
    xp = x.clone().requires_grad_()
    y = gather_from_tensor_parallel(scatter_to_tensor_parallel(xp, grid), grid)
    _close(y, x)
    (y * dy).sum().backward()
    _close(xp.grad, dy)
    # reduce sums rank-dependent inputs; copy sums rank-dependent gradients; neither mutates its input.
    local = (x * (grid.tp_rank + 1)).requires_grad_()
    kept = local.detach().clone()
    total = reduce_from_tensor_parallel(local, grid)
    _close(total, x * sum(range(1, grid.tp + 1)))
    _close(local.detach(), kept)
    total.backward(dy)
    _close(local.grad, dy)
    xc = x.clone().requires_grad_()
    out = copy_to_tensor_parallel(xc, grid)
    _close(out, x)
    shared = dy * (grid.tp_rank + 1)
    shared_kept = shared.clone()
    (out * shared + xc).sum().backward()  # the add's grad is shared with the copy's backward
    _close(xc.grad, dy * sum(range(1, grid.tp + 1)) + 1.0)
    _close(shared, shared_kept)


def check_collectives_along_each_dim(grid):
    """The (x, dim, group) helpers along every dim of a 3-d tensor, the started (asynchronous) ones included, and
    the sequence-parallel all-gather's backward (a reduce-scatter of the gradients), against dense tensors every
    rank knows. All collectives run before any assertion (a failing rank must not leave the others waiting)."""
    if grid.tp == 1:
        return
    t, group = grid.tp, grid.tp_group
    gen = torch.Generator().manual_seed(5)
    parts = [_randn(gen, 2 * t, 3 * t, 4 * t) for _ in range(t)]  # rank i's partial tensor
    got, want = [], []
    for dim in (0, 1, 2, -1):
        mine = _my_slice(parts[0], grid, dim)
        got += [split(parts[0], dim, group), all_gather(mine, dim, group),
                reduce_scatter(parts[grid.tp_rank], dim, group)]
        want += [mine, parts[0], _my_slice(sum(parts), grid, dim)]
        scattering = start_reduce_scatter(parts[grid.tp_rank], dim, group)
        gathering = start_all_gather(mine, dim, group)
        gathering.wait()
        got += [scattering.result(), gathering.result()]
        want += [_my_slice(sum(parts), grid, dim), parts[0]]
    dense, dys = _randn(gen, 2, 2 * t, 3), [_randn(gen, 2, 2 * t, 3) for _ in range(t)]
    shard = _my_slice(dense, grid, 1).clone().requires_grad_()
    y = all_gather_from_sequence_parallel(shard, grid)
    (y * dys[grid.tp_rank]).sum().backward()
    got += [y.detach(), shard.grad]
    want += [dense, _my_slice(sum(dys), grid, 1)]
    for a, b in zip(got, want):
        _close(a, b)


def check_shard_of_padding(grid):
    # A full embedding saved with a shorter (unpadded / other-tp) vocabulary is zero-padded.
    full = torch.arange(10 * 3, dtype=F64).view(10, 3)
    param = nn.Parameter(torch.empty(16 // grid.tp, 3, dtype=F64))
    param.partition_dim = 0
    padded = torch.cat([full, torch.zeros(6, 3, dtype=F64)])
    _close(shard_of(full, param, grid), _my_slice(padded, grid, 0))
    with pytest.raises(ValueError):
        shard_of(torch.zeros(17, 3, dtype=F64), param, grid)


def check_lm_head_cross_entropy(grid):
    """Tied embedding -> vocab-sharded logits -> vocab-parallel CE vs dense F.cross_entropy.

    vocab=10 is padded differently per tp (12, 16, 16 with multiple=4); at tp=4 the last rank's shard
    is entirely padding. The reference sees only the 10 real columns.
    """
    gen = torch.Generator().manual_seed(5)
    vocab, hidden, b, s = 10, 6, 3, 5
    v_pad = pad_vocab_size(vocab, grid.tp, multiple=4)
    emb = _randn(gen, v_pad, hidden)
    h = _randn(gen, b, s, hidden)
    target = torch.randint(0, vocab, (b, s), generator=gen)
    target[0, :] = torch.tensor([0, vocab - 1, 3, 4, 5])  # both ends of the real vocabulary
    w = _randn(gen, b, s)

    h_ref, emb_ref = h.clone().requires_grad_(), emb.clone().requires_grad_()
    logits_ref = h_ref @ emb_ref.T
    logits_ref.retain_grad()
    loss_ref = F.cross_entropy(logits_ref[..., :vocab].reshape(-1, vocab), target.reshape(-1),
                               reduction="none").view(b, s)
    (loss_ref * w).sum().backward()

    emb_p = nn.Parameter(_my_slice(emb, grid, 0).clone())
    emb_p.partition_dim = 0
    h_p = h.clone().requires_grad_()
    logits = parallel_lm_logits(h_p, emb_p, grid)
    logits.retain_grad()
    _close(logits, _my_slice(logits_ref, grid))
    loss = vocab_parallel_cross_entropy(logits, target, grid, vocab_size=vocab)
    assert loss.shape == (b, s) and loss.dtype == F64
    _close(loss, loss_ref)
    (loss * w).sum().backward()
    _close(logits.grad, _my_slice(logits_ref.grad, grid))  # padding columns: exactly zero
    _close(h_p.grad, h_ref.grad)
    _close(emb_p.grad, _my_slice(emb_ref.grad, grid, 0))


def check_cross_entropy_stability(grid):
    gen = torch.Generator().manual_seed(6)
    v = 8 * grid.tp
    full = _randn(gen, 4, 7, v) * 5 + 1e4  # exp(1e4) overflows even float64
    full[0, 0, 3] += 1e4
    target = torch.randint(0, v, (4, 7), generator=gen)
    ref = full.clone().requires_grad_()
    loss_ref = F.cross_entropy(ref.reshape(-1, v), target.reshape(-1), reduction="none").view(4, 7)
    loss_ref.sum().backward()
    shard = _my_slice(full, grid).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, grid)
    assert torch.isfinite(loss).all()
    _close(loss, loss_ref, tol=1e-9)
    loss.sum().backward()
    _close(shard.grad, _my_slice(ref.grad, grid))

    # float32 logits stay float32; bfloat16 logits are computed in float32 and the grad comes back bf16.
    shard32 = shard.detach().float().requires_grad_()
    loss32 = vocab_parallel_cross_entropy(shard32, target, grid)
    assert loss32.dtype == torch.float32
    _close(loss32.double(), loss_ref.detach(), tol=1e-3)
    small = (full - 1e4).to(torch.bfloat16)
    shard16 = _my_slice(small, grid).clone().requires_grad_()
    loss16 = vocab_parallel_cross_entropy(shard16, target, grid)
    assert loss16.dtype == torch.float32
    loss16.sum().backward()
    assert shard16.grad.dtype == torch.bfloat16
    ref16 = F.cross_entropy(small.double().reshape(-1, v), target.reshape(-1), reduction="none").view(4, 7)
    _close(loss16.double(), ref16, tol=1e-5)


def check_checkpointed_block(grid):
    """Column -> dropout in the tp region (tracker) -> GeLU -> Row -> dropout: recompute == plain."""
    gen = torch.Generator().manual_seed(7)
    h = 8
    col = ColumnParallelLinear(h, 4 * h, grid, dtype=F64)
    row = RowParallelLinear(4 * h, h, grid, dtype=F64)
    with torch.no_grad():
        for layer, full in ((col.weight, _randn(gen, 4 * h, h)), (col.bias, _randn(gen, 4 * h)),
                            (row.weight, _randn(gen, h, 4 * h)), (row.bias, _randn(gen, h))):
            layer.copy_(shard_of(full, layer, grid))
    x, dy = _randn(gen, 2, 5, h), _randn(gen, 2, 5, h)
    tracker = RNGTracker()

    def block(inp, p):
        z = col(inp)
        with tracker.fork():
            z = F.dropout(z, p)
        return F.dropout(row(F.gelu(z)), p)

    def run(use_checkpoint):
        seed_model_parallel(11, grid, tracker)
        for prm in (*col.parameters(), *row.parameters()):
            prm.grad = None
        xi = x.clone().requires_grad_()
        out = checkpoint(block, tracker, xi, 0.3) if use_checkpoint else block(xi, 0.3)
        (out * dy).sum().backward()
        return out.detach(), xi.grad, [prm.grad.clone() for prm in (*col.parameters(), *row.parameters())]

    out_a, gx_a, gp_a = run(False)
    out_b, gx_b, gp_b = run(True)
    _close(out_b, out_a)
    _close(gx_b, gx_a)
    for a, b_ in zip(gp_a, gp_b):
        _close(b_, a)


LAYER_CHECKS = {
    "column": lambda g: check_column(g, gather_output=False),
    "column_gather_output": lambda g: check_column(g, gather_output=True),
    "row_parallel_input": lambda g: check_row(g, input_is_parallel=True),
    "row_full_input": lambda g: check_row(g, input_is_parallel=False),
    "embedding": check_embedding,
    "mappings": check_mappings,
    "collectives_along_each_dim": check_collectives_along_each_dim,
    "shard_of_padding": check_shard_of_padding,
    "lm_head_cross_entropy": check_lm_head_cross_entropy,
    "cross_entropy_stability": check_cross_entropy_stability,
    "checkpointed_block": check_checkpointed_block,
}
TP_LAYOUTS = {"tp2dp2": (2, 1, 2), "tp4": (4, 1, 1)}


def _layer_checks_worker(rank, world_size):
    """Runs every layer check for each layout; returns {(layout, check): traceback or None}.

    Checks do all their collectives before asserting, so a failure on one rank does not leave the
    others blocked; the next check then starts in step on every rank.
    """
    report = {}
    for layout, (tp, pp, dp) in TP_LAYOUTS.items():
        grid = ParallelGrid(tp=tp, pp=pp, dp=dp)
        for name, check in LAYER_CHECKS.items():
            try:
                check(grid)
                report[(layout, name)] = None
            except Exception:  # noqa: BLE001 - reported per check to the parent
                report[(layout, name)] = traceback.format_exc()
        dist.barrier()
    return report


@pytest.fixture(scope="module")
def tp_world():
    return run_distributed(_layer_checks_worker, 4, timeout=180)


@pytest.mark.parametrize("name", list(LAYER_CHECKS))
def test_layer_tp1(name):
    LAYER_CHECKS[name](ParallelGrid())


@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
@pytest.mark.parametrize("name", list(LAYER_CHECKS))
def test_layer_tensor_parallel(tp_world, layout, name):
    failures = [f"rank {r}:\n{rep[(layout, name)]}" for r, rep in enumerate(tp_world) if rep[(layout, name)]]
    assert not failures, "\n".join(failures)


# ============================================================================ meta device and virtual grids


def test_meta_build_virtual_gpt1t_shapes():
    """The 1T model's layers on the meta device for one of 3072 ranks: shapes only, no collectives."""
    grid = ParallelGrid(tp=8, pp=64, dp=6, rank=3071, virtual=True)
    h, meta = 25600, torch.device("meta")
    col = ColumnParallelLinear(h, 4 * h, grid, device=meta, dtype=torch.bfloat16)
    row = RowParallelLinear(4 * h, h, grid, device=meta, dtype=torch.bfloat16)
    v = pad_vocab_size(51200, grid.tp)
    emb = VocabParallelEmbedding(v, h, grid, device=meta)
    assert col.weight.shape == (4 * h // 8, h) and row.weight.shape == (h, 4 * h // 8)
    assert emb.weight.shape == (v // 8, h) and emb.vocab_start_index == 7 * v // 8
    x = torch.empty(1, 2048, h, device=meta, dtype=torch.bfloat16)
    y = row(col(x))
    assert y.shape == x.shape and y.device.type == "meta"
    gathered = ColumnParallelLinear(h, 4 * h, grid, gather_output=True, device=meta)(x.float())
    assert gathered.shape == (1, 2048, 4 * h)
    scattered = RowParallelLinear(4 * h, h, grid, input_is_parallel=False, device=meta)(gathered)
    assert scattered.shape == (1, 2048, h)
    logits = parallel_lm_logits(emb(torch.zeros(1, 2048, dtype=torch.long, device=meta)), emb.weight, grid)
    assert logits.shape == (1, 2048, v // 8)
    loss = vocab_parallel_cross_entropy(logits, torch.zeros(1, 2048, dtype=torch.long, device=meta), grid, 51200)
    assert loss.shape == (1, 2048)


def test_partition_dim_survives_conversions():
    grid = ParallelGrid(tp=4, rank=1, virtual=True)
    layers = [
        ColumnParallelLinear(8, 16, grid, device="meta"),
        RowParallelLinear(16, 8, grid, device="meta"),
        VocabParallelEmbedding(16, 8, grid, device="meta"),
    ]
    expected = [{"weight": 0, "bias": 0}, {"weight": 1, "bias": None}, {"weight": 0}]
    for layer, dims in zip(layers, expected):
        for convert in (
            lambda m: m.to_empty(device="cpu"),
            lambda m: m.double(),
            copy.deepcopy,
            lambda m: pickle.loads(pickle.dumps(m)),
            lambda m: (m.load_state_dict(copy.deepcopy(m.state_dict()), assign=True), m)[1],
        ):
            layer = convert(layer)
            got = {n: getattr(p, "partition_dim", "missing") for n, p in layer.named_parameters()}
            assert got == dims


def test_row_blocks_shard_the_full_tensor_and_survive_conversions():
    """Fewer key/value heads than tp ranks (4 query heads of 2 dims on one key/value head, t = 4): rank i holds query
    head i and the k, v rows every rank shares; its shard is those rows of the full QKV, and the tags stay on."""
    from mlplat.config import ModelConfig
    from mlplat.model.decoder import qkv_row_blocks
    from mlplat.parallel.tensor import RowBlock, full_shape_of, shared_ranges

    cfg = ModelConfig(arch="llama", n_layers=1, hidden=8, n_heads=4, n_kv_heads=1, seq_len=4, vocab_size=16)
    blocks = qkv_row_blocks(cfg, 4)
    assert blocks[3] == [RowBlock(0, 6, 2), RowBlock(2, 8, 4, shared=True)]  # q head 3, then k and v
    full = torch.arange(12.0 * 8).view(12, 8)  # [q0..q3, k, v] x 2 rows each
    for rank in range(4):
        grid = ParallelGrid(tp=4, rank=rank, virtual=True)
        layer = ColumnParallelLinear(8, 12, grid, device="meta", row_blocks=blocks)
        for convert in (lambda m: m.to_empty(device="cpu"), copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
            layer = convert(layer)
            assert all(p.row_blocks is not None and p.partition_dim == 0 for p in layer.parameters())
        w = layer.weight
        assert full_shape_of(w, grid) == (12, 8) and shared_ranges(w, grid) == [(16, 48)]
        assert torch.equal(shard_of(full, w, grid), torch.cat([full[2 * rank:2 * rank + 2], full[8:]]))
        assert torch.equal(shard_of(full[:, 0], layer.bias, grid), torch.cat([full[2 * rank:2 * rank + 2, 0],
                                                                              full[8:, 0]]))
    assert qkv_row_blocks(dataclasses.replace(cfg, n_kv_heads=4), 4) is None  # whole heads: an even split


def test_shard_of_replicated_and_virtual():
    grid = ParallelGrid(tp=4, rank=2, virtual=True)
    row = RowParallelLinear(8, 4, grid)
    full_w = torch.arange(32.0).view(4, 8)
    assert torch.equal(shard_of(full_w, row.weight, grid), full_w[:, 4:6])
    bias = torch.arange(4.0)
    assert shard_of(bias, row.bias, grid) is bias
    with pytest.raises(ValueError):
        shard_of(torch.zeros(5), row.bias, grid)
    with pytest.raises(RuntimeError):
        gather_full(row.weight, grid)  # no collectives in virtual mode


def test_weight_grad_store_defers_linear_and_callables():
    """Under a key, B leaves the linear layer's dW and any `defer`red work to `run(key)` (in recording order,
    without autograd recording); W then gives the fused backward's gradient. With key None nothing is deferred."""
    gen = torch.Generator().manual_seed(0)
    layer = ColumnParallelLinear(4, 3, ParallelGrid(), dtype=F64)
    x = _randn(gen, 2, 5, 4)
    layer(x).square().sum().backward()
    fused_w, fused_b = layer.weight.grad.clone(), layer.bias.grad.clone()
    layer.weight.grad = layer.bias.grad = None

    store = WeightGradStore()
    layer.wgrad_store = store
    ran = []
    store.key = (0, 1)
    out = layer(x)
    out.square().sum().backward()
    store.defer(lambda: ran.append(torch.is_grad_enabled()))
    store.key = (0, 2)
    store.defer(lambda: ran.append("other key"))
    store.key = None
    assert layer.weight.grad is None and ran == []  # B: input and bias gradients only
    _close(layer.bias.grad, fused_b)
    store.run((0, 1))
    _close(layer.weight.grad, fused_w)
    assert ran == [False] and list(store.pending) == [(0, 2)]
    store.run((0, 1))  # a key runs once
    _close(layer.weight.grad, fused_w)

    layer.weight.grad = layer.bias.grad = None
    layer(x).square().sum().backward()  # key None: the weight gradient at once
    _close(layer.weight.grad, fused_w)
    assert list(store.pending) == [(0, 2)]
