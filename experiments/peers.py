"""The yardstick: magis' peers on the seven workloads, measured (small) and simulated (paper).

For every workload of ``magis.models.WORKLOADS``:

- preset ``small``: every method runs for real on this machine (peak from the
  live-tensor meter, latency by the interleaved protocol of ``yardstick.protocol``,
  gradients checked against eager PyTorch);
- preset ``paper`` (Table 2 of the MAGIS paper): every method's graph goes through
  magis' simulator, latency priced on a device profile (``h200`` by default).

Writes ``<out>/<workload>-<preset>.json`` and ``.png`` (the memory-latency plane,
every method's point, Pareto front drawn), then prints, per workload, the lowest
peak ratio any peer reaches (and which) at no more than 5% and 10% latency
overhead over eager, measured and simulated (and magis' own, in columns of their
own, when its methods were run: e.g.
``--methods eager,magis-scheduled,magis-fission --out results/magis``), and how
Checkmate's programs were solved (status, gap, seconds, per budget).

    python experiments/peers.py [--out results/peers] [--models bert-base,unet] [--presets small,paper]
                          [--methods eager,checkpoint-block,...] [--budget 1 0.5 0.1]
                          [--repeats 5] [--device h200]

The summary reads every ``<workload>-<preset>.json`` in ``--out``, so the presets
can be run by separate invocations (``--models ""`` only prints the summary); the
comparisons ``experiments/optimize.py`` writes have the same form, their peers' rows read alike.

Progress lines go to stderr; the summary table to stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from driver import workloads_and_presets

from magis.console import format_table, log
from magis.models import WORKLOADS
from yardstick.compare import Comparison, Row, best_within, compare
from yardstick.methods import DEFAULT_BUDGETS, MAGIS, METHODS, PEER
from yardstick.plot import plot_tradeoff
from yardstick.protocol import Rounds

#: the presets run, and how each is figured
PRESETS = {"small": "small (measured)", "paper": "paper (simulated)"}
#: the default methods: the peers (magis' own can be added with --methods)
PEERS = [name for name, method in METHODS.items() if method.kind == PEER and not method.full_step]
#: timed rounds per measured comparison: seven workloads at 5-10 s a step on one core
REPEATS = 5
#: latency overheads over eager under which the summary takes the lowest peak
OVERHEADS = (0.05, 0.10)


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
    """Per preset whose results are in ``out``: the best peer (any peer) within each latency
    overhead of :data:`OVERHEADS` as ``ratio (method)``, magis' best when it ran, and how
    Checkmate's programs were solved."""
    row = {"model": workload}
    for preset, label in PRESETS.items():
        path = out / f"{workload}-{preset}.json"
        comparison = Comparison.from_json(json.loads(path.read_text())) if path.exists() else None
        rows = None if comparison is None else comparison.rows
        for overhead in OVERHEADS:
            column = f"{label} <={overhead:.0%}"
            row[column] = "not run" if rows is None else _best(rows, PEER, overhead)
            if rows is not None and any(r.kind == MAGIS for r in rows):
                row[f"magis {column}"] = _best(rows, MAGIS, overhead)
        if comparison is not None:
            row[f"checkmate {preset}"] = _solves(comparison)
    return row


def _best(rows: list[Row], kind: str, overhead: float) -> str:
    best = best_within(rows, overhead, kind=kind)
    return "-" if best is None else f"{best.peak_ratio:.3f} ({best.method})"


def _solves(comparison: Comparison) -> str:
    """``budget: status seconds`` of every Checkmate row (``gap`` when not optimal), ``no plan`` where skipped."""
    parts = []
    for row in comparison.rows:
        if row.method.startswith("checkmate@") and row.details:
            d = row.details
            gap = "" if d["solver"] == "optimal" else f" gap {d['gap']:.1%}"
            parts.append(f"{row.method.removeprefix('checkmate@')}: {d['solver']}{gap} {d['solve_s']:.0f}s")
    parts += [
        f"{name.removeprefix('checkmate@')}: no plan" for name in comparison.skipped if name.startswith("checkmate@")
    ]
    return "; ".join(parts) or "-"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    chosen = workloads_and_presets(args.models, args.presets, WORKLOADS, PRESETS)
    if chosen is None:
        return 2
    models, presets = chosen
    args.out.mkdir(parents=True, exist_ok=True)
    for workload in models:
        for preset in presets:
            start = time.perf_counter()
            run_one(workload, preset, args)
            log(f"{workload} ({preset}): done in {time.perf_counter() - start:.0f} s")
    rows = [summary_row(workload, args.out) for workload in WORKLOADS]
    columns = list(dict.fromkeys(key for row in rows for key in row))  # magis' and Checkmate's where they ran
    rows = [{key: row.get(key, "-") for key in columns} for row in rows]
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2))
    print(
        f"Best peak ratio at <= {', '.join(f'{o:.0%}' for o in OVERHEADS)} latency overhead over eager "
        f"(results in {args.out}):"
    )
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
