"""Command line: `analyze RUN_DIR`, `steplens analyze RUN_DIR`, `python -m steplens.analyze RUN_DIR`."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import secrets
import socket
import sys
import time
import urllib.parse
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
    TransferSpeedColumn,
)

from steplens.analyze import importers
from steplens.analyze.importers import kineto, nsys
from steplens.analyze.analyses import kernels, runner
from steplens.analyze import cli_rerun
from steplens.analyze.contract import reuse, schema
from steplens.analyze.contract.manifest import missing_ranks

from steplens.analyze.pipeline.ingest import (
    IngestError,
    IngestResult,
    OutputUnwritable,
    classify,
    discover,
    input_key,
    reused_result,
)
from steplens.analyze.pipeline import remote
from steplens.analyze.pipeline import run as pipeline_run
from steplens.analyze.pipeline.workers import keep_pandas_out_of_pyarrow, use_system_allocator
from steplens.analyze.pipeline.runs import RunFolder, split_appended_logs, split_runs, subset
from steplens.analyze.cli_commands import compare_command, export_trace_command, sql_command, trials_command
from steplens.analyze.cli_render import (FiniteNumber, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_NOTHING, EXIT_PARTIAL,  # noqa: F401 - EXIT_* are public here too
                                         EXIT_REGRESSION, EXIT_STATUS_HELP, EXIT_UNWRITABLE, analyse_and_report,
                                         fail, import_figures, summary_lines)
from steplens.analyze.contract.text import number_ranges, safe_text
from steplens.reports.verdict import finding_lines, first_screen

ANALYZE_HELP = f"""Turn what a training job left in RUN_DIR into queryable Parquet tables, analyses and a report.

RUN_DIR is searched recursively (hidden folders skipped) for: per-rank PyTorch-profiler traces
(.json or .json.gz, as tensorboard_trace_handler or export_chrome_trace wrote them); Nsight Systems
SQLite exports (.sqlite, from nsys export --type sqlite); the steplens
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
@click.argument("run_dir", callback=lambda ctx, param, value: _path_or_url(value))
@click.option("--out", "out_dir", callback=lambda ctx, param, value: _path_or_url(value, folder=True), default=None,
              help=f"Write the run directory here instead of RUN_DIR/{schema.DEFAULT_OUT_DIR}/ (a new or empty folder, "
                   "or one steplens wrote; or an s3://, gs://... URL).")
@click.option("--scheduler", default=None, metavar="ADDRESS",
              help="Parse the traces as tasks on this Dask cluster (e.g. tcp://10.0.0.5:8786; needs steplens[dask]). "
                   "--out must be on a file system the workers share, or an object-store URL they write to.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Files parsed in parallel (default: number of CPUs). Memory grows with it, not with the number of ranks.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no ingest summary: print only the findings.")
@click.option("--ingest-only", is_flag=True, help="Write the trace tables only; skip the runner.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp8", "tf32", "fp32"]), default=None,
              help="Compute dtype whose dense peak MFU divides by. Default: the dtype of most of the traced matmuls' "
                   "FLOPs (TF32 where their kernels are TF32 ones), else the job's DeepSpeed or Megatron config's, else "
                   "bf16 (said to be assumed).")
@click.option("--peak-tflops", type=FiniteNumber(), default=None,
              help="Dense peak TFLOP/s per GPU, overriding the device table (needed for devices it does not know).")
@click.option("--params", type=FiniteNumber(), default=None,
              help="Model shape for the analytic (PaLM) MFU numerator: non-embedding parameters N. Each shape value "
                   "not given comes from the collector's manifest where it recorded one.")
