"""`steplens sql`: DuckDB views across runs, read-only, with documented examples that run."""

import json
import os
import shutil
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from steplens.analyze import analyses
from steplens.analyze.contract import reuse, schema
from steplens.analyze.query import sql
from steplens.analyze.cli import steplens
from steplens.analyze.pipeline import analyse
from synthetic import generate_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    truths = {}
    for name, ranks, straggler in (("a", 2, (1, 11)), ("b", 3, (2, 12))):
        generate_run(root / name, ranks=ranks, steps=4, seed=ranks, stragglers=[straggler])
        result, _ = analyse(root / name, jobs=1)
        truths[result.manifest["run_id"]] = json.loads((root / name / "truth.json").read_text())
    return root, truths


def test_views_span_runs_and_ranks(runs):
    root, truths = runs
    counts = sql.query(root, "SELECT run_id, rank, count(*) AS kernels FROM trace_events WHERE kind = 'kernel' GROUP BY ALL")
    for run_id, truth in truths.items():
        for rank, info in truth["ranks"].items():
            row = counts.filter((pl.col("run_id") == run_id) & (pl.col("rank") == int(rank)))
            assert row["kernels"].to_list() == [info["event_counts"]["kernel"]]
    listed = sql.query(root, "SELECT run_id, world_size FROM runs ORDER BY world_size")
    assert listed["world_size"].to_list() == [2, 3] and set(listed["run_id"]) == set(truths)


def test_documented_examples_run(runs):
    root, truths = runs
    for title, text in sql.EXAMPLES.items():
        assert isinstance(sql.query(root, text), pl.DataFrame), title
    slowest = sql.query(root, sql.EXAMPLES["slowest step per run"])
    for run_id, truth in truths.items():
        expected = truth["stragglers"][0]
        row = slowest.filter(pl.col("run_id") == run_id).row(0, named=True)
        assert (row["step"], row["straggler_rank"]) == (expected["step"], expected["rank"])


def test_only_select_is_accepted(runs):
    root, _ = runs
    for statement in ("DELETE FROM runs", "COPY (SELECT 1) TO 'x.csv'", "SELECT 1; SELECT 2", "CREATE TABLE t AS SELECT 1",
                      "SELEC 1", "SET enable_external_access = true"):
        with pytest.raises(sql.QueryError):
            sql.query(root, statement)


def test_a_query_reads_nothing_outside_the_runs_folder(runs, tmp_path):
    """read_text, read_csv, glob and the like reach only files under the folder given; the limit cannot be
    lifted from the query; the runs' tables still answer."""
    root, _ = runs
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("not for a query\n")
    for statement in (f"SELECT content FROM read_text('{secret}')", f"SELECT * FROM read_csv('{secret}')",
                      f"SELECT * FROM glob('{secret.parent}/*')", f"SELECT content FROM read_text('{root}/{os.path.relpath(secret, root)}')"):
        with pytest.raises(sql.QueryError):
            sql.query(root, statement)
    inside = sql.query(root, "SELECT count(*) AS runs FROM runs")
    assert inside["runs"][0] == 2


def test_a_result_of_any_size_in_bounded_memory(runs):
    """Ten billion rows: the table shows the first 200 and says so (it once grew to 24 GB); csv streams every row
    a batch at a time, its header once."""
    root, _ = runs
    shown = CliRunner().invoke(steplens, ["sql", str(root), "SELECT * FROM range(10000000000) AS t(n)"])
    assert shown.exit_code == 0 and "│ 199 " in shown.output and "│ 200 " not in shown.output
    assert "the first 200 rows" in " ".join(shown.output.split())
    rows = sql.BATCH_ROWS * 2 + 7
    streamed = CliRunner().invoke(steplens, ["sql", str(root), f"SELECT * FROM range({rows}) AS t(n)", "--format", "csv"])
    lines = streamed.output.splitlines()
    assert lines[0] == "n" and len(lines) == rows + 1 and lines[-1] == str(rows - 1)
    none = CliRunner().invoke(steplens, ["sql", str(root), "SELECT * FROM step_stats WHERE false"])
    assert none.exit_code == 0 and "no rows; columns: run_id, step" in " ".join(none.output.split())


def test_the_table_format_shows_control_characters_as_question_marks(runs):
    root, _ = runs
    shown = CliRunner().invoke(steplens, ["sql", str(root), "SELECT chr(27) || ']0;title' || chr(7) || chr(8238) AS v"])
    assert shown.exit_code == 0 and "?]0;title??" in shown.output
    assert not any(c in shown.output for c in "\x1b\x07\u202e")


