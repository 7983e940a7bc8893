"""The run-dir contract (analyze/contract/): what the collector and the analyzer both rely on."""

from __future__ import annotations

import polars as pl
import pytest

from steplens.analyze.contract import layout
from steplens.analyze.contract.bus_bandwidth import busbw_factor
from steplens.analyze.importers import collector_parts
from steplens.collect.comms import with_bandwidth
from steplens.collect.parts import PartWriter


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


def test_collector_layout_paths_are_the_public_ones(tmp_path):
    """The on-disk names are a public interface: spelled out here, not rebuilt from layout's own code."""
    root = layout.collector_root(tmp_path)
    assert root == tmp_path / "collector"
    assert layout.part_path(root, "train_steps", 3, 12) == tmp_path / "collector/train_steps/rank3-00012.parquet"
    assert layout.manifest_path(root, 7) == tmp_path / "collector/manifest/rank7.json"
    assert layout.parse_part(tmp_path / "collector/scalars/rank3-00012.parquet") == layout.CollectorPart("scalars", 3, 12)
    assert layout.parse_part(tmp_path / "collector/scalars/rank3-123456.parquet").seq == 123456  # seq past 5 digits
    assert layout.parse_manifest(tmp_path / "collector/manifest/rank7.json") == 7
    not_parts = ["collector/scalars/.rank3-00012.parquet.tmp", "collector/not_a_table/rank0-00001.parquet",
                 "elsewhere/scalars/rank0-00001.parquet", "collector/scalars/rank0.parquet", "collector/manifest/rank0.json"]
    assert [layout.parse_part(tmp_path / p) for p in not_parts] == [None] * len(not_parts)
    not_manifests = ["collector/manifest/.rank0.json.tmp", "collector/other/rank0.json", "manifest/rank0.json"]
    assert [layout.parse_manifest(tmp_path / p) for p in not_manifests] == [None] * len(not_manifests)


def test_part_writer_files_are_claimed_by_the_analyzer(tmp_path):
    """Both sides through the contract: what PartWriter writes, collector_parts reads, rank and table intact."""
    writer = PartWriter(tmp_path, rank=2, tables=("train_steps",), prepare={})
    writer.add("train_steps", {"rank": 2, "source": "collector", "step": 0, "micro_step": 0, "start_ns": 10, "end_ns": 25,
                               "dur_ns": 15, "is_boundary": True})
    writer.flush({"format": layout.COLLECTOR_MANIFEST_FORMAT, "rank": 2, "status": "completed"}, background=False)
    writer.close()
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["collector/manifest/rank2.json", "collector/train_steps/rank2-00000.parquet"]
    part = collector_parts.parse(tmp_path / written[1], written[1])
    assert part.issues == [] and part.tables["train_steps"].select("rank", "step", "dur_ns").rows() == [(2, 0, 15)]
    manifest = collector_parts.parse(tmp_path / written[0], written[0])
    assert manifest.tables["run_status"]["status"].to_list() == ["completed"]
    # A second writer on the same folder (a resumed job) continues the sequence instead of replacing a part.
    assert PartWriter(tmp_path, rank=2, tables=("train_steps",), prepare={}).seq == 1
