"""The user's own step (docs/design.md, "The user's side of the contract"): their batch as the
DataLoader yields it, their loss or training step, their modes, autocast and GradScaler, their
optimizer. Plans train exactly like eager PyTorch, and anything else is refused before it runs."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import magis
from magis.backend import verify
from magis.backend.meter import peak_meter
from magis.frontend.step import UserStep
from magis.ir.graph import Role

SEARCH = {"device": "h200", "max_states": 8, "time_budget": 10.0, "progress": False}


def adamw(step, model: nn.Module, batches: list, seed: int = 5) -> list[float]:
    """AdamW steps; ``step(batch)`` returns the loss and leaves the gradients in ``.grad``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(seed)
    losses = []
    for batch in batches:
        losses.append(float(step(batch)))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def eager(model: nn.Module, training_step=None):
    """The step as the user writes it without magis: loss, backward."""

    def step(batch):
        if training_step is not None:
            loss = training_step(model, *batch)
        else:
            loss = model(**batch).loss if isinstance(batch, dict) else model(*batch)
        loss.backward()
        return loss.detach()

    return step


def planned(plan: magis.Plan):
    return lambda batch: plan(batch) if isinstance(batch, dict) else plan(*batch)


def assert_same_state(a: nn.Module, b: nn.Module, rtol: float = 1e-10) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.allclose(x, y, rtol=rtol, atol=1e-12), name


def assert_within_limit(plan: magis.Plan, model: nn.Module, batch) -> None:
    """The plan's measured peak, as ``torch.cuda.max_memory_allocated`` would see it around the
    user's call, stays within its limit (the memory limit, else its simulated peak) + 2%."""
    inputs = [x for x in (batch.values() if isinstance(batch, dict) else batch) if isinstance(x, torch.Tensor)]
    constants = [n.target.value for n in plan.graph.nodes if n.role is Role.CONSTANT]
    limit = plan.objective.memory_bytes or plan.peak_bytes
    with peak_meter(model, [*inputs, *constants]) as meter:
        planned(plan)(batch)
    model.zero_grad()
    assert meter.peak_bytes <= 1.02 * limit, (meter.peak_bytes, limit)


def cross_entropy_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


class Classifier(nn.Module):
    """Logits, not a loss: the labels reach the loss only through the user's training step."""

    def __init__(self, d: int = 32, h: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, classes)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.drop(torch.relu(self.b(torch.tanh(self.a(x))))))


def classification_batches(n: int, rows: int = 256, dtype: torch.dtype = torch.float64) -> list[tuple]:
    return [(torch.randn(rows, 32, dtype=dtype), torch.randint(0, 10, (rows,))) for _ in range(n)]


def test_labels_reach_the_loss_through_the_users_training_step():
    torch.manual_seed(0)
    model = Classifier().double()
    twin = copy.deepcopy(model)
    batches = classification_batches(10)
    plan = magis.optimize(model, batches[0], training_step=cross_entropy_step, memory_limit=0.7, **SEARCH)
    assert plan.report().verified and plan.peak_bytes <= 0.7 * plan.baseline_peak_bytes
    expected = adamw(eager(twin, cross_entropy_step), twin, batches)
    assert adamw(planned(plan), model, batches) == pytest.approx(expected, rel=1e-12)
    assert_same_state(model, twin)
    assert_within_limit(plan, model, batches[0])


def logits_and_accuracy_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """A step that returns what a training loop logs beside the loss (the loss not first)."""
    logits = model(x)
    return {"logits": logits, "loss": F.cross_entropy(logits, y), "correct": logits.argmax(-1) == y}


