"""Memory simulation of a schedule (MAGIS §2.1).

For a schedule s = (v_1, ..., v_N), the tensor (storage) made by v_i lives from
step i until the last step that reads any view of it; graph outputs live to the
end; persistent tensors (parameters, buffers, inputs) live throughout. The active
memory M_i is the bytes of all storages live at step i, plus the transient
workspace of v_i (a fissioned region's internal peak, for instance); the peak is
max_i M_i, and the memory hot-spots are the storages live at a step whose M_i is
the peak.

Swapping (MAGIS §5.2): a storage a Store copies to host memory is no longer device
memory once the Store ran (its last device reader, as the simulator counts), and a
Load makes a new device storage; the host copies count apart (``host_peak``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from magis.ir.graph import Graph

StorageKey = tuple[str, int]


@dataclass(frozen=True)
class MemoryProfile:
    """The memory timeline of one schedule."""

    order: tuple[str, ...]
    timeline: tuple[int, ...]  # M_i, bytes, one per step
    peak: int
    peak_steps: tuple[int, ...]  # every step whose M_i is the peak
    hotspots: frozenset[StorageKey]  # storages live at a peak step
    persistent_bytes: int
    host_peak: int = 0  # most bytes held in host memory (swapped out) at one step

    @property
    def hotspot_nodes(self) -> frozenset[str]:
        """The nodes that own a hot-spot storage."""
        return frozenset(owner for owner, _ in self.hotspots)


def storage_lifetimes(graph: Graph, order: Sequence[str]) -> dict[StorageKey, tuple[int, int]]:
    """For every storage, the first and last step (inclusive) it is live in ``order``."""
    pos = {name: i for i, name in enumerate(order)}
    last = len(order) - 1
    resident = graph.persistent | set(graph.outputs)
    persistent, storages, consumers = graph.persistent, graph.storages, graph.consumers
    span: dict[StorageKey, tuple[int, int]] = {}
    for i, name in enumerate(order):
        readers = consumers[name]
        if name in resident:
            end = last
        elif readers:
            end = max(map(pos.__getitem__, readers))
        else:
            end = i
        for key in storages[name]:
            if key is None:
                continue
            old = span.get(key)
            if old is None:
                span[key] = (0 if key[0] in persistent else pos[key[0]], end)
            elif end > old[1]:
                span[key] = (old[0], end)
    return span


def simulate_memory(graph: Graph, order: Sequence[str]) -> MemoryProfile:
    """The memory timeline, peak and hot-spots of running ``graph`` in ``order``.

    A node's ``workspace`` (memory it needs only while it runs) counts at its step.
    """
    graph.check_schedule(order)
    n = len(order)
    sizes = graph.storage_bytes
    span = storage_lifetimes(graph, order)
    delta = [0] * (n + 1)
    persistent = 0
    for key, (start, end) in span.items():
        delta[start] += sizes[key]
        delta[end + 1] -= sizes[key]
        if key[0] in graph.persistent:
            persistent += sizes[key]
    timeline = []
    live = 0
    for i in range(n):
        live += delta[i]
        timeline.append(live + graph[order[i]].workspace)
    peak = max(timeline, default=0)
    peak_steps = tuple(i for i, m in enumerate(timeline) if m == peak)
    hot = frozenset(k for k, (s, e) in span.items() if any(s <= i <= e for i in peak_steps))
    host = [0] * (n + 1)
    for key, nbytes in graph.host_storage_bytes.items():
        start, end = span[key]
        host[start] += nbytes
        host[end + 1] -= nbytes
    host_peak = max(itertools.accumulate(host[:n]), default=0)
    return MemoryProfile(tuple(order), tuple(timeline), peak, peak_steps, hot, persistent, host_peak)


def peak_memory(graph: Graph, order: Sequence[str]) -> int:
    """Peak of :func:`simulate_memory`: the figure the schedulers minimise."""
    return simulate_memory(graph, order).peak
