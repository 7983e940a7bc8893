"""Monitor analysis over the `scalars` table: curves on a common x axis, post-hoc alarms, and whether
runs can be compared at all.

Curves are aligned on global samples (or tokens), never on the optimizer step: a step means
train_batch_size samples, and that differs between runs with another micro batch, gradient
accumulation or world size. Pure functions; run facts are the `facts` of run.json.
"""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl

# Which tags are what, and the robust z-score (Iglewicz & Hoaglin's modified z, |z| > 3.5): one definition,
# shared with the in-job alarm rules. The analysis here is post hoc, so the median and MAD are over the
# neighbours on both sides of the point: a trend (a falling loss) then shifts the median little, and one
# spike cannot hide in its own baseline. The in-job rules, replayed over the same rows, are alarm_agreement.
from steplens.analyze.contract.alarm_rules import DURATION, GRAD_NORM, LOSS, MAD_Z_SCALE, MEMORY, RATE, SPIKE_Z

NEIGHBOURS = 25  # points on each side a point is judged against
MIN_HISTORY = 8  # fewer points before it: not judged (the first steps are warm-up)
THROUGHPUT_MIN_CHANGE = 0.10  # and a throughput drop must also be >= 10% off the median around it
# Memory growth: Theil-Sen slope (Sen 1968; scipy.stats.theilslopes) with its 95% interval above zero
# and a fitted growth of at least MEMORY_MIN_GROWTH over the run.
MEMORY_MIN_GROWTH = 0.05
ORIGIN_PREFERENCE = ("collector", "csv_monitor", "tensorboard", "wandb", "log")  # exact first, float32 TB later

ALARM_COLUMNS = ("alarm", "name", "origin", "source", "global_samples", "step", "value", "baseline", "score",
                 "threshold", "detail")
COMPARABILITY_FIELDS = ("world_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                        "train_batch_size", "code_revision", "zero_stage", "seq_len", "deepspeed_version")
# Without these the runs' x axes or results cannot be compared.
REQUIRED_FIELDS = ("world_size", "gradient_accumulation_steps", "train_batch_size", "code_revision")


def run_fact(facts: dict, field: str):
    """A comparability field from run facts (ds_config, launcher, W&B config), or None."""
    config = facts.get("ds_config") or {}
    wandb = facts.get("wandb") or {}
    if field == "code_revision":  # launcher/W&B facts, or the collector manifest's git block
        return (facts.get("code_revision") or facts.get("git_commit") or wandb.get("git_commit")
                or (facts.get("git") or {}).get("commit"))
    if field == "deepspeed_version" and facts.get(field) is None:
        return (facts.get("environment") or {}).get("deepspeed")
    if field == "seq_len":
        return facts.get("seq_len") or facts.get("sequence_length")
    value = facts.get(field, config.get(field))
    if field == "zero_stage" and value is None:
        value = (config.get("zero_optimization") or {}).get("stage")
    if field == "train_batch_size" and value is None:
        parts = [run_fact(facts, f) for f in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "world_size")]
        if all(isinstance(p, int) for p in parts):
            value = math.prod(parts)  # DeepSpeed's definition: micro batch x gas x data-parallel size
    return value


def one_origin(scalars: pl.DataFrame) -> pl.DataFrame:
    """One series per tag: the same tag from csv_monitor, TensorBoard and W&B is one curve; keep the
    origin with most points (then the more exact one), and the lowest rank (the collector can log
    scalars on every rank). Within it, after a restart the later segment's point replaces the
    earlier one at the same x."""
    if scalars.is_empty():
        return scalars
    preference = {o: i for i, o in enumerate(ORIGIN_PREFERENCE)}
    counts = (scalars.group_by("name", "origin").len()
              .with_columns(pref=pl.col("origin").replace_strict(preference, default=len(preference)))
              .sort(["name", "len", "pref"], descending=[False, True, False])
              .unique("name", keep="first").select("name", "origin"))
    rank = pl.col("rank").fill_null(0)
    return (scalars.join(counts, on=["name", "origin"])
            .filter(rank == rank.min().over("name"))
            .sort(["name", "global_samples", pl.col("segment").fill_null(0)])
            .unique(["name", "global_samples"], keep="last", maintain_order=True))


