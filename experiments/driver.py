"""What the benchmark drivers share: one workload per fresh process, and writing results.

Imported by the scripts of this folder (``python experiments/<script>.py`` puts the folder
on ``sys.path``); not part of the magis package.
"""

from __future__ import annotations

import collections
import ctypes
import json
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from magis.ir.graph import Graph


def measure_in_subprocess(script: str, name: str, *args: str) -> dict[str, Any]:
    """Run ``python script --one name *args`` in a fresh interpreter (its memory, caches and
    peak RSS are the workload's own) and return the JSON object of its last stdout line."""
    done = subprocess.run([sys.executable, script, "--one", name, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit code {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_json(path: str | Path, payload: Any) -> Path:
    """Write ``payload`` as indented JSON to ``path`` (its folder made if needed)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return out


def workloads_and_presets(
    models: str, presets: str, workloads: Collection[str], known_presets: Collection[str]
) -> tuple[list[str], list[str]] | None:
    """A driver's comma-separated ``--models`` and ``--presets`` as lists, or None after saying
    on stderr which one is not among ``workloads`` / ``known_presets`` (the driver exits with 2)."""
    chosen = [m for m in models.split(",") if m], [p for p in presets.split(",") if p]
    unknown = [m for m in chosen[0] if m not in workloads] + [p for p in chosen[1] if p not in known_presets]
    if unknown:
        print(
            f"unknown workload or preset {unknown[0]!r}: workloads {', '.join(workloads)}; "
            f"presets {', '.join(known_presets)}",
            file=sys.stderr,
        )
        return None
    return chosen


def kahn_order(graph: Graph) -> list[str]:
    """Kahn's algorithm with a FIFO queue, ready nodes in node order: the order a framework
    without memory-aware scheduling runs (Serenity's baseline, TensorFlow Lite's)."""
    indegree = {name: len(preds) for name, preds in graph.predecessors.items()}
    ready = collections.deque(n.name for n in graph.nodes if not indegree[n.name])
    order = []
    while ready:
        name = ready.popleft()
        order.append(name)
        for succ in graph.successors[name]:
            indegree[succ] -= 1
            if not indegree[succ]:
                ready.append(succ)
    return order


#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def steady_allocator() -> bool:
    """Make glibc's malloc keep what is freed in this process (True where it could).

    By default glibc hands a block above its mmap threshold back to the operating system when
    it is freed, and trims the heap's free top, so a step that allocates and frees tensors of
    megabytes pays page faults at every call; how many depends on the allocator's history, so
    a batch-1 forward of 5 ms on a CPU measured 1.02 of eager in one process and 1.49 in the
    next. With the largest mmap threshold (32 MiB) and a trim threshold of 2 GiB, eager and
    every plan reuse their memory, as they would under jemalloc or tcmalloc (which PyTorch's
    performance tuning guide recommends for CPU inference). Call it before timing.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
