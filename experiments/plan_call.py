"""Where a plan's step time goes: ``plan(*batch)`` as a user calls it against its generated code alone.

On an H200 (2026-11-30, docs/results.md) ResNet-50 small's plan at 0.8 ran 1.70x eager's step
as ``plan(*batch)``, while its whole-step trial had timed the same generated code at eager's
speed on random inputs. This script times, per workload, in paired rounds
(:func:`magis.cost.op_timing.time_in_turns`): eager's step, ``plan(*batch)``,
:func:`~magis.backend.runtime.run_program` (binding the model's tensors, copying buffer
updates back), and the generated step alone on the bound inputs and on random inputs as the
trials make them; ``--profile`` adds torch.profiler's costliest ops of each (self time, CUDA
where the model is on CUDA).

    python experiments/plan_call.py --models resnet50 --preset small --device cuda --cost-model h200
                                    --limit 0.8 --profile --out plan_call.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from driver import write_json

import magis
from magis.backend.eager import eager_step
from magis.backend.runtime import bind, run_program
from magis.cost.op_keys import replay_strides
from magis.cost.op_timing import time_in_turns
from magis.models import ZOO
from magis.plan import _random_inputs


def calls(plan: magis.Plan, model: torch.nn.Module, batch: tuple, loss_fn: Any) -> dict[str, Any]:
    """Each way of running the step, as a call of no arguments (gradients zeroed first)."""
    graph, device = plan.program.graph, next(model.parameters()).device
    step = plan.generated
    given = plan.batch.tensors(plan.batch.given(batch))
    bound = bind(graph, model, given, module_inputs=plan.module_inputs)
    random = dict(zip(graph.inputs, _random_inputs(graph, graph.inputs, replay_strides(graph, every_op=True), device)))

    def zeroed(fn: Any) -> Any:
        def call() -> None:
            model.zero_grad(set_to_none=True)
            fn()

        return call

    return {
        "eager": zeroed(lambda: eager_step(model, batch, loss_fn)),
        "plan(*batch)": zeroed(lambda: plan(*batch)),
        "run_program": zeroed(
            lambda: run_program(plan.program, model, given, runtime=step, module_inputs=plan.module_inputs)
        ),
        "generated, bound inputs": lambda: step(dict(bound)),
        "generated, random inputs": lambda: step(dict(random)),
    }


def profiled(call: Any, device: torch.device, top: int) -> list[dict[str, Any]]:
    """torch.profiler's ``top`` ops of one call by self time (the device's where on CUDA)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    return [
        {"op": e.key, "calls": e.count, "self_us": getattr(e, key), "cpu_us": e.self_cpu_time_total} for e in events
    ]


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    built = ZOO[name].build(args.preset)
    model = built.model.to(device)
    batch = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in built.example_inputs)
    limit = {"latency_limit": args.latency_limit} if args.latency_limit else {"memory_limit": args.limit}
    plan = magis.optimize(
        model, batch, built.loss_fn, time_budget=args.time_budget, device=args.cost_model, cuda_graphs=False,
        progress=False, **limit,
    )  # fmt: skip
    runs = calls(plan, model, batch, built.loss_fn)
    for call in runs.values():  # warm-up: the generated code is made at its first call
        call()
    timed = time_in_turns(list(runs.values()), device, args.rounds, max_seconds=300.0)
    seconds = dict(zip(runs, timed.seconds))
    row: dict[str, Any] = {
        "model": name,
        "ops": len(plan.program.instructions),
        "simulated_latency_ratio": plan.report().latency_ratio,
        "seconds": seconds,
        "ratio_to_eager": {k: s / seconds["eager"] for k, s in seconds.items()},
        "rounds": timed.rounds,
    }
    if args.profile:
        row["profile"] = {k: profiled(call, device, args.top) for k, call in runs.items()}
    print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in row["ratio_to_eager"].items()), file=sys.stderr)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cost-model", default=None, help="latency cost model (default: the device's profiled one)")
    parser.add_argument("--limit", type=float, default=0.8, help="memory limit, a fraction of the captured peak")
    parser.add_argument(
        "--latency-limit", type=float, default=None, help="instead: the lowest peak within this latency"
    )
    parser.add_argument("--time-budget", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="also torch.profiler's costliest ops of each call")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default="results/plan_call.json")
    args = parser.parse_args()
    rows = [measure(name, args) for name in args.models.split(",")]
    print(f"wrote {write_json(args.out, {'device': args.device, 'preset': args.preset, 'workloads': rows})}")


if __name__ == "__main__":
    main()
