"""Checkpoints of key/value heads replicated over tensor-parallel ranks (fewer key/value heads than t), and
resharding between the replicated and the split layouts: multi-query attention (one key/value head, a QKV bias as
Qwen2's) saved at t2 comes back bit-exact at t2 and at t1 (d2, distributed optimizer: its shards are boxes of the
full tensor), and a t1 checkpoint loads into t2. Every check runs in one spawn of two ranks."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.dist import run_distributed

MODEL = dict(arch="llama", n_layers=2, hidden=32, n_heads=4, n_kv_heads=1, qkv_bias=True, seq_len=16,
             vocab_size=250, dropout=0.0)


def _module(tp: int, dp: int, distributed: bool = False):
    from mlplat.config import load_config
    from mlplat.step import TrainStep
    from tests.helpers.equivalence import make_grid

    raw = {"model": MODEL, "parallel": dict(tp=tp, pp=1, dp=dp, micro_batch_size=2, global_batch_size=2 * dp),
           "optim": dict(distributed=distributed), "trainer": dict(max_steps=3, precision="64-true"),
           "logger": dict(name="none"), "sample": dict(max_new_tokens=0), "seed": 7}
    cfg = load_config(raw, world_size=tp * dp, check_data=False)
    module = TrainStep(cfg, make_grid(cfg))
    return module, module.optimizer


def _full(module) -> dict[str, torch.Tensor]:
    """Full (tp = 1) weights by full-model name, vocabulary tables cut to the real vocabulary."""
    from mlplat.checkpoint.state import VOCAB_ROWS, full_parameters
    from tests.helpers.equivalence import _gather

    out = {}
    for name, p in full_parameters(module.chunks).items():
        full = _gather(p.data, p, module.grid)
        out[name] = full[:MODEL["vocab_size"]] if name in VOCAB_ROWS else full
    return out


def _changed(module) -> None:
    """A state unlike a fresh module's, the same on every rank holding an element (a function of its value); the
    vocabulary padding stays zero."""
    from mlplat.checkpoint.state import full_parameters, main_params_of, optimizer_state_of

    with torch.no_grad():
        for p in full_parameters(module.chunks).values():
            p.mul_(-2)
            if main_params_of(module.optimizer) is None:
                optimizer_state_of(module.optimizer, p)["exp_avg"].copy_(p.data * 3)
        if main_params_of(module.optimizer) is not None:
            module.grads.refresh()


def _in_group(rank, world, root):
    from mlplat.checkpoint import io
    from mlplat.checkpoint.state import full_parameters

    root = Path(root)
    out = {}
    # t2: the key/value head on both ranks, saved once; back at t2 (weights and Adam's moments) and at t1·d2.
    module, opt = _module(tp=2, dp=1)
    _changed(module)
    io.save(root / "t2", module.chunks, opt, module.grid, {"global_step": 1}, {"tp": 2})
    saved = _full(module)
    again, opt2 = _module(tp=2, dp=1)
    io.load(root / "t2", again.chunks, opt2, again.grid, vocab_size=MODEL["vocab_size"])
    pairs = zip(full_parameters(module.chunks).items(), full_parameters(again.chunks).values())
    out["t2_t2"] = {name: (torch.equal(a, b), torch.equal(opt.state[a]["exp_avg"], opt2.state[b]["exp_avg"]))
                    for (name, a), b in pairs}
    one, _ = _module(tp=1, dp=2, distributed=True)
    io.load(root / "t2", one.chunks, one.optimizer, one.grid, vocab_size=MODEL["vocab_size"])
    out["t2_t1"] = {name: torch.equal(t, saved[name]) for name, t in _full(one).items()}
    # t1·d2 (distributed optimizer) -> t2
    _changed(one)
    io.save(root / "t1", one.chunks, one.optimizer, one.grid, {"global_step": 2}, {"tp": 1, "dp": 2})
    expected = _full(one)
    two, opt3 = _module(tp=2, dp=1)
    io.load(root / "t1", two.chunks, opt3, two.grid, vocab_size=MODEL["vocab_size"])
    out["t1_t2"] = {name: torch.equal(t, expected[name]) for name, t in _full(two).items()}
    qkv = full_parameters(two.chunks)["layers.0.attn.qkv.weight"]
    out["kv_rows"] = qkv.data[-2 * 8:].clone()  # this rank's copy of the key/value head (head_dim 8)
    return out


def test_replicated_key_value_heads_reshard_bit_exact(tmp_path):
    results = run_distributed(_in_group, 2, str(tmp_path), timeout=240)
    for res in results:
        assert res["t2_t2"] and all(all(v) for v in res["t2_t2"].values()), res["t2_t2"]
        assert res["t2_t1"] and all(res["t2_t1"].values()), res["t2_t1"]
        assert res["t1_t2"] and all(res["t1_t2"].values()), res["t1_t2"]
    assert torch.equal(results[0]["kv_rows"], results[1]["kv_rows"])
