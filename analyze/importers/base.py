"""What a telemetry importer is and what it returns (registered in `importers/telemetry.py`): one file
into rows of run-level tables (logs, monitors, dumps, the collector's parts) plus run facts; and the
helpers every importer shares. A trace importer's interface is the trace model, `contract/traces.py`.
"""

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


def conform(frame: pl.DataFrame | list[dict], table: str, issues: list | None = None) -> pl.DataFrame:
    """Rows -> a frame with exactly the table's columns and types (missing columns are null). A row
    value its column cannot hold (an integer beyond int64, text where a number belongs, a lone
    surrogate) is null and counted in `issues` as unrepresentable_value; without `issues` it raises."""
    arrow_schema = schema.TABLES[table][0]
    polars_schema = pl.DataFrame(schema=dict(pl.from_arrow(arrow_schema.empty_table()).schema)).schema
    columns = {key for row in frame for key in row} if isinstance(frame, list) else set(frame.columns)
    if extra := columns - set(polars_schema):
        raise ValueError(f"{table}: unknown columns {sorted(extra)}")
    if isinstance(frame, list):
        try:
            return pl.DataFrame(frame, schema=polars_schema)
        except (TypeError, ValueError, OverflowError, UnicodeError, pl.exceptions.PolarsError):
            return pl.DataFrame([_column_or_nulls(frame, table, name, dtype, issues) for name, dtype in polars_schema.items()])
    return frame.select(
        pl.col(name).cast(dtype) if name in frame.columns else pl.lit(None, dtype).alias(name)
        for name, dtype in polars_schema.items()
    )


_INT_RANGES = {pl.Int64: schema.INT64_RANGE, pl.UInt64: schema.UINT64_RANGE}


def _fits(value, dtype) -> bool:
    """Whether a column of `dtype` holds `value` exactly (None fits every column)."""
    if value is None:
        return True
    if dtype in _INT_RANGES:
        low, high = _INT_RANGES[dtype]
        return isinstance(value, int) and low <= value <= high
    if dtype == pl.Float64:
        return isinstance(value, float) or isinstance(value, int) and abs(value) < 2**1023
    if dtype == pl.String:
        return isinstance(value, str) and (value.isascii() or _encodes(value))
    return isinstance(value, bool)


def _encodes(text: str) -> bool:
    try:
        text.encode()
        return True
    except UnicodeEncodeError:  # a lone surrogate, as a decoder's surrogateescape leaves
        return False


def _column_or_nulls(rows: list[dict], table: str, name: str, dtype, issues: list | None) -> pl.Series:
    """One column of `rows`, its values that `dtype` cannot hold replaced by null and counted."""
    values = [row.get(name) for row in rows]
    try:
        return pl.Series(name, values, dtype=dtype, strict=True)
    except (TypeError, ValueError, OverflowError, UnicodeError, pl.exceptions.PolarsError):
        pass
    bad = [value for value in values if not _fits(value, dtype)]
    detail = f"{table}.{name}: values its {dtype} column cannot hold are stored as null, e.g. {bad[0]!r:.80}"
    if issues is None:
        raise ValueError(detail)
    issues.append(["warning", "unrepresentable_value", len(bad), detail])
    return pl.Series(name, [value if _fits(value, dtype) else None for value in values], dtype=dtype, strict=True)
