"""End to end through `python -m mlplat.train`, as a user runs it (subprocesses, real gloo process groups).

1. A short single-process run learns (loss falls, val_loss logged), writes DIR/metrics.csv with one row per
   optimizer step, the Lightning CSV logs (logger=csv) and prints a sample; the default logger (W&B, offline)
   leaves an offline run under DIR; logger=none writes no logger files; data=text trains on a user's file.
2. The CLI equivalence runs: in float64 (`trainer.precision=64-true`) the per-step train_loss of
   every parallel layout equals the one-process run to a relative 1e-9: tensor parallel t=2,4; uneven pipeline
   stages (parallel.first_stage_layers/last_stage_layers) under 1F1B at p=3, p=4 interleaved (v=2) and zbv at p=4;
   and the paper's 3D tp2·pp2(v2)·dp2 on 8 processes; with sequence parallelism, tp4·pp2; the
   distributed optimizer (optim.sharding=optim, or optim.distributed=true: AdamW on data-parallel shards) at dp4,
   cp2·dp2 and tp2·pp2·dp2 (under zb_h2, with optimizer post-validation, optim.post_validate=true, whose redone
   steps are checked too); the
   parameters sharded too (optim.sharding=params) at dp4 post-validated, tp2·sp·pp2(v2)·dp2, Llama pp2 zbv·dp2
   and pp2·dp2 with full recomputation, cp2·dp2, and HSDP (parallel.dp_shard=2 of dp4) with ep2's experts sharded
   over their edp ranks. The split-backward schedules: zb_h1, zbv and v_half at p=4, and tp2·pp2·dp2 with zb_h1.
   The Llama family (model=llama_tiny: grouped-query attention split over tp, RoPE, RMSNorm, SwiGLU, untied
   output layer) against its own one-process run: tp2 with sequence parallelism, tp2·pp2(v2)·dp2
   with the distributed optimizer, tp2·pp2 with selective recomputation. Context parallelism:
   cp4, cp2·tp2·pp2(v2) with sequence parallelism, Llama cp2·tp2
   and cp2·pp2 zbv at m = 8, cp2·pp4 at m = 1; packed documents (data.pack=true on short documents), Llama
   cp2·pp2 with selective recomputation against the packed one-process run. FP8 (kernels.fp8) under each recipe
   against one process under the same recipe, in float64 and, to float32's bounds (FP32_FIRST_LOSS...), in float32.
   Each run is a layout or a feature the others do not hold. The schedules' p = 2 and p = 4 cases (gpipe, 1f1b,
   interleaved, zb_h1, zb_h2, zbv, v_half) are proven for one step in tests/lightning/test_equivalence.py, and
   1f1b, interleaved and zb_h1 over three AdamW steps there too (its 3D training jobs).
   Same global batch (8) everywhere, so every layout sees the same samples; micro-batches of 2 except where a
   run says otherwise (then the loss is still the same mean: every micro-batch holds as many tokens).
3. With dropout 0.1, sequence-parallel training (its shards' masks from the tensor-parallel streams, so not
   equal to the run without it) learns like the same layout without sequence parallelism.

Runs are shared between assertions (module-scoped fixtures) and the equivalence runs go two at a time: the
whole file is a few minutes on a 2-core machine.
"""
from __future__ import annotations

import itertools
import json
import math
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mlplat.parallel.profile import CATEGORIES
from tests.helpers.cli import read_metrics, read_wandb_run, run_train, train_losses

# The equivalence runs (a module fixture) take minutes on 2 cores, more on a busy machine: above the 600 s default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

RTOL = 1e-9


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _mean(xs) -> float:
    return sum(xs) / len(xs)


# -- 1. the user-facing run -------------------------------------------------------------------------------
LEARN_STEPS = 30


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    """30 steps on one process with the CSV logger, validation every 12 steps (and after the last, which the interval
    misses) and a short sample."""
    run_dir = tmp_path_factory.mktemp("learn")
    proc = run_train(run_dir, "parallel=single", "logger=csv", f"trainer.max_steps={LEARN_STEPS}",
                     "trainer.val_check_interval=12", "trainer.limit_val_batches=2", "sample.max_new_tokens=16")
    return run_dir, proc


def test_loss_falls_and_val_loss_is_logged(learning_run):
    run_dir, _ = learning_run
    losses = train_losses(run_dir)
    assert len(losses) == LEARN_STEPS and all(math.isfinite(x) for x in losses)
    first, last = _mean(losses[:5]), _mean(losses[-5:])
    assert last < first - 0.5, f"loss did not fall: first-5 mean {first:.3f}, last-5 mean {last:.3f}"
    vals = [(int(r["step"]), float(r["val_loss"])) for r in read_metrics(run_dir) if r.get("val_loss")]
    assert [s for s, _ in vals] == [12, 24, 30], vals  # the last step is validated too
    assert all(math.isfinite(v) for _, v in vals) and vals[-1][1] < losses[0]


def test_csv_logger_hparams_hold_the_config_and_prediction(learning_run):
    import yaml

    run_dir, _ = learning_run
    (hparams,) = (run_dir / "lightning_logs").glob("version_*/hparams.yaml")
    logged = yaml.safe_load(hparams.read_text())
    assert logged["parallel"]["tp"] == 1 and logged["model"]["hidden"] == 128
    assert logged["trainer"]["max_steps"] == LEARN_STEPS and "logger=csv" in logged["overrides"]
    assert logged["prediction"]["predicted_step_time_s"] > 0 and 0 <= logged["prediction"]["predicted_bubble"] < 1


