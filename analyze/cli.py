"""Command line: `analyze RUN_DIR`, `steplens analyze RUN_DIR`, `python -m steplens.analyze RUN_DIR`."""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import click
import polars as pl
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from . import analyses, kernels, mfu, schema
from steplens.reports.verdict import telemetry_lines

from .ingest import (
    IngestError,
    IngestResult,
    Source,
    discover,
    ingest,
    use_system_allocator,
)

EXIT_PARTIAL = 1  # results written, but some input files could not be used
EXIT_NOTHING = 2  # nothing usable, or bad arguments

ANALYZE_HELP = f"""Turn what a training job left in RUN_DIR into queryable Parquet tables, analyses and a report.

RUN_DIR is searched recursively (hidden folders skipped) for: per-rank PyTorch-profiler traces
(.json or .json.gz, as tensorboard_trace_handler or export_chrome_trace wrote them); the steplens
collector's output; and native DeepSpeed artifacts (job logs, FLOPs-profiler text, comms-logger
dumps, csv_monitor, TensorBoard event files, W&B offline runs, autotuning results). Files it does
not read are listed in run.json as ignored. The inputs are never modified.

Output goes to RUN_DIR/{schema.DEFAULT_OUT_DIR}/ (or --out DIR): run.json plus one folder per table,
hive-partitioned by rank (trace_events/rank=0/part-*.parquet, ...), and one folder per analysis
(step_stats, gpu_idle, collectives, mfu, ...). Query them with DuckDB from Python:

\b
    import duckdb
    duckdb.sql("SELECT rank, kind, count(*) FROM read_parquet("
               "'RUN_DIR/{schema.DEFAULT_OUT_DIR}/trace_events/*/*.parquet', hive_partitioning=true) "
               "GROUP BY ALL ORDER BY ALL").show()

After ingest it runs the analyses and prints the headline: slowest step and rank, stragglers, GPU
idle and its main cause, the most exposed collective, and MFU with its definition and peak. It
writes report.html (one self-contained file: attach it to a PR) and summary.md (a PR comment)
into the output folder; --format md prints the summary instead of the terminal tables.

Re-running is incremental: files whose size, mtime and first 64 KiB are unchanged are not parsed
again. The swap to the new result is atomic, so an interrupted run leaves the last result intact.

\b
Exit status: 0 all inputs used; {EXIT_PARTIAL} results written but some input files could not be
used (see the issues); {EXIT_NOTHING} nothing usable.
"""


@click.command("analyze", help=ANALYZE_HELP)
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help=f"Write the run directory here instead of RUN_DIR/{schema.DEFAULT_OUT_DIR}/.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Files parsed in parallel (default: number of CPUs). Memory grows with it, not with the number of ranks.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar; print only the summary.")
@click.option("--ingest-only", is_flag=True, help="Write the trace tables only; skip the analyses.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp8", "tf32", "fp32"]), default="bf16", show_default=True,
              help="Compute dtype whose dense peak MFU divides by.")
@click.option("--peak-tflops", type=float, default=None,
              help="Dense peak TFLOP/s per GPU, overriding the device table (needed for devices it does not know).")
@click.option("--params", type=float, default=None, help="Model shape for the PaLM MFU numerator: non-embedding parameters N.")
@click.option("--layers", type=int, default=None, help="Model shape: transformer layers L.")
@click.option("--heads", type=int, default=None, help="Model shape: attention heads H.")
@click.option("--head-dim", type=int, default=None, help="Model shape: head dimension Q.")
@click.option("--seq-len", type=int, default=None, help="Model shape: sequence length T.")
@click.option("--tokens-per-step", type=int, default=None, help="Global tokens per optimizer step (all ranks).")
@click.option("--recompute", is_flag=True, help="Full activation recompute was on: also report HFU (PaLM + one forward).")
@click.option("--grad-norm-threshold", type=float, default=None,
              help="Alarm when a grad-norm scalar exceeds this (default: alarm on robust-z spikes only).")
@click.option("--format", "fmt", type=click.Choice(["text", "md"]), default="text", show_default=True,
              help="text: terminal tables; md: print summary.md (markdown for a PR comment) instead.")
