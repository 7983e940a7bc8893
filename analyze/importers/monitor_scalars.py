"""Importers for DeepSpeed's monitor outputs -> the `scalars` table: csv_monitor CSV files,
TensorBoard event files and W&B offline runs (`run-<id>.wandb`).

DeepSpeed's monitors write on rank 0 only and use step = global_samples (train_batch_size x
optimizer steps), so that is the column every point lands in; the optimizer step is left null here
(the monitor analysis derives it when the run's train_batch_size is known).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections import Counter
from pathlib import Path

import polars as pl

from steplens.analyze.contract import schema
from steplens.analyze.importers.base import Imported, conform, peek
from steplens.analyze.importers.bounded import MAX_BINARY_BYTES, MAX_LINE_BYTES, read_text

MONITOR_RANK = 0  # DeepSpeed's MonitorMaster writes on rank 0 only
SHOWN_LINES = 5  # line numbers quoted in an issue
# Why a point of a TensorBoard or W&B file is skipped or loses its time (the `bad_monitor_point` issue).
POINT_DAMAGE = {
    "value": "the value is not one number a float64 holds; skipped",
    "step": "the step is not a whole number an int64 holds; skipped",
    "wall_time": "the wall time is not a time int64 nanoseconds hold; kept without wall_ns",
}


# Points kept per monitor file: each costs a few hundred bytes until the file's table is built, so a file of any size
# stays within a few hundred MB. A series logged every step of a million-step job fits.
MAX_POINTS = 1_000_000


class Points(list):
    """A file's scalars rows, at most MAX_POINTS of them; the rest are counted, not kept."""

    dropped = 0

    def add(self, row: dict) -> None:
        if len(self) < MAX_POINTS:
            self.append(row)
        else:
            self.dropped += 1


def _result() -> Imported:
    return Imported()


def _frame(rows: Points, issues: list) -> dict[str, pl.DataFrame]:
    if rows.dropped:
        issues.append(["warning", "points_capped", rows.dropped, f"the first {MAX_POINTS:,} points of the file were "
                                                                f"kept, the {rows.dropped:,} after them were not read"])
    return {"scalars": conform(list(rows), "scalars", issues)} if rows else {}