def test_metrics_csv_has_one_row_per_optimizer_step(learning_run):
    run_dir, _ = learning_run
    rows = read_metrics(run_dir)
    assert {"step", "train_loss", "tokens_per_s"} <= set(rows[0])
    assert [int(r["step"]) for r in rows] == list(range(1, LEARN_STEPS + 1))
    # tokens/s needs the previous step's end time: every step but the first has it.
    assert all(float(r["tokens_per_s"]) > 0 for r in rows[1:])
    assert all(r["train_loss"] for r in rows)


def test_csv_logger_writes_under_run_dir(learning_run):
    run_dir, _ = learning_run
    logs = list(run_dir.glob("lightning_logs/version_*/metrics.csv"))
    assert len(logs) == 1, list(run_dir.rglob("*"))
    text = logs[0].read_text()
    assert "train_loss" in text and "val_loss" in text
    assert not (run_dir / "wandb").exists()


def test_sample_is_printed_at_the_end(learning_run):
    _, proc = learning_run
    assert "--- sample ---" in proc.stdout
    sample = proc.stdout.split("--- sample ---", 1)[1].strip().splitlines()[0]
    assert sample.startswith("The for statement") and len(sample) > len("The for statement")


def test_the_console_tells_the_run_and_ends_with_its_summary(learning_run):
    """One line for the layout and one for the data; the libraries' lines that do not apply are gone; the summary
    (layout, loss curve ends, throughput, one step's breakdown) comes right before the sample."""
    run_dir, proc = learning_run
    out = proc.stdout + proc.stderr
    assert "layout: t=1 p=1 v=1 d=1, no pipeline, m=2 micro-batches of 8 per step, on 1 cpu process" in out
    assert "data: the embedded corpus (Python's documentation), tokenizer byte: " in out
    for noise in ("litlogger", "LeafSpec", "TPU available", "GPU available", "The anonymous setting", "Epoch 0",
                  "sync_dist", "v_num", "\x1b[A", "`Trainer.fit` stopped"):
        assert noise not in out, noise
    assert f"run directory: {run_dir}" in out
    # One line per optimizer step (trainer.log_every_n_steps=1 on CPU), as metrics.csv's row says, in train.log too;
    # the step after each validation is timed from the validation's end, not left with the step before's figures.
    rows = read_metrics(run_dir)
    lines = [line.split(" - ", 1)[1] for line in out.splitlines() if "] - step " in line]
    assert [line.split(" | ")[0] for line in lines] == [f"step {k}/{LEARN_STEPS}" for k in range(1, LEARN_STEPS + 1)]
    assert f"loss {float(rows[11]['train_loss']):.4f} | " in lines[11] and " tokens/s" in lines[11], lines[11]
    log_text = (run_dir / "train.log").read_text()
    assert all(line in log_text for line in lines)
    assert "--- run summary ---" in log_text and "--- sample ---" in log_text
    assert rows[12]["step_time_s"] and rows[12]["step_time_s"] != rows[11]["step_time_s"]
    summary = proc.stdout.split("--- run summary ---", 1)[1].split("--- sample ---", 1)[0].strip().splitlines()
    assert summary[0].startswith("layout      t=1 p=1 v=1 d=1, no pipeline, 1 cpu process, m=2"), summary
    first, last = float(rows[0]["train_loss"]), float(rows[-1]["train_loss"])
    assert summary[1] == f"steps       1-{LEARN_STEPS}", summary
    assert summary[2] == f"train loss  {first:.3f} (step 1) -> {last:.3f} (step {LEARN_STEPS})", summary
    assert summary[3].startswith("val loss    ") and summary[3].endswith(f"(step {LEARN_STEPS})"), summary
    assert summary[4].startswith("throughput  "), summary
    step = f"step {LEARN_STEPS - 1}"
    assert summary[5].startswith(step) and " s on rank 0: compute " in summary[5], summary
    assert summary[0].endswith(", 32-true"), summary  # the precision, and an FP8 recipe's path where one is set
    assert summary[6] == (f"files       in {run_dir}: metrics.csv (a row per step), loss.png (the loss curves per "
                          f"step), checkpoints/, train.log"), summary  # the last step saved (checkpoint.save_last)
    # Only the columns this run fills: no profile (the summary's step is not a profiled row), no MFU on a CPU, no
    # loss scale in fp32, no redone steps without post-validation.
    assert list(rows[0]) == ["step", "train_loss", "val_loss", "grad_norm", "lr", "step_time_s", "tokens_per_s",
                             "tflops_per_device", "skipped_steps"], list(rows[0])
    assert all(r["skipped_steps"] == "0" for r in rows)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """About 40 KB of a user's own text (pseudo-English from a fixed seed)."""
    rng = random.Random(0)
    words = "the a pipeline stage sends its activations to the next rank while tensor parallel shards " \
            "every matrix multiply and data parallel replicas average their gradients".split()
    lines = [" ".join(rng.choice(words) for _ in range(12)).capitalize() + "." for _ in range(500)]
    path = tmp_path_factory.mktemp("corpus") / "my_corpus.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def wandb_text_run(tmp_path_factory, text_file):
    """The default logger (W&B, offline: tests.helpers.cli sets WANDB_MODE=offline) on a user's text file."""
    run_dir = tmp_path_factory.mktemp("wandb_text")
    proc = run_train(run_dir, "parallel=single", "data=text", f"data.path={text_file}", "trainer.max_steps=3",
                     "trainer.limit_val_batches=0", "sample.max_new_tokens=0")
    return run_dir, proc


def test_default_logger_is_offline_wandb_under_run_dir(wandb_text_run):
    run_dir, _ = wandb_text_run
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(run_dir.rglob("*"))
    assert list(runs[0].glob("*.wandb")), list(runs[0].rglob("*"))


