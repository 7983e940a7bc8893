"""One definition of step time: the optimizer-step time of a run, from the best source it has.

Every consumer (the verdict, MFU, compare, trials, the report) calls `step_time_table` and
`step_time_summary` (or `from_run_dir` on an analysed run) instead of computing its own.

Sources, best first (the first that has at least one step is used; `source` names it):

* ``train_steps``: the collector's record of every micro step (rows written under ``collector/``).
  Optimizer-step time = the slowest rank's cycle: from the end of the step before (its
  ``engine.step()``) to the end of this one, so the step's data loading, the gaps between its micro
  steps and whatever else runs before its first forward are the step's time, as they are the job's
  (a ProfilerStep window runs the same way: the collector calls prof.step() after engine.step()).
  The run's first step has no step before it to start its cycle: ``no_previous_step``.
* ``log``: what the job's logs give, best first: `train_steps` rows read from logs (same
  definition); DeepSpeed's ``wall_clock_breakdown`` global timers fwd + bwd + step (summed over the
  step's micro steps by DeepSpeed), slowest rank; the throughput line's ``CurrSamplesPerSec``
  (rank 0: train_batch_size / CurrSamplesPerSec, the same fwd-to-step sum, every steps_per_print
  steps); Megatron's ``elapsed time per iteration (ms)`` (an average over the logging interval).
* ``profiler_steps``: the ``ProfilerStep#N`` windows of the traces, slowest rank. Every one ran the
  profiler, so none is excluded for it.

Excluded steps, each named in ``reason`` (several joined by ","):

* ``incomplete``: a rank lacks the step, or the step has no gradient-accumulation boundary (the job
  stopped inside it).
* ``overflow_skipped``: fp16 overflow, the optimizer skipped the step (``train_steps.skipped``).
* ``flops_profiler``: the collector's FLOPs profile (``flops_profile.profile_step``) or DeepSpeed's
  own FLOPs profiler (ds_config ``flops_profiler.profile_step``) ran in the step.
* ``profiler_warmup`` / ``profiler_window``: torch.profiler traced the step (warm-up: traced and
  discarded; window: recorded). From the collector's schedule (skip_first, wait, warmup, active,
  repeat; ProfilerStep#N is optimizer step N) and the ProfilerStep numbers found in the traces.
* ``profiler_export``: the step after a window's last step. Each rank writes its trace
  (on_trace_ready) before starting it, each at its own pace, so its collectives wait for the
  slowest writer.
* ``collector_flush``: a step during which the steplens collector wrote a flush (every ``flush_every``-th
  step's rows, on its writer thread: on a machine with few cores that thread takes CPU from the step); from
  the run fact ``first_flush_step`` and the collector's ``flush_every`` (5 or more; flushing more often, every
  step holds its share of the cost and none is left out: contract/alarm_rules.py ``flush_steps``).
* ``checkpoint_save``: the step that follows a checkpoint save (``facts["checkpoint_steps"]``: the
  optimizer steps done when the save began, from the DeepSpeed/Megatron log lines or the collector's
  wrapped ``save_checkpoint``). The save runs between steps: the ranks enter that step's first
  collective as each finishes saving, and a log interval that holds it holds the save (and the
  collector's cycle of that step holds the save itself).
* ``evaluation``: the step that follows an evaluation (``facts["evaluation_steps"]``, Megatron's "validation
  loss at iteration N"); a log interval that holds it (Megatron prints every log_interval-th iteration, each the
  interval's average) holds the evaluation's time. No training step's work.
* ``negative_duration``: the step (or one of its micro steps, or one of its timers) ends before it
  starts: clock trouble.
* ``no_time``: the step's time is 0, or none (a logged nan or inf): nothing was measured (DeepSpeed's
  FLOPs profiler leaves the timers of the step it profiles at 0).
* ``longer_than_run``: the step is longer than the run's span (first step start to last step end, or
  first to last log line): a unit error or clock trouble. Both also become an `inputs_disagree`
  finding (analyze/analyses/sanity.py).
* ``warm_up``: the run's first steps while each is slower than the steady state beyond its noise:
  above median + max(3.5 MAD / 0.6745, 5% of the median) of the steps not excluded for another
  reason (the modified z-score of Iglewicz & Hoaglin, as `monitor`); the scan stops at the first
  step within that bound, and never takes more than half of the steps. Needs 3 steps.

Summary (``findings.json`` ``step_time``): ``median_ns`` (mean of the middle two for an even count,
rounded to the ns), ``p90_ns`` (nearest rank: the ceil(0.9 n)-th smallest), ``max_ns`` over the
steps kept. With fewer than 3 kept steps that differ by more than 5% there is no median or p90 (no
step had it): ``note`` says so and ``kept_steps`` lists them.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import polars as pl
import pyarrow as pa

from steplens.analyze.contract import alarm_rules, schema
from steplens.analyze.contract.manifest import MAX_STEP
from steplens.analyze.contract.text import number_ranges
from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.analyses.percentile import nearest_rank
from steplens.analyze.analyses.steps import refused_ranks
from steplens.analyze.contract.units import duration

MAD_Z_SCALE = 0.6745  # modified z-score (Iglewicz & Hoaglin 1993): 0.6745 (x - median) / MAD
OUTLIER_Z = 3.5  # their recommended cut
MIN_EXCESS_SHARE = 0.05  # and at least 5% above the median: a MAD of ~0 does not make 1 us "slow"
MIN_STEPS_FOR_NOISE = 3
LISTED_STEPS = 50  # excluded steps listed per reason in findings.json (the table has them all)

GLOBAL_TIMERS = ({"fwd", "forward"}, {"bwd", "backward"}, {"step"})  # names before DeepSpeed 0.9 in the first set
MEGATRON_ITERATION = "elapsed time per iteration (ms)"
PIPELINE_ITERATION = "iter time (s)"  # DeepSpeed's pipeline engine
# How a log prints 0-based step s of each log source: after s + 1 steps are done, as "iteration s+1" (Megatron),
# "global_step=s+1" (the throughput line) or "step=s+1" (the step line, printed before step s's timer line).
LOG_STEP_LABELS = {"log_megatron": "iteration", "log_throughput": "global_step=", "log_timers": "step=",
                   "log_train_steps": "step=", "log_pipeline": "steps:"}
DEFINITIONS = {
    "collector": "collector train_steps: per optimizer step, the slowest rank's time from the end of the step before "
                 "(engine.step()) to the end of this one (the whole iteration: its data loading, every micro step and "
                 "engine.step())",
    "log_train_steps": "train_steps read from the logs: per optimizer step, the slowest rank's time from the end of the "
                       "step before to the end of this one",
    "log_timers": "DeepSpeed wall_clock_breakdown: fwd + bwd + step of the step's global timer line, slowest rank",
    "log_throughput": "DeepSpeed throughput line: train_batch_size / CurrSamplesPerSec (rank 0's fwd-to-step time "
                      "of that step), every steps_per_print steps",
    "log_megatron": "Megatron 'elapsed time per iteration': mean iteration time over each logging interval",
    "log_pipeline": "DeepSpeed pipeline engine 'iter time (s)': mean iteration time over each steps_per_print interval",
    "profiler_steps": "ProfilerStep#N windows in the traces, slowest rank (every one ran the profiler)",
}
COLUMNS = {
    "step": pl.Int64, "source": pl.String, "step_time_ns": pl.Int64, "slowest_rank": pl.Int64, "ranks": pl.Int64,
    "micro_steps": pl.Int64, "work_ns": pl.Int64, "outside_ns": pl.Int64, "outside_rank": pl.Int64,
    "least_outside_ns": pl.Int64, "start_ns": pl.Int64, "end_ns": pl.Int64, "samples": pl.Int64,
    "skipped": pl.Boolean, "loss_scale": pl.Float64, "excluded": pl.Boolean, "reason": pl.String,
}


def _empty() -> pl.DataFrame:
    return pl.DataFrame(schema=COLUMNS)


def _is_collector(source: pl.Expr) -> pl.Expr:
    return source.str.starts_with("collector/") | source.str.contains("/collector/") | (source == "collector")


def _from_micro_steps(micro: pl.DataFrame) -> pl.DataFrame:
    """Per optimizer step: the slowest rank's cycle, from the end of the step before to the end of this one (the whole
    iteration); incomplete when a rank or the boundary is missing, no_previous when a rank has no step before it."""
    micro = micro.filter(pl.col("step").is_not_null() & pl.col("rank").is_not_null())
    per_rank = micro.group_by("rank", "step").agg(
        micro_steps=pl.len(), negative=(pl.col("dur_ns") < 0).any(), work_ns=pl.col("dur_ns").sum(),
        start_ns=pl.col("start_ns").min(), end_ns=pl.col("end_ns").max(), boundary=pl.col("is_boundary").fill_null(False).any(),
        skipped=pl.col("skipped").fill_null(False).any(),
        samples_after=pl.col("global_samples").filter(pl.col("is_boundary").fill_null(False)).max(),
        loss_scale=pl.col("loss_scale").sort_by("micro_step").last(),
        resumed=pl.col("resumed").any() if "resumed" in micro.columns else pl.lit(False))
    # (the first step a resumed job recorded follows the earlier job's last: the time between is the restart's)
    preceded = (pl.col("step").shift(1).over("rank") == pl.col("step") - 1) & ~pl.col("resumed")
    per_rank = per_rank.sort("rank", "step").with_columns(
        dur_ns=pl.when(preceded).then(pl.col("end_ns") - pl.col("end_ns").shift(1).over("rank"))).with_columns(
        outside_ns=pl.col("dur_ns") - pl.col("work_ns"))  # this rank's own cycle outside its own micro steps
    all_ranks = micro["rank"].n_unique()
    slowest_first = [pl.col("dur_ns").fill_null(-1), "rank"]
    steps = per_rank.group_by("step").agg(
        step_time_ns=pl.col("dur_ns").max(), slowest_rank=pl.col("rank").sort_by(slowest_first).last(),
        work_ns=pl.col("work_ns").max(), outside_ns=pl.col("outside_ns").max(),
        outside_rank=pl.col("rank").sort_by(pl.col("outside_ns").fill_null(-1), "rank", descending=[False, True]).last(),
        least_outside_ns=pl.col("outside_ns").min(),
        ranks=pl.col("rank").n_unique().cast(pl.Int64), micro_steps=pl.col("micro_steps").sort_by(slowest_first).last(),
        start_ns=pl.col("start_ns").min(), end_ns=pl.col("end_ns").max(), complete=pl.col("boundary").all(),
        skipped=pl.col("skipped").any(), samples_after=pl.col("samples_after").max(),
        negative=pl.col("negative").any() | (pl.col("dur_ns") < 0).any(), no_previous=pl.col("dur_ns").is_null().any(),
        loss_scale=pl.col("loss_scale").drop_nulls().first())
    return steps.sort("step").with_columns(
        samples=(pl.col("samples_after") - pl.col("samples_after").shift(1)).fill_null(pl.col("samples_after")),
        incomplete=~pl.col("complete") | (pl.col("ranks") < all_ranks),
        step_time_ns=pl.when(~pl.col("no_previous")).then("step_time_ns"),
        slowest_rank=pl.when(~pl.col("no_previous")).then("slowest_rank"),
        outside_ns=pl.when(~pl.col("no_previous")).then("outside_ns"),
        outside_rank=pl.when(~pl.col("no_previous")).then("outside_rank"),
        least_outside_ns=pl.when(~pl.col("no_previous")).then("least_outside_ns"),
    ).drop("complete", "samples_after")


def _from_timers(timers: pl.DataFrame) -> pl.DataFrame:
    """fwd + bwd + step of each global timer line, slowest rank; one source per rank (the fullest)."""
    names = [name for group in GLOBAL_TIMERS for name in group]
    main = timers.filter((pl.col("scope") == "global") & pl.col("timer").is_in(names) & pl.col("step").is_not_null())
    if main.is_empty():
        return pl.DataFrame()
    # The collector and the log may both hold a rank's timers: keep the record with more lines. The collector's
    # record of a rank is all its flushed parts (rank1-00000.parquet, rank1-00001.parquet, ...), one source each.
    record = pl.when(_is_collector(pl.col("source"))).then(pl.col("source").str.replace(r"-\d+\.parquet$", "")) \
        .otherwise(pl.col("source"))
    main = main.with_columns(record=record)
    fullest = (main.group_by("rank", "record").agg(lines=pl.struct("source", "line").n_unique())
               .sort("lines", "record", descending=[True, False]).group_by("rank").first())
    main = main.join(fullest.select("rank", "record"), on=["rank", "record"])
    # One global line per step and rank; a step printed twice (runs appended to one log) keeps its last line.
    per_line = main.group_by("rank", "step", "source", "line").agg(  # importers bound each timer; a sum past int64 is null
        dur_ns=(pl.col("ms").sum() * 1e6).round().cast(pl.Int64, strict=False))
    per_rank = per_line.sort("line").group_by("rank", "step").agg(pl.col("dur_ns").last())
    # Any timer of the step below 0 (a bwd_inner of -298701 ms beside fwd, bwd and step of 0 in a real
    # Megatron-DeepSpeed log, micro-step timers included): its clock went wrong
    negative = timers.filter(pl.col("step").is_not_null() & (pl.col("ms") < 0))["step"].unique().implode()
    return per_rank.group_by("step").agg(
        step_time_ns=pl.col("dur_ns").max(), slowest_rank=pl.col("rank").sort_by("dur_ns", "rank").last(),
        ranks=pl.col("rank").n_unique().cast(pl.Int64)).with_columns(
        incomplete=pl.col("ranks") < pl.col("ranks").max(), negative=pl.col("step").is_in(negative))


def _ns(value: pl.Expr) -> pl.Expr:
    """A logged time in ns, null where the log's number is none (nan, inf, a rate of 5e-12 samples/s: past int64)."""
    return pl.when(value.is_finite()).then(value.round()).cast(pl.Int64, strict=False)


