"""Plots as inline SVG text: the report stays one file that opens offline.

Every figure is drawn from an aggregate table (never raw events), so its size does not grow with
the trace. Labels that come from traces are passed to matplotlib as plain text (usetex off,
math text off), and the SVG is embedded as markup the template marks safe: matplotlib escapes
text it writes into SVG.
"""

from __future__ import annotations

import functools
import io
import warnings

import matplotlib
import matplotlib.collections
import matplotlib.lines
import matplotlib.patches
import matplotlib.ticker
import numpy as np
import polars as pl
from matplotlib.backends.backend_agg import RendererAgg
from matplotlib.figure import Figure

from steplens.analyze.analyses.roofline import on_the_roofline
from steplens.analyze.contract.text import safe_text
from steplens.analyze.contract.units import binary_bytes

# Figures are made with the object API, never pyplot: no GUI backend, no global figure registry, and
# a third of a second less to import on every run.
matplotlib.rcParams.update({
    "svg.fonttype": "none",  # text stays text: smaller files, searchable, no glyph paths
    "text.usetex": False,
    "text.parse_math": False,  # a kernel name with $ signs is not math
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "svg.hashsalt": "steplens",  # fixed element ids: the same data gives the same bytes
})


# Log axes print ticks as math text by default; math parsing is off (trace labels are not math).
PLAIN_NUMBER = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")


RASTER_DPI = 150  # for the parts of a figure drawn as an embedded image
LABELLED_OPS = 3  # roofline points named beside the point; more in a few square inches run into a blob


def _subplots(*grid, figsize: tuple[float, float], **options):
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*grid, **options)


@functools.cache
def _measuring_renderer(dpi: float) -> RendererAgg:
    """One Agg renderer per dpi to measure every figure's text with: matplotlib caches a text's size per renderer,
    so the tick labels, axis labels and legend entries the figures share are measured once a run. It draws
    nothing (its canvas is one pixel): text sizes depend on the dpi alone."""
    return RendererAgg(1, 1, dpi)


def _svg(fig) -> str:
    """The figure cropped to what it draws (legends above the axes included), as inline SVG.

    savefig's bbox_inches="tight" finds that box by a whole SVG draw to nowhere before the real one;
    measuring the same artists with an Agg renderer costs a third of that draw (0.03-0.05 s a figure),
    and the box, padded as "tight" pads it, is then given to savefig."""
    buffer = io.StringIO()
    with warnings.catch_warnings():  # a label from a trace in a script the font lacks (or a control character)
        warnings.filterwarnings("ignore", message="Glyph .* missing from font", category=UserWarning)
        box = fig.get_tightbbox(_measuring_renderer(fig.dpi))
        fig.savefig(buffer, format="svg", bbox_inches=box.padded(matplotlib.rcParams["savefig.pad_inches"]),
                    metadata={"Date": None}, dpi=RASTER_DPI)
    text = buffer.getvalue()
    # Labels come from traces and logs: matplotlib escapes markup in them, not control or invisible characters.
    return safe_text(text[text.index("<svg"):])  # the XML prolog and doctype dropped: inline SVG does not take them


def step_heatmap(step_times: pl.DataFrame) -> str:
    """CPU step time per rank (rows) x step (columns)."""
    grid = step_times.pivot(on="step", index="rank", values="cpu_dur_ns", aggregate_function="max").sort("rank")
    steps = [c for c in grid.columns if c != "rank"]
    values = grid.select(steps).to_numpy() / 1e6
    fig, ax = _subplots(figsize=(min(2 + 0.35 * len(steps), 11), min(1 + 0.28 * grid.height, 9)))
    image = ax.imshow(values, aspect="auto", cmap="viridis", interpolation="nearest")
    _index_ticks(ax.xaxis, steps)
    _index_ticks(ax.yaxis, grid["rank"].to_list())
    ax.set_xlabel("ProfilerStep")
    ax.set_ylabel("rank")
    fig.colorbar(image, ax=ax, label="CPU step time (ms)")
    return _svg(fig)


MAX_TICKS = 24  # hundreds of tick labels make the figure unreadable and slow to lay out