@click.option("--layers", type=click.IntRange(min=1), default=None, help="Model shape: transformer layers L.")
@click.option("--hidden", type=click.IntRange(min=1), default=None, help="Model shape: hidden size d (or --heads and --head-dim).")
@click.option("--heads", type=click.IntRange(min=1), default=None, help="Model shape: attention heads H (hidden = H x head dim).")
@click.option("--head-dim", type=click.IntRange(min=1), default=None, help="Model shape: head dimension Q.")
@click.option("--seq-len", type=click.IntRange(min=1), default=None, help="Model shape: sequence length T.")
@click.option("--tokens-per-step", type=click.IntRange(min=1), default=None, help="Global tokens per optimizer step (all ranks).")
@click.option("--recompute", is_flag=True, help="Full activation recompute was on: also report HFU (PaLM + one forward).")
@click.option("--grad-norm-threshold", type=FiniteNumber(), default=None,
              help="Alarm when a grad-norm scalar exceeds this (default: alarm on robust-z spikes only).")
@click.option("--format", "fmt", type=click.Choice(["text", "md"]), default="text", show_default=True,
              help="text: terminal tables; md: print summary.md (markdown for a PR comment) instead.")
@click.option("--kernel-categories", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="CSV with columns category,pattern (regex on kernel names), checked before the built-in patterns "
                   "(a kernel with a recorded collective stays communication, copies and sets stay memcpy and memset).")
@click.option("--step-range", default=None, metavar="REGEX",
              help="Nsight Systems exports: the NVTX ranges that are steps, the step number in the first group "
                   "(default: ProfilerStep#N, 'iteration N', 'step N'). Without step ranges the whole window is analysed.")
@click.option("--nsys-export", is_flag=True,
              help="Run `nsys export --type sqlite` (nsys must be on the PATH) for each .nsys-rep in RUN_DIR without a "
                   ".sqlite beside it, writing that .sqlite, before reading the folder. Never done without this flag.")
