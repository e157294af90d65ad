"""Measure this CPU box for the cost model: the `cluster.cpu_*` figures and gloo's latency and bandwidth.

    python experiments/calibrate/calibrate.py                                   # print the figures as cluster yaml
    python experiments/calibrate/calibrate.py --write conf/cluster/local_cpu.yaml

Micro-benchmarks only: none of them runs a training step of a layout (`experiments/cost_model_check/` checks
the predictions against those). About a minute on 2 cores; run it on a quiet machine.
1. compute, one thread: mlplat's TransformerLayer (4 in a stack, as in a chunk), embedding and head (final
   LayerNorm, logits, vocab-parallel cross-entropy), forward and backward, at hidden 64/128/256, tensor-parallel
   shards t = 1/2/4 (built on a virtual grid, so without communication) and micro-batches 1/2/4; fitted by least
   squares (relative error) to ops · op_us + FLOPs / gemm_gflops + bytes / memory_gbps
   (`mlplat.perf.host.block_work`, fitted by `mlplat.perf.host.fit_relative`).
   Shown beside it, not fitted: a stack's backward split into the zero-bubble schedules' B and W, against the
   whole backward.
2. optimizer: mlplat's grad-norm clipping + AdamW + zero_grad on chunks of 1-4 layers; per tensor and per
   parameter.
3. gloo, 2 processes: all-reduce and send/recv of 4 B to 4 MiB back to back (their CPU work: α per hand-off,
   bandwidth), and all-reduce after some compute (shown, for comparison).
4. sharing, 8 processes: k = 1, 2, 4, 8 of them running the same layer loop -> other jobs' runnable processes
   on the cores; then tensor-parallel-like steps (a shard's forward, two all-reduces) on 2, 4, 8 processes in
   pairs and 4 in one group -> the wait per hand-off, for an idle core to wake and for a turn on a crowded one.
5. loop: `mlplat.train.build_trainer` on a minute model; a step's wall time less its pipeline step and optimizer.
Times are wall-clock: medians for compute, means for messages (their rare long waits count in a step), all
including what other jobs take from the machine at the time. The processes are started by the package's launcher
(`mlplat.harness.launch`), as in the tests.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mlplat.config import CPU_KEYS  # noqa: E402
from mlplat.harness.launch import launch  # noqa: E402
from mlplat.perf.flops import ModelDims  # noqa: E402
from mlplat.perf.host import Host, Work, alpha_beta, block_work, fit_relative  # noqa: E402
from mlplat.train import load_checked  # noqa: E402

SEQ, HEADS, VOCAB = 128, 4, 256
HIDDEN, TP, MICRO = (64, 128, 256), (1, 2, 4), (1, 2, 4)
SIZES = (4, 4096, 65536, 262144, 1 << 20, 4 << 20)
PAIR_BYTES = 2 * SEQ * 128 * 4  # the tensor-parallel all-reduce of a micro-batch of 2 at hidden 128


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset), not all the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cfg(hidden: int, layers: int = 1, seq: int = SEQ, micro: int = 2, **over):
    raw = {"model": dict(n_layers=layers, hidden=hidden, n_heads=HEADS, seq_len=seq, vocab_size=VOCAB, dropout=0.0),
           "parallel": dict(tp=1, pp=1, dp=1, micro_batch_size=micro, global_batch_size=micro),
           "kernels": dict(attention="sdpa"), "trainer": dict(precision="32-true", limit_val_batches=0),
           "logger": dict(name="none"), "sample": dict(max_new_tokens=0)}
    for section, values in over.items():
        raw.setdefault(section, {}).update(values)
    return load_checked(raw, world_size=1)  # the data's tokenizer resolved, for the loop's data module


def _median_time(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


STACK = 4  # layers timed together, as they run in a chunk: each finds the caches as the others leave them


def _parts(hidden: int, tp: int):
    """A first chunk (embedding, STACK layers) and a last one (STACK layers, head) of a tensor-parallel shard t,
    without groups."""
    from mlplat.model.decoder import DecoderChunk
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.parallel.random import RNGTracker, seed_model_parallel

    cfg = _cfg(hidden, layers=2 * STACK)
    grid = ParallelGrid(tp, 1, 1, rank=0, virtual=True)
    tracker = RNGTracker()
    seed_model_parallel(0, ParallelGrid(1, 1, 1, rank=0, virtual=True), tracker)
    first = DecoderChunk(cfg.model, grid, 0, 2, kernels=cfg.kernels, tracker=tracker, backend="sdpa")
    last = DecoderChunk(cfg.model, grid, 1, 2, kernels=cfg.kernels, tracker=tracker, backend="sdpa")
    return cfg, grid, first, last


def _through(layers, x: torch.Tensor) -> torch.Tensor:
    """x through a stack of layers, as a chunk runs them."""
    for layer in layers:
        x = layer(x)
    return x


def _block_timers(hidden: int, tp: int, micro: int, reps: int):
    """{block: (forward seconds, backward seconds)} of the layer, embedding and head at one shape."""
    import torch.nn.functional as F

    from mlplat.parallel.cross_entropy import vocab_parallel_cross_entropy
    from mlplat.parallel.tensor import parallel_lm_logits

    cfg, grid, first, last = _parts(hidden, tp)
    x = torch.randn(micro, SEQ, hidden, requires_grad=True)

    def layers():
        return _through(first.layers.values(), x)
    ids = torch.randint(0, VOCAB, (micro, SEQ))
    pos = torch.arange(SEQ)

    def embedding():  # DecoderChunk.forward's first lines
        return F.dropout(first.embedding.word(ids) + first.embedding.position(pos), 0.0, True)

    def head():  # ... and its last ones
        logits = parallel_lm_logits(last.final_ln(x), last.output_embedding(), grid)
        return vocab_parallel_cross_entropy(logits, ids, grid, VOCAB).mean()

    out = {}
    for name, fwd in (("layer", layers), ("embedding", embedding), ("head", head)):
        y = fwd()
        grad = torch.ones_like(y) if y.dim() == 0 else torch.randn_like(y)
        f = _median_time(fwd, reps)
        holder = []

        def backward():
            holder[0].backward(grad)

        bwd = []
        for i in range(reps + 2):
            holder[:] = [fwd()]
            t0 = time.perf_counter()
            backward()
            if i >= 2:
                bwd.append(time.perf_counter() - t0)
        per = STACK if name == "layer" else 1
        out[name] = (f / per, statistics.median(bwd) / per)
    return out


def measure_compute(reps: int, log) -> dict:
    """op_us, backward_op_us, gemm_gflops, memory_gbps and the fit's worst error."""
    torch.manual_seed(0)
    rows, samples = [], []
    for h in HIDDEN:
        for t in TP:
            for b in MICRO:
                work = block_work(ModelDims(1, h, HEADS, SEQ, VOCAB), b, t)
                for name, (f, bwd) in _block_timers(h, t, b, reps).items():
                    if name == "embedding" and t > 1:
                        continue  # its vocabulary mask is tp-only code the virtual grid skips
                    for backward, seconds in ((False, f), (True, bwd)):
                        w: Work = work[name][int(backward)]
                        ops = [0.0, w.ops] if backward else [w.ops, 0.0]
                        rows.append(([*ops, w.flops, w.bytes], seconds))
                        samples.append((name, h, t, b, backward, seconds, w))
    op, bop, per_flop, per_byte = fit_relative(rows)
    fig = dict(op_us=op * 1e6, backward_op_us=bop * 1e6, gemm_gflops=1e-9 / per_flop if per_flop else 1e3,
               memory_gbps=1e-9 / per_byte if per_byte else 1e3)
    host = Host(1, 0, fig["gemm_gflops"], fig["memory_gbps"], fig["op_us"], fig["backward_op_us"], 0, 0, 0, 0, 0)
    errors = [(host.seconds(w, bwd) / sec - 1, name, h, t, b, bwd, sec) for name, h, t, b, bwd, sec, w in samples]
    worst = max(errors, key=lambda e: abs(e[0]))
    layer_err = [abs(e[0]) for e in errors if e[1] == "layer"]
    log(f"compute: {len(samples)} timings; fit op {fig['op_us']:.2f} µs forward, {fig['backward_op_us']:.2f} µs "
        f"backward, GEMMs {fig['gemm_gflops']:.1f} GFLOP/s, element-wise {fig['memory_gbps']:.1f} GB/s; layers "
        f"within {max(layer_err):.0%} (median {statistics.median(layer_err):.0%}); worst {worst[0]:+.0%} "
        f"({worst[1]} h={worst[2]} t={worst[3]} b={worst[4]} {'backward' if worst[5] else 'forward'} "
        f"{worst[6] * 1e3:.2f} ms)")
    return fig


