"""Read one Nsight Systems SQLite export (`nsys export --type sqlite`, or `nsys profile --export sqlite`)
into the trace model.

This module knows the export's tables; what the events mean (step windows, launch links) is
trace.semantics, which ingest applies, as for Kineto. The file is opened read-only through the standard
library's sqlite3 and never written.

Mapping (table and column names as NVIDIA documents them in "Nsight Systems: SQLite Export Schema
Reference"; the exports of different years differ, so each table and column is read only when present,
and what is missing is counted as an ingest issue, nsys_schema_gap; checked on real exports of
2022.1, 2022.2 and 2025.3, tests/fixtures/nsys):

- CUPTI_ACTIVITY_KIND_KERNEL -> kind `kernel` (demangledName, else shortName, else mangledName,
  through StringIds); pid = deviceId, tid = streamId, as Kineto lays out device rows;
- CUPTI_ACTIVITY_KIND_MEMCPY / _MEMSET -> `gpu_memcpy` / `gpu_memset` with their bytes;
- CUPTI_ACTIVITY_KIND_RUNTIME -> `cuda_runtime`, or `cuda_driver` for eventClass 1 (ENUM_NSYS_EVENT_CLASS
  TRACE_PROCESS_EVENT_CUDA_DRIVER); the `_v3020`-style callback-version suffix is cut so names read
  as the API's (cudaLaunchKernel, cudaStreamSynchronize), as Kineto writes them;
- CUPTI_ACTIVITY_KIND_SYNCHRONIZATION -> category `cuda_sync` (kind `other`), named by ENUM_CUPTI_SYNC_TYPE;
- NVTX_EVENTS push/pop and start/end ranges -> `user_annotation` (category = domain name, and the
  NVTX category's), marks -> instants; NCCL's ranges give their kernels a collective and its bytes;
- TARGET_INFO_GPU -> TraceMeta.devices (name, SMs, memory, clock) for the peak table;
- globalTid -> pid = (globalTid >> 24) & 0xFFFFFF, tid = globalTid & 0xFFFFFF (the schema reference's
  decoding of a serialized GlobalId).

Times are integer ns since the session start; TARGET_INFO_SESSION_START_TIME.utcEpochNs is added, so
`ts_ns` is epoch ns on the session's clock, exact, and ranks of one job line up.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
from dataclasses import replace
from pathlib import Path

import polars as pl

from steplens.analyze.contract import schema
from steplens.analyze.contract.issue_reasons import Issue
from steplens.analyze.contract.traces import TIME_LIMIT_NS, DecodedTrace, Device, NotATrace, TraceMeta, checked
from steplens.analyze.importers.base import peek
from steplens.analyze.trace import semantics

SQLITE_MAGIC = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite 3 database (sqlite.org/fileformat.html)
SQLITE_SUFFIXES = (".sqlite", ".sqlite3")
REPORT_SUFFIXES = (".nsys-rep", ".qdrep")  # .qdrep: Nsight Systems before 2021.4

# The text columns read; every other column read holds integers (ns, ids, counts, enum values).
TEXT_COLUMNS = {"text", "jsonText", "name"}
# Tables whose presence tells an nsys export from any other SQLite database.
NSYS_MARKERS = ("StringIds", "TARGET_INFO_SESSION_START_TIME", "CUPTI_ACTIVITY_KIND_KERNEL", "NVTX_EVENTS",
                "CUPTI_ACTIVITY_KIND_RUNTIME")

# ENUM_NSYS_EVENT_TYPE ids (the same in every export that has the table; older ones lack it).
NVTX_MARK, NVTX_PUSH_POP, NVTX_START_END, NVTX_DOMAIN_CREATE, NVTX_CATEGORY = 34, 59, 60, 75, 33
NVTX_RANGE_TYPES = (NVTX_PUSH_POP, NVTX_START_END)
DRIVER_EVENT_CLASS = 1  # ENUM_NSYS_EVENT_CLASS TRACE_PROCESS_EVENT_CUDA_DRIVER
# ENUM_CUPTI_SYNC_TYPE labels, for exports without the enum table.
SYNC_TYPES = {0: "Unknown", 1: "Event sync", 2: "Stream wait sync", 3: "Stream sync", 4: "Context sync"}
# ENUM_CUDA_MEMCPY_OPER labels, for exports without the enum table.
MEMCPY_KINDS = {0: "Unknown", 1: "Host-to-Device", 2: "Device-to-Host", 8: "Device-to-Device", 9: "Host-to-Host",
                10: "Peer-to-Peer", 11: "Unified Host-to-Device", 12: "Unified Device-to-Host", 13: "Unified Device-to-Device"}
# The CUPTI callback's version suffix nsys appends to API names (cudaLaunchKernel_v7000): four or more
# digits, so a driver API's own `_v2` (cuMemcpyDtoH_v2) stays.
API_VERSION_SUFFIX = r"_v\d{4,}$"

# Steps: NVTX ranges named like these, the step number in the first group. ProfilerStep#N is
# PyTorch's; "iteration N"/"step N" the names training loops push around one iteration.
DEFAULT_STEP_RANGE = r"^(?:ProfilerStep#|[Ii]teration[ _#:]?|[Ii]ter[ _#:]?|(?:[Tt]rain_?)?[Ss]tep[ _#:]?)\s*(\d+)$"
STEP_RANGE_ENV = "STEPLENS_STEP_RANGE"  # set by `analyze --step-range` (workers are spawned with it)

# Environment variables naming the rank and world size, in the order they are trusted
# (torchrun/DeepSpeed, then Open MPI, then Slurm).
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
WORLD_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")

# NCCL's NVTX payload (NCCL >= 2.19, src/include/nvtx_payload_schemas.h): the message size entry.
NCCL_DOMAIN = "NCCL"
NCCL_SIZE_KEY = "Message size [bytes]"


def claims(path: Path) -> bool:
    """A SQLite file (by its magic bytes) or an nsys report; whether it is an nsys export is parse's call."""
    name = path.name.lower()
    if name.endswith(SQLITE_SUFFIXES):  # an empty one too: named as an empty input, as an empty trace is
        return peek(path, len(SQLITE_MAGIC)) in (SQLITE_MAGIC, b"")
    return name.endswith(REPORT_SUFFIXES) and not _exported(path)


