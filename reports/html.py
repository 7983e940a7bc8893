"""The self-contained HTML report: one file, inline CSS and SVG, no script, no external request.

Every string that comes from a trace or a log (kernel names, op names, file names, error lines) is
untrusted: the Jinja2 environment autoescapes everything, and only the SVG that matplotlib wrote
is marked safe. A Content-Security-Policy meta tag forbids scripts and any fetch, so even a
rendering mistake cannot make the page call out. Figures are drawn once every section is built
(`draw`, or the caller's drawer), so a report without one never imports matplotlib.

The report only renders: every number is a row of an analysis table or a finding, picked, sorted
and formatted here, never computed (so `steplens sql` over the same tables gives the same number).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import jinja2
import polars as pl
from markupsafe import Markup, escape

from steplens.analyze.analyses import ANALYSES
from steplens.analyze.analyses.step_time import source_words
from steplens.analyze.contract.text import number_ranges, safe_text, sentence, text_value, utilization_text

from .data import Run, kernel_labels, load, ms, size, write_atomic
from .verdict import NUMERATOR_SHORT, first_screen, verdict


def _shown(value):
    """Every {{ }} value before it is escaped: text without control or bidi-override characters (a trace's ESC,
    NUL or U+202E reach the page as `?`, as they reach the terminal); Markup (the figures' SVG) as it is."""
    return value if value is None or isinstance(value, (Markup, int, float)) else safe_text(value)


TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("steplens.reports", "templates"),
    finalize=_shown,
    autoescape=True,  # every {{ }} is escaped unless it is Markup
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def _code_spans(text: str) -> Markup:
    """Text whose `command` spans (the terminal's and markdown's way of naming a command) read as code, the
    rest escaped."""
    return Markup(re.sub(r"`([^`\n]+)`", r"<code>\1</code>", str(escape(safe_text(text)))))


TEMPLATES.filters["code_spans"] = _code_spans
TABLE_ROWS = 10  # rows shown per table; the Parquet tables hold the rest
REPORT_FILE = "report.html"
SUMMARY_FILE = "summary.md"


class Cell(str):
    """A table cell whose full text (a kernel's demangled name) is kept for its tooltip."""

    def __new__(cls, text: str, full: str):
        cell = super().__new__(cls, text)
        cell.full = full
        return cell


# A number and its unit stay on one line in a narrow cell ("1.519 ms", not "1.519" over "ms").
NUMBER_UNIT = re.compile(r"(\d) (ns|µs|ms|s|B|KiB|MiB|GiB|TiB|GB/s|TB/s|TFLOP/s)(?=$|[\s,;)])")


def _keep_units(cell):
    if not isinstance(cell, str) or " " not in cell:
        return cell
    kept = NUMBER_UNIT.sub("\\1\u00a0\\2", cell)
    return Cell(kept, cell.full) if isinstance(cell, Cell) else kept


def _rows(frame: pl.DataFrame | list[dict], columns: dict[str, tuple[str, callable]], table: str,
          limit: int = TABLE_ROWS) -> dict:
    """A table for the template: header and formatted cells (escaped later by the template), at most
    `limit` rows of a frame (or of rows as dicts); the rest are counted and named by their Parquet table."""
    shown = frame[:limit] if isinstance(frame, list) else list(frame.head(limit).iter_rows(named=True))
    rows = [[_keep_units(fmt(row[name])) if row.get(name) is not None else "" for name, (_, fmt) in columns.items()]
            for row in shown]
    return {
        "header": [label for label, _ in columns.values()],
        "rows": rows,
        # columns of sentences keep a reading width on a narrow page (the table scrolls instead of a word a line)
        "prose": {i for i in range(len(columns)) if any(len(str(row[i])) > PROSE_CHARS for row in rows)},
        "more": max(len(frame) - limit, 0),
        "table": table,
    }


PROSE_CHARS = 60  # a cell longer than this is read as a sentence


def _pct(value) -> str:
    return f"{value:.1%}"


def _num(value) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:,.3g}"


@dataclass(frozen=True, eq=False)  # compared by identity: its arguments are tables
class Drawing:
    """A figure still to draw: figures.<name>(*args)."""

    name: str
    args: tuple


