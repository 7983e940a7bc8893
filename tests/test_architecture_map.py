"""ARCHITECTURE.md's map from a number to its code holds: every report section and every findings.json key the
bundled samples produce is listed with modules that exist, and report.html names the same module beside each
section."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE_ROW = re.compile(r"^\| (?P<names>.+?) \| (?P<modules>`[^|]+`) \|$")


def _rows(table: str = "") -> list[tuple[list[str], list[str]]]:
    """The map's rows: both tables, or the one whose header starts with `table` ("| report section", "| findings")."""
    text = (ROOT / "ARCHITECTURE.md").read_text().split("## From a number to its code", 1)[1]
    if table:
        text = text.split(table, 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in text.splitlines():
        if match := TABLE_ROW.match(line):
            rows.append((re.findall(r"`([^`]+)`", match["names"]), re.findall(r"`([^`]+)`", match["modules"])))
    return rows


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> list[Path]:
    outs = []
    for name in ("synthetic_8rank", "deepspeed_cpu_2rank"):
        run = tmp_path_factory.mktemp("map") / name
        shutil.copytree(ROOT / "sample_runs" / name, run, ignore=shutil.ignore_patterns(".steplens"))
        done = subprocess.run([sys.executable, "-m", "steplens.analyze", str(run), "-q"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        outs.append(run / ".steplens")
    return outs


def test_every_module_named_exists():
    rows = _rows()
    assert len(rows) > 20
    for _names, modules in rows:
        for module in modules:
            assert (ROOT / module).is_file(), module


def test_every_finding_and_section_of_the_samples_is_mapped_and_named_in_the_page(samples):
    keys = {name for names, _modules in _rows("| findings.json key") for name in names}
    sections = {name: modules for names, modules in _rows("| report section") for name in names}
    for out in samples:
        for key in json.loads((out / "findings.json").read_text()):
            assert key in keys, f"findings.json key {key!r} is not in ARCHITECTURE.md's map"
        html = (out / "report.html").read_text()
        named = re.findall(r"<!-- computed in (.+?) -->\n<h2 id=\"([^\"]+)\">", html)
        assert len(named) >= 8
        for computed_in, section in named:  # what this page read: its own module first, then some of the row's
            modules = computed_in.split(", ")
            assert section in sections and modules[0] == sections[section][0], section
            assert set(modules) <= set(sections[section]), section
        assert html.count("<!-- computed in ") == html.count("<h2 id=") - 2  # all but the verdict and method
