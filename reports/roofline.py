"""The roofline part of the report's "FLOPs and MFU" section and of summary.md: drawn from
findings.json's `roofline` (computed by analyze/analyses/roofline.py); nothing is computed here."""

from __future__ import annotations

import math

from steplens.analyze.analyses.roofline import module_line, op_line
from steplens.analyze.contract.text import shapes_text


OP_COLUMNS = {"name": "op", "shapes": "shapes", "dtype": "dtype", "calls": "calls", "device_ns": "device time",
              "achieved_tflops": "TFLOP/s", "achieved_tbps": "TB/s", "intensity": "FLOPs/byte", "bound": "bound",
              "fraction_of_peak": "of peak"}
MODULE_COLUMNS = {"module": "module", "module_class": "class", "profile_path": "profile path", "device_ns": "forward device time",
                  "unknown_flops_share": "unknown FLOPs", "achieved_tflops": "TFLOP/s", "fraction_of_peak": "of peak", "backward_device_ns": "backward device time",
                  "training_fraction_of_peak": "of peak, fwd+bwd", "flag": "flag"}


def _cell(name: str, value) -> str:
    if value is None:
        return ""
    if name in ("device_ns", "backward_device_ns"):
        return f"{value / 1e6:.3f} ms"
    if name in ("fraction_of_peak", "training_fraction_of_peak"):
        return f"{value:.1%}"
    if name == "unknown_flops_share":  # whole percent, rounded up: 10.1% must not read as the 10% that still gives a rate
        return f"{math.ceil(value * 100)}% of it" if value > 0 else ""
    if name == "shapes":
        return shapes_text(value)
    if isinstance(value, float):
        return f"{value:,.3g}"
    return str(value)


def table(rows: list[dict], columns: dict[str, str], source_table: str) -> dict:
    """A table block as the report template takes it (cells escaped by the template)."""
    return {"header": list(columns.values()), "rows": [[_cell(c, row.get(c)) for c in columns] for row in rows],
            "more": 0, "table": source_table}


def report_blocks(finding: dict | None) -> list[tuple[str, object]]:
    """(kind, content) blocks for the FLOPs and MFU section: the scatter (a figure's name and arguments: figures.roofline_scatter),
    top ops, modules below peak."""
    if not finding:
        return []
    blocks: list[tuple[str, object]] = []
    if finding.get("note"):
        blocks.append(("text", finding["note"] + "."))
    if finding.get("top_ops"):
        blocks.append(("text", "Top modeled ops by device time and their place on the roofline (" + finding["top_ops_definition"] + "):"))
        if finding.get("roof"):
            blocks.append(("figure", ("roofline_scatter", finding["top_ops"], finding["roof"])))
            blocks.append(("text", "Roofs: " + finding["roof"]["label"] + "."))
        # Numbered as the roofline's points are (figures.roofline_scatter).
        numbered = [{"number": number, **op} for number, op in enumerate(finding["top_ops"], 1)]
        blocks.append(("table", table(numbered, {"number": "#", **OP_COLUMNS}, "op_perf")))
    if families := finding.get("time_by_op_family"):
        blocks.append(("text", "Device time by the family of the innermost op that launched it: " + ", ".join(
            f"{f['family']} {f['share']:.0%} ({f['device_ns'] / 1e6:.3f} ms)" for f in families) + "."))
    if finding.get("modules_below_peak"):
        blocks.append(("text", "Modules furthest below peak, among those with the most forward device time ("
                       + finding["modules_definition"] + "):"))
        blocks.append(("table", table(finding["modules_below_peak"], MODULE_COLUMNS, "module_perf")))
    return blocks


def summary_lines(finding: dict | None, escape) -> list[str]:
    """Lines for summary.md: the three busiest modeled ops and the three modules furthest below peak."""
    if not finding or not (finding.get("top_ops") or finding.get("modules_below_peak")):
        return []
    lines = ["**Roofline** (top modeled ops by device time" + ("" if finding.get("roof") else "; " + escape(finding.get("note") or "")) + ")", ""]
    lines += [f"- {escape(op_line(op))}" for op in finding.get("top_ops", [])[:3]]
    below = [m for m in finding.get("modules_below_peak", []) if m.get("fraction_of_peak") is not None][:3]
    lines += [f"- module {escape(module_line(m))}" for m in below]
    return lines + [""]
