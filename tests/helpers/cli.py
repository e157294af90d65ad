"""Run `python -m mlplat.train` as a user would, and read what it wrote.

A launch costs little more than its steps: each run is forked from one server process that imported torch,
Lightning and mlplat once for the whole session (multiprocessing's forkserver, with those modules preloaded and no
tensor work done), then runs `python -m mlplat.train ARGS` in-process as a new interpreter would (`runpy`), in its
own environment and working directory, its stdout and stderr in files. From there on it is the CLI: Hydra, the
launcher (which forks the other ranks), Lightning. What only a new interpreter shows (its exit through signals, the
processes the launcher starts, torchrun) is tested with real subprocesses in tests/cli/test_signals.py,
test_launch.py and test_checkpoint.py's dead-rank test.
"""
from __future__ import annotations

import csv
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers.dist import PRELOAD  # one forkserver for the session, one list of what it imports
from tests.helpers.paths import REPO

_CONTEXT: list = []  # the forkserver context, made on first use (one server per test process)


def _context():
    if not _CONTEXT:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def _run_module(module: str, args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """In the forked process: `python -m MODULE ARGS` with `env` in `cwd`, fds 1 and 2 in the files `out`, `err`."""
    from mlplat.lightning.launcher import run_as_main

    def to_files() -> None:
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)

    run_as_main(module, args, env, cwd, to_files)


def run_module(args: list[str], *, module: str = "mlplat.train", timeout: float = 600,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` in REPO, forked from the preloaded server: returncode, stdout, stderr. `env` is the
    whole environment (default: this process's), W&B offline and silent unless it says otherwise."""
    return run_modules(args, [env], module=module, timeout=timeout)[0]


def run_modules(args: list[str], envs: list[dict | None], *, module: str = "mlplat.train",
                timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """`run_module` once per environment of `envs`, all at once (the nodes of one job), each finished process."""
    with tempfile.TemporaryDirectory(prefix="mlplat-cli-") as tmp:
        started = []
        for i, env in enumerate(envs):
            full_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", **(os.environ if env is None else env)}
            out, err = os.path.join(tmp, f"stdout{i}"), os.path.join(tmp, f"stderr{i}")
            proc = _context().Process(target=_run_module, args=(module, list(args), str(REPO), full_env, out, err))
            proc.start()
            started.append((proc, out, err))
        deadline = time.monotonic() + timeout
        for proc, _, _ in started:
            proc.join(max(0.0, deadline - time.monotonic()))
        if any(proc.exitcode is None for proc, _, _ in started):
            for proc, _, _ in started:
                proc.kill()
                proc.join()
            raise subprocess.TimeoutExpired([module, *args], timeout, *(Path(f).read_text(errors="replace")
                                                                        for f in started[0][1:]))
        return [subprocess.CompletedProcess([sys.executable, "-m", module, *args], proc.exitcode,
                                            *(Path(f).read_text(errors="replace") for f in (out, err)))
                for proc, out, err in started]


def run_train(run_dir: Path, *overrides: str, timeout: int = 600, check: bool = True,
              env: dict | None = None, module: str = "mlplat.train") -> subprocess.CompletedProcess:
    """Run the CLI with `hydra.run.dir=run_dir`, quiet logging, W&B offline; returns the finished process."""
    proc = run_module([f"hydra.run.dir={run_dir}", *overrides], module=module, timeout=timeout,
                      env={**os.environ, "WANDB_MODE": "offline", **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
                             f"\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def start_endless_run(run_dir: Path, *overrides: str, err: Path | None = None) -> subprocess.Popen:
    """`python -m mlplat.train` in the background, in a session of its own and with no step limit in reach: a test
    kills one of its ranks and watches the job end (W&B offline, stdout discarded, stderr into `err` if given)."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "mlplat.train", f"hydra.run.dir={run_dir}", *overrides, "trainer.max_steps=100000"]
    stderr = open(err, "wb") if err is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                start_new_session=True)
    finally:
        if err is not None:
            stderr.close()  # the child holds its own copy


def forked_ranks(main: subprocess.Popen) -> list[int]:
    """The pids of the ranks the run's process forked (the same command line as it)."""
    children = subprocess.run(["pgrep", "-P", str(main.pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in children if "mlplat.train" in Path(f"/proc/{p}/cmdline").read_text()]


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
