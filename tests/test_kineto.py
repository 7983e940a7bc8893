"""Parsing single Kineto traces: exact times, old formats, odd values, truncation, non-traces."""

import gzip
import json

import polars as pl
import pytest

from steplens.analyze.importers import json_events
from steplens.analyze.contract.traces import NotATrace
from steplens.analyze.importers.kineto import microseconds_text_to_ns
from steplens.analyze.pipeline.ingest import read_trace

from conftest import write_trace


def test_microseconds_text_to_ns_is_exact():
    text = pl.Series(["1712195495519689.047", "63.813", "5", "-2.5", "0.0001", "1.5e3", '"7.25"', None, "x"])
    ns, bad = microseconds_text_to_ns(text)
    assert ns.to_list() == [1712195495519689047, 63813, 5000, -2500, 0, 1500000, 7250, None, None]
    assert bad == 1  # "x"
    # float64 cannot do this: the nearest double is off by tens of ns
    assert round(float("1712195495519689.047") * 1000) != 1712195495519689047


def _reference_ns(text):
    """An independent answer: Decimal arithmetic on the text, truncated toward zero, None out of range."""
    import re
    from decimal import Decimal

    if text is None or not re.fullmatch(r"-?[0-9]+(\.[0-9]+)?", text):
        return None
    value = Decimal(text)
    return int(value * 1000) if abs(int(value)) < 2**62 // 1000 else None


def test_microseconds_text_to_ns_kineto_forms_take_the_fast_path_exactly():
    import random

    from steplens.analyze.importers import kineto

    rng = random.Random(7)
    edge = ["-0", "-0.000", "0.500", "007.250", "4611686018427386", "4611686018427387", "-4611686018427386.999",
            "4611686018427387.000", "9223372036854775807", "-9223372036854775808", "-9223372036854775.808"]
    for _ in range(300):
        values = []
        for _ in range(rng.randint(1, 8)):
            sign = "-" if rng.random() < 0.3 else ""  # at most 19 digits, below 2**63: what an int64 holds
            whole, whole_us = rng.randint(0, 10 ** rng.randint(0, 18)), rng.randint(0, 10 ** rng.randint(0, 15))
            values.append(rng.choice([f"{sign}{whole}", f"{sign}{whole_us}.{rng.randint(0, 999):03d}", rng.choice(edge), None]))
        text = pl.Series(values, dtype=pl.String)
        fast = kineto._kineto_text_to_ns(text)
        assert fast is not None, values  # every value is a form Kineto writes
        assert fast.to_list() == [_reference_ns(v) for v in values], values
        ns, bad = microseconds_text_to_ns(text)
        assert ns.to_list() == fast.to_list() and bad == sum(v is not None and _reference_ns(v) is None for v in values)
    empty, bad = microseconds_text_to_ns(pl.Series([], dtype=pl.String))  # a trace cut before its first event
    assert empty.to_list() == [] and bad == 0
    # any other form sends the whole series down the general path, which gives the same answers
    for other in ["+5.000", ".500", "-.500", "5.", "1.5", "1.2345", "1e3", '"7.250"', "1.2.3", "", "x", "\u0663"]:
        assert kineto._kineto_text_to_ns(pl.Series(["1.000", other])) is None, other
        ns, _ = microseconds_text_to_ns(pl.Series(["1.000", other]))
        assert ns[0] == 1000 and (ns[1] == _reference_ns(other) or other in ("1e3", '"7.250"'))


def _events(n_kernels=3):
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "pid": 10, "tid": 1, "ts": 100.0, "dur": 50.5}]
    for i in range(n_kernels):
        t = 101.25 + i
        events += [
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 10, "tid": 1, "ts": t, "dur": 0.5, "args": {"correlation": 100 + i}},
            {"ph": "X", "cat": "kernel", "name": f"k{i}", "pid": 0, "tid": 7, "ts": 120.001 + i, "dur": 0.75,
             "args": {"correlation": 100 + i, "stream": 7, "device": 0}},
            {"ph": "s", "id": 100 + i, "pid": 10, "tid": 1, "ts": t, "cat": "ac2g", "name": "ac2g"},
            {"ph": "f", "id": 100 + i, "pid": 0, "tid": 7, "ts": 120.001 + i, "cat": "ac2g", "name": "ac2g", "bp": "e"},
        ]
    return events


