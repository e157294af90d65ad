"""The real pipeline engine on real processes, timed against the simulator and against torch.distributed.pipelining.

    python experiments/pipeline_bench/bench.py            # ~7 minutes on 2 cores; writes results.md here
    python experiments/pipeline_bench/bench.py --tf 0.1 --repeats 7 --more-m 16 32 --torch-v4 --out /tmp/r.md

What runs. p=4 (--p) gloo CPU processes execute `PipelineEngine` (mlplat/parallel/pipeline/engine.py) with the
instruction lists of `build_schedule(kind, p, v, m)`: gpipe, 1f1b, interleaved v=2 and v=4, zb_h1 (v=1) and zbv
(v=2, V placement) at m=8, and 1f1b, zb_h1 and zbv again at m=16 (--more-m). The model chunks are "sleep
stages": a chunk's forward takes tf/v, its input gradient (B) tB/v and its weight gradient (W) tW/v of wall
time, with tB = tW = tf by default (F = B = W, the zero-bubble paper's setting, so the whole backward is
tb = 2·tf), its own small tensor and autograd work included (it does that work, then sleeps until the deadline;
a backward pass sleeps at its end, once autograd has run all of its nodes), on a real
[micro_batch, seq, hidden] float32 activation, so the point-to-point traffic is real but the compute has a fixed
duration that does not depend on how many cores the machine has or how loaded it is (sleeping ranks leave the
CPUs free). The W sleep sits on the weight's own autograd branch: a schedule without the split runs it inside
its backward; in mlplat's zero-bubble B the chunk's `WeightGradStore` (which the engine attaches to every module
with a `wgrad_store`, the sleep stage included) has a key set, so the W sleep and the gradient accumulation are
deferred to the store and run by the engine's W (each step checks that every W sleep ran where the schedule
puts it). What the engine does around the computes (posting its sends and receives, waiting for them,
bookkeeping) is not hidden. Every rank does the same work m·(tf+tb) for any v, so step times compare directly.

Figures (medians over --repeats timed steps after one warm-up; the runs take turns round by round):
  * measured step time = latest end - earliest start over the ranks (one system-wide monotonic clock);
  * the simulator's prediction for the same instruction lists, with two transports:
    `mlplat.perf.simulator.simulate` (ideal transport: sends never block, each RECV waits for its message) and
    `simulate_nccl` (what the engine posts: the plans of `exchange_plans`, timed under NCCL's rules - one
    communicator per direction, a transfer starts once both sides are posted, each runs in posting order). Each with
    the nominal costs (CostModel forward tf/v; backward tB/v and weight tW/v for the zero-bubble schedules, whose
    CostModel.backward is B alone, else backward (tB+tW)/v) and no transfer time ("ideal"; both transports
    agree there), with the measured one-way transfer time of one activation ("+transfer"), and "calibrated":
    the measured compute durations plus each rank's measured overhead per compute (its span minus its computes
    minus its time blocked in `PostedGroup.wait`, per compute). The headline calibrated figure is
    simulate_nccl's. Per rank also the time spent posting groups and the time blocked in `PostedGroup.wait`,
    first on the receives, then on the sends;
  * interleaved vs 1F1B speed-up, the theoretical one (1+(p-1)/m)/(1+(p-1)/(v·m)) and the fraction achieved,
    (measured - 1)/(theoretical - 1);
  * zb_h1 and zbv vs 1F1B at the same m: the paper's, the simulated (ideal, +transfer under simulate_nccl,
    calibrated) and the measured speed-up, and the share of the simulated gain achieved,
    (measured - 1)/(simulated - 1) with simulate_nccl's +transfer figure, from the medians and from each run's
    fastest step;
  * torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B /
    ScheduleInterleavedZeroBubble (one stage per rank: its ZB1P, the peer of zb_h1) / ScheduleZBVZeroBubble on
    the same sleep stages, each in its own spawned process group together with the matching mlplat schedule
    (ABAB rounds in that group, so the ratio is measured under the same conditions), with torch's own time per
    action (its input-gradient and weight-gradient passes reach the B and W sleeps as mlplat's do). A peer
    that hangs or fails is reported, not waited for: its group is killed after a timeout, and its collectives
    time out on their own first;
  * a summary of the zero-bubble rows: measured, simulated, share of the simulated gain, mlplat / torch.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.autograd import Variable  # noqa: E402

from mlplat.harness.launch import launch as run_distributed  # noqa: E402
from mlplat.parallel.grid import ParallelGrid  # noqa: E402
from mlplat.parallel.hang import HangWatch  # noqa: E402
from mlplat.parallel.layout.exchange import RECV_OPS  # noqa: E402
from mlplat.parallel.layout.pipeline import PipelineLayout  # noqa: E402
from mlplat.parallel.layout.registry import get as schedule_of  # noqa: E402
from mlplat.parallel.layout.schedules import build_schedule, paper_bubble  # noqa: E402
from mlplat.parallel.pipeline.engine import PipelineEngine  # noqa: E402
from mlplat.parallel.pipeline.p2p import PostedGroup, StageComm  # noqa: E402
from mlplat.perf.simulator import CostModel, simulate, simulate_nccl  # noqa: E402

# (label, schedule kind, v): every one at Setup.m; the zero-bubble comparison also at each of Setup.more_m
SCHEDULES = (("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1), ("interleaved v=2", "interleaved", 2),
             ("interleaved v=4", "interleaved", 4), ("zb_h1", "zb_h1", 1), ("zbv", "zbv", 2))
ZB_COMPARISON = (("1f1b", "1f1b", 1), ("zb_h1", "zb_h1", 1), ("zbv", "zbv", 2))
# the torch.distributed.pipelining peer of an mlplat schedule
TORCH_PEERS = MappingProxyType({
    "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved v=2": "ScheduleInterleaved1F1B",
    "zb_h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"})
COMMAND = "python experiments/pipeline_bench/bench.py"

RunKey = tuple[str, int]  # (label, m): one mlplat run


@dataclass(frozen=True)
class Setup:
    p: int = 4
    m: int = 8
    more_m: tuple[int, ...] = (16,)  # further m for 1f1b / zb_h1 / zbv
    tf: float = 0.05  # forward time of one pipeline STAGE per micro-batch (a rank's chunks share it: tf/v each)
    tb_ratio: float = 2.0  # the whole backward, B + W
    w_share: float = 0.5  # W's part of the backward: F = B = W at the defaults (the zero-bubble paper's setting)
    micro_batch: int = 2
    seq: int = 64
    hidden: int = 256  # activation [2, 64, 256] float32 = 128 KiB per message
    repeats: int = 5
    op_timeout_s: float = 30.0

    @property
    def tb(self) -> float:
        """The whole backward of a stage, B + W (what a schedule without the split runs as one B)."""
        return self.tf * self.tb_ratio

    @property
    def tw(self) -> float:
        return self.tb * self.w_share

    @property
    def tb_input(self) -> float:
        """B alone: the input gradient."""
        return self.tb - self.tw

    def runs(self) -> list[tuple[str, str, int, int]]:
        """(label, kind, v, m) of every mlplat run."""
        out = [(label, kind, v, self.m) for label, kind, v in SCHEDULES]
        return out + [(label, kind, v, m) for m in self.more_m if m != self.m for label, kind, v in ZB_COMPARISON]

    def all_m(self) -> list[int]:
        """Every m of the runs, ascending."""
        return sorted({m for *_, m in self.runs()})

    def torch_runs(self) -> list[tuple[str, str, int, int]]:
        """(label, kind, v, m) of every mlplat schedule compared with its torch.distributed.pipelining peer."""
        return [r for r in self.runs() if r[0] in TORCH_PEERS]


def _setup(s: Setup | dict) -> Setup:
    """A Setup back from the plain dict it travels to the spawned processes as."""
    if isinstance(s, Setup):
        return s
    return Setup(**{**s, "more_m": tuple(s["more_m"])})


# ------------------------------------------------------------------------------------------ sleep stages


@dataclass
class ComputeLog:
    """One process's record of its stage computes since the last `reset`: how long each took (F, B: the input
    gradient, W: the weight gradient), and where the W sleeps ran: deferred to a W instruction (mlplat's
    zero-bubble schedules) or inside a backward."""

    durations: dict[str, list[float]] = field(default_factory=lambda: {"F": [], "B": [], "W": []})
    w_deferred: int = 0
    w_inline: int = 0

    def reset(self) -> None:
        for xs in self.durations.values():
            xs.clear()
        self.w_deferred = self.w_inline = 0

    def sleep_until(self, kind: str, start: float, seconds: float) -> None:
        """Sleep until `seconds` after `start` (at once if that is past); record how long the compute took."""
        left = start + seconds - time.perf_counter()
        if left > 0:
            time.sleep(left)
        self.durations[kind].append(time.perf_counter() - start)

    def computing(self) -> float:
        """The time of all recorded computes."""
        return sum(map(sum, self.durations.values()))

    def check_w_placement(self, schedule: str, split: bool) -> None:
        """Every W sleep ran where the schedule says: in a W when the backward is split, else inside its B."""
        where, other = (self.w_deferred, self.w_inline) if split else (self.w_inline, self.w_deferred)
        if other or where != len(self.durations["W"]):
            raise RuntimeError(f"{schedule}: W sleeps ran deferred={self.w_deferred} inline={self.w_inline}, "
                               f"expected all {'deferred' if split else 'inline'}")


class _BackwardClock:
    """The backward passes of one forward call: what their nodes owe in sleep, settled at the end of each pass
    (`Variable._execution_engine.queue_callback`: after the pass's last node, so after the stage's own gradient
    arithmetic and accumulation), and the log the computes go to."""

    __slots__ = ("log", "start", "owed")

    def __init__(self, log: ComputeLog):
        self.log, self.start, self.owed = log, None, []

    def begin(self) -> None:
        """The chunk's first backward op runs: its pass starts now."""
        self.start = time.perf_counter()

    def owe(self, kind: str, seconds: float) -> None:
        """A node of the running pass takes `seconds` of compute (B or W), slept at the end of the pass."""
        if not self.owed:
            if self.start is None:  # a pass that does not reach the chunk's first op (torch's weight pass)
                self.start = time.perf_counter()
            Variable._execution_engine.queue_callback(self._settle)
        self.owed.append((kind, seconds))

    def _settle(self) -> None:
        owed, start = self.owed, self.start
        self.owed, self.start = [], None
        self.log.sleep_until(owed[-1][0], start, sum(s for _, s in owed))
        took = self.log.durations[owed[-1][0]].pop()  # the pass's time, split between what it ran: the
        for kind, seconds in owed[:-1]:               # nominal time to all but the last, the rest to the last
            self.log.durations[kind].append(seconds)
            took -= seconds
        self.log.durations[owed[-1][0]].append(took)


