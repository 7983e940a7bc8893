"""`steplens export-trace`: all ranks on one clock, exact times, flows kept, slices nested."""

import json

import pytest
from click.testing import CliRunner

from steplens.analyze.cli import steplens
from steplens.analyze.pipeline import analyse
from synthetic import generate_run


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    run = tmp_path_factory.mktemp("exp") / "run"
    generate_run(run, ranks=3, steps=4, seed=11, stragglers=[(1, 12)])
    analyse(run, jobs=1)
    truth = json.loads((run / "truth.json").read_text())
    result = CliRunner().invoke(steplens, ["export-trace", str(run)])
    assert result.exit_code == 0, result.output
    return run, truth, json.loads((run / ".steplens" / "merged_trace.json").read_text()), result.output


def _ns(us) -> int:
    text = f"{us:.3f}"
    whole, frac = text.split(".")
    return int(whole) * 1000 + int(frac)


def test_ranks_share_the_reference_clock(exported):
    run, truth, trace, _ = exported
    origin = trace["otherData"]["origin_ns"]
    starts = {(e["pid"], e["name"]): _ns(e["ts"]) + origin for e in trace["traceEvents"]
              if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")}
    for rank, info in truth["ranks"].items():
        for step in info["steps"]:
            # Rank 0's clock is the reference and truth's rank 0 has no offset: aligned = true time.
            assert starts[(int(rank), f"ProfilerStep#{step['step']}")] == step["true_start_ns"]


def test_every_event_and_launch_is_exported(exported):
    run, truth, trace, output = exported
    kinds = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver", "kernel", "gpu_memcpy", "gpu_memset")
    for rank, info in truth["ranks"].items():
        mine = [e for e in trace["traceEvents"] if e.get("pid") == int(rank) and e.get("ph") == "X"]
        assert len(mine) == sum(info["event_counts"][k] for k in kinds)
    starts = [e for e in trace["traceEvents"] if e.get("ph") == "s"]
    ends = {e["id"] for e in trace["traceEvents"] if e.get("ph") == "f"}
    assert len(starts) == sum(i["launch_links"] for i in truth["ranks"].values()) and {e["id"] for e in starts} == ends
    assert "0 slices overlap without nesting" in output


def test_slices_nest_on_every_thread(exported):
    _, _, trace, _ = exported
    threads = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            threads.setdefault((e["pid"], e["tid"]), []).append((_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])))
    for spans in threads.values():
        stack = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1]
            stack.append(end)


def test_step_range_and_errors(exported, tmp_path):
    run, _, _, _ = exported
    runner = CliRunner()
    out = tmp_path / "s.json"
    assert runner.invoke(steplens, ["export-trace", str(run), "--steps", "12:12", "--out", str(out)]).exit_code == 0
    steps = {e["args"]["step"] for e in json.loads(out.read_text())["traceEvents"] if e.get("ph") == "X"}
    assert steps == {12}
    assert runner.invoke(steplens, ["export-trace", str(run), "--steps", "x"]).exit_code == 2
    assert runner.invoke(steplens, ["export-trace", str(run), "--steps", "10:"]).exit_code == 2  # was read as step 10 alone
    backwards = runner.invoke(steplens, ["export-trace", str(run), "--steps", "13:10", "--out", str(tmp_path / "b.json")])
    assert backwards.exit_code == 2 and "13:10 runs backwards" in backwards.output and not (tmp_path / "b.json").exists()
    none = runner.invoke(steplens, ["export-trace", str(run), "--steps", "99:99", "--out", str(out)])
    assert none.exit_code == 2 and "no events" in none.output
    missing = runner.invoke(steplens, ["export-trace", str(tmp_path)])
    assert missing.exit_code == 2 and "analyze" in missing.output


def test_nothing_to_export_writes_nothing_and_the_next_analyze_runs(exported, tmp_path):
    """An export of no events wrote an empty merged_trace.json into the output folder that run.json did not list,
    and the next `analyze` refused the folder; an earlier export was overwritten."""
    run, _, whole, _ = exported
    default = run / ".steplens" / "merged_trace.json"
    before = default.read_bytes()
    none = CliRunner().invoke(steplens, ["export-trace", str(run), "--steps", "99:99"])
    assert none.exit_code == 2 and default.read_bytes() == before
    again = CliRunner().invoke(steplens, ["analyze", str(run), "-q"])
    assert again.exit_code == 0, again.output


