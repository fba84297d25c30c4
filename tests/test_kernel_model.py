"""The GPU kernel model: tile and wave quantization of GEMMs, the bandwidth ramp of small kernels.

Reference: NVIDIA, Matrix Multiplication Background User's Guide (DU-09799-001,
February 2023), chapter 3, Dimension Quantization Effects. The guide's points are
paraphrased below, not quoted: its text could not be retrieved here to check wording
(the figures, 108 SMs and 256x128 tiles on the A100, agree with other write-ups of it).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from magis.cost.device_profiles import DEVICE_PROFILES, DeviceProfile
from magis.cost.kernel_model import Gemm, best_tiling, gemm_seconds, stream_seconds
from magis.cost.latency import AnalyticCostModel
from magis.ir.graph import Graph, Node, Ref, Role, TensorMeta

A100 = DEVICE_PROFILES["a100"]
#: the guide's experiments force one tile size, 256x128 (and no split-K), to show the effects alone.
A100_256x128 = dataclasses.replace(A100, gemm_tiles=((256, 128, 1.0),), split_k=(1,))
BF16 = A100.flops_per_second(torch.bfloat16)


def wave_seconds(profile: DeviceProfile, k: int) -> float:
    """One wave of 256x128 tiles: each SM computes one tile at its share of the device's rate."""
    return 2 * 256 * 128 * k / (profile.flops_per_second(torch.bfloat16) / profile.sm_count)


def test_tile_quantization_a_column_past_a_tile_costs_a_whole_tile() -> None:
    """§3.1: the output is cut into tiles and every tile does a whole tile's math, so an
    output one column past a multiple of the tile width pays a whole extra column of
    tiles. With M = 27648 =
    108 x 256, one column of 256x128 tiles is exactly one wave of the A100's 108 SMs:
    the time steps at N = 128, 256, 384 and is flat in between (N = 129 costs what
    N = 256 does, twice N = 128). Left to choose (as cuBLAS' heuristic would, picking
    a narrower tile such as a 64-wide one to lessen the quantization), the model picks a
    64-wide tile for N = 129.
    """
    one = wave_seconds(A100, 4096)
    times = {n: gemm_seconds(A100_256x128, Gemm(1, 27648, n, 4096), BF16) for n in (64, 128, 129, 200, 256, 257, 384)}
    assert times[64] == pytest.approx(one) and times[128] == pytest.approx(one)
    assert times[129] == times[200] == times[256] == pytest.approx(2 * one)
    assert times[257] == times[384] == pytest.approx(3 * one)
    chosen = best_tiling(A100, Gemm(1, 27648, 129, 4096), BF16)
    assert chosen.cols == 64
    assert chosen.seconds < times[129]


def test_wave_quantization_a_partial_wave_costs_a_whole_wave() -> None:
    """§3.2: the A100 has 108 SMs and runs one 256x128 thread-block tile per SM at a
    time, so tiles run in waves of 108, and the GPU is used best when the number of
    tiles is a multiple of 108 or just below one. With M = 2304
    (9 rows of tiles) and K = 4096, N = 1536 makes 9 x 12 = 108 tiles, one full wave;
    N = 1664 makes 117, and the 9 tiles of the second wave take as long as 108: the
    time doubles, then stays flat up to N = 3072 (216 tiles), and the achieved
    FLOP/s falls by nearly half right after each wave boundary.
    """
    one = wave_seconds(A100, 4096)
    cases = {1536: (108, 1), 1664: (117, 2), 3072: (216, 2), 3200: (225, 3)}
    for n, (tiles, waves) in cases.items():
        tiling = best_tiling(A100_256x128, Gemm(1, 2304, n, 4096), BF16)
        assert (tiling.tiles, tiling.waves) == (tiles, waves)
        assert tiling.seconds == pytest.approx(waves * one)
    for n in range(128, 1537, 128):  # all in the first wave
        assert gemm_seconds(A100_256x128, Gemm(1, 2304, n, 4096), BF16) == pytest.approx(one)
    rate = {n: Gemm(1, 2304, n, 4096).flops / gemm_seconds(A100_256x128, Gemm(1, 2304, n, 4096), BF16) for n in cases}
    assert rate[1536] == pytest.approx(BF16)  # a full wave runs at the large-kernel rate
    assert rate[1664] == pytest.approx(BF16 * 117 / 216)


