"""Is a difference between two runs beyond run-to-run noise? The statistics every verdict uses.

One significance level, ALPHA, for every test steplens runs (compare's two-run verdict and the
autotuning / trials ranking in `autotune`).

Two runs, per-step samples (`two_run_verdict`): the relative change of the median, a two-sided
Mann-Whitney U test (no normality assumption; step times are skewed) and a bootstrap interval of the
relative change of the median. A change counts only when the interval excludes zero AND the test
rejects equal distributions at ALPHA; with fewer than MIN_SAMPLES samples per run the verdict is
"not established". Which direction is a regression depends on the metric: more step time, or less
throughput.
"""

from __future__ import annotations

import numpy as np

from steplens.analyze.analyses.rank_test import mann_whitney_u

ALPHA = 0.05
CONFIDENCE = 0.95
# Below this a two-sided rank test cannot reach p < 0.05: U's exact p floor is 0.029 with 4 vs 4
# samples but 0.1 with 3 vs 3, and the bootstrap interval of a median needs a few more.
MIN_SAMPLES = 5
BOOTSTRAP_RESAMPLES = 4000
SEED = 0  # a fixed seed: the same runs give the same interval
TEST_NAME = "mann_whitney_u_two_sided"

METHOD = (f"A change counts only when the {CONFIDENCE:.0%} bootstrap interval ({BOOTSTRAP_RESAMPLES} resamples, "
          f"percentile method) of the relative change of the median excludes zero and a two-sided Mann-Whitney U "
          f"test gives p < {ALPHA}; with fewer than {MIN_SAMPLES} samples per run the comparison is not established.")


def two_run_verdict(base: np.ndarray, new: np.ndarray, higher_is_better: bool = False) -> dict:
    """Median change of `new` against `base` and whether it exceeds the noise.

    Returns base_n, new_n, base_median, new_median, delta (new / base - 1), and, with enough
    samples, test, statistic (U of new against base), p_value, ci_low, ci_high; then verdict
    (regression | improvement | within noise | not established), established (whether the change
    is beyond the noise) and why, in words."""
    # Imported here: scipy.stats (for its bootstrap) is slow to import, and importers reach this module for ALPHA alone.
    from scipy import stats

    b, n = np.asarray(base, dtype=float), np.asarray(new, dtype=float)
    result = {"base_n": len(b), "new_n": len(n),
              "base_median": float(np.median(b)) if len(b) else None,
              "new_median": float(np.median(n)) if len(n) else None, "delta": None,
              "test": None, "statistic": None, "p_value": None, "ci_low": None, "ci_high": None, "established": False}
    if len(b) and len(n) and result["base_median"]:
        result["delta"] = result["new_median"] / result["base_median"] - 1
    if min(len(b), len(n)) < MIN_SAMPLES:
        result.update(verdict="not established",
                      why=f"{len(b)} and {len(n)} samples; a rank test needs at least {MIN_SAMPLES} per run to detect "
                          f"anything at p < {ALPHA}. Record more steps.")
        return result
    statistic, p_value = mann_whitney_u(n, b)
    interval = stats.bootstrap((b, n), _relative_median_change, n_resamples=BOOTSTRAP_RESAMPLES,
                               confidence_level=CONFIDENCE, method="percentile", vectorized=True,
                               rng=np.random.default_rng(SEED)).confidence_interval
    low, high = float(interval.low), float(interval.high)
    result.update(test=TEST_NAME, statistic=float(statistic), p_value=float(p_value), ci_low=low, ci_high=high)
    if not (p_value < ALPHA and (low > 0 or high < 0)):
        result.update(verdict="within noise",
                      why=f"{CONFIDENCE:.0%} interval of the median change {low:+.1%} to {high:+.1%} includes 0 or "
                          f"Mann-Whitney p = {p_value:.3g} >= {ALPHA}")
        return result
    worse = result["delta"] < 0 if higher_is_better else result["delta"] > 0
    result.update(established=True, verdict="regression" if worse else "improvement",
                  why=f"median {result['delta']:+.1%}, {CONFIDENCE:.0%} interval {low:+.1%} to {high:+.1%}, "
                      f"Mann-Whitney U = {statistic:.0f}, p = {p_value:.3g}")
    return result


def _relative_median_change(base, new, axis=-1):
    return np.median(new, axis=axis) / np.median(base, axis=axis) - 1