def _index_ticks(axis, labels: list) -> None:
    """Ticks at cell indices labelled with the step or rank they stand for, at most MAX_TICKS of them."""
    axis.set_major_locator(matplotlib.ticker.MaxNLocator(MAX_TICKS, integer=True))
    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda value, _: str(labels[int(value)]) if 0 <= int(value) < len(labels) and value == int(value) else ""))


# One colour per activity, the same in every figure: compute blue, communication red, idle greys/orange.
ACTIVITY_COLORS = {"compute": "#4c72b0", "exposed communication": "#c44e52", "idle": "#d9d9d9",
                   "host-bound idle": "#dd8452", "sync idle": "#8172b3", "other idle": "#b0b0b0"}


def _rank_height(ranks: int) -> float:
    return min(1.0 + 0.32 * ranks, 12)


def _rank_axis(ax, labels: list[str]) -> None:
    """Rows top to bottom in the order given, at most MAX_TICKS labelled (hundreds of ranks stay legible)."""
    ax.set_ylim(len(labels) - 0.4, -0.6)
    if len(labels) <= MAX_TICKS:
        ax.set_yticks(range(len(labels)), labels)
    else:
        _index_ticks(ax.yaxis, labels)
    ax.set_ylabel("rank")


def _bars(ax, rows, starts, lengths, thickness: float, colour: str, label: str | None = None, horizontal: bool = True,
          sticky: bool = True, rasterized: bool = False) -> None:
    """Bars from starts[i] to starts[i] + lengths[i] centred on row rows[i], as one collection: Axes.bar, barh
    and broken_barh make an artist per bar or per row, and creating and drawing those was most of a bar chart's
    time, growing with the ranks (the same pixels). `sticky`: autoscaled as bar and barh are, the axis starting
    where the bars do."""
    rows, starts = np.asarray(rows, dtype=float), np.asarray(starts, dtype=float)
    low, high, ends = rows - thickness / 2, rows + thickness / 2, starts + lengths
    if horizontal:
        corners = np.stack([np.column_stack(c) for c in ((starts, low), (starts, high), (ends, high), (ends, low))], axis=1)
    else:
        corners = np.stack([np.column_stack(c) for c in ((low, starts), (high, starts), (high, ends), (low, ends))], axis=1)
    bars = matplotlib.collections.PolyCollection(corners, facecolors=colour, edgecolors="none", linewidths=0, label=label,
                                                 rasterized=rasterized)
    if sticky:
        (bars.sticky_edges.x if horizontal else bars.sticky_edges.y).extend(starts.tolist())
    ax.add_collection(bars)


def step_breakdown_bars(breakdown: pl.DataFrame) -> str:
    """One step's device time per rank, stacked: compute, exposed communication, idle by cause."""
    rows = breakdown.sort("rank", "device")
    labels = [str(r) for r in rows["rank"].to_list()]
    if len(set(labels)) < len(labels):  # several devices per rank
        labels = [f"{r}/gpu{d}" for r, d in rows.select("rank", "device").iter_rows()]
    fig, ax = _subplots(figsize=(7.5, _rank_height(rows.height)))
    left = np.zeros(rows.height)
    for column, label in (("compute_ns", "compute"), ("exposed_comm_ns", "exposed communication"),
                          ("host_bound_ns", "host-bound idle"), ("sync_ns", "sync idle"), ("other_ns", "other idle")):
        values = rows[column].fill_null(0).to_numpy() / 1e6
        _bars(ax, range(rows.height), left, values, 0.7, ACTIVITY_COLORS[label], label)
        left = left + values
    _rank_axis(ax, labels)
    ax.set_xlabel("device time in the step (ms)")
    ax.legend(frameon=False, ncols=5, loc="lower left", bbox_to_anchor=(0, 1.0), fontsize=8)
    return _svg(fig)


# Above this many segments the timeline's bars are drawn as one embedded image, not one SVG
# rectangle each: on 8 real dlrm ranks (2,358 segments) 19 KB and 0.11 s instead of 412 KB and 0.18 s,
# and without the hairline seams a browser draws between abutting vector rectangles (a 512-rank step
# would otherwise weigh tens of MB). Labels and axes stay text.
MAX_VECTOR_SEGMENTS = 500


