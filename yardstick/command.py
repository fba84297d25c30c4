"""``magis bench MODEL``: magis and its peers side by side, peak memory and latency against eager PyTorch."""

from __future__ import annotations

import argparse
import logging

from magis.commands.common import add_workload_arguments, emit, log, positive_int
from yardstick.compare import DEFAULT_DEVICE, compare
from yardstick.methods import DEFAULT_BUDGETS, METHODS
from yardstick.protocol import DEFAULT_MAX_REPEATS, DEFAULT_PRECISION, DEFAULT_REPEATS, DEFAULT_WARMUP, Rounds

OPT_IN = [name for name, method in METHODS.items() if method.opt_in]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated methods (default: all but the opt-in {', '.join(OPT_IN)}): {', '.join(METHODS)}; "
        "eager always runs, as the reference (eager+step when every method named is a full step, ...+step)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        nargs="+",
        default=list(DEFAULT_BUDGETS),
        metavar="B",
        help="memory budgets in (0, 1]: torch.compile's activation memory budget (compile@B), the activations' "
        "share of the captured peak Checkmate and DTR plan within (checkmate@B, dtr@B), magis-fission's "
        "fraction of the scheduled peak and magis-optimize's memory limit as a fraction of the captured "
        f"step's peak (default: {' '.join(map(str, DEFAULT_BUDGETS))})",
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="simulate instead of running (always so for the paper preset, which is on fake tensors)",
    )
    parser.add_argument(
        "--device",
        default=None,
        help=f"device profile that prices simulated latencies (default: {DEFAULT_DEVICE})",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=DEFAULT_REPEATS,
        help=f"timed rounds every method runs (default: {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--max-repeats",
        type=positive_int,
        default=None,
        help="timed rounds at most: methods whose latency ratio is not yet within --precision get more rounds "
        f"(default: {DEFAULT_MAX_REPEATS}, or --repeats if larger)",
    )
    parser.add_argument(
        "--precision",
        type=float,
        default=DEFAULT_PRECISION,
        help=f"target relative standard error of every latency ratio (default: {DEFAULT_PRECISION})",
    )
    parser.add_argument(
        "--warmup", type=int, default=DEFAULT_WARMUP, help=f"warm-up rounds (default: {DEFAULT_WARMUP})"
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch intra-op threads of measured runs (default: 1, timed by CPU time; more: by wall time)",
    )
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="also draw the memory-latency plane")


def run(args: argparse.Namespace) -> int:
    methods = None if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
    logging.getLogger("transformers").setLevel(logging.ERROR)  # checkpointing warns that it turns the KV cache off
    rounds = Rounds(args.repeats, args.warmup, args.max_repeats, args.precision)
    comparison = compare(
        args.model,
        args.preset,
        methods,
        args.budget,
        batch=args.batch,
        simulate=args.simulate or args.preset == "paper",
        device=args.device,
        rounds=rounds,
        threads=args.threads,
        progress=log,
    )
    if args.plot:
        from yardstick.plot import plot_tradeoff  # matplotlib is optional (the "bench" extra)

        log(f"plot written to {plot_tradeoff(comparison, args.plot)}")
    emit(comparison.to_json(), args.json)
    return 0
