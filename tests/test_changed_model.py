"""A model changed after planning (docs/design.md, "The user's side of the contract"): a layer
frozen or replaced, a dropout rate or another setting changed, a hook added. A trace records
what the model's Python did, so the plan would train the old step: each change is refused,
naming it, before anything runs; undone, the plan trains as eager does, and ``magis.planned``
plans the changed model again by itself."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import magis

SEARCH = {"device": "h200", "max_states": 8, "time_budget": 10.0, "progress": False}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)
        self.act, self.drop = nn.ReLU(), nn.Dropout(0.1)
        # settings in a config object and the config it holds, as transformers keeps them
        self.config = SimpleNamespace(scale=1.0, text=SimpleNamespace(width=64))
        self.widths, self.squash = [16, 64], torch.relu  # settings that are not numbers
        self._temperature, self._shift = 1.0, [0.0]  # private settings: read as public ones are

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.c(self.drop(self.act(self.b(self.act(self.a(x))))))
        return logits * self.config.scale / self._temperature + self._shift[0]


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(64, 16, dtype=torch.float64), torch.randint(0, 4, (64,))


def eager_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    twin = copy.deepcopy(model)
    torch.manual_seed(seed)
    step(twin, x, y).backward()
    return {name: p.grad for name, p in twin.named_parameters() if p.grad is not None}


def _freeze(model):
    model.a.weight.requires_grad_(False)
    return lambda: model.a.weight.requires_grad_(True)


def _replace(model):
    act = model.act
    model.act = nn.Tanh()
    return lambda: setattr(model, "act", act)


def _dropout_rate(model):
    model.drop.p = 0.5
    return lambda: setattr(model.drop, "p", 0.1)


def _config(model):
    model.config.scale = 2.0
    return lambda: setattr(model.config, "scale", 1.0)


def _inner_config(model):
    model.config.text.width = 32
    return lambda: setattr(model.config.text, "width", 64)


def _private(model):
    model._temperature = 0.5
    return lambda: setattr(model, "_temperature", 1.0)


def _private_list_in_place(model):
    model._shift[0] = 1.0
    return lambda: model._shift.__setitem__(0, 0.0)


def _list_in_place(model):
    model.widths.append(4)
    return model.widths.pop


def _function(model):
    model.squash = torch.tanh
    return lambda: setattr(model, "squash", torch.relu)


def _class(model):
    model.act.__class__ = nn.ReLU6
    return lambda: setattr(model.act, "__class__", nn.ReLU)


def _eval(model):
    model.drop.eval()
    return model.drop.train


def _forward_hook(model):
    return model.b.register_forward_hook(lambda module, args, out: 2 * out).remove


def _global_hook(model):
    return nn.modules.module.register_module_forward_hook(lambda module, args, out: None).remove


def _gradient_hook(model):
    return model.b.weight.register_hook(lambda grad: 2 * grad).remove


CHANGES = {
    "frozen": (_freeze, r"parameter 'a.weight' is frozen \(requires_grad=False\); the plan was made with it trainable"),
    "replaced": (_replace, "submodule 'act' is a Tanh; the plan was made with a ReLU there"),
    "dropout rate": (_dropout_rate, r"submodule 'drop' \(Dropout\) has p=0.5; the plan was made with p=0.1"),
    "inner config": (_inner_config, r"config.text.width=32; the plan was made with config.text.width=64"),
    "private setting": (_private, r"the model \(Net\) has _temperature=0.5; the plan was made with _temperature=1.0"),
    "private list changed in place": (
        _private_list_in_place,
        r"_shift=list\[1.0\]; the plan was made with _shift=list\[0.0\]",
    ),
    "list changed in place": (
        _list_in_place,
        r"widths=list\[16, 64, 4\]; the plan was made with widths=list\[16, 64\]",
    ),
    "function": (_function, r"has squash=torch.tanh; the plan was made with squash=torch.relu"),
    "class": (_class, "submodule 'act' is a ReLU6; the plan was made with a ReLU there"),
    "eval mode": (_eval, r"submodule 'drop' is in eval mode; the plan was made with it in training mode"),
    "config": (_config, r"the model \(Net\) has config.scale=2.0; the plan was made with config.scale=1.0"),
    "forward hook": (
        _forward_hook,
        r"'b' has forward hooks \[function .*_forward_hook.<locals>.<lambda> .*\]; .* \[\]",
    ),
    "global hook": (_global_hook, "torch.nn's global module forward hooks are"),
    "gradient hook": (_gradient_hook, r"parameter 'b.weight' has a hook on its gradient \(Tensor.register_hook\)"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_planning_is_refused_naming_it_and_undone_trains_like_eager(change):
    torch.manual_seed(0)
    model = Net().double()
    x, y = batch()
    plan = magis.optimize(model, (x, y), training_step=step, latency_limit=1.5, **SEARCH)
    plan(x, y)  # a change after a call too: what the call saw is no licence for the next
    model.zero_grad(set_to_none=True)
    make, message = CHANGES[change]
    undo = make(model)
    with pytest.raises(ValueError, match=message):
        plan(x, y)
    assert all(p.grad is None for p in model.parameters())  # refused before anything ran
    undo()
    expected = eager_gradients(model, x, y, seed=3)
    torch.manual_seed(3)
    plan(x, y)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[name], rtol=1e-12, atol=1e-14), name


def test_optimizer_hooks_in_the_backward_are_refused_before_eagers_check_fires_them():
    """The optimizer-in-backward recipe (a post-accumulate-grad hook per parameter stepping its
    own optimizer): the check that runs eager's step would update the weights; it never runs."""
    torch.manual_seed(0)
    model = Net().double()
    x, y = batch()
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step_in_backward(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"parameter 'a.weight' has a post-accumulate-grad hook.*optimizer=opt"):
        magis.optimize(model, (x, y), training_step=step, latency_limit=1.5, **SEARCH)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_batch_that_requires_grad_is_refused_naming_it():
    torch.manual_seed(0)
    model = Net().double()
    x, y = batch()
    with pytest.raises(ValueError, match="argument 0 requires grad: a plan computes the parameters' gradients"):
        magis.optimize(model, (x.requires_grad_(), y), training_step=step, **SEARCH)
    plan = magis.optimize(model, (x.detach(), y), training_step=step, latency_limit=1.5, **SEARCH)
    with pytest.raises(ValueError, match="argument 0 requires grad"):
        plan(x, y)


