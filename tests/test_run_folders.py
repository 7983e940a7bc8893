"""Which folders of a run directory are one job and which are separate runs (pipeline/runs.py), on copies of a
real 2-rank DeepSpeed job from ../shared: a damaged comms dump, or a job's log_summary text beside its rank
logs, must not split one job into one run per sub-folder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from steplens.analyze.pipeline import ingest, runs

JOB = Path(__file__).resolve().parents[1].parent / "shared" / "deepspeed-cpu-runs" / "run3"


def _real_copy(source: Path, marker: str, copy: Path) -> Path:
    """A copy of a real run from ../shared (skipped where it is not), for a test to damage."""
    if not (source / marker).is_file():
        pytest.skip(f"real run not found under {source}")
    shutil.copytree(source, copy)
    return copy


@pytest.fixture
def job(tmp_path) -> Path:
    return _real_copy(JOB, "comms/comms_dict_raw_rank0.json", tmp_path / "job")


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


AUTOTUNE = JOB.parent / "autotune1"
SAMPLE = Path(__file__).resolve().parents[1] / "sample_runs" / "deepspeed_cpu_2rank"


def _analyze(run: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "steplens.analyze", str(run), *extra], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def autotuning(tmp_path) -> Path:
    return _real_copy(AUTOTUNE, "autotuning_results/summary.txt", tmp_path / "at")


def test_an_experiment_never_launched_keeps_the_autotuning_run_one_run(autotuning, tmp_path):
    """A spec in autotuning_exps/ without its result folder (the tuner stopped first) split the run into one per
    experiment folder (10 runs) and then ended in an internal error. It adds one not_run row, nothing else."""
    before = _analyze(autotuning, "--ingest-only", "--out", str(tmp_path / "before"))
    assert before.returncode in (0, 1), before.stderr
    read_before = set(pl.read_parquet(tmp_path / "before" / "autotune_experiments")["experiment"].to_list())
    spec = json.loads((autotuning / "autotuning_exps" / "z1_gas1_tmbspg8.json").read_text())
    spec["name"] = "z1_gas1_tmbspg9"
    (autotuning / "autotuning_exps" / "z1_gas1_tmbspg9.json").write_text(json.dumps(spec))
    assert _runs(autotuning) == [autotuning]
    done = _analyze(autotuning)
    assert done.returncode in (0, 1), done.stderr
    experiments = pl.read_parquet(autotuning / ".steplens" / "autotune_experiments")
    assert experiments.filter(pl.col("experiment") == "z1_gas1_tmbspg9")["status"].to_list() == ["not_run"]
    assert set(experiments["experiment"].to_list()) == read_before | {"z1_gas1_tmbspg9"} and len(read_before) >= 6


def test_an_autotuning_run_without_its_summary_is_analysed(autotuning):
    """A tuner killed before it wrote summary.txt: no pick to check, the rest ranked (an internal error before)."""
    (autotuning / "autotuning_results" / "summary.txt").unlink()
    done = _analyze(autotuning)
    assert done.returncode in (0, 1), done.stderr
    verdicts = pl.read_parquet(autotuning / ".steplens" / "autotune_verdict")
    assert verdicts.height and verdicts["pick_detail"].null_count() == verdicts.height


def test_a_byte_copy_of_a_trace_beside_the_job_is_a_duplicate_not_another_run(tmp_path):
    """A backup copy of a rank's trace in a sibling folder split the job into 12 runs (the collector cut into one
    per table); it is now one run whose copy is named (duplicate_rank) and left out of the tables and counts."""
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns(".steplens"))
    (original,) = (run / "traces").glob("rank0.*")
    (run / "traces_backup").mkdir()
    shutil.copy(original, run / "traces_backup" / original.name)
    assert _runs(run) == [run]
    done = _analyze(run)
    assert done.returncode == 1, done.stderr
    assert " ".join(done.stdout.split()).startswith("2 trace file(s)")
    issues = pl.read_parquet(run / ".steplens" / "ingest_issues")
    assert issues.filter(pl.col("reason") == "duplicate_rank")["file"].to_list() == [f"traces_backup/{original.name}"]


def test_a_split_job_keeps_its_collector_whole(tmp_path):
    """Two different traces of rank 0 side by side are two runs; the collector's tables beside them stay one run
    (each table folder was made a run of its own, with a .steplens inside the collector's folder)."""
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns(".steplens"))
    (other,) = (run / "traces").glob("rank1.*")
    (run / "traces_other").mkdir()
    shutil.copy(other, run / "traces_other" / other.name.replace("rank1", "rank0"))
    found = _runs(run)
    assert run / "collector" in found and not [p for p in found if run / "collector" in p.parents]


def test_a_folder_of_runs_in_markdown_is_each_runs_summary(tmp_path):
    """--format md on a folder of runs printed the text listing; it prints each run's summary.md (for a PR)."""
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        shutil.copytree(SAMPLE, runs / name, ignore=shutil.ignore_patterns(".steplens"))
    done = _analyze(runs, "--format", "md")
    assert done.returncode == 0, done.stderr
    for name in ("a", "b"):
        summary = (runs / name / ".steplens" / "summary.md").read_text()
        assert summary.strip() in done.stdout
    assert "input(s), ranks" not in done.stdout


def test_a_sub_folder_past_the_path_limit_costs_what_it_holds(tmp_path):
    """A sub-folder whose path is past PATH_MAX (4096) ended the whole run with 'cannot list the folder' (exit 2)."""
    import os

    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns(".steplens"))
    fd = os.open(run, os.O_RDONLY)
    for _ in range(20):  # 20 names of 250 characters: past 4096 in all
        os.mkdir("x" * 250, dir_fd=fd)
        inner = os.open("x" * 250, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    done = _analyze(run, "--ingest-only")
    assert done.returncode == 1, done.stderr
    issues = pl.read_parquet(run / ".steplens" / "ingest_issues").filter(pl.col("reason") == "unreadable")
    assert issues.height == 1 and "cannot be listed" in issues["detail"][0]
    pristine = tmp_path / "pristine"
    shutil.copytree(SAMPLE, pristine, ignore=shutil.ignore_patterns(".steplens"))
    assert _analyze(pristine, "--ingest-only").returncode == 0

    def ingested(folder: Path) -> list[str]:
        sources = json.loads((folder / ".steplens" / "run.json").read_text())["sources"]
        return sorted(s["path"] for s in sources if s["status"] == "ingested")

    assert ingested(run) == ingested(pristine) and len(ingested(run)) > 30  # every other input still read
