"""Importers for what a job left besides Kineto traces: the collector's Parquet parts and the native
DeepSpeed artifacts (logs, FLOPs-profiler text, comms dumps, csv_monitor, TensorBoard, W&B,
autotuning results). Each turns one input file into rows of the telemetry tables in `schema`.

`ingest` offers every file under the run folder to `IMPORTERS` in order; the first that claims it
parses it. Files nobody claims are Kineto candidates when they end in .json/.gz, otherwise they are
listed as ignored with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import polars as pl

from . import schema


@dataclass
class Imported:
    """What one input file gave."""

    tables: dict[str, pl.DataFrame] = field(default_factory=dict)  # telemetry table -> rows
    issues: list[list] = field(default_factory=list)  # [severity, reason, count, detail]
    facts: dict = field(default_factory=dict)  # run facts for run.json: world_size, versions, ds_config, ...


@dataclass(frozen=True)
class Importer:
    name: str  # the source kind recorded in run.json
    claims: Callable[[Path], bool]  # cheap: the path, and at most a peek at the first bytes
    parse: Callable[[Path, str], Imported]  # (absolute path, path relative to the run folder)
    # Other files read with it (fingerprinted with it and offered to no other importer).
    companions: Callable[[Path], list[Path]] = lambda path: []


def conform(frame: pl.DataFrame | list[dict], table: str) -> pl.DataFrame:
    """Rows -> a frame with exactly the table's columns and types (missing columns are null)."""
    arrow_schema = schema.TABLES[table][0]
    polars_schema = pl.DataFrame(schema=dict(pl.from_arrow(arrow_schema.empty_table()).schema)).schema
    columns = {key for row in frame for key in row} if isinstance(frame, list) else set(frame.columns)
    if extra := columns - set(polars_schema):
        raise ValueError(f"{table}: unknown columns {sorted(extra)}")
    if isinstance(frame, list):
        return pl.DataFrame(frame, schema=polars_schema)
    return frame.select(
        pl.col(name).cast(dtype) if name in frame.columns else pl.lit(None, dtype).alias(name)
        for name, dtype in polars_schema.items()
    )


from . import autotune, collected, comms_dump, dslog, flops_text, scalars  # after the classes above: the importer modules use them

# Order is priority: specific file names before generic suffixes.
IMPORTERS: list[Importer] = [
    Importer("collector", collected.claims, collected.parse),
    Importer("autotune_experiment", autotune.claims_experiment, autotune.parse_experiment, autotune.experiment_companions),
    Importer("autotune_summary", autotune.claims_summary, autotune.parse_summary, autotune.summary_companions),
    Importer("tensorboard", scalars.claims_tensorboard, scalars.parse_tensorboard),
    Importer("wandb", scalars.claims_wandb, scalars.parse_wandb),
    Importer("csv_monitor", scalars.claims_csv, scalars.parse_csv_monitor),
    Importer("deepspeed_comms_dict", comms_dump.claims_raw, comms_dump.parse_raw, comms_dump.summary_sibling),
    Importer("deepspeed_comms_summary_dict", comms_dump.claims_summary, comms_dump.parse_summary),
    Importer("deepspeed_flops_profile", flops_text.claims, flops_text.parse, flops_text.ds_config_files),
    Importer("deepspeed_log", dslog.claims, dslog.parse),  # after the FLOPs text: a log may embed a profile
]


def claimant(path: Path) -> Importer | None:
    for importer in IMPORTERS:
        if importer.claims(path):
            return importer
    return None
