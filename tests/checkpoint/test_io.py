"""Checkpoint internals in one shared gloo group (fast): device discipline, rank-parallel verification, RNG states,
atomic re-saves, plain-data pickles.

Device discipline on a CPU-only machine. A tensor created without naming its device lands on the
default device — the CPU — which on a GPU run is the wrong one, and on a CPU run is indistinguishable from the
right one. So the test does not look at where tensors end up; it looks at how the checkpoint code asks for them:
`FactorySpy`, a `torch.overrides.TorchFunctionMode`, sees every torch call made while a save or a load runs and
records, for each tensor factory (`torch.empty/zeros/ones/full/...`, `*_like`, `Tensor.new_*`) called directly
from mlplat's checkpoint code (the calling frame's file), the device the call names: the `device=` argument, or
the like-tensor's device for `*_like`/`new_*`, or None when the call relies on the default device. The test then
asserts that every recorded device is the parameters' device. `torch.empty(shape, dtype=...)` (the old full-
embedding buffer) or `torch.zeros(())` (the old Adam step) records None and fails it, on CPU. The tensor-parallel
DeviceMesh is checked separately: `as_saved` of a tensor on the `meta` device (a stand-in for "cuda", which a CPU
build cannot allocate) must produce a DTensor whose mesh has device type "meta".
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.helpers.checkpoint import plant_code_running_pickle
from tests.helpers.dist import run_distributed

CHECKPOINT_CODE = (os.sep + os.path.join("mlplat", "checkpoint") + os.sep,
                   os.sep + os.path.join("mlplat", "parallel", "tensor.py"))
FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint, torch.arange,
             torch.tensor, torch.as_tensor, torch.empty_strided, torch.eye, torch.linspace}
LIKE = {torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like,
        torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_full,
        torch.Tensor.new_tensor}


class FactorySpy(TorchFunctionMode):
    """Records (function, file:line, named device, elements created) for tensor factories called from checkpoint
    code."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str, str | None, int | None]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES or func in LIKE:
            frame = sys._getframe(1)  # the code that called the factory (torch's own callees, e.g. DCP, are not ours)
            where = frame.f_code.co_filename
            if any(part in where for part in CHECKPOINT_CODE):
                device = kwargs.get("device")
                if device is None and func in LIKE:
                    device = args[0].device
                self.calls.append((func.__name__, f"{os.path.basename(where)}:{frame.f_lineno}",
                                   None if device is None else str(torch.device(device)),
                                   out.numel() if isinstance(out, torch.Tensor) else None))
        return out


def _module(tp: int, pp: int = 1, vpp: int = 1, schedule: str = "1f1b"):
    from mlplat.config import load_config
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.step import TrainStep

    raw = {"model": dict(n_layers=2 * pp * vpp, hidden=32, n_heads=4, seq_len=16, vocab_size=250, dropout=0.1),
           "parallel": dict(tp=tp, pp=pp, vpp=vpp, dp=1, schedule=schedule, micro_batch_size=2,
                            global_batch_size=4),
           "trainer": dict(max_steps=3, precision="32-true"), "logger": dict(name="none"),
           "sample": dict(max_new_tokens=0), "seed": 7}
    cfg = load_config(raw, world_size=tp * pp, check_data=False)  # token ids of its own
    module = TrainStep(cfg, ParallelGrid(tp, pp, 1, io_timeout=timedelta(seconds=77)))
    return module, module.optimizer


