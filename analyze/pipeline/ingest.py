"""Ingest a run folder (per-rank Kineto traces, the collector's Parquet parts, native DeepSpeed
artifacts) into a steplens run directory.

Never touches the inputs. Output is built in a sibling staging folder and swapped in at the end, so a
killed ingest leaves the previous result readable. Unchanged inputs (same size, mtime and hash of
their first 64 KiB) are not parsed again: their Parquet parts are linked over from the last result.
Files are parsed in worker processes, a bounded number at a time, so memory does not grow with the
number of ranks.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from steplens.analyze import importers
from steplens.analyze.importers import telemetry
from steplens.analyze.contract import issue_reasons, reuse, schema
from steplens.analyze.contract.manifest import RunManifest, fact_problem, settle_world_size
from steplens.analyze.contract.traces import DecodedTrace, NotATrace, ParsedTrace
from steplens.analyze.contract.text import file_name_text
from steplens.analyze.importers.base import Importer, conform
from steplens.analyze.trace import semantics
from steplens.analyze.pipeline.workers import Workers, estimated_json_bytes, worth_workers

# Candidates; the content decides (a .gz may hold any JSON export, or not be JSON at all).
HASH_PREFIX_BYTES = reuse.PREFIX_BYTES
# What a parser or an importer may raise on one bad file: a Rust panic in polars or pyarrow's binding
# surfaces as pyo3's PanicException, a BaseException that `except Exception` lets through.
FILE_FAILURES = (Exception, pl.exceptions.PanicException)
IGNORED_LISTED = 200  # run.json lists this many unrecognised files by name (a checkpoint folder has thousands)
PARSED_TABLES = reuse.TRACE_TABLES


class IngestError(Exception):
    """Nothing usable to ingest; the message is one line for the user, `sources` what became of each file."""

    def __init__(self, message: str, sources: list | None = None):
        super().__init__(message)
        self.sources = sources or []


class UnsafeOutput(IngestError):
    """The output folder is not one steplens may replace (it holds inputs or files it did not write)."""


class OutputUnwritable(Exception):
    """The output cannot be written (permissions, read-only or full disk); nothing was published."""


@dataclass
class Source:
    """One input file and what became of it (a row of run.json's `sources`)."""

    path: str
    size: int
    mtime_ns: int
    hash_prefix: str
    status: str = "pending"  # ingested | reused | ignored | error
    kind: str = "kineto"  # the name of the importer that read it (run.json keeps it)
    companions: list = field(default_factory=list)  # other files read with it (relative paths)
    tables: list = field(default_factory=list)  # tables it has parts in (non-Kineto sources)
    ranks: list = field(default_factory=list)  # ranks in its rows (non-Kineto sources)
    facts: dict = field(default_factory=dict)  # run facts it gave (versions, config, ...)
    rank: int | None = None
    rank_origin: str | None = None  # distributedInfo | file name | only trace | process in file
    part_id: str = ""
    events: int = 0
    raw_bytes: int = 0
    kind_counts: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)
    trace_rank: int | None = None
    world_size: int | None = None
    host_pids: list = field(default_factory=list)
    trace_meta: dict = field(default_factory=dict)
    issues: list = field(default_factory=list)  # [severity, reason, count, detail]
    seconds: float = 0.0
    # A file of several ranks (an nsys export of several processes) is one source per rank: `unit` says
    # which part (process 1234), `unit_index` its place in the file; the parse returns the first with
    # the others in `units` (never in run.json: each is a source of its own there).
    unit: str = ""
    unit_index: int | None = None
    units: list = field(default_factory=list)

    def fingerprint(self) -> tuple:
        return (self.path, self.size, self.mtime_ns, self.hash_prefix)


@dataclass
class IngestResult:
    out_dir: Path
    manifest: dict
    sources: list[Source]
    parsed: int
    reused: int
    seconds: float
    unchanged: bool = False  # the previous result, reused as it is (nothing read or written)

    @property
    def failed(self) -> list[Source]:
        return [s for s in self.sources if s.status == "error"]


# ---------------------------------------------------------------------------------------------
# Discovery


@dataclass
class Discovered:
    """The files of a run folder, sorted by who reads them."""

    traces: list[Path]  # Kineto candidates (.json/.gz nobody else claimed)
    native: list[tuple[Path, Importer, list[Path]]]  # (file, importer, companions)
    unknown: list[Path]  # nobody reads these
    # Never opened: FIFOs, devices, sockets (a FIFO would block the read forever) and entries that
    # cannot be looked at; (path, [severity, reason, count, detail]).
    special: list[tuple[Path, list]] = field(default_factory=list)
    # A run in object storage (pipeline/remote.py): its URL, and the traces streamed from it (their
    # paths lie in a local mirror of the run's layout that holds only the other files).
    origin: str | None = None
    remote: dict = field(default_factory=dict)  # mirror path -> remote.RemoteFile


def discover(run_dir: Path, out_dir: Path | None) -> Discovered:
    """Every file under run_dir, skipping hidden files and folders and the output folder (None: one
    in object storage)."""
    files, named = [], []  # named: folders not looked into, each with its issue
    try:
        out_dir = out_dir.resolve() if out_dir is not None else None
    except RuntimeError:  # a link that leads to itself: refused as an output later (a link), never inside the run
        out_dir = out_dir.absolute()

    def unlisted(path: Path, error: OSError) -> None:
        """A sub-folder that cannot be listed (permissions, a path past the system's limit) costs what it holds."""
        named.append((path, ["error", "unreadable", 1, f"a folder that cannot be listed ({error.strerror or error}): "
                                                        "skipped with what it holds"]))

    def walk_error(error: OSError) -> None:
        if Path(error.filename) == Path(run_dir):
            raise error  # the run folder itself: nothing to read
        unlisted(Path(error.filename), error)

    for root, dirs, names in os.walk(run_dir, onerror=walk_error):
        kept = []
        for d in sorted(d for d in dirs if not d.startswith(".")):
            path = Path(root) / d
            try:
                if path.resolve() == out_dir:
                    continue
                linked = path.is_symlink()
                result = not linked and os.path.isfile(path / schema.MANIFEST_FILE) and _written_by_steplens(path)
            except OSError as e:
                unlisted(path, e)
                continue
            if linked:  # not followed (it can lead out of the run, or in a loop), and named for it
                named.append((path, ["warning", "linked_folder", 1, "a symbolic link to a folder: not followed"]))
            elif result:
                named.append((path, ["info", "output_folder", 1, "a result analyze wrote (an --out inside the run "
                                                                 "folder): not read as an input"]))
                continue
            kept.append(d)
        dirs[:] = kept
        files.extend(Path(root) / name for name in sorted(names) if not name.startswith("."))
    found = classify(files)
    found.special += named
    return found


