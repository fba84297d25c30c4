"""The yardstick: magis' peers on the seven workloads, measured (small) and simulated (paper).

For every workload of ``magis.models.WORKLOADS``:

- preset ``small``: every method runs for real on this machine (peak from the
  live-tensor meter, latency by the interleaved protocol of ``magis.bench.protocol``,
  gradients checked against eager PyTorch);
- preset ``paper`` (Table 2 of the MAGIS paper): every method's graph goes through
  magis' simulator, latency priced on a device profile (``h200`` by default).

Writes ``<out>/<workload>-<preset>.json`` and ``.png`` (the memory-latency plane,
Pareto front drawn), then prints, per workload, the lowest peak ratio a peer
reaches at no more than 10% latency overhead over eager, measured and simulated
(and magis' own, in columns of their own, when its methods were run: e.g.
``--methods eager,magis-scheduled,magis-fission --out results/magis``).

    python bench/peers.py [--out results/peers] [--models bert-base,unet] [--presets small,paper]
                          [--methods eager,checkpoint-block,...] [--budget 1 0.5 0.1]
                          [--repeats 5] [--device h200]

The summary reads every ``<workload>-<preset>.json`` in ``--out``, so the presets
can be run by separate invocations.

Progress lines go to stderr; the summary table to stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from magis.bench.compare import OVERHEAD, Comparison, Row, best_within, compare
from magis.bench.methods import DEFAULT_BUDGETS, MAGIS, METHODS, PEER
from magis.bench.plot import plot_tradeoff
from magis.bench.protocol import Rounds
from magis.commands.common import format_table, log
from magis.models import WORKLOADS

#: the presets run, and how each is figured
PRESETS = {"small": "small (measured)", "paper": "paper (simulated)"}
#: the default methods: the peers (magis' own can be added with --methods)
PEERS = [name for name, method in METHODS.items() if method.kind == PEER]
#: timed rounds per measured comparison: seven workloads at 5-10 s a step on one core
REPEATS = 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/peers"), help="results folder")
    parser.add_argument("--models", default=",".join(WORKLOADS), help="comma-separated workloads (default: all)")
    parser.add_argument("--presets", default=",".join(PRESETS), help="small (measured), paper (simulated)")
    parser.add_argument("--methods", default=",".join(PEERS), help="comma-separated methods (default: the peers)")
    parser.add_argument("--budget", type=float, nargs="+", default=list(DEFAULT_BUDGETS), metavar="B")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed rounds of measured runs, at least")
    parser.add_argument("--device", default="h200", help="device profile of simulated latencies")
    return parser.parse_args(argv)


def run_one(workload: str, preset: str, args: argparse.Namespace) -> None:
    """Compare the methods on one workload at one preset and write its JSON and PNG."""
    simulated = preset == "paper"
    comparison = compare(
        workload,
        preset,
        args.methods.split(","),
        args.budget,
        simulate=simulated,
        device=args.device if simulated else None,
        rounds=Rounds(args.repeats),
        progress=lambda message: log(f"{workload} ({preset}): {message}"),
    )
    stem = f"{workload}-{preset}"  # not Path.with_suffix: "gpt-neo-1.3b" has a dot of its own
    (args.out / f"{stem}.json").write_text(json.dumps(comparison.to_json(), indent=2))
    plot_tradeoff(comparison, args.out / f"{stem}.png")


def summary_row(workload: str, out: Path) -> dict[str, str]:
    """The best peer within the latency overhead, per preset whose results are in ``out``: ``ratio (method)``."""
    row = {"model": workload}
    for preset, label in PRESETS.items():
        path = out / f"{workload}-{preset}.json"
        if not path.exists():
            row[label] = "not run"
            continue
        rows = Comparison.from_json(json.loads(path.read_text())).rows
        row[label] = _best(rows, PEER)
        if any(r.kind == MAGIS for r in rows):
            row[f"magis {label}"] = _best(rows, MAGIS)
    return row


def _best(rows: list[Row], kind: str) -> str:
    best = best_within(rows, kind=kind)
    return "-" if best is None else f"{best.peak_ratio:.3f} ({best.method})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    models = args.models.split(",")
    presets = args.presets.split(",")
    unknown = [m for m in models if m not in WORKLOADS] + [p for p in presets if p not in PRESETS]
    if unknown:
        print(
            f"unknown workload or preset {unknown[0]!r}: workloads {', '.join(WORKLOADS)}; presets "
            f"{', '.join(PRESETS)}",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for workload in models:
        for preset in presets:
            start = time.perf_counter()
            run_one(workload, preset, args)
            log(f"{workload} ({preset}): done in {time.perf_counter() - start:.0f} s")
    rows = [summary_row(workload, args.out) for workload in WORKLOADS]
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2))
    print(f"Best peak ratio at <= {OVERHEAD:.0%} latency overhead over eager (results in {args.out}):")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