def step_gantt(timeline: pl.DataFrame) -> str:
    """Compute, exposed communication and idle segments per rank on one clock (ms from the first start)."""
    origin = timeline["start_ns"].min()
    ranks = sorted(timeline["rank"].unique().to_list())
    row_of = {rank: y for y, rank in enumerate(ranks)}
    raster = timeline.height > MAX_VECTOR_SEGMENTS
    fig, ax = _subplots(figsize=(9, _rank_height(len(ranks))))
    for activity in ("idle", "compute", "exposed communication"):
        lanes = timeline.filter(pl.col("activity") == activity)
        _bars(ax, lanes["rank"].replace_strict(row_of).to_numpy(), (lanes["start_ns"].to_numpy() - origin) / 1e6,
              (lanes["end_ns"] - lanes["start_ns"]).to_numpy() / 1e6, 0.7, ACTIVITY_COLORS[activity], sticky=False,
              rasterized=raster)
    _rank_axis(ax, [str(r) for r in ranks])
    ax.set_xlabel("time since the step's span opened on the first rank (ms, reference clock)")
    handles = [matplotlib.patches.Patch(color=ACTIVITY_COLORS[a], label=a) for a in ("compute", "exposed communication", "idle")]
    ax.legend(handles=handles, frameon=False, ncols=3, loc="lower left", bbox_to_anchor=(0, 1.0), fontsize=8)
    return _svg(fig)


def step_time_series(step_time: pl.DataFrame, profiled: list[int], p90_ns: float | None) -> str:
    """Optimizer-step time over the run; excluded steps marked by reason, profiled steps shaded. Steps
    over OFF_SCALE x the run's p90 (a first step of seconds) sit on the top edge with their time
    written, so they do not flatten the curve."""
    fig, ax = _subplots(figsize=(9, 3))
    excluded_rows = pl.col("excluded").fill_null(False)
    kept, excluded = step_time.filter(~excluded_rows), step_time.filter(excluded_rows)
    slowest = float(step_time["step_time_ns"].max() or 0) / 1e6  # (no time at all: a log of zeros or nan)
    top = (min(slowest, OFF_SCALE * p90_ns / 1e6) if p90_ns else slowest) or 1.0

    def draw(frame: pl.DataFrame, fmt: str, **style) -> None:
        times = frame["step_time_ns"].to_numpy() / 1e6
        ax.plot(frame["step"].to_numpy(), times.clip(max=top), fmt, **style)
        for step, value in zip(frame["step"].to_list(), times.tolist()):
            if value > top:
                ax.annotate(f"{value:,.0f} ms", (step, top), textcoords="offset points", xytext=(4, -10), fontsize=7)

    draw(kept, "o-" if step_time.height <= MANY_STEPS else "-", ms=3, lw=1, color=ACTIVITY_COLORS["compute"],
         label="in the summary")
    markers = iter("xsD^v<>P*")
    # a step without a time (the first cycle, which no step before it starts) has no point, and so no legend entry
    for (reason,), group in excluded.drop_nulls("step_time_ns").group_by("reason", maintain_order=True):
        draw(group, next(markers, "x"), ms=6, ls="none", label="excluded: " + str(reason).replace("_", " ").replace(",", ", "))
    for step in profiled:
        ax.axvspan(step - 0.5, step + 0.5, color="#f2c14e", alpha=0.35, lw=0)
    if profiled:
        ax.plot([], [], "s", color="#f2c14e", alpha=0.6, label="profiled")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(0, top * 1.05)
    ax.legend(frameon=False, fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.0), ncols=3)
    return _svg(fig)


LABEL_CLEARANCE_PT = 4  # space kept between two point names, so that two never read as one


