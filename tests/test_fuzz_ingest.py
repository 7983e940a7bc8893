"""Hostile inputs (issue #13): mutated real traces never crash `analyze`, never wrap a number and never
cost more than the damaged event.

Every case takes a real corpus trace, changes one thing (a number, a type, the nesting, a truncation
point, a duplicated rank, a special file), runs `analyze` on a run folder holding it next to an
untouched rank, and checks: no traceback, an exit status from the documented set, the damage named
in ingest_issues, and every event the mutation did not touch still in trace_events. The ground truth
for the last is the original file read with the stdlib json (ts exact through Decimal), which shares
no code with steplens.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from isal import isal_zlib

from steplens.analyze.pipeline import ingest
from steplens.analyze.cli import analyze

from conftest import CORPUS

SAMPLED = "HolisticTraceAnalysis/trace_filter/sampled_rank-{}.json.gz"  # ranks 0 and 1 of 128, absolute ts
RELATIVE = "TraceLens/h100/gaunernst_bert-small-uncased__1016001.json.gz"  # ts relative to baseTimeNanoseconds
DOCUMENTED_EXITS = {0, 1, 2}


@dataclass
class Trace:
    text: str
    spans: list[tuple[int, int]]  # where each element of traceEvents starts and ends in text
    events: list[dict]  # the elements, read by the stdlib with exact (Decimal) numbers
    base_ns: int


def _load(relative: str) -> Trace:
    return _read(gzip.decompress((CORPUS / relative).read_bytes()).decode())


def _read(text: str) -> Trace:
    doc = json.loads(text, parse_float=Decimal)
    decoder = json.JSONDecoder()
    pos = text.index("[", text.index('"traceEvents"')) + 1
    spans = []
    while True:
        while text[pos] in " \n\r\t,":
            pos += 1
        if text[pos] == "]":
            break
        _, end = decoder.raw_decode(text, pos)
        spans.append((pos, end))
        pos = end
    return Trace(text, spans, doc["traceEvents"], int(doc.get("baseTimeNanoseconds") or 0))


@pytest.fixture(scope="module")
def traces() -> dict[str, Trace]:
    if not CORPUS.is_dir():
        pytest.skip(f"shared corpus not found at {CORPUS}")
    return {"rank0": _load(SAMPLED.format(0)), "rank1": _load(SAMPLED.format(1)), "relative": _load(RELATIVE)}


def expected_events(trace: Trace, touched: set[int] = frozenset(), base_ns: int | None = None) -> Counter:
    """(name, ts in ns) of every complete or instant event the mutation left alone, from the stdlib's reading."""
    base = trace.base_ns if base_ns is None else base_ns
    return Counter((e.get("name"), int(Decimal(e["ts"]) * 1000) + base) for i, e in enumerate(trace.events)
                   if i not in touched and e.get("ph") in ("X", "i", "I") and "ts" in e)


# ---------------------------------------------------------------------------------------------
# Mutations: each edits the original text in place, so every other byte stays as written.


def set_value(trace: Trace, index: int, key: str, raw: str | None) -> str:
    """The event's top-level `key` set to the raw JSON text `raw` (None: the key removed, absent: added)."""
    start, end = trace.spans[index]
    span = trace.text[start:end]
    at = span.find(f'"{key}": ')  # top-level keys come before args in these traces
    if at < 0:
        span = span[:-1] + f', "{key}": {raw}}}'
    else:
        value_end = json.JSONDecoder().raw_decode(span, at + len(key) + 4)[1]
        if raw is None:
            span = span[:at] + span[value_end:].removeprefix(", ")
        else:
            span = span[:at + len(key) + 4] + raw + span[value_end:]
    return trace.text[:start] + span + trace.text[end:]


def add_arg(trace: Trace, index: int, key: str, raw: str) -> str:
    """args[key] set to the raw JSON text (replaced when the event has it, else added)."""
    start, end = trace.spans[index]
    span = trace.text[start:end]
    args_at = span.index('"args": {')
    at = span.find(f'"{key}": ', args_at)
    if at < 0:
        span = span.replace('"args": {', f'"args": {{"{key}": {raw}, ', 1)
    else:
        value_end = json.JSONDecoder().raw_decode(span, at + len(key) + 4)[1]
        span = span[:at + len(key) + 4] + raw + span[value_end:]
    return trace.text[:start] + span + trace.text[end:]


def set_top(trace: Trace, key: str, raw: str) -> str:
    """A top-level key (before traceEvents) set to raw JSON text."""
    return trace.text.replace("{", f'{{"{key}": {raw}, ', 1)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def first(trace: Trace, predicate: Callable[[dict], bool], after: int = 0) -> int:
    return next(i for i, e in enumerate(trace.events) if i >= after and predicate(e))


def is_cpu_op(e: dict) -> bool:
    return e.get("ph") == "X" and e.get("cat") == "cpu_op" and "args" in e


# ---------------------------------------------------------------------------------------------
# Running analyze


@dataclass
class Outcome:
    exit_code: int
    output: str
    issues: list[dict]
    events: dict[int, Counter]  # rank -> (name, ts_ns)
    out_dir: Path
    seconds: float
    manifest: dict = field(default_factory=dict)


def run_analyze(run_dir: Path, *extra: str) -> Outcome:
    started = time.perf_counter()
    result = CliRunner().invoke(analyze, [str(run_dir), "-q", "-j", "1", *extra])
    seconds = time.perf_counter() - started
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    assert result.exit_code in DOCUMENTED_EXITS, result.output
    out = run_dir / ".steplens"
    issues, events = [], {}
    if (out / "run.json").exists():
        issues = [row for part in sorted((out / "ingest_issues").glob("*.parquet")) for row in pq.read_table(part).to_pylist()]
        for part in (out / "trace_events").glob("rank=*/*.parquet"):
            rank = int(part.parent.name.split("=")[1])
            table = pq.read_table(part, columns=["name", "ts_ns"]).to_pydict()
            events.setdefault(rank, Counter()).update(zip(table["name"], table["ts_ns"]))
    manifest = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    return Outcome(result.exit_code, result.output, issues, events, out, seconds, manifest)


def assert_untouched_present(outcome: Outcome, rank: int, expected: Counter, touched: int = 0) -> None:
    actual = outcome.events.get(rank, Counter())
    missing = expected - actual
    assert not missing, f"{sum(missing.values())} untouched events lost, e.g. {list(missing)[:3]}"
    assert sum(actual.values()) <= sum(expected.values()) + touched


def two_rank_run(tmp_path: Path, traces: dict, rank1_text: str | bytes, name: str = "rank1.json") -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.json").write_text(traces["rank0"].text)
    data = rank1_text.encode() if isinstance(rank1_text, str) else rank1_text
    (run / name).write_bytes(data)
    return run


# ---------------------------------------------------------------------------------------------
# The issue's cases, by name: one event or value damaged, the rest of the rank kept.


@dataclass
class Case:
    mutate: Callable[[Trace], tuple[str, set[int]]]  # -> (rank 1's text, indices of touched events)
    reasons: set[str]  # at least one of these is reported for rank 1
    # Run the analyses and the report too (where the issue saw the value do harm); else ingest only.
    analyses: bool = False


