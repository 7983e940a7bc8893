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
import re
from dataclasses import dataclass
from pathlib import Path

import jinja2
import polars as pl
from markupsafe import Markup

from steplens.analyze.analyses import REGISTERED
from steplens.analyze.contract.schema import ALL_STREAMS

from . import roofline
from .data import ALARM_HEADER, Run, alarm_rows, kernel_labels, load, ms, size, text_value, write_atomic
from .verdict import NUMERATOR_SHORT, STEP_SOURCE_WORDS, first_screen, verdict

TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("steplens.reports", "templates"),
    autoescape=True,  # every {{ }} is escaped unless it is Markup
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
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


def _rows(frame: pl.DataFrame, columns: dict[str, tuple[str, callable]], table: str, limit: int = TABLE_ROWS) -> dict:
    """A table for the template: header and formatted cells (escaped later by the template), at most
    `limit` rows; the rest are counted and named by their Parquet table."""
    shown = frame.head(limit)
    return {
        "header": [label for label, _ in columns.values()],
        "rows": [[_keep_units(fmt(row[name])) if row[name] is not None else "" for name, (_, fmt) in columns.items()]
                 for row in shown.iter_rows(named=True)],
        "more": max(frame.height - limit, 0),
        "table": table,
    }


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
    """The SVG of each drawing, in order."""
    if not drawings:
        return []
    from . import figures  # matplotlib: imported by a report that has figures only

    return [getattr(figures, d.name)(*d.args) for d in drawings]


def _drawn(sections: list[dict], drawer) -> list[dict]:
    """The sections with their figures drawn by `drawer` (drawings -> their SVGs, in order)."""
    blocks = [block for section in sections for block in section["blocks"]]
    svgs = iter(drawer([content for kind, content in blocks if kind == "figure"]))
    for section in sections:
        section["blocks"] = [(kind, Markup(next(svgs)) if kind == "figure" else content)
                             for kind, content in section["blocks"]]
    return sections


class Section(dict):
    """A report section: a title and blocks shown in order (text, figure, table), or one line when empty."""

    def __init__(self, title: str, anchor: str, empty: str | None = None, **extra):
        super().__init__(title=title, id=anchor, empty=empty, blocks=[], **extra)

    def text(self, line: str) -> None:
        self["blocks"].append(("text", line))

    def figure(self, name: str, *args) -> None:
        """A figure drawn by figures.<name>(*args) when the page is rendered."""
        self["blocks"].append(("figure", Drawing(name, args)))

    def table(self, table: dict) -> None:
        self["blocks"].append(("table", table))


def key_numbers(run: Run) -> list[tuple[str, str]]:
    """The few numbers a reviewer reads first, each from a finding (label, value)."""
    f, m = run.findings, run.manifest
    numbers = []
    devices = m.get("environment", {}).get("device_names") or []
    # "none" without traces of any rank, as the terminal says: a bare "0" read as rank 0
    numbers.append(("ranks", f"{len(m.get('ranks', []))} of world size {m['world_size']}" if m.get("world_size")
                    else str(len(m["ranks"])) if m.get("ranks") else "none"))
    if devices:
        numbers.append(("device", ", ".join(devices)))
    step = f.get("step_time") or {}
    if step.get("median_ns") is not None:  # the verdict's first sentence says over which steps
        numbers.append((f"step time ({STEP_SOURCE_WORDS.get(step.get('source'), step.get('source'))})",
                        f"median {ms(step['median_ns'])}, p90 {ms(step.get('p90_ns'))}" if step.get("steps", 0) > 1
                        else ms(step["median_ns"])))
    elif slow := step.get("slowest_step"):
        numbers.append(("profiled step time", f"median {ms(slow.get('median_step_ns'))}"))
    idle = f.get("gpu_idle") or {}
    if idle.get("idle_share") is not None:
        numbers.append(("GPU idle", f"{idle['idle_share']:.1%}"))
    if isinstance(f.get("mfu"), list) and f["mfu"]:  # the headline figure; the verdict gives the others beside it
        head = f["mfu"][0]
        numbers.append((f"{head['metric']} ({NUMERATOR_SHORT.get(head['numerator'], head['numerator'])})",
                        f"{head['utilization']:.1%}"))
    return numbers


