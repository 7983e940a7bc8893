"""The commands over analysed runs: `steplens sql`, `export-trace`, `compare` and `trials`."""

from __future__ import annotations

import itertools
import os
import sys
import textwrap
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from steplens.analyze import analyses
from steplens.analyze.cli_render import (EXIT_PARTIAL, EXIT_REGRESSION, EXIT_UNWRITABLE, FiniteNumber, analyse_and_report,
                                           fail)
from steplens.analyze.cli_rerun import EXIT_INTERRUPTED, Terminated, say, warn
from steplens.analyze.analyses import runner
from steplens.analyze.contract import reuse, schema
from steplens.analyze.contract.manifest import lost_inputs, missing_ranks, run_facts
from steplens.analyze.pipeline.ingest import IngestError, publish, staged
from steplens.analyze.contract.text import file_name_text, safe_text

def _sql_help() -> str:
    from steplens.analyze.query.sql import EXAMPLES

    tables = ", ".join(list(schema.TABLES) + list(analyses.TABLES))
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


def _folder_or_url(ctx, param, value: str) -> Path | str:
    """An existing folder, or an object-store URL (s3://, gs://...) kept as text."""
    from steplens.analyze.pipeline import remote

    return value if remote.is_url(value) else click.Path(exists=True, file_okay=False, path_type=Path).convert(
        value, param, ctx)


@click.command("sql", help=_sql_help())
@click.argument("runs_dir", callback=_folder_or_url)
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True,
              help="table for reading (control characters in values shown as ?), csv or json (one object per row, "
                   "values exactly as stored when written to a file or pipe, but NaN and infinities, which JSON "
                   "lacks, as null; to a terminal, control characters shown as ?) for other tools.")
def sql_command(runs_dir: Path, query: str, fmt: str) -> None:
    import polars as pl

    from steplens.analyze.query.sql import QueryError, find_runs, query_batches

    if not find_runs(runs_dir):
        fail(f"{runs_dir}: no steplens runs (no run.json) under this folder; run `analyze` first")
    skipped: list[tuple[str, str]] = []
    try:
        # csv and json stream the whole result a batch at a time; the table holds the first TABLE_ROWS rows
        batches = query_batches(runs_dir, query, skipped, limit=None if fmt in ("csv", "json") else TABLE_ROWS + 1)
        first = next(batches)
        _warn_skipped(skipped)
        if fmt == "table":
            result = pl.concat([first, *batches], how="vertical")
            _print_result_table(result.head(TABLE_ROWS))
            if result.height > TABLE_ROWS:
                warn(f"the first {TABLE_ROWS} rows; --format csv or json gives them all (or add LIMIT)")
        else:
            # values exactly as stored for the tool that reads them; on a terminal, its escape sequences shown as ?
            shown = safe_text if sys.stdout.isatty() else str
            for index, frame in enumerate(itertools.chain([first], batches)):
                # (not click.echo: to a file or pipe it strips escape sequences, which are values here)
                sys.stdout.write(shown(_csv(frame, index == 0) if fmt == "csv" else _ndjson(frame)))
                sys.stdout.flush()
                if getattr(sys.stdout, "reader_left", False):  # `| head`: the rest of the result is for no one
                    batches.close()  # the query stops now, not when the generator is collected
                    break
    except QueryError as e:
        _warn_skipped(skipped)
        fail(str(e))
    except (KeyboardInterrupt, Terminated):  # the query is stopped (sql.interruptible)
        warn("interrupted")
        sys.exit(EXIT_INTERRUPTED)
    if skipped:
        sys.exit(EXIT_PARTIAL)


def _csv(frame, header: bool) -> str:
    """CSV text of a result batch; a list or struct value (list(rank), a struct pack) as its JSON text, which CSV
    cannot hold otherwise."""
    import polars as pl

    nested = [name for name, dtype in frame.schema.items() if dtype.is_nested()]
    if nested:
        # {"v":VALUE} -> VALUE: the JSON of the value alone
        frame = frame.with_columns(pl.struct(pl.col(name).alias("v")).struct.json_encode().str.slice(5).str.head(-1)
                                   .alias(name) for name in nested)
    return frame.write_csv(include_header=header)


def _ndjson(frame) -> str:
    """JSON lines of a result batch, every number a JSON number: DuckDB's sum() of integers is a HUGEINT, a
    DECIMAL(38,0) here, which polars writes as a quoted string (kept exact as a 128-bit integer; a decimal with a
    fraction as the float a JSON reader would make of it)."""
    import polars as pl

    decimals = {name: pl.Int128 if dtype.scale == 0 else pl.Float64
                for name, dtype in frame.schema.items() if isinstance(dtype, pl.Decimal)}
    return frame.cast(decimals).write_ndjson() if decimals else frame.write_ndjson()


