"""What a report needs from a run directory: the manifest, the findings, and any table by name.

Reports read the Parquet tables `analyze` wrote; they never parse inputs themselves.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from steplens.analyze.contract import reuse, schema
from steplens.analyze.contract.manifest import damage
from steplens.analyze.contract.units import binary_bytes as size  # (the reports' name for it: sizes in tables)
from steplens.analyze.contract.units import duration as ms  # (the reports' short name for it)
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
                try:
                    self._tables[key] = pl.read_parquet(folder, columns=columns, hive_partitioning=partitioned)
                except (pl.exceptions.PolarsError, OSError) as e:  # a part overwritten with other columns, ...
                    raise DamagedRun(f"{self.out_dir}: damaged result ({name}: {type(e).__name__}: "
                                     f"{str(e).splitlines()[0][:200] if str(e) else ''}); analyse the run again") from None
                if columns is None and (name in schema.TABLES or name in _analysis_tables()) and \
                        (lacking := [c for c in _declared(name) if c not in self._tables[key].columns]):
                    raise DamagedRun(f"{self.out_dir}: damaged result ({name} lacks its column(s) "
                                     f"{', '.join(lacking[:3])}); analyse the run again")
        return self._tables[key]


def load(out_dir: Path) -> Run:
    """A run directory written by `analyze` (the `.steplens` folder, or the run folder holding it); DamagedRun naming
    the file and the problem when it cannot be read as one (reuse.published_manifest, reuse.missing_entries,
    reuse.result_problem)."""
    found = reuse.result_folder(Path(out_dir), schema.DEFAULT_OUT_DIR)
    if found is None:
        raise FileNotFoundError(f"{out_dir}: not an analysed run (no {schema.MANIFEST_FILE}); run `analyze` on it first")
    out_dir = found
    manifest, why = reuse.published_manifest(out_dir, schema.SCHEMA_VERSION)
    findings, findings_path = {}, out_dir / schema.FINDINGS_FILE
    if why is None and os.path.lexists(findings_path):
        findings = None
        if (handle := reuse.open_plain_file(findings_path)) is not None:
            try:
                with handle:
                    findings = json.loads(handle.read(reuse.MAX_MANIFEST_BYTES + 1))
            except (OSError, ValueError, RecursionError):
                pass
        why = None if isinstance(findings, dict) else f"{findings_path} is not a plain file holding a JSON object"
    why = why or damage(manifest)
    why = why or reuse.missing_entries(out_dir, manifest, set(schema.TABLES) | set(_analysis_tables()))
    why = why or reuse.result_problem(out_dir, manifest)
    if why:
        raise DamagedRun(f"{out_dir}: damaged result ({why}); analyse the run again")
    return Run(out_dir, manifest, findings)


def _analysis_tables() -> dict:
    from steplens.analyze import analyses  # here: the analyses import this module for their report sections

    return analyses.TABLES


def _declared(name: str) -> list[str]:
    """The columns a table is written with (ingest's or an analysis's declared schema; `rank` for per-rank tables)."""
    spec = schema.TABLES.get(name) or _analysis_tables()[name]
    return list(spec[0].names)


class DamagedRun(ValueError):
    """A published result whose run.json or findings.json a reader cannot rely on (edited or broken)."""


def write_atomic(path: Path, text: str) -> Path:
    """Write a text file so that a reader never sees half of it (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:  # a full disk, an interrupt: no half-written file left behind
        tmp.unlink(missing_ok=True)
        raise
    return path


MAX_KERNEL_LABEL = 60


def kernel_labels(names: list[str]) -> dict[str, str]:
    """Each kernel's base name for a table cell (the full demangled name goes in its tooltip); base
    names shared by several kernels of `names` (template instances) are numbered, in the order given."""
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