class _EndOfForward(torch.autograd.Function):
    """Identity, the chunk's last forward op: sleeps until the forward has taken `tf`, after its own work. Its
    backward is the chunk's first backward op: it notes when the chunk's backward began."""

    @staticmethod
    def forward(ctx, x, start, tf, clock):
        ctx.clock = clock
        out = x.clone()
        clock.log.sleep_until("F", start, tf)
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.begin()
        return grad, None, None, None


class _InputGrad(torch.autograd.Function):
    """Identity on the path from the chunk's input to its output, so its backward is part of the input gradient
    (B): the pass sleeps until it has taken `tb`, once the rest of its nodes have run."""

    @staticmethod
    def forward(ctx, x, tb, clock):
        ctx.tb, ctx.clock = tb, clock
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.owe("B", ctx.tb)
        return grad, None, None


class _WeightGrad(torch.autograd.Function):
    """Identity on the weight's own branch (weight -> its use), so that only the weight gradient flows through its
    backward: that backward is W, which accumulates the gradient and takes `stage.tw`. A backward that wants the
    input gradient alone never reaches it (torch.distributed.pipelining's input pass, autograd.grad w.r.t. the
    stage input; its weight pass does). In mlplat's zero-bubble B the engine has set a key on the chunk's
    WeightGradStore, and the work is deferred to the store, which the engine runs in that W."""

    @staticmethod
    def forward(ctx, weight, stage, clock):
        ctx.stage, ctx.clock = stage, clock
        return weight.clone()

    @staticmethod
    def backward(ctx, grad):
        stage = ctx.stage
        log, store = stage.log, stage.wgrad_store
        if store is None or store.key is None:  # no split: W is part of this backward pass
            log.w_inline += 1
            ctx.clock.owe("W", stage.tw)
            return grad, None, None

        def weight_gradient(weight=stage.weight, tw=stage.tw):
            start = time.perf_counter()
            weight.grad = grad if weight.grad is None else weight.grad.add_(grad)
            log.sleep_until("W", start, tw)

        store.defer(weight_gradient)
        log.w_deferred += 1
        return None, None, None


