"""Which folders of a run directory are one job and which are separate runs (pipeline/runs.py), on copies of a
real 2-rank DeepSpeed job from ../shared: a damaged comms dump, or a job's log_summary text beside its rank
logs, must not split one job into one run per sub-folder."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from steplens.analyze.pipeline import ingest, runs

JOB = Path(__file__).resolve().parents[1].parent / "shared" / "deepspeed-cpu-runs" / "run3"


@pytest.fixture
def job(tmp_path) -> Path:
    if not (JOB / "comms" / "comms_dict_raw_rank0.json").is_file():
        pytest.skip(f"real run not found under {JOB}")
    copy = tmp_path / "job"
    shutil.copytree(JOB, copy)
    return copy


def _runs(root: Path) -> list[Path]:
    return [run.path for run in runs.split_runs(root, ingest.discover(root, None))]


def test_empty_comms_dumps_are_named_and_the_job_stays_one_run(job, tmp_path):
    for rank in (0, 1):
        (job / "comms" / f"comms_dict_raw_rank{rank}.json").write_text("[]")
    assert _runs(job) == [job]
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "steplens.analyze", str(job), "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 1, done.stderr  # partial: two inputs lost
    assert "holds" not in done.stdout.splitlines()[0]
    issues = pl.read_parquet(out / "ingest_issues")
    named = issues.filter(pl.col("reason") == "unexpected_layout")["file"].to_list()
    assert sorted(named) == ["comms/comms_dict_raw_rank0.json", "comms/comms_dict_raw_rank1.json"]


def test_a_log_summary_beside_the_rank_logs_is_one_job(job):
    """Without its dumps, comms/ holds only the log_summary text: a log, as rank_logs/ holds, but the job's
    other folders (csv_monitor, traces, ...) say it is one job's."""
    for dump in (job / "comms").glob("*.json"):
        dump.unlink()
    assert _runs(job) == [job]


def test_logs_only_folders_side_by_side_are_still_separate_runs(job, tmp_path):
    sweep = tmp_path / "sweep"
    for trial in ("a", "b"):
        shutil.copytree(job / "rank_logs", sweep / trial)
    assert _runs(sweep) == [sweep / "a", sweep / "b"]
