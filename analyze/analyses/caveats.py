"""Method and caveats: the misuses of profiling data that this run's own data shows.

Each check looks at the tables, not at what the user meant, and says what the numbers can and
cannot be used for. A check with nothing to say returns nothing. findings.json `caveats` holds them;
the report and summary.md show them under "Method and caveats".
"""

from __future__ import annotations

import polars as pl

from steplens.analyze.analyses import autotune
from steplens.analyze.analyses.registry import Analysis, Inputs, Output

# A profiler window of more steps than this is "tracing the run", not a bounded window: the
# torch.profiler docs recommend schedule(wait, warmup, active) with a few active steps, because
# tracing costs time on every op and the trace grows without bound.
MAX_WINDOW_STEPS = 10
# Fraction of the run's optimizer steps covered by traces above which the run was mostly traced.
MAX_TRACED_SHARE = 0.5


def caveats(run: Inputs) -> list[dict]:
    found = []
    for check in (_comms_logger_timings, _flops_are_not_time, _whole_run_traced, _curves_on_step, _single_samples,
                  _mfu_definition):
        found.extend(check(run))
    return found


def _comms_logger_timings(run: Inputs) -> list[dict]:
    calls = run.table("comms_calls")
    if calls.is_empty():
        return []
    origins = set(calls["latency_origin"].drop_nulls().to_list())
    synced = calls["synchronized"].fill_null(False).sum()
    collector = calls["source"].cast(pl.String).str.contains(r"(^|/)collector/").fill_null(False)
    who = ("the collector" if collector.all() else "DeepSpeed's comms logger" if not collector.any()
           else "DeepSpeed's comms logger and the collector")
    timed = (f"{calls.height:,} communication calls were timed with synchronizing timers by {who} ({synced:,} forced "
             "a synchronization)" if synced else
             f"{calls.height:,} communication calls were timed one by one by {who} (none forced a device "
             "synchronization)")
    detail = (f"{timed}. Their latencies show which op and message size is slow, "
              "but not the throughput of the real job: the job overlaps communication that the logger serialises.")
    if "repaired_cumulative" in origins:
        detail += (" DeepSpeed's comms logger wrote running totals (DeepSpeed >= 0.18.3); steplens took per-call "
                   "latencies as differences of consecutive totals, and DeepSpeed's own algbw/busbw and summary "
                   "averages for these calls are wrong.")
    return [{"title": "Comms-logger timings are not throughput numbers", "detail": detail}]


def _flops_are_not_time(run: Inputs) -> list[dict]:
    profile = run.table("flops_profile")
    if profile.is_empty():
        return []
    detail = ("The FLOPs profiler counts theoretical operations per module. A module's share of FLOPs is not its "
              "share of time: memory-bound ops (norms, softmax, elementwise) take time with few FLOPs. Use the "
              "trace's kernel times for where time goes.")
    bogus = profile.filter(pl.col("duration_bogus").fill_null(False))
    if not bogus.is_empty():
        detail += (f" {bogus.height} module duration(s) are known profiler errors (the root latency when the "
                   "engine starts the profiler inside the forward pass) and are not shown as times.")
    return [{"title": "FLOPs are not latency", "detail": detail}]


def _whole_run_traced(run: Inputs) -> list[dict]:
    steps = run.table("steps")
    if steps.is_empty():
        return []
    per_window = steps.group_by("rank", "source").len()
    longest = int(per_window["len"].max())
    train_steps = run.table("train_steps")
    total = int(train_steps["step"].n_unique()) if not train_steps.is_empty() else None
    traced = int(steps["step"].n_unique())
    if longest > MAX_WINDOW_STEPS or (total and traced / total > MAX_TRACED_SHARE):
        share = f" ({traced} of {total} steps)" if total else ""
        return [{"title": "The run was traced end to end, not in bounded windows",
                 "detail": f"A profiler window holds {longest} steps{share}. Tracing adds overhead to every op and "
                           "distorts what it measures; use torch.profiler's schedule(wait, warmup, active) with a few "
                           f"active steps (at most {MAX_WINDOW_STEPS} here) and compare against untraced step times."}]
    return []


def _curves_on_step(run: Inputs) -> list[dict]:
    scalars = run.table("scalars")
    if scalars.is_empty():
        return []
    unaligned = scalars.filter(pl.col("global_samples").is_null())
    if unaligned.is_empty():
        return []
    names = sorted(set(unaligned["name"].to_list()))
    return [{"title": "Some curves have no global-samples axis",
             "detail": f"{len(names)} scalar(s) ({', '.join(names[:5])}{'...' if len(names) > 5 else ''}) are known by step "
                       "only. Curves from runs with different batch size, gradient accumulation or world size must be "
                       "compared on global samples or tokens, not on step: a step is a different amount of training."}]


def _single_samples(run: Inputs) -> list[dict]:
    experiments = run.table("autotune_experiments")
    if experiments.is_empty():
        return []
    repeats = experiments.filter(pl.col("status") == "ok").group_by(autotune.CONFIGURATION).len()
    if repeats.is_empty() or repeats["len"].max() > 1:
        return []
    return [{"title": "Autotuning ranks single measurements",
             "detail": f"Each of the {repeats.height} measured configurations ran once. In a noisy environment the "
                       "best single sample selects noise as often as a better configuration: repeat the top "
                       "configurations and compare their spread before adopting the winner."}]


def _mfu_definition(run: Inputs) -> list[dict]:
    mfu = run.table("mfu")
    if mfu.is_empty():
        return [{"title": "No MFU", "detail": (run.findings.get("mfu") or {}).get("note", "no FLOPs numerator or peak") +
                 ". MFU needs a numerator and a peak of the same definition (dense FLOPs at one dtype)."}]
    definitions = mfu.select("metric", "definition", "peak").unique().sort("metric").rows()
    stated = "; ".join(f"{metric}: numerator {definition}; peak {peak}" for metric, definition, peak in definitions)
    return [{"title": "MFU definition", "detail": f"{stated}. Numbers from tools that count sparse peaks, other "
                                                   "dtypes or executed (recomputed) FLOPs are not comparable with these."}]


# ---------------------------------------------------------------------------------------------
# The analysis


def _caveats(inputs: Inputs) -> Output:
    return Output(finding=caveats(inputs))


ANALYSIS = Analysis("caveats", "Method and caveats", ("comms_calls", "flops_profile", "steps", "train_steps", "scalars",
                                                      "autotune_experiments", "mfu"), {}, _caveats)
