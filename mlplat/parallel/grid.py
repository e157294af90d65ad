"""ParallelGrid: the map between a global rank and its (tensor, pipeline, data) parallel coordinates.

Layout (Narayanan et al., SC21, §3): tensor-parallel ranks are innermost so that the all-reduces of
tensor model parallelism run over the fastest links (inside a node); pipeline stages are outermost
because their point-to-point traffic is the smallest.

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

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
    """rank = tp_rank + tp * (dp_rank + dp * pp_rank): tensor-parallel innermost, then data, pipeline outermost.

    Real mode (default) creates the process groups of an initialized torch.distributed world (or, when
    it is not initialized, allows only the trivial 1x1x1 grid). ``virtual=True`` creates no groups and
    takes ``rank`` explicitly: it gives layers the sizes and coordinates they need to build shapes,
    e.g. on the meta device when planning a run far larger than this machine. A group of size 1 is
    ``None`` so callers can skip the collective.
    """

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1, *, rank: int | None = None, virtual: bool = False,
                 timeout: timedelta | None = None, io_timeout: timedelta | None = None, device="auto",
                 singleton_groups: bool = False):
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
        self.world_size = self.tp * self.pp * self.dp
        self.virtual = bool(virtual)

        if self.virtual:
            rank = 0 if rank is None else rank
        elif dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
            if world != self.world_size:
                raise ValueError(
                    f"world size {world} != tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {self.world_size}"
                )
            if rank is not None and rank != dist.get_rank():
                raise ValueError(f"rank={rank} differs from torch.distributed rank {dist.get_rank()}")
            rank = dist.get_rank()
        else:
            if self.world_size != 1:
                raise ValueError(
                    f"tp={self.tp}, pp={self.pp}, dp={self.dp} needs {self.world_size} processes "
                    "but torch.distributed is not initialized (use virtual=True to plan without groups)"
                )
            if rank not in (None, 0):
                raise ValueError(f"rank={rank} is invalid without torch.distributed (only rank 0)")
            rank = 0
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r} is outside [0, {self.world_size})")

        self.rank = rank
        self.tp_rank, self.pp_rank, self.dp_rank = self.coords(rank)

        # Global ranks of the groups this rank belongs to (known in every mode).
        self.tp_ranks = [self.rank_of(t, self.pp_rank, self.dp_rank) for t in range(self.tp)]
        self.dp_ranks = [self.rank_of(self.tp_rank, self.pp_rank, d) for d in range(self.dp)]
        self.pp_ranks = [self.rank_of(self.tp_rank, p, self.dp_rank) for p in range(self.pp)]
        self.model_parallel_ranks = [
            self.rank_of(t, p, self.dp_rank) for p in range(self.pp) for t in range(self.tp)
        ]
        # The word embedding lives on the first stage and (tied) on the last; their gradients are summed.
        self.embedding_ranks = [self.pp_ranks[0], self.pp_ranks[-1]] if self.pp > 1 else []

        self.tp_group = self.dp_group = self.pp_group = None
        self.embedding_group = self.model_parallel_group = self.io_group = None
        self._p2p_groups: dict[tuple[int, int], object] = {}  # (src, dst) pipeline ranks -> group of this pipeline
        self.communicators_s = 0.0  # how long creating the communicators took
        if not self.virtual and dist.is_available() and dist.is_initialized():
            self._create_groups()
            if device is not None:  # None: left to each group's first use (only to show why they are not)
                self.communicators_s = create_communicators(self, device)

    # ------------------------------------------------------------------ coordinates

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        for name, value, size in (("tp_rank", tp_rank, self.tp), ("pp_rank", pp_rank, self.pp),
                                  ("dp_rank", dp_rank, self.dp)):
            if not 0 <= value < size:
                raise ValueError(f"{name}={value} is outside [0, {size})")
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside [0, {self.world_size})")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return tp_rank, pp_rank, dp_rank

    def stage_rank(self, pipeline_rank: int) -> int:
        """Global rank of pipeline stage ``pipeline_rank`` (mod pp) in this rank's (tp_rank, dp_rank) pipeline.

        The modulo makes the last stage's "next" the first stage: with interleaving, virtual stage
        chunks wrap around the pipeline ranks.
        """
        return self.rank_of(self.tp_rank, pipeline_rank % self.pp, self.dp_rank)

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
        tp, pp, dp = self.tp, self.pp, self.dp

        def make(all_ranks: list[list[int]]):
            mine = None
            for ranks in all_ranks:
                if len(ranks) < 2 and not self.singleton_groups:
                    continue
                group = dist.new_group(ranks=ranks, timeout=self.timeout)
                if self.rank in ranks:
                    mine = group
            return mine

        self.tp_group = make([[self.rank_of(t, p, d) for t in range(tp)] for p in range(pp) for d in range(dp)])
        self.dp_group = make([[self.rank_of(t, p, d) for d in range(dp)] for p in range(pp) for t in range(tp)])
        self.pp_group = make([[self.rank_of(t, p, d) for p in range(pp)] for d in range(dp) for t in range(tp)])
        self.model_parallel_group = make(
            [[self.rank_of(t, p, d) for p in range(pp) for t in range(tp)] for d in range(dp)]
        )
        # One group per direction of each pair of neighbouring stages, wrap-around included (interleaving sends
        # from the last stage to the first): NCCL then runs each direction on a communicator of its own, so a
        # send never queues behind a receive (mlplat/parallel/pipeline/exchange.py).
        for a, b in self.p2p_channels(pp):
            for d in range(dp):
                for t in range(tp):
                    group = dist.new_group(ranks=[self.rank_of(t, a, d), self.rank_of(t, b, d)],
                                           timeout=self.timeout)
                    if (t, d) == (self.tp_rank, self.dp_rank):
                        self._p2p_groups[(a, b)] = group
        if pp > 1:
            self.embedding_group = make(
                [[self.rank_of(t, 0, d), self.rank_of(t, pp - 1, d)] for d in range(dp) for t in range(tp)]
            )
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
        return (
            f"ParallelGrid(tp={self.tp}, pp={self.pp}, dp={self.dp}, rank={self.rank}: "
            f"tp_rank={self.tp_rank}, pp_rank={self.pp_rank}, dp_rank={self.dp_rank}{mode})"
        )
