"""The yardstick's full steps (issue #29): each peer with AdamW's update, for real and simulated.

The real steps update the parameters as a plain AdamW loop does (step-in-backward through
``register_post_accumulate_grad_hook``), their simulated graphs hold the update, and on this
CPU the measured peak of each full step is its simulated one."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from magis.backend.meter import resident_tensors
from magis.cost.memory import simulate_memory
from magis.frontend.optimizer import ParameterUpdate
from magis.frontend.step import UserStep, as_batch
from magis.ir.graph import Graph, Role
from magis.models import build_workload
from yardstick.compare import compare
from yardstick.methods import FULL_STEP_REFERENCE, METHODS, REFERENCE, Subject, Variant, variants
from yardstick.methods.full_step import IN_BACKWARD, trained
from yardstick.protocol import Rounds, measure_peak

#: the full-step peers run for real and simulated on unet (compile+step, whose backward
#: test_peers.py runs compiled, only simulated here: its real step is another 10 s)
MEASURED = ["eager+step", IN_BACKWARD, "accumulate+step", "checkpoint-block+step"]
#: measured and simulated peaks of a full step on this CPU agree within this fraction of the measured
#: (measured: 0.4% at most on unet, btlm-3b and resnet50 tiny; the update's temporaries are counted exactly)
PEAK_TOLERANCE = 0.01

Run = tuple["int | None", int, Graph, list[str]]  # measured peak (None: not run), simulated peak, graph, order


@pytest.fixture(scope="module")
def full_steps() -> dict[str, Run]:
    """unet tiny's full-step variants: measured and simulated peaks and simulated graph."""
    subject = Subject("unet", "tiny")
    runs: dict[str, Run] = {}
    for variant in variants([*MEASURED, "compile+step"], [0.5], subject.batch_size):
        peak = None
        if variant.method.name in MEASURED:
            runnable = variant.real(subject)
            resident = [*resident_tensors(runnable.built.model, runnable.built.example_inputs), *runnable.resident]
            peak, _ = measure_peak(runnable.step, resident)
        graph, order = variant.simulate(subject)
        runs[variant.name] = (peak, simulate_memory(graph, order).peak, graph, list(order))
    return runs


def _plain_adamw(subject: Subject, steps: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """``steps`` steps of a plain eager loop, ``zero_grad; loss.backward(); optimizer.step()`` with
    AdamW at its defaults, on a build of ``subject``; the model and the first step's gradients."""
    built = subject.rebuild()
    model, user = built.model, UserStep(built.loss_fn, None)
    optimizer = torch.optim.AdamW(model.parameters())
    first = {}
    for i in range(steps):
        torch.manual_seed(0)
        optimizer.zero_grad(set_to_none=True)
        user.loss(model, as_batch(built.example_inputs)).backward()
        if i == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
    return model, first


def test_real_full_steps_update_the_parameters_as_a_plain_adamw_loop():
    """btlm-3b ties its output layer to the embeddings: one parameter with two uses, which the
    hook of step-in-backward updates once, when both gradients are summed."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    subject = Subject("btlm-3b", "tiny", dtype=torch.float64)
    expected, gradients = _plain_adamw(subject, 2)
    initial = dict(subject.built.model.named_parameters())
    for name in (FULL_STEP_REFERENCE, IN_BACKWARD):
        runnable = Variant(METHODS[name]).real(subject)
        model = runnable.built.model
        assert model is not subject.built.model  # its own weights: the subject's stay as built
        for i in range(2):
            torch.manual_seed(0)
            runnable.step(contextlib.nullcontext())
            if i == 0:  # what a comparison checks: the gradients the updates used, read from AdamW's states
                used = runnable.used_gradients()
                assert used.keys() == gradients.keys(), name
                for n, g in gradients.items():
                    torch.testing.assert_close(used[n], g, rtol=1e-10, atol=1e-14)
        moved = 0
        for (n, p), (_, q) in zip(model.named_parameters(), expected.named_parameters(), strict=True):
            assert p.grad is None, (name, n)  # each gradient freed once applied
            torch.testing.assert_close(p, q, rtol=1e-12, atol=0.0)
            moved += not torch.equal(p, initial[n])
        assert moved == len(trained(subject)), name


def test_simulated_full_steps_hold_the_update(full_steps):
    trained_params = None
    for name, (_, _, graph, order) in full_steps.items():
        updates = [n for n in graph.nodes if isinstance(n.target, ParameterUpdate)]
        updated = [p for n in updates for p in n.target.params]
        assert updates and len(updated) == len(set(updated)), name
        trained_params = set(updated) if trained_params is None else trained_params
        assert set(updated) == trained_params, name  # every trained parameter, once
        assert not graph.signature.gradients, name  # no gradient outlives its update
        states = [n for n in graph.nodes if n.role is Role.OPTIMIZER and n.target is None]
        assert len(states) == 1 + 3 * len(updated), name  # the optimizer, and step, exp_avg, exp_avg_sq
        assert not any(n.target.foreach for n in updates), name  # this CPU's loop over the parameters
        position = {n: i for i, n in enumerate(order)}
        if name == IN_BACKWARD:  # one update per parameter, each right after what it must follow
            assert all(len(n.target.params) == 1 for n in updates)
            for n in updates:
                before = max(position[p] for p in graph.predecessors[n.name])
                between = order[before + 1 : position[n.name]]
                assert all(isinstance(graph[m].target, ParameterUpdate) for m in between), n.name
        else:  # eager's optimizer.step(): one update, after the whole backward (the last micro-batch's)
            assert len(updates) == 1, name
            assert position[updates[0].name] == len(order) - 1, name
    assert full_steps["eager+step"][1] > full_steps[IN_BACKWARD][1]


def test_measured_full_step_peaks_match_their_simulation(full_steps):
    for name, (measured, simulated, _, _) in full_steps.items():
        if measured is not None:
            assert abs(simulated - measured) <= PEAK_TOLERANCE * measured, (name, measured, simulated)


def test_a_comparison_of_full_steps_is_against_eagers_full_step():
    assert variants([IN_BACKWARD, "compile+step"], [0.5])[0].name == FULL_STEP_REFERENCE
    assert [v.name for v in variants(["accumulate+step"], [1.0], batch=4)] == [
        FULL_STEP_REFERENCE,
        "accumulate@2+step",
        "accumulate@4+step",
    ]
    assert variants([REFERENCE, IN_BACKWARD])[0].name == REFERENCE  # beside a backward-only step: against eager
    assert all(METHODS[n].opt_in for n in METHODS if METHODS[n].full_step)  # never in a default comparison
    comparison = compare("unet", "tiny", [IN_BACKWARD], rounds=Rounds(1, warmup=0, max_repeats=1))
    eager, in_backward = comparison.rows
    assert comparison.measured and eager.method == FULL_STEP_REFERENCE and eager.peak_ratio == 1.0
    assert in_backward.max_grad_error == 0.0  # the gradients each update used: eager's backward's, exactly
    assert in_backward.peak_ratio < 1.0
    facts = eager.details
    parts = ("weight_bytes", "buffer_bytes", "optimizer_state_bytes", "input_bytes")
    assert facts["floor_bytes"] == sum(facts[p] for p in parts)
    params = len(list(build_workload("unet", "tiny", None).model.parameters()))  # every one trained
    assert facts["optimizer_state_bytes"] == 2 * facts["weight_bytes"] + 4 * params  # moments, float32 step counts
    assert facts["gradient_bytes"] == facts["weight_bytes"]
