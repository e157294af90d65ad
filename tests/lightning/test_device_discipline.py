"""Every tensor the training step shares with other ranks is created on the parallel device.

NCCL takes CUDA tensors only, and a CPU-only machine cannot show that directly. So the step runs here under an
ambient default device of `meta` while the model and the strategy's device are the CPU: a tensor that the
engine, the data-parallel reducer, the tied-embedding reduction, the gradient norm or the loss sharing create
without naming the parallel device lands on `meta`, and the step fails (gloo refuses it, arithmetic with the
CPU tensors refuses it). The same run records the tag and group of every point-to-point operation: all tags
are 0 and all go through the pipeline's directed channels, so nothing rests on tag matching.
"""
from __future__ import annotations

import torch

from tests.helpers.dist import run_distributed
from tests.helpers.equivalence import build_module, local_batches, make_cfg


def _step_under_meta(rank, world_size):
    import torch.distributed as dist

    from mlplat.parallel.grid import ParallelGrid
    from mlplat.parallel.pipeline import p2p

    cfg = make_cfg(pp=2, dp=2, vpp=2, schedule="interleaved", micro=1, global_batch=4, grad_clip=1.0)
    grid = ParallelGrid(1, 2, 2)
    module = build_module(cfg, grid)
    batch = local_batches(cfg, grid.dp_rank, 1)[0]
    seen = []
    real_isend, real_irecv = p2p.dist.isend, p2p.dist.irecv
    channels = {id(grid.p2p_group(a, b)) for a, b in grid.p2p_channels(grid.pp)}

    def recording(real):
        def call(tensor, *args, group=None, tag=0, **kwargs):
            seen.append((tag, id(group) in channels, tensor.device.type))
            return real(tensor, *args, group=group, tag=tag, **kwargs)
        return call

    p2p.dist.isend, p2p.dist.irecv = recording(real_isend), recording(real_irecv)
    try:
        reference_loss, reference_norm = module.forward_backward(batch)
        module.optimizer.zero_grad(set_to_none=True)
        with torch.device("meta"):
            loss, norm = module.forward_backward(batch)
    finally:
        p2p.dist.isend, p2p.dist.irecv = real_isend, real_irecv
    dist.barrier()
    return (loss.device.type, norm.device.type, float(loss), float(reference_loss), float(norm),
            float(reference_norm), seen)


def test_step_creates_nothing_off_the_parallel_device():
    for loss_dev, norm_dev, loss, ref_loss, norm, ref_norm, seen in run_distributed(_step_under_meta, 4):
        assert loss_dev == norm_dev == "cpu"
        assert loss == ref_loss and norm == ref_norm
        assert seen and all(tag == 0 and on_channel and dev == "cpu" for tag, on_channel, dev in seen)