def _from_scalars(scalars: pl.DataFrame, facts: dict) -> tuple[pl.DataFrame, str]:
    logged = scalars.filter((pl.col("origin") == "log") & pl.col("step").is_not_null()) if not scalars.is_empty() \
        else scalars
    if logged.is_empty():
        return pl.DataFrame(), ""
    batch = facts.get("train_batch_size") or (facts.get("ds_config") or {}).get("train_batch_size")
    rate = logged.filter((pl.col("name") == "CurrSamplesPerSec") & (pl.col("value") > 0))
    if isinstance(batch, int) and not rate.is_empty():
        seconds = batch / pl.col("value")
        return rate.group_by("step").agg(
            step_time_ns=_ns(seconds * 1e9).max(), slowest_rank=pl.col("rank").first(),
            ranks=pl.col("rank").n_unique().cast(pl.Int64)), "log_throughput"
    iteration = logged.filter(pl.col("name") == MEGATRON_ITERATION)
    if not iteration.is_empty():
        return iteration.group_by("step").agg(
            step_time_ns=_ns(pl.col("value") * 1e6).max(), slowest_rank=pl.col("rank").first(),
            ranks=pl.col("rank").n_unique().cast(pl.Int64)), "log_megatron"
    iteration = logged.filter(pl.col("name") == PIPELINE_ITERATION)
    if not iteration.is_empty():
        return iteration.group_by("step").agg(
            step_time_ns=_ns(pl.col("value") * 1e9).max(), slowest_rank=pl.col("rank").first(),
            ranks=pl.col("rank").n_unique().cast(pl.Int64)), "log_pipeline"
    return pl.DataFrame(), ""


