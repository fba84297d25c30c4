"""magis.optimize run for real: each workload's plan at several memory limits, measured.

For each workload of the zoo (``magis models``) at a preset (real weights) on a device (``cpu`` or ``cuda``): the
plan :func:`magis.optimize` returns per memory limit (a fraction of the captured
step's simulated peak; with ``--limit-kind latency`` per latency limit, a multiple of its
simulated latency: the lowest peak within it), run as a user runs it (``loss = plan(*batch)``), against the
eager step of the same model and batch: measured peak (the meter of
:mod:`magis.backend.meter`: live tensor bytes on CPU, ``max_memory_allocated`` on
CUDA) and step time (median of ``--runs``), gradients compared with eager's, and the
plan's simulated peak and latency. On CUDA each plan runs twice: replayed as a CUDA graph
(the default; ``graphs``: its step time, the pool it holds, its first call's peak) and
launch by launch (``cuda_graphs=False``). ``--compile-peer`` adds ``torch.compile``'s step
(``compile@1``: the default activation budget) beside eager, and ``--compile-plans`` each
limit's plan searched with ``compile=True`` and run compiled (under ``compiled``; with
``--compiled-only`` those alone). Each
workload is measured whole before the next, and JSON written after each measurement.

    python experiments/plan_run.py [--models bert-base,unet] [--preset small] [--device cuda]
                             [--limits 0.8,0.6] [--limit-kind memory|latency] [--time-budget 60]
                             [--compile-peer] [--compile-plans] [--compiled-only]
                             [--no-cudnn] [--out results/plan_run.json] [--plot results/plan_run.png]
    python experiments/plan_run.py --plot-only results/plan_run.json --plot results/plan_run.png

``--plot`` draws each workload's first limit: peak and step ratios to eager, simulated
beside measured (and compile@1's, as CUDA graph where one ran).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from driver import write_json

import magis
from magis.backend.eager import compare_gradients, eager_step
from magis.backend.meter import peak_meter
from magis.models import ZOO
from magis.plan import InfeasibleLimit


def _timed(step, runs: int, device: torch.device) -> float:
    """Median seconds of ``runs`` calls of ``step`` after one warm-up."""
    times = []
    for _ in range(runs + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _plan_step(plan: magis.Plan, model: torch.nn.Module, batch: tuple) -> dict[str, torch.Tensor]:
    """One plan step from zeroed gradients: the gradients it accumulated, and the loss."""
    model.zero_grad(set_to_none=True)
    loss = plan(*batch)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {**grads, "<loss>": loss.detach()}


def _with_eager(name: str, preset: str, device: torch.device, args: Any) -> tuple:
    """The workload built on ``device``, and eager's step of it: its gradients (the reference)
    and its measured peak and step time."""
    built = ZOO[name].build(preset)
    model = built.model.to(device)
    batch = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in built.example_inputs)
    with peak_meter(model, batch) as meter:
        torch.manual_seed(0)
        reference = eager_step(model, batch, built.loss_fn)
    eager = {
        "peak_bytes": meter.peak_bytes,
        "step_s": _timed(lambda: eager_step(model, batch, built.loss_fn), args.runs, device),
    }
    return built, model, batch, reference, eager


def measure_workload(name: str, preset: str, device: torch.device, limits: list[float], args: Any) -> dict[str, Any]:
    built, model, batch, reference, eager = _with_eager(name, preset, device, args)
    rows = []
    for limit in limits:
        plan, row = _planned(name, built.loss_fn, model, batch, limit, args, compiled=False)
        if plan is not None:
            row.update(_measured(plan, model, batch, reference, eager, args))
        rows.append(row)
        del plan
        _release(device)
        print(f"  {name} @ {limit}: {rows[-1]}", file=sys.stderr, flush=True)
    return {"model": name, "preset": preset, "device": str(device), "eager": eager, "plans": rows}


def _plan_path(name: str, limit: float, compiled: bool, args: Any) -> Path | None:
    """Where ``--plans`` keeps the plan of ``name`` at ``limit`` (None without ``--plans``)."""
    if not args.plans:
        return None
    kind = "" if args.limit_kind == "memory" else "lat"
    return Path(args.plans) / f"{name}-{args.preset}-{kind}{limit}{'-compiled' if compiled else ''}.magis"


def _planned(
    name: str, loss_fn: Any, model: torch.nn.Module, batch: tuple, limit: float, args: Any, compiled: bool
) -> tuple[magis.Plan | None, dict[str, Any]]:
    """The plan of ``limit`` (``compiled``: searched with ``compile=True``) and its row so far: read
    from ``--plans`` where an earlier ``--search-only`` run saved it, else searched (and saved
    there). None and the reason where no plan meets the limit."""
    path = _plan_path(name, limit, compiled, args)
    key = f"{args.limit_kind}_limit"
    if path is not None and path.exists():
        plan = dataclasses.replace(magis.load_plan(path, model), runtime="compiled" if compiled else "generated")
        return plan, {key: limit, "search_s": plan.report().search["seconds"], "plan_file": path.name}
    start = time.perf_counter()
    try:
        options = {key: limit, "time_budget": args.time_budget, "device": args.cost_model, "compile": compiled}
        plan = magis.optimize(model, batch, loss_fn, **options)
    except InfeasibleLimit as err:
        return None, {key: limit, "infeasible": str(err)}
    if path is not None:
        plan.save(path)
    return plan, {key: limit, "search_s": time.perf_counter() - start}


def _measured(plan: magis.Plan, model: torch.nn.Module, batch: tuple, reference: Any, eager: dict, args: Any) -> dict:
    """``plan`` run as a user runs it: simulated against measured peak and step (launch by
    launch), gradients against eager's, and on CUDA the same replayed as a CUDA graph."""
    device = next(model.parameters()).device
    graphs = _replayed(plan, model, batch, reference, eager, args) if device.type == "cuda" else None
    plan = dataclasses.replace(plan, cuda_graphs=False)  # launch by launch (on a CPU: as it always runs)
    start = time.perf_counter()
    _plan_step(plan, model, batch)  # a compiled plan compiles its segments here: not metered
    first_call_s = time.perf_counter() - start
    with peak_meter(model, batch) as meter:
        torch.manual_seed(0)
        gradients = _plan_step(plan, model, batch)
    versus = compare_gradients({**reference.gradients, "<loss>": reference.loss}, gradients)
    step_s = _timed(lambda: _plan_step(plan, model, batch), args.runs, device)
    report = plan.report().to_dict()
    return {
        "runtime": report["runtime"]["name"],
        "first_call_s": first_call_s,
        "simulated_peak_ratio": report["peak_ratio"],
        "simulated_latency_ratio": report["latency_ratio"],
        "measured_peak_bytes": meter.peak_bytes,
        "measured_peak_ratio": meter.peak_bytes / eager["peak_bytes"],
        "measured_step_ratio": step_s / eager["step_s"],
        "simulated_vs_measured_peak": plan.peak_bytes / meter.peak_bytes,
        "max_grad_error": versus.max_error if versus.same_names else None,
        "gradient_mismatch": None if versus.same_names else versus.describe(),
        "transformations": {k: len(v) for k, v in report["transformations"].items()},
        "compile_fallbacks": report["runtime"].get("fallbacks"),
        "runtime_report": report["runtime"],  # compiled: segments kept, the whole step's trial
        "graphs": graphs,
    }


