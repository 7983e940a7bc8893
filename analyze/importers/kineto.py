"""Read one PyTorch-profiler (Kineto) Chrome trace into normalized tables.

This module knows the Kineto format: it decodes the events into per-rank columns (kinds from
Kineto's categories, exact ns times) and the trace's metadata; what the events mean whatever the
format (step windows, step of each event, launch and flow links) is trace.semantics, which ingest applies.

The trace is decoded in bounded chunks straight from the (gzip) stream by json_events, so memory
stays a small multiple of the chunk size whatever the file holds, and damage (a cut, a bad token)
costs only what it damages. Events are decoded into typed structs by msgspec (unknown keys are
skipped without building Python objects), every value is checked where it is read (out of range or
of the wrong type: null and counted, never wrapped), and `ts`/`dur` are kept as their raw JSON text
and converted to integer nanoseconds with exact decimal arithmetic: a float64 cannot hold
`1712195495519689.047` µs to the ns, and rounding it is how other tools manufacture negative
durations.

Formats handled (see ../shared/corpus/INVENTORY.md): the 2020 top-level JSON array; capitalised
legacy categories (Operator, Runtime, Kernel, Memcpy, Memset); legacy launch flows (`async`,
`async_gpu`, `async_cpu_to_gpu`) and `ac2g`; `ts` relative to `baseTimeNanoseconds` (which Kineto
writes after traceEvents); ids above int64; string pids/tids (`"stream 7"`); ROCm `hip*` APIs.
"""

from __future__ import annotations

import ctypes
import decimal
import gc
import os
import re
import time
import typing
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional, Union

import msgspec
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from steplens.analyze.contract import schema
from steplens.analyze.contract.traces import TIME_LIMIT_NS, DecodedTrace, Device, NotATrace, TraceMeta, checked, preview
from steplens.analyze.importers.json_events import ByteStream, EventReader, Issue

try:  # the native columnizer (_columnize.c), built by pip where a C compiler is found
    from steplens.analyze.importers import _columnize
except ImportError:
    _columnize = None

# A ts above this many ns (~1973 as epoch time) is already absolute, not relative to a base time.
ABSOLUTE_NS_THRESHOLD = 10**17

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
    total_allocated: Any = msgspec.field(default=None, name="Total Allocated")
    total_reserved: Any = msgspec.field(default=None, name="Total Reserved")
    memory_device_type: Any = msgspec.field(default=None, name="Device Type")
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

# The phases of the Trace Event Format (Chrome's "Trace Event Format" document), Kineto's among them.
TRACE_EVENT_PHASES = ("X", "i", "I", "s", "f", "t", "M", "B", "E", "C", "b", "n", "e", "P", "N", "O", "D", "V", "v",
                      "R", "c", "(", ")")


def _phase_forms() -> Any:
    """The fast form of _Event: a union tagged by `ph` over the phases of the Trace Event Format, every
    one with _Event's fields but the metadata events ("M": process and thread names, two thirds of the
    events of mtia_rank_0.json.gz), which _columns drops and which thus decode to nothing (the file's
    decoding 311 -> 185 ms; nothing of theirs is read, so an odd value in them, args that are not an
    object say, is not counted either). An event of another phase, or without one, or any value the
    forms reject, sends the rest of the file to _Event."""
    hints = typing.get_type_hints(_Event)
    fields = [(name, hints[name], default) for name, default in zip(_Event.__struct_fields__, _Event.__struct_defaults__)
              if name != "ph"]
    forms = [msgspec.defstruct(f"_Event_{ord(phase)}", [] if phase == "M" else fields, tag_field="ph", tag=phase,
                               namespace={"ph": phase}, gc=False)
             for phase in TRACE_EVENT_PHASES]
    return Union[tuple(forms)]  # noqa: UP007 - msgspec takes a Union of the forms


_PHASED_EVENT = _phase_forms()


# read_decode: gunzip and JSON decoding into structs (interleaved, chunk by chunk); columns: structs
# to typed columns; normalise: exact ns times, kinds, checks (ingest times the semantics).
STAGES = ("read_decode", "columns", "normalise")


# ---------------------------------------------------------------------------------------------
# Columns


