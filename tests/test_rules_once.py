"""Rules stated once (issue 38): the run's world size, byte counts as text, the rank of a trace file and the
binding of the per-rank analyses. Each rule is checked on real inputs (../shared), with answers computed here
from the raw files; and a scan of the source (ast: statements, not comments) fails when a second copy reappears."""

from __future__ import annotations

import ast
import functools
import gzip
import json
import re
import shutil
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from steplens.analyze.analyses import runner
from steplens.analyze.contract import schema
from steplens.analyze.contract.units import binary_bytes
from steplens.analyze.pipeline import analyse, cluster
from steplens.analyze.pipeline.ingest import ingest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
NS_TRACE = "corpus/HolisticTraceAnalysis/ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"
LAUNCHER_LOG = "deepspeed-cpu-runs/run1/launcher.log"


def shared(relative: str) -> Path:
    path = SHARED / relative
    if not path.exists():
        pytest.skip(f"{path} not found")
    return path


def trace_document(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes())


def launcher_world_sizes(path: Path) -> set[int]:
    """The dist_world_size the DeepSpeed launcher prints (launch.py), read here with a regex of its own."""
    return {int(n) for n in re.findall(r"dist_world_size=(\d+)", path.read_text())}


def source_named(manifest: dict, path: str) -> dict:
    return next(s for s in manifest["sources"] if s["path"] == path)


def analysed(run: Path) -> tuple[dict, dict]:
    analyse(run, jobs=1)
    return (json.loads((run / ".steplens" / schema.MANIFEST_FILE).read_text()),
            json.loads((run / ".steplens" / schema.FINDINGS_FILE).read_text()))


# ---------------------------------------------------------------------------------------------
# World size


def test_a_log_that_disagrees_with_the_traces_on_world_size_is_told_and_the_analyses_use_the_traces(tmp_path):
    """A real trace (rank 0 of a 1-process NCCL job) beside a real launcher log of another job (2 processes): run.json
    and the analyses state one world size, the traces', and the log is told it disagrees. Before, run.json said 1
    and the collectives finding read the log's 2 ("although the backend is nccl")."""
    trace, log = shared(NS_TRACE), shared(LAUNCHER_LOG)
    doc = trace_document(trace)
    traced, (stated,) = doc["distributedInfo"]["world_size"], launcher_world_sizes(log)
    assert traced != stated
    # the trace's collectives are CPU-side only: the finding then names the world size it used
    events = doc["traceEvents"]
    assert not any(e.get("cat") == "kernel" and re.search("nccl", e.get("name", ""), re.I) for e in events)
    assert any(e.get("name") == "record_param_comms" for e in events)
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(trace, run / trace.name)
    shutil.copy(log, run / log.name)

    manifest, findings = analysed(run)

    assert (manifest["world_size"], manifest["world_size_source"]) == (traced, "traces")
    told = [i for i in source_named(manifest, log.name)["issues"] if i[1] == "world_size_mismatch"]
    assert len(told) == 1 and told[0][0] == "warning"
    assert f"world size {stated}, the traces {traced}" in told[0][3]
    assert f"world size {traced} (" in findings["collectives"]["comms_note"]


def test_without_traces_the_run_facts_give_the_world_size_and_say_which_input(tmp_path):
    log = shared(LAUNCHER_LOG)
    (stated,) = launcher_world_sizes(log)
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(log, run / log.name)

    manifest, _ = analysed(run)

    assert (manifest["world_size"], manifest["world_size_source"]) == (stated, f"run facts: {log.name}")
    assert not [i for s in manifest["sources"] for i in s["issues"] if i[1] == "world_size_mismatch"]


def mentions_world_size(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Constant) and n.value == "world_size") or (isinstance(n, ast.Attribute) and n.attr ==
               "world_size") or (isinstance(n, ast.Name) and n.id == "world_size") for n in ast.walk(node))


