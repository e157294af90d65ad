"""The real pipeline engine on real processes, timed against the simulator and against torch.distributed.pipelining.

    python experiments/pipeline_bench/bench.py            # ~3 minutes on 2 cores; writes results.md here
    python experiments/pipeline_bench/bench.py --tf 0.1 --repeats 7 --torch-v4 --out /tmp/r.md

What runs. p=4 gloo CPU processes execute `PipelineEngine` (mlplat/parallel/pipeline/engine.py) with the
instruction lists of `build_schedule(kind, p, v, m)`, m=8. The model chunks are "sleep stages": a chunk's forward
takes tf/v and its backward tb/v = 2·tf/v of wall time, its own small tensor and autograd work included (it
sleeps until the deadline), on a real [micro_batch, seq, hidden] float32 activation, so the point-to-point
traffic is real but the compute has a fixed duration that does not depend on how many cores the machine has or
how loaded it is (sleeping ranks leave the CPUs free). What the engine does around the computes (posting its
sends and receives, waiting for them, bookkeeping) is not hidden. Every rank does the same work m·(tf+tb) for any
v, so step times compare directly.

Figures (medians over --repeats timed steps after one warm-up; the schedules take turns round by round):
  * measured step time = latest end - earliest start over the ranks (one system-wide monotonic clock);
  * the simulator's prediction for the same instruction lists, with two transports:
    `mlplat.perf.simulator.simulate` (ideal transport: sends never block, each RECV waits for its message) and
    `simulate_nccl` (what the engine posts: the plans of `exchange_plans`, timed under NCCL's rules - one
    communicator per direction, a transfer starts once both sides are posted, each runs in posting order). Each with
    the nominal costs and no transfer time ("ideal"; both transports agree there), with the measured one-way
    transfer time of one activation ("+transfer"), and "calibrated": the measured compute durations plus each
    rank's measured overhead per compute (its span minus its computes minus its time blocked in
    `PostedGroup.wait`, per compute). The headline calibrated figure is simulate_nccl's. Per rank also the time
    spent posting groups and the time blocked in `PostedGroup.wait`, first on the receives, then on the sends;
  * interleaved vs 1F1B speed-up, the theoretical one (1+(p-1)/m)/(1+(p-1)/(v·m)) and the fraction achieved,
    (measured - 1)/(theoretical - 1);
  * torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B on the same sleep
    stages, each in its own spawned process group together with the matching mlplat schedule (ABAB rounds in
    that group, so the ratio is measured under the same conditions). A peer that hangs or fails is reported,
    not waited for: its group is killed after a timeout, and its collectives time out on their own first.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from mlplat.parallel.grid import ParallelGrid  # noqa: E402
from mlplat.parallel.pipeline.engine import PipelineEngine  # noqa: E402
from mlplat.parallel.pipeline.exchange import RECV_OPS  # noqa: E402
from mlplat.parallel.pipeline.p2p import PostedGroup, StageComm  # noqa: E402
from mlplat.parallel.pipeline.schedules import build_schedule, chunks_of_rank  # noqa: E402
from mlplat.perf.simulator import CostModel, simulate, simulate_nccl  # noqa: E402
from tests.helpers.dist import run_distributed  # noqa: E402

# (label, schedule kind, v)
MLPLAT_RUNS = [("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1), ("interleaved v=2", "interleaved", 2),
               ("interleaved v=4", "interleaved", 4)]
TORCH_RUNS = [("gpipe", "ScheduleGPipe", "gpipe", 1), ("1f1b", "Schedule1F1B", "1f1b", 1),
              ("interleaved v=2", "ScheduleInterleaved1F1B", "interleaved", 2)]


@dataclass
class Setup:
    p: int = 4
    m: int = 8
    tf: float = 0.05  # forward time of one pipeline STAGE per micro-batch (a rank's chunks share it: tf/v each)
    tb_ratio: float = 2.0
    micro_batch: int = 2
    seq: int = 64
    hidden: int = 256  # activation [2, 64, 256] float32 = 128 KiB per message
    repeats: int = 5
    op_timeout_s: float = 30.0

    @property
    def tb(self) -> float:
        return self.tf * self.tb_ratio


# ------------------------------------------------------------------------------------------ sleep stages

_DURATIONS: dict[str, list[float]] = {"F": [], "B": []}  # per process: how long each stage compute took


def _sleep_until(kind: str, start: float, seconds: float) -> None:
    """Sleep until `seconds` after `start` (at once if that is past); record how long the compute took."""
    left = start + seconds - time.perf_counter()
    if left > 0:
        time.sleep(left)
    _DURATIONS[kind].append(time.perf_counter() - start)


class _BackwardClock:
    __slots__ = ("start",)

    def __init__(self):
        self.start = 0.0


class _EndOfForward(torch.autograd.Function):
    """Identity, the chunk's last forward op: sleeps until the forward has taken `tf`. Its backward is the
    chunk's first backward op: it notes when the chunk's backward began."""

    @staticmethod
    def forward(ctx, x, start, tf, clock):
        ctx.clock = clock
        _sleep_until("F", start, tf)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.start = time.perf_counter()
        return grad, None, None, None


class _StartOfBackward(torch.autograd.Function):
    """Identity whose backward is the chunk's last real backward op: it sleeps until the backward has taken `tb`."""

    @staticmethod
    def forward(ctx, x, tb, clock):
        ctx.tb, ctx.clock = tb, clock
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _sleep_until("B", ctx.clock.start, ctx.tb)
        return grad, None, None


