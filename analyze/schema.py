"""The run-directory contract: the one place that says what a steplens run directory holds.

A run directory is what `analyze` writes (to `<run_dir>/.steplens/` or `--out DIR`) and what the
collector writes in-job. It holds:

    run.json                                   manifest (see `RunManifest`)
    <table>/rank=<r>/part-<source>.parquet     per-rank tables, hive-partitioned by rank
    <table>/part-<name>.parquet                run-level tables (no rank partition)

so that DuckDB (`read_parquet('<dir>/trace_events/*/*.parquet', hive_partitioning=true)`) and
`polars.scan_parquet('<dir>/trace_events/')` read every rank as one table with a `rank` column.
The rank lives in the path only, never inside the per-rank files.

Conventions (as Perfetto's trace processor does): times are integer nanoseconds; a column ending in
`_ns` is either an absolute timestamp (`ts_ns`, `start_ns`, `end_ns`: ns since the Unix epoch in the
clock of the rank that recorded it) or a duration (`dur_ns`). Ranks' clocks are NOT aligned here.

Bump SCHEMA_VERSION whenever a table's columns or meaning change; readers refuse newer versions and
`analyze` re-ingests older ones.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1
MANIFEST_FILE = "run.json"
DEFAULT_OUT_DIR = ".steplens"

# Event kinds. Device-side kinds are the only ones that count as GPU activity, even when a CPU
# event carries a `stream` arg (Triton launchers do).
KINDS = (
    "cpu_op",
    "user_annotation",
    "python_function",
    "cuda_runtime",
    "cuda_driver",
    "kernel",
    "gpu_memcpy",
    "gpu_memset",
    "gpu_user_annotation",
    "memory",
    "other",
)
DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


def _table(*columns: tuple[str, pa.DataType, str]) -> tuple[pa.Schema, dict[str, str]]:
    schema = pa.schema([pa.field(name, dtype) for name, dtype, _ in columns])
    docs = {name: doc for name, _, doc in columns}
    return schema, docs


TRACE_EVENTS, TRACE_EVENTS_DOC = _table(
    ("event_id", pa.int64(), "Row id, unique within (rank, source); flows refer to it."),
    ("source", pa.string(), "Source file, relative to the ingested folder."),
    ("ts_ns", pa.int64(), "Absolute start, ns since epoch, rank-local clock (exact: no float rounding)."),
    ("dur_ns", pa.int64(), "Duration in ns; null for instant events."),
    ("ph", pa.string(), "Chrome-trace phase: X (complete) or i/I (instant)."),
    ("kind", pa.string(), "Normalized category, one of schema.KINDS."),
    ("cat", pa.string(), "Category exactly as the trace wrote it."),
    ("name", pa.string(), "Event name."),
    ("pid", pa.int64(), "Process id (device id for GPU events); null when not numeric."),
    ("tid", pa.int64(), "Thread id (stream id for GPU events); null when not numeric."),
    ("stream", pa.int64(), "GPU stream for device-side events (args.stream, or a 'stream N' tid)."),
    ("device", pa.int64(), "GPU device for device-side events (args.device, else pid)."),
    ("correlation", pa.int64(), "CUPTI/roctracer correlation id linking a launch to device work."),
    ("external_id", pa.int64(), "'External id': links a CPU op to the runtime calls it made."),
    ("step", pa.int64(), "ProfilerStep number: CPU events by time window, device events via their launch."),
    ("is_launch", pa.bool_(), "Runtime/driver call that enqueues device work (kernel, graph, memcpy, memset)."),
    ("collective", pa.string(), "record_param_comms 'Collective name' (on the CPU op and the NCCL kernel)."),
    ("in_nelems", pa.int64(), "'In msg nelems' (elements, not bytes)."),
    ("out_nelems", pa.int64(), "'Out msg nelems' (elements, not bytes)."),
    ("dtype", pa.string(), "'dtype' of a collective (c10 ScalarType name, e.g. BFloat16)."),
    ("group_size", pa.int64(), "'Group size' of the process group."),
    ("group_name", pa.string(), "'Process Group Name'."),
    ("group_desc", pa.string(), "'Process Group Description', e.g. default_pg."),
    ("group_ranks", pa.string(), "'Process Group Ranks' as written (Kineto truncates after 30)."),
    ("seq", pa.int64(), "'Seq': per-process-group sequence number of a collective."),
    ("comms_id", pa.uint64(), "'Comms Id' (unsigned 64-bit hash; may exceed int64)."),
    ("src_rank", pa.int64(), "'Src Rank' of a point-to-point op."),
    ("dst_rank", pa.int64(), "'Dst Rank' of a point-to-point op."),
    ("input_dims", pa.string(), "'Input Dims' as JSON text."),
    ("bytes", pa.int64(), "'bytes' of a memcpy/memset, or 'Bytes' of a [memory] event."),
    ("flops", pa.float64(), "'flops' estimated by the profiler (with_flops=True)."),
)

FLOWS, FLOWS_DOC = _table(
    ("source", pa.string(), "Source file."),
    ("flow_type", pa.string(), "launch (CPU call -> device work) or fwdbwd (forward op -> backward op)."),
    ("src_event_id", pa.int64(), "event_id of the launching / forward event."),
    ("dst_event_id", pa.int64(), "event_id of the device / backward event."),
    ("via", pa.string(), "How the link was found: correlation (ids match) or flow_event (s/f pair)."),
    ("flow_id", pa.int64(), "Flow id of the s/f pair, or the correlation id."),
)

STEPS, STEPS_DOC = _table(
    ("source", pa.string(), "Source file (one profiler window)."),
    ("step", pa.int64(), "N of ProfilerStep#N."),
    ("start_ns", pa.int64(), "CPU start of the step annotation (absolute ns, rank clock)."),
    ("end_ns", pa.int64(), "CPU end of the step annotation."),
    ("dur_ns", pa.int64(), "end_ns - start_ns."),
    ("pid", pa.int64(), "Process that recorded the step."),
    ("tid", pa.int64(), "Thread that recorded the step."),
)

INGEST_ISSUES, INGEST_ISSUES_DOC = _table(
    ("rank", pa.int64(), "Rank of the file, null when it could not be told."),
    ("file", pa.string(), "Input file, relative to the ingested folder."),
    ("severity", pa.string(), "info (normal, nothing lost) | warning (repaired or guessed) | error (data lost)."),
    ("reason", pa.string(), "Stable code, e.g. truncated_json, not_a_trace, rank_from_filename."),
    ("count", pa.int64(), "How many events or files it affected."),
    ("detail", pa.string(), "What happened and what was done, for a human."),
)

# name -> (schema, column docs, partitioned by rank)
TABLES: dict[str, tuple[pa.Schema, dict[str, str], bool]] = {
    "trace_events": (TRACE_EVENTS, TRACE_EVENTS_DOC, True),
    "flows": (FLOWS, FLOWS_DOC, True),
    "steps": (STEPS, STEPS_DOC, True),
    "ingest_issues": (INGEST_ISSUES, INGEST_ISSUES_DOC, False),
}

# run.json keys, for the README and for readers:
#   schema_version   int, SCHEMA_VERSION of the writer
#   run_id           str, stable id of the run (hash of the source fingerprints, or the collector's id)
#   created_by       "steplens <version> ingest" or "steplens <version> collect"
#   world_size       int or null, from distributedInfo / the launcher
#   ranks            sorted list of ranks present
#   sources          list of {path, kind, size, mtime_ns, hash_prefix, status, rank, parts, events}
#   environment      {devices: [...], backend, nccl_version, cuda_runtime_version, ...} where known
#   tables           {name: {"partitioned_by_rank": bool}}


def part_dir(table: str, rank: int | None) -> str:
    """Relative folder of a table's part files for one rank (or the run-level folder)."""
    partitioned = TABLES[table][2]
    return f"{table}/rank={rank}" if partitioned else table
