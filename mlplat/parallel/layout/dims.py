"""ParallelDims: the layout of a run, written once: its sizes, the world size, m, the replicas, the rank order and
what a checkpoint's manifest records of it. Frozen and torch-free.

The fields are the `parallel.*` keys: t (tp), c (cp), p (pp), d (dp), v (vpp), the schedule, b (micro_batch_size),
B (global_batch_size), sequence parallelism, and the layers of the first and the last model chunk (null: an even
split; `PipelineLayout` owns what they mean). Everything derived from them is a property or method here and
nowhere else: the world size t·c·p·d, the micro-batches per step m = B/(b·d), the replicas d·c (the ranks holding
one copy of a rank's weights), the rank order (`rank_of`, `coords`, `stride`, the groups of an axis) and the
manifest's layout fields. `mlplat.config.validate` builds it once (`RunConfig.dims`); `ParallelGrid` takes its
rank order and groups from it; the perf models' `Layout` is one with the cost knobs added; the checkpoint manifest
writes and compares it.

The rank order (Narayanan et al., SC21, §3): `AXES`, innermost first, tp → cp → dp → pp,

    rank = tp + t·(cp + c·(dp + d·pp))

Tensor parallelism is innermost so that its all-reduces, every layer, run over the fastest links (inside a node);
context parallelism next (its ring moves K/V blocks every layer, more often than data parallelism communicates:
where Megatron-Core and torchtitan place it); the pipeline outermost, its point-to-point traffic being the smallest.
So neighbouring pipeline stages are t·c·d ranks apart (`stride("pp")`). The cp ranks of a replica hold the same
weights as its dp ranks: gradients are reduced (and the distributed optimizer sharded) over the d·c ranks of
`REPLICA_AXES`, in the same order (cp inside dp); the data is split over the d data-parallel ranks only.

Adding an axis is one field and one name in `AXES` at its place in the order: the world size, the rank order, the
groups and the manifest (old manifests read its default, 1) follow from them.

Expert parallelism is not an axis of the world: it folds over the same ranks (Megatron-Core's "parallel folding").
Within a pipeline stage the t·c·d ranks, numbered by their place i = tp + t·(cp + c·dp) (the rank order above
without pp), are laid out a second time for the experts as etp × ep × edp, innermost first: etp ranks split each
expert's width (1, or t: then etp is the tp axis itself), ep ranks split the experts, and the edp = t·c·d/(etp·ep)
ranks holding the same experts reduce their gradients (and shard their optimizer state) together.

Placement: in `mlplat/parallel/` so that the grid imports it within its own package, while `mlplat.config` above
and `mlplat.perf` beside read it downward; it imports only the pure pipeline layout, so no cycle can form.
"""
from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, fields
from math import prod
from typing import Any, Mapping

from mlplat.parallel.layout.pipeline import PipelineLayout  # pure data, no torch

AXES = ("tp", "cp", "dp", "pp")  # the rank order, innermost first
REPLICA_AXES = ("cp", "dp")  # the ranks holding one copy of a rank's weights (gradients reduced over them)
# What makes a saved rank's own state (its RNG streams) this rank's: the layers it holds are part of it.
MANIFEST_KEYS = (*AXES, "vpp", "schedule", "first_stage_layers", "last_stage_layers", "ep", "etp")
EXPERT_AXES = ("etp", "ep", "edp")  # the experts' layout of a stage's ranks, innermost first

Coords = namedtuple("Coords", AXES)  # a rank's place on every axis