def test_planned_plans_a_layer_frozen_mid_training_again_and_trains_like_eager(tmp_path):
    """Fine-tuning that freezes the first layer after two steps: the second plan leaves its
    gradient None, as eager does, and AdamW trains both alike."""
    torch.manual_seed(0)
    model = Net().double()
    twin = copy.deepcopy(model)
    batches = [batch() for _ in range(4)]
    step_fn = magis.planned(model, training_step=step, latency_limit=1.5, cache_dir=tmp_path, **SEARCH)
    for net, run in ((model, step_fn), (twin, lambda x, y: step(twin, x, y).backward())):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        torch.manual_seed(7)
        for i, (x, y) in enumerate(batches):
            if i == 2:
                net.a.requires_grad_(False)
            run(x, y)
            assert (net.a.weight.grad is None) == (i >= 2)
            optimizer.step()
            optimizer.zero_grad()
    assert step_fn.searches == 2
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=1e-10, atol=1e-12), name


def test_an_inference_plan_does_not_depend_on_which_parameters_are_trainable():
    torch.manual_seed(0)
    model = Net().double().eval()
    x, _ = batch()
    plan = magis.optimize(model, (x,), inference=True, latency_limit=1.5, **SEARCH)
    model.requires_grad_(False)
    with torch.no_grad():
        assert torch.equal(plan(x), model(x))


def test_a_param_group_added_to_a_planned_optimizer_is_refused_before_any_update():
    """Unfreezing by ``add_param_group``: the plan's update holds the groups it was made for,
    so the new group would not be stepped. Refused as the step binds: no parameter moved."""
    torch.manual_seed(0)
    model = Net().double()
    x, y = batch()
    optimizer = torch.optim.AdamW([*model.a.parameters(), *model.b.parameters()], lr=1e-2)
    plan = magis.optimize(model, (x, y), training_step=step, optimizer=optimizer, latency_limit=1.5, **SEARCH)
    plan(x, y)
    plan(x, y)  # c is not stepped: its gradient accumulates in .grad, as in eager, and refuses nothing
    assert model.a.weight.grad is None and model.c.weight.grad is not None
    optimizer.add_param_group({"params": list(model.c.parameters()), "lr": 1e-3})
    optimizer.zero_grad()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="the optimizer has 2 param groups; the plan was made for 1: optimize again"):
        plan(x, y)
    optimizer.param_groups[0]["params"].pop()
    optimizer.param_groups.pop()
    with pytest.raises(ValueError, match=r"param group 0 holds other parameters .*removed \['b.bias'\]"):
        plan(x, y)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_planned_plans_again_when_a_param_group_is_added_and_trains_like_eager(tmp_path):
    """Gradual unfreezing as users write it: the head trains first, then the body joins the
    optimizer through ``add_param_group``; ``magis.planned`` plans the new step by itself."""
    torch.manual_seed(0)
    model = Net().double()
    twin = copy.deepcopy(model)
    batches = [batch() for _ in range(4)]
    optimizer = torch.optim.AdamW(model.c.parameters(), lr=1e-2)
    twin_optimizer = torch.optim.AdamW(twin.c.parameters(), lr=1e-2)
    step_fn = magis.planned(
        model, training_step=step, optimizer=optimizer, latency_limit=1.5, cache_dir=tmp_path, **SEARCH
    )
    for net, opt, run in (
        (model, optimizer, step_fn),
        (twin, twin_optimizer, lambda x, y: (step(twin, x, y).backward(), twin_optimizer.step())),
    ):
        torch.manual_seed(7)
        for i, (x, y) in enumerate(batches):
            if i == 2:
                opt.add_param_group({"params": [*net.a.parameters(), *net.b.parameters()], "lr": 1e-3})
            opt.zero_grad()
            run(x, y)
    assert step_fn.searches == 2
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=1e-10, atol=1e-12), name


