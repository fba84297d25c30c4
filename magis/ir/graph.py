"""The graph IR that every pass of magis reads and writes.

A :class:`Graph` is a DAG of :class:`Node` objects, each an aten operator (or a
graph input) with its output described by :class:`TensorMeta`. It is immutable by
convention: rules build new graphs with :meth:`Graph.replace`, sharing the
untouched nodes, so copying a graph during search is cheap. Derived facts
(index, consumers, storage aliasing) are cached on the graph object that owns them.

Values and storages (MAGIS §2.1): a node's value is a tuple of output *elements*
(one for ordinary ops, several for ops such as ``native_batch_norm``). An element
either owns a freshly allocated storage, or is a view of an element of one of its
inputs (``view``, ``t``, ``getitem`` of a tuple, ``detach``...). Memory is counted
per storage, never per view, exactly as the allocator sees it.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch


class Role(enum.Enum):
    """What a node is in the training step."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    CONSTANT = "constant"  # a tensor baked into the traced program
    ACTIVATION = "activation"  # forward pass: ancestors of the loss
    LOSS = "loss"
    BACKWARD = "backward"  # backward pass intermediates
    GRADIENT = "gradient"  # a parameter's gradient (a graph output)
    BUFFER_UPDATE = "buffer_update"  # new value of a mutated buffer (BatchNorm stats)
    OPTIMIZER = "optimizer"  # the optimizer and its states (magis.frontend.optimizer)
    UPDATE = "update"  # an optimizer's update of parameters, and gradient clipping

    @property
    def persistent(self) -> bool:
        """Resident for the whole step (MAGIS §2.1: parameters, inputs, buffers)."""
        return self in (Role.PARAMETER, Role.BUFFER, Role.INPUT, Role.CONSTANT, Role.OPTIMIZER)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape, dtype and storage size of one output element, and its strides when known.

    ``strides`` is the layout capture saw (``None`` for a tensor a rule made without
    deriving it): kernels whose result depends on the layout, such as the order in
    which dropout draws its mask, are rewritten only where it is known.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    strides: tuple[int, ...] | None = None

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorMeta:
        shape = tuple(int(s) for s in tensor.shape)
        return TensorMeta(shape, tensor.dtype, tensor_nbytes(tensor), tuple(int(s) for s in tensor.stride()))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the storage behind ``tensor`` (works on real, fake and meta tensors)."""
    return int(tensor.untyped_storage().nbytes())


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to another node's value inside a node's arguments."""

    name: str


@dataclass(frozen=True, slots=True)
class Node:
    """One operator application.

    ``target`` is an aten ``OpOverload``, ``operator.getitem``, or ``None`` for a graph
    input. ``args``/``kwargs`` hold constants and :class:`Ref` objects. ``outputs`` has
    one :class:`TensorMeta` (or ``None`` for a missing optional output) per element.
    ``aliases[e]`` is ``None`` when element ``e`` owns a new storage, else a pair
    ``(input position, element of that input)`` it shares storage with.
    ``random`` marks ops whose result depends on the RNG state (dropout): they are
    never re-executed with a different result. ``workspace`` is memory the node holds
    only while it runs, on top of its inputs and outputs.
    """

    name: str
    target: Any
    args: tuple = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    outputs: tuple[TensorMeta | None, ...] = ()
    aliases: tuple[tuple[int, int] | None, ...] = ()
    role: Role = Role.ACTIVATION
    random: bool = False
    tuple_output: bool = False  # the op returns a tuple (consumers use getitem)
    workspace: int = 0  # transient bytes the node needs only while it runs (e.g. a fissioned region)

    #: every :class:`Ref` in the arguments, in argument order (repeats kept); worked out
    #: once, when the (immutable) node is made: the analyses ask for it millions of times
    refs: tuple[Ref, ...] = field(init=False, repr=False, compare=False)
    #: names of the nodes this one reads, in argument order, without repeats
    inputs: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        refs = tuple(iter_refs((self.args, self.kwargs)))
        object.__setattr__(self, "refs", refs)
        object.__setattr__(self, "inputs", tuple(dict.fromkeys(ref.name for ref in refs)))

    @property
    def meta(self) -> TensorMeta:
        """The output of a single-output node."""
        assert len(self.outputs) == 1 and self.outputs[0] is not None, self.name
        return self.outputs[0]

    @property
    def is_input(self) -> bool:
        return self.target is None

    @property
    def op_name(self) -> str:
        return op_name(self.target)

    def kwargs_dict(self) -> dict[str, Any]:
        return dict(self.kwargs)

    @property
    def on_host(self) -> bool:
        """The output lives in host memory (a swap's Store, MAGIS §5.2), not on the device."""
        return bool(getattr(self.target, "host_output", False))

    @property
    def fresh_bytes(self) -> int:
        """Bytes this node allocates: the storages it owns (views allocate nothing)."""
        return sum(m.nbytes for m, a in zip(self.outputs, self.aliases) if m is not None and a is None)