def test_the_sm_count_sets_the_wave() -> None:
    """The same 132 tiles are one wave on an H100 (132 SMs) and two on an A100 (108)."""
    gemm = Gemm(1, 12 * 256, 11 * 128, 1024)
    h100 = dataclasses.replace(DEVICE_PROFILES["h100"], gemm_tiles=((256, 128, 1.0),), split_k=(1,))
    assert best_tiling(h100, gemm, BF16).waves == 1
    assert best_tiling(A100_256x128, gemm, BF16).waves == 2


def test_an_output_with_few_tiles_splits_its_sum() -> None:
    """A convolution's weight gradient (64 x 576 outputs summed over 2M positions) has
    5 tiles for 132 SMs: unsplit, 127 SMs idle through a very long wave; split-K cuts
    the sum among thread blocks, and the time comes within 2x of the roofline."""
    profile = DEVICE_PROFILES["h100"]
    rate = profile.flops_per_second(torch.bfloat16)
    gemm = Gemm(1, 64, 576, 2 * 2**20)
    unsplit = dataclasses.replace(profile, split_k=(1,))
    chosen = best_tiling(profile, gemm, rate)
    assert chosen.split > 1
    assert chosen.seconds < best_tiling(unsplit, gemm, rate).seconds / 10
    assert gemm.flops / rate < chosen.seconds < 2 * gemm.flops / rate


# ---------------------------------------------------------------- whole nodes
def mm_graph(m: int, k: int, n: int, dtype: torch.dtype) -> Graph:
    """``a[m, k] @ b[k, n]`` as a one-operator graph."""

    def meta(*shape: int) -> TensorMeta:
        return TensorMeta(shape, dtype, shape[0] * shape[1] * dtype.itemsize)

    nodes = (
        Node("a", None, outputs=(meta(m, k),), aliases=(None,), role=Role.INPUT),
        Node("b", None, outputs=(meta(k, n),), aliases=(None,), role=Role.INPUT),
        Node("mm", torch.ops.aten.mm.default, (Ref("a"), Ref("b")), outputs=(meta(m, n),), aliases=(None,)),
    )
    return Graph(nodes, outputs=("mm",))


def mm_seconds(model: AnalyticCostModel, m: int, k: int, n: int, dtype: torch.dtype) -> float:
    return model.node_seconds(mm_graph(m, k, n, dtype), "mm")


def relu_graph(numel: int) -> Graph:
    meta = TensorMeta((numel,), torch.float32, numel * 4)
    nodes = (
        Node("x", None, outputs=(meta,), aliases=(None,), role=Role.INPUT),
        Node("relu", torch.ops.aten.relu.default, (Ref("x"),), outputs=(meta,), aliases=(None,)),
    )
    return Graph(nodes, outputs=("relu",))


devices = st.sampled_from(sorted(DEVICE_PROFILES))
dtypes = st.sampled_from([torch.bfloat16, torch.float32])
sizes = st.integers(1, 3000)


@settings(max_examples=150, deadline=None)
@given(devices, dtypes, sizes, sizes, sizes, st.integers(2, 64), st.sampled_from("mnk"))
def test_a_gemm_split_into_parts_never_costs_less_than_the_whole(
    device: str, dtype: torch.dtype, m: int, k: int, n: int, parts: int, axis: str
) -> None:
    """Fission runs ``parts`` smaller GEMMs one after another: each has its own
    launch, its own partial waves and tiles, its own ramp; none of that can beat the whole."""
    model = AnalyticCostModel(DEVICE_PROFILES[device])
    part = {"m": m, "k": k, "n": n}
    whole = dict(part, **{axis: part[axis] * parts})
    whole_s = mm_seconds(model, whole["m"], whole["k"], whole["n"], dtype)
    assert parts * mm_seconds(model, m, k, n, dtype) >= whole_s * (1 - 1e-12)


