"""What a graph rule returns: a new graph and a one-line description of the change.

Every rule of :mod:`magis.rules` that rewrites a whole graph (identity rewrites,
algebraic rewrites, re-materialization, swapping) is a function
``Graph -> list[Rewrite]``; the M-Optimizer (:mod:`magis.search.registry`) takes
any such function as an M-Rule. A plain ``(graph, description)`` pair unpacks the
same way and is accepted too.
"""

from __future__ import annotations

from typing import NamedTuple

from magis.ir.graph import Graph


class Rewrite(NamedTuple):
    """A rewritten graph, computing what the original computes, and what changed."""

    graph: Graph
    description: str
