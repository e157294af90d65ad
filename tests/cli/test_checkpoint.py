"""Sharded checkpoints: exact resume, resharding across layouts, atomic saves, corrupt input, dead ranks."""
from __future__ import annotations

import csv
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import REPO, forked_ranks, read_metrics, run_train, start_endless_run, train_losses

pytestmark = pytest.mark.slow

QUIET = ("logger=none", "sample.max_new_tokens=0", "trainer.val_check_interval=1000")

# Exact resume, one launch straight and one resumed per layout. Tiny models, m = p: tp2·pp2 and pp2 interleaved, and
# the layouts where some pipeline rank holds no word embedding (a resume used to hang there): pp=3 (the middle
# stage), pp=4 interleaved (the middle ranks) and zbv pp=2 (the V keeps both ends on rank 0).
TINY = ("parallel=single", "model.hidden=32", "model.n_heads=4", "model.seq_len=32", "parallel.micro_batch_size=1")
LAYOUTS = {
    "tp2pp2": ("parallel.tp=2", "parallel.pp=2", "model.n_layers=4", "parallel.global_batch_size=2"),
    "pp2v2-interleaved": ("parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved", "model.n_layers=4",
                          "parallel.global_batch_size=2"),
    # uneven stages too: [1, 4, 1] (parallel.first_stage_layers, last_stage_layers)
    "pp3-1f1b-uneven": ("parallel.pp=3", "model.n_layers=6", "parallel.first_stage_layers=1",
                        "parallel.last_stage_layers=1", "parallel.global_batch_size=3"),
    "pp4v2-interleaved": ("parallel.pp=4", "parallel.vpp=2", "parallel.schedule=interleaved", "model.n_layers=8",
                          "parallel.global_batch_size=4"),
    "pp2-zbv": ("parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zbv", "model.n_layers=4",
                "parallel.global_batch_size=2"),
    # the parameters sharded over dp2 under 1F1B at p = 3, m = p: the weights, gradients and AdamW state of each
    # rank's half come back; the layers gathered again from them
    "pp3-dp2-params": ("parallel.pp=3", "parallel.dp=2", "model.n_layers=6", "parallel.global_batch_size=6",
                       "optim.sharding=params"),
    # multi-token prediction on the last of 3 stages (its module's layer, norms and projection, and the word
    # embedding's copy there): its dropout streams and state come back too; under Muon (its momentum per matrix, the
    # AdamW moments of the rest) with QK-clip scaling heads at every step (tau 0.03 is under the tiny model's logits)
    "pp3-mtp-muon-qk-clip": ("parallel.pp=3", "model.n_layers=6", "parallel.global_batch_size=3", "model.mtp.depth=1",
                             "optim=muon", "optim.muon.qk_clip=0.03"),
    # A mixture of experts at p = 3, m = 6 (one layer per stage, layers 1-2 with experts), whose expert biases
    # (aux-loss-free balancing) move every step and must come back from the checkpoint; under capacity, which drops
    # assignments; under expert parallelism folded onto tp2 (each rank's experts, the router's and the dispatch's
    # ranks).
    "moe-ep2-tp2-pp3-bias-capacity": ("model=moe_tiny", "parallel.ep=2", "parallel.tp=2", "parallel.pp=3",
                                      "model.n_layers=3", "parallel.global_batch_size=6",
                                      "model.moe.bias_update_rate=0.01", "model.moe.capacity_factor=1.0"),
}
# bf16-megatron with the distributed optimizer under pp2·dp2: the tied embedding's shards on two stages. A 2-step
# warm-up (the default's 50 outlast the run), so that the loss falls within its 8 steps.
MEGATRON = ("parallel.pp=2", "parallel.dp=2", "model.n_layers=4", "parallel.global_batch_size=4",
            "trainer.precision=bf16-megatron", "optim.distributed=true", "optim.warmup_steps=2")


