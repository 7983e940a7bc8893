"""Where one trace's ingest time goes, stage by stage, against the decode-only limit.

    .venv/bin/python tests/benchmarks/stage_split.py [--runs 3] TRACE...

Per file, in this process (imports done before any timing), median of --runs:
  gunzip       : the decompressed stream alone (json_events.ByteStream, as ingest reads it)
  limit        : the decode-only limit: gunzip + msgspec scanning traceEvents into msgspec.Raw
                 (every event validated as JSON, nothing built): no msgspec-based reader is faster
  read_decode  : gunzip + decoding the events into steplens's structs, chunk by chunk
  columns      : structs -> typed columns         (ingest.read_trace's stage_seconds)
  normalise    : exact ns times, kinds, checks
  semantics    : steps, step of each event, launch and flow links
  parquet      : writing the three tables as ingest writes them
  cpu          : the CPU seconds of the parse and write, all threads together (the stream is read ahead on a
                 thread of its own and polars uses its threads, so the stages above are wall times that overlap)
Prints one JSON line per file: {"file", "mb", "events", "<stage>_s": ..., "limit_s", "cpu_s"}.
One untimed parse of the first file comes first: what a process pays once (pyarrow importing pandas,
polars and msgspec warming up) is start-up, which the end-to-end figures of bench_ingest.py count.
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from steplens.analyze.importers import kineto
from steplens.analyze.importers.json_events import ByteStream
from steplens.analyze.pipeline import ingest


class _EventsOnly(msgspec.Struct):
    traceEvents: list[msgspec.Raw] = []


def _gunzip(path: Path) -> tuple[float, bytes]:
    started = time.perf_counter()
    data = b"".join(ByteStream(path).blocks())
    return time.perf_counter() - started, data


def _limit(path: Path) -> float:
    started = time.perf_counter()
    data = b"".join(ByteStream(path).blocks())
    if data.lstrip()[:1] == b"[":  # the 2020 format: a bare array of events
        msgspec.json.decode(data, type=list[msgspec.Raw])
    else:
        msgspec.json.decode(data, type=_EventsOnly)
    return time.perf_counter() - started


def _parse_and_write(path: Path) -> tuple[dict, int, int]:
    parsed = ingest.read_trace(path, path.name)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="steplens-stage-split-") as tmp:
        for table, frame in (("trace_events", parsed.events), ("flows", parsed.flows), ("steps", parsed.steps)):
            ingest._write_table(frame, table, Path(tmp) / f"{table}.parquet")
    return {**parsed.stage_seconds, "parquet": time.perf_counter() - started}, parsed.raw_bytes, parsed.events.height


def split(path: Path, runs: int) -> dict:
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        gunzip_s, data = _gunzip(path)
        del data
        cpu_started = time.process_time()
        stages, raw_bytes, events = _parse_and_write(path)
        cpu_s = time.process_time() - cpu_started  # every thread's: the read-ahead's gunzip and polars' included
        for name, seconds in {"gunzip": gunzip_s, "limit": _limit(path), **stages, "cpu": cpu_s}.items():
            samples.setdefault(name, []).append(seconds)
    result = {"file": path.name, "mb": round(raw_bytes / 1e6, 2), "events": events}
    result.update({f"{name}_s": round(statistics.median(values), 4) for name, values in samples.items()})
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("traces", nargs="+", type=Path)
    args = ap.parse_args()
    _parse_and_write(args.traces[0])
    for path in args.traces:
        print(json.dumps(split(path, args.runs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
