"""Where one step's device time went, per rank: compute, exposed communication, idle by cause; and
the timeline of the slowest profiled step across ranks on one clock.

Definitions, per rank, profiler window (source), device and step, on the same device-busy timeline
as gpu_idle (the union of all the device's work in the window, of every step, launched or not):
- span_ns: gpu_idle's step span (launch.step_spans): from the first start of the device work launched in the step
  or, where the device sat idle before it with the step begun on the CPU, from the later of the step's start and
  the device's previous work's end (the idle that opens a step is the step's); to that work's last end or, where
  the device sat idle after it with the step still running on the CPU, to the step's end (or the next step's first
  work; the idle that closes a step is the step's too);
- compute_ns: the part of the span covered by non-communication work (kernels, copies, sets);
- exposed_comm_ns: the part covered by communication kernels (the `collectives` table) and not by
  compute, so overlapped communication is not counted twice;
- idle_ns: the rest, split by cause as in gpu_idle (host-bound, sync, other).
compute_ns + exposed_comm_ns + idle_ns = span_ns.

The timeline holds the same three activities as segments of the slowest profiled step on the
reference rank's clock (aligned = ts - clock offset). Gaps shorter than 1/TIMELINE_RESOLUTION of
the step's span are closed, so the table (and a picture of it) stays small whatever the kernel count.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import polars as pl
import pyarrow as pa

from steplens.analyze.analyses import launch, steps
from steplens.analyze.contract.schema import ALL_STREAMS
from steplens.analyze.trace import intervals
from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.contract import schema

TIMELINE_RESOLUTION = 1000  # segments resolved to 1/1000 of the step's span
LAUNCH_COLUMNS = ["rank", "source", "event_id", "step", "device", "stream", "ts_ns", "dur_ns"]
# event_id is unique within (rank, source) and collectives has no source: start and duration tell sources apart.
COMM_KEYS = ["rank", "event_id", "ts_ns", "dur_ns"]
LANE = ["rank", "source", "device"]

BREAKDOWN_SCHEMA = {"rank": pl.Int64, "source": pl.String, "device": pl.Int64, "step": pl.Int64, "span_ns": pl.Int64,
                    "compute_ns": pl.Int64, "exposed_comm_ns": pl.Int64, "idle_ns": pl.Int64, "host_bound_ns": pl.Int64,
                    "sync_ns": pl.Int64, "other_ns": pl.Int64}
TIMELINE_SCHEMA = {"rank": pl.Int64, "step": pl.Int64, "activity": pl.String, "start_ns": pl.Int64, "end_ns": pl.Int64}


def step_breakdown_tables(launch_parts: Iterable[pl.DataFrame], collectives: pl.DataFrame, gpu_idle: pl.DataFrame,
                          step_stats: pl.DataFrame, offsets: pl.DataFrame) -> tuple[dict[str, pl.DataFrame], np.ndarray]:
    """step_breakdown (every rank and step) and step_timeline (the slowest profiled step); and _Lane's covered_by_steps
    summed over the devices.

    `launch_parts` yields kernel_launches rows (LAUNCH_COLUMNS) a few whole ranks at a time (the parts the
    per-rank analyses wrote), so memory is bounded by the largest part; each part is one pass, whatever its
    ranks (a pass a rank made 32 small ranks' breakdown a quarter of their analyses)."""
    slowest = slowest_profiled_step(step_stats)
    comm_ids = collectives.select(*COMM_KEYS).unique().with_columns(is_comm=pl.lit(True))
    offset_of = {} if offsets.is_empty() else dict(  # rank -> offset_ns (null: not aligned, drawn on its own clock)
        offsets.select("rank", pl.col("offset_ns").fill_null(0)).iter_rows())  # rowwise-ok: one row per rank
    # A trace refused as a rank of this job (steps.unalignable) is not drawn beside the others.
    refused = set(steps.refused_ranks(offsets))
    keys = LANE + ["step"]
    step_rows = gpu_idle.filter((pl.col("stream") == ALL_STREAMS) & pl.col("step").is_not_null())
    spans = step_rows.select(*keys, "span_start_ns", "span_end_ns")
    breakdowns, timelines, covered = [], [], np.zeros(3, np.int64)
    for part in launch_parts:
        for lane in _lanes(_work(part, comm_ids), spans):
            breakdowns.append(lane.breakdown())
            covered += lane.covered_by_steps()
            rank = lane.key["rank"]
            if slowest is not None and rank not in refused:
                timelines.append(lane.timeline(slowest, offset_of.get(rank, 0)))
    breakdowns = [b for b in breakdowns if not b.is_empty()]
    if not breakdowns:
        return {"step_breakdown": pl.DataFrame(schema=BREAKDOWN_SCHEMA),
                "step_timeline": pl.DataFrame(schema=TIMELINE_SCHEMA)}, covered
    causes = step_rows.select(*keys, *[pl.col(c).cast(pl.Int64) for c in ("host_bound_ns", "sync_ns", "other_ns")])
    breakdown = pl.concat(breakdowns).join(causes, on=keys, how="left", nulls_equal=True).with_columns(
        idle_ns=pl.col("span_ns") - pl.col("compute_ns") - pl.col("exposed_comm_ns"))
    return {"step_breakdown": breakdown.select(list(BREAKDOWN_SCHEMA)).cast(BREAKDOWN_SCHEMA).sort("step", "rank", "device"),
            "step_timeline": pl.concat([pl.DataFrame(schema=TIMELINE_SCHEMA)] + timelines).sort("rank", "start_ns")}, covered


def slowest_profiled_step(step_stats: pl.DataFrame) -> int | None:
    """The profiled step with the longest wall time across ranks (aligned clock), else the longest CPU step."""
    if step_stats.is_empty():
        return None
    ranked = step_stats.sort(pl.coalesce("aligned_dur_ns", "max_dur_ns"), "step", descending=[True, False], nulls_last=True)
    return ranked["step"][0]


def _work(launched: pl.DataFrame, comm_ids: pl.DataFrame) -> pl.DataFrame:
    """All device work (with or without a step), with its end and whether it is communication."""
    work = launched.filter(pl.col("stream").is_not_null() & (pl.col("dur_ns") >= 0))
    return work.join(comm_ids, on=COMM_KEYS, how="left").select(
        *LANE, "step", "ts_ns", end_ns=pl.col("ts_ns") + pl.col("dur_ns"), is_comm=pl.col("is_comm").fill_null(False))


class _Lane:
    """One device timeline (rank, window, device): the union of all its work and of its compute, and the
    span of each of its steps (launch.step_spans)."""

    def __init__(self, key: dict, starts: np.ndarray, ends: np.ndarray, is_comm: np.ndarray, spans: pl.DataFrame):
        self.key = key
        self.busy = intervals.union(starts, ends)
        self.compute = intervals.union(starts[~is_comm], ends[~is_comm])
        self.exposed = _difference(*intervals.union(starts[is_comm], ends[is_comm]), *self.compute)
        self.steps = spans["step"].to_numpy()
        self.lo, self.hi = spans["span_start_ns"].to_numpy(), spans["span_end_ns"].to_numpy()

    def breakdown(self) -> pl.DataFrame:
        """Span, compute and exposed communication of every step."""
        busy = intervals.covered(*self.busy, self.lo, self.hi)
        compute = intervals.covered(*self.compute, self.lo, self.hi)
        rows = len(self.steps)
        return pl.DataFrame({**{k: pl.Series([self.key[k]] * rows, dtype=BREAKDOWN_SCHEMA[k]) for k in LANE},
                             "step": pl.Series(self.steps, dtype=pl.Int64), "span_ns": pl.Series(self.hi - self.lo),
                             "compute_ns": pl.Series(compute, dtype=pl.Int64),
                             "exposed_comm_ns": pl.Series(busy - compute, dtype=pl.Int64)})

    def covered_by_steps(self) -> np.ndarray:
        """[span, compute, busy] ns over the union of the steps' spans: where consecutive steps' work overlapped (on
        other streams, behind a backlog) the spans overlap, and the time there is counted once."""
        lo, hi = intervals.union(self.lo, self.hi)
        return np.array([int((hi - lo).sum()), int(intervals.covered(*self.compute, lo, hi).sum()),
                         int(intervals.covered(*self.busy, lo, hi).sum())], dtype=np.int64)

    def timeline(self, step: int, offset_ns: int) -> pl.DataFrame:
        """Compute, exposed-communication and idle segments of one step, on the reference clock."""
        at = np.flatnonzero(self.steps == step)
        if not len(at):
            return pl.DataFrame(schema=TIMELINE_SCHEMA)
        lo, hi = int(self.lo[at[0]]), int(self.hi[at[0]])
        min_gap = max((hi - lo) // TIMELINE_RESOLUTION, 1)
        c_s, c_e = _closed(*_clip(*self.compute, lo, hi), min_gap)
        x_s, x_e = _closed(*_clip(*self.exposed, lo, hi), min_gap)
        b_s, b_e = _closed(*_clip(*self.busy, lo, hi), min_gap)
        # idle: between the busy blocks, and from the span's start to the first (the idle that opens the step)
        idle_s, idle_e = np.concatenate([[lo], b_e]), np.concatenate([b_s, [hi]])
        idle = idle_e > idle_s
        names, starts, ends = zip(("compute", c_s, c_e), ("exposed communication", x_s, x_e),
                                  ("idle", idle_s[idle], idle_e[idle]))
        lengths = [len(s) for s in starts]
        return pl.DataFrame({"rank": [self.key["rank"]] * sum(lengths), "step": [step] * sum(lengths),
                             "activity": np.repeat(names, lengths).tolist(),
                             "start_ns": np.concatenate(starts) - offset_ns, "end_ns": np.concatenate(ends) - offset_ns},
                            schema=TIMELINE_SCHEMA)


_NO_SPANS = pl.DataFrame(schema={"step": pl.Int64, "span_start_ns": pl.Int64, "span_end_ns": pl.Int64})


def _lanes(work: pl.DataFrame, step_spans: pl.DataFrame) -> list[_Lane]:
    """A rank's device timelines, in the order they first appear: one pass over its work for all of them.
    `step_spans` holds the steps' spans (gpu_idle's per-step rows: launch.step_spans)."""
    if work.is_empty():
        return []
    spans = dict(step_spans.join(work.select(LANE).unique(), on=LANE, how="semi", nulls_equal=True).sort("step").partition_by(
        LANE, as_dict=True, maintain_order=True))
    lanes = []
    for key, group in work.partition_by(LANE, as_dict=True, maintain_order=True).items():
        lanes.append(_Lane(dict(zip(LANE, key)), group["ts_ns"].to_numpy(), group["end_ns"].to_numpy(),
                           group["is_comm"].to_numpy(), spans.get(key, _NO_SPANS)))
    return lanes


def _clip(starts: np.ndarray, ends: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted blocks cut to [lo, hi)."""
    s, e = np.maximum(starts, lo), np.minimum(ends, hi)
    keep = e > s
    return s[keep], e[keep]


def _closed(starts: np.ndarray, ends: np.ndarray, min_gap: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted blocks with the gaps shorter than min_gap closed."""
    if len(starts) == 0:
        return starts.astype(np.int64), ends.astype(np.int64)
    keep = np.concatenate([[True], starts[1:] - ends[:-1] >= min_gap])
    block = np.cumsum(keep) - 1
    merged_ends = np.zeros(block[-1] + 1, np.int64)
    np.maximum.at(merged_ends, block, ends)
    return starts[keep].astype(np.int64), merged_ends


def _difference(a_s: np.ndarray, a_e: np.ndarray, b_s: np.ndarray, b_e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The parts of the disjoint sorted blocks A not covered by the disjoint sorted blocks B."""
    if len(a_s) == 0 or len(b_s) == 0:
        return a_s.astype(np.int64), a_e.astype(np.int64)
    points = np.unique(np.concatenate([a_s, a_e, b_s, b_e]))
    lo, hi = points[:-1], points[1:]

    def inside(s: np.ndarray, e: np.ndarray) -> np.ndarray:
        i = np.searchsorted(s, lo, side="right") - 1
        return (i >= 0) & (e[np.clip(i, 0, None)] > lo)

    keep = inside(a_s, a_e) & ~inside(b_s, b_e)
    if not keep.any():
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return intervals.union(lo[keep], hi[keep])


def time_split(breakdown: pl.DataFrame, covered: np.ndarray, unstepped_device_ns: int = 0) -> dict | None:
    """Where the profiled steps' device time went: each activity's share of the time the steps' spans cover
    (`covered`: [span, compute, busy] ns over the union of each device's step spans, so time in two steps' spans
    counts once), the main idle cause over every rank and step of step_breakdown, and the median step's span (the
    longest rank's, per step); `unstepped_device_ns`, the device work in no step (its launch is not in the trace),
    kept beside it. None without profiled steps."""
    span, compute, busy = (int(x) for x in covered)
    if breakdown.is_empty() or not span:
        return None
    idle_by_cause = {cause: int(breakdown[f"{cause}_ns"].fill_null(0).sum()) for cause in launch.CAUSES}
    main_cause = max(launch.CAUSES, key=lambda cause: idle_by_cause[cause]) if any(idle_by_cause.values()) else None
    step_spans = breakdown.group_by("step").agg(pl.col("span_ns").max())["span_ns"]
    return {
        "steps": step_spans.len(), "ranks": breakdown["rank"].n_unique(), "span_ns": span,
        "overlap_ns": int(breakdown["span_ns"].sum()) - span,
        "median_step_span_ns": round(step_spans.median()),
        "compute_share": compute / span,
        "exposed_comm_share": (busy - compute) / span,
        "idle_share": (span - busy) / span,
        "main_idle_cause": main_cause,
        "unstepped_device_ns": int(unstepped_device_ns),
        "definition": "each activity's share of the time the profiled steps' spans cover on every rank's devices "
                      "(gpu_idle's step spans: the device work launched in the step, opened where the device "
                      "went idle before it with the step begun and closed where it sat idle after it with the step "
                      "still running on the CPU; where one step's work still ran when the next step's began, their "
                      "spans overlap and that time counts once: overlap_ns, the summed spans' excess); main_idle_cause: "
                      "the most idle of step_breakdown's causes summed over ranks and steps; median_step_span_ns: the median over "
                      "steps of the longest rank's span; unstepped_device_ns: summed duration of the device work "
                      "whose launch is not in the trace (kernel_launches with no step), in no step's span",
    }


# ---------------------------------------------------------------------------------------------
# Its report section


def time_section(page, run):
    """Where the slowest profiled step's time went, per rank (the report's first section)."""
    breakdown, timeline = run.table("step_breakdown"), run.table("step_timeline")
    title = "Where one step's time went"
    if breakdown.is_empty():
        return page.section(title, "time", empty="No device work inside profiled steps (CPU-only traces, no kernels, "
                                                 "or no ProfilerStep annotations).")
    section = page.section(title, "time")
    step = timeline["step"][0] if not timeline.is_empty() else breakdown["step"].max()
    section.text(f"ProfilerStep#{step}, the slowest profiled step (longest wall time across ranks): each rank's device "
                 "time split into compute, communication not hidden behind compute, and idle by cause.")
    section.figure("step_breakdown_bars", breakdown.filter(pl.col("step") == step))
    if not timeline.is_empty():
        offsets = run.table("clock_offsets")
        refused = steps.refused_ranks(offsets)
        offsets = offsets.filter(~pl.col("rank").is_in(refused)) if refused else offsets
        aligned = not offsets.is_empty() and offsets["offset_ns"].is_not_null().all() and offsets.height > 1
        clock = ("ranks aligned on collective end times (table clock_offsets)" if aligned
                 else "one rank" if offsets.height <= 1 else "ranks NOT aligned (no collective kernels to match): each on its own clock")
        left_out = (f"; rank(s) {', '.join(map(str, refused))} left out: not one job with the others (table clock_offsets)"
                    if refused else "")
        section.text(f"The same step over time ({clock}{left_out}); gaps under 1/1000 of the step are not drawn.")
        section.figure("step_gantt", timeline)
    return section


# ---------------------------------------------------------------------------------------------
# The analysis


def _step_breakdown(inputs: Inputs) -> Output:
    if not inputs.ranks:
        return Output()
    unstepped = []

    def parts():  # each part read once: its device work in no step summed on the way
        for part in inputs.parts("kernel_launches", LAUNCH_COLUMNS):
            unstepped.append(int(part.filter(pl.col("step").is_null() & (pl.col("dur_ns") > 0))["dur_ns"].sum()))
            yield part

    tables, covered = step_breakdown_tables(parts(), inputs.table("collectives"), inputs.table("gpu_idle"),
                                   inputs.table("step_stats"), inputs.table("clock_offsets"))
    split = time_split(tables["step_breakdown"], covered, sum(unstepped))
    return Output(tables=tables, finding={"time_split": split} if split else None)


STEP_BREAKDOWN = schema.table_spec(
    ("rank", pa.int64(), "Rank."),
    ("source", pa.string(), "Trace file (profiler window)."),
    ("device", pa.int64(), "GPU."),
    ("step", pa.int64(), "Step."),
    ("span_ns", pa.int64(), "gpu_idle's step span: the device work launched in the step, from where the device went "
                            "idle before it with the step begun on the CPU, to where the step ended on the CPU when "
                            "the device sat idle after it (launch.step_spans)."),
    ("compute_ns", pa.int64(), "Part of the span covered by non-communication device work (kernels, copies, sets) of "
                               "any step."),
    ("exposed_comm_ns", pa.int64(), "Part of the span covered by communication kernels and not by compute."),
    ("idle_ns", pa.int64(), "span_ns - compute_ns - exposed_comm_ns: no device work at all."),
    ("host_bound_ns", pa.int64(), "Idle with nothing queued (gpu_idle)."),
    ("sync_ns", pa.int64(), "Idle during a synchronizing call (gpu_idle)."),
    ("other_ns", pa.int64(), "Idle with work queued or launches not recorded (gpu_idle)."),
)

STEP_TIMELINE = schema.table_spec(
    ("rank", pa.int64(), "Rank."),
    ("step", pa.int64(), "The slowest profiled step (longest wall time across ranks)."),
    ("activity", pa.string(), "compute | exposed communication | idle (as in step_breakdown)."),
    ("start_ns", pa.int64(), "Segment start on the reference rank's clock (ts - clock offset)."),
    ("end_ns", pa.int64(), "Segment end."),
)


ANALYSIS = Analysis("step_breakdown", "Where one step's time went",
                    ("kernel_launches", "collectives", "gpu_idle", "step_stats", "clock_offsets"),
                    {"step_breakdown": STEP_BREAKDOWN, "step_timeline": STEP_TIMELINE}, _step_breakdown,
                    former_keys={"time_split": "time_split"}, section=time_section)