MIN_SERIES_STEPS = 3  # fewer steps are a table, not a curve
STEP_SOURCES = {"train_steps": "the collector (every step)", "log": "the job's logs",
                "profiler_steps": "the profiled ProfilerSteps"}


def _time_section(run: Run) -> dict:
    breakdown, timeline = run.table("step_breakdown"), run.table("step_timeline")
    title = "Where one step's time went"
    if breakdown.is_empty():
        return Section(title, "time", empty="No device work inside profiled steps (CPU-only traces, no kernels, "
                                            "or no ProfilerStep annotations).")
    section = Section(title, "time")
    step = timeline["step"][0] if not timeline.is_empty() else breakdown["step"].max()
    section.text(f"ProfilerStep#{step}, the slowest profiled step (longest wall time across ranks): each rank's device "
                 "time split into compute, communication not hidden behind compute, and idle by cause.")
    section.figure("step_breakdown_bars", breakdown.filter(pl.col("step") == step))
    if not timeline.is_empty():
        offsets = run.table("clock_offsets")
        refused = [] if offsets.is_empty() else offsets.filter(pl.col("method").str.starts_with("refused: "))["rank"].to_list()
        offsets = offsets.filter(~pl.col("rank").is_in(refused)) if refused else offsets
        aligned = not offsets.is_empty() and offsets["offset_ns"].is_not_null().all() and offsets.height > 1
        clock = ("ranks aligned on collective end times (clock_offsets)" if aligned
                 else "one rank" if offsets.height <= 1 else "ranks NOT aligned (no collectives to match): each on its own clock")
        left_out = (f"; rank(s) {', '.join(map(str, refused))} left out: not one job with the others (clock_offsets)"
                    if refused else "")
        section.text(f"The same step over time ({clock}{left_out}); gaps under 1/1000 of the step are not drawn.")
        section.figure("step_gantt", timeline)
    return section


def _steps_section(run: Run) -> dict:
    series, stats, times = run.table("step_time"), run.table("step_stats"), run.table("step_times")
    if series.is_empty() and stats.is_empty():
        return Section("Step time over the run", "steps",
                       empty="No step times: no collector steps, no step lines in the logs and no ProfilerStep annotations.")
    section = Section("Step time over the run", "steps")
    # Where the analyzer placed the profiled windows in the run's own step numbering.
    profiled = [w["step"] for w in ((run.findings.get("step_time") or {}).get("profiled_steps") or {}).get("steps", [])]
    if not series.is_empty():
        source = series["source"][0]
        definition = series["definition"][0] if "definition" in series.columns else None
        section.text(f"Step time from {STEP_SOURCES.get(source, source)}" + (f". {definition[0].upper()}{definition[1:]}"
                                                                              if definition else "") + ".")
        if series.height >= MIN_SERIES_STEPS:
            section.figure("step_time_series", series, profiled, (run.findings.get("step_time") or {}).get("p90_ns"))
        excluded = series.filter(pl.col("excluded").fill_null(False))
        if not excluded.is_empty():
            section.text("Steps left out of the summary, and why:")
            section.table(_rows(excluded, {"step": ("step", str), "step_time_ns": ("step time", ms), "reason": ("reason", _reason)},
                                "step_time"))
    if not stats.is_empty():
        if stats.height > 1 and stats["ranks"].max() > 1:  # one step or one rank: a table, not a heatmap
            section.figure("step_heatmap", times)
        section.text("Profiled steps (CPU ProfilerStep time, over ranks)" +
                     (f"; the {TABLE_ROWS} slowest of {stats.height}:" if stats.height > TABLE_ROWS else ":"))
        shown = stats.sort("max_dur_ns", descending=True) if stats.height > TABLE_ROWS else stats.sort("step")
        section.table(_rows(shown, {
            "step": ("step", str), "ranks": ("ranks", str), "median_dur_ns": ("median over ranks", ms),
            "max_dur_ns": ("longest", ms), "slowest_rank": ("rank with the longest", str),
            "spread_ns": ("longest - shortest", ms), "straggler_rank": ("straggler", str),
            "others_waited_ns": ("others waited for it", ms), "aligned_dur_ns": ("wall time across ranks", ms)},
            "step_stats"))
    return section