def analyze(run_dir: Path, out_dir: Path | None, jobs: int | None, quiet: bool, ingest_only: bool, dtype: str,
            peak_tflops: float | None, params, layers, hidden, heads, head_dim, seq_len, tokens_per_step, recompute: bool,
            grad_norm_threshold: float | None, fmt: str, kernel_categories: Path | None, scheduler: str | None,
            step_range: str | None, nsys_export: bool) -> None:
    use_system_allocator()
    console = Console(stderr=False, highlight=False, emoji=False)
    if not remote.is_url(run_dir) and not run_dir.exists():
        fail(f"{safe_text(run_dir)}: no such file or folder")
    if step_range is not None:
        try:
            pattern = re.compile(step_range)
        except re.error as e:
            fail(f"--step-range {safe_text(step_range)}: not a regular expression ({safe_text(e)})")
        if pattern.groups < 1:
            fail(f"--step-range {safe_text(step_range)}: needs a group capturing the step number, e.g. 'iteration (\\d+)'")
        if why := kernels.regex_problem(step_range):
            fail(f"--step-range {safe_text(step_range)}: not a regular expression steplens can run ({safe_text(why)}; "
                 "the syntax is Rust's regex crate: no look-around or back-references)")
    # Read by the nsys importer, in this process and the workers it spawns (empty: its default)
    os.environ[nsys.STEP_RANGE_ENV] = step_range or ""
    if nsys_export and not remote.is_url(run_dir):
        for report, outcome in nsys.export_reports(run_dir if run_dir.is_dir() else run_dir.parent):
            cli_rerun.say(console, f"{safe_text(report)}: {safe_text(outcome)}", indent=0)
    if (heads is None) != (head_dim is None):
        fail("--heads and --head-dim go together (hidden = heads x head dim); or give --hidden")
    if hidden is not None and heads is not None and hidden != heads * head_dim:
        fail(f"--hidden {hidden} is not --heads x --head-dim ({heads * head_dim})")
    shape = {"params": params, "layers": layers, "hidden": hidden or (heads * head_dim if heads else None),
             "seq_len": seq_len, "tokens_per_step": tokens_per_step}
    try:
        categories = kernels.load_categories(kernel_categories) if kernel_categories else list(kernels.KERNEL_CATEGORIES)
    except kernels.CategoriesError as e:
        fail(f"--kernel-categories {safe_text(e)}")
    options = runner.Options(
        dtype=dtype, peak_tflops=peak_tflops, recompute=recompute, grad_norm_threshold=grad_norm_threshold,
        shape={k: v for k, v in shape.items() if v is not None} or None, kernel_categories=categories,
    )
    runs, out_of = _runs_to_analyse(run_dir, out_dir)
    client = None
    if scheduler:
        from steplens.analyze.pipeline import cluster  # Dask only when asked for

        client = cluster.connect(scheduler)
    if len(runs) == 1:
        run, out = runs[0], out_of(runs[0])
        # The default analysis of a local folder records how the analyze script answers a re-run (cli_rerun.py).
        recorded = (not ingest_only and fmt == "text" and client is None and options == runner.Options()
                    and not remote.is_url(run_dir) and not remote.is_url(out) and run_dir.is_dir())
        announced = []

        def announce(stage, findings: dict) -> None:
            """The findings as soon as they exist: report.html's figures are drawn after this."""
            announced.append(True)
            if fmt == "md":
                click.echo((stage.folder / "summary.md").read_text(), nl=False)
                return
            so_far = IngestResult(stage.out_dir, stage.manifest, stage.sources, stage.parsed, stage.reused,
                                  time.perf_counter() - stage.started)
            summary = [] if quiet else summary_lines(so_far, findings.get("analysis_seconds"))
            cli_rerun.print_findings(console, summary, screen_lines(findings), finding_lines(findings))

        try:
            result, findings = _analyse_run(run, out, jobs, options, ingest_only, show_progress=not quiet, client=client,
                                            rerun_key=reuse.listing_key(run_dir, out) if recorded else None,
                                            announce=None if remote.is_url(out) else announce)
        except OutputUnwritable as e:
            fail(safe_text(e), EXIT_UNWRITABLE)
        except IngestError as e:
            if not (apart := _unranked_traces_apart(run, e, out_dir)):
                fail(safe_text(_as_given(e, run, run_dir)))
            _say_or_md(console, fmt, f"{run_dir}: {len(apart)} traces with no rank, from different processes: "
                                     "separate runs, each analysed on its own:")
            sys.exit(_analyse_each(run_dir, apart, jobs, options, ingest_only, client=client, fmt=fmt))
        if fmt == "md" and findings:
            if not announced:
                click.echo((result.out_dir / "summary.md").read_text(), nl=False)
        else:
            summary = [] if quiet else summary_lines(result, findings.get("analysis_seconds"))
            if findings:
                rendered = (f"rendered in {findings['report_seconds']:.2f}s" if "report_seconds" in findings
                            else "unchanged")
                if not announced:
                    cli_rerun.print_findings(console, summary, screen_lines(findings), finding_lines(findings))
                cli_rerun.print_report_line(console, result.out_dir, rendered)
            else:  # --ingest-only: what was read
                for text, indent in summary:
                    cli_rerun.say(console, text, indent)
        _warn_missing_ranks(result)
        _warn_figures_not_drawn(findings)
        _note_python_reader([result])
        sys.exit(_status(result))
    _say_or_md(console, fmt, f"{run_dir} holds {len(runs)} runs; each is analysed on its own:")
    sys.exit(_analyse_each(run_dir, [(run, out_of(run)) for run in runs], jobs, options, ingest_only,
                           out_given=out_dir is not None, client=client, fmt=fmt))


def _say_or_md(console, fmt: str, text: str, indent: int = 0) -> None:
    """A line of the several-runs listing: wrapped text, or with --format md a markdown paragraph."""
    if fmt == "md":
        from steplens.reports.markdown import escape

        click.echo(escape(safe_text(text)) + "\n")
    else:
        cli_rerun.say(console, text, indent=indent)


