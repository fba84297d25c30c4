"""Generated code (issue #30): a plan's step as straight-line Python, regions as loops.

Every transformation a plan holds survives codegen (asserted on the generated source)
and runs as the interpreter and eager PyTorch do, within the simulated peak; every tiny
workload's plan gives eager's loss and gradients in every runtime, within its limit.
"""

from __future__ import annotations

import operator
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

import magis
import magis.plan as plan_module
from magis.analysis.ftrans import FTrans
from magis.analysis.ftree import build_ftree, next_divisor
from magis.backend.codegen import GeneratedStep, generate
from magis.backend.compiled import (
    KERNEL_SCRATCH,
    PEAK_SHARE,
    STEP_SCRATCH_SHARE,
    CompiledSegment,
    Trial,
    compiled_segments,
)
from magis.backend.eager import (
    GRADIENT_TOLERANCE,
    buffers_snapshot,
    compare_gradients,
    eager_step,
    restore_buffers,
)
from magis.backend.meter import LiveTensorMeter, peak_meter, resident_tensors
from magis.backend.program import lower
from magis.backend.runtime import run_program
from magis.cost.device_profiles import DEVICE_PROFILES
from magis.cost.latency import AnalyticCostModel, estimate_latency, fused_with, fusible
from magis.cost.memory import simulate_memory
from magis.cost.op_timing import StepsTimed
from magis.frontend.capture import capture
from magis.ir.graph import Graph
from magis.models import WORKLOADS
from magis.plan import PLAN_RUNTIMES, InfeasibleLimit, generated_step
from magis.rules.fission import FissionRegion, fission
from magis.rules.remat import remat
from magis.rules.separable import make_separable
from magis.rules.swap import swap

H100 = AnalyticCostModel(DEVICE_PROFILES["h100"])


