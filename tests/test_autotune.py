"""Autotuner results: the real autotune1 run in ../shared, hand-made failed experiments, and the
noise verdict on synthetic repeated trials with known separation."""

import json
import re
import shutil
from pathlib import Path

import polars as pl
import pytest
from steplens.analyze import analyses
from steplens.analyze.analyses import autotune
from steplens.analyze.importers import autotune_results
from steplens.analyze.importers import telemetry
from steplens.analyze.analyses import step_time
from steplens.analyze.analyses import trials as trial_runs
from steplens.analyze.importers.base import conform

RUNS = Path(__file__).resolve().parents[1].parent / "shared" / "deepspeed-cpu-runs"
CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpus"


def autotune1() -> Path:
    path = RUNS / "autotune1"
    if not path.is_dir():
        pytest.skip(f"shared autotune run not found at {path}")
    return path


def import_folder(base: Path) -> tuple[pl.DataFrame, dict, list, set]:
    """What ingest does: offer every file to the importers in order, companions taken with their claimant."""
    frames, facts, issues, taken = [], {}, [], set()
    for path in sorted(p for p in base.rglob("*") if p.is_file()):
        if path in taken or (importer := telemetry.claimant(path)) is None:
            continue
        taken.update([path, *importer.companions(path)])
        if not importer.name.startswith("autotune"):  # the launcher's log etc. are other importers' business
            continue
        result = importer.parse(path, str(path.relative_to(base)))
        facts.update(result.facts)
        issues.extend(result.issues)
        if "autotune_experiments" in result.tables:
            frames.append(result.tables["autotune_experiments"])
    return pl.concat(frames), facts, issues, taken


def test_autotune1_every_experiment_read_with_its_files():
    base = autotune1()
    experiments, facts, issues, taken = import_folder(base)
    result_dirs = {p.name for p in (base / "autotuning_results").iterdir() if p.is_dir()} - {"profile_model_info"}
    assert set(experiments["experiment"]) == result_dirs and issues == []
    assert (experiments["status"] == "ok").all()
    specs = {p for p in (base / "autotuning_exps").iterdir()}
    assert specs <= taken  # specs of experiments that ran are read with their result folder
    for name in result_dirs:  # all of an experiment's files are read as one unit
        assert {p.name for p in (base / "autotuning_results" / name).iterdir()} <= {p.name for p in taken if p.parent.name == name}
    assert facts["autotune_metric"] == "throughput"
    assert facts["autotune_model_info"]["num_params"] == 932608
    assert facts["autotune_summary"]["total_experiments"] == 8


def test_autotune1_metrics_are_microseconds():
    """latency = (fwd + bwd + step) x gas and throughput = train_batch_size x 1e6 / latency: both hold
    only if the times are microseconds."""
    experiments, *_ = import_folder(autotune1())
    for row in experiments.iter_rows(named=True):
        config = json.loads(row["config_json"])
        assert row["latency_us"] == pytest.approx((row["fwd_us"] + row["bwd_us"] + row["step_us"]) * row["grad_accum"])
        assert row["throughput"] == pytest.approx(config["train_batch_size"] * 1e6 / row["latency_us"])


def test_autotune1_stale_metric_pick_is_detected():
    base = autotune1()
    # Ground truth straight from the files: each experiment's own metrics.json, and summary.txt's rows.
    own = {d.name: json.loads((d / "metrics.json").read_text())["throughput"]
           for d in (base / "autotuning_results").iterdir() if (d / "metrics.json").exists()}
    rows = [line.strip("|").split("|") for line in (base / "autotuning_results/summary.txt").read_text().splitlines()
            if line.startswith(("| z", "| global"))]
    picked = {cells[0].strip(): cells[3].strip() for cells in rows}
    best_z1 = max((n for n in own if n.startswith("z1_")), key=own.get)
    assert picked["z1"] != best_z1  # DeepSpeed's z1 pick is not the best measured one

    experiments, facts, *_ = import_folder(base)
    verdicts = {r["tuning_space"]: r for r in autotune.autotune_tables(experiments, facts)["autotune_verdict"].iter_rows(named=True)}
    z1 = verdicts["z1"]
    assert z1["winner"] == best_z1 and z1["deepspeed_pick"] == picked["z1"] and z1["pick_mismatch"] is True
    assert picked["z1"] in z1["pick_detail"] and best_z1 in z1["pick_detail"]
    global_best = max(own, key=own.get)
    assert verdicts["global"]["winner"] == global_best == picked["global"]
    assert verdicts["global"]["pick_mismatch"] is False and verdicts["z2"]["pick_mismatch"] is False


