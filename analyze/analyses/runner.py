"""Run every analysis over a run directory's tables and write each result as its own Parquet table.

Each analysis module is a pure function from tables to tables; this module only reads the inputs
(the columns they need), calls them in dependency order, writes the results and collects the
headline findings the terminal summary and the report show.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

from steplens.analyze.analyses import (REGISTERED, alarm_agreement, autotune, comms, comms_log, job_end, kernels, launch,
                                       log_mfu, mfu, module_perf, monitor, op_perf, registry, roofline, sanity,
                                       step_breakdown, step_time, steps, summaries)
from steplens.analyze.analyses.registry import Inputs
from steplens.analyze.contract import schema

# Columns each slice of trace_events needs; read with the filter pushed into the Parquet scan.
DEVICE_COLUMNS = ["source", "event_id", "ts_ns", "dur_ns", "kind", "name", "stream", "device", "correlation", "step",
                  "launch_event_id", "collective", "in_nelems", "out_nelems", "dtype", "group_size", "group_name", "seq"]
CALL_COLUMNS = ["source", "event_id", "ts_ns", "dur_ns", "name", "pid", "tid"]
CPU_COLUMNS = ["source", "ts_ns", "dur_ns", "kind", "name", "pid", "tid", "step", "collective", "flops"]
CPU_KINDS = ["cpu_op", "user_annotation", "python_function"]
PER_RANK_TABLES = ("kernel_launches", "op_perf")  # written rank by rank as part-<rank>


@dataclass
class Options:
    dtype: str = "bf16"
    peak_tflops: float | None = None
    shape: mfu.ModelShape | None = None
    recompute: bool = False
    kernel_categories: list = field(default_factory=lambda: list(kernels.KERNEL_CATEGORIES))
    grad_norm_threshold: float | None = None


def _read(out_dir: Path, table: str, columns: list[str], where: pl.Expr | None = None) -> pl.DataFrame:
    if not (out_dir / table).exists():  # a run with no traces has no per-rank tables
        empty = pl.from_arrow(schema.TABLES[table][0].empty_table())
        return empty.with_columns(rank=pl.lit(None, pl.Int64)).select(["rank"] + columns)
    frame = pl.scan_parquet(out_dir / table, hive_partitioning=True)
    if where is not None:
        frame = frame.filter(where)
    return frame.select(["rank"] + columns).collect()


def _write(out_dir: Path, table: str, frame: pl.DataFrame, part: str = "part-0") -> None:
    folder = out_dir / table
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{part}.parquet.tmp"
    declared = schema.analysis_schema(table)
    missing = [c for c in declared.names if c not in frame.columns]
    if missing and not frame.is_empty():
        raise KeyError(f"analysis table {table} lacks columns {missing}")
    # Every table is written with its declared types (an analysis with nothing to say: empty, typed, so
    # SQL over it works); a value that does not fit its type (3.5 in an int64 column) raises here.
    arrow = declared.empty_table() if missing else frame.select(declared.names).to_arrow().cast(declared)
    pq.write_table(arrow, tmp, compression="zstd", compression_level=1)
    tmp.replace(folder / f"{part}.parquet")


@dataclass
class _RankResults:
    """What one rank contributes: per-rank tables, and the small pieces the cross-rank analyses need."""

    calls: pl.DataFrame
    idle: pl.DataFrame
    launch_summary: pl.DataFrame
    sync_points: pl.DataFrame
    categories: pl.DataFrame
    kernel_totals: pl.DataFrame
    gpu_spans: pl.DataFrame
    flops: pl.DataFrame
    cpu_comm_ops: int
    op_totals: pl.DataFrame = field(default_factory=pl.DataFrame)  # op_perf per name and shapes (the rows are written per rank)
    modules: pl.DataFrame = field(default_factory=pl.DataFrame)
    family_time: pl.DataFrame = field(default_factory=pl.DataFrame)  # device time by the innermost op's family


def _analyse_rank(out_dir: Path, rank: int, world_size: int, options: Options, roof: op_perf.Roof | None = None
                  ) -> _RankResults:
    """The per-rank analyses, reading only this rank's partition (memory does not grow with ranks)."""
    this_rank, kind = pl.col("rank") == rank, pl.col("kind")
    device = _read(out_dir, "trace_events", DEVICE_COLUMNS, this_rank & kind.is_in(launch.WORK_KINDS))
    runtime = _read(out_dir, "trace_events", CALL_COLUMNS, this_rank & kind.is_in(["cuda_runtime", "cuda_driver"]))
    cpu = _read(out_dir, "trace_events", CPU_COLUMNS, this_rank & kind.is_in(CPU_KINDS))
    work = kernels.device_work(device, options.kernel_categories)
    threads = launch.cpu_threads(cpu)
    launched = launch.kernel_launches(device, runtime)
    _write(out_dir, "kernel_launches", launched, part=f"part-{rank}")
    ops = _read(out_dir, "trace_events", op_perf.OP_COLUMNS, this_rank & kind.is_in(CPU_KINDS) & pl.col("input_dims").is_not_null())
    perf = op_perf.op_perf(ops, launched, roof or op_perf.Roof())
    _write(out_dir, "op_perf", perf, part=f"part-{rank}")
    modules = _read(out_dir, "trace_events", module_perf.MODULE_COLUMNS,
                    this_rank & kind.is_in(CPU_KINDS) & pl.col("name").str.starts_with(module_perf.MODULE_PREFIX))
    links = _read(out_dir, "flows", ["source", "src_event_id", "dst_event_id"], this_rank & (pl.col("flow_type") == "fwdbwd"))
    linked = _read(out_dir, "trace_events", module_perf.LINKED_COLUMNS, this_rank & pl.col("event_id").is_in(
        pl.concat([links["src_event_id"], links["dst_event_id"]]).unique().implode())) if not modules.is_empty() else pl.DataFrame()
    gaps = launch.idle_gaps(launched, runtime)
    return _RankResults(
        calls=comms.with_call_sites(comms.collectives(work, world_size), runtime, threads),
        idle=launch.gpu_idle(launched, gaps),
        launch_summary=launch.launch_summary(launched),
        sync_points=launch.sync_points(gaps, runtime, threads),
        categories=kernels.category_time(work),
        kernel_totals=kernels.kernel_totals(work),
        gpu_spans=steps.gpu_spans(work),
        flops=mfu.step_flops(cpu),
        # record_param_comms (NCCL builds) or the c10d ops themselves (gloo/CPU runs record no comms args)
        cpu_comm_ops=cpu.filter((pl.col("name") == "record_param_comms") | pl.col("collective").is_not_null()
                                | pl.col("name").str.starts_with("c10d::")).height,
        op_totals=op_perf.op_totals(perf),
        family_time=op_perf.family_time(cpu, launched),
        modules=module_perf.module_perf(modules, ops, perf, launched, module_perf.backward_points(links, linked, launched)),
    )


