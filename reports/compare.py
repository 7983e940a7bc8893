"""A/B comparison of two analysed runs, with a verdict that counts a difference only beyond noise.

Step time is compared on its per-step samples: the difference of medians, a Mann-Whitney U test
(no normality assumption; step times are skewed) and a bootstrap 95% interval of the relative
change of the median. A change is a regression or an improvement only when the interval excludes
zero AND the test rejects equal distributions at ALPHA; with fewer than MIN_SAMPLES steps per run the
verdict says the comparison is not established. The other metrics (MFU, GPU idle, exposed
communication, kernel categories, top kernels) are shown side by side with their deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
from scipy import stats

from steplens.analyze import monitor

from .data import Run, ms

ALPHA = 0.05
CONFIDENCE = 0.95
MIN_SAMPLES = 5  # below this a rank test cannot reach p < 0.05 two-sided (U's exact p floor with 4 vs 4 is 0.029, 3 vs 3 is 0.1)
BOOTSTRAP_RESAMPLES = 4000
SEED = 0  # a fixed seed: the same runs give the same interval


@dataclass
class StepSamples:
    values_ns: np.ndarray
    source: str  # which table and column the samples are


def step_samples(run: Run) -> list[StepSamples]:
    """Per-step wall time from every source the run has, best first: aligned profiler steps across
    ranks, collector optimizer steps, DeepSpeed's wall-clock timers."""
    found = []
    stats_table = run.table("step_stats")
    if not stats_table.is_empty():
        found.append(StepSamples(stats_table["aligned_dur_ns"].drop_nulls().to_numpy(),
                                 "profiler steps: wall time across ranks on the aligned clock (step_stats.aligned_dur_ns)"))
    train = run.table("train_steps")
    if not train.is_empty():
        per_step = train.group_by("rank", "step").agg(pl.col("dur_ns").sum()).group_by("step").agg(pl.col("dur_ns").max())
        found.append(StepSamples(per_step["dur_ns"].drop_nulls().to_numpy(),
                                 "collector optimizer steps: slowest rank's sum of micro steps (train_steps)"))
    timers = run.table("step_timers")
    if not timers.is_empty():
        main = timers.filter((pl.col("scope") == "global") & pl.col("timer").is_in(["fwd", "bwd", "step"])
                             & (pl.col("rank") == pl.col("rank").min()))
        # The same timers may come from the collector and from the log: one source, the fullest.
        fullest = main.group_by("source").len().sort("len", "source", descending=[True, False])["source"].first()
        per_step = main.filter(pl.col("source") == fullest).group_by("line").agg(pl.col("ms").sum())
        if not per_step.is_empty():
            found.append(StepSamples((per_step["ms"] * 1e6).to_numpy(),
                                     "DeepSpeed wall-clock timers: fwd + bwd + step (step_timers)"))
    return found


def common_samples(base: Run, new: Run) -> tuple[StepSamples, StepSamples] | None:
    """The source both runs have with the most steps in the smaller run (ties: the better source)."""
    base_by_source = {s.source: s for s in step_samples(base)}
    pairs = [(base_by_source[s.source], s) for s in step_samples(new) if s.source in base_by_source]
    if not pairs:
        return None
    return max(pairs, key=lambda pair: min(len(pair[0].values_ns), len(pair[1].values_ns)))


def step_time_verdict(base: StepSamples, new: StepSamples) -> dict:
    """Median change and whether it exceeds run-to-run noise."""
    b, n = base.values_ns.astype(float), new.values_ns.astype(float)
    result = {"base_steps": len(b), "new_steps": len(n),
              "base_median_ns": float(np.median(b)) if len(b) else None,
              "new_median_ns": float(np.median(n)) if len(n) else None}
    if base.source != new.source:
        result.update(verdict="not comparable", why=f"step times come from different sources: {base.source} vs {new.source}")
        return result
    result["delta"] = result["new_median_ns"] / result["base_median_ns"] - 1 if len(b) and len(n) else None
    if min(len(b), len(n)) < MIN_SAMPLES:
        result.update(verdict="not established",
                      why=f"{len(b)} and {len(n)} steps; a rank test needs at least {MIN_SAMPLES} per run to detect "
                          "anything at p < 0.05. Trace or log more steps.")
        return result
    test = stats.mannwhitneyu(n, b, alternative="two-sided")
    interval = stats.bootstrap((b, n), _relative_median_change, n_resamples=BOOTSTRAP_RESAMPLES, confidence_level=CONFIDENCE,
                               method="percentile", vectorized=True, rng=np.random.default_rng(SEED)).confidence_interval
    low, high = float(interval.low), float(interval.high)
    result.update(u_statistic=float(test.statistic), p_value=float(test.pvalue), ci_low=low, ci_high=high)
    significant = test.pvalue < ALPHA and (low > 0 or high < 0)
    if not significant:
        result.update(verdict="within noise",
                      why=f"95% interval of the median change {low:+.1%} to {high:+.1%} includes 0 or "
                          f"Mann-Whitney p = {test.pvalue:.3g} >= {ALPHA}")
    else:
        result.update(verdict="regression" if result["delta"] > 0 else "improvement",
                      why=f"median {result['delta']:+.1%}, 95% interval {low:+.1%} to {high:+.1%}, "
                          f"Mann-Whitney U = {test.statistic:.0f}, p = {test.pvalue:.3g}")
    return result


