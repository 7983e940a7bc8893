"""DeepSpeed autotuner results, analysed: re-rank the experiments from their own metrics.json,
check DeepSpeed's pick, and say whether the ranking is established beyond run-to-run noise
(the rows come from importers/autotune_results.py)."""

from __future__ import annotations

import json
import math
import re

import polars as pl
import pyarrow as pa

from steplens.analyze.analyses.noise import ALPHA
from steplens.analyze.analyses.rank_test import mann_whitney_u
from steplens.analyze.importers.autotune_results import TUNED_KEYS, METRIC_COLUMNS, DEFAULT_METRIC
from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.contract import schema

# The noise-aware verdict. With repeated trials: exact one-sided Mann-Whitney U test of the winner
# against the runner-up (rank_test.mann_whitney_u, scipy's definition), significant at ALPHA. With fewer trials no
# rank test can separate two configs: the smallest exact one-sided p-value with n trials each is
# 1 / C(2n, n) (all winner trials above all runner-up trials): 1/6 for n=2, 1/20 = 0.05 for n=3,
# 1/70 for n=4. So MIN_TRIALS = 4 per config is the floor, whatever the gap. ALPHA is the one level
# every steplens verdict uses (noise.ALPHA).
POWER_Z = 0.8416  # z of 80% power
ALPHA_Z = 1.6449  # z of a one-sided 5% test
# Asymptotic relative efficiency of the Mann-Whitney test to the t-test is at least 0.864
# (Hodges & Lehmann 1956): a rank test needs up to 1/0.864 as many trials as the t-test formula says.
MANN_WHITNEY_ARE = 0.864
MAD_TO_SD = 1.4826  # MAD x 1.4826 estimates the standard deviation of normal noise


def min_trials(alpha: float = ALPHA) -> int:
    """Fewest trials per config for which an exact one-sided Mann-Whitney test can reach p < alpha."""
    n = 1
    while 1 / math.comb(2 * n, n) >= alpha:
        n += 1
    return n


def trials_needed(difference: float, noise_sd: float, alpha: float = ALPHA) -> int | None:
    """Trials per config to detect `difference` with 80% power at one-sided `alpha`: the two-sample
    normal formula n = 2 (z_alpha + z_power)^2 sd^2 / difference^2, divided by the Mann-Whitney ARE,
    never under min_trials(). None when the medians are equal: no number of trials tells them apart."""
    if difference == 0:
        return None
    if noise_sd <= 0:
        return min_trials(alpha)
    normal = 2 * (ALPHA_Z + POWER_Z) ** 2 * noise_sd ** 2 / difference ** 2
    return max(min_trials(alpha), math.ceil(normal / MANN_WHITNEY_ARE))


def _space_stage(space: str) -> int | None:
    match = re.match(r"z(\d)", space)
    return int(match.group(1)) if match else None


# Experiments with the same ds_config are trials of one configuration, whatever their names.
CONFIGURATION = pl.coalesce("config_json", "experiment")


def rank_experiments(experiments: pl.DataFrame, metric: str = DEFAULT_METRIC) -> pl.DataFrame:
    """One row per configuration (experiments with the same ds_config are trials of it), ranked by
    the median of the metric from its own metrics.json; failed configurations rank last."""
    column, higher_is_better = METRIC_COLUMNS[metric]
    frame = experiments.with_columns(
        config=CONFIGURATION,
        measured=pl.when(pl.col("status") == "ok").then(pl.col(column)),
    )
    environments = frame["environment"].drop_nulls()
    usual_env = environments.mode().sort()[0] if len(environments) else None
    ranked = (
        frame.group_by("config", maintain_order=True)
        .agg(
            experiment=pl.col("experiment").first(),
            experiments=pl.col("experiment").unique(maintain_order=True).str.join(","),
            zero_stage=pl.col("zero_stage").first(), micro_batch=pl.col("micro_batch").first(),
            grad_accum=pl.col("grad_accum").first(),
            trials=pl.len(), ok_trials=pl.col("measured").count(),
            statuses=pl.col("status").unique().sort().str.join(","),
            error=pl.col("error").drop_nulls().first(),
            median=pl.col("measured").median(), min=pl.col("measured").min(), max=pl.col("measured").max(),
            mad=(pl.col("measured") - pl.col("measured").median()).abs().median(),
            values=pl.col("measured").drop_nulls(),
            environment=pl.col("environment").first(),
            environments=pl.col("environment").n_unique(),
        )
        .with_columns(
            metric=pl.lit(metric),
            spread=pl.when(pl.col("ok_trials") > 1).then(pl.col("max") - pl.col("min")),  # one trial: no spread to tell
            environment_differs=pl.col("environment").ne_missing(usual_env) | (pl.col("environments") > 1),
        )
        .sort(["median"], descending=higher_is_better, nulls_last=True)
        .with_row_index("rank", offset=1)
        .with_columns(rank=pl.when(pl.col("median").is_not_null()).then(pl.col("rank").cast(pl.Int64)))
    )
    return ranked


