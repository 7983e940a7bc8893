"""What a trace means, whatever format it came in: step windows, which step each event belongs to,
which runtime call launched which device work.

A trace importer (kineto.py today) decodes its format into one events table and one table of flow
endpoints; `apply` adds the rest. The events table holds one row per complete or instant event,
sorted by `ts_ns`, with `event_id` (its row number), `ts_ns`, `dur_ns` (null for instants), `kind`
(schema.KINDS), `name`, `pid`, `tid` and `correlation` (the runtime's id linking a launch call to
the device work it enqueued; null where absent). The endpoints table holds one row per flow event:
`ph` (s, f or t), `cat`, `pid`, `tid`, `ts_ns`, `flow_id`.
"""

from __future__ import annotations

import re

import polars as pl

from steplens.analyze.contract import schema
from steplens.analyze.contract.issue_reasons import EVENTS_LOST_SHARE, Issue
from steplens.analyze.contract.schema import WORK_KINDS
from steplens.analyze.contract.units import duration

STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
MAX_STEP = 2**31 - 1  # ProfilerStep numbers; a step counter past 2 billion is damage

LAUNCH_KINDS = ("cuda_runtime", "cuda_driver")  # host API calls, some of which enqueue device work
# Runtime/driver calls that enqueue device work. Covers every launch API in the corpus
# (cudaLaunchKernel[ExC], cuLaunchKernel[Ex], cudaGraphLaunch, hipLaunchKernel,
# hipExtModuleLaunchKernel, hipModuleLaunchKernel, hipGraphLaunch) and async/sync copies and sets.
LAUNCH_API = re.compile(
    r"^(cuda|cu|hip)(Ext)?(Module)?Launch|^(cuda|cu|hip)GraphLaunch|^(cuda|cu|hip)Memcpy|^(cuda|cu|hip)Memset"
)

HOST_KINDS = ("cpu_op", "user_annotation", "python_function", *LAUNCH_KINDS)
# The profiler records device work only while its window is open, so work further from the window's host events
# than the window's own length (at least this) is a clock glitch, not work of the window: one such kernel made a
# 1 ms window 1000 s long and "100% idle". Kept in trace_events, counted, and left out of the device analyses.
MIN_WINDOW_MARGIN_NS = 1_000_000_000

# Flow categories that link a CPU launch to device work: `ac2g` (PyTorch >= 1.10) and the legacy
# names Kineto used before it.
LAUNCH_FLOW_CATEGORIES = {"ac2g", "async", "async_gpu", "async_cpu_to_gpu"}
FWDBWD_FLOW_CATEGORY = "fwdbwd"

FLOW_LINK_SCHEMA = {
    "flow_type": pl.String,
    "src_event_id": pl.Int64,
    "dst_event_id": pl.Int64,
    "via": pl.String,
    "flow_id": pl.Int64,
}


