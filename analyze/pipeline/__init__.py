"""The pipeline `analyze` runs, one step after the other:

    discover (pipeline/runs.py: the runs in a folder, each with its files)
    -> stage (pipeline/ingest.py `staged`: every input parsed into the run-dir tables, in a staging folder)
    -> analyse (analyses/runner.py `run`: analysis tables and findings.json, into the same folder)
    -> render (reports/: report.html and summary.md, into the same folder; what the CLI adds, pipeline/run.py Hooks)
    -> publish (pipeline/ingest.py `publish`: the folder swapped in at the output path, atomically)

pipeline/run.py `run` does all of it for one run (reuse, workers, remote output included), for the CLI and for
`analyse` below alike.

The package imports nothing itself, so that `pipeline.workers` (standard library only) starts the
workers before polars and pyarrow are imported.
"""

from __future__ import annotations

from pathlib import Path


def analyse(run_dir: Path, out_dir: Path | None = None, options=None, **run_options):
    """Tables and analyses, published together (no report): (IngestResult, findings); `options` is
    an analyses.runner.Options, `run_options` those of pipeline/run.py `run` (jobs, files, ...)."""
    from steplens.analyze.pipeline.run import run

    return run(run_dir, out_dir, options, **run_options)