@click.option("--kernel-categories", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="CSV with columns category,pattern (regex on kernel names), checked before the built-in patterns.")
def analyze(run_dir: Path, out_dir: Path | None, jobs: int | None, quiet: bool, ingest_only: bool, dtype: str,
            peak_tflops: float | None, params, layers, heads, head_dim, seq_len, tokens_per_step, recompute: bool,
            grad_norm_threshold: float | None, fmt: str, kernel_categories: Path | None) -> None:
    use_system_allocator()
    console = Console(stderr=False, highlight=False)
    if not run_dir.exists():
        _fail(f"{run_dir}: no such folder")
    out = out_dir or run_dir / schema.DEFAULT_OUT_DIR
    try:
        found = discover(run_dir, out)
        total = sum(p.stat().st_size for p in found.traces + [path for path, _, _ in found.native])
    except OSError:
        total = 0
    shape_values = (params, layers, heads, head_dim, seq_len, tokens_per_step)
    if any(v is not None for v in shape_values) and not all(v is not None for v in shape_values):
        _fail("the PaLM numerator needs all of --params --layers --heads --head-dim --seq-len --tokens-per-step")
    options = analyses.Options(
        dtype=dtype, peak_tflops=peak_tflops, recompute=recompute, grad_norm_threshold=grad_norm_threshold,
        shape=mfu.ModelShape(*shape_values) if all(v is not None for v in shape_values) else None,
        kernel_categories=kernels.load_categories(kernel_categories) if kernel_categories else list(kernels.KERNEL_CATEGORIES),
    )
    findings: dict = {}

    def run_analyses(staging: Path) -> None:
        findings.update(analyse_and_report(staging, options))

    show_progress = not quiet and sys.stderr.isatty()
    progress = Progress(TextColumn("ingest"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                        console=Console(stderr=True), transient=True, disable=not show_progress)
    with progress:
        task = progress.add_task("ingest", total=total or None)
        try:
            result = ingest(run_dir, out_dir, jobs=jobs, progress=lambda s: progress.advance(task, s.size),
                            finish=None if ingest_only else lambda staging: run_analyses(staging))
        except IngestError as e:
            _fail(str(e))
    if fmt == "md" and findings:
        click.echo((result.out_dir / "summary.md").read_text(), nl=False)
    else:
        print_summary(console, result, findings.get("analysis_seconds"))
        if findings:
            print_findings(console, findings)
            console.print(f"report: {result.out_dir / 'report.html'} (rendered in {findings['report_seconds']:.2f}s); "
                          f"PR summary: {result.out_dir / 'summary.md'}", markup=False, highlight=False, soft_wrap=True)
    if result.failed:
        sys.exit(EXIT_PARTIAL)


def analyse_and_report(staging: Path, options: analyses.Options) -> dict:
    """The analyses, then report.html and summary.md, inside the staged output (published together)."""
    from steplens.reports import html, markdown

    started = time.perf_counter()
    findings = analyses.run(staging, options)
    findings["analysis_seconds"] = time.perf_counter() - started
    started = time.perf_counter()
    html.write(staging)
    markdown.write(staging)
    findings["report_seconds"] = time.perf_counter() - started
    return findings


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_NOTHING)


def print_summary(console: Console, result: IngestResult, analysis_seconds: float | None = None) -> None:
    m = result.manifest
    used = [s for s in result.sources if s.rank is not None and s.kind == "kineto"]
    mb = sum(s.raw_bytes for s in result.sources if s.status == "ingested") / 1e6
    parsed = sum(1 for s in result.sources if s.status == "ingested")
    ingest_seconds = result.seconds - (analysis_seconds or 0)
    speed = f", {mb / ingest_seconds:.0f} MB/s" if parsed and ingest_seconds > 0 else ""
    analysed = f"; analyses {analysis_seconds:.2f}s" if analysis_seconds is not None else ""
    artifacts = Counter(s.kind for s in result.sources if s.kind != "kineto" and s.status in ("ingested", "reused"))
    others = f" and {sum(artifacts.values())} other input(s)" if artifacts else ""
    console.print(
        f"[bold]{len(used)}[/] trace file(s){others} -> {result.out_dir}  "
        f"({parsed} parsed, {result.reused} unchanged; {mb:.1f} MB JSON in {ingest_seconds:.2f}s{speed}{analysed})",
        highlight=False, soft_wrap=True,
    )
    world = f" of world size {m['world_size']}" if m.get("world_size") else ""
    console.print(f"ranks: {_ranges(m['ranks'])}{world}", highlight=False, markup=False)
    if artifacts:
        console.print("other inputs: " + ", ".join(f"{kind} {n}" for kind, n in sorted(artifacts.items())),
                      highlight=False, markup=False)
    if m.get("ignored_count"):
        console.print(f"not read: {m['ignored_count']} file(s) in no format steplens knows (listed in run.json "
                      "ignored_files)", highlight=False, markup=False)
    if used:
        _print_trace_tables(console, used)
    _print_issues(console, result)


