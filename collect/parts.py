"""Buffered, crash-safe output of one rank: rows of the telemetry tables, written as Parquet parts.

Layout under the run folder (the folder `analyze` is later given), built by analyze/contract/layout.py:
    collector/<table>/rank<r>-<seq:05d>.parquet   one part per table per flush (seq counts flushes)
    collector/manifest/rank<r>.json               the rank's manifest, rewritten whole after each flush

Every file is written to a hidden temporary name and renamed into place: a rename is atomic on POSIX, so
a job killed at any moment leaves each part either complete or absent, and ranks never share a file. Each rank
holds a lock on collector/manifest/.rank<r>.lock while its job runs (released by the kernel when the process
ends, however it ends): a rank of a second job started into the same folder finds its rank's lock held and
writes nothing (`FolderLock`), so one job's files are never replaced by another's.
Periodic flushes run on one background thread (in order), so the training step does not wait for Parquet
encoding; the last flush, at close, runs in the caller.

A write that fails (disk full, read-only, a removed folder) fails the writer for the rest of the job: from then
on rows are counted per table in `dropped_rows` instead of buffered, so memory stays bounded whatever the job
runs on. The caller waits for a background write at most `WAIT_S` seconds (a hung file system must not hold
up the job's exit).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import logging
import os
import queue
import stat
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

# polars' thread pool is sized when polars is first imported, one thread per core by default: in a training job
# those threads compete with the ranks' own for every flush (steps overlapping a flush took 2-3x as long, ~16% at
# a flush every 4 steps). A part is a few thousand rows: one thread writes it. A job that imported polars first
# or sets POLARS_MAX_THREADS keeps its own.
os.environ.setdefault("POLARS_MAX_THREADS", "1")

import polars as pl  # noqa: E402 - after its thread count
import pyarrow as pa
import pyarrow.parquet as pq
from steplens.analyze.contract import layout, schema

WAIT_S = 10.0  # longest wait for a background write at close or SIGTERM (schedulers kill ~30 s after SIGTERM)

log = logging.getLogger("steplens.collect")


def write_atomically(path: Path, data: bytes) -> None:
    """path holds data whole, or what it held before; a write that fails (a full disk) leaves no temporary file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except Exception:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


# Arrow -> polars types of the telemetry tables. Rows go through polars because building Arrow arrays from
# Python objects makes pyarrow import pandas (0.6 s, on the first flush of a training job).
POLARS_TYPES = {pa.int64(): pl.Int64, pa.uint64(): pl.UInt64, pa.float64(): pl.Float64, pa.string(): pl.String,
                pa.bool_(): pl.Boolean}


def to_frame(rows: list[dict], table: str) -> pl.DataFrame:
    """Rows (missing keys are null) -> a frame with the table's columns and types."""
    return pl.DataFrame(rows, schema={f.name: POLARS_TYPES[f.type] for f in schema.TABLES[table][0]})


class FolderLock:
    """This rank's lock on its files in the collector folder, held for the life of the process.

    `other_writer` says why this rank must not write here: another live process holds this rank's lock (a second
    job started into a folder the first is still writing, whose rank-r files it would replace). flock is released by
    the kernel when its holder ends, so a killed job leaves no stale lock. Where the file system has no flock
    (Lustre without -o flock, NFS without its lock daemon) or the lock file cannot be made, the rank writes
    unlocked, as before locks. Only this rank's own file is looked at: ranks of one job never wait on each other."""

    def __init__(self, root: Path, rank: int):
        self.fd: int | None = None
        self.other_writer: str | None = None
        path = layout.lock_path(root, rank)
        fd = _open_plain(path, os.O_RDWR | os.O_CREAT)
        if fd is None:  # a folder that takes no file (the writes fail and say so), or a link or FIFO in its place
            return
        me = {"pid": os.getpid(), "hostname": os.uname().nodename}
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = _read(path)
            if {k: holder.get(k) for k in me} != me:  # else an earlier attach of this very process holds it
                self.other_writer = (f"another process writes this rank's files in {root} ({_holder(holder)}): "
                                     "give each job a folder of its own")
            return
        except OSError:  # no flock here (ENOSYS, ENOLCK): unlocked
            os.close(fd)
            return
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
        except OSError:  # the holder stays unnamed; the lock holds all the same
            pass
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor releases the lock
            self.fd = None


