"""When a published result may be reused as it is: who wrote it, whether it is whole, and the keys
that say its inputs and the steplens code are unchanged.

Standard library only: the `analyze` script answers a re-run with nothing changed from this alone,
before importing polars and pyarrow (cli_rerun.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
from pathlib import Path

MANIFEST_FILE = "run.json"  # schema.MANIFEST_FILE, which imports pyarrow; test_contract checks they agree
OUTPUT_CREATOR = "steplens ingest"  # run.json created_by: marks an output folder steplens may replace
PREFIX_BYTES = 64 << 10  # how much of each file its fingerprint reads


def read_manifest(folder: Path) -> dict:
    """run.json of an output folder, {} when it is missing or not a JSON object."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def complete(out_dir: Path, manifest: dict) -> bool:
    """A result steplens published whole: every entry run.json lists is there, and nothing else is."""
    entries = manifest.get("output_entries")
    if manifest.get("created_by") != OUTPUT_CREATOR or not isinstance(entries, list):
        return False
    if not all(isinstance(e, str) and os.sep not in e and (out_dir / e).exists() for e in entries):
        return False
    try:
        return set(os.listdir(out_dir)) <= set(entries)
    except OSError:
        return False


def file_prefix_hash(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(PREFIX_BYTES)).hexdigest()[:16]


@functools.cache
def code_fingerprint() -> str:
    """The steplens code that made a result (every module's and template's name, size and mtime)."""
    package = Path(__file__).resolve().parents[2]
    return _fingerprint(package, [p for folder in ("analyze", "reports") for p in (package / folder).rglob("*")
                                  if p.suffix in (".py", ".j2", ".c")])


def _fingerprint(package: Path, files: list[Path]) -> str:
    return hashlib.sha256(repr([(str(p.relative_to(package)), p.stat().st_size, p.stat().st_mtime_ns)
                                for p in sorted(files)]).encode()).hexdigest()


@functools.cache
def parse_fingerprint() -> str:
    """The code that turns an input file into its tables (importers, trace semantics, the run contract, ingest):
    a part parsed by other code (an older steplens) is parsed again, not reused."""
    analyze = Path(__file__).resolve().parents[1]
    files = [p for folder in ("importers", "trace", "contract") for p in (analyze / folder).rglob("*")
             if p.suffix in (".py", ".c")] + [analyze / "pipeline" / "ingest.py"]
    return _fingerprint(analyze.parent, files)[:16]


def listing_key(run_dir: Path, out_dir: Path) -> str | None:
    """One hash of every file under run_dir as discovery walks it (hidden entries and the output folder
    left out): relative path, size, mtime and first 64 KiB of each (the kind of a FIFO or device, never
    opened); and the steplens code. None when a file cannot be read."""
    out_dir = Path(out_dir).resolve()
    entries = []
    try:
        for root, dirs, names in os.walk(run_dir):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and (Path(root) / d).resolve() != out_dir)
            for name in sorted(n for n in names if not n.startswith(".")):
                path = Path(root) / name
                st = path.stat()
                # a FIFO or device is never opened: reading one would block (ingest skips it, unopened)
                prefix = file_prefix_hash(path) if stat.S_ISREG(st.st_mode) else stat.S_IFMT(st.st_mode)
                entries.append((os.path.relpath(path, run_dir), st.st_size, st.st_mtime_ns, prefix))
    except OSError:
        return None
    return hashlib.sha256(repr((entries, code_fingerprint())).encode()).hexdigest()[:32]
