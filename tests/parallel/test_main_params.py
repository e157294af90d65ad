"""The gradient buffer's flat layout and MainParamsAdamW's arithmetic, in one process (no process group needed)."""
from __future__ import annotations

import torch
import torch.nn as nn

from mlplat.checkpoint.state import flat_boxes
from mlplat.optim.buffers import ALIGN, ParamBuffers
from mlplat.optim.main_params import MainParamsAdamW
from mlplat.parallel.grid import ParallelGrid


def _groups(module: nn.Module) -> list[dict]:
    return [{"params": [p for p in module.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in module.parameters() if p.ndim < 2], "weight_decay": 0.0}]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(37, 29), nn.LayerNorm(29), nn.Linear(29, 300)).double()


def test_adamw_on_flat_main_weights_is_torch_adamw_bit_for_bit():
    """Decay and no-decay groups, several buckets (small bucket_bytes), 20 steps of random gradients: the flat
    update equals torch.optim.AdamW's, bit for bit (the float64 CLI proofs rest on it)."""
    model, ref = _model(), _model()
    groups = _groups(model)
    main = ParamBuffers({0: model}, ParallelGrid(), [g["params"] for g in groups], param_dtype=torch.float64,
                             main_dtype=torch.float64, distributed=False, bucket_bytes=4096)
    assert len(main.buckets) > 1
    opt = MainParamsAdamW(main, groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    torch_opt = torch.optim.AdamW(_groups(ref), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        for p, q in zip(model.parameters(), ref.parameters()):
            g = torch.randn(q.shape, dtype=q.dtype, generator=gen)
            q.grad = g.clone()
            p.grad = g.clone()
            main.accumulate(p)  # what the gradient buffer's hook does
            assert p.grad.data_ptr() == p.main_grad.data_ptr()  # float64 weights: the gradient is the flat view
        opt.step()
        torch_opt.step()
        opt.zero_grad()
        torch_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_flat_layout_aligns_parameters_and_shards_buckets_evenly():
    """Every parameter starts at a multiple of ALIGN; the weights and main gradients are views of the bucket's
    flat buffers; four shards of a bucket are equal aligned ranges; decay parameters come first."""
    model = _model()
    groups = _groups(model)
    main = ParamBuffers({0: model}, ParallelGrid(1, 1, 4, rank=2, virtual=True), [g["params"] for g in groups],
                             param_dtype=torch.bfloat16, main_dtype=torch.float32, distributed=True)
    (bucket,) = main.buckets
    assert bucket.numel % (4 * ALIGN) == 0 and (bucket.lo, bucket.hi) == (bucket.numel // 2, 3 * bucket.numel // 4)
    assert [s.group for s in bucket.slots] == sorted(s.group for s in bucket.slots)
    for s in bucket.slots:
        assert s.start % ALIGN == 0 and s.param.dtype == torch.bfloat16
        assert s.param.data_ptr() == bucket.param_flat[s.start:].data_ptr()
        assert s.param.main_grad.data_ptr() == bucket.grad_flat[s.start:].data_ptr()
    assert bucket.main.dtype == torch.float32 and bucket.main.numel() == bucket.numel // 4
    # The main weights are the fp32 values of this rank's range (before the cast to bf16).
    for s in bucket.slots:
        rng = main.local_range(s.param)
        if rng is not None:
            a, b = rng
            ref = dict(zip(map(id, model.parameters()), _model().parameters()))[id(s.param)]
            assert torch.equal(main.shard_view(s.param, "main"), ref.detach().reshape(-1)[a:b].float())


def test_whole_params_gives_each_shard_whole_parameters():
    """An optimizer that reads a matrix whole (Muon): with whole_params the distributed optimizer's four shards
    are still equal aligned ranges, and each parameter lies within one of them, its main weights whole there; the
    ranks lay the bucket out alike. Without it the 300x29 matrix straddles shards."""
    layouts = []
    for rank in range(4):
        model = _model()
        groups = _groups(model)
        main = ParamBuffers({0: model}, ParallelGrid(1, 1, 4, rank=rank, virtual=True), [g["params"] for g in groups],
                            param_dtype=torch.bfloat16, main_dtype=torch.float32, distributed=True,
                            whole_params=True)
        (bucket,) = main.buckets
        n = bucket.numel // 4
        assert n % ALIGN == 0 and (bucket.lo, bucket.hi) == (rank * n, (rank + 1) * n)
        assert all(s.start % ALIGN == 0 and s.start // n == (s.end - 1) // n for s in bucket.slots)
        layouts.append([(s.start, s.numel) for s in sorted(bucket.slots, key=lambda s: id(s.param))])
        ref = dict(zip(map(id, model.parameters()), _model().parameters()))
        for s in bucket.slots:
            if main.local_range(s.param) is not None:
                assert main.local_range(s.param) == (0, s.numel)
                assert torch.equal(main.shard_view(s.param, "main"), ref[id(s.param)].detach().reshape(-1).float())
    assert len({tuple(sorted(x)) for x in layouts}) == 1
    split = ParamBuffers({0: _model()}, ParallelGrid(1, 1, 4, rank=0, virtual=True), distributed=True)
    (bucket,) = split.buckets
    n = bucket.numel // 4
    assert any(s.start // n != (s.end - 1) // n for s in bucket.slots)


def test_flat_boxes_cover_a_range_with_at_most_three_boxes():
    shape = torch.Size([5, 7])
    full = torch.arange(35).view(shape)
    for a in range(36):
        for b in range(a, 36):
            boxes = flat_boxes(shape, a, b)
            assert len(boxes) <= 3
            got = torch.cat([full[o[0]:o[0] + n[0], o[1]:o[1] + n[1]].reshape(-1) for o, n, _, _ in boxes]
                            or [torch.empty(0, dtype=full.dtype)])
            assert torch.equal(got, torch.arange(a, b)), (a, b)
            assert [(first, end) for _, _, first, end in boxes] == sorted((f, e) for _, _, f, e in boxes)
    assert flat_boxes(torch.Size([9]), 2, 5) == [((2,), (3,), 2, 5)]


def test_fp32_and_fp64_main_weights_are_views_of_the_weights():
    """No Megatron precision: the main weights of every bucket's shard share the weights' storage (no copy), the
    optimizer holds the moments only, and an update of the main weights is the update of the weights."""
    for dtype in (torch.float32, torch.float64):
        for grid, distributed in ((ParallelGrid(), False), (ParallelGrid(1, 1, 4, rank=1, virtual=True), True)):
            model = _model().to(dtype)
            groups = _groups(model)
            main = ParamBuffers({0: model}, grid, [g["params"] for g in groups], distributed=distributed)
            opt = MainParamsAdamW(main, groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
            for b in main.buckets:
                assert not b.own_main and b.main.dtype == dtype
                assert b.main.untyped_storage().data_ptr() == b.param_flat.untyped_storage().data_ptr()
                assert b.main.data_ptr() == b.param_flat[b.lo:].data_ptr()
                for s in b.slots:
                    assert s.param.untyped_storage().data_ptr() == b.main.untyped_storage().data_ptr()
            assert main.state_tensors() == [b.state[k] for b in main.buckets for k in ("exp_avg", "exp_avg_sq")]
            (b,) = main.buckets
            b.main.fill_(0.5)
            assert all(bool((s.param.detach().reshape(-1)[a:e] == 0.5).all())
                       for s in b.slots for a, e in [main.local_range(s.param) or (0, 0)])
            del opt