def _from_profiler(profiler_steps: pl.DataFrame) -> pl.DataFrame:
    per_rank = profiler_steps.group_by("rank", "step").agg(
        dur_ns=(pl.col("end_ns").max() - pl.col("start_ns").min()), start_ns=pl.col("start_ns").min(),
        end_ns=pl.col("end_ns").max())
    return per_rank.group_by("step").agg(
        step_time_ns=pl.col("dur_ns").max(), slowest_rank=pl.col("rank").sort_by("dur_ns", "rank").last(),
        ranks=pl.col("rank").n_unique().cast(pl.Int64), start_ns=pl.col("start_ns").min(),
        end_ns=pl.col("end_ns").max()).with_columns(incomplete=pl.col("ranks") < pl.col("ranks").max())


def recordings(train_steps: pl.DataFrame) -> pl.DataFrame:
    """Per row of train_steps (in its order): `superseded`, a row a later recording on the same rank went back over,
    and `resumed`, the first row a later recording kept (its step follows one of the earlier recording: the time
    between them is the restart's, no step's).

    A job run again into the same folder, or resumed from a checkpoint older than where it stopped, records (step,
    micro step) again from where it started: every row of the earlier recording from that point on, re-run or not (a
    run again for fewer steps leaves the earlier job's last steps behind), belongs to a timeline the run left; summing
    it with the later one doubled steps and mixed two jobs. A row is superseded when a row starting later (or a copy at
    the same time, written after it) has a (step, micro step) no higher. Only on a rank that records some optimizer
    step twice (a later recording repeats at least the step it starts from): rows out of time order on a rank that
    repeats none are a clock that went back, which the steps' negative durations say. Rows without a step, a micro
    step or a start take no part."""
    rows = train_steps.with_row_index("row").select("row")
    if train_steps.is_empty():
        return rows.with_columns(superseded=pl.lit(False), resumed=pl.lit(False)).drop("row")
    timed = pl.col("step").is_not_null() & pl.col("micro_step").is_not_null() & pl.col("start_ns").is_not_null()
    repeats = pl.col("step").filter(pl.col("is_boundary").fill_null(False)).is_duplicated().any().over("rank")
    ranked = (train_steps.select("rank", "step", "micro_step", "start_ns", "is_boundary").with_row_index("row")
              .filter(timed).filter(repeats)
              .with_columns(key=pl.struct("step", "micro_step").rank("dense").cast(pl.Int64))
              .sort("rank", "start_ns", "row"))
    # the lowest key among the rows after each, on its rank
    after = pl.col("key").reverse().cum_min().reverse().shift(-1).over("rank")
    ranked = ranked.with_columns(superseded=pl.col("key") >= after)
    # a kept row whose row before it (by start) has its key or a higher one, at another time (not a copy of it)
    before = [pl.col(c).shift(1).over("rank") for c in ("key", "start_ns")]
    ranked = ranked.with_columns(resumed=~pl.col("superseded").fill_null(False) & (before[0] >= pl.col("key"))
                                 & (before[1] != pl.col("start_ns")))
    return rows.join(ranked.select("row", "superseded", "resumed"), on="row", how="left").sort("row").select(
        pl.col("superseded").fill_null(False), pl.col("resumed").fill_null(False))


def earlier_recording(train_steps: pl.DataFrame, rows: pl.DataFrame, time: str) -> pl.Series:
    """Per row of another per-step table the collector writes (rank, step and the time column `time`): whether an
    earlier job recorded it on a timeline a later recording went back over (recordings): the later one started after
    it, at its step or before. Its calls or scalars are the earlier job's, as its train_steps rows are."""
    keep = pl.Series("earlier", [False] * rows.height, pl.Boolean)
    if train_steps.is_empty() or rows.is_empty() or not {"rank", "step", time} <= set(rows.columns):
        return keep
    restarts = train_steps.filter(recordings(train_steps)["resumed"]).select("rank", at_ns="start_ns", from_step="step")
    if restarts.is_empty():
        return keep
    # on each rank, the lowest step a recording starting at or after each restart goes back to
    restarts = restarts.sort("rank", "at_ns").with_columns(
        lowest=pl.col("from_step").reverse().cum_min().reverse().over("rank")).sort("at_ns")
    probe = rows.select("rank", "step", time).with_row_index("row").drop_nulls(["rank", time]).sort(time)
    found = probe.join_asof(restarts, left_on=time, right_on="at_ns", by="rank", strategy="forward",
                            check_sortedness=False)
    gone = found.filter(pl.col("step") >= pl.col("lowest"))["row"]
    return rows.with_row_index("row").select(earlier=pl.col("row").is_in(gone.implode()))["earlier"]


def superseded(train_steps: pl.DataFrame) -> pl.Series:
    """recordings' `superseded`: the rows a later recording on the same rank went back over."""
    return recordings(train_steps)["superseded"]