def test_relative_ts_base_time_steps_and_launch_links(tmp_path):
    path = write_trace(tmp_path / "t.json", _events(), baseTimeNanoseconds=1_700_000_000_000_000_000,
                       distributedInfo={"rank": 3, "world_size": 4})
    parsed = read_trace(path, "t.json")
    ev = parsed.events
    base = 1_700_000_000_000_000_000
    step = ev.filter(pl.col("name") == "ProfilerStep#7").row(0, named=True)
    assert (step["ts_ns"], step["dur_ns"]) == (base + 100_000, 50_500)
    kernels = ev.filter(pl.col("kind") == "kernel").sort("ts_ns")
    assert kernels["ts_ns"].to_list() == [base + 120_001, base + 121_001, base + 122_001]
    assert kernels["stream"].to_list() == [7, 7, 7] and kernels["device"].to_list() == [0, 0, 0]
    # kernels ran after the step's CPU window closed, but belong to it through their launch
    assert kernels["step"].to_list() == [7, 7, 7]
    assert parsed.steps.select("step", "start_ns", "end_ns").row(0) == (7, base + 100_000, base + 150_500)
    launches = ev.filter(pl.col("is_launch"))
    assert launches.height == 3
    links = parsed.flows.join(ev.select("event_id", "correlation"), left_on="dst_event_id", right_on="event_id")
    assert sorted(links["correlation"].to_list()) == [100, 101, 102]
    assert set(parsed.flows["via"]) == {"correlation"}  # the ac2g flows agree, so add nothing
    assert parsed.meta.rank == 3


def test_graph_launch_links_every_kernel(tmp_path):
    events = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 1, "ts": 1, "dur": 2, "args": {"correlation": 9}}]
    events += [{"ph": "X", "cat": "kernel", "name": f"g{i}", "pid": 0, "tid": 7, "ts": 5 + i, "dur": 1, "args": {"correlation": 9}} for i in range(4)]
    parsed = read_trace(write_trace(tmp_path / "g.json", events), "g.json")
    assert parsed.flows.height == 4
    assert parsed.flows["src_event_id"].n_unique() == 1


@pytest.mark.parametrize("overlap_us, counted", [(0, 0), (0.5, 0), (2, 1), (30, 1)])
def test_steps_of_one_thread_that_overlap_are_counted(tmp_path, overlap_us, counted):
    """ProfilerStep#7 [100, 150.5) us, then #8 starting `overlap_us` before #7 ends: a microsecond of rounding is
    no overlap, more is (step times would hold that time twice)."""
    events = _events() + [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#8", "pid": 10, "tid": 1,
                           "ts": 150.5 - overlap_us, "dur": 40}]
    parsed = read_trace(write_trace(tmp_path / "t.json", events), "t.json")
    assert [i.count for i in parsed.issues if i.reason == "overlapping_steps"] == ([counted] if counted else [])
    assert parsed.steps["step"].to_list() == [7, 8]  # kept as given


def test_events_written_twice_count_once(tmp_path):
    """A rank's events written twice into one file: each kernel, call and annotation with an id once, the repeats
    counted; two identical host ops without an id (a recursion within one clock tick) both kept."""
    events = [{**e, "args": {**e.get("args", {}), "External id": 1}} if e["name"] == "ProfilerStep#7" else e
              for e in _events()]
    recursion = [{"ph": "X", "cat": "python_function", "name": "f", "pid": 10, "tid": 1, "ts": 140, "dur": 1}] * 2
    parsed = read_trace(write_trace(tmp_path / "t.json", events + recursion + events), "t.json")
    ev = parsed.events
    assert ev.filter(pl.col("kind") == "kernel")["name"].sort().to_list() == ["k0", "k1", "k2"]
    assert ev.filter(pl.col("is_launch")).height == 3 and ev.filter(pl.col("name") == "f").height == 2
    assert [(i.reason, i.count) for i in parsed.issues if i.reason in ("repeated_events", "correlation_reused",
                                                                       "reused_step_number", "overlapping_steps")] == [
        ("repeated_events", 7)]  # the annotation, 3 calls, 3 kernels
    assert ev["event_id"].to_list() == list(range(ev.height))  # still each row's number
    assert parsed.steps["step"].to_list() == [7]
    assert sorted(parsed.flows.filter(pl.col("flow_type") == "launch")["dst_event_id"].to_list()) == sorted(
        ev.filter(pl.col("kind") == "kernel")["event_id"].to_list())
    # a kernel that differs in one field (another duration) is no repeat
    differs = [{**e, "dur": 0.5} if e.get("cat") == "kernel" and e["name"] == "k1" else e for e in events]
    parsed = read_trace(write_trace(tmp_path / "d.json", events + differs), "d.json")
    assert parsed.events.filter(pl.col("name") == "k1").height == 2
    assert [i.count for i in parsed.issues if i.reason == "repeated_events"] == [6]


