"""DeepSpeed comms-logger dumps -> `comms_calls` and `comms_summary`.

Inputs (written by the user's script from `deepspeed.comm`):
* `comms_dict_raw_rank<N>.json`: `CommsLogger.comms_dict` as JSON,
  `{record_name: {msg_size: [count, [latency_ms...], [algbw...], [busbw...]]}}`
  (deepspeed/utils/comms_logging.py `CommsLogger.append`). record_name is the op's log_name, or
  `"<op> | [Caller Func: <fn>]"` with `debug: true`.
* `log_summary_dict_rank<N>.json`: `log_summary(return_dict=True)`,
  `{"summary": {record_name: {msg_size: {count, total_latency_ms, avg_latency_ms, tput_avg_gbps,
  busbw_avg_gbps, ...}}}, "straggler_analysis": ..., "metadata": {world_size, rank, timestamp}}`.

Cumulative latencies (DeepSpeed >= 0.18.3): `timed_op` reads `timers(log_name).elapsed(reset=False)`
and the timer is never cleared (PR #7714), so every logged latency is the running total over all
earlier calls with that record name, across message sizes. Running totals only grow, so sorting all
entries of one record name by value recovers their call order, and the per-call latency is the
difference of consecutive totals (the first call's is the first total). The dict keeps no order
across record names, so `call_index` orders calls within a record name only (record names in the
order the dict lists them, i.e. the order of their first call).

Bandwidth is recomputed with the nccl-tests formulas (`contract.bus_bandwidth.busbw_factor`), GB/s, because
DeepSpeed's `calc_bw_log` reports Gbps, doubles all_reduce algbw, multiplies reduce_scatter's full
input by n again, and used the running totals.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path


from steplens.analyze.contract import schema
from steplens.analyze.contract.bus_bandwidth import with_bandwidth
from steplens.analyze.contract.manifest import MAX_COUNT
from steplens.analyze.importers.base import Imported, conform
from steplens.analyze.importers.bounded import TooLarge, load_json
from steplens.analyze.contract.traces import preview

RAW_NAME = re.compile(r"comms_dict_raw_rank(\d+)\.json$")
SUMMARY_NAME = re.compile(r"log_summary(?:_dict)?_rank(\d+)\.json$")  # either name is in use
CALLER = re.compile(r"^(?P<op>.*?) \| \[Caller Func: (?P<caller>.*)\]$")  # comms_logging.py get_caller_func
# A record name needs this many calls before its monotone latencies count as evidence of running
# totals: real per-call latencies fluctuate, so 3+ in non-decreasing order by chance is unlikely
# for every record name at once.
MIN_CALLS_FOR_EVIDENCE = 3
# deepspeed/utils/comms_logging.py convert_size: 1024-based units, value rounded to 2 decimals.
SIZE_UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40, "PB": 1 << 50}
SIZE_TEXT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]?B)\s*$")
SIZE_KEY = re.compile(r"[0-9]+")  # a msg_size dict key: the int DeepSpeed logged, as JSON writes keys
# Largest message size kept: nccl_bytes = size x group size (up to schema.MAX_RANK) must still fit an int64.
MAX_MSG_BYTES = (2**63 - 1) // schema.MAX_RANK
MAX_LATENCY_MS = 1e12  # ~30 years: any logged latency beyond it is damage, and stays well inside int64 ns
METADATA_BOUNDS = {"rank": (0, schema.MAX_RANK - 1), "world_size": (1, schema.MAX_RANK)}


def split_record_name(record: str) -> tuple[str, str | None]:
    """'all_reduce | [Caller Func: allreduce_bucket]' -> ('all_reduce', 'allreduce_bucket')."""
    match = CALLER.match(record)
    return (match["op"], match["caller"]) if match else (record, None)


def size_from_text(text: str) -> int | None:
    """DeepSpeed's convert_size text ('3.56 MB', '0B') back to bytes (rounded as printed)."""
    match = SIZE_TEXT.match(text)
    if not match or match[2] not in SIZE_UNITS:
        return None
    size = float(match[1]) * SIZE_UNITS[match[2]]
    return round(size) if size <= MAX_MSG_BYTES else None


def _msg_bytes(size) -> int | None:
    """A message size as DeepSpeed logs it (an int, or its text as a dict key) in bytes; None when it is
    not a size a row can hold."""
    if isinstance(size, str) and len(size) <= 20 and SIZE_KEY.fullmatch(size):  # longer: past int64, and int() refuses 4300 digits
        size = int(size)
    return size if type(size) is int and 0 <= size <= MAX_MSG_BYTES else None


def _latencies_ms(entry) -> list[float] | None:
    """The logged latencies of one [count, [latency_ms, ...], ...] entry; None unless each is a finite
    number of ms that int64 nanoseconds hold."""
    if not (isinstance(entry, list) and len(entry) > 1 and isinstance(entry[1], list)):
        return None
    values = entry[1]
    if not all(type(x) in (int, float) and -MAX_LATENCY_MS <= x <= MAX_LATENCY_MS for x in values):  # NaN fails too
        return None
    return [float(x) for x in values]