def test_the_table_format_shows_a_line_break_inside_a_value_as_backslash_n(runs):
    """Two rows whose first value holds line breaks: two rows on screen, the breaks written \\n (they read as rows of
    their own); json keeps the value exactly."""
    root, _ = runs
    query = "SELECT * FROM (VALUES ('a' || chr(10) || 'b' || chr(13) || chr(10) || 'c', 1), ('x', 2)) t(v, n)"
    table = CliRunner().invoke(steplens, ["sql", str(root), query])
    assert table.exit_code == 0
    body = [line for line in table.output.splitlines() if "┆" in line][3:]  # the rows under the names, dashes and types
    assert [line.split("┆")[0].strip(" │") for line in body] == ["a\\nb\\r\\nc", "x"]
    assert _sql_output(root, query, "json").splitlines()[0] == '{"v":"a\\nb\\r\\nc","n":1}'


def test_the_table_format_keeps_line_breaks_in_lists_structs_and_column_names_on_their_row(runs):
    """A line break inside a list or struct value, or in a column's name, is shown escaped: each row stays one line
    (the value as its repr); other nested values keep their type and NaN; a name that escaped meets another is kept
    apart from it (it was an internal error); a blob inside a struct is shown (it was a panic)."""
    root, _ = runs
    query = ("SELECT ['a' || chr(10) || 'b'] AS l, {'k': 'c' || chr(13) || 'd'} AS s, [1.5, 'nan'::double] AS f, "
             "{'b': 'abc'::blob} AS bl, 1 AS \"two\nlines\", 2 AS \"two\\nlines\" FROM (VALUES (1), (2)) t(n)")
    table = CliRunner().invoke(steplens, ["sql", str(root), query])
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()
    names = [line for line in lines if "two" in line]
    assert len(names) == 1 and "two\\nlines'" in names[0] and "list[f64]" in table.output
    body = [line for line in lines if "┆" in line][3:]
    assert [[cell.strip(" │") for cell in line.split("┆")] for line in body] == [
        ["['a\\nb']", "{'k': 'c\\rd'}", "[1.5, NaN]", '{b"abc"}', "1", "2"]] * 2

def test_cli_formats_and_errors(runs, tmp_path):
    root, truths = runs
    runner = CliRunner()
    csv = runner.invoke(steplens, ["sql", str(root), "SELECT run_id, ranks FROM runs ORDER BY ranks", "--format", "csv"])
    assert csv.exit_code == 0 and csv.output.splitlines()[0] == "run_id,ranks"
    lines = runner.invoke(steplens, ["sql", str(root), "SELECT ranks FROM runs ORDER BY ranks", "--format", "json"]).output
    assert [json.loads(line)["ranks"] for line in lines.splitlines()] == [2, 3]
    bad = runner.invoke(steplens, ["sql", str(root), "SELECT nope FROM runs"])
    assert bad.exit_code == 2 and "nope" in bad.output and "Traceback" not in bad.output
    empty = runner.invoke(steplens, ["sql", str(tmp_path), "SELECT 1"])
    assert empty.exit_code == 2 and "no steplens runs" in " ".join(empty.output.split())
    help_text = runner.invoke(steplens, ["sql", "--help"]).output
    assert all(table in help_text for table in list(schema.TABLES) + list(analyses.TABLES))


def test_runs_view_carries_the_facts_that_group_runs(tmp_path):
    """The collector sample's ZeRO stage, batch size and revision, as its own files state them."""
    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "deepspeed_cpu_2rank"
    shutil.copytree(root / "sample_runs" / "deepspeed_cpu_2rank", run, ignore=shutil.ignore_patterns(".steplens"))
    assert CliRunner().invoke(steplens, ["analyze", str(run), "-q"]).exit_code == 0
    config = json.loads((run / "ds_config.json").read_text())
    manifest = json.loads((run / "collector" / "manifest" / "rank0.json").read_text())
    row = sql.query(tmp_path, "SELECT * FROM runs").row(0, named=True)
    assert row["run_name"] == "deepspeed_cpu_2rank"
    assert row["zero_stage"] == config["zero_optimization"]["stage"]
    # DeepSpeed's definition: micro batch x gradient accumulation x data-parallel ranks
    assert row["train_batch_size"] == (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
                                       * manifest["run"]["world_size"])
    assert row["code_revision"] == manifest["run"]["git"]["commit"]


