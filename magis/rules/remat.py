"""Re-materialization and de-re-materialization as graph rules (MAGIS §5.2, Figure 8a-d).

- :func:`remat`: for a tensor A saved past the peak (a hot-spot read after the last
  peak step, :func:`~magis.rules.rewrite.saved_tensors`), the readers after the
  peak get their own recomputed copy A', placed right before the first of them. Where
  an input of A is freed by then, it is recomputed too (a short chain, at most
  ``max_ops`` operators, a pointwise one counting half, and up to ``SEGMENT_GROWTH``
  times as many where a shorter chain would keep alive more than it frees) rather than
  kept alive; inputs still alive then, or that cannot be recomputed, are read as they are.
- :func:`de_remat`: two nodes with the same operator and the same inputs become one
  (and so, in turn, do the readers that then coincide): the dual rule.

:func:`remat` is :func:`remat_proposals` (Echo's estimate for every saved tensor, no
graph built) followed by :func:`rematerialized` (each proposal rewritten and checked):
a caller that needs only the best few, such as the greedy front of
:mod:`magis.search.rule_front`, ranks the proposals and rewrites those alone.

Echo's footprint estimate (Echo §IV-A) decides whether a recomputation is proposed:
the bytes it frees at each peak step (the saved tensor no longer lives there) against
the bytes it newly keeps alive there (inputs of the copies that would have died
before it); only a net saving at the peak, with no peak step growing, is proposed.
Cheap operators are recomputed (pointwise ops, activations, normalisations,
softmax, views, and bandwidth-bound data movement: concatenation, padding, pooling,
embedding lookups, casts, mean and sum); matrix products and convolutions only with
``heavy=True`` (Echo §IV-B notes their gradients need only their inputs, so recomputing them is
the costly choice).

Random numbers are never drawn again (docs/design.md): a random op is never copied. The
output of a dropout is recomputed from the mask it saved, ``input * mask * scale``
(``native_dropout_backward``, the very formula of the op), so the copy is bit for bit
the first execution's value.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from magis.cost.latency import CostModel, node_flops
from magis.ir.graph import Graph, Node, Ref, Role, is_view, map_refs
from magis.rules.rewrite import (
    Rewrite,
    SavedTensor,
    Timeline,
    insert_before,
    kept_alive,
    net_saving,
    prune_dead,
    rebuild,
    reordered,
    saved_tensors,
)

aten = torch.ops.aten

#: cheap operators that are not tagged pointwise, all deterministic and bandwidth bound:
#: normalisations, softmax, and data movement (each reads and writes about its output once)
CHEAP_OPS = frozenset(
    {
        aten.cat.default,
        aten.constant_pad_nd.default,
        aten.max_pool2d_with_indices.default,
        aten.avg_pool2d.default,
        aten.embedding.default,
        aten._to_copy.default,
        aten.mean.dim,
        aten.sum.dim_IntList,
        aten.native_layer_norm.default,
        aten.native_batch_norm.default,
        aten._native_batch_norm_legit_functional.default,
        aten._native_batch_norm_legit_no_training.default,
        aten._softmax.default,
        aten._log_softmax.default,
        aten._safe_softmax.default,
    }
)
MAX_OPS = 4  # operators one recomputation may copy (views and getitem free, pointwise ones at POINTWISE_SHARE)
#: the share of ``MAX_OPS`` a pointwise operator takes: each reads and writes about one
#: tensor of its size, and activations are chains of them (a tanh-GELU is eight), which a
#: budget counted in whole operators cut off before the tensor that owns the storage
POINTWISE_SHARE = 0.5
#: how far a segment's budget may grow (doubling from ``max_ops``) where a shorter one
#: would keep alive more than it frees (:func:`remat_proposals`)
SEGMENT_GROWTH = 4


class RematError(ValueError):
    """A node that cannot be recomputed; the message says why."""


def why_not_recomputable(graph: Graph, name: str, heavy: bool = False) -> str | None:
    """``None`` when node ``name`` can be recomputed exactly, else the reason it cannot.

    A dropout's output (``getitem`` 0 of ``native_dropout``) can, from its saved mask.
    """
    node = graph[name]
    if node.is_input:
        return "it is an input of the step"
    if node.target is operator.getitem:
        producer = graph[node.inputs[0]]
        if producer.target is aten.native_dropout.default and node.args[1] == 0:
            if len(producer.args) < 3 or producer.args[2] is not True or not 0.0 <= float(producer.args[1]) < 1.0:
                return "the dropout is not a training-mode dropout with 0 <= p < 1 (its output is no mask product)"
            return None if _mask_of(graph, producer.name) else "the dropout's mask is not kept in the graph"
        return why_not_recomputable(graph, producer.name, heavy)
    if node.random:
        return f"{node.op_name} is random: its numbers are never drawn again"
    if not isinstance(node.target, torch._ops.OpOverload):
        return f"{node.op_name} is not an aten operator"
    if node.target._schema.is_mutable:
        return f"{node.op_name} has side effects (it writes into an input)"
    if is_view(node) or torch.Tag.pointwise in node.target.tags or node.target in CHEAP_OPS:
        return None
    if node_flops(graph, name) > 0:
        return None if heavy else f"{node.op_name} is compute-heavy: recompute it only with heavy=True"
    cheap = "pointwise, normalisation, softmax, views, data movement"
    return f"{node.op_name} is not among the operators recomputed ({cheap})"


def _budget_share(node: Node) -> float:
    """The share of the operator budget copying ``node`` takes (a view takes none)."""
    pointwise = isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags
    return POINTWISE_SHARE if pointwise else 1.0


def _is_dropout_output(graph: Graph, node: Node) -> bool:
    return node.target is operator.getitem and graph[node.inputs[0]].target is aten.native_dropout.default


def _mask_of(graph: Graph, dropout: str) -> str | None:
    """The ``getitem`` node holding a dropout's mask, if the graph keeps one."""
    return next(
        (c for c in graph.consumers[dropout] if graph[c].target is operator.getitem and graph[c].args[1] == 1), None
    )