@pytest.mark.parametrize("in_plan", [False, True], ids=["optimizer after", "optimizer in the plan"])
def test_a_step_that_returns_its_logits_and_a_metric_gets_them_back_as_eager_computes_them(in_plan):
    """What the plan returns is what the user's step returns, the other tensors detached and
    held to the end of the step (counted in its peak), at a limit the plan meets by fission."""
    torch.manual_seed(0)
    model = Classifier().double()
    twin = copy.deepcopy(model)
    batches = classification_batches(3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plan = magis.optimize(
        model,
        batches[0],
        training_step=logits_and_accuracy_step,
        memory_limit=0.8,
        optimizer=optimizer if in_plan else None,
        **SEARCH,
    )
    assert plan.report().verified and plan.graph.signature.results and plan.report().transformations["fission"]
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for i, batch in enumerate(batches):
        torch.manual_seed(i)
        returned = plan(*batch)
        if not in_plan:
            optimizer.step()
            optimizer.zero_grad()
        torch.manual_seed(i)
        expected = logits_and_accuracy_step(twin, *batch)
        expected["loss"].backward()
        twin_optimizer.step()
        twin_optimizer.zero_grad()
        assert list(returned) == ["logits", "loss", "correct"]
        assert not any(t.requires_grad for t in returned.values())
        assert torch.allclose(returned["logits"], expected["logits"], rtol=1e-12, atol=1e-14)
        assert torch.equal(returned["correct"], expected["correct"])
        assert float(returned["loss"]) == pytest.approx(float(expected["loss"].detach()), rel=1e-12)
    assert_same_state(model, twin)
    if not in_plan:
        assert_within_limit(plan, model, batches[0])


def test_a_step_that_returns_what_a_plan_cannot_is_refused_naming_it():
    model, (x, y) = Classifier().double(), classification_batches(1)[0]
    with pytest.raises(magis.CaptureError, match="returned a float beside its loss"):
        magis.optimize(model, (x, y), training_step=lambda m, x, y: (F.cross_entropy(m(x), y), 0.5), **SEARCH)
    with pytest.raises(magis.CaptureError, match="a mapping with a 'loss' key"):
        magis.optimize(model, (x, y), training_step=lambda m, x, y: {"nll": F.cross_entropy(m(x), y)}, **SEARCH)


def test_a_model_wrapped_for_data_parallelism_is_refused_naming_the_wrapper():
    """DataParallel and DistributedDataParallel split or average the step inside their own
    forward and backward, where a plan does not reach (a DDP model failed in capture with an
    op 'returns a non-tensor value (ScriptObject)')."""
    model, (x, y) = Classifier().double(), classification_batches(1)[0]
    with pytest.raises(magis.CaptureError, match=r"wrapped in DataParallel.*plan the module it wraps"):
        magis.optimize(nn.DataParallel(model), (x, y), training_step=cross_entropy_step, **SEARCH)


transformers = pytest.importorskip("transformers")


def causal_lm() -> nn.Module:
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double().train()  # dropout 0.1 everywhere


def test_a_causal_lm_trains_on_a_dict_batch_with_labels_and_no_wrapper():
    """What a collator yields: a dict with ``labels``; ``ids[:, :-1]`` is not contiguous."""
    model = causal_lm()
    twin = copy.deepcopy(model)
    ids = [torch.randint(0, 64, (4, 17)) for _ in range(10)]
    batches = [{"input_ids": i[:, :-1], "labels": i[:, 1:]} for i in ids]
    assert not batches[0]["input_ids"].is_contiguous()
    plan = magis.optimize(model, batches[0], **SEARCH)
    assert plan.report().verified
    expected = adamw(eager(twin), twin, batches)
    assert adamw(planned(plan), model, batches) == pytest.approx(expected, rel=1e-12)
    assert_same_state(model, twin)
    assert_within_limit(plan, model, {k: v.contiguous() for k, v in batches[0].items()})
    with pytest.raises(
        ValueError, match=r"batch\['input_ids'\] has shape \(4, 8\); the plan was made for shape \(4, 16\)"
    ):
        plan({"input_ids": ids[0][:, :8], "labels": ids[0][:, 1:9]})


def test_an_encoder_decoder_with_one_embedding_tied_three_ways_trains_like_eager():
    """T5 shares one embedding between its encoder, its decoder and its head: the tied-gradient
    rule sums two terms into the head's (planning any T5 failed before)."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        d_model=32, d_ff=64, d_kv=8, num_layers=1, num_heads=2, vocab_size=200, decoder_start_token_id=0, pad_token_id=0
    )
    model = transformers.T5ForConditionalGeneration(config).double()
    twin = copy.deepcopy(model)
    batches = [
        {"input_ids": torch.randint(1, 200, (4, 12)), "labels": torch.randint(1, 200, (4, 10))} for _ in range(3)
    ]
    plan = magis.optimize(model, batches[0], **SEARCH)
    assert plan.report().verified
    expected = adamw(eager(twin), twin, batches)
    assert adamw(planned(plan), model, batches) == pytest.approx(expected, rel=1e-12)
    assert_same_state(model, twin)


def test_an_encoder_classifier_trains_on_a_dict_batch_with_a_padding_mask():
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=64, num_labels=3
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).double().train()
    twin = copy.deepcopy(model)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[2:, 9:] = 0  # padded
    batches = [
        {"input_ids": torch.randint(0, 64, (4, 12)), "attention_mask": mask, "labels": torch.randint(0, 3, (4,))}
        for _ in range(10)
    ]
    plan = magis.optimize(model, batches[0], **SEARCH)
    assert plan.report().verified
    expected = adamw(eager(twin), twin, batches)
    assert adamw(planned(plan), model, batches) == pytest.approx(expected, rel=1e-12)
    assert_same_state(model, twin)
    assert_within_limit(plan, model, batches[0])


class Adapted(nn.Module):
    """A frozen base with small trainable low-rank adapters (LoRA's pattern)."""

    def __init__(self, d: int = 64, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.down = nn.ModuleList(nn.Linear(d, rank, bias=False) for _ in range(3))
        self.up = nn.ModuleList(nn.Linear(rank, d, bias=False) for _ in range(3))
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for base, down, up in zip(self.base, self.down, self.up):
            x = torch.tanh(base(x) + up(down(x)))
        return x


def test_a_frozen_base_with_adapters_trains_only_the_adapters_like_eager():
    torch.manual_seed(0)
    model = Adapted().double()
    twin = copy.deepcopy(model)
    frozen = copy.deepcopy(model.base.state_dict())
    batches = [
        (torch.randn(128, 64, dtype=torch.float64), torch.randn(128, 64, dtype=torch.float64)) for _ in range(10)
    ]

    def step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), target)

    plan = magis.optimize(model, batches[0], training_step=step, memory_limit=0.9, **SEARCH)
    assert set(plan.graph.signature.gradients) == {n for n, p in model.named_parameters() if p.requires_grad}
    expected = adamw(eager(twin, step), twin, batches)
    assert adamw(planned(plan), model, batches) == pytest.approx(expected, rel=1e-12)
    assert_same_state(model, twin)
    assert all(torch.equal(v, frozen[k]) for k, v in model.base.state_dict().items())
    assert_within_limit(plan, model, batches[0])


class BatchNormCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(self.drop(x.mean((2, 3))))


def test_a_batch_norm_cnn_trains_like_eager_and_keeps_its_running_statistics():
    torch.manual_seed(0)
    model = BatchNormCNN().double()
    twin = copy.deepcopy(model)
    batches = [(torch.randn(8, 3, 16, 16, dtype=torch.float64), torch.randint(0, 5, (8,))) for _ in range(10)]
    plan = magis.optimize(model, batches[0], training_step=cross_entropy_step, **SEARCH)
    assert torch.equal(model.bn1.running_mean, twin.bn1.running_mean)  # the check left them as they were
    expected = adamw(eager(twin, cross_entropy_step), twin, batches)
    assert adamw(planned(plan), model, batches) == pytest.approx(expected, rel=1e-12)
    assert_same_state(model, twin)  # the running statistics and num_batches_tracked included
    assert int(model.bn1.num_batches_tracked) == 10
    assert_within_limit(plan, model, batches[0])


def test_a_mode_flip_is_refused_and_an_eval_mode_model_is_warned_about():
    torch.manual_seed(0)
    model = Classifier()
    x, y = classification_batches(1, rows=16, dtype=torch.float32)[0]
    plan = magis.optimize(model, (x, y), training_step=cross_entropy_step, **SEARCH)
    model.drop.eval()
    with pytest.raises(ValueError, match="submodule 'drop' is in eval mode; the plan was made with it in training"):
        plan(x, y)
    model.train()
    plan(x, y)
    model.eval()
    with pytest.warns(UserWarning, match="eval mode: dropout and batch norm are captured as in evaluation"):
        evaluating = magis.optimize(model, (x, y), training_step=cross_entropy_step, **SEARCH)
    model.train()
    with pytest.raises(ValueError, match="the model is in training mode; the plan was made with it in eval"):
        evaluating(x, y)


def test_bf16_autocast_with_dropout_gives_eagers_loss_and_other_autocast_is_refused():
    """A plan that fissions a bf16 dropout step: CPU's dropout scales by the bf16-rounded
    scale, and a rewrite that applies the mask otherwise put the loss 1% off eager's."""
    torch.manual_seed(0)
    model = Classifier(h=256)
    twin = copy.deepcopy(model)
    batches = classification_batches(3, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = magis.optimize(model, batches[0], training_step=cross_entropy_step, memory_limit=0.8, **SEARCH)
        assert plan.report().verified and "bfloat16" in plan.report().verification
        for x, y in batches:
            torch.manual_seed(7)
            loss = plan(x, y)
            torch.manual_seed(7)
            expected = cross_entropy_step(twin, x, y)
            expected.backward()
            assert float(loss) == pytest.approx(float(expected), rel=2**-8)
            for (name, p), q in zip(model.named_parameters(), twin.parameters()):
                assert (p.grad - q.grad).abs().max() <= 5e-2 * q.grad.abs().max(), name
            model.zero_grad()
            twin.zero_grad()
    with pytest.raises(ValueError, match="autocast"):
        plan(*batches[0])
    fp32 = magis.optimize(model, batches[0], training_step=cross_entropy_step, **SEARCH)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="autocast off on cpu"):
        fp32(*batches[0])


def bf16_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.float(), y)