class LoadWatch:
    """Counts io.load's dcp.load calls and records the word embedding's boxes it asks DCP for: key -> [(first row,
    end row, first column, end column)] of the saved table, from the planner's read items."""

    def __init__(self):
        self.calls, self.rows = 0, {}

    def __enter__(self):
        from mlplat.checkpoint import io

        self.io, self.real_load, self.real_plan = io, io.dcp.load, io._RegionLoadPlanner.create_local_plan
        watch = self

        def load(*args, **kwargs):
            watch.calls += 1
            return watch.real_load(*args, **kwargs)

        def plan(planner):
            out = watch.real_plan(planner)
            for item in out.items:
                if item.dest_index.fqn in planner.regions:
                    (r0, c0), (r, c), (n, k) = item.storage_index.offset, item.storage_offsets, item.lengths
                    r, c = r0 + r, c0 + c  # in the saved table (storage_offsets: within the saved chunk)
                    watch.rows.setdefault(item.dest_index.fqn, []).append((r, r + n, c, c + k))
            return out

        io.dcp.load, io._RegionLoadPlanner.create_local_plan = load, plan
        return self

    def __exit__(self, *exc):
        self.io.dcp.load, self.io._RegionLoadPlanner.create_local_plan = self.real_load, self.real_plan


def _in_group(rank, world, root):
    """Everything that needs the tp2 group, in one spawn: device discipline, mesh, per-rank checksums, shared
    verification, RNG states, the word embedding's regions; then zbv pp=2 (no embedding on rank 1)."""
    import torch.distributed as dist

    from mlplat.checkpoint import CheckpointError, io
    from mlplat.checkpoint.state import as_saved, full_parameters
    from mlplat.parallel.random import rng_states

    root = Path(root)
    out: dict = {}
    module, opt = _module(tp=2)
    grid = module.grid
    params = full_parameters(module.chunks)
    device = str(next(iter(params.values())).device)

    # 1. the mesh follows the tensors' device type
    sharded = next(p for p in params.values() if getattr(p, "partition_dim", None) is not None)
    out["mesh"] = (as_saved(sharded.data, sharded, grid).device_mesh.device_type,
                   as_saved(torch.empty(sharded.shape, device="meta"), sharded, grid).device_mesh.device_type)

    # 2. save and load under the spy; also record which files each rank checksums
    checked: list[str] = []
    real_crc = io.crc32
    io.crc32 = lambda path: checked.append(Path(path).name) or real_crc(path)
    try:
        spy = FactorySpy()
        rng = rng_states(module.tracker)
        with spy:
            io.save(root / "step-3", module.chunks, opt, grid, {"global_step": 3}, {"tp": 2},
                    rank_state={"rng": rng})
        out["saved_checked"] = sorted(checked)
        checked.clear()
        module2, opt2 = _module(tp=2)
        # Also which of the checkpoint's files this rank stats, and how often it unpickles DCP's metadata
        import pathlib

        import torch.distributed.checkpoint as dcp
        stats: list[str] = []
        metadata_reads: list[int] = []
        real_stat, real_read = pathlib.Path.stat, dcp.FileSystemReader.read_metadata
        pathlib.Path.stat = lambda self, **kw: (stats.append(self.name) if self.parent.name == "step-3" else None) \
            or real_stat(self, **kw)
        dcp.FileSystemReader.read_metadata = lambda self, *a, **kw: metadata_reads.append(1) or real_read(self, *a,
                                                                                                           **kw)
        try:
            with spy, LoadWatch() as watch:
                io.load(root / "step-3", module2.chunks, opt2, module2.grid, vocab_size=250)
        finally:
            pathlib.Path.stat, dcp.FileSystemReader.read_metadata = real_stat, real_read
        out["load_stats"], out["metadata_reads"] = sorted(set(stats) - {io.MANIFEST}), len(metadata_reads)
        out["load_checked"] = sorted(checked)
        out["dcp_loads"], out["embedding_boxes"] = watch.calls, watch.rows
    finally:
        io.crc32 = real_crc
    out["factory_calls"] = spy.calls
    out["device"] = device
    out["equal"] = all(torch.equal(a, b) for a, b in zip(module.parameters(), module2.parameters()))
    out["io_timeout"] = module2.grid.io_group._get_backend(torch.device("cpu")).options._timeout
    mine, why = io.load_rank_state(root / "step-3", rank, {"tp": 2})
    out["rng_back"] = mine is not None and torch.equal(mine["rng"]["tracker"]["model-parallel"]["cpu"],
                                                       rng["tracker"]["model-parallel"]["cpu"])
    out["rng_other_layout"] = io.load_rank_state(root / "step-3", rank, {"tp": 1})[1]
    out["manifest"] = json.loads((root / "step-3" / "mlplat.json").read_text())

    # 2b. the same state saved behind training by DCP's process of each rank (checkpoint.async_mode=process)
    import multiprocessing

    from torch.distributed.checkpoint import _async_process_executor as executor

    # This harness's ranks are daemonic, which multiprocessing forbids to start a process (mlplat's ranks are not).
    multiprocessing.current_process()._config["daemon"] = False
    saver = io.AsyncSaver(grid, "process")
    saver.save(root / "process" / "step-3", module.chunks, opt, grid, {"global_step": 3}, {"tp": 2},
               rank_state={"rng": rng})
    saver.wait()
    child = executor._CHECKPOINT_PROCESS._save_process
    out["process"] = (child.pid != os.getpid() and child.is_alive(), (root / "process" / io.LATEST).read_text())
    saver.close()
    out["process"] += (executor._CHECKPOINT_PROCESS is None and not child.is_alive(),
                       json.loads((root / "process" / "step-3" / "mlplat.json").read_text()))
    io.verify_together(root / "process" / "step-3")
    module3, opt3 = _module(tp=2)
    io.load(root / "process" / "step-3", module3.chunks, opt3, module3.grid, vocab_size=250)
    out["process"] += (all(torch.equal(a, b) for a, b in zip(module.parameters(), module3.parameters())),)

    # 3. a corrupt file found by one rank is refused by all, with the same line
    dist.barrier()
    if rank == 0:
        shard = root / "step-3" / "__1_0.distcp"  # rank 1's file: rank 1 checks it
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    dist.barrier()
    try:
        io.verify_together(root / "step-3")
        out["corrupt"] = None
    except CheckpointError as e:
        out["corrupt"] = str(e)

    # 4. zbv pp=2: the embedding (and the V's output layer, the same parameter) only on rank 0; one dcp.load on
    # both ranks all the same, and the resumed state equals the saved one.
    from mlplat.checkpoint.state import optimizer_state_of

    module, opt = _module(tp=1, pp=2, vpp=2, schedule="zbv")
    saved = full_parameters(module.chunks)
    with torch.no_grad():  # a state unlike a fresh module's (padding rows included: a load must zero them)
        for i, p in enumerate(saved.values()):
            p.mul_(2).add_(0.5)
            for k, moment in (("exp_avg", 0.25 + i), ("exp_avg_sq", 0.5 + i)):
                optimizer_state_of(opt, p)[k].fill_(moment)
    io.save(root / "zbv", module.chunks, opt, module.grid, {"global_step": 0}, {"tp": 1})
    module2, opt2 = _module(tp=1, pp=2, vpp=2, schedule="zbv")
    with LoadWatch() as watch:
        io.load(root / "zbv", module2.chunks, opt2, module2.grid, vocab_size=250)
    loaded = full_parameters(module2.chunks)
    same = loaded.keys() == saved.keys()
    for name, p in loaded.items():
        q, rows = saved[name], 250 if name == "embedding.word.weight" else None
        for a, b in [(p.data, q.data), *((opt2.state[p][k], opt.state[q][k]) for k in ("exp_avg", "exp_avg_sq"))]:
            padding_zero = rows is None or not a[rows:].any()
            same &= torch.equal(a[:rows], b[:rows]) and padding_zero
    out["zbv"] = (watch.calls, watch.rows, "embedding.word.weight" in loaded, same)
    return out


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    return run_distributed(_in_group, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=240)


