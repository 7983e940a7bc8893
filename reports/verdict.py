"""The verdict: the few findings a reviewer should read first, each a sentence with its numbers."""

from __future__ import annotations

from datetime import datetime, timezone

from steplens.analyze.analyses import REGISTERED, profiler_effect
from steplens.reports.text import tensor_shapes_text

from .data import Run, ms, size

MAX_FINDINGS = 10
MIN_OP_SHARE = 0.01  # a busiest op below 1% of the steps' device time says nothing worth a reviewer's line


def telemetry_lines(f: dict) -> list[str]:
    """Findings from logs, monitors and autotuning, as sentences (the terminal summary prints them too)."""
    lines = []
    if logged := f.get("logged_comms"):
        busbw = logged["median_busbw_gbps"]
        if logged.get("no_op"):
            lines.append(f"logged comms: every call was within a group of one rank ({logged['op']} of "
                         f"{logged['nccl_bytes']:,} B: {ms(logged['total_latency_ns'])} over {logged['calls']} calls): nothing "
                         "crossed a link, no bus bandwidth; the synchronizing timers measured the wait for queued device work")
        else:
            lines.append(f"logged comms: {logged['op']} of {logged['nccl_bytes']:,} B costs most, "
                         f"{ms(logged['total_latency_ns'])} over {logged['calls']} calls (median {ms(logged['median_latency_ns'])}"
                         + (f", busbw {busbw:.2f} GB/s" if busbw is not None else "")
                         + f"; latencies {logged['latency_origin']}; synchronizing timers: per-op cost, not throughput)")
    if alarms := f.get("monitor_alarms"):
        lines.append("monitor alarms: " + ", ".join(f"{kind} x{n}" for kind, n in alarms.items()) + " (table monitor_alarms)")
    for space in f.get("autotune", []):
        if space["pick_mismatch"]:
            lines.append(f"autotuning {space['tuning_space']}: DeepSpeed's pick disagrees with the experiments' own metrics: "
                         f"{space['pick_detail']}")
        lines.append(f"autotuning {space['tuning_space']}: {space['detail']}")
    return lines


ALARM_ONLY_WORDS = {"only_in_job": "only in the job (rows that never reached the disk, a hang the watchdog saw, or a "
                                   "job whose steplens judged a rule another way)",
                    "on_instrumented_steps": "in the job on a step the run instrumented (profiler, FLOPs profile or "
                                             "checkpoint), which the replay does not judge",
                    "only_post_hoc": "only in the replay (a straggler step the job judged before the other ranks' "
                                     "parts were on disk, or alarms from after the job stopped delivering)"}


def alarm_lines(f: dict, limit: int = 3) -> list[str]:
    """In-job alarms (the collector's alarms table) next to the same rules replayed on the recorded rows, and
    where they agree; then the first alarms by severity and step. Post-hoc alarms over every scalar series
    (monitor_alarms) are in telemetry_lines."""
    summary = f.get("alarms") or {}
    if not (summary.get("in_job") or summary.get("post_hoc")):
        return []
    line = (f"In-job alarms: {summary['in_job']} raised while the job ran; the same rules replayed on the recorded "
            f"rows raise {summary['post_hoc']}; {summary['agree']} agree (same rule, series and step)")
    differ = [f"{summary[key]} {words}" for key, words in ALARM_ONLY_WORDS.items() if summary.get(key)]
    lines = [line + ("; " + "; ".join(differ) if differ else "") + "."]
    for alarm in summary.get("listed", [])[:limit]:
        seen = ("in the job and in the replay" if alarm["in_job"] and alarm["post_hoc"]
                else "in the job only, on an instrumented step" if alarm.get("instrumented")
                else "in the job only" if alarm["in_job"] else "in the replay only")
        lines.append(f"Alarm {alarm['rule']} ({alarm['severity']}) on {alarm['name']} at step {alarm['step']}, {seen}: "
                     f"{alarm['detail'].rstrip('.')}.")
    return lines