class SleepStage(nn.Module):
    """A model chunk whose forward takes `tf`, whose input gradient (B) takes `tb` and whose weight gradient (W)
    takes `tw` seconds of wall time, their own tensor and autograd work included (done first, then a sleep until
    the deadline: on this kind of machine code that runs right after a sleep runs several times slower, and was
    counted as the engine's overhead when the sleep came first): like a
    GPU kernel queue, the chunk's compute has a fixed duration that the CPU work of issuing it hides in, while
    everything the engine does around it (sends, receives, waits, bookkeeping) stays exposed. A backward that is
    not split runs both, tb + tw. With `with_loss`, forward(x, labels) returns the MSE loss (mlplat's last chunk);
    otherwise the activation (torch.distributed.pipelining applies its loss_fn itself). Its computes are recorded
    in `log`."""

    def __init__(self, hidden: int, tf: float, tb: float, tw: float, log: ComputeLog, with_loss: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.tf, self.tb, self.tw, self.log, self.with_loss = tf, tb, tw, log, with_loss
        self.wgrad_store = None  # set by PipelineEngine for the zero-bubble schedules, as on its linear layers

    def forward(self, x, labels=None):
        start, clock = time.perf_counter(), _BackwardClock(self.log)
        y = _InputGrad.apply(x * _WeightGrad.apply(self.weight, self, clock), self.tb, clock)
        if self.with_loss:
            y = _mse(y, labels)
        return _EndOfForward.apply(y, start, self.tf, clock)


def _mse(output, target):
    return ((output - target) ** 2).mean()


def _data(s: Setup, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m * s.micro_batch, s.seq, s.hidden, generator=gen)
    return x, torch.zeros_like(x)


class _TimedGroup(PostedGroup):
    """Posted operations whose wait() adds the time it blocks to its comm's `waited`, split into the time
    until the group's receives have completed and the time after that until its sends have (the group's own
    wait() then waits for the sends)."""

    def __init__(self, group: PostedGroup, is_recv: list[bool]):
        super().__init__(group.works, group.recvs, group.sends, group.comm, group.messages)
        self.is_recv = is_recv  # per work, in posting order

    def wait(self) -> dict:
        t0 = time.perf_counter()
        if len(self.works) == len(self.is_recv):  # gloo: one work per operation
            for work, is_recv in zip(self.works, self.is_recv):
                if is_recv:
                    work.wait()
            # A gloo work must be waited for exactly once (a second wait blocks): the rest waits for the sends.
            self.works = [work for work, is_recv in zip(self.works, self.is_recv) if not is_recv]
        t1 = time.perf_counter()
        out = super().wait()
        t2 = time.perf_counter()
        self.comm.waited_recv += t1 - t0
        self.comm.waited_send += t2 - t1
        return out


class _TimedComm(StageComm):
    """StageComm that adds up the time this rank spends blocked in `PostedGroup.wait` (on the receives, then on
    the sends) and the time it spends posting them, since the last `reset_timers`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reset_timers()

    def reset_timers(self) -> None:
        self.waited_recv = self.waited_send = self.posting = 0.0

    @property
    def waited(self) -> float:
        return self.waited_recv + self.waited_send

    def post(self, messages, payload) -> PostedGroup:
        t0 = time.perf_counter()
        group = super().post(messages, payload)
        self.posting += time.perf_counter() - t0
        return _TimedGroup(group, [ins.op in RECV_OPS for ins in messages])


def _stage(s: Setup, v: int, log: ComputeLog, with_loss: bool = False) -> SleepStage:
    return SleepStage(s.hidden, s.tf / v, s.tb_input / v, s.tw / v, log, with_loss)


def _mlplat_engine(s: Setup, grid: ParallelGrid, kind: str, v: int, log: ComputeLog) -> PipelineEngine:
    """The engine as training runs it: every step under its hang-watch label."""
    layout = PipelineLayout(s.p, v, kind)
    chunks = {c: _stage(s, v, log, with_loss=c == layout.last_chunk) for c in layout.chunks_of(grid.pp_rank)}
    comm = _TimedComm(grid, (s.micro_batch, s.seq, s.hidden), torch.float32, torch.device("cpu"),
                      scatter_gather=False)
    return PipelineEngine(chunks, grid, layout, comm, watch=HangWatch(grid, s.op_timeout_s))


def _timed(step) -> tuple[float, float, float]:
    """Run `step` on every rank; returns (step time, this rank's start, this rank's end). The step time is the
    latest end minus the earliest start; perf_counter is CLOCK_MONOTONIC on Linux, one clock for all processes
    of the machine."""
    dist.barrier()
    t0 = time.perf_counter()
    step()
    t1 = time.perf_counter()
    times = torch.tensor([t0, t1], dtype=torch.float64)
    out = [torch.empty_like(times) for _ in range(dist.get_world_size())]
    dist.all_gather(out, times)
    return max(float(t[1]) for t in out) - min(float(t[0]) for t in out), t0, t1


def _one_way_transfer(s: Setup, rank: int, rounds: int = 40) -> float:
    """Median one-way time of one activation between pipeline ranks 0 and 1 (ping-pong / 2), on every rank."""
    buf = torch.zeros(s.micro_batch, s.seq, s.hidden)
    samples = []
    for _ in range(rounds):
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(buf, 1)
            dist.recv(buf, 1)
            samples.append((time.perf_counter() - t0) / 2)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    value = torch.tensor([statistics.median(samples) if samples else 0.0], dtype=torch.float64)
    dist.broadcast(value, 0)
    return float(value)


def _mlplat_steps(engine: PipelineEngine, x: torch.Tensor, y: torch.Tensor, s: Setup, log: ComputeLog):
    """One training step of `engine` on (x, y), its computes recorded afresh in `log` (the one its stages use)."""
    mbs = list(zip(x.split(s.micro_batch), y.split(s.micro_batch)))
    split = engine.layout.spec.split_backward

    def step():
        log.reset()
        engine.run(mbs)
        log.check_w_placement(engine.layout.schedule, split)
        for chunk in engine.chunks.values():
            chunk.weight.grad = None
    return step


@dataclass
class _RunStats:
    """One rank's figures of one mlplat run over its timed steps."""

    split: bool  # B and W apart (a zero-bubble schedule)
    times: list[float] = field(default_factory=list)
    durations: dict[str, list[float]] = field(default_factory=lambda: {"F": [], "B": [], "W": []})
    overhead: list[float] = field(default_factory=list)
    posting: list[float] = field(default_factory=list)
    blocked: list[float] = field(default_factory=list)
    blocked_send: list[float] = field(default_factory=list)

    def add(self, t: float, span: float, comm: _TimedComm, log: ComputeLog) -> None:
        """One timed step: its step time, this rank's span, and what the comm and the log recorded in it."""
        self.times.append(t)
        for op in "FBW":
            self.durations[op] += log.durations[op]
        # A W sleep is a compute of its own only where the schedule has W's; otherwise it is part of a B.
        n_compute = len(log.durations["F"]) + len(log.durations["B"])
        if self.split:
            n_compute += len(log.durations["W"])
        self.overhead.append((span - comm.waited - log.computing()) / n_compute)
        self.posting.append(comm.posting / n_compute)
        self.blocked.append(comm.waited_recv)
        self.blocked_send.append(comm.waited_send)


def _group_mlplat(rank: int, world: int, s: Setup | dict) -> dict:
    """Every mlplat run (schedule, m) in one process group, round-robin with a rotating order.

    Besides the step times, each rank measures per step its own span (its start to its end), the time it was
    blocked in `PostedGroup.wait` and the time its computes took; (span - blocked - computes) / number of
    computes is this rank's overhead per compute: what the engine does around the computes (posting the
    sends and receives, bookkeeping, being descheduled on a busy machine). The calibrated simulations charge it to
    every compute. The time spent posting (the isend/irecv calls) is also reported on its own."""
    s = _setup(s)
    grid = ParallelGrid(tp=1, pp=s.p, dp=1)
    transfer = _one_way_transfer(s, rank)
    runs = s.runs()
    keys = [(label, m) for label, _, _, m in runs]
    data = {m: _data(s, m) for m in {m for *_, m in runs}}
    log = ComputeLog()
    engines = {(label, m): _mlplat_engine(s, grid, kind, v, log) for label, kind, v, m in runs}
    steps = {key: _mlplat_steps(e, *data[key[1]], s, log) for key, e in engines.items()}
    stats = {key: _RunStats(split=engines[key].layout.spec.split_backward) for key in keys}
    for rnd in range(1 + s.repeats):
        order = keys[rnd % len(keys):] + keys[: rnd % len(keys)]
        for key in order:
            comm = engines[key].comm
            comm.reset_timers()
            t, t0, t1 = _timed(steps[key])
            if rnd > 0:
                stats[key].add(t, t1 - t0, comm, log)
    med = statistics.median
    return {"times": {k: st.times for k, st in stats.items()}, "transfer": transfer,
            "durations": {k: st.durations for k, st in stats.items()},
            "overhead": {k: med(st.overhead) for k, st in stats.items()},
            "posting": {k: med(st.posting) for k, st in stats.items()},
            "blocked": {k: med(st.blocked) for k, st in stats.items()},
            "blocked_send": {k: med(st.blocked_send) for k, st in stats.items()}}


def _timed_actions(stage, first: bool, log: dict) -> None:
    """Wrap a torch stage's per-micro-batch actions so that each call's duration is logged, under
    (first stage?, F | B | W): B is `backward_one_chunk` (the input gradient alone in a zero-bubble schedule,
    else the whole backward), W `backward_weight_one_chunk`."""
    for name, op in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
        fn = getattr(stage, name)

        def timed(*args, _fn=fn, _key=(first, op), **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                log.setdefault(_key, []).append(time.perf_counter() - t0)
        setattr(stage, name, timed)


def _torch_schedule(s: Setup, rank: int, cls_name: str, kind: str, v: int, m: int, group, log: dict):
    from torch.distributed import pipelining as pp

    layout = PipelineLayout(s.p, v, kind)
    computes = ComputeLog()  # the sleeps' own record, unused on this side
    stages = [pp.PipelineStage(_stage(s, v, computes), c, layout.num_chunks, torch.device("cpu"), group=group)
              for c in layout.chunks_of(rank)]
    for st in stages:
        _timed_actions(st, st.stage_index == 0, log)
    cls = getattr(pp, cls_name)
    multi = issubclass(cls, pp.schedules.PipelineScheduleMulti)
    sched = cls(stages if multi else stages[0], n_microbatches=m, loss_fn=_mse)
    x, y = _data(s, m)
    first, last = rank == layout.owner(0), rank == layout.owner(layout.last_chunk)

    def step():
        log.clear()
        computes.reset()
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": []} if last else {}
        sched.step(*args, **kwargs)
        for st in stages:
            st.submod.weight.grad = None
    return step


def _group_vs_torch(rank: int, world: int, s: Setup | dict, cls_name: str, kind: str, v: int, m: int) -> dict:
    """mlplat's `kind` and torch's `cls_name` in one group, ABAB... (the first of each is a warm-up). Also
    torch's per-action times (ms medians over the timed steps, per (first stage?, F | B | W))."""
    s = _setup(s)
    grid = ParallelGrid(tp=1, pp=s.p, dp=1)
    computes = ComputeLog()
    mine = _mlplat_steps(_mlplat_engine(s, grid, kind, v, computes), *_data(s, m), s, computes)
    # torch's own group with a short timeout, so that a hang in its p2p turns into an error on its own.
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=s.op_timeout_s))
    log: dict = {}
    theirs = _torch_schedule(s, rank, cls_name, kind, v, m, group, log)
    times = {"mlplat": [], "torch": []}
    actions: dict = {}
    for rnd in range(1 + s.repeats):
        pair = [("mlplat", mine), ("torch", theirs)]
        if rnd % 2:
            pair.reverse()
        for name, step in pair:
            t = _timed(step)[0]
            if rnd > 0:
                times[name].append(t)
                if name == "torch":
                    for key, xs in log.items():
                        actions.setdefault(key, []).extend(xs)
    return {"times": times, "actions": actions}