def test_kernels_without_a_stream_are_said_lost_to_the_timeline(tmp_path):
    """Kernels with no args.stream and a thread id that is no number have no place on the GPU timeline: their time
    is left out of busy and idle, so that is data lost (an error), not a silent 98% idle."""
    events = [{**e, "tid": "stream x", "args": {k: v for k, v in e["args"].items() if k != "stream"}}
              if e.get("cat") == "kernel" else e for e in _events()]
    parsed = read_trace(write_trace(tmp_path / "t.json", events), "t.json")
    assert [(i.severity, i.count) for i in parsed.issues if i.reason == "events_lost"] == [("error", 3)]
    intact = read_trace(write_trace(tmp_path / "i.json", _events()), "i.json")
    assert not [i for i in intact.issues if i.reason == "events_lost"]


def test_a_correlation_id_repeated_by_an_appended_window_links_by_time(tmp_path):
    """Two windows in one file, the second 1 s later with its correlation ids starting again (step 7, then step 9):
    each kernel belongs to the launch of its own window, and the repeats are counted."""
    first = _events()
    later = [{**e, "ts": e["ts"] + 1_000_000, **({"name": "ProfilerStep#9"} if e["name"] == "ProfilerStep#7" else {})}
             for e in _events()]
    parsed = read_trace(write_trace(tmp_path / "t.json", first + later), "t.json")
    ev = parsed.events.sort("ts_ns")
    kernels = ev.filter(pl.col("kind") == "kernel")
    assert kernels["step"].to_list() == [7, 7, 7, 9, 9, 9]
    calls = ev.filter(pl.col("is_launch")).select("event_id", call_ts="ts_ns")
    linked = parsed.flows.filter(pl.col("flow_type") == "launch").join(calls, left_on="src_event_id", right_on="event_id")
    linked = linked.join(ev.select("event_id", "ts_ns"), left_on="dst_event_id", right_on="event_id")
    # by hand: each kernel starts 18.751 us after its own call
    assert (linked["ts_ns"] - linked["call_ts"]).to_list() == [18_751] * 6
    assert [(i.reason, i.count) for i in parsed.issues if i.reason == "correlation_reused"] == [("correlation_reused", 3)]
    alone = read_trace(write_trace(tmp_path / "one.json", first), "one.json")  # one window: nothing to say
    assert not [i for i in alone.issues if i.reason == "correlation_reused"]
    # the device clock a few microseconds behind: the second window's kernels still take their own window's calls
    skewed = [{**e, "ts": e["ts"] - (19.0 if e["cat"] == "kernel" else 0)} for e in later]
    parsed = read_trace(write_trace(tmp_path / "skew.json", first + skewed), "skew.json")
    assert parsed.events.filter(pl.col("kind") == "kernel").sort("ts_ns")["step"].to_list() == [7, 7, 7, 9, 9, 9]


@pytest.mark.parametrize("api", ["cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                                 "cudaGraphLaunch", "hipLaunchKernel", "hipExtModuleLaunchKernel", "hipGraphLaunch",
                                 "cudaMemcpyAsync", "cudaMemsetAsync", "hipMemcpyAsync"])
def test_every_launch_api_is_a_launch(tmp_path, api):
    events = [{"ph": "X", "cat": "cuda_driver" if api.startswith("cuL") else "cuda_runtime", "name": api, "pid": 1, "tid": 1, "ts": 1, "dur": 1},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 1, "tid": 1, "ts": 3, "dur": 1}]
    ev = read_trace(write_trace(tmp_path / "a.json", events), "a.json").events
    assert ev.filter(pl.col("is_launch"))["name"].to_list() == [api]


