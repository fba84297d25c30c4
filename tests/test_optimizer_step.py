"""The whole step (issue #29): ``magis.optimize(..., optimizer=opt)`` runs forward, backward and the
update, and must leave the parameters and the optimizer's states exactly as eager's
``zero_grad(); backward(); step()`` would, with the measured peak the simulated one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import magis
from magis.backend.meter import LiveTensorMeter
from magis.frontend.optimizer import ParameterUpdate
from magis.rules.tied_gradient import EmbeddingGradientInto

STEPS = 10


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Dropout(0.2), nn.Linear(24, 24), nn.Tanh())
        self.head = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # no bias before batch norm, which removes it: its exact gradient is 0, its value rounding, and
        # Adam's update of a rounding-level gradient is the learning rate times its sign
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3)
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean(dim=(2, 3)))


class TiedLM(nn.Module):
    """An embedding whose weight is also the output projection's (as BERT's and GPT-2's)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.mix = nn.Linear(16, 16)
        self.out = nn.Linear(16, 40, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mix(self.embed(ids))))


def _workload(name: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    if name == "dropout":
        return DropoutMLP().double(), (torch.randn(8, 12, dtype=torch.float64), torch.randint(0, 3, (8,)))
    if name == "batch-norm":
        return ConvBN().double(), (torch.randn(4, 3, 6, 6, dtype=torch.float64), torch.randint(0, 3, (4,)))
    ids = torch.randint(0, 40, (4, 6))
    return TiedLM().double(), (ids, torch.roll(ids, 1, dims=1))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _optimizer(
    kind: str, model: nn.Module
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.1), None
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3), None
    if kind == "adam-decoupled":  # AdamW's update from Adam (torch >= 2.6)
        return torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch))


def _eager_step(model, opt, batch, max_grad_norm=None) -> torch.Tensor:
    opt.zero_grad()
    loss = _loss(model, *batch)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    return loss


def _assert_same(model, twin, opt, opt_twin, exact: bool = True) -> None:
    """Parameters, optimizer states and buffers equal: bitwise, or (``exact=False``, a fissioned
    plan, which sums a gradient over its parts in another order) to rounding (:func:`_rounding`)."""

    def same(a: torch.Tensor, b: torch.Tensor, what: object) -> None:
        if exact:
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(a, b, **_rounding(a), msg=str(what))

    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        same(p, q, name)
        assert p.grad is None, name
        state, state_twin = opt.state[p], opt_twin.state[q]
        assert state.keys() == state_twin.keys(), name
        for key in state:
            same(state[key], state_twin[key], (name, key))
    for b, c in zip(model.buffers(), twin.buffers()):
        same(b, c, "buffer")


@pytest.mark.parametrize("workload", ["dropout", "batch-norm", "tied"])
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_ten_steps_equal_eager(workload: str, kind: str) -> None:
    model, batch = _workload(workload)
    twin = copy.deepcopy(model)
    opt, schedule = _optimizer(kind, model)
    opt_twin, schedule_twin = _optimizer(kind, twin)
    limit = 0.85 if workload == "tied" else 0.95  # the tied model's plans fission the embedding's backward
    plan = magis.optimize(
        model,
        batch,
        training_step=_loss,
        optimizer=opt,
        memory_limit=limit,
        time_budget=10,
        max_states=40,
        progress=False,
    )
    report = plan.report()
    assert report.optimizer["in_plan"]
    # a fissioned plan sums gradients over its parts, a batch norm's backward from its output
    # (magis.rules.output_backward) normalises again from the output: other rounding
    exact = not report.transformations["fission"] and not plan.graph.signature.divided_by
    for i in range(STEPS):
        torch.manual_seed(i)
        loss = plan(*batch)
        torch.manual_seed(i)
        loss_twin = _eager_step(twin, opt_twin, batch)
        torch.testing.assert_close(loss, loss_twin, rtol=0 if exact else 1e-10, atol=0 if exact else 1e-12)
        for s in (schedule, schedule_twin):
            if s is not None:
                s.step()
        _assert_same(model, twin, opt, opt_twin, exact)
    # steady state (every state made): the measured peak is the simulated one and within the limit
    with LiveTensorMeter(resident=_resident(model, opt, batch)) as meter:
        plan(*batch)
    measured = meter.reading().peak_bytes
    assert abs(measured - plan.peak_bytes) <= 0.02 * plan.peak_bytes, (measured, plan.peak_bytes)
    assert measured <= 1.02 * plan.objective.memory_bytes


