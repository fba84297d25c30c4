"""Analytic descriptions of GPUs, so a user can plan training on a device they do not have.

MAGIS (§5, "Simulator") estimates a schedule's latency from per-operator costs. On
the local device those costs are measured (:mod:`magis.cost.op_timing`); for any other
device they come from the figures below, which :mod:`magis.cost.kernel_model` turns
into kernel times: a roofline ``max(flops / (compute_efficiency * peak), bytes /
(bandwidth_efficiency * bandwidth))`` for large kernels, refined for small ones by
tile and wave quantization (GEMM-like kernels) and by a minimum kernel time and a
bandwidth ramp (memory-bound kernels). Every constant of that model is in this module.

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
  PCIe Gen5 128 GB/s (both directions together). Same GH100 compute die as the H100
  SXM5, hence the same 132 SMs.
- H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet (2023): FP64 34 TF, FP32 67 TF,
  TF32 989 TF / BF16 1,979 TF / FP16 1,979 TF with sparsity, 80 GB HBM3 at 3.35 TB/s,
  PCIe Gen5 128 GB/s. 132 SMs: NVIDIA H100 Tensor Core GPU Architecture whitepaper
  ("the H100 SXM5 GPU has 132 SMs").
- A100 SXM4 80 GB: NVIDIA A100 Tensor Core GPU datasheet (2021): FP64 9.7 TF, FP32 19.5 TF,
  TF32 156 TF, BF16 312 TF, FP16 312 TF (dense), 80 GB HBM2e at 2,039 GB/s, PCIe Gen4 64 GB/s.
  108 SMs: NVIDIA A100 Tensor Core GPU Architecture whitepaper, and the example GPU of
  NVIDIA's Matrix Multiplication Background User's Guide (DU-09799-001, 2023), §3.2.
- GeForce RTX 3090: NVIDIA Ampere GA102 GPU Architecture whitepaper (v2.1), appendix table:
  82 SMs, FP32 35.6 TF (non-tensor), TF32 35.6 TF, FP16 and BF16 71 TF with FP32
  accumulate (dense), FP64 1/64 of FP32; 24 GB GDDR6X at 936 GB/s; PCIe Gen4 x16.
- Tiles and waves: NVIDIA Matrix Multiplication Background User's Guide (DU-09799-001,
  February 2023). §2.1: a GEMM is computed by thread blocks, each owning one output
  tile; §2.3: the tile sizes cuBLAS chooses among, from 256x128 / 128x256 (the most
  efficient: most data reuse) down to 64x64 (the least); §3.1 (tile quantization):
  every tile does a full tile's math, so a dimension one past a multiple of the tile
  pays a whole extra row or column of tiles; §3.2 (wave quantization): the tiles run
  in waves of one tile per SM (A100: 108 tiles of 256x128), and a partial last wave
  takes as long as a full one.
- Split-K: when an output has too few tiles to fill the SMs (a weight gradient: a
  small output summed over a long batch), cuBLAS and CUTLASS also cut the sum over
  ``k`` among several thread blocks and reduce their partial results (CUTLASS,
  "Efficient GEMM in CUDA", *Parallelized Reductions: Split K*).

Memory sizes (:attr:`DeviceProfile.memory_bytes`) are what CUDA reports as the device's
total (``torch.cuda.get_device_properties(i).total_memory``), a few hundred MiB below
the marketed size that ``nvidia-smi`` prints:

- H100 SXM5 80 GB: 85,017,493,504 bytes (79.2 GiB), read on an "NVIDIA H100 80GB HBM3"
  with torch 2.11 / CUDA 13.0, driver 580 (2026-11; ``nvidia-smi``: 81,559 MiB);
- H200 141 GB: 150,109,880,320 bytes (139.8 GiB), read on an "NVIDIA H200" likewise
  (``nvidia-smi``: 143,771 MiB);
- A100 SXM4 80 GB: not read here; ``nvidia-smi`` prints 81,920 MiB, and we take 480 MiB
  less, the gap between ``nvidia-smi`` and CUDA on the H100 (an estimate);
- GeForce RTX 3090 24 GB: 24,268 MiB, as ``torch.cuda.get_device_properties`` prints it
  in transformers' documentation ("GPU selection", ``total_memory=24268MB``).

Not all of it holds tensors: :data:`CUDA_RESERVED_BYTES` is the allowance for what a
process holds besides them (:attr:`DeviceProfile.usable_memory_bytes`). Host links
are one direction of a PCIe x16 slot (Gen5: 64 GB/s, Gen4: 32 GB/s); swapping moves
data one way at a time.

Three constants are not datasheet figures but typical measured behaviour, to be
calibrated against a real GPU with ``experiments/gpu_fidelity.py``:

- :data:`LAUNCH_OVERHEAD_S`, the host-side cost of one eager PyTorch kernel launch
  (dispatcher plus ``cudaLaunchKernel``), a few microseconds on a modern server CPU;
  launches are asynchronous, so it overlaps with the previous kernel's execution;
- :data:`MIN_KERNEL_S`, the shortest time a kernel occupies the GPU from start to end
  (scheduling its blocks, one round trip to memory, the end-of-kernel flush): about
  2 microseconds in Nsight Systems timelines of small elementwise kernels on A100/H100;
- :data:`DRAM_LATENCY_S`, the latency of one load from device memory (about 0.5
  microseconds on HBM GPUs, e.g. Jia et al., "Dissecting the NVIDIA Volta/Ampere
  GPU architecture via microbenchmarking"). By Little's law a kernel needs
  bandwidth x latency bytes in flight to stream at full bandwidth, so one that moves
  ``b`` bytes takes ``latency + b / bandwidth``: its achieved bandwidth ramps up with
  its size and reaches half the peak at ``bandwidth x latency`` bytes (1.3 MB on H100).

The relative efficiencies of the smaller tiles (:data:`CUBLAS_TILES`) are likewise a
modelling assumption that follows the guide's ranking (§2.3), not a measurement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

TERA = 1e12
GIGA = 1e9
GIB = 2**30
MIB = 2**20

#: device memory a training process cannot give to tensors: the CUDA context, the kernels of
#: cuBLAS and cuDNN, cuBLAS' workspace (64 MiB, held in PyTorch's caching allocator). Measured
#: on an H100 80GB and an H200 (torch 2.11, CUDA 13.0, 2026-11): after a matmul and a
#: convolution forward and backward, 256 MiB and then 2 MiB tensors filled the device up to
#: 851 MiB below its total on both. Rounded up to 1 GiB for other CUDA and library versions
#: and the allocator's rounding of each block; the allocator's fragmentation beyond that
#: is not modelled (the simulated peak counts tensor bytes exactly).
CUDA_RESERVED_BYTES = GIB

#: host-side cost of launching one kernel from eager PyTorch (see the module docstring).
LAUNCH_OVERHEAD_S = 5e-6
#: shortest time a kernel occupies the GPU (see the module docstring).
MIN_KERNEL_S = 2e-6
#: latency of one device-memory load; sets the bandwidth ramp of small kernels.
DRAM_LATENCY_S = 0.5e-6
#: fraction of peak math throughput a large GEMM or convolution reaches.
GEMM_EFFICIENCY = 0.65
#: fraction of peak memory bandwidth a large streaming kernel reaches.
STREAM_EFFICIENCY = 0.8
#: throughput of a cuDNN convolution (forward or backward, fp32 tensors in NCHW, TF32
#: math) relative to a GEMM of its implicit-GEMM shape. Measured on an H100 SXM with
#: ``python experiments/gpu_fidelity.py --preset paper`` (2026-11-22, torch 2.11): U-Net,
#: U-Net++ and ResNet-50 convolutions ran 2.5-2.7x the GEMM model's time (layout
#: transforms, im2col-style tiling, per-call heuristics); 0.45 (with the batch norm
#: passes below) brings the analytic step time of the five paper workloads that fit
#: within 5-25% of the measured one (mean 10%, from 33%). Applied to every GPU profile.
CONV_EFFICIENCY = 0.45
#: times the bytes of one pass that a training-mode batch norm streams (statistics, then
#: normalisation; the backward reduces twice before it scales). Measured on an H100 SXM
#: as above: 5.8x (forward) and 6.7x (backward) one pass's time at ResNet-50's sizes;
#: 5 fits the step totals together with the convolution efficiency above.
BATCH_NORM_PASSES = 5.0
#: fraction of the host link's bandwidth a large pinned copy reaches.
HOST_LINK_EFFICIENCY = 0.8

#: GEMM output tiles (rows, columns, throughput relative to the largest tile), as
#: cuBLAS chooses among them (Matrix Multiplication Background User's Guide §2.3):
#: 256x128 and 128x256 are the most efficient, then 128x128, then 256x64 and 64x256,
#: then 128x64 and 64x128, and 64x64 the least. The relative throughputs (a smaller
#: tile reuses each loaded operand fewer times) are a modelling assumption.
CUBLAS_TILES: tuple[tuple[int, int, float], ...] = (
    (256, 128, 1.0),
    (128, 256, 1.0),
    (128, 128, 0.9),
    (256, 64, 0.85),
    (64, 256, 0.85),
    (128, 64, 0.75),
    (64, 128, 0.75),
    (64, 64, 0.6),
)

#: the ways a GEMM's sum over ``k`` may be cut among thread blocks (split-K, see the
#: sources above); the partial sums, in fp32, are written and read once more. Which
#: counts a library offers is a modelling assumption.
SPLIT_K: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
#: bytes of one partial sum of a split-K GEMM (fp32 accumulators).
PARTIAL_SUM_BYTES = 4

#: streaming multiprocessors (see the sources above): the size of a wave of tiles.
SM_COUNT = {"h200": 132, "h100": 132, "a100": 108, "rtx3090": 82}

#: precision key of each floating dtype; any other dtype (integers, bool) counts at the fp32 rate.
PRECISION_OF_DTYPE: Mapping[torch.dtype, str] = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}


@dataclass(frozen=True)
class DeviceProfile:
    """Figures of one device (MAGIS §5 cost model).

    ``peak_flops`` maps a precision key (``fp64``, ``fp32``, ``tf32``, ``bf16``,
    ``fp16``) to dense FLOP/s. The efficiencies are the fraction of each peak a large
    kernel reaches: large GEMMs and convolutions get 60-70% of peak tensor-core
    throughput, streaming kernels about 80% of the memory bandwidth.

    A GPU (``sm_count > 0``) launches asynchronously and runs GEMMs in tiles and
    waves (:mod:`magis.cost.kernel_model`); a device with ``sm_count == 0`` (the
    crude roofline the profiler measures of the local CPU) is a plain roofline whose
    launch cost adds to every operator.
    """

    name: str
    peak_flops: Mapping[str, float] = field(hash=False)
    memory_bandwidth: float  # bytes/s, device memory
    launch_overhead_s: float  # host cost of launching one operator
    host_link_bandwidth: float  # bytes/s, one direction host <-> device (for swapping)
    memory_bytes: int  # device memory capacity, as CUDA reports it (module docstring)
    compute_efficiency: float = GEMM_EFFICIENCY
    bandwidth_efficiency: float = STREAM_EFFICIENCY
    host_link_efficiency: float = HOST_LINK_EFFICIENCY
    host_link: str = ""  # what connects it to host memory (swapping), e.g. "PCIe 5.0 x16"
    sm_count: int = 0  # streaming multiprocessors; 0: not a GPU
    gemm_tiles: tuple[tuple[int, int, float], ...] = field(default=CUBLAS_TILES, hash=False)
    split_k: tuple[int, ...] = field(default=SPLIT_K, hash=False)
    min_kernel_s: float = 0.0  # shortest time a kernel occupies the device
    memory_latency_s: float = 0.0  # one device-memory load: the bandwidth ramp
    conv_efficiency: float = 1.0  # a convolution's throughput relative to its implicit GEMM's
    batch_norm_passes: float = 1.0  # passes over its bytes a training batch norm makes

    def flops_per_second(self, dtype: torch.dtype, tensor_core_fp32: bool = False) -> float:
        """Achievable FLOP/s for math in ``dtype``; ``tensor_core_fp32`` selects TF32 for fp32."""
        precision = PRECISION_OF_DTYPE.get(dtype, "fp32")
        if precision == "fp32" and tensor_core_fp32:
            precision = "tf32"
        return self.compute_efficiency * self.peak_flops[precision]

    @property
    def usable_memory_bytes(self) -> int:
        """The memory a training step's tensors can have: a GPU's total less :data:`CUDA_RESERVED_BYTES`."""
        return self.memory_bytes - CUDA_RESERVED_BYTES if self.sm_count else self.memory_bytes

    @property
    def bytes_per_second(self) -> float:
        """Achievable device-memory bandwidth."""
        return self.bandwidth_efficiency * self.memory_bandwidth

    @property
    def host_bytes_per_second(self) -> float:
        """Achievable host <-> device bandwidth in one direction."""
        return self.host_link_efficiency * self.host_link_bandwidth


def _gpu(
    name: str,
    peak_flops: Mapping[str, float],
    memory_bandwidth: float,
    host_link_bandwidth: float,
    memory_bytes: int,
    host_link: str,
) -> DeviceProfile:
    """A GPU's profile: its datasheet figures and the constants every GPU shares."""
    return DeviceProfile(
        name=name,
        peak_flops=peak_flops,
        memory_bandwidth=memory_bandwidth,
        launch_overhead_s=LAUNCH_OVERHEAD_S,
        host_link_bandwidth=host_link_bandwidth,
        memory_bytes=memory_bytes,
        host_link=host_link,
        sm_count=SM_COUNT[name],
        min_kernel_s=MIN_KERNEL_S,
        memory_latency_s=DRAM_LATENCY_S,
        conv_efficiency=CONV_EFFICIENCY,
        batch_norm_passes=BATCH_NORM_PASSES,
    )


