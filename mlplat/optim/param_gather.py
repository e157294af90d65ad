"""Parameters sharded over the data-parallel ranks (`optim.sharding=params`: ZeRO-3, FSDP's full sharding).

Each rank keeps 1/d of every bucket's weights (`Bucket.shard`) and gradients (`Bucket.grad_shard`); a bucket's full
weights (`param_flat`, whose views the parameters are) exist only while it is in use, its full gradients
(`grad_flat`) from a micro-batch's first gradient to their reduce-scatter (`ParamBuffers.each_micro_batch`; through
the pass under a split backward). Freeing is the storage's `resize_(0)`: the parameters stay views of the same
storage, so autograd's saved references to them read the weights again once they are gathered back. A layer's FP8
weight casts go with its weights (`release_unit`).

Units. A chunk names its gathering units (`sharding_units()`: its transformer layers and the multi-token
prediction's); the buckets never span two (`backward_buckets(unit_of=...)`). Every other parameter of a chunk (the
embeddings, the final norm, the output layer, the multi-token prediction's norms and projection) is gathered at
the first forward of any chunk on the rank and kept until the optimizer changes it (`release` from
`ParamBuffers.publish`): those are read across modules (the tied output layer reads the word embedding, zbv's last
chunk the first chunk's), which no module hook can see.

A unit in a pass:
- forward: its pre-hook starts its all-gather (unless its neighbour's prefetch did) and the next unit's, so the
  next gather overlaps this unit's compute, then waits for its own; its post-hook frees it (reshard after
  forward: a schedule keeps up to p micro-batches in flight, whose activations, not weights, it should hold) and
  hooks its output.
- backward: the output's gradient arriving means backward is about to run the unit, and is done with the next one
  (whose input it is: the residual branch included): that hook frees the next unit, gathers this one again and
  starts the previous unit's, so two units are gathered at a time in backward too. A hook on the unit's input
  frees it where no previous unit's hook will (a chunk's first unit). A deferred weight gradient (the zero-bubble
  W) reads the layer's input and output gradient, not its weights.
- recomputation (`kernels.recompute=full`) reruns the unit's forward inside backward: the pre-hook gathers it (no
  output hook asked for it: the first forward ran without gradients) and prefetches the previous unit, whose
  recomputation comes next; the post-hook does not free inside a backward (torch's graph task id says where it
  runs); the input hook then frees it. Selective recomputation reruns a core that reads no parameter.
- at a chunk's end its units are freed: a prefetch its forward did not use (the multi-token prediction's first layer,
  when the chunk returns logits) does not stay.

Every rank of a data-parallel group runs the same schedule and so the same hooks in the same order: they post the
same all-gathers in the same order (docs/gpu-nccl.md: a communicator is a FIFO with no tags). Each gather is
waited for before its buffer is read or freed; freeing on a GPU returns the memory to the caching allocator on the
compute stream, after the wait that ordered the gather's stream before it.

No Lightning and no Hydra here.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from mlplat.parallel.mappings import all_gather_into

__all__ = ["ParamGather", "gathering_units", "materialise", "free", "alive"]


def alive(t: torch.Tensor) -> bool:
    """Whether `t`'s storage holds memory (a freed buffer's is resized to zero bytes)."""
    return t.untyped_storage().nbytes() > 0


def materialise(t: torch.Tensor) -> None:
    """Give a freed flat buffer its memory back (contents undefined); its views see it again."""
    if not alive(t):
        t.untyped_storage().resize_(t.numel() * t.element_size())


def free(t: torch.Tensor) -> None:
    """Free a flat buffer's memory, keeping the tensor and its views (their storage is resized to 0 bytes)."""
    t.untyped_storage().resize_(0)


def gathering_units(chunks: dict[int, nn.Module]) -> list[tuple[int, nn.Module]]:
    """(chunk, module) of every gathering unit of the chunks, in forward order: the modules a chunk names in
    `sharding_units()`, whose parameters no other module reads."""
    return [(c, m) for c in sorted(chunks) for m in getattr(chunks[c], "sharding_units", lambda: [])()]


def _in_backward() -> bool:
    """Whether this runs inside an autograd backward (a recomputation's forward)."""
    return torch._C._current_graph_task_id() != -1


