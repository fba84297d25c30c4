"""Simulator fidelity: simulated vs measured latency of each workload's training step (MAGIS §5).

For every workload of ``magis.models.WORKLOADS`` at each preset of ``--presets``
(``tiny`` and ``small`` by default): capture the step, estimate its latency with the
profiled cost model of this machine (``magis.cost.latency.ProfiledCostModel``: on
CPU each operator timed inside a run of its step on random inputs, plus the
runtime's loop and the binding of the inputs), run the captured graph in
the same order through the magis runtime and time it (median of at least ``--runs``
steps and ``--min-seconds`` after warm-up), and report the relative error (simulated - measured) / measured. The
step is timed in wall-clock and in process CPU time: on a machine shared with other
work the wall time includes waiting for a core, which no per-operator profile can
predict. As in every magis timing (``yardstick.protocol``), the C allocator keeps
freed memory, so a step pays no page faults that the per-operator profile cannot see.
With ``--rounds R`` the whole measurement (a fresh profile, then the step timed)
runs R times in turn over the workloads, and each workload reports the round of
median error: on a virtual machine, the neighbours can slow the core by 10-50% for
seconds at a time, which no profile taken before can predict; each round's figures
stay in the JSON. Writes JSON (one report per preset) and a PNG bar chart per preset next to it.

With ``--fissions`` each workload also reports the step made separable and each of its
F-Tree roots fissioned at every n (the first plans the M-Optimizer makes): its latency
as a search estimates it (``estimate_unseen``: operators never timed priced from their
kin), as the step timed in place prices it, and measured, each as a ratio to the
captured step's (``fissions`` in each workload's row).

    python experiments/sim_fidelity.py [--out results/sim_fidelity.json] [--presets tiny,small]
                                 [--models bert-base,unet] [--device cpu] [--threads 1]
                                 [--runs 20] [--min-seconds 2] [--rounds 1]
                                 [--cache PATH] [--fissions]

The progress bar of the profiler goes to stderr; one line per workload to stdout.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from driver import write_json

from magis.backend.program import lower
from magis.backend.runtime import run_program
from magis.cost.latency import ProfiledCostModel, estimate_latency
from magis.frontend.capture import CaptureError, capture
from magis.ir.graph import Graph
from magis.models import WORKLOADS, Built
from magis.plan import generated_step
from magis.rules.ftree_mutation import apply_ftree
from magis.search.single_fission import fission_numbers, separable_step
from yardstick.protocol import keep_freed_memory


def to_device(built: Built, device: torch.device) -> Built:
    """The model and its tensor inputs moved to ``device``."""
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in built.example_inputs)
    return Built(built.model.to(device), inputs, built.loss_fn)


def measure_step(
    built: Built, graph: Any, order: list[str], device: torch.device, runs: int, min_seconds: float, warmup: int = 3
) -> tuple[float, float]:
    """Median wall seconds and median process CPU seconds of a training step run by the
    magis runtime: at least ``runs`` steps after warm-up, and at least ``min_seconds`` of
    them, so that a few milliseconds of a busy neighbour move the median of a short step little.

    On a machine shared with other work, wall time includes the time this process
    waited for a core; CPU time does not (with one torch thread it is the step's own work).
    """
    program = lower(graph, order)
    run = generated_step(program)  # generated once, as a plan does: not a step's cost
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        run_program(program, built.model, built.example_inputs, apply_buffer_updates=False, runtime=run)
    wall: list[float] = []
    cpu: list[float] = []
    while len(wall) < runs or sum(wall) < min_seconds:
        sync()
        start, start_cpu = time.perf_counter(), time.process_time()
        run_program(program, built.model, built.example_inputs, apply_buffer_updates=False, runtime=run)
        sync()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def measure_fissions(
    built: Built, graph: Graph, order: list[str], model: ProfiledCostModel, runs: int, min_seconds: float
) -> list[dict[str, Any]]:
    """The separable step and each F-Tree root at every fission number: latency estimated
    from the kin of the captured step's operators, timed in place, and measured."""
    estimating = ProfiledCostModel(str(model.device), cache_path=model.cache.path, estimate_unseen=True, progress=False)
    estimate_latency(graph, order, estimating)  # the captured step, from the cache: the kin
    step = separable_step(graph, order)
    variants = [("separable", 1, step.graph, list(step.order))]
    for i, candidate in enumerate(step.tree.candidates):
        if candidate.parent is None:
            for n in fission_numbers(candidate.length):
                applied = apply_ftree(step.graph, step.tree.with_parts({i: n}), step.order)
                variants.append((candidate.label, n, applied.graph, list(applied.order)))
    rows = []
    for label, n, variant, variant_order in variants:
        estimated = estimate_latency(variant, variant_order, estimating).total_s
        timed = estimate_latency(variant, variant_order, model).total_s
        measured, measured_cpu = measure_step(built, variant, variant_order, model.device, runs, min_seconds)
        rows.append(
            {"fission": label, "n": n, "estimated_s": estimated, "timed_s": timed, "measured_s": measured}
            | {"measured_cpu_s": measured_cpu}
        )
        print(
            f"    {label} n={n}: estimated {estimated:.3f} s, timed in place {timed:.3f} s, "
            f"measured {measured:.3f} s (CPU time {measured_cpu:.3f} s)",
            flush=True,
        )
    return rows


def measure_workload(
    name: str, preset: str, model: ProfiledCostModel, runs: int, min_seconds: float, fissions: bool = False
) -> dict[str, Any]:
    """Simulated and measured step latency of one workload (and of its first fissions)."""
    built = to_device(WORKLOADS[name].build(preset), model.device)
    graph = capture(built.model, built.example_inputs, built.loss_fn)
    order = [n.name for n in graph.nodes]
    measured_before = model.measurements
    start = time.perf_counter()
    simulated = estimate_latency(graph, order, model).total_s
    profile_s = time.perf_counter() - start
    measured, measured_cpu = measure_step(built, graph, order, model.device, runs, min_seconds)
    extra = {}
    if fissions:
        extra["fissions"] = [
            row
            | {
                "estimated_ratio": row["estimated_s"] / simulated,
                "timed_ratio": row["timed_s"] / simulated,
                "measured_ratio": row["measured_s"] / measured,
                "measured_cpu_ratio": row["measured_cpu_s"] / measured_cpu,
            }
            for row in measure_fissions(built, graph, order, model, runs, min_seconds)
        ]
    return extra | {
        "model": name,
        "nodes": len(graph),
        "simulated_s": simulated,
        "measured_s": measured,
        "relative_error": (simulated - measured) / measured,
        "measured_cpu_s": measured_cpu,
        "relative_error_cpu": (simulated - measured_cpu) / measured_cpu,
        "ops_timed": model.measurements - measured_before,
        "profile_seconds": profile_s,
    }


def measure_all(
    names: list[str], preset: str, model: ProfiledCostModel, runs: int, min_seconds: float, fissions: bool = False
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """One row per workload that could be captured, and the reason for each that could not."""
    rows, failures = [], {}
    for i, name in enumerate(names, start=1):
        try:
            row = measure_workload(name, preset, model, runs, min_seconds, fissions)
        except CaptureError as err:
            failures[name] = str(err)
            print(f"[{i}/{len(names)}] {name}: skipped, {err}", flush=True)
            continue
        rows.append(row)
        print(
            f"[{i}/{len(names)}] {name}: {row['nodes']} nodes, simulated {row['simulated_s'] * 1e3:.2f} ms, "
            f"measured {row['measured_s'] * 1e3:.2f} ms (error {row['relative_error']:+.1%}), "
            f"CPU time {row['measured_cpu_s'] * 1e3:.2f} ms (error {row['relative_error_cpu']:+.1%}) "
            f"({row['ops_timed']} ops timed in {row['profile_seconds']:.1f} s)",
            flush=True,
        )
    return rows, failures


ROUND_FIELDS = ("simulated_s", "measured_s", "relative_error", "measured_cpu_s", "relative_error_cpu")


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round of median relative error (the lower middle one of an even count),
    with every round's figures under ``rounds``."""
    middle = sorted(rounds, key=lambda r: r["relative_error"])[(len(rounds) - 1) // 2]
    return {**middle, "rounds": [{k: r[k] for k in ROUND_FIELDS} for r in rounds]}


def plot(rows: list[dict[str, Any]], device: str, path: Path) -> None:
    """Grouped bars per workload: simulated, measured wall and measured CPU milliseconds, errors on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = (
        ("simulated_s", "simulated"),
        ("measured_s", "measured (wall)"),
        ("measured_cpu_s", "measured (CPU time)"),
    )
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(rows)), 4.5))
    for k, (field, label) in enumerate(series):
        ax.bar([i + (k - 1) * 0.27 for i in range(len(rows))], [r[field] * 1e3 for r in rows], 0.27, label=label)
    for i, r in enumerate(rows):
        top = max(r[field] for field, _ in series) * 1e3
        text = f"{r['relative_error']:+.0%} wall\n{r['relative_error_cpu']:+.0%} CPU"
        ax.annotate(text, (i, top), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), [r["model"] for r in rows], rotation=20, ha="right")
    ax.set_ylabel("training step latency (ms)")
    ax.set_title(f"magis latency simulator vs runtime ({device})")
    ax.margins(y=0.2)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def preset_report(rows: list[dict[str, Any]], failures: dict[str, str]) -> dict[str, Any]:
    """The error statistics of one preset's rows, with the rows."""
    errors = [abs(r["relative_error"]) for r in rows]
    cpu_errors = [abs(r["relative_error_cpu"]) for r in rows]
    return {
        "mean_abs_relative_error": statistics.mean(errors),
        "max_abs_relative_error": max(errors),
        "mean_abs_relative_error_cpu": statistics.mean(cpu_errors),
        "max_abs_relative_error_cpu": max(cpu_errors),
        "workloads": rows,
        "failed": failures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/sim_fidelity.json"))
    parser.add_argument("--models", default=",".join(WORKLOADS), help="comma-separated workload names")
    parser.add_argument("--presets", default="tiny,small", help="comma-separated presets")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared machine, multi-threaded kernels stall whenever another "
        "process holds a core, which makes both measurements noise); 0 keeps torch's default",
    )
    parser.add_argument("--runs", type=int, default=20, help="timed steps per workload (at least)")
    parser.add_argument("--min-seconds", type=float, default=2.0, help="timed seconds per workload (at least)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="profile and time every workload this many times in turn and report each workload's round of "
        "median error (each round with a fresh profile, unless --cache is given)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="latency cache file to use and keep (default: a fresh one, so each workload is profiled right "
        "before its step is timed, under the same load)",
    )
    parser.add_argument(
        "--fissions",
        action="store_true",
        help="also the separable step and its F-Tree roots at every n: estimated from kin, timed in place, measured",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}: choose from {', '.join(WORKLOADS)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    presets = [p for p in args.presets.split(",") if p]
    freed_memory_kept = keep_freed_memory()

    reports: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for preset in presets:
            by_workload: dict[str, list[dict[str, Any]]] = {}
            for round_ in range(1, args.rounds + 1):
                print(f"preset {preset}, round {round_}/{args.rounds}", flush=True)
                cache = args.cache or Path(scratch) / f"latency-{preset}-{round_}.json"
                model = ProfiledCostModel(args.device, cache_path=cache)
                rows, failures = measure_all(names, preset, model, args.runs, args.min_seconds, args.fissions)
                for row in rows:
                    by_workload.setdefault(row["model"], []).append(row)
            if by_workload:
                reports[preset] = preset_report([median_round(rounds) for rounds in by_workload.values()], failures)
        runtime_costs = asdict(model.runtime_costs)
    if not reports:
        raise SystemExit("no workload could be measured")
    write_json(
        args.out,
        {
            "device": args.device,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "runs": args.runs,
            "min_seconds": args.min_seconds,
            "rounds": args.rounds,
            "cache": str(args.cache) if args.cache else "fresh",
            "freed_memory_kept": freed_memory_kept,
            "runtime_costs_s": runtime_costs,
            "presets": reports,
        },
    )
    for preset, report in reports.items():
        plot(report["workloads"], f"{args.device}, {preset}", args.out.with_name(f"{args.out.stem}-{preset}.png"))
        print(
            f"{preset}, median round of {args.rounds}: |error| vs wall time: "
            f"mean {report['mean_abs_relative_error']:.1%}, "
            f"max {report['max_abs_relative_error']:.1%}; "
            f"vs CPU time: mean {report['mean_abs_relative_error_cpu']:.1%}, "
            f"max {report['max_abs_relative_error_cpu']:.1%}"
        )
    print(f"wrote {args.out} and a PNG per preset beside it")


if __name__ == "__main__":
    main()
