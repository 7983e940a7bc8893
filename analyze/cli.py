"""Command line: `analyze RUN_DIR`, `steplens analyze RUN_DIR`, `python -m steplens.analyze RUN_DIR`."""

from __future__ import annotations

import errno
import os
import signal
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from steplens.analyze.analyses import kernels, mfu, runner
from steplens.analyze.contract import schema
from steplens.reports.verdict import finding_lines

from steplens.analyze.pipeline.ingest import (
    IngestError,
    IngestResult,
    OutputUnwritable,
    Source,
    classify,
    discover,
    publish,
    staged,
    use_system_allocator,
)
from steplens.analyze.pipeline.runs import RunFolder, split_runs
from steplens.reports.text import safe_text

# Exit status, one meaning each, for every command (documented in --help and the README).
EXIT_PARTIAL = 1  # results written, but some inputs could not be used (see the issues)
EXIT_NOTHING = 2  # nothing usable, or bad arguments
EXIT_REGRESSION = 3  # compare --fail-on-regression: a significant slowdown beyond the threshold
EXIT_UNWRITABLE = 4  # the output cannot be written (permissions, read-only or full disk)
EXIT_INTERNAL = 5  # a steplens bug: the message says where to look
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM: the last published result is unchanged
EXIT_STATUS_HELP = f"""\b
Exit status:
  0    all inputs used
  {EXIT_PARTIAL}    results written, but some inputs could not be used (see the issues)
  {EXIT_NOTHING}    nothing usable, or bad arguments
  {EXIT_REGRESSION}    compare: a regression beyond --fail-on-regression
  {EXIT_UNWRITABLE}    the output cannot be written (read-only or full disk)
  {EXIT_INTERNAL}    internal error (STEPLENS_DEBUG=1 shows the traceback)
  {EXIT_INTERRUPTED}  interrupted by Ctrl-C or SIGTERM (the last result is kept)
"""

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
The output folder is only ever one steplens wrote: --out refuses a folder that holds the inputs or
files steplens did not write.

RUN_DIR may hold several runs (one folder per job, side by side): they are told apart (two folders
with the same kind of input, such as two collector outputs or two traces of one rank, are two runs)
and each is analysed into its own RUN/.steplens/ (or --out DIR/RUN), one line per run. RUN_DIR may
also be a single trace file, analysed as a one-rank run into .steplens-FILE/ beside it.

