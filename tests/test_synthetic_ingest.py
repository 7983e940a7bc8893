"""Ingest of generated runs against the generator's ground truth (tests/synthetic.py)."""

import json

import polars as pl
import pytest

from steplens.analyze.contract import schema
from steplens.analyze.pipeline.ingest import ingest
from synthetic import generate_run


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    run = tmp_path_factory.mktemp("gen") / "run"
    generate_run(run, ranks=3, steps=4, seed=7, stragglers=[(2, 12)])
    truth = json.loads((run / "truth.json").read_text())
    result = ingest(run, jobs=2)
    return run / schema.DEFAULT_OUT_DIR, truth, result


def _table(out, name):
    return pl.scan_parquet(out / name).collect()


def test_event_counts_per_kind(generated):
    out, truth, result = generated
    counts = _table(out, "trace_events").group_by("rank", "kind").len()
    for rank, expected in truth["ranks"].items():
        got = dict(counts.filter(pl.col("rank") == int(rank)).select("kind", "len").iter_rows())
        assert got == {k: v for k, v in expected["event_counts"].items() if v}, rank
    assert result.manifest["ranks"] == [0, 1, 2] and result.manifest["world_size"] == 3
    assert {s.path: s.status for s in result.sources}["truth.json"] == "ignored"


def test_step_windows_are_exact(generated):
    out, truth, _ = generated
    steps = _table(out, "steps")
    for rank, expected in truth["ranks"].items():
        got = steps.filter(pl.col("rank") == int(rank)).sort("step").select("step", "start_ns", "end_ns").rows()
        assert got == [(s["step"], s["start_ns"], s["end_ns"]) for s in expected["steps"]]


def test_absolute_timestamps_are_exact(generated):
    out, truth, _ = generated
    events = _table(out, "trace_events")
    for rank, expected in truth["ranks"].items():
        mine = events.filter(pl.col("rank") == int(rank))
        assert mine["ts_ns"].min() == expected["first_event_abs_ns"]
        assert (mine["ts_ns"] + mine["dur_ns"].fill_null(0)).max() == expected["last_event_end_abs_ns"]


def test_launch_links_match_truth(generated):
    out, truth, _ = generated
    events = _table(out, "trace_events")
    flows = _table(out, "flows").filter(pl.col("flow_type") == "launch")
    for rank, expected in truth["ranks"].items():
        r = int(rank)
        mine = flows.filter(pl.col("rank") == r)
        assert mine.height == expected["launch_links"]
        kernels = (
            mine.join(events.filter(pl.col("rank") == r).select("event_id", "ts_ns", "kind"), left_on="dst_event_id", right_on="event_id")
            .join(events.filter(pl.col("rank") == r).select("event_id", "correlation"), left_on="src_event_id", right_on="event_id")
            .filter(pl.col("kind") == "kernel")
        )
        got = {}
        for corr, ts in kernels.select("correlation", "ts_ns").iter_rows():
            got.setdefault(str(corr), []).append(ts)
        assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in expected["kernels_by_correlation"].items()}


def test_collective_args_and_device_steps(generated):
    out, truth, _ = generated
    nccl = _table(out, "trace_events").filter((pl.col("kind") == "kernel") & pl.col("collective").is_not_null())
    for rank, expected in truth["ranks"].items():
        mine = nccl.filter(pl.col("rank") == int(rank)).sort("seq")
        assert mine.select("seq", "collective", "group_size", "ts_ns", "step").rows() == [
            (c["seq"], c["name"], c["group_size"], c["kernel_start_ns"], c["step"]) for c in expected["collectives"]
        ]
