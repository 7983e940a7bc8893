"""A re-run with nothing changed reuses the published result as it is (issue #15: incremental
re-analysis under 10% of a fresh run); any change to an input, an unread file, the options or a
missing output entry makes it analyse again."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SAMPLE = Path(__file__).resolve().parents[1] / "sample_runs" / "synthetic_8rank"


def _analyze(run: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "steplens.analyze", str(run), *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _snapshot(out: Path) -> dict:
    return {str(p.relative_to(out)): (p.stat().st_mtime_ns, p.stat().st_size) for p in out.rglob("*")}


@pytest.fixture
def analysed(tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns(".steplens"))
    _analyze(run)
    return run


def test_nothing_changed_reads_and_writes_nothing(analysed):
    out = analysed / ".steplens"
    before = _snapshot(out)
    again = _analyze(analysed)
    assert "nothing changed since the last analysis (8 input(s)" in again.stdout
    assert "report: " in again.stdout and "(unchanged)" in again.stdout
    assert _snapshot(out) == before  # not one file rewritten
    findings = json.loads((out / "findings.json").read_text())
    assert f"GPU idle: {findings['gpu_idle']['idle_share']:.1%}" in again.stdout  # the findings, from the kept result


@pytest.mark.parametrize("change", ["touch_input", "new_unread_file", "other_option", "report_deleted"])
def test_any_change_analyses_again(analysed, change):
    out = analysed / ".steplens"
    trace = sorted(analysed.glob("*.json*"))[0]
    args = []
    if change == "touch_input":
        os.utime(trace, ns=(time.time_ns(), trace.stat().st_mtime_ns + 10**9))
    elif change == "new_unread_file":
        (analysed / "notes.txt").write_text("an unread file is listed in run.json")
    elif change == "other_option":
        args = ["--dtype", "fp16"]
    else:
        (out / "report.html").unlink()
    again = _analyze(analysed, *args)
    assert "nothing changed" not in again.stdout and "rendered in" in again.stdout
    assert (out / "report.html").exists()
    manifest = json.loads((out / "run.json").read_text())
    if change == "new_unread_file":
        assert "notes.txt" in manifest["ignored_files"]


def test_inputs_reused_after_a_change_are_not_called_unchanged(analysed):
    """A new unread file changes the key: the traces' parts are reused, but the run is built again and
    the summary counts them, never 'nothing changed'."""
    (analysed / "notes.txt").write_text("new")
    again = _analyze(analysed, "--ingest-only")
    assert "nothing changed" not in again.stdout and "0 parsed, 8 unchanged" in again.stdout
