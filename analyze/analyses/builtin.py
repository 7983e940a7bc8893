"""The built-in analyses, declared: what each reads, which tables it writes (documented and typed in
the contract, schema.ANALYSIS_TABLES) and which findings.json keys it contributes. The computations
are the pure functions of the modules named; each `compute` here only reads its inputs and calls them.

`device_timeline` is the one per-rank analysis over the traces: it reads a rank's events once and
leaves small per-rank results (names starting with `_`) for the run-level analyses, so memory is
bounded by the largest rank.
"""

from __future__ import annotations

import polars as pl

from steplens.analyze.analyses import (alarm_agreement, autotune, caveats, comms, comms_log, job_end, kernels, launch, log_mfu,
                                       mfu, module_perf, monitor, op_perf, roofline, sanity, step_breakdown, step_time,
                                       steps, summaries)
from steplens.analyze.analyses.registry import Analysis, Inputs, Output, declared
from steplens.analyze.contract.schema import WORK_KINDS

# Columns each slice of trace_events needs; read with the filter pushed into the Parquet scan.
DEVICE_COLUMNS = ["source", "event_id", "ts_ns", "dur_ns", "kind", "name", "stream", "device", "correlation", "step",
                  "launch_event_id", "collective", "in_nelems", "out_nelems", "dtype", "group_size", "group_name", "seq"]
CALL_COLUMNS = ["source", "event_id", "ts_ns", "dur_ns", "name", "pid", "tid", "step"]
CPU_COLUMNS = ["source", "ts_ns", "dur_ns", "kind", "name", "pid", "tid", "step", "collective", "flops"]
CPU_KINDS = ["cpu_op", "user_annotation", "python_function"]
RUNTIME_KINDS = ["cuda_runtime", "cuda_driver"]
NO_TRACES = "no profiler traces: step, GPU and collective analyses need them"


def _events(inputs: Inputs, columns: list[str], where: pl.Expr) -> pl.DataFrame:
    return inputs.table("trace_events", ["rank"] + columns, where)


def _slices(inputs: Inputs) -> dict[str, pl.DataFrame]:
    """The batch's device work, runtime calls, CPU ops, ops with shapes and module spans, in trace order.

    Read from Parquet in one scan and split in memory: five scans of the same files cost four times
    as much (84 ms against 20 ms for one real 35 MB A100 rank)."""
    kind = pl.col("kind")
    cpu_kind = kind.is_in(CPU_KINDS)
    wanted = {
        "device": (DEVICE_COLUMNS, kind.is_in(WORK_KINDS)),
        "runtime": (CALL_COLUMNS, kind.is_in(RUNTIME_KINDS)),
        "cpu": (CPU_COLUMNS, cpu_kind),
        "ops": (op_perf.OP_COLUMNS, cpu_kind & pl.col("input_dims").is_not_null()),
        "modules": (module_perf.MODULE_COLUMNS, cpu_kind & pl.col("name").str.starts_with(module_perf.MODULE_PREFIX)),
    }
    columns = list(dict.fromkeys(c for names, _ in wanted.values() for c in names))
    events = _events(inputs, columns, kind.is_in([*WORK_KINDS, *RUNTIME_KINDS, *CPU_KINDS]))
    # lazily, so that each filter moves only the columns its slice keeps
    return {name: events.lazy().filter(where).select(["rank"] + names).collect() for name, (names, where) in wanted.items()}


