"""Buffered, crash-safe output of one rank: rows of the telemetry tables, written as Parquet parts.

Layout under the run folder (the folder `analyze` is later given):
    collector/<table>/rank<r>-<seq:05d>.parquet   one part per table per flush (seq counts flushes)
    collector/manifest/rank<r>.json               the rank's manifest, rewritten whole after each flush

Every file is written to a hidden temporary name and renamed into place: a rename is atomic on POSIX, so
a job killed at any moment leaves each part either complete or absent, and ranks never share a file.
Periodic flushes run on one background thread (in order), so the training step does not wait for Parquet
encoding; the last flush, at close, runs in the caller.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from steplens.analyze import schema

COLLECTOR_DIR = "collector"
MANIFEST_DIR = "manifest"


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# Arrow -> polars types of the telemetry tables. Rows go through polars because building Arrow arrays from
# Python objects makes pyarrow import pandas (0.6 s, on the first flush of a training job).
POLARS_TYPES = {pa.int64(): pl.Int64, pa.uint64(): pl.UInt64, pa.float64(): pl.Float64, pa.string(): pl.String,
                pa.bool_(): pl.Boolean}


def to_frame(rows: list[dict], table: str) -> pl.DataFrame:
    """Rows (missing keys are null) -> a frame with the table's columns and types."""
    return pl.DataFrame(rows, schema={f.name: POLARS_TYPES[f.type] for f in schema.TABLES[table][0]})


class PartWriter:
    """Rows per table in memory until `flush()`; columns exactly as in `schema.TABLES`."""

    def __init__(self, run_dir: Path, rank: int, tables: tuple[str, ...],
                 prepare: dict[str, Callable[[pl.DataFrame], pl.DataFrame]]):
        self.root = Path(run_dir) / COLLECTOR_DIR
        self.rank = rank
        # After this rank's existing parts: a resumed job (or a second attach) writing into the same folder
        # adds parts and never replaces one.
        self.seq = 1 + max((int(p.stem.split("-")[1]) for p in self.root.glob(f"*/rank{rank}-*.parquet")), default=-1)
        self.prepare = prepare  # table -> frame transform run at write time (e.g. derived columns)
        self.rows: dict[str, list[dict]] = {table: [] for table in tables}
        self.rows_written: dict[str, int] = dict.fromkeys(tables, 0)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"steplens-writer-rank{rank}")
        self.last: Future | None = None
        (self.root / MANIFEST_DIR).mkdir(parents=True, exist_ok=True)

    def add(self, table: str, row: dict) -> None:
        self.rows[table].append(row)

    def flush(self, manifest: dict, background: bool = True) -> None:
        """Hand the buffered rows and then the manifest to the writer. A failure of the previous background
        flush is raised here (its rows are lost; the caller disables writing)."""
        self.raise_failed()
        batch = {table: rows for table, rows in self.rows.items() if rows}
        self.rows = {table: [] for table in self.rows}
        seq = self.seq
        self.seq += bool(batch)
        if background:
            self.last = self.worker.submit(self.write, batch, seq, manifest)
        else:
            self.wait()
            self.write(batch, seq, manifest)

    def wait(self) -> None:
        if self.last is not None:
            self.last.result()
            self.last = None

    def raise_failed(self) -> None:
        if self.last is not None and self.last.done():
            self.wait()

    def write(self, batch: dict[str, list[dict]], seq: int, manifest: dict) -> None:
        for table, rows in batch.items():
            frame = to_frame(rows, table)
            if table in self.prepare:
                frame = self.prepare[table](frame)
            arrow = frame.to_arrow().cast(schema.TABLES[table][0])
            folder = self.root / table
            folder.mkdir(exist_ok=True)
            path = folder / f"rank{self.rank}-{seq:05d}.parquet"
            tmp = path.with_name(f".{path.name}.tmp")
            pq.write_table(arrow, tmp)
            os.replace(tmp, path)
            self.rows_written[table] += len(rows)
        self.write_manifest({**manifest, "flushes": self.seq, "rows_written": dict(self.rows_written)})

    def write_manifest(self, manifest: dict) -> None:
        data = json.dumps(manifest, indent=1, default=str).encode()
        write_atomically(self.root / MANIFEST_DIR / f"rank{self.rank}.json", data)

    def close(self) -> None:
        self.worker.shutdown(wait=True)
