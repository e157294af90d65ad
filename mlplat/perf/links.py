"""The `cluster.*` config group and its links: seconds of collectives and point-to-point messages between devices.

Ring collectives over NVLink inside a node, InfiniBand between nodes (each GPU on its own HCA), or gloo between
the processes of a CPU box (then `nvlink_*` are gloo's measured figures): time = hand-offs · α + bytes moved /
(η · link rate). Both cost models (`mlplat.perf.cluster` for GPUs, `mlplat.perf.cpu_model` for CPU processes)
time their messages here. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from mlplat.config import ClusterConfig
from mlplat.perf.devices import Device, get_device
from mlplat.perf.host import Host


@dataclass(frozen=True)
class Cluster:
    """The `cluster.*` config group: a device type and the links between devices."""

    name: str
    device: Device
    gpus_per_node: int
    gpu_memory_gb: float  # GiB per device usable by one rank
    nvlink_gbps: float  # per GPU per direction
    ib_gbps_per_gpu: float
    nodes: int | None = None  # size of the machine, if known
    nvlink_efficiency: float = 0.8
    ib_efficiency: float = 0.9
    nvlink_latency_s: float = 3e-6
    ib_latency_s: float = 8e-6
    hbm_efficiency: float = 0.8
    overhead_gib: float = 2.0  # CUDA context, NCCL buffers
    usable_fraction: float = 0.95  # the caching allocator's fragmentation eats the rest
    host: Host | None = None  # measured CPU figures (cluster.cpu_*): then ranks are processes sharing cores

    @property
    def memory_bytes(self) -> float:
        return self.gpu_memory_gb * 1024**3

    @property
    def usable_memory_bytes(self) -> float:
        """What a layout may plan to use: a layout "fits" when its worst GPU stays under this."""
        return self.usable_fraction * self.memory_bytes

    @classmethod
    def of(cls, c: ClusterConfig, accelerator: str = "gpu") -> "Cluster":
        """From the run's `cluster.*` section; no device named: a DGX A100 for GPU runs, this machine's CPU
        otherwise."""
        device = c.device or ("a100-80gb" if accelerator in ("gpu", "cuda") else "cpu")
        dev = get_device(device)
        pick = lambda value, default: default if value is None else value  # noqa: E731
        return cls(
            name=pick(c.name, "local_cpu" if dev.nominal and c.device is None else dev.name), device=dev,
            gpus_per_node=int(pick(c.gpus_per_node, dev.gpus_per_node)),
            gpu_memory_gb=float(pick(c.gpu_memory_gb, dev.memory_gib)),
            nvlink_gbps=float(pick(c.nvlink_gbps, dev.nvlink_gbps)),
            ib_gbps_per_gpu=float(pick(c.ib_gbps_per_gpu, dev.ib_gbps_per_gpu)),
            nodes=c.nodes, nvlink_efficiency=c.nvlink_efficiency, ib_efficiency=c.ib_efficiency,
            nvlink_latency_s=c.nvlink_latency_us * 1e-6, ib_latency_s=c.ib_latency_us * 1e-6,
            hbm_efficiency=c.hbm_efficiency, overhead_gib=float(pick(c.overhead_gib, 0.3 if dev.nominal else 2.0)),
            usable_fraction=c.usable_fraction,
            host=None if c.cpu_cores is None else Host.of(c),
        )

    @classmethod
    def from_config(cls, c: Mapping[str, Any]) -> "Cluster":
        """From a `cluster.*` mapping (e.g. a conf/cluster/ file), checked as the run config checks it."""
        from mlplat.config import from_dict

        return cls.of(from_dict({"cluster": dict(c)}).cluster)



def _bw(gbps: float, eff: float) -> float:
    return gbps * 1e9 / 8 * eff  # bytes/s


def allreduce_time(nbytes: float, n: int, cl: Cluster, inter_node: bool) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks."""
    if n <= 1:
        return 0.0
    bw, lat = (_bw(cl.ib_gbps_per_gpu, cl.ib_efficiency), cl.ib_latency_s) if inter_node else \
        (_bw(cl.nvlink_gbps, cl.nvlink_efficiency), cl.nvlink_latency_s)
    return 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw


def allgather_time(nbytes: float, n: int, cl: Cluster, inter_node: bool = False) -> float:
    """Ring all-gather producing `nbytes` on each of `n` ranks."""
    if n <= 1:
        return 0.0
    bw, lat = (_bw(cl.ib_gbps_per_gpu, cl.ib_efficiency), cl.ib_latency_s) if inter_node else \
        (_bw(cl.nvlink_gbps, cl.nvlink_efficiency), cl.nvlink_latency_s)
    return (n - 1) * lat + (n - 1) / n * nbytes / bw


def p2p_time(nbytes: float, cl: Cluster, inter_node: bool) -> float:
    bw, lat = (_bw(cl.ib_gbps_per_gpu, cl.ib_efficiency), cl.ib_latency_s) if inter_node else \
        (_bw(cl.nvlink_gbps, cl.nvlink_efficiency), cl.nvlink_latency_s)
    return lat + nbytes / bw



def alltoall_time(nbytes: float, n: int, cl: Cluster, local: int | None = None, skew: float = 1.0) -> float:
    """All-to-all over `n` ranks, each sending `nbytes` spread evenly over the n (its own share stays): n - 1
    hand-offs and, of the bytes that leave the rank, those to the `local` group members in its node (all n when
    None) over NVLink while the rest cross InfiniBand, both at once. `skew`: the busiest rank's bytes over the mean
    (an uneven all-to-all ends when its busiest receiver does)."""
    if n <= 1:
        return 0.0
    local = n if local is None else max(1, min(local, n))
    intra = (local - 1) / n * nbytes * skew / _bw(cl.nvlink_gbps, cl.nvlink_efficiency)
    if local == n:
        return (n - 1) * cl.nvlink_latency_s + intra
    inter = (n - local) / n * nbytes * skew / _bw(cl.ib_gbps_per_gpu, cl.ib_efficiency)
    return (n - 1) * cl.ib_latency_s + max(intra, inter)
