"""``magis profile MODEL``: capture a workload's training step, simulate it, optionally run it."""

from __future__ import annotations

import argparse

from magis.api import profile
from magis.commands.common import add_device_argument, add_workload_arguments, emit, load_workload, log


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--run", action="store_true", help="also run the step for real and measure it")


def run(args: argparse.Namespace) -> int:
    if args.run and args.preset == "paper":
        raise ValueError("--run needs real weights: the paper preset is traced on fake tensors; use tiny or small")
    built = load_workload(args.model, args.preset, args.batch)
    log(f"profiling {args.model} ({args.preset})")
    report = profile(built.model, built.example_inputs, built.loss_fn, run=args.run, device=args.device)
    fields = {k: v for k, v in report.to_dict().items() if k != "model"}
    emit({"model": args.model, "preset": args.preset, **fields}, args.json)
    if report.missing_gradients or report.extra_gradients:
        log(
            f"error: magis' gradients cover other parameters than eager PyTorch's: "
            f"missing {report.missing_gradients}, extra {report.extra_gradients}"
        )
        return 1
    return 0
