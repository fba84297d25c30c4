"""Transient device memory of operators: what a kernel allocates only while it runs.

On CUDA a convolution asks cuDNN for a workspace (often hundreds of MiB at paper
size: U-Net's measured peaks exceeded their simulation by 14-20% without it). The
caching allocator hands it out like a tensor, so it counts in a step's peak, but the
IR records only what an operator returns. :func:`measure_workspaces` runs each
distinct convolution of a graph once on the device, on random inputs of its recorded
shapes, and reads the allocator's peak; :func:`with_workspaces` writes the bytes into
the nodes' ``workspace`` (MAGIS §5's memory timeline counts a node's workspace at its
step: :func:`magis.cost.memory.simulate_memory`). A fissioned region's parts keep
their whole convolution's workspace (a bound: a smaller batch may need less).

On a CPU nothing is measured: the CPU meter counts live tensors, not the allocator's
scratch, so a CPU plan has no workspaces to hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from magis.cost.op_keys import op_key, replay_strides
from magis.cost.op_timing import prepared_call
from magis.ir.graph import Graph

#: a scratch allocation smaller than this is left out: it would only add noise to the nodes
MIN_WORKSPACE_BYTES = 2**20
#: the operators whose workspaces are measured: cuDNN's convolutions (measured at paper size on an
#: H200, U-Net++'s plan then peaked at its simulated bytes, 0.9999996; before, 2.1% above). Other
#: kernels' scratch (a split reduction's staging buffer) is small; and running every operator on
#: random inputs is what a profiled CUDA cost model does, not a memory plan's business
WORKSPACE_OPS = frozenset({torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default})


def measure_workspaces(graph: Graph, device: torch.device) -> dict[str, int]:
    """Bytes each convolution of ``graph`` (:data:`WORKSPACE_OPS`) allocates on CUDA ``device``
    beyond its outputs while it runs.

    Each distinct application (:func:`~magis.cost.op_keys.op_key`) runs once
    after a warm-up call (which lets cuDNN pick its algorithm) with the allocator's peak
    reset: its workspace is that peak less what is allocated once it returned (its
    inputs and outputs). Nodes below :data:`MIN_WORKSPACE_BYTES` are left out, and so is a
    convolution that cannot run here. The device's peak statistics are reset; the random
    number generators are left as they were.
    """
    if device.type != "cuda":
        raise ValueError(f"workspaces are measured on a CUDA device, not {device}")
    strides = replay_strides(graph)
    by_key: dict[str, int] = {}
    workspaces: dict[str, int] = {}
    with torch.no_grad(), torch.random.fork_rng(devices=[device]):
        for node in graph.nodes:
            if node.target not in WORKSPACE_OPS:
                continue
            key = op_key(graph, node.name, strides)
            if key not in by_key:
                by_key[key] = _scratch_bytes(graph, node.name, strides, device)
            if by_key[key] >= MIN_WORKSPACE_BYTES:
                workspaces[node.name] = by_key[key]
    return workspaces


def _scratch_bytes(graph: Graph, name: str, strides: Mapping, device: torch.device) -> int:
    """The allocator's peak during one call of node ``name`` beyond what the call leaves allocated."""
    try:
        call = prepared_call(graph, name, strides, device)  # its inputs made, one warm-up call
    except Exception:  # an operator that cannot run here holds nothing measurable
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = call()
    torch.cuda.synchronize(device)
    scratch = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    del result, call
    return max(0, scratch)


def with_workspaces(graph: Graph, workspaces: Mapping[str, int]) -> Graph:
    """``graph`` with each named node's ``workspace`` at least the bytes given for it."""
    if not workspaces:
        return graph
    nodes = [
        replace(node, workspace=max(node.workspace, workspaces[node.name])) if node.name in workspaces else node
        for node in graph.nodes
    ]
    return replace(graph, nodes=tuple(nodes))