def _wall_ns(seconds) -> int | None:
    """Seconds since the epoch -> int64 nanoseconds; None for anything else (not a number, NaN, out of range)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return None
    try:
        ns = seconds * 1e9
    except OverflowError:  # an integer beyond float64
        return None
    return round(ns) if schema.INT64_RANGE[0] <= ns <= schema.INT64_RANGE[1] else None  # NaN fails the comparison too


def _damage_issues(source: str, damaged: Counter) -> list[list]:
    if not damaged:
        return []
    parts = [f"{count} point(s): {POINT_DAMAGE[kind]}" for kind, count in damaged.items()]
    return [["warning", "bad_monitor_point", sum(damaged.values()), f"{source}: {'; '.join(parts)}"]]


# --- csv_monitor ---------------------------------------------------------------------------------
# DeepSpeed's csv_monitor writes one file per tag, named tag.replace('/', '_').replace(' ', '_') + '.csv',
# opened in append mode, with the header `step,<last tag component>` written the first time a
# process writes the file: a restarted job appends a second header (deepspeed/monitor/csv_monitor.py).



def claims_csv(path: Path) -> bool:
    if path.suffix != ".csv":
        return False
    header = peek(path, 256).split(b"\n", 1)[0].strip().split(b",")
    return len(header) == 2 and header[0] == b"step" and bool(header[1])


def csv_tag(file_stem: str, column: str | None) -> str:
    """The tag a csv_monitor file was written for: `Train_Samples_lr` with column `lr` ->
    `Train/Samples/lr`. The column keeps the last component's own underscores; the '_' before it
    were '/' (or spaces: that cannot be told apart, '/' is DeepSpeed's convention)."""
    if column and file_stem.endswith("_" + column):
        prefix = file_stem[: -len(column) - 1]
        return prefix.replace("_", "/") + "/" + column
    return file_stem


def parse_csv_monitor(path: Path, source: str) -> Imported:
    result = _result()
    text = read_text(path, result.issues)
    rows, bad_lines, headers = Points(), [], []
    segment, column = 0, None
    lines = text.splitlines()
    # csv.writer ends every row with a newline: a last line without one was cut (a killed job, a copy taken
    # mid-write), and its value may have lost digits ("14.0104" of "14.01042938"). It is left out, and said.
    cut = lines.pop() if lines and not text.endswith(("\n", "\r")) else ""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.strip().split(",")
        if len(fields) == 2 and fields[0] == "step":
            if headers:  # a header after data: the job restarted and appended to the file
                segment += 1
            headers.append(number)
            column = column or fields[1]
            continue
        try:
            if len(fields) != 2 or len(line) >= MAX_LINE_BYTES:  # a line cut at the reader's limit lost its end
                raise ValueError(line)
            global_samples, value = int(fields[0]), float(fields[1])  # float() keeps nan and inf
            if not schema.holds_int64(global_samples) or global_samples < 0:  # a count of samples: 0 or more
                raise ValueError(line)
        except ValueError:
            bad_lines.append(number)
            continue
        rows.add({"rank": MONITOR_RANK, "source": source, "origin": "csv_monitor", "segment": segment,
                     "global_samples": global_samples, "value": value})
    name = csv_tag(path.stem, column)
    for row in rows:
        row["name"] = name
    if segment:
        result.issues.append(["warning", "csv_restart", segment,
                              (f"{source}: header written {len(headers)} times (lines {headers[:SHOWN_LINES]}): the job "
                              f"restarted and appended; all {segment + 1} segments kept, told apart by `segment`")])
    if bad_lines:
        result.issues.append(["error", "garbled_lines", len(bad_lines),
                              (f"{source}: {len(bad_lines)} line(s) are not `step,value` (a step of 0 or more; lines "
                              f"{bad_lines[:SHOWN_LINES]}{' ...' if len(bad_lines) > SHOWN_LINES else ''}); skipped, "
                              f"{len(rows)} points kept")])
    if cut.strip():
        result.issues.append(["warning", "truncated", 1,
                              (f"{source}: the last line ({cut[:40]!r}, line {len(lines) + 1}) has no newline: cut off "
                               f"or still being written; skipped, {len(rows)} points kept")])
    if not rows and not bad_lines and not cut.strip():
        result.issues.append(["info", "no_data", 1, f"{source}: csv_monitor file with no points"])
    result.tables = _frame(rows, result.issues)
    return result


# --- TensorBoard ---------------------------------------------------------------------------------
# Read with TensorBoard's own record reader and compat layers (the steps of its EventFileLoader, with an
# undecodable record skipped rather than ending the file). data_compat turns legacy `simple_value`
# summaries (what torch's SummaryWriter writes for DeepSpeed) into scalar tensors, as TF2 summaries already are.
TFRECORD_FRAMING_BYTES = 16  # u64 length + u32 masked crc32c, data, u32 masked crc32c (TFRecord format)


def claims_tensorboard(path: Path) -> bool:
    return path.name.startswith("events.out.tfevents.")


def parse_tensorboard(path: Path, source: str) -> Imported:
    # Imported here: tensorboard pulls in protobuf and numpy, which only event files need.
    from google.protobuf.message import DecodeError
    from tensorboard import data_compat, dataclass_compat
    from tensorboard.backend.event_processing import event_file_loader
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.util import tensor_util

    class RawRecordCounter(event_file_loader.RawEventFileLoader):
        """Counts the complete records (and their bytes) the raw stage handed on."""

        bytes_read = records = 0

        def Load(self):
            for record in super().Load():
                self.bytes_read += len(record) + TFRECORD_FRAMING_BYTES
                self.records += 1
                yield record

    result = _result()
    rows, skipped, damaged, undecodable = Points(), {}, Counter(), 0
    loader = RawRecordCounter(str(path))
    initial_metadata = {}  # dataclass_compat's state: tag -> its first SummaryMetadata
    for record in loader.Load():
        try:
            event = event_pb2.Event.FromString(record)
        except DecodeError:
            undecodable += 1
            continue
        for event in dataclass_compat.migrate_event(data_compat.migrate_event(event), initial_metadata):
            if event.WhichOneof("what") != "summary":
                continue
            wall_ns = _wall_ns(event.wall_time)
            for value in event.summary.value:
                if value.metadata.data_class != summary_pb2.DATA_CLASS_SCALAR:
                    skipped[value.tag] = skipped.get(value.tag, 0) + 1
                    continue
                number = _scalar_value(value.tensor, tensor_util.make_ndarray)
                if number is None:
                    damaged["value"] += 1
                    continue
                if wall_ns is None:
                    damaged["wall_time"] += 1
                rows.add({"rank": MONITOR_RANK, "source": source, "origin": "tensorboard", "name": value.tag,
                             "segment": 0, "global_samples": event.step, "value": number, "wall_ns": wall_ns})
    size = path.stat().st_size
    if loader.bytes_read < size:
        # TensorBoard's loader stops quietly at a truncated or corrupt record; say so.
        result.issues.append(["error", "truncated_event_file", 1,
                              (f"{source}: event records end at byte {loader.bytes_read} of {size} (truncated or "
                              f"corrupt); the {loader.records} complete records before it were kept")])
    if undecodable:
        result.issues.append(["error", "truncated_event_file", undecodable,
                              f"{source}: {undecodable} record(s) are not TensorBoard events (corrupt); skipped"])
    if skipped:
        result.issues.append(["info", "non_scalar_summaries", sum(skipped.values()),
                              f"{source}: non-scalar summaries not read (tags {sorted(skipped)[:SHOWN_LINES]})"])
    result.issues.extend(_damage_issues(source, damaged))
    result.tables = _frame(rows, result.issues)
    return result


def _scalar_value(tensor, make_ndarray) -> float | None:
    """The one number of a scalar summary's tensor (any size-1 numeric tensor, as TensorBoard's scalars
    plugin reads it); None for a damaged one: other shape, text, an undecodable tensor."""
    if math.prod(dim.size for dim in tensor.tensor_shape.dim) != 1:  # before decoding: a shape can claim terabytes
        return None
    try:
        array = make_ndarray(tensor)
    except (TypeError, ValueError):
        return None
    return float(array.item()) if array.size == 1 and array.dtype.kind in "iuf" else None


# --- W&B offline run -----------------------------------------------------------------------------
# `run-<id>.wandb` is a LevelDB log (github.com/google/leveldb doc/log_format.md) after a 7-byte
# header: b':W&B', u16 magic 0xBEE1, u8 version. The log is 32 KiB blocks of chunks
# [u32 crc, u16 length, u8 type, data]; type FULL=1, FIRST=2, MIDDLE=3, LAST=4 reassemble one
# record; a block tail under 7 bytes is zero padding. wandb checks zlib.crc32(type byte + data)
# (checked on wandb 0.31 files). Each record is a serialized wandb `Record` protobuf.
WANDB_MAGIC = b":W&B"
WANDB_HEADER = struct.Struct("<4sHB")
WANDB_HEADER_MAGIC = 0xBEE1
LOG_BLOCK = 32768
LOG_CHUNK_HEADER = struct.Struct("<IHB")
LOG_FULL, LOG_FIRST, LOG_MIDDLE, LOG_LAST = 1, 2, 3, 4

# Field numbers from wandb/proto/wandb_internal.proto (wandb 0.31.0, read from the descriptors of
# wandb_internal_pb2): Record.history=2, .summary=3, .config=5, .run=17;
# HistoryRecord.item=1, .step=2 (HistoryStep.num=1); HistoryItem.key=1, .nested_key=2, .value_json=16;
# RunRecord.run_id=1, .entity=2, .project=3, .config=4 (ConfigRecord.update=1: ConfigItem key=1,
# nested_key=2, value_json=16), .run_group=6, .host=13, .git=21 (GitRepoRecord remote_url=1, commit=2).
RECORD_HISTORY, RECORD_RUN = 2, 17
HISTORY_ITEM, HISTORY_STEP, STEP_NUM = 1, 2, 1
ITEM_KEY, ITEM_NESTED_KEY, ITEM_VALUE_JSON = 1, 2, 16
RUN_ID, RUN_ENTITY, RUN_PROJECT, RUN_CONFIG, RUN_GROUP, RUN_HOST, RUN_GIT = 1, 2, 3, 4, 6, 13, 21
GIT_REMOTE, GIT_COMMIT = 1, 2
CONFIG_UPDATE = 1
WANDB_AXES = {"_step", "_runtime", "_timestamp"}  # wandb adds these to every history row


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def proto_fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) of one protobuf message: varints as int, length-delimited as bytes,
    fixed64/fixed32 as their raw bytes (protobuf wire format: protobuf.dev/programming-guides/encoding)."""
    fields, pos = [], 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            value, pos = buf[pos:pos + width], pos + width
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        fields.append((number, value))
    return fields


def wandb_records(data: bytes) -> tuple[list[bytes], list[str]]:
    """Records of a .wandb file and the problems met (corrupt chunks skip to the next block, as
    LevelDB's own reader does; a cut-off tail ends the read)."""
    problems, records, pending = [], [], None
    pos = WANDB_HEADER.size
    while pos < len(data):
        room = LOG_BLOCK - pos % LOG_BLOCK
        if room < LOG_CHUNK_HEADER.size:  # block trailer padding
            pos += room
            continue
        if pos + LOG_CHUNK_HEADER.size > len(data):
            problems.append(f"file ends inside a chunk header at byte {pos}")
            break
        crc, length, kind = LOG_CHUNK_HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0 and crc == 0:  # preallocated zeros: the writer stopped here
            break
        chunk = data[pos + LOG_CHUNK_HEADER.size:pos + LOG_CHUNK_HEADER.size + length]
        if len(chunk) < length:
            problems.append(f"file ends inside a record at byte {pos} (needs {length} bytes, has {len(chunk)})")
            break
        if zlib.crc32(bytes([kind]) + chunk) != crc or kind not in (LOG_FULL, LOG_FIRST, LOG_MIDDLE, LOG_LAST):
            problems.append(f"corrupt chunk at byte {pos}: skipped to the next 32 KiB block")
            pending = None
            pos += room
            continue
        pos += LOG_CHUNK_HEADER.size + length
        if kind == LOG_FULL:
            records.append(chunk)
        elif kind == LOG_FIRST:
            pending = chunk
        elif pending is not None:
            pending += chunk
            if kind == LOG_LAST:
                records.append(pending)
                pending = None
    if pending is not None:
        problems.append("the last record is incomplete")
    return records, problems


def _item(buf: bytes) -> tuple[str, object]:
    """(key, decoded value) of a HistoryItem or ConfigItem; nested keys joined with '.' as wandb
    flattens nested dicts. Non-JSON values come back as None."""
    key, nested, raw = "", [], None
    for number, value in proto_fields(buf):
        if number == ITEM_KEY:
            key = value.decode()
        elif number == ITEM_NESTED_KEY:
            nested.append(value.decode())
        elif number == ITEM_VALUE_JSON:
            raw = value.decode()
    try:
        decoded = json.loads(raw) if raw is not None else None  # json reads NaN, Infinity, -Infinity
    except (ValueError, RecursionError):
        decoded = None
    return key or ".".join(nested), decoded


def _run_facts(buf: bytes) -> dict:
    names = {RUN_ID: "run_id", RUN_ENTITY: "entity", RUN_PROJECT: "project", RUN_GROUP: "group", RUN_HOST: "host"}
    facts, config = {}, {}
    for number, value in proto_fields(buf):
        if number in names:
            facts[names[number]] = value.decode()
        elif number == RUN_CONFIG:
            for sub_number, update in proto_fields(value):
                if sub_number == CONFIG_UPDATE:
                    key, decoded = _item(update)
                    if not key.startswith("_wandb"):
                        config[key] = decoded
        elif number == RUN_GIT:
            git = dict(proto_fields(value))
            facts.update({name: git[field].decode() for name, field in (("git_remote", GIT_REMOTE), ("git_commit", GIT_COMMIT))
                          if field in git})
    facts["config"] = config
    return facts


def claims_wandb(path: Path) -> bool:
    return path.suffix == ".wandb" and path.name.startswith("run-")


def parse_wandb(path: Path, source: str) -> Imported:
    result = _result()
    if (size := path.stat().st_size) > MAX_BINARY_BYTES:  # its records are decoded from the whole file in memory
        result.issues.append(["error", "oversized_file", 1, f"{source}: {size / 2**20:,.0f} MiB, over the "
                                                           f"{MAX_BINARY_BYTES >> 20} MiB a W&B log may have; not read"])
        return result
    data = path.read_bytes()
    if len(data) < WANDB_HEADER.size or WANDB_HEADER.unpack_from(data)[:2] != (WANDB_MAGIC, WANDB_HEADER_MAGIC):
        result.issues.append(["error", "not_a_wandb_log", 1,
                              f"{source}: does not start with the W&B log header (b':W&B' + 0xBEE1); nothing read"])
        return result
    records, problems = wandb_records(data)
    rows, undecodable, non_numeric, damaged = Points(), 0, set(), Counter()
    for record in records:
        try:
            fields = proto_fields(record)
            for number, value in fields:
                if number == RECORD_RUN:
                    result.facts["wandb"] = _run_facts(value)
                elif number == RECORD_HISTORY:
                    for row in _history_rows(value, source, non_numeric, damaged):
                        rows.add(row)
        # TypeError, AttributeError: a field of another wire type (a number where bytes belong).
        except (ValueError, IndexError, UnicodeDecodeError, TypeError, AttributeError):
            undecodable += 1
    if problems:
        result.issues.append(["error", "truncated_wandb_log", len(problems),
                              f"{source}: {'; '.join(problems[:SHOWN_LINES])}; {len(records)} complete records kept"])
    if undecodable:
        result.issues.append(["error", "bad_wandb_record", undecodable,
                              f"{source}: {undecodable} record(s) are not valid protobuf; skipped"])
    if non_numeric:
        result.issues.append(["info", "non_numeric_history", len(non_numeric),
                              f"{source}: non-numeric history keys not read: {sorted(non_numeric)[:SHOWN_LINES]}"])
    result.issues.extend(_damage_issues(source, damaged))
    result.tables = _frame(rows, result.issues)
    return result


def _history_rows(buf: bytes, source: str, non_numeric: set, damaged: Counter) -> list[dict]:
    """One scalars row per numeric key of a history row; `_step` is DeepSpeed's global_samples. Points
    that cannot be stored as written are counted in `damaged` (POINT_DAMAGE's kinds)."""
    items, step = {}, None
    for number, value in proto_fields(buf):
        if number == HISTORY_ITEM:
            key, decoded = _item(value)
            items[key] = decoded
        elif number == HISTORY_STEP:
            step = dict(proto_fields(value)).get(STEP_NUM, 0)  # proto3: a zero num is not written
    step = items.get("_step", step)
    step_ok = step is None or schema.holds_int64(step)
    timestamp = items.get("_timestamp")
    wall_ns = _wall_ns(timestamp)
    rows = []
    for key, value in items.items():
        if key in WANDB_AXES:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            non_numeric.add(key)
            continue
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float64
            damaged["value"] += 1
            continue
        if not step_ok:
            damaged["step"] += 1
            continue
        if wall_ns is None and timestamp is not None:
            damaged["wall_time"] += 1
        rows.append({"rank": MONITOR_RANK, "source": source, "origin": "wandb", "name": key, "segment": 0,
                     "global_samples": step, "value": number, "wall_ns": wall_ns})
    return rows