def test_autocast_inside_the_users_step_is_checked_in_bfloat16_and_trains_like_eager():
    """A float32 model whose step enters bf16 autocast itself: the check judges it at bf16's
    tolerance (the graph computes in bf16), not float32's, which refused it over a convolution
    bias before batch norm (its exact gradient is zero, bf16 rounding is all it holds)."""
    torch.manual_seed(0)
    model = BatchNormCNN()
    twin = copy.deepcopy(model)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 5, (16,))
    plan = magis.optimize(model, (x, y), training_step=bf16_step, memory_limit=0.8, **SEARCH)
    assert plan.report().verified and "bfloat16" in plan.report().verification
    optimizer, twin_optimizer = (torch.optim.RMSprop(m.parameters(), lr=1e-3) for m in (model, twin))
    for seed in range(3):
        torch.manual_seed(seed)
        loss = plan(x, y)
        torch.manual_seed(seed)
        expected = bf16_step(twin, x, y)
        expected.backward()
        assert float(loss) == pytest.approx(float(expected), rel=2**-7)
        largest = max(q.grad.abs().max() for q in twin.parameters())
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert (p.grad - q.grad).abs().max() <= 5e-2 * largest, name
        for opt in (optimizer, twin_optimizer):
            opt.step()
            opt.zero_grad()