def _path_or_url(value: str | None, folder: bool = False) -> Path | str | None:
    """A local path, or an object-store URL kept as text (a Path would fold its '//'); a file:// URL is its path."""
    if value is not None and value.lower().startswith("file://"):
        value = urllib.parse.unquote(urllib.parse.urlparse(value).path)
    if value is not None and value.lower().startswith("memory://"):
        raise click.BadParameter(f"{value}: a memory:// store lives as long as this process; what analyze wrote there "
                                 "would be gone when it ends")
    if value is None or remote.is_url(value):
        return value
    if folder and Path(value).is_file():
        raise click.BadParameter(f"{value} is a file, not a folder")
    try:
        os.stat(value)
    except OSError as e:  # (a path that is not there yet is fine: --out makes it)
        if e.errno == errno.ELOOP:
            raise click.BadParameter(f"{value}: a symbolic link that leads to itself (a loop)") from None
    return Path(value)


def _analyse_each(run_dir: Path, runs: list[tuple[RunFolder, Path]], jobs, options: runner.Options,
                  ingest_only: bool, out_given: bool = False, client=None, fmt: str = "text") -> int:
    """Several runs, one line each with where its report is (with --format md, each run's summary.md); the exit
    status of them all."""
    statuses, results = [], []
    pending = list(runs)
    console = Console(stderr=False, highlight=False, emoji=False)
    while pending:
        run, out = pending.pop(0)
        name = safe_text(run.name or _run_name(run, run_dir))
        try:
            result, findings = _analyse_run(run, out, jobs, options, ingest_only, show_progress=False, client=client)
        except OutputUnwritable as e:
            fail(safe_text(e), EXIT_UNWRITABLE)
        except IngestError as e:
            if apart := _unranked_traces_apart(run, e, out if out_given else None):
                cli_rerun.say(console, f"{name}: {len(apart)} traces with no rank, from different processes: separate runs")
                pending[:0] = apart
                continue
            statuses.append(EXIT_NOTHING)
            _say_or_md(console, fmt, f"{name}: not analysed: {safe_text(e)}", indent=2)
            continue
        statuses.append(_status(result))
        results.append(result)
        if fmt == "md" and findings:
            click.echo((result.out_dir / "summary.md").read_text())
            continue
        ranks = number_ranges(result.manifest.get("ranks", []))
        problems = sum(1 for s in result.sources for i in s.issues if i[0] == "error")
        report = result.out_dir / ("report.html" if findings else schema.MANIFEST_FILE)
        cli_rerun.say(console, f"{name}: {len(result.sources)} input(s), ranks {ranks or 'none'}, {problems} error(s)")
        cli_rerun.say(console, str(report), indent=4)
        _warn_figures_not_drawn(findings)
    _note_python_reader(results)
    if all(s == EXIT_NOTHING for s in statuses):
        return EXIT_NOTHING
    return EXIT_PARTIAL if any(s != 0 for s in statuses) else 0


def _unranked_traces_apart(run: RunFolder, error: IngestError, out_dir: Path | None) -> list[tuple[RunFolder, Path]]:
    """Traces that name no rank and come from different processes (before/after traces, two
    models side by side) are separate one-rank runs, not one run that cannot be told apart: each
    is written to OUT/FILE, or to .steplens-FILE beside it."""
    traces = [s for s in error.sources if s.kind in importers.TRACE_KINDS]
    unranked = [s for s in traces if any(i[1] == "rank_unknown" for i in s.issues)]
    if len(unranked) < 2 or len(unranked) != len(traces) or run.found.native:
        return []
    apart = []
    for source in unranked:
        trace = run.path / source.path
        if out_dir:
            out = _under(out_dir, _out_name(trace.name))
        elif trace in run.found.remote:  # beside the trace in its store
            out = f"{run.found.remote[trace].url.rsplit('/', 1)[0]}/{schema.DEFAULT_OUT_DIR}-{trace.name}"
        else:
            out = trace.parent / _out_name(f"{schema.DEFAULT_OUT_DIR}-{trace.name}")
        apart.append((RunFolder(run.path, subset(run.found, lambda p, trace=trace: p == trace), name=source.path), out))
    return apart


