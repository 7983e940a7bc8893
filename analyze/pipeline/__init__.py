"""The pipeline `analyze` runs, one step after the other:

    discover (pipeline/runs.py: the runs in a folder, each with its files)
    -> stage (pipeline/ingest.py `staged`: every input parsed into the run-dir tables, in a staging folder)
    -> analyse (analyses/runner.py `run`: analysis tables and findings.json, into the same folder)
    -> render (reports/: report.html and summary.md, into the same folder; called by the CLI)
    -> publish (pipeline/ingest.py `publish`: the folder swapped in at the output path, atomically)

The package imports nothing itself, so that `pipeline.workers` (standard library only) starts the
workers before polars and pyarrow are imported.
"""

from __future__ import annotations

from pathlib import Path


def analyse(run_dir: Path, out_dir: Path | None = None, options=None, **ingest_options):
    """Tables and analyses, published together (no report): (IngestResult, findings); `options` is
    an analyses.runner.Options."""
    from steplens.analyze.analyses import runner
    from steplens.analyze.pipeline.ingest import publish, staged

    with staged(run_dir, out_dir, **ingest_options) as stage:
        findings = runner.run(stage.folder, options)
        return publish(stage), findings