def classify(files: list[Path]) -> Discovered:
    """Offer each regular file to the telemetry importers, then what is left to the trace importers."""
    files, special = _regular_files(files)
    native, taken = [], set()
    for path in files:
        if path in taken or (importer := telemetry.claimant(path)) is None:
            continue
        companions = [c for c in importer.companions(path) if c.is_file()]
        taken.update([path, *companions])
        native.append((path, importer, companions))
    rest = [p for p in files if p not in taken]
    traces = [p for p in rest if importers.trace_claimant(p) is not None]
    return Discovered(traces=traces, native=native, unknown=[p for p in rest if p not in set(traces)], special=special)


def _regular_files(files: list[Path]) -> tuple[list[Path], list[tuple[Path, list]]]:
    """The regular files (symlinks followed), and an issue for each other entry, which is never opened."""
    regular, special = [], []
    for path in files:
        try:
            mode = path.stat().st_mode
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOENT) and path.is_symlink():  # no file behind it: nothing to lose
                special.append((path, ["warning", "broken_link", 1, "a symbolic link that leads to no file (its target "
                                       f"is missing, or the links loop: {e.strerror or e}): nothing to read"]))
            else:
                special.append((path, ["error", "unreadable", 1, f"cannot read: {e.strerror or e}"]))
            continue
        if stat.S_ISREG(mode):
            regular.append(path)
        else:
            what = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
                    "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
            special.append((path, ["warning", "special_file", 1, f"{what}, not a regular file: skipped without opening it"]))
    return regular, special


def relative_name(path: Path, base: Path) -> str:
    """An input's name in the tables, run.json and the reports: its path from the run folder, a byte of it that is
    not UTF-8 shown as U+FFFD (the file is still opened by its own path)."""
    return file_name_text(os.path.relpath(path, base))


def _unopened_source(path: Path, base: Path, issue: list) -> Source:
    source = Source(path=relative_name(path, base), size=0, mtime_ns=0, hash_prefix="",
                    status="error" if issue[0] == "error" else "ignored")
    source.issues.append(issue)
    return source


def _describe(path: Path, base: Path, companions: list[Path] = ()) -> Source:
    stat = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(HASH_PREFIX_BYTES))
    for other in companions:  # a change in any file read with it means parsing again
        other_stat = other.stat()
        digest.update(f"{relative_name(other, base)}:{other_stat.st_size}:{other_stat.st_mtime_ns}".encode())
    rel = relative_name(path, base)
    source = Source(path=rel, size=stat.st_size, mtime_ns=stat.st_mtime_ns, hash_prefix=digest.hexdigest()[:16],
                    companions=[relative_name(c, base) for c in companions])
    source.part_id = hashlib.sha256(repr(source.fingerprint()).encode()).hexdigest()[:16]
    return source


# ---------------------------------------------------------------------------------------------
# Parsing one file (runs in a worker process)


def _write_table(frame: pl.DataFrame, table: str, path: Path) -> None:
    arrow = frame.to_arrow().cast(schema.TABLES[table][0])
    tmp = path.with_name(path.name + ".tmp")
    # Dictionary pages for text only: on ids and times they cost half the write time and save nothing.
    text, others = schema.text_columns(arrow.schema)
    pq.write_table(arrow, tmp, compression="zstd", use_dictionary=text, write_statistics=others)
    os.replace(tmp, path)


def _opened(location: str):
    """A local path, or an object in storage streamed by the parser (pipeline/remote.py: imported,
    with fsspec, only for URLs)."""
    if "://" not in location:
        return Path(location)
    from steplens.analyze.pipeline import remote

    return remote.StreamedObject(location)


def read_trace(path, source: str, location: str | None = None) -> ParsedTrace | list[ParsedTrace]:
    """One trace file (a local Path, or an object streamed from storage, whose URL is `location`) -> its
    rank's trace tables, or one per rank for a file of several: its format's importer decodes it, then the
    trace semantics (steps, launch links, flows) are applied and `source` stamped on every row, the same
    for every format. Raises NotATrace (not a trace of a known format) or OSError (unreadable)."""
    decoded = importers.trace_claimant(Path(location or path)).decode(path)
    return [_trace_tables(part, source) for part in decoded] if isinstance(decoded, list) else _trace_tables(decoded, source)


def _trace_tables(decoded: DecodedTrace, source: str) -> ParsedTrace:
    started = time.perf_counter()
    issues = list(decoded.issues)
    events, steps, flows = semantics.apply(decoded.events, decoded.endpoints, issues, decoded.step_name or semantics.STEP_NAME)
    events = events.select([pl.lit(source).alias("source") if c == "source" else
                            pl.col(c) if c in events.columns else pl.lit(None).alias(c) for c in schema.TRACE_EVENTS.names])
    steps = steps.select(pl.lit(source).alias("source"), pl.all())
    flows = flows.select(pl.lit(source).alias("source"), pl.all())
    seconds = {**decoded.stage_seconds, "semantics": time.perf_counter() - started}
    return ParsedTrace(events, flows, steps, decoded.meta, issues, decoded.raw_bytes, seconds, decoded.unit)


LINKED_ELSEWHERE = "a link to a file outside the run folder that is no trace (what it holds is not quoted)"


def _linked_from_elsewhere(abs_path: str, relative: str) -> bool:
    """Whether the file at abs_path (`relative` to its run folder) is a link to a file outside that folder."""
    if "://" in abs_path or not relative or not abs_path.endswith(relative):
        return False
    root = os.path.realpath(abs_path[: len(abs_path) - len(relative)] or ".")
    try:
        return os.path.commonpath([root, os.path.realpath(abs_path)]) != root
    except ValueError:  # on two drives (Windows)
        return True


def _parse_source(abs_path: str, source: Source, scratch: str) -> Source:
    started = time.perf_counter()
    try:
        parsed = read_trace(_opened(abs_path), source.path, abs_path)
    except NotATrace as e:
        # What a linked file outside the run folder holds is not quoted: the report goes on a PR
        what = LINKED_ELSEWHERE if _linked_from_elsewhere(abs_path, source.path) else str(e)
        if e.damaged:  # a .json file that is not JSON, or a trace cut before its events: a lost input
            source.status = "error"
            source.issues.append(["error", "damaged_trace", 1, f"a trace file with nothing usable: {what}"])
        else:
            source.status = "ignored"
            source.issues.append(["info", "not_a_trace", 1, f"not a trace: {what}"])
        return source
    except (OSError, EOFError) as e:
        source.status = "error"
        source.issues.append(["error", "unreadable", 1, f"cannot read: {e}"])
        return source
    except FILE_FAILURES as e:  # a file the parser fails on costs that file, not the run
        source.status = "error"
        source.issues.append(["error", "parse_failed", 1, f"the trace parser failed: {type(e).__name__}: {str(e)[:300]!r}"])
        return source
    if isinstance(parsed, list):  # a file of several ranks: one source each, read with the first
        units = [_write_parsed(part, replace(source, issues=list(source.issues), unit=part.unit, unit_index=i,
                                             part_id=hashlib.sha256(f"{source.part_id}:{part.unit}".encode()).hexdigest()[:16]),
                               scratch, started) for i, part in enumerate(parsed)]
        units[0].units = units[1:]
        return units[0]
    return _write_parsed(parsed, source, scratch, started)


