"""One Chrome-trace JSON with every rank on one clock, for Perfetto UI or chrome://tracing.

Each rank is a process (pid = rank); its CPU threads keep their ids and its GPU streams become
threads named "GPU <device> stream <s>". Times are moved onto the reference rank's clock with the
offsets of the clock_offsets analysis and written in µs with three decimals, so no ns is lost.
Launch links are kept as flow events. Perfetto's JSON importer drops complete events that overlap
on a thread without nesting; those are counted and reported, not silently lost.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import polars as pl

from steplens.analyze.contract import schema
from steplens.analyze.pipeline import remote

GPU_TID_BASE = 1_000_000  # GPU stream s of device d is thread GPU_TID_BASE * (d + 1) + s
EXPORT_KINDS = ["cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver", "kernel",
                "gpu_memcpy", "gpu_memset", "gpu_user_annotation"]


def _us(ns: int) -> msgspec.Raw:
    """ns as a JSON number of µs with three decimals (exact, unlike a float); the sign apart, as floor division
    would make -1500 ns -2.500."""
    sign = "-" if ns < 0 else ""
    return msgspec.Raw(f"{sign}{abs(ns) // 1000}.{abs(ns) % 1000:03d}".encode())


def _scan(run_dir: Path | str, table: str) -> pl.LazyFrame | None:
    """A table of an analysed run (None when it has no parts); in object storage, the objects its
    committed run.json names, read through pyarrow with the filters pushed down."""
    if not remote.is_url(run_dir):
        folder = Path(run_dir) / table
        return pl.scan_parquet(folder, hive_partitioning=True) if any(folder.rglob("*.parquet")) else None
    import pyarrow.dataset as ds

    urls = remote.table_objects(str(run_dir), remote.committed(str(run_dir)), table)
    if not urls:
        return None
    fs, _ = remote.filesystem(str(run_dir))
    paths = [url.split("://", 1)[1] for url in urls]
    base = paths[0][:paths[0].index(f"/{table}/") + len(table) + 1]
    dataset = ds.dataset(paths, filesystem=fs, format="parquet", partitioning="hive", partition_base_dir=base)
    frame = pl.scan_pyarrow_dataset(dataset)
    return frame.with_columns(pl.col("rank").cast(pl.Int64)) if "rank" in dataset.schema.names else frame


def export_trace(run_dir: Path, out_path: Path, steps: tuple[int, int] | None = None) -> dict:
    """Write the merged trace; returns counts (events, flows, ranks, partial overlaps)."""
    scan = _scan(run_dir, "trace_events")
    if scan is None:  # a run without traces
        scan = pl.from_arrow(schema.TABLES["trace_events"][0].empty_table()).with_columns(rank=pl.lit(None, pl.Int64)).lazy()
    scan = scan.filter(pl.col("kind").is_in(EXPORT_KINDS))
    if steps is not None:
        scan = scan.filter(pl.col("step").is_between(steps[0], steps[1]))
    events = scan.select("rank", "source", "event_id", "ts_ns", "dur_ns", "kind", "name", "pid", "tid", "stream",
                         "device", "step", "launch_event_id").collect()
    offsets = _scan(run_dir, "clock_offsets")
    offsets = offsets.select("rank", "offset_ns").collect() if offsets is not None else None
    # ranks whose offset is unknown (no collective to match) stay on their own clocks, and are named
    unaligned = [] if offsets is None else sorted(
        set(events["rank"].unique().to_list()) & set(offsets.filter(pl.col("offset_ns").is_null())["rank"].to_list()))
    if offsets is not None:
        events = events.join(offsets, on="rank", how="left").with_columns(
            ts_ns=pl.col("ts_ns") - pl.col("offset_ns").fill_null(0)).drop("offset_ns")
    device_side = pl.col("kind").is_in(schema.DEVICE_KINDS)
    events = events.with_columns(
        out_pid=pl.col("rank"),
        out_tid=pl.when(device_side).then(GPU_TID_BASE * (pl.col("device").fill_null(0) + 1) + pl.col("stream").fill_null(0))
        .otherwise(pl.col("tid").fill_null(0)),
    ).sort("out_pid", "out_tid", "ts_ns", pl.col("dur_ns").fill_null(0), descending=[False, False, False, True])
    origin = int(events["ts_ns"].min()) if events.height else 0
    overlaps = _partial_overlaps(events)

    trace_events: list = []
    for rank in events["rank"].unique().sort().to_list():
        trace_events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        trace_events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    gpu_threads = events.filter(device_side).select("out_pid", "out_tid", "device", "stream").unique()
    for pid, tid, device, stream in gpu_threads.iter_rows():
        trace_events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                             "args": {"name": f"GPU {device} stream {stream}"}})
    for pid, tid, ts, dur, name, kind, step in events.select(
            "out_pid", "out_tid", "ts_ns", "dur_ns", "name", "kind", "step").iter_rows():
        event = {"ph": "X" if dur is not None else "i", "cat": kind, "name": name, "pid": pid, "tid": tid,
                 "ts": _us(ts - origin), "args": {"step": step}}
        if dur is not None:
            event["dur"] = _us(dur)
        else:
            event["s"] = "t"
        trace_events.append(event)
    flows = _launch_flows(events, origin)
    trace_events.extend(flows)

    doc = {"traceEvents": trace_events, "displayTimeUnit": "ns",
           "otherData": {schema.EXPORT_MARK: "ranks aligned on the reference rank's clock (clock_offsets)" + (
                             f"; ranks {unaligned} on their own clocks (no collective kernels to match)" if unaligned else ""),
                         "origin_ns": origin}}
    if events.height:  # nothing to export writes nothing (an earlier export stays as it was)
        _write_atomic(out_path, msgspec.json.encode(doc))
    return {"events": events.height, "flows": len(flows) // 2, "ranks": events["rank"].n_unique(),
            "partial_overlaps": overlaps, "unaligned_ranks": unaligned}


def _write_atomic(path: Path, data: bytes) -> None:
    """path holds data whole or is as it was: a write that fails (a full disk) leaves no temporary file behind,
    which the next `analyze` would take for a file it did not write, and names the file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from e


