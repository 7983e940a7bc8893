"""What a report needs from a run directory: the manifest, the findings, and any table by name.

Reports read the Parquet tables `analyze` wrote; they never parse inputs themselves.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from steplens.analyze.contract import schema
from steplens.analyze.contract.manifest import damage
from steplens.analyze.contract.units import binary_bytes as size  # (the reports' name for it: sizes in tables)
from steplens.analyze.analyses.kernel_families import base_name


@dataclass
class Run:
    out_dir: Path
    manifest: dict
    findings: dict
    _tables: dict = field(default_factory=dict, repr=False)  # each table read once per report

    @property
    def name(self) -> str:
        return self.manifest.get("run_name") or self.manifest.get("run_id", "run")

    def table(self, name: str, columns: list[str] | None = None) -> pl.DataFrame:
        """A table (per-rank tables with their `rank` column), or only some of its columns (the big
        per-event tables); empty when the run has none."""
        key = (name, tuple(columns or ()))
        if key not in self._tables:
            folder = self.out_dir / name
            if not folder.exists() or not any(folder.rglob("*.parquet")):
                self._tables[key] = pl.DataFrame()
            else:
                partitioned = name in schema.TABLES and schema.TABLES[name][2]
                self._tables[key] = pl.read_parquet(folder, columns=columns, hive_partitioning=partitioned)
        return self._tables[key]


def load(out_dir: Path) -> Run:
    """A run directory written by `analyze` (the `.steplens` folder, or the run folder holding it)."""
    out_dir = Path(out_dir)
    if not (out_dir / schema.MANIFEST_FILE).exists() and (out_dir / schema.DEFAULT_OUT_DIR / schema.MANIFEST_FILE).exists():
        out_dir = out_dir / schema.DEFAULT_OUT_DIR
    manifest_path = out_dir / schema.MANIFEST_FILE
    if not manifest_path.exists():
        raise FileNotFoundError(f"{out_dir}: not an analysed run (no {schema.MANIFEST_FILE}); run `analyze` on it first")
    findings_path = out_dir / schema.FINDINGS_FILE
    try:
        manifest = json.loads(manifest_path.read_bytes())
        findings = json.loads(findings_path.read_bytes()) if findings_path.exists() else {}
    except (ValueError, RecursionError) as e:
        raise DamagedRun(f"{out_dir}: damaged result ({type(e).__name__} in its JSON); analyse the run again") from None
    if why := damage(manifest) or (None if isinstance(findings, dict) else "findings.json is not an object"):
        raise DamagedRun(f"{manifest_path}: damaged ({why}); analyse the run again")
    return Run(out_dir, manifest, findings)


class DamagedRun(ValueError):
    """A published result whose run.json or findings.json a reader cannot rely on (edited or broken)."""


def write_atomic(path: Path, text: str) -> Path:
    """Write a text file so that a reader never sees half of it (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def ms(ns: float | None) -> str:
    """A duration for people: ns -> the unit that reads best."""
    if ns is None:
        return "n/a"
    ns = float(ns)
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if abs(ns) >= scale:
            return f"{ns / scale:.3g} {unit}" if abs(ns) < 100 * scale else f"{ns / scale:,.0f} {unit}"
    return f"{ns:.0f} ns"


def text_value(value) -> str:
    """A value as a reader expects it: yes/no, not recorded, thousands separators; never a Python repr."""
    if value is None:
        return "not recorded"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(text_value(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}: {text_value(v)}" for k, v in value.items())
    return str(value)


MAX_KERNEL_LABEL = 60


def kernel_labels(names: list[str]) -> dict[str, str]:
    """Each kernel's base name for a table cell (the full demangled name goes in its tooltip); base
    names shared by several kernels of the table (template instances) are numbered."""
    bases = [base_name(str(name)) for name in names]
    bases = [b if len(b) <= MAX_KERNEL_LABEL else b[: MAX_KERNEL_LABEL - 1] + "…" for b in bases]
    numbered: dict[str, int] = {}
    labels = {}
    for name, base in zip(names, bases):
        if bases.count(base) > 1:
            numbered[base] = numbered.get(base, 0) + 1
            base = f"{base} ({numbered[base]})"
        labels[name] = base
    return labels


ALARM_HEADER = ["step", "alarm", "series", "raised", "value", "detail"]


def alarm_rows(run: Run) -> list[list]:
    """Every alarm of the run, in step order: the in-job alarms beside the same rules replayed (alarm_agreement),
    then the post-hoc alarms over every scalar series (monitor_alarms)."""
    rows = []
    for a in run.table("alarm_agreement").iter_rows(named=True):
        raised = ("in the job and the replay" if a["in_job"] and a["post_hoc"] else
                  "in the job, on an instrumented step" if a.get("instrumented") else
                  "in the job only" if a["in_job"] else "in the replay only")
        value = a["value_in_job"] if a["value_in_job"] is not None else a["value_post_hoc"]
        rows.append([a["step"], a["rule"], a["name"], raised, value, a["detail"]])
    for a in run.table("monitor_alarms").iter_rows(named=True):
        rows.append([a["step"], a["rule"], a["name"], f"post hoc ({a['origin']})", a["value"], a["detail"]])
    return sorted(rows, key=lambda row: (row[0] is None, row[0] if row[0] is not None else 0))
