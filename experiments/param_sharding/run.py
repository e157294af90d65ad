"""Parameters sharded over data parallelism (optim.sharding=params): what the planner predicts, beside published
FSDP runs, and what it costs on this machine.

    python experiments/param_sharding/run.py            # ~1.5 min on 2 cores; prints the three parts (results.md)
    python experiments/param_sharding/run.py --no-cpu   # the predictions only (~40 s)

1. Llama 3.1 8B on 8 H100 (conf/cluster/h100_96gb.yaml, torchtitan's 96 GB H100), as `python -m mlplat.train
   +experiment=llama3_8b [OVERRIDES] dry_run=true` plans it, beside torchtitan's FSDP 8 rows
   (benchmarks/llama3_h100_202412_torchtitan.md, Table 1: 5,762 tokens/s per GPU eager, 6,667 compiled) and
   Megatron-Bridge's FSDP 8 FP8 row (744 TFLOP/s per GPU, as the issue filing this work quotes Bridge's performance
   table). Predictions of the cost model: no GPU ran them.
2. Llama 3 70B on 64 H100: the planner's best layouts searched without parameter sharding (sharding=none,optim)
   and with it (the default none,optim,params), `python -m mlplat.plan model=llama3_70b cluster=h100_96gb gpus=64
   global_batch_size=64 top=3 [sharding=...]`.
3. Measured here: the main job (its layout, t2·p2(v2)·d2 on 8 gloo processes), sharding=optim against params, 20
   steps each, twice, alternated (tokens/s of the median step, averaged; the ratio is what to read: these
   machines are noisy), beside the CPU cost model's prediction of both (`dry_run=true`).
"""
from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TORCHTITAN = {"eager": 5762.0, "compiled": 6667.0}  # tokens/s per GPU, Llama 3.1 8B, FSDP 8, bf16, local batch 2
BRIDGE_FP8_TFLOPS = 744.0  # TFLOP/s per GPU, Llama 3 8B, FSDP 8, FP8
ROWS = [  # (label, overrides on +experiment=llama3_8b)
    ("ZeRO-1 (the distributed optimizer), full recomputation, b=2", ("optim.sharding=optim",)),
    ("ZeRO-3, full recomputation, b=2", ("optim.sharding=params",)),
    ("ZeRO-3, fused, full recomputation, b=2", ("optim.sharding=params", "kernels.fused=true")),
    ("ZeRO-3, selective recomputation, b=1", ("optim.sharding=params", "kernels.recompute=selective",
                                              "parallel.micro_batch_size=1")),
    ("ZeRO-3, fused, FP8 tensorwise, full recomputation, b=2", ("optim.sharding=params", "kernels.fused=true",
                                                              "kernels.fp8=tensorwise")),
]


def plan(overrides: tuple[str, ...]) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from mlplat.config import load_config
    from mlplat.perf.dry_run import plan as dry_plan

    args = ["experiment=llama3_8b", *overrides]  # (compose takes the group as a key; the CLI as +experiment)
    if GlobalHydra.instance().is_initialized():
        raw = compose(config_name="config", overrides=args)
    else:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            raw = compose(config_name="config", overrides=args)
    return dry_plan(load_config(raw), experiment="llama3_8b", use_meta=True)


def predictions() -> str:
    head = "| mlplat layout (d8, bf16-megatron) | memory GiB of 94 | predicted tokens/s/GPU | predicted TFLOP/s/GPU " \
           "| / torchtitan eager 5,762 | / torchtitan compiled 6,667 | / Bridge FP8 744 TFLOP/s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, overrides in ROWS:
        pl = plan(overrides)
        tokens = pl["predicted_tokens_per_second"] / pl["layout"]["gpus"]
        tflops = pl["predicted_tflops_per_gpu"]
        lines.append(f"| {label} | {pl['memory_per_gpu_bytes'] / 2**30:.1f} ({'fits' if pl['fits'] else 'NO'}) | "
                     f"{tokens:,.0f} | {tflops:.0f} | {tokens / TORCHTITAN['eager']:.2f} | "
                     f"{tokens / TORCHTITAN['compiled']:.2f} | {tflops / BRIDGE_FP8_TFLOPS:.2f} |")
    return "\n".join(lines)


def planner(sharding: str | None) -> str:
    cmd = [sys.executable, "-m", "mlplat.plan", "model=llama3_70b", "cluster=h100_96gb", "gpus=64",
           "global_batch_size=64", "top=3"] + ([f"sharding={sharding}"] if sharding else [])
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, check=True).stdout
    keep = [line for line in out.splitlines() if line.startswith(("  #", "---", "  1", "  2", "  3", "best:"))]
    return f"$ python {' '.join(cmd[1:])}\n" + "\n".join(keep)


def measured() -> str:
    """The main job, optim against params: each run's median step in tokens/s, and the CPU model's prediction."""
    rates, predicted = {"optim": [], "params": []}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for sharding in ("optim", "params", "optim", "params"):  # alternated: the machine's drift hits both
            run = Path(tmp) / f"{sharding}-{len(rates[sharding])}"
            subprocess.run([sys.executable, "-m", "mlplat.train", f"hydra.run.dir={run}", "parallel.dp=2",
                            f"optim.sharding={sharding}", "trainer.max_steps=20", "trainer.limit_val_batches=0",
                            "sample.max_new_tokens=0", "logger=none", "checkpoint.every_steps=0",
                            "checkpoint.save_last=false"], cwd=REPO, capture_output=True, text=True, timeout=900,
                           check=True)
            with open(run / "metrics.csv", newline="") as f:
                rows = [float(r["tokens_per_s"]) for r in csv.DictReader(f) if r.get("tokens_per_s")]
            rates[sharding].append(statistics.median(rows))
            if sharding in predicted:
                continue
            subprocess.run([sys.executable, "-m", "mlplat.train", f"hydra.run.dir={run}-plan",
                            f"optim.sharding={sharding}", "dry_run=true"], cwd=REPO, capture_output=True, text=True,
                           timeout=900, check=True)  # the CPU cost model, on the main job's data and tokenizer
            predicted[sharding] = json.loads((Path(f"{run}-plan") / "plan.json").read_text())[
                "predicted_tokens_per_second"]
    rates = {k: statistics.mean(v) for k, v in rates.items()}
    return (f"main job (t2·p2(v2)·d2, 8 gloo processes), 2 x 20 steps each: optim {rates['optim']:,.0f} tokens/s, "
            f"params {rates['params']:,.0f} tokens/s, params / optim = {rates['params'] / rates['optim']:.2f} "
            "measured, "
            f"{predicted['params'] / predicted['optim']:.2f} predicted by the CPU cost model "
            f"({predicted['optim']:,.0f} and {predicted['params']:,.0f} tokens/s)")


def main() -> int:
    print("1. Llama 3.1 8B on 8 H100, FSDP 8 (predicted)\n")
    print(predictions())
    print("\n2. Llama 3 70B on 64 H100: the planner's best, without and with parameter sharding\n")
    print(planner("none,optim"))
    print()
    print(planner(None))
    if "--no-cpu" not in sys.argv:
        print("\n3. Measured on this machine\n")
        print(measured())
    return 0


if __name__ == "__main__":
    sys.exit(main())
