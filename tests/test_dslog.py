"""DeepSpeed / Megatron-DeepSpeed log importer on real logs: the DeepSpeed 0.19.8 CPU runs and the
corpus's section-3 logs (../shared). Known answers come from the log lines themselves (counted with
independent regexes here), from the same run's csv_monitor files, or from reading the file by hand
(line numbers cited)."""

import csv
import json
import re
import sys
from pathlib import Path

import polars as pl
import pytest
from steplens.analyze.importers import deepspeed_log, flops_text
from steplens.analyze.importers import telemetry
from steplens.analyze.importers.base import conform

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
RUNS = SHARED / "deepspeed-cpu-runs"
CORPUS = SHARED / "corpus"
MEGATRON = CORPUS / "Megatron-DeepSpeed/random_ltd_gpt3_baseline/gpt3-0.125B-tokendropping-graduallyIncrease-lr-3.0e-4-baseline.log"
CONCATENATED = CORPUS / "DeepSpeedExamples/random_ltd_vit_cifar/training.log"
CHAT_SFT = CORPUS / "DeepSpeedExamples/deepspeed_chat_step1_sft/opt-1.3b-globalBatchSize128.log"
SECTION3_LOGS = [
    CHAT_SFT,
    CORPUS / "DeepSpeedExamples/deepspeed_chat_step2_reward/opt-350m_globalBatchSize-64.log",
    CORPUS / "DeepSpeedExamples/data_efficiency_gpt_check_base/training.log",
    CONCATENATED,
    MEGATRON,
]
FIXTURES = Path(__file__).parent / "fixtures" / "dslog"


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not found")
    return path


def _rank0_log(run: str) -> Path:
    return next(_need(RUNS / run / "rank_logs").glob("*_rank0.log"))


def _parse(path: Path):
    return deepspeed_log.parse(path, path.name)


def _all_logs() -> list[Path]:
    found = sorted(RUNS.glob("*/rank_logs/*.log")) + sorted(RUNS.glob("*/launcher.log")) + sorted(RUNS.glob("*/comms/*.txt"))
    return found + [p for p in SECTION3_LOGS if p.exists()]


@pytest.mark.parametrize("path", _all_logs(), ids=lambda p: str(p.relative_to(SHARED)))
def test_every_real_log_is_claimed_and_parses(path):
    assert telemetry.claimant(path).name == "deepspeed_log"
    imported = _parse(path)
    assert not [i for i in imported.issues if i[0] == "error"]
    for table, frame in imported.tables.items():
        assert conform(frame, table).columns == frame.columns


def test_global_timers_equal_the_log_lines_and_the_csv_monitor():
    path = _rank0_log("run1")
    timers = _parse(path).tables["step_timers"]
    text = path.read_text()
    fwd_lines = [float(x) for x in re.findall(r"\[Rank 0\] time \(ms\) \| fwd: ([\d.]+)", text)]
    fwd = timers.filter((pl.col("scope") == "global") & (pl.col("timer") == "fwd")).sort("step")
    assert fwd["step"].to_list() == list(range(len(fwd_lines)))
    assert fwd["ms"].to_list() == fwd_lines
    # The engine wrote the same timer to csv_monitor at global_samples = (step + 1) x train_batch_size (8).
    with open(RUNS / "run1/csv_monitor/tiny_gpt/Train_Samples_elapsed_time_ms_forward.csv") as f:
        monitor = {int(r["step"]): float(r["elapsed_time_ms_forward"]) for r in csv.DictReader(f)}
    for step, ms in zip(fwd["step"], fwd["ms"]):
        assert ms == pytest.approx(monitor[(step + 1) * 8], abs=0.006)
    # The optimizer line of step 1 (log line 237 of run1): printed before that step's global line.
    optimizer = timers.filter((pl.col("scope") == "optimizer") & (pl.col("step") == 1))
    assert dict(zip(optimizer["timer"], optimizer["ms"])) == {
        "optimizer_allgather": 6.38, "optimizer_gradients": 1.85, "optimizer_step": 1.27}


def test_gradient_accumulation_two_micro_lines_per_step():
    """run2 has gas=2: two micro lines then the global line, which holds their sum (reference, section 4)."""
    timers = _parse(_rank0_log("run2")).tables["step_timers"]
    micro = timers.filter(pl.col("timer") == "fwd_microstep").group_by("step").agg(pl.len(), pl.col("ms").sum())
    glob = timers.filter(pl.col("timer") == "fwd").select("step", pl.col("ms").alias("global_ms"))
    joined = micro.join(glob, on="step")
    assert joined.height == glob.height == 10
    assert set(joined["len"]) == {2}
    for row in joined.iter_rows(named=True):  # each value printed with 2 decimals
        assert row["ms"] == pytest.approx(row["global_ms"], abs=0.0151)


def test_step_lines_become_scalars_on_the_monitor_axis():
    path = _rank0_log("run1")
    scalars = _parse(path).tables["scalars"]
    lr = scalars.filter(pl.col("name") == "lr").drop_nulls("step")
    with open(RUNS / "run1/csv_monitor/tiny_gpt/Train_Samples_lr.csv") as f:
        monitor = {int(r["step"]): float(r["lr"]) for r in csv.DictReader(f)}
    assert lr.height == len(re.findall(r"\] step=[1-9]\d*, skipped", path.read_text()))
    for row in lr.iter_rows(named=True):
        assert row["global_samples"] == (row["step"] + 1) * 8
        assert row["value"] == monitor[row["global_samples"]]
    # epoch=0/micro_step=4/global_step=4 line: 4 optimizer steps done.
    speed = scalars.filter((pl.col("name") == "CurrSamplesPerSec") & (pl.col("step") == 3)).row(0, named=True)
    assert speed["value"] == 70.76169681439102 and speed["global_samples"] == 32
    assert speed["wall_ns"] is not None
    # DeepSpeed's step=0 line (before any step, and before its config dump names the batch) is at 0 samples: a curve
    # point without it read as a scalar "known by step only"
    initial = scalars.filter(pl.col("step").is_null() & pl.col("name").is_in(["lr", "skipped_steps"]))
    assert initial.height == 2 * len(re.findall(r"\] step=0, skipped", path.read_text())) > 0
    assert initial["global_samples"].to_list() == [0] * initial.height


def test_verbose_comms_lines_repaired_to_the_last_running_total():
    path = _rank0_log("run1")
    imported = _parse(path)
    calls = imported.tables["comms_calls"]
    totals: dict[str, list[float]] = {}
    for record, total in re.findall(r"comm op: (.+?) \| time \(ms\): ([\d.]+)", path.read_text()):
        totals.setdefault(record, []).append(float(total))
    assert calls.height == sum(len(v) for v in totals.values())
    assert set(calls["latency_origin"]) == {"repaired_cumulative"}
    for record, values in totals.items():
        mine = calls.filter(pl.col("op") == record)
        assert mine["latency_ns"].sum() / 1e6 == pytest.approx(values[-1], abs=1e-6)
    assert [i for i in imported.issues if i[1] == "cumulative_comms_latency"]
    # The log_summary table printed into the same log: untrusted, as printed.
    summary = imported.tables["comms_summary"]
    row = summary.filter((pl.col("op") == "all_reduce") & (pl.col("count") == 12) & (pl.col("total_latency_ms") == 651.52))
    assert row.height == 1 and row["trusted"].to_list() == [False]


