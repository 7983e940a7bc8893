"""The run-directory contract: the one place that says what a steplens run directory holds.

A run directory is what `analyze` writes (to `<run_dir>/.steplens/` or `--out DIR`) and what the
collector writes in-job. It holds:

    run.json                                   manifest (manifest.RunManifest)
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

import hashlib
import re

import pyarrow as pa

from steplens.analyze.contract.traces import INT64_RANGE

# 2: step_time outside_ns, outside_rank, least_outside_ns; gpu_idle and step_breakdown spans widened to the steps
# 3: every percentile the nearest rank; comms_log_stats least_wait_* and most_wait_median_latency_ns (2026-12)
SCHEMA_VERSION = 3
MANIFEST_FILE = "run.json"
FINDINGS_FILE = "findings.json"  # the analyses' findings, beside the tables
# A rank named in a file name (rank3.json, rank-3.pt.trace.json, worker_rank_3.log): what a file without a recorded
# rank is taken to be.
RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def rank_in_name(file_name: str) -> int | None:
    """The rank a file's name states (RANK_IN_NAME), or None (also for a number beyond MAX_RANK: not a rank)."""
    named = RANK_IN_NAME.search(file_name)
    return int(named.group(1)) if named and len(named.group(1)) <= 9 and int(named.group(1)) < MAX_RANK else None


def rank_in_name_issue(file_name: str) -> list | None:
    """The warning for a file name whose rank<N> is no rank (N beyond MAX_RANK), else None."""
    named = RANK_IN_NAME.search(file_name)
    if named is None or rank_in_name(file_name) is not None:
        return None
    shown = named.group(1) if len(named.group(1)) <= 24 else f"{named.group(1)[:12]}…({len(named.group(1))} digits)"
    return ["warning", "rank_in_name_ignored", 1, f"the file name's rank {shown} is beyond {MAX_RANK:,}: not taken as a rank"]


# Device work a launch call enqueues (what counts as the GPU being busy), and every device-side event kind.
WORK_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
ALL_STREAMS = -1  # gpu_idle's and step_breakdown's rows that treat a device as one timeline (no stream busy = idle)
DEFAULT_OUT_DIR = ".steplens"
EXPORT_MARK = "steplens"  # the otherData key of a merged trace steplens export-trace writes (no rank's trace)
# Largest rank or world size taken from an input; beyond it the value is not a rank (the largest
# jobs run on ~10^5 GPUs) and an int64 table or a per-rank figure would overflow.
MAX_RANK = 1 << 24
# A DeepSpeed timer (ms) beyond 31 years is damage, not a time; a step's few timers summed stay within int64 ns.
MAX_TIMER_MS = 1e12
# What an int64 / uint64 column holds: a value beyond is damage (stored as null and counted), never wrapped
# (INT64_RANGE is stated in the trace model, which must import without pyarrow).
UINT64_RANGE = (0, (1 << 64) - 1)


def holds_int64(value) -> bool:
    """An int (not a bool, not 2.0) that an int64 column holds."""
    return type(value) is int and INT64_RANGE[0] <= value <= INT64_RANGE[1]

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
DEVICE_KINDS = (*WORK_KINDS, "gpu_user_annotation")


def table_spec(*columns: tuple[str, pa.DataType, str]) -> tuple[pa.Schema, dict[str, str]]:
    """A table's declaration: (name, Arrow type, meaning) per column -> (typed schema, column docs)."""
    schema = pa.schema([pa.field(name, dtype) for name, dtype, _ in columns])
    docs = {name: doc for name, _, doc in columns}
    return schema, docs


_table = table_spec


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
    ("launch_event_id", pa.int64(), "For device work: event_id of the call that launched it (as in flows)."),
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
    ("input_types", pa.string(), "'Input type' as JSON text: each input's element type (c10::BFloat16, float, Scalar, ...)."),
    ("concrete_inputs", pa.string(), "'Concrete Inputs' as JSON text: scalar arguments as strings (conv stride, SDPA is_causal)."),
    ("bytes", pa.int64(), "'bytes' of a memcpy/memset, or 'Bytes' of a [memory] event."),
    ("flops", pa.float64(), "'flops' estimated by the profiler (with_flops=True)."),
    ("total_allocated_bytes", pa.int64(), "'Total Allocated' of a [memory] event (profile_memory=True): the device "
                                          "allocator's allocated bytes after it; null for host (Device Type 0) allocations."),
    ("total_reserved_bytes", pa.int64(), "'Total Reserved' of a [memory] event: the device caching allocator's reserved "
                                         "bytes after it; null for host allocations."),
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