def draw(drawings: list[Drawing]) -> list[str]:
    """The SVG of each drawing, in order (a figure that failed: a note in its place)."""
    if not drawings:
        return []
    from . import figures  # matplotlib: imported by a report that has figures only

    return [_figure_or_note(figures, d) for d in drawings]


NOT_DRAWN = '<p class="figure-not-drawn">'  # how a figure that failed starts, in its place


def _figure_or_note(figures, drawing: Drawing) -> str:
    """The drawing's SVG. A figure that raises (a steplens bug, on an input no test had) becomes a note in its
    place naming the error, so that the rest of the report stands; STEPLENS_DEBUG=1 raises it."""
    try:
        return getattr(figures, drawing.name)(*drawing.args)
    except Exception as e:  # noqa: BLE001 - any bug of one figure; the note names it
        if os.environ.get("STEPLENS_DEBUG"):
            raise
        return (f"{NOT_DRAWN}{escape(f'Figure {drawing.name} not drawn: {type(e).__name__}: {e}')} (a steplens bug: "
                "rerun with STEPLENS_DEBUG=1 for the traceback and report it)</p>")


def _drawn(sections: list[dict], drawer, not_drawn: list[str] | None = None) -> list[dict]:
    """The sections with their figures drawn by `drawer` (drawings -> their SVGs, in order); the notes of the
    figures that failed are added to `not_drawn`."""
    blocks = [block for section in sections for block in section["blocks"]]
    svgs = list(drawer([content for kind, content in blocks if kind == "figure"]))
    if not_drawn is not None:
        not_drawn.extend(Markup(svg).striptags() for svg in svgs if svg.startswith(NOT_DRAWN))
    svgs = iter(svgs)
    for section in sections:
        section["blocks"] = [(kind, Markup(next(svgs)) if kind == "figure" else content)
                             for kind, content in section["blocks"]]
    return sections


def _kernel_cells(frame: pl.DataFrame, column: str, limit: int) -> dict[str, Cell]:
    """A kernel column's cells: each shown name's base name, the full demangled name in its tooltip. Base names are
    numbered over the whole table, shown rows or not: a name shared with a kernel further down is numbered too."""
    labels = kernel_labels(frame[column].to_list())
    return {name: Cell(labels[name], name) for name in frame.head(limit)[column].to_list()}


# How a column's cells are shown, by the name an analysis's section gives (or any function of the value).
FORMATS = {"text": str, "ms": ms, "size": size, "pct": _pct, "num": _num, "value": text_value,
           "words": lambda value: str(value).replace("_", " ").replace(",", ", ")}


class Section(dict):
    """A report section: a title and blocks shown in order (text, figure, table), or one line when empty.
    An analysis builds its own in its `section(page, run)` (page: this module's PAGE)."""

    def __init__(self, title: str, anchor: str, empty: str | None = None, **extra):
        super().__init__(title=title, id=anchor, empty=empty, blocks=[], **extra)

    def text(self, line: str) -> None:
        self["blocks"].append(("text", line))

    def figure(self, name: str, *args) -> None:
        """A figure drawn by reports/figures.<name>(*args) when the page is rendered."""
        self["blocks"].append(("figure", Drawing(name, args)))

    def table(self, table: dict) -> None:
        self["blocks"].append(("table", table))

    def rows(self, frame: pl.DataFrame | list[dict], columns: dict[str, tuple[str, object]], table: str,
             limit: int = TABLE_ROWS) -> None:
        """A table of `frame`'s first `limit` rows (a frame, or rows as dicts): {column: (header, format)}, the
        format a name in FORMATS, "kernel" (a kernel name with its signature in the tooltip) or a function."""
        shown = {}
        for name, (header, fmt) in columns.items():
            if fmt == "kernel":
                cells = _kernel_cells(frame, name, limit)
                fmt = cells.__getitem__
            shown[name] = (header, FORMATS[fmt] if isinstance(fmt, str) else fmt)
        self.table(_rows(frame, shown, table, limit))


