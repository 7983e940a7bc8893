"""The run-level summaries the report and summary.md show, so that `reports/` only renders.

- collective_summary: per collective and message size, with exposed time per rank (the most exposed
  rank's total and the median rank's, never a sum over ranks) and busbw percentiles over calls;
- collective_call_sites: the same per CPU call site;
- category_summary: GPU time per kernel category over the whole run and its share;
- scalar_series: each monitor series, with how many points can go on a global-samples axis.
"""

from __future__ import annotations

import polars as pl
import pyarrow as pa

from steplens.analyze.analyses.registry import Analysis, Inputs, Output, conformed
from steplens.analyze.analyses.percentile import nearest_rank_expr
from steplens.analyze.contract import schema

COLLECTIVE_SUMMARY = schema.table_spec(
    ("op", pa.string(), "Collective."),
    ("bytes", pa.int64(), "nccl-tests message size S (null: not in the trace)."),
    ("calls", pa.int64(), "Calls over all ranks."),
    ("ranks", pa.int64(), "Ranks that ran it."),
    ("kernel_ns", pa.int64(), "Summed kernel time over all ranks."),
    ("max_rank_exposed_ns", pa.int64(), "Exposed time (not overlapped by compute) of the rank where it was most "
                                        "exposed."),
    ("max_exposed_rank", pa.int64(), "That rank."),
    ("median_rank_exposed_ns", pa.int64(), "Median over ranks of each rank's exposed time."),
    ("overlapped_ns", pa.int64(), "Kernel time hidden behind compute, all ranks."),
    ("busbw_median_gbps", pa.float64(), "Median busbw over calls, GB/s."),
    ("busbw_p10_gbps", pa.float64(), "10th percentile (nearest rank: analyze/analyses/percentile.py)."),
    ("busbw_p90_gbps", pa.float64(), "90th percentile (nearest rank)."),
)

COLLECTIVE_CALL_SITES = schema.table_spec(
    ("issuing_op", pa.string(), "CPU op, annotation or Python frame that issued the collective."),
    ("op", pa.string(), "Collective."),
    ("calls", pa.int64(), "Calls over all ranks."),
    ("max_rank_exposed_ns", pa.int64(), "Exposed time of the most exposed rank."),
    ("max_exposed_rank", pa.int64(), "That rank."),
)

CATEGORY_SUMMARY = schema.table_spec(
    ("category", pa.string(), "Kernel family (kernel_categories)."),
    ("kernels", pa.int64(), "Activities, all ranks and steps."),
    ("time_ns", pa.int64(), "Summed GPU time, all ranks (streams may overlap)."),
    ("share", pa.float64(), "time_ns / all categories' time_ns."),
)

SCALAR_SERIES = schema.table_spec(
    ("origin", pa.string(), "Where the series came from (collector, csv_monitor, tensorboard, wandb, log)."),
    ("name", pa.string(), "Scalar tag."),
    ("points", pa.int64(), "Points."),
    ("ranks", pa.int64(), "Ranks that logged it."),
    ("aligned_points", pa.int64(), "Points with a global-samples x and a finite value (the ones a curve can show)."),
)


def summary_tables(collectives: pl.DataFrame, kernel_categories: pl.DataFrame, scalars: pl.DataFrame
                   ) -> dict[str, pl.DataFrame]:
    """collective_summary, collective_call_sites, category_summary and scalar_series (empty when the run has no
    such input: the runner writes the declared table, typed and empty)."""
    has = {name: not frame.is_empty() and frame.width > 1 for name, frame in
           (("collectives", collectives), ("categories", kernel_categories), ("scalars", scalars))}
    return {
        "collective_summary": collective_summary(collectives) if has["collectives"] else pl.DataFrame(),
        "collective_call_sites": _call_sites(collectives) if has["collectives"] else pl.DataFrame(),
        "category_summary": _categories(kernel_categories) if has["categories"] else pl.DataFrame(),
        "scalar_series": _series(scalars) if has["scalars"] else pl.DataFrame(),
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
        busbw_p10_gbps=nearest_rank_expr("busbw_gbps", 10), busbw_p90_gbps=nearest_rank_expr("busbw_gbps", 90))
    return (totals.join(_exposure(calls, keys), on=keys, how="left", nulls_equal=True)
            .sort("max_rank_exposed_ns", "op", descending=[True, False]).pipe(conformed, COLLECTIVE_SUMMARY, "collective_summary"))


def _call_sites(calls: pl.DataFrame) -> pl.DataFrame:
    keys = ["issuing_op", "op"]
    return (calls.group_by(keys).agg(calls=pl.len()).join(_exposure(calls, keys), on=keys, how="left", nulls_equal=True)
            .sort("max_rank_exposed_ns", "op", descending=[True, False])
            .pipe(conformed, COLLECTIVE_CALL_SITES, "collective_call_sites"))


def _categories(categories: pl.DataFrame) -> pl.DataFrame:
    total = categories["time_ns"].sum()
    return (categories.group_by("category").agg(pl.col("kernels", "time_ns").sum())
            .with_columns(share=pl.col("time_ns") / total if total else pl.lit(None, pl.Float64))
            .sort("time_ns", "category", descending=[True, False]).pipe(conformed, CATEGORY_SUMMARY, "category_summary"))


def _series(scalars: pl.DataFrame) -> pl.DataFrame:
    aligned = pl.col("global_samples").is_not_null() & pl.col("value").is_finite()
    return (scalars.group_by("origin", "name").agg(points=pl.len(), ranks=pl.col("rank").n_unique(),
                                                   aligned_points=aligned.sum())
            .sort("origin", "name").pipe(conformed, SCALAR_SERIES, "scalar_series"))


# ---------------------------------------------------------------------------------------------
# The analysis


def _summaries(inputs: Inputs) -> Output:
    return Output(tables=summary_tables(inputs.table("collectives"), inputs.table("kernel_categories"),
                                        inputs.table("scalars")))


ANALYSIS = Analysis("summaries", "Summaries", ("collectives", "kernel_categories", "scalars"),
                    {"collective_summary": COLLECTIVE_SUMMARY, "collective_call_sites": COLLECTIVE_CALL_SITES,
                     "category_summary": CATEGORY_SUMMARY, "scalar_series": SCALAR_SERIES}, _summaries)
