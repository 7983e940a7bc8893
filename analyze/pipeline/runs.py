"""Tell the runs in a folder apart, so that `analyze runs/` never merges several jobs into one.

One run holds at most one input of each kind: one collector folder, one csv_monitor, one set of
traces with one trace per rank, ... So when two sub-folders of a folder each hold an input of the
same kind (for per-rank inputs: a rank both hold, or files whose names give no rank), the
sub-folders are separate runs, and each is looked at the same way in turn. Sub-folders with inputs
of different kinds (`collector/`, `traces/`, `rank_logs/` of one job) stay one run. Logs and
FLOPs text are scattered over a job's folders, so they set runs apart only where every sub-folder
holds nothing else (logs-only runs side by side): a job's `rank_logs/` and the `comms/` holding its
log_summary text are one job's, beside its `csv_monitor/`.

A DeepSpeed log that holds several jobs appended to one file (the launcher's stdout redirected with >>)
is several runs too: `split_appended_logs` makes one run of each job in it, read alone.
"""

from __future__ import annotations

import functools
import os
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

from steplens.analyze import importers
from steplens.analyze.contract import layout
from steplens.analyze.importers import autotune_results
from steplens.analyze.importers.base import Importer, peek
from steplens.analyze.contract.schema import rank_in_name
from steplens.analyze.pipeline.ingest import Discovered
from steplens.analyze.importers.json_events import sniff

MAX_DEPTH = 6  # runs/sweep/config/trial/... deeper than this are analysed where they stand


@dataclass
class RunFolder:
    path: Path
    found: Discovered  # the files that belong to this run (its own, not its sibling runs')
    name: str | None = None  # how to call it when it is not its folder (a single trace file)
    log_run: int | None = None  # which of the jobs appended to its one log file (split_appended_logs)


SNIFF_BYTES = 64 << 10


def _looks_like_trace(path: Path) -> bool:
    """A .json/.gz candidate whose first bytes are a trace's (a ds_config.json beside traces is not)."""
    head = peek(path, SNIFF_BYTES) if path.is_file() else b""
    if head[:2] == b"\x1f\x8b":
        try:
            head = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, SNIFF_BYTES)
        except zlib.error:
            return False
    return sniff(head)


def _inputs(found: Discovered) -> list[tuple[Path, str]]:
    return [(p, importers.trace_claimant(p).name) for p in found.traces if _looks_like_trace(p)] + [
        (p, importer.name) for p, importer, _ in found.native]


# Inputs a job writes once per rank: two folders holding the same rank of one are two runs.
PER_RANK_KINDS = importers.TRACE_KINDS | {"deepspeed_comms_dict", "deepspeed_comms_summary_dict"}
# Inputs a job scatters (launcher log, per-rank logs, a log_summary beside the comms dumps, FLOPs
# text): they tell runs apart only between folders that hold nothing else.
SCATTERED_KINDS = {"deepspeed_log", "deepspeed_flops_profile"}


# Inputs a run holds many of, laid out under one folder of the job's: the collector's parts and manifests and an
# autotuning run's experiments and summary, each kind's folder as its layout states it. Two sub-folders holding them
# are one run when they hold those of one such folder.
UNIT_OF = {"collector": layout.run_folder_of, "autotune_experiment": autotune_results.tuning_folder,
           "autotune_summary": autotune_results.tuning_folder}


def _ranks(paths: list[Path]) -> list[int | None]:
    return [rank_in_name(p.name) for p in paths]


def _copies(a: Path, b: Path) -> bool:
    """The same file (a link) or a byte copy of it (same size and first 64 KiB)."""
    try:
        return os.path.samefile(a, b) or (a.stat().st_size == b.stat().st_size and peek(a, SNIFF_BYTES) == peek(b, SNIFF_BYTES))
    except OSError:
        return False


def _backup(a: list[Path], b: list[Path]) -> bool:
    """One folder's traces are copies of some of the other's, fewer than it holds: a backup of a rank's trace kept
    beside the job is that job's (ingest names the copy, duplicate_rank), where two folders holding copies of the
    same traces are a run copied whole, two runs."""
    fewer, more = (a, b) if len(a) < len(b) else (b, a)
    return len(fewer) < len(more) and all(
        any(rank_in_name(x.name) == rank_in_name(y.name) and _copies(x, y) for y in more) for x in fewer)


