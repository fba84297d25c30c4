"""Workloads of the MAGIS evaluation (§7.1) and of its seed systems, and random graphs for scheduler work (§7.3)."""

from magis.models.convnets import CONVNET_WORKLOADS, VGG16, GoogLeNet, MobileNetV2
from magis.models.irregular import IRREGULAR_WORKLOADS, DartsImageNet, RandWire, SwiftNetHPD
from magis.models.nmt import NMT, NMT_WORKLOADS
from magis.models.random_graphs import random_nasnet_graph, random_randwire_graph, random_training_graph
from magis.models.unet import UNet, UNetPlusPlus
from magis.models.workloads import (
    PRESETS,
    WORKLOADS,
    Built,
    CrossEntropyTask,
    HFTask,
    Workload,
    fake_if,
)
from magis.models.zoo import ZOO, build_workload, get_workload

__all__ = [
    "CONVNET_WORKLOADS",
    "IRREGULAR_WORKLOADS",
    "NMT",
    "NMT_WORKLOADS",
    "PRESETS",
    "VGG16",
    "WORKLOADS",
    "ZOO",
    "Built",
    "CrossEntropyTask",
    "DartsImageNet",
    "GoogLeNet",
    "HFTask",
    "MobileNetV2",
    "RandWire",
    "SwiftNetHPD",
    "UNet",
    "UNetPlusPlus",
    "Workload",
    "build_workload",
    "fake_if",
    "get_workload",
    "random_nasnet_graph",
    "random_randwire_graph",
    "random_training_graph",
]
