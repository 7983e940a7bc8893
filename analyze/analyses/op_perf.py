"""Which op is slow for its work: FLOPs and bytes of every CPU op with shapes, the device time it
launched, and its place on the device's roofline.

- FLOPs and bytes come from the op's recorded shapes (analyze/analyses/op_model.py: each formula and its source),
  computed once per distinct (name, shapes, types, scalar arguments) and joined back.
- `device_ns` is the summed duration of all device work (kernels, memcpy, memset) launched under the op,
  nested ops included: device work -> its launch call (correlation) -> the call's place on the op's
  thread. The call sits inside its op (the op whose External id it carries) and so inside every op
  enclosing that one; prefix sums over each thread's launches give every op's total in one pass. The
  place, not the External id, is what links: in older traces (2022) a runtime call's External id is its
  own correlation id and names no op.
- The roofline (Williams, Waterman & Patterson, CACM 2009): intensity = FLOPs / byte; an op is
  compute-bound when its intensity reaches the ridge point peak FLOP/s / peak B/s of the device for its
  dtype, else memory-bound (ops without a FLOPs model but with bytes, normalization and softmax, are
  memory-bound by definition). `fraction_of_peak` is achieved FLOP/s over the peak when compute-bound,
  achieved B/s over the bandwidth when memory-bound. An unknown device gives no roofline (and says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from steplens.analyze.analyses import devices, launch, op_model
from steplens.analyze.analyses.op_model import family

OP_COLUMNS = ["source", "event_id", "ts_ns", "dur_ns", "name", "pid", "tid", "step", "external_id", "input_dims",
              "input_types", "concrete_inputs"]
THREAD = ["source", "pid", "tid"]
SIGNATURE = ["name", "input_dims", "input_types", "concrete_inputs"]
COLUMNS = {"rank": pl.Int64, "source": pl.String, "event_id": pl.Int64, "external_id": pl.Int64, "step": pl.Int64,
           "name": pl.String, "family": pl.String, "shapes": pl.String, "dtype": pl.String, "flops": pl.Float64,
           "bytes": pl.Float64, "device_ns": pl.Int64, "achieved_tflops": pl.Float64, "achieved_tbps": pl.Float64,
           "intensity": pl.Float64, "bound": pl.String, "fraction_of_peak": pl.Float64, "nested": pl.Boolean,
           "innermost": pl.Boolean}


@dataclass
class Roof:
    """The device's roofline: dense peak FLOP/s per dtype and the memory bandwidth, or why there is none."""

    flops: dict[str, float] = field(default_factory=dict)  # dtype -> FLOP/s
    bandwidth: float | None = None  # B/s
    label: str = ""
    problem: str = ""


def device_roof(device_name: str | None, num_sms: int | None = None) -> Roof:
    """The roofline of the run's device from the versioned device table (analyze/analyses/devices.py)."""
    bandwidth, bandwidth_label = devices.peak_bandwidth(device_name, num_sms)
    key = devices.match_device(device_name, num_sms) if device_name else None
    if key is None or bandwidth is None:
        problem = bandwidth_label if bandwidth is None else f"unknown device {device_name!r}: no FLOPs peak"
        return Roof(problem=f"no roofline: {problem}")
    flops = {dtype: tflops * 1e12 for dtype, tflops in devices.DEVICES[key].peak_tflops.items()}
    label = (f"{key}: memory {bandwidth_label}; dense FLOPs {devices.DEVICES[key].peak_source} "
             f"(peak table v{devices.PEAK_TABLE_VERSION})")
    return Roof(flops=flops, bandwidth=bandwidth, label=label)


def model_signatures(ops: pl.DataFrame) -> pl.DataFrame:
    """dtype, FLOPs, bytes and family per distinct op signature (the formulas run once per signature)."""
    sig = ops.select(SIGNATURE).unique()
    modeled = [op_model.model(*values)  # rowwise-ok: once per distinct op signature, not per event
               for values in zip(*(sig[c].to_list() for c in SIGNATURE))]
    return sig.with_columns(
        dtype=pl.Series([m[0] for m in modeled], dtype=pl.String),
        flops=pl.Series([m[1] for m in modeled], dtype=pl.Float64),
        bytes=pl.Series([m[2] for m in modeled], dtype=pl.Float64),
        family=pl.Series([op_model.family(n) for n in sig["name"].to_list()], dtype=pl.String))  # rowwise-ok: per signature


