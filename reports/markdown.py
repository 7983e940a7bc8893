"""summary.md: the verdict and the key tables, sized for a PR comment (GitHub-flavoured markdown).

Names from traces go into table cells and list items; characters markdown or HTML would act on
(`|`, `<`, `>`, backticks, `*`, `_`, `[`, `]`) are escaped so a kernel name cannot break the
table or inject markup.
"""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl

from . import caveats
from .data import load, ms, size, write_atomic
from .html import SUMMARY_FILE
from .verdict import verdict

MD_SPECIAL = re.compile(r"([\\`*_\[\]|<>#])")
TOP_ROWS = 5
MAX_CELL = 80  # long C++ kernel names would make the table unreadable in a PR comment


def escape(text) -> str:
    return MD_SPECIAL.sub(r"\\\1", str(text).replace("\n", " "))


def _cell(text) -> str:
    text = str(text)
    return escape(text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…")


def table_lines(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def render(out_dir: Path) -> str:
    run = load(out_dir)
    m = run.manifest
    devices = ", ".join(m.get("environment", {}).get("device_names", [])) or "devices not recorded"
    lines = [f"### steplens: {escape(run.name)}", "",
             f"world size {m.get('world_size') or 'unknown'}, ranks {len(m.get('ranks', []))}, {escape(devices)}", ""]
    lines += [f"- {escape(line)}" for line in verdict(run)] + [""]
    stats = run.table("step_stats")
    if not stats.is_empty():
        lines += ["**Step time** (CPU, over ranks)", ""]
        lines += table_lines(["step", "median", "slowest", "slowest rank", "straggler"],
                        [[r["step"], ms(r["median_dur_ns"]), ms(r["max_dur_ns"]), r["slowest_rank"],
                          r["straggler_rank"] if r["straggler_rank"] is not None else ""]
                         for r in stats.sort("step").iter_rows(named=True)][:10])
    top = run.table("top_kernels")
    if not top.is_empty():
        lines += ["**Top kernels**", ""]
        lines += table_lines(["kernel", "category", "calls", "total"],
                        [[r["name"], r["category"], r["calls"], ms(r["time_ns"])] for r in top.head(TOP_ROWS).iter_rows(named=True)])
    calls = run.table("collectives")
    if not calls.is_empty():
        by_op = calls.group_by("op", "bytes").agg(calls=pl.len(), exposed=pl.col("exposed_ns").sum(),
                                                    busbw=pl.col("busbw_gbps").median()).sort("exposed", descending=True)
        lines += ["**Collectives** (most exposed first)", ""]
        lines += table_lines(["collective", "size", "calls", "exposed", "median busbw GB/s"],
                        [[r["op"], size(r["bytes"]), r["calls"], ms(r["exposed"]),
                          f"{r['busbw']:.1f}" if r["busbw"] is not None else ""] for r in by_op.head(TOP_ROWS).iter_rows(named=True)])
    notes = caveats.caveats(run)
    if notes:
        lines += ["<details><summary>Method and caveats</summary>", ""]
        lines += [f"- **{escape(c['title'])}**: {escape(c['detail'])}" for c in notes]
        lines += ["", "</details>", ""]
    lines.append("Full report: report.html beside this file; tables: Parquet, queryable with `steplens sql`.")
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
