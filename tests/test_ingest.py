"""The run-directory contract, incremental and atomic ingest, rank rules, and the CLI."""

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import polars as pl
import psutil
import pytest
from click.testing import CliRunner

from steplens.analyze import analyses
from steplens.analyze.pipeline import ingest as ingest_module
from steplens.analyze.pipeline import workers as workers_module
from steplens.analyze.contract import schema
from steplens.analyze.cli import EXIT_NOTHING, EXIT_PARTIAL, analyze, steplens
from steplens.analyze.pipeline.ingest import ingest

from conftest import write_trace


def _trace(rank, n_kernels=2, world=2):
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 10 + rank, "tid": 1, "ts": 0, "dur": 100}]
    for i in range(n_kernels):
        events += [
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 10 + rank, "tid": 1, "ts": 10 + i, "dur": 1, "args": {"correlation": i + 1}},
            {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 20 + i, "dur": 1, "args": {"correlation": i + 1, "stream": 7}},
        ]
    return events, {"distributedInfo": {"rank": rank, "world_size": world, "backend": "nccl"}}


@pytest.fixture
def run_dir(tmp_path):
    for rank in (0, 1):
        events, top = _trace(rank, n_kernels=2 + rank)
        write_trace(tmp_path / "run" / f"host_{rank}.pt.trace.json.gz", events, gz=True, **top)
    (tmp_path / "run" / "ds_config.json").write_text('{"train_batch_size": 8}')
    return tmp_path / "run"


def test_run_directory_contract(run_dir):
    result = ingest(run_dir, jobs=1)
    out = run_dir / schema.DEFAULT_OUT_DIR
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["schema_version"] == schema.SCHEMA_VERSION
    assert manifest["ranks"] == [0, 1] and manifest["world_size"] == 2
    by_path = {s["path"]: s for s in manifest["sources"]}
    assert by_path["ds_config.json"]["status"] == "ignored"
    assert by_path["host_1.pt.trace.json.gz"]["hash_prefix"] and by_path["host_1.pt.trace.json.gz"]["rank"] == 1
    assert manifest["environment"]["backend"] == ["nccl"]
    # DuckDB and polars read all ranks as one table, rank from the hive path.
    counts = duckdb.sql(
        f"SELECT rank, count(*) FROM read_parquet('{out}/trace_events/*/*.parquet', hive_partitioning=true) "
        "WHERE kind = 'kernel' GROUP BY rank ORDER BY rank").fetchall()
    assert counts == [(0, 2), (1, 3)]
    frame = pl.scan_parquet(out / "steps").collect()
    assert sorted(frame["rank"].to_list()) == [0, 1]
    for table, (table_schema, docs, partitioned) in schema.TABLES.items():
        files = list((out / table).rglob("*.parquet"))
        assert files, table
        assert all(("rank=" in str(f.parent.name)) == partitioned for f in files)
        assert set(docs) == set(table_schema.names)
    issues = pl.read_parquet(out / "ingest_issues" / "*.parquet")
    assert issues.filter(pl.col("reason") == "not_a_trace")["file"].to_list() == ["ds_config.json"]
    assert result.failed == []


def test_inputs_are_never_modified(run_dir):
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run_dir.iterdir() if p.is_file()}
    ingest(run_dir, jobs=1)
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run_dir.iterdir() if p.is_file()} == before


def test_incremental_ingest_parses_only_changed_files(run_dir):
    first = ingest(run_dir, jobs=1)
    assert (first.parsed, first.reused) == (3, 0)
    second = ingest(run_dir, jobs=1)
    assert (second.parsed, second.reused) == (1, 2)  # ds_config.json is looked at again, the traces are not
    events, top = _trace(1, n_kernels=5)
    write_trace(run_dir / "host_1.pt.trace.json.gz", events, gz=True, **top)
    third = ingest(run_dir, jobs=1)
    assert third.reused == 1
    kernels = pl.scan_parquet(run_dir / ".steplens" / "trace_events").filter(pl.col("kind") == "kernel").collect()
    assert kernels.group_by("rank").len().sort("rank").rows() == [(0, 2), (1, 5)]