def test_an_export_beside_the_ranks_traces_is_not_read_as_a_rank(exported, tmp_path):
    """The merged trace written into the input folder: the next `analyze` names it and reads the ranks as before
    (it was a fourth trace claiming rank 0)."""
    import shutil

    import polars as pl

    run, _, _, _ = exported
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns(".steplens"))
    merged = copy / "merged.json"
    assert CliRunner().invoke(steplens, ["export-trace", str(run), "--out", str(merged)]).exit_code == 0
    analyse(copy, jobs=1)
    issues = pl.read_parquet(copy / ".steplens" / "ingest_issues").filter(pl.col("file") == "merged.json")
    assert issues.select("severity", "reason").rows() == [("info", "not_a_trace")]
    assert "steplens export-trace" in issues["detail"][0]
    ranks = pl.read_parquet(copy / ".steplens" / "trace_events").select(pl.col("rank").unique().sort())["rank"]
    assert ranks.to_list() == [0, 1, 2]


def test_negative_durations_keep_their_value():
    """µs text for ns: floor division wrote -1500 ns as -2.500 and -5 ns as -1.995."""
    from steplens.analyze.query.export_trace import _us

    assert [bytes(_us(ns)).decode() for ns in (-1500, -5, 0, 5, 1500, -1_000_000)] == [
        "-1.500", "-0.005", "0.000", "0.005", "1.500", "-1000.000"]


def test_a_failed_write_leaves_no_temporary_file_and_names_the_file(tmp_path, monkeypatch):
    """A full disk left merged_trace.json.tmp in the output folder (every later `analyze` refused it) and the
    message named no file."""
    import errno
    import os

    from steplens.analyze.query import export_trace

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    target = tmp_path / "merged_trace.json"
    with pytest.raises(OSError) as raised:
        export_trace._write_atomic(target, b"{}")
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(target)
    assert list(tmp_path.iterdir()) == []


def test_ranks_without_a_clock_offset_are_named_not_passed_off_as_aligned(tmp_path):
    """A gloo run has no collective kernels to match: rank 1 of the bundled CPU sample has no clock offset, and the
    export said every rank was on the reference clock while it left rank 1 on its own. The ranks with a null offset
    in clock_offsets (read here with pyarrow) are named in the summary and in the file."""
    import json
    import shutil
    from pathlib import Path

    import pyarrow.parquet as pq
    from click.testing import CliRunner
    from steplens.analyze.cli import analyze, steplens

    run = tmp_path / "run"
    shutil.copytree(Path(__file__).resolve().parents[1] / "sample_runs" / "deepspeed_cpu_2rank", run,
                    ignore=shutil.ignore_patterns(".steplens"))
    assert CliRunner().invoke(analyze, [str(run), "-q"]).exit_code in (0, 1)
    offsets = pq.read_table(run / ".steplens" / "clock_offsets").to_pylist()
    unaligned = sorted(r["rank"] for r in offsets if r["offset_ns"] is None)
    assert unaligned  # the sample's gloo ranks: nothing to align on
    done = CliRunner().invoke(steplens, ["export-trace", str(run), "--out", str(tmp_path / "t.json")])
    assert done.exit_code == 0, done.output
    said = " ".join(done.output.split())
    assert f"rank(s) {', '.join(map(str, unaligned))} not aligned (no collective kernels to match): on their own clocks" in said
    assert f"ranks {unaligned} on their own clocks" in json.loads((tmp_path / "t.json").read_text())["otherData"]["steplens"]


