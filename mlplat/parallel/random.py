"""Model-parallel random number generation and activation recomputation.

Dropout outside tensor-parallel regions acts on tensors that are replicated across the tp ranks of a
stage, so those ranks must draw identical masks (the default RNG, seeded identically). Dropout inside
a tensor-parallel region (attention probabilities of this rank's heads) acts on distinct shards, so
each tp rank draws from its own named state, swapped in by ``RNGTracker.fork``.

Activation recomputation (the paper's §3.5; "activation recomputation on" for every run) reruns the
forward of a block during backward, and must replay exactly the same dropout masks: ``checkpoint``
stashes every RNG state it may touch and restores it for the recomputation.

A training step draws from the tracker only: its pipeline runs inside ``fork(STAGE_RNG)``, a stream seeded
like the default generator (same on the tp ranks of a stage), so the model's masks depend on the seed, the
rank and the steps taken — not on whatever else used the default generator (a DataLoader draws a seed from
it each time an iterator is made, e.g. when a resumed run starts or validation runs). ``rng_states`` /
``set_rng_states`` capture and restore all of it for checkpoints.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import Tensor

from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.profile import recomputation

MODEL_PARALLEL_RNG = "model-parallel"
STAGE_RNG = "stage"


def _cuda_in_use() -> bool:
    # Never initialise CUDA as a side effect (CPU runs, forked workers); only track it once it is live.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _cuda_state_for_seed(seed: int) -> Tensor:
    saved = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(seed)
    state = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(saved)
    return state


class RNGTracker:
    """Named RNG states that can be swapped in for the default generator.

    Each state holds the CPU generator state and, when CUDA is in use, the current device's CUDA
    generator state (created lazily from the same seed the first time it is needed).
    """

    def __init__(self):
        self._states: dict[str, dict[str, Any]] = {}
        self.recorder = None  # a profile.Recorder while a profiled step records (recomputations report to it)

    def reset(self) -> None:
        self._states = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        if any(s["seed"] == seed for s in self._states.values()):
            raise ValueError(f"seed {seed} is already used by another RNG state")
        entry = {"seed": int(seed), "cpu": torch.Generator().manual_seed(int(seed)).get_state(), "cuda": None}
        if _cuda_in_use():
            entry["cuda"] = _cuda_state_for_seed(int(seed))
        self._states[name] = entry

    def __contains__(self, name: str) -> bool:
        return name in self._states

    def get_states(self) -> dict:
        """A copy of every named state (safe to keep: later draws do not change it)."""
        return {
            name: {"seed": s["seed"], "cpu": s["cpu"].clone(), "cuda": None if s["cuda"] is None else s["cuda"].clone()}
            for name, s in self._states.items()
        }

    def set_states(self, states: dict) -> None:
        self._states = {
            name: {"seed": s["seed"], "cpu": s["cpu"].clone(), "cuda": None if s["cuda"] is None else s["cuda"].clone()}
            for name, s in states.items()
        }

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with the named state as the default RNG; save its advance back afterwards."""
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} was never added (see seed_model_parallel)")
        entry = self._states[name]
        use_cuda = _cuda_in_use()
        outer_cpu = torch.get_rng_state()
        torch.set_rng_state(entry["cpu"])
        if use_cuda:
            outer_cuda = torch.cuda.get_rng_state()
            if entry["cuda"] is None:
                entry["cuda"] = _cuda_state_for_seed(entry["seed"])
            torch.cuda.set_rng_state(entry["cuda"])
        try:
            yield
        finally:
            # Look the state up again: set_states inside the block (recomputation replaying its RNG inside
            # an outer fork) replaces the entries, and the stream's advance must land in the live one.
            entry = self._states.get(name, entry)
            entry["cpu"] = torch.get_rng_state()
            torch.set_rng_state(outer_cpu)
            if use_cuda:
                entry["cuda"] = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(outer_cuda)


