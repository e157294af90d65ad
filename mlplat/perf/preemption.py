"""The lead a preemption notice needs, from the plan.

SLURM sends its notice `hydra.launcher.signal_delay_s` before it stops the job. mlplat's handler only sets a flag;
the flag is all-reduced at one step's end and read at the next's (`mlplat.lightning.signals`: a blocking
all-reduce at every step's end would be a barrier between steps), so the save starts up to NOTICE_STEPS steps
after the notice, and then writes every parameter's weight and optimizer state. An asynchronous save
(checkpoint.async_save) does not shorten this: the job must see its save committed before it exits.
"""
from __future__ import annotations

from dataclasses import dataclass

from mlplat.precision import precision_of

NOTICE_STEPS = 2  # steps from the notice to the save's start, at most


def checkpoint_bytes(parameters: float, precision: str) -> float:
    """What a checkpoint writes: each parameter's weight and optimizer state (main weight, if separate, and Adam's
    two moments), once over the whole job."""
    weight, _, state = precision_of(precision).state_bytes
    return parameters * (weight + state)


@dataclass(frozen=True)
class NoticeLead:
    step_seconds: float
    checkpoint_bytes: float
    save_seconds: float | None  # None: the file system's write bandwidth is not known (cluster.fs_write_gbps)

    @property
    def seconds(self) -> float:
        """The least lead that lets the notice's save finish: NOTICE_STEPS steps and the save (when known)."""
        return NOTICE_STEPS * self.step_seconds + (self.save_seconds or 0.0)

    def shortfall(self, signal_delay_s: float) -> str | None:
        """One line when `signal_delay_s` (the launcher's lead) is shorter than this, else None."""
        if signal_delay_s >= self.seconds:
            return None
        save = (f" + a {self.checkpoint_bytes / 1e12:.3g} TB save of {self.save_seconds:.0f} s"
                if self.save_seconds is not None else
                " (+ the save, unknown without cluster.fs_write_gbps)")
        return (f"hydra.launcher.signal_delay_s={signal_delay_s:g} is shorter than the {self.seconds:.0f} s a "
                f"preemption notice's checkpoint needs: up to {NOTICE_STEPS} steps of {self.step_seconds:.3g} s "
                f"before the save starts{save}; raise it, or rely on checkpoint.every_steps and lose the steps since")


def notice_lead(step_seconds: float, parameters: float, precision: str,
                fs_write_gbps: float | None) -> NoticeLead:
    nbytes = checkpoint_bytes(parameters, precision)
    return NoticeLead(step_seconds, nbytes, nbytes / (fs_write_gbps * 1e9) if fs_write_gbps else None)