def _print_trace_tables(console: Console, used: list[Source]) -> None:
    steps = Table(title="steps per rank", title_justify="left", box=None)
    for col in ("rank", "windows", "steps", "ProfilerStep#"):
        steps.add_column(col)
    by_rank: dict[int, list[Source]] = {}
    for s in used:
        by_rank.setdefault(s.rank, []).append(s)
    for rank in sorted(by_rank):
        numbers = sorted(n for s in by_rank[rank] for n in s.steps)
        steps.add_row(str(rank), str(len(by_rank[rank])), str(len(numbers)), _ranges(numbers) or "none")
    console.print(steps)

    kinds = Counter()
    for s in used:
        kinds.update(s.kind_counts)
    table = Table(title="events per kind (all ranks)", title_justify="left", box=None)
    table.add_column("kind")
    table.add_column("events", justify="right")
    for kind in schema.KINDS:
        if kinds.get(kind):
            table.add_row(kind, f"{kinds[kind]:,}")
    console.print(table)


def _print_issues(console: Console, result: IngestResult) -> None:
    issues = Table(title="ingest issues", title_justify="left", box=None)
    for col in ("severity", "reason", "files", "count", "example"):
        issues.add_column(col, overflow="fold")
    grouped: dict[tuple, list] = {}
    for s in result.sources:
        for severity, reason, count, detail in s.issues:
            grouped.setdefault((severity, reason), []).append((s.path, count, detail))
    order = {"error": 0, "warning": 1, "info": 2}
    for (severity, reason), rows in sorted(grouped.items(), key=lambda kv: (order.get(kv[0][0], 3), kv[0][1])):
        path, _, detail = rows[0]
        detail = detail.removeprefix(f"{path}: ")
        issues.add_row(severity, reason, str(len(rows)), f"{sum(r[1] for r in rows):,}", f"{path}: {detail}")
    if grouped:
        console.print(issues, markup=False)
    else:
        console.print("ingest issues: none")


def print_findings(console: Console, f: dict) -> None:
    """The headline: slowest rank and step, GPU idle and its cause, most exposed collective, MFU."""
    console.print("[bold]findings[/]")
    lines = []
    if slow := f.get("slowest_step"):
        lines.append(f"slowest step: ProfilerStep#{slow['step']} on rank {slow['rank']}, {_ms(slow['dur_ns'])} "
                     f"(median step {_ms(slow['median_step_ns'])})")
    for s in f.get("stragglers", []):
        if s["basis"] == "collective_wait":
            lines.append(f"straggler: rank {s['rank']} in step {s['step']}; the other ranks waited {_ms(s['others_waited_ns'])} "
                         "in total for it in collectives")
        else:
            lines.append(f"straggler: rank {s['rank']} in step {s['step']}, {_ms(s['spread_ns'])} longer than the fastest "
                         "rank (no collective timing in the traces to show who waited)")
    idle = f.get("gpu_idle", {})
    if idle.get("idle_share") is not None:
        cause = {"host_bound": "host-bound (GPU waiting for the CPU to launch)", "sync": "synchronization (CPU waiting on the GPU)",
                 "other": "other (cross-stream waits)"}.get(idle.get("main_cause"), "none")
        lines.append(f"GPU idle: {idle['idle_share']:.1%} of step GPU time; main cause {cause}")
    elif idle.get("note"):
        lines.append(f"GPU idle: {idle['note']}")
    if top := f.get("most_exposed_collective"):
        bw = f", median busbw {top['busbw_gbps']:.1f} GB/s" if top.get("busbw_gbps") is not None else ""
        size = f"{top['bytes']:,} B" if top.get("bytes") is not None else "unknown size"
        lines.append(f"most exposed collective: {top['op']} of {size}: {_ms(top['exposed_ns'])} exposed over "
                     f"{top['calls']} calls{bw}")
    elif f.get("comms_note"):
        lines.append(f"collectives: {f['comms_note']}")
    util = f.get("mfu")
    if isinstance(util, list):
        for row in util:
            lines.append(f"{row['metric']}: {row['utilization']:.1%} (median over steps). Numerator: {row['definition']}. "
                         f"Peak: {row['peak']}")
    elif isinstance(util, dict):
        lines.append(f"MFU: not computed: {util['note']}")
    if f.get("traces"):
        lines.append(f["traces"])
    lines.extend(telemetry_lines(f))
    for line in lines:
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)


