"""Random irregular graphs for scheduler work.

MAGIS §7.3 evaluates incremental scheduling on "randomly generated DNNs with
structures resembling NASNet". These generators give such graphs directly as a
:class:`magis.ir.Graph` of abstract operators: targets are op labels such as
``"sep_conv_3x3"`` (not executable), each node has one output that owns its
storage (float32 feature maps ``(batch, channels, height, width)``; int64 labels),
and the graph ends in a cross-entropy loss, its only output. Only the structure
and the tensor sizes matter, which is all a scheduler or the memory simulator reads.

- :func:`random_nasnet_graph`: NASNet-like (Zoph et al. 2018) cells. Each cell reads
  the outputs of the two cells before it, combines ``blocks`` pairs of randomly
  chosen operations on randomly chosen earlier states, and concatenates the states
  no block consumed. Two reduction cells, at 1/3 and 2/3 of the depth, halve the
  feature map and double the channels.
- :func:`random_randwire_graph`: RandWire-like (Xie et al. 2019) stages, each a
  Watts-Strogatz small-world graph oriented into a DAG; a stage's first nodes halve
  the feature map and double the channels.

Sizes (batch, image, channels) are drawn from realistic ranges; everything is
deterministic for a given seed.
"""

from __future__ import annotations

import math
import random

import torch

from magis.ir.graph import Graph, Node, Ref, Role, TensorMeta

Shape = tuple[int, ...]

_CELL_OPS = ("sep_conv_3x3", "sep_conv_5x5", "sep_conv_7x7", "dil_conv_3x3", "avg_pool_3x3", "max_pool_3x3")
_BATCHES = (8, 16, 32, 64)
_IMAGES = (32, 64, 112, 224)
_CHANNELS = (16, 24, 32, 48, 64)
_CLASSES = (10, 100, 1000)


