"""The RNG tracker's named streams and activation checkpointing that replays them (one process, float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mlplat.parallel.random import RNGTracker, checkpoint

F64 = torch.float64


def _close(actual, expected, tol=1e-10):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def test_rng_tracker_states_round_trip():
    tracker = RNGTracker()
    tracker.add("a", 1)
    tracker.add("b", 2)
    with pytest.raises(ValueError):
        tracker.add("a", 3)
    saved = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(4)
    with tracker.fork("a"):
        second = torch.rand(4)
    assert not torch.equal(first, second)  # the named stream advances across forks
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), first)
    with tracker.fork("b"):
        assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(2)))
    with pytest.raises(KeyError):
        with tracker.fork("missing"):
            pass


def test_rng_fork_restores_default_even_on_error():
    tracker = RNGTracker()
    tracker.add("model-parallel", 5)
    state = torch.get_rng_state()
    with pytest.raises(ZeroDivisionError):
        with tracker.fork():
            torch.rand(3)
            1 / 0
    assert torch.equal(torch.get_rng_state(), state)


def test_checkpoint_dropout_matches_plain():
    gen = torch.Generator().manual_seed(8)
    lin = nn.Linear(6, 6).double()
    x = torch.randn(4, 6, dtype=F64, generator=gen)
    scale = torch.randn(4, 6, dtype=F64, generator=gen)  # a tensor argument that needs no grad
    tracker = RNGTracker()

    def fn(inp, s, p, tag):
        assert tag == "non-tensor"
        with tracker.fork():
            inp = F.dropout(inp, p)
        return F.dropout(torch.tanh(lin(inp)) * s, p), inp.sum()

    def run(use_checkpoint, x_requires_grad=True):
        torch.manual_seed(0)
        tracker.reset()
        tracker.add("model-parallel", 99)
        lin.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(x_requires_grad)
        args = (xi, scale, 0.4, "non-tensor")
        out, extra = checkpoint(fn, tracker, *args) if use_checkpoint else fn(*args)
        (out.pow(2).sum() + extra).backward()
        states = (torch.get_rng_state(), tracker.get_states()["model-parallel"]["cpu"])
        return out.detach(), xi.grad, lin.weight.grad.clone(), lin.bias.grad.clone(), states

    plain, ckpt = run(False), run(True)
    for a, b in zip(plain[:4], ckpt[:4]):
        _close(b, a)
    # Recomputation put back the RNG states it found: both runs leave the streams in the same place.
    assert torch.equal(plain[4][0], ckpt[4][0]) and torch.equal(plain[4][1], ckpt[4][1])
    # Without any input requiring grad, the parameters used inside still get their gradients.
    plain_ng, ckpt_ng = run(False, x_requires_grad=False), run(True, x_requires_grad=False)
    assert ckpt_ng[1] is None
    _close(ckpt_ng[2], plain_ng[2])
    _close(ckpt_ng[3], plain_ng[3])