def _launch_flows(events: pl.DataFrame, origin: int) -> list:
    """s/f pairs from each launch call to the device work it enqueued (both must be exported)."""
    calls = events.select("rank", "source", "event_id", src_pid="out_pid", src_tid="out_tid", src_ts="ts_ns")
    linked = events.filter(pl.col("launch_event_id").is_not_null()).join(
        calls, left_on=["rank", "source", "launch_event_id"], right_on=["rank", "source", "event_id"], how="inner")
    flows = []
    for i, (spid, stid, sts, dpid, dtid, dts) in enumerate(
            linked.select("src_pid", "src_tid", "src_ts", "out_pid", "out_tid", "ts_ns").iter_rows()):
        flows.append({"ph": "s", "id": i, "cat": "ac2g", "name": "launch", "pid": spid, "tid": stid, "ts": _us(sts - origin)})
        flows.append({"ph": "f", "id": i, "cat": "ac2g", "name": "launch", "pid": dpid, "tid": dtid, "ts": _us(dts - origin),
                      "bp": "e"})
    return flows


def _partial_overlaps(events: pl.DataFrame) -> int:
    """Complete events that start inside an earlier slice on the same thread but end after it:
    Perfetto's JSON importer cannot nest them."""
    slices = events.filter(pl.col("dur_ns").is_not_null()).with_columns(end_ns=pl.col("ts_ns") + pl.col("dur_ns"))
    count = 0
    for (_, _), thread in slices.group_by("out_pid", "out_tid"):
        stack: list[int] = []
        for start, end in thread.select("ts_ns", "end_ns").iter_rows():
            while stack and stack[-1] <= start:
                stack.pop()
            if stack and end > stack[-1]:
                count += 1
                continue
            stack.append(end)
    return count