def test_autotune1_single_measurements_do_not_establish_a_ranking():
    experiments, facts, *_ = import_folder(autotune1())
    tables = autotune.autotune_tables(experiments, facts)
    for row in tables["autotune_verdict"].iter_rows(named=True):
        assert row["established"] is not True  # DeepSpeed measured every config once
        if row["runner_up"] is not None:
            assert row["trials_needed"] == autotune.min_trials() == 4 and "not established" in row["detail"]
            # the gap in the metric's own terms (it read 'the 106.8 gap')
            gap = abs(row["winner_median"] - row["runner_up_median"])
            unit = " samples/s" if row["metric"] == "throughput" else f" {row['metric']}"
            assert f"so the {gap:.4g}{unit} gap (" in row["detail"]
    assert tables["autotune_verdict"]["same_environment"].all()
    for table in ("autotune_ranking", "autotune_verdict"):
        assert set(tables[table].columns) == set(analyses.TABLES[table][1])


def test_environment_difference_is_reported(tmp_path):
    copy = tmp_path / "autotune1"
    shutil.copytree(autotune1(), copy)
    cmd = copy / "autotuning_results/z1_gas1_tmbspg7/cmd.txt"
    cmd.write_text(cmd.read_text().replace("--steps 20", "--steps 30"))
    experiments, facts, *_ = import_folder(copy)
    tables = autotune.autotune_tables(experiments, facts)
    ranking = tables["autotune_ranking"].filter(pl.col("tuning_space") == "global")
    assert ranking.filter(pl.col("environment_differs"))["experiment"].to_list() == ["z1_gas1_tmbspg7"]
    verdicts = {r["tuning_space"]: r for r in tables["autotune_verdict"].iter_rows(named=True)}
    assert verdicts["global"]["same_environment"] is False and "z1_gas1_tmbspg7" in verdicts["global"]["environment_detail"]
    assert verdicts["z2"]["same_environment"] is True


