"""Where swap transfers go in a schedule (MAGIS §6.2, "Simulator", last paragraph).

The memory orderings of this package put a Load right before its reader (its tensor
then lives the shortest time), which leaves the transfer no compute to hide behind.
:func:`place_transfers` moves every Store right after the node it copies (as early
as possible: the tensor leaves device memory soonest) and every Load back from its
first reader until the compute in between covers the transfer (as late as still
hides it), never before its Store. Other nodes keep their order.
"""

from __future__ import annotations

from collections.abc import Sequence

from magis.cost.latency import CostModel
from magis.ir.graph import Graph


def is_transfer(graph: Graph, name: str) -> bool:
    """A node on the transfer stream (a Store or a Load)."""
    return getattr(graph[name].target, "stream", 0) == 1


def place_transfers(graph: Graph, order: Sequence[str], model: CostModel) -> list[str]:
    """``order`` with Stores as early and Loads as late as MAGIS places them."""
    graph.check_schedule(order)
    rest = [name for name in order if not is_transfer(graph, name)]
    if len(rest) == len(order):
        return list(order)
    pos = {name: i for i, name in enumerate(rest)}
    after: dict[str, list[str]] = {}  # node -> Stores right after it
    before: dict[str, list[str]] = {}  # node -> Loads right before it (None: at the end)
    for store in (n for n in order if is_transfer(graph, n) and graph[n].on_host):
        after.setdefault(graph[store].inputs[0], []).append(store)
    for load in (n for n in order if is_transfer(graph, n) and not graph[n].on_host):
        floor = pos[graph[graph[load].inputs[0]].inputs[0]]  # the step its Store follows
        at = min((pos[r] for r in graph.successors[load]), default=len(rest))
        needed, hidden = model.node_seconds(graph, load), 0.0
        while at - 1 > floor and hidden < needed:
            at -= 1
            hidden += model.node_seconds(graph, rest[at])
        before.setdefault(rest[at] if at < len(rest) else None, []).append(load)
    placed: list[str] = []
    for name in rest:
        placed.extend(before.get(name, ()))
        placed.append(name)
        placed.extend(after.get(name, ()))
    placed.extend(before.get(None, ()))
    graph.check_schedule(placed)
    return placed
