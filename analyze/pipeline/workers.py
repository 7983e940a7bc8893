"""The local worker processes of one `analyze` run: started once, used by the traces' parse and then
by the per-rank analyses, stopped when the run ends.

A worker is a spawned interpreter (not forked: polars' thread pool does not survive fork) that has
imported polars, pyarrow and steplens: about as long as parsing 30 MB of JSON. Keeping the parse's
workers for the per-rank analyses saves starting them twice. Each worker dies with `analyze`, kill -9
included, and leaves Ctrl-C to it; `close` and `kill` leave no process behind (the resource tracker
included).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor

import pyarrow as pa

_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies


def use_system_allocator() -> None:
    """Arrow's default pool (mimalloc) keeps freed blocks; the system allocator returns them, which
    lowers an ingest process's peak memory by about a sixth at a few percent of speed."""
    pa.set_memory_pool(pa.system_memory_pool())


def keep_pandas_out_of_pyarrow() -> None:
    """pyarrow imports pandas (half a second) the first time it converts Python objects, only to ask
    whether they are pandas objects; steplens never hands it any. Called first in the processes that
    run `analyze` (not in a library user's, which may want pyarrow's pandas conversions): pyarrow then
    takes pandas as absent there, and pandas itself stays importable."""
    if "pandas" in sys.modules:
        return
    sys.meta_path.insert(0, _NoPandas)  # the import raises ImportError, which pyarrow takes as "not installed"
    try:
        # Both look once and remember: the Python-level check, and the C++ one of the first conversion.
        pa.lib._pandas_api.have_pandas  # noqa: B018
        pa.array([0])
    finally:
        sys.meta_path.remove(_NoPandas)


class _NoPandas:
    """An import finder that refuses pandas."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "pandas":
            raise ImportError("pandas is kept out of pyarrow in this process")
        return None


def _start_worker(parent_pid: int) -> None:
    """A worker dies with `analyze` (kill -9 included) and leaves Ctrl-C to it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the watchdog thread below still ends it
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch_parent() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch_parent, daemon=True, name="steplens-parent-watch").start()
    use_system_allocator()
    keep_pandas_out_of_pyarrow()


class Workers:
    """Up to `jobs` - 1 worker processes beside this one, started on first use; a context manager
    that stops them when the block ends (killed at once when it ends by an exception)."""

    def __init__(self, jobs: int | None = None):
        self.jobs = max(1, jobs or os.cpu_count() or 1)
        self.size = 0
        self._pool: ProcessPoolExecutor | None = None

    @property
    def started(self) -> bool:
        return self._pool is not None

    def pool(self, wanted: int) -> ProcessPoolExecutor:
        """The pool, started with min(wanted, jobs - 1) workers if it is not running yet."""
        if self._pool is None:
            self.size = max(1, min(wanted, self.jobs - 1))
            saved = os.environ.get("POLARS_MAX_THREADS")
            os.environ["POLARS_MAX_THREADS"] = "1"  # inherited by the workers only: this process has started polars
            try:
                self._pool = ProcessPoolExecutor(max_workers=self.size, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_start_worker, initargs=(os.getpid(),))
            finally:
                if saved is None:
                    os.environ.pop("POLARS_MAX_THREADS", None)
                else:
                    os.environ["POLARS_MAX_THREADS"] = saved
        return self._pool

    def submit(self, function, *args) -> Future:
        # submit() may start a worker; a Ctrl-C or SIGTERM in the middle of that would leave a
        # half-started child the cleanup cannot see, so they wait until it is registered.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            return self._pool.submit(function, *args)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def map_ranks(self, one_batch, batches: list) -> list:
        """one_batch(batch) for each batch of ranks, in order: on the workers the parse started, taking
        batches from the front, and this process, from the back; here alone when the parse needed none.
        It is the workers' last job: they stop when it returns, so the report is rendered without them
        holding memory."""
        if not self.started or len(batches) < 2:
            results = list(map(one_batch, batches))
            self.kill()  # idle since the parse
            return results
        queue, results, in_flight = list(batches), {}, {}

        def top_up() -> None:
            while queue and len(in_flight) < 2 * self.size:  # one queued behind each worker's
                batch = queue.pop(0)
                in_flight[self.submit(one_batch, batch)] = batch

        def collect(futures) -> None:
            for future in futures:
                results[in_flight.pop(future)] = future.result()

        try:
            top_up()
            while queue:
                batch = queue.pop()
                results[batch] = one_batch(batch)
                collect([f for f in in_flight if f.done()])
                top_up()
            collect(list(in_flight))
        finally:
            self.kill()  # every task has returned (or failed): nothing is lost, and no worker's teardown is waited for
        return [results[batch] for batch in batches]

    def kill(self) -> None:
        """Kill the workers now (Ctrl-C, SIGTERM, an error): waiting would finish every task in flight."""
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        # Every child multiprocessing started, including a worker still starting up (not yet in the pool).
        processes = list((getattr(pool, "_processes", None) or {}).values()) + multiprocessing.active_children()
        for process in processes:
            process.kill()
        for process in processes:
            process.join(timeout=5)
        pool.shutdown(wait=True, cancel_futures=True)
        _stop_resource_tracker()

    def close(self) -> None:
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        pool.shutdown(wait=True)
        _stop_resource_tracker()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.kill()


def _stop_resource_tracker() -> None:
    """The spawn context's resource tracker would outlive `analyze` by a moment; end it with the pool."""
    try:
        from multiprocessing import resource_tracker

        resource_tracker._resource_tracker._stop()
    except (AttributeError, OSError, ChildProcessError):
        pass
