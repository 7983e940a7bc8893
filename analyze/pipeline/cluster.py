"""`analyze --scheduler ADDRESS`: the traces of a run parsed, and its per-rank analyses run, as tasks
on an existing Dask cluster.

Discovery, the small native artifacts, rank assignment, the cross-rank analyses, the report and the
publish stay in the `analyze` process. Each batch of ranks' analyses is one task (`rank_mapper`:
runner.rank_analyses over runner.batches, reading the staged tables, writing its per-rank parts,
returning its small frames to gather). Each trace is one task (`_parse_task`: ingest._parse_source,
the code a local run uses): it streams its file (a shared path or an object-store URL) and writes its Parquet parts
into the staging folder's scratch space, which therefore lies on a file system the workers share;
only the small `Source` record travels back.

With an object-store --out, the workers share nothing with `analyze` but the store: a parse task
writes its parts straight into the result's uncommitted generation (remote.Generation), at the rank
the trace names; a rank task reads its ranks' parts from there and writes its own parts there. The
`analyze` process downloads the parts for the cross-rank analyses and the report, uploads what the
workers did not write, and commits: run.json, written last, names them (readers see none of them
before). A task whose worker dies is rescheduled by Dask (up to
the scheduler's `distributed.scheduler.allowed-failures`); after that the file is reported as an
ingest issue (`worker_lost`) and the run goes on without it.

Dask is imported here only: `analyze` without --scheduler never imports it.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import tempfile
import threading
from pathlib import Path

from steplens.analyze.contract import schema
from steplens.analyze.pipeline import remote
from steplens.analyze.pipeline.ingest import PARSED_TABLES, IngestError, Source, _parse_source, own_rank

# A child of the worker's own logger, so the line goes where the worker's log goes (its stderr, and
# the log `Client.get_worker_logs()` returns) without configuring logging on the workers.
TASK_LOG = logging.getLogger("distributed.worker.steplens")
CONNECT_TIMEOUT_S = 10
HANDSHAKE_MARGIN_S = 5  # beyond the connect timeout: Client's retries and its start


class ClusterError(IngestError):
    """The scheduler cannot be reached or the cluster went away; one line naming the address."""


def connect(address: str):
    """A client of the scheduler at address; ClusterError when it cannot be reached in time."""
    try:
        from distributed import Client
    except ImportError:
        raise ClusterError("--scheduler needs Dask distributed: pip install 'steplens[dask]'") from None
    # Client's own timeout does not bound its handshake: a service that accepts the connection and never
    # answers holds it forever, so it is made in a daemon thread that is given up on (and ends with the process).
    made: dict = {}

    def make_client() -> None:
        client = Client.__new__(Client)
        try:
            client.__init__(address, timeout=CONNECT_TIMEOUT_S, set_as_default=False)
            made["client"] = client
            return
        except (OSError, TimeoutError, ValueError) as e:
            made["error"] = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - another service's reply read as Dask frames (a MemoryError, ...)
            made["error"] = f"not a Dask scheduler ({type(e).__name__})"
        # It never connected: nothing to close (its close, run when it is collected, would wait 20 s on the service)
        client.status = "closed"

    attempt = threading.Thread(target=make_client, name="steplens-connect", daemon=True)
    attempt.start()
    attempt.join(CONNECT_TIMEOUT_S + HANDSHAKE_MARGIN_S)
    if "client" in made:
        return made["client"]
    why = made.get("error", f"no Dask handshake within {CONNECT_TIMEOUT_S + HANDSHAKE_MARGIN_S} s (not a Dask scheduler?)")
    raise ClusterError(f"cannot reach the Dask scheduler at {address}: {why}")


def _parse_task(location: str, source: Source, scratch: str) -> Source:
    """One trace, on a worker: the same parse as a local run's, logged with the file it reads."""
    TASK_LOG.info("steplens: parsing %s (%s, %d bytes) in pid %d", source.path, location, source.size, os.getpid())
    return _parse_source(location, source, scratch)


def _likely_rank(source: Source) -> int:
    """The rank ingest._assign_ranks gives a parsed trace, as far as the trace alone tells (ingest.own_rank);
    else the rank it gives a file alone in its run: a process its place in the file, another trace 0. Where the
    other traces decide otherwise, `analyze` uploads the parts again under the right rank."""
    rank, _ = own_rank(source)
    return rank if rank is not None else source.unit_index or 0


def _parse_to_store_task(location: str, source: Source, parts_url: str) -> tuple[Source, dict[str, int]]:
    """One trace, on a worker that shares no folder with `analyze`: parsed into a folder of its own, its
    parts uploaded to the uncommitted result (parts_url) where the result lays them out."""
    TASK_LOG.info("steplens: parsing %s (%s, %d bytes) in pid %d, parts to %s", source.path, location, source.size,
                  os.getpid(), parts_url)
    with tempfile.TemporaryDirectory(prefix="steplens-parse-") as scratch:
        parsed = _parse_source(location, source, scratch)
        if parsed.status != "ingested":
            return parsed, {}
        return parsed, remote.put_files(parts_url, {  # a file of several ranks: every unit's parts
            f"{schema.part_dir(table, _likely_rank(unit))}/part-{unit.part_id}.parquet": Path(scratch, unit.part_id, f"{table}.parquet")
            for unit in (parsed, *parsed.units) if unit.status == "ingested" for table in PARSED_TABLES})


def _part_id(relative: str) -> str:
    """The part id in an uploaded part's path (TABLE/rank=R/part-ID.parquet)."""
    return Path(relative).name.removeprefix("part-").removesuffix(".parquet")


