"""The run-dir contract (analyze/contract/): what the collector and the analyzer both rely on."""

from __future__ import annotations

import polars as pl
import pytest

from steplens.analyze.contract.bus_bandwidth import busbw_factor
from steplens.collect.comms import with_bandwidth


def test_bus_factors_are_nccl_tests_ones():
    """nccl-tests PERFORMANCE.md: allreduce 2(n-1)/n, allgather/reducescatter/alltoall (n-1)/n, broadcast 1."""
    ops = pl.DataFrame({"op": ["allreduce", "allgather", "reducescatter", "alltoall", "broadcast", "sendrecv", "barrier",
                               "allreduce"],
                        "group_size": [8, 8, 4, 2, 8, 2, 8, 0]})
    factors = ops.select(factor=busbw_factor())["factor"].to_list()
    assert factors == [pytest.approx(14 / 8), pytest.approx(7 / 8), pytest.approx(3 / 4), pytest.approx(1 / 2), 1.0, 1.0,
                       None, None]


def test_collector_bandwidth_uses_the_contract_factor():
    """A 4-rank all_gather of a 1 MB shard in 1 ms: S = 4 MB, algbw 4 GB/s, busbw 4 x 3/4 = 3 GB/s
    (the collector's DeepSpeed op name mapped to nccl-tests' allgather)."""
    calls = pl.DataFrame({"op": ["all_gather_into_tensor", "all_reduce"], "msg_bytes": [1_000_000, 2_000_000],
                          "group_size": [4, 2], "latency_ns": [1_000_000, 2_000_000]})
    rows = with_bandwidth(calls).select("nccl_bytes", "algbw_gbps", "busbw_gbps").rows()
    assert rows[0] == (4_000_000, pytest.approx(4.0), pytest.approx(3.0))
    # all_reduce of 2 MB in 2 ms over 2 ranks: algbw 1 GB/s, busbw 2 x 1/2 x 1 = 1 GB/s
    assert rows[1] == (2_000_000, pytest.approx(1.0), pytest.approx(1.0))