# ------------------------------------------------------------------------------------------ driver


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _theoretical_speedup(p: int, m: int, v: int) -> float:
    return (1 + (p - 1) / m) / (1 + (p - 1) / (v * m))


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    tail = [ln for ln in text if ln.strip()]
    # The last line of a rank's traceback is the exception itself.
    msg = tail[-1] if tail else type(err).__name__
    return f"{type(err).__name__}: {msg}"[:300]


NOTES = """
## How to read these figures

* **measured / calibrated (NCCL)** is the check on the engine: `simulate_nccl` runs the exchange plans the engine
  posts (each message on the communicator of its direction, receives one compute ahead, sends waited at the end),
  with the compute durations and per-compute overhead measured in this run, so a ratio near 1 means the engine
  executes its plans as the transport model says it should, with no stalls of its own (late receives, sends
  that block, ranks waiting on the wrong message). The **ideal transport** columns (`simulate`: sends never
  block) are the schedule's own limit; the gap between them and the NCCL columns is what the rendezvous-style
  transfers cost (zero without transfer time, where both transports agree).
* **measured / ideal** and the **fraction of the theoretical speed-up** also contain the per-compute overhead:
  the CPU work the engine does around each compute (posting its gloo isend/irecv, autograd bookkeeping;
  the "posting" column is those calls alone), plus the scheduling delays of a shared
  machine. The interleaved schedule pays it v times as often per step (v·m forwards and backwards per rank,
  and v times the messages), which is the price of interleaving the paper describes for communication. The
  smaller the overhead is against the stage time, the closer the speed-up gets to the theoretical one: run
  with a larger `--tf` to see it (a real model chunk on a GPU takes milliseconds to seconds, while its
  CPU-side overhead overlaps the GPU's queue).
* **blocked** is the time a rank spends in `PostedGroup.wait` per step, split into the time until its
  receives have completed and the time after that until its sends have too (gloo, like NCCL, moves no data
  before the receive is posted: the sender waits for the receiver's "ready"). The second part includes the
  send-only groups: a channel's older send waited for before its next one is posted (at most 2 in flight), the
  rest at the end of the step.
* **torch.distributed.pipelining** runs its own schedules on the same sleep stages, with its own p2p
  (batch_isend_irecv on gloo), in a group of its own with a 30 s collective timeout and an overall timeout,
  so a hang is reported instead of stopping the benchmark. Both sides are timed the same way in the same group.
  Its posting differs from mlplat's: Schedule1F1B batches a forward's send with the next backward's receive
  (and a backward's send with the next forward's receive) and waits for the whole batch, while mlplat waits for
  its sends only at the end of the step; ScheduleGPipe waits for its sends only after all forwards (all
  backwards), and ScheduleInterleaved1F1B (a `_PipelineScheduleRuntime`) posts each receive as its own batch as
  early as its lowering allows (by default) and waits for its sends only at the end of the step. On gloo those
  two never block on a send mid-step.
* **zero bubble**: zb_h1 and zbv run the backward as B (input gradient, on the critical path) and W (weight
  gradient, filling the bubble); 1F1B and the others run the same B + W as one backward, so all do the same
  work. The **share of the simulated gain** compares the measured speed-up over 1F1B with simulate_nccl's at
  the nominal costs, which know no per-compute overhead. A zero-bubble schedule runs 3 computes per chunk and
  micro-batch instead of 2, and zbv (two chunks per rank) posts twice 1F1B's messages, so it pays the engine's
  per-compute CPU work (posting a gloo isend/irecv, an autograd call, bookkeeping: the overhead column) up to
  3 times as often; with tf = 50 ms that is what separates the measured gain from the nominal one, and the
  calibrated column, which charges it, shows what remains. A GPU hides most of it behind the kernel queue.
  The share is also given from each run's fastest step ("best steps"): other work on the machine only ever
  adds time to these fixed-duration steps, and with a handful of steps per run a median on a busy machine
  still carries some of it.
* **torch's zero-bubble schedules** split the backward with their own autograd passes: `backward_one_chunk`
  computes the input gradient alone (reaching the B sleep), `backward_weight_one_chunk` the weight gradient
  from the saved intermediate gradients (reaching the W sleep); the per-action columns show B ≈ tB/v and
  W ≈ tW/v. On its first stage (no input gradient to send) torch runs nothing in B and the whole backward in
  W, while mlplat's chunk 0 runs B and W as the schedule lists them. ScheduleInterleavedZeroBubble takes one
  stage per rank (it is then the paper's ZB1P, warm-up as 1F1B's), the peer of zb_h1; ScheduleZBVZeroBubble
  takes the V placement (two stages per rank, chunks r and 2p-1-r), the peer of zbv. Their orders are not
  mlplat's (mlplat's come from its own list scheduler, `mlplat.parallel.layout.zero_bubble`).
* CPU timings on a shared machine are noisy: the step time ranges are listed, all figures are medians, and the
  schedules take turns within each group so slow phases of the machine hit all of them.
"""


