"""The Store and Load operators of swapping (MAGIS §5.2), and how they run (MAGIS §6.2).

A swap moves a tensor to host memory after it is made and back before its reader
needs it. In the graph these are two nodes whose targets are :class:`Store` (device
→ host; its output lives in host memory, :attr:`~magis.ir.graph.Node.on_host`) and
:class:`Load` (host → device, a fresh device tensor). Both run on a second stream
(``stream = 1``), so the latency model overlaps them with compute; it prices each by
its bytes over the host link (:mod:`magis.cost.host_link`: the rate is a cost figure,
which the runtime never needs).

On CUDA (:class:`TransferStreams`): a Store waits for the compute stream (its input
is ready), copies into pinned host memory on the side stream, and marks the input
as used by that stream, so the allocator reuses its memory only after the copy; the
input leaves device memory when the runtime frees it, right after the Store. A Load
allocates its result on the compute stream, waits for the compute stream (that memory
may have just been freed there), copies on the side stream and records an event; the
first kernel that reads the result waits for that event, so the copy overlaps all the
compute scheduled between the Load and that reader (MAGIS §6.2, last paragraph).

On a CPU there is no separate device memory: a Store copies into :data:`HOST_POOL`
unseen by the meters, which report the pool apart (``offloaded_bytes``),
and a Load copies back as an ordinary op the meter counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import _disable_current_modes

from magis.backend.meter import HOST_POOL, HOST_POOL_SCOPE


@dataclass(frozen=True)
class Store:
    """Copy a device tensor of ``nbytes`` into host memory (its output is on the host)."""

    nbytes: int
    host_output = True
    stream = 1

    @property
    def __name__(self) -> str:  # read by Node.op_name
        return "store"

    def __call__(self, x: torch.Tensor, streams: TransferStreams | None = None) -> torch.Tensor:
        if streams is not None:
            return streams.store(x)
        # not device memory: the meters must not count it
        with _disable_current_modes(), torch.profiler.record_function(HOST_POOL_SCOPE):
            host = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
            host.copy_(x)
        HOST_POOL.hold(host)
        return host


@dataclass(frozen=True)
class Load:
    """Copy a stored tensor of ``nbytes`` back into device memory."""

    nbytes: int
    host_output = False
    stream = 1

    @property
    def __name__(self) -> str:
        return "load"

    def __call__(self, host: torch.Tensor, streams: TransferStreams | None = None) -> torch.Tensor:
        if streams is not None:
            return streams.load(host)
        result = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=host.device)
        return result.copy_(host)


@dataclass
class TransferStreams:
    """The side stream of one CUDA step and the Loads it has not waited for yet."""

    device: torch.device
    #: pinned host memory kept per Store node from step to step (a CUDA graph's replays copy
    #: into the host memory its capture recorded, :mod:`magis.backend.cuda_graph`); None: each
    #: step allocates its own
    host_buffers: dict[str, torch.Tensor] | None = None
    side: torch.cuda.Stream = field(init=False)
    pending: dict[str, torch.cuda.Event] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.side = torch.cuda.Stream(self.device)

    def store(self, x: torch.Tensor, name: str | None = None) -> torch.Tensor:
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            host = self.host_buffers.get(name) if self.host_buffers is not None else None
            if host is None:
                host = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu", pin_memory=True)
                if self.host_buffers is not None and name is not None:
                    self.host_buffers[name] = host
            host.copy_(x, non_blocking=True)
        x.record_stream(self.side)
        HOST_POOL.hold(host)
        return host

    def load(self, host: torch.Tensor) -> torch.Tensor:
        main = torch.cuda.current_stream(self.device)
        result = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            result.copy_(host, non_blocking=True)
        result.record_stream(self.side)  # written there: never reused before the copy is done
        return result

    def run(self, name: str, transfer: Store | Load, value: torch.Tensor) -> torch.Tensor:
        """Issue Store or Load node ``name``; a Load's readers will wait for this point of the side stream."""
        result = self.store(value, name) if isinstance(transfer, Store) else transfer(value, self)
        if isinstance(transfer, Load):
            self.pending[name] = self.side.record_event()
        return result

    def wait_for(self, loads: tuple[str, ...]) -> None:
        """The compute stream waits until the copies of ``loads`` are done."""
        main = torch.cuda.current_stream(self.device)
        for name in loads:
            event = self.pending.get(name)
            if event is not None:
                main.wait_event(event)

    def finish(self) -> None:
        """The compute stream waits for everything on the side stream (end of the step)."""
        torch.cuda.current_stream(self.device).wait_stream(self.side)