def test_2020_array_format_with_string_tids_and_legacy_categories(tmp_path):
    events = [
        {"ph": "X", "cat": "Operator", "name": "aten::mm", "pid": 5, "tid": "4093687616", "ts": 1606910596297023, "dur": 13,
         "args": {"Input dims": [[2, 3], [3, 4]], "External id": 2}},
        {"ph": "X", "cat": "Runtime", "name": "cudaLaunchKernel", "pid": 5, "tid": "4093687616", "ts": 1606910596297030, "dur": 4,
         "args": {"correlation": 11, "External id": 2}},
        {"ph": "X", "cat": "Kernel", "name": "gemm", "pid": 0, "tid": "stream 7", "ts": 1606910596297040, "dur": 9,
         "args": {"correlation": 11, "device": 0}},
        {"ph": "s", "cat": "async", "id": 11, "pid": 5, "tid": "4093687616", "ts": 1606910596297030, "name": "launch"},
        {"ph": "f", "cat": "async", "id": 11, "pid": 0, "tid": "stream 7", "ts": 1606910596297040, "name": "launch"},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Traces", "tid": "PyTorch Profiler", "ts": 1606910596288053, "dur": 1},
    ]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(events, indent=2))
    parsed = read_trace(path, "old.json")
    ev = parsed.events.sort("ts_ns")
    assert ev["kind"].to_list() == ["other", "cpu_op", "cuda_runtime", "kernel"]
    kernel = ev.filter(pl.col("kind") == "kernel").row(0, named=True)
    assert (kernel["tid"], kernel["stream"], kernel["ts_ns"]) == (7, 7, 1606910596297040000)
    assert ev.filter(pl.col("kind") == "cpu_op")["tid"].to_list() == [4093687616]
    assert ev.filter(pl.col("kind") == "cpu_op")["input_dims"].to_list() == ["[[2,3],[3,4]]"]
    assert parsed.flows.height == 1
    assert not [i for i in parsed.issues if i.severity != "info"]


def test_integer_texts_are_read_exactly_and_damaged_ones_are_counted(tmp_path):
    """pid/tid/ids written as text: plain digits (the tids of PyTorch 1.8-1.9 traces, "stream 7") are
    numbers; other text ("Spans", "1.5") is a label, null and not counted; digits that make no int64
    ("--5", 20 nines, an Arabic-Indic three) are null and counted; none of them costs the file (a "--5"
    once made the whole file unusable)."""
    tids = ["4093687616", "stream 7", "stream -2", " 8 ", "-0", "0042", "Spans", "--5", "9" * 20, "1.5", "\u0663", 7]
    expected = [4093687616, 7, -2, 8, 0, 42, None, None, None, None, None, 7]
    events = [{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "pid": 1, "tid": tid, "ts": i, "dur": 1} for i, tid in enumerate(tids)]
    parsed = read_trace(write_trace(tmp_path / "t.json", events), "t.json")
    assert parsed.events.sort("ts_ns")["tid"].to_list() == expected
    assert [(i.reason, i.count, "'tid'" in i.detail) for i in parsed.issues] == [("unrepresentable_value", 3, True)]


@pytest.mark.parametrize("indent", [None, 1])
def test_bytes_that_are_not_utf8_cost_only_their_event_or_value(tmp_path, indent):
    """A JSON text must be UTF-8. A 0xFF byte in a name is replaced by U+FFFD, the event kept (counted: it was
    skipped, issue 37); in a ts kept as raw text, that ts is null (event dropped, counted); in Input Dims, that
    value is null (counted). Each once lost the whole file. Compact and indented files take different paths."""
    events = [{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "pid": 1, "tid": 1, "ts": 10 + i, "dur": 1,
               "args": {"Input Dims": [[i], ["d"]]}} for i in range(6)]
    text = json.dumps({"traceEvents": events}, indent=indent).encode()
    damaged = (text.replace(b'"op1"', b'"op\xff1"').replace(b'"ts": 12', b'"ts": "1\xff2"')
               .replace(b'"d"', b'"\xff"', 1))
    assert damaged.count(b"\xff") == 3
    parsed = read_trace(write_bytes(tmp_path / "t.json", damaged), "t.json")
    events_read = parsed.events.sort("ts_ns")
    assert events_read["name"].to_list() == ["op0", "op\ufffd1", "op3", "op4", "op5"]  # op2 without ts
    assert events_read["ts_ns"].to_list() == [10_000, 11_000, 13_000, 14_000, 15_000]
    dims = [json.loads(text) if text else None for text in events_read["input_dims"]]
    assert dims == [None, [[1], ["d"]], [[3], ["d"]], [[4], ["d"]], [[5], ["d"]]]
    counted = {(i.reason, i.count, i.detail.split()[0]) for i in parsed.issues}
    assert counted == {("repaired_text", 1, "events"), ("unrepresentable_value", 1, "'ts'"),
                       ("missing_timestamp", 1, "complete,"), ("unrepresentable_value", 1, "'Input")}