def world_size_choices(path: Path) -> list[str]:
    """Where a module chooses a world size itself: `a world size or something else` (a constant default aside), or
    `{"world_size": ..., **facts}` (a fact overriding it)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and mentions_world_size(node.values[0]) \
                and not all(isinstance(v, ast.Constant) for v in node.values[1:]):
            found.append(ast.unparse(node))
        if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "world_size"
                                              and mentions_world_size(v) for k, v in zip(node.keys, node.values)) \
                and any(k is None and not isinstance(v, ast.DictComp) for k, v in zip(node.keys, node.values)):
            found.append(ast.unparse(node))
    return found


def test_the_run_world_size_is_chosen_only_by_the_contract():
    """contract/manifest.py decides it (settle_world_size, run_facts, process_count); the importers state what their
    own input says; every other module reads the result."""
    modules = [p for folder in ("analyze", "reports", "collect") for p in sorted((ROOT / folder).rglob("*.py"))
               if p != ROOT / "analyze/contract/manifest.py" and "importers" not in p.parts]
    assert {ROOT / "analyze/analyses/mfu.py", ROOT / "analyze/pipeline/ingest.py", ROOT / "reports/data.py"} <= set(modules)
    assert {str(p.relative_to(ROOT)): c for p in modules if (c := world_size_choices(p))} == {}
    assert world_size_choices(ROOT / "analyze/contract/manifest.py")  # the scan sees the one place



def test_the_data_parallel_size_is_read_only_by_the_contract():
    """dp_world_size, else the world size: contract/manifest.py data_parallel_size, which MFU and compare call."""
    readers = {str(p.relative_to(ROOT)) for folder in ("analyze", "reports") for p in sorted((ROOT / folder).rglob("*.py"))
               if 'get("dp_world_size")' in p.read_text() and "importers" not in p.parts}
    assert readers == {"analyze/contract/manifest.py"}
    from steplens.analyze.contract.manifest import data_parallel_size
    assert (data_parallel_size({"dp_world_size": 2}, 8), data_parallel_size({}, 8), data_parallel_size({}, None)) == (2, 8, None)

# ---------------------------------------------------------------------------------------------
# Byte counts as text


def test_byte_counts_hand_computed():
    assert binary_bytes(None) == "n/a"
    assert [binary_bytes(n) for n in (0, 1, 1023, 1024, 1536, 100 * 2**10, 1023 * 2**20)] == [
        "0 B", "1 B", "1023 B", "1 KiB", "1.5 KiB", "100 KiB", "1,023 MiB"]
    assert binary_bytes(2**30 + 2**29) == "1.5 GiB" and binary_bytes(1500 * 2**30) == "1,500 GiB"
    assert binary_bytes(12_345_678) == "11.8 MiB"  # 12,345,678 / 1,048,576 = 11.77
    assert binary_bytes(-3 * 2**20) == "-3 MiB"  # a memory slope may fall
    # the memory sentences' precision: 2 decimals, as PyTorch's memory_summary
    assert [binary_bytes(n, decimals=2) for n in (512, 2**20, 12_345_678, 80 * 2**30)] == [
        "512 B", "1.00 MiB", "11.77 MiB", "80.00 GiB"]


def test_the_message_size_axis_labels_powers_of_two_as_whole_units():
    """The busbw figure's log2 axis ticks at powers of two: 2**k is 2**(k % 10) of the k // 10-th unit."""
    units = ("B", "KiB", "MiB", "GiB")
    assert [binary_bytes(2.0**k) for k in range(40)] == [f"{2 ** (k % 10)} {units[k // 10]}" for k in range(40)]


def unit_tables(path: Path) -> list[str]:
    """Literal tuples, lists or sets naming two or more byte units: a units table of the module's own."""
    units = {"B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"}
    return [ast.unparse(node) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(units & {
                n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}) >= 2]


def test_bytes_are_formatted_with_one_units_table():
    modules = sorted(p for folder in ("analyze", "reports", "collect") for p in (ROOT / folder).rglob("*.py"))
    tables = {str(p.relative_to(ROOT)): t for p in modules if (t := unit_tables(p))}
    assert list(tables) == ["analyze/contract/units.py"]


# ---------------------------------------------------------------------------------------------
# The rank of a trace file


def expected_rank(path: Path) -> int:
    """distributedInfo.rank, else the number after 'rank' in the file name (the README's rule)."""
    rank = trace_document(path).get("distributedInfo", {}).get("rank")
    return rank if rank is not None else int(re.search(r"rank[-_]?(\d+)", path.name, re.I).group(1))