# The issues whose events are left out of a trace's tables (issue_reasons: "skipped", "dropped").
EVENTS_LEFT_OUT = ("malformed_event", "nesting_too_deep", "oversized_event", "missing_timestamp", "bad_timestamp")


def _count_events_lost(source: Source, parsed: ParsedTrace) -> None:
    left_out = {i.reason: i.count for i in parsed.issues if i.reason in EVENTS_LEFT_OUT}
    lost, total = sum(left_out.values()), sum(left_out.values()) + parsed.events.height
    if lost and lost >= issue_reasons.EVENTS_LOST_SHARE * total:
        reasons = ", ".join(f"{reason} {count:,}" for reason, count in sorted(left_out.items()))
        source.issues.append(["error", "events_lost", lost, f"{lost:,} of the trace's {total:,} events "
                              f"({lost / total:.0%}) were left out ({reasons}): its figures stand on the rest only"])


def _write_parsed(parsed: ParsedTrace, source: Source, scratch: str, started: float) -> Source:
    if parsed.events.is_empty():
        source.status = "error"
        source.issues.extend([i.severity, i.reason, i.count, i.detail] for i in parsed.issues)
        # events left out for a reason of their own (a time beyond any session, say) can be every event: say which
        dropped = [f"{i.reason} ({i.count:,})" for i in parsed.issues if i.reason in EVENTS_LEFT_OUT]
        source.issues.append(["error", "no_events", 1, "a trace with no events left once rows with problems were left "
                              f"out: {', '.join(dropped)}" if dropped else
                              "a trace with no complete events (empty or cut before the first event)"])
        return source
    out = Path(scratch) / source.part_id
    out.mkdir(parents=True, exist_ok=True)
    for table, frame in (("trace_events", parsed.events), ("flows", parsed.flows), ("steps", parsed.steps)):
        _write_table(frame, table, out / f"{table}.parquet")
    _record_trace_facts(source, parsed)
    _count_events_lost(source, parsed)
    source.status = "ingested"
    source.seconds = round(time.perf_counter() - started, 3)
    return source


def _parse_native(path: Path, source: Source, importer: Importer, scratch: Path) -> Source:
    """Run one importer; a crash in it costs that file only, reported with the file's name."""
    started = time.perf_counter()
    source.kind = importer.name
    try:
        imported = importer.parse(path, source.path)
    except FILE_FAILURES as e:  # one bad file must not end the ingest of the others
        source.status = "error"
        source.issues.append(["error", "import_failed", 1, f"{importer.name} importer failed: {type(e).__name__}: {e}"])
        return source
    source.issues.extend(imported.issues)
    source.facts = imported.facts
    out = scratch / source.part_id
    out.mkdir(parents=True, exist_ok=True)
    ranks = set()
    for table, frame in imported.tables.items():
        if frame.is_empty():
            continue
        _write_table(conform(frame, table), table, out / f"{table}.parquet")
        source.tables.append(table)
        ranks.update(r for r in frame["rank"].unique().to_list() if r is not None)
        source.events += frame.height
    source.ranks = sorted(ranks)
    has_errors = any(i[0] == "error" for i in imported.issues)
    source.status = "ingested" if source.tables or imported.facts else ("error" if has_errors else "ignored")
    if source.status == "ignored" and not imported.issues:
        source.issues.append(["info", "no_data", 1, f"recognised as {importer.name} but holds no data"])
    source.seconds = round(time.perf_counter() - started, 3)
    return source


def _record_trace_facts(source: Source, parsed: ParsedTrace) -> None:
    """The run facts a trace gives, each checked: a value of the wrong type or out of range is left
    out of run.json and named in a `bad_metadata` issue."""
    meta = parsed.meta
    problems = list(meta.problems)
    source.trace_rank, source.world_size = meta.rank, meta.world_size
    if source.trace_rank is not None and source.world_size is not None and source.trace_rank >= source.world_size:
        problems.append(f"world size {source.world_size} is not above its rank {source.trace_rank}")
        source.world_size = None
    source.trace_meta = {
        "schema_version": meta.schema_version,
        "backend": meta.backend,
        "nccl_version": meta.nccl_version,
        "pg_count": meta.pg_count,
        "device_names": sorted({d.name for d in meta.devices} - {None, ""}),
        "device_sms": sorted({d.sm_count for d in meta.devices} - {None}),
        "cuda_runtime_version": meta.cuda_runtime_version,
        "cuda_driver_version": meta.cuda_driver_version,
        "base_time_ns": meta.base_time_ns,
        "display_time_unit": meta.display_time_unit,
    }
    if problems:
        shown = "; ".join(dict.fromkeys(problems))
        source.issues.append(["warning", "bad_metadata", len(problems),
                              f"trace metadata left out (wrong type or out of range): {shown[:400]}"])
    events = parsed.events
    source.events = events.height
    source.raw_bytes = parsed.raw_bytes
    # The host-clock time the trace covers: two traces of one rank that overlap in it are one rank twice.
    span = events.select(pl.col("ts_ns").min(), (pl.col("ts_ns") + pl.col("dur_ns").fill_null(0)).max().alias("end"))
    source.trace_meta["span_ns"] = list(span.row(0)) if span.height and span.row(0)[0] is not None else None
    source.kind_counts = dict(sorted(events.group_by("kind").len().iter_rows()))
    source.steps = parsed.steps["step"].to_list()
    host = events.filter(pl.col("kind").is_in(["cpu_op", "user_annotation"]))["pid"].drop_nulls().unique().sort()
    source.host_pids = host.head(8).to_list()
    source.issues.extend([i.severity, i.reason, i.count, i.detail] for i in parsed.issues)


# ---------------------------------------------------------------------------------------------
# Ranks


def own_rank(source: Source) -> tuple[int | None, str | None]:
    """(the rank a parsed trace tells by itself, how): the rank its trace records (distributedInfo.rank), else a
    rank<N> in its file name; (None, None) for a process of a file of several ranks, or a trace that tells none,
    whose rank the run's other traces decide (_assign_ranks)."""
    if source.trace_rank is not None:
        return source.trace_rank, "distributedInfo"
    if source.unit_index is None and (named := schema.rank_in_name(Path(source.path).name)) is not None:
        return named, "file name"
    return None, None