class Tower(nn.Module):
    """A user's model: two residual blocks with layer norm and GELU, a regression head."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(2)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).squeeze(-1)


def mse(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@pytest.fixture(scope="module")
def tower() -> tuple[nn.Module, tuple[torch.Tensor], Graph]:
    torch.manual_seed(0)
    model = Tower().double()
    batch = (torch.randn(64, 32, dtype=torch.float64),)
    graph = make_separable(capture(model, batch, mse))
    return model, batch, graph


def runs_like_eager(model: nn.Module, batch: tuple, graph: Graph, order: tuple[str, ...]) -> Steps:
    """Run ``graph`` in ``order`` as generated code: the same loss and gradients as the
    interpreter (bitwise: the same kernels in the same order) and eager PyTorch (float64
    round-off), the measured peak within 2% of the simulated one; then compiled, eager's
    loss and gradients within float64 round-off and the peak, as the allocator counts it
    (Inductor's buffers included), no higher. Returns both steps."""
    program = lower(graph, order)
    steps = Steps(generate(program), generated_step(program, compile=True))
    snapshot = buffers_snapshot(model)
    with LiveTensorMeter(resident_tensors(model, batch)) as meter:
        generated = run_program(program, model, batch, runtime=steps.generated)
    interpreted = run_program(program, model, batch, runtime="interpreted")
    run_program(program, model, batch, runtime=steps.compiled)  # the first call compiles
    with peak_meter(model, batch, compiled=True) as compiled_meter:  # Inductor's buffers included
        compiled = run_program(program, model, batch, runtime=steps.compiled)
    restore_buffers(model, snapshot)
    reference = eager_step(model, batch, mse)
    assert torch.equal(generated.loss, interpreted.loss)
    assert all(torch.equal(generated.gradients[p], interpreted.gradients[p]) for p in interpreted.gradients)
    for result in (generated, compiled):
        comparison = compare_gradients(
            {**reference.gradients, "<loss>": reference.loss}, {**result.gradients, "<loss>": result.loss}
        )
        assert comparison.same_names and comparison.max_error < 1e-10, comparison
    simulated = simulate_memory(graph, order).peak
    assert abs(meter.peak_bytes - simulated) <= 0.02 * simulated, (meter.peak_bytes, simulated)
    assert compiled_meter.peak_bytes <= 1.02 * simulated, (compiled_meter.peak_bytes, simulated)
    assert steps.compiled.segments and all(s.fallback is None for s in steps.compiled.segments)
    return steps


@dataclass(frozen=True)
class Steps:
    generated: GeneratedStep
    compiled: GeneratedStep

    def compiled_ops(self) -> set[str]:
        """The names of the nodes the compiled segments run."""
        return {n.name for s in self.compiled.segments for n in s.module.graph.nodes if n.op == "call_function"}


def test_a_compiled_steps_first_call_measures_as_its_later_ones(tower):
    """Inductor compiles each segment on the step's first call, on fake tensors: the live-tensor
    meter counts no memory for them (it did: GPT-Neo small's first compiled step measured 2.3
    times eager's peak, its second 0.78)."""
    model, batch, graph = tower
    program = lower(graph, tuple(n.name for n in graph.nodes))
    step = generated_step(program, compile=True)
    peaks = []
    for _ in range(2):
        with LiveTensorMeter(resident_tensors(model, batch)) as meter:
            run_program(program, model, batch, runtime=step)
        peaks.append(meter.peak_bytes)
    assert step.segments and peaks[0] == peaks[1], peaks


def test_a_fissioned_region_becomes_a_loop_over_its_parts(tower):
    model, batch, graph = tower
    tree = build_ftree(graph, simulate_memory(graph, [n.name for n in graph.nodes]))
    candidate = max(tree.candidates, key=lambda c: len(c.nodes))
    parts = next_divisor(candidate.length, 2)
    split = fission(graph, FTrans(candidate.axes, parts))
    (region,) = [n for n in split.nodes if isinstance(n.target, FissionRegion)]
    steps = runs_like_eager(model, batch, split, tuple(n.name for n in split.nodes))
    part_ops = {n.name for n in region.target.graph.nodes if not n.is_input and n.op_name.startswith("aten.")}
    for source in (steps.generated.source, steps.compiled.source):  # the region's loop stays when compiled
        loop = re.search(rf"^(\s+)for k\w* in range\({parts}\):$", source, re.MULTILINE)
        assert loop, source
        body = source[loop.end() :].split("\n" + loop.group(1) + region.name)[0]
        # every op of one part runs inside the loop, generated or in a compiled segment called
        # there (each part's segments are its own), and each part's piece is put in place there
        step = steps.compiled if source is steps.compiled.source else steps.generated
        called = [step.function.__globals__[name] for name in re.findall(r"\b(_segment\d+)\(", body)]
        in_segments = {n.name for s in called for n in s.module.graph.nodes if n.op == "call_function"}
        for node in region.target.graph.nodes:
            if node.name in part_ops and node.name not in in_segments:
                assert node.op_name in body, node.op_name
        assert ".copy_(" in body
    assert in_segments & part_ops, "one part's ops are compiled"


def test_a_swap_becomes_its_two_transfers(tower):
    """A Store and a Load, generated and compiled; the Load's reader waits for its copy (a
    compiled segment that reads it is preceded by the wait: on an H200 a compiled BERT plan
    without it read its loaded tensors before their copies and took gradients off by 1e15)."""
    model, batch, graph = tower
    candidate = max(swap(graph, model=H100), key=lambda c: c.saving)
    store, load = (n.name for n in candidate.graph.nodes if n.op_name in ("store", "load"))
    steps = runs_like_eager(model, batch, candidate.graph, candidate.order)
    for source in (steps.generated.source, steps.compiled.source):
        assert re.search(rf"= _transfer\(streams, '{store}', ", source), source
        loaded = re.search(rf"^\s+(\w+) = _transfer\(streams, '{load}', ", source, re.MULTILINE)
        assert loaded, source
        assert source.index(f"'{store}'") < source.index(f"'{load}'")
        # on CUDA the first op that reads the loaded tensor, in a compiled segment too, waits for its copy
        after = source[loaded.end() :].splitlines()[1:]
        waits = [i for i, line in enumerate(after) if "streams.wait_for(" in line and f"'{load}'" in line]
        reads = [i for i, line in enumerate(after) if re.search(rf"(?<!')\b{loaded.group(1)}\b(?!')", line)]
        assert waits and waits[0] < reads[0], source


def test_a_recomputation_runs_its_ops_twice(tower):
    model, batch, graph = tower
    candidate = max(remat(graph), key=lambda c: c.saving)
    added = set(candidate.graph.index) - set(graph.index)
    assert added
    steps = runs_like_eager(model, batch, candidate.graph, candidate.order)
    compiled = steps.compiled_ops()
    for name in added:  # each copy is an op of its own, generated or in a compiled segment
        assert re.search(rf"^\s+{name} = aten\.", steps.generated.source, re.MULTILINE), name
        assert name in compiled or re.search(rf"^\s+{name} = aten\.", steps.compiled.source, re.MULTILINE), name


def in_float64(built):
    inputs = tuple(x.double() if x.is_floating_point() else x for x in built.example_inputs)
    return built.model.double(), inputs


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_tiny_workload_plan_runs_like_eager_in_every_runtime(name):
    built = WORKLOADS[name].build("tiny", seed=0)
    model, batch = in_float64(built)
    try:
        plan = magis.optimize(
            model, batch, built.loss_fn, memory_limit=0.8, time_budget=3, device="h100", verify=False, progress=False
        )
    except InfeasibleLimit as err:  # the best plan found still runs as it was simulated
        plan = err.best or magis.optimize(
            model, batch, built.loss_fn, latency_limit=1.1, time_budget=3, device="h100", verify=False, progress=False
        )
    torch.manual_seed(5)
    snapshot = buffers_snapshot(model)
    reference = eager_step(model, batch, built.loss_fn)
    for runtime in PLAN_RUNTIMES:
        plan.runtime = runtime
        if runtime == "compiled":  # the first call compiles: measure the second
            restore_buffers(model, snapshot)
            plan(*batch)
        restore_buffers(model, snapshot)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        with LiveTensorMeter(resident_tensors(model, batch)) as meter:
            loss = plan(*batch)
        got = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        comparison = compare_gradients(
            {**reference.gradients, "<loss>": reference.loss}, {**got, "<loss>": loss.detach()}
        )
        # float64 where the model computes in it (the language models' attention upcasts to float32):
        # generated code runs eager's kernels, compiled ones fuse them and round otherwise
        tolerance = 1e-9 if runtime != "compiled" else GRADIENT_TOLERANCE[torch.float64]
        assert comparison.same_names and comparison.max_error < tolerance, (runtime, comparison)
        if runtime != "compiled":
            assert meter.peak_bytes <= 1.02 * plan.peak_bytes, (runtime, meter.peak_bytes, plan.peak_bytes)
    assert plan.report().runtime["fallbacks"] == []
    # compiled code allocates below the dispatcher, where live tensors miss its buffers: its peak
    # is the allocator's, beside the generated code's counted so (the simulated peak plus eager
    # kernels' own scratch: tiny U-Net's +31%, where a compiled step's live tensors may peak higher)
    allocated = {}
    for runtime in ("generated", "compiled"):
        plan.runtime = runtime
        restore_buffers(model, snapshot)
        model.zero_grad(set_to_none=True)
        with peak_meter(model, batch, compiled=True) as meter:
            plan(*batch)
        allocated[runtime] = meter.peak_bytes
    assert allocated["compiled"] <= allocated["generated"] + 0.02 * plan.peak_bytes, (allocated, plan.peak_bytes)
    model.zero_grad(set_to_none=True)


def test_an_unknown_runtime_is_refused_by_name(tower):
    model, batch, _ = tower
    plan = magis.optimize(model, batch, mse, memory_limit=0.9, time_budget=1, device="h100", progress=False)
    plan.runtime = "jit"
    with pytest.raises(ValueError, match="runtime 'jit' is not one of generated, interpreted"):
        plan(*batch)


class Gated(nn.Module):
    """A gated feed-forward block (SwiGLU): the gate's SiLU is saved for a pointwise reader."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.gate, self.up, self.down = (
            nn.Linear(width, 4 * width),
            nn.Linear(width, 4 * width),
            nn.Linear(4 * width, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def test_the_fusion_model_makes_recomputing_pointwise_ops_nearly_free(tower):
    """Priced as compiled (issue #30), a chain of pointwise ops is one kernel that reads and
    writes only its ends: the step is cheaper, an op computed inside a kernel already open
    costs only the bytes it moves in or out, and recomputing a pointwise op for a pointwise
    reader costs far less than unfused, where it is a kernel of its own writing a whole tensor."""
    _, _, graph = tower
    plain, fused = H100, AnalyticCostModel(H100.profile, fused=True)
    order = [n.name for n in graph.nodes]
    assert estimate_latency(graph, order, fused).total_s < estimate_latency(graph, order, plain).total_s
    inner = [n.name for n in graph.nodes if any(fused_with(graph[r], n) for r in n.inputs)]
    assert inner
    for name in inner:
        assert fused.node_seconds(graph, name) < plain.node_seconds(graph, name)

    torch.manual_seed(0)
    gated = capture(Gated(), (torch.randn(256, 32),), mse)
    order = [n.name for n in gated.nodes]
    cheap = []
    for candidate in remat(gated):
        copies = [candidate.graph[n] for n in set(candidate.graph.index) - set(gated.index)]
        readers = [candidate.graph[r] for c in copies for r in candidate.graph.consumers[c.name]]
        if all(fusible(c) for c in copies) and all(fusible(r) for r in readers):
            cheap.append(candidate)
    assert cheap
    for candidate in cheap:
        extra = {
            model: estimate_latency(candidate.graph, candidate.order, model).total_s
            - estimate_latency(gated, order, model).total_s
            for model in (plain, fused)
        }
        assert extra[fused] < 0.5 * extra[plain], (candidate.description, extra)


def test_a_timed_compiled_step_keeps_a_segment_compiled_only_where_its_trial_wins(tower):
    """``timed_on``: each segment compiled and run both ways on random inputs of its shapes; it
    stays compiled only where faster and holding no more memory, the others run as generated
    ops; the step still gives eager's gradients."""
    model, batch, graph = tower
    order = tuple(n.name for n in graph.nodes)
    program = lower(graph, order)
    every = generated_step(program, compile=True)
    timed = generated_step(program, compile=True, timed_on=torch.device("cpu"))
    assert every.segments and all(s.trial is None for s in every.segments)
    live = simulate_memory(graph, order).timeline
    candidates = {(s.start, s.stop) for near in (False, True) for s in compiled_segments(program, live, near_peak=near)}
    assert {(s.start, s.stop) for s in timed.segments} <= candidates
    assert all(s.trial is not None and s.trial.compiled_wins for s in timed.segments)
    compiled = {i for s in timed.segments for i in range(s.start, s.stop)}
    for i, ins in enumerate(program.instructions):
        if i not in compiled and ins.fn is not operator.getitem:  # generated code
            assert re.search(rf"^\s+\w+ = .*\b{re.escape(str(ins.fn))}\(", timed.source, re.MULTILINE), ins.node
    result = run_program(program, model, batch, runtime=timed)
    reference = eager_step(model, batch, mse)
    comparison = compare_gradients(reference.gradients, result.gradients)
    assert comparison.same_names and comparison.max_error < 1e-10, comparison


@pytest.mark.parametrize("wide_wins", [True, False])
def test_a_tried_segment_runs_through_the_peak_and_where_it_loses_the_runs_beside_the_peak_are_tried(
    tower, monkeypatch: pytest.MonkeyPatch, wide_wins: bool
):
    """Untried segments stop short of the instructions near the peak; tried ones run through
    them (their trial meters Inductor's buffers), and where one loses, the runs between its
    near-peak instructions are tried in its place."""
    model, batch, graph = tower
    order = tuple(n.name for n in graph.nodes)
    program = lower(graph, order)
    live = simulate_memory(graph, order).timeline
    narrow = compiled_segments(program, live)
    wide = compiled_segments(program, live, near_peak=True)
    position = {name: i for i, name in enumerate(order)}
    peak = max(live)

    def near(segment: CompiledSegment) -> bool:
        body = program.instructions[segment.start : segment.stop]
        return any(live[position[ins.node]] >= PEAK_SHARE * peak for ins in body)

    assert not any(near(s) for s in narrow) and any(near(s) for s in wide)
    tried: list[tuple[int, int]] = []

    def faster_compiled(segment: CompiledSegment, args, timer) -> bool:
        tried.append((segment.start, segment.stop))
        return wide_wins or not near(segment)

    monkeypatch.setattr(CompiledSegment, "faster_compiled", faster_compiled)
    monkeypatch.setattr(plan_module, "_faster_whole", lambda compiled, plain, strides, device: compiled)
    step = generated_step(program, compile=True, timed_on=torch.device("cpu"))
    kept = [(s.start, s.stop) for s in step.segments]
    if wide_wins:
        assert kept == [(s.start, s.stop) for s in wide]
    else:
        losers = [s for s in wide if near(s)]
        inside = [(s.start, s.stop) for s in narrow if any(w.start <= s.start and s.stop <= w.stop for w in losers)]
        assert inside and set(inside) <= set(tried)
        assert set(kept) == {(s.start, s.stop) for s in wide if not near(s)} | set(inside)
    result = run_program(program, model, batch, runtime=step)
    comparison = compare_gradients(eager_step(model, batch, mse).gradients, result.gradients)
    assert comparison.same_names and comparison.max_error < 1e-10, comparison


def test_a_compiled_step_made_inside_the_callers_profiler_runs_its_ops_as_they_are(tower):
    """A CPU trial meters through torch.profiler, which cannot nest: inside the caller's own
    profile no segment is kept (none could be metered), and the step still runs as eager's."""
    model, batch, graph = tower
    program = lower(graph, tuple(n.name for n in graph.nodes))
    with torch.profiler.profile():
        step = generated_step(program, compile=True, timed_on=torch.device("cpu"))
        result = run_program(program, model, batch, runtime=step)
    assert not step.segments
    comparison = compare_gradients(eager_step(model, batch, mse).gradients, result.gradients)
    assert comparison.same_names and comparison.max_error < 1e-10, comparison


def _rounds_timer(samples: tuple[tuple[float, float], ...]):
    """A stand-in for :func:`~magis.cost.op_timing.time_in_turns` that says the whole steps
    (compiled first) took ``samples`` in paired rounds."""

    def time_in_turns(calls, device, runs, max_seconds) -> StepsTimed:
        assert len(calls) == 2
        medians = tuple(statistics.median(r[i] for r in samples) for i in range(2))
        return StepsTimed(medians, len(samples), True, samples)

    return time_in_turns


@pytest.mark.parametrize(
    "samples, kept",
    [
        (((1.0, 2.0), (1.1, 2.0), (0.9, 2.1)), True),  # faster in every round
        (((3.0, 2.0), (3.1, 2.0), (2.9, 2.1)), False),  # slower
        (((0.9, 1.0), (1.1, 1.0), (0.95, 1.0)), False),  # 1.7% faster on average, with 6% of noise
    ],
)
def test_a_timed_compiled_step_not_clearly_faster_whole_than_its_generated_code_runs_as_generated_code(
    tower, monkeypatch: pytest.MonkeyPatch, samples: tuple[tuple[float, float], ...], kept: bool
):
    """Every segment wins its trial here (the timer says so), and the compiled step is then timed
    whole against its generated code in paired rounds (said here to take ``samples``): where it
    is not faster by more than the standard error of the rounds' ratios the step runs as
    generated code, no segment compiled, and gives eager's gradients all the same; either way
    the trial is kept (``whole_trial``) for the plan's report."""
    model, batch, graph = tower
    program = lower(graph, tuple(n.name for n in graph.nodes))
    monkeypatch.setattr(plan_module, "time_calls", lambda fns, device, repeats: [1.0, 2.0])  # compiled first
    monkeypatch.setattr(plan_module, "time_in_turns", _rounds_timer(samples))
    step = generated_step(program, compile=True, timed_on=torch.device("cpu"))
    trial = step.whole_trial
    assert trial is not None and trial.ratio == pytest.approx(statistics.fmean(c / g for c, g in samples))
    assert trial.compiled_s == statistics.median(c for c, _ in samples)
    assert trial.compiled_wins == kept  # both steps ran for real, metered: neither holds more here
    if kept:
        assert step.segments and all(s.trial.compiled_wins for s in step.segments)
    else:
        assert not step.segments and step.source == generate(program).source
    result = run_program(program, model, batch, runtime=step)
    reference = eager_step(model, batch, mse)
    comparison = compare_gradients(reference.gradients, result.gradients)
    assert comparison.same_names and comparison.max_error < 1e-10, comparison


def test_a_compiled_plan_with_the_optimizer_inside_times_its_whole_step_and_trains_as_eager(
    monkeypatch: pytest.MonkeyPatch,
):
    """``optimize(compile=True, optimizer=...)``: the whole-step trial runs the step (the update
    included) on random inputs without the user's optimizer, then the plan trains the model as
    eager's loop with the same optimizer does, and its report gives the trial's two times (the
    timer says compiled is faster: every trial then runs, whatever this machine's moment)."""
    monkeypatch.setattr(plan_module, "time_calls", lambda fns, device, repeats: [1.0, 2.0])
    monkeypatch.setattr(plan_module, "time_in_turns", _rounds_timer(((1.0, 2.0), (1.0, 2.0), (1.0, 2.0))))
    torch.manual_seed(0)
    model = Tower().double()
    twin = Tower().double()
    twin.load_state_dict(model.state_dict())
    sgd, twin_sgd = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, twin))
    batches = [torch.randn(64, 32, dtype=torch.float64) for _ in range(2)]
    plan = magis.optimize(
        model, (batches[0],), mse, optimizer=sgd, memory_limit=0.9, compile=True,
        device="h200", time_budget=10.0, max_states=6, progress=False,
    )  # fmt: skip
    for x in batches:
        loss = plan(x)
        expected = mse(twin(x))
        expected.backward()
        twin_sgd.step()
        twin_sgd.zero_grad()
        torch.testing.assert_close(loss, expected, rtol=1e-10, atol=0)
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-12)
    runtime = plan.report().runtime
    assert runtime["whole_step"]["compiled_s"] == 1.0 and runtime["whole_step"]["generated_s"] == 2.0
    assert runtime["whole_step"]["ratio"] == 0.5 and runtime["whole_step"]["ratio_error"] == 0.0
    assert runtime["whole_step"]["kept_compiled"] == (runtime["segments"] > 0)
    assert (runtime["whole_step"]["why_not_kept"] is None) == runtime["whole_step"]["kept_compiled"]