def writes(node: Node) -> tuple[str, ...]:
    """The inputs ``node`` writes in place: an optimizer's update writes its parameters and
    states (:class:`magis.frontend.optimizer.ParameterUpdate`), an in-place aten op the
    arguments its schema marks written (``Tensor(a!)``, positional or an ``out=`` keyword,
    :mod:`magis.rules.in_place`); ``()``
    for a functional op, as every captured op is."""
    written = getattr(node.target, "writes", None)
    if callable(written):
        return written(node)
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return ()
    kwargs = node.kwargs_dict()
    values = (
        node.args[position] if position < len(node.args) and not argument.kwarg_only else kwargs.get(argument.name)
        for position, argument in enumerate(schema.arguments)
    )
    return tuple(
        value.name
        for value, argument in zip(values, schema.arguments)
        if isinstance(value, Ref) and argument.alias_info is not None and argument.alias_info.is_write
    )


def is_view(node: Node) -> bool:
    """Every output element shares storage with an input: no data moves."""
    return all(alias is not None for meta, alias in zip(node.outputs, node.aliases) if meta is not None)


def op_name(target: Any) -> str:
    if target is None:
        return "input"
    name = getattr(target, "__name__", None) or str(target)
    if isinstance(target, torch._ops.OpOverload):
        name = str(target)
    return name