@pytest.mark.skipif(
    "decoupled_weight_decay" not in torch.optim.Adam.__init__.__code__.co_varnames, reason="torch < 2.6"
)
def test_adam_with_decoupled_weight_decay_steps_as_eager() -> None:
    test_ten_steps_equal_eager("dropout", "adam-decoupled")
    model, batch = _workload("dropout")
    opt, _ = _optimizer("adam-decoupled", model)
    plan = magis.optimize(model, batch, training_step=_loss, optimizer=opt, time_budget=5, progress=False)
    opt.param_groups[0]["decoupled_weight_decay"] = False  # another update: refused, not run as planned
    with pytest.raises(ValueError, match="decoupled_weight_decay is False"):
        plan(*batch)


def _resident(model, opt, batch):
    states = [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return [*model.parameters(), *model.buffers(), *states, *batch]


class Deep(nn.Module):
    """Eight equal layers: the gradients, not one update's temporaries, make the full step's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(48, 48), nn.Tanh())])
        self.head = nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def _deep() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return Deep().double(), (torch.randn(8, 48, dtype=torch.float64), torch.randint(0, 4, (8,)))


def test_early_updates_run_before_the_backward_ends() -> None:
    model, batch = _deep()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # timed=False: the estimates' choice, which takes the early updates (a plan timed faster may not)
    plan = magis.optimize(
        model, batch, training_step=_loss, optimizer=opt, memory_limit=0.85, time_budget=10, timed=False, progress=False
    )
    report = plan.report()
    assert report.peak_ratio <= 0.85 and any(step["rule"] == "early-update" for step in report.transformations["steps"])
    pos = {name: i for i, name in enumerate(plan.order)}
    updates = {p: n for n in plan.graph.nodes if isinstance(n.target, ParameterUpdate) for p in n.target.params}
    last_gradient = max(pos[g] for n in updates.values() for g in n.target.gradients(n))
    # the last hidden layer's gradient is final early: its update runs while the backward still goes on
    assert pos[updates["layers.14.weight"].name] < last_gradient
    assert report.optimizer["updated_before_backward_ends"] >= 8


def test_clipping_is_exact_and_holds_the_gradients() -> None:
    model, batch = _deep()
    twin = copy.deepcopy(model)
    opt, opt_twin = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin))
    search = {"time_budget": 120, "max_states": 60, "progress": False}  # bounded by states: deterministic
    plan = magis.optimize(model, batch, training_step=_loss, optimizer=opt, max_grad_norm=0.05, **search)
    clipped = plan.report().optimizer
    other = copy.deepcopy(model)
    unclipped = magis.optimize(
        other, batch, training_step=_loss, optimizer=torch.optim.AdamW(other.parameters()),
        memory_limit=plan.peak_bytes, verify=False, **search,
    )  # fmt: skip
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert clipped["clipping_holds_bytes"] == gradient_bytes
    assert unclipped.peak_bytes < plan.peak_bytes  # without clipping, updates free gradients early
    for i in range(3):
        torch.manual_seed(i)
        plan(*batch)
        torch.manual_seed(i)
        _eager_step(twin, opt_twin, batch, max_grad_norm=0.05)
        _assert_same(model, twin, opt, opt_twin, exact=not _sums_otherwise(plan))


def _sums_otherwise(plan: magis.Plan) -> bool:
    """The plan adds some gradient in another order than eager: over fissioned parts, or
    after the separable rewrite (equal to float64's rounding, not bitwise)."""
    return bool(plan.search.best.regions()) or any(s.rule == "separable" for s in plan.search.best.steps)


def test_another_optimizer_is_stepped_after_the_plan() -> None:
    model, batch = _workload("dropout")
    twin = copy.deepcopy(model)
    opt, opt_twin = (torch.optim.RMSprop(m.parameters(), lr=1e-2) for m in (model, twin))
    plan = magis.optimize(model, batch, training_step=_loss, optimizer=opt, time_budget=5, progress=False)
    summary = plan.report().optimizer
    assert not summary["in_plan"] and "RMSprop" in summary["note"] and "after the plan" in summary["note"]
    for i in range(3):
        torch.manual_seed(i)
        plan(*batch)
        torch.manual_seed(i)
        _eager_step(twin, opt_twin, batch)
        _assert_same(model, twin, opt, opt_twin)


def test_whole_step_refuses_what_it_cannot_do_right(tmp_path) -> None:
    model, batch = _workload("dropout")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizer= too"):
        magis.optimize(model, batch, training_step=_loss, max_grad_norm=1.0, progress=False)
    with pytest.raises(ValueError, match="not the model's"):
        magis.optimize(model, batch, training_step=_loss, optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1))
    plan = magis.optimize(model, batch, training_step=_loss, optimizer=opt, time_budget=5, progress=False)
    with pytest.raises(ValueError, match="GradScaler"):
        plan(*batch, grad_scale=1024.0)
    next(model.parameters()).grad = torch.zeros_like(next(model.parameters()))
    with pytest.raises(ValueError, match="zero_grad"):
        plan(*batch)
    opt.zero_grad()
    opt.param_groups[0]["nesterov"] = True
    opt.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ValueError, match="optimize again"):
        plan(*batch)
    opt.param_groups[0]["nesterov"] = False
    opt.param_groups[0]["momentum"] = 0.0
    path = plan.save(tmp_path / "step.plan")
    with pytest.raises(ValueError, match="optimizer"):
        magis.load_plan(path, model)
    with pytest.raises(ValueError, match="optimizer is AdamW; the plan was made for SGD"):
        magis.load_plan(path, model, torch.optim.AdamW(model.parameters()))  # refused before any step
    loaded = magis.load_plan(path, model, opt)
    before = [p.clone() for p in model.parameters()]
    loaded(*batch)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_planned_keeps_its_plan_across_learning_rates(tmp_path) -> None:
    model, batch = _workload("dropout")
    twin = copy.deepcopy(model)
    opt, schedule = _optimizer("adamw", model)
    opt_twin, schedule_twin = _optimizer("adamw", twin)
    step = magis.planned(model, training_step=_loss, optimizer=opt, cache_dir=tmp_path, time_budget=5, progress=False)
    for i in range(4):
        torch.manual_seed(i)
        step(*batch)
        torch.manual_seed(i)
        _eager_step(twin, opt_twin, batch)
        schedule.step()
        schedule_twin.step()
        _assert_same(model, twin, opt, opt_twin)
    assert step.searches == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_large_parameter_is_updated_slice_by_slice_exactly(monkeypatch, dtype: torch.dtype) -> None:
    """An early-updated parameter above PIECE_BYTES is updated in slices: its temporaries hold a
    slice, the step count advances once, and parameters and states stay eager's bit for bit."""
    monkeypatch.setattr(magis.frontend.optimizer, "PIECE_BYTES", 2048)  # the tiny layers count as large
    model, batch = _deep()
    model, batch = model.to(dtype), (batch[0].to(dtype), batch[1])
    twin = copy.deepcopy(model)
    opt, opt_twin = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True) for m in (model, twin))
    plan = magis.optimize(
        model, batch, training_step=_loss, optimizer=opt, memory_limit=0.85, time_budget=10, progress=False
    )
    sliced = [n for n in plan.graph.nodes if isinstance(n.target, ParameterUpdate) and n.target.pieces > 1]
    assert sliced, "no update runs in slices"
    weight = plan.graph[sliced[0].args[2].name].meta
    assert sliced[0].workspace < weight.nbytes  # whole, AdamW's temporaries are twice the weight
    _ten_steps_as_eager(plan, model, twin, opt, opt_twin, batch)
    assert opt.state[model.head.weight]["step"].item() == STEPS
    with LiveTensorMeter(resident=_resident(model, opt, batch)) as meter:
        plan(*batch)
    measured = meter.reading().peak_bytes
    assert abs(measured - plan.peak_bytes) <= 0.02 * plan.peak_bytes, (measured, plan.peak_bytes)


