"""The native columnizer (importers/_columnize.c) against the Python reader, its reference: the same ParsedTrace
(events, flows, steps, metadata, issues, frame equality) on every Kineto trace of the corpus, on every trace case
of the fuzz suite (tests/test_fuzz_ingest.py) and on hand-made edge cases, read in the usual 2 MiB windows and in
small ones (where the reader's fast form turns off mid-file). STEPLENS_NATIVE=0 makes kineto.decode use the Python
reader only. Where a value is one the native pass leaves to the Python reader, its window is handed back: the
counting is the Python reader's either way, and the real traces are read natively throughout.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sysconfig
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner
from polars.testing import assert_frame_equal

from steplens.analyze.contract import schema
from steplens.analyze.importers import json_events, kineto
from steplens.analyze.pipeline import ingest

from conftest import CORPUS
import test_fuzz_ingest as fuzz

needs_native = pytest.mark.skipif(not kineto.native_available(), reason="the native columnizer is not built here")


def _compiler() -> str | None:
    """The C compiler pip builds extensions with, where Python's headers are installed too."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return shutil.which(cc) if headers.is_file() else None


def test_the_native_columnizer_is_built_where_a_compiler_is():
    """pip builds it wherever a C compiler and Python's headers are: CI must not fall back to the Python reader
    unnoticed."""
    if _compiler() is None:
        pytest.skip("no C compiler or no Python headers here: the Python reader is the one used")
    assert kineto.native_available(), "a C compiler is here but importers/_columnize.c was not built (pip install -e .)"


@needs_native
def test_the_bounds_are_kinetos():
    assert kineto._columnize.BOUNDS == (kineto.MAX_MESSAGE_NELEMS, kineto.MAX_MEMORY_BYTES, schema.MAX_RANK,
                                       kineto._MAX_WHOLE_US)


class Windows:
    """How many windows the native pass read, and how many it handed back to the Python reader."""

    def __init__(self, monkeypatch):
        self.native = self.handed_back = 0
        columnize = kineto._native_columns

        def counting(window, fast):
            done = columnize(window, fast)
            if done is None:
                self.handed_back += 1
            else:
                self.native += 1
            return done

        monkeypatch.setattr(kineto, "_native_columns", counting)


def _parse(path: Path, monkeypatch, native: bool) -> ingest.ParsedTrace:
    monkeypatch.setenv("STEPLENS_NATIVE", "1" if native else "0")
    return ingest.read_trace(path, path.name)


def assert_same_parse(path: Path, monkeypatch) -> Windows:
    """Both readers give the same tables, metadata and issues (or both refuse the file the same way)."""
    try:
        python = _parse(path, monkeypatch, native=False)
    except kineto.NotATrace as e:
        with pytest.raises(kineto.NotATrace) as native_error:
            _parse(path, monkeypatch, native=True)
        assert (str(native_error.value), native_error.value.damaged) == (str(e), e.damaged)
        return Windows(monkeypatch)
    windows = Windows(monkeypatch)
    native = _parse(path, monkeypatch, native=True)
    for table in ("events", "flows", "steps"):
        assert_frame_equal(getattr(native, table), getattr(python, table), check_exact=True)
    assert native.meta == python.meta
    assert native.issues == python.issues
    assert native.raw_bytes == python.raw_bytes
    return windows


# ---------------------------------------------------------------------------------------------
# Every Kineto trace of the corpus

