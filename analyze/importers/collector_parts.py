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
from steplens.analyze.importers.base import Imported, conform

# Run facts every rank's manifest gives alike; the rest is per rank, under collector_rank<r>.
RUN_FACTS = ("world_size", "zero_stage", "dtype", "dp_world_size", "micro_batch", "grad_accum", "train_batch_size",
             "seq_len", "param_count", "ds_config", "wall_clock_breakdown", "environment", "git", "settings",
             "checkpoint_steps")


def claims(path: Path) -> bool:
    return layout.parse_part(path) is not None or layout.parse_manifest(path) is not None


def parse(path: Path, rel: str) -> Imported:
    """Registered in importers.IMPORTERS as "collector", ahead of the native-artifact importers."""
    part = layout.parse_part(path)
    return _parse_part(path, rel, part) if part is not None else _parse_manifest(path, rel)


def _parse_part(path: Path, rel: str, part: layout.CollectorPart) -> Imported:

    table, rank = part.table, part.rank
    expected = schema.TABLES[table][0]
    try:
        arrow = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        return Imported(issues=[["error", "collector_part_unreadable", 1,
                                 f"collector part {rel} cannot be read ({e}); its rows are lost, the other parts are used"]])
    missing, extra = set(expected.names) - set(arrow.schema.names), set(arrow.schema.names) - set(expected.names)
    if extra:
        return Imported(issues=[["error", "collector_part_columns", 1,
                                 (f"collector part {rel} has other columns than {table} (missing {sorted(missing)}, "
                                  f"unknown {sorted(extra)}): written by another steplens version? Skipped")]])
    # Columns are only ever added: a part from an older collector lacks the newest ones, read as null.
    frame = conform(pl.from_arrow(arrow), table).with_columns(source=pl.lit(rel))
    issues = []
    # An alarm's rank is the rank it is about (a straggler), not the writer's.
    if table != "alarms" and (ranks := frame["rank"].unique().to_list()) != [rank] and frame.height:
        issues.append(["warning", "collector_rank_mismatch", 1, f"{rel}: file name says rank {rank}, rows say {ranks}"])
    return Imported(tables={table: conform(frame, table)}, issues=issues)


def _parse_manifest(path: Path, rel: str) -> Imported:

    doc = json.loads(path.read_text())
    if doc.get("format") != layout.COLLECTOR_MANIFEST_FORMAT:
        return Imported(issues=[["warning", "not_a_collector_manifest", 1, f"{rel} is not a collector manifest"]])
    rank, status, run = doc["rank"], doc.get("status"), doc.get("run") or {}
    facts = {key: run[key] for key in RUN_FACTS if key in run}
    facts["collector_flags"] = doc.get("flags") or {}
    facts[f"collector_rank{rank}"] = {
        key: doc.get(key) for key in ("status", "host", "started_ns", "updated_ns", "steps_completed",
                                      "last_flushed_step", "flushes", "rows_written", "disabled")
    }
    last = doc.get("last_flushed_step")
    issues = []
    if status == "completed":
        run_status, detail = "completed", f"collector manifest: completed after {doc.get('steps_completed')} steps"
    elif status == "terminated":  # the collector flushed every finished step before the signal ended the rank
        run_status = "killed"
        detail = (f"collector manifest of rank {rank}: stopped by SIGTERM after {doc.get('steps_completed')} steps; "
                  f"rows up to step {last} were flushed")
    else:
        run_status = "failed" if status == "failed" else "incomplete"
        flushed = "nothing was flushed" if last is None else f"rows up to step {last} were flushed"
        detail = (f"collector manifest of rank {rank} says {status!r}: the rank did not finish (killed, crashed or still "
                  f"running); {doc.get('steps_completed')} steps had run at its last update, {flushed}; "
                  "everything after is missing")
        issues.append(["error", "collector_missing_tail", 1, detail])
    if dropped := {table: n for table, n in (doc.get("dropped_rows") or {}).items() if n}:
        issues.append(["warning", "collector_rows_dropped", sum(dropped.values()),
                       f"rank {rank}: the collector could not write and dropped rows {dropped}"])
    if rejected := doc.get("rejected_values") or {}:
        issues.append(["warning", "collector_values_rejected", sum(rejected.values()),
                       f"rank {rank}: log() values that were not numbers were dropped, per scalar: {rejected}"])
    for part, error in (doc.get("disabled") or {}).items():
        issues.append(["warning", "collector_part_disabled", 1,
                       f"rank {rank}: the collector's {part} recording was disabled after {error}; its rows stop there"])
    rows = [{"rank": rank, "source": rel, "run_index": 0, "status": run_status, "detail": detail}]
    return Imported(tables={"run_status": conform(rows, "run_status")}, issues=issues, facts=facts)
