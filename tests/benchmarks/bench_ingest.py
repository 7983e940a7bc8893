"""Ingest benchmark: steplens `analyze` vs Holistic Trace Analysis (HTA) loading the same traces.

    .venv/bin/python tests/benchmarks/bench_ingest.py [--quick] [--runs 3] [--cache DIR] [--jobs N] [--sets a,b]

Input sets (each a folder of symlinks to the trace files only, under --cache):
  synthetic-8r : 8 ranks, >= 50 MB raw JSON per rank, gzipped, made once by tests/synthetic.py
  real-8r      : 8 copies of the real A100 trace trace_diff/control.json.gz (35 MB raw), its
                 distributedInfo rank relabelled 0..7 (both tools take the rank from there)
  trace_diff   : /work/shared/corpus/HolisticTraceAnalysis/trace_diff (2 ranks, ~33 MB raw each)
  dlrm-8r      : /work/shared/corpus/param/dlrm_kineto (8 real ranks, ~1 MB raw each: start-up dominates)
  mtia_single  : .../mtia_trace_single_rank (1 rank, 87 MB raw: the heaviest trace of the corpus)
  dlrm-32r     : 4 copies of each dlrm_kineto rank, distributedInfo relabelled to ranks 0..31 of 32
                 (many small real ranks: each file's fixed cost dominates)
  small_single : .../ns_resolution_trace (1 real V100 rank, 15 MB raw: one small trace, where start-up,
                 the report's figures and the imports' memory dominate)
  dlrm-1r      : the first dlrm_kineto rank alone (one real 1 MB trace: start-up and the report are nearly all)
  with_stack   : the 2 rank traces of a real CPU DeepSpeed job (tests/realrun, ZeRO-2, gloo) profiled for 30 steps
                 with Python stacks (with_stack), about 100-150 MB raw a rank, mostly python_function events;
                 made once under --cache (needs the [collect] extra: torch and deepspeed), skipped without it
--quick: 4 ranks x 10 MB generated, trace_diff only, 1 run (smoke test).
Each set, end to end, whole processes from a cold start (interpreter start-up and imports count):
steplens `analyze RUN_DIR` (ingest + analyses + report) against HTA `TraceAnalysis(trace_dir=...)` +
its four core analyses (tests/benchmarks/hta_load.py), alternating (steplens, hta, steplens, ...)
--runs times; medians, with min-max. Peak RSS = summed RSS of the process tree
(tests/benchmarks/peak_rss.py); steplens's sources are byte-compiled first, as pip compiled HTA's.
Then, per set, where steplens's time goes: seconds per stage of one
file (tests/benchmarks/stage_split.py: gunzip, JSON decode, column building, normalisation,
step/launch linking, Parquet write), MB/s, and the ratio to the decode-only limit (gunzip + msgspec
scanning the same bytes), and the floor of this design: imports, the decode-only limit over --jobs cores,
the Parquet write and the report, with HTA's seconds over it (tests/benchmarks/floor.py). Before those, per set,
start-up: `analyze`'s process start to its first parse against HTA's import, interleaved
(tests/benchmarks/startup.py). Then the
analyses' share of ingest time, an unchanged re-run against a
fresh one, and steplens alone on 1, 2, 4, 8 rank subsets of the generated set: peak RSS should stay
flat (<= --jobs files in flight).
Standard library + psutil only in this process. Nothing is written outside --cache and tempfile's
directory.
"""
import argparse
import gzip
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
from peak_rss import measure  # noqa: E402

CORPUS = Path("/work/shared/corpus/HolisticTraceAnalysis")
DLRM = Path("/work/shared/corpus/param/dlrm_kineto")  # a real 8-rank set (V100), about 1 MB a rank
ANALYZE = Path(sys.executable).parent / "analyze"
TRACE_SUFFIXES = (".json", ".json.gz")


def trace_files(d: Path) -> list:
    return sorted(p for p in d.iterdir() if p.name.endswith(TRACE_SUFFIXES) and p.name != "truth.json")


