"""The registry of methods: :class:`Method`, :data:`METHODS`, :func:`register`, and :func:`variants`, the rows
of a comparison.

A method gives, for a :class:`~yardstick.methods.subject.Subject`, a real step (:class:`Runnable`)
and a simulated one (:data:`Simulated`); a :class:`Variant` is a method at one budget, latency
limit or micro-batch count. The families of :mod:`yardstick.methods` register their methods here.

A method is a training step without its optimizer (forward, loss, backward: the gradients are its
result, checked against eager's) or, :attr:`Method.full_step`, with it: the optimizer's update
after or inside the backward, compared against :data:`FULL_STEP_REFERENCE`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from magis.ir.graph import Graph
from magis.models import Built
from yardstick.methods.subject import Subject
from yardstick.peers.partitioned_capture import check_budget
from yardstick.protocol import Step

#: what ``simulate`` returns: a graph and the order of its nodes the method runs
Simulated = tuple[Graph, Sequence[str]]

PEER = "peer"
MAGIS = "magis"
#: the device profile simulated figures are priced on by default, and the baselines' planners plan for
DEFAULT_DEVICE = "h200"
REFERENCE = "eager"
#: the reference of a comparison of full steps (:attr:`Method.full_step`): eager's
#: ``loss.backward(); optimizer.step()`` (:mod:`yardstick.methods.full_step`)
FULL_STEP_REFERENCE = "eager+step"
DEFAULT_BUDGETS = (1.0, 0.5, 0.1)
#: the latency limits of latency-limited methods: MAGIS Fig. 9's 5% and 10% overheads
LATENCY_LIMITS = (1.05, 1.10)
#: the prefix of the micro-batched methods' names
ACCUMULATE = "accumulate"


class MethodUnavailable(RuntimeError):
    """A registered method cannot run in this installation (the message says why)."""


@dataclass(frozen=True)
class Runnable:
    """A method's real step, and the build it runs: its weights, buffers and inputs are resident memory."""

    step: Step
    built: Built
    #: why its gradients are not the full batch's (accumulation), ``None`` when they must equal eager's
    gradient_note: str | None = None
    #: tensors resident besides the build's weights, buffers and inputs: a full step's optimizer states
    resident: tuple[torch.Tensor, ...] = ()
    #: the gradients the step's first run used, read after it (a full step consumes its gradients:
    #: its optimizer's states tell them); ``None``: the gradients its result returns
    used_gradients: Callable[[], dict[str, torch.Tensor]] | None = None
    #: whether the step runs code Inductor compiled, whose buffers are allocated below the
    #: dispatcher, out of the live-tensor meter's sight: the allocator's meter measures it
    compiled: bool = False


@dataclass(frozen=True)
class Method:
    """A way to run a training step, for real and as a graph for the simulator."""

    name: str
    description: str
    kind: str  # PEER or MAGIS
    real: Callable[[Subject, float | None], Runnable]
    simulate: Callable[[Subject, float | None], Simulated]
    budgeted: bool = False  # runs once per activation memory budget
    #: runs once per latency limit (a ratio to the captured step's simulated latency), not per budget
    latency_limits: tuple[float, ...] = ()
    micro_batched: bool = False  # runs once per micro-batch count k > 1 dividing the batch (accumulation)
    #: facts of a variant's plan for its row (solver status, solve time...), ``None``: none
    details: Callable[[Subject, float | None], dict[str, Any]] | None = None
    #: left out of the default method set: runs only when named (an optional package's peer)
    opt_in: bool = False
    #: the step holds the optimizer's update (:mod:`yardstick.methods.full_step`), not only the backward
    full_step: bool = False


