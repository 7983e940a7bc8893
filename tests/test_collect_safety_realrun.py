"""The collector's safety on real 2-rank DeepSpeed CPU jobs (gloo, DS_ACCELERATOR=cpu, OMP_NUM_THREADS=1).

  sigterm    ZeRO-2, many steps; once both ranks are past step 4, every rank gets SIGTERM from outside (as a
             scheduler sends it); the script also logs values that are not numbers and NaN/inf each step
  read_only  the collector's run_dir is read-only: the job runs to the end without it
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from steplens.analyze.pipeline import ingest

sys.path.insert(0, str(Path(__file__).parent / "realrun"))
from read_only import read_only_dir  # noqa: E402  (the path is set just above)

RANKS = 2
TERM_AFTER_STEP = 4  # SIGTERM once both ranks finished this step
MAX_STEPS = 400  # never reached: the job is stopped long before


def script_steps(run: Path, rank: int) -> list[dict]:
    path = run / "script" / f"rank{rank}.steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


@pytest.fixture(scope="session")
def sigterm_run(tmp_path_factory) -> Path:
    pytest.importorskip("deepspeed")
    psutil = pytest.importorskip("psutil")
    from launch import command, cpu_env

    run = tmp_path_factory.mktemp("sigterm_run")
    cmd = command(run, ("--zero_stage", "2", "--steps", str(MAX_STEPS), "--flush_every", "3", "--profile_window", "off",
                        "--flops_step", "-1", "--log_odd_values"))
    with open(run / "launcher.log", "wb") as log:
        launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cpu_env(), cwd=run,
                                    start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while not all(len(script_steps(run, r)) > TERM_AFTER_STEP for r in range(RANKS)):
                assert launcher.poll() is None and time.monotonic() < deadline, (run / "launcher.log").read_text()[-3000:]
                time.sleep(0.2)
            workers = [p for p in psutil.Process(launcher.pid).children(recursive=True)  # not the launchers
                       if any(part.startswith("--local_rank") for part in p.cmdline())]
            assert len(workers) == RANKS
            for worker in workers:
                worker.send_signal(signal.SIGTERM)
            psutil.wait_procs(workers, timeout=120)
            launcher.wait(timeout=120)
        finally:
            if launcher.poll() is None:  # a failed test leaves no job behind
                os.killpg(launcher.pid, signal.SIGKILL)
    # A rank died of the signal, as it would have without the collector (the handler passes it on); the
    # launcher reports the first one it sees and stops the other.
    assert f"exits with return code = -{int(signal.SIGTERM)}" in (run / "launcher.log").read_text()
    return run


def test_sigterm_flushes_every_finished_step_and_marks_the_manifest(sigterm_run):
    result = ingest.ingest(sigterm_run, jobs=1)
    steps = pl.read_parquet(result.out_dir / "train_steps").filter(pl.col("source").str.starts_with("collector/"))
    status = pl.read_parquet(result.out_dir / "run_status").filter(pl.col("source").str.starts_with("collector/"))
    for rank in range(RANKS):
        manifest = json.loads((sigterm_run / "collector" / "manifest" / f"rank{rank}.json").read_text())
        assert manifest["status"] == "terminated"
        mine = steps.filter(pl.col("rank") == rank).sort("step")
        # Every step the script saw finish is in the collector's tables; the signal may have come between
        # the end of an optimizer step and the script's own line for it (one step more), never later.
        script = [s["step"] for s in script_steps(sigterm_run, rank)]
        assert mine["step"].to_list() == list(range(mine.height)) and mine.height == manifest["steps_completed"]
        assert script == list(range(len(script))) and len(script) <= mine.height <= len(script) + 1
        assert len(script) > TERM_AFTER_STEP
        by_step = {s["step"]: s["global_samples"] for s in script_steps(sigterm_run, rank)}
        assert all(mine.filter(pl.col("step") == k)["global_samples"].item() == v for k, v in by_step.items())
        assert manifest["last_flushed_step"] == mine.height - 1
        (row,) = status.filter(pl.col("rank") == rank).rows(named=True)
        assert row["status"] == "killed" and "SIGTERM" in row["detail"]
    issues = pl.read_parquet(result.out_dir / "ingest_issues")
    assert issues.filter(pl.col("reason") == "collector_missing_tail").is_empty()


def test_values_that_are_not_numbers_are_counted_and_nonfinite_ones_kept(sigterm_run):
    """Each step logged test/text = 'n/a' and test/none = None (dropped, counted) and test/nonfinite = nan,
    inf, -inf in turn (kept). Rank 0 writes scalars."""
    manifest = json.loads((sigterm_run / "collector" / "manifest" / "rank0.json").read_text())
    logged_steps = len(script_steps(sigterm_run, 0))  # the script logs before writing its line
    assert manifest["rejected_values"]["test/text"] in (logged_steps, logged_steps + 1)
    assert manifest["rejected_values"]["test/none"] == manifest["rejected_values"]["test/text"]
    assert "scalars" not in manifest["disabled"]
    result = ingest.ingest(sigterm_run, jobs=1)
    scalars = pl.read_parquet(result.out_dir / "scalars").filter(pl.col("origin") == "collector")
    odd = scalars.filter(pl.col("name") == "test/nonfinite").sort("step")
    expected = [(math.nan, math.inf, -math.inf)[s % 3] for s in odd["step"]]
    assert odd["step"].to_list() == list(range(manifest["rejected_values"]["test/text"]))
    assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(odd["value"], expected))
    assert scalars.filter(pl.col("name") == "train/loss").height == odd.height
    assert scalars.filter(pl.col("name").is_in(["test/text", "test/none"])).is_empty()


def test_a_read_only_run_dir_does_not_stop_the_job(tmp_path):
    pytest.importorskip("deepspeed")
    from launch import run_tiny_gpt

    steps = 3
    with read_only_dir(tmp_path / "ro") as read_only:
        run = run_tiny_gpt(tmp_path / "job", "--zero_stage", "2", "--steps", str(steps), "--profile_window", "off",
                           "--flops_step", "1", "--collector_run_dir", str(read_only / "exp"))
        assert not list(read_only.iterdir())
    for rank in range(RANKS):
        record = json.loads((run / "script" / f"rank{rank}.json").read_text())
        assert [s["step"] for s in record["steps"]] == list(range(steps))
        assert all(math.isfinite(s["global_samples"]) for s in record["steps"])
        rank_log = (run / "rank_logs").glob(f"*rank{rank}*")
        text = "".join(p.read_text(errors="replace") for p in rank_log)
        assert text.count("steplens collector: not attached") == 1, text[-3000:]