# The command line and what one run measures


@dataclass(frozen=True)
class Options:
    """The command line: the setup of the runs, which torch peers to run, where to write the results."""

    setup: Setup
    torch_v4: bool = False  # also torch's ScheduleInterleaved1F1B at v=4
    no_torch: bool = False
    out: str = ""  # markdown file to write ('' = none)
    command: str = COMMAND  # the command line, as the results file names it

    def torch_pairs(self) -> list[tuple[str, str, str, int, int]]:
        """(label, torch schedule class, kind, v, m) of every pair group to run."""
        if self.no_torch:
            return []
        runs = [(label, TORCH_PEERS[label], kind, v, m) for label, kind, v, m in self.setup.torch_runs()]
        if self.torch_v4:
            runs.append(("interleaved v=4", "ScheduleInterleaved1F1B", "interleaved", 4, self.setup.m))
        return runs


def parse_options(argv: list[str] | None = None) -> Options:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tf", type=float, default=0.05, help="forward seconds per pipeline stage per micro-batch")
    ap.add_argument("--p", type=int, default=4, help="pipeline stages (one process each)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per schedule (after one warm-up)")
    ap.add_argument("--more-m", type=int, nargs="*", default=[16],
                    help="further numbers of micro-batches for 1f1b / zb_h1 / zbv (besides m=8)")
    ap.add_argument("--torch-v4", action="store_true", help="also run torch's ScheduleInterleaved1F1B at v=4")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    ap.add_argument("--out", default=str(HERE / "results.md"), help="markdown file to write ('' = none)")
    args = ap.parse_args(argv)
    given = sys.argv[1:] if argv is None else list(argv)
    return Options(setup=Setup(p=args.p, tf=args.tf, repeats=args.repeats, more_m=tuple(args.more_m)),
                   torch_v4=args.torch_v4, no_torch=args.no_torch, out=args.out,
                   command=" ".join([COMMAND, *given]).strip())


