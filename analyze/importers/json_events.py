"""The events of a Chrome/Kineto trace file, decoded in bounded chunks whatever the file holds.

The (gzip) stream is read in blocks of at most CHUNK_BYTES, and the traceEvents array is decoded a
window of whole events at a time into msgspec structs, so memory stays a small multiple of the chunk
size. Damage costs what it damages: a truncated file yields every complete event before the cut; an
event that is not JSON, has the wrong shape, nests deeper than the decoder allows or is larger than
MAX_EVENT_BYTES is skipped and counted, and decoding resumes at the next event; bytes after the data
(zero padding, garbage) and further gzip members are told apart from a truncation.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import re
import threading
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import msgspec

from steplens.analyze.contract.issue_reasons import Issue  # noqa: F401 - importers take it from here too
from steplens.analyze.contract.traces import NotATrace
from isal import isal_zlib

CHUNK_BYTES = 2 << 20
SNIFF_BYTES = 1 << 20
# Memory bound for one event and for the text around the events array: no real event comes near it
# (the largest in the corpus is a few kB); beyond it the bytes are skipped to the next event.
MAX_EVENT_BYTES = 32 << 20
GZIP_MAGIC = b"\x1f\x8b"
UTF8_BOM = b"\xef\xbb\xbf"


@functools.cache
def _decoders(event_type: type) -> tuple[msgspec.json.Decoder, msgspec.json.Decoder]:
    """Decoders for a list of events and for one event."""
    return msgspec.json.Decoder(list[event_type]), msgspec.json.Decoder(event_type)


_RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])
_KEYED_LIST = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])
_ENCODER = msgspec.json.Encoder()


# ---------------------------------------------------------------------------------------------
# Byte stream


class ByteStream:
    """Decompressed bytes of a .json or .json.gz file, block by block, surviving truncation.

    Blocks are at most CHUNK_BYTES however well the data compresses (a 6 MB gzip can hold 1.5 GB),
    further gzip members are read, and bytes after the last member that are not one are counted
    (`trailing_bytes`, `trailing_zeros`), not taken for a damaged member."""

    def __init__(self, path: Path):  # or an fsspec OpenFile (an object in object storage), read the same way
        self.path = path
        self.truncated: str | None = None
        self.raw_bytes = 0
        self.trailing_bytes = 0
        self.trailing_zeros = False

    def blocks(self) -> Iterator[bytes]:
        with open(self.path, "rb") if isinstance(self.path, (str, os.PathLike)) else self.path.open() as f:
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
        size = getattr(f, "size", None)  # an fsspec file knows its object's size; a local one has fstat
        self.trailing_bytes = (os.fstat(f.fileno()).st_size if size is None else size) - f.tell() + len(first)
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
        if not re.match(rb'\{\s*("|\}|$)', text):  # a JSON object's first key, its end, or more to read
            return f"not JSON (starts with {text[:16]!r})", True
        key = re.match(rb'\{\s*"([^"]{0,80})"', text)
        first = key.group(1).decode("utf-8", "replace") if key else "?"
        hint = " (rocprofiler-sdk output)" if "rocprofiler" in first else ""
        return f"a JSON object with no traceEvents array (first key {first!r}){hint}", False
    return f"not JSON (starts with {text[:16]!r})", True


def sniff(head: bytes) -> bool:
    """True when the first bytes of a (decompressed) file look like a Chrome/Kineto trace."""
    text = head.removeprefix(UTF8_BOM).lstrip()
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
_ELEMENT_FOLLOWS = re.compile(rb"\s*[,\]]")
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


def _through_array_end(decoder: msgspec.json.Decoder, candidate: bytes, error: msgspec.DecodeError) -> tuple | None:
    """When `error` says the events array closed inside `candidate` (`[` + a prefix of the buffer + `]`:
    sound JSON up to the array's `]`, more after it), the events before that `]` decoded by `decoder`, with
    the buffer offset just past it and True; else None."""
    offset = _error_offset(error)
    if offset is None or "trailing characters" not in str(error):
        return None
    end = candidate.rfind(b"]", 0, offset)
    try:
        return decoder.decode(candidate[: end + 1]), end, True
    except (msgspec.DecodeError, RecursionError):  # (ValidationError included)
        return None


def _error_offset(error: msgspec.DecodeError) -> int | None:
    """msgspec's byte offset: the offending byte, or the one after it for "trailing characters";
    None when the input just ended."""
    m = _ERROR_OFFSET.search(str(error))
    return int(m.group(1)) if m else None


# Decompressed blocks a reader's stream is read ahead of its decoder (4 MiB at CHUNK_BYTES): two hide gunzip
# as well as four did, at 11 MiB more peak memory for one mtia_rank_0 instead of 23 (the reading thread's heap).
READ_AHEAD_BLOCKS = 2
_END = object()


class ReadAhead:
    """An iterator over `blocks` (a ByteStream's) produced on a thread of its own, up to `depth` blocks ahead of
    the consumer. Gunzip and file or object-storage reads release the GIL, and so does the native columnizer,
    so they overlap: one mtia_rank_0 decoded in 0.31 s instead of 0.39, an A100 rank in 0.17 instead of 0.23
    (medians of 8 interleaved); two processes decoding at once on 2 cores were no slower. The stream's
    attributes (truncated, raw_bytes, trailing_bytes) are whole once the iterator is exhausted. An error of the
    producer is raised to the consumer at the block where it happened; close() (or the iterator being
    dropped) stops the thread, and close() waits for it."""

    def __init__(self, blocks: Iterator[bytes], depth: int = READ_AHEAD_BLOCKS):
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._done = False
        # The thread holds the queue and the event, not this object: a reader dropped unclosed is collected,
        # and its __del__ stops the thread.
        self._thread = threading.Thread(target=_produce, args=(blocks, self._queue, self._stop),
                                        name="steplens-read-ahead", daemon=True)
        self._thread.start()

    def __iter__(self) -> "ReadAhead":
        return self

    def __next__(self) -> bytes:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END or isinstance(item, BaseException):
            self._done = True
            self._thread.join()
            if item is _END:
                raise StopIteration
            raise item
        return item

    def close(self) -> None:
        self._done = True
        self._stop.set()
        self._thread.join()

    def __del__(self) -> None:
        self._stop.set()


def _produce(blocks: Iterator[bytes], handoff: queue.Queue, stop: threading.Event) -> None:
    """ReadAhead's thread: each block, then _END or the error that ended the stream, until told to stop."""

    def put(item) -> bool:
        while not stop.is_set():
            try:
                handoff.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    try:
        for block in blocks:
            if not put(block):
                return
        put(_END)
    except BaseException as e:  # raised again in the consumer
        put(e)
    finally:
        close = getattr(blocks, "close", None)
        if close is not None:
            close()  # the file, now, on this thread


class EventReader:
    """Yields lists of decoded events from the traceEvents array of a stream.

    A damaged event costs that event only: decoding resumes at the next event boundary, and the
    skipped events are counted by reason in `skipped`. No more than MAX_EVENT_BYTES is held for one
    event, or for the text around the events array, whatever the file holds.
    """

    def __init__(self, stream: ByteStream, event_type: type, fast_type: Any = None,
                 columnize: Callable[[memoryview, bool], tuple | None] | None = None):
        """`fast_type`: a faster form of `event_type` for the events a file usually holds (a tagged union,
        say); tried first on each window until a window does not fit it, then never again in this file.
        `columnize(window, fast)`: a native reading of a window of whole events into what the caller's columns
        would be, (columns, bytes consumed, whether the array ended, whether the fast form still holds), or None
        to leave that window to the decoders here (which then count what is wrong with it)."""
        self.stream = stream
        self._many, self._one = _decoders(event_type)
        self._fast = _decoders(fast_type)[0] if fast_type is not None else None
        self._columnize = columnize
        self.blocks = ReadAhead(stream.blocks())
        self.buf = b""
        self.eof = False
        self.header = b""  # everything before the events array
        self.trailer = b""  # everything after it, up to MAX_EVENT_BYTES
        self.trailer_dropped = 0  # bytes after that, not kept
        self.trailer_dropped_junk = False  # whether any of them is more than zero padding or blanks
        self.read_any = False  # whether any event was decoded
        self.skipped: dict[str, list] = {}  # reason -> [events, first example]
        self.repaired: dict[str, list] = {}  # reason -> [events kept after a repair, first example]
        self.truncated: str | None = None  # why the events array never closed

    def close(self) -> None:
        """Stop reading the stream (its read-ahead thread ends; the file is closed)."""
        self.blocks.close()

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

    def _fill_past_separator(self, want: int) -> None:
        """_fill, and drop the separator (blanks, one comma) buf starts with: while the window is joined when the
        separator ends before the bytes left over do (the usual case), which spares a copy of the whole window."""
        leftover = self.buf
        skip = _SEPARATOR.match(leftover).end()
        if skip < len(leftover):
            self.buf = memoryview(leftover)[skip:]
            self._fill(want)  # (which joins into bytes, even one part)
            return
        self._fill(want)
        skip = _SEPARATOR.match(self.buf).end()
        if skip:
            self.buf = self.buf[skip:]

    def _skip(self, reason: str, example: str) -> None:
        entry = self.skipped.setdefault(reason, [0, example])
        entry[0] += 1

    def _find_array_start(self) -> None:
        self._fill(SNIFF_BYTES)
        self.buf = self.buf.removeprefix(UTF8_BOM)  # JSON has none, but Windows editors write one
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

    def events(self) -> Iterator[Any]:
        """Lists of decoded events, or the columns `columnize` made of a window."""
        self._find_array_start()
        want = CHUNK_BYTES
        while True:
            self._fill_past_separator(want)
            if _at_array_end(self.buf, 0):  # empty array, or the end after the last chunk
                self._finish(1)
                return
            limit = len(self.buf) if self.eof else min(len(self.buf), want)
            events, consumed, ended = self._decode_prefix(limit)
            if isinstance(events, list) and events:  # (a native window hands back any event giving a key twice)
                self._count_duplicate_keys(self.buf[:consumed - 1] if ended else self.buf[:consumed])
            self.buf = self.buf[consumed:]
            if len(events):
                self.read_any = True
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

    def _decode_prefix(self, limit: int) -> tuple[list, int, bool]:
        """Decode the whole events in buf[:limit]: (events, bytes consumed, whether the array ended).

        The fast path decodes them as one array; when that fails, the sound events before the
        failure are still decoded at once and the rest one by one (`_decode_one_by_one`)."""
        buf = self.buf
        pos = _last_event_end(buf, limit)
        if pos < 0:
            return self._decode_one_by_one([], 0, limit)
        if self._columnize is not None and (done := self._columnize(memoryview(buf)[: pos + 1], self._fast is not None)):
            columns, consumed, ended, fast = done
            if not fast:
                self._fast = None
            return columns, consumed, ended
        candidate = b"".join((b"[", memoryview(buf)[: pos + 1], b"]"))  # one copy, not three
        if self._fast is not None:
            try:
                return self._fast.decode(candidate), pos + 1, False
            except msgspec.DecodeError as e:  # (ValidationError included)
                # The end of the events array in this prefix (every file's last window) keeps the fast form
                if (ended := _through_array_end(self._fast, candidate, e)) is not None:
                    return ended
                self._fast = None  # the general form says what is wrong
            except RecursionError:
                self._fast = None
        try:
            return self._many.decode(candidate), pos + 1, False
        except msgspec.ValidationError:
            try:  # some element has an unexpected shape: the sound ones are kept
                return self._decode_each(candidate), pos + 1, False
            except (msgspec.DecodeError, RecursionError):  # and a later one is not JSON, or too deep
                return self._decode_one_by_one([], 0, limit)
        except RecursionError:
            return self._decode_one_by_one([], 0, limit)
        except msgspec.DecodeError as e:
            offset, message = _error_offset(e), str(e)
            ended = _through_array_end(self._many, candidate, e)
        if ended is not None:
            return ended
        if offset is None or "trailing characters" in message:
            return self._decode_one_by_one([], 0, limit)
        # The events before the one holding the error are sound: decode them in one go.
        error_at = offset - 2  # msgspec counts past the offending byte, and candidate starts with "["
        before = None
        for before in _BETWEEN_EVENTS.finditer(buf, max(0, error_at - (1 << 20)), max(0, error_at)):
            pass
        if before is not None:
            try:
                sound = self._many.decode(b"".join((b"[", memoryview(buf)[: before.start() + 1], b"]")))
                return self._decode_one_by_one(sound, before.start() + 1, limit)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                pass
        return self._decode_one_by_one([], 0, limit)

    def _count_duplicate_keys(self, window: bytes) -> None:
        """Count the events of a window (whole events and the commas between them) that give a key twice, any key
        of the event object, whatever its phase. The decoders take the last value of a key (JSON's usual rule).

        Each key given adds a colon outside keys and values. Decoded as objects of keys and raw values, a key given
        twice is kept once, so the objects encoded again hold fewer colons than the window exactly when some event
        gives a key twice, unless a `\\u` escape in a key spells a colon: such windows, and the windows with fewer
        colons, are looked at event by event."""
        array = b"".join((b"[", window, b"]"))
        try:
            if b"\\u" not in window and _ENCODER.encode(_KEYED_LIST.decode(array)).count(b":") == window.count(b":"):
                return
        except (msgspec.DecodeError, RecursionError):  # damaged events, or bytes that are not UTF-8: event by event
            pass
        try:
            raws = _RAW_LIST.decode(array)
        except (msgspec.DecodeError, RecursionError):  # damaged events in the window: their own issues say so
            return
        for raw in raws:
            text = bytes(raw)
            if _gives_a_key_twice(text):
                entry = self.repaired.setdefault("duplicate_keys", [0, f"{text[:120]!r}"])
                entry[0] += 1

    def _decode_each(self, candidate: bytes) -> list:
        events = []
        for raw in _RAW_LIST.decode(candidate):
            try:
                events.append(self._one.decode(raw))
            except msgspec.DecodeError as e:  # a wrong shape, or bytes that are not UTF-8 (ValidationError included)
                if (event := self._decode_repaired(bytes(raw))) is not None:
                    events.append(event)
                else:
                    self._skip("malformed_event", f"{e}: {bytes(raw)[:120]!r}")
        return events

    def _decode_repaired(self, raw: bytes) -> Any:
        """The event, its text repaired (bytes that are not UTF-8 and lone surrogate escapes become U+FFFD), or
        None when it needs more than that: one bad byte in a kernel's name must not cost the kernel."""
        repaired = _repair_text(raw)
        if repaired is None:
            return None
        try:
            event = self._one.decode(repaired)
        except (msgspec.DecodeError, RecursionError):
            return None
        entry = self.repaired.setdefault("repaired_text", [0, f"{raw[:120]!r}"])
        entry[0] += 1
        return event

    def _decode_one_by_one(self, events: list, pos: int, limit: int) -> tuple[list, int, bool]:
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

    def _value_end(self, view: memoryview, pos: int) -> int | None:
        """Where the JSON value at `pos` ends when it is whole and more follows it, else None (junk, or a value
        that may go on past the bytes read so far)."""
        try:
            _RAW.decode(view[pos:])
        except msgspec.DecodeError as e:
            offset = _error_offset(e)
            # an element of the array: the next one or the array's end follows (not a stray quote that would take
            # the start of the next event for a string)
            if offset is not None and "trailing characters" in str(e) and _ELEMENT_FOLLOWS.match(self.buf, pos + offset - 1):
                return pos + offset - 1
        except RecursionError:
            pass
        return None

    def _next_event(self, view: memoryview, pos: int) -> tuple[int, Any] | None:
        """The event at `pos` and where it ends (event None when it was skipped as damaged), or None
        when it may go on past the bytes read so far."""
        if view[pos] != 0x7B:  # not an event
            if (end := self._value_end(view, pos)) is not None:  # a whole JSON value (null, 42, "text", [1, 2])
                self._skip("malformed_event", f"an element that is no event object: {bytes(view[pos:min(end, pos + 60)])!r}")
                return end, None
            # junk between events (a stray comma, zeros) up to the next one
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
            elif (boundary := _EVENT_END.search(self.buf, pos + offset - 1)) is not None and (
                    event := self._decode_repaired(bytes(view[pos:boundary.start() + 1]))) is not None:
                return boundary.start() + 1, event  # a lone surrogate escape, replaced
            else:
                return self._resync(pos, pos + offset - 1, "malformed_event", f"{e}: {bytes(view[pos:pos + 120])!r}")
        except RecursionError:
            return self._resync(pos, pos + 1, "nesting_too_deep", f"{bytes(view[pos:pos + 120])!r}")
        try:
            return end, self._one.decode(view[pos:end])
        except msgspec.DecodeError as e:  # a wrong shape, or bytes that are not UTF-8 (ValidationError included)
            if (event := self._decode_repaired(bytes(view[pos:end]))) is not None:
                return end, event
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
        if not isinstance(value, dict):
            return {}
        # The header's traceEvents was decoded as [] above: a value here is a second traceEvents key's (the last wins).
        if (later := value.pop("traceEvents", [])) != []:
            count = f"{len(later)} events" if isinstance(later, list) else f"a {type(later).__name__}"
            issues.append(Issue("error", "duplicate_trace_events", len(later) if isinstance(later, list) else 1,
                                f"the file gives traceEvents twice: the first "
                                f"array was read, the later one ({count}) was not"))
        return value

    def report(self, issues: list[Issue]) -> None:
        """What reading cost, once the events and the metadata are read: a truncation, bytes after the
        gzip data, skipped events."""
        if self.stream.truncated or self.truncated:
            why = self.stream.truncated or self.truncated
            kept = "kept every complete event before the cut" if self.read_any else "no complete event before the cut"
            issues.append(Issue("error", "truncated", 1, f"{why}; {kept}"))
        if self.stream.trailing_bytes:
            _report_trailing(b"", self.stream.trailing_bytes, not self.stream.trailing_zeros, "the gzip data", issues)
        for reason, (n, example) in sorted(self.skipped.items()) + sorted(self.repaired.items()):
            what = f"{_SKIPPED[reason]}; decoding resumed at the next event" if reason in _SKIPPED else _REPAIRED[reason]
            issues.append(Issue("warning", reason, n, f"{what}, e.g. {example}"))

    def _report_after_document(self, text: bytes, issues: list[Issue]) -> None:
        _report_trailing(text, self.trailer_dropped, self.trailer_dropped_junk, "the JSON document", issues)


def _is_padding(data: bytes) -> bool:
    """Only zeros and blanks (counting zeros first: much faster than strip on a long run of them)."""
    return data.count(0) == len(data) or not data.strip(b"\0 \t\r\n")


# A second trace after the first: an object opening with a key Kineto writes, or an array of events (the old form)
SECOND_TRACE = re.compile(rb'\{\s*"(traceEvents|schemaVersion|deviceProperties|distributedInfo|displayTimeUnit|'
                          rb'otherData|traceName|baseTimeNanoseconds)"|\[\s*\{\s*"(ph|name|cat|pid|tid|ts)"')


def _report_trailing(text: bytes, more_bytes: int, more_junk: bool, after: str, issues: list[Issue]) -> None:
    """Bytes after the end of the data (`text`, then `more_bytes` not kept): zero padding or garbage."""
    junk = b"" if _is_padding(text) else text.strip(b" \t\r\n\0")
    size = len(text) + more_bytes
    if SECOND_TRACE.match(junk):
        # a second trace written after the first (two documents concatenated): its events are lost, not garbage
        issues.append(Issue("error", "duplicate_trace_events", 1, f"a second trace document after the end of {after} "
                            f"({size:,} bytes, starting {junk[:40]!r}): not read, its events lost; split the file"))
    elif junk or more_junk:
        example = f", e.g. {junk[:60]!r}" if junk else ""  # (after gzip data only their count is kept)
        issues.append(Issue("warning", "trailing_garbage", size, f"bytes after the end of {after} ignored{example}"))
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


def _gives_a_key_twice(event: bytes) -> bool:
    """Whether the event object (not the objects inside it) holds one key twice."""
    repeated = []

    def pairs(items: list) -> dict:
        repeated.append(len({key for key, _ in items}) < len(items))
        return dict(items)

    try:
        json.loads(event, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return False
    return bool(repeated) and repeated[-1]  # the outermost object is completed last


_REPAIRED = {
    "duplicate_keys": "events giving a key twice were read with the last value of each key (JSON's usual rule)",
    "repaired_text": "events whose strings held bytes that are not UTF-8 or a lone UTF-16 surrogate escape were kept, "
                     "each bad character replaced by U+FFFD",
}
# A \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or the latter not preceded by the former: JSON
# allows them (RFC 8259 section 8.2 calls the result unpredictable) but they are no text, and decoders refuse them.
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _repair_text(raw: bytes) -> bytes | None:
    """raw with lone surrogate escapes and bytes that are not UTF-8 replaced by U+FFFD; None when it has neither."""
    fixed = _LONE_SURROGATE.sub(rb"\\ufffd", raw)
    try:
        fixed.decode()
    except UnicodeDecodeError:
        fixed = fixed.decode(errors="replace").encode()
    return fixed if fixed != raw else None


_SKIPPED = {
    "malformed_event": "events that are not valid JSON or have an unexpected shape were skipped",
    "nesting_too_deep": "events nested deeper than the decoder allows were skipped",
    "oversized_event": f"events larger than {MAX_EVENT_BYTES >> 20} MiB (an unterminated string?) were skipped",
}