NO_DEVICE_WORK = ("No device work in the traces (a CPU-only run): the per-rank step picture, CPU vs GPU and kernels need "
                  "GPU (or other accelerator) activity.")


def _no_traces(run: Run) -> str | None:
    """The one line for the trace sections of a run analysed from logs, monitors or the collector only."""
    if run.manifest.get("trace_ranks"):
        return None
    return ("No profiler traces in this run (logs, monitors or collector output only): the per-rank step picture, "
            "CPU vs GPU, kernels and collective kernels need torch.profiler traces.")


def _reason(value) -> str:
    return str(value).replace("_", " ").replace(",", ", ")


def _cpu_gpu_section(run: Run) -> dict:
    launches = run.table("kernel_launches", ["queue_ns"])  # one row per device activity: read only what is drawn
    idle, sync = run.table("gpu_idle"), run.table("sync_points")
    if launches.is_empty():
        return Section("CPU vs GPU", "cpu-gpu", empty="No device activity in the traces (CPU-only run or no kernels).")
    section = Section("CPU vs GPU", "cpu-gpu")
    if (launches["queue_ns"] > 0).any():
        section.figure("launch_delay", launches)
    whole_window = idle.filter((pl.col("stream") == ALL_STREAMS) & pl.col("step").is_null())
    if not whole_window.is_empty():
        section.text("Device idle over the whole traced window, per rank, by cause:")
        section.figure("idle_by_cause", whole_window)
    section.text("Launch APIs per rank, most GPU time first:")
    section.table(_rows(run.table("launch_summary").sort("gpu_ns_total", descending=True), {
        "rank": ("rank", str), "launch_api": ("launch API", str), "activities": ("activities", _num),
        "api_ns_median": ("API call median", ms), "queue_ns_median": ("queueing median", ms),
        "queue_ns_p90": ("queueing p90", ms), "gpu_ns_total": ("GPU time launched", ms)}, "launch_summary"))
    if not sync.is_empty():
        section.text("Synchronization points that left the GPU idle longest (the CPU waited on the GPU):")
        section.table(_rows(sync, {
            "rank": ("rank", str), "step": ("step", str), "name": ("call", str), "issuing_op": ("issued by", str),
            "dur_ns": ("call duration", ms), "idle_caused_ns": ("GPU idle caused", ms)}, "sync_points"))
    return section


def _kernels_section(run: Run) -> dict:
    categories, top = run.table("category_summary"), run.table("top_kernels")
    if top.is_empty():
        return Section("Kernels", "kernels", empty="No kernels in the traces.")
    section = Section("Kernels", "kernels")
    section.table(_rows(categories, {"category": ("category", str), "kernels": ("activities", _num),
                                     "time_ns": ("GPU time (all ranks)", ms), "share": ("share", _pct)},
                        "category_summary"))
    section.text("Top kernels by total GPU time (hover a name for the full signature):")
    labels = kernel_labels(top.head(TABLE_ROWS)["name"].to_list())
    section.table(_rows(top, {"name": ("kernel", lambda name: Cell(labels[name], name)), "category": ("category", str),
                              "calls": ("calls", _num),
                              "time_ns": ("total", ms), "mean_ns": ("mean per call", ms),
                              "min_rank_time_ns": ("least on a rank", ms), "max_rank_time_ns": ("most on a rank", ms)},
                        "top_kernels"))
    return section


def _sentence(note: str) -> str:
    return note[0].upper() + note[1:] + ("" if note.endswith(".") else ".")