def _overlap(a: list[Path], b: list[Path]) -> bool:
    ranks_a, ranks_b = _ranks(a), _ranks(b)
    return None in ranks_a or None in ranks_b or bool(set(ranks_a) & set(ranks_b))


def _clash(a: dict[str, list[Path]], b: dict[str, list[Path]], logs_only: bool) -> bool:
    """Two sub-folders' inputs that cannot be one run's; logs_only: every sub-folder holds only scattered kinds."""
    for kind in a.keys() & b.keys():
        if kind in SCATTERED_KINDS:
            if logs_only and _overlap(a[kind], b[kind]):
                return True
        elif kind in UNIT_OF:
            if {UNIT_OF[kind](p) for p in a[kind]} != {UNIT_OF[kind](p) for p in b[kind]}:
                return True
        elif kind not in PER_RANK_KINDS or (_overlap(a[kind], b[kind])
                                            and not (kind in importers.TRACE_KINDS and _backup(a[kind], b[kind]))):
            return True
    return False


def subset(found: Discovered, keep, origin: str | None = None) -> Discovered:
    """The files `keep` accepts; a run in object storage keeps its streamed traces, and is at `origin`
    (its URL; default: the URL of what it was taken from)."""
    return Discovered(traces=[p for p in found.traces if keep(p)],
                      native=[entry for entry in found.native if keep(entry[0])],
                      unknown=[p for p in found.unknown if keep(p)],
                      special=[entry for entry in found.special if keep(entry[0])],
                      origin=origin or found.origin,
                      remote={p: file for p, file in found.remote.items() if keep(p)})


def split_runs(root: Path, found: Discovered, depth: int = 0) -> list[RunFolder]:
    """The runs under root, each with its files; one entry (root itself) when it is one run."""
    root = Path(root)
    by_child: dict[str, dict[str, list[Path]]] = {}
    for path, kind in _inputs(found):
        parts = path.relative_to(root).parts
        if len(parts) > 1:
            by_child.setdefault(parts[0], {}).setdefault(kind, []).append(path)
    children = sorted(by_child)
    logs_only = all(set(kinds) <= SCATTERED_KINDS for kinds in by_child.values())
    separate = depth < MAX_DEPTH and any(
        _clash(by_child[a], by_child[b], logs_only) for i, a in enumerate(children) for b in children[i + 1:])
    if not separate:
        return [RunFolder(root, found)]
    runs = []
    own = subset(found, lambda p: len(p.relative_to(root).parts) == 1)
    if own.traces or own.native:
        runs.append(RunFolder(root, own))
    for child in children:
        inside = subset(found, lambda p, child=child: p.relative_to(root).parts[0] == child,
                        origin=f"{found.origin}/{child}" if found.origin else None)
        runs.extend(split_runs(root / child, inside, depth + 1))
    return runs


def split_appended_logs(runs: list[RunFolder]) -> list[RunFolder]:
    """Each run whose one input is a DeepSpeed log holding several jobs becomes one run per job, each read
    alone (its own facts, steps and status) and named by the file and its lines. Runs sharing a folder need
    outputs of their own: callers place run k's output apart (RunFolder.log_run)."""
    split = []
    for run in runs:
        native = run.found.native
        if run.found.traces or len(native) != 1 or native[0][1].name != "deepspeed_log":
            split.append(run)
            continue
        path, importer, companions = native[0]
        from steplens.analyze.importers import deepspeed_log  # a log's regexes: imported when a run holds one

        spans = deepspeed_log.run_spans(path)
        if len(spans) < 2:
            split.append(run)
            continue
        rel = os.path.relpath(path, run.path)
        for index, (first, last) in enumerate(spans):
            one = Importer(importer.name, importer.claims, functools.partial(importer.parse, run_index=index),
                           importer.companions)
            found = replace(run.found, traces=[], native=[(path, one, companions)])
            split.append(RunFolder(run.path, found, name=f"{rel} run {index + 1} of {len(spans)} (lines {first}-{last})",
                                   log_run=index))
    return split
