"""The roofline findings: the ops with the most device time and where they sit against the device's
roofs, and the modules furthest below peak (findings.json `roofline`; report and summary render it)."""

from __future__ import annotations

import math
import polars as pl

from steplens.analyze.analyses import module_perf, op_perf
from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.contract.text import shapes_text
from steplens.analyze.contract.text import tensor_shapes_text

TOP_MODULES = 10
MODULE_FRACTION_DEFINITION = ("achieved TFLOP/s of the module's forward (FLOPs of its modeled ops, or the collector's "
                              "FLOPs profile where it joins) over the dense peak of the run's dtype; training: forward + "
                              "backward (backward = 2 x forward FLOPs) over forward + backward device time; none where "
                              f"more than {module_perf.MAX_UNKNOWN_FLOPS_SHARE:.0%} of the module's forward device time is "
                              "GEMM, convolution, attention or Triton-template kernels launched outside every op with a "
                              "FLOPs formula (a torch.compile region: unknown FLOPs)")


def roofline_finding(op_totals: pl.DataFrame, modules: pl.DataFrame, module_mfu: pl.DataFrame, roof: op_perf.Roof,
                     dtype: str, family_time: pl.DataFrame | None = None, steps_device_ns: int = 0) -> dict:
    """Top ops by device time with their roofline position and share of the profiled steps' device spans
    (`steps_device_ns`: step_breakdown's spans summed over ranks and steps); the modules (of the most device time)
    furthest below peak."""
    top = op_perf.top_ops(op_totals, roof)
    if not top.is_empty():
        top = top.with_columns(step_share=pl.col("device_ns") / steps_device_ns if steps_device_ns
                               else pl.lit(None, pl.Float64))
    finding: dict = {
        "roof": {"label": roof.label, "bandwidth_tbps": roof.bandwidth / 1e12 if roof.bandwidth else None,
                 "peak_tflops": {k: v / 1e12 for k, v in roof.flops.items()}} if roof.bandwidth else None,
        "note": roof.problem or None,
        "top_ops": top.select("name", "family", "shapes", "dtype", "calls", "ranks", "device_ns", "flops", "bytes",
                              "achieved_tflops", "achieved_tbps", "intensity", "bound", "fraction_of_peak",
                              "step_share").to_dicts()
        if not top.is_empty() else [],
        "step_share_definition": "the op's device time over the profiled steps' device spans (step_breakdown's "
                                 "span_ns, idle included: not over the device's busy time), both summed over ranks",
        "top_ops_definition": "ops with a FLOPs/bytes model (ops without one, such as cuDNN's convolution backward "
                              "before PyTorch 1.11, are not ranked) not nested in another such op, grouped by name, "
                              "shapes and dtype, summed over ranks; device time = device work launched under the op "
                              "(nested ops included)",
        "modules_below_peak": _modules_below_peak(modules, module_mfu, roof.flops.get(dtype)),
        "modules_definition": MODULE_FRACTION_DEFINITION + f" ({dtype})",
        "time_by_op_family": _family_shares(family_time),
        "time_by_op_family_definition": "device time of every kernel, memcpy and memset under the family of the "
                                        "innermost CPU op its launch call sits in (none: launched outside every op), "
                                        "summed over ranks",
    }
    return finding


