"""DeepSpeed autotuner results: an importer (one experiment folder -> one `autotune_experiments`
row; summary.txt -> DeepSpeed's pick as run facts) and the analysis that re-ranks the experiments
from their own metrics.json, checks DeepSpeed's pick, and says whether the ranking is established
beyond run-to-run noise.

Layout (DeepSpeed 0.19.8, deepspeed/autotuning/): `autotuning_exps/<exp>.json` is the spec of each
experiment; `autotuning_results/<exp>/` holds exp.json, ds_config.json, cmd.txt, stdout.log,
stderr.log and, when it finished, metrics.json (fwd/bwd/step/latency in microseconds: the engine's
timers.get_mean() multiplies ms by 1000). summary.txt and ds_config_optimal.json are DeepSpeed's
pick. DeepSpeed measures each experiment once.
"""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import polars as pl

from .imported import Imported, conform, peek
from .noise import ALPHA

EXPERIMENT_FILES = ("metrics.json", "stderr.log", "stdout.log", "ds_config.json", "cmd.txt", "model_info.json")
SUMMARY_FILES = ("ds_config_optimal.json", "cmd_optimal.txt")
EXPS_DIR, RESULTS_DIR = "autotuning_exps", "autotuning_results"  # DeepSpeed's defaults (autotuning/constants.py)
MODEL_PROFILE_EXP = "profile_model_info"  # the model-profiling run, not a candidate configuration

# Knobs the autotuner varies between experiments (fast mode: micro batch, gas, ZeRO stage; the full
# space also tunes the zero_optimization block, autotuning/tuner and config_templates): differences
# there are the point of the experiment, not a change of environment.
TUNED_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "zero_optimization")

# Failure classes. DeepSpeed itself only records "the first line containing Error/error/ERROR"
# (autotuning/utils.py search_error) and has no OOM class.
OOM_PATTERN = re.compile(r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|MemoryError|"
                         r"Cannot allocate memory|std::bad_alloc", re.IGNORECASE)
INTERRUPT_PATTERN = re.compile(r"KeyboardInterrupt|SIGTERM|SIGKILL|SIGINT|^Killed\b|Terminated\b", re.MULTILINE)
EXCEPTION_LINE = re.compile(r"^\s*([\w.]+(Error|Exception|Interrupt))\b.*$", re.MULTILINE)
ERROR_WORD = re.compile(r"Error|error|ERROR")  # DeepSpeed's own test (autotuning/utils.py search_error)

# metrics.json keys -> columns, and which way is better. DeepSpeed takes the max for every metric,
# latency included (autotuner.py get_best_space_record), which is wrong for latency.
METRIC_COLUMNS = {"throughput": ("throughput", True), "FLOPS": ("flops_per_gpu", True), "latency": ("latency_us", False)}
DEFAULT_METRIC = "throughput"  # DeepSpeed's default autotuning metric


def _imported() -> Imported:

    return Imported()


def _read_json(path: Path, problems: list[str]) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        problems.append(f"{path.name}: {e}")
        return None
    if not isinstance(value, dict):
        problems.append(f"{path.name}: not a JSON object")
        return None
    return value



# --- importer: one experiment ---------------------------------------------------------------------

def claims_experiment(path: Path) -> bool:
    """A result folder's exp.json, or a spec in autotuning_exps/ whose experiment has no result folder."""
    if path.name == "exp.json":
        return b'"ds_config"' in peek(path, 512)
    if path.parent.name == EXPS_DIR and path.suffix == ".json":
        return not (path.parent.parent / RESULTS_DIR / path.stem / "exp.json").exists()
    return False


def experiment_companions(path: Path) -> list[Path]:
    """The result folder's files, and the experiment's spec in autotuning_exps/ (same content as exp.json)."""
    if path.name != "exp.json":
        return []
    spec = path.parent.parent.parent / EXPS_DIR / f"{path.parent.name}.json"
    return [path.parent / name for name in EXPERIMENT_FILES] + [spec]