@dataclass
class Segment:
    """The copies one recomputation makes, in topological order."""

    nodes: list[Node] = field(default_factory=list)
    copy_of: dict[str, str] = field(default_factory=dict)  # original -> copy
    reads: set[str] = field(default_factory=set)  # originals the copies read
    ops: int = 0
    budget: float = 0.0  # of ``max_ops``: pointwise operators count POINTWISE_SHARE each


@dataclass
class _Recompute:
    graph: Graph
    timeline: Timeline
    until: int  # the copies run right before this step of the old schedule
    forced: frozenset[str]  # nodes that must be copied (they carry the storage to free)
    heavy: bool
    max_ops: int
    segment: Segment = field(default_factory=Segment)
    taken: set[str] = field(default_factory=set)

    def _check_not_overwritten(self, node: Node) -> None:
        """A copy runs before ``until``: none of what it reads may be written in place before
        then (a parameter its optimizer's update overwrites, :mod:`magis.frontend.optimizer`)."""
        writers, pos = self.graph.writers, self.timeline.pos
        for p in node.inputs:
            for key in self.graph.storages[p]:
                late = [w for w in writers.get(key, ()) if pos[w] < self.until]
                if late:
                    raise RematError(f"cannot recompute {node.name}: {late[0]} has overwritten {p} by then")

    def copy(self, name: str) -> str:
        """The copy of ``name`` (made on first request, its inputs first)."""
        if name in self.segment.copy_of:
            return self.segment.copy_of[name]
        reason = why_not_recomputable(self.graph, name, self.heavy)
        if reason is not None:
            raise RematError(f"cannot recompute {name}: {reason}")
        node = self.graph[name]
        self._check_not_overwritten(node)
        if _is_dropout_output(self.graph, node):
            made = self._dropout_output(node)
        else:
            if not is_view(node):
                self.segment.ops += 1
                self.segment.budget += _budget_share(node)
            args, kwargs = map_refs((node.args, node.kwargs), self._input)
            made = replace(node, name=self._fresh(name), args=args, kwargs=kwargs, role=Role.BACKWARD)
        self.segment.nodes.append(made)
        self.segment.copy_of[name] = made.name
        return made.name

    def _dropout_output(self, item: Node) -> Node:
        """``input * mask * scale`` from the dropout's saved mask: the output of its first run."""
        dropout = self.graph[item.inputs[0]]
        x, p = dropout.args[0], float(dropout.args[1])
        self.segment.ops += 1
        self.segment.budget += 1
        mask = _mask_of(self.graph, dropout.name)
        self.segment.reads.add(mask)
        return Node(
            self._fresh(item.name),
            aten.native_dropout_backward.default,
            (self._input(x), Ref(mask), 1.0 / (1.0 - p)),
            outputs=item.outputs,
            aliases=(None,),
            role=Role.BACKWARD,
        )

    def _input(self, ref: Ref) -> Ref:
        """Read input ``ref`` as it is, or its copy when it is gone by then and can be recomputed."""
        name = ref.name
        if name in self.forced or (self._gone(name) and self._worth_copying(name)):
            return Ref(self.copy(name))
        self.segment.reads.add(name)
        return ref

    def _gone(self, name: str) -> bool:
        """Every storage of ``name`` is freed before the copies run."""
        keys = [k for k in self.graph.storages[name] if k is not None]
        return bool(keys) and all(
            not self.graph[k[0]].role.persistent and self.timeline.span[k][1] < self.until for k in keys
        )

    def _worth_copying(self, name: str) -> bool:
        """Recomputable, along its views down to what owns its storage, within the operator budget."""
        node = self.graph[name]
        if why_not_recomputable(self.graph, name, self.heavy) is not None:
            return False
        if _is_dropout_output(self.graph, node):
            return self.segment.budget + 1 <= self.max_ops
        if node.target is operator.getitem or is_view(node):
            return all(self._worth_copying(p) or not self._gone(p) for p in node.inputs)
        return self.segment.budget + _budget_share(node) <= self.max_ops

    def _fresh(self, name: str) -> str:
        i = 0
        while (fresh := f"{name}_remat{i}") in self.graph or fresh in self.taken:
            i += 1
        self.taken.add(fresh)
        return fresh