def test_a_difference_eager_makes_too_against_float64_passes_and_a_wrong_gradient_does_not(monkeypatch):
    """Where the graph differs from eager beyond the tolerance, both are set beside the step in
    float64: a gradient rounded otherwise (on the other side of the exact value, 1.5 times as
    far from it as eager's) passes; a gradient 20% off does not."""
    torch.manual_seed(0)
    model = BatchNormCNN()
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 5, (16,))
    graph = magis.capture(model, (x, y), training_step=bf16_step)
    wide = copy.deepcopy(model).double()
    torch.manual_seed(0)
    bf16_step(wide, x.double(), y).backward()
    exact = {name: p.grad.float() for name, p in wide.named_parameters()}
    run_both = verify.run_both

    def changed(name: str, change):
        def run(*args, **kwargs):
            both = run_both(*args, **kwargs)
            both.result.gradients[name] = change(both.reference.gradients[name], exact[name])
            return both

        return run

    torch.manual_seed(0)
    bf16_step(model, x, y).backward()
    weight = model.conv2.weight.grad
    model.zero_grad()
    assert (weight - exact["conv2.weight"]).abs().max() > 0.05 / 2.5 * weight.abs().max()  # the check must look further
    monkeypatch.setattr(verify, "run_both", changed("conv2.weight", lambda got, exact: exact - 1.5 * (got - exact)))
    passed = verify.verify_capture(graph, model, (x, y), UserStep(training_step=bf16_step))
    assert passed.verified and "float64" in passed.note
    monkeypatch.setattr(verify, "run_both", changed("bn1.weight", lambda got, exact: 1.2 * got))
    with pytest.raises(magis.CaptureMismatch, match=r"bn1\.weight"):
        verify.verify_capture(graph, model, (x, y), UserStep(training_step=bf16_step))