def _modules_below_peak(modules: pl.DataFrame, module_mfu: pl.DataFrame, peak: float | None) -> list[dict]:
    """Among the TOP_MODULES modules with the most forward device time (the root left out), lowest fraction first."""
    if modules.is_empty():
        return []
    if not module_mfu.is_empty():
        joined = module_mfu.group_by("module", "module_class", "profile_path").agg(
            device_ns=pl.col("device_ns").sum(), flops=pl.col("forward_flops").sum(), flag=pl.col("flag").first(),
            backward_device_ns=pl.col("backward_device_ns").sum(), source=pl.lit("collector_flops_profile"),
            unknown_flops_device_ns=pl.lit(0, pl.Int64))  # the profile's FLOPs are the whole module's
    else:
        joined = modules.filter(pl.col("depth") > 0).group_by("module", "module_class").agg(
            device_ns=pl.col("device_ns").sum(), flops=pl.when(pl.col("flops").is_not_null().any()).then(pl.col("flops").sum()),
            unknown_flops_device_ns=pl.col("unknown_flops_device_ns").sum(), profile_path=pl.lit(None, pl.String), flag=pl.lit(None, pl.String),
            backward_device_ns=pl.col("backward_device_ns").sum(), source=pl.lit("op_shapes"))
    busiest = joined.filter(pl.col("device_ns") > 0).sort("device_ns", "module", descending=[True, False]).head(TOP_MODULES)
    achieved = module_perf.achieved_tflops("flops", "device_ns", "unknown_flops_device_ns")
    # Training: forward + backward (2 x forward FLOPs) over forward + backward time, where backward time was linked.
    both_ns = pl.col("device_ns") + pl.col("backward_device_ns")
    training = pl.when((pl.col("backward_device_ns") > 0) & achieved.is_not_null()).then(3 * pl.col("flops") / both_ns / 1e3)
    trusted = pl.col("flag").is_null()
    rated = busiest.with_columns(
        achieved_tflops=achieved, unknown_flops_share=pl.col("unknown_flops_device_ns") / pl.col("device_ns"),
        fraction_of_peak=pl.lit(None, pl.Float64) if not peak else pl.when(trusted).then(achieved * 1e12 / peak),
        training_fraction_of_peak=pl.lit(None, pl.Float64) if not peak else pl.when(trusted).then(training * 1e12 / peak))
    return rated.sort("fraction_of_peak", "device_ns", descending=[False, True], nulls_last=True).to_dicts()


def _family_shares(family_time: pl.DataFrame | None) -> list[dict]:
    if family_time is None or family_time.is_empty():
        return []
    total = family_time.group_by("family").agg(pl.col("launches", "device_ns").sum())
    return total.with_columns(share=pl.col("device_ns") / pl.col("device_ns").sum()).sort(
        "device_ns", "family", descending=[True, False]).to_dicts()


# ---------------------------------------------------------------------------------------------
# What it says


MIN_OP_SHARE = 0.01  # a busiest op below 1% of the steps' device time says nothing worth a reviewer's line


# What a bound op's fraction_of_peak divides by (op_perf.with_roofline): the FLOP/s peak, or the memory bandwidth.
PEAK_OF_BOUND = {"compute": "peak FLOP/s", "memory": "memory bandwidth"}


def op_line(op: dict, note: str | None = None) -> str:
    """One op of the roofline: name, tensor shapes, calls, device time, where it sits against the roof."""
    where = (f"{op['bound']}-bound, {op['fraction_of_peak']:.1%} of {PEAK_OF_BOUND.get(op['bound'], 'peak')}"
             if op.get("fraction_of_peak") is not None else note or "no roofline")
    over = f" over {op['ranks']} ranks" if (op.get("ranks") or 1) > 1 else ""  # calls and time are summed over them
    return f"{op['name']} ({tensor_shapes_text(op['shapes'])}) x{op['calls']}{over}: {op['device_ns'] / 1e6:.3f} ms, {where}"


def module_line(module: dict) -> str:
    return (f"{module['module']}, {module['fraction_of_peak']:.1%} of peak FLOP/s over {module['device_ns'] / 1e6:.3f} ms of "
            "forward device time")


def roofline_lines(finding: dict) -> list[str]:
    """The busiest modeled op and the module furthest below peak."""
    lines = []
    top = (finding.get("top_ops") or [None])[0]
    if top and (top.get("step_share") is None or top["step_share"] >= MIN_OP_SHARE):
        share = (f"; {top['step_share']:.1%} of the profiled steps' device spans (idle included)" if top.get("step_share") is not None
                 else "")
        lines.append(f"Busiest modeled op: {op_line(top, finding.get('note'))}{share}.")
    if rated := [m for m in finding.get("modules_below_peak") or [] if m.get("fraction_of_peak") is not None]:
        lines.append(f"Module furthest below peak: {module_line(rated[0])}.")
    return lines


# ---------------------------------------------------------------------------------------------
# Its report section


OP_COLUMNS = {"name": "op", "shapes": "shapes", "dtype": "dtype", "calls": "calls", "device_ns": "device time",
              "achieved_tflops": "TFLOP/s", "achieved_tbps": "TB/s", "intensity": "FLOPs/byte", "bound": "bound",
              "fraction_of_peak": "of peak (FLOP/s or bandwidth, as bound)"}