class Page:
    """What an analysis's `section(page, run)` builds with: `page.section(title, anchor, empty=None)`, filled with
    text, figures (named by their function in reports/figures.py) and tables (`Section.rows`); `page.rows_shown`
    rows of a table are shown (its Parquet table has the rest)."""

    section = Section
    rows_shown = TABLE_ROWS

    def declared(self, analysis, run) -> Section | None:
        """A section from an analysis's declaration alone: its sentences, then each of its tables with the
        columns it documents, shown by their unit suffix (None: the analysis found nothing to say)."""
        if run.findings.get(analysis.name) is None:
            return None
        section = Section(analysis.title, analysis.name.replace("_", "-"))
        for line in analysis.phrase(run.findings[analysis.name], run.findings):
            section.text(line)
        for table, (arrow_schema, _docs) in analysis.writes.items():
            frame = run.table(table)
            if not frame.is_empty():
                section.rows(frame, {c: (_header(c), _by_unit(c)) for c in arrow_schema.names}, table)
        return section


PAGE = Page()


def key_numbers(run: Run) -> list[tuple[str, str]]:
    """The few numbers a reviewer reads first, each from a finding (label, value)."""
    f, m = run.findings, run.manifest
    numbers = []
    devices = m.get("environment", {}).get("device_names") or []
    # "none" without traces of any rank, as the terminal says: a bare "0" read as rank 0
    count = len(m.get("ranks") or [])
    traced = f"{count} (rank{'s' if count > 1 else ''} {number_ranges(m['ranks'])})" if count else "none"
    numbers.append(("ranks", f"{traced} of world size {m['world_size']}" if m.get("world_size") else traced))
    if devices:
        numbers.append(("device", ", ".join(devices)))
    step = f.get("step_time") or {}
    if step.get("median_ns") is not None:  # the verdict's first sentence says over which steps
        numbers.append((f"step time ({source_words(step, 'short')})",
                        f"median {ms(step['median_ns'])}, p90 {ms(step.get('p90_ns'))}" if step.get("steps", 0) > 1
                        else ms(step["median_ns"])))
    elif slow := step.get("slowest_step"):
        numbers.append(("profiled step time", f"median {ms(slow.get('median_step_ns'))}"))
    idle = f.get("gpu_idle") or {}
    if idle.get("idle_share") is not None:
        numbers.append(("GPU idle, whole traced window", f"{idle['idle_share']:.1%}"))
    if isinstance(f.get("mfu"), list) and f["mfu"]:  # the headline figure; the verdict gives the others beside it
        head = f["mfu"][0]
        numbers.append((f"{head['metric']} ({NUMERATOR_SHORT.get(head['numerator'], head['numerator'])})",
                        utilization_text(head['utilization'])))
    return numbers


NO_DEVICE_WORK = ("No device work in the traces (a CPU-only run): the per-rank step picture, CPU vs GPU and kernels need "
                  "GPU (or other accelerator) activity.")


def _no_traces(run: Run) -> str | None:
    """The one line for the trace sections of a run analysed from logs, monitors or the collector only."""
    if run.manifest.get("trace_ranks"):
        return None
    return ("No profiler traces in this run (logs, monitors or collector output only): the per-rank step picture, "
            "CPU vs GPU, kernels and collective kernels need torch.profiler traces.")


def _by_unit(column: str):
    """How to show a column, from its unit suffix (the contract names every unit)."""
    if column.endswith("_bytes"):
        return lambda v: size(v) if v is not None else text_value(v)
    if column.endswith("_ns") and not column.endswith(("ts_ns", "start_ns", "end_ns", "wall_ns")):  # durations only
        return lambda v: ms(v) if v is not None else text_value(v)
    return text_value


UNIT_SUFFIXES = ("_bytes", "_ns")


def _header(column: str) -> str:
    """A column's name as a header: words, without the unit suffix its cells already show."""
    for suffix in UNIT_SUFFIXES:
        column = column.removesuffix(suffix)
    return column.replace("_", " ")


# Facts the manifest holds under two names (the config's and the collector's): shown once.
FACT_ALIASES = {"train_micro_batch_size_per_gpu": "micro_batch", "gradient_accumulation_steps": "grad_accum"}
FACT_LABELS = {"micro_batch": "micro batch per GPU", "grad_accum": "gradient accumulation steps",
               "dp_world_size": "data-parallel ranks", "zero_stage": "ZeRO stage", "seq_len": "sequence length",
               "param_count": "parameters", "train_batch_size": "global batch (samples per step)"}


