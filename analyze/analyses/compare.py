"""A/B comparison of two analysed runs: the verdict on the work done, and the metrics side by side.

A step is only the same amount of work in both runs when micro batch, gradient accumulation, world
size and sequence length agree. When they do, the verdict is on step time (more is a regression). When any of
them differs, the verdict is on throughput per optimizer step, samples per step / step time
(samples/s), or tokens/s when both runs know their sequence length (less is a regression), and the
result says so. The step times themselves come from the best source both runs have; the test is
`noise.two_run_verdict`.

`run` arguments are analysed runs as `steplens.reports.data.load` returns them: `.name`,
`.manifest`, `.findings` and `.table(name)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from steplens.analyze.analyses import monitor, noise, step_time
from steplens.analyze.analyses.mfu import NUMERATOR_WORDS
from steplens.analyze.contract.text import number_ranges
from steplens.analyze.contract import manifest

# Fields that change the work of one optimizer step (monitor.COMPARABILITY_FIELDS names).
WORK_FIELDS = ("world_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
               "seq_len")


@dataclass
class StepSamples:
    values_ns: np.ndarray  # kept optimizer steps' times (step_time's exclusions applied)
    samples: np.ndarray  # samples each of those steps consumed, where the source records it (else null)
    source: str  # the step_time definition they come from
    ranks: tuple[int, ...] = ()  # the ranks whose records they come from (empty: not known)


# Which input table each step_time definition comes from: dropped to fall back to the next source.
_INPUT_OF_DEFINITION = {"collector": "train_steps", "log_train_steps": "train_steps", "log_timers": "step_timers",
                        "log_throughput": "scalars", "log_megatron": "scalars", "log_pipeline": "scalars",
                        "profiler_steps": "profiler_steps"}


def step_samples(run, ranks: tuple[int, ...] | None = None) -> list[StepSamples]:
    """The run's optimizer-step times from every source it has, best first, each by the one step-time
    definition (`step_time.step_time_table`): the best source, then the next once that one's input
    is set aside, and so on; from the records of `ranks` only, when given."""
    steps = run.table("steps")
    inputs = {"train_steps": run.table("train_steps"), "step_timers": run.table("step_timers"),
              "scalars": run.table("scalars"),
              "profiler_steps": steps.select("rank", "step", "start_ns", "end_ns") if not steps.is_empty() else steps,
              "flops_profile": run.table("flops_profile")}
    if ranks is not None:
        inputs = {name: frame.filter(pl.col("rank").is_in(list(ranks))) if "rank" in frame.columns else frame
                  for name, frame in inputs.items()}
    by_text = {text: key for key, text in step_time.DEFINITIONS.items()}
    found = []
    while True:
        table = step_time.step_time_table(**inputs, facts=facts(run))
        if table.is_empty():
            return found
        kept = table.filter(~pl.col("excluded") & pl.col("step_time_ns").is_not_null())
        definition = table["definition"][0]
        source_input = _INPUT_OF_DEFINITION.get(by_text.get(definition))
        covered = inputs[source_input] if source_input else pl.DataFrame()
        found.append(StepSamples(kept["step_time_ns"].to_numpy(), kept["samples"].to_numpy(), definition,
                                 tuple(sorted(covered["rank"].drop_nulls().unique())) if "rank" in covered.columns else ()))
        if source_input is None:  # a definition this module does not know how to set aside: no fallback
            return found
        inputs[source_input] = pl.DataFrame()


def common_samples(base, new) -> tuple[StepSamples, StepSamples] | None:
    """The best source of the base run that the new run also has (the same definition in both), from the same
    ranks when one run's source covers only some of its ranks (DeepSpeed prints its timers on rank 0 alone; the
    collector times every rank): a slowest rank taken over two ranks in one run and over one in the other differs
    by the other rank's lag, not by any change."""
    new_by_source = {s.source: s for s in step_samples(new)}
    for ours in step_samples(base):
        theirs = new_by_source.get(ours.source)
        if theirs is None:
            continue
        if ours.ranks == theirs.ranks or not (_partial(base, ours) or _partial(new, theirs)):
            return ours, theirs
        shared = tuple(sorted(set(ours.ranks) & set(theirs.ranks)))
        again = [next((s for s in step_samples(run, shared) if s.source == ours.source), None) if shared else None
                 for run in (base, new)]
        if again[0] is not None and again[1] is not None:
            return again[0], again[1]
    return None


