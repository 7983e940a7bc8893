"""The verdict: the few findings a reviewer should read first, each a sentence with its numbers."""

from __future__ import annotations

import polars as pl

from .data import Run, ms, size

MAX_FINDINGS = 10


def telemetry_lines(f: dict) -> list[str]:
    """Findings from logs, monitors and autotuning, as sentences (the terminal summary prints them too)."""
    lines = []
    if logged := f.get("logged_comms"):
        busbw = logged["median_busbw_gbps"]
        lines.append(f"logged comms: {logged['op']} of {logged['nccl_bytes']:,} B costs most, {ms(logged['total_latency_ns'])} over "
                     f"{logged['calls']} calls (median {ms(logged['median_latency_ns'])}"
                     + (f", busbw {busbw:.2f} GB/s" if busbw is not None else "")
                     + f"; latencies {logged['latency_origin']}; synchronizing timers: per-op cost, not throughput)")
    if alarms := f.get("monitor_alarms"):
        lines.append("monitor alarms: " + ", ".join(f"{kind} x{n}" for kind, n in alarms.items()) + " (table monitor_alarms)")
    for space in f.get("autotune", []):
        if space["pick_mismatch"]:
            lines.append(f"autotuning {space['tuning_space']}: DeepSpeed's pick disagrees with the experiments' own metrics: "
                         f"{space['pick_detail']}")
        lines.append(f"autotuning {space['tuning_space']}: {space['detail']}")
    return lines


def verdict(run: Run) -> list[str]:
    f, lines = run.findings, []
    status = run.table("run_status")
    if not status.is_empty():
        bad = status.filter(pl.col("status").is_in(["failed", "killed", "incomplete"]))
        for row in bad.head(2).iter_rows(named=True):
            error = f": {row['error']}" if row["error"] else ""
            what = {"failed": "failed", "killed": "was killed", "incomplete": "did not finish"}[row["status"]]
            lines.append(f"The job {what} ({row['source']}{error}).")
    if slow := f.get("slowest_step"):
        lines.append(f"Slowest step: ProfilerStep#{slow['step']} on rank {slow['rank']}, {ms(slow['dur_ns'])} "
                     f"against a median step of {ms(slow['median_step_ns'])}.")
    for s in f.get("stragglers", [])[:2]:
        if s["basis"] == "collective_wait":
            lines.append(f"Straggler: rank {s['rank']} in step {s['step']}; the other ranks waited "
                         f"{ms(s['others_waited_ns'])} in total for it in collectives.")
        else:
            lines.append(f"Straggler: rank {s['rank']} in step {s['step']}, {ms(s['spread_ns'])} longer than the fastest "
                         "rank (no collective timing in the traces shows who waited).")
    idle = f.get("gpu_idle") or {}
    if idle.get("idle_share") is not None:
        cause = {"host_bound": "host-bound: the GPU waited for the CPU to launch work",
                 "sync": "synchronization: the CPU waited on the GPU", "other": "cross-stream waits or unrecorded launches"}
        lines.append(f"The GPU was idle {idle['idle_share']:.1%} of step time; main cause "
                     f"{cause.get(idle.get('main_cause'), 'none')}.")
    if top := f.get("most_exposed_collective"):
        bandwidth = f" at a median busbw of {top['busbw_gbps']:.1f} GB/s" if top.get("busbw_gbps") is not None else ""
        lines.append(f"Most exposed communication: {top['op']} of {size(top.get('bytes'))}, {ms(top['exposed_ns'])} not "
                     f"hidden behind compute over {top['calls']} calls{bandwidth}.")
    utilization = f.get("mfu")
    if isinstance(utilization, list):
        for row in utilization:
            lines.append(f"{row['metric']} {row['utilization']:.1%} (median over steps; numerator {row['numerator']}, "
                         f"peak {row['peak']}).")
    lines.extend(line[0].upper() + line[1:] + ("" if line.endswith(".") else ".") for line in telemetry_lines(f))
    issues = run.table("ingest_issues")
    if not issues.is_empty() and (errors := issues.filter(pl.col("severity") == "error")).height:
        lines.append(f"{errors.height} input problem(s) lost data (see Ingest issues); numbers cover what was readable.")
    if not lines:
        lines.append("Nothing stands out: no step boundaries, device activity or collectives to judge.")
    return lines[:MAX_FINDINGS]
