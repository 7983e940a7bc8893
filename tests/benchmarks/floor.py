"""The fastest `analyze RUN_DIR` could be on a set of traces, whatever its parser did: what is left when
column building, normalisation, linking and the analyses cost nothing.

    .venv/bin/python tests/benchmarks/floor.py --jobs 2 [--runs 3] TRACE_DIR OUT_DIR

OUT_DIR is a finished `analyze TRACE_DIR --out OUT_DIR`. Seconds, medians of --runs:
  imports     : a cold interpreter importing what every analyze process must (polars, pyarrow's
                Parquet writer, numpy, msgspec), timed from outside as a process
  decode      : the decode-only limit (gunzip + msgspec scanning traceEvents into msgspec.Raw: every
                event validated, nothing built) of every file, summed and spread over --jobs cores
                with perfect balance (and never less than the largest file's own time)
  parquet     : writing OUT_DIR's ingest tables (trace_events, flows, steps) as ingest writes them,
                spread over --jobs cores the same way
  report      : report.html + summary.md drawn from OUT_DIR as analyze draws them, in one process
                (matplotlib's import included; analyze itself imports it on an idle core when it has
                one and draws the figures on its workers), timed in a fresh process after its imports
Prints one JSON line: {"<part>_s": ..., "floor_s": the sum}. The end-to-end ratio no parser can beat
on this machine is HTA's seconds over floor_s.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from stage_split import _limit  # noqa: E402 - the same decode-only limit stage_split prints per file

IMPORTS = "import polars, pyarrow, pyarrow.parquet, numpy, msgspec"
REPORT = """
import sys, time
from pathlib import Path
from steplens.analyze.cli_render import skip_matplotlib_set_docs
from steplens.reports import html, markdown
started = time.perf_counter()
skip_matplotlib_set_docs()  # as analyze's own processes import matplotlib
html.write(Path(sys.argv[1]))
markdown.write(Path(sys.argv[1]))
print(time.perf_counter() - started)
"""
INGEST_TABLES = ("trace_events", "flows", "steps")
TRACE_SUFFIXES = (".json", ".json.gz")


def spread(seconds: list[float], jobs: int) -> float:
    """Wall time of `seconds` of independent work on `jobs` cores, perfectly balanced."""
    return max(sum(seconds) / max(1, min(jobs, len(seconds))), max(seconds, default=0.0))


def imports_s() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORTS], check=True)
    return time.perf_counter() - started


def parquet_s(out_dir: Path, jobs: int) -> float:
    import polars as pl

    from steplens.analyze.pipeline import ingest

    seconds = []
    with tempfile.TemporaryDirectory(prefix="steplens-floor-") as tmp:
        for table in INGEST_TABLES:
            for part in sorted((out_dir / table).glob("rank=*/*.parquet")):
                frame = pl.read_parquet(part)
                started = time.perf_counter()
                ingest._write_table(frame, table, Path(tmp) / f"{table}.parquet")
                seconds.append(time.perf_counter() - started)
    return spread(seconds, jobs)


def report_s(out_dir: Path) -> float:
    with tempfile.TemporaryDirectory(prefix="steplens-floor-report-") as tmp:
        copy = Path(tmp) / "out"
        subprocess.run(["cp", "-r", str(out_dir), str(copy)], check=True)  # the report is written beside its tables
        done = subprocess.run([sys.executable, "-c", REPORT, str(copy)], check=True, capture_output=True, text=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args()
    traces = sorted(p for p in args.trace_dir.iterdir() if p.name.endswith(TRACE_SUFFIXES))
    samples: dict[str, list[float]] = {}
    for _ in range(args.runs):
        parts = {"imports": imports_s(), "decode": spread([_limit(p) for p in traces], args.jobs),
                 "parquet": parquet_s(args.out_dir, args.jobs), "report": report_s(args.out_dir)}
        for name, seconds in parts.items():
            samples.setdefault(name, []).append(seconds)
    result = {f"{name}_s": round(statistics.median(values), 3) for name, values in samples.items()}
    result["floor_s"] = round(sum(result.values()), 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