def _count(value) -> int:
    """A JSON count; ValueError for anything else (text, true, 2.5, negative or past 2**53)."""
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        raise ValueError(value)
    return value


def _number(value) -> float:
    """A JSON number as a float; TypeError for text, true/false or null, OverflowError beyond float64."""
    if type(value) not in (int, float):
        raise TypeError(value)
    return float(value)


def is_running_total(series: list[list[float]]) -> bool | None:
    """True when every series (latencies of one record name, in call order) is non-decreasing and at
    least one is long enough to tell; False when one decreases; None when nothing can tell."""
    long_enough = False
    for values in series:
        if any(b < a for a, b in itertools.pairwise(values)):
            return False
        long_enough |= len(values) >= MIN_CALLS_FOR_EVIDENCE
    return True if long_enough else None


def per_call(running_totals: list[float]) -> list[float]:
    """Per-call latencies from running totals in call order."""
    return [b - a for a, b in zip([0.0, *running_totals], running_totals)]


def rank_from_name(path: Path) -> int | None:
    match = RAW_NAME.search(path.name) or SUMMARY_NAME.search(path.name)
    return int(match[1]) if match and int(match[1]) < schema.MAX_RANK else None


def _load(path: Path, issues: list) -> dict | None:
    try:
        doc = load_json(path)
    except TooLarge as e:
        issues.append(["error", "oversized_file", 1, f"{path.name}: {e}"])
        return None
    except (OSError, ValueError, RecursionError) as e:
        issues.append(["error", "bad_json", 1, f"{path.name}: not readable JSON ({type(e).__name__}: {e}); nothing read"])
        return None
    if not isinstance(doc, dict):
        issues.append(["error", "unexpected_layout", 1, f"{path.name}: top level is not an object; nothing read"])
        return None
    return doc


def _metadata(doc: dict | None, source: str, issues: list) -> dict:
    """log_summary's metadata {rank, world_size}, each kept only when it is a rank / group size."""
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    checked = {}
    for key, (lowest, highest) in METADATA_BOUNDS.items():
        value = meta.get(key) if isinstance(meta, dict) else None
        if type(value) is int and lowest <= value <= highest:
            checked[key] = value
        elif value is not None:
            issues.append(["warning", "bad_metadata", 1, f"{source}: metadata {key} = {preview(value)} is out of range "
                                                          "or not a whole number; left out"])
    return checked


def summary_rows(doc: dict, rank: int | None, source: str, trusted: bool | None, issues: list) -> list[dict]:
    """log_summary(return_dict=True)['summary'] -> comms_summary rows."""
    summary = doc.get("summary")
    if not isinstance(summary, dict):
        issues.append(["error", "unexpected_layout", 1, f"{source}: no 'summary' object; no summary rows"])
        return []
    rows, bad = [], 0
    for record, sizes in summary.items():
        op, caller = split_record_name(record)
        for size, stats in (sizes.items() if isinstance(sizes, dict) else []):
            try:
                msg_bytes = _msg_bytes(stats.get("msg_size_bytes", size))
                if msg_bytes is None:
                    raise ValueError(size)
                rows.append({
                    "rank": rank, "source": source, "op": op, "caller": caller, "msg_bytes": msg_bytes,
                    "count": _count(stats["count"]), "total_latency_ms": _number(stats["total_latency_ms"]),
                    "avg_latency_ms": _number(stats["avg_latency_ms"]),
                    "busbw_gbps": _number(stats["busbw_avg_gbps"]), "trusted": trusted,
                })
            except (AttributeError, KeyError, TypeError, ValueError, OverflowError):
                bad += 1
    if bad:
        issues.append(["warning", "bad_entry", bad, f"{source}: {bad} summary entries without a size, count and "
                                                      "latencies a row holds; skipped"])
    return rows


