"""Traces of different jobs in one folder are not aligned as one job (issue 36, item 2).

Every expected number is recomputed from the raw traces with the json module: NCCL kernels
numbered per collective in time order on each rank, the median and half range of the differences
of their end times, and the median ProfilerStep duration."""

import gzip
import json
import re
import shutil
import statistics

import polars as pl
import pytest
from click.testing import CliRunner

from steplens.analyze.cli import analyze
from steplens.analyze.pipeline import analyse
from steplens.reports.verdict import finding_lines, first_screen

from conftest import CORPUS, write_trace

TRACE_DIFF = CORPUS / "HolisticTraceAnalysis" / "trace_diff"  # an A100 "rank 3 of 8" and a V100 "rank 1 of 2"

pytestmark = pytest.mark.skipif(not CORPUS.is_dir(), reason="shared corpus not found")


def _raw(path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _nccl_ends_us(doc) -> dict:
    """(collective, k) -> end time in µs of the k-th NCCL kernel of that collective, in time order."""
    kernels = sorted((e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"
                      and "nccl" in e["name"].lower()), key=lambda e: float(e["ts"]))
    seen, ends = {}, {}
    for e in kernels:
        op = re.search(r"nccl(?:Kernel|Dev)?_?([A-Za-z]+)", e["name"]).group(1).lower()
        ends[(op, seen.get(op, 0))] = float(e["ts"]) + float(e["dur"])
        seen[op] = seen.get(op, 0) + 1
    return ends


def _median_step_us(doc) -> float:
    return statistics.median(float(e["dur"]) for e in doc["traceEvents"]
                             if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#"))


def _table(out, name):
    return pl.read_parquet(out / name / "*.parquet")


def test_an_a100_rank_of_8_and_a_v100_rank_of_2_are_not_aligned_as_one_job(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(TRACE_DIFF, run)
    docs = {d["distributedInfo"]["rank"]: d for d in (_raw(p) for p in sorted(run.glob("*.json.gz")))}
    assert {r: d["distributedInfo"]["world_size"] for r, d in docs.items()} == {1: 2, 3: 8}
    result = CliRunner().invoke(analyze, [str(run), "-q"])
    assert result.exit_code == 0, result.output
    out = run / ".steplens"
    findings = json.loads((out / "findings.json").read_text())
    offsets = _table(out, "clock_offsets").sort("rank")
    assert offsets["method"].to_list() == [
        "reference", "refused: its trace records world size 8, rank 1's 2: ranks of different jobs"]
    assert offsets["offset_ns"].to_list() == [0, None]
    assert findings["steps"]["clock_alignment"] == {"reference_rank": 1, "refused": [
        {"rank": 3, "reason": "its trace records world size 8, rank 1's 2: ranks of different jobs"}]}
    # Not drawn as one step, no aligned wall time across the two, nobody waited for anybody.
    assert _table(out, "step_timeline")["rank"].unique().to_list() == [1]
    times = _table(out, "step_times")
    assert times.filter(pl.col("rank") == 3)["aligned_start_ns"].null_count() == times.filter(pl.col("rank") == 3).height
    assert findings["steps"]["stragglers"] == [] and _table(out, "step_stats")["straggler_rank"].null_count() == 6
    assert ("Not one job: rank 3's trace is not aligned with rank 1's (its trace records world size 8, rank 1's 2: ranks "
            "of different jobs); its steps are not drawn on one clock with the others and no straggler is named across "
            "them.") in finding_lines(findings)
    report = (out / "report.html").read_text()
    assert "rank(s) 3 left out: not one job with the others" in report and "Not one job: rank 3" in report
    assert "Not one job: rank 3" in result.output
    # and the first screen says so
    assert ("Not one job: rank(s) 3 not aligned with rank 1", "steps") in first_screen(findings)
    # the step time is the job's: rank 1's ProfilerSteps alone (rank 3's are another job's), and says so
    step_time = findings["step_time"]
    assert (step_time["median_ns"], step_time["other_job_ranks"]) == (round(_median_step_us(docs[1]) * 1000), [3])
    assert any(line.startswith("Step time:") and "from the profiled steps of the ranks of one job (rank 3 left out: "
               "another job's trace)" in line for line in finding_lines(findings))


def test_without_world_sizes_the_clocks_still_tell_two_jobs_apart(tmp_path):
    """The same two traces with distributedInfo.world_size removed: the offset's uncertainty (half the
    range of the per-collective end-time differences) exceeds the shorter median step."""
    run = tmp_path / "run"
    run.mkdir()
    docs = {}
    for path in sorted(TRACE_DIFF.glob("*.json.gz")):
        doc = _raw(path)
        del doc["distributedInfo"]["world_size"]
        docs[doc["distributedInfo"]["rank"]] = doc
        (run / path.name.removesuffix(".gz")).write_text(json.dumps(doc))
    ref, other = _nccl_ends_us(docs[1]), _nccl_ends_us(docs[3])
    diffs_us = [other[k] - ref[k] for k in ref if k in other]
    offset_ns, half_range_ns = round(statistics.median(diffs_us) * 1000), round((max(diffs_us) - min(diffs_us)) / 2 * 1000)
    step_ns = min(_median_step_us(docs[1]), _median_step_us(docs[3])) * 1000
    assert half_range_ns > step_ns  # the premise: ± 135.9 ms against a 76.8 ms step
    findings = analyse(run, jobs=1)[1]
    offsets = _table(run / ".steplens", "clock_offsets").sort("rank")
    assert offsets["offset_ns"].to_list() == [0, None]
    reason = (f"offset {offset_ns / 1e9:,.3f} s known only to ± {half_range_ns / 1e6:,.1f} ms, more than a step "
              f"({step_ns / 1e6:,.1f} ms): its collectives do not end with rank 1's, so they are not one job's")
    assert offsets["method"][1] == "refused: " + reason
    assert findings["steps"]["clock_alignment"]["refused"] == [{"rank": 3, "reason": reason}]


@pytest.mark.parametrize("folder", ["param/dlrm_kineto", "HolisticTraceAnalysis/trace_filter"])
def test_the_real_ranks_of_one_job_still_align(tmp_path, folder):
    """Control: 8 dlrm V100 ranks (offsets known to µs), and two ranks of a 128-rank job whose sampled
    traces match some collectives wrongly (± ~100 ms, still well under their ~615 ms step)."""
    run = tmp_path / "run"
    shutil.copytree(CORPUS / folder, run)
    docs = {d["distributedInfo"]["rank"]: d for d in (_raw(p) for p in sorted(run.iterdir()))}
    findings = analyse(run, jobs=1)[1]
    offsets = _table(run / ".steplens", "clock_offsets").sort("rank")
    reference = min(docs)
    assert offsets["method"].to_list() == ["reference"] + ["collective end times"] * (len(docs) - 1)
    assert "clock_alignment" not in findings["steps"]
    ref = _nccl_ends_us(docs[reference])
    for rank, offset_ns, uncertainty_ns in offsets.filter(pl.col("rank") != reference).select(
            "rank", "offset_ns", "uncertainty_ns").iter_rows():
        ends = _nccl_ends_us(docs[rank])
        diffs_us = [ends[k] - ref[k] for k in ref if k in ends]
        assert offset_ns == pytest.approx(statistics.median(diffs_us) * 1000, abs=1)
        assert uncertainty_ns == pytest.approx((max(diffs_us) - min(diffs_us)) / 2 * 1000, abs=1)
        assert uncertainty_ns < min(_median_step_us(docs[rank]), _median_step_us(docs[reference])) * 1000
    assert sorted(_table(run / ".steplens", "step_timeline")["rank"].unique().to_list()) == sorted(docs)


def test_one_rank_claimed_by_traces_of_two_world_sizes_is_not_merged(tmp_path):
    """Rank 0 of a 2-rank job and rank 0 of a 4-rank job, at different times and steps: not two profiler
    windows of one process (one process has one world size)."""
    for name, world_size, start in (("a.json", 2, 0), ("b.json", 4, 10_000)):
        events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{start // 1000}", "pid": 1, "tid": 1,
                   "ts": start, "dur": 1000},
                  {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": start + 10, "dur": 100}]
        write_trace(tmp_path / "run" / name, events, distributedInfo={"rank": 0, "world_size": world_size})
    manifest = analyse(tmp_path / "run", jobs=1)[0].manifest
    status = {s["path"]: (s["status"], [i[1] for i in s["issues"]]) for s in manifest["sources"]}
    assert status["a.json"][0] == "ingested" and status["b.json"][0] == "error" and "duplicate_rank" in status["b.json"][1]
    assert manifest["trace_ranks"] == [0]
    detail = next(i[3] for s in manifest["sources"] if s["path"] == "b.json" for i in s["issues"] if i[1] == "duplicate_rank")
    assert detail == "claims rank 0 of world size 4, as a.json does of world size 2: ranks of two jobs; skipped, not merged into that rank"


def test_no_straggler_is_named_across_ranks_refused_as_one_job(tmp_path):
    """A generated run with a true straggler (rank 2 in step 12): named when the ranks are one job, not
    when step_stats is told they are not."""
    from steplens.analyze.analyses import steps
    from synthetic import generate_run

    generate_run(tmp_path / "run", ranks=4, steps=5, seed=3, stragglers=[(2, 12)])
    truth = json.loads((tmp_path / "run" / "truth.json").read_text())
    analyse(tmp_path / "run", jobs=1)
    times = _table(tmp_path / "run" / ".steplens", "step_times")
    judged = steps.step_stats(times).filter(pl.col("straggler_rank").is_not_null())
    assert judged.select("straggler_rank", "step").rows() == [(s["rank"], s["step"]) for s in truth["stragglers"]]
    assert steps.step_stats(times, judge_stragglers=False)["straggler_rank"].null_count() == times["step"].n_unique()
