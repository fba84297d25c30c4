"""Serenity's irregularly wired networks as inference workloads (Ahn et al., MLSys 2020, §4.1, Table 1).

Serenity schedules the forward pass of four networks for least peak activation memory:
DARTS on ImageNet, SwiftNet on a human-presence dataset (HPD), and RandWire on CIFAR-10
and CIFAR-100. They are written here as plain modules with random weights, in eval mode,
returning logits (no loss): a forward alone is what Serenity orders.

- ``darts-imagenet`` (:class:`DartsImageNet`): the ImageNet network of DARTS (Liu et al.,
  ICLR 2019, Table 3's mobile setting: 48 initial channels, 224x224) cut after its
  first normal cell. Serenity evaluates "only the first cell because it has the highest
  peak memory footprint" (§4.1): the rest of the network stacks the same cell on smaller
  feature maps. The network is the two-convolution stem that strides 224 down to 28, the
  learned normal cell (:data:`DARTS_V2_NORMAL`, the genotype the DARTS paper reports and
  trains on ImageNet), global average pooling and a 1000-way linear layer. ``cells``
  stacks more normal cells (all at 28x28, as the first four of the full network are).
- ``swiftnet-hpd`` (:class:`SwiftNetHPD`): SwiftNet's cell A (Zhang et al. 2019, found by
  GRAM, a node-wise architecture search) for HPD, a two-class human presence/absence
  task. **Neither Serenity's text nor what could be recovered of SwiftNet's paper gives
  cell A's wiring**, so :data:`SWIFTNET_CELL_A` is a reconstruction, not the published
  cell: a DAG of eight operation nodes in which each node concatenates several earlier
  states and applies either a 1x1 convolution or a depthwise-separable 3x3 convolution,
  which is what Serenity says of the network (§3.3: NAS cells "rely on extensive use of
  concatenation", followed by convolutions and depthwise convolutions, the two patterns
  its graph rewriting targets). The input is 128x128 RGB: a choice (HPD's resolution is
  not stated in the text available), a common one for on-device person detection.
- ``randwire-cifar10`` / ``randwire-cifar100`` (:class:`RandWire`): randomly wired
  networks (Xie et al., ICCV 2019, §3 and Table 1) in the small regime (C=78 channels,
  N=32 nodes, Watts-Strogatz graphs WS(K=4, P=0.75)). Each stage is one graph drawn by
  ``networkx.connected_watts_strogatz_graph`` with a fixed seed and made a DAG by
  orienting every edge from the lower node index to the higher (Xie et al. §3.3). A node
  aggregates its inputs by a weighted sum with sigmoid-positive learned weights, then
  applies ReLU, a 3x3 separable convolution and batch normalisation; the nodes with no
  predecessor read the stage input with stride 2, and the stage output averages the
  nodes with no successor. For 32x32 CIFAR images the stem keeps full resolution (both
  stem convolutions stride 1 where ImageNet's stride 2), so the three random stages run
  at 16x16, 8x8 and 4x4. The two workloads differ in their class count and their graphs
  (different seeds): Serenity evaluates one network per dataset.

Serenity's Table 1 (MACs, weights, accuracy per network) is not in the text available
here, so the sizes above follow the networks' own papers, not that table.

``paper`` presets run batch 1 at the paper's input size, as Serenity schedules inference
on edge devices; ``small`` is the same network at a batch whose forward holds 0.1-1 GiB
of live tensors (figures beside :data:`IRREGULAR_WORKLOADS`); ``tiny`` shrinks channels
and images for unit tests. RandWire draws its graphs with ``networkx`` (the ``models``
extra; torch depends on it too).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import networkx
import torch
from torch import nn

from magis.models.workloads import Built, Workload

# ---------------------------------------------------------------------------------------------
# Shared layers
# ---------------------------------------------------------------------------------------------


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1, relu_first: bool = True) -> nn.Sequential:
    """(ReLU,) convolution, batch norm: the ReLU-conv-BN order of DARTS' and RandWire's operations."""
    layers: list[nn.Module] = [nn.ReLU()] if relu_first else []
    layers += [nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(c_out)]
    return nn.Sequential(*layers)


def _relu_dw_pw_bn(c_in: int, c_out: int, stride: int = 1, dilation: int = 1) -> nn.Sequential:
    """ReLU, depthwise 3x3 (optionally dilated), pointwise 1x1, batch norm: one separable convolution.

    The ReLU is not in place: in these networks one state feeds several operations.
    """
    return nn.Sequential(
        nn.ReLU(),
        nn.Conv2d(c_in, c_in, 3, stride, padding=dilation, dilation=dilation, groups=c_in, bias=False),
        nn.Conv2d(c_in, c_out, 1, bias=False),
        nn.BatchNorm2d(c_out),
    )


def _add_all(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return functools.reduce(operator.add, tensors)


class _Classifier(nn.Module):
    """Global average pooling and a linear layer: features ``(N, C, H, W)`` to logits ``(N, classes)``."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features.mean((2, 3)))


