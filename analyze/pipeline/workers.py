"""The local worker processes of one `analyze` run: started once, used by the traces' parse and then
by the per-rank analyses, stopped when the run ends.

A worker is a spawned interpreter (not forked: polars' thread pool does not survive fork) that has
imported polars, pyarrow and steplens: about as long as parsing 30 MB of JSON. The `analyze` script
starts them (`start_early`) before its own imports when the run folder holds enough JSON to use them,
so they import on the other cores while this process does; keeping the parse's workers for the
per-rank analyses saves starting them twice. While this process would only wait for a worker, it
does the run's `when_idle` work (the report's imports). Each worker dies with `analyze`, kill -9
included, and leaves Ctrl-C to it; `close` and `kill` leave no process behind (the resource tracker
included).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Iterator

_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies
try:
    _LIBC = ctypes.CDLL(None)
except OSError:  # no C library to load by that name
    _LIBC = None


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt(3) parameters, from glibc's malloc.h


def use_system_allocator() -> None:
    """Arrow's default pool (mimalloc) keeps freed blocks; the system allocator returns them, which
    lowers an ingest process's peak memory by about a sixth at a few percent of speed.

    glibc's allocator is given from the start the thresholds its own rule grows to (blocks under 32 MiB
    from the heap, heap kept up to 64 MiB free; kineto.decode trims it after decoding): the parse's
    2 MiB windows then reuse heap pages instead of faulting fresh ones in each time (a quarter fewer page
    faults, about 4% of a parse's CPU, the same peak memory)."""
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())
    mallopt = getattr(_LIBC, "mallopt", None)  # glibc (elsewhere: absent, or a no-op)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        mallopt(_M_TRIM_THRESHOLD, 64 << 20)


# polars allocates with its own jemalloc, configured when polars loads: polars 2 asks it to keep freed pages for
# 500 ms, then to mark them free to the kernel (MADV_FREE) for 1000 ms more, then appends _RJEM_MALLOC_CONF,
# whose settings win. Pages marked so stay in the process's RSS until the kernel is short of memory, so a
# short run held nearly every page any of its stages had freed. Handed back at once when their 500 ms are up
# (muzzy_decay_ms:0), the peak RSS of a run is 5-10% lower (real-8r 645 -> 603 MiB, trace_diff 336 -> 316,
# a 15 MB trace 295 -> 276) in the same time. Handing them back sooner (dirty_decay_ms:100) saves as much
# again but costs a third more system time where every core parses (real-8r 4% slower).
POLARS_ALLOCATOR_CONF = "muzzy_decay_ms:0"


def return_polars_freed_pages() -> None:
    """Called in the `analyze` and `steplens` scripts before polars is imported (the spawned workers inherit
    it); a user's own _RJEM_MALLOC_CONF stands, and a library user's process is left as it is."""
    if "polars" not in sys.modules:
        os.environ.setdefault("_RJEM_MALLOC_CONF", POLARS_ALLOCATOR_CONF)


# OpenBLAS (numpy's, loaded with numpy) starts a thread per core that spins for work after each call and
# at start-up; steplens does no linear algebra worth a second thread (matplotlib's 3x3 transforms at most).
# With one thread an `analyze` of one 1 MB trace took 1.32 CPU s instead of 1.54 and 1.29 s instead of 1.40
# (medians of 10 interleaved runs), at the same memory; on real-8r, where both cores parse, no change.
BLAS_THREADS = "1"


def one_blas_thread() -> None:
    """Called in the `analyze` and `steplens` scripts before numpy is imported (the spawned workers inherit
    it); a user's own OPENBLAS_NUM_THREADS stands, and a library user's process is left as it is."""
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", BLAS_THREADS)


# Python's cyclic garbage collector passes over the young objects every 700 container allocations: importing
# polars, pyarrow, numpy and matplotlib alone made about 280 passes, two of them over every object, 85-120 ms of
# an `analyze` of one small trace (a tenth of it). Every 20,000 it makes about 10 (35-55 ms) at the same peak
# memory: steplens's data lives in Arrow buffers, not Python objects, and the reference cycles of matplotlib's
# figures are still collected every few figures.
GC_THRESHOLDS = (20_000, 50, 100)


def fewer_collections() -> None:
    """Called first in the `analyze` and `steplens` scripts and in the workers; a library user's process is left
    as it is."""
    global _collections_tuned
    gc.set_threshold(*GC_THRESHOLDS)
    _collections_tuned = True


_collections_tuned = False  # set by fewer_collections: this process is one of steplens's scripts or workers


