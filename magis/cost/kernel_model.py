"""How long one kernel runs on a device described by a :class:`DeviceProfile` (MAGIS §5 cost model).

A roofline, ``max(flops / peak, bytes / bandwidth)``, is right for large kernels and
optimistic for small ones, which fission multiplies. On a GPU (``sm_count > 0``):

- a GEMM-like kernel (matmul, convolution as an implicit GEMM, fused attention) is
  cut into output tiles, one thread block each, and the tiles run in waves of one
  tile per SM; every tile does a whole tile's math and every wave takes a whole
  wave's time, however few of its tiles are useful (tile and wave quantization,
  NVIDIA's Matrix Multiplication Background User's Guide, §3.1-3.2). An output with
  few tiles may also cut its sum over ``k`` among several thread blocks (split-K)
  and pay for reducing their partial sums. The tile and split are those among the
  profile's (:data:`~magis.cost.device_profiles.CUBLAS_TILES`,
  :data:`~magis.cost.device_profiles.SPLIT_K`) that give the shortest time, as
  cuBLAS' heuristics try to; with many full waves of the largest tile the time is
  the roofline's;
- a kernel streaming ``b`` bytes takes one memory latency plus ``b / bandwidth``, so
  small tensors never reach full bandwidth, and no kernel is shorter than the
  profile's minimum kernel time;
- launching is asynchronous: the host's launch cost overlaps the previous kernel, so
  a kernel costs the longer of the two.

A device with ``sm_count == 0`` (the local CPU's crude roofline) keeps the plain
roofline plus its launch cost.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from magis.cost.device_profiles import PARTIAL_SUM_BYTES, DeviceProfile


@dataclass(frozen=True)
class Gemm:
    """A GEMM-like kernel: ``batch`` independent ``m x n`` outputs, each element a sum of ``k`` products."""

    batch: int
    m: int
    n: int
    k: float

    @property
    def flops(self) -> float:
        """Multiply-adds count two FLOPs, as :mod:`torch.utils.flop_counter` counts them."""
        return 2 * self.batch * self.m * self.n * self.k


@dataclass(frozen=True)
class TiledGemm:
    """A GEMM run with one tile size and split-K: how many tiles and waves, and how long."""

    rows: int
    cols: int
    split: int
    tiles: int
    waves: int
    seconds: float


def tiled_gemm(
    profile: DeviceProfile, gemm: Gemm, flops_per_second: float, tile: tuple[int, int, float], split: int = 1
) -> TiledGemm:
    """``gemm`` in output tiles of ``tile = (rows, cols, relative throughput)``, its sum
    over ``k`` cut in ``split`` parts, on a GPU.

    Each SM computes one tile (of one part of the sum) per wave at ``relative`` times
    its share of ``flops_per_second`` (the device's achievable rate for the largest
    tile); a wave lasts one tile's time, and the kernel lasts ``waves`` of them. A
    split writes its partial sums and reads them back to reduce them.
    """
    rows, cols, relative = tile
    tiles = gemm.batch * math.ceil(gemm.m / rows) * math.ceil(gemm.n / cols) * split
    waves = math.ceil(tiles / profile.sm_count)
    tile_seconds = 2 * rows * cols * (gemm.k / split) / (relative * flops_per_second / profile.sm_count)
    reduce_seconds = 0.0
    if split > 1:
        reduce_seconds = 2 * split * gemm.batch * gemm.m * gemm.n * PARTIAL_SUM_BYTES / profile.bytes_per_second
    return TiledGemm(rows, cols, split, tiles, waves, waves * tile_seconds + reduce_seconds)


def best_tiling(profile: DeviceProfile, gemm: Gemm, flops_per_second: float) -> TiledGemm:
    """The tiling and split of ``gemm`` with the shortest modelled time (ties: the earlier, larger tile, less split)."""
    return min(
        (
            tiled_gemm(profile, gemm, flops_per_second, tile, split)
            for tile in profile.gemm_tiles
            for split in profile.split_k
        ),
        key=lambda t: t.seconds,
    )


@functools.lru_cache(maxsize=2**16)
def gemm_seconds(profile: DeviceProfile, gemm: Gemm, flops_per_second: float) -> float:
    """Math time of ``gemm``: tiles and waves on a GPU, ``flops / rate`` elsewhere.

    Remembered: a search prices the same few GEMM shapes (one per layer kind) over and over.
    """
    if gemm.batch * gemm.m * gemm.n == 0:
        return 0.0
    if not profile.sm_count:
        return gemm.flops / flops_per_second
    return best_tiling(profile, gemm, flops_per_second).seconds


def stream_seconds(profile: DeviceProfile, nbytes: int) -> float:
    """Time to move ``nbytes`` through device memory: one memory latency, then the bandwidth.

    The achieved bandwidth ``nbytes / time`` ramps up with the size and is half the
    achievable bandwidth at ``bandwidth x latency`` bytes (Little's law).
    """
    return profile.memory_latency_s + nbytes / profile.bytes_per_second


def kernel_seconds(profile: DeviceProfile, compute_s: float, memory_s: float) -> float:
    """One operator's time from its math and memory times.

    The device is busy for the longer of the two, and at least the minimum kernel
    time; a GPU launches asynchronously (the host's launch cost hides behind the
    previous kernel, so the operator costs the longer of launch and execution), any
    other device pays its launch cost on top.
    """
    device_s = max(profile.min_kernel_s, compute_s, memory_s)
    if profile.sm_count:
        return max(profile.launch_overhead_s, device_s)
    return device_s + profile.launch_overhead_s
