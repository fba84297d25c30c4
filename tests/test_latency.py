"""The latency half of the simulator: FLOP and byte counts, the analytic and profiled cost models."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from magis.backend.interpreter import execute
from magis.backend.program import lower
from magis.backend.runtime import bind
from magis.cost import latency
from magis.cost.device_profiles import DEVICE_PROFILES
from magis.cost.kernel_model import Gemm, best_tiling
from magis.cost.kin import KinTimes
from magis.cost.latency import (
    AnalyticCostModel,
    LatencyProfile,
    ProfiledCostModel,
    cost_model,
    estimate_latency,
    node_bytes,
    node_flops,
    node_gemms,
)
from magis.cost.op_keys import in_step_key, measurable, node_key, op_key, replay_strides, step_context
from magis.cost.op_timing import random_tensor
from magis.cost.runtime_costs import lookup_steps
from magis.cost.timing_cache import LatencyCache, default_cache_path
from magis.frontend.capture import capture
from magis.ir.graph import Graph, GraphError, Node, Ref, Role, TensorMeta

# one torch thread: a step timed beside another test worker then has quiet runs (two threads
# wait on each other's turns, and a step timed without quiet runs is not kept in the cache)
pytestmark = pytest.mark.usefixtures("one_thread_module")


def order_of(graph: Graph) -> list[str]:
    return [n.name for n in graph.nodes]


@pytest.fixture(scope="module")
def conv_linear() -> Graph:
    """conv 3->4 (3x3, no bias) on 2x3x8x8, flatten, linear 256->5, sum."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.ReLU(), nn.Flatten(), nn.Linear(256, 5))
    return capture(model, (torch.randn(2, 3, 8, 8),), lambda out: out.sum())


def matmul_graph(size: int) -> Graph:
    """Two bf16 ``size x size`` linear layers on a ``size x size`` batch, traced on fake tensors."""
    with FakeTensorMode():
        model = nn.Sequential(
            nn.Linear(size, size, bias=False, dtype=torch.bfloat16),
            nn.ReLU(),
            nn.Linear(size, size, bias=False, dtype=torch.bfloat16),
        )
        x = torch.randn(size, size, dtype=torch.bfloat16)
    return capture(model, (x,), lambda out: out.sum())


@pytest.fixture(scope="module")
def small_matmuls() -> Graph:
    return matmul_graph(1024)


@pytest.fixture(scope="module")
def large_matmuls() -> Graph:
    return matmul_graph(8192)


def flops_by_op(graph: Graph) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for node in graph.nodes:
        flops = node_flops(graph, node.name)
        if flops:
            out.setdefault(node.op_name, []).append(flops)
    return {k: sorted(v) for k, v in out.items()}


# ------------------------------------------------------------------ counting
def test_flops_of_captured_conv_and_linear_match_hand_counts(conv_linear: Graph) -> None:
    conv = 2 * (2 * 4 * 8 * 8) * (3 * 3 * 3)  # 2 * output elements * (C_in * kh * kw)
    linear = 2 * 2 * 256 * 5  # 2 * batch * in * out
    assert flops_by_op(conv_linear) == {
        "aten.convolution.default": [conv],
        # the input needs no gradient: only the weight gradient, as many FLOPs as the forward
        "aten.convolution_backward.default": [conv],
        "aten.addmm.default": [linear],
        "aten.mm.default": [linear, linear],  # gradients of the linear's input and weight
    }


def test_convolutions_are_implicit_gemms(conv_linear: Graph) -> None:
    """Forward: M = N x H_out x W_out, N = C_out, K = C_in x kh x kw / groups; the weight
    gradient: M = C_out, N = C_in x kh x kw / groups, K = N x H_out x W_out (the input
    needs no gradient here, so the backward runs only that GEMM)."""
    gemms = {n.op_name: node_gemms(conv_linear, n.name) for n in conv_linear.nodes if "conv" in n.op_name}
    assert gemms == {
        "aten.convolution.default": (Gemm(1, 2 * 8 * 8, 4, 3 * 3 * 3),),
        "aten.convolution_backward.default": (Gemm(1, 4, 3 * 3 * 3, 2 * 8 * 8),),
    }


