"""Known accelerators: dense peak TFLOP/s by precision, memory, and the node interconnect they ship in.

Figures are vendor datasheet numbers for *dense* math (no 2:4 sparsity). Bandwidths are per GPU and per
direction, in gigabits per second like the network ports they describe:
  - DGX A100: NVLink 3 through NVSwitch, 600 GB/s bidirectional = 300 GB/s = 2400 Gb/s each way;
    8 GPUs/node, one 200 Gb/s HDR InfiniBand HCA per GPU (8x200 Gb/s).
  - DGX H100 / H200: NVLink 4, 900 GB/s bidirectional = 450 GB/s = 3600 Gb/s each way;
    8 GPUs/node, one 400 Gb/s NDR HCA per GPU (8x400 Gb/s). The HBM2e H100 of torchtitan's runs: the same
    links (400 Gb/s of RDMA per GPU), 2.4 TB/s of memory bandwidth.
  - H800 SXM (NVIDIA's H800 datasheet): the H100 SXM's die, memory and 16-bit/FP8 tensor peaks, NVLink cut to
    400 GB/s bidirectional = 200 GB/s = 1600 Gb/s each way, FP64 to 1 TFLOP/s; DeepSeek-V3's cluster (DeepSeek-AI
    2024, §3.1, §3.2.2): 8 per node on NVSwitch, InfiniBand across nodes at 50 GB/s = 400 Gb/s per GPU.
`sm_count` and `gemm_efficiency` feed the GEMM model in `mlplat.perf.cluster` (see there).

No torch at module level: this file is imported by the planner on machines without torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mlplat.precision import precision_of

GIB = 1024**3


@dataclass(frozen=True)
class Device:
    name: str
    peak_tflops: dict[str, float]  # dense peak by precision: bf16, fp16, tf32, fp32, fp64
    memory_gib: float  # what nvidia-smi shows, in GiB
    hbm_gbytes_per_s: float  # memory bandwidth, GB/s
    sm_count: int  # streaming multiprocessors (wave quantisation of GEMMs)
    # Fraction of peak a large, well-shaped GEMM sustains in a training loop (cuBLAS reaches ~80-85% in
    # isolation; under the full-node power load of training the clocks sag, so we use a bit less).
    gemm_efficiency: float
    gpus_per_node: int = 8
    nvlink_gbps: float = 0.0  # per GPU, per direction, Gb/s
    ib_gbps_per_gpu: float = 0.0  # per GPU, Gb/s
    aliases: tuple[str, ...] = field(default_factory=tuple)
    nominal: bool = False  # figures are placeholders, not a datasheet
    sm: tuple[int, int] | None = None  # CUDA compute capability (which FP8 kernels run: `fp8_gemm_path`)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


HOPPER = (9, 0)  # the H100, H200 and H800
_A100 = dict(bf16=312.0, fp16=312.0, tf32=156.0, fp32=19.5, fp64=19.5)  # fp64 with tensor cores
_H100_SXM = dict(bf16=989.0, fp16=989.0, fp8=1979.0, tf32=494.0, fp32=67.0, fp64=67.0)
_H100_PCIE = dict(bf16=756.0, fp16=756.0, fp8=1513.0, tf32=378.0, fp32=51.0, fp64=51.0)

DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("a100-80gb", _A100, 80, 2039, 108, 0.72, 8, 2400, 200, aliases=("a100",)),
        Device("a100-40gb", _A100, 40, 1555, 108, 0.72, 8, 2400, 200),
        Device("h100-sxm", _H100_SXM, 80, 3350, 132, 0.68, 8, 3600, 400, aliases=("h100",), sm=HOPPER),
        Device("h100-pcie", _H100_PCIE, 80, 2000, 114, 0.68, 8, 1200, 400, sm=HOPPER),
        Device("h200", _H100_SXM, 140, 4800, 132, 0.70, 8, 3600, 400, aliases=("h200-sxm",), sm=HOPPER),
        Device("h800-sxm", dict(_H100_SXM, fp64=1.0), 80, 3350, 132, 0.68, 8, 1600, 400, aliases=("h800",), sm=HOPPER),
        # The H100 of torchtitan's published runs (Meta's Grand Teton hosts): 96 GB of HBM2e at 2.4 TB/s, run at a
        # 500 W power limit. Its GEMM peak lies between the SXM's and the NVL's (torchtitan does not know it
        # either); the SXM's is taken, as torchtitan's MFU takes it, so predictions on it lean optimistic.
        Device("h100-hbm2e", _H100_SXM, 94, 2400, 132, 0.68, 8, 3600, 400, aliases=("h100-96gb",), sm=HOPPER),
        # A nominal CPU "device" so that the same planner runs for the gloo-on-CPU layouts of a laptop or
        # CI box. 0.1 TFLOP/s is roughly what 1-2 cores of a modern x86 sustain in fp32 GEMMs; the links
        # stand for shared-memory gloo. Use it for relative comparisons only.
        Device("cpu", dict(bf16=0.05, fp16=0.05, tf32=0.1, fp32=0.1, fp64=0.05), 4, 20, 1, 0.5, 8, 40, 10,
               nominal=True),
    )
}

PEAK_KEYS = ("bf16", "fp16", "fp8", "tf32", "fp32", "fp64")  # the columns of a device's peak table
_PEAK_OF_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def get_device(name: str) -> Device:
    """An entry by name or alias (case-insensitive)."""
    key = str(name).lower()
    if key in DEVICES:
        return DEVICES[key]
    for d in DEVICES.values():
        if key in d.aliases:
            return d
    raise ValueError(f"cluster.device={name!r} is not a known device ({', '.join(DEVICES)})")


def gemm_precision(precision: str) -> str:
    """The peak-table column of a GEMM in `precision`: a column name itself (bf16, tf32, ...) or a
    `trainer.precision` value, whose compute dtype the precision table gives."""
    key = str(precision).lower()
    return key if key in PEAK_KEYS else _PEAK_OF_DTYPE[precision_of(precision).compute_dtype]


def peak_flops(device: str | Device, precision: str = "bf16") -> float:
    """Dense peak FLOP/s (not tera) of `device` for GEMMs in `precision` (Lightning strings accepted)."""
    dev = device if isinstance(device, Device) else get_device(device)
    prec = gemm_precision(precision)
    if prec not in dev.peak_tflops:
        raise ValueError(f"device {dev.name} has no {prec} peak in the table")
    return dev.peak_tflops[prec] * 1e12


def device_from_cuda_name(cuda_name: str) -> Device:
    """Map `torch.cuda.get_device_name()` (e.g. 'NVIDIA A100-SXM4-80GB', 'NVIDIA H100 80GB HBM3') to an entry."""
    n = cuda_name.lower()
    if "h200" in n:
        return DEVICES["h200"]
    if "h800" in n:
        return DEVICES["h800-sxm"]
    if "h100" in n:
        return DEVICES["h100-pcie"] if "pcie" in n else DEVICES["h100-sxm"]
    if "a100" in n:
        return DEVICES["a100-40gb"] if "40gb" in n else DEVICES["a100-80gb"]
    raise ValueError(f"no device entry for CUDA device {cuda_name!r}; known: {', '.join(DEVICES)}")


def current_device() -> Device:
    """The entry for this machine's GPU 0, or the nominal cpu entry without CUDA."""
    import torch  # lazily: keep the module importable without torch

    if torch.cuda.is_available():
        return device_from_cuda_name(torch.cuda.get_device_name(0))
    return DEVICES["cpu"]
