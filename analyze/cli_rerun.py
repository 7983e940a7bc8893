"""The `analyze` script, and its answer to a re-run with nothing changed.

A re-run with nothing changed reuses the published result as it is (pipeline/ingest.py `unchanged`),
but reaching that answer through the full command costs more than the answer: importing polars,
pyarrow and the importers takes most of a second. So a result made with the default analysis options
records in run.json `rerun` a key over every file under the run folder and the steplens code
(contract/reuse.listing_key), and what a re-run prints. This module checks that key with the
standard library alone (and rich, to print as the full command does); when it matches and the
result is whole, it prints the recorded lines, wrapped to this terminal, and exits with the
recorded status. Any other command line (another option, a URL), a changed file or an incomplete
result takes the full command.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import unicodedata
from pathlib import Path

from steplens.analyze.contract import reuse
from steplens.analyze.contract.text import path_text, safe_text

DEFAULT_OUT_DIR = ".steplens"  # schema.DEFAULT_OUT_DIR (test_rerun checks they agree)
# What a recording this code wrote can hold; anything else (an edited run.json) goes to the full command.
MAX_INDENT = 8
RECORDED_STATUSES = (0, 1)  # cli_render.EXIT_PARTIAL: a published result was complete or partial


def say(console, text: str, indent: int = 2, lead: str | None = None) -> None:
    """Print untrusted text as plain lines wrapped to the console width (80 columns when piped), the
    continuation indented; a word longer than the line (a path) stays whole rather than broken. `lead`
    (`error: `) starts the first line in place of the indent, a long word after it on the same line."""
    for line in wrapped(safe_text(text), max(console.width, 40), " " * indent if lead is None else lead,
                        " " * (indent + 2)):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def wrapped(text: str, width: int, first: str, rest: str) -> list[str]:
    """text's words in lines of at most `width` terminal columns (a CJK character takes two: textwrap counts
    characters, and a line of them ran to 112 columns), `first` then `rest` before them; a word longer than a
    line stays whole on a line of its own (a path)."""
    lines, line, used = [], first, _columns(first)
    fresh = True  # nothing but the lead on the line yet
    for word in text.split():
        size = _columns(word)
        if not fresh and used + 1 + size > width:
            lines.append(line)
            line, used, fresh = rest, _columns(rest), True
        line, used, fresh = (line + word, used + size, False) if fresh else (line + " " + word, used + 1 + size, False)
    lines.append(line)
    return [line for line in lines if line.strip()] or [""]


def _columns(text: str) -> int:
    """Terminal columns: East Asian wide and full-width characters take two, combining marks none."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


HEADER_LINES = 2  # summary_lines' first two: what was read into where, and how long it took


def warn(text: str, lead: str = "") -> None:
    """A closing warning (or, with `lead` "error: ", the error) on stderr, wrapped like the rest (80 columns
    when piped), continuation indented."""
    from rich.console import Console

    say(Console(stderr=True, highlight=False, emoji=False), text, indent=0, lead=lead)


def print_result(console, summary: list[tuple[str, int]], verdict: list[str], finding_texts: list[str], out_dir: Path,
                 rendered: str) -> None:
    """What the run answered, first screen first: where the output went, the verdict (the report's first
    screen), what was read, every finding in the report's sentences, where the report and summary.md are."""
    print_findings(console, summary, verdict, finding_texts)
    print_report_line(console, out_dir, rendered)


def print_findings(console, summary: list[tuple[str, int]], verdict: list[str], finding_texts: list[str]) -> None:
    """print_result up to the findings: what `analyze` prints as soon as the analyses are done, before the
    report's figures are drawn."""
    for text, indent in summary[:HEADER_LINES]:
        say(console, text, indent)
    console.print("[bold]verdict[/]")
    for text in verdict:
        say(console, text)
    for text, indent in summary[HEADER_LINES:]:
        say(console, text, indent)
    console.print("[bold]findings[/]")
    for text in finding_texts:
        say(console, text)


def print_report_line(console, out_dir: Path, rendered: str) -> None:
    """print_result's last line: where report.html and summary.md are."""
    console.print(f"report: {path_text(out_dir / 'report.html')} ({rendered})\nPR summary: "
                  f"{path_text(out_dir / 'summary.md')}", markup=False, highlight=False, soft_wrap=True)


def record(key: str, out_token: str, summary: list[tuple[str, int]], verdict: list[str], findings: list[str],
           warning: str | None, status: int) -> dict:
    """run.json `rerun`: the key, and what a re-run prints; `out_token` stands for the output folder as
    the re-run names it."""
    return {"key": key, "out_token": out_token, "summary": summary, "verdict": verdict, "findings": findings,
            "warning": warning, "status": status}


