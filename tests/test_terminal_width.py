"""80 columns everywhere when piped, not only in analyze's main block: the closing warnings, steplens sql (a result
wider than the terminal is shown one block per row, its values checked against the CSV of the same query),
export-trace and trials."""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _piped(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "80"})


def _too_wide(text: str) -> list[str]:
    """Lines over 80 columns that could have been wrapped (more than one word: a path alone may be longer)."""
    return [line for line in text.splitlines() if len(line) > 80 and len(line.split()) > 1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The 8-rank sample, analysed, under a long folder name (so that every path in a message is long), and a
    copy of it whose traces claim 16 ranks (a closing warning names the 8 without a trace)."""
    folder = tmp_path_factory.mktemp("width") / ("a-folder-name-long-enough-to-push-any-message-past-80-columns" * 2)
    run = folder / "synthetic_8rank"
    shutil.copytree(ROOT / "sample_runs" / "synthetic_8rank", run, ignore=shutil.ignore_patterns(".steplens"))
    done = _piped("analyze", str(run), "-q")
    assert done.returncode == 0, done.stderr
    return folder


def test_closing_warnings_wrap_at_80_columns(runs, tmp_path):
    import gzip

    run = tmp_path / ("another-long-folder-name-for-the-warning" * 2)
    run.mkdir()
    for trace in sorted((runs / "synthetic_8rank").glob("rank-[0-3].pt.trace.json.gz")):
        text = gzip.decompress(trace.read_bytes()).decode().replace('"world_size": 8', '"world_size": 16', 1)
        (run / trace.name).write_bytes(gzip.compress(text.encode()))
    done = _piped("analyze", str(run), "-q")
    assert done.returncode == 0, done.stderr
    assert "no trace for rank(s) 4-15" in " ".join(done.stderr.split())
    assert _too_wide(done.stderr) == [] and len(done.stderr.splitlines()) >= 2


def test_a_wide_sql_result_is_one_block_per_row_with_the_values_of_the_csv(runs):
    query = "SELECT rank, name, dur_ns, source FROM trace_events WHERE kind = 'kernel' ORDER BY rank, ts_ns LIMIT 3"
    wide = _piped("steplens", "sql", str(runs), query)
    assert wide.returncode == 0, wide.stderr
    assert [line for line in wide.stdout.splitlines() if len(line) > 80] == []
    rows = list(csv.DictReader(io.StringIO(_piped("steplens", "sql", str(runs), query, "--format", "csv").stdout)))
    blocks = [block for block in wide.stdout.split("-[ row ")[1:]]
    assert len(blocks) == len(rows) == 3
    for block, row in zip(blocks, rows):
        values: dict[str, str] = {}
        name = None
        for line in block.splitlines()[1:]:
            key, _, value = line.partition(" | ")
            name = key.strip() or name
            values[name] = values.get(name, "") + value  # a wrapped value continues under its column
        assert values == row


def test_a_narrow_sql_result_stays_a_table(runs):
    done = _piped("steplens", "sql", str(runs), "SELECT rank, count(*) AS n FROM trace_events GROUP BY rank ORDER BY rank")
    assert "-[ row" not in done.stdout and "rank" in done.stdout and _too_wide(done.stdout) == []


def test_export_trace_says_what_it_wrote_within_80_columns(runs):
    done = _piped("steplens", "export-trace", str(runs / "synthetic_8rank"))
    assert done.returncode == 0, done.stderr
    assert " events and " in done.stdout and _too_wide(done.stdout) == []


@pytest.mark.parametrize("args", [["analyze", "RUN", "--kernel-categories", "MISSING"],
                                  ["steplens", "sql", "MISSING", "SELECT 1"]])
def test_a_usage_error_naming_a_long_path_wraps_at_80_columns(runs, args):
    """click's own errors ran to 140 columns with a long path in them; they wrap as steplens's do, the path whole."""
    missing = str(runs / "no-such-file.csv")
    args = [str(runs / "synthetic_8rank") if a == "RUN" else missing if a == "MISSING" else a for a in args]
    done = _piped(*args)
    assert done.returncode == 2
    assert done.stderr.splitlines()[0].startswith("Usage: ")
    assert missing in done.stderr and "does not exist" in " ".join(done.stderr.split())
    assert _too_wide(done.stderr) == []


def test_wide_characters_count_two_columns_when_wrapping():
    """textwrap counts characters: a message of CJK words (two columns each) ran to 112 columns at 80."""
    import unicodedata

    from steplens.analyze.cli_rerun import wrapped

    def columns(line: str) -> int:  # by hand: W and F characters are two columns
        return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)

    text = " ".join(["训练损失"] * 30 + ["loss"] * 10)
    lines = wrapped(text, 80, "  ", "    ")
    assert all(columns(line) <= 80 for line in lines) and max(columns(line) for line in lines) > 70
    assert " ".join(" ".join(lines).split()) == text  # every word, in order