def test_killed_ingest_leaves_previous_result(run_dir, monkeypatch):
    ingest(run_dir, jobs=1)
    out = run_dir / ".steplens"
    before = (out / "run.json").read_text()
    events, top = _trace(0, n_kernels=9)
    write_trace(run_dir / "host_0.pt.trace.json.gz", events, gz=True, **top)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ingest_module, "_swap_in", killed)
    with pytest.raises(KeyboardInterrupt):
        ingest(run_dir, jobs=1)
    assert (out / "run.json").read_text() == before
    assert pl.scan_parquet(out / "trace_events").collect().height > 0
    # Killed between the two renames of the swap: the next run restores and goes on.
    monkeypatch.undo()
    out.rename(run_dir / ".steplens.old-999999")
    (run_dir / ".steplens.old-999999").rename(run_dir / "..steplens.old-999999")
    result = ingest(run_dir, jobs=1)
    assert result.reused == 1 and not (run_dir / "..steplens.old-999999").exists()


def test_parallel_ingest_matches_serial(run_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(workers_module, "WORKER_WORTH_BYTES", 0)  # small inputs would stay in-process
    serial = ingest(run_dir, tmp_path / "a", jobs=1)
    parallel = ingest(run_dir, tmp_path / "b", jobs=2)
    a = pl.scan_parquet(tmp_path / "a" / "trace_events").collect().sort("rank", "event_id")
    b = pl.scan_parquet(tmp_path / "b" / "trace_events").collect().sort("rank", "event_id")
    assert a.equals(b) and serial.manifest["ranks"] == parallel.manifest["ranks"]


def test_a_run_too_small_for_workers_is_parsed_on_threads_into_the_same_tables(run_dir, tmp_path, monkeypatch):
    """Below the worker threshold the files are parsed on threads of this process, several at once; the run
    directory is the same as parsing them one after the other, and no worker process is started."""
    original, active, most = ingest_module._parse_source, [0], [0]
    lock = threading.Lock()

    def counted(*args):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.2)  # both files in flight at once, however fast the parse
        try:
            return original(*args)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(ingest_module, "_parse_source", counted)
    services = {child.pid for child in psutil.Process().children()}  # the session's own (a pushgateway)
    threaded = ingest(run_dir, tmp_path / "threads", jobs=2)
    assert most[0] == 2 and {child.pid for child in psutil.Process().children()} <= services
    monkeypatch.setattr(ingest_module, "_parse_source", original)
    serial = ingest(run_dir, tmp_path / "serial", jobs=1)
    assert threaded.manifest["ranks"] == serial.manifest["ranks"]
    threaded_tables, serial_tables = _ingested_tables(tmp_path / "threads"), _ingested_tables(tmp_path / "serial")
    assert threaded_tables.keys() == serial_tables.keys()
    assert all(threaded_tables[name].equals(serial_tables[name]) for name in serial_tables)


def test_a_failed_threaded_parse_waits_for_the_files_in_flight(run_dir, tmp_path, monkeypatch):
    """An error (or Ctrl-C) while files are parsed on threads cancels the files not started and returns only
    once the ones in flight are done: none writes into the staging folder after it is removed."""
    original, started, finished = ingest_module._parse_source, [], []
    events, top = _trace(0, n_kernels=50)  # the largest file, parsed first: it fails
    write_trace(run_dir / "host_0.pt.trace.json.gz", events, gz=True, **top)
    for rank in range(2, 8):
        events, top = _trace(rank, world=8)
        write_trace(run_dir / f"host_{rank}.pt.trace.json.gz", events, gz=True, **top)

    def first_fails(path, source, scratch):
        started.append(source.path)
        if source.path.startswith("host_0"):
            raise KeyboardInterrupt
        time.sleep(0.3)
        result = original(path, source, scratch)
        finished.append(source.path)
        return result

    monkeypatch.setattr(ingest_module, "_parse_source", first_fails)
    with pytest.raises(KeyboardInterrupt):
        ingest(run_dir, tmp_path / "out", jobs=2)
    assert sorted(finished) == sorted(started[1:])  # every file started beside the failed one ran to its end
    assert len(started) < 9  # the files still queued were never started
    time.sleep(0.5)  # nothing left running writes afterwards
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert [p.name for p in tmp_path.iterdir() if p.name != "run"] in ([], ["out"])


