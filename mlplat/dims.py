"""The derived layout facts of a run, in one frozen object (torch-free).

`mlplat.config.validate` builds it once from `parallel.*` (dp resolved) and every consumer asks it instead of
re-deriving: the world size t·c·p·d, the micro-batches per step m = B/(b·d), the pipeline layout (p·v model chunks and
which rank holds which) and whether sequence parallelism is on. Validation refuses sequence parallelism with t < 2,
so `sequence_parallel` here is the whole fact: no consumer needs to test `tp > 1` again.
"""
from __future__ import annotations

from dataclasses import dataclass

from mlplat.parallel.pipeline.layout import PipelineLayout  # pure data, no torch


@dataclass(frozen=True)
class ParallelDims:
    tp: int  # t: tensor-parallel ranks
    pp: int  # p: pipeline ranks
    dp: int  # d: data-parallel replicas
    vpp: int = 1  # v: model chunks (virtual stages) per pipeline rank
    schedule: str = "1f1b"
    sequence_parallel: bool = False  # on (validation guarantees t >= 2 when it is)
    micro_batch_size: int = 1  # b
    global_batch_size: int = 1  # B = b·m·d
    cp: int = 1  # c: context-parallel ranks (each holds 1/c of every sequence)

    @classmethod
    def of(cls, parallel) -> "ParallelDims":
        """From the config's `parallel` section (or anything with its keys), parallel.dp already resolved."""
        if parallel.dp is None:
            raise ValueError("parallel.dp is not resolved yet (mlplat.config.validate derives it)")
        return cls(parallel.tp, parallel.pp, parallel.dp, parallel.vpp, parallel.schedule,
                   bool(parallel.sequence_parallel), parallel.micro_batch_size, parallel.global_batch_size,
                   getattr(parallel, "cp", 1))

    @property
    def world_size(self) -> int:
        """t·c·p·d ranks."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def num_micro_batches(self) -> int:
        """m: micro-batches per pipeline per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def pipeline(self) -> PipelineLayout:
        """p, v and the schedule: the number of model chunks and the rank that holds each."""
        return PipelineLayout(self.pp, self.vpp, self.schedule)

    @property
    def interleaved(self) -> bool:
        """More than one model chunk per pipeline rank."""
        return self.vpp > 1
