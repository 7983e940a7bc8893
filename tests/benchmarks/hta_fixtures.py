"""Regenerate HTA (Holistic Trace Analysis) reference outputs under tests/fixtures/hta/.

Run with the HTA venv's python (tests/benchmarks/hta_env.sh creates it and prints its path):
    HTA_PY=$(bash tests/benchmarks/hta_env.sh) && $HTA_PY tests/benchmarks/hta_fixtures.py

For every trace in TRACES the trace file(s) are symlinked into a fresh temp dir (HTA loads a
whole directory), `TraceAnalysis(trace_dir=tmp)` is built with HTA's defaults, and these
analyses run with their default arguments (visualize=False only):
    get_cuda_kernel_launch_stats, get_idle_time_breakdown, get_temporal_breakdown,
    get_comm_comp_overlap, get_gpu_kernel_breakdown
plus two clearly-labelled non-default variants (see README): the idle-interval statistics
(show_idle_interval_stats=True) and, for multi-rank runs, launch stats / idle time for every rank.
Each DataFrame is written as <out>/<short_name>/<analysis>[_<i>|_rank<r>].csv (.csv.gz, written
with mtime 0, when it has more than GZIP_ROWS rows). A failing analysis is recorded, not raised.
Besides the CSVs it writes <out>/manifest.json (calls, shapes, errors, audit numbers) and
<out>/README.md (versions, command, HTA's definitions with source line references, and the
places where HTA's numbers are visibly wrong on these traces, computed from the traces).
"""
from __future__ import annotations

import argparse
import collections
import copy
import gzip
import inspect
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "hta"
DEFAULT_CORPUS = Path(os.environ.get("STEPLENS_CORPUS", "/work/shared/corpus"))
GZIP_ROWS = 3000
COMMAND = (
    "HTA_PY=$(bash tests/benchmarks/hta_env.sh) && $HTA_PY tests/benchmarks/hta_fixtures.py"
)

# short_name -> (corpus-relative file or directory, what it exercises)
TRACES: dict[str, tuple[str, str]] = {
    "nccl_a100": (
        "HolisticTraceAnalysis/nccl_parser_config/nccl_data.json.gz",
        "A100, NCCL collectives, cudaLaunchKernelExC",
    ),
    "ns_resolution_v100": (
        "HolisticTraceAnalysis/ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
        "V100, fractional-ns ts",
    ),
    "triton_example": (
        "HolisticTraceAnalysis/triton_example/triton_example.json.gz",
        "Triton cuLaunchKernel; CPU op with a stream arg",
    ),
    "h100_qwen": (
        "TraceLens/h100/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz",
        "H100, cuLaunchKernel, cudaLaunchKernelExC",
    ),
    "mi300_qwen": (
        "TraceLens/mi300/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz",
        "MI300X, hip* launches",
    ),
    "sglang_decode": (
        "TraceLens/inference_sglang_decode/sglang_Qwen3-8B_decode.json.gz",
        "MI300X, hipGraphLaunch",
    ),
    "gpu_user_annotation": (
        "HolisticTraceAnalysis/with_gpu_user_annotation/step_based_trace_2543932.json.gz",
        "Quadro GP100, gpu_user_annotation events",
    ),
    "dlrm_8rank": ("param/dlrm_kineto", "8 ranks as one run; V100, NCCL"),
}

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # GPU activity categories in Kineto traces
# categories get_idle_time_breakdown treats as kernels (breakdown_analysis.py, kernel_cats)
HTA_IDLE_KERNEL_CATS = ("kernel", "Kernel", "gpu_memset", "Memset", "gpu_memcpy", "Memcpy",
                        "mtia_ccp_events")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


# --------------------------------------------------------------------------- HTA source refs
def hta_root() -> Path:
    import hta

    return Path(hta.__file__).resolve().parent


def ref(relpath: str, needle: str, nth: int = 1) -> str:
    """`hta/<relpath>:<line>` of the nth line containing needle in the installed HTA source."""
    path = hta_root() / relpath
    seen = 0
    try:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if needle in line:
                seen += 1
                if seen == nth:
                    return f"`hta/{relpath}:{i}`"
    except OSError:
        pass
    return f"`hta/{relpath}:?` (not found: {needle!r})"


# --------------------------------------------------------------------------- raw trace stats
def load_json(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    return data if isinstance(data, dict) else {"traceEvents": data}


def trace_files(src: Path) -> list[Path]:
    if src.is_dir():
        return sorted(p for p in src.iterdir() if p.name.endswith((".json", ".gz")))
    return [src]


def raw_stats(path: Path) -> dict:
    """Counts straight from the JSON (independent of HTA) for one trace file."""
    events = [e for e in load_json(path).get("traceEvents", []) if isinstance(e, dict)]
    launcher_by_corr: dict[int, str] = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATS and e.get("ph") == "X":
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launcher_by_corr[corr] = e.get("name")
    gpu = [e for e in events if e.get("cat") in GPU_CATS and e.get("ph") == "X"]
    launchers = collections.Counter(
        launcher_by_corr.get((e.get("args") or {}).get("correlation"), "(no launch event)")
        for e in gpu
    )
    stream_non_gpu = [
        {"cat": e.get("cat"), "name": e.get("name"), "dur": e.get("dur"),
         "stream": e["args"]["stream"]}
        for e in events
        if isinstance(e.get("args"), dict) and "stream" in e["args"]
        and e.get("cat") not in GPU_CATS
    ]
    frac = sum(1 for e in events if isinstance(e.get("ts"), float) and not e["ts"].is_integer())
    runtime_names = collections.Counter(e.get("name") for e in events if e.get("cat") in LAUNCH_CATS)
    steps = sorted({e.get("name") for e in events
                    if str(e.get("name", "")).startswith("ProfilerStep") and e.get("cat") != "gpu_user_annotation"})
    # HTA's ceil(ts)/floor(ts + dur) applied to the GPU events (hta/common/trace_parser.py)
    def hta_dur(e):
        ts, dur = float(e.get("ts", 0)), float(e.get("dur", 0))
        return math.floor(ts + dur) - math.ceil(ts)
    rounds = any(isinstance(e.get("ts"), float) for e in events)
    rounded = [hta_dur(e) for e in gpu] if rounds else [e.get("dur", 0) for e in gpu]
    return {
        "file": path.name,
        "hta_rounds_ts": rounds,
        "gpu_dur_sum_raw_us": round(sum(float(e.get("dur", 0)) for e in gpu), 3),
        "gpu_dur_sum_after_hta_rounding_us": sum(rounded),
        "gpu_events_ge_1us_rounded_to_0": sum(1 for e, d in zip(gpu, rounded) if d == 0 and e.get("dur", 0) >= 1),
        "gpu_events_rounded_negative": sum(1 for d in rounded if d < 0),
        "events": len(events),
        "gpu_events": dict(collections.Counter(e["cat"] for e in gpu)),
        "gpu_events_total": len(gpu),
        "gpu_events_by_launcher": dict(launchers.most_common()),
        "runtime_and_driver_calls": dict(runtime_names.most_common()),
        "non_gpu_events_with_stream_arg": stream_non_gpu,
        "events_with_fractional_ts": frac,
        "gpu_events_dur_lt_1us": sum(1 for e in gpu if (e.get("dur") or 0) < 1),
        "profiler_steps": steps,
    }


# --------------------------------------------------------------------------- output helpers
def write_df(df, out_dir: Path, stem: str) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    if df.index.name is not None or df.index.nlevels > 1:
        df = df.reset_index()  # e.g. idle interval stats are indexed by idle_category
    text = df.to_csv(index=False, lineterminator="\n")
    if len(df) > GZIP_ROWS:
        path = out_dir / f"{stem}.csv.gz"
        with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                                    mtime=0, compresslevel=9) as gz:
            gz.write(text.encode())
    else:
        path = out_dir / f"{stem}.csv"
        path.write_text(text)
    return {"path": str(path.relative_to(out_dir.parent)), "rows": len(df),
            "columns": [str(c) for c in df.columns], "bytes": path.stat().st_size}