def device_window(host: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """Per `keys` (none: the whole frame), where device work of the window may lie: from the first start to
    the last end of the host events (`host`: HOST_KINDS rows), each widened by the window's length (at least
    MIN_WINDOW_MARGIN_NS). Null bounds where there are no host events (a device-only trace): nothing is judged."""
    # In float64: a window of damaged times can span more than int64 holds, and a bound a few hundred ns off
    # (float64's spacing at epoch-ns magnitudes) does not matter against a margin of a second or more.
    edges = dict(first_ns=pl.col("ts_ns").min().cast(pl.Float64),
                 last_ns=(pl.col("ts_ns") + pl.col("dur_ns").fill_null(0)).max().cast(pl.Float64))
    bounds = host.group_by(keys).agg(**edges) if keys else host.select(**edges)
    margin = pl.max_horizontal(pl.col("last_ns") - pl.col("first_ns"), pl.lit(float(MIN_WINDOW_MARGIN_NS)))
    return bounds.select(*keys, earliest_ns=pl.col("first_ns") - margin, latest_ns=pl.col("last_ns") + margin)


def unusable_device_work(work: pl.DataFrame, bounds: pl.DataFrame, keys: list[str]) -> pl.Series:
    """Per row of `work` (device work), whether its time cannot be used: a negative duration, or outside the
    `device_window` bounds of its keys."""
    joined = (work.join(bounds, on=keys, how="left", maintain_order="left") if keys
              else work.select("ts_ns", "dur_ns").join(bounds, how="cross"))
    start = pl.col("ts_ns").cast(pl.Float64)
    outside = (start < pl.col("earliest_ns")) | (start + pl.col("dur_ns").fill_null(0).cast(pl.Float64) > pl.col("latest_ns"))
    return joined.select(unusable=((pl.col("dur_ns") < 0) | outside).fill_null(False))["unusable"]


def apply(events: pl.DataFrame, endpoints: pl.DataFrame, issues: list[Issue],
          step_name: re.Pattern = STEP_NAME) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(events with `is_launch`, `step` and `launch_event_id`, steps, flow links); what does not
    hold together (orphan device work, unpaired flows, damaged step numbers) is added to `issues`.
    `step_name` matches the host ranges that are steps, the step number in its first group."""
    events = _without_repeated_events(events, issues)
    events = events.with_columns(
        is_launch=pl.col("kind").is_in(LAUNCH_KINDS) & pl.col("name").str.contains(LAUNCH_API.pattern))
    steps = step_windows(events, issues, step_name)
    launched = launch_links(events, issues)
    events = assign_steps(events, steps, launched)
    flows = links(events, launched, endpoints, issues)
    _count_stray_device_work(events, issues)
    _count_streamless_device_work(events, issues)
    launched_by = flows.filter(pl.col("flow_type") == "launch").unique("dst_event_id", keep="first").select(
        event_id="dst_event_id", launch_event_id="src_event_id")
    events = events.join(launched_by, on="event_id", how="left", maintain_order="left")
    return events, steps, flows


def _without_repeated_events(events: pl.DataFrame, issues: list[Issue]) -> pl.DataFrame:
    """The events with each one listed twice or more (every field equal: a rank's events written twice into one file,
    traces merged with themselves) kept once, counted (repeated_events). Only rows that cannot be two real events are
    judged: device work that took time (a stream runs one activity at a time) and calls with a correlation or External
    id (each call's own); identical host ops without an id may be a recursion timed within one clock tick."""
    ts = pl.col("ts_ns")
    # Repeats share their ts, so in ts order they sit among rows whose neighbour has the same ts: a few columns of
    # those first (about 2 ms a 75k-event rank), every column only where those few repeat
    ids = [c for c in ("correlation", "external_id") if c in events.columns]
    # (on a thread or stream that is not known, two rows may have been on two: not judged)
    judged = pl.col("tid").is_not_null() & pl.any_horizontal(pl.col("kind").is_in(WORK_KINDS) & (pl.col("dur_ns") > 0),
                                                             *(pl.col(c).is_not_null() for c in ids))
    keys = [c for c in ("ts_ns", "dur_ns", "tid", *ids) if c in events.columns]
    same_tick = events.select(pl.int_range(pl.len(), dtype=pl.UInt32).alias("row"), *keys, "kind").filter(
        judged & ((ts == ts.shift(1)) | (ts == ts.shift(-1))))
    same_tick = same_tick.filter(pl.struct(keys).is_duplicated())
    if same_tick.is_empty():
        return events
    rows = events[same_tick["row"]]
    fields = [c for c in events.columns if c != "event_id"]
    repeats = rows.with_columns(row=same_tick["row"]).filter(pl.struct(fields).is_first_distinct().not_())["row"]
    if repeats.is_empty():
        return events
    issues.append(Issue("warning", "repeated_events", repeats.len(),
                        "events listed more than once in the file (every field equal: device work, or calls with an id), "
                        "as when a rank's events are written twice or traces merged with themselves; each counted once"))
    kept = events.filter(~pl.int_range(pl.len(), dtype=pl.UInt32).is_in(repeats.implode()))
    return kept.with_columns(event_id=pl.int_range(pl.len(), dtype=pl.Int64))


def _count_stray_device_work(events: pl.DataFrame, issues: list[Issue]) -> None:
    work = events.filter(pl.col("kind").is_in(WORK_KINDS))
    if work.is_empty():
        return
    bounds = device_window(events.filter(pl.col("kind").is_in(HOST_KINDS)), [])
    stray = work.filter(unusable_device_work(work, bounds, []) & (pl.col("dur_ns").fill_null(0) >= 0))
    if stray.height:
        edge = bounds.row(0, named=True)
        issues.append(Issue("warning", "device_activity_outside_window", stray.height,
                            f"device activities {_side_of_window(stray, edge)} the trace's host events (more than the window's "
                            "length, and at least 1 s): a clock glitch; kept in trace_events, left out of the device analyses"))


def _count_streamless_device_work(events: pl.DataFrame, issues: list[Issue]) -> None:
    """Device work with no stream (no args.stream and a thread id that is no number; an export without streamId) has
    no place on the device's timeline: the busy and idle figures leave it out, so that is data lost, said."""
    if "stream" not in events.columns:  # (a format that has no streams: nothing placed by one)
        return
    lost, work = events.select(lost=(pl.col("kind").is_in(WORK_KINDS) & pl.col("stream").is_null()).sum(),
                               work=pl.col("kind").is_in(WORK_KINDS).sum()).row(0)
    if lost:
        # a tenth of the device work or more is its figures lost (as for events_lost at ingest); a few, a warning
        issues.append(Issue("error" if lost >= EVENTS_LOST_SHARE * work else "warning", "events_lost", lost,
                            f"{lost:,} of {work:,} device activities without a stream (the trace names none for them): "
                            "kept in trace_events, out of the GPU timeline (busy, idle, exposed communication)"))


def _side_of_window(stray: pl.DataFrame, edge: dict) -> str:
    before = stray.filter(pl.col("ts_ns") < edge["earliest_ns"]).height
    return ("before" if before == stray.height else "after" if not before else "before or after") + " the window of"


def step_windows(events: pl.DataFrame, issues: list[Issue], step_name: re.Pattern = STEP_NAME) -> pl.DataFrame:
    """One row per host annotation named as a step (`ProfilerStep#N` unless `step_name` says otherwise):
    step, start_ns, end_ns, dur_ns, pid, tid."""
    # A literal prefix first: the regex then runs only on the few names that start like a step
    prefix = pl.col("name").str.starts_with("ProfilerStep#") if step_name is STEP_NAME else pl.col("name").str.contains(step_name.pattern)
    marked = events.filter(
        prefix
        & pl.col("dur_ns").is_not_null()
        & ~pl.col("kind").is_in(schema.DEVICE_KINDS)
    ).with_columns(digits=pl.col("name").str.extract(step_name.pattern))
    number = pl.col("digits").cast(pl.Int64, strict=False)
    # ("ProfilerStep#-5", "ProfilerStep#": named as steps, with no step number the pattern takes)
    damaged = marked.filter(~number.is_between(0, MAX_STEP).fill_null(False))
    if damaged.height:
        # what the step pattern's group captured: digits past the step limit, nothing, or (a pattern given with
        # --step-range) text that is no number at all
        digits = damaged["digits"][0]
        why = ("a step annotation without a step number" if digits is None else
               f"step numbers above {MAX_STEP} are damage, not steps" if digits.isdigit() else
               f"the step pattern's group captured {digits!r:.40}, not a step number")
        issues.append(Issue("warning", "bad_step_number", damaged.height, f"{why}; those events are kept as plain "
                            f"events, e.g. {damaged['name'][0]!r:.80}"))
    steps = (
        marked.filter(number.is_between(0, MAX_STEP))
        .select(
            step=number,
            start_ns="ts_ns",
            end_ns=pl.col("ts_ns") + pl.col("dur_ns"),
            dur_ns="dur_ns",
            pid="pid",
            tid="tid",
        )
        .drop_nulls("step")
        .sort("start_ns")
    )
    steps = _without_reused_numbers(steps, issues)
    # Ranges of one number nested on one thread ("iteration 3" holding "step 3") are one step: one row a thread
    # (the spans left of a number overlap, so their hull is each thread's span of the step)
    steps = steps.group_by("step", "pid", "tid", maintain_order=True).agg(
        pl.col("start_ns").min(), pl.col("end_ns").max()).select(
        "step", "start_ns", "end_ns", dur_ns=pl.col("end_ns") - pl.col("start_ns"), pid="pid", tid="tid").sort("start_ns")
    _count_overlapping_steps(steps, issues)
    return steps


STEP_OVERLAP_SLACK_NS = 1_000  # a microsecond: Kineto writes times in us, a step's end rounded past the next's start


def _count_overlapping_steps(steps: pl.DataFrame, issues: list[Issue]) -> None:
    """Steps of one thread run one after another: one that starts before the thread's step before it ended holds
    time of that step too (the step annotations were edited, or two runs' traces merged). Counted, kept as given."""
    thread = ["pid", "tid"]
    ordered = steps.sort(*thread, "start_ns", maintain_order=True).with_columns(
        before_step=pl.col("step").shift(1).over(thread), before_end_ns=pl.col("end_ns").shift(1).over(thread))
    overlapping = ordered.filter(pl.col("start_ns") < pl.col("before_end_ns") - STEP_OVERLAP_SLACK_NS)
    if overlapping.height:
        first = overlapping.row(0, named=True)
        issues.append(Issue("warning", "overlapping_steps", overlapping.height,
                            f"steps that start before the step before them on their thread ended (step {first['step']} "
                            f"starts {(first['before_end_ns'] - first['start_ns']) / 1e6:.3g} ms before step "
                            f"{first['before_step']} ends): step times from them hold that time twice"))


def _without_reused_numbers(steps: pl.DataFrame, issues: list[Issue]) -> pl.DataFrame:
    """A step number marking spans one after another (the profiler's counter restarted within one trace, or
    annotations copied) names no one step: every analysis would merge them into one from the first start to the last
    end. Such numbers are left out of the steps (their events stay, with no step) and counted; spans of one number
    that overlap (the step annotated on several threads) are one step."""
    earlier_end = pl.col("end_ns").cum_max().shift(1).over("step")
    reused = steps.filter(pl.col("start_ns") >= earlier_end)["step"].unique().sort()
    if reused.is_empty():
        return steps
    spans = steps.filter(pl.col("step").is_in(reused.implode()))
    first = spans.filter(pl.col("step") == reused[0])
    issues.append(Issue("warning", "reused_step_number", spans.height,
                        f"step number(s) {', '.join(map(str, reused.head(5).to_list()))}"
                        f"{' and more' if reused.len() > 5 else ''} each mark spans one after another (step "
                        f"{reused[0]}: {first.height} spans, {first['dur_ns'].min() / 1e6:.3g}-"
                        f"{first['dur_ns'].max() / 1e6:.3g} ms each): a number must name one step, so they are left "
                        "out of the steps (their events are kept, with no step)"))
    return steps.filter(~pl.col("step").is_in(reused.implode()))


def assign_steps(events: pl.DataFrame, steps: pl.DataFrame, launched: pl.DataFrame) -> pl.DataFrame:
    """CPU events get the step whose window holds their start; device events the step of their launch call
    (`launched`: launch_links' table).

    `events` is sorted by ts_ns (event_id order), which the as-of join needs and keeps."""
    if steps.is_empty():
        return events.with_columns(step=pl.lit(None, pl.Int64))
    windows = steps.select("start_ns", step_end_ns="end_ns", window_step="step").sort("start_ns")
    events = events.join_asof(windows, left_on="ts_ns", right_on="start_ns", strategy="backward", check_sortedness=False)
    events = events.with_columns(time_step=pl.when(pl.col("ts_ns") < pl.col("step_end_ns")).then(pl.col("window_step")))
    launch_steps = launched.join(events.select(src_event_id="event_id", launch_step="time_step"), on="src_event_id").select(
        event_id="dst_event_id", launch_step="launch_step")
    # Device work takes its launch's step, and none when its launch is not in the file (enqueued before
    # the window): a time guess would put it in whichever step was open when it ran.
    work = pl.col("kind").is_in(WORK_KINDS)
    events = events.join(launch_steps, on="event_id", how="left", maintain_order="left").with_columns(
        step=pl.when(work).then(pl.col("launch_step")).otherwise(pl.col("time_step"))
    )
    return events.drop("start_ns", "step_end_ns", "window_step", "time_step", "launch_step")


# A reused correlation id's activity is linked to the last call with the id that started before it, or this little
# after it: device and host clocks disagree by microseconds.
LINK_CLOCK_SLACK_NS = 100_000


def launch_links(events: pl.DataFrame, issues: list[Issue]) -> pl.DataFrame:
    """Launch -> device work by correlation id. A graph launch links to every kernel it ran.

    A correlation id is one call's: where a trace repeats one among its calls of one kind (profiler windows appended
    into one file, traces merged), each activity takes the call with its id that started last before it (clock skew
    allowed: LINK_CLOCK_SLACK_NS), a launch API before another call, and the repeats are counted (correlation_reused)."""
    # The columns first: a filter copies every column it holds (over a third of the semantics stage)
    ids = events.select("event_id", "kind", "correlation", "is_launch", "ts_ns")
    calls = ids.filter(pl.col("kind").is_in(LAUNCH_KINDS) & pl.col("correlation").is_not_null()).drop("kind")
    device = ids.filter(pl.col("kind").is_in(WORK_KINDS) & pl.col("correlation").is_not_null()).select(
        "event_id", "correlation", "ts_ns")
    # one call per id: the launch API, then the first
    first = calls.sort(["correlation", "is_launch", "event_id"], descending=[False, True, False], maintain_order=True).unique(
        "correlation", keep="first").select("correlation", src_event_id="event_id")
    linked = device.join(first, on="correlation", how="inner")
    reused = calls.filter(pl.struct("correlation", "is_launch").is_duplicated())
    if not reused.is_empty():
        repeats = reused.height - reused.select("correlation", "is_launch").n_unique()
        issues.append(Issue("warning", "correlation_reused", repeats,
                            "runtime calls whose correlation id an earlier call of the same role (launch API or other) "
                            "has (profiler windows appended into one file, or traces merged); each device activity is "
                            "linked to the call with its id that started last before it"))
        ids_reused = reused["correlation"].unique().implode()
        candidates = calls.filter(pl.col("correlation").is_in(ids_reused) & pl.col("ts_ns").is_not_null())
        # a launch API before another call with the id
        candidates = candidates.filter(pl.col("is_launch") | ~pl.col("is_launch").any().over("correlation"))
        timed = linked.filter(pl.col("correlation").is_in(ids_reused) & pl.col("ts_ns").is_not_null()).with_columns(
            skewed_ns=pl.col("ts_ns") + LINK_CLOCK_SLACK_NS).sort("skewed_ns").join_asof(
            candidates.select("correlation", call_ns="ts_ns", latest_src="event_id").sort("call_ns"), left_on="skewed_ns",
            right_on="call_ns", by="correlation", strategy="backward", check_sortedness=False)
        linked = linked.join(timed.select("event_id", "latest_src"), on="event_id", how="left").with_columns(
            src_event_id=pl.coalesce("latest_src", "src_event_id"))  # none before it (clock skew): the first
    return linked.select(
        flow_type=pl.lit("launch"),
        src_event_id="src_event_id",
        dst_event_id="event_id",
        via=pl.lit("correlation"),
        flow_id="correlation",
    )


def flow_links(events: pl.DataFrame, endpoints: pl.DataFrame, issues: list[Issue]) -> pl.DataFrame:
    """Pair s/f flow events and bind each end to the innermost slice starting at that time."""
    if endpoints.is_empty():
        return pl.DataFrame(schema=FLOW_LINK_SCHEMA)
    endpoints = endpoints.filter(pl.col("flow_id").is_not_null())
    starts = endpoints.filter(pl.col("ph") == "s")
    ends = endpoints.filter(pl.col("ph").is_in(["f", "t"]))
    pairs = starts.join(ends, on=["cat", "flow_id"], how="inner", suffix="_dst").unique(["cat", "flow_id"], keep="first")
    unmatched_starts = starts.height - starts.join(ends, on=["cat", "flow_id"], how="semi").height
    if unmatched_starts:
        issues.append(Issue("info", "flow_without_end", unmatched_starts,
                            "flow starts whose end is outside the trace window (e.g. a launch whose kernel was not recorded)"))
    # Only the slices starting where a flow end lies can bind one (a third of the time on a real A100 rank)
    ends_at = pl.concat([pairs.select("pid", "tid", "ts_ns"),
                         pairs.select(pid="pid_dst", tid="tid_dst", ts_ns="ts_ns_dst")]).unique()
    slices = events.select("event_id", "pid", "tid", "ts_ns", "dur_ns").filter(pl.col("dur_ns").is_not_null()).join(
        ends_at, on=["pid", "tid", "ts_ns"], how="semi", maintain_order="left")
    # The shortest slice at each start (the first written among equals); a filter finds them in half a unique's time
    innermost = slices.sort("dur_ns", maintain_order=True).filter(pl.struct("pid", "tid", "ts_ns").is_first_distinct()).drop("dur_ns")
    src = innermost.rename({"event_id": "src_event_id"})
    dst = innermost.rename({"event_id": "dst_event_id", "pid": "pid_dst", "tid": "tid_dst", "ts_ns": "ts_ns_dst"})
    linked = pairs.join(src, on=["pid", "tid", "ts_ns"], how="inner").join(dst, on=["pid_dst", "tid_dst", "ts_ns_dst"], how="inner")
    unbound = pairs.height - linked.height
    if unbound:
        issues.append(Issue("info", "flow_unbound", unbound, "flow pairs whose start or end matches no slice; not linked"))
    flow_type = pl.when(pl.col("cat").is_in(list(LAUNCH_FLOW_CATEGORIES))).then(pl.lit("launch")).otherwise(
        pl.when(pl.col("cat") == FWDBWD_FLOW_CATEGORY).then(pl.lit("fwdbwd")).otherwise(pl.col("cat"))
    )
    return linked.select(
        flow_type=flow_type,
        src_event_id="src_event_id",
        dst_event_id="dst_event_id",
        via=pl.lit("flow_event"),
        flow_id="flow_id",
    )


def links(events: pl.DataFrame, by_correlation: pl.DataFrame, endpoints: pl.DataFrame, issues: list[Issue]) -> pl.DataFrame:
    """Launch links by correlation (launch_links), plus the links only flow events give; orphan device work counted."""
    by_flow = flow_links(events, endpoints, issues)
    # Correlation is authoritative for launches; flow events add only the links it cannot see.
    extra = by_flow.join(by_correlation, on="dst_event_id", how="anti")
    flows = pl.concat([by_correlation.cast(FLOW_LINK_SCHEMA), extra.cast(FLOW_LINK_SCHEMA)]).sort("src_event_id", "dst_event_id")
    launched = flows.filter(pl.col("flow_type") == "launch")["dst_event_id"].implode()
    orphans = events.select("kind", "event_id", "dur_ns").filter(pl.col("kind").is_in(WORK_KINDS) & ~pl.col("event_id").is_in(launched))
    if orphans.height:
        issues.append(Issue("warning", "orphan_device_activity", orphans.height,
                            f"device activities ({duration(orphans['dur_ns'].fill_null(0).clip(lower_bound=0).sum())} of GPU "
                            "time) whose launch is not "
                            "in the trace (enqueued before the profiler window opened, or the call cut from the file): no step, "
                            "no launch API; they still count as device busy time"))
    return flows
