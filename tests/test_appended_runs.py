"""Several jobs appended to one launcher log are separate runs (issue 12), on two real DeepSpeed-Chat logs
from ../shared concatenated into one file: each run read alone gives what its own file gives, and nothing
of the other job."""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl
import pytest
from steplens.analyze.importers import deepspeed_log
from steplens.analyze.pipeline import ingest, runs

CHAT = Path(__file__).resolve().parents[1].parent / "shared" / "corpus" / "DeepSpeedExamples"
LOGS = [CHAT / "deepspeed_chat_step1_sft" / "opt-1.3b-globalBatchSize128.log",
        CHAT / "deepspeed_chat_step2_reward" / "opt-350m_globalBatchSize-64.log"]
THROUGHPUT = re.compile(r"RunningAvgSamplesPerSec=")


@pytest.fixture
def appended(tmp_path) -> Path:
    if not all(log.is_file() for log in LOGS):
        pytest.skip(f"corpus logs not found under {CHAT}")
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "train.log").write_bytes(b"".join(log.read_bytes() for log in LOGS))  # `>> train.log`, twice
    return folder


def test_the_runs_of_an_appended_log_are_read_apart(appended):
    log = appended / "train.log"
    lengths = [len(path.read_text(errors="replace").splitlines()) for path in LOGS]
    assert deepspeed_log.run_spans(log) == [(1, lengths[0]), (lengths[0] + 1, lengths[0] + lengths[1])]
    for index, original in enumerate(LOGS):
        alone = deepspeed_log.parse(original, original.name)
        part = deepspeed_log.parse(log, log.name, run_index=index)
        # Throughput lines of that job only, counted in the original file without steplens.
        lines = sum(bool(THROUGHPUT.search(line)) for line in original.read_text(errors="replace").splitlines())
        scalars = part.tables["scalars"]
        assert scalars.filter(pl.col("name") == "RunningAvgSamplesPerSec").height == lines
        assert scalars.drop("source").equals(alone.tables["scalars"].drop("source"))
        assert part.facts["train_batch_size"] == alone.facts["train_batch_size"] == (128, 64)[index]
        assert part.facts["log_run"] == {"index": index, "runs_in_file": 2, "first_line": 1 + sum(lengths[:index]),
                                         "last_line": sum(lengths[:index + 1])}
    whole = deepspeed_log.parse(log, log.name)
    assert whole.facts["runs_in_file"] == 2


def test_an_appended_log_becomes_two_runs_each_ingested_alone(appended, tmp_path):
    found = ingest.discover(appended, appended / ".steplens")
    (one,) = runs.split_runs(appended, found)
    parts = runs.split_appended_logs([one])
    assert [run.log_run for run in parts] == [0, 1]
    assert parts[0].name.startswith("train.log run 1 of 2 (lines 1-")
    for run, original in zip(parts, LOGS):
        result = ingest.ingest(run.path, tmp_path / f"out{run.log_run}", jobs=1, found=run.found)
        facts = result.manifest["facts"]
        assert facts["log_run"]["index"] == run.log_run and "runs_in_file" not in facts
        scalars = pl.read_parquet(result.out_dir / "scalars")
        alone = deepspeed_log.parse(original, original.name).tables["scalars"]
        assert scalars.height == alone.height


def test_analyze_reports_each_appended_job_apart(appended):
    """Through the command line: one line per job, each with its own output folder and its own
    throughput rows, counted in the original logs without steplens."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "steplens.analyze", str(appended)], capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert f"{appended} holds 2 runs" in done.stdout
    for index, original in enumerate(LOGS):
        out = appended / f".steplens-run{index + 1}"
        expected = sum(bool(THROUGHPUT.search(line)) for line in original.read_text(errors="replace").splitlines())
        scalars = pl.read_parquet(out / "scalars")
        assert scalars.filter(pl.col("name").str.contains("RunningAvgSamplesPerSec")).height == expected
        assert json.loads((out / "run.json").read_text())["created_by"].startswith("steplens")
