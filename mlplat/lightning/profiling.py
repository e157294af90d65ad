"""`profile.steps=[FROM,TO]`: record where the time of those optimizer steps goes, on every rank.

During a profiled step the module's step labels (`HangWatch`), every collective and every recomputation are
recorded as spans (`mlplat.parallel.profile`); the time since the previous step ended and before this one starts
is "data" (the batch fetch and Lightning's loop), and the time from the step's last span to its end is "loop"
(Lightning's work after the training step, the hooks before this one). A step's window is Throughput's: the
same two clock readings that give its step_time_s. Each profiled step logs its breakdown (`time_<category>_s`,
rank 0's) beside `step_time_s`; after step TO every rank writes DIR/profile/rank-K.json and rank 0 turns them into
trace.json, timeline.png and report.md (`mlplat.perf.profile_report`). `profile.torch=true` also runs
torch.profiler over the same steps (DIR/profile/torch/rank-K.json).

Without `profile.steps`, one step is still recorded for the run summary (`summary_step`: the one before the last),
on every rank alike, and nothing is written or logged for it: no file, no barrier, no `time_*` column.

On a GPU kernels and NCCL calls return before they ran: both ends of every span wait for the compute stream
(`profile.span_sync`: the current stream's synchronize, never `torch.cuda.synchronize`, which would also wait for
the NCCL streams' receives posted ahead and stall the pipeline at pp > 1). The host then cannot run ahead of the
GPU, so a profiled step is slower there than an unprofiled one. The choice of that sync is tested on a CPU
(tests/parallel/test_profile.py); its timings wait for a GPU machine.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist

from mlplat.config import RunConfig
from mlplat.lightning.callbacks import Throughput
from mlplat.parallel.grid import dist_ready
from mlplat.parallel.profile import CATEGORIES, Recorder, exclusive_times, span_sync

log = logging.getLogger("mlplat")


def summary_step(max_steps: int) -> int | None:
    """The step the run summary's breakdown is of when `profile.steps` is not set: the one before the last (past the
    first steps' warm-up, before the last step's end-of-training work); none in a run of fewer than 3 steps."""
    return max_steps - 1 if max_steps >= 3 else None


class Profiler(pl.Callback):
    """Must come right after `clock` in the callback list: their hooks read the same step boundaries."""

    def __init__(self, cfg: RunConfig, run_dir: Path, clock: Throughput):
        self.cfg, self.clock = cfg, clock
        self.requested = cfg.profile.steps is not None  # else: only the summary's step, kept in `summary`
        step = summary_step(cfg.trainer.max_steps)
        self.first, self.last = cfg.profile.steps or ((step, step) if step is not None else (0, -1))
        self.summary: dict[int, dict[str, float]] = {}
        self.folder = Path(run_dir) / "profile"
        self.recorder = Recorder()
        self.steps: list[tuple[int, float, float]] = []
        self.breakdown: dict[int, dict[str, float]] = {}
        self._recording = None
        self._torch = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        step = trainer.global_step + 1
        if not self.first <= step <= self.last:
            return
        if self.cfg.profile.torch and self._torch is None:
            self._torch = torch.profiler.profile(record_shapes=False)
            self._torch.__enter__()
        self._start = self.clock.step_end if self.clock.step_end is not None else now
        self._first_span = len(self.recorder.spans)
        if self.recorder.sync is None:  # a test mode may have set its own
            self.recorder.sync = span_sync(pl_module.step.device)  # the compute stream's wait on a GPU, None on a CPU
        self.recorder.add("data loading, the loop and the profiler", "data", self._start, now)
        pl_module.step.watch.recorder = self.recorder
        self._recording = self.recorder.recording(pl_module.step.grid, pl_module.step.tracker)
        self._recording.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._recording is not None:
            self._recording.__exit__(None, None, None)
            self._recording, pl_module.step.watch.recorder = None, None
            now = self.clock.step_end  # read by Throughput's hook a moment ago: this step's end
            step = trainer.global_step
            ends = [s.end for s in self.recorder.spans[self._first_span:]]
            self.recorder.add("Lightning's loop after the step", "loop", max(ends, default=self._start), now)
            self.steps.append((step, self._start, now))
            parts = exclusive_times(self.recorder.spans, self._start, now)
            if not self.requested:
                self.summary[step] = parts
                self.recorder = Recorder()
                return
            self.breakdown[step] = parts
            for category in CATEGORIES:
                pl_module.log(f"time_{category}_s", torch.tensor(parts[category]), on_step=True, rank_zero_only=True)
            if step == self.last:
                self._write(trainer, pl_module)
        # This hook's own work (the breakdown, its logging, writing the files) is after the step's end reading:
        # the next step's "data" span covers it, as Throughput's next step_time_s does.

    def on_train_end(self, trainer, pl_module) -> None:
        if self.requested and self.steps and self.steps[-1][0] != self.last:  # training ended inside the window
            self._write(trainer, pl_module)

    def _write(self, trainer, pl_module) -> None:
        grid = pl_module.step.grid
        if self._torch is not None:
            self._torch.__exit__(None, None, None)
            (self.folder / "torch").mkdir(parents=True, exist_ok=True)
            self._torch.export_chrome_trace(str(self.folder / "torch" / f"rank-{grid.rank}.json"))
            self._torch = None
        self.folder.mkdir(parents=True, exist_ok=True)
        # [t, p, d], and c with context parallelism: the report draws one rank per pipeline stage from them
        coords = [grid.tp_rank, grid.pp_rank, grid.dp_rank] + ([grid.cp_rank] if grid.cp > 1 else [])
        record = {"rank": grid.rank, "coords": coords,
                  "offset": self._clock_offset(trainer, pl_module), "steps": self.steps,
                  "spans": [[s.name, s.category, s.start, s.end, s.args] for s in self.recorder.spans],
                  "breakdown": {str(k): v for k, v in self.breakdown.items()}}
        (self.folder / f"rank-{grid.rank}.json").write_text(json.dumps(record))
        together = dist_ready()
        if together:
            dist.barrier(group=grid.io_group)  # after file I/O: checkpoint.timeout_s
        if grid.rank == 0:
            from mlplat.perf.profile_report import TRACE_ALL_RANKS, write_profile

            par = self.cfg.parallel
            cp = f" c={par.cp}" if par.cp > 1 else ""
            title = (f"t={par.tp}{cp} p={par.pp} v={par.vpp} d={par.dp}, {par.schedule}, m={par.num_micro_batches}")
            world = dist.get_world_size() if together else 1
            write_profile(self.folder, par.pipeline, par.num_micro_batches, title,
                          None if world <= TRACE_ALL_RANKS else [grid.stage_rank(r) for r in range(grid.pp)])
            steps = f"{self.steps[0][0]}-{self.steps[-1][0]}" if len(self.steps) > 1 else str(self.steps[0][0])
            torch_trace = ", torch/rank-K.json" if self.cfg.profile.torch else ""
            log.info("profile of step%s %s: %s (trace.json for chrome://tracing or Perfetto, timeline.png, report.md"
                     "%s)", "s" if len(self.steps) > 1 else "", steps, self.folder, torch_trace)
        if together:  # the others wait here for rank 0's report, not in the next step's first collective
            dist.barrier(group=grid.io_group)
        self.recorder = Recorder()

    @staticmethod
    def _clock_offset(trainer, pl_module) -> float:
        """Seconds to add to this rank's clock to read rank 0's. One machine: one monotonic clock, no offset.
        Several: each rank reads its clock right after a barrier and takes rank 0's reading as the reference."""
        if trainer.num_nodes == 1 or not dist.is_initialized():
            return 0.0
        # After the torch trace's file I/O: checkpoint.timeout_s.
        io_group = getattr(pl_module.step.grid, "io_group", None)
        dist.barrier(group=io_group)
        mine = torch.tensor([time.perf_counter()], dtype=torch.float64, device=pl_module.step.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine, group=io_group)
        return float(every[0] - mine)
