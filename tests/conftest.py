import os

# Tests never reach W&B's servers, and each worker process uses one thread (2-core CI machines).
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HYDRA_FULL_ERROR", "1")
