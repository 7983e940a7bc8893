"""The verdict: the few findings a reviewer should read first, each a sentence with its numbers."""

from __future__ import annotations

from steplens.analyze.analyses import ANALYSES
from steplens.analyze.analyses.job_end import job_end_lines
from steplens.analyze.analyses.monitor import distinct_alarms
from steplens.analyze.analyses.step_time import OUTSIDE_HEADLINE, outside_line, source_words, step_name
from steplens.analyze.contract.text import utilization_text
from steplens.analyze.contract.units import binary_bytes

from .data import Run, ms

MAX_FINDINGS = 10
# The order the analyses' sentences are said in, most important first: how the job ended, figures that cannot be
# true, the step time and what qualifies it, then where it went. Analyses not named here follow in ANALYSES'
# order, before the input problems, which come last.
SAID_FIRST = ("job_end", "inputs_disagree", "step_time", "profiler_after_effect", "steps", "gpu_idle", "collectives",
              "mfu", "roofline", "comms_log", "monitor_alarms", "autotune", "alarm_agreement")
SAID_LAST = ("ingest_errors",)


def said_order() -> list:
    named = {analysis.name: analysis for analysis in ANALYSES}
    rest = [a for a in ANALYSES if a.name not in SAID_FIRST + SAID_LAST]
    return [named[name] for name in SAID_FIRST] + rest + [named[name] for name in SAID_LAST]


def finding_lines(f: dict) -> list[str]:
    """Every finding as sentences, most important first; each analysis phrases its own finding (its `phrase`).
    The terminal prints them all; summary.md and report.html show the first MAX_FINDINGS."""
    lines = [line for analysis in said_order() if f.get(analysis.name) is not None
             for line in analysis.phrase(f[analysis.name], f)]
    return lines or ["Nothing stands out: no step boundaries, device activity or collectives to judge."]


def verdict(run: Run) -> list[str]:
    return finding_lines(run.findings)[:MAX_FINDINGS]


# The first screen: at most FIRST_SCREEN lines, each (text, the report section that details it).
FIRST_SCREEN = 6
MAX_PROBLEMS = 3
EXPOSED_WORTH_NAMING = 0.05  # exposed communication below 5% of the step is not the first thing to fix
NUMERATOR_SHORT = {"palm": "analytic count", "megatron_args": "Megatron's count", "trace_shapes": "trace op shapes",
                   "collector_flops_profile": "FLOPs profile", "deepspeed_flops_profile": "DeepSpeed's FLOPs profile",
                   "profiler_flops": "profiler FLOPs"}


def share(value: float) -> str:
    """A share with the digits it needs: 75%, 9.4%, 0.4%."""
    return "0%" if value == 0 else f"{value:.0%}" if value >= 0.095 else f"{value:.1%}"


def first_clause(text: str) -> str:
    """The part of a sentence before its first ';' or '(', for a one-line summary of it."""
    for mark in ("; ", " ("):
        text = text.split(mark, 1)[0]
    return text.rstrip(".:")


def time_headline(f: dict) -> str | None:
    split = (f.get("step_breakdown") or {}).get("time_split")
    idle = f.get("gpu_idle") or {}
    if not split and idle.get("idle_share") is not None:  # device work but no ProfilerStep: the whole window's idle
        cause = f" ({idle['main_cause'].replace('_', '-')})" if idle.get("main_cause") else ""
        return f"GPU idle {share(idle['idle_share'])} of the profiled time{cause}; no profiled steps to split it by"
    if not split:
        return None
    cause = f" ({split['main_idle_cause'].replace('_', '-')})" if split.get("main_idle_cause") else ""
    effect = f.get("profiler_after_effect") or {}
    slowed = f", profiler-slowed {effect['window_ratio_max']:.1f}x" if effect.get("window_slowed") else ""
    # Device work whose launch is not in the trace has no step: where there is more of it than the steps' spans
    # hold, the shares describe the lesser part of the device time.
    unstepped = split.get("unstepped_device_ns") or 0
    aside = (f"; {ms(unstepped)} more device work has no recorded launch, so no step, and is not in these shares"
             if unstepped > split["span_ns"] else "")
    return (f"Inside profiled steps (device span {ms(split['median_step_span_ns'])}{slowed}): compute "
            f"{share(split['compute_share'])}, exposed comms {share(split['exposed_comm_share'])}, idle "
            f"{share(split['idle_share'])}{cause}{aside}")


