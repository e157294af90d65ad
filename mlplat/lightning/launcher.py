"""Lightning's script launcher, made safe under Hydra.

Lightning starts ranks 1..N-1 by re-running `sys.argv`. Under Hydra that goes wrong twice: in a multirun the
children see `-m` and start sweeps of their own (Lightning issue 11300), and under submitit_local `sys.argv` is
submitit's own `_submit.py`. Here a child is started from what Hydra composed for *this* job — the job's own
overrides, pinned to the job's output directory — so it is always exactly one more rank of the same run.
"""
from __future__ import annotations

import os
import subprocess
import sys

from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

CHILD_ENV = "MLPLAT_LAUNCHED_RANK"


def hydra_job_command(local_rank: int) -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    overrides = [o for o in hc.overrides.task if not o.startswith("hydra.")]
    return [sys.executable, "-m", "mlplat.train", *overrides,
            f'hydra.run.dir="{hc.runtime.output_dir}"',
            "hydra.output_subdir=null",
            f"hydra.job.name=rank{local_rank}",
            "hydra.job.chdir=false"]


class HydraSafeLauncher(_SubprocessScriptLauncher):
    def _call_children_scripts(self) -> None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return super()._call_children_scripts()
        self._check_can_spawn_children()
        self.procs = []
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        for local_rank in range(1, self.num_processes):
            env = os.environ.copy()
            env["LOCAL_RANK"] = str(local_rank)
            env[CHILD_ENV] = str(local_rank)
            self.procs.append(subprocess.Popen(hydra_job_command(local_rank), env=env))