def _damaged_copy(runs_root: Path, tmp_path: Path, damage: str) -> tuple[Path, str]:
    """A copy of run a's result with one kind of damage; the damaged file's path in it."""
    out = tmp_path / damage / ".steplens"
    shutil.copytree(runs_root / "a" / ".steplens", out)
    part = sorted((out / "trace_events" / "rank=1").glob("*.parquet"))[0]
    name = part.relative_to(out).as_posix()
    if damage == "fifo":
        part.unlink()
        os.mkfifo(part)
    elif damage == "link":
        target = tmp_path / "elsewhere.parquet"
        shutil.copy(part, target)
        part.unlink()
        part.symlink_to(target)
    elif damage == "cut":
        part.write_bytes(part.read_bytes()[:1000])
    elif damage == "missing":
        part.unlink()
    elif damage == "rank_folder":
        shutil.copytree(part.parent, out / "trace_events" / "rank=abc")
        name = "trace_events/rank=abc"
    elif damage in ("run_json_fifo", "run_json_zero"):  # compare once blocked on the FIFO, read /dev/zero to the OOM killer
        (out / "run.json").unlink()
        os.mkfifo(out / "run.json") if damage == "run_json_fifo" else (out / "run.json").symlink_to("/dev/zero")
        name = "run.json is not a plain file"
    elif damage in ("run_json_empty", "other_version"):  # compare took {} for a run and passed its CI gate
        doc = json.loads((out / "run.json").read_text())
        (out / "run.json").write_text("{}" if damage == "run_json_empty" else json.dumps({**doc, "schema_version": 999}))
        name = "not written by steplens analyze" if damage == "run_json_empty" else "result schema 999"
    elif damage == "table_part_removed":  # compare silently lost its top-kernels section
        for removed in (out / "top_kernels").glob("*.parquet"):
            removed.unlink()
        name = "top_kernels/ holds no Parquet file"
    return out, name


@pytest.mark.parametrize("damage", ["fifo", "link", "cut", "missing", "rank_folder", "run_json_fifo", "run_json_zero",
                                    "run_json_empty", "other_version", "table_part_removed"])
def test_a_damaged_result_is_refused_by_name_not_read(runs, tmp_path, damage):
    """A result with a FIFO where a part was (reading it blocked sql and export-trace for good, SIGTERM included),
    a part linked to a file outside it, cut short, deleted (sql said 7 of 8 ranks, silently) or a stray rank
    folder; a run.json that is a FIFO, a link to /dev/zero, {} or another version's; an analysis table's part removed:
    sql leaves the run out and says why, export-trace and compare refuse it, each naming the file."""
    import subprocess
    import sys

    out, name = _damaged_copy(runs[0], tmp_path, damage)
    binary = Path(sys.executable).parent / "steplens"
    for args in (["sql", str(out), "SELECT count(*) FROM trace_events"], ["export-trace", str(out), "--out", str(tmp_path / "t.json")],
                 ["compare", str(runs[0] / "a"), str(out), "--out", str(tmp_path / "cmp")]):
        done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
        said = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 2, (args[0], said)
        assert name in said and "damaged result" in said and "a steplens bug" not in said, (args[0], said)


def test_analyze_parses_again_what_a_damaged_earlier_result_holds(runs, tmp_path):
    """The FIFO in the earlier result of a run whose input changed: analyze once hung on it; it parses that rank's
    trace again and publishes plain files."""
    run = tmp_path / "run"
    shutil.copytree(runs[0] / "a", run)
    part = sorted((run / ".steplens" / "trace_events" / "rank=1").glob("*.parquet"))[0]
    part.unlink()
    os.mkfifo(part)
    os.utime(next(run.glob("rank-0*")))  # another input touched: the run is analysed again, reusing what it can
    import subprocess
    import sys

    done = subprocess.run([str(Path(sys.executable).parent / "analyze"), str(run), "-q"], capture_output=True, text=True,
                          timeout=120)  # it hung here
    assert done.returncode == 0, done.stdout + done.stderr
    assert reuse.stray_files(run / ".steplens") == []
    assert sql.query(run, "SELECT count(DISTINCT rank) AS n FROM trace_events")["n"].to_list() == [2]