MODULE_COLUMNS = {"module": "module", "module_class": "class", "profile_path": "profile path",
                  "device_ns": "forward device time", "unknown_flops_share": "unknown FLOPs", "achieved_tflops": "TFLOP/s",
                  "fraction_of_peak": "of peak FLOP/s", "backward_device_ns": "backward device time",
                  "training_fraction_of_peak": "of peak, fwd+bwd", "flag": "flag"}


def _cell(name: str, value) -> str:
    if name in ("device_ns", "backward_device_ns"):
        return f"{value / 1e6:.3f} ms"
    if name in ("fraction_of_peak", "training_fraction_of_peak"):
        return f"{value:.1%}"
    if name == "unknown_flops_share":  # whole percent, rounded up: 10.1% must not read as the 10% that still gives a rate
        return f"{math.ceil(value * 100)}% of it" if value > 0 else ""
    if name == "shapes":
        return shapes_text(value)
    if isinstance(value, float):
        return f"{value:,.3g}"
    return str(value)


def _columns(columns: dict[str, str]) -> dict[str, tuple[str, object]]:
    return {name: (header, lambda value, name=name: _cell(name, value)) for name, header in columns.items()}


def on_the_roofline(op: dict) -> bool:
    """Whether a top op has a point on the roofline's log-log axes: intensity and achieved FLOP/s both above zero
    (FLOPs, bytes moved and device time all counted). An op that moves bytes but does no FLOPs the models count
    (a copy, a cast) has none."""
    intensity, achieved = op.get("intensity"), op.get("achieved_tflops")
    return intensity is not None and achieved is not None and intensity > 0 and achieved > 0


def roofline_blocks(section, finding: dict | None) -> None:
    """The roofline part of the FLOPs and MFU section (mfu.mfu_section): the scatter of the top modeled ops,
    their table, device time by op family, and the modules furthest below peak."""
    if not finding:
        return
    if finding.get("note"):
        section.text(finding["note"] + ".")
    if finding.get("top_ops"):
        section.text("Top modeled ops by device time and their place on the roofline ("
                     + finding["top_ops_definition"] + "):")
        if finding.get("roof"):
            if any(on_the_roofline(op) for op in finding["top_ops"]):
                section.figure("roofline_scatter", finding["top_ops"], finding["roof"])
            else:
                section.text("No roofline figure: none of these ops has FLOPs, bytes moved and device time all above "
                             "zero, so none has a point on it.")
            section.text("Roofs: " + finding["roof"]["label"] + ".")
        # Numbered as the roofline's points are (figures.roofline_scatter).
        numbered = [{"number": number, **op} for number, op in enumerate(finding["top_ops"], 1)]
        section.rows(numbered, _columns({"number": "#", **OP_COLUMNS}), "op_perf", limit=len(numbered))
    if families := finding.get("time_by_op_family"):
        section.text("Device time by the family of the innermost op that launched it: " + ", ".join(
            f"{f['family']} {f['share']:.0%} ({f['device_ns'] / 1e6:.3f} ms)" for f in families) + ".")
    if finding.get("modules_below_peak"):
        section.text("Modules furthest below peak, among those with the most forward device time ("
                     + finding["modules_definition"] + "):")
        rows = finding["modules_below_peak"]
        section.rows(rows, _columns(MODULE_COLUMNS), "module_perf", limit=len(rows))


# ---------------------------------------------------------------------------------------------
# The analysis


def _roofline(inputs: Inputs) -> Output:
    ranked = bool(inputs.ranks)
    return Output(finding=roofline_finding(
        inputs.table("_op_totals") if ranked else pl.DataFrame(), inputs.table("module_perf"), inputs.table("module_mfu"),
        inputs.context.roof, inputs.options.dtype, inputs.table("_family_time") if ranked else pl.DataFrame(),
        inputs.table("step_breakdown")["span_ns"].sum() if ranked else 0))


ANALYSIS = Analysis("roofline", "Roofline", ("_op_totals", "_family_time", "module_perf", "module_mfu", "step_breakdown"), {},
                    _roofline, phrase=lambda finding, findings: roofline_lines(finding))
