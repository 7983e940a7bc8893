"""The local worker processes (pipeline/workers.py): one queue shared with this process, workers started
before the analyze script's imports, polars on one thread each, and nothing left behind."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from steplens.analyze import cli, cli_rerun
from steplens.analyze.pipeline import workers as workers_module
from steplens.analyze.pipeline.workers import Workers

from conftest import python_children, write_trace


def _square_where(item: int) -> tuple[int, int]:
    time.sleep(0.02)  # long enough for both sides to take items
    return item * item, os.getpid()


def _fails_on_three(item: int) -> int:
    if item == 3:
        raise ValueError("item 3 is bad")
    return item


def _polars_threads(_=None) -> int:
    import polars as pl

    return pl.thread_pool_size()


def test_share_gives_every_item_once_from_the_workers_and_this_process():
    before = python_children()
    with Workers(3) as workers:
        workers.pool(2)
        done = list(workers.share(_square_where, list(range(40))))
    assert sorted(item for item, _ in done) == list(range(40))  # each once
    assert all(result[0] == item * item for item, result in done)
    pids = {result[1] for _, result in done}
    assert os.getpid() in pids and len(pids) >= 2  # this process and at least one worker took items
    assert python_children() <= before


def test_share_takes_items_from_the_back_here_and_from_the_front_on_the_workers():
    with Workers(2) as workers:
        workers.pool(1)
        done = list(workers.share(_square_where, list(range(12))))
    here = [item for item, (_, pid) in done if pid == os.getpid()]
    there = [item for item, (_, pid) in done if pid != os.getpid()]
    assert here and there and min(here) > max(there)


def test_a_failing_item_is_raised_and_no_worker_is_left():
    before = python_children()
    workers = Workers(2)
    workers.pool(1)
    with pytest.raises(ValueError, match="item 3 is bad"):
        with workers:
            dict(workers.share(_fails_on_three, list(range(8))))
    assert python_children() <= before


def test_workers_run_polars_on_one_thread():
    with Workers(2) as workers:
        workers.pool(1)
        assert workers.submit(_polars_threads).result() == 1


def _two_traces(folder):
    for rank in (0, 1):
        write_trace(folder / f"rank{rank}.pt.trace.json", [{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1,
                                                              "tid": 1, "ts": 1, "dur": 1}])
    return folder


def test_workers_started_early_are_taken_by_the_first_pool(tmp_path, monkeypatch):
    monkeypatch.setattr(workers_module, "WORKER_WORTH_BYTES", 0)
    monkeypatch.setenv("POLARS_MAX_THREADS", "")  # recorded, so that what start_early_for sets is undone
    monkeypatch.delenv("POLARS_MAX_THREADS")
    before = python_children()
    workers_module.start_early_for(_two_traces(tmp_path / "run"), jobs=2)
    early = python_children() - before
    assert len(early) >= 1  # started before any Workers asked
    assert os.environ["POLARS_MAX_THREADS"] == str(max(1, os.cpu_count() - 1))  # for this process, not yet importing polars
    with Workers(2) as workers:
        assert workers.available
        workers.pool(1)
        assert workers.size == 1 and early <= python_children()  # the same processes, no new ones
        assert workers.submit(_polars_threads).result() == 1
    assert python_children() <= before


def test_workers_started_early_that_no_run_takes_are_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(workers_module, "WORKER_WORTH_BYTES", 0)
    monkeypatch.setenv("POLARS_MAX_THREADS", "2")  # a user's setting stands
    before = python_children()
    workers_module.start_early_for(_two_traces(tmp_path / "run"), jobs=2)
    assert os.environ["POLARS_MAX_THREADS"] == "2"
    assert python_children() - before
    workers_module.stop_early()
    assert python_children() <= before


def test_no_early_workers_below_the_threshold_or_for_one_file(tmp_path, monkeypatch):
    before = python_children()
    workers_module.start_early_for(_two_traces(tmp_path / "small"), jobs=2)  # a few bytes: the default threshold
    monkeypatch.setattr(workers_module, "WORKER_WORTH_BYTES", 0)
    one = tmp_path / "one"
    write_trace(one / "rank0.pt.trace.json", [{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 1, "ts": 1, "dur": 1}])
    workers_module.start_early_for(one, jobs=2)
    workers_module.start_early_for(_two_traces(tmp_path / "jobs1"), jobs=1)
    assert workers_module._early is None and python_children() <= before


def test_early_workers_for_many_traces_however_small_but_not_for_many_small_json_files(tmp_path, monkeypatch):
    """WORKER_WORTH_FILES traces of TRACE_GUESS_MIN_BYTES each are far below WORKER_WORTH_BYTES, and still
    worth FILES_WORKERS_MIN workers or more (each file has a fixed cost), not one (2 cores: no faster for
    the memory of another process); as many small .json files (configs, dumps) are not traces."""
    many, small = tmp_path / "many", tmp_path / "small"
    padding = "x" * workers_module.TRACE_GUESS_MIN_BYTES
    for rank in range(workers_module.WORKER_WORTH_FILES):
        write_trace(many / f"rank{rank}.pt.trace.json", [{"ph": "X", "cat": "cpu_op", "name": padding, "pid": 1,
                                                          "tid": 1, "ts": 1, "dur": 1}])
        write_trace(small / f"exp{rank}.json", [])
    assert workers_module.WORKER_WORTH_FILES * workers_module.TRACE_GUESS_MIN_BYTES * 10 < workers_module.WORKER_WORTH_BYTES
    monkeypatch.setenv("POLARS_MAX_THREADS", "")  # recorded, so that what start_early_for sets is undone
    monkeypatch.delenv("POLARS_MAX_THREADS")
    before = python_children()
    try:
        jobs = workers_module.FILES_WORKERS_MIN + 1
        workers_module.start_early_for(small, jobs=jobs)
        workers_module.start_early_for(many, jobs=2)
        assert workers_module._early is None and python_children() <= before
        workers_module.start_early_for(many, jobs=jobs)
        assert workers_module._early is not None and python_children() - before
    finally:
        workers_module.stop_early()
    assert python_children() <= before


def test_worth_workers_by_bytes_or_by_many_files_on_enough_cores():
    worth, many, mb = workers_module.worth_workers, workers_module.WORKER_WORTH_FILES, 1 << 20
    assert workers_module.FILES_WORKERS_MIN == 3 and workers_module.WORKER_WORTH_BYTES == 100_000_000
    assert worth(2, 2, 100_000_000) and not worth(2, 2, 99_999_999) and not worth(16, 1, 10**9)  # bytes: any cores
    assert not worth(2, many, many * mb) and not worth(3, many, many * mb)  # one or two workers: not for small files
    assert worth(4, many, many * mb) and not worth(4, many - 1, (many - 1) * mb)
    assert not worth(16, many + 10, many * mb, sure_traces=many - 1) and worth(16, many + 10, many * mb, sure_traces=many)


def test_the_script_knows_every_analyze_option_that_takes_a_value():
    taking = {name for param in cli.analyze.params if not getattr(param, "is_flag", True) and param.name != "run_dir"
              for name in param.opts + param.secondary_opts}
    assert taking == cli_rerun.VALUE_OPTIONS


@pytest.mark.parametrize("argv, expected", [
    (["RUN", "-q"], ("RUN", None)),
    (["--out", "elsewhere", "RUN", "-j", "3"], ("RUN", 3)),
    (["--dtype=fp16", "RUN", "--jobs=4"], ("RUN", 4)),
    (["--scheduler", "tcp://x:1", "RUN"], None),
    (["compare", "RUN", "RUN"], None),
    (["RUN", "--help"], None),
    (["s3://bucket/run"], None),
])
def test_the_script_reads_run_dir_and_jobs(argv, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "RUN").mkdir()
    parsed = cli_rerun._run_dir_and_jobs(argv)
    if expected is None:
        assert parsed is None
    else:
        assert parsed == (Path(expected[0]), expected[1] or os.cpu_count())


def _report_imports(run, out) -> str:
    script = ("import sys\n"
              "from steplens.analyze.pipeline import analyse\n"
              "from steplens.reports import html\n"
              f"analyse({str(run)!r}, {str(out)!r}, jobs=1)\n"
              f"page = html.render({str(out)!r})\n"
              "print('matplotlib' in sys.modules, page.count('<svg'))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_report_without_figures_never_imports_matplotlib(tmp_path):
    run = tmp_path / "cpu_only"
    write_trace(run / "rank0.pt.trace.json", [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1,
                                               "ts": 1, "dur": 5}], distributedInfo={"rank": 0, "world_size": 1})
    assert _report_imports(run, tmp_path / "out") == ["False", "0"]


def test_a_report_with_figures_draws_them(tmp_path):
    from synthetic import generate_run

    run = tmp_path / "run"
    generate_run(run, ranks=2, steps=3, kernels_per_step=20, seed=1, write_truth=False)
    imported, figures = _report_imports(run, tmp_path / "out")
    assert imported == "True" and int(figures) >= 4


def test_figures_drawn_on_a_worker_are_the_ones_drawn_here(tmp_path):
    """The report's figures are shared with the workers (Workers.map): the same SVG bytes either way."""
    from synthetic import generate_run

    from steplens.analyze.cli_render import draw_figure, import_figures
    from steplens.analyze.pipeline import analyse
    from steplens.reports import html

    run = tmp_path / "run"
    generate_run(run, ranks=2, steps=3, kernels_per_step=20, seed=2, write_truth=False)
    analyse(run, tmp_path / "out", jobs=1)
    drawings = []
    here = html.render(tmp_path / "out", lambda ds: drawings.extend(ds) or html.draw(ds))
    with Workers(2) as workers:
        workers.pool(1)
        workers.submit(import_figures).result()
        shared = workers.map(draw_figure, drawings)
        assert not workers.started  # the figures were their last job
    assert len(drawings) >= 4 and shared == html.draw(drawings)
    assert html.render(tmp_path / "out", lambda ds: shared) == here