def run(out_dir: Path, options: Options | None = None) -> dict:
    """All analyses over out_dir; returns the headline findings (also written to findings.json).

    Ranks are analysed one at a time; only small per-rank results (collective calls, step spans,
    totals) are kept for the cross-rank analyses, so memory is bounded by the largest rank."""
    options = options or Options()
    manifest = json.loads((out_dir / schema.MANIFEST_FILE).read_text())
    ranks = manifest["trace_ranks"]
    world_size = manifest.get("world_size") or len(ranks)
    for table in schema.ANALYSIS_TABLES:
        shutil.rmtree(out_dir / table, ignore_errors=True)
    device_name, num_sms = _device(manifest)
    roof = op_perf.device_roof(device_name, num_sms)
    per_rank = [_analyse_rank(out_dir, rank, world_size, options, roof) for rank in ranks]
    peak, peak_problem = mfu.peak_for(device_name, options.dtype, num_sms, options.peak_tflops)
    if ranks:
        tables = _cross_rank(out_dir, per_rank, ranks, world_size, peak, options)
        launches = pl.scan_parquet(out_dir / "kernel_launches")
        tables.update(step_breakdown.step_breakdown_tables(
            lambda rank: launches.filter(pl.col("rank") == rank).select(step_breakdown.LAUNCH_COLUMNS).collect(), ranks,
            tables["collectives"], tables["gpu_idle"], tables["step_stats"], tables["clock_offsets"]))
    else:  # logs, monitors or autotuning only: the trace analyses are empty tables
        tables = {name: pl.DataFrame(schema={c: pl.Null for c in columns})
                  for name, columns in schema.ANALYSIS_TABLES.items() if name not in PER_RANK_TABLES}
    facts = manifest.get("facts", {})
    if facts.get("world_size") is None and manifest.get("world_size"):  # traces alone give it (distributedInfo)
        facts = {**facts, "world_size": manifest["world_size"]}
    tables.update(_telemetry_analyses(out_dir, facts, options))
    tables.update(summaries.summary_tables(tables["collectives"], tables["kernel_categories"], _run_table(out_dir, "scalars")))
    profiler_steps = _read(out_dir, "steps", ["step", "start_ns", "end_ns"])
    tables["step_time"] = step_time.step_time_table(
        _run_table(out_dir, "train_steps"), _run_table(out_dir, "step_timers"), _run_table(out_dir, "scalars"),
        profiler_steps, _run_table(out_dir, "flops_profile"), facts)
    run_rows, mfu_problem = mfu.step_time_mfu(tables["step_time"], _run_table(out_dir, "flops_profile"), facts,
                                                          peak, world_size or facts.get("world_size") or 1, options.shape,
                                                          options.recompute)
    if not run_rows.is_empty():
        tables["mfu"] = pl.concat([tables["mfu"], run_rows], how="diagonal_relaxed")
    log_rows, log_problem = log_mfu.megatron_mfu(tables["step_time"], facts, peak, world_size or facts.get("world_size") or 1)
    if not log_rows.is_empty():  # a logs-only Megatron run: the shape from its arguments
        tables["mfu"] = pl.concat([tables["mfu"], log_rows], how="diagonal_relaxed")
    mfu_problem = mfu_problem or log_problem
    tables["module_perf"] = pl.concat([r.modules for r in per_rank], how="diagonal_relaxed") if ranks \
        else pl.DataFrame(schema=module_perf.COLUMNS)
    tables["module_mfu"] = module_perf.module_mfu(tables["module_perf"], _run_table(out_dir, "flops_profile"), facts, roof,
                                                  options.dtype)
    for name, frame in tables.items():
        _write(out_dir, name, frame)
    if not ranks:
        for table in PER_RANK_TABLES:
            _write(out_dir, table, pl.DataFrame())
    findings = headline(tables, sum(r.cpu_comm_ops for r in per_rank), mfu_problem or peak_problem, device_name) \
        if ranks \
        else {"device": None, "traces": "no profiler traces: step, GPU and collective analyses need them",
              "mfu": mfu_finding(tables["mfu"], mfu_problem or peak_problem)}
    findings["step_time"] = step_time.step_time_summary(tables["step_time"])
    # The slowest step over the whole run (not only the profiled ones), and only when it stands out.
    if slow := step_time.slowest_step(tables["step_time"]):
        findings["slowest_step"] = slow
    if windows := step_time.profiled_windows(tables["step_time"], profiler_steps):
        findings["profiled_steps"] = windows
    if overflow := step_time.overflow_finding(tables["step_time"], _run_table(out_dir, "scalars")):
        findings["fp16_overflow"] = overflow
    if ended := job_end.job_end(_run_table(out_dir, "run_status"), _run_table(out_dir, "train_steps"),
                                _run_table(out_dir, "step_timers"), _run_table(out_dir, "scalars"), facts,
                                findings["step_time"].get("median_ns")):
        findings["job_end"] = ended
    findings.update(telemetry_headline(tables))
    op_totals = pl.concat([r.op_totals for r in per_rank], how="diagonal_relaxed") if ranks else pl.DataFrame()
    findings["roofline"] = roofline.roofline_finding(op_totals, tables["module_perf"], tables["module_mfu"], roof, options.dtype,
                                                     pl.concat([r.family_time for r in per_rank], how="diagonal_relaxed")
                                                     if ranks else pl.DataFrame())
    device_key = mfu.match_device(device_name, num_sms) if device_name else None
    if disagree := sanity.inputs_disagree(findings, tables["step_time"], device_key):
        findings["inputs_disagree"] = disagree
    findings.update(run_registered(out_dir, facts, options, ranks, tables))
    issues = _run_table(out_dir, "ingest_issues")
    if not issues.is_empty() and (errors := issues.filter(pl.col("severity") == "error").height):
        findings["ingest_errors"] = errors  # input problems that lost data
    (out_dir / "findings.json").write_text(json.dumps(findings, indent=1, default=str))
    return findings