def fixed_config_differences(experiments: pl.DataFrame) -> list[str]:
    """ds_config keys, outside the tuned knobs, whose values differ between experiments."""
    configs = [json.loads(c) for c in experiments["config_json"].drop_nulls()]
    keys = sorted({k for c in configs for k in c} - set(TUNED_KEYS))
    return [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1]


VERDICT_FIELDS = ("winner", "winner_median", "winner_trials", "runner_up", "runner_up_median", "runner_up_trials",
                  "difference", "relative_difference", "noise_sd", "test", "statistic", "p_value", "established",
                  "trials_needed", "detail")


# The unit a metric's gap is said in (DeepSpeed's autotuner measures throughput in samples per second)
METRIC_UNITS = {"throughput": " samples/s"}


def verdict(ranked: pl.DataFrame, higher_is_better: bool = True, alpha: float = ALPHA, metric: str = "") -> dict:
    """Does the best configuration beat the runner-up by more than the run-to-run noise?"""
    measured = ranked.filter(pl.col("median").is_not_null())
    out = dict.fromkeys(VERDICT_FIELDS) | {"established": False}
    if measured.height == 0:
        out["detail"] = "no experiment produced metrics"
        return out
    winner = measured.row(0, named=True)
    out.update(winner=winner["experiment"], winner_median=winner["median"], winner_trials=winner["ok_trials"])
    if measured.height == 1:
        out.update(established=None, detail="only one configuration has metrics: nothing to rank it against")
        return out
    runner = measured.row(1, named=True)
    difference = abs(winner["median"] - runner["median"])
    out.update(runner_up=runner["experiment"], runner_up_median=runner["median"], runner_up_trials=runner["ok_trials"],
               difference=difference, relative_difference=difference / abs(runner["median"]) if runner["median"] else None)
    noise_values = [v - r["median"] for r in measured.iter_rows(named=True) if r["ok_trials"] > 1 for v in r["values"]]
    noise_sd = MAD_TO_SD * float(pl.Series(noise_values).abs().median()) if noise_values else None
    out["noise_sd"] = noise_sd
    fewest = min(winner["ok_trials"], runner["ok_trials"])
    if fewest < 2:
        floor = min_trials(alpha)
        out.update(trials_needed=trials_needed(difference, noise_sd, alpha) if noise_sd else floor,
                   detail=f"ranking not established: {winner['experiment']} and {runner['experiment']} were measured "
                          f"{winner['ok_trials']} and {runner['ok_trials']} time(s), so the {difference:.4g}"
                          f"{METRIC_UNITS.get(metric, f' {metric}' if metric else '')} gap "
                          f"({out['relative_difference']:.2%}) cannot be told from run-to-run noise. An exact one-sided "
                          f"Mann-Whitney test needs at least {floor} trials per config to reach p < {alpha} "
                          f"(1/C(2n,n)); more if the noise is comparable to the gap.")
        return out
    statistic, p_value = mann_whitney_u(winner["values"], runner["values"], "greater" if higher_is_better else "less",
                                        method="exact")
    established = bool(p_value < alpha)
    out.update(test="mann_whitney_u_exact_one_sided", statistic=statistic, p_value=p_value,
               established=established,
               trials_needed=None if established else trials_needed(difference, noise_sd or 0.0, alpha))
    spread = f"spread {winner['min']:.4g}..{winner['max']:.4g} vs {runner['min']:.4g}..{runner['max']:.4g}"
    if established:
        out["detail"] = (f"{winner['experiment']} beats {runner['experiment']} beyond the noise: median "
                         f"{winner['median']:.4g} vs {runner['median']:.4g} ({spread}); Mann-Whitney U = "
                         f"{statistic:g}, one-sided exact p = {p_value:.3g} < {alpha}")
    else:
        out["detail"] = (f"not established: {winner['experiment']} vs {runner['experiment']} median "
                         f"{winner['median']:.4g} vs {runner['median']:.4g} ({spread}); Mann-Whitney U = "
                         f"{statistic:g}, one-sided exact p = {p_value:.3g} >= {alpha}; "
                         + (f"about {out['trials_needed']} trials per config would settle it (80% power)"
                            if out["trials_needed"] is not None else
                            "the medians are equal: no number of trials would tell these two apart"))
    return out


