"""Rockmate 2.0 as an opt-in, measured-only peer: eager's gradients where it can run, a reason where not."""

from __future__ import annotations

import contextlib

import pytest
import torch

from magis.backend.eager import eager_step, max_relative_error
from yardstick.methods import METHODS, MethodUnavailable, Subject, Variant, variants
from yardstick.peers.rockmate import unavailable_reason


def test_rockmate_is_opt_in_and_says_why_it_cannot_run():
    assert "rockmate@0.5" not in [v.name for v in variants(None, [0.5])]
    assert [v.name for v in variants(["rockmate"], [0.5, 0.3])] == ["eager", "rockmate@0.5", "rockmate@0.3"]
    subject = Subject("btlm-3b", "tiny")
    with pytest.raises(MethodUnavailable, match="measured only"):
        Variant(METHODS["rockmate"], 0.5).simulate(subject)
    reason = unavailable_reason()
    if reason is not None:
        with pytest.raises(MethodUnavailable, match=r"rockmate|CUDA"):
            Variant(METHODS["rockmate"], 0.5).real(subject)


@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
def test_rockmate_computes_eagers_gradients_on_the_gpu():
    """Eager on the same GPU is the reference (the CPU's float32 sums differ in the last bits)."""
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    subject = Subject("btlm-3b", "tiny")
    try:
        runnable = Variant(METHODS["rockmate"], 0.5).real(subject)
    except MethodUnavailable as err:  # Rockmate's own tracer failed: said, never a wrong step
        assert "Rockmate failed" in str(err)
        pytest.xfail(f"Rockmate does not run this model here: {err}")
    got = runnable.step(contextlib.nullcontext())
    built = runnable.built
    want = eager_step(built.model, built.example_inputs, built.loss_fn)
    want_grads = {**{n: g.cpu() for n, g in want.gradients.items()}, "<loss>": want.loss.cpu()}
    assert set(got.gradients) == set(want.gradients)
    assert max_relative_error(want_grads, {**got.gradients, "<loss>": got.loss}) < 1e-4
    details = Variant(METHODS["rockmate"], 0.5).details(subject)
    assert details is not None and details["rockmate_budget_bytes"] > 0
