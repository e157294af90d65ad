"""The pipeline layout: p ranks, v model chunks on each, and the schedule that runs them.

This object is the one place that knows how many chunks the model is cut into (p·v) and which pipeline rank
holds which chunk; the schedules, the engine, the model builder, the data module and the planner ask it. Pure
data, no torch.

Placement and rules come from the schedule's entry in `registry`. Chunk c lives on rank c % p (round robin: rank r
holds r, r+p, ..., r+(v-1)p), except under the V-shaped schedules (zbv, v_half), whose V gives rank r chunks r and
2p-1-r (the first and the last chunk, embedding and loss, on rank 0).

The layers of each chunk (`chunk_layers`, `layers_of`) are this object's fact too. Even by default: L/(p·v) each.
`first_stage_layers` and `last_stage_layers` fix the layers of the chunk that holds the embedding (chunk 0) and of
the one that computes the loss (chunk p·v-1); the other chunks split the rest evenly, in order. The loss's chunk
may hold none (`last_stage_layers=0`): the final norm, the output layer and the multi-token prediction modules on
a stage of their own. With v = 1 those
are the first and the last pipeline stage (Megatron-Core's decoder_first/last_pipeline_num_layers); interleaved,
they are the first rank's first chunk and the last rank's last chunk; under the V (zbv, v_half) both are on rank
0, the rank that also holds the embedding and the output layer. A key left null counts with the even chunks. Which
layer holds which index never depends on the schedule: layer i is named `layers.i` wherever it lives.
"""
from __future__ import annotations

from dataclasses import dataclass

from mlplat.parallel.layout import registry


@dataclass(frozen=True)
class PipelineLayout:
    pp: int = 1  # p: pipeline ranks
    vpp: int = 1  # v: model chunks (virtual stages) per pipeline rank
    schedule: str = registry.DEFAULT
    first_stage_layers: int | None = None  # layers of chunk 0 (the embedding's); None: as the even chunks
    last_stage_layers: int | None = None  # layers of chunk p·v-1 (the loss's); None: as the even chunks

    @classmethod
    def of(cls, parallel) -> "PipelineLayout":
        """From anything with pp, vpp and schedule attributes (the config's `parallel` section, a perf Layout) and
        optionally first_stage_layers and last_stage_layers."""
        return cls(parallel.pp, parallel.vpp, parallel.schedule, getattr(parallel, "first_stage_layers", None),
                   getattr(parallel, "last_stage_layers", None))

    @property
    def uneven(self) -> bool:
        """The first or the last chunk holds a fixed number of layers."""
        return self.first_stage_layers is not None or self.last_stage_layers is not None

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

    def chunk_layers(self, n_layers: int) -> list[int]:
        """The number of layers of each chunk, in chunk order (ValueError when the layout cannot split them)."""
        problems = self._split_violations(n_layers)
        if problems:
            raise ValueError(problems[0])
        return self._split(n_layers)

    def layers_of(self, chunk: int, n_layers: int) -> range:
        """The global indices of the layers `chunk` holds (consecutive: chunk c follows chunk c-1)."""
        counts = self.chunk_layers(n_layers)
        start = sum(counts[:chunk])
        return range(start, start + counts[chunk])

    def rank_layers(self, rank: int, n_layers: int) -> int:
        """The layers pipeline `rank` holds over all its chunks."""
        counts = self.chunk_layers(n_layers)
        return sum(counts[c] for c in self.chunks_of(rank))

    def max_rank_layers(self, n_layers: int) -> int:
        """The most layers any pipeline rank holds (the memory and the critical path follow it)."""
        return max(self.rank_layers(r, n_layers) for r in range(self.pp))

    def _split(self, n_layers: int) -> list[int]:
        n = self.num_chunks
        fixed = {0: self.first_stage_layers, n - 1: self.last_stage_layers}
        fixed = {c: k for c, k in fixed.items() if k is not None}
        free = n - len(fixed)
        even = (n_layers - sum(fixed.values())) // free if free else 0
        return [fixed.get(c, even) for c in range(n)]

    def _split_violations(self, n_layers: int) -> list[str]:
        """The rules of the split of n_layers over the chunks (one line each)."""
        n = self.num_chunks
        if not self.uneven:
            if n_layers % n:
                return [f"model.n_layers={n_layers} is not divisible by parallel.pp·parallel.vpp={n} (every model "
                        f"chunk must hold the same number of layers) or set parallel.first_stage_layers and/or "
                        f"parallel.last_stage_layers (the first and the last chunk's layers)"]
            return []
        set_keys = [(k, v) for k, v in (("parallel.first_stage_layers", self.first_stage_layers),
                                         ("parallel.last_stage_layers", self.last_stage_layers)) if v is not None]
        for key, value in set_keys:
            # The loss's chunk may hold no layer: the final norm, the output layer and the multi-token prediction
            # modules, a stage of their own (Megatron-Core's `mL` pipeline layout for DeepSeek-V3).
            least = 0 if key == "parallel.last_stage_layers" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                return [f"{key}={value} must be an integer >= {least} (or null: as the other chunks)"]
        named = ", ".join(f"{k}={v}" for k, v in set_keys)
        if n == 1:
            return [f"{named} needs parallel.pp > 1 (one model chunk holds all model.n_layers={n_layers})"]
        if n == 2 and self.first_stage_layers is not None and self.last_stage_layers is not None:
            if self.first_stage_layers + self.last_stage_layers != n_layers:
                return [f"{named} must add up to model.n_layers={n_layers} with parallel.pp·parallel.vpp=2 chunks"]
            return []
        free = n - len(set_keys)
        rest = n_layers - sum(v for _, v in set_keys)
        if rest < free or rest % free:
            verb, taken = ("leave" if len(set_keys) > 1 else "leaves"), "-".join(str(v) for _, v in set_keys)
            return [f"{named} {verb} model.n_layers-{taken}={rest} layers for the "
                    f"other {free} of the parallel.pp·parallel.vpp={n} model chunks: not a positive multiple of "
                    f"{free} (they split the rest evenly)"]
        return []

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
        if n_layers is not None:
            problems += self._split_violations(n_layers)
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


def layer_runs(counts: list[int]) -> str:
    """Layers per chunk as read aloud: [15, 16, 16, 16, 15] -> `15, 16 x3, 15`."""
    out: list[list[int]] = []
    for k in counts:
        if out and out[-1][0] == k:
            out[-1][1] += 1
        else:
            out.append([k, 1])
    return ", ".join(f"{k} x{n}" if n > 1 else str(k) for k, n in out)
