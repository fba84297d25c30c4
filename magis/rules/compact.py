"""Compact saved tensors (Echo §IV-B, layer specifics): a mask instead of a feature map.

- ReLU: the backward of ``relu`` is ``threshold_backward(grad, out, 0)``, which needs
  only where ``out <= 0``. Where a ReLU's output is saved past the peak for nothing
  else, :func:`compact` keeps ``le(out, 0)`` (a bool, one byte an element) from the
  forward and the backward becomes ``where(mask, 0, grad)``: the same values, NaN
  included, from a quarter of the bytes (fp32).
- Dropout: the backward keeps the bool mask already; what a training step also saves
  is the dropout's scaled output, for the operator that reads it (a matmul's weight
  gradient). :func:`compact` recomputes that output from the mask, ``input * mask *
  scale``, one operator and no new random numbers (:mod:`magis.rules.remat`), where
  the dropout's input is kept anyway.

- Bit masks (Echo §IV-B, Algorithm 1 line 21, "encode and decode"): a bool kept for the
  backward (a dropout's mask, or a ReLU's mask made as above) still takes a byte an
  element. :func:`compact` packs it eight elements to a byte right after its last
  forward reader, frees the bool, and unpacks it right before each reader after the
  peak (:func:`bit_mask_proposals`, :func:`packed_masks`); or packs it where it is made
  and unpacks it before every reader, forward ones too (a mask drawn ahead of a fission
  region, which should read it packed). Aten operators only, all exact on integers: the
  packed byte is ``sum(lane_k * 2**k)`` in uint8, lane k is ``byte & 2**k != 0``; the
  unpacked mask has the shape and strides of the original, so its readers are unchanged.

All are proposed, like every rule here, only around the memory hot-spots and only
where Echo's estimate (Echo §IV-A) finds bytes saved at the peak; the bit masks also
all together in one rewrite (first), since a model saves one in every layer.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from magis.ir.graph import Graph, Node, Ref, Role, TensorMeta, map_refs
from magis.rules.builder import NodeBuilder
from magis.rules.remat import RematError, plan_recompute, with_copies
from magis.rules.rewrite import (
    Rewrite,
    SavedTensor,
    Timeline,
    kept_alive,
    net_saving,
    prune_dead,
    rebuild,
    saved_tensors,
)

aten = torch.ops.aten

#: mask elements one packed byte holds
BITS = 8


#: masks packed alone, besides all at once: the ones saving most (each is a rewrite to simulate;
#: BERT at paper size has 37 masks, and one call proposing each took ~3 s)
SINGLE_MASKS = 4


def compact(graph: Graph, order: Sequence[str] | None = None) -> list[Rewrite]:
    """Echo's compact saved tensors around the hot-spots of ``order``: every saved bool mask
    packed into bits (all in one rewrite, first, and all where they are made, then the
    :data:`SINGLE_MASKS` saving most alone),
    ReLU outputs kept as masks, dropout outputs recomputed from their masks."""
    timeline = Timeline.of(graph, order)
    saved_all = saved_tensors(graph, timeline)
    proposals = bit_mask_proposals(graph, timeline, saved_all)
    at_source = bit_mask_proposals(graph, timeline, saved_all, at_source=True)
    together = [batch for batch in (proposals if len(proposals) > 1 else [], at_source) if batch]
    found = [r for r in (packed_masks(graph, timeline, batch) for batch in together) if r is not None]
    for saved in saved_all:
        owner = graph[saved.storage[0]]
        if owner.target is aten.relu.default and _only_threshold_backward(graph, saved):
            rewrite = _relu_mask(graph, timeline, saved)
        elif owner.target is aten.native_dropout.default and saved.storage[1] == 0:
            rewrite = _dropout_from_mask(graph, timeline, saved)
        else:
            continue
        memory = None if rewrite is None else timeline.not_raised_by(rewrite.graph)
        if rewrite is not None and memory is not None:
            found.append(replace(rewrite, memory=memory))
    largest = sorted(proposals, key=lambda p: -p.saving)[:SINGLE_MASKS]
    found.extend(r for r in (packed_masks(graph, timeline, [p]) for p in largest) if r is not None)
    return found


def _only_threshold_backward(graph: Graph, saved: SavedTensor) -> bool:
    """Every reader after the peak is ``threshold_backward(grad, relu, 0)``, reading the ReLU's
    output itself (or a ``detach``/``alias`` of it, as capture leaves them)."""
    relu = saved.storage[0]
    return all(
        graph[r].target is aten.threshold_backward.default
        and _unchanged(graph, graph[r].args[1].name) == relu
        and graph[r].args[2] == 0
        for r in saved.late
    )


def _unchanged(graph: Graph, name: str) -> str:
    """The node whose value ``name`` is, through ``detach`` and ``alias``."""
    while graph[name].target in (aten.detach.default, aten.alias.default):
        name = graph[name].inputs[0]
    return name


def _relu_mask(graph: Graph, timeline: Timeline, saved: SavedTensor) -> Rewrite | None:
    relu = graph[saved.storage[0]]
    meta = relu.meta
    mask_meta = replace(meta, dtype=torch.bool, nbytes=meta.numel)
    name = graph.fresh_name(f"{relu.name}_mask")
    mask = Node(name, aten.le.Scalar, (Ref(relu.name), 0), (), (mask_meta,), (None,), relu.role)
    saving = net_saving(timeline, saved.freed, dict.fromkeys(saved.freed, mask_meta.nbytes))
    if saving is None:
        return None
    readers = [
        replace(graph[r], target=aten.where.ScalarSelf, args=(Ref(mask.name), 0.0, graph[r].args[0]), kwargs=())
        for r in saved.late
    ]
    order = list(timeline.order)
    order.insert(order.index(relu.name) + 1, mask.name)
    result = prune_dead(rebuild(graph, order, [mask, *readers]), saved.carriers)
    description = (
        f"compact {relu.name}: a bool mask kept for {len(readers)} ReLU backward(s), {saving} bytes saved at the peak"
    )
    touched = {mask.name, *saved.late} | (set(graph.index) - set(result.index))
    return Rewrite(result, description, tuple(n.name for n in result.nodes), frozenset(touched), saving)


def _dropout_from_mask(graph: Graph, timeline: Timeline, saved: SavedTensor) -> Rewrite | None:
    try:
        segment = plan_recompute(graph, saved, timeline, max_ops=1)
    except RematError:
        return None
    saving = net_saving(timeline, saved.freed, kept_alive(graph, timeline, segment.reads, saved.first_late))
    if saving is None:
        return None
    result = with_copies(graph, saved, timeline, segment)
    description = f"compact {saved.storage[0]}: output recomputed from its mask, {saving} bytes saved at the peak"
    touched = {n.name for n in segment.nodes} | set(saved.late) | (set(graph.index) - set(result.index))
    return Rewrite(result, description, tuple(n.name for n in result.nodes), frozenset(touched), saving)


# ------------------------------------------------------------------ bit masks
@dataclass(frozen=True)
class BitLayout:
    """How a dense bool mask is cut into rows of whole bytes (Echo §IV-B's 1-bit encoding).

    The mask is read in its memory order (``perm``, outermost dimension first, a view), its
    leading dimensions ``lead`` kept and the rest merged into rows of ``row`` elements, each
    a whole number of bytes; where no trailing block of dimensions is, the mask is one row
    padded with ``pad`` zeros.
    """

    perm: tuple[int, ...]
    permuted: tuple[int, ...]  # the mask's shape in memory order
    lead: tuple[int, ...]
    row: int
    pad: int

    @property
    def packed_shape(self) -> tuple[int, ...]:
        return (*self.lead, (self.row + self.pad) // BITS)

    @property
    def packed_bytes(self) -> int:
        return math.prod(self.packed_shape)

    @property
    def moves(self) -> bool:
        """The memory order is not the dimension order (a transposed mask)."""
        return self.perm != tuple(range(len(self.perm)))


def bit_layout(meta: TensorMeta) -> BitLayout | None:
    """The :class:`BitLayout` of a bool mask of ``meta``; ``None`` where its layout is unknown,
    it does not fill its storage densely, or it holds fewer than a byte's elements."""
    shape, strides = meta.shape, meta.strides
    if meta.dtype is not torch.bool or strides is None or meta.numel < BITS or meta.nbytes != meta.numel:
        return None
    perm = tuple(sorted(range(len(shape)), key=lambda d: -strides[d]))  # stable: size-1 dims stay put
    expected = 1
    for d in reversed(perm):
        if shape[d] != 1:
            if strides[d] != expected:
                return None
            expected *= shape[d]
    permuted = tuple(shape[d] for d in perm)
    for j in range(len(permuted) - 1, -1, -1):  # keep as many leading dimensions as whole bytes allow
        row = math.prod(permuted[j:])
        if row % BITS == 0:
            return BitLayout(perm, permuted, permuted[:j], row, 0)
    return BitLayout(perm, permuted, (), meta.numel, -meta.numel % BITS)


@dataclass(frozen=True)
class BitMask:
    """A bool mask saved past the peak whose packing into bits Echo's estimate finds a saving:
    the pack reads ``source`` (the whole mask) right after node ``after``, and each of
    ``readers`` reads an unpacked copy made right before it instead of the carriers it names."""

    saved: SavedTensor
    source: str
    after: str
    layout: BitLayout
    readers: dict[str, tuple[str, ...]]
    freed: dict[int, int]  # bytes of the mask no longer held at each peak step
    cost: dict[int, int]  # bytes the packed mask (and unpacked copies) hold at each peak step
    saving: int
    packed: str | None = None  # the mask packed already (by an earlier rewrite): read, not made again

    @property
    def target(self) -> str:
        """The node that owns the mask's storage."""
        return self.saved.storage[0]


def bit_mask_proposals(
    graph: Graph, timeline: Timeline, saved: Sequence[SavedTensor] | None = None, at_source: bool = False
) -> list[BitMask]:
    """Every bool storage among ``saved`` (default: the saved tensors of ``timeline``) that
    packing into bits frees at the peak by Echo's estimate: the mask's bytes at each peak step
    it no longer spans, less the packed bytes held there. Each reader of an unpacked copy
    must read the whole mask (not a view of part of it).

    The pack runs after the mask's last reader before the peak, so only the readers after
    the peak unpack it; or, ``at_source``, right where the mask is made, every reader
    unpacking its own copy (offered only for masks with readers before the peak): one more
    unpack, but what a fission region reads is then the packed mask (a dropout mask drawn
    ahead of a region, :func:`magis.rules.separable.predraw_dropout_masks`)."""
    found = []
    pos = timeline.pos
    packs = _packs(graph)
    for s in saved_tensors(graph, timeline) if saved is None else saved:
        owner, element = s.storage
        meta = graph[owner].outputs[element]
        layout = bit_layout(meta) if meta is not None else None
        whole = [c for c in s.carriers if _is_whole(graph, c, s.storage, meta)]
        if layout is None or not whole:
            continue
        source = min(whole, key=pos.__getitem__)
        packed, chain = packs.get(source, (None, frozenset()))
        early: dict[str, tuple[str, ...]] = {}
        for c in s.carriers:
            for r in graph.consumers[c]:
                if r not in s.late and r not in s.carriers and r not in chain:
                    early[r] = (*early.get(r, ()), c)
        readers = {**s.late, **early} if at_source else s.late
        if (at_source and not early) or any(c not in whole for cs in readers.values() for c in cs):
            continue
        if at_source:
            start, end = timeline.span[s.storage]
            freed = {p: s.nbytes for p in timeline.peak_steps if start <= p <= end}
            copies = {pos[r]: s.nbytes for r in early}  # each unpacked copy lives at its reader
            after = source if packed is None else packed
        else:
            freed, copies = s.freed, {}
            after = max([source, *early], key=pos.__getitem__) if packed is None else packed
        if packed is None:
            cost = {p: layout.packed_bytes for p in timeline.peak_steps if p > pos[after]}
        else:  # what the packed mask is now kept alive for
            cost = kept_alive(graph, timeline, [packed], max(pos[r] for r in readers))
        cost = _summed([cost, copies])
        saving = net_saving(timeline, freed, cost)
        if saving is not None:
            found.append(BitMask(s, source, after, layout, readers, freed, cost, saving, packed))
    return found


def _packs(graph: Graph) -> dict[str, tuple[str, frozenset[str]]]:
    """The masks an earlier rewrite packed (:func:`_pack`): each one's source node, its packed
    node and the nodes in between. A mask whose reader was given a copy of it since (a
    dropout's output recomputed from its mask, :mod:`magis.rules.remat`) is unpacked from
    there, not packed twice."""
    found: dict[str, tuple[str, frozenset[str]]] = {}
    for node in graph.nodes:
        if node.target is not aten.sum.dim_IntList or node.kwargs_dict().get("dtype") is not torch.uint8:
            continue
        lanes = graph[node.inputs[0]]
        if lanes.target is not aten.mul.Tensor or len(lanes.inputs) != 2:
            continue
        if not _is_weights(graph, graph[lanes.inputs[1]]):
            continue
        chain, x = [node.name, lanes.name], lanes.inputs[0]
        while graph[x].target in (aten.view.default, aten.constant_pad_nd.default, aten.permute.default):
            chain.append(x)
            x = graph[x].inputs[0]
        layout = bit_layout(graph[x].meta) if len(graph[x].outputs) == 1 and graph[x].outputs[0] else None
        if layout is not None and node.meta.shape == layout.packed_shape:
            found.setdefault(x, (node.name, frozenset(chain)))
    return found


def _is_whole(graph: Graph, name: str, storage: tuple[str, int], meta: TensorMeta) -> bool:
    """Node ``name``'s value is the whole of ``storage`` (of ``meta``): its owner's element, a
    ``getitem`` of it, or a ``detach``/``alias`` of such."""
    node = graph[name]
    if name == storage[0]:
        return not node.tuple_output and storage[1] == 0
    if len(node.outputs) != 1 or node.outputs[0] != meta:
        return False
    if node.target is operator.getitem:
        return node.args[0].name == storage[0] and node.args[1] == storage[1]
    if node.target in (aten.detach.default, aten.alias.default):
        return _is_whole(graph, node.inputs[0], storage, meta)
    return False


def packed_masks(graph: Graph, timeline: Timeline, proposals: Sequence[BitMask]) -> Rewrite | None:
    """``proposals`` (of ``timeline``, different masks) applied in one rewrite: each mask packed
    into bits right after its ``after`` node (unless it is packed already), unpacked right
    before each of its ``readers``; ``None`` where the rewritten step peaks higher (Echo's
    guarantee) or a reader would see a layout other than the mask's."""
    if not proposals:
        return None
    pos, order = timeline.pos, timeline.order
    first = min(proposals, key=lambda p: pos[p.after])
    after: dict[str, list[str]] = {}  # new nodes placed right after / before an old node
    before: dict[str, list[str]] = {}
    weights = _weights_before(graph, pos, pos[first.after])
    base, costs = graph, [p.cost for p in proposals]
    if weights is None:  # the lane weights 1, 2, ..., 128, made once, before the first pack
        build = NodeBuilder(graph, first.source)
        weights = _lane_weights(build, Ref(first.source), graph[first.target].role)
        after[first.after] = [n.name for n in build.nodes]
        base = rebuild(graph, _placed(order, after, before), build.nodes)
        costs.append({p: BITS for p in timeline.peak_steps if p > pos[first.after]})
    added: list[Node] = [base[name] for names in after.values() for name in names]
    reads: dict[str, dict[str, str]] = {}  # reader -> {carrier: its unpacked copy}
    for proposal in proposals:
        build = NodeBuilder(base, proposal.source)
        if proposal.packed is None:
            packed = _pack(build, Ref(proposal.source), proposal.layout, weights, graph[proposal.target].role)
            after.setdefault(proposal.after, []).extend(n.name for n in build.nodes)
        else:
            packed = Ref(proposal.packed)
        meta = graph[proposal.source].meta
        for reader in sorted(proposal.readers, key=pos.__getitem__):
            start = len(build.nodes)
            unpacked = _unpack(build, packed, proposal.layout, weights, graph[reader].role)
            if not _same_layout(build.nodes[-1].meta, meta):
                return None
            before.setdefault(reader, []).extend(n.name for n in build.nodes[start:])
            reads.setdefault(reader, {}).update(dict.fromkeys(proposal.readers[reader], unpacked.name))
        added.extend(build.nodes)
    rewired = [
        replace(graph[r], args=map_refs(graph[r].args, _to(m)), kwargs=map_refs(graph[r].kwargs, _to(m)))
        for r, m in reads.items()
    ]
    carriers = [c for p in proposals for c in p.saved.carriers]
    result = prune_dead(rebuild(base, _placed(order, after, before), [*added, *rewired]), carriers)
    memory = timeline.not_raised_by(result)
    if memory is None:
        return None
    saving = net_saving(timeline, _summed(p.freed for p in proposals), _summed(costs))
    if saving is None:
        return None
    readers = sum(len(p.readers) for p in proposals)
    what = proposals[0].target if len(proposals) == 1 else f"{len(proposals)} masks"
    if all(p.packed is not None for p in proposals):
        where = "as packed already"
    elif any(p.after == p.source for p in proposals):
        where = "where made"
    else:
        where = "after the last forward reader"
    description = (
        f"pack bits of {what} {where}: bool kept 8 to a byte for {readers} reader(s), {saving} bytes saved at the peak"
    )
    touched = {n.name for n in added} | set(reads) | (set(graph.index) - set(result.index))
    return Rewrite(result, description, tuple(n.name for n in result.nodes), frozenset(touched), saving, memory)


def _to(mapping: dict[str, str]) -> Callable[[Ref], Ref]:
    """Read the node ``mapping`` names in place of each of its keys."""

    def to(ref: Ref) -> Ref:
        return Ref(mapping.get(ref.name, ref.name))

    return to


def _summed(parts: Iterable[dict[int, int]]) -> dict[int, int]:
    total: dict[int, int] = {}
    for part in parts:
        for step, nbytes in part.items():
            total[step] = total.get(step, 0) + nbytes
    return total


def _placed(order: Sequence[str], after: dict[str, list[str]], before: dict[str, list[str]]) -> list[str]:
    """``order`` with ``before[n]`` placed right before and ``after[n]`` right after node ``n``."""
    return [new for name in order for new in (*before.get(name, ()), name, *after.get(name, ()))]


def _weights_before(graph: Graph, pos: dict[str, int], step: int) -> Ref | None:
    """Lane weights an earlier packing made (:func:`_lane_weights`), scheduled by ``step``."""
    return next((Ref(n.name) for n in graph.nodes if _is_weights(graph, n) and pos[n.name] <= step), None)


def _is_weights(graph: Graph, node: Node) -> bool:
    """``node`` makes the lane weights ``1 << lane`` in uint8 (:func:`_lane_weights`)."""
    if node.target is not aten._to_copy.default or node.outputs[0] is None or not isinstance(node.args[0], Ref):
        return False
    shifted = graph[node.args[0].name]
    return (
        shifted.target is aten.bitwise_left_shift.Scalar_Tensor
        and shifted.args[0] == 1
        and node.meta.shape == (BITS,)
        and node.meta.dtype is torch.uint8
    )


def _lane_weights(build: NodeBuilder, like: Ref, role: Role) -> Ref:
    """``[1, 2, 4, ..., 128]`` in uint8 on the device of ``like``: the graph records no device,
    so the weights are made from a tensor that has one (``new_ones``), then ``1 << (cumsum - 1)``
    in int64, cast to uint8 last: Inductor (torch 2.13) computes a uint8 ``cumsum`` in int64 and
    then packs wrong bits, so a compiled plan (``compile=True``) would unpack other masks."""
    ones = build.add("lanes", aten.new_ones.default, (like, [BITS]), {"dtype": torch.uint8}, role=role)
    count = build.add("lanes", aten.cumsum.default, (ones, 0), role=role)
    shift = build.add("lanes", aten.sub.Scalar, (count, 1), role=role)
    shifted = build.add("lanes", aten.bitwise_left_shift.Scalar_Tensor, (1, shift), role=role)
    return build.add("lanes", aten._to_copy.default, (shifted,), {"dtype": torch.uint8}, role=role)


def _pack(build: NodeBuilder, mask: Ref, layout: BitLayout, weights: Ref, role: Role) -> Ref:
    """The mask's bits, eight lanes summed into a uint8 (distinct powers of two: exact)."""
    x = build.add("bits", aten.permute.default, (mask, list(layout.perm)), role=role) if layout.moves else mask
    if layout.pad:
        x = build.add("bits", aten.view.default, (x, [layout.row]), role=role)
        x = build.add("bits", aten.constant_pad_nd.default, (x, [0, layout.pad], 0), role=role)
    x = build.add("bits", aten.view.default, (x, [*layout.packed_shape, BITS]), role=role)
    x = build.add("bits", aten.mul.Tensor, (x, weights), role=role)  # bool * uint8 -> uint8, one bit set
    return build.add("packed", aten.sum.dim_IntList, (x, [-1], False), {"dtype": torch.uint8}, role=role)


def _unpack(build: NodeBuilder, packed: Ref, layout: BitLayout, weights: Ref, role: Role) -> Ref:
    """The bool mask again from its bits, in the mask's own shape and strides."""
    x = build.add("unbits", aten.unsqueeze.default, (packed, -1), role=role)
    x = build.add("unbits", aten.bitwise_and.Tensor, (x, weights), role=role)
    x = build.add("unbits", aten.ne.Scalar, (x, 0), role=role)
    if layout.pad:
        x = build.add("unbits", aten.view.default, (x, [layout.row + layout.pad]), role=role)
        x = build.add("unbits", aten.slice.Tensor, (x, 0, 0, layout.row), role=role)
    x = build.add("unbits", aten.view.default, (x, list(layout.permuted)), role=role)
    if layout.moves:
        inverse = sorted(range(len(layout.perm)), key=layout.perm.__getitem__)
        x = build.add("unbits", aten.permute.default, (x, inverse), role=role)
    return x


def _same_layout(got: TensorMeta, want: TensorMeta) -> bool:
    """Same shape, dtype, and strides along every dimension longer than one."""
    if got.shape != want.shape or got.dtype is not want.dtype or got.strides is None or want.strides is None:
        return False
    return all(a == b for a, b, n in zip(got.strides, want.strides, got.shape) if n != 1)