def test_a_strided_convolution_backward_runs_a_gemm_per_gradient() -> None:
    """Input gradient: M = N x H_in x W_in, N = C_in, K from the FLOPs (each gradient
    counts as many as the forward); weight gradient as above."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 6, 3, padding=1, stride=2))
    graph = capture(model, (torch.randn(2, 3, 8, 8),), lambda out: out.sum())
    forward = 2 * (2 * 4 * 4) * 6 * (4 * 3 * 3)
    backward = next(
        n for n in graph.nodes if n.op_name == "aten.convolution_backward.default" and n.outputs[0] is not None
    )
    assert node_gemms(graph, backward.name) == (
        Gemm(1, 2 * 8 * 8, 4, forward / (2 * 2 * 8 * 8 * 4)),
        Gemm(1, 6, 4 * 3 * 3, 2 * 4 * 4),
    )


def test_fused_attention_is_a_batched_gemm_over_heads() -> None:
    """Flash attention: one tile row per block of queries of one (batch, head), as wide
    as the head; K = 2 x keys (Q K^T, then P V)."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))

        def forward(self, q: torch.Tensor) -> torch.Tensor:
            q = q * self.scale
            return nn.functional.scaled_dot_product_attention(q, q * 2, q * 3)

    graph = capture(Attention(), (torch.randn(2, 4, 16, 8),), lambda out: out.sum())
    forward = next(n for n in graph.nodes if "attention" in n.op_name and "backward" not in n.op_name)
    assert node_gemms(graph, forward.name) == (Gemm(2 * 4, 16, 8, 2 * 16),)


def test_bytes_count_reads_and_writes_and_views_move_nothing(conv_linear: Graph) -> None:
    relu = next(n for n in conv_linear.nodes if n.op_name == "aten.relu.default")
    assert node_bytes(conv_linear, relu.name) == 2 * (2 * 4 * 8 * 8 * 4)
    model = AnalyticCostModel(DEVICE_PROFILES["h200"])
    for node in conv_linear.nodes:
        seconds = model.node_seconds(conv_linear, node.name)
        view = all(alias is not None for alias in node.aliases)  # t, view, expand, detach, getitem
        assert (seconds == 0) == (node.is_input or view), node.op_name


# ------------------------------------------------------------------ analytic
def test_a_large_gemm_costs_the_roofline_up_to_its_last_wave(large_matmuls: Graph) -> None:
    """8192^3 in bf16 on an A100: 32 x 64 = 2048 tiles of 256x128 in 19 waves of 108,
    the last one 104 tiles full: 0.2% above the roofline, and no launch cost on top."""
    profile = DEVICE_PROFILES["a100"]
    model = AnalyticCostModel(profile)
    mm = next(n for n in large_matmuls.nodes if n.op_name == "aten.mm.default")
    flops = node_flops(large_matmuls, mm.name)
    assert flops == 2 * 8192**3
    assert node_gemms(large_matmuls, mm.name) == (Gemm(1, 8192, 8192, 8192),)
    compute = flops / (profile.compute_efficiency * profile.peak_flops["bf16"])
    memory = node_bytes(large_matmuls, mm.name) / (profile.bandwidth_efficiency * profile.memory_bandwidth)
    assert compute > memory
    tiling = best_tiling(profile, Gemm(1, 8192, 8192, 8192), profile.flops_per_second(torch.bfloat16))
    assert (tiling.rows, tiling.cols, tiling.tiles, tiling.waves) == (256, 128, 2048, 19)
    assert model.node_seconds(large_matmuls, mm.name) == pytest.approx(compute * 19 * 108 / 2048)


def test_analytic_latency_grows_with_size_and_ranks_devices(small_matmuls: Graph, large_matmuls: Graph) -> None:
    totals = {}
    for name in ("h200", "a100", "rtx3090"):
        model = cost_model(name)
        small = estimate_latency(small_matmuls, order_of(small_matmuls), model).total_s
        large = estimate_latency(large_matmuls, order_of(large_matmuls), model).total_s
        assert 0 < small < large
        totals[name] = large
    assert totals["h200"] < totals["a100"] < totals["rtx3090"]