def _warn_skipped(skipped: list[tuple[str, str]]) -> None:
    for run, why in skipped:
        warn(f"warning: {run}: {why}; this run is left out")


def _print_result_table(result) -> None:
    """The result as a table when it fits the terminal (80 columns when piped); otherwise one block per row,
    `column | value`, as psql's expanded display, each value cut into lines under its column. A line break inside a
    value is shown as \\n (it would read as rows of their own)."""
    import polars as pl

    result = result.with_columns(pl.col(pl.String).str.replace_all("\r", r"\r", literal=True)
                                 .str.replace_all("\n", r"\n", literal=True))
    # a list or struct value holding a line break: the column as each value's Python repr, which escapes it (the
    # table would show it as rows of its own); a column name likewise, kept apart from any other name
    for name, dtype in result.schema.items():
        if dtype.is_nested() and any(map(_holds_line_break, result[name].to_list())):
            result = result.with_columns(pl.Series(name, [None if v is None else repr(v) for v in result[name].to_list()],
                                                   pl.String))
    shown: dict[str, str] = {}
    for name in result.columns:
        escaped = name.replace("\r", r"\r").replace("\n", r"\n")
        while escaped != name and (escaped in result.columns or escaped in shown.values()):
            escaped += "'"
        shown[name] = escaped
    result = result.rename(shown)
    width = max(Console(emoji=False).width, 40)
    with pl_config():
        table = safe_text(str(result))  # a value's control characters (ESC ] ... BEL sets the title) shown as ?
    if max((len(line) for line in table.splitlines()), default=0) <= width:
        click.echo(table)
        return
    names = result.columns
    if result.is_empty():  # no row blocks to show: the columns at least
        say(Console(emoji=False), f"no rows; columns: {', '.join(names)}", indent=0)
        return
    pad = min(max(len(name) for name in names), width // 3)
    for index, row in enumerate(result.iter_rows()):
        click.echo(f"-[ row {index + 1} ]" + "-" * max(width - len(f"-[ row {index + 1} ]"), 0))
        for name, value in zip(names, row):
            text = safe_text("null" if value is None else str(value))
            room = width - pad - 3  # cut at the width, not between words: the value reads back exactly
            lines = [text[i:i + room] for i in range(0, len(text), room)] or [""]
            click.echo(f"{safe_text(name)[:pad]:<{pad}} | {lines[0]}")
            for more in lines[1:]:
                click.echo(f"{'':<{pad}} | {more}")


def _holds_line_break(value) -> bool:
    """Whether a list or struct value (as Python lists and dicts) holds text with a line break, at any depth."""
    if isinstance(value, str):
        return "\n" in value or "\r" in value
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, list) and any(map(_holds_line_break, value))


TABLE_ROWS = 200  # rows the table format shows (pl_config's tbl_rows): more go to --format csv or json


def pl_config():
    import polars as pl

    return pl.Config(tbl_rows=TABLE_ROWS, tbl_cols=-1, tbl_width_chars=200, fmt_str_lengths=80, tbl_hide_dataframe_shape=True)




