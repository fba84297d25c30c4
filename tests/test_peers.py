"""The yardstick: every peer runs for real with eager's gradients, its simulation matches its
measurement, and bad input is refused with the valid choices."""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
import torch

from magis.backend.eager import max_relative_error
from magis.backend.meter import resident_tensors
from magis.cli import main
from magis.cost.memory import simulate_memory
from magis.models import build_workload
from yardstick.compare import Row, _float32_rounding, best_within, compare, pareto_front
from yardstick.methods import METHODS, PEER, MethodUnavailable, Subject, Variant, variants
from yardstick.peers.checkpointing import checkpoint_sqrt_segments
from yardstick.protocol import Rounds, measure_peak

PEERS = [name for name, method in METHODS.items() if method.kind == PEER and not method.opt_in]

# One of each kind: a transformers decoder (checkpointable layers, a KV cache, tied
# embeddings), a transformers CNN without checkpointing support (BatchNorm, chained
# blocks) and a plain module whose blocks do not chain. vit-base behaves as btlm-3b;
# two workloads are left out because eager CPU execution and the traced graph differ:
# bert-base (dropout p=0.1: eager CPU keeps float masks, the traced graph native_dropout's
# bool masks, as CUDA eager does) and gpt-neo-1.3b (Python locals keep recomputed tensors
# alive longer in eager's checkpoint replay; the attention's p=0 dropout traces as a clone).
# resnet50 at batch 4: accumulation's micro-batches of 2 keep two values per channel for
# batch norm at the last stage's 1x1 feature maps.
WORKLOADS = {"btlm-3b": None, "resnet50": 4, "unet": None}
#: accumulate+compile compiles once more per workload, Checkmate solves a program: each runs on
#: unet only (test_accumulation_with_compile, test_rematerialization_peers_run_their_plans_for_real)
FIXTURE_PEERS = [name for name in PEERS if name not in ("accumulate+compile", "checkmate")]

Run = tuple[int, int, float, "str | None"]  # measured peak, simulated peak, max gradient error, gradient note


def run_variants(subject: Subject, chosen: list[Variant]) -> dict[str, Run]:
    """Every variant of ``chosen`` on ``subject`` for real and simulated; the first is the reference."""
    runs: dict[str, Run] = {}
    reference = None
    for variant in chosen:
        try:
            runnable = variant.real(subject)
            resident = resident_tensors(runnable.built.model, runnable.built.example_inputs)
            peak, result = measure_peak(runnable.step, resident)
        except MethodUnavailable:
            continue
        gradients = {**result.gradients, "<loss>": result.loss}
        reference = gradients if reference is None else reference
        graph, order = variant.simulate(subject)
        simulated = simulate_memory(graph, order).peak
        runs[variant.name] = (peak, simulated, max_relative_error(reference, gradients), runnable.gradient_note)
    return runs


@pytest.fixture(scope="module")
def peer_runs() -> dict[str, dict[str, Run]]:
    """workload -> peer variant -> its run (variants that cannot run at this size are left out)."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    runs = {}
    for workload, batch in WORKLOADS.items():
        subject = Subject(workload, "tiny", batch)
        runs[workload] = run_variants(subject, variants(FIXTURE_PEERS, [0.5], subject.batch_size))
    return runs


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_peer_computes_eagers_gradients(peer_runs, workload):
    for name, (_, _, error, note) in peer_runs[workload].items():
        if note is None:
            assert error < 1e-5, (name, error)


def test_accumulation_says_where_its_gradients_differ_and_by_how_much(peer_runs):
    """Micro-batches of a batch-norm network normalise by their own statistics: the gradients
    differ from the full batch's, measured here (the largest relative difference over all
    gradients is 180 at resnet50 tiny: a conv bias that batch norm makes nearly gradient-free).
    Without batch norm, dropout or masked labels, accumulation is exact."""
    for name in ("accumulate@2", "accumulate@2+checkpoint-block"):
        _, _, error, note = peer_runs["resnet50"][name]
        assert note is not None and "batch norm" in note
        assert 10 < error < 1000, error
        for workload in ("btlm-3b", "unet"):
            _, _, error, note = peer_runs[workload][name]
            assert note is None and error < 1e-5, (workload, name, error)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_simulated_peer_peaks_match_measured_within_2_percent(peer_runs, workload):
    for name, (measured, simulated, _, _) in peer_runs[workload].items():
        assert abs(simulated - measured) <= 0.02 * measured, (name, measured, simulated)


def test_checkpointing_lowers_the_measured_peak(peer_runs):
    for workload, runs in peer_runs.items():
        eager = runs["eager"][0]
        assert runs["checkpoint-block"][0] < eager, workload
        assert runs["compile@0.5"][0] < eager, workload
        assert runs["accumulate@2+checkpoint-block"][0] < runs["accumulate@2"][0], workload


def test_accumulation_with_compile():
    subject = Subject("unet", "tiny")
    runs = run_variants(subject, variants(["eager", "accumulate+compile"], [0.5], subject.batch_size))
    measured, simulated, error, note = runs["accumulate@2+compile@0.5"]
    assert note is None and error < 1e-5
    assert abs(simulated - measured) <= 0.02 * measured


def test_accumulation_with_compile_at_micro_batch_one_keeps_aliased_gradients_apart():
    """ViT's compiled backward at micro-batch 1 returns the class token's gradient as a
    slice of the position embeddings'; kept as ``.grad`` as it is, the two would share
    memory and every later micro-batch would add into both (twice eager's gradient).
    Copying the slice between micro-batches leaves the step's memory as simulated."""
    subject = Subject("vit-base", "tiny")
    assert subject.batch_size == 2
    runs = run_variants(subject, variants(["eager", "accumulate+compile"], [1.0], subject.batch_size))
    measured, simulated, error, note = runs["accumulate@2+compile@1"]
    assert note is None and error < 1e-5
    assert abs(simulated - measured) <= 0.02 * measured


def test_more_compile_variants_than_dynamos_recompile_limit_all_run_compiled():
    """A comparison compiles one ``forward`` once per budget and micro-batch count (twelve on
    resnet50 small): past dynamo's recompile limit (8) the step would run eagerly, which the
    compiled peer refuses to pass off as compiled."""
    subject = Subject("unet", "tiny")
    for budget in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2):
        result = METHODS["compile"].real(subject, budget).step(contextlib.nullcontext())
        assert result.gradients, budget


