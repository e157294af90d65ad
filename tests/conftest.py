import os

# Tests never reach W&B's servers, and each worker process uses one thread (2-core CI machines).
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HYDRA_FULL_ERROR", "1")
# NCCL-strict: every rank's gloo transfers block where NCCL's host would (mlplat.harness.nccl_strict), so an order
# of first uses that deadlocks on NCCL deadlocks in the tests too.
os.environ.setdefault("MLPLAT_NCCL_STRICT", "1")
