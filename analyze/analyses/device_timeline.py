"""CPU launch and GPU execution, per rank: the one per-rank analysis over the traces. It reads a batch of ranks'
events once and leaves, besides its own tables, small per-rank results (names starting with `_`) for the run-level
analyses (steps, collectives, gpu_idle, top_kernels, mfu, module_perf, roofline), so memory is bounded by the
largest rank. The computations are the pure functions of the modules it calls.
"""

from __future__ import annotations

import polars as pl
import pyarrow as pa

from steplens.analyze.analyses import comms, kernels, launch, mfu, module_perf, op_perf, steps
from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.contract import schema
from steplens.analyze.contract.schema import WORK_KINDS
from steplens.analyze.trace import semantics

# Columns each slice of trace_events needs; read with the filter pushed into the Parquet scan.
DEVICE_COLUMNS = ["source", "event_id", "ts_ns", "dur_ns", "kind", "name", "stream", "device", "correlation", "step",
                  "launch_event_id", "collective", "in_nelems", "out_nelems", "dtype", "group_size", "group_name", "seq"]
CALL_COLUMNS = ["source", "event_id", "ts_ns", "dur_ns", "name", "pid", "tid", "step"]
CPU_COLUMNS = ["source", "ts_ns", "dur_ns", "kind", "name", "pid", "tid", "step", "collective", "flops"]
CPU_KINDS = ["cpu_op", "user_annotation", "python_function"]
RUNTIME_KINDS = ["cuda_runtime", "cuda_driver"]

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
    sliced = {name: events.lazy().filter(where).select(["rank"] + names).collect() for name, (names, where) in wanted.items()}
    # Device work whose time cannot be used (a negative duration, a clock glitch far outside the window) is not
    # device time: ingest counted it (negative_duration, device_activity_outside_window).
    keys = ["rank", "source"]
    bounds = semantics.device_window(pl.concat([sliced[name].select(*keys, "ts_ns", "dur_ns")
                                                for name in ("runtime", "cpu")]), keys)
    sliced["device"] = sliced["device"].filter(~semantics.unusable_device_work(sliced["device"], bounds, keys))
    return sliced


def device_timeline(inputs: Inputs) -> Output:
    """A batch of ranks: kernel launches, idle and its causes, op and module performance, and the small
    results the run-level analyses need, each keyed by rank (and source)."""
    context = inputs.context
    sliced = _slices(inputs)
    device, runtime, cpu, ops, modules = (sliced[name] for name in ("device", "runtime", "cpu", "ops", "modules"))
    work = kernels.device_work(device, inputs.options.kernel_categories)
    threads = launch.CpuThreads(cpu)
    launched = launch.kernel_launches(device, runtime)
    perf = op_perf.op_perf(ops, launched, context.roof)
    links = inputs.table("flows", ["rank", "source", "src_event_id", "dst_event_id"], pl.col("flow_type") == "fwdbwd")
    linked = _events(inputs, module_perf.LINKED_COLUMNS, pl.col("event_id").is_in(
        pl.concat([links["src_event_id"], links["dst_event_id"]]).unique().implode())) if not modules.is_empty() \
        else pl.DataFrame()
    gaps = launch.idle_gaps(launched, runtime)
    heavy = launched.join(work.filter(pl.col("category").is_in(module_perf.FLOPS_HEAVY_FAMILIES)).select("source", "event_id"),
                          on=["source", "event_id"], how="semi") if not modules.is_empty() else launched.clear()
    # record_param_comms (NCCL builds) or the c10d ops themselves (gloo/CPU runs record no comms args), each call
    # once: a record_param_comms inside its c10d:: op is the same call
    thread = ["rank", "source", "pid", "tid"]
    end = pl.col("ts_ns") + pl.col("dur_ns").fill_null(0)
    cpu_comm_ops = cpu.filter((pl.col("name") == "record_param_comms") | pl.col("collective").is_not_null()
                              | pl.col("name").str.starts_with("c10d::")).sort(
        *thread, "ts_ns", pl.col("dur_ns").fill_null(0), descending=[False] * 5 + [True]).filter(
        ~(end.cum_max().shift(1).over(thread) > pl.col("ts_ns")).fill_null(False)).group_by("rank").agg(ops=pl.len())
    return Output(tables={
        "kernel_launches": launched,
        "op_perf": perf,
        "_gpu_idle": launch.gpu_idle(launched, gaps, inputs.table("steps", ["rank", "source", "step", "start_ns", "end_ns"])),
        "launch_summary": launch.launch_summary(launched),
        "kernel_categories": kernels.category_time(work),
        "_collective_calls": comms.with_call_sites(comms.collectives(work, context.world_size), runtime, threads),
        "_sync_points": launch.sync_points(gaps, runtime, threads),
        "_kernel_totals": kernels.kernel_totals(work),
        "_gpu_spans": steps.gpu_spans(work),
        "_step_flops": mfu.step_flops(cpu),
        "_trace_step_flops": trace_step_flops(perf, runtime),
        "_cpu_comm_ops": cpu_comm_ops,
        "_op_totals": op_perf.op_totals(perf),
        "_dtype_flops": op_perf.dtype_flops(perf),
        "_family_time": op_perf.family_time(cpu, launched),
        "_module_rows": module_perf.module_perf(modules, ops, perf, launched,
                                               module_perf.backward_points(links, linked, launched), heavy),
    })