def plan_recompute(
    graph: Graph, saved: SavedTensor, timeline: Timeline, heavy: bool = False, max_ops: int = MAX_OPS
) -> Segment:
    """The copies that give the readers of ``saved`` after the peak their own value; raises
    :class:`RematError` when the saved tensor cannot be recomputed."""
    work = _Recompute(graph, timeline, saved.first_late, frozenset(saved.carriers), heavy, max_ops)
    for carriers in saved.late.values():
        for carrier in carriers:
            work.copy(carrier)
    return work.segment


def recompute(
    graph: Graph, saved: SavedTensor, timeline: Timeline, heavy: bool = False, max_ops: int = MAX_OPS
) -> tuple[Graph, Segment]:
    """The readers of ``saved`` after the peak read recomputed copies, placed right before
    the first of them (MAGIS §5.2 Re-materialization); raises :class:`RematError` when the
    saved tensor cannot be recomputed."""
    segment = plan_recompute(graph, saved, timeline, heavy, max_ops)
    return with_copies(graph, saved, timeline, segment), segment


def with_copies(graph: Graph, saved: SavedTensor, timeline: Timeline, segment: Segment) -> Graph:
    """``graph`` with ``segment``'s copies placed right before the first late reader of
    ``saved``, those readers reading the copies, and what no longer has readers removed."""
    return with_all_copies(graph, timeline, [(saved, segment)])


def with_all_copies(graph: Graph, timeline: Timeline, plans: Sequence[tuple[SavedTensor, Segment]]) -> Graph:
    """:func:`with_copies` for several saved tensors at once, planned on the same
    ``timeline`` and independent of one another (:func:`independent`)."""
    order: list[str] = list(timeline.order)
    rewired: list[Node] = []
    for saved, segment in plans:

        def to_copy(ref: Ref, copy_of: dict[str, str] = segment.copy_of) -> Ref:
            return Ref(copy_of.get(ref.name, ref.name))

        rewired += [
            replace(graph[r], args=map_refs(graph[r].args, to_copy), kwargs=map_refs(graph[r].kwargs, to_copy))
            for r in saved.late
        ]
        order = insert_before(order, [n.name for n in segment.nodes], timeline.order[saved.first_late])
    copies = [node for _, segment in plans for node in segment.nodes]
    carriers = [carrier for saved, _ in plans for carrier in saved.carriers]
    return prune_dead(rebuild(graph, order, [*copies, *rewired]), carriers)


@dataclass(frozen=True)
class RematProposal:
    """A recomputation Echo's estimate proposes (Echo §IV-A), before any graph is built:
    the saved tensor, the copies that would replace it, the bytes it saves at the peak."""

    saved: SavedTensor
    segment: Segment
    saving: int

    @property
    def target(self) -> str:
        """The node that owns the saved storage."""
        return self.saved.storage[0]


