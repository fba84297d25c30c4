"""A third hunt for silent differences from eager PyTorch: users' own models and loops."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import magis
from magis.frontend.step import CaptureError


def test_a_step_that_changes_its_batch_in_place_is_refused_naming_the_argument() -> None:
    # eager doubles the user's tensor at every call; a plan reads a copy and would leave it as it was
    def training_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return F.cross_entropy(model(x), y)

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    before = x.clone()
    for verify in (True, False):
        with pytest.raises(CaptureError, match="changes argument 0 of the batch in place"):
            magis.optimize(model, (x, y), training_step=training_step, time_budget=1, progress=False, verify=verify)
    assert torch.equal(x, before)  # the trace ran on fake tensors


def test_an_inference_forward_that_changes_its_input_in_place_is_refused() -> None:
    class Scales(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
            extra["mask"].clamp_(0, 1)
            return self.linear(x) * extra["mask"]

    batch = (torch.randn(2, 4), {"mask": torch.randn(2, 4)})
    with pytest.raises(CaptureError, match=r"changes argument 1\['mask'\] of the batch in place"):
        magis.optimize(Scales(), batch, inference=True, time_budget=1, progress=False)


class _UpsamplingDecoder(nn.Module):
    """A decoder's block: a convolution whose bias instance norm cancels (its exact gradient
    is zero: eager's and the plan's are rounding alone), then a bilinear upsampling."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True), nn.ReLU())
        self.out = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.interpolate(self.block(x), scale_factor=2, mode="bilinear")).tanh()


def test_a_gradient_whose_exact_value_is_zero_is_not_a_capture_mismatch() -> None:
    # seed 4 drew eager's bias gradient nearer zero than twice the plan's: refused as a mismatch
    def training_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.l1_loss(model(x), F.interpolate(y, scale_factor=2))

    for seed in range(8):
        torch.manual_seed(seed)
        model = _UpsamplingDecoder()
        x, y = torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16)
        plan = magis.optimize(model, (x, y), training_step=training_step, time_budget=1, max_states=2, progress=False)
        assert plan.report().verified, seed
        eager = copy.deepcopy(model)
        loss = plan(x, y)
        eager_loss = training_step(eager, x, y)
        eager_loss.backward()
        torch.testing.assert_close(loss, eager_loss)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)


class _Float32Attention(nn.Module):
    """Attention whose scores and softmax run in float32 under the caller's autocast, as users
    write it: ``torch.autocast(..., enabled=False)`` around them."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.query(x), self.key(x)
        with torch.autocast("cpu", enabled=False):
            scores = torch.softmax(q.float() @ k.float().transpose(-1, -2) / 8**0.5, -1)
        return self.out((scores.to(q.dtype) @ q).mean(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_region_with_autocast_disabled_inside_the_callers_autocast_is_planned_as_eager_runs_it(dtype) -> None:
    # AOTAutograd traced its joint graph again under the caller's autocast, casting the float32
    # region down: a dtype mismatch from deep in torch (an AssertionError for an inference)
    def training_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    torch.manual_seed(0)
    model = _Float32Attention()
    eager = copy.deepcopy(model)
    x, y = torch.randn(3, 5, 8), torch.randint(0, 4, (3,))
    with torch.autocast("cpu", dtype=dtype):
        plan = magis.optimize(model, (x, y), training_step=training_step, time_budget=1, progress=False)
        loss = plan(x, y)
        eager_loss = training_step(eager, x, y)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):  # a plan's sums round in another order
        torch.testing.assert_close(p.grad, q.grad, rtol=1.6e-2, atol=1e-3, msg=name)

    model.eval()
    with torch.autocast("cpu", dtype=dtype):
        plan = magis.optimize(model, (x,), inference=True, time_budget=1, progress=False)
        output = plan(x)
        with torch.no_grad():
            torch.testing.assert_close(output, model(x))


class _NoisyInput(nn.Module):
    """Input noise drawn from the layer's own generator, a stream apart from torch's default."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.generator = torch.Generator().manual_seed(123)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x + 0.1 * torch.randn(x.shape, generator=self.generator))


