"""The interpreter: a program run instruction by instruction, with a clock around each if asked.

The plan's step runs as generated code (:mod:`magis.backend.codegen`); the interpreter
stays for what needs a hook per instruction: the in-step profile of
:func:`magis.cost.op_timing.measure_in_step` (``seconds``) and a fissioned region that
merges a part's results as they come (``emit``). Swap transfers (Store and Load,
:mod:`magis.backend.transfer`) run on a side stream on CUDA, each reader of a loaded
tensor waiting for its copy; on a CPU they run in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from magis.backend.kernels import runtime_kernel
from magis.backend.program import Program
from magis.backend.transfer import Load, Store, TransferStreams
from magis.ir.graph import Ref, map_refs


def execute(
    program: Program,
    env: dict[str, Any],
    seconds: list[float] | None = None,
    emit: Callable[[str, Any], None] | None = None,
) -> dict[str, Any]:
    """Run the instructions; ``env`` holds the bound inputs and receives the outputs.

    With ``seconds``, the wall time of each instruction (mapping its arguments, the
    call, freeing what died) is appended to it: the in-step profile of
    :func:`magis.cost.op_timing.measure_in_step`. With ``emit``, each value is handed
    to ``emit(node, value)`` as soon as it is made, before what died is freed (a
    fissioned region merges a part's results as they come).
    """

    def value(ref: Ref) -> Any:
        return env[ref.name]

    streams = transfer_streams(program, env)
    clock = time.perf_counter
    with torch.no_grad():
        for ins in program.instructions:
            if seconds is not None:
                start = clock()
            args = map_refs(ins.args, value)
            kwargs = map_refs(ins.kwargs, value) if ins.kwargs else {}
            if streams is None:
                env[ins.node] = runtime_kernel(ins.fn)(*args, **kwargs)
            elif isinstance(ins.fn, (Store, Load)):
                env[ins.node] = streams.run(ins.node, ins.fn, *args)
            else:
                streams.wait_for(ins.waits)
                env[ins.node] = runtime_kernel(ins.fn)(*args, **kwargs)
            del args, kwargs
            if emit is not None:
                emit(ins.node, env[ins.node])
            for name in ins.free:
                del env[name]
            if seconds is not None:
                seconds.append(clock() - start)
        if streams is not None:
            streams.finish()
    return env


def transfer_streams(program: Program, env: dict[str, Any]) -> TransferStreams | None:
    """A side stream for the swaps of a program that runs on CUDA, else ``None``."""
    if not program.swaps:
        return None
    device = next((v.device for v in env.values() if isinstance(v, torch.Tensor) and v.is_cuda), None)
    return None if device is None else TransferStreams(device)
