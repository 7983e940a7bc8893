"""Step time from the best source, on real 2-rank DeepSpeed CPU jobs (tests/conftest.py fixtures).

Every number is recomputed here from the raw inputs (the collector's Parquet parts read with pyarrow,
the Kineto traces with gzip + json + Decimal, the log lines with a regex), sharing no code with
steplens, and the exclusion rule of analyze/analyses/step_time.py is restated here from its docstring.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from conftest import REALRUN_INSTRUMENTED, REALRUN_STEADY_STEPS
from steplens.analyze.analyses import step_time
from steplens.analyze.contract import alarm_rules
from steplens.reports import data, verdict

ROOT = Path(__file__).resolve().parents[1]

ANALYZE = [sys.executable, "-m", "steplens.analyze"]


def analyse(run_dir: Path, out: Path) -> tuple[dict, list[str]]:
    done = subprocess.run([*ANALYZE, str(run_dir), "--out", str(out), "-q"], capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    run = data.load(out)
    return run.findings, verdict.verdict(run)


def shown(ns: float) -> str:
    """How the verdict prints a duration: 3 significant digits, whole units from 100 up."""
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            value = ns / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:,.0f} {unit}"
    return f"{ns:.0f} ns"


def collector_step_times(run_dir: Path) -> dict[int, int | None]:
    """Optimizer step -> the slowest rank's cycle, from the end of its step before (the last micro step's end) to the
    end of this one, from the collector's raw parts; None for a step that some rank has no step before (the first)."""
    ends: dict[tuple[int, int], int] = {}
    for part in sorted((run_dir / "collector" / "train_steps").glob("rank*.parquet")):
        for row in pq.read_table(part).to_pylist():
            key = (row["rank"], row["step"])
            ends[key] = max(ends.get(key, row["end_ns"]), row["end_ns"])
    steps: dict[int, int | None] = {}
    for (rank, step), end in ends.items():
        cycle = end - ends[(rank, step - 1)] if (rank, step - 1) in ends else None
        steps[step] = None if cycle is None or (step in steps and steps[step] is None) else max(steps.get(step, 0), cycle)
    return steps


