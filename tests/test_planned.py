"""``magis.planned``: a loader whose shapes vary trains like eager, with one search per shape,
and a second process reads the plans instead of searching; and the command line on the
user's own ``MODULE:FUNCTION``."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import magis
from magis.cli import main
from magis.planned_step import PlannedStep

OPTIONS = {"device": "h200", "max_states": 6, "time_budget": 20.0, "progress": False}
#: (batch, sequence length) of each batch: the sequence length varies, the last batch is smaller
LOADER = [(8, 12), (8, 12), (8, 7), (8, 12), (3, 7)]
SHAPES = len(set(LOADER))


class TinyLM(nn.Module):
    """Embedding -> tanh(linear) -> vocabulary logits."""

    def __init__(self, vocab: int = 40, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def lm_step(net: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The user's training step: the labels reach the loss."""
    return F.cross_entropy(net(ids).flatten(0, 1), labels.flatten())


def model() -> nn.Module:
    torch.manual_seed(0)
    return TinyLM().double()


def loader(vocab: int = 40) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, vocab, (b, s), generator=generator), torch.randint(0, vocab, (b, s), generator=generator))
        for b, s in LOADER
    ]


def train(step, net: nn.Module) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """SGD over the loader; each step's loss and gradients."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    seen = []
    for ids, labels in loader():
        optimizer.zero_grad(set_to_none=True)
        loss = step(ids, labels)
        seen.append((loss.detach(), [p.grad.clone() for p in net.parameters()]))
        optimizer.step()
    return seen


def eager_step(net: nn.Module):
    def run(*batch: torch.Tensor) -> torch.Tensor:
        loss = lm_step(net, *batch)
        loss.backward()
        return loss

    return run


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PlannedStep, list, list]:
    """The loader trained through ``planned`` (its plans kept in a fresh cache) and eagerly."""
    cache = tmp_path_factory.mktemp("plans")
    net = model()
    reference = copy.deepcopy(net)
    step = magis.planned(net, training_step=lm_step, memory_limit=0.9, cache_dir=cache, **OPTIONS)
    return cache, step, train(step, net), train(eager_step(reference), reference)


def test_every_step_equals_eager_with_one_search_per_shape(first_run):
    cache, step, planned_steps, eager_steps = first_run
    for (loss, grads), (eager_loss, eager_grads) in zip(planned_steps, eager_steps, strict=True):
        torch.testing.assert_close(loss, eager_loss, rtol=1e-10, atol=0)
        for g, e in zip(grads, eager_grads):
            torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-13)
    assert (step.searches, step.loaded) == (SHAPES, 0)
    assert len(list(cache.glob("*.plan"))) == SHAPES
    for b, s in sorted(set(LOADER)):  # a fraction is of each shape's own peak
        plan = step.plan_for(torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s, dtype=torch.long))
        assert plan.objective.memory_bytes == int(0.9 * plan.baseline_peak_bytes)
        assert plan.peak_bytes <= plan.objective.memory_bytes


CHILD = """
import sys
sys.path.insert(0, {tests!r})
import magis
from test_planned import OPTIONS, lm_step, model, train
net = model()
step = magis.planned(net, training_step=lm_step, memory_limit=0.9, cache_dir={cache!r}, **OPTIONS)
train(step, net)
print(step.searches, step.loaded)
"""


def test_a_second_process_with_the_same_cache_does_no_search(first_run):
    script = CHILD.format(tests=str(Path(__file__).parent), cache=str(first_run[0]))
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    searches, loaded = map(int, child.stdout.split())
    assert (searches, loaded) == (0, SHAPES)


def test_a_plan_read_from_the_cache_runs_as_the_steps_options_say(tmp_path):
    """A plan file holds no runtime: one read back runs compiled when the step was made with
    ``compile=True``, and without CUDA graphs when ``cuda_graphs=False``."""
    batch = loader()[0]
    options = dict(OPTIONS, memory_limit=0.9, cache_dir=tmp_path, compile=True, cuda_graphs=False)
    first = magis.planned(model(), training_step=lm_step, **options)
    assert first.plan_for(*batch).runtime == "compiled" and first.searches == 1
    again = magis.planned(model(), training_step=lm_step, **options)
    plan = again.plan_for(*batch)
    assert (again.searches, again.loaded) == (0, 1)
    assert plan.runtime == "compiled" and plan.cuda_graphs is False


class Tagger(nn.Module):
    """A user's sequence tagger with a dropout (live in training, off in eval) and a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.lm, self.drop = TinyLM(), nn.Dropout(0.3)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.drop(self.lm(ids))
        return {"logits": logits, "best": logits.argmax(-1)}


def test_an_inference_step_plans_each_shape_of_an_evaluation_loop_and_returns_eagers_outputs(tmp_path):
    """``planned(..., inference=True)``: an evaluation loop's batches (another length, the last
    smaller) each get the forward's plan, outputs as eager's under no_grad; a second step on the
    same cache reads them; the model put in training mode is another signature, planned anew."""
    torch.manual_seed(0)
    net = Tagger().double().eval()
    step = magis.planned(net, inference=True, latency_limit=1.2, cache_dir=tmp_path, **OPTIONS)
    batches = [ids for ids, _ in loader()]
    for ids in batches:
        with torch.no_grad():
            expected = net(ids)
        got = step(ids)
        assert got.keys() == expected.keys() and not got["logits"].requires_grad
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)  # a split sums in another order
    assert (step.searches, step.loaded) == (SHAPES, 0)
    again = magis.planned(net, inference=True, latency_limit=1.2, cache_dir=tmp_path, **OPTIONS)
    torch.testing.assert_close(again(batches[-1]), step(batches[-1]), rtol=0, atol=0)
    assert (again.searches, again.loaded) == (0, 1)
    net.train()  # the dropout live now: the trace of eval mode would return the wrong outputs
    torch.manual_seed(5)
    with torch.no_grad():
        expected = net(batches[0])
    torch.manual_seed(5)
    torch.testing.assert_close(step(batches[0]), expected, rtol=1e-12, atol=1e-14)
    assert step.searches == SHAPES + 1


