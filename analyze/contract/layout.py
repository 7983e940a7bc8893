"""Where the collector's files live in a run folder: built here by the collector (collect/parts.py) and
parsed here by the analyzer (importers/collector_parts.py), so the two never disagree.

    collector/<table>/rank<r>-<seq:05d>.parquet   one part per telemetry table per flush (seq counts flushes)
    collector/manifest/rank<r>.json               the rank's manifest, rewritten whole after each flush
    collector/manifest/.rank<r>.lock              locked by the rank while its job runs (who holds it, as JSON)

This layout is a public interface (jobs written by an older steplens are read by a newer one): change it
only with a reader for the old one. The folder `analyze` writes (run.json and one folder per table) is
laid out by schema.MANIFEST_FILE, schema.DEFAULT_OUT_DIR and schema.part_dir.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from steplens.analyze.contract import schema

COLLECTOR_DIR = "collector"
MANIFEST_DIR = "manifest"
# The collector manifest's `format` and `version` keys: a file without this format is not one.
COLLECTOR_MANIFEST_FORMAT = "steplens-collector-manifest"
COLLECTOR_MANIFEST_VERSION = 1

_PART_NAME = re.compile(r"rank(\d+)-(\d+)\.parquet")
_MANIFEST_NAME = re.compile(r"rank(\d+)\.json")
PART_GLOB = "rank*-*.parquet"  # every rank's parts in a table's folder (hidden temporary files excluded)
# Columns added to a table after the first collector wrote it: a part from an older collector lacks them
# (read as null). Every other column of the table is in every part; a part without one is not the collector's.
LATER_COLUMNS = {"train_steps": ("max_allocated_bytes", "max_reserved_bytes")}


@dataclass(frozen=True)
class CollectorPart:
    table: str
    rank: int
    seq: int


def run_folder_of(path: Path) -> Path | None:
    """The folder holding the `collector/` a part or manifest is under (None for a path too short to be one)."""
    return path.parents[2] if len(path.parents) > 2 else None


def collector_root(run_dir: Path) -> Path:
    return Path(run_dir) / COLLECTOR_DIR


def part_path(root: Path, table: str, rank: int, seq: int) -> Path:
    """A part of `table` written by `rank` at flush `seq`, under the collector root."""
    return root / table / f"rank{rank}-{seq:05d}.parquet"


def rank_parts_glob(rank: int) -> str:
    """Glob (relative to the collector root) of one rank's parts of every table."""
    return f"*/rank{rank}-*.parquet"


def manifest_path(root: Path, rank: int) -> Path:
    return root / MANIFEST_DIR / f"rank{rank}.json"


def lock_path(root: Path, rank: int) -> Path:
    """The file a writing rank holds locked while its job runs (hidden: `analyze` does not read it)."""
    return root / MANIFEST_DIR / f".rank{rank}.lock"


LOCK_GLOB = ".rank*.lock"


def parse_part(path: Path) -> CollectorPart | None:
    """The table, rank and seq of a collector part; None for any other file (a hidden temporary one, a
    folder that is not a telemetry table, a folder not under `collector/`)."""
    numbers = parse_part_name(path.name)
    if numbers is None or path.parent.parent.name != COLLECTOR_DIR or path.parent.name not in schema.TELEMETRY_TABLES:
        return None
    return CollectorPart(path.parent.name, *numbers)


def parse_part_name(name: str) -> tuple[int, int] | None:
    """(rank, seq) of a part's file name, e.g. rank3-00012.parquet -> (3, 12); None for any other name."""
    match = _PART_NAME.fullmatch(name)
    return (int(match[1]), int(match[2])) if match else None


def parse_manifest(path: Path) -> int | None:
    """The rank of a collector manifest file; None for any other file."""
    match = _MANIFEST_NAME.fullmatch(path.name)
    if match is None or path.parent.name != MANIFEST_DIR or path.parent.parent.name != COLLECTOR_DIR:
        return None
    return int(match[1])
