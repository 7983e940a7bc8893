"""`steplens trials`: repeated runs (collector runs, or any run with step times and a ds_config) grouped
into configurations by the work they do, ranked by throughput, with the autotuning noise verdict
(`autotune.verdict`, at `noise.ALPHA`).

Two runs are trials of one configuration when their ds_configs differ only in settings that do not
change the work: where output goes and what is logged or profiled (IGNORED_KEYS, and any key named
in IGNORED_NAMES at any depth, such as a monitor's output_path or the steplens block's run_dir).
The world size is part of the work; so is the sequence length the steplens block records (seq_len
describes the samples). Which ignored settings actually differed between the runs grouped together
is returned, so a reader sees what was set aside.

Code is part of the configuration too: runs whose records name another git revision of the training
code (commit, or a dirty tree) or other steplens, DeepSpeed or torch versions (`code_identity`) are
different configurations, and the output says which configurations are the same settings on other code.
"""

from __future__ import annotations

import json

import polars as pl

from steplens.analyze.analyses import autotune, step_time
from steplens.analyze.analyses.monitor import run_fact
from steplens.analyze.contract.manifest import is_count
from steplens.analyze.importers import autotune_results

# Top-level ds_config keys that do not change the work of a step: the tuner's own block, where
# output goes, and what is logged, monitored or profiled. (Logging settings can cost time, as
# wall_clock_breakdown's synchronizations do; the runs are still the same work, and the ignored
# differences are reported.)
IGNORED_KEYS = frozenset({
    "steplens", "autotuning",  # the collector's and the autotuner's own settings
    "csv_monitor", "tensorboard", "wandb", "comet", "flops_profiler", "comms_logger",  # monitors and profilers
    "wall_clock_breakdown", "memory_breakdown", "steps_per_print", "log_level", "dump_state", "timers",  # logging
})
IGNORED_NAMES = {"run_dir", "output_path", "output_file", "job_name", "log_dir", "save_dir"}  # paths, at any depth
WORK_SETTINGS_IN_IGNORED = {"steplens": ("seq_len",)}  # kept: they describe the samples


def work_config(config: dict, world_size: int | None) -> tuple[dict, dict]:
    """(the settings that decide the work, {dotted path: value} of what was set aside)."""
    ignored: dict = {}

    def strip(value, path: str):
        if not isinstance(value, dict):
            return value
        kept = {}
        for key, item in value.items():
            dotted = f"{path}.{key}" if path else key
            if key in IGNORED_NAMES or (not path and key in IGNORED_KEYS):
                ignored[dotted] = item
            else:
                kept[key] = strip(item, dotted)
        return kept

    work = strip(config, "")
    for block, keys in WORK_SETTINGS_IN_IGNORED.items():
        for key in keys:
            if isinstance(config.get(block), dict) and config[block].get(key) is not None:
                work[f"{block}.{key}"] = config[block][key]
    work["world_size"] = world_size
    return work, ignored


def code_identity(facts: dict) -> dict:
    """What the run records of the code it ran: the training script's git commit and whether its tree was
    dirty (collector manifest, launcher or W&B facts), and the steplens, DeepSpeed and torch versions
    (collector environment, else the log's DeepSpeed info and ds_report lines). Unrecorded items are left out."""
    environment = facts.get("environment") if isinstance(facts.get("environment"), dict) else {}
    git = facts.get("git") if isinstance(facts.get("git"), dict) else {}
    code = {"git_commit": run_fact(facts, "code_revision"), "git_dirty": git.get("dirty"),
            "steplens": environment.get("steplens"),
            "deepspeed": environment.get("deepspeed") or facts.get("deepspeed_version"),
            "torch": environment.get("torch") or facts.get("torch_version")}
    return {key: value for key, value in code.items() if value is not None}


def experiments_from_runs(runs: dict[str, tuple[pl.DataFrame, dict]]) -> tuple[pl.DataFrame, dict[str, dict]]:
    """Runs (one run folder each: its `step_time` table and run facts) as `autotune_experiments`
    rows, so they rank and get the same verdict as DeepSpeed's experiments, and each run's ignored
    settings. Over the steps `step_time` keeps (warm-up, instrumented and incomplete steps left
    out): latency_us = the median optimizer-step time; throughput = median samples per step (as the
    step-time source records them, else train_batch_size) / that median, in samples/s."""
    rows, ignored = [], {}
    for name, (steps, facts) in runs.items():
        config = dict(facts.get("ds_config") or {})
        work, ignored[name] = work_config(config, facts.get("world_size"))
        work["code"] = code_identity(facts)
        # a ds_config is any JSON object a job or an edit left: only whole numbers are counts
        row = {"experiment": name, "source": name, "config_json": json.dumps(work, sort_keys=True) if config else None,
               "zero_stage": _count(zero.get("stage")) if isinstance(zero := config.get("zero_optimization"), dict) else None,
               "micro_batch": _count(config.get("train_micro_batch_size_per_gpu")),
               "grad_accum": _count(config.get("gradient_accumulation_steps"))}
        kept = steps.filter(~pl.col("excluded") & pl.col("step_time_ns").is_not_null()) if steps.height else steps
        samples = kept["samples"].drop_nulls() if kept.height else pl.Series([], dtype=pl.Int64)
        per_step = samples.median() if samples.len() else _count(facts.get("train_batch_size")) or _count(config.get("train_batch_size"))
        if kept.height >= step_time.MIN_STEPS_FOR_NOISE and per_step:
            median_ns = kept["step_time_ns"].median()
            row.update(status="ok", latency_us=median_ns / 1e3, throughput=per_step / (median_ns / 1e9))
        else:
            row.update(status="interrupted", error=_untimed(steps, kept.height, bool(per_step)))
        rows.append(row)
    frame = autotune_results.experiment_rows(rows)
    trial = pl.col("experiment").cum_count().over(pl.coalesce("config_json", "experiment")) - 1
    return frame.with_columns(trial=trial.cast(pl.Int64)), ignored