def test_a_nan_the_graph_makes_and_eager_does_not_is_refused(monkeypatch):
    """A NaN difference is the largest of all, wherever it is met (``max(0.0, nan)`` is 0.0:
    a NaN gradient met after a finite loss had passed the check)."""
    torch.manual_seed(0)
    model = BatchNormCNN()
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 5, (16,))
    graph = magis.capture(model, (x, y), training_step=cross_entropy_step)
    run_both = verify.run_both

    def with_nan(name: str):
        def run(*args, **kwargs):
            both = run_both(*args, **kwargs)
            if name == "loss":
                both.result.loss = torch.full_like(both.result.loss, float("nan"))
            else:
                both.result.gradients[name] = (
                    both.result.gradients[name]
                    .clone()
                    .view(-1)
                    .index_fill(0, torch.tensor([1]), float("nan"))
                    .view_as(both.result.gradients[name])
                )
            return both

        return run

    for name in ("fc.weight", "loss"):
        monkeypatch.setattr(verify, "run_both", with_nan(name))
        with pytest.raises(magis.CaptureMismatch, match="nan"):
            verify.verify_capture(graph, model, (x, y), UserStep(training_step=cross_entropy_step))


class NotFinite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.a(x) - 100).mean()  # the log of a negative number: NaN


def test_a_step_whose_eager_loss_is_nan_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(magis.api, "m_optimize", _no_search)
    with pytest.raises(magis.CaptureError, match="eager PyTorch's own loss is not finite"):
        magis.optimize(NotFinite(), (torch.randn(4, 8),), **SEARCH)


def test_a_grad_scaler_steps_a_plan_as_it_steps_eager():
    """``plan(*batch, grad_scale=s)`` seeds the backward with ``s``: ``.grad`` holds the scaled
    gradients, the loss returned is unscaled, and ``scaler.step``/``update`` work unchanged."""
    torch.manual_seed(0)
    model = Classifier()
    twin = copy.deepcopy(model)
    batches = classification_batches(4, rows=64, dtype=torch.float32)
    plan = magis.optimize(model, batches[0], training_step=cross_entropy_step, **SEARCH)
    unscaled = copy.deepcopy(model)
    torch.manual_seed(3)
    cross_entropy_step(unscaled, *batches[0]).backward()

    def train(model: nn.Module, step) -> list[tuple[float, list[torch.Tensor]]]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        torch.manual_seed(3)
        seen = []
        for batch in batches:
            loss = step(scaler, batch)
            seen.append((float(loss), [p.grad.clone() for p in model.parameters()]))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        return seen

    def eager_step(scaler, batch):
        loss = cross_entropy_step(twin, *batch)
        scaler.scale(loss).backward()
        return loss.detach()

    def plan_step(scaler, batch):
        return plan(*batch, grad_scale=scaler.scale(torch.ones(())))

    expected, got = train(twin, eager_step), train(model, plan_step)
    for (loss, grads), (eager_loss, eager_grads) in zip(got, expected):
        assert loss == eager_loss
        assert all(torch.equal(g, e) for g, e in zip(grads, eager_grads))
    first = next(unscaled.parameters()).grad
    torch.testing.assert_close(expected[0][1][0], first * 2.0**12)  # scaled, not the plain gradient
    assert_same_state(model, twin, rtol=0)
    assert float(plan.grad_seed) == 1.0  # back to an unscaled step


