"""Numbers that cannot be true are never printed as results: each becomes a finding that the inputs
disagree, saying what to check.

Checks (``findings["inputs_disagree"]``, one entry per check that fails):

* ``mfu_above_100``: a median MFU or HFU above 100% (the wrong model shape, the wrong peak or dtype,
  or a step time that is too short); the figure is taken out of ``findings["mfu"]`` and out of the ``mfu``
  table (null ``utilization``, the reason in ``inputs_disagree``) by the mfu analysis, with this module's rule.
* ``negative_duration``: a step or micro step that ends before it starts (the host's wall clock was
  stepped back, e.g. by NTP, or the input is damaged).
* ``step_longer_than_run``: a step longer than the run's own span (a unit error in a log, or clocks).
* ``bandwidth_above_link``: an nccl-tests busbw above the device's whole interconnect bandwidth (both
  directions of every NVLink / Infinity Fabric link; busbw is per direction, so even in-switch
  reduction stays below it); the figure is taken out of the finding that carried it. Unknown
  devices are held to the fastest link in the table.

The step-time checks read the `step_time` table, which already leaves such steps out of its summary
(reasons ``negative_duration``, ``longer_than_run``).
"""

from __future__ import annotations

import math

import polars as pl

from steplens.analyze.analyses.devices import DEVICES, FASTEST_LINK
from steplens.analyze.analyses.mfu import utilization
from steplens.analyze.analyses.registry import Analysis, Inputs, Output

CHECK_PEAK = "the peak (--peak-tflops is dense, per GPU; --dtype) and the step time's source"
CHECK_MFU = {  # by numerator
    "palm": "the model shape (--params counts non-embedding parameters; --tokens-per-step is global tokens per "
            "optimizer step), " + CHECK_PEAK,
    "collector_flops_profile": "gradient_accumulation_steps and dp_world_size in the run facts (the profile is one "
                               "micro batch on one rank), " + CHECK_PEAK,
    "deepspeed_flops_profile": "gradient_accumulation_steps and the profile's data- and model-parallel sizes (its "
                               "summary is one micro batch per GPU), " + CHECK_PEAK,
}
CHECK_CLOCK = ("the hosts' clocks (an NTP step during the run moves wall-clock times) and whether the input files "
               "are complete and unmodified")
CHECK_UNITS = "the unit of the logged step time (ms or s) and the hosts' clocks"
CHECK_BANDWIDTH = ("the message size and group size of the collective (nccl_bytes, group_size), whether its latency is "
                   "only the time to issue it (latency_origin issue_only), and the device")


def mark_impossible_mfu(table: pl.DataFrame, finding) -> tuple[pl.DataFrame, object]:
    """The mfu table and finding with every MFU/HFU whose median is above 100% taken out of both alike: the
    finding drops the figure, the table's rows of that metric and numerator keep their inputs but get a null
    `utilization` and the reason in `inputs_disagree`, so report.html, summary.md and `steplens sql` agree."""
    if not table.is_empty():
        table = table.with_columns(inputs_disagree=pl.lit(None, pl.String))
    if not isinstance(finding, list):
        return table, finding
    impossible = [r for r in finding if r.get("utilization") is not None and r["utilization"] > 1]
    for r in impossible:
        bad = (pl.col("metric") == r["metric"]) & (pl.col("numerator") == r["numerator"])
        table = table.with_columns(utilization=pl.when(bad).then(None).otherwise(pl.col("utilization")),
                                   inputs_disagree=pl.when(bad).then(pl.lit(_mfu_detail(r))).otherwise("inputs_disagree"))
    kept = [r for r in finding if r not in impossible]
    return table, kept or ({"note": "not shown: the only figures were above 100% (see inputs_disagree)"}
                           if impossible else kept)


def _mfu_detail(row: dict) -> str:
    # past 1,000,000% as a multiple of the peak: a peak of 1e-300 TFLOP/s once printed a 307-digit percentage
    shown = f"{row['utilization']:.1%}" if row["utilization"] < 1e4 else f"{row['utilization']:.3g}x the peak" \
        if math.isfinite(row["utilization"]) else "beyond any multiple of the peak (an infinite ratio)"
    return f"{row['metric']} {shown} (numerator {row['numerator']}) is above 100%: impossible"


