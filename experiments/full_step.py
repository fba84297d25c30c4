"""Full steps (issue #29): every peer with AdamW's update, beside magis planning the whole step.

For each workload at each preset, one comparison of the yardstick's full-step methods
(:mod:`yardstick.methods.full_step`, torch's ``AdamW`` at its default hyperparameters)
against eager's full step, ``eager+step`` (``loss.backward(); optimizer.step()``):
``eager+step-in-backward`` (per-parameter optimizers stepped from
``register_post_accumulate_grad_hook``), ``accumulate@k+step``, ``checkpoint-block+step``,
``compile+step@B`` and ``magis-optimize-lat+step@L`` (the M-Optimizer at a latency limit
``L`` over the step with its update). ``paper`` is simulated on fake tensors (``--device``
profile, h200 by default; the update is CUDA's ``foreach`` default); ``small`` and ``tiny``
run every method for real on this machine with the yardstick's protocol (the update is the
CPU's per-parameter loop), the gradients each update used checked against eager's.

Writes ``<out>/<workload>-<preset>.json`` and ``.png`` (the memory-latency plane),
``<out>/full_step.png`` (one panel per comparison, the floor drawn) and ``<out>/summary.json``,
and prints, per workload and preset:

- eager+step's peak, and the floor every plan holds (weights, buffers, optimizer states and
  inputs) as a ratio to it;
- the gradients' bytes, and whether they are at least 5% of eager+step's peak (below that,
  nothing that frees gradients early can lower the peak by much);
- magis' peak ratio within each latency limit (measured presets: the lowest peak of magis'
  plans whose measured latency is within it);

and then every method's peak ratio and latency ratio.

    python experiments/full_step.py [--models bert-base,unet] [--presets paper,small]
                                    [--methods eager+step,eager+step-in-backward,...] [--budget 1 0.5 0.1]
                                    [--latency-limits 1.10] [--time-budget 60] [--repeats 5]
                                    [--max-repeats 21] [--device h200] [--out results/full_step]

``--time-budget`` is the M-Optimizer's search, in seconds, per workload and limit (the
yardstick's 60 s by default): keep it short for a smoke test, and time the figures on a
quiet machine. Progress lines go to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

from driver import workloads_and_presets, write_json
from matplotlib.figure import Figure

from magis.console import format_table, log
from magis.models import WORKLOADS, ZOO
from yardstick.compare import Comparison, best_within, compare
from yardstick.methods import DEFAULT_BUDGETS, FULL_STEP_REFERENCE, MAGIS, METHODS, magis_methods
from yardstick.methods.full_step import MAGIS_STEP
from yardstick.plot import draw_tradeoff, plot_tradeoff
from yardstick.protocol import Rounds

PRESETS = ("paper", "small", "tiny")
#: the full-step methods but magis' (its variants are named per limit)
PEERS = [name for name, method in METHODS.items() if method.full_step and method.kind != MAGIS]
#: the latency limit magis' plans are reported at (MAGIS Fig. 9's 10%)
LATENCY_LIMITS = (1.10,)
#: the share of eager+step's peak at and above which the gradients are worth freeing early
GRADIENT_SHARE = 0.05
#: timed rounds of a measured comparison
REPEATS = 5
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default=",".join(WORKLOADS),
        help="comma-separated workloads of `magis models` (default: the seven of MAGIS)",
    )
    parser.add_argument("--presets", default="paper", help="paper (simulated), small or tiny (measured)")
    parser.add_argument("--methods", default=",".join(PEERS), help="comma-separated full-step peers (default: all)")
    parser.add_argument("--budget", type=float, nargs="+", default=list(DEFAULT_BUDGETS), metavar="B")
    parser.add_argument("--latency-limits", type=float, nargs="*", default=list(LATENCY_LIMITS), metavar="L")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=magis_methods.OPTIMIZE_SECONDS,
        metavar="S",
        help="seconds of each M-Optimizer search (default: %(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed rounds of measured runs, at least")
    parser.add_argument("--max-repeats", type=int, default=None, help="timed rounds of measured runs, at most")
    parser.add_argument("--device", default="h200", help="device profile of simulated latencies")
    parser.add_argument("--out", type=Path, default=Path("results/full_step"))
    return parser.parse_args(argv)


def methods(args: argparse.Namespace) -> list[str]:
    """The peers, then magis over the full step at each latency limit asked for."""
    peers = [name for name in args.methods.split(",") if name]
    bases = [name if name in METHODS else name.rpartition("@")[0] for name in peers]  # compile+step@0.5 too
    unknown = [name for name, base in zip(peers, bases) if base not in METHODS or not METHODS[base].full_step]
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a full-step method: choose from {', '.join(PEERS)}")
    if not peers and not args.latency_limits:
        raise ValueError("no method to compare: name a peer (--methods) or a latency limit (--latency-limits)")
    return [*peers, *(f"{MAGIS_STEP}@{limit:g}" for limit in args.latency_limits)]


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
    stem = f"{workload}-{preset}"  # not Path.with_suffix: "gpt-neo-1.3b" has a dot of its own
    write_json(args.out / f"{stem}.json", comparison.to_json())
    plot_tradeoff(comparison, args.out / f"{stem}.png")
    return comparison


def summary(comparison: Comparison, limits: list[float]) -> dict[str, Any]:
    """What ``summary.json`` holds for one comparison: eager+step's peak, the floor and its parts,
    the gradients, every method's ratios and magis' plan within each limit."""
    rows = {row.method: row for row in comparison.rows}
    eager = rows[FULL_STEP_REFERENCE]
    facts = dict(eager.details or {})
    peak = eager.peak_bytes
    out: dict[str, Any] = {
        "model": comparison.workload,
        "preset": comparison.preset,
        "measured": comparison.measured,
        "device": comparison.settings.get("device"),
        "eager_step_peak_bytes": peak,
        **{k: v for k, v in facts.items() if k.endswith("_bytes")},
        "floor_ratio": facts["floor_bytes"] / peak,
        "gradient_share": facts["gradient_bytes"] / peak,
        "gradients_matter": facts["gradient_bytes"] >= GRADIENT_SHARE * peak,
        "methods": {
            row.method: {"peak_bytes": row.peak_bytes, "peak_ratio": row.peak_ratio, "latency_ratio": row.latency_ratio}
            for row in comparison.rows
        },
        "magis": {f"{limit:g}": _magis_within(comparison, limit) for limit in limits},
        "skipped": comparison.skipped,
    }
    return out


def _magis_within(comparison: Comparison, limit: float) -> dict[str, Any] | None:
    """magis' plan within ``limit``: its variant's row when simulated, the lowest measured peak of
    magis' plans whose measured latency is within the limit when measured (a plan simulated within
    it may run slower)."""
    if comparison.measured:
        row = best_within(comparison.rows, limit - 1.0 + 1e-9, kind=MAGIS)
    else:
        row = next((r for r in comparison.rows if r.method == f"{MAGIS_STEP}@{limit:g}"), None)
    if row is None:
        return None
    return {
        "method": row.method,
        "peak_bytes": row.peak_bytes,
        "peak_ratio": row.peak_ratio,
        "latency_ratio": row.latency_ratio,
        "within": row.latency_ratio <= limit + 1e-9,
    }


def table_row(entry: dict[str, Any]) -> dict[str, str]:
    """One line of the printed summary."""
    row = {
        "model": entry["model"],
        "preset": entry["preset"],
        "eager+step MiB": f"{entry['eager_step_peak_bytes'] / MIB:.1f}",
        "floor": f"{entry['floor_ratio']:.3f}",
        "gradients MiB": f"{entry['gradient_bytes'] / MIB:.1f}",
    }
    matter = "yes" if entry["gradients_matter"] else "no"
    row[f"grads >= {GRADIENT_SHARE:.0%}"] = f"{matter} ({entry['gradient_share']:.1%})"
    for limit, plan in entry["magis"].items():
        row[f"magis <= {limit}"] = "-" if plan is None else _point(plan)
    return row


def method_rows(entry: dict[str, Any]) -> list[dict[str, str]]:
    """The printed lines of one comparison's methods: peak (MiB and ratio) and latency ratio."""
    return [
        {
            "model": entry["model"],
            "preset": entry["preset"],
            "method": name,
            "peak MiB": f"{figures['peak_bytes'] / MIB:.1f}",
            "peak / latency": _point(figures),
        }
        for name, figures in entry["methods"].items()
    ]