class HiddenDropout(nn.Module):
    """A random op tracing never sees: the graph lacks the dropout eager draws."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if not torch.compiler.is_compiling():
            h = F.dropout(h, 0.5, self.training)
        return h.square().mean()


class CountingModel(nn.Module):
    """A forward that reads Python state outside the model changing from call to call (state in
    the model's own attributes is refused as the capture changes it): the capture froze one value."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.calls = itertools.count(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a(x) * next(self.calls)).square().mean()


def test_a_capture_that_differs_from_eager_is_refused_before_any_search(monkeypatch):
    monkeypatch.setattr(magis.api, "m_optimize", _no_search)
    x = torch.randn(4, 8)
    with pytest.raises(magis.CaptureMismatch, match=r"random numbers \(dropout\) that the captured graph lacks"):
        magis.optimize(HiddenDropout(), (x,), **SEARCH)
    with pytest.raises(
        magis.CaptureMismatch, match=r"largest gradient difference is at a\.(weight|bias).*Python state"
    ):
        magis.optimize(CountingModel(), (x,), **SEARCH)
    assert issubclass(magis.CaptureMismatch, magis.CaptureError)
    monkeypatch.undo()
    plan = magis.optimize(CountingModel(), (x,), verify=False, **SEARCH)
    report = plan.report().to_dict()
    assert report["verified"] is False and "verify=False" in report["verification"]


def test_the_check_leaves_the_model_its_gradients_and_the_generator_as_they_were():
    torch.manual_seed(0)
    model = BatchNormCNN()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    model.fc.weight.grad = torch.ones_like(model.fc.weight)
    state = copy.deepcopy(model.state_dict())
    torch.manual_seed(11)
    magis.optimize(model, (x, y), training_step=cross_entropy_step, **SEARCH)
    after = torch.rand(3)
    torch.manual_seed(11)
    assert torch.equal(after, torch.rand(3))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(model.fc.weight.grad, torch.ones_like(model.fc.weight))


def test_the_check_runs_on_the_first_samples_where_the_whole_step_would_not_fit(monkeypatch):
    torch.manual_seed(0)
    model = Classifier()
    x, y = classification_batches(1, rows=8, dtype=torch.float32)[0]
    step = UserStep(training_step=cross_entropy_step)
    graph = magis.capture(model, (x, y), training_step=cross_entropy_step)
    monkeypatch.setattr(verify, "free_device_bytes", lambda _model: 1000)
    checked = verify.verify_step(graph, 1000, model, (x, y), step)
    assert checked.verified and checked.note.startswith("on the first 4 of 8 samples")
    assert not verify.verify_step(graph, 10**6, model, (x, y), step).verified  # not one sample fits
    with pytest.raises(magis.CaptureMismatch):
        counting = CountingModel()
        verify.verify_step(magis.capture(counting, (x[:, :8],)), 1000, counting, (x[:, :8],), UserStep())


def test_bad_input_is_refused_before_any_search(monkeypatch):
    monkeypatch.setattr(magis.api, "m_optimize", _no_search)
    torch.manual_seed(0)
    model = Classifier()
    x, y = classification_batches(1, rows=8, dtype=torch.float32)[0]
    with pytest.raises(ValueError, match=r"tuple or list .* a mapping .* or one tensor, not set"):
        magis.optimize(model, {x}, **SEARCH)
    with pytest.raises(ValueError, match="loss_fn or training_step, not both"):
        magis.optimize(model, (x, y), lambda out: out.sum(), training_step=cross_entropy_step, **SEARCH)
    with pytest.raises(
        magis.CaptureError, match=r"training_step must return a scalar loss tensor, got a tensor of shape \(8, 10\)"
    ):
        magis.optimize(model, (x, y), training_step=lambda m, x, y: m(x), **SEARCH)
    with pytest.raises(magis.CaptureError, match="shape \\(8, 10\\), not a scalar loss: pass loss_fn"):
        magis.optimize(model, (x,), **SEARCH)
    with pytest.raises(magis.CaptureError, match=r"closing over the labels.*pass them in the batch"):
        magis.optimize(model, (x,), lambda out: F.cross_entropy(out, y), **SEARCH)


def test_a_compiled_model_is_planned_as_the_module_it_wraps():
    torch.manual_seed(0)
    model = Classifier().double()
    twin = copy.deepcopy(model)
    batches = classification_batches(3, rows=16)
    plan = magis.optimize(torch.compile(model), batches[0], training_step=cross_entropy_step, **SEARCH)
    assert plan.model is model
    expected = adamw(eager(twin, cross_entropy_step), twin, batches)
    assert adamw(planned(plan), model, batches) == pytest.approx(expected, rel=1e-12)


def test_a_call_that_differs_from_the_example_is_refused_before_anything_runs(monkeypatch):
    class Keywords(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, scale: float, pair: tuple) -> torch.Tensor:
            return (self.a(x) * scale + pair[0]).square().mean()

    model = Keywords()
    x = torch.randn(4, 8)
    batch = {"x": x, "scale": 2.0, "pair": (torch.ones(8), None)}
    plan = magis.optimize(model, batch, **SEARCH)
    monkeypatch.setattr(magis.plan, "run_program", _no_search)
    for call, words in [
        (
            ({**batch, "x": torch.randn(5, 8)},),
            r"batch\['x'\] has shape \(5, 8\); the plan was made for shape \(4, 8\)",
        ),
        (({**batch, "x": x.double()},), r"batch\['x'\] has dtype torch.float64"),
        (({**batch, "scale": 3.0},), r"batch\['scale'\] is 3.0; the plan was made for 2.0"),
        (({**batch, "pair": (torch.ones(3), None)},), r"batch\['pair'\]\[0\] has shape \(3,\)"),
        (({"x": x, "scale": 2.0},), "another structure .* keys"),
        ((x, 2.0, (torch.ones(8), None)), "a batch of a mapping .* call plan\\(batch\\)"),
    ]:
        with pytest.raises(ValueError, match=words):
            plan(*call)


def test_a_single_tensor_batch_and_a_model_on_fake_tensors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    x = torch.randn(4, 8).t().contiguous().t()  # column-major: not contiguous
    plan = magis.optimize(model, x, lambda out: out.square().mean(), **SEARCH)
    twin = copy.deepcopy(model)
    assert plan(x) == twin(x).square().mean()
    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        fake, fake_x = nn.Linear(8, 8), torch.randn(4, 8)
    report = magis.optimize(fake, (fake_x,), lambda out: out.square().mean(), **SEARCH).report()
    assert report.verified is False and "fake or meta" in report.verification


def _no_search(*args, **kwargs):
    raise AssertionError("reached the search or the runtime")


def test_a_parameter_set_anew_between_calls_gets_the_next_calls_gradient():
    """The plan finds the parameters it hands gradients to at each call: one replaced since
    (``load_state_dict(..., assign=True)``, a checkpoint loaded in place) gets the gradient,
    eager's, and the replaced one keeps what it had."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    twin = copy.deepcopy(model)
    x = torch.randn(4, 8)
    plan = magis.optimize(model, (x,), lambda out: out.pow(2).mean(), time_budget=1, progress=False)
    plan(x)
    replaced, first = model[0].weight, model[0].weight.grad.clone()
    model.load_state_dict({k: v * 2 for k, v in model.state_dict().items()}, assign=True)
    twin.load_state_dict(model.state_dict())
    plan(x)
    twin(x).pow(2).mean().backward()
    assert model[0].weight is not replaced and torch.equal(replaced.grad, first)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