# A file name's limit on Linux and macOS (NAME_MAX) less what staging and publishing add to an output folder's name
# (".NAME.tmp-PID", ".NAME.old-PID", PIDs up to 7 digits): a longer output name could not be staged.
MAX_OUT_NAME_BYTES = 255 - len("..tmp-") - 7


def _out_name(name: str) -> str:
    """An output folder's name derived from an input's: the name itself when it fits, else its start and a hash
    of the whole (two long names sharing a start stay apart)."""
    if len(name.encode(errors="surrogateescape")) <= MAX_OUT_NAME_BYTES:
        return name
    digest = hashlib.sha256(name.encode(errors="surrogateescape")).hexdigest()[:12]
    start = name.encode(errors="surrogateescape")[:MAX_OUT_NAME_BYTES - len(digest) - 1]
    return f"{start.decode(errors='ignore')}-{digest}"


def _as_given(error: IngestError, run: RunFolder, run_dir: Path | str) -> str:
    """Why nothing could be ingested, naming what the user gave: the file (not the folder it is in), the URL (not
    its local mirror)."""
    message = str(error)
    if type(error) is not IngestError:  # an unsafe --out, a store's answer: they name what they are about
        return message
    if run.found.origin:
        return message.replace(str(run.path), run.found.origin)
    if isinstance(run_dir, Path) and run_dir.is_file():
        details = [issue[3] for source in error.sources for issue in source.issues]
        return f"{run_dir}: " + (details[0] if details else
                                 "not a file steplens reads (a profiler trace, collector output or DeepSpeed artifact)")
    return message


def _run_name(run: RunFolder, run_dir: Path | str) -> str:
    """A run among several, by its folder below RUN_DIR (a run in object storage: below its URL)."""
    if run.found.origin and remote.is_url(run_dir):
        return run.found.origin[len(str(run_dir).rstrip("/")) + 1:] or str(run_dir)
    return os.path.relpath(run.path, run_dir) if run.path != run_dir else run_dir.name


def _under(out: Path | str, *parts: str) -> Path | str:
    """A place below an output folder or an output URL."""
    return remote.join(out, *parts) if remote.is_url(out) else Path(out, *parts)


def _runs_to_analyse(run_dir: Path, out_dir: Path | None):
    """The runs under run_dir (or the one trace file it names), and where each one's output goes."""
    if remote.is_url(run_dir):  # told apart as a local folder is, in a mirror holding all but the traces
        mirror, found = remote.discover(run_dir)
        runs = split_appended_logs(split_runs(mirror, found))
        if len(runs) == 1:
            return runs, lambda run: out_dir or remote.join(run_dir, schema.DEFAULT_OUT_DIR)

        def remote_out_of(run: RunFolder) -> Path | str:
            if out_dir is None:
                return _apart(remote.join(run.found.origin, schema.DEFAULT_OUT_DIR), run)
            relative = run.path.relative_to(mirror).parts
            return _apart(_under(out_dir, *(relative or ["_top"])), run)

        return runs, remote_out_of
    if run_dir.is_file():
        out = out_dir or run_dir.parent / _out_name(f"{schema.DEFAULT_OUT_DIR}-{run_dir.name}")
        return split_appended_logs([RunFolder(run_dir.parent, classify([run_dir]))]), lambda run: _apart(out, run)
    if not run_dir.is_dir():
        fail(f"{safe_text(run_dir)}: not a file or folder steplens can read")
    try:
        local_out = None if remote.is_url(out_dir) else out_dir or run_dir / schema.DEFAULT_OUT_DIR
        found = discover(run_dir, local_out)
    except OSError as e:
        fail(f"{safe_text(run_dir)}: cannot list the folder: {e.strerror or e}")
    runs = split_appended_logs(split_runs(run_dir, found))
    if len(runs) == 1:
        return runs, lambda run: out_dir or run_dir / schema.DEFAULT_OUT_DIR

    def out_of(run: RunFolder) -> Path:
        if out_dir is None:
            return _apart(run.path / schema.DEFAULT_OUT_DIR, run)
        relative = run.path.relative_to(run_dir)
        return _apart(out_dir / (relative if relative.parts else "_top"), run)

    return runs, out_of