def _open_plain(path: Path, flags: int) -> int | None:
    """A descriptor of `path` if it is a plain file (never following a link, never waiting on a FIFO), else None."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _read(path: Path) -> dict:
    """Who holds a lock file, as it wrote itself there ({} when unreadable)."""
    fd = _open_plain(path, os.O_RDONLY)
    if fd is None:
        return {}
    try:
        found = json.loads(os.pread(fd, 4096, 0))
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return found if isinstance(found, dict) else {}


def _holder(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on {holder.get('hostname', '?')}" if holder else "a process still starting"


class PartWriter:
    """Rows per table in memory until `flush()`; columns exactly as in `schema.TABLES`."""

    def __init__(self, run_dir: Path, rank: int, tables: tuple[str, ...],
                 prepare: dict[str, Callable[[pl.DataFrame], pl.DataFrame]]):
        self.root = layout.collector_root(run_dir)
        self.rank = rank
        # After this rank's existing parts: a resumed job (or a second attach) writing into the same folder
        # adds parts and never replaces one.
        self.seq = 1 + max((layout.parse_part_name(p.name)[1] for p in self.root.glob(layout.rank_parts_glob(rank))),
                           default=-1)
        self.prepare = prepare  # table -> frame transform run at write time (e.g. derived columns)
        self.rows: dict[str, list[dict]] = {table: [] for table in tables}
        self.rows_written: dict[str, int] = dict.fromkeys(tables, 0)
        self.dropped_rows: dict[str, int] = dict.fromkeys(tables, 0)  # rows lost to a failed writer, per table
        self.failure: str | None = None  # why writing stopped; set once
        self.flushed_step: int | None = None  # the last optimizer step whose rows are all written
        self.lock = threading.Lock()  # the worker thread and the job both count dropped rows
        self.worker = BackgroundWriter(f"steplens-writer-rank{rank}")
        self.last: Future | None = None
        layout.manifest_path(self.root, rank).parent.mkdir(parents=True, exist_ok=True)
        self.folder_lock = FolderLock(self.root, rank)
        if self.folder_lock.other_writer is not None:  # nothing of this job is written: the folder is another's
            self.fail(self.folder_lock.other_writer, {})

    def warm_up(self) -> None:
        """Run the write path once on empty frames, in memory, before training starts: the first use of
        polars' and pyarrow's frame building, casts and Parquet writer costs tens of ms of CPU (more on a
        busy host), which would otherwise land on the background thread during the first flush and slow
        the step it overlaps."""
        for table in self.rows:
            frame = to_frame([], table)
            if table in self.prepare:
                frame = self.prepare[table](frame)
            pq.write_table(frame.to_arrow().cast(schema.TABLES[table][0]), io.BytesIO())

    def add(self, table: str, row: dict) -> None:
        if self.failure is None:
            self.rows[table].append(row)
        else:
            with self.lock:
                self.dropped_rows[table] += 1

    def fail(self, reason: str, lost: dict[str, list[dict]]) -> None:
        """Stop writing for good; `lost` (a batch that did not make it) is counted as dropped. Safe on any thread:
        the rows still buffered are counted by the caller's next flush."""
        with self.lock:
            if self.failure is None:
                self.failure = reason
                log.warning("steplens collector: rank %d stops writing (%s); rows are counted as dropped from now on",
                            self.rank, reason)
            for table, rows in lost.items():
                self.dropped_rows[table] += len(rows)

    def flush(self, manifest: dict, background: bool = True) -> None:
        """Hand the buffered rows and then the manifest to the writer (once the writer failed: count them)."""
        batch = {table: rows for table, rows in self.rows.items() if rows}
        self.rows = {table: [] for table in self.rows}
        if self.failure is not None:
            self.fail(self.failure, batch)
            return
        seq = self.seq
        self.seq += bool(batch)
        if background:
            self.last = self.worker.submit(self.write, batch, seq, manifest)
        else:
            self.wait()
            if self.failure is None:
                self.write(batch, seq, manifest)
            else:
                self.fail(self.failure, batch)

    def wait(self, timeout_s: float = WAIT_S) -> None:
        """Until the background write is done; one that takes longer than `timeout_s` fails the writer."""
        if self.last is None:
            return
        try:
            self.last.result(timeout=timeout_s)
        except FutureTimeout:
            self.fail(f"a background write took over {timeout_s:g} s", {})
        self.last = None

    def write(self, batch: dict[str, list[dict]], seq: int, manifest: dict) -> None:
        """Write one batch; never raises (it runs on the worker thread or at exit): a failure fails the writer."""
        pending = dict(batch)
        try:
            for table, rows in batch.items():
                self.write_part(table, rows, seq)
                del pending[table]
            self.flushed_step = manifest.get("last_flushed_step", self.flushed_step)
            self.write_manifest({**manifest, "flushes": self.seq, "rows_written": dict(self.rows_written),
                                 "dropped_rows": dict(self.dropped_rows)})
        except Exception as exc:
            self.fail(f"{type(exc).__name__}: {exc}", pending)

    def write_part(self, table: str, rows: list[dict], seq: int) -> None:
        """One part of one table; a part cut by a full disk is removed (its space given back) and the error raised."""
        frame = to_frame(rows, table)
        if table in self.prepare:
            frame = self.prepare[table](frame)
        arrow = frame.to_arrow().cast(schema.TABLES[table][0])
        path = layout.part_path(self.root, table, self.rank, seq)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            pq.write_table(arrow, tmp)
            os.replace(tmp, path)
        except Exception:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        self.rows_written[table] += len(rows)

    def run(self, fn, *args, background: bool = True) -> None:
        """fn(*args) after the writes handed over so far: on the writer's thread, or here."""
        if background and self.failure is None:
            self.last = self.worker.submit(fn, *args)
        else:
            self.wait()
            fn(*args)

    def write_manifest(self, manifest: dict) -> None:
        if self.folder_lock.other_writer is not None:  # the manifest there is the other writer's
            return
        data = json.dumps(manifest, indent=1, default=str).encode()
        write_atomically(layout.manifest_path(self.root, self.rank), data)

    def close(self) -> None:
        self.wait()
        self.worker.shutdown()  # a hung write (already given up on) must not hold up the exit
        self.folder_lock.release()


class BackgroundWriter:
    """One daemon thread running the writes handed to it, in order. Not a ThreadPoolExecutor: the interpreter
    joins an executor's threads at exit, so a write hung on a dead file system (NFS, a FIFO) held the job's exit
    forever after close() had given up on it; a daemon thread ends with the process."""

    def __init__(self, name: str):
        self.name = name
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self.tasks.put((future, fn, args))
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.thread.start()
        return future

    def _run(self) -> None:
        while (task := self.tasks.get()) is not None:
            future, fn, args = task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter, as an executor does
                    future.set_exception(exc)

    def shutdown(self) -> None:
        """The thread ends after the writes handed over so far (or with the process)."""
        self.tasks.put(None)