def test_wandb_run_carries_config_name_and_prediction(wandb_text_run):
    """The W&B run config is the resolved config; the run is named from its overrides; the summary has the
    planner's prediction beside the measured step time."""
    run_dir, _ = wandb_text_run
    run = read_wandb_run(run_dir)
    assert run["config"]["parallel"]["tp"] == 1 and run["config"]["model"]["hidden"] == 128
    assert run["config"]["data"]["name"] == "text" and "parallel=single" in run["config"]["overrides"]
    assert run["name"].startswith("parallel=single,data=text,") and run["group"] == ""
    assert run["config"]["prediction"]["predicted_step_time_s"] > 0
    assert run["summary"]["predicted_step_time_s"] == run["config"]["prediction"]["predicted_step_time_s"]
    assert run["summary"]["step_time_s"] > 0 and run["summary"]["tflops_per_device"] > 0


def test_data_text_trains_on_the_users_file(wandb_text_run, learning_run):
    run_dir, proc = wandb_text_run
    losses = train_losses(run_dir)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # Same model, seed and batch as the pydoc run: only the data differs, and so does the first loss.
    assert losses[0] != train_losses(learning_run[0])[0]
    assert "--- sample ---" not in proc.stdout  # sample.max_new_tokens=0 skips generation


# -- 2. equivalence: every layout equals one process, in float64 ------------------------------------------
EQUIV_COMMON = ("parallel=single", "logger=none", "trainer.precision=64-true", "trainer.max_steps=3",
                "trainer.limit_val_batches=0", "sample.max_new_tokens=0", "parallel.micro_batch_size=2",
                "parallel.global_batch_size=8", "model.seq_len=64")
