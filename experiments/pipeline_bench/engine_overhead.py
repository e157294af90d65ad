"""The engine's own host time per compute, against a plain loop of the same computes.

    python experiments/pipeline_bench/engine_overhead.py      # ~1 minute; writes engine_overhead.md here

What a GPU run pays on its host for each instruction, apart from the kernels and the backend: in one process,
pipeline rank 1 of p = 4 runs its exchange plan through the real `PipelineEngine`, `StageComm` and `HangWatch`
(every step under its label, as training runs it), on chunks that are one tiny autograd op each, while the backend
is taken out: `torch.distributed.isend`/`irecv` return an already completed work at once. The peer is a plain loop
over the same F, B and W computes of the same chunks (a forward, a backward with a ready gradient, a W), with no
plan, no messages and no labels. The difference, per compute, is the engine's own work: posting and waiting for
messages through its plans, the per-step bookkeeping, the hang watch. The chunks' autograd work is in both.

Timings are the fastest of `--rounds` runs of `--reps` steps each (other work on the machine only ever adds time),
the two loops taking turns. bench.py's "overhead per compute" is another figure: it is measured on 4 processes on
gloo after 12.5-50 ms sleeps, where it also holds gloo's own posting and the cost of running code on a CPU that has
just been idle (both far larger than the engine's own work on this machine). The last column shows the latter: the
plain loop again, with a `--sleep-ms` sleep before each compute (the sleep itself not counted), as bench.py's
stages run.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from mlplat.parallel.grid import ParallelGrid  # noqa: E402
from mlplat.parallel.hang import HangWatch  # noqa: E402
from mlplat.parallel.layout.exchange import Compute  # noqa: E402
from mlplat.parallel.layout.pipeline import PipelineLayout  # noqa: E402
from mlplat.parallel.layout.schedules import COMPUTE_OPS, Op  # noqa: E402
from mlplat.parallel.pipeline.engine import PipelineEngine  # noqa: E402
from mlplat.parallel.pipeline.p2p import StageComm  # noqa: E402

COMMAND = "python experiments/pipeline_bench/engine_overhead.py"
RUNS = (("1f1b", "1f1b", 1), ("interleaved v=4", "interleaved", 4), ("zb_h1", "zb_h1", 1), ("zbv", "zbv", 2))
SHAPE = (1, 4, 8)  # [micro-batch, seq, hidden]: the chunks' arithmetic is negligible


class TinyChunk(nn.Module):
    """One multiply by a weight (the last chunk: and a sum as its loss); its output is freed once sent, as
    DecoderChunk's is."""

    frees_sent_output = True

    def __init__(self, last: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(SHAPE[-1]))
        self.last = last
        self.wgrad_store = None  # the zero-bubble schedules' W: the weight's gradient is deferred (below)

    def forward(self, x, labels=None):
        y = _Deferred.apply(x, self.weight, self)
        return y.sum() if self.last else y


class _Deferred(torch.autograd.Function):
    """x * weight, whose weight gradient goes to the chunk's WeightGradStore during a zero-bubble B."""

    @staticmethod
    def forward(ctx, x, weight, chunk):
        ctx.save_for_backward(x, weight)
        ctx.chunk = chunk
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        store = ctx.chunk.wgrad_store
        wgrad = (grad * x).sum((0, 1))
        if store is not None and store.key is not None:
            store.defer(lambda: weight.grad.add_(wgrad) if weight.grad is not None else setattr(weight, "grad", wgrad))
            wgrad = None
        return grad * weight, wgrad, None


class _Completed:
    """A transfer that has already happened: the backend taken out."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _without_backend() -> None:
    done = _Completed()
    dist.isend = lambda *args, **kwargs: done
    dist.irecv = lambda *args, **kwargs: done


def _engine(kind: str, v: int, rank: int, p: int) -> PipelineEngine:
    layout = PipelineLayout(p, v, kind)
    grid = ParallelGrid(1, p, 1, rank=rank, virtual=True)
    grid._p2p_groups = {ch: None for ch in ParallelGrid.p2p_channels(p)}  # the channels, with no backend behind
    chunks = {c: TinyChunk(c == layout.last_chunk) for c in layout.chunks_of(rank)}
    comm = StageComm(grid, SHAPE, torch.float32, torch.device("cpu"))
    return PipelineEngine(chunks, grid, layout, comm, watch=HangWatch(grid, 600.0))


def _micro_batches(m: int) -> list:
    return [(torch.zeros(SHAPE), torch.zeros(SHAPE)) for _ in range(m)]


def _fastest(fn, reps: int, slept: float = 0.0) -> float:
    """The fastest of `reps` calls (after one warm-up), less `slept` seconds of sleeps in each."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0 - slept)
    return best