def test_a_model_cast_after_planning_is_refused_naming_a_parameter():
    """Token ids pass the batch check whatever the weights' dtype: the cast is caught as the
    step binds (it failed inside the step with "expected scalar type Float but found BFloat16")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Flatten(), nn.Linear(16 * 8, 4))
    ids, labels = torch.randint(0, 32, (16, 8)), torch.randint(0, 4, (16,))
    plan = magis.optimize(model, (ids, labels), training_step=step, latency_limit=1.5, **SEARCH)
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"parameter '0.weight' is torch.bfloat16 .* captured with torch.float32"):
        plan(ids, labels)
    model.float()
    plan(ids, labels)
    assert model[0].weight.grad.dtype == torch.float32


SMOOTHING = 0.0  # read by smoothed_step from the module's globals, as users keep hyperparameters


def smoothed_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, label_smoothing=SMOOTHING)


def test_a_value_the_step_reads_from_its_globals_or_closure_is_checked_at_each_call(monkeypatch):
    torch.manual_seed(0)
    model = Net().double()
    x, y = batch()
    plan = magis.optimize(model, (x, y), training_step=smoothed_step, latency_limit=1.5, **SEARCH)
    monkeypatch.setitem(globals(), "SMOOTHING", 0.3)
    with pytest.raises(ValueError, match=r"smoothed_step\(\) reads SMOOTHING=0.3; the plan was made with SMOOTHING=0"):
        plan(x, y)
    monkeypatch.setitem(globals(), "SMOOTHING", 0.0)
    plan(x, y)

    weight = 1.0

    def weighted(model, x, y):
        return weight * step(model, x, y)

    model.zero_grad()
    plan = magis.optimize(model, (x, y), training_step=weighted, latency_limit=1.5, **SEARCH)
    weight = 2.0
    with pytest.raises(ValueError, match=r"weighted\(\) reads weight=2.0; the plan was made with weight=1.0"):
        plan(x, y)


class Scale:
    """A hook object whose state a user tunes between calls."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return self.factor * out


def test_a_hook_whose_state_or_code_changed_is_refused_and_its_side_effects_are_warned_of():
    torch.manual_seed(0)
    model = Net().double()
    x, y = batch()
    scale = Scale(1.0)
    model.b.register_forward_hook(scale)
    plan = magis.optimize(model, (x, y), training_step=step, latency_limit=1.5, **SEARCH)
    plan(x, y)
    scale.factor = 3.0
    with pytest.raises(ValueError, match=r"submodule 'b' has forward hooks \[Scale\{'factor': 3.0\}\]"):
        plan(x, y)

    seen = []
    model = Net().double()
    model.c.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with pytest.warns(UserWarning, match=r"submodule 'c' has forward hooks .*: a plan runs what they computed"):
        magis.optimize(model, (x, y), training_step=step, latency_limit=1.5, **SEARCH)


HYPERPARAMETERS = {"smoothing": 0.0}  # a dict of the module's, as users keep a run's settings


def dict_smoothed_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, label_smoothing=HYPERPARAMETERS["smoothing"])


def test_a_container_or_namespace_the_step_reads_is_checked_at_each_call(monkeypatch):
    torch.manual_seed(0)
    model = Net().double()
    x, y = batch()
    plan = magis.optimize(model, (x, y), training_step=dict_smoothed_step, latency_limit=1.5, **SEARCH)
    plan(x, y)
    monkeypatch.setitem(HYPERPARAMETERS, "smoothing", 0.2)
    with pytest.raises(ValueError, match=r"reads HYPERPARAMETERS=dict\['smoothing': 0.2\]; the plan was made with"):
        plan(x, y)

    args = SimpleNamespace(weight=1.0, epoch=0)  # what argparse returns

    def weighted(model, x, y):
        return args.weight * step(model, x, y)

    model.zero_grad()
    plan = magis.optimize(model, (x, y), training_step=weighted, latency_limit=1.5, **SEARCH)
    args.epoch = 1  # not read by the step: no new step
    plan(x, y)
    args.weight = 2.0
    with pytest.raises(ValueError, match=r"weighted\(\) reads args.weight=2.0; the plan was made with args.weight=1.0"):
        plan(x, y)
