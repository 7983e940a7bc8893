"""Whether the GPU waits on the CPU: launch cost and queueing per kernel, GPU busy/idle per stream and
step, and idle time split by cause.

Definitions (one cause per gap; the same in tests/synthetic.py, which builds runs with known answers):
- A stream's span in a step runs from the first start to the last end of the device work (kernels,
  memcpy, memset) launched in that step on that stream; busy is the union of that work.
- Each gap between consecutive activities A (ends at g0) and B on the stream is
  * sync       when B's launch call started at or after g0 and, at g0, the launching thread was
               inside a synchronizing call (stream/device/event synchronize, blocking memcpy);
  * host-bound when B's launch call started at or after g0 otherwise: nothing was queued, the GPU
               waited for the CPU to issue work;
  * other      when B was already queued before A ended (a cross-stream dependency), or B has no
               recorded launch.
HTA's idle breakdown (host wait / kernel wait / other) differs: it looks at kernel-to-kernel gaps
with a fixed threshold and does not see synchronization; see tests/fixtures/hta/README.md.
"""

from __future__ import annotations

import polars as pl

from . import intervals

SYNC_API = r"Synchronize$|^(cuda|hip)Memcpy(2D|3D)?$|^(cuda|hip)Memcpy(To|From)Symbol$|^cuMemcpy(DtoH|HtoD|DtoD)?(_v2)?$"
WORK_KINDS = ["kernel", "gpu_memcpy", "gpu_memset"]


def kernel_launches(device: pl.DataFrame, calls: pl.DataFrame) -> pl.DataFrame:
    """One row per device activity with its launch: API, CPU cost of the call, queueing delay.

    `device` holds the device-side events (with launch_event_id), `calls` the runtime/driver calls."""
    call_info = calls.select("rank", "source", "event_id", launch_api="name", launch_ts_ns="ts_ns", api_ns="dur_ns",
                             launch_pid="pid", launch_tid="tid")
    work = device.filter(pl.col("kind").is_in(WORK_KINDS)).select(
        "rank", "source", "event_id", "step", "kind", "name", "stream", "device", "correlation", "ts_ns", "dur_ns",
        "launch_event_id")
    linked = work.join(call_info, left_on=["rank", "source", "launch_event_id"], right_on=["rank", "source", "event_id"],
                       how="left", maintain_order="left")
    return linked.with_columns(
        queue_ns=pl.col("ts_ns") - (pl.col("launch_ts_ns") + pl.col("api_ns")),
        launch_delay_ns=pl.col("ts_ns") - pl.col("launch_ts_ns"),
    ).drop("launch_event_id")


ALL_STREAMS = -1  # `stream` value of the rows that treat the device as one timeline


def idle_gaps(launched: pl.DataFrame, calls: pl.DataFrame) -> pl.DataFrame:
    """Every gap inside a step span, per stream and for the whole device (stream = ALL_STREAMS: the
    device is idle only when no stream is busy), with its cause and, for sync gaps, the sync call.

    `launched` must be in time order within each (rank, source), as kernel_launches leaves it."""
    work = launched.filter(pl.col("step").is_not_null() & pl.col("stream").is_not_null()).with_columns(
        end_ns=pl.col("ts_ns") + pl.col("dur_ns").fill_null(0))
    keys = ["rank", "source", "device", "stream", "step"]
    lanes = []
    for lane_keys, stream in ((keys, pl.col("stream")), ([k for k in keys if k != "stream"], pl.lit(ALL_STREAMS, pl.Int64))):
        prev_end = pl.col("end_ns").cum_max().shift(1).over(lane_keys)
        lanes.append(work.with_columns(prev_end_ns=prev_end).filter(pl.col("ts_ns") > pl.col("prev_end_ns")).select(
            "rank", "source", "device", stream.alias("stream"), "step", "launch_pid", "launch_tid", "launch_ts_ns",
            gap_start_ns="prev_end_ns", gap_end_ns="ts_ns"))
    gaps = pl.concat(lanes)
    syncs = calls.filter(pl.col("name").str.contains(SYNC_API)).select(
        "rank", "source", sync_pid="pid", sync_tid="tid", sync_event_id="event_id", sync_name="name",
        sync_start_ns="ts_ns", sync_end_ns=pl.col("ts_ns") + pl.col("dur_ns"))
    gaps = gaps.sort("gap_start_ns").join_asof(
        syncs.sort("sync_start_ns"), left_on="gap_start_ns", right_on="sync_start_ns",
        by_left=["rank", "source", "launch_pid", "launch_tid"], by_right=["rank", "source", "sync_pid", "sync_tid"],
        strategy="backward", check_sortedness=False,
    )
    in_sync = pl.col("sync_end_ns").is_not_null() & (pl.col("sync_end_ns") > pl.col("gap_start_ns"))
    issued_after = pl.col("launch_ts_ns").is_not_null() & (pl.col("launch_ts_ns") >= pl.col("gap_start_ns"))
    cause = pl.when(issued_after & in_sync).then(pl.lit("sync")).when(issued_after).then(pl.lit("host_bound")).otherwise(pl.lit("other"))
    return gaps.with_columns(cause=cause, idle_ns=pl.col("gap_end_ns") - pl.col("gap_start_ns")).with_columns(
        sync_event_id=pl.when(pl.col("cause") == "sync").then(pl.col("sync_event_id")),
        sync_name=pl.when(pl.col("cause") == "sync").then(pl.col("sync_name")),
    ).select(keys + ["gap_start_ns", "gap_end_ns", "idle_ns", "cause", "sync_event_id", "sync_name"])


