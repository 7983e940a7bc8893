"""The analyze script answers a re-run with nothing changed from run.json `rerun` alone, before importing
polars or pyarrow (analyze/cli_rerun.py): the same lines and exit status as the full command; any other
command line, a changed file or an incomplete result goes to the full command."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from steplens.analyze import cli_rerun
from steplens.analyze.contract import reuse, schema

SAMPLE = Path(__file__).resolve().parents[1] / "sample_runs" / "synthetic_8rank"
SCRIPT = Path(sys.executable).parent / "analyze"
# The full command, without the script's shortcut, with the set of modules it imported.
FULL = ("import sys\nfrom steplens.analyze import cli\nsys.argv = ['analyze'] + sys.argv[1:]\n"
        "try:\n    cli.analyze_entry()\nfinally:\n    print('polars' in sys.modules, file=sys.stderr)\n")
# The script's entry point, reporting whether it imported polars.
SHORT = ("import sys\nfrom steplens.analyze import cli_rerun\nsys.argv = ['analyze'] + sys.argv[1:]\n"
         "try:\n    cli_rerun.analyze_entry()\nfinally:\n    print('polars' in sys.modules, file=sys.stderr)\n")


def _run(code: str, *args, cwd: Path, columns: int = 80) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "COLUMNS": str(columns)}, timeout=300)


@pytest.fixture
def run(tmp_path) -> Path:
    """A copy of the 8-rank sample with one trace missing (a warning and exit status 1 to replay)."""
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns(".steplens", "*rank7*"))
    (run / "notes.txt").write_text("not read")
    return run


@pytest.mark.parametrize("args,columns", [((), 80), (("--out", "out"), 60), (("-q", "--out=out", "-j", "2"), 120)])
def test_a_rerun_prints_what_the_full_command_prints_without_importing_polars(run, args, columns):
    first = subprocess.run([SCRIPT, "run", *args], capture_output=True, text=True, cwd=run.parent, timeout=300)
    assert first.returncode in (0, 1), first.stderr
    full = _run(FULL, "run", *args, cwd=run.parent, columns=columns)
    short = _run(SHORT, "run", *args, cwd=run.parent, columns=columns)
    assert "nothing changed since the last analysis" in full.stdout or "-q" in args
    assert "(unchanged)" in full.stdout
    assert (short.stdout, short.returncode) == (full.stdout, full.returncode)
    assert short.stderr.splitlines()[:-1] == full.stderr.splitlines()[:-1]  # the missing-rank warning
    assert full.stderr.splitlines()[-1] == "True" and short.stderr.splitlines()[-1] == "False"


@pytest.mark.parametrize("change", ["touch_input", "new_file", "option", "user_file_in_output", "entry_deleted",
                                    "other_out"])
def test_anything_else_goes_to_the_full_command(run, change):
    subprocess.run([SCRIPT, "run"], capture_output=True, cwd=run.parent, timeout=300)
    out, args = run / schema.DEFAULT_OUT_DIR, ["run"]
    trace = sorted(run.glob("*.json*"))[0]
    if change == "touch_input":
        os.utime(trace, ns=(time.time_ns(), trace.stat().st_mtime_ns + 10**9))
    elif change == "new_file":
        (run / "more_notes.txt").write_text("x")
    elif change == "option":
        args += ["--dtype", "fp16"]
    elif change == "user_file_in_output":
        (out / "mine.txt").write_text("a user's file")
    elif change == "entry_deleted":
        (out / "summary.md").unlink()
    else:
        args += ["--out", str(run.parent / "elsewhere")]
    assert cli_rerun.answer([str(run), *args[1:]]) is None
    short = _run(SHORT, *args, cwd=run.parent)
    assert short.stderr.splitlines()[-1] == "True"  # the full command ran
    if change == "user_file_in_output":
        assert short.returncode == 2 and "mine.txt" in short.stderr
    else:
        assert "nothing changed" not in short.stdout and "rendered in" in short.stdout


def test_the_shortcut_constants_agree_with_the_contract():
    from steplens.analyze import importers
    from steplens.analyze.pipeline import ingest

    assert reuse.MANIFEST_FILE == schema.MANIFEST_FILE and reuse.FINDINGS_FILE == schema.FINDINGS_FILE
    assert cli_rerun.DEFAULT_OUT_DIR == schema.DEFAULT_OUT_DIR
    assert reuse.TRACE_KINDS == importers.TRACE_KINDS and reuse.TRACE_TABLES == ingest.PARSED_TABLES
    assert all(schema.TABLES[table][2] for table in reuse.TRACE_TABLES)  # per-rank tables: their parts in rank=N


@pytest.mark.parametrize("damage", ["fifo", "cut", "link"])
def test_a_rerun_repairs_a_damaged_result_instead_of_keeping_it(tmp_path, damage):
    """With nothing changed, analyze kept a result whose part had become a FIFO, a file cut short or a link, and sql,
    compare and export-trace kept saying "analyse the run again": the re-run now parses what it must again."""
    from synthetic import generate_run

    run = tmp_path / "run"
    generate_run(run, ranks=2, steps=3, kernels_per_step=20, seed=3, write_truth=False)
    analyze = str(Path(sys.executable).parent / "analyze")
    assert subprocess.run([analyze, str(run), "-q"], capture_output=True, timeout=300).returncode == 0
    part = sorted((run / ".steplens" / "steps" / "rank=0").glob("*.parquet"))[0]
    if damage == "fifo":
        part.unlink()
        os.mkfifo(part)
    elif damage == "cut":
        part.write_bytes(part.read_bytes()[:100])
    else:
        shutil.move(part, tmp_path / "elsewhere.parquet")
        part.symlink_to(tmp_path / "elsewhere.parquet")
    done = subprocess.run([analyze, str(run), "-q"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "nothing changed" not in done.stdout, done.stdout + done.stderr
    assert reuse.result_problem(run / ".steplens", reuse.read_manifest(run / ".steplens")) is None


@pytest.mark.parametrize("edit", [{"status": 7}, {"summary": [["x", 10**9]]}, {"findings": [3]}, {"warning": ["w"]},
                                  {"summary": "not a list"}])
def test_an_edited_recording_goes_to_the_full_command(run, edit):
    import json

    subprocess.run([SCRIPT, "run"], capture_output=True, cwd=run.parent, timeout=300)
    manifest_path = run / schema.DEFAULT_OUT_DIR / schema.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    assert cli_rerun.answer([str(run)]) is not None  # the recording as written is replayed
    manifest["rerun"].update(edit)
    manifest_path.write_text(json.dumps(manifest))
    assert cli_rerun.answer([str(run)]) is None


EXIT_CASES = {
    # buffered output (a pipe: block-buffered) is written whole; the status is the entry's
    "status": ("import sys\ndef entry():\n    sys.stdout.write('x' * 100000)\n    sys.exit(3)\n", 3, "x" * 100000),
    # sys.exit with a message: printed to stderr, status 1, as Python does
    "message": ("import sys\ndef entry():\n    print('out')\n    sys.exit('why')\n", 1, "out\n"),
    # a non-daemon thread still running is waited for: the interpreter exits as usual
    "thread": ("import threading, time, sys\ndef late():\n    time.sleep(0.3)\n    print('late', flush=True)\n"
               "def entry():\n    threading.Thread(target=late).start()\n", 0, "late\n"),
}


@pytest.mark.parametrize("case", sorted(EXIT_CASES))
def test_console_scripts_exit_without_teardown_but_lose_nothing(case):
    """The scripts end with os._exit (the interpreter's teardown costs 0.1-0.3 s after polars, pyarrow and
    matplotlib): everything printed still arrives, the status is kept, and a live thread is waited for."""
    code, status, stdout = EXIT_CASES[case]
    script = code + "from steplens.analyze.cli_rerun import exit_without_teardown\nexit_without_teardown(entry)\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (status, stdout)
    assert done.stderr == ("why\n" if case == "message" else "")


def _cached(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("__pycache__/*.pyc"))


def test_own_modules_are_compiled_once_when_the_interpreter_writes_no_bytecode(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("X = 1\n")
    (package / "sub" / "b.py").write_text("Y = 2\n")
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    cli_rerun.compile_own_modules((package,))
    assert _cached(package) == []  # an interpreter that writes bytecode compiles on import: nothing to do
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    cli_rerun.compile_own_modules((package,))
    assert [name.split(".")[0] for name in _cached(package)] == ["a", "b"]
    sys.path.insert(0, str(package))
    try:  # the import finds the compiled file beside its source
        import a  # noqa: PLC0415
        assert a.__cached__ and Path(a.__cached__).exists() and a.X == 1
    finally:
        sys.path.remove(str(package))
        sys.modules.pop("a", None)



def test_a_module_whose_bytecode_cannot_be_written_is_left_as_it_is(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("X = 1\n")
    (package / "__pycache__").write_text("not a folder")  # no .pyc can go there, even as root
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    cli_rerun.compile_own_modules((package,))  # raises nothing
    assert (package / "a.py").read_text() == "X = 1\n" and (package / "__pycache__").read_text() == "not a folder"


def _read_one_line_and_leave(args: list, cwd: Path) -> tuple[str, int, str]:
    """`analyze ... | head -1`: the reader takes the first line and closes the pipe."""
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd)
    first = process.stdout.readline().decode()
    process.stdout.close()
    _, stderr = process.communicate(timeout=300)
    return first, process.returncode, stderr.decode()


def test_a_reader_that_leaves_early_loses_no_result(run):
    """`analyze RUN | head -1` used to end with a BrokenPipeError at the first line after the reader went,
    before the result was published: nothing was written. Now the rest of the lines are dropped and the
    run completes with the status it would have had, the fresh run and the replay alike."""
    for attempt in ("fresh", "replayed"):
        first, status, stderr = _read_one_line_and_leave([SCRIPT, "run"], cwd=run.parent)
        assert "trace file(s)" in first and status == 0, (attempt, first, status, stderr)
        assert "BrokenPipe" not in stderr and "error" not in stderr
        out = run / schema.DEFAULT_OUT_DIR
        assert (out / "report.html").stat().st_size > 0 and (out / "summary.md").stat().st_size > 0
        assert reuse.complete(out, __import__("json").loads((out / schema.MANIFEST_FILE).read_text()))


def test_a_second_analyze_into_an_output_being_written_is_refused(tmp_path):
    """Two analyze runs writing one --out both said they succeeded, the later one's result replacing the other's.
    While another live process stages a result there (its .NAME.tmp-PID folder), analyze refuses with exit 4 and says
    which; once that process is gone, its leftover is cleaned and the run goes ahead."""
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns(".steplens"))
    out = tmp_path / "out"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f".out.tmp-{other.pid}" / "_scratch").mkdir(parents=True)
        refused = subprocess.run([str(SCRIPT), str(run), "--out", str(out), "-q"], capture_output=True, text=True,
                                 timeout=300)
        assert refused.returncode == 4, refused.stderr
        assert f"is being written by another analyze (process {other.pid})" in " ".join(refused.stderr.split())
        assert not out.exists()
    finally:
        other.kill()
        other.wait()
    done = subprocess.run([str(SCRIPT), str(run), "--out", str(out), "-q"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode in (0, 1) and (out / "run.json").exists() and not (tmp_path / f".out.tmp-{other.pid}").exists()


def test_a_process_that_took_a_dead_writers_id_holds_no_lock(tmp_path):
    """A killed analyze leaves .NAME.tmp-PID behind; when a later process gets that id, the folder read as a live
    writer's and the output stayed refused (exit 4) for as long as that process lived. A process that did not start when
    the writer recorded it started cannot be its writer: the run goes ahead and cleans the leftover."""
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns(".steplens"))
    out = tmp_path / "out"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        leftover = tmp_path / f".out.tmp-{other.pid}"
        (leftover / "_scratch").mkdir(parents=True)
        # its writer's start, in ticks after boot, as analyze records it: not that of the process now holding the id
        (leftover / "_writer").write_text("1")
        done = subprocess.run([str(SCRIPT), str(run), "--out", str(out), "-q"], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode in (0, 1), done.stderr
        assert (out / "run.json").exists() and not leftover.exists()
    finally:
        other.kill()
        other.wait()


def test_a_dead_runs_staging_folder_of_tables_alone_is_cleaned(tmp_path):
    """A run stopped after its scratch space was removed and before its manifest was written left a staging folder
    holding ingested tables only, which no later run recognised or removed (144 KB each, for good)."""
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns(".steplens"))
    out = tmp_path / "out"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    leftover = tmp_path / f".out.tmp-{gone.pid}"
    (leftover / "trace_events" / "rank=0").mkdir(parents=True)
    (leftover / "trace_events" / "rank=0" / "part-0.parquet").write_bytes(b"PAR1")
    (leftover / "ingest_issues").mkdir()
    done = subprocess.run([str(SCRIPT), str(run), "--out", str(out), "-q"], capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr
    assert (out / "run.json").exists() and not leftover.exists()


def test_this_runs_own_staging_folder_goes_whatever_it_holds_when_it_fails(tmp_path, monkeypatch):
    """An internal error raised after the scratch space was removed left this process's staging folder behind."""
    from steplens.analyze.pipeline import analyse, ingest

    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns(".steplens"))

    def fails(run_dir, out_dir, staging, *args):
        shutil.rmtree(staging / "_scratch")
        (staging / "trace_events").mkdir()
        raise ValueError("a bug after the scratch space went")

    monkeypatch.setattr(ingest, "_stage", fails)
    with pytest.raises(ValueError, match="a bug after"):
        analyse(run, tmp_path / "out", jobs=1)
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