def _assign_ranks(sources: list[Source]) -> None:
    """own_rank, else one rank per process of a file of several ranks, else rank 0 if it is clearly the only one."""
    unresolved = []
    for s in sources:
        if s.status not in ("ingested", "reused") or s.kind not in importers.TRACE_KINDS:
            continue
        rank, origin = own_rank(s)
        if s.trace_rank is None and (ignored := schema.rank_in_name_issue(Path(s.path).name)):
            s.issues.append(ignored)
        if rank is not None:
            s.rank, s.rank_origin = rank, origin
        elif s.unit_index is None:
            unresolved.append(s)  # (a file of several ranks: below, once the other files' ranks are known)
        if origin == "file name":
            s.issues.append(["warning", "rank_from_filename", 1,
                             f"no distributedInfo.rank in the trace; rank {s.rank} taken from the file name"])
    _ranks_by_process(sources)
    _reject_duplicate_ranks(sources)
    if not unresolved:
        return
    resolved = [s for s in sources if s.rank is not None and s.kind in importers.TRACE_KINDS]
    one_process = len({tuple(s.host_pids) for s in unresolved}) == 1
    if not resolved and (len(unresolved) == 1 or one_process):
        for s in unresolved:
            s.rank, s.rank_origin = 0, "only trace"
            what = "the only trace" if len(unresolved) == 1 else "windows of one process"
            s.issues.append(["warning", "rank_assumed", 1, f"no rank in the trace or its name; treated as rank 0 ({what})"])
        return
    for s in unresolved:
        s.status = "error"
        s.issues.append(["error", "rank_unknown", 1,
                         "cannot tell which rank this trace is: no distributedInfo.rank and no 'rank<N>' in the "
                         "file name (rename it, e.g. rank-3.json.gz, to include it)"])


def _ranks_by_process(sources: list[Source]) -> None:
    """One rank per process of the files that hold several ranks: in file-path order, then each file's
    own order (importers give their units in rank order), after the ranks other traces name."""
    units = sorted((s for s in sources if s.unit_index is not None and s.rank is None and s.status in ("ingested", "reused")
                    and s.kind in importers.TRACE_KINDS), key=lambda s: (s.path, s.unit_index))
    taken = {s.rank for s in sources if s.rank is not None and s.kind in importers.TRACE_KINDS}
    rank = 0
    for s in units:
        while rank in taken:
            rank += 1
        s.rank, s.rank_origin = rank, "process in file"
        taken.add(rank)
        s.issues.append(["warning", "rank_from_process", 1, f"one rank per process: {s.unit} (number {s.unit_index + 1} of "
                         f"its file, in the order its importer gives) is treated as rank {rank}"])


def _name_disagrees(source: Source) -> bool:
    """A trace whose file name names another rank than the one it records (renamed or copied under another name)."""
    named = schema.rank_in_name(Path(source.path).name) if source.unit_index is None else None
    return named is not None and source.trace_rank is not None and named != source.trace_rank


def _overlap(a: Source, b: Source) -> bool:
    span_a, span_b = a.trace_meta.get("span_ns"), b.trace_meta.get("span_ns")
    return bool(span_a and span_b) and max(span_a[0], span_b[0]) < min(span_a[1], span_b[1])


def _reject_duplicate_ranks(sources: list[Source]) -> None:
    """Two traces of one rank that cover the same time (overlapping time spans, byte-identical copies or
    the same ProfilerStep numbers) are never merged: the later one is an error and skipped. Profiler
    windows of one process (torch.profiler's repeat >= 2: one file per window, each with the process's
    baseTimeNanoseconds) share a rank and a base time, but neither host-clock time nor steps: all kept.
    Two traces of one rank recording different world sizes are two jobs' (one process has one world
    size): the later one is an error and skipped too. A trace whose file name names another rank than it records
    counts as later than one whose name agrees."""
    kept: dict[int, list[Source]] = {}
    # of two claims, the trace whose file name agrees with the rank it records is kept (then path order)
    for s in sorted(sources, key=_name_disagrees):
        if s.rank is None or s.status not in ("ingested", "reused") or s.kind not in importers.TRACE_KINDS:
            continue
        twin = next((k for k in kept.get(s.rank, []) if (k.size, k.hash_prefix) == (s.size, s.hash_prefix)
                     or _overlap(k, s) or set(k.steps) & set(s.steps)), None)
        other_job = next((k for k in kept.get(s.rank, []) if k.world_size and s.world_size
                          and k.world_size != s.world_size), None)
        if twin is None and other_job is None:
            kept.setdefault(s.rank, []).append(s)
            continue
        s.status = "error"
        if _name_disagrees(s):  # (only here: files named by local rank disagree on every node but the first)
            s.issues.append(["warning", "rank_name_disagrees", 1,
                             f"the file name says rank {schema.rank_in_name(Path(s.path).name)}, the trace's "
                             f"distributedInfo.rank {s.rank}: of two traces of rank {s.rank}, the one named for it is kept"])
        s.issues.append(["error", "duplicate_rank", 1,
                         f"claims rank {s.rank} for the same time as {twin.path} (overlapping time, identical file or the "
                         "same profiler steps); skipped, not merged into that rank" if twin is not None else
                         f"claims rank {s.rank} of world size {s.world_size}, as {other_job.path} does of world size "
                         f"{other_job.world_size}: ranks of two jobs; skipped, not merged into that rank"])


# ---------------------------------------------------------------------------------------------
# Output folder: steplens replaces only a folder it wrote itself (marked by its own run.json, every
# entry in it listed there), never an input folder, a parent of the inputs or a user's files.

OUTPUT_CREATOR = reuse.OUTPUT_CREATOR
# Entries of an output folder written before run.json listed them (`output_entries`).
_KNOWN_OUTPUT_FILES = {schema.MANIFEST_FILE, "report.html", "summary.md", "findings.json"}
PART_ID = re.compile(r"[0-9a-f]{16}")


def _written_by_steplens(folder: Path) -> bool:
    return reuse.read_manifest(folder).get("created_by") == OUTPUT_CREATOR


def _foreign_entries(folder: Path) -> list[str]:
    """Entries of an existing output folder that steplens did not write."""
    from steplens.analyze import analyses  # here: the parse workers that import this module need no analysis
    manifest = reuse.read_manifest(folder)
    listed = manifest.get("output_entries")
    owned = set(listed) if isinstance(listed, list) else (
        _KNOWN_OUTPUT_FILES | set(schema.TABLES) | set(analyses.TABLES))
    return sorted(name for name in os.listdir(folder) if name not in owned)


