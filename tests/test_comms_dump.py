"""comms_dict_raw / log_summary_dict importers on the real DeepSpeed 0.19.8 CPU runs (../shared).

Known answers come from the JSON files themselves (running totals, counts) and from the verbose
comms-logger lines of the same rank and run, which keep the call order across message sizes.
"""

import json
import re
import shutil
import statistics
from pathlib import Path

import polars as pl
import pytest
from steplens.analyze import analyses
from steplens.analyze.importers import comms_dump
from steplens.analyze.analyses import comms_log
from steplens.analyze.importers import deepspeed_log
from steplens.analyze.importers import telemetry
from steplens.analyze.importers.base import conform

RUNS = Path(__file__).resolve().parents[1].parent / "shared" / "deepspeed-cpu-runs"
VERBOSE = re.compile(r"comm op: (.+?) \| time \(ms\): ([\d.]+) \| msg size")


@pytest.fixture
def runs() -> Path:
    if not RUNS.is_dir():
        pytest.skip(f"DeepSpeed CPU runs not found at {RUNS}")
    return RUNS


def _raw(runs: Path, run: str, rank: int = 0):
    path = runs / run / "comms" / f"comms_dict_raw_rank{rank}.json"
    return json.loads(path.read_text()), comms_dump.parse_raw(path, f"{run}/comms/{path.name}")


def test_running_totals_detected():
    assert comms_dump.is_running_total([[1.0, 2.0, 2.0, 5.0]]) is True
    assert comms_dump.is_running_total([[1.0, 2.0, 5.0], [3.0, 1.0]]) is False
    assert comms_dump.is_running_total([[1.0, 2.0]]) is None  # two values prove nothing
    assert comms_dump.per_call([1.0, 3.5, 4.0]) == [1.0, 2.5, 0.5]


def test_size_text_back_to_bytes():
    assert comms_dump.size_from_text("512.0 B") == 512
    assert comms_dump.size_from_text("0B") == 0
    assert comms_dump.size_from_text("1.78 MB") == round(1.78 * 2**20)
    assert comms_dump.size_from_text("garbage") is None


@pytest.mark.parametrize("run", ["run1", "run2", "run3", "run5"])
def test_repaired_latencies_sum_to_last_running_total(runs, run):
    raw, imported = _raw(runs, run)
    calls = imported.tables["comms_calls"]
    assert set(calls["latency_origin"]) == {"repaired_cumulative"}
    assert any(i[1] == "cumulative_comms_latency" for i in imported.issues)
    for record, sizes in raw.items():
        op, caller = comms_dump.split_record_name(record)
        mine = calls.filter((pl.col("op") == op) & pl.col("caller").eq_missing(caller))
        totals = [lat for entry in sizes.values() for lat in entry[1]]
        assert mine.height == len(totals) == sum(entry[0] for entry in sizes.values())
        assert mine["latency_ns"].sum() / 1e6 == pytest.approx(max(totals), abs=1e-5 * len(totals))
        assert mine["latency_ns"].min() >= 0


def test_dict_order_matches_the_verbose_lines(runs):
    """Sorting a record name's running totals recovers the call order the log shows, sizes interleaved."""
    _, imported = _raw(runs, "run1")
    log = next((runs / "run1" / "rank_logs").glob("*_rank0.log")).read_text()
    calls = imported.tables["comms_calls"]
    logged: dict[str, list[float]] = {}
    for record, total in VERBOSE.findall(log):
        logged.setdefault(record, []).append(float(total))
    for record in ("all_reduce", "broadcast", "all_gather_into_tensor"):
        from_log = comms_dump.per_call(logged[record])
        from_dict = (calls.filter(pl.col("op") == record)["latency_ns"] / 1e6).to_list()
        # The log prints 2 decimals: each difference is off by at most 0.01 ms.
        assert from_dict[: len(from_log)] == pytest.approx(from_log, abs=0.0101)
    # all_reduce alternates 3.56 MB (gradient bucket) and 4 B (grad norm) in the log.
    sizes = calls.filter(pl.col("op") == "all_reduce")["msg_bytes"].head(4).to_list()
    assert sizes == [3730432, 4, 3730432, 4]


