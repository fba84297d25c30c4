"""Measure the true peak of live tensor bytes while a training step runs.

On CUDA the caching allocator keeps exact statistics (``max_memory_allocated``).
On CPU there is no such counter, so :class:`LiveTensorMeter` watches every aten
call through a ``TorchDispatchMode``: it records the storage of every tensor an op
returns, and after each op sums the storages still alive (weak references tell
which were freed). The figure at op i is the memory live while op i has just run —
its inputs, its output and everything else still held — the M_i of MAGIS §2.1.
Resident tensors (parameters, buffers, inputs) are registered up front, as
``torch.cuda.max_memory_allocated`` would count them.

Code compiled by Inductor allocates its buffers below the dispatcher, where that meter
sees nothing: :class:`CpuAllocatorMeter` reads the CPU allocator itself instead (every
allocation and free, as ``torch.profiler`` records them with ``profile_memory``), the
CPU's counterpart of :class:`CudaPeakMeter`. It also counts what kernels allocate for
themselves, which the simulator (live tensors) does not, so it meters compiled code only.

Tensors swapped out to host memory (a swap's Store, MAGIS §5.2) are held in
:data:`HOST_POOL`, never counted as device memory: both meters report the pool's peak
apart, as ``offloaded_bytes``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch._subclasses.fake_tensor import is_fake
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class HostPool:
    """Host memory holding swapped-out tensors: the bytes still alive, and their peak."""

    def __init__(self) -> None:
        self._live: dict[StorageWeakRef, int] = {}
        self.peak_bytes = 0

    def hold(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage until it is freed."""
        storage = tensor.untyped_storage()
        self._live[StorageWeakRef(storage)] = int(storage.nbytes())
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    @property
    def live_bytes(self) -> int:
        for ref in [ref for ref in self._live if ref.expired()]:
            del self._live[ref]
        return sum(self._live.values())

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes


#: where Store puts what it swaps out (one per process, as host memory is)
HOST_POOL = HostPool()


@dataclass
class MeterReading:
    """Peak live bytes and the live bytes after each op (CPU only)."""

    peak_bytes: int
    timeline: list[int] = field(default_factory=list)


class LiveTensorMeter(TorchDispatchMode):
    """Track live tensor storages on CPU; ``peak_bytes`` after the ``with`` block."""

    def __init__(self, resident: Iterable[torch.Tensor] = (), keep_timeline: bool = False) -> None:
        super().__init__()
        self._live: dict[StorageWeakRef, int] = {}
        self._total = 0
        self.peak_bytes = 0
        self.keep_timeline = keep_timeline
        self.timeline: list[int] = []
        for t in resident:
            self._register(t)
        self.peak_bytes = self._total
        self.offloaded_bytes = 0  # peak of host memory holding swapped-out tensors

    def __enter__(self) -> LiveTensorMeter:
        HOST_POOL.reset_peak()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.offloaded_bytes = HOST_POOL.peak_bytes

    def _register(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        # a fake tensor (or a functional one around it: Inductor compiling a segment on the step's
        # first call makes thousands) holds no memory: counted, it made GPT-Neo small's first
        # compiled step look 2.3 times eager's peak
        if type(t) is not torch.Tensor and is_fake(t):
            return
        storage = t.untyped_storage()
        ref = StorageWeakRef(storage)
        nbytes = int(storage.nbytes())
        self._total += nbytes - self._live.get(ref, 0)
        self._live[ref] = nbytes

    def _prune(self) -> None:
        dead = [ref for ref in self._live if ref.expired()]
        for ref in dead:
            self._total -= self._live.pop(ref)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._register(t)
        self._prune()
        self.peak_bytes = max(self.peak_bytes, self._total)
        if self.keep_timeline:
            self.timeline.append(self._total)
        return out

    def reading(self) -> MeterReading:
        return MeterReading(self.peak_bytes, list(self.timeline))


def resident_tensors(model: torch.nn.Module, inputs: Iterable[Any]) -> list[torch.Tensor]:
    """Parameters, buffers and tensor inputs: memory held for the whole step."""
    tensors = [p for p in model.parameters()] + [b for b in model.buffers()]
    tensors += [t for t in tree_leaves(list(inputs)) if isinstance(t, torch.Tensor)]
    return tensors


class CudaPeakMeter:
    """``torch.cuda.max_memory_allocated`` over a block, counted as :class:`LiveTensorMeter`
    counts: the resident tensors, plus what the block allocates above what was held when
    it began.

    Memory the caller holds beside the step (eager's reference gradients kept for a
    comparison, another model) is allocated but belongs to no step: counting it, as the
    raw counter does, made a plan measured after eager look larger by eager's gradients
    (BERT small on an H100: 1.32 of eager's peak where the step alone is 0.97).
    """

    def __init__(self, device: torch.device, resident: Iterable[torch.Tensor] = ()) -> None:
        self.device = device
        storages = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in resident}
        self.resident_bytes = int(sum(storages.values()))
        self.held_at_start = 0
        self.peak_bytes = 0
        self.offloaded_bytes = 0  # peak of pinned host memory holding swapped-out tensors

    def __enter__(self) -> CudaPeakMeter:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.held_at_start = int(torch.cuda.memory_allocated(self.device))
        HOST_POOL.reset_peak()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)
        allocated = int(torch.cuda.max_memory_allocated(self.device)) - self.held_at_start
        self.peak_bytes = self.resident_bytes + allocated
        self.offloaded_bytes = HOST_POOL.peak_bytes


