"""DeepSpeed autotuner results, imported: one experiment folder -> one `autotune_experiments` row;
summary.txt -> DeepSpeed's pick as run facts. The analysis that re-ranks them is analyses/autotune.py.

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

from steplens.analyze.contract import schema
from steplens.analyze.contract.failures import OOM
from steplens.analyze.importers.base import Imported, conform, peek
from steplens.analyze.importers.bounded import load_json, read_text
from steplens.analyze.contract.traces import preview

EXPERIMENT_FILES = ("metrics.json", "stderr.log", "stdout.log", "ds_config.json", "cmd.txt", "model_info.json")
SUMMARY_FILES = ("ds_config_optimal.json", "cmd_optimal.txt")
EXPS_DIR, RESULTS_DIR = "autotuning_exps", "autotuning_results"  # DeepSpeed's defaults (autotuning/constants.py)
MODEL_PROFILE_EXP = "profile_model_info"  # the model-profiling run, not a candidate configuration

# Knobs the autotuner varies between experiments (fast mode: micro batch, gas, ZeRO stage; the full
# space also tunes the zero_optimization block, autotuning/tuner and config_templates): differences
# there are the point of the experiment, not a change of environment.
TUNED_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "zero_optimization")

# Failure classes (out of memory: contract/failures.py).
INTERRUPT_PATTERN = re.compile(r"KeyboardInterrupt|SIGTERM|SIGKILL|SIGINT|^Killed\b|Terminated\b", re.MULTILINE)
EXCEPTION_LINE = re.compile(r"^\s*([\w.]+(Error|Exception|Interrupt))\b.*$", re.MULTILINE)
ERROR_WORD = re.compile(r"Error|error|ERROR")  # DeepSpeed's own test (autotuning/utils.py search_error)

# metrics.json keys -> columns, and which way is better. DeepSpeed takes the max for every metric,
# latency included (autotuner.py get_best_space_record), which is wrong for latency.
METRIC_COLUMNS = {"throughput": ("throughput", True), "FLOPS": ("flops_per_gpu", True), "latency": ("latency_us", False)}
DEFAULT_METRIC = "throughput"  # DeepSpeed's default autotuning metric
# metrics.json keys -> autotune_experiments float columns.
METRIC_FIELDS = {"latency": "latency_us", "throughput": "throughput", "FLOPS_per_gpu": "flops_per_gpu", "fwd": "fwd_us",
                 "bwd": "bwd_us", "step": "step_us"}
RANKS = (0, schema.MAX_RANK - 1)
# summary.txt's closing line (autotuner.py print_tuning_results): the time as str(timedelta), e.g.
# '0:02:33.223603' or '1 day, 2:03:04'.
TUNING_COMPLETED = re.compile(r"Tuning completed in (?:(\d{1,9}) days?, )?(\d{1,2}):(\d{1,2}):(\d{1,2}(?:\.\d+)?)\. "
                              r"Total number of experiments: (\d{1,9})(?!\d)")


def _imported() -> Imported:

    return Imported()


def _read_json(path: Path, problems: list[str]) -> dict | None:
    try:
        value = load_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        problems.append(f"{path.name}: {e}")
        return None
    if not isinstance(value, dict):
        problems.append(f"{path.name}: not a JSON object")
        return None
    return value


def _object(parent: dict, key: str, where: str, problems: list[str]) -> dict:
    """parent[key] when it is a JSON object; {} when absent or (with a problem) of another type."""
    value = parent.get(key)
    if value is None or isinstance(value, dict):
        return value or {}
    problems.append(f"{where}{key} is {preview(value)}, not an object")
    return {}


def _whole(value, what: str, problems: list[str], bounds: tuple[int, int] = schema.INT64_RANGE) -> int | None:
    """A whole number within bounds (an int64 column); None for anything else, with a problem when present."""
    if value is None or (type(value) is int and bounds[0] <= value <= bounds[1]):
        return value
    problems.append(f"{what} = {preview(value)} is out of range or not a whole number")
    return None


def _number(value, what: str, problems: list[str]) -> float | None:
    """A number as a float; None for anything else (text, true/false, an integer beyond float64), with a problem."""
    if value is None:
        return None
    if type(value) in (int, float):
        try:
            return float(value)
        except OverflowError:
            pass
    problems.append(f"{what} = {preview(value)} is not a number a float64 holds")
    return None


def _measure(value, what: str, problems: list[str]) -> float | None:
    """A measured time, rate or FLOPs count: a finite number from 0 (Python's json reads NaN and Infinity, and a
    NaN or infinite throughput would win the ranking)."""
    number = _number(value, what, problems)
    if number is not None and not (math.isfinite(number) and number >= 0):
        problems.append(f"{what} = {preview(value)} is no measurement (not finite, or below 0)")
        return None
    return number


# --- importer: one experiment ---------------------------------------------------------------------

def tuning_folder(path: Path) -> Path:
    """The folder an autotuning run wrote its RESULTS_DIR and EXPS_DIR into, from an experiment's exp.json
    (RESULTS_DIR/<exp>/exp.json), a spec (EXPS_DIR/<exp>.json) or the summary (RESULTS_DIR/summary.txt)."""
    return path.parents[2] if path.name == "exp.json" and len(path.parents) > 2 else path.parents[1]


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
    if match := OOM.search(text):
        line = next((e for e in exceptions if OOM.search(e)), None)
        return "oom", line or text[text.rfind("\n", 0, match.start()) + 1:].split("\n", 1)[0].strip()
    if match := INTERRUPT_PATTERN.search(text):
        return "interrupted", exceptions[-1] if exceptions else match.group(0)
    if exceptions:
        return "error", exceptions[-1]
    if match := ERROR_WORD.search(text):
        return "error", text[text.rfind("\n", 0, match.start()) + 1:].split("\n", 1)[0].strip()
    return "interrupted", "no metrics.json and no error in stderr.log: the run ended before measuring"


def _environment(exp: dict, stdout: str | None, problems: list[str]) -> dict:
    """What the experiment ran on and with, tuned values removed so experiments compare."""
    env = {key: exp.get(key) for key in ("num_gpus", "num_nodes", "hostfile", "user", "job_id") if key in exp}
    launcher = exp.get("launcher_args") or []
    if not isinstance(launcher, list):
        problems.append(f"launcher_args is {preview(launcher)}, not a list")
        launcher = []
    launcher = list(launcher)  # a copy: the port is taken out
    if "--master_port" in launcher:  # a fresh port per experiment
        del launcher[launcher.index("--master_port"):launcher.index("--master_port") + 2]
    env["launcher_args"] = launcher
    if stdout:
        if match := re.search(r"cmd = (\S+) -u -m deepspeed\.launcher\.launch (?:.*?)--world_info=(\S+)", stdout):
            env["python"] = match.group(1)
            try:
                env["world_info"] = json.loads(base64.urlsafe_b64decode(match.group(2)))
            except (ValueError, RecursionError):
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
    if not isinstance(name, str):
        problems.append(f"name is {preview(name)}, not text")
        name = path.parent.name
    folder = path.parent
    if name == MODEL_PROFILE_EXP:
        if info := _read_json(folder / "model_info.json", problems):
            result.facts["autotune_model_info"] = info
        return _with_problems(result, source, problems)
    ds_config = exp["ds_config"]
    # Problems with exp.json's own keys name the key only: the issue names the file.
    autotuning = _object(ds_config, "autotuning", "ds_config.", problems)
    arg_mappings = _object(autotuning, "arg_mappings", "ds_config.autotuning.", problems)
    metric = autotuning.get("metric", DEFAULT_METRIC)
    if not isinstance(metric, str):
        problems.append(f"ds_config.autotuning.metric is {preview(metric)}, not a name; {DEFAULT_METRIC} used")
        metric = DEFAULT_METRIC
    result.facts["autotune_metric"] = metric
    zero = _object(ds_config, "zero_optimization", "ds_config.", problems)
    row = {
        "experiment": name, "source": source, "trial": 0,
        "zero_stage": _whole(zero.get("stage"), "ds_config.zero_optimization.stage", problems),
        "micro_batch": _whole(ds_config.get("train_micro_batch_size_per_gpu"), "ds_config.train_micro_batch_size_per_gpu",
                              problems),
        "grad_accum": _whole(ds_config.get("gradient_accumulation_steps"), "ds_config.gradient_accumulation_steps",
                             problems),
        "config_json": json.dumps({k: v for k, v in ds_config.items() if k != "autotuning"}, sort_keys=True),
    }
    if path.name != "exp.json":  # a spec whose experiment left no result folder
        row.update(status="not_run", error="no result folder: the experiment was never launched (or was cleaned up)",
                   environment=json.dumps(_environment(exp, None, problems), sort_keys=True))
        result.tables = {"autotune_experiments": experiment_rows([row])}
        return _with_problems(result, source, problems)

    stdout = _read_text(folder / "stdout.log")
    environment = _environment(exp, stdout, problems)
    environment["command"] = _command(_read_text(folder / "cmd.txt"), arg_mappings)
    row["environment"] = json.dumps(environment, sort_keys=True)
    metrics = _read_json(folder / "metrics.json", problems)
    if metrics is not None:
        row.update(status="ok", rank=_whole(metrics.get("rank"), "metrics.json rank", problems, RANKS))
        row.update({column: _measure(metrics.get(key), f"metrics.json {key}", problems)
                    for key, column in METRIC_FIELDS.items()})
    else:
        row["status"], row["error"] = classify_stderr(_read_text(folder / "stderr.log"))
    result.tables = {"autotune_experiments": experiment_rows([row])}
    return _with_problems(result, source, problems)


def _with_problems(result: Imported, source: str, problems: list[str]) -> Imported:
    if problems:
        result.issues.append(["error", "bad_autotune_file", len(problems), f"{source}: " + "; ".join(problems)])
    return result


def _read_text(path: Path) -> str | None:
    """A log of an experiment (stdout, stderr, cmd.txt), bounded like every text input; only its words are used."""
    try:
        return read_text(path, [])
    except OSError:
        return None


def experiment_rows(rows: list[dict]) -> pl.DataFrame:

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


def parse_summary_text(text: str) -> tuple[dict, list[str]]:
    """DeepSpeed's summary.txt (a tabulate "pipe" table and a closing line) -> (facts, damaged rows and lines)."""
    spaces, problems = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and (len(cells) != 4 or not line.rstrip().endswith("|")):
            # A table row cut short (a partial copy) or damaged: its last cell may have lost characters.
            problems.append(f"line {number}: a table row without its 4 cells and closing '|' (cut or damaged); row skipped")
            continue
        if len(cells) != 4 or cells[0] in ("tuning_space", "") or set(cells[0]) <= set(":- "):
            continue
        try:
            spaces.append({"tuning_space": cells[0], "num_experiments": int(cells[1]),
                           "best_metric_val": float(cells[2]), "best_exp_name": cells[3]})
        except ValueError:
            problems.append(f"line {number}: not a count and a metric value; row skipped")
    summary = {"spaces": spaces}
    if match := TUNING_COMPLETED.search(text):
        days, hours, minutes, seconds, total = match.groups()
        summary["tuning_seconds"] = int(days or 0) * 86400 + int(hours) * 3600 + int(minutes) * 60 + float(seconds)
        summary["total_experiments"] = int(total)
    elif "Tuning completed in" in text:
        problems.append("the 'Tuning completed in' line has no [d days, ]h:mm:ss time and experiment count; left out")
    return summary, problems


def parse_summary(path: Path, source: str) -> Imported:
    result = _imported()
    summary, problems = parse_summary_text(_read_text(path) or "")
    if not summary["spaces"]:
        result.issues.append(["error", "bad_autotune_summary", 1, f"{source}: no tuning_space rows in the table"])
        return result
    if optimal := _read_json(path.parent / "ds_config_optimal.json", problems):
        summary["optimal_ds_config"] = optimal
    summary["source"] = source
    result.facts["autotune_summary"] = summary
    return _with_problems(result, source, problems)
