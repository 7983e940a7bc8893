"""In-job alarms next to the same rules replayed after the fact: where they agree.

The collector evaluated its alarm rules (analyze/contract/alarm_rules.py) on rank 0 while the job ran and wrote what
fired to the `alarms` table. Here the same rules, with the settings of the collector's manifest, run again
over the rows the collector recorded (rank 0's scalars in the order written, every rank's train_steps and
comms_calls). An alarm is matched on (rule, name, step). Differences have causes that can be named: rows
that never reached the disk (a killed rank, a failed writer), a straggler step judged in the job only once
the other ranks' parts were on disk, a watchdog that saw a hang the step times cannot (the job never
stepped again).

The step rules (slow_step, throughput_drop) skip the steps the run instrumented (profiler windows, FLOPs profile,
checkpoint saves: step_time.INSTRUMENTATION) in the replay; an in-job alarm of theirs on such a step is marked
`instrumented` and counted apart, not as a disagreement (a collector that did not skip them raised it on the
instrument's cost).
"""

from __future__ import annotations

import polars as pl
import pyarrow as pa

from steplens.analyze.contract import alarm_rules
from steplens.analyze.analyses import step_time
from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.contract import schema

COLUMNS = {"rule": pl.String, "name": pl.String, "step": pl.Int64, "rank": pl.Int64, "severity": pl.String,
           "in_job": pl.Boolean, "post_hoc": pl.Boolean, "value_in_job": pl.Float64, "value_post_hoc": pl.Float64,
           "detail": pl.String, "instrumented": pl.Boolean}


def _collector(frame: pl.DataFrame) -> pl.DataFrame:
    """The collector's rows of a run table (an absent table: no rows)."""
    if "source" not in frame.columns:
        return pl.DataFrame()
    return frame.filter(pl.col("source").str.starts_with("collector/"))


def _by_rank(frame: pl.DataFrame) -> dict[int, list[dict]]:
    if frame.is_empty():
        return {}
    return {rank: part.to_dicts() for (rank,), part in frame.partition_by("rank", as_dict=True, maintain_order=True).items()}


def alarm_agreement(alarms: pl.DataFrame, scalars: pl.DataFrame, train_steps: pl.DataFrame,
                    comms_calls: pl.DataFrame, facts: dict, instrumented: set[int] = frozenset()) -> pl.DataFrame:
    """One row per alarm raised in the job, by the replay, or both; empty without a collector's settings."""
    settings = facts.get("settings") if isinstance(facts.get("settings"), dict) else None
    if settings is None or "alarms" not in settings:  # no collector, or one from before alarms: nothing to replay
        return pl.DataFrame(schema=COLUMNS)
    try:
        rules = alarm_rules.parse_rules(settings.get("alarms"))
    except ValueError:
        return pl.DataFrame(schema=COLUMNS)
    scalars = _collector(scalars)
    own = scalars.filter((pl.col("rank") == 0) & (pl.col("origin") == "collector")) if not scalars.is_empty() else scalars
    steps, comms = _collector(train_steps), _collector(comms_calls)
    # Parts sort by name in flush order (rank0-00003 before rank0-00004); rows keep their order inside a part.
    own_rows = own.sort("source", maintain_order=True).to_dicts() if not own.is_empty() else []
    steps_rows = _by_rank(steps.sort("rank", "step", "micro_step")) if not steps.is_empty() else {}
    replayed = alarm_rules.replay(rules, own_rows, steps_rows, _by_rank(comms) if not comms.is_empty() else {},
                                  skip_steps=instrumented)
    in_job = _collector(alarms).to_dicts() if not alarms.is_empty() else []
    rows: dict[tuple, dict] = {}
    for side, found in (("in_job", in_job), ("post_hoc", replayed)):
        for alarm in found:
            key = (alarm["rule"], alarm["name"], alarm["step"])
            row = rows.setdefault(key, {"rule": alarm["rule"], "name": alarm["name"], "step": alarm["step"],
                                        "rank": alarm["rank"], "severity": alarm["severity"], "in_job": False,
                                        "post_hoc": False, "detail": alarm["detail"],
                                        "instrumented": alarm["rule"] in alarm_rules.STEP_KINDS
                                        and alarm["step"] in instrumented})
            row[side] = True
            row[f"value_{side}"] = alarm["value"]
    return pl.DataFrame(list(rows.values()), schema=COLUMNS).sort("step", "rule", "name")


SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
LISTED = 5  # alarms named in findings.json (the table holds them all)


def agreement_summary(table: pl.DataFrame) -> dict:
    """For findings.json: counts of alarms in the job, in the replay, in both; and the first LISTED alarms, most
    severe first, then by step (`listed`: rule, name, step, rank, severity, in_job, post_hoc, value, detail),
    every alarm the replay raised (`replayed`: rule, name, step) and every one the job raised on a step it did not
    instrument (`raised_in_job`)."""
    both = table.filter(pl.col("in_job") & pl.col("post_hoc")).height
    judged = ~pl.col("instrumented").fill_null(False)
    listed = (table.with_columns(order=pl.col("severity").replace_strict(SEVERITY_ORDER, default=len(SEVERITY_ORDER)))
              .sort("order", "step", "rule", "name").head(LISTED)
              .select("rule", "name", "step", "rank", "severity", "in_job", "post_hoc", "instrumented",
                      pl.coalesce("value_in_job", "value_post_hoc").alias("value"), "detail"))
    return {"in_job": table.filter("in_job").height, "post_hoc": table.filter("post_hoc").height, "agree": both,
            "only_in_job": table.filter(pl.col("in_job") & ~pl.col("post_hoc") & judged).height,
            "on_instrumented_steps": table.filter(~judged).height,
            "only_post_hoc": table.filter(~pl.col("in_job") & pl.col("post_hoc")).height,
            "listed": listed.to_dicts(),
            # every alarm the replay raised and every one the job raised on a step it did not instrument, (rule,
            # series, step): the verdict counts each alarm of the run once
            "replayed": table.filter("post_hoc").select("rule", "name", "step").sort("step", "rule", "name").rows(),
            "raised_in_job": table.filter(pl.col("in_job") & judged).select("rule", "name", "step")
            .sort("step", "rule", "name").rows()}


