"""The host link of a cost model: its rate, and what a swap's transfer over it costs (MAGIS §5.2).

A Store or Load (:mod:`magis.backend.transfer`) moves its bytes over the link between
device and host memory, one direction at a time, on a stream of its own; its time is
its bytes over the link's achievable bandwidth. The runtime only issues the copies: the
rate is a cost figure, read here by the latency model and by the search (which weighs a
recomputation's saving per second against what a swap would move in that time).
"""

from __future__ import annotations

from typing import Any


def host_bytes_per_second(model: Any) -> float:
    """Host-link bandwidth of a cost model: its device profile's, or for a profiled model
    that of the roofline it measured on this machine (:mod:`magis.cost.latency`)."""
    analytic = getattr(model, "fallback", model)
    return analytic.profile.host_bytes_per_second


def transfer_seconds(nbytes: int, model: Any) -> float:
    """Seconds a Store or Load of ``nbytes`` takes over the host link of ``model``."""
    return nbytes / host_bytes_per_second(model)
