"""What bench scripts and the command line print: timestamped progress lines on
stderr, plain text tables, and a workload captured with progress; and the workloads the
command line takes: a built-in one by name, or the user's own as ``MODULE:FUNCTION``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from magis.frontend.capture import capture_forward, capture_timed
from magis.frontend.step import TrainingStep, UserStep, as_batch
from magis.ir.graph import Graph
from magis.models import Built, build_workload


def log(message: str) -> None:
    """Progress goes to stderr so that --json output stays parseable."""
    print(f"[magis {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def load_graph(name: str, preset: str, batch: int | None, inference: bool = False) -> tuple[Graph, float]:
    """Build and capture a workload's training step, or its forward alone (``inference``, or a
    workload whose model returns no loss: :attr:`~magis.models.Built.inference`): the graph and
    the capture seconds."""
    log(f"building {name} ({preset})")
    built = load_workload(name, preset, batch)
    inference = inference or built.inference
    log(f"capturing {name} ({preset}{', forward alone' if inference else ''})")
    captured = (
        capture_forward(built.model, built.example_inputs)
        if inference
        else capture_timed(built.model, built.example_inputs, built.loss_fn)
    )
    log(f"captured {len(captured.graph)} nodes in {captured.seconds:.1f} s")
    return captured.graph, captured.seconds


def load_workload(name: str, preset: str, batch: int | None) -> Built:
    """The built-in workload ``name`` at ``preset``, or, when ``name`` is ``MODULE:FUNCTION``,
    the user's: ``FUNCTION()`` (MODULE a module name or a path to a ``.py`` file) returns
    ``(model, batch)`` or ``(model, batch, training_step)``, its sizes its own (no ``batch``)."""
    if ":" not in name:
        return build_workload(name, preset, batch)
    if batch is not None:
        raise ValueError(f"--batch sizes the built-in workloads; {name} makes its own batch")
    module_name, _, function_name = name.rpartition(":")
    function = getattr(_import(module_name), function_name, None)
    if not callable(function):
        raise ValueError(f"{name}: {module_name} has no function {function_name!r}")
    made = function()
    if not _is_workload(made):
        shown = f"a tuple of {len(made)}" if isinstance(made, tuple) else type(made).__name__
        raise ValueError(
            f"{name} must return (model, batch) or (model, batch, training_step), the model a torch.nn.Module; "
            f"it returned {shown}"
        )
    model, example, *step = made
    try:
        example = as_batch(example)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    return Built(StepAsModule(model, step[0]) if step else model, example)


def _is_workload(made: Any) -> bool:
    """``(model, batch)`` or ``(model, batch, training_step)``."""
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        return False
    return isinstance(made[0], torch.nn.Module) and (len(made) == 2 or callable(made[2]))


class StepAsModule(torch.nn.Module):
    """The user's ``training_step(model, *batch) -> loss`` (``training_step(model, batch)`` for a
    mapping) as a module whose output is that loss: what every command takes."""

    def __init__(self, model: torch.nn.Module, training_step: TrainingStep) -> None:
        super().__init__()
        self.model, self.step = model, UserStep(training_step=training_step)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.step.loss(self.model, kwargs if kwargs else args)


def _import(name: str) -> ModuleType:
    """The module ``name``, or the ``.py`` file at that path; a ValueError says why not.
    Its directory (the working directory for a module name) is searched first, as
    ``python`` does for a script, so that the file's own imports of its neighbours work."""
    is_file = name.endswith(".py") or os.sep in name
    directory = str(Path(name).resolve().parent if is_file else Path.cwd())
    if directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        if not is_file:
            return importlib.import_module(name)
        spec = importlib.util.spec_from_file_location(f"magis_workload_{Path(name).stem}", name)
        if spec is None or spec.loader is None or not Path(name).is_file():
            raise FileNotFoundError(f"no such file: {name}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses and pickling look their module up there
        spec.loader.exec_module(module)
        return module
    except Exception as err:  # whatever the user's module raises while it is imported
        raise ValueError(f"cannot import {name}: {type(err).__name__}: {err}") from err


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain text table of dict rows with the same keys."""
    keys = list(rows[0])
    cells = [[format_cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.rjust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def format_cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)[:40]
    return str(value)