CORPUS_TRACES = sorted(str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*") if p.name.endswith((".json", ".json.gz"))) \
    if CORPUS.is_dir() else []


@needs_native
@pytest.mark.parametrize("relative", CORPUS_TRACES)
def test_every_corpus_trace_parses_the_same_natively(relative, monkeypatch):
    path = CORPUS / relative
    try:
        _parse(path, monkeypatch, native=False)
    except kineto.NotATrace as e:  # rocprofiler output, a memory timeline: the Python reader refuses them too
        pytest.skip(f"not a Kineto trace: {e}")
    windows = assert_same_parse(path, monkeypatch)
    assert windows.native >= 1 and windows.handed_back == 0  # real traces are read natively throughout


# ---------------------------------------------------------------------------------------------
# The fuzz suite's trace cases


@pytest.fixture(scope="module")
def rank1() -> fuzz.Trace:
    if not CORPUS.is_dir():
        pytest.skip(f"shared corpus not found at {CORPUS}")
    return fuzz._load(fuzz.SAMPLED.format(1))


def _fuzz_texts(t: fuzz.Trace) -> dict[str, str | bytes]:
    texts: dict[str, str | bytes] = {f"case {name}": case.mutate(t)[0] for name, case in fuzz.CASES.items()}
    i = fuzz.first(t, fuzz.is_cpu_op, after=len(t.events) // 2)
    for key, raw in fuzz._generated():
        texts[f"generated {key}={raw}"] = (fuzz.add_arg(t, i, key[5:], raw) if key.startswith("args.")
                                          else fuzz.set_value(t, i, key, raw))
    middle = len(t.spans) // 2
    cuts = {"in the header": t.text.index('"traceEvents"') - 10, "inside the first event": t.spans[0][0] + 20,
            "middle": sum(t.spans[middle]) // 2, "before the closing bracket": t.spans[-1][1]}
    texts.update({f"cut {where}": t.text[:cut] for where, cut in cuts.items()})
    for junk in (", ,", ",\x00\x00\x00,", ",]},"):
        texts[f"junk {junk!r}"] = t.text[:t.spans[middle][1]] + junk + t.text[t.spans[middle][1]:]
    texts["objects with a NaN in args"] = fuzz.add_arg(t, i, "objects", '[{"a": NaN}, {"b": 2}, {"c": [3]}]')
    b = fuzz.first(t, fuzz.is_cpu_op, after=i + 5)
    texts["args a list, then a NaN"] = fuzz.set_value(fuzz._read(fuzz.set_value(t, b, "dur", "NaN")), i, "args", "[1, 2]")
    texts["garbage after the document"] = t.text + "\n}}junk"
    texts["byte order mark"] = "\ufeff" + t.text
    kernels = [k for k, e in enumerate(t.events) if e.get("cat") == "kernel"]
    a, b, c = kernels[len(kernels) // 4], kernels[len(kernels) // 2], kernels[3 * len(kernels) // 4]
    bad = fuzz.set_value(fuzz._read(fuzz.set_value(fuzz._read(fuzz.set_value(t, c, "name", '"low\\udc00end"')), b, "name",
                                                   '"high\\ud800end"')), a, "name", '"byteMARKend"')
    texts["bad bytes and lone surrogates in names"] = bad.encode().replace(b"MARK", b"\xff")
    twice = t.text
    for k in sorted((a, b, c), reverse=True):
        end = t.spans[k][1]
        twice = twice[:end - 1] + ', "ph": "i", "ts": 1}' + twice[end:]
    texts["keys given twice"] = twice
    return texts


FUZZ_NAMES = sorted(_fuzz_texts(fuzz._load(fuzz.SAMPLED.format(1)))) if CORPUS.is_dir() else []


@needs_native
@pytest.mark.parametrize("name", FUZZ_NAMES)
def test_every_fuzz_case_parses_the_same_natively(name, rank1, tmp_path, monkeypatch):
    data = _fuzz_texts(rank1)[name]
    path = tmp_path / "rank1.json"
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    assert_same_parse(path, monkeypatch)


@needs_native
@pytest.mark.parametrize("gz", [False, True])
def test_gzip_members_and_a_tail_parse_the_same(rank1, tmp_path, monkeypatch, gz):
    data = rank1.text.encode()
    third = len(data) // 3
    members = b"".join(gzip.compress(data[x:y], compresslevel=1) for x, y in ((0, third), (third, 2 * third), (2 * third, None)))
    path = tmp_path / "rank1.json.gz"
    path.write_bytes(members + (b"\0" * 1000 if gz else b"garbage\n"))
    assert_same_parse(path, monkeypatch)


# ---------------------------------------------------------------------------------------------
# Hand-made edge cases, each in the usual windows and in windows of a few events (the fast form then turns off
# in a later window than the first, and the end of traceEvents falls in a window of its own)

EVENT = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": "1712195495519689.047", "dur": 1.5,
         "args": {"correlation": 5, "stream": 7, "device": 0}}


def _event(**changes) -> dict:
    event = {**EVENT, "args": dict(EVENT["args"])}
    for key, value in changes.items():
        if key.startswith("args_"):
            event["args"][key[5:].replace("_", " ")] = value
        elif value is None:
            event.pop(key, None)
        else:
            event[key] = value
    return event


def _trace_text(events: list, top_level_array: bool = False, after: str = "") -> str:
    """Events as a Kineto file writes them (`ts` as written: a string value is put in as its raw number text)."""
    texts = []
    for e in events:
        text = json.dumps(e) if isinstance(e, dict) else e
        texts.append(text.replace('"ts": "1712195495519689.047"', '"ts": 1712195495519689.047'))
    body = "[\n" + ",\n".join(texts) + "\n]"
    if top_level_array:
        return body
    return '{"schemaVersion": 1, "distributedInfo": {"rank": 0},\n"traceEvents": ' + body + after + "}"


def _filler(n: int) -> list:
    return [_event(ts=str(1000 + i), name=f"f{i}") for i in range(n)]


EDGE_CASES = {
    "string tids and pids": [_event(tid="stream 7"), _event(tid=" 12 "), _event(tid="PyTorch Profiler"),
                             _event(pid="-3"), _event(tid=""), _event(tid="stream x")],
    "a numeric tid beyond int64": [_event(tid="99999999999999999999")],
    "a tid of 21 digits after 'stream '": [_event(tid="stream 999999999999999999999")],
    "ids above int64": [_event(ph="s", id=2**63), _event(ph="f", id=2**64 + 1)],
    "comms id above int64": [_event(args_Collective_name="allreduce", **{"args_Comms_Id": 2**64 - 1}),
                             _event(args_Seq=3, **{"args_Comms_Id": -1})],
    "collective args": [_event(**{"args_Collective_name": "allreduce", "args_In_msg_nelems": 4, "args_Out_msg_nelems": "8",
                                  "args_dtype": "Float", "args_Group_size": 2, "args_Process_Group_Ranks": "[0, 1]",
                                  "args_Seq": 9, "args_Src_Rank": 0, "args_Dst_Rank": "1"}),
                        _event(args_Seq=None), _event(**{"args_Group_size": 0, "args_Seq": 1})],
    "group ranks as a list": [_event(**{"args_Collective_name": "x", "args_Process_Group_Ranks": [0, 1]})],
    "collective args on a plain event are not read": [_event(**{"args_In_msg_nelems": 2**62, "args_dtype": 5})],
    "names with escapes": [_event(name="caf\u00e9 \"quoted\" \\ tab\t \U0001F600 \u2028"), _event(cat="\u0000")],
    # a string's end, escapes and multi-byte characters at every offset of an 8-byte block (word-at-a-time scanners)
    "escapes and multi-byte text at every offset of long names": [
        _event(name="n" * offset + stop + "m" * 20) for offset in range(17) for stop in ('"', "\\", "\n", "\u00e9", "\U0001F600")],
    "raw multi-byte text in names at every offset": [
        f'{{"ph": "X", "name": "{"n" * offset}{raw}{"m" * 9}", "pid": 0, "tid": 7, "ts": 1, "dur": 1}}'
        for offset in range(17) for raw in ("\u00e9", "\U0001F600")],
    "a raw control byte in a name at every offset": [
        f'{{"ph": "X", "name": "{"n" * offset}\t{"m" * 9}", "pid": 0, "tid": 7, "ts": 1, "dur": 1}}' for offset in range(17)],
    "a name that is a number": [_event(name=5)],
    "a name that is a list": [_event(name=["a"])],
    "floats and bools where integers belong": [_event(pid=1.0), _event(tid=2.5), _event(args_correlation=True)],
    "flops": [_event(args_flops=10), _event(args_flops=2.5e12), _event(args_flops=-0.0), _event(args_flops=2**60)],
    "negative flops": [_event(args_flops=-1)],
    "memory events": [_event(ph="i", name="[memory]", **{"args_Bytes": 512, "args_Total_Allocated": 1024,
                                                          "args_Total_Reserved": 2048, "args_Device_Type": 1}),
                      _event(ph="i", name="[memory]", **{"args_Bytes": -512, "args_Total_Allocated": 10,
                                                          "args_Device_Type": 0}),
                      _event(ph="i", name="[memory]", **{"args_Total_Allocated": 10, "args_Device_Type": "0"}),
                      _event(ph="i", name="[memory]", **{"args_Total_Allocated": 10, "args_Device_Type": 0.0}),
                      _event(args_bytes=None, args_Bytes=3)],
    "bytes beyond 2**48": [_event(args_bytes=2**49)],
    "input dims, legacy and raw texts": [_event(**{"args_Input_Dims": [[1, 2], []], "args_Input_dims": [[3]]}),
                                          _event(**{"args_Input_dims": [[3]], "args_Input_type": ["float", ""],
                                                    "args_Concrete_Inputs": ["", "1"]}),
                                          _event(**{"args_Input_Dims": None, "args_Input_dims": [[4]]})],
    "times in every form": [_event(ts="5"), _event(dur="0.5"), _event(dur=3), _event(ts=None),
                            '{"ph": "X", "name": "q", "pid": 0, "tid": 0, "ts": "12", "dur": 1e3}',
                            '{"ph": "X", "name": "e", "pid": 0, "tid": 0, "ts": 1.5e2, "dur": -1}'],
    # The native pass converts plain decimals itself and leaves the rest to the Python conversion, in one window
    "times at the native conversion's edges": [
        '{"ph": "X", "name": "sub-ns", "pid": 0, "tid": 0, "ts": 12.3456789, "dur": -0.5}',
        '{"ph": "X", "name": "negative", "pid": 0, "tid": 0, "ts": -12.3456, "dur": -0.0009}',
        '{"ph": "X", "name": "bound", "pid": 0, "tid": 0, "ts": 4611686018427386.999, "dur": 4611686018427387}',
        '{"ph": "X", "name": "18 digits", "pid": 0, "tid": 0, "ts": 123456789012345678, "dur": 1234567890123456789.5}',
        '{"ph": "X", "name": "beside text", "pid": 0, "tid": 0, "ts": "17.25", "dur": 2E+1}',
        '{"ph": "X", "name": "zeros", "pid": 0, "tid": 0, "ts": 0, "dur": 0.000}'],
    "phases": [_event(ph="B"), _event(ph="C"), _event(ph="i"), _event(ph=None), _event(ph="zz"),
               _event(ph="i", name="step", ts="7")],
    "metadata events, bad args after the fast form is off": [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "p"}}, _event(ph="zz"),
        {"ph": "M", "name": "thread_name", "pid": 0, "args": "bad"}],
    "metadata events, bad args while the fast form holds": [
        {"ph": "M", "name": "thread_name", "pid": 0, "args": "bad"}, {"ph": "M", "args": [1]}],
    "args that are not an object": [_event(args=[1]), _event(args=None), _event(args="x")],
    "a key given twice, any key, any phase": [
        '{"ph": "X", "name": "a", "foo": 1, "foo": 2, "pid": 0, "tid": 0, "ts": 5, "dur": 1}',
        '{"ph": "M", "name": "thread_name", "name": "again", "pid": 0}',
        '{"ph": "X", "ph": "i", "name": "b", "pid": 0, "tid": 0, "ts": 6, "ts": 7}',
        '{"ph": "X", "cat": "kernel", "name": "c", "pid": 0, "tid": 0, "ts": 8, "dur": 1, "args": {"stream": 1, "stream": 2}}'],
    "a key spelled with an escape": ['{"ph": "X", "p\\u0068": "i", "name": "d", "pid": 0, "tid": 0, "ts": 9}',
                                     '{"ph": "X", "name": "e:\\u003a", "pid": 0, "tid": 0, "ts": 9, "dur": 1}'],
    "deep nesting": [_event(args_deep=[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]])],
    "long numbers": ['{"ph": "X", "name": "n", "pid": 0, "tid": 0, "ts": 1682725898081806000000000, "dur": 1e999}',
                     '{"ph": "X", "name": "m", "pid": 0, "tid": 123456789012345678901234, "ts": 1, "dur": 1}'],
    # A multi-line text makes the Python reader re-encode its column's texts compact, in that window
    "pretty-printed input dims": ['{"ph": "X", "name": "p", "pid": 0, "tid": 0, "ts": 1, "dur": 1, "args": '
                                  '{"Input Dims": [\n  [1, -2],\n  []\n], "Input type": ["a b", ""]}}',
                                  _event(**{"args_Input_Dims": [[1, 2], []], "args_Concrete_Inputs": ["", "[1, 2]"]})],
    # damage mid-array: the first `]` is not the array's end when another follows it
    "a stray ]] after an event": ['{"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": 1, "dur": 1}]]',
                                  '{"ph": "X", "name": "b", "pid": 0, "tid": 0, "ts": 2, "dur": 1}] ]'],
    "pretty-printed floats and literals": ['{"ph": "X", "name": "p", "pid": 0, "tid": 0, "ts": 1, "dur": 1, "args": '
                                           '{"Concrete Inputs": [\n  1.50,\n  true, null, -0\n]}}'],
}


