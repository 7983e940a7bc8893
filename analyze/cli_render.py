"""What the command line prints and writes besides the tables: exit statuses, the ingest summary,
the findings (in the sentences of reports/verdict.py) and the rendered reports."""

from __future__ import annotations

import math
import re
import sys
import time
from collections import Counter
from pathlib import Path

import click

from steplens.analyze import importers
from steplens.analyze.analyses import runner
from steplens.analyze.contract import schema
from steplens.analyze.contract.text import number_ranges
from steplens.analyze.cli_rerun import EXIT_INTERRUPTED
from steplens.analyze.pipeline.ingest import IngestResult, Source
from steplens.analyze.pipeline.workers import imports_without_collections

# Exit status, one meaning each, for every command (documented in --help and the README).
EXIT_PARTIAL = 1  # results written, but some inputs could not be used (see the issues)
EXIT_NOTHING = 2  # nothing usable, or bad arguments
EXIT_REGRESSION = 3  # compare --fail-on-regression: a significant slowdown beyond the threshold
EXIT_UNWRITABLE = 4  # the output cannot be written (permissions, read-only or full disk)
EXIT_INTERNAL = 5  # a steplens bug: the message says where to look
EXIT_STATUS_HELP = f"""\b
Exit status:
  0    all inputs used
  {EXIT_PARTIAL}    results written, but some inputs could not be used (see the issues)
  {EXIT_NOTHING}    nothing usable, or bad arguments
  {EXIT_REGRESSION}    compare: a regression beyond --fail-on-regression
  {EXIT_UNWRITABLE}    the output cannot be written (read-only or full disk, another analyze writing it)
  {EXIT_INTERNAL}    internal error (STEPLENS_DEBUG=1 shows the traceback)
  {EXIT_INTERRUPTED}  interrupted by Ctrl-C or SIGTERM (the last result is kept)
"""


class FiniteNumber(click.ParamType):
    """A finite number above 0 (a peak, a parameter count), or at least 0 with `zero_allowed`: nan and
    inf are refused (a range check lets nan through, and a nan threshold never fires)."""
    name = "number"

    def __init__(self, zero_allowed: bool = False) -> None:
        self.zero_allowed = zero_allowed

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number) or number < 0 or (number == 0 and not self.zero_allowed):
            self.fail(f"{value!r} is not a finite number {'of 0 or more' if self.zero_allowed else 'above 0'}", param, ctx)
        return number


def fail(message: str, status: int = EXIT_NOTHING) -> None:
    """`error: message` on stderr, wrapped as every line is (80 columns when piped), and exit with `status`."""
    from steplens.analyze.cli_rerun import warn

    warn(message, lead="error: ")
    sys.exit(status)


def summary_lines(result: IngestResult, analysis_seconds: float | None = None) -> list[tuple[str, int]]:
    """What was read, one fact per line, unwrapped (text, indent): cli_rerun.say wraps them to the console."""
    lines: list[tuple[str, int]] = []
    m = result.manifest
    # the traces in the tables: not one skipped as a second copy of a rank (duplicate_rank) or otherwise lost
    used = [s for s in result.sources if s.rank is not None and s.kind in importers.TRACE_KINDS
            and s.status in ("ingested", "reused")]
    mb = sum(s.raw_bytes for s in result.sources if s.status == "ingested") / 1e6
    parsed = sum(1 for s in result.sources if s.status == "ingested")
    ingest_seconds = result.seconds - (analysis_seconds or 0)
    speed = f", {mb / ingest_seconds:.0f} MB/s" if parsed and ingest_seconds > 0 else ""
    analysed = f"; analyses {analysis_seconds:.2f}s" if analysis_seconds is not None else ""
    artifacts = Counter(s.kind for s in result.sources if s.kind not in importers.TRACE_KINDS and s.status in ("ingested", "reused"))
    others = f" and {sum(artifacts.values())} other input(s)" if artifacts else ""
    lines.append((f"{len({s.path for s in used})} trace file(s){others} -> {result.out_dir}", 0))  # (a file of several ranks is one)
    if result.unchanged:
        lines.append((f"nothing changed since the last analysis ({result.reused} input(s), same options and steplens): "
                      "the result is reused as it is", 2))
    else:
        traces = any(s.kind in importers.TRACE_KINDS and s.status == "ingested" for s in result.sources)
        read = f"; {mb:.1f} MB of trace data in {ingest_seconds:.2f}s{speed}" if traces else f" in {ingest_seconds:.2f}s"
        lines.append((f"{parsed} parsed, {result.reused} unchanged{read}{analysed}", 2))
    world = f" of world size {m['world_size']}" if m.get("world_size") else ""
    lines.append((f"ranks: {number_ranges(m['ranks']) or 'none'}{world}", 0))
    if artifacts:
        lines.append(("other inputs: " + ", ".join(f"{kind}={n}" for kind, n in sorted(artifacts.items())), 0))
    if m.get("ignored_count"):
        lines.append((f"not read: {m['ignored_count']} file(s) in no format steplens knows (run.json ignored_files)", 0))
    if used:
        lines += _trace_table_lines(used)
    return lines + _issue_lines(result)