class _GraphBuilder:
    """Appends abstract nodes in topological order and remembers their shapes."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.shapes: dict[str, Shape] = {}

    def _add(self, target: str | None, inputs: list[str], shape: Shape, role: Role, dtype: torch.dtype) -> str:
        name = f"{target or 'input'}_{len(self.nodes)}"
        meta = TensorMeta(shape, dtype, math.prod(shape) * dtype.itemsize)
        args = tuple(Ref(i) for i in inputs)
        self.nodes.append(Node(name, target, args=args, outputs=(meta,), aliases=(None,), role=role))
        self.shapes[name] = shape
        return name

    def input(self, shape: Shape, dtype: torch.dtype = torch.float32) -> str:
        return self._add(None, [], shape, Role.INPUT, dtype)

    def op(self, target: str, inputs: list[str], shape: Shape, role: Role = Role.ACTIVATION) -> str:
        return self._add(target, inputs, shape, role, torch.float32)

    def classifier_loss(self, features: str, labels: str, classes: int) -> None:
        """Global pooling, a linear layer and the cross-entropy loss."""
        batch, channels = self.shapes[features][:2]
        pooled = self.op("global_avg_pool", [features], (batch, channels))
        logits = self.op("linear", [pooled], (batch, classes))
        self.op("cross_entropy", [logits, labels], (), Role.LOSS)

    def graph(self) -> Graph:
        """The graph; its outputs are the nodes nothing reads."""
        read = {i for n in self.nodes for i in n.inputs}
        return Graph(tuple(self.nodes), tuple(n.name for n in self.nodes if n.name not in read))


def _inputs_and_stem(b: _GraphBuilder, rng: random.Random) -> tuple[str, str]:
    """Image and label inputs and a stem convolution that, as in ImageNet networks, strides
    large images down to at most 56x56. Returns the names of the stem and the labels."""
    batch, size = rng.choice(_BATCHES), rng.choice(_IMAGES)
    images = b.input((batch, 3, size, size))
    labels = b.input((batch,), torch.int64)
    while size > 56:
        size //= 2
    return b.op("stem_conv", [images], (batch, rng.choice(_CHANNELS), size, size)), labels


def random_nasnet_graph(num_cells: int, seed: int, blocks: int = 5) -> Graph:
    """A NASNet-like graph of ``num_cells`` cells of ``blocks`` blocks each.

    A cell first maps its two inputs (the outputs of the previous two cells) to its
    channel count (``conv_1x1``, or ``factorized_reduce`` when the older one is
    twice as large spatially). Each block applies two random operations to two
    random earlier states of the cell (the first block to the two cell inputs) and
    adds them; the cell output concatenates the block outputs no later block read.
    The graph has exactly ``6 + num_cells * (3 * blocks + 3)`` nodes: two inputs
    (images, labels), a stem convolution, the cells, pooling, a linear layer and the
    loss. With the default 5 blocks a cell is 18 nodes: 1 cell gives 24 nodes, 277
    cells 4992.
    """
    if num_cells < 1 or blocks < 1:
        raise ValueError(f"num_cells and blocks must be positive, got num_cells={num_cells}, blocks={blocks}")
    rng = random.Random(seed)
    b = _GraphBuilder()
    stem, labels = _inputs_and_stem(b, rng)
    batch, channels = b.shapes[stem][:2]
    reductions = {num_cells // 3, 2 * num_cells // 3} - {0}
    prev_prev = prev = stem
    for cell in range(num_cells):
        reduction = cell in reductions
        if reduction:
            channels *= 2
        in_size = b.shapes[prev][2]
        out_size = max(1, in_size // 2) if reduction else in_size
        older = "factorized_reduce" if b.shapes[prev_prev][2] > in_size else "conv_1x1"
        states = [
            b.op(older, [prev_prev], (batch, channels, in_size, in_size)),
            b.op("conv_1x1", [prev], (batch, channels, in_size, in_size)),
        ]
        out_shape = (batch, channels, out_size, out_size)
        read: set[int] = set()
        for block in range(blocks):
            branches = []
            for branch in range(2):
                # The first block reads both cell inputs, so neither is left unused.
                source = branch if block == 0 else rng.randrange(len(states))
                read.add(source)
                branches.append(b.op(rng.choice(_CELL_OPS), [states[source]], out_shape))
            states.append(b.op("add", branches, out_shape))
        loose = [s for k, s in enumerate(states) if k >= 2 and k not in read]
        output = b.op("concat", loose, (batch, channels * len(loose), out_size, out_size))
        prev_prev, prev = prev, output
    b.classifier_loss(prev, labels, rng.choice(_CLASSES))
    return b.graph()


def _watts_strogatz_dag(n: int, k: int, p: float, rng: random.Random) -> list[set[int]]:
    """Predecessors of each node of a Watts-Strogatz graph oriented from lower to higher index.

    Start from a ring where each node links to its ``k // 2`` nearest neighbours on
    each side; rewire each edge's far end with probability ``p`` to a random node it
    is not yet linked to.
    """
    neighbours: list[set[int]] = [set() for _ in range(n)]
    edges = [(i, (i + j) % n) for j in range(1, k // 2 + 1) for i in range(n)]
    for i, j in edges:
        neighbours[i].add(j)
        neighbours[j].add(i)
    for i, j in edges:
        if rng.random() < p and len(neighbours[i]) < n - 1:
            w = rng.randrange(n)
            while w == i or w in neighbours[i]:
                w = rng.randrange(n)
            neighbours[i].discard(j)
            neighbours[j].discard(i)
            neighbours[i].add(w)
            neighbours[w].add(i)
    return [{j for j in neighbours[i] if j < i} for i in range(n)]


def random_randwire_graph(num_nodes: int, seed: int, k: int = 4, p: float = 0.75, stages: int = 3) -> Graph:
    """A RandWire-like graph of exactly ``num_nodes`` nodes.

    Besides the two inputs, the stem convolution, and the pooling, linear and loss
    nodes of the head, the nodes form up to ``stages`` stages (fewer when
    ``num_nodes`` is too small to give each at least ``k + 1`` nodes). A stage is a
    Watts-Strogatz graph WS(n, k, p) oriented into a DAG; each of its nodes
    (``randwire_node``: weighted sum of its inputs, ReLU, separable convolution,
    BatchNorm) reads its predecessors, or the stage input when it has none, and a
    ``mean`` node averages the nodes without successors into the stage output.
    """
    if k < 2 or k % 2 or not 0 <= p <= 1 or stages < 1:
        raise ValueError(f"need an even k >= 2, a probability p and stages >= 1; got k={k}, p={p}, stages={stages}")
    head_and_inputs = 6
    stages = min(stages, (num_nodes - head_and_inputs) // (k + 2))
    if stages < 1:
        raise ValueError(f"num_nodes must be at least {head_and_inputs + k + 2} for k={k}, got {num_nodes}")
    rng = random.Random(seed)
    b = _GraphBuilder()
    stage_input, labels = _inputs_and_stem(b, rng)
    batch, channels, size = b.shapes[stage_input][:3]
    per_stage, extra = divmod(num_nodes - head_and_inputs - stages, stages)
    for stage in range(stages):
        n = per_stage + (stage < extra)
        channels *= 2
        size = max(1, size // 2)
        shape = (batch, channels, size, size)
        preds = _watts_strogatz_dag(n, k, p, rng)
        names: list[str] = []
        for i in range(n):
            names.append(b.op("randwire_node", [names[j] for j in sorted(preds[i])] or [stage_input], shape))
        read = {j for ps in preds for j in ps}
        stage_input = b.op("mean", [names[i] for i in range(n) if i not in read], shape)
    b.classifier_loss(stage_input, labels, rng.choice(_CLASSES))
    return b.graph()


def random_training_graph(layers: int, seed: int, skip: float = 0.3) -> Graph:
    """A small training step of ``layers`` layers: ``2 * layers + 2`` nodes, for rematerialization work.

    An input, a forward chain (layer ``i`` reads layer ``i - 1`` and, with probability
    ``skip``, an earlier layer), a loss, and a backward chain in reverse: the backward
    of layer ``i`` reads the backward of layer ``i + 1`` and the forward value layer
    ``i`` read (what autograd saves), so every forward value is live from its forward
    to its backward, the memory profile checkpointing (Chen et al. 2016) and
    Checkmate (Jain et al. 2020) trade compute against. Feature maps are float32 of
    random sizes (64 KiB to 1 MiB); the last backward value is a graph output (a
    gradient), as is the loss.
    """
    if layers < 1:
        raise ValueError(f"layers must be positive, got {layers}")
    rng = random.Random(seed)
    b = _GraphBuilder()

    def shape() -> Shape:
        return (rng.choice((16, 32, 64, 128, 256)), 1024)

    forward = [b.input(shape())]
    for _ in range(layers):
        inputs = [forward[-1]]
        if len(forward) > 1 and rng.random() < skip:
            inputs.append(forward[rng.randrange(len(forward) - 1)])
        forward.append(b.op("layer", inputs, shape()))
    loss = grad = b.op("loss", [forward[-1]], (), Role.LOSS)
    for i in range(layers, 0, -1):
        role = Role.GRADIENT if i == 1 else Role.BACKWARD
        grad = b.op("layer_backward", [grad, forward[i - 1]], b.shapes[forward[i - 1]], role)
    return Graph(tuple(b.nodes), (loss, grad))