def warm_up(times: dict[int, int], other_exclusions: set[int]) -> set[int]:
    """The documented rule: leading steps above median + max(3.5 MAD / 0.6745, 5% median), at most half."""
    candidates = [(s, times[s]) for s in sorted(times) if s not in other_exclusions and times[s] is not None]
    values = [t for _, t in candidates]
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    bound = median + max(3.5 * mad / 0.6745, 0.05 * median)
    found = set()
    for step, value in candidates[: len(candidates) // 2]:
        if value <= bound:
            break
        found.add(step)
    return found


def expected_summary(times: dict[int, int | None], excluded: set[int]) -> dict:
    kept = sorted(t for s, t in times.items() if s not in excluded and t is not None)
    return {"steps": len(kept), "total_steps": len(times), "median_ns": round(statistics.median(kept)),
            "p90_ns": kept[math.ceil(0.9 * len(kept)) - 1], "max_ns": kept[-1]}


def profiler_windows(run_dir: Path) -> dict[int, int]:
    """ProfilerStep#N -> its longest window over ranks, ns, from the raw traces (Decimal us -> ns)."""
    windows: dict[int, int] = {}
    for trace in (run_dir / "traces").glob("*.pt.trace.json.gz"):
        doc = json.loads(gzip.decompress(trace.read_bytes()), parse_float=Decimal)
        for event in doc["traceEvents"]:
            if event.get("ph") == "X" and str(event.get("name", "")).startswith("ProfilerStep#"):
                step = int(event["name"].split("#")[1])
                windows[step] = max(windows.get(step, 0), int(Decimal(event["dur"]) * 1000))
    return windows


@pytest.fixture(scope="module")
def steady(ds_steady_run, tmp_path_factory):
    return analyse(ds_steady_run, tmp_path_factory.mktemp("steady") / "out")


@pytest.fixture(scope="module")
def instrumented(ds_instrumented_run, tmp_path_factory):
    return analyse(ds_instrumented_run, tmp_path_factory.mktemp("instrumented") / "out")


def test_steady_run_step_time_from_train_steps(ds_steady_run, steady):
    findings, lines = steady
    times = collector_step_times(ds_steady_run)
    assert sorted(times) == list(range(REALRUN_STEADY_STEPS))
    warm = warm_up(times, set())
    block = findings["step_time"]
    assert block["source"] == "train_steps"
    assert {k: block[k] for k in ("steps", "total_steps", "median_ns", "p90_ns", "max_ns")} == expected_summary(times, warm)
    assert times[0] is None  # no step before the run's first starts its cycle
    assert block["excluded_steps"] == [{"reason": "no_previous_step", "count": 1, "steps": [0], "step_times_ns": [None]}] + (
        [{"reason": "warm_up", "count": len(warm), "steps": sorted(warm),
          "step_times_ns": [times[s] for s in sorted(warm)]}] if warm else [])
    line = next(line for line in lines if line.startswith("Step time:"))
    expected = expected_summary(times, warm)
    assert (f"median {shown(expected['median_ns'])}, p90 {shown(expected['p90_ns'])}, max {shown(expected['max_ns'])}"
            in line)
    assert f"over {expected['steps']} of {REALRUN_STEADY_STEPS} steps, from the collector's train_steps" in line
    assert not any(line.startswith("Profiled step") for line in lines)  # no profiler window in this job
    assert "profiled_steps" not in findings["step_time"]


def test_slowest_step_only_beyond_noise(ds_steady_run, steady):
    findings, lines = steady
    times = collector_step_times(ds_steady_run)
    warm = warm_up(times, set())
    kept = {s: t for s, t in times.items() if s not in warm and t is not None}
    median = statistics.median(kept.values())
    mad = statistics.median(abs(v - median) for v in kept.values())
    bound = median + max(3.5 * mad / 0.6745, 0.05 * median)
    slowest = max(kept, key=lambda s: (kept[s], -s))
    if kept[slowest] > bound:
        slow = findings["step_time"]["slowest_step"]
        assert (slow["step"], slow["dur_ns"], slow["median_step_ns"]) == (slowest, kept[slowest], round(median))
        assert round(bound) == slow["noise_bound_ns"]
        assert (f"Slowest step: step {slowest} on rank {slow['rank']}, {shown(kept[slowest])} against a median of "
                f"{shown(median)}") in "\n".join(lines)
    else:
        assert "slowest_step" not in findings["step_time"]
        assert not any(line.startswith("Slowest step") for line in lines)


def test_instrumented_steps_excluded_and_named(ds_instrumented_run, instrumented):
    findings, lines = instrumented
    job = REALRUN_INSTRUMENTED
    wait, warmup, active, _ = job["window"]
    window_start = job["skip_first"] + wait
    # Ground truth from the job's arguments: which steps ran which instrumentation.
    expected = {"flops_profiler": [job["flops_step"]],
                "profiler_warmup": list(range(window_start, window_start + warmup)),
                "profiler_window": list(range(window_start + warmup, window_start + warmup + active)),
                "profiler_export": [window_start + warmup + active]}
    instrumented_steps = {s for steps in expected.values() for s in steps}
    times = collector_step_times(ds_instrumented_run)
    expected["no_previous_step"] = [s for s, t in times.items() if t is None]  # the run's first step
    warm = warm_up(times, instrumented_steps)
    if warm:
        expected["warm_up"] = sorted(warm)
    block = findings["step_time"]
    assert {e["reason"]: e["steps"] for e in block["excluded_steps"]} == expected
    assert {k: block[k] for k in ("steps", "total_steps", "median_ns", "p90_ns", "max_ns")} == \
        expected_summary(times, instrumented_steps | warm)
    line = next(line for line in lines if line.startswith("Step time:"))
    for words, reason in (("FLOPs profiler step", "flops_profiler"), ("profiler window step", "profiler_window"),
                          ("profiler warm-up step", "profiler_warmup"), ("trace export step", "profiler_export")):
        assert f"{words} {expected[reason][0]}" in line


def test_profiled_window_placed_in_the_run(ds_instrumented_run, instrumented):
    findings, lines = instrumented
    windows = profiler_windows(ds_instrumented_run)
    job = REALRUN_INSTRUMENTED
    active_step = job["skip_first"] + job["window"][0] + job["window"][1]
    assert sorted(windows) == [active_step]
    placed = findings["step_time"]["profiled_steps"]
    times = collector_step_times(ds_instrumented_run)
    assert placed["steps"][0]["step"] == active_step
    assert placed["steps"][0]["profiler_dur_ns"] == windows[active_step]
    assert placed["steps"][0]["step_time_ns"] == times[active_step]
    assert placed["run_median_ns"] == findings["step_time"]["median_ns"]
    assert (f"Profiled step {active_step} took {shown(windows[active_step])} (ProfilerStep window, rank "
            f"{placed['steps'][0]['rank']}; the collector's train_steps timed it {shown(times[active_step])}), the run's "
            f"median step is {shown(placed['run_median_ns'])}.") in lines


TIMER_LINE = re.compile(r"\[Rank (\d+)\] time \(ms\) \| fwd: ([\d.]+) \| bwd: ([\d.]+) \|.*\| step: ([\d.]+)$")


def test_logs_only_run_takes_step_time_from_the_timer_lines(ds_steady_run, tmp_path):
    """The same job with only its per-rank logs: step time is fwd + bwd + step of each global timer line."""
    shutil.copytree(ds_steady_run / "rank_logs", tmp_path / "run" / "rank_logs")
    findings, lines = analyse(tmp_path / "run", tmp_path / "out")
    per_rank: dict[int, list[int]] = {}
    for log in sorted((tmp_path / "run" / "rank_logs").glob("*.log")):
        for text in log.read_text().splitlines():
            if m := TIMER_LINE.search(text):
                ms = sum(Decimal(x) for x in m.group(2, 3, 4))
                per_rank.setdefault(int(m[1]), []).append(int((ms * 1_000_000).to_integral_value()))
    assert per_rank and all(len(v) == REALRUN_STEADY_STEPS for v in per_rank.values())
    times = {step: max(v[step] for v in per_rank.values()) for step in range(REALRUN_STEADY_STEPS)}
    warm = warm_up(times, set())
    block = findings["step_time"]
    assert block["source"] == "log" and "wall_clock_breakdown" in block["definition"]
    assert {k: block[k] for k in ("steps", "total_steps", "median_ns", "p90_ns", "max_ns")} == expected_summary(times, warm)
    assert any(line.startswith("Step time:") and "from the logs' fwd + bwd + step timers (wall_clock_breakdown: not "
               "the whole iteration)" in line for line in lines)
    # the first screen says what the figure times: fwd + bwd + step, not the iteration around it
    from steplens.reports.verdict import step_headline

    assert step_headline(findings).endswith(f"over {block['steps']} of {block['total_steps']} (logs: fwd+bwd+step)")


# Five steps of a Megatron-DeepSpeed log (its layout as a 2024 AuroraGPT run printed it): the fourth is the step
# DeepSpeed's FLOPs profiler profiled, whose timers it left at 0 beside a negative bwd_inner.
PROFILED_STEP_LOG = "\n".join(
    f"[2024-04-19 13:{27 + i}:45,504] [INFO] [logging.py:96:log_dist] [Rank 0] time (ms) | fwd: {fwd} | bwd: {bwd} | "
    f"bwd_inner: {inner} | bwd_allreduce: 2681.72 | step: {opt}"
    for i, (fwd, bwd, inner, opt) in enumerate([("9695.89", "48449.69", "45767.63", "150.45"),
                                                ("9288.04", "47613.76", "44920.55", "155.70"),
                                                ("9294.96", "47634.93", "44940.23", "152.73"),
                                                ("0.00", "0.00", "-298701.19", "0.00"),
                                                ("9280.10", "47610.20", "44918.02", "155.00")])) + "\n"


def test_a_step_whose_timers_read_0_or_below_0_is_left_out(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.log").write_text(PROFILED_STEP_LOG)
    findings, lines = analyse(tmp_path / "run", tmp_path / "out")
    table = pl.read_parquet(tmp_path / "out" / "step_time")
    assert table.select("step", "step_time_ns", "reason").rows() == [
        (0, 58_296_030_000, None), (1, 57_057_500_000, None), (2, 57_082_620_000, None),
        (3, 0, "negative_duration,no_time"), (4, 57_045_300_000, None)]
    block = findings["step_time"]  # the median of the 4 measured steps: (57 057.50 + 57 082.62) / 2 ms
    assert (block["steps"], block["total_steps"], block["median_ns"]) == (4, 5, 57_070_060_000)
    assert any("left out: step 3 (end before start); step 3 (no time measured)" in line for line in lines)


def test_skipped_and_incomplete_steps_hand_computed():
    """fp16 overflow and a step a rank never finished, on a hand-made train_steps table. Rank 0 starts its steps at
    0, 120, 250, 320 and 455 ns, rank 1 each 2 ns a step later (0, 122, 254, 326, 463); they end 100 + rank, 110 + rank,
    50 + rank, 105 + rank and 100 + rank ns after their start: rank 0 at 100, 230, 300, 425, 555, rank 1 at 101, 233,
    305, 432, 564. The cycles (the end of the step before to this one's end) are 130, 70, 125, 130 and 132, 72, 127,
    132: the slowest rank's, 132, 72, 127, 132; the first step has no step before it. The micro steps' own durations
    (forward to engine.step(): 50-111 ns) are not it."""
    rows = []
    starts = [0, 120, 250, 320, 455]
    for rank in (0, 1):
        for step, dur in enumerate([100, 110, 50, 105, 100]):
            last = step == 4 and rank == 1  # rank 1 stopped inside step 4: no boundary micro step
            start = starts[step] + 2 * step * rank
            rows.append({"rank": rank, "source": f"collector/train_steps/rank{rank}-00000.parquet", "step": step,
                         "micro_step": step, "start_ns": start, "end_ns": start + dur + rank, "dur_ns": dur + rank,
                         "is_boundary": not last, "skipped": step == 2, "global_samples": 8 * (step + 1),
                         "global_tokens": None, "loss_scale": 2.0 ** (16 - (step >= 2)), "lr": 0.1})
    table = step_time.step_time_table(pl.DataFrame(rows))
    assert table.select("step", "step_time_ns", "slowest_rank", "reason").rows() == [
        (0, None, None, "no_previous_step"), (1, 132, 1, None), (2, 72, 1, "overflow_skipped"), (3, 127, 1, None),
        (4, 132, 1, "incomplete")]
    summary = step_time.step_time_summary(table)
    assert (summary["steps"], summary["median_ns"], summary["max_ns"]) == (2, 130, 132)
    overflow = step_time.overflow_finding(table)
    assert (overflow["skipped_steps"], overflow["steps"], overflow["steps_skipped"]) == (1, 5, [2])
    assert overflow["frequent"] is False  # one skip: the loss scale settling, not a finding
    assert (overflow["loss_scale_first"], overflow["loss_scale_min"], overflow["loss_scale_last"]) == (2.0**16, 2.0**15, 2.0**15)
    lines = step_time.step_lines({"fp16_overflow": {**overflow, "skipped_steps": 2, "share": 0.4, "frequent": True}})
    assert lines == ["fp16 overflow: the optimizer skipped 2 of 5 steps (40%); loss scale 65,536 at the start, 32,768 at "
                     "its lowest, 32,768 at the end. Skipped steps do no training: check the loss for inf/NaN and the "
                     "initial loss scale (fp16.initial_scale_power), or use bf16."]


THROUGHPUT_LINE = re.compile(r"global_step=(\d+), RunningAvgSamplesPerSec=[\d.e+-]+, CurrSamplesPerSec=([\d.e+-]+)")


def test_logs_without_timers_take_step_time_from_the_throughput_lines(ds_steady_run, tmp_path):
    """The job's logs with the wall_clock_breakdown lines taken out (a job without it): step time is
    train_batch_size / CurrSamplesPerSec, DeepSpeed's fwd-to-step time of that step on rank 0."""
    logs = tmp_path / "run" / "rank_logs"
    logs.mkdir(parents=True)
    times: dict[int, Decimal] = {}
    config = json.loads((ds_steady_run / "ds_config.json").read_text())
    batch = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * 2  # 2 ranks
    for log in (ds_steady_run / "rank_logs").glob("*.log"):
        kept = [line for line in log.read_text().splitlines(keepends=True) if "time (ms) |" not in line]
        (logs / log.name).write_text("".join(kept))
        for line in kept:
            if m := THROUGHPUT_LINE.search(line):  # global_step=N: N steps done, the 0-based step N - 1
                times[int(m[1]) - 1] = Decimal(batch) / Decimal(m[2]) * 1_000_000_000
    findings, lines = analyse(tmp_path / "run", tmp_path / "out")
    table = pl.read_parquet(tmp_path / "out" / "step_time")
    assert sorted(table["step"].to_list()) == sorted(times)
    for step, ns in table.select("step", "step_time_ns").iter_rows():
        assert abs(ns - times[step]) <= 1  # float64 division against exact decimal
    block = findings["step_time"]
    assert block["source"] == "log" and "CurrSamplesPerSec" in block["definition"]
    warm = warm_up({step: float(ns) for step, ns in times.items()}, set())
    kept = sorted(ns for step, ns in times.items() if step not in warm)
    assert block["steps"] == len(kept) and abs(block["max_ns"] - kept[-1]) <= 1
    assert abs(block["median_ns"] - statistics.median(kept)) <= 1


MEGATRON_LOG = "Megatron-DeepSpeed/random_ltd_gpt3_baseline/gpt3-0.125B-tokendropping-graduallyIncrease-lr-3.0e-4-baseline.log"
MEGATRON_LINE = re.compile(r"^\s*iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")


def test_megatron_log_step_time_from_its_iteration_lines(corpus, tmp_path):
    """A real Megatron-DeepSpeed log (8 GPUs, killed by SIGTERM): one mean iteration time per logging interval."""
    (tmp_path / "run").mkdir()
    shutil.copyfile(corpus / MEGATRON_LOG, tmp_path / "run" / "train.log")
    times, evaluated = {}, []
    for line in (tmp_path / "run" / "train.log").read_text(errors="replace").splitlines():
        if m := MEGATRON_LINE.match(line):  # iteration N: N iterations done, the 0-based step N - 1
            times[int(m[1]) - 1] = int((Decimal(m[2]) * 1_000_000).to_integral_value())
        elif m := re.search(r"validation loss at iteration\s+(\d+) \|", line):
            evaluated.append(int(m[1]))
    findings, lines = analyse(tmp_path / "run", tmp_path / "out")
    block = findings["step_time"]
    # the interval after each evaluation holds it (iterations 110, 210, 310, 410 at ~805 ms against ~490 ms)
    after_evaluation = {min(s for s in times if s >= n) for n in evaluated if any(s >= n for s in times)}
    assert sorted(after_evaluation) == [109, 209, 309, 409]
    warm = warm_up(times, set()) | after_evaluation
    assert block["source"] == "log" and block["interval_means"] is True
    assert {k: block[k] for k in ("steps", "total_steps", "median_ns", "p90_ns", "max_ns")} == expected_summary(times, warm)
    assert any(line.startswith("Step time:") and "logged iterations, each the mean of its logging interval" in line
               for line in lines)


@pytest.mark.parametrize("bad", ["48412345678901234.7", "nan", "1e300"])
def test_a_logged_time_that_is_no_time_costs_its_step_only(corpus, tmp_path, bad):
    """One Megatron iteration time damaged (past int64 in ns, nan, 1e300): the run was lost (an internal error, rc 5);
    that interval is left out (no_time) and every other step is as the intact log's."""
    (tmp_path / "run").mkdir()
    text = (corpus / MEGATRON_LOG).read_text(errors="replace")
    first = next(m for m in map(MEGATRON_LINE.match, text.splitlines()) if m)
    damaged = text.replace(f"elapsed time per iteration (ms): {first[2]}", f"elapsed time per iteration (ms): {bad}", 1)
    assert damaged != text
    (tmp_path / "run" / "train.log").write_text(damaged)
    findings, _ = analyse(tmp_path / "run", tmp_path / "out")
    table = pl.read_parquet(tmp_path / "out" / "step_time")
    row = table.filter(pl.col("step") == int(first[1]) - 1).row(0, named=True)
    assert row["step_time_ns"] is None and "no_time" in row["reason"].split(",")
    assert findings["step_time"]["steps"] > 30


def test_fp16_overflow_skips_from_a_deepspeed_chat_log(corpus, tmp_path):
    """DeepSpeed's `step=N, skipped=S` lines: S of N steps skipped, against the last such line."""
    name = "DeepSpeedExamples/deepspeed_chat_step1_sft/opt-1.3b-globalBatchSize128.log"
    (tmp_path / "run").mkdir()
    shutil.copyfile(corpus / name, tmp_path / "run" / "train.log")
    last = re.findall(r"\] step=(\d+), skipped=(\d+),", (tmp_path / "run" / "train.log").read_text(errors="replace"))[-1]
    done, skipped = int(last[0]), int(last[1])
    findings, lines = analyse(tmp_path / "run", tmp_path / "out")
    overflow = findings["step_time"]["fp16_overflow"]
    assert (overflow["skipped_steps"], overflow["steps"]) == (skipped, done)
    assert overflow["frequent"] is (skipped / done >= 0.05)
    assert any(line.startswith("fp16 overflow") for line in lines) is overflow["frequent"]


def test_traces_only_run_takes_step_time_from_the_profiler_windows(corpus, tmp_path):
    """The 8-rank DLRM traces (one profiled step, same step on every rank): the slowest rank's window."""
    run = corpus / "param" / "dlrm_kineto"
    windows: dict[int, int] = {}
    for trace in run.glob("*.pt.trace.json"):
        for event in json.loads(trace.read_text(), parse_float=Decimal)["traceEvents"]:
            if event.get("ph") == "X" and str(event.get("name", "")).startswith("ProfilerStep#"):
                step = int(event["name"].split("#")[1])
                windows[step] = max(windows.get(step, 0), int(Decimal(event["dur"]) * 1000))
    findings, lines = analyse(run, tmp_path / "out")
    [(step, ns)] = windows.items()
    block = findings["step_time"]
    assert (block["source"], block["steps"], block["median_ns"], block["max_ns"], block["max_step"]) == \
        ("profiler_steps", 1, ns, ns, step)
    assert f"Step time: {shown(ns)} (step {step}, the only one of 1 kept), from the profiled steps." in lines
    assert "profiled_steps" not in block and "slowest_step" not in block  # one step: nothing to compare with


def test_damaged_schedule_and_config_values_mark_nothing_and_cost_nothing():
    """instrumented_steps reads ds_config and the collector's schedule, which a damaged log or manifest can
    fill with anything: only whole step numbers mark steps (hand-computed), a repeat beyond any step number
    is damage, and one of two billion is not looped over."""
    empty = pl.DataFrame()
    schedule = {"skip_first": 7, "wait": 1, "warmup": 1, "active": 1, "repeat": 1}
    assert step_time.instrumented_steps({"settings": {"profile": schedule}, "checkpoint_steps": [3]}, empty, empty) == {
        8: {"profiler_warmup"}, 9: {"profiler_window"}, 10: {"profiler_export"}, 3: {"checkpoint_save"}}
    for ds_config in ({"flops_profiler": {"enabled": True, "profile_step": "x"}},
                      {"flops_profiler": {"enabled": True, "profile_step": 1e999}}, {"flops_profiler": [1]}):
        assert step_time.instrumented_steps({"ds_config": ds_config}, empty, empty) == {}
    assert step_time.instrumented_steps({"settings": {"profile": {**schedule, "active": "2"}}}, empty, empty) == {}
    every_step = {"wait": 0, "warmup": 0, "active": 1}
    assert step_time.instrumented_steps({"settings": {"profile": {**every_step, "repeat": 10**12}}}, empty, empty) == {}
    huge = step_time.instrumented_steps({"settings": {"profile": {**every_step, "repeat": 2**31 - 1}}}, empty, empty)
    assert len(huge) <= alarm_rules.MAX_SCHEDULE_MARKS + 2 and huge[0] == {"profiler_window"}


@pytest.mark.parametrize("damage", [("ds_config", [1]), ("checkpoint_steps", "abc"), ("world_size", "x")])
def test_a_damaged_run_fact_is_left_out_with_an_issue(tmp_path, damage):
    """A collector manifest whose run facts have the wrong type (each made analyze exit 5 before): the fact
    is left out and named in the file's issues, and the analysis finishes with the step time."""
    run = tmp_path / "run"
    shutil.copytree(ROOT / "sample_runs" / "deepspeed_cpu_2rank", run, ignore=shutil.ignore_patterns(".steplens"))
    manifest = run / "collector" / "manifest" / "rank0.json"
    doc = json.loads(manifest.read_text())
    doc["run"][damage[0]] = damage[1]
    manifest.write_text(json.dumps(doc))
    done = subprocess.run([sys.executable, "-m", "steplens.analyze", str(run), "--out", str(tmp_path / "out"), "-q"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    sources = json.loads((tmp_path / "out" / "run.json").read_text())["sources"]
    issues = [i for s in sources if s["path"] == "collector/manifest/rank0.json" for i in s["issues"]]
    assert [(i[1], f"'{damage[0]}'" in i[3]) for i in issues if i[1] == "bad_fact"] == [("bad_fact", True)]
    summary = json.loads((tmp_path / "out" / "findings.json").read_text())["step_time"]
    assert summary["steps"] > 0 and summary["max_ns"] > 0  # the damaged fact costs itself only


def test_a_log_that_names_no_rank_shows_none_not_rank_0(tmp_path):
    """Megatron prints its iteration lines without a rank (a real GWDA_lib log): the report's ranks are "none", as
    the terminal says, not a "0" that reads as rank 0. Step time: 1996.1 and 429.4 ms: two unlike steps, no median
    (1212.75 ms would be a time no step had)."""
    line = ("iteration {:>8}/   30000 | current time: 1706860208.35 | consumed samples: {:>12} | elapsed time per "
            "iteration (ms): {} | learning rate: 0.000E+00 | global batch size:    16 | loss scale: 4294967296.0 |")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.log").write_text(line.format(1, 16, "1996.1") + "\n" + line.format(2, 32, "429.4") + "\n")
    findings, lines = analyse(tmp_path / "run", tmp_path / "out")
    assert findings["step_time"]["median_ns"] is None
    assert [k["step_time_ns"] for k in findings["step_time"]["kept_steps"]] == [1_996_100_000, 429_400_000]
    assert "ranks **none**" in (tmp_path / "out" / "summary.md").read_text()


def test_deepspeeds_pipeline_engine_lines_give_interval_mean_step_times(tmp_path):
    """runtime/pipe/engine.py prints "steps: N loss: L iter time (s): T samples/sec: S" from global rank 0 every
    steps_per_print steps, T the mean over the interval (lines in its format, values chosen by hand)."""
    from click.testing import CliRunner
    from steplens.analyze.cli import analyze

    times = [0.912, 0.501, 0.498, 0.503, 0.760, 0.499]  # the first interval holds start-up
    lines = [f"steps: {10 * (k + 1)} loss: {2.5 - 0.1 * k:.4f} iter time (s): {t:.3f} samples/sec: {32 / t:.3f}"
             for k, t in enumerate(times)]
    lines.insert(3, "steps: 40 loss: 2.2000 moe_loss: 0.0100 iter time (s): 0.502 samples/sec: 63.745")  # extra losses
    del lines[4]
    times[3] = 0.502
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(analyze, [str(run), "--out", str(tmp_path / "out"), "-q"])
    assert result.exit_code in (0, 1), result.output
    table = pl.read_parquet(tmp_path / "out" / "step_time")
    assert table.sort("step").select("step", "step_time_ns").rows() == [(10 * (k + 1) - 1, round(t * 1e9)) for k, t in enumerate(times)]
    findings = json.loads((tmp_path / "out" / "findings.json").read_text())["step_time"]
    kept = sorted(times[1:])  # the first interval (0.912 s) is warm-up: above median + max(3.5 MAD/0.6745, 5%)
    assert findings["steps"] == 5 and findings["median_ns"] == round(statistics.median(kept) * 1e9)
    assert findings["interval_means"] and "pipeline engine" in findings["definition"]
    text = " ".join(result.output.split())
    assert "(step 49, the log's steps: 50)" in text  # 0.760 s, the slowest kept


def test_two_unlike_kept_steps_give_no_median_and_say_what_is_known(tmp_path):
    """Two kept steps of 400 and 92 ms (hand-made: one rank's steps end at 0, 400, 492 ms): no median of a warm-up
    step and a steady one; the sentence gives each kept step's time. The bundled sample's line, recomputed from its
    raw parts: step 0 has no step before it; the FLOPs profiler's step and the profiler's warm-up, window and export
    steps (from the collector's settings) are left out and named; the median of the rest."""
    ms = 1_000_000
    rows = [{"rank": 0, "source": "collector/train_steps/rank0-00000.parquet", "step": step, "micro_step": step,
             "start_ns": end - 10 * ms, "end_ns": end, "dur_ns": 10 * ms, "is_boundary": True, "skipped": False,
             "global_samples": 8 * (step + 1), "loss_scale": None} for step, end in enumerate([0, 400 * ms, 492 * ms])]
    summary = step_time.step_time_summary(step_time.step_time_table(pl.DataFrame(rows)))
    assert summary["median_ns"] is None and summary["p90_ns"] is None and summary["note"].startswith("too few steps")
    assert summary["kept_steps"] == [{"step": 1, "step_time_ns": 400 * ms}, {"step": 2, "step_time_ns": 92 * ms}]
    line = next(line for line in step_time.step_lines(summary) if line.startswith("Step time: "))
    assert line.startswith(f"Step time: too few steps for a typical time: 2 of 3 kept (step 1 {shown(400 * ms)}, step 2 "
                           f"{shown(92 * ms)}; no median")
    assert verdict.first_screen({"step_time": summary})[0] == (
        f"Steps: too few for a typical time (2 of 3 kept, max {shown(400 * ms)}; collector)", "steps")

    sample = ROOT / "sample_runs" / "deepspeed_cpu_2rank"
    shutil.copytree(sample, tmp_path / "run", ignore=shutil.ignore_patterns(".steplens"))
    findings, lines = analyse(tmp_path / "run", tmp_path / "out")
    times = collector_step_times(sample)
    settings = json.loads((sample / "collector" / "manifest" / "rank0.json").read_text())["run"]["settings"]
    window = settings["profile"]["skip_first"] + settings["profile"]["wait"]  # warm-up, active, then the export
    left_out = {settings["flops_step"]: "FLOPs profiler", window: "profiler warm-up", window + 1: "profiler window",
                window + 2: "trace export"}
    warm = warm_up(times, set(left_out))  # leading steps beyond the noise, if this recording has any
    kept = [t for s, t in times.items() if s not in left_out and s not in warm and t is not None]
    line = next(line for line in lines if line.startswith("Step time: "))
    assert line.startswith(f"Step time: median {shown(statistics.median(kept))}")
    assert f"over {len(kept)} of {len(times)} steps" in line and times[0] is None
    assert "step 0 (no step before to time from)" in line  # the run's first step: no cycle to time
    for step, why in sorted(left_out.items()):
        assert f"{why} step {step}" in line


@pytest.mark.parametrize(("values", "typical"), [([100, 105], True), ([100, 106], False), ([100], True), ([], False),
                                                 ([100, 300, 200], True)])
def test_a_median_needs_three_steps_or_steps_that_agree(values, typical):
    assert step_time.has_typical_time(values) is typical


def test_trials_says_in_the_runs_terms_why_no_run_was_timed(tmp_path):
    """The bundled sample cut to its first two steps (the collector's first flush of train_steps: the later parts
    removed): step 0 has no step before it, so one step is kept, and trials says so in the run's own terms."""
    run = tmp_path / "runs" / "cpu"
    shutil.copytree(ROOT / "sample_runs" / "deepspeed_cpu_2rank", run, ignore=shutil.ignore_patterns(".steplens"))
    first_flush = {part.name for part in (run / "collector" / "train_steps").glob("rank*-00000.parquet")}
    for part in (run / "collector" / "train_steps").glob("rank*.parquet"):
        if part.name not in first_flush:
            part.unlink()
    steps = {row["step"] for part in (run / "collector" / "train_steps").glob("rank*.parquet")
             for row in pq.read_table(part).to_pylist()}
    assert steps == {0, 1}
    subprocess.run([*ANALYZE, str(run), "-q"], capture_output=True)
    done = subprocess.run([str(Path(sys.executable).parent / "steplens"), "trials", str(tmp_path / "runs")],
                          capture_output=True, text=True, env={**__import__("os").environ, "COLUMNS": "80"})
    text = " ".join(done.stdout.split())
    assert ("no run could be timed: cpu: 1 of 2 steps kept (1 no_previous_step left out): a trial needs 3 kept steps "
            "and its samples per step") in text.lower()
    assert "no experiment produced metrics" not in text
    assert max(len(line) for line in done.stdout.splitlines()) <= 80


def test_a_profiler_step_after_the_last_recorded_step_is_no_step():
    """A job that ends inside a profiler window: stopping the profiler closes one more ProfilerStep span (104 µs,
    after the last prof.step()), which was reported as 'Profiled step 5 took 95.6 µs'. Hand-made: the run recorded
    steps 0-4; ProfilerStep 3 and 4 are steps, 5 is not."""
    from steplens.analyze.analyses import step_time as st

    table = pl.DataFrame({"step": [0, 1, 2, 3, 4], "step_time_ns": [50_000_000] * 5, "excluded": [False] * 5,
                          "source": ["train_steps"] * 5})
    ms = 1_000_000
    profiler_steps = pl.DataFrame({"rank": [0, 0, 0], "step": [3, 4, 5], "start_ns": [0, 40 * ms, 80 * ms],
                                   "end_ns": [40 * ms, 80 * ms, 80 * ms + 104_000]})
    windows = st.profiled_windows(table, profiler_steps)
    assert [(w["step"], w["after_last_step"]) for w in windows["steps"]] == [(3, False), (4, False), (5, True)]
    lines = st.step_lines({"profiled_steps": windows})
    assert [line.split(" (")[0] for line in lines] == ["Profiled step 3 took 40 ms", "Profiled step 4 took 40 ms",
                                                       "ProfilerStep 5"]
    assert "no step of training" in lines[2] and "104 µs" in lines[2]


def test_a_job_run_again_into_its_folder_is_timed_once_per_step():
    """The same job run twice into one folder (or resumed from an earlier checkpoint) repeats its micro steps; the
    step time summed both recordings (109 ms against 50-60 ms per job). Hand-made: steps 0-2 on ranks 0 and 1,
    recorded a step every 100 ms, then again (later) every 150 ms; each step is timed from the later recording, 150 ms
    from the end of one to the end of the next (the first has no step before it), and the repeat is named."""
    from steplens.analyze.analyses import step_time as st

    ms = 1_000_000
    rows = []
    for job, (offset, dur, every) in enumerate([(0, 10 * ms, 100 * ms), (10_000 * ms, 20 * ms, 150 * ms)]):
        for rank in (0, 1):
            for step in range(3):
                start = offset + step * every
                rows.append({"rank": rank, "source": f"collector/train_steps/rank{rank}-0000{job}.parquet", "step": step,
                             "micro_step": step, "start_ns": start, "end_ns": start + dur, "dur_ns": dur,
                             "is_boundary": True, "skipped": False, "global_samples": 8 * (step + 1)})
    from steplens.analyze.importers.base import conform

    train_steps = conform(rows, "train_steps")
    table = st.step_time_table(train_steps)
    assert table.sort("step")["step_time_ns"].to_list() == [None, 150 * ms, 150 * ms]
    assert st.repeated_steps(train_steps) == {"micro_steps": 6, "steps": [0, 1, 2], "step_count": 3, "ranks": [0, 1],
                                              "rank_count": 2, "copies": 0}
    once = train_steps.filter(pl.col("start_ns") >= 10_000 * ms)
    assert st.repeated_steps(once) is None and st.step_time_table(once)["step_time_ns"].to_list() == [None, 150 * ms, 150 * ms]
    # rank 1's part copied under another name: its 3 rows twice, at the same times; said as a copy, each step once
    copied = pl.concat([once, once.filter(pl.col("rank") == 1).with_columns(source=pl.lit("copy.parquet"))])
    repeated = st.repeated_steps(copied)
    assert (repeated["micro_steps"], repeated["copies"]) == (3, 3)
    assert st.step_time_table(copied)["step_time_ns"].to_list() == [None, 150 * ms, 150 * ms]
    assert "a collector part copied under another name" in " ".join(st.step_lines({"repeated_steps": repeated}))


def _two_jobs(first_steps: int, second: list[tuple[int, int]]) -> pl.DataFrame:
    """One rank: a job recording steps 0..first_steps-1 (micro step = step) every 100 ms from t=0, then a later job
    recording the (step, micro step) pairs `second` every 30 ms from t=10 s."""
    from steplens.analyze.importers.base import conform

    ms = 1_000_000
    rows = [(step, step, step * 100 * ms) for step in range(first_steps)]
    rows += [(step, micro, 10_000 * ms + i * 30 * ms) for i, (step, micro) in enumerate(second)]
    return conform([{"rank": 0, "source": "collector/train_steps/rank0-00000.parquet", "step": step, "micro_step": micro,
                     "start_ns": start, "end_ns": start + 5 * ms, "dur_ns": 5 * ms, "is_boundary": True,
                     "skipped": False} for step, micro, start in rows], "train_steps")


def test_a_job_run_again_for_fewer_steps_leaves_none_of_the_earlier_job_in_the_step_time():
    """The helper's job run twice into one folder, 10 steps then 5: the earlier job's steps 5-9, which the later job
    never reached, were timed beside the later job's 0-4 (and step 5 came out at minus 15 s, blamed on the clocks). Every
    step of the earlier job is left out; the later job's 30 ms cycle is all that is timed."""
    from steplens.analyze.analyses import step_time as st

    train_steps = _two_jobs(10, [(step, step) for step in range(5)])
    table = st.step_time_table(train_steps).sort("step")
    assert table["step"].to_list() == [0, 1, 2, 3, 4]
    assert table["step_time_ns"].to_list() == [None] + [30_000_000] * 4
    repeated = st.repeated_steps(train_steps)
    assert (repeated["micro_steps"], repeated["step_count"], repeated["copies"]) == (10, 10, 0)
    assert "Steps 0-9 of an earlier recording are left out" in " ".join(st.step_lines({"repeated_steps": repeated}))


def test_a_job_resumed_from_an_earlier_checkpoint_keeps_the_steps_before_it():
    """Resumed at step 3 (DeepSpeed restores the global step, not the micro-step count, which starts at 0 again): the
    earlier job's steps 0-2 are the run's history and stay; its steps 3-9 were gone back over and are left out."""
    from steplens.analyze.analyses import step_time as st

    train_steps = _two_jobs(10, [(3 + i, i) for i in range(4)])
    assert st.superseded(train_steps).to_list() == [False] * 3 + [True] * 7 + [False] * 4
    assert st.repeated_steps(train_steps)["steps"] == [3, 4, 5, 6, 7, 8, 9]
    # step 3, the resumed job's first, follows the earlier job's step 2 by the restart's 9.8 s: no step's time
    table = st.step_time_table(train_steps).sort("step")
    assert table.select("step", "step_time_ns", "reason").rows() == [
        (0, None, "no_previous_step"), (1, 100_000_000, "warm_up"), (2, 100_000_000, "warm_up"),
        (3, None, "no_previous_step"), (4, 30_000_000, None), (5, 30_000_000, None), (6, 30_000_000, None)]


def test_a_clock_that_went_back_drops_no_step_as_a_rerun():
    """20 steps 100 ms apart on one rank whose clock went back 1 s before step 10 (an NTP step): no step is recorded
    twice, so no rerun is read into it; step 10 is the one with a negative time, as before."""
    from steplens.analyze.analyses import step_time as st
    from steplens.analyze.importers.base import conform

    ms = 1_000_000
    starts = [10**12 + step * 100 * ms - (1000 * ms if step >= 10 else 0) for step in range(20)]
    train_steps = conform([{"rank": 0, "source": "collector/train_steps/rank0-00000.parquet", "step": step,
                            "micro_step": step, "start_ns": start, "end_ns": start + 5 * ms, "dur_ns": 5 * ms,
                            "is_boundary": True, "skipped": False} for step, start in enumerate(starts)], "train_steps")
    assert not st.superseded(train_steps).any() and st.repeated_steps(train_steps) is None
    table = st.step_time_table(train_steps)
    assert table.filter(pl.col("reason").is_not_null()).sort("step").select("step", "reason").rows() == [
        (0, "no_previous_step"), (10, "negative_duration")]


def test_time_outside_the_steps_work_is_in_the_step_and_said():
    """A data loader that takes 100 ms before every forward (the helper's slow-load job): each rank starts a step
    every 120 ms and spends 20 ms (rank 1: 21 ms) in it. Hand-computed: the step time is the 120 ms cycle, not the
    20 ms of work, so a 6x slower input pipeline is in the step time, the MFU and compare; rank 0 spent 100 ms of
    each step (83%) outside its work, rank 1 99 ms: every rank's loader, and the verdict leads with it. The first
    step has no step before it to start its cycle."""
    from steplens.analyze.contract.units import duration
    from steplens.reports.verdict import first_screen

    ms = 1_000_000
    rows = [{"rank": rank, "source": f"collector/train_steps/rank{rank}-00000.parquet", "step": step, "micro_step": step,
             "start_ns": step * 120 * ms + rank * ms, "end_ns": step * 120 * ms + rank * ms + (20 + rank) * ms,
             "dur_ns": (20 + rank) * ms, "is_boundary": True, "skipped": False, "global_samples": 8 * (step + 1),
             "loss_scale": None}
            for rank in (0, 1) for step in range(6)]
    table = step_time.step_time_table(pl.DataFrame(rows))
    assert table.select("step", "step_time_ns", "work_ns", "reason").rows() == [
        (0, None, 21 * ms, "no_previous_step"), *((step, 120 * ms, 21 * ms, None) for step in range(1, 6))]
    outside = step_time.outside_work(table)
    assert (outside["median_outside_ns"], outside["median_step_ns"], outside["steps"]) == (100 * ms, 120 * ms, 5)
    assert (outside["rank"], outside["least_outside_ns"], outside["share"]) == (0, 99 * ms, pytest.approx(100 / 120))
    summary = {**step_time.step_time_summary(table), "outside_work": outside}
    assert f"Outside the steps' work: {duration(100 * ms)} of each {duration(120 * ms)} step (83%, median) on every " \
           "rank ran before" in " ".join(step_time.step_lines(summary))
    assert (f"Outside the steps' work: {duration(100 * ms)} of each {duration(120 * ms)} step", "steps") in \
        first_screen({"step_time": summary})
    # work close to the cycle: nothing to say
    busy = [{**row, "end_ns": row["start_ns"] + 115 * ms, "dur_ns": 115 * ms} for row in rows]
    assert step_time.outside_work(step_time.step_time_table(pl.DataFrame(busy))) is None


def test_one_ranks_slow_loader_is_named_though_the_others_wait_inside_their_work():
    """The helper's job E: rank 1 loads data for 123 ms before each forward, rank 0 for 0.4 ms, and rank 0 then waits
    in its all-reduce for rank 1 (its work 215 - 0.4 ms, rank 1's 92 ms). Every cycle is 215 ms. Hand-computed: rank
    1 spends 123 ms of each 215 ms step outside its work (57%), rank 0 0.4 ms; the most any rank spent inside its
    work (215 - 0.4 ms) had hidden it (215 - 214.6 = 0.4 ms outside, nothing said)."""
    ms, us = 1_000_000, 1_000
    loader = {0: 400 * us, 1: 123 * ms}
    rows = [{"rank": rank, "source": f"collector/train_steps/rank{rank}-00000.parquet", "step": step, "micro_step": step,
             "start_ns": step * 215 * ms + loader[rank], "end_ns": (step + 1) * 215 * ms,
             "dur_ns": 215 * ms - loader[rank], "is_boundary": True, "skipped": False, "global_samples": 8 * (step + 1),
             "loss_scale": None}
            for rank in (0, 1) for step in range(6)]
    table = step_time.step_time_table(pl.DataFrame(rows))
    outside = step_time.outside_work(table)
    assert (outside["median_outside_ns"], outside["rank"], outside["least_outside_ns"]) == (123 * ms, 1, 400 * us)
    line = step_time.outside_line(outside)
    assert line.startswith("Outside the steps' work: rank 1 spends 123 ms of each 215 ms step (57%, median) before a "
                           "step's first forward")
    assert line.endswith("the other ranks as little as 400 µs, waiting for it inside their work (in their collectives)")


def test_profiled_steps_past_the_third_are_named():
    """A job with two windows of two steps (4, 5, 8, 9) printed steps 4, 5 and 8 and nothing of 9."""
    windows = [{"step": s, "profiler_dur_ns": 10_000_000, "rank": 0, "step_time_ns": 11_000_000, "after_last_step": False}
               for s in (4, 5, 8, 9)]
    lines = step_time.step_lines({"profiled_steps": {"steps": windows, "source": "train_steps", "run_median_ns": None}})
    assert [line.split(" took")[0] for line in lines[:3]] == ["Profiled step 4", "Profiled step 5", "Profiled step 8"]
    assert lines[3] == "1 more profiled step (9): step_time's profiled_steps in findings.json."


def _steady_rows(cycles: list[int]) -> list[dict]:
    """One rank's train_steps rows whose cycles (the end of the step before to this one's end) are `cycles` ns."""
    rows, end = [], 0
    for step, cycle in enumerate(cycles):
        end += cycle
        rows.append({"rank": 0, "source": "collector/train_steps/rank0-00000.parquet", "step": step, "micro_step": step,
                     "start_ns": end - cycle // 2, "end_ns": end, "dur_ns": cycle // 2, "is_boundary": True,
                     "skipped": False, "global_samples": 8 * (step + 1), "global_tokens": None, "loss_scale": None,
                     "lr": 0.1})
    return rows


def test_the_steps_the_collector_flushed_in_are_left_out_and_their_cost_said():
    """A collector flushing every 10 steps (first after step 9: first_flush_step 10) on 31 steps of 1000 ns whose
    steps 10, 20 and 30 took 2500 ns: those three are left out as the collector's, the kept median is 1000 ns, no
    step is the run's slowest, and one line gives the flushes' cost (median 2500 against 1000)."""
    cycles = [2500 if step in (10, 20, 30) else 1000 for step in range(31)]
    facts = {"first_flush_step": 10, "settings": {"flush_every": 10}}
    table = step_time.step_time_table(pl.DataFrame(_steady_rows(cycles)), facts=facts)
    flagged = table.filter(pl.col("reason") == "collector_flush")["step"].to_list()
    assert flagged == [10, 20, 30]
    summary = step_time.step_time_summary(table)
    assert (summary["steps"], summary["median_ns"], summary["max_ns"]) == (27, 1000, 1000)  # 31 less step 0 and three
    assert summary["flush_cost"] == {"steps": 3, "median_ns": 2500, "kept_median_ns": 1000}
    assert step_time.slowest_step(table) is None
    lines = step_time.step_lines(summary)
    assert "left out: step 0 (no step before to time from); steps 10, 20, 30 (the collector's flushes)" in lines[0]
    assert any(line.startswith("The collector's flushes slowed the steps they ran in: median 2.5 µs over 3 such steps "
                               "against 1 µs") for line in lines), lines
    # the replayed alarms skip them as the job's own alarms did (the collector adds each flush step to skip_steps)
    assert {10, 20, 30} <= step_time.instrumented(table)


@pytest.mark.parametrize("facts", [
    {"first_flush_step": 10, "settings": {"flush_every": 4}},  # flushing this often, every step holds its share
    {"settings": {"flush_every": 10}},  # a collector from before first_flush_step: nothing to place them by
    {"first_flush_step": "10", "settings": {"flush_every": 10}},
    {"first_flush_step": 10, "settings": {"flush_every": True}},
])
def test_flush_steps_are_marked_only_when_known_and_sparse(facts):
    cycles = [2500 if step in (10, 20, 30) else 1000 for step in range(31)]
    table = step_time.step_time_table(pl.DataFrame(_steady_rows(cycles)), facts=facts)
    assert table.filter(pl.col("reason").str.contains("collector_flush")).is_empty()
    assert "flush_cost" not in step_time.step_time_summary(table)


def test_the_collector_notes_the_step_its_first_flush_ran_in(ds_steady_run):
    """The real job's manifests: the first flush follows the flush_every-th step, so the step it runs in is the
    first recorded step + flush_every (train_steps' own numbering, from the parts)."""
    for manifest_path in sorted((ds_steady_run / "collector" / "manifest").glob("rank*.json")):
        manifest = json.loads(manifest_path.read_text())
        rank = manifest["rank"]
        steps = pl.read_parquet(ds_steady_run / "collector" / "train_steps" / f"rank{rank}-*.parquet")["step"]
        assert manifest["run"]["first_flush_step"] == steps.min() + manifest["run"]["settings"]["flush_every"]


def test_a_profiler_window_after_the_last_step_is_named_as_why_there_is_no_trace():
    """skip_first 25 in a 20-step job: no trace, and the report said only 'no profiler traces'."""
    from steplens.analyze.analyses import launch

    profile = {"skip_first": 25, "wait": 1, "warmup": 1, "active": 2, "repeat": 1}
    facts = {"settings": {"profile": profile}, "collector_rank0": {"steps_completed": 20},
             "collector_rank1": {"steps_completed": 20}}
    # window steps: skip 25, wait 1, warm-up 1 -> steps 27 and 28 traced
    assert launch._unopened_window(facts) == (
        "no profiler traces: the collector's profiler window was to open at step 27, after the run's last step (19); "
        "open it earlier (profile skip_first and wait) to trace this run")
    assert launch._unopened_window({**facts, "collector_rank0": {"steps_completed": 40}}) is None
    assert launch._unopened_window({"collector_rank0": {"steps_completed": 20}}) is None  # no window asked for


def test_an_earlier_jobs_calls_and_scalars_are_told_from_the_later_jobs():
    """The helper's job run twice into one folder (10 steps, then 5): comms_log counted both jobs' 30 all_reduce calls
    (the later job made 10). Rows of the collector's other tables recorded before the later recording began, at a step
    it went back to or after, are the earlier job's; a resumed job's rows before its checkpoint step stay."""
    from steplens.analyze.analyses import step_time as st

    ms = 1_000_000
    rerun = _two_jobs(10, [(step, step) for step in range(5)])
    calls = pl.DataFrame({"rank": [0] * 4, "step": [3, 9, 0, 4],
                          "ts_ns": [350 * ms, 950 * ms, 10_000 * ms + 1, 10_000 * ms + 130 * ms]})
    assert st.earlier_recording(rerun, calls, "ts_ns").to_list() == [True, True, False, False]
    resumed = _two_jobs(10, [(3 + i, i) for i in range(4)])
    calls = calls.with_columns(step=pl.Series([1, 9, 3, 6]))
    assert st.earlier_recording(resumed, calls, "ts_ns").to_list() == [False, True, False, False]
    assert not st.earlier_recording(_two_jobs(10, []), calls, "ts_ns").any()  # one recording: nothing earlier