def test_fp32_matmul_uses_tensor_cores_only_with_tf32() -> None:
    with FakeTensorMode():
        model = nn.Linear(4096, 4096, bias=False)
        x = torch.randn(4096, 4096)
    graph = capture(model, (x,), lambda out: out.sum())
    order = order_of(graph)
    ieee = estimate_latency(graph, order, AnalyticCostModel(DEVICE_PROFILES["a100"])).total_s
    tf32 = estimate_latency(graph, order, AnalyticCostModel(DEVICE_PROFILES["a100"], tf32_matmul=True)).total_s
    assert tf32 < ieee / 4  # 156 vs 19.5 TFLOP/s
    assert estimate_latency(graph, order, cost_model("a100")).total_s == ieee  # PyTorch's default: no TF32
    # Set and restore by hand: torch.backends.cuda.matmul answers ``allow_tf32`` through
    # __getattr__, which pytest's monkeypatch cannot undo (it deletes the attribute).
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert estimate_latency(graph, order, cost_model("a100")).total_s == tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    assert not torch.backends.cuda.matmul.allow_tf32


def test_estimate_latency_is_a_sequential_timeline(conv_linear: Graph) -> None:
    order = order_of(conv_linear)
    profile = estimate_latency(conv_linear, order, cost_model("rtx3090"))
    assert isinstance(profile, LatencyProfile)
    assert profile.order == tuple(order)
    assert len(profile.per_node_s) == len(profile.start_s) == len(profile.streams) == len(order)
    assert profile.start_s[0] == 0
    for i in range(1, len(order)):
        assert profile.start_s[i] == pytest.approx(profile.start_s[i - 1] + profile.per_node_s[i - 1])
    assert profile.total_s == pytest.approx(sum(profile.per_node_s))
    with pytest.raises(GraphError):
        estimate_latency(conv_linear, order[::-1], cost_model("rtx3090"))


# ------------------------------------------------------------------ devices
def test_unknown_device_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="tpu-v9") as info:
        cost_model("tpu-v9")
    for name in ("cpu", "cuda", "h200", "h100", "a100", "rtx3090"):
        assert name in str(info.value)


def test_cost_model_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAGIS_CACHE_DIR", str(tmp_path))
    assert isinstance(cost_model("H200"), AnalyticCostModel)
    local = cost_model()
    assert isinstance(local, ProfiledCostModel)
    assert local.device.type == "cpu"
    assert local.cache.path == default_cache_path(torch.device("cpu"))
    assert local.cache.path.parent == tmp_path
    threads = torch.get_num_threads()
    assert local.cache.path.name.startswith(f"latency-cpu-{threads}threads-{torch.__version__}-")
    try:  # times taken on another thread count are another cache
        torch.set_num_threads(threads + 1)
        assert cost_model().cache.path != local.cache.path
    finally:
        torch.set_num_threads(threads)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            cost_model("cuda")


def test_every_profile_is_complete() -> None:
    for name, profile in DEVICE_PROFILES.items():
        assert profile.name == name
        assert set(profile.peak_flops) == {"fp64", "fp32", "tf32", "bf16", "fp16"}
        assert profile.peak_flops["bf16"] >= profile.peak_flops["fp32"]
        assert profile.memory_bandwidth > profile.host_link_bandwidth > 0
        assert 0 < profile.compute_efficiency <= 1 and 0 < profile.bandwidth_efficiency <= 1


# ------------------------------------------------------------------ profiler
def test_profiler_measures_each_operator_once_and_caches_on_disk(conv_linear: Graph, tmp_path: Path) -> None:
    path = tmp_path / "latency.json"
    order = order_of(conv_linear)
    first = ProfiledCostModel(cache_path=path, repeats=2)
    timeline = estimate_latency(conv_linear, order, first)
    assert first.measurements > 0
    assert all(math.isfinite(s) and s >= 0 for s in timeline.per_node_s)
    assert timeline.total_s > 0
    assert estimate_latency(conv_linear, order, first) == timeline
    cached = json.loads(path.read_text())
    assert first.measurements == len(cached["in_step"]) + len(cached["ops"])
    assert cached["in_step"] and not cached["ops"]  # on CPU the step ran in place: nothing was timed alone

    again = ProfiledCostModel(cache_path=path, repeats=2)
    assert estimate_latency(conv_linear, order, again) == timeline
    assert again.measurements == 0