def _separate_results_of(run_dir: Path, out_dir: Path) -> bool:
    """out_dir holds only the results of this run's traces analysed as separate runs (traces with no
    rank from different processes, each in OUT/TRACE): a re-run either splits it again, replacing each
    one, or, the run being one again, replaces them whole. Results of other runs are never taken for them."""
    entries = list(out_dir.iterdir())
    for entry in entries:
        manifest = reuse.read_manifest(entry) if entry.is_dir() and not entry.is_symlink() else {}
        sources = manifest.get("sources")
        if (manifest.get("created_by") != OUTPUT_CREATOR or manifest.get("run_name") != file_name_text(run_dir.name)
                or not isinstance(sources, list) or not sources):
            return False
        paths = [s.get("path") if isinstance(s, dict) else None for s in sources]
        if not all(isinstance(p, str) and (run_dir / p).resolve().is_relative_to(run_dir) and (run_dir / p).exists()
                   for p in paths):
            return False
    return bool(entries)


def check_output_folder(run_dir: Path, out_dir: Path) -> None:
    """Refuse an output folder whose replacement would lose anything that is not steplens's own output."""
    if Path(out_dir).is_symlink():  # replacing it would rename the link and leave it behind
        raise UnsafeOutput(f"{out_dir} is a symbolic link: steplens replaces its output folder whole and does not "
                           "follow or replace a link; remove it, or give the folder it points to with --out")
    run, out = Path(run_dir).resolve(), Path(out_dir).resolve()
    if file_name_text(str(out)) != str(out):  # Arrow and polars name files in UTF-8 only
        raise UnsafeOutput(f"{file_name_text(str(out_dir))}: the output folder's path holds bytes that are not UTF-8 "
                           "(shown as \ufffd), in which the tables cannot be written; give another folder with --out")
    if out == run or run.is_relative_to(out):
        raise UnsafeOutput(f"--out {out_dir} holds the inputs ({run_dir}): the output folder is replaced on every "
                           f"run, so give a folder of its own (the default is RUN_DIR/{schema.DEFAULT_OUT_DIR})")
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise UnsafeOutput(f"{out_dir} exists and is not a folder steplens wrote: give a new or empty folder with --out")
    try:
        if not any(out.iterdir()) or _separate_results_of(run, out):
            return
        if not _written_by_steplens(out):
            raise UnsafeOutput(f"{out_dir} is not empty and holds no steplens {schema.MANIFEST_FILE}: steplens replaces "
                               "its output folder whole, so give a new or empty folder with --out")
        foreign = _foreign_entries(out)
    except OSError as e:
        raise OutputUnwritable(f"cannot read {out_dir}: {e.strerror or e}") from e
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UnsafeOutput(f"{out_dir} holds files steplens did not write ({shown}); move them, or give another "
                           "folder with --out")


def _previous_manifest(out_dir: Path) -> dict:
    manifest = reuse.read_manifest(out_dir)
    ok = (manifest.get("schema_fingerprint") == schema.fingerprint() and isinstance(manifest.get("sources"), list)
          and manifest.get("parse_fingerprint") == reuse.parse_fingerprint())
    return manifest if ok else {}


def _recover(out_dir: Path) -> None:
    """Undo a swap that was killed between its two renames, and drop dead staging folders (only
    folders steplens named and wrote)."""
    parent = out_dir.parent
    if not parent.exists():
        return
    for leftover in parent.glob(reuse.staged_folder(out_dir, "old").name):
        if not leftover.is_dir() or leftover.is_symlink() or not _written_by_steplens(leftover):
            continue
        if not out_dir.exists():
            leftover.rename(out_dir)
        else:
            shutil.rmtree(leftover, ignore_errors=True)
    for leftover in parent.glob(reuse.staged_folder(out_dir, "tmp").name):
        pid = leftover.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or leftover.is_symlink() or not leftover.is_dir():
            continue
        if not _writing(int(pid), leftover) and _is_staging(leftover):
            shutil.rmtree(leftover, ignore_errors=True)


def _other_writer(out_dir: Path) -> int | None:
    """The process id of another live analyze staging a result for out_dir (its .NAME.tmp-PID folder), or None:
    two runs writing one output would each publish over the other, and both say they succeeded."""
    for staging in out_dir.parent.glob(reuse.staged_folder(out_dir, "tmp").name):
        pid = staging.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid() or not _writing(int(pid), staging):
            continue
        try:
            if staging.is_dir() and not staging.is_symlink() and _is_staging(staging):
                return int(pid)
        except OSError:  # it finished (or gave up) as we looked
            continue
    return None


def _is_staging(folder: Path) -> bool:
    """A staging folder holds steplens's scratch space or manifest, or nothing yet, or only ingested tables (a
    run stopped between the two)."""
    names = set(os.listdir(folder))
    return (not names or "_scratch" in names or WRITER_FILE in names or _written_by_steplens(folder)
            or names <= set(schema.TABLES))


WRITER_FILE = "_writer"  # in a staging folder: its writer's start time, in ticks after boot (removed at publish)


def _writing(pid: int, staging: Path) -> bool:
    """Whether process `pid` may be the one writing `staging` (named after it): alive, and, where both are known, the
    process that started when the folder's writer did (its WRITER_FILE): a process that only took the id of a killed
    writer is not, and its folder would otherwise hold the output for as long as it lives. No clock is compared."""
    if not _alive(pid):
        return False
    try:
        recorded = (staging / WRITER_FILE).read_text()[:32]
    except (OSError, UnicodeDecodeError):
        return True  # (written by an older steplens, or not yet: its writer is taken to be alive)
    started = _start_ticks(pid)
    return started is None or started == recorded


