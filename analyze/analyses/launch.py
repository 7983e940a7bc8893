"""Whether the GPU waits on the CPU: launch cost and queueing per kernel, GPU busy/idle per device,
step and stream, and idle time split by cause.

Definitions (one cause per gap; the same in tests/synthetic.py, which builds runs with known answers):
- The device-busy timeline of a rank's device in one profiler window (source) is the union of all its
  device work: kernels, memcpy and memset on every stream, of every step, with or without a recorded
  launch (work enqueued before the window opened included). The device is idle only where it is not.
- `gpu_idle` rows, all with busy_ns + idle_ns == span_ns:
  * whole window (step null, stream -1): first start to last end of all device work in the window,
    widened to the CPU span of the profiled steps with work on the device (first step's start to last
    step's end) where that reaches further, idle against the device-busy timeline. Every trace with device activity has them, with or
    without ProfilerStep; the headline idle share is theirs.
  * per step (stream -1): the step's span (step_spans), idle against the same device-wide timeline, so
    time in which another step's work (or work launched before the window) kept the device busy is never
    idle. The span starts at the step's first work, or where the device went idle before it if the step
    had begun on the CPU by then (from the later of the two): the GPU waiting on the data loader at the
    start of every step is that step's idle. It ends at the last end of the work launched in it, or at the
    step's end on the CPU if that is later (the host finishing the step, a CUDA-graph capture that ran
    almost nothing): the GPU waiting at the end of a step is that step's idle. A step with no device work
    has no row.
  * idle before the device's first work and after its last, within the profiled steps' CPU span
    (edge_gaps): host-bound (other before work launched ahead of the window).
  * per step and stream: the step's own work on that stream, idle against its own union.
- Each gap between consecutive activities A (ends at g0) and B (starts at g1) on a lane, B's launch call
  running from c0 to c1, is
  * sync       when c0 >= g0, B then queued no longer than below, and, at g0, the launching thread was
               inside a synchronizing call (stream/device/event synchronize, blocking memcpy);
  * host-bound when c0 >= g0 and B then queued no longer than below, otherwise: nothing was queued,
               the GPU waited for the CPU to issue work;
  * other      when B was already queued before A ended (a cross-stream dependency), when B, issued,
               then waited in the queue longer than the host took to issue it and than the rank's work
               usually waits after its call (g1 - c1 > max(c1 - g0, the median queue_ns): an event or
               cross-stream wait on something the trace shows no device work for), or B has no recorded
               launch.
- queue_ns = start on the GPU - end of the launch call. It is negative where the call returns only
  after the work started: blocking copies (cudaMemcpy returns once the copy is done) and graph
  launches (cudaGraphLaunch is still enqueueing when its first kernels start). launch_summary's
  queue statistics clip it at 0 ("no queueing: the work overlapped the call"); launch_delay_ns (from
  the start of the call) is never negative for linked work.
HTA's idle breakdown (host wait / kernel wait / other) differs: it looks at kernel-to-kernel gaps
with a fixed threshold and does not see synchronization; see tests/fixtures/hta/README.md.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa

from steplens.analyze.contract.schema import ALL_STREAMS, WORK_KINDS
from steplens.analyze.trace import intervals
from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.analyses.percentile import nearest_rank_expr
from steplens.analyze.analyses import profiler_effect
from steplens.analyze.contract.text import sentence
from steplens.analyze.contract.units import duration
from steplens.analyze.contract import alarm_rules, schema

# Calls that return only once the device has caught up: the synchronizes and the blocking copies. ROCm's PyTorch
# makes its blocking copies with hipMemcpyWithStream (c10/hip memcpy_and_sync), CUDA's with cudaMemcpyAsync and a
# stream synchronize; hipMemcpy{DtoH,HtoD} and cuMemcpy* are the blocking driver-style copies (a device-to-device
# or peer copy returns before it is done).
SYNC_API = (r"Synchronize$|^(cuda|hip)Memcpy(2D|3D)?$|^hipMemcpyWithStream$|^(cuda|hip)Memcpy(To|From)Symbol$"
            r"|^hipMemcpy(DtoH|HtoD)$|^cuMemcpy(DtoH|HtoD|DtoD)?(_v2)?$")


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
    # Work whose launch is not in the file (enqueued before the window) belongs to no step: never guess one by time.
    return linked.with_columns(
        step=pl.when(pl.col("launch_api").is_not_null()).then(pl.col("step")),
        queue_ns=pl.col("ts_ns") - (pl.col("launch_ts_ns") + pl.col("api_ns")),
        launch_delay_ns=pl.col("ts_ns") - pl.col("launch_ts_ns"),
    ).drop("launch_event_id")


CAUSES = ("host_bound", "sync", "other")


def usual_queue(launched: pl.DataFrame) -> pl.DataFrame:
    """Per rank and window, the median time its work waited after its launch call returned (clipped at 0): the
    launch latency of an idle device, or the backlog of a busy one (rank, source, usual_queue_ns)."""
    return launched.filter(pl.col("queue_ns").is_not_null()).group_by("rank", "source").agg(
        usual_queue_ns=pl.col("queue_ns").clip(lower_bound=0).median())


def issued_in_gap(call_start: str, call_end: str, gap_start: str, gap_end: str) -> pl.Expr:
    """The gap's next work was issued in it (its launch call started after the device ran dry) and then waited in the
    queue no longer than the call took from the gap's start or than the rank's work usually waits (usual_queue_ns):
    the host's gap, not a queued one."""
    return pl.col(call_start).is_not_null() & (pl.col(call_start) >= pl.col(gap_start)) & (
        pl.col(gap_end) - pl.col(call_end) <= pl.max_horizontal(
            pl.col(call_end) - pl.col(gap_start), pl.col("usual_queue_ns").fill_null(0)))