def with_axes(scalars: pl.DataFrame, facts: dict) -> pl.DataFrame:
    """Fill step (= global_samples / train_batch_size) and global_tokens (x seq_len) where the run facts allow."""
    batch, seq_len = run_fact(facts, "train_batch_size"), run_fact(facts, "seq_len")
    columns = []
    if isinstance(batch, int) and batch > 0:
        columns.append(pl.col("step").fill_null(pl.col("global_samples") // batch))
    if isinstance(seq_len, int) and seq_len > 0:
        columns.append(pl.col("global_tokens").fill_null(pl.col("global_samples") * seq_len))
    return scalars.with_columns(columns) if columns else scalars


def aligned_curves(runs: dict[str, tuple[pl.DataFrame, dict]], axis: str = "global_samples") -> pl.DataFrame:
    """Curves of several runs on one x axis: columns run, name, origin, x, value. `axis` is
    global_samples or global_tokens; points without that axis (tokens need seq_len) are left out."""
    if axis not in ("global_samples", "global_tokens"):
        raise ValueError(f"curves align on global_samples or global_tokens, not {axis!r}: a step means "
                         "a different number of samples in runs with other batch settings")
    frames = []
    for run, (scalars, facts) in runs.items():
        frame = with_axes(one_origin(scalars), facts).filter(pl.col(axis).is_not_null())
        frames.append(frame.select(pl.lit(run).alias("run"), "name", "origin", pl.col(axis).alias("x"), "value"))
    return pl.concat(frames) if frames else pl.DataFrame()


def robust_z(values: np.ndarray, neighbours: int = NEIGHBOURS, min_history: int = MIN_HISTORY
             ) -> tuple[np.ndarray, np.ndarray]:
    """(modified z-score, median of the neighbours) of each point against the finite points within
    `neighbours` on either side; NaN with under `min_history` points before it or no spread (MAD 0)."""
    z, medians = np.full(len(values), np.nan), np.full(len(values), np.nan)
    finite = np.where(np.isfinite(values), values, np.nan)
    before = np.cumsum(~np.isnan(finite)) - ~np.isnan(finite)  # finite points before each index
    for i in np.flatnonzero(before >= min_history):
        around = np.concatenate([finite[max(0, i - neighbours):i], finite[i + 1:i + 1 + neighbours]])
        around = around[~np.isnan(around)]
        median = np.median(around)
        mad = np.median(np.abs(around - median))
        medians[i] = median
        if mad > 0 and np.isfinite(values[i]):
            z[i] = MAD_Z_SCALE * (values[i] - median) / mad
    return z, medians


def _alarm(kind: str, row: dict, value: float, baseline, score, threshold, detail: str) -> dict:
    return {"alarm": kind, "name": row["name"], "origin": row["origin"], "source": row["source"],
            "global_samples": row["global_samples"], "step": row["step"], "value": value, "baseline": baseline,
            "score": score, "threshold": threshold, "detail": detail}


def _series_alarms(series: pl.DataFrame, grad_norm_threshold: float | None) -> list[dict]:
    name = series["name"][0]
    values = series["value"].to_numpy().astype(float)
    rows = series.to_dicts()
    alarms = [_alarm("nan_inf", row, v, None, None, None, f"{name} is {v} at global sample {row['global_samples']}")
              for row, v in zip(rows, values) if not math.isfinite(v)]
    z, medians = robust_z(values)

    def spikes(kind: str, upward: bool, min_change: float = 0.0) -> None:
        for i in np.flatnonzero(np.nan_to_num(z if upward else -z, nan=-np.inf) > SPIKE_Z):
            change = values[i] / medians[i] - 1 if medians[i] else math.inf
            if abs(change) < min_change:
                continue
            alarms.append(_alarm(kind, rows[i], values[i], medians[i], z[i], SPIKE_Z,
                                 f"{name} = {values[i]:.6g} against a median of {medians[i]:.6g} around it "
                                 f"({change:+.1%}); robust z = {z[i]:.1f}, |z| > {SPIKE_Z} (Iglewicz & Hoaglin)"))

    if GRAD_NORM.search(name):
        if grad_norm_threshold is None:
            spikes("grad_norm_high", upward=True)
        else:
            alarms += [_alarm("grad_norm_high", row, v, None, None, grad_norm_threshold,
                              f"{name} = {v:.6g} > threshold {grad_norm_threshold:g}")
                       for row, v in zip(rows, values) if math.isfinite(v) and v > grad_norm_threshold]
    elif LOSS.search(name):
        spikes("loss_spike", upward=True)
    elif RATE.search(name):
        spikes("throughput_drop", upward=False, min_change=THROUGHPUT_MIN_CHANGE)
    elif DURATION.search(name):  # a slower step is a throughput drop
        spikes("throughput_drop", upward=True, min_change=THROUGHPUT_MIN_CHANGE)
    elif MEMORY.search(name):
        alarms += _memory_growth(series, values)
    return alarms


def _memory_growth(series: pl.DataFrame, values: np.ndarray) -> list[dict]:
    from scipy import stats

    x = series["global_samples"].to_numpy().astype(float)
    keep = np.isfinite(values) & np.isfinite(x)
    if keep.sum() < MIN_HISTORY or np.ptp(x[keep]) == 0:
        return []
    slope, intercept, low, high = stats.theilslopes(values[keep], x[keep], alpha=0.95)
    start, end = intercept + slope * x[keep][0], intercept + slope * x[keep][-1]
    growth = (end - start) / abs(start) if start else math.inf
    if low <= 0 or growth < MEMORY_MIN_GROWTH:
        return []
    last = series.row(int(np.flatnonzero(keep)[-1]), named=True)
    return [_alarm("memory_growth", last, float(values[keep][-1]), float(start), float(slope), MEMORY_MIN_GROWTH,
                   f"{last['name']} grows {growth:+.1%} over the run (Theil-Sen slope {slope:.4g} per sample, "
                   f"95% interval {low:.4g}..{high:.4g} above 0)")]


def monitor_alarms(scalars: pl.DataFrame, facts: dict | None = None, grad_norm_threshold: float | None = None
                   ) -> pl.DataFrame:
    """Post-hoc alarms over every tag: nan_inf, loss_spike, grad_norm_high (above
    `grad_norm_threshold` when given, else a robust-z spike), throughput_drop, memory_growth."""
    series = with_axes(one_origin(scalars), facts or {})
    alarms = []
    for _, frame in series.group_by("name", maintain_order=True):
        alarms += _series_alarms(frame.sort("global_samples"), grad_norm_threshold)
    schema = {"alarm": pl.String, "name": pl.String, "origin": pl.String, "source": pl.String,
              "global_samples": pl.Int64, "step": pl.Int64, "value": pl.Float64, "baseline": pl.Float64,
              "score": pl.Float64, "threshold": pl.Float64, "detail": pl.String}
    return pl.DataFrame(alarms, schema=schema)


def comparability(run_facts: dict[str, dict]) -> pl.DataFrame:
    """One row per field that decides whether runs compare: status same, different or missing
    (missing in any run; for the required fields that alone makes the runs incomparable)."""
    rows = []
    for field in COMPARABILITY_FIELDS:
        values = {run: run_fact(facts, field) for run, facts in run_facts.items()}
        missing = sorted(run for run, value in values.items() if value is None)
        distinct = {json.dumps(v, sort_keys=True) for v in values.values() if v is not None}
        if missing:
            status = "missing"
            detail = f"not recorded for {missing}"
            if field in REQUIRED_FIELDS:
                detail += ": runs cannot be shown comparable on this"
        elif len(distinct) > 1:
            status = "different"
            detail = "differs between runs" + (": align curves on global samples, not steps"
                                                if field in ("world_size", "train_micro_batch_size_per_gpu",
                                                             "gradient_accumulation_steps", "train_batch_size") else "")
        elif len(run_facts) == 1:
            status, detail = "recorded", "recorded"
        else:
            status, detail = "same", "same in every run"
        rows.append({"field": field, "required": field in REQUIRED_FIELDS, "status": status,
                     "values": json.dumps(values, sort_keys=True, default=str), "detail": detail})
    return pl.DataFrame(rows, schema={"field": pl.String, "required": pl.Boolean, "status": pl.String,
                                      "values": pl.String, "detail": pl.String})


def monitor_tables(scalars: pl.DataFrame, facts: dict, grad_norm_threshold: float | None = None
                   ) -> dict[str, pl.DataFrame]:
    """The tables `analyze` writes for one run: monitor_alarms, and run_comparability (for one run:
    which of the fields needed to compare it with others are missing)."""
    return {"monitor_alarms": monitor_alarms(scalars, facts, grad_norm_threshold),
            "run_comparability": comparability({"run": facts})}
