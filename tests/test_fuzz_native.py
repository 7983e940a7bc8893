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

from steplens.analyze.importers import telemetry
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
            importer = telemetry.claimant(path)
            size = path.stat().st_size
            if importer is not None and size <= MAX_FILE_BYTES and size > chosen.get(importer.name, (0, None, None))[0]:
                chosen[importer.name] = (size, root, path)
    return [(name, root, path) for name, (_, root, path) in sorted(chosen.items())]


FILES = _one_file_per_kind()


def _cases(path: Path) -> list[tuple[int, int]]:
    data = path.read_bytes()
    spans = [m.span() for m in NUMBER.finditer(data)]
    return random.Random(path.name).sample(spans, min(TOKENS_PER_FILE, len(spans)))


def _failures(tmp_path: Path, root: Path, path: Path, variants) -> list[str]:
    """Each (name, bytes) variant of `path` through the importer that claims it, with the file's own folder
    beside it (companions: a sibling ds_config.json, an experiment's files): what raised, or broke the
    contract (a table off its schema, an undeclared issue reason)."""
    relative = path.relative_to(root)
    copied = tmp_path / relative
    shutil.copytree(path.parent, copied.parent, ignore=shutil.ignore_patterns("*.gz", "*.pt.trace.json"))
    failures = []
    for name, damaged in variants:
        copied.chmod(0o644)
        copied.write_bytes(damaged)
        importer = telemetry.claimant(copied)
        if importer is None:  # the damage made it another kind of file (a collector manifest no longer one)
            continue
        try:
            got = importer.parse(copied, str(relative))
            for table, frame in got.tables.items():
                assert conform(frame, table).schema == frame.schema, table
            for severity, reason, count, detail in got.issues:
                issue_reasons.check(severity, reason)
                assert isinstance(count, int) and count > 0 and isinstance(detail, str)
        except BaseException as e:  # noqa: BLE001 (a Rust panic inside polars is a BaseException)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
    return failures


@pytest.mark.skipif(not FILES, reason="no native artifacts beside the checkout")
@pytest.mark.parametrize("kind,root,path", FILES, ids=[kind for kind, _, _ in FILES])
def test_hostile_values_never_make_an_importer_raise(tmp_path, kind, root, path):
    data = path.read_bytes()
    variants = [(f"{data[start:end]!r} -> {value[:12]!r}", data[:start] + value + data[end:])
                for start, end in _cases(path) for value in HOSTILE]
    failures = _failures(tmp_path, root, path, variants)
    assert not failures, "\n".join(failures)


# --- Structural damage: the file cut, its lines moved, bytes flipped, re-encoded, retyped ---------------------
# A second sweep over the same files (and a Parquet part of each collector table): what a killed job, a partial
# copy, a bad disk or an editor does to a whole file rather than to one number. Found by it, and now handled:
# a part whose footer metadata or column name is not UTF-8 (polars panicked: PanicException is no Exception),
# a csv_monitor or autotuning summary.txt cut mid-row (the cut value was kept as if whole).
HUGE_LINE_BYTES = 10_000_000
PARQUET_PARTS = sorted((ROOTS[1] / "collector").glob("*/rank0-00001.parquet"))


