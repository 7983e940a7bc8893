"""Statistics of the calls DeepSpeed's comms logger timed (`comms_calls` from logs and dumps).

The comms logger wraps every op in `timed_op` (deepspeed/comm/comm.py), which synchronizes the
device before and after it, so each latency includes waiting for the slowest rank and the op never
overlaps compute: these are per-op costs under the logger, not the job's free-running throughput.

One rank's calls may arrive twice (its verbose log lines and its comms_dict_raw dump); per rank only
one source is used (the dump first), so no call is counted twice.
"""

from __future__ import annotations

import polars as pl
import pyarrow as pa

from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.analyses.percentile import nearest_rank_expr
from steplens.analyze.analyses.step_time import earlier_recording
from steplens.analyze.contract.units import binary_bytes, duration
from steplens.analyze.contract import schema

# A call within a group of one rank moves nothing: its latency is the synchronizing timer waiting for the device work
# queued before it. Such calls have no bus bandwidth and rank after every real one.
NO_OP = pl.col("group_size").fill_null(2) <= 1
CAVEAT = ("timed by DeepSpeed's comms logger, which synchronizes around every op: latency includes waiting "
          "for the slowest rank and nothing overlaps; not free-running throughput")


def one_source_per_rank(calls: pl.DataFrame) -> pl.DataFrame:
    """Keep, for each rank, one source: a comms dump (.json: exact sizes, unrounded latencies) before
    a log (sizes and times rounded as printed), then the one with the most calls, then by name.
    A rank the collector measured (latency_origin measured) keeps all of those and nothing else: its
    flushed parts are pieces of one record, and the comms logger timed the same calls."""
    measured = calls.filter(pl.col("latency_origin") == "measured")
    calls = calls.join(measured.select("rank").unique(), on="rank", how="anti", nulls_equal=True)
    counts = calls.group_by("rank", "source").len().with_columns(dump=pl.col("source").str.ends_with(".json"))
    counts = counts.sort(["rank", "dump", "len", "source"], descending=[False, True, True, False])
    chosen = counts.unique("rank", keep="first", maintain_order=True).select("rank", "source")
    return pl.concat([measured, calls.join(chosen, on=["rank", "source"], how="semi", nulls_equal=True)])


def comms_log_stats(comms_calls: pl.DataFrame) -> pl.DataFrame:
    """comms_calls -> one row per (op, nccl_bytes, group_size): calls, ranks, median/p90/total latency,
    median algbw/busbw (nccl-tests GB/s), how the latencies were obtained, and the caveat."""
    calls = one_source_per_rank(comms_calls)
    stats = calls.group_by("op", "nccl_bytes", "group_size").agg(
        pl.col("msg_bytes").first(),
        calls=pl.len(),
        ranks=pl.col("rank").n_unique(),
        median_latency_ns=pl.col("latency_ns").median().round().cast(pl.Int64),
        p90_latency_ns=nearest_rank_expr("latency_ns", 90),
        total_latency_ns=pl.col("latency_ns").sum(),
        median_algbw_gbps=pl.col("algbw_gbps").median(),
        median_busbw_gbps=pl.col("busbw_gbps").filter(~NO_OP).median(),  # rows written before the rule carry 0
        latency_origin=pl.col("latency_origin").unique().sort().str.join(","),
        synchronized=pl.col("synchronized").any(),
    )
    # Each rank's own median: a rank that reaches a collective early times its wait for the last one too, so the
    # rank whose median is lowest is the nearest to the op itself, and the others' excess is waiting. Only ranks that
    # timed at least half as many calls as the rank that timed most are compared (a stray call is no rank's
    # median), and at least two of them.
    keys = ["op", "nccl_bytes", "group_size"]
    per_rank = calls.group_by(*keys, "rank").agg(
        rank_calls=pl.len(), rank_latency_ns=pl.col("latency_ns").median(),
        rank_busbw_gbps=pl.col("busbw_gbps").filter(~NO_OP).median())
    per_rank = per_rank.filter((2 * pl.col("rank_calls") >= pl.col("rank_calls").max().over(keys))
                               & pl.col("rank_latency_ns").is_not_null())
    per_rank = per_rank.filter(pl.len().over(keys) >= 2)
    least = per_rank.sort(*keys, "rank_latency_ns", "rank").group_by(keys, maintain_order=True).agg(
        least_wait_rank=pl.col("rank").first(),
        least_wait_median_latency_ns=pl.col("rank_latency_ns").first().round().cast(pl.Int64),
        least_wait_median_busbw_gbps=pl.col("rank_busbw_gbps").first(),
        most_wait_median_latency_ns=pl.col("rank_latency_ns").max().round().cast(pl.Int64))
    stats = stats.join(least, on=keys, how="left", nulls_equal=True)
    caveat = pl.when(pl.col("synchronized")).then(pl.lit(CAVEAT)).otherwise(pl.lit(None, pl.String))
    return stats.with_columns(caveat=caveat).sort(NO_OP, pl.col("total_latency_ns"), descending=[False, True]).select(
        "op", "msg_bytes", "nccl_bytes", "group_size", "calls", "ranks", "median_latency_ns", "p90_latency_ns",
        "total_latency_ns", "median_algbw_gbps", "median_busbw_gbps", "least_wait_rank", "least_wait_median_latency_ns",
        "least_wait_median_busbw_gbps", "most_wait_median_latency_ns", "latency_origin", "synchronized", "caveat",
    )


