"""``magis.fits`` and ``magis fits``: the largest size eager PyTorch and magis fit on a device.

Small models on the meta device and a small memory stand in for a GPU's: each test
captures a step of a few hundred nodes at most, so the file runs in seconds."""

from __future__ import annotations

import importlib
import json
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import magis
from magis.cli import main
from magis.frontend.size_family import SizeFamily, SizeFamilyError
from magis.models import get_workload

MEMORY = 4 * 2**20  # 4 MiB: a few hundred samples of the MLP below, with AdamW's states


def mlp_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def make_mlp(n: int) -> tuple:
    """An MLP and a batch of ``n`` samples on the meta device: planned, never run."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        x, y = torch.randn(n, 64), torch.randint(0, 10, (n,))
    return model, (x, y), mlp_step


class HalfBatch(nn.Module):
    """Trains on the first half of its batch: an integer (n // 2) that no polynomial fits."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(64, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x[: x.shape[0] // 2]).square().mean()


def make_half_batch(n: int) -> tuple:
    with torch.device("meta"):
        return HalfBatch(), (torch.randn(n, 64),)


def eager_peak(make, n: int) -> int:
    """The simulated peak of eager's whole step (backward, then AdamW's update) at size ``n``,
    as :func:`magis.optimize` reports it for the captured order."""
    model, batch, *step = make(n)
    plan = magis.optimize(
        model,
        batch,
        training_step=step[0] if step else None,
        optimizer=torch.optim.AdamW(model.parameters()),
        device="h100",
        max_states=1,
        progress=False,
    )
    return plan.baseline_peak_bytes


@pytest.fixture(scope="module")
def mlp_report() -> magis.FitReport:
    return magis.fits(make_mlp, device="h100", memory_bytes=MEMORY, search_seconds=2, progress=False)


def test_eager_answer_is_the_largest_size_whose_simulated_step_fits(mlp_report):
    size = mlp_report.eager.size
    assert size > 1
    assert mlp_report.eager.peak_bytes == eager_peak(make_mlp, size) <= MEMORY < eager_peak(make_mlp, size + 1)


def test_magis_fits_at_least_what_eager_fits_within_the_limits(mlp_report):
    report = mlp_report
    assert report.magis.size >= report.eager.size
    assert report.magis.peak_bytes <= report.memory_bytes == MEMORY
    assert 1.0 <= report.magis_latency_ratio <= report.latency_limit + 1e-9
    assert report.magis.samples_per_s == pytest.approx(report.magis.size / report.magis.latency_s)
    assert report.derived and report.captured[:2] == (8, 9)
    assert report.verified_size in (report.magis.size, report.eager.size)


def test_report_is_json(mlp_report):
    data = json.loads(json.dumps(mlp_report.to_dict()))
    assert data["eager"]["size"] == mlp_report.eager.size
    assert {p["side"] for p in data["probes"]} <= {"eager", "magis"}


def test_a_step_that_is_no_polynomial_in_the_size_is_captured_at_every_size():
    report = magis.fits(
        make_half_batch, device="h100", optimizer="sgd", memory_bytes=MEMORY, max_probes=0, progress=False
    )
    assert not report.derived and len(report.captured) > 3
    size = report.eager.size
    assert eager_peak_sgd(size) <= MEMORY < eager_peak_sgd(size + 1)


def eager_peak_sgd(n: int) -> int:
    model, batch = make_half_batch(n)
    optimizer = torch.optim.SGD(model.parameters())
    return magis.optimize(
        model, batch, optimizer=optimizer, device="h100", max_states=1, progress=False
    ).baseline_peak_bytes


def captured(make, n: int) -> magis.Graph:
    model, batch, *step = make(n)
    return magis.capture(model, batch, training_step=step[0] if step else None)


def test_size_family_derives_the_graph_captured_at_another_size():
    family = SizeFamily({2: captured(make_mlp, 2), 3: captured(make_mlp, 3)})
    assert family.graph(7).structural_hash() == captured(make_mlp, 7).structural_hash()
    with pytest.raises(ValueError, match="2 or more"):
        family.graph(1)


def test_size_family_refuses_graphs_of_different_structure():
    with pytest.raises(SizeFamilyError, match="changes with the size"):
        SizeFamily({2: captured(make_mlp, 2), 4: captured(make_half_batch, 4)})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"device": "tpu"}, "unknown device 'tpu'.*h100"),
        ({"optimizer": "lion"}, "unknown optimizer 'lion'.*adamw"),
        ({"dim": "width"}, "dim must be one of batch, sequence"),
        ({"latency_limit": 0.9}, "latency_limit"),
        ({"memory_bytes": "lots"}, "cannot read 'lots'"),
    ],
)
def test_bad_options_fail_before_anything_is_captured(options, message):
    def never(n: int) -> tuple:
        raise AssertionError("nothing is built for bad options")

    with pytest.raises(ValueError, match=message):
        magis.fits(never, **options)


def test_sequence_of_an_image_model_is_refused():
    with pytest.raises(ValueError, match="no sequence length"):
        get_workload("resnet50").sized("sequence")


def test_cli_sequence_of_a_tiny_workload(capsys):
    argv = ["fits", "bert-base", "--preset", "tiny", "--dim", "sequence", "--device", "h200", "--memory", "6MiB"]
    assert main([*argv, "--max-probes", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dim"] == "sequence" and report["device"] == "h200" and report["memory_bytes"] == 6 * 2**20
    assert report["captured"][:3] == [16, 17, 18] and report["derived"]
    assert report["verified_size"] == report["eager"]["size"]  # derived (a quadratic), then captured: equal
    eager = report["eager"]
    assert eager["size"] > 18 and report["magis"] == eager
    assert eager["tokens_per_s"] == pytest.approx(eager["samples_per_s"] * eager["size"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["resnet50", "--dim", "sequence", "--device", "h100"], "no sequence length"),
        (["unet", "--device", "tpu"], "unknown device 'tpu'"),
        (["unet", "--device", "h100", "--optimizer", "lion"], "unknown optimizer 'lion'"),
        (["alexnet", "--device", "h100"], "unknown workload 'alexnet'"),
    ],
)
def test_cli_bad_input_is_a_clear_error(argv, message, capsys):
    assert main(["fits", *argv]) == 2
    assert message in capsys.readouterr().err


MODULE = """
import torch
from torch import nn


def sized(batch_size):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1))
        return model, (torch.randn(batch_size, 32),), lambda m, x: m(x).square().mean()


def unsized():
    return sized(4)
"""


def test_cli_module_function_takes_its_size_by_keyword(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(importlib.import_module("magis.fits"), "CHILD_AFTER_S", 0.0)  # verify in a child process
    path = tmp_path / "sized_model.py"
    path.write_text(textwrap.dedent(MODULE))
    argv = ["fits", f"{path}:sized", "--device", "rtx3090", "--optimizer", "none", "--memory", "256KiB"]
    assert main([*argv, "--max-probes", "0"]) == 0
    out, err = capsys.readouterr()
    size = int(next(line for line in out.splitlines() if "eager_size" in line).split(":")[1])
    assert size > 8 and f"size {size}: the derived graph equals its capture" in err
    assert "capturing it here" not in err  # the child process captured it
    assert "magis_stopped_by: max_probes" in out

    assert main(["fits", f"{path}:unsized", "--device", "h100"]) == 2
    assert "must take batch_size=N" in capsys.readouterr().err
