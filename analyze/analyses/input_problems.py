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
# The analysis


def _input_problems(inputs: Inputs) -> Output:
    issues = inputs.table("ingest_issues")
    errors = issues.filter(pl.col("severity") == "error").height if not issues.is_empty() else 0
    return Output(finding=errors or None)  # input problems that lost data


ANALYSIS = Analysis("ingest_errors", "Input problems", ("ingest_issues",), {}, _input_problems, phrase=lambda errors, findings: input_problem_lines(errors))
