"""Did the profiler change the run? The steps after the last profiler window against those before the first.

Tracing a run distorts it, and not only inside the window: Kineto leaves CUPTI attached after profiling
unless TEARDOWN_CUPTI=1 (pytorch/pytorch#144455), and every later kernel launch pays for it. On a real
H200 ZeRO-3 job the steps after two windows ran 1.20x those before them with CUPTI left attached, 0.94x
with it released (tests/gpu/gpu_check.py).

Needs a whole-run step record (the step_time table from the collector's train_steps or the logs, not
from the profiler's own steps). Before: steps before the first traced step (profiler warm-up or window);
after: steps after the last window step; both without the steps step_time leaves out (warm-up, FLOPs
profile, trace export, checkpoint saves...). The change is beyond the run's step-to-step noise when the
two samples differ (Mann-Whitney U, two-sided, p < P_VALUE) by at least MIN_CHANGE of the median before.
"""

from __future__ import annotations

import polars as pl

from steplens.analyze.analyses.rank_test import mann_whitney_u
from steplens.analyze.analyses.registry import Analysis, Output
from steplens.analyze.contract.units import duration

P_VALUE = 0.01
MIN_CHANGE = 0.02  # a median shift under 2% is not a finding however steady the steps (the collector's own target)
MIN_STEPS = 3  # on each side; fewer cannot be judged
SLOW_WINDOW = 1.2  # figures measured in a window step slower than this x the run's median say so (idle, exposed comms)
TRACED = ("profiler_warmup", "profiler_window")
CAUSE = ("Kineto leaves CUPTI attached after profiling unless TEARDOWN_CUPTI=1 is set (pytorch/pytorch#144455); "
         "set it in the job's environment, or let the steplens collector open the windows (it sets it unless the job "
         "uses CUDA graphs)")


def _marked(table: pl.DataFrame, reasons: tuple[str, ...]) -> list[int]:
    return table.filter(pl.col("reason").str.split(",").list.eval(pl.element().is_in(list(reasons))).list.any()
                        .fill_null(False))["step"].to_list()


def after_effect(step_time: pl.DataFrame, facts: dict) -> dict | None:
    """The profiler_after_effect finding, or None when the run has no whole-run record around a window."""
    if step_time.is_empty() or step_time["source"][0] == "profiler_steps":
        return None
    traced, windows = _marked(step_time, TRACED), _marked(step_time, ("profiler_window",))
    if not windows:
        return None
    first, last = min(traced), max(windows)
    kept = step_time.filter(~pl.col("excluded") & pl.col("step_time_ns").is_not_null())
    run_median = kept["step_time_ns"].median()
    window_times = step_time.filter(pl.col("step").is_in(windows))["step_time_ns"].drop_nulls()
    before = kept.filter(pl.col("step") < first)["step_time_ns"]
    after = kept.filter(pl.col("step") > last)["step_time_ns"]
    finding = {"first_window_step": first, "last_window_step": last, "steps_before": before.len(),
               "steps_after": after.len(), "before_median_ns": None, "after_median_ns": None, "ratio": None,
               "p_value": None, "beyond_noise": None,
               # each window step's time over the run's median kept step: what the traces' figures were measured in
               "window_ratio_min": window_times.min() / run_median if run_median and window_times.len() else None,
               "window_ratio_max": window_times.max() / run_median if run_median and window_times.len() else None,
               "window_slowed": bool(run_median and window_times.len() and window_times.max() > SLOW_WINDOW * run_median),
               "cupti_teardown": (facts.get("collector_profiler") or {}).get("cupti_teardown"),
               "cupti_teardown_by": (facts.get("collector_profiler") or {}).get("cupti_teardown_by"),
               # the collector was set to open the windows: without its record of CUPTI, it is older than that record
               "collector_profiled": isinstance(facts.get("settings"), dict) and bool(facts["settings"].get("profile")),
               "collector_record": "collector_profiler" in facts,
               "definition": "median kept step after the last profiler window / median kept step before the first; "
                             f"beyond noise: Mann-Whitney U p < {P_VALUE} and a change of at least {MIN_CHANGE:.0%}"}
    if before.len() and after.len():
        finding["before_median_ns"] = round(before.median())
        finding["after_median_ns"] = round(after.median())
        finding["ratio"] = after.median() / before.median()
    if before.len() >= MIN_STEPS and after.len() >= MIN_STEPS:
        p_value = mann_whitney_u(before.to_list(), after.to_list())[1]
        finding["p_value"] = p_value
        finding["beyond_noise"] = p_value < P_VALUE and abs(finding["ratio"] - 1) >= MIN_CHANGE
    return finding


