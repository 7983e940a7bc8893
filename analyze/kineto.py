"""Read one PyTorch-profiler (Kineto) Chrome trace into normalized tables.

The trace is decoded in bounded chunks straight from the (gzip) stream, so memory stays a small
multiple of the chunk size whatever the file size, and a truncated file yields every complete event
before the cut. Events are decoded into typed structs by msgspec (unknown keys are skipped without
building Python objects), and `ts`/`dur` are kept as their raw JSON text and converted to integer
nanoseconds with exact decimal arithmetic: a float64 cannot hold `1712195495519689.047` µs to the
ns, and rounding it is how other tools manufacture negative durations.

Formats handled (see ../shared/corpus/INVENTORY.md): the 2020 top-level JSON array; capitalised
legacy categories (Operator, Runtime, Kernel, Memcpy, Memset); legacy launch flows (`async`,
`async_gpu`, `async_cpu_to_gpu`) and `ac2g`; `ts` relative to `baseTimeNanoseconds` (which Kineto
writes after traceEvents); ids above int64; string pids/tids (`"stream 7"`); ROCm `hip*` APIs.
"""

from __future__ import annotations

import ctypes
import gc
import io
import re
import zlib
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Iterator, Optional

import msgspec
import polars as pl
import pyarrow as pa
import pyarrow.csv as pacsv
from isal import isal_zlib

from . import schema

CHUNK_BYTES = 2 << 20
# A ts above this many ns (~1973 as epoch time) is already absolute, not relative to a base time.
ABSOLUTE_NS_THRESHOLD = 10**17
SNIFF_BYTES = 1 << 20

# Category (lower-cased) -> kind. Old traces (PyTorch 1.8/1.9) capitalise: Operator, Runtime, Kernel.
CATEGORY_KINDS = {
    "cpu_op": "cpu_op",
    "operator": "cpu_op",
    "user_annotation": "user_annotation",
    "python_function": "python_function",
    "cuda_runtime": "cuda_runtime",
    "runtime": "cuda_runtime",
    "cuda_driver": "cuda_driver",
    "driver": "cuda_driver",
    "kernel": "kernel",
    "gpu_memcpy": "gpu_memcpy",
    "memcpy": "gpu_memcpy",
    "gpu_memset": "gpu_memset",
    "memset": "gpu_memset",
    "gpu_user_annotation": "gpu_user_annotation",
}
MEMORY_EVENT_NAME = "[memory]"

# Flow categories that link a CPU launch to device work: `ac2g` (PyTorch >= 1.10) and the legacy
# names Kineto used before it.
LAUNCH_FLOW_CATEGORIES = {"ac2g", "async", "async_gpu", "async_cpu_to_gpu"}
FWDBWD_FLOW_CATEGORY = "fwdbwd"

# Runtime/driver calls that enqueue device work. Covers every launch API in the corpus
# (cudaLaunchKernel[ExC], cuLaunchKernel[Ex], cudaGraphLaunch, hipLaunchKernel,
# hipExtModuleLaunchKernel, hipModuleLaunchKernel, hipGraphLaunch) and async/sync copies and sets.
LAUNCH_API = re.compile(
    r"^(cuda|cu|hip)(Ext)?(Module)?Launch|^(cuda|cu|hip)GraphLaunch|^(cuda|cu|hip)Memcpy|^(cuda|cu|hip)Memset"
)
STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")


class _Args(msgspec.Struct, gc=False):
    correlation: Any = None
    external_id: Any = msgspec.field(default=None, name="External id")
    stream: Any = None
    device: Any = None
    collective: Any = msgspec.field(default=None, name="Collective name")
    in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    dtype: Any = None
    group_size: Any = msgspec.field(default=None, name="Group size")
    group_name: Any = msgspec.field(default=None, name="Process Group Name")
    group_desc: Any = msgspec.field(default=None, name="Process Group Description")
    group_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")
    seq: Any = msgspec.field(default=None, name="Seq")
    comms_id: Any = msgspec.field(default=None, name="Comms Id")
    src_rank: Any = msgspec.field(default=None, name="Src Rank")
    dst_rank: Any = msgspec.field(default=None, name="Dst Rank")
    input_dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input Dims")
    input_dims_legacy: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input dims")
    nbytes: Any = msgspec.field(default=None, name="bytes")
    memory_bytes: Any = msgspec.field(default=None, name="Bytes")
    flops: Any = None