def _mfu(mfu: pl.DataFrame) -> list[dict]:
    """One entry per metric and numerator the mfu analysis marked (mark_impossible_mfu), its median recomputed
    from the inputs the rows keep."""
    if mfu.is_empty() or "inputs_disagree" not in mfu.columns:
        return []
    marked = mfu.filter(pl.col("inputs_disagree").is_not_null())
    entries = []
    for (metric, numerator, detail), rows in marked.group_by("metric", "numerator", "inputs_disagree", maintain_order=True):
        value = rows.select(utilization(*(pl.col(c) for c in ("flops", "step_time_ns", "gpus", "peak_flops")))).to_series().median()
        entries.append({"check": "mfu_above_100", "value": value, "bound": 1.0, "detail": detail,
                        "what_to_check": CHECK_MFU.get(numerator, CHECK_PEAK)})
    return entries


def _steps(step_time: pl.DataFrame) -> list[dict]:
    if step_time.is_empty():
        return []
    entries = []
    for reason, check, what, wrong in (
            ("negative_duration", "negative_duration", CHECK_CLOCK, "ends before it starts (or one of its micro steps does)"),
            ("longer_than_run", "step_longer_than_run", CHECK_UNITS, "is longer than the whole run")):
        bad = step_time.filter(pl.col("reason").fill_null("").str.split(",").list.contains(reason))
        if bad.height:
            first = bad.row(0, named=True)
            entries.append({"check": check, "value": first["step_time_ns"], "steps": bad["step"].head(20).to_list(),
                            "detail": f"{bad.height} step(s) with an impossible time: step {first['step']} {wrong}; "
                                      "left out of the step-time summary",
                            "what_to_check": what})
    return entries


def _bandwidth(findings: dict, device_key: str | None) -> list[dict]:
    bound, source = (DEVICES[device_key].link_gbps, DEVICES[device_key].link_source) if device_key in DEVICES else (
        FASTEST_LINK[0], f"no link known for the device; the fastest in the table ({FASTEST_LINK[1]})")
    entries = []
    # (the finding holding a bandwidth, its name in the detail, the field)
    for finding, key, field in (((findings.get("collectives") or {}).get("most_exposed_collective"),
                                 "most_exposed_collective", "busbw_gbps"),
                                (findings.get("comms_log"), "logged_comms", "median_busbw_gbps")):
        value = finding.get(field) if isinstance(finding, dict) else None
        if value is not None and value > bound:
            finding[field] = None  # never printed as a result
            entries.append({"check": "bandwidth_above_link", "value": value, "bound": bound,
                            "detail": f"{finding.get('op')} busbw {value:.1f} GB/s ({key}) is above the device's whole "
                                      f"interconnect, {bound:g} GB/s ({source})",
                            "what_to_check": CHECK_BANDWIDTH})
    return entries


def inputs_disagree(findings: dict, step_time: pl.DataFrame, mfu: pl.DataFrame, device_key: str | None) -> list[dict]:
    """The failed checks; impossible bandwidths are removed from `findings` (changed in place), impossible MFU
    figures were taken out of the mfu table and finding by the mfu analysis (mark_impossible_mfu)."""
    return _mfu(mfu) + _steps(step_time) + _bandwidth(findings, device_key)


# ---------------------------------------------------------------------------------------------
# What it says


def disagreement_lines(disagree: list[dict]) -> list[str]:
    """Figures that cannot be true (analyze/analyses/sanity.py), with what to check instead of the figure."""
    return [f"Inputs disagree: {d['detail']}; check {d['what_to_check']}." for d in disagree]


# ---------------------------------------------------------------------------------------------
# The analysis


def _sanity(inputs: Inputs) -> Output:
    """Figures that cannot be true, said once (impossible bandwidths leave their findings here; MFU above 100%
    left the mfu table and finding in _mfu)."""
    disagree = inputs_disagree(inputs.findings, inputs.table("step_time"), inputs.table("mfu"),
                               inputs.context.device_key)
    return Output(finding=disagree or None)


ANALYSIS = Analysis("inputs_disagree", "Inputs that disagree", ("step_time", "mfu", "collectives", "comms_log_stats"), {}, _sanity, phrase=lambda disagree, findings: disagreement_lines(disagree))