def _square_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _planned_noisy_input() -> tuple[_NoisyInput, _NoisyInput, torch.Tensor, magis.Plan]:
    """A model with its own generator, its eager twin, a batch and the model's plan."""
    torch.manual_seed(0)
    model = _NoisyInput()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8)
    return model, eager, x, magis.optimize(model, (x,), training_step=_square_step, time_budget=1, progress=False)


def test_a_models_own_generator_is_left_as_it_was_by_planning_and_drawn_from_as_eager_draws() -> None:
    # tracing and the check drew from it: refused as a mismatch blaming Python state, and with
    # verify=False the user's stream was left ahead of eager's
    model, eager, x, plan = _planned_noisy_input()
    assert torch.equal(model.generator.get_state(), eager.generator.get_state())
    for _ in range(3):
        loss = plan(x)
        eager_loss = _square_step(eager, x)
        eager_loss.backward()
        assert torch.equal(loss, eager_loss)
    assert torch.equal(model.generator.get_state(), eager.generator.get_state())
    torch.testing.assert_close(model.linear.weight.grad, eager.linear.weight.grad)


def test_a_generator_the_model_does_not_hold_is_refused() -> None:
    shared = torch.Generator().manual_seed(5)

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x + torch.randn(x.shape, generator=shared))

    with pytest.raises(CaptureError, match=r"torch\.Generator the model does not hold"):
        magis.optimize(Noisy(), (torch.randn(4, 8),), training_step=_square_step, time_budget=1, progress=False)
    with pytest.raises(CaptureError, match=r"torch\.Generator the model does not hold"):
        magis.optimize(Noisy(), (torch.randn(4, 8),), inference=True, time_budget=1, progress=False)


def test_a_loaded_plan_draws_from_the_models_own_generator_not_a_copy_saved_with_the_plan(tmp_path) -> None:
    # the plan file pickled the generator: a loaded plan drew from a stale copy of the stream
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    path = magis.optimize(_NoisyInput(), (x,), inference=True, time_budget=1, progress=False).save(tmp_path / "p")
    model = _NoisyInput()
    model.generator.manual_seed(77)
    eager = copy.deepcopy(model)
    plan = magis.load_plan(path, model)
    for _ in range(2):
        output = plan(x)
        with torch.no_grad():
            torch.testing.assert_close(output, eager(x))
        assert torch.equal(model.generator.get_state(), eager.generator.get_state())

    class Plain(nn.Module):  # the same weights, no generator
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x)

    with pytest.raises(ValueError, match="draws from the generator 'generator', which this model does not hold"):
        magis.load_plan(path, Plain())


def test_a_generator_replaced_after_planning_is_refused_and_one_reseeded_in_place_is_followed() -> None:
    # the plan drew from the replaced generator's stream: loss 0.79 where eager's was 0.90
    model, eager, x, plan = _planned_noisy_input()
    for m in (model, eager):
        m.generator.manual_seed(9)
    torch.testing.assert_close(plan(x), _square_step(eager, x))
    replaced = model.generator
    model.generator = torch.Generator().manual_seed(5)
    with pytest.raises(ValueError, match=r"draws from a torch\.Generator the model no longer holds"):
        plan(x)
    model.generator = replaced
    plan(x)


