"""SubmititEnvironment: Lightning's view of a submitit job that started one task per rank.

Under `hydra/launcher=submitit_slurm` (and `submitit_local` with `tasks_per_node > 1`) submitit starts every
rank itself: `nodes × tasks_per_node` tasks, each running the same Hydra job. Lightning must then start no
process of its own (its script launcher would re-run submitit's `_submit.py`); this environment says so
(`creates_processes_externally`) and reads each task's place from `submitit.JobEnvironment()`.

The rendezvous address is the first host of the job (127.0.0.1 for a local job) and the port is derived from
the job id, so every task of a job agrees on both without talking; `MASTER_ADDR` / `MASTER_PORT` in the
environment win over both.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from lightning_fabric.plugins.environments.cluster_environment import ClusterEnvironment

from mlplat.lightning.launcher import CHILD_ENV
from mlplat.lightning.ports import port_for_job
from mlplat.lightning.signals import submitit_job


def requeued() -> bool:
    """True in a SLURM job that SLURM has restarted (preempted or timed out, then requeued: by submitit, by mlplat's
    preemption checkpoint (`mlplat.lightning.signals`) or by hand), whether submitit started it or a batch script."""
    return bool(os.environ.get("SLURM_JOB_ID")) and int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0


def resume_ckpt_path(ckpt_path: str | None) -> str | None:
    """The checkpoint a job resumes from: the one asked for, else `last` when the job is a requeue (a requeued job
    runs the same command again; `last` finds the newest checkpoint of the same run dir, so a batch script must pin
    `hydra.run.dir`, submitit's jobs have theirs)."""
    if ckpt_path is None and requeued():
        return "last"
    return ckpt_path


def _close_file_logs() -> None:
    """Every task runs the Hydra job, so every task logs to the job's `train.log`: thousands of writers to one file
    on a shared filesystem under SLURM. Only global rank 0 keeps it; the others still log to their stdout/stderr,
    which submitit keeps per task (`.submitit/<job id>/<job id>_<task>_log.{out,err}`)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()


class SubmititEnvironment(ClusterEnvironment):
    def __init__(self, job: Any | None = None) -> None:
        super().__init__()
        job = job if job is not None else submitit_job()
        if job is None:
            raise RuntimeError("SubmititEnvironment needs a running submitit job (SUBMITIT_EXECUTOR is not set)")
        self.job = job
        self._main_port = int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else None
        if job.global_rank != 0:
            _close_file_logs()

    @staticmethod
    def detect() -> bool:
        """Inside a submitit job that started more than one task (one per rank). A job of one task is an
        ordinary single process to Lightning (whose launcher then starts the other ranks, see launcher.py)."""
        if os.environ.get(CHILD_ENV):
            return False
        job = submitit_job()
        return job is not None and job.num_tasks > 1

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        if os.environ.get("MASTER_ADDR"):
            return os.environ["MASTER_ADDR"]
        if self.job.cluster in ("local", "debug"):
            return "127.0.0.1"
        return self.job.hostnames[0]

    @property
    def main_port(self) -> int:
        if self._main_port is None:
            self._main_port = port_for_job(self.job.job_id)
        return self._main_port

    def world_size(self) -> int:
        return self.job.num_tasks

    def set_world_size(self, size: int) -> None:
        if size != self.job.num_tasks:
            raise ValueError(f"the layout needs {size} ranks but submitit started {self.job.num_tasks} tasks "
                             f"({self.job.num_nodes} node(s)): hydra.launcher.nodes·tasks_per_node must equal "
                             "trainer.num_nodes·trainer.devices")

    def global_rank(self) -> int:
        return self.job.global_rank

    def set_global_rank(self, rank: int) -> None:
        pass  # submitit fixed it

    def local_rank(self) -> int:
        return self.job.local_rank

    def node_rank(self) -> int:
        return self.job.node

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        per_node = self.job.num_tasks // max(1, self.job.num_nodes)
        if (num_devices, num_nodes) != (per_node, self.job.num_nodes):
            raise ValueError(f"trainer.devices={num_devices}, trainer.num_nodes={num_nodes} do not match the submitit "
                             f"job: {per_node} task(s) per node on {self.job.num_nodes} node(s)")