def _collectives_section(run: Run) -> dict:
    summary, sites, logged = run.table("collective_summary"), run.table("collective_call_sites"), run.table("comms_log_stats")
    if summary.is_empty() and logged.is_empty():
        note = (run.findings.get("collectives") or {}).get("comms_note")
        return Section("Collectives", "collectives", empty=_sentence(note or "No collectives recorded."))
    section = Section("Collectives", "collectives")
    if not summary.is_empty():
        if summary["busbw_median_gbps"].is_not_null().any():
            section.figure("busbw_by_size", summary.filter(pl.col("busbw_median_gbps").is_not_null()))
        else:
            section.text("No bandwidth plot: the traces do not give these collectives' message sizes "
                         "(no record_param_comms sizes).")
        section.text("Per collective and message size, most exposed first (exposed: not hidden behind compute, "
                     "on the rank where it was most exposed):")
        section.table(_rows(summary, {
            "op": ("collective", str), "bytes": ("size S", size), "calls": ("calls (all ranks)", _num),
            "kernel_ns": ("kernel time (all ranks)", ms), "max_rank_exposed_ns": ("exposed, worst rank", ms),
            "max_exposed_rank": ("worst rank", str), "median_rank_exposed_ns": ("exposed, median rank", ms),
            "busbw_median_gbps": ("median busbw GB/s", _num)}, "collective_summary"))
        section.text("Per call site (the CPU op that issued the collective):")
        section.table(_rows(sites, {"issuing_op": ("call site", str), "op": ("collective", str),
                                    "calls": ("calls (all ranks)", _num), "max_rank_exposed_ns": ("exposed, worst rank", ms),
                                    "max_exposed_rank": ("worst rank", str)}, "collective_call_sites"))
    if not logged.is_empty():
        section.text("Communication calls timed by DeepSpeed's comms logger or the collector (synchronizing timers, "
                     "one source per rank: see Method and caveats):")
        section.table(_rows(logged.sort("total_latency_ns", descending=True), {
            "op": ("op", str), "nccl_bytes": ("size S", size), "group_size": ("ranks in group", str),
            "calls": ("calls", _num), "median_latency_ns": ("median latency", ms), "p90_latency_ns": ("p90 latency", ms),
            "total_latency_ns": ("total latency", ms), "median_busbw_gbps": ("median busbw GB/s", _num),
            "latency_origin": ("latency from", str)}, "comms_log_stats"))
    return section


def _mfu_section(run: Run) -> dict:
    profile = run.table("flops_profile")
    section = Section("FLOPs and MFU", "mfu")
    utilization = run.findings.get("mfu")
    if isinstance(utilization, list) and utilization:
        section.text("Median over steps, with the numerator and peak each number divides:")
        section.table(_rows(pl.DataFrame(utilization), {
            "metric": ("metric", str), "utilization": ("median", _pct), "numerator": ("numerator", str),
            "peak": ("peak", str), "definition": ("definition", str)}, "mfu"))
    else:
        note = (utilization or {}).get("note", "not computed") if isinstance(utilization, dict) else "not computed"
        section.text(f"MFU not computed: {note}.")
    if not profile.is_empty():
        modules = profile.filter(pl.col("depth") <= 2).sort("flops_total", descending=True, nulls_last=True).with_columns(
            duration_ns=pl.when(~pl.col("duration_bogus").fill_null(False)).then(pl.col("duration_ns")))  # see caveats
        section.text("FLOPs profiler, modules to depth 2 (theoretical counts, not time):")
        section.table(_rows(modules, {
            "source": ("from", str), "path": ("module", str), "module_class": ("class", str), "params": ("params", _num),
            "flops_total": ("FLOPs incl. children", _num), "macs_total": ("MACs incl. children", _num),
            "duration_ns": ("forward time", ms)}, "flops_profile"))
    for kind, content in roofline.report_blocks(run.findings.get("roofline")):  # computed in analyze/analyses/roofline.py
        section.figure(*content) if kind == "figure" else getattr(section, kind)(content)
    return section


def _monitor_section(run: Run) -> dict:
    series = run.table("scalar_series")
    if series.is_empty():
        return Section("Monitor curves", "monitor", empty="No monitor scalars (csv_monitor, TensorBoard, W&B or collector).")
    section = Section("Monitor curves", "monitor")
    names = sorted(set(series.filter(pl.col("aligned_points") > 1)["name"].to_list()))
    if names:
        shown = _preferred(names)
        scalars = run.table("scalars").filter(pl.col("name").is_in(shown) & pl.col("global_samples").is_not_null()
                                              & pl.col("value").is_finite())
        section.figure("curves", scalars, "global_samples", shown)
    section.table(_rows(series, {"origin": ("from", str), "name": ("scalar", str), "points": ("points", _num),
                                 "aligned_points": ("on global samples", _num), "ranks": ("ranks", _num)},
                        "scalar_series"))
    return section