def _start_ticks(pid: int) -> str | None:
    """When process `pid` started, in clock ticks after boot, as Linux's /proc says; None where that cannot be told."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()[19].decode()  # field 22, starttime
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _swap_in(staging: Path, out_dir: Path, run_dir: Path) -> None:
    """Publish: the staged result replaces the last one in two renames (checked again just before)."""
    check_output_folder(run_dir, out_dir)
    old = reuse.staged_folder(out_dir, "old", os.getpid())
    if out_dir.exists():
        out_dir.rename(old)
    staging.rename(out_dir)
    if old.exists() and _written_by_steplens(old):
        shutil.rmtree(old, ignore_errors=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _place_parts(source: Source, staging: Path, scratch: Path | None = None, previous: tuple[Path, int] | None = None) -> None:
    """Put a source's parts in place (a trace's in its rank partition): moved from scratch, or linked
    from the last result."""
    tables = PARSED_TABLES if source.kind in importers.TRACE_KINDS else source.tables
    for table in tables:
        dst = staging / schema.part_dir(table, source.rank) / f"part-{source.part_id}.parquet"
        dst.parent.mkdir(parents=True, exist_ok=True)
        if scratch is not None:
            os.replace(scratch / source.part_id / f"{table}.parquet", dst)
        else:
            old_dir, old_rank = previous
            _link_or_copy(old_dir / schema.part_dir(table, old_rank) / f"part-{source.part_id}.parquet", dst)


def _write_empty_tables(staging: Path) -> None:
    """Every run-level table exists, empty when no input had rows for it, so SQL over it works."""
    for table, (arrow_schema, _, partitioned) in schema.TABLES.items():
        folder = staging / table
        if not partitioned and not any(folder.glob("*.parquet")):
            folder.mkdir(parents=True, exist_ok=True)
            pq.write_table(arrow_schema.empty_table(), folder / "part-empty.parquet")


def _issues_table(sources: list[Source]) -> pa.Table:
    rows = [
        {"rank": s.rank, "file": s.path, "severity": sev, "reason": reason, "count": count, "detail": detail}
        for s in sources
        for sev, reason, count, detail in s.issues
    ]
    for row in rows:  # an undeclared reason is a programming error (contract/issue_reasons.py)
        issue_reasons.check(row["severity"], row["reason"])
    return pa.Table.from_pylist(rows, schema=schema.INGEST_ISSUES)


def _environment(sources: list[Source]) -> dict:
    ingested = [s for s in sources if s.rank is not None]
    meta = [s.trace_meta for s in ingested]

    def distinct(key):
        return sorted({str(m[key]) for m in meta if m.get(key) not in (None, "")})

    return {
        "device_names": sorted({n for m in meta for n in m.get("device_names", []) if n}),
        "device_sms": sorted({n for m in meta for n in m.get("device_sms", [])}),
        "backend": distinct("backend"),
        "nccl_version": distinct("nccl_version"),
        "cuda_runtime_version": distinct("cuda_runtime_version"),
        "cuda_driver_version": distinct("cuda_driver_version"),
        "trace_schema_version": distinct("schema_version"),
    }


def _facts(sources: list[Source]) -> tuple[dict, dict[str, Source]]:
    """Run facts from the non-trace sources (collector manifests, launcher headers, ...); the first
    source to give a fact wins, and disagreements are kept under `conflicts`. Also {fact: the source that gave it}."""
    merged, conflicts, given_by = {}, {}, {}
    for s in sources:
        for key, value in (s.facts or {}).items():
            if (problem := fact_problem(key, value)) is not None:
                s.issues.append(["warning", "bad_fact", 1, f"run fact {key!r} left out: {problem}"])
                continue
            if key not in merged:
                merged[key], given_by[key] = value, s
            elif merged[key] != value:
                conflicts.setdefault(key, []).append({"source": s.path, "value": value})
    if conflicts:
        merged["conflicts"] = conflicts
    return merged, given_by


def _world_size(traces: list[Source], facts: dict, given_by: dict[str, Source]) -> tuple[int | None, str | None]:
    """The run's world size and its source (manifest.settle_world_size); the inputs that disagree with it are told."""
    trace_sizes = sorted({s.world_size for s in traces if s.world_size})
    if len(trace_sizes) > 1:
        for s in traces:
            s.issues.append(["warning", "world_size_mismatch", 1,
                             f"traces disagree on world size {trace_sizes}: are they from one run?"])
    stated_by = given_by.get("world_size")
    world_size, source = settle_world_size(trace_sizes, facts.get("world_size"), stated_by.path if stated_by else None)
    if stated_by and facts["world_size"] != world_size:
        stated_by.issues.append(["warning", "world_size_mismatch", 1,
                                 f"states world size {facts['world_size']}, the traces {world_size}: the traces' is the "
                                 "run's (are they from one run?)"])
    return world_size, source


def _manifest(sources: list[Source], ignored: list[str], run_folder: str) -> dict:
    ingested = [s for s in sources if s.rank is not None]
    facts, given_by = _facts([s for s in sources if s.status in ("ingested", "reused")])
    world_size, world_size_source = _world_size(ingested, facts, given_by)
    used = [s for s in sources if s.status in ("ingested", "reused")]
    # The run folder is part of the id: two folders holding copies of the same files are two runs.
    run_id = hashlib.sha256(repr((run_folder, sorted(s.fingerprint() for s in used))).encode()).hexdigest()[:12]
    trace_ranks = sorted({s.rank for s in ingested})
    return RunManifest(
        schema_version=schema.SCHEMA_VERSION,
        schema_fingerprint=schema.fingerprint(),
        parse_fingerprint=reuse.parse_fingerprint(),
        run_id=run_id,
        created_by=OUTPUT_CREATOR,
        world_size=world_size,
        world_size_source=world_size_source,
        ranks=sorted(set(trace_ranks).union(*(s.ranks for s in used))),
        trace_ranks=trace_ranks,
        sources=[asdict(s) for s in sources],
        ignored_files=ignored[:IGNORED_LISTED],
        ignored_count=len(ignored),
        facts=facts,
        environment=_environment(sources),
        tables={name: {"partitioned_by_rank": spec[2]} for name, spec in schema.TABLES.items()},
    ).to_dict()