def test_the_runtime_costs_are_measured_cached_and_added(
    conv_linear: Graph, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """simulated total = the instructions timed in their step (the runtime's loop included)
    + the binding of the inputs (lookup_s per submodule on a name's path, input_s per input)."""
    path = tmp_path / "latency.json"
    order = order_of(conv_linear)
    model = ProfiledCostModel(cache_path=path, repeats=2)
    total = estimate_latency(conv_linear, order, model).total_s
    cached = json.loads(path.read_text())["runtime_costs"]
    assert 0 <= cached["instruction_s"] < 1e-4  # beyond mapping and calling, the runtime does little
    assert 0 < cached["getitem_s"] < 1e-4
    assert 0 < cached["lookup_s"] + cached["input_s"] < 1e-4
    assert asdict(model.runtime_costs) == cached
    strides = replay_strides(conv_linear)
    keys = {n.name: op_key(conv_linear, n.name, strides) for n in conv_linear.nodes if measurable(n)}
    in_step = model.cache.in_step
    instructions = [n.name for n in conv_linear.nodes if not n.is_input]
    assert any(conv_linear[n].op_name == "getitem" for n in instructions)
    context = step_context(conv_linear.signature)
    assert all(in_step_key(conv_linear, n, keys, context) in in_step for n in instructions)
    timed = sum(in_step[in_step_key(conv_linear, n, keys, context)] for n in instructions)
    inputs = sum(1 for n in conv_linear.nodes if n.is_input)
    steps = lookup_steps(conv_linear.signature)
    assert steps == 2  # the convolution (0) and the linear layer (3) hold the parameters
    binding = steps * cached["lookup_s"] + inputs * cached["input_s"]
    assert total == pytest.approx(timed + binding)

    data = json.loads(path.read_text())
    data["runtime_costs"] = {"instruction_s": 1e-3, "getitem_s": 1e-2, "lookup_s": 1e-4, "input_s": 1e-5}
    path.write_text(json.dumps(data))

    def never(*args: object) -> float:
        raise AssertionError("the cached costs must be used")

    monkeypatch.setattr("magis.cost.latency.measure_runtime_costs", never)
    again = ProfiledCostModel(cache_path=path, repeats=2)
    expected = timed + steps * 1e-4 + inputs * 1e-5
    assert estimate_latency(conv_linear, order, again).total_s == pytest.approx(expected)
    assert again.measurements == 0


def test_a_step_timed_while_other_processes_hold_every_core_is_priced_now_and_not_kept(tmp_path: Path) -> None:
    """Beside two busy loops per core this process's thread runs about half the time or less
    (several threads of torch would wait on each other's turns): a step of tens of
    milliseconds, longer than the scheduler's turns, has no quiet run; the model warns, prices
    with its times, and keeps them out of the file, so that a run on a quiet machine times
    the step again. (A step shorter than a turn finds runs that ran whole, and keeps them.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    step = capture(model, (torch.randn(512, 512),), lambda out: out.sum())
    path = tmp_path / "latency.json"
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.5)  # the loops started
        priced = ProfiledCostModel(cache_path=path, repeats=2)
        with pytest.warns(UserWarning, match="kept this machine's cores busy while the step's .* were timed"):
            busy_s = estimate_latency(step, order_of(step), priced).total_s
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert busy_s > 0 and priced.cache.in_step and priced.cache.unsaved == priced.cache.in_step.keys()
    saved = json.loads(path.read_text())
    assert saved["in_step"] == {} and saved["runtime_costs"]  # what was timed alone is kept
    again = ProfiledCostModel(cache_path=path, repeats=2)
    assert not again.cache.in_step  # the next model times the step again


def test_times_kept_out_of_the_file_give_way_to_another_processes_quiet_ones(tmp_path: Path) -> None:
    busy, quiet = LatencyCache(tmp_path / "latency.json"), LatencyCache(tmp_path / "latency.json")
    busy.in_step.update(step=9.0, other=1.0)
    busy.unsaved.add("step")
    busy.save()
    assert json.loads(busy.path.read_text())["in_step"] == {"other": 1.0}
    quiet.in_step["step"] = 2.0  # timed quietly in another process meanwhile
    quiet.save()
    busy.save()
    assert json.loads(busy.path.read_text())["in_step"] == {"other": 1.0, "step": 2.0}
    assert busy.in_step["step"] == 2.0 and not busy.unsaved


def test_a_step_that_cannot_run_in_place_is_timed_operator_by_operator(
    conv_linear: Graph, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no such kernel here")

    monkeypatch.setattr("magis.cost.latency.measure_in_step", fails)
    model = ProfiledCostModel(cache_path=tmp_path / "latency.json", repeats=2)
    timeline = estimate_latency(conv_linear, order_of(conv_linear), model)
    assert not model.cache.in_step
    assert model.measurements == len(model.cache.ops) > 0
    getitem = order_of(conv_linear).index(next(n.name for n in conv_linear.nodes if n.op_name == "getitem"))
    costs = model.runtime_costs
    assert timeline.per_node_s[getitem] == pytest.approx(costs.getitem_s + costs.instruction_s)


def test_kin_times_scale_the_nearest_kin_by_the_roofline() -> None:
    kin = KinTimes()
    kin.add("aten.mm(T(float32[8, 16]),T(float32[16, 4]))", analytic_s=1.0, seconds=2.0)
    kin.add("aten.mm(T(float32[8, 16]),T(float32[16, 32]))", analytic_s=5.0, seconds=8.0)
    # one integer differs from the first, two from the second: the first is the kin
    assert kin.estimate("aten.mm(T(float32[4, 16]),T(float32[16, 4]))", analytic_s=0.5) == pytest.approx(1.0)
    assert kin.estimate("aten.mm(T(float32[8, 16]),T(float32[16, 32]))", analytic_s=5.0) == 8.0  # itself
    # no operator of that form: the analytic time at the median measured/analytic ratio (2.0, 1.6)
    assert kin.estimate("aten.relu(T(float32[8, 16]))", analytic_s=3.0) == pytest.approx(3.0 * 1.8)
    kin.add("aten.relu(T(float32[8, 8]))", analytic_s=1.0, seconds=4.0)  # a kin now: the estimate follows
    assert kin.estimate("aten.relu(T(float32[8, 16]))", analytic_s=3.0) == pytest.approx(12.0)


def test_an_estimating_model_prices_another_batch_from_its_kin_without_timing(tmp_path: Path) -> None:
    """The step at batch 4 after the step at batch 2: each operator estimated from its own
    application at batch 2, scaled by the roofline; nothing timed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.ReLU(), nn.Flatten(), nn.Linear(256, 5))
    half, whole = (capture(model, (torch.randn(b, 3, 8, 8),), lambda out: out.sum()) for b in (2, 4))
    estimating = ProfiledCostModel(cache_path=tmp_path / "latency.json", repeats=2, estimate_unseen=True)
    first = dict(zip(order_of(half), estimate_latency(half, order_of(half), estimating).per_node_s))
    timed = estimating.measurements
    assert timed > 0 and estimating.estimated == 0  # the first graph is always timed
    second = dict(zip(order_of(whole), estimate_latency(whole, order_of(whole), estimating).per_node_s))
    assert estimating.measurements == timed and estimating.estimated > 0
    conv = next(n.name for n in whole.nodes if n.op_name == "aten.convolution.default")
    roofline = estimating.fallback
    assert second[conv] == pytest.approx(
        first[conv] * roofline.node_seconds(whole, conv) / roofline.node_seconds(half, conv)
    )
    strides = replay_strides(whole)
    keys = {n.name: op_key(whole, n.name, strides) for n in whole.nodes if measurable(n)}
    assert node_key(whole, conv, keys) == keys[conv]
    measuring = ProfiledCostModel(cache_path=tmp_path / "latency.json", repeats=2)
    estimate_latency(whole, order_of(whole), measuring)
    assert measuring.measurements > 0  # without estimate_unseen the new batch is timed