@pytest.mark.parametrize(("stderr", "status", "error"), [
    ("Traceback (most recent call last):\n  File \"t.py\", line 3\n"
     + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n", "oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    ("    raise RuntimeError(f\"[simulated] CPU out of memory: mbs {mbs}\")\n"
     + "RuntimeError: [simulated] CPU out of memory: mbs 6\n", "oom", "RuntimeError: [simulated] CPU out of memory: mbs 6"),
    ("warn: x is deprecated\nTraceback (most recent call last):\nKeyError: 'hostfile'\n", "error", "KeyError: 'hostfile'"),
    ("Traceback (most recent call last):\n  File \"t.py\", line 9\nKeyboardInterrupt\n", "interrupted", "KeyboardInterrupt"),
    ("FutureWarning: something is deprecated\n", "interrupted", None),
    (None, "not_run", None),
])
def test_failed_experiment_classified_from_stderr(tmp_path, stderr, status, error):
    folder = tmp_path / "autotuning_results" / "z3_gas1_tmbspg9"
    folder.mkdir(parents=True)
    ds_config = {"train_micro_batch_size_per_gpu": 9, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}
    (folder / "exp.json").write_text(json.dumps({"name": folder.name, "ds_config": ds_config, "num_gpus": 8}))
    if stderr is not None:
        (folder / "stderr.log").write_text(stderr)
    assert telemetry.claimant(folder / "exp.json").name == "autotune_experiment"
    row = autotune_results.parse_experiment(folder / "exp.json", "exp.json").tables["autotune_experiments"].row(0, named=True)
    assert row["status"] == status and row["zero_stage"] == 3 and row["micro_batch"] == 9
    if error:
        assert row["error"] == error
    assert row["throughput"] is None


def test_spec_without_result_folder_is_not_run(tmp_path):
    exps = tmp_path / "autotuning_exps"
    exps.mkdir()
    spec = {"name": "z2_gas1_tmbspg4", "ds_config": {"train_micro_batch_size_per_gpu": 4}, "num_gpus": 2}
    (exps / "z2_gas1_tmbspg4.json").write_text(json.dumps(spec))
    (exps / "z2_gas1_tmbspg2.json").write_text(json.dumps({**spec, "name": "z2_gas1_tmbspg2"}))
    (tmp_path / "autotuning_results" / "z2_gas1_tmbspg2").mkdir(parents=True)
    (tmp_path / "autotuning_results" / "z2_gas1_tmbspg2" / "exp.json").write_text(json.dumps(spec))
    assert telemetry.claimant(exps / "z2_gas1_tmbspg4.json").name == "autotune_experiment"
    assert telemetry.claimant(exps / "z2_gas1_tmbspg2.json") is None  # its result folder is read instead
    row = autotune_results.parse_experiment(exps / "z2_gas1_tmbspg4.json", "spec").tables["autotune_experiments"].row(0, named=True)
    assert row["status"] == "not_run" and row["experiment"] == "z2_gas1_tmbspg4"


def test_bad_files_give_issues_not_exceptions(tmp_path):
    folder = tmp_path / "z1_gas1_tmbspg2"
    folder.mkdir()
    (folder / "exp.json").write_text('{"ds_config": {"train_micro_batch_size_per_gpu": 2}, "name": "z1_gas1_tmbspg2"}')
    (folder / "metrics.json").write_bytes(b'{"throughput": 7\x00\xff')
    (folder / "stderr.log").write_text("RuntimeError: boom\n")
    result = autotune_results.parse_experiment(folder / "exp.json", "z1_gas1_tmbspg2/exp.json")
    assert result.tables["autotune_experiments"]["status"].to_list() == ["error"]
    assert result.issues[0][:2] == ["error", "bad_autotune_file"] and "metrics.json" in result.issues[0][3]
    junk = tmp_path / "exp.json"
    junk.write_bytes(b'\x00\x01"ds_config" garbage')
    bad = autotune_results.parse_experiment(junk, "exp.json")
    assert bad.tables == {} and bad.issues[0][:2] == ["error", "bad_autotune_experiment"]
    empty_summary = tmp_path / "summary.txt"
    empty_summary.write_text("| tuning_space | x |\n")
    assert autotune_results.parse_summary(empty_summary, "summary.txt").issues[0][1] == "bad_autotune_summary"
    assert autotune.autotune_tables(pl.DataFrame(), {})["autotune_verdict"].is_empty()


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "-500.0"])
def test_a_measurement_that_is_not_finite_or_negative_is_left_out(tmp_path, value):
    """Python's json reads NaN and Infinity from metrics.json: a NaN or infinite throughput won the ranking ("the
    nan gap (nan%)"); a negative one is no measurement either."""
    real = autotune1() / "autotuning_results" / "z1_gas1_tmbspg2"
    folder = tmp_path / real.name
    shutil.copytree(real, folder)
    metrics = (folder / "metrics.json").read_text()
    damaged = re.sub(r'("throughput":\s*)[-0-9.eE+]+', lambda m: m[1] + value, metrics)
    assert damaged != metrics
    (folder / "metrics.json").write_text(damaged)
    result = autotune_results.parse_experiment(folder / "exp.json", "exp.json")
    row = result.tables["autotune_experiments"].row(0, named=True)
    assert row["throughput"] is None and row["latency_us"] == json.loads(metrics)["latency"]
    assert [i[:3] for i in result.issues] == [["error", "bad_autotune_file", 1]] and "throughput" in result.issues[0][3]