def test_bandwidth_is_nccl_tests(runs):
    _, imported = _raw(runs, "run1")
    calls = imported.tables["comms_calls"]
    gather = calls.filter(pl.col("op") == "all_gather_into_tensor").row(0, named=True)
    # DeepSpeed's msg size is the per-rank shard; nccl-tests S is the whole output (x n = 2).
    assert gather["group_size"] == 2 and gather["nccl_bytes"] == 1865216 * 2
    assert gather["algbw_gbps"] == pytest.approx(1865216 * 2 / gather["latency_ns"])
    assert gather["busbw_gbps"] == pytest.approx(gather["algbw_gbps"] * (2 - 1) / 2)
    reduce = calls.filter((pl.col("op") == "all_reduce") & (pl.col("msg_bytes") == 3730432)).row(0, named=True)
    assert reduce["nccl_bytes"] == 3730432
    assert reduce["busbw_gbps"] == pytest.approx(reduce["algbw_gbps"] * 2 * (2 - 1) / 2)


def test_debug_record_names_split_caller(runs):
    raw, imported = _raw(runs, "run2")
    calls = imported.tables["comms_calls"]
    callers = set(calls.filter(pl.col("op") == "all_reduce")["caller"])
    assert {"allreduce_bucket", "get_grad_norm_direct"} <= callers
    bucket = raw["all_reduce | [Caller Func: allreduce_bucket]"]
    mine = calls.filter(pl.col("caller") == "allreduce_bucket")
    assert mine["latency_ns"].sum() / 1e6 == pytest.approx(max(lat for e in bucket.values() for lat in e[1]), abs=1e-4)


def test_summary_companion_is_untrusted(runs):
    raw_summary = json.loads((runs / "run1" / "comms" / "log_summary_dict_rank0.json").read_text())
    _, imported = _raw(runs, "run1")
    summary = imported.tables["comms_summary"]
    assert set(summary["trusted"]) == {False}
    expected = raw_summary["summary"]["all_reduce"]["3730432"]
    row = summary.filter((pl.col("op") == "all_reduce") & (pl.col("msg_bytes") == 3730432)).row(0, named=True)
    assert row["count"] == expected["count"] and row["total_latency_ms"] == expected["total_latency_ms"]
    assert imported.facts["world_size"] == raw_summary["metadata"]["world_size"]


def test_claims_and_companions(runs, tmp_path):
    comms = runs / "run1" / "comms"
    assert telemetry.claimant(comms / "comms_dict_raw_rank1.json").name == "deepspeed_comms_dict"
    assert telemetry.claimant(comms / "log_summary_dict_rank1.json") is None  # its raw dict reads it
    assert telemetry.claimant(comms / "log_summary_rank0.txt").name == "deepspeed_log"
    alone = tmp_path / "log_summary_dict_rank1.json"
    shutil.copy(comms / alone.name, alone)
    assert telemetry.claimant(alone).name == "deepspeed_comms_summary_dict"
    summary = comms_dump.parse_summary(alone, alone.name)
    assert summary.tables["comms_summary"]["trusted"].null_count() == summary.tables["comms_summary"].height


def test_verbose_lines_and_raw_dict_agree_per_rank_and_run(runs):
    """The same calls seen twice: rank 0's verbose log lines and its comms_dict_raw."""
    log_path = next((runs / "run3" / "rank_logs").glob("*_rank0.log"))
    from_log = deepspeed_log.parse(log_path, log_path.name).tables["comms_calls"]
    _, from_dict = _raw(runs, "run3")
    dict_calls = from_dict.tables["comms_calls"]
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        a = (from_log.filter(pl.col("op") == op)["latency_ns"] / 1e6).to_list()
        b = (dict_calls.filter(pl.col("op") == op)["latency_ns"] / 1e6).to_list()
        assert len(a) == len(b) > 0
        assert a == pytest.approx(b, abs=0.0101)