def remat_proposals(
    graph: Graph, timeline: Timeline, heavy: bool = False, max_ops: int = MAX_OPS
) -> list[RematProposal]:
    """Every saved tensor of ``timeline`` whose recomputation is a net saving at the peak by
    Echo's estimate (bytes freed at each peak step minus bytes newly kept there); cheap,
    nothing is rewritten or simulated (that is :func:`rematerialized`)."""
    found = []
    for saved in joined_by_owner(graph, saved_tensors(graph, timeline)):
        proposal = _shortest_saving_segment(graph, timeline, saved, heavy, max_ops)
        if proposal is not None:
            found.append(proposal)
    return found


def _shortest_saving_segment(
    graph: Graph, timeline: Timeline, saved: SavedTensor, heavy: bool, max_ops: int
) -> RematProposal | None:
    """The recomputation of ``saved`` within ``max_ops`` operators where it is a net saving,
    else within twice as many, and so on up to ``SEGMENT_GROWTH`` times ``max_ops``.

    A segment cut off by its budget reads whatever its last copies need as it is, and
    where that was freed before the peak it is kept alive instead: a layer's rotary
    query (a norm, a projection, the rotation) keeps the norm's statistics and the
    rotated half alive, more than it frees. The copies then run on to tensors that are
    still alive, which is what checkpointing a whole layer does; the greedy ranks the
    longer segment by its bytes per second, so it is taken only where it pays."""
    copied: set[str] | None = None
    budget = max_ops
    while budget <= SEGMENT_GROWTH * max_ops:
        try:
            segment = plan_recompute(graph, saved, timeline, heavy, budget)
        except RematError:
            return None
        if set(segment.copy_of) == copied:  # the budget no longer cuts it off
            return None
        saving = net_saving(timeline, saved.freed, kept_alive(graph, timeline, segment.reads, saved.first_late))
        if saving is not None:
            return RematProposal(saved, segment, saving)
        copied, budget = set(segment.copy_of), 2 * budget
    return None


def joined_by_owner(graph: Graph, saved: Sequence[SavedTensor]) -> list[SavedTensor]:
    """The saved outputs of one multi-output operator as one saved tensor: one copy of the
    operator recomputes them all (max pooling's values and indices, a layer norm's output,
    mean and rstd), where recomputing each apart would run the operator once per output.
    A random operator's outputs stay apart: a dropout's output is recomputed from its mask,
    which itself is never recomputed."""
    groups: dict[str, list[SavedTensor]] = {}
    for s in saved:
        owner = s.storage[0]
        groups.setdefault(owner if graph[owner].tuple_output and not graph[owner].random else s.storage, []).append(s)
    joined = []
    for parts in groups.values():
        first = parts[0]
        if len(parts) == 1:
            joined.append(first)
            continue
        late: dict[str, tuple[str, ...]] = {}
        freed: dict[int, int] = {}
        for part in parts:
            for reader, carriers in part.late.items():
                late[reader] = tuple(dict.fromkeys((*late.get(reader, ()), *carriers)))
            for step, nbytes in part.freed.items():
                freed[step] = freed.get(step, 0) + nbytes
        carriers = tuple(dict.fromkeys(c for part in parts for c in part.carriers))
        nbytes = sum(part.nbytes for part in parts)
        first_late = min(part.first_late for part in parts)
        joined.append(SavedTensor(first.storage, nbytes, carriers, late, first_late, freed))
    return joined


def rematerialized(graph: Graph, timeline: Timeline, proposal: RematProposal) -> Rewrite | None:
    """``proposal`` applied: the rewritten graph, or ``None`` where running the copies
    would raise some step above the peak (Echo's guarantee: the footprint never grows)."""
    return rematerialized_together(graph, timeline, [proposal])


def independent(a: RematProposal, b: RematProposal) -> bool:
    """Whether two proposals of one timeline can be applied together, each doing what it
    would alone: they copy, free and rewire different nodes, and neither's copies read a
    tensor the other frees (which would then live until those copies run)."""
    mine = {*a.segment.copy_of, *a.saved.late, *a.saved.carriers}
    theirs = {*b.segment.copy_of, *b.saved.late, *b.saved.carriers}
    return (
        mine.isdisjoint(theirs)
        and a.segment.reads.isdisjoint(b.saved.carriers)
        and b.segment.reads.isdisjoint(a.saved.carriers)
    )