def test_summary_text_alone_has_unknown_trust():
    path = _need(RUNS / "run1/comms/log_summary_rank0.txt")
    imported = _parse(path)
    summary = imported.tables["comms_summary"]
    text = path.read_text().split("_____")[0]  # the straggler breakdown after it is not read
    assert summary.height == len(re.findall(r"(?m)^ +\d+(?:\.\d+)? ?[KMG]?B +\d+ ", text)) == 11
    assert summary["trusted"].null_count() == summary.height
    assert [i for i in imported.issues if i[1] == "comms_summary_trust_unknown"]


def test_facts_from_the_launcher_and_config_dump():
    imported = _parse(_rank0_log("run1"))
    assert imported.facts["train_batch_size"] == 8 and imported.facts["zero_stage"] == 2
    assert imported.facts["ds_config"]["comms_logger"]["verbose"] is True
    launcher = _parse(_need(RUNS / "run1/launcher.log"))
    assert launcher.facts["world_size"] == 2
    status = launcher.tables["run_status"].row(0, named=True)
    assert (status["status"], status["exit_code"]) == ("completed", 0)


def test_megatron_log_killed_with_iteration_scalars():
    path = _need(MEGATRON)
    imported = _parse(path)
    status = imported.tables["run_status"]
    assert status["status"].to_list() == ["killed"]
    assert "SIGTERM" in status["error"][0]
    scalars = imported.tables["scalars"]
    # Line 2740: iteration 10 | consumed samples: 2560 | consumed tokens: 5242880 | elapsed ... (ms): 1001.5
    first = scalars.filter((pl.col("name") == "elapsed time per iteration (ms)") & (pl.col("step") == 9)).row(0, named=True)
    assert (first["value"], first["global_samples"], first["global_tokens"]) == (1001.5, 2560, 5242880)
    assert first["rank"] == 7  # Megatron's print_rank_last, dist_world_size=8 (line 32)
    iterations = len(re.findall(r"(?m)^ iteration\s+\d+/", path.read_text()))
    assert scalars.filter(pl.col("name") == "lm loss").height == iterations
    assert imported.facts["world_size"] == 8 and imported.facts["deepspeed_version"] == "0.7.3+d505437d"
    # ds_report lines interleaved by several ranks (e.g. "torch version ... 11.31.11.0+cu113") are not believed.
    assert imported.facts["torch_version"] == "1.11.0+cu113"
    garbled = [i for i in imported.issues if i[1] == "garbled_lines"]
    assert garbled and garbled[0][2] > 0


@pytest.mark.parametrize("keep", ["using_world_size_line", "arguments_block"])
def test_megatron_log_without_the_launchers_lines_takes_its_world_size_from_megatron(tmp_path, keep):
    """The same real log, as a job launched without deepspeed's launcher prints it: no dist_world_size
    and no DeepSpeed config dump. Megatron's own start-up lines give the world size (8: line 168
    "using world size: 8, ..." and line 367 "  world_size ...... 8"), so its iteration lines, printed
    by the last rank, are rank 7, not rank-less."""
    lines = _need(MEGATRON).read_text().splitlines()
    megatron_line = "using world size:" if keep == "arguments_block" else "  world_size ......................................"

    def dropped(line: str) -> bool:
        return "dist_world_size=" in line or "[config.py" in line and "world_size" in line or line.startswith(megatron_line)

    log = tmp_path / "megatron.log"
    log.write_text("\n".join(line for line in lines if not dropped(line)) + "\n")
    imported = _parse(log)
    assert imported.facts["world_size"] == 8
    iterations = len(re.findall(r"(?m)^ iteration\s+\d+/", log.read_text()))
    ranks = imported.tables["scalars"].filter(pl.col("name") == "lm loss")["rank"]
    assert ranks.to_list() == [7] * iterations


def test_concatenated_runs_counted_with_their_status():
    path = _need(CONCATENATED)
    text = path.read_text()
    launches = len(re.findall(r"\[runner\.py:\d+:main\] cmd = ", text))
    first_launch = text.index("] cmd = ")
    launcherless = len(re.findall(r"Discovered MPI settings of world_rank=0", text[:first_launch]))
    status = _parse(path).tables["run_status"].sort("run_index")
    assert status.height == launches + launcherless == 21
    # Line 122: the first launch's rank 15 "exits with return code = 2"; the file ends "exits successfully".
    first = status.filter(pl.col("run_index") == launcherless).row(0, named=True)
    assert (first["status"], first["exit_code"]) == ("failed", 2)
    assert status["status"][-1] == "completed"
    failures = len(re.findall(r"exits with return code = [1-9]", text))
    assert status.filter(pl.col("status") == "failed").height == failures


def test_a_log_captured_with_colours_reads_as_without_them(tmp_path):
    """The console of a job run with colours (FORCE_COLOR, `script`): every line wrapped in SGR codes, some
    levels coloured, a window title set. The same records as the plain log, and no escape in what is shown."""
    plain = _rank0_log("run1")
    lines = plain.read_text().splitlines()
    coloured = [f"\x1b[1;32m{line}\x1b[0m" if i % 2 else line.replace("[INFO]", "[\x1b[33mINFO\x1b[0m]")
                for i, line in enumerate(lines)]
    copy = tmp_path / plain.name
    copy.write_text("\x1b]0;train.py\x07" + "\n".join(coloured) + "\n")
    expected, got = _parse(plain), _parse(copy)
    assert sorted(got.tables) == sorted(expected.tables) and got.tables
    for name, frame in expected.tables.items():
        assert got.tables[name].equals(frame), name
    assert "\x1b" not in json.dumps(got.facts)
    assert [i[1] for i in got.issues] == [i[1] for i in expected.issues]


def test_a_timer_past_any_time_is_a_garbled_item_not_a_crash(tmp_path):
    """fwd 1e300 ms, or 1e400 (inf), in a real log's timer line: that item is dropped and the line counted as
    garbled; the run is analysed (it ended in an internal error casting the step's ns to int64)."""
    from click.testing import CliRunner
    from steplens.analyze.cli import analyze

    lines = _rank0_log("run1").read_text().splitlines()
    timer_lines = [i for i, line in enumerate(lines) if "time (ms) | fwd:" in line][:2]
    assert len(timer_lines) == 2
    for i, huge in zip(timer_lines, ("1e300", "1e400")):
        lines[i] = re.sub(r"fwd: [0-9.]+", f"fwd: {huge}", lines[i])
    run = tmp_path / "run"
    run.mkdir()
    (run / _rank0_log("run1").name).write_text("\n".join(lines) + "\n")
    imported = _parse(run / _rank0_log("run1").name)
    timers = imported.tables["step_timers"]
    assert timers.filter(pl.col("timer") == "fwd")["ms"].abs().max() < 1e12
    assert dict((i[1], i[2]) for i in imported.issues)["garbled_lines"] >= 2
    result = CliRunner().invoke(analyze, [str(run), "-q", "-j", "1"])
    assert result.exit_code == 0, result.output


