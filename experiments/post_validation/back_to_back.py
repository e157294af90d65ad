"""Training steps back to back: the real training step (`TrainStep.run`) synchronous and post-validated, on model
chunks whose computes take a fixed time, p = 4, against 1F1B.

    python experiments/post_validation/back_to_back.py        # ~5 minutes on 2 cores; writes back_to_back.md here
    python experiments/post_validation/back_to_back.py --steps 5 --rounds 1 --out /tmp/b.md

What runs. 4 gloo processes each run K training steps of a tiny GPT (8 layers of hidden 32) through
`TrainStep.run`, as Lightning's `training_step` does: the pipeline pass, the gradient reductions, the checks (the global
gradient norm, the loss), AdamW and the learning-rate schedule; with optim.post_validate=false (every step waits for
the all-reduces before its optimizer step) and =true (the checks are read after the next step's pass). Nothing
clips (optim.grad_clip=100), so every post-validated step stands. To let the pipeline's timing show on 2 cores, each
chunk's compute is made to take a fixed time, as a GPU kernel queue would: a forward sleeps until it has taken
tf/v, a backward pass until tb/v (B alone where the backward is split, B + W otherwise), a W until tw/v, with
F = B = W = tf (pipeline_bench's stages, tf = 50 ms per stage), each after its own (tiny) arithmetic. The rest of
the step (reductions, checks, the optimizer) runs at its real CPU cost.

Figures per run (median over rounds, the runs taking turns): the period, the latest end of step K minus the latest
end of step 2 over K - 2 (each rank stamps its step ends on the machine's one monotonic clock); the speed-up over
1F1B (synchronous) and the bound (m + p - 1)/m; and the engine's own back-to-back period from the simulator
(`steady_state_step`, NCCL transport) at the nominal costs.

The model ties its output layer to the word embedding (GPT's default), whose two copies' gradients are summed
between the first and the last pipeline stage at every step's end (Megatron's embedding group): under ZB-H2 that
all-reduce makes the first rank wait for the last one, as the checks did, so ZB-H2 also runs with an untied output
layer (Llama's default). ZB-V keeps both copies on rank 0.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.autograd import Variable  # noqa: E402

from mlplat.config import load_config  # noqa: E402
from mlplat.harness.launch import launch  # noqa: E402
from mlplat.parallel.grid import ParallelGrid  # noqa: E402
from mlplat.parallel.layout.registry import get as schedule_of  # noqa: E402
from mlplat.parallel.layout.schedules import build_schedule  # noqa: E402
from mlplat.perf.simulator import CostModel, simulate, simulate_nccl, steady_state_step  # noqa: E402
from mlplat.step import TrainStep  # noqa: E402

COMMAND = "python experiments/post_validation/back_to_back.py"
P = 4
# (label, schedule, v, tied word embedding and output layer)
RUNS = (("1f1b", "1f1b", 1, True), ("zb_h2", "zb_h2", 1, True), ("zb_h2, untied output layer", "zb_h2", 1, False),
        ("zbv", "zbv", 2, True))


def _config(kind: str, v: int, m: int, post_validate: bool, tied: bool = True):
    raw = {"model": dict(n_layers=8, hidden=32, n_heads=4, seq_len=16, vocab_size=256, dropout=0.0,
                         tie_embeddings=tied),
           "parallel": dict(tp=1, pp=P, vpp=v, dp=1, schedule=kind, micro_batch_size=2, global_batch_size=2 * m),
           "kernels": dict(attention="math", recompute="none", fused=False),
           "optim": dict(lr=1e-3, grad_clip=100.0, warmup_steps=1, post_validate=post_validate),
           "trainer": dict(max_steps=1000, precision="32-true"), "logger": dict(name="none"), "seed": 1}
    return load_config(raw, world_size=P, check_data=False)


class _Timed(torch.autograd.Function):
    """Identity at a chunk's output: its backward is the chunk's first backward op. The pass then sleeps, once
    autograd has run its last node, until it has taken `seconds`."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        start, seconds = time.perf_counter(), ctx.seconds
        Variable._execution_engine.queue_callback(lambda: _sleep_until(start + seconds))
        return grad, None


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _fixed_times(module: TrainStep, tf: float, tb: float, tw: float) -> None:
    """Every chunk's forward takes tf, its backward pass tb, its W tw (seconds, wall time)."""
    split = module.engine.layout.spec.split_backward
    for c, chunk in module.engine.chunks.items():
        def pre(mod, args):
            mod._started = time.perf_counter()

        def post(mod, args, out, backward=tb if split else tb + tw):
            out = _Timed.apply(out, backward)
            _sleep_until(mod._started + tf)
            return out
        chunk.register_forward_pre_hook(pre)
        chunk.register_forward_hook(post)
        if split:
            store = module.engine.stores[c]

            def run(key, _run=store.run):
                start = time.perf_counter()
                _run(key)
                _sleep_until(start + tw)
            store.run = run