# The curves a reviewer looks for first, as patterns on the scalar's name.
PREFERRED_CURVES = [re.compile(p) for p in (r"loss", r"grad.?norm", r"(^|[/_])lr($|[/_])",
                                            r"samplespersec|throughput|step.?time", r"mem")]
MAX_CURVES = 6


def _preferred(names: list[str]) -> list[str]:
    def rank(name: str) -> int:
        return next((i for i, pattern in enumerate(PREFERRED_CURVES) if pattern.search(name.lower())), len(PREFERRED_CURVES))

    return sorted(names, key=lambda n: (rank(n), n))[:MAX_CURVES]


# Analyses of logs, monitors and autotuning: (column, header) pairs a reader needs (the Parquet
# tables have the rest).
EXTRA_TABLES = {
    "autotune_verdict": ("Autotuning verdict", [("tuning_space", "tuning space"), ("winner", "winner"),
                                                ("runner_up", "runner-up"), ("relative_difference", "difference"),
                                                ("established", "established"), ("trials_needed", "trials needed"),
                                                ("pick_mismatch", "DeepSpeed's pick disagrees"), ("detail", "detail")]),
    "autotune_ranking": ("Autotuning experiments", [("tuning_space", "tuning space"), ("rank", "rank"),
                                                    ("experiment", "experiment"), ("zero_stage", "ZeRO stage"),
                                                    ("micro_batch", "micro batch"), ("grad_accum", "grad accum"),
                                                    ("trials", "trials"), ("statuses", "statuses"), ("metric", "metric"),
                                                    ("median", "median"), ("spread", "max - min"),
                                                    ("environment_differs", "environment differs"), ("error", "error")]),
}


def _alarms_section(run: Run) -> dict | None:
    """Every alarm: in the job, in the replay of the same rules, post hoc over every series (tables
    alarm_agreement and monitor_alarms)."""
    rows = alarm_rows(run)
    if not rows:
        return None
    section = Section("Alarms", "alarms")
    frame = pl.DataFrame(rows, schema=ALARM_HEADER, orient="row", strict=False)
    section.table(_rows(frame, {c: (c, text_value) for c in ALARM_HEADER}, "alarm_agreement, monitor_alarms"))
    return section


def _extra_analyses(run: Run) -> list[dict]:
    sections = [s for s in [_alarms_section(run)] if s]
    for name, (title, columns) in EXTRA_TABLES.items():
        frame = run.table(name)
        if frame.is_empty():
            continue
        section = Section(title, name.replace("_", "-"))
        section.table(_rows(frame, {c: (header, text_value) for c, header in columns}, name))
        sections.append(section)
    return sections


def _by_unit(column: str):
    """How to show a column, from its unit suffix (the contract names every unit)."""
    if column.endswith("_bytes"):
        return lambda v: size(v) if v is not None else text_value(v)
    if column.endswith("_ns") and not column.endswith(("ts_ns", "start_ns", "end_ns", "wall_ns")):  # durations only
        return lambda v: ms(v) if v is not None else text_value(v)
    return text_value


def _registered_sections(run: Run) -> list[dict]:
    """A section per registered analysis with something to say: its sentences, then its tables with
    the columns its declaration documents (the column meaning is the header's tooltip)."""
    sections = []
    for analysis in REGISTERED:
        if analysis.name not in run.findings:
            continue
        section = Section(analysis.title, analysis.name.replace("_", "-"))
        for line in analysis.phrase(run.findings[analysis.name], run.findings):
            section.text(line)
        for table, (arrow_schema, _docs) in analysis.writes.items():
            frame = run.table(table)
            if frame.is_empty():
                continue
            if table in TABLE_VIEWS:
                section.text(TABLE_VIEWS[table][0])
                section.table(TABLE_VIEWS[table][1](frame))
            else:
                section.table(_rows(frame, {c: (_header(c), _by_unit(c)) for c in arrow_schema.names}, table))
        sections.append(section)
    return sections


UNIT_SUFFIXES = ("_bytes", "_ns")


def _header(column: str) -> str:
    """A column's name as a header: words, without the unit suffix its cells already show."""
    for suffix in UNIT_SUFFIXES:
        column = column.removesuffix(suffix)
    return column.replace("_", " ")


