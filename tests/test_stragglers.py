"""Stragglers only when they stand out from the run's own noise, with the test that decided it.

Generated runs (tests/synthetic.py) whose ground truth says which rank is late in which step; the
generator's jitter is the noise. The binomial p-value is recomputed here from its definition.
"""

from __future__ import annotations

from math import comb

import pytest
from steplens.analyze import pipeline
from synthetic import generate_run


def analyse(run, out) -> dict:
    return pipeline.analyse(run, out, jobs=1)[1]


@pytest.mark.parametrize("ranks", [2, 8])
def test_no_straggler_in_noise(tmp_path, ranks):
    truth = generate_run(tmp_path / "run", ranks=ranks, steps=8, seed=3)
    assert truth["stragglers"] == []
    findings = analyse(tmp_path / "run", tmp_path / "out")
    assert findings["steps"]["stragglers"] == []


def test_one_late_rank_in_one_step_beyond_the_rank_spread(tmp_path):
    truth = generate_run(tmp_path / "run", ranks=8, steps=6, seed=4, stragglers=[(3, 12)])
    findings = analyse(tmp_path / "run", tmp_path / "out")
    assert [(s["rank"], s["step"]) for s in findings["steps"]["stragglers"]] == [(s["rank"], s["step"]) for s in truth["stragglers"]]
    assert findings["steps"]["stragglers"][0]["decided_by"].startswith("beyond_rank_spread: ")


def test_the_same_rank_last_in_every_step(tmp_path):
    """Two ranks: no spread to compare with inside a step, so the evidence is the same rank being last
    step after step. Chance gives 8 of 8 with probability (1/2)^8."""
    first, steps = 10, 8
    generate_run(tmp_path / "run", ranks=2, steps=steps, seed=5, first_step=first, straggler_factor=1.5,
                 stragglers=[(1, s) for s in range(first, first + steps)])
    findings = analyse(tmp_path / "run", tmp_path / "out")
    assert {(s["rank"], s["step"]) for s in findings["steps"]["stragglers"]} == {(1, s) for s in range(first, first + steps)}
    p_value = sum(comb(steps, k) for k in range(steps, steps + 1)) / 2 ** steps
    assert all(s["decided_by"].startswith(f"same_rank_last: rank 1 was last in {steps} of {steps} steps")
               and f"p = {p_value:.2g}" in s["decided_by"] for s in findings["steps"]["stragglers"])


def test_two_ranks_one_late_step_beyond_the_run_noise(tmp_path):
    """Two ranks: nothing to compare with inside the step, but the others' wait in the late step
    dwarfs their wait in every other step of the run."""
    truth = generate_run(tmp_path / "run", ranks=2, steps=6, seed=7, stragglers=[(1, 12)])
    findings = analyse(tmp_path / "run", tmp_path / "out")
    assert [(s["rank"], s["step"]) for s in findings["steps"]["stragglers"]] == [(s["rank"], s["step"]) for s in truth["stragglers"]]
    assert findings["steps"]["stragglers"][0]["decided_by"].startswith("beyond_step_noise: the others waited ")


def test_binomial_tail_matches_the_exact_sum():
    """The p-value's tail, against the exact rational sum of its definition (no scipy, no log space)."""
    from fractions import Fraction

    from steplens.analyze.analyses.steps import binomial_tail

    for n, ranks in ((1, 2), (6, 2), (40, 3), (200, 8), (500, 64)):
        p = Fraction(1, ranks)
        for k in range(0, n + 1, max(1, n // 15)):
            exact = sum(comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))
            assert binomial_tail(k, n, 1 / ranks) == pytest.approx(float(exact), rel=1e-9, abs=1e-300), (n, ranks, k)


def test_wall_time_across_ranks_needs_every_rank_on_one_clock():
    """A rank without a clock offset (no collective to match) was left out of 'wall time across ranks', which came
    out shorter than that rank's own step (94 ms against 95.4). Hand-made: steps 1 and 2 of two ranks."""
    import polars as pl
    from steplens.analyze.analyses import steps

    ms = 1_000_000
    times = pl.DataFrame({"rank": [0, 1, 0, 1], "step": [1, 1, 2, 2], "cpu_dur_ns": [94 * ms, 95 * ms, 50 * ms, 52 * ms],
                          "comm_wait_ns": [0, 0, 0, 0],
                          "aligned_start_ns": [0, None, 100 * ms, 101 * ms],
                          "aligned_end_ns": [94 * ms, None, 150 * ms, 153 * ms]})
    stats = steps.step_stats(times).sort("step")
    assert stats["aligned_dur_ns"].to_list() == [None, 53 * ms]  # step 2: 153 - 100


def test_without_collective_timing_the_longest_step_is_no_straggler():
    """A 2-rank gloo job (no communication kernels): in step 4 rank 1 began 14 ms before rank 0 and both ended
    together, so rank 1's step is 14 ms longer: it waited for rank 0. The longest step was named the straggler
    ('rank 1 ... decided by beyond_step_noise: the others waited 14.3 ms' while others_waited_ns was 0). Hand-made:
    nothing in the step boundaries tells who waited, so nobody is named; the spread stays in step_stats."""
    import polars as pl
    from steplens.analyze.analyses import steps

    ms = 1_000_000
    durations = {0: [50, 51, 50, 52, 50, 51], 1: [51, 50, 51, 51, 64, 50]}
    times = pl.DataFrame([{"rank": rank, "step": step, "cpu_dur_ns": d * ms, "comm_wait_ns": 0,
                           "aligned_start_ns": None, "aligned_end_ns": None}
                          for rank, ds in durations.items() for step, d in enumerate(ds)])
    stats = steps.step_stats(times).sort("step")
    assert stats["straggler_rank"].null_count() == stats.height
    assert stats.filter(pl.col("step") == 4).select("spread_ns", "slowest_rank").row(0) == (14 * ms, 1)
    assert stats["others_waited_ns"].null_count() == stats.height  # no wait was timed: unknown, not 0 ns
    assert steps.straggler_finding(stats) == {"stragglers": []}
