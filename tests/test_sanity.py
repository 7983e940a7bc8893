"""Impossible numbers are never printed as results: they become `inputs_disagree` findings.

Real inputs: the bundled 2-rank DeepSpeed run analysed with a peak far below the CPU's, and a copy of
the 40-step real run whose collector part is edited as an NTP step of the wall clock would leave it.
Expected values are recomputed from the raw Parquet parts and manifests with pyarrow and statistics.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from steplens.analyze.analyses import sanity
from steplens.reports import data, verdict
from test_step_time import collector_step_times

SAMPLE = Path(__file__).resolve().parents[1] / "sample_runs" / "deepspeed_cpu_2rank"


def analyse(run_dir: Path, *options: str) -> tuple[dict, list[str], str]:
    out = run_dir.parent / "out"
    done = subprocess.run([sys.executable, "-m", "steplens.analyze", str(run_dir), "--out", str(out), *options],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode in (0, 1), done.stderr[-3000:]
    run = data.load(out)
    return run.findings, verdict.verdict(run), done.stdout


def test_mfu_above_100_percent_becomes_a_disagreement(tmp_path):
    shutil.copytree(SAMPLE, tmp_path / "run", ignore=shutil.ignore_patterns(".steplens"))
    peak_tflops = 1e-4  # far below what the job did: every MFU figure is above 100% (and below 1e4x, shown in %)
    findings, lines, stdout = analyse(tmp_path / "run", "--peak-tflops", str(peak_tflops))
    manifest = json.loads((SAMPLE / "collector" / "manifest" / "rank0.json").read_text())["run"]
    forward = next(r["flops_total"] for r in pq.read_table(SAMPLE / "collector" / "flops_profile").to_pylist()
                   if r["path"] == "")
    flops = 3 * forward * manifest["grad_accum"] * manifest["dp_world_size"]
    times = collector_step_times(SAMPLE)  # each step's cycle, start to the next start (None: the last)
    profile, flops_step = manifest["settings"]["profile"], manifest["settings"]["flops_step"]
    window = profile["skip_first"] + profile["wait"]
    instrumented = {flops_step, *range(window, window + profile["warmup"] + profile["active"] + 1)}
    median = statistics.median(flops / (t * 1e-9 * manifest["world_size"] * peak_tflops * 1e12)
                               for s, t in times.items() if s not in instrumented and t is not None)
    assert median > 1
    # every numerator's figure is above 100% (the traces' op shapes give one too); the collector's is checked here
    [entry] = [e for e in findings["inputs_disagree"] if "collector_flops_profile" in e["detail"]]
    assert entry["check"] == "mfu_above_100" and math.isclose(entry["value"], median, rel_tol=1e-9)
    assert {e["check"] for e in findings["inputs_disagree"]} == {"mfu_above_100"}
    assert not isinstance(findings["mfu"], list)  # no MFU figure left to print as a result
    # the table says the same as the finding: the rows keep their inputs, the impossible figure is null, the reason named
    rows = [r for r in pq.read_table(tmp_path / "out" / "mfu").to_pylist() if r["numerator"] == "collector_flops_profile"]
    assert rows and all(r["utilization"] is None and r["inputs_disagree"] == entry["detail"] for r in rows)
    assert math.isclose(statistics.median(r["flops"] / (r["step_time_ns"] * 1e-9 * r["gpus"] * r["peak_flops"])
                                          for r in rows if r["metric"] == "MFU"), median, rel_tol=1e-9)
    assert f"Inputs disagree: MFU {median:.1%} (numerator collector_flops_profile) is above 100%" in "\n".join(lines)
    assert not any(line.startswith("MFU ") for line in lines)
    assert "Inputs disagree: MFU" in stdout and "MFU: " not in stdout.replace("MFU: not", "")


def test_clock_stepped_back_is_left_out_and_named(ds_steady_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ds_steady_run / "collector", run / "collector")
    bad_step, bad_rank = 20, 1
    for part in sorted((run / "collector" / "train_steps").glob(f"rank{bad_rank}-*.parquet")):
        table = pq.read_table(part)
        rows = table.to_pylist()
        for row in rows:
            if row["step"] == bad_step:  # the wall clock stepped back 5 ms during the micro step
                row["end_ns"] = row["start_ns"] - 5_000_000
                row["dur_ns"] = row["end_ns"] - row["start_ns"]
        pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), part)
    findings, lines, _ = analyse(run)
    times = collector_step_times(run)  # the step's cycle: its start to the next step's, slowest rank
    [entry] = findings["inputs_disagree"]
    assert entry["check"] == "negative_duration" and entry["steps"] == [bad_step]
    assert entry["value"] == times[bad_step]  # the cycle is positive; a micro step in it ended before it started
    excluded = {e["reason"]: e["steps"] for e in findings["step_time"]["excluded_steps"]}
    assert excluded["negative_duration"] == [bad_step]
    assert findings["step_time"]["steps"] == len(times) - sum(len(v) for v in excluded.values())
    assert any(line.startswith(f"Inputs disagree: 1 step(s) with an impossible time: step {bad_step} ends before it "
                               "starts") for line in lines)


def test_bandwidth_above_the_link_is_taken_out():
    """Hand-made findings: 1,200 GB/s on an H100 SXM (900 GB/s of NVLink in both directions together)."""
    findings = {"collectives": {"most_exposed_collective": {"op": "allreduce", "busbw_gbps": 1200.0, "bytes": 1 << 30}},
                "comms_log": {"op": "all_reduce", "median_busbw_gbps": 300.0}}
    [entry] = sanity.inputs_disagree(findings, pl.DataFrame(), pl.DataFrame(), "h100-sxm")
    assert (entry["check"], entry["value"], entry["bound"]) == ("bandwidth_above_link", 1200.0, 900.0)
    assert findings["collectives"]["most_exposed_collective"]["busbw_gbps"] is None
    assert findings["comms_log"]["median_busbw_gbps"] == 300.0  # possible: kept
