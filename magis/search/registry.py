"""The M-Rules of MAGIS Algorithm 3: every mutation the search may apply to an M-State.

Two kinds of rule (MAGIS §5):

- **F-Tree rules** change the fission numbers of the state's F-Tree (Enable, Lift,
  Disable, Mutate, :mod:`magis.rules.ftree_mutation`): ``FTree -> list[FTree]``;
- **graph rules** rewrite the graph the F-Tree is laid over (identity rewrites,
  algebraic rewrites, re-materialization, swapping): ``Graph -> list[Rewrite]``,
  each a new graph and a one-line description (:class:`magis.rules.rewrite.Rewrite`,
  a plain ``(graph, description)`` pair, or any value with those two attributes).

The search takes whatever is registered, in registration order (which, with the
order each rule lists its results in, fixes the order states are made: the search
is deterministic). Adding a rule is one call::

    register_graph_rule("remat", magis.rules.remat.remat_rewrites)

A plan's report lists the steps of the rules named ``remat`` and ``swap`` as its
recomputed and swapped tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from magis.analysis.ftree import FTree
from magis.ir.graph import Graph
from magis.rules import (
    algebraic,
    canonical,
    compact,
    concat_in_place,
    early_update,
    ftree_mutation,
    identity,
    in_place,
    multiply_add,
    output_backward,
    pointwise_matmul,
    remat,
    swap,
    tied_gradient,
    tiling,
)
from magis.rules.rewrite import Rewrite

TreeRule = Callable[[FTree], list[FTree]]
GraphRule = Callable[..., Sequence[Rewrite | tuple[Graph, str]]]


@dataclass(frozen=True)
class MRule:
    """A registered rule: its name (shown in plans' reports), kind and function.

    A graph rule is ``fn(graph)``, or ``fn(graph, order)`` when ``scheduled`` (the
    scheduling-based rules of MAGIS §5.2 act around the hot-spots of a schedule)."""

    name: str
    kind: Literal["ftree", "graph"]
    fn: TreeRule | GraphRule
    scheduled: bool = False

    def rewrites(self, graph: Graph, order: Sequence[str]) -> list[Rewrite]:
        """A graph rule's results as :class:`Rewrite` values (from pairs, or from any value
        with ``graph`` and ``description`` attributes)."""
        found = self.fn(graph, order) if self.scheduled else self.fn(graph)  # type: ignore[call-arg]
        return [
            r if isinstance(r, Rewrite) else Rewrite(*r) if isinstance(r, tuple) else Rewrite(r.graph, r.description)
            for r in found
        ]


#: every registered rule, by name, in registration order
RULES: dict[str, MRule] = {}


def register_ftree_rule(name: str, fn: TreeRule) -> MRule:
    """Register an F-Tree mutation ``FTree -> list[FTree]`` under ``name``."""
    return _register(MRule(name, "ftree", fn))


def register_graph_rule(name: str, fn: GraphRule, scheduled: bool = False) -> MRule:
    """Register a graph rule ``Graph -> list[Rewrite | (graph, description)]`` under ``name``
    (``(Graph, order) -> ...`` when ``scheduled``)."""
    return _register(MRule(name, "graph", fn, scheduled))


def _register(rule: MRule) -> MRule:
    if rule.name in RULES:
        raise ValueError(f"an M-Rule named {rule.name!r} is already registered")
    RULES[rule.name] = rule
    return rule


def rules(names: Iterable[str] | None = None) -> tuple[MRule, ...]:
    """The registered rules (or those named, in the order named); an unknown name is an error."""
    if names is None:
        return tuple(RULES.values())
    unknown = [n for n in names if n not in RULES]
    if unknown:
        raise ValueError(f"unknown M-Rule(s) {unknown}: registered are {', '.join(RULES)}")
    return tuple(RULES[n] for n in names)


register_ftree_rule("enable", ftree_mutation.enable)
register_ftree_rule("lift", ftree_mutation.lift)
register_ftree_rule("disable", ftree_mutation.disable)
register_ftree_rule("mutate", ftree_mutation.mutate)
register_graph_rule("concat-conv", identity.concat_conv_rewrites)
register_graph_rule("concat-depthwise", identity.concat_depthwise_rewrites)
register_graph_rule("concat-sink", identity.concat_sink_rewrites)
register_graph_rule("bias-out", identity.bias_out_rewrites, scheduled=True)
register_graph_rule("tile", tiling.tile_rewrites, scheduled=True)
register_graph_rule("backward-from-output", output_backward.backward_from_outputs)
register_graph_rule("batch-norm-from-output", output_backward.batch_norms_from_outputs)
register_graph_rule("in-place", in_place.in_place_rewrites)
register_graph_rule("multiply-add", multiply_add.multiply_add_rewrites)
register_graph_rule("pointwise-matmul", pointwise_matmul.pointwise_matmul_rewrites)
register_graph_rule("canonical", canonical.canonical_rewrites)
register_graph_rule("concat-in-place", concat_in_place.concat_in_place_rewrites)
register_graph_rule("tied-gradient", tied_gradient.tied_gradient_rewrites)
register_graph_rule("merge-matmuls", algebraic.merge_rewrites)
register_graph_rule("split-matmuls", algebraic.split_rewrites)
register_graph_rule("remat", remat.remat, scheduled=True)
register_graph_rule("de-remat", remat.de_remat, scheduled=True)
register_graph_rule("compact", compact.compact, scheduled=True)
register_graph_rule("swap", swap.swap, scheduled=True)
register_graph_rule("de-swap", swap.de_swap, scheduled=True)
register_graph_rule("early-update", early_update.early_updates, scheduled=True)

#: rules that only pay off where device memory is not host memory (a GPU)
DEVICE_ONLY_RULES = frozenset({"swap", "de-swap"})