def link_set(dest: Path, files) -> Path:
    """dest/ = fresh folder of symlinks to `files` (keeps truth.json etc. away from both tools)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in files:
        (dest / f.name).symlink_to(f.resolve())
    return dest


def generate(cache: Path, ranks: int, mb: int) -> Path:
    out = cache / f"gen-{ranks}x{mb}mb"
    if not (out / ".done").exists():
        shutil.rmtree(out, ignore_errors=True)
        print(f"generating {ranks} ranks x {mb} MB into {out} ...", flush=True)
        subprocess.run([sys.executable, str(REPO / "tests" / "synthetic.py"), str(out),
                        "--ranks", str(ranks), "--steps", "4", "--target-mb-per-rank", str(mb),
                        "--seed", "0"], check=True)
        (out / ".done").touch()
    return out


WITH_STACK_JOB = ("--zero_stage", "2", "--steps", "34", "--model", "256,64,4,4", "--profile_window", "0,1,30,1",
                  "--profile_skip_first", "1", "--profile_stack", "--profile_modules")


def with_stack_traces(cache: Path) -> list:
    """The rank traces of a real 2-rank CPU DeepSpeed job profiled with Python stacks (made once; [] without
    torch and deepspeed)."""
    out = cache / "with_stack-job"
    if not (out / ".done").exists():
        if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("torch") is None:
            print("with_stack: skipped (torch and deepspeed are not installed: pip install -e '.[collect]')")
            return []
        shutil.rmtree(out, ignore_errors=True)
        print(f"running a 2-rank CPU DeepSpeed job with with_stack into {out} ...", flush=True)
        subprocess.run([sys.executable, str(REPO / "tests" / "realrun" / "launch.py"), str(out), *WITH_STACK_JOB],
                       check=True, capture_output=True)
        (out / ".done").write_text("")
    return trace_files(out / "traces")


def relabelled_copies(cache: Path, source: Path, ranks: int) -> Path:
    """`ranks` copies of one real trace, each with its distributedInfo rank set to 0..ranks-1."""
    out = cache / f"real-{ranks}x-{source.name.split('.')[0]}"
    if not (out / ".done").exists():
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        text = gzip.decompress(source.read_bytes())
        info = re.search(rb'"distributedInfo":\s*\{[^}]*"rank":\s*(\d+)', text)
        for rank in range(ranks):
            data = text[: info.start(1)] + str(rank).encode() + text[info.end(1):]
            (out / f"rank{rank}.json.gz").write_bytes(gzip.compress(data, compresslevel=1))
        (out / ".done").touch()
    return out


def relabelled_set(cache: Path, sources: list, copies: int) -> Path:
    """`copies` copies of a real multi-rank set, copy c of rank r relabelled rank c * len(sources) + r of
    copies * len(sources) (distributedInfo rank and world_size)."""
    out = cache / f"relabelled-{copies}x-{sources[0].parent.name}"
    if not (out / ".done").exists():
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        world = copies * len(sources)
        for source in sources:
            text = source.read_bytes()
            info = re.search(rb'"distributedInfo":\s*\{[^}]*\}', text)
            rank = int(re.search(rb'"rank":\s*(\d+)', info[0])[1])
            for copy in range(copies):
                relabelled = re.sub(rb'"world_size":\s*\d+', b'"world_size": %d' % world,
                                    re.sub(rb'"rank":\s*\d+', b'"rank": %d' % (copy * len(sources) + rank), info[0]))
                (out / f"rank{copy * len(sources) + rank}.json").write_bytes(text[:info.start()] + relabelled + text[info.end():])
        (out / ".done").touch()
    return out


def scan(path: Path, cache: dict) -> dict:
    """Uncompressed bytes and X/i event count of one file; cached by path, size and mtime."""
    st = path.resolve().stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    if key not in cache:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rb") as fh:
            raw = fh.read()
        events = json.loads(raw).get("traceEvents", [])
        cache[key] = {"bytes": len(raw),
                      "events": sum(1 for e in events if isinstance(e, dict) and e.get("ph") in ("X", "i"))}
    return cache[key]


def run_steplens(d: Path, jobs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="steplens-bench-out-") as tmp:
        r = measure([str(ANALYZE), str(d), "--out", os.path.join(tmp, "out"), "-q", "--jobs", str(jobs)],
                    capture=True, stderr=subprocess.STDOUT)
    if r["returncode"] not in (0, 1):  # 1: findings at warning level, a finished analysis
        print(f"  steplens exit {r['returncode']} on {d}:\n{r['stdout'][-3000:]}", flush=True)
    return r


ANALYSES = """
import sys, time
from pathlib import Path
from steplens.analyze.pipeline.workers import keep_pandas_out_of_pyarrow
keep_pandas_out_of_pyarrow()  # as analyze's own process does
from steplens.analyze.analyses import runner
from steplens.reports import html, markdown
started = time.perf_counter()
runner.run(Path(sys.argv[1]))
analysed = time.perf_counter()
report = html.write(Path(sys.argv[1]))
markdown.write(Path(sys.argv[1]))
print(analysed - started, time.perf_counter() - analysed, report.stat().st_size)
"""


def time_analyses(d: Path, jobs: int, runs: int) -> tuple[float, float, float, int]:
    """Median seconds of ingest (--ingest-only), of all analyses reading that run's Parquet and of
    rendering report.html + summary.md from it; and the report's size in bytes."""
    ingest_s, analyses_s, report_s, report_bytes = [], [], [], 0
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="steplens-bench-out-") as tmp:
            out = os.path.join(tmp, "out")
            started = time.perf_counter()
            subprocess.run([str(ANALYZE), str(d), "--out", out, "-q", "--jobs", str(jobs), "--ingest-only"],
                           check=True, capture_output=True)
            ingest_s.append(time.perf_counter() - started)
            done = subprocess.run([sys.executable, "-c", ANALYSES, out], check=True, capture_output=True, text=True)
            analysis_time, report_time, report_bytes = done.stdout.strip().splitlines()[-1].split()
            analyses_s.append(float(analysis_time))
            report_s.append(float(report_time))
    return statistics.median(ingest_s), statistics.median(analyses_s), statistics.median(report_s), int(report_bytes)


