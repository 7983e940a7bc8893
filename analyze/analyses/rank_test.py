"""The Mann-Whitney U test, as scipy.stats.mannwhitneyu computes it (scipy 1.17, method "auto" or "exact").

Written out because importing scipy.stats costs about 0.55 s of CPU, a quarter of `analyze` on a collector run
whose only use of it is this one test (the profiler after-effect). Same definitions as scipy's
(scipy/stats/_mannwhitneyu.py): U1 = R1 - n1 (n1 + 1) / 2 from average ranks; the exact null distribution when
the samples have no ties and at most one has more than 8 values, else the normal approximation with the tie
correction and a continuity correction of 0.5; a two-sided p is twice the one-sided one, at most 1.
tests/test_rank_test.py checks it against scipy on random samples. Its callers give it samples of at least one
value each, none NaN (scipy answers NaN there).
"""

from __future__ import annotations

import math

import numpy as np

EXACT_MAX_SIZE = 8  # scipy's `_mwu_choose_method`: exact unless both samples are larger than this, or there are ties


def mann_whitney_u(x, y, alternative: str = "two-sided", method: str = "auto") -> tuple[float, float]:
    """(U1, p): U1 is x's statistic (the number of pairs in which x's value is the larger, ties counting a half);
    `alternative` "greater" asks whether x tends to be larger than y, "less" smaller; `method` "auto" or "exact"."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n1, n2 = len(x), len(y)
    ranks, tie_sizes = _average_ranks(np.concatenate([x, y]))
    u1 = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2)
    u2 = n1 * n2 - u1
    u, factor = {"greater": (u1, 1), "less": (u2, 1), "two-sided": (max(u1, u2), 2)}[alternative]
    ties = bool((tie_sizes > 1).any())
    if method == "auto":
        method = "asymptotic" if (n1 > EXACT_MAX_SIZE and n2 > EXACT_MAX_SIZE) or ties else "exact"
    if method == "exact":
        # scipy truncates a tied (half-integer) U to an integer here: P(U >= floor(U)), the conservative side
        p = _exact_sf(int(u), n1, n2)
    else:
        p = _normal_sf(u, n1, n2, tie_sizes)
    return u1, min(max(factor * p, 0.0), 1.0)


def _average_ranks(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ranks from 1, tied values sharing their average rank; and the size of each group of equal values."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    sizes = np.diff(np.r_[starts, len(values)])
    ranks = np.empty(len(values))
    ranks[order] = np.repeat(starts + (sizes + 1) / 2, sizes)
    return ranks, sizes


def _normal_sf(u: float, n1: int, n2: int, tie_sizes: np.ndarray) -> float:
    """P(U >= u) by the normal approximation, tie-corrected variance, continuity correction."""
    n = n1 + n2
    tie_term = float((tie_sizes.astype(float) ** 3 - tie_sizes).sum())
    sd = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1)))) if n > 1 else 0.0
    excess = u - n1 * n2 / 2 - 0.5
    if sd == 0:  # every value equal: nothing tells the samples apart
        return 1.0 if excess <= 0 else 0.0
    return 0.5 * math.erfc(excess / sd / math.sqrt(2))


def _exact_sf(u: int, n1: int, n2: int) -> float:
    """P(U >= u) under the null, from the number of orderings with each U: the coefficients of the Gaussian
    binomial [n1 + n2 choose n1]_q, built as the product over i = 1..m of (1 - q^(k + i)) / (1 - q^i), exactly in
    integers (m the smaller size, k the larger)."""
    m, k = min(n1, n2), max(n1, n2)
    counts = np.zeros(m * k + 1, dtype=object)
    counts[0] = 1
    for i in range(1, m + 1):
        shift = k + i
        if shift < len(counts):
            counts[shift:] = counts[shift:] - counts[:-shift]
        for start in range(i):  # dividing by (1 - q^i): a running sum over every i-th coefficient
            counts[start::i] = np.cumsum(counts[start::i])
    if u <= 0:
        return 1.0
    if u > m * k:
        return 0.0
    return int(counts[u:].sum()) / math.comb(n1 + n2, n1)
