"""SQL over many runs: one DuckDB view per table across every run (and rank) under a folder.

A run is any folder holding a steplens `run.json` (an `analyze` output such as `RUN/.steplens/`, or
a collector run directory). Every view has a `run_id` column; per-rank tables also have `rank`.
The `runs` view lists the runs themselves. Only SELECT statements are accepted, and they read no file
outside the folder: querying never changes a run, nor shows anything else.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import signal
import threading
import types
from pathlib import Path
from collections.abc import Iterator
from typing import TYPE_CHECKING

import polars as pl

from steplens.analyze import analyses
from steplens.analyze.analyses import monitor
from steplens.analyze.contract import reuse, schema
from steplens.analyze.contract.manifest import damage
from steplens.analyze.pipeline import remote

if TYPE_CHECKING:
    import duckdb

EXAMPLES = {
    "slowest step per run": "SELECT run_id, step, max_dur_ns / 1e6 AS ms, straggler_rank FROM step_stats "
                            "QUALIFY row_number() OVER (PARTITION BY run_id ORDER BY max_dur_ns DESC) = 1",
    "busbw by message size across runs": "SELECT run_id, op, bytes, count(*) AS calls, median(busbw_gbps) AS busbw_gbps "
                                         "FROM collectives GROUP BY ALL ORDER BY op, bytes, run_id",
    "MFU by run": "SELECT run_id, metric, numerator, median(utilization) AS utilization FROM mfu GROUP BY ALL",
    "GPU idle by cause": "SELECT run_id, sum(host_bound_ns) / 1e6 AS host_bound_ms, sum(sync_ns) / 1e6 AS sync_ms "
                         f"FROM gpu_idle WHERE stream = {schema.ALL_STREAMS} AND step IS NULL GROUP BY run_id",
    "MFU by code revision and ZeRO stage": "SELECT r.code_revision, r.zero_stage, median(m.utilization) AS mfu "
                                           "FROM mfu m JOIN runs r USING (run_id) WHERE m.metric = 'MFU' GROUP BY ALL",
    "loss against global samples across runs": "SELECT run_id, global_samples, value AS loss FROM scalars "
                                               "WHERE name ILIKE '%loss%' ORDER BY run_id, global_samples",
    "slowest logged collective per run": "SELECT run_id, op, nccl_bytes, median_latency_ns / 1e6 AS median_ms, latency_origin "
                                         "FROM comms_log_stats QUALIFY row_number() OVER "
                                         "(PARTITION BY run_id ORDER BY total_latency_ns DESC) = 1",
}
# Facts of each run shown in the `runs` view (monitor.run_fact reads them from any importer's facts).
RUN_FACTS = {"zero_stage": pl.Int64, "train_batch_size": pl.Int64, "code_revision": pl.String,
             "deepspeed_version": pl.String}


class QueryError(Exception):
    """A query that is not a single SELECT, or that DuckDB rejects; the message is for the user."""


def find_runs(root: Path | str) -> list[Path] | list[str]:
    """Folders under root (root included) that hold a steplens run.json; under an object-store URL,
    the committed results."""
    if remote.is_url(root):
        return [url for url, _ in remote.committed_runs(str(root))]
    return [run for run, _, _ in _runs_with_manifests(Path(root))]


def _runs_with_manifests(root: Path) -> list[tuple[Path, dict, str | None]]:
    """The local runs under root, each with its run.json read once and checked (reuse.published_manifest: what is
    wrong with it, or None): every run.json analyze wrote (its created_by), and any in a folder named .steplens
    (analyze's default), whatever it holds (a user's own run.json elsewhere is not taken for a result)."""
    found = []
    for folder, subfolders, files in os.walk(root, followlinks=False):
        # an analysis being written (.NAME.tmp-PID) or one being replaced (.NAME.old-PID) is no run of its own
        subfolders[:] = sorted(d for d in subfolders if not reuse.STAGED.match(d))
        if schema.MANIFEST_FILE in files:
            manifest, why = reuse.published_manifest(Path(folder), schema.SCHEMA_VERSION)
            if manifest.get("created_by") == reuse.OUTPUT_CREATOR or Path(folder).name == schema.DEFAULT_OUT_DIR:
                found.append((Path(folder), manifest, why))
    return sorted(found, key=lambda run: run[0])


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _part_files(run: Path, table: str, partitioned: bool) -> list[str]:
    """The table's part files in one run, by exact path: a folder named `exp*` or `glob[1]` must
    not match another run's files, so nothing here is a pattern for DuckDB to expand."""
    folder = run / table
    files = sorted(folder.glob("*/*.parquet" if partitioned else "*.parquet")) if folder.is_dir() else []
    return [glob.escape(str(f)) for f in files]


