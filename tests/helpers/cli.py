"""Run `python -m mlplat.train` as a user would, and read what it wrote."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import REPO


def run_train(run_dir: Path, *overrides: str, timeout: int = 600, check: bool = True,
              env: dict | None = None, module: str = "mlplat.train") -> subprocess.CompletedProcess:
    """Run the CLI with `hydra.run.dir=run_dir`, quiet logging, W&B offline; returns the finished process."""
    full_env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    cmd = [sys.executable, "-m", module, f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
                             f"\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    with open(Path(run_dir) / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def train_losses(run_dir: Path) -> list[float]:
    return [float(r["train_loss"]) for r in read_metrics(run_dir) if r.get("train_loss")]


def read_wandb_run(run_dir: Path) -> dict:
    """The offline W&B run under `run_dir`, read from its transaction log (`run-ID.wandb`: W&B's record log, 32 KiB
    blocks of checksummed fragments holding protobuf Records): {name, group, config, summary}. Config values and
    summary values are JSON-decoded; a later update of a key wins."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")
    data, block, pos = log.read_bytes(), 32768, 7  # 7: the file header (":W&B", magic, version)
    records, partial = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a fragment header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        partial = chunk if kind in (1, 2) else partial + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            records.append(partial)
    out: dict = {"name": None, "group": None, "config": {}, "summary": {}}
    key = lambda item: item.key or ".".join(item.nested_key)  # noqa: E731
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["name"], out["group"] = rec.run.display_name, rec.run.run_group
            out["config"].update({key(i): json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            out["config"].update({key(i): json.loads(i.value_json) for i in rec.config.update})
        elif kind == "summary":
            out["summary"].update({key(i): json.loads(i.value_json) for i in rec.summary.update})
    return out