class _Event(msgspec.Struct, gc=False):
    ph: Any = None
    cat: Any = None
    name: Any = None
    pid: Any = None
    tid: Any = None
    ts: msgspec.Raw = msgspec.Raw()
    dur: msgspec.Raw = msgspec.Raw()
    id: Any = None
    args: Optional[_Args] = None


_NO_ARGS = _Args()
_EVENTS = msgspec.json.Decoder(list[_Event])
_RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])
_EVENT = msgspec.json.Decoder(_Event)


class NotATrace(Exception):
    """The file is readable but is not a Kineto/Chrome trace; the message says what it looks like."""


@dataclass
class Issue:
    severity: str
    reason: str
    count: int
    detail: str


@dataclass
class ParsedTrace:
    events: pl.DataFrame
    flows: pl.DataFrame
    steps: pl.DataFrame
    metadata: dict
    issues: list[Issue] = field(default_factory=list)
    raw_bytes: int = 0


# ---------------------------------------------------------------------------------------------
# Byte stream


class _Stream:
    """Decompressed bytes of a .json or .json.gz file, block by block, surviving truncation."""

    def __init__(self, path: Path):
        self.path = path
        self.truncated: str | None = None
        self.raw_bytes = 0

    def blocks(self) -> Iterator[bytes]:
        with open(self.path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            if head != b"\x1f\x8b":
                while block := f.read(CHUNK_BYTES):
                    self.raw_bytes += len(block)
                    yield block
                return
            inflater = isal_zlib.decompressobj(31)
            while compressed := f.read(1 << 20):
                while compressed:
                    try:
                        block = inflater.decompress(compressed)
                    except (isal_zlib.error, zlib.error) as e:
                        self.truncated = f"corrupt gzip data ({e})"
                        return
                    self.raw_bytes += len(block)
                    if block:
                        yield block
                    if not inflater.eof or not inflater.unused_data:
                        break
                    # A multi-member gzip: start the next member on the leftover bytes.
                    compressed = inflater.unused_data
                    inflater = isal_zlib.decompressobj(31)
            if not inflater.eof:
                tail = inflater.flush()
                self.raw_bytes += len(tail)
                if tail:
                    yield tail
                self.truncated = "gzip stream ends before its end marker (file cut short)"


# ---------------------------------------------------------------------------------------------
# Chunked JSON decoding


def _describe_non_trace(head: bytes) -> str:
    text = head.lstrip()
    if not text:
        return "empty file"
    if text[:1] == b"[":
        inner = text[1:].lstrip()[:1]
        if inner == b"[":
            return "a JSON array of arrays (looks like a torch memory_timeline export)"
        return "a JSON array whose elements are not trace events"
    if text[:1] == b"{":
        key = re.match(rb'\{\s*"([^"]{0,80})"', text)
        first = key.group(1).decode("utf-8", "replace") if key else "?"
        hint = " (rocprofiler-sdk output)" if "rocprofiler" in first else ""
        return f"a JSON object with no traceEvents array (first key {first!r}){hint}"
    return "not JSON"


def sniff(head: bytes) -> bool:
    """True when the first bytes of a (decompressed) file look like a Chrome/Kineto trace."""
    text = head.lstrip()
    if text[:1] == b"{":
        return b'"traceEvents"' in text or b'"schemaVersion"' in text[:200]
    if text[:1] == b"[":
        first = text[1:].lstrip()
        return first[:1] == b"{" and b'"ph"' in first[:2000]
    return False


_BETWEEN_EVENTS = re.compile(rb"\}\s*,\s*\{")
_SEPARATOR = re.compile(rb"\s*,?\s*")


def _last_event_end(buf: bytes, limit: int) -> int:
    """Index of the `}` that most likely closes the last whole event before `limit`.

    Prefers a `},{` boundary (cheap to confirm); falls back to the last `}`.
    """
    for lookback in (1 << 16, 1 << 20):
        last = None
        for last in _BETWEEN_EVENTS.finditer(buf, max(0, limit - lookback), limit):
            pass
        if last is not None:
            return last.start()
    return buf.rfind(b"}", 0, limit)


class _ChunkReader:
    """Yields lists of decoded events from the traceEvents array of a stream."""

    def __init__(self, stream: _Stream):
        self.stream = stream
        self.blocks = stream.blocks()
        self.buf = b""
        self.eof = False
        self.header = b""  # everything before the events array
        self.trailer = b""  # everything after it
        self.malformed_events = 0
        self.malformed_example = ""
        self.truncated = False

    def _fill(self, want: int) -> None:
        parts = [self.buf]
        size = len(self.buf)
        while size < want and not self.eof:
            block = next(self.blocks, None)
            if block is None:
                self.eof = True
                break
            parts.append(block)
            size += len(block)
        self.buf = b"".join(parts)

    def _find_array_start(self) -> None:
        self._fill(SNIFF_BYTES)
        if not sniff(self.buf[:SNIFF_BYTES]):
            raise NotATrace(_describe_non_trace(self.buf[:4096]))
        text = self.buf.lstrip()
        if text[:1] == b"[":
            start = len(self.buf) - len(text) + 1
        else:
            while True:
                m = re.search(rb'"traceEvents"\s*:\s*\[', self.buf)
                if m or self.eof:
                    break
                self._fill(len(self.buf) + CHUNK_BYTES)
            if not m:
                raise NotATrace(_describe_non_trace(self.buf[:4096]))
            start = m.end()
        self.header = self.buf[:start - 1]
        self.buf = self.buf[start:]

    def events(self) -> Iterator[list[_Event]]:
        self._find_array_start()
        want = CHUNK_BYTES
        while True:
            self._fill(want)
            skip = _SEPARATOR.match(self.buf).end()
            if self.buf[skip : skip + 1] == b"]":  # empty array, or the end after the last chunk
                self.trailer = self.buf[skip + 1 :]
                self._drain()
                return
            if skip:
                self.buf = self.buf[skip:]
            limit = len(self.buf) if self.eof else min(len(self.buf), want)
            decoded = self._decode_prefix(limit)
            if decoded is None:
                if self.eof:
                    self._mark_truncated()
                    return
                want *= 2  # one event larger than the window: widen it
                continue
            events, consumed, ended = decoded
            self.buf = self.buf[consumed:]
            if events:
                yield events
            if ended:
                self.trailer = self.buf
                self._drain()
                return
            want = CHUNK_BYTES

    def _decode_prefix(self, limit: int):
        """Decode the longest run of whole events in buf[:limit]; None when there is none."""
        pos = _last_event_end(self.buf, limit)
        for _ in range(64):
            if pos < 0:
                return None
            candidate = b"[" + self.buf[: pos + 1] + b"]"
            try:
                return self._decode(candidate), pos + 1, False
            except msgspec.DecodeError as e:
                m = re.search(r"trailing characters \(byte (\d+)\)", str(e))
                if m:  # the events array closed inside this prefix
                    end = candidate.rfind(b"]", 0, int(m.group(1)))
                    events = self._decode(candidate[: end + 1])
                    return events, end, True
            pos = self.buf.rfind(b"}", 0, pos)
        return None

    def _decode(self, candidate: bytes) -> list[_Event]:
        try:
            return _EVENTS.decode(candidate)
        except msgspec.ValidationError:
            pass
        # Some element has an unexpected shape: decode one by one and keep the sound ones.
        events = []
        for raw in _RAW_LIST.decode(candidate):
            try:
                events.append(_EVENT.decode(raw))
            except msgspec.ValidationError as e:
                self.malformed_events += 1
                if not self.malformed_example:
                    self.malformed_example = f"{e}: {bytes(raw)[:120]!r}"
        return events

    def _mark_truncated(self) -> None:
        self.truncated = True
        self.trailer = b""

    def _drain(self) -> None:
        parts = [self.trailer]
        for block in self.blocks:
            parts.append(block)
        self.trailer = b"".join(parts)
        self.eof = True

    def metadata(self) -> dict:
        """Top-level keys other than traceEvents (deviceProperties, distributedInfo, base time...)."""
        if not self.header.strip():  # 2020 array format: no metadata at all
            return {}
        for doc in (self.header + b"[]" + self.trailer, self.header + b"[]}"):
            try:
                value = msgspec.json.decode(doc)
                return value if isinstance(value, dict) else {}
            except msgspec.DecodeError:
                continue
        return {}


# ---------------------------------------------------------------------------------------------
# Columns


def _int_column(values: list, dtype=pa.int64()) -> tuple[pa.Array, int]:
    """Values as an integer array; numeric strings are parsed, anything else becomes null.

    Returns the array and how many non-null values could not be represented.
    """
    try:
        return pa.array(values, type=dtype), 0
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
        pass
    lo, hi = (0, 2**64 - 1) if dtype == pa.uint64() else (-(2**63), 2**63 - 1)
    out = [v if type(v) is int else None for v in values]
    bad = 0
    for i in [i for i, v in enumerate(values) if type(v) is not int and v is not None]:
        out[i] = _coerce_int(values[i], lo, hi)
        # Non-numeric labels ("Spans", "PyTorch Profiler") are names, not damaged numbers.
        bad += out[i] is None and not isinstance(values[i], str)
    try:
        return pa.array(out, type=dtype), bad
    except OverflowError:
        in_range = [v if v is None or lo <= v <= hi else None for v in out]
        return pa.array(in_range, type=dtype), bad + in_range.count(None) - out.count(None)


def _coerce_int(value, lo: int, hi: int) -> int | None:
    """Numeric strings (and Kineto's legacy "stream 7" tids) become ints; the rest None."""
    if isinstance(value, str):
        digits = value.removeprefix("stream ").strip()
        value = int(digits) if digits.lstrip("-").isdigit() else None
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if type(value) is int and lo <= value <= hi else None


def _str_column(values: list) -> pa.Array:
    try:
        return pa.array(values, type=pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if v is None else str(v) for v in values], type=pa.string())


