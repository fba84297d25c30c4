"""What fits on a device: the largest batch (or sequence length) magis plans within its memory, beside eager's.

``magis fits MODEL --device h100`` and :func:`fits` answer the question a user asks before
renting a GPU (issue #29): how large a batch can I train with, with magis and without?
Everything is planned, nothing runs: the model is built on fake (or meta) tensors at each
size, its whole training step captured (forward, backward and, by default, AdamW's update
with its states) and simulated against the memory of a device profile
(:data:`~magis.cost.device_profiles.DEVICE_PROFILES`).

- **Eager PyTorch** fits a size when the captured step's simulated peak in its captured
  order (eager's ``loss.backward(); optimizer.step()``) is within the device's usable memory
  (:attr:`~magis.cost.device_profiles.DeviceProfile.usable_memory_bytes`: CUDA's total less
  :data:`~magis.cost.device_profiles.CUDA_RESERVED_BYTES`, 1 GiB for the CUDA context, the
  cuBLAS/cuDNN kernels and workspace, measured on an H100 and an H200). The peak grows with
  the size, so doubling and then bisection find the largest size, on simulation alone.
- **magis** fits a size when its search (the M-Optimizer in memory-limit mode, as
  :func:`magis.optimize` with both limits runs it) finds, within ``search_seconds``, a plan
  whose peak is within that memory and whose latency is within ``latency_limit`` times
  eager's step at that size. Eager's largest size fits already (the captured order is a
  plan); the search probes sizes above it: twice eager's first (doubling), then the size its
  last result predicts (the plan's activation memory, its peak less what every plan holds,
  taken as the same fraction of eager's at every size; halfway once a plan within the memory
  was too slow), kept strictly between the largest size found to fit and the smallest found
  not to. It stops when those two are adjacent, after ``max_probes``
  sizes, or when ``time_budget`` (the whole call's) leaves less than half a search (the last
  search gets what is left). Its answer is a lower bound: a longer search may fit more.

Capturing a large model takes tens of seconds (GPT-Neo 1.3B: about 20 s on one CPU core),
so the step is captured at two sizes (batch) or three (sequence length) and its graph at
every other size derived from those (:class:`~magis.frontend.size_family.SizeFamily`).
One answer is then captured too and compared with its derived graph: eager's, in a child
process while magis searches (:class:`_Verification`), or else magis' at the end. A model
whose graphs are not one polynomial family in the size is captured at every size tried
instead (slow, and said so in the progress lines and the report's ``derived``).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from magis.api import DEFAULT_LATENCY_RATIO, floor_bytes, parse_bytes
from magis.cost.device_profiles import DEVICE_PROFILES
from magis.cost.latency import CostModel, cost_model, estimate_latency
from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture
from magis.frontend.grad_seed import with_grad_seed
from magis.frontend.optimizer import with_optimizer
from magis.frontend.size_family import SizeFamily, SizeFamilyError
from magis.frontend.step import user_model
from magis.ir.graph import Graph
from magis.search.m_optimizer import DEFAULT_MAX_STATES, Objective, m_optimize

#: the dimensions a step can be sized along
DIMS = ("batch", "sequence")
#: the optimizers ``optimizer=`` names (default hyperparameters); "none": forward and backward only
OPTIMIZERS: dict[str, type[torch.optim.Optimizer] | None] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
    "none": None,
}
#: seconds of search per size magis probes: GPT-Neo 1.3B with AdamW (6,200 nodes) took 13 to 14
#: on one core of a busy two-core CPU to find its first plan within an H100's memory at batch
#: 18 and 24 (the first level splits the optimizer's updates before it fissions)
SEARCH_SECONDS = 20.0
#: sizes magis' search probes at most
MAX_PROBES = 4
#: seconds for the whole call: magis probes no more sizes once less than half a search is left
#: (under two minutes for GPT-Neo 1.3B and BERT-base on a two-core CPU, with the 8 s Python takes
#: to import torch and transformers, and room for a search's overrun)
TIME_BUDGET = 95.0
#: captures slower than this verify an answer in a child process, alongside the search: about
#: what a child takes to start (importing torch, transformers and magis on this two-core CPU)
CHILD_AFTER_S = 10.0
#: the size doubling gives up at: a step whose memory does not grow with the size
MAX_SIZE = 2**24
#: the captures the size family is derived from, per dimension (the degree of its polynomials plus one)
_SAMPLES = {"batch": 2, "sequence": 3}

#: ``make(n)``: the model and a batch at size ``n``: ``(model, batch)`` or ``(model, batch, training_step)``
Make = Callable[[int], tuple]


@dataclass(frozen=True)
class Fit:
    """One side's answer: the largest size that fits and what one training step at that size costs.

    ``size`` is 0 when not even size 1 fits. ``samples_per_s`` is the samples of a step (the
    batch: ``size``, or with ``dim="sequence"`` the batch's leading dimension) over its
    simulated latency; ``tokens_per_s`` (sequence only) counts each sample's ``size`` tokens.
    """

    size: int
    peak_bytes: int | None = None
    latency_s: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None


@dataclass(frozen=True)
class Probe:
    """One size tried: eager's captured step, or the plan magis' search found there in ``search_s``."""

    side: str
    size: int
    peak_bytes: int
    latency_s: float
    fits: bool
    search_s: float | None = None


@dataclass(frozen=True)
class FitReport:
    """What :func:`fits` returns; :meth:`to_dict` is its JSON form (``magis fits --json``).

    ``memory_bytes`` is the memory the sizes are checked against; ``magis_latency_ratio``
    the plan's latency over eager's step at the same size; ``magis_stopped_by`` why magis'
    probes stopped: ``"adjacent"`` (the size above its answer was searched and no plan
    found that fits), ``"max_probes"`` or ``"time_budget"``; ``captured`` the sizes
    captured, ``derived`` whether the other sizes' graphs were derived from them,
    ``verified_size`` the answer whose derived graph was captured (it is among ``captured``)
    and found equal (None where no answer was derived).
    """

    model: str
    device: str
    dim: str
    optimizer: str
    memory_bytes: int
    latency_limit: float
    eager: Fit
    magis: Fit
    magis_latency_ratio: float | None
    magis_stopped_by: str
    search_seconds: float
    max_probes: int
    time_budget: float
    probes: tuple[Probe, ...]
    captured: tuple[int, ...]
    derived: bool
    verified_size: int | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: plain numbers, strings, lists and dicts."""
        report = asdict(self)
        report["probes"] = [asdict(p) for p in self.probes]
        report["captured"] = list(self.captured)
        return report


@dataclass(frozen=True)
class _Limits:
    """What a size must meet, and how long magis may search for it."""

    memory_bytes: int
    latency_limit: float
    search_seconds: float
    max_probes: int
    deadline: float  # time.perf_counter() after which no search starts


def fits(
    make: Make,
    *,
    device: str = "h100",
    optimizer: str = "adamw",
    latency_limit: float = DEFAULT_LATENCY_RATIO,
    dim: str = "batch",
    memory_bytes: int | str | None = None,
    start: int = 8,
    search_seconds: float = SEARCH_SECONDS,
    max_probes: int = MAX_PROBES,
    time_budget: float = TIME_BUDGET,
    name: str = "",
    progress: bool = True,
) -> FitReport:
    """The largest size magis fits on ``device`` within ``latency_limit``, beside eager's largest.

    ``make(n)`` builds the model and a batch at size ``n`` (a batch of ``n`` samples, or with
    ``dim="sequence"`` sequences of ``n`` tokens), as ``(model, batch)`` or ``(model, batch,
    training_step)`` (:func:`magis.optimize`'s step); build it on the meta device (``with
    torch.device("meta")``) or under a ``FakeTensorMode`` so that no size allocates anything.
    A built-in workload's is :meth:`Workload.sized <magis.models.Workload.sized>`.
    ``device`` names a device profile (``h100``, ``h200``, ``a100``, ``rtx3090``): its cost
    model and its usable memory, which ``memory_bytes`` (bytes or a size such as ``"24GiB"``)
    replaces. ``optimizer`` (``adamw``, ``adam``, ``sgd``, or ``none``: forward and backward
    only) is built with its default hyperparameters and planned inside the step, its states
    resident. ``start`` (2 or more) is where the search starts and the step is first captured.
    ``search_seconds`` is the search's budget per size probed, ``max_probes`` how many sizes
    it probes at most, ``time_budget`` the seconds of the whole call after which no search
    runs (the captures take what they take; a search runs over its budget by a few seconds). ``name`` labels the report;
    ``progress`` logs a line per size tried on stderr. The module docstring says how each
    side's answer is found.
    """
    started = time.perf_counter()
    optimizer_class = _check(device, optimizer, latency_limit, dim, start, search_seconds, max_probes, time_budget)
    capacity = DEVICE_PROFILES[device].usable_memory_bytes if memory_bytes is None else _bytes(memory_bytes)
    limits = _Limits(capacity, latency_limit, search_seconds, max_probes, started + time_budget)
    log = _log if progress else _quiet
    steps = _Steps(make, dim, start, optimizer_class, cost_model(device), log)
    log(f"{name or 'model'} on {device}: {capacity / 2**30:.2f} GiB usable, sizing the {dim}")
    try:
        eager, magis, stopped_by, probes, verified = _answers(steps, limits, log)
    except SizeFamilyError as err:
        log(f"{err}: capturing every size tried instead (slow)")
        steps.stop_deriving()
        eager, magis, stopped_by, probes, verified = _answers(steps, limits, log)
    return FitReport(
        model=name or type(steps.model).__name__,
        device=device,
        dim=dim,
        optimizer=optimizer,
        memory_bytes=capacity,
        latency_limit=latency_limit,
        eager=eager,
        magis=magis,
        magis_latency_ratio=magis.latency_s / steps.eager(magis.size)[1] if magis.size else None,
        magis_stopped_by=stopped_by,
        search_seconds=search_seconds,
        max_probes=max_probes,
        time_budget=time_budget,
        probes=tuple(probes),
        captured=tuple(sorted({*steps.captured, *([verified] if verified else [])})),
        derived=steps.family is not None,
        verified_size=verified,
        seconds=time.perf_counter() - started,
    )


def _check(
    device: str,
    optimizer: str,
    latency_limit: float,
    dim: str,
    start: int,
    search_seconds: float,
    max_probes: int,
    time_budget: float,
) -> type[torch.optim.Optimizer] | None:
    """Every option checked before anything is built; returns the optimizer's class."""
    if device not in DEVICE_PROFILES:
        raise ValueError(f"unknown device {device!r}: choose one of {', '.join(DEVICE_PROFILES)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    if dim not in DIMS:
        raise ValueError(f"dim must be one of {', '.join(DIMS)}, got {dim!r}")
    if isinstance(latency_limit, bool) or not latency_limit >= 1.0:
        raise ValueError(f"latency_limit is a ratio to eager's step at the same size, >= 1; got {latency_limit!r}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 2:
        raise ValueError(f"start must be an integer of 2 or more, got {start!r}")
    if not (search_seconds > 0 and time_budget > 0):
        raise ValueError(f"search_seconds and time_budget must be positive, got {search_seconds!r}, {time_budget!r}")
    if isinstance(max_probes, bool) or not isinstance(max_probes, int) or max_probes < 0:
        raise ValueError(f"max_probes must be a non-negative integer, got {max_probes!r}")
    return OPTIMIZERS[optimizer]


def _bytes(memory: int | str) -> int:
    value = parse_bytes(memory) if isinstance(memory, str) else memory
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"memory_bytes must be a positive number of bytes or a size such as '24GiB', got {memory!r}")
    return value


def _log(message: str) -> None:
    print(f"[magis fits {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _quiet(message: str) -> None:
    """Progress off: nothing is printed."""


def _captured(make: Make, n: int) -> tuple[torch.nn.Module, Any, Graph]:
    """``make(n)`` and its step captured: the model, the batch and the graph."""
    made = make(n)
    if not (isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], torch.nn.Module)):
        raise ValueError(f"make({n}) must return (model, batch) or (model, batch, training_step)")
    model, batch, *step = made
    model = user_model(model)
    return model, batch, capture(model, batch, training_step=step[0] if step else None)


class _Steps:
    """The training step at each size: its graph (captured, or derived from captures at a few
    sizes), with the optimizer's update, and eager's simulated peak and latency there."""

    def __init__(
        self,
        make: Make,
        dim: str,
        start: int,
        optimizer_class: type[torch.optim.Optimizer] | None,
        costs: CostModel,
        log: Callable[[str], None],
    ) -> None:
        self.make, self.costs, self.log = make, costs, log
        self.sizing_batch = dim == "batch"
        self.captured: dict[int, Graph] = {}
        self.capture_s = 0.0  # the longest capture so far
        sizes = range(start, start + _SAMPLES[dim])
        self.model, batch = self._capture(start)
        first = next((t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)), None)
        self.samples = int(first.shape[0]) if first is not None and first.dim() else 1  # a step's, sizing the sequence
        for n in sizes[1:]:
            self._capture(n)
        self.optimizer = None if optimizer_class is None else optimizer_class(self.model.parameters())
        try:
            self.family: SizeFamily | None = SizeFamily({n: self.captured[n] for n in sizes})
        except SizeFamilyError as err:
            log(f"{err}: capturing every size tried instead (slow)")
            self.family = None
        self._eager: dict[int, tuple[int, float, int]] = {}

    def _capture(self, n: int) -> tuple[torch.nn.Module, Any]:
        began = time.perf_counter()
        model, batch, graph = _captured(self.make, n)
        seconds = time.perf_counter() - began
        self.capture_s = max(self.capture_s, seconds)
        self.log(f"captured size {n}: {len(graph)} nodes in {seconds:.1f} s")
        self.captured[n] = graph
        return model, batch

    def derived(self, n: int) -> bool:
        """Whether the graph at size ``n`` is derived rather than captured."""
        return self.family is not None and n >= 2 and n not in self.captured

    def stop_deriving(self) -> None:
        """Capture every size from now on (a derived graph was found wrong)."""
        self.family = None
        self._eager.clear()

    def graph(self, n: int) -> Graph:
        """The step at size ``n`` with the optimizer's update, as eager runs it (node order)."""
        if self.derived(n):
            assert self.family is not None
            graph = self.family.graph(n)
        else:
            if n not in self.captured:
                self._capture(n)
            graph = self.captured[n]
        graph, _ = with_grad_seed(graph, torch.device("cpu"))
        if self.optimizer is not None:
            graph = with_optimizer(graph, self.optimizer, self.model, None, on_cuda=True)
        return graph

    def eager(self, n: int) -> tuple[int, float, int]:
        """Eager's step at size ``n``: simulated peak, latency and the floor every plan holds."""
        if n not in self._eager:
            graph = self.graph(n)
            order = [node.name for node in graph.nodes]
            memory = simulate_memory(graph, order)
            latency = estimate_latency(graph, order, self.costs).total_s
            self._eager[n] = (memory.peak, latency, floor_bytes(graph, memory))
        return self._eager[n]

    def fit(self, n: int, peak: int | None = None, latency: float | None = None) -> Fit:
        """The answer ``n`` with its cost (eager's step there unless a plan's figures are given)."""
        if n == 0:
            return Fit(0)
        eager_peak, eager_latency, _ = self.eager(n)
        peak = eager_peak if peak is None else peak
        latency = eager_latency if latency is None else latency
        samples = n if self.sizing_batch else self.samples
        return Fit(n, peak, latency, samples / latency, None if self.sizing_batch else samples * n / latency)

    def check(self, n: int, hashed: str) -> int:
        """``n`` when ``hashed`` (its capture's structural hash) is its derived graph's, else a SizeFamilyError."""
        assert self.family is not None
        if self.family.graph(n).structural_hash() != hashed:
            raise SizeFamilyError(f"the graph derived at size {n} differs from its capture")
        self.log(f"size {n}: the derived graph equals its capture")
        return n