# ---------------------------------------------------------------------------------------------
# What it says


ALARM_ONLY_WORDS = {"only_in_job": "only in the job (rows that never reached the disk, a hang the watchdog saw, or a "
                                   "job whose steplens judged a rule another way)",
                    "on_instrumented_steps": "in the job on a step the run instrumented (profiler, FLOPs profile or "
                                             "checkpoint), which the replay does not judge",
                    "only_post_hoc": "only in the replay (a straggler step the job judged before the other ranks' "
                                     "parts were on disk, or alarms from after the job stopped delivering)"}


def alarm_lines(summary: dict, limit: int = 3) -> list[str]:
    """In-job alarms (the collector's alarms table) next to the same rules replayed on the recorded rows, and
    where they agree; then the first alarms by severity and step. Post-hoc alarms over every scalar series
    (monitor_alarms) are the monitor_alarms analysis's."""
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


# ---------------------------------------------------------------------------------------------
# Its report section


ALARM_HEADER = ["step", "alarm", "series", "raised", "value", "detail"]


def alarm_rows(run) -> list[list]:
    """Every alarm of the run, in step order: the in-job alarms beside the same rules replayed (alarm_agreement),
    then the post-hoc alarms over every scalar series (monitor_alarms) that are not one of those."""
    rows, replayed = [], set()
    for a in run.table("alarm_agreement").iter_rows(named=True):
        replayed.add((a["rule"], a["name"], a["step"]))
        raised = ("in the job and the replay" if a["in_job"] and a["post_hoc"] else
                  "in the job, on an instrumented step" if a.get("instrumented") else
                  "in the job only" if a["in_job"] else "in the replay only")
        value = a["value_in_job"] if a["value_in_job"] is not None else a["value_post_hoc"]
        rows.append([a["step"], a["rule"], a["name"], raised, value, a["detail"]])
    for a in run.table("monitor_alarms").iter_rows(named=True):
        if (a["rule"], a["name"], a["step"]) not in replayed:  # the same alarm as the replay's: listed once, above
            rows.append([a["step"], a["rule"], a["name"], f"post hoc ({a['origin']})", a["value"], a["detail"]])
    return sorted(rows, key=lambda row: (row[0] is None, row[0] if row[0] is not None else 0))


def alarms_section(page, run):
    """Every alarm: in the job, in the replay of the same rules, post hoc over every series (tables
    alarm_agreement and monitor_alarms)."""
    rows = alarm_rows(run)
    if not rows:
        return None
    section = page.section("Alarms", "alarms")
    section.rows([dict(zip(ALARM_HEADER, row)) for row in rows], {c: (c, "value") for c in ALARM_HEADER},
                 "alarm_agreement, monitor_alarms")
    return section


# ---------------------------------------------------------------------------------------------
# The analysis


def _alarm_agreement(inputs: Inputs) -> Output:
    table = alarm_agreement(inputs.table("alarms"), inputs.table("scalars"), inputs.table("train_steps"),
                            inputs.table("comms_calls"), inputs.facts,
                            step_time.instrumented(inputs.table("step_time")))
    return Output(tables={"alarm_agreement": table},
                  finding=agreement_summary(table) if not table.is_empty() else None)


ALARM_AGREEMENT = schema.table_spec(
    ("rule", pa.string(), "Alarm rule (analyze/contract/alarm_rules.py)."),
    ("name", pa.string(), "Series watched (scalar tag, step_time, samples_per_s, rank <r>, step_end)."),
    ("step", pa.int64(), "Optimizer step it fired at."),
    ("rank", pa.int64(), "Rank it is about."),
    ("severity", pa.string(), "As configured."),
    ("in_job", pa.bool_(), "Raised by the collector while the job ran (the alarms table)."),
    ("post_hoc", pa.bool_(), "Raised by the same rules replayed over the recorded collector rows."),
    ("value_in_job", pa.float64(), "Value the job saw."),
    ("value_post_hoc", pa.float64(), "Value in the replay."),
    ("detail", pa.string(), "The alarm in words (the job's, else the replay's)."),
    ("instrumented", pa.bool_(), "A step rule's alarm on a step the run instrumented (profiler, FLOPs profile, "
                                 "checkpoint): the replay skips such steps; not counted as a disagreement."),
)


ANALYSIS = Analysis("alarm_agreement", "In-job alarms", ("alarms", "scalars", "train_steps", "comms_calls", "step_time"),
                    {"alarm_agreement": ALARM_AGREEMENT}, _alarm_agreement, former_keys={"alarms": None}, phrase=lambda summary, findings: alarm_lines(summary), section=alarms_section)