def _arguments(argv: list[str]) -> tuple[Path, Path, bool] | None:
    """RUN_DIR, the output folder and --quiet, when the command line holds nothing else (--jobs aside)."""
    run_dir, out_dir, quiet = None, None, False
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-q", "--quiet"):
            quiet = True
        elif arg == "--out" and args and out_dir is None:
            out_dir = args.pop(0)
        elif arg.startswith("--out=") and out_dir is None:
            out_dir = arg.removeprefix("--out=")
        elif arg in ("--jobs", "-j") and args and args[0].isdigit() and int(args[0]) > 0:
            args.pop(0)  # how the work is spread out, not what it gives
        elif arg.startswith("-") or run_dir is not None:
            return None
        else:
            run_dir = arg
    if not run_dir or out_dir == "" or "://" in run_dir or "://" in (out_dir or ""):
        return None
    return Path(run_dir), Path(out_dir) if out_dir else Path(run_dir) / DEFAULT_OUT_DIR, quiet


def answer(argv: list[str]) -> int | None:
    """The exit status after printing what the full command would, or None: run the full command (which also says
    what is wrong with a path that cannot be looked at: a name too long, a folder it may not read)."""
    parsed = _arguments(argv)
    if parsed is None:
        return None
    run_dir, out_dir, quiet = parsed
    try:
        if not run_dir.is_dir() or not out_dir.is_dir():
            return None
        manifest = reuse.read_manifest(out_dir)
        recorded = manifest.get("rerun")
        if not isinstance(recorded, dict) or not reuse.complete(out_dir, manifest):
            return None
        if recorded.get("key") != reuse.listing_key(run_dir, out_dir):
            return None
    except (OSError, RuntimeError):  # (RuntimeError: a symlink loop, as pathlib says it)
        return None
    try:
        summary = [] if quiet else [(text.replace(recorded["out_token"], str(out_dir)), int(indent))
                                    for text, indent in recorded["summary"]]
        findings, warning, status = list(recorded["findings"]), recorded["warning"], int(recorded["status"])
        verdict = list(recorded["verdict"])
    except (TypeError, ValueError, KeyError, AttributeError):  # not a recording this code wrote
        return None
    if not (all(isinstance(text, str) and 0 <= indent <= MAX_INDENT for text, indent in summary)
            and all(isinstance(text, str) for text in findings + verdict) and isinstance(warning, (str, type(None)))
            and status in RECORDED_STATUSES):
        return None
    from rich.console import Console  # as the full command prints: same width, same styles

    console = Console(stderr=False, highlight=False, emoji=False)
    print_result(console, summary, verdict, findings, out_dir, "unchanged")
    if warning:
        warn(warning)
    return status