def test_a_signal_during_a_submit_is_handled_once_the_submit_returns():
    """A SIGTERM in the middle of starting a worker would leave a half-started child nobody can see (and
    stopping the resource tracker would then hang): its handler runs when the submit has returned."""
    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted(signum)

    submitted = []

    # Sent to the process by a thread made before the submit, as a native (polars) thread would take it:
    # blocking the signal in the submitting thread alone does not keep the handler out.
    go, sent = threading.Event(), threading.Event()
    sender = threading.Thread(target=lambda: (go.wait(), os.kill(os.getpid(), signal.SIGTERM), sent.set()))
    sender.start()

    class Pool:
        def submit(self, function, *args):
            go.set()  # arrives while the child is starting
            sent.wait()
            for _ in range(1000):  # bytecodes at which a handler could run
                time.sleep(0)
            submitted.append(function)
            return "future"

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(Interrupted):
            workers_module._submit(Pool(), print)
        assert submitted == [print]  # the submit finished before the handler ran
        assert signal.getsignal(signal.SIGTERM) is handler  # and the process's own handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)
        sender.join()


def test_the_json_a_gzip_trace_holds_is_read_from_its_trailer(tmp_path):
    import gzip

    text = b'{"traceEvents": [' + b",".join([b'{"ph": "X", "ts": 1, "dur": 1}'] * 5000) + b"]}"
    whole = tmp_path / "rank0.json.gz"
    whole.write_bytes(gzip.compress(text))
    size = whole.stat().st_size
    assert workers_module.estimated_json_bytes(str(whole), size) == len(text)  # 30x: the ratio would say 10x
    cut = tmp_path / "cut.json.gz"  # cut short: its last 4 bytes are deflate data, not the size
    cut.write_bytes(whole.read_bytes()[: size // 2] + b"\x00\x00\x00\x00")
    assert workers_module.estimated_json_bytes(str(cut), cut.stat().st_size) == cut.stat().st_size * workers_module.GZIP_RATIO
    plain = tmp_path / "rank1.json"
    plain.write_bytes(text)
    assert workers_module.estimated_json_bytes(str(plain), len(text)) == len(text)
    assert workers_module.estimated_json_bytes("s3://bucket/rank0.json.gz", 100) == 100 * workers_module.GZIP_RATIO


# Either script ({script}: main or steplens_main), cut short after its set-up; a probe's lines follow.
SCRIPT_SET_UP = """import os, sys
from steplens.analyze import cli_rerun
cli_rerun.exit_without_teardown = lambda entry: entry()
sys.argv = [sys.argv[0], '--help']
try:
    cli_rerun.{script}()
except SystemExit:
    pass
"""


def _probe(probe: str, script: str, variable: str | None = None, users: str | None = None) -> str:
    """The last line `probe` prints after `script`'s set-up, run with the user's `variable` set to `users` (None:
    unset)."""
    env = {k: v for k, v in os.environ.items() if k != variable}
    if users is not None:
        env[variable] = users
    done = subprocess.run([sys.executable, "-c", probe.format(script=script)], env=env, capture_output=True,
                          text=True, check=True)
    return done.stdout.splitlines()[-1]


# What polars' allocator is told.
ALLOCATOR_PROBE = SCRIPT_SET_UP + "print(os.environ.get('_RJEM_MALLOC_CONF'))\n"


@pytest.mark.parametrize("script", ["main", "steplens_main"])
@pytest.mark.parametrize("users", [None, "dirty_decay_ms:5000"])
def test_the_scripts_have_polars_return_freed_pages_unless_the_user_configured_its_allocator(script, users):
    told = _probe(ALLOCATOR_PROBE, script, "_RJEM_MALLOC_CONF", users)
    # polars puts its own defaults first; jemalloc takes the last value of each setting
    assert told.endswith("," + (users or workers_module.POLARS_ALLOCATOR_CONF))


def test_a_library_user_process_that_loaded_polars_is_left_as_it_is(monkeypatch):
    import polars  # noqa: F401 - loaded, as in any process that imports steplens as a library

    monkeypatch.delenv("_RJEM_MALLOC_CONF", raising=False)
    workers_module.return_polars_freed_pages()
    assert "_RJEM_MALLOC_CONF" not in os.environ


# What numpy's OpenBLAS is told, and the threads importing numpy starts.
BLAS_PROBE = SCRIPT_SET_UP + """before = len(os.listdir('/proc/self/task'))
import numpy
print(os.environ.get('OPENBLAS_NUM_THREADS'), len(os.listdir('/proc/self/task')) - before)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
@pytest.mark.parametrize("script", ["main", "steplens_main"])
@pytest.mark.parametrize("users", [None, "2"])
def test_the_scripts_run_blas_on_one_thread_unless_the_user_said_otherwise(script, users):
    told, started = _probe(BLAS_PROBE, script, "OPENBLAS_NUM_THREADS", users).split()
    assert told == (users or workers_module.BLAS_THREADS)
    if users is None:
        assert started == "0"  # numpy's import started no BLAS thread beside this one


def test_a_library_user_process_that_loaded_numpy_keeps_its_blas_threads(monkeypatch):
    import numpy  # noqa: F401 - loaded, as in any process that imports steplens as a library

    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    workers_module.one_blas_thread()
    assert "OPENBLAS_NUM_THREADS" not in os.environ


# The garbage collector's thresholds after the set-up.
GC_PROBE = SCRIPT_SET_UP + "import gc\nprint(*gc.get_threshold())\n"


@pytest.mark.parametrize("script", ["main", "steplens_main"])
def test_the_scripts_and_their_workers_collect_garbage_less_often(script):
    import gc

    told = tuple(int(n) for n in _probe(GC_PROBE, script).split())
    assert told == workers_module.GC_THRESHOLDS and told[0] > gc.get_threshold()[0]
    with workers_module.Workers(2) as spare:
        spare.pool(1)
        assert spare.submit(gc.get_threshold).result(timeout=120) == workers_module.GC_THRESHOLDS


# The collector's passes once polars is imported (during the heavy imports, then the help text), whether the
# collector runs after the set-up, and the objects frozen.
IMPORT_GC_PROBE = """import gc, sys
passes = []
gc.callbacks.append(lambda phase, info: phase == 'start' and 'polars' in sys.modules and passes.append(1))
""" + SCRIPT_SET_UP + """print(len(passes), gc.isenabled(), gc.get_freeze_count())
"""


def _worker_collector() -> tuple[bool, int]:
    import gc

    return gc.isenabled(), gc.get_freeze_count()


@pytest.mark.parametrize("script", ["main", "steplens_main"])
def test_the_scripts_and_their_workers_import_without_collector_passes_and_freeze_what_they_imported(script):
    passes, enabled, frozen = _probe(IMPORT_GC_PROBE, script).split()
    # importing polars, pyarrow, numpy, rich and click made ~8 passes at the tuned thresholds
    assert int(passes) <= 1 and enabled == "True" and int(frozen) > 50_000
    with workers_module.Workers(2) as spare:
        spare.pool(1)
        enabled, frozen = spare.submit(_worker_collector).result(timeout=120)
        assert enabled and frozen > 50_000  # polars, pyarrow and the parser


def test_a_library_user_process_keeps_its_garbage_collector_as_it_is():
    import gc

    from steplens.analyze.analyses import runner  # noqa: F401 - steplens imported as a library

    assert gc.get_threshold() != workers_module.GC_THRESHOLDS
    frozen = gc.get_freeze_count()
    with workers_module.imports_without_collections():
        assert gc.isenabled()
    assert gc.get_freeze_count() == frozen


def test_analyses_of_a_reused_parse_start_workers_when_worth_it_and_give_the_same_tables(tmp_path, monkeypatch):
    """`analyze` again with another option parses nothing, so no worker was up and a large run's per-rank analyses
    ran in this process alone: they start workers of their own from ANALYSIS_WORKER_WORTH_EVENTS trace events (here
    lowered to one, and a batch a rank), with the same tables as one process gives, and leave no process behind."""
    import polars as pl
    from click.testing import CliRunner

    from synthetic import generate_run

    run = tmp_path / "run"
    generate_run(run, ranks=4, steps=3, seed=5)
    assert CliRunner().invoke(cli.analyze, [str(run), "-q", "--jobs", "2"]).exit_code in (0, 1)

    def tables() -> dict:
        out = run / ".steplens"
        return {name: pl.read_parquet(out / name).sort(pl.all()) for name in ("kernel_launches", "op_perf", "gpu_idle")}

    from steplens.analyze.analyses import runner

    monkeypatch.setattr(runner, "RANK_BATCH_EVENTS", 1)  # a batch a rank, as large ranks are
    started = []
    pool = Workers.pool
    monkeypatch.setattr(Workers, "pool", lambda self, wanted: started.append(wanted) or pool(self, wanted))
    assert CliRunner().invoke(cli.analyze, [str(run), "-q", "--jobs", "2", "--peak-tflops", "100"]).exit_code in (0, 1)
    alone = tables()
    assert started == []  # 4 small ranks: not worth a worker
    before = python_children()
    monkeypatch.setattr(workers_module, "ANALYSIS_WORKER_WORTH_EVENTS", 1)
    assert CliRunner().invoke(cli.analyze, [str(run), "-q", "--jobs", "2", "--peak-tflops", "200"]).exit_code in (0, 1)
    assert started == [3]  # a worker for each batch but the one this process takes (Workers caps it at jobs - 1)
    shared = tables()
    assert all(shared[name].equals(alone[name]) for name in alone)
    assert python_children() <= before