class TwiceUsed(nn.Module):
    """A layer applied twice (weights shared inside a model, as ALBERT's): its weight's gradient
    is the sum of its two uses', two matmuls."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.square = nn.Linear(16, 16, bias=False)
        self.out = nn.Linear(16, 40)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.square(torch.relu(self.square(self.embed(ids))))))


@pytest.mark.parametrize("shared", ["embedding", "twice-used"])
def test_a_shared_weight_is_updated_from_its_two_gradients_slice_by_slice(monkeypatch, shared) -> None:
    """A shared weight's gradient is the sum of its two uses'; its update runs in slices. A tied
    embedding's sum is made in place, its embedding term a slice at a time
    (:mod:`magis.rules.tied_gradient`); any other sum is added by the update a slice at a time
    (the whole sum never exists). Both exactly as eager's step, measured as simulated."""
    monkeypatch.setattr(magis.frontend.optimizer, "PIECE_BYTES", 512 if shared == "twice-used" else 2048)
    model, batch = _workload("tied")
    if shared == "twice-used":
        model = TwiceUsed().double()
    twin = copy.deepcopy(model)
    opt, opt_twin = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, twin))
    plan = magis.optimize(
        model, batch, training_step=_loss, optimizer=opt, memory_limit=0.9, time_budget=10, progress=False
    )
    updates = [n for n in plan.graph.nodes if isinstance(n.target, ParameterUpdate)]
    weight = "embed.weight" if shared == "embedding" else "square.weight"
    (update,) = [n for n in updates if weight in n.target.params]
    assert update.target.pieces > 1
    if shared == "embedding":
        (gradient,) = update.target.gradients(update)
        assert isinstance(plan.graph[gradient].target, EmbeddingGradientInto)
    else:
        assert update.target.summed and update.target.pieces == 8  # SUMMED_PIECES: 3 slices + 2 terms < 3 weights
        assert len(update.target.gradients(update)) == 2
    _ten_steps_as_eager(plan, model, twin, opt, opt_twin, batch)
    with LiveTensorMeter(resident=_resident(model, opt, batch)) as meter:
        plan(*batch)
    measured = meter.reading().peak_bytes
    assert abs(measured - plan.peak_bytes) <= 0.02 * plan.peak_bytes, (measured, plan.peak_bytes)


def _ten_steps_as_eager(plan, model, twin, opt, opt_twin, batch) -> None:
    """Ten steps of ``plan`` beside eager's on ``twin``: losses, parameters and states equal
    (bitwise, or to rounding where the plan sums some gradient in another order)."""
    exact = not _sums_otherwise(plan)
    for _ in range(STEPS):
        loss, loss_twin = plan(*batch), _eager_step(twin, opt_twin, batch).detach()
        torch.testing.assert_close(loss, loss_twin, **({"rtol": 0, "atol": 0} if exact else _rounding(loss)))
        _assert_same(model, twin, opt, opt_twin, exact)


def _rounding(t: torch.Tensor) -> dict[str, float]:
    """How far two sums of the same terms in other orders may differ, by dtype."""
    return {"rtol": 1e-10, "atol": 1e-12} if t.dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