def coords_label(tp: int, pp: int, dp: int, cp: int | None = None) -> str:
    """A rank's place as the logs and reports write it: `t1,p0,d1`, with `,c0` under context parallelism."""
    return f"t{tp},p{pp},d{dp}" + (f",c{cp}" if cp is not None else "")


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1  # t: tensor-parallel ranks
    cp: int = 1  # c: context-parallel ranks (each holds 1/c of every sequence)
    pp: int = 1  # p: pipeline ranks
    dp: int = 1  # d: data-parallel replicas
    vpp: int = 1  # v: model chunks (virtual stages) per pipeline rank
    schedule: str = "1f1b"
    micro_batch_size: int = 1  # b
    global_batch_size: int = 1  # B = b·m·d
    sequence_parallel: bool = False  # on (validation guarantees t >= 2 when it is: no consumer tests t again)
    first_stage_layers: int | None = None  # layers of the embedding's chunk (PipelineLayout); None: even
    last_stage_layers: int | None = None  # layers of the loss's chunk; None: even
    ep: int = 1  # expert-parallel ranks (folded over a stage's t·c·d ranks: the module docstring)
    etp: int | None = None  # each expert's tensor-parallel ranks, 1 or t; None: t when ep = 1, else 1
    dp_shard: int | None = None  # HSDP: the replicas' shard groups' size; None: all d·c (not a rank's identity)

    @classmethod
    def of(cls, parallel, **given) -> "ParallelDims":
        """From anything with these fields' names (the config's `parallel` section, parallel.dp resolved; a perf
        Layout); a name it lacks takes its default, `given` overrides."""
        values = {f.name: getattr(parallel, f.name) for f in fields(ParallelDims) if hasattr(parallel, f.name)}
        values.update(given)
        if values.get("dp") is None:
            raise ValueError("parallel.dp is not resolved yet (mlplat.config.validate derives it)")
        return cls(**values)

    # ------------------------------------------------------------------ derived facts

    @property
    def world_size(self) -> int:
        """t·c·p·d ranks."""
        return prod(self.size(axis) for axis in AXES)

    @property
    def num_micro_batches(self) -> int:
        """m = B/(b·d): micro-batches per pipeline per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def replicas(self) -> int:
        """d·c: the ranks holding one copy of a rank's weights; gradients are reduced (and the distributed optimizer
        sharded) over them."""
        return prod(self.size(axis) for axis in REPLICA_AXES)

    @property
    def shard_size(self) -> int:
        """The replicas a weight's optimizer state (and, sharded, the weight) is split over: parallel.dp_shard, or
        all d·c of them."""
        return self.dp_shard or self.replicas

    @property
    def pipeline(self) -> PipelineLayout:
        """p, v, the schedule and the uneven split: the model chunks, the rank that holds each and their layers."""
        return PipelineLayout(self.pp, self.vpp, self.schedule, self.first_stage_layers, self.last_stage_layers)

    @property
    def interleaved(self) -> bool:
        """More than one model chunk per pipeline rank."""
        return self.vpp > 1

    # ------------------------------------------------------------------ the experts' layout

    @property
    def expert_tp(self) -> int:
        """etp resolved: the ranks each expert's width is split over (t when ep = 1 and etp unset, else 1)."""
        if self.etp is not None:
            return self.etp
        return self.tp if self.ep == 1 else 1

    @property
    def stage_ranks(self) -> int:
        """t·c·d: the ranks of one pipeline stage, laid out once for attention and once for the experts."""
        return self.world_size // self.pp

    @property
    def edp(self) -> int:
        """The ranks of a stage holding the same experts: t·c·d/(etp·ep)."""
        return self.stage_ranks // (self.expert_tp * self.ep)

    def _expert_radix(self) -> dict[str, tuple[int, int]]:
        """Each of EXPERT_AXES' (size, stride) within a stage's place i = rank mod t·c·d, innermost first."""
        out, stride = {}, 1
        for axis, size in zip(EXPERT_AXES, (self.expert_tp, self.ep, self.edp)):
            out[axis], stride = (size, stride), stride * size
        return out

    def expert_coords(self, rank: int) -> dict[str, int]:
        """A rank's place on EXPERT_AXES (etp, ep, edp) within its stage."""
        i = rank % self.stage_ranks
        return {axis: i // stride % size for axis, (size, stride) in self._expert_radix().items()}

    def expert_group(self, axis: str, rank: int) -> list[int]:
        """The ranks of `rank`'s stage that differ from it on expert axis `axis` alone, in that axis's order."""
        size, stride = self._expert_radix()[axis]
        first = rank - self.expert_coords(rank)[axis] * stride
        return [first + j * stride for j in range(size)]

    def expert_groups(self, axis: str) -> list[list[int]]:
        """Every group of expert axis `axis`, each once, in the order of their first rank."""
        return [self.expert_group(axis, r) for r in range(self.world_size) if self.expert_coords(r)[axis] == 0]

    # ------------------------------------------------------------------ the rank order

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def stride(self, axis: str) -> int:
        """The global-rank distance between neighbours along `axis`: the product of the sizes inside it (t·c·d
        between pipeline stages)."""
        return _strides(self, AXES)[axis]

    def span(self, axis: str) -> int:
        """Consecutive ranks one group of `axis` reaches across, the axes inside it included (t·c for a cp ring):
        the group stays in a node of n ranks when this is at most n."""
        return self.stride(axis) * self.size(axis)

    def rank_of(self, **coords: int) -> int:
        """The global rank at `coords` (axis name -> index; an axis not named is at 0)."""
        return _encode(self, AXES, coords)

    def coords(self, rank: int) -> Coords:
        """The place of a global rank on every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside [0, {self.world_size})")
        return Coords(**_decode(self, AXES, rank))

    def replica_rank(self, rank: int) -> int:
        """A rank's place among the d·c ranks holding its weights (its shard of the distributed optimizer)."""
        return _encode(self, REPLICA_AXES, self.coords(rank)._asdict())

    def group(self, axes: str | tuple[str, ...], rank: int) -> list[int]:
        """The global ranks that differ from `rank` on `axes` alone, in the rank order of those axes."""
        axes = (axes,) if isinstance(axes, str) else axes
        at = self.coords(rank)._asdict()
        return [self.rank_of(**{**at, **_decode(self, axes, i)}) for i in range(prod(self.size(a) for a in axes))]

    def groups(self, axes: str | tuple[str, ...]) -> list[list[int]]:
        """Every group of `axes`, each once, in the order of their first rank (the same on every rank)."""
        axes = (axes,) if isinstance(axes, str) else axes
        return [self.group(axes, r) for r in range(self.world_size) if all(self.coords(r)._asdict()[a] == 0
                                                                            for a in axes)]

    # ------------------------------------------------------------------ the checkpoint manifest

    def manifest(self) -> dict[str, Any]:
        """The layout fields a checkpoint's manifest records."""
        return {key: getattr(self, key) for key in MANIFEST_KEYS}

    @classmethod
    def from_manifest(cls, layout: Mapping[str, Any]) -> "ParallelDims":
        """The layout a manifest records; a key it lacks (a manifest written before the key existed) or holds null
        takes its default (cp: 1). Its other keys (the model, the tokenizer) are not read."""
        return cls(**{key: layout[key] for key in MANIFEST_KEYS if layout.get(key) is not None})

    def same_ranks(self, other: "ParallelDims") -> bool:
        """Whether every rank of one is the same rank of the other (its saved RNG streams are its own)."""
        return self.manifest() == other.manifest()


def _strides(dims: ParallelDims, axes: tuple[str, ...]) -> dict[str, int]:
    """The mixed radix of `axes`, the first innermost: each axis's stride, the product of the sizes inside it. The
    one formula of the rank order (over AXES) and of the replicas' order (over REPLICA_AXES)."""
    out, stride = {}, 1
    for axis in axes:
        out[axis], stride = stride, stride * dims.size(axis)
    return out


def _encode(dims: ParallelDims, axes: tuple[str, ...], coords: Mapping[str, int]) -> int:
    """The index of `coords` (axis name -> index; an axis not named at 0) in that radix."""
    index = 0
    for axis, stride in _strides(dims, axes).items():
        value, size = coords.get(axis, 0), dims.size(axis)
        if not 0 <= value < size:
            raise ValueError(f"{axis}_rank={value} is outside [0, {size})")
        index += value * stride
    return index


def _decode(dims: ParallelDims, axes: tuple[str, ...], index: int) -> dict[str, int]:
    """The inverse of `_encode`: the coordinates on `axes` of `index`."""
    return {axis: index // stride % dims.size(axis) for axis, stride in _strides(dims, axes).items()}