@pytest.fixture(scope="module")
def resumes(tmp_path_factory):
    """Per layout, dropout 0.1: 8 steps straight, saving every 4 (step-4 is what a preempted job leaves), and a second
    run resumed from that step-4 to step 8 in its own folder (float32; bf16-megatron for MEGATRON)."""
    root = tmp_path_factory.mktemp("resume")
    out = {}
    for name, layout in {**LAYOUTS, "pp2dp2-megatron": MEGATRON}.items():
        precision = () if name == "pp2dp2-megatron" else ("trainer.precision=32-true",)
        common = (*TINY, *precision, *layout, *QUIET, "model.dropout=0.1", "checkpoint.every_steps=4",
                  "trainer.max_steps=8")
        straight, resumed = root / name / "straight", root / name / "resumed"
        run_train(straight, *common)
        proc = run_train(resumed, *common, f"ckpt_path={straight / 'checkpoints' / 'step-4'}")
        out[name] = dict(straight=straight, resumed=resumed, log=proc.stdout + proc.stderr)
    return out


@pytest.mark.parametrize("name", [*LAYOUTS, "pp2dp2-megatron"])
def test_resume_is_bit_identical(resumes, name):
    """8 steps straight == 4 steps, save, resume, 4 steps, bit for bit, with dropout on: the RNG streams of every rank
    (default generator and the tracker's streams) and the data position come back from the checkpoint, and every
    rank enters the one collective load the same way, whatever it holds (same layout: nothing is re-seeded)."""
    run = resumes[name]
    assert "re-seeded" not in run["log"] and "holds no expert biases" not in run["log"]
    assert "Restored all states" in run["log"]
    a, b = train_losses(run["straight"]), train_losses(run["resumed"])
    assert [int(r["step"]) for r in read_metrics(run["resumed"])] == [5, 6, 7, 8]
    assert len(a) == 8 and b == a[4:]  # repr() of the logged values: equal strings are equal bits
    if "qk-clip" in name:  # heads clipped in the resumed steps too
        assert all(float(r["qk_clipped_heads"]) > 0 for r in read_metrics(run["resumed"]))


def test_megatron_checkpoint_holds_fp32_main_weights_and_dp_shards(resumes):
    """bf16-megatron: the checkpoint holds the fp32 main weights and the moments of every data-parallel shard, not the
    bf16 weights; the loss falls."""
    import torch.distributed.checkpoint as dcp

    run = resumes["pp2dp2-megatron"]
    a = train_losses(run["straight"])
    assert a[-1] < a[0] - 0.3, a
    saved = dcp.FileSystemReader(str(run["straight"] / "checkpoints" / "step-4")).read_metadata().state_dict_metadata
    for key in ("model/layers.0.attn.qkv.weight", "model/embedding.word.weight",
                "optim/layers.0.attn.qkv.weight/exp_avg"):
        assert saved[key].properties.dtype == torch.float32, key
    assert len(saved["model/embedding.word.weight"].chunks) == 2  # one data-parallel shard per rank


