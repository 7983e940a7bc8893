"""Checkpoint-save steps (issue 12) on a real 2-rank DeepSpeed CPU job that calls engine.save_checkpoint after
optimizer step SAVE_AFTER: the collector (its wrapped save_checkpoint) and the DeepSpeed log lines both
record the step that follows the save, and the step-time summary leaves it out and names it."""

from __future__ import annotations

import json
import re
import shutil
import statistics
import sys
from pathlib import Path

import pytest
from test_step_time import TIMER_LINE, analyse, collector_step_times, warm_up
from steplens.analyze.importers import deepspeed_log

STEPS, SAVE_AFTER = 16, 7


@pytest.fixture(scope="module")
def checkpoint_run(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    sys.path.insert(0, str(Path(__file__).parent / "realrun"))
    from launch import run_tiny_gpt

    return run_tiny_gpt(tmp_path_factory.mktemp("checkpoint") / "job", "--steps", str(STEPS), "--profile_window", "off",
                        "--flops_step", "-1", "--wall_clock_breakdown", "--log_level", "info", "--steps_per_print", "1",
                        "--save_checkpoint_at", str(SAVE_AFTER))


def saved_before_step(run: Path) -> int:
    """From the script's own record: engine.global_steps after loop step SAVE_AFTER, when it saved."""
    return json.loads((run / "script" / "rank0.json").read_text())["steps"][SAVE_AFTER]["global_steps"]


def test_the_log_and_the_collector_record_the_step_after_the_save(checkpoint_run):
    step = saved_before_step(checkpoint_run)
    assert step == SAVE_AFTER + 1 and (checkpoint_run / "checkpoints" / f"global_step{step}").is_dir()
    (log,) = (checkpoint_run / "rank_logs").glob("*rank0.log")  # --enable_each_rank_log: rank 0's output
    assert f"[Rank 0] [Torch] Checkpoint global_step{step} is about to be saved!" in log.read_text()
    assert deepspeed_log.parse(log, log.name).facts["checkpoint_steps"] == [step]
    for rank in (0, 1):
        manifest = json.loads((checkpoint_run / "collector" / "manifest" / f"rank{rank}.json").read_text())
        assert manifest["run"]["checkpoint_steps"] == [step]


def test_the_step_after_the_save_is_left_out_of_the_summary_and_named(checkpoint_run, tmp_path):
    step = saved_before_step(checkpoint_run)
    findings, lines = analyse(checkpoint_run, tmp_path / "out")
    times = collector_step_times(checkpoint_run)  # cycles: the save, before step `step`, is in its cycle
    warm = warm_up(times, {step})
    kept = sorted(t for s, t in times.items() if s not in warm | {step} and t is not None)
    block = findings["step_time"]
    assert block["source"] == "train_steps" and block["median_ns"] == round(statistics.median(kept))
    assert {"reason": "checkpoint_save", "count": 1, "steps": [step]} in [
        {k: e[k] for k in ("reason", "count", "steps")} for e in block["excluded_steps"]]
    line = next(line for line in lines if line.startswith("Step time:"))
    assert f"checkpoint save step {step}" in line


def test_logs_only_the_save_is_left_out_too(checkpoint_run, tmp_path):
    step = saved_before_step(checkpoint_run)
    shutil.copytree(checkpoint_run / "rank_logs", tmp_path / "run" / "rank_logs")
    shutil.copy(checkpoint_run / "launcher.log", tmp_path / "run" / "launcher.log")
    findings, lines = analyse(tmp_path / "run", tmp_path / "out")
    # Step time per step from the timer lines (fwd + bwd + step, slowest rank), read here without steplens.
    per_rank: dict[int, list[float]] = {}
    for log in sorted((tmp_path / "run" / "rank_logs").glob("*.log")):
        for text in log.read_text().splitlines():
            if m := TIMER_LINE.search(text):
                per_rank.setdefault(int(m[1]), []).append(sum(float(x) for x in m.group(2, 3, 4)))
    assert all(len(v) == STEPS for v in per_rank.values())
    block = findings["step_time"]
    assert block["source"] == "log"
    assert {"reason": "checkpoint_save", "count": 1, "steps": [step]} in [
        {k: e[k] for k in ("reason", "count", "steps")} for e in block["excluded_steps"]]
    excluded = {s for e in block["excluded_steps"] for s in e["steps"]}
    kept = sorted(max(v[s] for v in per_rank.values()) for s in range(STEPS) if s not in excluded)
    assert block["median_ns"] == pytest.approx(statistics.median(kept) * 1e6, abs=1)
    assert any(re.search(rf"checkpoint save step {step}\b", line) for line in lines)