def _ms(ns) -> str:
    return "n/a" if ns is None else f"{ns / 1e6:.3f} ms"


def _ranges(numbers: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2, 5, 7-8'."""
    parts, start, prev = [], None, None
    for n in sorted(set(numbers)):
        if start is None:
            start = prev = n
        elif n == prev + 1:
            prev = n
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = n
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(parts)


@click.group(help="steplens: post-hoc trace and log analysis for DeepSpeed / PyTorch training runs.")
def steplens() -> None:
    pass


steplens.add_command(analyze)


def _sql_help() -> str:
    from .sql import EXAMPLES

    tables = ", ".join(list(schema.TABLES) + list(schema.ANALYSIS_TABLES))
    examples = "\n".join(f"    # {title}\n    {text}\n" for title, text in EXAMPLES.items())
    return f"""Run one SELECT over every steplens run under RUNS_DIR (any folder holding a run.json, such
as RUN/.steplens/), with DuckDB.

Each table is a view across all runs, with a run_id column (per-rank tables also have rank):
{tables}. The view `runs` lists the runs (run_id, run_name, path, world_size, ranks, devices, created_by,
zero_stage, train_batch_size, code_revision, deepspeed_version).
Columns are documented in analyze/schema.py and the README. Queries never modify a run: only a
single SELECT is accepted.

\b
Examples:
{examples}"""


@click.command("sql", help=_sql_help())
@click.argument("runs_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True,
              help="table for reading, csv or json (one object per row) for other tools.")
def sql_command(runs_dir: Path, query: str, fmt: str) -> None:
    from .sql import QueryError, find_runs
    from .sql import query as run_query

    if not find_runs(runs_dir):
        _fail(f"{runs_dir}: no steplens runs (no run.json) under this folder; run `analyze` first")
    try:
        result = run_query(runs_dir, query)
    except QueryError as e:
        _fail(str(e))
    if fmt == "csv":
        click.echo(result.write_csv(), nl=False)
    elif fmt == "json":
        click.echo(result.write_ndjson(), nl=False)
    else:
        with pl_config():
            click.echo(result)


def pl_config():
    import polars as pl

    return pl.Config(tbl_rows=200, tbl_cols=-1, tbl_width_chars=200, fmt_str_lengths=80, tbl_hide_dataframe_shape=True)


steplens.add_command(sql_command)


def _step_range(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    first, _, last = value.partition(":")
    try:
        return int(first), int(last or first)
    except ValueError:
        raise click.BadParameter("expected A:B (ProfilerStep numbers, inclusive) or A") from None


@click.command("export-trace")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--steps", default=None, help="Only ProfilerSteps A to B inclusive, as A:B (or one step A).")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Output file (default: merged_trace.json in the run directory).")
def export_trace_command(run_dir: Path, steps: str | None, out_path: Path | None) -> None:
    """Write one Chrome-trace JSON with every rank of an analysed run on one clock.

    RUN_DIR is a run folder that `analyze` has processed (or its .steplens/ output). Each rank becomes
    a process, its GPU streams become threads, times move onto the reference rank's clock (the
    clock_offsets analysis) and launch links stay as flow arrows. Open the file in Perfetto UI
    (ui.perfetto.dev) or chrome://tracing; slices that overlap without nesting, which Perfetto drops,
    are counted in the summary.
    """
    from .export import export_trace

    out_dir = run_dir if (run_dir / schema.MANIFEST_FILE).exists() else run_dir / schema.DEFAULT_OUT_DIR
    if not (out_dir / schema.MANIFEST_FILE).exists():
        _fail(f"{run_dir}: not an analysed run (no run.json); run `analyze {run_dir}` first")
    out_path = out_path or out_dir / "merged_trace.json"
    counts = export_trace(out_dir, out_path, _step_range(steps))
    if not counts["events"]:
        _fail(f"{run_dir}: no events to export" + (f" in steps {steps}" if steps else ""))
    click.echo(f"{out_path}: {counts['events']:,} events and {counts['flows']:,} launch flows from "
               f"{counts['ranks']} rank(s); {counts['partial_overlaps']:,} slices overlap without nesting")


steplens.add_command(export_trace_command)


EXIT_REGRESSION = 3  # compare --fail-on-regression: a significant slowdown beyond the threshold


def _analysed(run_dir: Path) -> Path:
    """The run's analysed output folder, analysing it first (default options) when it has none."""
    for candidate in (run_dir, run_dir / schema.DEFAULT_OUT_DIR):
        if (candidate / schema.MANIFEST_FILE).exists():
            return candidate
    click.echo(f"analysing {run_dir} first (default options) ...", err=True)
    try:
        return ingest(run_dir, finish=lambda staging: analyse_and_report(staging, analyses.Options())).out_dir
    except IngestError as e:
        _fail(str(e))


@click.command("compare")
@click.argument("base_run", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("new_run", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("steplens-compare"),
              show_default=True, help="Folder for compare.html and compare.md.")
@click.option("--format", "fmt", type=click.Choice(["text", "md", "json"]), default="text", show_default=True,
              help="text: terminal tables; md: print compare.md (for a PR comment); json: the verdict as data.")
@click.option("--fail-on-regression", "fail_pct", type=float, default=None, metavar="PCT",
              help=f"Exit {EXIT_REGRESSION} when the judged metric (step time, or throughput when the work per step "
                   "differs) got significantly worse by more than PCT percent (CI gating).")
def compare_command(base_run: Path, new_run: Path, out_dir: Path, fmt: str, fail_pct: float | None) -> None:
    """Compare two runs: a noise-aware verdict on the work done, and MFU, GPU idle, exposed
    communication, kernel categories and top kernels side by side.

    BASE_RUN and NEW_RUN are run folders (analysed first if they have no .steplens/ output) or
    analysed output folders. When micro batch, gradient accumulation and world size agree the
    verdict is on step time; when any differs, on throughput (tokens/s when both runs know their
    sequence length, else samples/s), and the output says so. A change counts only when a bootstrap
    95% interval of the relative change of the median excludes zero and a Mann-Whitney U test gives
    p < 0.05; with fewer than 5 steps per run the verdict is "not established". Writes compare.html
    and compare.md.
    """
    import json

    from steplens.analyze import compare as comparison
    from steplens.reports import compare, html, markdown
    from steplens.reports.data import load, write_atomic

    result = comparison.compare(load(_analysed(base_run)), load(_analysed(new_run)))
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "compare.html", html.render_compare(result))
    write_atomic(out_dir / "compare.md", markdown.render_compare(result))
    if fmt == "md":
        click.echo((out_dir / "compare.md").read_text(), nl=False)
    elif fmt == "json":
        click.echo(json.dumps(comparison.as_data(result), indent=1, default=str))
    else:
        console = Console(highlight=False)
        verdict = result["verdict"]
        console.print(f"{verdict['metric']}: {verdict['verdict']} {verdict.get('why', '')}", markup=False, soft_wrap=True)
        if verdict.get("why_metric"):
            console.print(f"judged on {verdict['metric']}: {verdict['why_metric']}", markup=False, soft_wrap=True)
        for warning in result["warnings"]:
            console.print(f"warning: {warning}", markup=False, soft_wrap=True)
        for table in compare.display_tables(result):
            if table["rows"]:
                view = Table(title=table["title"], title_justify="left", box=None)
                for header in table["header"]:
                    view.add_column(header, overflow="ellipsis", no_wrap=True, max_width=60)
                for row in table["rows"]:
                    view.add_row(*row)
                console.print(view, markup=False)
        console.print(f"written: {out_dir / 'compare.html'}, {out_dir / 'compare.md'}", markup=False)
    if fail_pct is not None and comparison.regressed(result, fail_pct):
        sys.exit(EXIT_REGRESSION)


steplens.add_command(compare_command)


def analyze_entry() -> None:
    """The `analyze` script: `analyze RUN_DIR`, and `analyze compare BASE NEW` (unless RUN_DIR is a
    folder named compare)."""
    if len(sys.argv) > 1 and sys.argv[1] == "compare" and not Path("compare").is_dir():
        compare_command.main(sys.argv[2:], prog_name="analyze compare")
    else:
        analyze.main(prog_name="analyze")


@click.command("trials")
@click.argument("runs_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["text", "md", "json"]), default="text", show_default=True,
              help="text: terminal tables; md: markdown for a PR comment; json: the verdict as data.")
def trials_command(runs_dir: Path, fmt: str) -> None:
    """Rank repeated trial runs made by the collector, with a noise-aware verdict.

    Every folder directly under RUNS_DIR is one run (analysed first if it has no .steplens/ output).
    Runs whose ds_configs differ only in settings that do not change the work (the steplens block and
    its run_dir, output paths, logging, monitor, profiler and comms-logger settings, autotuning) are
    trials of one configuration; what was ignored is printed. Each run is measured by its median
    optimizer-step time and samples per step (collector train_steps). Configurations are ranked by
    median throughput, as the autotuning analysis ranks DeepSpeed's experiments, and the winner is
    called only when an exact one-sided Mann-Whitney U test over the trials gives p < 0.05 (which
    needs at least 4 trials per configuration).
    """
    import json

    from steplens.analyze.trials import trials
    from steplens.reports.data import load

    folders = sorted(p for p in runs_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    runs = {}
    for folder in folders:
        run = load(_analysed(folder))
        runs[folder.name] = (run.table("step_time"), {"world_size": run.manifest.get("world_size"),
                                                      **run.manifest.get("facts", {})})
    measured = {name: value for name, value in runs.items() if not value[0].is_empty()}
    if not measured:
        _fail(f"{runs_dir}: no run folder with step times (collector train_steps, logs or profiler steps) under it")
    result = trials(measured)
    if fmt == "json":
        click.echo(json.dumps(result, indent=1, default=str))
        return
    columns = ["rank", "runs", "trials", "ok_trials", "median", "min", "max", "metric"]
    rows = [[_cell(",".join(c["runs"]) if column == "runs" else c[column]) for column in columns]
            for c in result["configurations"]]
    ignored = (f"ignored settings that differed between trials: {', '.join(result['ignored_differences'])}"
               if result["ignored_differences"] else "no ignored setting differed between trials")
    if fmt == "md":
        from steplens.reports.markdown import escape, table_lines

        click.echo("\n".join([f"**{escape(result['verdict']['detail'])}**", "", escape(ignored) + ".", ""]
                             + table_lines(columns, rows) + ["", escape(result["ignored_rule"]) + "."]))
        return
    console = Console(highlight=False)
    console.print(result["verdict"]["detail"], markup=False, soft_wrap=True)
    console.print(ignored, markup=False, soft_wrap=True)
    view = Table(title="configurations (median over trials)", title_justify="left", box=None)
    for column in columns:
        view.add_column(column, overflow="fold")
    for row in rows:
        view.add_row(*row)
    console.print(view, markup=False)
    console.print(result["ignored_rule"], markup=False, soft_wrap=True)


def _cell(value) -> str:
    if value is None:
        return ""
    return f"{value:,.4g}" if isinstance(value, float) else str(value)


steplens.add_command(trials_command)