def _step_range(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    first, colon, last = value.partition(":")
    try:
        if colon and not last:  # "10:" is no range: an open end would be read as step 10 alone
            raise ValueError
        low, high = int(first), int(last or first)
    except ValueError:
        raise click.BadParameter("expected A:B (ProfilerStep numbers, inclusive) or A") from None
    if low > high:
        raise click.BadParameter(f"{low}:{high} runs backwards: the first step comes first ({high}:{low})")
    return low, high


@click.command("export-trace")
@click.argument("run_dir", callback=_folder_or_url)
@click.option("--steps", default=None, help="Only ProfilerSteps A to B inclusive, as A:B (or one step A).")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Output file (default: merged_trace.json in the run's output folder, which the next analyze of "
                   "the run replaces with the rest of its result; for an s3:// or gs:// run, here).")
def export_trace_command(run_dir: Path, steps: str | None, out_path: Path | None) -> None:
    """Write one Chrome-trace JSON with every rank of an analysed run on one clock.

    RUN_DIR is a run folder that `analyze` has processed (or its .steplens/ output). Each rank becomes
    a process, its GPU streams become threads, times move onto the reference rank's clock (the
    clock_offsets analysis) and launch links stay as flow arrows. Open the file in Perfetto UI
    (ui.perfetto.dev) or chrome://tracing; slices that overlap without nesting, which Perfetto drops,
    are counted in the summary.
    """
    from steplens.analyze.pipeline import remote
    from steplens.analyze.query.export_trace import export_trace

    if remote.is_url(run_dir):  # a committed result in object storage; the trace is written here
        out_dir = run_dir if remote.committed(run_dir) else remote.join(run_dir, schema.DEFAULT_OUT_DIR)
        if not remote.committed(out_dir):
            fail(f"{run_dir}: not an analysed run (no committed run.json); run `analyze {run_dir}` first")
        out_path = out_path or Path("merged_trace.json")
    else:
        out_dir = reuse.result_folder(run_dir, schema.DEFAULT_OUT_DIR)
        if out_dir is None:
            fail(f"{run_dir}: not an analysed run (no run.json); run `analyze {run_dir}` first")
        out_path = out_path or out_dir / "merged_trace.json"
        from steplens.reports.data import DamagedRun, load

        try:
            manifest = load(out_dir).manifest  # the checks every reader of a result makes (run.json, its entries, files)
        except DamagedRun as e:
            fail(safe_text(e))
    if out_path.exists() and not _is_export(out_path):
        fail(f"{safe_text(out_path)} exists and is not a trace steplens exported: give a new file with --out")
    import polars as pl

    try:
        counts = export_trace(out_dir, out_path, _step_range(steps))
    except pl.exceptions.PolarsError as e:  # a part overwritten with other columns or types
        fail(f"{safe_text(out_dir)}: damaged result (a table's part has other columns or types: "
             f"{safe_text(str(e).splitlines()[0][:200])}); analyse the run again")
    if not counts["events"]:
        fail(f"{run_dir}: no events to export" + (f" in steps {steps}" if steps else ""))
    if not remote.is_url(run_dir) and out_path.resolve().parent == out_dir.resolve():
        _list_as_output(out_dir, out_path.name)
    unaligned = (f"; rank(s) {', '.join(map(str, counts['unaligned_ranks']))} not aligned (no collective kernels to match): "
                 "on their own clocks" if counts["unaligned_ranks"] else "")
    say(Console(highlight=False, emoji=False), f"{out_path}: {counts['events']:,} events and {counts['flows']:,} launch flows from "
        f"{counts['ranks']} rank(s); {counts['partial_overlaps']:,} slices overlap without nesting{unaligned}", indent=0)
    # a merge of what was read: ranks not traced are not in it, and said, as analyze says it; inputs that lost data
    # make it partial: exit 1, as analyze
    if not remote.is_url(run_dir):
        if missing := missing_ranks(manifest):
            warn(f"warning: {missing}: not in the export")
        if lost := lost_inputs(manifest):
            warn(f"warning: {len(lost)} input(s) lost data ({safe_text(_listed(lost))}; see {safe_text(out_dir)}/"
                 "ingest_issues): the export holds what was read")
            sys.exit(EXIT_PARTIAL)




def _list_as_output(out_dir: Path, name: str) -> None:
    """An export written into the output folder is one of its entries (run.json's output_entries): the next
    `analyze` replaces it with the rest of the result instead of refusing a folder with a file it did not write."""
    import json
    import os

    from steplens.analyze.contract import reuse

    manifest = reuse.read_manifest(out_dir)
    entries = manifest.get("output_entries")
    if not isinstance(entries, list) or name in entries:
        return
    manifest["output_entries"] = sorted([*entries, name])
    path = out_dir / schema.MANIFEST_FILE
    tmp = path.with_name(f".{path.name}.export-tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path)


def _is_export(path: Path) -> bool:
    """A plain file export-trace wrote (its otherData, written last, names steplens): the only kind it replaces (a
    device such as /dev/zero never ends, a FIFO blocks the reader)."""
    handle = reuse.open_plain_file(path)
    if handle is None:
        return False
    try:
        with handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - 4096))
            tail = handle.read(4096)
    except OSError:
        return False
    return b'"steplens":' in tail and b'"origin_ns":' in tail


def _analysed(run_dir: Path) -> Path:
    """The run's analysed output folder, analysing it first (default options) when it has none; IngestError
    when it cannot be (nothing usable in it, an output folder that cannot be written)."""
    if (found := reuse.result_folder(run_dir, schema.DEFAULT_OUT_DIR)) is not None:
        return found
    from steplens.analyze.pipeline.ingest import discover
    from steplens.analyze.pipeline.runs import split_appended_logs, split_runs

    found = discover(run_dir, run_dir / schema.DEFAULT_OUT_DIR)
    if len(runs := split_appended_logs(split_runs(run_dir, found))) > 1:  # analyze tells them apart; merged, they
        names = ", ".join(run.name or str(run.path.relative_to(run_dir)) for run in runs[:3])  # would be judged as one
        raise IngestError(f"{run_dir} holds {len(runs)} runs ({names}{', ...' if len(runs) > 3 else ''}): give one run "
                          "folder, or the output folder analyze wrote for it")
    warn(f"analysing {file_name_text(str(run_dir))} first (default options) ...")
    with staged(run_dir, found=found) as stage:
        analyse_and_report(stage.folder, runner.Options())
        return publish(stage).out_dir