@dataclass(frozen=True)
class MlplatResult:
    """What every rank of the mlplat group returned (`_group_mlplat`), in rank order."""

    ranks: list[dict]

    @property
    def transfer(self) -> float:
        """The measured one-way transfer time of one activation."""
        return self.ranks[0]["transfer"]

    def times(self, key: RunKey) -> list[float]:
        return self.ranks[0]["times"][key]

    def step(self, key: RunKey) -> float:
        """The measured step time: the median over the timed steps."""
        return _median(self.times(key))

    def best(self, key: RunKey) -> float:
        """The run's fastest step."""
        return min(self.times(key))

    def durations(self, key: RunKey) -> dict[str, list[float]] | None:
        """Rank 0's compute durations (F, B, W) over the timed steps; None for a run not in the group."""
        return self.ranks[0]["durations"].get(key)

    def overheads(self, key: RunKey) -> list[float]:
        """Each rank's overhead per compute."""
        return [r["overhead"][key] for r in self.ranks]

    def per_rank(self, name: str, key: RunKey, scale: float = 1e3) -> str:
        return " / ".join(f"{r[name][key] * scale:.1f}" for r in self.ranks)

    def blocked(self, key: RunKey) -> str:
        return " / ".join(f"{r['blocked'][key] * 1e3:.0f}+{r['blocked_send'][key] * 1e3:.0f}" for r in self.ranks)


@dataclass(frozen=True)
class TorchPair:
    """One pair group: mlplat's schedule and its torch.distributed.pipelining peer (`_group_vs_torch`)."""

    label: str
    cls_name: str
    kind: str
    v: int
    m: int
    ranks: list[dict] | None = None  # what each rank returned; None when the group hung or failed
    error: str = ""

    @property
    def key(self) -> RunKey:
        return (self.label, self.m)

    @property
    def mlplat(self) -> float:
        return _median(self.ranks[0]["times"]["mlplat"])

    @property
    def torch(self) -> float:
        return _median(self.ranks[0]["times"]["torch"])

    def action(self, first: bool, op: str) -> str:
        """torch's median time (ms) of one action, on its first stage or on the others."""
        xs = [x for r in self.ranks for x in r["actions"].get((first, op), [])]
        return f"{_median(xs) * 1e3:.1f}" if xs else "-"


def measure_mlplat(s: Setup) -> MlplatResult:
    """Every mlplat run in one process group."""
    per_round = sum((m + s.p - 1) * (s.tf + s.tb) for *_, m in s.runs())
    return MlplatResult(run_distributed(_group_mlplat, s.p, asdict(s), timeout=120 + 3 * (1 + s.repeats) * per_round))


def measure_torch_pair(s: Setup, label: str, cls_name: str, kind: str, v: int, m: int) -> TorchPair:
    """mlplat's `kind` against torch's `cls_name` in a group of their own; a hang or failure is a result."""
    expected = 2 * (1 + s.repeats) * (m + s.p - 1) * (s.tf + s.tb)
    try:
        ranks = run_distributed(_group_vs_torch, s.p, asdict(s), cls_name, kind, v, m, timeout=90 + 3 * expected)
    except BaseException as err:  # noqa: BLE001 - a hanging or failing peer is a result, not a crash
        if isinstance(err, KeyboardInterrupt):
            raise
        return TorchPair(label, cls_name, kind, v, m, error=_reason(err))
    return TorchPair(label, cls_name, kind, v, m, ranks=ranks)


def vs_torch(pairs: list[TorchPair]) -> dict[RunKey, float]:
    """mlplat / torch of every pair group that ran."""
    return {pair.key: pair.mlplat / pair.torch for pair in pairs if pair.ranks is not None}


# What the simulator predicts for the same instruction lists


def _cost_model(kind: str, f, b, w, tr) -> CostModel:
    """B and W apart where the schedule splits the backward (CostModel.backward is then B alone), else one B."""
    if schedule_of(kind).split_backward:
        return CostModel(forward=f, backward=b, transfer=tr, weight=w)
    fused = (lambda r, c, mb: b(r, c, mb) + w(r, c, mb)) if callable(b) else b + w
    return CostModel(forward=f, backward=fused, transfer=tr)


def _simulated(s: Setup, kind: str, v: int, m: int, cost: CostModel, nccl: bool) -> float:
    sim = simulate_nccl if nccl else simulate
    out = sim(build_schedule(kind, s.p, v, m), cost, v)
    if out.deadlock:
        raise RuntimeError(f"{sim.__name__} finds {kind} v={v} m={m} deadlocked: {out.report or out.stuck}")
    return out.step_time


def nominal_step(s: Setup, kind: str, v: int, m: int, transfer: float = 0.0, nccl: bool = False) -> float:
    """The simulated step with the nominal costs (tf/v, tB/v, tW/v) and the given one-way transfer time."""
    return _simulated(s, kind, v, m, _cost_model(kind, s.tf / v, s.tb_input / v, s.tw / v, transfer), nccl)


def calibrated_step(s: Setup, res: MlplatResult, key: RunKey, kind: str, v: int, nccl: bool = True) -> float:
    """The simulated step with the measured compute durations, each rank's overhead per compute and the
    measured transfer."""
    d, o = res.durations(key), res.overheads(key)
    f, b, w = _median(d["F"]), _median(d["B"]), _median(d["W"])
    # A split backward pays the overhead per compute twice (B and W); a fused one once.
    cost = _cost_model(kind, lambda r, c, mb: f + o[r], lambda r, c, mb: b + o[r],
                       lambda r, c, mb: w + (o[r] if schedule_of(kind).split_backward else 0.0), res.transfer)
    return _simulated(s, kind, v, key[1], cost, nccl)


@dataclass(frozen=True)
class ZeroBubbleGain:
    """A zero-bubble run against 1F1B at the same m: speed-ups = 1F1B step / zero-bubble step."""

    paper: float
    simulated_ideal: float
    simulated_nccl: float  # simulate_nccl, nominal costs, measured transfer: what the share is taken of
    simulated_calibrated: float
    measured: float
    share: float  # (measured - 1) / (simulated_nccl - 1)
    measured_best: float  # from each run's fastest step
    share_best: float
    simulated_step: float  # simulate_nccl's step of the zero-bubble run itself (nominal costs, measured transfer)


