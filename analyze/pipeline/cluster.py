"""`analyze --scheduler ADDRESS`: the traces of a run parsed, and its per-rank analyses run, as tasks
on an existing Dask cluster.

Discovery, the small native artifacts, rank assignment, the cross-rank analyses, the report and the
publish stay in the `analyze` process. Each rank's analyses are one task (`rank_mapper`:
runner.rank_analyses, reading the staged tables, writing its per-rank parts, returning its small
frames to gather). Each trace is one task (`_parse_task`: ingest._parse_source, the code a local
run uses): it streams its file (a shared path or an object-store URL) and writes its Parquet parts
into the staging folder's scratch space, which therefore lies on a file system the workers share;
only the small `Source` record travels back. A task whose worker dies is rescheduled by Dask (up to
the scheduler's `distributed.scheduler.allowed-failures`); after that the file is reported as an
ingest issue (`worker_lost`) and the run goes on without it.

Dask is imported here only: `analyze` without --scheduler never imports it.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from steplens.analyze.pipeline.ingest import IngestError, Source, _parse_source

# A child of the worker's own logger, so the line goes where the worker's log goes (its stderr, and
# the log `Client.get_worker_logs()` returns) without configuring logging on the workers.
TASK_LOG = logging.getLogger("distributed.worker.steplens")
CONNECT_TIMEOUT_S = 10


class ClusterError(IngestError):
    """The scheduler cannot be reached or the cluster went away; one line naming the address."""


def connect(address: str):
    """A client of the scheduler at address; ClusterError when it cannot be reached in time."""
    try:
        from distributed import Client
    except ImportError:
        raise ClusterError("--scheduler needs Dask distributed: pip install 'steplens[dask]'") from None
    try:
        return Client(address, timeout=CONNECT_TIMEOUT_S, set_as_default=False)
    except (OSError, TimeoutError, ValueError) as e:
        raise ClusterError(f"cannot reach the Dask scheduler at {address}: {type(e).__name__}: {e}") from None


def _parse_task(location: str, source: Source, scratch: str) -> Source:
    """One trace, on a worker: the same parse as a local run's, logged with the file it reads."""
    TASK_LOG.info("steplens: parsing %s (%s, %d bytes) in pid %d", source.path, location, source.size, os.getpid())
    return _parse_source(location, source, scratch)


def parse_all(client, to_parse: list, scratch: Path, progress) -> list[Source]:
    """Parse every (location, source) as a task; the sources as the tasks finish (or fail)."""
    from distributed import as_completed
    from distributed.scheduler import KilledWorker

    token = secrets.token_hex(4)  # keys of this run only: another client's results are never taken for ours
    futures = {}
    scratch = scratch.resolve()  # the workers' working folder is not ours
    for location, source in sorted(to_parse, key=lambda item: -item[1].size):  # the largest first
        location = str(location) if "://" in str(location) else str(Path(location).resolve())
        key = f"steplens-parse-{source.path}-{token}"
        futures[client.submit(_parse_task, location, source, str(scratch), key=key, pure=False)] = source
    results = []
    try:
        for future in as_completed(futures, loop=client.loop):
            source = futures[future]
            try:
                parsed = future.result()
            except KilledWorker as e:
                source.status = "error"
                source.issues.append(["error", "worker_lost", 1, f"the Dask workers parsing it died each time it was "
                                      f"tried ({e.last_worker.address if e.last_worker else 'unknown'} last); the "
                                      "run goes on without it"])
                parsed = source
            if parsed.status == "ingested" and not (scratch / parsed.part_id).is_dir():
                raise ClusterError(f"a worker wrote the parts of {parsed.path} to {scratch}, which this machine does "
                                   "not see: --out (or, for an object-store --out, the temporary folder) must be on a "
                                   "file system the workers share")
            results.append(parsed)
            if progress:
                progress(parsed)
    except OSError as e:  # the scheduler went away mid-run
        raise ClusterError(f"lost the Dask scheduler at {client.scheduler.address}: {e}") from None
    finally:
        for future in futures:
            future.release()
    return results


def _rank_task(rank: int, one_rank):
    """The per-rank analyses of one rank, on a worker (runner.rank_analyses), logged with the rank."""
    TASK_LOG.info("steplens: analysing rank %d in pid %d", rank, os.getpid())
    return one_rank(rank)


def rank_mapper(client):
    """A `map` for runner.run: each rank's analyses as a task, the results in rank order. They read the
    staged tables and write their per-rank parts there (the shared folder the parse tasks wrote to)."""
    from distributed.scheduler import KilledWorker

    def map_ranks(one_rank, ranks):
        token = secrets.token_hex(4)
        futures = [client.submit(_rank_task, rank, one_rank, key=f"steplens-rank-{rank}-{token}", pure=False)
                   for rank in ranks]
        try:
            return client.gather(futures)
        except KilledWorker as e:
            raise ClusterError(f"the workers analysing a rank died each time it was tried ({e}); nothing was "
                               "published") from None
        except OSError as e:
            raise ClusterError(f"lost the Dask scheduler at {client.scheduler.address}: {e}") from None
        finally:
            for future in futures:
                future.release()

    return map_ranks