# compare's files, each with what its first bytes hold when compare wrote it: another file of the name is the user's
COMPARE_FILES = {"compare.html": b"<title>steplens compare: ", "compare.md": b"### steplens compare: "}


def _not_written_by_compare(path: Path, mark: bytes) -> bool:
    """Whether `path` is there and not a file compare wrote (a link, a folder, another file of that name)."""
    if not os.path.lexists(path):
        return False
    if path.is_symlink() or not path.is_file():  # (a FIFO would block the read)
        return True
    try:
        with open(path, "rb") as f:
            return mark not in f.read(1024)
    except OSError:
        return True


@click.command("compare")
@click.argument("base_run", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("new_run", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", "out_text", default="steplens-compare", show_default=True,
              help="Folder for compare.html and compare.md.")
@click.option("--format", "fmt", type=click.Choice(["text", "md", "json"]), default="text", show_default=True,
              help="text: terminal tables; md: print compare.md (for a PR comment); json: the verdict as data.")
@click.option("--fail-on-regression", "fail_pct", type=FiniteNumber(zero_allowed=True), default=None, metavar="PCT",
              help=f"Exit {EXIT_REGRESSION} when the judged metric (step time, or throughput when the work per step "
                   "differs) got significantly worse by more than PCT percent (CI gating).")
def compare_command(base_run: Path, new_run: Path, out_text: str, fmt: str, fail_pct: float | None) -> None:
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
    from steplens.reports.data import DamagedRun, load, write_atomic

    if not out_text:  # (an unset variable in a CI script: not the current folder)
        fail("--out is empty: give compare a folder of its own (the default is ./steplens-compare)")
    out_dir = Path(out_text)
    if os.path.lexists(out_dir) and not out_dir.is_dir():
        fail(f"--out {safe_text(out_dir)}: not a folder (a file or FIFO of that name is there)")
    # analyze replaces its output folder whole and refuses one holding files it did not write: compare's files
    # written into one would stop the next analyze of that run
    if (held := next((p for p in (out_dir.resolve(), *out_dir.resolve().parents)
                      if (p / schema.MANIFEST_FILE).is_file()), None)) is not None:
        fail(f"--out {safe_text(out_dir)}: inside {safe_text(held)}, a folder analyze wrote; give compare a folder "
             "of its own")
    # a run's own folder is an input: files written there would be read with it by the next analyze
    if inside := next((run for run in (base_run, new_run) if out_dir.resolve() == run.resolve()
                       or run.resolve() in out_dir.resolve().parents), None):
        fail(f"--out {safe_text(out_dir)}: inside the run folder {safe_text(inside)}, an input; give compare a folder of "
             "its own")
    if foreign := [name for name, mark in COMPARE_FILES.items() if _not_written_by_compare(out_dir / name, mark)]:
        fail(f"--out {safe_text(out_dir)}: its {' and '.join(foreign)} {'is' if len(foreign) == 1 else 'are'} not one "
             "compare wrote; move it, or give compare another folder")
    try:
        base, new = load(_analysed(base_run)), load(_analysed(new_run))
        result = comparison.compare(base, new)  # (a table read here may turn out damaged too: other columns)
    except (DamagedRun, IngestError) as e:
        fail(safe_text(e))
    # A run whose analysis lost inputs (exit 1) is compared on what was read; the comparison says so and exits 1.
    partial = [(role, run.out_dir, lost) for role, run in (("base", base), ("new", new))
               if (lost := lost_inputs(run.manifest))]
    result["warnings"] += [f"the {role} run's analysis lost data from {len(lost)} input(s) ({_listed(lost)}; see "
                           f"{out}/ingest_issues): it is compared on what was read" for role, out, lost in partial]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(out_dir / "compare.html", html.render_compare(result))
        write_atomic(out_dir / "compare.md", markdown.render_compare(result))
    except OSError as e:
        fail(f"--out {safe_text(out_dir)}: cannot write there ({e.strerror or e})", EXIT_UNWRITABLE)
    if fmt == "md":
        click.echo((out_dir / "compare.md").read_text(), nl=False)
    elif fmt == "json":
        click.echo(json.dumps(comparison.as_data(result), indent=1, default=str))
    else:
        console = Console(highlight=False, emoji=False)
        verdict = result["verdict"]
        why = f": {verdict['why']}" if verdict.get("why") else ""
        say(console, f"{verdict['metric']}: {verdict['verdict']}{why}", indent=0)
        if verdict.get("why_metric"):
            say(console, f"judged on {verdict['metric']}: {verdict['why_metric']}", indent=0)
        for warning in result["warnings"]:
            say(console, f"warning: {warning}", indent=0)
        # One line per row, "label: header value, ...", wrapped with its continuation indented: CI logs (piped,
        # 80 columns) read it as text, not as table fragments.
        for table in compare.display_tables(result):
            if table["rows"]:
                say(console, table["title"], indent=0)
                for label, *cells in table["rows"]:
                    pairs = ", ".join(f"{header} {cell}" for header, cell in zip(table["header"][1:], cells) if cell)
                    say(console, f"{label}: {pairs}")
        say(console, f"written: {out_dir / 'compare.html'}, {out_dir / 'compare.md'}", indent=0)
    if fail_pct is not None and result["verdict"].get("verdict") in ("not comparable", "not established"):
        # the gate could not judge: said, so that a CI log does not read the exit 0 as a pass
        warn(f"warning: --fail-on-regression {fail_pct:g}% not applied: the verdict is "
             f"'{result['verdict']['verdict']}' (see above)")
    if fail_pct is not None and comparison.regressed(result, fail_pct):
        verdict = result["verdict"]
        warn(f"{verdict['metric']} regressed by {abs(verdict['delta']):.1%}, beyond --fail-on-regression {fail_pct:g}%: "
             f"exit {EXIT_REGRESSION}")
        sys.exit(EXIT_REGRESSION)
    if partial:
        sys.exit(EXIT_PARTIAL)


def _listed(paths: list[str], shown: int = 3) -> str:
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more




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
    from steplens.analyze.analyses.trials import trials
    from steplens.reports.data import DamagedRun, load

    # a link is not followed (as analyze and sql do not): it could lead out of RUNS_DIR, where analysing it first
    # would write a result into someone else's folder
    folders = sorted(p for p in runs_dir.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))
    # (a link within RUNS_DIR, such as latest -> run_042, names a folder already here: skipped without a word)
    runs, left_out = {}, [f"{file_name_text(str(link))}: a link out of {file_name_text(str(runs_dir))}, not followed (give "
                          "the run folder itself); this run is left out"
                          for link in sorted(runs_dir.iterdir()) if link.is_symlink() and link.is_dir()
                          and not link.name.startswith(".") and not _within(link, runs_dir)]
    for folder in folders:
        try:
            run = load(_analysed(folder))
            runs[file_name_text(folder.name)] = (run.table("step_time"), run_facts(run.manifest))
        except (DamagedRun, IngestError) as e:  # named and left out; the other runs are ranked
            left_out.append(f"{safe_text(e)}; this run is left out")
    measured = {name: value for name, value in runs.items() if not value[0].is_empty()}
    left_out += [f"{name}: no step times (collector train_steps, logs or profiler steps); this run is left out"
                 for name in runs if name not in measured]
    for why in left_out:  # (said before a failure too: why every run was left out)
        warn(f"warning: {why}")
    if not measured:
        fail(f"{runs_dir}: no run folder with step times (collector train_steps, logs or profiler steps) under it")
    _print_trials(trials(measured), fmt)
    if left_out:
        sys.exit(EXIT_PARTIAL)


def _within(link: Path, folder: Path) -> bool:
    try:
        return folder.resolve() in link.resolve().parents
    except (OSError, RuntimeError):  # a loop
        return False


def _print_trials(result: dict, fmt: str) -> None:
    import json

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
    console = Console(highlight=False, emoji=False)
    say(console, result["verdict"]["detail"], indent=0)
    say(console, ignored, indent=0)
    # Narrow enough for an 80-column CI log: the configuration's first run names it (--format json lists every run).
    view = Table(title="configurations (throughput in samples/s, median over trials)", title_justify="left", box=None)
    narrow = ["rank", "configuration", "micro_batch", "trials", "ok_trials", "median", "min", "max"]
    for column in narrow:
        view.add_column(column.replace("_", " "), overflow="fold")
    for c in result["configurations"]:
        view.add_row(*(_cell(c[column]) for column in narrow))
    console.print(view, markup=False)
    say(console, result["ignored_rule"], indent=0)


def _cell(value) -> str:
    if value is None:
        return ""
    return f"{value:,.4g}" if isinstance(value, float) else safe_text(value)  # a run's name is a folder's