def test_export_reads_every_layouts_checkpoints(resumes, tmp_path):
    """`python -m mlplat.checkpoint.export` consolidates the checkpoints of those layouts: the word embedding without
    padding, every layer once; the resumed run's step-8 weights equal the straight run's bit for bit. (The command
    itself runs once; the other exports call its main() in this process, which is what the command runs.)"""
    from mlplat.checkpoint.export import main as export_main

    for i, name in enumerate(LAYOUTS):
        run = resumes[name]
        layers = int(next(o for o in LAYOUTS[name] if o.startswith("model.n_layers=")).split("=")[1])
        a, b = tmp_path / f"{name}-straight.pt", tmp_path / f"{name}-resumed.pt"
        straight = str(run["straight"] / "checkpoints" / "step-8")
        if i == 0:
            proc = subprocess.run([sys.executable, "-m", "mlplat.checkpoint.export", straight, str(a)],
                                  cwd=REPO, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0 and proc.stdout.startswith(f"wrote {a}"), proc.stderr
        else:
            assert export_main([straight, str(a)]) == 0
        assert export_main([str(run["resumed"] / "checkpoints" / "step-8"), str(b)]) == 0
        wa, wb = torch.load(a), torch.load(b)
        names = {k for k in wa if not k.startswith("__")}
        assert names == {k for k in wb if not k.startswith("__")}
        assert wa["embedding.word.weight"].shape == (256, 32)
        assert {int(k.split(".")[1]) for k in names if k.startswith("layers.")} == set(range(layers)), name
        assert wa["__mlplat__"]["step"] == 8
        for k in names:
            assert torch.equal(wa[k], wb[k]), (name, k)


# Resharding, float64: one process for 8 steps is the reference; tp2·pp2 and pp4 v2 (interleaved, v_half) save at
# step 4; each resumes under other layouts. Another layout: the RNG streams have no counterpart; the run re-seeds
# them.
MOE_DROPLESS = ("model=moe_tiny", "model.n_layers=4", "model.moe.bias_update_rate=0.01")
MOE = (*MOE_DROPLESS, "model.moe.capacity_factor=1.0")
F64 = (*TINY, "model.n_layers=8", *QUIET, "trainer.precision=64-true", "parallel.global_batch_size=4",
       "trainer.max_steps=8", "checkpoint.every_steps=4", "optim.grad_clip=3.6")
SAVED = {"tp2pp2": ("parallel.tp=2", "parallel.pp=2"),
         "pp4v2-interleaved": ("parallel.pp=4", "parallel.vpp=2", "parallel.schedule=interleaved"),
         "pp3-uneven": ("parallel.pp=3", "parallel.first_stage_layers=2"),  # chunks of [2, 3, 3] layers
         # context parallelism: the distributed optimizer's shards are over the d·c = 4 ranks of each weight
         "cp2dp2-distributed": ("parallel.cp=2", "parallel.dp=2", "optim.distributed=true"),
         # mixture of experts, 2 whole experts per rank (m = 1), the optimizer sharded over each expert's edp ranks
         "moe-ep4-dp4-distributed": (*MOE_DROPLESS, "parallel.ep=4", "parallel.dp=4", "optim.distributed=true"),
         # the parameters sharded, HSDP: 2 shard groups of 2 ranks (each shard saved by two ranks: once in the file)
         "dp4-hsdp-params": ("parallel.dp=4", "parallel.dp_shard=2", "optim.sharding=params")}
RESHARDS = {"tp2pp2-to-tp1pp2": ("tp2pp2", ("parallel.pp=2",)),
            # into sharded parameters, and out of them into tp2·pp2 unsharded and into one process
            "tp2pp2-to-tp2dp2-params": ("tp2pp2", ("parallel.tp=2", "parallel.dp=2", "optim.sharding=params")),
            "dp4-hsdp-params-to-tp2pp2": ("dp4-hsdp-params", ("parallel.tp=2", "parallel.pp=2")),
            "dp4-hsdp-params-to-single": ("dp4-hsdp-params", ()),
            "tp2pp2-to-single": ("tp2pp2", ()),
            # another number of stages and chunks: the middle ranks that held no embedding now hold it
            "pp4v2-interleaved-to-pp2": ("pp4v2-interleaved", ("parallel.pp=2",)),
            # from uneven stages to even ones: layers 2-4 leave pipeline rank 1 for rank 0
            "pp3-uneven-to-pp2": ("pp3-uneven", ("parallel.pp=2",)),
            # into the V: chunks placed r and 2p-1-r, not r and r+p (out of it: the post-validated run below)
            "tp2pp2-to-pp4v2-v_half": ("tp2pp2", ("parallel.pp=4", "parallel.vpp=2", "parallel.schedule=v_half")),
            # out of context parallelism (4 optimizer shards into 2, at the same tp, pp and dp: only cp tells the
            # layouts apart, and the RNG streams are re-seeded), and into it (2 shards over c = 2)
            "cp2dp2-distributed-to-dp2-distributed": ("cp2dp2-distributed",
                                                      ("parallel.dp=2", "optim.distributed=true")),
            "tp2pp2-to-cp2pp2-distributed": ("tp2pp2", ("parallel.cp=2", "parallel.pp=2", "optim.distributed=true")),
            # Llama (GQA: 8 query heads, 4 key/value heads; untied output layer): from one key/value head per rank
            # at tp4, whose vocabulary is padded to 512 rows, to tp2 and the zbv V (both tables on pipeline rank 0,
            # padded to 256 rows).
            "llama-tp4-to-tp2pp2-zbv": ("llama-tp4", ("parallel.tp=2", "parallel.pp=2", "parallel.vpp=2",
                                                      "parallel.schedule=zbv")),
            # experts saved by global index: from ep4 into ep2 folded onto tp2 (whole experts, other ranks; each tp
            # rank routes half of each sequence, so dropless: docs/moe.md), and into one process
            "moe-ep4-to-ep2-tp2-dp2": ("moe-ep4-dp4-distributed", (*MOE_DROPLESS, "parallel.ep=2", "parallel.tp=2",
                                                                   "parallel.dp=2")),
            "moe-ep4-to-single": ("moe-ep4-dp4-distributed", MOE_DROPLESS),
            # A mixture of experts with moving expert biases, under capacity: from one process to four stages of
            # one layer each, each layer's bias read by the rank that now holds the layer.
            "moe-single-to-pp4": ("moe-single", ("parallel.pp=4",))}
LLAMA = ("model=llama_tiny", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden=64")
# Optimizer post-validation across a checkpoint: the tiny model's gradient norm is 5.7, 5.4, 4.2, 3.3 and 3.9 in steps
# 1-5, so under F64's bound of 3.6 step 4 stands and step 5 is stepped before its checks: it is still pending when step
# 5's checkpoint is written, which settles it first (redoes it on its clipped gradients). Saved under the V of V-Half
# (each rank holds chunks r and 2p-1-r, both ends of the model on pipeline rank 0), resumed out of it under tp2·pp2;
# the one-process reference ("single", synchronous) and the saved run validate after every step: step 1, rejected,
# is still pending when validation starts, which settles it too.
VALIDATE = (*(o for o in F64 if not o.startswith("trainer.val_check_interval")), "trainer.val_check_interval=1",
            "trainer.limit_val_batches=1")
POST_SAVED = ("parallel.pp=4", "parallel.vpp=2", "parallel.schedule=v_half", "optim.post_validate=true",
              "trainer.max_steps=5", "checkpoint.every_steps=5")
POST_RESUMED = ("parallel.tp=2", "parallel.pp=2", "optim.post_validate=true")


@pytest.fixture(scope="module")
def reshards(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    run_train(root / "single", *VALIDATE)
    run_train(root / "llama-single", *F64, *LLAMA)
    run_train(root / "moe-single", *F64, *MOE)  # the reference, and the checkpoint resharded
    run_train(root / "moe-dropless-single", *F64, *MOE_DROPLESS)  # the expert-parallel reshards' reference
    run_train(root / "post-saved", *VALIDATE, *POST_SAVED)
    run_train(root / "post-resumed", *F64, *POST_RESUMED, f"ckpt_path={root / 'post-saved' / 'checkpoints' / 'step-5'}")
    for name, layout in SAVED.items():
        run_train(root / name, *F64, *layout, "trainer.max_steps=4")
    run_train(root / "llama-tp4", *F64, *LLAMA, "parallel.tp=4", "trainer.max_steps=4")
    logs = {}
    for name, (source, layout) in RESHARDS.items():
        model = LLAMA if source.startswith("llama") else MOE if source == "moe-single" else ()
        proc = run_train(root / name, *F64, *model, *layout, f"ckpt_path={root / source / 'checkpoints' / 'step-4'}")
        logs[name] = proc.stdout + proc.stderr
    return root, logs


@pytest.mark.parametrize("name", list(RESHARDS))
def test_resharded_resume_continues_the_one_process_run(reshards, name):
    """Saved under one layout at step 4, resumed under another: the per-step loss of steps 5-8 equals the
    uninterrupted one-process run's to 1e-9 (optimizer state, schedule and data position included)."""
    root, logs = reshards
    assert "re-seeded from (seed=1234, step=4)" in logs[name], name
    reference = next((ref for prefix, ref in (("llama", "llama-single"), ("moe-ep", "moe-dropless-single"),
                                              ("moe", "moe-single")) if name.startswith(prefix)), "single")
    expected = train_losses(root / reference)
    got = train_losses(root / name)
    assert len(expected) == 8 and len(got) == 4, name
    for step, (g, e) in enumerate(zip(got, expected[4:]), start=5):
        assert abs(g - e) <= 1e-9 * abs(e), f"{name} step {step}: {g!r} != {e!r}"


def test_a_resharded_mixture_of_experts_keeps_its_expert_biases_and_loads(reshards):
    """The one-process MoE checkpoint holds each layer's expert bias (moved by steps 1-4); resumed at
    p = 4, every layer's expert loads in steps 5-8 (the experts chosen with those biases; assignments dropped under
    capacity) equal the uninterrupted run's."""
    from mlplat.checkpoint.export import consolidate

    root, _ = reshards
    weights = consolidate(root / "moe-single" / "checkpoints" / "step-4")
    biases = {k: v for k, v in weights.items() if k.endswith(".mlp.expert_bias")}
    assert sorted(biases) == [f"layers.{i}.mlp.expert_bias" for i in range(1, 4)]
    assert any(v.abs().max() > 0 for v in biases.values()), biases  # one may be back at 0: the steps' signs flip
    expected, got = read_metrics(root / "moe-single")[4:], read_metrics(root / "moe-single-to-pp4")
    columns = [c for c in expected[0] if c.startswith(("moe_load_", "moe_dropped"))]
    assert len(columns) == 3 + 3 * 3 and float(expected[0]["moe_dropped"]) > 0
    for e, g in zip(expected, got, strict=True):
        for c in columns:
            assert abs(float(g[c]) - float(e[c])) <= 1e-12 * abs(float(e[c])), (e["step"], c, g[c], e[c])


def test_a_step_pending_at_a_checkpoint_is_settled_before_it_is_saved(reshards):
    """Post-validation: the checkpoint of step 5, taken while step 5 was stepped first on unclipped gradients, holds
    the step redone on clipped ones, and the validation after step 1 (stepped first, rejected) sees step 1 redone.
    Steps 1-5 of the saved run (train and val loss) and steps 6-8 of the run resumed from it under another layout
    equal the synchronous one-process run to 1e-9; steps 1 and 5 were redone."""
    root, _ = reshards
    reference = read_metrics(root / "single")
    expected = [float(r["train_loss"]) for r in reference]
    norms = [float(r["grad_norm"]) for r in reference]
    assert [n > 3.6 for n in norms[:5]] == [True, True, True, False, True], norms
    saved, resumed = read_metrics(root / "post-saved"), train_losses(root / "post-resumed")
    assert [int(float(r["redone_steps"])) for r in saved] == [1, 1, 1, 1, 2]
    for step, (g, e) in enumerate(zip([float(r["train_loss"]) for r in saved] + resumed, expected), start=1):
        assert abs(g - e) <= 1e-9 * abs(e), f"step {step}: {g!r} != {e!r}"
    for step, (g, e) in enumerate(zip(saved, reference), start=1):
        assert abs(float(g["val_loss"]) - float(e["val_loss"])) <= 1e-9 * float(e["val_loss"]), (step, g, e)
    assert len(saved) == 5 and len(resumed) == 3


def test_consolidated_export_matches_single_process(reshards, tmp_path):
    """The tp2·pp2 checkpoint, exported, holds the one-process checkpoint's weights (float64, 1e-9)."""
    from mlplat.checkpoint.export import main as export_main

    root, _ = reshards
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    assert export_main([str(root / "tp2pp2" / "checkpoints" / "step-4"), str(a)]) == 0
    assert export_main([str(root / "single" / "checkpoints" / "step-4"), str(b)]) == 0
    wa, wb = torch.load(a), torch.load(b)
    assert wa["__mlplat__"]["layout"]["tp"] == 2 and wb["__mlplat__"]["layout"]["tp"] == 1
    names = {k for k in wa if not k.startswith("__")}
    assert names == {k for k in wb if not k.startswith("__")}
    assert wa["embedding.word.weight"].shape == (256, 32)
    for k in names:
        assert torch.allclose(wa[k], wb[k], rtol=1e-9, atol=1e-12), k


KILLED_SAVE = r"""
import os, signal, sys, torch
import torch.distributed.checkpoint as dcp
from mlplat.checkpoint import io
from mlplat.config import RunConfig
from mlplat.parallel.grid import ParallelGrid
from mlplat.step import TrainStep

cfg = RunConfig(); cfg.parallel.dp = 1; cfg.model.vocab_size = 256
module = TrainStep(cfg, ParallelGrid())
opt = module.optimizer
root = sys.argv[1]
io.save(f"{root}/step-2", module.chunks, opt, module.grid, {"global_step": 2}, {"tp": 1})
real_save = dcp.save
def dying_save(state, **where):
    real_save(state, **where)                           # shards written ...
    os.kill(os.getpid(), signal.SIGKILL)                # ... and the process dies before the manifest/rename
io.dcp.save = dying_save
io.save(f"{root}/step-4", module.chunks, opt, module.grid, {"global_step": 4}, {"tp": 1})
"""


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    from mlplat.checkpoint import io

    root = tmp_path / "checkpoints"
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(root)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not (root / "step-4").exists()
    assert list(root.glob("step-4.partial-*")), "the killed save should have left only a partial folder"
    assert io.find_last(root) == root / "step-2"
    assert io.verify(root / "step-2")["step"] == 2


def test_resume_skips_partial_and_corrupt_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    run_train(run_dir, *TINY, "parallel.pp=2", "parallel.global_batch_size=4", *QUIET,
              "trainer.max_steps=2", "checkpoint.every_steps=2")
    ckpts = run_dir / "checkpoints"
    # What a save killed half-way leaves: a partial folder without manifest, never a step-N folder.
    partial = ckpts / "step-4.partial-deadbeef"
    shutil.copytree(ckpts / "step-2", partial)
    (partial / "mlplat.json").unlink()
    run_train(run_dir, *TINY, "parallel.pp=2", "parallel.global_batch_size=4", *QUIET,
              "trainer.max_steps=4", "checkpoint.every_steps=2", "ckpt_path=last")
    steps = [int(r["step"]) for r in read_metrics(run_dir)]
    assert steps == [1, 2, 3, 4]
    assert (ckpts / "step-4" / "mlplat.json").exists() and not partial.exists()

    truncated = tmp_path / "truncated"
    shutil.copytree(ckpts / "step-2", truncated)
    shard = sorted(truncated.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    flipped = tmp_path / "flipped"
    shutil.copytree(ckpts / "step-2", flipped)
    shard = sorted(flipped.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    from tests.helpers.checkpoint import plant_code_running_pickle

    hostile, marker = tmp_path / "hostile", tmp_path / "MARKER"
    shutil.copytree(ckpts / "step-2", hostile)
    plant_code_running_pickle(hostile, marker)
    for bad, words in ((truncated, "is truncated"), (flipped, "CRC32"), (tmp_path / "nope", "does not exist"),
                       (hostile, "lightning.pt is not plain data")):
        proc = run_train(tmp_path / "x", *TINY, *QUIET, f"ckpt_path={bad}", check=False, timeout=120)
        assert proc.returncode == 2
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error: checkpoint") and words in last, proc.stderr
        assert "Traceback" not in proc.stderr
    assert not marker.exists()  # the hostile pickle was refused, not run
    # A resume whose max_steps lies below the checkpoint's step would train nothing: one line, not a silent exit 0.
    proc = run_train(run_dir, *TINY, "parallel.pp=2", "parallel.global_batch_size=4", *QUIET, "trainer.max_steps=3",
                     "ckpt_path=last", check=False, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "trainer.max_steps=3 is below the step of ckpt_path=" in last, proc.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; it only waits for its parent to read the status.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _kill_a_rank_and_watch_the_job_end(run_dir, overrides, err, until, victim: int) -> None:
    """Start the run, SIGKILL global rank `victim` (as the OOM killer would) once `until` exists, and check the job
    ends within 60 s, every rank gone, with the killed rank's status as a shell reports it (137) and one line naming
    it: rank 0's own view is a closed connection to its neighbour, which it must not blame."""
    main = start_endless_run(run_dir, *overrides, err=err)
    try:
        deadline = time.time() + 180
        while not until.exists():
            assert main.poll() is None, "training ended early: " + err.read_text()[-3000:]
            assert time.time() < deadline, f"no {until} within 180 s"
            time.sleep(0.5)
        ranks = forked_ranks(main)  # ranks 1, 2, ... in the order they were started
        killed_at = time.time()
        os.kill(ranks[victim - 1], signal.SIGKILL)
        main.wait(timeout=60)
        said = err.read_text()
        assert main.returncode == 128 + signal.SIGKILL, (main.returncode, said[-3000:])
        # (each line one write; another process's line may still end where this one starts)
        assert re.search(rf"mlplat: rank {victim} \(pid {ranks[victim - 1]}\) was killed by SIGKILL; stopping every "
                         rf"rank \(ckpt_path=last continues from the latest checkpoint\)$", said, re.M), said[-3000:]
        assert "Traceback" not in said.split("was killed by SIGKILL")[0], said[-3000:]
        while any(_alive(p) for p in ranks):
            assert time.time() - killed_at < 60, "ranks still alive 60 s after one died"
            time.sleep(0.5)
    finally:
        if main.poll() is None:
            os.killpg(main.pid, signal.SIGKILL)


def test_a_rank_killed_at_pp3_is_the_rank_named(tmp_path):
    """pp = 3: rank 0 talks to pipeline rank 1 only, which reports rank 2's death and exits; the job names rank 2."""
    run_dir = tmp_path / "run"
    overrides = (*TINY, "parallel.pp=3", "model.n_layers=3", "parallel.global_batch_size=3", *QUIET,
                 "parallel.timeout_s=30", "checkpoint.save_last=false")
    _kill_a_rank_and_watch_the_job_end(run_dir, overrides, tmp_path / "stderr", until=run_dir / "metrics.csv",
                                       victim=2)


def test_dead_rank_ends_the_job_and_restart_continues(tmp_path):
    run_dir = tmp_path / "run"
    overrides = ("parallel=single", "parallel.tp=2", "parallel.pp=2", "parallel.micro_batch_size=4", *QUIET,
                 "checkpoint.every_steps=2", "parallel.timeout_s=30")
    _kill_a_rank_and_watch_the_job_end(run_dir, overrides, tmp_path / "stderr", until=run_dir / "checkpoints" /
                                       "step-2" / "mlplat.json", victim=2)
    done = int(max(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*")
                   if "partial" not in p.name))
    run_train(run_dir, *overrides, f"trainer.max_steps={done + 2}", "ckpt_path=last")

    steps = [int(r["step"]) for r in read_metrics(run_dir)]
    assert steps == list(range(1, done + 3))  # one row per step: rows after the checkpoint were replayed


BRANCH = (*TINY, "model.n_layers=2", "parallel.global_batch_size=1", *QUIET, "checkpoint.every_steps=1")


def test_a_run_directory_keeps_its_history_and_last_never_guesses(tmp_path):
    """A run of 4 steps, then in the same directory: a new run is refused in one line, touching nothing (Hydra's
    `.hydra/` included). A branch from its step-2 with another LR to step 3 moves the first run's later steps (3, 4)
    to checkpoints/abandoned/<time>/ and their metrics.csv rows to a file of their own, each said in one line, so
    that the folder and metrics.csv hold one lineage; `ckpt_path=last` resumes the branch's step-3. With `latest`
    removed, `ckpt_path=last` is refused in one line listing what is there."""
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    run_train(run_dir, *BRANCH, "trainer.max_steps=4")
    first_rows, first_config = read_metrics(run_dir), (run_dir / ".hydra" / "config.yaml").read_text()
    first = {n: (ckpts / n / "mlplat.json").read_text() for n in ("step-3", "step-4")}

    proc = run_train(run_dir, *BRANCH, "trainer.max_steps=4", "seed=7", check=False, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: hydra.run.dir={run_dir} holds an earlier run (checkpoints step-1, step-2, step-3, step-4 and "
        f"metrics.csv with 4 rows): continue it with ckpt_path=last, or choose another hydra.run.dir for a new run"]
    assert read_metrics(run_dir) == first_rows and (run_dir / ".hydra" / "config.yaml").read_text() == first_config

    proc = run_train(run_dir, *BRANCH, "trainer.max_steps=3", "optim.lr=1e-3", f"ckpt_path={ckpts / 'step-2'}")
    out = proc.stdout + proc.stderr
    (aside,) = (ckpts / "abandoned").iterdir()
    assert sorted(p.name for p in ckpts.iterdir()) == ["abandoned", "latest", "step-1", "step-2", "step-3"]
    assert sorted(p.name for p in aside.iterdir()) == ["latest", "step-3", "step-4"]
    assert {n: (aside / n / "mlplat.json").read_text() for n in first} == first  # the first run's, whole
    assert (aside / "latest").read_text().strip() == "step-4"
    assert f"resuming step-2: the later checkpoints of the lineage it leaves (step-3, step-4) moved to {aside}" in out
    (side,) = run_dir.glob("metrics.abandoned-*.csv")
    assert read_metrics(run_dir) == [*first_rows[:2], *read_metrics(run_dir)[2:]] and len(read_metrics(run_dir)) == 3
    with open(side, newline="") as f:
        assert list(csv.DictReader(f)) == first_rows[2:]
    assert f"{run_dir / 'metrics.csv'}: the rows of steps 3-4, past step 2 where this run resumes, moved to {side}" \
        in out

    proc = run_train(run_dir, *BRANCH, "trainer.max_steps=5", "ckpt_path=last")
    assert f"Restoring states from the checkpoint path at {ckpts / 'step-3'}" in proc.stdout + proc.stderr
    assert [int(r["step"]) for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5]

    (ckpts / "latest").unlink()
    proc = run_train(run_dir, *BRANCH, "trainer.max_steps=6", "ckpt_path=last", check=False, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: ckpt_path=last: {ckpts} holds step-1, step-2, step-3, step-4, step-5 but no latest record says "
        f"which one continues the run: resume one by its path, ckpt_path={ckpts}/step-N")


def test_the_last_step_is_saved_and_resumed(tmp_path):
    """max_steps=3 with every_steps=2 saves steps 2 and 3 (the run's end), and `ckpt_path=last` continues from 3."""
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    common = (*BRANCH[:-1], "checkpoint.every_steps=2")
    run_train(run_dir, *common, "trainer.max_steps=3")
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-2", "step-3"]
    proc = run_train(run_dir, *common, "trainer.max_steps=4", "ckpt_path=last")
    assert f"Restoring states from the checkpoint path at {ckpts / 'step-3'}" in proc.stdout + proc.stderr
    assert [int(r["step"]) for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-2", "step-3", "step-4"]


def test_a_resume_keeps_saving_at_the_checkpoints_cadence(tmp_path):
    """`ckpt_path=last` without checkpoint.every_steps saves as the run it continues did (said in one line);
    checkpoint.every_steps=0 with checkpoint.save_last=false still turns saving off."""
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    run_train(run_dir, *BRANCH[:-1], "checkpoint.every_steps=2", "trainer.max_steps=2")
    proc = run_train(run_dir, *BRANCH[:-1], "trainer.max_steps=4", "ckpt_path=last")
    assert f"checkpoint.every_steps=2, as {ckpts / 'step-2'} was saved" in proc.stdout + proc.stderr
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-2", "step-4"]
    proc = run_train(run_dir, *BRANCH[:-1], "trainer.max_steps=5", "ckpt_path=last", "checkpoint.every_steps=0",
                     "checkpoint.save_last=false")
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-2", "step-4"]
    # Lightning's warning that the checkpoint's callbacks are missing does not apply (the cadence changed on purpose),
    # nor torch's that a one-process load is meant as one; the summary covers this run's step only.
    out = proc.stdout + proc.stderr
    assert "callbacks used to create the checkpoint" not in out and "assuming the intent" not in out, out[-3000:]
    assert "\nsteps       5, resumed from step 4\n" in out


def test_a_resume_keeps_its_learning_rate_schedule_and_says_what_it_took(tmp_path):
    """The schedule is part of the checkpoint: resumed with a longer trainer.max_steps and another optim.lr, the run
    holds optim.min_lr past the checkpoint's horizon (it used to recompute the cosine over the new length: a 43x jump)
    and one line names what it took from the checkpoint and what was given and not applied; optim.lr_decay_steps
    given on the resumed command line moves the horizon."""
    run_dir, moved = tmp_path / "run", tmp_path / "moved"
    common = (*TINY, "model.n_layers=2", "parallel.global_batch_size=1", *QUIET, "optim.warmup_steps=1",
              "checkpoint.every_steps=2")
    run_train(run_dir, *common, "trainer.max_steps=4")
    shutil.copytree(run_dir / "checkpoints" / "step-4", moved / "checkpoints" / "step-4")
    proc = run_train(run_dir, *common, "trainer.max_steps=6", "ckpt_path=last", "optim.lr=0.01")
    lrs = {int(r["step"]): float(r["lr"]) for r in read_metrics(run_dir)}
    assert lrs[4] == lrs[5] == lrs[6] == pytest.approx(6e-5), lrs  # optim.min_lr from the horizon (step 4) on
    assert "resumed learning-rate schedule: the checkpoint's (optim.lr=0.006, optim.min_lr=6e-05, " \
           "optim.warmup_steps=1), cosine to step 4; given and not applied: optim.lr=0.01 (the checkpoint's: 0.006)" \
           in proc.stdout + proc.stderr
    proc = run_train(moved, *common, "trainer.max_steps=6", "ckpt_path=last", "optim.lr_decay_steps=8")
    lrs = {int(r["step"]): float(r["lr"]) for r in read_metrics(moved)}
    assert 6e-5 < lrs[6] < lrs[5] < 0.006, lrs  # the cosine goes on to step 8
    assert "cosine to step 8 (optim.lr_decay_steps, given)" in proc.stdout + proc.stderr
