"""Which collective and message size is slow, and how much of it the GPU waits on.

One row per collective kernel per rank: bytes and bandwidth with the nccl-tests definitions
(NVIDIA/nccl-tests doc/PERFORMANCE.md: algbw = S / t, busbw = algbw * factor, GB/s = 1e9 bytes/s,
n = the process group's size), time exposed (not overlapped by compute on another stream of the same device:
any other device work, kernels, copies and sets, as step_breakdown counts compute) vs overlapped, and the
cross-rank instance it belongs to.
"""

from __future__ import annotations

import polars as pl
import pyarrow as pa

from steplens.analyze.contract.bus_bandwidth import busbw_factor, nccl_tests_op
from steplens.analyze.trace import intervals
from steplens.analyze.analyses.kernels import families
from steplens.analyze.analyses.launch import CpuThreads, enclosing_op
from steplens.analyze.analyses.summaries import collective_summary
from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.analyses import profiler_effect
from steplens.analyze.contract.text import sentence
from steplens.analyze.contract.units import binary_bytes, duration
from steplens.analyze.contract import schema

# c10 ScalarType names (record_param_comms `dtype`) -> bytes per element.
DTYPE_BYTES = {
    "Float": 4, "float": 4, "Float32": 4, "Double": 8, "Half": 2, "BFloat16": 2, "ComplexFloat": 8,
    "Int": 4, "Long": 8, "Short": 2, "Char": 1, "Byte": 1, "Bool": 1, "UInt32": 4, "UInt64": 8,
    "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1,
}

# Below this message size a collective's time is dominated by latency, not bandwidth: NCCL's LL and
# LL128 protocols, tuned for small messages, cover sizes up to roughly this (NCCL tuning tables).
LATENCY_BOUND_BYTES = 1 << 20

# Ordered: the first match names the collective (args first, then the kernel name).


def collective_kernels(events: pl.DataFrame) -> pl.DataFrame:
    """Communication kernels (family `communication`: NCCL/RCCL, NVLS multimem, DeepEP, custom
    all-reduce; or record_param_comms args) with their collective. `events` may carry the `category`
    of kernels.device_work (user patterns included); otherwise the default families are used."""
    # one filter (a filter copies every column it holds): the kind and the family together
    return events.filter((pl.col("kind") == "kernel") & _is_communication(events)).with_columns(
        op=pl.coalesce(nccl_tests_op("collective"), nccl_tests_op("name"), pl.lit("unknown")))


def _is_communication(events: pl.DataFrame) -> pl.Expr:
    """Whether a kernel of `events` communicates: its category, or the default families of its name."""
    if "category" in events.columns:
        return pl.col("collective").is_not_null() | (pl.col("category") == "communication")
    names = events.lazy().filter(pl.col("kind") == "kernel").select("name").collect().to_series()
    comm = families(names).filter(pl.col("category") == "communication")["name"].implode()
    return pl.col("collective").is_not_null() | pl.col("name").is_in(comm)


def collectives(device: pl.DataFrame, world_size: int | None = None) -> pl.DataFrame:
    """Per call: bytes, algbw/busbw, exposed vs overlapped time, regime and cross-rank instance key."""
    comm = collective_kernels(device)
    if comm.is_empty():
        return _empty()
    elem = pl.col("dtype").replace_strict(DTYPE_BYTES, default=None, return_dtype=pl.Int64)
    n = pl.coalesce("group_size", pl.lit(world_size, pl.Int64))
    in_bytes, out_bytes = pl.col("in_nelems") * elem, pl.col("out_nelems") * elem
    size = (
        pl.when(pl.col("op") == "allgather").then(pl.coalesce(out_bytes, in_bytes * n))
        .when(pl.col("op") == "reducescatter").then(pl.coalesce(in_bytes, out_bytes * n))
        .when(pl.col("op") == "sendrecv").then(pl.max_horizontal(in_bytes, out_bytes))
        .otherwise(in_bytes)
    )
    comm = comm.with_columns(group_size=n, bytes=size)
    comm = comm.with_columns(
        algbw_gbps=pl.when(pl.col("dur_ns") > 0).then(pl.col("bytes") / pl.col("dur_ns")),  # bytes/ns == GB/s
    ).with_columns(busbw_gbps=pl.col("algbw_gbps") * busbw_factor())
    comm = _add_exposure(comm, device)
    # Same instance on every rank: process group + sequence number when the trace has them, else order.
    ordinal = pl.int_range(pl.len()).over("rank", "group_name", "op")
    comm = comm.sort("rank", "ts_ns").with_columns(
        instance=pl.when(pl.col("seq").is_not_null())
        .then(pl.format("{}:{}", pl.col("group_name").fill_null("?"), pl.col("seq")))
        .otherwise(pl.format("{}:{}#{}", pl.col("group_name").fill_null("?"), pl.col("op"), ordinal)),
        regime=pl.when(pl.col("bytes").is_null()).then(pl.lit(None, pl.String))
        .when(pl.col("bytes") < LATENCY_BOUND_BYTES).then(pl.lit("latency-bound"))
        .otherwise(pl.lit("bandwidth-bound")),
    )
    return comm.select(
        "rank", "step", "event_id", "instance", "op", "collective", "name", "group_name", "group_size", "seq",
        "dtype", "bytes", "ts_ns", "dur_ns", "algbw_gbps", "busbw_gbps", "overlapped_ns", "exposed_ns", "regime",
        "device", "stream", "source", "launch_event_id",
    )


