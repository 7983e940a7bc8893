"""The run-dir contract (analyze/contract/): what the collector and the analyzer both rely on."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from steplens.analyze import analyses
from steplens.analyze.contract import issue_reasons, layout, schema
from steplens.analyze.pipeline import analyse, ingest
from steplens.analyze.contract.bus_bandwidth import busbw_factor, nccl_tests_op, with_bandwidth
from steplens.analyze.contract.manifest import RunManifest
from steplens.analyze.importers import collector_parts
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


def test_gather_and_scatter_are_sized_as_nccl_tests_does_for_the_collector_and_the_importers_alike():
    """nccl-tests gather.cu/scatter.cu: S = count x typesize x nranks, busbw = S / t x (n-1)/n. DeepSpeed logs one
    rank's piece (its `tensor` argument), so a 4-rank gather of 1 MiB pieces in 1 ms moves S = 4 MiB: algbw
    4.194304 GB/s, busbw 3.145728 GB/s; reduce_scatter's logged input list is already the whole buffer."""
    calls = pl.DataFrame({"op": ["gather", "scatter", "reduce_scatter", "monitored_barrier"],
                          "msg_bytes": [2**20, 2**20, 4 * 2**20, 0], "group_size": [4, 4, 4, 4],
                          "latency_ns": [1_000_000] * 4})
    rows = with_bandwidth(calls).select("nccl_bytes", "algbw_gbps", "busbw_gbps").rows()
    assert rows[:3] == [(4 * 2**20, pytest.approx(4.194304), pytest.approx(3.145728))] * 3
    assert rows[3] == (0, 0.0, None)  # a barrier moves nothing: no bus factor
    # one rule: the collector writes its comms_calls parts and the log and dump importers read theirs with it
    from steplens.analyze.importers import comms_dump, deepspeed_log
    from steplens.collect import collector

    assert collector.with_bandwidth is deepspeed_log.with_bandwidth is comms_dump.with_bandwidth is with_bandwidth


@pytest.mark.parametrize(("name", "op"), [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "allgather"),
    ("ncclKernel_ReduceScatter_RING_LL_Sum_float", "reducescatter"), ("all_gather_into_tensor", "allgather"),
    ("reduce_scatter_tensor", "reducescatter"), ("inference_all_reduce", "allreduce"), ("gather", "gather"),
    ("scatter", "scatter"), ("all_to_all_single", "alltoall"), ("isend", "sendrecv"), ("reduce", "reduce"),
    ("broadcast_object_list", "broadcast"), ("monitored_barrier", "barrier"), ("aten::mm", None)])
def test_collective_names_in_nccl_tests_terms(name, op):
    assert pl.DataFrame({"op": [name]}).select(nccl_op=nccl_tests_op("op"))["nccl_op"][0] == op


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
    # the rank's lock, held while it wrote (hidden: no reader takes it for data)
    assert written == ["collector/manifest/.rank2.lock", "collector/manifest/rank2.json",
                       "collector/train_steps/rank2-00000.parquet"]
    written = written[1:]
    part = collector_parts.parse(tmp_path / written[1], written[1])
    assert part.issues == [] and part.tables["train_steps"].select("rank", "step", "dur_ns").rows() == [(2, 0, 15)]
    manifest = collector_parts.parse(tmp_path / written[0], written[0])
    assert manifest.tables["run_status"]["status"].to_list() == ["completed"]
    # A second writer on the same folder (a resumed job) continues the sequence instead of replacing a part.
    assert PartWriter(tmp_path, rank=2, tables=("train_steps",), prepare={}).seq == 1


SHARED = Path(__file__).resolve().parents[1].parent / "shared"
# Real runs of every kind the analyses see: a 2-rank DeepSpeed CPU job (traces, logs, monitors, comms
# dumps), 2-rank GPU traces with NCCL kernels, a Megatron-DeepSpeed log alone, a DeepSpeed autotuning run.
REAL_RUNS = {
    "deepspeed_cpu_2rank": Path(__file__).resolve().parents[1] / "sample_runs" / "deepspeed_cpu_2rank",
    "gpu_traces_2rank": SHARED / "corpus" / "HolisticTraceAnalysis" / "trace_filter",
    "megatron_log": SHARED / "corpus" / "Megatron-DeepSpeed" / "random_ltd_gpt3_baseline",
    "autotuning": SHARED / "deepspeed-cpu-runs" / "autotune1",
}