# Training telemetry: written per rank by the collector (collect/) and by the importers of native
# DeepSpeed artifacts (logs, csv_monitor, TensorBoard, W&B, FLOPs-profiler text, comms dumps,
# autotuning results). Run-level tables with the rank as a column, because one native file often
# holds several ranks (interleaved logs) or none (autotuning). Parts: <table>/part-<source>.parquet.
# Values keep the units DeepSpeed reports (ms timers) only where the column name says so.

TRAIN_STEPS, TRAIN_STEPS_DOC = _table(
    ("rank", pa.int64(), "Rank."),
    ("source", pa.string(), "Writer (collector part) or input file."),
    ("step", pa.int64(), "Optimizer step the micro step belongs to (engine global_steps before it ends, from 0)."),
    ("micro_step", pa.int64(), "Micro step index over the run (engine micro_steps), from 0."),
    ("start_ns", pa.int64(), "Wall-clock start, ns since epoch (host clock of the rank)."),
    ("end_ns", pa.int64(), "Wall-clock end."),
    ("dur_ns", pa.int64(), "end_ns - start_ns."),
    ("is_boundary", pa.bool_(), "Gradient-accumulation boundary: the optimizer stepped after this micro step."),
    ("skipped", pa.bool_(), "The optimizer step was skipped (fp16 overflow); null on non-boundary micro steps."),
    ("global_samples", pa.int64(), "Samples consumed by the whole job after this micro step."),
    ("global_tokens", pa.int64(), "global_samples x sequence length, when the sequence length is known."),
    ("loss_scale", pa.float64(), "fp16 loss scale after the step (null without fp16)."),
    ("lr", pa.float64(), "Learning rate of the first parameter group."),
    ("max_allocated_bytes", pa.int64(), "torch.cuda.max_memory_allocated() of the rank's device at the row's end: the "
                                        "peak since the job started or last reset it (the collector never resets it; "
                                        "DeepSpeed's see_memory_usage does). Null without a CUDA/ROCm device."),
    ("max_reserved_bytes", pa.int64(), "torch.cuda.max_memory_reserved() at the row's end (same scope); null without a device."),
)

STEP_TIMERS, STEP_TIMERS_DOC = _table(
    ("rank", pa.int64(), "Rank that printed or recorded the timers."),
    ("source", pa.string(), "Writer or input file."),
    ("step", pa.int64(), "Optimizer step (null when a log gives no step for the line)."),
    ("line", pa.int64(), "Order of the timer line/record within the source (joins the timers of one print)."),
    ("scope", pa.string(), "global (per optimizer step, summed over micro steps), micro (one micro step), optimizer, or "
                            "megatron_interval (Megatron's timers: the mean per iteration over the logging interval that "
                            "ends at the row's step)."),
    ("timer", pa.string(), "DeepSpeed timer name: fwd, bwd, bwd_inner, bwd_allreduce, step, fwd_microstep, optimizer_step, ..."),
    ("ms", pa.float64(), "Host wall milliseconds, as DeepSpeed's wall_clock_breakdown reports them."),
)

SCALARS, SCALARS_DOC = _table(
    ("rank", pa.int64(), "Rank that wrote it (DeepSpeed monitors write on rank 0 only)."),
    ("source", pa.string(), "Writer or input file."),
    ("origin", pa.string(), "collector | csv_monitor | tensorboard | wandb | log."),
    ("name", pa.string(), "Tag as written, e.g. Train/Samples/lr, train/loss."),
    ("step", pa.int64(), "Optimizer step when known."),
    ("global_samples", pa.int64(), "Samples seen by the whole job: the x axis curves are aligned on."),
    ("global_tokens", pa.int64(), "Tokens seen by the whole job, when the sequence length is known."),
    ("value", pa.float64(), "Value (NaN and inf kept)."),
    ("wall_ns", pa.int64(), "Wall-clock time of the point, ns since epoch, when recorded."),
    ("segment", pa.int64(), "Process that wrote it within the source: 0, +1 after each restart (a repeated CSV header)."),
)