EIGHT_LAYERS = ("model.n_layers=8",)
TEN_LAYERS = ("model.n_layers=10",)  # no even split over p = 3 or p·v = 8: the uneven stages
INTERLEAVED = ("parallel.vpp=2", "parallel.schedule=interleaved")
SP = "parallel.sequence_parallel=true"
DROPOUT = ("model.dropout=0.1", "trainer.max_steps=10")  # the later max_steps wins
LLAMA = ("model=llama_tiny",)
MOE = ("model=moe_tiny",)
PACKED = ("data=text", "data.path={short_documents}", "data.pack=true")
FLOAT32 = ("trainer.precision=32-true", "trainer.max_steps=2")  # the FP8 runs in float32 (test_fp8_in_float32)
# 0.5, not the default 0.2: 8 ranks crowded on 2 cores vary by up to ~30% in CPU time (mlplat/parallel/straggler.py)
EVEN_STRAGGLER_CHECK = ("straggler.every_steps=1", "straggler.threshold=0.5")
# name: (overrides, processes, reference run)
RUNS: dict[str, tuple[tuple[str, ...], int, str | None]] = {
    "one-process": ((), 1, None),
    "one-process-8-layers": (EIGHT_LAYERS, 1, None),
    # Profiled steps must not change a digit (and are checked below).
    "tp2": (("parallel.tp=2", "profile.steps=[2,3]", "profile.torch=true"), 2, "one-process"),
    "tp4": (("parallel.tp=4",), 4, "one-process"),
    "one-process-10-layers": (TEN_LAYERS, 1, None),
    # Uneven stages: the first and the last chunk hold parallel.first/last_stage_layers, the others split the rest.
    # 1F1B over [2, 4, 4]; interleaved over [2, 1 x6, 2] (the first rank's first, the last rank's last chunk).
    "pp3-1f1b-uneven": (("parallel.pp=3", "parallel.first_stage_layers=2", *TEN_LAYERS), 3, "one-process-10-layers"),
    "pp4-interleaved-v2-uneven": (("parallel.pp=4", *INTERLEAVED, "parallel.first_stage_layers=2",
                                   "parallel.last_stage_layers=2", *TEN_LAYERS), 4, "one-process-10-layers"),
    "tp2-pp2v2-dp2": (("parallel.tp=2", "parallel.pp=2", *INTERLEAVED, "parallel.dp=2", "profile.steps=[2,3]"), 8,
                      "one-process"),
    # Zero bubble: split backward (deferred weight GEMMs); zbv puts the embedding and the loss on rank 0, here
    # with uneven ends ([1 x7, 3]: rank 0 holds 4 layers, the others 2).
    "pp4-zb_h1": (("parallel.pp=4", "parallel.schedule=zb_h1", *EIGHT_LAYERS), 4, "one-process-8-layers"),
    "pp4-zbv-uneven": (("parallel.pp=4", "parallel.schedule=zbv", "parallel.vpp=2", "parallel.first_stage_layers=1",
                        "parallel.last_stage_layers=3", *TEN_LAYERS), 4, "one-process-10-layers"),
    # V-Half: the V at half of 1F1B's activations (p/2 micro-batches per rank).
    "pp4-v_half": (("parallel.pp=4", "parallel.schedule=v_half", "parallel.vpp=2", *EIGHT_LAYERS), 4,
                   "one-process-8-layers"),
    # Checked for stragglers at every step (an even run: nobody named, test_an_even_run_names_no_straggler).
    "tp2-pp2-dp2-zb_h1": (("parallel.tp=2", "parallel.pp=2", "parallel.schedule=zb_h1", "parallel.dp=2",
                           *EVEN_STRAGGLER_CHECK), 8, "one-process"),
    # Sequence parallelism: LayerNorm/dropout regions on 1/t of the sequence, stages exchanging shards.
    "tp4-pp2-sp": (("parallel.tp=4", "parallel.pp=2", SP), 8, "one-process"),
    # Dropout on: compared with each other, not with one process (test_sequence_parallel_with_dropout_learns).
    "tp2-dropout": (("parallel.tp=2", *DROPOUT), 2, None),
    "tp2-sp-dropout": (("parallel.tp=2", SP, *DROPOUT), 2, None),
    # Parameters sharded (optim.sharding=params, ZeRO-3): each rank keeps 1/d of the weights, gradients and AdamW's
    # state, gathers a layer's weights ahead of its forward and backward, reduce-scatters its gradients after every
    # micro-batch; here post-validated, every step clipped (the reference's norm is above optim.grad_clip=1). The
    # one-process reference runs torch's AdamW.
    "dp4-params-post-validate": (("parallel.dp=4", "optim.sharding=params", "optim.post_validate=true"), 4,
                                 "one-process"),
    # The distributed optimizer alone (optim.sharding=optim): gradients reduce-scattered into shards after the last
    # micro-batch, AdamW on the shards, the weights all-gathered after the step; and its older spelling over d·c.
    "dp4-distributed-optimizer": (("parallel.dp=4", "optim.sharding=optim"), 4, "one-process"),
    # Post-validated too (each step first, the clipping and inf/NaN checks read after it, a clipped step redone),
    # under ZB-H2, the schedule that post-validation is for.
    "tp2-pp2-dp2-zb_h2-distributed-optimizer-post-validate": (("parallel.tp=2", "parallel.pp=2", "parallel.dp=2",
                                                               "parallel.schedule=zb_h2", "optim.distributed=true",
                                                               "optim.post_validate=true"), 8, "one-process"),
    # With sequence parallelism too: its LayerNorm/bias gradients are summed over tp on the gradient shards; the
    # parameters sharded under interleaved stages (each chunk's layers gathered in turn).
    "tp2-sp-pp2v2-dp2-params": (("parallel.tp=2", "parallel.pp=2", *INTERLEAVED, "parallel.dp=2", SP,
                                 "optim.sharding=params"), 8, "one-process"),
    # The Llama family (RMSNorm, SwiGLU, rotary positions, 2 key/value heads for 4 query heads, untied output):
    # tp2 holds one key/value head (and its two query heads) per rank.
    "llama-one-process": (LLAMA, 1, None),
    "llama-tp2-sp": ((*LLAMA, "parallel.tp=2", SP), 2, "llama-one-process"),
    # zbv's V with the parameters sharded: W deferred past later micro-batches' B, the gradients' full buffers kept
    # through the pass
    "llama-pp2-zbv-dp2-params": ((*LLAMA, "parallel.pp=2", "parallel.schedule=zbv", "parallel.vpp=2", "parallel.dp=2",
                                  "optim.sharding=params"), 4, "llama-one-process"),
    "llama-tp2-pp2v2-dp2-distributed-optimizer": ((*LLAMA, "parallel.tp=2", "parallel.pp=2", *INTERLEAVED,
                                                   "parallel.dp=2", "optim.distributed=true"), 8, "llama-one-process"),
    "llama-tp2-pp2-recompute-selective": ((*LLAMA, "parallel.tp=2", "parallel.pp=2", "kernels.recompute=selective"),
                                          4, "llama-one-process"),
    # full recomputation re-runs a layer's forward inside backward: with sharded parameters it finds them gathered
    "llama-pp2-dp2-recompute-full-params": ((*LLAMA, "parallel.pp=2", "parallel.dp=2", "kernels.recompute=full",
                                             "optim.sharding=params"), 4, "llama-one-process"),
    # Context parallelism: each rank holds 2 of the 2c chunks of every sequence; attention is a ring (K/V blocks
    # passed on, merged by their log-sum-exp); gradients are reduced over d·c.
    "cp4": (("parallel.cp=4",), 4, "one-process"),
    "cp2-tp2-sp-pp2v2": (("parallel.cp=2", "parallel.tp=2", SP, "parallel.pp=2", *INTERLEAVED,
                          "profile.steps=[2,3]"), 8, "one-process"),
    "cp2-dp2-params": (("parallel.cp=2", "parallel.dp=2", "optim.sharding=params"), 4, "one-process"),
    "cp2-dp2-distributed-optimizer": (("parallel.cp=2", "parallel.dp=2", "optim.distributed=true"), 4,
                                      "one-process"),
    "llama-cp2-tp2": ((*LLAMA, "parallel.cp=2", "parallel.tp=2"), 4, "llama-one-process"),
    # m = 8 micro-batches of 1 (4p) through the zbv V; and m = 1 through p = 4 (one micro-batch of 8, equal to the
    # reference's mean of four: every micro-batch has as many tokens).
    "llama-cp2-pp2-zbv-m8": ((*LLAMA, "parallel.cp=2", "parallel.pp=2", "parallel.schedule=zbv", "parallel.vpp=2",
                              "parallel.micro_batch_size=1"), 4, "llama-one-process"),
    "cp2-pp4-m1": (("parallel.cp=2", "parallel.pp=4", "parallel.micro_batch_size=8", *EIGHT_LAYERS), 8,
                   "one-process-8-layers"),
    # Packed documents (short ones: most windows hold several): attention, positions and the loss stop at each
    # end-of-document token, on every stage and across the cp ranks' chunks.
    # Mixture of experts (model=moe_tiny: a dense first layer, 8 experts top-2 with a gated shared expert, the
    # balancing and z losses on): expert parallelism folded onto tp (4 whole experts per rank, each rank routing
    # its sequence shard, the all-to-all over the tp ranks), interleaved stages, the distributed optimizer over
    # the experts' edp ranks; the balancing loss logged equal too.
    "moe-one-process": ((*MOE, "logger=wandb"), 1, None),  # W&B offline: the loggers get the expert loads too
    "moe-ep2-tp2-sp-pp2v2-dp2-distributed-optimizer": ((*MOE, "parallel.ep=2", "parallel.tp=2", SP, "parallel.pp=2",
                                                        *INTERLEAVED, "parallel.dp=2", "optim.distributed=true"), 8,
                                                       "moe-one-process"),
    # Tokens dispatched by all-gather over ep2 within dp4, post-validated, the parameters sharded: HSDP for the
    # dense ones (parallel.dp_shard=2: 2 shards x 2 replicas, the replicas' gradients all-reduced once per step),
    # the experts over their own 2 edp ranks. And ep2 over the cp ranks of four one-layer stages (the first dense),
    # each rank routing its cp chunks.
    "moe-ep2-dp4-hsdp-allgather-post-validate": ((*MOE, "parallel.ep=2", "parallel.dp=4", "parallel.dp_shard=2",
                                                  "optim.sharding=params", "model.moe.dispatcher=allgather",
                                                  "optim.post_validate=true"), 4, "moe-one-process"),
    "moe-ep2-cp2-pp4": ((*MOE, "parallel.ep=2", "parallel.cp=2", "parallel.pp=4"), 8, "moe-one-process"),
    # FP8 (kernels.fp8): the layers' GEMMs quantised, computed wider under 64-true, each layout against one process
    # under the same recipe: tp2 with sequence parallelism, interleaved stages and the distributed optimizer over
    # d2 in one run, and c2. Blockwise needs whole 128-blocks on every rank: the hidden size of 128 keeps t = 1 and
    # 64 tokens no cp.
    **{f"fp8-{recipe}-{name}": ((f"kernels.fp8={recipe}", *keys), n, None if n == 1 else f"fp8-{recipe}-one-process")
       for recipe in ("tensorwise", "rowwise")
       for name, keys, n in (("one-process", (), 1),
                             ("tp2-sp-pp2v2-dp2-distributed-optimizer", ("parallel.tp=2", SP, "parallel.pp=2",
                                                                         *INTERLEAVED, "parallel.dp=2",
                                                                         "optim.distributed=true"), 8),
                             ("cp2", ("parallel.cp=2",), 2))},
    "fp8-blockwise-one-process": (("kernels.fp8=blockwise",), 1, None),
    "fp8-blockwise-pp2v2-dp2-distributed-optimizer": (("kernels.fp8=blockwise", "parallel.pp=2", *INTERLEAVED,
                                                       "parallel.dp=2", "optim.distributed=true"), 4,
                                                      "fp8-blockwise-one-process"),
    # FP8 in float32 (FLOAT32), where tensorwise and rowwise multiply through torch._scaled_mm (float64 takes the
    # emulation): per recipe one layout holding the splits its scales see, against one process in float32.
    **{f"fp8-{recipe}-float32-{name}": ((f"kernels.fp8={recipe}", *FLOAT32, *keys), n,
                                        None if n == 1 else f"fp8-{recipe}-float32-one-process")
       for recipe, layout in (("tensorwise", ("cp2-tp2-sp-pp2v2", ("parallel.cp=2", "parallel.tp=2", SP,
                                                                     "parallel.pp=2", *INTERLEAVED), 8)),
                              ("rowwise", ("cp2-tp2-sp-dp2-distributed-optimizer", ("parallel.cp=2", "parallel.tp=2",
                                                                                   SP, "parallel.dp=2",
                                                                                   "optim.distributed=true"), 8)),
                              ("blockwise", ("pp2v2-dp2-distributed-optimizer", ("parallel.pp=2", *INTERLEAVED,
                                                                                 "parallel.dp=2",
                                                                                 "optim.distributed=true"), 4)))
       for name, keys, n in (("one-process", (), 1), layout)},
    "llama-packed-one-process": ((*LLAMA, *PACKED), 1, None),
    "llama-packed-cp2-pp2-recompute-selective": ((*LLAMA, *PACKED, "parallel.cp=2", "parallel.pp=2",
                                                  "kernels.recompute=selective"), 4, "llama-packed-one-process"),
}
LAYOUTS = [name for name, (keys, _, ref) in RUNS.items() if ref is not None and FLOAT32[0] not in keys]
FLOAT32_LAYOUTS = [name for name, (keys, _, ref) in RUNS.items() if ref is not None and FLOAT32[0] in keys]