def engine_step(kind: str, v: int, m: int, rank: int, p: int):
    """(one step of the engine, number of computes)."""
    engine = _engine(kind, v, rank, p)
    mbs = _micro_batches(m)
    computes = sum(isinstance(s, Compute) for s in engine.plan(m))
    return (lambda: engine.run(mbs)), computes


def plain_loop(kind: str, v: int, m: int, rank: int, p: int, sleep_s: float = 0.0):
    """(the same computes in a plain loop, number of computes); with sleep_s, each compute after a sleep, and the
    step's time without the sleeps."""
    engine = _engine(kind, v, rank, p)
    ops = [i for i in engine.schedule(m)[rank] if i.op in COMPUTE_OPS]
    mbs, grad = _micro_batches(m), torch.ones(SHAPE)
    chunks, stores, last = engine.chunks, engine.stores, engine.last_chunk

    def step():
        outputs = {}
        for ins in ops:
            if sleep_s:
                time.sleep(sleep_s)
            c, mb = ins.chunk, ins.micro_batch
            if ins.op is Op.FORWARD:
                x = mbs[mb][0] if c == 0 else torch.zeros(SHAPE).requires_grad_()
                outputs[(c, mb)] = chunks[c](x, mbs[mb][1]) if c == last else chunks[c](x)
            elif ins.op is Op.BACKWARD:
                if stores:
                    stores[c].key = (c, mb)
                torch.autograd.backward(outputs.pop((c, mb)), None if c == last else grad)
                if stores:
                    stores[c].key = None
            else:
                stores[c].run((c, mb))
    return step, len(ops)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=16, help="micro-batches per step")
    ap.add_argument("--rank", type=int, default=1, help="the pipeline rank whose plan runs (a middle one)")
    ap.add_argument("--reps", type=int, default=40, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, the two loops taking turns")
    ap.add_argument("--sleep-ms", type=float, default=25.0, help="the sleep before each compute of the last column")
    ap.add_argument("--out", default=str(HERE / "engine_overhead.md"), help="markdown file to write ('' = none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    _without_backend()
    p = 4
    t0 = time.time()
    rows = []
    for label, kind, v in RUNS:
        engine, n = engine_step(kind, v, args.m, args.rank, p)
        plain, n_plain = plain_loop(kind, v, args.m, args.rank, p)
        assert n == n_plain, (n, n_plain)
        sleep_s = args.sleep_ms / 1e3
        after_sleep, _ = plain_loop(kind, v, args.m, args.rank, p, sleep_s)
        a = b = float("inf")
        for _ in range(args.rounds):
            a = min(a, _fastest(engine, args.reps))
            b = min(b, _fastest(plain, args.reps))
        c = _fastest(after_sleep, 2, n * sleep_s)  # a few steps: each is n sleeps long
        rows.append((label, n, a / n * 1e6, b / n * 1e6, c / n * 1e6))
    lines = [
        "# The engine's own host time per compute",
        "",
        f"Written by `{' '.join([COMMAND, *(argv if argv is not None else sys.argv[1:])]).strip()}` on "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M} in {time.time() - t0:.0f} s (torch {torch.__version__}). "
        f"Pipeline rank {args.rank} of p={p}, m={args.m}, the backend taken out; fastest of {args.rounds} rounds of "
        f"{args.reps} steps. See the docstring of engine_overhead.py.",
        "",
        "| schedule | computes per step | engine (us per compute) | plain loop of the same computes (us) | "
        f"engine's own (us per compute) | engine / plain loop | plain loop, each compute after a {args.sleep_ms:g} ms "
        "sleep (us) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, n, a, b, c in rows:
        lines.append(f"| {label} | {n} | {a:.1f} | {b:.1f} | {a - b:.1f} | {a / b:.2f} | {c:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
