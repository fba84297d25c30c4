"""The command line: documented JSON keys, and clear errors for bad options."""

from __future__ import annotations

import json

import pytest

from magis.cli import main


def run_json(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_models_lists_every_workload_of_the_zoo_with_its_step(capsys):
    from magis.models import ZOO

    report = run_json(capsys, "models", "--json")
    rows = {row["model"]: row for row in report["workloads"]}
    assert list(rows) == list(ZOO)
    assert {"resnet50", "bert-base", "vit-base", "unet", "unetpp", "gpt-neo-1.3b", "btlm-3b"} <= set(rows)
    assert all(row["step"] == ("inference" if ZOO[name].inference else "training") for name, row in rows.items())


def test_profile_json_has_the_documented_keys(capsys):
    report = run_json(capsys, "profile", "vit-base", "--preset", "tiny", "--run", "--json")
    for key in (
        "model",
        "nodes",
        "weight_bytes",
        "simulated_peak_bytes",
        "simulated_latency_s",
        "capture_seconds",
        "measured_peak_bytes",
        "eager_peak_bytes",
        "max_grad_error",
    ):
        assert key in report, key
    assert report["model"] == "vit-base"
    assert report["max_grad_error"] < 1e-4
    assert abs(report["measured_peak_bytes"] - report["simulated_peak_bytes"]) <= 0.02 * report["simulated_peak_bytes"]


def test_unknown_model_names_the_valid_ones(capsys):
    assert main(["profile", "alexnet", "--json"]) == 2
    err = capsys.readouterr().err
    assert "alexnet" in err and "bert-base" in err


def test_unknown_device_names_the_valid_ones(capsys):
    assert main(["profile", "unet", "--device", "tpu", "--json"]) == 2
    assert "h200" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["profile", "unet", "--preset", "huge"], ["profile", "unet", "--batch", "0"]])
def test_bad_options_are_rejected_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid" in err or "must be" in err


def test_run_on_paper_preset_is_refused(capsys):
    assert main(["profile", "bert-base", "--preset", "paper", "--run"]) == 2
    assert "fake" in capsys.readouterr().err


def test_optimize_json_has_the_documented_keys(capsys, tmp_path):
    plot = tmp_path / "timeline.png"
    argv = ["optimize", "gpt-neo-1.3b", "--preset", "tiny", "--memory-limit", "0.8", "--device", "h200"]
    report = run_json(capsys, *argv, "--max-states", "12", "--json", "--plot", str(plot))
    for key in (
        "model",
        "preset",
        "device",
        "baseline_peak_bytes",
        "baseline_latency_s",
        "peak_bytes",
        "latency_s",
        "search_seconds",
        "states",
        "transformations",
    ):
        assert key in report, key
    assert report["peak_bytes"] <= 0.8 * report["baseline_peak_bytes"] and report["states"] <= 12
    done = report["transformations"]
    assert done["fission"] or done["recomputed"] or done["swapped"]  # what brought the peak under the limit
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_optimize_on_this_cpu_times_its_choice_unless_told_not_to(capsys):
    argv = ["optimize", "gpt-neo-1.3b", "--preset", "tiny", "--latency-limit", "1.1", "--max-states", "12", "--json"]
    timed = run_json(capsys, *argv, "--time-budget", "20")["timed"]
    assert timed["plans"] >= 1 and timed["rounds"] >= 1 and timed["choice"]
    assert run_json(capsys, *argv, "--no-timed")["timed"] == {"plans": 0, "rounds": 0, "choice": ""}


def test_optimize_plans_the_whole_step_with_an_optimizer(capsys):
    argv = ["optimize", "gpt-neo-1.3b", "--preset", "tiny", "--latency-limit", "1.1", "--device", "h200"]
    report = run_json(capsys, *argv, "--optimizer", "adamw", "--max-states", "20", "--time-budget", "20", "--json")
    assert report["optimizer"]["name"] == "AdamW" and report["optimizer"]["in_plan"]
    assert report["peak_bytes"] <= report["baseline_peak_bytes"]
    assert main([*argv, "--optimizer", "adamw", "--run"]) == 2
    assert "without --optimizer" in capsys.readouterr().err


def test_optimize_rejects_two_limits_and_a_bad_size(capsys):
    with pytest.raises(SystemExit):
        main(["optimize", "unet", "--memory-limit", "0.5", "--latency-limit", "1.1"])
    assert "not allowed with" in capsys.readouterr().err
    assert main(["optimize", "unet", "--memory-limit", "5parsecs", "--json"]) == 2
    assert "memory size" in capsys.readouterr().err
