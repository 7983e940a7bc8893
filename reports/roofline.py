"""The roofline part of summary.md, from findings.json's `roofline` (computed by analyze/analyses/roofline.py,
which also builds its part of the report's FLOPs and MFU section); nothing is computed here."""

from __future__ import annotations

from steplens.analyze.analyses.roofline import module_line, op_line


def summary_lines(finding: dict | None, escape) -> list[str]:
    """Lines for summary.md: the three busiest modeled ops and the three modules furthest below peak."""
    if not finding or not (finding.get("top_ops") or finding.get("modules_below_peak")):
        return []
    lines = ["**Roofline** (top modeled ops by device time" + ("" if finding.get("roof") else "; " + escape(finding.get("note") or "")) + ")", ""]
    lines += [f"- {escape(op_line(op))}" for op in finding.get("top_ops", [])[:3]]
    below = [m for m in finding.get("modules_below_peak", []) if m.get("fraction_of_peak") is not None][:3]
    lines += [f"- module {escape(module_line(m))}" for m in below]
    return lines + [""]