@pytest.fixture(scope="module")
def analysed_runs(tmp_path_factory) -> dict[str, Path]:
    missing = [str(path) for path in REAL_RUNS.values() if not path.is_dir()]
    if missing:
        pytest.skip(f"real runs not found: {missing}")
    root = tmp_path_factory.mktemp("contract_runs")
    return {name: analyse(path, root / name, jobs=1)[0].out_dir for name, path in REAL_RUNS.items()}


def test_every_analysis_table_is_written_with_its_declared_schema(analysed_runs):
    """Names, order and Arrow types of every part of every analysis table, empty or not, on every run."""
    rows = {table: 0 for table in analyses.TABLES}
    for name, out_dir in analysed_runs.items():
        for table in analyses.TABLES:
            parts = sorted((out_dir / table).glob("*.parquet"))
            assert parts, f"{name}: {table} not written"
            for part in parts:
                assert pq.read_schema(part) == analyses.TABLES[table][0], f"{name}: {part.relative_to(out_dir)}"
                rows[table] += pq.read_metadata(part).num_rows
    # The runs exercise the trace, log and autotuning analyses with real rows, not only empty tables.
    assert {t for t, n in rows.items() if n} >= {"step_stats", "collectives", "kernel_launches", "gpu_idle", "op_perf",
                                                 "step_time", "comms_log_stats", "autotune_ranking", "autotune_verdict"}


def test_counts_are_int64_where_polars_counts_in_uint32(analysed_runs):
    """step_stats.ranks is a polars count (uint32) cast to the declared int64: 2 ranks per step of a 2-rank job."""
    stats = pq.read_table(analysed_runs["gpu_traces_2rank"] / "step_stats")
    assert stats.schema.field("ranks").type == pa.int64()
    assert set(stats["ranks"].to_pylist()) == {2}


def test_run_json_keys_are_the_manifest_fields(analysed_runs):
    """Every key a real run.json holds is a RunManifest field and every field is written, in declaration order."""
    fields = [f.name for f in dataclasses.fields(RunManifest)]
    for name, out_dir in analysed_runs.items():
        text = (out_dir / schema.MANIFEST_FILE).read_text()
        assert list(json.loads(text)) == fields, name
        assert RunManifest.from_json(text).to_json() == text, name  # round trip, byte for byte
    autotuning = RunManifest.from_json((analysed_runs["autotuning"] / schema.MANIFEST_FILE).read_text())
    assert autotuning.created_by == "steplens ingest" and autotuning.trace_ranks == [] and autotuning.run_name == "autotune1"
    gpu = RunManifest.from_json((analysed_runs["gpu_traces_2rank"] / schema.MANIFEST_FILE).read_text())
    assert gpu.trace_ranks == [0, 1] and {s["path"] for s in gpu.sources} == {"sampled_rank-0.json.gz", "sampled_rank-1.json.gz"}


def test_older_run_json_loads_and_unknown_keys_are_refused_only_when_writing():
    older = RunManifest.from_json('{"schema_version": 1, "run_id": "abc", "ranks": [0, 1], "from_the_future": 3}')
    assert (older.run_id, older.ranks, older.trace_ranks, older.schema_fingerprint) == ("abc", [0, 1], [], None)
    assert "output_entries" not in older.to_dict()  # absent until the output folder is complete
    with pytest.raises(KeyError, match="from_the_future"):
        RunManifest.from_dict({"run_id": "abc", "from_the_future": 3}, strict=True)


def test_readme_documents_every_run_json_key():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    paragraph = readme[readme.index("**`run.json`**"):readme.index("**`trace_events`**")]
    assert [f.name for f in dataclasses.fields(RunManifest) if f"`{f.name}`" not in paragraph] == []