# Values beyond these bounds are damage, not measurements; they are stored as null and counted.
# Times: contract.traces.TIME_LIMIT_NS.
# A collective's element count: 2**48 elements (4.5 PB at 16 bytes) is beyond any device's memory,
# and keeps byte counts (x the element size) and their sums over many calls inside int64.
MAX_MESSAGE_NELEMS = 2**48
MAX_MEMORY_BYTES = 2**48  # a [memory] event's allocation size (negative for a free)
HOST_DEVICE_TYPE = 0  # c10::DeviceType::CPU in a [memory] event's 'Device Type' (CUDA is 1, HIP 6)
# Longest integer text parsed (int64 has 19 digits); longer strings are not parsed at all.
_MAX_INT_DIGITS = 20


def _int_column(values: list, dtype=pa.int64(), bounds: tuple[int, int] | None = None) -> tuple[pa.Array, int, str]:
    """Values as an integer array; numeric strings are parsed, anything else becomes null, and so
    does a value outside `bounds` (inclusive).

    Returns the array, how many non-null values could not be represented, and an example of one.
    """
    if values.count(None) == len(values):  # most args are absent from most chunks: no inference needed
        return pa.nulls(len(values), dtype), 0, ""
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
    lo, hi = schema.UINT64_RANGE if dtype == pa.uint64() else schema.INT64_RANGE
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
        numeric = digits.removeprefix("-").isdigit() and digits.isascii() and len(digits) <= _MAX_INT_DIGITS
        value = int(digits) if numeric else None
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if type(value) is int and lo <= value <= hi else None


def _str_column(values: list, count_bad=None, lists_as_json: bool = False) -> pa.Array | pl.Series:
    """Strings; numbers become their text, anything else (a list where a name belongs) null, or
    with `lists_as_json` its compact JSON text."""
    if values.count(None) == len(values):
        return pa.nulls(len(values), pa.string())
    try:  # polars takes Python strings in half pyarrow's time (names: 9 against 18 ms for 109k), and refuses any other value
        return pl.Series(values, dtype=pl.String, strict=True)
    except (TypeError, ValueError, OverflowError, pl.exceptions.PolarsError):
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