@dataclass(frozen=True)
class Variant:
    """A method at one budget (``None`` for a method without one) and micro-batch count: one row of a comparison."""

    method: Method
    budget: float | None = None
    micro_batches: int | None = None  # micro-batched methods only

    @property
    def name(self) -> str:
        name = self.method.name
        if self.micro_batches is not None:
            name = name.replace(ACCUMULATE, f"{ACCUMULATE}@{self.micro_batches}", 1)
        return name if self.budget is None else f"{name}@{self.budget:g}"

    def subject(self, subject: Subject) -> Subject:
        """The subject this variant runs on: ``subject``, or its accumulating version."""
        return subject if self.micro_batches is None else subject.accumulating(self.micro_batches)

    def real(self, subject: Subject) -> Runnable:
        """The variant's step on ``subject``, run for real."""
        return self.method.real(self.subject(subject), self.budget)

    def simulate(self, subject: Subject) -> Simulated:
        """The variant's graph and order on ``subject``, for the simulator."""
        return self.method.simulate(self.subject(subject), self.budget)

    def details(self, subject: Subject) -> dict[str, Any] | None:
        """Facts of the variant's plan for its row, if the method reports any."""
        report = self.method.details
        return None if report is None else report(self.subject(subject), self.budget)


#: every registered method by name, in registration order (the order of a comparison's rows)
METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS` (its name must be new)."""
    if method.name in METHODS:
        raise ValueError(f"a method called {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


def variants(
    names: Sequence[str] | None = None, budgets: Sequence[float] = DEFAULT_BUDGETS, batch: int | None = None
) -> list[Variant]:
    """The variants to compare: ``names`` (default: every method but the opt-in ones), the reference first, one
    per budget and, for micro-batched methods, one per divisor ``k > 1`` of ``batch`` (none without a batch).

    The reference is eager, or :data:`FULL_STEP_REFERENCE` when every method named is a full step
    (:attr:`Method.full_step`): full steps are compared with eager's full step.

    A name may fix its own limit, ``magis-optimize@0.8`` or ``magis-optimize-lat@1.05``:
    that variant alone, whatever ``budgets`` says. Raises ValueError naming the valid
    choices for an unknown method, a budget outside ``(0, 1]`` or a latency limit below 1.
    """
    names = [n for n, m in METHODS.items() if not m.opt_in] if names is None else list(names)
    fixed = [_fixed_limit(n) for n in names]
    if not budgets:
        raise ValueError("give at least one activation memory budget")
    budgets = [check_budget(b) for b in budgets]
    reference = reference_of(n for n, _ in fixed)
    ordered = [(reference, None), *dict.fromkeys(f for f in fixed if f[0] != reference)]
    out: list[Variant] = []
    counts = [k for k in range(2, (batch or 0) + 1) if batch % k == 0]
    for name, limit in ordered:
        method = METHODS[name]
        for k in counts if method.micro_batched else [None]:
            if limit is not None:
                out.append(Variant(method, limit, k))
                continue
            limits = budgets if method.budgeted else method.latency_limits or [None]
            out += [Variant(method, limit, k) for limit in limits]
    return out


def reference_of(names: Iterable[str]) -> str:
    """The reference of a comparison of the methods ``names`` (plain names, no limits): eager, or eager's
    full step when every one of them is a full step."""
    names = list(names)
    full = FULL_STEP_REFERENCE in METHODS and names and all(METHODS[n].full_step for n in names)
    return FULL_STEP_REFERENCE if full else REFERENCE


def _fixed_limit(name: str) -> tuple[str, float | None]:
    """``("magis-optimize", 0.8)`` for ``"magis-optimize@0.8"``, ``(name, None)`` for a plain
    method name; ValueError for anything else."""
    if name in METHODS:
        return name, None
    base, _, text = name.rpartition("@")
    method = METHODS.get(base)
    if method is None or not (method.budgeted or method.latency_limits):
        raise ValueError(f"unknown method {name!r}: choose from {', '.join(METHODS)} (a budgeted one may end in @B)")
    try:
        limit = float(text)
    except ValueError:
        raise ValueError(f"{name!r}: the limit after '@' must be a number, got {text!r}") from None
    if method.budgeted:
        return base, check_budget(limit)
    if not limit >= 1.0:
        raise ValueError(f"{name!r}: a latency limit is a ratio to the captured step's latency, at least 1")
    return base, limit