def measure_compiled_plans(name: str, preset: str, device: torch.device, limits: list[float], args: Any) -> dict:
    """Each limit's plan searched and run with ``compile=True`` (Inductor segments; on CUDA
    replayed as a CUDA graph too): the rows of :func:`measure_workload` for the compiled runtime,
    whose ``first_call_s`` is the seconds Inductor took to compile every segment."""
    built, model, batch, reference, eager = _with_eager(name, preset, device, args)
    rows = []
    for limit in limits:
        plan, row = _planned(name, built.loss_fn, model, batch, limit, args, compiled=True)
        if plan is not None:
            row.update(_measured(plan, model, batch, reference, eager, args))
        rows.append(row)
        del plan
        _release(device)
        print(f"  {name} compiled @ {limit}: {rows[-1]}", file=sys.stderr, flush=True)
    return {"model": name, "eager": eager, "plans": rows}


def _replayed(plan: magis.Plan, model: torch.nn.Module, batch: tuple, reference: Any, eager: dict, args: Any) -> dict:
    """The plan replayed as a CUDA graph: its first call (the capture) metered, its gradients
    against eager's, its step time, and what the graph's pool holds."""
    device = next(model.parameters()).device
    with peak_meter(model, batch) as meter:
        torch.manual_seed(0)
        gradients = _plan_step(plan, model, batch)
    versus = compare_gradients({**reference.gradients, "<loss>": reference.loss}, gradients)
    step_s = _timed(lambda: _plan_step(plan, model, batch), args.runs, device)
    with peak_meter(model, batch) as replay:
        _plan_step(plan, model, batch)
    graph = plan.report().runtime.get("cuda_graph", {})
    return {
        "captured": graph.get("captured"),
        "fallback": graph.get("fallback"),
        "pool_bytes": graph.get("pool_bytes"),
        "first_call_peak_bytes": meter.peak_bytes,
        "replay_call_peak_bytes": replay.peak_bytes,
        "measured_step_ratio": step_s / eager["step_s"],
        "max_grad_error": versus.max_error if versus.same_names else None,
    }


