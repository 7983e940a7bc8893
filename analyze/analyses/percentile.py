"""Percentiles, one definition for every table and sentence: the nearest rank, the ceil(p/100 x n)-th smallest
value (Hyndman & Fan 1996, definition 1 without interpolation). It is always a value that was observed, and the p90
of a few calls is their slowest one, not a point between the two slowest. Integer arithmetic: ceil(p x n / 100)
is (p x n + 99) // 100, exact for every n.
"""

from __future__ import annotations

import polars as pl


def nearest_rank(values: list, percent: int):
    """The `percent`-th percentile of `values` (not empty) by nearest rank."""
    ordered = sorted(values)
    return ordered[max((percent * len(ordered) + 99) // 100, 1) - 1]


def nearest_rank_expr(column: str, percent: int) -> pl.Expr:
    """The `percent`-th percentile of `column`'s non-null values by nearest rank, as an aggregation (null when
    there are none)."""
    values = pl.col(column).drop_nulls()
    rank = ((values.len().cast(pl.Int64) * percent + 99) // 100).clip(lower_bound=1)
    return values.sort().get(rank - 1, null_on_oob=True)
