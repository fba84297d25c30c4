"""Plan files (``plan.save`` / ``magis.load_plan``), ``InfeasibleLimit.best`` and ``progress=False``:
a loaded plan trains exactly as the saved one, a file for another model or a damaged one is a
clear error before anything runs, a near miss keeps its plan, and a quiet search prints nothing."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from test_optimize import MLP
from torch import nn

import magis
from magis import plan_file
from magis.api import floor_bytes
from magis.cost.latency import cost_model
from magis.cost.memory import simulate_memory

OPTIONS = {"device": "h200", "max_states": 12, "time_budget": 20.0, "progress": False}


def mlp(h: int = 64) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return MLP(d=32, h=h).double(), torch.randn(128, 32, dtype=torch.float64)


def eager(model: nn.Module):
    """Eager PyTorch's training step: the loss, its backward run."""

    def run(x: torch.Tensor) -> torch.Tensor:
        loss = model(x)
        loss.backward()
        return loss

    return run


def step(run, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss of ``run(x)`` and the gradients it leaves, from zeroed gradients."""
    model.zero_grad(set_to_none=True)
    loss = run(x).detach()
    return loss, [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[magis.Plan, torch.Tensor, object]:
    model, x = mlp()
    plan = magis.optimize(model, (x,), memory_limit=0.6, **OPTIONS)
    return plan, x, plan.save(tmp_path_factory.mktemp("plans") / "mlp.plan")


def test_a_loaded_plan_trains_exactly_as_the_saved_one(saved):
    plan, x, path = saved
    loaded = magis.load_plan(path, plan.model)
    assert plan.report().transformations["fission"], "the plan should fission something"
    assert loaded.report() == plan.report()
    assert (loaded.peak_bytes, loaded.order, loaded.objective) == (plan.peak_bytes, plan.order, plan.objective)
    expected_loss, expected_grads = step(plan, plan.model, x)
    loss, grads = step(loaded, plan.model, x)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads))


def test_a_plan_loads_in_the_runtime_it_was_saved_in(saved, tmp_path):
    """A plan of ``optimize(compile=True)`` was priced compiled: loaded, it ran as generated code."""
    plan, x, _ = saved
    compiled = replace(plan, runtime="compiled", timed=False, cuda_graphs=False)
    loaded = magis.load_plan(compiled.save(tmp_path / "compiled.plan"), plan.model)
    assert (loaded.runtime, loaded.timed, loaded.cuda_graphs) == ("compiled", False, False)
    loss, grads = step(loaded, plan.model, x)
    expected_loss, expected_grads = step(plan, plan.model, x)
    assert loaded.report().runtime["segments"] > 0
    torch.testing.assert_close(loss, expected_loss, rtol=1e-9, atol=0)
    for got, expected in zip(grads, expected_grads):
        torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-12)


def test_a_loaded_plan_runs_on_a_copy_of_the_model_and_the_file_holds_no_weights(saved, tmp_path):
    plan, x, path = saved
    twin = copy.deepcopy(plan.model)
    loaded = magis.load_plan(path, twin)
    eager_loss, eager_grads = step(eager(twin), twin, x)
    loss, grads = step(loaded, twin, x)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-12, atol=0)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-14)
    big, _ = mlp(h=512)  # 0.3 MiB of weights: the plan of its step stays much smaller
    big_path = magis.optimize(big, (torch.randn(4, 32, dtype=torch.float64),), **OPTIONS).save(tmp_path / "big.plan")
    weights = sum(p.numel() * p.element_size() for p in big.parameters())
    assert big_path.stat().st_size < weights / 4


def test_a_plan_file_of_another_model_is_refused_naming_the_first_difference(saved):
    plan, _, path = saved
    other, _ = mlp(h=48)
    with pytest.raises(ValueError, match=r"another model: parameter 'a.weight' is \[48, 32\] float64"):
        magis.load_plan(path, other)
    frozen = copy.deepcopy(plan.model)
    frozen.a.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"'a.bias' is \[64\] float64, frozen in this model"):
        magis.load_plan(path, frozen)
    renamed = nn.Sequential(plan.model)
    with pytest.raises(ValueError, match=r"the plan's parameter 'a\.weight' is not in this model"):
        magis.load_plan(path, renamed)


def test_a_plan_file_loaded_for_a_model_whose_code_was_edited_is_refused_at_its_call(saved):
    """The same class and parameters with another ``forward`` (the file edited since): the plan
    holds the old code's graph, so its first call refuses, before anything runs."""
    plan, x, path = saved
    edited_forward = type(plan.model).forward

    class Edited(type(plan.model)):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * edited_forward(self, x)

    Edited.__qualname__, Edited.__module__ = type(plan.model).__qualname__, type(plan.model).__module__
    edited = copy.deepcopy(plan.model)
    edited.__class__ = Edited
    loaded = magis.load_plan(path, edited)
    with pytest.raises(ValueError, match=r"the code of the model's class MLP is not the code the plan was made with"):
        loaded(x)
    assert all(p.grad is None for p in edited.parameters())


def test_missing_damaged_and_foreign_files_are_clear_errors(saved, tmp_path):
    plan, _, path = saved
    with pytest.raises(FileNotFoundError, match="no plan file at"):
        magis.load_plan(tmp_path / "nothing.plan", plan.model)
    data = path.read_bytes()
    truncated = tmp_path / "truncated.plan"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="is damaged"):
        magis.load_plan(truncated, plan.model)
    foreign = tmp_path / "weights.pt"
    torch.save(plan.model.state_dict(), foreign)
    with pytest.raises(ValueError, match="not a magis plan file"):
        magis.load_plan(foreign, plan.model)