def _relative_median_change(base, new, axis=-1):
    return np.median(new, axis=axis) / np.median(base, axis=axis) - 1


def metrics(run: Run) -> dict[str, float | None]:
    """The scalar metrics shown side by side; per step and rank where they add up over a run."""
    f = run.findings
    step_count = max(run.table("step_stats").height, 1)
    ranks = max(len(run.manifest.get("trace_ranks", [])), 1)
    calls = run.table("collectives")
    mfu = run.table("mfu").filter(pl.col("metric") == "MFU") if not run.table("mfu").is_empty() else pl.DataFrame()
    return {
        "MFU (median)": float(mfu["utilization"].median()) if not mfu.is_empty() else None,
        "GPU idle share": (f.get("gpu_idle") or {}).get("idle_share"),
        "exposed communication per step and rank (ns)": float(calls["exposed_ns"].sum()) / step_count / ranks
        if not calls.is_empty() else None,
    }


def per_step_rank(frame: pl.DataFrame, key: str, run: Run) -> pl.DataFrame:
    """Kernel time per step and rank, so runs with different numbers of traced steps compare."""
    step_count = max(run.table("step_stats").height, 1)
    ranks = max(len(run.manifest.get("trace_ranks", [])), 1)
    return frame.group_by(key).agg((pl.col("time_ns").sum() / step_count / ranks).alias("time_ns"))


def side_by_side(base: pl.DataFrame, new: pl.DataFrame, key: str, limit: int) -> pl.DataFrame:
    joined = base.join(new, on=key, how="full", suffix="_new", coalesce=True).fill_null(0)
    joined = joined.rename({"time_ns": "base_ns", "time_ns_new": "new_ns"}).with_columns(
        delta_ns=pl.col("new_ns") - pl.col("base_ns"),
        delta=pl.when(pl.col("base_ns") > 0).then(pl.col("new_ns") / pl.col("base_ns") - 1))
    return joined.sort(pl.col("delta_ns").abs(), descending=True).head(limit)


def compare(base: Run, new: Run) -> dict:
    pair = common_samples(base, new)
    if pair is None:
        step = {"verdict": "not comparable", "why": "the runs have no step-time source in common (profiler steps, "
                                                    "collector steps or DeepSpeed timers)"}
    else:
        step = step_time_verdict(*pair) | {"source": pair[0].source}
    base_metrics, new_metrics = metrics(base), metrics(new)
    categories = side_by_side(per_step_rank(base.table("kernel_categories"), "category", base),
                              per_step_rank(new.table("kernel_categories"), "category", new), "category", 20) \
        if not base.table("kernel_categories").is_empty() and not new.table("kernel_categories").is_empty() else pl.DataFrame()
    kernels = side_by_side(per_step_rank(base.table("top_kernels"), "name", base),
                           per_step_rank(new.table("top_kernels"), "name", new), "name", 15) \
        if not base.table("top_kernels").is_empty() and not new.table("top_kernels").is_empty() else pl.DataFrame()
    return {
        "base": base.name, "new": new.name, "step_time": step,
        "metrics": [{"metric": k, "base": base_metrics[k], "new": new_metrics[k]} for k in base_metrics],
        "categories": categories, "kernels": kernels, "comparability": (table := comparability(base, new)),
        "warnings": warnings(table, base, new), "curves": curves(base, new),
    }


def _facts(run: Run) -> dict:
    return {"world_size": run.manifest.get("world_size"), **run.manifest.get("facts", {})}