@settings(max_examples=150, deadline=None)
@given(devices, dtypes, sizes, sizes, sizes, st.integers(1, 512), st.sampled_from("mnk"))
def test_a_larger_gemm_never_costs_less(
    device: str, dtype: torch.dtype, m: int, k: int, n: int, extra: int, axis: str
) -> None:
    """Monotone in each dimension: within a wave the time is flat (tiles grow, waves
    do not), and at a wave or tile boundary it steps up, never down."""
    model = AnalyticCostModel(DEVICE_PROFILES[device])
    dims = {"m": m, "k": k, "n": n}
    larger = dict(dims, **{axis: dims[axis] + extra})
    assert mm_seconds(model, m, k, n, dtype) <= mm_seconds(model, larger["m"], larger["k"], larger["n"], dtype)


def test_small_kernels_never_reach_full_bandwidth() -> None:
    """A kernel moving b bytes takes latency + b / bandwidth: half the achievable
    bandwidth at bandwidth x latency bytes, nearly all of it at a thousand times that."""
    profile = DEVICE_PROFILES["h100"]
    half = profile.bytes_per_second * profile.memory_latency_s
    assert half / stream_seconds(profile, int(half)) == pytest.approx(profile.bytes_per_second / 2, rel=1e-6)
    big = int(1000 * half)
    assert big / stream_seconds(profile, big) == pytest.approx(profile.bytes_per_second, rel=2e-3)


def test_a_tiny_kernel_costs_its_launch_and_a_huge_one_its_bandwidth() -> None:
    """Launches overlap the previous kernel (the longer of launch and run counts); no
    kernel runs shorter than the minimum; a huge elementwise op is the roofline's."""
    profile = DEVICE_PROFILES["h200"]
    model = AnalyticCostModel(profile)
    assert profile.min_kernel_s < profile.launch_overhead_s
    tiny = mm_graph(1, 1, 1, torch.float32)
    assert model.node_seconds(tiny, "mm") == profile.launch_overhead_s
    relu = relu_graph(2**28)
    moved = 2 * 2**28 * 4
    expected = profile.memory_latency_s + moved / profile.bytes_per_second
    assert model.node_seconds(relu, "relu") == pytest.approx(expected)
    assert expected == pytest.approx(moved / profile.bytes_per_second, rel=1e-3)


def test_convolutions_and_batch_norm_are_priced_as_measured_on_an_h100() -> None:
    """cuDNN convolutions run below their implicit GEMM's rate and training batch norm makes
    several passes (``CONV_EFFICIENCY``, ``BATCH_NORM_PASSES``, measured with
    experiments/gpu_fidelity.py): each lengthens exactly its own kind of node."""
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    import magis

    with FakeTensorMode():
        model = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU())
        x = torch.randn(32, 64, 56, 56)
    graph = magis.capture(model, (x,), lambda out: out.sum())
    h100 = DEVICE_PROFILES["h100"]
    calibrated = AnalyticCostModel(h100)
    ideal = AnalyticCostModel(dataclasses.replace(h100, conv_efficiency=1.0, batch_norm_passes=1.0))
    kinds = {"conv": 0, "batch_norm": 0}
    for node in graph.nodes:
        ratio = calibrated.node_seconds(graph, node.name) / max(ideal.node_seconds(graph, node.name), 1e-30)
        kind = next((k for k in kinds if k in node.op_name), None)
        if kind is None:
            assert ratio == pytest.approx(1.0) or ideal.node_seconds(graph, node.name) == 0
        else:
            kinds[kind] += 1
            assert ratio > 1.5, node.op_name
    assert kinds["conv"] >= 2 and kinds["batch_norm"] >= 2  # forward and backward of each