@pytest.fixture(scope="module")
def equivalence_runs(tmp_path_factory):
    """Every run of RUNS, two at a time (biggest first); name -> run dir, or the exception it raised."""
    base = tmp_path_factory.mktemp("equiv")
    documents = short_documents(base / "short_documents")

    def one(name: str):
        run_dir = base / name
        try:
            overrides = [o.format(short_documents=documents) for o in RUNS[name][0]]
            run_train(run_dir, *EQUIV_COMMON, *overrides, timeout=900)
            return run_dir
        except Exception as e:  # reported by the test of that layout
            return e

    order = sorted(RUNS, key=lambda n: -RUNS[n][1])
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(order, pool.map(one, order)))
    return results


def short_documents(folder: Path) -> Path:
    """400 files, each the start of a paragraph of the Python reference: documents of 10 to 70 bytes."""
    from mlplat.data.corpus import pydoc_corpus

    folder.mkdir(parents=True, exist_ok=True)
    paragraphs = [p for p in pydoc_corpus().split("\n\n") if p.strip()]
    for i in range(400):
        (folder / f"doc{i:03d}.txt").write_text(paragraphs[i][: 10 + (37 * i) % 61], encoding="utf-8")
    return folder


def test_packed_windows_hold_several_documents(tmp_path):
    """The packed runs' data really packs: the windows of 64 bytes hold two documents or more, on average."""
    import torch

    from mlplat.data.corpus import load_documents
    from mlplat.data.dataset import TokenWindows
    from mlplat.data.packing import PackedWindows

    ids = [i for doc in load_documents("text", str(short_documents(tmp_path))) for i in (*doc.encode(), 0)]
    windows = PackedWindows(TokenWindows(torch.tensor(ids), 64), eod=0)
    counts = [int(windows[i][2].max()) + 1 for i in range(len(windows))]
    assert sum(counts) / len(counts) > 2, counts[:20]