class ReaderMayLeave:
    """A script's stdout whose reader may go away (`analyze RUN | head`): the rest of the lines go to
    /dev/null and the command goes on to publish its result, where a BrokenPipeError would end it with
    nothing written. Everything else is the wrapped stream's."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.reader_left = False  # a command whose output is all it does (sql) stops when it is

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        self.reader_left = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())  # what the stream still buffers is flushed there too
        os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def exit_without_teardown(entry) -> None:
    """Run a console script's `entry` (its stdout a ReaderMayLeave), then end the process without the
    interpreter's teardown: freeing every module of polars, pyarrow and matplotlib one by one takes
    0.1-0.3 s and does nothing for a command that has written its files and printed its lines. Only
    when no other non-daemon thread is alive (nothing left to wait for); an uncaught exception exits as
    Python does."""
    if sys.stdout is not None and not isinstance(sys.stdout, ReaderMayLeave):
        sys.stdout = ReaderMayLeave(sys.stdout)
    try:
        entry()
        status = 0
    except SystemExit as e:
        status = e.code
    except Terminated:  # before the command set its own handlers (cli._guarded), which say the same
        print("interrupted: the last published result is unchanged", file=sys.stderr)
        status = EXIT_INTERRUPTED
    if not isinstance(status, int):  # sys.exit("message"): printed, status 1, as Python does
        if status is not None:
            print(status, file=sys.stderr)
        status = 0 if status is None else 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):  # a reader that went away (| head) or a closed stream
        pass
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(status)
    os._exit(status)


def compile_own_modules(packages: tuple[Path, ...] | None = None) -> None:
    """Byte-compile steplens's analyzer and reports into their __pycache__ when this interpreter does
    not write bytecode (PYTHONDONTWRITEBYTECODE, python -B): an editable install is not compiled by pip,
    so every process of every run would compile its 13k lines from source again (0.15-0.3 s of CPU a
    run, the workers' included; they are spawned after this). Up-to-date files are only checked (3 ms);
    a folder that cannot be written (an installed, already compiled copy) is left as it is."""
    if not sys.dont_write_bytecode:
        return
    import compileall

    import steplens.reports

    for folder in packages or (Path(__file__).parent, Path(steplens.reports.__file__).parent):
        compileall.compile_dir(folder, quiet=2)  # a file it cannot write is a quiet failure, not an error


EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM: the last published result is unchanged


class Terminated(BaseException):
    """SIGTERM or Ctrl-C, raised in the main thread so that cleanup (workers, staging folder) runs;
    not a KeyboardInterrupt, which click would answer with a line of its own."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def catch_interrupts() -> None:
    """SIGTERM and Ctrl-C raise Terminated from here on: set first, so that one during the imports exits 130
    as one later does, not 143 or a KeyboardInterrupt traceback. One that arrives while the handlers are being set
    (the handler runs inside signal.signal's own return) exits 130 here."""
    try:
        signal.signal(signal.SIGTERM, _raise_terminated)
        signal.signal(signal.SIGINT, _raise_terminated)
    except Terminated:
        print("interrupted: the last published result is unchanged", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


# The narrowest terminal the output is laid out for: rich takes COLUMNS as it is, and COLUMNS=0 printed nothing at
# all (errors included), COLUMNS=1 a character a line.
MIN_COLUMNS = 40


def usable_columns() -> None:
    """COLUMNS that is no width (0, negative, text) is dropped, so the terminal's own width (or 80) is used; one
    narrower than MIN_COLUMNS is widened to it."""
    given = os.environ.get("COLUMNS")
    if given is None:
        return
    if not (given.strip().isascii() and given.strip().isdigit()) or int(given) == 0:  # ('²' is a digit to Python)
        del os.environ["COLUMNS"]
    elif int(given) < MIN_COLUMNS:
        os.environ["COLUMNS"] = str(MIN_COLUMNS)


def main() -> None:
    """The `analyze` script."""
    catch_interrupts()
    usable_columns()
    exit_without_teardown(analyze_entry)


def steplens_main() -> None:
    """The `steplens` script (every subcommand), set up as `analyze` is before polars is imported."""
    catch_interrupts()
    usable_columns()
    exit_without_teardown(_steplens_entry)


def _steplens_entry() -> None:
    from steplens.analyze.pipeline import workers

    workers.fewer_collections()
    workers.return_polars_freed_pages()
    workers.one_blas_thread()
    with workers.imports_without_collections():
        from steplens.analyze import cli

    cli.steplens_entry()


def analyze_entry() -> None:
    """`analyze`: a re-run with nothing changed answered here, anything else by the full
    command (cli.py)."""
    status = answer(sys.argv[1:])
    if status is not None:
        sys.exit(status)
    from steplens.analyze.pipeline import workers

    workers.fewer_collections()
    compile_own_modules()
    workers.return_polars_freed_pages()
    workers.one_blas_thread()
    try:
        if (early := _run_dir_and_jobs(sys.argv[1:])) is not None:
            workers.start_early_for(*early)  # they import while this process does
        with workers.imports_without_collections():
            from steplens.analyze import cli

        cli.analyze_entry()
    finally:
        workers.stop_early()


# The analyze command's options that take a value (test_workers checks them against cli.analyze).
VALUE_OPTIONS = {"--out", "--scheduler", "--jobs", "-j", "--dtype", "--peak-tflops", "--params", "--layers", "--heads",
                 "--head-dim", "--seq-len", "--tokens-per-step", "--grad-norm-threshold", "--format",
                 "--kernel-categories", "--step-range", "--hidden"}


def _run_dir_and_jobs(argv: list[str]) -> tuple[Path, int] | None:
    """`analyze RUN_DIR ...`'s local RUN_DIR and --jobs, for workers started before the imports; None
    for another command, a URL, --scheduler (a cluster's workers) or --help."""
    run_dir, jobs, args = None, os.cpu_count() or 1, list(argv)
    if args[:1] == ["compare"]:
        return None
    while args:
        arg = args.pop(0)
        name, _, value = arg.partition("=")
        # --step-range reaches the workers through their environment, set once the options are read
        if arg in ("--help", "--scheduler") or name in ("--scheduler", "--step-range"):
            return None
        if name in VALUE_OPTIONS:
            value = value if "=" in arg else (args.pop(0) if args else "")
            if name in ("--jobs", "-j"):
                if not value.isdigit():
                    return None  # click will say what is wrong
                jobs = int(value)
        elif not arg.startswith("-"):
            run_dir = arg
    try:
        if run_dir is None or "://" in run_dir or not Path(run_dir).is_dir():
            return None
    except OSError:  # (a name too long to look at: the full command says so)
        return None
    return Path(run_dir), jobs