def _float_column(values: list) -> pa.Array:
    try:
        return pa.array(values, type=pa.float64())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([v if isinstance(v, (int, float)) else None for v in values], type=pa.float64())


def _raw_column(raws: list[msgspec.Raw]) -> pa.Array:
    """Raw JSON texts (empty = absent) as a string array, via one CSV parse instead of N bytes()."""
    joined = b"\n".join(raws)
    if not joined.strip():
        return pa.nulls(len(raws), pa.string())
    if b"\r" in joined or joined.count(b"\n") != len(raws) - 1:  # multi-line values: re-encode compactly
        return pa.array([msgspec.json.encode(msgspec.json.decode(r)).decode() if r else None for r in raws], type=pa.string())
    table = pacsv.read_csv(
        io.BytesIO(joined + b"\n"),
        read_options=pacsv.ReadOptions(column_names=["v"], use_threads=False),
        parse_options=pacsv.ParseOptions(ignore_empty_lines=False, quote_char=False, delimiter="\x01"),
        convert_options=pacsv.ConvertOptions(column_types={"v": pa.string()}, strings_can_be_null=True),
    )
    return table.column("v").combine_chunks()


_DECIMAL = r"^-?\d+(\.\d+)?$"


def microseconds_text_to_ns(text: pl.Series) -> tuple[pl.Series, int]:
    """Exact µs decimal text -> integer ns (digits past the third decimal are sub-ns and dropped).

    Returns the ns series and the number of non-empty values that are not JSON numbers.
    """
    frame = pl.DataFrame({"t": text})
    parts = pl.col("t").str.split_exact(".", 1)
    whole = parts.struct.field("field_0").cast(pl.Int64, strict=False)
    frac = parts.struct.field("field_1").fill_null("").str.pad_end(3, "0").str.slice(0, 3).cast(pl.Int64, strict=False)
    signed_frac = pl.when(pl.col("t").str.starts_with("-")).then(-frac).otherwise(frac)
    plain = pl.col("t").str.contains(_DECIMAL)
    frame = frame.with_columns(
        ns=pl.when(plain).then(whole * 1000 + signed_frac),
        odd=pl.col("t").is_not_null() & ~plain,
    )
    ns = frame["ns"]
    odd = frame["odd"]
    n_odd = int(odd.sum())
    if n_odd:  # exponents or quoted numbers: rare, exact via Decimal
        fixed = [
            _decimal_us_to_ns(t) if o else v
            for t, o, v in zip(frame["t"].to_list(), odd.to_list(), ns.to_list())
        ]
        ns = pl.Series(fixed, dtype=pl.Int64)
        n_odd = sum(1 for t, o, v in zip(frame["t"].to_list(), odd.to_list(), fixed) if o and v is None)
    return ns, n_odd