def _classify(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _classifier_and_twin() -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, copy.deepcopy(model), torch.randn(6, 8), torch.randint(0, 4, (6,))


@pytest.mark.parametrize(
    "device, dtype",
    [
        ("cpu", torch.bfloat16),
        pytest.param("cuda", torch.float16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
    ],
)
def test_a_grad_scaler_given_as_it_is_steps_the_plan_as_it_steps_eager(device: str, dtype: torch.dtype) -> None:
    # docs/usage.md said grad_scale=scaler.get_scale(): a number, which leaves the scaler's scale
    # tensor unmade, and the first scaler.step(optimizer) failed ("_scale is None")
    model, eager, x, y = (t.to(device) for t in _classifier_and_twin())
    with torch.autocast(device, dtype=dtype):
        plan = magis.optimize(model, (x, y), training_step=_classify, time_budget=1, progress=False)
    optimizers = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, eager)]
    scalers = [torch.amp.GradScaler(device, init_scale=2.0**10) for _ in range(2)]
    for _ in range(3):
        with torch.autocast(device, dtype=dtype):
            loss = plan(x, y, grad_scale=scalers[0])
            eager_loss = _classify(eager, x, y)
        scalers[1].scale(eager_loss).backward()
        torch.testing.assert_close(loss, eager_loss.detach())
        for scaler, optimizer in zip(scalers, optimizers):
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert scalers[0].get_scale() == scalers[1].get_scale()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_a_planned_step_takes_a_grad_scaler_as_a_plan_does(tmp_path) -> None:
    # step(x, y, grad_scale=scaler) was a TypeError: the planned step took the batch alone
    model, eager, x, y = _classifier_and_twin()
    step = magis.planned(model, training_step=_classify, time_budget=1, progress=False, cache_dir=tmp_path)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    loss = step(x, y, grad_scale=scalers[0])
    eager_loss = _classify(eager, x, y)
    scalers[1].scale(eager_loss).backward()
    torch.testing.assert_close(loss, eager_loss.detach())
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_hook_the_step_puts_on_a_tensor_is_warned_of_as_a_modules_hook_is() -> None:
    # the gradient a hook recorded was recorded once, in the trace, and never at a call: silently
    recorded: list[torch.Tensor] = []

    class Recording(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            h.register_hook(recorded.append)
            return self.b(h)

    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="calls register_hook on a tensor it computes"):
        magis.optimize(Recording(), (x,), training_step=_square_step, time_budget=1, progress=False)