def run_hta(hta_py: str, d: Path) -> dict:
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: HTA logs a lot
        r = measure([hta_py, str(HERE / "hta_load.py"), str(d), "--json"], capture=True, stderr=err)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    lines = [ln for ln in r["stdout"].splitlines() if ln.startswith("{")]
    if r["returncode"] != 0 or not lines:
        print(f"  HTA exit {r['returncode']} on {d}:\n{stderr[-3000:]}", flush=True)
        return {**r, "hta": None}
    r["hta"] = json.loads(lines[-1])
    if r["hta"].get("skipped_files"):
        print(f"  HTA skipped files: {r['hta']['skipped_files']}", flush=True)
    return r


FINISHED = (0, 1)  # analyze: 1 = results written, some input lost (the hostile sets may have some)


def finished(results) -> list:
    return [r for r in results if r.get("returncode") in FINISHED and r.get("hta", True) is not None]


def med(results, key):
    vals = [r[key] for r in finished(results)]
    return statistics.median(vals) if vals else float("nan")


def spread(results, key) -> str:
    vals = [r[key] for r in finished(results)]
    return f"{min(vals):.2f}-{max(vals):.2f}" if vals else "-"


def bench_set(name, d, hta_py, runs, jobs, counts):
    files = trace_files(d)
    mb = sum(scan(f, counts)["bytes"] for f in files) / 1e6
    events = sum(scan(f, counts)["events"] for f in files)
    sl, hta = [], []
    for i in range(runs):
        sl.append(run_steplens(d, jobs))
        hta.append(run_hta(hta_py, d))
        print(f"  [{name}] run {i + 1}/{runs}: steplens {sl[-1]['seconds']:.2f} s {sl[-1]['peak_rss_mb']:.0f} MiB"
              f" | hta {hta[-1]['seconds']:.2f} s {hta[-1]['peak_rss_mb']:.0f} MiB", flush=True)
    hta_ok = [r for r in hta if r["hta"]]
    hta_load = statistics.median(r["hta"]["load_seconds"] for r in hta_ok) if hta_ok else float("nan")
    hta_rows = statistics.median(r["hta"]["events"] for r in hta_ok) if hta_ok else 0
    failed = sorted({a for r in hta_ok for a in r["hta"].get("failed_analyses", {})})
    print(f"\n== {name}: {len(files)} file(s), {mb:.1f} MB raw JSON, {events:,} input events (X+i);"
          f" median (min-max) of {runs} run(s), steplens --jobs {jobs}")
    print(f"   {'tool':<44}{'seconds':>9}{'min-max':>13}{'raw MB/s':>10}{'peak RSS MiB':>14}")
    for tool, results in (("steplens analyze (ingest+analyses+report)", sl), ("hta (load + 4 core analyses)", hta)):
        seconds = med(results, "seconds")
        print(f"   {tool:<44}{seconds:>9.2f}{spread(results, 'seconds'):>13}{mb / seconds:>10.1f}"
              f"{med(results, 'peak_rss_mb'):>14.0f}")
    print(f"   (whole processes from a cold start; HTA's own load step alone {hta_load:.2f} s; it kept "
          f"{hta_rows:,.0f} rows after its own filtering{'; analyses that raised: ' + ', '.join(failed) if failed else ''})")
    s_sl, s_hta = med(sl, "seconds"), med(hta, "seconds")
    print(f"   end to end: HTA seconds / steplens seconds = {s_hta / s_sl:.1f}x (target >= {END_TO_END_TARGET.get(name, 1)})")
    print(f"   peak RSS: steplens / HTA = {med(sl, 'peak_rss_mb') / med(hta, 'peak_rss_mb'):.2f} (target <= 1)\n",
          flush=True)
    return s_sl, s_hta


