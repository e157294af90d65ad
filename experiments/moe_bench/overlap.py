"""The overlapped schedule (1f1b_overlap) against plain 1F1B on CPU, in one run, and the cost model's GPU figures.

    python experiments/moe_bench/overlap.py                  # both parts
    python experiments/moe_bench/overlap.py --part predict   # (b) only: no processes, a few seconds
    python experiments/moe_bench/overlap.py --part cpu --ep 4  # (a) at ep 4 only

(a) Expert parallelism on gloo processes, ep 2 and 4 (pp 1, the ep ranks the data-parallel ones): a 2-layer MoE
    model (llama attention, 8 experts top-2, h 256, expert width 512, sequence 256, 2 sequences a micro-batch,
    m = 8 micro-batches a step), float32, one thread a process, the whole training step's pipeline pass
    (`TrainStep.forward_backward`: the engine, the dispatch, the gradient reduction) under each schedule in turn
    (rotating order). The step is the slowest rank's; per step also the time every rank spends blocked in the
    expert collectives' waits (the exposed all-to-all time; under 1f1b_overlap what the other pass's compute did
    not cover), the rest being compute and the dense layers' traffic. Median over the steps; ratio overlapped / plain.
    Before timing, the losses and gradients of one step are checked bit-identical between the two schedules.
(b) The cluster cost model (`mlplat.perf.cluster.predict`, as the dry run calls it) on Qwen3-30B-A3B at EP16 and
    Qwen3-235B-A22B, each under 1f1b and 1f1b_overlap, beside Bridge's published 1.32x (30B-A3B, EP16) and
    245 -> 276 TFLOP/s per GPU (235B).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mlplat.config import load_config  # noqa: E402
from mlplat.harness.launch import launch  # noqa: E402
from mlplat.parallel import dispatch  # noqa: E402
from mlplat.parallel.grid import ParallelGrid  # noqa: E402
from mlplat.step import TrainStep  # noqa: E402

SCHEDULES = ("1f1b", "1f1b_overlap")
MICRO, M, SEQ = 2, 8, 256


def _cfg(ep: int, schedule: str, precision: str = "32-true"):
    raw = {"model": dict(arch="llama", n_layers=2, hidden=256, n_heads=4, seq_len=SEQ, vocab_size=512, dropout=0.0,
                         moe=dict(num_experts=8, top_k=2, ffn_hidden=512, norm_topk_prob=True)),
           "parallel": dict(dp=ep, ep=ep, schedule=schedule, micro_batch_size=MICRO,
                            global_batch_size=MICRO * M * ep),
           "trainer": dict(max_steps=1, precision=precision), "logger": dict(name="none"), "seed": 1}
    return load_config(raw, world_size=ep, check_data=False)


def _batch(rank: int):
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 512, (MICRO * M, SEQ + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class _WaitClock:
    """Seconds this rank spends in the dispatchers' waits on posted collectives (`_Waits.done`)."""

    def __init__(self):
        self.seconds, self._done = 0.0, dispatch._Waits.done
        clock = self

        def done(waits, label, work):
            if waits.alternation is not None:
                waits.alternation.hand_over()
            start = time.perf_counter()
            with waits.waiting(label):
                work.wait()
            clock.seconds += time.perf_counter() - start
        dispatch._Waits.done = done

    def close(self):
        dispatch._Waits.done = self._done


def _steps(rank: int, world: int, steps: int) -> dict:
    torch.set_num_threads(1)
    grid = ParallelGrid(dp=world, ep=world)
    batch = _batch(rank)
    # bit-identical first, in float64
    grads = {}
    for kind in SCHEDULES:
        module = TrainStep(_cfg(world, kind, "64-true"), grid)
        loss, _ = module.forward_backward(batch)
        grads[kind] = (float(loss), [p.grad.clone() for p in module.parameters()])
    same = grads["1f1b"][0] == grads["1f1b_overlap"][0] and all(
        torch.equal(a, b) for a, b in zip(grads["1f1b"][1], grads["1f1b_overlap"][1]))
    modules = {kind: TrainStep(_cfg(world, kind), grid) for kind in SCHEDULES}
    clock = _WaitClock()
    times: dict = {kind: [] for kind in SCHEDULES}
    waits: dict = {kind: [] for kind in SCHEDULES}
    try:
        for i in range(steps + 2):
            for kind in SCHEDULES[i % 2:] + SCHEDULES[:i % 2]:
                module = modules[kind]
                for p in module.parameters():
                    p.grad = None
                dist.barrier()
                clock.seconds = 0.0
                start = time.perf_counter()
                module.forward_backward(batch)
                end = time.perf_counter()
                row = torch.tensor([start, end, clock.seconds], dtype=torch.float64)
                rows = [torch.zeros_like(row) for _ in range(world)]
                dist.all_gather(rows, row)
                if i >= 2:  # warm-up
                    times[kind].append(max(float(r[1]) for r in rows) - min(float(r[0]) for r in rows))
                    waits[kind].append(statistics.mean(float(r[2]) for r in rows))
    finally:
        clock.close()
    return {"same": same, **{kind: (statistics.median(times[kind]), statistics.median(waits[kind]))
                             for kind in SCHEDULES}}


