"""The measurement protocol: robust ratios with their standard error, rounds that adapt to the
noise, and an allocator that keeps freed memory as PyTorch's CUDA caching allocator does."""

from __future__ import annotations

import math
import resource
import statistics
import subprocess
import sys
import time
from contextlib import AbstractContextManager

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from magis.backend.runtime import StepResult
from yardstick.protocol import Estimate, Rounds, interleaved_timings

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@given(st.lists(finite, min_size=2, max_size=40))
def test_untrimmed_mean_has_the_textbook_standard_error(values):
    estimate = Estimate.trimmed_mean(values, trim=0.0)
    assert estimate.value == pytest.approx(statistics.fmean(values), abs=1e-6)
    assert estimate.stderr == pytest.approx(statistics.stdev(values) / math.sqrt(len(values)), abs=1e-6)


@given(st.lists(finite, min_size=5, max_size=40), st.floats(min_value=1e7, max_value=1e9))
@example([0.0, *[3.508602172744969e-43] * 5], 1e7)  # the mean of five equal subnormals rounds past them
def test_trimmed_mean_is_the_mean_of_the_middle_and_ignores_one_outlier(values, outlier):
    data = sorted(values)
    cut = int(0.2 * len(data))
    estimate = Estimate.trimmed_mean(values, trim=0.2)
    assert estimate.value == pytest.approx(statistics.fmean(data[cut : len(data) - cut]), abs=1e-6)
    with_outlier = Estimate.trimmed_mean([*values, outlier], trim=0.2)
    rounding = 1e-9 * max(1.0, abs(data[0]), abs(data[-1]))  # a mean of equal values may round past them
    assert data[0] - rounding <= with_outlier.value <= data[-1] + rounding


def test_yuen_standard_error_by_hand():
    # n = 10, trim 0.2: two values cut at each end, h = 6 kept. Winsorized: the two
    # lowest become the third lowest (3), the two highest the third highest (8).
    values = [1, 2, 3, 4, 5, 6, 7, 8, 50, 100]
    winsorized = [3, 3, 3, 4, 5, 6, 7, 8, 8, 8]
    estimate = Estimate.trimmed_mean(values, trim=0.2)
    assert estimate.value == pytest.approx(statistics.fmean([3, 4, 5, 6, 7, 8]))
    assert estimate.stderr == pytest.approx(math.sqrt(9 * statistics.variance(winsorized) / (6 * 5)))


def test_one_value_has_an_unknown_standard_error():
    assert Estimate.trimmed_mean([1.0]).stderr == math.inf
    with pytest.raises(ValueError, match="no values"):
        Estimate.trimmed_mean([])
    with pytest.raises(ValueError, match="trim"):
        Estimate.trimmed_mean([1.0, 2.0], trim=0.5)


def _busy(seconds: float) -> None:
    """Spend ``seconds`` of CPU time: the protocol's clock with one thread, and wall time anyway."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _steps(calls: dict[str, int]):
    """A reference, a method doing the same work and one whose time swings 30-fold from step to step."""

    def step(name: str, seconds):
        def run(_scope: AbstractContextManager) -> StepResult:
            calls[name] = calls.get(name, 0) + 1
            _busy(seconds(calls[name]))
            return StepResult(None, {}, {})

        return run

    return {
        "ref": step("ref", lambda _n: 0.002),
        "same": step("same", lambda _n: 0.002),
        "noisy": step("noisy", lambda n: 0.001 if n % 2 else 0.03),
    }


def test_rounds_continue_only_for_methods_whose_ratio_is_not_yet_precise(one_thread):
    calls: dict[str, int] = {}
    rounds = Rounds(repeats=3, warmup=1, max_repeats=6, precision=0.2)
    timings = interleaved_timings(_steps(calls), "ref", rounds)
    assert len(timings["same"].ratios) == 3  # precise after the minimum
    assert len(timings["noisy"].ratios) == 6  # 30-fold swings never get within 20%
    assert calls == {"ref": 4 * 3 + 3 * 2, "same": 4, "noisy": 7}  # warm-up included
    assert len(timings["ref"].samples) == 3 * 3 + 3 * 2
    assert timings["same"].ratio.value == pytest.approx(1.0, rel=0.2)
    assert timings["ref"].ratio == Estimate(1.0, 0.0)


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"repeats": 0}, "repeats"), ({"repeats": 5, "max_repeats": 4}, "max_repeats"), ({"precision": 0}, "precision")],
)
def test_bad_rounds_are_refused(fields, named):
    with pytest.raises(ValueError, match=named):
        Rounds(**fields)


def test_max_repeats_defaults_to_at_least_repeats():
    assert Rounds(repeats=30).max_repeats == 30
    assert Rounds(repeats=2).max_repeats > 2


_PAGE_FAULTS_OF_A_FRESH_BLOCK = """
import resource, sys, torch
from yardstick.protocol import keep_freed_memory
kept = sys.argv[1] == "keep" and keep_freed_memory()
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(2**24)  # 64 MiB: above every mmap threshold glibc would pick itself
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del block
print(int(kept), max(faults[3:]))
"""


@pytest.mark.parametrize("mode", ["keep", "system"])
def test_kept_freed_memory_spares_the_page_faults_of_the_next_step(mode):
    """Once freed memory is kept, a block allocated again touches no fresh page; otherwise every page faults.

    The first allocations still map memory: a block freed in the middle of the heap
    is reused only once the blocks next to it are free too, so the check starts
    from the fourth allocation (a benchmark's warm-up round does the same).
    """
    done = subprocess.run(
        [sys.executable, "-c", _PAGE_FAULTS_OF_A_FRESH_BLOCK, mode], capture_output=True, text=True, check=True
    )
    kept, faults = map(int, done.stdout.split())
    pages = 2**26 // resource.getpagesize()
    if mode == "keep" and not kept:
        pytest.skip("the C library has no mallopt (not glibc)")
    if kept:
        assert faults < pages // 100, faults
    else:
        assert faults >= pages * 0.9, faults