def idle_gaps(launched: pl.DataFrame, calls: pl.DataFrame) -> pl.DataFrame:
    """Every gap with its cause and, for sync gaps, the sync call: per step and stream (inside the
    step's work on that stream), and for the whole device (stream = ALL_STREAMS, step = the step of
    the activity that ends the gap): the gaps of the device-busy timeline, all steps and streams and
    work without a launch included.

    `launched` must be in time order within each (rank, source), as kernel_launches leaves it."""
    # Only the columns the gaps need: a filter copies every column it holds
    work = launched.select("rank", "source", "device", "stream", "step", "launch_pid", "launch_tid", "launch_ts_ns", "ts_ns",
                           launch_end_ns=pl.col("launch_ts_ns") + pl.col("api_ns").fill_null(0),
                           end_ns=pl.col("ts_ns") + pl.col("dur_ns").fill_null(0)).filter(pl.col("stream").is_not_null())
    lanes = []
    for lane_keys, stream, rows in (
        (["rank", "source", "device", "stream", "step"], pl.col("stream"), work.filter(pl.col("step").is_not_null())),
        (["rank", "source", "device"], pl.lit(ALL_STREAMS, pl.Int64), work),
    ):
        prev_end = pl.col("end_ns").cum_max().shift(1).over(lane_keys)
        lanes.append(rows.with_columns(prev_end_ns=prev_end).filter(pl.col("ts_ns") > pl.col("prev_end_ns")).select(
            "rank", "source", "device", stream.alias("stream"), "step", "launch_pid", "launch_tid", "launch_ts_ns",
            "launch_end_ns", gap_start_ns="prev_end_ns", gap_end_ns="ts_ns"))
    gaps = pl.concat(lanes)
    syncs = calls.lazy().filter(pl.col("name").str.contains(SYNC_API)).select(
        "rank", "source", sync_pid="pid", sync_tid="tid", sync_event_id="event_id", sync_name="name",
        sync_start_ns="ts_ns", sync_end_ns=pl.col("ts_ns") + pl.col("dur_ns")).collect()
    gaps = gaps.sort("gap_start_ns").join_asof(
        syncs.sort("sync_start_ns"), left_on="gap_start_ns", right_on="sync_start_ns",
        by_left=["rank", "source", "launch_pid", "launch_tid"], by_right=["rank", "source", "sync_pid", "sync_tid"],
        strategy="backward", check_sortedness=False,
    )
    in_sync = pl.col("sync_end_ns").is_not_null() & (pl.col("sync_end_ns") > pl.col("gap_start_ns"))
    # issued after the GPU ran dry, and not then left in the queue longer than the host took to issue it or than
    # the rank's work usually waits after its call (launch latency)
    gaps = gaps.join(usual_queue(launched), on=["rank", "source"], how="left", nulls_equal=True)
    issued_after = issued_in_gap("launch_ts_ns", "launch_end_ns", "gap_start_ns", "gap_end_ns")
    cause = pl.when(issued_after & in_sync).then(pl.lit("sync")).when(issued_after).then(pl.lit("host_bound")).otherwise(pl.lit("other"))
    return gaps.with_columns(cause=cause, idle_ns=pl.col("gap_end_ns") - pl.col("gap_start_ns")).with_columns(
        sync_event_id=pl.when(pl.col("cause") == "sync").then(pl.col("sync_event_id")),
        sync_name=pl.when(pl.col("cause") == "sync").then(pl.col("sync_name")),
    ).select("rank", "source", "device", "stream", "step", "gap_start_ns", "gap_end_ns", "idle_ns", "cause",
             "sync_event_id", "sync_name").sort("rank", "source", "device", "stream", "gap_start_ns", maintain_order=True)


GPU_IDLE_COLUMNS = ["rank", "device", "stream", "step", "span_start_ns", "span_end_ns", "span_ns", "busy_ns", "idle_ns",
                    "host_bound_ns", "sync_ns", "other_ns", "activities", "source"]