def classify_stderr(text: str | None) -> tuple[str, str | None]:
    """(status, error line) of an experiment that left no metrics, from its stderr.log."""
    if text is None:
        return "not_run", "no stderr.log: the experiment never started"
    exceptions = [m.group(0).strip() for m in EXCEPTION_LINE.finditer(text)]
    if match := OOM_PATTERN.search(text):
        line = next((e for e in exceptions if OOM_PATTERN.search(e)), None)
        return "oom", line or text[text.rfind("\n", 0, match.start()) + 1:].split("\n", 1)[0].strip()
    if match := INTERRUPT_PATTERN.search(text):
        return "interrupted", exceptions[-1] if exceptions else match.group(0)
    if exceptions:
        return "error", exceptions[-1]
    if match := ERROR_WORD.search(text):
        return "error", text[text.rfind("\n", 0, match.start()) + 1:].split("\n", 1)[0].strip()
    return "interrupted", "no metrics.json and no error in stderr.log: the run ended before measuring"


def _environment(exp: dict, stdout: str | None) -> dict:
    """What the experiment ran on and with, tuned values removed so experiments compare."""
    env = {key: exp.get(key) for key in ("num_gpus", "num_nodes", "hostfile", "user", "job_id") if key in exp}
    launcher = list(exp.get("launcher_args") or [])
    if "--master_port" in launcher:  # a fresh port per experiment
        del launcher[launcher.index("--master_port"):launcher.index("--master_port") + 2]
    env["launcher_args"] = launcher
    if stdout:
        if match := re.search(r"cmd = (\S+) -u -m deepspeed\.launcher\.launch (?:.*?)--world_info=(\S+)", stdout):
            env["python"] = match.group(1)
            try:
                env["world_info"] = json.loads(base64.urlsafe_b64decode(match.group(2)))
            except ValueError:
                env["world_info"] = match.group(2)
        if match := re.search(r"DeepSpeed info: version=([^,\s]+), git-hash=([^,\s]+)", stdout):
            env["deepspeed_version"], env["deepspeed_git_hash"] = match.groups()
    return env


def _command(cmd: str | None, arg_mappings: dict) -> str | None:
    """cmd.txt with the per-experiment values (port, base64 config, tuned script args) blanked."""
    if not cmd:
        return None
    words = cmd.split()
    for flag in ("--master_port", "--deepspeed_config", *arg_mappings.values()):
        if flag in words and words.index(flag) + 1 < len(words):
            words[words.index(flag) + 1] = "<varies>"
    return " ".join(words)


def parse_experiment(path: Path, source: str) -> Imported:
    result = _imported()
    problems: list[str] = []
    exp = _read_json(path, problems)
    if exp is None or not isinstance(exp.get("ds_config"), dict):
        result.issues.append(["error", "bad_autotune_experiment", 1,
                              f"{source}: not an autotuner experiment ({'; '.join(problems) or 'no ds_config'})"])
        return result
    name = exp.get("name") or path.parent.name
    folder = path.parent
    if name == MODEL_PROFILE_EXP:
        if info := _read_json(folder / "model_info.json", problems):
            result.facts["autotune_model_info"] = info
        return result
    ds_config = exp["ds_config"]
    autotuning = ds_config.get("autotuning") or {}
    arg_mappings = autotuning.get("arg_mappings") or {}
    result.facts["autotune_metric"] = autotuning.get("metric", DEFAULT_METRIC)
    row = {
        "experiment": name, "source": source, "trial": 0,
        "zero_stage": (ds_config.get("zero_optimization") or {}).get("stage"),
        "micro_batch": ds_config.get("train_micro_batch_size_per_gpu"),
        "grad_accum": ds_config.get("gradient_accumulation_steps"),
        "config_json": json.dumps({k: v for k, v in ds_config.items() if k != "autotuning"}, sort_keys=True),
    }
    if path.name != "exp.json":  # a spec whose experiment left no result folder
        row.update(status="not_run", error="no result folder: the experiment was never launched (or was cleaned up)",
                   environment=json.dumps(_environment(exp, None), sort_keys=True))
        result.tables = {"autotune_experiments": _rows([row])}
        return result

    stdout = _read_text(folder / "stdout.log")
    environment = _environment(exp, stdout)
    environment["command"] = _command(_read_text(folder / "cmd.txt"), arg_mappings)
    row["environment"] = json.dumps(environment, sort_keys=True)
    metrics = _read_json(folder / "metrics.json", problems)
    if metrics is not None:
        row.update(status="ok", rank=metrics.get("rank"), latency_us=metrics.get("latency"), throughput=metrics.get("throughput"),
                   flops_per_gpu=metrics.get("FLOPS_per_gpu"), fwd_us=metrics.get("fwd"), bwd_us=metrics.get("bwd"),
                   step_us=metrics.get("step"))
    else:
        row["status"], row["error"] = classify_stderr(_read_text(folder / "stderr.log"))
    if problems:
        result.issues.append(["error", "bad_autotune_file", len(problems), f"{source}: " + "; ".join(problems)])
    result.tables = {"autotune_experiments": _rows([row])}
    return result


