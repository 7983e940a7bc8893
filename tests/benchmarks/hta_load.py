"""Load all rank traces in TRACE_DIR with Holistic Trace Analysis (HTA) and run its core analyses,
the way a user would.

Run with the HTA venv's python (tests/benchmarks/hta_env.sh prints its path):
    $HTA_PY tests/benchmarks/hta_load.py TRACE_DIR [--json]

Timed: `TraceAnalysis(trace_dir=TRACE_DIR)` with HTA's defaults, which (HTA 0.5.0) means:
  - files: every *.json / *.gz in TRACE_DIR; the rank is the first `"rank": N` (regex
    `"rank":\\s+(\\d+)`, so at least one space is needed) found line by line; a file without a
    match is taken as rank 0, and a later file with an already-seen rank replaces the earlier one
    (only a warning is logged), so files can be silently dropped;
  - parser: ParserBackend.JSON, i.e. stdlib json.loads of the whole (gunzipped) file, then
    pd.DataFrame(traceEvents); events without `dur` or `cat` and cat == "Trace" are dropped;
  - ranks in parallel: multiprocessing fork Pool of min(os.cpu_count(), n_ranks) processes
    (for > 8 ranks it first parses rank 0 once more under tracemalloc to size the pool).
    TraceAnalysis has no knob for this; Trace.load_traces(use_multiprocessing=False) is the only one.
Then timed too, with visualize=False (what steplens's report covers): get_temporal_breakdown,
get_cuda_kernel_launch_stats, get_comm_comp_overlap, get_idle_time_breakdown. One that raises (a trace
without kernels, say) is named in `failed_analyses` and its time still counts.
Output: {"tool","version","seconds","load_seconds","analyses_seconds","events","ranks", ...};
seconds = load + analyses; events = rows in the loaded dataframes summed over ranks (after HTA's
filtering, i.e. fewer than traceEvents in the files).
"""
import argparse
import gzip
import json
import os
import sys
import time
from importlib.metadata import version


def json_bytes(path: str) -> int:
    """Uncompressed size of a trace file (streams .gz, so memory stays small)."""
    if not path.endswith(".gz"):
        return os.path.getsize(path)
    n = 0
    with gzip.open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            n += len(chunk)
    return n


CORE_ANALYSES = ("get_temporal_breakdown", "get_cuda_kernel_launch_stats", "get_comm_comp_overlap",
                 "get_idle_time_breakdown")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()

    from hta.trace_analysis import TraceAnalysis  # imported outside the timed section

    t0 = time.perf_counter()
    analysis = TraceAnalysis(trace_dir=args.trace_dir)
    load_seconds = time.perf_counter() - t0
    failed = {}
    for name in CORE_ANALYSES:
        try:
            getattr(analysis, name)(visualize=False)
        except Exception as e:  # noqa: BLE001 - reported, and the time it took still counts
            failed[name] = f"{type(e).__name__}: {str(e)[:200]}"
    seconds = time.perf_counter() - t0

    trace = analysis.t
    used = sorted(trace.trace_files.values())
    candidates = sorted(
        os.path.join(trace.trace_path, f)
        for f in os.listdir(trace.trace_path)
        if f.endswith((".gz", ".json"))
    )
    events = sum(len(df) for df in trace.get_all_traces().values())
    nbytes = sum(json_bytes(p) for p in used)
    result = {
        "tool": "hta",
        "version": version("HolisticTraceAnalysis"),
        "seconds": round(seconds, 3),
        "load_seconds": round(load_seconds, 3),
        "analyses_seconds": round(seconds - load_seconds, 3),
        "failed_analyses": failed,
        "events": events,
        "ranks": len(trace.get_all_traces()),
        "json_bytes": nbytes,
        "json_mb_per_s": round(nbytes / 1e6 / seconds, 2),
        "events_per_s": round(events / seconds),
        "skipped_files": [os.path.basename(p) for p in candidates if p not in used],
    }
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(", ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