def measure_compiled(name: str, preset: str, device: torch.device, args: Any) -> dict[str, Any]:
    """``torch.compile``'s step of the workload (default activation budget: ``compile@1``) beside
    eager's, on a fresh copy of the model: step time (median, after the compiling call) and peak."""
    built = ZOO[name].build(preset)
    model = built.model.to(device)
    batch = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in built.example_inputs)
    eager_s = _timed(lambda: eager_step(model, batch, built.loss_fn), args.runs, device)
    with peak_meter(model, batch) as eager_meter:
        eager_step(model, batch, built.loss_fn)
    compiled = torch.compile(model)
    start = time.perf_counter()
    eager_step(compiled, batch, built.loss_fn)
    compile_s = time.perf_counter() - start
    step_s = _timed(lambda: eager_step(compiled, batch, built.loss_fn), args.runs, device)
    with peak_meter(model, batch) as meter:
        eager_step(compiled, batch, built.loss_fn)
    row = {
        "model": name,
        "eager_step_s": eager_s,
        "eager_peak_bytes": eager_meter.peak_bytes,
        "compile_s": compile_s,
        "step_s": step_s,
        "step_ratio": step_s / eager_s,
        "peak_bytes": meter.peak_bytes,
        "peak_ratio": meter.peak_bytes / eager_meter.peak_bytes,
    }
    print(f"  {name} compile@1: {row}", file=sys.stderr, flush=True)
    return row


def search_only(name: str, device: torch.device, limits: list[float], args: Any) -> None:
    """``--search-only``: each limit's plans searched and saved in ``--plans`` (no measurement),
    each compiled plan and ``compile@1`` called once so that Inductor's cache holds their
    kernels: run one process per workload at once, then measure them one by one from the files."""
    built = ZOO[name].build(args.preset)
    model = built.model.to(device)
    batch = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in built.example_inputs)
    for limit in limits:
        for compiled in (False, True) if args.compile_plans else (False,):
            plan, row = _planned(name, built.loss_fn, model, batch, limit, args, compiled)
            if plan is not None and compiled:
                _plan_step(plan, model, batch)
            print(f"  {name} @ {limit}{' compiled' if compiled else ''}: {row}", file=sys.stderr, flush=True)
    if args.compile_peer:
        eager_step(torch.compile(model), batch, built.loss_fn)
        model.zero_grad(set_to_none=True)


def plot(payload: dict[str, Any], path: str) -> None:
    """Two panels per workload (its first limit): peak ratio and step ratio to eager, the
    plan's simulated and measured figures beside the compiled plan's and compile@1's where
    they ran."""
    from matplotlib.figure import Figure

    compiled = {row["model"]: row for row in payload.get("compile@1", [])}
    compiled_plans = {w["model"]: w["plans"][0] for w in payload.get("compiled", []) if w["plans"]}
    primary = payload["workloads"] or payload.get("compiled", [])  # --compiled-only: the compiled plans
    firsts = [(w["model"], w["plans"][0]) for w in primary if w["plans"]]
    rows = [(name, row) for name, row in firsts if "infeasible" not in row]
    names = [name for name, _ in rows]
    bars = {
        "peak": [
            ("simulated", [r["simulated_peak_ratio"] for _, r in rows]),
            ("measured", [r["measured_peak_ratio"] for _, r in rows]),
            ("compiled plan", [compiled_plans.get(n, {}).get("measured_peak_ratio", float("nan")) for n in names]),
            ("compile@1", [compiled.get(n, {}).get("peak_ratio", float("nan")) for n in names]),
        ],
        "step": [
            ("simulated", [r["simulated_latency_ratio"] for _, r in rows]),
            ("measured", [r["measured_step_ratio"] for _, r in rows]),
            ("CUDA graph", [_replayed_step(r) for _, r in rows]),
            ("compiled plan", [compiled_plans.get(n, {}).get("measured_step_ratio", float("nan")) for n in names]),
            ("compile@1", [compiled.get(n, {}).get("step_ratio", float("nan")) for n in names]),
        ],
    }
    colors = {label: f"C{i}" for i, (label, _) in enumerate(bars["step"])}  # one colour per series in both panels
    fig = Figure(figsize=(11, 4))
    for ax, (what, series) in zip(fig.subplots(1, 2), bars.items()):
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series):
            ax.bar([x + i * width for x in range(len(names))], values, width, label=label, color=colors[label])
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=20)
        ax.set_ylabel(f"{what} / eager's")
        ax.legend(fontsize=8, loc="lower right")
    kind = next((k for k in ("memory_limit", "latency_limit") if rows and k in rows[0][1]), "memory_limit")
    limit = rows[0][1][kind] if rows else ""
    where = payload.get("device", "?")
    fig.suptitle(f"magis plans at {kind.replace('_', ' ')} {limit} on {where}: simulated vs measured")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _replayed_step(row: dict[str, Any]) -> float:
    """The step ratio of a plan replayed as a CUDA graph; NaN where the capture fell back."""
    graphs = row.get("graphs") or {}
    return graphs["measured_step_ratio"] if graphs.get("captured") else float("nan")


