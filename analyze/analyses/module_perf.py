"""Which module is slow for its work: device time and FLOPs per nn.Module, and per-module MFU for
collector runs.

Modules come from the `nn.Module: <Class>_<n>` events the profiler's Python tracer writes
(`with_stack=True`; `<n>` numbers the instances of a class in the order they are first called). A
module's path is the chain of module events enclosing it on its thread (`GPT_0/Block_1/Linear_4`).
Its `device_ns` is the device work launched inside its forward span (itself and its submodules, the
same launch-on-the-thread rule as op_perf); its `flops` the FLOPs of the modeled ops inside it that are
not nested in another modeled op (op_perf.nested), so a linear and the addmm under it count once. The
backward pass runs on the autograd thread, outside every module's span: `backward_device_ns` is the
device work launched under the backward nodes whose forward op (the `fwdbwd` flow's start) ran inside
the module.

Per-module MFU (collector runs): the collector's exact per-module FLOPs (flops_profile, DeepSpeed's
profiler, forward FLOPs of one micro batch, children included) joined to the trace's module instances by
class and instance order (flops_profile rows are in named_modules() order; a class whose instance count
differs between the two is left unmatched, never guessed), times the calls in the step, over the
module's forward device time, against the dense peak of the run's dtype (`mfu`); and for training,
forward + backward with the backward counted as 2 x the forward FLOPs (Kaplan et al. 2020, the 6N rule's
2N + 4N) over forward + backward device time (`training_mfu`). A ZeRO-3 profile counts Linear FLOPs
twice: those rows are flagged and get no MFU.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa

from steplens.analyze.analyses.op_perf import THREAD, Roof, launch_points, window_sums
from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.contract import schema

MODULE_PREFIX = "nn.Module: "
MODULE_COLUMNS = ["source", "event_id", "ts_ns", "dur_ns", "name", "pid", "tid", "step"]
COLUMNS = {"rank": pl.Int64, "step": pl.Int64, "module": pl.String, "module_class": pl.String, "depth": pl.Int64,
           "calls": pl.Int64, "device_ns": pl.Int64, "unknown_flops_device_ns": pl.Int64, "flops": pl.Float64,
           "achieved_tflops": pl.Float64, "backward_device_ns": pl.Int64}
MFU_COLUMNS = {"rank": pl.Int64, "step": pl.Int64, "module": pl.String, "module_class": pl.String,
               "profile_path": pl.String, "calls": pl.Int64, "forward_flops": pl.Float64, "device_ns": pl.Int64,
               "achieved_tflops": pl.Float64, "peak_tflops": pl.Float64, "mfu": pl.Float64, "definition": pl.String,
               "flag": pl.String, "backward_device_ns": pl.Int64, "training_flops": pl.Float64,
               "training_mfu": pl.Float64}
MFU_DEFINITION = ("mfu: the FLOPs profile's forward FLOPs of the module (one micro batch, children included) x its calls "
                  "in the step, over the device time launched inside its forward; training_mfu: 3 x those FLOPs (backward "
                  "= 2 x forward) over forward + backward device time (backward: the work of the backward nodes that "
                  "fwdbwd flows link to the module's forward ops)")
ZERO3_FLAG = "ZeRO-3 FLOPs profile: Linear FLOPs counted twice, no MFU"


LINKED_COLUMNS = ["source", "event_id", "ts_ns", "dur_ns", "pid", "tid"]


def backward_points(links: pl.DataFrame, linked: pl.DataFrame, launched: pl.DataFrame) -> pl.DataFrame:
    """Device time under each backward node (a fwdbwd flow's end), placed at its forward op's start.
    `links`: flows (source, src_event_id, dst_event_id) of type fwdbwd; `linked`: their events (LINKED_COLUMNS)."""
    empty = pl.DataFrame(schema={"source": pl.String, "pid": pl.Int64, "tid": pl.Int64, "at_ns": pl.Int64,
                                 "backward_ns": pl.Float64})
    if links.is_empty() or linked.is_empty():
        return empty
    nodes = links.join(linked, left_on=["source", "dst_event_id"], right_on=["source", "event_id"]).drop_nulls(
        [*THREAD, "ts_ns", "dur_ns"]).with_columns(lo_ns=pl.col("ts_ns"), hi_ns=pl.col("ts_ns") + pl.col("dur_ns"))
    if nodes.is_empty():
        return empty
    nodes = nodes.with_columns(backward_ns=window_sums(nodes, launch_points(launched), "work_ns"))
    forward = nodes.select("source", "src_event_id", "backward_ns").join(
        linked, left_on=["source", "src_event_id"], right_on=["source", "event_id"])
    return forward.select("source", "pid", "tid", at_ns="ts_ns", backward_ns="backward_ns")


def module_perf(modules: pl.DataFrame, ops: pl.DataFrame, perf: pl.DataFrame, launched: pl.DataFrame,
                backward: pl.DataFrame | None = None, heavy: pl.DataFrame | None = None) -> pl.DataFrame:
    """Per rank, step and module path: forward device time and FLOPs, and backward device time.
    `modules` are CPU events (MODULE_COLUMNS plus rank), `ops` op_perf's input, `perf` its output,
    `launched` kernel_launches, `backward` backward_points' table, `heavy` the rows of `launched` whose
    kernels are of a FLOPS_HEAVY_FAMILIES family."""
    mods = modules.filter(pl.col("name").str.starts_with(MODULE_PREFIX) & pl.col("dur_ns").is_not_null()).drop_nulls(THREAD)
    if mods.is_empty():
        return pl.DataFrame(schema=COLUMNS)
    mods = _with_paths(mods).with_columns(lo_ns=pl.col("ts_ns"), hi_ns=pl.col("ts_ns") + pl.col("dur_ns"))
    counted = (ops.select("source", "event_id", *THREAD[1:], at_ns="ts_ns", lo_ns="ts_ns",
                          hi_ns=pl.col("ts_ns") + pl.col("dur_ns").fill_null(0))  # as op_perf times an op without dur
               .join(perf.filter(~pl.col("nested") & pl.col("flops").is_not_null()).select("source", "event_id", "flops"),
                     on=["source", "event_id"]))
    heavy_points = launch_points(heavy if heavy is not None else launched.clear())
    counted = counted.with_columns(heavy_ns=window_sums(counted, heavy_points, "work_ns"))
    mods = mods.with_columns(device_ns=window_sums(mods, launch_points(launched), "work_ns").round().cast(pl.Int64),
                             # (never below 0: two modeled ops that overlap without nesting on a thread count a launch twice)
                             unknown_flops_device_ns=(window_sums(mods, heavy_points, "work_ns")
                                                      - window_sums(mods, counted, "heavy_ns")).clip(0).round().cast(pl.Int64),
                             flops=window_sums(mods, counted, "flops"), has_flops=window_sums(
                                 mods, counted.with_columns(one=pl.lit(1.0)), "one") > 0,
                             backward_device_ns=window_sums(mods, backward if backward is not None else pl.DataFrame(),
                                                            "backward_ns").round().cast(pl.Int64))
    per_step = mods.group_by("rank", "step", "module").agg(
        pl.col("module_class", "depth").first(), calls=pl.len(), device_ns=pl.col("device_ns").sum(),
        unknown_flops_device_ns=pl.col("unknown_flops_device_ns").sum(), backward_device_ns=pl.col("backward_device_ns").sum(),
        flops=pl.when(pl.col("has_flops").any()).then(pl.col("flops").sum()))
    return per_step.with_columns(achieved_tflops=achieved_tflops("flops", "device_ns", "unknown_flops_device_ns")
                                 ).select(list(COLUMNS)).cast(COLUMNS).sort("rank", "step", "module")


# The kernel families that carry a model's FLOPs (kernel_families.FAMILIES; "triton": Inductor templates whose
# name does not say matmul). A module's FLOPs are those of its ops with a FLOPs formula: an op without one
# (layer_norm, batch_norm, an activation) adds memory-bound time of negligible FLOPs, and FLOPs over all the
# module's time stays a fair rate; a GEMM, convolution or attention kernel launched outside every modeled op
# (a torch.compile region, a custom extension) has unknown and large FLOPs.
FLOPS_HEAVY_FAMILIES = ("gemm", "conv", "attention", "triton")
# Above this share of a module's device time in such kernels, its FLOPs rate is not given (N/A rather than a
# module of compiled GEMMs shown at 0% of peak because its only modeled ops were copies).
MAX_UNKNOWN_FLOPS_SHARE = 0.1


def achieved_tflops(flops: str, device_ns: str, unknown_flops_device_ns: str) -> pl.Expr:
    """FLOPs over device time in TFLOP/s, where at most MAX_UNKNOWN_FLOPS_SHARE of that time has unknown FLOPs."""
    known = pl.col(unknown_flops_device_ns) <= MAX_UNKNOWN_FLOPS_SHARE * pl.col(device_ns)
    return pl.when((pl.col(device_ns) > 0) & known).then(pl.col(flops) / pl.col(device_ns) / 1e3)


def _with_paths(mods: pl.DataFrame) -> pl.DataFrame:
    """module (path of enclosing module names on the thread), module_class and depth (0 = outermost)."""
    ordered = mods.sort(*THREAD, "ts_ns", "dur_ns", descending=[False] * 4 + [True], maintain_order=True).with_row_index("order")
    ordered = ordered.with_columns(thread=pl.struct(THREAD).rank("dense"), end_ns=pl.col("ts_ns") + pl.col("dur_ns"))
    starts, ends = ordered["ts_ns"].to_numpy(), ordered["end_ns"].to_numpy()
    thread = ordered["thread"].to_numpy()
    # Depth = earlier-starting module events on the thread that have not ended when this one starts.
    depth = np.zeros(len(starts), np.int64)
    for key in np.unique(thread):  # rowwise-ok: once per thread
        at = np.nonzero(thread == key)[0]
        ended_before = np.searchsorted(np.sort(ends[at]), starts[at], side="right")
        depth[at] = np.arange(len(at)) - ended_before
    ordered = ordered.with_columns(depth=pl.Series(np.maximum(depth, 0)))
    # The parent is the last module on the thread, before this one, one level up.
    parents = ordered.select("thread", "order", want=pl.col("depth") - 1).join_asof(
        ordered.select("thread", "depth", parent=pl.col("order")), left_on="order", right_on="parent", by_left=["thread", "want"],
        by_right=["thread", "depth"], strategy="backward", allow_exact_matches=False, check_sortedness=False)
    parent = parents.sort("order")["parent"].fill_null(-1).to_numpy().astype(np.int64)
    short = ordered["name"].str.strip_prefix(MODULE_PREFIX).to_numpy().astype(object)
    path, up = short.copy(), parent.copy()
    while (up >= 0).any():  # one round per nesting level
        has = up >= 0
        path[has] = short[up[has]] + "/" + path[has]
        up = np.where(has, parent[np.maximum(up, 0)], -1)
    return ordered.with_columns(module=pl.Series(path, dtype=pl.String),
                                module_class=pl.Series(short, dtype=pl.String).str.replace(r"_\d+$", ""))


def module_mfu(modules: pl.DataFrame, flops_profile: pl.DataFrame, facts: dict, roof: Roof, dtype: str) -> pl.DataFrame:
    """Per-module MFU of the forward pass from the collector's exact FLOPs profile (see the module docstring)."""
    exact = flops_profile.filter(pl.col("exact").fill_null(False)) if not flops_profile.is_empty() else flops_profile
    if exact.is_empty() or modules.is_empty():
        return pl.DataFrame(schema=MFU_COLUMNS)
    first = exact.filter((pl.col("rank") == exact["rank"].min()) & (pl.col("source") == exact["source"].min()))
    profile = first.with_columns(instance=pl.int_range(pl.len()).over("module_class")).select(
        "module_class", "instance", profile_path="path", profile_flops="flops_total",
        profile_count=pl.len().over("module_class"))
    traced = modules.with_columns(instance=pl.col("module").str.extract(r"_(\d+)$").cast(pl.Int64))
    traced = traced.with_columns(traced_count=pl.col("instance").n_unique().over("rank", "module_class"))
    joined = traced.join(profile, on=["module_class", "instance"], how="inner").filter(
        pl.col("traced_count") == pl.col("profile_count"))
    peak = roof.flops.get(dtype)
    zero3 = "flops_zero3_double_counting" in (facts.get("collector_flags") or {})
    forward = pl.col("profile_flops").cast(pl.Float64) * pl.col("calls")
    achieved = pl.when(pl.col("device_ns") > 0).then(forward / pl.col("device_ns") / 1e3)
    both_ns = pl.col("device_ns") + pl.col("backward_device_ns")
    training = pl.when((pl.col("backward_device_ns") > 0) & (both_ns > 0)).then(3 * forward / both_ns / 1e3)
    return joined.select(
        "rank", "step", "module", "module_class", "profile_path", "calls", forward_flops=forward, device_ns="device_ns",
        achieved_tflops=achieved, peak_tflops=pl.lit(peak / 1e12 if peak else None, pl.Float64),
        mfu=pl.lit(None, pl.Float64) if zero3 or not peak else achieved * 1e12 / peak,
        definition=pl.lit(MFU_DEFINITION + f"; peak: dense {dtype}, {roof.label}" if peak else MFU_DEFINITION),
        flag=pl.lit(ZERO3_FLAG if zero3 else None, pl.String), backward_device_ns="backward_device_ns",
        training_flops=3 * forward,
        training_mfu=pl.lit(None, pl.Float64) if zero3 or not peak else training * 1e12 / peak,
    ).cast(MFU_COLUMNS).sort("rank", "step", "module")


# ---------------------------------------------------------------------------------------------
# The analysis


def _module_perf(inputs: Inputs) -> Output:
    modules = inputs.table("_module_rows") if inputs.ranks else pl.DataFrame(schema=COLUMNS)
    return Output(tables={"module_perf": modules, "module_mfu": module_mfu(
        modules, inputs.table("flops_profile"), inputs.facts, inputs.context.roof, inputs.options.dtype)})


MODULE_PERF = schema.table_spec(
    ("rank", pa.int64(), "Rank."),
    ("step", pa.int64(), "ProfilerStep."),
    ("module", pa.string(), "Path of nn.Module events (with_stack), e.g. GPT_0/Block_1/Linear_4."),
    ("module_class", pa.string(), "Module class."),
    ("depth", pa.int64(), "Nesting depth (0: outermost module)."),
    ("calls", pa.int64(), "Forward calls in the step."),
    ("device_ns", pa.int64(), "Device work launched inside the module's forward (submodules included)."),
    ("unknown_flops_device_ns", pa.int64(), "The part of device_ns in GEMM, convolution, attention or Triton-template "
                                            "kernels launched under no op with a FLOPs formula (a torch.compile "
                                            "region): FLOPs flops does not count."),
    ("flops", pa.float64(), "FLOPs of the modeled ops inside it (op_perf, outer ops only); null when none has a "
                            "model."),
    ("achieved_tflops", pa.float64(), "flops / device_ns, TFLOP/s (forward only); null where unknown_flops_device_ns "
                                      "is over 10% of device_ns."),
    ("backward_device_ns", pa.int64(), "Device work under the backward nodes (fwdbwd flows) of the forward ops inside "
                                       "the module."),
)

MODULE_MFU = schema.table_spec(
    ("rank", pa.int64(), "Rank."),
    ("step", pa.int64(), "ProfilerStep."),
    ("module", pa.string(), "Module path in the trace (module_perf)."),
    ("module_class", pa.string(), "Module class."),
    ("profile_path", pa.string(), "The matching flops_profile path (class and instance order)."),
    ("calls", pa.int64(), "Forward calls in the step."),
    ("forward_flops", pa.float64(), "flops_profile forward FLOPs (children included) x calls."),
    ("device_ns", pa.int64(), "Forward device time (module_perf)."),
    ("achieved_tflops", pa.float64(), "forward_flops / device_ns, TFLOP/s."),
    ("peak_tflops", pa.float64(), "Dense peak of the run's dtype (--dtype)."),
    ("mfu", pa.float64(), "achieved_tflops / peak_tflops; null when flagged or no peak."),
    ("definition", pa.string(), "What is divided by what."),
    ("flag", pa.string(), "Why the number is not trusted (ZeRO-3 double counting), else null."),
    ("backward_device_ns", pa.int64(), "Backward device time (module_perf)."),
    ("training_flops", pa.float64(), "3 x forward_flops (backward = 2 x forward)."),
    ("training_mfu", pa.float64(), "training_flops / (device_ns + backward_device_ns) / peak; null without backward "
                                   "time, when flagged or no peak."),
)


ANALYSIS = Analysis("module_perf", "Modules", ("_module_rows", "flops_profile"), {"module_perf": MODULE_PERF, "module_mfu": MODULE_MFU},
                    _module_perf)