MEMORY_KEYS = ("rank", "source", "label", "peak_allocated_bytes", "peak_reserved_bytes", "peak_scope", "resolution_bytes")
PEAK_SCOPES = {"step": "within the step", "since_start": "since the start", "since_last_report": "since the last report"}


def _memory_rows(frame: pl.DataFrame) -> dict:
    """memory_by_step with the consecutive steps of one rank and source that hold the same figures as one
    row (a running peak repeats for every step once reached)."""
    ordered = frame.sort("rank", "source", "step", nulls_last=True)
    changed = pl.any_horizontal([pl.col(c).ne_missing(pl.col(c).shift(1)) for c in MEMORY_KEYS])
    runs = ordered.with_columns(run=changed.fill_null(True).cum_sum()).group_by("run", maintain_order=True).agg(
        *[pl.col(c).first() for c in MEMORY_KEYS], first_step=pl.col("step").first(), last_step=pl.col("step").last(),
        steps=pl.len(), samples=pl.col("samples").sum())
    runs = runs.with_columns(step_span=pl.struct("first_step", "last_step", "steps"))
    return _rows(runs, {
        "rank": ("rank", str), "step_span": ("steps", _step_span), "source": ("source", _reason),
        "label": ("where", str), "peak_allocated_bytes": ("peak allocated", size),
        "peak_reserved_bytes": ("peak reserved", size), "peak_scope": ("peak over", lambda v: PEAK_SCOPES.get(v, _reason(v))),
        "samples": ("samples", _num), "resolution_bytes": ("rounded to", lambda v: "exact" if v == 0 else size(v))},
        "memory_by_step")


def _step_span(span: dict) -> str:
    first, last, count = span["first_step"], span["last_step"], span["steps"]
    if first is None:
        return "outside any step" if count == 1 else f"outside any step ({count} rows)"
    return str(first) if count == 1 else f"{first}–{last} ({count} rows)"


# Registered tables shown otherwise than column by column: (a line before it, the table).
TABLE_VIEWS = {"memory_by_step": ("Rows of one rank and source with the same figures over consecutive steps are shown as "
                                  "one (all rows: the memory_by_step table).", _memory_rows)}


def _comparability_section(run: Run) -> dict | None:
    fields = run.table("run_comparability")
    if fields.is_empty():
        return None
    section = Section("What another run must match to be compared", "run-comparability")
    section.table(_rows(fields, {"field": ("field", str), "required": ("required to compare", text_value),
                                 "values": ("this run", _run_values), "status": ("status", str)},
                        "run_comparability", limit=fields.height))
    return section


def _run_values(values: str) -> str:
    """run_comparability's JSON {run: value} as text: the value alone for one run."""
    decoded = json.loads(values)
    if len(decoded) == 1:
        return text_value(next(iter(decoded.values())))
    return ", ".join(f"{run}: {text_value(value)}" for run, value in decoded.items())


def _status_section(run: Run) -> dict | None:
    status = run.table("run_status")
    if status.is_empty():
        return None
    section = Section("How the job ended", "status")
    section.table(_rows(status, {
        "source": ("file", str), "run_index": ("run in the file", str), "rank": ("rank", str), "status": ("status", str),
        "exit_code": ("exit code", str), "error": ("error", str)}, "run_status"))
    return section


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
             "more": 0, "table": "run.json sources"}
    section = Section("Run and environment", "run", facts=[(k, text_value(v)) for k, v in pairs if v not in (None, "")])
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


def _issues_section(run: Run) -> dict:
    issues = run.table("ingest_issues")
    if issues.is_empty():
        return Section("Ingest issues", "issues", empty="None: every input was read completely.")
    order = pl.col("severity").replace_strict({"error": 0, "warning": 1, "info": 2}, default=3)
    section = Section("Ingest issues", "issues")
    section.table(_rows(issues.sort(order, "file"), {
        "severity": ("severity", str), "file": ("file", str), "rank": ("rank", str), "reason": ("reason", str),
        "count": ("count", _num), "detail": ("detail", str)}, "ingest_issues"))
    return section