def _decimal_us_to_ns(text: str) -> int | None:
    try:
        return int(Decimal(text.strip('"')) * 1000)
    except (InvalidOperation, ValueError):
        return None


def _columns(events: list[_Event], counters: dict[str, int]) -> pl.DataFrame:
    args = [e.args or _NO_ARGS for e in events]

    def count_bad(column: str, bad: int) -> None:
        if bad:
            counters[column] = counters.get(column, 0) + bad

    def ints(values, column, dtype=pa.int64()):
        array, bad = _int_column(values, dtype)
        count_bad(column, bad)
        return array

    n = len(events)
    # Collective args sit on a handful of events: read them only there.
    comm_rows = [i for i, a in enumerate(args) if a.collective is not None or a.seq is not None or a.comms_id is not None]

    def comm(name: str) -> list:
        values = [None] * n
        for i in comm_rows:
            values[i] = getattr(args[i], name)
        return values

    dims = [a.input_dims or a.input_dims_legacy for a in args]
    columns = {
        "ph": _str_column([e.ph for e in events]),
        "cat": _str_column([e.cat for e in events]),
        "name": _str_column([e.name for e in events]),
        "pid": ints([e.pid for e in events], "pid"),
        "tid": ints([e.tid for e in events], "tid"),
        "ts_text": _raw_column([e.ts for e in events]),
        "dur_text": _raw_column([e.dur for e in events]),
        "flow_id": ints([e.id for e in events], "id"),
        "arg_stream": ints([a.stream for a in args], "stream"),
        "arg_device": ints([a.device for a in args], "device"),
        "correlation": ints([a.correlation for a in args], "correlation"),
        "external_id": ints([a.external_id for a in args], "External id"),
        "collective": _str_column(comm("collective")),
        "in_nelems": ints(comm("in_nelems"), "In msg nelems"),
        "out_nelems": ints(comm("out_nelems"), "Out msg nelems"),
        "dtype": _str_column(comm("dtype")),
        "group_size": ints(comm("group_size"), "Group size"),
        "group_name": _str_column(comm("group_name")),
        "group_desc": _str_column(comm("group_desc")),
        "group_ranks": _str_column(comm("group_ranks")),
        "seq": ints(comm("seq"), "Seq"),
        "comms_id": ints(comm("comms_id"), "Comms Id", pa.uint64()),
        "src_rank": ints(comm("src_rank"), "Src Rank"),
        "dst_rank": ints(comm("dst_rank"), "Dst Rank"),
        "input_dims": _raw_column(dims),
        "bytes": ints([a.nbytes if a.nbytes is not None else a.memory_bytes for a in args], "bytes"),
        "flops": _float_column([a.flops for a in args]),
    }
    return pl.from_arrow(pa.table(columns))


