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
import re
import stat
from pathlib import Path

MANIFEST_FILE = "run.json"  # schema.MANIFEST_FILE, which imports pyarrow; test_contract checks they agree
FINDINGS_FILE = "findings.json"  # schema.FINDINGS_FILE, likewise
OUTPUT_CREATOR = "steplens ingest"  # run.json created_by: marks an output folder steplens may replace
PREFIX_BYTES = 64 << 10  # how much of each file its fingerprint reads


# run.json above this size is not one steplens wrote (a run of 100k sources writes a few tens of MB).
MAX_MANIFEST_BYTES = 256 << 20

# Where `analyze` stages a result for OUT (.OUT.tmp-PID) and moves the one it replaces (.OUT.old-PID), beside OUT.
STAGED = re.compile(r"^\..+\.(tmp|old)-\d+$")


def staged_folder(out_dir: Path, kind: str, pid: int | str = "*") -> Path:
    """out_dir's staging ("tmp") or replaced ("old") folder of process `pid` (a glob pattern by default)."""
    return Path(out_dir).parent / f".{Path(out_dir).name}.{kind}-{pid}"


def open_plain_file(path: Path):
    """`path` opened for reading in binary when it is a regular file, else None: it is opened without following a link
    or waiting on a FIFO, and what was opened is checked (not what the name was a moment before)."""
    try:
        handle = open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb")
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
        handle.close()
        return None
    return handle


def read_manifest(folder: Path) -> dict:
    """run.json of an output folder, {} when it is missing, not a plain file in it (a FIFO would block the reader, a
    device never end), larger than MAX_MANIFEST_BYTES or not a JSON object."""
    handle = open_plain_file(Path(folder) / MANIFEST_FILE)
    if handle is None:
        return {}
    try:
        with handle:
            data = handle.read(MAX_MANIFEST_BYTES + 1)
        manifest = json.loads(data) if len(data) <= MAX_MANIFEST_BYTES else None
    except (OSError, ValueError, RecursionError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def result_folder(path: Path, default_out: str) -> Path | None:
    """The published result a reader was pointed at: `path` when its run.json is one analyze wrote, else its
    `default_out` folder (.steplens) when that holds a run.json, else `path` when it holds any run.json (to be named
    as damaged), else None. A run folder's own run.json that is not steplens's (the user's) does not hide the result."""
    path = Path(path)
    if read_manifest(path).get("created_by") == OUTPUT_CREATOR:
        return path
    for folder in (path / default_out, path):
        if os.path.lexists(folder / MANIFEST_FILE):
            return folder
    return None


def published_manifest(folder: Path, schema_version: int) -> tuple[dict, str | None]:
    """run.json of a published result for a reader (compare, trials, sql, export-trace), with what makes it unusable,
    naming the file: not a plain file (a FIFO would block the reader, /dev/zero never end), too large, not JSON, not an
    object, not written by `analyze` (({}, why) for each of these), or written by a steplens whose tables differ
    (schema_version: (its manifest, why))."""
    path = Path(folder) / MANIFEST_FILE
    handle = open_plain_file(path)
    if handle is None:
        return {}, f"{path} is not a plain file (a link, FIFO or device) or cannot be read"
    try:
        with handle:
            data = handle.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            return {}, f"{path} is larger than {MAX_MANIFEST_BYTES >> 20} MiB: not one steplens wrote"
        manifest = json.loads(data)
    except OSError as e:
        return {}, f"{path} cannot be read ({e.strerror or e})"
    except (ValueError, RecursionError) as e:
        return {}, f"{path} is not valid JSON ({type(e).__name__}: cut short or edited)"
    if not isinstance(manifest, dict):
        return {}, f"{path} holds {type(manifest).__name__}, not an object"
    if manifest.get("created_by") != OUTPUT_CREATOR:
        return {}, f"{path} was not written by steplens analyze (created_by {manifest.get('created_by')!r})"
    if manifest.get("schema_version") != schema_version:  # (returned with the problem: a result, if not for this reader)
        return manifest, (f"{path} is a result of another steplens version (result schema {manifest.get('schema_version')!r}; "
                    f"this steplens reads {schema_version})")
    return manifest, None


def missing_entries(out_dir: Path, manifest: dict, tables: set[str]) -> str | None:
    """What readers need of a published result that is gone since `analyze` listed it (run.json output_entries): a
    table's folder or findings.json removed, or a table's folder left without any Parquet file (every table writes
    one, empty and typed when it has no rows). The report, the summary and an export are the user's to delete."""
    entries = manifest.get("output_entries")
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, str) or not (entry in tables or entry == FINDINGS_FILE):
            continue
        path = Path(out_dir) / entry
        if not path.exists():
            return f"{entry} is missing (run.json lists it)"
        if entry in tables and path.is_dir() and not any(path.rglob("*.parquet")):
            return f"{entry}/ holds no Parquet file (a table's part was removed)"
    return None