def test_rank0_stdout_without_launcher_header():
    path = _need(CHAT_SFT)
    imported = _parse(path)
    steps = len(re.findall(r"\] step=\d+, skipped=", path.read_text()))
    assert imported.tables["scalars"].filter(pl.col("name") == "lr").height == steps
    assert imported.tables["run_status"]["status"].to_list() == ["completed"]


def test_bad_inputs_give_issues_not_exceptions(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_bytes(b"")
    assert _parse(empty).issues[0][1] == "empty_file"

    junk = tmp_path / "junk.log"
    junk.write_bytes(bytes(range(256)) * 64)
    imported = _parse(junk)
    assert imported.tables == {} and not [i for i in imported.issues if i[0] == "error"]
    assert not deepspeed_log.claims(junk)

    whole = _rank0_log("run1").read_bytes()
    cut = tmp_path / "cut_rank0.log"
    cut.write_bytes(whole[: len(whole) * 2 // 3 + 7])  # mid-line
    imported = _parse(cut)
    assert 0 < imported.tables["step_timers"].height < _parse(_rank0_log("run1")).tables["step_timers"].height
    assert any(i[1] == "no_final_newline" for i in imported.issues)

    garbled = FIXTURES / "garbled_interleaved.log"
    imported = _parse(garbled)
    timers = imported.tables["step_timers"]
    # The fixture's second timer line was split by another rank's write: only its whole items are kept.
    assert timers.filter(pl.col("line") == 2)["timer"].to_list() == ["fwd_microstep"]
    assert next(i for i in imported.issues if i[1] == "garbled_lines")[2] == 3
    assert imported.tables["run_status"]["status"].to_list() == ["failed"]
    assert imported.tables["run_status"]["error"].to_list() == ["RuntimeError: CUDA error: an illegal memory access"]


@pytest.fixture(scope="module")
def fresh_runs(tmp_path_factory) -> dict[str, Path]:
    """Two real 2-rank DeepSpeed CPU jobs (tests/realrun, about 25 s each): one with the comms logger
    verbose, wall-clock timers and DeepSpeed's FLOPs profiler; one where rank 1 SIGKILLs itself."""
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    sys.path.insert(0, str(Path(__file__).parent / "realrun"))
    from launch import run_tiny_gpt

    root = tmp_path_factory.mktemp("dslog_runs")
    common = ("--zero_stage", "2", "--no-collector", "--wall_clock_breakdown", "--log_level", "info")
    return {
        "verbose": run_tiny_gpt(root / "verbose", *common, "--steps", "4", "--comms_logger", "verbose",
                                "--ds_flops_profiler", "2"),
        "killed": run_tiny_gpt(root / "killed", *common, "--steps", "6", "--kill_rank", "1", "--kill_at_step", "2",
                               check=False),
    }


def test_fresh_run_logs(fresh_runs):
    run = fresh_runs["verbose"]
    log = next((run / "rank_logs").glob("*_rank0.log"))
    imported = _parse(log)
    text = log.read_text()
    calls = imported.tables["comms_calls"]
    logged = re.findall(r"comm op: (\S+) \| time \(ms\): ([\d.]+) \| msg size: ([^|]+?) \|", text)
    assert calls.height == len(logged) > 0
    assert set(calls["latency_origin"]) == {"repaired_cumulative"}  # DeepSpeed 0.19.8 logs running totals
    for op in {op for op, _, _ in logged}:
        last_total = [float(ms) for name, ms, _ in logged if name == op][-1]
        assert calls.filter(pl.col("op") == op)["latency_ns"].sum() / 1e6 == pytest.approx(last_total, abs=1e-6)
    # The summary dict written at the end counts the same calls per op and size (as DeepSpeed prints the size).
    summary = json.loads((run / "comms" / "log_summary_rank0.json").read_text())["summary"]
    for op, sizes in summary.items():
        for stats in sizes.values():
            seen = sum(1 for name, _, size in logged if name == op and size.strip() == stats["msg_size_str"])
            assert seen >= stats["count"]  # the log also holds calls made after the summary (its own barrier)
    timers = imported.tables["step_timers"]
    assert timers.filter(pl.col("timer") == "fwd")["step"].to_list() == [0, 1, 2, 3]
    flops = flops_text.parse(run / "flops_profiler" / "flops_profile.txt", "flops_profile.txt")
    assert flops.tables["flops_profile"].filter(pl.col("depth") == 0)["duration_bogus"].to_list() == [True]
    launcher = _parse(run / "launcher.log").tables["run_status"]
    assert (launcher["status"][0], launcher["exit_code"][0]) == ("completed", 0)
    killed = _parse(fresh_runs["killed"] / "launcher.log").tables["run_status"].row(0, named=True)
    assert killed["status"] == "killed" and killed["exit_code"] == -9


def test_flops_profile_printed_into_the_log(tmp_path):
    """Without output_file the engine prints the profile to stdout, between ordinary log lines."""
    profile = _need(RUNS / "run1/flops_profiler/flops_profile.txt").read_text()
    log_lines = _rank0_log("run1").read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(log_lines) if "Flops profiler finished" in line)
    mixed = tmp_path / "stdout_rank0.log"
    mixed.write_text("".join(log_lines[:at]) + profile + "".join(log_lines[at:]))
    imported = _parse(mixed)
    alone = flops_text.parse(RUNS / "run1/flops_profiler/flops_profile.txt", "x")
    assert imported.tables["flops_profile"].drop("source").equals(alone.tables["flops_profile"].drop("source"))
    assert imported.facts["flops_profiler"]["fwd_macs_per_gpu"] == 234.88e6
    # The lines around it are read as before.
    assert imported.tables["step_timers"].height == _parse(_rank0_log("run1")).tables["step_timers"].height


# Hostile input: a damaged value costs that value (null) or its line, counted; never the file. The lines are run1's
# rank-0 log lines (and the corpus's Megatron log) as printed, with one thing changed.
STAMP = "[2026-11-29 12:59:{}] [INFO] [logging.py:123:log_dist] [Rank 0] "
BROADCASTS = [  # run1 rank-0 lines 12-17: running totals (DeepSpeed 0.19.8)
    ("49,231", "0.63", "256.0 KB"), ("49,233", "0.88", "32.0 KB"), ("49,234", "1.08", "512.0 B"),
    ("49,235", "1.29", "512.0 B"), ("49,235", "1.48", "192.0 KB"), ("49,236", "1.59", "1.5 KB")]


def _damaged_log(tmp_path, lines: list[str], name: str = "damaged_rank0.log"):
    path = tmp_path / name
    path.write_text("".join(f"{line}\n" for line in lines))
    return _parse(path)


def _counted(imported, reason: str) -> list[tuple[int, str]]:
    return [(count, detail.split(":")[0]) for _, r, count, detail in imported.issues if r == reason]


def _broadcast_lines(changed: dict[int, tuple[str, str]]) -> list[str]:
    """BROADCASTS as log lines; `changed` maps an index to the (time, size) text written there instead."""
    lines = []
    for index, (at, ms, size) in enumerate(BROADCASTS):
        ms, size = changed.get(index, (ms, size))
        lines.append(STAMP.format(at) + f"comm op: broadcast | time (ms): {ms} | msg size: {size} | "
                     "algbw (Gbps): 0.00 | busbw (Gbps): 0.00")
    return lines


def test_comms_latency_nan_or_inf_is_null_and_counted(tmp_path):
    """An inf running total: its call and the next (their difference to it) have no latency; the others are repaired
    as before, and the inf does not hide that the totals run up."""
    imported = _damaged_log(tmp_path, _broadcast_lines({2: ("inf", "512.0 B")}))
    calls = imported.tables["comms_calls"]
    assert calls["latency_ns"].to_list() == [630000, 250000, None, None, 190000, 110000]
    assert calls["msg_bytes"].to_list() == [262144, 32768, 512, 512, 196608, 1536]
    assert set(calls["latency_origin"]) == {"repaired_cumulative"}
    assert _counted(imported, "unrepresentable_value") == [(2, "comms_calls.latency_ns")]
    nan = _damaged_log(tmp_path, _broadcast_lines({4: ("nan", "192.0 KB")}), "nan_rank0.log").tables["comms_calls"]
    assert nan["latency_ns"].to_list() == [630000, 250000, 200000, 210000, None, None]


def test_comms_size_that_is_no_number_keeps_the_call(tmp_path):
    imported = _damaged_log(tmp_path, _broadcast_lines({1: ("0.88", "1.2.3 MB"), 3: ("1.29", "9" * 400 + " MB")}))
    calls = imported.tables["comms_calls"]
    assert calls["msg_bytes"].to_list() == [262144, None, 512, None, 196608, 1536]
    assert calls["latency_ns"].to_list() == [630000, 250000, 200000, 210000, 190000, 110000]
    assert _counted(imported, "garbled_lines") == [(2, "2 lines hold interleaved writes from several processes, "
                                                       "undecodable bytes or damaged values (an impossible date, a number "
                                                       "too long to read); records in them that did not parse whole were "
                                                       "skipped, damaged values in kept records are null")]


def test_impossible_date_leaves_the_wall_time_null(tmp_path):
    imported = _damaged_log(tmp_path, [  # run1 rank-0 lines 257, 275 (30 Nov written 31) and 293
        "[2026-11-29 12:59:54,493] [INFO] [logging.py:123:log_dist] [Rank 0] step=2, skipped=0, lr=[0.00043067655807339306], mom=[(0.9, 0.999)]",
        "[2026-11-31 12:59:54,704] [INFO] [logging.py:123:log_dist] [Rank 0] step=4, skipped=0, lr=[0.0008613531161467861], mom=[(0.9, 0.999)]",
        "[2026-11-29 13:00:01,573] [INFO] [logging.py:123:log_dist] [Rank 0] step=6, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]",
        "[2026-02-30 13:00:05,000] [INFO] [logging.py:123:log_dist] [Rank 0] done",  # the rank's last line
    ])
    lr = imported.tables["scalars"].filter(pl.col("name") == "lr")
    assert lr.select("step", "value", "wall_ns").rows() == [
        (1, 0.00043067655807339306, 1795957194493000000), (3, 0.0008613531161467861, None), (5, 0.001, 1795957201573000000)]
    assert imported.tables["scalars"].filter(pl.col("name") == "skipped_steps")["wall_ns"].null_count() == 1
    last = imported.facts["log_last_line_rank0"]
    assert (last["line"], last["wall_ns"], last["not_before_ns"]) == (4, None, None)
    assert [count for count, _ in _counted(imported, "garbled_lines")] == [2]


def test_unhashable_literal_is_kept_as_text(tmp_path):
    launcher = _damaged_log(tmp_path, [  # run1 launcher.log line 3, its dict damaged
        "[2026-11-29 12:59:44,805] [INFO] [launch.py:152:main] WORLD INFO DICT: {[1]: 2}"], "launcher.log")
    assert launcher.tables["run_status"]["status"].to_list() == ["incomplete"]
    assert [count for count, _ in _counted(launcher, "garbled_lines")] == [1]
    megatron = _damaged_log(tmp_path, [  # the corpus Megatron log's arguments block (lines 170, 234, 236, 311, 373)
        "------------------------ arguments ------------------------",
        "  global_batch_size ............................... {[1]: 2}",
        "  hidden_size ..................................... 768",
        "  num_layers ...................................... 12",
        "-------------------- end of arguments ---------------------"], "megatron.log")
    assert megatron.facts["megatron_args"] == {"global_batch_size": "{[1]: 2}", "hidden_size": 768, "num_layers": 12}
    assert "train_batch_size" not in megatron.facts


def test_megatron_consumed_samples_nan_or_inf_leave_the_axis_null(tmp_path):
    fields = ("elapsed time per iteration (ms): {} | learning rate: {} | global batch size:   256 |reserve_length:   256 | "
              "lm loss: {} | loss scale: 2048.0 | number of skipped iterations:   0 | number of nan iterations:   0 |")
    imported = _damaged_log(tmp_path, [  # the corpus Megatron log's lines 2740, 2744, 2748
        " iteration       10/  171661 | consumed samples:         2560 | consumed tokens:      5242880 | "
        + fields.format("1001.5", "9.339E-08", "1.078335E+01"),
        " iteration       20/  171661 | consumed samples:          nan | consumed tokens:     10485760 | "
        + fields.format("484.7", "1.972E-07", "1.074999E+01"),
        " iteration       30/  171661 | consumed samples:         7680 | consumed tokens:          inf | "
        + fields.format("484.5", "3.009E-07", "1.071889E+01")], "megatron_rank7.log")
    scalars = imported.tables["scalars"]
    assert scalars.filter(pl.col("name") == "lm loss").select("step", "value", "global_samples", "global_tokens").rows() == [
        (9, 10.78335, 2560, 5242880), (19, 10.74999, None, 10485760), (29, 10.71889, 7680, None)]
    assert scalars.height == 3 * 8  # eight numbers per line besides the consumed counts
    assert sorted(_counted(imported, "unrepresentable_value")) == [
        (8, "scalars.global_samples"), (8, "scalars.global_tokens")]


def test_infinite_samples_rate_gives_no_batch_estimate(tmp_path):
    """train_batch_size from the throughput lines: the inf rates are no estimate, the finite one still is."""
    throughput = "[2026-11-29 {}] [INFO] [timer.py:264:stop] epoch=0/micro_step={}/global_step={}, " \
                 "RunningAvgSamplesPerSec={}, CurrSamplesPerSec={}, MemAllocated=0.85GB, MaxMemAllocated=0.85GB"
    imported = _damaged_log(tmp_path, [  # run1 rank-0 lines 189-190 (its other keys left out), 276, 294, 310 and 326
        "[2026-11-29 12:59:52,453] [INFO] [config.py:664:print_user_config]   json = {",
        '    "train_micro_batch_size_per_gpu": 4',
        "}",
        throughput.format("12:59:54,705", 4, 4, "88.7557766294982", "70.76169681439102"),
        throughput.format("13:00:01,574", 6, 6, "102.96268440889044", "inf"),
        throughput.format("13:00:01,768", 8, 8, "99.79755223436686", "101.61075707963799"),
        throughput.format("13:00:01,969", 10, 10, "97.04077596338388", "inf")])
    # One finite interval: 101.61075707963799 samples/s x 0.194 s / 2 steps = 9.86, a multiple of 4: 8 (run1's batch).
    assert imported.facts["train_batch_size"] == 8
    assert "median 9.9 over 1 intervals" in imported.facts["train_batch_size_origin"]
    rates = imported.tables["scalars"].filter(pl.col("name") == "CurrSamplesPerSec")
    assert rates.select("step", "value", "global_samples").rows() == [
        (3, 70.76169681439102, 32), (5, float("inf"), 48), (7, 101.61075707963799, 64), (9, float("inf"), 80)]


def test_numbers_past_the_int_digit_limit_cost_their_line(tmp_path):
    huge = "9" * 5000  # int() reads at most 4300 digits
    imported = _damaged_log(tmp_path, [  # run1 rank-0 lines 251, 257 (step written huge) and 259
        "[Rank 0] time (ms) | fwd: 724.02 | bwd: 1000.93 | bwd_inner: 970.99 | bwd_allreduce: 29.88 | step: 202.78",
        f"[2026-11-29 12:59:54,493] [INFO] [logging.py:123:log_dist] [Rank 0] step={huge}, skipped=0, lr=[0.00043067655807339306], mom=[(0.9, 0.999)]",
        f"[Rank {huge}] time (ms) | fwd: 16.74",
        "[Rank 0] time (ms) | fwd: 16.74 | bwd: 34.57 | bwd_inner: 21.74 | bwd_allreduce: 12.79 | step: 16.54"])
    timers = imported.tables["step_timers"]
    assert timers.filter(pl.col("timer") == "fwd").select("rank", "step", "line", "ms").rows() == [
        (0, 0, 1, 724.02), (0, 1, 4, 16.74)]
    assert timers.height == 10 and "scalars" not in imported.tables
    assert [count for count, _ in _counted(imported, "garbled_lines")] == [2]


def test_summary_row_past_the_int_digit_limit_costs_its_row(tmp_path):
    row = "                    {:<19} {:<19} {:<19} {:<19} 0.00                0.00                "
    imported = _damaged_log(tmp_path, [  # run1 comms/log_summary_rank0.txt lines 1-5, one count damaged
        "Comm. Op            Message Size        Count               Total Latency(ms)   Avg Latency(ms)     "
        "tput_avg (Gbps)     busbw_avg (Gbps)    ",
        "broadcast",
        row.format("512.0 B", "26", "120.25", "4.72"),
        row.format("1.5 KB", "4" * 5000, "16.53", "4.13"),
        row.format("2.0 KB", "4", "19.71", "4.93")], "log_summary_rank0.txt")
    summary = imported.tables["comms_summary"]
    assert summary.select("op", "msg_bytes", "count", "total_latency_ms").rows() == [
        ("broadcast", 512, 26, 120.25), ("broadcast", 2048, 4, 19.71)]
    assert [count for count, _ in _counted(imported, "garbled_lines")] == [1]


def test_values_beyond_int64_are_null_and_counted(tmp_path):
    imported = _damaged_log(tmp_path, [  # run1 rank-0 lines 257 (in the year 9999: past int64 in ns) and 275
        "[9999-11-29 12:59:54,493] [INFO] [logging.py:123:log_dist] [Rank 0] step=2, skipped=0, lr=[0.00043067655807339306], mom=[(0.9, 0.999)]",
        "[2026-11-29 12:59:54,704] [INFO] [logging.py:123:log_dist] [Rank 0] step=4, skipped=0, lr=[0.0008613531161467861], mom=[(0.9, 0.999)]"])
    lr = imported.tables["scalars"].filter(pl.col("name") == "lr")
    assert lr.select("step", "value", "wall_ns").rows() == [
        (1, 0.00043067655807339306, None), (3, 0.0008613531161467861, 1795957194704000000)]
    assert _counted(imported, "unrepresentable_value") == [(2, "scalars.wall_ns")]


def test_config_json_nested_too_deep_costs_its_line(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    imported = _damaged_log(tmp_path, [  # run1 rank-0 lines 189 (one line, nested past the decoder's depth) and 251
        f'[2026-11-29 12:59:52,453] [INFO] [config.py:664:print_user_config]   json = {{"train_micro_batch_size_per_gpu": 4, "a": {deep}}}',
        "[Rank 0] time (ms) | fwd: 724.02 | bwd: 1000.93 | bwd_inner: 970.99 | bwd_allreduce: 29.88 | step: 202.78"])
    assert "ds_config" not in imported.facts and "train_micro_batch_size_per_gpu" not in imported.facts
    assert imported.tables["step_timers"]["ms"].to_list() == [724.02, 1000.93, 970.99, 29.88, 202.78]
    assert [count for count, _ in _counted(imported, "garbled_lines")] == [1]


def test_throughput_intervals_that_hold_a_checkpoint_save_give_no_batch_estimate(tmp_path):
    """8 samples a step at 100 samples/s: 0.16 s between throughput lines two steps apart, 1.16 s where a save
    of 1 s ran between them. Two of the three intervals hold a save: their median would say 58 samples (56)."""
    throughput = "[2026-11-29 13:00:{}] [INFO] [timer.py:264:stop] epoch=0/micro_step={}/global_step={}, " \
                 "RunningAvgSamplesPerSec=100.0, CurrSamplesPerSec=100.0, MemAllocated=0.85GB, MaxMemAllocated=0.85GB"
    save = "[2026-11-29 13:00:{}] [INFO] [torch_checkpoint_engine.py:21:save] [Torch] Checkpoint global_step{} is about to be saved!"
    imported = _damaged_log(tmp_path, [
        "[2026-11-29 12:59:52,453] [INFO] [config.py:664:print_user_config]   json = {",
        '    "train_micro_batch_size_per_gpu": 4',
        "}",
        throughput.format("00,000", 2, 2), throughput.format("00,160", 4, 4), save.format("00,161", 4),
        throughput.format("01,320", 6, 6), save.format("01,321", 6), throughput.format("02,480", 8, 8)])
    assert imported.facts["checkpoint_steps"] == [4, 6]
    assert imported.facts["train_batch_size"] == 8  # from the one clean interval: 100 x 0.16 / 2
    assert "median 8.0 over 1 intervals" in imported.facts["train_batch_size_origin"]


def test_throughput_lines_of_older_deepspeed_releases_are_read(tmp_path):
    """Older ThroughputTimers printed the running average as plain SamplesPerSec, with or without the
    memory figures; the second number is a micro-step count, so no optimizer step is given."""
    imported = _damaged_log(tmp_path, [
        "[2020-06-01 10:00:01,000] [INFO] [timer.py:158:stop] 0/10, SamplesPerSec=38.71",
        "[2020-06-01 10:00:02,000] [INFO] [timer.py:158:stop] 0/20, SamplesPerSec=39.5, MemAllocated=1.25GB, "
        "MaxMemAllocated=2.5GB",
    ])
    rows = imported.tables["scalars"].sort("name", "value").select("name", "value", "step").rows()
    assert rows == [("MaxMemAllocated_GB", 2.5, None), ("MemAllocated_GB", 1.25, None),
                    ("RunningAvgSamplesPerSec", 38.71, None), ("RunningAvgSamplesPerSec", 39.5, None)]


def test_timer_lines_of_older_deepspeed_releases_are_read(tmp_path):
    """DeepSpeed before 0.9 wrote "[Rank 0] rank=0 time (ms) | ..." (names forward, backward, ...), 0.3 printed
    "rank=0 time (ms) | ..." without the logger's prefix (from real logs pasted in DeepSpeed's issues)."""
    imported = _damaged_log(tmp_path, [
        "[2023-02-25 17:42:38,677] [INFO] [logging.py:75:log_dist] [Rank 1] rank=1 time (ms) | forward_microstep: 100.54 | "
        "backward_microstep: 237.41",
        "[2023-02-25 17:42:38,678] [INFO] [logging.py:75:log_dist] [Rank 1] rank=1 time (ms) | forward: 100.60 | "
        "backward: 237.50 | step: 4.70",
        "rank=0 time (ms) | optimizer_gradients: 51.24 | optimizer_step: 937.01 | optimizer_allgather: 64.85",
        "rank=0 time (ms) | forward: 90.00 | backward: 200.00 | step: 1053.10"], name="train.log")
    timers = imported.tables["step_timers"]
    assert timers.select("rank", "step", "scope", "timer", "ms").rows() == [
        (1, 0, "micro", "forward_microstep", 100.54), (1, 0, "micro", "backward_microstep", 237.41),
        (1, 0, "global", "forward", 100.60), (1, 0, "global", "backward", 237.50), (1, 0, "global", "step", 4.70),
        (0, 0, "optimizer", "optimizer_gradients", 51.24), (0, 0, "optimizer", "optimizer_step", 937.01),
        (0, 0, "optimizer", "optimizer_allgather", 64.85),
        (0, 0, "global", "forward", 90.00), (0, 0, "global", "backward", 200.00), (0, 0, "global", "step", 1053.10)]
    assert not _counted(imported, "garbled_lines")


def test_a_launchers_prefix_before_each_line_is_not_interleaving(tmp_path):
    """pdsh (DeepSpeed's multi-node launcher) writes "host: " before each line, mpirun --tag-output "[1,0]<stdout>:",
    a job runner "stdout: " (a real DeepSpeed 0.7.7 log in its issue 2629): those lines are whole; a stamp after
    other text is still two writers on one line."""
    timer = "[2022-12-20 08:26:26,101] [INFO] [logging.py:68:log_dist] [Rank 0] time (ms) | fwd: 10.00 | bwd: 20.00 | step: 5.00"
    imported = _damaged_log(tmp_path, [
        "worker-1: " + timer, "[1,0]<stdout>:" + timer, "stdout: " + timer, "worker-1: stdout: " + timer,
        "CurrSamplesPerSec=12.3" + timer, "stdout: epoch 3 done " + timer], name="train.log")
    assert [count for count, _ in _counted(imported, "garbled_lines")] == [2]  # the last two lines
    assert imported.tables["step_timers"].filter(pl.col("timer") == "fwd").height == 6  # every whole item kept


def test_a_debug_mode_summary_keeps_each_rows_caller(tmp_path):
    """The comms logger in debug mode names the caller in the op column (its tutorial's example): two all_reduce
    rows of one size from two callers stay two rows told apart."""
    row = "                    {:<20}{:<20}{:<20}{:<20}{:<20}{}"
    imported = _damaged_log(tmp_path, [
        "Comm. Op            Message Size        Count               Total Latency(ms)   Avg Latency(ms)     "
        "tput_avg (Gbps)     busbw_avg (Gbps)",
        "all_reduce | [Caller Func: has_overflow]", row.format("4.0 B", 20, "156.43", "7.82", "0.00", "0.00"),
        "all_reduce | [Caller Func: _model_parallel_all_reduce]", row.format("4.0 B", 20, "5895.90", "294.80", "0.00", "0.00"),
        "broadcast", row.format("98.25 MB", 1, "8540.60", "8540.60", "0.19", "0.18")], name="train.log")
    summary = imported.tables["comms_summary"]
    assert summary.select("op", "caller", "msg_bytes", "count", "total_latency_ms").rows() == [
        ("all_reduce", "has_overflow", 4, 20, 156.43), ("all_reduce", "_model_parallel_all_reduce", 4, 20, 5895.90),
        ("broadcast", None, 103_022_592, 1, 8540.60)]  # 98.25 x 2**20 bytes
    from steplens.analyze.importers import comms_dump

    stats = {"msg_size_bytes": 4, "count": 20, "total_latency_ms": 156.43, "avg_latency_ms": 7.82, "busbw_avg_gbps": 0.0}
    rows = comms_dump.summary_rows({"summary": {"all_reduce | [Caller Func: has_overflow]": {"4": stats}}}, 0, "d.json", None, [])
    assert [(r["op"], r["caller"], r["count"]) for r in rows] == [("all_reduce", "has_overflow", 20)]  # log_summary(return_dict=True)


def test_timer_lines_of_a_log_that_begins_mid_run_are_numbered_as_its_step_lines(tmp_path):
    """A log that starts after step 2 (rotated, or pasted from an issue): DeepSpeed prints step=N, the throughput
    line, then step N's timers (engine.step). The timers take their steps from the step=N lines (0-based N - 1),
    the ones printed before the first such line included, so timers and scalars agree."""
    stamp = "[2024-04-19 13:{:02d}:45,504] [INFO] [logging.py:96:log_dist] [Rank 0] "
    timer = stamp + "time (ms) | fwd: {} | bwd: 20.00 | step: 5.00"
    step = stamp + "step={}, skipped=0, lr=[{}], mom=[(0.9, 0.999)]"
    imported = _damaged_log(tmp_path, [
        timer.format(1, "11.00"),  # step 2 of the run (0-based 1): its step=2 line is not in the log
        step.format(2, 3, "6e-06"), timer.format(2, "12.00"),
        step.format(3, 4, "8e-06"), timer.format(3, "13.00"),
        timer.format(4, "14.00")], name="train.log")  # no step=5 line: numbered on from the last one
    fwd = imported.tables["step_timers"].filter(pl.col("timer") == "fwd")
    assert fwd.select("step", "ms").rows() == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0)]
    lr = imported.tables["scalars"].filter(pl.col("name") == "lr")
    assert lr.select("step", "value").rows() == [(2, 6e-06), (3, 8e-06)]  # the steps of the timers after them


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_line_numbers_are_the_files_though_a_progress_bar_redraws_in_place(tmp_path, newline):
    """tqdm redraws its bar with a bare carriage return: a terminal shows each draw on the same line, an
    editor and grep count newlines only. Line numbers are the editor's (a real DeepSpeed-Chat log said
    1805 for its line 1012); the record after the bar's last draw is still read."""
    bar = "\r".join(f"Epoch 1: {p:3d}%|{'#' * (p // 10):<10}| {p // 10}/10" for p in (10, 20, 30))
    lines = [
        "[2024-01-01 00:00:00,000] [INFO] [logging.py:96:log_dist] [Rank 0] rank=0 time (ms) | forward: 10.00 | "
        "backward: 20.00 | step: 5.00",
        bar + "\r[2024-01-01 00:00:01,000] [INFO] [logging.py:96:log_dist] [Rank 0] rank=0 time (ms) | forward: 11.00 | "
        "backward: 21.00 | step: 6.00",
        bar,
        "[2024-01-01 00:00:02,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=2, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]",
    ]
    path = tmp_path / "train.log"
    path.write_bytes(newline.join(lines).encode() + newline.encode())
    imported = _parse(path)
    timers = imported.tables["step_timers"]
    assert timers.filter(pl.col("timer") == "forward").select("step", "line", "ms").rows() == [(0, 1, 10.0), (1, 2, 11.0)]
    assert imported.facts["log_last_line_rank0"]["line"] == 4
    assert path.read_bytes().split(b"\n")[3].startswith(lines[3].encode())  # grep's line 4


def test_verbose_comms_lines_of_deepspeed_0_7_to_0_11_are_read(tmp_path):
    """Those releases wrote "algbw (Gbps): {:.2f} " then " | busbw ...": two spaces before the bar (lines from
    DeepSpeed's comms-logging docs); they were dropped without an issue."""
    imported = _damaged_log(tmp_path, [
        "[2022-06-26 01:39:55,722] [INFO] [logging.py:69:log_dist] [Rank 0] rank=0 | comm op: reduce_scatter_tensor | "
        "time (ms): 9.46 | msg size: 678.86 MB | algbw (Gbps): 1204.52  | busbw (Gbps): 1129.23",
        "[2022-06-26 01:39:56,470] [INFO] [logging.py:69:log_dist] [Rank 0] rank=0 | comm op: all_gather_into_tensor | "
        "time (ms): 0.11 | msg size: 6.0 MB | algbw (Gbps): 954.41  | busbw (Gbps): 894.76"])
    calls = imported.tables["comms_calls"]
    assert calls.select("rank", "op", "latency_ns").rows() == [
        (0, "reduce_scatter_tensor", 9_460_000), (0, "all_gather_into_tensor", 110_000)]
    assert calls["msg_bytes"].to_list() == [int(678.86 * 1024**2), 6 * 1024**2]  # DeepSpeed's convert_size: powers of 1024


@pytest.mark.parametrize("megatron", ["1.1", "2.x"])
def test_deepspeeds_config_world_size_is_the_data_parallel_size_not_the_jobs(tmp_path, megatron):
    """Megatron-DeepSpeed on 64 GPUs with model parallelism: DeepSpeed's config print says world_size 16 (its
    data-parallel group), Megatron says 64 (lines of real 2021 Megatron-DeepSpeed logs). Megatron-LM before 2.0
    printed its iteration line from rank 0, from 2.0 on from the last rank (print_rank_last)."""
    world_line = ("using world size: 64 and model-parallel size: 4 " if megatron == "1.1" else
                  "using world size: 64, data-parallel-size: 16, tensor-model-parallel size: 4, pipeline-model-parallel size: 1 ")
    imported = _damaged_log(tmp_path, [
        world_line,
        "[2021-05-25 22:30:04,196] [INFO] [config.py:752:print]   world_size ................... 16",
        " iteration        1/    1000 | elapsed time per iteration (ms): 121899.8 | learning rate: 1.875E-05 | "
        "lm loss: 1.252221E+01 | loss scale: 1024.0 | number of skipped iterations:   0 | number of nan iterations:   0 |",
    ], name="megatron.out")
    assert (imported.facts["world_size"], imported.facts["dp_world_size"]) == (64, 16)
    scalars = imported.tables["scalars"].filter(pl.col("name") == "elapsed time per iteration (ms)")
    assert scalars.select("rank", "step", "value").rows() == [(0 if megatron == "1.1" else 63, 0, 121899.8)]


def test_deepspeeds_config_world_size_stands_where_nothing_else_gives_one(tmp_path):
    imported = _damaged_log(tmp_path, [
        "[2021-05-25 22:30:04,196] [INFO] [config.py:752:print]   world_size ................... 16",
        "[2021-05-25 22:30:05,000] [INFO] [logging.py:60:log_dist] [Rank 0] step=1, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]"])
    assert (imported.facts["world_size"], imported.facts["dp_world_size"]) == (16, 16)


def test_a_log_whose_first_record_follows_a_long_preamble_is_read(tmp_path):
    """A real Megatron-DeepSpeed job log began with 246 kB of `set -x` trace before DeepSpeed's first line,
    and was reported as nothing steplens reads."""
    preamble = "".join(f"+ export VAR_{i}=/some/long/path/to/a/module/{i}\n" for i in range(6000))
    assert len(preamble) > 250_000
    record = "[2021-05-27 21:32:10,180] [INFO] [logging.py:60:log_dist] [Rank 0] step=1, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]\n"
    log = tmp_path / "job-1999616.out"
    log.write_text(preamble + record)
    assert deepspeed_log.claims(log)
    assert _parse(log).tables["scalars"].filter(pl.col("name") == "lr")["value"].to_list() == [0.001]
    far = tmp_path / "notes.txt"
    far.write_text(preamble * 60 + record)  # a record past the 16 MiB looked into is not looked for
    assert far.stat().st_size > deepspeed_log.SNIFF_LIMIT_BYTES and not deepspeed_log.claims(far)


def test_two_engines_in_one_log_are_two_series(tmp_path):
    """DeepSpeed-Chat's RLHF step trains an actor and a critic in one process: each engine prints step=N (lines of
    a real log). The second line of a step is the second engine's; the throughput line after the actor's step
    line is the actor's; the batch size is not inferred from throughput (generation time sits between lines)."""
    step = "[2023-04-18 08:48:{}] [INFO] [logging.py:96:log_dist] [Rank 0] step={}, skipped={}, lr=[{}, {}], mom=[(0.9, 0.95)]"
    throughput = ("[2023-04-18 08:48:{}] [INFO] [timer.py:199:stop] epoch=0/micro_step={}/global_step={}, "
                  "RunningAvgSamplesPerSec=86.0, CurrSamplesPerSec={}, MemAllocated=10.77GB, MaxMemAllocated=20.55GB")
    imported = _damaged_log(tmp_path, [
        "[2023-04-18 08:48:00,000] [INFO] [launch.py:100:main] cmd = deepspeed main.py --per_device_training_batch_size 4",
        step.format("36,035", 10, 4, 5.79e-07, 5.79e-07), throughput.format("36,058", 10, 10, 78.9),
        step.format("36,251", 10, 3, 3.5e-07, 3.5e-07),
        step.format("52,035", 20, 4, 6.0e-07, 6.0e-07), throughput.format("52,058", 20, 20, 80.1),
        step.format("52,251", 20, 3, 4.0e-07, 4.0e-07)], name="rlhf.log")
    series = {name: frame.sort("step").select("step", "value").rows()
              for (name,), frame in imported.tables["scalars"].group_by("name")}
    assert series["lr"] == [(9, 5.79e-07), (19, 6.0e-07)] and series["engine1/lr"] == [(9, 3.5e-07), (19, 4.0e-07)]
    assert series["skipped_steps"] == [(9, 4.0), (19, 4.0)] and series["engine1/skipped_steps"] == [(9, 3.0), (19, 3.0)]
    assert series["CurrSamplesPerSec"] == [(9, 78.9), (19, 80.1)] and "engine1/CurrSamplesPerSec" not in series
    assert [(n, "engine1/<name>" in detail) for _, reason, n, detail in imported.issues if reason == "several_engines"] == [(2, True)]
    assert "train_batch_size" not in imported.facts


def test_megatron_timer_lines_are_interval_means_on_the_iteration_before_them(tmp_path):
    """Megatron's training_log prints the iteration line, then "time (ms) | ..." (no rank prefix) with each timer
    divided by the logging interval (lines of a real Megatron-DeepSpeed MoE log). They are not DeepSpeed's global
    timers: forward + backward here is no step time."""
    imported = _damaged_log(tmp_path, [
        "using world size: 8, data-parallel-size: 8, tensor-model-parallel size: 1, pipeline-model-parallel size: 1 ",
        " iteration       10/    1000 | consumed samples:         2560 | elapsed time per iteration (ms): 1001.5 |",
        "time (ms) | forward-compute: 340.72 | backward-compute: 176.25 | optimizer: 313.71 | batch-generator: 42.49",
        " iteration       20/    1000 | consumed samples:         5120 | elapsed time per iteration (ms): 990.0 |",
        "time (ms) | forward: 35255.98 | backward: 90266.11 | batch generator: 1.50"], name="megatron.log")
    timers = imported.tables["step_timers"].select("rank", "step", "scope", "timer", "ms").rows()
    assert timers == [(7, 9, "megatron_interval", "forward-compute", 340.72), (7, 9, "megatron_interval", "backward-compute", 176.25),
                      (7, 9, "megatron_interval", "optimizer", 313.71), (7, 9, "megatron_interval", "batch-generator", 42.49),
                      (7, 19, "megatron_interval", "forward", 35255.98), (7, 19, "megatron_interval", "backward", 90266.11),
                      (7, 19, "megatron_interval", "batch generator", 1.5)]


def test_the_throughput_lines_memory_figures_are_memory_usage_rows(tmp_path):
    """MemAllocated / MaxMemAllocated: the allocator's bytes / 1024**3 to 2 decimals; the running peak gives the
    run's peak memory where no see_memory_usage line does (a real DeepSpeed-Chat DPO log: 8.61 GB)."""
    throughput = ("[2025-01-02 15:50:0{}] [INFO] [timer.py:264:stop] epoch=0/micro_step={}/global_step={}, "
                  "RunningAvgSamplesPerSec=46.5, CurrSamplesPerSec=46.6, MemAllocated={}GB, MaxMemAllocated={}GB")
    imported = _damaged_log(tmp_path, [throughput.format("4,232", 20, 10, "5.25", "8.61"),
                                       throughput.format("5,232", 40, 20, "5.3", "8.61")])
    rows = imported.tables["memory_usage"].select("rank", "step", "origin", "allocated_bytes", "max_allocated_bytes",
                                                  "reserved_bytes", "resolution_bytes", "line").rows()
    assert rows == [(0, 9, "deepspeed_throughput", round(5.25 * 2**30), round(8.61 * 2**30), None, round(0.01 * 2**30), 1),
                    (0, 19, "deepspeed_throughput", round(5.3 * 2**30), round(8.61 * 2**30), None, round(0.01 * 2**30), 2)]


def test_log_importer_is_imported_only_for_a_file_with_a_log_suffix(tmp_path):
    """The registered log importer sniffs the same suffixes as deepspeed_log and claims what it claims; an
    analyze of traces alone never compiles the log regexes, an analyze of a run with logs reads them."""
    import subprocess

    assert telemetry.LOG_SUFFIXES == deepspeed_log.SUFFIXES
    log = _rank0_log("run1")
    (tmp_path / "notes.md").write_text(log.read_text()[:2000])  # a log's text under another suffix: not a log
    for path in (log, tmp_path / "notes.md", FIXTURES.parent / "tiny_trace.json"):
        if path.exists():
            assert telemetry.claims_log(path) == deepspeed_log.claims(path), path
    assert telemetry.claims_log(log) and not telemetry.claims_log(tmp_path / "notes.md")
    samples = Path(__file__).parent.parent / "sample_runs"
    script = ("import sys\nfrom steplens.analyze import cli\n"
              "sys.argv = ['analyze', sys.argv[1], '--out', sys.argv[2], '-q']\n"
              "try:\n    cli.analyze_entry()\nexcept SystemExit:\n    pass\n"
              "print('steplens.analyze.importers.deepspeed_log' in sys.modules)\n")
    seen = {}
    for run in ("synthetic_8rank", "deepspeed_cpu_2rank"):
        done = subprocess.run([sys.executable, "-c", script, str(samples / run), str(tmp_path / run)],
                              capture_output=True, text=True, timeout=300)
        seen[run] = done.stdout.splitlines()[-1:]
    assert seen == {"synthetic_8rank": ["False"], "deepspeed_cpu_2rank": ["True"]}
    sources = json.loads((tmp_path / "deepspeed_cpu_2rank" / "run.json").read_text())["sources"]
    assert [s["status"] for s in sources if s["kind"] == "deepspeed_log"] == ["ingested"] * 2


def test_an_issue_given_per_column_is_counted_once_per_file(tmp_path):
    """Step numbers past int64 in one real log give unrepresentable_value once per table column; the terminal said
    'in 3 files' for the one file."""
    from click.testing import CliRunner
    from steplens.analyze.cli import analyze

    (log,) = (RUNS / "run3" / "rank_logs").glob("*rank0.log")
    run = tmp_path / "run"
    run.mkdir()
    text = re.sub(r"\] step=(\d+),", r"] step=99999999999999999\1,", log.read_text())
    (run / "train_rank0.log").write_text(text)
    done = CliRunner().invoke(analyze, [str(run), "--ingest-only"])
    (line,) = [line for line in " ".join(done.output.split()).split("warning ") if line.startswith("unrepresentable_value")]
    assert " in 1 file; e.g. train_rank0.log:" in line
    issues = pl.read_parquet(run / ".steplens" / "ingest_issues").filter(pl.col("reason") == "unrepresentable_value")
    assert issues["file"].n_unique() == 1 and issues.height > 1  # several columns of one file


def test_a_traceback_the_collector_caught_is_not_the_jobs_failure():
    """A collector logged the exception it caught with its traceback: a rank log of a job that exited 0 then read
    as 'The job failed: RuntimeError: ...'. A traceback right after the collector's warning is not the job's."""
    (log,) = (RUNS / "run3" / "rank_logs").glob("*rank0.log")
    lines = log.read_text().splitlines()
    caught = ["[2026-11-29 13:01:59,100] [WARNING] steplens collector: timers disabled on rank 0 after RuntimeError: "
              "injected fault", "Traceback (most recent call last):", '  File "collector.py", line 166, in guard',
              "    return fn(*args)", "RuntimeError: injected fault"]
    at = len(lines) // 2
    damaged = "\n".join(lines[:at] + caught + lines[at:]) + "\n"
    import tempfile

    def statuses(text: str) -> list[tuple]:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / log.name
            path.write_text(text)
            table = deepspeed_log.parse(path, path.name).tables.get("run_status")
        return [] if table is None else table.select("status", "error").rows()

    assert statuses(damaged) == statuses(log.read_text())  # as if the collector had printed nothing
    crashed = statuses(damaged.replace("steplens collector:", "something else:"))
    assert crashed == [("failed", "RuntimeError: injected fault")]  # the same traceback on its own is the job's