# A CUDA/HIP graph's ops are recorded once, when it is captured (their kernels do not run then), and not at all
# when it is replayed (one graph-launch call runs them all): a step doing either has no op-shape FLOPs count.
GRAPH_API = launch.GRAPH_LAUNCH + r"|^(cuda|cu|hip)StreamBeginCapture"


def trace_step_flops(perf: pl.DataFrame, runtime: pl.DataFrame) -> pl.DataFrame:
    """Executed FLOPs from shapes per rank and profiled step (rank, step, flops, graphs): the outermost ops with a
    FLOPs formula; `graphs` marks the steps that capture or replay a CUDA/HIP graph, whose count it is not."""
    flops = perf.filter(~pl.col("nested") & pl.col("flops").is_not_null() & pl.col("step").is_not_null()).group_by(
        "rank", "step").agg(flops=pl.col("flops").sum().cast(pl.Float64))
    graphs = runtime.filter(pl.col("name").str.contains(GRAPH_API) & pl.col("step").is_not_null()).select(
        "rank", "step").unique().with_columns(graphs=pl.lit(True))
    return flops.join(graphs, on=["rank", "step"], how="full", coalesce=True).with_columns(
        pl.col("graphs").fill_null(False)).select("rank", "step", "flops", "graphs")


KERNEL_LAUNCHES = schema.table_spec(
    ("rank", pa.int64(), "Rank."),
    ("source", pa.string(), "Source file."),
    ("event_id", pa.int64(), "Device event."),
    ("step", pa.int64(), "Step of the launch call; null when the launch is not in the file (orphan_device_activity)."),
    ("kind", pa.string(), "kernel, gpu_memcpy or gpu_memset."),
    ("name", pa.string(), "Device event name."),
    ("stream", pa.int64(), "Stream."),
    ("device", pa.int64(), "GPU."),
    ("correlation", pa.int64(), "Correlation id."),
    ("ts_ns", pa.int64(), "Start on the GPU."),
    ("dur_ns", pa.int64(), "GPU duration."),
    ("launch_api", pa.string(), "Runtime/driver call that enqueued it (null: no launch recorded)."),
    ("launch_ts_ns", pa.int64(), "Start of that call."),
    ("api_ns", pa.int64(), "CPU cost of the call."),
    ("launch_pid", pa.int64(), "Launching process."),
    ("launch_tid", pa.int64(), "Launching thread."),
    ("queue_ns", pa.int64(), "From the end of the call to the start on the GPU; negative when the work started before "
                             "the call returned (blocking copies, graph launches)."),
    ("launch_delay_ns", pa.int64(), "From the start of the call to the start on the GPU."),
)