EXCLUSION_WORDS = {"warm_up": "warm-up", "flops_profiler": "FLOPs profiler", "profiler_warmup": "profiler warm-up",
                   "profiler_window": "profiler window", "profiler_export": "trace export",
                   "checkpoint_save": "checkpoint save", "overflow_skipped": "skipped on fp16 overflow",
                   "incomplete": "incomplete", "negative_duration": "ends before it starts",
                   "longer_than_run": "longer than the run", "no_time": "no time measured"}
SOURCE_WORDS = {"train_steps": "the collector's train_steps", "log": "the logs", "profiler_steps": "the profiled steps"}


def _step_ranges(steps: list[int], count: int) -> str:
    """[8, 9, 10, 12] -> "8-10, 12" (and how many more when the list was cut)."""
    parts, start = [], None
    for i, step in enumerate(steps):
        start = step if start is None else start
        if i + 1 == len(steps) or steps[i + 1] != step + 1:
            parts.append(str(step) if start == step else f"{start}-{step}")
            start = None
    more = f" and {count - len(steps)} more" if count > len(steps) else ""
    return ", ".join(parts) + more


def disagreement_lines(f: dict) -> list[str]:
    """Figures that cannot be true (analyze/analyses/sanity.py), with what to check instead of the figure."""
    return [f"Inputs disagree: {d['detail']}; check {d['what_to_check']}." for d in f.get("inputs_disagree", [])]


def alignment_lines(f: dict) -> list[str]:
    """Traces that cannot be ranks of one job (analyze/analyses/steps.py unalignable)."""
    alignment = f.get("clock_alignment") or {}
    return [f"Not one job: rank {r['rank']}'s trace is not aligned with rank {alignment['reference_rank']}'s ({r['reason']}); "
            "its steps are not drawn on one clock with the others and no straggler is named across them."
            for r in alignment.get("refused", [])]


def straggler_lines(f: dict, limit: int = 2) -> list[str]:
    """Stragglers that stand out from the run's noise, each with the test that decided it."""
    lines = []
    for s in f.get("stragglers", [])[:limit]:
        how = f" Decided by {s['decided_by']}." if s.get("decided_by") else ""
        if s["basis"] == "collective_wait":
            lines.append(f"Straggler: rank {s['rank']} in step {s['step']}; the other ranks waited "
                         f"{ms(s['others_waited_ns'])} in total for it in collectives.{how}")
        else:
            lines.append(f"Straggler: rank {s['rank']} in step {s['step']}, {ms(s['spread_ns'])} longer than the fastest "
                         f"rank (no collective timing in the traces shows who waited).{how}")
    return lines


CAUSE_WORDS = {"nccl_watchdog_timeout": "an NCCL watchdog timeout: a collective waited past its timeout for a rank that "
                                         "never joined it",
               "peer_lost": "a lost peer: the other ranks' collectives failed when a rank died or stopped answering"}


def job_end_lines(f: dict, with_status: bool = False) -> list[str]:
    """How the job ended (with_status: also its status, for the terminal, which has no run_status table)
    and the rank that stopped making progress first."""
    end = f.get("job_end") or {}
    lines = []
    if with_status and end.get("status"):
        what = {"failed": "failed", "killed": "was killed", "incomplete": "did not finish"}[end["status"]]
        lines.append(f"The job {what}" + (f": {end['errors'][0].rstrip('.')}" if end.get("errors") else "") + ".")
    if end.get("cause"):
        lines.append(f"It ended on {CAUSE_WORDS[end['cause']]}.")
    if end.get("first_stalled_rank") is not None:
        lines.append(f"Rank {end['first_stalled_rank']} stopped making progress first: {end['basis']}.")
    return lines