def write_bytes(path, data: bytes):
    path.write_bytes(data)
    return path


def test_ids_above_int64_are_kept_unsigned(tmp_path):
    big = 10159970886766084423
    events = [{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1, "ts": 1, "dur": 1,
               "args": {"Comms Id": big, "Collective name": "allreduce", "correlation": 2**70}}]
    parsed = read_trace(write_trace(tmp_path / "big.json", events), "big.json")
    row = parsed.events.row(0, named=True)
    assert row["comms_id"] == big
    assert row["correlation"] is None
    assert [(i.reason, i.count) for i in parsed.issues] == [("unrepresentable_value", 1)]


def test_metadata_events_are_dropped_silently_other_phases_are_counted(tmp_path):
    events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
              {"ph": "M", "name": "thread_sort_index", "pid": "Spans", "tid": 1, "ts": 0, "args": {"sort_index": 1}},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 5, "dur": 2},
              {"ph": "C", "name": "memory", "pid": 1, "tid": 1, "ts": 6, "args": {"bytes": 3}},
              {"ph": "i", "cat": "cpu_instant_event", "name": "mark", "pid": 1, "tid": 1, "ts": 7, "s": "t"}]
    parsed = read_trace(write_trace(tmp_path / "m.json", events), "m.json")
    assert parsed.events["name"].to_list() == ["aten::mm", "mark"]
    assert [(i.reason, i.count, "ph='C'" in i.detail) for i in parsed.issues] == [("unsupported_phase", 1, True)]


def test_the_phase_tagged_fast_form_reads_what_the_general_form_reads(tmp_path, monkeypatch):
    from steplens.analyze.importers import kineto

    base = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 5.5, "dur": 2, "args": {"External id": 3}},
            {"ph": "C", "name": "memory", "pid": 1, "tid": 1, "ts": 6, "args": {"bytes": 3}},
            {"ph": "s", "id": 9, "pid": 1, "tid": 1, "ts": 5.5, "cat": "fwdbwd", "name": "fwdbwd"}]
    odd = [{"ph": "Q", "name": "an unknown phase", "pid": 1, "tid": 1, "ts": 8},
           {"cat": "cpu_op", "name": "no phase at all", "pid": 1, "tid": 1, "ts": 9, "dur": 1},
           {"ph": 7, "name": "a number for a phase", "pid": 1, "tid": 1, "ts": 10}]
    for name, events in [("plain", base * 3000), ("odd", base * 3000 + odd + base * 3000)]:  # several windows each
        path = write_trace(tmp_path / f"{name}.json", events)
        fast = read_trace(path, "t")
        monkeypatch.setattr(kineto, "_PHASED_EVENT", None)
        general = read_trace(path, "t")
        monkeypatch.undo()
        for table in ("events", "flows", "steps"):
            assert getattr(fast, table).equals(getattr(general, table)), (name, table)
        assert [(i.reason, i.count, i.detail) for i in fast.issues] == [(i.reason, i.count, i.detail) for i in general.issues]
    unsupported = sorted(i.count for i in fast.issues if i.reason == "unsupported_phase")
    assert unsupported == [1, 1, 1, 6000]  # Q, no phase and the number once each, C once per base
    # the fast form is what decoded the plain file: its metadata events carry no fields at all
    first = next(json_events.EventReader(json_events.ByteStream(tmp_path / "plain.json"), kineto._Event,
                                         kineto._PHASED_EVENT).events())
    assert first[0].ph == "M" and not first[0].__struct_fields__ and first[1].name == "aten::mm"