def test_a_packed_run_says_so(equivalence_runs):
    log = (_run_dir(equivalence_runs, "llama-packed-one-process") / "train.log").read_text()
    assert "; packed: documents end at token 0, positions restart and attention stays inside each" in log


def _run_dir(runs, name: str) -> Path:
    result = runs[name]
    if isinstance(result, Exception):
        raise result
    return result


def test_post_validated_run_redoes_exactly_the_clipped_steps(equivalence_runs):
    """The post-validated layout's logged count of redone steps: a step is stepped first unless the step before it
    was clipped, and redone when the one-process run clipped it (its gradient norm above optim.grad_clip, 1.0)."""
    ref = read_metrics(_run_dir(equivalence_runs, "one-process"))
    got = read_metrics(_run_dir(equivalence_runs, "tp2-pp2-dp2-zb_h2-distributed-optimizer-post-validate"))
    clipped = [float(r["grad_norm"]) > 1.0 for r in ref]
    assert clipped[0], f"the reference's first step was not clipped: {[r['grad_norm'] for r in ref]}"
    eager = [not before for before in [False, *clipped[:-1]]]
    expected = list(itertools.accumulate(e and c for e, c in zip(eager, clipped)))
    assert [int(float(r["redone_steps"])) for r in got] == expected, (clipped, expected)
    assert all(not r.get("redone_steps") for r in ref)  # logged by post-validated runs only


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_equals_one_process_in_float64(equivalence_runs, layout):
    overrides, n_proc, ref_name = RUNS[layout]
    ref = read_metrics(_run_dir(equivalence_runs, ref_name))
    got = read_metrics(_run_dir(equivalence_runs, layout))
    assert [int(r["step"]) for r in got] == [int(r["step"]) for r in ref] == [1, 2, 3]
    for r, g in zip(ref, got):
        step, a, b = int(r["step"]), float(g["train_loss"]), float(r["train_loss"])
        assert _rel(a, b) <= RTOL, f"{layout} step {step}: train_loss {a!r} vs one process {b!r} " \
                                   f"(rel {_rel(a, b):.2e})"
        # grad_norm is logged in float32: equal to its 7 digits (it includes the gradient clipping's norm).
        assert _rel(float(g["grad_norm"]), float(r["grad_norm"])) <= 1e-6, (layout, step)
        assert ("moe_aux_loss" in g) == ("moe_aux_loss" in r) == ("model=moe_tiny" in overrides), layout
        if "moe_aux_loss" in g:
            assert _rel(float(g["moe_aux_loss"]), float(r["moe_aux_loss"])) <= RTOL, (layout, step)
            # The expert loads over the global batch, from every stage's layers and every replica's tokens.
            loads = [c for c in r if c.startswith("moe_load_")]
            assert len(loads) == 2 + 2 * 3 and [c for c in g if c.startswith("moe_load_")] == loads, layout
            for c in loads:
                assert _rel(float(g[c]), float(r[c])) <= RTOL, (layout, step, c, g[c], r[c])
    # The steps really trained (clipped AdamW updates move the loss), so equality is not vacuous.
    assert float(ref[0]["train_loss"]) - float(ref[-1]["train_loss"]) > 0.1


def test_a_mixture_of_experts_run_shows_its_expert_load(equivalence_runs):
    """With MoE layers (moe_tiny: layers 1-3 of 4) metrics.csv has each step's expert load over all layers and per
    layer (the least and the most loaded expert's share of the mean; no dropped columns when dropless), as W&B
    does, the run summary the last step's per layer, and the run directory a picture of them over the steps; every
    run, dense or not, a picture of its loss curves."""
    run_dir = _run_dir(equivalence_runs, "moe-one-process")
    rows = read_metrics(run_dir)
    layers = [1, 2, 3]
    assert [c for c in rows[0] if c.startswith(("moe_load", "moe_dropped"))] == [
        "moe_load_min", "moe_load_max", *(f"moe_load_{m}/layer{i}" for i in layers for m in ("min", "max"))]
    for r in rows:
        low, high = ([float(r[f"moe_load_{m}/layer{i}"]) for i in layers] for m in ("min", "max"))
        assert all(0 <= a < 1 < b <= 8 for a, b in zip(low, high)), r  # 8 experts: at most all of them on one
        assert float(r["moe_load_min"]) == min(low) and float(r["moe_load_max"]) == max(high)
    log = (run_dir / "train.log").read_text()
    last = rows[-1]
    shown = ", ".join(f"layer {i} {float(last[f'moe_load_min/layer{i}']):.2f}-"
                      f"{float(last[f'moe_load_max/layer{i}']):.2f}" for i in layers)
    assert ("expert load step 3, the least and the most loaded expert's tokens over the mean (1 = balanced):\n"
            f"            {shown}\n") in log, log[-800:]
    assert f"expert load max {float(rows[0]['moe_load_max']):.2f} | " in log
    assert (run_dir / "expert_load.png").stat().st_size > 10_000
    assert "expert_load.png (each MoE layer's expert load per step)" in log  # the summary names it
    dense = _run_dir(equivalence_runs, "one-process")
    assert not (dense / "expert_load.png").exists()
    # Every run draws its loss curves (W&B is offline by default: without a sync there is nothing else to look at)
    for d in (run_dir, dense):
        assert (d / "loss.png").stat().st_size > 10_000
        assert "loss.png (the loss curves per step)" in (d / "train.log").read_text()
    # and saves its last step without checkpoint.every_steps (checkpoint.save_last): a finished run can be exported
    from mlplat.checkpoint.io import latest_name

    assert latest_name(dense / "checkpoints") == f"step-{read_metrics(dense)[-1]['step']}"
    summary = read_wandb_run(run_dir)["summary"]  # the W&B run's last values: the last step's
    for c in ("moe_aux_loss", "moe_load_min", "moe_load_max", *(f"moe_load_max/layer{i}" for i in layers)):
        assert summary[c] == float(last[c]), (c, summary.get(c), last[c])