def test_every_tensor_checkpoint_code_creates_names_the_parameters_device(group_results):
    for res in group_results:
        assert res["factory_calls"], "the spy saw no factory call: it is not watching the checkpoint code"
        names = {c[0] for c in res["factory_calls"]}
        assert {"zeros", "zeros_like"} <= names, names  # Adam step, Adam moments
        wrong = [c for c in res["factory_calls"] if c[2] != res["device"]]
        assert not wrong, f"tensors created off the parameters' device {res['device']}: {wrong}"
        # Nothing the size of the whole word embedding (256 padded rows x 32) is created: each rank reads its rows.
        big = [c for c in res["factory_calls"] if c[3] is not None and c[3] >= 256 * 32]
        assert not big, big


def test_load_is_one_dcp_load_and_each_rank_reads_its_own_embedding_rows(group_results):
    """tp2, vocabulary 250 padded to 256: rank 0 asks DCP for rows [0, 128) of the saved table, rank 1 for [128, 250)
    (its 6 padding rows are zeroed, never read), for the weights and both moments, in the one dcp.load of everything.
    zbv pp=2: only rank 0 holds the embedding (its V's output layer is the same parameter); both ranks still make
    exactly one dcp.load (the old code made three on rank 0 and one on rank 1: a hang), and the state comes back."""
    keys = {"model/embedding.word.weight", "optim/embedding.word.weight/exp_avg",
            "optim/embedding.word.weight/exp_avg_sq"}
    for rank, res in enumerate(group_results):
        assert res["dcp_loads"] == 1
        assert res["embedding_boxes"].keys() == keys
        for key, boxes in res["embedding_boxes"].items():
            assert sorted(boxes) == [(128 * rank, 250 if rank else 128, 0, 32)], (key, boxes)
        assert res["io_timeout"] == timedelta(seconds=77)  # the grid's io_group waits checkpoint.timeout_s
    (calls0, boxes0, holds0, same0), (calls1, boxes1, holds1, same1) = (r["zbv"] for r in group_results)
    assert (calls0, calls1) == (1, 1) and (holds0, holds1) == (True, False)
    assert boxes1 == {} and boxes0.keys() == keys and all(b == [(0, 250, 0, 32)] for b in boxes0.values())
    assert same0 and same1