def costliest_finding(stats: pl.DataFrame) -> dict | None:
    """The logged collective and size that cost the most time."""
    if stats.is_empty():
        return None
    top = stats.sort(NO_OP, pl.col("total_latency_ns"), descending=[False, True]).row(0, named=True)
    return {**{k: top[k] for k in ("op", "nccl_bytes", "calls", "median_latency_ns", "total_latency_ns",
                                   "median_busbw_gbps", "latency_origin", "group_size", "synchronized",
                                   "least_wait_rank", "least_wait_median_latency_ns", "least_wait_median_busbw_gbps",
                                   "most_wait_median_latency_ns")},
            "no_op": (top["group_size"] or 2) <= 1}


# ---------------------------------------------------------------------------------------------
# What it says


def logged_lines(logged: dict, findings: dict) -> list[str]:
    """The logged collective and size that cost most (the comms logger's synchronizing timers: a per-op cost,
    not throughput)."""
    busbw = logged["median_busbw_gbps"]
    if logged.get("no_op"):
        return [f"Logged comms: every call was within a group of one rank ({logged['op']} of "
                f"{binary_bytes(logged['nccl_bytes'])}: {duration(logged['total_latency_ns'])} over {logged['calls']} calls): "
                "nothing crossed a link, no bus bandwidth; the synchronizing timers measured the wait for queued "
                "device work."]
    # the size as the logs print it, to two figures (DeepSpeed's "3.3 MB" is no exact byte count; the table has
    # the collector's exact ones)
    timing = (f"latencies {logged['latency_origin']}; "
              + ("synchronizing timers" if logged.get("synchronized") else "each call timed on its own")
              + ": per-op cost, not throughput")
    least, most = logged.get("least_wait_median_latency_ns"), logged.get("most_wait_median_latency_ns")
    if least and most and most > WAITING_RATIO * least:  # one rank's median is mostly waiting for the others
        busbw = logged.get("least_wait_median_busbw_gbps")
        return [f"Logged comms: {logged['op']} of {binary_bytes(logged['nccl_bytes'])} costs most, "
                f"{duration(logged['total_latency_ns'])} over {logged['calls']} calls, mostly waiting: the median call "
                f"takes {duration(least)} on rank {logged['least_wait_rank']}, the rank that waits least (nearest the "
                + (f"op's own time, busbw {busbw:.2f} GB/s" if busbw is not None else "op's own time")
                + f"), and {duration(most)} on the rank that waits most, which reaches it early and waits for a later "
                f"one (each a rank's median call; {timing})."]
    return [f"Logged comms: {logged['op']} of {binary_bytes(logged['nccl_bytes'])} costs most, "
            f"{duration(logged['total_latency_ns'])} over {logged['calls']} calls (median "
            f"{duration(logged['median_latency_ns'])}" + (f", busbw {busbw:.2f} GB/s" if busbw is not None else "")
            + f"; {timing})."]


# One rank's median call this many times another's: the difference is waiting for a late rank, not the collective.
WAITING_RATIO = 2


# ---------------------------------------------------------------------------------------------
# The analysis


def _comms_log(inputs: Inputs) -> Output:
    calls = inputs.table("comms_calls")
    # an earlier job's calls in the same folder (a job run again, resumed from an earlier checkpoint) are not this one's
    calls = calls.filter(~earlier_recording(inputs.table("train_steps"), calls, "ts_ns"))
    table = comms_log_stats(calls) if not calls.is_empty() else pl.DataFrame()
    return Output(tables={"comms_log_stats": table}, finding=costliest_finding(table))


COMMS_LOG_STATS = schema.table_spec(
    ("op", pa.string(), "DeepSpeed comm op (log_name), e.g. all_reduce, all_gather_into_tensor."),
    ("msg_bytes", pa.int64(), "Message size as DeepSpeed records it (all_gather: the per-rank shard)."),
    ("nccl_bytes", pa.int64(), "nccl-tests message size S."),
    ("group_size", pa.int64(), "n (DeepSpeed's world size: the logger knows no group)."),
    ("calls", pa.int64(), "Calls timed, over all ranks (one source per rank: the comms dump before the log)."),
    ("ranks", pa.int64(), "Ranks that timed them."),
    ("median_latency_ns", pa.int64(), "Median per-call latency."),
    ("p90_latency_ns", pa.int64(), "90th percentile (nearest rank: analyze/analyses/percentile.py)."),
    ("total_latency_ns", pa.int64(), "Summed latency."),
    ("median_algbw_gbps", pa.float64(), "Median nccl-tests algbw, GB/s."),
    ("median_busbw_gbps", pa.float64(), "Median nccl-tests busbw, GB/s."),
    ("least_wait_rank", pa.int64(), "The rank whose median latency is lowest (among the ranks that timed at least "
                                    "half as many calls as the rank that timed most; null with fewer than two): it "
                                    "reached the op last, so it waited least for the others; its calls are nearest "
                                    "the op's own time."),
    ("least_wait_median_latency_ns", pa.int64(), "That rank's median latency."),
    ("least_wait_median_busbw_gbps", pa.float64(), "That rank's median busbw, GB/s."),
    ("most_wait_median_latency_ns", pa.int64(), "The highest median latency of a rank: beyond the op's, its wait for "
                                                "later ranks."),
    ("latency_origin", pa.string(), "measured | repaired_cumulative | as_logged (several joined by commas)."),
    ("synchronized", pa.bool_(), "The timer synchronized around the op (DeepSpeed's comms logger always does)."),
    ("caveat", pa.string(), "Why these are not free-running throughput numbers."),
)


ANALYSIS = Analysis("comms_log", "Logged communication", ("comms_calls", "train_steps"), {"comms_log_stats": COMMS_LOG_STATS}, _comms_log,
                    former_keys={"logged_comms": None}, phrase=logged_lines)