def rematerialized_together(graph: Graph, timeline: Timeline, proposals: Sequence[RematProposal]) -> Rewrite | None:
    """Independent proposals of ``timeline`` (:func:`independent`) applied in one rewrite, or
    ``None`` where some step would rise above the peak. A greedy that finds the same kind
    of tensor saved in every layer of a model takes many of them in one round this way."""
    result = with_all_copies(graph, timeline, [(p.saved, p.segment) for p in proposals])
    memory = timeline.not_raised_by(result)
    if memory is None:
        return None
    saving = sum(p.saving for p in proposals)
    if len(proposals) == 1:
        (proposal,) = proposals
        saved, segment = proposal.saved, proposal.segment
        description = (
            f"remat {proposal.target} ({graph[proposal.target].op_name}) for {len(saved.late)} reader(s) after "
            f"the peak: {segment.ops} op(s) recomputed, {saving} bytes saved at the peak"
        )
    else:
        description = (
            f"remat {len(proposals)} saved tensors ({', '.join(p.target for p in proposals)}): "
            f"{sum(p.segment.ops for p in proposals)} op(s) recomputed, {saving} bytes saved at the peak"
        )
    touched = {name for p in proposals for name in (*(n.name for n in p.segment.nodes), *p.saved.late)}
    touched |= set(graph.index) - set(result.index)
    order = tuple(n.name for n in result.nodes)
    return Rewrite(result, description, order, frozenset(touched), saving, memory)


def recompute_seconds(graph: Graph, segment: Segment, model: CostModel) -> float:
    """What the copies of ``segment`` add to the step, each priced as the node it copies
    (a dropout's output, a free ``getitem``, as the dropout that made it: the copy reads
    and writes as much)."""
    priced = (graph[o].inputs[0] if _is_dropout_output(graph, graph[o]) else o for o in segment.copy_of)
    return sum(model.node_seconds(graph, name) for name in priced)


def remat(
    graph: Graph, order: Sequence[str] | None = None, heavy: bool = False, max_ops: int = MAX_OPS
) -> list[Rewrite]:
    """Re-materialization candidates around the memory hot-spots of ``order`` (MAGIS §5.2),
    each a net saving at the peak by Echo's estimate (Echo §IV-A) that raises no other step
    above the peak."""
    timeline = Timeline.of(graph, order)
    found = (rematerialized(graph, timeline, p) for p in remat_proposals(graph, timeline, heavy, max_ops))
    return [rewrite for rewrite in found if rewrite is not None]


def _key(graph: Graph, node: Node) -> str:
    """What a node computes: operator and arguments. A dropout applied again from its saved
    mask (``native_dropout_backward(x, mask, scale)``) computes the dropout's own output."""
    if node.target is aten.native_dropout_backward.default:
        x, mask, scale = node.args
        dropout = graph[mask.name].args[0].name if graph[mask.name].target is operator.getitem else None
        if (
            dropout is not None
            and graph[mask.name].args[1] == 1
            and graph[dropout].target is aten.native_dropout.default
            and graph[dropout].args[0] == x
            and scale == 1.0 / (1.0 - float(graph[dropout].args[1]))
        ):
            return repr((operator.getitem, (Ref(dropout), 0), ()))
    return repr((node.target, node.args, node.kwargs))


def de_remat(graph: Graph, order: Sequence[str] | None = None) -> list[Rewrite]:
    """De-re-materialization candidates (MAGIS §5.2): every node that allocates memory and
    computes what an earlier node computes (same operator, same inputs; never a random op)
    is merged into it, and then every pair of readers that has become the same, and so on;
    and, where there are several, all of them at once. Not only recomputations undone: a
    framework runs what the module says, and two modules beginning with the same operator on
    one tensor compute it twice (each operation of a NAS cell rectifies its input state)."""
    order = tuple(order) if order is not None else tuple(n.name for n in graph.nodes)
    pairs = duplicates(graph, order)
    every = [merged_duplicates(graph, order, pairs, description="de-remat every duplicate")] if len(pairs) > 1 else []
    return [
        *(merged_duplicates(graph, order, [pair], description=f"de-remat {pair[0]} into {pair[1]}") for pair in pairs),
        *every,
    ]