def comparability(base: Run, new: Run) -> pl.DataFrame:
    """monitor.comparability over the two runs' facts: which fields decide whether a step of one is
    the same amount of work as a step of the other, and whether they agree."""
    return monitor.comparability({"base": _facts(base), "new": _facts(new)})


def warnings(table: pl.DataFrame, base: Run, new: Run) -> list[str]:
    found = [f"{row['field']} differs ({row['values']}): {row['detail']}; compare throughput or time per global "
             "sample, not per step." for row in table.filter(pl.col("status") == "different").iter_rows(named=True)]
    found += [f"{row['field']} {row['detail']}." for row in
              table.filter((pl.col("status") == "missing") & pl.col("required")).iter_rows(named=True)]
    devices = [tuple(r.manifest.get("environment", {}).get("device_names", [])) for r in (base, new)]
    if devices[0] and devices[1] and devices[0] != devices[1]:
        found.append(f"devices differ ({', '.join(devices[0])} vs {', '.join(devices[1])}).")
    return found


MAX_CURVES = 4


def curves(base: Run, new: Run) -> pl.DataFrame:
    """Monitor curves of both runs on global samples (never on step), for the names both have."""
    runs = {"base": (base.table("scalars"), _facts(base)), "new": (new.table("scalars"), _facts(new))}
    if any(frame.is_empty() for frame, _ in runs.values()):
        return pl.DataFrame()
    aligned = monitor.aligned_curves(runs, "global_samples").filter(pl.col("value").is_finite())
    common = (aligned.group_by("name").agg(pl.col("run").n_unique().alias("runs")).filter(pl.col("runs") == 2)
              .sort("name")["name"].to_list())
    return aligned.filter(pl.col("name").is_in(common[:MAX_CURVES]))


def regressed(result: dict, threshold_pct: float) -> bool:
    """For --fail-on-regression: a significant step-time increase larger than threshold_pct."""
    step = result["step_time"]
    return step.get("verdict") == "regression" and step["delta"] * 100 > threshold_pct


def _fmt_metric(name: str, value: float | None) -> str:
    if value is None:
        return "n/a"
    return ms(value) if name.endswith("(ns)") else f"{value:.1%}"


def _fmt_delta(base: float | None, new: float | None) -> str:
    if base is None or new is None or base == 0:
        return ""
    return f"{new / base - 1:+.1%}"


def display_tables(result: dict) -> list[dict]:
    """The comparison as titled tables of formatted cells, for HTML, markdown and the terminal alike."""
    step = result["step_time"]
    step_rows = []
    if step.get("base_median_ns") is not None:
        step_rows.append(["median step time", ms(step["base_median_ns"]), ms(step["new_median_ns"]),
                          f"{step['delta']:+.1%}" if step.get("delta") is not None else "",
                          f"{step['base_steps']} / {step['new_steps']}"])
    tables = [{"title": "Step time", "note": step.get("source", ""), "header": ["metric", "base", "new", "change", "steps"],
               "rows": step_rows}]
    tables.append({"title": "Efficiency", "note": "", "header": ["metric", "base", "new", "change"],
                   "rows": [[m["metric"], _fmt_metric(m["metric"], m["base"]), _fmt_metric(m["metric"], m["new"]),
                             _fmt_delta(m["base"], m["new"])] for m in result["metrics"]]})
    comparable = result["comparability"]
    tables.append({"title": "What a step is in each run", "note": "", "header": ["field", "status", "values", "detail"],
                   "rows": [[r["field"], r["status"], r["values"], r["detail"]] for r in comparable.iter_rows(named=True)]})
    for key, title, label in (("categories", "Kernel categories", "category"), ("kernels", "Top kernels", "name")):
        frame = result[key]
        rows = [] if frame.is_empty() else [
            [r[label], ms(r["base_ns"]), ms(r["new_ns"]), ms(r["delta_ns"]), f"{r['delta']:+.1%}" if r["delta"] is not None else "new"]
            for r in frame.iter_rows(named=True)]
        tables.append({"title": title, "note": "GPU time per step and rank, largest changes first.",
                       "header": [label, "base", "new", "delta", "change"], "rows": rows})
    return tables


METHOD = (f"Step times are per-step samples of each run. A change counts only when the {CONFIDENCE:.0%} bootstrap "
          f"interval ({BOOTSTRAP_RESAMPLES} resamples, percentile method) of the relative change of the median excludes "
          f"zero and a two-sided Mann-Whitney U test gives p < {ALPHA}; with fewer than {MIN_SAMPLES} steps per run "
          "the comparison is not established. Other metrics are shown without a test: they are one number per run.")
