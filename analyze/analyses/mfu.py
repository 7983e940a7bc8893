"""How far the run is from the hardware: MFU and HFU with one stated peak and named numerators.

MFU = model FLOPs per step / (step time x GPUs x peak); HFU counts the FLOPs actually executed,
recomputation included. The step time is the run's one definition (analyze/analyses/step_time.py: the best
source the run has, warm-up and instrumented steps left out); only the profiler's own with_flops
count is divided by its own profiled window. The peak is the DENSE datasheet rate of the device for the dtype (never a
sparse rate, never a measured "achievable" one); every figure carries the peak, its source and the
numerator's definition. An unknown device gives no MFU and says how to supply a peak.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import polars as pl
import pyarrow as pa

from steplens.analyze.analyses.devices import DEVICES, match_device
from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.contract import schema
from steplens.analyze.contract.text import utilization_text
from steplens.analyze.contract.manifest import data_parallel_size


@dataclass
class Peak:
    flops: float  # per GPU, FLOP/s
    label: str  # what it is, for every printed figure


def peak_for(device_name: str | None, dtype: str, num_sms: int | None = None, peak_tflops: float | None = None,
             device_activity: bool | None = None, dtype_origin: str = "") -> tuple[Peak | None, str]:
    """The peak to divide by, or None with a message saying why and how to supply one.

    `device_activity`: whether the run's traces hold any device work (kernels, copies), None without
    traces; a run whose traces hold none ran on CPUs (DeepSpeed's cpu accelerator), where a GPU's
    peak means nothing."""
    if peak_tflops:
        return Peak(peak_tflops * 1e12, f"{peak_tflops:g} TFLOP/s per device (given with --peak-tflops)"), ""
    if not device_name:
        if device_activity is False:
            return None, ("the traces hold no GPU work (no kernels or copies: a CPU run); MFU is against the "
                          "device's peak: pass --peak-tflops (dense, per device) to compute it")
        where = "in the traces" if device_activity else "(no profiler traces or collector manifest name it)"
        return None, f"no device name {where}; pass --peak-tflops (dense, per GPU) to compute MFU"
    key = match_device(device_name, num_sms)
    if key is None:
        return None, f"unknown device {device_name!r}; pass --peak-tflops (dense, per GPU) to compute MFU"
    tflops = DEVICES[key].peak_tflops.get(dtype)
    if tflops is None:
        known = ", ".join(sorted(DEVICES[key].peak_tflops))  # the dtypes of this device's datasheet
        origin = f"; {dtype}: {dtype_origin}" if dtype_origin else ""
        return None, (f"no {dtype} peak for {key} (its datasheet's: {known}{origin}); pass --dtype with the job's "
                      "compute dtype, or --peak-tflops")
    return Peak(tflops * 1e12, f"{tflops:g} TFLOP/s dense {dtype}, {key} ({DEVICES[key].peak_source})"), ""


DTYPE_ASSUMED = "assumed: neither the traces' op shapes nor a DeepSpeed or Megatron config say it; pass --dtype"
# torch dtype names in DeepSpeed's torch_autocast config -> the peak table's
AUTOCAST_DTYPES = {"bfloat16": "bf16", "torch.bfloat16": "bf16", "float16": "fp16", "torch.float16": "fp16",
                   "half": "fp16"}


# The families whose FLOPs run on the tensor cores a dense peak rates: their dtype is the peak's.
PEAK_FAMILIES = ("gemm", "conv", "attention")
# GEMM kernels that run fp32 operands on TF32 tensor cores: cuBLAS's xmma kernels name the type (..._tf32f32_...), and
# CUTLASS's SM80 single-precision tensor-op kernels its 16x8x8 TF32 instruction (cutlass_80_tensorop_s1688gemm_...).
TF32_KERNEL = r"(?i)tf32|tensorop_s1688"
TF32_NOTE = ("; fp32 matmuls run on TF32 tensor cores when torch.backends.cuda.matmul.allow_tf32 (or "
             "set_float32_matmul_precision('high')) is set: then pass --dtype tf32")


def tf32_gemm_share(kernel_totals: pl.DataFrame) -> float:
    """The share of the GEMM kernels' time in kernels named as TF32 tensor-op GEMMs (TF32_KERNEL); 0 without any."""
    if kernel_totals.is_empty():
        return 0.0
    gemm = kernel_totals.filter(pl.col("category") == "gemm")
    total = gemm["time_ns"].sum()
    return float(gemm.filter(pl.col("name").str.contains(TF32_KERNEL))["time_ns"].sum() / total) if total else 0.0


def compute_dtype(given: str | None, dtype_flops: pl.DataFrame, facts: dict, device_key: str | None,
                  tf32_share: float = 0.0) -> tuple[str, str]:
    """The dtype whose dense peak MFU divides by, and where it came from: --dtype; else the dtype holding the most
    FLOPs of the traces' innermost matmuls, convolutions and attention (op_perf.dtype_flops; among the dtypes the
    device has a peak for; an fp32 convolution counts as tf32 on a device with TF32 tensor cores, where PyTorch runs
    it so by default: op_perf.with_roofline); else the run's config (the collector's engine dtype, Megatron's --bf16
    / --fp16, DeepSpeed's bf16 / fp16 / torch_autocast, else fp32, their default); else bf16, assumed. fp32 matmuls
    count as tf32 when most of the run's GEMM kernel time (`tf32_share`) is in TF32 tensor-op kernels."""
    if given:
        return given, "given with --dtype"
    rated_dtypes = list(DEVICES[device_key].peak_tflops) if device_key is not None else None
    counted = dtype_flops.filter(pl.col("dtype").is_not_null() & (pl.col("flops") > 0)
                                 & pl.col("family").is_in(PEAK_FAMILIES)) if not dtype_flops.is_empty() else dtype_flops
    if not counted.is_empty():
        tf32 = device_key is not None and "tf32" in DEVICES[device_key].peak_tflops
        on_tf32 = (pl.col("family") == "conv") | ((pl.col("family") != "conv") & pl.lit(tf32_share > 0.5))
        rated = counted.with_columns(dtype=pl.when(on_tf32 & (pl.col("dtype") == "fp32") & pl.lit(tf32))
                                     .then(pl.lit("tf32")).otherwise(pl.col("dtype")))
        if rated_dtypes is not None:  # (an integer or fp64 op has no dense tensor-core peak to be the run's)
            rated = rated.filter(pl.col("dtype").is_in(rated_dtypes))
        by_dtype = rated.group_by("dtype").agg(pl.col("flops").sum()).sort("flops", "dtype", descending=[True, False])
        if not by_dtype.is_empty():
            total = by_dtype["flops"].sum()
            top, share = by_dtype["dtype"][0], by_dtype["flops"][0] / total
            # the others that a rounded share would show
            others = ", ".join(f"{d} {f / total:.0%}" for d, f in by_dtype.tail(-1).head(2).iter_rows() if f / total >= 0.005)
            ran_on = (f", fp32 counted as tf32: {tf32_share:.0%} of the GEMM kernel time is in TF32 tensor-op kernels"
                      if tf32 and tf32_share > 0.5 and "fp32" in counted["dtype"].to_list() else "")
            return top, (f"the dtype of {share:.0%} of the FLOPs of the traces' innermost matmuls, convolutions and "
                         f"attention" + (f" ({others})" if others else "") + ran_on
                         + (TF32_NOTE if top == "fp32" and tf32 else ""))
    config = _config_dtype(facts)
    return (config, "the job's DeepSpeed or Megatron config") if config else ("bf16", DTYPE_ASSUMED)


def _config_dtype(facts: dict) -> str | None:
    """The compute dtype a DeepSpeed or Megatron run states: the collector's (from the engine), else Megatron's
    --bf16 / --fp16 arguments, else the DeepSpeed config (as JSON in the log or its printed bfloat16_enabled /
    fp16_enabled lines); None when nothing states it."""
    if facts.get("dtype") in ("bf16", "fp16", "fp32"):
        return facts["dtype"]
    megatron = facts.get("megatron_args") if isinstance(facts.get("megatron_args"), dict) else {}
    if megatron.get("bf16") is True or megatron.get("fp16") is True:  # (a command line's --bf16 flag alone too)
        return "bf16" if megatron.get("bf16") is True else "fp16"
    if megatron.get("bf16") is False and megatron.get("fp16") is False:
        return "fp32"  # Megatron's default
    config = facts.get("ds_config") if isinstance(facts.get("ds_config"), dict) else {}

    def enabled(key: str) -> bool:
        block = config.get(key)
        return isinstance(block, dict) and block.get("enabled") is True

    autocast = config.get("torch_autocast") if isinstance(config.get("torch_autocast"), dict) else {}
    if enabled("bf16") or enabled("bfloat16") or facts.get("bfloat16_enabled") is True:
        return "bf16"
    if enabled("fp16") or facts.get("fp16_enabled") is True:
        return "fp16"
    if autocast.get("enabled") is True and str(autocast.get("dtype")) in AUTOCAST_DTYPES:
        return AUTOCAST_DTYPES[str(autocast["dtype"])]
    if config or facts.get("bfloat16_enabled") is False or facts.get("fp16_enabled") is False:
        return "fp32"  # a DeepSpeed config with neither: fp32 weights and compute
    return None


@dataclass
class ModelShape:
    """For the PaLM numerator (Chowdhery et al. 2022, App. B): 6N + 12·L·d·T FLOPs per token (their 12·L·H·Q·T
    with H·Q = d, the hidden size)."""

    params: float  # N, non-embedding parameters
    layers: int  # L
    hidden: int  # d = heads x head dim
    seq_len: int  # T
    tokens_per_step: int  # global tokens per optimizer step

    def flops_per_step(self, recompute: bool = False) -> float:
        per_token = 6 * self.params + 12 * self.layers * self.hidden * self.seq_len
        # Full activation recompute runs the forward (a third of 6N + 12LdT) once more.
        return per_token * (4 / 3 if recompute else 1) * self.tokens_per_step


SHAPE_FIELDS = ("params", "layers", "hidden", "seq_len", "tokens_per_step")


def resolve_shape(given: dict | None, facts: dict) -> tuple[ModelShape | None, str, str]:
    """The analytic numerator's shape: each value from the command line (`given`), else the run's facts (the
    collector's model_shape and seq_len; tokens per step = the job's train_batch_size x the sequence length, wherever
    that came from). Returns (shape or None, where it came from, what is missing)."""
    given = {k: v for k, v in (given or {}).items() if v is not None}
    recorded = facts.get("model_shape") if isinstance(facts.get("model_shape"), dict) else {}
    from_facts = {"params": recorded.get("non_embedding_params"), "layers": recorded.get("layers"),
                  "hidden": recorded.get("hidden"), "seq_len": facts.get("seq_len") or facts.get("sequence_length")}
    values = {k: given.get(k, from_facts[k]) for k in SHAPE_FIELDS if k != "tokens_per_step"}
    batch, seq_len = facts.get("train_batch_size"), values["seq_len"]
    counted = batch * seq_len if type(batch) is int and batch > 0 and type(seq_len) is int else None
    values["tokens_per_step"] = given.get("tokens_per_step", counted)
    missing = [k for k in SHAPE_FIELDS if not (isinstance(values[k], (int, float)) and values[k] > 0)]
    if missing:
        return None, "", ", ".join(missing)
    recorded_fields = {k for k in ("params", "layers", "hidden", "seq_len") if k not in given}
    parts = []
    if given:
        parts.append("the command line")
    if recorded_fields:
        parts.append(f"the collector's manifest (layers and hidden size from the {recorded.get('shape_from')}, "
                     "parameters counted in the job)" if recorded_fields & {"params", "layers", "hidden"}
                     else "the run's recorded sequence length")
    if "tokens_per_step" not in given:
        parts.append(f"tokens per step = the job's train_batch_size {batch} x sequence length {seq_len}")
    return ModelShape(**{k: values[k] for k in SHAPE_FIELDS}), " and ".join(parts), ""


PALM_DEFINITION = ("analytic model FLOPs (PaLM): (6N + 12*L*d*T) per token x tokens per step, N the non-embedding "
                   "parameters (attention not causal-halved)")
PROFILER_DEFINITION = ("FLOPs counted by torch.profiler(with_flops=True) on the ops it knows (matmul, conv, "
                       "elementwise) in the step, forward and backward as executed: hardware FLOPs")
TRACE_DEFINITION = ("FLOPs from the traces' op shapes (steplens' formula for each op family): the outermost modelled ops of each "
                    "profiled step, forward and backward as executed (recomputation counted), mean over the traced ranks "
                    "x GPUs, median over the profiled steps")


def step_flops(cpu: pl.DataFrame) -> pl.DataFrame:
    """Profiler-counted FLOPs per rank and step (the with_flops numerator)."""
    counted = cpu.filter(pl.col("flops").is_not_null() & (pl.col("flops") > 0) & pl.col("step").is_not_null())
    return counted.group_by("rank", "step").agg(flops=pl.col("flops").sum())


COLLECTOR_DEFINITION = ("3 x the forward FLOPs DeepSpeed's FLOPs profiler counted for one micro batch on rank 0 "
                        "(forward + backward = 3 forward, no recompute; under ZeRO-3 its doubled Linear FLOPs halved), "
                        "x micro batches per step x data-parallel ranks")
DEEPSPEED_PROFILE_DEFINITION = ("3 x the 'fwd flops per GPU' of DeepSpeed's FLOPs-profiler summary (one micro batch's "
                                "forward; forward + backward = 3 forward, no recompute; printed with 2 decimals of its "
                                "unit, so within 0.5%), x micro batches per step x data-parallel x model-parallel ranks")
STEP_TIME_NOTE = "; step time: the run's step_time table, steps the summary keeps (warm-up and instrumented steps left out)"
COLUMNS = {"step": pl.Int64, "rank": pl.Int64, "metric": pl.String, "numerator": pl.String, "flops": pl.Float64,
           "step_time_ns": pl.Int64, "gpus": pl.Int64, "peak_flops": pl.Float64, "utilization": pl.Float64,
           "definition": pl.String, "peak": pl.String}


ZERO3_LINEAR_RATIO = (1.9, 2.0)  # ZeRO-3: a Linear's MACs over params x tokens (2x, the bias's share below)
SINGLE_LINEAR_RATIO = (0.95, 1.0)


def _zero3_corrected(exact: pl.DataFrame, facts: dict) -> tuple[float | None, str]:
    """The profile's total under ZeRO-3 with the double-counted linear FLOPs halved, when every linear call shows the
    doubling exactly; else None and why. ZeRO-3 counts each functional linear call twice: in a Linear module (any
    class named *Linear that ran) its MACs are 2 x its parameters x the micro batch's tokens, the bias aside; an
    nn.MultiheadAttention makes its input and output projections with functional linear calls of its own (its
    out_proj child never runs), 4 E^2 weights, so 2 x 4 E^2 x tokens of its MACs are the doubled projections."""
    tokens = (facts.get("micro_batch") or 0) * (facts.get("seq_len") or 0)
    linear = exact.filter(pl.col("module_class").str.ends_with("Linear") & (pl.col("macs_total") > 0))
    attention = exact.filter(pl.col("module_class") == "MultiheadAttention")
    if not tokens or (linear.is_empty() and attention.is_empty()):
        return None, ("the FLOPs profile was taken under ZeRO-3, which counts Linear FLOPs twice, and the micro batch's "
                      "tokens are unknown, so the double count cannot be checked: no MFU from it")
    root = float(exact.filter(pl.col("depth") == 0)["flops_total"].max())
    ratio = linear["macs_total"] / (linear["params"] * tokens)
    if ((ratio > SINGLE_LINEAR_RATIO[0]) & (ratio <= SINGLE_LINEAR_RATIO[1])).all() and attention.is_empty():
        return root, ""  # a DeepSpeed that counts once
    if not ((ratio > ZERO3_LINEAR_RATIO[0]) & (ratio <= ZERO3_LINEAR_RATIO[1])).all():
        return None, ("the FLOPs profile was taken under ZeRO-3, which counts Linear FLOPs twice, and not every Linear "
                      "shows exactly twice its work: no MFU from it")
    doubled = float(linear["flops_total"].sum()) / 2
    for module in attention.iter_rows(named=True):  # rowwise-ok: one row per attention module
        weights = _attention_projection_weights(module["params"])
        ran_children = exact.filter(pl.col("path").str.starts_with(f"{module['path']}.") & (pl.col("macs_total") > 0))
        if weights is None or not ran_children.is_empty() or module["macs_total"] < 2 * weights * tokens:
            return None, (f"the FLOPs profile was taken under ZeRO-3, which counts linear FLOPs twice, and the doubled "
                          f"projections of {module['path'] or module['module_class']} (MultiheadAttention) cannot be "
                          "told from its attention: no MFU from it")
        doubled += 2 * weights * tokens  # FLOPs = 2 x the doubled MACs counted once too many
    return root - doubled, ""


def _attention_projection_weights(params: int) -> int | None:
    """The weights of an nn.MultiheadAttention's four E x E projections (4 E^2) from its parameter count: 4 E^2 + 4 E
    with biases, 4 E^2 without; None for another layout (kdim or vdim apart from E, bias_kv)."""
    for biases in (True, False):
        embed = round((-4 + math.sqrt(16 + 16 * params)) / 8) if biases else round(math.sqrt(params / 4))
        if 4 * embed * embed + (4 * embed if biases else 0) == params and embed > 0:
            return 4 * embed * embed
    return None


def _micro_batches(facts: dict) -> int:
    """Micro batches per optimizer step (gradient accumulation), 1 when the run does not say."""
    return facts.get("gradient_accumulation_steps") or facts.get("grad_accum") or 1


def _collector_flops(flops_profile: pl.DataFrame, facts: dict, world_size: int) -> tuple[float | None, str]:
    """FLOPs per optimizer step from the collector's exact profile (under ZeRO-3 corrected where exact), or None and why not."""
    exact = flops_profile.filter(pl.col("exact").fill_null(False) & pl.col("source").str.starts_with("collector")) \
        if not flops_profile.is_empty() else flops_profile
    if exact.is_empty() or exact.filter(pl.col("depth") == 0).is_empty():
        return None, ""
    if "flops_zero3_double_counting" in (facts.get("collector_flags") or {}):
        forward, problem = _zero3_corrected(exact, facts)
        if forward is None:
            return None, problem
    else:
        forward = float(exact.filter(pl.col("depth") == 0)["flops_total"].max())
    return 3 * forward * _micro_batches(facts) * data_parallel_size(facts, world_size), ""


PROFILES_AGREE = 0.01  # two of DeepSpeed's profiles of one forward, each rounded to 2 decimals of its unit


def _deepspeed_profile_flops(flops_profile: pl.DataFrame, facts: dict, world_size: int) -> tuple[float | None, str]:
    """FLOPs per optimizer step from the summary of DeepSpeed's own FLOPs-profiler output (the root module's
    flops_total: its 'fwd flops per GPU'), or None and why not."""
    native = flops_profile.filter(~pl.col("source").str.starts_with("collector") & (pl.col("depth") == 0)
                                  & pl.col("flops_total").is_not_null() & (pl.col("flops_total") > 0)) \
        if not flops_profile.is_empty() else flops_profile
    if native.is_empty():
        return None, ""
    if facts.get("zero_stage") == 3:
        return None, ("DeepSpeed's FLOPs profile was taken under ZeRO-3, which counts Linear FLOPs twice, and its "
                      "rounded numbers cannot show the doubling exactly: no MFU from it")
    low, high = native["flops_total"].min(), native["flops_total"].max()
    if high > low * (1 + PROFILES_AGREE):  # a profile of another model or batch (print_model_profile can take any)
        shown = ", ".join(f"{row['flops_total']:,} in {row['source']}" for row in
                          native.unique("flops_total").sort("flops_total").head(3).iter_rows(named=True))
        return None, f"DeepSpeed's FLOPs profiles in the run disagree on the forward FLOPs ({shown}): no MFU from them"
    micro_batch, profiled_batch = facts.get("train_micro_batch_size_per_gpu"), facts.get("batch_size_per_gpu")
    if micro_batch and profiled_batch and micro_batch != profiled_batch:
        return None, (f"DeepSpeed's FLOPs profile counts a batch of {profiled_batch} per GPU and the run trains "
                      f"{micro_batch}: no MFU from it")
    model_parallel = facts.get("model_parallel_size") or 1
    data_parallel = facts.get("data_parallel_size") or data_parallel_size(facts, max(world_size // model_parallel, 1))
    if world_size > 1 and data_parallel * model_parallel != world_size:  # pipeline stages: each GPU one stage's share
        return None, (f"DeepSpeed's FLOPs profile is one GPU's share of the forward, and the run's {world_size} "
                      f"processes are not its {data_parallel} data-parallel x {model_parallel} model-parallel ranks "
                      "(pipeline stages?): no MFU from it")
    return 3 * float(high) * _micro_batches(facts) * data_parallel * model_parallel, ""


def trace_flops_per_step(step_flops: pl.DataFrame, gpus: int) -> float | None:
    """The traces' executed FLOPs of one optimizer step (`_trace_step_flops`: rank, step, flops, graphs): per
    profiled step the mean over the traced ranks x gpus, then the median over the profiled steps; a step that
    captures or replays a CUDA/HIP graph (on any rank) is not counted."""
    if step_flops.is_empty():
        return None
    graph_steps = step_flops.filter(pl.col("graphs"))["step"].unique().implode()
    counted = step_flops.filter(pl.col("flops").is_not_null() & ~pl.col("step").is_in(graph_steps))
    if counted.is_empty():
        return None
    per_step = counted.group_by("step").agg(flops=pl.col("flops").mean() * gpus)
    return float(per_step["flops"].median())


def graph_steps_note(step_flops: pl.DataFrame) -> str:
    """Why the traces' op shapes count no step, when the steps with modelled ops all capture or replay graphs."""
    graphs = step_flops.filter(pl.col("graphs") & pl.col("flops").is_not_null())["step"].unique().sort() \
        if not step_flops.is_empty() else []
    if not len(graphs):
        return ""
    steps = ", ".join(str(s) for s in graphs.head(5).to_list()) + (", ..." if len(graphs) > 5 else "")
    return (f"the traces' op shapes cannot count the profiled step(s) {steps}: they capture or replay CUDA/HIP graphs "
            "(a graph's ops are recorded when it is captured, when its kernels do not run, and not when it is "
            "replayed)")


def step_time_mfu(step_time: pl.DataFrame, flops_profile: pl.DataFrame, facts: dict, peak: Peak | None, world_size: int,
                  shape: ModelShape | None = None, recompute: bool = False, shape_origin: str = "",
                  trace_flops: float | None = None) -> tuple[pl.DataFrame, str]:
    """MFU (and HFU) per step over the run, on the one step-time definition (analyze/analyses/step_time.py).

    Numerators: the analytic (PaLM) count when the model shape is known; the collector's exact FLOPs profile
    (matmuls as 2 x MACs plus the other functional ops, one micro batch, x3 for the backward pass); the traces'
    FLOPs from op shapes, executed work (recomputation included): HFU beside another numerator, else the MFU.
    Only the steps the step-time summary keeps count. Returns the rows and, when a numerator was refused, why."""
    collector_flops, problem = _collector_flops(flops_profile, facts, world_size)
    native_flops, native_problem = (None, "") if collector_flops is not None else \
        _deepspeed_profile_flops(flops_profile, facts, world_size)
    problem = problem or native_problem
    kept = step_time.filter(~pl.col("excluded") & (pl.col("step_time_ns") > 0)) if not step_time.is_empty() else step_time
    if peak is None or kept.is_empty():
        return pl.DataFrame(schema=COLUMNS), problem
    variants = []
    if shape is not None:
        origin = f"; shape from {shape_origin}" if shape_origin else ""
        variants.append(("MFU", "palm", shape.flops_per_step(), PALM_DEFINITION + origin))
        if recompute:
            variants.append(("HFU", "palm", shape.flops_per_step(recompute=True),
                             PALM_DEFINITION + " + one forward recompute" + origin))
    if collector_flops is not None:
        variants.append(("MFU", "collector_flops_profile", collector_flops, COLLECTOR_DEFINITION))
    if native_flops is not None:
        variants.append(("MFU", "deepspeed_flops_profile", native_flops, DEEPSPEED_PROFILE_DEFINITION))
    if trace_flops:
        variants.append(("HFU" if variants else "MFU", "trace_shapes", trace_flops, TRACE_DEFINITION))
    frames = [kept.select(
        "step", rank=pl.lit(None, pl.Int64), metric=pl.lit(metric), numerator=pl.lit(numerator), flops=pl.lit(float(flops)),
        step_time_ns="step_time_ns", gpus=pl.lit(world_size, pl.Int64), peak_flops=pl.lit(peak.flops),
        utilization=utilization(flops, pl.col("step_time_ns"), world_size, peak.flops),
        definition=pl.lit(definition + STEP_TIME_NOTE), peak=pl.lit(peak.label))
        for metric, numerator, flops, definition in variants]
    return (pl.concat(frames).cast(COLUMNS) if frames else pl.DataFrame(schema=COLUMNS)), problem


def utilization(flops, step_time_ns, gpus, peak_flops) -> pl.Expr:
    """The one MFU/HFU ratio: a step's FLOPs / (its time x GPUs x the dense peak per GPU); each argument a column
    expression or a number."""
    return flops / (step_time_ns * 1e-9 * gpus * peak_flops)


def profiler_hfu(step_times: pl.DataFrame, counted_flops: pl.DataFrame, peak: Peak | None) -> pl.DataFrame:
    """HFU per rank and profiled step from the FLOPs torch.profiler(with_flops=True) counted in the step's
    own window (`counted_flops` is step_flops' table, possibly empty)."""
    if peak is None or counted_flops.is_empty():
        return pl.DataFrame(schema=COLUMNS)
    per_rank = counted_flops.join(step_times.select("rank", "step", "cpu_dur_ns"), on=["rank", "step"])
    return per_rank.filter(pl.col("cpu_dur_ns") > 0).select(
        "step", "rank", metric=pl.lit("HFU"), numerator=pl.lit("profiler_flops"), flops=pl.col("flops").cast(pl.Float64),
        step_time_ns="cpu_dur_ns", gpus=pl.lit(1, pl.Int64), peak_flops=pl.lit(peak.flops),
        utilization=utilization(pl.col("flops"), pl.col("cpu_dur_ns"), 1, peak.flops),
        definition=pl.lit(PROFILER_DEFINITION), peak=pl.lit(peak.label)).cast(COLUMNS).sort("step", "rank")


NUMERATOR_ORDER = ("palm", "megatron_args", "collector_flops_profile", "deepspeed_flops_profile", "trace_shapes",
                   "profiler_flops")
DISAGREE = 0.15  # two numerators of one step further apart than this (relative to the smaller) are named


def mfu_finding(table: pl.DataFrame, problem: str | None) -> list[dict] | dict:
    """Median utilization per metric and numerator, the headline first (model FLOPs before executed FLOPs, the
    analytic count before the profile before the traces), or why there is none."""
    if table.is_empty():
        return {"note": problem or "no FLOPs numerator: give the model shape (--params --layers --hidden), record op "
                                   "shapes (torch.profiler record_shapes=True), or take a FLOPs profile (the "
                                   "collector's, or DeepSpeed's flops_profiler)"}
    summary = table.group_by("metric", "numerator", "definition", "peak").agg(
        utilization=pl.col("utilization").median(), flops_per_step=pl.col("flops").median())
    order = {name: i for i, name in enumerate(NUMERATOR_ORDER)}
    return sorted(summary.to_dicts(), key=lambda r: (r["metric"] != "MFU", order.get(r["numerator"], len(order)),
                                                     r["definition"]))


def numerators_disagree(rows: list[dict]) -> list[dict]:
    """Pairs of step-time numerators (one row each, run-level) whose FLOPs per step differ by more than DISAGREE."""
    per_step = {r["numerator"]: r["flops_per_step"] for r in rows if r.get("flops_per_step") and r["numerator"] != "profiler_flops"}
    names = sorted(per_step, key=lambda n: NUMERATOR_ORDER.index(n) if n in NUMERATOR_ORDER else 99)
    return [{"numerators": [a, b], "flops_per_step": [per_step[a], per_step[b]], "ratio": per_step[b] / per_step[a]}
            for i, a in enumerate(names) for b in names[i + 1:]
            if abs(per_step[a] - per_step[b]) > DISAGREE * min(per_step[a], per_step[b])]


# ---------------------------------------------------------------------------------------------
# What it says


NUMERATOR_WORDS = {"palm": "the analytic count", "megatron_args": "Megatron's count", "trace_shapes": "the traces' op shapes",
                   "collector_flops_profile": "the collector's FLOPs profile",
                   "deepspeed_flops_profile": "DeepSpeed's FLOPs profile", "profiler_flops": "torch.profiler with_flops"}


# Why two FLOPs counts of one step differ, in either direction: what each counts.
COUNTS_DIFFER = ("the counts differ in what they hold: recomputation (in executed counts only), ops without a FLOPs "
                 "formula such as fused or custom kernels (missing from executed counts), and attention under a causal "
                 "mask (halved in the traces' op shapes, counted in full by DeepSpeed's FLOPs profiler and the analytic "
                 "count)")


def _dtype_origin(head: dict, findings: dict) -> str:
    """Where the peak's dtype came from, unless the peak was given whole (--peak-tflops)."""
    dtype = findings.get("mfu_dtype") or {}
    if not dtype.get("origin") or "--peak-tflops" in head.get("peak", ""):
        return ""
    return f"; {dtype['dtype']}: {dtype['origin']}"


def mfu_lines(utilization: list | dict, findings: dict) -> list[str]:
    """One headline figure with its numerator named, the other numerators beside it; where they disagree."""
    if isinstance(utilization, dict) and utilization.get("note"):
        return [f"MFU: not computed: {utilization['note']}."]
    if not isinstance(utilization, list) or not utilization:
        return []
    head, *others = utilization
    beside = "; ".join(f"{r['metric']} {utilization_text(r['utilization'])} from {NUMERATOR_WORDS.get(r['numerator'], r['numerator'])}"
                       for r in others)
    lines = [f"{head['metric']}: {utilization_text(head['utilization'])} (median over steps) from "
             f"{NUMERATOR_WORDS.get(head['numerator'], head['numerator'])}{f'; beside it {beside}' if beside else ''}. "
             f"Numerator: {head['definition']}. Peak: {head['peak']}{_dtype_origin(head, findings)}."]
    for pair in findings.get("mfu_numerators_disagree") or []:
        a, b = (NUMERATOR_WORDS.get(n, n) for n in pair["numerators"])
        lines.append(f"MFU numerators disagree: {b} gives {pair['ratio']:.2f}x the FLOPs per step of {a} "
                     f"({COUNTS_DIFFER}).")
    # An executed count below the model's is not always missed work: the model's count may hold work never executed.
    model = [r for r in utilization if r["metric"] == "MFU" and r.get("utilization") is not None]
    for row in (r for r in utilization if r["metric"] == "HFU" and r.get("utilization") is not None and model):
        if row["utilization"] < model[0]["utilization"]:
            lines.append(f"HFU below MFU: HFU {utilization_text(row['utilization'])} from "
                         f"{NUMERATOR_WORDS.get(row['numerator'], row['numerator'])} against MFU "
                         f"{utilization_text(model[0]['utilization'])} from {NUMERATOR_WORDS.get(model[0]['numerator'], model[0]['numerator'])}"
                         f" ({COUNTS_DIFFER}).")
    if findings.get("mfu_refused"):
        lines.append(f"MFU: one numerator left out: {findings['mfu_refused']}.")
    return lines


# ---------------------------------------------------------------------------------------------
# Its report section


def mfu_section(page, run):
    """The MFU figures with their numerators and peak, the FLOPs profiler's modules, and the roofline
    (roofline.py's finding)."""
    from steplens.analyze.analyses import roofline  # (roofline reads this module's device tables)

    profile = run.table("flops_profile")
    section = page.section("FLOPs and MFU", "mfu")
    utilization = run.findings.get("mfu")
    if isinstance(utilization, list) and utilization:
        section.text("Median over steps, with the numerator and peak each number divides:")
        section.rows(utilization, {"metric": ("metric", "text"), "utilization": ("median", "pct"),
                                   "numerator": ("numerator", "text"), "peak": ("peak", "text"),
                                   "definition": ("definition", "text")}, "mfu")
    else:
        note = (utilization or {}).get("note", "not computed") if isinstance(utilization, dict) else "not computed"
        section.text(f"MFU not computed: {note}.")
    if not profile.is_empty():
        modules = profile.filter(pl.col("depth") <= 2).sort("flops_total", descending=True, nulls_last=True).with_columns(
            duration_ns=pl.when(~pl.col("duration_bogus").fill_null(False)).then(pl.col("duration_ns")))  # see caveats
        section.text("FLOPs profiler, modules to depth 2 (theoretical counts, not time):")
        section.rows(modules, {
            "source": ("from", "text"), "path": ("module", "text"), "module_class": ("class", "text"),
            "params": ("params", "num"), "flops_total": ("FLOPs incl. children", "num"),
            "macs_total": ("MACs incl. children", "num"), "duration_ns": ("forward time", "ms")}, "flops_profile")
    roofline.roofline_blocks(section, run.findings.get("roofline"))
    return section


# ---------------------------------------------------------------------------------------------
# The analysis


def _mfu(inputs: Inputs) -> Output:
    from steplens.analyze.analyses import log_mfu, sanity  # (both import this module)

    context, facts = inputs.context, inputs.facts
    world_size = context.world_size or 1  # (no trace and no input stating it: one GPU)
    rows = [profiler_hfu(inputs.table("step_times"), inputs.table("_step_flops"), context.peak)] if inputs.ranks else []
    shape, origin, lacking = resolve_shape(inputs.options.shape, facts)
    # the user asked for the analytic count and it cannot be completed: say what it lacks
    missing = (f"the analytic numerator lacks {lacking}: give them (--params --layers --hidden --seq-len --tokens-per-step)"
               if inputs.options.shape and shape is None else "")
    step_flops = inputs.table("_trace_step_flops") if inputs.ranks else pl.DataFrame()
    trace_flops = trace_flops_per_step(step_flops, world_size) if inputs.ranks else None
    graphs_note = graph_steps_note(step_flops) if trace_flops is None and inputs.ranks else ""
    run_rows, problem = step_time_mfu(inputs.table("step_time"), inputs.table("flops_profile"), facts, context.peak,
                                      world_size, shape, inputs.options.recompute, origin, trace_flops)
    log_rows, log_problem = log_mfu.megatron_mfu(inputs.table("step_time"), facts, context.peak, world_size)
    # a logs-only Megatron run: the shape from its arguments
    found = [r for r in rows + [run_rows, log_rows] if not r.is_empty()]
    table = pl.concat(found, how="diagonal_relaxed") if found else pl.DataFrame()
    timed = inputs.table("step_time")
    no_step_time = ("no step time to divide by: no step was kept (the traces hold no ProfilerStep# window, and no "
                    "collector or log timed a step)" if timed.is_empty() or timed.filter(
                        ~pl.col("excluded") & (pl.col("step_time_ns") > 0)).is_empty() else "")
    table, finding = sanity.mark_impossible_mfu(
        table, mfu_finding(table, problem or log_problem or context.peak_problem or missing or no_step_time or graphs_note))
    qualified = {"mfu_dtype": {"dtype": inputs.options.dtype, "origin": context.dtype_origin}}
    if isinstance(finding, list) and (disagree := numerators_disagree(finding)):
        qualified["mfu_numerators_disagree"] = disagree
    if isinstance(finding, list) and (problem or missing):  # a numerator refused beside those computed
        qualified["mfu_refused"] = "; ".join(p for p in (problem, missing) if p)
    return Output(tables={"mfu": table}, finding=finding, qualified=qualified)


MFU = schema.table_spec(
    ("step", pa.int64(), "Step."),
    ("rank", pa.int64(), "Rank (null: the whole job)."),
    ("metric", pa.string(), "MFU (model FLOPs) or HFU (executed FLOPs)."),
    ("numerator", pa.string(), "palm (6N + 12LHQT per token), megatron_args, profiler_flops (torch.profiler "
                               "with_flops), trace_shapes, collector_flops_profile (3 x the collector's profiled "
                               "forward FLOPs) or deepspeed_flops_profile (3 x DeepSpeed's profiler summary's)."),
    ("flops", pa.float64(), "FLOPs in the step."),
    ("step_time_ns", pa.int64(), "Step time divided by."),
    ("gpus", pa.int64(), "GPUs."),
    ("peak_flops", pa.float64(), "Dense peak per GPU, FLOP/s."),
    ("utilization", pa.float64(), "flops / (step time x gpus x peak)."),
    ("definition", pa.string(), "The numerator's definition."),
    ("peak", pa.string(), "The peak, its dtype and source."),
    ("inputs_disagree", pa.string(), "Why the figure cannot be true (its utilization is then null; findings "
                                     "inputs_disagree)."),
)


ANALYSIS = Analysis("mfu", "FLOPs and MFU", ("step_times", "_step_flops", "_trace_step_flops", "step_time", "flops_profile"),
                    {"mfu": MFU}, _mfu, phrase=mfu_lines, section=mfu_section)
