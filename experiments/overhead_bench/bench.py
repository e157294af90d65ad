"""What mlplat costs on top of plain PyTorch, and 3D step times on CPU processes.

    python experiments/overhead_bench/bench.py                 # both parts, ~3-4 minutes on 2 cores
    python experiments/overhead_bench/bench.py --part a        # (a) only
    python experiments/overhead_bench/bench.py --part b        # (b) only

(a) One process, one thread, tp=pp=dp=1. The same training step done four ways, on the same model, weights and
    data, one step of each in turn (rotating order, so slow phases of a busy machine hit all of them alike):
      mlplat       `TrainStep.forward_backward(batch)` (the pipeline engine over m=1 micro-batch, gradient
                   reductions, global-norm clipping) + AdamW.step + LR schedule: a Lightning training step
                   without the Trainer around it;
      trainer      the same through Lightning: `mlplat.train.build_trainer` + `Trainer.fit` on the embedded corpus
                   (progress bar, metrics.csv, self.log). Timed per loop iteration by a callback that also
                   runs one step of each other variant per iteration, so it stays interleaved with them;
      plain chunk  the same `DecoderChunk` used as a plain nn.Module: loss = chunk(tokens, labels); loss.backward();
                   torch.nn.utils.clip_grad_norm_; AdamW.step; LR schedule;
      plain GPT    an independent minimal GPT with the same shapes (nn.Linear, F.scaled_dot_product_attention,
                   F.cross_entropy) and the same plain loop.
    Wall and CPU (process_time) medians over the steps; ratio = variant / plain. The losses of mlplat and plain
    chunk are printed side by side as a check that both do the same computation.
(b) 3D layouts on CPU processes (gloo) via tests/dist.run_distributed: median step time (latest end - earliest
    start over the ranks, `forward_backward` + AdamW) of one process and of tp2, pp2, dp2, tp4, pp4 (1f1b) and
    tp2·pp2(v2)·dp2, all with the same model and the same global batch, so every step does the same work.
(c) The activation layout under sequence parallelism, tp2 on gloo: the same sequence-parallel blocks (LayerNorm,
    g + column-parallel GEMM, GeLU, row-parallel GEMM + ḡ, residual), forward and backward, with activations
    [b, s, h] (mlplat's, the sequence is dim 1) and [s, b, h] (Megatron's sequence-first, dim 0), one step of
    each in turn; printed side by side with their ratio. Along dim 0 the all-gather lands in place and the
    reduce-scatter sends its input as it is; along dim 1 each costs one copy of the activation.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from mlplat.config import load_config  # noqa: E402
from mlplat.harness.launch import launch as run_distributed  # noqa: E402
from mlplat.lightning.module import DecoderModule  # noqa: E402
from mlplat.model.decoder import DecoderChunk  # noqa: E402
from mlplat.model.init import init_full_view  # noqa: E402
from mlplat.parallel import mappings, sequence  # noqa: E402
from mlplat.parallel.grid import ParallelGrid  # noqa: E402
from mlplat.parallel.random import RNGTracker, seed_model_parallel  # noqa: E402
from mlplat.step import TrainStep  # noqa: E402

sys.path.insert(0, str(REPO / "experiments"))
from peer_gpt import PeerGPT  # noqa: E402


def make_cfg(model: dict, tp=1, pp=1, vpp=1, dp=1, schedule="1f1b", micro=8, global_batch=8, steps=1000,
             checked: bool = False):
    """The run config; `checked`: with the data checks `python -m mlplat.train` makes (they resolve
    data.tokenizer=null), for a run through the Trainer."""
    raw = {
        "model": dict(model),
        "parallel": dict(tp=tp, pp=pp, vpp=vpp, dp=dp, schedule=schedule, micro_batch_size=micro,
                         global_batch_size=global_batch),
        "kernels": dict(attention="sdpa"),
        "optim": dict(warmup_steps=10, grad_clip=1.0),
        "trainer": dict(max_steps=steps, precision="32-true", val_check_interval=10**6, limit_val_batches=0,
                        log_every_n_steps=1),
        "logger": dict(name="none"),
        "sample": dict(max_new_tokens=0),
        "seed": 1234,
    }
    if checked:
        from mlplat.train import load_checked

        return load_checked(raw, world_size=tp * pp * dp)
    return load_config(raw, world_size=tp * pp * dp)


def batch_of(cfg, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    w = torch.randint(0, cfg.model.vocab_size, (cfg.parallel.global_batch_size, cfg.model.seq_len + 1), generator=gen)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


# ------------------------------------------------------------------------------------------ the four steps


def _adamw(named_params, o, total_steps: int):
    decay = [p for _, p in named_params if p.ndim >= 2]
    no_decay = [p for _, p in named_params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor(o, total_steps))


def _lr_factor(o, total: int):
    """The learning-rate factor of TrainStep.schedule: linear warm-up, then cosine to min_lr."""
    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        t = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
        return (o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * t))) / o.lr
    return factor


class MlplatStep:
    """TrainStep.forward_backward + the optimizer and the schedule, as TrainStep.run does them (minus its record)."""

    def __init__(self, cfg, grid: ParallelGrid | None = None):
        self.module = TrainStep(cfg, grid or ParallelGrid())
        self.opt, self.sched = self.module.optimizer, self.module.schedule

    def __call__(self, batch) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss, _norm = self.module.forward_backward(batch)
        self.opt.step()
        self.sched.step()
        return float(loss)


class PlainChunkStep:
    """The same DecoderChunk (tp=1, one chunk = the whole model) in a plain PyTorch loop."""

    def __init__(self, cfg, backend: str):
        tracker = RNGTracker()  # attention dropout's RNG state (dropout is 0 here, but the chunk forks it)
        seed_model_parallel(cfg.seed, ParallelGrid(), tracker)
        self.model = DecoderChunk(cfg.model, ParallelGrid(), 0, 1, kernels=cfg.kernels, tracker=tracker,
                                 backend=backend)
        init_full_view(self.model, cfg.seed)
        self.clip = cfg.optim.grad_clip
        self.opt, self.sched = _adamw(list(self.model.named_parameters()), cfg.optim, cfg.trainer.max_steps)

    def __call__(self, batch) -> float:
        tokens, labels = batch
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.sched.step()
        return float(loss.detach())


class PlainGPTStep(PlainChunkStep):
    def __init__(self, cfg):  # super().__init__ not called: a different model, the same loop
        torch.manual_seed(cfg.seed)
        self.model = PeerGPT(**vars(cfg.model))
        self.clip = cfg.optim.grad_clip
        self.opt, self.sched = _adamw(list(self.model.named_parameters()), cfg.optim, cfg.trainer.max_steps)


def _time(fn, *args) -> tuple[float, float, object]:
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn(*args)
    return time.perf_counter() - w0, time.process_time() - c0, out


def part_a(model: dict, steps: int, warmup: int, with_trainer: bool, emit) -> None:
    torch.set_num_threads(1)
    # PTDPStrategy sets the thread count from OMP_NUM_THREADS when given (else cores / processes = 2 here).
    os.environ["OMP_NUM_THREADS"] = "1"
    cfg = make_cfg(model, steps=steps + warmup + 5)
    variants = {"mlplat": MlplatStep(cfg)}
    variants["plain chunk"] = PlainChunkStep(cfg, variants["mlplat"].module.attention_backend)
    variants["plain GPT"] = PlainGPTStep(cfg)
    names = list(variants)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    losses = {n: [] for n in names}
    step_no = {n: 0 for n in names}

    def one_round(rnd: int, record: bool, skip=()):
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for n in order:
            if n in skip:
                continue
            batch = batch_of(cfg, step_no[n])
            step_no[n] += 1
            w, c, loss = _time(variants[n], batch)
            if record:
                wall[n].append(w)
                cpu[n].append(c)
                losses[n].append(loss)

    n_params = sum(p.numel() for p in variants["plain chunk"].model.parameters())
    started = time.perf_counter()
    for rnd in range(warmup):
        one_round(rnd, False)
    for rnd in range(steps):
        one_round(rnd, True)
    elapsed = time.perf_counter() - started

    m = cfg.model
    emit(f"Model: {m.n_layers} layers, hidden {m.hidden}, {m.n_heads} heads, seq {m.seq_len}, vocab {m.vocab_size}, "
         f"batch {cfg.parallel.global_batch_size} ({n_params / 1e6:.2f} M parameters), float32, "
         f"attention={variants['mlplat'].module.attention_backend}, torch.set_num_threads(1); "
         f"{steps} timed steps of each after {warmup} warm-up, one of each in turn; "
         f"{elapsed:.0f} s without the Trainer part.")
    emit()
    emit("| variant | wall median (ms) | wall ratio vs plain chunk | wall ratio vs plain GPT | CPU median (ms) "
         "| CPU ratio vs plain chunk | CPU ratio vs plain GPT |")
    emit("|---|---|---|---|---|---|---|")
    rows = [(n, wall[n], cpu[n]) for n in names]
    pw, pc = statistics.median(wall["plain chunk"]), statistics.median(cpu["plain chunk"])
    gw, gc = statistics.median(wall["plain GPT"]), statistics.median(cpu["plain GPT"])
    for n, ws, cs in rows:
        w, c = statistics.median(ws), statistics.median(cs)
        emit(f"| {n} | {w * 1e3:.1f} | {w / pw:.3f} | {w / gw:.3f} | {c * 1e3:.1f} | {c / pc:.3f} | {c / gc:.3f} |")
    emit()
    # Per-round ratios (each mlplat step against the plain step of the same round) are less sensitive to
    # slow phases of a busy machine than the ratio of medians.
    paired = [a / b for a, b in zip(wall["mlplat"], wall["plain chunk"])]
    paired_cpu = [a / b for a, b in zip(cpu["mlplat"], cpu["plain chunk"])]
    emit(f"Median of per-round ratios mlplat / plain chunk: wall {statistics.median(paired):.3f}, "
         f"CPU {statistics.median(paired_cpu):.3f}.")
    diff = max(abs(a - b) for a, b in zip(losses["mlplat"], losses["plain chunk"]))
    emit(f"Same computation check: losses of mlplat and plain chunk over {len(losses['mlplat'])} steps differ by at "
         f"most {diff:.2e} (first {losses['mlplat'][0]:.4f}, last {losses['mlplat'][-1]:.4f} vs "
         f"{losses['plain chunk'][-1]:.4f}).")
    if not with_trainer:
        return

    # Lightning's full path: Trainer.fit on the embedded corpus, same model size; after each of its iterations a
    # callback runs one step of mlplat or plain chunk (alternately), so the three stay interleaved.
    tw, tc, phase = _trainer_steps(cfg, 2 * steps + warmup, warmup, variants, ("mlplat", "plain chunk"))
    emit()
    emit(f"Lightning Trainer path (`mlplat.train.build_trainer` + `Trainer.fit`, progress bar, metrics.csv, "
         f"self.log; logger=none): {len(tw)} timed iterations, each followed by one step of mlplat or plain chunk "
         f"in turn; an iteration is timed from one on_train_batch_start to the next, minus that extra step.")
    emit()
    emit("| variant (Trainer phase) | wall median (ms) | wall ratio vs plain chunk | CPU median (ms) "
         "| CPU ratio vs plain chunk |")
    emit("|---|---|---|---|---|")
    pw, pc = statistics.median(phase["plain chunk"][0]), statistics.median(phase["plain chunk"][1])
    for n, ws, cs in (("mlplat via Lightning Trainer", tw, tc), ("mlplat", *phase["mlplat"]),
                      ("plain chunk", *phase["plain chunk"])):
        w, c = statistics.median(ws), statistics.median(cs)
        emit(f"| {n} | {w * 1e3:.1f} | {w / pw:.3f} | {c * 1e3:.1f} | {c / pc:.3f} |")


def _trainer_steps(cfg, total: int, warmup: int, variants: dict, others: tuple[str, ...]):
    """Trainer.fit for `total` steps; returns (iteration wall times, iteration CPU times, {variant: (wall, cpu)})
    without the warm-up iterations."""
    import logging

    import pytorch_lightning as pl

    from mlplat.lightning.datamodule import TextDataModule
    from mlplat.train import build_trainer

    tcfg = make_cfg({k: getattr(cfg.model, k) for k in ("n_layers", "hidden", "n_heads", "seq_len", "vocab_size")},
                    steps=total, checked=True)
    marks: list[tuple[float, float]] = []
    inner: list[tuple[float, float]] = []
    phase = {n: ([], []) for n in others}

    class Interleave(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            marks.append((time.perf_counter(), time.process_time()))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            i = len(marks) - 1
            name = others[i % len(others)]
            w, c, _ = _time(variants[name], batch_of(cfg, 10_000 + i))
            if i >= warmup:
                phase[name][0].append(w)
                phase[name][1].append(c)
            inner.append((w, c))

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(tcfg, Path(tmp), extra_callbacks=[Interleave()])
        trainer.fit(DecoderModule(tcfg), datamodule=TextDataModule(tcfg))
    tw, tc = [], []
    for i in range(warmup, len(marks) - 1):
        tw.append(marks[i + 1][0] - marks[i][0] - inner[i][0])
        tc.append(marks[i + 1][1] - marks[i][1] - inner[i][1])
    return tw, tc, phase


# ------------------------------------------------------------------------------------------ part (b)

LAYOUTS = [  # (label, tp, pp, vpp, dp, schedule)
    ("tp2", 2, 1, 1, 1, "1f1b"), ("pp2", 1, 2, 1, 1, "1f1b"), ("dp2", 1, 1, 1, 2, "1f1b"),
    ("tp4", 4, 1, 1, 1, "1f1b"), ("pp4", 1, 4, 1, 1, "1f1b"), ("tp2·pp2(v2)", 2, 2, 2, 1, "interleaved"),
    ("tp2·pp2(v2)·dp2", 2, 2, 2, 2, "interleaved"),
]


def _layout_steps(rank: int, world: int, model: dict, layouts: list, micro: int, global_batch: int,
                  steps: int, warmup: int) -> dict:
    """Every layout of this world size in one process group, one after the other."""
    torch.set_num_threads(1)
    out = {}
    for label, tp, pp, vpp, dp, schedule in layouts:
        cfg = make_cfg(model, tp, pp, vpp, dp, schedule, micro, global_batch)
        grid = ParallelGrid(tp, pp, dp)
        step = MlplatStep(cfg, grid)
        times, cpus = [], []
        per = global_batch // dp  # this data-parallel rank's share of the global batch
        mine = slice(grid.dp_rank * per, (grid.dp_rank + 1) * per)
        for i in range(warmup + steps):
            tokens, labels = batch_of(cfg, i)
            local = (tokens[mine], labels[mine])
            if world > 1:
                dist.barrier()
            w0, c0 = time.perf_counter(), time.process_time()
            step(local)
            w1, c1 = time.perf_counter(), time.process_time()
            if i < warmup:
                continue
            if world > 1:
                t = torch.tensor([w0, w1, c1 - c0], dtype=torch.float64)
                parts = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(parts, t)
                times.append(max(float(p[1]) for p in parts) - min(float(p[0]) for p in parts))
                cpus.append(sum(float(p[2]) for p in parts))
            else:
                times.append(w1 - w0)
                cpus.append(c1 - c0)
        m = cfg.parallel.num_micro_batches
        out[label] = {"wall": statistics.median(times), "cpu": statistics.median(cpus), "m": m,
                      "all": sorted(times)}
    return out


def part_b(model: dict, micro: int, global_batch: int, steps: int, warmup: int, emit) -> None:
    by_world: dict[int, list] = {}
    for lay in LAYOUTS:
        by_world.setdefault(lay[1] * lay[2] * lay[4], []).append(lay)
    single = ("1 process", 1, 1, 1, 1, "1f1b")
    started = time.perf_counter()
    results = _layout_steps(0, 1, model, [single], micro, global_batch, steps, warmup)
    for world, lays in by_world.items():
        try:
            res = run_distributed(_layout_steps, world, model, lays, micro, global_batch, steps, warmup,
                                  timeout=900)[0]
        except Exception as err:  # noqa: BLE001 - report it in the table
            for lay in lays:
                results[lay[0]] = {"error": str(err).strip().splitlines()[-1][:200]}
            continue
        results.update(res)
    elapsed = time.perf_counter() - started
    base = results["1 process"]
    emit(f"Model: {model['n_layers']} layers, hidden {model['hidden']}, {model['n_heads']} heads, seq "
         f"{model['seq_len']}, vocab {model['vocab_size']}; global batch {global_batch}, micro-batch {micro} "
         f"(1 process: m={base['m']}); float32; one thread per process; {os.cpu_count()} cores; median of {steps} "
         f"steps after {warmup} warm-up; {elapsed:.0f} s in all.")
    emit()
    emit("| layout | processes | m per pipeline | step wall (s) | vs 1 process | CPU s per step, all ranks "
         "| CPU vs 1 process | steps (s) |")
    emit("|---|---|---|---|---|---|---|---|")
    for label, tp, pp, vpp, dp, _ in [single, *LAYOUTS]:
        r = results[label]
        n = tp * pp * dp
        if "error" in r:
            emit(f"| {label} | {n} | - | failed: {r['error']} | | | | |")
            continue
        spread = " ".join(f"{x:.2f}" for x in r["all"])
        emit(f"| {label} | {n} | {r['m']} | {r['wall']:.3f} | {r['wall'] / base['wall']:.2f}x | {r['cpu']:.3f} "
             f"| {r['cpu'] / base['cpu']:.2f}x | {spread} |")


# ------------------------------------------------------------------------------------------ part (c)

LAYOUT_DIMS = {"[b, s, h]": 1, "[s, b, h]": 0}  # activation layout -> the sequence dim


def _sequence_dim(dim: int) -> None:
    """The layout the sequence-parallel mappings assume (a module constant, read at each call)."""
    mappings.SEQUENCE_DIM = sequence.SEQUENCE_DIM = dim


def _sp_layout_steps(rank: int, world: int, hidden: int, layers: int, seq: int, batch: int, steps: int,
                     warmup: int) -> dict:
    """Sequence-parallel MLP blocks at tp = world, forward + backward, in both layouts, one step of each in turn."""
    from mlplat.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    torch.set_num_threads(1)
    grid = ParallelGrid(tp=world)
    torch.manual_seed(0)
    sp = dict(sequence_parallel=True)
    blocks = [nn.ModuleList([nn.LayerNorm(hidden), ColumnParallelLinear(hidden, 4 * hidden, grid, **sp),
                             RowParallelLinear(4 * hidden, hidden, grid, **sp)]) for _ in range(layers)]
    params = [p for b in blocks for p in b.parameters()]
    shard = seq // world
    shapes = {"[b, s, h]": (batch, shard, hidden), "[s, b, h]": (shard, batch, hidden)}
    names = list(LAYOUT_DIMS)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    saved = mappings.SEQUENCE_DIM
    try:
        for i in range(warmup + steps):
            for n in names[i % 2:] + names[:i % 2]:
                _sequence_dim(LAYOUT_DIMS[n])
                x = torch.randn(shapes[n], requires_grad=True)
                for p in params:
                    p.grad = None
                dist.barrier()
                w0, c0 = time.perf_counter(), time.process_time()
                y = x
                for ln, fc1, fc2 in blocks:
                    y = y + fc2(F.gelu(fc1(ln(y))))
                y.sum().backward()
                w1, c1 = time.perf_counter(), time.process_time()
                t = torch.tensor([w0, w1, c1 - c0], dtype=torch.float64)
                parts = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(parts, t)
                if i >= warmup:
                    wall[n].append(max(float(p[1]) for p in parts) - min(float(p[0]) for p in parts))
                    cpu[n].append(sum(float(p[2]) for p in parts))
    finally:
        _sequence_dim(saved)
    return {"wall": wall, "cpu": cpu}


def part_c(hidden: int, layers: int, seq: int, batch: int, steps: int, warmup: int, emit) -> None:
    started = time.perf_counter()
    res = run_distributed(_sp_layout_steps, 2, hidden, layers, seq, batch, steps, warmup, timeout=900)[0]
    elapsed = time.perf_counter() - started
    wall, cpu = res["wall"], res["cpu"]
    emit(f"{layers} sequence-parallel MLP blocks (LayerNorm, g + column-parallel GEMM {hidden}->{4 * hidden}, GeLU, "
         f"row-parallel GEMM + ḡ, residual), forward + backward, tp2 on gloo, float32, batch {batch}, seq {seq} "
         f"(shard {seq // 2}), one thread per process; median of {steps} steps of each after {warmup} warm-up, one "
         f"of each in turn; {elapsed:.0f} s in all.")
    emit()
    emit("| layout | sequence dim | step wall (ms) | CPU ms per step, both ranks |")
    emit("|---|---|---|---|")
    for n, dim in LAYOUT_DIMS.items():
        emit(f"| {n} | {dim} | {statistics.median(wall[n]) * 1e3:.1f} | {statistics.median(cpu[n]) * 1e3:.1f} |")
    a, b = LAYOUT_DIMS
    med = statistics.median
    paired = med([x / y for x, y in zip(wall[b], wall[a])])
    paired_cpu = med([x / y for x, y in zip(cpu[b], cpu[a])])
    emit()
    emit(f"Ratio {b} / {a}: wall {med(wall[b]) / med(wall[a]):.3f} (median of per-step ratios {paired:.3f}), "
         f"CPU {med(cpu[b]) / med(cpu[a]):.3f} (per-step {paired_cpu:.3f}).")


NOTES = """
## How to read these figures