def _log_clock(ns: int) -> str:
    """A log line's time as the log printed it (importers read the zone-less stamps as UTC)."""
    return datetime.fromtimestamp(ns / 1e9, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def last_log_line_lines(f: dict, limit: int = 4) -> list[str]:
    """For a job that did not end cleanly: each rank's last log line (where, when, what), earliest first, so a
    reader sees which rank fell silent first (job_end.last_log_lines)."""
    lines = []
    for row in ((f.get("job_end") or {}).get("last_log_lines") or [])[:limit]:
        if row.get("wall_ns") is not None:
            when = f"at {_log_clock(row['wall_ns'])}"
        elif row.get("not_before_ns") is not None:
            when = f"no time of its own, after {_log_clock(row['not_before_ns'])}"
        else:
            when = "no time"
        lines.append(f"Rank {row['rank']}'s last log line ({row['source']}:{row['line']}, {when}): {row['text']}")
    return lines


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
    return f" ({', '.join(ms(t) for t in times[:3])})" if times and excluded["count"] <= 3 else ""


def step_lines(f: dict) -> list[str]:
    """Step time over the run, the slowest step when it stands out, and where the profiled steps sit."""
    lines = []
    summary = f.get("step_time") or {}
    source = SOURCE_WORDS.get(summary.get("source"), summary.get("source"))
    few = summary.get("kept_steps")  # too few kept steps, too far apart, for a typical time
    if summary.get("steps") == 1:
        line = (f"Step time: {ms(summary['max_ns'])} ({step_name(summary['max_step'], summary)}, the only one of "
                f"{summary['total_steps']} kept), from {source}")
    elif few:
        line = (f"Step time: too few steps for a typical time: {len(few)} of {summary['total_steps']} kept ("
                + ", ".join(f"{step_name(k['step'], summary)} {ms(k['step_time_ns'])}" for k in few)
                + "; no median of steps this unlike), from " + source)
    elif summary.get("steps"):
        line = (f"Step time: median {ms(summary['median_ns'])}, p90 {ms(summary['p90_ns'])}, max {ms(summary['max_ns'])} "
                f"({step_name(summary['max_step'], summary)}) over {summary['steps']} of {summary['total_steps']} "
                + ("logged iterations, each the mean of its logging interval" if summary.get("interval_means") else "steps")
                + f", from {source}")
    if summary.get("steps"):
        if excluded := summary.get("excluded_steps"):
            line += "; left out: " + "; ".join(
                f"{EXCLUSION_WORDS.get(e['reason'], e['reason'])} {'step' if e['count'] == 1 else 'steps'} "
                f"{_step_ranges(e['steps'], e['count'])}" + (_times(e) if few else "") for e in excluded)
        lines.append(line + ".")
    elif summary.get("source"):
        lines.append(f"Step time: none of the {summary['total_steps']} steps is typical ({summary.get('note')}).")
    if slow := f.get("slowest_step"):
        lines.append(f"Slowest step: {step_name(slow['step'], summary, ' ({})')}" + (f" on rank {slow['rank']}" if slow.get("rank") is not None else "")
                     + f", {ms(slow['dur_ns'])} against a median of {ms(slow['median_step_ns'])}, beyond the run's "
                     f"step-to-step noise (above {ms(slow['noise_bound_ns'])}).")
    overflow = f.get("fp16_overflow") or {}
    if overflow.get("frequent"):
        scale = (f"; loss scale {overflow['loss_scale_first']:,.0f} at the start, {overflow['loss_scale_min']:,.0f} at its "
                 f"lowest, {overflow['loss_scale_last']:,.0f} at the end" if overflow.get("loss_scale_min") is not None else "")
        lines.append(f"fp16 overflow: the optimizer skipped {overflow['skipped_steps']} of {overflow['steps']} steps "
                     f"({overflow['share']:.0%}){scale}. Skipped steps do no training: check the loss for inf/NaN and the "
                     "initial loss scale (fp16.initial_scale_power), or use bf16.")
    profiled = f.get("profiled_steps") or {}
    for window in profiled.get("steps", [])[:3]:
        timed = (f"; {SOURCE_WORDS.get(profiled['source'], profiled['source'])} timed it {ms(window['step_time_ns'])}"
                 if window.get("step_time_ns") is not None else "")
        median = (f", the run's median step is {ms(profiled['run_median_ns'])}"
                  if profiled.get("run_median_ns") is not None else "")
        lines.append(f"Profiled step {window['step']} took {ms(window['profiler_dur_ns'])} (ProfilerStep window, "
                     f"rank {window['rank']}{timed}){median}.")
    return lines


IDLE_CAUSE_WORDS = {"host_bound": "host-bound: the GPU waited for the CPU to launch work",
                    "sync": "synchronization: the CPU waited on the GPU", "other": "cross-stream waits or unrecorded launches"}


def gpu_idle_lines(f: dict) -> list[str]:
    idle = f.get("gpu_idle") or {}
    if idle.get("runtime_calls_without_device_work"):
        return [f"GPU idle: not measured: {idle['note']}."]
    if idle.get("idle_share") is None:
        return []
    cause = f"; main cause {IDLE_CAUSE_WORDS[idle['main_cause']]}" if idle.get("main_cause") in IDLE_CAUSE_WORDS else ""
    return [f"GPU idle: {idle['idle_share']:.1%} of the profiled time (first to last device activity of each window, no "
            f"stream busy){cause}{profiler_effect.window_note(f.get('profiler_after_effect'))}."]


def collective_lines(f: dict) -> list[str]:
    if (f.get("gpu_idle") or {}).get("runtime_calls_without_device_work"):
        return []  # no device work recorded: no collective kernels to find either (the GPU idle line says so)
    if top := f.get("most_exposed_collective"):
        bandwidth = f" at a median busbw of {top['busbw_gbps']:.1f} GB/s" if top.get("busbw_gbps") is not None else ""
        message = f" of {size(top['bytes'])}" if top.get("bytes") is not None else " (message size not in the traces)"
        on_rank = f" on rank {top['rank']}" if top.get("rank") is not None else ""
        ranks = f" on {top['ranks']} ranks" if (top.get("ranks") or 1) > 1 else ""
        return [f"Most exposed communication: {top['op']}{message}, {ms(top['exposed_ns'])} not hidden behind compute"
                f"{on_rank} (its most exposed rank), {top['calls']} calls{ranks}{bandwidth}"
                f"{profiler_effect.window_note(f.get('profiler_after_effect'))}."]
    return [f"Collectives: {f['comms_note']}."] if f.get("comms_note") else []


NUMERATOR_WORDS = {"palm": "the analytic count", "megatron_args": "Megatron's count", "trace_shapes": "the traces' op shapes",
                   "collector_flops_profile": "the collector's FLOPs profile", "profiler_flops": "torch.profiler with_flops"}


def mfu_lines(f: dict) -> list[str]:
    """One headline figure with its numerator named, the other numerators beside it; where they disagree."""
    utilization = f.get("mfu")
    if isinstance(utilization, dict) and utilization.get("note"):
        return [f"MFU: not computed: {utilization['note']}."]
    if not isinstance(utilization, list) or not utilization:
        return []
    head, *others = utilization
    beside = "; ".join(f"{r['metric']} {r['utilization']:.1%} from {NUMERATOR_WORDS.get(r['numerator'], r['numerator'])}"
                       for r in others)
    lines = [f"{head['metric']}: {head['utilization']:.1%} (median over steps) from "
             f"{NUMERATOR_WORDS.get(head['numerator'], head['numerator'])}{f'; beside it {beside}' if beside else ''}. "
             f"Numerator: {head['definition']}. Peak: {head['peak']}."]
    for pair in f.get("mfu_numerators_disagree") or []:
        a, b = (NUMERATOR_WORDS.get(n, n) for n in pair["numerators"])
        lines.append(f"MFU numerators disagree: {b} gives {pair['ratio']:.2f}x the FLOPs per step of {a} "
                     "(executed FLOPs count recomputation; an analytic count misses what the model does beyond its formula).")
    if f.get("mfu_refused"):
        lines.append(f"MFU: one numerator left out: {f['mfu_refused']}.")
    return lines


def op_line(op: dict, note: str | None = None) -> str:
    """One op of the roofline: name, tensor shapes, calls, device time, where it sits against the roof."""
    where = (f"{op['bound']}-bound, {op['fraction_of_peak']:.1%} of peak" if op.get("fraction_of_peak") is not None
             else note or "no roofline")
    over = f" over {op['ranks']} ranks" if (op.get("ranks") or 1) > 1 else ""  # calls and time are summed over them
    return f"{op['name']} ({tensor_shapes_text(op['shapes'])}) x{op['calls']}{over}: {op['device_ns'] / 1e6:.3f} ms, {where}"


def module_line(module: dict) -> str:
    return (f"{module['module']}, {module['fraction_of_peak']:.1%} of peak over {module['device_ns'] / 1e6:.3f} ms of "
            "forward device time")


def roofline_lines(f: dict) -> list[str]:
    """The busiest modeled op and the module furthest below peak."""
    finding = f.get("roofline") or {}
    lines = []
    top = (finding.get("top_ops") or [None])[0]
    if top and (top.get("step_share") is None or top["step_share"] >= MIN_OP_SHARE):
        share = (f"; {top['step_share']:.1%} of the profiled steps' device time" if top.get("step_share") is not None
                 else "")
        lines.append(f"Busiest modeled op: {op_line(top, finding.get('note'))}{share}.")
    if rated := [m for m in finding.get("modules_below_peak") or [] if m.get("fraction_of_peak") is not None]:
        lines.append(f"Module furthest below peak: {module_line(rated[0])}.")
    return lines


def input_problem_lines(f: dict) -> list[str]:
    if errors := f.get("ingest_errors"):
        return [f"{errors} input problem(s) lost data (see Ingest issues); numbers cover what was readable."]
    return []


def registered_lines(f: dict) -> list[str]:
    """The sentences of the registered analyses (each phrases its own finding)."""
    return [line for analysis in REGISTERED if analysis.name in f and analysis.name not in EARLY
            for line in analysis.phrase(f[analysis.name])]


# Registered findings said next to the step time they qualify, not after the others.
EARLY = {profiler_effect.ANALYSIS.name: profiler_effect.after_effect_lines}


def finding_lines(f: dict) -> list[str]:
    """Every finding as sentences, most important first. The terminal prints them all; summary.md and
    report.html show the first MAX_FINDINGS. Each sentence is written here once."""
    lines = (job_end_lines(f, with_status=True) + last_log_line_lines(f) + disagreement_lines(f) + alignment_lines(f)
             + step_lines(f)
             + [line for name, phrase in EARLY.items() if f.get(name) for line in phrase(f[name])]
             + straggler_lines(f, limit=3) + gpu_idle_lines(f) + collective_lines(f)
             + mfu_lines(f) + roofline_lines(f) + ([f"{f['traces']}."] if f.get("traces") else [])
             + [line[0].upper() + line[1:] + ("" if line.endswith(".") else ".") for line in telemetry_lines(f)]
             + alarm_lines(f)
             + registered_lines(f) + input_problem_lines(f))
    return lines or ["Nothing stands out: no step boundaries, device activity or collectives to judge."]


def verdict(run: Run) -> list[str]:
    return finding_lines(run.findings)[:MAX_FINDINGS]


# The first screen: at most FIRST_SCREEN lines, each (text, the report section that details it).
FIRST_SCREEN = 6
MAX_PROBLEMS = 3
EXPOSED_WORTH_NAMING = 0.05  # exposed communication below 5% of the step is not the first thing to fix
STEP_SOURCE_WORDS = {"train_steps": "collector", "log": "logs", "profiler_steps": "profiled steps"}
NUMERATOR_SHORT = {"palm": "analytic count", "megatron_args": "Megatron's count", "trace_shapes": "trace op shapes",
                   "collector_flops_profile": "FLOPs profile", "profiler_flops": "profiler FLOPs"}


def share(value: float) -> str:
    """A share with the digits it needs: 75%, 9.4%, 0.4%."""
    return "0%" if value == 0 else f"{value:.0%}" if value >= 0.095 else f"{value:.1%}"


def first_clause(text: str) -> str:
    """The part of a sentence before its first ';' or '(', for a one-line summary of it."""
    for mark in ("; ", " ("):
        text = text.split(mark, 1)[0]
    return text.rstrip(".:")


def time_headline(f: dict) -> str | None:
    split = f.get("time_split")
    if not split:
        return None
    cause = f" ({split['main_idle_cause'].replace('_', '-')})" if split.get("main_idle_cause") else ""
    effect = f.get("profiler_after_effect") or {}
    slowed = f", profiler-slowed {effect['window_ratio_max']:.1f}x" if effect.get("window_slowed") else ""
    return (f"Inside profiled steps (device span {ms(split['median_step_span_ns'])}{slowed}): compute "
            f"{share(split['compute_share'])}, exposed comms {share(split['exposed_comm_share'])}, idle "
            f"{share(split['idle_share'])}{cause}")


def step_headline(f: dict) -> str | None:
    summary = f.get("step_time") or {}
    source = STEP_SOURCE_WORDS.get(summary.get("source"), summary.get("source"))
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
    problems = [(first_clause(line), "status") for line in job_end_lines(f, with_status=True)[:1]]
    problems += [(f"Inputs disagree: {first_clause(d['detail'])}", "details") for d in f.get("inputs_disagree", [])[:1]]
    if refused := (f.get("clock_alignment") or {}).get("refused"):
        ranks = ", ".join(str(r["rank"]) for r in refused)
        problems.append((f"Not one job: rank(s) {ranks} not aligned with rank {f['clock_alignment']['reference_rank']}",
                         "steps"))
    problems += [(text, analysis.name.replace("_", "-")) for analysis in REGISTERED  # its section's id
                 if isinstance(f.get(analysis.name), dict) and (text := analysis.headline(f[analysis.name]))]
    problems += [(f"Straggler: rank {s['rank']} in step {s['step']}", "steps") for s in f.get("stragglers", [])[:1]]
    split, top = f.get("time_split") or {}, f.get("most_exposed_collective")
    if top and split.get("exposed_comm_share", 0) >= EXPOSED_WORTH_NAMING:
        problems.append((f"Exposed comms: {top['op']} costs most, {ms(top['exposed_ns'])} on rank {top['rank']}",
                         "collectives"))
    if (f.get("fp16_overflow") or {}).get("frequent"):
        overflow = f["fp16_overflow"]
        problems.append((f"fp16 overflow skipped {overflow['skipped_steps']} of {overflow['steps']} steps", "details"))
    alarms = dict(f.get("monitor_alarms") or {})
    for alarm in (f.get("alarms") or {}).get("listed", []):  # the in-job rules replayed on the recorded rows
        if alarm["post_hoc"]:
            alarms[alarm["rule"]] = alarms.get(alarm["rule"], 0) + 1
    if alarms:
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
    return (f"{head['metric']}: {head['utilization']:.1%} ({NUMERATOR_SHORT.get(head['numerator'], head['numerator'])}; "
            f"peak {first_clause(head['peak'])})")


def first_screen(f: dict) -> list[tuple[str, str]]:
    """At most FIRST_SCREEN lines, each with the id of the report section that holds its details ("details":
    the verdict's full sentences): where the time went, the step time, what is wrong, the MFU."""
    lines = [(text, anchor) for text, anchor in ((time_headline(f), "time"), (step_headline(f), "steps")) if text]
    lines += problem_headlines(f)
    if mfu := mfu_headline(f):
        lines.append((mfu, "mfu"))
    return lines[:FIRST_SCREEN] or [("Nothing stands out: no step boundaries, device activity or collectives to judge.",
                                     "details")]