def test_tensor_parallel_mesh_takes_the_tensors_device_type(group_results):
    for res in group_results:
        assert res["mesh"] == ("cpu", "meta")


def test_each_rank_checksums_only_its_own_files(group_results):
    r0, r1 = group_results
    assert r0["saved_checked"] == [".metadata", "__0_0.distcp", "lightning.pt", "rank-0.pt"]
    assert r1["saved_checked"] == ["__1_0.distcp", "rank-1.pt"]
    files = r0["manifest"]["files"]
    assert {n: e["rank"] for n, e in files.items()} == {".metadata": 0, "__0_0.distcp": 0, "lightning.pt": 0,
                                                        "rank-0.pt": 0, "__1_0.distcp": 1, "rank-1.pt": 1}
    # On load (same layout) each rank checksums the files it wrote: every file exactly once in all; it stats only
    # those too (at thousands of ranks, every rank checking every file is millions of metadata operations), and
    # unpickles DCP's metadata once.
    assert r0["load_checked"] == r0["saved_checked"] and r1["load_checked"] == r1["saved_checked"]
    assert r0["load_stats"] == r0["saved_checked"] and r1["load_stats"] == r1["saved_checked"]
    assert r0["metadata_reads"] == r1["metadata_reads"] == 1
    assert r0["equal"] and r1["equal"]


def test_a_save_by_dcps_process_commits_the_same_checkpoint(group_results):
    """checkpoint.async_mode=process: DCP's process of each rank (spawned at the first save, ended by close) writes
    the shards; the commit is the thread's: each rank checksums the files it wrote (named from DCP's metadata), the
    manifest, the rename, `latest`. The shards and RNG states are the synchronous save's, bit for bit, and load back."""
    for res in group_results:
        spawned, latest, ended, manifest, loads = res["process"]
        assert spawned and ended and latest.strip() == "step-3" and loads
        sync = res["manifest"]["files"]
        assert {n: e["rank"] for n, e in manifest["files"].items()} == {n: e["rank"] for n, e in sync.items()}
        same = [n for n in sync if n.endswith(".distcp") or n.startswith("rank-")]  # .metadata names its save
        assert [manifest["files"][n] for n in same] == [sync[n] for n in same]