def shared_copies(graph: Graph, order: Sequence[str], originals: frozenset[str]) -> list[tuple[str, str]]:
    """Recomputed copies that compute what an earlier copy computes, each with that copy
    (``(drop, keep)``, in ``order``), for :func:`merged_duplicates`.

    Two recomputations often copy the same chain: saving two intermediates of one
    activation (tanh-GELU's eight operators) recomputes the chain's head twice, where
    torch.compile's min-cut recomputes it once. :func:`de_remat` leaves these alone,
    since each copy also computes what its original did, and merging into the original
    undoes the recomputation. Here only nodes outside ``originals`` (the step before any
    recomputation) are compared.
    """
    return duplicates(graph, order, originals)


def _never_merged(node: Node) -> bool:
    """An input, a random operator (its numbers are its own), a tensor in host memory, or an
    operator that writes into one of its inputs (two such writes are never one)."""
    mutates = isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable
    return node.is_input or node.random or node.on_host or mutates


def _overwritten(graph: Graph, name: str) -> bool:
    """An operator overwrites the node's result in place (:mod:`magis.rules.in_place`): a
    reader after the write needs a copy made before it, never the original."""
    return any(key in graph.writers for key in graph.storages[name])


def duplicates(graph: Graph, order: Sequence[str], left: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """Each node outside ``left`` that allocates memory and computes what an earlier such
    node computes (:func:`_key`), with the earliest such node: ``(drop, keep)``. Random
    operators and operators that write into an input are never duplicates, nor is a node
    whose result an in-place operator overwrites (a later reader needs its recomputed copy)."""
    first: dict[str, str] = {}
    found = []
    for name in order:
        node = graph[name]
        if name in left or _never_merged(node) or _overwritten(graph, name):
            continue
        keep = first.setdefault(_key(graph, node), name)
        if keep != name and node.fresh_bytes > 0:
            found.append((name, keep))
    return found


def merged_duplicates(
    graph: Graph,
    order: Sequence[str],
    pairs: Sequence[tuple[str, str]],
    left: frozenset[str] = frozenset(),
    description: str = "merge duplicates",
) -> Rewrite:
    """Each ``(drop, keep)`` of ``pairs`` (:func:`duplicates`) merged, and then every reader
    that coincides with an earlier node, and so on (:func:`_value_numbered`), all in one
    rebuild; a node of ``left`` is never merged into another. A round of the greedy that
    recomputes a tensor of every layer makes a shared copy in each: merging them one by
    one would rebuild and simulate the step once per layer."""
    order = tuple(order)
    rename = _value_numbered(graph, order, dict(pairs), lambda name: name not in left)
    new_order = tuple(n for n in order if n not in rename)
    merged = reordered(graph.replace(rename, rename=rename), new_order)
    touched = frozenset(rename) | frozenset(keep for _, keep in pairs)
    return Rewrite(merged, f"{description}: {len(rename)} node(s) merged", new_order, touched)


def _value_numbered(
    graph: Graph, order: tuple[str, ...], seed: dict[str, str], mergeable: Callable[[str], bool]
) -> dict[str, str]:
    """``seed`` (node -> the earlier node it is merged into) grown by value numbering: in
    ``order``, a node that reads a merged node and then computes what an earlier node
    computes (operator and arguments, read through the merges so far: :func:`_key`) is
    merged into it, where ``mergeable`` allows. One pass, one rebuild by the caller:
    merging the readers one at a time rebuilds the step once per reader."""
    rename = dict(seed)

    def root(name: str) -> str:  # a seed's keep may itself be merged on the way
        while name in rename:
            name = rename[name]
        return name

    def renamed(ref: Ref) -> Ref:
        return Ref(root(ref.name))

    first: dict[str, str] = {}
    for name in order:
        node = graph[name]
        if name in rename or _never_merged(node) or _overwritten(graph, name):
            continue
        reads_merged = any(p in rename for p in node.inputs)
        if reads_merged:
            node = replace(node, args=map_refs(node.args, renamed), kwargs=map_refs(node.kwargs, renamed))
        keep = first.setdefault(_key(graph, node), name)
        if keep != name and reads_merged and mergeable(name):
            rename[name] = keep
    return {drop: root(keep) for drop, keep in rename.items()}