**(a)** All variants run the same model, weights and batches in one process with one thread, one step of each
in turn, so a busy machine slows them alike; wall and CPU (process_time) medians agree when the process was
not starved. *mlplat / plain chunk* is what mlplat's training step adds to a plain PyTorch loop over the very
same `DecoderChunk` (pipeline engine with one stage and one micro-batch, the data-parallel gradient buckets and
tied-embedding reduction that are no-ops at dp=1, the grid-aware norm for clipping, the LR schedule): the
losses agree to float32 rounding, so both do the same computation. *plain GPT* is an independent minimal GPT
with the same shapes: the difference between it and *plain chunk* is the cost of mlplat's model code at tp=1
(tensor-parallel linear layers with their identity autograd mappings, a bias added after the row-parallel
matmul, the vocab-parallel cross-entropy, the model-parallel RNG fork around attention), not of the engine.
*Lightning Trainer* is the full `python -m mlplat.train` path (loop, data loader, `self.log` calls,
metrics.csv, progress bar) on the same model size.

**(b)** Every layout trains the same model on the same global batch, so a step is the same work everywhere and
times compare directly. On this machine they cannot show GPU-like scaling:
* 2 cores run up to 8 processes: at most two ranks compute at a time, so no layout can beat half the one-process
  time, and the pipeline bubble, the tensor-parallel all-reduces and the data-parallel gradient all-reduce come
  on top;