COMMS_CALLS, COMMS_CALLS_DOC = _table(
    ("rank", pa.int64(), "Rank that made (or logged) the call."),
    ("source", pa.string(), "Writer or input file."),
    ("call_index", pa.int64(), "Order of the call within (rank, source)."),
    ("ts_ns", pa.int64(), "Wall-clock start when known (collector), or the log line's time."),
    ("step", pa.int64(), "Optimizer step when known."),
    ("op", pa.string(), "DeepSpeed comm op (log_name), e.g. all_reduce, all_gather_into_tensor."),
    ("caller", pa.string(), "Calling function (DeepSpeed debug mode or the collector), else null."),
    ("msg_bytes", pa.int64(), "Message size as DeepSpeed records it (all_gather: the per-rank shard)."),
    ("nccl_bytes", pa.int64(), "nccl-tests message size S (all_gather: msg_bytes x n)."),
    ("group_size", pa.int64(), "n: ranks in the process group."),
    ("latency_ns", pa.int64(), "Latency of this one call."),
    ("latency_origin", pa.string(), "measured (per call) | issue_only (an async or unsynchronized op: the time to issue it) | repaired_cumulative (difference of DeepSpeed's running totals) | as_logged."),
    ("synchronized", pa.bool_(), "Timing forced a device synchronization (the numbers are not free-running throughput)."),
    ("algbw_gbps", pa.float64(), "nccl-tests algbw, GB/s (1e9 B/s), recomputed from nccl_bytes and latency_ns."),
    ("busbw_gbps", pa.float64(), "nccl-tests busbw, GB/s."),
)

COMMS_SUMMARY, COMMS_SUMMARY_DOC = _table(
    ("rank", pa.int64(), "Rank whose summary it is."),
    ("source", pa.string(), "Input file (log_summary text or dict)."),
    ("op", pa.string(), "DeepSpeed comm op."),
    ("caller", pa.string(), "The calling function, where the logger's debug mode records it (`op | [Caller Func: f]`)."),
    ("msg_bytes", pa.int64(), "Message size as DeepSpeed records it."),
    ("count", pa.int64(), "Calls."),
    ("total_latency_ms", pa.float64(), "As printed (a sum of running totals on DeepSpeed >= 0.18.3: wrong)."),
    ("avg_latency_ms", pa.float64(), "As printed (a trimmed mean)."),
    ("busbw_gbps", pa.float64(), "As printed (DeepSpeed's Gbps)."),
    ("trusted", pa.bool_(), "False when the latencies are known to be cumulative or otherwise wrong."),
)

FLOPS_PROFILE, FLOPS_PROFILE_DOC = _table(
    ("rank", pa.int64(), "Rank profiled (DeepSpeed profiles rank 0)."),
    ("source", pa.string(), "Writer or input file."),
    ("profile_step", pa.int64(), "Step profiled, as DeepSpeed prints it."),
    ("path", pa.string(), "Module path from the root ('' for the root), e.g. blocks.0.qkv."),
    ("module_class", pa.string(), "Module class, e.g. Linear."),
    ("depth", pa.int64(), "0 for the root."),
    ("params", pa.int64(), "Parameters, children included."),
    ("macs", pa.int64(), "MACs of the module's own functional ops."),
    ("flops", pa.int64(), "FLOPs of the module's own functional ops."),
    ("macs_total", pa.int64(), "MACs including children."),
    ("flops_total", pa.int64(), "FLOPs including children."),
    ("duration_ns", pa.int64(), "Forward wall time (profiler hooks; not a latency breakdown you can add up)."),
    ("duration_bogus", pa.bool_(), "The duration is a known profiler error (root latency when started by the engine)."),
    ("exact", pa.bool_(), "Counts are exact integers (collector) rather than parsed from rounded text."),
)

