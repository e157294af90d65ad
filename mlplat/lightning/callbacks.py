"""Callbacks: throughput and MFU, the per-step metrics.csv every run writes, the run summary and the text sample
printed at the end."""
from __future__ import annotations

import contextlib
import csv
import io
import logging
import os
import statistics
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from mlplat.config import RunConfig, SampleConfig
from mlplat.data.tokenizer import load_tokenizer
from mlplat.errors import RunFileError, os_error
from mlplat.lightning.console import print_and_file
from mlplat.lightning.pictures import PICTURES, draw_pictures
from mlplat.model.moe_step import LAYER_LOAD, moe_load_columns
from mlplat.model.mtp_step import mtp_loss_columns
from mlplat.parallel.grid import dist_ready
from mlplat.parallel.layout.dims import coords_label
from mlplat.parallel.layout.pipeline import layer_runs
from mlplat.parallel.profile import CATEGORIES
from mlplat.parallel.straggler import FIGURES, Detector, StepClock, describe, exchange
from mlplat.precision import fp8_gemm_path, precision_of
from mlplat.step.decode import generate

STRAGGLER_COLUMNS = ("straggler_slowdown", "straggler_rank")

log = logging.getLogger("mlplat")

METRIC_COLUMNS = ("step", "train_loss", "val_loss", "grad_norm", "lr", "step_time_s", "tokens_per_s",
                  "tflops_per_device", "mfu", "loss_scale", "skipped_steps", "redone_steps", "moe_aux_loss",
                  "qk_clipped_heads",
                  "moe_load_min", "moe_load_max", "moe_dropped",  # per MoE layer too, after these (moe_load_columns)
                  *(f"time_{c}_s" for c in CATEGORIES),  # profiled steps: where the step time went
                  *STRAGGLER_COLUMNS)  # the straggler check's steps


PROFILE_COLUMNS = frozenset(f"time_{c}_s" for c in CATEGORIES)  # written on profiled rows only


def metric_columns(trainer, pl_module) -> list[str]:
    """The metrics.csv columns this run can fill, decided at its start: `mfu` where the Throughput callback knows
    the device's peak, `loss_scale` under a loss scaler (fp16), `redone_steps` under optim.post_validate, the
    `time_*_s` columns with `profile.steps`, `val_loss` unless validation is off (trainer.limit_val_batches=0),
    `moe_aux_loss` and the expert load figures with MoE layers (model.moe.num_experts > 0; `moe_load_columns`:
    min/max shares over the layers, then per layer, the dropped fractions under capacity), the per-layer ones last,
    then each depth's loss with multi-token prediction (`mtp_loss/depth<k>`, model.mtp.depth > 0; and its validation
    loss `val_mtp_loss/depth<k>` unless validation is off), `qk_clipped_heads` under optim.muon.qk_clip.
    `skipped_steps` is always there: any run can skip a step (an inf/NaN loss or norm)."""
    step = getattr(pl_module, "step", None)
    callbacks = getattr(trainer, "callbacks", ())
    absent = set()
    if not any(getattr(c, "peak", None) for c in callbacks if isinstance(c, Throughput)):
        absent.add("mfu")
    if getattr(step, "loss_scaler", None) is None:
        absent.add("loss_scale")
    if step is None or not step.cfg.optim.post_validate:
        absent.add("redone_steps")
    muon = getattr(getattr(getattr(step, "cfg", None), "optim", None), "muon", None)
    if getattr(muon, "qk_clip", None) is None:  # set only with optim.name=muon (the config refuses it elsewhere)
        absent.add("qk_clipped_heads")
    model = getattr(getattr(step, "cfg", None), "model", None)  # the whole model's: rank 0 may hold no experts
    load = moe_load_columns(model) if model is not None else []
    if not load:
        absent.add("moe_aux_loss")
    absent |= set(LAYER_LOAD) - set(load)  # moe_dropped: under capacity only
    if not any(getattr(c, "requested", False) for c in callbacks):  # the Profiler, asked for steps to profile
        absent |= PROFILE_COLUMNS
    if getattr(trainer, "limit_val_batches", 1) == 0:
        absent.add("val_loss")
    if not any(isinstance(c, StragglerCheck) for c in callbacks):
        absent |= set(STRAGGLER_COLUMNS)
    mtp = mtp_loss_columns(model) if model is not None else []
    mtp += [f"val_{c}" for c in mtp if "val_loss" not in absent]
    return [*(c for c in METRIC_COLUMNS if c not in absent), *(c for c in load if c not in METRIC_COLUMNS), *mtp]