def floor(name: str, d: Path, seconds: tuple[float, float], jobs: int, runs: int) -> None:
    """What is left of `analyze` on this set when its parsing and analyses cost nothing
    (tests/benchmarks/floor.py), and the end-to-end ratio to HTA that no parser could beat."""
    s_sl, s_hta = seconds
    with tempfile.TemporaryDirectory(prefix="steplens-bench-out-") as tmp:
        out = os.path.join(tmp, "out")
        subprocess.run([str(ANALYZE), str(d), "--out", out, "-q", "--jobs", str(jobs)], capture_output=True)
        done = subprocess.run([sys.executable, str(HERE / "floor.py"), "--jobs", str(jobs), "--runs", str(runs), str(d), out],
                              check=True, capture_output=True, text=True)
    r = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"== {name}: the floor of this design (column building, normalisation, linking and analyses at no cost;"
          f" --jobs {jobs}, median of {runs})")
    print(f"   imports {r['imports_s']:.2f} + decode-only limit {r['decode_s']:.2f} + Parquet write {r['parquet_s']:.2f}"
          f" + report {r['report_s']:.2f} = {r['floor_s']:.2f} s")
    print(f"   HTA {s_hta:.2f} s / floor = {s_hta / r['floor_s']:.1f}x: the most any parser could reach here; "
          f"steplens's {s_sl:.2f} s is {s_sl / r['floor_s']:.1f}x its floor\n", flush=True)


# Issue 40's targets per set: HTA seconds / steplens seconds end to end, and parse MB/s per core (None: no target).
# "Never slower than HTA" holds for every set; 1.5x on small inputs, 5x and 10x on the large real sets.
END_TO_END_TARGET = {"real-8r": 10, "trace_diff": 5, "mtia_single": 5, "dlrm-8r": 1.5, "dlrm-1r": 1.5}
PARSE_TARGET_MB_S = {"mtia_single": 150, "with_stack": 100}  # the heaviest corpus trace; a trace recorded with stacks


STAGES = (("gunzip", "gunzip"), ("decode", "JSON decode"), ("columns", "column building"),
          ("normalise", "normalisation"), ("semantics", "step/launch linking"), ("parquet", "Parquet write"))