def test_uneven_stages_are_the_run_summarys(equivalence_runs):
    """The run summary names the layers of each chunk of an uneven split (so the runs above really ran it)."""
    for name, split in (("pp3-1f1b-uneven", "2, 4 x2"), ("pp4-interleaved-v2-uneven", "2, 1 x6, 2"),
                        ("pp4-zbv-uneven", "1 x7, 3")):
        log = (_run_dir(equivalence_runs, name) / "train.log").read_text()
        assert f"micro-batches of 2 x 64 tokens, layers per chunk {split}, " in log, name


def test_sequence_parallel_with_dropout_learns(equivalence_runs):
    """Dropout 0.1 at t=2: the sequence-parallel run draws other masks (the shards' masks come from the
    tensor-parallel streams) yet falls as the run without sequence parallelism does."""
    plain = train_losses(_run_dir(equivalence_runs, "tp2-dropout"))
    sp = train_losses(_run_dir(equivalence_runs, "tp2-sp-dropout"))
    assert len(plain) == len(sp) == 10 and all(math.isfinite(x) for x in plain + sp)
    assert sp != plain, "sequence parallelism should draw other dropout masks"
    for losses in (plain, sp):
        assert _mean(losses[:3]) - _mean(losses[-3:]) > 0.3, losses
    assert _rel(_mean(sp[-3:]), _mean(plain[-3:])) < 0.05, (sp, plain)


def test_fp8_runs_quantise(equivalence_runs):
    """The FP8 references are not the run in the run's precision: each recipe's rounding moves the losses (so their
    layouts' equality with them is the recipe's, not a no-op's)."""
    plain = train_losses(_run_dir(equivalence_runs, "one-process"))
    fp8 = {r: train_losses(_run_dir(equivalence_runs, f"fp8-{r}-one-process"))
           for r in ("tensorwise", "rowwise", "blockwise")}
    for recipe, losses in fp8.items():
        assert len(losses) == len(plain) == 3 and 1e-6 < abs(losses[0] - plain[0]) < 0.05, (recipe, losses, plain)
    assert len({ls[0] for ls in fp8.values()}) == 3  # three recipes, three roundings
    fp32 = {train_losses(_run_dir(equivalence_runs, f"fp8-{r}-float32-one-process"))[0] for r in fp8}
    assert len(fp32) == 3, fp32  # and in float32


# FP8 in float32. A layout sums in another order (tensor-parallel partial sums, the context-parallel ring, the
# data-parallel reduction), which moves an operand by an ulp; that flips the FP8 code of each element lying on a
# rounding boundary, a step of 1/16 to 1/4 of its value (e4m3, e5m2), so a layout is off by far more than float32's
# 1e-7. Measured, each recipe's layout against its one process, seeds 1234, 1 and 2: the first step's loss (same
# weights) within 2.1e-5 and its gradient norm within 4.7e-4; the second step's loss within 1.6e-4 (AdamW's first
# update is lr·sign(g): a near-zero gradient's rounding can move its weight by 2·lr). The bounds are 3-5 times
# those. Layout-dependent scales fail the first step's, in 14 of 15 runs at those seeds: without the amax
# all-reduces (tensorwise, rowwise; blockwise has none), or with a scale 10% off on odd ranks (all three; blockwise
# at seed 1 passes, 8.2e-5 and 8.4e-4).
FP32_FIRST_LOSS, FP32_FIRST_GRAD_NORM, FP32_LOSS = 1e-4, 2e-3, 5e-4


@pytest.mark.parametrize("layout", FLOAT32_LAYOUTS)
def test_fp8_in_float32_equals_one_process(equivalence_runs, layout):
    ref = read_metrics(_run_dir(equivalence_runs, RUNS[layout][2]))
    got = read_metrics(_run_dir(equivalence_runs, layout))
    assert [int(r["step"]) for r in got] == [int(r["step"]) for r in ref] == [1, 2]
    first = [(name, _rel(float(got[0][name]), float(ref[0][name])), bound)
             for name, bound in (("train_loss", FP32_FIRST_LOSS), ("grad_norm", FP32_FIRST_GRAD_NORM))]
    second = ("train_loss", _rel(float(got[1]["train_loss"]), float(ref[1]["train_loss"])), FP32_LOSS)
    assert all(rel <= bound for _, rel, bound in [*first, second]), (layout, first, second)
    assert float(ref[0]["train_loss"]) - float(ref[1]["train_loss"]) > 0.1  # the step moved the weights


def test_equivalence_runs_used_the_processes_of_their_layout(equivalence_runs):
    """Each child rank writes DIR/rank<k>.log: the layouts really ran on t·p·d processes."""
    for name, (_, n_proc, _) in RUNS.items():
        run_dir = _run_dir(equivalence_runs, name)
        ranks = sorted(p.name for p in run_dir.glob("rank*.log"))
        assert ranks == [f"rank{k}.log" for k in range(1, n_proc)], (name, ranks)


