"""The importers, one module per input format (the interfaces are in `base`).

IMPORTERS read what a job left besides traces: the collector's Parquet parts and the native
DeepSpeed artifacts (logs, FLOPs-profiler text, comms dumps, csv_monitor, TensorBoard, W&B,
autotuning results), each into rows of the telemetry tables in `schema`. TRACE_IMPORTERS read one
rank's trace into its trace tables.

`ingest` offers every file under the run folder to IMPORTERS in order, then what is left to
TRACE_IMPORTERS; the first that claims a file reads it. Files nobody claims are listed as ignored
with the reason.
"""

from __future__ import annotations

from pathlib import Path

from steplens.analyze.importers import autotune_results, collector_parts, comms_dump, deepspeed_log, flops_text, monitor_scalars
from steplens.analyze.importers import kineto, nsys
from steplens.analyze.importers.base import Importer, TraceImporter

# Order is priority: specific file names before generic suffixes.
IMPORTERS: list[Importer] = [
    Importer("collector", collector_parts.claims, collector_parts.parse),
    Importer("autotune_experiment", autotune_results.claims_experiment, autotune_results.parse_experiment, autotune_results.experiment_companions),
    Importer("autotune_summary", autotune_results.claims_summary, autotune_results.parse_summary, autotune_results.summary_companions),
    Importer("tensorboard", monitor_scalars.claims_tensorboard, monitor_scalars.parse_tensorboard),
    Importer("wandb", monitor_scalars.claims_wandb, monitor_scalars.parse_wandb),
    Importer("csv_monitor", monitor_scalars.claims_csv, monitor_scalars.parse_csv_monitor),
    Importer("deepspeed_comms_dict", comms_dump.claims_raw, comms_dump.parse_raw, comms_dump.summary_sibling),
    Importer("deepspeed_comms_summary_dict", comms_dump.claims_summary, comms_dump.parse_summary),
    Importer("deepspeed_flops_profile", flops_text.claims, flops_text.parse, flops_text.ds_config_files),
    Importer("deepspeed_log", deepspeed_log.claims, deepspeed_log.parse),  # after the FLOPs text: a log may embed a profile
]


def claimant(path: Path) -> Importer | None:
    for importer in IMPORTERS:
        if importer.claims(path):
            return importer
    return None


# Kineto JSON (tensorboard_trace_handler's .pt.trace.json[.gz], export_chrome_trace's .json): a file
# that turns out not to be a trace is reported by the parser (not_a_trace), not guessed from its name.
TRACE_IMPORTERS: list[TraceImporter] = [
    TraceImporter("kineto", lambda path: path.name.endswith((".json", ".gz")), kineto.parse_trace),
    TraceImporter("nsys", nsys.claims, nsys.parse, settings=lambda: nsys.step_range().pattern),  # Nsight Systems SQLite exports (and reports to export)
]
TRACE_KINDS = frozenset(importer.name for importer in TRACE_IMPORTERS)


def trace_claimant(path: Path) -> TraceImporter | None:
    return next((importer for importer in TRACE_IMPORTERS if importer.claims(path)), None)
