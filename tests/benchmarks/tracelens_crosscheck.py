"""Cross-check steplens' op_perf against AMD's TraceLens on traces with shapes (not part of CI).

    TL_PY=$(TRACELENS_SRC=/path/to/TraceLens bash tests/benchmarks/tracelens_env.sh)
    .venv/bin/python tests/benchmarks/tracelens_crosscheck.py --tracelens-python "$TL_PY" TRACE [TRACE ...]

For every op of OPS that TraceLens models (GEMMs, convolution forward and backward, SDPA forward and
backward, binary elementwise; matched by External id) it compares, per trace and op name: FLOPs
(TraceLens `perf_model.flops()` vs steplens `flops`), bytes, kernel time (TraceLens
`compute_perf_metrics` busy time vs steplens `device_ns`) and achieved TFLOP/s. It prints one
line per trace and, with --details, every op that differs. Definitional differences (see the README):
TraceLens' kernel time is the *busy* time (union of the op's kernel intervals) of the kernels its
tree gives the op; steplens' device_ns is the *summed* duration of the device work launched under
the op (memcpy/memset included), so they differ where an op's kernels overlap on several streams or
where it launched copies.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import polars as pl

from steplens.analyze.pipeline import analyse

OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::convolution",
       "aten::convolution_backward", "aten::_scaled_dot_product_flash_attention",
       "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
       "aten::_scaled_dot_product_flash_attention_backward", "aten::_scaled_dot_product_efficient_attention_backward",
       "aten::add", "aten::mul", "aten::div")

# Run under TraceLens' venv: one JSON line per op of OPS it models.
TRACELENS_SCRIPT = r"""
import json, sys, math, warnings
warnings.filterwarnings("ignore")
from TraceLens import TreePerfAnalyzer
analyzer = TreePerfAnalyzer.from_file(sys.argv[1])
names = set(sys.argv[2].split(","))
for event in analyzer.tree.events:
    if event.get("cat") != "cpu_op" or event.get("name") not in names or "Input Dims" not in event.get("args", {}):
        continue
    try:
        metrics = analyzer.compute_perf_metrics(event)
    except Exception as error:  # TraceLens refuses some shapes/dtypes
        print(json.dumps({"external_id": event["args"].get("External id"), "error": type(error).__name__}))
        continue
    clean = lambda v: None if isinstance(v, float) and math.isnan(v) else v
    print(json.dumps({"external_id": event["args"].get("External id"), "name": event["name"],
                      "gflops": clean(metrics["GFLOPS"]), "kernel_us": clean(metrics["Kernel Time (µs)"]),
                      "tflops": clean(metrics["TFLOPS/s"]), "mb": clean(metrics.get("Data Moved (MB)"))}))
"""


def tracelens_rows(python: str, trace: Path) -> pl.DataFrame:
    done = subprocess.run([python, "-c", TRACELENS_SCRIPT, str(trace), ",".join(OPS)], capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"TraceLens failed on {trace}:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    schema = {"external_id": pl.Int64, "name": pl.String, "gflops": pl.Float64, "kernel_us": pl.Float64,
              "tflops": pl.Float64, "mb": pl.Float64, "error": pl.String}
    return pl.DataFrame(rows, schema=schema) if rows else pl.DataFrame(schema=schema)


def steplens_rows(trace: Path, workdir: Path) -> pl.DataFrame:
    out = workdir / trace.name
    analyse(trace.parent, out, files=[trace], jobs=1)
    return pl.read_parquet(out / "op_perf").filter(pl.col("name").is_in(OPS))


def compare(tracelens: pl.DataFrame, steplens: pl.DataFrame) -> tuple[dict, pl.DataFrame]:
    both = steplens.join(tracelens, on="external_id", how="inner", suffix="_tl")
    both = both.with_columns(tl_flops=pl.col("gflops") * 1e9, tl_ns=pl.col("kernel_us") * 1e3,
                             tl_bytes=pl.col("mb") * 1024 * 1024)
    flops_equal = (pl.col("flops") - pl.col("tl_flops")).abs() <= 1e-9 * pl.col("tl_flops").abs() + 0.5
    time_equal = (pl.col("device_ns") - pl.col("tl_ns")).abs() <= 1  # µs floats from TraceLens: 1 ns of rounding
    bytes_equal = (pl.col("bytes") - pl.col("tl_bytes")).abs() <= 1e-6 * pl.col("tl_bytes").abs() + 0.5
    both = both.with_columns(flops_equal=flops_equal, time_equal=time_equal, bytes_equal=bytes_equal)
    per_op = both.group_by("name").agg(ops=pl.len(), flops_equal=pl.col("flops_equal").fill_null(False).sum(),
                                      bytes_equal=pl.col("bytes_equal").fill_null(False).sum(),
                                      device_time_equal=pl.col("time_equal").fill_null(False).sum()).sort("name")
    summary = {
        "ops_steplens": steplens.height, "ops_tracelens": tracelens.filter(pl.col("error").is_null()).height,
        "tracelens_refused": tracelens.filter(pl.col("error").is_not_null()).height, "matched": both.height,
        "flops_equal": int(both["flops_equal"].fill_null(False).sum()),
        "device_time_equal": int(both["time_equal"].fill_null(False).sum()),
        "per_op": per_op.to_dicts(),
        "tflops_median_ratio": (both.filter(pl.col("tflops") > 0)
                                .select((pl.col("achieved_tflops") / pl.col("tflops")).median()).item()
                                if both.height else None),
    }
    differing = both.filter(~pl.col("flops_equal").fill_null(False) | ~pl.col("time_equal").fill_null(False)).select(
        "external_id", "name", "shapes", "flops", "tl_flops", "bytes", "tl_bytes", "device_ns", "tl_ns")
    return summary, differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tracelens-python", required=True, help="python of the TraceLens venv (tracelens_env.sh)")
    parser.add_argument("--details", action="store_true", help="print every op that differs")
    parser.add_argument("traces", nargs="+", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        for trace in args.traces:
            summary, differing = compare(tracelens_rows(args.tracelens_python, trace), steplens_rows(trace, Path(workdir)))
            print(json.dumps({"trace": str(trace), **summary}))
            if args.details and not differing.is_empty():
                with pl.Config(tbl_rows=50, fmt_str_lengths=60, tbl_width_chars=200):
                    print(differing)


if __name__ == "__main__":
    main()
