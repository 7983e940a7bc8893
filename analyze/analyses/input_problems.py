"""Whether a run reported input problems that lost data: the `ingest_errors` finding."""

from __future__ import annotations

import polars as pl

from steplens.analyze.analyses.registry import Analysis, Inputs, Output


# ---------------------------------------------------------------------------------------------
# What it says


def input_problem_lines(errors: int) -> list[str]:
    if errors:
        return [f"{errors} input problem(s) lost data (see Ingest issues); numbers cover what was readable."]
    return []


# ---------------------------------------------------------------------------------------------
# Its report section


def issues_section(page, run):
    """Every input problem, errors first (the ingest_issues table; reasons: contract/issue_reasons.py)."""
    issues = run.table("ingest_issues")
    if issues.is_empty():
        return page.section("Ingest issues", "issues", empty="None: every input was read completely.")
    order = pl.col("severity").replace_strict({"error": 0, "warning": 1, "info": 2}, default=3)
    section = page.section("Ingest issues", "issues")
    section.rows(issues.sort(order, "file"), {
        "severity": ("severity", "text"), "file": ("file", "text"), "rank": ("rank", "text"),
        "reason": ("reason", "text"), "count": ("count", "num"), "detail": ("detail", "text")}, "ingest_issues")
    return section


# ---------------------------------------------------------------------------------------------
# The analysis


def _input_problems(inputs: Inputs) -> Output:
    issues = inputs.table("ingest_issues")
    errors = issues.filter(pl.col("severity") == "error").height if not issues.is_empty() else 0
    return Output(finding=errors or None)  # input problems that lost data


ANALYSIS = Analysis("ingest_errors", "Input problems", ("ingest_issues",), {}, _input_problems, phrase=lambda errors, findings: input_problem_lines(errors), section=issues_section)
