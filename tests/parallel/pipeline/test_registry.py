"""The schedule registry: a schedule registered by a test - GPipe with its backwards last in, first out - is one entry
plus its order function, and from then on the layout rules accept it, the planner searches it, the simulator and the
cost models time it and the timeline draws it (tests/parallel/pipeline/test_engine.py runs it); after the `with`
block it is gone."""
from __future__ import annotations

from dataclasses import replace

import pytest

from mlplat.parallel.layout import registry
from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.parallel.layout.schedules import Op, build_schedule, paper_bubble
from mlplat.perf.simulator import CostModel, check_schedule, simulate
from tests.helpers.perf import a100
from tests.helpers.schedules import TOY

NAME = TOY.name


def test_a_registered_schedule_is_validated_searched_simulated_timed_and_drawn(tmp_path, monkeypatch):
    from mlplat.perf import timeline
    from mlplat.perf.cluster import predict
    from mlplat.perf.flops import ModelDims
    from mlplat.plan import candidate_layouts, evaluate, search

    assert PipelineLayout(4, 1, NAME).violations() == [
        f"parallel.schedule='{NAME}' is not one of gpipe, 1f1b, interleaved, zb_h1, zb_h2, zbv, v_half, 1f1b_overlap"]
    with registry.registered(TOY):
        # The layout rules: one chunk per rank, as the entry says; the config's refusal lists it.
        assert PipelineLayout(4, 1, NAME).violations() == []
        assert PipelineLayout(4, 2, NAME).violations() == [
            f"parallel.vpp=2 needs parallel.schedule=interleaved (got {NAME})"]
        assert NAME in PipelineLayout(4, 1, "zigzag").violations()[0]
        with pytest.raises(ValueError, match="already registered"):
            registry.register(TOY)

        # Its instruction lists: well formed, each rank's backwards last in first out, GPipe's bubble exactly.
        for p, m in ((2, 3), (4, 8)):
            sched = build_schedule(NAME, p, 1, m)
            check_schedule(sched, p, 1, m, NAME)
            assert [i.micro_batch for i in sched[0] if i.op is Op.BACKWARD] == list(reversed(range(m)))
            res = simulate(sched, CostModel(forward=1.0, backward=2.0), 1)
            assert res.bubble_fraction == pytest.approx(paper_bubble(NAME, p, 1, m), abs=1e-12)
            assert res.peak_in_flight == [m] * p

        # The planner: beside 1F1B and the zero-bubble schedules at v = 1, weighed and timed like them.
        big = ModelDims(n_layers=128, hidden=25600, n_heads=160, seq_len=2048, vocab_size=51200)
        kinds = {lay.schedule for lay in candidate_layouts(big, a100(), 3072, 3072, micro_batch_sizes=(1,),
                                                            recompute=("full",), max_vpp=2, distributed=False,
                                                            sequence_parallel=(True,)) if lay.pp > 1 and lay.vpp == 1}
        assert kinds == {"1f1b", "zb_h1", "zb_h2", NAME}
        dims = ModelDims(n_layers=8, hidden=1024, n_heads=16, seq_len=1024, vocab_size=51200)
        best, _ = search(dims, a100(), 8, 64, top=1000, micro_batch_sizes=(2,), recompute=("none",), max_vpp=1,
                         precision="bf16-mixed", distributed=False, sequence_parallel=(False,))
        toy = [c for c in best if c.layout.schedule == NAME]
        assert toy and all(c.prediction.method == "simulated" for c in toy)
        # The cost models read its entry: GPipe's fill, its ranks ending together; its memory counts all m.
        lay = toy[0].layout
        gpipe = evaluate(dims, replace(lay, schedule="gpipe"), a100())
        assert toy[0].memory_bytes == gpipe.memory_bytes
        assert predict(dims, lay, a100(), method="analytic").seconds_per_iteration == pytest.approx(
            predict(dims, gpipe.layout, a100(), method="analytic").seconds_per_iteration, rel=1e-12)

        # The timeline, under its label.
        titles = []
        plot = timeline.plot_timeline
        monkeypatch.setattr(timeline, "plot_timeline", lambda *a, **kw: titles.append(kw["title"]) or plot(*a, **kw))
        out = tmp_path / "toy.png"
        timeline.main(["--schedule", NAME, "-p", "4", "-m", "8", "-o", str(out)])
        assert out.stat().st_size > 1000 and titles[0].startswith("GPipe, backwards last in first out, p=4")
    assert NAME not in registry.names() and "is not one of" in PipelineLayout(4, 1, NAME).violations()[0]
