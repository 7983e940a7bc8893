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

SCHEMA_VERSION = 1
MANIFEST_FILE = "run.json"
FINDINGS_FILE = "findings.json"  # the analyses' findings, beside the tables
# A rank named in a file name (rank3.json, rank-3.pt.trace.json, worker_rank_3.log): what a file without a recorded
# rank is taken to be.
RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def rank_in_name(file_name: str) -> int | None:
    """The rank a file's name states (RANK_IN_NAME), or None."""
    return int(named.group(1)) if (named := RANK_IN_NAME.search(file_name)) else None


# Device work a launch call enqueues (what counts as the GPU being busy), and every device-side event kind.
WORK_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
ALL_STREAMS = -1  # gpu_idle's and step_breakdown's rows that treat a device as one timeline (no stream busy = idle)
DEFAULT_OUT_DIR = ".steplens"
# Largest rank or world size taken from an input; beyond it the value is not a rank (the largest
# jobs run on ~10^5 GPUs) and an int64 table or a per-rank figure would overflow.
MAX_RANK = 1 << 24
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


def part_dir(table: str, rank: int | None) -> str:
    """Relative folder of a table's part files for one rank (or the run-level folder)."""
    partitioned = TABLES[table][2]
    return f"{table}/rank={rank}" if partitioned else table