def test_the_trials_of_a_timed_compiled_plan_leave_the_callers_random_stream_to_its_dropout(
    monkeypatch: pytest.MonkeyPatch,
):
    """The first call of a timed compiled plan tries its segments and its whole step on random
    inputs and runs the step's random ops; the caller's generators and the model's own are left
    as they were, so the step's dropout and noise under the caller's seeds draw eager's numbers
    (the trials drew from them: a user's convnet with ``Dropout2d`` took a loss 0.2% off eager's
    at its first step, and trained apart from there)."""
    monkeypatch.setattr(plan_module, "time_calls", lambda fns, device, repeats: [1.0, 2.0])
    monkeypatch.setattr(plan_module, "time_in_turns", _rounds_timer(((1.0, 2.0), (1.0, 2.0), (1.0, 2.0))))
    torch.manual_seed(0)
    noise = OwnNoise()
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.3), noise, nn.Linear(64, 1)).double()
    x = torch.randn(64, 32, dtype=torch.float64)
    plan = magis.optimize(model, (x,), mse, compile=True, device="h200", max_states=6, progress=False)
    torch.manual_seed(7), noise.generator.manual_seed(8)
    loss = plan(x)
    assert plan.report().runtime["segments"] > 0  # trials ran, each on random inputs
    torch.manual_seed(7), noise.generator.manual_seed(8)
    torch.testing.assert_close(loss, mse(model(x)), rtol=1e-12, atol=0)


