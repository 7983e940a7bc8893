"""Which kernels take the GPU time: families per rank and step, and the top kernels.

A kernel's family (the `category` column) comes from its base name (no return type, namespaces,
template arguments or parameters) matched against the patterns of `kernel_families.FAMILIES`, in
order (first match wins); users extend them with `--kernel-categories FILE` (CSV with columns
category,pattern, matched against the base name, placed before the defaults). memcpy and memset come
from the event kind, not the name.
"""

from __future__ import annotations

import csv
from pathlib import Path

import polars as pl
import pyarrow as pa

from steplens.analyze.contract.schema import WORK_KINDS
from steplens.analyze.analyses.kernel_families import FAMILIES, FAMILY_NAMES, base_name
from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.contract import schema

# (category, case-insensitive regex over the base name), in the order they are tried.
KERNEL_CATEGORIES: list[tuple[str, str]] = [(family, pattern) for family, pattern, _ in FAMILIES]
CATEGORIES = FAMILY_NAMES


class CategoriesError(ValueError):
    """A --kernel-categories file steplens cannot use; the message names the file and the row."""


def load_categories(path: Path) -> list[tuple[str, str]]:
    """User patterns (CSV: category,pattern) followed by the defaults. Each pattern is checked as the
    analyses run it (a polars regex, case-insensitive), so a bad one is named here, not mid-analysis."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if not {"category", "pattern"} <= set(reader.fieldnames or ()):
                raise CategoriesError(f"{path}: needs a header row with the columns category,pattern "
                                      f"(found: {','.join(reader.fieldnames or ()) or 'nothing'})")
            rows = []
            for row in reader:
                category, pattern = (row.get(column) for column in ("category", "pattern"))
                if not isinstance(category, str) or not isinstance(pattern, str) or not category.strip() or not pattern.strip():
                    raise CategoriesError(f"{path}, line {reader.line_num}: a category and a pattern are both needed")
                rows.append((category.strip(), pattern.strip()))
    except UnicodeDecodeError as e:
        raise CategoriesError(f"{path}: not UTF-8 text (byte {e.start})") from e
    except csv.Error as e:
        raise CategoriesError(f"{path}: not a CSV file ({e})") from e
    except OSError as e:
        raise CategoriesError(f"{path}: cannot read: {e.strerror or e}") from e
    for category, pattern in rows:
        if why := regex_problem(f"(?i){pattern}"):
            raise CategoriesError(f"{path}: the pattern of {category!r} is not a regular expression steplens can run: "
                                  f"{pattern!r} ({why}; the syntax is Rust's regex crate)")
    return rows + KERNEL_CATEGORIES


def regex_problem(pattern: str) -> str | None:
    """Why the analyses' regex engine (polars: Rust's regex crate, no look-around or back-references) cannot run
    `pattern`, or None."""
    try:
        pl.Series([""]).str.contains(pattern)
    except pl.exceptions.ComputeError as e:
        return next((line[len("error: "):] for line in str(e).splitlines() if line.startswith("error: ")), "invalid")
    return None


def first_match(column: str, patterns: list[tuple[str, str]], default: str | None) -> pl.Expr:
    """The label of the first (label, regex) pattern the column matches, else `default`."""
    expr = pl.when(pl.lit(False)).then(pl.lit(None, pl.String))
    for label, pattern in patterns:
        expr = expr.when(pl.col(column).str.contains(pattern)).then(pl.lit(label))
    return expr.otherwise(pl.lit(default, pl.String))


def categorize(patterns: list[tuple[str, str]] = KERNEL_CATEGORIES, column: str = "name") -> pl.Expr:
    """An expression giving a kernel (base) name its category (first matching pattern, case-insensitive)."""
    return first_match(column, [(category, f"(?i){pattern}") for category, pattern in patterns], "other")


def families(names: pl.Series, patterns: list[tuple[str, str]] = KERNEL_CATEGORIES) -> pl.DataFrame:
    """name, base_name and category of each distinct kernel name."""
    distinct = names.drop_nulls().unique()
    bases = [base_name(n) for n in distinct.to_list()]  # rowwise-ok: once per distinct kernel name, not per event
    table = pl.DataFrame({"name": distinct, "base_name": pl.Series(bases, dtype=pl.String)})
    return table.with_columns(category=categorize(patterns, "base_name"))


def device_work(device: pl.DataFrame, patterns=KERNEL_CATEGORIES) -> pl.DataFrame:
    """Kernels, memcpy and memset with their category. Patterns run once per distinct kernel name."""
    work = device.filter(pl.col("kind").is_in(WORK_KINDS))
    names = families(work["name"], patterns)
    by_name = pl.col("name").replace_strict(names["name"], names["category"], default="other")
    return work.with_columns(
        category=pl.when(pl.col("kind") == "gpu_memcpy").then(pl.lit("memcpy"))
        .when(pl.col("kind") == "gpu_memset").then(pl.lit("memset"))
        .when(pl.col("collective").is_not_null()).then(pl.lit("communication"))
        .otherwise(by_name)
    )


def category_time(work: pl.DataFrame) -> pl.DataFrame:
    """GPU time per rank, step and category (summed kernel time; streams may overlap)."""
    return (
        work.group_by("rank", "step", "category")
        .agg(kernels=pl.len(), time_ns=pl.col("dur_ns").sum())
        .sort("rank", "step", "category", nulls_last=True)
    )


def kernel_totals(work: pl.DataFrame) -> pl.DataFrame:
    """Time and calls per kernel name and rank: the input of top_kernels."""
    return work.group_by("name", "category", "rank").agg(time_ns=pl.col("dur_ns").sum(), calls=pl.len())


def top_kernels(totals: pl.DataFrame, limit: int = 50) -> pl.DataFrame:
    """Kernels by total time over all ranks, with how they spread across ranks."""
    if totals.is_empty():
        return totals
    return (
        totals.group_by("name", "category")
        .agg(
            calls=pl.col("calls").sum(),
            time_ns=pl.col("time_ns").sum(),
            ranks=pl.len(),
            min_rank_time_ns=pl.col("time_ns").min(),
            max_rank_time_ns=pl.col("time_ns").max(),
        )
        .with_columns(mean_ns=pl.col("time_ns") // pl.col("calls"))
        # Ties by name: the same 50 every run.
        .sort("time_ns", "name", "category", descending=[True, False, False], nulls_last=True)
        .head(limit)
    )


# ---------------------------------------------------------------------------------------------
# Its report section


def kernels_section(page, run):
    """GPU time by kernel family, then the top kernels."""
    categories, top = run.table("category_summary"), run.table("top_kernels")
    if top.is_empty():
        return page.section("Kernels", "kernels", empty="No kernels in the traces.")
    section = page.section("Kernels", "kernels")
    section.rows(categories, {"category": ("category", "text"), "kernels": ("activities", "num"),
                              "time_ns": ("GPU time (all ranks)", "ms"), "share": ("share", "pct")}, "category_summary")
    section.text("Top kernels by total GPU time (hover a name for the full signature):")
    section.rows(top, {"name": ("kernel", "kernel"), "category": ("category", "text"), "calls": ("calls", "num"),
                       "time_ns": ("total", "ms"), "mean_ns": ("mean per call", "ms"),
                       "min_rank_time_ns": ("least on a rank", "ms"), "max_rank_time_ns": ("most on a rank", "ms")},
                 "top_kernels")
    return section


# ---------------------------------------------------------------------------------------------
# The analysis


def _top_kernels(inputs: Inputs) -> Output:
    return Output(tables={"top_kernels": top_kernels(inputs.table("_kernel_totals"))} if inputs.ranks else {})


TOP_KERNELS = schema.table_spec(
    ("name", pa.string(), "Kernel."),
    ("category", pa.string(), "Category."),
    ("calls", pa.int64(), "Calls over all ranks."),
    ("time_ns", pa.int64(), "Total time."),
    ("ranks", pa.int64(), "Ranks that ran it."),
    ("min_rank_time_ns", pa.int64(), "Least time on one rank."),
    ("max_rank_time_ns", pa.int64(), "Most time on one rank."),
    ("mean_ns", pa.int64(), "Mean per call."),
)


ANALYSIS = Analysis("top_kernels", "Kernels", ("_kernel_totals",), {"top_kernels": TOP_KERNELS}, _top_kernels, section=kernels_section)