def autotune_tables(experiments: pl.DataFrame, facts: dict) -> dict[str, pl.DataFrame]:
    """`autotune_ranking` (per tuning space and configuration) and `autotune_verdict` (per tuning
    space: the winner, the noise verdict, DeepSpeed's pick and whether it rests on a stale metric)."""
    metric = facts.get("autotune_metric", DEFAULT_METRIC)
    if metric not in METRIC_COLUMNS:
        metric = DEFAULT_METRIC
    higher_is_better = METRIC_COLUMNS[metric][1]
    if experiments.is_empty():
        return {"autotune_ranking": pl.DataFrame(), "autotune_verdict": pl.DataFrame()}  # written as empty tables
    summary = facts.get("autotune_summary") or {}
    picks = {s["tuning_space"]: s for s in summary.get("spaces", [])}
    stages = sorted(s for s in experiments["zero_stage"].drop_nulls().unique())
    spaces = ["global"] + [f"z{s}" for s in stages]
    fixed_differences = fixed_config_differences(experiments)
    rankings, verdicts = [], []
    for space in spaces:
        stage = _space_stage(space)
        subset = experiments if stage is None else experiments.filter(pl.col("zero_stage") == stage)
        ranked = rank_experiments(subset, metric).with_columns(tuning_space=pl.lit(space))
        rankings.append(ranked)
        result = {"tuning_space": space, "metric": metric, **verdict(ranked, higher_is_better, metric=metric)}
        result.update(_check_pick(space, picks, ranked, higher_is_better))
        differing_env = ranked.filter(pl.col("environment_differs"))["experiment"].to_list()
        result["same_environment"] = not differing_env and not fixed_differences
        notes = []
        if differing_env:
            notes.append(f"environment differs for {differing_env}")
        if fixed_differences:
            notes.append(f"ds_config differs outside the tuned knobs: {fixed_differences}")
        result["environment_detail"] = "; ".join(notes) or "one environment (hosts, launcher, command, fixed ds_config)"
        verdicts.append(result)
    ranking = pl.concat(rankings, how="diagonal_relaxed").select(RANKING_COLUMNS)
    return {"autotune_ranking": ranking, "autotune_verdict": pl.DataFrame(verdicts, infer_schema_length=None)}


RANKING_COLUMNS = ("tuning_space", "rank", "experiment", "experiments", "zero_stage", "micro_batch", "grad_accum",
                   "trials", "ok_trials", "statuses", "error", "metric", "median", "min", "max", "spread",
                   "environment", "environment_differs")


def _check_pick(space: str, picks: dict, ranked: pl.DataFrame, higher_is_better: bool) -> dict:
    """DeepSpeed's pick for the space against the re-ranked metrics (pitfall: a stale metric_file
    in the fast-mode loop records an experiment with the previous experiment's metric)."""
    pick = picks.get(space)
    if pick is None:
        return {"deepspeed_pick": None, "deepspeed_recorded": None, "pick_mismatch": None, "pick_detail": None}
    name, recorded = pick["best_exp_name"], pick["best_metric_val"]
    own = ranked.filter(pl.col("experiments").str.split(",").list.contains(name))
    own_value = own["median"][0] if own.height else None
    best = ranked.filter(pl.col("rank") == 1)
    best_name, best_value = (best["experiment"][0], best["median"][0]) if best.height else (None, None)
    problems = []
    # summary.txt rounds to 6 significant digits (tabulate's default floatfmt "g").
    stale = own_value is not None and not math.isclose(own_value, recorded, rel_tol=1e-5)
    if stale:
        problems.append(f"DeepSpeed recorded {recorded:g} for {name}, its own metrics.json says {own_value:.6g}")
    if best_name is not None and best_name != name and own_value is not None and (
            best_value > own_value if higher_is_better else best_value < own_value):
        # DeepSpeed's autotuner keeps the largest value of any metric (parse_results, get_best_space_record), latency
        # included: with a lower-is-better metric and the pick's own value recorded, that, not a stale metric, is why
        cause = ("DeepSpeed recorded a stale metric for it" if stale else
                 "DeepSpeed's autotuner keeps the largest value of every metric, so for latency it picks the slowest"
                 if not higher_is_better else "not a stale metric: DeepSpeed recorded the pick's own value")
        problems.append(f"DeepSpeed picked {name} ({own_value:.6g}) but {best_name} measured {best_value:.6g} "
                        f"in its own metrics.json ({cause})")
    if own_value is None:
        problems.append(f"DeepSpeed picked {name}, which has no metrics here")
    return {"deepspeed_pick": name, "deepspeed_recorded": recorded, "pick_mismatch": bool(problems),
            "pick_detail": "; ".join(problems) or f"matches the re-ranking ({name})"}