def _release(device: torch.device) -> None:
    """Give back what the last workload held, so the next one is measured alone."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert-base,unet,gpt-neo-1.3b")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cost-model", default=None, help="latency cost model (default: the device's profiled one)")
    parser.add_argument("--limits", default="0.8,0.6", help="memory limits, fractions of the captured step's peak")
    parser.add_argument(
        "--limit-kind",
        choices=("memory", "latency"),
        default="memory",
        help="--limits are memory limits (the fastest plan within each) or latency limits, multiples of the "
        "captured step's simulated latency (the lowest peak within each)",
    )
    parser.add_argument("--time-budget", type=float, default=60.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--compile-peer", action="store_true", help="also time torch.compile's step (compile@1)")
    parser.add_argument("--compile-plans", action="store_true", help="also run each plan searched with compile=True")
    parser.add_argument(
        "--compiled-only", action="store_true", help="only the plans searched with compile=True (no generated plan)"
    )
    parser.add_argument("--plans", default=None, metavar="DIR", help="read saved plans from DIR, save searched ones")
    parser.add_argument(
        "--search-only", action="store_true", help="only search and save the plans in --plans (and warm Inductor)"
    )
    parser.add_argument(
        "--no-cudnn",
        action="store_true",
        help="torch.backends.cudnn.enabled = False: eager's and the plans' LSTMs both run the native "
        "kernels (cuDNN draws an LSTM's inter-layer dropout itself, which magis refuses to capture)",
    )
    parser.add_argument("--out", default="results/plan_run.json")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw the first limit's ratios")
    parser.add_argument("--plot-only", default=None, metavar="JSON", help="only draw a run's JSON (with --plot)")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), args.plot or "plan_run.png")
        return
    device = torch.device(args.device)
    if args.no_cudnn:
        torch.backends.cudnn.enabled = False
    limits = [float(x) for x in args.limits.split(",")]
    if args.search_only:
        if not args.plans:
            parser.error("--search-only saves the plans in --plans DIR")
        Path(args.plans).mkdir(parents=True, exist_ok=True)
        for name in args.models.split(","):
            search_only(name, device, limits, args)
        return
    payload: dict[str, Any] = {"device": _device_name(device), "workloads": [], "compile@1": [], "compiled": []}
    names = args.models.split(",")
    for name in names:  # each workload whole before the next: a run cut short keeps complete rows
        print(f"{name} ({args.preset}, {device})", file=sys.stderr, flush=True)
        measures = []
        if not args.compiled_only:
            measures.append(("workloads", partial(measure_workload, name, args.preset, device, limits, args)))
        if args.compile_peer:
            measures.append(("compile@1", partial(measure_compiled, name, args.preset, device, args)))
        if args.compile_plans or args.compiled_only:
            measures.append(("compiled", partial(measure_compiled_plans, name, args.preset, device, limits, args)))
        for key, measure in measures:
            payload[key].append(measure())
            write_json(args.out, payload)
            _release(device)
    if args.plot:
        plot(payload, args.plot)
    print(f"wrote {args.out}")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()
