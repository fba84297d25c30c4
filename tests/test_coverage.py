"""The CI sample of the coverage sweep (yardstick.coverage): architectures chosen over a full
sweep to hold the most distinct operators together, each captured, run and compared with eager."""

from __future__ import annotations

import pytest

from yardstick.coverage import SAMPLE, Architecture, Summary, Verdict, architectures, check, choose_sample, shrink

pytest.importorskip("transformers")
pytest.importorskip("diffusers")


def test_the_registries_are_swept_once_per_class():
    found = architectures()
    assert len(found) > 300
    assert len({(a.task, a.class_name) for a in found}) == len(found)
    assert {a.class_name for a in found if a.task == "diffusion"} == {
        "UNet2DModel",
        "UNet2DConditionModel",
        "AutoencoderKL",
    }
    # a newer transformers may retire a class: most of the sample must still be there
    assert len({a.name for a in found} & SAMPLE) >= 0.75 * len(SAMPLE)


def test_shrink_makes_a_default_configuration_small():
    import transformers

    config = shrink(transformers.AutoConfig.for_model("llama"))
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 2, 128)
    assert config.num_attention_heads % config.num_key_value_heads == 0


@pytest.fixture(scope="module")
def sample() -> list[Verdict]:
    return [check(a, plan=True) for a in architectures() if a.name in SAMPLE]


def test_the_sample_trains_like_eager(sample: list[Verdict]):
    """Every sampled architecture passes all four checks: captured, the same gradients as
    eager PyTorch's for the same parameters, simulated peak = measured peak, and the plan a
    user gets within 10% more time runs with eager's gradients."""
    summary = Summary(sample)
    assert summary.count("wrong") == 0, summary.causes("wrong")
    assert summary.count("pass") == len(sample), {v.architecture: v.cause for v in sample if v.status != "pass"}
    for verdict in sample:
        assert verdict.missing_gradients == verdict.extra_gradients == []
        assert abs(verdict.simulated_peak_bytes - verdict.measured_peak_bytes) <= 0.02 * verdict.measured_peak_bytes
        assert verdict.plan_grad_error is not None and verdict.plan_peak_ratio <= 1.0 + 1e-9


def test_an_unsupported_construct_is_refused_with_its_cause():
    """A data-dependent output shape (T5Gemma 2's nonzero) is named, not captured wrongly."""
    arch = next((a for a in architectures() if a.class_name == "T5Gemma2ForConditionalGeneration"), None)
    if arch is None:
        pytest.skip("this transformers has no T5Gemma 2")
    verdict = check(arch)
    assert verdict.status == "refused"
    assert "data-dependent output shape" in verdict.cause and "nonzero" in verdict.cause


def test_choose_sample_is_greedy_maximum_coverage():
    def v(name: str, ops: list[str], nodes: int) -> Verdict:
        return Verdict(name, "t", "pass", nodes=nodes, ops=ops)

    verdicts = [v("a", ["x", "y"], 10), v("b", ["x", "y", "z"], 50), v("c", ["w"], 5), v("d", ["x"], 1)]
    assert choose_sample(verdicts, 5) == ["b", "c"]  # d adds nothing once b is in
    assert choose_sample(verdicts, 1) == ["b"]
    tie = [v("big", ["p"], 9), v("small", ["p"], 3)]
    assert choose_sample(tie, 1) == ["small"]
    assert Architecture("t", "m", "C").name == "C (t)"