def device_timeline(inputs: Inputs) -> Output:
    """A batch of ranks: kernel launches, idle and its causes, op and module performance, and the small
    results the run-level analyses need, each keyed by rank (and source)."""
    context = inputs.context
    sliced = _slices(inputs)
    device, runtime, cpu, ops, modules = (sliced[name] for name in ("device", "runtime", "cpu", "ops", "modules"))
    work = kernels.device_work(device, inputs.options.kernel_categories)
    threads = launch.cpu_threads(cpu)
    launched = launch.kernel_launches(device, runtime)
    perf = op_perf.op_perf(ops, launched, context.roof)
    links = inputs.table("flows", ["rank", "source", "src_event_id", "dst_event_id"], pl.col("flow_type") == "fwdbwd")
    linked = _events(inputs, module_perf.LINKED_COLUMNS, pl.col("event_id").is_in(
        pl.concat([links["src_event_id"], links["dst_event_id"]]).unique().implode())) if not modules.is_empty() \
        else pl.DataFrame()
    gaps = launch.idle_gaps(launched, runtime)
    heavy = launched.join(work.filter(pl.col("category").is_in(module_perf.FLOPS_HEAVY_FAMILIES)).select("source", "event_id"),
                          on=["source", "event_id"], how="semi") if not modules.is_empty() else launched.clear()
    # record_param_comms (NCCL builds) or the c10d ops themselves (gloo/CPU runs record no comms args)
    cpu_comm_ops = cpu.filter((pl.col("name") == "record_param_comms") | pl.col("collective").is_not_null()
                              | pl.col("name").str.starts_with("c10d::")).group_by("rank").agg(ops=pl.len())
    return Output(tables={
        "kernel_launches": launched,
        "op_perf": perf,
        "gpu_idle": launch.gpu_idle(launched, gaps),
        "launch_summary": launch.launch_summary(launched),
        "kernel_categories": kernels.category_time(work),
        "_collective_calls": comms.with_call_sites(comms.collectives(work, context.world_size), runtime, threads),
        "_sync_points": launch.sync_points(gaps, runtime, threads),
        "_kernel_totals": kernels.kernel_totals(work),
        "_gpu_spans": steps.gpu_spans(work),
        "_step_flops": mfu.step_flops(cpu),
        # executed FLOPs from shapes per rank and profiled step: the outermost ops with a FLOPs formula
        "_trace_step_flops": perf.filter(~pl.col("nested") & pl.col("flops").is_not_null() & pl.col("step").is_not_null())
        .group_by("rank", "step").agg(flops=pl.col("flops").sum()),
        "_cpu_comm_ops": cpu_comm_ops,
        "_op_totals": op_perf.op_totals(perf),
        "_family_time": op_perf.family_time(cpu, launched),
        "_module_rows": module_perf.module_perf(modules, ops, perf, launched,
                                               module_perf.backward_points(links, linked, launched), heavy),
    })


def _steps(inputs: Inputs) -> Output:
    if not inputs.ranks:
        return Output()
    calls = inputs.table("_collective_calls")
    profiled = inputs.table("steps", ["rank", "step", "start_ns", "end_ns"])
    offsets = steps.clock_offsets(calls, inputs.ranks, inputs.context.world_size_of_rank if inputs.context else {}, profiled)
    times = steps.step_times(profiled, inputs.table("_gpu_spans"), steps.collective_waits(calls), offsets)
    refused = steps.refused_alignment(offsets)
    stats = steps.step_stats(times, judge_stragglers=not refused)
    return Output(tables={"clock_offsets": offsets, "step_times": times, "step_stats": stats},
                  findings={**steps.straggler_finding(stats), **refused})


def _collectives(inputs: Inputs) -> Output:
    if not inputs.ranks:
        return Output()
    calls = inputs.table("_collective_calls")
    cpu_comm_ops = inputs.table("_cpu_comm_ops")["ops"].sum()
    return Output(tables={"collectives": calls, "collective_instances": comms.instances(calls, inputs.table("clock_offsets"))},
                  findings=comms.exposed_comm_finding(calls, cpu_comm_ops, inputs.context.backend,
                                                      inputs.facts.get("world_size")))


def _idle(inputs: Inputs) -> Output:
    if not inputs.ranks:
        return Output(findings={"traces": NO_TRACES})
    sync_points = inputs.table("_sync_points")
    return Output(tables={"sync_points": sync_points.sort("idle_caused_ns", descending=True).head(launch.SYNC_POINTS)},
                  findings={"gpu_idle": launch.idle_finding(inputs.table("gpu_idle"),
                                                            inputs.context.runtime_calls if inputs.context else 0)})


def _top_kernels(inputs: Inputs) -> Output:
    return Output(tables={"top_kernels": kernels.top_kernels(inputs.table("_kernel_totals"))} if inputs.ranks else {})


def _step_breakdown(inputs: Inputs) -> Output:
    if not inputs.ranks:
        return Output()
    launches = pl.scan_parquet(inputs.out_dir / "kernel_launches")
    tables = step_breakdown.step_breakdown_tables(
        lambda rank: launches.filter(pl.col("rank") == rank).select(step_breakdown.LAUNCH_COLUMNS).collect(), inputs.ranks,
        inputs.table("collectives"), inputs.table("gpu_idle"), inputs.table("step_stats"), inputs.table("clock_offsets"))
    return Output(tables=tables, findings={"time_split": step_breakdown.time_split(tables["step_breakdown"])})