def test_the_window_where_the_events_array_ends_is_read_by_the_fast_form_too(tmp_path):
    """Every file's last window holds the end of traceEvents, with the rest of the file after it: the
    fast form reads it as it reads the others (once more, up to the `]`), so a metadata event there is
    dropped unread as anywhere else, not decoded by the general form and counted."""
    from steplens.analyze.importers import kineto

    events = [{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "pid": 1, "tid": 1, "ts": i, "dur": 1} for i in range(3)]
    odd_metadata = {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": 5}  # args not an object
    for placed in (events + [odd_metadata], [odd_metadata] + events):
        path = write_trace(tmp_path / "t.json", placed, deviceProperties=[{"id": 0}, {"id": 1}])
        reader = json_events.EventReader(json_events.ByteStream(path), kineto._Event, kineto._PHASED_EVENT)
        decoded = [e for window in reader.events() for e in window]
        assert reader._fast is not None and len(decoded) == 4 and not reader.skipped
        parsed = read_trace(path, "t")
        assert parsed.events["name"].to_list() == ["op0", "op1", "op2"] and parsed.issues == []


def test_cpu_event_with_stream_arg_is_not_device_activity(tmp_path):
    events = [{"ph": "X", "cat": "cpu_op", "name": "triton_launcher", "pid": 1, "tid": 1, "ts": 1, "dur": 400,
               "args": {"stream": 7, "device": 0}}]
    row = read_trace(write_trace(tmp_path / "s.json", events), "s.json").events.row(0, named=True)
    assert row["kind"] == "cpu_op" and row["stream"] is None and row["device"] is None


def test_chunked_decoding_matches_whole_file(tmp_path, monkeypatch, corpus):
    path = corpus / "HolisticTraceAnalysis/nccl_parser_config/nccl_data.json.gz"
    whole = read_trace(path, "x")
    monkeypatch.setattr(json_events, "CHUNK_BYTES", 50_000)
    monkeypatch.setattr(json_events, "SNIFF_BYTES", 50_000)
    chunked = read_trace(path, "x")
    assert chunked.events.equals(whole.events)
    assert chunked.flows.equals(whole.flows)
    assert chunked.meta == whole.meta


def test_compact_json_and_event_larger_than_chunk(tmp_path, monkeypatch):
    events = _events(50)
    events[3]["args"] = {"correlation": 101, "Input Dims": [[1] * 5000]}
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"traceEvents": events}, separators=(",", ":")))
    monkeypatch.setattr(json_events, "CHUNK_BYTES", 1000)
    parsed = read_trace(path, "c.json")
    assert parsed.events.height == 101
    assert parsed.issues == []


