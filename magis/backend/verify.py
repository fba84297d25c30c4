"""The captured step against eager PyTorch: the same batch, the same seed, the same state.

docs/design.md: "A capture that differs from eager is refused before it is planned,
never run." :func:`run_both` runs one eager step (:func:`~magis.backend.eager.eager_step`)
and the captured graph from the same random state and the same buffers, and leaves
the model as it found them: buffers, ``.grad`` and the caller's generators.
:func:`verify_capture` compares the loss, every gradient and every buffer update
within the step's precision (:data:`~magis.backend.eager.GRADIENT_TOLERANCE`) and
raises :class:`CaptureMismatch` naming the largest difference and what is suspected.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from magis.backend.codegen import runs_compiled_code
from magis.backend.eager import (
    GRADIENT_TOLERANCE,
    NOISE_FLOOR,
    GradientComparison,
    buffers_snapshot,
    compare_gradients,
    eager_forward,
    eager_step,
    restore_buffers,
    slice_batch,
)
from magis.backend.meter import peak_meter
from magis.backend.runtime import Runtime, StepResult, StepRunner, run_step
from magis.frontend.capture import capture, capture_forward, forked_generators, model_generators
from magis.frontend.conditions import autocast_off, autocast_state
from magis.frontend.fx_graph import draws_random_numbers
from magis.frontend.step import BatchSpec, CaptureError, UserStep, as_batch
from magis.ir.graph import Graph, Role


class CaptureMismatch(CaptureError):
    """The captured step computes another loss, gradients or buffer updates than eager
    PyTorch on the same batch and seed: it is refused, never planned. The message names
    the largest difference and what is suspected."""


@dataclass(frozen=True)
class Verification:
    """Whether the captured step was checked against eager, and what was found (or why not)."""

    verified: bool
    note: str


@dataclass
class BothSteps:
    """One eager step and one run of the graph, from the same state and seed."""

    reference: StepResult  # eager's loss and gradients
    result: StepResult  # the graph's, its buffer updates included
    buffers_before: dict[str, torch.Tensor]
    buffers_after: dict[str, torch.Tensor]  # eager's buffers after its step
    eager_peak_bytes: int = 0
    measured_peak_bytes: int = 0


def run_both(
    graph: Graph,
    order: Sequence[str] | None,
    model: torch.nn.Module,
    batch: Any,
    step: UserStep,
    seed: int = 0,
    measure: bool = False,
    runtime: Runtime | StepRunner = "generated",
) -> BothSteps:
    """Eager's step, then ``graph`` in ``order`` (autocast off: it holds its casts) run as
    ``runtime`` says (:func:`~magis.backend.runtime.run_program`), each from ``seed`` and the
    same buffers, with ``measure`` each measured (:func:`~magis.backend.meter.peak_meter`; for
    a step with compiled segments both by the allocator, kernels' scratch included);
    the model's buffers, ``.grad`` and the generators are as before afterwards. For an
    inference graph (:attr:`~magis.ir.graph.Signature.inference`) eager's step is the forward
    alone (:func:`~magis.backend.eager.eager_forward`) and ``step`` is not used."""
    inputs = BatchSpec.of(batch).tensors(batch)
    constants = [n.target.value for n in graph.nodes if n.role is Role.CONSTANT]
    # a compiled step's buffers are seen by its allocator only: eager is then metered so too
    compiled = runs_compiled_code(runtime)
    with _model_kept(model) as before, forked_rng(model):
        # forked again: the graph draws from the model's own generators where eager's run began
        with forked_rng(model), peak_meter(model, inputs, compiled) if measure else _Unmeasured() as eager_meter:
            torch.manual_seed(seed)
            reference = _eager_reference(graph, model, batch, step)
        after = buffers_snapshot(model)
        restore_buffers(model, before)
        with peak_meter(model, [*inputs, *constants], compiled) if measure else _Unmeasured() as meter, autocast_off():
            torch.manual_seed(seed)
            result = run_step(graph, model, inputs, order, apply_buffer_updates=False, runtime=runtime)
    return BothSteps(reference, result, before, after, eager_meter.peak_bytes, meter.peak_bytes)


def _eager_reference(graph: Graph, model: torch.nn.Module, batch: Any, step: UserStep) -> StepResult:
    """Eager's run of what ``graph`` captured: the training step, or the forward alone."""
    if graph.signature.inference:
        return eager_forward(model, batch)
    return eager_step(model, batch, step.loss_fn, training_step=step.training_step)


def step_precision(model: torch.nn.Module, graph: Graph | None = None) -> torch.dtype:
    """The narrowest floating dtype the step computes in: its trainable parameters', autocast's
    on the model's device, or any ``graph`` computes (autocast entered inside the user's step)."""
    params = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    dtypes = {p.dtype for p in params}
    device = params[0].device.type if params else "cpu"
    dtypes |= {dtype for kind, dtype in autocast_state() if kind == device and dtype is not None}
    if graph is not None:
        dtypes |= {m.dtype for n in graph.nodes for m in n.outputs if m is not None and m.dtype.is_floating_point}
    return min(dtypes or {torch.float32}, key=lambda dtype: (dtype.itemsize, dtype != torch.bfloat16))


def compare_steps(
    both: BothSteps, precision: torch.dtype, noise_floor: float | None = None
) -> tuple[float, GradientComparison]:
    """The loss's relative difference, and every gradient, every output (an inference's, or
    what a training step returns beside its loss) and every buffer eager or the graph
    changed, the graph's against eager's (:func:`~magis.backend.eager.compare_gradients`;
    ``noise_floor`` the precision's unless given: 1 measures every difference against the
    largest value of all)."""
    if both.reference.loss is None:
        loss = 0.0
    else:
        loss = compare_gradients({"loss": both.reference.loss}, {"loss": both.result.loss}).max_error
    reference, other = dict(both.reference.gradients), dict(both.result.gradients)
    if both.reference.outputs:  # none where eager ran in micro-batches
        reference.update({f"output {i}": _as_float(t) for i, t in enumerate(both.reference.outputs)})
        other.update({f"output {i}": _as_float(t) for i, t in enumerate(both.result.outputs)})
    for name, value in both.buffers_after.items():
        if not torch.equal(value, both.buffers_before[name]) or name in both.result.buffer_updates:
            reference[f"buffer {name}"] = value
            other[f"buffer {name}"] = both.result.buffer_updates.get(name, both.buffers_before[name])
    floor = NOISE_FLOOR.get(precision, 1e-6) if noise_floor is None else noise_floor
    return loss, compare_gradients(reference, other, floor)


def _as_float(tensor: torch.Tensor) -> torch.Tensor:
    """An output as compared: an integer or boolean one (a prediction, a hit) in float64."""
    return tensor if tensor.is_floating_point() or tensor.is_complex() else tensor.double()


def verify_capture(graph: Graph, model: torch.nn.Module, batch: Any, step: UserStep, seed: int = 0) -> Verification:
    """Check ``graph`` against eager on ``batch`` (module docstring): the verification, or
    :class:`CaptureMismatch`.

    On CUDA both steps run without TF32 (:func:`exact_float32`), and a difference is allowed
    up to :data:`EAGER_NOISE_MARGIN` times eager's own from one run to the next (atomic adds
    in a convolution's backward make it nondeterministic; a gradient whose terms cancel, a
    convolution bias before batch norm, turns that noise into large relative differences)."""
    precision = step_precision(model, graph)
    tolerance = GRADIENT_TOLERANCE.get(precision, GRADIENT_TOLERANCE[torch.float32])
    with exact_float32(model):
        both = run_both(graph, None, model, batch, step, seed)
        loss, comparison = compare_steps(both, precision)
        largest = _largest(loss, comparison)
        noise = truth = None
        if comparison.same_names and largest > tolerance and on_cuda(model):
            noise = compare_steps(_against_eager_again(graph, model, batch, step, seed, both), precision)
        if comparison.same_names and largest > tolerance and precision is not torch.float64:
            truth = _against_float64(graph, model, batch, step, seed, both, precision, tolerance)
    inference = graph.signature.inference
    what = "outputs and buffer updates" if inference else "loss, gradients and buffer updates"
    if comparison.same_names and largest <= tolerance:
        return Verification(
            True,
            f"{what} equal eager PyTorch's within {tolerance:g} ({precision}; "
            f"largest relative difference {largest:.2g})",
        )
    if noise is not None and _within_noise(loss, comparison, *noise, tolerance):
        return Verification(
            True,
            f"{what} equal eager PyTorch's within {tolerance:g} ({precision}) or within {EAGER_NOISE_MARGIN:g} "
            f"times eager's own difference from one run to the next on CUDA (largest relative difference "
            f"{largest:.2g}, eager's own up to {_largest(*noise):.2g})",
        )
    if truth is not None and _as_near_as_eager(*truth, tolerance):
        return Verification(
            True,
            f"{what} equal eager PyTorch's within {tolerance:g} ({precision}) or are as near the same step run in "
            f"float64 as eager's, within {FLOAT64_MARGIN:g} times eager's distance to it (largest relative "
            f"difference to eager's {largest:.2g}; to float64's: eager's up to {_largest(*truth[0]):.2g}, "
            f"the graph's {_largest(*truth[1]):.2g})",
        )
    broken = not_finite(both.reference)
    if broken is not None:
        raise CaptureError(
            f"eager PyTorch's own {broken} is not finite on the example batch, so there is nothing to check the "
            "captured step against (and nothing worth planning): run the step eagerly and fix the model, its "
            "precision or the batch first; optimize(..., verify=False) plans it anyway"
        )
    found = [] if inference else [f"the loss differs by {loss:.3g} (relative)"]
    if comparison.worst is not None:
        kind = "output" if inference else "gradient"
        found.append(f"the largest {kind} difference is at {comparison.worst} ({comparison.max_error:.3g} relative)")
    if not comparison.same_names:
        found.append(comparison.describe())
    raise CaptureMismatch(
        f"the captured {'forward' if inference else 'training step'} differs from eager PyTorch's on the example batch "
        f"(tolerance {tolerance:g} in {precision}): {'; '.join(found)}. "
        f"Suspected: {_suspect(graph, model, batch, step, comparison)}. Nothing was planned; "
        "optimize(..., verify=False) plans it anyway (at your own risk)"
    )


def not_finite(result: StepResult) -> str | None:
    """What of a step's results holds a NaN or an infinity (``"loss"``, ``"gradient of NAME"``,
    ``"output I"``), or None."""
    named = [("loss", result.loss)] if result.loss is not None else []
    named += [(f"gradient of {name}", grad) for name, grad in result.gradients.items()]
    named += [(f"output {i}", out) for i, out in enumerate(result.outputs)]
    for what, tensor in named:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            return what
    return None


#: on CUDA, how many times eager's own run-to-run difference the captured step may differ by
EAGER_NOISE_MARGIN = 10.0


def on_cuda(model: torch.nn.Module) -> bool:
    return any(p.is_cuda for p in model.parameters())


@contextlib.contextmanager
def exact_float32(model: torch.nn.Module) -> Iterator[None]:
    """On CUDA, float32 matmuls and convolutions without TF32 inside the block: TF32 keeps 10
    bits of mantissa, so its rounding, not the capture, would decide a comparison."""
    if not on_cuda(model):
        yield
        return
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul


def _against_eager_again(
    graph: Graph, model: torch.nn.Module, batch: Any, step: UserStep, seed: int, both: BothSteps
) -> BothSteps:
    """Eager's step run once more from the same seed and buffers, beside the first: eager's own
    run-to-run difference, to set beside the captured step's."""
    with _model_kept(model), forked_rng(model):
        torch.manual_seed(seed)
        again = _eager_reference(graph, model, batch, step)
        after = buffers_snapshot(model)
    result = StepResult(again.loss, again.gradients, after, again.outputs)
    return BothSteps(both.reference, result, both.buffers_before, both.buffers_after)


def _against_float64(
    graph: Graph,
    model: torch.nn.Module,
    batch: Any,
    step: UserStep,
    seed: int,
    both: BothSteps,
    precision: torch.dtype,
    tolerance: float,
) -> tuple[tuple[float, GradientComparison], tuple[float, GradientComparison]] | None:
    """Eager's and the graph's distance to eager's step on a float64 copy of the model and
    batch (autocast leaves float64 alone): ``(eager's, the graph's)``, each as
    :func:`compare_steps` gives it. Rounding alone can make two correct steps differ by far more
    than the precision's tolerance where a gradient's exact value is zero (a convolution's
    bias before batch norm); beside the exact values a capture is judged as eager is
    (torch._dynamo's accuracy check does the same).

    None where the float64 run is not the same step: it fails (a dtype the step fixes,
    memory), eager differs from it by more than the tolerance measured against the largest
    gradient of all (other random draws), or the step draws random numbers on CUDA (whose
    dropout kernels draw per dtype)."""
    if on_cuda(model) and any(node.random for node in graph.nodes):
        return None
    free = free_device_bytes(model) if on_cuda(model) else _free_host_bytes()
    if free is not None and FLOAT64_COPIES * _float64_bytes(model) > free:
        return None
    try:
        with forked_rng(model):
            wide = copy.deepcopy(model).double()
            wide_batch = pytree.tree_map(lambda x: x.double() if _is_float_tensor(x) else x, batch)
            before = buffers_snapshot(wide)
            torch.manual_seed(seed)
            exact = _eager_reference(graph, wide, wide_batch, step)
            after = buffers_snapshot(wide)
    except Exception:  # the step does not run in float64: no such check
        return None
    truth = StepResult(exact.loss, exact.gradients, after, exact.outputs)
    eager = BothSteps(
        truth,
        StepResult(both.reference.loss, both.reference.gradients, both.buffers_after, both.reference.outputs),
        before,
        after,
    )
    loss, overall = compare_steps(eager, precision, noise_floor=1.0)
    if not overall.same_names or not _largest(loss, overall) <= tolerance:
        return None
    return compare_steps(eager, precision), compare_steps(BothSteps(truth, both.result, before, after), precision)


#: how many times eager's distance to the float64 step the graph's may be (torch._dynamo's
#: accuracy check allows twice, and a tenth of the tolerance besides)
FLOAT64_MARGIN = 2.0


def _as_near_as_eager(
    eager: tuple[float, GradientComparison], graph: tuple[float, GradientComparison], tolerance: float
) -> bool:
    """Whether the graph's loss and each of its gradients are as near the float64 step's as
    eager's are (:data:`FLOAT64_MARGIN`, plus a tenth of ``tolerance``), or, for a gradient
    whose float64 value is zero at round-off level (a convolution's bias before instance
    norm), within that round-off level of it (the noise floor): both steps' values are then
    rounding alone, and which of the two lands nearer zero is chance."""
    (eager_loss, eager_errors), (graph_loss, graph_errors) = eager, graph
    if not graph_loss <= FLOAT64_MARGIN * eager_loss + tolerance / 10:  # a NaN fails
        return False
    return all(
        error <= FLOAT64_MARGIN * eager_errors.errors.get(name, 0.0) + tolerance / 10
        or (name in graph_errors.at_floor and error <= 1.0)
        for name, error in graph_errors.errors.items()
    )


#: how many float64 copies of the model's weights the float64 check must find free (weights,
#: gradients, the optimizer-free step's activations at least as large again): else it is skipped
FLOAT64_COPIES = 4


def _float64_bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * (8 if t.is_floating_point() else t.element_size()) for t in tensors)