* communication is gloo over loopback TCP: every message costs CPU time on the same two cores (the "CPU s per
  step, all ranks" column against the one-process CPU time shows this work inflation), and its latency is
  milliseconds instead of microseconds over NVLink/InfiniBand;
* with more processes than cores, a rank that waits in a collective often waits for a peer that is not
  scheduled at all (oversubscription); tensor parallelism suffers most, with two blocking all-reduces per layer
  per micro-batch forward and two more in backward, each needing all t ranks on a core at once: tp4 on 2 cores
  is the worst case, pipeline parallelism (one point-to-point message per micro-batch and stage) the mildest;
* other jobs share the machine: see the load averages at the end.
On GPUs the compute of a step is ~1000x faster and the links ~100x faster and overlapped with compute, so
these CPU ratios say nothing about GPU scaling; the figures that do are the simulator's and the planner's
(`experiments/paper_table1/`). What these runs do show is that every layout runs the same training step and
how much the CPU backend's communication costs.
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("a", "b", "c", "ab", "abc"), default="abc")
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="(a) batch size")
    ap.add_argument("--steps", type=int, default=40, help="(a) timed steps of each variant")
    ap.add_argument("--no-trainer", action="store_true", help="(a) skip the Lightning Trainer variant")
    ap.add_argument("--b-hidden", type=int, default=128)
    ap.add_argument("--b-steps", type=int, default=8)
    ap.add_argument("--b-global-batch", type=int, default=16)
    ap.add_argument("--b-micro", type=int, default=2)
    ap.add_argument("--c-hidden", type=int, default=256)
    ap.add_argument("--c-layers", type=int, default=4)
    ap.add_argument("--c-seq", type=int, default=256)
    ap.add_argument("--c-batch", type=int, default=8)
    ap.add_argument("--c-steps", type=int, default=20)
    ap.add_argument("--out", default=str(HERE / "results.md"), help="markdown file to write ('' = none)")
    args = ap.parse_args(argv)
    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    load0, started = os.getloadavg()[0], time.perf_counter()
    model = dict(n_layers=args.layers, hidden=args.hidden, n_heads=4, seq_len=args.seq, vocab_size=256, dropout=0.0)
    if "a" in args.part:
        emit("## (a) mlplat at tp=pp=dp=1 vs a plain PyTorch loop (one process, one thread)")
        emit()
        part_a({**model}, args.steps, 3, not args.no_trainer, emit)
        emit()
    if "b" in args.part:
        emit("## (b) 3D layouts on CPU processes (gloo)")
        emit()
        part_b({**model, "hidden": args.b_hidden}, args.b_micro, args.b_global_batch, args.b_steps, 2, emit)
        emit()
    if "c" in args.part:
        emit("## (c) The activation layout under sequence parallelism: [b, s, h] vs [s, b, h] (tp2, gloo)")
        emit()
        part_c(args.c_hidden, args.c_layers, args.c_seq, args.c_batch, args.c_steps, 3, emit)
        emit()
    emit(f"Total wall time {time.perf_counter() - started:.0f} s. Load average (1 min) of the machine at the start / "
         f"end: {load0:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.")
    if args.out:
        cmd = "python experiments/overhead_bench/bench.py" + (" " + " ".join(sys.argv[1:]) if argv is None and
                                                                sys.argv[1:] else "")
        header = ["# Overhead benchmark: mlplat vs plain PyTorch, and 3D step times on CPU", "",
                  f"Written by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M')} (torch {torch.__version__}). See README.md "
                  "in this folder for what is measured and how to read it.", ""]
        Path(args.out).write_text("\n".join(header + lines) + "\n" + NOTES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