def step_headline(f: dict) -> str | None:
    summary = f.get("step_time") or {}
    source = source_words(summary, 'short')
    if summary.get("steps") and summary.get("median_ns") is not None and summary["steps"] > 1:
        return (f"Steps: median {ms(summary['median_ns'])}, p90 {ms(summary['p90_ns'])} over {summary['steps']} of "
                f"{summary['total_steps']} ({source})")
    if summary.get("steps") == 1:
        return (f"Step time: {ms(summary['max_ns'])} ({step_name(summary['max_step'], summary)}, the only one kept of "
                f"{summary['total_steps']}; {source})")
    if summary.get("steps"):
        return (f"Steps: too few for a typical time ({summary['steps']} of {summary['total_steps']} kept, max "
                f"{ms(summary['max_ns'])}; {source})")
    return None


def problem_headlines(f: dict) -> list[tuple[str, str]]:
    """What is wrong, most serious first: how the job ended, figures that cannot be true, the registered
    analyses' problems, stragglers, exposed communication worth naming, fp16 overflow, alarms, lost input."""
    problems = [(first_clause(line), "status") for line in job_end_lines(f.get("job_end") or {}, with_status=True)[:1]]
    problems += [(f"Inputs disagree: {first_clause(d['detail'])}", "details") for d in f.get("inputs_disagree", [])[:1]]
    steps = f.get("steps") or {}
    if refused := (steps.get("clock_alignment") or {}).get("refused"):
        ranks = ", ".join(str(r["rank"]) for r in refused)
        problems.append((f"Not one job: rank(s) {ranks} not aligned with rank "
                         f"{steps['clock_alignment']['reference_rank']}", "steps"))
    problems += [(text, analysis.name.replace("_", "-")) for analysis in ANALYSES  # its section's id
                 if isinstance(f.get(analysis.name), (dict, list)) and (text := analysis.headline(f[analysis.name]))]
    problems += [(f"Straggler: rank {s['rank']} in step {s['step']}", "steps") for s in steps.get("stragglers", [])[:1]]
    split = (f.get("step_breakdown") or {}).get("time_split") or {}
    top = (f.get("collectives") or {}).get("most_exposed_collective")
    if top and split.get("exposed_comm_share", 0) >= EXPOSED_WORTH_NAMING:
        # the collective of one message size (the Collectives table's first row), so the size is named
        size = f" of {binary_bytes(top['bytes'])}" if top.get("bytes") is not None else " (size not in the traces)"
        problems.append((f"Exposed comms: {top['op']}{size} costs most, {ms(top['exposed_ns'])} on rank {top['rank']}",
                         "collectives"))
    if ((outside := (f.get("step_time") or {}).get("outside_work")) or {}).get("share", 0) >= OUTSIDE_HEADLINE:
        problems.append((first_clause(outside_line(outside)), "steps"))
    if (overflow := (f.get("step_time") or {}).get("fp16_overflow") or {}).get("frequent"):
        problems.append((f"fp16 overflow skipped {overflow['skipped_steps']} of {overflow['steps']} steps", "details"))
    if alarms := distinct_alarms(f):
        problems.append(("Alarms: " + ", ".join(f"{kind} x{n}" for kind, n in sorted(alarms.items())), "alarms"))
    if errors := f.get("ingest_errors"):
        problems.append((f"{errors} input problem(s) lost data", "issues"))
    return problems[:MAX_PROBLEMS]


def mfu_headline(f: dict) -> str | None:
    utilization = f.get("mfu")
    if isinstance(utilization, dict) and utilization.get("note"):
        return f"MFU: not computed: {first_clause(utilization['note']).split(': ')[0]}"
    if not isinstance(utilization, list) or not utilization:
        return None
    head = utilization[0]
    # a peak whose dtype nothing in the run states is a guess: said on the line that divides by it
    assumed = ", dtype assumed" if (f.get("mfu_dtype") or {}).get("origin", "").startswith("assumed") \
        and "--peak-tflops" not in head["peak"] else ""
    return (f"{head['metric']}: {utilization_text(head['utilization'])} ({NUMERATOR_SHORT.get(head['numerator'], head['numerator'])}; "
            f"peak {first_clause(head['peak'])}{assumed})")


def first_screen(f: dict) -> list[tuple[str, str]]:
    """At most FIRST_SCREEN lines, each with the id of the report section that holds its details ("details":
    the verdict's full sentences): where the time went, the step time, what is wrong, the MFU."""
    lines = [(text, anchor) for text, anchor in ((time_headline(f), "time"), (step_headline(f), "steps")) if text]
    lines += problem_headlines(f)
    if mfu := mfu_headline(f):
        lines.append((mfu, "mfu"))
    return lines[:FIRST_SCREEN] or [("Nothing stands out: no step boundaries, device activity or collectives to judge.",
                                     "details")]