def test_csv_to_a_terminal_shows_escape_sequences_as_question_marks(runs):
    """`--format csv` keeps values as stored for a pipe or file; printed on a terminal, an OSC 52 clipboard write and a
    bidi override in a value no longer reach it."""
    import pty
    import sys

    query = "SELECT chr(27) || ']52;c;QQ==' || chr(7) || chr(8238) AS v"
    binary = str(Path(sys.executable).parent / "steplens")
    pid, fd = pty.fork()
    if pid == 0:  # the child: steplens on the pseudo-terminal
        os.execv(binary, [binary, "sql", str(runs[0]), query, "--format", "csv"])
    shown = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.waitpid(pid, 0)
    assert shown.replace(b"\r\n", b"\n") == b"v\n?]52;c;QQ==??\n"
    piped = CliRunner().invoke(steplens, ["sql", str(runs[0]), query, "--format", "csv"])
    assert piped.output == "v\n\x1b]52;c;QQ==\x07\u202e\n"


def test_a_result_being_written_or_replaced_is_no_run_of_its_own(runs, tmp_path):
    """analyze stages a result in .NAME.tmp-PID beside the published one and moves the one it replaces to
    .NAME.old-PID: both hold a run.json while it runs (and after a SIGKILL), and sql counted each as another run,
    doubling every aggregate. Only the published result is a run."""
    run = tmp_path / "a"
    shutil.copytree(runs[0] / "a", run)
    for staged in ("..steplens.tmp-4242", "..steplens.old-4243"):
        shutil.copytree(run / ".steplens", run / staged)
    assert sql.find_runs(tmp_path) == [run / ".steplens"]
    assert sql.query(tmp_path, "SELECT count(*) AS n FROM runs")["n"].to_list() == [1]
    # a folder of the user's own that merely looks hidden is still searched
    shutil.copytree(run / ".steplens", tmp_path / ".archive" / ".steplens")
    assert sql.find_runs(tmp_path) == [tmp_path / ".archive" / ".steplens", run / ".steplens"]


