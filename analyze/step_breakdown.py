"""Where one step's device time went, per rank: compute, exposed communication, idle by cause; and
the timeline of the slowest profiled step across ranks on one clock.

Definitions (per rank, device and step, over the device work launched in the step, as gpu_idle):
- compute_ns: the union of the step's non-communication device work (kernels, copies, sets);
- exposed_comm_ns: the union of its communication kernels (the `collectives` table) minus that
  compute union, so overlapped communication is not counted twice;
- idle: the span (first start to last end) minus the union of all the work, split by cause as in
  gpu_idle (host-bound, sync, other). compute + exposed communication + idle = span.

The timeline keeps the same three activities as segments on the reference rank's clock
(aligned = ts - clock offset). Gaps shorter than 1/TIMELINE_RESOLUTION of the step's wall time are
closed, so the table (and any picture of it) stays small whatever the kernel count.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import polars as pl

from . import intervals

ALL_STREAMS = -1  # gpu_idle's whole-device rows
TIMELINE_RESOLUTION = 1000  # segments resolved to 1/1000 of the step's wall time
LAUNCH_COLUMNS = ["rank", "event_id", "step", "device", "stream", "ts_ns", "dur_ns"]
COMM_KEYS = ["rank", "event_id", "ts_ns", "dur_ns"]

BREAKDOWN_SCHEMA = {"rank": pl.Int64, "device": pl.Int64, "step": pl.Int64, "span_ns": pl.Int64, "compute_ns": pl.Int64,
                    "exposed_comm_ns": pl.Int64, "idle_ns": pl.Int64, "host_bound_ns": pl.Int64, "sync_ns": pl.Int64,
                    "other_ns": pl.Int64}
TIMELINE_SCHEMA = {"rank": pl.Int64, "step": pl.Int64, "activity": pl.String, "start_ns": pl.Int64, "end_ns": pl.Int64}


def step_breakdown_tables(read_launches: Callable[[int], pl.DataFrame], ranks: list[int], collectives: pl.DataFrame,
                          gpu_idle: pl.DataFrame, step_stats: pl.DataFrame, offsets: pl.DataFrame
                          ) -> dict[str, pl.DataFrame]:
    """step_breakdown (every rank and step) and step_timeline (the slowest profiled step).

    `read_launches(rank)` returns that rank's kernel_launches rows (source, event_id, step, device,
    stream, ts_ns, dur_ns); ranks are read one at a time, so memory is bounded by the largest rank."""
    slowest = slowest_profiled_step(step_stats)
    # event_id is unique within (rank, source); the kernel's start and duration tell sources apart.
    comm_ids = collectives.select(*COMM_KEYS).unique().with_columns(is_comm=pl.lit(True))
    offset_of = dict(offsets.select("rank", pl.col("offset_ns").fill_null(0)).iter_rows()) if not offsets.is_empty() else {}
    breakdowns, timelines = [], []
    for rank in ranks:
        work = _work(read_launches(rank), comm_ids)
        if work.is_empty():
            continue
        breakdowns.append(_breakdown(work))
        if slowest is not None:
            timelines.append(_timeline(work.filter(pl.col("step") == slowest), offset_of.get(rank, 0)))
    if not breakdowns:
        return {"step_breakdown": pl.DataFrame(schema=BREAKDOWN_SCHEMA), "step_timeline": pl.DataFrame(schema=TIMELINE_SCHEMA)}
    causes = gpu_idle.filter((pl.col("stream") == ALL_STREAMS) & pl.col("step").is_not_null()).select(
        *[pl.col(c).cast(pl.Int64) for c in ("rank", "device", "step", "host_bound_ns", "sync_ns", "other_ns")])
    breakdown = pl.concat(breakdowns).join(causes, on=["rank", "device", "step"], how="left").with_columns(
        idle_ns=pl.col("span_ns") - pl.col("compute_ns") - pl.col("exposed_comm_ns"))
    timeline = pl.concat(timelines) if timelines else pl.DataFrame(schema=TIMELINE_SCHEMA)
    return {"step_breakdown": breakdown.select(list(BREAKDOWN_SCHEMA)).cast(BREAKDOWN_SCHEMA).sort("step", "rank", "device"),
            "step_timeline": timeline.select(list(TIMELINE_SCHEMA)).cast(TIMELINE_SCHEMA)}


def slowest_profiled_step(step_stats: pl.DataFrame) -> int | None:
    """The profiled step with the longest wall time across ranks (aligned clock), else the longest CPU step."""
    if step_stats.is_empty():
        return None
    ranked = step_stats.sort(pl.coalesce("aligned_dur_ns", "max_dur_ns"), "step", descending=[True, False], nulls_last=True)
    return ranked["step"][0]


def _work(launched: pl.DataFrame, comm_ids: pl.DataFrame) -> pl.DataFrame:
    """The device work assigned to a step, with its end and whether it is communication."""
    work = launched.filter(pl.col("step").is_not_null() & pl.col("stream").is_not_null() & pl.col("dur_ns").is_not_null())
    return work.join(comm_ids, on=COMM_KEYS, how="left").select(
        "rank", "device", "step", "ts_ns", end_ns=pl.col("ts_ns") + pl.col("dur_ns"), is_comm=pl.col("is_comm").fill_null(False))


def _blocks(work: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """The union of the intervals in each group of `keys`, as disjoint blocks (start_ns, end_ns)."""
    ordered = work.sort(keys + ["ts_ns"]).with_columns(prev_end=pl.col("end_ns").cum_max().shift(1).over(keys))
    ordered = ordered.with_columns(
        block=(pl.col("prev_end").is_null() | (pl.col("ts_ns") > pl.col("prev_end"))).cum_sum().over(keys))
    return ordered.group_by(keys + ["block"]).agg(start_ns=pl.col("ts_ns").min(), end_ns=pl.col("end_ns").max())


def _covered(work: pl.DataFrame, keys: list[str], name: str) -> pl.DataFrame:
    return _blocks(work, keys).group_by(keys).agg((pl.col("end_ns") - pl.col("start_ns")).sum().alias(name))


def _breakdown(work: pl.DataFrame) -> pl.DataFrame:
    """Span, compute union and exposed communication per (rank, device, step)."""
    keys = ["rank", "device", "step"]
    spans = work.group_by(keys).agg(span_ns=pl.col("end_ns").max() - pl.col("ts_ns").min())
    busy = _covered(work, keys, "busy_ns")
    compute = _covered(work.filter(~pl.col("is_comm")), keys, "compute_ns")
    return (spans.join(busy, on=keys, how="left").join(compute, on=keys, how="left")
            .with_columns(pl.col("compute_ns").fill_null(0))
            .with_columns(exposed_comm_ns=pl.col("busy_ns") - pl.col("compute_ns")).drop("busy_ns"))


def _timeline(work: pl.DataFrame, offset_ns: int) -> pl.DataFrame:
    """Compute, exposed-communication and idle segments of one rank's step, on the reference clock."""
    if work.is_empty():
        return pl.DataFrame(schema=TIMELINE_SCHEMA)
    rank, step = work["rank"][0], work["step"][0]
    begin, finish = work["ts_ns"].min(), work["end_ns"].max()
    min_gap = max((finish - begin) // TIMELINE_RESOLUTION, 1)
    compute = work.filter(~pl.col("is_comm"))
    comm = work.filter(pl.col("is_comm"))
    c_s, c_e = _closed(*intervals.union(compute["ts_ns"].to_numpy(), compute["end_ns"].to_numpy()), min_gap)
    m_s, m_e = intervals.union(comm["ts_ns"].to_numpy(), comm["end_ns"].to_numpy())
    x_s, x_e = _closed(*_difference(m_s, m_e, c_s, c_e), min_gap)
    b_s, b_e = _closed(*intervals.union(np.concatenate([c_s, x_s]), np.concatenate([c_e, x_e])), min_gap)
    segments = [("compute", c_s, c_e), ("exposed communication", x_s, x_e), ("idle", b_e[:-1], b_s[1:])]
    return pl.concat([pl.DataFrame({"rank": rank, "step": step, "activity": name, "start_ns": s - offset_ns,
                                    "end_ns": e - offset_ns}, schema=TIMELINE_SCHEMA) for name, s, e in segments])


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
