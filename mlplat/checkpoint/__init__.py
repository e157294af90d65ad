"""Sharded checkpoints (io.py: save/load/verify on torch.distributed.checkpoint; export.py; state.py)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; str() is one line naming the path and what is wrong.

    Defined here, torch-free, so that `mlplat.train` can catch it without importing torch before it has
    validated the config (a refused config exits in well under a second)."""