RUN_STATUS, RUN_STATUS_DOC = _table(
    ("rank", pa.int64(), "Rank, or null for the whole job/launcher."),
    ("source", pa.string(), "Input file."),
    ("run_index", pa.int64(), "Which run in the file, when several runs were concatenated (0 first)."),
    ("status", pa.string(), "completed | failed | killed | incomplete (cut off, or still running) | unknown."),
    ("exit_code", pa.int64(), "Exit code when printed."),
    ("error", pa.string(), "Last exception line of a traceback, or the kill message."),
    ("detail", pa.string(), "What the status rests on, for a human."),
)

AUTOTUNE_EXPERIMENTS, AUTOTUNE_EXPERIMENTS_DOC = _table(
    ("rank", pa.int64(), "Rank that wrote metrics.json (DeepSpeed: 0); null when the experiment left none."),
    ("experiment", pa.string(), "Experiment name, e.g. z1_gas1_tmbspg4, or a collector trial run's id."),
    ("source", pa.string(), "Folder or file it was read from."),
    ("trial", pa.int64(), "Repeat number for the same config (0 when measured once)."),
    ("zero_stage", pa.int64(), "ZeRO stage of the experiment's ds_config."),
    ("micro_batch", pa.int64(), "train_micro_batch_size_per_gpu."),
    ("grad_accum", pa.int64(), "gradient_accumulation_steps."),
    ("config_json", pa.string(), "The experiment's ds_config as JSON (autotuning block removed)."),
    ("status", pa.string(), "ok | oom | error | interrupted | not_run."),
    ("error", pa.string(), "The error line from stderr.log, when it failed."),
    ("latency_us", pa.float64(), "metrics.json latency: (fwd+bwd+step) x gas, microseconds."),
    ("throughput", pa.float64(), "metrics.json throughput, samples/s."),
    ("flops_per_gpu", pa.float64(), "metrics.json FLOPS_per_gpu."),
    ("fwd_us", pa.float64(), "metrics.json fwd, microseconds."),
    ("bwd_us", pa.float64(), "metrics.json bwd, microseconds."),
    ("step_us", pa.float64(), "metrics.json step, microseconds."),
    ("environment", pa.string(), "Host, devices and versions the experiment ran with, when recorded."),
)

MEMORY_USAGE, MEMORY_USAGE_DOC = _table(
    ("rank", pa.int64(), "Rank that printed it (see_memory_usage prints on rank 0 only)."),
    ("source", pa.string(), "Input file."),
    ("line", pa.int64(), "Line number of the figures in the file."),
    ("origin", pa.string(), "see_memory_usage (DeepSpeed runtime/utils.py) | deepspeed_throughput (its throughput line's "
                            "MemAllocated / MaxMemAllocated) | megatron_report_memory (Megatron's report_memory)."),
    ("message", pa.string(), "Where it was printed: see_memory_usage's message line (e.g. After Building Model), or "
                             "Megatron's '(after N iterations)'."),
    ("step", pa.int64(), "Optimizer step when the line says it (Megatron: after N iterations -> N - 1; throughput: "
                         "global_step=N -> N - 1), else null."),
    ("allocated_bytes", pa.int64(), "Allocated device memory then (MA; Megatron 'allocated')."),
    ("max_allocated_bytes", pa.int64(), "Peak allocated since the previous reset (Max_MA; see_memory_usage resets it after printing)."),
    ("reserved_bytes", pa.int64(), "Reserved (cached) device memory (CA; Megatron 'reserved'; null from a throughput line)."),
    ("max_reserved_bytes", pa.int64(), "Peak reserved (Max_CA, which DeepSpeed prints rounded to whole GiB; Megatron 'max reserved')."),
    ("resolution_bytes", pa.int64(), "Rounding of the printed allocated/reserved figures: 0.01 GiB for see_memory_usage "
                                     "and the throughput line, 0 for Megatron's exact MiB."),
    ("wall_ns", pa.int64(), "Time of the log line, ns since epoch (read as UTC), when stamped."),
)