def iter_refs(value: Any) -> Iterator[Ref]:
    """Every :class:`Ref` inside a nested structure of tuples, lists and dicts."""
    if isinstance(value, Ref):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from iter_refs(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_refs(v)


def map_refs(value: Any, fn: Callable[[Ref], Any]) -> Any:
    """Rebuild a nested argument structure with every :class:`Ref` replaced by ``fn(ref)``."""
    if isinstance(value, Ref):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(map_refs(v, fn) for v in value)
    if isinstance(value, list):
        return [map_refs(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: map_refs(v, fn) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Signature:
    """How the graph's inputs and outputs map onto the user's module."""

    parameters: dict[str, str] = field(default_factory=dict)  # input node -> parameter name
    buffers: dict[str, str] = field(default_factory=dict)  # input node -> buffer name
    user_inputs: tuple[str, ...] = ()  # input nodes, in the user's argument order
    loss: str = ""  # node holding the scalar loss
    gradients: dict[str, str] = field(default_factory=dict)  # parameter name -> gradient node
    buffer_updates: dict[str, str] = field(default_factory=dict)  # buffer name -> new value node
    optimizer: str = ""  # input node bound to the optimizer whose update the graph holds, if any
    optimizer_states: dict[str, tuple[str, str]] = field(default_factory=dict)  # input node -> (parameter, key)
    #: per param group, its parameters' names and the options that shape its update, as planned
    #: (magis.frontend.optimizer.group_layout): checked each time the step binds
    optimizer_groups: tuple[tuple[tuple[str, ...], tuple[tuple[str, Any], ...]], ...] = ()
    results: tuple[str, ...] = ()  # an inference step's output tensors, in order (it has no loss)
    #: (weight, bias) input nodes of batch norms whose backward the step takes from their output,
    #: dividing by the weight (magis.rules.output_backward): checked each time the step binds
    divided_by: tuple[tuple[str, str], ...] = ()

    @property
    def inference(self) -> bool:
        """The graph is a forward alone (an inference step): it returns ``results``, no loss."""
        return not self.loss


class GraphError(ValueError):
    """A graph that breaks an invariant of the IR."""


@dataclass(frozen=True, eq=False)
class Graph:
    """An immutable DAG of nodes, listed in one valid topological order.

    ``outputs`` are the node names the step returns: they stay alive until the end.
    """

    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]
    signature: Signature = field(default_factory=Signature)
    #: extra ordering constraints (before, after) that are not data edges, e.g. the
    #: order of random ops, which share one RNG stream.
    order_edges: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise GraphError("duplicate node names")

    # ------------------------------------------------------------------ lookup
    @cached_property
    def index(self) -> dict[str, int]:
        """Position of each node in ``nodes``."""
        return {n.name: i for i, n in enumerate(self.nodes)}

    @cached_property
    def node_of(self) -> dict[str, Node]:
        """Each node by its name (what ``graph[name]`` looks up)."""
        return {n.name: n for n in self.nodes}

    def __getitem__(self, name: str) -> Node:
        return self.node_of[name]

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    @cached_property
    def predecessors(self) -> dict[str, tuple[str, ...]]:
        """Data and ordering predecessors of every node: a node that writes a storage in place
        (:func:`writes`, an optimizer's update) comes after every other reader of that storage."""
        preds = {n.name: list(n.inputs) for n in self.nodes}
        for before, after in (*self.order_edges, *self._write_after_read):
            if before not in preds[after]:
                preds[after].append(before)
        return {k: tuple(v) for k, v in preds.items()}

    @cached_property
    def writers(self) -> dict[tuple[str, int], tuple[str, ...]]:
        """The nodes that write each storage in place (:func:`writes`); most graphs have none."""
        found: dict[tuple[str, int], list[str]] = {}
        for n in self.nodes:
            for name in writes(n):
                for key in self.storages[name]:
                    if key is not None:
                        found.setdefault(key, []).append(n.name)
        return {key: tuple(names) for key, names in found.items()}

    @cached_property
    def _write_after_read(self) -> tuple[tuple[str, str], ...]:
        """(reader, writer) for every node reading, through any view, a storage another node
        writes, unless what it reads is the writer's own result (an in-place op's output, or
        a view of it: read after the write, by its data edge), or the reader writes that
        storage too (in-place adds into views of one gradient: their data edges order them)."""
        writers = self.writers
        if not writers:
            return ()
        viewed: dict[str, frozenset[str]] = {}  # node -> itself and the nodes it is a view of
        for n in self.nodes:
            sources = {n.inputs[alias[0]] for alias in n.aliases if alias is not None}
            viewed[n.name] = frozenset({n.name}).union(*(viewed[s] for s in sources))
        edges = []
        for n in self.nodes:
            for p in n.inputs:
                for key in self.storages[p]:
                    if n.name in writers.get(key, ()):
                        continue
                    edges.extend((n.name, w) for w in writers.get(key, ()) if w not in viewed[p])
        return tuple(dict.fromkeys(edges))

    @cached_property
    def successors(self) -> dict[str, tuple[str, ...]]:
        """Data and ordering successors of every node, in node order."""
        succ: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for p in self.predecessors[n.name]:
                succ[p].append(n.name)
        return {k: tuple(v) for k, v in succ.items()}

    @cached_property
    def consumers(self) -> dict[str, tuple[str, ...]]:
        """Data consumers only (nodes that read a node's value)."""
        cons: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for p in n.inputs:
                cons[p].append(n.name)
        return {k: tuple(v) for k, v in cons.items()}

    @cached_property
    def persistent(self) -> frozenset[str]:
        """Names of the nodes resident for the whole step (:attr:`Role.persistent`)."""
        return frozenset(n.name for n in self.nodes if n.role.persistent)

    @cached_property
    def inputs(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes if n.is_input)

    @cached_property
    def generators(self) -> tuple[torch.Generator, ...]:
        """The generators the graph draws from (a module's own, or torch's default passed by hand), each once."""
        found = (n.target.value for n in self.nodes if n.role is Role.CONSTANT)
        return tuple({id(g): g for g in found if isinstance(g, torch.Generator)}.values())

    @cached_property
    def storages(self) -> dict[str, tuple[tuple[str, int] | None, ...]]:
        """For every node, the storage each output element lives in: ``(owner, element)``.

        Follows view chains back to the node that allocated the storage.
        """
        out: dict[str, tuple[tuple[str, int] | None, ...]] = {}
        for n in self.nodes:
            elems: list[tuple[str, int] | None] = []
            ins = n.inputs
            for e, (m, alias) in enumerate(zip(n.outputs, n.aliases)):
                if m is None:
                    elems.append(None)
                elif alias is None:
                    elems.append((n.name, e))
                else:
                    pos, k = alias
                    elems.append(out[ins[pos]][k])
            out[n.name] = tuple(elems)
        return out

    @cached_property
    def storage_bytes(self) -> dict[tuple[str, int], int]:
        """Device bytes of every storage, keyed by ``(owner, element)``: 0 for a storage in
        host memory (:attr:`Node.on_host`), whose size :attr:`host_storage_bytes` gives."""
        sizes: dict[tuple[str, int], int] = {}
        for n in self.nodes:
            for e, (m, alias) in enumerate(zip(n.outputs, n.aliases)):
                if m is not None and alias is None:
                    sizes[(n.name, e)] = 0 if n.on_host else m.nbytes
        return sizes

    @cached_property
    def host_storage_bytes(self) -> dict[tuple[str, int], int]:
        """Size of every storage held in host memory (swapped out), keyed by ``(owner, element)``."""
        return {
            (n.name, e): m.nbytes
            for n in self.nodes
            if n.on_host
            for e, (m, alias) in enumerate(zip(n.outputs, n.aliases))
            if m is not None and alias is None
        }

    # -------------------------------------------------------------- structure
    def is_schedule(self, order: Sequence[str]) -> bool:
        """True when ``order`` lists every node once and respects every edge."""
        if len(order) != len(self.nodes) or set(order) != set(self.index):
            return False
        pos = {name: i for i, name in enumerate(order)}
        return all(pos[p] < pos[n] for n in order for p in self.predecessors[n])

    def check_schedule(self, order: Sequence[str]) -> None:
        if not self.is_schedule(order):
            raise GraphError("the order is not a topological order of this graph's nodes")

    def ancestors(self, name: str) -> set[str]:
        """All nodes with a path to ``name`` (data or ordering edges)."""
        return _reach(name, self.predecessors)

    def descendants(self, name: str) -> set[str]:
        """All nodes reachable from ``name``."""
        return _reach(name, self.successors)

    def structural_hash(self) -> str:
        """A deterministic hash of the graph's structure, independent of node names and order.

        Each node hashes its operator, constants and output shapes together with the
        hashes of its inputs in argument order (a Merkle hash of the DAG); the graph
        hash combines the sorted node hashes. Used by search to skip graphs it saw.
        """
        node_hash: dict[str, str] = {}
        for n in self.nodes:
            consts = map_refs((n.args, n.kwargs), lambda r: "#" + node_hash[r.name])
            text = repr((n.op_name, consts, n.outputs, n.role.value))
            node_hash[n.name] = hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
        outs = sorted(node_hash[o] for o in self.outputs)
        return hashlib.blake2b(repr((sorted(node_hash.values()), outs)).encode(), digest_size=16).hexdigest()

    # ----------------------------------------------------------------- change
    def replace(
        self,
        remove: Iterable[str] = (),
        add: Sequence[Node] = (),
        rename: dict[str, str] | None = None,
        order_edges: tuple[tuple[str, str], ...] | None = None,
        in_place_of: Mapping[str, str] | None = None,
    ) -> Graph:
        """A new graph without ``remove``, with ``add`` inserted, and references renamed.

        ``rename`` maps an old node name to the node that now provides its value (for
        every consumer, the outputs and the signature). New nodes are placed right
        after the last of their inputs so the node list stays topologically sorted;
        ``in_place_of[new] = old`` places a new node no earlier than where ``old`` was
        (a node that takes a removed one's place in the chain of random ops).
        """
        rename = rename or {}
        removed = set(remove)

        def ren(ref: Ref) -> Ref:
            return Ref(rename.get(ref.name, ref.name))

        kept = [
            replace(n, args=map_refs(n.args, ren), kwargs=map_refs(n.kwargs, ren))
            if rename and any(p in rename for p in n.inputs)
            else n
            for n in self.nodes
            if n.name not in removed
        ]
        kept_positions = [self.index[n.name] for n in kept]
        floors = {
            new: bisect.bisect_left(kept_positions, self.index[old]) - 1 for new, old in (in_place_of or {}).items()
        }
        edges = self.order_edges if order_edges is None else order_edges
        edges = tuple((rename.get(a, a), rename.get(b, b)) for a, b in edges)
        edges = tuple((a, b) for a, b in edges if a not in removed and b not in removed)
        nodes = topological_merge(kept, list(add), floors, edges)
        sig = self.signature
        if rename:
            sig = replace(
                sig,
                loss=rename.get(sig.loss, sig.loss),
                gradients={k: rename.get(v, v) for k, v in sig.gradients.items()},
                buffer_updates={k: rename.get(v, v) for k, v in sig.buffer_updates.items()},
                results=tuple(rename.get(r, r) for r in sig.results),
            )
        return Graph(tuple(nodes), tuple(rename.get(o, o) for o in self.outputs), sig, edges)

    def fresh_name(self, base: str) -> str:
        """A node name not used in this graph."""
        if base not in self.index:
            return base
        i = 1
        while f"{base}_{i}" in self.index:
            i += 1
        return f"{base}_{i}"

    def subgraph_inputs(self, names: Iterable[str]) -> tuple[str, ...]:
        """Nodes outside ``names`` whose values the sub-graph reads."""
        inside = set(names)
        seen: dict[str, None] = {}
        for name in sorted(inside, key=self.index.__getitem__):
            for p in self[name].inputs:
                if p not in inside:
                    seen.setdefault(p, None)
        return tuple(seen)

    def subgraph_outputs(self, names: Iterable[str]) -> tuple[str, ...]:
        """Nodes of ``names`` read outside it or returned by the graph."""
        inside = set(names)
        outs = set(self.outputs)
        return tuple(
            n
            for n in sorted(inside, key=self.index.__getitem__)
            if n in outs or any(c not in inside for c in self.consumers[n])
        )

    def summary(self) -> dict[str, int]:
        """Counts a person wants to see first."""
        return {
            "nodes": len(self.nodes),
            "weight_bytes": sum(self[n].fresh_bytes for n in self.signature.parameters),
        }


def _reach(start: str, edges: dict[str, tuple[str, ...]]) -> set[str]:
    seen: set[str] = set()
    stack = list(edges[start])
    while stack:
        v = stack.pop()
        if v not in seen:
            seen.add(v)
            stack.extend(edges[v])
    return seen


def _dependencies(
    nodes: Sequence[Node], order_edges: Sequence[tuple[str, str]]
) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Each node's count of predecessors and its successors: its inputs and readers, and the
    ``order_edges`` between ``nodes``."""
    indeg = {n.name: len(n.inputs) for n in nodes}
    users: dict[str, list[str]] = {n.name: [] for n in nodes}
    for n in nodes:
        for p in n.inputs:
            users[p].append(n.name)
    for before, after in order_edges:
        if before in users and after in users:
            users[before].append(after)
            indeg[after] += 1
    return indeg, users


def topological_merge(
    kept: list[Node],
    added: list[Node],
    floors: Mapping[str, int] | None = None,
    order_edges: Sequence[tuple[str, str]] = (),
) -> list[Node]:
    """Sort ``kept`` (already in order) plus ``added`` topologically, ``order_edges``
    (the chain of random ops) honoured as dependencies: the node list stays a schedule.

    Kept nodes keep their relative order; each added node goes right after the last
    of its inputs, or after ``kept[floors[name]]`` if that is later (ties broken by
    the order it was given in).
    """
    floors = floors or {}
    nodes = kept + added
    by_name = {n.name: n for n in nodes}
    missing = {p for n in added for p in n.inputs if p not in by_name}
    if missing:
        raise GraphError(f"added nodes read unknown nodes: {sorted(missing)[:5]}")
    priority: dict[str, tuple[float, int]] = {n.name: (float(i), 0) for i, n in enumerate(kept)}
    for j, n in enumerate(added, start=1):
        last = max((priority[p][0] for p in n.inputs if p in priority), default=-1.0)
        last = max(last, float(floors.get(n.name, -1)))
        priority[n.name] = (last + 0.5, j)
    for j, n in enumerate(nodes):  # a node that writes in place runs after every reader: last
        if writes(n):
            priority[n.name] = (float("inf"), j)
    indeg, users = _dependencies(nodes, order_edges)
    heap = [(priority[name], name) for name, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    out: list[Node] = []
    while heap:
        _, name = heapq.heappop(heap)
        out.append(by_name[name])
        for u in users[name]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(heap, (priority[u], u))
    if len(out) != len(nodes):
        raise GraphError("the graph has a cycle")
    return out