def _free_host_bytes() -> int | None:
    """The host's available memory where the OS says (Linux), else None."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _largest(loss: float, comparison: GradientComparison) -> float:
    """The larger of the two differences, NaN where either is (``max`` would drop a NaN met second)."""
    if math.isnan(loss) or math.isnan(comparison.max_error):
        return math.nan
    return max(loss, comparison.max_error)


def _is_float_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _within_noise(
    loss: float, comparison: GradientComparison, noise_loss: float, noise: GradientComparison, tolerance: float
) -> bool:
    """Whether the loss and each gradient differ by at most the tolerance or
    :data:`EAGER_NOISE_MARGIN` times eager's own difference for the same name."""
    if not loss <= max(tolerance, EAGER_NOISE_MARGIN * noise_loss):  # a NaN fails
        return False
    return all(
        error <= max(tolerance, EAGER_NOISE_MARGIN * noise.errors.get(name, 0.0))
        for name, error in comparison.errors.items()
    )


def verify_step(
    graph: Graph, transient_bytes: int, model: torch.nn.Module, batch: Any, step: UserStep, seed: int = 0
) -> Verification:
    """:func:`verify_capture` on the example batch, or, where the device's free memory would
    not hold a step of ``transient_bytes`` (the captured step's peak beyond its resident
    tensors) twice over (eager's, then the graph's beside eager's gradients), on its first
    samples, as many as fit: that slice's step is captured and checked."""
    free = free_device_bytes(model)
    rows = _rows(batch)
    if free is None or rows is None or 2 * transient_bytes <= free:
        return verify_capture(graph, model, batch, step, seed)
    fit = min(rows - 1, rows * free // (2 * transient_bytes))
    if fit < 1:
        return Verification(False, "not checked: even one sample's eager step would not fit in the free device memory")
    part = slice_batch(as_batch(batch), 0, fit)
    sliced = (
        capture_forward(model, part).graph
        if graph.signature.inference
        else capture(model, part, step.loss_fn, training_step=step.training_step)
    )
    checked = verify_capture(sliced, model, part, step, seed)
    return Verification(True, f"on the first {fit} of {rows} samples (the whole step would not fit): {checked.note}")


def free_device_bytes(model: torch.nn.Module) -> int | None:
    """The free memory of the CUDA device the model lives on; None off CUDA (host memory is not checked)."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(param.device)[0])


def _rows(batch: Any) -> int | None:
    """The batch's size: the first dimension of its first tensor that has dimensions."""
    tensors = [x for x in pytree.tree_leaves(as_batch(batch)) if isinstance(x, torch.Tensor) and x.dim()]
    return int(tensors[0].shape[0]) if tensors else None


def _suspect(graph: Graph, model: torch.nn.Module, batch: Any, step: UserStep, comparison: GradientComparison) -> str:
    drawn = eager_random_draws(graph, model, batch, step)
    in_graph = sum(n.random for n in graph.nodes)
    if in_graph < drawn:
        return (
            f"the model draws random numbers (dropout) that the captured graph lacks: eager draws {_times(drawn)}, "
            f"the graph {_times(in_graph)} (a random op hidden from tracing, e.g. behind "
            "torch.compiler.is_compiling(), or dropped by a decomposition)"
        )
    if in_graph > drawn:
        return f"the captured graph draws random numbers {_times(in_graph)}, eager {_times(drawn)}"
    if comparison.worst is not None and comparison.worst.startswith("buffer "):
        return (
            f"a buffer is updated otherwise than eager does ({comparison.worst}): the train/eval mode of a "
            "normalization, or a buffer the forward changes in a way the graph does not record"
        )
    return (
        "the forward depends on something the graph cannot hold: Python state that changes from call to "
        "call (a counter, a cache), a branch on a tensor's value, or an op computed at another precision"
    )


def eager_random_draws(graph: Graph, model: torch.nn.Module, batch: Any, step: UserStep) -> int:
    """How many random ops one eager run of what ``graph`` captured makes (the model left as it was)."""
    counter = _RandomDraws()
    with _model_kept(model), forked_rng(model), counter:
        _eager_reference(graph, model, batch, step)
    return counter.draws


def _times(n: int) -> str:
    return {0: "never", 1: "once"}.get(n, f"{n} times")


class _RandomDraws(TorchDispatchMode):
    """Counts the ops that read torch's generator (the predicate the capture marks ``random`` with)."""

    def __init__(self) -> None:
        super().__init__()
        self.draws = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.draws += draws_random_numbers(func, args, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _model_kept(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """The model's buffers (yielded: a copy) and ``.grad`` as they were, put back after the block."""
    grads = {p: p.grad for p in model.parameters()}
    before = buffers_snapshot(model)
    try:
        yield before
    finally:
        restore_buffers(model, before)
        for p, grad in grads.items():
            p.grad = grad


class _Unmeasured:
    """A meter that measures nothing (a check needs no peaks)."""

    peak_bytes = 0

    def __enter__(self) -> _Unmeasured:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@contextlib.contextmanager
def forked_rng(model: torch.nn.Module) -> Iterator[None]:
    """The generators of the CPU and of the model's CUDA devices, and the model's own
    (:func:`~magis.frontend.capture.model_generators`), restored afterwards."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with forked_generators(model_generators(model), devices):
        yield