class ParamGather:
    """The all-gathers and frees of the sharded buckets of `buffers` (the gradient buffer, `ParamBuffers`, which
    owns this and imports this module), driven by hooks on the chunks and the units. A bucket (`Bucket`) is
    sharded when its `shard` is set."""

    def __init__(self, buffers, chunks: dict[int, nn.Module], units: list[tuple[int, nn.Module]]):
        self.sharded = [b for b in buffers.buckets if b.shard is not None]
        self.of_unit = {u: [b for b in self.sharded if b.unit == u] for u in range(len(units))}
        self.rest = [b for b in self.sharded if b.unit is None]
        self.live: set[int] = set()  # id of the buckets whose param_flat holds the current weights
        self.next = {u: u + 1 for u in range(len(units) - 1) if units[u][0] == units[u + 1][0]}
        self.prev = {v: u for u, v in self.next.items()}
        self.modules = [m for _, m in units]
        self.hooks = [chunk.register_forward_pre_hook(self._before_chunk) for chunk in chunks.values()]
        # at a chunk's end none of its units is in use: a prefetch its forward did not reach (the multi-token
        # prediction's first layer when the chunk only returns logits) is freed there
        units_of = {c: [u for u, (cu, _) in enumerate(units) if cu == c] for c in chunks}
        self.hooks += [chunk.register_forward_hook(partial(self._after_chunk, units_of[c]))
                       for c, chunk in chunks.items()]
        for u, (_, module) in enumerate(units):
            self.hooks.append(module.register_forward_pre_hook(partial(self._before_unit, u)))
            self.hooks.append(module.register_forward_hook(partial(self._after_unit, u)))
        for b in self.sharded:
            free(b.param_flat)
            free(b.grad_flat)

    # -- one bucket -------------------------------------------------------------------------------------
    def gather(self, b) -> None:
        """Start b's all-gather into its full buffer, unless it holds the weights or one is in flight."""
        if id(b) in self.live or b.gather is not None:
            return
        materialise(b.param_flat)
        b.gather = all_gather_into(b.param_flat, b.shard, b.group, async_op=True)

    def ready(self, b) -> None:
        """b's full weights, gathered (started here if nothing started it)."""
        self.gather(b)
        if b.gather is not None:
            b.gather.wait()
            b.gather = None
            self.live.add(id(b))

    def release(self, b) -> None:
        """Free b's full weights (after any gather in flight into them)."""
        if b.gather is not None:
            b.gather.wait()
            b.gather = None
        self.live.discard(id(b))
        if alive(b.param_flat):
            free(b.param_flat)

    def release_unit(self, u: int) -> None:
        """Free unit u's full weights, and the FP8 casts its layers keep of them (`mlplat.parallel.fp8.WeightCasts`:
        a layer's GEMM holds its store as `gemm.casts`), so that a gather is cast once and its casts go with it."""
        for b in self.of_unit[u]:
            self.release(b)
        for m in self.modules[u].modules():
            gemm = getattr(m, "gemm", None)
            if getattr(gemm, "casts", None) is not None:
                gemm.casts.drop(gemm)

    def wait(self) -> None:
        """Wait for every gather in flight (a prefetch whose unit has not run)."""
        for b in self.sharded:
            if b.gather is not None:
                self.ready(b)

    # -- hooks --------------------------------------------------------------------------------------------
    def _before_chunk(self, module: nn.Module, args) -> None:
        for b in self.rest:
            self.gather(b)
        for b in self.rest:
            self.ready(b)

    def _after_chunk(self, units: list[int], module: nn.Module, args, out) -> None:
        for u in units:
            self.release_unit(u)

    def _use(self, u: int, ahead: int | None) -> None:
        """Unit u's weights gathered for use, after posting the gather of unit `ahead` (the prefetch that overlaps
        u's compute; None: none), in that order on every rank."""
        for b in self.of_unit[u]:
            self.gather(b)
        for b in self.of_unit.get(ahead, ()):
            self.gather(b)
        for b in self.of_unit[u]:
            self.ready(b)

    def _before_unit(self, u: int, module: nn.Module, args) -> None:
        # prefetch the next unit; in a recomputation (inside backward) the previous one, whose recomputation and
        # backward come next
        self._use(u, self.prev.get(u) if _in_backward() else self.next.get(u))
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(partial(self._after_unit_backward, u))

    def _after_unit(self, u: int, module: nn.Module, args, out) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
            out.register_hook(partial(self._before_unit_backward, u))
        if not _in_backward():
            self.release_unit(u)

    def _before_unit_backward(self, u: int, grad: torch.Tensor) -> None:
        if u in self.next:  # its output is the next unit's input: that one is done
            self.release_unit(self.next[u])
        self._use(u, self.prev.get(u))

    def _after_unit_backward(self, u: int, grad: torch.Tensor) -> None:
        self.release_unit(u)

    def remove_hooks(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
