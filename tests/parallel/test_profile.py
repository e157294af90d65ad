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
        tp_group, dp_group, pp_group, embedding_group = object(), object(), None, None

    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, async_op=False: calls.append(group))
    rec, grid = Recorder(), Grid()
    with rec.recording(grid):
        dist.all_reduce(None, group=grid.tp_group)
        dist.all_reduce(None, group=grid.dp_group)
        dist.all_reduce(None, group=grid.dp_group, async_op=True)  # waited for elsewhere: not a span here
    dist.all_reduce(None, group=grid.tp_group)  # after recording: the original function again, unrecorded
    assert [s.category for s in rec.spans] == ["tp_comm", "dp_comm"] and len(calls) == 4


def test_positional_groups_and_async_waits_are_timed(monkeypatch):
    """The group may come by position; an asynchronous collective is a span where its work is waited for (in the
    group's category), and only while the recorder records; everything else of the work is the work's."""
    import torch.distributed as dist

    class Grid:
        tp_group, dp_group = object(), object()

    class Work:
        waited = 0

        def wait(self):
            Work.waited += 1
            return True

        def is_completed(self):
            return "delegated"

    monkeypatch.setattr(dist, "reduce_scatter_single",
                        lambda out, inp, op=None, group=None, async_op=False: Work() if async_op else None)
    rec, grid = Recorder(), Grid()
    with rec.recording(grid):
        dist.reduce_scatter_single(None, None, None, grid.tp_group)  # op and group by position
        work = dist.reduce_scatter_single(None, None, None, grid.dp_group, True)
        assert not rec.spans[1:] and work.is_completed() == "delegated"
        assert work.wait() is True
        late = dist.reduce_scatter_single(None, None, group=grid.tp_group, async_op=True)
    late.wait()  # after recording: waited, not recorded
    assert [(s.name, s.category) for s in rec.spans] == [("reduce_scatter_single", "tp_comm"),
                                                         ("reduce_scatter_single (wait)", "dp_comm")]
    assert Work.waited == 2


def _fake_cuda(monkeypatch) -> list:
    """torch.cuda without a GPU: current_stream(device) gives a stream that notes its synchronize; a device-wide
    torch.cuda.synchronize raises."""
    import torch

    synced = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            synced.append(str(self.device))

    def device_wide():
        raise AssertionError("torch.cuda.synchronize waits for the NCCL streams too: it stalls the pipeline")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    return synced


def test_spans_on_cuda_wait_for_the_compute_stream_never_the_device(monkeypatch, tmp_path):
    """The sync the profiler installs for a cuda device waits for that device's current stream (at both ends of a
    span) and never calls torch.cuda.synchronize; on a CPU none is installed; one a test mode set is kept."""
    from types import SimpleNamespace

    import torch

    from mlplat.lightning.profiling import Profiler
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.parallel.hang import HangWatch
    from mlplat.parallel.profile import span_sync
    from tests.helpers.equivalence import make_cfg

    synced = _fake_cuda(monkeypatch)
    assert span_sync(torch.device("cpu")) is None
    cfg = make_cfg()
    cfg.profile.steps = [1, 2]

    def profiled_step(device, sync=None):
        grid = ParallelGrid()
        step = SimpleNamespace(device=torch.device(device), grid=grid, watch=HangWatch(grid, 60.0), tracker=None)
        module = SimpleNamespace(step=step, log=lambda *a, **k: None)
        clock = SimpleNamespace(step_end=None)
        profiler = Profiler(cfg, tmp_path, clock)
        profiler.recorder.sync = sync
        profiler.on_train_batch_start(SimpleNamespace(global_step=0), module, None, 0)
        installed = profiler.recorder.sync
        with step.watch.blocked_in("F(chunk 0, mb 0)"):
            pass
        clock.step_end = profiler.recorder.now()
        profiler.on_train_batch_end(SimpleNamespace(global_step=1), module, None, None, 0)
        return installed, [s.name for s in profiler.recorder.spans]

    installed, names = profiled_step("cuda:1")
    assert installed is not None and installed is not torch.cuda.synchronize
    assert "F(chunk 0, mb 0)" in names
    assert synced == ["cuda:1"] * 3  # the span's two ends, then the step end read above
    synced.clear()
    assert profiled_step("cpu")[0] is None and synced == []
    own = lambda: None  # noqa: E731 - e.g. the NCCL-strict mode's
    assert profiled_step("cuda:0", own)[0] is own and synced == []