def _place_label(ax, name: str, point: tuple[float, float], colour: str, renderer, inside, placed: list) -> bool:
    """Name a point in its colour, right of it or else left of it, where the name stays inside the axes
    and clears the names already placed (their boxes in `placed`, to which its box is added); False: nowhere."""
    pad = LABEL_CLEARANCE_PT * ax.figure.dpi / 72
    for offset, align in (((3, 2), "left"), ((-3, 2), "right")):
        label = ax.annotate(name, point, fontsize=7, xytext=offset, textcoords="offset points", ha=align, color=colour)
        box = label.get_window_extent(renderer).expanded(1, 1).padded(pad)
        if (box.x0 >= inside.x0 and box.x1 <= inside.x1 and box.y0 >= inside.y0 and box.y1 <= inside.y1
                and not any(box.overlaps(other) for other in placed)):
            placed.append(box)
            return True
        label.remove()
    return False


OFF_SCALE = 3  # the y axis stops at 3x the run's p90 step time
MANY_STEPS = 200  # beyond it, a marker per step hides the line


def launch_delay(launches: pl.DataFrame) -> str:
    """Distribution of queueing (end of the launch call to start on the GPU), log scale."""
    queue = launches.filter(pl.col("queue_ns") > 0)["queue_ns"].to_numpy() / 1e3
    fig, ax = _subplots(figsize=(6, 2.6))
    ax.hist(queue, bins=_log_bins(queue), color="#4c72b0", histtype="stepfilled")  # one polygon, not a patch a bin
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(PLAIN_NUMBER)
    if queue.size and queue.max() > 10 * max(queue.min(), 1e-3):
        # Over more than a decade matplotlib labels no minor tick (LogFormatter's minor_thresholds): the unlabelled
        # marks were 40% of the figure's drawing time.
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    else:  # within a decade the minor ticks are labelled: as plain numbers too (the default writes math text)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.LogFormatter(labelOnlyBase=False))
    ax.set_xlabel("queueing: launch call end -> GPU start (µs, log)")
    ax.set_ylabel("device activities")
    return _svg(fig)


def _log_bins(values, count: int = 40):

    low, high = max(values.min(), 1e-3), max(values.max(), 1e-3)
    return np.logspace(np.log10(low), np.log10(high * 1.0001), count) if high > low else 10


def idle_by_cause(idle: pl.DataFrame) -> str:
    """Whole-device idle per rank over the traced window, stacked by cause (gpu_idle's whole-window rows)."""
    rows = idle.sort("rank", "device")
    labels = [str(r) for r in rows["rank"].to_list()]
    if len(set(labels)) < len(labels):
        labels = [f"{r}/gpu{d}" for r, d in rows.select("rank", "device").iter_rows()]
    fig, ax = _subplots(figsize=(min(2 + 0.4 * rows.height, 10), 2.8))
    bottom = np.zeros(rows.height)
    for column, label in (("host_bound_ns", "host-bound idle"), ("sync_ns", "sync idle"), ("other_ns", "other idle")):
        values = rows[column].fill_null(0).to_numpy() / 1e6
        _bars(ax, range(rows.height), bottom, values, 0.8, ACTIVITY_COLORS[label], label, horizontal=False)
        bottom = bottom + values
    ax.set_xticks(range(rows.height), labels)
    ax.set_xlabel("rank")
    ax.set_ylabel("GPU idle (ms)")
    ax.legend(frameon=False, ncols=3, loc="lower left", bbox_to_anchor=(0, 1.0))
    return _svg(fig)


def busbw_by_size(summary: pl.DataFrame) -> str:
    """busbw against message size, one series per collective (nccl-tests' view): collective_summary's
    median per size with a bar from its 10th to its 90th percentile."""
    fig, ax = _subplots(figsize=(6, 3))
    for (op,), group in summary.sort("op", "bytes").group_by("op", maintain_order=True):
        median = group["busbw_median_gbps"].to_numpy()
        spread = [median - group["busbw_p10_gbps"].to_numpy(), group["busbw_p90_gbps"].to_numpy() - median]
        ax.errorbar(group["bytes"].to_numpy(), median, yerr=spread, fmt="o-", ms=4, lw=1, capsize=2, label=str(op))
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: binary_bytes(value)))
    ax.set_xlabel("message size S (log2)")
    ax.set_ylabel("busbw (GB/s), median and p10-p90")
    ax.legend(frameon=False, fontsize=8)
    return _svg(fig)