ANALYZER = Path(__file__).resolve().parents[1] / "analyze"
# Reasons the importers pass as variables (the keys of a table of checks), not as literals.
REASONS_FROM_TABLES = {"importers/json_events.py": {"malformed_event", "nesting_too_deep", "oversized_event",
                                                        "repaired_text", "duplicate_keys"},
                       "importers/kineto.py": {"missing_timestamp", "bad_timestamp", "bad_duration"}}


def raised_issues() -> tuple[dict[str, set[str]], list[str]]:
    """(reason -> severities) of every issue the analyzer's source raises, in either shape:
    Issue(severity, reason, count, detail) and [severity, reason, count, detail]; and the places whose
    reason is not a literal."""
    raised: dict[str, set[str]] = {}
    not_literal = []
    for path in sorted(ANALYZER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Issue":
                fields = node.args
            elif isinstance(node, ast.List) and len(node.elts) == 4:
                fields = node.elts
            else:
                continue
            severity, reason = fields[0], fields[1]
            if not (isinstance(severity, ast.Constant) and severity.value in ("info", "warning", "error")):
                continue
            if isinstance(reason, ast.Constant):
                raised.setdefault(reason.value, set()).add(severity.value)
            else:
                not_literal.append(f"{path.relative_to(ANALYZER)}:{node.lineno}")
    return raised, not_literal


def test_every_reason_the_analyzer_raises_is_declared_with_its_severity():
    raised, not_literal = raised_issues()
    assert len(raised) > 50  # the scan finds the importers' issues at all
    undeclared = sorted(set(raised) - set(issue_reasons.ISSUE_REASONS))
    assert undeclared == []
    wrong_severity = {r: s for r, s in raised.items() if not s <= set(issue_reasons.ISSUE_REASONS[r].severities)}
    assert wrong_severity == {}
    # Reasons passed as variables come from the tables named above; each file still has exactly one such site.
    assert sorted(site.split(":")[0] for site in not_literal) == sorted(REASONS_FROM_TABLES)
    for reasons in REASONS_FROM_TABLES.values():
        assert reasons <= set(issue_reasons.ISSUE_REASONS)
    source_text = {f: (ANALYZER / f).read_text() for f in REASONS_FROM_TABLES}
    assert all(f'"{r}"' in source_text[f] for f, reasons in REASONS_FROM_TABLES.items() for r in reasons)
    # Nothing declared that nothing raises.
    declared_unused = set(issue_reasons.ISSUE_REASONS) - set(raised) - set().union(*REASONS_FROM_TABLES.values())
    assert declared_unused == set()


def test_registry_declares_each_reason_once_with_known_severities():
    names = [r.name for r in issue_reasons._DECLARED]
    assert len(names) == len(set(names))
    assert all(r.severities and set(r.severities) <= {"info", "warning", "error"} and r.meaning for r in issue_reasons._DECLARED)


def test_readme_lists_exactly_the_declared_reasons():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme.index("Every reason, with its severity and meaning")
    listed = re.findall(r"`([a-z0-9_]+)`", readme[start:readme.index("\n\n", start)])
    assert listed == list(issue_reasons.ISSUE_REASONS)


def test_ingest_refuses_an_undeclared_reason(tmp_path):
    """The ingest_issues table is built only from declared reasons at an allowed severity."""
    source = ingest.Source(path="a.json", size=1, mtime_ns=0, hash_prefix="", issues=[["warning", "truncated", 1, "cut"]])
    table = ingest._issues_table([source])
    assert table.column("reason").to_pylist() == ["truncated"]
    source.issues = [["warning", "made_up_reason", 1, "?"]]
    with pytest.raises(ValueError, match="made_up_reason"):
        ingest._issues_table([source])
    source.issues = [["info", "rank_unknown", 1, "?"]]  # declared as error only
    with pytest.raises(ValueError, match="rank_unknown"):
        ingest._issues_table([source])