@needs_native
@pytest.mark.parametrize("chunk_bytes", [json_events.CHUNK_BYTES, 700])
@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_cases_parse_the_same_natively(case, chunk_bytes, tmp_path, monkeypatch):
    monkeypatch.setattr(json_events, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(json_events, "SNIFF_BYTES", min(chunk_bytes, json_events.SNIFF_BYTES))  # small windows from the start
    events = _filler(8) + EDGE_CASES[case] + _filler(8)
    for name, text in (("trace.json", _trace_text(events)), ("array.json", _trace_text(events, top_level_array=True)),
                       ("after.json", _trace_text(events, after=', "baseTimeNanoseconds": 1000, "deviceProperties": []'))):
        path = tmp_path / name
        path.write_text(text)
        assert_same_parse(path, monkeypatch)


@needs_native
def test_long_names_are_read_natively_with_a_stop_at_every_offset_of_a_block(tmp_path, monkeypatch):
    """An escape, a quote or a multi-byte character at any offset of an 8-byte block (where a word-at-a-time scan
    would go wrong) ends or continues the name natively exactly where the Python reader does."""
    stops, raws = ('"', "\\", "\n", "\u00e9", "\U0001F600"), ("\u00e9", "\U0001F600")
    path = tmp_path / "trace.json"
    path.write_text(_trace_text(EDGE_CASES["escapes and multi-byte text at every offset of long names"]
                                + EDGE_CASES["raw multi-byte text in names at every offset"]), encoding="utf-8")
    windows = assert_same_parse(path, monkeypatch)
    assert windows.native >= 1 and windows.handed_back == 0
    expected = ["n" * offset + stop + "m" * 20 for offset in range(17) for stop in stops]
    expected += ["n" * offset + raw + "m" * 9 for offset in range(17) for raw in raws]
    assert sorted(_parse(path, monkeypatch, native=True).events["name"].to_list()) == sorted(expected)


@needs_native
def test_clean_events_are_read_natively_and_exactly(tmp_path, monkeypatch):
    """Kineto's usual values, read by the native pass alone: ns from the decimal text, string tids as numbers."""
    path = tmp_path / "trace.json"
    path.write_text(_trace_text(_filler(3) + EDGE_CASES["string tids and pids"] + EDGE_CASES["names with escapes"]))
    windows = assert_same_parse(path, monkeypatch)
    assert windows.native >= 1 and windows.handed_back == 0
    events = _parse(path, monkeypatch, native=True).events
    assert 1712195495519689047 in events["ts_ns"].to_list()
    assert events.filter(pl.col("name") == "k")["tid"].to_list() == [7, 12, None, 7, None, None, 7]
    assert "caf\u00e9 \"quoted\" \\ tab\t \U0001F600 \u2028" in events["name"].to_list()


@pytest.mark.parametrize("native", [False, True])
def test_a_key_given_twice_is_counted_for_any_key_in_any_window(native, tmp_path, monkeypatch):
    """Issue 37 item 6: an event giving any key twice is counted (the stdlib's object_pairs_hook is the independent
    answer), in the fast form's windows too (it counted a repeated `ph` only), and read with the last value."""
    if native and not kineto.native_available():
        pytest.skip("the native columnizer is not built here")
    monkeypatch.setattr(json_events, "CHUNK_BYTES", 700)
    events = _filler(10) + EDGE_CASES["a key given twice, any key, any phase"] + _filler(10) + [
        '{"ph": "X", "name": "late", "pid": 0, "tid": 0, "ts": 5, "ts": 6, "dur": 1}']
    path = tmp_path / "trace.json"
    path.write_text(_trace_text(events))
    twice = sum(1 for text in events if isinstance(text, str) and _gives_a_key_twice(text))
    assert twice == 4
    parsed = _parse(path, monkeypatch, native=native)
    assert {i.reason: i.count for i in parsed.issues}.get("duplicate_keys") == twice
    read = dict(zip(parsed.events["name"].to_list(), zip(parsed.events["ph"].to_list(), parsed.events["ts_ns"].to_list())))
    assert read["b"] == ("i", 7000) and read["late"] == ("X", 6000)
    assert parsed.events.filter(pl.col("name") == "c")["stream"].to_list() == [2]


def _gives_a_key_twice(text: str) -> bool:
    seen = []
    json.loads(text, object_pairs_hook=lambda pairs: seen.append(len(pairs) != len(dict(pairs))) or dict(pairs))
    return seen[-1]


def test_analyze_says_once_when_the_python_reader_is_used(tmp_path, monkeypatch):
    from steplens.analyze.cli import analyze

    run = tmp_path / "run"
    for rank in (0, 1):
        (run / f"rank{rank}.json").parent.mkdir(exist_ok=True)
        (run / f"rank{rank}.json").write_text(_trace_text(_filler(5), after="").replace('"rank": 0', f'"rank": {rank}'))
    monkeypatch.setattr(kineto, "_columnize", None)
    done = CliRunner().invoke(analyze, [str(run), "-q", "-j", "1", "--ingest-only"])
    assert done.exit_code == 0, done.output
    assert done.output.count("native Kineto reader is not built") == 1
    monkeypatch.undo()
    if kineto.native_available():
        (run / "rank1.json").write_text((run / "rank1.json").read_text() + " ")  # changed: parsed again
        done = CliRunner().invoke(analyze, [str(run), "-q", "-j", "1", "--ingest-only"])
        assert done.exit_code == 0 and "native Kineto reader" not in done.output


@needs_native
def test_times_are_exact_ns_from_the_decimal_text(tmp_path, monkeypatch):
    """ts and dur by hand: digits past the third decimal dropped toward zero, bounds at +-(2**62 // 1000 - 1) us,
    the forms the native pass leaves to the Python conversion (a quoted number, an exponent) converted all the same."""
    path = tmp_path / "trace.json"
    path.write_text(_trace_text(EDGE_CASES["times at the native conversion's edges"]))
    assert assert_same_parse(path, monkeypatch).handed_back == 0  # the native pass read them all
    events = _parse(path, monkeypatch, native=True).events
    got = {name: (ts, dur) for name, ts, dur in events.select("name", "ts_ns", "dur_ns").iter_rows()}
    assert got["sub-ns"] == (12345, -500)
    assert got["negative"] == (-12345, 0)
    assert got["bound"] == (4611686018427386999, None)  # a dur of 2**62 // 1000 us is beyond the bound: dropped
    assert "18 digits" not in got  # its ts is beyond the bound: the event is dropped (and counted)
    assert got["beside text"] == (17250, 20000)
    assert got["zeros"] == (0, 0)


def test_text_past_the_limit_is_cut_the_same_by_both_readers(tmp_path, monkeypatch):
    """A kernel name of 200,001 characters (a multi-byte one last) and shapes past the limit: both readers cut each to
    MAX_TEXT_CHARS characters, counted per column (long_text); a name at the limit is kept whole. (A trace whose
    names ran to 5 MB each, 558 times, took 8 GB and ended in an internal error.)"""
    limit = kineto.MAX_TEXT_CHARS
    long_name = "K" * 200_000 + "\u00e9"
    shapes = [[1] * (limit // 3 + 10)]  # "[[1, 1, ..." : 3 characters a dimension
    events = (_filler(4) + [_event(name=long_name), _event(name=long_name, ts="1700"), _event(name="n" * limit, ts="1701"),
                            _event(**{"args_Input_Dims": shapes})] + _filler(4))
    path = tmp_path / "trace.json"
    path.write_text(_trace_text(events), encoding="utf-8")
    assert_same_parse(path, monkeypatch)  # (the native reader too, where it is built)
    parsed = _parse(path, monkeypatch, native=False)
    names = parsed.events["name"].to_list()
    assert names.count("K" * limit) == 2 and names.count("n" * limit) == 1
    assert max(len(n) for n in names) == limit
    dims = parsed.events["input_dims"].drop_nulls().to_list()
    assert [len(d) for d in dims] == [limit]
    cut = {i.detail.split("'")[1]: i.count for i in parsed.issues if i.reason == "long_text"}
    assert cut == {"name": 2, "input_dims": 1}