def run_registered(out_dir: Path, facts: dict, options: Options, ranks: list[int], computed: dict[str, pl.DataFrame]
                   ) -> dict:
    """The registered analyses, in dependency order: each output table written typed, each finding
    kept under the analysis's name."""
    findings = {}
    inputs = Inputs(out_dir, facts, options, ranks, computed=dict(computed))
    for analysis in registry.ordered(REGISTERED):
        result = analysis.compute(inputs)
        for table, spec in analysis.writes.items():
            frame = registry.conformed(result.tables.get(table, pl.DataFrame()), spec, table)
            inputs.computed[table] = frame
            shutil.rmtree(out_dir / table, ignore_errors=True)
            (out_dir / table).mkdir(parents=True)
            frame.write_parquet(out_dir / table / "part-0.parquet", compression="zstd", compression_level=1)
        if result.finding is not None:
            findings[analysis.name] = result.finding
    return findings


def _cross_rank(out_dir: Path, per_rank: list[_RankResults], ranks: list[int], world_size: int, peak, options: Options
                ) -> dict[str, pl.DataFrame]:
    """The analyses that need every rank's small results: alignment, stragglers, collectives, MFU."""

    def gather(field: str) -> pl.DataFrame:
        return pl.concat([getattr(r, field) for r in per_rank], how="diagonal_relaxed")

    step_windows = _read(out_dir, "steps", ["step", "start_ns", "end_ns"])
    calls = gather("calls")
    offsets = steps.clock_offsets(calls, ranks)
    times = steps.step_times(step_windows, gather("gpu_spans"), steps.collective_waits(calls), offsets)
    stats = steps.step_stats(times)
    return {
        "clock_offsets": offsets,
        "step_times": times,
        "step_stats": stats,
        "collectives": calls,
        "collective_instances": comms.instances(calls, offsets),
        "launch_summary": gather("launch_summary"),
        "gpu_idle": gather("idle"),
        "sync_points": gather("sync_points").sort("idle_caused_ns", descending=True).head(launch.SYNC_POINTS),
        "kernel_categories": gather("categories"),
        "top_kernels": kernels.top_kernels(gather("kernel_totals")),
        "mfu": mfu.profiler_hfu(times, gather("flops"), peak),
    }