def parse_all(client, to_parse: list, scratch: Path, progress, store: remote.Generation | None = None) -> list[Source]:
    """Parse every (location, source) as a task; the sources as the tasks finish (or fail). With a `store`
    (an object-store --out) the workers upload their parts to it, and they are downloaded into scratch."""
    from distributed import as_completed
    from distributed.scheduler import KilledWorker

    token = secrets.token_hex(4)  # keys of this run only: another client's results are never taken for ours
    futures = {}
    scratch = scratch.resolve()  # the workers' working folder is not ours
    for location, source in sorted(to_parse, key=lambda item: -item[1].size):  # the largest first
        location = str(location) if "://" in str(location) else str(Path(location).resolve())
        key = f"steplens-parse-{source.path}-{token}"
        task = (_parse_to_store_task, location, source, store.prefix) if store else (_parse_task, location, source,
                                                                                      str(scratch))
        futures[client.submit(*task, key=key, pure=False)] = source
    results = []
    try:
        for future in as_completed(futures, loop=client.loop):
            source = futures[future]
            try:
                parsed, uploaded = future.result() if store else (future.result(), {})
                if uploaded:  # here too: the cross-rank analyses and the report read them
                    store.uploaded.update(uploaded)
                    remote.get_files(store.prefix, {relative: scratch / _part_id(relative) / f"{relative.split('/')[0]}.parquet"
                                                    for relative in uploaded})
            except KilledWorker as e:
                source.status = "error"
                source.issues.append(["error", "worker_lost", 1, f"the Dask workers parsing it died each time it was "
                                      f"tried ({e.last_worker.address if e.last_worker else 'unknown'} last); the "
                                      "run goes on without it"])
                parsed = source
            if parsed.status == "ingested" and not (scratch / parsed.part_id).is_dir():
                raise ClusterError(f"a worker wrote the parts of {parsed.path} to {scratch}, which this machine does "
                                   "not see: --out must be on a file system the workers share, or an object-store URL")
            results.append(parsed)
            if progress:
                progress(parsed)
    except OSError as e:  # the scheduler went away mid-run
        raise ClusterError(f"lost the Dask scheduler at {client.scheduler.address}: {e}") from None
    finally:
        for future in futures:
            future.release()
    return results


def _rank_task(batch: tuple[int, ...], one_batch):
    """The per-rank analyses of one batch of ranks, on a worker (runner.rank_analyses), logged with its ranks."""
    TASK_LOG.info("steplens: analysing ranks %s in pid %d", _named(batch), os.getpid())
    return one_batch(batch)


def _named(batch: tuple[int, ...]) -> str:
    return "-".join(map(str, batch))


def _rank_from_store_task(batch: tuple[int, ...], one_batch, parts_url: str, inputs: list[str]):
    """The per-rank analyses of one batch of ranks, on a worker that shares no folder with `analyze`: its
    inputs downloaded from the uncommitted result into a folder of its own, its parts uploaded there.
    Returns the frames to gather and {relative path: size} of what it uploaded."""
    TASK_LOG.info("steplens: analysing ranks %s in pid %d, parts to %s", _named(batch), os.getpid(), parts_url)
    with tempfile.TemporaryDirectory(prefix="steplens-rank-") as folder:
        remote.get_files(parts_url, {relative: Path(folder, relative) for relative in inputs})
        frames = functools.partial(one_batch, out_dir=Path(folder))(batch)  # this task's own folder, not the staged one
        written = {p.relative_to(folder).as_posix(): p for p in Path(folder).rglob("*.parquet")}
        return frames, remote.put_files(parts_url, {k: v for k, v in written.items() if k not in inputs})


def _rank_inputs(folder: Path, batch: tuple[int, ...]) -> list[str]:
    """The staged parts the per-rank analyses read for one batch of ranks (relative paths): those ranks'
    partitions of the ingested tables they read, and those tables whole when they are not partitioned by rank."""
    from steplens.analyze.analyses import runner

    tables = {table for analysis in runner.ANALYSES if analysis.per_rank for table in analysis.reads
              if table in schema.TABLES}
    return sorted({p.relative_to(folder).as_posix() for table in tables for rank in batch
                   for p in (folder / schema.part_dir(table, rank)).glob("*.parquet")})


def rank_mapper(client, store: remote.Generation | None = None):
    """A `map` for runner.run: each batch of ranks' analyses as a task, the results in rank order. They read the
    staged tables and write their per-rank parts there (the shared folder the parse tasks wrote to); with a
    `store`, they read and write the uncommitted result instead, and their parts are downloaded here."""
    from distributed.scheduler import KilledWorker

    def map_ranks(one_batch, batches):
        token = secrets.token_hex(4)
        if store:
            folder = Path(one_batch.keywords["out_dir"])
            inputs = {batch: _rank_inputs(folder, batch) for batch in batches}
            store.put_missing(folder, sorted({p for paths in inputs.values() for p in paths}))  # reused parts
            futures = [client.submit(_rank_from_store_task, batch, one_batch, store.prefix, inputs[batch],
                                     key=f"steplens-rank-{_named(batch)}-{token}", pure=False) for batch in batches]
        else:
            futures = [client.submit(_rank_task, batch, one_batch, key=f"steplens-rank-{_named(batch)}-{token}",
                                     pure=False) for batch in batches]
        try:
            if not store:
                return client.gather(futures)
            results = []
            for frames, uploaded in client.gather(futures):
                store.uploaded.update(uploaded)
                remote.get_files(store.prefix, {relative: folder / relative for relative in uploaded})
                results.append(frames)
            return results
        except KilledWorker as e:
            raise ClusterError(f"the workers analysing a rank died each time it was tried ({e}); nothing was "
                               "published") from None
        except OSError as e:
            raise ClusterError(f"lost the Dask scheduler at {client.scheduler.address}: {e}") from None
        finally:
            for future in futures:
                future.release()

    return map_ranks
