"""The reference: a plain eager PyTorch training step (or forward), as a user would write it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from magis.backend.runtime import StepResult
from magis.frontend.step import LossFn, TrainingStep, UserStep, as_batch


def eager_step(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    micro_batches: int = 1,
    *,
    training_step: TrainingStep | None = None,
) -> StepResult:
    """``zero_grad(set_to_none)``, forward, loss, backward; gradients are detached from ``.grad``,
    and the tensors the step returns beside its loss are the result's ``outputs`` (detached;
    none with micro-batches).

    The step is the user's (:class:`~magis.frontend.step.UserStep`): ``loss_fn(model(*batch))``
    or ``training_step(model, *batch)``, a mapping passed as keyword arguments.

    With ``micro_batches = k > 1``, gradient accumulation as transformers' ``Trainer``
    does it (``gradient_accumulation_steps``): the batch is split into ``k`` equal
    micro-batches (:func:`split_batch`), each runs forward and ``backward()`` of its
    mean loss times ``1/k``, the gradients adding up in ``.grad``; the loss returned is
    the sum of the scaled losses. That is the full batch's gradient when the loss is a
    mean over equally many terms per micro-batch and nothing else couples samples.
    Between micro-batches, ``.grad`` tensors that share memory are made apart
    (:func:`separate_shared_gradients`).
    """
    step = UserStep(loss_fn, training_step)
    for p in model.parameters():
        p.grad = None
    total = None
    outputs: tuple[torch.Tensor, ...] = ()
    for i, part in enumerate(split_batch(batch, micro_batches)):
        if i:
            separate_shared_gradients(model)
        loss, others, _ = step.returned(model, as_batch(part))
        if micro_batches == 1:
            outputs = tuple(other.detach() for other in others)
        if micro_batches > 1:
            loss = loss / micro_batches
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
        del loss
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    assert total is not None
    return StepResult(total, grads, {}, outputs)


def eager_forward(model: torch.nn.Module, batch: Any) -> StepResult:
    """The model's forward on ``batch`` without gradients, as an inference step runs it: its
    output's tensors (flattened, :func:`torch.utils._pytree.tree_flatten`, without its ``None`` s)
    as ``outputs``."""
    with torch.no_grad():
        output = UserStep.output(model, as_batch(batch))
    return StepResult(None, {}, {}, tuple(leaf for leaf in pytree.tree_leaves(output) if leaf is not None))


def separate_shared_gradients(model: torch.nn.Module) -> None:
    """Copy each ``.grad`` that shares its storage with a larger one, so that adding into one
    no longer adds into the other.

    A compiled backward may return two parameters' gradients in one storage (ViT at
    micro-batch 1 under ``torch.compile``, inductor and aot_eager alike, torch 2.13: the
    class token's gradient is a slice of the position embeddings'). ``AccumulateGrad``
    keeps the first micro-batch's gradient as ``.grad`` itself, so every later micro-batch
    would be added into both (measured on ViT small: 1.97 where eager's gradient is 1.05).
    Eager PyTorch's ``.grad`` tensors never share storage; there this does nothing. The
    copies are the smaller tensors, made while the step holds little more than ``.grad``
    (the simulation of accumulation leaves them out: on ViT tiny it stays within 4 bytes).
    """
    by_storage: dict[int, list[torch.nn.Parameter]] = {}
    for p in model.parameters():
        if p.grad is not None:
            by_storage.setdefault(p.grad.untyped_storage().data_ptr(), []).append(p)
    for sharing in by_storage.values():
        for p in sorted(sharing, key=lambda q: q.grad.numel(), reverse=True)[1:]:
            p.grad = p.grad.clone()


def split_batch(batch: Any, micro_batches: int) -> list:
    """The batch as ``micro_batches`` equal micro-batches along the first dimension of every tensor (views),
    each of the batch's form (a tuple for positional arguments).

    Raises ValueError when the tensors disagree on the batch size or ``micro_batches``
    does not divide it.
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches}")
    batch = as_batch(batch)
    if micro_batches == 1:
        return [batch]
    sizes = {x.shape[0] for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor) and x.dim()}
    if len(sizes) != 1:
        raise ValueError(f"cannot split into micro-batches: the input tensors' first dimensions differ ({sizes})")
    (whole,) = sizes
    if whole % micro_batches:
        raise ValueError(f"{micro_batches} micro-batches do not divide the batch of {whole}")
    size = whole // micro_batches
    return [slice_batch(batch, i * size, (i + 1) * size) for i in range(micro_batches)]


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """``batch`` with every tensor that has dimensions cut to ``[start:stop]`` along the first (views)."""
    return pytree.tree_map(lambda x: x[start:stop] if isinstance(x, torch.Tensor) and x.dim() else x, batch)