def test_no_module_level_recorder_and_recompute_seen_from_another_thread():
    """The profile module holds no mutable state; the recorder reaches a recomputation through the RNG tracker the
    model passes to the checkpoint, also when backward runs in a thread other than the one recording (on a GPU
    autograd runs it in its worker thread: a ContextVar set by the step would not be seen there). Two recorders
    in turn each get their own spans."""
    import threading

    import torch

    from mlplat.parallel import profile
    from mlplat.parallel.random import RNGTracker, checkpoint

    mutable = {k: type(v).__name__ for k, v in vars(profile).items()
               if not k.startswith("__") and isinstance(v, (list, dict, set, profile.Recorder))}
    assert not mutable, mutable

    class Grid:
        pass

    tracker = RNGTracker()
    x = torch.randn(4, 4, requires_grad=True)
    errors = []

    def backward(out):
        try:
            out.sum().backward()
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    for expected in (1, 1):
        rec = Recorder()
        with rec.recording(Grid(), tracker):
            out = checkpoint(torch.tanh, tracker, x)
            worker = threading.Thread(target=backward, args=(out,))
            worker.start()
            worker.join()
        assert not errors and [s.category for s in rec.spans].count("recompute") == expected
    assert getattr(tracker, "recorder", None) is None
    checkpoint(torch.tanh, tracker, x).sum().backward()  # not recording: no span, no error


def test_every_collective_mlplat_calls_is_seen_by_the_profiler():
    """Scan of mlplat: every torch.distributed function it names is a collective the profiler times or a known
    point-to-point / setup call (a new name must be classified here), and no collective is bound at import (the
    profiler would never see it: the fault sequence.py had)."""
    import ast
    from pathlib import Path

    from mlplat.parallel.profile import COLLECTIVES

    not_timed = {"is_available", "is_initialized", "get_world_size", "get_rank", "new_group", "init_process_group",
                 "destroy_process_group", "ReduceOp", "TCPStore", "PrefixStore", "Store", "isend", "irecv", "send",
                 "recv", "batch_isend_irecv", "P2POp", "Work", "ProcessGroup", "Backend", "get_backend",
                 "get_process_group_ranks", "get_global_rank", "get_group_rank", "GroupMember", "group", "checkpoint"}
    root = Path(__file__).resolve().parents[2] / "mlplat"
    unknown, bound = set(), []

    def names(node):
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and ast.unparse(n.value) in ("dist", "torch.distributed"):
                yield n.attr
            if (isinstance(n, ast.Call) and ast.unparse(n.func) == "getattr" and len(n.args) >= 2
                    and ast.unparse(n.args[0]) in ("dist", "torch.distributed")
                    and isinstance(n.args[1], ast.Constant)):
                yield n.args[1].value

    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        unknown |= {f"{path.name}: {n}" for n in names(tree) if n not in COLLECTIVES and n not in not_timed}
        for stmt in tree.body:
            if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.module.startswith("torch.distributed"):
                bound += [f"{path.name}: from {stmt.module} import {a.name}" for a in stmt.names
                          if a.name in COLLECTIVES]
            elif not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import,
                                       ast.ImportFrom)):
                bound += [f"{path.name}:{stmt.lineno} {n}" for n in names(stmt) if n in COLLECTIVES]
    assert not unknown, f"torch.distributed names to classify in this test or in profile.COLLECTIVES: {unknown}"
    assert not bound, f"collectives bound at import (looked up per call, the profiler would time them): {bound}"


# ----------------------------------------------------------------------------- a recorded step, four gloo ranks
# tp2·dp2, sequence parallelism, the distributed optimizer and full recomputation: two optimizer steps recorded as
# the profiler records them (the hang watch's labels, the collectives, the recomputations).
_TIMED = ("all_reduce", "all_gather", "reduce_scatter_single", "all_gather_single")


