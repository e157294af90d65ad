"""A MoE layer's dispatch reads the host at most once per micro-batch (#53): on a GPU each read synchronises the
stream with the host. CPU shows no synchronisation, so the count is of what would make one: every call of
`dispatch.host_read` (the one deliberate read), and every operator that reads device values on the host inside CUDA
(`bincount`'s min and max, `nonzero`, a boolean mask's index, `item`, `masked_select`, `unique`, a
`repeat_interleave` not told its size, a `_grouped_mm` on operands other than bf16: CUDA's fallback copies its offsets
to the host), recorded by a dispatch mode around routing, the balancing counts, dispatch and combine, forward and
backward, and around a whole layer's forward and backward, its experts' grouped GEMMs included."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.dist import run_distributed

aten = torch.ops.aten
SYNCING = {aten.nonzero.default, aten.bincount.default, aten._local_scalar_dense.default, aten.masked_select.default,
           aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default, aten.argwhere.default}


class HostReads(TorchDispatchMode):
    """Operators that would read device values on the host (CUDA), by name."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING:
            self.seen.append(str(func))
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            self.seen.append(f"{func} with a boolean mask")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.seen.append(f"{func} without output_size")
        elif func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            self.seen.append(f"{func} in {args[0].dtype} (the fallback)")
        return func(*args, **kwargs)


def _layer_reads(dispatcher, monkeypatch_host_read, e: int = 8, k: int = 2, n: int = 24, h: int = 16, seed: int = 0):
    """(deliberate reads, implicit ones) of one routed micro-batch through `dispatcher`, forward and backward."""
    from mlplat.model.moe import expert_counts, group_limited_topk

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(n, h, generator=g, requires_grad=True)
    logits = torch.randn(n, e, generator=g, requires_grad=True)
    reads = monkeypatch_host_read()
    with HostReads() as mode:
        scores = logits.sigmoid()
        chosen = group_limited_topk(scores, k, 4, 2, lambda x: x.topk(2, dim=-1).values.sum(-1))
        gates = scores.gather(1, chosen)
        expert_counts(chosen, torch.arange(n) // 6, 4, e)  # the sequence-wise balancing loss's counts
        d = dispatcher.dispatch(tokens, chosen, gates)
        out = dispatcher.combine(d.rows * d.gates.unsqueeze(1), d.handle)
        out.sum().backward()
    return len(reads), mode.seen


def _counter(monkeypatch):
    from mlplat.parallel import dispatch

    def install():
        calls = []
        real = dispatch.host_read.__wrapped__ if hasattr(dispatch.host_read, "__wrapped__") else dispatch.host_read

        def counted(t):
            calls.append(t.shape)
            return real(t)

        counted.__wrapped__ = real
        monkeypatch.setattr(dispatch, "host_read", counted)
        return calls
    return install


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_the_local_dispatcher_reads_the_host_once_under_capacity_and_never_dropless(capacity, monkeypatch):
    from mlplat.parallel.dispatch import LocalDispatcher

    deliberate, implicit = _layer_reads(LocalDispatcher(8, capacity), _counter(monkeypatch))
    assert implicit == [] and deliberate == (0 if capacity is None else 1), (deliberate, implicit)


def _ep_reads(rank, world_size):
    import torch.distributed as dist

    from mlplat.parallel import dispatch

    out = {}
    calls = []
    real = dispatch.host_read

    def counted(t):
        calls.append(t.shape)
        return real(t)

    dispatch.host_read = counted
    from mlplat.parallel.grid import EpNodes
    from mlplat.parallel.node_dispatch import NodeAllToAllDispatcher

    group = dist.new_group(list(range(world_size)))
    within = [dist.new_group([r]) for r in range(world_size)][rank]  # a node of one rank each
    node = partial(NodeAllToAllDispatcher, nodes=EpNodes(1, group, within))
    for name, cls in (("alltoall", dispatch.AllToAllDispatcher), ("allgather", dispatch.AllGatherDispatcher),
                      ("node_alltoall", node)):
        for capacity in (None, 1.0):
            calls.clear()
            deliberate, implicit = _layer_reads(cls(8, capacity, world_size, rank, group), lambda: calls,
                                                seed=rank)
            out[f"{name} capacity={capacity}"] = (deliberate, implicit)
    return out


def test_expert_parallel_dispatchers_read_the_host_once_per_layer():
    """alltoall: its split sizes, capacity's kept rows counted in them; allgather: how many rows its experts take;
    node_alltoall (two nodes of one rank): every hop's sizes and its experts' rows, read at once."""
    for rank in run_distributed(_ep_reads, 2):
        for case, (deliberate, implicit) in rank.items():
            assert implicit == [] and deliberate == 1, (case, deliberate, implicit)


@pytest.mark.parametrize("dtype,autocast,kernels,reads,fallbacks", [
    (torch.bfloat16, False, "cuda", 0, 0),  # bf16-true, bf16-megatron: the grouped kernel
    (torch.float32, True, "cuda", 0, 0),  # bf16-mixed: the operands cast to bf16 for it
    (torch.float32, False, "cuda", 2, 0),  # 32-true: the loop, the counts read once per GEMM forward
    (torch.float32, True, "cpu", 0, 6),  # CUDA given the CPU's list: torch's fallback, every GEMM forward and backward
])
def test_a_layer_reads_the_host_only_where_its_experts_loop(dtype, autocast, kernels, reads, fallbacks, monkeypatch):
    """A whole dropless layer on one rank, forward and backward, on CUDA's `_grouped_mm` kernel list
    (mlplat.precision.GROUPED_KERNEL_DTYPES): the grouped paths read nothing; the loop reads the counts."""
    from mlplat import precision
    from mlplat.config import ModelConfig, MoEConfig
    from mlplat.model.moe import MoELayer
    from mlplat.parallel.grid import ParallelGrid

    monkeypatch.setitem(precision.GROUPED_KERNEL_DTYPES, "cpu", precision.GROUPED_KERNEL_DTYPES[kernels])
    cfg = ModelConfig(arch="llama", mlp="swiglu", hidden=32, n_heads=4,
                      moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden=16, aux_loss_coeff=0.1))
    layer = MoELayer(cfg, ParallelGrid(), dtype=dtype).train()
    x = torch.randn(2, 8, 32, dtype=dtype, requires_grad=True)
    calls = _counter(monkeypatch)()
    with HostReads() as mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        layer(x).float().square().sum().backward()
    assert len(calls) == reads and len(mode.seen) == fallbacks, (calls, mode.seen)