def _ingested_tables(out: Path) -> dict[str, pl.DataFrame]:
    tables = {}
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        frame = pl.read_parquet(folder / "**" / "*.parquet")
        tables[folder.name] = frame.select(sorted(frame.columns)).sort(sorted(frame.columns), nulls_last=True)
    return tables


def test_rank_rules(tmp_path):
    events, _ = _trace(0)
    write_trace(tmp_path / "a" / "trace_rank-5.json", events)
    result = ingest(tmp_path / "a", jobs=1)
    assert result.manifest["ranks"] == [5]
    assert [i[1] for i in result.sources[0].issues] == ["rank_from_filename"]

    write_trace(tmp_path / "b" / "only.json", events)
    result = ingest(tmp_path / "b", jobs=1)
    assert result.manifest["ranks"] == [0] and result.sources[0].issues[0][1] == "rank_assumed"

    events1, top1 = _trace(1)
    write_trace(tmp_path / "c" / "good.json", events1, **top1)
    write_trace(tmp_path / "c" / "anonymous.json", events)
    result = ingest(tmp_path / "c", jobs=1)
    bad = [s for s in result.sources if s.status == "error"]
    assert [s.path for s in bad] == ["anonymous.json"] and "rank" in bad[0].issues[0][3]
    assert result.manifest["ranks"] == [1]


