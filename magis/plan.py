"""A plan: the training step the M-Optimizer chose, ready to train with (what :func:`magis.optimize` returns).

``plan(*batch)`` runs one training step with the magis runtime
(:mod:`magis.backend.runtime`), on the model's parameters as they are at that call
(an optimizer updates them in place between calls): it returns the loss,
accumulates each parameter's gradient into ``.grad`` as ``loss.backward()`` would,
and writes the new BatchNorm statistics into the model's buffers as an eager step
does. Random ops draw from torch's generator in eager's order, so a seeded plan
reproduces a seeded eager step.

The figures are simulated (MAGIS §5): ``peak_bytes`` and ``latency_s`` of the plan,
``baseline_peak_bytes`` and ``baseline_latency_s`` of the captured step in its
captured order, what the magis runtime does without optimization.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from magis.backend.runtime import Program, lower, run_program
from magis.cost.latency import CostModel, estimate_latency
from magis.cost.memory import simulate_memory
from magis.ir.graph import Graph
from magis.search.m_optimizer import Objective, SearchResult


class InfeasibleLimit(ValueError):
    """No plan found meets the limit; the message names the best figure found and the floor."""


@dataclass(eq=False)
class Plan:
    """The optimized training step of one model at one input shape (module docstring)."""

    model: torch.nn.Module = field(repr=False)
    graph: Graph = field(repr=False)  # what runs
    order: tuple[str, ...] = field(repr=False)
    peak_bytes: int
    latency_s: float
    baseline_peak_bytes: int
    baseline_latency_s: float
    device: str
    objective: Objective
    search: SearchResult = field(repr=False)
    baseline: Graph = field(repr=False)  # the captured step, run in its node order
    cost_model: CostModel = field(repr=False)
    planning_only: bool = False  # the model is on fake or meta tensors

    @cached_property
    def program(self) -> Program:
        return lower(self.graph, self.order)

    def __call__(self, *batch: Any) -> torch.Tensor:
        """One training step on ``batch`` (same shapes as the example inputs): the loss."""
        if self.planning_only:
            raise RuntimeError(
                "this plan was made for a model on fake or meta tensors: it needs real weights to run "
                "(optimize the model with its real parameters)"
            )
        self._check_dtypes(batch)
        result = run_program(self.program, self.model, batch)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, gradient in result.gradients.items():
                param = params[name]
                if param.grad is None:
                    param.grad = gradient if _owns_storage(gradient, param) else gradient.clone()
                else:
                    param.grad.add_(gradient)
        return result.loss

    def _check_dtypes(self, batch: tuple[Any, ...]) -> None:
        """Inputs of another dtype than the example's are an error (shapes and their count
        are checked when the runtime binds them)."""
        for i, (name, value) in enumerate(zip(self.graph.signature.user_inputs, batch)):
            meta = self.graph[name].outputs[0]
            if isinstance(value, torch.Tensor) and meta is not None and value.dtype != meta.dtype:
                raise ValueError(f"input {i} has dtype {value.dtype}; the plan was made for {meta.dtype}")

    def report(self) -> dict[str, Any]:
        """A JSON-able summary: the figures, the transformations applied and the search's statistics."""
        best, stats = self.search.best, self.search.stats
        rewrites = [{"rule": s.rule, "description": s.description} for s in best.steps]
        return {
            "device": self.device,
            "mode": self.objective.mode,
            "memory_limit_bytes": self.objective.memory_bytes,
            "latency_limit_s": self.objective.latency_s,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "baseline_latency_s": self.baseline_latency_s,
            "peak_bytes": self.peak_bytes,
            "latency_s": self.latency_s,
            "peak_ratio": self.peak_bytes / self.baseline_peak_bytes,
            "latency_ratio": self.latency_s / self.baseline_latency_s,
            "transformations": {
                "fission": best.regions(),
                "recomputed": [r["description"] for r in rewrites if r["rule"] == "remat"],
                "swapped": [r["description"] for r in rewrites if r["rule"] == "swap"],
                "steps": rewrites,
            },
            "search": {
                "seconds": stats.seconds,
                "states": stats.states,
                "expanded": stats.expanded,
                "duplicates": stats.duplicates,
                "invalid": stats.invalid,
                "first_feasible_s": stats.first_feasible_s,
                "stopped_by": stats.stopped_by,
                "states_per_rule": dict(stats.rules),
            },
        }

    def plot(self, path: str | Path) -> Path:
        """A PNG of the simulated memory over the step's time, the captured step beside the
        plan (MAGIS Figure 16's picture); returns the path written."""
        from matplotlib.figure import Figure  # optional (the "plot" extra); no pyplot: no global state

        path = Path(path)
        fig = Figure(figsize=(8, 4))
        ax = fig.subplots()
        baseline_order = tuple(n.name for n in self.baseline.nodes)
        for label, graph, order in (
            ("captured step", self.baseline, baseline_order),
            ("magis plan", self.graph, self.order),
        ):
            memory = simulate_memory(graph, order).timeline
            latency = estimate_latency(graph, order, self.cost_model)
            ends = [(start + seconds) * 1e3 for start, seconds in zip(latency.start_s, latency.per_node_s)]
            ax.step(ends, [m / 2**20 for m in memory], where="post", label=label)
        if self.objective.memory_bytes is not None:
            ax.axhline(self.objective.memory_bytes / 2**20, color="grey", linestyle="--", label="memory limit")
        ax.set_xlabel(f"simulated time (ms, {self.device})")
        ax.set_ylabel("live memory (MiB)")
        ax.set_title("memory timeline: captured step vs magis plan")
        ax.legend()
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        return path


def _owns_storage(gradient: torch.Tensor, param: torch.Tensor) -> bool:
    """A gradient can become ``.grad`` as it is: a whole tensor laid out like its parameter."""
    return gradient._base is None and gradient.stride() == param.stride() and gradient.dtype == param.dtype