def measure_split(reps: int, log, hidden: int = 128, micro: int = 2) -> dict:
    """Shown, not a figure: a stack of layers' backward split as the zero-bubble schedules run it, B (weight
    gradients recorded) then W (the recorded GEMMs run), against the whole backward. The model prices B + W as the
    whole backward (`mlplat.perf.cpu_model`: W as a forward's compute, B the rest)."""
    from mlplat.parallel.weight_grad import WeightGradStore

    _, _, first, _ = _parts(hidden, 1)
    stack = list(first.layers.values())
    for q in first.parameters():
        q.main_grad = torch.zeros_like(q)  # W accumulates there, as under the engine's gradient buffer
    deferring = [mod for layer in stack for mod in layer.modules() if hasattr(mod, "wgrad_store")]
    store = WeightGradStore()
    x = torch.randn(micro, SEQ, hidden, requires_grad=True)
    grad = torch.randn(micro, SEQ, hidden)

    times: dict[str, list[float]] = {"whole": [], "B": [], "W": []}
    for i in range(2 * reps + 4):
        split = i % 2 == 1
        for mod in deferring:
            mod.wgrad_store = store if split else None
        y = _through(stack, x)
        store.key = (0, 0) if split else None
        t0 = time.perf_counter()
        y.backward(grad)
        t1 = time.perf_counter()
        store.key = None
        store.run((0, 0))
        t2 = time.perf_counter()
        if i >= 4:
            times["B" if split else "whole"].append(t1 - t0)
            if split:
                times["W"].append(t2 - t1)
    whole, b, w = (statistics.median(times[k]) / STACK for k in ("whole", "B", "W"))
    log(f"zero-bubble split, per layer (hidden {hidden}, micro-batch {micro}): B {b * 1e3:.2f} ms + W {w * 1e3:.2f} ms"
        f" = {(b + w) / whole:.2f} x the whole backward ({whole * 1e3:.2f} ms; the model: 1.00 x)")
    return {}


