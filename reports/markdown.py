"""summary.md: the verdict and the key tables, sized for a PR comment (GitHub-flavoured markdown).

Names from traces go into table cells and list items; characters markdown or HTML would act on
(`|`, `<`, `>`, backticks, `*`, `_`, `[`, `]`) are escaped so a kernel name cannot break the
table or inject markup.
"""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl

from steplens.analyze.analyses.alarm_agreement import ALARM_HEADER, alarm_rows
from steplens.analyze.contract.text import safe_text, text_value

from . import roofline
from .data import kernel_labels, load, ms, size, write_atomic
from .html import SUMMARY_FILE, key_numbers
from .verdict import first_screen, verdict

MD_SPECIAL = re.compile(r"([\\`*_\[\]|<>#~&])")
# What GitHub turns into a notification or a link in plain text: @mentions (a user, or a team: @org/team) and the
# autolinked www. and scheme:// addresses. A zero-width space after the @ and in the address keeps the text as it
# reads and makes it neither (as Renovate does in its PR bodies).
NOT_LINKED = [(re.compile(r"@(?=\w)"), "@&#8203;"), (re.compile(r"(?i)\bwww\."), "www&#8203;."),
              (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*):(?=//)"), "\\1:&#8203;")]
TOP_ROWS = 5
MAX_CELL = 80  # long C++ kernel names would make the table unreadable in a PR comment


def escape(text) -> str:
    """Markdown-escaped, on one line, with no control characters (names come from traces and logs)."""
    text = MD_SPECIAL.sub(r"\\\1", safe_text(str(text).replace("\n", " ")))
    for pattern, replacement in NOT_LINKED:
        text = pattern.sub(replacement, text)
    return text


def _cell(text) -> str:
    """A table cell, a long one cut at a word (or mid-word where a word is half the cell)."""
    text = str(text)
    if len(text) <= MAX_CELL:
        return escape(text)
    cut = text[: MAX_CELL - 1]
    space = cut.rfind(" ")
    return escape((cut[:space] if space > MAX_CELL // 2 else cut) + "…")


def table_lines(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def render(out_dir: Path) -> str:
    run = load(out_dir)
    lines = [f"### steplens: {escape(run.name)}", "",
             " · ".join(f"{escape(key)} **{escape(value)}**" for key, value in key_numbers(run)), ""]
    lines += [f"- **{escape(text)}**" for text, _section in first_screen(run.findings)] + [""]
    lines += ["<details><summary>In detail</summary>", ""] + [f"- {escape(line)}" for line in verdict(run)]
    lines += ["", "</details>", ""]
    breakdown, timeline = run.table("step_breakdown"), run.table("step_timeline")
    if not breakdown.is_empty() and not timeline.is_empty():
        step = timeline["step"][0]
        shown = breakdown.filter(pl.col("step") == step).sort("span_ns", descending=True)
        lines += [f"**Where ProfilerStep\\#{step} went** (the slowest profiled step; device time per rank, longest first)", ""]
        lines += table_lines(["rank", "span", "compute", "exposed comm", "idle: host-bound", "sync", "other"],
                             [[r["rank"], ms(r["span_ns"]), ms(r["compute_ns"]), ms(r["exposed_comm_ns"]),
                               ms(r["host_bound_ns"]), ms(r["sync_ns"]), ms(r["other_ns"])]
                              for r in shown.head(TOP_ROWS).iter_rows(named=True)])
    top = run.table("top_kernels")
    if not top.is_empty():
        lines += ["**Top kernels** (kernels, memcpy and memset, by total GPU time)", ""]
        labels = kernel_labels(top["name"].to_list())  # numbered over the whole table, as report.html numbers them
        lines += table_lines(["kernel", "category", "calls", "total"],
                             [[labels[r["name"]], r["category"], r["calls"], ms(r["time_ns"])]
                              for r in top.head(TOP_ROWS).iter_rows(named=True)])
    collectives = run.table("collective_summary")
    if not collectives.is_empty():
        lines += ["**Collectives** (most exposed first; exposed on the worst rank)", ""]
        lines += table_lines(["collective", "size", "calls", "exposed", "worst rank", "median busbw GB/s"],
                             [[r["op"], size(r["bytes"]) if r["bytes"] is not None else "unknown", r["calls"],
                               ms(r["max_rank_exposed_ns"]), r["max_exposed_rank"],
                               f"{r['busbw_median_gbps']:.1f}" if r["busbw_median_gbps"] is not None else ""]
                              for r in collectives.head(TOP_ROWS).iter_rows(named=True)])
    if alarms := alarm_rows(run):
        lines += ["**Alarms**" + (f" (first {TOP_ROWS} of {len(alarms)}; tables alarm_agreement, monitor_alarms)"
                                  if len(alarms) > TOP_ROWS else ""), ""]
        lines += table_lines(ALARM_HEADER, [[text_value(cell) for cell in row] for row in alarms[:TOP_ROWS]])
    lines += roofline.summary_lines(run.findings.get("roofline"), escape)
    notes = run.findings.get("caveats", [])
    if notes:
        lines += ["<details><summary>Method and caveats</summary>", ""]
        lines += [f"- **{escape(c['title'])}**: {escape(c['detail'])}" for c in notes]
        lines += ["", "</details>", ""]
    lines.append("Full report: report.html in the run's output folder (beside summary.md); tables: Parquet, queryable "
                 "with `steplens sql`.")
    return "\n".join(lines) + "\n"


def render_compare(result: dict) -> str:
    from .compare import METHOD, display_tables, headline

    lines = [f"### steplens compare: {escape(result['base'])} → {escape(result['new'])}", "",
             f"**{escape(headline(result))}**", ""]
    lines += [f"- {escape(w)}" for w in result["warnings"]]
    for table in display_tables(result):
        if table["rows"]:
            lines += ["", f"**{escape(table['title'])}**" + (f" ({escape(table['note'])})" if table["note"] else ""), ""]
            lines += table_lines(table["header"], table["rows"])
    lines += ["<details><summary>Method</summary>", "", escape(METHOD), "", "</details>", ""]
    return "\n".join(lines)


def write(out_dir: Path) -> Path:
    """Render summary.md into out_dir, atomically."""
    return write_atomic(Path(out_dir) / SUMMARY_FILE, render(out_dir))