@contextlib.contextmanager
def imports_without_collections() -> Iterator[None]:
    """No collector passes while the heavy modules are imported, which are then frozen (gc.freeze: never looked
    at again): everything an import makes lives as long as the process, so the passes over it found nothing,
    yet at every 20,000 allocations they were still 9 of an `analyze` of one small trace's 10 passes, 35-45 ms.
    In the processes fewer_collections tuned only: a library user's collector is left as it is."""
    if not _collections_tuned or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def keep_pandas_out_of_pyarrow() -> None:
    """pyarrow imports pandas (half a second) the first time it converts Python objects, only to ask
    whether they are pandas objects; steplens never hands it any. Called first in the processes that
    run `analyze` (not in a library user's, which may want pyarrow's pandas conversions): pyarrow then
    takes pandas as absent there, and pandas itself stays importable."""
    if "pandas" in sys.modules:
        return
    import pyarrow as pa

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
    """A worker dies with `analyze` (kill -9 included) and leaves Ctrl-C to it. Its polars runs one thread
    (set before any task imports polars; a user's POLARS_MAX_THREADS stands): the cores are the workers'."""
    os.environ.setdefault("POLARS_MAX_THREADS", "1")
    fewer_collections()
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
    with imports_without_collections():  # every task parses or analyses: polars, pyarrow and the parser
        use_system_allocator()
        keep_pandas_out_of_pyarrow()
        import steplens.analyze.pipeline.ingest  # noqa: F401


# Starting a worker (a fresh interpreter importing polars and pyarrow) costs about as much as
# parsing 30 MB of JSON, and the memory of another process: below this much JSON in total the work,
# the per-rank analyses included, stays in this process (measured: two workers on 67 MB were no
# faster than one process, at twice its memory)
# (STEPLENS_WORKER_WORTH_BYTES overrides it, e.g. to force workers on small test inputs).
WORKER_WORTH_BYTES = int(os.environ.get("STEPLENS_WORKER_WORTH_BYTES", 100_000_000))
# ... or this many trace files, however small, given cores for FILES_WORKERS_MIN workers or more: each
# file costs about 0.065 s of fixed work (a 1 MB dlrm_kineto rank, tests/benchmarks/stage_split.py), so 32
# are 2 s in one process. With one worker (2 cores) it does not pay: 32 of those ranks (bench_ingest
# dlrm-32r, 29 MB) took 3.6 s and 285 MiB in one process, 2.7 s and 482 MiB with a worker, where HTA
# takes 3.7 s and 339 MiB; each further worker divides the parse again for the same memory each.
WORKER_WORTH_FILES = 32
FILES_WORKERS_MIN = 3


def worth_workers(jobs: int, files: int, json_bytes: int, sure_traces: int | None = None) -> bool:
    """Whether parsing `files` traces of `json_bytes` of JSON in all is worth starting workers;
    `sure_traces`: how many of them count towards WORKER_WORTH_FILES (all by default)."""
    traces = files if sure_traces is None else sure_traces
    return files >= 2 and (json_bytes >= WORKER_WORTH_BYTES or (jobs - 1 >= FILES_WORKERS_MIN and traces >= WORKER_WORTH_FILES))


# The per-rank analyses of a run whose parse started no workers (it was reused: `analyze` again with other options;
# or it was small) start workers of their own from this many trace events: they cost about 2.5 us of CPU an event
# (190 ms a real 75k-event A100 rank) and a worker's start about 0.35 s of CPU on the cores they share, so below
# this the start costs more than the share of the work it takes over.
ANALYSIS_WORKER_WORTH_EVENTS = 300_000


def worth_analysis_workers(jobs: int, batches: int, events: int) -> bool:
    """Whether the per-rank analyses of `batches` batches holding `events` trace events in all are worth
    starting workers for (when none are up from the parse)."""
    return jobs >= 2 and batches >= 2 and events >= ANALYSIS_WORKER_WORTH_EVENTS


# A file counts towards WORKER_WORTH_FILES before discovery only from this size: a run folder's small
# .json files (ds_config.json, comms dumps, autotuning experiments, manifests) are not traces.
TRACE_GUESS_MIN_BYTES = 256 << 10
GZIP_RATIO = 10  # typical raw/gzip size of a Kineto trace (the corpus ranges 7x-30x), when the file does not say