def gpu_idle(launched: pl.DataFrame, gaps: pl.DataFrame) -> pl.DataFrame:
    """Per rank, step and stream (and ALL_STREAMS for the device): span, busy, and idle split by cause
    (busy + idle causes == span)."""
    keys = ["rank", "device", "stream", "step"]
    work = launched.filter(pl.col("step").is_not_null() & pl.col("stream").is_not_null())
    span = dict(span_start_ns=pl.col("ts_ns").min(), span_end_ns=(pl.col("ts_ns") + pl.col("dur_ns")).max(), activities=pl.len())
    spans = pl.concat([
        work.group_by(keys).agg(**span),
        work.group_by("rank", "device", "step").agg(**span).with_columns(stream=pl.lit(ALL_STREAMS, pl.Int64)).select(keys + list(span)),
    ]).with_columns(span_ns=pl.col("span_end_ns") - pl.col("span_start_ns"))
    causes = gaps.group_by(keys).agg(
        **{f"{c}_ns": pl.col("idle_ns").filter(pl.col("cause") == c).sum() for c in ("host_bound", "sync", "other")})
    table = spans.join(causes, on=keys, how="left").with_columns(
        [pl.col(c).fill_null(0) for c in ("host_bound_ns", "sync_ns", "other_ns")])
    return table.with_columns(
        idle_ns=pl.col("host_bound_ns") + pl.col("sync_ns") + pl.col("other_ns"),
    ).with_columns(busy_ns=pl.col("span_ns") - pl.col("idle_ns")).select(
        keys + ["span_start_ns", "span_end_ns", "span_ns", "busy_ns", "idle_ns", "host_bound_ns", "sync_ns", "other_ns", "activities"]
    ).sort(keys)


SYNC_POINTS = 20  # the synchronizing calls kept, worst first


def sync_points(gaps: pl.DataFrame, calls: pl.DataFrame, threads: dict, limit: int = SYNC_POINTS) -> pl.DataFrame:
    """The synchronizing calls that left the GPU idle longest, with the CPU op that issued them."""
    caused = gaps.filter((pl.col("cause") == "sync") & (pl.col("stream") == ALL_STREAMS)).group_by("rank", "source", "sync_event_id").agg(
        idle_caused_ns=pl.col("idle_ns").sum(), step=pl.col("step").min())
    if caused.is_empty():
        return pl.DataFrame(schema={"rank": pl.Int64, "step": pl.Int64, "name": pl.String, "issuing_op": pl.String,
                                    "ts_ns": pl.Int64, "dur_ns": pl.Int64, "idle_caused_ns": pl.Int64})
    points = caused.join(calls.select("rank", "source", "event_id", "name", "ts_ns", "dur_ns", "pid", "tid"),
                         left_on=["rank", "source", "sync_event_id"], right_on=["rank", "source", "event_id"])
    points = points.sort("idle_caused_ns", descending=True).head(limit)
    points = points.with_columns(issuing_op=enclosing_op(points, threads))
    return points.sort("idle_caused_ns", descending=True).head(limit).select(
        "rank", "step", "name", "issuing_op", "ts_ns", "dur_ns", "idle_caused_ns")


THREAD_KEYS = ["rank", "source", "pid", "tid"]


def cpu_threads(cpu: pl.DataFrame) -> dict[tuple, pl.DataFrame]:
    """CPU ops per thread, by start with the outermost first on ties: the input of enclosing_op."""
    ops = cpu.filter(pl.col("dur_ns").is_not_null()).with_columns(end_ns=pl.col("ts_ns") + pl.col("dur_ns"))
    ops = ops.sort(THREAD_KEYS + ["ts_ns", "end_ns"], descending=[False] * 5 + [True])
    return ops.partition_by(THREAD_KEYS, as_dict=True)


def enclosing_op(calls: pl.DataFrame, threads: dict[tuple, pl.DataFrame], skip: tuple[str, ...] = ()) -> pl.Series:
    """Name of the innermost CPU op, annotation or Python frame on the same thread that contains each
    call, ignoring ops named in `skip` (null when none does). `calls` needs rank, source, pid, tid,
    ts_ns, dur_ns; `threads` comes from cpu_threads."""
    names = [None] * calls.height
    queries = calls.with_columns(row=pl.int_range(pl.len()), end_ns=pl.col("ts_ns") + pl.col("dur_ns")).drop_nulls("end_ns")
    for key, group in queries.partition_by(THREAD_KEYS, as_dict=True).items():
        thread = threads.get(key)
        if thread is None:
            continue
        if skip:
            thread = thread.filter(~pl.col("name").is_in(list(skip)))
        found = intervals.innermost_container(thread["ts_ns"].to_numpy(), thread["end_ns"].to_numpy(),
                                              group["ts_ns"].to_numpy(), group["end_ns"].to_numpy())
        hit = found >= 0
        rows = group["row"].to_numpy()[hit]
        for row, name in zip(rows.tolist(), thread["name"].gather(found[hit]).to_list()):
            names[row] = name
    return pl.Series("issuing_op", names, dtype=pl.String)


def launch_summary(launched: pl.DataFrame) -> pl.DataFrame:
    """Per rank and launch API: how many, CPU cost and queueing (median, p90)."""
    linked = launched.filter(pl.col("launch_api").is_not_null())
    return linked.group_by("rank", "launch_api").agg(
        activities=pl.len(),
        api_ns_median=pl.col("api_ns").median(),
        api_ns_p90=pl.col("api_ns").quantile(0.9),
        queue_ns_median=pl.col("queue_ns").median(),
        queue_ns_p90=pl.col("queue_ns").quantile(0.9),
        gpu_ns_total=pl.col("dur_ns").sum(),
    ).sort("rank", "activities", descending=[False, True])
