"""Every p10/p90 steplens writes is the nearest rank (the ceil(p/100 x n)-th smallest value): the launch summary's,
the logged comms', the collectives' busbw and the step times' agree on one definition, and the p90 of a few calls is
the slowest of them, an observed value."""

from __future__ import annotations

import polars as pl
import pytest

from steplens.analyze.analyses import comms_log, percentile, summaries
from steplens.analyze.pipeline import analyse

from conftest import launch_call_durations_ns, write_trace


def _by_hand(values: list, percent: int):
    """The nearest rank, counted out: the smallest value with at least percent% of the values at or below it."""
    ordered = sorted(values)
    for value in ordered:
        if 100 * sum(v <= value for v in ordered) >= percent * len(ordered):
            return value


@pytest.mark.parametrize("count", [1, 2, 3, 7, 10, 11, 19, 20, 21, 30, 99, 100, 101, 1000])
@pytest.mark.parametrize("percent", [10, 50, 90])
def test_nearest_rank_is_the_smallest_value_with_that_share_at_or_below(count, percent):
    values = [(i * 7919) % 1009 * 3 for i in range(count)]  # distinct, out of order
    expected = _by_hand(values, percent)
    assert percentile.nearest_rank(values, percent) == expected
    frame = pl.DataFrame({"group": [1] * count, "value": values})
    assert frame.group_by("group").agg(p=percentile.nearest_rank_expr("value", percent))["p"][0] == expected


def test_nulls_are_left_out_and_no_values_give_null():
    frame = pl.DataFrame({"group": [1, 1, 1, 2], "value": [None, 5, 9, None]}, schema={"group": pl.Int64, "value": pl.Int64})
    got = frame.group_by("group").agg(p=percentile.nearest_rank_expr("value", 90)).sort("group")
    assert got["p"].to_list() == [9, None]


def test_launch_summary_p90_of_seven_launches_is_the_slowest(tmp_path):
    """Seven launches taking 1..6 us and one of 20 us: the p90 is the 20 us call (polars' default quantile gave the
    6 us one), and the queueing p90 the longest wait."""
    api_us = [1, 2, 3, 20, 4, 5, 6]
    queue_us = [3, 1, 40, 2, 5, 4, 6]
    events, ts = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0,
                   "dur": 2000}], 10
    for correlation, (api, queue) in enumerate(zip(api_us, queue_us), start=1):
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts,
                       "dur": api, "args": {"correlation": correlation}})
        events.append({"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": ts + api + queue, "dur": 5,
                       "args": {"correlation": correlation, "stream": 7, "device": 0}})
        ts += api + queue + 100
    write_trace(tmp_path / "run" / "rank0.json", events)
    analyse(tmp_path / "run", jobs=1)
    row = pl.read_parquet(tmp_path / "run" / ".steplens" / "launch_summary" / "*.parquet").row(0, named=True)
    assert row["activities"] == 7
    assert row["api_ns_p90"] == _by_hand(api_us, 90) * 1000 == 20_000
    assert row["queue_ns_p90"] == _by_hand(queue_us, 90) * 1000 == 40_000


def test_launch_summary_p90_on_a_real_rocm_trace(corpus, tmp_path):
    """The torch.compile ROCm trace's seven hipExtModuleLaunchKernel calls, recomputed from the raw JSON: each
    kernel's launch call found by its correlation id; the p90 of the calls' durations by nearest rank."""
    source = corpus / "TraceLens" / "torch_compile_triton" / "trace.json.gz"
    durations = launch_call_durations_ns(source, "hipExtModuleLaunchKernel")
    assert len(durations) == 7
    run = tmp_path / "run"
    run.mkdir()
    (run / source.name).symlink_to(source)
    analyse(run, jobs=1)
    table = pl.read_parquet(run / ".steplens" / "launch_summary" / "*.parquet")
    row = table.filter(pl.col("launch_api") == "hipExtModuleLaunchKernel").row(0, named=True)
    assert row["activities"] == 7
    assert row["api_ns_p90"] == _by_hand(durations, 90) == max(durations)


def test_logged_comms_p90_latency_is_the_nearest_rank():
    latencies = [100, 300, 200, 5000, 400, 250, 350]  # ns; seven calls of one op and size on two ranks
    calls = pl.DataFrame({
        "rank": [0, 1, 0, 1, 0, 1, 0], "source": ["r0.log", "r1.log", "r0.log", "r1.log", "r0.log", "r1.log", "r0.log"],
        "op": ["all_reduce"] * 7, "msg_bytes": [1024] * 7, "nccl_bytes": [1024] * 7, "group_size": [2] * 7,
        "latency_ns": latencies, "algbw_gbps": [1.0] * 7, "busbw_gbps": [1.0] * 7, "latency_origin": ["logged"] * 7,
        "synchronized": [False] * 7})
    row = comms_log.comms_log_stats(calls).row(0, named=True)
    assert row["calls"] == 7 and row["p90_latency_ns"] == _by_hand(latencies, 90) == 5000


def test_collective_busbw_p10_and_p90_are_observed_values():
    busbw = [10.0, 80.0, 75.0, 70.0, 72.0, 74.0, 76.0, 78.0, 79.0, 81.0, 82.0]  # one slow call of eleven
    calls = pl.DataFrame({
        "rank": [i % 2 for i in range(11)], "op": ["all_reduce"] * 11, "bytes": [1 << 20] * 11,
        "dur_ns": [1000] * 11, "overlapped_ns": [0] * 11, "exposed_ns": [1000] * 11, "busbw_gbps": busbw})
    row = summaries.collective_summary(calls).row(0, named=True)
    assert row["busbw_p10_gbps"] == _by_hand(busbw, 10) == 70.0  # the 2nd smallest of 11 (ceil(1.1))
    assert row["busbw_p90_gbps"] == _by_hand(busbw, 90) == 81.0  # the 10th smallest (ceil(9.9))