def test_a_step_that_keeps_a_tensor_in_a_plain_attribute_is_refused_and_the_attribute_put_back() -> None:
    # eager's model.attention held each call's weights; the plan's kept a tensor left by the trace
    class KeepsAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)
            self.attention = torch.zeros(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weights = torch.softmax(self.a(x), -1)
            self.attention = weights.detach()
            return self.b(weights)

    model = KeepsAttention()
    before = model.attention
    x = torch.randn(4, 8)
    with pytest.raises(CaptureError, match="sets the model's attribute 'attention' to a tensor"):
        magis.optimize(model, (x,), training_step=_square_step, time_budget=1, progress=False)
    assert model.attention is before
    with pytest.raises(CaptureError, match="sets the model's attribute 'attention' to a tensor"):
        magis.optimize(model.eval(), (x,), inference=True, time_budget=1, progress=False)
    assert model.attention is before


@pytest.mark.parametrize("gradients_off", [torch.no_grad, torch.inference_mode])
def test_a_training_step_with_gradients_off_is_refused_and_trains_nothing(gradients_off) -> None:
    """An evaluation loop under ``torch.no_grad()`` that calls the training plan: eager's
    ``loss.backward()`` raises there; the plan computed its gradients itself and, with the
    optimizer inside, updated the weights in the middle of an evaluation."""

    def training_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"training_step": training_step, "latency_limit": 1.5, "time_budget": 1, "progress": False}
    plan = magis.optimize(model, (x, y), optimizer=optimizer, **options)
    planned = magis.planned(model, optimizer=optimizer, **options)
    weights = copy.deepcopy(model.state_dict())
    with gradients_off():
        with pytest.raises(RuntimeError, match=r"gradients are off here \(torch.no_grad\(\) or"):
            plan(x, y)
        with pytest.raises(RuntimeError, match="gradients are off here"):
            planned(x, y)  # before its first capture
        with pytest.raises(RuntimeError, match="gradients are off here"):
            magis.optimize(model, (x, y), **options)
        evaluation = magis.optimize(model, (x,), inference=True, time_budget=1, progress=False)
        assert torch.equal(evaluation(x), model(x))  # an inference plan is what runs there
    assert all(torch.equal(weights[name], value) for name, value in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        expected = training_step(model, x, y)
    assert float(plan(x, y)) == pytest.approx(float(expected), rel=1e-6)  # with gradients on, it trains
    assert all(p.grad is None for p in model.parameters())  # the optimizer inside took its step and cleared them


def test_an_optimizer_that_needs_a_closure_is_refused_and_steps_a_plan_as_its_closure_like_eager() -> None:
    """L-BFGS evaluates the loss several times per update (its line search calls a closure):
    inside a plan, which runs one forward and backward per update, it failed with L-BFGS's own
    TypeError. It is refused naming the closure, and the way the message gives works."""

    def training_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3)).double()
    twin = copy.deepcopy(model)
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.randint(0, 3, (6,))
    options = {"training_step": training_step, "latency_limit": 1.5, "time_budget": 1, "progress": False}
    with pytest.raises(ValueError, match=r"LBFGS\.step needs a closure"):
        magis.optimize(model, (x, y), optimizer=torch.optim.LBFGS(model.parameters()), **options)
    plan = magis.optimize(model, (x, y), **options)
    optimizer, eager = (
        torch.optim.LBFGS(model.parameters(), max_iter=4),
        torch.optim.LBFGS(twin.parameters(), max_iter=4),
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        return plan(x, y)

    def eager_closure() -> torch.Tensor:
        eager.zero_grad()
        loss = training_step(twin, x, y)
        loss.backward()
        return loss

    for _ in range(3):
        assert float(optimizer.step(closure)) == pytest.approx(float(eager.step(eager_closure)), rel=1e-12)
    for ours, theirs in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


class _Centred(nn.Module):
    """A layer that makes a tensor without a dtype: torch's default dtype, traced as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) - torch.full((x.shape[0], 3), 0.1)


def test_a_step_called_under_another_default_dtype_is_refused_and_planned_again_by_planned() -> None:
    """Eager's ``torch.full`` follows ``torch.set_default_dtype`` at each call (here the loss
    becomes float64); the plan had traced the dtype of its call to optimize."""

    def training_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    torch.manual_seed(0)
    model = _Centred()
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    options = {"training_step": training_step, "latency_limit": 1.5, "time_budget": 1, "progress": False}
    plan = magis.optimize(model, (x, y), **options)
    planned = magis.planned(model, **options)
    planned(x, y)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(
            ValueError, match=r"default dtype is torch\.float64; the plan was made under torch\.float32"
        ):
            plan(x, y)
        model.zero_grad()
        loss = planned(x, y)  # another plan, made under this default
        gradients = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        expected = training_step(model, x, y)
        expected.backward()
    finally:
        torch.set_default_dtype(before)
    assert loss.dtype == expected.dtype == torch.float64 and planned.searches == 2
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
    for got, p in zip(gradients, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-12, atol=1e-15)


def test_a_submodule_or_a_step_the_user_compiled_is_planned_as_its_python_and_trains_like_eager() -> None:
    """``model.block = torch.compile(block)``, or ``training_step=torch.compile(step)``: Inductor
    ran inside the capture's trace and failed (``BackendCompilerFailed``, nothing named). The
    trace now runs compiled code as written; the plan runs its own graph."""

    def training_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    torch.manual_seed(0)
    twin = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 3)).double()
    model = copy.deepcopy(twin)
    model[0] = torch.compile(model[0])
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.randint(0, 3, (6,))
    optimizer, eager = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, twin))
    plan = magis.optimize(
        model, (x, y), training_step=torch.compile(training_step), latency_limit=1.5, time_budget=1, progress=False
    )
    for _ in range(3):
        loss = plan(x, y)
        optimizer.step()
        optimizer.zero_grad()
        expected = training_step(twin, x, y)
        expected.backward()
        eager.step()
        eager.zero_grad()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
    for ours, theirs in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