def zero_bubble_gain(s: Setup, res: MlplatResult, label: str, kind: str, v: int, m: int) -> ZeroBubbleGain:
    key, base, tr = (label, m), ("1f1b", m), res.transfer
    sim_step = nominal_step(s, kind, v, m, tr, nccl=True)
    sim_n = nominal_step(s, "1f1b", 1, m, tr, nccl=True) / sim_step
    got = res.step(base) / res.step(key)
    got_best = res.best(base) / res.best(key)
    return ZeroBubbleGain(
        paper=(1 + (s.p - 1) / m) / (1 + paper_bubble(kind, s.p, v, m)),
        simulated_ideal=nominal_step(s, "1f1b", 1, m) / nominal_step(s, kind, v, m),
        simulated_nccl=sim_n,
        simulated_calibrated=calibrated_step(s, res, base, "1f1b", 1) / calibrated_step(s, res, key, kind, v),
        measured=got, share=(got - 1) / (sim_n - 1), measured_best=got_best, share_best=(got_best - 1) / (sim_n - 1),
        simulated_step=sim_step)


# The tables


@dataclass
class Report:
    """The printed lines, kept for the results file."""

    lines: list[str] = field(default_factory=list)

    def emit(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def print_setup(report: Report, s: Setup, transfer: float) -> None:
    report.emit(
        f"p={s.p}, m={s.m} (and m={', '.join(map(str, s.more_m))} for 1f1b, zb_h1, zbv), stage forward "
        f"tf={s.tf * 1e3:.0f} ms, backward tb={s.tb * 1e3:.0f} ms = B {s.tb_input * 1e3:.0f} ms (input gradient) "
        f"+ W {s.tw * 1e3:.0f} ms (weight gradient), run apart by zb_h1 and zbv and as one backward by the others "
        f"(each of a rank's v chunks: tf/v, tb/v); activation {s.micro_batch}x{s.seq}x{s.hidden} float32 "
        f"= {s.micro_batch * s.seq * s.hidden * 4 // 1024} KiB; gloo, {s.p} processes on {os.cpu_count()} cores; "
        f"medians of {s.repeats} steps; measured one-way transfer {transfer * 1e3:.2f} ms.")
    report.emit()
    report.emit(
        "Simulated on the instruction lists the engine runs, with two transports: `simulate` (ideal: sends never "
        "block) and `simulate_nccl` (the engine's exchange plans under NCCL's rules: one communicator per "
        "direction, a transfer starts once its send and its receive are posted, each runs in posting order). "
        "ideal = nominal tf/v, tb/v (B and W apart for zb_h1 and zbv), no transfer time (both transports agree); "
        "+transfer = nominal costs and the measured one-way transfer; calibrated = the measured compute durations "
        "plus each rank's measured overhead per compute, and the measured transfer. measured / calibrated uses "
        "simulate_nccl, which times what the engine posts.")


def print_step_table(report: Report, s: Setup, res: MlplatResult) -> None:
    """Measured step time of every mlplat run against the simulator's, with the per-rank figures."""
    report.emit()
    report.emit(
        "| schedule | m | simulated: ideal (s) | +transfer, ideal transport (s) | +transfer, NCCL (s) "
        "| calibrated, ideal transport (s) | calibrated, NCCL (s) | mlplat measured (s) | measured / ideal "
        "| measured / calibrated (NCCL) | overhead per compute, ranks 0-3 (ms) | of which posting, ranks 0-3 (ms) "
        "| blocked per step on receives + then on sends, ranks 0-3 (ms) | bubble: paper | bubble: measured "
        "| range of steps (s) |")
    report.emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    tr = res.transfer
    for label, kind, v, m in s.runs():
        key = (label, m)
        ideal = nominal_step(s, kind, v, m)
        tr_ideal, tr_nccl = nominal_step(s, kind, v, m, tr), nominal_step(s, kind, v, m, tr, nccl=True)
        cal_ideal, cal = calibrated_step(s, res, key, kind, v, nccl=False), calibrated_step(s, res, key, kind, v)
        t, times = res.step(key), res.times(key)
        work = m * (s.tf + s.tb)
        report.emit(
            f"| {label} | {m} | {ideal:.3f} | {tr_ideal:.3f} | {tr_nccl:.3f} | {cal_ideal:.3f} | {cal:.3f} "
            f"| {t:.3f} | {t / ideal:.3f} | {t / cal:.3f} | {res.per_rank('overhead', key)} "
            f"| {res.per_rank('posting', key)} | {res.blocked(key)} | {paper_bubble(kind, s.p, v, m):.3f} "
            f"| {(t - work) / work:.3f} | {min(times):.3f}-{max(times):.3f} |")


def print_interleaved_table(report: Report, s: Setup, res: MlplatResult) -> None:
    """Interleaved against 1F1B at m: theoretical, simulated and measured speed-up."""
    report.emit()
    report.emit("Interleaved vs 1F1B, same total work per rank; speed-up = 1F1B step / interleaved step; theoretical "
                "= (1 + (p-1)/m) / (1 + (p-1)/(v·m)); fraction achieved = (measured - 1) / (theoretical - 1):")
    report.emit()
    report.emit("| interleaved run | vs | theoretical speed-up | simulated: +transfer, ideal transport "
                "| simulated: +transfer, NCCL | simulated: calibrated, NCCL | measured speed-up "
                "| fraction of theoretical achieved |")
    report.emit("|---|---|---|---|---|---|---|---|")
    base, tr = ("1f1b", s.m), res.transfer
    for label, kind, v, m in s.runs():
        if kind != "interleaved":
            continue
        theo = _theoretical_speedup(s.p, m, v)
        sim_t = nominal_step(s, "1f1b", 1, m, tr) / nominal_step(s, kind, v, m, tr)
        sim_n = nominal_step(s, "1f1b", 1, m, tr, nccl=True) / nominal_step(s, kind, v, m, tr, nccl=True)
        sim_c = calibrated_step(s, res, base, "1f1b", 1) / calibrated_step(s, res, (label, m), kind, v)
        got = res.step(base) / res.step((label, m))
        report.emit(f"| {label} | 1f1b | {theo:.4f} | {sim_t:.4f} | {sim_n:.4f} | {sim_c:.4f} | {got:.4f} "
                    f"| {(got - 1) / (theo - 1):.1%} |")


def print_zero_bubble_table(report: Report, s: Setup, res: MlplatResult) -> None:
    """zb_h1 and zbv against 1F1B at the same m: paper, simulated and measured speed-up, share of the gain."""
    report.emit()
    report.emit("Zero bubble vs 1F1B at the same m, same total work per rank (1F1B runs B + W as one backward); "
                "speed-up = 1F1B step / zero-bubble step; paper = (1 + (p-1)/m) / (1 + paper bubble); "
                "share of the simulated gain = (measured speed-up - 1) / (simulated speed-up - 1), simulated = "
                "simulate_nccl with the nominal costs and the measured transfer (the engine's own transport); "
                "best steps: the same from each run's fastest step (interference from other work on the machine "
                "only ever adds time to these fixed-duration steps):")
    report.emit()
    report.emit("| zero-bubble run | m | paper speed-up | simulated speed-up: ideal "
                "| simulated speed-up: +transfer, NCCL | simulated speed-up: calibrated, NCCL | measured speed-up "
                "| share of the simulated gain | measured speed-up, best steps | share, best steps |")
    report.emit("|---|---|---|---|---|---|---|---|---|---|")
    for label, kind, v, m in s.runs():
        if not schedule_of(kind).split_backward:
            continue
        g = zero_bubble_gain(s, res, label, kind, v, m)
        report.emit(f"| {label} | {m} | {g.paper:.4f} | {g.simulated_ideal:.4f} | {g.simulated_nccl:.4f} "
                    f"| {g.simulated_calibrated:.4f} | {g.measured:.4f} | {g.share:.1%} | {g.measured_best:.4f} "
                    f"| {g.share_best:.1%} |")


def _torch_row(pair: TorchPair, res: MlplatResult) -> str:
    name = f"{pair.label} ({pair.cls_name})"
    if pair.ranks is None:
        return f"| {name} | {pair.m} | - | - | - | - | - | - | - | hung/failed: {pair.error} |"
    a, b = pair.mlplat, pair.torch
    d = res.durations(pair.key)
    mine = "-" if d is None else f"{_median(d['B']) * 1e3:.1f} / {_median(d['W']) * 1e3:.1f}"
    if d is not None and not schedule_of(pair.kind).split_backward:
        mine += " (one B)"
    return (f"| {name} | {pair.m} | {a:.3f} | {b:.3f} | {a / b:.3f} | {b / a:.3f} "
            f"| {pair.action(True, 'B')} / {pair.action(True, 'W')} "
            f"| {pair.action(False, 'B')} / {pair.action(False, 'W')} | {mine} | ok |")


def print_torch_table(report: Report, res: MlplatResult, pairs: Iterable[TorchPair]) -> list[TorchPair]:
    """mlplat against torch.distributed.pipelining, a row as each pair comes in; returns the pairs."""
    report.emit()
    report.emit("Against torch.distributed.pipelining (torch " + torch.__version__ + "), each pair in its own process "
                "group, ABAB rounds; mlplat / torch <= 1 means mlplat is no slower. torch's time per action "
                "(medians, ms): B = `backward_one_chunk` (the input gradient alone in its zero-bubble schedules, "
                "else the whole backward), W = `backward_weight_one_chunk`; its first stage leaves the whole "
                "backward to W. mlplat's B and W computes are the sleeps themselves (medians, ms):")
    report.emit()
    report.emit("| schedule | m | mlplat (s) | torch (s) | mlplat / torch | torch / mlplat "
                "| torch B / W, first stage (ms) | torch B / W, other stages (ms) | mlplat B / W (ms) | status |")
    report.emit("|---|---|---|---|---|---|---|---|---|---|")
    done = []
    for pair in pairs:
        report.emit(_torch_row(pair, res))
        done.append(pair)
    return done


def print_summary_table(report: Report, s: Setup, res: MlplatResult, ratios: dict[RunKey, float]) -> None:
    """The zero-bubble rows in short: measured, simulated, share of the simulated gain, mlplat / torch."""
    report.emit()
    report.emit("Zero bubble in short (issue #16's aim: at least 90% of the simulated gain over 1F1B, no slower than "
                "torch.distributed.pipelining). simulated = simulate_nccl, nominal costs, measured transfer; share as "
                "above; mlplat / torch from the pair groups:")
    report.emit()
    report.emit("| schedule | m | measured (s) | simulated (s) | speed-up over 1f1b: measured / simulated "
                "| share of the simulated gain | share, best steps | mlplat / torch (peer) |")
    report.emit("|---|---|---|---|---|---|---|---|")
    for m in s.all_m():
        base_sim = nominal_step(s, "1f1b", 1, m, res.transfer, nccl=True)
        for label, kind, v in ZB_COMPARISON:
            key = (label, m)
            ratio = f"{ratios[key]:.3f} ({TORCH_PEERS[label]})" if key in ratios else "-"
            if label == "1f1b":
                report.emit(f"| {label} | {m} | {res.step(key):.3f} | {base_sim:.3f} | - | - | - | {ratio} |")
                continue
            g = zero_bubble_gain(s, res, label, kind, v, m)
            report.emit(f"| {label} | {m} | {res.step(key):.3f} | {g.simulated_step:.3f} "
                        f"| {res.step(('1f1b', m)) / res.step(key):.4f} / {base_sim / g.simulated_step:.4f} "
                        f"| {g.share:.1%} | {g.share_best:.1%} | {ratio} |")


def print_footer(report: Report, started: float, load0: float) -> None:
    report.emit()
    report.emit(f"Total benchmark wall time: {time.perf_counter() - started:.0f} s. Load average (1 min) of the "
                f"machine at the start / end: {load0:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.")


def write_results(path: str, command: str, lines: list[str]) -> None:
    header = [
        "# Pipeline engine benchmark: measured vs simulated vs torch.distributed.pipelining",
        "",
        "Written by `" + command + "` on " + time.strftime("%Y-%m-%d %H:%M") + ". "
        "See README.md in this folder for what is measured and how to read it.",
        "",
    ]
    Path(path).write_text("\n".join(header + lines) + "\n" + NOTES)


def main(argv: list[str] | None = None) -> int:
    opts = parse_options(argv)
    s = opts.setup
    started, load0 = time.perf_counter(), os.getloadavg()[0]
    report = Report()
    res = measure_mlplat(s)
    print_setup(report, s, res.transfer)
    print_step_table(report, s, res)
    print_interleaved_table(report, s, res)
    print_zero_bubble_table(report, s, res)
    pairs = []
    if not opts.no_torch:
        pairs = print_torch_table(report, res, (measure_torch_pair(s, *spec) for spec in opts.torch_pairs()))
    print_summary_table(report, s, res, vs_torch(pairs))
    print_footer(report, started, load0)
    if opts.out:
        write_results(opts.out, opts.command, report.lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