def test_an_inference_step_takes_no_loss_or_optimizer():
    net = TinyLM()
    with pytest.raises(ValueError, match="without loss or update: drop training_step, optimizer"):
        magis.planned(net, training_step=lm_step, optimizer=torch.optim.SGD(net.parameters()), inference=True)
    with pytest.raises(ValueError, match="inference is True or False"):
        magis.planned(net, inference="yes")


def test_a_damaged_cache_file_is_planned_again(first_run, tmp_path):
    for path in first_run[0].glob("*.plan"):
        (tmp_path / path.name).write_bytes(path.read_bytes()[:100])
    net = model()
    step = magis.planned(net, training_step=lm_step, memory_limit=0.9, cache_dir=tmp_path, **OPTIONS)
    with pytest.warns(UserWarning, match="planning again.*damaged"):
        step(*loader()[0])
    assert (step.searches, step.loaded) == (1, 0)
    (rewritten,) = [path for path in tmp_path.glob("*.plan") if path.stat().st_size > 100]
    assert magis.load_plan(rewritten, net).peak_bytes > 0


def test_a_byte_limit_applies_to_every_shape_and_old_plans_come_back_from_the_cache(tmp_path):
    net = model()
    limit = 100_000
    options = {"memory_limit": limit, "cache_dir": tmp_path, "max_plans": 1, **OPTIONS}
    step = magis.planned(net, training_step=lambda m, batch: lm_step(m, batch["ids"], batch["labels"]), **options)
    short, long = ({"ids": ids, "labels": labels} for ids, labels in (loader()[4], loader()[2]))
    for batch in (short, long, short):  # a mapping is the batch (keyword arguments)
        reference = copy.deepcopy(net)
        loss = step(batch)
        torch.testing.assert_close(loss, lm_step(reference, **batch), rtol=1e-10, atol=0)
        assert step.plan_for(batch).objective.memory_bytes == limit
    assert (step.searches, step.loaded, len(step.plans)) == (2, 1, 1)  # the least recently used left memory
    with pytest.warns(UserWarning, match="eval mode"):
        net.eval()  # another mode is another plan
        step(short)
    assert step.searches == 3


def test_bad_options_are_refused_before_anything_runs():
    net = model()
    with pytest.raises(ValueError, match="loss_fn or training_step, not both"):
        magis.planned(net, lambda out: out.sum(), training_step=lm_step)
    with pytest.raises(ValueError, match=r"loss_fn takes 3 arguments.*training_step=step"):
        magis.planned(net, lm_step)  # a step of (model, *batch) passed where loss_fn(output) goes
    with pytest.raises(ValueError, match="max_plans"):
        magis.planned(net, max_plans=0)


WORKLOAD = """
import torch
import torch.nn.functional as F
from torch import nn


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    return model, (x, y), lambda m, x, y: F.cross_entropy(m(x), y)


class Squared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).square().mean()


def plain():
    torch.manual_seed(0)
    return Squared(), torch.randn(32, 8)


def broken():
    return "a model"
"""


@pytest.fixture
def workload(tmp_path: Path) -> Path:
    path = tmp_path / "my_workload.py"
    path.write_text(textwrap.dedent(WORKLOAD))
    return path


def test_the_cli_optimizes_the_users_module_function(workload, capsys):
    argv = ["optimize", f"{workload}:make", "--memory-limit", "0.8", "--device", "h200", "--max-states", "8"]
    assert main([*argv, "--run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == f"{workload}:make"
    assert report["peak_bytes"] <= 0.8 * report["baseline_peak_bytes"]
    assert report["max_grad_error"] < 1e-4 and not report["missing_gradients"]
    assert main(["schedule", f"{workload}:make", "--json", "--time-limit", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["nodes"] > 0


def test_the_cli_imports_a_module_by_name(workload, capsys, monkeypatch):
    monkeypatch.chdir(workload.parent)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_workload", raising=False)
    assert main(["profile", "my_workload:plain", "--preset", "tiny", "--run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_grad_error"] < 1e-4


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{file}:broken", "must return (model, batch) or (model, batch, training_step)"),
        ("{file}:missing", "has no function 'missing'"),
        ("{dir}/absent.py:make", "cannot import"),
        ("no_such_module_here:make", "cannot import no_such_module_here: ModuleNotFoundError"),
    ],
)
def test_the_cli_names_what_is_wrong_with_a_module_function(workload, capsys, spec, message):
    spec = spec.format(file=workload, dir=workload.parent)
    assert main(["profile", spec, "--json"]) == 2
    assert message in capsys.readouterr().err


def test_the_cli_refuses_batch_for_a_module_function(workload, capsys):
    assert main(["profile", f"{workload}:make", "--batch", "4"]) == 2
    assert "--batch" in capsys.readouterr().err