def _step_time(inputs: Inputs) -> Output:
    profiler_steps = inputs.table("steps", ["rank", "step", "start_ns", "end_ns"])
    table = step_time.step_time_table(inputs.table("train_steps"), inputs.table("step_timers"), inputs.table("scalars"),
                                      profiler_steps, inputs.table("flops_profile"), inputs.facts)
    findings = {"step_time": step_time.step_time_summary(table)}
    # The slowest step over the whole run (not only the profiled ones), and only when it stands out.
    if slow := step_time.slowest_step(table):
        findings["slowest_step"] = slow
    if windows := step_time.profiled_windows(table, profiler_steps):
        findings["profiled_steps"] = windows
    if overflow := step_time.overflow_finding(table, inputs.table("scalars")):
        findings["fp16_overflow"] = overflow
    return Output(tables={"step_time": table}, findings=findings)


def _mfu(inputs: Inputs) -> Output:
    context, facts = inputs.context, inputs.facts
    world_size = context.world_size or facts.get("world_size") or 1
    rows = [mfu.profiler_hfu(inputs.table("step_times"), inputs.table("_step_flops"), context.peak)] if inputs.ranks else []
    shape, origin, lacking = mfu.resolve_shape(inputs.options.shape, facts)
    # the user asked for the analytic count and it cannot be completed: say what it lacks
    missing = (f"the analytic numerator lacks {lacking}: give them (--params --layers --hidden --seq-len --tokens-per-step)"
               if inputs.options.shape and shape is None else "")
    trace_flops = mfu.trace_flops_per_step(inputs.table("_trace_step_flops"), world_size) if inputs.ranks else None
    run_rows, problem = mfu.step_time_mfu(inputs.table("step_time"), inputs.table("flops_profile"), facts, context.peak,
                                          world_size, shape, inputs.options.recompute, origin, trace_flops)
    log_rows, log_problem = log_mfu.megatron_mfu(inputs.table("step_time"), facts, context.peak, world_size)
    # a logs-only Megatron run: the shape from its arguments
    found = [r for r in rows + [run_rows, log_rows] if not r.is_empty()]
    table = pl.concat(found, how="diagonal_relaxed") if found else pl.DataFrame()
    table, finding = sanity.mark_impossible_mfu(
        table, mfu.mfu_finding(table, problem or log_problem or context.peak_problem or missing))
    findings = {"mfu": finding}
    if isinstance(finding, list) and (disagree := mfu.numerators_disagree(finding)):
        findings["mfu_numerators_disagree"] = disagree
    if isinstance(finding, list) and (problem or missing):  # a numerator refused beside those computed
        findings["mfu_refused"] = "; ".join(p for p in (problem, missing) if p)
    return Output(tables={"mfu": table}, findings=findings)


def _module_perf(inputs: Inputs) -> Output:
    modules = inputs.table("_module_rows") if inputs.ranks else pl.DataFrame(schema=module_perf.COLUMNS)
    return Output(tables={"module_perf": modules, "module_mfu": module_perf.module_mfu(
        modules, inputs.table("flops_profile"), inputs.facts, inputs.context.roof, inputs.options.dtype)})


def _roofline(inputs: Inputs) -> Output:
    ranked = bool(inputs.ranks)
    return Output(findings={"roofline": roofline.roofline_finding(
        inputs.table("_op_totals") if ranked else pl.DataFrame(), inputs.table("module_perf"), inputs.table("module_mfu"),
        inputs.context.roof, inputs.options.dtype, inputs.table("_family_time") if ranked else pl.DataFrame(),
        inputs.table("step_breakdown")["span_ns"].sum() if ranked else 0)})


def _summaries(inputs: Inputs) -> Output:
    return Output(tables=summaries.summary_tables(inputs.table("collectives"), inputs.table("kernel_categories"),
                                                  inputs.table("scalars")))


def _monitor(inputs: Inputs) -> Output:
    tables = monitor.monitor_tables(inputs.table("scalars"), inputs.facts, inputs.options.grad_norm_threshold,
                                    step_time.instrumented(inputs.table("step_time")))
    return Output(tables=tables, findings=monitor.alarms_finding(tables["monitor_alarms"]))


def _alarm_agreement(inputs: Inputs) -> Output:
    table = alarm_agreement.alarm_agreement(inputs.table("alarms"), inputs.table("scalars"), inputs.table("train_steps"),
                                            inputs.table("comms_calls"), inputs.facts,
                                            step_time.instrumented(inputs.table("step_time")))
    return Output(tables={"alarm_agreement": table},
                  findings={"alarms": alarm_agreement.agreement_summary(table)} if not table.is_empty() else {})


def _autotune(inputs: Inputs) -> Output:
    tables = autotune.autotune_tables(inputs.table("autotune_experiments"), inputs.facts)
    return Output(tables=tables, findings=autotune.verdict_finding(tables["autotune_verdict"]))


def _comms_log(inputs: Inputs) -> Output:
    calls = inputs.table("comms_calls")
    table = comms_log.comms_log_stats(calls) if not calls.is_empty() else pl.DataFrame()
    return Output(tables={"comms_log_stats": table}, findings=comms_log.costliest_finding(table))


