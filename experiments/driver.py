"""What the benchmark drivers share: one workload per fresh process, and writing results.

Imported by the scripts of this folder (``python experiments/<script>.py`` puts the folder
on ``sys.path``); not part of the magis package.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


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