def test_a_large_estimate_is_scaled_by_its_kin_timed_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An estimate above ``CHECK_ESTIMATE_S`` (here every one) is the kin's time in its step
    scaled by the two operators' times alone, not by the roofline: here timing alone says the
    convolution at batch 4 takes 3x its kin at batch 2 (the roofline says about 1x), and each
    distinct operator is timed alone once."""
    monkeypatch.setattr(latency, "CHECK_ESTIMATE_S", 0.0)
    alone_calls = []

    def alone(graph, names, strides, device, repeats):
        for name in names:
            alone_calls.append(name)
            batch4 = any(m is not None and m.shape[:1] == (4,) for m in graph[name].outputs)
            yield name, 1e-3 * (3.0 if batch4 else 1.0)

    monkeypatch.setattr(latency, "measure_nodes", alone)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.ReLU(), nn.Flatten(), nn.Linear(256, 5))
    half, whole = (capture(model, (torch.randn(b, 3, 8, 8),), lambda out: out.sum()) for b in (2, 4))
    estimating = ProfiledCostModel(cache_path=tmp_path / "latency.json", repeats=2, estimate_unseen=True)
    first = dict(zip(order_of(half), estimate_latency(half, order_of(half), estimating).per_node_s))
    assert not alone_calls  # the first graph is timed in its step
    second = dict(zip(order_of(whole), estimate_latency(whole, order_of(whole), estimating).per_node_s))
    conv = next(n.name for n in whole.nodes if n.op_name == "aten.convolution.default")
    assert second[conv] == pytest.approx(3.0 * first[conv])
    assert alone_calls.count(conv) == 2  # the convolution at batch 4, then its kin at batch 2
    estimate_latency(whole, order_of(whole), estimating)
    assert alone_calls.count(conv) == 2
    # another process on this machine (the same cache file) times nothing alone again
    again = ProfiledCostModel(cache_path=tmp_path / "latency.json", repeats=2, estimate_unseen=True)
    estimate_latency(half, order_of(half), again)
    priced = dict(zip(order_of(whole), estimate_latency(whole, order_of(whole), again).per_node_s))
    assert priced[conv] == pytest.approx(second[conv])
    assert alone_calls.count(conv) == 2 and again.measurements == 0


def test_an_operator_of_a_form_never_timed_is_priced_by_its_time_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with a GELU where the step timed before had a ReLU: the GELU has no kin, and is
    priced by its time alone plus the runtime's cost per instruction (not the roofline at the
    median ratio of what was timed, which a rewrite's in-place op or 1x1 convolution's matrix
    product missed several times over); at another batch size it is priced from that kin."""
    timed_alone: list[str] = []

    def alone(graph, names, strides, device, repeats):
        for name in names:
            timed_alone.append(graph[name].op_name)
            yield name, 7e-4

    monkeypatch.setattr(latency, "measure_nodes", alone)
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.ReLU(), nn.Flatten(), nn.Linear(256, 5)]
    relu, gelu = nn.Sequential(*layers), nn.Sequential(*layers[:1], nn.GELU(), *layers[2:])
    timed = capture(relu, (torch.randn(2, 3, 8, 8),), lambda out: out.sum())
    estimating = ProfiledCostModel(cache_path=tmp_path / "latency.json", repeats=2, estimate_unseen=True)
    estimate_latency(timed, order_of(timed), estimating)
    instruction = estimating.runtime_costs.instruction_s
    steps = [capture(gelu, (torch.randn(batch, 3, 8, 8),), lambda out: out.sum()) for batch in (2, 4)]
    for step in steps:
        priced = dict(zip(order_of(step), estimate_latency(step, order_of(step), estimating).per_node_s))
        gelus = [n.name for n in step.nodes if "gelu" in n.op_name]
        assert len(gelus) == 2  # the forward and its backward
        if step is steps[0]:
            assert all(priced[name] == pytest.approx(7e-4 + instruction) for name in gelus)
    assert sorted(timed_alone) == ["aten.gelu.default", "aten.gelu_backward.default"]
    assert estimating.estimated > 0  # the convolution and the linear layer from their kin