# Where each section's numbers are computed (the report only renders them), named in the page's source beside the
# section so that a reader goes from a number to its code in one hop; ARCHITECTURE.md has the same table.
SECTION_MODULES = {
    "time": "analyze/analyses/step_breakdown.py", "steps": "analyze/analyses/step_time.py, analyze/analyses/steps.py",
    "cpu-gpu": "analyze/analyses/launch.py", "kernels": "analyze/analyses/kernels.py",
    "collectives": "analyze/analyses/comms.py, analyze/analyses/summaries.py, analyze/analyses/comms_log.py",
    "mfu": "analyze/analyses/mfu.py, analyze/analyses/op_perf.py, analyze/analyses/roofline.py",
    "monitor": "analyze/analyses/monitor.py", "status": "analyze/analyses/job_end.py",
    "alarms": "analyze/analyses/alarm_agreement.py, analyze/analyses/monitor.py",
    "autotune-verdict": "analyze/analyses/autotune.py", "autotune-ranking": "analyze/analyses/autotune.py",
    "run-comparability": "analyze/analyses/monitor.py", "run": "analyze/pipeline/ingest.py",
    "issues": "analyze/contract/issue_reasons.py",
}


def section_module(section_id: str) -> str:
    """The module(s) computing a section's numbers: the table above, or a registered analysis's own module."""
    if section_id in SECTION_MODULES:
        return SECTION_MODULES[section_id]
    analysis = next(a for a in REGISTERED if a.name.replace("_", "-") == section_id)
    return "analyze/" + analysis.compute.__module__.removeprefix("steplens.analyze.").replace(".", "/") + ".py"


def render(out_dir: Path, drawer=draw) -> str:
    """The page; `drawer` (drawings -> their SVGs, in order) draws its figures, here by default."""
    run = load(out_dir)
    if not run.manifest.get("trace_ranks"):  # one line for every picture that needs traces
        sections = [Section("Where one step's time went", "time", empty=_no_traces(run)), _steps_section(run)]
        sections += [s for s in [_collectives_section(run)] if s.get("empty") is None]  # logged comms
    elif run.table("kernel_launches", ["queue_ns"]).is_empty():  # no device work recorded: no device pictures
        unrecorded = (run.findings.get("gpu_idle") or {}).get("runtime_calls_without_device_work")
        empty = _sentence(run.findings["gpu_idle"]["note"]) if unrecorded else NO_DEVICE_WORK
        sections = [Section("Where one step's time went", "time", empty=empty), _steps_section(run)]
        sections += [] if unrecorded else [_collectives_section(run)]  # no collective kernels could be seen
    else:
        sections = [_time_section(run), _steps_section(run), _cpu_gpu_section(run), _kernels_section(run),
                    _collectives_section(run)]
    sections += [_mfu_section(run), _monitor_section(run)]
    sections += [s for s in [_status_section(run)] if s] + _extra_analyses(run) + _registered_sections(run)
    sections += [s for s in [_comparability_section(run)] if s] + [_manifest_section(run), _issues_section(run)]
    return TEMPLATES.get_template("report.html.j2").render(
        run=run, title=f"steplens report: {run.name}", first_screen=_first_screen(run, sections), verdict=verdict(run),
        numbers=key_numbers(run), sections=_drawn(sections, drawer), caveats=run.findings.get("caveats", []),
        module_of=section_module)


def _first_screen(run: Run, sections: list[dict]) -> list[tuple[str, str]]:
    """The verdict's first screen, each line linked to its section, or to the detailed sentences when the
    report has no such section."""
    shown = {section["id"] for section in sections if not section.get("empty")}
    return [(text, anchor if anchor in shown else "details") for text, anchor in first_screen(run.findings)]


def render_compare(result: dict) -> str:
    from .compare import METHOD, display_tables, headline

    figure = Markup(draw([Drawing("run_curves", (result["curves"],))])[0]) if not result["curves"].is_empty() else None
    return TEMPLATES.get_template("compare.html.j2").render(r=result, tables=display_tables(result), method=METHOD,
                                                            curves=figure, headline=headline(result))


def write(out_dir: Path, drawer=draw) -> Path:
    """Render report.html into out_dir, atomically (figures drawn by `drawer`, as render)."""
    return write_atomic(Path(out_dir) / REPORT_FILE, render(out_dir, drawer))
