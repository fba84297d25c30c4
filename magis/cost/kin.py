"""Pricing an operator never timed from its kin: the same operator on other shapes,
timed before, its time scaled by the roofline (MAGIS §5, for a search with a time budget)."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field

_INTEGER = re.compile(r"\d+")


@dataclass
class KinTimes:
    """Node times of the graphs a cost model priced, to estimate operators never timed
    from their kin: the same operator on other shapes.

    Two node keys (:func:`magis.cost.op_keys.node_key`) are kin when they differ only in their integers
    (shapes, sizes, constant arguments). The nearest kin differs in the fewest of them
    (one part of a fissioned step differs from the whole step in its batch dimension
    alone), ties broken by the closest analytic time; its measured time is scaled by
    the ratio of the two operators' analytic times (the roofline of this device). An
    operator without kin gets its analytic time scaled by the median ratio of measured
    to analytic time over everything seen. Measuring a graph on a CPU runs the whole step
    ten times, seconds per graph; an estimate takes microseconds, which is what lets a
    search with a time budget try fissioned graphs at all (:class:`magis.cost.latency.ProfiledCostModel`).
    """

    #: key skeleton (integers replaced) -> {integers of the key: (analytic s, measured s)}
    by_skeleton: dict[str, dict[tuple[int, ...], tuple[float, float]]] = field(default_factory=dict)
    #: measured / analytic time of each operator seen with a positive analytic time
    ratios: list[float] = field(default_factory=list)
    #: estimates made, by key (a graph and its variants share most keys)
    estimates: dict[str, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.by_skeleton)

    def add(self, key: str, analytic_s: float, seconds: float) -> None:
        """Remember that the operator of ``key`` took ``seconds`` (its analytic time ``analytic_s``)."""
        known = self.by_skeleton.setdefault(_INTEGER.sub("#", key), {})
        integers = _integers(key)
        if integers not in known:
            known[integers] = (analytic_s, seconds)
            if analytic_s > 0:
                self.ratios.append(seconds / analytic_s)
            self.estimates.clear()  # an estimate may have a nearer kin now

    def estimate(self, key: str, analytic_s: float) -> float:
        """Seconds the operator of ``key`` likely takes (class docstring)."""
        if key in self.estimates:
            return self.estimates[key]
        kin = self.nearest(key, analytic_s)
        if kin is not None:
            kin_analytic, kin_seconds = self.by_skeleton[_INTEGER.sub("#", key)][_integers(kin)]
            seconds = kin_seconds * (analytic_s / kin_analytic if analytic_s > 0 and kin_analytic > 0 else 1.0)
        else:
            seconds = analytic_s * (statistics.median(self.ratios) if self.ratios else 1.0)
        self.estimates[key] = seconds
        return seconds

    def nearest(self, key: str, analytic_s: float) -> str | None:
        """The key of the nearest kin of ``key`` (class docstring), None when it has none."""
        integers = _integers(key)
        kin = self.by_skeleton.get(_INTEGER.sub("#", key), {})

        def distance(other: tuple[int, ...]) -> tuple[int, float]:
            differing = sum(a != b for a, b in zip(integers, other))
            kin_analytic = kin[other][0]
            closeness = abs(math.log(analytic_s / kin_analytic)) if analytic_s > 0 and kin_analytic > 0 else 0.0
            return differing, closeness

        if not kin:
            return None
        values = iter(min(kin, key=distance))
        return _INTEGER.sub(lambda _: str(next(values)), key)

    def seconds(self, key: str) -> float:
        """The time remembered for the operator of ``key`` (one :meth:`add` gave)."""
        return self.by_skeleton[_INTEGER.sub("#", key)][_integers(key)][1]


def _integers(key: str) -> tuple[int, ...]:
    return tuple(int(i) for i in _INTEGER.findall(key))