def measure_optimizer(reps: int, log) -> dict:
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.step import TrainStep

    rows = []
    for layers in (1, 4):
        for h in (64, 256):
            module = TrainStep(_cfg(h, layers=layers), ParallelGrid())
            params = module.parameters()
            grads = [torch.randn_like(q) * 1e-3 for q in params]
            optim, sched = module.optimizer, module.schedule

            def step():
                for q, g in zip(params, grads):
                    q.main_grad.copy_(g)  # what the gradient buffer holds after a backward
                    q.grad = q.main_grad
                t0 = time.perf_counter()
                module.grads.clip_grad_norm_(1.0)
                optim.step()
                sched.step()
                optim.zero_grad(set_to_none=True)
                return time.perf_counter() - t0

            for _ in range(2):
                step()
            rows.append(([len(params), sum(q.numel() for q in params)], statistics.median(step() for _ in range(reps))))
    per_tensor, per_param = fit_relative(rows)
    log(f"optimizer: {per_tensor * 1e6:.1f} µs per tensor + {per_param * 1e9:.2f} ns per parameter "
        f"({', '.join(f'{n:.0f} tensors/{p / 1e6:.2f}M: {s * 1e3:.1f} ms' for (n, p), s in rows)})")
    return dict(optimizer_us_per_tensor=per_tensor * 1e6, optimizer_ns_per_param=per_param * 1e9)


# ---------------------------------------------------------------------------------------------- processes

def _shard_forward(hidden: int, tp: int, micro: int):
    """A no-grad forward of one tensor-parallel shard of a layer: the compute between two TP all-reduces."""
    _, _, first, _ = _parts(hidden, tp)
    layer = next(iter(first.layers.values()))
    x = torch.randn(micro, SEQ, hidden)

    def run():
        with torch.no_grad():
            layer(x)
    return run