def save_result(result, out_dir: Path, stem: str) -> list[dict]:
    """DataFrame -> stem.csv; tuple -> stem_<i>.csv (None recorded); dict rank->df -> stem_rank<r>."""
    import pandas as pd

    if isinstance(result, pd.DataFrame):
        return [write_df(result, out_dir, stem)]
    if isinstance(result, tuple):
        files = []
        for i, item in enumerate(result):
            if item is None:
                files.append({"path": None, "element": i, "value": "None"})
            else:
                files += [dict(f, element=i) for f in save_result(item, out_dir, f"{stem}_{i}")]
        return files
    if isinstance(result, dict):
        files = []
        for rank, item in sorted(result.items()):
            files += [dict(f, rank=int(rank)) for f in save_result(item, out_dir, f"{stem}_rank{rank}")]
        return files
    if result is None:
        return [{"path": None, "value": "None"}]
    raise TypeError(f"unexpected result type {type(result)}")


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        # strip volatile parts (temp paths, timings, pids)
        msg = re.sub(r"/tmp/[^\s'\"]+/", "<tmp>/", msg)
        msg = re.sub(r"\d+\.\d+ (milli )?seconds", "<t> seconds", msg)
        msg = re.sub(r"PID:\s*\d+", "PID:<pid>", msg)
        if msg not in self.messages:
            self.messages.append(msg)


# --------------------------------------------------------------------------- audit (discrepancies)
def audit_rank(ta, rank: int, launch_df, idle_df) -> dict:
    """Numbers showing where HTA's outputs diverge from what is in the loaded trace."""
    import numpy as np

    t = ta.t
    sym = t.symbol_table.get_sym_table()
    df = t.get_trace(rank)
    cat = df["cat"].map(lambda i: sym[i])
    out: dict = {"rows_loaded": int(len(df))}

    # events HTA treats as "GPU" (stream != -1) although they are not GPU activity
    gpu_mask = df["stream"].ne(-1)
    kern_mask = gpu_mask & cat.isin(HTA_IDLE_KERNEL_CATS)
    fake = df[gpu_mask & ~cat.isin(HTA_IDLE_KERNEL_CATS)]
    out["stream_ne_minus1_rows"] = int(gpu_mask.sum())
    out["gpu_activity_rows"] = int(kern_mask.sum())
    out["non_gpu_rows_with_stream"] = [
        {"cat": sym[r.cat], "name": sym[r.name], "ts": int(r.ts), "dur": int(r.dur),
         "stream": int(r.stream)}
        for r in fake.itertuples()
    ][:20]
    out["non_gpu_rows_with_stream_count"] = int(len(fake))
    out["non_gpu_rows_with_stream_dur_sum"] = int(fake["dur"].sum())

    # rounding: negative / zero durations after HTA's ceil(ts)/floor(end)
    neg = df[df["dur"] < 0]
    out["negative_dur_rows"] = int(len(neg))
    out["negative_dur_by_cat"] = dict(collections.Counter(cat[neg.index]))
    out["negative_dur_min"] = int(neg["dur"].min()) if len(neg) else None
    out["gpu_activity_dur_le_0"] = int((df.loc[kern_mask, "dur"] <= 0).sum())
    out["gpu_activity_dur_lt_0"] = int((df.loc[kern_mask, "dur"] < 0).sum())

    # launch-stats coverage: which runtime call launched each GPU activity row
    kern = df[kern_mask]
    idx_corr = kern["index_correlation"]
    launch_name = idx_corr.map(
        lambda i: sym[df.at[i, "name"]] if i > 0 and i in df.index else "(no launch event)")
    covered = kern["correlation"].isin(set(launch_df["correlation"])) if launch_df is not None \
        else np.zeros(len(kern), bool)
    cov = collections.defaultdict(lambda: [0, 0])
    for ln, c in zip(launch_name, covered):
        cov[ln][0] += 1
        cov[ln][1] += int(c)
    out["launch_coverage"] = {k: {"gpu_rows": v[0], "in_launch_stats": v[1]}
                              for k, v in sorted(cov.items(), key=lambda kv: -kv[1][0])}
    if launch_df is not None:
        out["launch_stats_rows"] = int(len(launch_df))
        out["launch_stats_duplicate_correlations"] = int(launch_df["correlation"].duplicated().sum())
        out["launch_stats_cpu_duration_lt_0"] = int((launch_df["cpu_duration"] < 0).sum())
        out["launch_stats_gpu_duration_lt_0"] = int((launch_df["gpu_duration"] < 0).sum())
        out["launch_stats_gpu_duration_eq_0"] = int((launch_df["gpu_duration"] == 0).sum())
        out["launch_stats_launch_delay_eq_0"] = int((launch_df["launch_delay"] == 0).sum())
        # launch_delay before HTA's clip(lower=0): recompute with HTA's own join
        cpu = df[df["stream"].eq(-1) & df["correlation"].isin(launch_df["correlation"])]
        gpu = df[df["stream"].ne(-1) & df["correlation"].isin(launch_df["correlation"])]
        j = cpu[["correlation", "ts", "dur"]].merge(gpu[["correlation", "ts"]], on="correlation")
        raw_delay = j["ts_y"] - j["ts_x"] - j["dur"]
        out["launch_delay_negative_before_clip"] = int((raw_delay < 0).sum())
        out["launch_delay_min_before_clip"] = int(raw_delay.min()) if len(raw_delay) else None

    # idle time: per stream gaps as HTA computes them (ts - previous kernel's end, ts order)
    neg_gaps = 0
    neg_gap_sum = 0
    nested = 0
    for _, s in kern.sort_values("ts").groupby("stream"):
        end = s["ts"] + s["dur"]
        gap = s["ts"] - end.shift(1)
        neg_gaps += int((gap < 0).sum())
        neg_gap_sum += int(gap[gap < 0].sum())
        nested += int((s["ts"] + s["dur"] < end.cummax().shift(1)).sum())
    no_launch = kern[kern["index_correlation"] <= 0]
    out["idle_kernels_without_launch_event"] = int(len(no_launch))
    # get_idle_time_breakdown joins index_correlation (0 for these) against the row labels, so
    # their "runtime ts" is the ts of whatever event has index 0 (or NaN if that row was dropped)
    out["idle_row0_exists"] = bool(0 in df.index)
    out["idle_row0_event"] = (f"{sym[df.at[0, 'cat']]} `{sym[df.at[0, 'name']]}` ts={df.at[0, 'ts']}"
                              if 0 in df.index else None)
    out["idle_negative_gaps"] = neg_gaps
    out["idle_negative_gap_sum_us"] = neg_gap_sum
    out["idle_kernels_ending_before_previous_end"] = nested
    if idle_df is not None and len(idle_df):
        out["idle_time_total_us"] = float(idle_df["idle_time"].sum())
        out["idle_negative_category_rows"] = int((idle_df["idle_time"] < 0).sum())

    # comm kernels (get_kernel_type COMMUNICATION = ^nccl.*Kernel)
    from hta.utils.utils import get_kernel_type

    gk = df[gpu_mask]
    types = collections.Counter(get_kernel_type(sym[n]) for n in gk["name"])
    out["kernel_types_stream_ne_minus1"] = dict(types)
    return out