def step_figures(trainer) -> dict[str, float]:
    """This step's time, tokens/s, TFLOP/s and MFU from the Throughput callback; {} for a step it did not time."""
    for callback in getattr(trainer, "callbacks", ()):
        if isinstance(callback, Throughput):
            return callback.current
    return {}


def profiled_breakdown(trainer, step: int) -> dict[str, float] | None:
    """The profiler's breakdown of optimizer step `step` (category -> seconds, rank 0's), None if it was not
    profiled: read from the callback that keeps one per profiled step (`breakdown`, mlplat.lightning.profiling)."""
    for callback in getattr(trainer, "callbacks", ()):
        breakdown = getattr(callback, "breakdown", None)
        if isinstance(breakdown, dict) and step in breakdown:
            return breakdown[step]
    return None


def _digits(value) -> str:
    """Every digit the value carries: float64 in full (64-true runs are compared to ~1e-12), float32 to the 9
    significant digits that round-trip it (no spurious tail like 0.0006000000284984708); a count as an integer."""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, torch.Tensor) and value.dtype not in (torch.float64, torch.int64):
        return f"{float(value):.9g}"
    return repr(float(value))


class Throughput(pl.Callback):
    """step_time_s, tokens_per_s, tflops_per_device (model FLOPs: the paper's 72·B·s·l·h²(…) count, no recomputation)
    and mfu against the device's dense peak for the run's precision (none where no real peak is known, e.g. on the
    CPU), from the wall time between consecutive optimizer steps; validation time is not counted. Must come
    before MetricsCSV in the callback list (it reads what this keeps)."""

    def __init__(self, cfg: RunConfig, world_size: int):
        from mlplat.perf import devices, flops

        self.tokens_per_step = cfg.parallel.global_batch_size * cfg.model.seq_len
        self.dims, self.world_size, self.tp = flops.ModelDims.of(cfg.model), world_size, cfg.parallel.tp
        try:  # an unknown GPU, or a nominal entry (the CPU): no real peak, so no MFU rather than a made-up one
            device = devices.current_device()
            self.peak = None if device.nominal else devices.peak_flops(device, str(cfg.trainer.precision))
        except ValueError:
            self.peak = None
        # The clock reading that ended the last step (or the validation after it): the Profiler reads the same
        # readings, so its breakdown splits exactly the step_time_s logged here.
        self.step_end: float | None = None
        # This step's figures, {} for the first step (no start time): what metrics.csv and the summary read.
        self.current: dict[str, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from mlplat.perf import flops

        now = time.perf_counter()
        self.current = {}
        if self.step_end is not None:
            step_time = now - self.step_end
            tokens_per_s = self.tokens_per_step / step_time
            tflops = flops.model_tflops_per_gpu(tokens_per_s, self.world_size, self.dims, self.tp)
            self.current = {"step_time_s": step_time, "tokens_per_s": tokens_per_s, "tflops_per_device": tflops}
            if self.peak:
                self.current["mfu"] = tflops * 1e12 / self.peak
            for name, value in self.current.items():
                pl_module.log(name, torch.tensor(value), prog_bar=name == "tokens_per_s", on_step=True,
                              rank_zero_only=True)
        self.step_end = now

    def on_validation_end(self, trainer, pl_module) -> None:
        self.step_end = time.perf_counter()  # the next step is timed from here: validation is not a step's time


class StragglerCheck(pl.Callback):
    """`straggler.every_steps=N`: every N-th step is timed on every rank (`StepClock` on the hang watch's blocks),
    the ranks exchange their [work, bubble, comm] seconds in one all-gather of a device tensor, and the ranks
    slower than their pipeline stage's median by more than `straggler.threshold` at two checks in a row are named by
    rank 0, one line each (mlplat.parallel.straggler). A checked step logs `straggler_slowdown` (the largest, named
    or not) and, when one is named, `straggler_rank` (the slowest named). Before MetricsCSV (it reads `checked`)."""

    def __init__(self, every_steps: int, threshold: float):
        self.every, self.threshold = every_steps, threshold
        self.checked: dict[int, dict[str, float]] = {}  # the last checked step -> its logged figures
        self.hosts: list[str] = []
        self.detector: Detector | None = None
        self._clock: StepClock | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        import socket

        import torch.distributed as dist

        grid = pl_module.step.grid
        self.detector = Detector([grid.coords(r)[1] for r in range(grid.world_size)], self.threshold)  # stages
        if grid.pp == grid.world_size and trainer.is_global_zero:  # no rank has a peer to be compared with
            log.warning("straggler.every_steps=%d: each pipeline stage holds one rank (t·c·d=1), so no rank has a "
                        "peer in its stage to be compared with: no straggler can be named and its columns stay "
                        "empty", self.every)
        self.hosts = [socket.gethostname()]
        if grid.world_size > 1 and dist_ready():  # once per run, for the lines that name a rank's host
            self.hosts = [""] * grid.world_size
            dist.all_gather_object(self.hosts, socket.gethostname(), group=grid.io_group)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if (trainer.global_step + 1) % self.every == 0:
            self._clock = pl_module.step.watch.clock = StepClock(pl_module.step.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._clock is None:
            return
        step, grid = pl_module.step, pl_module.step.grid
        figures, step.watch.clock, self._clock = self._clock.figures(), None, None
        if grid.world_size > 1:
            table = exchange(figures, grid.io_group, grid.world_size, step.device).tolist()
        else:
            table = [figures]
        named, worst = self.detector.check([row[FIGURES.index("work")] for row in table])
        logged = {} if worst is None else {"straggler_slowdown": worst.slowdown}
        if named:
            logged["straggler_rank"] = named[0].rank
        self.checked = {trainer.global_step: logged}  # read by MetricsCSV at this step's end
        for name, value in logged.items():
            pl_module.log(name, torch.tensor(float(value)), on_step=True, rank_zero_only=True)
        if trainer.is_global_zero:
            for s in named:
                t, p, d, c = grid.coords(s.rank)
                where = coords_label(t, p, d, c if grid.cp > 1 else None)
                log.warning(describe(s, where, self.hosts[s.rank], trainer.global_step, table[s.rank]))


def straggler_figures(trainer, step: int) -> dict[str, float]:
    """The straggler check's figures of optimizer step `step` ({} for a step it did not check)."""
    for callback in getattr(trainer, "callbacks", ()):
        if isinstance(callback, StragglerCheck):
            return callback.checked.get(step, {})
    return {}


class ValidateLast(pl.Callback):
    """Validation after the last step when trainer.val_check_interval did not fall on it: every run ends with a
    val_loss of its final weights (a run shorter than the interval would otherwise never validate). Lightning
    validates a step's end when the fit is asked to stop there (`should_stop`); it stops at max_steps anyway."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        every = trainer.val_check_batch
        if (trainer.global_step >= trainer.max_steps > 0 and trainer.limit_val_batches != 0
                and every not in (None, float("inf")) and trainer.global_step % every != 0):
            trainer.should_stop = True


class MetricsCSV(pl.Callback):
    """DIR/metrics.csv: one row per optimizer step, whatever the logger (written by global rank 0).

    A step's row is written once the next step starts (or training ends), so that a validation run right
    after the step can add its val_loss to the same row. The step's own figures (RECORD_METRICS: loss, norm,
    learning rate, loss scaling, redone steps) come from its record (`TrainStep.records`), filled in then: a step
    stepped before its checks (post-validation) is settled during the next step, before that step ends.

    The `time_<category>_s` columns belong to the profiled steps only: they are read from the profiler's own
    breakdown of this step (`Profiler.breakdown[step]`), not from Lightning's `callback_metrics`, which keep a
    metric's last value, so that the rows after the profiled window would repeat the last profiled step's."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd: int | None = None  # metrics.csv, opened for appending whole rows (`_append`)
        self._columns: list[str] = []
        self._pending: dict | None = None
        self._module = None  # the LightningModule, whose records hold each step's own figures

    @rank_zero_only
    def on_train_start(self, trainer, pl_module) -> None:
        self._module = pl_module
        self._every, self._total = max(1, trainer.log_every_n_steps), trainer.max_steps
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[dict] = []
        order = metric_columns(trainer, pl_module)
        columns = set(order)
        resumed_in_place = self.path.exists()
        if resumed_in_place:
            # A resumed run keeps the rows up to its checkpoint's step, and the columns the run it continues wrote
            # (that run may have been profiled, this one not). The later rows are another lineage's (a branch from an
            # earlier step) or were written after that save before the job died (replayed now): either way this
            # file keeps one row per step of one lineage, and they move to a file of their own.
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                rows = [r for r in reader if r.get("step")]
                columns |= set(reader.fieldnames or ())
            kept = [r for r in rows if int(r["step"]) <= trainer.global_step]
            later = [r for r in rows if int(r["step"]) > trainer.global_step]
            if later:
                aside = self._set_aside(later, list(reader.fieldnames or ()))
                log.warning("%s: the rows of steps %s-%s, past step %d where this run resumes, moved to %s",
                            self.path, later[0]["step"], later[-1]["step"], trainer.global_step, aside)
        known = [*METRIC_COLUMNS, *(c for c in order if c not in METRIC_COLUMNS)]
        self._columns = [c for c in known if c in columns]
        restored, self._pending = self._pending, None
        # The checkpoint's own step, saved before its row was written (only when continuing this run's file).
        if resumed_in_place and restored is not None and all(int(r["step"]) != int(restored["step"]) for r in kept):
            kept.append(restored)
        # Rewritten aside, then renamed over it: a disk that fills now leaves the old file whole.
        tmp = self.path.with_name(self.path.name + ".tmp")
        self._write_new(tmp, self._csv(kept, header=True))
        os.replace(tmp, self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def _csv(self, rows: list[dict], header: bool = False, columns: list[str] | None = None) -> bytes:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=columns or self._columns, extrasaction="ignore")
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return out.getvalue().encode()

    def _set_aside(self, rows: list[dict], columns: list[str]) -> Path:
        from mlplat.checkpoint.io import aside_path  # (the checkpoint machinery, only when rows move aside)

        aside = aside_path(lambda stamp: self.path.with_name(f"{self.path.stem}.abandoned-{stamp}{self.path.suffix}"))
        self._write_new(aside, self._csv(rows, header=True, columns=columns))
        return aside

    def _write_new(self, path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_whole(fd, data, path, 0)
        except RunFileError:
            path.unlink(missing_ok=True)  # a new file: its rows are still where they came from
            raise
        finally:
            os.close(fd)

    def _append(self, row: dict) -> None:
        """One row in one write (a loop only if the system takes part of it), flushed at once; a failed write (a full
        disk) is cut back off, so the file ends with a whole row, and stops the run in one line."""
        _write_whole(self._fd, self._csv([row]), self.path, os.fstat(self._fd).st_size, step=row.get("step"))

    def state_dict(self) -> dict:
        # Saved with each checkpoint: the row of the step being checkpointed is still pending (it waits for a
        # possible val_loss), so a job that dies right after the save must not lose it. A checkpoint settles its step
        # first (PTDPStrategy.lightning_module_state_dict), so the step's record is there.
        self._complete()
        return {"pending": self._pending}

    def _complete(self) -> None:
        """The pending row's own figures from its step's record, once the step is settled."""
        records = getattr(self._module, "records", {})
        if self._pending is not None and int(self._pending["step"]) in records:
            record = records[int(self._pending["step"])]
            # A record leaves skipped_steps out until one is skipped (the loggers get no series of zeros); a row says 0.
            self._pending.update({"skipped_steps": _digits(0), **{k: _digits(v) for k, v in record.metrics().items()}})

    def load_state_dict(self, state: dict) -> None:
        self._pending = state.get("pending")

    def _flush(self) -> None:
        self._complete()
        if self._fd is not None and self._pending is not None:
            self._append(self._pending)
            step = int(self._pending["step"])
            if step % self._every == 0 or step == self._total:
                log.info(step_line(self._pending, self._total))
        self._pending = None

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._fd is None:
            return
        self._flush()
        row = {"step": trainer.global_step}
        row.update({k: _digits(v) for k, v in step_figures(trainer).items()})
        parts = profiled_breakdown(trainer, trainer.global_step)
        if parts is not None:
            row.update({f"time_{c}_s": _digits(parts[c]) for c in CATEGORIES if c in parts})
        row.update({k: _digits(v) for k, v in straggler_figures(trainer, trainer.global_step).items()})
        self._pending = row

    @rank_zero_only
    def on_validation_end(self, trainer, pl_module) -> None:
        if self._pending is not None and not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            self._pending.update({k: _digits(v) for k, v in trainer.callback_metrics.items()
                                  if k == "val_loss" or k.startswith("val_mtp_loss/")})

    @rank_zero_only
    def on_train_end(self, trainer, pl_module) -> None:
        self._flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            # Drawn from the rows of every step this run directory holds, a resumed run's earlier ones too
            draw_pictures(self.path)


def _write_whole(fd: int, data: bytes, path: Path, size: int, step=None, write=os.write) -> None:
    """`data` appended to the file `fd` (of `size` bytes) whole, or the file cut back to `size` and RunFileError:
    the operating system may take part of a write on a filling disk, and a half row would end the file."""
    try:
        done = 0
        while done < len(data):
            done += write(fd, data[done:])
    except OSError as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        what = f"step {step}'s row" if step is not None else "its rows"
        raise RunFileError(f"{path}: {os_error(e)} writing {what}: training stopped (the file ends with the last "
                           f"whole row)") from None


# metrics.csv's columns in a step's line, as (column, how the line shows its value); empty cells are left out.
STEP_LINE = (("train_loss", "loss {:.4f}".format), ("val_loss", "val loss {:.4f}".format), ("lr", "lr {:.2e}".format),
             ("moe_aux_loss", "moe aux {:.4f}".format), ("moe_load_max", "expert load max {:.2f}".format),
             ("moe_dropped", "dropped {:.1%}".format), ("mtp_loss/depth1", "mtp loss {:.4f}".format),
             ("grad_norm", "grad norm {:.3g}".format), ("step_time_s", lambda s: f"{s * 1e3:,.0f} ms"),
             ("tokens_per_s", "{:,.0f} tokens/s".format),
             ("skipped_steps", lambda n: f"skipped {n:.0f}" if n else ""),
             ("redone_steps", lambda n: f"redone {n:.0f}" if n else ""),
             ("qk_clipped_heads", lambda n: f"qk-clipped heads {n:.0f}" if n else ""))


def step_line(row: dict, total: int) -> str:
    """One metrics.csv row as the console's and train.log's line for its step (every trainer.log_every_n_steps
    steps and the last): `step 12/120 | loss 3.8355 | lr 1.56e-03 | grad norm 2.11 | 530 ms | 7,736 tokens/s`."""
    shown = (show(float(row[key])) for key, show in STEP_LINE if row.get(key) not in (None, ""))
    return " | ".join([f"step {row['step']}/{total}", *(part for part in shown if part)])


class RunSummary(pl.Callback):
    """At the end of training, rank 0 prints what a newcomer wants to know about the run, in a few lines: the
    layout, the steps this run ran (a resumed run's from the step it resumed, with the steps post-validation redid
    and the steps skipped), the loss curve's start and end, the throughput, and where one step's time went (the
    profiler's breakdown: the steps of `profile.steps`, or the one step it records for this summary). Before the
    sample."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path | None = None):
        self.cfg, self.run_dir = cfg, None if run_dir is None else Path(run_dir)
        self.train: dict[int, float] = {}
        self.val: dict[int, float] = {}
        self.tokens_per_s: list[float] = []
        self.start = self.first_step_start = None  # the clock at the current step's start, at the first step's
        self.steps_run = 0  # steps this process ran (a resumed run's only)
        self.first_step = 0  # the step this run started from: a resumed run's checkpoint's
        self.counted_before = {"redone_steps": 0, "skipped_steps": 0}  # counts restored from that checkpoint
        self.counts = dict(self.counted_before)  # the counts so far, as the latest settled step's record says
        self.load: tuple[int, dict] | None = None  # the latest settled step's expert load figures (MoE layers)
        self.mtp: dict[int, dict[str, float]] = {}  # each step's depths' losses (multi-token prediction)
        self.text: str | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.first_step = trainer.global_step
        self.counted_before = {k: getattr(pl_module.step, k, 0) for k in self.counted_before}
        self.counts = dict(self.counted_before)

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._read_records(pl_module)
        if self.first_step_start is None:
            self.first_step_start = self.start
        figures = step_figures(trainer)
        if "tokens_per_s" in figures:
            self.tokens_per_s.append(figures["tokens_per_s"])
        self.steps_run += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = time.perf_counter()

    def _read_records(self, pl_module) -> None:
        """The train loss of every step settled since (a step's record can come a step later: post-validation)."""
        for step, record in getattr(pl_module, "records", {}).items():
            if step > self.first_step:
                self.train[step] = float(record.loss)
                self.counts = {k: getattr(record, k) or 0 for k in self.counts}
                if record.moe_load and (self.load is None or step >= self.load[0]):
                    self.load = (step, record.moe_load)
                if record.mtp_loss:
                    self.mtp[step] = {k: float(v) for k, v in record.mtp_loss.items()}

    @rank_zero_only
    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            self.val[trainer.global_step] = float(trainer.callback_metrics["val_loss"])

    def on_train_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        self._read_records(pl_module)  # the last step's, settled at the end of the epoch
        p = self.cfg.parallel
        cp = f" c={p.cp}" if p.cp > 1 else ""
        dims, experts = self.cfg.dims, self.cfg.model.moe.num_experts
        # the experts' own layout of each stage's ranks
        ep = f" ep={dims.ep} etp={dims.expert_tp} edp={dims.edp} ({experts // dims.ep} experts per rank)" \
            if experts else ""
        lines = [f"layout      t={p.tp}{cp} p={p.pp} v={p.vpp} d={p.dp}{ep}, "
                 f"{p.schedule if p.pp > 1 else 'no pipeline'}, "
                 f"{p.world_size} {pl_module.step.device.type} process{'es' if p.world_size > 1 else ''}, "
                 f"m={p.num_micro_batches} micro-batches of {p.micro_batch_size} x {self.cfg.model.seq_len} tokens"
                 + (f", layers per chunk {layer_runs(p.pipeline.chunk_layers(self.cfg.model.n_layers))}"
                    if p.pipeline.uneven else "") + f", {self._precision_words(pl_module.step.device.type)}",
                 self._steps_line(trainer)]
        for name, curve in (("train loss", self.train), ("val loss", self.val)):
            if curve:
                first, last = min(curve), max(curve)
                trend = f" -> {curve[last]:.3f} (step {last})" if last != first else ""
                lines.append(f"{name:<11} {curve[first]:.3f} (step {first}){trend}")
        if self.mtp:
            lines.append(mtp_loss_line(self.mtp))
        if self.tokens_per_s:
            rate = statistics.median(self.tokens_per_s)
            tokens = p.global_batch_size * self.cfg.model.seq_len
            wall = time.perf_counter() - self.first_step_start
            lines.append(f"throughput  {rate:,.0f} tokens/s, the median timed step ({tokens / rate:.3f} s); "
                         f"{tokens * self.steps_run / wall:,.0f} tokens/s over the run's {self.steps_run} steps "
                         f"({wall:.1f} s, validation included)")
        parts = _breakdown_for_summary(trainer)
        if parts is not None:
            step, seconds = parts
            total = sum(seconds.values()) or 1.0
            shares = ", ".join(f"{c} {seconds[c] / total:.0%}" for c in sorted(seconds, key=lambda c: -seconds[c])
                               if seconds[c] / total >= 0.005)
            lines.append(f"step {step:<6} {total:.3f} s on rank 0: {shares}")
        if self.load is not None:
            lines += expert_load_lines(*self.load)
        if self.run_dir is not None:
            lines.append(self._files_line())
        self.text = "\n".join(lines)
        print_and_file(f"\n--- run summary ---\n{self.text}")

    def _precision_words(self, device_type: str) -> str:
        """trainer.precision, and kernels.fp8's recipe with the path its products take on this device."""
        fp8, precision = self.cfg.kernels.fp8, self.cfg.trainer.precision
        path = fp8_gemm_path(fp8, device_type, precision_of(precision).compute_dtype)
        return f"{precision}" + (f", FP8 GEMMs ({fp8}, {path})" if fp8 != "none" else "")

    def _files_line(self) -> str:
        """What the run left in its directory for a reader: the per-step metrics, the expert-load picture, the
        checkpoints, the log."""
        d = self.run_dir
        files = ["metrics.csv (a row per step)"]
        files += [f"{name} ({what})" for name, what in PICTURES.items() if (d / name).exists()]
        if (d / "checkpoints").is_dir():
            files.append("checkpoints/")
        files.append("train.log")
        return f"{'files':<11} in {d}: " + ", ".join(files)

    def _steps_line(self, trainer) -> str:
        """`steps       61-120, resumed from step 60, 3 redone (post-validation: ...), 1 skipped (...)`: the steps this
        run ran, and of them the steps post-validation redid (under optim.post_validate) and those skipped (if any)."""
        first, last = self.first_step, trainer.global_step
        ran = f"{first + 1}-{last}" if last > first + 1 else str(last) if last > first else "none"
        parts = [ran + (f", resumed from step {first}" if first else "")]
        redone, skipped = (self.counts[k] - self.counted_before[k] for k in ("redone_steps", "skipped_steps"))
        if self.cfg.optim.post_validate:
            parts.append(f"{redone} redone (post-validation: stepped before their checks, then undone or redone)")
        if skipped:
            parts.append(f"{skipped} skipped (an inf/NaN loss or gradient norm)")
        return f"{'steps':<11} " + ", ".join(parts)


def mtp_loss_line(losses: dict[int, dict[str, float]]) -> str:
    """The run summary's multi-token prediction losses: each depth's at the first and the last step it has."""
    first, last = min(losses), max(losses)

    def one(name: str) -> str:
        trend = f" -> {losses[last][name]:.3f}" if last != first else ""
        return f"depth {name.split('depth')[1]} {losses[first][name]:.3f}{trend}"
    steps = f"(step {first}{f' -> {last}' if last != first else ''})"
    return f"{'mtp loss':<11} " + ", ".join(one(name) for name in losses[first]) + f" {steps}"


def expert_load_lines(step: int, figures: dict) -> list[str]:
    """The run summary's expert load (`moe_load_metrics` of step `step`): per MoE layer, its least and most loaded
    experts' kept assignments as a share of the mean over the experts, and the share dropped under capacity."""
    layers = [name.split("/layer")[1] for name in figures if name.startswith("moe_load_max/")]
    dropped = "moe_dropped" in figures

    def one(i: str) -> str:
        low, high = (float(figures[f"{name}/layer{i}"]) for name in ("moe_load_min", "moe_load_max"))
        return f"layer {i} {low:.2f}-{high:.2f}" + (f" ({float(figures[f'moe_dropped/layer{i}']):.1%} dropped)"
                                                     if dropped else "")

    rows = [", ".join(one(i) for i in layers[k:k + 6]) for k in range(0, len(layers), 6)]
    return [f"{'expert load':<11} step {step}, the least and the most loaded expert's tokens over the mean "
            f"(1 = balanced):", *(f"{'':<11} {row}" for row in rows)]


def _breakdown_for_summary(trainer) -> tuple[str, dict[str, float]] | None:
    """(which step(s), category -> seconds) from the profiler: the mean of the profiled steps, or its summary step."""
    for callback in getattr(trainer, "callbacks", ()):
        steps = getattr(callback, "breakdown", None) or getattr(callback, "summary", None)
        if isinstance(steps, dict) and steps:
            keys = sorted(steps)
            label = str(keys[0]) if len(keys) == 1 else f"{keys[0]}-{keys[-1]}"
            return label, {c: sum(steps[k][c] for k in keys) / len(keys) for c in steps[keys[0]]}
    return None


class SampleText(pl.Callback):
    """Text from a prompt at the end of training (`sample.*`, in the data's tokenizer); all ranks take part,
    rank 0 prints it."""

    def __init__(self, sample: SampleConfig, tokenizer: str, seed: int):
        self.sample, self.tokenizer = sample, tokenizer
        self.seed = sample.seed if sample.seed is not None else seed
        self.text: str | None = None

    def on_train_end(self, trainer, pl_module) -> None:
        s = self.sample
        if s.max_new_tokens <= 0:
            return
        tok = load_tokenizer(self.tokenizer)
        ids = generate(pl_module.step, tok.encode(s.prompt), s.max_new_tokens, s.temperature, s.top_k, s.top_p,
                       self.seed)
        self.text = tok.decode(ids)
        if trainer.is_global_zero:
            print_and_file(f"\n--- sample ---\n{self.text}\n--------------")