def test_a_corrupt_file_is_refused_by_every_rank_with_one_line(group_results):
    lines = [res["corrupt"] for res in group_results]
    assert lines[0] == lines[1] and "__1_0.distcp fails its CRC32 check" in lines[0], lines


def test_rng_states_are_saved_per_rank_and_kept_only_for_the_same_layout(group_results):
    for res in group_results:
        assert res["rng_back"]
        assert "another layout" in res["rng_other_layout"]


def test_share_of_files_covers_every_file_once():
    from mlplat.checkpoint.io import share_of_files

    files = {f"__{r}_0.distcp": {"bytes": 100 + r, "crc32": 0, "rank": r} for r in range(4)}
    files[".metadata"] = {"bytes": 5, "crc32": 0, "rank": 0}
    files["old"] = {"bytes": 50, "crc32": 0}  # no writer recorded (an older manifest)
    for world in (1, 2, 4, 8):
        shares = [share_of_files(files, world, r) for r in range(world)]
        flat = sorted(n for s in shares for n in s)
        assert flat == sorted(files), world
    # Same world: a rank checks what it wrote; a smaller world spreads the orphans by bytes.
    assert share_of_files(files, 4, 2) == ["__2_0.distcp"]
    two = [share_of_files(files, 2, r) for r in range(2)]
    assert set(two[0]) >= {"__0_0.distcp", ".metadata"} and "__1_0.distcp" in two[1]


def test_resaving_a_step_never_leaves_it_without_a_complete_checkpoint(tmp_path):
    from mlplat.checkpoint import io

    module, opt = _module(tp=1)
    root = tmp_path / "checkpoints"
    seen: list[bool] = []
    real_replace = os.replace

    def watching_replace(src, dst):  # after each rename, a complete step-2 is findable
        real_replace(src, dst)
        last = io.find_last(root)
        seen.append(last is not None and (last / io.MANIFEST).exists() and io.checkpoint_dirs(root)[-1][0] == 2)

    io.save(root / "step-2", module.chunks, opt, module.grid, {"global_step": 2}, {"tp": 1})
    io.os.replace = watching_replace
    try:
        io.save(root / "step-2", module.chunks, opt, module.grid, {"global_step": 2}, {"tp": 1})
    finally:
        io.os.replace = real_replace
    assert len(seen) >= 3 and all(seen[1:]), seen  # [0] is the manifest's own rename inside the partial folder
    assert sorted(p.name for p in root.iterdir()) == [io.LATEST, "step-2"]
    io.verify(root / "step-2")
    # A save killed between its two renames leaves only step-2.old-*: it still counts as step 2.
    aside = root / "step-2.old-0123abcd"
    os.rename(root / "step-2", aside)
    assert io.find_last(root) == aside
    (root / "step-1").mkdir()
    assert io.find_last(root) == aside