""" + EXIT_STATUS_HELP


@click.command("analyze", help=ANALYZE_HELP)
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help=f"Write the run directory here instead of RUN_DIR/{schema.DEFAULT_OUT_DIR}/ (a new or empty folder, "
                   "or one steplens wrote).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Files parsed in parallel (default: number of CPUs). Memory grows with it, not with the number of ranks.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no ingest summary: print only the findings.")
@click.option("--ingest-only", is_flag=True, help="Write the trace tables only; skip the runner.")
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
        _fail(f"{safe_text(run_dir)}: no such file or folder")
    shape_values = (params, layers, heads, head_dim, seq_len, tokens_per_step)
    if any(v is not None for v in shape_values) and not all(v is not None for v in shape_values):
        _fail("the PaLM numerator needs all of --params --layers --heads --head-dim --seq-len --tokens-per-step")
    options = runner.Options(
        dtype=dtype, peak_tflops=peak_tflops, recompute=recompute, grad_norm_threshold=grad_norm_threshold,
        shape=mfu.ModelShape(*shape_values) if all(v is not None for v in shape_values) else None,
        kernel_categories=kernels.load_categories(kernel_categories) if kernel_categories else list(kernels.KERNEL_CATEGORIES),
    )
    runs, out_of = _runs_to_analyse(run_dir, out_dir)
    if len(runs) == 1:
        run, out = runs[0], out_of(runs[0])
        try:
            result, findings = _analyse_run(run, out, jobs, options, ingest_only, show_progress=not quiet)
        except OutputUnwritable as e:
            _fail(safe_text(e), EXIT_UNWRITABLE)
        except IngestError as e:
            if not (apart := _unranked_traces_apart(run, e, out_dir)):
                _fail(safe_text(e))
            click.echo(f"{safe_text(run_dir)}: {len(apart)} traces with no rank, from different processes: "
                       "separate runs, each analysed on its own:")
            sys.exit(_analyse_each(run_dir, apart, jobs, options, ingest_only))
        if fmt == "md" and findings:
            click.echo((result.out_dir / "summary.md").read_text(), nl=False)
        else:
            if not quiet:
                print_summary(console, result, findings.get("analysis_seconds"))
            if findings:
                print_findings(console, findings)
                console.print(f"report: {safe_text(result.out_dir / 'report.html')} (rendered in "
                              f"{findings['report_seconds']:.2f}s)\nPR summary: "
                              f"{safe_text(result.out_dir / 'summary.md')}", markup=False, highlight=False,
                              soft_wrap=True)
        _warn_missing_ranks(result)
        sys.exit(_status(result))
    click.echo(f"{safe_text(run_dir)} holds {len(runs)} runs; each is analysed on its own:")
    sys.exit(_analyse_each(run_dir, [(run, out_of(run)) for run in runs], jobs, options, ingest_only,
                           out_given=out_dir is not None))


def _analyse_each(run_dir: Path, runs: list[tuple[RunFolder, Path]], jobs, options: runner.Options,
                  ingest_only: bool, out_given: bool = False) -> int:
    """Several runs, one line each with where its report is; the exit status of them all."""
    statuses = []
    pending = list(runs)
    while pending:
        run, out = pending.pop(0)
        name = safe_text(run.name or (os.path.relpath(run.path, run_dir) if run.path != run_dir else run_dir.name))
        try:
            result, findings = _analyse_run(run, out, jobs, options, ingest_only, show_progress=False)
        except OutputUnwritable as e:
            _fail(safe_text(e), EXIT_UNWRITABLE)
        except IngestError as e:
            if apart := _unranked_traces_apart(run, e, out if out_given else None):
                click.echo(f"  {name}: {len(apart)} traces with no rank, from different processes: separate runs")
                pending[:0] = apart
                continue
            statuses.append(EXIT_NOTHING)
            click.echo(f"  {name}: not analysed: {safe_text(e)}")
            continue
        statuses.append(_status(result))
        ranks = _ranges(result.manifest.get("ranks", []))
        problems = sum(1 for s in result.sources for i in s.issues if i[0] == "error")
        report = result.out_dir / ("report.html" if findings else schema.MANIFEST_FILE)
        click.echo(f"  {name}: {len(result.sources)} input(s), ranks {ranks or 'none'}, {problems} error(s)\n"
                   f"    {safe_text(report)}")
    if all(s == EXIT_NOTHING for s in statuses):
        return EXIT_NOTHING
    return EXIT_PARTIAL if any(s != 0 for s in statuses) else 0


def _unranked_traces_apart(run: RunFolder, error: IngestError, out_dir: Path | None) -> list[tuple[RunFolder, Path]]:
    """Traces that name no rank and come from different processes (before/after traces, two
    models side by side) are separate one-rank runs, not one run that cannot be told apart: each
    is written to OUT/FILE, or to .steplens-FILE beside it."""
    traces = [s for s in error.sources if s.kind == "kineto"]
    unranked = [s for s in traces if any(i[1] == "rank_unknown" for i in s.issues)]
    if len(unranked) < 2 or len(unranked) != len(traces) or run.found.native:
        return []
    apart = []
    for source in unranked:
        trace = run.path / source.path
        out = out_dir / trace.name if out_dir else trace.parent / f"{schema.DEFAULT_OUT_DIR}-{trace.name}"
        apart.append((RunFolder(run.path, classify([trace]), name=source.path), out))
    return apart


def _runs_to_analyse(run_dir: Path, out_dir: Path | None):
    """The runs under run_dir (or the one trace file it names), and where each one's output goes."""
    if run_dir.is_file():
        out = out_dir or run_dir.parent / f"{schema.DEFAULT_OUT_DIR}-{run_dir.name}"
        return [RunFolder(run_dir.parent, classify([run_dir]))], lambda run: out
    if not run_dir.is_dir():
        _fail(f"{safe_text(run_dir)}: not a file or folder steplens can read")
    try:
        found = discover(run_dir, out_dir or run_dir / schema.DEFAULT_OUT_DIR)
    except OSError as e:
        _fail(f"{safe_text(run_dir)}: cannot list the folder: {e.strerror or e}")
    runs = split_runs(run_dir, found)
    if len(runs) == 1:
        return runs, lambda run: out_dir or run_dir / schema.DEFAULT_OUT_DIR

    def out_of(run: RunFolder) -> Path:
        if out_dir is None:
            return run.path / schema.DEFAULT_OUT_DIR
        relative = run.path.relative_to(run_dir)
        return out_dir / (relative if relative.parts else "_top")

    return runs, out_of