ALARMS, ALARMS_DOC = _table(
    ("rank", pa.int64(), "Rank the alarm is about (straggler: the slow rank; the rules run on rank 0)."),
    ("source", pa.string(), "Writer or input file."),
    ("rule", pa.string(), "nonfinite | loss_spike | grad_norm_high | memory_growth | slow_step | throughput_drop | "
                          "straggler | no_progress (analyze/contract/alarm_rules.py)."),
    ("name", pa.string(), "Series watched: a scalar tag, step_time, samples_per_s, rank <r> or step_end."),
    ("step", pa.int64(), "Optimizer step of the point that raised it (no_progress: the step that did not end)."),
    ("global_samples", pa.int64(), "Samples seen by the whole job at that point, when known."),
    ("value", pa.float64(), "Value that raised it: the scalar, step time in ms, samples/s, busy ms, or seconds silent."),
    ("threshold", pa.float64(), "The rule's threshold (z, factor, fraction or seconds; null for nonfinite)."),
    ("severity", pa.string(), "info | warning | critical, as configured."),
    ("wall_ns", pa.int64(), "Wall-clock time of the point (no_progress: of the check), ns since epoch."),
    ("detail", pa.string(), "The alarm in words."),
)

# name -> (schema, column docs, partitioned by rank)
TABLES: dict[str, tuple[pa.Schema, dict[str, str], bool]] = {
    "trace_events": (TRACE_EVENTS, TRACE_EVENTS_DOC, True),
    "flows": (FLOWS, FLOWS_DOC, True),
    "steps": (STEPS, STEPS_DOC, True),
    "ingest_issues": (INGEST_ISSUES, INGEST_ISSUES_DOC, False),
    "train_steps": (TRAIN_STEPS, TRAIN_STEPS_DOC, False),
    "step_timers": (STEP_TIMERS, STEP_TIMERS_DOC, False),
    "scalars": (SCALARS, SCALARS_DOC, False),
    "comms_calls": (COMMS_CALLS, COMMS_CALLS_DOC, False),
    "comms_summary": (COMMS_SUMMARY, COMMS_SUMMARY_DOC, False),
    "flops_profile": (FLOPS_PROFILE, FLOPS_PROFILE_DOC, False),
    "run_status": (RUN_STATUS, RUN_STATUS_DOC, False),
    "autotune_experiments": (AUTOTUNE_EXPERIMENTS, AUTOTUNE_EXPERIMENTS_DOC, False),
    "alarms": (ALARMS, ALARMS_DOC, False),
    "memory_usage": (MEMORY_USAGE, MEMORY_USAGE_DOC, False),
}

# Tables filled by the collector and the native importers (not by the Kineto parser).
TELEMETRY_TABLES = ("train_steps", "step_timers", "scalars", "comms_calls", "comms_summary",
                    "flops_profile", "run_status", "autotune_experiments", "alarms", "memory_usage")

# run.json's keys, types and meanings: manifest.RunManifest.


def fingerprint() -> str:
    """Hash of every parsed table's columns and types: parts written under another layout (an older
    steplens) are never reused, even where SCHEMA_VERSION was not bumped."""
    layout = repr([(name, str(spec[0])) for name, spec in sorted(TABLES.items())]) + str(SCHEMA_VERSION)
    return hashlib.sha256(layout.encode()).hexdigest()[:16]


def text_columns(arrow_schema: pa.Schema) -> tuple[list[str], list[str]]:
    """(text columns, the others) of a table about to be written: every table's Parquet keeps min/max
    statistics for the others only. Up to a million events a rank is one row group and names are not
    clustered in time, so text bounds prune nothing and cost a tenth to a sixth of the write (trace_events of a
    real A100 rank 23.3 -> 20.6 ms, its op_perf 7.1 -> 6.0 ms)."""
    text = [f.name for f in arrow_schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
    return text, [name for name in arrow_schema.names if name not in text]


def part_dir(table: str, rank: int | None) -> str:
    """Relative folder of a table's part files for one rank (or the run-level folder)."""
    partitioned = TABLES[table][2]
    return f"{table}/rank={rank}" if partitioned else table


# The analyses' tables are declared by the analyses that write them (their ANALYSIS.writes); the catalogue
# of them all is steplens.analyze.analyses.TABLES.
