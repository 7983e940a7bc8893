"""The Mann-Whitney U test steplens computes itself, against scipy.stats.mannwhitneyu (the definition it follows)
and against hand-counted cases; and an `analyze` of a run whose verdict uses it never imports scipy."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import mannwhitneyu

from steplens.analyze.analyses.rank_test import mann_whitney_u

SAMPLE = Path(__file__).resolve().parents[1] / "sample_runs" / "deepspeed_cpu_2rank"


def test_hand_counted_cases():
    # 1,2,3 against 4,5,6: every one of the C(6,3) = 20 orderings equally likely; only this one and its mirror are
    # as extreme, so the two-sided p is 2/20; x wins no pair (U1 = 0)
    assert mann_whitney_u([1, 2, 3], [4, 5, 6]) == (0.0, 0.1)
    # one-sided: x smaller than y is the one ordering in 20
    assert mann_whitney_u([1, 2, 3], [4, 5, 6], "less") == (0.0, 0.05)
    assert mann_whitney_u([1, 2, 3], [4, 5, 6], "greater") == (0.0, 1.0)
    # 1,4 against 2,3: x wins 2 of the 4 pairs; U >= 2 in 4 of the C(4,2) = 6 orderings (U = 0,1,2,2,3,4)
    assert mann_whitney_u([1, 4], [2, 3], "greater") == (2.0, 4 / 6)
    # every value equal: nothing to tell apart
    assert mann_whitney_u([3, 3, 3], [3, 3]) == (3.0, 1.0)


def test_large_samples_by_the_normal_approximation():
    # 10 vs 10, no ties, x all above y: U1 = 100; z = (100 - 50 - 0.5) / sqrt(10 x 10 x 21 / 12)
    z = 49.5 / math.sqrt(100 * 21 / 12)
    u1, p = mann_whitney_u(list(range(10, 20)), list(range(10)))
    assert u1 == 100.0 and p == pytest.approx(math.erfc(z / math.sqrt(2)), rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_agrees_with_scipy(seed):
    rng = np.random.default_rng(seed)
    for trial in range(300):
        n1, n2 = (int(n) for n in rng.integers(1, 14, 2))
        if trial % 3 == 0:  # ties: the asymptotic branch with the tie correction (or exact, asked for)
            x, y = rng.integers(0, 5, n1).astype(float), rng.integers(0, 5, n2).astype(float)
        else:
            x, y = rng.normal(0, 1, n1), rng.normal(0.7, 1, n2)
        for alternative in ("two-sided", "greater", "less"):
            for method in ("auto", "exact"):
                expected = mannwhitneyu(x, y, alternative=alternative, method=method)
                u1, p = mann_whitney_u(x, y, alternative, method)
                assert u1 == expected.statistic
                assert p == pytest.approx(expected.pvalue, rel=1e-9, abs=1e-300), (x, y, alternative, method)


def test_exact_with_one_large_sample():
    # scipy's exact branch (the smaller sample has at most 8 values) over a long run of steps
    rng = np.random.default_rng(7)
    x, y = rng.normal(0, 1, 6), rng.normal(0.3, 1, 1500)
    assert mann_whitney_u(x, y)[1] == pytest.approx(mannwhitneyu(x, y).pvalue, rel=1e-9)


def test_analyze_of_a_run_with_profiler_windows_does_not_import_scipy(tmp_path):
    """The bundled collector run has steps on both sides of its profiler windows, so its profiler after-effect is
    tested; importing scipy.stats for that cost about 0.55 s of CPU a run."""
    run = shutil.copytree(SAMPLE, tmp_path / "run")
    script = ("import sys\n"
              "from steplens.analyze import cli\n"
              f"sys.argv = ['analyze', {str(run)!r}, '-q']\n"
              "try:\n"
              "    cli.analyze_entry()\n"
              "except SystemExit as e:\n"
              "    print('exit', e.code)\n"
              "print(sorted({m.split('.')[0] for m in sys.modules} & {'scipy'}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines()[-2:] == ["exit 0", "[]"], done.stderr[-2000:]
    effect = json.loads((run / ".steplens" / "findings.json").read_text())["profiler_after_effect"]
    assert effect["steps_before"] >= 3 and effect["steps_after"] >= 3 and effect["p_value"] is not None