# Analysis results: run-level tables (<table>/part-*.parquet: part-0, or part-<rank> for the per-rank
# kernel_launches), rewritten by every `analyze` run.
# name -> {column: meaning}. Written by analyze/analyses/runner.py; tests check the columns match.
ANALYSIS_TABLES: dict[str, dict[str, str]] = {
    "clock_offsets": {
        "rank": "Rank.",
        "offset_ns": "This rank's clock minus the reference rank's (aligned time = ts_ns - offset_ns).",
        "uncertainty_ns": "Half the range of the per-collective estimates.",
        "matched": "Collective instances shared with the reference rank.",
        "method": "How it was estimated (collective end times, reference, or none), or 'refused: ' and why the trace cannot be aligned as a rank of the same job.",
        "reference_rank": "The rank whose clock is the reference (the lowest).",
    },
    "step_times": {
        "rank": "Rank.", "step": "ProfilerStep number.",
        "cpu_start_ns": "Start of the step annotation (rank clock).", "cpu_end_ns": "Its end.",
        "cpu_dur_ns": "CPU step duration.",
        "gpu_start_ns": "First start of device work launched in the step.", "gpu_end_ns": "Last end of it.",
        "gpu_dur_ns": "GPU projection of the step.",
        "comm_wait_ns": "Time this rank waited in collectives for slower ranks in the step.",
        "aligned_start_ns": "cpu_start_ns on the reference clock.", "aligned_end_ns": "cpu_end_ns on the reference clock.",
    },
    "step_stats": {
        "step": "ProfilerStep number.", "ranks": "Ranks that recorded it.",
        "min_dur_ns": "Shortest CPU step over ranks.", "median_dur_ns": "Median.", "max_dur_ns": "Longest.",
        "spread_ns": "max_dur_ns - min_dur_ns.", "slowest_rank": "Rank with the longest CPU step.",
        "straggler_rank": "Rank the others waited for (last to arrive at collectives; without collective timing the longest "
                          "step), when it stands out from the run's noise (straggler_basis) and the wait is >= 5% of the step.",
        "others_waited_ns": "Total collective wait of the other ranks in the step.",
        "median_other_wait_ns": "Median of it over the other ranks.",
        "aligned_dur_ns": "Step wall time across ranks on the aligned clock (first start to last end).",
        "straggler_basis": "How the straggler was shown to stand out from the run's noise (same_rank_last, "
                           "beyond_rank_spread), with its numbers; null: no straggler.",
    },
    "collectives": {
        "rank": "Rank.", "step": "Step of the launch.",
        "event_id": "The communication kernel's event_id (family communication: NCCL/RCCL, NVLS multimem, DeepEP, custom all-reduce).",
        "instance": "Cross-rank key: process group + Seq, else process group + op + order.",
        "op": "Collective in nccl-tests terms (allreduce, allgather, reducescatter, alltoall, broadcast, reduce, sendrecv, ...), "
              "from record_param_comms or else inferred from the kernel name (unknown when neither says).",
        "collective": "'Collective name' as recorded.", "name": "Kernel name.", "group_name": "Process group.",
        "group_size": "n of the nccl-tests formulas: the process group's size.", "seq": "Sequence number in the group.",
        "dtype": "Element type.", "bytes": "nccl-tests message size S (allgather: whole output; reducescatter: whole input); "
                                           "null when the trace records no record_param_comms for the kernel.",
        "ts_ns": "Kernel start.", "dur_ns": "Kernel duration.", "algbw_gbps": "S / duration, GB/s (1e9 B/s).",
        "busbw_gbps": "algbw x nccl-tests bus factor (allreduce 2(n-1)/n, allgather/reducescatter/alltoall (n-1)/n, else 1).",
        "overlapped_ns": "Part covered by compute kernels on another stream of the same device.",
        "exposed_ns": "dur_ns - overlapped_ns.", "regime": "latency-bound below 1 MiB, else bandwidth-bound.",
        "device": "GPU.", "stream": "Stream.",
        "issuing_op": "Innermost CPU op, annotation or Python frame around the launch (record_param_comms skipped).",
    },
    "collective_instances": {
        "instance": "Cross-rank key.", "op": "Collective.", "ranks": "Ranks that recorded it.", "step": "Step.",
        "bytes": "S.", "group_size": "n.", "min_dur_ns": "Minimum kernel time over ranks: the transfer itself.",
        "max_dur_ns": "Maximum: includes waiting for the last rank.",
        "start_skew_ns": "Spread of kernel starts over ranks (aligned clocks).",
        "end_skew_ns": "Spread of kernel ends over ranks (aligned clocks).",
        "last_rank": "Rank that started last (the others waited for it).",
        "busbw_at_min_latency_gbps": "busbw at the minimum latency.",
    },
    "kernel_launches": {
        "rank": "Rank.", "source": "Source file.", "event_id": "Device event.",
        "step": "Step of the launch call; null when the launch is not in the file (orphan_device_activity).",
        "kind": "kernel, gpu_memcpy or gpu_memset.",
        "name": "Device event name.", "stream": "Stream.", "device": "GPU.", "correlation": "Correlation id.",
        "ts_ns": "Start on the GPU.", "dur_ns": "GPU duration.",
        "launch_api": "Runtime/driver call that enqueued it (null: no launch recorded).", "launch_ts_ns": "Start of that call.",
        "api_ns": "CPU cost of the call.", "launch_pid": "Launching process.", "launch_tid": "Launching thread.",
        "queue_ns": "From the end of the call to the start on the GPU; negative when the work started before the call "
                    "returned (blocking copies, graph launches).",
        "launch_delay_ns": "From the start of the call to the start on the GPU.",
    },
    "launch_summary": {
        "rank": "Rank.", "launch_api": "Launch API.", "activities": "Device activities it launched.",
        "api_ns_median": "Median CPU cost.", "api_ns_p90": "90th percentile CPU cost.",
        "queue_ns_median": "Median queueing (queue_ns clipped at 0).", "queue_ns_p90": "90th percentile queueing (clipped at 0).", "gpu_ns_total": "GPU time launched.",
    },
    "gpu_idle": {
        "rank": "Rank.", "device": "GPU.", "stream": "Stream, or -1: the whole device (idle only when no stream is busy).",
        "step": "Step; null only on the whole-window rows (stream -1: all device work of the profiler window).",
        "span_start_ns": "First start of the row's device work (the step's, the step's on the stream, or the window's).",
        "span_end_ns": "Last end.",
        "span_ns": "The span.", "busy_ns": "Part of the span the device (stream -1) or the stream was busy; stream -1 rows "
        "count every step's work and work launched before the window.", "idle_ns": "span_ns - busy_ns.",
        "host_bound_ns": "Idle with nothing queued: the GPU waited for the CPU to launch.",
        "sync_ns": "Idle while the launching thread sat in a synchronizing call.",
        "other_ns": "Idle with work queued (cross-stream waits) or launches not recorded.",
        "activities": "Device activities of the row (the step's, the stream's, or the window's).",
        "source": "Profiler window (trace file) the row belongs to.",
    },
    "sync_points": {
        "rank": "Rank.", "step": "ProfilerStep the call ran in (its CPU time window).", "name": "Synchronizing call.", "issuing_op": "Innermost CPU op, annotation or frame around it.",
        "ts_ns": "Start of the call.", "dur_ns": "Its duration.", "idle_caused_ns": "Device idle it caused (sync gaps).",
    },
    "kernel_categories": {
        "rank": "Rank.", "step": "Step.", "category": "Kernel family from the base name (analyze/analyses/kernel_families.py): gemm, conv, attention, "
                    "communication, normalization, elementwise, reduction, optimizer, embedding, triton, memcpy, memset, other.",
        "kernels": "Activities.", "time_ns": "Summed GPU time (streams may overlap).",
    },
    "top_kernels": {
        "name": "Kernel.", "category": "Category.", "calls": "Calls over all ranks.", "time_ns": "Total time.",
        "ranks": "Ranks that ran it.", "min_rank_time_ns": "Least time on one rank.", "max_rank_time_ns": "Most time on one rank.",
        "mean_ns": "Mean per call.",
    },
    "op_perf": {
        "rank": "Rank.", "source": "Trace file.", "event_id": "The CPU op's event_id in trace_events.",
        "external_id": "Its External id (the runtime calls it made carry it).", "step": "ProfilerStep of the op.",
        "name": "Op name, e.g. aten::addmm.",
        "family": "gemm | conv | attention | elementwise | normalization | reduction | other (kernel family names).",
        "shapes": "Input Dims as recorded (JSON text).", "dtype": "Element type of the first tensor input (bf16, fp16, fp32, ...).",
        "flops": "FLOPs from the shapes (analyze/analyses/op_model.py, formula and source per family); null: no formula or unknown shapes.",
        "bytes": "Bytes moved: operands read once, outputs written once; null when unknown.",
        "device_ns": "Summed duration of all device work launched under the op, nested ops included (External id -> "
                     "runtime call -> correlation); 0 when it launched none.",
        "achieved_tflops": "flops / device_ns, TFLOP/s.", "achieved_tbps": "bytes / device_ns, TB/s.",
        "intensity": "flops / bytes (FLOPs per byte).",
        "bound": "compute | memory: intensity against the device's ridge point (peak FLOP/s / bandwidth); null without a roofline.",
        "fraction_of_peak": "Achieved FLOP/s over the dense peak (compute-bound) or achieved bytes/s over the memory bandwidth (memory-bound).",
        "nested": "Inside another op with a FLOPs/bytes model on its thread (its time is in the outer op's too).",
    },
    "module_perf": {
        "rank": "Rank.", "step": "ProfilerStep.", "module": "Path of nn.Module events (with_stack), e.g. GPT_0/Block_1/Linear_4.",
        "module_class": "Module class.", "depth": "Nesting depth (0: outermost module).", "calls": "Forward calls in the step.",
        "device_ns": "Device work launched inside the module's forward (submodules included).",
        "unknown_flops_device_ns": "The part of device_ns in GEMM, convolution, attention or Triton-template kernels launched "
                                   "under no op with a FLOPs formula (a torch.compile region): FLOPs flops does not count.",
        "flops": "FLOPs of the modeled ops inside it (op_perf, outer ops only); null when none has a model.",
        "achieved_tflops": "flops / device_ns, TFLOP/s (forward only); null where unknown_flops_device_ns is over 10% "
                           "of device_ns.",
        "backward_device_ns": "Device work under the backward nodes (fwdbwd flows) of the forward ops inside the module.",
    },
    "module_mfu": {
        "rank": "Rank.", "step": "ProfilerStep.", "module": "Module path in the trace (module_perf).",
        "module_class": "Module class.", "profile_path": "The matching flops_profile path (class and instance order).",
        "calls": "Forward calls in the step.", "forward_flops": "flops_profile forward FLOPs (children included) x calls.",
        "device_ns": "Forward device time (module_perf).", "achieved_tflops": "forward_flops / device_ns, TFLOP/s.",
        "peak_tflops": "Dense peak of the run's dtype (--dtype).", "mfu": "achieved_tflops / peak_tflops; null when flagged or no peak.",
        "definition": "What is divided by what.", "flag": "Why the number is not trusted (ZeRO-3 double counting), else null.",
        "backward_device_ns": "Backward device time (module_perf).", "training_flops": "3 x forward_flops (backward = 2 x forward).",
        "training_mfu": "training_flops / (device_ns + backward_device_ns) / peak; null without backward time, when flagged or no peak.",
    },
    "mfu": {
        "step": "Step.", "rank": "Rank (null: the whole job).", "metric": "MFU (model FLOPs) or HFU (executed FLOPs).",
        "numerator": "palm (6N + 12LHQT per token), profiler_flops (torch.profiler with_flops) or collector_flops_profile "
                     "(3 x the collector's profiled forward FLOPs).", "flops": "FLOPs in the step.",
        "step_time_ns": "Step time divided by.", "gpus": "GPUs.", "peak_flops": "Dense peak per GPU, FLOP/s.",
        "utilization": "flops / (step time x gpus x peak).", "definition": "The numerator's definition.",
        "peak": "The peak, its dtype and source.",
        "inputs_disagree": "Why the figure cannot be true (its utilization is then null; findings inputs_disagree).",
    },
    "step_time": {
        "step": "Optimizer step, from 0 (ProfilerStep#N when the source is profiler_steps).",
        "source": "train_steps (collector) | log | profiler_steps: the best source the run has (analyze/analyses/step_time.py).",
        "step_time_ns": "Slowest rank's sum of the step's micro steps (logs: the stated time of the step).",
        "slowest_rank": "Rank with that time.", "ranks": "Ranks that recorded the step.",
        "micro_steps": "Micro steps of the slowest rank.", "start_ns": "Earliest start over ranks (rank clocks).",
        "end_ns": "Latest end.", "samples": "Samples the whole job consumed in the step.",
        "skipped": "The optimizer skipped the step (fp16 overflow).", "loss_scale": "fp16 loss scale after the step.",
        "excluded": "Left out of the run's step-time summary.",
        "reason": "Why: warm_up, flops_profiler, profiler_warmup, profiler_window, profiler_export, checkpoint_save, "
                  "overflow_skipped, incomplete, negative_duration, longer_than_run, no_time (comma-separated).",
        "definition": "The step-time definition of the source, in words.",
    },
    "autotune_ranking": {
        "tuning_space": "global, or z<stage>: the experiments of one ZeRO stage (as DeepSpeed's summary.txt groups them).",
        "rank": "1 = best by the median metric from the experiments' own metrics.json; null: no metrics (failed).",
        "experiment": "Experiment name (first trial's, for collector trial runs).",
        "experiments": "All experiment names that are trials of this configuration (same ds_config), comma-separated.",
        "zero_stage": "ZeRO stage.", "micro_batch": "train_micro_batch_size_per_gpu.", "grad_accum": "gradient_accumulation_steps.",
        "trials": "Experiments of this configuration.", "ok_trials": "Of them, those with metrics.",
        "statuses": "Statuses seen (ok, oom, error, interrupted, not_run), comma-separated.",
        "error": "First error line, when a trial failed.", "metric": "throughput (samples/s), FLOPS or latency (us).",
        "median": "Median metric over the trials.", "min": "Smallest.", "max": "Largest.", "spread": "max - min.",
        "environment": "Hosts, launcher, command (tuned values blanked) and versions, as JSON.",
        "environment_differs": "The environment differs from the most common one (or between its own trials).",
    },
    "autotune_verdict": {
        "tuning_space": "global or z<stage>.", "metric": "The metric ranked on.",
        "winner": "Best configuration by median.", "winner_median": "Its median.", "winner_trials": "Its trials with metrics.",
        "runner_up": "Second best.", "runner_up_median": "Its median.", "runner_up_trials": "Its trials with metrics.",
        "difference": "|winner_median - runner_up_median|.", "relative_difference": "difference / runner_up_median.",
        "noise_sd": "Run-to-run noise: 1.4826 x median absolute deviation of all repeated trials from their config's median.",
        "test": "mann_whitney_u_exact_one_sided when both have 2+ trials, else null.",
        "statistic": "Mann-Whitney U of the winner's trials.", "p_value": "Exact one-sided p-value.",
        "established": "The winner beats the runner-up beyond the noise (p < 0.05); false with single measurements.",
        "trials_needed": "Trials per config that would settle it: at least 4 (1/C(2n,n) < 0.05), more by the normal "
                         "sample-size formula at 80% power when the noise is known; -1: identical medians.",
        "detail": "The verdict in words.",
        "deepspeed_pick": "best_exp_name in DeepSpeed's summary.txt.", "deepspeed_recorded": "best_metric_val there.",
        "pick_mismatch": "DeepSpeed's pick or recorded value disagrees with the experiments' own metrics (stale metric).",
        "pick_detail": "What disagrees.",
        "same_environment": "All experiments ran with one environment and the same fixed ds_config.",
        "environment_detail": "What differs, when something does.",
    },
    "comms_log_stats": {
        "op": "DeepSpeed comm op (log_name), e.g. all_reduce, all_gather_into_tensor.",
        "msg_bytes": "Message size as DeepSpeed records it (all_gather: the per-rank shard).",
        "nccl_bytes": "nccl-tests message size S.", "group_size": "n (DeepSpeed's world size: the logger knows no group).",
        "calls": "Calls timed, over all ranks (one source per rank: the comms dump before the log).",
        "ranks": "Ranks that timed them.", "median_latency_ns": "Median per-call latency.",
        "p90_latency_ns": "90th percentile.", "total_latency_ns": "Summed latency.",
        "median_algbw_gbps": "Median nccl-tests algbw, GB/s.", "median_busbw_gbps": "Median nccl-tests busbw, GB/s.",
        "latency_origin": "measured | repaired_cumulative | as_logged (several joined by commas).",
        "synchronized": "The timer synchronized around the op (DeepSpeed's comms logger always does).",
        "caveat": "Why these are not free-running throughput numbers.",
    },
    "monitor_alarms": {
        "alarm": "nan_inf | loss_spike | grad_norm_high | throughput_drop (a rate falls or a step time rises) | memory_growth.",
        "name": "Scalar tag.", "origin": "Where the series came from (one origin per tag: the fullest).",
        "source": "Input file.", "global_samples": "x of the point.", "step": "Optimizer step, when train_batch_size is known.",
        "value": "The value that fired (throughput_drop from a rate: the median of the last `recent` points).",
        "baseline": "What it was judged against: the trailing median (spikes, slow steps), the median before the recent "
                    "points (rates), the median of the first `window` points (memory_growth); null for nan_inf and a threshold.",
        "score": "loss/grad-norm spikes: modified z-score 0.6745 (value - median) / MAD; slow step: value / median; "
                 "rate and memory: relative change.",
        "threshold": "The rule's threshold (analyze/contract/alarm_rules.py: z 3.5 after Iglewicz & Hoaglin, 3x for a slow "
                     "step, -20% for a rate, +20% for memory, the grad-norm threshold given).",
        "detail": "The alarm in words.",
        "rule": "The alarm rule that fired (alarm_rules kinds: nonfinite, loss_spike, grad_norm_spike, grad_norm_high, "
                "slow_step, throughput_drop, memory_growth), evaluated as the in-job collector evaluates it.",
    },
    "alarm_agreement": {
        "rule": "Alarm rule (analyze/contract/alarm_rules.py).", "name": "Series watched (scalar tag, step_time, samples_per_s, rank <r>, step_end).",
        "step": "Optimizer step it fired at.", "rank": "Rank it is about.", "severity": "As configured.",
        "in_job": "Raised by the collector while the job ran (the alarms table).",
        "post_hoc": "Raised by the same rules replayed over the recorded collector rows.",
        "value_in_job": "Value the job saw.", "value_post_hoc": "Value in the replay.",
        "detail": "The alarm in words (the job's, else the replay's).",
        "instrumented": "A step rule's alarm on a step the run instrumented (profiler, FLOPs profile, checkpoint): "
                        "the replay skips such steps; not counted as a disagreement.",
    },
    "run_comparability": {
        "field": "world_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size, "
                 "code_revision, zero_stage, seq_len, deepspeed_version.",
        "required": "Runs cannot be shown comparable without it.",
        "status": "same | different | missing (in some run) | recorded (one run).",
        "values": "JSON {run: value}.", "detail": "What it means for comparing the runs.",
    },
    "step_breakdown": {
        "rank": "Rank.", "source": "Trace file (profiler window).", "device": "GPU.", "step": "Step.",
        "span_ns": "First start to last end of the device work launched in the step (gpu_idle's step span).",
        "compute_ns": "Part of the span covered by non-communication device work (kernels, copies, sets) of any step.",
        "exposed_comm_ns": "Part of the span covered by communication kernels and not by compute.",
        "idle_ns": "span_ns - compute_ns - exposed_comm_ns: no device work at all.",
        "host_bound_ns": "Idle with nothing queued (gpu_idle).", "sync_ns": "Idle during a synchronizing call (gpu_idle).",
        "other_ns": "Idle with work queued or launches not recorded (gpu_idle).",
    },
    "step_timeline": {
        "rank": "Rank.", "step": "The slowest profiled step (longest wall time across ranks).",
        "activity": "compute | exposed communication | idle (as in step_breakdown).",
        "start_ns": "Segment start on the reference rank's clock (ts - clock offset).", "end_ns": "Segment end.",
    },
    "collective_summary": {
        "op": "Collective.", "bytes": "nccl-tests message size S (null: not in the trace).", "calls": "Calls over all ranks.",
        "ranks": "Ranks that ran it.", "kernel_ns": "Summed kernel time over all ranks.",
        "max_rank_exposed_ns": "Exposed time (not overlapped by compute) of the rank where it was most exposed.",
        "max_exposed_rank": "That rank.", "median_rank_exposed_ns": "Median over ranks of each rank's exposed time.",
        "overlapped_ns": "Kernel time hidden behind compute, all ranks.", "busbw_median_gbps": "Median busbw over calls, GB/s.",
        "busbw_p10_gbps": "10th percentile.", "busbw_p90_gbps": "90th percentile.",
    },
    "collective_call_sites": {
        "issuing_op": "CPU op, annotation or Python frame that issued the collective.", "op": "Collective.",
        "calls": "Calls over all ranks.", "max_rank_exposed_ns": "Exposed time of the most exposed rank.",
        "max_exposed_rank": "That rank.",
    },
    "category_summary": {
        "category": "Kernel family (kernel_categories).", "kernels": "Activities, all ranks and steps.",
        "time_ns": "Summed GPU time, all ranks (streams may overlap).", "share": "time_ns / all categories' time_ns.",
    },
    "scalar_series": {
        "origin": "Where the series came from (collector, csv_monitor, tensorboard, wandb, log).", "name": "Scalar tag.",
        "points": "Points.", "ranks": "Ranks that logged it.",
        "aligned_points": "Points with a global-samples x and a finite value (the ones a curve can show).",
    },
}

