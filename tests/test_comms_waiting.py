"""Logged collective latencies where one rank reaches every call early and waits for the other: the op's own cost is
the median of the rank that waits least, not the median over every call (which sits between the two ranks)."""

from __future__ import annotations

import polars as pl

from steplens.analyze.analyses import comms_log


def _calls(per_rank: dict[int, list[int]]) -> pl.DataFrame:
    rows = [{"rank": rank, "source": f"rank{rank}.json", "op": "all_reduce", "msg_bytes": 1 << 20, "nccl_bytes": 1 << 20,
             "group_size": 2, "latency_ns": ns, "algbw_gbps": (1 << 20) / ns, "busbw_gbps": (1 << 20) / ns,
             "latency_origin": "measured", "synchronized": False}
            for rank, values in per_rank.items() for ns in values]
    return pl.DataFrame(rows)


def test_a_rank_that_waits_is_told_apart_from_the_op():
    """Rank 0 waits about 31 ms in every call for rank 1, whose calls take about 1 ms: the median over all six
    calls is 16.05 ms (the mean of the middle two, 1.1 and 31 ms), neither rank's; rank 1's median 1.0 ms is the op,
    its busbw 1 MiB / 1.0 ms."""
    stats = comms_log.comms_log_stats(_calls({0: [32_000_000, 31_000_000, 33_000_000], 1: [1_000_000, 900_000, 1_100_000]}))
    row = stats.row(0, named=True)
    assert row["median_latency_ns"] == 16_050_000  # (1_100_000 + 31_000_000) / 2: no call took it
    assert (row["least_wait_rank"], row["least_wait_median_latency_ns"], row["most_wait_median_latency_ns"]) == \
        (1, 1_000_000, 32_000_000)
    assert row["least_wait_median_busbw_gbps"] == (1 << 20) / 1_000_000
    line = comms_log.logged_lines(comms_log.costliest_finding(stats), {})[0]
    assert "the median call takes 1 ms on rank 1, the rank that waits least" in " ".join(line.split())
    assert "and 32 ms on the rank that waits most, which reaches it early" in " ".join(line.split())


def test_ranks_that_agree_keep_the_plain_median():
    """Ranks within twice each other's median: the line gives the median over every call, as before."""
    stats = comms_log.comms_log_stats(_calls({0: [1_200_000, 1_300_000, 1_250_000], 1: [1_000_000, 900_000, 1_100_000]}))
    line = " ".join(comms_log.logged_lines(comms_log.costliest_finding(stats), {})[0].split())
    assert "(median 1.15 ms" in line and "waits least" not in line


def test_a_rank_with_a_stray_call_is_not_the_op_or_the_wait():
    """Rank 0 timed one 0.1 ms call, ranks 1-3 a hundred each at about 1, 1.05 and 3 ms: rank 0 is left out of the
    comparison (fewer than half the calls of the rank that timed most), so rank 1 is the one that waits least and 3 ms
    is the most; with one rank alone there is nothing to compare."""
    stats = comms_log.comms_log_stats(_calls({0: [100_000], 1: [1_000_000] * 100, 2: [1_050_000] * 100,
                                              3: [3_000_000] * 100}))
    row = stats.row(0, named=True)
    assert (row["least_wait_rank"], row["least_wait_median_latency_ns"], row["most_wait_median_latency_ns"]) == \
        (1, 1_000_000, 3_000_000)
    alone = comms_log.comms_log_stats(_calls({0: [1_000_000, 30_000_000]})).row(0, named=True)
    assert alone["least_wait_rank"] is None and alone["most_wait_median_latency_ns"] is None
