"""ParallelGrid: the map between a global rank and its (tensor, pipeline, data, context) parallel coordinates.

Layout (Narayanan et al., SC21, §3): tensor-parallel ranks are innermost so that the all-reduces of
tensor model parallelism run over the fastest links (inside a node); pipeline stages are outermost
because their point-to-point traffic is the smallest. Context parallelism (each rank of a cp group holds 1/c of
every sequence; `mlplat.parallel.context`) sits between tensor and data parallelism, where Megatron-Core and
torchtitan place it: its ring moves K/V blocks every layer, more often than data parallelism communicates.

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

The cp ranks of a replica hold the same weights, so gradients are reduced (and the distributed optimizer
sharded) over the d·c ranks of `dp_cp_group`; the data is split over the d data-parallel ranks only.

One grid object is built per process and passed explicitly; there is no module-level group state.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from mlplat.parallel.communicators import create_communicators


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


class ParallelGrid:
    """rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)): tensor-parallel innermost, then context,
    data, pipeline outermost.

    Real mode (default) creates the process groups of an initialized torch.distributed world (or, when
    it is not initialized, allows only the trivial 1x1x1x1 grid). ``virtual=True`` creates no groups and
    takes ``rank`` explicitly: it gives layers the sizes and coordinates they need to build shapes,
    e.g. on the meta device when planning a run far larger than this machine. A group of size 1 is
    ``None`` so callers can skip the collective.
    """

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1, *, rank: int | None = None, virtual: bool = False,
                 timeout: timedelta | None = None, io_timeout: timedelta | None = None, device="auto",
                 singleton_groups: bool = False, cp: int = 1):
        # timeout: how long a collective or transfer of this grid's groups may wait (parallel.timeout_s). Every
        # group gets it: a group created without one waits torch's default (30 min on gloo), not the world's.
        # io_timeout: the same for io_group, the world group of the collectives that follow file I/O
        # (checkpoint.timeout_s: saving, verifying, loading, writing the profile); default: timeout.
        # device: where the communicators are created, before any step uses them (mlplat.parallel.communicators);
        # "auto": the current CUDA device on NCCL, else the CPU.
        # singleton_groups: groups of one rank exist too (not None), so that every collective of a step runs even
        # on one GPU: the GPU check meets NCCL's rules at world size 1 (experiments/gpu_check/run.sh).
        self.singleton_groups = singleton_groups
        self.timeout = timeout
        self.io_timeout = io_timeout if io_timeout is not None else timeout
        self.tp = _positive("tp", tp)
        self.pp = _positive("pp", pp)
        self.dp = _positive("dp", dp)
        self.cp = _positive("cp", cp)
        self.dp_cp = self.dp * self.cp  # the ranks that hold one copy of this rank's weights
        self.world_size = self.tp * self.cp * self.pp * self.dp
        self.virtual = bool(virtual)

        if self.virtual:
            rank = 0 if rank is None else rank
        elif dist.is_available() and dist.is_initialized():
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
        self.dp_cp_rank = self.cp_rank + self.cp * self.dp_rank

        # Global ranks of the groups this rank belongs to (known in every mode).
        t_, p_, d_, c_ = self.tp_rank, self.pp_rank, self.dp_rank, self.cp_rank
        self.tp_ranks = [self.rank_of(t, p_, d_, c_) for t in range(self.tp)]
        self.cp_ranks = [self.rank_of(t_, p_, d_, c) for c in range(self.cp)]
        self.dp_ranks = [self.rank_of(t_, p_, d, c_) for d in range(self.dp)]
        self.dp_cp_ranks = [self.dp_cp_rank_of(t_, p_, g) for g in range(self.dp_cp)]
        self.pp_ranks = [self.rank_of(t_, p, d_, c_) for p in range(self.pp)]
        # The word embedding lives on the first stage and (tied) on the last; their gradients are summed.
        self.embedding_ranks = [self.pp_ranks[0], self.pp_ranks[-1]] if self.pp > 1 else []

        self.tp_group = self.cp_group = self.dp_group = self.dp_cp_group = self.pp_group = None
        self.embedding_group = self.io_group = None
        self._p2p_groups: dict[tuple[int, int], object] = {}  # (src, dst) pipeline ranks -> group of this pipeline
        self.communicators_s = 0.0  # how long creating the communicators took
        if not self.virtual and dist.is_available() and dist.is_initialized():
            self._create_groups()
            if device is not None:  # None: left to each group's first use (only to show why they are not)
                self.communicators_s = create_communicators(self, device)

    # ------------------------------------------------------------------ coordinates

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int, cp_rank: int = 0) -> int:
        for name, value, size in (("tp_rank", tp_rank, self.tp), ("pp_rank", pp_rank, self.pp),
                                  ("dp_rank", dp_rank, self.dp), ("cp_rank", cp_rank, self.cp)):
            if not 0 <= value < size:
                raise ValueError(f"{name}={value} is outside [0, {size})")
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

    def dp_cp_rank_of(self, tp_rank: int, pp_rank: int, index: int) -> int:
        """The global rank of the index-th of the d·c ranks that hold (tp_rank, pp_rank)'s weights."""
        return self.rank_of(tp_rank, pp_rank, index // self.cp, index % self.cp)

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(tp_rank, pp_rank, dp_rank, cp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside [0, {self.world_size})")
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return tp_rank, pp_rank, dp_rank, cp_rank

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
        tp, pp, dp, cp = self.tp, self.pp, self.dp, self.cp
        R = self.rank_of

        def make(all_ranks: list[list[int]]):
            mine = None
            for ranks in all_ranks:
                if len(ranks) < 2 and not self.singleton_groups:
                    continue
                group = dist.new_group(ranks=ranks, timeout=self.timeout)
                if self.rank in ranks:
                    mine = group
            return mine

        every = [(t, p, d, c) for t in range(tp) for p in range(pp) for d in range(dp) for c in range(cp)]
        self.tp_group = make([[R(t, p, d, c) for t in range(tp)] for (t0, p, d, c) in every if t0 == 0])
        self.cp_group = make([[R(t, p, d, c) for c in range(cp)] for (t, p, d, c0) in every if c0 == 0])
        self.dp_group = make([[R(t, p, d, c) for d in range(dp)] for (t, p, d0, c) in every if d0 == 0])
        if cp > 1:  # at c = 1 the ranks of one copy of the weights are the data-parallel group itself
            self.dp_cp_group = make([[self.dp_cp_rank_of(t, p, g) for g in range(dp * cp)]
                                     for (t, p, d, c) in every if d == c == 0])
        else:
            self.dp_cp_group = self.dp_group
        self.pp_group = make([[R(t, p, d, c) for p in range(pp)] for (t, p0, d, c) in every if p0 == 0])
        # One group per direction of each pair of neighbouring stages, wrap-around included (interleaving sends
        # from the last stage to the first): NCCL then runs each direction on a communicator of its own, so a
        # send never queues behind a receive (mlplat/parallel/pipeline/exchange.py).
        for a, b in self.p2p_channels(pp):
            for (t, p, d, c) in every:
                if p == 0:
                    group = dist.new_group(ranks=[R(t, a, d, c), R(t, b, d, c)], timeout=self.timeout)
                    if (t, d, c) == (self.tp_rank, self.dp_rank, self.cp_rank):
                        self._p2p_groups[(a, b)] = group
        if pp > 1:
            self.embedding_group = make([[R(t, 0, d, c), R(t, pp - 1, d, c)] for (t, p, d, c) in every if p == 0])
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
