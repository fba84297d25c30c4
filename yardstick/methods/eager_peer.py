"""``eager``: plain PyTorch, forward, loss, ``backward()``; the reference every row is a ratio to.

Its real and simulated steps run over the subject's micro-batches, so gradient accumulation
(:mod:`yardstick.methods.accumulate_peers`) and ``magis-captured`` reuse them.
"""

from __future__ import annotations

from magis.frontend.capture import capture
from yardstick.methods.method_registry import PEER, REFERENCE, Method, Runnable, Simulated, register
from yardstick.methods.steps import eager_runnable, in_order, traced
from yardstick.methods.subject import Subject


def eager_real(subject: Subject, _budget: float | None) -> Runnable:
    return eager_runnable(subject.built, subject)


def eager_simulate(subject: Subject, _budget: float | None) -> Simulated:
    if subject.micro_batches == 1:
        return in_order(subject.graph)  # captured once, shared with the magis methods
    return traced(subject, subject.built, capture)


register(Method(REFERENCE, "eager PyTorch: forward, loss, backward()", PEER, eager_real, eager_simulate))