# Wrappers around the real call site: the op that records the collective's arguments.
RECORDING_OPS = ("record_param_comms",)


def with_call_sites(calls: pl.DataFrame, runtime: pl.DataFrame, threads: CpuThreads) -> pl.DataFrame:
    """Add issuing_op: the innermost CPU op, annotation or Python frame around each collective's
    launch, skipping record_param_comms (it wraps every collective and says nothing of the caller)."""
    if calls.is_empty():
        return calls.with_columns(issuing_op=pl.lit(None, pl.String)).drop("source", "launch_event_id")
    launches = calls.select("rank", "source", "launch_event_id").join(
        runtime.select("rank", "source", "event_id", "ts_ns", "dur_ns", "pid", "tid"),
        left_on=["rank", "source", "launch_event_id"], right_on=["rank", "source", "event_id"], how="left",
        maintain_order="left")
    sites = enclosing_op(launches, threads, skip=RECORDING_OPS)
    return calls.with_columns(issuing_op=sites).drop("source", "launch_event_id")


def _add_exposure(comm: pl.DataFrame, device: pl.DataFrame) -> pl.DataFrame:
    """Overlapped = covered by compute on another stream of the same device (every other device activity: kernels,
    copies, sets, as step_breakdown's compute); the rest is exposed."""
    compute = device.lazy().filter(pl.col("kind").is_in(schema.WORK_KINDS) & ~_is_communication(device)).select(
        "rank", "device", "stream", "ts_ns", "dur_ns").collect()
    by_device = compute.partition_by("rank", "device", as_dict=True)
    empty = compute.clear()
    pieces = []
    for (rank, device, stream), group in comm.group_by("rank", "device", "stream", maintain_order=True):
        # (a collective with no stream, out of the timeline: only work on a known other stream hides it)
        others = by_device.get((rank, device), empty).filter(pl.col("stream").ne_missing(pl.lit(stream, pl.Int64))
                                                             & pl.col("stream").is_not_null())
        starts = others["ts_ns"].to_numpy()
        u_s, u_e = intervals.union(starts, starts + others["dur_ns"].fill_null(0).to_numpy())
        lo = group["ts_ns"].to_numpy()
        overlapped = intervals.covered(u_s, u_e, lo, lo + group["dur_ns"].fill_null(0).to_numpy())
        pieces.append(group.with_columns(overlapped_ns=pl.Series(overlapped, dtype=pl.Int64)))
    comm = pl.concat(pieces)
    return comm.with_columns(exposed_ns=pl.col("dur_ns") - pl.col("overlapped_ns"))