def verdict_finding(verdicts: pl.DataFrame) -> list[dict] | None:
    """Each tuning space's verdict, for findings.json."""
    if verdicts.is_empty():
        return None
    return verdicts.select("tuning_space", "winner", "established", "trials_needed", "deepspeed_pick", "pick_mismatch",
                           "pick_detail", "detail").to_dicts()


def autotune_headline(spaces: list[dict]) -> str | None:
    """The first screen's line: the best configuration over every experiment, whether that is beyond the noise,
    and DeepSpeed's own pick where it differs."""
    space = next((s for s in spaces if s.get("tuning_space") == "global"), None)
    if space is None or not space.get("winner"):
        return None
    ranked = {True: "beyond the noise", False: "not beyond the noise"}.get(space["established"],
                                                                           "nothing to rank it against")
    pick = f"; DeepSpeed picked {space['deepspeed_pick']}" if space.get("pick_mismatch") and space.get("deepspeed_pick") else ""
    return f"Autotuning: best {space['winner']} ({ranked}){pick}"


# ---------------------------------------------------------------------------------------------
# What it says


def autotune_lines(spaces: list[dict], findings: dict) -> list[str]:
    lines = []
    for space in spaces:
        if space["pick_mismatch"]:
            lines.append(f"Autotuning {space['tuning_space']}: DeepSpeed's pick disagrees with the experiments' own "
                         f"metrics: {space['pick_detail']}")
        lines.append(f"Autotuning {space['tuning_space']}: {space['detail']}")
    return [line if line.endswith(".") else line + "." for line in lines]


# ---------------------------------------------------------------------------------------------
# Its report section


# The columns a reader needs, (column, header) pairs (the Parquet tables have the rest).
SHOWN = {
    "autotune_verdict": ("Autotuning verdict", [("tuning_space", "tuning space"), ("winner", "winner"),
                                                ("runner_up", "runner-up"), ("relative_difference", "difference"),
                                                ("established", "established"), ("trials_needed", "trials needed"),
                                                ("pick_mismatch", "DeepSpeed's pick disagrees"), ("detail", "detail")]),
    "autotune_ranking": ("Autotuning experiments", [("tuning_space", "tuning space"), ("rank", "rank"),
                                                    ("experiment", "experiment"), ("zero_stage", "ZeRO stage"),
                                                    ("micro_batch", "micro batch"), ("grad_accum", "grad accum"),
                                                    ("trials", "trials"), ("statuses", "statuses"), ("metric", "metric"),
                                                    ("median", "median"), ("spread", "max - min"),
                                                    ("environment_differs", "environment differs"), ("error", "error")]),
}


def autotune_sections(page, run) -> list:
    sections = []
    for name, (title, columns) in SHOWN.items():
        frame = run.table(name)
        if frame.is_empty():
            continue
        section = page.section(title, name.replace("_", "-"))
        if name == "autotune_verdict":
            section.text(NAMES_AND_SPACES)
        section.rows(frame, {c: (header, FORMATS.get(c, "value")) for c, header in columns}, name)
        sections.append(section)
    return sections


NAMES_AND_SPACES = ("Experiment names are DeepSpeed's: z1_gas2_tmbspg4 is ZeRO stage 1, gradient accumulation 2, micro "
                    "batch 4 per GPU. Each tuning space is ranked on its own: global over every experiment, z1, z2 ... "
                    "over one ZeRO stage's; difference is the winner's lead over the runner-up, relative to the "
                    "runner-up.")
FORMATS = {"relative_difference": "pct"}  # the rest as their values