def _raw_column(raws: list[msgspec.Raw], count_bad) -> pa.Array:
    """Raw JSON texts (empty = absent) as a string array, built from the joined bytes and their lengths
    (no Python object per value). A text that is not UTF-8 is null and counted (msgspec.Raw keeps bytes
    as they are; the rest of its event is sound)."""
    joined = b"".join(raws)
    if not joined.strip():
        return pa.nulls(len(raws), pa.string())
    if b"\n" in joined or b"\r" in joined:  # multi-line values: re-encode compactly
        texts = [_compact_or_none(r) for r in raws]
        _count_nulled([bytes(r) if r else None for r in raws], texts, count_bad)
        return pa.array(texts, type=pa.string())
    lengths = np.fromiter(map(len, raws), dtype=np.int32, count=len(raws))
    offsets = np.zeros(len(raws) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    validity = pa.array(lengths > 0).buffers()[1]
    array = pa.StringArray.from_buffers(len(raws), pa.py_buffer(offsets), pa.py_buffer(joined), validity)
    try:
        array.validate(full=True)  # UTF-8, as a JSON text must be
        return array
    except pa.ArrowInvalid:
        texts = [_utf8_or_none(r) for r in raws]
        _count_nulled([bytes(r) if r else None for r in raws], texts, count_bad)
        return pa.array(texts, type=pa.string())


def _utf8_or_none(raw: msgspec.Raw) -> str | None:
    try:
        return bytes(raw).decode() if raw else None
    except UnicodeDecodeError:
        return None


def _compact_or_none(raw: msgspec.Raw) -> str | None:
    try:
        return msgspec.json.encode(msgspec.json.decode(raw)).decode() if raw else None
    except msgspec.DecodeError:  # not UTF-8
        return None


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
    ns = _kineto_text_to_ns(text)
    if ns is None:
        ns = _text_to_ns_generally(text)
    return ns, int((text.is_not_null() & ns.is_null()).sum())


def _kineto_text_to_ns(text: pl.Series) -> pl.Series | None:
    """The fast path for the two forms Kineto writes: whole µs (older releases), and µs with exactly
    three decimals (ns resolution). Without the point those are the µs (or ns) as one integer: a cast,
    against the general path's split and regex (2.4x and 1.6x faster on the 145k ts and dur of
    mtia_rank_0.json.gz). None when some value has another form (or more than 19 digits)."""
    t = pl.col("t")
    parts = pl.DataFrame({"t": text}).with_columns(
        dot=t.str.find(".", literal=True).cast(pl.Int64),  # null when there is none
        digits=t.str.replace(".", "", literal=True).cast(pl.Int64, strict=False),  # ASCII digits and a sign only
        length=t.str.len_bytes().cast(pl.Int64), plus=t.str.starts_with("+"), minus=t.str.starts_with("-"))
    dot, digits = pl.col("dot"), pl.col("digits")
    # "+5" casts, and ".500" or "-.500" would read as numbers, but none is a JSON number
    kineto_form = digits.is_not_null() & ~pl.col("plus") & (
        dot.is_null() | ((dot == pl.col("length") - 4) & (dot >= 1) & ~((dot == 1) & pl.col("minus"))))
    whole_ns = pl.when(digits.is_between(-_MAX_WHOLE_US, _MAX_WHOLE_US)).then(digits * 1000)
    bound = _MAX_WHOLE_US * 1000 + 999
    if parts.select((t.is_not_null() & ~kineto_form).any()).item():
        return None
    return parts.select(ns=pl.when(dot.is_null()).then(whole_ns).otherwise(
        pl.when(digits.is_between(-bound, bound)).then(digits)))["ns"]


def _text_to_ns_generally(text: pl.Series) -> pl.Series:
    """microseconds_text_to_ns for any text: plain decimals split at the point, exponents and quoted
    numbers through Decimal."""
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
    return ns


def _decimal_us_to_ns(text: str) -> int | None:
    m = _NUMBER_TEXT.match(text)
    if m is None:
        return None
    ns = int(_EXACT.multiply(Decimal(m.group(1)), 1000))
    return ns if -TIME_LIMIT_NS <= ns <= TIME_LIMIT_NS else None


def _columns(events: list[_Event], counters: dict[str, list]) -> pl.DataFrame:
    # Metadata events (ph "M": process and thread names and sort indices, two thirds of the events of
    # mtia_rank_0.json.gz) are read by nothing downstream: they are dropped before any column is built.
    events = [e for e in events if e.ph != "M"]
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
    # Collective args and allocator totals sit on a handful of events: found in one pass, read only there.
    rare_rows = [i for i, a in enumerate(args) if a.collective is not None or a.seq is not None or a.comms_id is not None
                 or a.total_allocated is not None or a.total_reserved is not None]
    comm_rows = [i for i in rare_rows if args[i].collective is not None or args[i].seq is not None
                 or args[i].comms_id is not None]

    def comm(name: str) -> list:
        values = [None] * n
        for i in comm_rows:
            values[i] = getattr(args[i], name)
        return values

    memory_rows = [i for i in rare_rows if args[i].total_allocated is not None or args[i].total_reserved is not None]

    def device_memory(name: str) -> list:
        """A [memory] event's allocator total, kept for device allocators only: the host's (Device Type 0) is another pool."""
        values = [None] * n
        for i in memory_rows:
            if args[i].memory_device_type != HOST_DEVICE_TYPE:
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
        "ts_text": _raw_column([e.ts for e in events], count_bad("ts")),
        "dur_text": _raw_column([e.dur for e in events], count_bad("dur")),
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
        "input_dims": _raw_column(dims, count_bad("Input Dims")),
        "input_types": _raw_column([a.input_types for a in args], count_bad("Input type")),
        "concrete_inputs": _raw_column([a.concrete_inputs for a in args], count_bad("Concrete Inputs")),
        "bytes": ints([a.nbytes if a.nbytes is not None else a.memory_bytes for a in args], "bytes",
                      bounds=(-MAX_MEMORY_BYTES, MAX_MEMORY_BYTES)),
        "flops": _float_column([a.flops for a in args], count_bad("flops")),
        "total_allocated_bytes": ints(device_memory("total_allocated"), "Total Allocated", bounds=(0, MAX_MEMORY_BYTES)),
        "total_reserved_bytes": ints(device_memory("total_reserved"), "Total Reserved", bounds=(0, MAX_MEMORY_BYTES)),
        # what the native columnizer converts itself (_normalize converts the texts of the rest)
        "ts_native_ns": pa.nulls(len(events), pa.int64()),
        "dur_native_ns": pa.nulls(len(events), pa.int64()),
    }
    return pl.DataFrame(columns)  # Arrow arrays and the polars string columns


