"""One run, start to end: reuse -> stage -> analyses (and the caller's report) -> publish, with the parse's worker
processes kept for the per-rank analyses and an object-store output built locally and committed. The one
orchestrator: `analyze` (the CLI adds its progress bar, report and re-run record through `Hooks`) and
`pipeline.analyse` (the library, no report) both run a run here.
"""

from __future__ import annotations

import functools
import json
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from steplens.analyze.analyses import runner
from steplens.analyze.contract.schema import FINDINGS_FILE
from steplens.analyze.pipeline import remote
from steplens.analyze.pipeline.ingest import IngestResult, Source, Staged, publish, staged, unchanged
from steplens.analyze.pipeline.workers import Workers


@dataclass
class Hooks:
    """What a caller adds to a run; the pipeline itself renders nothing and prints nothing."""

    # (folder, options, map_ranks, map_figures, announce) -> findings: the analyses and whatever the caller writes
    # beside them (the CLI's report), calling announce(findings) once they exist; default: the analyses alone
    # (runner.run)
    analyse: Callable | None = None
    progress: Callable[[Source], None] | None = None  # each input as it is parsed
    when_idle: Callable[[], None] | None = None  # work for this process while it would only wait for a worker
    record: Callable[[Staged], dict] | None = None  # run.json `rerun`, written with the result
    findings: Callable[[Staged, dict], None] | None = None  # the findings, as soon as `analyse` announces them


def run(run_dir: Path, out: Path | str | None = None, options: runner.Options | None = None, *, jobs: int | None = None,
        ingest_only: bool = False, reuse_key: str | None = None, client=None, hooks: Hooks | None = None,
        **stage_options) -> tuple[IngestResult, dict]:
    """Stage, analyse and publish one run: (IngestResult, findings). A local result made from the inputs, options
    and code `reuse_key` names is returned as it is. `stage_options` go to `ingest.staged` (found, files)."""
    hooks = hooks or Hooks()
    if reuse_key is not None and (previous := unchanged(out, reuse_key)) is not None:
        return previous, {} if ingest_only else json.loads((Path(out) / FINDINGS_FILE).read_text())
    # An object-store out under --scheduler: the workers write their parts straight into its new generation.
    store = remote.Generation(out) if client is not None and remote.is_url(out) else None
    findings: dict = {}
    try:
        with remote.output_folder(out) if remote.is_url(out) else nullcontext(out) as local_out:
            # The parse's worker processes stay up for the per-rank analyses (a cluster's are its own).
            workers = Workers(jobs, when_idle=None if ingest_only else hooks.when_idle)
            with workers, staged(run_dir, local_out, jobs=jobs, progress=hooks.progress, client=client, store=store,
                                 workers=workers, **stage_options) as stage:
                if not ingest_only:
                    findings = _analyse(stage, options, workers, client, store, hooks)
                stage.manifest["input_key"] = reuse_key
                if hooks.record is not None and findings:
                    stage.manifest["rerun"] = hooks.record(stage)
                result = publish(stage)
            if remote.is_url(out):
                result.out_dir = remote.commit(local_out, out, store)
    except BaseException:
        if store is not None:  # what the workers uploaded is named by no commit: delete it
            store.abandon()
        raise
    return result, findings


def _analyse(stage: Staged, options, workers: Workers, client, store, hooks: Hooks) -> dict:
    folder = stage.folder
    if client is not None:
        from steplens.analyze.pipeline import cluster  # Dask only when asked for

        map_ranks, map_figures = cluster.rank_mapper(client, store), None
    else:  # the workers stay for the report's figures, doing the caller's idle work meanwhile
        events = sum(s["events"] for s in stage.manifest.get("sources", []) if isinstance(s.get("events"), int))
        map_ranks = functools.partial(workers.map_ranks, then=hooks.when_idle, events=events)
        map_figures = workers.map
    if hooks.analyse is None:
        return runner.run(folder, options, map_ranks)
    announce = functools.partial(hooks.findings, stage) if hooks.findings else None
    return hooks.analyse(folder, options, map_ranks=map_ranks, map_figures=map_figures, announce=announce)