def instances(calls: pl.DataFrame, offsets: pl.DataFrame | None = None) -> pl.DataFrame:
    """The same collective across ranks: skew of start and end (clocks aligned when offsets are given),
    and the minimum-over-ranks latency, which is the transfer itself (the rest is waiting)."""
    if calls.is_empty():
        return pl.DataFrame()
    if offsets is not None and not offsets.is_empty():
        calls = calls.join(offsets.select("rank", "offset_ns"), on="rank", how="left").with_columns(
            start=pl.col("ts_ns") - pl.col("offset_ns").fill_null(0))
    else:
        calls = calls.with_columns(start=pl.col("ts_ns"))
    calls = calls.with_columns(end=pl.col("start") + pl.col("dur_ns"))
    return (
        calls.group_by("instance", "op")
        .agg(
            ranks=pl.col("rank").n_unique(),
            step=pl.col("step").min(),
            bytes=pl.col("bytes").max(),
            group_size=pl.col("group_size").max(),
            min_dur_ns=pl.col("dur_ns").min(),
            max_dur_ns=pl.col("dur_ns").max(),
            start_skew_ns=pl.col("start").max() - pl.col("start").min(),
            end_skew_ns=pl.col("end").max() - pl.col("end").min(),
            last_rank=pl.col("rank").sort_by("start").last(),
            busbw_at_min_latency_gbps=pl.col("busbw_gbps").max(),
        )
        .sort("step", "instance", nulls_last=True)
    )


def _empty() -> pl.DataFrame:
    return pl.DataFrame(schema={
        "rank": pl.Int64, "step": pl.Int64, "event_id": pl.Int64, "instance": pl.String, "op": pl.String,
        "collective": pl.String, "name": pl.String, "group_name": pl.String, "group_size": pl.Int64, "seq": pl.Int64,
        "dtype": pl.String, "bytes": pl.Int64, "ts_ns": pl.Int64, "dur_ns": pl.Int64, "algbw_gbps": pl.Float64,
        "busbw_gbps": pl.Float64, "overlapped_ns": pl.Int64, "exposed_ns": pl.Int64, "regime": pl.String,
        "device": pl.Int64, "stream": pl.Int64, "source": pl.String, "launch_event_id": pl.Int64,
    })


def cpu_only_note(cpu_comm_ops: int, backend: str | None, world_size: int | None) -> str:
    """What a run whose traces hold collective calls but no communication kernels communicated with, as recorded."""
    if not cpu_comm_ops:
        return "no collectives in the traces"
    calls = f"{cpu_comm_ops} collective op(s) on the CPU side (record_param_comms or c10d::*) and no communication kernels"
    if world_size == 1:
        return f"{calls}: world size 1{f' ({backend})' if backend else ''}, nothing to exchange"
    if backend is None:
        return f"communication without NCCL/RCCL kernels: {calls} (gloo or CPU collectives)"
    if backend.lower() in ("nccl", "rccl"):
        return f"{calls} in the traces, although the backend is {backend} (its kernels were not recorded)"
    return f"{calls}: {backend} collectives run on the CPU"


# The keys of the collectives finding (findings.json wrote each at the top level before 0.2).
FINDING_KEYS = ("most_exposed_collective", "exposed_comm_ns", "exposed_comm_rank", "exposed_comm_median_rank_ns",
                "exposed_comm_definition", "comms_note")


def exposed_comm_finding(calls: pl.DataFrame, cpu_comm_ops: int, backend: str | None = None,
                         world_size: int | None = None) -> dict:
    """Exposed communication of the rank with the most (summing over ranks could exceed the run's wall
    time); without communication kernels, what the CPU side shows, with the backend as the traces record it."""
    if calls.is_empty():
        return {"most_exposed_collective": None, "comms_note": cpu_only_note(cpu_comm_ops, backend, world_size)}
    per_rank = calls.group_by("rank").agg(exposed_ns=pl.col("exposed_ns").sum()).sort("exposed_ns", "rank", descending=[True, False])
    worst_rank = per_rank.row(0, named=True)
    # The Collectives table's first row, so the verdict and the table state one figure (summaries.collective_summary)
    top = collective_summary(calls).row(0, named=True)
    return {
        "most_exposed_collective": {"op": top["op"], "bytes": top["bytes"], "exposed_ns": top["max_rank_exposed_ns"],
                                    "rank": top["max_exposed_rank"], "calls": top["calls"], "ranks": top["ranks"],
                                    "busbw_gbps": top["busbw_median_gbps"]},
        "exposed_comm_ns": int(worst_rank["exposed_ns"]),
        "exposed_comm_rank": worst_rank["rank"],
        "exposed_comm_median_rank_ns": int(per_rank["exposed_ns"].median()),
        "exposed_comm_definition": "communication kernel time not overlapped by compute (kernels, copies, sets) on "
                                   "another stream of the same device, on the rank with the most (exposed_comm_rank); "
                                   "never summed over ranks",
    }