def test_the_last_checkpoint_is_the_one_committed_last_and_never_a_guess(tmp_path, caplog):
    """A run branched from an earlier step saves below the highest step: `find_last` follows the commits (the
    folder's `latest`). Without that record, or when it names no checkpoint, which one continues the run cannot be
    told: refused in one line listing what is there (an older mlplat's `step-N-vK` too), never the highest step. A
    checkpoint saved inside a run of skipped steps is committed but not `latest`, said in one line."""
    from mlplat.checkpoint import CheckpointError, io

    module, opt = _module(tp=1)
    root = tmp_path / "checkpoints"
    assert io.find_last(root) is None
    for step in (2, 4, 3):
        io.save(root / f"step-{step}", module.chunks, opt, module.grid, {"global_step": step}, {"tp": 1})
    assert io.find_last(root) == root / "step-3"
    with caplog.at_level("WARNING", logger="mlplat"):
        io.save(root / "step-5", module.chunks, opt, module.grid, {"global_step": 5}, {"tp": 1}, skipped=2)
    assert "checkpoint step-5 was saved after 2 skipped steps in a row (an inf/NaN loss or gradient norm): not " \
           "recorded as the latest, which stays step-3; resume it only by its path" in caplog.text
    assert io.find_last(root) == root / "step-3" and io.verify(root / "step-5")["step"] == 5
    shutil.rmtree(root / "step-3")  # deleted by hand
    with pytest.raises(CheckpointError) as info:
        io.find_last(root)
    assert str(info.value) == (f"ckpt_path=last: {root} holds step-2, step-4, step-5 but its latest record names "
                               f"step-3, which is not there: resume one by its path, ckpt_path={root}/step-N")
    (root / io.LATEST).unlink()  # removed, or a folder written before the record existed
    (root / "step-2-v1").mkdir()  # ... where a re-save of step 2 became Lightning's second version
    with pytest.raises(CheckpointError, match=r"holds step-2, step-4, step-5, step-2-v1 but no latest record says"):
        io.find_last(root)
    # One checkpoint copied into a new run directory, no record: no lineage to tell apart, that one, said.
    alone = tmp_path / "copied" / "checkpoints"
    shutil.copytree(root / "step-4", alone / "step-4")
    with caplog.at_level("INFO", logger="mlplat"):
        assert io.find_last(alone) == alone / "step-4"
    assert f"ckpt_path=last: {alone} holds one checkpoint and no latest record: resuming step-4" in caplog.text


def test_a_branch_moves_the_later_steps_aside_with_their_latest(tmp_path):
    """Resuming step-2 of a folder that holds steps 1-4 (and an older mlplat's step-3-v1): steps 3, 4 and step-3-v1
    move to abandoned/<time>/ with the `latest` they had; `latest` names step-2 first; a second branch in the same
    second gets a folder of its own. Nothing later: `latest` still names the resumed step."""
    from mlplat.checkpoint import io

    root = tmp_path / "checkpoints"
    for name in ("step-1", "step-2", "step-3", "step-3-v1", "step-4", "step-10.old-0123abcd"):
        (root / name).mkdir(parents=True)
    io.write_latest(root, "step-4")
    aside, moved = io.set_aside_later(root / "step-2")
    assert moved == ["step-3", "step-3-v1", "step-4", "step-10.old-0123abcd"]
    assert aside.parent == root / io.ABANDONED and io.latest_name(aside) == "step-4"
    assert sorted(p.name for p in aside.iterdir()) == sorted([*moved, io.LATEST])
    assert sorted(p.name for p in root.iterdir()) == [io.ABANDONED, io.LATEST, "step-1", "step-2"]
    assert io.find_last(root) == root / "step-2"
    (root / "step-3").mkdir()
    again, _ = io.set_aside_later(root / "step-1")
    assert again != aside and again.parent == aside.parent and io.latest_name(root) == "step-1"
    assert io.set_aside_later(root / "step-1") is None and io.latest_name(root) == "step-1"


def test_a_pickle_that_runs_code_is_refused_by_load_and_export(tmp_path):
    from mlplat.checkpoint import CheckpointError, io
    from mlplat.checkpoint.export import main as export_main

    module, opt = _module(tp=1)
    ckpt = tmp_path / "step-2"
    io.save(ckpt, module.chunks, opt, module.grid, {"global_step": 2}, {"tp": 1})
    marker = tmp_path / "MARKER"
    plant_code_running_pickle(ckpt, marker)
    io.verify(ckpt, checksum=[])  # sizes match: only the content is hostile
    with pytest.raises(CheckpointError, match=r"checkpoint .*step-2 is refused: lightning.pt is not plain data"):
        io.load(ckpt, module.chunks, opt, module.grid, vocab_size=250)
    assert export_main([str(ckpt), str(tmp_path / "out.pt")]) == 2
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists()