def part_a(steps: int, eps=(2, 4)) -> None:
    print(f"(a) 2-layer MoE (8 experts top-2, h 256, expert width 512), {MICRO}x{SEQ} tokens a micro-batch, m = {M}, "
          f"float32, pp 1, gloo processes, one thread each; median of {steps} steps")
    print(f"{'ep':>3} {'schedule':>13} {'step ms':>9} {'a2a wait ms':>12} {'rest ms':>9} {'overlapped / plain':>19} "
          f"{'bit-identical':>14}")
    for ep in eps:
        res = launch(_steps, ep, steps, timeout=1800)[0]
        for kind in SCHEDULES:
            step, wait = res[kind]
            ratio = f"{res['1f1b_overlap'][0] / res['1f1b'][0]:.3f}" if kind != "1f1b" else ""
            print(f"{ep:>3} {kind:>13} {step * 1e3:>9.1f} {wait * 1e3:>12.1f} {(step - wait) * 1e3:>9.1f} "
                  f"{ratio:>19} {str(res['same']):>14}")


# Bridge's two published runs: the overrides composing each (`python -m mlplat.train OVERRIDES dry_run=true`) and
# the figure. Qwen3-30B-A3B at EP16: 16 H100 (2 nodes), t1 p1, the experts over all 16 ranks; Qwen3-235B-A22B: the
# experiment's layout (conf/experiment/qwen3_235b_a22b.yaml) at v = 1, which 1f1b_overlap runs.
BRIDGE = {
    "Qwen3-30B-A3B EP16": (["model=qwen3_30b_a3b", "cluster=dgx_h100", "trainer=gpu", "trainer.devices=8",
                            "trainer.num_nodes=2", "trainer.precision=bf16-mixed", "parallel.tp=1", "parallel.pp=1",
                            "parallel.vpp=1", "parallel.dp=16", "parallel.ep=16", "parallel.micro_batch_size=1",
                            "parallel.global_batch_size=256", "optim.distributed=true", "kernels.fused=true"],
                           "1.32x"),
    "Qwen3-235B-A22B": (["experiment=qwen3_235b_a22b", "parallel.vpp=1"], "245 -> 276 TFLOP/s (1.13x)"),
}


def _plan(overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir

    import mlplat.train  # noqa: F401  (the resolvers of conf/hydra/launcher/)
    from mlplat.perf.dry_run import plan

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose(config_name="config", overrides=[*overrides, "dry_run=true"])
    return plan(load_config(raw), overrides=overrides, use_meta=False, max_compute_ops=20_000)


def part_predict() -> None:
    print("\n(b) the cluster cost model (the dry run's plan), the all-to-all dispatcher, at perfect balance")
    print("| model | layout | 1f1b s/step | 1f1b_overlap s/step | speed-up | TFLOP/s per GPU | Bridge |")
    print("|---|---|---|---|---|---|---|")
    for name, (overrides, bridge) in BRIDGE.items():
        res = {kind: _plan([*overrides, f"parallel.schedule={kind}"]) for kind in SCHEDULES}
        plain, over = res["1f1b"], res["1f1b_overlap"]
        L, x = plain["layout"], plain["experts"]
        layout = f"t{L['tp']} p{L['pp']} v{L['vpp']} d{L['dp']} ep{x['ep']}, b{L['micro']} B{L['global']}"
        secs = [r["predicted_seconds_per_iteration"] for r in (plain, over)]
        tflops = [r["predicted_tflops_per_gpu"] for r in (plain, over)]
        print(f"| {name} | {layout} | {secs[0]:.2f} | {secs[1]:.2f} | {secs[0] / secs[1]:.2f}x | "
              f"{tflops[0]:.0f} -> {tflops[1]:.0f} | {bridge} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("cpu", "predict", "both"), default="both")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="the ep sizes of part (a)")
    args = parser.parse_args()
    if args.part in ("cpu", "both"):
        part_a(args.steps, args.ep)
    if args.part in ("predict", "both"):
        part_predict()


if __name__ == "__main__":
    main()
