"""Interval helpers against brute force."""

import numpy as np

from steplens.analyze.trace import intervals


def _nested(rng, n):
    """Random properly nested intervals (a random tree), sorted by start, outermost first on ties."""
    spans = []

    def grow(lo, hi, depth):
        t = lo
        while t < hi and len(spans) < n:
            length = int(rng.integers(0, max(1, (hi - t) // 2) + 1))
            spans.append((t, t + length))
            if depth < 6 and length > 2:
                grow(t, t + length, depth + 1)
            t += length + int(rng.integers(0, 3))

    grow(0, 100_000, 0)
    spans.sort(key=lambda s: (s[0], -s[1]))
    return np.array([s[0] for s in spans]), np.array([s[1] for s in spans])


def test_innermost_container_matches_brute_force():
    rng = np.random.default_rng(0)
    starts, ends = _nested(rng, 3000)
    lo = rng.integers(0, 100_000, 500)
    hi = lo + rng.integers(0, 50, 500)
    got = intervals.innermost_container(starts, ends, lo, hi)
    for q, (a, b) in enumerate(zip(lo, hi)):
        containing = [i for i in range(len(starts)) if starts[i] <= a and ends[i] >= b]
        assert got[q] == (containing[-1] if containing else -1)


def test_union_and_covered():
    s, e = intervals.union(np.array([0, 5, 20, 6]), np.array([10, 8, 30, 12]))
    assert s.tolist() == [0, 20] and e.tolist() == [12, 30]
    assert intervals.covered(s, e, np.array([0, 10, 15, 25]), np.array([5, 25, 18, 40])).tolist() == [5, 7, 0, 5]