def _run_table(out_dir: Path, table: str) -> pl.DataFrame:
    return pl.read_parquet(out_dir / table) if (out_dir / table).exists() else pl.DataFrame()


def _telemetry_analyses(out_dir: Path, facts: dict, options: Options) -> dict[str, pl.DataFrame]:
    """Analyses of the collector's and the native artifacts' tables (run-level, always present after ingest)."""

    calls = _run_table(out_dir, "comms_calls")
    scalars = _run_table(out_dir, "scalars")
    return {
        **monitor.monitor_tables(scalars, facts, options.grad_norm_threshold),
        "alarm_agreement": alarm_agreement.alarm_agreement(_run_table(out_dir, "alarms"), scalars,
                                                           _run_table(out_dir, "train_steps"), calls, facts),
        **autotune.autotune_tables(_run_table(out_dir, "autotune_experiments"), facts),
        "comms_log_stats": comms_log.comms_log_stats(calls) if not calls.is_empty() else pl.DataFrame(),
    }


def _device(manifest: dict) -> tuple[str | None, int | None]:
    """The run's GPU model. Kineto lists every GPU of the node; a mixed node has no single peak."""
    env = manifest.get("environment", {})
    names, sms = env.get("device_names") or [], env.get("device_sms") or []
    if len(names) != 1:
        return None, None
    return names[0], sms[0] if len(sms) == 1 else None


def headline(tables: dict[str, pl.DataFrame], cpu_comm_ops: int, peak_problem: str, device_name: str | None) -> dict:
    """The few numbers a user came for, each with what it means."""
    findings: dict = {"device": device_name}
    stats = tables["step_stats"]
    if not stats.is_empty():
        stragglers = stats.filter(pl.col("straggler_rank").is_not_null())
        # Without collective waits (gloo/CPU runs, or no NCCL kernels) the straggler is the longest CPU step.
        basis = "collective_wait" if stats["others_waited_ns"].fill_null(0).sum() > 0 else "step_spread"
        findings["stragglers"] = [
            {"step": s, "rank": r, "others_waited_ns": w, "spread_ns": d, "basis": basis, "decided_by": how}
            for s, r, w, d, how in
            stragglers.select("step", "straggler_rank", "others_waited_ns", "spread_ns", "straggler_basis").iter_rows()]
    findings["gpu_idle"] = idle_finding(tables["gpu_idle"])
    calls = tables["collectives"]
    if not calls.is_empty():
        findings.update(exposed_comm_finding(calls))
    else:
        findings["most_exposed_collective"] = None
        findings["comms_note"] = (
            f"communication without NCCL/RCCL kernels: {cpu_comm_ops} CPU collective ops (gloo or CPU collectives: record_param_comms or c10d::*)"
            if cpu_comm_ops else "no collectives in the traces")
    findings["mfu"] = mfu_finding(tables["mfu"], peak_problem)
    return findings