def _job_end(inputs: Inputs) -> Output:
    ended = job_end.job_end(inputs.table("run_status"), inputs.table("train_steps"), inputs.table("step_timers"),
                            inputs.table("scalars"), inputs.facts, inputs.findings["step_time"].get("median_ns"))
    return Output(findings={"job_end": ended} if ended else {})


def _sanity(inputs: Inputs) -> Output:
    """Figures that cannot be true, said once (impossible bandwidths leave their findings here; MFU above 100%
    left the mfu table and finding in _mfu)."""
    disagree = sanity.inputs_disagree(inputs.findings, inputs.table("step_time"), inputs.table("mfu"),
                                      inputs.context.device_key)
    return Output(findings={"inputs_disagree": disagree} if disagree else {})


def _caveats(inputs: Inputs) -> Output:
    return Output(findings={"caveats": caveats.caveats(inputs)})


def _input_problems(inputs: Inputs) -> Output:
    issues = inputs.table("ingest_issues")
    errors = issues.filter(pl.col("severity") == "error").height if not issues.is_empty() else 0
    return Output(findings={"ingest_errors": errors} if errors else {})  # input problems that lost data


ANALYSES = [
    Analysis("device_timeline", "CPU launch and GPU execution, per rank", ("trace_events", "flows"),
             declared("kernel_launches", "op_perf", "gpu_idle", "launch_summary", "kernel_categories"), device_timeline,
             per_rank=True, parts=("kernel_launches", "op_perf"),
             passes=("_collective_calls", "_sync_points", "_kernel_totals", "_gpu_spans", "_step_flops", "_cpu_comm_ops",
                     "_trace_step_flops", "_op_totals", "_family_time", "_module_rows")),
    Analysis("steps", "Steps and stragglers", ("_collective_calls", "_gpu_spans", "steps"),
             declared("clock_offsets", "step_times", "step_stats"), _steps),
    Analysis("collectives", "Collectives", ("_collective_calls", "_cpu_comm_ops", "clock_offsets"),
             declared("collectives", "collective_instances"), _collectives),
    Analysis("gpu_idle", "GPU idle", ("gpu_idle", "_sync_points"), declared("sync_points"), _idle),
    Analysis("top_kernels", "Kernels", ("_kernel_totals",), declared("top_kernels"), _top_kernels),
    Analysis("step_breakdown", "Where one step's time went",
             ("kernel_launches", "collectives", "gpu_idle", "step_stats", "clock_offsets"),
             declared("step_breakdown", "step_timeline"), _step_breakdown),
    Analysis("step_time", "Step time over the run", ("train_steps", "step_timers", "scalars", "steps", "flops_profile"),
             declared("step_time"), _step_time),
    Analysis("mfu", "FLOPs and MFU", ("step_times", "_step_flops", "_trace_step_flops", "step_time", "flops_profile"),
             declared("mfu"), _mfu),
    Analysis("module_perf", "Modules", ("_module_rows", "flops_profile"), declared("module_perf", "module_mfu"),
             _module_perf),
    Analysis("roofline", "Roofline", ("_op_totals", "_family_time", "module_perf", "module_mfu", "step_breakdown"), {},
             _roofline),
    Analysis("summaries", "Summaries", ("collectives", "kernel_categories", "scalars"),
             declared("collective_summary", "collective_call_sites", "category_summary", "scalar_series"), _summaries),
    Analysis("monitor", "Monitor alarms", ("scalars", "step_time"), declared("monitor_alarms", "run_comparability"),
             _monitor),
    Analysis("alarm_agreement", "In-job alarms", ("alarms", "scalars", "train_steps", "comms_calls", "step_time"),
             declared("alarm_agreement"), _alarm_agreement),
    Analysis("autotune", "Autotuning", ("autotune_experiments",), declared("autotune_ranking", "autotune_verdict"),
             _autotune),
    Analysis("comms_log", "Logged communication", ("comms_calls",), declared("comms_log_stats"), _comms_log),
    Analysis("job_end", "How the job ended", ("run_status", "train_steps", "step_timers", "scalars", "step_time"), {},
             _job_end),
    Analysis("sanity", "Inputs that disagree", ("step_time", "mfu", "collectives", "comms_log_stats"), {}, _sanity),
    Analysis("input_problems", "Input problems", ("ingest_issues",), {}, _input_problems),
    Analysis("caveats", "Method and caveats", ("comms_calls", "flops_profile", "steps", "train_steps", "scalars",
                                               "autotune_experiments", "mfu"), {}, _caveats),
]
