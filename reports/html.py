"""The self-contained HTML report: one file, inline CSS and SVG, no script, no external request.

Every string that comes from a trace or a log (kernel names, op names, file names, error lines) is
untrusted: the Jinja2 environment autoescapes everything, and only the SVG that matplotlib wrote
is marked safe. A Content-Security-Policy meta tag forbids scripts and any fetch, so even a
rendering mistake cannot make the page call out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2
import polars as pl
from markupsafe import Markup

from . import caveats, figures
from .data import Run, load, ms, size, write_atomic
from .verdict import verdict

TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("steplens.reports", "templates"),
    autoescape=True,  # every {{ }} is escaped unless it is Markup
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
TABLE_ROWS = 20  # rows shown per table; the Parquet tables hold the rest
REPORT_FILE = "report.html"
SUMMARY_FILE = "summary.md"


def _rows(frame: pl.DataFrame, columns: dict[str, tuple[str, callable]], limit: int = TABLE_ROWS) -> dict:
    """A table for the template: header and formatted cells (escaped later by the template)."""
    shown = frame.head(limit)
    return {
        "header": [label for label, _ in columns.values()],
        "rows": [[fmt(row[name]) if row[name] is not None else "" for name, (_, fmt) in columns.items()]
                 for row in shown.iter_rows(named=True)],
        "more": max(frame.height - limit, 0),
    }


def _pct(value) -> str:
    return f"{value:.1%}"


def _num(value) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:,.3g}"


def _text(value) -> str:
    return str(value)


class Section(dict):
    """A report section: a title and blocks shown in order (text, figure, table), or one line when empty."""

    def __init__(self, title: str, anchor: str, empty: str | None = None, **extra):
        super().__init__(title=title, id=anchor, empty=empty, blocks=[], **extra)

    def text(self, line: str) -> None:
        self["blocks"].append(("text", line))

    def figure(self, svg: str) -> None:
        self["blocks"].append(("figure", Markup(svg)))

    def table(self, table: dict) -> None:
        self["blocks"].append(("table", table))


def _manifestSection(run: Run) -> dict:
    m, facts, env = run.manifest, run.manifest.get("facts", {}), run.manifest.get("environment", {})
    pairs = [
        ("run id", m.get("run_id")), ("world size", m.get("world_size")), ("ranks", _span(m.get("ranks", []))),
        ("devices", ", ".join(env.get("device_names", [])) or None),
        ("backend", ", ".join(env.get("backend", [])) or None), ("NCCL", ", ".join(env.get("nccl_version", [])) or None),
        ("CUDA runtime", ", ".join(env.get("cuda_runtime_version", [])) or None),
    ]
    pairs += [(key.replace("_", " "), value) for key, value in sorted(facts.items())
              if key not in ("conflicts", "ds_config") and not isinstance(value, (dict, list))]
    sources = {}
    for s in m.get("sources", []):
        sources.setdefault((s.get("kind", "kineto"), s["status"]), []).append(s["path"])
    table = {"header": ["input kind", "status", "files", "example"],
             "rows": [[kind, status, str(len(paths)), paths[0]] for (kind, status), paths in sorted(sources.items())],
             "more": 0}
    section = Section("Run and environment", "run", facts=[(k, str(v)) for k, v in pairs if v not in (None, "")])
    section.table(table)
    if m.get("ignored_count"):
        section.text(f"{m['ignored_count']} file(s) in no format steplens reads were left alone "
                                     "(listed in run.json, ignored_files).")
    if "ds_config" in facts:
        section["code"] = json.dumps(facts["ds_config"], indent=1, default=str)
    return section


def _span(values: list[int]) -> str:
    if not values:
        return ""
    return f"{values[0]}–{values[-1]}" if values == list(range(values[0], values[-1] + 1)) and len(values) > 2 \
        else ", ".join(map(str, values))


def _stepsSection(run: Run) -> dict:
    times, stats = run.table("step_times"), run.table("step_stats")
    train = run.table("train_steps")
    if times.is_empty() and train.is_empty():
        return Section("Step time", "steps", empty="No step boundaries: no ProfilerStep annotations and no collector steps.")
    section = Section("Step time", "steps")
    if not times.is_empty():
        section.figure(figures.step_heatmap(times))
        if stats.height > TABLE_ROWS:
            section.text(f"The {TABLE_ROWS} slowest of {stats.height} steps:")
            stats = stats.sort("max_dur_ns", descending=True)
        section.table(_rows(stats.sort("step") if stats.height <= TABLE_ROWS else stats, {
            "step": ("step", _text), "ranks": ("ranks", _text), "median_dur_ns": ("median", ms),
            "max_dur_ns": ("slowest", ms), "slowest_rank": ("slowest rank", _text), "spread_ns": ("spread", ms),
            "straggler_rank": ("straggler", _text), "others_waited_ns": ("others waited", ms),
            "aligned_dur_ns": ("aligned wall", ms)}))
    if not train.is_empty():
        per_step = (train.group_by("rank", "step").agg(pl.col("dur_ns").sum(), pl.col("global_samples").max())
                    .group_by("step").agg(pl.col("dur_ns").median().alias("median"), pl.col("dur_ns").max().alias("max"),
                                          pl.col("global_samples").max()).sort("step"))
        section.text("Optimizer steps recorded by the collector (sum of micro steps, over ranks):")
        section.table(_rows(per_step, {"step": ("step", _text), "global_samples": ("global samples", _num),
                                                  "median": ("median", ms), "max": ("slowest rank", ms)}))
    return section


def _cpu_gpuSection(run: Run) -> dict:
    launches = run.table("kernel_launches", ["queue_ns"])  # one row per device activity: read only what is drawn
    idle, sync = run.table("gpu_idle"), run.table("sync_points")
    if launches.is_empty():
        return Section("CPU vs GPU", "cpu-gpu", empty="No device activity in the traces (CPU-only run or no kernels).")
    section = Section("CPU vs GPU", "cpu-gpu")
    if (launches["queue_ns"] > 0).any():
        section.figure(figures.launch_delay(launches))
    device_idle = idle.filter(pl.col("stream") == -1)
    if not device_idle.is_empty():
        section.figure(figures.idle_by_cause(device_idle))
    summary = (run.table("launch_summary").group_by("launch_api").agg(
        pl.col("activities", "gpu_ns_total").sum(), pl.col("api_ns_median", "queue_ns_median", "queue_ns_p90").median(),
        ranks=pl.len()).sort("gpu_ns_total", descending=True))
    section.text("Launch APIs (medians over ranks of the per-rank medians):")
    section.table(_rows(summary, {
        "launch_api": ("launch API", _text), "ranks": ("ranks", _num), "activities": ("activities", _num),
        "api_ns_median": ("API median", ms), "queue_ns_median": ("queue median", ms), "queue_ns_p90": ("queue p90", ms),
        "gpu_ns_total": ("GPU time", ms)}))
    if not sync.is_empty():
        section.text("Top synchronization points (the CPU waited on the GPU, which then idled):")
        section.table(_rows(sync, {
            "rank": ("rank", _text), "step": ("step", _text), "name": ("call", _text), "issuing_op": ("issued by", _text),
            "dur_ns": ("duration", ms), "idle_caused_ns": ("GPU idle caused", ms)}))
    return section


def _kernelsSection(run: Run) -> dict:
    categories, top = run.table("kernel_categories"), run.table("top_kernels")
    if top.is_empty():
        return Section("Kernels", "kernels", empty="No kernels in the traces.")
    section = Section("Kernels", "kernels")
    total = categories["time_ns"].sum()
    by_category = categories.group_by("category").agg(pl.col("time_ns", "kernels").sum()).sort("time_ns", descending=True)
    by_category = by_category.with_columns(share=pl.col("time_ns") / total)
    section.table(_rows(by_category, {"category": ("category", _text), "kernels": ("activities", _num),
                                                 "time_ns": ("GPU time (all ranks)", ms), "share": ("share", _pct)}))
    section.table(_rows(top, {"name": ("kernel", _text), "category": ("category", _text), "calls": ("calls", _num),
                                         "time_ns": ("total", ms), "mean_ns": ("mean", ms),
                                         "min_rank_time_ns": ("least on a rank", ms),
                                         "max_rank_time_ns": ("most on a rank", ms)}))
    return section


def _collectivesSection(run: Run) -> dict:
    calls, logged = run.table("collectives"), run.table("comms_log_stats")
    if calls.is_empty() and logged.is_empty():
        note = run.findings.get("comms_note", "No collectives recorded.")
        return Section("Collectives", "collectives", empty=note)
    section = Section("Collectives", "collectives")
    if not calls.is_empty():
        section.figure(figures.busbw_by_size(calls))
        by_op = (calls.group_by("op", "bytes").agg(calls=pl.len(), time=pl.col("dur_ns").sum(),
                                                     exposed=pl.col("exposed_ns").sum(),
                                                     overlapped=pl.col("overlapped_ns").sum(),
                                                     busbw=pl.col("busbw_gbps").median())
                 .sort("exposed", descending=True))
        section.table(_rows(by_op, {"op": ("collective", _text), "bytes": ("size S", size), "calls": ("calls", _num),
                                               "time": ("kernel time", ms), "exposed": ("exposed", ms),
                                               "overlapped": ("overlapped", ms), "busbw": ("median busbw GB/s", _num)}))
        sites = (calls.group_by("issuing_op", "op").agg(calls=pl.len(), exposed=pl.col("exposed_ns").sum())
                 .sort("exposed", descending=True))
        section.text("Per call site (the CPU op that issued the collective):")
        section.table(_rows(sites, {"issuing_op": ("call site", _text), "op": ("collective", _text),
                                               "calls": ("calls", _num), "exposed": ("exposed", ms)}))
    if not logged.is_empty():
        section.text("Communication calls timed by DeepSpeed's comms logger or the collector (synchronizing timers, "
                     "one source per rank: see Method and caveats):")
        section.table(_rows(logged.sort("total_latency_ns", descending=True), {
            "op": ("op", _text), "nccl_bytes": ("size S", size), "group_size": ("ranks in group", _text),
            "calls": ("calls", _num), "median_latency_ns": ("median latency", ms), "p90_latency_ns": ("p90", ms),
            "total_latency_ns": ("total", ms), "median_busbw_gbps": ("median busbw GB/s", _num),
            "latency_origin": ("latency", _text)}))
    return section


def _mfuSection(run: Run) -> dict:
    mfu, profile = run.table("mfu"), run.table("flops_profile")
    section = Section("FLOPs and MFU", "mfu")
    if mfu.is_empty():
        section.text("MFU: " + (run.findings.get("mfu") or {}).get("note", "not computed") + ".")
    else:
        summary = mfu.group_by("metric", "numerator", "peak", "definition").agg(
            pl.col("utilization").median().alias("median"), pl.col("utilization").min().alias("min"),
            pl.col("utilization").max().alias("max"), pl.len().alias("steps")).sort("metric", descending=True)
        section.table(_rows(summary, {"metric": ("metric", _text), "median": ("median", _pct),
                                                 "min": ("min", _pct), "max": ("max", _pct), "steps": ("rows", _num),
                                                 "numerator": ("numerator", _text), "peak": ("peak", _text),
                                                 "definition": ("definition", _text)}))
    if not profile.is_empty():
        modules = profile.filter(pl.col("depth") <= 2).sort("flops_total", descending=True, nulls_last=True)
        section.text("FLOPs profiler, modules to depth 2 (theoretical counts, not time):")
        section.table(_rows(modules, {
            "source": ("from", _text), "path": ("module", _text), "module_class": ("class", _text), "params": ("params", _num),
            "flops_total": ("FLOPs incl. children", _num), "macs_total": ("MACs incl. children", _num),
            "duration_ns": ("fwd duration", ms), "duration_bogus": ("duration is a profiler error", _text)}))
    return section


def _monitorSection(run: Run) -> dict:
    scalars = run.table("scalars")
    if scalars.is_empty():
        return Section("Monitor curves", "monitor", empty="No monitor scalars (csv_monitor, TensorBoard, W&B or collector).")
    section = Section("Monitor curves", "monitor")
    aligned = scalars.filter(pl.col("global_samples").is_not_null() & pl.col("value").is_finite())
    names = (aligned.group_by("name").len().filter(pl.col("len") > 1).sort("name")["name"].to_list())
    if names:
        section.figure(figures.curves(aligned, "global_samples", _preferred(names)))
    counts = scalars.group_by("origin", "name").agg(points=pl.len(), ranks=pl.col("rank").n_unique()).sort("origin", "name")
    section.table(_rows(counts, {"origin": ("from", _text), "name": ("scalar", _text),
                                            "points": ("points", _num), "ranks": ("ranks", _num)}, limit=40))
    return section


# The curves a reviewer looks for first, as patterns on the scalar's name.
PREFERRED_CURVES = [re.compile(p) for p in (r"loss", r"grad.?norm", r"(^|[/_])lr($|[/_])",
                                            r"samplespersec|throughput|step.?time", r"mem")]
MAX_CURVES = 6


def _preferred(names: list[str]) -> list[str]:
    def rank(name: str) -> int:
        return next((i for i, pattern in enumerate(PREFERRED_CURVES) if pattern.search(name.lower())), len(PREFERRED_CURVES))

    return sorted(names, key=lambda n: (rank(n), n))[:MAX_CURVES]


# Analyses of logs, monitors and autotuning, with the columns a reader needs (the Parquet tables
# have the rest).
EXTRA_TABLES = {
    "monitor_alarms": ("Monitor alarms", ["alarm", "name", "global_samples", "step", "value", "baseline", "score", "detail"]),
    "autotune_verdict": ("Autotuning verdict", ["tuning_space", "winner", "runner_up", "relative_difference", "established",
                                                "trials_needed", "pick_mismatch", "pick_detail", "detail"]),
    "autotune_ranking": ("Autotuning experiments", ["tuning_space", "rank", "experiment", "zero_stage", "micro_batch",
                                                    "grad_accum", "trials", "statuses", "metric", "median", "spread",
                                                    "environment_differs", "error"]),
    "run_comparability": ("What another run must match to be compared", ["field", "required", "status", "values", "detail"]),
}


def _extra_analyses(run: Run) -> list[dict]:
    sections = []
    for name, (title, columns) in EXTRA_TABLES.items():
        frame = run.table(name)
        if frame.is_empty():
            continue
        section = Section(title, name.replace("_", "-"))
        section.table(_rows(frame, {c: (c.replace("_", " "), _cell) for c in columns}))
        sections.append(section)
    return sections


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _statusSection(run: Run) -> dict | None:
    status = run.table("run_status")
    if status.is_empty():
        return None
    section = Section("How the job ended", "status")
    section.table(_rows(status, {
        "source": ("file", _text), "run_index": ("run", _text), "rank": ("rank", _text), "status": ("status", _text),
        "exit_code": ("exit code", _text), "error": ("error", _text)}))
    return section


def _issuesSection(run: Run) -> dict:
    issues = run.table("ingest_issues")
    if issues.is_empty():
        return Section("Ingest issues", "issues", empty="None: every input was read completely.")
    order = pl.col("severity").replace_strict({"error": 0, "warning": 1, "info": 2}, default=3)
    section = Section("Ingest issues", "issues")
    section.table(_rows(issues.sort(order, "file"), {
        "severity": ("severity", _text), "file": ("file", _text), "rank": ("rank", _text), "reason": ("reason", _text),
        "count": ("count", _num), "detail": ("detail", _text)}, limit=50))
    return section


def render(out_dir: Path) -> str:
    run = load(out_dir)
    sections = [_manifestSection(run), _stepsSection(run), _cpu_gpuSection(run), _kernelsSection(run),
                _collectivesSection(run), _mfuSection(run), _monitorSection(run)]
    sections += [s for s in [_statusSection(run)] if s] + _extra_analyses(run) + [_issuesSection(run)]
    return TEMPLATES.get_template("report.html.j2").render(
        run=run, title=f"steplens report: {run.name}", verdict=verdict(run), sections=sections,
        caveats=caveats.caveats(run))


def render_compare(result: dict) -> str:
    from .compare import METHOD, display_tables, headline

    figure = Markup(figures.run_curves(result["curves"])) if not result["curves"].is_empty() else None
    return TEMPLATES.get_template("compare.html.j2").render(r=result, tables=display_tables(result), method=METHOD,
                                                            curves=figure, headline=headline(result))


def write(out_dir: Path) -> Path:
    """Render report.html into out_dir, atomically."""
    return write_atomic(Path(out_dir) / REPORT_FILE, render(out_dir))
