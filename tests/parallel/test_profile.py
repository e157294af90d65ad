"""Step-time breakdown: nested spans are charged to the innermost one; collectives are timed by group."""
from __future__ import annotations

import pytest

from mlplat.parallel.profile import CATEGORIES, Recorder, Span, exclusive_times


def test_nested_spans_are_charged_to_the_innermost():
    spans = [Span("data", "data", 0.0, 1.0),
             Span("F", "compute", 1.0, 5.0), Span("all_reduce", "tp_comm", 2.0, 3.0),
             Span("RECV wait", "bubble", 5.0, 6.0), Span("all_gather", "tp_comm", 5.5, 5.75),
             Span("B", "compute", 6.0, 9.0), Span("recompute", "recompute", 6.0, 7.0),
             Span("all_reduce", "tp_comm", 6.5, 6.75),
             Span("dp", "dp_comm", 9.5, 10.0), Span("outside", "compute", 10.0, 11.0)]
    got = exclusive_times(spans, 0.0, 10.0)
    assert set(got) == set(CATEGORIES)
    assert got["data"] == 1.0 and got["tp_comm"] == 1.0 + 0.25 + 0.25
    assert got["compute"] == pytest.approx(3.0 + 2.0)  # F less its all-reduce, B less the recompute
    assert got["recompute"] == pytest.approx(0.75) and got["bubble"] == pytest.approx(0.75)
    assert got["dp_comm"] == 0.5  # the span past the window's end is not counted
    assert sum(got.values()) == pytest.approx(9.5)  # [9, 9.5] is covered by no span


def test_collectives_are_timed_and_categorised_by_group(monkeypatch):
    import torch.distributed as dist

    class Grid:
        tp_group, dp_group, pp_group, embedding_group, model_parallel_group = object(), object(), None, None, None

    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, async_op=False: calls.append(group))
    rec, grid = Recorder(), Grid()
    with rec.recording(grid):
        dist.all_reduce(None, group=grid.tp_group)
        dist.all_reduce(None, group=grid.dp_group)
        dist.all_reduce(None, group=grid.dp_group, async_op=True)  # waited for elsewhere: not a span here
    dist.all_reduce(None, group=grid.tp_group)  # after recording: the original function again, unrecorded
    assert [s.category for s in rec.spans] == ["tp_comm", "dp_comm"] and len(calls) == 4
