"""Nothing a user has is ever lost: --out checks, a damaged or crafted previous result, write
failures, runs kept apart, exit statuses, no process left behind, safe names in the terminal."""

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import pyarrow.parquet as pq
from click.testing import CliRunner

from steplens.analyze.pipeline import ingest as ingest_module
from steplens.analyze.contract import schema
from steplens.analyze.cli import EXIT_INTERRUPTED, EXIT_NOTHING, EXIT_UNWRITABLE, analyze, steplens
from steplens.analyze.pipeline import analyse

from conftest import write_trace
from synthetic import generate_run

ANALYZE = [sys.executable, "-m", "steplens.analyze"]


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs") / "run"
    generate_run(folder, ranks=2, steps=3, kernels_per_step=20, seed=3, write_truth=False)
    return folder


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns(".steplens*"))
    return dest


def _tree(root: Path) -> dict[str, str]:
    """Every file under root (hidden ones too) with a hash of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_out_naming_the_inputs_or_a_parent_is_refused_and_nothing_is_touched(synthetic_run, tmp_path):
    run = _copy(synthetic_run, tmp_path / "runs" / "run")
    (run / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    runner = CliRunner()
    for out in (run, tmp_path / "runs", tmp_path):
        result = runner.invoke(analyze, [str(run), "--out", str(out)])
        assert result.exit_code == EXIT_NOTHING, result.output
        assert "holds the inputs" in " ".join(result.output.split())
    assert _tree(tmp_path) == before


def test_out_with_foreign_files_is_refused_and_they_survive(synthetic_run, tmp_path):
    run = _copy(synthetic_run, tmp_path / "run")
    elsewhere = tmp_path / "checkpoints"
    elsewhere.mkdir()
    (elsewhere / "model.pt").write_bytes(b"weights")
    result = CliRunner().invoke(analyze, [str(run), "--out", str(elsewhere)])
    assert result.exit_code == EXIT_NOTHING and "holds no steplens run.json" in result.output
    assert (elsewhere / "model.pt").read_bytes() == b"weights"

    # A file a user drops into steplens's own output folder is not deleted by the next run either.
    assert CliRunner().invoke(analyze, [str(run)]).exit_code == 0
    out = run / schema.DEFAULT_OUT_DIR
    (out / "my_notes.md").write_text("keep me")
    again = CliRunner().invoke(analyze, [str(run)])
    assert again.exit_code == EXIT_NOTHING and "my_notes.md" in again.output
    assert (out / "my_notes.md").read_text() == "keep me" and (out / "run.json").exists()
    # Every entry of a published folder is listed in its run.json, so the next run knows what it owns.
    (out / "my_notes.md").unlink()
    listed = json.loads((out / "run.json").read_text())["output_entries"]
    assert sorted(os.listdir(out)) == listed


def test_damaged_previous_result_is_parsed_again(synthetic_run, tmp_path):
    run = _copy(synthetic_run, tmp_path / "run")
    out = tmp_path / "out"
    first = ingest_module.ingest(run, out, jobs=1)
    events = {s.path: s.events for s in first.sources}
    parts = sorted((out / "trace_events").glob("rank=*/*.parquet"))
    parts[0].unlink()  # a deleted part
    with open(parts[1], "r+b") as f:  # a truncated part
        f.truncate(100)
    again = ingest_module.ingest(run, out, jobs=1)
    assert again.parsed == 2 and again.reused == 0
    assert {s.path: s.events for s in again.sources} == events
    third = ingest_module.ingest(run, out, jobs=1)
    assert third.parsed == 0 and third.reused == 2


def test_crafted_manifest_paths_never_leave_the_output_folder(synthetic_run, tmp_path):
    run = _copy(synthetic_run, tmp_path / "run")
    out = tmp_path / "out"
    ingest_module.ingest(run, out, jobs=1)
    manifest = json.loads((out / "run.json").read_text())
    manifest["sources"][0]["part_id"] = "../../../escaped"
    manifest["sources"][1]["rank"] = "../../x"
    (out / "run.json").write_text(json.dumps(manifest))
    outside = {p for p in tmp_path.rglob("*") if out not in p.parents and p != out}
    result = ingest_module.ingest(run, out, jobs=1)
    assert result.parsed == 2  # neither crafted entry was trusted
    assert {p for p in tmp_path.rglob("*") if out not in p.parents and p != out} == outside


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_exits_4_and_keeps_the_last_result(synthetic_run, tmp_path, monkeypatch, code):
    run = _copy(synthetic_run, tmp_path / "run")
    assert CliRunner().invoke(analyze, [str(run), "-j", "1"]).exit_code == 0
    before = _tree(run / schema.DEFAULT_OUT_DIR)
    (run / "rank-1.pt.trace.json.gz").touch()  # changed: must be parsed again, which now fails to write

    def no_space(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(args[1]))

    monkeypatch.setattr(ingest_module.pq, "write_table", no_space)
    result = CliRunner().invoke(analyze, [str(run), "-j", "1"])
    assert result.exit_code == EXIT_UNWRITABLE, result.output
    told = " ".join(result.output.split())
    assert f"cannot write to {run / schema.DEFAULT_OUT_DIR}" in told and "use --out DIR" in told
    assert _tree(run / schema.DEFAULT_OUT_DIR) == before
    assert not [p for p in run.iterdir() if ".tmp-" in p.name]  # no staging folder left behind


def test_a_folder_of_runs_is_analysed_run_by_run(synthetic_run, tmp_path):
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        _copy(synthetic_run, runs / name)
    done = subprocess.run([*ANALYZE, str(runs), "-q"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "holds 2 runs" in " ".join(done.stdout.split())  # wrapped where the path ends
    for name in ("a", "b"):
        manifest = json.loads((runs / name / schema.DEFAULT_OUT_DIR / "run.json").read_text())
        assert sorted(s["path"] for s in manifest["sources"]) == sorted(
            p.name for p in (runs / name).glob("rank-*.json.gz"))
        assert manifest["trace_ranks"] == [0, 1]
        inputs = len(list((runs / name).glob("rank-*.json.gz")))
        assert f"  {name}: {inputs} input(s), ranks 0-1, 0 error(s)\n    {runs / name / schema.DEFAULT_OUT_DIR / 'report.html'}" in done.stdout
    assert not (runs / schema.DEFAULT_OUT_DIR).exists()


def test_a_single_trace_file_is_a_one_rank_run(synthetic_run, tmp_path):
    run = _copy(synthetic_run, tmp_path / "run")
    trace = run / "rank-1.pt.trace.json.gz"
    done = subprocess.run([*ANALYZE, str(trace), "-q"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((run / f"{schema.DEFAULT_OUT_DIR}-{trace.name}" / "run.json").read_text())
    assert [s["path"] for s in manifest["sources"]] == [trace.name]


def _descendants_alive(pgid: int) -> list[psutil.Process]:
    alive = []
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except (psutil.Error, ProcessLookupError):
            continue
    return alive


def _start_parallel_analyze(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    run = tmp_path / "big"
    generate_run(run, ranks=4, steps=6, kernels_per_step=400, seed=5)
    env = dict(os.environ, STEPLENS_WORKER_WORTH_BYTES="0")
    process = subprocess.Popen([*ANALYZE, str(run), "-j", "3", "-q"], env=env, start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and len(psutil.Process(process.pid).children(recursive=True)) < 2:
        time.sleep(0.05)
    assert psutil.Process(process.pid).children(recursive=True), "no worker started"
    return process, run


def _wait_for_no_process(pgid: int, seconds: float = 10) -> list:
    deadline = time.time() + seconds
    while (alive := _descendants_alive(pgid)) and time.time() < deadline:
        time.sleep(0.1)
    return alive


def test_kill_9_during_a_parallel_ingest_leaves_no_process(tmp_path):
    process, run = _start_parallel_analyze(tmp_path)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert _wait_for_no_process(process.pid) == []


def test_sigterm_stops_the_workers_and_keeps_the_last_result(tmp_path):
    process, run = _start_parallel_analyze(tmp_path)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == EXIT_INTERRUPTED
    assert stderr.strip().splitlines()[-1] == "interrupted: the last published result is unchanged"
    assert "Traceback" not in stderr
    assert _wait_for_no_process(process.pid) == []
    assert not [p for p in run.iterdir() if ".tmp-" in p.name]


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


@pytest.mark.parametrize("command", [[sys.executable, "-m", "steplens.analyze"],
                                     [str(Path(sys.executable).parent / "analyze")]])
def test_sigterm_during_the_imports_exits_130(tmp_path, command):
    """A SIGTERM in the first 0.3 s (the imports, the early workers) ended the process with 143 and no word:
    the handler is now the first thing the scripts set, and one sent as soon as it is set exits 130."""
    if not Path(command[0]).exists():
        pytest.skip(f"{command[0]} not installed")
    process, run = None, tmp_path / "run"
    generate_run(run, ranks=4, steps=6, kernels_per_step=400, seed=5)
    env = dict(os.environ, STEPLENS_WORKER_WORTH_BYTES="0")
    process = subprocess.Popen([*command, str(run), "-j", "3", "-q"], env=env, start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not _catches_sigterm(process.pid) and time.time() < deadline and process.poll() is None:
        time.sleep(0.001)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == EXIT_INTERRUPTED, stderr
    assert stderr.strip().splitlines()[-1] == "interrupted: the last published result is unchanged"
    assert "Traceback" not in stderr
    assert _wait_for_no_process(process.pid) == []
    assert not (run / ".steplens").exists()


def test_a_finished_parallel_analyze_leaves_no_process(tmp_path):
    run = tmp_path / "run"
    generate_run(run, ranks=3, steps=2, kernels_per_step=20, seed=6)
    env = dict(os.environ, STEPLENS_WORKER_WORTH_BYTES="0")
    process = subprocess.Popen([*ANALYZE, str(run), "-j", "2", "-q", "--ingest-only"], env=env, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert _descendants_alive(process.pid) == []  # at once, not after a grace period


def test_names_with_markup_and_escape_sequences_reach_the_terminal_inert(synthetic_run, tmp_path):
    run = _copy(synthetic_run, tmp_path / "mk[/x/y]\x1b]0;pwned\x07")
    os.rename(run / "rank-1.pt.trace.json.gz", run / "rank-1\x1b[2J.pt.trace.json.gz")
    (run / "rank-0.pt.trace.json.gz").write_bytes(b"\x1b[31mnot a trace")
    done = subprocess.run([*ANALYZE, str(run)], capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr
    assert "Traceback" not in done.stderr
    assert "\x1b" not in done.stdout + done.stderr and "\x07" not in done.stdout + done.stderr
    assert "mk[/x/y]" in done.stdout


def test_sql_takes_run_folders_literally(synthetic_run, tmp_path):
    runs = tmp_path / "runs"
    for name in ("exp*", "expA", "glob[1]", "bs\\x"):
        run = _copy(synthetic_run, runs / name)
        assert ingest_module.ingest(run, jobs=1).parsed == 2
    done = CliRunner().invoke(steplens, ["sql", str(runs), "SELECT run_id, count(*) AS n FROM steps GROUP BY run_id",
                                         "--format", "json"])
    assert done.exit_code == 0, done.output
    rows = [json.loads(line) for line in done.output.splitlines()]
    steps_per_run = len(json.loads((runs / "expA" / schema.DEFAULT_OUT_DIR / "run.json").read_text())["sources"]) * 3
    assert len(rows) == 4 and {r["n"] for r in rows} == {steps_per_run}  # copies of one run, none double counted


def test_export_trace_never_overwrites_an_input(synthetic_run, tmp_path):
    run = _copy(synthetic_run, tmp_path / "run")
    analyse(run, jobs=1)  # tables and analyses, no report
    trace = run / "rank-0.pt.trace.json.gz"
    before = trace.read_bytes()
    refused = CliRunner().invoke(steplens, ["export-trace", str(run), "--out", str(trace)])
    assert refused.exit_code == EXIT_NOTHING and "not a trace steplens exported" in refused.output
    assert trace.read_bytes() == before
    merged = tmp_path / "merged.json"
    assert CliRunner().invoke(steplens, ["export-trace", str(run), "--out", str(merged)]).exit_code == 0
    assert CliRunner().invoke(steplens, ["export-trace", str(run), "--out", str(merged)]).exit_code == 0  # its own: replaced


def _unranked_trace(path: Path, pid: int, kernels: int) -> Path:
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": pid, "tid": 1, "ts": 0, "dur": 50}]
    for i in range(kernels):
        events += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": 1, "ts": 1 + i,
                    "dur": 1, "args": {"correlation": i + 1}},
                   {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 10 + i, "dur": 1,
                    "args": {"correlation": i + 1, "stream": 7}}]
    return write_trace(path, events)


def test_unranked_traces_of_different_processes_are_separate_runs(tmp_path):
    before = _unranked_trace(tmp_path / "traces" / "before_fix.json", pid=100, kernels=2)
    after = _unranked_trace(tmp_path / "traces" / "after_fix.json", pid=200, kernels=3)
    done = subprocess.run([*ANALYZE, str(tmp_path / "traces"), "-q"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 traces with no rank, from different processes" in " ".join(done.stdout.split())  # wrapped to 80 columns
    # every line within 80 columns but one a path longer than that fills alone
    assert all(len(line) <= 80 or len(line.split()) == 1 or len(line.split()[0]) > 70 for line in done.stdout.splitlines()[:2])
    for trace, kernels in ((before, 2), (after, 3)):
        out = trace.parent / f"{schema.DEFAULT_OUT_DIR}-{trace.name}"
        manifest = json.loads((out / "run.json").read_text())
        assert [s["path"] for s in manifest["sources"]] == [trace.name]
        assert manifest["sources"][0]["kind_counts"]["kernel"] == kernels


def test_separate_runs_with_an_output_folder_can_be_run_again(tmp_path):
    traces = tmp_path / "traces"
    _unranked_trace(traces / "before_fix.json", pid=100, kernels=2)
    _unranked_trace(traces / "after_fix.json", pid=200, kernels=3)
    out = tmp_path / "out"
    first, again = (subprocess.run([*ANALYZE, str(traces), "--out", str(out), "-q"], capture_output=True, text=True)
                    for _ in range(2))
    assert first.returncode == again.returncode == 0, first.stderr + again.stderr
    assert sorted(p.name for p in out.iterdir()) == ["after_fix.json", "before_fix.json"]
    # Results of another run in that folder are not taken for its own: refused, not replaced.
    other = tmp_path / "other"
    _unranked_trace(other / "before_fix.json", pid=300, kernels=1)
    _unranked_trace(other / "after_fix.json", pid=400, kernels=1)
    refused = subprocess.run([*ANALYZE, str(other), "--out", str(out), "-q"], capture_output=True, text=True)
    assert refused.returncode == EXIT_NOTHING and "holds no steplens run.json" in refused.stderr
    manifest = json.loads((out / "after_fix.json" / "run.json").read_text())
    assert manifest["run_name"] == "traces" and manifest["sources"][0]["kind_counts"]["kernel"] == 3


def test_ranks_without_a_trace_are_named_on_stderr(tmp_path):
    run = tmp_path / "run"
    generate_run(run, ranks=4, steps=2, kernels_per_step=20, seed=8, write_truth=False)
    for rank in (1, 3):
        (run / f"rank-{rank}.pt.trace.json.gz").unlink()
    done = subprocess.run([*ANALYZE, str(run), "-q"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # profiling some ranks only is legitimate: a warning, not a failure
    assert "warning: traces of 2 of 4 ranks; no trace for rank(s) 1, 3" in done.stderr


def test_names_that_are_not_utf8_are_shown_replaced_and_their_files_read(synthetic_run, tmp_path):
    """A byte that is not UTF-8 in a trace's or the run folder's name ended in an internal error (Arrow and JSON take
    no lone surrogate); the file is read, its name shown with U+FFFD, and an output folder Arrow cannot name is
    refused with exit 2 and a message."""
    parent = os.fsencode(tmp_path)
    run = os.fsdecode(parent + b"/run\xff")
    _copy(synthetic_run, Path(run))
    os.rename(os.path.join(run, "rank-1.pt.trace.json.gz"), os.fsdecode(os.fsencode(run) + b"/rank-1\xfe.pt.trace.json.gz"))
    refused = subprocess.run([*ANALYZE, run, "-q"], capture_output=True, text=True)
    assert refused.returncode == 2 and "not UTF-8" in refused.stderr and "Traceback" not in refused.stderr
    out = tmp_path / "out"
    done = subprocess.run([*ANALYZE, run, "--out", str(out), "-q"], capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr
    sources = set(pq.read_table(out / "trace_events", columns=["source"]).column("source").to_pylist())
    assert sources == {"rank-0.pt.trace.json.gz", "rank-1\ufffd.pt.trace.json.gz"}
    assert json.loads((out / "run.json").read_text())["run_name"] == "run\ufffd"
    assert "run\ufffd" in (out / "summary.md").read_text()


HIDDEN = ["\u00ad", "\u061c", "\u180e", "\u200b", "\u200e", "\u2028", "\u2029", "\u202e", "\u2060", "\u2064", "\u2066",
          "\ufe0f", "\ufeff", "\U000e0041", "\U000e0101", "\x1b", "\x07", "\x9b"]


def test_every_character_that_hides_reorders_or_breaks_text_is_shown_as_a_question_mark():
    """Bidi controls (U+061C is one too), zero-width and invisible characters, the line separators, variation
    selectors and the tag characters that carry hidden text, as well as C0/C1 controls."""
    from steplens.analyze.contract.text import path_text, safe_text

    assert safe_text("a" + "".join(HIDDEN) + "b") == "a" + "?" * len(HIDDEN) + "b"
    assert safe_text("ünïcødé 日本 ok\tand\nlines") == "ünïcødé 日本 ok\tand\nlines"
    assert path_text("run\nname/report.html") == "run?name/report.html"


def test_markdown_gives_no_mention_link_or_strikethrough_from_trace_text():
    """Posted as a PR comment, `@org/team` in a kernel name notified a team and `www.` became a link."""
    from steplens.reports.markdown import escape

    text = escape("hi @octocat @org/team www.evil.example https://x.example/y ~~gone~~ &#64;bob a|b")
    assert "@octocat" not in text and "@org" not in text and "@&#8203;octocat" in text
    assert "www." not in text and "https://" not in text
    assert "~~" not in text and "\\~\\~gone\\~\\~" in text and "\\&\\#64;bob" in text and "a\\|b" in text


def test_figure_text_from_traces_carries_no_control_or_invisible_character():
    """A monitor tag with an OSC 8 hyperlink, a BEL and a bidi override: matplotlib escapes markup, not these."""
    import polars as pl

    from steplens.reports import figures

    name = "train/loss\x1b]8;;https://evil\x07\u202eevil"
    scalars = pl.DataFrame({"name": [name] * 3, "global_samples": [8, 16, 24], "value": [3.0, 2.5, 2.0], "rank": [0] * 3})
    svg = figures.curves(scalars, "global_samples", [name])
    assert not any(ch in svg for ch in ("\x1b", "\x07", "\u202e"))
    assert "train/loss?]8;;https://evil??evil" in svg


def test_a_name_with_emoji_codes_prints_as_written(synthetic_run, tmp_path):
    """rich turned `:smiley:` in a folder name into an emoji: a path that does not exist, shown as one."""
    run = _copy(synthetic_run, tmp_path / ":smiley: :warning: run")
    done = subprocess.run([str(Path(sys.executable).parent / "analyze"), str(run), "-q"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "300"})
    assert done.returncode == 0, done.stderr
    assert ":smiley: :warning: run/.steplens/report.html" in done.stdout and "\U0001f603" not in done.stdout


@pytest.mark.parametrize("columns, narrowest", [("0", 80), ("-3", 80), ("wide", 80), ("1", 40)])
def test_a_columns_value_that_is_no_width_still_prints_every_message(columns, narrowest, tmp_path):
    """COLUMNS=0 made rich print nothing, the error of a missing folder included; COLUMNS=1 a character a line."""
    missing = "no such run folder"
    done = subprocess.run([str(Path(sys.executable).parent / "analyze"), missing], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": columns}, cwd=tmp_path)
    assert done.returncode == 2
    said = " ".join(done.stderr.split())
    assert f"{missing}: no such file or folder" in said
    assert all(len(line) <= narrowest for line in done.stderr.splitlines())
    assert len(done.stderr.splitlines()) <= -(-len(said) // (narrowest - 10)) + 1  # not a character a line


def test_a_file_url_out_is_its_path_and_a_memory_store_is_refused(synthetic_run, tmp_path):
    """--out file:///... wrote nothing where it said ("cannot write"); --out memory://x reported a report that was
    gone once analyze ended."""
    run = _copy(synthetic_run, tmp_path / "run")
    out = tmp_path / "out dir"
    done = CliRunner().invoke(analyze, [str(run), "-q", "--ingest-only", "--out", "file://" + str(out).replace(" ", "%20")])
    assert done.exit_code == 0, done.output
    assert (out / "run.json").is_file()
    refused = CliRunner().invoke(analyze, [str(run), "-q", "--out", "memory://results"])
    assert refused.exit_code == 2 and "would be gone when it ends" in " ".join(refused.output.split())


def test_an_unreachable_host_names_the_url_given(capsys):
    """An --out URL whose host does not resolve said 'error: : Name or service not known', naming nothing."""
    import socket

    import click

    from steplens.analyze import cli

    @click.command()
    @click.option("--out")
    def reaches(out):
        raise socket.gaierror(-2, "Name or service not known")

    with pytest.raises(SystemExit) as ended:
        cli._guarded(reaches, ["--out", "ftp://x/y"], prog_name="analyze")
    assert ended.value.code == EXIT_NOTHING
    assert "ftp://x/y: cannot reach its host (Name or service not known)" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("case", ["run name too long", "out name too long", "out a link loop", "run a link loop"])
def test_paths_that_cannot_be_looked_at_are_named_not_a_traceback(synthetic_run, tmp_path, case):
    """The `analyze` script answers a re-run before its imports: a path it could not stat (a name past the system's
    255 bytes) printed a Python traceback with exit 1, the status of a written result; a link that leads to itself
    was an internal error (exit 5)."""
    long_name = str(tmp_path / ("r" * 300))
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    run, out = {"run name too long": (long_name, None), "out name too long": (str(synthetic_run), long_name),
                "out a link loop": (str(synthetic_run), str(loop)), "run a link loop": (str(loop), None)}[case]
    analyse(synthetic_run, jobs=1)  # a result to answer a re-run from, as the script does first
    done = subprocess.run([str(Path(sys.executable).parent / "analyze"), run, "-q", *(["--out", out] if out else [])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_NOTHING and "Traceback" not in done.stderr and "internal error" not in done.stderr
    assert ("File name too long" if "too long" in case else "a symbolic link that leads to itself") in " ".join(
        done.stderr.split())


def test_what_a_linked_file_outside_the_run_holds_is_not_quoted(tmp_path):
    """Links in a run folder are followed (traces are linked in), but a linked file outside it that is no trace had
    its first bytes quoted in ingest_issues, run.json and the report that goes on a PR ('starts with b'root:*:...'');
    a file of the folder itself is still described."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "shadow").write_text("root:*:20228:0:99999:7:::\n")
    (outside / "keys.json").write_text('{"secret_api_key": "abc"}')
    run = tmp_path / "run"
    write_trace(run / "rank0.pt.trace.json", [{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 1, "ts": 1, "dur": 1}])
    (run / "rank1.pt.trace.json").symlink_to(outside / "shadow")
    (run / "keys.json").symlink_to(outside / "keys.json")
    (run / "own.json").write_text('{"own_key": 1}')
    analyse(run, jobs=1)
    written = b"".join(p.read_bytes() for p in (run / ".steplens").rglob("*") if p.is_file())
    assert b"root:" not in written and b"secret_api_key" not in written
    issues = {r["file"]: r for r in pq.read_table(run / ".steplens" / "ingest_issues").to_pylist()}
    assert issues["rank1.pt.trace.json"]["reason"] == "damaged_trace" and "not quoted" in issues["rank1.pt.trace.json"]["detail"]
    assert issues["keys.json"]["reason"] == "not_a_trace" and "'own_key'" in issues["own.json"]["detail"]


def test_a_result_written_inside_the_run_folder_is_no_input_of_the_next_run(synthetic_run, tmp_path):
    """--out RUN/sub, then analyze RUN: sub's run.json, findings.json and tables were read as inputs (not_a_trace and
    more); a folder analyze wrote is now named once and not read."""
    run = tmp_path / "run"
    shutil.copytree(synthetic_run, run, ignore=shutil.ignore_patterns(".steplens"))
    analyse(run, run / "sub", jobs=1)
    analyse(run, jobs=1)
    issues = pq.read_table(run / ".steplens" / "ingest_issues").to_pylist()
    assert [(i["file"], i["reason"]) for i in issues if i["file"].startswith("sub")] == [("sub", "output_folder")]
    manifest = json.loads((run / ".steplens" / "run.json").read_text())
    assert not [s for s in manifest["sources"] if s["path"].startswith("sub/")]