def complete(out_dir: Path, manifest: dict) -> bool:
    """A result steplens published whole: every entry run.json lists is there, nothing else is, and nothing in it is
    damaged (result_problem)."""
    entries = manifest.get("output_entries")
    if manifest.get("created_by") != OUTPUT_CREATOR or not isinstance(entries, list):
        return False
    if not all(isinstance(e, str) and os.sep not in e and (out_dir / e).exists() for e in entries):
        return False
    try:
        return set(os.listdir(out_dir)) <= set(entries) and result_problem(out_dir, manifest) is None
    except OSError:
        return False


TRACE_KINDS = frozenset({"kineto", "nsys"})  # importers.TRACE_KINDS (test_contract checks they agree)
TRACE_TABLES = ("trace_events", "flows", "steps")  # the tables every parsed trace writes a part of, for its rank
PARQUET_MAGIC = b"PAR1"  # a Parquet file's first and last four bytes (the format's spec)
_RANK_FOLDER = re.compile(r"rank=\d+")


def plain_file_inside(path: Path, folder: Path) -> bool:
    """`path` is a regular file (not a link, FIFO or device) whose real location is inside `folder`: the only kind
    of file steplens opens in an output folder it did not just write (a FIFO blocks the reader, a link leads out)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        return os.path.commonpath([os.path.realpath(path), os.path.realpath(folder)]) == os.path.realpath(folder)
    except (OSError, ValueError):
        return False


def stray_files(folder: Path) -> list[str]:
    """What in an output folder is not a plain file or folder of its own (links, FIFOs, devices, sockets), by
    relative path: a result holding one is damaged, and none of its files is opened."""
    found = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            path = os.path.join(root, name)
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                continue
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                found.append(os.path.relpath(path, folder))
    return sorted(found)


def result_problem(out_dir: Path, manifest: dict) -> str | None:
    """What makes a published result unreadable, naming the file, or None: a file that is not a plain one (a
    FIFO blocks a reader, a link leads outside), a Parquet file cut short, a folder inside a table's folder that is
    not a rank's (`rank=N`), or a part that run.json's sources list and the folder lacks. Only the first bytes and
    the last of each file are read (a result of any size is checked in a moment)."""
    out_dir = Path(out_dir)
    if stray := stray_files(out_dir):
        return f"{stray[0]} is not a plain file (a link, FIFO or device)"
    for root, dirs, files in os.walk(out_dir):
        depth = len(Path(root).relative_to(out_dir).parts)
        if depth == 0:  # a result being staged holds its scratch (_scratch) and hidden files: not the result's
            dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        if depth == 1 and any(d.startswith("rank=") for d in dirs):  # a per-rank table's folder: its folders are ranks'
            for name in sorted(d for d in dirs if not d.startswith(".")):
                if not _RANK_FOLDER.fullmatch(name):
                    return f"{Path(root).name}/{name} is not a rank's folder (rank=N)"
        for name in sorted(f for f in files if f.endswith(".parquet")):
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    head = f.read(4)
                    size = os.fstat(f.fileno()).st_size
                    f.seek(max(size - 4, 0))
                    tail = f.read(4)
            except OSError as e:
                return f"{os.path.relpath(path, out_dir)} cannot be read ({e.strerror or e})"
            if head != PARQUET_MAGIC or tail != PARQUET_MAGIC or size < 12:
                return f"{os.path.relpath(path, out_dir)} is not a whole Parquet file (cut short or overwritten)"
    sources = manifest.get("sources")
    for source in sources if isinstance(sources, list) else []:
        if not isinstance(source, dict) or source.get("status") not in ("ingested", "reused"):
            continue
        part_id, rank = source.get("part_id"), source.get("rank")
        tables = TRACE_TABLES if source.get("kind") in TRACE_KINDS else source.get("tables")
        if not isinstance(part_id, str) or not isinstance(tables, (list, tuple)) or not (rank is None or type(rank) is int):
            continue
        for table in (t for t in tables if isinstance(t, str) and t.isidentifier()):
            name = f"part-{part_id}.parquet"  # in the table's folder, or its rank's for a per-rank table
            if not ((out_dir / table / name).is_file() or (out_dir / table / f"rank={rank}" / name).is_file()):
                where = f"{table}/rank={rank}/{name}" if rank is not None and table in TRACE_TABLES else f"{table}/{name}"
                return f"{where} is missing (run.json lists it for {source.get('path')})"
    return None


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
