"""`analyze` prints its findings (or, with --format md, summary.md) as soon as the analyses are done: summary.md is
written and the terminal has every finding before report.html's figures are drawn, and report.html is still the
page the published tables render to (analyze/cli_render.py analyse_and_report)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SAMPLE = Path(__file__).resolve().parents[1] / "sample_runs" / "synthetic_8rank"
# The full command with the report's drawer watched: when it is called, it prints a marker line and what the staging
# folder holds (report.html is written after the figures, summary.md must already be there).
WATCHED = """
import glob, os, sys
from steplens.reports import html
drawn, out = html.draw, sys.argv[2]

def watched(drawings):
    staging = glob.glob(os.path.join(os.path.dirname(out), '.' + os.path.basename(out) + '.tmp-*'))
    names = sorted(os.listdir(staging[0])) if len(staging) == 1 else []
    print('DRAWING', len(drawings), 'summary.md' in names, 'findings.json' in names, 'report.html' in names, flush=True)
    return drawn(drawings)

html.draw = watched
from steplens.analyze import cli
sys.argv = ['analyze', sys.argv[1], '--out', sys.argv[2], '-j', '1'] + sys.argv[3:]
cli.analyze_entry()
"""


@pytest.fixture
def run(tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns(".steplens"))
    return run


def _analyze(run: Path, out: Path, *args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", WATCHED, str(run), str(out), *args],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_findings_are_printed_and_summary_written_before_the_figures_are_drawn(run, tmp_path):
    out = tmp_path / "out"
    lines = _analyze(run, out)
    drawing = [i for i, line in enumerate(lines) if line.startswith("DRAWING")]  # one call per figure here
    assert len(drawing) >= 4 and drawing == list(range(drawing[0], drawing[-1] + 1)), lines
    for i in drawing:  # summary.md and findings.json there, report.html not yet
        assert lines[i].split()[2:] == ["True", "True", "False"], lines[i]
    findings = lines.index("findings")
    assert lines.index("verdict") < findings < drawing[0]
    finding_lines = lines[findings + 1:drawing[0]]
    assert finding_lines and all(line.startswith("  ") for line in finding_lines)  # every finding before the figures
    assert lines[drawing[-1] + 1].startswith("report: ") and lines[-1].startswith("PR summary: ")
    # The file is the page the published result renders to, drawn here in one process.
    check = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from steplens.reports import html;"
                            "sys.stdout.write(html.render(Path(sys.argv[1])))", str(out)],
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr
    assert (out / "report.html").read_text() == check.stdout


def test_format_md_prints_the_summary_before_the_figures_are_drawn(run, tmp_path):
    out = tmp_path / "out"
    lines = _analyze(run, out, "--format", "md")
    drawing = [i for i, line in enumerate(lines) if line.startswith("DRAWING")]
    summary = (out / "summary.md").read_text().splitlines()
    assert len(summary) > 10 and lines[:drawing[0]] == summary  # all of it before the figures
    assert len(drawing) >= 4 and drawing[-1] == len(lines) - 1  # and printed once