@pytest.mark.parametrize("special", ["fifo", "device"])
def test_a_run_json_that_is_no_plain_file_is_not_read(runs, tmp_path, special):
    """run.json as a FIFO blocked sql and analyze for good; as a link to /dev/zero, reading it never ended (a
    traceback from analyze's re-run check, an out-of-memory kill elsewhere). Neither is read: sql finds no run there,
    and analyze of the run parses it again. sql names the damage (it is in analyze's default folder, .steplens)."""
    import subprocess
    import sys

    run = tmp_path / "a"
    shutil.copytree(runs[0] / "a", run)
    manifest = run / ".steplens" / schema.MANIFEST_FILE
    manifest.unlink()
    if special == "fifo":
        os.mkfifo(manifest)
    else:
        manifest.symlink_to("/dev/zero")
    assert sql.find_runs(tmp_path) == [manifest.parent] and reuse.read_manifest(manifest.parent) == {}
    skipped: list = []
    with pytest.raises(sql.QueryError):  # no run left to answer
        sql.query(tmp_path, "SELECT count(*) FROM trace_events", skipped)
    assert skipped == [(str(manifest.parent), f"damaged result ({manifest} is not a plain file (a link, FIFO or device) "
                                              "or cannot be read); analyse the run again")]
    binary = Path(sys.executable).parent / "analyze"
    done = subprocess.run([str(binary), str(run), "-q"], capture_output=True, text=True, timeout=120)
    # a folder steplens cannot tell for its own is not replaced: a clear refusal, no traceback
    assert done.returncode == 2 and "Traceback" not in done.stderr and "holds no steplens run.json" in done.stderr


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_ctrl_c_and_sigterm_stop_a_long_query(runs, signum):
    """A query that runs for minutes inside DuckDB (where Python runs no signal handler) stops at Ctrl-C or SIGTERM:
    exit 130, 'interrupted', within seconds."""
    import signal
    import subprocess
    import sys
    import time

    binary = Path(sys.executable).parent / "steplens"
    proc = subprocess.Popen([str(binary), "sql", str(runs[0]), "SELECT count(*) FROM range(100000000000) a"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(6)  # past the start-up (about 1 s), into the query
    assert proc.poll() is None
    proc.send_signal(getattr(signal, signum))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and err.strip() == "interrupted"


def test_a_reader_that_leaves_ends_the_query(runs):
    """`sql ... | head -1`: the query went on to its end with its output thrown away (30 M rows took as long as without
    head); it stops when the reader is gone."""
    import subprocess
    import sys
    import time

    binary = Path(sys.executable).parent / "steplens"
    started = time.monotonic()
    proc = subprocess.Popen([str(binary), "sql", str(runs[0]), "SELECT * FROM range(100000000000)", "--format", "csv"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline() == b"range\n"
    proc.stdout.close()
    proc.wait(timeout=60)
    assert time.monotonic() - started < 60 and proc.returncode == 0


def _sql_output(root: Path, query: str, fmt: str) -> str:
    done = CliRunner().invoke(steplens, ["sql", str(root), query, "--format", fmt])
    assert done.exit_code == 0, done.output
    return done.output


def test_csv_gives_list_and_struct_values_as_json(runs):
    """CSV has no nested values: a list or struct cell is its JSON text (it was an internal error)."""
    import csv
    import io

    root = runs[0]
    output = _sql_output(root, "SELECT step, list(DISTINCT rank ORDER BY rank) AS ranks, {'n': 1, 'q': 'a\"b'} AS s "
                         "FROM steps WHERE run_id = (SELECT min(run_id) FROM runs) GROUP BY step ORDER BY step", "csv")
    rows = list(csv.DictReader(io.StringIO(output)))
    ranks = sql.query(root, "SELECT step, rank FROM steps WHERE run_id = (SELECT min(run_id) FROM runs)")
    for row in rows:
        expected = sorted(set(ranks.filter(pl.col("step") == int(row["step"]))["rank"].to_list()))
        assert json.loads(row["ranks"]) == expected
        assert json.loads(row["s"]) == {"n": 1, "q": 'a"b'}


def test_json_gives_sums_as_numbers(runs):
    """DuckDB's sum() of BIGINT is a HUGEINT (DECIMAL(38,0) in the result): it came out as the string "60022283"."""
    import pyarrow.parquet as pq_

    root = runs[0]
    output = _sql_output(root, "SELECT count(*) AS n, sum(dur_ns) AS total, sum(dur_ns)::DECIMAL(30, 2) / 4 AS quarter "
                         "FROM trace_events WHERE dur_ns IS NOT NULL", "json")
    (row,) = [json.loads(line) for line in output.splitlines()]
    # recomputed from the Parquet parts with pyarrow alone
    durations = [d for part in sorted(root.rglob("trace_events/*/*.parquet"))
                 for d in pq_.read_table(part, columns=["dur_ns"]).column("dur_ns").to_pylist() if d is not None]
    assert row == {"n": len(durations), "total": sum(durations), "quarter": pytest.approx(sum(durations) / 4)}
    assert isinstance(row["total"], int)


def test_a_part_overwritten_with_other_columns_is_a_damaged_result_for_compare_and_export_trace(runs, tmp_path):
    """A well-formed Parquet file with other columns where a table's part was: compare and export-trace ended with an
    internal error (ColumnNotFoundError, SchemaError); they refuse the result, naming the table, exit 2."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    other = pa.table({"x": [1, 2, 3], "step": ["a", "b", "c"]})
    analysis, events = tmp_path / "analysis" / ".steplens", tmp_path / "events" / ".steplens"
    for out in (analysis, events):
        shutil.copytree(runs[0] / "a" / ".steplens", out)
    pq.write_table(other, analysis / "top_kernels" / "part-0.parquet")
    pq.write_table(other, sorted((events / "trace_events" / "rank=1").glob("*.parquet"))[0])
    binary = Path(sys.executable).parent / "steplens"
    for args, named in ((["compare", str(runs[0] / "a"), str(analysis), "--out", str(tmp_path / "cmp")], "top_kernels"),
                        (["export-trace", str(events), "--out", str(tmp_path / "t.json")], "other columns")):
        done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "COLUMNS": "200"})
        said = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 2 and "damaged result" in said and named in said, (args[0], said)
        assert "a steplens bug" not in said
    assert not (tmp_path / "t.json").exists()


def test_csv_and_json_to_a_pipe_keep_escape_sequences_as_stored(runs):
    """--format csv to a file or pipe dropped ESC [ ... m and ESC [2J from values and column names (click strips
    'styles' off a stream that is no terminal): they are values, written exactly."""
    import subprocess
    import sys

    binary = Path(sys.executable).parent / "steplens"
    query = "SELECT 'a' || chr(27) || '[31mRED' || chr(27) || '[2Jz' AS \"c" + "\x1b" + "[1m\""
    for fmt, expected in (("csv", 'c\x1b[1m\na\x1b[31mRED\x1b[2Jz\n'), ("json", '{"c\\u001b[1m":"a\\u001b[31mRED\\u001b[2Jz"}\n')):
        done = subprocess.run([str(binary), "sql", str(runs[0]), query, "--format", fmt], capture_output=True, timeout=120)
        assert done.returncode == 0 and done.stdout.decode() == expected, (fmt, done.stdout)
