"""magis: fit PyTorch training in less memory (MAGIS, ASPLOS'24).

``capture`` turns a training step into a :class:`~magis.ir.Graph`; ``profile``
reports its size, simulated peak memory and latency, and can run it for real.
"""

from magis.api import profile
from magis.frontend.capture import CaptureError, capture
from magis.ir import Graph

__all__ = ["CaptureError", "Graph", "capture", "profile"]