class _Verification:
    """The capture of one derived size, compared with its derived graph. The capture runs in a
    child Python process alongside magis' search when a capture takes longer than
    :data:`CHILD_AFTER_S` and ``make`` pickles (a built-in workload's and ``MODULE:FUNCTION``'s
    do, a lambda does not), else in this one when the result is asked for. (A forked child
    would inherit this process' OpenMP threads' state, and hangs in it.)"""

    def __init__(self, steps: _Steps, n: int) -> None:
        self.steps, self.n = steps, n
        self.child: subprocess.Popen | None = None
        if steps.capture_s < CHILD_AFTER_S:
            return
        try:
            payload = pickle.dumps((steps.make, n))
        except (pickle.PicklingError, AttributeError, TypeError):
            return
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        # the child's stderr: a pipe nobody reads until the end could fill up; closed in result()
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115
        self.child = subprocess.Popen(
            [sys.executable, "-c", "from magis.fits import _hash_capture; _hash_capture()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            env={**os.environ, "PYTHONPATH": path},
        )
        assert self.child.stdin is not None
        self.child.stdin.write(payload)
        self.child.stdin.close()

    def result(self) -> int:
        """The size verified (a SizeFamilyError when its graphs differ)."""
        if self.child is not None:
            try:
                self.child.wait(timeout=max(120.0, 4 * self.steps.capture_s))
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
            assert self.child.stdout is not None
            out = self.child.stdout.read()  # one line: the pipe cannot have filled
            self.child.stdout.close()
            self.errors.seek(0)
            errors = self.errors.read().decode(errors="replace").strip().splitlines()
            self.errors.close()
            hashed = out.decode().strip()
            if self.child.returncode == 0 and hashed:
                return self.steps.check(self.n, hashed)
            why = errors[-1] if errors else f"exit status {self.child.returncode}"
            self.steps.log(f"capturing size {self.n} alongside the search failed ({why}): capturing it here")
        return self.steps.check(self.n, _captured(self.steps.make, self.n)[2].structural_hash())


def _hash_capture() -> None:
    """In the child process of :class:`_Verification`: read the pickled ``(make, n)`` from stdin,
    capture size ``n`` and print its structural hash."""
    make, n = pickle.load(sys.stdin.buffer)
    print(_captured(make, n)[2].structural_hash())


def _answers(
    steps: _Steps, limits: _Limits, log: Callable[[str], None]
) -> tuple[Fit, Fit, str, list[Probe], int | None]:
    """Eager's answer, magis' (module docstring), why magis' probes stopped, the probes, and the size verified."""
    probes: list[Probe] = []
    eager = _largest_eager(steps, limits.memory_bytes, probes, log)
    alongside = _Verification(steps, eager) if steps.derived(eager) else None
    magis, stopped_by = _largest_magis(steps, eager, limits, probes, log)
    verified = None
    if alongside is not None:
        verified = alongside.result()
    elif steps.derived(magis.size):
        verified = steps.check(magis.size, _captured(steps.make, magis.size)[2].structural_hash())
    return steps.fit(eager), magis, stopped_by, probes, verified


def _largest_eager(steps: _Steps, capacity: int, probes: list[Probe], log: Callable[[str], None]) -> int:
    """Doubling, then bisection, on eager's simulated peak (it grows with the size)."""

    def fits_eagerly(n: int) -> bool:
        peak, latency, _ = steps.eager(n)
        ok = peak <= capacity
        probes.append(Probe("eager", n, peak, latency, ok))
        log(f"eager, size {n}: peak {peak / 2**30:.2f} GiB, {'fits' if ok else 'does not fit'}")
        return ok

    start = min(steps.captured)
    if fits_eagerly(start):
        low = start
        while fits_eagerly(low * 2):
            low *= 2
            if low >= MAX_SIZE:
                raise ValueError(f"the step's memory does not grow with the size: size {low} still fits")
        high = low * 2
    else:
        high = start
        low = high // 2
        while low and not fits_eagerly(low):
            high, low = low, low // 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits_eagerly(middle) else (low, middle)
    return low


def _largest_magis(
    steps: _Steps, eager: int, limits: _Limits, probes: list[Probe], log: Callable[[str], None]
) -> tuple[Fit, str]:
    """Probe sizes above eager's largest with the search (module docstring): magis' answer, and why it stopped."""
    best = steps.fit(eager)  # the captured order is a plan
    low, high = eager, None
    guess = max(1, 2 * eager)
    too_slow = False  # a plan within the memory was found too slow: the latency limit binds
    for _ in range(limits.max_probes):
        seconds = min(limits.search_seconds, limits.deadline - time.perf_counter())
        if seconds < limits.search_seconds / 2:
            return best, "time_budget"
        peak, latency, search_s = _probe(steps, guess, limits, seconds)
        ok = peak <= limits.memory_bytes and latency <= limits.latency_limit * steps.eager(guess)[1]
        probes.append(Probe("magis", guess, peak, latency, ok, search_s))
        log(
            f"magis, size {guess}: peak {peak / 2**30:.2f} GiB at {latency / steps.eager(guess)[1]:.2f}x eager's "
            f"latency ({search_s:.1f} s of search), {'fits' if ok else 'does not fit'}"
        )
        if ok:
            low, best = guess, steps.fit(guess, peak, latency)
        else:
            high = guess
        if high is not None and high - low <= 1:
            return best, "adjacent"
        too_slow = too_slow or (not ok and peak <= limits.memory_bytes)
        # the memory tells nothing of the latency: once it binds, bisection (a failure set ``high``)
        guess = (low + high) // 2 if too_slow and high else _predict(steps, guess, peak, limits.memory_bytes, low, high)
    return best, "max_probes"


def _probe(steps: _Steps, n: int, limits: _Limits, seconds: float) -> tuple[int, float, float]:
    """Magis' search at size ``n`` for ``seconds``, for a plan within both limits (its memory-limit
    mode): the best plan's peak and latency (the fastest within the memory, else the lowest peak
    found) and the seconds searched."""
    _, latency, floor = steps.eager(n)
    if floor > limits.memory_bytes:  # weights, states and inputs alone do not fit: no plan can
        return floor, latency, 0.0
    objective = Objective("memory", memory_bytes=limits.memory_bytes, latency_s=limits.latency_limit * latency)
    graph = steps.graph(n)
    result = m_optimize(graph, objective, steps.costs, seconds, DEFAULT_MAX_STATES, progress=False)
    return result.best.peak_bytes, result.best.latency_s, result.stats.seconds


def _predict(steps: _Steps, n: int, peak: int, capacity: int, low: int, high: int | None) -> int:
    """The next size to probe: the largest whose plan would fit if the plan found at ``n`` kept
    the same fraction of eager's activation memory (peak less the floor) at every size, kept
    strictly between ``low`` (fits) and ``high`` (does not; None: not found yet)."""
    eager_peak, _, floor = steps.eager(n)
    share = (peak - floor) / max(eager_peak - floor, 1)

    def predicted_fit(m: int) -> bool:
        eager_m, _, floor_m = steps.eager(m)
        return floor_m + share * (eager_m - floor_m) <= capacity

    lo, hi = low, high if high is not None else 2 * max(low, n)
    while high is None and predicted_fit(hi) and hi < MAX_SIZE:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        middle = (lo + hi) // 2
        lo, hi = (middle, hi) if predicted_fit(middle) else (lo, middle)
    ceiling = MAX_SIZE if high is None else high - 1
    return min(max(lo, low + 1), ceiling)