def buffers_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every buffer, to run two steps from the same state."""
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def restore_buffers(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(snapshot[k])


class GradientMismatch(ValueError):
    """Two steps produced gradients for different parameters (the message names them)."""


#: largest relative gradient difference to a reference that still counts as equal, per dtype:
#: in float64 a tensor near the noise floor of compare_gradients reads round-off as up to
#: ~1e-7; in float32 summation orders differ by up to 5e-4 (diffusers' VAE, ViT's gradients
#: summed over two micro-batches); under bfloat16 autocast one rounding of a gradient is
#: up to 0.8% (CPU's captured dropout backward scales by the float scale where eager's
#: scales by the bf16 one: a small transformer's gradients differ by up to 1.4%)
GRADIENT_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
#: compare_gradients' noise floor per dtype: a gradient whose exact value is zero (a key
#: bias under softmax) reads as round-off of the step's precision
NOISE_FLOOR = {torch.float64: 1e-6, torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}


@dataclass(frozen=True)
class GradientComparison:
    """How one step's gradients differ from a reference step's.

    ``missing``: names with a reference gradient but none here (a parameter that would
    never be trained); ``extra``: the reverse. ``max_error`` is over the common names,
    ``worst`` the name it was found at (None when nothing differs).
    """

    max_error: float
    missing: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    worst: str | None = None
    errors: dict[str, float] = field(default_factory=dict)  # each common name's relative difference
    #: the common names whose reference is at round-off level (measured against the noise floor)
    at_floor: frozenset[str] = frozenset()

    @property
    def same_names(self) -> bool:
        return not self.missing and not self.extra

    def describe(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"no gradient for {', '.join(self.missing)}")
        if self.extra:
            parts.append(f"a gradient eager PyTorch does not compute for {', '.join(self.extra)}")
        return "; ".join(parts) or f"largest relative difference {self.max_error:.2g}"


def compare_gradients(
    reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor], noise_floor: float = 1e-6
) -> GradientComparison:
    """Largest ``max|a-b| / max|a|`` over the names both have, and the names only one has.

    A tensor whose reference is at float round-off level (below ``noise_floor`` times
    the largest reference magnitude, e.g. a key bias under softmax, whose exact
    gradient is zero) is scaled by that floor instead, so rounding noise does not read
    as a large relative error.
    """
    largest = max((t.detach().abs().max().item() for t in reference.values() if t.numel()), default=0.0)
    floor = max(noise_floor * largest, 1e-30)
    worst, worst_name = 0.0, None
    errors: dict[str, float] = {}
    at_floor = set()
    for k, ref in reference.items():
        if k not in other or not ref.numel():
            continue
        ref = ref.detach().double()
        diff = (other[k].detach().double() - ref).abs().max().item()
        magnitude = ref.abs().max().item()
        if magnitude < floor:
            at_floor.add(k)
        errors[k] = error = diff / max(magnitude, floor)
        if error > worst or error != error:  # a NaN is the worst of all
            worst, worst_name = error, k
    return GradientComparison(
        worst,
        tuple(sorted(set(reference) - set(other))),
        tuple(sorted(set(other) - set(reference))),
        worst_name,
        errors,
        frozenset(at_floor),
    )


def max_relative_error(
    reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor], noise_floor: float = 1e-6
) -> float:
    """:func:`compare_gradients`' largest relative difference (0 when all equal).

    Raises :class:`GradientMismatch` naming the parameters when the two steps have
    gradients for different parameters: no number measures a lost gradient.
    """
    comparison = compare_gradients(reference, other, noise_floor)
    if not comparison.same_names:
        raise GradientMismatch(comparison.describe())
    return comparison.max_error