def test_an_even_run_names_no_straggler(equivalence_runs):
    """Every step of the 3D run is checked (`straggler_slowdown` logged: the slowest rank's, against the other 3 of
    its stage) and nobody is named (no line, no `straggler_rank`)."""
    run_dir = _run_dir(equivalence_runs, "tp2-pp2-dp2-zb_h1")
    rows = read_metrics(run_dir)
    assert len(rows) == 3 and all(0 <= float(r["straggler_slowdown"]) < 0.5 for r in rows), rows
    assert all(r["straggler_rank"] == "" for r in rows)
    assert "straggler:" not in (run_dir / "train.log").read_text()
    assert "straggler_slowdown" not in read_metrics(_run_dir(equivalence_runs, "tp4"))[0]  # unchecked: no column


def test_logger_none_writes_no_logger_files(equivalence_runs):
    run_dir = _run_dir(equivalence_runs, "one-process")
    assert (run_dir / "metrics.csv").exists()
    assert not (run_dir / "wandb").exists() and not list(run_dir.glob("lightning_logs"))


# What no span covers is the host's Python between a rank's instructions, and, with 8 ranks on CI's 2 cores,
# the scheduler's pauses there: 3-5% of a toy step there (5.06% seen once), so the bound is 10%. A category
# that went unrecorded is caught by the category checks beside it, not by this sum.
SPAN_COVER = 0.10


def test_profiled_steps_trace_every_rank_and_account_for_the_step(equivalence_runs):
    """The 3D layout's profiled steps: a Chrome trace with all 8 ranks, a timeline and a report; each step's
    breakdown (metrics.csv) adds up to its measured step time within SPAN_COVER."""
    run_dir = _run_dir(equivalence_runs, "tp2-pp2v2-dp2")
    trace = json.loads((run_dir / "profile" / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(8))
    assert {"compute", "bubble", "tp_comm", "dp_comm", "optimizer"} <= {e["cat"] for e in spans}
    assert any(e["name"].startswith("RECV_ACT(chunk ") and " from pipeline rank " in e["name"] for e in spans)
    assert (run_dir / "profile" / "timeline.png").stat().st_size > 10_000
    assert "measured / simulated" in (run_dir / "profile" / "report.md").read_text()
    rows = {int(r["step"]): r for r in read_metrics(run_dir)}
    for step in (2, 3):
        parts = [float(rows[step][f"time_{c}_s"]) for c in CATEGORIES]
        assert abs(sum(parts) / float(rows[step]["step_time_s"]) - 1) < SPAN_COVER, (step, parts, rows[step])
    assert not rows[1]["time_compute_s"]  # step 1 was not profiled


def test_a_large_run_reports_from_its_drawn_pipelines_files_only(equivalence_runs, tmp_path):
    """Beyond TRACE_ALL_RANKS ranks, rank 0 reads only the rank files of the pipeline it draws (ranks 0 and 4 of
    t2·p2·d2), not thousands: the report, trace and timeline come from those two files alone."""
    import shutil

    from mlplat.parallel.layout.pipeline import PipelineLayout
    from mlplat.perf.profile_report import write_profile

    for k in (0, 4):  # the other ranks' files are not there: reading one would fail
        shutil.copy(_run_dir(equivalence_runs, "tp2-pp2v2-dp2") / "profile" / f"rank-{k}.json", tmp_path)
    m = 1 + max(span[4]["micro_batch"] for span in json.loads((tmp_path / "rank-0.json").read_text())["spans"]
                if span[1] == "compute")
    figures = write_profile(tmp_path, PipelineLayout(2, 2, "interleaved"), m, "t2 p2 v2 d2", pipeline_ranks=[0, 4])
    assert set(figures["steps"]) == {2, 3} and figures["pipeline_simulated"] > 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 4}
    assert "2 ranks (rank 0's pipeline" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def test_profiled_steps_show_the_context_parallel_ring(equivalence_runs):
    """The 4D run's profiled steps: every rank's ring waits are spans of their own (cp_comm, named by hop), and
    the breakdown in metrics.csv has a cp_comm column that adds up with the rest to the step time."""
    run_dir = _run_dir(equivalence_runs, "cp2-tp2-sp-pp2v2")
    trace = json.loads((run_dir / "profile" / "trace.json").read_text())
    ring = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "cp_comm"]
    assert {e["pid"] for e in ring} == set(range(8))
    # Each rank's record names its cp rank, so the report draws one rank per pipeline stage, not both cp ranks.
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {n for n in names if n.endswith(",c1)")} and {n for n in names if n.endswith(",c0)")}, names
    assert {e["name"] for e in ring} >= {"the context-parallel ring (forward K/V hop 1 of 1)",
                                         "the context-parallel ring (backward dK/dV hop 2 of 2)"}
    rows = {int(r["step"]): r for r in read_metrics(run_dir)}
    for step in (2, 3):
        assert float(rows[step]["time_cp_comm_s"]) > 0
        parts = [float(rows[step][f"time_{c}_s"]) for c in CATEGORIES]
        assert abs(sum(parts) / float(rows[step]["step_time_s"]) - 1) < SPAN_COVER, (step, parts, rows[step])


def test_torch_profiler_traces_the_same_steps(equivalence_runs):
    run_dir = _run_dir(equivalence_runs, "tp2")
    for rank in (0, 1):
        trace = json.loads((run_dir / "profile" / "torch" / f"rank-{rank}.json").read_text())
        assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