class CpuAllocatorMeter:
    """The CPU allocator's peak over a block, counted as :class:`CudaPeakMeter` counts: the
    resident tensors, plus the most the block's allocations less its frees reached.

    Read from ``torch.profiler``'s allocation events (``profile_memory``), which the
    allocator reports whatever allocates: an aten op, or Inductor's generated code, whose
    buffers :class:`LiveTensorMeter` never sees (module docstring). What a CPU's Store copies
    into :data:`HOST_POOL` (allocated in :data:`HOST_POOL_SCOPE`) is reported apart, as
    ``offloaded_bytes``. A profiler already running in the process cannot be nested, so
    entering it then raises.
    """

    def __init__(self, resident: Iterable[torch.Tensor] = ()) -> None:
        storages = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in resident}
        self.resident_bytes = int(sum(storages.values()))
        self.peak_bytes = 0
        self.offloaded_bytes = 0
        self._profile: torch.profiler.profile | None = None

    def __enter__(self) -> CpuAllocatorMeter:
        if torch.autograd.profiler._is_profiler_enabled:
            raise RuntimeError("the CPU allocator's peak is read through torch.profiler, which is already running")
        # Kineto, below torch.profiler, logs two lines per profile at its default level (a
        # compiled plan's trials meter every segment twice); a level the caller set is kept
        os.environ.setdefault("KINETO_LOG_LEVEL", str(_KINETO_QUIET))
        HOST_POOL.reset_peak()
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._profile is not None
        self._profile.__exit__(*exc)
        events = sorted(_cpu_allocations(self._profile.profiler.kineto_results.experimental_event_tree()))
        hosted: dict[int, bool] = {}  # live allocations by address: made for the host pool?
        running = peak = 0
        for _, size, address, in_host_pool in events:
            if size > 0:
                hosted[address] = in_host_pool
            if not (hosted.pop(address, False) if size < 0 else in_host_pool):
                running += size
                peak = max(peak, running)
        self.peak_bytes = self.resident_bytes + peak
        self.offloaded_bytes = HOST_POOL.peak_bytes
        self._profile = None


#: Kineto's log level above its every message (read when the profiler first starts in a process)
_KINETO_QUIET = 6

#: the profiler scope around an allocation of :data:`HOST_POOL` (a CPU's Store): not device memory
HOST_POOL_SCOPE = "magis::host_pool"


def _cpu_allocations(roots: Iterable[Any]) -> list[tuple[int, int, int, bool]]:
    """``(time, bytes, address, in the host pool's scope)`` of every CPU allocation (bytes > 0)
    and free (< 0) under ``roots``, nodes of the profiler's event tree."""
    found: list[tuple[int, int, int, bool]] = []
    stack = [(node, False) for node in roots]
    while stack:
        node, in_host_pool = stack.pop()
        in_host_pool = in_host_pool or node.name == HOST_POOL_SCOPE
        stack.extend((child, in_host_pool) for child in node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            fields = node.extra_fields
            found.append((node.start_time_ns, fields.alloc_size, fields.ptr, in_host_pool))
    return found


def allocator_meter(
    device: torch.device | None, resident: Iterable[torch.Tensor] = ()
) -> CudaPeakMeter | CpuAllocatorMeter:
    """The allocator's meter of ``device`` (``None``: the CPU): what compiled code is metered by."""
    if device is not None and device.type == "cuda":
        return CudaPeakMeter(device, resident)
    return CpuAllocatorMeter(resident)


def peak_meter(
    model: torch.nn.Module, inputs: Iterable[Any], compiled: bool = False
) -> LiveTensorMeter | CudaPeakMeter | CpuAllocatorMeter:
    """The right meter for where the model lives, and for a step that runs ``compiled`` code
    (Inductor's buffers: on CPU the allocator's meter, as live tensors cannot show them)."""
    device = next(model.parameters()).device
    if device.type == "cuda" or compiled:
        return allocator_meter(device, resident_tensors(model, inputs))
    return LiveTensorMeter(resident_tensors(model, inputs))
