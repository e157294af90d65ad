"""PTDPStrategy: the Lightning Strategy that carries out tensor × pipeline × data parallelism.

Lightning decides *when* (launch, setup, the loop, logging, checkpoint hooks); mlplat's core decides *how*:
the strategy builds the `ParallelGrid` once the processes exist, the LightningModule builds its model chunks
from it in `configure_model`, and each training step runs the pipeline engine, the data-parallel and tied
gradient reductions and the global clipping. Lightning's own backward is not used (the engine runs backward
inside the schedule), and no DDP wrapper is applied.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from pytorch_lightning.strategies.parallel import ParallelStrategy
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from mlplat.config import ParallelConfig
from mlplat.harness.nccl_strict import install_if_enabled
from mlplat.lightning.console import to_log_files
from mlplat.lightning.launcher import CHILD_ENV, HydraSafeLauncher
from mlplat.lightning.signals import install_early
from mlplat.parallel.communicators import collective_groups
from mlplat.parallel.grid import ParallelGrid, dist_ready
from mlplat.parallel.layout.dims import ParallelDims

log = logging.getLogger("mlplat")
# Set to 1: a process group even for one process, and groups of one rank, so that every collective a step makes
# runs (on one GPU: on NCCL, where a CPU tensor in a collective fails). experiments/gpu_check/run.sh sets it.
SINGLETON_GROUPS_ENV = "MLPLAT_SINGLETON_GROUPS"
TRAIN_STEP_KEY = "train_step"  # the training step's counters and loss scaler, in Lightning's checkpoint dict


class PTDPStrategy(ParallelStrategy):
    strategy_name = "ptdp"

    def __init__(self, parallel: ParallelConfig, timeout: timedelta = timedelta(minutes=5),
                 io_timeout: timedelta | None = None, rank_job: Callable[[], None] | None = None,
                 kv_replicas: int = 1, async_save: bool = False, async_mode: str = "thread", resume: str | None = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.parallel = parallel
        self.rank_job = rank_job  # what the ranks forked from rank 0 run (HydraSafeLauncher); None: the command line
        self.timeout = timeout
        self.io_timeout = io_timeout  # checkpoint.timeout_s: the grid's io_group (collectives after file I/O)
        self.kv_replicas = kv_replicas  # the tp ranks sharing a key/value head: the grid's kv_group
        self.async_save = async_save  # checkpoint.async_save: saves written behind training (io.AsyncSaver)
        self.async_mode = async_mode  # checkpoint.async_mode: DCP's thread or process
        self.saver = None
        self.resume = resume  # the checkpoint this rank resumes (what the Trainer's fit gets), or None
        self.num_nodes = 1
        self.grid: ParallelGrid | None = None

    # -- devices and ranks ---------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        assert self.grid is not None
        return {"num_replicas": self.grid.dp, "rank": self.grid.dp_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally and self.num_processes > 1:
            self._launcher = HydraSafeLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                                               rank_job=self.rank_job)

    def setup_environment(self) -> None:
        super().setup_environment()
        env = self.cluster_environment
        assert env is not None
        env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        env.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        p = self.parallel
        if self.root_device.type == "cpu":
            # One process per core at most: oversubscribed OpenMP threads make gloo ranks wait on each other
            # (a tp2·pp2·dp2 step on 2 cores is ~30x slower with the default thread count).
            # An explicit OMP_NUM_THREADS wins (CI sets 1: on a shared, busy box even 2 threads per process
            # spin against other jobs and run ~10x slower).
            omp = os.environ.get("OMP_NUM_THREADS", "")
            threads, why = ((int(omp), "OMP_NUM_THREADS") if omp.isdigit() and int(omp) > 0
                            else cpu_threads(self.num_processes))
            torch.set_num_threads(threads)
            if self.local_rank == 0 and why:
                log.info("torch threads per process: %d (%s)", threads, why)
        group_timeout = self.timeout
        singletons = os.environ.get(SINGLETON_GROUPS_ENV, "") not in ("", "0")
        if self.world_size > 1 or singletons:
            backend = "nccl" if self.root_device.type == "cuda" else "gloo"
            if backend == "nccl":
                # The hang watch reports a transfer stuck past parallel.timeout_s by its label (hang.py); NCCL's
                # watchdog, which would abort first and name no instruction, waits a minute more, and its flight
                # recorder then dumps what each rank had queued (untested here: no GPU).
                group_timeout = self.timeout + timedelta(seconds=60)
                os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
                os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
                # NCCL (>= 2.22) connects each algorithm and protocol of a communicator at its first use by default:
                # the grid's one-element warm-up then leaves the first full-size collectives to connect inside step
                # 1. Connected at creation instead, every connection is made before step 1 (NCCL's buffers for all
                # of them: the planner's cluster.overhead_gib). Untested here: no GPU.
                os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
            if self.root_device.type == "cuda":
                torch.cuda.set_device(self.root_device)
            # The rendezvous waits generously (ranks start slowly on a busy machine); once joined, a collective
            # or transfer that waits longer than parallel.timeout_s means a peer died, and fails the job.
            store = _rendezvous_store(env.main_address, env.main_port, self.world_size, self.global_rank,
                                      timeout=max(self.timeout, timedelta(minutes=10)))
            # No device_id: with it PyTorch splits every new group's NCCL communicator from the world's at once, a
            # world-wide step per group (and the pipeline has 2 per pair of neighbouring stages). Lazily, only a
            # group's members create its communicator, on its first use.
            dist.init_process_group(backend, store=store, rank=self.global_rank, world_size=self.world_size,
                                    timeout=group_timeout)
        # MLPLAT_NCCL_STRICT=1 (the tests): gloo blocks where NCCL's host does
        self.strict = install_if_enabled() if self.root_device.type == "cpu" else None
        self.grid = ParallelGrid.of(ParallelDims.of(p),  # dp: resolved by mlplat.config.validate
                                    timeout=group_timeout, io_timeout=self.io_timeout, device=self.root_device,
                                    singleton_groups=singletons, kv_replicas=self.kv_replicas,
                                    ep_per_node=p.ep_per_node)
        if self.global_rank == 0:
            log.info("layout: t=%d%s p=%d v=%d d=%d, %s, m=%d micro-batches of %d per step, on %d %s process%s",
                     p.tp, f" c={p.cp}" if p.cp > 1 else "", p.pp, p.vpp, p.dp,
                     p.schedule if p.pp > 1 else "no pipeline", p.num_micro_batches,
                     p.micro_batch_size,
                     self.world_size, self.root_device.type, "" if self.world_size == 1 else "es")
        if self.world_size > 1 and self.global_rank == 0:  # created with the grid, not lazily inside a step
            log.info("communicators of %d process groups and %d pipeline channels created in %.2f s",
                     len(collective_groups(self.grid)), len(self.grid.p2p_channels(p.pp)), self.grid.communicators_s)
        if self.world_size > 1:  # a rank that found no checkpoint (or another) while the others resume: all stop now
            from mlplat.checkpoint.io import io_group, same_resume

            same_resume(self.resume, io_group(self.grid))
        if self.async_save:  # its process group is created here, by every rank in the same order
            from mlplat.checkpoint.io import AsyncSaver

            self.saver = AsyncSaver(self.grid, self.async_mode)
        if os.environ.get(CHILD_ENV):
            _exit_with_parent()
        install_early(self)  # SIGTERM and the preemption notice handled from here on (mlplat.lightning.signals)
        # Each rank's own log file (train.log, rank<N>.log) says which rank wrote it: never an empty file.
        where = ", ".join(f"{axis}={i}" for axis, i in self.grid.dims.coords(self.global_rank)._asdict().items())
        to_log_files(f"rank {self.global_rank} of {self.world_size} ({where}), pid {os.getpid()} on "
                     f"{socket.gethostname()}")

    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- collectives Lightning uses ------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        if dist_ready():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist_ready():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or not dist_ready():
            return tensor
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        if reduce_op in ("mean", "avg"):
            tensor /= dist.get_world_size(group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        if not dist_ready():
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    # -- checkpoints: Lightning decides when, mlplat.checkpoint what and how ---------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the chunks and the optimizer must exist: loading writes into them

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # The first thing a checkpoint reads: a step taken before its checks is settled first (post-validation),
        # so that the weights, the optimizer, the schedule, the scaler and the metrics it saves are the step's own.
        self.lightning_module.step.settle()
        return {}  # the model goes into the sharded DCP checkpoint, not Lightning's dict

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return {}

    def _optimizer(self):
        """The step's optimizer when fitting (Lightning has set it up), else None: no optimizer state to read."""
        return self.lightning_module.step.optimizer if self.optimizers else None

    def layout(self) -> dict[str, Any]:
        return checkpoint_layout(self.lightning_module.cfg, self.grid.dp if self.grid else self.parallel.dp)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        from mlplat.checkpoint import io
        from mlplat.parallel.random import rng_states

        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        step = self.lightning_module.step
        checkpoint[TRAIN_STEP_KEY] = step.state_dict()
        save = self.saver.save if self.saver is not None else io.save  # behind training, or before it goes on
        # skips.in_a_row is the saved step's own: lightning_module_state_dict settled it
        save(filepath, step.chunks, self._optimizer(), self.grid, checkpoint, self.layout(),
             rank_state={"rng": rng_states(step.tracker)}, skipped=step.skips.in_a_row)

    def wait_for_checkpoint(self) -> None:
        """Until the checkpoint written behind training, if any, is committed (the end of a run, a preemption)."""
        if self.saver is not None:
            self.saver.wait()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Model, optimizer, the step's counters and Lightning state from any layout; this rank's RNG states when the
        layout is the one that saved it (a bit-exact resume), else every stream re-seeded from (seed, step), said in
        a log line."""
        from mlplat.checkpoint import io
        from mlplat.parallel.random import seed_model_parallel, set_rng_states

        step = self.lightning_module.step
        cfg = step.cfg
        state = io.load(checkpoint_path, step.chunks, self._optimizer(), self.grid, cfg.model.vocab_size)
        # another optimizer's checkpoint (AdamW's under Muon): the schedule's groups are this optimizer's
        step.schedule.fresh_groups = bool(state.pop(io.FRESH_STATE, ()))
        global_step = int(state.get("global_step", 0))
        step.load_state_dict(state.get(TRAIN_STEP_KEY) or {"steps": global_step})  # (older checkpoints: the count)
        step.schedule.resuming = True  # Lightning restores it next: it says what the resume took from where
        mine, why = io.load_rank_state(checkpoint_path, self.global_rank, self.layout())
        if mine is not None:
            set_rng_states(mine["rng"], step.tracker)
        else:
            seed_model_parallel(resume_seed(cfg.seed, global_step), self.grid, step.tracker)
            if self.is_global_zero:
                log.warning("resuming %s: %s, so its RNG streams (dropout) have no counterpart here; every stream "
                            "is re-seeded from (seed=%d, step=%d): the run continues, but not bit for bit",
                            checkpoint_path, why, cfg.seed, global_step)
        return state

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # done by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # done by load_checkpoint

    def remove_checkpoint(self, filepath) -> None:
        import shutil

        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    def teardown(self) -> None:
        if self.saver is not None:  # a run that ends by an error: its last save still commits, or fails, first
            self.saver, saver = None, self.saver
            saver.close()
        super().teardown()
        if getattr(self, "strict", None) is not None:  # the next run in this process installs its own
            self.strict.uninstall()
            self.strict = None
        if self.cluster_environment is not None:
            if self.cluster_environment.creates_processes_externally and dist.is_initialized():
                # torchrun, SLURM, submitit, the elastic agent: this strategy made the group itself, so Lightning's
                # exit hook that would destroy it is not installed. Undestroyed, NCCL's communicators are torn down
                # at interpreter exit, where they can hang or abort; every rank has left its last collective here.
                dist.destroy_process_group()
            self.cluster_environment.teardown()


def cpu_threads(processes: int, cores: int | None = None, load: float | None = None) -> tuple[int, str]:
    """(torch threads per process, why when fewer than the cores allow) for `processes` ranks on this machine: its
    cores shared out, but only the cores the machine's other work leaves free (its 1-minute load average, read before
    our ranks compute). OpenMP threads spin while they wait for each other, and on busy cores that costs far more
    than the extra threads gain (docs/launching.md, experiments/cpu_threads/bench.py)."""
    cores = cores or os.cpu_count() or 1
    load = os.getloadavg()[0] if load is None and hasattr(os, "getloadavg") else (load or 0.0)
    share = max(1, cores // processes)
    free = max(1, round(cores - load) // processes)  # a background load of a few tenths takes no core
    if free >= share:
        return share, ""
    return free, (f"the machine's load {load:.1f} leaves {max(0.0, cores - load):.1f} of {cores} cores free; "
                  f"OMP_NUM_THREADS=N sets it")


def resume_seed(seed: int, step: int) -> int:
    """The seed of a resume whose RNG states cannot be restored: distinct per (seed, step), so its dropout masks
    do not replay those of step 1."""
    return (seed * 1_000_003 + step) % (2**62)
def checkpoint_layout(cfg, dp: int) -> dict[str, Any]:
    """What a checkpoint's manifest records about the run: the layout that saved it (`ParallelDims.manifest`), and
    the model and tokenizer that exporting it (`python -m mlplat.checkpoint.export --format hf`) needs without the
    run's config."""
    from mlplat.parallel.layout.dims import ParallelDims

    return {**ParallelDims.of(cfg.parallel, dp=dp).manifest(),
            "vocab_size": cfg.model.vocab_size, "model": dataclasses.asdict(cfg.model),
            # the optimizer whose state it holds (mlplat.train.check_resumed_optimizer)
            "optimizer": cfg.optim.name,
            # data.tokenizer (byte | gpt2 | a path) where the config has it; byte-level tokens otherwise.
            "tokenizer": getattr(cfg.data, "tokenizer", None) or "byte"}


def _exit_with_parent(period_s: float = 1.0) -> None:
    """A rank started by our launcher exits when rank 0 (its parent) is gone, instead of waiting forever in
    a collective. (Lightning's observer in rank 0 covers the other direction: a dead child kills all.)"""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(period_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="mlplat-parent-watchdog", daemon=True).start()


def _rendezvous_store(address: str, port: int, world_size: int, rank: int, timeout: timedelta) -> dist.Store:
    """The store the ranks meet in: rank 0 serves it on the launcher's port; under torchrun, whose agent already
    serves one there (TORCHELASTIC_USE_AGENT_STORE), every rank joins the agent's, under this restart's prefix as
    torch's env:// rendezvous does (a second server on that port would fail to bind, an error line on every run)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0 and not agent, timeout=timeout)
    if agent:
        return dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return store