def test_experiment_values_of_the_wrong_type_are_left_out(tmp_path):
    folder = tmp_path / "autotuning_results" / "z1_gas2_tmbspg2"
    folder.mkdir(parents=True)
    ds_config = {"train_micro_batch_size_per_gpu": 2.5, "gradient_accumulation_steps": 2, "zero_optimization": [1],
                 "autotuning": {"metric": "latency", "arg_mappings": ["--micro_bs"]}}
    (folder / "exp.json").write_text(json.dumps({"name": ["x"], "ds_config": ds_config, "launcher_args": 5}))
    (folder / "metrics.json").write_text('{"latency": 1500.0, "fwd": 7, "throughput": ' + "9" * 400
                                         + ', "rank": ' + "9" * 40 + "}")
    result = autotune_results.parse_experiment(folder / "exp.json", "exp.json")
    row = result.tables["autotune_experiments"].row(0, named=True)
    assert (row["experiment"], row["status"], row["grad_accum"], row["latency_us"], row["fwd_us"]) == \
        ("z1_gas2_tmbspg2", "ok", 2, 1500.0, 7.0)
    assert row["micro_batch"] is None and row["zero_stage"] is None and row["throughput"] is None and row["rank"] is None
    assert result.facts["autotune_metric"] == "latency"
    [issue] = result.issues
    assert issue[:3] == ["error", "bad_autotune_file", 7]
    for named in ("name", "train_micro_batch_size_per_gpu", "zero_optimization", "arg_mappings", "launcher_args",
                  "metrics.json throughput", "metrics.json rank"):
        assert named in issue[3]


@pytest.mark.parametrize("autotuning", [[1], "on"])
def test_an_autotuning_block_that_is_not_an_object_is_an_issue(tmp_path, autotuning):
    folder = tmp_path / "z1_gas1_tmbspg4"
    folder.mkdir()
    ds_config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}, "autotuning": autotuning}
    (folder / "exp.json").write_text(json.dumps({"name": folder.name, "ds_config": ds_config}))
    result = autotune_results.parse_experiment(folder / "exp.json", "exp.json")
    row = result.tables["autotune_experiments"].row(0, named=True)
    assert (row["micro_batch"], row["zero_stage"]) == (4, 1) and result.facts["autotune_metric"] == "throughput"
    assert [issue[:3] for issue in result.issues] == [["error", "bad_autotune_file", 1]]


def test_json_nested_past_the_decoders_depth_is_an_issue(tmp_path):
    folder = tmp_path / "z1_gas1_tmbspg4"
    folder.mkdir()
    (folder / "exp.json").write_text('{"ds_config": ' + "[" * 100_000 + "]" * 100_000 + "}")
    result = autotune_results.parse_experiment(folder / "exp.json", "exp.json")
    assert result.tables == {} and [issue[:3] for issue in result.issues] == [["error", "bad_autotune_experiment", 1]]


def test_damaged_summary_rows_and_time_are_left_out(tmp_path):
    path = tmp_path / "summary.txt"
    path.write_text("| tuning_space | num_experiments | best_metric_val | best_exp_name |\n"
                    "|:--|--:|--:|:--|\n| z1 | 6 | 268.708 | z1_gas2_tmbspg4 |\n| z2 | two | 312.166 | z2_gas1_tmbspg8 |\n\n"
                    "Tuning completed in 0:0:1.2.3. Total number of experiments: 8.")
    result = autotune_results.parse_summary(path, "summary.txt")
    assert result.facts["autotune_summary"] == {"spaces": [{"tuning_space": "z1", "num_experiments": 6,
                                                            "best_metric_val": 268.708, "best_exp_name": "z1_gas2_tmbspg4"}],
                                                "source": "summary.txt"}
    [issue] = result.issues
    assert issue[:3] == ["error", "bad_autotune_file", 2] and "line 4" in issue[3] and "Tuning completed" in issue[3]