def test_a_file_of_other_versions_is_refused(saved, tmp_path, monkeypatch):
    plan = saved[0]
    real = plan_file.versions()
    monkeypatch.setattr(plan_file, "versions", lambda: {**real, "torch": "1.0"})
    old = plan.save(tmp_path / "old.plan")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=re.escape(f"made with torch 1.0, this is torch {torch.__version__}")):
        magis.load_plan(old, plan.model)


def test_a_failed_save_leaves_the_previous_file_whole(saved, tmp_path):
    plan = saved[0]
    target = plan.save(tmp_path / "keep.plan")
    before = target.read_bytes()
    broken = copy.copy(plan)
    broken.device = lambda: "a lambda cannot be pickled"
    with pytest.raises(ValueError, match="cannot be written to a file"):
        broken.save(target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["keep.plan"]  # no temporary file left


def test_infeasible_limit_keeps_the_best_plan_of_a_near_miss(saved):
    plan, x, _ = saved
    model, graph = plan.model, plan.baseline  # the step optimize searched from
    floor = floor_bytes(graph, simulate_memory(graph, [n.name for n in graph.nodes]))
    with pytest.raises(magis.InfeasibleLimit, match="not met") as near:
        magis.optimize(model, (x,), memory_limit=floor, **OPTIONS)
    best = near.value.best
    assert isinstance(best, magis.Plan) and best.peak_bytes > floor
    loss, grads = step(best, model, x)  # a near miss still trains like eager
    eager_loss, eager_grads = step(eager(model), model, x)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-12, atol=0)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-14)
    with pytest.raises(magis.InfeasibleLimit, match="below the floor") as below:
        magis.optimize(model, (x,), memory_limit=floor - 1, **OPTIONS)
    assert below.value.best is None


def test_progress_false_prints_nothing(capfd):
    model, x = mlp()
    magis.optimize(model, (x,), memory_limit=0.6, **OPTIONS)
    assert capfd.readouterr() == ("", "")
    assert cost_model("cpu", progress=False).progress is False  # the operator-timing bar is off too


def test_progress_names_the_stages_before_the_search_and_their_seconds(capfd):
    """Capturing a large model takes a minute before any bar: a line says what runs, and how long it took."""
    model, x = mlp()
    magis.optimize(model, (x,), memory_limit=0.6, **{**OPTIONS, "progress": True})
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("magis: ") and "search" not in line]
    assert lines[0] == "magis: capturing the step (forward, loss, backward)..."
    assert re.fullmatch(r"magis: captured in \d+\.\d s", lines[1])
    assert re.fullmatch(r"magis: checking its \d+ nodes against eager\.\.\.", lines[2])
    assert re.fullmatch(r"magis: checked in \d+\.\d s", lines[3])


def test_a_models_code_is_recorded_alike_in_processes_of_other_string_hash_seeds(tmp_path):
    """A plan file records the code of the model's classes; another process must read the same
    code as the same (a set literal in a method compiles to a frozenset, ordered by the string
    hash seed), or every plan would be refused as edited."""
    source = tmp_path / "user_model.py"
    source.write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def forward(self, x, mode='gelu'):\n"
        "        return x.relu() if mode in {'relu', 'relu6', 'leaky', 'prelu', 'elu'} else x\n"
    )
    script = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import user_model, magis.frontend.conditions as c; "
        "print(c.module_records(user_model.Net()))"
    )
    records = {
        subprocess.run(
            [sys.executable, "-c", script], env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(records) == 1 and "Net" in records.pop()
