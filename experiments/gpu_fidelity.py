"""GPU cost-model fidelity: the analytic profile of this GPU vs its real kernels (MAGIS §5 simulator).

On a CUDA machine, for every workload of ``magis.models.WORKLOADS`` at ``--preset``
(``small`` by default: it fits any GPU with 16 GB): capture the training step on the
GPU, price every operator twice, with the ``cuda`` cost model (each distinct
operator timed on this GPU, ``magis.cost.latency.ProfiledCostModel``) and with the
analytic profile of the same GPU (``h100``, ``h200``, ``a100`` or ``rtx3090``, chosen
from the device name, or ``--profile``; ``magis.cost.latency.AnalyticCostModel`` with
this process's TF32 settings), and run the step through the magis runtime (median of
``--runs``). Reports per workload the analytic total's error against the profiled
total and against the measured step, the same split into GEMM-like operators
(matmul, convolution, attention) and the rest, and the operators whose two prices
differ most. Writes JSON.

    python experiments/gpu_fidelity.py [--out results/gpu_fidelity.json] [--preset small]
                                 [--models bert-base,unet] [--profile h100] [--runs 10]

Without CUDA it refuses, saying so.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from driver import write_json
from sim_fidelity import measure_step, to_device

from magis.cost.device_profiles import DEVICE_PROFILES
from magis.cost.latency import ProfiledCostModel, cost_model, estimate_latency, node_gemms
from magis.frontend.capture import CaptureError, capture
from magis.ir.graph import Graph
from magis.models import WORKLOADS

#: substrings of ``torch.cuda.get_device_name()`` naming each analytic profile.
PROFILE_OF_NAME = {"H200": "h200", "H100": "h100", "A100": "a100", "3090": "rtx3090"}
#: how many of the most differently priced operators each workload lists.
WORST_OPS = 8


def detect_profile(device_name: str) -> str | None:
    """The analytic profile for a CUDA device name (``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``);
    ``None`` for any other GPU, PCIe and NVL cards included (the profiles are SXM parts)."""
    name = device_name.upper()
    if "PCIE" in name or "NVL" in name:
        return None
    return next((profile for key, profile in PROFILE_OF_NAME.items() if key in name), None)


def relative(estimate: float, reference: float) -> float:
    return (estimate - reference) / reference


def compare_workload(name: str, preset: str, profiled: ProfiledCostModel, profile: str, runs: int) -> dict[str, Any]:
    """Profiled, analytic and measured step latency of one workload, with the per-operator split."""
    built = to_device(WORKLOADS[name].build(preset), profiled.device)
    graph: Graph = capture(built.model, built.example_inputs, built.loss_fn)
    order = [n.name for n in graph.nodes]
    start = time.perf_counter()
    real = estimate_latency(graph, order, profiled)
    profile_s = time.perf_counter() - start
    analytic = estimate_latency(graph, order, cost_model(profile))
    measured, _ = measure_step(built, graph, order, profiled.device, runs)
    gemm = {n.name for n in graph.nodes if node_gemms(graph, n.name)}
    split = {"gemm": [0.0, 0.0], "other": [0.0, 0.0]}
    ops = []
    for node, real_s, analytic_s in zip(order, real.per_node_s, analytic.per_node_s):
        part = split["gemm" if node in gemm else "other"]
        part[0] += real_s
        part[1] += analytic_s
        ops.append((abs(analytic_s - real_s), graph[node].op_name, node, real_s, analytic_s))
    ops.sort(reverse=True)
    return {
        "model": name,
        "nodes": len(graph),
        "profiled_s": real.total_s,
        "analytic_s": analytic.total_s,
        "measured_s": measured,
        "error_vs_profiled": relative(analytic.total_s, real.total_s),
        "error_vs_measured": relative(analytic.total_s, measured),
        "profiled_error_vs_measured": relative(real.total_s, measured),
        "split": {
            kind: {"profiled_s": p, "analytic_s": a, "error": relative(a, p) if p else None}
            for kind, (p, a) in split.items()
        },
        "most_different_ops": [
            {"op": op, "node": node, "profiled_s": p, "analytic_s": a} for _, op, node, p, a in ops[:WORST_OPS]
        ],
        "profile_seconds": profile_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/gpu_fidelity.json"))
    parser.add_argument("--models", default=",".join(WORKLOADS), help="comma-separated workload names")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--profile", choices=sorted(DEVICE_PROFILES), help="analytic profile (default: from the GPU)")
    parser.add_argument("--runs", type=int, default=10, help="timed steps per workload")
    parser.add_argument("--cache", type=Path, default=None, help="latency cache to use and keep (default: fresh)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("experiments/gpu_fidelity.py needs a CUDA GPU, and torch.cuda.is_available() is False here")
    device_name = torch.cuda.get_device_name()
    profile = args.profile or detect_profile(device_name)
    if profile is None:
        raise SystemExit(
            f"no analytic profile for {device_name!r}: pass --profile ({', '.join(sorted(DEVICE_PROFILES))})"
        )
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}: choose from {', '.join(WORKLOADS)}")

    rows, failures = [], {}
    with tempfile.TemporaryDirectory() as scratch:
        profiled = ProfiledCostModel("cuda", cache_path=args.cache or Path(scratch) / "latency.json")
        for i, name in enumerate(names, start=1):
            try:
                row = compare_workload(name, args.preset, profiled, profile, args.runs)
            except (CaptureError, torch.cuda.OutOfMemoryError) as err:
                failures[name] = str(err)
                print(f"[{i}/{len(names)}] {name}: skipped, {err}", flush=True)
                torch.cuda.empty_cache()
                continue
            rows.append(row)
            print(
                f"[{i}/{len(names)}] {name}: profiled {row['profiled_s'] * 1e3:.2f} ms, analytic "
                f"{row['analytic_s'] * 1e3:.2f} ms ({row['error_vs_profiled']:+.1%}; GEMM-like "
                f"{row['split']['gemm']['error'] or 0:+.1%}), measured {row['measured_s'] * 1e3:.2f} ms "
                f"(analytic {row['error_vs_measured']:+.1%}, profiled {row['profiled_error_vs_measured']:+.1%})",
                flush=True,
            )
    if not rows:
        raise SystemExit("no workload could be measured")
    errors = [abs(r["error_vs_profiled"]) for r in rows]
    report = {
        "gpu": device_name,
        "profile": profile,
        "preset": args.preset,
        "torch": torch.__version__,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_conv": torch.backends.cudnn.allow_tf32,
        "mean_abs_error_vs_profiled": statistics.mean(errors),
        "max_abs_error_vs_profiled": max(errors),
        "mean_abs_error_vs_measured": statistics.mean(abs(r["error_vs_measured"]) for r in rows),
        "workloads": rows,
        "failed": failures,
    }
    write_json(args.out, report)
    print(
        f"analytic {profile} vs profiled {device_name}: |error| mean {report['mean_abs_error_vs_profiled']:.1%}, "
        f"max {report['max_abs_error_vs_profiled']:.1%}; vs measured steps: mean "
        f"{report['mean_abs_error_vs_measured']:.1%}"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
