"""magis: fit PyTorch training in less memory (MAGIS, ASPLOS'24).

``capture`` turns a training step into a :class:`~magis.ir.Graph`; ``profile``
reports its size, simulated peak memory and latency, and can run it for real;
``optimize`` searches for the plan that fits a memory (or latency) limit and returns
a :class:`Plan`, a callable training step, which ``Plan.save`` writes and ``load_plan``
reads back; ``planned`` is a training step planned once per input shape. A captured
step that differs from eager PyTorch's is refused with :class:`CaptureMismatch`, a
plan whose weights broke a division it makes with :class:`DivisorError`;
``profile`` and ``Plan.report`` return :class:`ProfileReport` and :class:`PlanReport`.
"""

from magis.api import ProfileReport, optimize, profile
from magis.backend.runtime import DivisorError
from magis.backend.verify import CaptureMismatch
from magis.fits import FitReport, fits
from magis.frontend.capture import CaptureError, capture
from magis.ir import Graph
from magis.plan import InfeasibleLimit, Plan, PlanReport, load_plan
from magis.planned_step import planned

__all__ = [
    "CaptureError",
    "CaptureMismatch",
    "DivisorError",
    "FitReport",
    "Graph",
    "InfeasibleLimit",
    "Plan",
    "PlanReport",
    "ProfileReport",
    "capture",
    "fits",
    "load_plan",
    "optimize",
    "planned",
    "profile",
]
