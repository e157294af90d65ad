"""Checkpoint save and verification at scale: each rank checksums its own shards, in parallel, vs rank 0 alone.

    python experiments/checkpoint_bench/bench.py                 # ~2.4 GB over 4 ranks, a few minutes on 2 cores
    python experiments/checkpoint_bench/bench.py --layers 2      # ~1.2 GB

A GPT with tensor parallelism t=4 on 4 gloo CPU processes (hidden 2048, 4 layers: ~200M parameters, so ~2.4 GB
of float32 weights and Adam moments) is saved with `mlplat.checkpoint.io.save`, which reports per rank how long
DCP took to write its shards and how long the rank took to checksum them. Then the checkpoint is verified
twice as a load would: `verify_together` (every rank checksums its own share, at once) and the old way (rank 0
checksums every file while the other ranks wait in a barrier), each from the page cache (warm: right after the
save) and from disk (cold: the files evicted from the page cache with posix_fadvise(DONTNEED) first, as on a
node that did not write them). Last, single-thread throughput of candidate checksums over one shard.
Figures are wall-clock seconds, the slowest rank for collective phases. The folder is deleted at the end.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WORLD = 4


def _evict(folder: Path) -> None:
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed_collective(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _checksum_speeds(path: Path) -> dict[str, float]:
    """GB/s of one pass over `path` (warm) per checksum, 16 MiB blocks, one thread."""
    size = path.stat().st_size

    def run(make, update) -> float:
        t0 = time.perf_counter()
        state = make()
        with open(path, "rb", buffering=0) as f:
            while block := f.read(1 << 24):
                state = update(block, state)
        return size / (time.perf_counter() - t0) / 1e9

    def hashing(name: str):
        def update(block, h):
            h.update(block)
            return h
        return lambda: hashlib.new(name), update

    out = {"read only": run(lambda: None, lambda b, s: s),
           "zlib.crc32": run(lambda: 0, zlib.crc32),
           "zlib.adler32": run(lambda: 1, zlib.adler32)}
    for name in ("md5", "sha1", "blake2b"):
        out[f"hashlib.{name}"] = run(*hashing(name))
    return out


def _rank_main(rank: int, world: int, root: str, layers: int, hidden: int) -> dict:
    import torch.distributed as dist

    from mlplat.checkpoint import io
    from mlplat.config import load_config
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.step import TrainStep

    raw = {"model": dict(n_layers=layers, hidden=hidden, n_heads=16, seq_len=128, vocab_size=256, dropout=0.0),
           "parallel": dict(tp=world, pp=1, vpp=1, dp=1, micro_batch_size=1, global_batch_size=1),
           "trainer": dict(max_steps=1, precision="32-true"), "logger": dict(name="none"),
           "sample": dict(max_new_tokens=0), "seed": 1}
    cfg = load_config(raw, world_size=world)
    module = TrainStep(cfg, ParallelGrid(world, 1, 1))
    opt = module.optimizer
    out: dict = {}
    path = Path(root) / "step-1"
    wall = _timed_collective(lambda: io.save(path, module.chunks, opt, module.grid, {"global_step": 1},
                                             {"tp": world}))
    out["save"] = dict(io.last_save_seconds, wall=wall)
    out["bytes"] = {f.name: f.stat().st_size for f in path.iterdir()}
    module = opt = None  # free the chunks before the next size (the lambda above held them)

    def serial() -> None:
        if rank == 0:
            io.verify(path)

    for temp in ("warm", "cold"):
        for name, fn in (("parallel", lambda: io.verify_together(path)), ("rank 0 alone", serial)):
            if temp == "cold" and rank == 0:
                _evict(path)
            out[f"verify {name} ({temp})"] = _timed_collective(fn)
    if rank == 0:
        out["checksums GB/s"] = _checksum_speeds(path / "__0_0.distcp")
    dist.barrier()
    return out


def main() -> None:
    from mlplat.harness.launch import launch as run_distributed

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mlplat-ckpt-bench-"))
    try:
        res = run_distributed(_rank_main, WORLD, str(root), args.layers, args.hidden, timeout=3000)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = sum(res[0]["bytes"].values())
    print(f"checkpoint: {total / 1e9:.2f} GB in {len(res[0]['bytes'])} files over {WORLD} ranks "
          f"(largest {max(res[0]['bytes'].values()) / 1e6:.0f} MB); {os.cpu_count()} CPU cores")
    print("save, per rank (s):   " + "  ".join(
        f"r{r}: write {x['save']['write']:.2f} checksum {x['save']['checksum']:.2f}" for r, x in enumerate(res)))
    write = max(x["save"]["write"] for x in res)
    check = max(x["save"]["checksum"] for x in res)
    print(f"save: wall {res[0]['save']['wall']:.2f} s = write {write:.2f} s (slowest rank) + own-shard checksums "
          f"{check:.2f} s (slowest rank): checksum/write = {check / write:.2f}")
    for key in [k for k in res[0] if k.startswith("verify")]:
        t = max(x[key] for x in res)
        print(f"{key:28s} {t:7.2f} s   {total / t / 1e9:5.2f} GB/s   vs write {t / write:5.2f}x")
    print("checksum throughput over one shard, one thread, warm (GB/s): " +
          ", ".join(f"{k} {v:.2f}" for k, v in res[0]["checksums GB/s"].items()))


if __name__ == "__main__":
    main()