# ---------------------------------------------------------------------------------------------
# Normalization


def _normalize(raw: pl.DataFrame, base_ns: int, issues: list[Issue]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Split raw rows into trace events (X/i) and flow endpoints (s/f/t), with exact ns times."""
    ts, bad_ts = microseconds_text_to_ns(raw["ts_text"])
    dur, bad_dur = microseconds_text_to_ns(raw["dur_text"])
    if base_ns and (ts.max() or 0) >= ABSOLUTE_NS_THRESHOLD:
        issues.append(Issue("info", "absolute_ts_with_base", 1, "ts already absolute; baseTimeNanoseconds not added"))
        base_ns = 0
    if bad_ts or bad_dur:
        issues.append(Issue("warning", "bad_timestamp", bad_ts + bad_dur,
                            "ts/dur values that are not numbers; those events were dropped"))
    raw = raw.with_columns(ts_ns=ts + base_ns, dur_ns=dur).drop("ts_text", "dur_text")

    phase = pl.col("ph")
    is_event = phase.is_in(["X", "i", "I"]) & pl.col("ts_ns").is_not_null()
    is_flow = phase.is_in(["s", "f", "t"]) & pl.col("ts_ns").is_not_null()
    counts = raw.group_by("ph").len()
    ignored = counts.filter(~pl.col("ph").is_in(["X", "i", "I", "s", "f", "t", "M"]) | pl.col("ph").is_null())
    for ph, n in ignored.iter_rows():
        issues.append(Issue("info", "unsupported_phase", n, f"events with ph={ph!r} are not complete/instant/flow events; skipped"))
    no_dur = raw.filter((phase == "X") & pl.col("dur_ns").is_null()).height
    if no_dur:
        issues.append(Issue("warning", "missing_duration", no_dur, "complete (X) events without dur; kept with null duration"))
    negative = raw.filter((phase == "X") & (pl.col("dur_ns") < 0)).height
    if negative:
        issues.append(Issue("warning", "negative_duration", negative, "complete events with negative dur as written in the trace"))

    events = raw.filter(is_event)
    flows = raw.filter(is_flow).select("ph", "cat", "pid", "tid", "ts_ns", "flow_id")
    kind_of_cat = pl.col("cat").str.to_lowercase().replace_strict(CATEGORY_KINDS, default="other")
    kind = pl.when(pl.col("name") == MEMORY_EVENT_NAME).then(pl.lit("memory")).otherwise(kind_of_cat)
    events = events.with_columns(
        kind=kind.fill_null("other"),
        dur_ns=pl.when(pl.col("ph") == "X").then(pl.col("dur_ns")),
    ).with_columns(
        stream=pl.when(pl.col("kind").is_in(schema.DEVICE_KINDS)).then(pl.coalesce("arg_stream", "tid")),
        device=pl.when(pl.col("kind").is_in(schema.DEVICE_KINDS)).then(pl.coalesce("arg_device", "pid")),
        is_launch=pl.col("kind").is_in(["cuda_runtime", "cuda_driver"]) & pl.col("name").str.contains(LAUNCH_API.pattern),
    )
    events = events.sort("ts_ns", maintain_order=True).with_row_index("event_id").with_columns(pl.col("event_id").cast(pl.Int64))
    return events, flows


def _steps(events: pl.DataFrame) -> pl.DataFrame:
    steps = (
        events.filter(
            pl.col("name").str.starts_with("ProfilerStep#")
            & pl.col("dur_ns").is_not_null()
            & ~pl.col("kind").is_in(schema.DEVICE_KINDS)
        )
        .select(
            step=pl.col("name").str.extract(STEP_NAME.pattern).cast(pl.Int64),
            start_ns="ts_ns",
            end_ns=pl.col("ts_ns") + pl.col("dur_ns"),
            dur_ns="dur_ns",
            pid="pid",
            tid="tid",
        )
        .drop_nulls("step")
        .sort("start_ns")
    )
    return steps


WORK_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")  # device work a launch call enqueues


def _assign_steps(events: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    """CPU events get the step whose window holds their start; device events the step of their launch.

    `events` is sorted by ts_ns (event_id order), which the as-of join needs and keeps."""
    if steps.is_empty():
        return events.with_columns(step=pl.lit(None, pl.Int64))
    windows = steps.select("start_ns", step_end_ns="end_ns", window_step="step").sort("start_ns")
    events = events.join_asof(windows, left_on="ts_ns", right_on="start_ns", strategy="backward", check_sortedness=False)
    events = events.with_columns(time_step=pl.when(pl.col("ts_ns") < pl.col("step_end_ns")).then(pl.col("window_step")))
    launch_steps = (
        events.filter(pl.col("kind").is_in(["cuda_runtime", "cuda_driver"]) & pl.col("correlation").is_not_null())
        .group_by("correlation")
        .agg(launch_step=pl.col("time_step").first())
    )
    # Device work takes its launch's step, and none when its launch is not in the file (enqueued before
    # the window): a time guess would put it in whichever step was open when it ran.
    work = pl.col("kind").is_in(WORK_KINDS)
    events = events.join(launch_steps, on="correlation", how="left", maintain_order="left").with_columns(
        step=pl.when(work).then(pl.col("launch_step")).otherwise(pl.col("time_step"))
    )
    return events.drop("start_ns", "step_end_ns", "window_step", "time_step", "launch_step")


def _launch_links(events: pl.DataFrame) -> pl.DataFrame:
    """Launch -> device work by correlation id. A graph launch links to every kernel it ran."""
    calls = events.filter(pl.col("kind").is_in(["cuda_runtime", "cuda_driver"]) & pl.col("correlation").is_not_null())
    device = events.filter(pl.col("kind").is_in(["kernel", "gpu_memcpy", "gpu_memset"]) & pl.col("correlation").is_not_null())
    # Correlation ids are unique per call; if a trace repeats one, keep the launch API (then the first).
    calls = calls.sort(["correlation", "is_launch", "event_id"], descending=[False, True, False]).unique("correlation", keep="first")
    return device.join(calls, on="correlation", how="inner", suffix="_src").select(
        flow_type=pl.lit("launch"),
        src_event_id="event_id_src",
        dst_event_id="event_id",
        via=pl.lit("correlation"),
        flow_id="correlation",
    )


def _flow_links(events: pl.DataFrame, endpoints: pl.DataFrame, issues: list[Issue]) -> pl.DataFrame:
    """Pair s/f flow events and bind each end to the innermost slice starting at that time."""
    if endpoints.is_empty():
        return pl.DataFrame(schema=_FLOW_LINK_SCHEMA)
    endpoints = endpoints.filter(pl.col("flow_id").is_not_null())
    starts = endpoints.filter(pl.col("ph") == "s")
    ends = endpoints.filter(pl.col("ph").is_in(["f", "t"]))
    pairs = starts.join(ends, on=["cat", "flow_id"], how="inner", suffix="_dst").unique(["cat", "flow_id"], keep="first")
    unmatched_starts = starts.height - starts.join(ends, on=["cat", "flow_id"], how="semi").height
    if unmatched_starts:
        issues.append(Issue("info", "flow_without_end", unmatched_starts,
                            "flow starts whose end is outside the trace window (e.g. a launch whose kernel was not recorded)"))
    slices = events.filter(pl.col("dur_ns").is_not_null()).select("event_id", "pid", "tid", "ts_ns", "dur_ns")
    innermost = slices.sort("dur_ns").unique(["pid", "tid", "ts_ns"], keep="first").drop("dur_ns")
    src = innermost.rename({"event_id": "src_event_id"})
    dst = innermost.rename({"event_id": "dst_event_id", "pid": "pid_dst", "tid": "tid_dst", "ts_ns": "ts_ns_dst"})
    linked = pairs.join(src, on=["pid", "tid", "ts_ns"], how="inner").join(dst, on=["pid_dst", "tid_dst", "ts_ns_dst"], how="inner")
    unbound = pairs.height - linked.height
    if unbound:
        issues.append(Issue("info", "flow_unbound", unbound, "flow pairs whose start or end matches no slice; not linked"))
    flow_type = pl.when(pl.col("cat").is_in(list(LAUNCH_FLOW_CATEGORIES))).then(pl.lit("launch")).otherwise(
        pl.when(pl.col("cat") == FWDBWD_FLOW_CATEGORY).then(pl.lit("fwdbwd")).otherwise(pl.col("cat"))
    )
    return linked.select(
        flow_type=flow_type,
        src_event_id="src_event_id",
        dst_event_id="dst_event_id",
        via=pl.lit("flow_event"),
        flow_id="flow_id",
    )


_FLOW_LINK_SCHEMA = {
    "flow_type": pl.String,
    "src_event_id": pl.Int64,
    "dst_event_id": pl.Int64,
    "via": pl.String,
    "flow_id": pl.Int64,
}


def _flows(events: pl.DataFrame, endpoints: pl.DataFrame, issues: list[Issue]) -> pl.DataFrame:
    by_correlation = _launch_links(events)
    by_flow = _flow_links(events, endpoints, issues)
    # Correlation is authoritative for launches; flow events add only the links it cannot see.
    extra = by_flow.join(by_correlation, on="dst_event_id", how="anti")
    flows = pl.concat([by_correlation.cast(_FLOW_LINK_SCHEMA), extra.cast(_FLOW_LINK_SCHEMA)]).sort("src_event_id", "dst_event_id")
    launched = flows.filter(pl.col("flow_type") == "launch")["dst_event_id"].implode()
    orphans = events.filter(pl.col("kind").is_in(WORK_KINDS) & ~pl.col("event_id").is_in(launched))
    if orphans.height:
        issues.append(Issue("warning", "orphan_device_activity", orphans.height,
                            f"device activities ({orphans['dur_ns'].fill_null(0).sum()} ns of GPU time) whose launch is not "
                            "in the trace (enqueued before the profiler window opened): no step, no launch API; they "
                            "still count as device busy time"))
    return flows


# ---------------------------------------------------------------------------------------------
# Entry point


def parse_trace(path: Path, source: str) -> ParsedTrace:
    """Parse one trace file. Raises NotATrace for JSON that is not a trace, OSError if unreadable."""
    stream = _Stream(path)
    reader = _ChunkReader(stream)
    counters: dict[str, int] = {}
    # Decoded events hold no reference cycles; collecting garbage over them only costs time.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        chunks = [_columns(events, counters) for events in reader.events()]
    finally:
        if gc_was_enabled:
            gc.enable()
    metadata = reader.metadata()
    issues: list[Issue] = []
    if stream.truncated or reader.truncated:
        why = stream.truncated or "JSON ends in the middle of traceEvents (file cut short)"
        issues.append(Issue("error", "truncated", 1, f"{why}; kept every complete event before the cut"))
    if reader.malformed_events:
        issues.append(Issue("warning", "malformed_event", reader.malformed_events,
                            f"events of an unexpected shape were skipped, e.g. {reader.malformed_example}"))
    for column, n in sorted(counters.items()):
        issues.append(Issue("warning", "unrepresentable_value", n, f"'{column}' values that are not integers in range; stored as null"))

    if not chunks:
        if reader.malformed_events:
            raise NotATrace("a JSON array whose elements are not trace events")
        raw = _columns([], counters)
    else:
        raw = pl.concat(chunks, how="vertical_relaxed", rechunk=False)
    del chunks  # each stage drops its input as soon as it is done: peak memory is about two copies
    _return_freed_memory()
    base_ns = _base_time_ns(metadata)
    events, endpoints = _normalize(raw, base_ns, issues)
    del raw
    steps = _steps(events)
    events = _assign_steps(events, steps)
    flows = _flows(events, endpoints, issues)
    launched_by = flows.filter(pl.col("flow_type") == "launch").unique("dst_event_id", keep="first").select(
        event_id="dst_event_id", launch_event_id="src_event_id")
    events = events.join(launched_by, on="event_id", how="left", maintain_order="left")
    events = events.select(
        [pl.col(c) if c != "source" else pl.lit(source).alias("source") for c in schema.TRACE_EVENTS.names]
    )
    steps = steps.select(pl.lit(source).alias("source"), pl.all())
    flows = flows.select(pl.lit(source).alias("source"), pl.all())
    return ParsedTrace(events, flows, steps, metadata, issues, stream.raw_bytes)


def _return_freed_memory() -> None:
    """Hand the decoding stage's freed heap back to the OS before polars (which allocates with its
    own jemalloc and cannot reuse glibc's free lists) builds the tables: 5-8% lower peak memory."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


try:
    _LIBC = ctypes.CDLL(None)
except OSError:  # not a platform with a C library to load by that name
    _LIBC = None


def _base_time_ns(metadata: dict) -> int:
    base = metadata.get("baseTimeNanoseconds")
    return int(base) if isinstance(base, (int, float)) and not isinstance(base, bool) else 0