def _analyse_run(run: RunFolder, out: Path, jobs, options: runner.Options, ingest_only: bool,
                 show_progress: bool) -> tuple[IngestResult, dict]:
    findings: dict = {}
    total = 0
    for path in run.found.traces + [path for path, _, _ in run.found.native]:
        try:
            total += path.stat().st_size
        except OSError:
            pass
    progress = Progress(TextColumn("ingest"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                        console=Console(stderr=True), transient=True, disable=not (show_progress and sys.stderr.isatty()))
    with progress:
        task = progress.add_task("ingest", total=total or None)
        with staged(run.path, out, jobs=jobs, found=run.found, progress=lambda s: progress.advance(task, s.size)) as stage:
            if not ingest_only:
                findings = analyse_and_report(stage.folder, options)
            return publish(stage), findings


def _status(result: IngestResult) -> int:
    """0 when every input was used; partial when a file, or a rank in it, was lost."""
    lost = result.failed or any(i[0] == "error" for s in result.sources for i in s.issues)
    return EXIT_PARTIAL if lost else 0


def _warn_missing_ranks(result: IngestResult) -> None:
    world_size = result.manifest.get("world_size")
    traced = result.manifest.get("trace_ranks") or []
    if traced and isinstance(world_size, int) and 0 < world_size <= schema.MAX_RANK and len(traced) < world_size:
        missing = sorted(set(range(world_size)) - set(traced))
        click.echo(f"warning: traces of {len(traced)} of {world_size} ranks; no trace for rank(s) {_ranges(missing)} "
                   "(profiled on some ranks only, or lost: see the issues)", err=True)


def analyse_and_report(folder: Path, options: runner.Options) -> dict:
    """The analyses, then report.html and summary.md, in the staged output (published together)."""
    from steplens.reports import html, markdown

    started = time.perf_counter()
    findings = runner.run(folder, options)
    findings["analysis_seconds"] = time.perf_counter() - started
    started = time.perf_counter()
    html.write(folder)
    markdown.write(folder)
    findings["report_seconds"] = time.perf_counter() - started
    return findings


def _fail(message: str, status: int = EXIT_NOTHING) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(status)


class Terminated(BaseException):
    """SIGTERM or Ctrl-C, raised in the main thread so that cleanup (workers, staging folder) runs;
    not a KeyboardInterrupt, which click would answer with a line of its own."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def _guarded(command: click.Command, args: list[str] | None = None, prog_name: str | None = None) -> None:
    """Run a command with the documented exit statuses for what click does not handle: a full or
    read-only disk, Ctrl-C and SIGTERM (one line each), and internal errors."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGINT, _raise_terminated)
    try:
        command.main(args, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("interrupted: the last published result is unchanged", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except (KeyboardInterrupt, Terminated):
        click.echo("interrupted: the last published result is unchanged", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.exceptions.ClickException as e:
        e.show()
        sys.exit(EXIT_NOTHING)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except OutputUnwritable as e:
        _fail(safe_text(e), EXIT_UNWRITABLE)
    except IngestError as e:
        _fail(safe_text(e))
    except OSError as e:
        _fail(f"{safe_text(e.filename or '')}: {e.strerror or e}", EXIT_UNWRITABLE if e.errno in _WRITE_ERRNOS else EXIT_NOTHING)
    except Exception as e:  # noqa: BLE001 - one line and a distinct status instead of a traceback
        if os.environ.get("STEPLENS_DEBUG"):
            raise
        _fail(f"internal error: {type(e).__name__}: {safe_text(e)} (a steplens bug: rerun with STEPLENS_DEBUG=1 for "
              "the traceback and report it)", EXIT_INTERNAL)


_WRITE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}


def print_summary(console: Console, result: IngestResult, analysis_seconds: float | None = None) -> None:
    """What was read: one line per fact, wrapped to the console (80 columns when piped), no tables."""
    m = result.manifest
    used = [s for s in result.sources if s.rank is not None and s.kind == "kineto"]
    mb = sum(s.raw_bytes for s in result.sources if s.status == "ingested") / 1e6
    parsed = sum(1 for s in result.sources if s.status == "ingested")
    ingest_seconds = result.seconds - (analysis_seconds or 0)
    speed = f", {mb / ingest_seconds:.0f} MB/s" if parsed and ingest_seconds > 0 else ""
    analysed = f"; analyses {analysis_seconds:.2f}s" if analysis_seconds is not None else ""
    artifacts = Counter(s.kind for s in result.sources if s.kind != "kineto" and s.status in ("ingested", "reused"))
    others = f" and {sum(artifacts.values())} other input(s)" if artifacts else ""
    say(console, f"{len(used)} trace file(s){others} -> {result.out_dir}", indent=0)
    say(console, f"{parsed} parsed, {result.reused} unchanged; {mb:.1f} MB JSON in {ingest_seconds:.2f}s{speed}{analysed}")
    world = f" of world size {m['world_size']}" if m.get("world_size") else ""
    say(console, f"ranks: {_ranges(m['ranks']) or 'none'}{world}", indent=0)
    if artifacts:
        say(console, "other inputs: " + ", ".join(f"{kind}={n}" for kind, n in sorted(artifacts.items())), indent=0)
    if m.get("ignored_count"):
        say(console, f"not read: {m['ignored_count']} file(s) in no format steplens knows (run.json ignored_files)",
            indent=0)
    if used:
        _print_trace_tables(console, used)
    _print_issues(console, result)


def say(console: Console, text: str, indent: int = 2) -> None:
    """Print untrusted text as plain lines wrapped to the console width (80 columns when piped), the
    continuation indented; a word longer than the line (a path) stays whole rather than broken."""
    width = max(console.width, 40)
    lines = textwrap.wrap(safe_text(text), width=width, initial_indent=" " * indent, subsequent_indent=" " * (indent + 2),
                          break_long_words=False, break_on_hyphens=False) or [""]
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _print_trace_tables(console: Console, used: list[Source]) -> None:
    """Profiled steps per rank (ranks with the same steps on one line) and events per kind."""
    by_rank: dict[int, list[Source]] = {}
    for s in used:
        by_rank.setdefault(s.rank, []).append(s)
    same_steps: dict[tuple, list[int]] = {}
    for rank in sorted(by_rank):
        numbers = sorted(n for s in by_rank[rank] for n in s.steps)
        same_steps.setdefault((len(by_rank[rank]), tuple(numbers)), []).append(rank)
    say(console, "profiled steps (ProfilerStep#):", indent=0)
    for (windows, numbers), ranks in same_steps.items():
        steps = f"{len(numbers)} step(s) {_ranges(list(numbers))}" if numbers else "no steps"
        say(console, f"rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)}: {windows} window(s), {steps}")
    kinds = Counter()
    for s in used:
        kinds.update(s.kind_counts)
    # kind=count: a line wrapped at the console width never parts a kind from its count
    say(console, "events (all ranks): " + ", ".join(f"{kind}={kinds[kind]:,}" for kind in schema.KINDS if kinds.get(kind)),
        indent=0)


def _print_issues(console: Console, result: IngestResult) -> None:
    """One line per kind of issue (severity, reason, count, files) and its first example."""
    grouped: dict[tuple, list] = {}
    for s in result.sources:
        for severity, reason, count, detail in s.issues:
            grouped.setdefault((severity, reason), []).append((s.path, count, detail))
    if not grouped:
        say(console, "ingest issues: none", indent=0)
        return
    say(console, f"ingest issues ({len(grouped)} kind(s); all in the ingest_issues table):", indent=0)
    order = {"error": 0, "warning": 1, "info": 2}
    for (severity, reason), rows in sorted(grouped.items(), key=lambda kv: (order.get(kv[0][0], 3), kv[0][1])):
        path, _, detail = rows[0]
        detail = detail.removeprefix(f"{path}: ")
        files = f"{len(rows)} file{'s' if len(rows) > 1 else ''}"
        say(console, f"{severity} {reason}: {sum(r[1] for r in rows):,} in {files}; e.g. {path}: {detail}")


def print_findings(console: Console, f: dict) -> None:
    """Every finding, in the sentences the report and summary.md use."""
    console.print("[bold]findings[/]")
    for line in finding_lines(f):
        say(console, line)


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


@click.group(help="steplens: post-hoc trace and log analysis for DeepSpeed / PyTorch training runs.\n\n"
                  + EXIT_STATUS_HELP.replace("Exit status:", "Exit status (every command):"))
def steplens() -> None:
    pass


steplens.add_command(analyze)


def _sql_help() -> str:
    from steplens.analyze.query.sql import EXAMPLES

    tables = ", ".join(list(schema.TABLES) + list(schema.ANALYSIS_TABLES))
    # One \\b block per example: click keeps its lines as written (the comment above its query).
    examples = "\n\n".join("\b\n  # " + title + "\n" + "\n".join(textwrap.wrap(text, 76, initial_indent="  ",
                                                                         subsequent_indent="    "))
                           for title, text in EXAMPLES.items())
    return f"""Run one SELECT over every steplens run under RUNS_DIR (any folder holding a run.json, such
as RUN/.steplens/), with DuckDB.

Each table is a view across all runs, with a run_id column (per-rank tables also have rank):
{tables}. The view `runs` lists the runs (run_id, run_name, path, world_size, ranks, devices, created_by,
zero_stage, train_batch_size, code_revision, deepspeed_version).
Columns are documented in analyze/contract/schema.py and the README. Queries never modify a run: only a
single SELECT is accepted.

Examples:

{examples}"""


@click.command("sql", help=_sql_help())
@click.argument("runs_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True,
              help="table for reading, csv or json (one object per row) for other tools.")
def sql_command(runs_dir: Path, query: str, fmt: str) -> None:
    from steplens.analyze.query.sql import QueryError, find_runs
    from steplens.analyze.query.sql import query as run_query

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
    from steplens.analyze.query.export_trace import export_trace

    out_dir = run_dir if (run_dir / schema.MANIFEST_FILE).exists() else run_dir / schema.DEFAULT_OUT_DIR
    if not (out_dir / schema.MANIFEST_FILE).exists():
        _fail(f"{run_dir}: not an analysed run (no run.json); run `analyze {run_dir}` first")
    out_path = out_path or out_dir / "merged_trace.json"
    if out_path.exists() and not _is_export(out_path):
        _fail(f"{safe_text(out_path)} exists and is not a trace steplens exported: give a new file with --out")
    counts = export_trace(out_dir, out_path, _step_range(steps))
    if not counts["events"]:
        _fail(f"{run_dir}: no events to export" + (f" in steps {steps}" if steps else ""))
    click.echo(f"{out_path}: {counts['events']:,} events and {counts['flows']:,} launch flows from "
               f"{counts['ranks']} rank(s); {counts['partial_overlaps']:,} slices overlap without nesting")


steplens.add_command(export_trace_command)


def _is_export(path: Path) -> bool:
    """A file export-trace wrote (its otherData, written last, names steplens): the only kind it replaces."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 4096))
            tail = f.read()
    except OSError:
        return False
    return b'"steplens":' in tail and b'"origin_ns":' in tail


def _analysed(run_dir: Path) -> Path:
    """The run's analysed output folder, analysing it first (default options) when it has none."""
    for candidate in (run_dir, run_dir / schema.DEFAULT_OUT_DIR):
        if (candidate / schema.MANIFEST_FILE).exists():
            return candidate
    click.echo(f"analysing {run_dir} first (default options) ...", err=True)
    try:
        with staged(run_dir) as stage:
            analyse_and_report(stage.folder, runner.Options())
            return publish(stage).out_dir
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

    from steplens.analyze.analyses import compare as comparison
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
        why = f": {verdict['why']}" if verdict.get("why") else ""
        console.print(f"{verdict['metric']}: {verdict['verdict']}{why}", markup=False)
        if verdict.get("why_metric"):
            console.print(f"judged on {verdict['metric']}: {verdict['why_metric']}", markup=False)
        for warning in result["warnings"]:
            console.print(f"warning: {safe_text(warning)}", markup=False)
        # One line per row, "label: header value, ...": CI logs (piped, 80 columns) wrap it as text, not as table fragments.
        for table in compare.display_tables(result):
            if table["rows"]:
                console.print(table["title"], markup=False)
                for label, *cells in table["rows"]:
                    pairs = ", ".join(f"{header} {cell}" for header, cell in zip(table["header"][1:], cells) if cell)
                    console.print(f"  {safe_text(label)}: {safe_text(pairs)}", markup=False)
        console.print(f"written: {out_dir / 'compare.html'}, {out_dir / 'compare.md'}", markup=False)
    if fail_pct is not None and comparison.regressed(result, fail_pct):
        sys.exit(EXIT_REGRESSION)


steplens.add_command(compare_command)


def analyze_entry() -> None:
    """The `analyze` script: `analyze RUN_DIR`, and `analyze compare BASE NEW` (unless RUN_DIR is a
    folder named compare)."""
    if len(sys.argv) > 1 and sys.argv[1] == "compare" and not Path("compare").is_dir():
        _guarded(compare_command, sys.argv[2:], prog_name="analyze compare")
    else:
        _guarded(analyze, sys.argv[1:], prog_name="analyze")


def steplens_entry() -> None:
    """The `steplens` script: every subcommand with the documented exit statuses."""
    _guarded(steplens, sys.argv[1:], prog_name="steplens")


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

    from steplens.analyze.analyses.trials import trials
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
    # Narrow enough for an 80-column CI log: the configuration's first run names it (--format json lists every run).
    view = Table(title="configurations (throughput in samples/s, median over trials)", title_justify="left", box=None)
    narrow = ["rank", "configuration", "micro_batch", "trials", "ok_trials", "median", "min", "max"]
    for column in narrow:
        view.add_column(column.replace("_", " "), overflow="fold")
    for c in result["configurations"]:
        view.add_row(*(_cell(c[column]) for column in narrow))
    console.print(view, markup=False)
    console.print(result["ignored_rule"], markup=False, soft_wrap=True)


def _cell(value) -> str:
    if value is None:
        return ""
    return f"{value:,.4g}" if isinstance(value, float) else str(value)


steplens.add_command(trials_command)