# The columns of _columns, in its order, with their Arrow types: what _columnize returns, column by column.
_NATIVE_COLUMNS = (
    ("ph", pa.string()), ("cat", pa.string()), ("name", pa.string()), ("pid", pa.int64()), ("tid", pa.int64()),
    ("ts_text", pa.string()), ("dur_text", pa.string()), ("flow_id", pa.int64()), ("arg_stream", pa.int64()),
    ("arg_device", pa.int64()), ("correlation", pa.int64()), ("external_id", pa.int64()), ("collective", pa.string()),
    ("in_nelems", pa.int64()), ("out_nelems", pa.int64()), ("dtype", pa.string()), ("group_size", pa.int64()),
    ("group_name", pa.string()), ("group_desc", pa.string()), ("group_ranks", pa.string()), ("seq", pa.int64()),
    ("comms_id", pa.uint64()), ("src_rank", pa.int64()), ("dst_rank", pa.int64()), ("input_dims", pa.string()),
    ("input_types", pa.string()), ("concrete_inputs", pa.string()), ("bytes", pa.int64()), ("flops", pa.float64()),
    ("total_allocated_bytes", pa.int64()), ("total_reserved_bytes", pa.int64()), ("ts_native_ns", pa.int64()),
    ("dur_native_ns", pa.int64()),
)


def native_available() -> bool:
    """Whether the native columnizer is built (pip builds it where a C compiler is found)."""
    return _columnize is not None


_NATIVE_SCHEMA = pa.schema(list(_NATIVE_COLUMNS))


def _native_columns(window: memoryview, fast: bool) -> tuple[pa.RecordBatch, int, bool, bool] | None:
    """_columns of a window of whole events, decoded natively (json_events.EventReader's `columnize`), as an Arrow
    batch (the windows become one polars frame at once: _concatenated); None when the window holds anything the
    Python reader must see (a damaged event, a value _columns would count)."""
    done = _columnize.columnize(window, fast)
    if done is None:
        return None
    buffers, rows, consumed, ended, still_fast = done
    arrays = []
    for (name, dtype), (values, offsets, validity, nulls) in zip(_NATIVE_COLUMNS, buffers):
        if nulls == rows:
            arrays.append(pa.nulls(rows, dtype))
            continue
        held = [None if validity is None else pa.py_buffer(validity)]
        held += [pa.py_buffer(values)] if offsets is None else [pa.py_buffer(offsets), pa.py_buffer(values)]
        arrays.append(pa.Array.from_buffers(dtype, rows, held, null_count=nulls))
    return pa.RecordBatch.from_arrays(arrays, schema=_NATIVE_SCHEMA), consumed, ended, still_fast


def _concatenated(chunks: list, counters: dict[str, list]) -> pl.DataFrame:
    """The windows' columns as one contiguous frame: putting events in time order gathers every column, and a
    gather across the windows' chunks costs 3-4x a rechunk and a gather (with_stack rank, 372k rows: 39 -> 10 ms).
    Native windows (Arrow batches) become one Arrow table and then one polars frame: a polars frame a window and
    a concat took twice as long (an A100 rank's 18 windows: 41 -> 19 ms)."""
    if not chunks:
        return _columns([], counters)
    if all(isinstance(chunk, pa.RecordBatch) for chunk in chunks):
        return pl.from_arrow(pa.Table.from_batches(chunks), rechunk=True)
    frames = [pl.from_arrow(chunk) if isinstance(chunk, pa.RecordBatch) else chunk for chunk in chunks]
    return pl.concat(frames, how="vertical_relaxed", rechunk=True)


