"""Analytic descriptions of GPUs, so a user can plan training on a device they do not have.

MAGIS (§5, "Simulator") estimates a schedule's latency from per-operator costs. On
the local device those costs are measured (:mod:`magis.cost.profiler`); for any other
device they come from a roofline over the figures below: an operator takes
``max(flops / (compute_efficiency * peak), bytes / (bandwidth_efficiency * bandwidth))``
plus the host-side cost of launching it.

Peak figures are the vendors' datasheet numbers for *dense* math (datasheets print
tensor-core figures "with sparsity", twice the dense rate; we halve them). Precision
keys: ``fp64``, ``fp32`` (CUDA cores, no tensor cores), ``tf32``, ``bf16``, ``fp16``
(tensor cores, FP32 accumulate). Which rate an fp32 operator gets follows PyTorch's
defaults: matmuls run in full fp32 (``torch.backends.cuda.matmul.allow_tf32`` is False
by default since PyTorch 1.12), convolutions run in TF32 (``torch.backends.cudnn.allow_tf32``
is True by default); see :meth:`DeviceProfile.flops_per_second`.

Sources:

- H200 SXM: NVIDIA H200 Tensor Core GPU datasheet (2024): FP64 34 TF, FP32 67 TF,
  TF32 989 TF / BF16 1,979 TF / FP16 1,979 TF with sparsity, 141 GB HBM3e at 4.8 TB/s,
  PCIe Gen5 128 GB/s (both directions together).
- H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet (2023): FP64 34 TF, FP32 67 TF,
  TF32 989 TF / BF16 1,979 TF / FP16 1,979 TF with sparsity, 80 GB HBM3 at 3.35 TB/s,
  PCIe Gen5 128 GB/s.
- A100 SXM4 80 GB: NVIDIA A100 Tensor Core GPU datasheet (2021): FP64 9.7 TF, FP32 19.5 TF,
  TF32 156 TF, BF16 312 TF, FP16 312 TF (dense), 80 GB HBM2e at 2,039 GB/s, PCIe Gen4 64 GB/s.
- GeForce RTX 3090: NVIDIA Ampere GA102 GPU Architecture whitepaper (v2.1), appendix table:
  FP32 35.6 TF (non-tensor), TF32 35.6 TF, FP16 and BF16 71 TF with FP32 accumulate (dense),
  FP64 1/64 of FP32; 24 GB GDDR6X at 936 GB/s; PCIe Gen4 x16.

Memory sizes are the marketed GB read as GiB, which is what the devices report
(an "80 GB" H100 shows 79.1 GiB to ``torch.cuda.get_device_properties``). Host links
are one direction of a PCIe x16 slot (Gen5: 64 GB/s, Gen4: 32 GB/s); swapping moves
data one way at a time. The launch overhead is not a datasheet figure: it is the
typical host-side cost of one eager PyTorch kernel launch (dispatcher plus
``cudaLaunchKernel``), a few microseconds on a modern server CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

TERA = 1e12
GIGA = 1e9
GIB = 2**30

#: precision key of each floating dtype; any other dtype (integers, bool) counts at the fp32 rate.
PRECISION_OF_DTYPE: Mapping[torch.dtype, str] = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}


@dataclass(frozen=True)
class DeviceProfile:
    """Roofline figures of one device (MAGIS §5 cost model).

    ``peak_flops`` maps a precision key (``fp64``, ``fp32``, ``tf32``, ``bf16``,
    ``fp16``) to dense FLOP/s. The efficiencies are the fraction of each peak a real
    kernel reaches: large GEMMs and convolutions get 60-70% of peak tensor-core
    throughput, streaming kernels about 80% of the memory bandwidth.
    """

    name: str
    peak_flops: Mapping[str, float] = field(hash=False)
    memory_bandwidth: float  # bytes/s, device memory
    launch_overhead_s: float  # fixed cost of every operator that launches a kernel
    host_link_bandwidth: float  # bytes/s, one direction host <-> device (for swapping)
    memory_bytes: int  # device memory capacity
    compute_efficiency: float = 0.65
    bandwidth_efficiency: float = 0.8
    host_link_efficiency: float = 0.8
    host_link: str = ""  # what connects it to host memory (swapping), e.g. "PCIe 5.0 x16"

    def flops_per_second(self, dtype: torch.dtype, tensor_core_fp32: bool = False) -> float:
        """Achievable FLOP/s for math in ``dtype``; ``tensor_core_fp32`` selects TF32 for fp32."""
        precision = PRECISION_OF_DTYPE.get(dtype, "fp32")
        if precision == "fp32" and tensor_core_fp32:
            precision = "tf32"
        return self.compute_efficiency * self.peak_flops[precision]

    @property
    def bytes_per_second(self) -> float:
        """Achievable device-memory bandwidth."""
        return self.bandwidth_efficiency * self.memory_bandwidth

    @property
    def host_bytes_per_second(self) -> float:
        """Achievable host <-> device bandwidth in one direction."""
        return self.host_link_efficiency * self.host_link_bandwidth


def _hopper(name: str, memory_gib: int, bandwidth_tb_s: float) -> DeviceProfile:
    """H100 and H200 share the same SXM compute die; they differ in memory."""
    return DeviceProfile(
        name=name,
        peak_flops={
            "fp64": 34 * TERA,
            "fp32": 67 * TERA,
            "tf32": 494.5 * TERA,
            "bf16": 989.5 * TERA,
            "fp16": 989.5 * TERA,
        },
        memory_bandwidth=bandwidth_tb_s * TERA,
        launch_overhead_s=5e-6,
        host_link_bandwidth=64 * GIGA,
        memory_bytes=memory_gib * GIB,
        host_link="PCIe 5.0 x16",
    )


#: the named devices a user can plan for (``magis profile --device NAME``).
DEVICE_PROFILES: dict[str, DeviceProfile] = {
    "h200": _hopper("h200", memory_gib=141, bandwidth_tb_s=4.8),
    "h100": _hopper("h100", memory_gib=80, bandwidth_tb_s=3.35),
    "a100": DeviceProfile(
        name="a100",
        peak_flops={
            "fp64": 9.7 * TERA,
            "fp32": 19.5 * TERA,
            "tf32": 156 * TERA,
            "bf16": 312 * TERA,
            "fp16": 312 * TERA,
        },
        memory_bandwidth=2039 * GIGA,
        launch_overhead_s=5e-6,
        host_link_bandwidth=32 * GIGA,
        memory_bytes=80 * GIB,
        host_link="PCIe 4.0 x16",
    ),
    "rtx3090": DeviceProfile(
        name="rtx3090",
        peak_flops={
            "fp64": 35.6 / 64 * TERA,
            "fp32": 35.6 * TERA,
            "tf32": 35.6 * TERA,
            "bf16": 71 * TERA,
            "fp16": 71 * TERA,
        },
        memory_bandwidth=936 * GIGA,
        launch_overhead_s=5e-6,
        host_link_bandwidth=32 * GIGA,
        memory_bytes=24 * GIB,
        host_link="PCIe 4.0 x16",
    ),
}