def test_cli_summary_and_exit_codes(run_dir, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(analyze, [str(run_dir), "--out", str(tmp_path / "o1")])
    assert ok.exit_code == 0, ok.output
    assert "ranks: 0-1 of world size 2" in ok.output
    assert "kernel" in ok.output and "not_a_trace" in ok.output

    (run_dir / "empty.pt.trace.json").write_bytes(b"")
    partial = runner.invoke(steplens, ["analyze", str(run_dir), "--out", str(tmp_path / "o2")])
    assert partial.exit_code == EXIT_PARTIAL
    assert "empty_file" in partial.output and "empty.pt.trace.json" in partial.output
    assert (tmp_path / "o2" / "run.json").exists()

    (tmp_path / "nothing").mkdir()
    none = runner.invoke(analyze, [str(tmp_path / "nothing")])
    assert none.exit_code == EXIT_NOTHING
    # one message: its first line, and the lines it wraps onto indented under it
    assert none.output.startswith("error: ") and all(line.startswith("  ") for line in none.output.splitlines()[1:])
    assert "nothing steplens reads here" in " ".join(none.output.split())
    assert "Traceback" not in none.output

    only_empty = tmp_path / "only_empty"
    only_empty.mkdir()
    (only_empty / "rank0.json").write_bytes(b"")
    result = runner.invoke(analyze, [str(only_empty)])
    assert result.exit_code == EXIT_NOTHING and "empty file" in result.output

    assert "DuckDB" in runner.invoke(analyze, ["--help"]).output


def test_analyzer_runs_without_torch(run_dir, tmp_path):
    """The whole analyze command (ingest, analyses, report) loads neither torch nor deepspeed, though
    both are installed here: nothing on the analyzer's path imports them."""
    code = (
        "import sys\n"
        "from steplens.analyze.cli import _guarded, analyze\n"
        "try:\n"
        f"    _guarded(analyze, [{str(run_dir)!r}, '--out', {str(tmp_path / 'o')!r}, '-q'])\n"
        "finally:\n"
        "    loaded = [m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed')]\n"
        "    assert not loaded, loaded[:5]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "o" / "report.html").exists()


def test_python_dash_m_entry_point(run_dir, tmp_path):
    done = subprocess.run([sys.executable, "-m", "steplens.analyze", str(run_dir), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "2 trace file(s)" in done.stdout
    quiet = subprocess.run([sys.executable, "-m", "steplens.analyze", str(run_dir), "--out", str(tmp_path / "o"), "-q"],
                           capture_output=True, text=True)
    assert quiet.returncode == 0, quiet.stderr
    assert "trace file(s)" not in quiet.stdout and "findings" in quiet.stdout  # -q: the findings only


def test_readme_documents_every_column():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for table, (table_schema, _, _) in schema.TABLES.items():
        assert f"**`{table}`**" in readme
        for column in table_schema.names:
            assert f"`{column}`" in readme, (table, column)


def test_readme_documents_every_analysis_table():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for table, (_, columns) in analyses.TABLES.items():
        line = next(l for l in readme.splitlines() if l.startswith(f"- **`{table}`**"))
        assert all(f"`{c}`" in line for c in columns), table


@pytest.mark.parametrize("fingerprint", ["schema_fingerprint", "parse_fingerprint"])
def test_parts_from_another_table_layout_or_parser_are_not_reused(run_dir, fingerprint):
    """Parts written under another layout, or by another parser (a steplens whose importers changed: the
    same columns, other values), are parsed again; with both the same they are reused."""
    ingest(run_dir, jobs=1)
    assert ingest(run_dir, jobs=1).reused >= 2  # the traces
    manifest_path = run_dir / ".steplens" / "run.json"
    manifest = json.loads(manifest_path.read_text())
    manifest[fingerprint] = "written-by-an-older-steplens"
    manifest_path.write_text(json.dumps(manifest))
    again = ingest(run_dir, jobs=1)
    assert again.reused == 0 and again.parsed == 3


def test_readme_python_examples_run(tmp_path):
    """The README's Python snippets, run as written against a copy of the bundled sample."""
    import re
    import shutil

    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "sample_runs", tmp_path / "sample_runs", ignore=shutil.ignore_patterns(".steplens"))
    assert CliRunner().invoke(analyze, [str(tmp_path / "sample_runs" / "synthetic_8rank"), "-q"]).exit_code == 0
    # Blocks fenced `python in-job` run inside a DeepSpeed job; test_collect.py makes the same calls.
    blocks = re.findall(r"```python\n(.*?)```", (root / "README.md").read_text(), re.S)
    assert len(blocks) >= 3
    for block in blocks:
        done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, (block, done.stderr)
        assert done.stdout.strip()


def test_per_rank_analyses_on_workers_match_this_process(tmp_path, monkeypatch):
    """The parse's workers also run the per-rank analyses: every table and finding is what one process
    computes, and no worker outlives `analyze`."""
    from conftest import python_children
    from synthetic import generate_run

    run = tmp_path / "run"
    generate_run(run, ranks=4, steps=3, kernels_per_step=20, seed=3, write_truth=False)
    before = python_children()
    one = CliRunner().invoke(analyze, [str(run), "--out", str(tmp_path / "one"), "--jobs", "1", "--quiet"])
    monkeypatch.setattr(workers_module, "WORKER_WORTH_BYTES", 0)  # small inputs would stay in this process
    many = CliRunner().invoke(analyze, [str(run), "--out", str(tmp_path / "many"), "--jobs", "3", "--quiet"])
    assert one.exit_code == many.exit_code == 0, (one.output, many.output)
    assert python_children() <= before
    tables = sorted(p.name for p in (tmp_path / "one").iterdir() if p.is_dir())
    assert tables == sorted(p.name for p in (tmp_path / "many").iterdir() if p.is_dir())
    for table in tables:
        a, b = (pl.read_parquet(tmp_path / side / table / "**" / "*.parquet") for side in ("one", "many"))
        key = [c for c, t in a.schema.items() if t != pl.Object]
        assert a.sort(key, nulls_last=True).equals(b.select(a.columns).sort(key, nulls_last=True)), table
    timing = ("analysis_seconds", "report_seconds")
    findings = [{k: v for k, v in json.loads((tmp_path / side / "findings.json").read_text()).items() if k not in timing}
                for side in ("one", "many")]
    assert findings[0] == findings[1]


def test_analyze_script_runs_without_importing_pandas(run_dir, tmp_path):
    """pyarrow's first conversion of Python objects imports pandas (half a second per process) to ask
    whether they are pandas objects; the analyze script tells it pandas is absent, and pandas itself
    stays importable afterwards."""
    script = (
        "import sys\n"
        "from steplens.analyze import cli\n"
        f"sys.argv = ['analyze', {str(run_dir)!r}, '--out', {str(tmp_path / 'out')!r}, '-q']\n"
        "try:\n"
        "    cli.analyze_entry()\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code)\n"
        "print('pandas' in sys.modules)\n"
        "import pandas, pyarrow\n"
        "print(pyarrow.array(['a', None]).to_pylist())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines()[-3:] == ["exit 0", "False", "['a', None]"], done.stderr
    # `python -m steplens.analyze` too (it imported pandas)
    as_module = subprocess.run([sys.executable, "-X", "importtime", "-m", "steplens.analyze", str(run_dir), "--out",
                                str(tmp_path / "out2"), "-q"], capture_output=True, text=True, timeout=300)
    assert as_module.returncode == 0 and not re.search(r"\| +pandas\.", as_module.stderr), as_module.stderr[-2000:]


def _tables_and_findings(out: Path) -> tuple[dict, dict]:
    timing = ("analysis_seconds", "report_seconds")
    tables = {}
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        frame = pl.read_parquet(folder / "**" / "*.parquet")
        key = [c for c, t in frame.schema.items() if t != pl.Object]
        tables[folder.name] = frame.select(sorted(frame.columns)).sort(key, nulls_last=True)
    findings = {k: v for k, v in json.loads((out / "findings.json").read_text()).items() if k not in timing}
    return tables, findings


@pytest.mark.parametrize("which", ["dlrm_kineto", "synthetic"])
def test_batched_per_rank_analyses_match_one_rank_at_a_time(which, corpus, tmp_path, monkeypatch):
    """Small ranks share one run of the per-rank analyses (runner.batches); every table and finding is
    what running them one rank at a time gives: on 8 real V100 ranks and on a generated 4-rank run."""
    from steplens.analyze.analyses import runner

    if which == "synthetic":
        from synthetic import generate_run

        run = tmp_path / "run"
        generate_run(run, ranks=4, steps=3, kernels_per_step=20, seed=5, write_truth=False)
    else:
        run = corpus / "param" / "dlrm_kineto"
    batched = CliRunner().invoke(analyze, [str(run), "--out", str(tmp_path / "batched"), "--jobs", "1", "--quiet"])
    manifest = json.loads((tmp_path / "batched" / schema.MANIFEST_FILE).read_text())
    assert len(runner.batches(manifest, manifest["trace_ranks"])) == 1 < len(manifest["trace_ranks"])
    monkeypatch.setattr(runner, "RANK_BATCH_EVENTS", 0)  # every rank alone
    assert len(runner.batches(manifest, manifest["trace_ranks"])) == len(manifest["trace_ranks"])
    alone = CliRunner().invoke(analyze, [str(run), "--out", str(tmp_path / "alone"), "--jobs", "1", "--quiet"])
    assert batched.exit_code == alone.exit_code, (batched.output, alone.output)
    (tables_b, findings_b), (tables_a, findings_a) = (_tables_and_findings(tmp_path / side) for side in ("batched", "alone"))
    assert tables_b.keys() == tables_a.keys()
    for table in tables_b:
        assert tables_b[table].equals(tables_a[table]), table
    assert findings_b == findings_a


def test_rank_batches_hold_at_most_the_limit_or_one_rank():
    from steplens.analyze.analyses import runner

    manifest = {"sources": [{"rank": 0, "events": 60}, {"rank": 1, "events": 30}, {"rank": 1, "events": 20},
                            {"rank": 2, "events": 500}, {"rank": 3, "events": 10}, {"rank": 4, "events": 90},
                            {"rank": None, "events": 10**9}]}
    assert runner.batches(manifest, [0, 1, 2, 3, 4], limit=100) == [(0,), (1,), (2,), (3, 4)]
    assert runner.batches(manifest, [0, 1, 2, 3, 4], limit=109) == [(0,), (1,), (2,), (3, 4)]
    assert runner.batches(manifest, [0, 1, 2, 3, 4], limit=110) == [(0, 1), (2,), (3, 4)]
    assert runner.batches(manifest, [0, 1, 2, 3, 4], limit=0) == [(0,), (1,), (2,), (3,), (4,)]
    assert runner.batches({"sources": []}, [5, 7], limit=0) == [(5,), (7,)]


def test_a_panic_in_the_trace_parser_costs_its_file_only(run_dir, monkeypatch):
    """A Rust panic in polars or pyarrow reaches Python as pyo3's PanicException, a BaseException that
    `except Exception` lets through: it once ended the whole analyze with a traceback."""
    from steplens.analyze.importers import kineto

    decode = kineto.decode

    def panicking(path):
        if "host_1" in path.name:
            raise pl.exceptions.PanicException("called `Result::unwrap()` on an `Err` value")
        return decode(path)

    monkeypatch.setattr(kineto, "decode", panicking)
    result = ingest(run_dir, jobs=1)
    (failed,) = result.failed
    assert failed.path == "host_1.pt.trace.json.gz"
    assert [(reason, "PanicException" in detail) for _, reason, _, detail in failed.issues] == [("parse_failed", True)]
    assert pl.read_parquet(result.out_dir / "trace_events")["rank"].unique().to_list() == [0]


@pytest.mark.parametrize("failure", [ZeroDivisionError, pl.exceptions.PanicException])
def test_an_internal_error_is_one_line_and_status_5(run_dir, tmp_path, monkeypatch, capsys, failure):
    """A bug in an analysis ends analyze with one line naming it and the documented status, no traceback,
    a Rust panic (a BaseException) included; the inputs are untouched."""
    from steplens.analyze import cli
    from steplens.analyze.cli_render import EXIT_INTERNAL

    def broken(*args, **kwargs):
        raise failure("division by zero in an analysis")

    monkeypatch.setattr(cli.runner, "run", broken)
    monkeypatch.delenv("STEPLENS_DEBUG", raising=False)
    before = sorted((p.name, p.stat().st_size) for p in run_dir.iterdir())
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # _guarded sets its own
    try:
        with pytest.raises(SystemExit) as ended:
            cli._guarded(cli.analyze, [str(run_dir), "--out", str(tmp_path / "out"), "-q", "--jobs", "1"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert ended.value.code == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert f"internal error: {failure.__name__}: division by zero in an analysis" in err and "Traceback" not in err
    assert sorted((p.name, p.stat().st_size) for p in run_dir.iterdir()) == before


def test_a_new_trace_format_is_one_module_and_one_registration_line(tmp_path, monkeypatch):
    """A toy format (one line per event: name start_ns end_ns kind) read through the trace model only: its
    module decodes, its registration names its files, and ingest gives it steps, launch links, the source
    column, the rank from TraceMeta and the device from its facts, as for a Kineto trace."""
    import types

    from steplens.analyze import importers
    from steplens.analyze.contract.traces import DecodedTrace, Device, TraceImporter, TraceMeta

    def decode(path):
        rows = [line.split() for line in path.read_text().splitlines()]
        events = pl.DataFrame({
            "event_id": list(range(len(rows))),
            "name": [r[0] for r in rows], "ts_ns": [int(r[1]) for r in rows], "dur_ns": [int(r[2]) - int(r[1]) for r in rows],
            "kind": [r[3] for r in rows], "ph": ["X"] * len(rows),
            "pid": [0 if r[3] == "kernel" else 100 for r in rows], "tid": [7 if r[3] == "kernel" else 1 for r in rows],
            "correlation": [int(r[4]) if len(r) > 4 else None for r in rows],
            "stream": [7 if r[3] == "kernel" else None for r in rows], "device": [0 if r[3] == "kernel" else None for r in rows],
        }, schema_overrides={"event_id": pl.Int64, "correlation": pl.Int64, "stream": pl.Int64, "device": pl.Int64})
        endpoints = pl.DataFrame(schema={"ph": pl.String, "cat": pl.String, "pid": pl.Int64, "tid": pl.Int64,
                                         "ts_ns": pl.Int64, "flow_id": pl.Int64})
        return DecodedTrace(events, endpoints, TraceMeta(rank=int(path.stem[-1]), world_size=2,
                                                         devices=[Device(name="NVIDIA H100 80GB HBM3", sm_count=132)]))

    toy = types.ModuleType("steplens.analyze.importers.toy")
    toy.claims, toy.decode = (lambda path: True), decode
    monkeypatch.setitem(sys.modules, "steplens.analyze.importers.toy", toy)
    monkeypatch.setattr(importers, "TRACE_IMPORTERS", [*importers.TRACE_IMPORTERS, TraceImporter("toy", names=(".toy",))])
    monkeypatch.setattr(importers, "TRACE_KINDS", importers.TRACE_KINDS | {"toy"})
    run = tmp_path / "run"
    run.mkdir()
    for rank in (0, 1):
        (run / f"job_{rank}.toy").write_text(
            "ProfilerStep#4 1000 9000 user_annotation\ncudaLaunchKernel 2000 2100 cuda_runtime 55\n"
            f"gemm 3000 {5000 + rank * 1000} kernel 55\n")
    result = ingest(run, jobs=1)
    out = run / schema.DEFAULT_OUT_DIR
    manifest = json.loads((out / "run.json").read_text())
    assert sorted((s["path"], s["kind"], s["rank"]) for s in manifest["sources"]) == [("job_0.toy", "toy", 0), ("job_1.toy", "toy", 1)]
    assert all(s["trace_meta"]["device_names"] == ["NVIDIA H100 80GB HBM3"] for s in manifest["sources"])
    events = pl.read_parquet(out / "trace_events", hive_partitioning=True)
    kernels = events.filter(pl.col("kind") == "kernel").sort("rank")
    assert kernels.select("rank", "step", "dur_ns", "source").rows() == [(0, 4, 2000, "job_0.toy"), (1, 4, 3000, "job_1.toy")]
    launches = pl.read_parquet(out / "flows", hive_partitioning=True).filter(pl.col("flow_type") == "launch")
    assert launches.height == 2
    assert result.failed == []


def test_every_table_keeps_min_max_statistics_for_its_non_text_columns_only(run_dir, tmp_path):
    """Ingest's tables and the analyses' alike (schema.text_columns): numbers and times carry Parquet min/max
    bounds for pruning, names and shapes none."""
    import pyarrow.parquet as pq

    done = CliRunner().invoke(analyze, [str(run_dir), "--out", str(tmp_path / "out"), "--jobs", "1", "--quiet"])
    assert done.exit_code == 0, done.output
    for table in ("trace_events", "kernel_launches"):
        part = next((tmp_path / "out" / table).rglob("*.parquet"))
        metadata = pq.ParquetFile(part).metadata
        columns = [metadata.row_group(0).column(i) for i in range(metadata.num_columns)]
        kinds = {c.path_in_schema: c.statistics is not None and c.statistics.has_min_max for c in columns}
        text = {f.name for f in pq.read_schema(part) if str(f.type) in ("string", "large_string")}
        assert text and all(not kinds[name] for name in text), table
        assert {"ts_ns", "dur_ns"} <= {name for name, bounded in kinds.items() if bounded}, table