def _group(rank: int, world: int, tf: float, m: int, steps: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    grid = ParallelGrid(tp=1, pp=P, dp=1)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (steps, 2 * m, 17), generator=gen)
    batches = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]
    runs = {}
    for label, kind, v, tied in RUNS:
        for post in (False, True):
            module = TrainStep(_config(kind, v, m, post, tied), grid)
            _fixed_times(module, tf / v, tf / v, tf / v)
            runs[(label, post)] = module
    keys = list(runs)
    out = {key: [] for key in keys}
    for rnd in range(1 + rounds):  # round 0 warms up
        for key in keys[rnd % len(keys):] + keys[: rnd % len(keys)]:
            module = runs[key]
            dist.barrier()
            ends = []
            for batch in batches:
                module.run(batch)
                ends.append(time.perf_counter())
            module.settle()
            every = [torch.empty(steps, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, torch.tensor(ends, dtype=torch.float64))
            if rnd > 0:
                latest = [max(float(t[k]) for t in every) for k in range(steps)]
                out[key].append((latest[-1] - latest[1]) / (steps - 2))
    return out


def _simulated(kind: str, v: int, m: int, tf: float) -> tuple[float, float]:
    """(one step, back to back under NCCL's rules) at the nominal costs."""
    split = schedule_of(kind).split_backward
    f = tf / v
    cost = CostModel(forward=lambda r, c, mb: f, backward=lambda r, c, mb: f if split else 2 * f,
                     weight=lambda r, c, mb: f)
    sched = build_schedule(kind, P, v, m)
    return simulate(sched, cost, v).step_time, steady_state_step(sched, cost, v, simulate_nccl)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tf", type=float, default=0.05, help="forward seconds per pipeline stage per micro-batch")
    ap.add_argument("--m", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=6, help="training steps per timed run (K)")
    ap.add_argument("--rounds", type=int, default=3, help="timed runs per setting (after one warm-up)")
    ap.add_argument("--out", default=str(HERE / "back_to_back.md"), help="markdown file to write ('' = none)")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    t0 = time.time()
    work = 3 * args.m * args.tf
    budget = 300 + 12 * (1 + args.rounds) * args.steps * (args.m + P) * 3 * args.tf
    res = launch(_group, P, args.tf, args.m, args.steps, args.rounds, timeout=budget)[0]
    med = statistics.median
    base = med(res[("1f1b", False)])
    bound = (args.m + P - 1) / args.m
    lines = [
        "# Training steps back to back: synchronous and post-validated",
        "",
        f"Written by `{' '.join([COMMAND, *(argv if argv is not None else sys.argv[1:])]).strip()}` on "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M} in {time.time() - t0:.0f} s (1-minute load {load:.1f} at the "
        f"start). p={P}, m={args.m}, F = B = W = tf/v per chunk, tf={args.tf * 1e3:.0f} ms per stage; gloo, {P} "
        f"processes; the period of steps 2 to {args.steps}, median of {args.rounds} runs. See the docstring of "
        "back_to_back.py.",
        "",
        "| schedule | work per rank (s) | simulated: one step / back to back (s) | synchronous: period (s) | "
        "post-validated: period (s) | post / sync | speed-up over synchronous 1F1B: sync / post | bound "
        "(m+p-1)/m | share of the bound's gain, post-validated |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, kind, v, _ in RUNS:
        one, steady = _simulated(kind, v, args.m, args.tf)
        sync, post = med(res[(label, False)]), med(res[(label, True)])
        lines.append(f"| {label} | {work:.3f} | {one:.3f} / {steady:.3f} | {sync:.3f} | {post:.3f} | "
                     f"{post / sync:.3f} | {base / sync:.4f} / {base / post:.4f} | {bound:.4f} | "
                     + (f"{(base / post - 1) / (bound - 1):.1%} |" if label != "1f1b" else "- |"))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