def _apart(out: Path | str, run: RunFolder) -> Path | str:
    """The output of one of the jobs appended to one log file: OUT-run<k>, beside the others'."""
    if run.log_run is None:
        return out
    return f"{out.rstrip('/')}-run{run.log_run + 1}" if remote.is_url(out) else out.with_name(f"{out.name}-run{run.log_run + 1}")


def _analyse_run(run: RunFolder, out: Path | str, jobs, options: runner.Options, ingest_only: bool,
                 show_progress: bool, client=None, rerun_key: str | None = None,
                 announce=None) -> tuple[IngestResult, dict]:
    """One run through the pipeline (pipeline/run.py), with what the command adds: the progress bar, the report
    (drawn while the workers parse, its imports done while this process would wait), `announce(stage, findings)`
    as soon as the findings exist (before the report's figures are drawn) and, with `rerun_key`
    (contract/reuse.listing_key of the command's RUN_DIR), the record of how a re-run is answered."""
    key = None if remote.is_url(out) else input_key(run.path, run.found, repr((options, ingest_only, nsys.step_range().pattern)))
    total = 0
    for path in run.found.traces + [path for path, _, _ in run.found.native]:
        try:
            total += run.found.remote[path].size if path in run.found.remote else path.stat().st_size
        except OSError:
            pass
    progress = Progress(TextColumn("ingest"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TextColumn("{task.fields[files]} files"), TimeRemainingColumn(),
                        console=Console(stderr=True, emoji=False), transient=True, disable=not (show_progress and sys.stderr.isatty()))
    with progress:
        task = progress.add_task("ingest", total=total or None, files=0)

        def advance(source) -> None:
            progress.update(task, advance=source.size, files=progress.tasks[task].fields["files"] + 1)

        hooks = pipeline_run.Hooks(analyse=analyse_and_report, progress=advance, when_idle=import_figures,
                                   record=(lambda stage: _rerun_record(rerun_key, stage)) if rerun_key else None,
                                   findings=announce)
        return pipeline_run.run(run.path, out, options, jobs=jobs, ingest_only=ingest_only, reuse_key=key, client=client,
                                hooks=hooks, found=run.found)


def screen_lines(findings: dict) -> list[str]:
    """The report's first screen, as the terminal prints it (without the links)."""
    return [text for text, _section in first_screen(findings)]


def _status(result: IngestResult) -> int:
    """0 when every input was used; partial when a file, or a rank in it, was lost."""
    lost = result.failed or any(i[0] == "error" for s in result.sources for i in s.issues)
    return EXIT_PARTIAL if lost else 0


def _rerun_record(key: str, stage) -> dict:
    """What a re-run with nothing changed prints and returns, made by the code that prints it here."""
    token = f"\x00out-{secrets.token_hex(8)}\x00"
    reused = reused_result(Path(token), stage.manifest)
    # As a re-run reads them: from findings.json (its JSON round trip can turn a value into its text).
    findings = json.loads((stage.folder / "findings.json").read_text())
    return cli_rerun.record(key, token, summary_lines(reused), screen_lines(findings), finding_lines(findings),
                            _missing_ranks_warning(reused), _status(reused))


def _warn_figures_not_drawn(findings: dict | None) -> None:
    """A report figure that failed is a note in its place (reports/html.py); the command says so too."""
    for note in (findings or {}).get("figures_not_drawn", []):
        cli_rerun.warn(f"report.html: {note}")


def _warn_missing_ranks(result: IngestResult) -> None:
    if warning := _missing_ranks_warning(result):
        cli_rerun.warn(warning)


def _note_python_reader(results: list[IngestResult]) -> None:
    """Once per command: Kineto traces were parsed by the Python reader, the native columnizer not being built."""
    parsed = any(s.kind == "kineto" and s.status == "ingested" for result in results for s in result.sources)
    if parsed and not kineto.native_available():
        cli_rerun.warn("note: the native Kineto reader is not built (no C compiler when steplens was installed); "
                       "the traces were parsed by the Python reader, about 3x slower")


def _missing_ranks_warning(result: IngestResult) -> str | None:
    return f"warning: {missing}" if (missing := missing_ranks(result.manifest)) else None


def _show_click_error(error: click.exceptions.ClickException) -> None:
    """click's usage lines as click prints them, then its error wrapped to the terminal as steplens's own are
    (a long path stays whole on its line rather than running the message past 80 columns)."""
    shown = io.StringIO()
    error.show(file=shown)
    lines = shown.getvalue().rstrip("\n").split("\n")
    at = next((i for i, line in enumerate(lines) if line.startswith("Error: ")), len(lines))
    if lines[:at]:
        click.echo("\n".join(lines[:at]), err=True)
    if lines[at:]:
        cli_rerun.warn(" ".join(lines[at:]).removeprefix("Error: "), lead="Error: ")


def _guarded(command: click.Command, args: list[str] | None = None, prog_name: str | None = None) -> None:
    """Run a command with the documented exit statuses for what click does not handle: a full or
    read-only disk, Ctrl-C and SIGTERM (one line each), and internal errors."""
    cli_rerun.catch_interrupts()  # set already by the scripts; not by a caller of steplens_entry or analyze_entry
    try:
        command.main(args, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("interrupted: the last published result is unchanged", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except (KeyboardInterrupt, cli_rerun.Terminated):
        click.echo("interrupted: the last published result is unchanged", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.exceptions.ClickException as e:
        _show_click_error(e)
        sys.exit(EXIT_NOTHING)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except OutputUnwritable as e:
        fail(safe_text(e), EXIT_UNWRITABLE)
    except IngestError as e:
        fail(safe_text(e))
    except socket.gaierror as e:  # (an OSError without a file name): name the URLs given, one of whose hosts it is
        urls = ", ".join(safe_text(a) for a in (args if args is not None else sys.argv[1:]) if remote.URL.match(str(a)))
        fail(f"{urls or 'a URL given'}: cannot reach its host ({e.strerror or e})")
    except OSError as e:
        fail(f"{safe_text(e.filename)}: {e.strerror or e}" if e.filename else safe_text(e.strerror or e),
             EXIT_UNWRITABLE if e.errno in _WRITE_ERRNOS else EXIT_NOTHING)
    except (Exception, pl.exceptions.PanicException) as e:  # noqa: BLE001 - one line and a distinct status, no traceback
        if os.environ.get("STEPLENS_DEBUG"):
            raise
        fail(f"internal error: {type(e).__name__}: {safe_text(e)} (a steplens bug: rerun with STEPLENS_DEBUG=1 for "
              "the traceback and report it)", EXIT_INTERNAL)


_WRITE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}


@click.group(help="steplens: post-hoc trace and log analysis for DeepSpeed / PyTorch training runs.\n\n"
                  + EXIT_STATUS_HELP.replace("Exit status:", "Exit status (every command):"))
def steplens() -> None:
    pass


for command in (analyze, sql_command, export_trace_command, compare_command, trials_command):
    steplens.add_command(command)


def analyze_entry() -> None:
    """The `analyze` script: `analyze RUN_DIR`, and `analyze compare BASE NEW` (unless RUN_DIR is a
    folder named compare)."""
    keep_pandas_out_of_pyarrow()
    if len(sys.argv) > 1 and sys.argv[1] == "compare" and not Path("compare").is_dir():
        _guarded(compare_command, sys.argv[2:], prog_name="analyze compare")
    else:
        _guarded(analyze, sys.argv[1:], prog_name="analyze")


def steplens_entry() -> None:
    """`steplens` (every subcommand) with the documented exit statuses."""
    if sys.argv[1:2] == ["analyze"]:
        keep_pandas_out_of_pyarrow()
    _guarded(steplens, sys.argv[1:], prog_name="steplens")
