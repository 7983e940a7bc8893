"""The importers, one module per input format.

Trace formats are registered here, one line each (`TRACE_IMPORTERS`); a format's module is imported
only when a file needs it, so this list is read before polars is imported (to decide whether to start
worker processes early). What a trace importer provides and returns is the trace model,
`contract/traces.py`. The importers of what a job left besides traces (the collector's Parquet parts,
DeepSpeed logs, FLOPs-profiler text, comms dumps, monitors, autotuning results) are registered in
`telemetry.py`.

`ingest` offers every file under the run folder to the telemetry importers in order, then what is left
to TRACE_IMPORTERS; the first that claims a file reads it. Files nobody claims are listed as ignored
with the reason.
"""

from __future__ import annotations

from pathlib import Path

from steplens.analyze.contract.traces import TraceImporter

TRACE_IMPORTERS: list[TraceImporter] = [
    # Kineto JSON (tensorboard_trace_handler's .pt.trace.json[.gz], export_chrome_trace's .json): a file that turns
    # out not to be a trace is reported by the parser (not_a_trace), not guessed from its name.
    TraceImporter("kineto", names=(".json", ".gz")),
    TraceImporter("nsys", names=(".sqlite", ".sqlite3", ".nsys-rep", ".qdrep")),  # Nsight Systems SQLite exports
]
TRACE_KINDS = frozenset(importer.name for importer in TRACE_IMPORTERS)
TRACE_NAMES = tuple(name for importer in TRACE_IMPORTERS for name in importer.names)


def trace_claimant(path: Path) -> TraceImporter | None:
    return next((importer for importer in TRACE_IMPORTERS if importer.claims(path)), None)
