"""Memory-optimal operator ordering (Serenity, MLSys'20; MAGIS, ASPLOS'24 §6.1).

- :func:`schedule`: the entry point, DP on narrow-waist pieces under adaptive soft
  budgeting, never worse than the captured order (:mod:`magis.schedule.scheduler`).
- :func:`dp_schedule`: Serenity's exact DP over a whole graph (:mod:`magis.schedule.dp`).
- :func:`greedy_schedule`: a fast memory-greedy order (:mod:`magis.schedule.greedy`).
- :func:`narrow_waist`: nw(v) of every node (:mod:`magis.schedule.partition`).
- :func:`incremental_schedule`: MAGIS Alg. 2 after a graph mutation (:mod:`magis.schedule.incremental`).
"""

from magis.schedule.dp import ScheduleTimeout, dp_schedule
from magis.schedule.greedy import greedy_schedule
from magis.schedule.incremental import incremental_schedule
from magis.schedule.partition import narrow_waist
from magis.schedule.scheduler import ScheduleResult, schedule

__all__ = [
    "ScheduleResult",
    "ScheduleTimeout",
    "dp_schedule",
    "greedy_schedule",
    "incremental_schedule",
    "narrow_waist",
    "schedule",
]
