"""A plan's step captured once in a CUDA graph and replayed (issue #30, item 2).

A plan has static shapes and a static schedule, so on CUDA its whole step (the
generated code of :mod:`magis.backend.codegen`, compiled segments included) can be
recorded once as a CUDA graph and replayed at each call: one launch instead of a few
thousand kernel launches from Python. What makes that exact:

- **Memory.** The step is captured into a private memory pool, and every ``del`` of the
  generated code frees into that pool during the capture, so later tensors of the same
  step reuse the memory as they do when the step runs uncaptured: the pool holds the
  plan's peak, not the sum of its tensors. :attr:`CudaGraphStep.pool_bytes` says how much
  it holds (measured, as the reserved memory the capture added).
- **Inputs.** Parameters, buffers and optimizer states keep their storage from call to
  call: the graph reads them in place, and a call that finds one moved (``model.to``,
  ``load_state_dict(assign=True)``) or a non-tensor input changed captures again. The
  user's batch is copied into static buffers before each replay.
- **Outputs.** The loss, gradients and buffer updates live in the pool, where the next
  replay overwrites them: each call hands out copies (a step's memory is then the pool
  plus one copy of its outputs).
- **Randomness.** Dropout draws from the default CUDA generator, which a graph replay
  advances as an uncaptured step does; the warm-up run and the capture leave the
  generators as they found them, so the first replay draws what an eager step would.
- **The limit.** A private pool can hold more than the plan's peak (blocks freed during the
  capture are reused only where they fit): a capture whose pool and output copies exceed
  :attr:`CudaGraphStep.memory_limit` is dropped, and the step runs launch by launch.
- **Swaps.** Stores and Loads run on their side stream inside the capture (it forks
  from and joins the capturing stream); each Store copies into the same pinned host
  buffer at every replay (:attr:`~magis.backend.transfer.TransferStreams.host_buffers`).

A step that cannot be captured (a host synchronisation, an op that CUDA graphs forbid)
runs uncaptured; :attr:`CudaGraphStep.fallback` says why, and ``plan.report()`` shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from magis.backend.codegen import GeneratedStep
from magis.backend.transfer import TransferStreams
from magis.frontend.capture import forked_generators

#: uncaptured runs on a side stream before the capture: lazily initialised libraries (cuBLAS
#: workspaces, Inductor's compiled segments) must not initialise inside the capture
WARMUP_RUNS = 1


@dataclass
class CudaGraphStep:
    """``step`` (a generated step of a program whose tensors are on CUDA) captured as a CUDA
    graph at its first call and replayed at the next ones (module docstring). Called as a
    :class:`~magis.backend.codegen.GeneratedStep` is: on the bound ``env``, adding the outputs."""

    step: GeneratedStep
    user_inputs: tuple[str, ...]  # the batch's nodes: copied into static buffers at each call
    #: bytes the graph's pool and the copies of its outputs may hold (the plan's memory limit
    #: beyond its resident tensors); a capture that holds more is dropped: None, no limit
    memory_limit: int | None = None
    fallback: str | None = None  # why the step runs uncaptured; None while it is captured
    captures: int = 0  # how many times it was captured (again when a bound input moved)
    pool_bytes: int = 0  # device memory the capture reserved: the graph's private pool
    _graph: torch.cuda.CUDAGraph | None = field(default=None, repr=False)
    _static: dict[str, Any] = field(default_factory=dict, repr=False)  # what the capture read
    _outputs: dict[str, Any] = field(default_factory=dict, repr=False)  # what it wrote

    def __call__(self, env: dict[str, Any]) -> dict[str, Any]:
        if self._graph is None and self.fallback is None:
            self.fallback = uncapturable(self.step, env)
        if self.fallback is not None:
            return self.step(env)
        if self._graph is None or not self._bound_as_captured(env):
            try:
                self._capture(env)
            except Exception as err:  # any step that cannot be captured still runs, uncaptured
                self._graph, self._static, self._outputs = None, {}, {}
                self.fallback = f"the step could not be captured in a CUDA graph: {type(err).__name__}: {err}"
                return self.step(env)
        with torch.no_grad():
            for name in self.user_inputs:
                if isinstance(env[name], torch.Tensor):
                    self._static[name].copy_(env[name])
            self._graph.replay()
            env.update({name: _copy(value) for name, value in self._outputs.items()})
        return env

    def _bound_as_captured(self, env: dict[str, Any]) -> bool:
        """Whether every input the graph reads in place is where it was at the capture
        (tensors: the same storage, shape and strides; anything else: an equal value)."""
        for name, value in env.items():
            if name in self.user_inputs and isinstance(value, torch.Tensor):
                continue
            captured = self._static.get(name)
            if isinstance(value, torch.Tensor):
                if not isinstance(captured, torch.Tensor) or not _same_tensor(value, captured):
                    return False
            elif captured is not value and captured != value:
                return False
        return True

    def _capture(self, env: dict[str, Any]) -> None:
        """Warm up, then record one step into a fresh graph and private pool (module docstring)."""
        device = next(v.device for v in env.values() if isinstance(v, torch.Tensor) and v.is_cuda)
        static = {
            name: value.clone() if name in self.user_inputs and isinstance(value, torch.Tensor) else value
            for name, value in env.items()
        }
        streams = TransferStreams(device, host_buffers={}) if self.step.program.swaps else None
        side = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        # the warm-up and the capture draw as a step does: every generator the step draws from is
        # left as it was (a module's own too), so the first call's draws are eager's
        generators = forked_generators(self.step.program.graph.generators, [device.index or 0])
        with generators, torch.no_grad():
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self.step.function(dict(static), streams)
            torch.cuda.current_stream(device).wait_stream(side)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # the warm-up's blocks are not the pool's: give them back
            reserved = torch.cuda.memory_reserved(device)
            run = dict(static)
            with torch.cuda.graph(graph):
                self.step.function(run, streams)
            torch.cuda.synchronize(device)
        self.pool_bytes = int(torch.cuda.memory_reserved(device)) - int(reserved)
        self.captures += 1
        outputs = {name: run[name] for name in self.step.program.graph.outputs if name not in static}
        held = self.pool_bytes + sum(v.nbytes for v in outputs.values() if isinstance(v, torch.Tensor))
        if self.memory_limit is not None and held > self.memory_limit:
            del run, outputs, graph
            torch.cuda.empty_cache()
            raise MemoryError(
                f"its pool and the copies of its outputs hold {held / 2**20:.0f} MiB beside the resident "
                f"tensors, above the {self.memory_limit / 2**20:.0f} MiB the memory limit leaves"
            )
        self._graph, self._static, self._outputs = graph, static, outputs


def uncapturable(step: GeneratedStep, env: dict[str, Any]) -> str | None:
    """Why ``step`` bound to ``env`` cannot be replayed as a CUDA graph, or None: a graph reads
    no tensor off the GPU (a CPU step count would stay as the capture left it), and nothing
    it writes in place may be written by the warm-up run too (an optimizer's update, whose
    hyperparameters the host also reads at each call)."""
    graph = step.program.graph
    if graph.signature.optimizer:
        return "the step holds the optimizer's update (its step counts and hyperparameters are read on the host)"
    writers = graph.writers
    written = sorted(n for n in graph.inputs if any(key in writers for key in graph.storages[n] if key is not None))
    if written:
        return f"the step writes its input {written[0]} in place"
    on_host = sorted(n for n, v in env.items() if isinstance(v, torch.Tensor) and not v.is_cuda)
    if on_host:
        return f"the step reads {on_host[0]} from {env[on_host[0]].device}: a CUDA graph replays device work only"
    return None


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _copy(value: Any) -> Any:
    """A captured output handed out: the next replay rewrites the graph's own tensor."""
    return value.clone() if isinstance(value, torch.Tensor) else value
