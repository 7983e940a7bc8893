"""Every real trace in ../shared/corpus either ingests or is rejected with a named reason, and what is
ingested agrees with an independent reading by the standard library (Decimal, no float rounding)."""

import gzip
import json
from collections import Counter
from decimal import Decimal
from pathlib import Path

import polars as pl
import pytest

from steplens.analyze.pipeline.ingest import IngestError, ingest
from steplens.analyze.pipeline.ingest import read_trace

from conftest import CORPUS

TRACE_FILES = sorted(p for p in CORPUS.rglob("*") if p.name.endswith((".json", ".gz"))) if CORPUS.is_dir() else []
NOT_TRACES = {
    "HolisticTraceAnalysis/memory_analysis/memory_timeline.raw.gz": "memory_timeline",
    "TraceLens/rocprof/908_results.json.gz": "rocprofiler",
}
CROSS_CHECK_LIMIT = 20_000_000  # uncompressed bytes; the stdlib Decimal reading is slow


def _rel(path: Path) -> str:
    return path.relative_to(CORPUS).as_posix()


def _load(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


@pytest.mark.skipif(not TRACE_FILES, reason="shared corpus not found")
@pytest.mark.parametrize("path", TRACE_FILES, ids=_rel)
def test_corpus_file_ingests_or_is_rejected_with_reason(path, tmp_path):
    expected_reject = NOT_TRACES.get(_rel(path))
    if expected_reject:
        with pytest.raises(IngestError, match=expected_reject):
            ingest(path.parent, tmp_path / "out", files=[path], jobs=1)
        return
    result = ingest(path.parent, tmp_path / "out", files=[path], jobs=1)
    source = result.sources[0]
    assert source.status == "ingested" and source.rank is not None
    assert not [i for i in source.issues if i[0] == "error"]
    events = pl.read_parquet(tmp_path / "out" / "trace_events" / f"rank={source.rank}" / "*.parquet")
    assert events.height == source.events > 0

    raw = _load(path)
    if len(raw) > CROSS_CHECK_LIMIT:
        return
    doc = json.loads(raw, parse_float=Decimal)
    trace = doc if isinstance(doc, list) else doc["traceEvents"]
    base = doc.get("baseTimeNanoseconds", 0) if isinstance(doc, dict) else 0
    reference = [e for e in trace if e.get("ph") in ("X", "i", "I") and "ts" in e]
    assert events.height == len(reference)
    expected_times = Counter((e.get("name"), int(Decimal(e["ts"]) * 1000) + base) for e in reference)
    got_times = Counter(events.select("name", "ts_ns").iter_rows())
    assert got_times == expected_times
    expected_durs = sorted(int(Decimal(e["dur"]) * 1000) for e in reference if e.get("ph") == "X" and "dur" in e)
    assert sorted(events["dur_ns"].drop_nulls().to_list()) == expected_durs
    kernels = sum(1 for e in reference if str(e.get("cat")).lower() == "kernel")
    assert events.filter(pl.col("kind") == "kernel").height == kernels
    # Launch links: one per device event whose correlation id has a runtime/driver call.
    calls = {e["args"]["correlation"] for e in reference
             if str(e.get("cat")).lower() in ("cuda_runtime", "runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    device = [e for e in reference if str(e.get("cat")).lower() in ("kernel", "gpu_memcpy", "memcpy", "gpu_memset", "memset")]
    linked = sum(1 for e in device if e.get("args", {}).get("correlation") in calls)
    flows = pl.read_parquet(tmp_path / "out" / "flows" / f"rank={source.rank}" / "*.parquet")
    assert flows.filter((pl.col("flow_type") == "launch") & (pl.col("via") == "correlation")).height == linked


@pytest.mark.skipif(not TRACE_FILES, reason="shared corpus not found")
def test_ns_resolution_trace_keeps_fractional_microseconds():
    path = CORPUS / "HolisticTraceAnalysis/ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"
    events = read_trace(path, "ns").events
    # "ts": 1712195495519689.047 in the file: ns precision kept, and no negative durations made up
    assert events.filter(pl.col("ts_ns") == 1712195495519689047).height >= 1
    assert events.filter(pl.col("dur_ns") < 0).height == 0


@pytest.mark.skipif(not TRACE_FILES, reason="shared corpus not found")
def test_two_windows_of_one_process_are_one_rank(tmp_path):
    folder = CORPUS / "kineto/tb_plugin_samples_resnet50_num_workers_0"
    result = ingest(folder, tmp_path / "out", jobs=1)
    assert result.manifest["ranks"] == [0]
    steps = pl.read_parquet(tmp_path / "out" / "steps" / "rank=0" / "*.parquet")
    assert sorted(steps["step"].to_list()) == [5, 6, 7, 8, 9, 10, 16, 17, 18, 19, 20, 21]
    assert {i[1] for s in result.sources for i in s.issues} >= {"rank_assumed"}


@pytest.mark.skipif(not TRACE_FILES, reason="shared corpus not found")
def test_hip_launches_are_linked(tmp_path):
    path = CORPUS / "TraceLens/mi300/gaunernst_bert-small-uncased__1016001.json.gz"
    parsed = read_trace(path, "mi300")
    launches = parsed.events.filter(pl.col("is_launch"))
    names = set(launches["name"])
    assert {"hipLaunchKernel", "hipExtModuleLaunchKernel", "hipModuleLaunchKernel"} <= names
    device = parsed.events.filter(pl.col("kind").is_in(["kernel", "gpu_memcpy", "gpu_memset"]))
    linked = parsed.flows.filter(pl.col("flow_type") == "launch")["dst_event_id"].n_unique()
    assert device.height == 61 and linked == 61  # 60 kernels and a memcpy, every one with its launch


@pytest.mark.skipif(not TRACE_FILES, reason="shared corpus not found")
def test_unusable_folder_names_the_error_not_a_notice(tmp_path):
    """Two single-process traces with no rank anywhere: the one-line error says why, not an info note."""
    with pytest.raises(IngestError, match="cannot tell which rank"):
        ingest(CORPUS / "TraceLens/h100", tmp_path / "out", jobs=1)
