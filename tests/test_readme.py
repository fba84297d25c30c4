"""The README's Use section and docs/usage.md, which goes on from it, run as written: their
examples are executed here, in order, in one namespace, so that they cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
USAGE = README.parent / "docs" / "usage.md"  # goes on from the README's Use section


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def use_section_examples() -> list[str]:
    """The ``python`` code blocks of the README's "## Use" section, in order."""
    section = README.read_text().split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    return python_blocks(section)


def test_the_use_section_has_the_forms_the_readme_promises():
    code = "\n".join(use_section_examples())
    for form in ("training_step=", "plan(batch)", "magis.planned(", "plan.save(", "magis.load_plan("):
        assert form in code, form


def test_the_use_section_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # plan.save writes where the user stands
    monkeypatch.setenv("MAGIS_CACHE_DIR", str(tmp_path / "cache"))
    namespace: dict = {"__name__": "readme"}
    for path, block in [(README, b) for b in use_section_examples()] + [
        (USAGE, b) for b in python_blocks(USAGE.read_text())
    ]:
        exec(compile(block, str(path), "exec"), namespace)
    assert (tmp_path / "mlp.plan").is_file()
    step = namespace["step"]
    assert step.searches == 2  # the full batches and the smaller last one
    assert len(list((tmp_path / "cache").rglob("*"))) > 0  # the plans a restarted run would load
