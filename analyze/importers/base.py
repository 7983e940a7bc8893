"""What an importer is and what it returns: the interface between `ingest` and the modules that read
non-Kineto inputs (registered in `importers`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import polars as pl

from steplens.analyze.contract import schema


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


def peek(path: Path, size: int) -> bytes:
    """The first bytes of a file, for `claims`; nothing when it cannot be read (ingest reports that)."""
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:
        return b""


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