@pytest.mark.parametrize("synchronized", [[False, False, None], [True, False, True]])
@pytest.mark.parametrize("sources", [["rank_logs/r0.log"] * 3, ["collector/comms_calls/rank0-00000.parquet"] * 3])
def test_the_comms_logger_caveat_says_how_and_by_whom_the_calls_were_timed(synchronized, sources):
    """A CPU run's comms records force no synchronization: the caveat read '3 communication calls were timed with a
    synchronizing logger (0 forced a synchronization)', and a run with the collector alone was said to be timed by
    the comms logger. Hand-made comms_calls rows."""
    import polars as pl
    from steplens.analyze.analyses import caveats, comms_log

    class Run:
        def table(self, name):
            return pl.DataFrame({"latency_origin": ["measured"] * 3, "synchronized": synchronized, "source": sources}) \
                if name == "comms_calls" else pl.DataFrame()

    [caveat] = caveats._comms_logger_timings(Run())
    forced = sum(bool(s) for s in synchronized)
    who = "the collector" if sources[0].startswith("collector/") else "DeepSpeed's comms logger"
    expected = (f"3 communication calls were timed with synchronizing timers by {who} ({forced} forced a "
                "synchronization)." if forced else
                f"3 communication calls were timed one by one by {who} (none forced a device synchronization).")
    assert caveat["detail"].startswith(expected)
    calls = pl.DataFrame({"rank": [0, 0, 1], "source": sources, "latency_origin": ["measured"] * 3, "op": ["all_reduce"] * 3,
                          "msg_bytes": [8] * 3, "nccl_bytes": [8] * 3, "group_size": [2] * 3, "latency_ns": [10**6] * 3,
                          "algbw_gbps": [0.008] * 3, "busbw_gbps": [0.008] * 3, "synchronized": synchronized})
    line = comms_log.logged_lines(comms_log.costliest_finding(comms_log.comms_log_stats(calls)), {})[0]
    assert line.endswith("synchronizing timers: per-op cost, not throughput)." if forced else
                         "each call timed on its own: per-op cost, not throughput).")


@pytest.mark.parametrize("special", ["device", "fifo"])
def test_an_output_that_is_no_plain_file_is_refused_unread(exported, tmp_path, special):
    """--out /dev/full (a device that never ends) was read whole to see whether export-trace wrote it: 22 GB and an
    out-of-memory kill; a FIFO blocked for good. Neither is read: the file exists and is no export, so it is refused."""
    import os

    run, _, _, _ = exported
    out = tmp_path / "out.json"
    if special == "fifo":
        os.mkfifo(out)
    else:
        out.symlink_to("/dev/zero")
    done = CliRunner().invoke(steplens, ["export-trace", str(run), "--out", str(out)])
    assert done.exit_code == 2 and "is not a trace steplens exported" in " ".join(done.output.split())


def test_an_export_of_a_run_with_a_rank_missing_and_one_cut_short_says_so(tmp_path):
    """param/dlrm_kineto (8 ranks) with worker5's trace gone and worker3's cut in half: analyze exits 1 and names
    both; export-trace said 'from 7 rank(s)' and exited 0. It names the missing rank and the damaged input, exit 1 (a
    rank not traced alone, profiled on some ranks only, is said and exits 0, as analyze does)."""
    import shutil

    from conftest import CORPUS

    source = CORPUS / "param" / "dlrm_kineto"
    if not source.is_dir():
        pytest.skip("shared corpus not found")
    run = tmp_path / "run"
    shutil.copytree(source, run)
    (cut,) = run.glob("worker3_*.json")
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    for gone in run.glob("worker5_*.json"):
        gone.unlink()
    assert CliRunner().invoke(steplens, ["analyze", str(run), "-q"]).exit_code == 1
    done = CliRunner().invoke(steplens, ["export-trace", str(run), "--out", str(tmp_path / "merged.json")])
    said = " ".join(done.output.split())
    assert done.exit_code == 1, said
    assert "from 7 rank(s)" in said and ("warning: traces of 7 of 8 ranks; no trace for rank(s) 5 (profiled on some "
                                         "ranks only, or lost: see the issues): not in the export") in said
    assert f"warning: 1 input(s) lost data ({cut.name};" in said


def test_an_export_of_a_run_profiled_on_some_ranks_only_says_so_and_exits_0(tmp_path):
    """One of param/dlrm_kineto's 8 ranks, as a job profiled on rank 0 alone leaves it: analyze warns and exits 0;
    export-trace says the same and exits 0 (a deliberate setup is no lost input)."""
    import shutil

    from conftest import CORPUS

    source = CORPUS / "param" / "dlrm_kineto"
    if not source.is_dir():
        pytest.skip("shared corpus not found")
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(sorted(source.glob("worker0_*.json"))[0], run)
    assert CliRunner().invoke(steplens, ["analyze", str(run), "-q"]).exit_code == 0
    done = CliRunner().invoke(steplens, ["export-trace", str(run), "--out", str(tmp_path / "merged.json")])
    assert done.exit_code == 0 and "no trace for rank(s) 1-7" in " ".join(done.output.split())