def step_spans(work: pl.DataFrame, device_gaps: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    """Each step's span on each device (rank, source, device, step, span_start_ns, span_end_ns, activities): from
    when its work could have run to when the step was over on both sides. It starts at its first work, or earlier
    when the device sat idle before that work with the step already begun on the CPU: at the later of the step's
    start (`steps`: rank, source, step, start_ns, end_ns), the end of the device's work before (none: the device
    had done nothing yet in the window) and the end of every earlier step's span. It ends at the last end of the
    work launched in it, or later when the step went on on the CPU after that work: at the step's end, or at
    the next step's first work if that came sooner. The idle that opens a step (a data loader, an input copy,
    the host preparing the step) and the idle that closes it (the host finishing the step, a CUDA-graph capture
    that ran almost nothing) are then the step's, not nobody's, and no time is in two steps' spans that was not
    already. `device_gaps` are idle_gaps' ALL_STREAMS rows."""
    keys = ["rank", "source", "device"]
    device_first = work.group_by(keys).agg(device_first_ns=pl.col("ts_ns").min())
    spans = work.filter(pl.col("step").is_not_null()).group_by(*keys, "step").agg(
        first_ns=pl.col("ts_ns").min(), last_end_ns=(pl.col("ts_ns") + pl.col("dur_ns").fill_null(0)).max(),
        activities=pl.len())
    # only the gaps that end where a step's work begins (a few of thousands): filtered before anything else
    before = device_gaps.filter(pl.col("gap_end_ns").is_in(spans["first_ns"].implode())).select(
        *keys, first_ns="gap_end_ns", idle_from_ns="gap_start_ns").unique([*keys, "first_ns"])
    began = steps.group_by("rank", "source", "step").agg(step_start_ns=pl.col("start_ns").min(),
                                                          step_end_ns=pl.col("end_ns").max())
    spans = spans.join(before, on=[*keys, "first_ns"], how="left", nulls_equal=True).join(
        began, on=["rank", "source", "step"], how="left", nulls_equal=True).join(
        device_first, on=keys, how="left", nulls_equal=True).sort(*keys, "first_ns", "step")
    # the step's own end on the CPU, before the next step's work on this device (spans stay apart); not where an
    # earlier step's work still ran past this step's (the device was busy, and that span holds the time already)
    next_first = pl.col("first_ns").shift(-1).over(keys)
    earlier_work_end = pl.col("last_end_ns").cum_max().shift(1).over(keys)
    closed = pl.when(earlier_work_end > pl.col("last_end_ns")).then(pl.col("last_end_ns")).otherwise(
        pl.max_horizontal("last_end_ns", pl.min_horizontal("step_end_ns", next_first)))
    spans = spans.with_columns(span_end_ns=closed)
    # the device's first work in the window: idle since before the step began
    idle_from = pl.coalesce("idle_from_ns", pl.when(pl.col("first_ns") == pl.col("device_first_ns")).then("step_start_ns"))
    # never inside an earlier step's span (its later work may run after this step's first)
    earlier_end = pl.col("span_end_ns").cum_max().shift(1).over(keys)
    opened = pl.when(idle_from.is_not_null() & pl.col("step_start_ns").is_not_null()).then(
        pl.max_horizontal("step_start_ns", idle_from, earlier_end))
    return spans.select(
        *keys, "step", span_start_ns=pl.when(opened < pl.col("first_ns")).then(opened).otherwise(pl.col("first_ns")),
        span_end_ns="span_end_ns", activities="activities")


def edge_gaps(launched: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    """The device's idle before its first work and after its last in the window, as far as the profiled steps with
    work on that device reach on the CPU (idle_gaps' ALL_STREAMS columns): only steps' spans (step_spans) and the
    window's widened span cover them. Before: as for a gap (idle_gaps: host-bound when the first work's launch call
    started in it and the work then queued no longer than usual, else other: work launched before the window);
    after: host-bound (no work was left)."""
    keys = ["rank", "source", "device"]
    work = launched.select(*keys, "stream", "step", "ts_ns", "dur_ns", "launch_ts_ns", "api_ns").filter(
        pl.col("stream").is_not_null())
    worked = work.filter(pl.col("step").is_not_null()).select(*keys, "step").unique()
    reach = steps.join(worked, on=["rank", "source", "step"], how="inner", nulls_equal=True).group_by(keys).agg(
        from_ns=pl.col("start_ns").min(), to_ns=pl.col("end_ns").max())
    first = pl.col("ts_ns").arg_min()
    device = work.group_by(keys).agg(
        first_ns=pl.col("ts_ns").min(), first_launch_ns=pl.col("launch_ts_ns").get(first),
        first_launch_end_ns=(pl.col("launch_ts_ns") + pl.col("api_ns").fill_null(0)).get(first),
        last_end_ns=(pl.col("ts_ns") + pl.col("dur_ns").fill_null(0)).max()).join(reach, on=keys, how="inner", nulls_equal=True)
    device = device.join(usual_queue(launched), on=["rank", "source"], how="left", nulls_equal=True)
    columns = dict(stream=pl.lit(ALL_STREAMS, pl.Int64), step=pl.lit(None, pl.Int64), sync_event_id=pl.lit(None, pl.Int64),
                   sync_name=pl.lit(None, pl.String))
    issued_in = issued_in_gap("first_launch_ns", "first_launch_end_ns", "from_ns", "first_ns")
    lead = device.filter(pl.col("from_ns") < pl.col("first_ns")).select(
        *keys, gap_start_ns="from_ns", gap_end_ns="first_ns",
        cause=pl.when(issued_in).then(pl.lit("host_bound")).otherwise(pl.lit("other")), **columns)
    trail = device.filter(pl.col("to_ns") > pl.col("last_end_ns")).select(
        *keys, gap_start_ns="last_end_ns", gap_end_ns="to_ns", cause=pl.lit("host_bound"), **columns)
    return pl.concat([lead, trail]).with_columns(idle_ns=pl.col("gap_end_ns") - pl.col("gap_start_ns"))


def gpu_idle(launched: pl.DataFrame, gaps: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    """Per rank, device and window (step null, stream ALL_STREAMS), per step (stream ALL_STREAMS, over
    step_spans) and per step and stream: span, busy, and idle split by cause (busy + idle causes == span)."""
    work = launched.select("rank", "source", "device", "stream", "step", "ts_ns", "dur_ns").filter(pl.col("stream").is_not_null())
    span = dict(span_start_ns=pl.col("ts_ns").min(), span_end_ns=(pl.col("ts_ns") + pl.col("dur_ns").fill_null(0)).max(),
                activities=pl.len())
    stream_keys = ["rank", "source", "device", "stream", "step"]
    per_stream = work.filter(pl.col("step").is_not_null()).group_by(stream_keys).agg(**span)
    stream_gaps = gaps.filter(pl.col("stream") != ALL_STREAMS)
    per_stream = per_stream.join(_cause_totals(stream_gaps, stream_keys), on=stream_keys, how="left")
    device_gaps = gaps.filter(pl.col("stream") == ALL_STREAMS)
    device = ["rank", "source", "device"]
    edges = edge_gaps(launched, steps).select(device_gaps.columns).cast(device_gaps.schema)
    all_gaps = pl.concat([device_gaps, edges])
    # the window: first to last device work, widened to the profiled steps' CPU span where that reaches further
    reach = edges.group_by(device).agg(edge_from_ns=pl.col("gap_start_ns").min(), edge_to_ns=pl.col("gap_end_ns").max())
    windows = work.group_by(device).agg(**span).join(reach, on=device, how="left", nulls_equal=True).with_columns(
        span_start_ns=pl.min_horizontal("span_start_ns", "edge_from_ns"), span_end_ns=pl.max_horizontal("span_end_ns", "edge_to_ns"),
        step=pl.lit(None, pl.Int64)).drop("edge_from_ns", "edge_to_ns")
    windows = windows.join(_cause_totals(all_gaps, device), on=device, how="left", nulls_equal=True)
    per_step = _clipped_causes(step_spans(work, device_gaps, steps), all_gaps)
    device_rows = pl.concat([windows, per_step], how="diagonal_relaxed").with_columns(stream=pl.lit(ALL_STREAMS, pl.Int64))
    table = pl.concat([device_rows, per_stream], how="diagonal_relaxed").with_columns(
        [pl.col(f"{c}_ns").fill_null(0) for c in CAUSES])
    return table.with_columns(
        span_ns=pl.col("span_end_ns") - pl.col("span_start_ns"),
        idle_ns=pl.sum_horizontal([f"{c}_ns" for c in CAUSES]),
    ).with_columns(busy_ns=pl.col("span_ns") - pl.col("idle_ns")).select(GPU_IDLE_COLUMNS).sort(
        "rank", "device", "stream", "step", "source", nulls_last=False)


def _cause_totals(gaps: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    return gaps.group_by(keys).agg(**{f"{c}_ns": pl.col("idle_ns").filter(pl.col("cause") == c).sum() for c in CAUSES})


def _clipped_causes(spans: pl.DataFrame, device_gaps: pl.DataFrame) -> pl.DataFrame:
    """Add each cause's share of the device-timeline gaps inside every [span_start_ns, span_end_ns): every device
    at once, laid end to end (intervals.end_to_end), or device by device where the times span too much for that."""
    keys = ["rank", "source", "device"]
    if spans.is_empty():
        return spans
    devices = spans.select(keys).unique().with_row_index("lane")
    span_lane = spans.select(keys).join(devices, on=keys, how="left", nulls_equal=True, maintain_order="left")["lane"]
    gaps = device_gaps.join(devices, on=keys, how="inner", nulls_equal=True)
    lane, lo, hi = span_lane.to_numpy(), spans["span_start_ns"].to_numpy(), spans["span_end_ns"].to_numpy()
    totals = {}
    for c in CAUSES:
        mine = gaps.filter(pl.col("cause") == c)  # per device: disjoint and in time order, gaps of one union
        g_lane, g_s, g_e = mine["lane"].to_numpy(), mine["gap_start_ns"].to_numpy(), mine["gap_end_ns"].to_numpy()
        if (laid := intervals.end_to_end(devices.height, lo, hi, g_s, g_e)) is not None:
            order = np.argsort(laid(g_s, g_lane), kind="stable")
            covered = intervals.covered(laid(g_s, g_lane)[order], laid(g_e, g_lane)[order], laid(lo, lane), laid(hi, lane))
        else:
            covered = np.zeros(len(lo), np.int64)
            for device in np.unique(lane):
                at = lane == device
                own = np.flatnonzero(g_lane == device)
                own = own[np.argsort(g_s[own], kind="stable")]
                covered[at] = intervals.covered(g_s[own], g_e[own], lo[at], hi[at])
        totals[f"{c}_ns"] = pl.Series(covered.astype(np.int64), dtype=pl.Int64)
    return spans.with_columns(**totals)


SYNC_POINTS_KEPT = 20  # the synchronizing calls kept, worst first


def sync_points(gaps: pl.DataFrame, calls: pl.DataFrame, threads: CpuThreads, limit: int = SYNC_POINTS_KEPT) -> pl.DataFrame:
    """The synchronizing calls that left the GPU idle longest, with the CPU op that issued them and the
    step the call ran in (the idle it caused can fall in the next step's device time)."""
    caused = gaps.filter((pl.col("cause") == "sync") & (pl.col("stream") == ALL_STREAMS)).group_by("rank", "source", "sync_event_id").agg(
        idle_caused_ns=pl.col("idle_ns").sum())
    if caused.is_empty():
        return pl.DataFrame(schema={"rank": pl.Int64, "step": pl.Int64, "name": pl.String, "issuing_op": pl.String,
                                    "ts_ns": pl.Int64, "dur_ns": pl.Int64, "idle_caused_ns": pl.Int64})
    points = caused.join(calls.select("rank", "source", "event_id", "step", "name", "ts_ns", "dur_ns", "pid", "tid"),
                         left_on=["rank", "source", "sync_event_id"], right_on=["rank", "source", "event_id"])
    points = points.sort("idle_caused_ns", descending=True).head(limit)
    points = points.with_columns(issuing_op=enclosing_op(points, threads))
    return points.sort("idle_caused_ns", descending=True).head(limit).select(
        "rank", "step", "name", "issuing_op", "ts_ns", "dur_ns", "idle_caused_ns")


THREAD_KEYS = ["rank", "source", "pid", "tid"]


class CpuThreads:
    """CPU ops per thread, by start with the outermost first on ties: the input of enclosing_op. Sorted on the
    first lookup: a run whose calls need no enclosing op (a CPU-only trace: no device work, no collective
    kernels, no sync idle) never pays for sorting every CPU event (a quarter of a with_stack rank's analyses)."""

    def __init__(self, cpu: pl.DataFrame):
        self._cpu, self._sorted = cpu, None

    def ops(self) -> pl.DataFrame:
        """Every thread's ops (THREAD_KEYS, ts_ns, end_ns, name) by start, the outermost first on ties."""
        if self._sorted is None:
            ops = self._cpu.select(*THREAD_KEYS, "ts_ns", "name", end_ns=pl.col("ts_ns") + pl.col("dur_ns")).filter(
                pl.col("end_ns").is_not_null())  # what enclosing_op reads
            self._sorted = ops.sort("ts_ns", "end_ns", descending=[False, True], maintain_order=True)
        return self._sorted


def innermost_on_thread(ops: pl.DataFrame, queries: pl.DataFrame, keys: list[str] = THREAD_KEYS) -> np.ndarray:
    """For each query row (`keys`, ts_ns, end_ns), the row of `ops` (`keys`, ts_ns, end_ns, without nulls in the
    times; by start, the outermost first on ties) of the innermost op on the same thread that contains it, or -1.

    Every thread in one search, laid end to end (intervals.end_to_end); threads are searched one by one only where
    the times span too much for that. A loop over the threads of a run of 32 small ranks was a fifth of its analyses."""
    found = np.full(queries.height, -1, np.int64)
    asked = queries.select(*keys, "ts_ns", "end_ns").with_row_index("row").drop_nulls(["ts_ns", "end_ns"])
    if ops.is_empty() or asked.is_empty():
        return found
    threads = ops.select(keys).unique().with_row_index("thread")
    op_thread = ops.select(keys).join(threads, on=keys, how="left", nulls_equal=True,
                                      maintain_order="left")["thread"].to_numpy()
    asked = asked.join(threads, on=keys, how="inner", nulls_equal=True)  # a query on a thread without ops: none
    if asked.is_empty():
        return found
    starts, ends = ops["ts_ns"].to_numpy(), ops["end_ns"].to_numpy()
    rows, q_thread = asked["row"].to_numpy(), asked["thread"].to_numpy()
    lo, hi = asked["ts_ns"].to_numpy(), asked["end_ns"].to_numpy()
    if (laid := intervals.end_to_end(threads.height, starts, ends, lo, hi)) is not None:
        order = np.argsort(laid(starts, op_thread), kind="stable")  # by thread, each in its given order
        hit = intervals.innermost_container(laid(starts, op_thread)[order], laid(ends, op_thread)[order],
                                            laid(lo, q_thread), laid(hi, q_thread))
        found[rows] = np.where(hit >= 0, order[np.maximum(hit, 0)], -1)
        return found
    for thread in np.unique(q_thread):
        mine, asking = np.flatnonzero(op_thread == thread), q_thread == thread
        hit = intervals.innermost_container(starts[mine], ends[mine], lo[asking], hi[asking])
        found[rows[asking]] = np.where(hit >= 0, mine[np.maximum(hit, 0)], -1)
    return found


def enclosing_op(calls: pl.DataFrame, threads: CpuThreads, skip: tuple[str, ...] = ()) -> pl.Series:
    """Name of the innermost CPU op, annotation or Python frame on the same thread that contains each
    call, ignoring ops named in `skip` (null when none does). `calls` needs rank, source, pid, tid,
    ts_ns, dur_ns."""
    ops = threads.ops()
    if skip:
        ops = ops.filter(~pl.col("name").is_in(list(skip)))
    found = innermost_on_thread(ops, calls.with_columns(end_ns=pl.col("ts_ns") + pl.col("dur_ns")))
    return named(ops["name"], found).alias("issuing_op")


def named(names: pl.Series, found: np.ndarray) -> pl.Series:
    """names[found], null where found is -1 (innermost_on_thread's rows)."""
    if not len(names):
        return pl.Series(names.name, [None] * len(found), pl.String)
    return names.gather(np.maximum(found, 0)).scatter(np.flatnonzero(found < 0), None)


GRAPH_LAUNCH = r"^(cuda|cu|hip)Graph(Exec)?Launch"


def launch_summary(launched: pl.DataFrame) -> pl.DataFrame:
    """Per rank and launch API: how many, CPU cost and queueing (median, p90; queue_ns clipped at 0:
    work that started before its call returned did not queue; of a graph launch, its first kernel's only)."""
    linked = launched.filter(pl.col("launch_api").is_not_null())
    # A graph launch runs many kernels, each after the one before: only its first waited in a queue for the call.
    call = ["rank", "source", "launch_pid", "launch_tid", "launch_ts_ns"]
    # `launched` is in time order. Not a window over the call keys: one group per call made it 5x slower.
    first_of_call = pl.struct(call).is_first_distinct()
    later_in_graph = pl.col("launch_api").str.contains(GRAPH_LAUNCH) & ~first_of_call
    # A copy or set whose call returned only once it had ended waited for the device (a copy to pageable memory is
    # synchronous whatever its name): its length is the device's, no launch stall. A kernel launch never waits for
    # its kernel, however short the kernel.
    returned_first = ~pl.col("kind").is_in(["gpu_memcpy", "gpu_memset"]) | (
        (pl.col("launch_ts_ns") + pl.col("api_ns")) < (pl.col("ts_ns") + pl.col("dur_ns").fill_null(0)))
    linked = linked.with_columns(queued=pl.when(~later_in_graph).then(pl.col("queue_ns").clip(lower_bound=0)),
                                 call_ns=pl.when(first_of_call).then(pl.col("api_ns")),
                                 stall_ns=pl.when(first_of_call & returned_first).then(pl.col("api_ns")))
    return linked.group_by("rank", "launch_api").agg(
        activities=pl.len(),
        api_ns_median=pl.col("call_ns").median(),  # each call once, as max and total
        api_ns_p90=nearest_rank_expr("call_ns", 90),
        api_ns_max=pl.col("call_ns").max(),  # each call once: a graph launch runs many kernels
        api_ns_total=pl.col("call_ns").sum(),
        launch_ns_max=pl.col("stall_ns").max(),
        queue_ns_median=pl.col("queued").median(),
        queue_ns_p90=nearest_rank_expr("queued", 90),
        gpu_ns_total=pl.col("dur_ns").sum(),
    ).sort("rank", "activities", "launch_api", descending=[False, True, False])  # a total order: the same rows, the same order


# Idle under 1% of the profiled time is what launch jitter and clock rounding alone leave (back-to-back kernels
# a nanosecond apart): it has no cause worth naming.
MAIN_CAUSE_MIN_IDLE_SHARE = 0.01


# A launch call at least this share of the host-bound idle is named beside it (the medians hide one long stall).
SLOW_LAUNCH_SHARE = 0.1


def slowest_launch(launches: pl.DataFrame, idle: pl.DataFrame) -> dict | None:
    """On the rank with the most host-bound idle (`idle`: gpu_idle's whole-window rows), its longest launch call that
    returned before its work ended (launch_summary's launch_ns_max), when it is at least SLOW_LAUNCH_SHARE of that
    rank's host-bound idle: rank, launch_api, api_ns and its API's median. Another rank's stall, or a call that waited
    for the device, is no evidence of this idle."""
    if launches.is_empty() or idle.is_empty():
        return None
    by_rank = idle.group_by("rank").agg(pl.col("host_bound_ns").sum()).sort("host_bound_ns", "rank", descending=[True, False])
    rank, host_bound_ns = by_rank.row(0)
    if not host_bound_ns:
        return None
    # a synchronous API's call waits for the device by definition
    top = launches.filter((pl.col("rank") == rank) & pl.col("launch_ns_max").is_not_null()
                          & ~pl.col("launch_api").str.contains(SYNC_API)).sort("launch_ns_max", descending=True)
    if top.is_empty() or top["launch_ns_max"][0] < SLOW_LAUNCH_SHARE * host_bound_ns:
        return None
    row = top.row(0, named=True)
    return {"rank": rank, "launch_api": row["launch_api"], "api_ns": row["launch_ns_max"],
            "api_ns_median": row["api_ns_median"], "ranks": idle["rank"].n_unique()}


def idle_finding(idle: pl.DataFrame, runtime_calls: int = 0, launches: pl.DataFrame | None = None) -> dict:
    """Device idle share over the whole profiled windows (the whole-window rows of gpu_idle); its main cause
    where the idle is at least MAIN_CAUSE_MIN_IDLE_SHARE of them, and with host-bound idle the longest launch call
    where it is a good part of it (`launches`: launch_summary). `runtime_calls`: the traces' CUDA/HIP
    runtime and driver calls, which say a GPU was used where no device activity was recorded."""
    windows = idle.filter((pl.col("stream") == ALL_STREAMS) & pl.col("step").is_null())
    if windows.is_empty() and runtime_calls:
        return {"idle_share": None, "runtime_calls_without_device_work": runtime_calls,
                "note": f"the traces hold {runtime_calls:,} CUDA/HIP runtime and driver calls (launches among them) but no kernel, "
                        "copy or memset: the profiler recorded the launches, not the GPU's work (ProfilerActivity.CUDA "
                        "off, or CUPTI lost its records), so GPU idle, kernels and collectives cannot be measured"}
    if windows.is_empty():
        return {"idle_share": None, "note": "no device activity in the traces (CPU-only or no kernels)"}
    totals = windows.select(pl.col("span_ns", "idle_ns", "host_bound_ns", "sync_ns", "other_ns").sum()).row(0, named=True)
    causes = {c: totals[f"{c}_ns"] for c in CAUSES}
    share = totals["idle_ns"] / totals["span_ns"] if totals["span_ns"] else None
    main = max(causes, key=causes.get) if share is not None and share >= MAIN_CAUSE_MIN_IDLE_SHARE else None
    return {
        "idle_share": share,
        "main_cause": main,
        "slowest_launch": slowest_launch(launches if launches is not None else pl.DataFrame(), windows)
        if main == "host_bound" else None,
        **{f"{c}_ns": v for c, v in causes.items()},
        "definition": "time no stream of the device was busy (every step's work and work launched before the window "
                      "included), over the span from the first to the last device activity of each profiler window (widened to "
                      "the profiled steps where they start earlier or end later); "
                      "summed over ranks, devices and windows",
    }


# ---------------------------------------------------------------------------------------------
# What it says


IDLE_CAUSE_WORDS = {"host_bound": "host-bound: the GPU waited for the CPU to launch work",
                    # the whole gap: the call emptied the queue, so the host's own work after it (a loader, the
                    # step's Python) was not overlapped with the GPU's; most of it is often after the call returned
                    "sync": "synchronization: a synchronize, .item() or blocking copy emptied the GPU's queue, "
                            "which then stayed empty until the CPU launched again",
                    "other": "other: the next work was already queued (the device's own gaps between kernels, "
                             "cross-stream or event waits) or its launch is not in the trace"}


def gpu_idle_lines(idle: dict, findings: dict) -> list[str]:
    if idle.get("no_traces"):
        return [sentence(idle["no_traces"])]
    if idle.get("runtime_calls_without_device_work"):
        return [f"GPU idle: not measured: {idle['note']}."]
    if idle.get("idle_share") is None:
        return []
    cause = f"; main cause {IDLE_CAUSE_WORDS[idle['main_cause']]}" if idle.get("main_cause") in IDLE_CAUSE_WORDS else ""
    # the verdict's idle is the steps' (step_breakdown): where it differs, say both are right and what each covers
    split = (findings.get("step_breakdown") or {}).get("time_split") or {}
    steps = (f"; {split['idle_share']:.1%} inside the profiled steps' device spans, the verdict's figure"
             if split.get("idle_share") is not None and abs(split["idle_share"] - idle["idle_share"]) >= 0.001 else "")
    if slow := idle.get("slowest_launch"):
        where = ", the rank with the most host-bound idle" if slow.get("ranks", 1) > 1 else ""
        cause += (f"; the longest launch call took {duration(slow['api_ns'])} ({slow['launch_api']}, rank "
                  f"{slow['rank']}{where}; its median {duration(slow['api_ns_median'])})")
    return [f"GPU idle: {idle['idle_share']:.1%} of the profiled time (no stream busy, from the first device activity "
            f"or profiled step to the last{steps}){cause}"
            f"{profiler_effect.window_note(findings.get('profiler_after_effect'))}."]


# ---------------------------------------------------------------------------------------------
# Its report section


def cpu_gpu_section(page, run):
    """Launch delays, device idle by cause, the launch APIs and the synchronization points."""
    launches = run.table("kernel_launches", ["queue_ns"])  # one row per device activity: read only what is drawn
    idle, sync = run.table("gpu_idle"), run.table("sync_points")
    if launches.is_empty():
        return page.section("CPU vs GPU", "cpu-gpu", empty="No device activity in the traces (CPU-only run or no kernels).")
    section = page.section("CPU vs GPU", "cpu-gpu")
    if (launches["queue_ns"] > 0).any():
        section.figure("launch_delay", launches)
    whole_window = idle.filter((pl.col("stream") == ALL_STREAMS) & pl.col("step").is_null())
    if not whole_window.is_empty():
        section.text("Device idle over the whole traced window, per rank, by cause:")
        section.figure("idle_by_cause", whole_window)
    section.text("Launch APIs per rank, most GPU time first:")
    section.rows(run.table("launch_summary").sort("gpu_ns_total", descending=True), {
        "rank": ("rank", "text"), "launch_api": ("launch API", "text"), "activities": ("activities", "num"),
        "api_ns_median": ("API call median", "ms"), "queue_ns_median": ("queueing median", "ms"),
        "queue_ns_p90": ("queueing p90", "ms"), "gpu_ns_total": ("GPU time launched", "ms")}, "launch_summary")
    if not sync.is_empty():
        section.text("Synchronization points that left the GPU idle longest (the idle after each, until the CPU "
                     "launched again: the call itself and the host's work after it):")
        section.rows(sync, {
            "rank": ("rank", "text"), "step": ("step", "text"), "name": ("call", "text"),
            "issuing_op": ("issued by", "text"), "dur_ns": ("call duration", "ms"),
            "idle_caused_ns": ("GPU idle caused", "ms")}, "sync_points")
    return section


# ---------------------------------------------------------------------------------------------
# The analysis

NO_TRACES = "no profiler traces: step, GPU and collective analyses need them"


def _unopened_window(facts: dict) -> str | None:
    """Why the collector's profiler wrote no trace when its first window was to open after the run's last step."""
    windows = [step for step, reason in alarm_rules.profiled_steps((facts.get("settings") or {}).get("profile"))
               if reason == "profiler_window"]
    completed = [state.get("steps_completed") for key, state in facts.items()
                 if key.startswith("collector_rank") and isinstance(state, dict)]
    completed = [n for n in completed if type(n) is int and n >= 0]
    if not windows or not completed or min(windows) < max(completed):
        return None
    return (f"no profiler traces: the collector's profiler window was to open at step {min(windows)}, after the "
            f"run's last step ({max(completed) - 1}); open it earlier (profile skip_first and wait) to trace this run")


def _idle(inputs: Inputs) -> Output:
    if not inputs.ranks:
        return Output(finding={"no_traces": _unopened_window(inputs.facts) or NO_TRACES})
    idle, sync_points = inputs.table("_gpu_idle"), inputs.table("_sync_points")
    return Output(tables={"gpu_idle": idle,
                          "sync_points": sync_points.sort("idle_caused_ns", descending=True).head(SYNC_POINTS_KEPT)},
                  finding=idle_finding(idle, inputs.context.runtime_calls if inputs.context else 0,
                                       inputs.table("launch_summary")))


GPU_IDLE = schema.table_spec(
    ("rank", pa.int64(), "Rank."),
    ("device", pa.int64(), "GPU."),
    ("stream", pa.int64(), "Stream, or -1: the whole device (idle only when no stream is busy)."),
    ("step", pa.int64(), "Step; null only on the whole-window rows (stream -1: all device work of the profiler "
                         "window)."),
    ("span_start_ns", pa.int64(), "First start of the row's device work (the step's on the stream, or the window's); "
                                  "on a step's device row, earlier where the device sat idle before that work with the "
                                  "step begun on the CPU: the latest of the step's start, the device's previous work's "
                                  "end (none: the step's start) and earlier steps' spans' ends; on a window row, "
                                  "earlier where its first step with work on the device began earlier on the CPU."),
    ("span_end_ns", pa.int64(), "Last end of the row's device work; on a step's device row, later where the device sat "
                                "idle after it with the step still running on the CPU: the step's end, or the next "
                                "step's first work if sooner (not where an earlier step's work ran on past it); on a "
                                "window row, later where its last step with work on the device ended later."),
    ("span_ns", pa.int64(), "The span."),
    ("busy_ns", pa.int64(), "Part of the span the device (stream -1) or the stream was busy; stream -1 rows count "
                            "every step's work and work launched before the window."),
    ("idle_ns", pa.int64(), "span_ns - busy_ns."),
    ("host_bound_ns", pa.int64(), "Idle with nothing queued: the GPU waited for the CPU to launch."),
    ("sync_ns", pa.int64(), "Idle while the launching thread sat in a synchronizing call."),
    ("other_ns", pa.int64(), "Idle with the next work already queued (the device's own gaps between kernels, "
                             "cross-stream or event waits) or its launch not recorded."),
    ("activities", pa.int64(), "Device activities of the row (the step's, the stream's, or the window's)."),
    ("source", pa.string(), "Profiler window (trace file) the row belongs to."),
)

SYNC_POINTS = schema.table_spec(
    ("rank", pa.int64(), "Rank."),
    ("step", pa.int64(), "ProfilerStep the call ran in (its CPU time window)."),
    ("name", pa.string(), "Synchronizing call."),
    ("issuing_op", pa.string(), "Innermost CPU op, annotation or frame around it."),
    ("ts_ns", pa.int64(), "Start of the call."),
    ("dur_ns", pa.int64(), "Its duration."),
    ("idle_caused_ns", pa.int64(), "Device idle it caused (sync gaps)."),
)


ANALYSIS = Analysis("gpu_idle", "GPU idle", ("_gpu_idle", "_sync_points", "launch_summary"), {"gpu_idle": GPU_IDLE, "sync_points": SYNC_POINTS},
                    _idle, former_keys={"traces": "no_traces"}, phrase=gpu_idle_lines, section=cpu_gpu_section)