# ---------------------------------------------------------------------------------------------
# DARTS (Liu et al., ICLR 2019)
# ---------------------------------------------------------------------------------------------

#: The normal cell DARTS learned (second-order search on CIFAR-10, "DARTS_V2", as the paper draws
#: it), the cell its ImageNet network (Table 3) stacks. Intermediate node 2 + j sums two operations,
#: entries 2j and 2j + 1, each ``(operation, input state)``; states 0 and 1 are the outputs of the
#: two previous cells.
DARTS_V2_NORMAL: tuple[tuple[str, int], ...] = (
    ("sep_conv_3x3", 0),
    ("sep_conv_3x3", 1),
    ("sep_conv_3x3", 0),
    ("sep_conv_3x3", 1),
    ("sep_conv_3x3", 1),
    ("skip_connect", 0),
    ("skip_connect", 0),
    ("dil_conv_3x3", 2),
)
#: The states the cell's output concatenates: all four intermediate nodes.
DARTS_V2_NORMAL_CONCAT: tuple[int, ...] = (2, 3, 4, 5)


class FactorizedReduce(nn.Module):
    """Halve the height and width with two 1x1 stride-2 convolutions on pixel grids offset by one,
    concatenated (DARTS' operation for a cell input twice the cell's resolution)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        if c_out % 2:
            raise ValueError(f"FactorizedReduce needs an even number of output channels, got {c_out}")
        self.relu = nn.ReLU()
        self.even = nn.Conv2d(c_in, c_out // 2, 1, stride=2, bias=False)
        self.odd = nn.Conv2d(c_in, c_out // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(x)
        return self.bn(torch.cat([self.even(x), self.odd(x[:, :, 1:, 1:])], dim=1))


def darts_operation(name: str, channels: int) -> nn.Module:
    """One stride-1 operation of the DARTS search space (Liu et al. §2.1) that the normal cell uses."""
    if name == "skip_connect":
        return nn.Identity()
    if name == "sep_conv_3x3":  # DARTS applies its separable convolution twice
        return nn.Sequential(_relu_dw_pw_bn(channels, channels), _relu_dw_pw_bn(channels, channels))
    if name == "dil_conv_3x3":
        return _relu_dw_pw_bn(channels, channels, dilation=2)
    raise ValueError(f"unknown DARTS operation {name!r}")


class DartsNormalCell(nn.Module):
    """A DARTS normal cell with ``channels`` channels per state (Liu et al. §2.1).

    Its two inputs are first brought to ``channels`` channels at the cell's resolution: a 1x1
    ReLU-conv-BN, or :class:`FactorizedReduce` for the older input when the previous cell
    reduced (twice the resolution). The output concatenates :data:`DARTS_V2_NORMAL_CONCAT`.
    """

    def __init__(
        self,
        c_prev_prev: int,
        c_prev: int,
        channels: int,
        reduction_prev: bool,
        genotype: Sequence[tuple[str, int]] = DARTS_V2_NORMAL,
        concat: Sequence[int] = DARTS_V2_NORMAL_CONCAT,
    ) -> None:
        super().__init__()
        if len(genotype) % 2:
            raise ValueError("a DARTS genotype lists two operations per intermediate node")
        self.preprocess0 = (
            FactorizedReduce(c_prev_prev, channels) if reduction_prev else _conv_bn(c_prev_prev, channels, 1)
        )
        self.preprocess1 = _conv_bn(c_prev, channels, 1)
        self.inputs = tuple(index for _, index in genotype)
        self.ops = nn.ModuleList(darts_operation(name, channels) for name, _ in genotype)
        self.concat = tuple(concat)
        self.out_channels = channels * len(self.concat)

    def forward(self, s0: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
        states = [self.preprocess0(s0), self.preprocess1(s1)]
        for j in range(0, len(self.ops), 2):
            a, b = self.inputs[j], self.inputs[j + 1]
            states.append(self.ops[j](states[a]) + self.ops[j + 1](states[b]))
        return torch.cat([states[i] for i in self.concat], dim=1)


class DartsImageNet(nn.Module):
    """DARTS' ImageNet network up to its ``cells``-th normal cell, then a classifier.

    The stem is DARTS' ImageNet stem: 3x3 stride-2 convolutions 3 -> C/2 -> C (BN, ReLU
    between, BN after), giving state s0 at 1/4 resolution, then ReLU, a 3x3 stride-2
    convolution and BN, giving s1 at 1/8 (28x28 for 224x224 images). Cells read the outputs
    of the two before them. Height and width of the input must be divisible by 8.
    """

    def __init__(self, classes: int = 1000, channels: int = 48, cells: int = 1) -> None:
        super().__init__()
        if channels <= 0 or channels % 2 or cells <= 0:
            raise ValueError(f"channels must be positive and even and cells positive, got {channels}, {cells}")
        self.stem0 = nn.Sequential(
            nn.Conv2d(3, channels // 2, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(channels // 2),
            nn.ReLU(),
            nn.Conv2d(channels // 2, channels, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(channels),
        )
        self.stem1 = _conv_bn(channels, channels, 3, stride=2)
        self.cells = nn.ModuleList()
        c_prev_prev, c_prev = channels, channels
        for index in range(cells):
            cell = DartsNormalCell(c_prev_prev, c_prev, channels, reduction_prev=index == 0)
            self.cells.append(cell)
            c_prev_prev, c_prev = c_prev, cell.out_channels
        self.classifier = _Classifier(c_prev, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        s0 = self.stem0(images)
        s1 = self.stem1(s0)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.classifier(s1)


# ---------------------------------------------------------------------------------------------
# SwiftNet (Zhang et al. 2019): a reconstruction of cell A, see the module docstring
# ---------------------------------------------------------------------------------------------

#: Cell A as rebuilt here (not SwiftNet's published wiring, which is not recoverable from the
#: text available): node k (1-based; state 0 is the cell input) is ``(operation, input states)``.
#: ``"conv"`` concatenates its inputs and applies a 1x1 convolution; ``"sep"`` concatenates them and
#: applies a depthwise 3x3 then a 1x1 convolution. Both end in BN and ReLU with the cell's width.
SWIFTNET_CELL_A: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("sep", (0,)),
    ("conv", (0,)),
    ("sep", (1, 2)),
    ("conv", (0, 1)),
    ("sep", (2, 3, 4)),
    ("conv", (1, 3)),
    ("sep", (4, 5, 6)),
    ("conv", (0, 5, 6)),
)


class SwiftNetNode(nn.Module):
    """Concatenate the inputs, then a 1x1 convolution (``"conv"``) or a depthwise 3x3 and a 1x1
    convolution (``"sep"``), batch norm and ReLU: the concat+conv and concat+depthwise patterns
    of Serenity §3.3."""

    def __init__(self, kind: str, c_in: int, c_out: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        if kind == "sep":
            layers += [nn.Conv2d(c_in, c_in, 3, padding=1, groups=c_in, bias=False), nn.BatchNorm2d(c_in), nn.ReLU()]
        elif kind != "conv":
            raise ValueError(f"unknown SwiftNet node kind {kind!r}: 'conv' or 'sep'")
        layers += [nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]
        self.body = nn.Sequential(*layers)

    def forward(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        # One input is used as it is: a concatenation of one tensor would only copy it.
        return self.body(inputs[0] if len(inputs) == 1 else torch.cat(list(inputs), dim=1))


class SwiftNetCell(nn.Module):
    """A cell of :class:`SwiftNetNode` wired by ``wiring``; the output concatenates the nodes no
    other node reads (as NASNet-style cells do), so it has ``channels`` times their number."""

    def __init__(self, channels: int, wiring: Sequence[tuple[str, tuple[int, ...]]] = SWIFTNET_CELL_A) -> None:
        super().__init__()
        for k, (_, inputs) in enumerate(wiring, start=1):
            if not inputs or any(not 0 <= i < k for i in inputs):
                raise ValueError(f"node {k} must read earlier states only, got {inputs}")
        self.inputs = tuple(tuple(inputs) for _, inputs in wiring)
        self.nodes = nn.ModuleList(SwiftNetNode(kind, channels * len(inputs), channels) for kind, inputs in wiring)
        self.last_reader = {i: k for k, inputs in enumerate(self.inputs, start=1) for i in inputs}
        self.outputs = tuple(k for k in range(1, len(wiring) + 1) if k not in self.last_reader)
        self.out_channels = channels * len(self.outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A state is dropped once its last reader has run, as a framework executing the cell
        # in this order would free it, rather than held until the cell ends.
        states = {0: x}
        for k, (inputs, node) in enumerate(zip(self.inputs, self.nodes), start=1):
            states[k] = node([states[i] for i in inputs])
            for i in inputs:
                if self.last_reader[i] == k:
                    del states[i]
        return torch.cat([states[k] for k in self.outputs], dim=1)


class SwiftNetHPD(nn.Module):
    """Human-presence classifier around SwiftNet's cell A: a 3x3 stride-2 convolution stem (BN,
    ReLU) to ``channels`` channels, the cell at half the input resolution, a classifier."""

    def __init__(self, classes: int = 2, channels: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.cell = SwiftNetCell(channels)
        self.classifier = _Classifier(self.cell.out_channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.cell(self.stem(images)))


# ---------------------------------------------------------------------------------------------
# RandWire (Xie et al., ICCV 2019)
# ---------------------------------------------------------------------------------------------


def ws_dag(nodes: int, k: int, p: float, seed: int) -> tuple[tuple[int, int], ...]:
    """The edges of ``networkx.connected_watts_strogatz_graph(nodes, k, p, seed=seed)``, each
    oriented from its lower node index to its higher: a DAG (Xie et al. §3.3), sorted."""
    graph = networkx.connected_watts_strogatz_graph(nodes, k, p, tries=100, seed=seed)
    return tuple(sorted((min(u, v), max(u, v)) for u, v in graph.edges()))


class RandWireNode(nn.Module):
    """Weighted sum of the inputs (weights passed through a sigmoid, so positive), then ReLU, a 3x3
    separable convolution and BN (Xie et al. §3.2: aggregation, transformation)."""

    def __init__(self, c_in: int, c_out: int, in_degree: int, stride: int) -> None:
        super().__init__()
        # A node of in-degree one takes its input as it is; a weight would only scale it.
        self.edge_weights = nn.Parameter(torch.zeros(in_degree)) if in_degree > 1 else None
        self.transform = _relu_dw_pw_bn(c_in, c_out, stride)

    def forward(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.edge_weights is None:
            return self.transform(inputs[0])
        weights = torch.sigmoid(self.edge_weights)
        return self.transform(_add_all([weights[i] * x for i, x in enumerate(inputs)]))


class RandWireStage(nn.Module):
    """One randomly wired stage: a node per graph node, wired by the DAG's ``edges``.

    The nodes with no predecessor read the stage input with stride 2 (halving the resolution,
    ``c_in`` to ``c_out`` channels); the stage output is the mean of the nodes with no successor.
    A node's output is dropped once its last reader has run, so the forward holds what a
    framework executing the graph in this order would (not every node output until the end).
    """

    def __init__(self, c_in: int, c_out: int, nodes: int, edges: Sequence[tuple[int, int]]) -> None:
        super().__init__()
        if any(not 0 <= u < v < nodes for u, v in edges):
            raise ValueError("edges must run from a lower node index to a higher one, within range")
        self.edges = tuple(edges)
        self.predecessors = tuple(tuple(u for u, v in self.edges if v == node) for node in range(nodes))
        self.sinks = tuple(n for n in range(nodes) if all(u != n for u, _ in self.edges))
        self.last_reader = {u: max(v for w, v in self.edges if w == u) for u, _ in self.edges}
        self.nodes = nn.ModuleList(
            RandWireNode(c_out if preds else c_in, c_out, max(len(preds), 1), 1 if preds else 2)
            for preds in self.predecessors
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs: dict[int, torch.Tensor] = {}
        for index, (node, preds) in enumerate(zip(self.nodes, self.predecessors)):
            outputs[index] = node([outputs[u] for u in preds] if preds else [x])
            for u in preds:
                if self.last_reader[u] == index:
                    del outputs[u]
        return _add_all([outputs[n] for n in self.sinks]) / len(self.sinks)


class RandWire(nn.Module):
    """RandWire's small regime (Xie et al. Table 1) for 32x32 images.

    conv1: 3x3 convolution to C/2 and BN; conv2: ReLU, 3x3 convolution to C, BN (both stride 1
    here, stride 2 on ImageNet); conv3-5: random stages of N/2, N, N nodes with C, 2C, 4C
    channels, each halving the resolution; then ReLU, a 1x1 convolution to 1280 channels, BN,
    ReLU, global average pooling and a linear layer. ``graph_seeds`` seeds the three stages'
    Watts-Strogatz graphs WS(``k``, ``p``).
    """

    def __init__(
        self,
        classes: int = 10,
        channels: int = 78,
        nodes: int = 32,
        k: int = 4,
        p: float = 0.75,
        graph_seeds: Sequence[int] = (0, 1, 2),
        head_channels: int = 1280,
    ) -> None:
        super().__init__()
        if len(graph_seeds) != 3:
            raise ValueError(f"RandWire's small regime has three random stages: give three seeds, got {graph_seeds}")
        self.conv1 = _conv_bn(3, channels // 2, 3, relu_first=False)
        self.conv2 = _conv_bn(channels // 2, channels, 3)
        widths = (channels, channels, 2 * channels, 4 * channels)
        sizes = (nodes // 2, nodes, nodes)
        self.stages = nn.ModuleList(
            RandWireStage(widths[i], widths[i + 1], n, ws_dag(n, k, p, seed))
            for i, (n, seed) in enumerate(zip(sizes, graph_seeds))
        )
        self.head = nn.Sequential(_conv_bn(widths[-1], head_channels, 1), nn.ReLU())
        self.classifier = _Classifier(head_channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.conv2(self.conv1(images))
        for stage in self.stages:
            x = stage(x)
        return self.classifier(self.head(x))


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------


def _images(batch: int, size: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size)


def _build_darts(sizes: dict, batch: int) -> Built:
    network = DartsImageNet(sizes["classes"], sizes["channels"], sizes["cells"])
    return Built(network, (_images(batch, sizes["image"]),))


def _build_swiftnet(sizes: dict, batch: int) -> Built:
    return Built(SwiftNetHPD(sizes["classes"], sizes["channels"]), (_images(batch, sizes["image"]),))


def _build_randwire(sizes: dict, batch: int) -> Built:
    network = RandWire(
        sizes["classes"], sizes["channels"], sizes["nodes"], sizes["k"], sizes["p"], sizes["graph_seeds"], sizes["head"]
    )
    return Built(network, (_images(batch, sizes["image"]),))


# Architecture sizes; presets add the batch and input size.
#
# Measured: one eager forward under no_grad in eval mode (PyTorch's own order), with
# magis.backend.meter.LiveTensorMeter; "peak" counts everything live (weights, input),
# "activations" is that peak less the weights and the input. Aten operators: nodes of
# the forward graph (magis.frontend.capture.capture_forward).
#                      aten ops  weights   paper (batch 1): peak / activations   small: batch, peak / activations
#   darts-imagenet        70    0.26 M         3.87 MiB / 2.30 MiB                 128, 368.5 MiB / 294.0 MiB
#   swiftnet-hpd          49    6.7 K          3.72 MiB / 3.50 MiB                  64, 236.0 MiB / 224.0 MiB
#   randwire-cifar10     755    4.27 M        17.74 MiB / 1.30 MiB                 128, 183.7 MiB / 165.8 MiB
#   randwire-cifar100    760    4.40 M        18.46 MiB / 1.52 MiB                 128, 213.4 MiB / 195.0 MiB
# In PyTorch's order DARTS peaks in its stem (the first convolution's 112x112 output and its
# batch norm's, 2.30 MiB), just above its cell's peak (2.15 MiB); SwiftNet and RandWire peak
# in the cell and in the first random stage.
_DARTS_IMAGENET = dict(classes=1000, channels=48, cells=1, image=224)
_SWIFTNET_HPD = dict(classes=2, channels=16, image=128)
_RANDWIRE_SMALL = dict(channels=78, nodes=32, k=4, p=0.75, head=1280, image=32)
_RANDWIRE_TINY = dict(channels=8, nodes=12, k=4, p=0.75, head=32, image=16)

IRREGULAR_WORKLOADS: tuple[Workload, ...] = (
    Workload(
        "darts-imagenet",
        "DARTS ImageNet network to its first normal cell (Liu et al. 2019; Serenity §4.1), inference",
        {
            "tiny": dict(_DARTS_IMAGENET, batch=2, image=32, channels=8, cells=2, classes=10),
            "small": dict(_DARTS_IMAGENET, batch=128),
            "paper": dict(_DARTS_IMAGENET, batch=1),
        },
        _build_darts,
        inference=True,
    ),
    Workload(
        "swiftnet-hpd",
        "SwiftNet cell A, human presence detection (Zhang et al. 2019; Serenity §4.1; wiring reconstructed), inference",
        {
            "tiny": dict(_SWIFTNET_HPD, batch=2, image=16, channels=4),
            "small": dict(_SWIFTNET_HPD, batch=64),
            "paper": dict(_SWIFTNET_HPD, batch=1),
        },
        _build_swiftnet,
        inference=True,
    ),
    Workload(
        "randwire-cifar10",
        "RandWire small regime, WS(4, 0.75), CIFAR-10 (Xie et al. 2019; Serenity §4.1), inference",
        {
            "tiny": dict(_RANDWIRE_TINY, batch=2, classes=10, graph_seeds=(0, 1, 2)),
            "small": dict(_RANDWIRE_SMALL, batch=128, classes=10, graph_seeds=(0, 1, 2)),
            "paper": dict(_RANDWIRE_SMALL, batch=1, classes=10, graph_seeds=(0, 1, 2)),
        },
        _build_randwire,
        inference=True,
    ),
    Workload(
        "randwire-cifar100",
        "RandWire small regime, WS(4, 0.75), CIFAR-100 (Xie et al. 2019; Serenity §4.1), inference",
        {
            "tiny": dict(_RANDWIRE_TINY, batch=2, classes=100, graph_seeds=(3, 4, 5)),
            "small": dict(_RANDWIRE_SMALL, batch=128, classes=100, graph_seeds=(3, 4, 5)),
            "paper": dict(_RANDWIRE_SMALL, batch=1, classes=100, graph_seeds=(3, 4, 5)),
        },
        _build_randwire,
        inference=True,
    ),
)
