"""Every reason an input problem is recorded in the `ingest_issues` table, declared once, like the stats
table of Perfetto's trace processor (src/trace_processor/storage/stats.h: name, severity, description).

Severity: info (normal, nothing lost), warning (repaired or guessed), error (data lost). A reason raised
at two severities by different importers lists both, the usual first. The ingest refuses to write an
issue whose reason is not declared here or whose severity the reason does not allow (a programming
error: tests/test_contract.py also scans the analyzer's source for reason literals).
"""

from __future__ import annotations

from dataclasses import dataclass

SEVERITIES = ("info", "warning", "error")

# A trace that lost this share of its events (or of its device work) or more is data lost (events_lost, an error:
# `analyze` exits 1), not a repair: every kernel with a NaN duration dropped left a trace whose GPU read 98% idle,
# with a warning beside it.
EVENTS_LOST_SHARE = 0.1


@dataclass
class Issue:
    """One problem of one input, as the `ingest_issues` table records it (reason: one declared below)."""
    severity: str
    reason: str
    count: int
    detail: str


@dataclass(frozen=True)
class IssueReason:
    name: str
    severities: tuple[str, ...]
    meaning: str


_DECLARED = (
    # Files and folders (pipeline/ingest.py)
    IssueReason("special_file", ("warning",), "A FIFO, device or socket: skipped without opening it."),
    IssueReason("broken_link", ("warning",), "A symbolic link to no file (a missing target, or links in a loop): "
                "nothing to read."),
    IssueReason("linked_folder", ("warning",), "A symbolic link to a folder: not followed (it may lead out of the "
                "run or loop), named in run.json."),
    IssueReason("unreadable", ("error",), "The file cannot be read, or a sub-folder cannot be listed (permissions, I/O "
                "error, a path past the system's limit): what it holds is lost."),
    IssueReason("empty_file", ("error", "warning"), "The file is empty (a log: warning, nothing expected was lost)."),
    IssueReason("not_a_trace", ("info",), "A .json/.gz file that is not a profiler trace, a SQLite file that is not an "
                "Nsight Systems export, or an nsys report to export first; ignored."),
    IssueReason("damaged_trace", ("error",), "A .json file with nothing usable (not JSON, or cut before its events)."),
    IssueReason("parse_failed", ("error",), "The trace parser failed on the file."),
    IssueReason("worker_lost", ("error",), "analyze --scheduler: every Dask worker that parsed the file died; not used."),
    IssueReason("no_such_run", ("error",), "A log asked for a job it does not hold (jobs appended to one log are read apart)."),
    IssueReason("no_events", ("error",), "A trace with no complete events."),
    IssueReason("events_lost", ("error", "warning"), "A tenth or more of a trace's events left out (malformed, oversized, "
                "without a usable time), or device work out of its timeline (an export's kernels gone while their "
                "launches remain, activities without a stream; a warning where that is under a tenth of the device "
                "work): its figures stand on the rest only."),
    IssueReason("import_failed", ("error",), "An importer of a native artifact failed on the file."),
    IssueReason("no_data", ("info",), "Recognised by an importer but holds no data."),
    IssueReason("bad_metadata", ("warning",), "Trace metadata of the wrong type or out of range; left out."),
    IssueReason("bad_fact", ("warning",), "A run fact (a log's ds_config, a manifest's settings, ...) of the wrong type "
                "or out of range (contract/manifest.py fact_problem); left out of the run's facts."),
    # Ranks (pipeline/ingest.py)
    IssueReason("output_folder", ("info",), "A folder analyze wrote (an --out inside the run folder): not read as "
                                            "an input."),
    IssueReason("rank_from_filename", ("warning",), "No distributedInfo.rank: the rank is taken from the file name."),
    IssueReason("rank_name_disagrees", ("warning",), "Of two traces of one rank, the one whose file name names "
                "another rank than its distributedInfo.rank (renamed or copied) is the one skipped."),
    IssueReason("rank_from_process", ("warning",), "A file of several processes (an nsys export): one rank per process, "
                                                   "in file then process order."),
    IssueReason("rank_in_name_ignored", ("warning",), "A file name's rank<N> is beyond any job's ranks (2^24): not taken "
                                                      "as the file's rank."),
    IssueReason("rank_assumed", ("warning",), "No rank in the trace or its name: treated as rank 0, the only trace."),
    IssueReason("rank_unknown", ("error",), "The rank of a trace cannot be told; the trace is not used."),
    IssueReason("duplicate_rank", ("error",), "Two traces claim one rank for the same time; the later is not used."),
    IssueReason("world_size_mismatch", ("warning",), "Traces disagree on the world size, or an input's run facts "
                "disagree with the traces' (the traces' is the run's: manifest.settle_world_size)."),
    # JSON decoding (importers/json_events.py)
    IssueReason("truncated", ("error", "warning"), "The file is cut short; what came before the cut is kept."),
    IssueReason("malformed_event", ("warning",), "Events that are not valid JSON or have an unexpected shape; skipped."),
    IssueReason("duplicate_keys", ("warning",), "Trace events giving a key twice: read with the last value of each key "
                "(JSON's usual rule)."),
    IssueReason("duplicate_trace_events", ("error",), "The file gives traceEvents twice (a second key, or a second "
                "trace written after the first): the first is read, the later one is not (readers that keep a key's "
                "last value read only the later)."),
    IssueReason("repaired_text", ("warning",), "Events whose strings held bytes that are not UTF-8 or a lone "
                "surrogate escape: kept, each bad character replaced by U+FFFD."),
    IssueReason("nesting_too_deep", ("warning",), "Events or metadata nested deeper than the decoder allows; skipped."),
    IssueReason("oversized_event", ("warning",), "Events larger than the decoder's limit (an unterminated string?); skipped."),
    IssueReason("oversized_metadata", ("warning",), "The text after traceEvents is too large and not valid JSON; not read."),
    IssueReason("trailing_garbage", ("warning",), "Bytes after the end of the JSON document or gzip stream; ignored."),
    IssueReason("zero_padding", ("info",), "Zero bytes after the end of the document (a preallocated file), or in a "
                "log (a crash); ignored."),
    # Kineto events (importers/kineto.py, trace/semantics.py)
    IssueReason("absolute_ts_with_base", ("info",), "ts already absolute: baseTimeNanoseconds not added."),
    IssueReason("bad_base_time", ("warning",), "baseTimeNanoseconds is not a plausible time; ignored."),
    IssueReason("unsupported_phase", ("info",), "Events of a phase other than complete, instant or flow; skipped."),
    IssueReason("missing_duration", ("warning",), "Complete events without dur; kept with a null duration."),
    IssueReason("negative_duration", ("warning",), "Complete events with a negative dur, kept as written (device work "
                                                   "with one is left out of the device analyses)."),
    IssueReason("missing_timestamp", ("warning",), "Timed events without ts; dropped."),
    IssueReason("bad_timestamp", ("warning",), "ts that is not a number or not a plausible time; those events dropped."),
    IssueReason("bad_duration", ("warning",), "dur that is not a number or implausible; kept without a duration."),
    IssueReason("unrepresentable_value", ("warning",), "Values out of range for their meaning (a trace arg) or their "
                "column (a log's number past int64, nan where a count belongs); stored as null."),
    IssueReason("long_text", ("warning",), "Text values (a name, shapes) longer than kineto.MAX_TEXT_CHARS characters; "
                "cut to that length (a 5 MB kernel name a few hundred times over reached 2 GiB in one column)."),
    IssueReason("bad_step_number", ("warning",), "ProfilerStep annotations whose number is missing or too large to "
                "be a step; kept as plain events."),
    IssueReason("reused_step_number", ("warning",), "A step number marking spans one after another (a restarted "
                "counter, copied annotations): left out of the steps; the events are kept, with no step."),
    IssueReason("overlapping_steps", ("warning",), "Steps that start before the step before them on their thread "
                "ended (edited annotations, merged traces): their step times hold that time twice; kept as given."),
    IssueReason("flow_without_end", ("info",), "Flow starts whose end is outside the trace window."),
    IssueReason("flow_unbound", ("info",), "Flow pairs whose start or end matches no slice; not linked."),
    IssueReason("device_activity_outside_window", ("warning",), "Device activities further from the trace's host events "
                "than the window's length (at least 1 s): a clock glitch; kept, left out of the device analyses."),
    IssueReason("orphan_device_activity", ("warning",), "Device activities whose launch is not in the trace (no step)."),
    IssueReason("correlation_reused", ("warning",), "Runtime calls whose correlation id an earlier call of the same "
                "role (launch API or other) has (windows appended into one file, merged traces): each device activity "
                "is linked to the call with its id that started last before it."),
    IssueReason("repeated_events", ("warning",), "Events listed twice or more in one file, every field equal (device "
                "work that took time, or calls with a correlation or External id): kept once."),
    # Nsight Systems exports (importers/nsys.py)
    IssueReason("nsys_schema_gap", ("info",), "Tables or columns this Nsight Systems export version lacks; what they "
                                              "would give is absent."),
    IssueReason("several_processes", ("info",), "Events of processes without CUDA work in an nsys export (a launcher's "
                                                "NVTX ranges): no rank holds them; not read."),
    # Collector parts (importers/collector_parts.py)
    IssueReason("collector_part_unreadable", ("error",), "A collector part cannot be read; its rows are lost."),
    IssueReason("collector_part_columns", ("error",), "A collector part with other columns than its table; skipped."),
    IssueReason("collector_part_rank", ("error",), "Collector rows (or a part's file name) of a rank past the rank "
                "limit the traces are held to; skipped."),
    IssueReason("collector_part_too_large", ("error",), "A collector part that decodes to more rows or bytes than a "
                "part is read for; the rows past the bound are skipped."),
    IssueReason("collector_rank_mismatch", ("warning",), "A collector part's file name and rows name different ranks."),
    IssueReason("not_a_collector_manifest", ("warning",), "A file in collector/manifest/ that is not a collector manifest."),
    IssueReason("collector_missing_tail", ("error",), "A rank's collector did not finish; rows after its last flush are missing."),
    IssueReason("collector_rows_dropped", ("error",), "The collector could not write and dropped rows: the run's "
                "record misses them (its steps, timers, scalars or calls)."),
    IssueReason("collector_values_implausible", ("warning",), "Collector rows with values no run can have (a negative "
                "latency or size, a NaN bandwidth, a duration past 104 days): dropped."),
    IssueReason("collector_values_rejected", ("warning",), "log() values that were not numbers were dropped in the job."),
    IssueReason("collector_part_disabled", ("warning",), "A part of the collector's recording was disabled after an error."),
    # DeepSpeed and Megatron logs (importers/deepspeed_log.py)
    IssueReason("long_lines", ("warning",), "Log lines longer than the reader's limit (1 MiB): cut there, the rest of "
                "each not read."),
    IssueReason("middle_skipped", ("warning",), "A text input (a log, csv_monitor file, FLOPs profile) over the reader's "
                "limit (512 MiB): its first and last 256 MiB are read, the bytes between are not."),
    IssueReason("oversized_file", ("error",), "A JSON input (a comms dump, an autotuning file) over the reader's limit "
                "(256 MiB), or a W&B log over 512 MiB: not parsed."),
    IssueReason("points_capped", ("warning",), "A monitor file (csv_monitor, TensorBoard, W&B) of more than a million "
                "points: the first million kept, the rest counted."),
    IssueReason("no_final_newline", ("info",), "The last line has no newline (cut off or still being written)."),
    IssueReason("garbled_lines", ("info", "error"), "Lines of interleaved writes or undecodable bytes (a csv_monitor file: "
                                                    "lines lost, error)."),
    IssueReason("no_world_size", ("warning",), "World size unknown: no nccl_bytes or bandwidth for comms records."),
    IssueReason("train_batch_size_unknown", ("info",), "Throughput lines imply a batch size no line states."),
    IssueReason("train_batch_size_inferred", ("info",), "train_batch_size inferred from other lines of the log."),
    IssueReason("several_runs", ("info",), "Several runs appended to one log file."),
    IssueReason("several_engines", ("info",), "Several DeepSpeed engines print step lines in one log (DeepSpeed-Chat's "
                                              "actor and critic): the second engine's scalars are named engine1/<name>."),
    IssueReason("no_records", ("info",), "DeepSpeed markers but no timer, step, comms or status lines."),
    # Comms-logger dumps (importers/comms_dump.py)
    IssueReason("bad_json", ("error",), "A comms dump that is not readable JSON; nothing read."),
    IssueReason("unexpected_layout", ("error",), "A comms dump whose JSON is not laid out as DeepSpeed writes it."),
    IssueReason("bad_entry", ("warning",), "Comms dump entries of the wrong shape; skipped."),
    IssueReason("cumulative_comms_latency", ("warning",), "Comms-logger latencies are running totals (DeepSpeed >= 0.18.3); "
                                                          "per-call latency repaired as differences."),
    IssueReason("comms_latency_kind_unknown", ("info",), "Too few calls to tell per-call from cumulative latencies."),
    IssueReason("comms_summary_trust_unknown", ("info",), "Whether a comms summary's latencies are running totals is unknown."),
    # Monitors: csv_monitor, TensorBoard, W&B (importers/monitor_scalars.py)
    IssueReason("csv_restart", ("warning",), "A csv_monitor header written again: the job restarted and appended."),
    IssueReason("truncated_event_file", ("error",), "A TensorBoard event file cut short or corrupt; complete records kept."),
    IssueReason("non_scalar_summaries", ("info",), "TensorBoard summaries that are not scalars; not read."),
    IssueReason("not_a_wandb_log", ("error",), "A .wandb file without the W&B log header; nothing read."),
    IssueReason("truncated_wandb_log", ("error",), "A W&B log cut short or with damaged blocks; complete records kept."),
    IssueReason("bad_wandb_record", ("error",), "W&B records that are not valid protobuf; skipped."),
    IssueReason("non_numeric_history", ("info",), "W&B history keys that are not numbers; not read."),
    IssueReason("bad_monitor_point", ("warning",), "TensorBoard or W&B points whose value or step no column holds "
                                                   "(damaged): skipped; a wall time out of range is left null."),
    # FLOPs-profiler text (importers/flops_text.py)
    IssueReason("not_a_flops_profile", ("error",), "No FLOPs-profiler header; not read."),
    IssueReason("no_module_tree", ("warning",), "No detailed per-module profile (detailed=false, or cut off)."),
    IssueReason("zero3_double_count", ("warning",), "ZeRO-3: DeepSpeed's profiler counts Linear MACs twice; flagged."),
    IssueReason("bogus_root_latency", ("warning",), "The root module latency is a known profiler error; flagged."),
    # Autotuning results (importers/autotune_results.py)
    IssueReason("bad_autotune_experiment", ("error",), "An autotuning experiment folder that is not one; not read."),
    IssueReason("bad_autotune_file", ("error",), "An autotuning file that cannot be read as DeepSpeed writes it."),
    IssueReason("bad_autotune_summary", ("error",), "An autotuning summary without tuning_space rows."),
)

ISSUE_REASONS: dict[str, IssueReason] = {reason.name: reason for reason in _DECLARED}


def check(severity: str, reason: str) -> None:
    """Raise ValueError for an undeclared reason or a severity the reason does not allow."""
    declared = ISSUE_REASONS.get(reason)
    if declared is None:
        raise ValueError(f"ingest issue reason {reason!r} is not declared in analyze/contract/issue_reasons.py")
    if severity not in declared.severities:
        raise ValueError(f"ingest issue {reason!r} raised as {severity!r}; declared {declared.severities}")
