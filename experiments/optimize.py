"""MAGIS §7's two experiments (Fig. 9 and 10): the M-Optimizer beside every peer, per workload.

For each workload at each preset, one comparison of the yardstick
(:func:`yardstick.compare.compare`): eager, the peers, and the M-Optimizer in both
of its modes, ``magis-optimize-lat@L`` for each ``--latency-limits`` L (Fig. 9: the
lowest peak within L times the captured step's latency) and ``magis-optimize@M`` for
each ``--memory-limits`` M (Fig. 10: the lowest latency within M times its peak).
``paper`` is simulated (``--device`` profile, h200 by default); ``small`` runs every
method for real on this machine with the yardstick's protocol, gradients checked
against eager PyTorch.

Writes ``<out>/<workload>-<preset>.json`` and ``.png`` (the memory-latency plane) and
``<out>/summary.json``, and prints per workload and preset:

- (a) per latency limit L: the plan's peak ratio to eager, the best peer's within the
  same overhead (which peer), and whether the plan is below it (measured presets: the
  lowest peak of any of magis' plans whose measured latency is within L, since a plan
  the search simulated within L may run slower);
- (b) per memory limit M: the plan's latency overhead over eager (``infeasible`` where
  the search found no plan within M);
- (c) the search: the slowest first feasible plan and the longest search, in seconds;
- (d) measured presets: the largest difference between a plan's measured latency ratio
  and the one the search simulated, in points (measured minus simulated);
- (e) with ``--runtimes``: ``magis-optimize@M``'s plan run by the interpreter and compiled
  (``compile=True``) beside its generated code: each one's latency ratio to eager, its time
  over ``torch.compile``'s (``inductor@1`` with ``--peers ...,inductor``, else ``compile@1``) and
  its peak beside the lowest such peer at any budget within its own time.

    python experiments/optimize.py [--models bert-base,unet] [--presets paper,small]
                             [--peers eager,accumulate,compile,...] [--budget 1 0.5 0.1]
                             [--latency-limits 1.05 1.10] [--memory-limits 0.8 0.6 0.4]
                             [--runtimes interpreted,compiled] [--repeats 5] [--max-repeats 21]
                             [--peers-from results/optimize] [--out results/optimize]

Simulated peers are deterministic: ``--peers-from DIR`` takes the peers' rows (and
eager's) from an earlier run's ``<workload>-paper.json`` in ``DIR`` instead of
simulating them again (most of a paper-size run), with ``--peers eager``; it refuses a
measured preset, whose figures belong to the run that took them, and a run made for
another device profile.

The search runs with the yardstick's budget (60 s, ``yardstick.methods.magis_methods.OPTIMIZE_SECONDS``):
time it on a quiet machine. Progress lines go to stderr; the summary table to stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from driver import workloads_and_presets

from magis.console import format_table, log
from magis.models import WORKLOADS, ZOO
from yardstick.compare import Comparison, Row, best_within, compare
from yardstick.methods import DEFAULT_BUDGETS, LATENCY_LIMITS, MAGIS, METHODS, PEER
from yardstick.plot import plot_tradeoff
from yardstick.protocol import Rounds

PRESETS = ("paper", "small", "tiny")
#: the peers by default: every one a user would try (Rockmate only where asked for)
PEERS = [name for name, method in METHODS.items() if method.kind == PEER and not method.opt_in]
#: memory limits of Fig. 10, fractions of eager's peak
MEMORY_LIMITS = (0.8, 0.6, 0.4)
#: timed rounds of a measured comparison
REPEATS = 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default=",".join(WORKLOADS),
        help="comma-separated workloads of `magis models` (default: the seven of MAGIS)",
    )
    parser.add_argument("--presets", default="paper", help="paper (simulated), small or tiny (measured)")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated peers (default: all but opt-in)")
    parser.add_argument("--budget", type=float, nargs="+", default=list(DEFAULT_BUDGETS), metavar="B")
    parser.add_argument("--latency-limits", type=float, nargs="*", default=list(LATENCY_LIMITS), metavar="L")
    parser.add_argument("--memory-limits", type=float, nargs="*", default=list(MEMORY_LIMITS), metavar="M")
    parser.add_argument(
        "--runtimes",
        default="",
        help="comma-separated runtimes that also run magis-optimize@M's plans beside its generated code: "
        "interpreted, compiled (issue #30; measured presets)",
    )
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed rounds of measured runs, at least")
    parser.add_argument("--max-repeats", type=int, default=None, help="timed rounds of measured runs, at most")
    parser.add_argument("--device", default="h200", help="device profile of simulated latencies")
    parser.add_argument("--peers-from", type=Path, default=None, metavar="DIR", help="reuse simulated peers' rows")
    parser.add_argument("--out", type=Path, default=Path("results/optimize"))
    return parser.parse_args(argv)


def methods(args: argparse.Namespace) -> list[str]:
    """The peers, then the M-Optimizer at each limit asked for."""
    return [
        *args.peers.split(","),
        *(f"magis-optimize-lat@{limit:g}" for limit in args.latency_limits),
        *(f"magis-optimize@{limit:g}" for limit in args.memory_limits),
        *(f"magis-optimize-{runtime}@{limit:g}" for runtime in runtimes(args) for limit in args.memory_limits),
    ]


def runtimes(args: argparse.Namespace) -> list[str]:
    chosen = [r for r in args.runtimes.split(",") if r]
    unknown = [r for r in chosen if r not in ("interpreted", "compiled")]
    if unknown:
        raise SystemExit(f"--runtimes: unknown {', '.join(unknown)} (interpreted, compiled)")
    return chosen


def run_one(workload: str, preset: str, args: argparse.Namespace) -> Comparison:
    simulated = preset == "paper"
    comparison = compare(
        workload,
        preset,
        methods(args),
        args.budget,
        simulate=simulated,
        device=args.device if simulated else None,
        rounds=Rounds(args.repeats, max_repeats=args.max_repeats),
        progress=lambda message: log(f"{workload} ({preset}): {message}"),
    )
    stem = f"{workload}-{preset}"
    if args.peers_from is not None:
        comparison = with_peers_from(comparison, args.peers_from / f"{stem}.json")
    (args.out / f"{stem}.json").write_text(json.dumps(comparison.to_json(), indent=2))
    plot_tradeoff(comparison, args.out / f"{stem}.png")
    return comparison


def with_peers_from(comparison: Comparison, path: Path) -> Comparison:
    """``comparison`` with the peers' rows of the simulated comparison at ``path`` added
    (those it does not hold itself); ValueError for a measured one, or another device."""
    if comparison.measured:
        raise ValueError("--peers-from takes simulated figures only: measured peers belong to the run that timed them")
    earlier = Comparison.from_json(json.loads(path.read_text()))
    if earlier.measured or earlier.settings.get("device") != comparison.settings.get("device"):
        raise ValueError(f"{path} is not a simulation for device {comparison.settings.get('device')!r}")
    have = {row.method for row in comparison.rows}
    peers = [row for row in earlier.rows if row.kind == PEER and row.method not in have]
    return replace(comparison, rows=[*comparison.rows, *peers])


def summary(comparison: Comparison, args: argparse.Namespace) -> dict[str, Any]:
    """The row of the printed table (and of ``summary.json``) for one comparison."""
    rows = {row.method: row for row in comparison.rows}
    out: dict[str, Any] = {"model": comparison.workload, "preset": comparison.preset}
    searches: list[dict[str, Any]] = []
    for limit in args.latency_limits:
        # measured: a plan is judged by its measured latency (magis' lowest peak within the limit)
        within = best_within(comparison.rows, limit - 1.0 + 1e-9, kind=MAGIS)
        plan = within if comparison.measured else rows.get(f"magis-optimize-lat@{limit:g}")
        peer = best_within(comparison.rows, limit - 1.0 + 1e-9, kind=PEER)
        out[f"lat {limit:g}: magis"] = _point(plan)
        out[f"lat {limit:g}: best peer"] = "-" if peer is None else f"{peer.peak_ratio:.3f} ({peer.method})"
        out[f"lat {limit:g}: below"] = (
            "-" if plan is None or peer is None else "yes" if plan.peak_ratio < peer.peak_ratio else "no"
        )
        searches.append(plan.details if plan is not None and plan.details else {})
    for limit in args.memory_limits:
        plan = rows.get(f"magis-optimize@{limit:g}")
        details = plan.details if plan is not None and plan.details else {}
        met = plan is not None and plan.peak_ratio <= limit + 1e-9
        if plan is None:
            out[f"mem {limit:g}: overhead"] = "-"
        else:
            overhead = f"{plan.latency_ratio - 1.0:+.1%}"
            out[f"mem {limit:g}: overhead"] = overhead if met else f"infeasible ({plan.peak_ratio:.3f})"
        searches.append(details)
    for runtime in runtimes(args):  # (e) issue #30: each runtime beside eager and torch.compile
        for limit in args.memory_limits:
            out.update(_runtime_columns(rows, f"magis-optimize-{runtime}@{limit:g}"))
    if comparison.measured:  # (d) the simulator's fidelity: each plan's simulated latency ratio beside its measured one
        errors = [
            row.latency_ratio - row.details["simulated_latency_ratio"]
            for row in comparison.rows
            if "simulated_latency_ratio" in (row.details or {})
        ]
        out["latency ratio error (max, points)"] = f"{100 * max(errors, key=abs):+.1f}" if errors else "-"
    first = [d["first_feasible_s"] for d in searches if d.get("first_feasible_s") is not None]
    out["first feasible s (max)"] = f"{max(first):.1f}" if first else "-"
    out["search s (max)"] = f"{max(d.get('search_s', 0.0) for d in searches):.0f}" if searches else "-"
    return out


def _runtime_columns(rows: dict[str, Row], name: str) -> dict[str, str]:
    """A plan in one runtime: its latency ratio to eager, its time over ``torch.compile``'s (Inductor's
    ``inductor@1`` where it ran, else the partitioner's graphs run eagerly, ``compile@1``), and
    whether its peak is no higher than the lowest such peer at any budget as fast as it ("-": none is)."""
    peer = "inductor" if "inductor@1" in rows else "compile"
    plan, full = rows.get(name), rows.get(f"{peer}@1")
    if plan is None:
        return {f"{name}: lat": "-"}
    out = {f"{name}: lat": f"{plan.latency_ratio:.3f}"}
    if full is not None:
        within = [
            row.peak_ratio
            for method, row in rows.items()
            if method.startswith(f"{peer}@") and row.latency_ratio <= plan.latency_ratio
        ]
        out[f"{name}: / {peer}@1"] = f"{plan.latency_ratio / full.latency_ratio:.3f}"
        out[f"{name}: peak vs {peer}@B"] = f"{plan.peak_ratio:.3f} vs {min(within):.3f}" if within else "-"
    return out


def _point(row: Row | None) -> str:
    return "-" if row is None else f"{row.peak_ratio:.3f} @ {row.latency_ratio:.3f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    chosen = workloads_and_presets(args.models, args.presets, ZOO, PRESETS)
    if chosen is None:
        return 2
    models, presets = chosen
    args.out.mkdir(parents=True, exist_ok=True)
    table = []
    for workload in models:
        for preset in presets:
            start = time.perf_counter()
            table.append(summary(run_one(workload, preset, args), args))
            log(f"{workload} ({preset}): done in {time.perf_counter() - start:.0f} s")
            (args.out / "summary.json").write_text(json.dumps(table, indent=2))
    print(f"magis-optimize beside the best peer (results in {args.out}):")
    print(format_table(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
