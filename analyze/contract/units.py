"""Byte counts as text, stated once for the analyses' sentences and the reports' tables and figures."""

from __future__ import annotations

# Binary prefixes (IEC 80000-13), the units nccl-tests prints message sizes in and PyTorch's memory_summary and
# DeepSpeed's see_memory_usage print memory in; nothing above GiB, which the largest device still fits.
BINARY_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def binary_bytes(num_bytes: float | None, decimals: int | None = None) -> str:
    """num_bytes in the largest binary unit it reaches (whole bytes below 1 KiB); n/a for None. The number has
    `decimals` decimals when given, else three significant digits, whole from 100 up (never 1e+03)."""
    if num_bytes is None:
        return "n/a"
    unit, scale = next(((unit, scale) for unit, scale in BINARY_UNITS if abs(num_bytes) >= scale), ("B", 1))
    value = num_bytes / scale
    if unit == "B":
        return f"{value:.0f} B"
    if decimals is not None:
        return f"{value:.{decimals}f} {unit}"
    return f"{value:.3g} {unit}" if abs(value) < 100 else f"{value:,.0f} {unit}"
