"""Swapping and de-swapping as graph rules (MAGIS §5.2, Figure 8e-f).

- :func:`swap`: a tensor saved past the peak (a hot-spot read after the last peak
  step, :func:`~magis.rules.rewrite.saved_tensors`) is copied to host memory by a
  Store right after it is made, and back by a Load before the first of its readers
  after the peak; those readers (and the views they read, rebuilt on the loaded
  tensor) read the loaded copy. The tensor leaves device memory once its Store and
  its readers before the peak have run; the host copy counts apart
  (:mod:`magis.cost.memory`). Proposed only where that frees bytes at the peak and no
  step rises above it.
- :func:`de_swap`: a Store and its Load go, their readers read the tensor itself again.

As for re-materialization, :func:`swap` is :func:`swap_proposals` (no graph built)
followed by :func:`swapped` (each proposal rewritten and checked).

Swapping re-executes nothing, so any tensor qualifies, random ones included; a loaded
tensor is not swapped again. The Store/Load operators and how they run are in
:mod:`magis.backend.transfer`; with a cost model, the candidate's Load is placed as
late as still hides its transfer (:func:`magis.schedule.transfers.place_transfers`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace

from magis.backend.transfer import Load, Store
from magis.cost.latency import CostModel
from magis.ir.graph import Graph, Node, Ref, Role, map_refs
from magis.rules.rewrite import (
    Rewrite,
    SavedTensor,
    Timeline,
    insert_before,
    net_saving,
    prune_dead,
    rebuild,
    reordered,
    saved_tensors,
)
from magis.schedule.transfers import place_transfers


@dataclass(frozen=True)
class SwapProposal:
    """A swap the estimate proposes, before any graph is built: the saved tensor, the node
    holding its whole storage (what the Store copies) and the bytes it saves at the peak."""

    saved: SavedTensor
    holder: str
    saving: int

    @property
    def target(self) -> str:
        """The node whose value is swapped out."""
        return self.holder


def swap_proposals(graph: Graph, timeline: Timeline) -> list[SwapProposal]:
    """Every saved tensor of ``timeline`` whose leaving device memory frees bytes at the
    peak; cheap, nothing is rewritten or simulated (that is :func:`swapped`)."""
    found = []
    position = {name: i for i, name in enumerate(timeline.order)}
    for saved in saved_tensors(graph, timeline):
        holder = _holder(graph, saved)
        if holder is None or position[holder] >= saved.first_late:
            continue  # no value to store before the first late reader (a getitem taken late)
        if any(isinstance(graph[reader].target, Store) for reader in saved.late):
            continue  # stored already, after the peak: another swap would wrap the first one
        saving = net_saving(timeline, saved.freed, {})
        if saving is not None:
            found.append(SwapProposal(saved, holder, saving))
    return found


def swapped(graph: Graph, timeline: Timeline, proposal: SwapProposal, model: CostModel | None = None) -> Rewrite | None:
    """``proposal`` applied (with ``model``, each Load placed to hide its transfer, else right
    before its reader), or ``None`` where some step would rise above the peak."""
    return swapped_together(graph, timeline, [proposal], model)


def independent_swaps(a: SwapProposal, b: SwapProposal) -> bool:
    """Whether two swaps of one timeline can be applied together, each doing what it would
    alone: they store different storages and rewire different readers and views."""
    return a.saved.storage != b.saved.storage and {*a.saved.late, *a.saved.carriers}.isdisjoint(
        {*b.saved.late, *b.saved.carriers}
    )


def swapped_together(
    graph: Graph, timeline: Timeline, proposals: Sequence[SwapProposal], model: CostModel | None = None
) -> Rewrite | None:
    """Independent proposals of ``timeline`` (:func:`independent_swaps`) applied in one rewrite
    (with ``model``, every Load placed to hide its transfer), or ``None`` where some step would
    rise above the peak. A recurrent network saves a few small tensors per cell and time step
    (Echo's NMT: 1,750 of 0.25 MiB at paper size): one swap a round would never reach them."""
    result, order = graph, list(timeline.order)
    for proposal in proposals:
        first_late = timeline.order[proposal.saved.first_late]
        result = _swapped(result, proposal.saved, order, first_late, proposal.holder)
        order = [n.name for n in result.nodes]
    if model is not None:
        result = reordered(result, place_transfers(result, order, model))
    memory = timeline.not_raised_by(result)
    if memory is None:
        return None
    saving = sum(p.saving for p in proposals)
    if len(proposals) == 1:
        (proposal,) = proposals
        description = (
            f"swap {proposal.holder} ({proposal.saved.nbytes} bytes) out after it is made, in before "
            f"{timeline.order[proposal.saved.first_late]}: {saving} bytes saved at the peak"
        )
    else:
        description = (
            f"swap {len(proposals)} saved tensors ({', '.join(p.holder for p in proposals)}) out after "
            f"they are made, in before their readers after the peak: {saving} bytes saved at the peak"
        )
    late = {name for p in proposals for name in p.saved.late}
    touched = (set(result.index) ^ set(graph.index)) | late
    return Rewrite(result, description, tuple(n.name for n in result.nodes), frozenset(touched), saving, memory)


def swap(graph: Graph, order: Sequence[str] | None = None, model: CostModel | None = None) -> list[Rewrite]:
    """Swapping candidates around the memory hot-spots of ``order`` (MAGIS §5.2); with
    ``model``, each Load is placed to hide its transfer, else right before its reader."""
    timeline = Timeline.of(graph, order)
    found = (swapped(graph, timeline, p, model) for p in swap_proposals(graph, timeline))
    return [rewrite for rewrite in found if rewrite is not None]


def _holder(graph: Graph, saved: SavedTensor) -> str | None:
    """The node whose value is the whole saved storage: its owner, or the ``getitem`` of
    the owner's element. ``None`` for a loaded tensor (never swapped again), a storage an
    in-place operator writes after its owner (:mod:`magis.rules.in_place`) or an element
    nothing reads whole."""
    owner, element = saved.storage
    node = graph[owner]
    if isinstance(node.target, Load) or saved.storage in graph.writers:
        return None  # a storage an operator writes in place: its owner's value is not the one saved
    if not node.tuple_output:
        return owner
    return next(
        (
            c
            for c in saved.carriers
            if graph[c].target is operator.getitem and graph[c].inputs[0] == owner and graph[c].args[1] == element
        ),
        None,
    )


def _swapped(graph: Graph, saved: SavedTensor, order: Sequence[str], first_late: str, holder: str) -> Graph:
    """``saved`` (whole in ``holder``) stored right after ``holder`` in ``order`` and loaded
    right before ``first_late``, its readers after the peak reading the loaded copy."""
    meta = graph[holder].meta
    nbytes = graph.storage_bytes[saved.storage]
    role = graph[holder].role
    store = Node(graph.fresh_name(f"{holder}_store"), Store(nbytes), (Ref(holder),), (), (meta,), (None,), role)
    load_name = graph.fresh_name(f"{holder}_load")
    load = Node(load_name, Load(nbytes), (Ref(store.name),), outputs=(meta,), aliases=(None,), role=Role.BACKWARD)
    copies: dict[str, str] = {holder: load_name}
    views: list[Node] = []

    def onto_load(name: str) -> str:
        """The view ``name`` of the saved storage, rebuilt on the loaded tensor."""
        if name not in copies:
            node = graph[name]
            args, kwargs = map_refs(
                (node.args, node.kwargs), lambda ref: Ref(onto_load(ref.name)) if ref.name in carriers else ref
            )
            copy = replace(node, name=graph.fresh_name(f"{name}_loaded"), args=args, kwargs=kwargs, role=Role.BACKWARD)
            views.append(copy)
            copies[name] = copy.name
        return copies[name]

    carriers = set(saved.carriers) - {saved.storage[0]} if graph[saved.storage[0]].tuple_output else set(saved.carriers)
    for reads in saved.late.values():
        for carrier in reads:
            onto_load(carrier)

    def to_load(ref: Ref) -> Ref:
        return Ref(copies.get(ref.name, ref.name))

    readers = [
        replace(graph[r], args=map_refs(graph[r].args, to_load), kwargs=map_refs(graph[r].kwargs, to_load))
        for r in saved.late
    ]
    placed = list(order)
    placed.insert(placed.index(holder) + 1, store.name)
    placed = insert_before(placed, [load_name, *(v.name for v in views)], first_late)
    return prune_dead(rebuild(graph, placed, [store, load, *views, *readers]), saved.carriers)


def de_swap(graph: Graph, order: Sequence[str] | None = None) -> list[Rewrite]:
    """De-swapping candidates (MAGIS §5.2): each Store goes with its Loads, whose readers
    read the stored tensor again. Not where an in-place op writes the stored tensor's memory
    after the Store (:mod:`magis.rules.in_place` reuses memory nothing reads any more): the
    readers would read what it wrote."""
    order = tuple(order) if order is not None else tuple(n.name for n in graph.nodes)
    position = {name: i for i, name in enumerate(order)}
    found = []
    for store in (n for n in order if isinstance(graph[n].target, Store)):
        holder = graph[store].inputs[0]
        writers = (w for key in graph.storages[holder] if key is not None for w in graph.writers.get(key, ()))
        if any(position[w] > position[store] for w in writers):
            continue
        loads = [c for c in graph.consumers[store] if isinstance(graph[c].target, Load)]
        result = graph.replace([store, *loads], rename=dict.fromkeys(loads, holder))
        new_order = tuple(n for n in order if n in result.index)
        description = f"de-swap {holder}: its Store and {len(loads)} Load(s) removed"
        found.append(Rewrite(reordered(result, new_order), description, new_order, frozenset([store, *loads, holder])))
    return found
