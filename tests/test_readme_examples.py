"""The README's example output is the output of the commands it names, on a copy of the bundled samples at 80
columns, so it cannot drift. A block follows a marker `<!-- example: SAMPLE [ARGS...] [lines=N] -->` and holds the
first N lines (all without lines=) of `analyze sample_runs/SAMPLE ARGS`, with the run-dependent timings as `...`.
STEPLENS_UPDATE_README=1 rewrites the blocks instead of checking them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
MARKER = re.compile(r"<!-- example: (?P<args>[^>]*?) -->\n```\n(?P<body>.*?)```\n", re.S)
# what changes from one run to the next: wall times, speeds and how long the report took
TIMINGS = [(re.compile(r"(trace data in )[\d.]+s"), r"\1..."), (re.compile(r",\s+\d+ MB/s"), ""),
           (re.compile(r"; analyses \S+"), "; analyses ..."), (re.compile(r"\((rendered in|unchanged)[^)]*\)"), "(...)")]


def _output(tmp: Path, sample: str, args: list[str], lines: int | None) -> str:
    run = tmp / "sample_runs" / sample  # named as in the README, so that lines wrap where they do for a user
    if not run.exists():
        shutil.copytree(ROOT / "sample_runs" / sample, run, ignore=shutil.ignore_patterns(".steplens"))
    done = subprocess.run([str(BIN / "analyze"), f"sample_runs/{sample}", *args], capture_output=True, text=True,
                          timeout=600, cwd=tmp, env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for pattern, replacement in TIMINGS:
        text = pattern.sub(replacement, text)
    kept = text.splitlines()[:lines] if lines else text.splitlines()
    return "\n".join(kept) + "\n"


def _expected(tmp: Path, args: str) -> str:
    words = args.split()
    lines = next((int(w.split("=")[1]) for w in words if w.startswith("lines=")), None)
    sample, *rest = [w for w in words if not w.startswith("lines=")]
    return _output(tmp, sample, rest, lines)


def test_the_readme_examples_are_the_commands_output(tmp_path):
    text = README.read_text()
    blocks = list(MARKER.finditer(text))
    assert len(blocks) >= 2  # the ingest summary with the verdict, and the findings
    if os.environ.get("STEPLENS_UPDATE_README"):
        README.write_text(MARKER.sub(lambda m: f"<!-- example: {m['args']} -->\n```\n{_expected(tmp_path, m['args'])}```\n",
                                     text))
        pytest.skip("README examples rewritten")
    for block in blocks:
        assert block["body"] == _expected(tmp_path, block["args"]), f"README example '{block['args']}' is stale"
    assert all(len(line) <= 80 for block in blocks for line in block["body"].splitlines())


def test_the_readme_shows_the_reports_first_screen():
    shot = ROOT / "docs" / "report-first-screen.png"
    assert "](docs/report-first-screen.png)" in README.read_text()
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < shot.stat().st_size < 300_000
    width, height = int.from_bytes(shot.read_bytes()[16:20], "big"), int.from_bytes(shot.read_bytes()[20:24], "big")
    assert (width, height) == (1280, 800)
