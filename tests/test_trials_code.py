"""`steplens trials` keeps runs of other code apart (issue 12): the same ds_config on another git revision
or other library versions is another configuration, and the output says so. The git revision the collector
records, inside a repository and outside one."""

from __future__ import annotations

import subprocess

import polars as pl
from steplens.analyze.analyses import trials
from steplens.collect import environment

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2}}


def steps(step_ms: list[float], samples: int = 8) -> pl.DataFrame:
    """A step_time table as `steplens trials` reads it: every step kept, `samples` per step."""
    return pl.DataFrame({"step": range(len(step_ms)), "step_time_ns": [int(ms * 1e6) for ms in step_ms],
                         "samples": [samples] * len(step_ms), "excluded": [False] * len(step_ms)})


def facts(commit: str | None, deepspeed: str = "0.18.4", run_dir: str = "/runs/x") -> dict:
    return {"world_size": 2, "ds_config": {**CONFIG, "steplens": {"run_dir": run_dir}},
            "git": None if commit is None else {"commit": commit, "dirty": False, "repo": "/src"},
            "environment": {"steplens": "0.1.0", "deepspeed": deepspeed, "torch": "2.5.1"}}


def test_runs_of_other_code_are_other_configurations_and_the_output_says_so():
    runs = {f"a{i}": (steps([100 + i, 101, 99]), facts("aaaa111", run_dir=f"/runs/a{i}")) for i in range(4)}
    runs |= {f"b{i}": (steps([90 + i, 91, 89]), facts("bbbb222", run_dir=f"/runs/b{i}")) for i in range(4)}
    result = trials.trials(runs)
    by_commit = {c["code"]["git_commit"]: c for c in result["configurations"]}
    assert sorted(by_commit) == ["aaaa111", "bbbb222"]
    assert sorted(by_commit["aaaa111"]["runs"]) == [f"a{i}" for i in range(4)]
    assert sorted(by_commit["bbbb222"]["runs"]) == [f"b{i}" for i in range(4)]
    (split,) = result["code_splits"]
    # Named by each configuration's first run, in rank order (b's steps are shorter: more samples/s).
    assert split == ("b0, a0 have the same settings but other code (git_commit: bbbb222 vs aaaa111): kept apart, "
                     "not trials of one configuration")
    assert split in result["ignored_rule"]


def test_same_code_groups_and_a_version_change_splits():
    same = {f"r{i}": (steps([100, 101, 99]), facts("c0ffee", run_dir=f"/runs/r{i}")) for i in range(3)}
    result = trials.trials(same)
    assert len(result["configurations"]) == 1 and result["code_splits"] == []
    assert result["configurations"][0]["code"] == {"git_commit": "c0ffee", "git_dirty": False, "steplens": "0.1.0",
                                                   "deepspeed": "0.18.4", "torch": "2.5.1"}
    upgraded = {**same, "r9": (steps([100, 101, 99]), facts("c0ffee", deepspeed="0.19.0", run_dir="/runs/r9"))}
    result = trials.trials(upgraded)
    assert len(result["configurations"]) == 2
    (split,) = result["code_splits"]
    assert "deepspeed: " in split and "0.19.0" in split and "git_commit" not in split


def test_a_log_only_run_gives_its_versions_from_the_log_facts():
    assert trials.code_identity({"deepspeed_version": "0.9.1", "torch_version": "1.13.1"}) == {
        "deepspeed": "0.9.1", "torch": "1.13.1"}
    assert trials.code_identity({}) == {}


def test_git_revision_in_a_repository_and_outside_one(tmp_path):
    assert environment.git_revision(tmp_path) is None  # not a repository: no record, no exception
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "train.py").write_text("print(1)\n")
    subprocess.run([*git, "add", "train.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert environment.git_revision(repo) == {"commit": head, "dirty": False, "repo": str(repo.resolve())}
    (repo / "train.py").write_text("print(2)\n")
    assert environment.git_revision(repo)["dirty"] is True