def window_sums(windows: pl.DataFrame, points: pl.DataFrame, value: str) -> pl.Series:
    """For each window (THREAD keys, lo_ns, hi_ns), the sum of `value` over the points (THREAD keys, at_ns)
    with lo_ns <= at_ns <= hi_ns: two as-of lookups into per-thread prefix sums."""
    if windows.is_empty():
        return pl.Series(value, [], dtype=pl.Float64)
    if points.is_empty():
        return pl.Series(value, [0.0] * windows.height)
    prefix = (points.drop_nulls(THREAD + ["at_ns"]).sort("at_ns")
              .with_columns(cum=pl.col(value).cast(pl.Float64).cum_sum().over(THREAD)).select(THREAD + ["at_ns", "cum"]))
    looked = windows.select(*THREAD, "lo_ns", "hi_ns").with_row_index("row").with_columns(before_ns=pl.col("lo_ns") - 1)

    def cum_at(column: str) -> pl.DataFrame:
        return looked.sort(column).join_asof(prefix, left_on=column, right_on="at_ns", by=THREAD, strategy="backward",
                                             check_sortedness=False).select("row", pl.col("cum").fill_null(0.0))

    upto_hi, before_lo = cum_at("hi_ns"), cum_at("before_ns")
    total = upto_hi.join(before_lo, on="row", suffix="_lo").sort("row")
    return (total["cum"] - total["cum_lo"]).alias(value)


def launch_points(launched: pl.DataFrame) -> pl.DataFrame:
    """Device time per launch call, placed at the call's start on its thread."""
    return (launched.filter(pl.col("launch_ts_ns").is_not_null())
            .group_by("rank", "source", pid="launch_pid", tid="launch_tid", at_ns="launch_ts_ns")
            .agg(work_ns=pl.col("dur_ns").sum()))


def op_perf(ops: pl.DataFrame, launched: pl.DataFrame, roof: Roof) -> pl.DataFrame:
    """One row per CPU op with shapes (`ops`: OP_COLUMNS plus rank), with its FLOPs, bytes, device time
    and roofline position; `launched` is kernel_launches' table for the same rank."""
    if ops.is_empty():
        return pl.DataFrame(schema=COLUMNS)
    rows = ops.join(model_signatures(ops), on=SIGNATURE, how="left", nulls_equal=True)
    rows = rows.with_columns(lo_ns=pl.col("ts_ns"), hi_ns=pl.col("ts_ns") + pl.col("dur_ns").fill_null(0))
    rows = rows.with_columns(device_ns=window_sums(rows, launch_points(launched), "work_ns").round().cast(pl.Int64))
    return with_roofline(_mark_nested(rows), roof).select(
        [pl.col(c) if c != "shapes" else pl.col("input_dims").alias("shapes") for c in COLUMNS]).cast(COLUMNS)


def _mark_nested(rows: pl.DataFrame) -> pl.DataFrame:
    """nested: inside another op with a model on its thread (its time is in the outer op's too). innermost: an op with
    FLOPs holding no other op with FLOPs, the op that ran the arithmetic (under autocast an fp32 aten::linear holds the
    bf16 addmm that ran it)."""
    modeled = pl.col("flops").is_not_null() | pl.col("bytes").is_not_null()
    counted = pl.col("flops").is_not_null() & (pl.col("flops") > 0)
    # Ties (two ops with the same start and duration) in trace order: the one written first encloses.
    ordered = rows.sort(THREAD + ["ts_ns", "dur_ns", "event_id"], descending=[False] * 4 + [True, False], maintain_order=True)
    end = pl.when(modeled).then(pl.col("hi_ns"))  # only modeled ops enclose
    # Properly nested slices: the earlier one reaching furthest contains this one if any does (a zero-length
    # op at an earlier op's end is beside it, not inside).
    reach = end.cum_max().forward_fill().shift(1).over(THREAD).fill_null(-1)
    # the next op with FLOPs on the thread, by start: inside this one if any op with FLOPs is (properly nested slices)
    next_counted = pl.when(counted).then(pl.col("ts_ns")).shift(-1).backward_fill().over(THREAD)
    return ordered.with_columns(nested=modeled & (reach >= pl.col("hi_ns")) & (reach > pl.col("ts_ns")),
                                innermost=counted & ~(next_counted < pl.col("hi_ns")).fill_null(False))


def dtype_flops(perf: pl.DataFrame) -> pl.DataFrame:
    """FLOPs of the innermost ops with FLOPs per rank, dtype and family (rank, dtype, family, flops): what the run's
    compute dtype is read from (mfu.compute_dtype)."""
    return perf.filter(pl.col("innermost")).group_by("rank", "dtype", "family").agg(flops=pl.col("flops").sum())


