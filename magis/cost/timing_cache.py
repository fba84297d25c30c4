"""Operator times kept on disk, per machine (MAGIS §5: the simulator's per-op profile).

A profiled cost model (:class:`magis.cost.latency.ProfiledCostModel`) measures each
distinct operator application once on the local device and keeps its time in a JSON
file, so a later run (or another process on the same machine) measures nothing. This
module is that file: where it lives and how it is read and written.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch

from magis.cost.local_device import device_tag

CACHE_FORMAT = 4  # 4: steps timed as generated code (magis.backend.codegen)
CACHE_DIR_ENV = "MAGIS_CACHE_DIR"
#: seconds per op key (``None``: the op could not run)
OpTimes = dict[str, float | None]


def default_cache_path(device: torch.device) -> Path:
    """``$MAGIS_CACHE_DIR`` (default ``~/.cache/magis``) ``/latency-<device>-<torch>-<host hash>.json``.

    On CPU ``<device>`` also names torch's intra-op thread count (``cpu-1threads``): a
    convolution on two threads takes about half its time on one, a small pointwise op or the
    runtime's own work hardly less, so times taken at one count misprice a plan run at another
    (recomputed pointwise ops against the convolutions they spare)."""
    base = Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "magis")
    host = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()
    tag = device_tag(device) + (f"-{torch.get_num_threads()}threads" if device.type == "cpu" else "")
    return base / f"latency-{tag}-{torch.__version__}-{host}.json"


class LatencyCache:
    """Seconds per op key timed alone (``ops``; ``None``: the op could not run) and
    timed in its step (``in_step``, :func:`magis.cost.op_keys.in_step_key`), the device's crude roofline
    and the runtime's own costs (:class:`magis.cost.runtime_costs.RuntimeCosts` as a dict, ``None`` until measured).
    ``alone`` holds the operators timed alone only to check an estimate from their kin
    (:meth:`~magis.cost.latency.ProfiledCostModel.node_seconds`): kept apart from ``ops``,
    whose operators are priced by that time, as these are priced by their kin's time in its step
    scaled by the two times alone. Kept on disk, a second search of a step on this machine
    spends its time budget searching, not timing: BERT small's search at 0.8 of eager's peak
    timed 87 operators alone and met the limit after 39 s of its 60; in a second process, 13 s.

    Saving merges with what other processes wrote meanwhile and replaces the file
    atomically, so concurrent runs never corrupt it. The in-step times of ``unsaved`` keys
    (timed while other processes held the cores) are this process's alone, never written.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ops, self.in_step, self.alone, self.device_profile, self.runtime_costs = self._read()
        self.unsaved: set[str] = set()

    def _read(self) -> tuple[OpTimes, dict[str, float], OpTimes, dict[str, Any] | None, dict[str, float] | None]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}, {}, {}, None, None
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
            return {}, {}, {}, None, None
        ops, in_step, alone = (dict(data.get(part, {})) for part in ("ops", "in_step", "alone"))
        return ops, in_step, alone, data.get("device_profile"), data.get("runtime_costs")

    def save(self) -> None:
        ops, in_step, alone, profile, runtime = self._read()
        ops.update(self.ops)
        alone.update(self.alone)
        quietly = self.unsaved & in_step.keys()  # timed by another process meanwhile: its times win
        self.unsaved -= quietly
        in_step.update((key, seconds) for key, seconds in self.in_step.items() if key not in quietly)
        self.ops, self.in_step, self.alone = ops, in_step, alone
        self.device_profile = self.device_profile or profile
        self.runtime_costs = self.runtime_costs or runtime
        data = {
            "format": CACHE_FORMAT,
            "torch": torch.__version__,
            "device_profile": self.device_profile,
            "runtime_costs": self.runtime_costs,
            "ops": ops,
            "alone": alone,
            "in_step": {key: seconds for key, seconds in in_step.items() if key not in self.unsaved},
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as tmp:
            json.dump(data, tmp, indent=0, sort_keys=True)
        os.replace(tmp.name, self.path)
