"""mlplat.perf.devices: peak FLOP/s per precision and the device behind a CUDA name."""
from __future__ import annotations

import pytest

from mlplat.perf.devices import device_from_cuda_name, get_device, peak_flops


def test_devices():
    assert peak_flops("a100", "bf16-mixed") == 312e12 and peak_flops("a100", "32-true") == 19.5e12
    assert peak_flops("h100", "bf16") == peak_flops("h200", "bf16") == 989e12
    assert device_from_cuda_name("NVIDIA A100-SXM4-80GB").name == "a100-80gb"
    assert device_from_cuda_name("NVIDIA A100-SXM4-40GB").name == "a100-40gb"
    assert device_from_cuda_name("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert device_from_cuda_name("NVIDIA H200").name == "h200"
    # DeepSeek-V3's H800: the H100 SXM's peaks, NVLink cut to 200 GB/s each way
    assert device_from_cuda_name("NVIDIA H800").name == "h800-sxm" and get_device("h800").nvlink_gbps == 1600
    assert peak_flops("h800", "bf16") == 989e12 and peak_flops("h800", "fp8") == 1979e12
    assert get_device("cpu").nominal
    with pytest.raises(ValueError, match="not a known device"):
        get_device("tpu")
