"""Hostile values in the native artifacts a job leaves (DeepSpeed logs, comms dumps, FLOPs-profiler text,
csv_monitor, TensorBoard, autotuning results, the collector's manifests): a number replaced by nan, inf,
1e999, 400 or 5000 digits, a value past int64, text, a container, deep nesting or a byte that is not
UTF-8 never makes an importer raise (ingest would lose the whole file, "import_failed"). Every table it
returns holds the contract's columns and types, and every issue has a declared reason and severity.

The inputs are real: the 2-rank CPU DeepSpeed runs in ../shared and the bundled collector sample. The
cases are fixed (seeded): the largest file of each importer kind, eight number tokens in each.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pytest

from steplens.analyze import importers
from steplens.analyze.contract import issue_reasons
from steplens.analyze.importers.base import conform

from conftest import CORPUS

ROOTS = [CORPUS.parent / "deepspeed-cpu-runs", Path(__file__).resolve().parents[1] / "sample_runs" / "deepspeed_cpu_2rank"]
NUMBER = re.compile(rb"(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.])")
HOSTILE = [b"nan", b"NaN", b"inf", b"Infinity", b"-inf", b"1e999", b"9" * 400, b"9" * 5000, b"99999999999999999999",
           b"-99999999999999999999", b"1.2.3", b"\xff", b'"x"', b"{}", b"[]", b"[" * 3000 + b"]" * 3000, b"null",
           b"true", b"-0"]
TOKENS_PER_FILE = 8
MAX_FILE_BYTES = 3_000_000


def _one_file_per_kind() -> list[tuple[str, Path, Path]]:
    """(importer name, root, file): the largest file (most records to damage) each importer claims,
    Parquet parts aside."""
    chosen: dict[str, tuple[int, Path, Path]] = {}
    for root in ROOTS:
        for path in sorted(root.rglob("*")) if root.is_dir() else []:
            if not path.is_file() or ".steplens" in path.parts or path.name.endswith(".parquet"):
                continue
            importer = importers.claimant(path)
            size = path.stat().st_size
            if importer is not None and size <= MAX_FILE_BYTES and size > chosen.get(importer.name, (0, None, None))[0]:
                chosen[importer.name] = (size, root, path)
    return [(name, root, path) for name, (_, root, path) in sorted(chosen.items())]


FILES = _one_file_per_kind()


def _cases(path: Path) -> list[tuple[int, int]]:
    data = path.read_bytes()
    spans = [m.span() for m in NUMBER.finditer(data)]
    return random.Random(path.name).sample(spans, min(TOKENS_PER_FILE, len(spans)))


@pytest.mark.skipif(not FILES, reason="no native artifacts beside the checkout")
@pytest.mark.parametrize("kind,root,path", FILES, ids=[kind for kind, _, _ in FILES])
def test_hostile_values_never_make_an_importer_raise(tmp_path, kind, root, path):
    data = path.read_bytes()
    relative = path.relative_to(root)
    copied = tmp_path / relative
    # The file's own folder comes along: companions (a sibling ds_config.json, an experiment's files).
    shutil.copytree(path.parent, copied.parent, ignore=shutil.ignore_patterns("*.gz", "*.pt.trace.json"))
    failures = []
    for start, end in _cases(path):
        for value in HOSTILE:
            copied.chmod(0o644)
            copied.write_bytes(data[:start] + value + data[end:])
            importer = importers.claimant(copied)
            if importer is None:  # the damage made it another kind of file (a collector manifest no longer one)
                continue
            try:
                got = importer.parse(copied, str(relative))
                for table, frame in got.tables.items():
                    assert conform(frame, table).schema == frame.schema, table
                for severity, reason, count, detail in got.issues:
                    issue_reasons.check(severity, reason)
                    assert isinstance(count, int) and count > 0 and isinstance(detail, str)
            except Exception as e:  # noqa: BLE001 (each failure is collected and shown)
                failures.append(f"{data[start:end]!r} -> {value[:12]!r}...: {type(e).__name__}: {str(e)[:200]}")
    assert not failures, "\n".join(failures)