# ---------------------------------------------------------------------------------------------
# The analysis


def _autotune(inputs: Inputs) -> Output:
    tables = autotune_tables(inputs.table("autotune_experiments"), inputs.facts)
    return Output(tables=tables, finding=verdict_finding(tables["autotune_verdict"]))


AUTOTUNE_RANKING = schema.table_spec(
    ("tuning_space", pa.string(), "global, or z<stage>: the experiments of one ZeRO stage (as DeepSpeed's summary.txt "
                                  "groups them)."),
    ("rank", pa.int64(), "1 = best by the median metric from the experiments' own metrics.json; null: no metrics "
                         "(failed)."),
    ("experiment", pa.string(), "Experiment name (first trial's, for collector trial runs)."),
    ("experiments", pa.string(), "All experiment names that are trials of this configuration (same ds_config), "
                                 "comma-separated."),
    ("zero_stage", pa.int64(), "ZeRO stage."),
    ("micro_batch", pa.int64(), "train_micro_batch_size_per_gpu."),
    ("grad_accum", pa.int64(), "gradient_accumulation_steps."),
    ("trials", pa.int64(), "Experiments of this configuration."),
    ("ok_trials", pa.int64(), "Of them, those with metrics."),
    ("statuses", pa.string(), "Statuses seen (ok, oom, error, interrupted, not_run), comma-separated."),
    ("error", pa.string(), "First error line, when a trial failed."),
    ("metric", pa.string(), "throughput (samples/s), FLOPS or latency (us)."),
    ("median", pa.float64(), "Median metric over the trials."),
    ("min", pa.float64(), "Smallest."),
    ("max", pa.float64(), "Largest."),
    ("spread", pa.float64(), "max - min over the measured trials; null with fewer than two."),
    ("environment", pa.string(), "Hosts, launcher, command (tuned values blanked) and versions, as JSON."),
    ("environment_differs", pa.bool_(), "The environment differs from the most common one (or between its own "
                                        "trials)."),
)

AUTOTUNE_VERDICT = schema.table_spec(
    ("tuning_space", pa.string(), "global or z<stage>."),
    ("metric", pa.string(), "The metric ranked on."),
    ("winner", pa.string(), "Best configuration by median."),
    ("winner_median", pa.float64(), "Its median."),
    ("winner_trials", pa.int64(), "Its trials with metrics."),
    ("runner_up", pa.string(), "Second best."),
    ("runner_up_median", pa.float64(), "Its median."),
    ("runner_up_trials", pa.int64(), "Its trials with metrics."),
    ("difference", pa.float64(), "|winner_median - runner_up_median|."),
    ("relative_difference", pa.float64(), "difference / runner_up_median."),
    ("noise_sd", pa.float64(), "Run-to-run noise: 1.4826 x median absolute deviation of all repeated trials from "
                               "their config's median."),
    ("test", pa.string(), "mann_whitney_u_exact_one_sided when both have 2+ trials, else null."),
    ("statistic", pa.float64(), "Mann-Whitney U of the winner's trials."),
    ("p_value", pa.float64(), "Exact one-sided p-value."),
    ("established", pa.bool_(), "The winner beats the runner-up beyond the noise (p < 0.05); false with single "
                                "measurements."),
    ("trials_needed", pa.int64(), "Trials per config that would settle it: at least 4 (1/C(2n,n) < 0.05), more by the "
                                  "normal sample-size formula at 80% power when the noise is known; -1: identical "
                                  "medians."),
    ("detail", pa.string(), "The verdict in words."),
    ("deepspeed_pick", pa.string(), "best_exp_name in DeepSpeed's summary.txt."),
    ("deepspeed_recorded", pa.float64(), "best_metric_val there."),
    ("pick_mismatch", pa.bool_(), "DeepSpeed's pick or recorded value disagrees with the experiments' own metrics "
                                  "(stale metric)."),
    ("pick_detail", pa.string(), "What disagrees."),
    ("same_environment", pa.bool_(), "All experiments ran with one environment and the same fixed ds_config."),
    ("environment_detail", pa.string(), "What differs, when something does."),
)


ANALYSIS = Analysis("autotune", "Autotuning", ("autotune_experiments",), {"autotune_ranking": AUTOTUNE_RANKING, "autotune_verdict": AUTOTUNE_VERDICT},
                    _autotune, phrase=autotune_lines, section=autotune_sections, headline=autotune_headline)