def _no_common_source(base, new, sources: str) -> str:
    """Why two runs with step times have none to compare: no source in common, or one whose ranks differ (a slowest
    rank over some ranks is not the slowest over others: their lag would read as a change)."""
    theirs = {s.source: s for s in step_samples(new)}
    for ours in step_samples(base):
        other = theirs.get(ours.source)
        if other is not None and ours.ranks and other.ranks and not set(ours.ranks) & set(other.ranks):
            key = _definition_key(ours.source)
            return (f"both have step times from {SOURCE_WORDS.get(key, key)}, but from ranks with none in common "
                    f"(base rank(s) {number_ranges(list(ours.ranks))}, new rank(s) {number_ranges(list(other.ranks))})")
    return "the runs have no step-time source in common" + sources


def _partial(run, samples: StepSamples) -> bool:
    """Whether `samples` come from fewer ranks than the run has (as far as the run states its world size)."""
    world_size = facts(run).get("world_size")
    return bool(samples.ranks) and isinstance(world_size, int) and len(samples.ranks) < world_size


def facts(run) -> dict:
    return manifest.run_facts(run.manifest)


def samples_per_step(run, steps: StepSamples) -> np.ndarray | None:
    """Samples each of `steps` consumed across the job: what the step-time source records (the
    collector's global_samples), else train_batch_size, else micro batch x accumulation x
    data-parallel size; None when the run states none of them."""
    run_facts = facts(run)
    batch = monitor.run_fact(run_facts, "train_batch_size")
    if not batch:
        parts = [monitor.run_fact(run_facts, f) for f in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")]
        data_parallel = manifest.data_parallel_size(run_facts, run_facts.get("world_size"))
        batch = parts[0] * parts[1] * data_parallel if all(parts) and data_parallel else None
    recorded = np.array([np.nan if v is None else v for v in steps.samples], dtype=float)
    recorded[recorded <= 0] = np.nan
    if np.isnan(recorded).any() and not batch:
        return None
    return np.where(np.isnan(recorded), float(batch or 0), recorded)


def _work_differs(table: pl.DataFrame) -> list[str]:
    return table.filter(pl.col("field").is_in(WORK_FIELDS) & (pl.col("status") == "different"))["field"].to_list()


def _work_unrecorded(table: pl.DataFrame) -> list[str]:
    return table.filter(pl.col("field").is_in(WORK_FIELDS) & (pl.col("status") == "missing"))["field"].to_list()


def _same_work(table: pl.DataFrame) -> str:
    """Why step time is judged: every work field recorded and the same, or the ones not recorded (then assumed)."""
    if unrecorded := _work_unrecorded(table):
        return (f"no recorded work field differs, but {', '.join(unrecorded)} are not recorded for every run: a step is "
                "assumed to be the same work in both runs")
    return "a step is the same work in both runs (micro batch, gradient accumulation, world size)"


def _verdict(base, new, pair: tuple[StepSamples, StepSamples] | None, differs: list[str],
             same_work: str = "") -> dict:
    """The judged metric: step time when a step is the same work in both runs, throughput otherwise."""
    if pair is None:
        without = [side for side, run in (("base", base), ("new", new)) if not step_samples(run)]
        sources = " (profiler steps, collector steps, DeepSpeed timers or Megatron iteration times)"
        why = ("neither run has step times" + sources if len(without) == 2 else
               f"the {without[0]} run has no step times" + sources if without else _no_common_source(base, new, sources))
        # with different work per step the verdict would be on throughput (the warnings say so): named as such
        return {"metric": "throughput" if differs else "step time", "unit": None if differs else "ns",
                "verdict": "not comparable", "established": None,
                "why": why}
    base_steps, new_steps = pair
    if not differs:
        return {"metric": "step time", "unit": "ns", "higher_is_better": False, "source": base_steps.source,
                "why_metric": same_work,
                **_typical(noise.two_run_verdict(base_steps.values_ns, new_steps.values_ns, higher_is_better=False),
                           base_steps.values_ns, new_steps.values_ns)}
    samples = {"base": samples_per_step(base, base_steps), "new": samples_per_step(new, new_steps)}
    seq = {"base": monitor.run_fact(facts(base), "seq_len"), "new": monitor.run_fact(facts(new), "seq_len")}
    changed = ", ".join(differs)
    if any(value is None for value in samples.values()):
        missing = [side for side, value in samples.items() if value is None]
        return {"metric": "throughput", "unit": None, "verdict": "not comparable", "established": None,
                "why": f"{changed} differ(s), so a step is not the same work, and the samples per step of the "
                       f"{' and '.join(missing)} run{'s are' if len(missing) > 1 else ' is'} not recorded (no "
                       "global_samples, train_batch_size or batch settings)"}
    tokens = all(seq.values())
    metric, unit = ("tokens/s", "tokens_per_s") if tokens else ("samples/s", "samples_per_s")
    rates = {side: samples[side] * (seq[side] if tokens else 1) / (steps.values_ns / 1e9)
             for side, steps in (("base", base_steps), ("new", new_steps))}
    result = _typical(noise.two_run_verdict(rates["base"], rates["new"], higher_is_better=True), rates["base"], rates["new"])
    return {"metric": metric, "unit": unit, "higher_is_better": True, "source": base_steps.source,
            "samples_per_step": {side: float(np.median(values)) for side, values in samples.items()},
            "seq_len": seq if tokens else None,
            "why_metric": f"{changed} differ(s) between the runs, so a step is not the same work: judged on {metric} "
                          f"per optimizer step ({'samples x sequence length' if tokens else 'samples'} per step / step time)",
            **result}


def _typical(result: dict, base: np.ndarray, new: np.ndarray) -> dict:
    """The verdict without the median of a side whose few values disagree (step_time's rule: the median of a 403 ms
    and an 86 ms step is a time, or a rate, no step had), nor a change computed from it."""
    for side, values in (("base", base), ("new", new)):
        if not step_time.has_typical_time([float(v) for v in values]):
            result.update({f"{side}_median": None, "delta": None})
    return result


def _step_time(pair: tuple[StepSamples, StepSamples] | None) -> dict:
    """Step time side by side (always shown; the verdict is `_verdict`'s)."""
    if pair is None:
        return {}
    b, n = pair
    return {"source": b.source, "base_steps": len(b.values_ns), "new_steps": len(n.values_ns),
            # step_time's rule: no median of too few steps that disagree (it would be a time no step had)
            "base_median_ns": float(np.median(b.values_ns)) if step_time.has_typical_time(list(b.values_ns)) else None,
            "new_median_ns": float(np.median(n.values_ns)) if step_time.has_typical_time(list(n.values_ns)) else None}


def _mfu_figures(run) -> list[dict]:
    """The run's MFU figures as `analyze` states them (median over steps, one per numerator and peak), in its order."""
    stated = run.findings.get("mfu")
    return [r for r in stated if r.get("metric") == "MFU" and r.get("utilization") is not None] \
        if isinstance(stated, list) else []


def mfu_pair(base, new) -> tuple[str, float | None, float | None, str | None]:
    """(label, base, new, why not) for MFU: the first of base's figures whose numerator and peak the new run's
    figures share (a median over every numerator would mix definitions, and other peaks divide by other things)."""
    theirs = {(r["numerator"], r["peak"]): r["utilization"] for r in _mfu_figures(new)}
    for figure in _mfu_figures(base):
        if (figure["numerator"], figure["peak"]) in theirs:
            words = NUMERATOR_WORDS.get(figure["numerator"], figure["numerator"])
            return (f"MFU (median, {words})", figure["utilization"], theirs[(figure["numerator"], figure["peak"])], None)
    figures = {side: _mfu_figures(run) for side, run in (("base", base), ("new", new))}
    if not any(figures.values()):
        return "MFU (median)", None, None, None
    if not all(figures.values()):  # one side's figure shown, the other's n/a: never both n/a beside a number
        side, row = next((side, rows[0]) for side, rows in figures.items() if rows)
        words = NUMERATOR_WORDS.get(row["numerator"], row["numerator"])
        other = "new" if side == "base" else "base"
        return (f"MFU (median, {words})", row["utilization"] if side == "base" else None,
                row["utilization"] if side == "new" else None, f"MFU of the {side} run only: the {other} run has none")
    stated = "; ".join(f"{side}: " + ", ".join(f"{NUMERATOR_WORDS.get(r['numerator'], r['numerator'])} over {r['peak']}"
                                                for r in rows) for side, rows in figures.items())
    return "MFU (median)", None, None, f"MFU not compared: the runs' MFU figures share no numerator and peak ({stated})"


def metrics(run) -> dict[str, float | None]:
    """The scalar metrics shown side by side; per step and rank where they add up over a run (MFU: mfu_pair)."""
    f = run.findings
    step_count = max(run.table("step_stats").height, 1)
    ranks = max(len(run.manifest.get("trace_ranks", [])), 1)
    calls = run.table("collectives")
    return {
        "GPU idle share": (f.get("gpu_idle") or {}).get("idle_share"),
        "exposed communication per step and rank (ns)": float(calls.filter(pl.col("step").is_not_null())["exposed_ns"].sum())
        / step_count / ranks if not calls.is_empty() else None,
    }


def per_step_rank(frame: pl.DataFrame, key: str, run) -> pl.DataFrame:
    """Kernel time per step and rank, so runs with different numbers of traced steps compare."""
    step_count = max(run.table("step_stats").height, 1)
    ranks = max(len(run.manifest.get("trace_ranks", [])), 1)
    if "step" in frame.columns:  # the steps' work only: kernels outside every step added to it (6% in trace_diff)
        frame = frame.filter(pl.col("step").is_not_null())
    return frame.group_by(key).agg((pl.col("time_ns").sum() / step_count / ranks).alias("time_ns"))


def side_by_side(base: pl.DataFrame, new: pl.DataFrame, key: str, limit: int) -> pl.DataFrame:
    joined = base.join(new, on=key, how="full", suffix="_new", coalesce=True).fill_null(0)
    joined = joined.rename({"time_ns": "base_ns", "time_ns_new": "new_ns"}).with_columns(
        delta_ns=pl.col("new_ns") - pl.col("base_ns"),
        delta=pl.when(pl.col("base_ns") > 0).then(pl.col("new_ns") / pl.col("base_ns") - 1))
    # the largest changes first; ties (two identical runs: every delta 0) by time, then name, so the rows shown
    # are the biggest and the same on every run
    return joined.sort(pl.col("delta_ns").abs(), pl.max_horizontal("base_ns", "new_ns"), key,
                       descending=[True, True, False]).head(limit)


def _kernel_tables(base, new) -> dict[str, pl.DataFrame]:
    out = {}
    for key, table, label, limit in (("categories", "kernel_categories", "category", 20), ("kernels", "top_kernels", "name", 15)):
        both = not base.table(table).is_empty() and not new.table(table).is_empty()
        out[key] = side_by_side(per_step_rank(base.table(table), label, base), per_step_rank(new.table(table), label, new),
                                label, limit) if both else pl.DataFrame()
    return out


def compare(base, new) -> dict:
    """Everything `steplens compare` shows: the verdict (the judged metric), step time, metrics,
    kernel tables, what a step is in each run, warnings and monitor curves."""
    pair = common_samples(base, new)
    table = comparability(base, new)
    base_metrics, new_metrics = metrics(base), metrics(new)
    mfu_label, base_mfu, new_mfu, mfu_apart = mfu_pair(base, new)
    verdict = _verdict(base, new, pair, _work_differs(table), _same_work(table))
    shown_curves, shared_curves = curves(base, new)
    return {
        "base": base.name, "new": new.name, "verdict": verdict,
        "step_time": _step_time(pair),
        "metrics": [{"metric": mfu_label, "base": base_mfu, "new": new_mfu}]
        + [{"metric": k, "base": base_metrics[k], "new": new_metrics[k]} for k in base_metrics],
        **_kernel_tables(base, new), "comparability": table,
        "warnings": warnings(table, base, new) + source_warnings(base, new, pair) + rank_warnings(base, new, pair)
        + ([mfu_apart] if mfu_apart else [])
        + ([ONE_RUN_EACH] if verdict.get("established") else [])
        + ([SAME_RUN] if _same_result(base, new) else []),
        "curves": shown_curves, "shared_curves": shared_curves,
    }


SAME_RUN = "both sides are the same result (one run compared with itself): every difference is zero by construction."


def _same_result(base, new) -> bool:
    try:
        return Path(base.out_dir).resolve() == Path(new.out_dir).resolve()
    except (OSError, RuntimeError):
        return False


# The rank test takes the steps of each run as its samples: it tells these two runs apart. What moves a run's
# median from one run to the next (the node, the machine's other load, the hour, the data order) is in neither.
ONE_RUN_EACH = ("one run on each side: the test takes each run's steps as its samples, so it tells these two runs "
                "apart, not the two configurations; what changes from one run to the next (another node, the "
                "machine's other load) is in neither. Repeat each run and compare them with `steplens trials` "
                "before trusting the difference.")


SOURCE_WORDS = {"collector": "the collector's train_steps", "profiler_steps": "the profiled ProfilerSteps",
                "log_train_steps": "train_steps lines in the logs", "log_timers": "the wall_clock_breakdown timers",
                "log_throughput": "the throughput lines", "log_megatron": "Megatron's iteration times",
                "log_pipeline": "the pipeline engine's iteration times"}


def source_warnings(base, new, pair: tuple[StepSamples, StepSamples] | None) -> list[str]:
    """When the step-time source both runs share is not a run's own best, what that run's best source says: a
    traced ProfilerStep runs slower than the steps the collector timed."""
    if pair is None:
        return []
    common = _definition_key(pair[0].source)
    found = []
    for side, run in (("base", base), ("new", new)):
        best = step_samples(run)[0]
        if best.source != pair[0].source and len(best.values_ns):
            gives = (f"a median of {np.median(best.values_ns) / 1e6:.3g} ms over {len(best.values_ns)} steps"
                     if step_time.has_typical_time(list(best.values_ns)) else
                     f"{len(best.values_ns)} steps too unlike for a median ({min(best.values_ns) / 1e6:.3g} to "
                     f"{max(best.values_ns) / 1e6:.3g} ms)")
            found.append(f"step times from {SOURCE_WORDS.get(common, common)}, the only source both runs have; the "
                         f"{side} run's own best, {SOURCE_WORDS.get(_definition_key(best.source), best.source)}, gives "
                         f"{gives}.")
    return found


def rank_warnings(base, new, pair: tuple[StepSamples, StepSamples] | None) -> list[str]:
    """Which ranks the step times come from, when a run's source covers only some of its ranks."""
    if pair is None:
        return []
    ranks, source = pair[0].ranks, pair[0].source
    if not (_partial(base, pair[0]) or _partial(new, pair[1])):
        return []
    # what each run's source covers before both were taken from the same ranks
    covered = {side: next(s for s in step_samples(run) if s.source == source) for side, run in (("base", base), ("new", new))}
    partial = [f"in the {side} run they cover {len(covered[side].ranks)} of its {facts(run)['world_size']} ranks"
               for side, run in (("base", base), ("new", new)) if _partial(run, covered[side])]
    words = SOURCE_WORDS.get(_definition_key(source), source)
    return [f"step times of rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} in both runs, from "
            f"{words}: {' and '.join(partial)} (DeepSpeed prints its timers and throughput lines on rank 0 alone, or "
            "a rank's records are missing); a slowest rank over more ranks in one run would differ by the other "
            "ranks' lag, not by any change."]


def _definition_key(definition: str) -> str:
    return step_time.definition_key(definition) or definition


def comparability(base, new) -> pl.DataFrame:
    """monitor.comparability over the two runs' facts: which fields decide whether a step of one is
    the same amount of work as a step of the other, and whether they agree."""
    return monitor.comparability({"base": facts(base), "new": facts(new)})


def warnings(table: pl.DataFrame, base, new) -> list[str]:
    found = [f"{row['field']} differs ({row['values']}): {row['detail']}; the verdict is on throughput, not step time."
             for row in table.filter((pl.col("status") == "different") & pl.col("field").is_in(WORK_FIELDS)).iter_rows(named=True)]
    found += [f"{row['field']} differs ({row['values']})." for row in
              table.filter((pl.col("status") == "different") & ~pl.col("field").is_in(WORK_FIELDS)).iter_rows(named=True)]
    found += [f"{row['field']} {row['detail']}." for row in
              table.filter((pl.col("status") == "missing") & pl.col("required")).iter_rows(named=True)]
    devices = [_devices(run) for run in (base, new)]
    if devices[0] and devices[1] and devices[0] != devices[1]:
        found.append(f"devices differ ({', '.join(devices[0])} vs {', '.join(devices[1])}).")
    return found


def _devices(run) -> tuple[str, ...]:
    """The devices the run's traces name, else those its collector saw (a CPU job's `cpu (N cores)` among them)."""
    traced = run.manifest.get("environment", {}).get("device_names") or []
    if traced:
        return tuple(traced)
    hosts = [v.get("host") for k, v in run.manifest.get("facts", {}).items()
             if k.startswith("collector_rank") and isinstance(v, dict) and isinstance(v.get("host"), dict)]
    return tuple(sorted({d for h in hosts if isinstance(h.get("devices"), list) for d in h["devices"] if isinstance(d, str)}))


MAX_CURVES = 4


def curves(base, new) -> tuple[pl.DataFrame, int]:
    """Monitor curves of both runs on global samples (never on step): the MAX_CURVES of the names both have that a
    reviewer looks at first (loss before memory, as the run's own report), and how many names both have."""
    runs = {"base": (base.table("scalars"), facts(base)), "new": (new.table("scalars"), facts(new))}
    if any(frame.is_empty() for frame, _ in runs.values()):
        return pl.DataFrame(), 0
    aligned = monitor.aligned_curves(runs, "global_samples").filter(pl.col("value").is_finite())
    common = (aligned.group_by("name").agg(pl.col("run").n_unique().alias("runs")).filter(pl.col("runs") == 2)
              ["name"].to_list())
    return aligned.filter(pl.col("name").is_in(monitor.preferred_curves(common, MAX_CURVES))), len(common)


def regressed(result: dict, threshold_pct: float) -> bool:
    """For --fail-on-regression: a significant change for the worse of the judged metric (step time,
    or throughput when the work per step differs) larger than threshold_pct."""
    verdict = result["verdict"]
    return verdict.get("verdict") == "regression" and abs(verdict["delta"]) * 100 > threshold_pct


def as_data(result: dict) -> dict:
    """The verdict as JSON-ready data (`compare --format json`)."""
    return {"base": result["base"], "new": result["new"], "verdict": result["verdict"], "step_time": result["step_time"],
            "metrics": result["metrics"], "warnings": result["warnings"],
            "comparability": result["comparability"].to_dicts()}
