"""The registry of methods: :class:`Method`, :data:`METHODS`, :func:`register`, and :func:`variants`, the rows
of a comparison.

A method gives, for a :class:`~yardstick.methods.subject.Subject`, a real step (:class:`Runnable`)
and a simulated one (:data:`Simulated`); a :class:`Variant` is a method at one budget, latency
limit or micro-batch count. The families of :mod:`yardstick.methods` register their methods here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
    """The variants to compare: ``names`` (default: every method but the opt-in ones), eager first, one per budget
    and, for micro-batched methods, one per divisor ``k > 1`` of ``batch`` (none without a batch).

    A name may fix its own limit, ``magis-optimize@0.8`` or ``magis-optimize-lat@1.05``:
    that variant alone, whatever ``budgets`` says. Raises ValueError naming the valid
    choices for an unknown method, a budget outside ``(0, 1]`` or a latency limit below 1.
    """
    names = [n for n, m in METHODS.items() if not m.opt_in] if names is None else list(names)
    fixed = [_fixed_limit(n) for n in names]
    if not budgets:
        raise ValueError("give at least one activation memory budget")
    budgets = [check_budget(b) for b in budgets]
    ordered = [(REFERENCE, None), *dict.fromkeys(f for f in fixed if f[0] != REFERENCE)]
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