def corrected_temporal(ta, drop_non_gpu: bool = False, clip_negative_dur: bool = False):
    """HTA's own temporal breakdown on a patched copy of the loaded trace: without the non-GPU rows
    that carry a stream arg, and/or with negative (rounding) durations set to 0."""
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis

    t2 = copy.copy(ta.t)
    sym = ta.t.symbol_table.get_sym_table()
    t2.traces = {}
    for r, df in ta.t.traces.items():
        df = df.copy()
        if drop_non_gpu:
            cat = df["cat"].map(lambda i: sym[i])
            df = df[df["stream"].eq(-1) | cat.isin(HTA_IDLE_KERNEL_CATS)].copy()
        if clip_negative_dur:
            df["dur"] = df["dur"].clip(lower=0)
        t2.traces[r] = df
    return BreakdownAnalysis.get_temporal_breakdown(t2, visualize=False)


def breakdown_collapse(ta, all_kernel_df) -> dict:
    """Rows of get_gpu_kernel_breakdown()[1] whose max/min/mean equal the sum although the kernel ran
    more than once (HTA re-aggregates per-name sums when a type has > num_kernels names)."""
    sym = ta.t.symbol_table.get_sym_table()
    counts = {}
    truth = {}
    for r, df in ta.t.traces.items():
        g = df[df["stream"].ne(-1)]
        names = g["name"].map(lambda i: sym[i])
        agg = g.groupby(names)["dur"].agg(["count", "sum", "max", "min", "mean"])
        for n, row in agg.iterrows():
            counts[(int(r), n)] = int(row["count"])
            truth[(int(r), n)] = row
    bad = []
    for row in all_kernel_df.to_dict("records"):
        rk, n = int(row["rank"]), row["name"]
        if n == "others" or counts.get((rk, n), 0) < 2:
            continue
        s, mx, mn, mean = row["sum (us)"], row["max (us)"], row["min (us)"], row["mean (us)"]
        if s == mx == mn == mean:
            tr = truth[(rk, n)]
            bad.append({"rank": rk, "name": n[:80], "launches": counts[(rk, n)],
                        "reported_sum_max_min_mean": float(s),
                        "true_max": float(tr["max"]), "true_min": float(tr["min"]),
                        "true_mean": round(float(tr["mean"]), 3)})
    return {"collapsed_rows": len(bad), "examples": bad[:3]}