def test_export_refuses_bad_arguments_in_one_line_before_reading(tmp_path, capsys):
    """Each refusal comes before the checkpoint is read (here it does not even exist): a load can take minutes."""
    from mlplat.checkpoint.export import main as export_main

    never = str(tmp_path / "no-such-checkpoint")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "config.json").write_text("{}")
    cases = {**{(str(tmp_path / "hf"), "--format", "hf", "--max-shard-gb", gb): f"--max-shard-gb={float(gb)} must be a "
                f"positive number of GB" for gb in ("-1", "nan", "inf")},
             (str(tmp_path / "m.pt"), "--vocab-size", "0"): "--vocab-size=0 must be at least 1",
             (str(tmp_path / "missing" / "m.pt"),): f"{tmp_path / 'missing' / 'm.pt'}: its folder "
                                                    f"{tmp_path / 'missing'} does not exist",
             (str(taken), "--format", "hf"): f"{taken} exists; pass --overwrite to replace it"}
    for args, line in cases.items():
        assert export_main([never, *args]) == 2, args
        assert capsys.readouterr().err == f"error: {line}\n"
    assert export_main([never, str(taken), "--format", "hf", "--overwrite"]) == 2  # now the checkpoint is read
    assert "no-such-checkpoint" in capsys.readouterr().err


def test_checkpoint_timeout_is_validated_and_reaches_the_grid(tmp_path):
    """checkpoint.timeout_s: at least 1, refused in one line naming key, value and rule; the trainer's strategy
    hands it to the grid it builds (io_timeout, the wait of io_group's collectives)."""
    from mlplat.config import load_config
    from mlplat.errors import ConfigError
    from mlplat.train import build_trainer

    raw = {"model": dict(n_layers=2, hidden=32, n_heads=4, seq_len=16, vocab_size=250),
           "parallel": dict(micro_batch_size=2, global_batch_size=4), "logger": dict(name="none")}
    with pytest.raises(ConfigError, match=r"^checkpoint.timeout_s=0 must be at least 1$"):
        load_config({**raw, "checkpoint": {"timeout_s": 0}}, world_size=1, check_data=False)
    cfg = load_config(raw, world_size=1, check_data=False)
    assert cfg.checkpoint.timeout_s == 1800
    cfg.checkpoint.timeout_s = 99
    trainer = build_trainer(cfg, tmp_path)
    assert trainer.strategy.io_timeout == timedelta(seconds=99)


def _load_different_paths(rank, world_size, root):
    from mlplat.checkpoint import io
    from mlplat.parallel.grid import ParallelGrid

    grid = ParallelGrid(1, 1, world_size)
    try:
        io.load(Path(root) / f"step-{2 + rank}", {}, None, grid, 0)  # as if each rank's `last` had differed
    except io.CheckpointError as err:
        return str(err)
    return "loaded"


def test_ranks_that_resolved_different_checkpoints_all_refuse_in_one_line(tmp_path):
    lines = run_distributed(_load_different_paths, 2, str(tmp_path), timeout=120)
    assert lines[0] == lines[1] and "the ranks resolved different checkpoints" in lines[0], lines