def idle_finding(idle: pl.DataFrame) -> dict:
    """Device idle share over the whole profiled windows (the whole-window rows of gpu_idle)."""
    windows = idle.filter((pl.col("stream") == launch.ALL_STREAMS) & pl.col("step").is_null())
    if windows.is_empty():
        return {"idle_share": None, "note": "no device activity in the traces (CPU-only or no kernels)"}
    totals = windows.select(pl.col("span_ns", "idle_ns", "host_bound_ns", "sync_ns", "other_ns").sum()).row(0, named=True)
    causes = {c: totals[f"{c}_ns"] for c in launch.CAUSES}
    return {
        "idle_share": totals["idle_ns"] / totals["span_ns"] if totals["span_ns"] else None,
        "main_cause": max(causes, key=causes.get) if totals["idle_ns"] else None,
        **{f"{c}_ns": v for c, v in causes.items()},
        "definition": "time no stream of the device was busy (every step's work and work launched before the window "
                      "included), over the span from the first to the last device activity of each profiler window; "
                      "summed over ranks, devices and windows",
    }


def exposed_comm_finding(calls: pl.DataFrame) -> dict:
    """Exposed communication of the rank with the most (summing over ranks could exceed the run's wall time)."""
    per_rank = calls.group_by("rank").agg(exposed_ns=pl.col("exposed_ns").sum()).sort("exposed_ns", "rank", descending=[True, False])
    worst_rank = per_rank.row(0, named=True)
    worst = (calls.filter(pl.col("rank") == worst_rank["rank"])
             .group_by("op", "bytes").agg(exposed_ns=pl.col("exposed_ns").sum(), calls=pl.len(),
                                          busbw_gbps=pl.col("busbw_gbps").median())
             .sort("exposed_ns", "calls", descending=True))
    return {
        "most_exposed_collective": {**worst.row(0, named=True), "rank": worst_rank["rank"]},
        "exposed_comm_ns": int(worst_rank["exposed_ns"]),
        "exposed_comm_rank": worst_rank["rank"],
        "exposed_comm_median_rank_ns": int(per_rank["exposed_ns"].median()),
        "exposed_comm_definition": "communication kernel time not overlapped by compute kernels on another stream of the "
                                   "same device, on the rank with the most (exposed_comm_rank); never summed over ranks",
    }


def mfu_finding(table: pl.DataFrame, problem: str) -> list[dict] | dict:
    """Median utilization per metric and numerator, or why there is none."""
    if table.is_empty():
        return {"note": problem or "no FLOPs numerator: give the model shape (--params ...), profile with_flops=True, "
                                   "or let the collector take a FLOPs profile"}
    summary = table.group_by("metric", "numerator", "definition", "peak").agg(
        utilization=pl.col("utilization").median()).sort("metric", "numerator", descending=[True, False])
    return summary.to_dicts()


def telemetry_headline(tables: dict[str, pl.DataFrame]) -> dict:
    """Findings from logs, monitors and autotuning: alarms by kind, autotuning verdicts, the slowest
    logged collective."""
    findings: dict = {}
    alarms = tables["monitor_alarms"]
    if not alarms.is_empty():
        findings["monitor_alarms"] = dict(alarms.group_by("alarm").len().sort("alarm").iter_rows())
    if "alarm_agreement" in tables and not tables["alarm_agreement"].is_empty():  # in-job alarms and their replay
        findings["alarms"] = alarm_agreement.agreement_summary(tables["alarm_agreement"])
    verdicts = tables["autotune_verdict"]
    if not verdicts.is_empty():
        findings["autotune"] = verdicts.select("tuning_space", "winner", "established", "trials_needed", "pick_mismatch",
                                               "pick_detail", "detail").to_dicts()
    stats = tables["comms_log_stats"]
    if not stats.is_empty():
        top = stats.sort("total_latency_ns", descending=True).row(0, named=True)
        findings["logged_comms"] = {k: top[k] for k in ("op", "nccl_bytes", "calls", "median_latency_ns", "total_latency_ns",
                                                         "median_busbw_gbps", "latency_origin")}
    return findings
