"""Importer for what the in-job collector (collect/) wrote into the run folder (analyze/contract/layout.py):

    collector/<table>/rank<r>-<seq>.parquet   rows of one telemetry table, one part per flush
    collector/manifest/rank<r>.json           the rank's manifest (status running -> completed)

A part that cannot be read (cut, damaged, wrong columns) costs that part only: it becomes an error issue
naming the file. A manifest still saying `running` means the rank never finished (killed, or still
going): its rows after `last_flushed_step` are missing, and that is reported.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from steplens.analyze.contract import layout, schema
from steplens.analyze.contract.manifest import is_count
from steplens.analyze.importers.base import Imported, conform
from steplens.analyze.importers.kineto import preview

# Run facts every rank's manifest gives alike; the rest is per rank, under collector_rank<r>.
RUN_FACTS = ("world_size", "zero_stage", "dtype", "dp_world_size", "micro_batch", "grad_accum", "train_batch_size",
             "seq_len", "param_count", "ds_config", "wall_clock_breakdown", "environment", "git", "settings",
             "checkpoint_steps", "model_shape", "first_flush_step")
# Bounds of one part as read (_read_bounded). The collector writes a part per table per flush (flush_every=50
# steps by default): a real part holds up to a few 10k rows (comms_calls of a large job); 1 M rows of the widest
# table (comms_calls) take about 300 MB as frames.
MAX_PART_ROWS = 1_000_000
MAX_PART_BYTES = 256 << 20
READ_BATCH_ROWS = 16_384
# The per-rank manifest keys kept under collector_rank<r>, and the type each must have (job_end reads them).
RANK_STATE = {"status": str, "host": dict, "started_ns": int, "updated_ns": int, "steps_completed": int,
              "last_flushed_step": int, "flushes": int, "rows_written": dict, "disabled": dict}


def claims(path: Path) -> bool:
    return layout.parse_part(path) is not None or layout.parse_manifest(path) is not None


def parse(path: Path, rel: str) -> Imported:
    """Registered in importers.IMPORTERS as "collector", ahead of the native-artifact importers."""
    part = layout.parse_part(path)
    return _parse_part(path, rel, part) if part is not None else _parse_manifest(path, rel)


def _read_bounded(path: Path) -> tuple[pa.Table, str | None]:
    """The part's rows, at most MAX_PART_ROWS of them and MAX_PART_BYTES decoded, read batch by batch: a part
    of a few kB can decode to millions of rows (run-length encoding) or gigabytes (a dictionary of long
    strings), and memory must not follow. Returns the rows kept and, when some were not, what was left."""
    # opened here: Arrow takes a path in UTF-8 only, and a run folder's name need not be
    with open(path, "rb") as raw, pq.ParquetFile(raw) as parquet:
        total = parquet.metadata.num_rows
        batches, rows, nbytes = [], 0, 0
        for batch in parquet.iter_batches(batch_size=READ_BATCH_ROWS):
            batch = batch.slice(0, MAX_PART_ROWS - rows)
            batches.append(batch)
            rows += batch.num_rows
            nbytes += batch.nbytes
            if rows >= MAX_PART_ROWS or nbytes >= MAX_PART_BYTES:
                break
        arrow = pa.Table.from_batches(batches, schema=parquet.schema_arrow)
    if rows < total:
        return arrow, (f"{total - rows} of its {total} rows skipped: a collector part holds at most {MAX_PART_ROWS} "
                       f"rows and {MAX_PART_BYTES >> 20} MB decoded (the collector writes one part per flush)")
    return arrow, None


# Arrow types that hold the same text or bytes as the collector's own, each castable to it without loss.
# (the view types: pyarrow 16 and later)
SAME_VALUES = {pa.string(): tuple(t() for t in (pa.large_string, getattr(pa, "string_view", None)) if t),
               pa.binary(): tuple(t() for t in (pa.large_binary, getattr(pa, "binary_view", None)) if t)}


def _same_values(actual: pa.DataType, expected: pa.DataType) -> bool:
    if pa.types.is_dictionary(actual):
        actual = actual.value_type
    return actual == expected or actual in SAME_VALUES.get(expected, ())


def _parse_part(path: Path, rel: str, part: layout.CollectorPart) -> Imported:

    table, rank = part.table, part.rank
    if rank >= schema.MAX_RANK:
        return Imported(issues=[["error", "collector_part_rank", 1,
                                 f"collector part {rel}: rank {rank} in its name is past the rank limit "
                                 f"({schema.MAX_RANK}); skipped"]])
    expected = schema.TABLES[table][0]
    try:
        arrow, skipped = _read_bounded(path)
        names = arrow.schema.names  # a damaged footer can name a column in bytes that are not UTF-8
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        return Imported(issues=[["error", "collector_part_unreadable", 1,
                                 f"collector part {rel} cannot be read ({e}); its rows are lost, the other parts are used"]])
    # The footer's key-value metadata (the ARROW:schema blob, per-column metadata) has served the read; damaged
    # (not UTF-8) it would make polars panic, so the columns go on without it (no copy).
    arrow = pa.Table.from_arrays(arrow.columns, names=names)
    missing, extra = set(expected.names) - set(arrow.schema.names), set(arrow.schema.names) - set(expected.names)
    # A column of another type is another column: casting it could truncate (2.5 -> rank 2) or fail. Text stored
    # another way (large or view strings, dictionary-encoded: a part rewritten by polars or pandas) is the same values.
    retyped = sorted(f.name for f in arrow.schema if f.name in expected.names
                     and not _same_values(f.type, expected.field(f.name).type))
    for i, f in enumerate(arrow.schema):
        if f.name in expected.names and f.type != expected.field(f.name).type and f.name not in retyped:
            arrow = arrow.set_column(i, f.name, arrow.column(i).cast(expected.field(f.name).type))
    missing -= set(layout.LATER_COLUMNS.get(table, ()))
    if extra or retyped or missing:
        return Imported(issues=[["error", "collector_part_columns", 1,
                                 (f"collector part {rel} has other columns than {table} (missing {sorted(missing)}, "
                                  f"unknown {sorted(extra)}, of other types {retyped}): written by another steplens "
                                  "version? Skipped")]])
    # Columns are only ever added: a part from an older collector lacks the newest ones, read as null; any
    # other missing column (a step, a duration) would leave every row of the part null where it counts.
    frame = conform(pl.from_arrow(arrow), table).with_columns(source=pl.lit(rel))
    issues = []
    if skipped is not None:
        issues.append(["error", "collector_part_too_large", 1, f"collector part {rel}: {skipped}"])
    # Ranks past the limit the traces are held to are not ranks (a rank column of 2**40 would make every
    # per-rank range in the analyses and the report that large).
    in_range = pl.col("rank").is_between(0, schema.MAX_RANK - 1).fill_null(True)  # a null rank stays null
    if (outside := frame.filter(~in_range)).height:
        issues.append(["error", "collector_part_rank", outside.height,
                       f"collector part {rel}: {outside.height} row(s) of a rank outside 0..{schema.MAX_RANK - 1} "
                       f"(e.g. {outside['rank'][0]}); skipped"])
        frame = frame.filter(in_range)
    frame = _drop_implausible(frame, rel, issues)
    # An alarm's rank is the rank it is about (a straggler), not the writer's.
    if table != "alarms" and (ranks := frame["rank"].unique().to_list()) != [rank] and frame.height:
        issues.append(["warning", "collector_rank_mismatch", 1, f"{rel}: file name says rank {rank}, rows say {ranks}"])
    return Imported(tables={table: conform(frame, table)}, issues=issues)


# What a value of each kind of column can be, whatever the table (the collector writes them itself, so a value
# outside is damage or another writer's): such a row is dropped and counted (a null in its place would reach
# analyses that need the value). A duration or latency past 2**53 ns (104 days) is no time a step or call
# takes, and keeps the sums of many rows inside int64.
MAX_DURATION_NS = 2**53
MAX_AMOUNT = 2**62  # bytes, FLOPs (a step of a large model exceeds 2**53), MACs, parameters, samples, tokens
PLAUSIBLE = {
    "latency_ns": lambda c: pl.col(c).is_between(0, MAX_DURATION_NS),
    # a step's or module's time below 0 is kept: the clock stepped back, which sanity and step_time name
    **dict.fromkeys(("dur_ns", "duration_ns"), lambda c: pl.col(c).abs() <= MAX_DURATION_NS),
    **dict.fromkeys(("ts_ns", "start_ns", "end_ns", "wall_ns"), lambda c: pl.col(c).abs() <= MAX_AMOUNT),
    **dict.fromkeys(("msg_bytes", "nccl_bytes", "allocated_bytes", "max_allocated_bytes", "reserved_bytes",
                     "max_reserved_bytes", "params", "macs", "flops", "macs_total", "flops_total",
                     "global_samples", "global_tokens"), lambda c: pl.col(c).is_between(0, MAX_AMOUNT)),
    "group_size": lambda c: pl.col(c).is_between(1, schema.MAX_RANK),
    "ms": lambda c: pl.col(c).is_finite() & (pl.col(c).abs() <= schema.MAX_TIMER_MS),  # step_timers, as a log's
    **dict.fromkeys(("algbw_gbps", "busbw_gbps"), lambda c: pl.col(c).is_finite() & (pl.col(c) >= 0)),
}


def _drop_implausible(frame: pl.DataFrame, rel: str, issues: list) -> pl.DataFrame:
    checks = {c: PLAUSIBLE[c](c).fill_null(True) for c in frame.columns if c in PLAUSIBLE}
    if not checks or frame.is_empty():
        return frame
    bad = frame.select(**{c: (~ok).sum() for c, ok in checks.items()}).row(0, named=True)
    if not (damaged := {c: n for c, n in bad.items() if n}):
        return frame
    kept = frame.filter(pl.all_horizontal(checks.values()))
    shown = ", ".join(f"{c} ({n})" for c, n in damaged.items())
    issues.append(["warning", "collector_values_implausible", frame.height - kept.height,
                   f"collector part {rel}: rows with values no run can have (negative, not finite, a duration past "
                   f"104 days) in {shown}; those rows dropped"])
    return kept


def _is_a(value, kind: type) -> bool:
    if kind is int:  # an int64 column's whole number, not true/false
        return schema.holds_int64(value)
    return isinstance(value, kind)


def _counts(value) -> tuple[dict, bool]:
    """A manifest's {name: count} table: the entries that are counts, and whether anything was not."""
    if value is None:
        return {}, False
    if not isinstance(value, dict):
        return {}, True
    counts = {name: n for name, n in value.items() if is_count(n)}
    return counts, len(counts) < len(value)