def stage_split(name: str, files: list, runs: int) -> None:
    """Seconds per stage of the first two files of a set of distinct files, or of its first file when they are
    copies or generated alike (tests/benchmarks/stage_split.py)."""
    shown = files[:2] if name in ("trace_diff",) else files[:1]
    done = subprocess.run([sys.executable, str(HERE / "stage_split.py"), "--runs", str(runs), *map(str, shown)],
                          check=True, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        r = json.loads(line)
        r["decode_s"] = max(0.0, r["read_decode_s"] - r["gunzip_s"])
        total = sum(r[f"{key}_s"] for key, _ in STAGES)
        print(f"== {name}: where steplens's time goes in {r['file']} ({r['mb']:.1f} MB raw, {r['events']:,} events kept;"
              f" in process, median of {runs}; MB/s per core from the CPU seconds)")
        print(f"   {'stage':<22}{'seconds':>9}{'share':>8}{'MB/s':>9}")
        for key, label in STAGES:
            seconds = r[f"{key}_s"]
            print(f"   {label:<22}{seconds:>9.3f}{seconds / total:>8.0%}{r['mb'] / seconds if seconds else float('inf'):>9.0f}")
        target = f"  (target >= {PARSE_TARGET_MB_S[name]} MB/s per core)" if name in PARSE_TARGET_MB_S else ""
        print(f"   {'total (wall)':<22}{total:>9.3f}{'':>8}{r['mb'] / total:>9.1f}")
        print(f"   {'CPU, all threads':<22}{r['cpu_s']:>9.3f}{'':>8}{r['mb'] / r['cpu_s']:>9.1f}{target}")
        print(f"   decode-only limit (gunzip + msgspec scan of traceEvents): {r['limit_s']:.3f} s = "
              f"{r['mb'] / r['limit_s']:.0f} MB/s; steplens at {r['limit_s'] / total:.0%} of it\n", flush=True)


def startup(name: str, d: Path, hta_py: str, runs: int) -> None:
    """Process start to first parse of `analyze` (its imports and discovery) against HTA's import as a whole
    process, cold starts interleaved (tests/benchmarks/startup.py)."""
    done = subprocess.run([sys.executable, str(HERE / "startup.py"), str(d), "--runs", str(runs), "--hta-python", hta_py],
                          check=True, capture_output=True, text=True)
    r = json.loads(done.stdout.strip().splitlines()[-1])
    ours, hta = statistics.median(r["analyze_s"]), statistics.median(r["hta_import_s"])
    print(f"== {name}: start-up, process start to first parse (cold, interleaved, median (min-max) of {runs}): analyze "
          f"{ours:.2f} s ({min(r['analyze_s']):.2f}-{max(r['analyze_s']):.2f}); HTA's `from hta.trace_analysis import "
          f"TraceAnalysis` alone {hta:.2f} s ({min(r['hta_import_s']):.2f}-{max(r['hta_import_s']):.2f}): "
          f"{ours / hta:.2f} of it (target < 1)\n", flush=True)


def time_incremental(d: Path, jobs: int, runs: int) -> tuple[float, float]:
    """Median seconds of a fresh `analyze` and of the same command again with nothing changed."""
    fresh, again = [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="steplens-bench-out-") as tmp:
            cmd = [str(ANALYZE), str(d), "--out", os.path.join(tmp, "out"), "-q", "--jobs", str(jobs)]
            for times in (fresh, again):
                started = time.perf_counter()
                subprocess.run(cmd, capture_output=True)
                times.append(time.perf_counter() - started)
    return statistics.median(fresh), statistics.median(again)


def byte_compile_steplens() -> None:
    """Compile steplens's sources to bytecode once, as pip does for HTA's installed packages: an editable
    install run where PYTHONDONTWRITEBYTECODE is set (this machine sets it) would otherwise compile
    every module again in every process, about a quarter of a second a run that no installed copy pays."""
    folders = [str(REPO / d) for d in ("analyze", "reports", "collect")]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *folders], check=True, capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 ranks x 10 MB, trace_diff only, 1 run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/steplens-bench"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="steplens --jobs (default: CPUs)")
    ap.add_argument("--sets", default=None, help="comma-separated names of the sets to run (default: all); the "
                    "analyses, re-run and memory sections use the first one")
    args = ap.parse_args()
    runs = 1 if args.quick else args.runs
    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)

    hta_py = subprocess.run(["bash", str(HERE / "hta_env.sh")], check=True, capture_output=True,
                            text=True).stdout.strip().splitlines()[-1]
    byte_compile_steplens()
    ranks, mb = (4, 10) if args.quick else (8, 50)
    wanted = args.sets.split(",") if args.sets else None
    # The generated set takes minutes to make the first time: made only when a section uses it.
    gen_files = trace_files(generate(cache, ranks, mb)) if wanted is None or f"synthetic-{ranks}r" in wanted else []
    sets = [(f"synthetic-{ranks}r", link_set(cache / "sets" / f"synthetic-{ranks}r", gen_files))] if gen_files else []
    if not args.quick:
        real = trace_files(relabelled_copies(cache, CORPUS / "trace_diff" / "control.json.gz", 8))
        sets.append(("real-8r", link_set(cache / "sets" / "real-8r", real)))
    sets.append(("trace_diff", link_set(cache / "sets" / "trace_diff", trace_files(CORPUS / "trace_diff"))))
    if not args.quick:
        sets.append(("dlrm-8r", link_set(cache / "sets" / "dlrm-8r", trace_files(DLRM))))
    if not args.quick:
        sets.append(("mtia_single", link_set(cache / "sets" / "mtia_single",
                                             trace_files(CORPUS / "mtia_trace_single_rank"))))
        sets.append(("dlrm-32r", link_set(cache / "sets" / "dlrm-32r", trace_files(relabelled_set(cache, trace_files(DLRM), 4)))))
        sets.append(("small_single", link_set(cache / "sets" / "small_single", trace_files(CORPUS / "ns_resolution_trace"))))
        sets.append(("dlrm-1r", link_set(cache / "sets" / "dlrm-1r", trace_files(DLRM)[:1])))
        if (wanted is None or "with_stack" in wanted) and (stacked := with_stack_traces(cache)):
            sets.append(("with_stack", link_set(cache / "sets" / "with_stack", stacked)))

    if wanted is not None:
        sets = [(name, d) for name, d in sets if name in wanted]
    counts_path = cache / "counts.json"
    counts = json.loads(counts_path.read_text()) if counts_path.exists() else {}
    print(f"steplens: {ANALYZE}\nHTA python: {hta_py}\ncache: {cache}\n", flush=True)
    seconds = {}
    for name, d in sets:
        seconds[name] = bench_set(name, d, hta_py, runs, args.jobs, counts)
        counts_path.write_text(json.dumps(counts, indent=1))
    for name, d in sets:
        startup(name, d, hta_py, runs)
    for name, d in sets:
        stage_split(name, trace_files(d), runs)
        floor(name, d, seconds[name], args.jobs, runs)

    ingest_s, analyses_s, report_s, report_bytes = time_analyses(sets[0][1], args.jobs, runs)
    print(f"== analyses on {sets[0][0]} (reading Parquet): {analyses_s:.2f} s = {analyses_s / ingest_s:.1%} of its ingest "
          f"time {ingest_s:.2f} s (target <= 20%)", flush=True)
    print(f"== report.html + summary.md from Parquet: {report_s:.2f} s (ingest {ingest_s:.2f} s); "
          f"report.html {report_bytes / 1e6:.2f} MB", flush=True)
    fresh_s, again_s = time_incremental(sets[0][1], args.jobs, runs)
    print(f"== re-running analyze on {sets[0][0]} with nothing changed: {again_s:.2f} s = {again_s / fresh_s:.0%} of a "
          f"fresh run's {fresh_s:.2f} s (target < 10%)\n", flush=True)

    if sets[0][0] != f"synthetic-{ranks}r":  # the memory section runs on the generated set only
        return 0
    print(f"== steplens peak RSS vs rank count (generated set, --jobs {args.jobs}, median of {runs})")
    print(f"   {'ranks':>5}{'raw MB':>9}{'seconds':>9}{'peak RSS MiB':>14}")
    for n in (1, 2, 4, 8):
        if n > len(gen_files):
            break
        d = link_set(cache / "sets" / f"synthetic-first{n}", gen_files[:n])
        res = [run_steplens(d, args.jobs) for _ in range(runs)]
        raw = sum(scan(f, counts)["bytes"] for f in gen_files[:n]) / 1e6
        print(f"   {n:>5}{raw:>9.1f}{med(res, 'seconds'):>9.2f}{med(res, 'peak_rss_mb'):>14.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