def _exported(report: Path) -> Path | None:
    """The SQLite export beside a report, when there is one."""
    for suffix in SQLITE_SUFFIXES:
        candidate = report.with_name(report.name.rsplit(".", 1)[0] + suffix)
        if candidate.is_file():
            return candidate
    return None


def export_command(report: Path) -> list[str]:
    """The command that writes a report's SQLite export beside it."""
    output = report.with_name(report.name.rsplit(".", 1)[0] + ".sqlite")
    return ["nsys", "export", "--type", "sqlite", "--output", str(output), str(report)]


def export_reports(run_dir: Path) -> list[tuple[Path, str]]:
    """Run `nsys export` for every report under run_dir without a SQLite export (analyze --nsys-export).
    Returns (report, what happened) per report; nothing is run when nsys is not on the PATH."""
    reports = sorted(p for p in Path(run_dir).rglob("*") if p.name.lower().endswith(REPORT_SUFFIXES)
                     and not any(part.startswith(".") for part in p.relative_to(run_dir).parts) and not _exported(p))
    if not reports:
        return []
    if shutil.which("nsys") is None:
        return [(report, "nsys is not on the PATH: not exported") for report in reports]
    done = []
    for report in reports:
        try:
            returncode, output = _run_bounded(export_command(report), EXPORT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            done.append((report, f"nsys export did not finish in {EXPORT_TIMEOUT_S} s: stopped, not exported"))
            continue
        tail = output.strip().splitlines()[-1:] or [""]
        done.append((report, "exported" if returncode == 0 else f"nsys export failed ({returncode}): {tail[0]}"))
    return done


# `nsys export` of a large report takes minutes; one that has not ended in half an hour is hung.
EXPORT_TIMEOUT_S = 1800


def _run_bounded(command: list[str], timeout_s: float) -> tuple[int, str]:
    """(exit status, stderr or else stdout) of a command run in a process group of its own, which is killed
    whole when the command outlives timeout_s or analyze is stopped (Ctrl-C, SIGTERM): nothing it started is
    left running."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except BaseException:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.communicate()
        raise
    return process.returncode, stderr or stdout


def step_range() -> re.Pattern:
    return re.compile(os.environ.get(STEP_RANGE_ENV) or DEFAULT_STEP_RANGE)


def settings() -> str:
    """A part decoded under another step-range pattern is decoded again."""
    return step_range().pattern


# ---------------------------------------------------------------------------------------------
# Reading


def _identifier(name: str) -> str:
    """A table name as an SQL identifier: quoted, its quotes doubled (a table of any name is read around)."""
    return '"' + name.replace('"', '""') + '"'


class _Export:
    """The open export: its tables and columns, and the StringIds lookup."""

    def __init__(self, path: Path):
        uri = Path(path).resolve().as_uri() + "?mode=ro&immutable=1"
        self.db = sqlite3.connect(uri, uri=True)
        # Names are bytes as the application wrote them: undecodable ones are kept, marked, not fatal
        self.db.text_factory = lambda raw: raw.decode("utf-8", "replace")
        self.tables = {name: [row[1] for row in self.db.execute(f"PRAGMA table_info({_identifier(name)})")]
                       for (name,) in self.db.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
        self.missing: list[str] = []
        self.mistyped: dict[str, int] = {}  # table.column -> values not of the column's type

    def has(self, table: str, *columns: str) -> bool:
        return table in self.tables and all(c in self.tables[table] for c in columns)

    def rows(self, table: str, columns: dict[str, str], required: tuple[str, ...], alternatives: tuple[str, ...] = ()) -> list[tuple]:
        """SELECT the columns (alias -> column) the table has, the absent ones as NULL (and noted); nothing,
        with the gap noted, when the table or a `required` column is absent. Of `alternatives` (one
        version's column for another's), only the absence of all is a gap."""
        if table not in self.tables:
            return []
        have = self.tables[table]
        absent = [c for c in required if c not in have]
        if absent:
            self.missing.append(f"{table} without {', '.join(absent)} (not read)")
            return []
        gaps = [c for c in columns.values() if c not in have and c not in alternatives]
        if alternatives and not any(c in have for c in alternatives):
            gaps.append(" or ".join(alternatives))
        if gaps:
            self.missing.append(f"{table} without {', '.join(gaps)}")
        present = [c for c in columns.values() if c in have]
        # A value of another type than the column's (text in a time, a float id) is null, and counted
        wanted = {c: "text" if c in TEXT_COLUMNS else "integer" for c in present}
        if present:
            mistyped = ", ".join(f"SUM(typeof(\"{c}\") NOT IN ('{t}', 'null'))" for c, t in wanted.items())
            counts = self.db.execute(f'SELECT {mistyped} FROM "{table}"').fetchone()
            for column, n in zip(present, counts):
                if n:
                    self.mistyped[f"{table}.{column}"] = n
        select = ", ".join(f"CASE WHEN typeof(\"{c}\") = '{wanted[c]}' THEN \"{c}\" END" if c in have else "NULL"
                           for c in columns.values())
        return self.db.execute(f'SELECT {select} FROM "{table}"').fetchall()

    def enum(self, table: str, fallback: dict[int, str]) -> dict[int, str]:
        if not self.has(table, "id", "label"):
            return dict(fallback)
        return {**fallback, **dict(self.db.execute(
            f"""SELECT id, label FROM "{table}" WHERE typeof(id) = 'integer' AND typeof(label) = 'text'""").fetchall())}

    def strings(self) -> dict[int, str]:
        if not self.has("StringIds", "id", "value"):
            return {}
        return dict(self.db.execute("SELECT id, value FROM StringIds WHERE typeof(id) = 'integer' AND typeof(value) = 'text'"))

    def close(self) -> None:
        self.db.close()


_EVENT_SCHEMA = {
    "ts_ns": pl.Int64, "end_ns": pl.Int64, "ph": pl.String, "kind": pl.String, "cat": pl.String, "name": pl.String,
    "pid": pl.Int64, "tid": pl.Int64, "stream": pl.Int64, "device": pl.Int64, "correlation": pl.Int64,
    "bytes": pl.Int64, "process": pl.Int64, "collective": pl.String, "in_nelems": pl.Int64, "out_nelems": pl.Int64,
    "dtype": pl.String,
    "code": pl.Int64,  # an enum value (copyKind, syncType), named and then dropped
}


def _frame(rows: list[tuple], columns: list[str], **constants) -> pl.DataFrame:
    frame = pl.DataFrame(rows, schema={c: _EVENT_SCHEMA[c] for c in columns}, orient="row")
    return frame.with_columns(**{k: pl.lit(v, _EVENT_SCHEMA[k]) for k, v in constants.items()})


# Calls whose work is one kernel (not cudaLaunchHostFunc, which runs on the host; not a graph launch, whose kernels an
# export made with --cuda-graph-trace=graph keeps in a table of its own)
KERNEL_LAUNCH_API = r"^(cudaLaunch(Kernel|CooperativeKernel)?|cuLaunch(Kernel|CooperativeKernel|Grid))(Ex|ExC)?$"


def _count_lost_device_work(events: pl.DataFrame, issues: list[Issue]) -> None:
    """Kernel launches without their kernels (an export whose kernel table, or its times, is gone): device work lost,
    said as an error, never a confident 98% idle off the copies alone."""
    launches, kernels = events.select(
        launches=(pl.col("kind").is_in(["cuda_runtime", "cuda_driver"]) & pl.col("name").str.contains(KERNEL_LAUNCH_API)).sum(),
        kernels=(pl.col("kind") == "kernel").sum()).row(0)
    if launches and not kernels:
        issues.append(Issue("error", "events_lost", launches, f"{launches:,} kernel launch calls and no kernel: the export's "
                            "kernel table, or its times, is missing; GPU busy, idle and kernel figures cover the copies "
                            "and sets alone"))


def _process_of(global_id: pl.Expr) -> pl.Expr:
    return (global_id // (1 << 24)) % (1 << 24)


def _device_work(export: _Export, names: dict[int, str]) -> pl.DataFrame:
    kernel_rows = export.rows("CUPTI_ACTIVITY_KIND_KERNEL", {
        "start": "start", "end": "end", "device": "deviceId", "stream": "streamId", "correlation": "correlationId",
        "process": "globalPid", "demangled": "demangledName", "short": "shortName", "mangled": "mangledName"},
        required=("start", "end"), alternatives=("demangledName", "shortName", "mangledName"))
    kernels = pl.DataFrame(kernel_rows, orient="row", schema={
        "ts_ns": pl.Int64, "end_ns": pl.Int64, "device": pl.Int64, "stream": pl.Int64, "correlation": pl.Int64,
        "process": pl.Int64, "demangled": pl.Int64, "short": pl.Int64, "mangled": pl.Int64})
    lookup = pl.DataFrame({"id": list(names), "value": list(names.values())}, schema={"id": pl.Int64, "value": pl.String})

    def name_of(column: str) -> pl.Expr:
        return pl.col(column).replace_strict(lookup["id"], lookup["value"], default=None, return_dtype=pl.String)

    kernels = kernels.with_columns(name=pl.coalesce(name_of("demangled"), name_of("short"), name_of("mangled")),
                                   ph=pl.lit("X"), kind=pl.lit("kernel"), cat=pl.lit("kernel")).drop("demangled", "short", "mangled")

    copy_kinds = export.enum("ENUM_CUDA_MEMCPY_OPER", MEMCPY_KINDS)
    copies = _frame(export.rows("CUPTI_ACTIVITY_KIND_MEMCPY", {
        "start": "start", "end": "end", "device": "deviceId", "stream": "streamId", "correlation": "correlationId",
        "process": "globalPid", "bytes": "bytes", "code": "copyKind"}, required=("start", "end")),
        ["ts_ns", "end_ns", "device", "stream", "correlation", "process", "bytes", "code"],
        ph="X", kind="gpu_memcpy", cat="gpu_memcpy")
    copies = copies.with_columns(name=pl.format("Memcpy {}", pl.col("code").replace_strict(
        list(copy_kinds), list(copy_kinds.values()), default="Unknown", return_dtype=pl.String)))
    sets = _frame(export.rows("CUPTI_ACTIVITY_KIND_MEMSET", {
        "start": "start", "end": "end", "device": "deviceId", "stream": "streamId", "correlation": "correlationId",
        "process": "globalPid", "bytes": "bytes"}, required=("start", "end")),
        ["ts_ns", "end_ns", "device", "stream", "correlation", "process", "bytes"],
        ph="X", kind="gpu_memset", cat="gpu_memset", name="Memset")
    sync_types = export.enum("ENUM_CUPTI_SYNC_TYPE", SYNC_TYPES)
    syncs = _frame(export.rows("CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", {
        "start": "start", "end": "end", "device": "deviceId", "stream": "streamId", "correlation": "correlationId",
        "process": "globalPid", "code": "syncType"}, required=("start", "end")),
        ["ts_ns", "end_ns", "device", "stream", "correlation", "process", "code"], ph="X", kind="other", cat="cuda_sync")
    syncs = syncs.with_columns(name=pl.col("code").replace_strict(list(sync_types), list(sync_types.values()),
                                                                 default="Unknown", return_dtype=pl.String))
    work = pl.concat([kernels, copies.drop("code"), sets, syncs.drop("code")], how="diagonal_relaxed")
    # Device rows as Kineto lays them out: pid = device, tid = stream. CUPTI's correlation ids start at 1:
    # 0 is no launch (a unified-memory migration)
    return work.with_columns(pid="device", tid="stream", process=_process_of(pl.col("process")),
                             correlation=pl.when(pl.col("correlation") != 0).then("correlation"))


def _api_calls(export: _Export, names: dict[int, str]) -> pl.DataFrame:
    rows = export.rows("CUPTI_ACTIVITY_KIND_RUNTIME", {
        "start": "start", "end": "end", "thread": "globalTid", "correlation": "correlationId", "name": "nameId",
        "class": "eventClass"}, required=("start", "end", "nameId"))
    calls = pl.DataFrame(rows, orient="row", schema={"ts_ns": pl.Int64, "end_ns": pl.Int64, "thread": pl.Int64,
                                                     "correlation": pl.Int64, "name_id": pl.Int64, "event_class": pl.Int64})
    api = pl.col("name_id").replace_strict(list(names), list(names.values()), default=None, return_dtype=pl.String)
    name = api.str.replace(API_VERSION_SUFFIX, "")
    # eventClass says runtime or driver; without it, the driver API's names are cu*, the runtime's cuda*
    driver = pl.when(pl.col("event_class").is_not_null()).then(pl.col("event_class") == DRIVER_EVENT_CLASS).otherwise(
        ~name.str.starts_with("cuda"))
    return calls.with_columns(
        name=name, ph=pl.lit("X"), kind=pl.when(driver).then(pl.lit("cuda_driver")).otherwise(pl.lit("cuda_runtime")),
        pid=_process_of(pl.col("thread")), tid=pl.col("thread") % (1 << 24),
    ).with_columns(cat="kind", process="pid").drop("name_id", "event_class", "thread")


def _nvtx(export: _Export, names: dict[int, str], issues: list[Issue]) -> pl.DataFrame:
    """NVTX ranges as annotations, marks as instants; the category (`cat`) is the domain, and the NVTX
    category after a colon when the range has a named one (Domain:Category). NCCL's ranges keep
    their message size."""
    rows = export.rows("NVTX_EVENTS", {
        "start": "start", "end": "end", "type": "eventType", "text": "text", "text_id": "textId", "thread": "globalTid",
        "domain": "domainId", "category": "category", "json": "jsonText", "json_id": "jsonTextId"},
        required=("start", "eventType"), alternatives=("text", "textId"))
    nvtx = pl.DataFrame(rows, orient="row", schema={
        "ts_ns": pl.Int64, "end_ns": pl.Int64, "type": pl.Int64, "text": pl.String, "text_id": pl.Int64, "thread": pl.Int64,
        "domain": pl.Int64, "category": pl.Int64, "json": pl.String, "json_id": pl.Int64})

    def string(column: str) -> pl.Expr:
        return pl.col(column).replace_strict(list(names), list(names.values()), default=None, return_dtype=pl.String)

    nvtx = nvtx.with_columns(name=pl.coalesce("text", string("text_id")), payload=pl.coalesce("json", string("json_id")),
                             domain=pl.col("domain").fill_null(0))  # the default domain: 0, or NULL in some exports
    domains = nvtx.filter(pl.col("type") == NVTX_DOMAIN_CREATE).select("domain", domain_name="name").unique("domain")
    categories = nvtx.filter(pl.col("type") == NVTX_CATEGORY).select("domain", "category", category_name="name").unique(
        ["domain", "category"])
    shown = nvtx.filter(pl.col("type").is_in([*NVTX_RANGE_TYPES, NVTX_MARK])).with_row_index("row")
    shown = shown.join(domains, on="domain", how="left").join(categories, on=["domain", "category"], how="left")
    domain = pl.coalesce("domain_name", pl.lit("NVTX"))
    shown = shown.with_columns(
        cat=pl.when(pl.col("category_name").is_not_null()).then(pl.format("{}:{}", domain, "category_name")).otherwise(domain),
        ph=pl.when(pl.col("type") == NVTX_MARK).then(pl.lit("i")).otherwise(pl.lit("X")),
        end_ns=pl.when(pl.col("type") == NVTX_MARK).then(None).otherwise(pl.col("end_ns")),
        kind=pl.lit("user_annotation"), pid=_process_of(pl.col("thread")), tid=pl.col("thread") % (1 << 24),
        nccl=(domain == NCCL_DOMAIN) & pl.col("payload").is_not_null(),
    ).with_columns(process="pid")
    nccl = shown.filter("nccl")
    sizes = pl.Series("in_nelems", [_message_bytes(text) for text in nccl["payload"].to_list()], dtype=pl.Int64)
    shown = shown.join(nccl.select("row", sizes), on="row", how="left")
    return shown.drop("row", "type", "text", "text_id", "domain", "category", "json", "json_id", "payload", "domain_name",
                      "category_name", "nccl")


def _message_bytes(payload: str) -> int | None:
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    size = value.get(NCCL_SIZE_KEY) if isinstance(value, dict) else None
    return size if type(size) is int and 0 <= size <= 2**48 else None


def _link_nccl_sizes(events: pl.DataFrame) -> pl.DataFrame:
    """NCCL's NVTX range on the host encloses the launch of its kernel: the kernel takes the range's
    collective name and message size (as bytes: dtype Byte, so the comms analysis's bytes = nelems)."""
    in_nccl_domain = pl.col("cat").str.split(":").list.first() == NCCL_DOMAIN
    ranges = events.filter(in_nccl_domain & (pl.col("kind") == "user_annotation") & pl.col("end_ns").is_not_null())
    if ranges.is_empty():
        return events
    launches = events.filter(pl.col("kind").is_in(semantics.LAUNCH_KINDS) & pl.col("correlation").is_not_null()).select(
        "pid", "tid", "ts_ns", "correlation").sort("ts_ns")
    enclosing = ranges.select("pid", "tid", range_start="ts_ns", range_end="end_ns", collective="name", size="in_nelems").sort("range_start")
    linked = launches.join_asof(enclosing, left_on="ts_ns", right_on="range_start", by=["pid", "tid"], strategy="backward",
                               check_sortedness=False)  # both sorted by time above
    linked = linked.filter(pl.col("ts_ns") < pl.col("range_end")).select("correlation", "collective", "size")
    work = pl.col("kind") == "kernel"
    # NCCL's size is per rank: ReduceScatter's the output's (recvcount), the others' the input's
    output_sized = pl.col("collective_nccl").str.contains("(?i)reduce_?scatter").fill_null(False)
    events = events.join(linked, on="correlation", how="left", suffix="_nccl")
    return events.with_columns(
        collective=pl.when(work).then(pl.col("collective_nccl").str.replace(r"^nccl", "")).otherwise(pl.col("collective")),
        in_nelems=pl.when(work & ~output_sized).then(pl.col("size")).otherwise(pl.when(~work).then(pl.col("in_nelems"))),
        out_nelems=pl.when(work & output_sized).then(pl.col("size")),
        dtype=pl.when(work & pl.col("size").is_not_null()).then(pl.lit("Byte")).otherwise(pl.col("dtype")),
    ).drop("collective_nccl", "size")


# ---------------------------------------------------------------------------------------------
# Metadata


def _session_start_ns(export: _Export, issues: list[Issue]) -> int:
    if export.has("TARGET_INFO_SESSION_START_TIME", "utcEpochNs"):
        row = export.db.execute("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME").fetchone()
        if row and type(row[0]) is int and 0 <= row[0] <= 2**62:
            return row[0]
    issues.append(Issue("warning", "bad_base_time", 1, "no TARGET_INFO_SESSION_START_TIME.utcEpochNs: times are ns since "
                        "the session start, not epoch time (this rank cannot be aligned with others by clock)"))
    return 0


def _devices(export: _Export, problems: list[str]) -> list[Device]:
    """The GPUs of TARGET_INFO_GPU (clockRate in Hz there, kHz in CUDA's cudaDeviceProp)."""
    columns = {"name": "name", "numSms": "smCount", "totalGlobalMem": "totalMemory", "clockRate": "clockRate"}
    devices = []
    for name, sms, memory, clock_hz in export.rows("TARGET_INFO_GPU", columns, required=("name",)):
        devices.append(Device(name=checked(name, "TARGET_INFO_GPU.name", problems, str),
                              sm_count=checked(sms, "TARGET_INFO_GPU.smCount", problems, int, (1, 1 << 20)),
                              memory_bytes=checked(memory, "TARGET_INFO_GPU.totalMemory", problems, int, (0, 1 << 62)),
                              clock_khz=clock_hz // 1000 if type(clock_hz) is int and clock_hz > 0 else None))
    return devices


def _capture_environment(export: _Export) -> dict[str, str]:
    """The launched process's environment as nsys recorded it (META_DATA_CAPTURE PROCESS_<n>:ENVIRONMENT_VARIABLE)."""
    table = next((t for t in ("META_DATA_CAPTURE", "TARGET_INFO_CAPTURE") if export.has(t, "name", "value")), None)
    if table is None:
        return {}
    env = {}
    for (value,) in export.db.execute(f"SELECT value FROM {table} WHERE name LIKE 'PROCESS_%:ENVIRONMENT_VARIABLE'"):
        key, _, text = str(value).partition("=")
        env.setdefault(key, text.strip('"'))
    return env


def _rank_from_environment(env: dict[str, str], meta: TraceMeta) -> None:
    rank = next((env[k] for k in RANK_VARIABLES if env.get(k, "").isdigit()), None)
    world = next((env[k] for k in WORLD_VARIABLES if env.get(k, "").isdigit()), None)
    meta.rank = checked(int(rank), "environment RANK", meta.problems, int, (0, schema.MAX_RANK - 1)) if rank else None
    meta.world_size = checked(int(world), "environment WORLD_SIZE", meta.problems, int, (1, schema.MAX_RANK)) if world else None


def _export_facts(export: _Export) -> dict[str, str]:
    table = next((t for t in ("META_DATA_EXPORT", "EXPORT_META_DATA") if export.has(t, "name", "value")), None)
    return dict(export.db.execute(f"SELECT name, value FROM {table}").fetchall()) if table else {}


# ---------------------------------------------------------------------------------------------
# Entry point


def decode(path: Path) -> DecodedTrace | list[DecodedTrace]:
    """One nsys SQLite export -> one rank's trace, or one per process when it holds several
    processes with CUDA work. Raises NotATrace for a report that needs exporting or a SQLite database
    that is not an nsys export."""
    path = Path(path)
    if path.name.lower().endswith(REPORT_SUFFIXES):
        raise NotATrace("an Nsight Systems report, which steplens reads once exported to SQLite: run "
                        f"`{shlex.join(export_command(path))}` (or analyze --nsys-export)")
    try:
        export = _Export(path)
    except sqlite3.DatabaseError as e:
        raise NotATrace(f"a SQLite file that cannot be opened ({e})", damaged=True) from e
    try:
        decoded = _decode_export(export)
    except sqlite3.DatabaseError as e:  # a damaged page mid-read
        raise NotATrace(f"a damaged SQLite file ({e})", damaged=True) from e
    finally:
        export.close()
    # the bytes read, once per file (with its first rank when it holds several)
    (decoded[0] if isinstance(decoded, list) else decoded).raw_bytes = path.stat().st_size
    return decoded


def _decode_export(export: _Export) -> DecodedTrace | list[DecodedTrace]:
    if not any(t in export.tables for t in NSYS_MARKERS):
        shown = ", ".join(sorted(export.tables)[:8]) or "none"
        raise NotATrace(f"a SQLite database that is not an Nsight Systems export (its tables: {shown})")
    issues: list[Issue] = []
    names = export.strings()
    if not names and not export.has("StringIds", "id", "value"):
        export.missing.append(("StringIds without value" if "StringIds" in export.tables else "no StringIds") + " (names unknown)")
    base_ns = _session_start_ns(export, issues)
    parts = [_device_work(export, names), _api_calls(export, names), _nvtx(export, names, issues)]
    events = pl.concat([p for p in parts if p.height], how="diagonal_relaxed") if any(p.height for p in parts) else parts[0]
    for column, dtype in _EVENT_SCHEMA.items():
        if column not in events.columns:
            events = events.with_columns(pl.lit(None, dtype).alias(column))
    if export.mistyped:
        shown = ", ".join(f"{column} ({n})" for column, n in export.mistyped.items())
        issues.append(Issue("warning", "unrepresentable_value", sum(export.mistyped.values()),
                            f"values not of their column's type, read as null: {shown}"[:400]))
    _count_lost_device_work(events, issues)
    if export.missing:
        issues.append(Issue("info", "nsys_schema_gap", len(export.missing),
                            f"tables or columns this export lacks (Nsight Systems {_export_facts(export).get('EXPORT_PRODUCT_VERSION', '?')}): "
                            + "; ".join(export.missing)[:400]))
    facts = _export_facts(export)
    meta = TraceMeta(base_time_ns=base_ns or None)
    meta.schema_version = checked(facts.get("EXPORT_SCHEMA_VERSION"), "EXPORT_SCHEMA_VERSION", meta.problems, (int, str))
    meta.producer_version = checked(facts.get("EXPORT_PRODUCT_VERSION"), "EXPORT_PRODUCT_VERSION", meta.problems, str)
    meta.devices = _devices(export, meta.problems)
    processes = _processes(events, issues)
    if len(processes) <= 1:
        # One process: the environment nsys captured for the process it launched is this rank's
        _rank_from_environment(_capture_environment(export), meta)
        frame, row_issues = _checked_rows(processes[0][1], base_ns)
        return _rank_trace(frame, base_ns, meta, issues + row_issues)
    traces = []
    for index, (process, frame) in enumerate(processes):
        # the file's own problems once, with the first process; each process's rows' problems with it
        frame, row_issues = _checked_rows(frame, base_ns)
        trace = _rank_trace(frame, base_ns, replace(meta, problems=list(meta.problems)),
                            (list(issues) if index == 0 else []) + row_issues)
        trace.unit = f"process {process}"
        traces.append(trace)
    return traces


def _checked_rows(events: pl.DataFrame, base_ns: int) -> tuple[pl.DataFrame, list[Issue]]:
    """One process's events without the rows no time can be given, and the problems of its rows, counted."""
    issues: list[Issue] = []
    # Times once the session start is added must stay within ±TIME_LIMIT_NS: one beyond would wrap int64.
    def in_range(column: str) -> pl.Expr:
        return pl.col(column).is_between(-TIME_LIMIT_NS - base_ns, TIME_LIMIT_NS - base_ns)

    beyond = events.filter(pl.col("ts_ns").is_not_null() & ~in_range("ts_ns")).height
    if beyond:
        issues.append(Issue("warning", "bad_timestamp", beyond, "rows whose start is beyond 146 years of the session "
                            "start (damage, not a time); dropped"))
        events = events.filter(pl.col("ts_ns").is_null() | in_range("ts_ns"))
    events = events.with_columns(end_ns=pl.when(in_range("end_ns")).then("end_ns"))  # counted as missing below
    untimed = events.filter(pl.col("ts_ns").is_null()).height
    if untimed:
        issues.append(Issue("warning", "bad_timestamp", untimed, "rows without an integer start; dropped"))
        events = events.filter(pl.col("ts_ns").is_not_null())
    open_ended = events.filter((pl.col("ph") == "X") & pl.col("end_ns").is_null()).group_by("kind").len()
    for kind, n in open_ended.iter_rows():
        what = ("NVTX ranges without an end (still open when the capture stopped)" if kind == "user_annotation"
                else f"{kind} rows without an integer end (or with one beyond 146 years)")
        issues.append(Issue("warning", "missing_duration", n, f"{what}; kept with a null duration"))
    unnamed = events.filter(pl.col("name").is_null()).height
    if unnamed:
        issues.append(Issue("warning", "unrepresentable_value", unnamed, "events whose name id is not in StringIds; kept unnamed"))
    negative = events.filter(pl.col("end_ns") < pl.col("ts_ns")).height
    if negative:
        issues.append(Issue("warning", "negative_duration", negative, "events whose end is before their start, kept as written"))
    return events, issues


def _rank_trace(events: pl.DataFrame, base_ns: int, meta: TraceMeta, issues: list[Issue]) -> DecodedTrace:
    """One process's events, in the trace model (ingest applies the semantics, as for a Kineto trace)."""
    events = _link_nccl_sizes(events)
    events = events.with_columns(
        dur_ns=pl.col("end_ns") - pl.col("ts_ns"), ts_ns=pl.col("ts_ns") + base_ns,
        stream=pl.when(pl.col("kind").is_in(schema.DEVICE_KINDS)).then("stream"),
        device=pl.when(pl.col("kind").is_in(schema.DEVICE_KINDS)).then("device"),
    ).sort("ts_ns", maintain_order=True).with_row_index("event_id").with_columns(pl.col("event_id").cast(pl.Int64))
    endpoints = pl.DataFrame(schema={"ph": pl.String, "cat": pl.String, "pid": pl.Int64, "tid": pl.Int64, "ts_ns": pl.Int64,
                                     "flow_id": pl.Int64})
    return DecodedTrace(events, endpoints, meta, issues, step_name=step_range())


def _processes(events: pl.DataFrame, issues: list[Issue]) -> list[tuple[int, pl.DataFrame]]:
    """The processes that ran device work (where none did: those with CUDA API calls), each with its events,
    ordered by the lowest GPU each ran work on (torchrun and DeepSpeed give local rank N the GPU N), then by pid.
    Events of other processes (a launcher's NVTX ranges, a helper process that only queried the devices) belong
    to no rank and are counted."""
    work = pl.col("kind").is_in(list(schema.WORK_KINDS))
    cuda = work | pl.col("kind").is_in(semantics.LAUNCH_KINDS)
    with_process = events.filter(pl.col("process").is_not_null())
    ran_work = with_process.filter(work)
    ranked = ran_work if ran_work.height else with_process.filter(cuda)
    order = (ranked.group_by("process").agg(gpu=pl.col("device").filter(work).min())
             .sort(["gpu", "process"], nulls_last=True))
    if order.height == 0:
        return [(None, events)]
    processes = order["process"].to_list()
    rest = events.filter(~pl.col("process").is_in(processes) | pl.col("process").is_null())
    if rest.height:
        issues.append(Issue("info", "several_processes", rest.height,
                            f"events of processes that ran no device work (e.g. pid {rest['process'].drop_nulls().head(1).to_list()}), "
                            "which no rank holds; not read"))
    return [(process, events.filter(pl.col("process") == process)) for process in processes]
