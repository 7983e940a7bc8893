"""Start-up: how long `analyze RUN_DIR` takes from its process's start to its first parse (the imports and the
discovery a run needs before its first byte is parsed), against HTA's `from hta.trace_analysis import TraceAnalysis`
as a whole process, from cold starts, interleaved.

    .venv/bin/python tests/benchmarks/startup.py RUN_DIR [--runs 5] [--hta-python PATH]

Prints one JSON line: {"analyze_s": [...], "hta_import_s": [...]}. `analyze` is run as its console script runs it
(cli_rerun.analyze_entry, in a fresh interpreter); the moment the parse starts (pipeline/ingest.py `_parse_all`
called) the process prints the clock and exits. Standard library only in this process.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time

# Run in the child: wrap ingest._parse_all when the module is first imported, without importing it sooner than
# `analyze` does (a finder that steps aside after wrapping it), then run the script's entry point.
FIRST_PARSE = """
import importlib.util, os, sys, time

class WrapIngest:
    def find_spec(self, name, path=None, target=None):
        if name != "steplens.analyze.pipeline.ingest":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)

            def first_parse(*args, **kwargs):
                print(time.time(), flush=True)
                os._exit(0)

            module._parse_all = first_parse

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, WrapIngest())
sys.argv = ["analyze", *sys.argv[1:]]
from steplens.analyze.cli_rerun import analyze_entry
analyze_entry()
"""


def analyze_seconds(run_dir: str) -> float:
    with tempfile.TemporaryDirectory(prefix="steplens-bench-out-") as tmp:
        started = time.time()
        done = subprocess.run([sys.executable, "-c", FIRST_PARSE, run_dir, "--out", f"{tmp}/out", "-q"],
                              capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1]) - started


def hta_import_seconds(hta_python: str) -> float:
    started = time.perf_counter()
    subprocess.run([hta_python, "-c", "from hta.trace_analysis import TraceAnalysis"], check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--hta-python", default=None, help="the HTA venv's python (tests/benchmarks/hta_env.sh)")
    args = ap.parse_args()
    result = {"analyze_s": [], "hta_import_s": []}
    for _ in range(args.runs):
        result["analyze_s"].append(round(analyze_seconds(args.run_dir), 3))
        if args.hta_python:
            result["hta_import_s"].append(round(hta_import_seconds(args.hta_python), 3))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