def with_roofline(rows: pl.DataFrame, roof: Roof) -> pl.DataFrame:
    """achieved_tflops, achieved_tbps, intensity, bound, fraction_of_peak from flops, bytes, device_ns, dtype."""
    timed = pl.col("device_ns") > 0
    # fp32 convolutions run on TF32 tensor cores by default (torch.backends.cudnn.allow_tf32 = True); fp32
    # matmuls do not (torch.backends.cuda.matmul.allow_tf32 = False since PyTorch 1.12): PyTorch docs, "TensorFloat-32".
    rated = pl.when((pl.col("dtype") == "fp32") & (pl.col("family") == "conv") & pl.lit("tf32" in roof.flops)) \
        .then(pl.lit("tf32")).otherwise(pl.col("dtype"))
    peak = rated.replace_strict(roof.flops, default=None, return_dtype=pl.Float64) if roof.flops \
        else pl.lit(None, pl.Float64)
    bandwidth = pl.lit(roof.bandwidth, pl.Float64)
    rows = rows.with_columns(
        achieved_tflops=pl.when(timed).then(pl.col("flops") / pl.col("device_ns") / 1e3),
        achieved_tbps=pl.when(timed).then(pl.col("bytes") / pl.col("device_ns") / 1e3),
        intensity=pl.when(pl.col("bytes") > 0).then(pl.col("flops") / pl.col("bytes")),
        peak_flops=peak)
    compute_bound = pl.col("intensity") >= pl.col("peak_flops") / bandwidth
    bound = (pl.when(bandwidth.is_null()).then(None)
             .when(pl.col("flops").is_null() & pl.col("bytes").is_not_null()).then(pl.lit("memory"))
             .when(pl.col("intensity").is_null() | pl.col("peak_flops").is_null()).then(None)
             .when(compute_bound).then(pl.lit("compute")).otherwise(pl.lit("memory")))
    rows = rows.with_columns(bound=bound)
    return rows.with_columns(fraction_of_peak=pl.when(pl.col("bound") == "compute")
                             .then(pl.col("achieved_tflops") * 1e12 / pl.col("peak_flops"))
                             .when(pl.col("bound") == "memory").then(pl.col("achieved_tbps") * 1e12 / bandwidth))


TOP_OPS = 10


def _sum_or_null(column: str) -> pl.Expr:
    return pl.when(pl.col(column).is_not_null().any()).then(pl.col(column).sum())


def op_totals(perf: pl.DataFrame) -> pl.DataFrame:
    """Per (name, shapes, dtype): calls and totals over the ops not nested in another modeled op."""
    outer = perf.filter(~pl.col("nested") & (pl.col("flops").is_not_null() | pl.col("bytes").is_not_null()))
    return outer.group_by("name", "family", "shapes", "dtype").agg(
        calls=pl.len(), device_ns=pl.col("device_ns").sum(), flops=_sum_or_null("flops"),
        bytes=_sum_or_null("bytes"), ranks=pl.col("rank").n_unique())


def top_ops(totals: pl.DataFrame, roof: Roof, limit: int = TOP_OPS) -> pl.DataFrame:
    """The ops (by name and shapes) with the most device time over all ranks, with their roofline position."""
    if totals.is_empty():
        return totals
    merged = totals.group_by("name", "family", "shapes", "dtype").agg(
        pl.col("calls", "device_ns").sum(), flops=_sum_or_null("flops"), bytes=_sum_or_null("bytes"),
        ranks=pl.col("ranks").sum())
    merged = merged.filter(pl.col("device_ns") > 0).sort("device_ns", "name", descending=[True, False]).head(limit)
    return with_roofline(merged, roof).drop("peak_flops")


def family_time(cpu: pl.DataFrame, launched: pl.DataFrame) -> pl.DataFrame:
    """Device time by the family of the innermost CPU op each launch call sits in (TraceLens's
    kernel-launcher view: every activity counted once, under its innermost op; `none`: launched outside
    every op), per rank. `cpu` holds the ranks' CPU events (rank, source, kind, name, ts_ns, dur_ns, pid, tid)."""
    points = launch_points(launched).drop_nulls(THREAD + ["at_ns"])
    if points.is_empty():
        return pl.DataFrame(schema={"rank": pl.Int64, "family": pl.String, "launches": pl.Int64, "device_ns": pl.Int64})
    ops = (cpu.lazy().filter((pl.col("kind") == "cpu_op") & pl.col("dur_ns").is_not_null()).drop_nulls(THREAD + ["ts_ns"])
           .select(*THREAD, "ts_ns", "name", end_ns=pl.col("ts_ns") + pl.col("dur_ns"))
           .sort("ts_ns", "end_ns", descending=[False, True], maintain_order=True).collect())
    found = launch.innermost_on_thread(ops, points.with_columns(ts_ns=pl.col("at_ns"), end_ns=pl.col("at_ns")), THREAD)
    owned = points.with_columns(op=launch.named(ops["name"], found))
    families = {n: family(n) for n in owned["op"].drop_nulls().unique().to_list()}  # rowwise-ok: per distinct op name
    return owned.with_columns(family=pl.col("op").replace_strict(families, default="none", return_dtype=pl.String)).group_by(
        "rank", "family").agg(launches=pl.len(), device_ns=pl.col("work_ns").sum().cast(pl.Int64)).select(
        "rank", "family", "launches", "device_ns")
