"""``magis models``: the built-in workloads and their presets."""

from __future__ import annotations

import argparse

from magis.commands.common import emit
from magis.models import ZOO


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    rows = [
        {
            "model": w.name,
            "description": w.description,
            "step": "inference" if w.inference else "training",
            **{p: _sizes(c) for p, c in w.presets.items()},
        }
        for w in ZOO.values()
    ]
    emit({"workloads": rows}, args.json)
    return 0


def _sizes(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())