def test_summary_time_of_more_than_a_day():
    """str(timedelta) puts whole days before h:mm:ss."""
    summary, problems = autotune_results.parse_summary_text(
        "| z1 | 6 | 268.708 | z1_a |\nTuning completed in 1 day, 2:03:04.5. Total number of experiments: 12.")
    assert problems == [] and summary["tuning_seconds"] == 86400 + 2 * 3600 + 3 * 60 + 4.5
    assert summary["total_experiments"] == 12


def test_summary_table_from_deepspeed_docs():
    path = CORPUS / "DeepSpeed" / "docs_examples" / "autotuning_md_summary_gpt2-large_16xV100.txt"
    if not path.exists():
        pytest.skip("corpus not found")
    summary, problems = autotune_results.parse_summary_text(path.read_text())
    assert problems == []
    spaces = {s["tuning_space"]: s for s in summary["spaces"]}
    assert list(spaces) == ["z0", "z1", "z2", "z3", "global"]
    assert spaces["global"]["best_exp_name"] == spaces["z1"]["best_exp_name"]
    assert sum(spaces[z]["num_experiments"] for z in ("z0", "z1", "z2", "z3")) == summary["total_experiments"]
    assert spaces["z3"]["best_metric_val"] == 0  # every z3 experiment failed (DeepSpeed records 0)


# --- noise verdict on synthetic trials (ground truth by construction) ----------------------------

def trials(configs: dict[str, list[float]]) -> pl.DataFrame:
    """Collector-style repeated trial runs: distinct run ids, the same ds_config per configuration."""
    rows = []
    for name, values in configs.items():
        micro = int(name.removeprefix("mbs"))
        config = json.dumps({"train_micro_batch_size_per_gpu": micro, "zero_optimization": {"stage": 2}})
        rows += [{"experiment": f"{name}_run{i}", "trial": i, "zero_stage": 2, "micro_batch": micro, "config_json": config,
                  "status": "ok", "throughput": value} for i, value in enumerate(values)]
    return conform(rows, "autotune_experiments")


def global_verdict(configs: dict[str, list[float]]) -> dict:
    return autotune.autotune_tables(trials(configs), {})["autotune_verdict"].row(0, named=True)


def test_min_trials_rule():
    assert autotune.min_trials(0.05) == 4  # 1/C(6,3) = 0.05 is not below 0.05; 1/C(8,4) = 1/70 is
    assert autotune.min_trials(0.01) == 5  # 1/C(10,5) = 1/252


def test_separated_trials_establish_the_winner():
    result = global_verdict({"mbs4": [100.0, 101.0, 99.5, 100.5, 100.2], "mbs2": [90.0, 91.0, 89.0, 90.5, 90.2]})
    assert result["winner"] == "mbs4_run0" and result["runner_up"] == "mbs2_run0"
    assert result["established"] is True and result["test"] == "mann_whitney_u_exact_one_sided"
    assert result["statistic"] == 25 and result["p_value"] == pytest.approx(1 / 252)
    assert result["winner_median"] == 100.2 and result["winner_trials"] == 5


@pytest.mark.parametrize("configs", [{"mbs4": [100.0, 102.0], "mbs2": [101.0, 101.0]},  # equal medians, noise
                                     {"mbs4": [100.0, 100.0], "mbs2": [100.0, 100.0]}])  # identical, no noise
def test_equal_medians_claim_no_number_of_trials(configs):
    """Equal medians printed 'about -1 trials per config would settle it' (with noise) or 'about 4' (without)."""
    result = global_verdict(configs)
    assert result["difference"] == 0 and result["established"] is False and result["trials_needed"] is None
    assert "no number of trials would tell these two apart" in result["detail"] and "about" not in result["detail"]


