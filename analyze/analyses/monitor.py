"""Monitor analysis over the `scalars` table: curves on a common x axis, post-hoc alarms, and whether
runs can be compared at all.

Curves are aligned on global samples (or tokens), never on the optimizer step: a step means
train_batch_size samples, and that differs between runs with another micro batch, gradient
accumulation or world size. Pure functions; run facts are the `facts` of run.json.
"""

from __future__ import annotations

import re
import json
import math

import polars as pl
import pyarrow as pa

# The alarm rules are the in-job collector's (analyze/contract/alarm_rules.py): one implementation, fed here
# point by point over every scalar series of the run, whoever wrote it, with the same trailing windows,
# thresholds and cooldowns, so a series the job saw raises the same alarms here as it did there.
from steplens.analyze.contract import alarm_rules
from steplens.analyze.contract.alarm_rules import SPIKE_Z  # noqa: F401  (the spike limit, for readers of this module)
from steplens.analyze.analyses import step_time
from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.contract.text import text_value as value_text
from steplens.analyze.contract import schema

ORIGIN_PREFERENCE = ("collector", "csv_monitor", "tensorboard", "wandb", "log")  # exact first, float32 TB later
# Post hoc, the rules a job may leave off run too (they cost the job nothing here), with their default settings.
POST_HOC_EXTRA_KINDS = ("grad_norm_spike", "memory_growth")
# The `alarm` column keeps its values (public): the rule that fired is in the `rule` column.
ALARM_OF_RULE = {"nonfinite": "nan_inf", "loss_spike": "loss_spike", "grad_norm_spike": "grad_norm_high",
                 "grad_norm_high": "grad_norm_high", "memory_growth": "memory_growth",
                 "throughput_drop": "throughput_drop", "slow_step": "throughput_drop"}
