"""The run-level summaries the report and summary.md show, so that `reports/` only renders.

- collective_summary: per collective and message size, with exposed time per rank (the most exposed
  rank's total and the median rank's, never a sum over ranks) and busbw percentiles over calls;
- collective_call_sites: the same per CPU call site;
- category_summary: GPU time per kernel category over the whole run and its share;
- scalar_series: each monitor series, with how many points can go on a global-samples axis.
"""

from __future__ import annotations

import polars as pl

from steplens.analyze.analyses.registry import Analysis, Inputs, Output, declared

COLLECTIVE_SUMMARY = {"op": pl.String, "bytes": pl.Int64, "calls": pl.Int64, "ranks": pl.Int64, "kernel_ns": pl.Int64,
                      "max_rank_exposed_ns": pl.Int64, "max_exposed_rank": pl.Int64, "median_rank_exposed_ns": pl.Int64,
                      "overlapped_ns": pl.Int64, "busbw_median_gbps": pl.Float64, "busbw_p10_gbps": pl.Float64,
                      "busbw_p90_gbps": pl.Float64}
CALL_SITES = {"issuing_op": pl.String, "op": pl.String, "calls": pl.Int64, "max_rank_exposed_ns": pl.Int64,
              "max_exposed_rank": pl.Int64}
CATEGORY_SUMMARY = {"category": pl.String, "kernels": pl.Int64, "time_ns": pl.Int64, "share": pl.Float64}
SCALAR_SERIES = {"origin": pl.String, "name": pl.String, "points": pl.Int64, "ranks": pl.Int64,
                 "aligned_points": pl.Int64}


def summary_tables(collectives: pl.DataFrame, kernel_categories: pl.DataFrame, scalars: pl.DataFrame
                   ) -> dict[str, pl.DataFrame]:
    """collective_summary, collective_call_sites, category_summary and scalar_series (empty tables
    when the run has no such input)."""
    has = {name: not frame.is_empty() and frame.width > 1 for name, frame in
           (("collectives", collectives), ("categories", kernel_categories), ("scalars", scalars))}
    return {
        "collective_summary": collective_summary(collectives) if has["collectives"]
        else pl.DataFrame(schema=COLLECTIVE_SUMMARY),
        "collective_call_sites": _call_sites(collectives) if has["collectives"] else pl.DataFrame(schema=CALL_SITES),
        "category_summary": _categories(kernel_categories) if has["categories"] else pl.DataFrame(schema=CATEGORY_SUMMARY),
        "scalar_series": _series(scalars) if has["scalars"] else pl.DataFrame(schema=SCALAR_SERIES),
    }


def collective_summary(calls: pl.DataFrame) -> pl.DataFrame:
    """Per collective and message size, most exposed first (the verdict's "most exposed communication" is its
    first row)."""
    return _per_rank_exposure(calls, ["op", "bytes"])


def _exposure(calls: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """Per key: the most exposed rank's total exposed time (and which rank), and the median rank's."""
    per_rank = calls.group_by(keys + ["rank"]).agg(exposed_ns=pl.col("exposed_ns").sum())
    return per_rank.group_by(keys).agg(
        max_rank_exposed_ns=pl.col("exposed_ns").max(),
        max_exposed_rank=pl.col("rank").sort_by("exposed_ns", "rank", descending=[True, False]).first(),
        median_rank_exposed_ns=pl.col("exposed_ns").median().round().cast(pl.Int64),
    )


def _per_rank_exposure(calls: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    busbw = pl.col("busbw_gbps")
    totals = calls.group_by(keys).agg(
        calls=pl.len(), ranks=pl.col("rank").n_unique(), kernel_ns=pl.col("dur_ns").sum(),
        overlapped_ns=pl.col("overlapped_ns").sum(), busbw_median_gbps=busbw.median(),
        busbw_p10_gbps=busbw.quantile(0.1, "linear"), busbw_p90_gbps=busbw.quantile(0.9, "linear"))
    return (totals.join(_exposure(calls, keys), on=keys, how="left", nulls_equal=True)
            .sort("max_rank_exposed_ns", "op", descending=[True, False]).select(list(COLLECTIVE_SUMMARY))
            .cast(COLLECTIVE_SUMMARY))


def _call_sites(calls: pl.DataFrame) -> pl.DataFrame:
    keys = ["issuing_op", "op"]
    return (calls.group_by(keys).agg(calls=pl.len()).join(_exposure(calls, keys), on=keys, how="left", nulls_equal=True)
            .sort("max_rank_exposed_ns", "op", descending=[True, False]).select(list(CALL_SITES)).cast(CALL_SITES))


def _categories(categories: pl.DataFrame) -> pl.DataFrame:
    total = categories["time_ns"].sum()
    return (categories.group_by("category").agg(pl.col("kernels", "time_ns").sum())
            .with_columns(share=pl.col("time_ns") / total if total else pl.lit(None, pl.Float64))
            .sort("time_ns", "category", descending=[True, False]).select(list(CATEGORY_SUMMARY)).cast(CATEGORY_SUMMARY))


def _series(scalars: pl.DataFrame) -> pl.DataFrame:
    aligned = pl.col("global_samples").is_not_null() & pl.col("value").is_finite()
    return (scalars.group_by("origin", "name").agg(points=pl.len(), ranks=pl.col("rank").n_unique(),
                                                   aligned_points=aligned.sum())
            .sort("origin", "name").select(list(SCALAR_SERIES)).cast(SCALAR_SERIES))


# ---------------------------------------------------------------------------------------------
# The analysis


def _summaries(inputs: Inputs) -> Output:
    return Output(tables=summary_tables(inputs.table("collectives"), inputs.table("kernel_categories"),
                                        inputs.table("scalars")))


ANALYSIS = Analysis("summaries", "Summaries", ("collectives", "kernel_categories", "scalars"),
                    declared("collective_summary", "collective_call_sites", "category_summary", "scalar_series"), _summaries)