# Text values past this many characters are cut (long_text): a demangled template kernel name runs to a few thousand,
# an op's shapes with thousands of inputs to tens of thousands; a trace whose names ran to megabytes each, a few
# hundred times, took 8 GB to read and failed at Arrow's 2 GiB a column.
MAX_TEXT_CHARS = 1 << 16


def _cut_long_text(chunk, cut: dict[str, list]):
    """A window's columns with every text value past MAX_TEXT_CHARS cut to it, counted per column in `cut`
    ([count, example]); native (Arrow) and Python (polars) windows alike, so both readers give the same tables."""
    if isinstance(chunk, pa.RecordBatch):
        arrays, changed = list(chunk.columns), False
        for i, (name, dtype) in enumerate(zip(chunk.schema.names, chunk.schema.types)):
            array = arrays[i]
            if dtype != pa.string() or (data := array.buffers()[2]) is None or data.size <= MAX_TEXT_CHARS:
                continue  # (no value has more characters than the column has bytes)
            offsets = np.frombuffer(array.buffers()[1], np.int32, len(array) + 1, array.offset * 4)
            if int(np.diff(offsets).max()) <= MAX_TEXT_CHARS:  # (nor more characters than its own bytes)
                continue
            long = pc.fill_null(pc.greater(pc.utf8_length(array), MAX_TEXT_CHARS), False)
            if n := pc.sum(long).as_py():
                _count_cut(cut, name, n, pc.filter(array, long)[0].as_py())
                arrays[i], changed = pc.if_else(long, pc.utf8_slice_codeunits(array, 0, MAX_TEXT_CHARS), array), True
        return pa.RecordBatch.from_arrays(arrays, schema=chunk.schema) if changed else chunk
    text = [name for name, dtype in chunk.schema.items() if dtype == pl.String]
    counts = chunk.select(pl.col(text).str.len_chars().gt(MAX_TEXT_CHARS).sum()).row(0) if text else ()
    for name, n in zip(text, counts):
        if n:
            _count_cut(cut, name, n, chunk.filter(pl.col(name).str.len_chars() > MAX_TEXT_CHARS)[name][0])
            chunk = chunk.with_columns(pl.col(name).str.slice(0, MAX_TEXT_CHARS))
    return chunk


def _count_cut(cut: dict[str, list], column: str, n: int, example: str) -> None:
    counted = cut.setdefault(column, [0, f"{len(example):,} characters beginning {example[:40]!r}"])
    counted[0] += n


def _use_native() -> bool:
    """STEPLENS_NATIVE=0 makes the Python reader read every window (it is the reference the native one is held to)."""
    return _columnize is not None and os.environ.get("STEPLENS_NATIVE", "1") != "0"


# ---------------------------------------------------------------------------------------------
# Normalization