def _event_value(key: str, raw: str, reasons: set[str], predicate=is_cpu_op) -> Case:
    def mutate(t: Trace):
        i = first(t, predicate, after=len(t.events) // 2)
        return set_value(t, i, key, raw), {i}
    return Case(mutate, reasons)


def _step_value(key: str, raw: str, reasons: set[str]) -> Case:
    def mutate(t: Trace):
        i = first(t, lambda e: str(e.get("name", "")).startswith("ProfilerStep#"))
        return set_value(t, i, key, raw), {i}
    return Case(mutate, reasons, analyses=True)


def _header(old: str, new: str, reasons: set[str]) -> Case:
    """Text of the header (before traceEvents) replaced."""
    def mutate(t: Trace):
        assert old in t.text[:t.text.index('"traceEvents"')]
        return t.text.replace(old, new, 1), set()
    return Case(mutate, reasons, analyses=True)


def _nan_at(position: str) -> Case:
    def mutate(t: Trace):
        i = 0 if position == "first" else first(t, is_cpu_op, after=len(t.events) // 2)
        return set_value(t, i, "dur", "NaN"), {i}
    return Case(mutate, {"malformed_event"})


def _deep_args(t: Trace):
    i = first(t, is_cpu_op, after=len(t.events) // 3)
    return add_arg(t, i, "deep", nested(5000)), {i}


def _nelems(t: Trace):
    i = first(t, is_cpu_op, after=len(t.events) // 2)
    text = add_arg(t, i, "In msg nelems", str(2**62))
    text = text.replace('"args": {"In msg nelems"', '"args": {"Collective name": "allreduce", "In msg nelems"', 1)
    return text, set()


TIME_BEYOND = {"bad_timestamp"}
CASES = {
    "ts 1e30": _event_value("ts", "1e30", TIME_BEYOND),
    "ts 1e400": _event_value("ts", "1e400", TIME_BEYOND),
    "ts 'Infinity'": _event_value("ts", '"Infinity"', TIME_BEYOND),
    "ts 1e999999": _event_value("ts", "1e999999", TIME_BEYOND),
    "ts 1e999990 (48 s of CPU before)": _event_value("ts", "1e999990", TIME_BEYOND),
    "ts of 25 digits": _event_value("ts", "1682725898081806000000000", TIME_BEYOND),
    "ts missing": _event_value("ts", None, {"missing_timestamp"}),
    "dur 1e30": _event_value("dur", "1e30", {"bad_duration"}),
    "dur 'Infinity'": _event_value("dur", '"Infinity"', {"bad_duration"}),
    "ProfilerStep dur 9.2e15 us (int64 wrap)": _step_value("dur", "9.2e15", {"bad_duration"}),
    "ProfilerStep#99999999999999999999999": _step_value("name", '"ProfilerStep#99999999999999999999999"', {"bad_step_number"}),
    "ProfilerStep#-5": _step_value("name", '"ProfilerStep#-5"', {"bad_step_number"}),
    "ProfilerStep# without a number": _step_value("name", '"ProfilerStep#"', {"bad_step_number"}),
    "NaN token mid-file": _nan_at("middle"),
    "NaN token in the first chunk": _nan_at("first"),
    "args nested 5000 deep": Case(_deep_args, {"nesting_too_deep"}),
    "metadata nested 5000 deep": Case(lambda t: (set_top(t, "deep", nested(5000)), set()), {"nesting_too_deep"}),
    "In msg nelems 2**62 (negative busbw)": Case(_nelems, {"unrepresentable_value"}),
    "deviceProperties name 5": Case(lambda t: (set_top(t, "deviceProperties", '[{"name": 5}]'), set()), {"bad_metadata"},
                                    analyses=True),
    "distributedInfo.rank true": _header('"rank": 1,', '"rank": true,', {"bad_metadata"}),
    "distributedInfo.rank 2**63-1": _header('"rank": 1,', f'"rank": {2**63 - 1},', {"bad_metadata"}),
    "distributedInfo.rank 2**70": _header('"rank": 1,', f'"rank": {2**70},', {"bad_metadata"}),
    "distributedInfo.world_size 2**70": _header('"world_size": 128', f'"world_size": {2**70}', {"bad_metadata"}),
    "distributedInfo a list": _header('"distributedInfo": {', '"distributedInfo": [1, 2], "was": {', {"bad_metadata"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_issue_case_costs_only_the_damaged_value(tmp_path, traces, name):
    case = CASES[name]
    text, touched = case.mutate(traces["rank1"])
    outcome = run_analyze(two_rank_run(tmp_path, traces, text), *([] if case.analyses else ["--ingest-only"]))
    reasons = {i["reason"] for i in outcome.issues if i["file"] == "rank1.json"}
    assert reasons & case.reasons, (name, reasons)
    assert_untouched_present(outcome, 0, expected_events(traces["rank0"]))
    # A rank that lost its distributedInfo.rank takes the one in its file name: rank 1 either way.
    assert_untouched_present(outcome, 1, expected_events(traces["rank1"], touched), len(touched))
    assert outcome.seconds < 60  # 1e999990 used to burn 48 s of CPU in Decimal


def test_no_wrapped_numbers_reach_the_tables(tmp_path, traces):
    """The wraps the issue saw: a ProfilerStep end before its start, negative bytes or busbw."""
    text, _ = _step_value("dur", "9.2e15", set()).mutate(traces["rank1"])
    text, _ = _nelems(_read(text))
    outcome = run_analyze(two_rank_run(tmp_path, traces, text))
    steps = pq.read_table(outcome.out_dir / "steps").to_pylist()
    assert steps and all(s["end_ns"] >= s["start_ns"] and s["dur_ns"] >= 0 for s in steps)
    assert 551 not in {s["step"] for s in steps if s["rank"] == 1}  # its duration was damage
    collectives = outcome.out_dir / "collectives"
    if collectives.exists():
        for row in pq.read_table(collectives).to_pylist():
            assert (row.get("busbw_gbps") or 0) >= 0 and (row.get("bytes") or 0) >= 0
    nelems = [i for i in outcome.issues if i["reason"] == "unrepresentable_value"]
    assert nelems and "In msg nelems" in nelems[0]["detail"] and str(2**62) in nelems[0]["detail"]


@pytest.mark.parametrize("base", [10**23, 2**63 - 10, -5, '"soon"'])
def test_bad_base_time_is_named_and_times_stay_as_written(tmp_path, traces, base):
    trace = traces["relative"]
    old = f'"baseTimeNanoseconds": {trace.base_ns}'
    assert old in trace.text
    run = tmp_path / "run"
    run.mkdir()
    (run / "trace.json").write_text(trace.text.replace(old, f'"baseTimeNanoseconds": {base}'))
    outcome = run_analyze(run, "--ingest-only")
    assert "bad_base_time" in {i["reason"] for i in outcome.issues}
    assert_untouched_present(outcome, 0, expected_events(trace, base_ns=0))


# ---------------------------------------------------------------------------------------------
# Generated mutations: a real event's fields given values of the wrong type or out of range.

CONTAINERS = ["[]", "[1, [2]]", "{}", '{"a": {"b": 1}}']
OUT_OF_INT64 = [str(2**64), "-" + str(2**63 + 1), "1e400"]
WRONG_VALUES = ["null", "true", "-1", "3.5", '"text"', '"12"', *CONTAINERS, *OUT_OF_INT64]
# What a value must be, and which wrong values are damage to be named (others are readable:
# "12" for a number, 3.5 µs for a time, a number where a name belongs).
TIME_FIELDS = {"ts", "dur"}
INT_FIELDS = {"pid", "tid", "correlation", "External id", "stream", "device", "bytes"}
ARG_FIELDS = {"correlation", "External id", "stream", "device", "bytes", "flops", "Input Dims"}


def must_be_named(key: str, raw: str) -> bool:
    if key in TIME_FIELDS:
        return raw not in ("-1", "3.5", '"12"')
    if key in INT_FIELDS:
        return raw in (*CONTAINERS, *OUT_OF_INT64, "true", "3.5")
    if key == "flops":
        return raw in (*CONTAINERS, "1e400", "true", "-1", '"text"', "-" + str(2**63 + 1))
    if key in ("ph", "cat", "name"):
        return raw in (*CONTAINERS, "1e400")
    if key == "args":
        return raw not in ("null", "{}", '{"a": {"b": 1}}')
    return False


def _generated(seed: int = 13, count: int = 30) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    fields = sorted(TIME_FIELDS | {"pid", "tid", "ph", "cat", "name", "args"} | {f"args.{k}" for k in ARG_FIELDS})
    return [(rng.choice(fields), rng.choice(WRONG_VALUES)) for _ in range(count)]


@pytest.mark.parametrize("key, raw", _generated())
def test_wrong_type_costs_at_most_its_event(tmp_path, traces, key, raw):
    t = traces["rank1"]
    i = first(t, is_cpu_op, after=len(t.events) // 2)
    text = add_arg(t, i, key[5:], raw) if key.startswith("args.") else set_value(t, i, key, raw)
    path = tmp_path / "rank1.json"
    path.write_text(text)
    parsed = ingest.read_trace(path, "rank1.json")
    kept = Counter(zip(parsed.events["name"].to_list(), parsed.events["ts_ns"].to_list()))
    assert not expected_events(t, {i}) - kept
    assert parsed.events.height <= sum(expected_events(t).values())
    if must_be_named(key.removeprefix("args."), raw):
        assert [i for i in parsed.issues if i.severity != "info" or i.reason == "unsupported_phase"], (key, raw)


# ---------------------------------------------------------------------------------------------
# Truncation points, bytes after the data, gzip members


def _cut_off(trace: Trace, cut: int) -> set[int]:
    return {i for i, (_, end) in enumerate(trace.spans) if end > cut}


@pytest.mark.parametrize("where", ["in the header", "inside the first event", "middle", "before the closing bracket"])
def test_truncation_points(tmp_path, traces, where):
    t = traces["rank1"]
    cut = {"in the header": t.text.index('"traceEvents"') - 10,
           "inside the first event": t.spans[0][0] + 20,
           "middle": (t.spans[len(t.spans) // 2][0] + t.spans[len(t.spans) // 2][1]) // 2,
           "before the closing bracket": t.spans[-1][1]}[where]
    outcome = run_analyze(two_rank_run(tmp_path, traces, t.text[:cut]), "--ingest-only")
    rank1 = [i for i in outcome.issues if i["file"] == "rank1.json"]
    errors = {i["reason"] for i in rank1 if i["severity"] == "error"}
    assert outcome.exit_code == 1 and errors  # partial results: a file (or rank) lost
    if where in ("in the header", "inside the first event"):  # the whole rank is lost: an error, not a note
        assert errors & {"damaged_trace", "no_events"} and 1 not in outcome.events
    else:
        assert "truncated" in errors
        assert_untouched_present(outcome, 1, expected_events(t, _cut_off(t, cut)))
    assert_untouched_present(outcome, 0, expected_events(traces["rank0"]))


@pytest.mark.parametrize("tail, reason", [(b"\0" * 100_000, "zero_padding"), (b"garbage\n" * 10, "trailing_garbage")])
def test_bytes_after_a_complete_gzip_are_not_a_truncation(tmp_path, traces, tail, reason):
    data = gzip.compress(traces["rank1"].text.encode(), compresslevel=1) + tail
    outcome = run_analyze(two_rank_run(tmp_path, traces, data, "rank1.json.gz"), "--ingest-only")
    reasons = {i["reason"]: i["severity"] for i in outcome.issues if i["file"] == "rank1.json.gz"}
    assert reasons.get(reason) in ("info", "warning") and "truncated" not in reasons
    assert outcome.exit_code == 0
    assert_untouched_present(outcome, 1, expected_events(traces["rank1"]))
    detail = next(i["detail"] for i in outcome.issues if i["reason"] == reason)
    assert "b''" not in detail  # no empty example: after gzip data only the count is kept


def test_every_gzip_member_is_read(tmp_path, traces):
    data = traces["rank1"].text.encode()
    third = len(data) // 3
    members = b"".join(gzip.compress(data[a:b], compresslevel=1) for a, b in ((0, third), (third, 2 * third), (2 * third, None)))
    outcome = run_analyze(two_rank_run(tmp_path, traces, members, "rank1.json.gz"), "--ingest-only")
    assert outcome.exit_code == 0 and not [i for i in outcome.issues if i["file"] == "rank1.json.gz"]
    assert outcome.events[1] == expected_events(traces["rank1"])


def test_garbage_after_the_json_document_is_named(tmp_path, traces):
    outcome = run_analyze(two_rank_run(tmp_path, traces, traces["rank1"].text + "\n}}junk"), "--ingest-only")
    assert "trailing_garbage" in {i["reason"] for i in outcome.issues if i["file"] == "rank1.json"}
    assert outcome.events[1] == expected_events(traces["rank1"]) and outcome.exit_code == 0


@pytest.mark.parametrize("junk", [b"\x00\x01junk" * 50, b"{not json at all, disk error"])
def test_a_damaged_json_file_is_a_lost_rank(tmp_path, traces, junk):
    """Junk named like a trace is an error (exit 1), not an informational 'not a trace', a brace first included."""
    outcome = run_analyze(two_rank_run(tmp_path, traces, junk, "rank1.json"), "--ingest-only")
    assert outcome.exit_code == 1
    assert {"damaged_trace"} <= {i["reason"] for i in outcome.issues if i["severity"] == "error"}


@pytest.mark.parametrize("damaged", ["one kernel", "every kernel"])
def test_a_trace_that_lost_a_tenth_of_its_events_is_data_lost(tmp_path, traces, damaged):
    """Kernels whose dur is NaN (no JSON number) are skipped: one of them is a warning, every kernel (far more than
    a tenth of the file's elements, counted here from the raw text) is data lost: an error, exit 1."""
    t = traces["rank1"]
    kernels = [i for i, e in enumerate(t.events) if e.get("cat") == "kernel" and "dur" in e]
    assert len(kernels) >= 0.2 * len(t.events)
    text = t.text
    for i in reversed(kernels if damaged == "every kernel" else kernels[:1]):  # from the end: earlier spans hold
        text = set_value(Trace(text, t.spans, t.events, t.base_ns), i, "dur", "NaN")
    outcome = run_analyze(two_rank_run(tmp_path, traces, text), "--ingest-only")
    lost = [i for i in outcome.issues if i["reason"] == "events_lost"]
    if damaged == "one kernel":
        assert outcome.exit_code == 0 and not lost
    else:
        assert outcome.exit_code == 1 and [(i["severity"], i["count"]) for i in lost] == [("error", len(kernels))]


@pytest.mark.parametrize("text", [b'{"train_batch_size": 8, "bf16": {"enabled": true}}',
                                  b'{"iteration": 19, "loss": 1.2}\n{"iteration": 39, "loss": 1.1}\n',  # JSON Lines
                                  b'{"loss": NaN, "step": 3}'])  # Python's json.dump of a diverged run
def test_another_json_format_is_no_trace_and_no_error(tmp_path, traces, text):
    outcome = run_analyze(two_rank_run(tmp_path, traces, text, "metrics.json"), "--ingest-only")
    assert outcome.exit_code == 0
    assert [i["reason"] for i in outcome.issues if i["file"] == "metrics.json"] == ["not_a_trace"]


def test_a_stray_quote_between_events_costs_no_event(tmp_path, traces):
    """`, "x{...}`: read as a string, the quote would take the next event's start with it."""
    t = traces["rank1"]
    i = len(t.spans) // 2
    parsed = _parse_text(tmp_path, t.text[:t.spans[i][1]] + ', "x' + t.text[t.spans[i][1]:].lstrip(", "))
    assert _kept(parsed) == expected_events(t)


def test_a_rank_in_a_name_beyond_any_job_is_named_not_taken(tmp_path, traces):
    """rank9223372036854775808 in a file name (2^63: no int64 holds it) is not a rank: a warning, and the trace
    and the log are read as files that state none."""
    run = tmp_path / "run"
    run.mkdir()
    huge = str(1 << 63)
    doc = json.loads(traces["rank0"].text)
    doc.pop("distributedInfo", None)
    (run / f"trace_rank{huge}.json").write_text(json.dumps(doc))
    log = next((CORPUS.parent / "deepspeed-cpu-runs" / "run1" / "rank_logs").glob("*.log"), None)
    if log is not None:
        (run / f"train_rank{huge}.log").write_bytes(log.read_bytes())
    outcome = run_analyze(run)
    ignored = [i for i in outcome.issues if i["reason"] == "rank_in_name_ignored"]
    assert sorted(i["file"] for i in ignored) == sorted(p.name for p in run.iterdir() if p.is_file())
    assert all(huge in i["detail"] and i["severity"] == "warning" for i in ignored)
    assert outcome.exit_code == 0 and sorted(outcome.events) == [0]  # the only trace: rank 0, assumed
    assert "rank_assumed" in {i["reason"] for i in outcome.issues}


def test_duplicated_rank_is_named(tmp_path, traces):
    run = two_rank_run(tmp_path, traces, traces["rank1"].text)
    (run / "rank1_copy.json").write_text(traces["rank1"].text)
    outcome = run_analyze(run, "--ingest-only")
    assert "duplicate_rank" in {i["reason"] for i in outcome.issues}
    assert outcome.events[1] == expected_events(traces["rank1"])  # counted once


def test_of_two_claims_on_a_rank_the_file_named_for_it_is_kept(tmp_path, traces):
    """rank1's trace (distributedInfo.rank 1) also copied as rank0-old.json, which sorts first: the misnamed copy is
    the duplicate, and its name's disagreement with its trace is said (only there: files named by local rank
    disagree on every node but the first, and are no problem)."""
    assert traces["rank1"].text.count('"rank": 1') >= 1  # the trace records its rank
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0-old.json").write_text(traces["rank1"].text)
    (run / "rank1.json").write_text(traces["rank1"].text)
    outcome = run_analyze(run, "--ingest-only")
    by_file = {(i["file"], i["reason"]) for i in outcome.issues}
    assert ("rank0-old.json", "duplicate_rank") in by_file and ("rank0-old.json", "rank_name_disagrees") in by_file
    assert not {reason for file, reason in by_file if file == "rank1.json"} & {"duplicate_rank", "rank_name_disagrees"}
    assert outcome.events[1] == expected_events(traces["rank1"])
    (run / "rank0-old.json").rename(tmp_path / "elsewhere.json")
    (run / "rank1.json").rename(run / "node1_local_rank0.json")  # named by local rank, alone: nothing to say
    alone = run_analyze(run, "--ingest-only")
    assert alone.exit_code == 0 and "rank_name_disagrees" not in {i["reason"] for i in alone.issues}


# ---------------------------------------------------------------------------------------------
# Special files and memory: these run analyze in a subprocess, so a hang or a blow-up fails the test.


def test_special_files_are_skipped_unopened(tmp_path, traces):
    run = two_rank_run(tmp_path, traces, traces["rank1"].text)
    os.mkfifo(run / "rank-3.json")  # opening it would block forever
    (run / "rank-4.json").symlink_to("/dev/zero")  # an endless device
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(run / "rank-5.json"))
    (run / "loop-1").symlink_to("loop-2")  # links that lead to no file: nothing to read, nothing lost
    (run / "loop-2").symlink_to("loop-1")
    (run / "rank-6.json").symlink_to("gone.json")
    analyze_script = Path(sys.executable).with_name("analyze")
    try:
        proc = subprocess.run([sys.executable, "-m", "steplens.analyze", str(run), "-q", "--ingest-only"],
                              capture_output=True, text=True, timeout=120)
        # the default mode fingerprints every file for a re-run first: a FIFO must not be opened there either
        fresh, replayed = (subprocess.run([analyze_script, str(run), "-q", "--out", str(tmp_path / "full")],
                                          capture_output=True, text=True, timeout=120) for _ in range(2))
    finally:
        listener.close()
    assert proc.returncode in DOCUMENTED_EXITS and "Traceback" not in proc.stderr, proc.stderr
    assert fresh.returncode == replayed.returncode == 0, fresh.stderr + replayed.stderr  # nothing was lost
    assert "unchanged" in replayed.stdout + replayed.stderr
    manifest = json.loads((run / ".steplens" / "run.json").read_text())
    special = {s["path"]: s["issues"][0][:2] for s in manifest["sources"] if s["path"].startswith(("rank-", "loop-"))}
    assert special == {"rank-3.json": ["warning", "special_file"], "rank-4.json": ["warning", "special_file"],
                       "rank-5.json": ["warning", "special_file"], "rank-6.json": ["warning", "broken_link"],
                       "loop-1": ["warning", "broken_link"], "loop-2": ["warning", "broken_link"]}
    assert sorted(manifest["trace_ranks"]) == [0, 1]


STRING_MB, ZEROS_MB = 300, 1024
MEMORY_PROBE = """
import sys
from pathlib import Path
from steplens.analyze.pipeline import ingest

def peak_mb():  # VmHWM starts afresh at exec (getrusage's maxrss would carry pytest's over)
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
    return int(line.split()[1]) / 1024

before = peak_mb()
parsed = ingest.read_trace(Path(sys.argv[1]), "x")
print(parsed.events.height, peak_mb() - before, sorted(i.reason for i in parsed.issues))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak memory from /proc")
def test_memory_follows_the_chunk_size_not_the_content(tmp_path, traces):
    """An unterminated 300 MB string inside a 300 kB gzip, and a 1 GB zero tail (a sparse file): the
    parser holds at most one event's bound, not the content (it used to hold several copies of it)."""
    t = traces["rank1"]
    i = len(t.spans) // 2
    head = t.text[: t.spans[i][0]] + '{"ph": "X", "name": "'
    string_gz = tmp_path / "string.json.gz"
    deflate = isal_zlib.compressobj(1, isal_zlib.DEFLATED, 31)
    string_gz.write_bytes(deflate.compress(head.encode()) + b"".join(deflate.compress(b"A" * (1 << 20)) for _ in range(STRING_MB))
                          + deflate.flush())
    zeros = tmp_path / "zeros.json"
    zeros.write_text(t.text)
    with open(zeros, "r+b") as f:
        f.truncate(len(t.text.encode()) + (ZEROS_MB << 20))  # a hole: reads as zeros, takes no disk
    for path, kept, reason in ((string_gz, i, "truncated"), (zeros, None, "zero_padding")):
        proc = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(path)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        events, grown_mb, reasons = proc.stdout.split(maxsplit=2)
        assert float(grown_mb) < 200, (path.name, grown_mb)  # it was 960 MB for the string
        assert reason in reasons
        want = expected_events(t, set(range(kept, len(t.spans))) if kept is not None else set())
        assert int(events) == sum(want.values())


# ---------------------------------------------------------------------------------------------
# Resynchronisation: what a damaged stretch costs


def _parse_text(tmp_path: Path, text: str) -> ingest.ParsedTrace:
    path = tmp_path / "rank1.json"
    path.write_text(text)
    return ingest.read_trace(path, path.name)


def _kept(parsed: ingest.ParsedTrace) -> Counter:
    return Counter(zip(parsed.events["name"].to_list(), parsed.events["ts_ns"].to_list()))


@pytest.mark.parametrize("junk", [", ,", ",\x00\x00\x00,", ",]},"])
def test_junk_between_events_costs_no_event(tmp_path, traces, junk):
    t = traces["rank1"]
    i = len(t.spans) // 2
    parsed = _parse_text(tmp_path, t.text[:t.spans[i][1]] + junk + t.text[t.spans[i][1]:])
    assert _kept(parsed) == expected_events(t)
    assert [i.reason for i in parsed.issues] == ["malformed_event"]


@pytest.mark.parametrize("element", ["null", "42", '"an event"', "[1, [2]]"])
@pytest.mark.parametrize("where", ["middle", "last"])
def test_an_element_that_is_no_event_costs_no_event_and_keeps_the_trailer(tmp_path, traces, element, where):
    """null, a number, a string or a list in traceEvents, even as its last element, is one malformed element: the
    events and the metadata after the array (baseTimeNanoseconds, to which this trace's ts are relative) are kept.
    As the last element it once read as a file cut short, and every ts came out 1.7e18 ns early."""
    t = traces["relative"]
    at = t.spans[len(t.spans) // 2][1] if where == "middle" else t.spans[-1][1]
    as_written = sorted(i.reason for i in _parse_text(tmp_path, t.text).issues)
    parsed = _parse_text(tmp_path, t.text[:at] + ", " + element + t.text[at:])
    assert _kept(parsed) == expected_events(t)
    assert sorted(i.reason for i in parsed.issues) == sorted(as_written + ["malformed_event"])  # not "truncated"


def test_damage_inside_nested_objects_does_not_end_the_array(tmp_path, traces):
    """A NaN in an event whose args hold a list of objects: resynchronising inside that list must not
    take its `]}}` for the end of traceEvents and drop every later event."""
    t = traces["rank1"]
    i = first(t, is_cpu_op, after=len(t.events) // 2)
    text = add_arg(t, i, "objects", '[{"a": NaN}, {"b": 2}, {"c": [3]}]')
    parsed = _parse_text(tmp_path, text)
    assert not expected_events(t, {i}) - _kept(parsed)
    assert "malformed_event" in {i.reason for i in parsed.issues} and "trailing_garbage" not in {i.reason for i in parsed.issues}


def test_wrong_shape_then_bad_token_in_one_chunk(tmp_path, traces):
    """A wrong shape (args a list) stops the fast decoder before it sees a later NaN: both cost their
    own event only."""
    t = traces["rank1"]
    a = first(t, is_cpu_op, after=len(t.events) // 2)
    b = first(t, is_cpu_op, after=a + 5)
    text = set_value(_read(set_value(t, b, "dur", "NaN")), a, "args", "[1, 2]")
    parsed = _parse_text(tmp_path, text)
    assert _kept(parsed) == expected_events(t, {a, b})
    assert {i.reason: i.count for i in parsed.issues}["malformed_event"] == 2


def test_zeros_where_the_file_was_cut(tmp_path, traces):
    """A preallocated file the job never filled: the events before the zeros, and a truncation that says so."""
    t = traces["rank1"]
    i = len(t.spans) // 2
    path = tmp_path / "rank1.json"
    path.write_text(t.text[: t.spans[i][0]])
    with open(path, "r+b") as f:
        f.truncate(len(t.text[: t.spans[i][0]].encode()) + (64 << 20))  # more than MAX_EVENT_BYTES of zeros
    parsed = ingest.read_trace(path, path.name)
    assert _kept(parsed) == expected_events(t, set(range(i, len(t.spans))))
    truncated = [i for i in parsed.issues if i.reason == "truncated"]
    assert truncated and f"followed by {64 << 20} zero" in truncated[0].detail


def test_a_byte_order_mark_is_not_damage(tmp_path, traces):
    parsed = _parse_text(tmp_path, "\ufeff" + traces["rank1"].text)
    assert _kept(parsed) == expected_events(traces["rank1"]) and parsed.issues == []


# ---------------------------------------------------------------------------------------------
# Collector parts (issue 37): ranks past the limit, parts that decode to far more than their size

INGEST_PROBE = """
import sys
from pathlib import Path
from steplens.analyze.pipeline import ingest

def peak_mb():  # VmHWM starts afresh at exec (getrusage's maxrss would carry pytest's over)
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
    return int(line.split()[1]) / 1024

before = peak_mb()
result = ingest.ingest(Path(sys.argv[1]), jobs=1)
print(result.out_dir, peak_mb() - before)
"""


def _collector_part(run: Path, table: str, name: str, columns: dict, repeat: int = 1) -> None:
    """A part written with pyarrow (no steplens code), `repeat` row groups of the same rows."""
    from steplens.analyze.contract import schema

    folder = run / "collector" / table
    folder.mkdir(parents=True, exist_ok=True)
    arrow_schema = schema.TABLES[table][0]
    rows = len(next(iter(columns.values())))
    import pyarrow as pa

    block = pa.table({f.name: pa.array(columns.get(f.name, [None] * rows), f.type) for f in arrow_schema},
                     schema=arrow_schema)
    with pq.ParquetWriter(folder / name, arrow_schema, compression="zstd") as writer:
        for _ in range(repeat):
            writer.write_table(block)


def _ingest_probe(run: Path) -> tuple[Path, float]:
    proc = subprocess.run([sys.executable, "-c", INGEST_PROBE, str(run)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    out_dir, grown_mb = proc.stdout.split()
    return Path(out_dir), float(grown_mb)


def _issues(out_dir: Path) -> Counter:
    """Issue counts per reason, over every file."""
    counts = Counter()
    for row in pq.read_table(out_dir / "ingest_issues").to_pylist():
        counts[row["reason"]] += row["count"]
    return counts


def test_a_collector_rank_past_the_limit_costs_its_rows_only(tmp_path):
    """Rows of rank 2**40 (and a part named rank 2**40): skipped and counted; analyze exits 1, rows lost (it
    exited 5, out of memory building the report's rank range); the good points of rank 0 all survive."""
    run = tmp_path / "run"
    good = [float(v) / 4 for v in range(10)]
    _collector_part(run, "scalars", "rank0-00000.parquet", {
        "rank": [0] * 10, "source": ["collector"] * 10, "name": ["train/loss"] * 10, "step": list(range(10)),
        "value": good})
    _collector_part(run, "scalars", "rank0-00001.parquet", {
        "rank": [0, 2**40, 2**40, -1], "source": ["collector"] * 4, "name": ["train/loss", "x", "x", "x"],
        "step": [10, 11, 12, 13], "value": [9.0, 1.0, 1.0, 1.0]})
    _collector_part(run, "scalars", f"rank{2**40}-00000.parquet", {
        "rank": [2**40], "source": ["collector"], "name": ["y"], "step": [0], "value": [1.0]})
    proc = subprocess.run([sys.executable, "-m", "steplens.analyze", str(run), "-q"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    out_dir = run / ".steplens"
    scalars = pq.read_table(out_dir / "scalars").to_pylist()
    assert sorted((r["step"], r["value"]) for r in scalars) == list(zip(range(10), good)) + [(10, 9.0)]
    issues = _issues(out_dir)
    assert issues["collector_part_rank"] == 3 + 1  # three rows, one part
    assert json.loads((out_dir / "run.json").read_text())["ranks"] == [0]
    assert (out_dir / "report.html").exists()


def test_collector_rows_with_values_no_run_can_have_are_dropped_and_counted(tmp_path):
    """The real 2-rank sample with rank 0's comms calls damaged: latencies of -1 ns and 2**62 ns (12 of them
    summed wrapped to "0 ns"), a NaN and an infinite bus bandwidth, a negative size, a group of -3 ranks. Those
    six rows are dropped and counted; every other call is kept; the run is analysed (exit 0)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(Path(__file__).resolve().parents[1] / "sample_runs" / "deepspeed_cpu_2rank", run,
                    ignore=shutil.ignore_patterns(".steplens"))
    part = sorted((run / "collector" / "comms_calls").glob("rank0-*.parquet"))[0]
    table = pq.read_table(part)
    assert table.num_rows >= 6
    damage = {"latency_ns": [(0, -1), (1, 2**62)], "busbw_gbps": [(2, float("nan")), (3, float("inf"))],
              "msg_bytes": [(4, -2_146_816)], "group_size": [(5, -3)]}
    for column, changes in damage.items():
        values = table.column(column).to_pylist()
        for row, value in changes:
            values[row] = value
        table = table.set_column(table.schema.get_field_index(column), column,
                                 pa.array(values, table.schema.field(column).type))
    pq.write_table(table, part)
    calls_before = sum(pq.read_table(p).num_rows for p in (run / "collector" / "comms_calls").glob("*.parquet"))
    outcome = run_analyze(run)
    assert outcome.exit_code == 0, outcome.output
    counted = [i for i in outcome.issues if i["reason"] == "collector_values_implausible"]
    assert [(i["file"], i["count"]) for i in counted] == [(str(part.relative_to(run)), 6)]
    kept = pq.read_table(outcome.out_dir / "comms_calls").to_pylist()
    collected = [c for c in kept if c["source"].startswith("collector")]
    assert len(collected) == calls_before - 6
    assert all(c["latency_ns"] is None or 0 <= c["latency_ns"] < 2**53 for c in kept)
    assert "nan" not in outcome.output and "-2,146,816" not in outcome.output


def test_collector_timers_are_bounded_as_a_logs_are():
    """step_timers rows from the collector: an infinite or 1e13 ms timer is dropped, as the log importer drops it
    from a timer line; a negative one (a clock that stepped back) is kept for sanity to name."""
    import polars as pl
    from steplens.analyze.importers import collector_parts

    timers = pl.DataFrame({"rank": [0] * 4, "timer": ["fwd"] * 4, "ms": [1.0, float("inf"), 1e13, -5.0]})
    issues = []
    kept = collector_parts._drop_implausible(timers, "collector/step_timers/rank0-00000.parquet", issues)
    assert kept["ms"].to_list() == [1.0, -5.0]
    assert [(i[1], i[2]) for i in issues] == [("collector_values_implausible", 2)]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak memory from /proc")
def test_a_collector_part_that_decodes_to_millions_of_rows_is_bounded(tmp_path):
    """A part of a few hundred kB holding 8 M identical rows (what a run-length encoder makes of them): read up
    to the bound, the rest counted as skipped; memory stays bounded; the good part beside it survives."""
    from steplens.analyze.importers import collector_parts

    run = tmp_path / "run"
    _collector_part(run, "scalars", "rank0-00000.parquet", {
        "rank": [0] * 5, "source": ["collector"] * 5, "name": ["train/loss"] * 5, "step": list(range(5)),
        "value": [1.0, 2.0, 3.0, 4.0, 5.0]})
    rows_per_group, groups = 500_000, 16
    _collector_part(run, "train_steps", "rank0-00001.parquet", {
        "rank": [0] * rows_per_group, "source": ["collector"] * rows_per_group, "step": [7] * rows_per_group,
        "micro_step": [7] * rows_per_group, "dur_ns": [1000] * rows_per_group}, repeat=groups)
    part_bytes = (run / "collector" / "train_steps" / "rank0-00001.parquet").stat().st_size
    assert part_bytes < 1 << 20
    out_dir, grown_mb = _ingest_probe(run)
    assert grown_mb < 450, grown_mb  # measured: 290 MB; 8 M rows took 1.6 GB before the bound
    steps = pq.read_table(out_dir / "train_steps", columns=["step"])
    assert steps.num_rows == collector_parts.MAX_PART_ROWS
    assert _issues(out_dir)["collector_part_too_large"] == 1
    detail = next(r["detail"] for r in pq.read_table(out_dir / "ingest_issues").to_pylist()
                  if r["reason"] == "collector_part_too_large")
    assert f"{rows_per_group * groups - collector_parts.MAX_PART_ROWS} of its {rows_per_group * groups} rows" in detail
    assert pq.read_table(out_dir / "scalars")["value"].to_pylist() == [1.0, 2.0, 3.0, 4.0, 5.0]


# ---------------------------------------------------------------------------------------------
# Damaged results (issue 37)


@pytest.mark.parametrize("damage", [{"ranks": 5}, {"world_size": "8"}, {"environment": []},
                                    {"environment": {"device_names": "H100"}}, {"facts": [1]}, {"run_name": {"a": 1}}])
def test_sql_leaves_out_a_run_whose_run_json_is_damaged(tmp_path, damage):
    """Two analysed runs, one run.json damaged by hand: the damaged run is named and left out (exit 1), the
    other still answers with both its ranks (as generated)."""
    from synthetic import generate_run

    from steplens.analyze.cli import steplens
    from steplens.analyze.pipeline import ingest

    runs = tmp_path / "runs"
    for name in ("good", "bad"):
        generate_run(runs / name, ranks=2, steps=3, kernels_per_step=20, seed=3, write_truth=False)
        ingest.ingest(runs / name, jobs=1)
    manifest_path = runs / "bad" / ".steplens" / "run.json"
    manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), **damage}))
    done = CliRunner().invoke(steplens, ["sql", str(runs), "SELECT run_id, count(DISTINCT rank) AS n FROM "
                                         "trace_events GROUP BY run_id", "--format", "json"])
    assert done.exit_code == 1, done.output
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    good_id = json.loads((runs / "good" / ".steplens" / "run.json").read_text())["run_id"]
    assert [(r["run_id"], r["n"]) for r in rows] == [(good_id, 2)]
    warning = " ".join(done.stderr.split())  # one warning, wrapped at the terminal's width
    assert warning.count("warning: ") == 1
    assert str(runs / "bad" / ".steplens") in warning and next(iter(damage)) in warning


@pytest.mark.parametrize("stem", ["r" * 230, "é" * 118])  # 230 and 236 bytes before .json
def test_a_single_trace_with_a_long_name_is_analysed(tmp_path, traces, stem):
    """analyze FILE writes .steplens-FILE beside it: a name near the 255-byte limit made the staging name too long
    ("File name too long", exit 4). Now a short name is derived (its start and a hash); every event is kept."""
    trace = tmp_path / f"{stem}.json"
    trace.write_text(traces["rank1"].text)
    result = CliRunner().invoke(analyze, [str(trace), "-q", "-j", "1", "--ingest-only"])
    assert result.exit_code == 0, result.output
    (out,) = [p for p in tmp_path.iterdir() if p.name.startswith(".steplens-")]
    assert len(out.name.encode()) <= 255 - len("..tmp-") - 7 and out.name.startswith(".steplens-" + stem[:50])
    table = pq.read_table(out / "trace_events", columns=["name", "ts_ns"]).to_pydict()
    assert Counter(zip(table["name"], table["ts_ns"])) == expected_events(traces["rank1"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([trace.name, out.name])  # no staging debris


def test_export_trace_into_the_default_place_does_not_block_the_next_analyze(tmp_path):
    """The README's snippet: analyze RUN, export-trace RUN (RUN/.steplens/merged_trace.json), analyze RUN again. It
    refused ("holds files steplens did not write"); now the export is listed as an entry of the result."""
    from synthetic import generate_run

    from steplens.analyze.cli import steplens

    run = tmp_path / "run"
    generate_run(run, ranks=2, steps=3, kernels_per_step=20, seed=4, write_truth=False)
    assert CliRunner().invoke(analyze, [str(run), "-q", "-j", "1"]).exit_code == 0
    exported = CliRunner().invoke(steplens, ["export-trace", str(run)])
    assert exported.exit_code == 0, exported.output
    merged = run / ".steplens" / "merged_trace.json"
    assert merged.is_file()
    again = CliRunner().invoke(analyze, [str(run), "-q", "-j", "1"])
    assert again.exit_code == 0, again.output
    (run / "rank-1.pt.trace.json.gz").touch()  # a changed input: a new result replaces the old one whole
    os.utime(run / "rank-1.pt.trace.json.gz", ns=(1, 1))
    changed = CliRunner().invoke(analyze, [str(run), "-q", "-j", "1"])
    assert changed.exit_code == 0, changed.output
    manifest = json.loads((run / ".steplens" / "run.json").read_text())
    assert sorted(manifest["trace_ranks"]) == [0, 1]
    assert sorted(os.listdir(run)) == [".steplens", "rank-0.pt.trace.json.gz", "rank-1.pt.trace.json.gz"]


def test_a_file_that_is_not_read_is_named_as_given(tmp_path, traces):
    """`analyze notatrace.txt` said "`.`: nothing steplens reads here"; `analyze hg/truth.json` said "hg: nothing
    usable among 1 file(s)" though hg holds a good trace. Each names the file given, and the good trace beside it is
    neither read nor harmed."""
    (tmp_path / "notatrace.txt").write_text("hello\n")
    hg = tmp_path / "hg"
    hg.mkdir()
    (hg / "truth.json").write_text('{"a": 1}')
    (hg / "rank1.json").write_text(traces["rank1"].text)
    for given, why in ((tmp_path / "notatrace.txt", "not a file steplens reads"),
                       (hg / "truth.json", "not a trace: a JSON object with no traceEvents array")):
        result = CliRunner().invoke(analyze, [str(given), "-q", "-j", "1"])
        assert result.exit_code == 2
        assert " ".join(result.output.split()).startswith(f"error: {given}: {why}"), result.output
    assert sorted(p.name for p in hg.iterdir()) == ["rank1.json", "truth.json"]
    assert CliRunner().invoke(analyze, [str(hg / "rank1.json"), "-q", "-j", "1", "--ingest-only"]).exit_code == 0


def test_linked_folders_are_named_and_a_linked_output_is_refused(tmp_path, traces):
    """A sub-folder that is a symbolic link is not followed, and is now named (run.json, the issues, and the message of
    a run holding nothing else, which said '0 other file(s)'). A .steplens that is a link was replaced, leaving the
    link behind as ..steplens.old-PID: it is refused, and nothing is touched."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "rank0.json").write_text(traces["rank0"].text)
    only_links = tmp_path / "only_links"
    only_links.mkdir()
    (only_links / "traces").symlink_to(elsewhere)
    result = CliRunner().invoke(analyze, [str(only_links), "-q", "-j", "1"])
    assert result.exit_code == 2 and "linked folders not followed: traces" in result.output, result.output

    run = two_rank_run(tmp_path, traces, traces["rank1"].text)
    (run / "more").symlink_to(elsewhere)
    outcome = run_analyze(run, "--ingest-only")
    assert outcome.exit_code == 0
    (linked,) = [s for s in outcome.manifest["sources"] if s["path"] == "more"]
    assert linked["status"] == "ignored" and linked["issues"][0][1] == "linked_folder"
    assert [i["reason"] for i in outcome.issues] == ["linked_folder"]
    assert outcome.events[0] == expected_events(traces["rank0"]) and outcome.events[1] == expected_events(traces["rank1"])

    kept = tmp_path / "kept"
    (run / ".steplens").rename(kept)
    (run / ".steplens").symlink_to(kept)
    before = sorted(os.listdir(kept))
    (run / "rank1.json").write_text(traces["rank1"].text)  # a change: a new result would be published
    result = CliRunner().invoke(analyze, [str(run), "-q", "-j", "1", "--ingest-only"])
    assert result.exit_code == 2 and "is a symbolic link" in result.output, result.output
    assert sorted(os.listdir(run)) == [".steplens", "more", "rank0.json", "rank1.json"]  # no .old- or .tmp- debris
    assert (run / ".steplens").is_symlink() and sorted(os.listdir(kept)) == before


def test_a_bad_byte_in_a_kernel_name_costs_only_that_character(tmp_path, traces):
    """A byte that is not UTF-8, a lone high and a lone low surrogate escape in three kernels' names: each event was
    dropped with its GPU time (a whole window of them when the fast decoder gave up); now each is kept, the bad
    character replaced by U+FFFD, and counted (repaired_text)."""
    t = traces["rank1"]
    kernels = [i for i, e in enumerate(t.events) if e.get("cat") == "kernel"]
    a, b, c = kernels[len(kernels) // 4], kernels[len(kernels) // 2], kernels[3 * len(kernels) // 4]
    text = set_value(t, c, "name", '"low\\udc00end"')
    text = set_value(_read(text), b, "name", '"high\\ud800end"')
    text = set_value(_read(text), a, "name", '"byteMARKend"')
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.json").write_text(traces["rank0"].text)
    (run / "rank1.json").write_bytes(text.encode().replace(b"MARK", b"\xff"))
    outcome = run_analyze(run)
    assert outcome.exit_code == 0, outcome.output
    want = expected_events(t, {a, b, c})
    want.update((name, int(Decimal(t.events[i]["ts"]) * 1000) + t.base_ns)
                for name, i in (("byte\ufffdend", a), ("high\ufffdend", b), ("low\ufffdend", c)))
    assert outcome.events[1] == want  # every event, the three repaired ones included
    (issue,) = [i for i in outcome.issues if i["reason"] == "repaired_text"]
    assert issue["count"] == 3 and issue["severity"] == "warning"
    durations = pq.read_table(outcome.out_dir / "trace_events", columns=["name", "dur_ns", "kind"]).to_pylist()
    gpu_ns = sum(r["dur_ns"] for r in durations if r["kind"] == "kernel")
    want_ns = sum(int(Decimal(e["dur"]) * 1000) for e in t.events if e.get("cat") == "kernel")
    want_ns += sum(int(Decimal(e["dur"]) * 1000) for e in traces["rank0"].events if e.get("cat") == "kernel")
    assert gpu_ns == want_ns


# ---------------------------------------------------------------------------------------------
# Logs (issue 37): one endless line, a crash's zero bytes; memory follows what is kept

LOG_PROBE = """
import sys, time
from pathlib import Path
from steplens.analyze.importers import deepspeed_log

def peak_mb():  # VmHWM starts afresh at exec
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
    return int(line.split()[1]) / 1024

before, started = peak_mb(), time.perf_counter()
imported = deepspeed_log.parse(Path(sys.argv[1]), "x.log")
lr = sorted(imported.tables["scalars"].filter(name="lr")["value"].to_list())
issues = {i[1]: i[2] for i in imported.issues}
print(peak_mb() - before, time.perf_counter() - started, lr, issues)
"""


def _log_lines(first: int, last: int) -> bytes:
    return "".join(f"[2026-11-29 12:59:{s:02d},493] [INFO] [logging.py:123:log_dist] [Rank 0] step={s}, skipped=0, "
                   f"lr=[0.{s}], mom=[(0.9, 0.999)]\n" for s in range(first, last + 1)).encode()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak memory from /proc")
@pytest.mark.parametrize("hostile", ["long_line", "zeros"])
def test_a_log_with_an_endless_line_or_a_crash_tail_is_read_in_bounded_memory(tmp_path, hostile):
    """A 200 MB line between good lines (it took 1 GB and minutes of regex scanning), and 1 GB of zero bytes after a
    real start (a crash or preallocation: it kept growing past 4 GB). Both are read in bounded memory, the damage
    counted, every good line's lr kept."""
    import ast

    log = tmp_path / "train.log"
    with open(log, "wb") as f:
        f.write(_log_lines(1, 5))
        if hostile == "long_line":
            f.write(b"[Rank 0] tensor(" + b"1.0, " * (40 << 20) + b")\n")
            f.write(_log_lines(6, 9))
    if hostile == "zeros":
        with open(log, "r+b") as f:
            f.truncate(log.stat().st_size + (1 << 30))  # a hole: reads as zeros, takes no disk
    proc = subprocess.run([sys.executable, "-c", LOG_PROBE, str(log)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    grown_mb, seconds, rest = proc.stdout.split(maxsplit=2)
    lr_text, issues_text = rest.rsplit("] ", 1)
    lr, issues = ast.literal_eval(lr_text + "]"), ast.literal_eval(issues_text)
    assert float(grown_mb) < 150, grown_mb
    if hostile == "long_line":
        assert lr == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
        assert issues == {"long_lines": 1}
    else:  # over the 512 MiB a text input may have: its first and last 256 MiB read, every line of the log kept
        assert lr == [0.1, 0.2, 0.3, 0.4, 0.5]
        assert set(issues) == {"zero_padding", "middle_skipped"}
        assert issues["zero_padding"] + issues["middle_skipped"] + len(_log_lines(1, 5)) <= log.stat().st_size
        assert issues["middle_skipped"] >= log.stat().st_size - (512 << 20)


def test_a_key_given_twice_is_read_last_value_wins_and_counted(tmp_path, traces):
    """Three kernels given `"ph": "i"` and a later `ts` after their own: every field is read with its last value (the
    stdlib's json, which keeps the last, is the ground truth), the other events untouched, the three counted."""
    t = traces["rank1"]
    kernels = [i for i, e in enumerate(t.events) if e.get("cat") == "kernel"]
    chosen = [kernels[len(kernels) // 4], kernels[len(kernels) // 2], kernels[3 * len(kernels) // 4]]
    text = t.text
    for i in sorted(chosen, reverse=True):  # from the end: the earlier spans stay where they are
        start, end = t.spans[i]
        later_ts = Decimal(t.events[i]["ts"]) + 1
        text = text[:end - 1] + f', "ph": "i", "ts": {later_ts}}}' + text[end:]
    mutated = _read(text)
    assert [mutated.events[i]["ph"] for i in chosen] == ["i"] * 3  # the stdlib: the last value
    run = two_rank_run(tmp_path, traces, text)
    outcome = run_analyze(run)
    assert outcome.exit_code == 0, outcome.output
    assert outcome.events[1] == expected_events(mutated)
    (issue,) = [i for i in outcome.issues if i["reason"] == "duplicate_keys"]
    assert issue["count"] == 3


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_second_trace_events_array_is_named_as_lost(tmp_path, traces, native, monkeypatch):
    """`{"traceEvents": A, ..., "traceEvents": B}`: the first array is read (the stream cannot go back) and B's
    events are an error, counted; they were dropped without a word. Both readers."""
    monkeypatch.setenv("STEPLENS_NATIVE", native)
    t = traces["rank1"]
    half = len(t.spans) // 2
    cut, resume = t.spans[half - 1][1], t.spans[half][0]
    # A = the first half, B = the second half, as a second key after the first array's end.
    text = t.text[:cut] + "], \"traceEvents\": [" + t.text[resume:]
    first_half = Trace(t.text, t.spans[:half], t.events[:half], t.base_ns)
    outcome = run_analyze(two_rank_run(tmp_path, traces, text), "--ingest-only")
    assert outcome.exit_code == 1, outcome.output
    assert outcome.events[1] == expected_events(first_half)
    (issue,) = [i for i in outcome.issues if i["reason"] == "duplicate_trace_events"]
    assert issue["count"] == len(t.events) - half and issue["file"] == "rank1.json"
    assert outcome.events[0] == expected_events(traces["rank0"])


# analyze in a fresh child of a fresh process: RUSAGE_CHILDREN's peak is then analyze's own (in pytest it would be
# the largest of every child the session has waited for).
ANALYZE_PEAK = """
import resource, subprocess, sys
done = subprocess.run([sys.executable, "-m", "steplens.analyze", *sys.argv[1:]])
print(f"peak_mb={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}", file=sys.stderr)
sys.exit(done.returncode)
"""


def test_a_world_size_of_two_to_the_24_costs_no_memory(tmp_path, traces):
    """Traces of ranks 0 and 1 claiming 2**24 ranks (the largest world size accepted): the warning names the missing
    ranks as one range, built from the gaps (a set over range(world_size) took analyze to 2.3 GB)."""
    run = tmp_path / "run"
    run.mkdir()
    for rank in (0, 1):
        text = traces[f"rank{rank}"].text.replace('"world_size": 128', f'"world_size": {2**24}', 1)
        (run / f"rank{rank}.json").write_text(text)
    done = subprocess.run([sys.executable, "-c", ANALYZE_PEAK, str(run), "-q", "-j", "1", "--ingest-only"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"traces of 2 of {2**24} ranks; no trace for rank(s) 2-{2**24 - 1} (" in " ".join(done.stderr.split())
    peak_mb = float(done.stderr.rsplit("peak_mb=", 1)[1])
    assert peak_mb < 500, peak_mb  # measured: 210 MB; 2.3 GB before
    events = pq.read_table(run / ".steplens" / "trace_events", columns=["name", "ts_ns", "rank"]).to_pylist()
    for rank in (0, 1):
        got = Counter((e["name"], e["ts_ns"]) for e in events if e["rank"] == rank)
        assert got == expected_events(traces[f"rank{rank}"])
