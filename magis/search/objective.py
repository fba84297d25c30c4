"""``BetterThan`` of MAGIS Algorithm 3: how two states compare under a memory or a latency limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from magis.search.rule_front import FrontPoint
from magis.search.state import MState

#: relaxation of the acceptance test (MAGIS §6.2: "empirically set to 1.1")
DELTA = 1.1

Mode = Literal["memory", "latency"]


@dataclass(frozen=True)
class Objective:
    """``BetterThan`` of Algorithm 3 for one of its two modes.

    ``memory`` mode: states within ``memory_bytes`` come first, by lower latency, then
    the others by lower peak. ``latency`` mode is the dual: within ``latency_s``, lower
    peak first. In memory mode a ``latency_s`` too is a second limit a plan must meet
    (:meth:`met_by`), though the order is that of memory mode.
    """

    mode: Mode
    memory_bytes: int | None = None
    latency_s: float | None = None

    def __post_init__(self) -> None:
        if self.mode == "memory" and self.memory_bytes is None:
            raise ValueError("memory mode needs a memory limit")
        if self.mode == "latency" and self.latency_s is None:
            raise ValueError("latency mode needs a latency limit")

    def rank(self, peak: float, latency: float) -> tuple[int, float, float]:
        """The sort key of a state with this peak and latency (lower is better)."""
        if self.mode == "memory":
            assert self.memory_bytes is not None
            return (0, latency, peak) if peak <= self.memory_bytes else (1, peak, latency)
        assert self.latency_s is not None
        return (0, peak, latency) if latency <= self.latency_s else (1, latency, peak)

    def queue_rank(self, state: MState) -> tuple:
        """:meth:`rank`, with states of equal peak ordered by their memory timeline, highest
        steps first, before their latency: of two states alike at the peak, the one whose memory
        is lower away from it has more to gain once the peak itself is rewritten (a stem tiled in
        eight bands ties with four until the operators at the cell's peak run in place). The
        queue's order only: the best state is still chosen by :meth:`rank`."""
        meets, first, second = self.rank(state.peak_bytes, state.latency_s)
        if first != state.peak_bytes:  # ranked by latency first: the profile would never decide
            return (meets, first, second)
        return (meets, first, tuple(sorted(state.memory.timeline, reverse=True)), second)

    def better_than(self, a: MState, b: MState) -> bool:
        return self.rank(a.peak_bytes, a.latency_s) < self.rank(b.peak_bytes, b.latency_s)

    def acceptable(self, state: MState, best: MState, delta: float = DELTA) -> bool:
        """The relaxed test of Alg. 3: ``state`` is no worse than ``best`` with the figures
        ``best`` is ranked by scaled by ``delta`` (whether ``best`` meets the limit stays as it is)."""
        meets, first, second = self.rank(best.peak_bytes, best.latency_s)
        return self.rank(state.peak_bytes, state.latency_s) <= (meets, first * delta, second * delta)

    def met_by(self, state: MState | FrontPoint) -> bool:
        """Whether ``state`` meets every limit given."""
        memory_ok = self.memory_bytes is None or state.peak_bytes <= self.memory_bytes
        latency_ok = self.latency_s is None or state.latency_s <= self.latency_s
        return memory_ok and latency_ok