def test_three_separated_trials_are_not_enough():
    result = global_verdict({"mbs4": [100.0, 101.0, 102.0], "mbs2": [90.0, 91.0, 92.0]})
    assert result["established"] is False and result["p_value"] == pytest.approx(0.05)
    assert result["trials_needed"] == 4


def test_overlapping_trials_are_not_established():
    result = global_verdict({"mbs4": [100.0, 102.0, 98.0, 101.0, 99.0], "mbs2": [99.5, 101.5, 97.5, 100.5, 98.5]})
    assert result["established"] is False and result["p_value"] > 0.05
    assert result["trials_needed"] > 5 and "not established" in result["detail"]


def test_failed_configs_rank_last_and_keep_their_error():
    frame = pl.concat([trials({"mbs4": [100.0], "mbs2": [90.0]}), conform(
        [{"experiment": "mbs8", "zero_stage": 2, "micro_batch": 8, "status": "oom", "error": "CUDA out of memory"}],
        "autotune_experiments")])
    ranking = autotune.autotune_tables(frame, {})["autotune_ranking"].filter(pl.col("tuning_space") == "global")
    assert ranking["experiment"].to_list() == ["mbs4_run0", "mbs2_run0", "mbs8"]
    assert ranking["rank"].to_list() == [1, 2, None] and ranking["error"][2] == "CUDA out of memory"


def collector_run(step_ms: float, micro_batch: int, steps: int = 6, **config_extra) -> tuple[pl.DataFrame, dict]:
    """A collector run's train_steps on two ranks: a 2 s warm-up step, then steps of `step_ms`."""
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, **config_extra}
    rows, start = [], 1_000_000_000
    for step in range(steps):
        end = start + int((2000 if step == 0 else step_ms) * 1e6)
        rows += [{"rank": rank, "source": f"collector/train_steps/rank{rank}-00000.parquet", "step": step,
                  "micro_step": step, "start_ns": start, "end_ns": end, "dur_ns": end - start, "is_boundary": True,
                  "global_samples": 2 * micro_batch * (step + 1)} for rank in (0, 1)]
        start = end
    return conform(rows, "train_steps"), {"ds_config": config, "world_size": 2}


def test_collector_trial_runs_are_ranked_the_same_way():
    runs = {f"fast{i}": collector_run(100 + i, micro_batch=8) for i in range(4)}
    runs |= {f"slow{i}": collector_run(120 + i, micro_batch=8, fp16={"enabled": True}) for i in range(4)}
    runs["cut"] = collector_run(100, micro_batch=4, steps=1)  # one step: nothing to time
    runs = {name: (step_time.step_time_table(train_steps, facts=facts), facts) for name, (train_steps, facts) in runs.items()}
    experiments, _ = trial_runs.experiments_from_runs(runs)
    fast0 = experiments.filter(pl.col("experiment") == "fast0").row(0, named=True)
    assert fast0["throughput"] == pytest.approx(16 / 0.100) and fast0["latency_us"] == pytest.approx(100_000)
    for prefix in ("fast", "slow"):  # runs with one ds_config are trials of one configuration
        assert experiments.filter(pl.col("experiment").str.starts_with(prefix))["trial"].to_list() == [0, 1, 2, 3]
    assert experiments.filter(pl.col("experiment") == "cut")["status"].to_list() == ["interrupted"]
    verdict = autotune.autotune_tables(experiments, {})["autotune_verdict"].row(0, named=True)
    assert verdict["winner"] == "fast0" and verdict["runner_up"] == "slow0" and verdict["winner_trials"] == 4
    assert verdict["established"] is True and verdict["p_value"] == pytest.approx(1 / 70)


class _Tables:
    """The one thing a caveat reads of a run: its tables by name."""

    def __init__(self, **tables: pl.DataFrame):
        self.tables = tables

    def table(self, name: str) -> pl.DataFrame:
        return self.tables.get(name, pl.DataFrame())


