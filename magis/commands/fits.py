"""``magis fits MODEL --device h100``: the largest batch (or sequence length) magis fits on a device, beside eager's.

Builds the workload on fake tensors at each size it tries and plans it for the device
(:func:`magis.fits`): the largest size eager PyTorch fits (its whole step, the optimizer's
update and states included, ``--optimizer none`` for forward and backward only), the
largest size a magis plan fits within ``--latency-limit`` of eager's step at that size,
and what a step at each costs (simulated latency, samples per second). ``--dim sequence``
sizes the sequence length of a model that takes token sequences, its batch held at the
preset's.

``MODEL`` is a built-in workload (``magis models``; its ``--preset``, paper by default, at
other sizes: :meth:`Workload.sized <magis.models.Workload.sized>`) or ``MODULE:FUNCTION``
as the other commands take it, here called with the size: ``FUNCTION(batch_size=n)``
(``FUNCTION(seq_len=n)`` with ``--dim sequence``) returns ``(model, batch)`` or ``(model,
batch, training_step)`` at that size, best built on the meta device.
"""

from __future__ import annotations

import argparse
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from magis import console
from magis.commands.common import emit, positive_int
from magis.cost.device_profiles import DEVICE_PROFILES
from magis.fits import DIMS, MAX_PROBES, OPTIMIZERS, SEARCH_SECONDS, TIME_BUDGET, Make, fits
from magis.models import PRESETS, get_workload

#: the keyword ``MODULE:FUNCTION`` takes its size by, per dimension
SIZE_KEYWORDS = {"batch": "batch_size", "sequence": "seq_len"}
#: where a ``MODULE:FUNCTION``'s search starts (a built-in workload starts at its preset's size)
USER_START = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a workload name (see `magis models`), or your own as MODULE:FUNCTION (a module name or a .py "
        "file; FUNCTION(batch_size=N), or FUNCTION(seq_len=N) with --dim sequence, returns (model, batch) "
        "or (model, batch, training_step))",
    )
    parser.add_argument(
        "--device", required=True, help=f"the device to fit: {', '.join(DEVICE_PROFILES)} (memory and cost model)"
    )
    parser.add_argument(
        "--optimizer", default="adamw", help=f"{', '.join(OPTIMIZERS)}: planned inside the step (default: adamw)"
    )
    parser.add_argument(
        "--latency-limit",
        type=float,
        default=1.10,
        help="a magis plan fits within this ratio to eager's step at the same size (default: 1.10)",
    )
    parser.add_argument("--dim", choices=DIMS, default="batch", help="the size to grow (default: batch)")
    parser.add_argument(
        "--preset", choices=PRESETS, default="paper", help="a built-in workload's size otherwise (default: paper)"
    )
    parser.add_argument("--memory", default=None, help="fit this much memory instead of the device's (e.g. 24GiB)")
    parser.add_argument(
        "--start",
        type=positive_int,
        default=None,
        help=f"the first size tried (default: the preset's; {USER_START} for MODULE:FUNCTION)",
    )
    parser.add_argument(
        "--search-seconds",
        type=float,
        default=SEARCH_SECONDS,
        help=f"magis' search per size probed (default: {SEARCH_SECONDS:g})",
    )
    parser.add_argument(
        "--max-probes", type=int, default=MAX_PROBES, help=f"sizes magis' search probes at most (default: {MAX_PROBES})"
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=TIME_BUDGET,
        help=f"seconds for the whole command: no search starts after (default: {TIME_BUDGET:g})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    make, start = sized_workload(args.model, args.dim, args.preset)
    report = fits(
        make,
        device=args.device,
        optimizer=args.optimizer,
        latency_limit=args.latency_limit,
        dim=args.dim,
        memory_bytes=args.memory,
        start=args.start or start,
        search_seconds=args.search_seconds,
        max_probes=args.max_probes,
        time_budget=args.time_budget,
        name=args.model,
        progress=not args.json,
    ).to_dict()
    if not args.json:
        report = _flat(report)
    emit(report, args.json)
    return 0


def sized_workload(name: str, dim: str, preset: str) -> tuple[Make, int]:
    """``make(n)`` for ``name`` (a built-in workload at ``preset``, or ``MODULE:FUNCTION``) sized
    along ``dim``, and the size to start at."""
    if dim not in DIMS:
        raise ValueError(f"dim must be one of {', '.join(DIMS)}, got {dim!r}")
    if ":" not in name:
        workload = get_workload(name)
        make = workload.sized(dim, preset)
        return make, workload.presets[preset]["batch" if dim == "batch" else "seq"]
    module_name, _, function_name = name.rpartition(":")
    sized = SizedFunction(module_name, function_name, SIZE_KEYWORDS[dim])
    parameters = inspect.signature(sized.function()).parameters.values()
    if not any(p.name == sized.keyword or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        raise ValueError(
            f"{name} cannot be sized along the {dim}: FUNCTION must take {sized.keyword}=N and return "
            "(model, batch) or (model, batch, training_step) at that size"
        )
    return sized, USER_START


@dataclass(frozen=True)
class SizedFunction:
    """``MODULE:FUNCTION`` called with the size as ``keyword``; it pickles by name, so that
    :func:`magis.fits` can capture a size in another process too."""

    module: str
    name: str
    keyword: str

    def function(self) -> Callable[..., tuple]:
        """FUNCTION, imported once as the other commands import it (:func:`magis.console.load_workload`)."""
        return _imported(self.module, self.name)

    def __call__(self, n: int) -> tuple:
        return self.function()(**{self.keyword: n})


@functools.cache
def _imported(module: str, name: str) -> Callable[..., tuple]:
    function = getattr(console._import(module), name, None)
    if not callable(function):
        raise ValueError(f"{module}:{name}: {module} has no function {name!r}")
    return function


def _flat(report: dict[str, Any]) -> dict[str, Any]:
    """The report as ``magis fits`` prints it: each side's answer as lines, the probes as a table."""
    head = ("model", "device", "dim", "optimizer", "memory_bytes", "latency_limit")
    flat: dict[str, Any] = {k: report[k] for k in head}
    for side in ("eager", "magis"):
        flat.update({f"{side}_{k}": v for k, v in report[side].items() if v is not None})
    flat.update({k: v for k, v in report.items() if k not in (*head, "eager", "magis", "probes")})
    flat["probes"] = [
        {
            "side": p["side"],
            "size": p["size"],
            "peak_GiB": p["peak_bytes"] / 2**30,
            "latency_s": p["latency_s"],
            "fits": p["fits"],
            "search_s": "-" if p["search_s"] is None else p["search_s"],
        }
        for p in report["probes"]
    ]
    return flat