def _trace_table_lines(used: list[Source]) -> list[tuple[str, int]]:
    """Profiled steps per rank (ranks with the same steps on one line) and events per kind."""
    by_rank: dict[int, list[Source]] = {}
    for s in used:
        by_rank.setdefault(s.rank, []).append(s)
    same_steps: dict[tuple, list[int]] = {}
    for rank in sorted(by_rank):
        numbers = sorted(n for s in by_rank[rank] for n in s.steps)
        same_steps.setdefault((len(by_rank[rank]), tuple(numbers)), []).append(rank)
    marked = ("ProfilerStep#" if all(s.kind == "kineto" for s in used) else "NVTX step ranges, --step-range"
              if all(s.kind == "nsys" for s in used) else "ProfilerStep#; NVTX step ranges in Nsight Systems exports")
    lines = [(f"profiled steps ({marked}):", 0)]
    for (windows, numbers), ranks in same_steps.items():
        steps = f"{len(numbers)} step(s) {number_ranges(list(numbers))}" if numbers else "no steps"
        lines.append((f"rank{'s' if len(ranks) > 1 else ''} {number_ranges(ranks)}: {windows} window(s), {steps}", 2))
    kinds = Counter()
    for s in used:
        kinds.update(s.kind_counts)
    # kind=count: a line wrapped at the console width never parts a kind from its count
    lines.append(("events (all ranks): " + ", ".join(f"{kind}={kinds[kind]:,}" for kind in schema.KINDS if kinds.get(kind)), 0))
    return lines


LONG_WORD = re.compile(r"[^\s/]{61,}")  # no space to wrap at, and no path (a path is shown whole)
LONG_WORD_SHOWN = 40


def _issue_lines(result: IngestResult) -> list[tuple[str, int]]:
    """One line per kind of issue (severity, reason, count, files) and its first example."""
    grouped: dict[tuple, list] = {}
    for s in result.sources:
        for severity, reason, count, detail in s.issues:
            grouped.setdefault((severity, reason), []).append((s.path, count, detail))
    if not grouped:
        return [("ingest issues: none", 0)]
    lines = [(f"ingest issues ({len(grouped)} kind(s); all in the ingest_issues table):", 0)]
    order = {"error": 0, "warning": 1, "info": 2}
    for (severity, reason), rows in sorted(grouped.items(), key=lambda kv: (order.get(kv[0][0], 3), kv[0][1])):
        path, _, detail = rows[0]
        # an excerpt of the damage ("{"a":{"a":... 50,000 deep) cut to fit a line; ingest_issues keeps it whole
        detail = LONG_WORD.sub(lambda word: word[0][:LONG_WORD_SHOWN] + "…", detail.removeprefix(f"{path}: "))
        files = len({r[0] for r in rows})  # one file may give a reason several times (one per column)
        files = f"{files} file{'s' if files > 1 else ''}"
        lines.append((f"{severity} {reason}: {sum(r[1] for r in rows):,} in {files}; e.g. {path}: {detail}", 2))
    return lines



def import_figures() -> None:
    """The report's figure module and matplotlib (a quarter of a second): `analyze` imports them while it
    waits for its workers (Workers when_idle), and the workers while this process runs the run-level
    analyses, rather than after the analyses."""
    with imports_without_collections():
        skip_matplotlib_set_docs()
        from steplens.reports import figures  # noqa: F401


def skip_matplotlib_set_docs() -> None:
    """While matplotlib is imported, each Artist class gets a docstring and a signature for its set()
    listing every property (matplotlib/artist.py: Artist.__init_subclass__ calls
    _update_set_signature_and_docstring, which calls kwdoc; modules also register kwdoc texts): about a
    third of the import (0.31-0.47 -> 0.20-0.27 s here), read only by help(). `analyze` never shows help,
    so its own processes skip that work; set() is the same function either way, and the figures are the
    same bytes (tests/test_reports.py). Done only before matplotlib's artists exist, and only in the
    processes of the command line: a program importing steplens keeps matplotlib as it is."""
    if "matplotlib.artist" in sys.modules:
        return
    import matplotlib.artist as artist

    if callable(getattr(artist, "kwdoc", None)) and hasattr(artist.Artist, "_update_set_signature_and_docstring"):
        artist.kwdoc = lambda _artist: ""
        artist.Artist._update_set_signature_and_docstring = classmethod(lambda cls: None)


def draw_figure(drawing) -> str:
    """One report figure's SVG (reports/html.py Drawing), here or on a worker."""
    import_figures()
    from steplens.reports import html

    return html.draw([drawing])[0]


def analyse_and_report(folder: Path, options: runner.Options, map_ranks=None, map_figures=None, announce=None) -> dict:
    """The analyses, then summary.md and report.html, in the staged output (published together);
    `map_ranks` runs the per-rank analyses (runner.run), `map_figures` draws the report's figures
    (map(draw_figure, drawings) by default). `announce(findings)` is called once the analyses and
    summary.md are written, before the figures are drawn (the command prints the findings then)."""
    from steplens.reports import html, markdown

    started = time.perf_counter()
    findings = runner.run(folder, options, map_ranks)
    findings["analysis_seconds"] = time.perf_counter() - started
    started = time.perf_counter()
    markdown.write(folder)
    report_seconds = time.perf_counter() - started
    if announce is not None:
        announce(findings)
    started = time.perf_counter()
    not_drawn: list[str] = []
    html.write(folder, html.draw if map_figures is None else lambda drawings: map_figures(draw_figure, drawings),
               not_drawn)
    findings["report_seconds"] = report_seconds + time.perf_counter() - started
    if not_drawn:  # for the command's closing warning (findings.json is written: this is the run's, not the data's)
        findings["figures_not_drawn"] = not_drawn
    return findings