def test_rematerialization_peers_run_their_plans_for_real():
    """Checkmate's and DTR's plans recompute values; the magis runtime runs them with eager's
    gradients, and the measured peak is the simulated one, within the budget. (Checkmate's
    program at 0.8 is solved to optimality in 5-12 s on two shared cores: its own time limit.)"""
    subject = Subject("unet", "tiny")
    chosen = [*variants(["eager"], [1.0]), Variant(METHODS["checkmate"], 0.8), Variant(METHODS["dtr"], 0.8)]
    runs = run_variants(subject, chosen)
    assert set(runs) == {"eager", "checkmate@0.8", "dtr@0.8"}
    for name in ("checkmate@0.8", "dtr@0.8"):
        measured, simulated, error, _ = runs[name]
        assert error < 1e-5 and abs(simulated - measured) <= 0.02 * measured, name
        details = next(v for v in chosen if v.name == name).details(subject)
        assert details["recomputed_nodes"] > 0
        assert measured <= details["memory_limit_bytes"]
    checkmate = next(v for v in chosen if v.name == "checkmate@0.8").details(subject)
    assert checkmate["solver"] == "optimal" and checkmate["gap"] == 0.0 and checkmate["solve_s"] > 0


@pytest.mark.parametrize(
    ("workload", "segments"),
    [
        ("resnet50", [2, 2]),  # four chained bottlenecks: two segments of two
        ("unet", [1] * 9),  # pooling and skip concatenations between blocks: no chain
    ],
)
def test_sqrt_segments_follow_chains_of_blocks(workload, segments):
    built = build_workload(workload, "tiny", None)
    found = checkpoint_sqrt_segments(built.model, built.example_inputs)
    assert [len(s) for s in found] == segments


def test_simulated_comparison_reports_ratios_against_eager():
    comparison = compare("vit-base", "tiny", ["eager", "compile"], [0.5], simulate=True)
    rows = {r.method: r for r in comparison.rows}
    assert set(rows) == {"eager", "compile@0.5"}
    assert rows["eager"].peak_ratio == 1.0 and rows["eager"].latency_ratio == 1.0
    assert not any(r.measured for r in comparison.rows)
    assert rows["compile@0.5"].peak_ratio < 1.0


def test_bench_cli_json_and_plot(capsys, tmp_path):
    plot = tmp_path / "plane.png"
    argv = ["bench", "vit-base", "--preset", "tiny", "--methods", "checkpoint-block"]
    rounds = ["--repeats", "1", "--max-repeats", "1", "--warmup", "0"]
    assert main([*argv, *rounds, "--json", "--plot", str(plot)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in report["rows"]] == ["eager", "checkpoint-block"]
    for row in report["rows"]:
        for key in ("method", "peak_bytes", "latency_s", "peak_ratio", "latency_ratio", "measured"):
            assert key in row, key
        assert row["measured"] is True
        assert row["rounds"] == 1
        assert row["latency_ratio_stderr"] is None  # one round says nothing of the spread
    assert plot.stat().st_size > 0


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["bench", "vit-base", "--methods", "eager,hiremate"], ["hiremate", "checkpoint-block", "dtr"]),
        (["bench", "alexnet"], ["alexnet", "bert-base", "unet"]),
        (["bench", "vit-base", "--budget", "0"], ["(0, 1]"]),
        (["bench", "vit-base", "--budget", "0.5", "1.5"], ["(0, 1]", "1.5"]),
        (["bench", "vit-base", "--device", "h200"], ["simulate"]),
        (["bench", "vit-base", "--simulate", "--device", "tpu"], ["tpu", "h200"]),
        (["bench", "vit-base", "--precision", "0"], ["precision"]),
        (["bench", "vit-base", "--repeats", "5", "--max-repeats", "3"], ["max_repeats", "5", "3"]),
    ],
)
def test_bad_input_names_the_valid_choices(capsys, argv, named):
    assert main(argv) == 2
    err = capsys.readouterr().err
    for text in named:
        assert text in err, (text, err)


