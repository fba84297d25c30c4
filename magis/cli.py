"""The ``magis`` command line: one sub-command per module of :mod:`magis.commands`.

``magis bench`` is the yardstick's (the ``yardstick`` package beside magis, installed with
the ``bench`` extra): the command line names its module, the library never imports it."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

#: sub-command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "models": ("magis.commands.models", "list the built-in workloads and their presets"),
    "profile": ("magis.commands.profile", "capture a workload; simulate (and optionally run) its training step"),
    "schedule": ("magis.commands.schedule", "find a memory-optimal operator order for a workload"),
    "fission": ("magis.commands.fission", "list the F-Tree's fission candidates of a workload"),
    "remat": ("magis.commands.remat", "the peak/latency front of recompute-only (or swap-only) plans, by a greedy"),
    "optimize": ("magis.commands.optimize", "search for the plan that fits a memory or latency limit (MAGIS Alg. 3)"),
    "fits": ("magis.commands.fits", "the largest batch (or sequence) magis and eager PyTorch fit on a device"),
    "bench": ("yardstick.command", "compare magis with its peers on a workload"),
}

#: what to install for a command whose module cannot be imported here
EXTRAS = {"bench": "pip install -e '.[bench]'  (or: pip install 'magis[bench]')"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="magis", description="Fit PyTorch training in less memory (MAGIS).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        try:
            importlib.import_module(module).add_arguments(command)
        except ModuleNotFoundError as missing:
            if name not in EXTRAS:
                raise
            command.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            command.set_defaults(missing=f"needs {missing.name}, which is not installed: {EXTRAS[name]}")
        command.set_defaults(module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "missing", None):
        print(f"magis {args.command}: error: {args.missing}", file=sys.stderr)
        return 2
    try:
        return importlib.import_module(args.module).run(args)
    except (ValueError, RuntimeError) as err:
        if os.environ.get("MAGIS_DEBUG"):
            raise
        print(f"magis {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