def seed_model_parallel(seed: int, grid: ParallelGrid, tracker: RNGTracker) -> None:
    """Seed the default RNG per pipeline stage (same on all tp ranks) and the tracker per tp rank.

    Data-parallel replicas share seeds: they differ through their data, and identical initialisation
    of replicated parameters is what data parallelism needs anyway.
    """
    default_seed = seed + 100 * grid.pp_rank
    torch.manual_seed(default_seed)  # seeds CUDA too when present
    tracker.reset()
    tracker.add(STAGE_RNG, default_seed)
    tracker.add(MODEL_PARALLEL_RNG, default_seed + 2718 + grid.tp_rank)


def rng_states(tracker: RNGTracker | None) -> dict:
    """Every RNG state of this process: the default CPU generator, the current CUDA device's (when CUDA is in
    use) and the tracker's streams. Plain data (tensors, ints, None): loadable with torch.load(weights_only=True)."""
    cpu, cuda, tracked = _get_rng(tracker)
    return {"cpu": cpu, "cuda": cuda, "tracker": tracked}


def set_rng_states(states: dict, tracker: RNGTracker | None) -> None:
    """Restore what ``rng_states`` captured (a CUDA state is restored only where CUDA is in use)."""
    cuda = states.get("cuda") if _cuda_in_use() else None
    _set_rng((states["cpu"], cuda, states.get("tracker")), tracker)


# ---------------------------------------------------------------------------------------- recompute


def _get_rng(tracker: RNGTracker | None) -> tuple:
    cuda = torch.cuda.get_rng_state() if _cuda_in_use() else None
    return torch.get_rng_state(), cuda, (tracker.get_states() if tracker is not None else None)


def _set_rng(state: tuple, tracker: RNGTracker | None) -> None:
    cpu, cuda, tracked = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    if tracker is not None and tracked is not None:
        tracker.set_states(tracked)


def _get_autocast() -> tuple:
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")), \
        torch.is_autocast_cache_enabled()


@contextlib.contextmanager
def _autocast_as(state: tuple):
    """Re-enter the forward's autocast: recomputation runs in backward, where autocast is off (on CUDA, backward
    even runs on another thread), and would otherwise give float32 activations where the forward's were 16-bit."""
    devices, cache = state
    if not any(enabled for _, enabled, _ in devices):
        yield
        return
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in devices:
            stack.enter_context(torch.autocast(device, enabled=enabled, dtype=dtype, cache_enabled=cache))
        yield


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, tracker, _anchor, *args):
        ctx.function = function
        ctx.tracker = tracker
        ctx.rng = _get_rng(tracker)
        ctx.autocast = _get_autocast()
        # Tensors go through save_for_backward (in-place changes are then detected); the rest is kept as is.
        ctx.tensor_index = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.arg_requires_grad = [torch.is_tensor(a) and a.requires_grad for a in args]
        ctx.other_args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_index])
        with torch.no_grad():
            outputs = function(*args)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.other_args)
        for i, t in zip(ctx.tensor_index, ctx.saved_tensors):
            args[i] = t.detach().requires_grad_(ctx.arg_requires_grad[i])

        # Replay the forward's random streams, then put back whatever state backward found.
        found = _get_rng(ctx.tracker)
        _set_rng(ctx.rng, ctx.tracker)
        try:
            # recomputation: a span of profiled steps (mlplat.parallel.profile; the tracker carries the recorder)
            with torch.enable_grad(), _autocast_as(ctx.autocast), recomputation(ctx.tracker):
                outputs = ctx.function(*args)
        finally:
            _set_rng(found, ctx.tracker)

        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [
            (o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args)
        return (None, None, None) + input_grads


def checkpoint(function: Callable, tracker: RNGTracker | None, *args):
    """Run ``function(*args)`` without keeping its activations; recompute them in backward.

    Dropout masks in the recomputation equal those of the first forward (default CPU/CUDA RNG and
    the tracker's states are replayed), and so does its autocast (mixed-precision) state. ``function`` must return
    a tensor or a tuple of tensors.
    """
    # The anchor makes the output require grad even when no tensor argument does (e.g. a first block
    # fed by data): otherwise backward would never run and the parameters used inside would get no grad.
    device = next((a.device for a in args if torch.is_tensor(a)), None)
    anchor = torch.empty(0, device=device, requires_grad=torch.is_grad_enabled())
    return _Checkpoint.apply(function, tracker, anchor, *args)