def _point(figures: dict[str, Any]) -> str:
    return f"{figures['peak_ratio']:.3f} @ {figures['latency_ratio']:.3f}"


def plot_all(comparisons: list[Comparison], entries: list[dict[str, Any]], path: Path) -> Path:
    """One panel per comparison (peak vs latency, both against eager+step), the floor a dotted line."""
    columns = min(3, len(comparisons))
    lines = -(-len(comparisons) // columns)
    fig = Figure(figsize=(6 * columns, 4.5 * lines))
    axes = list(fig.subplots(lines, columns, squeeze=False).flat)
    for ax, comparison, entry in zip(axes, comparisons, entries):
        draw_tradeoff(ax, comparison, fontsize=8)
        ax.axvline(entry["floor_ratio"], color="C3", linestyle=":", linewidth=1)
        ax.annotate("floor", (entry["floor_ratio"], 1.0), textcoords="offset points", xytext=(3, 3), fontsize=8)
    for ax in axes[len(comparisons) :]:  # the panels left over
        ax.set_visible(False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    chosen = workloads_and_presets(args.models, args.presets, ZOO, PRESETS)
    if chosen is None:
        return 2
    models, presets = chosen
    try:
        methods(args)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    if not args.time_budget > 0:
        print(f"--time-budget must be positive, got {args.time_budget}", file=sys.stderr)
        return 2
    magis_methods.OPTIMIZE_SECONDS = args.time_budget  # what the M-Optimizer's searches read
    args.out.mkdir(parents=True, exist_ok=True)
    comparisons, entries = [], []
    for workload in models:
        for preset in presets:
            start = time.perf_counter()
            comparisons.append(run_one(workload, preset, args))
            entries.append(summary(comparisons[-1], args.latency_limits))
            entries[-1]["seconds"] = time.perf_counter() - start
            log(f"{workload} ({preset}): done in {entries[-1]['seconds']:.0f} s")
            write_json(args.out / "summary.json", entries)
    if comparisons:
        plot_all(comparisons, entries, args.out / "full_step.png")
    print(f"Full steps with AdamW against eager+step (results in {args.out}):")
    print(format_table([table_row(entry) for entry in entries]))
    print()
    print(format_table([line for entry in entries for line in method_rows(entry)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