def estimated_json_bytes(name: str, size: int) -> int:
    """The JSON a trace file holds: a local .gz file says (gzip's trailer: its last member's size mod
    2**32, taken when it is not below the compressed size), a URL or an implausible trailer is guessed."""
    if not name.endswith(".gz"):
        return size
    if "://" not in name:
        try:
            with open(name, "rb") as f:
                f.seek(-4, os.SEEK_END)
                inflated = int.from_bytes(f.read(4), "little")
            if inflated >= size:
                return inflated
        except OSError:
            pass
    return size * GZIP_RATIO


def start_early_for(run_dir: Path, jobs: int) -> None:
    """Start workers now when run_dir holds traces enough to parse on them: two or more files named as a
    registered trace format's (importers.TRACE_NAMES; hidden folders left out, as discovery does) of
    WORKER_WORTH_BYTES in all, or WORKER_WORTH_FILES of them of TRACE_GUESS_MIN_BYTES or more (worth_workers).
    A guess made before discovery: workers no Workers takes are stopped with the run (stop_early)."""
    if jobs < 2:
        return
    from steplens.analyze.importers import TRACE_NAMES  # the registry alone: no format module is imported

    files, large, total = 0, 0, 0
    try:
        for root, dirs, names in os.walk(run_dir):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in names:
                if name.lower().endswith(TRACE_NAMES) and not name.startswith("."):
                    files += 1
                    path = os.path.join(root, name)
                    size = estimated_json_bytes(path, os.stat(path).st_size)
                    total += size
                    large += size >= TRACE_GUESS_MIN_BYTES
            if files > jobs and worth_workers(jobs, files, total, large):  # enough to decide: the rest is not walked
                break
    except OSError:
        return
    if worth_workers(jobs, files, total, large):
        size = min(files - 1, jobs - 1)
        start_early(size)
        # This process parses beside them: polars threads for the cores they leave (it is imported after this).
        os.environ.setdefault("POLARS_MAX_THREADS", str(max(1, (os.cpu_count() or 1) - size)))


_DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _submit(pool: ProcessPoolExecutor, function, *args) -> Future:
    """pool.submit, which may start a worker. A Ctrl-C or SIGTERM handled in the middle of that would leave a
    half-started child that the cleanup cannot see, waiting for its start-up data with the resource tracker's
    pipe open (so stopping the tracker hangs): here their handlers run once the child is registered. Blocking the
    signals (pthread_sigmask) is not enough: polars' threads take them, and Python runs the handler in the
    main thread all the same. Handlers run in the main thread only, so a submit from another does not defer."""
    if threading.current_thread() is not threading.main_thread() or None in map(signal.getsignal, _DEFERRED_SIGNALS):
        return pool.submit(function, *args)  # (None: a handler not set from Python, which could not be put back)
    caught: list[int] = []
    handlers = {number: signal.signal(number, lambda signum, frame: caught.append(signum)) for number in _DEFERRED_SIGNALS}
    try:
        return pool.submit(function, *args)
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        for number in caught:
            signal.raise_signal(number)  # now, to the handler the process had


def _new_pool(size: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=size, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(os.getpid(),))


def _import_parser() -> None:
    """A worker's first task when started early: it starts the worker, whose initializer (_start_worker) makes
    the parse's imports before a file arrives."""


_early: tuple[ProcessPoolExecutor, int] | None = None  # started by start_early, taken by the first Workers.pool


def start_early(size: int) -> None:
    """Start `size` workers now, each importing the parser: the first Workers.pool takes them."""
    global _early
    if _early is None and size > 0:
        pool = _new_pool(size)
        _early = (pool, size)  # before the first start: a signal handled between two is stopped with them
        for _ in range(size):  # a spawned pool starts one process per task it cannot hand to an idle one
            _submit(pool, _import_parser)


def stop_early() -> None:
    """Kill workers started early that no Workers took (the run turned out too small for them, or failed)."""
    global _early
    if _early is not None:
        pool, _early = _early[0], None
        _kill_pool(pool)


