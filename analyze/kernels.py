"""Which kernels take the GPU time: categories per rank and step, and the top kernels.

Categories come from name patterns in `KERNEL_CATEGORIES`, checked in order (first match wins);
users extend it with `--kernel-categories FILE` (CSV with columns category,pattern, placed before the
defaults). memcpy and memset come from the event kind, not the name.
"""

from __future__ import annotations

import csv
from pathlib import Path

import polars as pl

# (category, case-insensitive regex). Communication first: NCCL kernel names contain "Reduce".
KERNEL_CATEGORIES: list[tuple[str, str]] = [
    ("communication", r"nccl|rccl|^c10d::|allreduce|all_reduce|allgather|reducescatter|sendrecv"),
    ("attention", r"flash|fmha|attention|attn|sdpa|mha_|scaled_dot_product"),
    ("gemm", r"gemm|cublas|cutlass|xmma|nvjet|matmul|wgmma|gemv|Cijk_|hipblaslt|splitk"),
    ("elementwise/reduction", r"elementwise|vectorized|unrolled|reduce|reduction|softmax|norm|"
                              r"\badd|\bmul|copy|fill|dropout|activation|gelu|silu|relu|triton_|index|cat|scatter|gather"),
]
CATEGORIES = ("gemm", "attention", "elementwise/reduction", "communication", "memcpy", "memset", "other")


def load_categories(path: Path) -> list[tuple[str, str]]:
    """User patterns (CSV: category,pattern) followed by the defaults."""
    with open(path, newline="") as f:
        rows = [(r["category"].strip(), r["pattern"].strip()) for r in csv.DictReader(f)]
    return rows + KERNEL_CATEGORIES


def first_match(column: str, patterns: list[tuple[str, str]], default: str | None) -> pl.Expr:
    """The label of the first (label, regex) pattern the column matches, else `default`."""
    expr = pl.when(pl.lit(False)).then(pl.lit(None, pl.String))
    for label, pattern in patterns:
        expr = expr.when(pl.col(column).str.contains(pattern)).then(pl.lit(label))
    return expr.otherwise(pl.lit(default, pl.String))


def categorize(patterns: list[tuple[str, str]] = KERNEL_CATEGORIES) -> pl.Expr:
    """An expression giving a kernel name its category (first matching pattern, case-insensitive)."""
    return first_match("name", [(category, f"(?i){pattern}") for category, pattern in patterns], "other")


def device_work(device: pl.DataFrame, patterns=KERNEL_CATEGORIES) -> pl.DataFrame:
    """Kernels, memcpy and memset with their category. Patterns run once per distinct kernel name."""
    work = device.filter(pl.col("kind").is_in(["kernel", "gpu_memcpy", "gpu_memset"]))
    names = work.select(pl.col("name").unique()).with_columns(category=categorize(patterns))
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
        .sort("time_ns", descending=True)
        .head(limit)
    )