def repeated_steps(train_steps: pl.DataFrame) -> dict | None:
    """The optimizer steps of rows a later recording superseded on some rank (they are left out), or None."""
    if train_steps.is_empty():
        return None
    repeated = train_steps.filter(superseded(train_steps))
    if repeated.is_empty():
        return None
    steps = sorted(repeated["step"].drop_nulls().unique().to_list())
    ranks = sorted(repeated["rank"].drop_nulls().unique().to_list())
    # a recording at the very start time of another is the same one written twice (a part copied), not a run again
    copies = train_steps.select(pl.struct("rank", "micro_step", "start_ns").is_duplicated()).to_series().sum()
    return {"micro_steps": repeated.height, "steps": steps[:LISTED], "step_count": len(steps), "ranks": ranks[:LISTED],
            "rank_count": len(ranks), "copies": int(copies) // 2 if copies else 0}


LISTED = 100  # steps or ranks named in findings.json; the count says how many more


def _pick_source(train_steps: pl.DataFrame, step_timers: pl.DataFrame, scalars: pl.DataFrame,
                 profiler_steps: pl.DataFrame, facts: dict) -> tuple[str, str, pl.DataFrame]:
    """(source, definition key, per-step frame) of the best source with at least one step."""
    if not train_steps.is_empty():
        marked = recordings(train_steps)
        train_steps = train_steps.with_columns(resumed=marked["resumed"]).filter(~marked["superseded"])
        collected = train_steps.filter(_is_collector(pl.col("source")))
        if not collected.is_empty():
            return "train_steps", "collector", _from_micro_steps(collected)
        return "log", "log_train_steps", _from_micro_steps(train_steps)
    if not step_timers.is_empty() and not (timed := _from_timers(step_timers)).is_empty():
        return "log", "log_timers", timed
    logged, key = _from_scalars(scalars, facts)
    if not logged.is_empty():
        return "log", key, logged
    if not profiler_steps.is_empty():
        return "profiler_steps", "profiler_steps", _from_profiler(profiler_steps)
    return "", "", pl.DataFrame()



def instrumented_steps(facts: dict, flops_profile: pl.DataFrame, profiler_steps: pl.DataFrame,
                       last_step: int | None = None) -> dict[int, set[str]]:
    """Optimizer step -> instrumentation that ran in it (flops_profiler, profiler_warmup, profiler_window, ...), for
    the steps up to `last_step` (the collector's flushes recur to the end of the run)."""
    found: dict[int, set[str]] = {}

    def mark(step, reason: str) -> None:
        if type(step) is int and 0 <= step <= MAX_STEP:  # (values from a printed ds_config can be anything)
            found.setdefault(step, set()).add(reason)

    if not flops_profile.is_empty():
        for step in flops_profile.filter(_is_collector(pl.col("source")))["profile_step"].drop_nulls().unique():
            mark(step, "flops_profiler")
    ds_profiler = (facts.get("ds_config") or {}).get("flops_profiler")
    if isinstance(ds_profiler, dict) and ds_profiler.get("enabled"):
        # engine.forward profiles when global_steps == profile_step (DeepSpeed's default 1), rank 0
        mark(ds_profiler.get("profile_step", 1), "flops_profiler")
    for step, reason in alarm_rules.profiled_steps((facts.get("settings") or {}).get("profile")):
        mark(step, reason)
    if not profiler_steps.is_empty():
        traced = set(profiler_steps["step"].drop_nulls().unique().to_list())
        for step in traced:
            mark(step, "profiler_window")
            if step + 1 not in traced:
                mark(step + 1, "profiler_export")
    for step in facts.get("checkpoint_steps") or []:
        mark(step, "checkpoint_save")
    for step in flush_steps(facts, last_step):
        mark(step, "collector_flush")
    return found


def _mark_evaluations(instrumented: dict[int, set[str]], evaluations: list[int], steps: pl.Series) -> None:
    """An evaluation after step N runs before step N: the timed row of step N, or the first after it (a log interval's
    row is its last step), holds it."""
    timed = steps.drop_nulls().unique().sort()
    for step in evaluations:
        if type(step) is int and (at := timed.search_sorted(step, side="left")) < len(timed):
            instrumented.setdefault(timed[at], set()).add("evaluation")


def flush_steps(facts: dict, last_step: int | None) -> range:
    """The optimizer steps that ran while the collector wrote a flush on its writer thread, up to `last_step`
    (alarm_rules.flush_steps), from the run fact first_flush_step and the collector's flush_every."""
    return alarm_rules.flush_steps(facts.get("first_flush_step"), (facts.get("settings") or {}).get("flush_every"),
                                   last_step)


def _run_span_ns(frame: pl.DataFrame, scalars: pl.DataFrame) -> int | None:
    """The run's own span: first start to last end of the steps, else first to last log line (3 lines at
    least, so that even a one-iteration logging interval fits twice)."""
    if frame["start_ns"].null_count() < frame.height:
        return frame["end_ns"].max() - frame["start_ns"].min()
    if scalars.is_empty():
        return None
    stamps = scalars.filter(pl.col("origin") == "log")["wall_ns"].drop_nulls()
    return stamps.max() - stamps.min() if stamps.n_unique() >= 3 else None


def _noise_bound(values: pl.Series) -> float | None:
    """Step time above which a step stands out from the run's step-to-step noise; None below 3 steps."""
    if values.len() < MIN_STEPS_FOR_NOISE:
        return None
    median = float(values.median())
    mad = float((values - median).abs().median())
    return median + max(OUTLIER_Z * mad / MAD_Z_SCALE, MIN_EXCESS_SHARE * median)


def _warm_up(frame: pl.DataFrame) -> set[int]:
    """The leading steps above the noise bound of every step not left out for another reason (the warm-up
    steps among them), at most half of those steps."""
    candidates = frame.filter(pl.col("reason").is_null()).sort("step")
    bound = _noise_bound(candidates["step_time_ns"])
    if bound is None:
        return set()
    slow = (candidates["step_time_ns"] > bound).to_list()
    leading = next((i for i, is_slow in enumerate(slow) if not is_slow), len(slow))
    return set(candidates["step"].head(min(leading, candidates.height // 2)).to_list())


def step_time_table(train_steps: pl.DataFrame | None = None, step_timers: pl.DataFrame | None = None,
                    scalars: pl.DataFrame | None = None, profiler_steps: pl.DataFrame | None = None,
                    flops_profile: pl.DataFrame | None = None, facts: dict | None = None) -> pl.DataFrame:
    """Per optimizer step: its time from the best source, and whether (and why) the summary leaves it out.

    Inputs are the run's tables (any may be None or empty): `train_steps`, `step_timers`, `scalars`,
    the per-rank `steps` table (ProfilerStep windows, with `rank`), `flops_profile`; `facts` is
    run.json's facts (ds_config, the collector's settings)."""
    frames = [f if f is not None else pl.DataFrame() for f in (train_steps, step_timers, scalars, profiler_steps,
                                                               flops_profile)]
    train_steps, step_timers, scalars, profiler_steps, flops_profile = frames
    facts = facts or {}
    source, key, frame = _pick_source(train_steps, step_timers, scalars, profiler_steps, facts)
    if frame.is_empty():
        return _empty()
    flags = {"incomplete": pl.Boolean, "negative": pl.Boolean, "no_previous": pl.Boolean}  # set by the sources that can tell
    frame = frame.with_columns([pl.lit(None, dtype).alias(c) for c, dtype in {**COLUMNS, **flags}.items()
                                if c not in frame.columns])
    span = _run_span_ns(frame, scalars)
    frame = frame.with_columns(
        negative=(pl.col("step_time_ns") < 0) | pl.col("negative").fill_null(False),
        too_long=(pl.col("step_time_ns") > span) if span is not None else pl.lit(False))
    instrumented = {} if source == "profiler_steps" else instrumented_steps(
        facts, flops_profile, profiler_steps, frame["step"].max())
    if source != "profiler_steps":  # (ProfilerStep numbers are the profiler's counter, not the log's)
        _mark_evaluations(instrumented, facts.get("evaluation_steps") or [], frame["step"])
    reasons = pl.DataFrame({"step": list(instrumented), "instrumented": [",".join(sorted(r)) for r in instrumented.values()]},
                           schema={"step": pl.Int64, "instrumented": pl.String})
    frame = frame.join(reasons, on="step", how="left").with_columns(
        reason=pl.concat_str(
            pl.when(pl.col("negative").fill_null(False)).then(pl.lit("negative_duration")),
            pl.when(pl.col("step_time_ns") == 0).then(pl.lit("no_time")),
            pl.when(pl.col("too_long").fill_null(False)).then(pl.lit("longer_than_run")),
            pl.when(pl.col("incomplete").fill_null(False)).then(pl.lit("incomplete")),
            pl.when(pl.col("no_previous").fill_null(False)).then(pl.lit("no_previous_step")),
            pl.when(pl.col("skipped").fill_null(False)).then(pl.lit("overflow_skipped")),
            pl.col("instrumented"), separator=",", ignore_nulls=True).replace("", None))
    # no time for no other reason: the log's number was none (nan, inf, past int64)
    frame = frame.with_columns(reason=pl.col("reason").fill_null(
        pl.when(pl.col("step_time_ns").is_null()).then(pl.lit("no_time"))))
    warm = _warm_up(frame)
    frame = frame.with_columns(
        reason=pl.when(pl.col("step").is_in(list(warm))).then(pl.lit("warm_up")).otherwise(pl.col("reason")),
        source=pl.lit(source), definition=pl.lit(DEFINITIONS[key]))
    return frame.with_columns(excluded=pl.col("reason").is_not_null()).select(
        [pl.col(c).cast(dtype) for c, dtype in COLUMNS.items()] + ["definition"]).sort("step")


# Reasons that mark a step the run instrumented: its time is partly the instrument's (profilers, checkpoint saves).
INSTRUMENTATION = ("flops_profiler", "profiler_warmup", "profiler_window", "profiler_export", "checkpoint_save",
                   "collector_flush")


def instrumented(table: pl.DataFrame) -> set[int]:
    """The steps of a step_time table marked for one of the INSTRUMENTATION reasons."""
    if table.is_empty():
        return set()
    reasons = pl.col("reason").fill_null("").str.split(",")
    return set(table.filter(pl.any_horizontal(reasons.list.contains(r) for r in INSTRUMENTATION))["step"].to_list())


def step_time_summary(table: pl.DataFrame) -> dict:
    """The `step_time` block of findings.json: source, steps kept, median/p90/max, excluded steps by reason."""
    if table.is_empty():
        return {"source": None, "steps": 0, "note": "no step times: no collector train_steps, step lines in the logs "
                                                    "or profiler steps"}
    kept = table.filter(~pl.col("excluded"))
    values = kept["step_time_ns"].drop_nulls().to_list()
    excluded = []
    for reason in sorted({r for rs in table["reason"].drop_nulls().to_list() for r in rs.split(",")}):
        rows = table.filter(pl.col("reason").str.split(",").list.contains(reason))
        excluded.append({"reason": reason, "count": rows.height, "steps": rows["step"].head(LISTED_STEPS).to_list(),
                         "step_times_ns": rows["step_time_ns"].head(LISTED_STEPS).to_list()})
    excluded.sort(key=lambda entry: entry["steps"][0])  # in run order
    typical = has_typical_time(values)
    summary = {
        "source": table["source"][0], "definition": table["definition"][0], "steps": len(values),
        "total_steps": table.height, "median_ns": round(statistics.median(values)) if typical else None,
        "p90_ns": nearest_rank(values, 90) if typical else None, "max_ns": max(values) if values else None,
        "max_step": kept.sort("step_time_ns", "step", descending=[True, False])["step"][0] if values else None,
        "excluded_steps": excluded,
        # Megatron logs one mean per logging interval: each value stands for several steps.
        "interval_means": table["definition"][0] in (DEFINITIONS["log_megatron"], DEFINITIONS["log_pipeline"]),
        "log_step_label": LOG_STEP_LABELS.get(definition_key(table["definition"][0]) or ""),
    }
    flushed = table.filter(pl.col("reason") == "collector_flush")["step_time_ns"].drop_nulls()
    if typical and flushed.len() and flushed.median() > (1 + MIN_EXCESS_SHARE) * summary["median_ns"]:
        summary["flush_cost"] = {"steps": flushed.len(), "median_ns": round(flushed.median()),
                                 "kept_median_ns": summary["median_ns"]}
    if not values:
        summary["note"] = "every step was excluded (see excluded_steps)"
    elif not typical:
        summary["note"] = (f"too few steps for a typical time: {len(values)} kept, more than {MIN_EXCESS_SHARE:.0%} apart "
                           f"(a median needs {MIN_STEPS_FOR_NOISE} kept steps, or steps that agree)")
        summary["kept_steps"] = kept.select("step", "step_time_ns").to_dicts()
    return summary


def has_typical_time(values: list[int]) -> bool:
    """Whether kept step times have a typical value: MIN_STEPS_FOR_NOISE of them, or fewer that agree within the
    warm-up rule's own floor (MIN_EXCESS_SHARE). The median of a 403 ms warm-up step and an 86 ms step is a time no
    step had."""
    if len(values) >= MIN_STEPS_FOR_NOISE:
        return True
    return bool(values) and min(values) > 0 and max(values) <= (1 + MIN_EXCESS_SHARE) * min(values)


def noise_bound_ns(table: pl.DataFrame) -> float | None:
    """Step time above which a kept step stands out from the run's own step-to-step noise (None: too few steps)."""
    if table.is_empty():
        return None
    return _noise_bound(table.filter(~pl.col("excluded"))["step_time_ns"].drop_nulls())


def _read(out_dir: Path, table: str) -> pl.DataFrame:
    folder = out_dir / table
    if not folder.exists() or not any(folder.rglob("*.parquet")):
        return pl.DataFrame()
    return pl.read_parquet(folder, hive_partitioning=schema.TABLES[table][2])


def from_run_dir(out_dir: Path) -> tuple[pl.DataFrame, dict]:
    """(step_time_table, step_time_summary) of an ingested run directory (the `.steplens` folder)."""
    out_dir = Path(out_dir)
    manifest = json.loads((out_dir / schema.MANIFEST_FILE).read_text())
    steps = _read(out_dir, "steps")
    table = step_time_table(_read(out_dir, "train_steps"), _read(out_dir, "step_timers"), _read(out_dir, "scalars"),
                            steps.select("rank", "step", "start_ns", "end_ns") if not steps.is_empty() else steps,
                            _read(out_dir, "flops_profile"), manifest.get("facts", {}))
    return table, step_time_summary(table)


def slowest_step(table: pl.DataFrame) -> dict | None:
    """The slowest kept step, only when it stands out from the run's step-to-step noise (else None:
    one step a little slower than the rest is not a finding)."""
    bound = noise_bound_ns(table)
    if bound is None:
        return None
    kept = table.filter(~pl.col("excluded"))
    slow = kept.sort("step_time_ns", "step", descending=[True, False]).row(0, named=True)
    if slow["step_time_ns"] <= bound:
        return None
    return {"step": slow["step"], "rank": slow["slowest_rank"], "dur_ns": slow["step_time_ns"],
            "median_step_ns": round(kept["step_time_ns"].median()), "noise_bound_ns": round(bound),
            "source": slow["source"], "steps": kept.height,
            "basis": f"above median + max({OUTLIER_Z} MAD / {MAD_Z_SCALE}, {MIN_EXCESS_SHARE:.0%} of the median) "
                     f"of the {kept.height} kept steps"}


OUTSIDE_WORTH_SAYING = 0.10  # of the median step: what runs outside the steps' work from here on is said
OUTSIDE_HEADLINE = 0.25  # and leads the verdict from here: a quarter of every step spent outside it


def outside_work(table: pl.DataFrame) -> dict | None:
    """What each kept step spends outside its micro steps (before its first forward, between micro steps: the data
    loader, the job's own work between steps), when the source records both (the collector), rank by rank: each
    rank's own cycle minus its own work, the most of any rank (outside_ns, by outside_rank) and the least
    (least_outside_ns). Their medians over kept steps against the median step; None below OUTSIDE_WORTH_SAYING of
    it. A rank whose data loader is slow spends the time outside its work; the others wait for it inside theirs
    (in their collectives), so the rank with the most outside is the one the others waited for."""
    if table.is_empty() or "outside_ns" not in table.columns:
        return None
    kept = table.filter(~pl.col("excluded") & pl.col("outside_ns").is_not_null() & pl.col("step_time_ns").is_not_null())
    if kept.is_empty() or not kept["step_time_ns"].median():
        return None
    outside, step = kept["outside_ns"].median(), kept["step_time_ns"].median()
    if outside < OUTSIDE_WORTH_SAYING * step:
        return None
    ranks = int(kept["ranks"].max() or 1)
    return {"median_outside_ns": round(outside), "median_step_ns": round(step), "share": outside / step,
            "steps": kept.height, "ranks": ranks,
            "rank": int(kept["outside_rank"].mode().sort()[0]) if ranks > 1 else None,
            "least_outside_ns": round(kept["least_outside_ns"].median()) if ranks > 1 else None,
            "definition": "median over kept steps of the most any rank spent outside its own micro steps in its own "
                          "cycle (its cycle minus its forward-to-engine.step() time); the least any rank spent so "
                          "beside it"}


def profiled_windows(table: pl.DataFrame, profiler_steps: pl.DataFrame) -> dict | None:
    """Where the traced ProfilerStep windows sit in the run: each window's time (slowest rank), the
    same step's time from the run's step-time source, and the run's median step."""
    source = table["source"][0] if table.height else None
    if profiler_steps.is_empty() or source == "profiler_steps":  # then the step time is these windows already
        return None
    windows = _from_profiler(profiler_steps).select("step", profiler_dur_ns="step_time_ns", rank="slowest_rank")
    kept = table.filter(~pl.col("excluded"))
    if source:
        # A ProfilerStep after the last step the run recorded is the profiler's closing span (stopped inside its
        # window when the job ended), no step of training: it is flagged, and the sentence says so.
        last = table["step"].max()
        windows = windows.join(table.select("step", "step_time_ns"), on="step", how="left").with_columns(
            after_last_step=pl.col("step") > last)
    else:
        windows = windows.with_columns(step_time_ns=pl.lit(None, pl.Int64), after_last_step=pl.lit(False))
    values = kept["step_time_ns"].drop_nulls().to_list()
    return {"steps": windows.sort("step").to_dicts(), "source": source,
            "definition": table["definition"][0] if table.height and "definition" in table.columns else None,
            "run_median_ns": round(statistics.median(values)) if has_typical_time(values) else None}


OVERFLOW_FREQUENT_SHARE = 0.05  # fp16 overflow skips are a finding from 5% of the steps (and 2 steps) on


def overflow_finding(table: pl.DataFrame, scalars: pl.DataFrame | None = None) -> dict | None:
    """fp16 steps the optimizer skipped on overflow, and the loss scale; None when nothing was skipped.

    Exact per step from `train_steps`; from a log, the last `skipped_steps` count DeepSpeed printed."""
    if table.is_empty():
        return None
    skipped_steps = table.filter(pl.col("skipped").fill_null(False))["step"].to_list()
    skipped, steps = len(skipped_steps), table.height
    scalars = scalars if scalars is not None else pl.DataFrame()
    if not skipped and not scalars.is_empty():
        # DeepSpeed's step=N, skipped=S line: S steps skipped of the N done so far (printed every steps_per_print).
        counts = scalars.filter((pl.col("origin") == "log") & (pl.col("name") == "skipped_steps")
                                & pl.col("step").is_not_null() & pl.col("value").is_not_null()).sort("step")
        if counts.height:
            skipped, steps = int(counts["value"].max()), int(counts["step"].max()) + 1
    if not skipped:
        return None
    scales = table.sort("step")["loss_scale"].drop_nulls()
    share = skipped / steps
    return {"skipped_steps": skipped, "steps": steps, "share": share, "steps_skipped": skipped_steps[:LISTED_STEPS],
            "frequent": skipped >= 2 and share >= OVERFLOW_FREQUENT_SHARE,
            "loss_scale_first": scales[0] if scales.len() else None, "loss_scale_min": scales.min() if scales.len() else None,
            "loss_scale_last": scales[-1] if scales.len() else None}


# ---------------------------------------------------------------------------------------------
# What it says


# How the step line names the steps left out for each reason ({steps}: "step 4" or "steps 10-13, 20").
EXCLUSION_WORDS = {"warm_up": "warm-up {steps}", "flops_profiler": "FLOPs profiler {steps}",
                   "profiler_warmup": "profiler warm-up {steps}", "profiler_window": "profiler window {steps}",
                   "profiler_export": "trace export {steps}", "checkpoint_save": "checkpoint save {steps}",
                   "evaluation": "{steps} (after an evaluation)",
                   "collector_flush": "{steps} (the collector's flushes)",
                   "overflow_skipped": "{steps} (skipped on fp16 overflow)",
                   "incomplete": "{steps} (incomplete: a rank's record is missing, or the job stopped inside)",
                   "negative_duration": "{steps} (end before start)", "longer_than_run": "{steps} (longer than the run)",
                   "no_time": "{steps} (no time measured)", "no_previous_step": "{steps} (no step before to time from)"}


SOURCE_WORDS = {"train_steps": "the collector's train_steps", "log": "the logs", "profiler_steps": "the profiled steps"}
SHORT_SOURCE_WORDS = {"train_steps": "collector", "log": "logs", "profiler_steps": "profiled steps"}
# DeepSpeed's wall_clock_breakdown timers time fwd, bwd and step, not the iteration around them (data loading, the
# script's own work): said wherever the step time comes from them, so it is not read as the job's step
# (DeepSpeed's throughput line times rank 0's fwd to step, too)
PART_OF_STEP_WORDS = {
    "log_timers": {"full": "the logs' fwd + bwd + step timers (wall_clock_breakdown: not the whole iteration)",
                   "short": "logs: fwd+bwd+step", "subject": "the logs' fwd + bwd + step"},
    "log_throughput": {"full": "the logs' throughput lines (rank 0's fwd to step: not the whole iteration)",
                       "short": "logs: fwd-to-step", "subject": "the logs' throughput line"},
}


def definition_key(definition: str | None) -> str | None:
    """The DEFINITIONS key of a step-time definition (None: none of them)."""
    return next((key for key, words in DEFINITIONS.items() if words == definition), None)


def source_words(summary: dict, form: str = "full") -> str:
    """Where the step time came from, in words: `full`, `short` (the first screen's) or `subject` (of 'timed it')."""
    if (key := definition_key(summary.get("definition"))) in PART_OF_STEP_WORDS:
        return PART_OF_STEP_WORDS[key][form]
    source = summary.get("source")
    return (SHORT_SOURCE_WORDS if form == "short" else SOURCE_WORDS).get(source, source)


def _step_ranges(steps: list[int], count: int) -> str:
    """[8, 9, 10, 12] -> "8-10, 12" (and how many more when the list was cut)."""
    more = f" and {count - len(steps)} more" if count > len(steps) else ""
    return number_ranges(steps) + more


def step_name(step: int, summary: dict, aside: str = ", {}") -> str:
    """'step 2109', and for a step from the logs the number they print for it (in `aside`): steps are 0-based,
    and a log prints each one when it is done ("iteration 2110", "global_step=2110")."""
    label = summary.get("log_step_label")
    if label is None or step is None:
        return f"step {step}"
    return f"step {step}" + aside.format(f"the log's {label}{'' if label.endswith('=') else ' '}{step + 1}")


def _times(excluded: dict) -> str:
    """' (659 ms)': what the left-out steps took, when the kept ones are too few to say what a step takes."""
    times = [t for t in excluded.get("step_times_ns") or [] if t is not None]
    return f" ({', '.join(duration(t) for t in times[:3])})" if times and excluded["count"] <= 3 else ""


def step_lines(summary: dict) -> list[str]:
    """Step time over the run, the slowest step when it stands out, and where the profiled steps sit."""
    lines = []
    source = source_words(summary)
    few = summary.get("kept_steps")  # too few kept steps, too far apart, for a typical time
    if summary.get("steps") == 1:
        line = (f"Step time: {duration(summary['max_ns'])} ({step_name(summary['max_step'], summary)}, the only one of "
                f"{summary['total_steps']} kept), from {source}")
    elif few:
        line = (f"Step time: too few steps for a typical time: {len(few)} of {summary['total_steps']} kept ("
                + ", ".join(f"{step_name(k['step'], summary)} {duration(k['step_time_ns'])}" for k in few)
                + "; no median of steps this unlike), from " + source)
    elif summary.get("steps"):
        line = (f"Step time: median {duration(summary['median_ns'])}, p90 {duration(summary['p90_ns'])}, max {duration(summary['max_ns'])} "
                f"({step_name(summary['max_step'], summary)}) over {summary['steps']} of {summary['total_steps']} "
                + ("logged iterations, each the mean of its logging interval" if summary.get("interval_means") else "steps")
                + f", from {source}")
    if summary.get("steps") and (other := summary.get("other_job_ranks")):
        line += f" of the ranks of one job (rank{'s' if len(other) > 1 else ''} {number_ranges(other)} left out: another job's trace)"
    if summary.get("steps"):
        if excluded := summary.get("excluded_steps"):
            line += "; left out: " + "; ".join(
                EXCLUSION_WORDS.get(e["reason"], e["reason"] + " {steps}").format(
                    steps=f"{'step' if e['count'] == 1 else 'steps'} {_step_ranges(e['steps'], e['count'])}")
                + (_times(e) if few else "") for e in excluded)
        lines.append(line + ".")
    elif summary.get("source"):
        lines.append(f"Step time: none of the {summary['total_steps']} steps is typical ({summary.get('note')}).")
    if slow := summary.get("slowest_step"):
        lines.append(f"Slowest step: {step_name(slow['step'], summary, ' ({})')}" + (f" on rank {slow['rank']}" if slow.get("rank") is not None else "")
                     + f", {duration(slow['dur_ns'])} against a median of {duration(slow['median_step_ns'])}, beyond the run's "
                     f"step-to-step noise (above {duration(slow['noise_bound_ns'])}).")
    overflow = summary.get("fp16_overflow") or {}
    if overflow.get("frequent"):
        scale = (f"; loss scale {overflow['loss_scale_first']:,.0f} at the start, {overflow['loss_scale_min']:,.0f} at its "
                 f"lowest, {overflow['loss_scale_last']:,.0f} at the end" if overflow.get("loss_scale_min") is not None else "")
        lines.append(f"fp16 overflow: the optimizer skipped {overflow['skipped_steps']} of {overflow['steps']} steps "
                     f"({overflow['share']:.0%}){scale}. Skipped steps do no training: check the loss for inf/NaN and the "
                     "initial loss scale (fp16.initial_scale_power), or use bf16.")
    if repeated := summary.get("repeated_steps"):
        steps = _step_ranges(repeated["steps"], repeated["step_count"])
        ranks = f"rank{'s' if repeated['rank_count'] > 1 else ''} {_step_ranges(repeated['ranks'], repeated['rank_count'])}"
        if repeated.get("copies") == repeated["micro_steps"]:
            lines.append(f"Steps {steps} were recorded twice with the same times ({ranks}, {repeated['micro_steps']} "
                         "micro step(s)): a collector part copied under another name; each counted once.")
        else:
            lines.append(f"Steps {steps} of an earlier recording are left out ({ranks}, {repeated['micro_steps']} micro "
                         "step(s)): a later job in the same folder went back to an earlier step (the job run again, or "
                         "resumed from an earlier checkpoint), and only the timeline it went on with is timed.")
    profiled = summary.get("profiled_steps") or {}
    for window in profiled.get("steps", [])[:PROFILED_SAID]:
        timed = (f"; {source_words(profiled, 'subject')} timed it {duration(window['step_time_ns'])}"
                 if window.get("step_time_ns") is not None else "")
        median = (f", the run's median step is {duration(profiled['run_median_ns'])}"
                  if profiled.get("run_median_ns") is not None else "")
        if window.get("after_last_step"):
            lines.append(f"ProfilerStep {window['step']} ({duration(window['profiler_dur_ns'])}, rank {window['rank']}) "
                         f"began after the last step {source_words(profiled)} "
                         "recorded: the profiler was stopped inside its window, so it is no step of training.")
            continue
        lines.append(f"Profiled step {window['step']} took {duration(window['profiler_dur_ns'])} (ProfilerStep window, "
                     f"rank {window['rank']}{timed}){median}.")
    if len(profiled.get("steps") or []) > PROFILED_SAID:
        more = profiled["steps"][PROFILED_SAID:]
        lines.append(f"{len(more)} more profiled step{'s' if len(more) > 1 else ''} "
                     f"({_step_ranges([w['step'] for w in more], len(more))}): step_time's profiled_steps in findings.json.")
    if flush := summary.get("flush_cost"):
        lines.append(f"The collector's flushes slowed the steps they ran in: median {duration(flush['median_ns'])} over "
                     f"{flush['steps']} such step{'s' if flush['steps'] > 1 else ''} against {duration(flush['kept_median_ns'])} "
                     "(its writer thread takes CPU from the step); left out of the step time; a larger flush_every "
                     "spreads the cost.")
    if outside := summary.get("outside_work"):
        lines.append(outside_line(outside) + ".")
    return lines


ONE_RANK_OUTSIDE = 0.5  # the other ranks spend less than this share of it outside theirs: one rank's, not all's


PROFILED_SAID = 3  # profiled steps given a sentence each; the rest are named


def outside_line(outside: dict) -> str:
    where = ("before a step's first forward or between its micro steps, in no forward, backward or engine.step(): the "
             "data loader, or the job's own work between steps")
    least = outside.get("least_outside_ns")
    if outside.get("rank") is not None and least is not None and least < ONE_RANK_OUTSIDE * outside["median_outside_ns"]:
        return (f"Outside the steps' work: rank {outside['rank']} spends {duration(outside['median_outside_ns'])} of "
                f"each {duration(outside['median_step_ns'])} step ({outside['share']:.0%}, median) {where}; the other "
                f"ranks as little as {duration(least)}, waiting for it inside their work (in their collectives)")
    every = " on every rank" if outside.get("rank") is not None else ""
    return (f"Outside the steps' work: {duration(outside['median_outside_ns'])} of each {duration(outside['median_step_ns'])} "
            f"step ({outside['share']:.0%}, median){every} ran {where}")


# ---------------------------------------------------------------------------------------------
# Its report section


MIN_SERIES_STEPS = 3  # fewer steps are a table, not a curve
STEP_SOURCES = {"train_steps": "the collector (every step)", "log": "the job's logs",
                "profiler_steps": "the profiled ProfilerSteps"}


def steps_section(page, run):
    """Step time over the run (this analysis's step_time), then the profiled steps over ranks (steps.py's)."""
    series, stats, times = run.table("step_time"), run.table("step_stats"), run.table("step_times")
    if series.is_empty() and stats.is_empty():
        return page.section("Step time over the run", "steps",
                            empty="No step times: no collector steps, no step lines in the logs and no ProfilerStep "
                                  "annotations.")
    section = page.section("Step time over the run", "steps")
    summary = run.findings.get("step_time") or {}
    # Where the analyzer placed the profiled windows in the run's own step numbering.
    profiled = [w["step"] for w in (summary.get("profiled_steps") or {}).get("steps", [])]
    if not series.is_empty():
        source = series["source"][0]
        definition = series["definition"][0] if "definition" in series.columns else None
        section.text(f"Step time from {STEP_SOURCES.get(source, source)}" + (f". {definition[0].upper()}{definition[1:]}"
                                                                              if definition else "") + ".")
        if series.height >= MIN_SERIES_STEPS:
            section.figure("step_time_series", series, profiled, summary.get("p90_ns"))
        excluded = series.filter(pl.col("excluded").fill_null(False))
        if not excluded.is_empty():
            section.text("Steps left out of the summary, and why:")
            section.rows(excluded, {"step": ("step", "text"), "step_time_ns": ("step time", "ms"),
                                    "reason": ("reason", "words")}, "step_time")
    if not stats.is_empty():
        if stats.height > 1 and stats["ranks"].max() > 1:  # one step or one rank: a table, not a heatmap
            section.figure("step_heatmap", times)
        many = stats.height > page.rows_shown
        section.text("Profiled steps (CPU ProfilerStep time, over ranks)" +
                     (f"; the {page.rows_shown} slowest of {stats.height}:" if many else ":"))
        shown = stats.sort("max_dur_ns", descending=True) if many else stats.sort("step")
        section.rows(shown, {
            "step": ("step", "text"), "ranks": ("ranks", "text"), "median_dur_ns": ("median over ranks", "ms"),
            "max_dur_ns": ("longest", "ms"), "slowest_rank": ("rank with the longest", "text"),
            "spread_ns": ("longest - shortest", "ms"), "straggler_rank": ("straggler", "text"),
            "others_waited_ns": ("others waited for it", "ms"), "aligned_dur_ns": ("wall time across ranks", "ms")},
            "step_stats")
    return section


# ---------------------------------------------------------------------------------------------
# The analysis


def _step_time(inputs: Inputs) -> Output:
    profiler_steps = inputs.table("steps", ["rank", "step", "start_ns", "end_ns"])
    # A trace refused as a rank of this job (steps.unalignable: another world size, no shared collective) has steps of
    # another job: its windows are no step of this one
    offsets = inputs.table("clock_offsets", ["rank", "method"])
    other_job = refused_ranks(offsets)
    profiler_steps = profiler_steps.filter(~pl.col("rank").is_in(other_job))
    table = step_time_table(inputs.table("train_steps"), inputs.table("step_timers"), inputs.table("scalars"),
                            profiler_steps, inputs.table("flops_profile"), inputs.facts)
    finding = step_time_summary(table)
    if other_job and finding.get("source") == "profiler_steps":
        finding["other_job_ranks"] = other_job
    # The slowest step over the whole run (not only the profiled ones), and only when it stands out.
    if slow := slowest_step(table):
        finding["slowest_step"] = slow
    if windows := profiled_windows(table, profiler_steps):
        finding["profiled_steps"] = windows
    if overflow := overflow_finding(table, inputs.table("scalars")):
        finding["fp16_overflow"] = overflow
    if repeated := repeated_steps(inputs.table("train_steps", ["rank", "step", "micro_step", "start_ns",
                                                               "is_boundary"])):
        finding["repeated_steps"] = repeated
    if outside := outside_work(table):
        finding["outside_work"] = outside
    return Output(tables={"step_time": table}, finding=finding)


STEP_TIME = schema.table_spec(
    ("step", pa.int64(), "Optimizer step, from 0 (ProfilerStep#N when the source is profiler_steps)."),
    ("source", pa.string(), "train_steps (collector) | log | profiler_steps: the best source the run has "
                            "(analyze/analyses/step_time.py)."),
    ("step_time_ns", pa.int64(), "The slowest rank's cycle: the end of the step before to the end of this one "
                                 "(collector, train_steps from logs); logs: the stated time of the step; "
                                 "profiler_steps: the ProfilerStep window."),
    ("slowest_rank", pa.int64(), "Rank with that time."),
    ("ranks", pa.int64(), "Ranks that recorded the step."),
    ("micro_steps", pa.int64(), "Micro steps of the slowest rank."),
    ("work_ns", pa.int64(), "The most any rank spent inside the step's micro steps (forward to the end of "
                            "engine.step(), summed). Null for other sources."),
    ("outside_ns", pa.int64(), "The most any rank spent outside its own micro steps in its own cycle (the data "
                               "loader, the job's own work between steps); null for other sources."),
    ("outside_rank", pa.int64(), "The rank with that time: where a slow data loader is, the others wait for it "
                                 "inside their work."),
    ("least_outside_ns", pa.int64(), "The least any rank spent outside its own micro steps in its own cycle."),
    ("start_ns", pa.int64(), "Earliest start over ranks (rank clocks)."),
    ("end_ns", pa.int64(), "Latest end."),
    ("samples", pa.int64(), "Samples the whole job consumed in the step."),
    ("skipped", pa.bool_(), "The optimizer skipped the step (fp16 overflow)."),
    ("loss_scale", pa.float64(), "fp16 loss scale after the step."),
    ("excluded", pa.bool_(), "Left out of the run's step-time summary."),
    ("reason", pa.string(), "Why: warm_up, flops_profiler, profiler_warmup, profiler_window, profiler_export, "
                            "checkpoint_save, evaluation, collector_flush, overflow_skipped, incomplete, no_previous_step, "
                            "negative_duration, longer_than_run, no_time (comma-separated)."),
    ("definition", pa.string(), "The step-time definition of the source, in words."),
)


ANALYSIS = Analysis("step_time", "Step time over the run", ("train_steps", "step_timers", "scalars", "steps", "flops_profile",
                                                           "clock_offsets"),
                    {"step_time": STEP_TIME}, _step_time,
                    former_keys={key: key for key in ("slowest_step", "profiled_steps", "fp16_overflow")}, phrase=lambda summary, findings: step_lines(summary), section=steps_section)
