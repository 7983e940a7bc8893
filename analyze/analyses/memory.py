"""Device memory per rank and step: the peaks, whether they grow, and an out-of-memory end.

Three sources, each row saying which:

* trace: the `[memory]` events of a trace recorded with profile_memory=True. Each carries the device
  allocator's totals after the allocation or free, so the largest total in a ProfilerStep is that
  step's exact peak (for the recorded window).
* collector: torch.cuda.max_memory_allocated/reserved at the end of each train_steps row. The
  collector never resets the peak, so a step's figure is the running peak up to that step (unless the
  job resets it: DeepSpeed's see_memory_usage does).
* logs: DeepSpeed's see_memory_usage lines (peak since the previous call, which resets it; figures
  rounded to 0.01 GiB), its throughput line's MemAllocated / MaxMemAllocated (running peak at each
  steps_per_print step, 0.01 GiB, no reserved figure) and Megatron's report_memory line (running peak
  after N iterations).

Growth is judged on one series per rank (the collector's, else the trace's, else the logs': the first
with enough steps), after the warm-up steps: the Theil-Sen slope of the peak over the steps, against
the scatter around it.
An out-of-memory end is read from the run_status errors (the last exception of a failed run).
"""

from __future__ import annotations

import re

import numpy as np
import polars as pl
import pyarrow as pa

from steplens.analyze.analyses import job_end
from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.analyses.step_time import superseded
from steplens.analyze.contract import schema
from steplens.analyze.contract.failures import DEVICE_OOM, OOM
from steplens.analyze.contract.units import binary_bytes

MEMORY_BY_STEP = schema.table_spec(
    ("rank", pa.int64(), "Rank."),
    ("step", pa.int64(), "Optimizer step (ProfilerStep#N for traces); null: outside any step, or not said."),
    ("source", pa.string(), "trace ([memory] events) | collector (train_steps) | see_memory_usage | "
                            "deepspeed_throughput | megatron_report_memory (log lines)."),
    ("label", pa.string(), "Where in the run, for log figures (see_memory_usage's message, e.g. After Building Model)."),
    ("peak_allocated_bytes", pa.int64(), "Largest allocated device memory: trace, the largest Total Allocated in the "
                                         "step; collector, max_memory_allocated at the step's end; logs, Max_MA."),
    ("peak_reserved_bytes", pa.int64(), "Largest reserved (cached) device memory, likewise (logs: the larger of CA and Max_CA)."),
    ("peak_scope", pa.string(), "step (the peak within the step) | since_start (the process's running peak up to the "
                                "step) | since_last_report (see_memory_usage: since its previous call)."),
    ("samples", pa.int64(), "[memory] events, train_steps rows or log lines behind the row."),
    ("resolution_bytes", pa.int64(), "Rounding of the figures: 0 exact; 0.01 GiB for see_memory_usage and "
                                     "deepspeed_throughput."),
)

# Series preferred for judging growth, best first: the collector sees every step, a trace a window.
SERIES_ORDER = ("collector", "trace", "megatron_report_memory", "deepspeed_throughput", "see_memory_usage")
# The first steps allocate the optimizer states and fill the caching allocator: not growth.
WARM_UP_STEPS = 2
MIN_GROWTH_STEPS = 4  # steps left after the warm-up to judge growth on
# Growth counts when the fitted rise over the kept steps exceeds 3 robust standard deviations of the
# scatter around the fit, and 1% of the starting level (below that: allocator block rounding).
GROWTH_NOISE_Z = 3.0
MIN_GROWTH_FRACTION = 0.01
MAD_TO_SD = 1.4826  # normal-consistent MAD scale
MAX_SLOPE_POINTS = 2000  # Theil-Sen pairs grow as n^2: longer series are thinned evenly

# PyTorch's OOM message (c10/cuda/CUDACachingAllocator.cpp): "Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB
# total capacity; ...)" or "... GPU 0 has a total capacity of 79.15 GiB of which 1.2 GiB is free".
TRIED = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) ?([KMGT]i?B|B)\b")
CAPACITY = re.compile(r"(\d+(?:\.\d+)?) ?([KMGT]i?B) total capacity|total capacity of (\d+(?:\.\d+)?) ?([KMGT]i?B)")
UNIT_BYTES = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,  # PyTorch's format_size: binary
              "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}