def _parse_manifest(path: Path, rel: str) -> Imported:

    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:  # cut, not UTF-8, not JSON, nested past the decoder's depth
        return Imported(issues=[["error", "collector_part_unreadable", 1,
                                 (f"collector manifest {rel} cannot be read ({type(e).__name__}: {e}); this rank's "
                                  "status and run facts are lost, its parts are still used")]])
    if not isinstance(doc, dict) or doc.get("format") != layout.COLLECTOR_MANIFEST_FORMAT:
        return Imported(issues=[["warning", "not_a_collector_manifest", 1, f"{rel} is not a collector manifest"]])
    issues, damaged = [], []  # damaged: keys of the wrong type or out of range, left out
    rank = doc.get("rank")
    if not (type(rank) is int and 0 <= rank < schema.MAX_RANK):
        name_rank = layout.parse_manifest(path)
        if name_rank is None or name_rank >= schema.MAX_RANK:
            return Imported(issues=[["warning", "not_a_collector_manifest", 1,
                                     f"{rel}: no rank in the manifest ({preview(rank)}) or its file name"]])
        issues.append(["warning", "collector_rank_mismatch", 1,
                       f"{rel}: the manifest's rank is {preview(rank)}, not a rank; rank {name_rank} from the file name used"])
        rank = name_rank
    state = {}
    for key, kind in RANK_STATE.items():
        value = doc.get(key)
        if value is not None and not _is_a(value, kind):
            damaged.append(key)
            value = None
        state[key] = value
    run = doc.get("run")
    if not isinstance(run, dict):
        if run is not None:
            damaged.append("run")
        run = {}
    facts = {key: run[key] for key in RUN_FACTS if key in run}
    facts["collector_flags"] = doc.get("flags") or {}
    if isinstance(doc.get("profiler"), dict) and doc["profiler"]:  # what it did about the profiler's cost (CUPTI)
        facts["collector_profiler"] = doc["profiler"]
    facts[f"collector_rank{rank}"] = state
    status, last, steps = state["status"], state["last_flushed_step"], state["steps_completed"]
    if status == "completed":
        run_status, detail = "completed", f"collector manifest: completed after {steps} steps"
    elif status == "terminated":  # the collector flushed every finished step before the signal ended the rank
        run_status = "killed"
        detail = (f"collector manifest of rank {rank}: stopped by SIGTERM after {steps} steps; "
                  f"rows up to step {last} were flushed")
    elif status == "failed" and is_count(steps) and last == steps - 1:
        # the rank's job raised, and the collector flushed every step it finished first: the job's failure (job_end
        # says it), not a loss of data
        run_status = "failed"
        detail = f"collector manifest of rank {rank}: the rank failed after {steps} steps; every one of them was flushed"
    else:
        run_status = "failed" if status == "failed" else "incomplete"
        flushed = "nothing was flushed" if last is None else f"rows up to step {last} were flushed"
        says = f"says {status!r}" if status is not None else "gives no status"
        ran = f"{steps} steps had run at its last update, " if steps is not None else ""
        detail = (f"collector manifest of rank {rank} {says}: the rank did not finish (killed, crashed or still "
                  f"running), or the collector's writes failed (a read-only or full disk); {ran}{flushed}; "
                  "everything after is missing")
        issues.append(["error", "collector_missing_tail", 1, detail])
    dropped, dropped_damaged = _counts(doc.get("dropped_rows"))
    rejected, rejected_damaged = _counts(doc.get("rejected_values"))
    damaged += [key for key, bad in (("dropped_rows", dropped_damaged), ("rejected_values", rejected_damaged)) if bad]
    if dropped := {table: n for table, n in dropped.items() if n}:
        issues.append(["error", "collector_rows_dropped", sum(dropped.values()),
                       f"rank {rank}: the collector could not write and dropped rows {dropped}"])
    if rejected:
        issues.append(["warning", "collector_values_rejected", sum(rejected.values()),
                       f"rank {rank}: log() values that were not numbers were dropped, per scalar: {rejected}"])
    for part, error in (state["disabled"] or {}).items():
        issues.append(["warning", "collector_part_disabled", 1,
                       f"rank {rank}: the collector's {part} recording was disabled after {error}; its rows stop there"])
    if damaged:
        issues.append(["warning", "bad_fact", len(damaged),
                       f"collector manifest of rank {rank}: {damaged} of the wrong type or out of range; left out"])
    rows = [{"rank": rank, "source": rel, "run_index": 0, "status": run_status, "detail": detail}]
    return Imported(tables={"run_status": conform(rows, "run_status", issues)}, issues=issues, facts=facts)