def curves(scalars: pl.DataFrame, x: str, names: list[str]) -> str:
    """Monitor scalars against global samples (or tokens), one panel per name."""
    fig, axes = _subplots(len(names), 1, figsize=(6.5, 1.9 * len(names)), squeeze=False, sharex=True)
    for ax, name in zip(axes[:, 0], names):
        series = scalars.filter(pl.col("name") == name).sort(x)
        for rank, group in series.group_by("rank", maintain_order=True):
            ax.plot(group[x].to_numpy(), group["value"].to_numpy(), lw=1.2, label=f"rank {rank[0]}")
        ax.set_title(name, loc="left", fontsize=9)
    axes[-1, 0].set_xlabel(x.replace("_", " "))
    return _svg(fig)


def run_curves(aligned: pl.DataFrame) -> str:
    """Two runs' monitor curves on one global-samples axis (columns run, name, x, value)."""
    names = sorted(set(aligned["name"].to_list()))
    fig, axes = _subplots(len(names), 1, figsize=(6.5, 1.9 * len(names)), squeeze=False, sharex=True)
    for ax, name in zip(axes[:, 0], names):
        for run, group in aligned.filter(pl.col("name") == name).sort("x").group_by("run", maintain_order=True):
            ax.plot(group["x"].to_numpy(), group["value"].to_numpy(), lw=1.2, label=str(run[0]))
        ax.set_title(name, loc="left", fontsize=9)
        ax.legend(frameon=False, fontsize=8)
    axes[-1, 0].set_xlabel("global samples")
    return _svg(fig)


def roofline_scatter(top_ops: list[dict], roof: dict) -> str:
    """Achieved TFLOP/s against FLOPs per byte for the top ops, under the device's roofs (memory slope
    and the dense peak of each dtype shown). Each point is numbered as its op ranks by device time; the
    LABELLED_OPS busiest are named beside their point when the name clears the names already placed,
    the others in the legend beside the plot."""
    points = [(number, op) for number, op in enumerate(top_ops, 1) if on_the_roofline(op)]
    fig, ax = _subplots(figsize=(6, 3.4))
    lo = min([op["intensity"] for _, op in points] + [0.1]) / 2
    hi = max([op["intensity"] for _, op in points] + [1e4]) * 2
    bandwidth = roof["bandwidth_tbps"]
    for dtype in sorted({op["dtype"] for _, op in points if op["dtype"] in roof["peak_tflops"]}):
        peak = roof["peak_tflops"][dtype]
        ridge = peak / bandwidth
        ax.plot([lo, ridge, hi], [lo * bandwidth, peak, peak], lw=1, label=f"roof {dtype}: {peak:g} TFLOP/s, {bandwidth:g} TB/s")
    # One colour per op from the colour cycle, as one scatter call per op gave (scatter's cycle is not the lines').
    colours = [f"C{i % 10}" for i in range(len(points))]
    ax.scatter([op["intensity"] for _, op in points], [op["achieved_tflops"] for _, op in points], s=18, c=colours)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.autoscale_view()  # the final limits, so that a label's box measured below is where it is drawn
    # Minor ticks over these many decades are clutter, and drawing them was half the figure's time.
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.xaxis.set_major_formatter(PLAIN_NUMBER)
    ax.yaxis.set_major_formatter(PLAIN_NUMBER)
    ax.set_xlabel("intensity (FLOPs per byte moved)")
    ax.set_ylabel("achieved TFLOP/s")
    renderer = _measuring_renderer(fig.dpi)
    inside = ax.get_window_extent(renderer)
    placed, unlabelled = [], []
    for rank, ((number, op), colour) in enumerate(zip(points, colours)):
        name = f"{number}. {op['name'].removeprefix('aten::')}"
        if rank < LABELLED_OPS and _place_label(ax, name, (op["intensity"], op["achieved_tflops"]), colour, renderer,
                                                inside, placed):
            continue
        unlabelled.append(matplotlib.lines.Line2D([], [], ls="none", marker="o", ms=4, color=colour, label=name))
    handles = ax.get_legend_handles_labels()[0] + unlabelled
    if handles:  # nothing to name: no empty legend (matplotlib warns "No artists with labels")
        ax.legend(handles=handles, frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _svg(fig)