def test_bad_inputs_give_issues_not_exceptions(runs, tmp_path):
    whole = (runs / "run1" / "comms" / "comms_dict_raw_rank0.json").read_bytes()
    cut = tmp_path / "comms_dict_raw_rank0.json"
    cut.write_bytes(whole[: len(whole) // 2])
    imported = comms_dump.parse_raw(cut, cut.name)
    assert imported.tables == {} and imported.issues[0][:2] == ["error", "bad_json"]

    odd = tmp_path / "comms_dict_raw_rank1.json"
    odd.write_text(json.dumps({"all_reduce": {"4": [2, [1.0, 2.5], [], []], "8": "junk"}, "broadcast": [1]}))
    imported = comms_dump.parse_raw(odd, odd.name)
    assert imported.tables["comms_calls"].height == 2
    assert {i[1] for i in imported.issues} >= {"bad_entry", "no_world_size", "comms_latency_kind_unknown"}

    listing = tmp_path / "comms_dict_raw_rank2.json"
    listing.write_text("[1, 2]")
    assert comms_dump.parse_raw(listing, listing.name).issues[0][1] == "unexpected_layout"
    empty = tmp_path / "comms_dict_raw_rank3.json"
    empty.write_bytes(b"")
    assert comms_dump.parse_raw(empty, empty.name).issues[0][1] == "bad_json"
    assert comms_dump.claims_raw(empty) and comms_dump.claims_raw(listing)  # named as damaged dumps, not left unread


def test_damaged_size_text_is_no_size():
    assert comms_dump.size_from_text("1.2.3 MB") is None
    assert comms_dump.size_from_text("9" * 400 + " PB") is None  # past any int64 count of bytes


def test_damaged_entries_cost_only_themselves(tmp_path):
    """Latencies kept as logged (they decrease): each damaged size entry is skipped alone, as are damaged
    summary entries; nothing else changes."""
    raw = tmp_path / "comms_dict_raw_rank0.json"
    raw.write_text('{"all_reduce": {"4": [2, [0.5, 0.25]], "8": {}, "16": [1, [NaN]], "32": [1, [Infinity]], '
                   '"64": [1, [1e300]], "128": [1, ["0.5"]], "' + "9" * 30 + '": [1, [0.5]]}, '
                   '"broadcast": {"512": [1, [0.75]]}}')
    good = {"count": 1, "total_latency_ms": 0.75, "avg_latency_ms": 0.75, "busbw_avg_gbps": 1.5, "msg_size_bytes": 512}
    summary = {"broadcast": {"512": good, "1024": {**good, "count": 10**30}, "2048": {}},
               "all_reduce": {"4": {**good, "msg_size_bytes": "INF"}}}
    (tmp_path / "log_summary_dict_rank0.json").write_text(
        json.dumps({"summary": summary, "metadata": {"world_size": 2, "rank": 0}}).replace('"INF"', "1e999"))
    imported = comms_dump.parse_raw(raw, raw.name)
    calls = imported.tables["comms_calls"]
    assert calls.select("op", "msg_bytes", "latency_ns", "group_size").rows() == [
        ("all_reduce", 4, 500_000, 2), ("all_reduce", 4, 250_000, 2), ("broadcast", 512, 750_000, 2)]
    assert set(calls["latency_origin"]) == {"as_logged"}
    rows = imported.tables["comms_summary"].select("op", "msg_bytes", "count", "total_latency_ms", "busbw_gbps").rows()
    assert rows == [("broadcast", 512, 1, 0.75, 1.5)]
    bad = [issue for issue in imported.issues if issue[1] == "bad_entry"]
    assert [issue[:3] for issue in bad] == [["warning", "bad_entry", 6], ["warning", "bad_entry", 3]]
    assert "log_summary_dict_rank0.json" in bad[1][3]


def test_a_damaged_running_total_leaves_its_record_name_without_latencies(tmp_path):
    """Running totals: one lost total would fold its call into the next call's difference, so the calls of
    that record name keep no latency; the other record names are repaired as usual."""
    raw = tmp_path / "comms_dict_raw_rank0.json"
    raw.write_text('{"all_reduce": {"4": [3, [1.0, 3.0, 6.0]], "8": [1, [NaN]]}, "broadcast": {"512": [3, [0.5, 1.5, 2.0]]}}')
    imported = comms_dump.parse_raw(raw, raw.name)
    calls = imported.tables["comms_calls"]
    assert set(calls["latency_origin"]) == {"repaired_cumulative"}
    assert calls.select("op", "latency_ns").rows() == [("all_reduce", None)] * 3 + [
        ("broadcast", 500_000), ("broadcast", 1_000_000), ("broadcast", 500_000)]
    [bad] = [issue for issue in imported.issues if issue[1] == "bad_entry"]
    assert bad[:3] == ["warning", "bad_entry", 1] and "other 3 calls" in bad[3]


def test_damaged_summary_metadata_is_left_out(tmp_path):
    path = tmp_path / "log_summary_dict_rank3.json"
    stats = {"count": 2, "total_latency_ms": 1.0, "avg_latency_ms": 0.5, "busbw_avg_gbps": 4.0, "msg_size_bytes": 8}
    path.write_text(json.dumps({"summary": {"all_reduce": {"8": stats}}, "metadata": {"rank": "zero", "world_size": 10**30}}))
    imported = comms_dump.parse_summary(path, path.name)
    assert imported.tables["comms_summary"].select("rank", "msg_bytes", "count").rows() == [(3, 8, 2)]  # rank from the name
    assert imported.facts == {}
    damaged = [issue for issue in imported.issues if issue[1] == "bad_metadata"]
    assert [issue[:3] for issue in damaged] == [["warning", "bad_metadata", 1]] * 2
    assert "rank" in damaged[0][3] and "world_size" in damaged[1][3] and path.name in damaged[0][3]


def test_json_nested_past_the_decoders_depth_is_bad_json(tmp_path):
    path = tmp_path / "comms_dict_raw_rank0.json"
    path.write_text('{"all_reduce": ' + "[" * 100_000 + "]" * 100_000 + "}")
    imported = comms_dump.parse_raw(path, path.name)
    assert imported.tables == {} and [issue[:3] for issue in imported.issues] == [["error", "bad_json", 1]]


def test_comms_log_stats_counts_each_call_once(runs):
    """Rank 0's calls come twice (log lines and dump); the stats use the dump. Expected values are
    recomputed here from the two JSON dumps: sort a record name's totals, take differences."""
    log_path = next((runs / "run1" / "rank_logs").glob("*_rank0.log"))
    frames = [deepspeed_log.parse(log_path, log_path.name).tables["comms_calls"]]
    expected = []
    for rank in (0, 1):
        raw, imported = _raw(runs, "run1", rank)
        frames.append(imported.tables["comms_calls"])
        totals = sorted((lat, int(size)) for size, entry in raw["all_reduce"].items() for lat in entry[1])
        previous = 0.0
        for total, size in totals:
            if size == 3730432:
                expected.append((total - previous) * 1e6)
            previous = total
    stats = comms_log.comms_log_stats(pl.concat(frames))
    row = stats.filter((pl.col("op") == "all_reduce") & (pl.col("nccl_bytes") == 3730432)).row(0, named=True)
    assert (row["calls"], row["ranks"], row["group_size"]) == (len(expected), 2, 2) == (24, 2, 2)
    assert row["median_latency_ns"] == pytest.approx(statistics.median(expected), abs=1)
    assert row["total_latency_ns"] == pytest.approx(sum(expected), abs=len(expected))
    assert row["latency_origin"] == "repaired_cumulative" and row["synchronized"] and "synchronizes" in row["caveat"]
    # Nothing from the log's rounded sizes ("3.56 MB") leaks in beside the dump's exact ones.
    assert stats.filter(pl.col("op") == "all_reduce")["nccl_bytes"].is_in([round(3.56 * 2**20)]).sum() == 0
    assert set(stats.columns) == set(analyses.TABLES["comms_log_stats"][1])


def test_collector_measurements_replace_the_logger_for_their_rank():
    """Rank 0 measured by the collector (two flushed parts) and timed by the comms logger; rank 1 only
    in a dump and a log. Expected by hand: rank 0's two measured calls + rank 1's dump call."""
    def call(rank, source, latency, origin):
        return {"rank": rank, "source": source, "op": "all_reduce", "msg_bytes": 8, "nccl_bytes": 8, "group_size": 2,
                "latency_ns": latency, "latency_origin": origin, "synchronized": origin != "measured"}
    calls = conform([
        call(0, "collector/part-a", 10, "measured"), call(0, "collector/part-b", 30, "measured"),
        call(0, "comms/comms_dict_raw_rank0.json", 99, "repaired_cumulative"),
        call(1, "comms/comms_dict_raw_rank1.json", 20, "repaired_cumulative"),
        call(1, "rank_logs/x_rank1.log", 21, "repaired_cumulative"),
    ], "comms_calls")
    row = comms_log.comms_log_stats(calls).row(0, named=True)
    assert (row["calls"], row["ranks"], row["total_latency_ns"]) == (3, 2, 60)
    assert row["latency_origin"] == "measured,repaired_cumulative"
