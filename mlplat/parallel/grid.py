"""ParallelGrid: a rank's (tensor, pipeline, data, context) parallel coordinates and its process groups.

The rank order, the world size and the groups of each axis are `mlplat.parallel.layout.dims.ParallelDims`' (tensor
parallelism innermost, then context, data, pipeline outermost); the grid holds one (`grid.dims`) and creates the
groups it names. The cp ranks of a replica hold the same weights, so gradients are reduced (and the distributed
optimizer sharded) over the d·c ranks of `dp_cp_group`; the data is split over the d data-parallel ranks only.
With fewer key/value heads than tp ranks, runs of `kv_replicas` consecutive tp ranks hold the same key/value head;
`kv_group` is this rank's run (their gradients of it are summed there). The experts' layout of a stage (etp × ep ×
edp over its t·c·d ranks, `ParallelDims.expert_coords`) gives `ep_group` (the ranks the experts are split over: the
dispatch's all-to-all) and `edp_group` (the ranks holding the same experts: their gradients' reduction), each the
communicator of an attention group where one has the same ranks.

One grid object is built per process and passed explicitly; there is no module-level group state.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from mlplat.parallel.communicators import create_communicators
from mlplat.parallel.layout.dims import REPLICA_AXES, ParallelDims


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value



def dist_ready() -> bool:
    """Whether this process is in a default process group (torch.distributed built and initialised)."""
    return dist.is_available() and dist.is_initialized()


@dataclass(frozen=True)
class EpNodes:
    """The ep group split into nodes of `size` consecutive ep ranks (parallel.ep_per_node; the node dispatcher's,
    docs/moe.md): `across`, this rank's group with the ranks of its in-node index in every node, in node order;
    `within`, its node's ranks in order. Either may hold one rank (one node, or one rank per node): it exists all
    the same, so every layout posts the same collectives."""

    size: int
    across: object
    within: object


class ParallelGrid:
    """The coordinates and groups of one rank in the layout `dims` (`ParallelGrid.of(dims)`, or its sizes).

    Real mode (default) creates the process groups of an initialized torch.distributed world (or, when
    it is not initialized, allows only the trivial 1x1x1x1 grid). ``virtual=True`` creates no groups and
    takes ``rank`` explicitly: it gives layers the sizes and coordinates they need to build shapes,
    e.g. on the meta device when planning a run far larger than this machine. A group of size 1 is
    ``None`` so callers can skip the collective.
    """

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1, *, rank: int | None = None, virtual: bool = False,
                 timeout: timedelta | None = None, io_timeout: timedelta | None = None, device="auto",
                 singleton_groups: bool = False, cp: int = 1, kv_replicas: int = 1, ep: int = 1,
                 etp: int | None = None, dp_shard: int | None = None, ep_per_node: int | None = None):
        # timeout: how long a collective or transfer of this grid's groups may wait (parallel.timeout_s). Every
        # group gets it: a group created without one waits torch's default (30 min on gloo), not the world's.
        # io_timeout: the same for io_group, the world group of the collectives that follow file I/O
        # (checkpoint.timeout_s: saving, verifying, loading, writing the profile); default: timeout.
        # device: where the communicators are created, before any step uses them (mlplat.parallel.communicators);
        # "auto": the current CUDA device on NCCL, else the CPU.
        # singleton_groups: groups of one rank exist too (not None), so that every collective of a step runs even
        # on one GPU: the GPU check meets NCCL's rules at world size 1 (experiments/gpu_check/run.sh).
        # kv_replicas: the tp ranks sharing one key/value head (ModelConfig.kv_replicas; 1: none shared).
        # ep_per_node: the ep ranks of one node, whose sub-groups (`ep_nodes`) the node dispatcher runs on
        # (parallel.ep_per_node, filled by mlplat.config.validate for that dispatcher alone); None: not created.
        self.singleton_groups = singleton_groups
        self.timeout = timeout
        self.io_timeout = io_timeout if io_timeout is not None else timeout
        self.dims = ParallelDims(tp=_positive("tp", tp), cp=_positive("cp", cp), pp=_positive("pp", pp),
                                 dp=_positive("dp", dp), ep=_positive("ep", ep), etp=etp, dp_shard=dp_shard)
        self.tp, self.cp, self.pp, self.dp = tp, cp, pp, dp
        self.dp_cp = self.dims.replicas  # the ranks that hold one copy of this rank's weights
        self.kv_replicas = _positive("kv_replicas", kv_replicas)
        if tp % kv_replicas:
            raise ValueError(f"kv_replicas={kv_replicas} does not divide tp={tp}")
        self.world_size = self.dims.world_size
        self.virtual = bool(virtual)

        if self.virtual:
            rank = 0 if rank is None else rank
        elif dist_ready():
            world = dist.get_world_size()
            if world != self.world_size:
                raise ValueError(
                    f"world size {world} != tp*cp*pp*dp = {self.tp}*{self.cp}*{self.pp}*{self.dp} = {self.world_size}"
                )
            if rank is not None and rank != dist.get_rank():
                raise ValueError(f"rank={rank} differs from torch.distributed rank {dist.get_rank()}")
            rank = dist.get_rank()
        else:
            if self.world_size != 1:
                raise ValueError(
                    f"tp={self.tp}, cp={self.cp}, pp={self.pp}, dp={self.dp} needs {self.world_size} processes "
                    "but torch.distributed is not initialized (use virtual=True to plan without groups)"
                )
            if rank not in (None, 0):
                raise ValueError(f"rank={rank} is invalid without torch.distributed (only rank 0)")
            rank = 0
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r} is outside [0, {self.world_size})")

        self.rank = rank
        self.tp_rank, self.pp_rank, self.dp_rank, self.cp_rank = self.coords(rank)
        # This rank's place among the d·c ranks of dp_cp_group (its shard of the distributed optimizer).
        self.dp_cp_rank = self.dims.replica_rank(rank)
        # HSDP: the replicas split into groups of dp_shard consecutive places (`shard_ranks`), a weight sharded
        # within each and replicated across them; the ranks at this rank's place of every group are
        # `replicate_ranks`. Without HSDP, one group of all d·c.
        self.dp_shard = self.dims.shard_size
        if self.dp_cp % self.dp_shard:
            raise ValueError(f"dp_shard={self.dp_shard} does not divide the {self.dp_cp} replicas (d·c)")
        self.shard_rank, self.shard_block = self.dp_cp_rank % self.dp_shard, self.dp_cp_rank // self.dp_shard

        # Global ranks of the groups this rank belongs to (known in every mode).
        group = self.dims.group
        self.tp_ranks, self.cp_ranks, self.dp_ranks = group("tp", rank), group("cp", rank), group("dp", rank)
        self.dp_cp_ranks, self.pp_ranks = group(REPLICA_AXES, rank), group("pp", rank)
        self.shard_ranks = self.dp_cp_ranks[self.shard_block * self.dp_shard:(self.shard_block + 1) * self.dp_shard]
        self.replicate_ranks = self.dp_cp_ranks[self.shard_rank::self.dp_shard]
        first = self.tp_rank - self.tp_rank % self.kv_replicas  # this rank's run of tp ranks sharing a KV head
        self.kv_ranks = self.tp_ranks[first:first + self.kv_replicas]
        # The experts' layout of this stage (ParallelDims' docstring): ep ranks split the experts, the edp ranks
        # holding the same ones reduce their gradients together.
        self.ep, self.etp, self.edp = self.dims.ep, self.dims.expert_tp, self.dims.edp
        if self.dims.stage_ranks % (self.ep * self.etp):
            raise ValueError(f"ep·etp={self.ep}·{self.etp} does not divide a stage's {self.dims.stage_ranks} ranks")
        at = self.dims.expert_coords(rank)
        self.ep_rank, self.edp_rank = at["ep"], at["edp"]
        self.ep_ranks, self.edp_ranks = self.dims.expert_group("ep", rank), self.dims.expert_group("edp", rank)
        self.ep_per_node = ep_per_node
        if ep_per_node is not None and (ep_per_node < 1 or self.ep % ep_per_node):
            raise ValueError(f"ep_per_node={ep_per_node} does not divide ep={self.ep}")
        # The word embedding lives on the first stage and (tied) on the last; their gradients are summed.
        self.embedding_ranks = [self.pp_ranks[0], self.pp_ranks[-1]] if self.pp > 1 else []

        self.tp_group = self.kv_group = self.cp_group = self.dp_group = self.dp_cp_group = self.pp_group = None
        self.ep_group = self.edp_group = self.shard_group = self.replicate_group = None
        self.embedding_group = self.io_group = None
        self.ep_nodes: EpNodes | None = None  # the ep group's node sub-groups, where ep_per_node is given
        self._p2p_groups: dict[tuple[int, int], object] = {}  # (src, dst) pipeline ranks -> group of this pipeline
        self.communicators_s = 0.0  # how long creating the communicators took
        if not self.virtual and dist_ready():
            self._create_groups()
            if device is not None:  # None: left to each group's first use (only to show why they are not)
                self.communicators_s = create_communicators(self, device)

    # ------------------------------------------------------------------ coordinates

    @classmethod
    def of(cls, dims: ParallelDims, **kwargs) -> "ParallelGrid":
        """The grid of a run's layout (`RunConfig.dims`); kwargs as the constructor's."""
        return cls(dims.tp, dims.pp, dims.dp, cp=dims.cp, ep=dims.ep, etp=dims.etp, dp_shard=dims.dp_shard, **kwargs)

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int, cp_rank: int = 0) -> int:
        return self.dims.rank_of(tp=tp_rank, pp=pp_rank, dp=dp_rank, cp=cp_rank)

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(tp_rank, pp_rank, dp_rank, cp_rank) of a global rank."""
        at = self.dims.coords(rank)
        return at.tp, at.pp, at.dp, at.cp

    def shard_owner(self, peer: int, shard: int, expert: bool = False) -> int:
        """The global rank holding distributed-optimizer shard `shard` of what `peer` (a rank of this rank's tp or
        ep group) holds: the shard-th of peer's d·c replicas, or of its edp ranks for an expert."""
        if expert:
            return self.dims.expert_group("edp", peer)[shard]
        return self.dims.group(REPLICA_AXES, peer)[self.shard_block * self.dp_shard + shard]  # in this rank's group

    def stage_rank(self, pipeline_rank: int) -> int:
        """Global rank of pipeline stage ``pipeline_rank`` (mod pp) in this rank's (tp_rank, dp_rank) pipeline.

        The modulo makes the last stage's "next" the first stage: with interleaving, virtual stage
        chunks wrap around the pipeline ranks.
        """
        return self.rank_of(self.tp_rank, pipeline_rank % self.pp, self.dp_rank, self.cp_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    # ------------------------------------------------------------------ groups

    def _create_groups(self) -> None:
        # dist.new_group is collective over the whole world: every rank must create every group,
        # in the same order, even the groups it is not part of. Groups of size 1 are skipped by all.
        dims = self.dims

        def make(all_ranks: list[list[int]], singletons: bool = self.singleton_groups):
            mine = None
            for ranks in all_ranks:
                if len(ranks) < 2 and not singletons:
                    continue
                group = dist.new_group(ranks=ranks, timeout=self.timeout)
                if self.rank in ranks:
                    mine = group
            return mine

        self.tp_group, self.cp_group, self.dp_group = (make(dims.groups(axis)) for axis in ("tp", "cp", "dp"))
        k = self.kv_replicas
        self.kv_group = make([ranks[i:i + k] for ranks in dims.groups("tp") for i in range(0, self.tp, k)]) \
            if k > 1 else None
        # at c = 1 the ranks of one copy of the weights are the data-parallel group itself
        self.dp_cp_group = make(dims.groups(REPLICA_AXES)) if self.cp > 1 else self.dp_group
        self.shard_group = self.dp_cp_group
        if self.dp_shard < self.dp_cp:  # HSDP
            s = self.dp_shard
            self.shard_group = make([ranks[i:i + s] for ranks in dims.groups(REPLICA_AXES)
                                     for i in range(0, len(ranks), s)])
            self.replicate_group = make([ranks[i::s] for ranks in dims.groups(REPLICA_AXES) for i in range(s)])
        # The expert groups, each the same communicator as an attention group over the same ranks where there is
        # one (ep = t: tp's; edp = the replicas at etp = t or t = 1), else one of their own.
        for name, axis in (("ep_group", "ep"), ("edp_group", "edp")):
            groups, mine = dims.expert_groups(axis), getattr(self, axis + "_ranks")
            same = [(g, ranks) for g, ranks in ((self.tp_group, self.tp_ranks), (self.dp_cp_group, self.dp_cp_ranks))
                    if ranks == mine and (g is not None or len(mine) == 1)]
            setattr(self, name, same[0][0] if same else make(groups))
        if self.ep_per_node is not None:  # the ep group itself where a sub-group has all its ranks
            n, every = self.ep_per_node, dims.expert_groups("ep")
            across = self.ep_group if n == 1 and self.ep > 1 else make(
                [ranks[i::n] for ranks in every for i in range(n)], singletons=True)
            within = self.ep_group if n == self.ep > 1 else make(
                [ranks[i:i + n] for ranks in every for i in range(0, self.ep, n)], singletons=True)
            self.ep_nodes = EpNodes(n, across, within)
        pipelines = dims.groups("pp")
        self.pp_group = make(pipelines)
        # One group per direction of each pair of neighbouring stages, wrap-around included (interleaving sends
        # from the last stage to the first): NCCL then runs each direction on a communicator of its own, so a
        # send never queues behind a receive (mlplat/parallel/layout/exchange.py).
        for a, b in self.p2p_channels(self.pp):
            for stages in pipelines:
                group = dist.new_group(ranks=[stages[a], stages[b]], timeout=self.timeout)
                if stages == self.pp_ranks:
                    self._p2p_groups[(a, b)] = group
        if self.pp > 1:
            self.embedding_group = make([[stages[0], stages[-1]] for stages in pipelines])
        # Last, on every rank: the whole world under io_timeout, for collectives after long, uneven file I/O.
        if self.world_size > 1 or self.singleton_groups:
            self.io_group = dist.new_group(ranks=list(range(self.world_size)), timeout=self.io_timeout)

    @staticmethod
    def p2p_channels(pp: int) -> list[tuple[int, int]]:
        """The directed (src, dst) pipeline-rank pairs that carry messages: neighbours, both ways, with wrap."""
        if pp < 2:
            return []
        return sorted({pair for r in range(pp) for pair in ((r, (r + 1) % pp), ((r + 1) % pp, r))})

    def p2p_group(self, src: int, dst: int):
        """The process group of this rank's pipeline for messages from pipeline rank src to dst."""
        try:
            return self._p2p_groups[(src % self.pp, dst % self.pp)]
        except KeyError:
            raise ValueError(f"no point-to-point channel from pipeline rank {src} to {dst} (pp={self.pp})") from None

    def __repr__(self) -> str:
        mode = ", virtual" if self.virtual else ""
        cp = f", cp={self.cp}" if self.cp > 1 else ""
        cp_rank = f", cp_rank={self.cp_rank}" if self.cp > 1 else ""
        return (
            f"ParallelGrid(tp={self.tp}{cp}, pp={self.pp}, dp={self.dp}, rank={self.rank}: "
            f"tp_rank={self.tp_rank}, pp_rank={self.pp_rank}, dp_rank={self.dp_rank}{cp_rank}{mode})"
        )
