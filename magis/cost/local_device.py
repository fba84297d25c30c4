"""This machine's device: which kind it is, how much memory it has, and a crude
roofline of it, measured (MAGIS §5: what prices the operators the profiler cannot run).

:mod:`magis.cost.device_profiles` describes named devices from their data sheets;
the local device is measured instead, once, and its profile cached with the
operator times (:mod:`magis.cost.timing_cache`).
"""

from __future__ import annotations

import functools
import os
import re

import torch

from magis.cost.device_profiles import PRECISION_OF_DTYPE, DeviceProfile
from magis.cost.op_timing import time_call


def device_tag(device: torch.device) -> str:
    """``cpu``, or ``cuda-<gpu model>``: measurements are only valid on the same kind of device."""
    if device.type == "cuda":
        return "cuda-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return device.type


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure_device_profile(device: torch.device, repeats: int = 5) -> DeviceProfile:
    """A crude roofline of ``device``, for the operators the profiler cannot run.

    Peak FLOP/s per precision from a 256x256 matmul, bandwidth from copying 32 MiB,
    launch overhead from adding two one-element tensors. The figures are achieved
    rates, so the efficiencies are 1.
    """
    n = 256
    peak_flops = {}
    for dtype, precision in PRECISION_OF_DTYPE.items():
        a = torch.rand(n, n, device=device).to(dtype)
        peak_flops[precision] = 2 * n**3 / time_call(functools.partial(torch.mm, a, a), device, repeats)
    peak_flops["tf32"] = peak_flops["fp32"]
    block, target = torch.rand(8 * 2**20, device=device), torch.empty(8 * 2**20, device=device)
    bandwidth = 2 * block.nbytes / time_call(functools.partial(target.copy_, block), device, repeats)
    one = torch.ones(1, device=device)
    launch = time_call(functools.partial(torch.add, one, one), device, repeats)
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
        pinned = torch.empty(block.shape, pin_memory=True)
        host_link = block.nbytes / time_call(functools.partial(pinned.copy_, block), device, repeats)
    else:
        memory = host_memory_bytes()
        host_link = bandwidth
    return DeviceProfile(
        name=device_tag(device),
        peak_flops=peak_flops,
        memory_bandwidth=bandwidth,
        launch_overhead_s=launch,
        host_link_bandwidth=host_link,
        memory_bytes=memory,
        compute_efficiency=1.0,
        bandwidth_efficiency=1.0,
        host_link_efficiency=1.0,
    )
