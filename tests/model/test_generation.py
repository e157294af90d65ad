"""Generation through the pipeline (`mlplat.model.generation`) under t2·p2·d2: the first data-parallel replica
decodes one sequence per token, the other takes each token from it, and every rank returns the one-process tokens."""
from __future__ import annotations

import torch

from mlplat.config import load_config
from tests.helpers.dist import run_distributed

MODEL = dict(n_layers=4, hidden=32, n_heads=4, seq_len=16, vocab_size=64, position="rope")
PROMPT = [5, 9, 3, 17]
NEW = 12  # past seq_len - len(PROMPT): the window slides


def _cfg(tp: int, pp: int, dp: int):
    return load_config({
        "model": MODEL,
        "parallel": dict(tp=tp, pp=pp, dp=dp, micro_batch_size=4, global_batch_size=8 * dp),
        "kernels": dict(attention="math"), "trainer": dict(precision="64-true"), "logger": dict(name="none"),
    }, world_size=tp * pp * dp, check_data=False)  # token ids of its own


def _worker(rank, world_size, tp, pp, dp):
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.step import TrainStep
    from mlplat.step.decode import generate

    grid = ParallelGrid(tp, pp, dp)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        module = TrainStep(_cfg(tp, pp, dp), grid)
    finally:
        torch.set_default_dtype(saved)
    comm, passes, rows = module.engine.comm, [], []
    run = module.engine.run

    def counted(micro_batches, **kwargs):
        passes.append(1)
        rows.append({int(mb[0].shape[0]) for mb in micro_batches})
        return run(micro_batches, **kwargs)

    module.engine.run = counted
    ids = generate(module, PROMPT, NEW, temperature=1.0, seed=7)
    restored = module.engine.comm is comm  # training's micro-batch shape comes back
    return dict(ids=ids, dp_rank=grid.dp_rank, passes=len(passes), rows=set().union(*rows), restored=restored)


def test_every_rank_returns_the_one_process_tokens_and_one_replica_decodes():
    one = run_distributed(_worker, 1, 1, 1, 1)[0]
    assert len(one["ids"]) == len(PROMPT) + NEW and len(set(one["ids"][len(PROMPT):])) > 3  # drawn, not one repeat
    ranks = run_distributed(_worker, 8, 2, 2, 2)
    assert [r["ids"] for r in ranks] == [one["ids"]] * 8
    assert [r["passes"] for r in ranks] == [NEW if r["dp_rank"] == 0 else 0 for r in ranks]
    assert all(r["rows"] == {1} for r in ranks if r["dp_rank"] == 0)  # one sequence, not training's micro-batch of 4
    assert all(r["restored"] for r in ranks)


def test_a_long_sample_says_how_far_it_is(monkeypatch, caplog):
    """Each new token is a whole forward pass of the window: a long sample (sample.max_new_tokens=100000 at
    seq_len=64 took 20 silent minutes) says how far it is, its rate and the time left, every PROGRESS_S."""
    from mlplat.model import generation
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.step import TrainStep
    from mlplat.step.decode import generate

    ticks = iter(range(0, 10_000, 4))  # each reading of the clock 4 s later
    monkeypatch.setattr(generation, "_clock", lambda: float(next(ticks)))
    module = TrainStep(_cfg(1, 1, 1), ParallelGrid())
    with caplog.at_level("INFO", logger="mlplat"):
        generate(module, PROMPT, 6, seed=7)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sample: ")]
    assert lines and lines[0].startswith("sample: 3 of 6 tokens, ") and lines[0].endswith(" s left"), lines
