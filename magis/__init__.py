"""magis: fit PyTorch training in less memory (MAGIS, ASPLOS'24).

``capture`` turns a training step into a :class:`~magis.ir.Graph`; ``profile``
reports its size, simulated peak memory and latency, and can run it for real;
``optimize`` searches for the plan that fits a memory (or latency) limit and returns
a :class:`Plan`, a callable training step.
"""

from magis.api import optimize, profile
from magis.frontend.capture import CaptureError, capture
from magis.ir import Graph
from magis.plan import InfeasibleLimit, Plan

__all__ = ["CaptureError", "Graph", "InfeasibleLimit", "Plan", "capture", "optimize", "profile"]