def test_a_save_that_cannot_write_says_why_in_one_line_and_leaves_no_partial_folder(tmp_path):
    """A disk that fills during a save (here: a file size limit, EFBIG, which torch's zip writer reports as the same
    "unexpected pos" a full disk gives): one line naming the checkpoint, the operating system's error and the folder;
    the partial folder is deleted (left, it keeps the disk full) and the last committed checkpoint stays the last."""
    import resource
    import signal

    from mlplat.checkpoint import CheckpointError, io

    module, opt = _module(tp=1)
    root = tmp_path / "checkpoints"
    io.save(root / "step-1", module.chunks, opt, module.grid, {"global_step": 1}, {"tp": 1})
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limits[1]))  # mlplat's small files fit, the shards do not
    try:
        with pytest.raises(CheckpointError) as info:
            io.save(root / "step-2", module.chunks, opt, module.grid, {"global_step": 2}, {"tp": 1})
        # Where the library lost the error (what a full disk gave inside torch.save), a probe write finds it again.
        lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        assert io.write_failure(root / "step-2", tmp_path, lost) == (
            f"checkpoint {root / 'step-2'} was not saved on rank 0: File too large (errno 27 EFBIG) writing "
            f"{tmp_path} ([enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598)")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"checkpoint {root / 'step-2'} was not saved on rank 0: "
                                                      f"File too large (errno 27 EFBIG) writing {root}/step-2.partial-")
    assert sorted(p.name for p in root.iterdir()) == [io.LATEST, "step-1"]
    assert io.find_last(root) == root / "step-1" and io.verify(root / "step-1")["step"] == 1
    # A save interrupted for good (kill -9, Ctrl-C) leaves its partial folder: the next run there deletes it.
    (root / "step-3.partial-0123abcd").mkdir()
    (root / "step-3.partial-0123abcd" / "__0_0.distcp").write_bytes(bytes(1000))
    (root / "step-2.old-89abcdef").mkdir()  # may stand for step 2 (a re-save caught between its renames): kept
    assert io.remove_unfinished(root) == ["step-3.partial-0123abcd"]
    assert sorted(p.name for p in root.iterdir()) == [io.LATEST, "step-1", "step-2.old-89abcdef"]


def _moe_module(bias_update_rate: float):
    from mlplat.config import load_config
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.step import TrainStep

    raw = {"model": dict(n_layers=2, hidden=32, n_heads=4, seq_len=16, vocab_size=250,
                         moe=dict(num_experts=4, top_k=2, ffn_hidden=16, bias_update_rate=bias_update_rate)),
           "parallel": dict(micro_batch_size=2, global_batch_size=4), "trainer": dict(precision="32-true"),
           "logger": dict(name="none"), "sample": dict(max_new_tokens=0), "seed": 7}
    module = TrainStep(load_config(raw, world_size=1, check_data=False), ParallelGrid())
    return module, module.optimizer


def test_expert_biases_are_saved_by_layer_name_and_an_older_checkpoint_starts_them_at_0(tmp_path, caplog):
    """The expert biases go into the checkpoint under their full-model names (the consolidated export has them)
    and come back on load; a checkpoint without them (an older one, or one of a run without the bias) loads with
    the biases at 0, said in one warning."""
    from mlplat.checkpoint import io
    from mlplat.checkpoint.export import consolidate
    from mlplat.model.moe import expert_biases

    module, opt = _moe_module(0.01)
    biases = expert_biases(module.chunks.values())
    assert sorted(biases) == ["layers.0.mlp.expert_bias", "layers.1.mlp.expert_bias"]
    for k, bias in enumerate(biases.values()):
        bias.copy_(torch.arange(4.0) * 0.01 - k)
    saved = {name: bias.clone() for name, bias in biases.items()}
    io.save(tmp_path / "step-1", module.chunks, opt, module.grid, {"global_step": 1}, {"tp": 1})
    weights = consolidate(tmp_path / "step-1")
    for name, bias in saved.items():
        assert torch.equal(weights[name], bias)
    fresh, fresh_opt = _moe_module(0.01)
    io.load(tmp_path / "step-1", fresh.chunks, fresh_opt, fresh.grid, 250)
    for name, bias in expert_biases(fresh.chunks.values()).items():
        assert torch.equal(bias, saved[name]), name
    plain, plain_opt = _moe_module(0.0)
    io.save(tmp_path / "plain", plain.chunks, plain_opt, plain.grid, {"global_step": 1}, {"tp": 1})
    resumed, resumed_opt = _moe_module(0.01)
    with caplog.at_level("WARNING", logger="mlplat"):
        io.load(tmp_path / "plain", resumed.chunks, resumed_opt, resumed.grid, 250)
    assert all(not bias.any() for bias in expert_biases(resumed.chunks.values()).values())
    assert "holds no expert biases (saved before checkpoints held them, or by a run without " \
           "model.moe.expert_bias or bias_update_rate): they start at 0" in caplog.text