def _write_json(path: Path, value: dict) -> None:
    """run.json, atomically; a key RunManifest does not declare raises (the contract lists every key)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(RunManifest.from_dict(value, strict=True).to_json())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Entry point


@dataclass
class Staged:
    """A complete new result in its staging folder, not yet visible at out_dir: analyses and reports
    are written into `folder`, then `publish` swaps it in, so tables, analyses and reports appear
    together or not at all."""

    run_dir: Path
    out_dir: Path
    folder: Path
    manifest: dict
    sources: list[Source]
    parsed: int
    reused: int
    started: float


@contextmanager
def staged(
    run_dir: Path,
    out_dir: Path | None = None,
    jobs: int | None = None,
    files: Iterable[Path] | None = None,
    progress: Callable[[Source], None] | None = None,
    found: Discovered | None = None,
    client=None,
    store=None,
    workers: Workers | None = None,
) -> Iterator[Staged]:
    """Ingest the inputs under run_dir (or the given files, or what `discover` found) into a staging
    folder beside out_dir (default run_dir/.steplens); the folder is removed when the block ends,
    published or not. With a Dask `client` the traces are parsed as tasks on its cluster; with a `store`
    (remote.Generation of an object-store --out) its workers upload their parts there. Local `workers`
    given by the caller stay up for its per-rank analyses; else they are `jobs` and stop with the parse."""
    started = time.perf_counter()
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise IngestError(f"{run_dir}: not a folder")
    out_dir = Path(out_dir) if out_dir else run_dir / schema.DEFAULT_OUT_DIR
    check_output_folder(run_dir, out_dir)
    if found is None:
        found = classify(list(files)) if files is not None else discover(run_dir, out_dir)
    if not found.traces and not found.native:
        links = [relative_name(path, run_dir) for path, issue in found.special if issue[1] == "linked_folder"]
        not_followed = f"; linked folders not followed: {', '.join(links)}" if links else ""
        raise IngestError(f"{run_dir}: nothing steplens reads here (no traces, collector output or DeepSpeed artifacts"
                          f"; {len(found.unknown)} other file(s){not_followed})")
    staging = reuse.staged_folder(out_dir, "tmp", os.getpid())
    made = False
    try:
        try:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            _recover(out_dir)
            check_output_folder(run_dir, out_dir)
            if staging.exists() and _is_staging(staging):
                shutil.rmtree(staging)
            (staging / "_scratch").mkdir(parents=True)
            made = True  # this process's own, whatever it holds when the block ends
            if (ticks := _start_ticks(os.getpid())) is not None:
                (staging / WRITER_FILE).write_text(ticks)
            if writer := _other_writer(out_dir):  # checked with our own staging in place: of two, one sees the other
                raise OutputUnwritable(f"{out_dir} is being written by another analyze (process {writer}): wait for "
                                       "it to finish, or give another folder with --out")
            with nullcontext(workers) if workers else Workers(jobs) as parse_workers:
                stage = _stage(run_dir, out_dir, staging, found, parse_workers, progress, started, client, store)
            yield stage  # analyses write here too
        except OSError as e:
            raise OutputUnwritable(f"cannot write to {out_dir}: {e.strerror or e}: use --out DIR") from e
    finally:
        if staging.is_dir() and not staging.is_symlink() and (made or _is_staging(staging)):
            shutil.rmtree(staging, ignore_errors=True)


def publish(stage: Staged) -> IngestResult:
    """Swap the staged result in at out_dir (the previous result stays until then)."""
    try:
        (stage.folder / WRITER_FILE).unlink(missing_ok=True)  # the result is no one's work in progress
        stage.manifest["output_entries"] = sorted(os.listdir(stage.folder))
        _write_json(stage.folder / schema.MANIFEST_FILE, stage.manifest)
        _swap_in(stage.folder, stage.out_dir, stage.run_dir)
    except OSError as e:
        raise OutputUnwritable(f"cannot write to {stage.out_dir}: {e.strerror or e}: use --out DIR") from e
    return IngestResult(stage.out_dir, stage.manifest, stage.sources, stage.parsed, stage.reused,
                        time.perf_counter() - stage.started)


def ingest(run_dir: Path, out_dir: Path | None = None, jobs: int | None = None, files: Iterable[Path] | None = None,
           progress: Callable[[Source], None] | None = None, found: Discovered | None = None) -> IngestResult:
    """The tables alone: stage and publish (`steplens.analyze.pipeline.analyse` adds the analyses)."""
    with staged(run_dir, out_dir, jobs, files, progress, found) as stage:
        return publish(stage)


def input_key(run_dir: Path, found: Discovered, settings: str) -> str | None:
    """One hash of what a run's result depends on: each input's fingerprint (path, size, mtime and first
    64 KiB, its companions'), the names of the files steplens does not read, `settings` (the analysis
    options) and the steplens code. None when an input cannot be read (then nothing is reused)."""
    try:
        inputs = sorted([_describe(path, run_dir, companions).fingerprint() for path, _, companions in found.native]
                        + [_describe(path, run_dir).fingerprint() for path in found.traces])
    except OSError:
        return None
    unread = sorted(relative_name(path, run_dir) for path in found.unknown)
    return hashlib.sha256(repr((inputs, unread, settings, schema.fingerprint(), reuse.code_fingerprint())).encode()).hexdigest()[:32]


def unchanged(out_dir: Path, key: str | None) -> IngestResult | None:
    """The published result at out_dir, when it was made with this input key, is complete (every entry
    it listed is still there) and holds nothing else: a re-run with nothing changed reads nothing and
    writes nothing. (A user's file in it is refused by the full path, which names it.)"""
    if key is None:
        return None
    manifest = reuse.read_manifest(out_dir)
    if manifest.get("input_key") != key or not reuse.complete(out_dir, manifest):
        return None
    return reused_result(out_dir, manifest)


def reused_result(out_dir: Path, manifest: dict) -> IngestResult:
    """The result a re-run with nothing changed gives: the manifest's sources, reused."""
    sources = [Source(**{k: v for k, v in doc.items() if k in Source.__dataclass_fields__})
               for doc in manifest.get("sources", []) if isinstance(doc, dict)]
    for source in sources:
        source.status = "reused" if source.status == "ingested" else source.status
    return IngestResult(out_dir, manifest, sources, 0, sum(s.status == "reused" for s in sources), 0.0, unchanged=True)


def _reusable(old: dict, out_dir: Path) -> Source | None:
    """A source of the last result whose parts are all there and readable, with paths that stay
    inside out_dir; None means parse the file again (the cache never fails a run)."""
    try:
        restored = Source(**{k: v for k, v in old.items() if k in Source.__dataclass_fields__})
    except TypeError:
        return None
    rank = old.get("rank")
    tables = PARSED_TABLES if restored.kind in importers.TRACE_KINDS else restored.tables
    if (not isinstance(restored.part_id, str) or not PART_ID.fullmatch(restored.part_id)
            or not (rank is None or (type(rank) is int and 0 <= rank < schema.MAX_RANK))
            or not isinstance(tables, (list, tuple)) or any(t not in schema.TABLES for t in tables)
            or (restored.kind in importers.TRACE_KINDS and rank is None)):
        return None
    for table in tables:
        part = out_dir / schema.part_dir(table, rank) / f"part-{restored.part_id}.parquet"
        if not reuse.plain_file_inside(part, out_dir):  # a FIFO would block the read, a link leads elsewhere
            return None
        try:
            pq.read_metadata(part)
        except Exception:  # noqa: BLE001 - missing, truncated or not Parquet: parse the input again
            return None
    return restored


def _stage(run_dir: Path, out_dir: Path, staging: Path, found: Discovered, workers: Workers, progress,
           started: float, client=None, store=None) -> Staged:
    scratch = staging / "_scratch"
    previous = {}
    for old in _previous_manifest(out_dir).get("sources", []):
        key = tuple(old.get(k) for k in ("path", "size", "mtime_ns", "hash_prefix")) if isinstance(old, dict) else ()
        if key and all(isinstance(v, (str, int)) for v in key) and old.get("status") in ("ingested", "reused"):
            previous.setdefault(key, []).append(old)  # a file of several ranks was several sources

    sources, to_parse, reused, native = [], [], [], []
    sources += [_unopened_source(path, run_dir, issue) for path, issue in found.special]
    candidates = [(path, None, []) for path in found.traces] + found.native
    for path, importer, companions in candidates:
        try:
            source = (found.remote[path].source(os.path.relpath(path, run_dir)) if path in found.remote
                      else _describe(path, run_dir, companions))
            source.kind = importer.name if importer else importers.trace_claimant(path).name
            if importer is None and (settings := importers.trace_claimant(path).settings()):
                source.hash_prefix = hashlib.sha256(f"{source.hash_prefix}:{settings}".encode()).hexdigest()[:16]
        except OSError as e:
            source = Source(path=relative_name(path, run_dir), size=0, mtime_ns=0, hash_prefix="", status="error",
                            kind=importer.name if importer else importers.trace_claimant(path).name)
            source.issues.append(["error", "unreadable", 1, f"cannot read: {e.strerror or e}"])
            sources.append(source)
            continue
        sources.append(source)
        if source.size == 0:
            source.status = "error"
            source.issues.append(["error", "empty_file", 1, "empty file"])
        elif (olds := previous.get(source.fingerprint())) and None not in (restored := [_reusable(old, out_dir) for old in olds]):
            sources.pop()
            for old, unit in zip(olds, restored):
                unit.issues = [i for i in unit.issues if isinstance(i, list) and len(i) == 4
                              and i[1] not in _RUN_LEVEL_REASONS]
                unit.status = "reused"
                unit.rank = None if unit.kind in importers.TRACE_KINDS else unit.rank
                sources.append(unit)
                reused.append((unit, old["rank"]))
        elif importer is not None:
            native.append(_parse_native(path, source, importer, scratch))
            if progress:
                progress(native[-1])
        else:
            to_parse.append((found.remote[path].url if path in found.remote else path, source))

    if client is not None:
        from steplens.analyze.pipeline import cluster  # Dask is imported only for --scheduler

        parsed = cluster.parse_all(client, to_parse, scratch, progress, store) + native
    else:
        parsed = _parse_all(to_parse, scratch, workers, progress) + native
    parsed = [unit for s in parsed for unit in (s, *s.units)]
    by_path: dict[str, list[Source]] = {}
    for s in parsed:
        s.units = []
        by_path.setdefault(s.path, []).append(s)
    sources = [unit for s in sources for unit in by_path.get(s.path, [s])]
    _assign_ranks(sources)

    for s in sources:
        if s.status == "ingested":
            _place_parts(s, staging, scratch=scratch)
    for s, old_rank in reused:
        if s.status == "reused":
            _place_parts(s, staging, previous=(out_dir, old_rank))
            if progress:
                progress(s)
    shutil.rmtree(scratch, ignore_errors=True)
    _write_empty_tables(staging)

    manifest = _manifest(sources, [relative_name(p, run_dir) for p in found.unknown],
                         found.origin or str(run_dir.resolve()))
    manifest["run_name"] = file_name_text(run_dir.resolve().name)
    issues_dir = staging / schema.part_dir("ingest_issues", None)
    issues_dir.mkdir(parents=True, exist_ok=True)
    pq.write_table(_issues_table(sources), issues_dir / "part-0.parquet")
    _write_json(staging / schema.MANIFEST_FILE, manifest)

    if not any(s.status in ("ingested", "reused") for s in sources):
        problems = [(s.path, i[3]) for s in sources for i in s.issues if i[0] == "error"]
        problems = problems or [(s.path, i[3]) for s in sources for i in s.issues]
        why = f" ({problems[0][0]}: {problems[0][1]})" if problems else ""
        raise IngestError(f"{run_dir}: nothing usable among {len(sources)} file(s){why}", sources)
    return Staged(run_dir, out_dir, staging, manifest, sources, len(to_parse) + len(native), len(reused), started)


# Issues that depend on the other files of the run, so they are recomputed on every ingest.
_RUN_LEVEL_REASONS = {"rank_from_filename", "rank_from_process", "rank_assumed", "rank_unknown", "world_size_mismatch",
                      "bad_fact"}


def _parse_on_threads(pending, scratch: Path, threads: int) -> Iterator[Source]:
    """Each file parsed on one of `threads` threads, yielded as it is done (to this thread: the progress bar's).
    An error or an interrupt here cancels the files not started and waits for the ones being parsed (a
    second or so at most, the run being small): none of them writes into a staging folder being removed."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix="steplens-parse")
    futures = [pool.submit(_parse_source, str(path), source, str(scratch)) for path, source in pending]
    try:
        for future in as_completed(futures):
            yield future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _estimated_json_bytes(to_parse) -> int:
    return sum(estimated_json_bytes(str(path), source.size) for path, source in to_parse)


def _parse_file(item: tuple[str, Source, str]) -> Source:
    return _parse_source(*item)


# Files parsed at once on threads of this process, when the run is too small for worker processes: the parse
# spends about half its time without the GIL (the native columnizer, polars, gunzip, the Parquet write), so a
# second thread uses the core a one-process run leaves idle: parsing trace_diff's 2 files took 0.42-0.60 s
# instead of 0.68-0.93 s at a peak of 356-410 MiB instead of 280 (a worker process: 580), dlrm-8r's 8 files
# 0.18-0.23 s instead of 0.29-0.31. The half that holds the GIL bounds what more threads could add.
PARSE_THREADS = 4


def _parse_all(to_parse, scratch: Path, workers: Workers, progress) -> list[Source]:
    """Parse files in this process and on the workers: they take the largest files, this process the
    smallest, each the next as soon as it is free. One file per process is parsed at a time, which
    bounds memory. A run too small for workers (worth_workers) is parsed on up to PARSE_THREADS threads
    of this process instead, the largest files first."""
    results: list[Source] = []

    def done(source: Source) -> None:
        results.append(source)
        if progress:
            progress(source)

    pending = sorted(to_parse, key=lambda item: item[1].size)
    worth = workers.available or worth_workers(workers.jobs, len(pending), _estimated_json_bytes(to_parse))
    if workers.jobs == 1 or len(pending) <= 1:
        for path, source in pending:
            done(_parse_source(str(path), source, str(scratch)))
        return results
    if not worth:
        for source in _parse_on_threads(pending[::-1], scratch, min(workers.jobs, PARSE_THREADS)):
            done(source)
        return results
    workers.pool(len(pending) - 1)
    try:
        for _, source in workers.share(_parse_file, [(str(path), source, str(scratch)) for path, source in pending[::-1]]):
            done(source)
    except BaseException:
        workers.kill()
        raise
    return results