class OwnNoise(nn.Module):
    """Noise from the module's own generator, which the whole-step trial's runs draw from too."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn(x.shape, generator=self.generator, dtype=x.dtype)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
)
def test_a_whole_step_trial_meters_the_allocator_of_the_device_its_inputs_live_on(device: str):
    """A whole step's inputs reach its trial as one mapping (the step's environment): its peaks
    are that device's allocator's. On CUDA they were read by the CPU's allocator, which saw
    nothing of the step: the whole step's memory check passed whatever it held."""
    env = {"x": torch.randn(512, 512, device=device)}

    def step(args: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return (args[0]["x"] @ args[0]["x"]).sum()  # a 1 MiB product, freed before it returns

    trial = Trial.metered(step, step, [env], 1.0, 2.0)
    assert trial.compiled_peak >= 2**20 and trial.ops_peak >= 2**20


def test_a_whole_steps_trial_allows_its_kernels_scratch_only_as_a_share_of_its_peak():
    """Tiny U-Net's plan at 0.8 with its seven segments compiled allocated 32 KiB above its
    generated code (1.7% of its peak): within :data:`KERNEL_SCRATCH`, so the whole step was kept
    and measured over its plan's peak. A whole step's scratch is a share of its peak."""
    env = {"x": torch.randn(256, 256, dtype=torch.float64)}  # its product: 512 KiB

    def ops(args: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return (args[0]["x"] @ args[0]["x"]).sum()

    def holding(extra_bytes: int) -> Callable[[list[dict[str, torch.Tensor]]], torch.Tensor]:
        def compiled(args: list[dict[str, torch.Tensor]]) -> torch.Tensor:
            product, scratch = args[0]["x"] @ args[0]["x"], torch.empty(extra_bytes, dtype=torch.uint8)
            return product.sum() + 0 * scratch[:1].sum()

        return compiled

    for extra, kept in ((2**10, True), (24 * 2**10, False)):  # 0.2% and 4.7% of the product
        trial = Trial.metered(holding(extra), ops, [env], 1.0, 2.0, scratch_share=STEP_SCRATCH_SHARE)
        assert trial.compiled_wins == kept, (extra, trial)
        assert Trial.metered(holding(extra), ops, [env], 1.0, 2.0).compiled_wins  # a segment's allowance


def test_a_trial_keeps_the_compiled_segment_only_where_it_wins_on_time_and_memory():
    faster = Trial(compiled_s=1.0, ops_s=2.0, compiled_peak=10, ops_peak=10, compiled_held=5, ops_held=5)
    assert faster.compiled_wins
    assert not replace(faster, compiled_s=2.0).compiled_wins  # a tie keeps eager's kernels
    # a kernel's own scratch (the allocator's meter counts it) is not a tensor the plan holds
    assert replace(faster, compiled_peak=10 + KERNEL_SCRATCH).compiled_wins
    assert not replace(faster, compiled_peak=11 + KERNEL_SCRATCH).compiled_wins
    assert not replace(faster, compiled_held=6).compiled_wins  # an output viewing a larger buffer
    assert not replace(faster, same_layouts=False).compiled_wins  # the ops after it would read other layouts
    # timed in paired rounds (a whole step): faster by more than the rounds' standard error
    assert replace(faster, compiled_s=3.0, ratio=0.95, ratio_error=0.02).compiled_wins
    assert not replace(faster, ratio=0.99, ratio_error=0.02).compiled_wins
    # and says why it lost, the first reason
    assert faster.why_not_compiled is None
    assert "not faster" in replace(faster, compiled_s=2.0).why_not_compiled
    assert "not clearly faster (0.990 +- 0.020" in replace(faster, ratio=0.99, ratio_error=0.02).why_not_compiled
    assert "allocates 65537 bytes more" in replace(faster, compiled_peak=11 + KERNEL_SCRATCH).why_not_compiled
    assert "hold 1 bytes more" in replace(faster, compiled_held=6).why_not_compiled
    assert "other layouts" in replace(faster, same_layouts=False, compiled_s=2.0).why_not_compiled