def _manifest_section(run: Run) -> dict:
    m, facts, env = run.manifest, run.manifest.get("facts", {}), run.manifest.get("environment", {})
    pairs = [
        ("run id", m.get("run_id")), ("world size", m.get("world_size")), ("ranks", _span(m.get("ranks", []))),
        ("devices", ", ".join(env.get("device_names", [])) or None),
        ("backend", ", ".join(env.get("backend", [])) or None), ("NCCL", ", ".join(env.get("nccl_version", [])) or None),
        ("CUDA runtime", ", ".join(map(cuda_version, env.get("cuda_runtime_version", []))) or None),
    ]
    shown = {"world_size"}
    for key, value in sorted(facts.items()):
        key = FACT_ALIASES.get(key, key)
        if key in shown or key in ("conflicts", "ds_config") or isinstance(value, (dict, list)):
            continue
        shown.add(key)
        pairs.append((FACT_LABELS.get(key, key.replace("_", " ")), value))
    sources = {}
    for s in m.get("sources", []):
        sources.setdefault((_input_kind(s), s["status"]), []).append(s["path"])
    table = {"header": ["input kind", "status", "files", "example"],
             "rows": [[kind, status, str(len(paths)), paths[0]] for (kind, status), paths in sorted(sources.items())],
             "prose": set(), "more": 0, "table": "run.json sources"}
    section = Section("Run and environment", "run", module="analyze/pipeline/ingest.py", facts=[(k, text_value(v)) for k, v in pairs if v not in (None, "")])
    section.table(table)
    if m.get("ignored_count"):
        section.text(f"{m['ignored_count']} file(s) in no format steplens reads were left alone "
                     "(listed in run.json, ignored_files).")
    if "ds_config" in facts:
        section["code"] = json.dumps(facts["ds_config"], indent=1, default=str)
    return section


def cuda_version(value: str) -> str:
    """Kineto records cudaRuntimeGetVersion's integer, 1000 x major + 10 x minor (CUDA Runtime API,
    cudaRuntimeGetVersion): 13000 is 13.0, 12040 is 12.4. A version already written out stays as it is."""
    if not value.isdigit():
        return value
    number = int(value)
    return f"{number // 1000}.{number % 1000 // 10}"


# What a file a trace importer looked at and found to be no trace is, by the importer that tried.
NOT_A_TRACE_KINDS = {"kineto": "JSON, not a trace", "nsys": "SQLite, not an nsys export"}


def _input_kind(source: dict) -> str:
    """The input kind the report lists: a ds_config.json or truth.json is JSON that is not a trace, not a Kineto input."""
    kind = source.get("kind", "kineto")
    reasons = {issue[1] for issue in source.get("issues", []) if isinstance(issue, list) and len(issue) == 4}
    if source.get("status") == "ignored" and "not_a_trace" in reasons:
        return NOT_A_TRACE_KINDS.get(kind, f"{kind}: not a trace")
    return kind


def _span(values: list[int]) -> str:
    if not values:
        return ""
    # Consecutive checked pairwise: a range built over values[0]..values[-1] would be as long as the span.
    consecutive = all(later - earlier == 1 for earlier, later in zip(values, values[1:]))
    return f"{values[0]}–{values[-1]}" if consecutive and len(values) > 2 else ", ".join(map(str, values))