def _trace_rows(inputs: Inputs) -> pl.DataFrame:
    events = inputs.table("trace_events", ["rank", "step", "total_allocated_bytes", "total_reserved_bytes"],
                          where=(pl.col("kind") == "memory") & pl.col("total_allocated_bytes").is_not_null())
    return events.group_by("rank", "step").agg(
        peak_allocated_bytes=pl.col("total_allocated_bytes").max(), peak_reserved_bytes=pl.col("total_reserved_bytes").max(),
        samples=pl.len(),
    ).with_columns(source=pl.lit("trace"), label=pl.lit(None, pl.String), peak_scope=pl.lit("step"), resolution_bytes=pl.lit(0))


def _collector_rows(train_steps: pl.DataFrame) -> pl.DataFrame:
    # the timeline the job went on with: an earlier job's rows in the same folder are another job's memory
    recorded = train_steps.filter(~superseded(train_steps) & pl.col("max_allocated_bytes").is_not_null())
    return recorded.group_by("rank", "step").agg(
        peak_allocated_bytes=pl.col("max_allocated_bytes").max(), peak_reserved_bytes=pl.col("max_reserved_bytes").max(),
        samples=pl.len(),
    ).with_columns(source=pl.lit("collector"), label=pl.lit(None, pl.String), peak_scope=pl.lit("since_start"),
                   resolution_bytes=pl.lit(0))


def _log_rows(inputs: Inputs) -> pl.DataFrame:
    lines = inputs.table("memory_usage")
    return lines.select(
        "rank", "step", source="origin", label="message",
        peak_allocated_bytes=pl.max_horizontal("allocated_bytes", "max_allocated_bytes"),
        peak_reserved_bytes=pl.max_horizontal("reserved_bytes", "max_reserved_bytes"),
        peak_scope=pl.when(pl.col("origin") == "see_memory_usage").then(pl.lit("since_last_report"))
        .otherwise(pl.lit("since_start")),
        samples=pl.lit(1), resolution_bytes="resolution_bytes",
    )


def theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(slope, intercept): the median of the pairwise slopes, and the median of y - slope x (Sen 1968)."""
    if len(x) > MAX_SLOPE_POINTS:
        keep = np.linspace(0, len(x) - 1, MAX_SLOPE_POINTS).round().astype(int)
        x, y = x[keep], y[keep]
    i, j = np.triu_indices(len(x), k=1)
    dx = x[j] - x[i]
    slope = float(np.median((y[j] - y[i])[dx != 0] / dx[dx != 0]))
    return slope, float(np.median(y - slope * x))


def growth(rows: pl.DataFrame) -> dict | None:
    """Growth of one rank's peak allocated memory over the steps of one source, after the warm-up."""
    series = rows.filter(pl.col("step").is_not_null()).sort("step")
    if series.height - WARM_UP_STEPS < MIN_GROWTH_STEPS:
        return None
    kept = series.slice(WARM_UP_STEPS)
    x = kept["step"].to_numpy().astype(float)
    y = kept["peak_allocated_bytes"].to_numpy().astype(float)
    slope, intercept = theil_sen(x, y)
    noise = MAD_TO_SD * float(np.median(np.abs(y - (intercept + slope * x))))
    quarter = max(1, len(y) // 4)
    first, last = float(np.median(y[:quarter])), float(np.median(y[-quarter:]))
    rise = slope * (x[-1] - x[0])
    resolution = float(kept["resolution_bytes"].max())
    floor = max(GROWTH_NOISE_Z * noise, MIN_GROWTH_FRACTION * first, resolution)
    # Figures printed to a resolution (0.01 GiB) move in whole steps of it: a value sitting on a rounding boundary
    # reads one step higher on a later print, and a running peak keeps that step for good. Growth needs the last
    # quarter at least two steps above the first.
    apart = last - first > 1.5 * resolution if resolution else last > first
    return {
        "rank": rows["rank"][0], "source": rows["source"][0], "first_step": int(x[0]), "last_step": int(x[-1]),
        "steps": len(y), "first_bytes": round(first), "last_bytes": round(last),
        "slope_bytes_per_step": slope, "fitted_rise_bytes": round(rise), "noise_bytes": round(noise),
        "growing": bool(rise > floor and apart),
    }


def _size_bytes(number: str, unit: str) -> int:
    return round(float(number) * UNIT_BYTES[unit])


def out_of_memory(inputs: Inputs) -> dict | None:
    """The out-of-memory end, when a run's last error is one: its kind, rank, step and sizes where said."""
    status = inputs.table("run_status")
    errors = status.filter(pl.col("error").is_not_null() & pl.col("error").str.contains(f"(?i){OOM.pattern}"))
    if errors.is_empty():
        return None
    device = errors.filter(pl.col("error").str.contains(f"(?i){DEVICE_OOM.pattern}"))
    row = (device if not device.is_empty() else errors).sort("rank", nulls_last=True).row(0, named=True)
    rank = row["rank"]
    if rank is None:  # a launcher log's error names no rank: the one rank whose own record says failed
        failed = status.filter((pl.col("status") == "failed") & pl.col("rank").is_not_null())["rank"].unique()
        rank = failed[0] if failed.len() == 1 else None
    progress = job_end.progress(inputs.table("train_steps"), inputs.table("step_timers"), inputs.table("scalars"),
                                inputs.facts)
    finished = progress.filter(pl.col("rank") == rank) if rank is not None else progress
    last = finished["last_step"].drop_nulls()
    error = row["error"]
    tried, capacity = TRIED.search(error), CAPACITY.search(error)
    return {
        "kind": "device" if not device.is_empty() else "host", "rank": rank, "source": row["source"],
        # The step that was running: one past the last one finished (by the rank, else by every rank).
        "step": int(last.min()) + 1 if last.len() else None, "error": error[:500],
        "tried_bytes": _size_bytes(tried[1], tried[2]) if tried else None,
        "capacity_bytes": (_size_bytes(capacity[1], capacity[2]) if capacity[1] else _size_bytes(capacity[3], capacity[4]))
        if capacity else None,
    }


def _host_run(inputs: Inputs, train_steps: pl.DataFrame) -> bool:
    """A run on DeepSpeed's cpu accelerator, whose throughput line's MemAllocated is host memory: the log says
    so, or the traces hold no device work, or the collector recorded no device."""
    context = inputs.context
    return (inputs.facts.get("ds_accelerator") == "cpu" or (context is not None and context.device_activity is False)
            or (not train_steps.is_empty() and train_steps["max_allocated_bytes"].is_null().all()))


def memory(inputs: Inputs) -> Output:
    train_steps = inputs.table("train_steps")
    logged = _log_rows(inputs)
    if _host_run(inputs, train_steps):
        logged = logged.filter(pl.col("source") != "deepspeed_throughput")
    rows = pl.concat([frame.select(MEMORY_BY_STEP[0].names) for frame in
                      (_trace_rows(inputs), _collector_rows(train_steps), logged)], how="vertical_relaxed")
    rows = rows.sort("rank", "source", "step", nulls_last=True)
    oom = out_of_memory(inputs)
    if rows.is_empty() and oom is None and train_steps.is_empty():
        return Output()
    peaks = [
        {"rank": r["rank"], "peak_allocated_bytes": r["peak_allocated_bytes"], "step": r["step"], "source": r["source"],
         "peak_reserved_bytes": rank_rows["peak_reserved_bytes"].max()}
        for rank_rows in rows.partition_by("rank", maintain_order=True)
        for r in [_peak_row(rank_rows)]
    ]
    growths = []
    for rank_rows in rows.partition_by("rank", maintain_order=True):
        # the best series with enough steps (Megatron reports memory once; the throughput line every print)
        present = [s for s in SERIES_ORDER if s in rank_rows["source"].to_list()]
        if judged := next(filter(None, (growth(rank_rows.filter(pl.col("source") == s)) for s in present)), None):
            growths.append(judged)
    finding = {
        "sources": sorted(rows["source"].unique().to_list()),
        "device_memory_recorded": not rows.is_empty(),
        "collector_without_device": not train_steps.is_empty() and train_steps["max_allocated_bytes"].is_null().all(),
        "peak_by_rank": peaks, "growth": growths, "out_of_memory": oom,
    }
    return Output(tables={"memory_by_step": rows}, finding=finding)


def _peak_row(rank_rows: pl.DataFrame) -> dict:
    """The row of a rank's peak: the largest, unless a more exact figure is as large within the larger one's
    rounding (Megatron's exact 7176.14 MiB against the throughput line's 7.01 GiB, which rounds 7.0079 up)."""
    ordered = rank_rows.sort("peak_allocated_bytes", descending=True, nulls_last=True)
    top = ordered.row(0, named=True)
    if top["peak_allocated_bytes"] is None:
        return top
    near = ordered.filter(pl.col("peak_allocated_bytes") >= top["peak_allocated_bytes"] - top["resolution_bytes"])
    return near.sort("resolution_bytes", "peak_allocated_bytes", descending=[False, True]).row(0, named=True)


# Log lines that print memory in GiB with two decimals (DeepSpeed: round(bytes / 1024**3, 2), labelled "GB").
LOGGED_IN_GIB = ("see_memory_usage", "deepspeed_throughput")
# Where a peak was read, in words for the sentences (the table keeps the source's key)
SOURCE_WORDS = {"collector": "the collector's step records", "trace": "the traces' [memory] events",
                "megatron_report_memory": "Megatron's memory report", "see_memory_usage": "DeepSpeed's see_memory_usage",
                "deepspeed_throughput": "DeepSpeed's throughput lines"}


def size_text(num_bytes: float, source: str | None = None) -> str:
    """Memory with two decimals, as PyTorch's memory_summary and DeepSpeed's see_memory_usage print it; a figure
    from a log that printed it in GiB stays in GiB (0.39 GiB, not a false 399.36 MiB)."""
    if source in LOGGED_IN_GIB:
        return f"{num_bytes / 2**30:.2f} GiB"
    return binary_bytes(num_bytes, decimals=2)


def memory_lines(finding: dict) -> list[str]:
    """At most four sentences however many ranks: the out-of-memory end, the highest peak and the
    spread over ranks, the ranks whose memory grows (per-rank figures are in memory_by_step)."""
    lines = []
    if oom := finding["out_of_memory"]:
        who = f"rank {oom['rank']}" if oom["rank"] is not None else "a rank the logs do not name"
        when = f" in step {oom['step']}" if oom["step"] is not None else ""
        sizes = (f" while allocating {size_text(oom['tried_bytes'])}" if oom["tried_bytes"] is not None else "") + (
            f" of a {size_text(oom['capacity_bytes'])} device" if oom["capacity_bytes"] is not None else "")
        lines.append(f"The job ended out of {oom['kind']} memory on {who}{when}{sizes}: {oom['error'][:200]}")
    if not finding["device_memory_recorded"]:
        lines.append("No device memory was recorded: " + (
            "the collector ran without a CUDA/ROCm device (a CPU job), and no trace or log gave device memory figures "
            "(a CPU job's logged MemAllocated is host memory, left out)."
            if finding["collector_without_device"] else "no [memory] events, collector peaks or memory log lines."))
    if peaks := finding["peak_by_rank"]:
        top = max(peaks, key=lambda p: (p["peak_allocated_bytes"], -p["rank"]))
        where = f"step {top['step']}" if top["step"] is not None else "outside the steps"
        reserved = (f", {size_text(top['peak_reserved_bytes'], top['source'])} reserved"
                    if top["peak_reserved_bytes"] is not None else "")
        others = ""
        if len(peaks) > 1:
            low = min(peaks, key=lambda p: (p["peak_allocated_bytes"], p["rank"]))
            others = (f"; every one of the {len(peaks)} ranks peaks at the same"
                      if low["peak_allocated_bytes"] == top["peak_allocated_bytes"]
                      else f"; the lowest of the {len(peaks)} ranks peaks at "
                           f"{size_text(low['peak_allocated_bytes'], low['source'])}")
        lines.append(f"Peak memory: {size_text(top['peak_allocated_bytes'], top['source'])} allocated{reserved} on rank {top['rank']} "
                     f"({where}, from {SOURCE_WORDS.get(top['source'], top['source'])}){others}.")
    growing = [g for g in finding["growth"] if g["growing"]]
    if growing:
        worst = max(growing, key=lambda g: g["slope_bytes_per_step"])
        ranks = ", ".join(str(g["rank"]) for g in growing)
        logged = worst["source"]
        lines.append(f"Memory grows on rank(s) {ranks}: up to {size_text(worst['slope_bytes_per_step'])} per step on rank "
                     f"{worst['rank']} over steps {worst['first_step']}-{worst['last_step']} "
                     f"({size_text(worst['first_bytes'], logged)} -> {size_text(worst['last_bytes'], logged)}, "
                     f"{worst['source']}), beyond the step-to-step noise ({size_text(worst['noise_bytes'])}).")
    elif finding["growth"]:
        lines.append(f"No memory growth beyond the step-to-step noise on the {len(finding['growth'])} rank(s) with enough "
                     "steps to judge.")
    return lines


def memory_headline(finding: dict) -> str | None:
    """The first screen's line: an out-of-memory end, else growth beyond the noise."""
    if oom := finding["out_of_memory"]:
        who = f" on rank {oom['rank']}" if oom["rank"] is not None else ""
        return f"Out of {oom['kind']} memory{who}" + (f" in step {oom['step']}" if oom["step"] is not None else "")
    if growing := [g for g in finding["growth"] if g["growing"]]:
        worst = max(growing, key=lambda g: g["slope_bytes_per_step"])
        return f"Memory grows {size_text(worst['slope_bytes_per_step'])} per step on rank {worst['rank']}"
    return None


MEMORY_KEYS = ("rank", "source", "label", "peak_allocated_bytes", "peak_reserved_bytes", "peak_scope", "resolution_bytes")
PEAK_SCOPES = {"step": "within the step", "since_start": "since the start", "since_last_report": "since the last report"}


def _step_span(span: dict) -> str:
    first, last, count = span["first_step"], span["last_step"], span["steps"]
    if first is None:
        return "outside any step" if count == 1 else f"outside any step ({count} rows)"
    return str(first) if count == 1 else f"{first}–{last} ({count} rows)"


def _words(value) -> str:
    return str(value).replace("_", " ").replace(",", ", ")


def memory_section(page, run):
    """The sentences, then memory_by_step with the consecutive steps of one rank and source that hold the same
    figures as one row (a running peak repeats for every step once reached)."""
    if run.findings.get("memory") is None:
        return None
    section = page.section(ANALYSIS.title, "memory")
    for line in memory_lines(run.findings["memory"]):
        section.text(line)
    frame = run.table("memory_by_step")
    if frame.is_empty():
        return section
    ordered = frame.sort("rank", "source", "step", nulls_last=True)
    changed = pl.any_horizontal([pl.col(c).ne_missing(pl.col(c).shift(1)) for c in MEMORY_KEYS])
    runs = ordered.with_columns(run=changed.fill_null(True).cum_sum()).group_by("run", maintain_order=True).agg(
        *[pl.col(c).first() for c in MEMORY_KEYS], first_step=pl.col("step").first(), last_step=pl.col("step").last(),
        steps=pl.len(), samples=pl.col("samples").sum())
    runs = runs.with_columns(step_span=pl.struct("first_step", "last_step", "steps"))
    section.text("Rows of one rank and source with the same figures over consecutive steps are shown as one (all rows: "
                 "the memory_by_step table).")
    section.rows(runs, {
        "rank": ("rank", "text"), "step_span": ("steps", _step_span), "source": ("source", "words"),
        "label": ("where", "text"), "peak_allocated_bytes": ("peak allocated", "size"),
        "peak_reserved_bytes": ("peak reserved", "size"), "peak_scope": ("peak over", lambda v: PEAK_SCOPES.get(v, _words(v))),
        "samples": ("samples", "num"), "resolution_bytes": ("rounded to", lambda v: "exact" if v == 0 else binary_bytes(v))},
        "memory_by_step")
    return section


ANALYSIS = Analysis(
    name="memory",
    title="Memory per rank and step",
    reads=("trace_events", "train_steps", "memory_usage", "run_status", "step_timers", "scalars"),
    writes={"memory_by_step": MEMORY_BY_STEP},
    compute=memory,
    phrase=lambda finding, findings: memory_lines(finding),
    headline=memory_headline,
    section=memory_section,
)
