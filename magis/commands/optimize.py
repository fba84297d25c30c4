"""``magis optimize MODEL``: the M-Optimizer (MAGIS Alg. 3) on a workload, and the plan run for real.

Captures the workload's training step and searches for the plan with the lowest
latency whose simulated peak fits ``--memory-limit``, or the lowest peak within
``--latency-limit`` (:func:`magis.optimize`). ``--run`` runs the plan and eager
PyTorch from the same seed and reports both measured peaks and the largest
gradient difference; ``--plot`` draws the memory timelines of the captured step
and the plan. ``--optimizer adamw|adam|sgd`` plans the whole step, the update included
(``optimize(..., optimizer=)``), the limits then of eager's full step. ``--compile``
runs the plan's segments compiled by Inductor (``optimize(..., compile=True)``).
``--inference`` plans the forward alone (``optimize(..., inference=True)``; always, for an
inference workload of ``magis models``); ``--run`` then compares the outputs.
"""

from __future__ import annotations

import argparse
from typing import Any

from magis.api import measure_against_eager, optimize
from magis.commands.common import (
    add_device_argument,
    add_inference_argument,
    add_workload_arguments,
    emit,
    load_workload,
    log,
)
from magis.fits import OPTIMIZERS
from magis.search.m_optimizer import DEFAULT_MAX_STATES


def memory_limit(text: str) -> int | float | str:
    """``0.5`` (a fraction of the captured step's peak), ``6GiB``/``512MiB``, or bytes (``1000000``)."""
    if text.isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_device_argument(parser)
    add_inference_argument(parser)
    limits = parser.add_mutually_exclusive_group()
    limits.add_argument(
        "--memory-limit",
        type=memory_limit,
        default=None,
        help="lowest latency within this peak: a fraction of the captured step's peak (0.5), "
        "a size (6GiB, 512MiB) or bytes",
    )
    limits.add_argument(
        "--latency-limit",
        type=float,
        default=None,
        help="lowest peak within this latency, a ratio to the captured step's (default: 1.10)",
    )
    parser.add_argument("--time-budget", type=float, default=60.0, help="search seconds (default: 60)")
    parser.add_argument(
        "--max-states", type=int, default=DEFAULT_MAX_STATES, help=f"states searched (default: {DEFAULT_MAX_STATES})"
    )
    parser.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default="none",
        help="plan the whole step with this optimizer's update (default hyperparameters; default: none, "
        "forward and backward only)",
    )
    parser.add_argument(
        "--max-grad-norm", type=float, default=None, help="clip the gradients first (needs --optimizer)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run the plan's segments of operators compiled by Inductor (optimize(compile=True))",
    )
    parser.add_argument(
        "--timed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a CPU, time the plans nearest the search's choice whole and choose by their timings "
        "(optimize(timed=...); --no-timed: by the estimates, repeatable under --max-states; default: timed)",
    )
    parser.add_argument("--run", action="store_true", help="run the plan and eager PyTorch, measure both")
    parser.add_argument("--plot", metavar="F.png", default=None, help="write the memory timelines to this PNG")


def run(args: argparse.Namespace) -> int:
    if args.run and args.preset == "paper":
        raise ValueError("--run needs real weights: the paper preset is traced on fake tensors; use tiny or small")
    if args.run and args.optimizer != "none":
        raise ValueError("--run compares the plan's gradients with eager's: plan without --optimizer to run it")
    built = load_workload(args.model, args.preset, args.batch)
    inference = args.inference or built.inference
    if inference and args.optimizer != "none":
        raise ValueError("--inference plans the forward alone: it takes no --optimizer")
    optimizer_class = OPTIMIZERS[args.optimizer]
    log(f"optimizing {args.model} ({args.preset}{', forward alone' if inference else ''})")
    plan = optimize(
        built.model,
        built.example_inputs,
        None if inference else built.loss_fn,
        inference=inference,
        memory_limit=args.memory_limit,
        latency_limit=args.latency_limit,
        time_budget=args.time_budget,
        device=args.device,
        max_states=args.max_states,
        progress=not args.json,
        optimizer=None if optimizer_class is None else optimizer_class(built.model.parameters()),
        max_grad_norm=args.max_grad_norm,
        compile=args.compile,
        timed=args.timed,
    )
    details = plan.report()
    report: dict[str, Any] = {
        "model": args.model,
        "preset": args.preset,
        "step": "inference" if inference else "training",
        "device": plan.device,
        "mode": details.mode,
        "baseline_peak_bytes": plan.baseline_peak_bytes,
        "baseline_latency_s": plan.baseline_latency_s,
        "peak_bytes": plan.peak_bytes,
        "latency_s": plan.latency_s,
        "peak_ratio": details.peak_ratio,
        "latency_ratio": details.latency_ratio,
        "search_seconds": details.search["seconds"],
        "states": details.search["states"],
        "timed": details.search["timed"],
        "transformations": details.transformations,
        "verified": details.verified,
        "optimizer": details.optimizer,
    }
    if args.run:
        log("running the plan and eager PyTorch")
        step = plan.compiled if args.compile else plan.generated
        report.update(
            measure_against_eager(
                plan.graph, plan.order, built.model, built.example_inputs, built.loss_fn, runtime=step
            )
        )
    report["runtime"] = plan.runtime_summary()  # after the run: a segment's fallback is known once it ran
    if args.plot:
        report["plot"] = str(plan.plot(args.plot))
    if not args.json:
        transformations = report.pop("transformations")
        report["fission"] = transformations["fission"]
        if transformations["divides_by"]:  # batch norms from their outputs: the list is in --json
            report["divides_by"] = f"{len(transformations['divides_by'])} batch norm weights (checked at each call)"
        report["steps"] = [f"{s['rule']}: {s['description']}" for s in transformations["steps"]]
    emit(report, args.json)
    return 0