def _json_retyped(data: bytes, rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    """The document with one value's type changed (object -> list, string -> number, list -> string, ...)."""
    import json

    try:
        doc = json.loads(data)
    except ValueError:
        return []
    paths: list[list] = []

    def walk(node, at):
        items = node.items() if isinstance(node, dict) else enumerate(node[:3]) if isinstance(node, list) else ()
        for key, value in items:
            paths.append(at + [key])
            walk(value, at + [key])

    walk(doc, [])
    out = []
    for at in rng.sample(paths, min(count, len(paths))):
        changed = json.loads(data)
        parent = changed
        for key in at[:-1]:
            parent = parent[key]
        old = parent[at[-1]]
        parent[at[-1]] = rng.choice([[old], {"k": old}, str(old)[:20], 7, -1, 2.5, None, True,
                                     "x" if isinstance(old, (list, dict)) else []])
        out.append((f"retyped {at}", json.dumps(changed).encode()))
    return out + [("document is a list", b"[]"), ("document is a string", b'"x"'), ("document is a number", b"3")]


def _structural(data: bytes, seed: str) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    size, lines = len(data), data.split(b"\n")
    out = [(f"cut at {at}", data[:at]) for at in sorted({1, size // 2, size - 1, *(rng.randrange(size) for _ in range(8))})]
    if (wide := next((i for i, byte in enumerate(data) if byte >= 0xC0), None)) is not None:
        out.append(("cut inside a UTF-8 character", data[:wide + 1]))
    for _ in range(4):
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        swapped = list(lines)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        out += [(f"line {i} deleted", b"\n".join(lines[:i] + lines[i + 1:])),
                (f"line {i} doubled", b"\n".join(lines[:i + 1] + lines[i:])),
                (f"lines {i} and {j} swapped", b"\n".join(swapped)),
                (f"cut inside line {i}", b"\n".join(lines[:i] + [lines[i][:len(lines[i]) // 2]]))]
    for _ in range(10):
        at, flipped = rng.randrange(size), bytearray(data)
        flipped[at] ^= 1 << rng.randrange(8)
        out.append((f"bit flipped at {at}", bytes(flipped)))
    for _ in range(3):
        at = rng.randrange(size + 1)
        out.append((f"NUL at {at}", data[:at] + b"\0" + data[at:]))
    out += [("CRLF", data.replace(b"\n", b"\r\n")), ("CR", data.replace(b"\n", b"\r")), ("BOM", b"\xef\xbb\xbf" + data),
            ("empty", b""), ("one huge line", (data.replace(b"\n", b" ") * (HUGE_LINE_BYTES // size + 1))[:HUGE_LINE_BYTES])]
    try:
        out.append(("UTF-16", data.decode("utf-8").encode("utf-16")))
    except UnicodeDecodeError:
        pass
    return out + _json_retyped(data, rng, 12)


def _parquet_damage(data: bytes, seed: str) -> list[tuple[str, bytes]]:
    """0xff over bytes of the footer (the schema's column names, the ARROW:schema metadata) and elsewhere, then cuts."""
    rng = random.Random(seed)
    footer_end = len(data) - 8
    footer_start = footer_end - int.from_bytes(data[footer_end:footer_end + 4], "little")
    spots = {data.find(b"ARROW:schema"), data.find(b"rank", footer_start), *rng.sample(range(footer_start, footer_end), 24),
             *(rng.randrange(len(data)) for _ in range(8))}
    out = []
    for at in sorted(spot for spot in spots if spot >= 0):
        damaged = bytearray(data)
        damaged[at] = 0xFF
        out.append((f"0xff at {at}", bytes(damaged)))
    return out + [(f"cut at {at}", data[:at]) for at in (0, 4, len(data) // 2, len(data) - 1)]


STRUCTURAL = FILES + [("collector_part_" + part.parent.name, ROOTS[1], part) for part in PARQUET_PARTS]


@pytest.mark.skipif(not STRUCTURAL, reason="no native artifacts beside the checkout")
@pytest.mark.parametrize("kind,root,path", STRUCTURAL, ids=[kind for kind, _, _ in STRUCTURAL])
def test_structural_damage_never_makes_an_importer_raise(tmp_path, kind, root, path):
    damage = _parquet_damage if path.name.endswith(".parquet") else _structural
    failures = _failures(tmp_path, root, path, damage(path.read_bytes(), path.name))
    assert not failures, "\n".join(failures)


def test_a_cut_last_row_is_never_kept_as_a_whole_value(tmp_path):
    """A csv_monitor row and an autotuning summary row cut mid-number are left out and reported, not kept short."""
    from steplens.analyze.importers import autotune_results, monitor_scalars

    csv = tmp_path / "Train_Samples_lr.csv"
    csv.write_bytes(b"step,lr\r\n8,0.125\r\n16,0.0625\r\n24,0.03")
    got = monitor_scalars.parse_csv_monitor(csv, csv.name)
    assert got.tables["scalars"]["value"].to_list() == [0.125, 0.0625]
    assert [issue[:3] for issue in got.issues] == [["warning", "truncated", 1]]
    summary = (b"| tuning_space | num_experiments | best_metric_val | best_exp_name |\n|:--|--:|--:|:--|\n"
               b"| z1 | 6 | 268.708 | z1_gas2 |\n| z2 | 2 | 312.1")
    facts, problems = autotune_results.parse_summary_text(summary.decode())
    assert [space["tuning_space"] for space in facts["spaces"]] == ["z1"] and len(problems) == 1