ALARM_SCHEMA = {"alarm": pl.String, "name": pl.String, "origin": pl.String, "source": pl.String,
                "global_samples": pl.Int64, "step": pl.Int64, "value": pl.Float64, "baseline": pl.Float64,
                "score": pl.Float64, "threshold": pl.Float64, "detail": pl.String, "rule": pl.String}
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
        zero = config.get("zero_optimization")  # (a printed ds_config: an object, or anything if damaged)
        value = zero.get("stage") if isinstance(zero, dict) else None
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
    """Fill step (the 0-based optimizer step whose end the point is: global_samples / train_batch_size - 1, as the
    collector numbers them) and global_tokens (x seq_len) where the run facts allow."""
    batch, seq_len = run_fact(facts, "train_batch_size"), run_fact(facts, "seq_len")
    columns = []
    if isinstance(batch, int) and batch > 0:
        after = pl.col("global_samples")
        columns.append(pl.col("step").fill_null(pl.when(after >= batch).then(after // batch - 1)))
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


def post_hoc_rules(facts: dict | None = None, grad_norm_threshold: float | None = None) -> list[alarm_rules.Rule]:
    """The rules judged after the fact: the in-job defaults, and the opt-in scalar rules with their defaults;
    a kind the run's collector configured (run.json settings.alarms) is judged with the job's settings, and
    `grad_norm_threshold` sets grad_norm_high. `"alarms": []` in the job turned delivery off, not the analysis."""
    settings = (facts or {}).get("settings")
    configured = settings.get("alarms") if isinstance(settings, dict) else None
    try:
        configured_rules = alarm_rules.parse_rules(configured) if isinstance(configured, list) else []
    except ValueError:  # a config the collector refused: the defaults
        configured_rules = []
    configured_kinds = {rule.kind for rule in configured_rules}
    defaults = [*alarm_rules.parse_rules(None), *(alarm_rules.Rule.parse({"kind": k}) for k in POST_HOC_EXTRA_KINDS)]
    rules = [rule for rule in defaults if rule.kind not in configured_kinds]
    rules += [rule for rule in configured_rules if rule.kind in alarm_rules.SCALAR_KINDS + alarm_rules.STEP_KINDS]
    if grad_norm_threshold is not None:
        rules = [rule for rule in rules if rule.kind != "grad_norm_high"]
        rules.append(alarm_rules.Rule.parse({"kind": "grad_norm_high", "threshold": grad_norm_threshold}))
    return rules


def series_alarms(rules: list[alarm_rules.Rule], rows: list[dict], skip_steps=frozenset()) -> list[dict]:
    """The rules over one series' points (dicts with name, step, global_samples, value, wall_ns), in order:
    the engine's alarm dicts, as the job would have raised them on the same points, each with the
    `position` of the point that raised it; the step rules skip `skip_steps`."""
    engine = alarm_rules.AlarmEngine(rules, skip_steps=skip_steps)
    alarms = []
    for position, row in enumerate(rows):
        alarms += [{**alarm, "position": position} for alarm in
                   engine.scalar(row["name"], row["step"], row["global_samples"], row["value"], row.get("wall_ns"),
                                 position=position)]
    return alarms


def monitor_alarms(scalars: pl.DataFrame, facts: dict | None = None, grad_norm_threshold: float | None = None,
                   rules: list[alarm_rules.Rule] | None = None, instrumented=frozenset()) -> pl.DataFrame:
    """Post-hoc alarms over every tag, from the alarm rules (`post_hoc_rules` unless `rules` is given) fed each
    series in global-sample order: nan_inf, loss_spike, grad_norm_high (above the threshold when one is given,
    and robust-z spikes), throughput_drop (a rate falls, or a step time rises: slow_step), memory_growth.
    The step rules skip the `instrumented` optimizer steps in the collector's series (whose `step` is the
    optimizer step) and in series whose steps come from global_samples (with_axes); other loggers number their
    points their own way."""
    rules = post_hoc_rules(facts, grad_norm_threshold) if rules is None else rules
    series = one_origin(scalars)
    if not series.is_empty():  # a step told from global_samples is the optimizer step too
        series = with_axes(series.with_columns(numbered=pl.col("step").is_not_null()), facts or {})
    alarms = []
    for _, frame in series.group_by("name", maintain_order=True):
        rows = frame.sort("global_samples", maintain_order=True).to_dicts()
        optimizer_steps = frame["origin"][0] == "collector" or not frame["numbered"].any()
        skip = instrumented if optimizer_steps else frozenset()
        for alarm in series_alarms(rules, rows, skip):
            row = rows[alarm["position"]]
            alarms.append({"alarm": ALARM_OF_RULE[alarm["rule"]], "rule": alarm["rule"], "name": alarm["name"],
                           "origin": row["origin"], "source": row["source"], "global_samples": row["global_samples"],
                           "step": row["step"], "value": alarm["value"], "baseline": alarm["baseline"],
                           "score": alarm["score"], "threshold": alarm["threshold"], "detail": alarm["detail"]})
    return pl.DataFrame(alarms, schema=ALARM_SCHEMA)


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
            detail = f"not recorded for the {' and '.join(missing)} run{'s' if len(missing) > 1 else ''}"
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


def monitor_tables(scalars: pl.DataFrame, facts: dict, grad_norm_threshold: float | None = None,
                   instrumented=frozenset()) -> dict[str, pl.DataFrame]:
    """The tables `analyze` writes for one run: monitor_alarms, and run_comparability (for one run:
    which of the fields needed to compare it with others are missing)."""
    return {"monitor_alarms": monitor_alarms(scalars, facts, grad_norm_threshold, instrumented=instrumented),
            "run_comparability": comparability({"run": facts})}


def alarms_finding(alarms: pl.DataFrame) -> dict | None:
    """Post-hoc alarms by the rule that fired (`by_rule`), and each one's (rule, series name, step) (`alarms`), by
    which the verdict tells them from the in-job rules' replay of the same series (alarm_agreement)."""
    if alarms.is_empty():
        return None
    return {"by_rule": dict(alarms.group_by("rule").len().sort("rule").iter_rows()),
            "alarms": alarms.select("rule", "name", "step").sort("step", "rule", "name", nulls_last=True).rows()}


# ---------------------------------------------------------------------------------------------
# What it says


def alarms_lines(alarms: dict, findings: dict) -> list[str]:
    by_rule = alarms.get("by_rule", alarms)  # (counts by kind alone in a result of steplens before 2026-12)
    return ["Monitor alarms: " + ", ".join(f"{rule} x{n}" for rule, n in by_rule.items()) + " (table monitor_alarms)."]


def distinct_alarms(findings: dict) -> dict[str, int]:
    """Every alarm of the run once, by rule: the post-hoc ones over every series (monitor_alarms), the in-job
    rules replayed on the recorded rows and the alarms the job itself raised on steps it did not instrument
    (alarm_agreement), an alarm of one rule on one series at one step counted once however many of them raised it."""
    posted = findings.get("monitor_alarms") or {}
    if "by_rule" not in posted and posted:  # a result of steplens before 2026-12: counts by kind, no alarms to match
        return dict(sorted(posted.items()))
    seen = {tuple(a) for a in (posted.get("alarms") or [])}
    agreement = findings.get("alarm_agreement") or {}
    seen |= {tuple(a) for a in agreement.get("replayed", []) + agreement.get("raised_in_job", [])}
    counts: dict[str, int] = {}
    for rule, _name, _step in seen:
        counts[rule] = counts.get(rule, 0) + 1
    return dict(sorted(counts.items()))


# ---------------------------------------------------------------------------------------------
# Its report section


# The curves a reviewer looks for first, as patterns on the scalar's name.
PREFERRED_CURVES = [re.compile(p) for p in (r"loss", r"grad.?norm", r"(^|[/_])lr($|[/_])",
                                            r"samplespersec|throughput|step.?time", r"mem")]
MAX_CURVES = 6


def preferred_curves(names: list[str], limit: int = MAX_CURVES) -> list[str]:
    """The `limit` names a reviewer looks at first (PREFERRED_CURVES' order, then by name)."""
    def rank(name: str) -> int:
        return next((i for i, pattern in enumerate(PREFERRED_CURVES) if pattern.search(name.lower())), len(PREFERRED_CURVES))

    return sorted(names, key=lambda n: (rank(n), n))[:limit]


def monitor_sections(page, run) -> list:
    """The monitor's curves on global samples (summaries.py's scalar_series), and what another run must match to
    be compared with this one (run_comparability)."""
    series = run.table("scalar_series")
    if series.is_empty():
        sections = [page.section("Monitor curves", "monitor",
                                 empty="No monitor scalars (csv_monitor, TensorBoard, W&B or collector).")]
    else:
        section = page.section("Monitor curves", "monitor")
        names = sorted(set(series.filter(pl.col("aligned_points") > 1)["name"].to_list()))
        if names:
            shown = preferred_curves(names)
            scalars = run.table("scalars").filter(pl.col("name").is_in(shown) & pl.col("global_samples").is_not_null()
                                                  & pl.col("value").is_finite())
            section.figure("curves", scalars, "global_samples", shown)
        section.rows(series, {"origin": ("from", "text"), "name": ("scalar", "text"), "points": ("points", "num"),
                              "aligned_points": ("on global samples", "num"), "ranks": ("ranks", "num")}, "scalar_series")
        sections = [section]
    fields = run.table("run_comparability")
    if not fields.is_empty():
        section = page.section("What another run must match to be compared", "run-comparability")
        section.rows(fields, {"field": ("field", "text"), "required": ("required to compare", "value"),
                              "values": ("this run", _run_values), "status": ("status", "text")},
                     "run_comparability", limit=fields.height)
        sections.append(section)
    return sections


def _run_values(values: str) -> str:
    """run_comparability's JSON {run: value} as text: the value alone for one run."""
    decoded = json.loads(values)
    if len(decoded) == 1:
        return value_text(next(iter(decoded.values())))
    return ", ".join(f"{run}: {value_text(value)}" for run, value in decoded.items())


# ---------------------------------------------------------------------------------------------
# The analysis


def _monitor(inputs: Inputs) -> Output:
    scalars = inputs.table("scalars")
    # the collector's points of an earlier job in the same folder (run again, resumed) are not this job's curve
    earlier = step_time.earlier_recording(inputs.table("train_steps"), scalars, "wall_ns")
    scalars = scalars.filter(~(earlier & (pl.col("origin") == "collector").fill_null(False)))
    tables = monitor_tables(scalars, inputs.facts, inputs.options.grad_norm_threshold,
                            step_time.instrumented(inputs.table("step_time")))
    return Output(tables=tables, finding=alarms_finding(tables["monitor_alarms"]))


MONITOR_ALARMS = schema.table_spec(
    ("alarm", pa.string(), "nan_inf | loss_spike | grad_norm_high | throughput_drop (a rate falls or a step time "
                           "rises) | memory_growth."),
    ("name", pa.string(), "Scalar tag."),
    ("origin", pa.string(), "Where the series came from (one origin per tag: the fullest)."),
    ("source", pa.string(), "Input file."),
    ("global_samples", pa.int64(), "x of the point."),
    ("step", pa.int64(), "Optimizer step, when train_batch_size is known."),
    ("value", pa.float64(), "The value that fired (throughput_drop from a rate: the median of the last `recent` "
                            "points)."),
    ("baseline", pa.float64(), "What it was judged against: the trailing median (spikes, slow steps), the median "
                               "before the recent points (rates), the median of the first `window` points "
                               "(memory_growth); null for nan_inf and a threshold."),
    ("score", pa.float64(), "loss/grad-norm spikes: modified z-score 0.6745 (value - median) / MAD; slow step: value "
                            "/ median; rate and memory: relative change."),
    ("threshold", pa.float64(), "The rule's threshold (analyze/contract/alarm_rules.py: z 3.5 after Iglewicz & "
                                "Hoaglin, 3x for a slow step, -20% for a rate, +20% for memory, the grad-norm "
                                "threshold given)."),
    ("detail", pa.string(), "The alarm in words."),
    ("rule", pa.string(), "The alarm rule that fired (alarm_rules kinds: nonfinite, loss_spike, grad_norm_spike, "
                          "grad_norm_high, slow_step, throughput_drop, memory_growth), evaluated as the in-job "
                          "collector evaluates it."),
)

RUN_COMPARABILITY = schema.table_spec(
    ("field", pa.string(), "world_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, "
                           "train_batch_size, code_revision, zero_stage, seq_len, deepspeed_version."),
    ("required", pa.bool_(), "Runs cannot be shown comparable without it."),
    ("status", pa.string(), "same | different | missing (in some run) | recorded (one run)."),
    ("values", pa.string(), "JSON {run: value}."),
    ("detail", pa.string(), "What it means for comparing the runs."),
)


ANALYSIS = Analysis("monitor_alarms", "Monitor alarms", ("scalars", "step_time", "train_steps"), {"monitor_alarms": MONITOR_ALARMS, "run_comparability": RUN_COMPARABILITY},
                    _monitor, phrase=alarms_lines, section=monitor_sections)