def test_trials_under_their_own_names_are_not_called_single_measurements():
    """Repeated trials in result folders of their own names (mbs4_run0..3) were 'Each of the 8 measured
    configurations ran once' beside a verdict that ranked 2 configurations of 4 trials each."""
    from steplens.analyze.analyses import caveats

    repeated = trials({"mbs4": [100.0, 101.0, 102.0, 103.0], "mbs2": [90.0, 91.0, 92.0, 93.0]})
    assert caveats._single_samples(_Tables(autotune_experiments=repeated)) == []
    once = trials({"mbs4": [100.0], "mbs2": [90.0], "mbs8": [95.0]})
    (caveat,) = caveats._single_samples(_Tables(autotune_experiments=once))
    assert "Each of the 3 measured configurations ran once" in caveat["detail"]
    # one trial has no spread to show (0.0 read as 'no noise')
    ranking = autotune.autotune_tables(once, {})["autotune_ranking"]
    assert ranking["spread"].is_null().all()
    spread = autotune.autotune_tables(repeated, {})["autotune_ranking"].filter(pl.col("tuning_space") == "global")
    assert spread["spread"].to_list() == [3.0, 3.0]


def _pick(name: str, value: float, space: str = "global") -> dict:
    return {"autotune_summary": {"spaces": [{"tuning_space": space, "best_exp_name": name, "best_metric_val": value}]}}


def test_a_pick_of_the_largest_latency_is_not_called_a_stale_metric():
    """DeepSpeed's autotuner keeps the largest value of any metric, latency included (reference: parse_results,
    get_best_space_record); its pick recorded with its own latency was blamed on 'a stale metric'."""
    rows = [{"experiment": name, "trial": 0, "zero_stage": 1, "micro_batch": mb, "config_json": json.dumps({"mb": mb}),
             "status": "ok", "latency_us": latency} for name, mb, latency in (("z1_mbs8", 8, 104557.75), ("z1_mbs6", 6, 44529.4))]
    experiments = conform(rows, "autotune_experiments")
    facts = {"autotune_metric": "latency", **_pick("z1_mbs8", 104558.0)}
    verdict = autotune.autotune_tables(experiments, facts)["autotune_verdict"].row(0, named=True)
    assert verdict["winner"] == "z1_mbs6" and verdict["pick_mismatch"] is True
    assert "so for latency it picks the slowest" in verdict["pick_detail"] and "stale" not in verdict["pick_detail"]
    # the pick's recorded value other than its own metrics.json: that is a stale metric
    stale = autotune.autotune_tables(experiments, {"autotune_metric": "latency", **_pick("z1_mbs8", 30000.0)})
    assert "DeepSpeed recorded a stale metric" in stale["autotune_verdict"]["pick_detail"][0]


def test_the_first_screen_says_what_autotuning_found():
    """An autotuning folder's first screen said only 'MFU: not computed'; the ranking was below four empty sections."""
    from steplens.reports.verdict import first_screen

    experiments, facts, *_ = import_folder(autotune1())
    finding = autotune.verdict_finding(autotune.autotune_tables(experiments, facts)["autotune_verdict"])
    own = {d.name: json.loads((d / "metrics.json").read_text())["throughput"]
           for d in (autotune1() / "autotuning_results").iterdir() if (d / "metrics.json").exists()}
    best = max(own, key=own.get)  # every config measured once: a best, not beyond the noise
    assert (f"Autotuning: best {best} (not beyond the noise)", "autotune") in first_screen({"autotune": finding})
    repeated = autotune.verdict_finding(autotune.autotune_tables(
        trials({"mbs4": [100.0, 101.0, 102.0, 103.0], "mbs2": [90.0, 91.0, 92.0, 93.0]}), {})["autotune_verdict"])
    assert autotune.autotune_headline(repeated) == "Autotuning: best mbs4_run0 (beyond the noise)"