def _count(value) -> int | None:
    return value if is_count(value) else None


def _untimed(steps: pl.DataFrame, kept: int, samples_known: bool) -> str:
    """Why a run gives no trial, in the run's own terms: its steps kept and why the others were left out."""
    reasons: dict[str, int] = {}
    for reason in steps.filter(pl.col("excluded"))["reason"].drop_nulls().to_list() if steps.height else []:
        for one in reason.split(","):
            reasons[one] = reasons.get(one, 0) + 1
    left_out = f" ({', '.join(f'{n} {reason}' for reason, n in reasons.items())} left out)" if reasons else ""
    return (f"{kept} of {steps.height} steps kept{left_out}" + ("" if samples_known else ", samples per step unknown")
            + f": a trial needs {step_time.MIN_STEPS_FOR_NOISE} kept steps and its samples per step")


def _leaves(settings: dict, prefix: str = "") -> dict:
    """{dotted path: value} down to the values that are not objects."""
    out = {}
    for key, value in settings.items():
        path = f"{prefix}.{key}" if prefix else key
        out.update(_leaves(value, path) if isinstance(value, dict) and value else {path: value})
    return out


def _differing(ignored: dict[str, dict], names: list[str]) -> list[str]:
    """Ignored settings (down to single values) whose values are not the same in every one of these runs."""
    leaves = {name: _leaves(ignored[name]) for name in names}
    paths = sorted({path for name in names for path in leaves[name]})
    return [p for p in paths
            if len({json.dumps(leaves[name].get(p), sort_keys=True, default=str) for name in names}) > 1]


def trials(runs: dict[str, tuple[pl.DataFrame, dict]]) -> dict:
    """The verdict as data: configurations (runs, trials, median, spread, the ignored settings that
    differed between its runs), the winner against the runner-up (test, statistic, p value,
    established, trials needed) and the rule for what was ignored."""
    experiments, ignored = experiments_from_runs(runs)
    tables = autotune.autotune_tables(experiments, {})
    verdict = tables["autotune_verdict"].filter(pl.col("tuning_space") == "global").row(0, named=True)
    if not (experiments["status"] == "ok").any():  # said in the runs' own terms, not the autotuner's
        verdict["detail"] = "no run could be timed: " + "; ".join(
            f"{name}: {error}" for name, error in experiments.select("experiment", "error").iter_rows())
    ranking = tables["autotune_ranking"].filter(pl.col("tuning_space") == "global").sort("rank", nulls_last=True)
    work_of = dict(zip(experiments["experiment"], experiments["config_json"]))
    configurations, settings = [], []
    for row in ranking.iter_rows(named=True):
        names = row["experiments"].split(",")
        work = json.loads(work_of[names[0]]) if work_of.get(names[0]) else {}
        code = work.pop("code", {})
        settings.append(json.dumps(work, sort_keys=True) if work else names[0])
        configurations.append({
            "configuration": row["experiment"], "rank": row["rank"], "runs": names, "trials": row["trials"],
            "ok_trials": row["ok_trials"], "zero_stage": row["zero_stage"], "micro_batch": row["micro_batch"],
            "grad_accum": row["grad_accum"], "metric": row["metric"], "median": row["median"], "min": row["min"],
            "max": row["max"], "ignored_differences": _differing(ignored, names), "code": code})
    code_splits = _code_splits(configurations, settings)
    keys = ("winner", "winner_median", "winner_trials", "runner_up", "runner_up_median", "runner_up_trials", "difference",
            "relative_difference", "noise_sd", "test", "statistic", "p_value", "established", "trials_needed", "detail")
    return {"metric": "throughput", "unit": "samples_per_s", "higher_is_better": True, "alpha": autotune.ALPHA,
            "configurations": configurations, "verdict": {k: verdict[k] for k in keys},
            "ignored_rule": IGNORED_RULE + "".join(f"; {split}" for split in code_splits),
            "ignored_differences": sorted({p for c in configurations for p in c["ignored_differences"]}),
            "code_splits": code_splits}


def _code_splits(configurations: list[dict], settings: list[str]) -> list[str]:
    """Configurations with the same settings (`settings`, one per configuration) but other code, in words."""
    by_work: dict[str, list[dict]] = {}
    for c, work in zip(configurations, settings):
        by_work.setdefault(work, []).append(c)
    splits = []
    for group in by_work.values():
        if len(group) < 2:
            continue
        items = sorted({key for c in group for key in c["code"]})
        differ = [key for key in items if len({json.dumps(c["code"].get(key)) for c in group}) > 1]
        splits.append(f"{', '.join(c['configuration'] for c in group)} have the same settings but other code "
                      f"({', '.join(f'{key}: ' + ' vs '.join(str(c['code'].get(key, 'not recorded')) for c in group) for key in differ)}): "
                      "kept apart, not trials of one configuration")
    return splits


IGNORED_RULE = (f"ds_config settings that do not change the work were ignored when grouping runs: "
                f"{', '.join(sorted(IGNORED_KEYS))}, and keys named {', '.join(sorted(IGNORED_NAMES))} at any depth "
                "(steplens.seq_len and the world size still count); runs of other code (git commit or dirty tree, "
                "steplens, DeepSpeed or torch versions) are other configurations")