class SleepStage(nn.Module):
    """A model chunk whose forward takes `tf` and whose backward takes `tb` seconds of wall time, its own tensor
    and autograd work included (sleep until a deadline): like a GPU kernel queue, the chunk's compute has a fixed
    duration that the CPU work of issuing it hides in, while everything the engine does around it (sends,
    receives, waits, bookkeeping) stays exposed. With `with_loss`, forward(x, labels) returns the MSE loss
    (mlplat's last chunk); otherwise the activation (torch.distributed.pipelining applies its loss_fn itself)."""

    def __init__(self, hidden: int, tf: float, tb: float, with_loss: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.tf, self.tb, self.with_loss = tf, tb, with_loss

    def forward(self, x, labels=None):
        start, clock = time.perf_counter(), _BackwardClock()
        y = _StartOfBackward.apply(x * self.weight, self.tb, clock)
        if self.with_loss:
            y = _mse(y, labels)
        return _EndOfForward.apply(y, start, self.tf, clock)


def _mse(output, target):
    return ((output - target) ** 2).mean()


def _data(s: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(s.m * s.micro_batch, s.seq, s.hidden, generator=gen)
    return x, torch.zeros_like(x)


class _TimedGroup(PostedGroup):
    """Posted operations whose wait() adds the time it blocks to its comm's `waited`, split into the time
    until the group's receives have completed and the time after that until its sends have (the group's own
    wait() then waits for the sends)."""

    def __init__(self, group: PostedGroup, is_recv: list[bool]):
        super().__init__(group.works, group.recvs, group.sends, group.comm)
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
    the sends) and the time it spends posting them."""

    waited_recv = waited_send = posting = 0.0

    @property
    def waited(self) -> float:
        return self.waited_recv + self.waited_send

    def post(self, messages, payload) -> PostedGroup:
        t0 = time.perf_counter()
        group = super().post(messages, payload)
        self.posting += time.perf_counter() - t0
        return _TimedGroup(group, [ins.op in RECV_OPS for ins in messages])


def _mlplat_engine(s: Setup, grid: ParallelGrid, kind: str, v: int) -> PipelineEngine:
    n = s.p * v
    chunks = {c: SleepStage(s.hidden, s.tf / v, s.tb / v, with_loss=c == n - 1)
              for c in chunks_of_rank(s.p, v, grid.pp_rank)}
    comm = _TimedComm(grid, (s.micro_batch, s.seq, s.hidden), torch.float32, torch.device("cpu"),
                      scatter_gather=False)
    return PipelineEngine(chunks, grid, kind, v, comm)


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


def _mlplat_steps(engine: PipelineEngine, x: torch.Tensor, y: torch.Tensor, s: Setup):
    mbs = list(zip(x.split(s.micro_batch), y.split(s.micro_batch)))

    def step():
        engine.run(mbs)
        for chunk in engine.chunks.values():
            chunk.weight.grad = None
    return step


def _group_mlplat(rank: int, world: int, s: Setup) -> dict:
    """Every mlplat schedule in one process group, round-robin with a rotating order.

    Besides the step times, each rank measures per step its own span (its start to its end), the time it was
    blocked in `PostedGroup.wait` and the time its computes took; (span - blocked - computes) / number of
    computes is this rank's overhead per compute: what the engine does around the computes (posting the
    sends and receives, bookkeeping, being descheduled on a busy machine). The calibrated simulations charge it to
    every compute. The time spent posting (the isend/irecv calls) is also reported on its own."""
    s = Setup(**s) if isinstance(s, dict) else s
    grid = ParallelGrid(tp=1, pp=s.p, dp=1)
    x, y = _data(s)
    transfer = _one_way_transfer(s, rank)
    engines = {label: _mlplat_engine(s, grid, kind, v) for label, kind, v in MLPLAT_RUNS}
    steps = {label: _mlplat_steps(e, x, y, s) for label, e in engines.items()}
    labels = [r[0] for r in MLPLAT_RUNS]
    times: dict[str, list[float]] = {label: [] for label in labels}
    durations: dict[str, dict[str, list[float]]] = {label: {"F": [], "B": []} for label in labels}
    overhead: dict[str, list[float]] = {label: [] for label in labels}
    posting: dict[str, list[float]] = {label: [] for label in labels}
    blocked: dict[str, list[float]] = {label: [] for label in labels}
    blocked_send: dict[str, list[float]] = {label: [] for label in labels}
    for rnd in range(1 + s.repeats):
        order = labels[rnd % len(labels):] + labels[: rnd % len(labels)]
        for label in order:
            _DURATIONS["F"].clear()
            _DURATIONS["B"].clear()
            comm = engines[label].comm
            comm.waited_recv = comm.waited_send = comm.posting = 0.0
            t, t0, t1 = _timed(steps[label])
            if rnd == 0:
                continue
            times[label].append(t)
            durations[label]["F"] += _DURATIONS["F"]
            durations[label]["B"] += _DURATIONS["B"]
            computing = sum(_DURATIONS["F"]) + sum(_DURATIONS["B"])
            n_compute = len(_DURATIONS["F"]) + len(_DURATIONS["B"])
            overhead[label].append((t1 - t0 - comm.waited - computing) / n_compute)
            posting[label].append(comm.posting / n_compute)
            blocked[label].append(comm.waited_recv)
            blocked_send[label].append(comm.waited_send)
    med = statistics.median
    return {"times": times, "transfer": transfer, "durations": durations,
            "overhead": {k: med(v) for k, v in overhead.items()},
            "posting": {k: med(v) for k, v in posting.items()},
            "blocked": {k: med(v) for k, v in blocked.items()},
            "blocked_send": {k: med(v) for k, v in blocked_send.items()}}


def _torch_schedule(s: Setup, rank: int, cls_name: str, v: int, group):
    from torch.distributed import pipelining as pp

    n = s.p * v
    stages = [pp.PipelineStage(SleepStage(s.hidden, s.tf / v, s.tb / v), c, n, torch.device("cpu"), group=group)
              for c in chunks_of_rank(s.p, v, rank)]
    cls = getattr(pp, cls_name)
    sched = cls(stages if cls_name == "ScheduleInterleaved1F1B" else stages[0], n_microbatches=s.m, loss_fn=_mse)
    x, y = _data(s)
    first, last = rank == 0, rank == (n - 1) % s.p

    def step():
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": []} if last else {}
        sched.step(*args, **kwargs)
        for st in stages:
            st.submod.weight.grad = None
    return step


def _group_vs_torch(rank: int, world: int, s: Setup, cls_name: str, kind: str, v: int) -> dict:
    """mlplat's `kind` and torch's `cls_name` in one group, ABAB... (the first of each is a warm-up)."""
    s = Setup(**s) if isinstance(s, dict) else s
    grid = ParallelGrid(tp=1, pp=s.p, dp=1)
    x, y = _data(s)
    mine = _mlplat_steps(_mlplat_engine(s, grid, kind, v), x, y, s)
    # torch's own group with a short timeout, so that a hang in its p2p turns into an error on its own.
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=s.op_timeout_s))
    theirs = _torch_schedule(s, rank, cls_name, v, group)
    times = {"mlplat": [], "torch": []}
    for rnd in range(1 + s.repeats):
        pair = [("mlplat", mine), ("torch", theirs)]
        if rnd % 2:
            pair.reverse()
        for name, step in pair:
            t = _timed(step)[0]
            if rnd > 0:
                times[name].append(t)
    return times


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
  send-only groups waited for at the end of the step.
* **torch.distributed.pipelining** runs its own schedules on the same sleep stages, with its own p2p
  (batch_isend_irecv on gloo), in a group of its own with a 30 s collective timeout and an overall timeout,
  so a hang is reported instead of stopping the benchmark. Both sides are timed the same way in the same group.
  Its posting differs from mlplat's: Schedule1F1B batches a forward's send with the next backward's receive
  (and a backward's send with the next forward's receive) and waits for the whole batch, while mlplat waits for
  its sends only at the end of the step; ScheduleGPipe waits for its sends only after all forwards (all backwards), and ScheduleInterleaved1F1B (a
  `_PipelineScheduleRuntime`) posts each receive as its own batch as early as its lowering allows (by
  default) and waits for its sends only at the end of the step. On gloo those two never block on a send
  mid-step.
* CPU timings on a shared machine are noisy: the step time ranges are listed, all figures are medians, and the
  schedules take turns within each group so slow phases of the machine hit all of them.
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tf", type=float, default=0.05, help="forward seconds per pipeline stage per micro-batch")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per schedule (after one warm-up)")
    ap.add_argument("--torch-v4", action="store_true", help="also run torch's ScheduleInterleaved1F1B at v=4")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    ap.add_argument("--out", default=str(HERE / "results.md"), help="markdown file to write ('' = none)")
    args = ap.parse_args(argv)
    s = Setup(tf=args.tf, repeats=args.repeats)
    sd = asdict(s)
    started = time.perf_counter()
    load0 = os.getloadavg()[0]
    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    per_round = len(MLPLAT_RUNS) * (s.m + s.p - 1) * (s.tf + s.tb)
    group_timeout = 120 + 3 * (1 + s.repeats) * per_round
    res_all = run_distributed(_group_mlplat, s.p, sd, timeout=group_timeout)
    res = res_all[0]
    transfer = res["transfer"]

    def overheads(label: str) -> list[float]:
        return [r["overhead"][label] for r in res_all]

    def timed(kind: str, v: int, cost: CostModel, nccl: bool) -> float:
        sim = simulate_nccl if nccl else simulate
        out = sim(build_schedule(kind, s.p, v, s.m), cost, v)
        if out.deadlock:
            raise RuntimeError(f"{sim.__name__} finds {kind} v={v} deadlocked: {out.report or out.stuck}")
        return out.step_time

    def calibrated(label: str, kind: str, v: int, nccl: bool = True) -> float:
        d, o = res["durations"][label], overheads(label)
        f, b = _median(d["F"]), _median(d["B"])
        cost = CostModel(lambda r, c, mb: f + o[r], lambda r, c, mb: b + o[r], transfer)
        return timed(kind, v, cost, nccl)

    def nominal(kind: str, v: int, with_transfer: bool, nccl: bool = False) -> float:
        return timed(kind, v, CostModel(s.tf / v, s.tb / v, transfer if with_transfer else 0.0), nccl)

    def per_rank(key: str, label: str, scale: float = 1e3) -> str:
        return " / ".join(f"{r[key][label] * scale:.1f}" for r in res_all)

    def blocked(label: str) -> str:
        return " / ".join(f"{r['blocked'][label] * 1e3:.0f}+{r['blocked_send'][label] * 1e3:.0f}" for r in res_all)

    emit(f"p={s.p}, m={s.m}, stage forward tf={s.tf * 1e3:.0f} ms, backward tb={s.tb * 1e3:.0f} ms "
         f"(each of a rank's v chunks: tf/v, tb/v); activation {s.micro_batch}x{s.seq}x{s.hidden} float32 "
         f"= {s.micro_batch * s.seq * s.hidden * 4 // 1024} KiB; gloo, {s.p} processes on {os.cpu_count()} cores; "
         f"medians of {s.repeats} steps; measured one-way transfer {transfer * 1e3:.2f} ms.")
    emit()
    emit("Simulated on the instruction lists the engine runs, with two transports: `simulate` (ideal: sends never "
         "block) and `simulate_nccl` (the engine's exchange plans under NCCL's rules: one communicator per "
         "direction, a transfer starts once its send and its receive are posted, each runs in posting order). ideal = nominal tf/v, tb/v, "
         "no transfer time (both transports agree); +transfer = nominal costs and the measured one-way transfer; "
         "calibrated = the measured compute durations plus each rank's measured overhead per compute, and the "
         "measured transfer. measured / calibrated uses simulate_nccl, which times what the engine posts.")
    emit()
    emit("| schedule | simulated: ideal (s) | +transfer, ideal transport (s) | +transfer, NCCL (s) "
         "| calibrated, ideal transport (s) | calibrated, NCCL (s) | mlplat measured (s) | measured / ideal "
         "| measured / calibrated (NCCL) | overhead per compute, ranks 0-3 (ms) | of which posting, ranks 0-3 (ms) "
         "| blocked per step on receives + then on sends, ranks 0-3 (ms) | bubble: paper | bubble: measured "
         "| range of steps (s) |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    measured: dict[str, float] = {}
    for label, kind, v in MLPLAT_RUNS:
        ideal = nominal(kind, v, False)
        tr_ideal, tr_nccl = nominal(kind, v, True), nominal(kind, v, True, nccl=True)
        cal_ideal, cal = calibrated(label, kind, v, nccl=False), calibrated(label, kind, v)
        t = _median(res["times"][label])
        measured[label] = t
        work = s.m * (s.tf + s.tb)
        paper_bubble = (s.p - 1) / (v * s.m)
        emit(f"| {label} | {ideal:.3f} | {tr_ideal:.3f} | {tr_nccl:.3f} | {cal_ideal:.3f} | {cal:.3f} | {t:.3f} "
             f"| {t / ideal:.3f} | {t / cal:.3f} | {per_rank('overhead', label)} | {per_rank('posting', label)} "
             f"| {blocked(label)} | {paper_bubble:.3f} | {(t - work) / work:.3f} "
             f"| {min(res['times'][label]):.3f}-{max(res['times'][label]):.3f} |")
    emit()
    emit("Interleaved vs 1F1B, same total work per rank; speed-up = 1F1B step / interleaved step; theoretical = "
         "(1 + (p-1)/m) / (1 + (p-1)/(v·m)); fraction achieved = (measured - 1) / (theoretical - 1):")
    emit()
    emit("| interleaved run | vs | theoretical speed-up | simulated: +transfer, ideal transport "
         "| simulated: +transfer, NCCL | simulated: calibrated, NCCL | measured speed-up "
         "| fraction of theoretical achieved |")
    emit("|---|---|---|---|---|---|---|---|")
    base = "1f1b"
    for label, kind, v in MLPLAT_RUNS:
        if kind != "interleaved":
            continue
        theo = _theoretical_speedup(s.p, s.m, v)
        sim_t = nominal("1f1b", 1, True) / nominal(kind, v, True)
        sim_n = nominal("1f1b", 1, True, nccl=True) / nominal(kind, v, True, nccl=True)
        sim_c = calibrated(base, "1f1b", 1) / calibrated(label, kind, v)
        got = measured[base] / measured[label]
        emit(f"| {label} | {base} | {theo:.4f} | {sim_t:.4f} | {sim_n:.4f} | {sim_c:.4f} | {got:.4f} "
             f"| {(got - 1) / (theo - 1):.1%} |")

    if not args.no_torch:
        emit()
        emit("Against torch.distributed.pipelining (torch " + torch.__version__ + "), each pair in its own process "
             "group, ABAB rounds; mlplat / torch <= 1 means mlplat is no slower:")
        emit()
        emit("| schedule | mlplat (s) | torch (s) | mlplat / torch | torch / mlplat | status |")
        emit("|---|---|---|---|---|---|")
        runs = list(TORCH_RUNS)
        if args.torch_v4:
            runs.append(("interleaved v=4", "ScheduleInterleaved1F1B", "interleaved", 4))
        for label, cls_name, kind, v in runs:
            expected = 2 * (1 + s.repeats) * (s.m + s.p - 1) * (s.tf + s.tb)
            try:
                out = run_distributed(_group_vs_torch, s.p, sd, cls_name, kind, v, timeout=90 + 3 * expected)[0]
            except BaseException as err:  # noqa: BLE001 - a hanging or failing peer is a result, not a crash
                if isinstance(err, KeyboardInterrupt):
                    raise
                emit(f"| {label} ({cls_name}) | - | - | - | - | hung/failed: {_reason(err)} |")
                continue
            a, b = _median(out["mlplat"]), _median(out["torch"])
            emit(f"| {label} ({cls_name}) | {a:.3f} | {b:.3f} | {a / b:.3f} | {b / a:.3f} | ok |")

    emit()
    emit(f"Total benchmark wall time: {time.perf_counter() - started:.0f} s. Load average (1 min) of the machine "
         f"at the start / end: {load0:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.")
    if args.out:
        cmd = "python experiments/pipeline_bench/bench.py" + ("" if argv is None and len(sys.argv) == 1
                                                               else " " + " ".join(sys.argv[1:] if argv is None
                                                                                   else argv))
        header = [
            "# Pipeline engine benchmark: measured vs simulated vs torch.distributed.pipelining",
            "",
            "Written by `" + cmd.strip() + "` on " + time.strftime("%Y-%m-%d %H:%M") + ". "
            "See README.md in this folder for what is measured and how to read it.",
            "",
        ]
        Path(args.out).write_text("\n".join(header + lines) + "\n" + NOTES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
