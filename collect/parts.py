"""Buffered, crash-safe output of one rank: rows of the telemetry tables, written as Parquet parts.

Layout under the run folder (the folder `analyze` is later given):
    collector/<table>/rank<r>-<seq:05d>.parquet   one part per table per flush (seq counts flushes)
    collector/manifest/rank<r>.json               the rank's manifest, rewritten whole

Every file is written to a hidden temporary name and renamed into place: a rename is atomic on POSIX, so
a job killed at any moment leaves each part either complete or absent, and ranks never share a file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from steplens.analyze import schema

COLLECTOR_DIR = "collector"
MANIFEST_DIR = "manifest"


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class PartWriter:
    """Rows per table in memory until `flush()`; columns exactly as in `schema.TABLES`."""

    def __init__(self, run_dir: Path, rank: int, tables: tuple[str, ...]):
        self.root = Path(run_dir) / COLLECTOR_DIR
        self.rank = rank
        self.seq = 0
        self.rows: dict[str, list[dict]] = {table: [] for table in tables}
        self.parts_written: dict[str, int] = dict.fromkeys(tables, 0)
        self.rows_written: dict[str, int] = dict.fromkeys(tables, 0)
        (self.root / MANIFEST_DIR).mkdir(parents=True, exist_ok=True)

    def add(self, table: str, row: dict) -> None:
        self.rows[table].append(row)

    def pending(self) -> int:
        return sum(len(rows) for rows in self.rows.values())

    def flush(self) -> None:
        """One part per table that has rows; rows stay buffered if the write fails, so nothing is lost twice."""
        wrote = False
        for table, rows in self.rows.items():
            if not rows:
                continue
            arrow = pa.Table.from_pylist(rows, schema=schema.TABLES[table][0])
            folder = self.root / table
            folder.mkdir(exist_ok=True)
            path = folder / f"rank{self.rank}-{self.seq:05d}.parquet"
            tmp = path.with_name(f".{path.name}.tmp")
            pq.write_table(arrow, tmp)
            os.replace(tmp, path)
            self.parts_written[table] += 1
            self.rows_written[table] += len(rows)
            self.rows[table] = []
            wrote = True
        if wrote:
            self.seq += 1

    def write_manifest(self, manifest: dict) -> None:
        data = json.dumps(manifest, indent=1, default=str).encode()
        write_atomically(self.root / MANIFEST_DIR / f"rank{self.rank}.json", data)