def parse_raw(path: Path, rel: str) -> Imported:
    """comms_dict_raw_rank<N>.json (+ its log_summary_dict_rank<N>.json) -> comms_calls, comms_summary."""
    issues: list = []
    rank = rank_from_name(path)
    raw = _load(path, issues)
    summary_path = path.with_name(f"log_summary_dict_rank{rank}.json")
    summary_rel = str(Path(rel).with_name(summary_path.name))
    summary = _load(summary_path, issues) if summary_path.is_file() else None
    meta = _metadata(summary, summary_rel, issues)
    world_size = meta.get("world_size")
    if raw is None:
        return Imported(issues=issues)

    entries: dict[str, list[tuple[int, float]]] = {}  # record name -> (msg_size, logged latency ms)
    damaged_records, bad = set(), 0
    for record, sizes in raw.items():
        # A record that is not {size: entry} counts as one bad entry.
        for size, entry in (sizes.items() if isinstance(sizes, dict) else [("", None)]):
            msg_bytes, latencies = _msg_bytes(size), _latencies_ms(entry)
            if msg_bytes is None or latencies is None:
                bad += 1
                damaged_records.add(record)
                continue
            entries.setdefault(record, []).extend((msg_bytes, lat) for lat in latencies)

    per_size_series = [[lat for s, lat in calls if s == size] for calls in entries.values() for size in {s for s, _ in calls}]
    cumulative = is_running_total(per_size_series)
    rows, untold = [], 0
    for record, calls in entries.items():
        op, caller = split_record_name(record)
        if cumulative:
            calls = sorted(calls, key=lambda c: c[1])  # running totals grow: value order is call order
            if record in damaged_records:  # a lost running total folds its calls into the next difference
                latencies = [None] * len(calls)
                untold += len(calls)
            else:
                latencies = per_call([lat for _, lat in calls])
        else:
            latencies = [lat for _, lat in calls]
        for (size, _), latency in zip(calls, latencies):
            rows.append({
                "rank": rank, "source": rel, "call_index": len(rows), "op": op, "caller": caller, "msg_bytes": size,
                "group_size": world_size, "latency_ns": None if latency is None else round(latency * 1e6),
                "latency_origin": "repaired_cumulative" if cumulative else "as_logged", "synchronized": True,
            })
    if bad:
        untold_detail = (f"; the other {untold} calls of their record names have no latency (their running totals "
                         "miss the skipped calls' time)") if untold else ""
        issues.append(["warning", "bad_entry", bad, (f"{bad} record/size entries not a size with [count, [latencies "
                                                     f"in ms], ...]; skipped{untold_detail}")])
    report_cumulative(cumulative, "", len(rows), issues)
    if world_size is None and rows:
        issues.append(["warning", "no_world_size", len(rows),
                       f"world size unknown (no log_summary_dict_rank{rank}.json metadata); no nccl_bytes/bandwidth"])
    tables = {"comms_calls": with_bandwidth(conform(rows, "comms_calls", issues))} if rows else {}
    if summary is not None:
        srows = summary_rows(summary, meta.get("rank", rank), summary_rel, None if cumulative is None else not cumulative, issues)
        if srows:
            tables["comms_summary"] = conform(srows, "comms_summary", issues)
    facts = {"world_size": world_size} if world_size else {}
    return Imported(tables=tables, issues=issues, facts=facts)


def report_cumulative(cumulative: bool | None, where: str, calls: int, issues: list) -> None:
    if cumulative:
        issues.append(["warning", "cumulative_comms_latency", calls,
                       (f"{where}comms-logger latencies are running totals per record name (DeepSpeed >= 0.18.3); "
                       "per-call latency = difference of consecutive totals, bandwidth recomputed (nccl-tests)")])
    elif cumulative is None and calls:
        issues.append(["info", "comms_latency_kind_unknown", calls,
                       f"{where}too few calls per op to tell per-call from cumulative latencies; kept as logged"])


def parse_summary(path: Path, rel: str) -> Imported:
    """A log_summary_dict_rank<N>.json without its raw dict: comms_summary only, trust unknown."""
    issues: list = []
    doc = _load(path, issues)
    if doc is None:
        return Imported(issues=issues)
    meta = _metadata(doc, rel, issues)
    rows = summary_rows(doc, meta.get("rank", rank_from_name(path)), rel, None, issues)
    if rows:
        issues.append(["info", "comms_summary_trust_unknown", len(rows),
                       ("without the raw dict or verbose lines it cannot be told whether latencies are running totals "
                       "(DeepSpeed >= 0.18.3); trusted left null")])
    world_size = meta.get("world_size")
    return Imported(tables={"comms_summary": conform(rows, "comms_summary", issues)} if rows else {}, issues=issues,
                    facts={"world_size": world_size} if world_size else {})


def summary_sibling(path: Path) -> list[Path]:
    """The log_summary_dict written with a raw dict (read with it, for world size and the summary)."""
    return [path.with_name(f"log_summary_dict_rank{rank_from_name(path)}.json")]


# Claimed by name whatever they hold: a damaged dump (`[]`, cut, empty) is named as one, not taken for an
# empty trace or left unread (which made its folder a logs-only one, set apart from the job's rank logs).
def claims_raw(path: Path) -> bool:
    return bool(RAW_NAME.search(path.name))


def claims_summary(path: Path) -> bool:
    """A summary dict on its own; next to its raw dict it is that dict's companion."""
    match = SUMMARY_NAME.search(path.name)
    if not match:
        return False
    companion = path.with_name(f"log_summary_dict_rank{match[1]}.json")
    return not (path == companion and path.with_name(f"comms_dict_raw_rank{match[1]}.json").is_file())