# --------------------------------------------------------------------------- per trace
def run_trace(short: str, corpus: Path, rel: str, out_root: Path) -> dict:
    from hta.trace_analysis import TraceAnalysis

    src = corpus / rel
    rec: dict = {"source": rel, "analyses": {}, "audit": {}}
    files = trace_files(src)
    rec["raw"] = [raw_stats(p) for p in files]
    out_dir = out_root / short
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)

    cap = _Capture()
    hta_logger = logging.getLogger("hta")
    hta_logger.addHandler(cap)
    tmp = Path(tempfile.mkdtemp(prefix=f"hta_fix_{short}_"))
    try:
        for p in files:
            (tmp / p.name).symlink_to(p)
        t0 = time.perf_counter()
        try:
            ta = TraceAnalysis(trace_dir=str(tmp))
        except Exception as exc:  # noqa: BLE001 - record, don't crash
            rec["load_error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            return rec
        load_seconds = time.perf_counter() - t0  # printed only: keeps regenerated fixtures diff-free
        print(f"[hta_fixtures]   loaded in {load_seconds:.2f} s", file=sys.stderr, flush=True)
        ranks = sorted(int(r) for r in ta.t.get_all_traces())
        rec["ranks"] = ranks
        rec["rank_files"] = {int(r): Path(f).name for r, f in ta.t.trace_files.items()}

        calls = [
            ("cuda_kernel_launch_stats", "get_cuda_kernel_launch_stats", {"visualize": False}, True),
            ("idle_time_breakdown", "get_idle_time_breakdown", {"visualize": False}, True),
            ("temporal_breakdown", "get_temporal_breakdown", {"visualize": False}, True),
            ("comm_comp_overlap", "get_comm_comp_overlap", {"visualize": False}, True),
            ("gpu_kernel_breakdown", "get_gpu_kernel_breakdown", {"visualize": False}, True),
            ("idle_time_breakdown_interval_stats", "get_idle_time_breakdown",
             {"visualize": False, "show_idle_interval_stats": True}, False),
        ]
        if ranks != [0]:
            calls += [
                ("cuda_kernel_launch_stats_allranks", "get_cuda_kernel_launch_stats",
                 {"ranks": ranks, "visualize": False}, False),
                ("idle_time_breakdown_allranks", "get_idle_time_breakdown",
                 {"ranks": ranks, "visualize": False}, False),
            ]
        results = {}
        for stem, meth, kwargs, is_default in calls:
            entry = {"call": f"{meth}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})",
                     "default_args": is_default}
            fn = getattr(ta, meth, None)
            if fn is None:
                entry["error"] = f"TraceAnalysis has no method {meth}"
                rec["analyses"][stem] = entry
                continue
            try:
                res = fn(**kwargs)
                results[stem] = res
                if stem == "idle_time_breakdown_interval_stats":
                    # element 0 is identical to the default call; keep only the stats table
                    res = (None, res[1])
                entry["files"] = save_result(res, out_dir, stem)
            except Exception as exc:  # noqa: BLE001
                entry["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                tb = traceback.extract_tb(exc.__traceback__)
                entry["error_at"] = [f"{Path(f.filename).name}:{f.lineno} {f.line}" for f in tb[-3:]]
            rec["analyses"][stem] = entry

        # ----- audit
        launch = results.get("cuda_kernel_launch_stats_allranks") or results.get("cuda_kernel_launch_stats") or {}
        idle = results.get("idle_time_breakdown_allranks") or results.get("idle_time_breakdown")
        idle_df = idle[0] if idle is not None else None
        for r in ranks:
            try:
                rec["audit"][r] = audit_rank(
                    ta, r, launch.get(r),
                    idle_df[idle_df["rank"] == r] if idle_df is not None else None)
            except Exception as exc:  # noqa: BLE001
                rec["audit"][r] = {"error": repr(exc)}
        for key, kw in (("temporal_without_non_gpu_stream_rows", {"drop_non_gpu": True}),
                        ("temporal_with_negative_dur_clipped", {"clip_negative_dur": True})):
            try:
                rec[key] = json.loads(corrected_temporal(ta, **kw).to_json(orient="records"))
            except Exception as exc:  # noqa: BLE001
                rec[key] = {"error": "".join(traceback.format_exception_only(type(exc), exc)).strip()}
        if "gpu_kernel_breakdown" in results:
            try:
                rec["gpu_kernel_breakdown_collapse"] = breakdown_collapse(
                    ta, results["gpu_kernel_breakdown"][1])
            except Exception as exc:  # noqa: BLE001
                rec["gpu_kernel_breakdown_collapse"] = {"error": repr(exc)}
        for k in ("temporal_breakdown", "comm_comp_overlap"):
            if k in results:
                rec[k] = json.loads(results[k].to_json(orient="records"))
        if "gpu_kernel_breakdown" in results:
            rec["kernel_type_breakdown"] = json.loads(results["gpu_kernel_breakdown"][0].to_json(orient="records"))
    finally:
        hta_logger.removeHandler(cap)
        rec["hta_warnings"] = cap.messages
        shutil.rmtree(tmp, ignore_errors=True)
    return rec


# --------------------------------------------------------------------------- README
def signature_defaults(meth: str) -> str:
    from hta.trace_analysis import TraceAnalysis

    fn = getattr(TraceAnalysis, meth, None)
    if fn is None:
        return "(missing)"
    parts = []
    for n, p in inspect.signature(fn).parameters.items():
        if n == "self":
            continue
        parts.append(n if p.default is inspect.Parameter.empty else f"{n}={p.default!r}")
    return f"{meth}({', '.join(parts)})"


def definitions() -> str:
    R = ref
    ta, ck, bd, ca = ("trace_analysis.py", "analyzers/cuda_kernel_analysis.py",
                      "analyzers/breakdown_analysis.py", "analyzers/communication_analysis.py")
    tp, tr, ut, tf = ("common/trace_parser.py", "common/trace.py", "utils/utils.py", "common/trace_file.py")
    return f"""
## How HTA computes these numbers (HTA {version('HolisticTraceAnalysis')} source, paths relative to the installed `hta` package)

### Loading (applies to every analysis)
- Files and ranks: every `*.json`/`*.gz` in the directory; the rank is the first match of the
  regex `"rank":\\s+(\\d+)` in the file ({R(tf, "rank_re = re.compile")}); no match -> rank 0
  ({R(tf, "rank_to_trace_dict[0] = file_path")}); a later file with the same rank replaces the earlier one.
- Parser: `ParserBackend.JSON` by default ({R(tp, "_TRACE_PARSING_BACKEND = ParserBackend.JSON")}).
- **Timestamp rounding**: if the `ts` column is float64 (any fractional/ns-resolution ts), HTA does
  `end = ts + dur; ts = ceil(ts); end = floor(end); dur = end - ts` on every event
  ({R(tp, "def round_down_time_stamps")}, {R(tp, "math.ceil(x)")}-{R(tp, 'df["dur"] = df["end"] - df["ts"]')}),
  unless env `HTA_DISABLE_NS_ROUNDING=1` (unset here). So all times below are integer microseconds and an
  event shorter than 1 us gets `dur` 0 or **-1**.
- Events without `dur` or `cat`, and `cat == "Trace"`, are dropped ({R(tp, 'df.dropna(axis=0, subset=["dur", "cat"]')}).
- `stream` = `args.stream` (default -1; non-int -> -1; {R(ut, "def normalize_gpu_stream_numbers")});
  `correlation` = `args.correlation` (default -1). Most analyses call an event "GPU" iff `stream != -1`,
  whatever its `cat`; `GPUKernelFilter` additionally requires `correlation >= 0` ({R("common/trace_filter.py", 'return ((df["stream"] >= 0) & (df["correlation"] >= 0))')}).
- `index_correlation`: CPU event <-> GPU event row index through `correlation` ({R(tr, "def transform_correlation_to_index")}).
- All ranks are shifted so the earliest event of any rank is at 0 ({R(tr, "def _align_all_ranks")}).
- Last-iteration filter (`include_last_profiler_step=False`): when the trace has >= 2 distinct `ProfilerStep*`
  names, CPU events with `ts >=` start of the last ProfilerStep are dropped, and GPU events whose correlation is
  not among the remaining CPU events are dropped ({R(tr, "def _filter_irrelevant_gpu_kernels")}, {R(tr, 'else cpu_kernels[cpu_kernels["ts"] < last_profiler_start]')}).

### get_cuda_kernel_launch_stats -> `cuda_kernel_launch_stats_rank<r>.csv`
`{signature_defaults('get_cuda_kernel_launch_stats')}` ({R(ta, "def get_cuda_kernel_launch_stats")}; implementation {R(ck, "def cuda_kernel_launch_stats")}).
Returns `{{rank: DataFrame}}`, default ranks `[0]` only. `runtime_cutoff`/`launch_delay_cutoff` are used only by the plots.
- Launch events = CPU events whose name is exactly `cudaLaunchKernel`, `cudaLaunchKernelExC`, or
  `runFunction - job_prep_and_submit_for_execution` (MTIA), plus `cudaMemcpyAsync`/`cudaMemsetAsync` when
  `include_memory_events` ({R(ck, 'cuda_launch_kernel_id = sym_index.get("cudaLaunchKernel"')}-{R(ck, "memory_event_correlation_series: pd.Series")}).
  **Not** counted: `cuLaunchKernel`, `cuLaunchKernelEx`, `cudaGraphLaunch`, `cudaLaunchCooperativeKernel`, any `hip*` call,
  even though HTA's own launch pattern elsewhere matches `(cuda.*LaunchKernel)|(cuLaunchKernel)|(^runFunction)` ({R("common/types.py", "KERNEL_LAUNCH_CATEGORY_PATTERN = GroupingPattern(")}).
- CPU side = rows with `stream == -1` whose correlation is in that set; GPU side = rows with `stream != -1` and the same
  correlation; inner join on `correlation` ({R(ck, "joined_df = pd.merge(")}).
- Columns: `correlation`; `cpu_duration` = CPU runtime event `dur` (us); `gpu_duration` = GPU event `dur` (us);
  `launch_delay` = `gpu.ts - cpu.ts - cpu.dur` (us) ({R(ck, 'joined_df["ts_y"] - joined_df["ts_x"] - joined_df["dur_x"]')}),
  **clipped at 0** ({R(ck, "clip(lower=0)")}). All after the ceil/floor rounding above.

### get_idle_time_breakdown -> `idle_time_breakdown_0.csv`
`{signature_defaults('get_idle_time_breakdown')}` ({R(ta, "def get_idle_time_breakdown")}; implementation {R(bd, "def get_idle_time_breakdown")}, {R(bd, "def _analyze_idle_time_for_stream")}).
Returns a tuple `(idle_df, interval_stats_df)`; with the default `show_idle_interval_stats=False` the second element is `None`
(no `_1` file). Default ranks `[0]`, all streams.
- Kernels: `stream != -1` and `cat` in `kernel, Kernel, gpu_memset, Memset, gpu_memcpy, Memcpy, mtia_ccp_events` ({R(bd, "kernel_cats = [")}).
- Per stream, kernels sorted by `ts`; `idle_interval = ts - end of the previous kernel in ts order` ({R(bd, 'gpu_kernels_s["ts"] - gpu_kernels_s["prev_end_ts"]')}); the first kernel's interval is NaN (ignored).
  Overlapping kernels on one stream give negative intervals, which are summed as is.
- Category ({R(bd, "is_host_wait = ")}): `host_wait` if the launching runtime event's `ts` (via `index_correlation`) is after the previous kernel's end;
  else `kernel_wait` if `idle_interval < consecutive_kernel_delay` ({R(bd, 'gpu_kernels_s["idle_interval"] < consecutive_kernel_delay')}); else `other`.
  `consecutive_kernel_delay` defaults to **30**; the docstring says "30 nanoseconds" ({R(ta, "Default = 30 nanoseconds")}) but it is compared with
  microsecond intervals, so the threshold is 30 us.
- Columns: `rank`, `stream`, `idle_category` (host_wait / kernel_wait / other), `idle_time` = sum of `idle_interval` (us),
  `idle_time_ratio` = idle_time / total idle of that stream; rounded to 2 decimals ({R(bd, '["rank", "stream", "idle_category", "idle_time", "idle_time_ratio"]')}).
- Non-default variant `idle_time_breakdown_interval_stats_1.csv` (`show_idle_interval_stats=True`): pandas `describe()` of `idle_interval`
  per stream and category: count, mean, std, min, 25%, 50%, 75%, max (us, rounded 2) ({R(bd, "gpu_kernels_groupby.idle_interval.describe()")}); the `idle_category`
  column holds the category name.

### get_temporal_breakdown -> `temporal_breakdown.csv`
`{signature_defaults('get_temporal_breakdown')}` ({R(ta, "def get_temporal_breakdown")}; implementation {R(bd, "def get_temporal_breakdown")}). One row per rank (all ranks).
- "GPU" rows = `stream != -1` (any cat) ({R(bd, 'gpu_kernels = trace_df[trace_df["stream"].ne(-1)].copy()', 2)}). Intervals are merged when
  `ts <= running max end` ({R(ut, "def merge_kernel_intervals")}).
- `kernel_time(us)` = end of the last merged interval - start of the first; `idle_time(us)` = kernel_time - union busy time ({R(bd, "def _get_idle_time_for_kernels")});
  `compute_time(us)` = union of COMPUTATION kernels; `non_compute_time(us)` = kernel_time - compute - idle (i.e. busy time not covered by compute:
  communication, memcpy/memset, OTHER) ({R(bd, "non_compute_time = kernel_time - compute_time - idle_time")}). `*_pctg` = round(100 * x / kernel_time, 2).
- Kernel type from the name ({R(ut, "def get_kernel_type")}): COMMUNICATION if `^nccl.*Kernel`; MEMORY if `^Memcpy|^Memset|^dma`;
  COMPUTATION if it does not `re.match` `(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)` (so any name containing `Memcpy` or `Sync` is OTHER); else OTHER.

### get_comm_comp_overlap -> `comm_comp_overlap.csv`
`{signature_defaults('get_comm_comp_overlap')}` ({R(ta, "def get_comm_comp_overlap")}; implementation {R(ca, "def get_comm_comp_overlap")}). One row per rank.
- Union of COMMUNICATION intervals and of COMPUTATION intervals (`stream != -1` rows); `comp_comm_overlap_pctg` =
  round(100 * time both are running / union communication time, 2) ({R(ca, 'return (shifted_overlap["time_y"] - shifted_overlap["time_x"]).sum() / (')}).
  With no communication kernel this is 0/0 = NaN (written as an empty CSV cell).

### get_gpu_kernel_breakdown -> `gpu_kernel_breakdown_0.csv`, `gpu_kernel_breakdown_1.csv`
`{signature_defaults('get_gpu_kernel_breakdown')}` ({R(ta, "def get_gpu_kernel_breakdown")}; implementation {R(bd, "def get_gpu_kernel_breakdown")}).
Note `TraceAnalysis` passes `include_memory_kernels=True`, while `BreakdownAnalysis.get_gpu_kernel_breakdown` defaults to False.
- `_0` (kernel_type_df): `kernel_type` (a type or a combination such as `COMMUNICATION overlapping COMPUTATION`), `sum` = time (us)
  during which exactly that combination of types runs (union of merged intervals per type, summed over ranks), `percentage` = sum / total, rounded 1 ({R(bd, "def _get_gpu_kernel_type_time")}).
- `_1` (all_kernel_df): per rank, kernel type and kernel name: `sum (us)`, `max (us)`, `min (us)`, `stddev`, `mean (us)` of `dur`, `kernel_type`, `rank`.
  When a type has more than `num_kernels` names, names past the `duration_ratio` quantile of the cumulative sum or past
  position `num_kernels` become `others`, and then **everything is re-aggregated over the per-name sums**
  ({R(bd, 'gpu_kernel_time = gpu_kernel_time.groupby(by=["name"])["sum"].agg(')}): for every kept name max = min = mean = sum and stddev = 0,
  and `others` gets statistics of per-name sums, not of kernel durations.
"""


def fmt(x) -> str:
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"
        return f"{x:g}"
    return str(x)


def discrepancies(manifest: dict) -> str:
    lines = ["## Where HTA's numbers are visibly wrong on these traces (computed by this script)\n"]
    traces = manifest["traces"]

    # 1. launch-stats coverage
    lines.append("### 1. get_cuda_kernel_launch_stats misses launches that are not cudaLaunchKernel[ExC]/cudaMem{cpy,set}Async\n")
    lines.append("GPU rows = loaded rows with `stream != -1` and a kernel/memcpy/memset cat, per launching runtime call "
                 "(via `index_correlation`); `in stats` = how many of them appear in the launch-stats table "
                 "(default run for rank 0, all-ranks run for other ranks). `raw` = GPU events in the file(s) before HTA's filtering. "
                 "`(no launch event)` = GPU events whose correlation id matches no runtime/driver event in the file (launched from "
                 "an unprofiled thread or before the window); no tool can attribute those, so only the other launchers count against HTA.\n")
    lines.append("| trace | rank | raw GPU events | loaded GPU rows | launch-stats rows | launcher: GPU rows / in stats |")
    lines.append("|---|---|---|---|---|---|")
    for short, rec in traces.items():
        if "audit" not in rec:
            continue
        raws = {r["file"]: r for r in rec["raw"]}
        for r, a in rec["audit"].items():
            if "error" in a:
                lines.append(f"| {short} | {r} | | | | audit error {a['error']} |")
                continue
            raw = raws.get(rec.get("rank_files", {}).get(int(r)), {})
            cov = "; ".join(f"{k}: {v['gpu_rows']}/{v['in_launch_stats']}" for k, v in a["launch_coverage"].items())
            lines.append(f"| {short} | {r} | {raw.get('gpu_events_total', '')} | {a['gpu_activity_rows']} | "
                         f"{a.get('launch_stats_rows', 'n/a')} | {cov} |")
    lines.append("")

    # 2. non-GPU rows with a stream arg
    lines.append("### 2. Non-GPU events with a `stream` arg are counted as GPU time (temporal breakdown, kernel breakdown, comm/comp overlap)\n")
    any_fake = False
    for short, rec in traces.items():
        for r, a in rec.get("audit", {}).items():
            if a.get("non_gpu_rows_with_stream_count"):
                any_fake = True
                ex = ", ".join(f"{e['cat']} `{e['name']}` ts={e['ts']} dur={e['dur']} us stream={e['stream']}"
                               for e in a["non_gpu_rows_with_stream"][:3])
                tb = {int(x["rank"]): x for x in rec.get("temporal_breakdown", [])}.get(int(r))
                fix = {int(x["rank"]): x for x in rec.get("temporal_without_non_gpu_stream_rows", [])
                       if isinstance(x, dict)}.get(int(r))
                real = sum(x["gpu_dur_sum_raw_us"] for x in rec["raw"])
                lines.append(f"- **{short}** rank {r}: {a['non_gpu_rows_with_stream_count']} row(s), {a['non_gpu_rows_with_stream_dur_sum']} us: {ex}. "
                             f"Actual GPU activity (kernel/memcpy/memset) in the file: {real:g} us raw, {a['gpu_activity_rows']} row(s).")
                if tb and fix:
                    keys = ["kernel_time(us)", "idle_time(us)", "compute_time(us)", "non_compute_time(us)",
                            "idle_time_pctg", "compute_time_pctg"]
                    lines.append("  HTA temporal breakdown: " + ", ".join(f"{k}={fmt(tb[k])}" for k in keys))
                    lines.append("  same HTA code without those rows: " + ", ".join(f"{k}={fmt(fix[k])}" for k in keys))
                kt = rec.get("kernel_type_breakdown")
                if kt:
                    lines.append("  gpu_kernel_breakdown kernel types: " + ", ".join(f"{x['kernel_type']}={x['sum']} us ({x['percentage']}%)" for x in kt))
    if not any_fake:
        lines.append("- none in these traces")
    lines.append("")

    # 3. comm/comp overlap NaN
    lines.append("### 3. get_comm_comp_overlap is NaN (0/0) when a rank has no communication kernel\n")
    for short, rec in traces.items():
        cco = rec.get("comm_comp_overlap")
        if cco is None:
            continue
        vals = ", ".join(
            f"rank {x['rank']}: {fmt(x['comp_comm_overlap_pctg']) if x['comp_comm_overlap_pctg'] is not None else 'NaN'}% "
            f"(COMMUNICATION kernels: {rec['audit'].get(x['rank'], rec['audit'].get(str(x['rank']), {})).get('kernel_types_stream_ne_minus1', {}).get('COMMUNICATION', 0)})"
            for x in cco)
        lines.append(f"- {short}: {vals}")
    lines.append("")

    # 4. rounding
    lines.append("### 4. ceil(ts)/floor(end) rounding: zero and negative durations\n")
    lines.append("| trace | rank | events with fractional ts (raw) | GPU events < 1 us (raw) | loaded rows with dur < 0 (by cat) | min dur | GPU rows dur <= 0 | GPU rows dur < 0 | launch stats gpu_duration == 0 / < 0 | launch stats cpu_duration < 0 |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for short, rec in traces.items():
        raws = {r["file"]: r for r in rec["raw"]}
        for r, a in rec.get("audit", {}).items():
            if "error" in a:
                continue
            raw = raws.get(rec.get("rank_files", {}).get(int(r)), {})
            lines.append(
                f"| {short} | {r} | {raw.get('events_with_fractional_ts', '')} | {raw.get('gpu_events_dur_lt_1us', '')} | "
                f"{a['negative_dur_rows']} {a['negative_dur_by_cat'] or ''} | {a['negative_dur_min']} | "
                f"{a['gpu_activity_dur_le_0']} | {a['gpu_activity_dur_lt_0']} | "
                f"{a.get('launch_stats_gpu_duration_eq_0', 'n/a')} / {a.get('launch_stats_gpu_duration_lt_0', 'n/a')} | "
                f"{a.get('launch_stats_cpu_duration_lt_0', 'n/a')} |")
    lines.append("")
    lines.append("GPU events in the file(s) (before HTA's last-step filter), HTA's `floor(ts + dur) - ceil(ts)` vs the raw `dur`:\n")
    lines.append("| trace | file | rounding applied | GPU dur sum raw (us) | after rounding (us) | lost | events >= 1 us rounded to 0 | events rounded to < 0 |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for short, rec in traces.items():
        for raw in rec["raw"]:
            lost = raw["gpu_dur_sum_raw_us"] - raw["gpu_dur_sum_after_hta_rounding_us"]
            pct = 100 * lost / raw["gpu_dur_sum_raw_us"] if raw["gpu_dur_sum_raw_us"] else 0
            lines.append(f"| {short} | {raw['file'][:40]} | {raw['hta_rounds_ts']} | {raw['gpu_dur_sum_raw_us']:.3f} | "
                         f"{raw['gpu_dur_sum_after_hta_rounding_us']} | {lost:.3f} ({pct:.2f}%) | "
                         f"{raw['gpu_events_ge_1us_rounded_to_0']} | {raw['gpu_events_rounded_negative']} |")
    lines.append("")
    for short, rec in traces.items():
        err = rec["analyses"].get("temporal_breakdown", {}).get("error")
        fix = rec.get("temporal_with_negative_dur_clipped")
        negs = {r: a.get("gpu_activity_dur_lt_0", 0) for r, a in rec.get("audit", {}).items()}
        if err and isinstance(fix, list):
            keys = ["kernel_time(us)", "idle_time(us)", "compute_time(us)", "non_compute_time(us)"]
            lines.append(f"- **{short}**: `get_temporal_breakdown` raises `{err}` (`assert non_compute_time >= 0`): the "
                         f"{sum(negs.values())} GPU row(s) with dur -1 each become a merged interval with end < ts, so the union of "
                         f"all GPU time comes out smaller than the union of compute kernels alone. The same HTA code with negative "
                         f"durations set to 0 gives: " + "; ".join(
                             f"rank {x['rank']}: " + ", ".join(f"{k}={fmt(x[k])}" for k in keys) for x in fix))
    lines.append("")

    # 5. launch delay clipping
    lines.append("### 5. launch_delay clipped at 0 hides GPU starts before the runtime call returns\n")
    for short, rec in traces.items():
        parts = [f"rank {r}: {a['launch_delay_negative_before_clip']} of {a['launch_stats_rows']} negative before the clip (min {a['launch_delay_min_before_clip']} us)"
                 for r, a in rec.get("audit", {}).items() if a.get("launch_stats_rows")]
        if parts:
            lines.append(f"- {short}: " + "; ".join(parts))
    lines.append("")

    # 6. idle time negative gaps
    lines.append("### 6. Idle-time breakdown sums negative gaps (overlapping kernels on one stream)\n")
    lines.append("`idle_interval = ts - previous kernel's end` in ts order, so a kernel that starts before the previous one ended "
                 "(overlap on the same stream, often created by the rounding) contributes a negative 'idle' time, mostly to kernel_wait.\n")
    for short, rec in traces.items():
        parts = []
        for r, a in rec.get("audit", {}).items():
            if a.get("idle_negative_gaps"):
                parts.append(f"rank {r}: {a['idle_negative_gaps']} negative gaps summing to {a['idle_negative_gap_sum_us']} us; "
                             f"{a['idle_kernels_ending_before_previous_end']} kernels end before the previous one (nested); "
                             f"{a.get('idle_negative_category_rows', 0)} category rows with idle_time < 0")
        if parts:
            lines.append(f"- {short}: " + "; ".join(parts))
    if not any(a.get("idle_negative_gaps") for rec in traces.values() for a in rec.get("audit", {}).values()):
        lines.append("- none in these traces (no same-stream overlap after rounding; the -1 us memsets only widen the next gap).")
    lines.append("")
    lines.append("Kernels with no launch event in the trace get `index_correlation` 0, and the idle-time join then takes the `ts` of "
                 "the event whose row index is 0 as their 'runtime start' (it is `host_wait` only if the previous kernel ended before that unrelated ts):\n")
    for short, rec in traces.items():
        parts = [f"rank {r}: {a['idle_kernels_without_launch_event']} kernels (row 0 = {a['idle_row0_event']})"
                 for r, a in rec.get("audit", {}).items() if a.get("idle_kernels_without_launch_event")]
        if parts:
            lines.append(f"- {short}: " + "; ".join(parts))
    lines.append("")

    # 7. kernel breakdown collapse
    lines.append("### 7. get_gpu_kernel_breakdown: per-kernel max/min/mean replaced by the kernel's total\n")
    for short, rec in traces.items():
        c = rec.get("gpu_kernel_breakdown_collapse")
        if not c or "error" in c:
            continue
        if c["collapsed_rows"]:
            ex = c["examples"][0]
            lines.append(f"- {short}: {c['collapsed_rows']} rows (kernels launched >= 2 times) report max = min = mean = sum and stddev 0; e.g. rank {ex['rank']} "
                         f"`{ex['name']}` launched {ex['launches']} times: reported max/min/mean {fmt(ex['reported_sum_max_min_mean'])} us, "
                         f"true max {fmt(ex['true_max'])}, min {fmt(ex['true_min'])}, mean {fmt(ex['true_mean'])} us")
    lines.append("")

    # 8. last step filter
    lines.append("### 8. GPU events dropped by the default last-ProfilerStep filter (`include_last_profiler_step=False`)\n")
    for short, rec in traces.items():
        raws = {r["file"]: r for r in rec["raw"]}
        parts = []
        for r, a in rec.get("audit", {}).items():
            raw = raws.get(rec.get("rank_files", {}).get(int(r)), {})
            if "gpu_activity_rows" in a and raw:
                parts.append(f"rank {r}: {raw['gpu_events_total']} -> {a['gpu_activity_rows']} "
                             f"(ProfilerStep names: {len(raw['profiler_steps'])})")
        if parts:
            lines.append(f"- {short}: " + "; ".join(parts))
    lines.append("")
    return "\n".join(lines)


def write_readme(out_root: Path, manifest: dict) -> None:
    lines = [
        "# HTA reference outputs (test fixtures)",
        "",
        "Generated by `tests/benchmarks/hta_fixtures.py`; do not edit by hand (regenerate instead).",
        "",
        f"- HolisticTraceAnalysis: **{manifest['versions']['HolisticTraceAnalysis']}**",
        f"- pandas: **{manifest['versions']['pandas']}**, numpy {manifest['versions']['numpy']}, python {manifest['versions']['python']}",
        f"- HTA_DISABLE_NS_ROUNDING: {manifest['env']['HTA_DISABLE_NS_ROUNDING']!r}; parser backend: {manifest['env']['parser_backend']}",
        f"- corpus: `{manifest['corpus']}` (each trace symlinked into its own temp dir)",
        "",
        "Command (from the repo root):",
        "",
        "```",
        COMMAND,
        "```",
        "",
        "Every analysis runs on `TraceAnalysis(trace_dir=<tmp dir>)` with default arguments except `visualize=False`.",
        "Non-default extras (marked `default_args: false` in `manifest.json`): `idle_time_breakdown_interval_stats_1.csv`",
        "(`show_idle_interval_stats=True`) and, for multi-rank runs, `*_allranks*` (`ranks=<all ranks>`).",
        "`manifest.json` lists every call, file, row count and column, HTA's logged warnings, and the raw audit numbers used below.",
        "Files: `<analysis>.csv` for a DataFrame, `<analysis>_<i>.csv` for element i of a returned tuple, `<analysis>_rank<r>.csv`",
        f"for a returned `{{rank: DataFrame}}`; tables with more than {GZIP_ROWS} rows are `.csv.gz`. Empty cells are NaN.",
        "",
        "## Traces and files",
        "",
        "| short name | source (under the corpus) | ranks | HTA warnings (timing lines omitted) |",
        "|---|---|---|---|",
    ]
    for short, rec in manifest["traces"].items():
        warns = [w for w in rec.get("hta_warnings", [])
                 if not re.match(r"(Parsed |Overall parsing|leaving )", w)]
        warns = "; ".join(w.replace("|", "/")[:110] for w in warns)
        lines.append(f"| {short} | `{rec['source']}` ({TRACES[short][1]}) | {rec.get('ranks', 'load failed')} | {warns} |")
    lines += ["", "| file | rows | bytes |", "|---|---|---|"]
    for short, rec in manifest["traces"].items():
        for stem, a in rec["analyses"].items():
            for f in a.get("files", []):
                if f.get("path"):
                    lines.append(f"| `{f['path']}` | {f['rows']} | {f['bytes']} |")
    lines += ["", "## Analyses that failed or returned nothing", "",
              "(`get_idle_time_breakdown` with defaults returns `(df, None)` on every trace: no `idle_time_breakdown_1` file.)", ""]
    any_err = False
    for short, rec in manifest["traces"].items():
        if "load_error" in rec:
            any_err = True
            lines.append(f"- **{short}**: TraceAnalysis load failed: `{rec['load_error']}`")
        for stem, a in rec["analyses"].items():
            if "error" in a:
                any_err = True
                at = "; ".join(a.get("error_at", []))
                lines.append(f"- **{short}** `{a['call']}`: `{a['error']}`" + (f" (at {at})" if at else ""))
            for f in a.get("files", []):
                if f.get("path") is None and not stem.startswith("idle_time_breakdown"):
                    lines.append(f"- {short} `{a['call']}`: element {f.get('element', '')} is None (no file)")
                elif f.get("rows") == 0:
                    lines.append(f"- {short} `{a['call']}`: `{f['path']}` is empty (0 rows)")
    if not any_err:
        lines.append("- no analysis raised")
    lines.append(definitions())
    lines.append(discrepancies(manifest))
    (out_root / "README.md").write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", choices=sorted(TRACES), help="subset of traces (README/manifest then cover only these)")
    args = ap.parse_args()

    os.environ.pop("HTA_DISABLE_NS_ROUNDING", None)  # HTA's default behaviour
    import numpy
    import pandas
    from hta.common.trace_parser import get_default_trace_parsing_backend

    manifest = {
        "versions": {"HolisticTraceAnalysis": version("HolisticTraceAnalysis"), "pandas": pandas.__version__,
                     "numpy": numpy.__version__, "python": sys.version.split()[0]},
        "env": {"HTA_DISABLE_NS_ROUNDING": os.environ.get("HTA_DISABLE_NS_ROUNDING"),
                "parser_backend": str(get_default_trace_parsing_backend().value)},
        "corpus": str(args.corpus),
        "command": COMMAND,
        "defaults": {m: signature_defaults(m) for m in (
            "get_cuda_kernel_launch_stats", "get_idle_time_breakdown", "get_temporal_breakdown",
            "get_comm_comp_overlap", "get_gpu_kernel_breakdown")},
        "traces": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for short, (rel, _) in TRACES.items():
        if args.only and short not in args.only:
            continue
        print(f"[hta_fixtures] {short}: {rel}", file=sys.stderr, flush=True)
        manifest["traces"][short] = run_trace(short, args.corpus, rel, args.out)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str, sort_keys=False) + "\n")
    write_readme(args.out, manifest)
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"[hta_fixtures] wrote {args.out} ({total / 1e6:.2f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