class _Noted(dict):
    """The run's findings, noting each key a section reads."""

    def __init__(self, findings: dict, read: list):
        super().__init__(findings)
        self.read = read

    def __getitem__(self, key):
        self.read.append(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.append(key)
        return super().get(key, default)


class _Reading:
    """The run as a section builder sees it, noting the tables and findings it reads: the page names the modules
    that computed them beside the section (one hop from a number to its code)."""

    def __init__(self, run: Run):
        self.run, self.read = run, []
        self.manifest = run.manifest
        self.findings = _Noted(run.findings, self.read)

    def table(self, name: str, columns: list[str] | None = None) -> pl.DataFrame:
        self.read.append(name)
        return self.run.table(name, columns)


def _module(analysis) -> str:
    return "analyze/" + analysis.compute.__module__.removeprefix("steplens.analyze.").replace(".", "/") + ".py"


def computed_in(analysis, read: list[str]) -> str:
    """The modules behind a section: its analysis's, then those of the analyses whose tables or findings it read."""
    producers = {name: a for a in ANALYSES for name in [a.name, *a.writes, *a.former_keys]}
    modules = [_module(analysis)] + [_module(producers[name]) for name in read if name in producers]
    return ", ".join(dict.fromkeys(modules))


def _analysis_sections(analysis, run: Run) -> list[dict]:
    if analysis.section is None:
        return []
    reading = _Reading(run)
    made = analysis.section(PAGE, reading)
    made = made if isinstance(made, list) else [made] if made else []
    for section in made:
        section["module"] = computed_in(analysis, reading.read)
    return made


# The analyses' sections in the order a reviewer reads them; an analysis not named here shows its section after
# these (in ANALYSES' order), then the run and its environment, then the input problems.
SHOWN_FIRST = ("step_breakdown", "step_time", "gpu_idle", "top_kernels", "collectives", "mfu", "monitor_alarms",
               "job_end", "alarm_agreement", "autotune")
SHOWN_LAST = ("ingest_errors",)
DEVICE_PICTURES = ("gpu_idle", "top_kernels")  # sections of device work alone: none without it


def _shown(run: Run, device_work: bool, name: str, sections: list[dict]) -> list[dict]:
    """A trace section as a run without traces, or without device work, shows it: one line for the step picture,
    no device pictures, the collectives only where something else (the comms log) fills them."""
    traced = bool(run.manifest.get("trace_ranks"))
    if device_work:
        return sections
    unrecorded = traced and (run.findings.get("gpu_idle") or {}).get("runtime_calls_without_device_work")
    if name == "step_breakdown":
        empty = (_no_traces(run) if not traced else sentence(run.findings["gpu_idle"]["note"]) if unrecorded
                 else NO_DEVICE_WORK)
        return [Section("Where one step's time went", "time", empty=empty, module=sections[0]["module"])]
    if name in DEVICE_PICTURES or (name == "collectives" and unrecorded):  # no collective kernels could be seen
        return []
    if name == "collectives" and not traced:
        return [s for s in sections if s.get("empty") is None]  # logged comms only
    return sections


def render(out_dir: Path, drawer=draw, not_drawn: list[str] | None = None) -> str:
    """The page; `drawer` (drawings -> their SVGs, in order) draws its figures, here by default; the notes of
    figures that failed are added to `not_drawn`."""
    run = load(out_dir)
    named = {analysis.name: analysis for analysis in ANALYSES}
    middle = [a for a in ANALYSES if a.name not in SHOWN_FIRST + SHOWN_LAST]
    device_work = bool(run.manifest.get("trace_ranks")) and not run.table("kernel_launches", ["queue_ns"]).is_empty()
    sections = [s for a in [named[n] for n in SHOWN_FIRST] + middle
                for s in _shown(run, device_work, a.name, _analysis_sections(a, run))]
    sections.append(_manifest_section(run))
    sections += [s for name in SHOWN_LAST for s in _analysis_sections(named[name], run)]
    return TEMPLATES.get_template("report.html.j2").render(
        run=run, title=f"steplens report: {run.name}", first_screen=_first_screen(run, sections), verdict=verdict(run),
        numbers=key_numbers(run), sections=_drawn(sections, drawer, not_drawn), caveats=run.findings.get("caveats", []))


def _first_screen(run: Run, sections: list[dict]) -> list[tuple[str, str]]:
    """The verdict's first screen, each line linked to its section, or to the detailed sentences when the
    report has no such section."""
    shown = {section["id"] for section in sections if not section.get("empty")}
    return [(text, anchor if anchor in shown else "details") for text, anchor in first_screen(run.findings)]


def render_compare(result: dict) -> str:
    from .compare import METHOD, display_tables, headline

    figure = Markup(draw([Drawing("run_curves", (result["curves"],))])[0]) if not result["curves"].is_empty() else None
    return TEMPLATES.get_template("compare.html.j2").render(r=result, tables=display_tables(result), method=METHOD,
                                                            curves=figure, headline=headline(result),
                                                            shown_curves=result["curves"]["name"].n_unique()
                                                            if figure else 0)


def write(out_dir: Path, drawer=draw, not_drawn: list[str] | None = None) -> Path:
    """Render report.html into out_dir, atomically (figures drawn by `drawer`, as render)."""
    return write_atomic(Path(out_dir) / REPORT_FILE, render(out_dir, drawer, not_drawn))