# The Arrow type of every analysis column (ANALYSIS_TABLES gives the order and the meaning). Taken from what
# the analyses produce on real runs, with every count as int64 (polars counts are uint32) and text as
# string, as in the ingested tables. runner._write casts each table to analysis_schema(table) before
# writing, so a table has the same types in every run directory, empty or not.
_INT, _FLOAT, _STR, _BOOL = pa.int64(), pa.float64(), pa.string(), pa.bool_()
ANALYSIS_TYPES: dict[str, dict[str, pa.DataType]] = {
    "clock_offsets": {"rank": _INT, "offset_ns": _INT, "uncertainty_ns": _INT, "matched": _INT, "method": _STR,
        "reference_rank": _INT},
    "step_times": {"rank": _INT, "step": _INT, "cpu_start_ns": _INT, "cpu_end_ns": _INT, "cpu_dur_ns": _INT,
        "gpu_start_ns": _INT, "gpu_end_ns": _INT, "gpu_dur_ns": _INT, "comm_wait_ns": _INT, "aligned_start_ns": _INT,
        "aligned_end_ns": _INT},
    "step_stats": {"step": _INT, "ranks": _INT, "min_dur_ns": _INT, "median_dur_ns": _INT, "max_dur_ns": _INT,
        "spread_ns": _INT, "slowest_rank": _INT, "straggler_rank": _INT, "others_waited_ns": _INT,
        "median_other_wait_ns": _INT, "aligned_dur_ns": _INT, "straggler_basis": _STR},
    "collectives": {"rank": _INT, "step": _INT, "event_id": _INT, "instance": _STR, "op": _STR, "collective": _STR,
        "name": _STR, "group_name": _STR, "group_size": _INT, "seq": _INT, "dtype": _STR, "bytes": _INT,
        "ts_ns": _INT, "dur_ns": _INT, "algbw_gbps": _FLOAT, "busbw_gbps": _FLOAT, "overlapped_ns": _INT,
        "exposed_ns": _INT, "regime": _STR, "device": _INT, "stream": _INT, "issuing_op": _STR},
    "collective_instances": {"instance": _STR, "op": _STR, "ranks": _INT, "step": _INT, "bytes": _INT,
        "group_size": _INT, "min_dur_ns": _INT, "max_dur_ns": _INT, "start_skew_ns": _INT, "end_skew_ns": _INT,
        "last_rank": _INT, "busbw_at_min_latency_gbps": _FLOAT},
    "kernel_launches": {"rank": _INT, "source": _STR, "event_id": _INT, "step": _INT, "kind": _STR, "name": _STR,
        "stream": _INT, "device": _INT, "correlation": _INT, "ts_ns": _INT, "dur_ns": _INT, "launch_api": _STR,
        "launch_ts_ns": _INT, "api_ns": _INT, "launch_pid": _INT, "launch_tid": _INT, "queue_ns": _INT,
        "launch_delay_ns": _INT},
    "launch_summary": {"rank": _INT, "launch_api": _STR, "activities": _INT, "api_ns_median": _FLOAT,
        "api_ns_p90": _FLOAT, "queue_ns_median": _FLOAT, "queue_ns_p90": _FLOAT, "gpu_ns_total": _INT},
    "gpu_idle": {"rank": _INT, "device": _INT, "stream": _INT, "step": _INT, "span_start_ns": _INT,
        "span_end_ns": _INT, "span_ns": _INT, "busy_ns": _INT, "idle_ns": _INT, "host_bound_ns": _INT,
        "sync_ns": _INT, "other_ns": _INT, "activities": _INT, "source": _STR},
    "sync_points": {"rank": _INT, "step": _INT, "name": _STR, "issuing_op": _STR, "ts_ns": _INT, "dur_ns": _INT,
        "idle_caused_ns": _INT},
    "kernel_categories": {"rank": _INT, "step": _INT, "category": _STR, "kernels": _INT, "time_ns": _INT},
    "top_kernels": {"name": _STR, "category": _STR, "calls": _INT, "time_ns": _INT, "ranks": _INT,
        "min_rank_time_ns": _INT, "max_rank_time_ns": _INT, "mean_ns": _INT},
    "op_perf": {"rank": _INT, "source": _STR, "event_id": _INT, "external_id": _INT, "step": _INT, "name": _STR,
        "family": _STR, "shapes": _STR, "dtype": _STR, "flops": _FLOAT, "bytes": _FLOAT, "device_ns": _INT,
        "achieved_tflops": _FLOAT, "achieved_tbps": _FLOAT, "intensity": _FLOAT, "bound": _STR,
        "fraction_of_peak": _FLOAT, "nested": _BOOL},
    "module_perf": {"rank": _INT, "step": _INT, "module": _STR, "module_class": _STR, "depth": _INT, "calls": _INT,
        "device_ns": _INT, "unknown_flops_device_ns": _INT, "flops": _FLOAT, "achieved_tflops": _FLOAT, "backward_device_ns": _INT},
    "module_mfu": {"rank": _INT, "step": _INT, "module": _STR, "module_class": _STR, "profile_path": _STR,
        "calls": _INT, "forward_flops": _FLOAT, "device_ns": _INT, "achieved_tflops": _FLOAT, "peak_tflops": _FLOAT,
        "mfu": _FLOAT, "definition": _STR, "flag": _STR, "backward_device_ns": _INT, "training_flops": _FLOAT,
        "training_mfu": _FLOAT},
    "mfu": {"step": _INT, "rank": _INT, "metric": _STR, "numerator": _STR, "flops": _FLOAT, "step_time_ns": _INT,
        "gpus": _INT, "peak_flops": _FLOAT, "utilization": _FLOAT, "definition": _STR, "peak": _STR,
        "inputs_disagree": _STR},
    "step_time": {"step": _INT, "source": _STR, "step_time_ns": _INT, "slowest_rank": _INT, "ranks": _INT,
        "micro_steps": _INT, "start_ns": _INT, "end_ns": _INT, "samples": _INT, "skipped": _BOOL,
        "loss_scale": _FLOAT, "excluded": _BOOL, "reason": _STR, "definition": _STR},
    "autotune_ranking": {"tuning_space": _STR, "rank": _INT, "experiment": _STR, "experiments": _STR,
        "zero_stage": _INT, "micro_batch": _INT, "grad_accum": _INT, "trials": _INT, "ok_trials": _INT,
        "statuses": _STR, "error": _STR, "metric": _STR, "median": _FLOAT, "min": _FLOAT, "max": _FLOAT,
        "spread": _FLOAT, "environment": _STR, "environment_differs": _BOOL},
    "autotune_verdict": {"tuning_space": _STR, "metric": _STR, "winner": _STR, "winner_median": _FLOAT,
        "winner_trials": _INT, "runner_up": _STR, "runner_up_median": _FLOAT, "runner_up_trials": _INT,
        "difference": _FLOAT, "relative_difference": _FLOAT, "noise_sd": _FLOAT, "test": _STR, "statistic": _FLOAT,
        "p_value": _FLOAT, "established": _BOOL, "trials_needed": _INT, "detail": _STR, "deepspeed_pick": _STR,
        "deepspeed_recorded": _FLOAT, "pick_mismatch": _BOOL, "pick_detail": _STR, "same_environment": _BOOL,
        "environment_detail": _STR},
    "comms_log_stats": {"op": _STR, "msg_bytes": _INT, "nccl_bytes": _INT, "group_size": _INT, "calls": _INT,
        "ranks": _INT, "median_latency_ns": _INT, "p90_latency_ns": _INT, "total_latency_ns": _INT,
        "median_algbw_gbps": _FLOAT, "median_busbw_gbps": _FLOAT, "latency_origin": _STR, "synchronized": _BOOL,
        "caveat": _STR},
    "monitor_alarms": {"alarm": _STR, "name": _STR, "origin": _STR, "source": _STR, "global_samples": _INT,
        "step": _INT, "value": _FLOAT, "baseline": _FLOAT, "score": _FLOAT, "threshold": _FLOAT, "detail": _STR,
        "rule": _STR},
    "alarm_agreement": {"rule": _STR, "name": _STR, "step": _INT, "rank": _INT, "severity": _STR, "in_job": _BOOL,
        "post_hoc": _BOOL, "value_in_job": _FLOAT, "value_post_hoc": _FLOAT, "detail": _STR, "instrumented": _BOOL},
    "run_comparability": {"field": _STR, "required": _BOOL, "status": _STR, "values": _STR, "detail": _STR},
    "step_breakdown": {"rank": _INT, "source": _STR, "device": _INT, "step": _INT, "span_ns": _INT,
        "compute_ns": _INT, "exposed_comm_ns": _INT, "idle_ns": _INT, "host_bound_ns": _INT, "sync_ns": _INT,
        "other_ns": _INT},
    "step_timeline": {"rank": _INT, "step": _INT, "activity": _STR, "start_ns": _INT, "end_ns": _INT},
    "collective_summary": {"op": _STR, "bytes": _INT, "calls": _INT, "ranks": _INT, "kernel_ns": _INT,
        "max_rank_exposed_ns": _INT, "max_exposed_rank": _INT, "median_rank_exposed_ns": _INT, "overlapped_ns": _INT,
        "busbw_median_gbps": _FLOAT, "busbw_p10_gbps": _FLOAT, "busbw_p90_gbps": _FLOAT},
    "collective_call_sites": {"issuing_op": _STR, "op": _STR, "calls": _INT, "max_rank_exposed_ns": _INT,
        "max_exposed_rank": _INT},
    "category_summary": {"category": _STR, "kernels": _INT, "time_ns": _INT, "share": _FLOAT},
    "scalar_series": {"origin": _STR, "name": _STR, "points": _INT, "ranks": _INT, "aligned_points": _INT},
}


def _analysis_schemas() -> dict[str, pa.Schema]:
    schemas = {}
    for table, docs in ANALYSIS_TABLES.items():
        types = ANALYSIS_TYPES.get(table, {})
        if set(types) != set(docs):
            raise ValueError(f"analysis table {table}: columns documented but not typed {sorted(set(docs) - set(types))}, "
                             f"typed but not documented {sorted(set(types) - set(docs))}")
        schemas[table] = pa.schema([pa.field(column, types[column]) for column in docs])
    if extra := set(ANALYSIS_TYPES) - set(ANALYSIS_TABLES):
        raise ValueError(f"analysis tables typed but not documented: {sorted(extra)}")
    return schemas


_ANALYSIS_SCHEMAS = _analysis_schemas()


def analysis_schema(table: str) -> pa.Schema:
    """An analysis table's typed schema: ANALYSIS_TABLES' columns, in order, with ANALYSIS_TYPES' types."""
    return _ANALYSIS_SCHEMAS[table]