def _normalize(raw: pl.DataFrame, base_ns: int, issues: list[Issue]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Split raw rows into trace events (X/i) and flow endpoints (s/f/t), with exact ns times."""
    ts, dur = _times_ns(raw, "ts"), _times_ns(raw, "dur")
    if base_ns and (ts.median() or 0) >= ABSOLUTE_NS_THRESHOLD:
        issues.append(Issue("info", "absolute_ts_with_base", 1, "ts already absolute; baseTimeNanoseconds not added"))
        base_ns = 0
    raw = raw.with_columns(ts_ns=ts, dur_ns=dur)
    bad_durations = _report_bad_times(raw, base_ns, issues)
    in_range = pl.col("ts_ns").is_between(-TIME_LIMIT_NS - base_ns, TIME_LIMIT_NS - base_ns)
    raw = raw.with_columns(ts_ns=pl.when(in_range).then(pl.col("ts_ns") + base_ns)).drop(
        "ts_text", "dur_text", "ts_native_ns", "dur_native_ns")

    phase = pl.col("ph")
    is_event = phase.is_in(["X", "i", "I"]) & pl.col("ts_ns").is_not_null()
    is_flow = phase.is_in(["s", "f", "t"]) & pl.col("ts_ns").is_not_null()
    # Issues in the order of the file; grouped after the filter (usually nothing left), not before
    ignored = raw.select("ph").filter(~phase.is_in(["X", "i", "I", "s", "f", "t", "M"]) | phase.is_null()).group_by(
        "ph", maintain_order=True).len()
    for ph, n in ignored.iter_rows():
        issues.append(Issue("info", "unsupported_phase", n, f"events with ph={ph!r} are not complete/instant/flow events; skipped"))
    # Counted, not filtered: a filter copies every column
    no_dur, negative = raw.select(no_dur=((phase == "X") & pl.col("dur_ns").is_null()).sum(),
                                  negative=((phase == "X") & (pl.col("dur_ns") < 0)).sum()).row(0)
    no_dur -= bad_durations
    if no_dur:
        issues.append(Issue("warning", "missing_duration", no_dur, "complete (X) events without dur; kept with null duration"))
    if negative:
        issues.append(Issue("warning", "negative_duration", negative, "complete events with negative dur as written in the trace"))

    # The events in ts order in one gather: filtering, then sorting, would copy every column twice
    in_order = raw.select(pl.int_range(pl.len(), dtype=pl.UInt32).filter(is_event).sort_by(
        pl.col("ts_ns").filter(is_event), maintain_order=True))
    events = raw[in_order.to_series()]
    flows = raw.select("ph", "cat", "pid", "tid", "ts_ns", "flow_id").filter(is_flow)
    # Mapped once per distinct category (a handful), not per event: half the time of this stage's columns
    cats = events.select(pl.col("cat").unique().drop_nulls())
    kind_of = dict(cats.with_columns(pl.col("cat").str.to_lowercase().replace_strict(CATEGORY_KINDS, default="other")
                                     .alias("kind")).iter_rows())  # rowwise-ok: per distinct category
    kind_of_cat = pl.col("cat").replace_strict(kind_of, default="other", return_dtype=pl.String)
    kind = pl.when(pl.col("name") == MEMORY_EVENT_NAME).then(pl.lit("memory")).otherwise(kind_of_cat)
    events = events.with_columns(
        kind=kind.fill_null("other"),
        dur_ns=pl.when(pl.col("ph") == "X").then(pl.col("dur_ns")),
    ).with_columns(
        stream=pl.when(pl.col("kind").is_in(schema.DEVICE_KINDS)).then(pl.coalesce("arg_stream", "tid")),
        device=pl.when(pl.col("kind").is_in(schema.DEVICE_KINDS)).then(pl.coalesce("arg_device", "pid")),
    )
    events = events.with_row_index("event_id").with_columns(pl.col("event_id").cast(pl.Int64))
    return events, flows


_TIMED_PHASES = ["X", "i", "I", "s", "f", "t"]
_YEARS_LIMIT = TIME_LIMIT_NS // (365 * 86400 * 10**9)


def _times_ns(raw: pl.DataFrame, field: str) -> pl.Series:
    """The field's exact ns: as the native columnizer converted it (plain decimals, the forms every profiler
    writes), else from its text (exponents, quoted numbers, damage: microseconds_text_to_ns, the reference)."""
    native, text = raw[f"{field}_native_ns"], raw[f"{field}_text"]
    if native.null_count() < native.len():
        text = raw.select(pl.when(pl.col(f"{field}_native_ns").is_null()).then(pl.col(f"{field}_text")))[f"{field}_text"]
    if text.null_count() == text.len():
        return native
    converted, _ = microseconds_text_to_ns(text)
    return pl.select(pl.coalesce(native, converted)).to_series()


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


# ---------------------------------------------------------------------------------------------
# Entry point


def claims(path: Path) -> bool:
    """Any .json or .gz file is offered; one that is not a trace is reported by the parser (not_a_trace)."""
    return True


def decode(path: Path) -> DecodedTrace:
    """Decode one trace file. Raises NotATrace for JSON that is not a trace, OSError if unreadable."""
    reader = EventReader(ByteStream(path), _Event, _PHASED_EVENT, _native_columns if _use_native() else None)
    counters: dict[str, list] = {}
    cut: dict[str, list] = {}  # column -> [values cut to MAX_TEXT_CHARS, an example]
    seconds = dict.fromkeys(STAGES, 0.0)
    chunks = []
    # Decoded events hold no reference cycles; collecting garbage over them only costs time.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    clock = time.perf_counter()
    try:
        for events in reader.events():
            decoded = time.perf_counter()
            chunks.append(_cut_long_text(events if isinstance(events, pa.RecordBatch) else _columns(events, counters), cut))
            seconds["read_decode"] += decoded - clock
            clock = time.perf_counter()
            seconds["columns"] += clock - decoded
    except NotATrace as e:
        # Text that is not JSON only damages a file whose name says it is JSON (not a .tar.gz).
        e.damaged = e.damaged and path.name.endswith((".json", ".json.gz"))
        raise
    finally:
        if gc_was_enabled:
            gc.enable()
        reader.close()  # read to the end by now, unless an error or an interrupt stopped it early
    issues: list[Issue] = []
    metadata = reader.metadata(issues)
    if isinstance(other := metadata.get("otherData"), dict) and schema.EXPORT_MARK in other:
        raise NotATrace("a merge of every rank that `steplens export-trace` wrote for Perfetto (its events carry no "
                        "arguments); not read as a rank's trace: analyse the ranks' own traces")
    reader.report(issues)
    for column, (n, example) in sorted(cut.items()):
        issues.append(Issue("warning", "long_text", n, f"'{column}' values longer than {MAX_TEXT_CHARS:,} characters cut "
                                                       f"to that length, e.g. one of {example}"))
    for column, (n, example) in sorted(counters.items()):
        issues.append(Issue("warning", "unrepresentable_value", n,
                            f"'{column}' values that are not in range for their meaning; stored as null, e.g. {example}"))

    raw = _concatenated(chunks, counters)
    del chunks  # each stage drops its input as soon as it is done: peak memory is about two copies
    _return_freed_memory()
    base_ns = _base_time_ns(metadata, issues)
    normalising = time.perf_counter()
    seconds["read_decode"] += normalising - clock  # the metadata after the events array
    events, endpoints = _normalize(raw, base_ns, issues)
    del raw
    seconds["normalise"] = time.perf_counter() - normalising
    return DecodedTrace(events, endpoints, _meta(metadata), issues, reader.stream.raw_bytes, seconds)


def _meta(metadata: dict) -> TraceMeta:
    """Kineto's top-level keys -> TraceMeta, each value checked (baseTimeNanoseconds was, by _base_time_ns)."""
    problems: list[str] = []
    info = checked(metadata.get("distributedInfo"), "distributedInfo", problems, dict) or {}
    meta = TraceMeta(problems=problems)
    meta.rank = checked(info.get("rank"), "distributedInfo.rank", problems, int, (0, schema.MAX_RANK - 1))
    meta.world_size = checked(info.get("world_size"), "distributedInfo.world_size", problems, int, (1, schema.MAX_RANK))
    devices = metadata.get("deviceProperties") or metadata.get("computeProperties") or []
    devices = [d for d in devices if isinstance(d, dict)] if isinstance(devices, list) else []
    names = [checked(d.get("name"), "deviceProperties.name", problems, str) for d in devices]
    sms = [checked(d.get("numSms"), "deviceProperties.numSms", problems, int, (1, 1 << 20)) for d in devices]
    meta.devices = [Device(name=name, sm_count=count) for name, count in zip(names, sms)]
    meta.schema_version = checked(metadata.get("schemaVersion"), "schemaVersion", problems, (int, str))
    meta.backend = checked(info.get("backend"), "distributedInfo.backend", problems, str)
    meta.nccl_version = checked(info.get("nccl_version"), "distributedInfo.nccl_version", problems, (int, str))
    meta.pg_count = checked(info.get("pg_count"), "distributedInfo.pg_count", problems, int, (0, 1 << 31))
    meta.cuda_runtime_version = checked(metadata.get("cuda_runtime_version"), "cuda_runtime_version", problems, (int, str))
    meta.cuda_driver_version = checked(metadata.get("cuda_driver_version"), "cuda_driver_version", problems, (int, str))
    base = metadata.get("baseTimeNanoseconds")
    meta.base_time_ns = base if type(base) is int and 0 <= base <= TIME_LIMIT_NS else None
    meta.display_time_unit = checked(metadata.get("displayTimeUnit"), "displayTimeUnit", problems, str)
    return meta


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
