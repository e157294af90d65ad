"""The CPU cost model against this machine: predicted and measured step times side by side, in one run.

    python experiments/cost_model_check/run.py                  # calibrate, predict, measure; ~4 min on 2 cores
    python experiments/cost_model_check/run.py --no-calibrate   # the figures of conf/cluster/local_cpu.yaml
    python experiments/cost_model_check/run.py --write-cluster  # also store the fresh figures there

1. calibrate: `experiments/calibrate/calibrate.py` (micro-benchmarks: layer compute, optimizer, gloo, processes sharing
   cores, the Lightning loop), unless --no-calibrate;
2. predict, from those figures alone, with `mlplat.perf.dry_run.plan`: the layouts of
   `experiments/overhead_bench/` part (b) (1 process, tp2, pp2, dp2, tp4, pp4, tp2·pp2(v2), tp2·pp2(v2)·dp2; one
   4-layer GPT, hidden 128, global batch 16, micro-batch 2) and the main job (`python -m mlplat.train`'s
   defaults: model tiny, t2·p2(v2)·d2 on 8 processes, micro-batch 4), also on p4 as 1F1B, ZB-H1 and ZB-H2, the
   last with and without optimizer post-validation (MAIN_JOBS);
3. measure them: part (b) with overhead_bench's own code (median of 8 steps of `forward_backward` + AdamW, no
   Lightning loop, so its predictions leave `cluster.cpu_loop_us` out), the main jobs by their command lines
   (median `step_time_s` of steps 5-30 in metrics.csv);
4. print and write results.md: predicted | measured | ratio, the worst ratio (the one farthest from 1), and a reason
   where the prediction misses the measurement by more than 25% of it.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (REPO, REPO / "experiments" / "overhead_bench", REPO / "experiments" / "calibrate"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench  # noqa: E402  (experiments/overhead_bench/bench.py)
import torch  # noqa: E402
from calibrate import calibrate, cluster_yaml, usable_cores  # noqa: E402  (experiments/calibrate/calibrate.py)
from omegaconf import OmegaConf  # noqa: E402

from mlplat.config import CPU_KEYS, ClusterConfig  # noqa: E402
from mlplat.perf.dry_run import plan  # noqa: E402
from mlplat.train import load_checked  # noqa: E402

CLUSTER_FILE = REPO / "conf" / "cluster" / "local_cpu.yaml"
FIGURES = ("nvlink_gbps", "nvlink_latency_us", "nvlink_efficiency", *CPU_KEYS)
MAIN_STEPS = ("trainer.max_steps=30", "logger=none", "sample.max_new_tokens=0", "trainer.limit_val_batches=0")
BENCH_MODEL = dict(n_layers=4, hidden=128, n_heads=4, seq_len=128, vocab_size=256, dropout=0.0)
MICRO, GLOBAL, STEPS, WARMUP = 2, 16, 8, 2
SINGLE = ("1 process", 1, 1, 1, 1, "1f1b")
# The main job, and on 4 processes (p4, m = 16, an untied output layer) 1F1B, ZB-H1 and ZB-H2, the last with and
# without optimizer post-validation: the model times the post-validated steps back to back, with no wait for the
# checks. A clipping threshold these steps never reach: at the main job's 1.0 the norm is above it for the first
# ~20 steps, and post-validation steps synchronously after every clipped step (and redoes a clipped eager one).
P4 = ("parallel.tp=1", "parallel.pp=4", "parallel.vpp=1", "parallel.dp=1", "parallel.micro_batch_size=2",
      "model.tie_embeddings=false", "optim.grad_clip=1000")
MAIN_JOBS = {"main job": ((), 8), "main job, p4 1f1b": ((*P4, "parallel.schedule=1f1b"), 4),
             "main job, p4 zb_h1": ((*P4, "parallel.schedule=zb_h1"), 4),
             "main job, p4 zb_h2": ((*P4, "parallel.schedule=zb_h2"), 4),
             "main job, p4 zb_h2 post-validated": ((*P4, "parallel.schedule=zb_h2", "optim.post_validate=true"), 4)}


def load(what: str) -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) {what}"


def cluster_of(figures: dict, **over) -> ClusterConfig:
    base = OmegaConf.to_container(OmegaConf.load(CLUSTER_FILE))
    return ClusterConfig(**{**base, **{k: figures[k] for k in FIGURES if k in figures}, **over})


def predict_bench(figures: dict) -> dict[str, dict]:
    """plan() of every part (b) layout; the bench times no Lightning loop, so cpu_loop_us = 0."""
    out = {}
    for label, tp, pp, vpp, dp, schedule in [SINGLE, *bench.LAYOUTS]:
        cfg = bench.make_cfg(BENCH_MODEL, tp, pp, vpp, dp, schedule, MICRO, GLOBAL)
        cfg = dataclasses.replace(cfg, cluster=cluster_of(figures, cpu_loop_us=0.0))
        out[label] = plan(cfg)
    return out


def predict_main(figures: dict, layout: tuple[str, ...] = (), world_size: int = 8) -> dict:
    from hydra import compose, initialize_config_dir

    overrides = [*MAIN_STEPS, *layout, *(f"++cluster.{k}={figures[k]}" for k in FIGURES if k in figures)]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        raw = compose(config_name="config", overrides=overrides)
    return plan(load_checked(raw, world_size=world_size))  # the tokenizer's vocabulary, as the run resolves it


def measure_bench() -> dict[str, dict]:
    """overhead_bench part (b): every layout of one world size in one process group."""
    by_world: dict[int, list] = {}
    for lay in bench.LAYOUTS:
        by_world.setdefault(lay[1] * lay[2] * lay[4], []).append(lay)
    results = bench._layout_steps(0, 1, BENCH_MODEL, [SINGLE], MICRO, GLOBAL, STEPS, WARMUP)
    for world, lays in by_world.items():
        results.update(bench.run_distributed(bench._layout_steps, world, BENCH_MODEL, lays, MICRO, GLOBAL, STEPS,
                                             WARMUP, timeout=900)[0])
    return results


def measure_main(layout: tuple[str, ...] = ()) -> tuple[float, list[float]]:
    """`python -m mlplat.train` (its defaults, with `layout`'s overrides) for 30 steps: median step_time_s of steps
    5-30."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "mlplat.train", *MAIN_STEPS, *layout, f"hydra.run.dir={tmp}"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        with open(Path(tmp) / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
    times = [float(r["step_time_s"]) for r in rows if r.get("step_time_s") and 5 <= int(r["step"]) <= 30]
    return statistics.median(times), times


def breakdown(pl: dict) -> str:
    tb = pl["time_breakdown_seconds"]
    after = pl["predicted_seconds_per_iteration"] - tb["pipeline"]
    return (f"the last rank computes {tb['rank_compute'] * 1e3:.0f} ms and waits in tensor-parallel all-reduces "
            f"{tb['rank_messages'] * 1e3:.0f} ms; pipeline {tb['pipeline'] * 1e3:.0f} ms (bubble "
            f"{pl['bubble_fraction']:.2f}), after the flush {after * 1e3:.0f} ms")


def reason(pl: dict, ratio: float) -> str:
    """Where the predicted time went, for a layout off by more than 25% (results.md analyses it)."""
    share = pl["time_breakdown_seconds"]["rank_messages"] / pl["predicted_seconds_per_iteration"]
    return (f"ran {'slower' if ratio < 1 else 'faster'} than modelled; {share:.0%} of the prediction is "
            f"tensor-parallel all-reduces, {pl['layout']['gpus']} processes on {usable_cores()} cores (see below)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-calibrate", action="store_true", help="use the figures in conf/cluster/local_cpu.yaml")
    ap.add_argument("--write-cluster", action="store_true", help="write the fresh figures to local_cpu.yaml")
    ap.add_argument("--out", default=str(HERE / "results.md"), help="markdown file to write ('' = none)")
    args = ap.parse_args(argv)
    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    started = time.perf_counter()
    emit(f"Start: {load('before calibrating')}, {usable_cores()} cores.")
    emit()
    if args.no_calibrate:
        figures = OmegaConf.to_container(OmegaConf.load(CLUSTER_FILE))
        emit(f"Figures: {CLUSTER_FILE.relative_to(REPO)} as committed.")
    else:
        emit("### Calibration (micro-benchmarks)")
        emit()
        emit("```")
        figures = calibrate(log=emit)
        emit("```")
        if args.write_cluster:
            CLUSTER_FILE.write_text(cluster_yaml(figures))
            emit(f"Written to {CLUSTER_FILE.relative_to(REPO)}.")
    emit()
    emit("Figures: " + ", ".join(f"{k}={figures[k]:.4g}" for k in FIGURES if k in figures))
    emit()

    # Predictions first, from the figures alone.
    predicted = predict_bench(figures)
    for label, (layout, world) in MAIN_JOBS.items():
        predicted[label] = predict_main(figures, layout, world)
    for label, pl in predicted.items():
        emit(f"- predicted {label}: {pl['predicted_seconds_per_iteration']:.3f} s/step; {breakdown(pl)}")
    emit()

    emit(f"Measuring: {load('before the layouts')}.")
    t0 = time.perf_counter()
    measured = {label: r["wall"] for label, r in measure_bench().items()}
    emit(f"Part (b) layouts measured in {time.perf_counter() - t0:.0f} s; {load('after them')}.")
    for label, (layout, _) in MAIN_JOBS.items():
        t0 = time.perf_counter()
        measured[label], main_times = measure_main(layout)
        emit(f"{label[0].upper() + label[1:]} measured in {time.perf_counter() - t0:.0f} s (steps 5-30: "
             f"{min(main_times):.3f} to {max(main_times):.3f} s); {load('after it')}.")
    emit()

    emit("| layout | processes | predicted s/step | measured s/step | predicted / measured | reason if off by >25% |")
    emit("|---|---|---|---|---|---|")
    ratios = {}
    for label, pl in predicted.items():
        pred, meas = pl["predicted_seconds_per_iteration"], measured[label]
        ratios[label] = pred / meas
        off = abs(ratios[label] - 1) > 0.25  # the prediction misses the measurement by more than 25% of it
        why = reason(pl, ratios[label]) if off else ""
        emit(f"| {label} | {pl['layout']['gpus']} | {pred:.3f} | {meas:.3f} | {ratios[label]:.2f} | {why} |")
    worst = max(ratios, key=lambda k: abs(ratios[k] - 1))
    within = sum(1 for r in ratios.values() if abs(r - 1) <= 0.25)
    emit()
    emit(f"Worst ratio: {ratios[worst]:.2f} ({worst}); {within} of {len(ratios)} within 25%. "
         f"Total {time.perf_counter() - started:.0f} s; {load('at the end')}.")
    if args.out:
        flags = " ".join(sys.argv[1:]) if argv is None else " ".join(argv)
        header = ["# Cost model check: predicted vs measured step times on this CPU box", "",
                  f"Written by `python experiments/cost_model_check/run.py{' ' + flags if flags else ''}` on "
                  f"{time.strftime('%Y-%m-%d %H:%M')} (torch {torch.__version__}). See README.md in this folder.", ""]
        notes = (HERE / "notes.md").read_text() if (HERE / "notes.md").exists() else ""
        Path(args.out).write_text("\n".join(header + lines) + "\n" + notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
