"""`analyze --scheduler`: a generated run parsed on a real Dask cluster (a scheduler and two worker
processes on loopback) gives exactly the tables of the single-process run; a worker killed mid-task
costs nothing (the task is retried) or, when every try dies, that one file, reported; the default path
never imports Dask."""

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from steplens.analyze.contract import schema
from synthetic import generate_run

distributed = pytest.importorskip("distributed")

ANALYZE = [sys.executable, "-m", "steplens.analyze"]
RANKS = 16


def output_tables(out: Path) -> dict[str, pl.DataFrame]:
    """Every table of an output folder (a folder of Parquet parts), rows sorted on every column."""
    tables = {}
    for folder in sorted(p for p in Path(out).iterdir() if p.is_dir()):
        parts = sorted(folder.rglob("*.parquet"))
        if not parts:
            continue
        frame = pl.concat([pl.read_parquet(p, hive_partitioning=False).with_columns(
            **({"rank": pl.lit(int(p.parent.name.split("=")[1]))} if p.parent.name.startswith("rank=") else {}))
            for p in parts], how="diagonal_relaxed")
        tables[folder.name] = frame.sort(frame.columns, nulls_last=True)
    return tables


def assert_same_tables(expected: dict[str, pl.DataFrame], got: dict[str, pl.DataFrame]) -> None:
    assert sorted(got) == sorted(expected)
    differing = [name for name in expected if not got[name].equals(expected[name])]
    assert differing == []


def analyze(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*ANALYZE, *map(str, args), "-q"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """A 16-rank generated run and its single-process analysis (the reference)."""
    run = tmp_path_factory.mktemp("cluster") / "run16"
    generate_run(run, ranks=RANKS, steps=3, kernels_per_step=20, seed=3)
    reference = run.parent / "single"
    done = analyze(run, "--out", reference, "-j", "1")
    assert done.returncode == 0, done.stderr
    return run, output_tables(reference)


@pytest.fixture
def cluster():
    """A real scheduler and two worker processes (one thread each) on loopback."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=None) as local:
        with distributed.Client(local.scheduler_address) as client:
            yield local.scheduler_address, client


def _traces(run: Path) -> set[str]:
    return {p.name for p in run.glob("rank-*.pt.trace.json.gz")}


def test_cluster_run_gives_the_single_process_tables(generated, cluster, tmp_path):
    run, reference = generated
    address, client = cluster
    done = analyze(run, "--out", tmp_path / "out", "--scheduler", address)
    assert done.returncode == 0, done.stderr
    assert_same_tables(reference, output_tables(tmp_path / "out"))
    # One INFO line per file on the worker that parsed it; both workers took part.
    logged = {worker: [message for _, message in records if "steplens: parsing" in message]
              for worker, records in client.get_worker_logs().items()}
    files = [line.split("steplens: parsing ", 1)[1].split(" ", 1)[0] for lines in logged.values() for line in lines]
    assert sorted(files) == sorted(_traces(run) | {"truth.json"})
    assert all(logged.values()) and len(logged) == 2
    # The per-rank analyses ran as tasks too, one line per batch of ranks, every rank in one.
    analysed = [message.split("steplens: analysing ranks ", 1)[1].split(" ", 1)[0]
                for records in client.get_worker_logs().values() for _, message in records if "analysing ranks" in message]
    assert sorted(int(rank) for batch in analysed for rank in batch.split("-")) == list(range(RANKS))
    assert not list(tmp_path.glob(".out.*"))  # no staging folder left


class KillOnParse(distributed.WorkerPlugin):
    """Kills the worker process (as the OOM killer would) when it starts parsing `file`: once when
    `marker` is given (the marker file records that it happened), else every time."""

    def __init__(self, file: str, marker: str | None = None):
        self.file, self.marker = file, marker

    def transition(self, key, start, finish, **kwargs):
        if finish != "executing" or f"steplens-parse-{self.file}-" not in str(key):
            return
        if self.marker is not None:
            if os.path.exists(self.marker):
                return
            Path(self.marker).write_text(str(os.getpid()))
        os._exit(9)


def test_worker_killed_mid_task_is_retried_and_the_result_is_unchanged(generated, cluster, tmp_path):
    run, reference = generated
    address, client = cluster
    marker = tmp_path / "killed"
    client.register_plugin(KillOnParse("rank-5.pt.trace.json.gz", str(marker)))
    done = analyze(run, "--out", tmp_path / "out", "--scheduler", address)
    assert marker.exists()  # a worker did die parsing rank 5
    assert done.returncode == 0, done.stderr
    assert_same_tables(reference, output_tables(tmp_path / "out"))


def test_a_file_whose_worker_dies_every_time_is_reported_and_the_rest_published(generated, tmp_path):
    run, reference = generated
    import dask

    # Give up on a task after one death (the default, 3, only makes the test slower), and hand each worker
    # one task at a time (the default saturation queues a second, which would die with the first).
    with dask.config.set({"distributed.scheduler.allowed-failures": 0, "distributed.scheduler.worker-saturation": 1.0}):
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                      dashboard_address=None) as local, distributed.Client(local.scheduler_address) as client:
            client.register_plugin(KillOnParse("rank-3.pt.trace.json.gz"))
            done = analyze(run, "--out", tmp_path / "out", "--scheduler", local.scheduler_address)
    assert done.returncode == 1, done.stderr  # partial: one input lost
    manifest = json.loads((tmp_path / "out" / schema.MANIFEST_FILE).read_text())
    assert manifest["trace_ranks"] == [r for r in range(RANKS) if r != 3]
    got = output_tables(tmp_path / "out")
    issues = got["ingest_issues"].filter(pl.col("reason") == "worker_lost")
    assert issues["file"].to_list() == ["rank-3.pt.trace.json.gz"] and issues["severity"].to_list() == ["error"]
    # Every other rank's rows are exactly the single-process run's.
    for table in ("trace_events", "flows", "steps"):
        assert got[table].equals(reference[table].filter(pl.col("rank") != 3)), table
    assert not list(tmp_path.glob(".out.*"))


def test_unreachable_scheduler_is_one_line_naming_it(generated, tmp_path):
    run, _ = generated
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = analyze(run, "--out", tmp_path / "out", "--scheduler", f"tcp://127.0.0.1:{port}")
    assert done.returncode == 2
    assert f"cannot reach the Dask scheduler at tcp://127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("service", ["silent", "http"])
def test_a_service_that_is_not_a_scheduler_is_one_line_naming_it(generated, tmp_path, service):
    """A port that accepts and never answers (it once held analyze forever), and one that answers HTTP (read as
    Dask frames, it once asked for 3 EiB): exit 2 within the connect timeout and its margin."""
    import socket
    import threading
    import time

    run, _ = generated
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            if service == "http":
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\nBad Request")

    threading.Thread(target=serve, daemon=True).start()
    started = time.monotonic()
    try:
        done = analyze(run, "--out", tmp_path / "out", "--scheduler", f"tcp://127.0.0.1:{port}")
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
    assert done.returncode == 2, done.stderr
    assert f"cannot reach the Dask scheduler at tcp://127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()
    assert time.monotonic() - started < 60


def test_default_analyze_never_imports_dask(generated, tmp_path):
    run, _ = generated
    script = (
        "import sys\n"
        "from steplens.analyze import cli\n"
        f"sys.argv = ['analyze', {str(run)!r}, '--out', {str(tmp_path / 'out')!r}, '-q']\n"
        "try:\n"
        "    cli.analyze_entry()\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'dask', 'distributed', 'fsspec', 's3fs', 'gcsfs'}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines()[-2:] == ["exit 0", "[]"], done.stderr