@pytest.mark.parametrize("gz", [False, True])
def test_truncated_trace_keeps_every_complete_event(tmp_path, corpus, gz):
    source = corpus / "HolisticTraceAnalysis/trace_filter/sampled_rank-1.json.gz"
    full = gzip.decompress(source.read_bytes())
    cut = full[: len(full) * 2 // 3]
    path = tmp_path / ("cut.json.gz" if gz else "cut.json")
    path.write_bytes(gzip.compress(full)[: len(gzip.compress(cut))] if gz else cut)
    parsed = read_trace(path, path.name)
    # Ground truth from the stdlib decoder: the events that end before the cut.
    body = json.loads(full)["traceEvents"]
    raw_len = parsed.raw_bytes
    complete = [e for e, stop in zip(body, _event_ends(full)) if stop <= raw_len]
    expected = sum(1 for e in complete if e.get("ph") in ("X", "i"))
    assert parsed.events.height == expected > 0
    assert [i.reason for i in parsed.issues if i.severity == "error"] == ["truncated"]
    assert "kept every complete event before the cut" in str(parsed.issues)


def test_a_trace_cut_inside_its_first_event_says_none_was_kept(tmp_path):
    path = tmp_path / "cut.json"
    path.write_bytes(b'{"schemaVersion": 1, "traceEvents": [{"ph": "M", "name": "process_name", "pid": 1}, {"ph": "X", "na')
    parsed = read_trace(path, path.name)
    assert parsed.events.height == 0
    assert [i.detail.split("; ")[-1] for i in parsed.issues if i.reason == "truncated"] == ["no complete event before the cut"]


def _event_ends(doc: bytes) -> list[int]:
    """End offset of each element of traceEvents, found with the stdlib decoder."""
    text = doc.decode()
    decoder = json.JSONDecoder()
    pos = text.index("[", text.index('"traceEvents"')) + 1
    ends = []
    while True:
        while text[pos] in " \n\r\t,":
            pos += 1
        if text[pos] == "]":
            return ends
        _, pos = decoder.raw_decode(text, pos)
        ends.append(len(text[:pos].encode()))


def test_a_second_trace_concatenated_after_the_first_is_said_lost(tmp_path):
    """Two whole traces written one after the other into one file: the second read as 'trailing garbage' (a warning,
    exit 0). Its events are lost: an error naming it; the first is read whole."""
    one = json.dumps({"schemaVersion": 1, "traceEvents": _events()})
    path = tmp_path / "two.json"
    path.write_text(one + "\n" + one + "\n")
    parsed = read_trace(path, "two.json")
    assert parsed.events.height == read_trace(write_trace(tmp_path / "one.json", _events()), "one.json").events.height
    assert [(i.severity, i.reason) for i in parsed.issues if i.severity != "info"] == [("error", "duplicate_trace_events")]
    path.write_text(one + json.dumps(_events()))  # the second in the old form, a bare array of events
    assert [i.reason for i in read_trace(path, "two.json").issues] == ["duplicate_trace_events"]
    path.write_text(one + "\n garbage")  # anything else after the document stays what it was
    assert [i.reason for i in read_trace(path, "two.json").issues] == ["trailing_garbage"]


def test_non_traces_are_named(tmp_path, corpus):
    with pytest.raises(NotATrace, match="memory_timeline"):
        read_trace(corpus / "HolisticTraceAnalysis/memory_analysis/memory_timeline.raw.gz", "m")
    with pytest.raises(NotATrace, match="rocprofiler"):
        read_trace(corpus / "TraceLens/rocprof/908_results.json.gz", "r")
    (tmp_path / "ds_config.json").write_text('{"train_batch_size": 8}')
    with pytest.raises(NotATrace, match="train_batch_size"):
        read_trace(tmp_path / "ds_config.json", "ds_config.json")


def test_multi_member_gzip(tmp_path):
    data = json.dumps({"traceEvents": _events(2)}).encode()
    path = tmp_path / "mm.json.gz"
    path.write_bytes(gzip.compress(data[:100]) + gzip.compress(data[100:]))
    parsed = read_trace(path, "mm.json.gz")
    assert parsed.events.height == 5 and parsed.issues == []


def _read_ahead_threads():
    import threading

    return [t for t in threading.enumerate() if t.name == "steplens-read-ahead"]


def test_read_ahead_produces_on_its_own_thread_and_hands_on_blocks_and_errors_in_order():
    """The stream is read on a thread of its own, ahead of the decoder (what lets gunzip overlap the
    columnizer); the consumer gets every block in order, then the producer's error where it happened."""
    import threading
    import time

    produced_on = []

    def blocks():
        for i in range(6):
            produced_on.append(threading.current_thread().name)
            yield bytes([i]) * 10
        raise OSError("disk gone at block 6")

    reader = json_events.ReadAhead(blocks(), depth=2)
    deadline = time.monotonic() + 5
    while len(produced_on) < 3 and time.monotonic() < deadline:  # 2 queued + 1 waiting to be put
        time.sleep(0.01)
    assert len(produced_on) == 3  # ahead of a consumer that has asked for nothing yet, and no further
    got = []
    with pytest.raises(OSError, match="block 6"):
        for block in reader:
            got.append(block)
    assert got == [bytes([i]) * 10 for i in range(6)]
    assert set(produced_on) == {"steplens-read-ahead"} and not _read_ahead_threads()
    assert next(reader, None) is None  # ended: no second error, no wait


def test_read_ahead_closed_or_dropped_early_stops_its_thread_and_closes_the_stream():
    import gc
    import time

    closed = []

    def endless():
        try:
            while True:
                yield b"x" * 100
        finally:
            closed.append(True)

    reader = json_events.ReadAhead(endless(), depth=2)
    assert next(reader) == b"x" * 100
    reader.close()
    assert closed == [True] and not _read_ahead_threads()
    assert next(reader, None) is None  # closed: nothing more, and no wait for a thread that is gone

    dropped = json_events.ReadAhead(endless(), depth=2)
    next(dropped)
    del dropped
    gc.collect()
    deadline = time.monotonic() + 5
    while _read_ahead_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closed == [True, True] and not _read_ahead_threads()


def test_a_file_given_up_early_leaves_no_read_ahead_thread(tmp_path):
    """A large JSON file that is not a trace is refused after its first MiB; the reading thread stops then."""
    path = tmp_path / "not_a_trace.json"
    path.write_text(json.dumps({"rows": [{"value": i, "text": "y" * 50} for i in range(300_000)]}))
    assert path.stat().st_size > 6 * json_events.CHUNK_BYTES
    with pytest.raises(NotATrace):
        read_trace(path, "x")
    assert not _read_ahead_threads()