def _recorded_steps(rank: int, world_size: int) -> dict:
    import functools

    import torch
    import torch.distributed as dist

    from mlplat.parallel.grid import ParallelGrid
    from tests.helpers.equivalence import build_module, local_batches, make_cfg

    torch.set_num_threads(1)
    cfg = make_cfg(tp=2, dp=2, global_batch=8, sequence_parallel=True, recompute="full")
    cfg.optim.distributed, cfg.model.n_layers = True, 2
    grid = ParallelGrid(tp=2, dp=2)
    module = build_module(cfg, grid)  # float64
    opt = module.optimizer
    # Below the profiler: every call of these collectives, however it was reached.
    calls = {name: 0 for name in _TIMED}

    def counting(name, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    saved = {name: getattr(dist, name) for name in _TIMED}
    for name, fn in saved.items():
        setattr(dist, name, counting(name, fn))
    rec, windows = Recorder(), []
    module.watch.recorder = rec
    try:
        for batch in local_batches(cfg, grid.dp_rank, 2):
            start = rec.now()
            with rec.recording(grid, module.tracker):
                opt.zero_grad(set_to_none=True)
                module.forward_backward(batch)
                with module.watch.blocked_in("the optimizer step", "optimizer"):
                    opt.step()
                if len(windows) == 1:
                    module.grads.wait()  # the last step's all-gathers, so that every post is waited for here
            windows.append((start, rec.now()))
    finally:
        module.watch.recorder = None
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return {"spans": [(s.name, s.category, s.start, s.end) for s in rec.spans], "calls": calls,
            "windows": windows, "breakdown": [exclusive_times(rec.spans, *w) for w in windows]}


_RECORDED: list = []


def _recorded() -> list[dict]:
    if not _RECORDED:
        from tests.helpers.dist import run_distributed

        _RECORDED.append(run_distributed(_recorded_steps, 4, timeout=300))
    return _RECORDED[0]


def test_sequence_parallel_collectives_are_tp_comm_and_distributed_optimizer_ones_dp_comm():
    """Recorded tp2·dp2 steps: sequence parallelism's all-gathers and reduce-scatters (forward, and overlapped in
    backward: timed at their waits) are tp_comm spans; the distributed optimizer's reduce-scatters and all-gathers
    are dp_comm spans, the all-gather waited in the next forward nested in it (so not charged as compute); every
    call of those collectives is a span; recomputation is recorded; the breakdown shows all three."""
    for result in _recorded():
        spans, calls = result["spans"], result["calls"]
        seen = {(name, category) for name, category, _, _ in spans}
        assert {("all_gather", "tp_comm"), ("reduce_scatter_single", "tp_comm"),  # g and ḡ, forward
                ("all_gather (wait)", "tp_comm"), ("reduce_scatter_single (wait)", "tp_comm")} <= seen  # backward
        assert {("reduce_scatter_single (wait)", "dp_comm"), ("all_gather_single (wait)", "dp_comm")} <= seen
        assert not {n for n, c in seen if c == "compute" and n.split(" ")[0] in _TIMED}
        for name in _TIMED:
            timed = sum(1 for n, _, _, _ in spans if n in (name, f"{name} (wait)"))
            assert timed == calls[name], (name, timed, calls[name])
        forwards = [(s, e) for n, _, s, e in spans if n.startswith("F(")]
        gathers = [(s, e) for n, c, s, e in spans if n == "all_gather_single (wait)"]
        assert any(fs <= s and e <= fe for s, e in gathers for fs, fe in forwards)
        later = result["breakdown"][1]
        assert later["tp_comm"] > 0 and later["dp_comm"] > 0 and later["recompute"] > 0 and later["compute"] > 0


def test_a_written_profile_says_where_it_went(tmp_path, caplog):
    """After the last profiled step rank 0 writes DIR/profile/ and says so in one line (one process here)."""
    import logging
    from types import SimpleNamespace

    import torch

    from mlplat.lightning.profiling import Profiler
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.parallel.hang import HangWatch
    from tests.helpers.equivalence import make_cfg

    cfg = make_cfg()
    cfg.profile.steps = [1, 1]
    grid = ParallelGrid()
    step = SimpleNamespace(device=torch.device("cpu"), grid=grid, watch=HangWatch(grid, 60.0), tracker=None)
    module = SimpleNamespace(step=step, log=lambda *a, **k: None)
    clock = SimpleNamespace(step_end=None)
    profiler = Profiler(cfg, tmp_path, clock)
    profiler.on_train_batch_start(SimpleNamespace(global_step=0), module, None, 0)
    for op in ("F", "B"):
        with step.watch.blocked_in(f"{op}(chunk 0, mb 0)", op=op, chunk=0, micro_batch=0):
            pass
    clock.step_end = profiler.recorder.now()
    with caplog.at_level(logging.INFO, logger="mlplat"):
        profiler.on_train_batch_end(SimpleNamespace(global_step=1, num_nodes=1), module, None, None, 0)
    folder = tmp_path / "profile"
    assert (folder / "trace.json").exists() and (folder / "report.md").exists()
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("profile of step")] == [
        f"profile of step 1: {folder} (trace.json for chrome://tracing or Perfetto, timeline.png, report.md)"]