def _read_text(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None


def _rows(rows: list[dict]) -> pl.DataFrame:

    for row in rows:  # metrics.json numbers may be ints
        for key in ("latency_us", "throughput", "flops_per_gpu", "fwd_us", "bwd_us", "step_us"):
            if isinstance(row.get(key), (int, float)):
                row[key] = float(row[key])
            elif key in row:
                row[key] = None
    return conform(rows, "autotune_experiments")


# --- importer: DeepSpeed's summary ------------------------------------------------------------------

def claims_summary(path: Path) -> bool:
    return path.name == "summary.txt" and peek(path, 64).lstrip().startswith(b"| tuning_space")


def summary_companions(path: Path) -> list[Path]:
    return [path.parent / name for name in SUMMARY_FILES]


def parse_summary_text(text: str) -> dict:
    """DeepSpeed's summary.txt (a tabulate "pipe" table and a closing line) -> facts."""
    spaces = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("tuning_space", "") or set(cells[0]) <= set(":- "):
            continue
        try:
            spaces.append({"tuning_space": cells[0], "num_experiments": int(cells[1]),
                           "best_metric_val": float(cells[2]), "best_exp_name": cells[3]})
        except ValueError:
            continue
    summary = {"spaces": spaces}
    if match := re.search(r"Tuning completed in (\d+):(\d+):([\d.]+)\. Total number of experiments: (\d+)", text):
        hours, minutes, seconds, total = match.groups()
        summary["tuning_seconds"] = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
        summary["total_experiments"] = int(total)
    return summary


def parse_summary(path: Path, source: str) -> Imported:
    result = _imported()
    summary = parse_summary_text(_read_text(path) or "")
    if not summary["spaces"]:
        result.issues.append(["error", "bad_autotune_summary", 1, f"{source}: no tuning_space rows in the table"])
        return result
    problems: list[str] = []
    if optimal := _read_json(path.parent / "ds_config_optimal.json", problems):
        summary["optimal_ds_config"] = optimal
    if problems:
        result.issues.append(["error", "bad_autotune_file", len(problems), f"{source}: " + "; ".join(problems)])
    summary["source"] = source
    result.facts["autotune_summary"] = summary
    return result


# --- analysis -------------------------------------------------------------------------------------
# The noise-aware verdict. With repeated trials: exact one-sided Mann-Whitney U test of the winner
# against the runner-up (scipy.stats.mannwhitneyu), significant at ALPHA. With fewer trials no
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


def trials_needed(difference: float, noise_sd: float, alpha: float = ALPHA) -> int:
    """Trials per config to detect `difference` with 80% power at one-sided `alpha`: the two-sample
    normal formula n = 2 (z_alpha + z_power)^2 sd^2 / difference^2, divided by the Mann-Whitney ARE,
    never under min_trials()."""
    if noise_sd <= 0:
        return min_trials(alpha)
    if difference == 0:
        return -1  # no finite number: the two configs measure the same
    normal = 2 * (ALPHA_Z + POWER_Z) ** 2 * noise_sd ** 2 / difference ** 2
    return max(min_trials(alpha), math.ceil(normal / MANN_WHITNEY_ARE))


def _space_stage(space: str) -> int | None:
    match = re.match(r"z(\d)", space)
    return int(match.group(1)) if match else None


def rank_experiments(experiments: pl.DataFrame, metric: str = DEFAULT_METRIC) -> pl.DataFrame:
    """One row per configuration (experiments with the same ds_config are trials of it), ranked by
    the median of the metric from its own metrics.json; failed configurations rank last."""
    column, higher_is_better = METRIC_COLUMNS[metric]
    frame = experiments.with_columns(
        config=pl.coalesce("config_json", "experiment"),
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
            spread=pl.col("max") - pl.col("min"),
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


def verdict(ranked: pl.DataFrame, higher_is_better: bool = True, alpha: float = ALPHA) -> dict:
    """Does the best configuration beat the runner-up by more than the run-to-run noise?"""
    from scipy import stats

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
                          f"{winner['ok_trials']} and {runner['ok_trials']} time(s), so the {difference:.4g} gap "
                          f"({out['relative_difference']:.2%}) cannot be told from run-to-run noise. An exact one-sided "
                          f"Mann-Whitney test needs at least {floor} trials per config to reach p < {alpha} "
                          f"(1/C(2n,n)); more if the noise is comparable to the gap.")
        return out
    test = stats.mannwhitneyu(winner["values"], runner["values"], method="exact",
                              alternative="greater" if higher_is_better else "less")
    established = bool(test.pvalue < alpha)
    out.update(test="mann_whitney_u_exact_one_sided", statistic=float(test.statistic), p_value=float(test.pvalue),
               established=established,
               trials_needed=None if established else trials_needed(difference, noise_sd or 0.0, alpha))
    spread = f"spread {winner['min']:.4g}..{winner['max']:.4g} vs {runner['min']:.4g}..{runner['max']:.4g}"
    if established:
        out["detail"] = (f"{winner['experiment']} beats {runner['experiment']} beyond the noise: median "
                         f"{winner['median']:.4g} vs {runner['median']:.4g} ({spread}); Mann-Whitney U = "
                         f"{test.statistic:g}, one-sided exact p = {test.pvalue:.3g} < {alpha}")
    else:
        out["detail"] = (f"not established: {winner['experiment']} vs {runner['experiment']} median "
                         f"{winner['median']:.4g} vs {runner['median']:.4g} ({spread}); Mann-Whitney U = "
                         f"{test.statistic:g}, one-sided exact p = {test.pvalue:.3g} >= {alpha}; about "
                         f"{out['trials_needed']} trials per config would settle it (80% power)")
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
        result = {"tuning_space": space, "metric": metric, **verdict(ranked, higher_is_better)}
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
        return {"deepspeed_pick": None, "deepspeed_recorded": None, "pick_mismatch": None}
    name, recorded = pick["best_exp_name"], pick["best_metric_val"]
    own = ranked.filter(pl.col("experiments").str.split(",").list.contains(name))
    own_value = own["median"][0] if own.height else None
    best = ranked.filter(pl.col("rank") == 1)
    best_name, best_value = (best["experiment"][0], best["median"][0]) if best.height else (None, None)
    problems = []
    # summary.txt rounds to 6 significant digits (tabulate's default floatfmt "g").
    if own_value is not None and not math.isclose(own_value, recorded, rel_tol=1e-5):
        problems.append(f"DeepSpeed recorded {recorded:g} for {name}, its own metrics.json says {own_value:.6g}")
    if best_name is not None and best_name != name and own_value is not None and (
            best_value > own_value if higher_is_better else best_value < own_value):
        problems.append(f"DeepSpeed picked {name} ({own_value:.6g}) but {best_name} measured {best_value:.6g} "
                        f"in its own metrics.json (DeepSpeed recorded a stale metric for it)")
    if own_value is None:
        problems.append(f"DeepSpeed picked {name}, which has no metrics here")
    return {"deepspeed_pick": name, "deepspeed_recorded": recorded, "pick_mismatch": bool(problems),
            "pick_detail": "; ".join(problems) or f"matches the re-ranking ({name})"}
