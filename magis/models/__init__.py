"""Workloads of the MAGIS evaluation (§7.1) and of its seed systems, and random graphs for scheduler work (§7.3)."""

from magis.models.random_graphs import random_nasnet_graph, random_randwire_graph, random_training_graph
from magis.models.unet import UNet, UNetPlusPlus
from magis.models.workloads import (
    PRESETS,
    WORKLOADS,
    Built,
    HFTask,
    SegmentationTask,
    Workload,
    fake_if,
)
from magis.models.zoo import ZOO, build_workload, get_workload

__all__ = [
    "PRESETS",
    "WORKLOADS",
    "ZOO",
    "Built",
    "HFTask",
    "SegmentationTask",
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
