"""`steplens compare` rendered: the verdict and the side-by-side metrics as titled tables of text,
for HTML, markdown and the terminal alike. The comparison itself is `steplens.analyze.compare`."""

from __future__ import annotations

import json

from steplens.analyze.analyses import noise

from .data import kernel_labels, ms


def _is_duration(name: str) -> bool:
    return name.endswith("(ns)")  # the metric's unit, as the analysis names it (compare --format json keeps it)


def _label(name: str) -> str:
    """A metric's name for people: its unit is in the value ('1.52 ms'), not in a '(ns)' label."""
    return name.removesuffix(" (ns)")


def _fmt_metric(name: str, value: float | None) -> str:
    if value is None:
        return "n/a"
    return ms(value) if _is_duration(name) else f"{value:.1%}"


def _fmt_delta(base: float | None, new: float | None) -> str:
    if base is None or new is None or base == 0:
        return ""
    return f"{new / base - 1:+.1%}"


def _fmt_change(name: str, base: float | None, new: float | None) -> str:
    """A duration's change relative to it; a share's (MFU, idle) in percentage points: 1% -> 4% is +3.0 pp,
    not +300%."""
    if _is_duration(name):
        return _fmt_delta(base, new)
    return "" if base is None or new is None else f"{(new - base) * 100:+.1f} pp"


def _median_text(ns: float | None) -> str:
    return ms(ns) if ns is not None else "too few steps"


def _value_of(values_json: str, run: str) -> str:
    """One run's value in run_comparability's values ({"base": 4, "new": null}), 'not recorded' for none."""
    try:
        values = json.loads(values_json)
    except (TypeError, ValueError):
        return ""
    value = values.get(run) if isinstance(values, dict) else None
    return "not recorded" if value is None else str(value)


def _fmt_value(verdict: dict, value: float | None) -> str:
    if value is None:
        return "n/a"
    return ms(value) if verdict["unit"] == "ns" else f"{value:,.4g} {verdict['metric']}"


def headline(result: dict) -> str:
    """'Step time: regression: median +12.0%, ...' or 'tokens/s: improvement: ...' in one line."""
    verdict = result["verdict"]
    name = verdict["metric"][:1].upper() + verdict["metric"][1:]
    return f"{name}: {verdict['verdict']}" + (f": {verdict['why']}" if verdict.get("why") else "")


def display_tables(result: dict) -> list[dict]:
    """The comparison as titled tables of formatted cells."""
    verdict, step = result["verdict"], result["step_time"]
    rows = []
    if verdict["unit"] != "ns" and verdict.get("base_n"):
        shown = {side: "too few steps" if verdict[f"{side}_median"] is None else _fmt_value(verdict, verdict[f"{side}_median"])
                 for side in ("base", "new")}  # (a median of a few unlike steps is a rate no step had)
        rows.append([f"median {verdict['metric']}", shown["base"], shown["new"],
                     _fmt_delta(verdict["base_median"], verdict["new_median"]),
                     f"{verdict['base_n']} / {verdict['new_n']}"])
        samples = verdict["samples_per_step"]
        rows.append(["samples per optimizer step (median)", f"{samples['base']:,.0f}", f"{samples['new']:,.0f}",
                     _fmt_delta(samples["base"], samples["new"]), ""])
    if step:
        rows.append(["median step time", _median_text(step["base_median_ns"]), _median_text(step["new_median_ns"]),
                     _fmt_delta(step["base_median_ns"], step["new_median_ns"]), f"{step['base_steps']} / {step['new_steps']}"])
    why = verdict.get("why_metric")
    note = " ".join(x for x in (f"{why[:1].upper()}{why[1:]}." if why else "", f"Step times: {step['source']}." if step else "") if x)
    tables = [{"title": "Step time and throughput", "note": note, "header": ["metric", "base", "new", "change", "steps"],
               "rows": rows}]
    tables.append({"title": "Efficiency", "note": "", "header": ["metric", "base", "new", "change"],
                   "rows": [[_label(m["metric"]), _fmt_metric(m["metric"], m["base"]), _fmt_metric(m["metric"], m["new"]),
                             _fmt_change(m["metric"], m["base"], m["new"])] for m in result["metrics"]]})
    comparable = result["comparability"]
    # each run's value, and what a difference means (what is missing, the warnings above say)
    tables.append({"title": "What a step is in each run", "note": "", "header": ["field", "base", "new", "status", "detail"],
                   "rows": [[r["field"], _value_of(r["values"], "base"), _value_of(r["values"], "new"), r["status"],
                             r["detail"] if r["status"] == "different" else ""]
                            for r in comparable.iter_rows(named=True)]})
    for key, title, label in (("categories", "Kernel categories", "category"), ("kernels", "Top kernels", "name")):
        frame = result[key]
        names = kernel_labels(frame[label].to_list()) if key == "kernels" and not frame.is_empty() else {}
        rows = [] if frame.is_empty() else [
            [names.get(r[label], r[label]), ms(r["base_ns"]), ms(r["new_ns"]), ms(r["delta_ns"]),
             f"{r['delta']:+.1%}" if r["delta"] is not None else "new"]
            for r in frame.iter_rows(named=True)]
        tables.append({"title": title, "note": "GPU time per step and rank, largest changes first.",
                       "header": [label, "base", "new", "delta", "change"], "rows": rows})
    return tables


METHOD = ("Step times are per-step samples of each run. When micro batch, gradient accumulation and world size "
          "agree, the verdict is on step time; when any differs, on throughput per step (tokens/s when both runs "
          "know their sequence length, else samples/s). " + noise.METHOD
          + " Other metrics are shown without a test: they are one number per run.")