# ---------------------------------------------------------------------------------------------
# What it says


def collective_lines(finding: dict, findings: dict) -> list[str]:
    if (findings.get("gpu_idle") or {}).get("runtime_calls_without_device_work"):
        return []  # no device work recorded: no collective kernels to find either (the GPU idle line says so)
    if top := finding.get("most_exposed_collective"):
        bandwidth = f" at a median busbw of {top['busbw_gbps']:.1f} GB/s" if top.get("busbw_gbps") is not None else ""
        message = f" of {binary_bytes(top['bytes'])}" if top.get("bytes") is not None else " (message size not in the traces)"
        on_rank = f" on rank {top['rank']}" if top.get("rank") is not None else ""
        ranks = f" on {top['ranks']} ranks" if (top.get("ranks") or 1) > 1 else ""
        return [f"Most exposed communication: {top['op']}{message}, {duration(top['exposed_ns'])} not hidden behind compute"
                f"{on_rank} (its most exposed rank), {top['calls']} call{'' if top['calls'] == 1 else 's'}{ranks}{bandwidth}"
                f"{profiler_effect.window_note(findings.get('profiler_after_effect'))}."]
    return [f"Collectives: {finding['comms_note']}."] if finding.get("comms_note") else []


# ---------------------------------------------------------------------------------------------
# Its report section


def collectives_section(page, run):
    """Collectives by size and call site (summaries.py's tables), and the logged calls (comms_log.py's)."""
    summary, sites, logged = run.table("collective_summary"), run.table("collective_call_sites"), run.table("comms_log_stats")
    if summary.is_empty() and logged.is_empty():
        note = (run.findings.get("collectives") or {}).get("comms_note") or "No collectives recorded."
        return page.section("Collectives", "collectives", empty=sentence(note))
    section = page.section("Collectives", "collectives")
    if not summary.is_empty():
        if summary["busbw_median_gbps"].is_not_null().any():
            section.figure("busbw_by_size", summary.filter(pl.col("busbw_median_gbps").is_not_null()))
        else:
            section.text("No bandwidth plot: the traces do not give these collectives' message sizes "
                         "(no record_param_comms sizes).")
        section.text("Per collective and message size, most exposed first (exposed: not hidden behind compute, "
                     "on the rank where it was most exposed):")
        section.rows(summary, {
            "op": ("collective", "text"), "bytes": ("size S", "size"), "calls": ("calls (all ranks)", "num"),
            "kernel_ns": ("kernel time (all ranks)", "ms"), "max_rank_exposed_ns": ("exposed, worst rank", "ms"),
            "max_exposed_rank": ("worst rank", "text"), "median_rank_exposed_ns": ("exposed, median rank", "ms"),
            "busbw_median_gbps": ("median busbw GB/s", "num")}, "collective_summary")
        section.text("Per call site (the CPU op that issued the collective):")
        section.rows(sites, {"issuing_op": ("call site", "text"), "op": ("collective", "text"),
                             "calls": ("calls (all ranks)", "num"), "max_rank_exposed_ns": ("exposed, worst rank", "ms"),
                             "max_exposed_rank": ("worst rank", "text")}, "collective_call_sites")
    if not logged.is_empty():
        timers = "synchronizing timers" if logged["synchronized"].any() else "each call timed on its own"
        section.text(f"Communication calls timed by DeepSpeed's comms logger or the collector ({timers}, one source per "
                     "rank: see Method and caveats):")
        section.rows(logged.sort("total_latency_ns", descending=True), {
            "op": ("op", "text"), "nccl_bytes": ("size S", "size"), "group_size": ("ranks in group", "text"),
            "calls": ("calls", "num"), "median_latency_ns": ("median latency", "ms"),
            "least_wait_median_latency_ns": ("median, rank waiting least", "ms"),
            "p90_latency_ns": ("p90 latency", "ms"), "total_latency_ns": ("total latency", "ms"),
            "median_busbw_gbps": ("median busbw GB/s", "num"), "latency_origin": ("latency from", "text")},
            "comms_log_stats")
    return section