def _hopper(name: str, memory_bytes: int, bandwidth_tb_s: float) -> DeviceProfile:
    """H100 and H200 share the same SXM compute die; they differ in memory."""
    return _gpu(
        name,
        peak_flops={
            "fp64": 34 * TERA,
            "fp32": 67 * TERA,
            "tf32": 494.5 * TERA,
            "bf16": 989.5 * TERA,
            "fp16": 989.5 * TERA,
        },
        memory_bandwidth=bandwidth_tb_s * TERA,
        host_link_bandwidth=64 * GIGA,
        memory_bytes=memory_bytes,
        host_link="PCIe 5.0 x16",
    )


#: the named devices a user can plan for (``magis profile --device NAME``).
DEVICE_PROFILES: dict[str, DeviceProfile] = {
    "h200": _hopper("h200", memory_bytes=150_109_880_320, bandwidth_tb_s=4.8),
    "h100": _hopper("h100", memory_bytes=85_017_493_504, bandwidth_tb_s=3.35),
    "a100": _gpu(
        "a100",
        peak_flops={
            "fp64": 9.7 * TERA,
            "fp32": 19.5 * TERA,
            "tf32": 156 * TERA,
            "bf16": 312 * TERA,
            "fp16": 312 * TERA,
        },
        memory_bandwidth=2039 * GIGA,
        host_link_bandwidth=32 * GIGA,
        memory_bytes=(81_920 - 480) * MIB,
        host_link="PCIe 4.0 x16",
    ),
    "rtx3090": _gpu(
        "rtx3090",
        peak_flops={
            "fp64": 35.6 / 64 * TERA,
            "fp32": 35.6 * TERA,
            "tf32": 35.6 * TERA,
            "bf16": 71 * TERA,
            "fp16": 71 * TERA,
        },
        memory_bandwidth=936 * GIGA,
        host_link_bandwidth=32 * GIGA,
        memory_bytes=24_268 * MIB,
        host_link="PCIe 4.0 x16",
    ),
}
