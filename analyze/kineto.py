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
import decimal
import gc
import io
import os
import re
import zlib
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Iterator, Optional

import msgspec
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from isal import isal_zlib

from . import schema

CHUNK_BYTES = 2 << 20
# Memory bound for one event and for the text around the events array: no real event comes near it
# (the largest in the corpus is a few kB); beyond it the bytes are skipped to the next event.
MAX_EVENT_BYTES = 32 << 20
GZIP_MAGIC = b"\x1f\x8b"
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
    input_types: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input type")
    concrete_inputs: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Concrete Inputs")
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
    """The file is readable but is not a Kineto/Chrome trace; the message says what it looks like.

    `damaged`: it is not JSON at all (or a trace cut short before its events), as opposed to JSON
    of another kind (a ds_config.json, a memory-timeline export)."""

    def __init__(self, message: str, damaged: bool = False):
        super().__init__(message)
        self.damaged = damaged


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
    """Decompressed bytes of a .json or .json.gz file, block by block, surviving truncation.

    Blocks are at most CHUNK_BYTES however well the data compresses (a 6 MB gzip can hold 1.5 GB),
    further gzip members are read, and bytes after the last member that are not one are counted
    (`trailing_bytes`, `trailing_zeros`), not taken for a damaged member."""

    def __init__(self, path: Path):
        self.path = path
        self.truncated: str | None = None
        self.raw_bytes = 0
        self.trailing_bytes = 0
        self.trailing_zeros = False

    def blocks(self) -> Iterator[bytes]:
        with open(self.path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            if head != GZIP_MAGIC:
                while block := f.read(CHUNK_BYTES):
                    self.raw_bytes += len(block)
                    yield block
                return
            yield from self._inflate(f)

    def _inflate(self, f) -> Iterator[bytes]:
        inflater = isal_zlib.decompressobj(31)
        pending = b""
        while True:
            if len(pending) < 2:  # also enough to tell a next member's magic from padding
                pending += f.read(1 << 20)
                if not pending:
                    break
            if inflater.eof:
                if pending[:2] != GZIP_MAGIC:
                    self._count_trailing(pending, f)
                    return
                inflater = isal_zlib.decompressobj(31)  # a multi-member gzip: the next member
            try:
                block = inflater.decompress(pending, CHUNK_BYTES)
            except (isal_zlib.error, zlib.error) as e:
                self.truncated = f"corrupt gzip data ({e})"
                return
            pending = inflater.unused_data if inflater.eof else inflater.unconsumed_tail
            self.raw_bytes += len(block)
            if block:
                yield block
        if not inflater.eof:
            tail = inflater.flush()
            self.raw_bytes += len(tail)
            if tail:
                yield tail
            self.truncated = "gzip stream ends before its end marker (file cut short)"

    def _count_trailing(self, pending: bytes, f) -> None:
        """Bytes after the last gzip member: zero padding (from a preallocated file) or garbage."""
        first = pending + f.read(max(0, (1 << 20) - len(pending)))
        self.trailing_bytes = os.fstat(f.fileno()).st_size - f.tell() + len(first)
        self.trailing_zeros = first.count(0) == len(first)


# ---------------------------------------------------------------------------------------------
# Chunked JSON decoding


def _describe_non_trace(head: bytes) -> tuple[str, bool]:
    """What the file looks like, and whether that is damage (not JSON at all) rather than another format."""
    text = head.lstrip()
    if not text:
        return "empty file", True
    if text[:1] == b"[":
        inner = text[1:].lstrip()[:1]
        if inner == b"[":
            return "a JSON array of arrays (looks like a torch memory_timeline export)", False
        return "a JSON array whose elements are not trace events", False
    if text[:1] == b"{":
        key = re.match(rb'\{\s*"([^"]{0,80})"', text)
        first = key.group(1).decode("utf-8", "replace") if key else "?"
        hint = " (rocprofiler-sdk output)" if "rocprofiler" in first else ""
        return f"a JSON object with no traceEvents array (first key {first!r}){hint}", False
    return f"not JSON (starts with {text[:16]!r})", True


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
# Where decoding picks up after a damaged event: the end of an object followed by the next event
# or by the end of the events array.
_EVENT_END = re.compile(rb"\}\s*(?:,\s*\{|\])")
# A `]` that closes the events array: the enclosing object goes on or ends, or the file ends (the
# 2020 format is a bare array); not one inside a damaged event, which more events follow.
_ARRAY_END = re.compile(rb"\](?![\s}]*,\s*\{)\s*(?:\}|,\s*\"|$)")
_SEPARATOR = re.compile(rb"\s*,?\s*")
_ERROR_OFFSET = re.compile(r"\(byte (\d+)\)")
# A syntax error this close to the end of the bytes read so far may just be an event that goes on.
_NEAR_END = 1024


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


def _at_array_end(buf: bytes, pos: int) -> bool:
    """Whether the `]` at pos closes traceEvents. After a damaged event decoding may resume inside it,
    where a `]` can look like the end too; but no trace event (no "ph") follows the real end."""
    return _ARRAY_END.match(buf, pos) is not None and buf.find(b'"ph"', pos, pos + CHUNK_BYTES) < 0


def _error_offset(error: msgspec.DecodeError) -> int | None:
    """Where msgspec stopped (the byte after the offending one); None when the input just ended."""
    m = _ERROR_OFFSET.search(str(error))
    return int(m.group(1)) if m else None


class _ChunkReader:
    """Yields lists of decoded events from the traceEvents array of a stream.

    A damaged event costs that event only: decoding resumes at the next event boundary, and the
    skipped events are counted by reason in `skipped`. No more than MAX_EVENT_BYTES is held for one
    event, or for the text around the events array, whatever the file holds.
    """

    def __init__(self, stream: _Stream):
        self.stream = stream
        self.blocks = stream.blocks()
        self.buf = b""
        self.eof = False
        self.header = b""  # everything before the events array
        self.trailer = b""  # everything after it, up to MAX_EVENT_BYTES
        self.trailer_dropped = 0  # bytes after that, not kept
        self.trailer_dropped_junk = False  # whether any of them is more than zero padding or blanks
        self.skipped: dict[str, list] = {}  # reason -> [events, first example]
        self.truncated: str | None = None  # why the events array never closed

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

    def _skip(self, reason: str, example: str) -> None:
        entry = self.skipped.setdefault(reason, [0, example])
        entry[0] += 1

    def _find_array_start(self) -> None:
        self._fill(SNIFF_BYTES)
        if not sniff(self.buf[:SNIFF_BYTES]):
            if not self.buf and self.stream.truncated:
                raise NotATrace(self.stream.truncated, damaged=True)
            raise NotATrace(*_describe_non_trace(self.buf[:4096]))
        text = self.buf.lstrip()
        if text[:1] == b"[":
            start = len(self.buf) - len(text) + 1
        else:
            while True:
                m = re.search(rb'"traceEvents"\s*:\s*\[', self.buf)
                if m or self.eof or len(self.buf) > MAX_EVENT_BYTES:
                    break
                self._fill(len(self.buf) + CHUNK_BYTES)
            if not m:
                raise self._no_events_array()
            start = m.end()
        self.header = self.buf[: start - 1]
        self.buf = self.buf[start:]

    def _no_events_array(self) -> NotATrace:
        """A whole JSON object without traceEvents is another format; one cut short is a damaged trace."""
        if len(self.buf) > MAX_EVENT_BYTES:
            return NotATrace(f"no traceEvents array in the first {MAX_EVENT_BYTES >> 20} MiB", damaged=True)
        try:
            msgspec.json.decode(self.buf)
        except (msgspec.DecodeError, RecursionError):
            return NotATrace("a trace cut short (or damaged) before its traceEvents array", damaged=True)
        return NotATrace(_describe_non_trace(self.buf[:4096])[0], damaged=False)

    def events(self) -> Iterator[list[_Event]]:
        self._find_array_start()
        want = CHUNK_BYTES
        while True:
            self._fill(want)
            skip = _SEPARATOR.match(self.buf).end()
            if skip:
                self.buf = self.buf[skip:]
            if _at_array_end(self.buf, 0):  # empty array, or the end after the last chunk
                self._finish(1)
                return
            limit = len(self.buf) if self.eof else min(len(self.buf), want)
            events, consumed, ended = self._decode_prefix(limit)
            self.buf = self.buf[consumed:]
            if events:
                yield events
            if ended:
                self._finish(0)
                return
            if consumed:
                want = CHUNK_BYTES
            elif self.eof:
                if not self.truncated:  # (_skip_oversized may have said why already)
                    self.truncated = "JSON ends in the middle of traceEvents (file cut short)"
                    if self.buf and _is_padding(self.buf.replace(b",", b"")):
                        self.truncated += f", followed by {len(self.buf)} zero or blank bytes"
                return
            elif want >= MAX_EVENT_BYTES:
                self._skip_oversized()
                want = CHUNK_BYTES
            else:
                want *= 2  # one event larger than the window: widen it

    def _decode_prefix(self, limit: int) -> tuple[list[_Event], int, bool]:
        """Decode the whole events in buf[:limit]: (events, bytes consumed, whether the array ended).

        The fast path decodes them as one array; when that fails, the sound events before the
        failure are still decoded at once and the rest one by one (`_decode_one_by_one`)."""
        buf = self.buf
        pos = _last_event_end(buf, limit)
        if pos < 0:
            return self._decode_one_by_one([], 0, limit)
        candidate = b"[" + buf[: pos + 1] + b"]"
        try:
            return _EVENTS.decode(candidate), pos + 1, False
        except msgspec.ValidationError:
            try:  # some element has an unexpected shape: the sound ones are kept
                return self._decode_each(candidate), pos + 1, False
            except (msgspec.DecodeError, RecursionError):  # and a later one is not JSON, or too deep
                return self._decode_one_by_one([], 0, limit)
        except RecursionError:
            return self._decode_one_by_one([], 0, limit)
        except msgspec.DecodeError as e:
            offset, message = _error_offset(e), str(e)
        if offset is None:
            return self._decode_one_by_one([], 0, limit)
        if "trailing characters" in message:  # the events array closed inside this prefix
            end = candidate.rfind(b"]", 0, offset)
            try:
                return _EVENTS.decode(candidate[: end + 1]), end, True
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                return self._decode_one_by_one([], 0, limit)
        # The events before the one holding the error are sound: decode them in one go.
        error_at = offset - 2  # msgspec counts past the offending byte, and candidate starts with "["
        before = None
        for before in _BETWEEN_EVENTS.finditer(buf, max(0, error_at - (1 << 20)), max(0, error_at)):
            pass
        if before is not None:
            try:
                sound = _EVENTS.decode(b"[" + buf[: before.start() + 1] + b"]")
                return self._decode_one_by_one(sound, before.start() + 1, limit)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                pass
        return self._decode_one_by_one([], 0, limit)

    def _decode_each(self, candidate: bytes) -> list[_Event]:
        events = []
        for raw in _RAW_LIST.decode(candidate):
            try:
                events.append(_EVENT.decode(raw))
            except msgspec.ValidationError as e:
                self._skip("malformed_event", f"{e}: {bytes(raw)[:120]!r}")
        return events

    def _decode_one_by_one(self, events: list, pos: int, limit: int) -> tuple[list[_Event], int, bool]:
        """Decode events starting before `limit` one at a time, skipping damaged ones."""
        buf, view = self.buf, memoryview(self.buf)
        while True:
            pos = _SEPARATOR.match(buf, pos).end()
            if pos >= limit:
                return events, pos, False
            if _at_array_end(buf, pos):
                return events, pos + 1, True
            found = self._next_event(view, pos)
            if found is None:  # it goes on past the bytes read so far
                return events, pos, False
            end, event = found
            if event is not None:
                events.append(event)
            pos = end

    def _next_event(self, view: memoryview, pos: int) -> tuple[int, _Event | None] | None:
        """The event at `pos` and where it ends (event None when it was skipped as damaged), or None
        when it may go on past the bytes read so far."""
        if view[pos] != 0x7B:  # not an event: junk between events (a stray comma, zeros) up to the next one
            start = self.buf.find(b"{", pos)
            if start < 0:
                return None
            self._skip("malformed_event", f"bytes between events: {bytes(view[pos:min(start, pos + 60)])!r}")
            return start, None
        try:
            _RAW.decode(view[pos:])
            end = len(view)
        except msgspec.DecodeError as e:
            offset = _error_offset(e)
            if offset is None:  # the input ended inside the event
                return None
            if "trailing characters" in str(e):
                end = pos + offset - 1
            elif not self.eof and pos + offset + _NEAR_END >= len(view):
                return None
            else:
                return self._resync(pos, pos + offset - 1, "malformed_event", f"{e}: {bytes(view[pos:pos + 120])!r}")
        except RecursionError:
            return self._resync(pos, pos + 1, "nesting_too_deep", f"{bytes(view[pos:pos + 120])!r}")
        try:
            return end, _EVENT.decode(view[pos:end])
        except msgspec.ValidationError as e:
            self._skip("malformed_event", f"{e}: {bytes(view[pos:pos + 120])!r}")
        except RecursionError:
            self._skip("nesting_too_deep", f"{bytes(view[pos:pos + 120])!r}")
        return end, None

    def _resync(self, pos: int, error_at: int, reason: str, example: str) -> tuple[int, None] | None:
        """Skip the damaged event at `pos` to the next event boundary after `error_at`."""
        m = _EVENT_END.search(self.buf, max(pos, error_at))
        if m is None:  # no boundary in the bytes read so far
            return None
        self._skip(reason, example)
        return m.start() + 1, None

    def _skip_oversized(self) -> None:
        """No whole event in MAX_EVENT_BYTES (an unterminated string, a runaway value, zeros where the
        file was cut): drop bytes up to the next event boundary, holding at most MAX_EVENT_BYTES +
        CHUNK_BYTES."""
        example = f"{self.buf[:120]!r}"
        dropped, padding = 0, True
        searched = 1
        while True:
            m = _EVENT_END.search(self.buf, searched)
            if m is not None:
                self.buf = self.buf[m.start() + 1 :]
                self._skip("oversized_event", example)
                return
            padding = padding and _is_padding(self.buf)
            if self.eof:
                dropped += len(self.buf)
                self.buf = b""
                self.truncated = (f"JSON ends in the middle of traceEvents (file cut short), followed by {dropped} zero "
                                  "or blank bytes" if padding else f"JSON ends inside an event larger than "
                                  f"{MAX_EVENT_BYTES >> 20} MiB (file cut short?)")
                return
            dropped += len(self.buf) - 64
            self.buf = self.buf[-64:]  # a boundary may straddle two blocks
            searched = 0
            self._fill(CHUNK_BYTES)

    def _finish(self, after_array: int) -> None:
        """Keep the text after the events array (the rest of the metadata), up to MAX_EVENT_BYTES."""
        parts, size = [self.buf[after_array:]], len(self.buf) - after_array
        for block in self.blocks:
            if size < MAX_EVENT_BYTES:
                parts.append(block)
            else:
                self.trailer_dropped += len(block)
                self.trailer_dropped_junk = self.trailer_dropped_junk or not _is_padding(block)
            size += len(block)
        self.trailer = b"".join(parts)
        self.buf = b""
        self.eof = True

    def metadata(self, issues: list[Issue]) -> dict:
        """Top-level keys other than traceEvents (deviceProperties, distributedInfo, base time...).

        Text after the document is reported (zero padding or garbage), and metadata nested too deep
        to decode keeps the keys steplens reads that are not themselves too deep."""
        if not self.header.strip():  # 2020 array format: no metadata at all
            self._report_after_document(self.trailer, issues)
            return {}
        doc = self.header + b"[]" + self.trailer
        try:
            value = _JSON.decode(doc)
        except RecursionError:
            issues.append(Issue("warning", "nesting_too_deep", 1, "trace metadata nested deeper than the decoder "
                                "allows; kept only the top-level keys steplens reads that decode"))
            value = _metadata_by_key(doc)
        except msgspec.DecodeError as e:
            offset = _error_offset(e)
            if offset is not None and "trailing characters" in str(e):
                self._report_after_document(doc[offset - 1 :], issues)
                value = _decode_or_none(doc[: offset - 1])
            else:  # the metadata after the events array is cut short (or too big); keep what came before it
                value = _decode_or_none(self.header + b"[]}")
                if self.trailer_dropped:
                    issues.append(Issue("warning", "oversized_metadata", 1, f"the text after traceEvents is over "
                                        f"{MAX_EVENT_BYTES >> 20} MiB and is not valid JSON within that; not read"))
                elif not (self.truncated or self.stream.truncated):
                    issues.append(Issue("error", "truncated", 1, "file cut short after the last event: the metadata "
                                        "written after traceEvents (baseTimeNanoseconds, ...) is lost"))
        else:
            self._report_after_document(b"", issues)
        return value if isinstance(value, dict) else {}

    def _report_after_document(self, text: bytes, issues: list[Issue]) -> None:
        _report_trailing(text, self.trailer_dropped, self.trailer_dropped_junk, "the JSON document", issues)


def _is_padding(data: bytes) -> bool:
    """Only zeros and blanks (counting zeros first: much faster than strip on a long run of them)."""
    return data.count(0) == len(data) or not data.strip(b"\0 \t\r\n")


def _report_trailing(text: bytes, more_bytes: int, more_junk: bool, after: str, issues: list[Issue]) -> None:
    """Bytes after the end of the data (`text`, then `more_bytes` not kept): zero padding or garbage."""
    junk = b"" if _is_padding(text) else text.strip(b" \t\r\n\0")
    size = len(text) + more_bytes
    if junk or more_junk:
        issues.append(Issue("warning", "trailing_garbage", size, f"bytes after the end of {after} ignored, e.g. {junk[:60]!r}"))
    elif b"\0" in text or more_bytes:
        issues.append(Issue("info", "zero_padding", size, f"zero bytes after the end of {after} (a preallocated file?); ignored"))


_JSON = msgspec.json.Decoder()
_RAW = msgspec.json.Decoder(msgspec.Raw)
# The top-level keys steplens reads (ingest's trace facts and the base time).
METADATA_KEYS = ("schemaVersion", "distributedInfo", "deviceProperties", "computeProperties", "baseTimeNanoseconds",
                 "cuda_runtime_version", "cuda_driver_version", "displayTimeUnit")


def _decode_or_none(doc: bytes):
    try:
        return _JSON.decode(doc)
    except (msgspec.DecodeError, RecursionError):
        return None


def _metadata_by_key(doc: bytes) -> dict:
    """Each key of METADATA_KEYS at its first `"key":` in the text, decoded on its own."""
    found = {}
    for key in METADATA_KEYS:
        m = re.search(rb'"' + key.encode() + rb'"\s*:\s*', doc)
        if m is None:
            continue
        try:
            found[key] = _JSON.decode(doc[m.end():])
        except msgspec.DecodeError as e:
            offset = _error_offset(e)
            if offset is not None and "trailing characters" in str(e):
                value = _decode_or_none(doc[m.end() : m.end() + offset - 1])
                if value is not None:
                    found[key] = value
        except RecursionError:
            continue
    return found


# ---------------------------------------------------------------------------------------------
# Columns


# Values beyond these bounds are damage, not measurements; they are stored as null and counted.
# Times are int64 ns: bounding |ts| and |dur| by 2**62 ns (146 years; epoch ns today are 1.8e18)
# keeps ts + dur and ts + baseTimeNanoseconds inside int64, so no end time can wrap.
TIME_LIMIT_NS = 2**62
# A collective's element count: 2**48 elements (4.5 PB at 16 bytes) is beyond any device's memory,
# and keeps byte counts (x the element size) and their sums over many calls inside int64.
MAX_MESSAGE_NELEMS = 2**48
MAX_MEMORY_BYTES = 2**48  # a [memory] event's allocation size (negative for a free)
MAX_STEP = 2**31 - 1  # ProfilerStep numbers; a step counter past 2 billion is damage
# Longest integer text parsed (int64 has 19 digits); longer strings are not parsed at all.
_MAX_INT_DIGITS = 20


def _int_column(values: list, dtype=pa.int64(), bounds: tuple[int, int] | None = None) -> tuple[pa.Array, int, str]:
    """Values as an integer array; numeric strings are parsed, anything else becomes null, and so
    does a value outside `bounds` (inclusive).

    Returns the array, how many non-null values could not be represented, and an example of one.
    """
    # Inferred first: converting straight to an integer type would truncate a 3.5 to 3 unnoticed.
    try:
        inferred = pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
        inferred = None
    exact = None
    if inferred is not None and inferred.type == pa.null():
        exact = pa.nulls(len(values), dtype)
    elif inferred is not None and pa.types.is_integer(inferred.type):
        exact = _cast_exactly(inferred, dtype)
    if exact is not None:
        array, bad, example = exact, 0, ""
    else:  # strings, floats, booleans or numbers beyond int64 among them: value by value
        array, bad, example = _int_column_slowly(values, dtype)
    if bounds is not None:
        outside = pc.fill_null(pc.invert(pc.and_(pc.greater_equal(array, bounds[0]), pc.less_equal(array, bounds[1]))), False)
        n_outside = pc.sum(outside).as_py() or 0
        if n_outside:
            example = example or preview(pc.filter(array, outside)[0].as_py())
            array = pc.if_else(outside, pa.scalar(None, dtype), array)
            bad += n_outside
    return array, bad, example


def _cast_exactly(array: pa.Array, dtype) -> pa.Array | None:
    try:
        return array.cast(dtype)  # a safe cast: None rather than a wrapped value
    except (pa.ArrowInvalid, OverflowError):
        return None


def _int_column_slowly(values: list, dtype) -> tuple[pa.Array, int, str]:
    lo, hi = (0, 2**64 - 1) if dtype == pa.uint64() else (-(2**63), 2**63 - 1)
    out = [v if type(v) is int and lo <= v <= hi else None for v in values]
    bad, example = 0, ""
    for i in [i for i, v in enumerate(values) if out[i] is None and v is not None]:
        out[i] = _coerce_int(values[i], lo, hi)
        # Non-numeric labels ("Spans", "PyTorch Profiler") are names, not damaged numbers.
        if out[i] is None and not (isinstance(values[i], str) and not values[i].lstrip("-").isdigit()):
            bad += 1
            example = example or preview(values[i])
    return pa.array(out, type=dtype), bad, example


def _coerce_int(value, lo: int, hi: int) -> int | None:
    """Numeric strings (and Kineto's legacy "stream 7" tids) become ints; the rest None."""
    if isinstance(value, str):
        digits = value.removeprefix("stream ").strip()
        numeric = digits.lstrip("-").isdigit() and digits.isascii() and len(digits) <= _MAX_INT_DIGITS
        value = int(digits) if numeric else None
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if type(value) is int and lo <= value <= hi else None


def preview(value) -> str:
    """A short, printable rendering of a value from a trace (repr escapes control characters)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, (list, dict)):
        return f"a {type(value).__name__} of {len(value)} items"
    return repr(value)[:80]


def _str_column(values: list, count_bad=None, lists_as_json: bool = False) -> pa.Array:
    """Strings; numbers become their text, anything else (a list where a name belongs) null, or
    with `lists_as_json` its compact JSON text."""
    try:
        return pa.array(values, type=pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        pass
    out = [v if v is None or isinstance(v, str) else str(v) if _is_number(v) else
           _json_text(v) if lists_as_json and isinstance(v, list) else None for v in values]
    _count_nulled(values, out, count_bad)
    return pa.array(out, type=pa.string())


def _json_text(value: list) -> str | None:
    try:
        return msgspec.json.encode(value).decode()
    except (TypeError, OverflowError, RecursionError):
        return None


def _is_number(value) -> bool:
    return isinstance(value, float) or isinstance(value, int) and value.bit_length() <= 64


def _float_column(values: list, count_bad=None) -> pa.Array:
    """Finite, non-negative numbers (counts such as FLOPs); anything else null."""
    try:
        array = pa.array(values, type=pa.float64())
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        array = pa.array([_finite(v) for v in values], type=pa.float64())
    valid = pc.fill_null(pc.and_(pc.is_finite(array), pc.greater_equal(array, 0)), False)
    array = pc.if_else(valid, array, pa.scalar(None, pa.float64()))
    if len(values) - values.count(None) != len(array) - array.null_count:
        _count_nulled(values, array.to_pylist(), count_bad)
    return array


def _finite(value) -> float | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _count_nulled(values: list, out: list, count_bad) -> None:
    """Count the values that became null (and show one), when the caller wants to know."""
    nulled = [v for v, o in zip(values, out) if o is None and v is not None]
    if nulled and count_bad is not None:
        count_bad(len(nulled), preview(nulled[0]))


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
_MAX_WHOLE_US = TIME_LIMIT_NS // 1000 - 1
# A JSON number in exponent form, or quoted: short enough to convert exactly and cheaply (a
# Decimal of 1e999999 takes seconds and then overflows).
_NUMBER_TEXT = re.compile(r'^"?(-?\d{1,30}(?:\.\d{1,30})?(?:[eE][+-]?\d{1,3})?)"?$')
_EXACT = decimal.Context(prec=100)


def microseconds_text_to_ns(text: pl.Series) -> tuple[pl.Series, int]:
    """Exact µs decimal text -> integer ns (digits past the third decimal are sub-ns and dropped).

    Values that are not JSON numbers, or beyond ±TIME_LIMIT_NS, become null. Returns the ns series
    and how many non-empty values became null.
    """
    frame = pl.DataFrame({"t": text})
    parts = pl.col("t").str.split_exact(".", 1)
    whole = parts.struct.field("field_0").cast(pl.Int64, strict=False)
    frac = parts.struct.field("field_1").fill_null("").str.pad_end(3, "0").str.slice(0, 3).cast(pl.Int64, strict=False)
    signed_frac = pl.when(pl.col("t").str.starts_with("-")).then(-frac).otherwise(frac)
    plain = pl.col("t").str.contains(_DECIMAL)
    frame = frame.with_columns(
        ns=pl.when(plain & whole.is_between(-_MAX_WHOLE_US, _MAX_WHOLE_US)).then(whole * 1000 + signed_frac),
        odd=pl.col("t").is_not_null() & ~plain,
    )
    ns = frame["ns"]
    if frame["odd"].any():  # exponents or quoted numbers: rare, exact via Decimal
        ns = pl.Series([_decimal_us_to_ns(t) if o else v for t, o, v in
                        zip(frame["t"].to_list(), frame["odd"].to_list(), ns.to_list())], dtype=pl.Int64)
    return ns, int((text.is_not_null() & ns.is_null()).sum())


def _decimal_us_to_ns(text: str) -> int | None:
    m = _NUMBER_TEXT.match(text)
    if m is None:
        return None
    ns = int(_EXACT.multiply(Decimal(m.group(1)), 1000))
    return ns if -TIME_LIMIT_NS <= ns <= TIME_LIMIT_NS else None


def _columns(events: list[_Event], counters: dict[str, list]) -> pl.DataFrame:
    args = [e.args or _NO_ARGS for e in events]

    def count_bad(column: str):
        def add(n: int, example: str) -> None:
            entry = counters.setdefault(column, [0, example])
            entry[0] += n
        return add

    def ints(values, column, dtype=pa.int64(), bounds=None):
        array, bad, example = _int_column(values, dtype, bounds)
        if bad:
            count_bad(column)(bad, example)
        return array

    def strs(values, column, lists_as_json=False):
        return _str_column(values, count_bad(column), lists_as_json)

    n = len(events)
    # Collective args sit on a handful of events: read them only there.
    comm_rows = [i for i, a in enumerate(args) if a.collective is not None or a.seq is not None or a.comms_id is not None]

    def comm(name: str) -> list:
        values = [None] * n
        for i in comm_rows:
            values[i] = getattr(args[i], name)
        return values

    nelems = (0, MAX_MESSAGE_NELEMS)
    dims = [a.input_dims or a.input_dims_legacy for a in args]
    columns = {
        "ph": strs([e.ph for e in events], "ph"),
        "cat": strs([e.cat for e in events], "cat"),
        "name": strs([e.name for e in events], "name"),
        "pid": ints([e.pid for e in events], "pid"),
        "tid": ints([e.tid for e in events], "tid"),
        "ts_text": _raw_column([e.ts for e in events]),
        "dur_text": _raw_column([e.dur for e in events]),
        "flow_id": ints([e.id for e in events], "id"),
        "arg_stream": ints([a.stream for a in args], "stream"),
        "arg_device": ints([a.device for a in args], "device"),
        "correlation": ints([a.correlation for a in args], "correlation"),
        "external_id": ints([a.external_id for a in args], "External id"),
        "collective": strs(comm("collective"), "Collective name"),
        "in_nelems": ints(comm("in_nelems"), "In msg nelems", bounds=nelems),
        "out_nelems": ints(comm("out_nelems"), "Out msg nelems", bounds=nelems),
        "dtype": strs(comm("dtype"), "dtype"),
        "group_size": ints(comm("group_size"), "Group size", bounds=(1, schema.MAX_RANK)),
        "group_name": strs(comm("group_name"), "Process Group Name"),
        "group_desc": strs(comm("group_desc"), "Process Group Description"),
        "group_ranks": strs(comm("group_ranks"), "Process Group Ranks", lists_as_json=True),
        "seq": ints(comm("seq"), "Seq"),
        "comms_id": ints(comm("comms_id"), "Comms Id", pa.uint64()),
        "src_rank": ints(comm("src_rank"), "Src Rank"),
        "dst_rank": ints(comm("dst_rank"), "Dst Rank"),
        "input_dims": _raw_column(dims),
        "input_types": _raw_column([a.input_types for a in args]),
        "concrete_inputs": _raw_column([a.concrete_inputs for a in args]),
        "bytes": ints([a.nbytes if a.nbytes is not None else a.memory_bytes for a in args], "bytes",
                      bounds=(-MAX_MEMORY_BYTES, MAX_MEMORY_BYTES)),
        "flops": _float_column([a.flops for a in args], count_bad("flops")),
    }
    return pl.from_arrow(pa.table(columns))


# ---------------------------------------------------------------------------------------------
# Normalization


def _normalize(raw: pl.DataFrame, base_ns: int, issues: list[Issue]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Split raw rows into trace events (X/i) and flow endpoints (s/f/t), with exact ns times."""
    ts, _ = microseconds_text_to_ns(raw["ts_text"])
    dur, _ = microseconds_text_to_ns(raw["dur_text"])
    if base_ns and (ts.median() or 0) >= ABSOLUTE_NS_THRESHOLD:
        issues.append(Issue("info", "absolute_ts_with_base", 1, "ts already absolute; baseTimeNanoseconds not added"))
        base_ns = 0
    raw = raw.with_columns(ts_ns=ts, dur_ns=dur)
    bad_durations = _report_bad_times(raw, base_ns, issues)
    in_range = pl.col("ts_ns").is_between(-TIME_LIMIT_NS - base_ns, TIME_LIMIT_NS - base_ns)
    raw = raw.with_columns(ts_ns=pl.when(in_range).then(pl.col("ts_ns") + base_ns)).drop("ts_text", "dur_text")

    phase = pl.col("ph")
    is_event = phase.is_in(["X", "i", "I"]) & pl.col("ts_ns").is_not_null()
    is_flow = phase.is_in(["s", "f", "t"]) & pl.col("ts_ns").is_not_null()
    counts = raw.group_by("ph").len()
    ignored = counts.filter(~pl.col("ph").is_in(["X", "i", "I", "s", "f", "t", "M"]) | pl.col("ph").is_null())
    for ph, n in ignored.iter_rows():
        issues.append(Issue("info", "unsupported_phase", n, f"events with ph={ph!r} are not complete/instant/flow events; skipped"))
    no_dur = raw.filter((phase == "X") & pl.col("dur_ns").is_null()).height - bad_durations
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


_TIMED_PHASES = ["X", "i", "I", "s", "f", "t"]
_YEARS_LIMIT = TIME_LIMIT_NS // (365 * 86400 * 10**9)


def _report_bad_times(raw: pl.DataFrame, base_ns: int, issues: list[Issue]) -> int:
    """Count, with an example, the events whose ts is missing or damaged (they are dropped) and the
    complete events whose dur is damaged (kept without a duration). Returns the latter count."""
    timed = pl.col("ph").is_in(_TIMED_PHASES)
    ts_ok = pl.col("ts_ns").is_between(-TIME_LIMIT_NS - base_ns, TIME_LIMIT_NS - base_ns).fill_null(False)
    beyond = f"not numbers or beyond {_YEARS_LIMIT} years from the epoch"
    checks = {
        "missing_timestamp": (timed & pl.col("ts_text").is_null(), "ts_text",
                              "complete, instant or flow events without ts were dropped"),
        "bad_timestamp": (timed & pl.col("ts_text").is_not_null() & ~ts_ok, "ts_text",
                          f"ts values that are {beyond} (with baseTimeNanoseconds); those events were dropped"),
        "bad_duration": ((pl.col("ph") == "X") & pl.col("dur_text").is_not_null() & pl.col("dur_ns").is_null(), "dur_text",
                         f"dur values that are {beyond}; those events are kept without a duration"),
    }
    counts = raw.select(**{reason: mask.sum() for reason, (mask, _, _) in checks.items()}).row(0, named=True)
    for reason, (mask, column, what) in checks.items():
        if counts[reason]:
            name, value = raw.filter(mask).select("name", column).row(0)
            issues.append(Issue("warning", reason, counts[reason], f"{what}, e.g. {name!r:.80} {column[:-5]}={value!r:.60}"))
    return counts["bad_duration"]


def _steps(events: pl.DataFrame, issues: list[Issue]) -> pl.DataFrame:
    marked = events.filter(
        pl.col("name").str.starts_with("ProfilerStep#")
        & pl.col("dur_ns").is_not_null()
        & ~pl.col("kind").is_in(schema.DEVICE_KINDS)
    ).with_columns(digits=pl.col("name").str.extract(STEP_NAME.pattern))
    number = pl.col("digits").cast(pl.Int64, strict=False)
    damaged = marked.filter(pl.col("digits").is_not_null() & ~number.is_between(0, MAX_STEP).fill_null(False))
    if damaged.height:
        issues.append(Issue("warning", "bad_step_number", damaged.height, f"ProfilerStep numbers above {MAX_STEP} "
                            f"are damage, not steps; those events are kept as plain events, e.g. {damaged['name'][0]!r:.80}"))
    steps = (
        marked.filter(number.is_between(0, MAX_STEP))
        .select(
            step=number,
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
    counters: dict[str, list] = {}
    # Decoded events hold no reference cycles; collecting garbage over them only costs time.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        chunks = [_columns(events, counters) for events in reader.events()]
    except NotATrace as e:
        # Text that is not JSON only damages a file whose name says it is JSON (not a .tar.gz).
        e.damaged = e.damaged and path.name.endswith((".json", ".json.gz"))
        raise
    finally:
        if gc_was_enabled:
            gc.enable()
    issues: list[Issue] = []
    metadata = reader.metadata(issues)
    if stream.truncated or reader.truncated:
        why = stream.truncated or reader.truncated
        issues.append(Issue("error", "truncated", 1, f"{why}; kept every complete event before the cut"))
    if stream.trailing_bytes:
        _report_trailing(b"", stream.trailing_bytes, not stream.trailing_zeros, "the gzip data", issues)
    for reason, (n, example) in sorted(reader.skipped.items()):
        issues.append(Issue("warning", reason, n, f"{_SKIPPED[reason]}; decoding resumed at the next event, e.g. {example}"))
    for column, (n, example) in sorted(counters.items()):
        issues.append(Issue("warning", "unrepresentable_value", n,
                            f"'{column}' values that are not in range for their meaning; stored as null, e.g. {example}"))

    raw = pl.concat(chunks, how="vertical_relaxed", rechunk=False) if chunks else _columns([], counters)
    del chunks  # each stage drops its input as soon as it is done: peak memory is about two copies
    _return_freed_memory()
    base_ns = _base_time_ns(metadata, issues)
    events, endpoints = _normalize(raw, base_ns, issues)
    del raw
    steps = _steps(events, issues)
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


_SKIPPED = {
    "malformed_event": "events that are not valid JSON or have an unexpected shape were skipped",
    "nesting_too_deep": "events nested deeper than the decoder allows were skipped",
    "oversized_event": f"events larger than {MAX_EVENT_BYTES >> 20} MiB (an unterminated string?) were skipped",
}


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


def _base_time_ns(metadata: dict, issues: list[Issue]) -> int:
    base = metadata.get("baseTimeNanoseconds")
    if isinstance(base, float) and base.is_integer():
        base = int(base)
    if base is None or type(base) is int and 0 <= base <= TIME_LIMIT_NS:
        return base or 0
    issues.append(Issue("warning", "bad_base_time", 1, f"baseTimeNanoseconds {preview(base)} is not a time within "
                        f"{_YEARS_LIMIT} years of the epoch; ignored, so ts are taken as written (this rank cannot "
                        "be aligned with the others)"))
    return 0