OP_PERF = schema.table_spec(
    ("rank", pa.int64(), "Rank."),
    ("source", pa.string(), "Trace file."),
    ("event_id", pa.int64(), "The CPU op's event_id in trace_events."),
    ("external_id", pa.int64(), "Its External id (the runtime calls it made carry it)."),
    ("step", pa.int64(), "ProfilerStep of the op."),
    ("name", pa.string(), "Op name, e.g. aten::addmm."),
    ("family", pa.string(), "gemm | conv | attention | elementwise | normalization | reduction | other (kernel family "
                            "names)."),
    ("shapes", pa.string(), "Input Dims as recorded (JSON text)."),
    ("dtype", pa.string(), "Element type of the first tensor input (bf16, fp16, fp32, ...)."),
    ("flops", pa.float64(), "FLOPs from the shapes (analyze/analyses/op_model.py, formula and source per family); "
                            "null: no formula or unknown shapes."),
    ("bytes", pa.float64(), "Bytes moved: operands read once, outputs written once; null when unknown."),
    ("device_ns", pa.int64(), "Summed duration of all device work launched under the op, nested ops included "
                              "(External id -> runtime call -> correlation); 0 when it launched none."),
    ("achieved_tflops", pa.float64(), "flops / device_ns, TFLOP/s."),
    ("achieved_tbps", pa.float64(), "bytes / device_ns, TB/s."),
    ("intensity", pa.float64(), "flops / bytes (FLOPs per byte)."),
    ("bound", pa.string(), "compute | memory: intensity against the device's ridge point (peak FLOP/s / bandwidth); "
                           "null without a roofline."),
    ("fraction_of_peak", pa.float64(), "Achieved FLOP/s over the dense peak (compute-bound) or achieved bytes/s over "
                                       "the memory bandwidth (memory-bound)."),
    ("nested", pa.bool_(), "Inside another op with a FLOPs/bytes model on its thread (its time is in the outer op's "
                           "too)."),
    ("innermost", pa.bool_(), "Has FLOPs and holds no other op with FLOPs on its thread: the op that ran the "
                              "arithmetic, whose dtype is the compute dtype (autocast: an fp32 aten::linear holds the "
                              "bf16 addmm)."),
)

LAUNCH_SUMMARY = schema.table_spec(
    ("rank", pa.int64(), "Rank."),
    ("launch_api", pa.string(), "Launch API."),
    ("activities", pa.int64(), "Device activities it launched."),
    ("api_ns_median", pa.float64(), "Median CPU cost of a call (each call once: a graph launch runs many activities)."),
    ("api_ns_p90", pa.float64(), "90th percentile CPU cost (nearest rank: analyze/analyses/percentile.py)."),
    ("api_ns_max", pa.int64(), "The longest call: one stall the percentiles hide."),
    ("api_ns_total", pa.int64(), "CPU time of all the calls, each once (a graph launch runs many activities)."),
    ("launch_ns_max", pa.int64(), "The longest call that is a launch stall: every kernel launch, and the copies and "
                                  "sets whose call returned before they ended. One that returned only once its copy had "
                                  "ended waited for the device (a cudaMemcpyAsync to pageable memory is synchronous): "
                                  "its length is the device's."),
    ("queue_ns_median", pa.float64(), "Median queueing (queue_ns clipped at 0)."),
    ("queue_ns_p90", pa.float64(), "90th percentile queueing (clipped at 0; nearest rank)."),
    ("gpu_ns_total", pa.int64(), "GPU time launched."),
)

KERNEL_CATEGORIES = schema.table_spec(
    ("rank", pa.int64(), "Rank."),
    ("step", pa.int64(), "Step."),
    ("category", pa.string(), "Kernel family from the base name (analyze/analyses/kernel_families.py): gemm, conv, "
                              "attention, communication, normalization, elementwise, reduction, optimizer, embedding, "
                              "triton, memcpy, memset, other."),
    ("kernels", pa.int64(), "Activities."),
    ("time_ns", pa.int64(), "Summed GPU time (streams may overlap)."),
)


ANALYSIS = Analysis("device_timeline", "CPU launch and GPU execution, per rank", ("trace_events", "flows", "steps"),
             {"kernel_launches": KERNEL_LAUNCHES, "op_perf": OP_PERF, "launch_summary": LAUNCH_SUMMARY,
              "kernel_categories": KERNEL_CATEGORIES}, device_timeline,
             per_rank=True, parts=("kernel_launches", "op_perf"),
             passes=("_gpu_idle", "_collective_calls", "_sync_points", "_kernel_totals", "_gpu_spans", "_step_flops",
                     "_cpu_comm_ops", "_trace_step_flops", "_op_totals", "_dtype_flops", "_family_time", "_module_rows"))