def window_note(finding: dict | None) -> str:
    """What to say next to a figure measured inside the profiler windows, when they ran slow; else ''."""
    if not finding or not finding.get("window_slowed"):
        return ""
    low, high = finding["window_ratio_min"], finding["window_ratio_max"]
    spread = f"{high:.1f}x" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f}x"
    return f"; measured in profiled steps that ran {spread} the run's median step (the profiler's own cost)"


def after_effect_lines(finding: dict) -> list[str]:
    first, last = finding["first_window_step"], finding["last_window_step"]
    where = f"window of step {first}" if first == last else f"windows of steps {first}-{last}"
    if finding["ratio"] is None or finding["beyond_noise"] is None:
        return [f"Profiler after-effect: not judged: {finding['steps_before']} kept step(s) before the profiler "
                f"{where}, and {finding['steps_after']} after them; {MIN_STEPS} on each side are needed."]
    figures = (f"median {duration(finding['after_median_ns'])} over the {finding['steps_after']} kept steps after the "
               f"profiler {where}, against {duration(finding['before_median_ns'])} over the {finding['steps_before']} "
               "before them")
    if not finding["beyond_noise"]:
        return [f"Profiler after-effect: none beyond the step-to-step noise ({finding['ratio']:.2f}x: {figures})."]
    if finding["ratio"] < 1:
        return [f"Steps ran faster after the profiler windows: {finding['ratio']:.2f}x ({figures}); the run's "
                "own drift, not the profiler's cost."]
    if finding["cupti_teardown"]:
        cause = ("CUPTI was released after the windows (TEARDOWN_CUPTI=1), so the profiler is not the likely cause: "
                 "look at what else changed in the run")
    elif finding["cupti_teardown"] is False:
        by = f" ({finding['cupti_teardown_by']})" if finding.get("cupti_teardown_by") else ""
        cause = (f"likely cause: CUPTI stayed attached after the windows{by}, and every later kernel launch pays for it "
                 "(pytorch/pytorch#144455): where the job uses no CUDA graphs, TEARDOWN_CUPTI=1 releases it; with "
                 "them, profile in a run of its own")
    elif finding.get("collector_record") and finding["cupti_teardown"] is None:  # the collector saw no CUDA device
        cause = (f"the profiler is not the likely cause ({finding['cupti_teardown_by']}): look at what else changed in "
                 "the run")
    elif finding.get("collector_profiled") and not finding.get("collector_record"):
        # the collector opened the windows, but is older than its record of the CUPTI decision
        cause = ("likely cause: Kineto leaves CUPTI attached after profiling unless TEARDOWN_CUPTI=1 is set "
                 "(pytorch/pytorch#144455), and this collector's record does not say whether it was (a collector "
                 "older than that record): set TEARDOWN_CUPTI=1 in the job's environment")
    else:
        cause = "likely cause: " + CAUSE
    return [f"Steps ran {finding['ratio']:.2f}x slower after the profiler windows ({figures}; beyond the "
            f"step-to-step noise); {cause}. The step time above mixes both regimes."]


def after_effect_headline(finding: dict) -> str | None:
    """The first screen's line: only a slow-down beyond the noise is a problem worth it."""
    if not finding.get("beyond_noise") or finding["ratio"] < 1:
        return None
    blame = "" if finding["cupti_teardown"] else " (CUPTI left attached?)"
    return f"Profiling slowed the run: steps {finding['ratio']:.2f}x slower after the windows{blame}"


ANALYSIS = Analysis(
    name="profiler_after_effect",
    title="The profiler's after-effect",
    reads=("step_time",),
    writes={},
    compute=lambda inputs: Output(finding=after_effect(inputs.table("step_time"), inputs.facts)),
    phrase=lambda finding, findings: after_effect_lines(finding),
    headline=after_effect_headline,
    section=lambda page, run: page.declared(ANALYSIS, run),
)