def test_the_cluster_places_a_trace_at_the_rank_ingest_gives_it(tmp_path):
    """Real traces ranked three ways: distributedInfo alone (no rank in the name), distributedInfo and the name,
    the name alone. Ingest and the cluster's placement of parts (before the other traces are known) agree."""
    traces = [shared("corpus/HolisticTraceAnalysis/nccl_parser_config/nccl_data.json.gz"),
              shared("corpus/HolisticTraceAnalysis/cpu_only/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"),
              shared("corpus/HolisticTraceAnalysis/large_integer_trace/rank-70.Mar_25_20_48_12.2861.pt.trace.json.gz")]
    assert "distributedInfo" not in trace_document(traces[2])
    run = tmp_path / "run"
    run.mkdir()
    for trace in traces:
        shutil.copy(trace, run / trace.name)

    result = ingest(run, jobs=1)

    ranks = {s.path: s.rank for s in result.sources}
    assert ranks == {t.name: expected_rank(t) for t in traces} == {traces[0].name: 0, traces[1].name: 34,
                                                                    traces[2].name: 70}
    assert {s.path: cluster._likely_rank(s) for s in result.sources} == ranks


def rank_in_name_uses(path: Path) -> list[str]:
    return [ast.unparse(node) for node in ast.walk(ast.parse(path.read_text()))
            if (isinstance(node, ast.Name) and node.id == "RANK_IN_NAME")
            or (isinstance(node, ast.Attribute) and node.attr == "RANK_IN_NAME")
            or (isinstance(node, ast.alias) and node.name == "RANK_IN_NAME")]


def test_the_rank_in_a_file_name_is_read_in_one_place():
    modules = sorted(p for folder in ("analyze", "reports", "collect") for p in (ROOT / folder).rglob("*.py"))
    assert [str(p.relative_to(ROOT)) for p in modules if rank_in_name_uses(p)] == ["analyze/contract/schema.py"]


def in_order(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.sort(frame.columns, nulls_last=True) if frame.width else frame


def test_the_per_rank_analyses_are_bound_by_name_and_run_in_another_folder(tmp_path):
    """runner.run binds the per-rank analyses by name; a cluster task runs them in a folder of its own by rebinding
    out_dir alone, and gets what the staged folder gives."""
    run = tmp_path / "run"
    shutil.copytree(shared("gpu-runs/h200_zero2_gpu_check/job"), run)
    analyse(run, jobs=1)
    captured = []

    def map_ranks(one_batch, batches):
        captured.append(one_batch)
        return list(map(one_batch, batches))

    out = run / ".steplens"
    runner.run(out, map_ranks=map_ranks)
    (one_batch,) = captured
    assert one_batch.args == () and set(one_batch.keywords) == {"out_dir", "facts", "options", "ranks", "context"}
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(out, elsewhere)
    shutil.rmtree(elsewhere / "kernel_launches")  # a per-rank table: the task writes it where it runs
    here = one_batch((0,))
    there = functools.partial(one_batch, out_dir=elsewhere)((0,))
    assert here.keys() == there.keys() and here
    for name in here:
        for a, b in zip(here[name], there[name], strict=True):
            assert_frame_equal(in_order(a), in_order(b))
    written = pl.read_parquet(elsewhere / "kernel_launches", hive_partitioning=True)
    assert written.height > 0
    assert_frame_equal(in_order(written), in_order(pl.read_parquet(out / "kernel_launches", hive_partitioning=True)))


def positional_rebinding(path: Path) -> list[str]:
    """`f(*partial.args[1:])`: some of a partial's positional arguments passed again by position (the others
    replaced by knowing their places)."""
    return [ast.unparse(node) for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Starred)
            and isinstance(node.value, ast.Subscript) and isinstance(node.value.value, ast.Attribute)
            and node.value.value.attr == "args"]


def test_no_partial_is_rebound_by_position():
    modules = sorted(p for folder in ("analyze", "reports", "collect") for p in (ROOT / folder).rglob("*.py"))
    assert {str(p.relative_to(ROOT)): r for p in modules if (r := positional_rebinding(p))} == {}