class Workers:
    """Up to `jobs` - 1 worker processes beside this one, started on first use (or taken from
    start_early); a context manager that stops them when the block ends (killed at once when it ends
    by an exception). `when_idle` is run once, here, the first time this process would only wait
    for a worker."""

    def __init__(self, jobs: int | None = None, when_idle=None):
        self.jobs = max(1, jobs or os.cpu_count() or 1)
        self.size = 0
        self._pool: ProcessPoolExecutor | None = None
        self._when_idle = when_idle

    def idle(self, futures) -> None:
        """About to wait for `futures`: first the when_idle work, if one of them is still running."""
        if self._when_idle is not None and not all(f.done() for f in futures):
            work, self._when_idle = self._when_idle, None
            work()

    @property
    def started(self) -> bool:
        return self._pool is not None

    @property
    def available(self) -> bool:
        """Workers are up, or waiting from start_early: using them costs nothing more."""
        return self._pool is not None or _early is not None

    def pool(self, wanted: int) -> ProcessPoolExecutor:
        """The pool, started with min(wanted, jobs - 1) workers if it is not running yet."""
        global _early
        if self._pool is None and _early is not None:
            (self._pool, self.size), _early = _early, None
        if self._pool is None:
            self.size = max(1, min(wanted, self.jobs - 1))
            self._pool = _new_pool(self.size)
        return self._pool

    def submit(self, function, *args) -> Future:
        return _submit(self._pool, function, *args)

    def share(self, work, items: list) -> Iterator[tuple[object, object]]:
        """(item, work(item)) for every item, as each is done: the workers take items from the front of
        `items`, this process from the back, each the next one as soon as it is free. A worker's next item
        is handed to it when its last one ends (by that future's callback), so it waits neither for this
        process nor behind a queued item that this process, free sooner, could have taken."""
        queue, lock, in_flight = list(items), threading.Lock(), {}

        def hand_out(finished: Future | None = None) -> None:
            with lock:
                failed = finished is not None and (finished.cancelled() or finished.exception() is not None)
                if failed or not queue or self._pool is None:
                    return  # a failed item is raised when this process collects it; a killed pool gets none
                item = queue.pop(0)
                try:
                    future = self.submit(work, item)
                except Exception:  # noqa: BLE001 - a pool that cannot take it (broken): this process does the item
                    queue.insert(0, item)
                    return
                in_flight[future] = item
            future.add_done_callback(hand_out)

        def collect(futures) -> Iterator[tuple[object, object]]:
            for future in futures:
                with lock:
                    item = in_flight.pop(future)
                yield item, future.result()

        remaining = len(queue)
        for _ in range(self.size):
            hand_out()
        while remaining:
            with lock:
                item = queue.pop() if queue else None
                running = list(in_flight)
            if item is not None:
                yield item, work(item)
                finished = [f for f in running if f.done()]
            elif running:
                self.idle(running)
                finished = [next(as_completed(running))]
            else:  # an item ended and its callback is handing the next one out: a moment
                time.sleep(0.001)
                continue
            remaining -= (item is not None) + len(finished)
            yield from collect(finished)

    def map_ranks(self, one_batch, batches: list, then=None, events: int = 0) -> list:
        """one_batch(batch) for each batch of ranks, in order: on the workers the parse started and this
        process (share); when the parse needed none, on workers started now if the batches' `events` trace
        events are worth it (worth_analysis_workers), else here alone. Then the workers stop, unless `then` is
        given: each worker starts on it (the report's imports) and stays for `map`."""
        if not self.started:
            if not worth_analysis_workers(self.jobs, len(batches), events):
                return list(map(one_batch, batches))
            self.pool(len(batches) - 1)
        try:
            results = dict(self.share(one_batch, batches)) if len(batches) > 1 else {b: one_batch(b) for b in batches}
        except BaseException:
            self.kill()
            raise
        if then is None:
            self.kill()  # every task has returned: nothing is lost, and no worker's teardown is waited for
        else:
            for _ in range(self.size):
                self.submit(then)
        return [results[batch] for batch in batches]

    def map(self, work, items: list) -> list:
        """work(item) for each item, in order, shared with the workers if they are up; their last job."""
        if not self.started:
            return list(map(work, items))
        try:
            results = {id(item): result for item, result in self.share(work, items)}
        finally:
            self.kill()
        return [results[id(item)] for item in items]

    def kill(self) -> None:
        """Kill the workers now (Ctrl-C, SIGTERM, an error): waiting would finish every task in flight."""
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        _kill_pool(pool)

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
        stop_early()


def _kill_pool(pool: ProcessPoolExecutor) -> None:
    # Every child multiprocessing started, including a worker still starting up (not yet in the pool).
    processes = list((getattr(pool, "_processes", None) or {}).values()) + multiprocessing.active_children()
    for process in processes:
        process.kill()
    for process in processes:
        process.join(timeout=5)
    pool.shutdown(wait=True, cancel_futures=True)
    _stop_resource_tracker()


def _stop_resource_tracker() -> None:
    """The spawn context's resource tracker would outlive `analyze` by a moment; end it with the pool."""
    try:
        from multiprocessing import resource_tracker

        resource_tracker._resource_tracker._stop()
    except (AttributeError, OSError, ChildProcessError):
        pass