def test_pareto_front_and_best_within_overhead():
    def row(name: str, peak: float, latency: float, kind: str = PEER) -> Row:
        return Row(name, 0, 0.0, peak, latency, True, kind)

    rows = [
        row("eager", 1.0, 1.0),
        row("a", 0.8, 1.05),
        row("b", 0.9, 1.2),
        row("c", 0.5, 1.5),
        row("m", 0.4, 1.0, "magis"),
    ]
    assert [r.method for r in pareto_front(rows)] == ["m"]
    assert [r.method for r in pareto_front(rows[:4])] == ["c", "a", "eager"]
    assert best_within(rows).method == "a"
    assert best_within(rows, kind=None).method == "m"
    assert best_within(rows, overhead=0.6).method == "c"


def test_a_method_name_may_fix_its_own_limit():
    names = [v.name for v in variants(["magis-optimize@0.8", "magis-optimize-lat@1.05", "compile"], [0.5])]
    assert names == ["eager", "magis-optimize@0.8", "magis-optimize-lat@1.05", "compile@0.5"]
    for bad, words in [
        ("magis-optimize@1.5", "budget"),
        ("magis-optimize-lat@0.9", "at least 1"),
        ("magis-optimize@lots", "must be a number"),
        ("eager@0.5", "unknown method"),
    ]:
        with pytest.raises(ValueError, match=words):
            variants([bad])


def test_gradients_off_eagers_float32_pass_only_within_its_own_error_against_float64():
    """A method whose float32 gradients differ from eager's (other kernels, a gradient whose
    terms cancel) is judged against the step in float64: float64's gradients rounded to
    float32 pass; one gradient 1% off, far beyond eager's own float32 error, does not."""
    subject = Subject("resnet50", "tiny", 4)
    eager = variants(["eager"], [0.5], subject.batch_size)[0]
    runnable = eager.real(subject)
    _, result = measure_peak(runnable.step, [])
    float32 = {**result.gradients, "<loss>": result.loss}
    exact = _float32_rounding(subject, eager, float32, float32, tolerance=0.0, seed=0)
    assert exact is not None and "float32 rounding" in exact
    truth = subject.once("float64_reference", lambda: None)  # made by the call above
    assert all(t.dtype == torch.float64 for t in truth.values())
    rounded = {name: t.float() for name, t in truth.items()}
    assert _float32_rounding(subject, eager, float32, rounded, 1e-3, 0) is not None
    name = next(n for n in rounded if n.endswith("convolution.weight"))
    wrong = {**rounded, name: rounded[name] * 1.01}
    assert _float32_rounding(subject, eager, float32, wrong, 1e-3, 0) is None


def test_inductor_peer_runs_compiled_with_eagers_gradients_and_its_allocators_peak():
    """``inductor@1`` is ``torch.compile(model)`` as users call it: Inductor's kernels, eager's
    gradients; Inductor allocates below the dispatcher, so its row's peak is the allocator's,
    as a ratio to eager's peak counted so too (convolutions' scratch included), and the row says
    so: at least the weights, the inputs and the gradients it returns."""
    comparison = compare("unet", "tiny", ["eager", "inductor"], [1.0], rounds=Rounds(1, max_repeats=1))
    eager, row = (next(r for r in comparison.rows if r.method == m) for m in ("eager", "inductor@1"))
    assert row.measured and row.max_grad_error < 1e-4
    built = Subject("unet", "tiny").built
    weights = sum(p.nbytes for p in built.model.parameters())
    inputs = sum(t.nbytes for t in built.example_inputs if isinstance(t, torch.Tensor))
    assert row.peak_bytes >= 2 * weights + inputs
    assert "allocator" in row.details["peak"]
    allocated_eager = row.details["eager_allocated_bytes"]
    assert allocated_eager >= eager.peak_bytes  # scratch is counted beside the live tensors
    assert row.peak_ratio == pytest.approx(row.peak_bytes / allocated_eager)