def _processes(rank: int, world: int, reps: int, sharing_iters: int, rounds: int = 8) -> dict:
    """Everything that needs several processes, in one group of 8 (idle ranks wait in a barrier, asleep). Sizes,
    and process counts, take turns (in `rounds`) so that other jobs' load, which drifts, hits them alike."""
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    quads = [dist.new_group(list(range(r, r + 4))) for r in range(0, world, 4)]
    pair, quad = pairs[rank // 2], quads[rank // 4]

    # gloo on ranks 0 and 1: back to back, the CPU work of a message with nobody asleep; after some compute, as in
    # training, when the waiting side's core has gone idle meanwhile.
    buffers = {n: torch.zeros(max(1, n // 4)) for n in SIZES}
    ar: dict[int, list[float]] = {n: [] for n in SIZES}
    pp: dict[int, list[float]] = {n: [] for n in SIZES}
    late: dict[int, list[float]] = {n: [] for n in SIZES}
    work2 = _shard_forward(128, 2, 2)
    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def ping(x):
        def run():
            if rank == 0:
                dist.send(x, 1, group=pair)
                dist.recv(x, 1, group=pair)
            else:
                dist.recv(x, 0, group=pair)
                dist.send(x, 0, group=pair)
        return run

    if rank < 2:
        for i in range(reps + 2):
            for n, x in buffers.items():
                reduce = lambda: dist.all_reduce(x, group=pair)  # noqa: E731
                reduce()
                reduce()  # the third in a row finds every thread awake
                ar[n].append(timed(reduce))
                work2()
                late[n].append(timed(reduce))
                ping(x)()
                pp[n].append(timed(ping(x)) / 2)
    # Means, not medians: a message's rare long waits are part of what it costs a training step.
    out: dict = {name: {n: statistics.mean(v[2:]) for n, v in times.items() if v}
                 for name, times in (("allreduce", ar), ("p2p", pp), ("after_compute", late))}

    # The same layer loop on k processes at once; tensor-parallel-like groups (a shard's forward, then two
    # blocking all-reduces) on k processes at once: pairs on 2, 4, 8 processes, one group of 4; and the shards'
    # compute alone. Each timed as a whole loop: a process's share of the cores shows between calls, not in them.
    _, _, first, _ = _parts(128, 1)
    layer = next(iter(first.layers.values()))
    x = torch.randn(2, SEQ, 128, requires_grad=True)
    g = torch.randn_like(x)
    msg = torch.zeros(PAIR_BYTES // 4)
    work4 = _shard_forward(128, 4, 2)

    def tp_step(work, group):
        def run():
            work()
            dist.all_reduce(msg, group=group)
            dist.all_reduce(msg, group=group)
        return run

    def layer_step():
        layer(x).backward(g)

    calls = max(1, 4 * reps // rounds)
    cases = [("sharing", k, layer_step, max(1, sharing_iters // rounds)) for k in (1, 2, 4, 8)]
    cases += [("pairs", k, tp_step(work2, pair), calls) for k in (2, 4, 8)]
    cases += [("quad", 4, tp_step(work4, quad), calls), ("work2", 1, work2, calls), ("work4", 1, work4, calls)]
    seen: dict[tuple, list[float]] = {}
    for _ in range(rounds):
        for name, k, fn, n in cases:
            dist.barrier()
            if rank < k:
                fn()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                seen.setdefault((name, k), []).append((time.perf_counter() - t0) / n)
            dist.barrier()
    for (name, k), values in seen.items():
        out.setdefault(name, {})[k] = statistics.median(values)
    out["work"] = {2: out.pop("work2", {}).get(1), 4: out.pop("work4", {}).get(1)}
    return out


def measure_processes(reps: int, sharing_iters: int, log) -> dict:
    res = launch(_processes, 8, reps, sharing_iters, timeout=600)[0]
    ar_alpha, ar_bw = alpha_beta(res["allreduce"], 2)  # 2 processes: 2 ring steps, each moving bytes / 2
    p2p_alpha, p2p_bw = alpha_beta(res["p2p"], 1)
    log("gloo, 2 processes, back to back: all-reduce " + ", ".join(f"{n} B {s * 1e6:.0f} µs" for n, s in
                                                                    res["allreduce"].items()))
    log("                                 send/recv  " + ", ".join(f"{n} B {s * 1e6:.0f} µs" for n, s in
                                                                    res["p2p"].items()))
    log(f"  -> all-reduce {ar_alpha * 1e6:.0f} µs per ring step, {ar_bw / 1e9:.2f} GB/s; send/recv "
        f"{p2p_alpha * 1e6:.0f} µs, {p2p_bw / 1e9:.2f} GB/s")
    # Our k processes and `background` runnable ones of other jobs share the cores fairly (mlplat.perf.host).
    cores = float(usable_cores())
    slow = {k: w / res["sharing"][1] for k, w in res["sharing"].items()}

    def host_of(background: float, idle: float = 0.0, wakeup: float = 0.0) -> Host:
        return Host(cores, background, 1, 1, 0, 0, 0, 0, idle * 1e6, wakeup * 1e6, 0)

    background = min((b / 20 for b in range(0, 321)),
                     key=lambda b: sum(math.log(slow[k] / host_of(b).sharing(k)) ** 2 for k in slow))
    log("sharing: a layer loop on k processes at once runs " + ", ".join(f"k={k}: {x:.2f}x" for k, x in slow.items())
        + f" slower than one alone -> {background:.2f} runnable processes of other jobs on the {cores:g} cores")

    log("  after compute: all-reduce " + ", ".join(f"{n} B {s * 1e6:.0f} µs" for n, s in
                                                   res["after_compute"].items()))

    # A TP-like step = sharing(k) x its compute alone + 2 all-reduces, each its CPU work (the back-to-back α-β)
    # c(k)/c(2) times over + per hand-off a wait: waking an idle core, which fades as the cores crowd, and a turn
    # on a crowded core (mlplat.perf.host). Fit both waits, non-negative, on the 4 cases.
    def ring(t: int) -> float:
        return 2 * (t - 1) * ar_alpha + 2 * (t - 1) / t * PAIR_BYTES / ar_bw

    cases = [(f"{k} processes in pairs", k, 2, res["pairs"][k]) for k in (2, 4, 8)]
    cases.append(("4 processes in one group", 4, 4, res["quad"][4]))
    base = host_of(background)
    rows = []
    for _, k, t, wall in cases:
        terms = [host_of(background, *w).message(0.0, 4 * (t - 1), k) for w in ((1.0, 0.0), (0.0, 1.0))]
        rows.append((terms, wall - base.message(2 * ring(t), 0, k) - base.sharing(k) * res["work"][t]))
    a, y = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
    waits, *_ = np.linalg.lstsq(a, y, rcond=None)
    if (waits < 0).any():  # one of them explains nothing: fit the other alone
        keep = int(np.argmax(waits))
        waits = np.zeros(2)
        waits[keep] = max(0.0, float(a[:, keep] @ y / (a[:, keep] @ a[:, keep])))
    idle, wakeup = (float(w) for w in waits)
    fitted = host_of(background, idle, wakeup)
    parts = []
    for label, k, t, wall in cases:
        model = fitted.message(2 * ring(t), 4 * (t - 1), k) + fitted.sharing(k) * res["work"][t]
        parts.append(f"{label} {wall * 1e3:.2f} ms (model {model * 1e3:.2f})")
    log("TP-like steps (a shard's forward, 2 all-reduces of 128 KiB): " + "; ".join(parts)
        + f" -> per hand-off {idle * 1e6:.0f} µs to wake an idle core, {wakeup * 1e6:.0f} µs for a turn on a "
        "crowded one")
    return dict(cores=cores, background=background, idle_wakeup_us=idle * 1e6, wakeup_us=wakeup * 1e6,
                nvlink_latency_us=ar_alpha * 1e6, nvlink_gbps=ar_bw * 8 / 1e9, p2p_latency_us=p2p_alpha * 1e6,
                p2p_gbps=p2p_bw * 8 / 1e9)


def measure_loop(steps: int, log) -> dict:
    """The Lightning loop's cost per step (callbacks, self.log, metrics.csv, data loader), one process."""
    import logging

    import pytorch_lightning as pl

    from mlplat.lightning.datamodule import TextDataModule
    from mlplat.lightning.module import DecoderModule
    from mlplat.train import build_trainer

    cfg = _cfg(32, layers=1, seq=32, micro=2, trainer=dict(max_steps=steps, val_check_interval=10**6))
    inner: list[float] = []
    marks: list[float] = []

    class Timed(DecoderModule):
        def configure_model(self):
            super().configure_model()
            run = self.step.run

            def timed(batch):  # the pipeline pass and the optimizer step
                t0 = time.perf_counter()
                out = run(batch)
                inner.append(time.perf_counter() - t0)
                return out

            self.step.run = timed

    class Marks(pl.Callback):
        def on_train_batch_end(self, *a, **k):
            marks.append(time.perf_counter())

    for name in ("pytorch_lightning", "lightning", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # One thread, as each rank of a multi-process run has (PTDPStrategy would give one process all the cores).
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as quiet, \
                contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):  # the progress bar
            trainer = build_trainer(cfg, Path(tmp), extra_callbacks=[Marks()])
            trainer.fit(Timed(cfg), datamodule=TextDataModule(cfg))
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    loop = [marks[i + 1] - marks[i] - inner[i + 1] for i in range(steps // 4, len(marks) - 1)]
    log(f"loop: a Lightning step takes {statistics.median(loop) * 1e3:.2f} ms beyond its pipeline step and optimizer")
    return dict(loop_us=statistics.median(loop) * 1e6)


def calibrate(reps: int = 9, sharing_iters: int = 150, loop_steps: int = 60, log=print) -> dict:
    """All figures, as `cluster.*` keys."""
    torch.set_num_threads(1)
    started, load = time.perf_counter(), os.getloadavg()[0]
    fig = measure_compute(reps, log)
    fig.update(measure_split(reps, log))
    fig.update(measure_optimizer(reps, log))
    fig.update(measure_processes(reps * 4, sharing_iters, log))
    fig.update(measure_loop(loop_steps, log))
    log(f"calibration: {time.perf_counter() - started:.0f} s; load average (1 min) {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end, on {usable_cores()} cores")
    host = Host(**{name: fig[name] for name in Host.__dataclass_fields__})
    return {"nvlink_gbps": float(fig["nvlink_gbps"]), "nvlink_latency_us": float(fig["nvlink_latency_us"]),
            **host.cluster_keys()}


CLUSTER_YAML = """\
# This machine: CPU processes over gloo. gpus_per_node = how many ranks (processes) you may run here.
# The figures below were measured on it by experiments/calibrate/calibrate.py ({when}, load average {load:.1f} on
# {cpus} cores; mlplat.perf.host explains the model). On another machine:
# python experiments/calibrate/calibrate.py --write THIS_FILE
name: local_cpu
device: cpu
gpus_per_node: 8
gpu_memory_gb: 4           # GiB budget per process
nvlink_gbps: {nvlink_gbps:.4g}  # "intra-node" = gloo between local processes: all-reduce bandwidth
nvlink_efficiency: 1.0     # (measured, nothing to discount)
nvlink_latency_us: {nvlink_latency_us:.4g}  # gloo back to back: per ring step of an all-reduce, per message
ib_gbps_per_gpu: 10        # "inter-node" = TCP gloo, nominal
nodes: 1
"""


def cluster_yaml(fig: dict) -> str:
    """The cluster file: the fixed lines above, then one line per `cluster.cpu_*` key (`mlplat.config.CPU_KEYS`)."""
    head = CLUSTER_YAML.format(when=time.strftime("%Y-%m-%d"), load=os.getloadavg()[0], cpus=usable_cores(), **fig)
    return head + "".join(f"{key}: {fig[key]:.4g}\n" for key in CPU_KEYS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", metavar="YAML", help="write the cluster file (e.g. conf/cluster/local_cpu.yaml)")
    args = ap.parse_args(argv)
    text = cluster_yaml(calibrate())
    if args.write:
        Path(args.write).write_text(text)
        print(f"written to {args.write}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
