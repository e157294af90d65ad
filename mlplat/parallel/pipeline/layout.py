"""The pipeline layout: p ranks, v model chunks on each, and the schedule that runs them.

This object is the one place that knows how many chunks the model is cut into (p·v) and which pipeline rank
holds which chunk; the schedules, the engine, the model builder, the data module and the planner ask it. Pure
data, no torch.

Placement and rules come from the schedule's entry in `registry`. Chunk c lives on rank c % p (round robin: rank r
holds r, r+p, ..., r+(v-1)p), except under the V-shaped schedules (zbv, v_half), whose V gives rank r chunks r and
2p-1-r (the first and the last chunk, embedding and loss, on rank 0).
"""
from __future__ import annotations

from dataclasses import dataclass

from mlplat.parallel.pipeline import registry


@dataclass(frozen=True)
class PipelineLayout:
    pp: int = 1  # p: pipeline ranks
    vpp: int = 1  # v: model chunks (virtual stages) per pipeline rank
    schedule: str = registry.DEFAULT

    @classmethod
    def of(cls, parallel) -> "PipelineLayout":
        """From anything with pp, vpp and schedule attributes (the config's `parallel` section, a perf Layout)."""
        return cls(parallel.pp, parallel.vpp, parallel.schedule)

    @property
    def spec(self) -> registry.Schedule:
        """The schedule's registry entry (ValueError if none has its name)."""
        return registry.get(self.schedule)

    @property
    def num_chunks(self) -> int:
        """p·v model chunks in all."""
        return self.pp * self.vpp

    @property
    def last_chunk(self) -> int:
        """The chunk that computes the loss."""
        return self.num_chunks - 1

    def owner(self, chunk: int) -> int:
        """The pipeline rank holding `chunk`."""
        return self.spec.placement.owner(chunk, self.pp)

    def chunks_of(self, rank: int) -> list[int]:
        """The global chunk ids held by pipeline `rank`, ascending."""
        owner = self.spec.placement.owner
        return [c for c in range(self.num_chunks) if owner(c, self.pp) == rank]

    @property
    def min_micro_batches(self) -> int:
        """The fewest micro-batches a step may have (interleaving moves them through a chunk in groups of p)."""
        return self.pp if self.spec.groups_of_p else 1

    def layers_per_chunk(self, n_layers: int) -> int:
        return n_layers // self.num_chunks

    def violations(self, n_layers: int | None = None) -> list[str]:
        """Every rule the layout breaks (one line each naming keys, values and the rule); [] when valid. Used by
        the config's validation, the schedules and the planner alike."""
        problems = []
        if self.schedule not in registry.names():
            problems.append(f"parallel.schedule={self.schedule!r} is not one of {', '.join(registry.names())}")
        for key, value in (("parallel.pp", self.pp), ("parallel.vpp", self.vpp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{key}={value} must be an integer >= 1")
        if problems:
            return problems
        if n_layers is not None and n_layers % self.num_chunks:
            problems.append(f"model.n_layers={n_layers} is not divisible by parallel.pp·parallel.vpp="
                            f"{self.num_chunks} (every model chunk must hold the same number of layers)")
        need = self.spec.vpp  # the schedule's chunks per rank; None: any (interleaving)
        if need is None and self.vpp > 1 and self.pp == 1:
            # One rank holding every chunk is sequential execution; interleaving buys nothing.
            problems.append(f"parallel.vpp={self.vpp} needs parallel.pp > 1 for parallel.schedule={self.schedule} "
                            f"(got parallel.pp=1)")
        elif need not in (None, self.vpp) and need > 1:
            problems.append(f"parallel.schedule={self.schedule} needs parallel.vpp={need} "
                            f"({self.spec.placement.note}), got {self.vpp}")
        elif need not in (None, self.vpp):
            any_v = " or ".join(s.name for s in registry.schedules() if s.vpp is None)
            problems.append(f"parallel.vpp={self.vpp} needs parallel.schedule={any_v} (got {self.schedule})")
        return problems

    def micro_batch_violations(self, m: int) -> list[str]:
        """The rules on m, the micro-batches per pipeline per step."""
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            return [f"the number of micro-batches m={m} must be an integer >= 1"]
        if m % self.min_micro_batches:
            # Micro-batches go through each chunk in groups of p, so a partial group has no defined order.
            return [f"parallel.schedule={self.schedule} needs the number of micro-batches m={m} to be a multiple of "
                    f"parallel.pp={self.pp}"]
        return []