def connect(root: Path, skipped: list[tuple[str, str]] | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with a view per table over every run under root. A run whose run.json is
    damaged is left out and added to `skipped` as (run, why): the other runs still answer."""
    import duckdb  # here, not at import: `analyze` imports this module for its help text only

    skipped = [] if skipped is None else skipped
    con = duckdb.connect()
    if remote.is_url(root):  # DuckDB reads the objects through the store's fsspec filesystem, offline too
        runs = [(url, manifest, None) for url, manifest in remote.committed_runs(str(root))]
        con.register_filesystem(remote.filesystem(str(root))[0])
    else:
        runs = _runs_with_manifests(Path(root))
    rows, parts, seen_ids = [], {}, set()
    for run, manifest, why in runs:
        why = why or damage(manifest)
        if not why and not isinstance(run, str):  # a FIFO part would block the query, a missing table mislead it
            why = reuse.missing_entries(run, manifest, set(schema.TABLES) | set(analyses.TABLES)) \
                or reuse.result_problem(run, manifest)
        if why:
            skipped.append((str(run), f"damaged result ({why}); analyse the run again"))
            continue
        run_id = str(manifest.get("run_id") or run)
        if run_id in seen_ids:  # a copied output folder: still a run of its own
            run_id = f"{run_id}-{hashlib.sha256(str(run if isinstance(run, str) else run.resolve()).encode()).hexdigest()[:6]}"
        seen_ids.add(run_id)
        facts = manifest.get("facts", {})
        rows.append({"run_id": run_id, "run_name": manifest.get("run_name"), "path": str(run),
                     "world_size": manifest.get("world_size"), "ranks": len(manifest.get("ranks", [])),
                     "devices": ", ".join(manifest.get("environment", {}).get("device_names", [])),
                     "created_by": manifest.get("created_by"),
                     **{field: _fact(monitor.run_fact(facts, field), dtype) for field, dtype in RUN_FACTS.items()}})
        for table in list(schema.TABLES) + list(analyses.TABLES):
            partitioned = table in schema.TABLES and schema.TABLES[table][2]
            if isinstance(run, str):  # a committed result in object storage: the objects it names
                files = [glob.escape(url) for url in remote.table_objects(run, manifest, table)]
            else:
                files = _part_files(run, table, partitioned)
            if files:
                listed = ", ".join(_quote(f) for f in files)
                parts.setdefault(table, []).append(
                    f"SELECT {_quote(run_id)} AS run_id, * FROM read_parquet([{listed}]"
                    f"{', hive_partitioning = true' if partitioned else ''})")
    con.register("runs_frame", pl.DataFrame(rows, schema={
        "run_id": pl.String, "run_name": pl.String, "path": pl.String, "world_size": pl.Int64, "ranks": pl.Int64,
        "devices": pl.String, "created_by": pl.String, **RUN_FACTS}))
    con.execute("CREATE VIEW runs AS SELECT * FROM runs_frame")
    for table, selects in parts.items():
        con.execute(f"CREATE VIEW {table} AS " + " UNION ALL BY NAME ".join(selects))
    # A query reads the runs under root and nothing else (read_text('/etc/passwd'), glob('/home/*')), and cannot
    # undo that: DuckDB's file access is limited to root, then its configuration locked.
    allowed = str(root).rstrip("/") + "/" if remote.is_url(root) else str(Path(root).resolve()) + os.sep
    con.execute(f"SET allowed_directories = [{_quote(allowed)}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def _fact(value, dtype):
    """A fact as the column's type, or null when it does not fit (facts come from free-form sources)."""
    if value is None:
        return None
    if dtype == pl.Int64:
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    return str(value)


BATCH_ROWS = 100_000  # rows fetched at a time: memory follows a batch, not the result


def query(root: Path, sql: str, skipped: list[tuple[str, str]] | None = None) -> pl.DataFrame:
    """Run one SELECT over every run under root; the result as a polars DataFrame. Runs left out (a damaged
    run.json) are added to `skipped` as (run, why)."""
    return pl.concat(list(query_batches(root, sql, skipped)), how="vertical")


def query_batches(root: Path, sql: str, skipped: list[tuple[str, str]] | None = None,
                  limit: int | None = None) -> Iterator[pl.DataFrame]:
    """The result of `query`, BATCH_ROWS rows at a time (at least one frame, for the columns), and at most
    `limit` rows: a result of any size is written out, or its first rows shown, in bounded memory."""
    import duckdb

    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as e:  # a syntax error
        raise QueryError(str(e).splitlines()[0]) from None
    if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
        raise QueryError("only a single SELECT (or WITH ... SELECT) statement is accepted")
    skipped = [] if skipped is None else skipped
    left_out = len(skipped)
    con = connect(root, skipped)
    if len(skipped) > left_out and not con.execute("SELECT count(*) FROM runs").fetchall()[0][0]:
        raise QueryError(f"no run under {root} can be read (each is named above)")
    with interruptible(con) as stop:
        try:
            relation = con.sql(sql)
            reader = (relation.limit(limit) if limit is not None else relation).to_arrow_reader(BATCH_ROWS)
            empty = True
            for batch in reader:
                empty = False
                yield pl.from_arrow(batch)
            if empty:
                yield pl.from_arrow(reader.schema.empty_table())
        except Exception as e:
            if stop.interrupted:  # DuckDB's InterruptException, or Arrow's reader saying "Query interrupted"
                raise KeyboardInterrupt from None
            if isinstance(e, duckdb.Error):
                raise QueryError(str(e).splitlines()[0]) from None
            raise


@contextlib.contextmanager
def interruptible(con: duckdb.DuckDBPyConnection):
    """Ctrl-C and SIGTERM stop a query DuckDB is running: Python runs its signal handlers only between bytecodes, and
    a query runs in DuckDB's C++ for as long as it takes (a `range(1e11)` ran on after both), so the signal's wakeup
    byte (signal.set_wakeup_fd, written by the C-level handler) wakes a thread that interrupts the connection; the
    handler then runs as the query returns. In the main thread only (where signals are delivered). Yields an object
    whose `interrupted` says whether it stopped the query."""
    stop = types.SimpleNamespace(interrupted=False)
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def watch() -> None:
        while byte := os.read(read_fd, 1):  # b"": the query ended and the pipe closed
            if byte[0] in (signal.SIGINT, signal.SIGTERM):  # the byte is the signal's number; others are not a stop
                stop.interrupted = True
                con.interrupt()

    watcher = threading.Thread(target=watch, name="steplens-sql-interrupt", daemon=True)
    previous = None
    try:
        previous = signal.set_wakeup_fd(write_fd)
        watcher.start()
        yield stop
    finally:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(previous)
        os.close(write_fd)
        if watcher.is_alive():
            watcher.join()
        os.close(read_fd)