# ---------------------------------------------------------------------------------------------
# The analysis


def _collectives(inputs: Inputs) -> Output:
    if not inputs.ranks:
        return Output()
    calls = inputs.table("_collective_calls")
    cpu_comm_ops = inputs.table("_cpu_comm_ops")["ops"].sum()
    return Output(tables={"collectives": calls, "collective_instances": instances(calls, inputs.table("clock_offsets"))},
                  finding=exposed_comm_finding(calls, cpu_comm_ops, inputs.context.backend,
                                               inputs.facts.get("world_size")))


COLLECTIVES = schema.table_spec(
    ("rank", pa.int64(), "Rank."),
    ("step", pa.int64(), "Step of the launch."),
    ("event_id", pa.int64(), "The communication kernel's event_id (family communication: NCCL/RCCL, NVLS multimem, "
                             "DeepEP, custom all-reduce)."),
    ("instance", pa.string(), "Cross-rank key: process group + Seq, else process group + op + order."),
    ("op", pa.string(), "Collective in nccl-tests terms (allreduce, allgather, reducescatter, alltoall, broadcast, "
                        "reduce, sendrecv, ...), from record_param_comms or else inferred from the kernel name "
                        "(unknown when neither says)."),
    ("collective", pa.string(), "'Collective name' as recorded."),
    ("name", pa.string(), "Kernel name."),
    ("group_name", pa.string(), "Process group."),
    ("group_size", pa.int64(), "n of the nccl-tests formulas: the process group's size."),
    ("seq", pa.int64(), "Sequence number in the group."),
    ("dtype", pa.string(), "Element type."),
    ("bytes", pa.int64(), "nccl-tests message size S (allgather: whole output; reducescatter: whole input); null when "
                          "the trace records no record_param_comms for the kernel."),
    ("ts_ns", pa.int64(), "Kernel start."),
    ("dur_ns", pa.int64(), "Kernel duration."),
    ("algbw_gbps", pa.float64(), "S / duration, GB/s (1e9 B/s)."),
    ("busbw_gbps", pa.float64(), "algbw x nccl-tests bus factor (allreduce 2(n-1)/n, allgather/reducescatter/alltoall "
                                 "(n-1)/n, else 1)."),
    ("overlapped_ns", pa.int64(), "Part covered by compute (kernels, copies, sets) on another stream of the same "
                                  "device."),
    ("exposed_ns", pa.int64(), "dur_ns - overlapped_ns."),
    ("regime", pa.string(), "latency-bound below 1 MiB, else bandwidth-bound."),
    ("device", pa.int64(), "GPU."),
    ("stream", pa.int64(), "Stream."),
    ("issuing_op", pa.string(), "Innermost CPU op, annotation or Python frame around the launch (record_param_comms "
                                "skipped)."),
)

COLLECTIVE_INSTANCES = schema.table_spec(
    ("instance", pa.string(), "Cross-rank key."),
    ("op", pa.string(), "Collective."),
    ("ranks", pa.int64(), "Ranks that recorded it."),
    ("step", pa.int64(), "Step."),
    ("bytes", pa.int64(), "S."),
    ("group_size", pa.int64(), "n."),
    ("min_dur_ns", pa.int64(), "Minimum kernel time over ranks: the transfer itself."),
    ("max_dur_ns", pa.int64(), "Maximum: includes waiting for the last rank."),
    ("start_skew_ns", pa.int64(), "Spread of kernel starts over ranks (aligned clocks)."),
    ("end_skew_ns", pa.int64(), "Spread of kernel ends over ranks (aligned clocks)."),
    ("last_rank", pa.int64(), "Rank that started last (the others waited for it)."),
    ("busbw_at_min_latency_gbps", pa.float64(), "busbw at the minimum latency."),
)


ANALYSIS = Analysis("collectives", "Collectives", ("_collective_calls", "_cpu_comm_ops", "clock_offsets"),
                    {"collectives": COLLECTIVES, "collective_instances": COLLECTIVE_INSTANCES}, _collectives,
                    former_keys={key: key for key in FINDING_KEYS}, phrase=collective_lines, section=collectives_section)