def test_identical_operators_are_measured_once(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    graph = capture(model, (torch.randn(4, 8),), lambda out: out.sum())
    profiled = ProfiledCostModel(cache_path=tmp_path / "latency.json", repeats=2)
    per_node = dict(zip(order_of(graph), estimate_latency(graph, order_of(graph), profiled).per_node_s))
    addmms = [per_node[n.name] for n in graph.nodes if n.op_name == "aten.addmm.default"]
    assert len(addmms) == 3 and len(set(addmms)) == 1
    measured_ops = {n.op_name for n in graph.nodes if n.target is not None and n.op_name != "getitem"}
    assert profiled.measurements < sum(1 for n in graph.nodes if n.op_name in measured_ops)


def test_profiler_keeps_the_rng_stream(conv_linear: Graph, tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    graph = capture(model, (torch.randn(4, 8),), lambda out: out.sum())
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    estimate_latency(graph, order_of(graph), ProfiledCostModel(cache_path=tmp_path / "latency.json", repeats=2))
    assert torch.equal(torch.rand(3), expected)


def test_random_inputs_follow_the_recorded_layout() -> None:
    meta = TensorMeta((3, 4), torch.float32, 48)
    transposed = random_tensor(meta, (1, 3), torch.device("cpu"))
    assert transposed.shape == (3, 4) and transposed.stride() == (1, 3)
    broadcast = random_tensor(meta, (0, 0), torch.device("cpu"))
    assert broadcast.stride() == (0, 0)
    indices = random_tensor(TensorMeta((5,), torch.int64, 40), None, torch.device("cpu"))
    assert indices.eq(0).all()


def test_replayed_strides_see_transposes_and_broadcasts(conv_linear: Graph) -> None:
    strides = replay_strides(conv_linear)
    t = next(n for n in conv_linear.nodes if n.op_name == "aten.t.default" and conv_linear[n.inputs[0]].is_input)
    assert strides[t.name] == ((1, 256),)
    expand = next(n for n in conv_linear.nodes if n.op_name == "aten.expand.default")
    assert strides[expand.name] == ((0, 0),)


# ------------------------------------------------------------------ never crash
class Region:
    """A stand-in for a fissioned region: it prices itself."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.asked: list[object] = []

    def estimate_seconds(self, model: object) -> float:
        self.asked.append(model)
        return self.seconds


def abstract_graph(region: Region) -> Graph:
    """Inputs, an op known only by name, an aten op that cannot run on its shapes, a region."""
    square = TensorMeta((64, 64), torch.float32, 64 * 64 * 4)
    odd = TensorMeta((3, 5), torch.float32, 60)
    nodes = (
        Node("a", None, outputs=(square,), aliases=(None,), role=Role.INPUT),
        Node("b", None, outputs=(odd,), aliases=(None,), role=Role.INPUT),
        Node("matmul", "matmul", (Ref("a"), Ref("a")), outputs=(square,), aliases=(None,)),
        Node("bad", torch.ops.aten.mm.default, (Ref("matmul"), Ref("b")), outputs=(odd,), aliases=(None,)),
        Node("region", region, (Ref("bad"),), outputs=(odd,), aliases=(None,)),
    )
    return Graph(nodes, outputs=("region",))


def test_abstract_and_failing_operators_fall_back_to_the_analytic_estimate(tmp_path: Path) -> None:
    region = Region(0.25)
    graph = abstract_graph(region)
    order = order_of(graph)
    analytic = estimate_latency(graph, order, cost_model("h100"))
    assert analytic.per_node_s[:2] == (0.0, 0.0)
    assert all(math.isfinite(s) and s > 0 for s in analytic.per_node_s[2:])
    assert analytic.per_node_s[-1] == 0.25

    path = tmp_path / "latency.json"
    profiled = ProfiledCostModel(cache_path=path, repeats=2)
    timeline = estimate_latency(graph, order, profiled)
    assert all(math.isfinite(s) and s > 0 for s in timeline.per_node_s[2:])
    assert timeline.per_node_s[-1] == 0.25 + profiled.runtime_costs.instruction_s  # the region is one instruction
    assert region.asked[-1] is profiled
    assert profiled.measurements == 1  # the aten op was tried once and failed
    cached = json.loads(path.read_text())
    assert list(cached["ops"].values()) == [None]
    assert cached["device_profile"]["name"] == "cpu"

    again = ProfiledCostModel(cache_path=path, repeats=2)
    assert estimate_latency(graph, order, again) == timeline
    assert again.measurements == 0


def test_replaying_every_op_on_meta_gives_each_value_the_layout_a_real_run_gives_it() -> None:
    """``replay_strides(every_op=True)``: an elementwise op keeps its transposed input's layout,
    a matmul's gradient comes out transposed; the strides of each value as the step makes it."""

    class Transposing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(16, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (torch.tanh(x.t() * 2.0) @ self.weight).relu()

    model, x = Transposing(), torch.randn(16, 12)
    graph = capture(model, (x,), lambda out: out.sum())
    made: dict[str, tuple] = {}
    program = lower(graph, [n.name for n in graph.nodes])
    env = bind(graph, model, (x,))
    with torch.no_grad():
        execute(program, env, emit=lambda name, value: made.setdefault(name, value))
    real = {
        name: tuple(
            v.stride() if isinstance(v, torch.Tensor) else None
            for v in (value if isinstance(value, tuple) else (value,))
        )
        for name, value in made.items()
    }
    replayed = replay_strides(graph, every_op=True)
    assert all(replayed[name] == strides for name, strides in real.items()), {
        n: (replayed[n], s) for n, s in real.items() if replayed[n] != s
    }
    views_only = replay_strides(graph)
    assert any(views_only[name] != strides for name, strides in real.items())  # the case that needs it


def test_an_operator_keeps_its_key_while_its_inputs_keep_their_layout(tmp_path: Path) -> None:
    """The keys a profiled model remembers by node: the same ``unsqueeze`` and ``relu`` nodes,
    priced in a graph where the unsqueezed value is a transpose and in one where it is a
    contiguous copy of another tensor, get each graph's own keys (those :func:`op_key` gives):
    the ``relu``'s input is the same node in both, in another layout."""
    meta, unsqueezed = TensorMeta((6, 4), torch.float32, 96), TensorMeta((1, 6, 4), torch.float32, 96)
    x = Node("x", None, outputs=(TensorMeta((4, 6), torch.float32, 96),), aliases=(None,), role=Role.INPUT)
    w = Node("w", None, outputs=(meta,), aliases=(None,), role=Role.INPUT)
    transposed = Node("v", torch.ops.aten.t.default, (Ref("x"),), outputs=(meta,), aliases=((0, 0),))
    copied = Node("v", torch.ops.aten.clone.default, (Ref("w"),), outputs=(meta,), aliases=(None,))
    view = Node("y", torch.ops.aten.unsqueeze.default, (Ref("v"), 0), outputs=(unsqueezed,), aliases=((0, 0),))
    relu = Node("z", torch.ops.aten.relu.default, (Ref("y"),), outputs=(unsqueezed,), aliases=(None,))
    first = Graph((x, w, transposed, view, relu), outputs=("z",))
    second = Graph((x, w, copied, view, relu), outputs=("z",))
    model = ProfiledCostModel(cache_path=tmp_path / "latency.json", repeats=2, estimate_unseen=True)
    keys = []
    for graph in (first, second, first):
        strides = replay_strides(graph)
        expected = {n.name: op_key(graph, n.name, strides) for n in graph.nodes if measurable(n)}
        keys.append(model._keys(graph, strides))
        assert keys[-1] == expected
    assert keys[0]["z"] != keys[1]["z"]
