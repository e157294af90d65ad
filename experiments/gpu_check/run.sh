#!/usr/bin/env bash
# The GPU checks in one command, for a machine with one CUDA GPU (about 8-10 minutes on one H200):
#   1. pytest -m gpu                 the GPU-marked tests (kernels, flash-attn, bf16 numerics)
#   2. a one-GPU training run        through the CLI: gpt125m, bf16-mixed, attention=auto (flash when installed),
#                                    selective recomputation, a checkpoint and a resume, CSV metrics
#   3. a Megatron-style run          the same with trainer.precision=bf16-megatron optim.distributed=true (bf16
#                                    weights, fp32 main weights and gradients in flat CUDA buffers), and a resume
#   4. the kernels MFU benchmark     experiments/kernels_gpu/bench.py, short
#   5. FP8                           experiments/fp8/gpu_bench.py: the FP8 GEMMs' TFLOP/s (`_scaled_mm` or the
#                                    emulation, with and without the casts) beside bf16, and a 1.3B training step's
#                                    MFU under kernels.fp8=none/tensorwise/rowwise (fp8.json, fp8.txt); then the
#                                    Megatron-style CLI run with kernels.fp8=tensorwise (fp8_train/, its MFU column)
#   6. a mixture of experts          model=moe_tiny under bf16-megatron with the all-to-all dispatch (moe/)
# Results go to experiments/gpu_check/results/ (env.txt, cuda.txt, pytest.txt, train/, train.txt, kernels.json,
# kernels.txt, fp8.json, fp8.txt, fp8_train/, moe/, summary.txt). Every part runs under its own time limit, and a failing part does not stop the
# others: summary.txt lists each part's exit code and the failed ones, and the script exits 1 when any part
# failed (a part that sees no CUDA device fails too), 0 only when every part passed.
#
# The CLI runs use an NCCL process group although the world has one rank (MLPLAT_SINGLETON_GROUPS=1: groups of
# one rank exist too), so the collectives on the data-parallel, embedding, model-parallel, I/O and world groups
# - the distributed optimizer's reduce-scatter and all-gather, the loss and gradient-norm all-reduces, the
# checkpoint's - meet NCCL's rules (CUDA tensors only), and the first run is profiled (its spans must end on the
# compute stream, never a device-wide synchronize). Not covered at t = 1: the tensor- and sequence-parallel
# mappings, which run only at t > 1.
# Multi-rank NCCL cannot run here: NCCL refuses two ranks on one GPU and the project's machines have one.
# The multi-rank NCCL rules are proven instead by the transport model (tests/parallel/pipeline/test_exchange.py,
# tests/perf/test_transport.py) and by the NCCL-strict gloo runs of the tests (mlplat/harness/nccl_strict.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=experiments/gpu_check/results
rm -rf "$out" && mkdir -p "$out"
export WANDB_MODE=offline WANDB_SILENT=true MLPLAT_SINGLETON_GROUPS=1
declare -A rc
parts=()

# part NAME SECONDS COMMAND...: COMMAND under its time limit, its output in $out/NAME.txt, its exit code kept.
part() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  rc[$name]=$?
  parts+=("$name")
}

{ date -u; nvidia-smi || true; python -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 || true
} > "$out/env.txt" 2>&1
part cuda 120 python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)
assert torch.cuda.is_available(), 'torch sees no CUDA device'
print('device', torch.cuda.get_device_name(0))"

part pytest 180 python -m pytest -q -m gpu tests -p no:cacheprovider

train=(trainer=gpu parallel=single model=gpt125m kernels.recompute=selective trainer.max_steps=40
       trainer.val_check_interval=20 trainer.limit_val_batches=2 parallel.micro_batch_size=4
       parallel.global_batch_size=8 checkpoint.every_steps=20 logger=csv sample.max_new_tokens=20)
part train 150 python -m mlplat.train "${train[@]}" profile.steps=[5,7] hydra.run.dir="$out/train"
part resume 120 python -m mlplat.train "${train[@]}" trainer.max_steps=60 ckpt_path=last hydra.run.dir="$out/train"

mega=("${train[@]}" trainer.precision=bf16-megatron optim.distributed=true trainer.max_steps=20
      trainer.val_check_interval=10 checkpoint.every_steps=10)
part megatron 120 python -m mlplat.train "${mega[@]}" hydra.run.dir="$out/megatron"
part megatron_resume 90 python -m mlplat.train "${mega[@]}" trainer.max_steps=30 ckpt_path=last \
    hydra.run.dir="$out/megatron"

part kernels 180 python experiments/kernels_gpu/bench.py --warmup 2 --steps 5 --out "$out/kernels.json"
part fp8 240 python experiments/fp8/gpu_bench.py --out "$out/fp8.json"
part fp8_train 120 python -m mlplat.train "${mega[@]}" kernels.fp8=tensorwise checkpoint.every_steps=0 \
    hydra.run.dir="$out/fp8_train"
# A mixture of experts: the grouped GEMMs in bf16, the balancing losses and expert loads, and the all-to-all
# dispatch over the rank's own ep group (parallel.etp=1; its split sizes read by the host with a stream sync).
part moe 120 python -m mlplat.train trainer=gpu parallel=single model=moe_tiny parallel.etp=1 \
    trainer.precision=bf16-megatron optim.distributed=true trainer.max_steps=20 trainer.val_check_interval=10 \
    trainer.limit_val_batches=2 logger=csv sample.max_new_tokens=10 hydra.run.dir="$out/moe"

failed=()
for k in "${parts[@]}"; do
  [ "${rc[$k]}" -eq 0 ] || failed+=("$k")
done
{ for k in "${parts[@]}"; do echo "$k exit ${rc[$k]}"; done
  tail -n 3 "$out/pytest.txt"; tail -n 5 "$out/train/metrics.csv" 2>/dev/null
  tail -n 5 "$out/megatron/metrics.csv" 2>/dev/null; tail -n 25 "$out/kernels.txt"; tail -n 20 "$out/fp8.txt"
  tail -n 3 "$out/fp8_train/metrics.csv" 2>/dev/null; tail -n 3 "$out/moe/metrics.csv" 2>/dev/null
  if [ ${#failed[@]} -eq 0 ]; then echo "gpu_check: all ${#parts[@]} parts passed"
  else echo "gpu_check: ${#failed[@]} of ${#parts[@]} parts failed: ${failed[*]}"; fi; } > "$out/summary.txt"
cat "$out/summary.txt"
[ ${#failed[@]} -eq 0 ]
