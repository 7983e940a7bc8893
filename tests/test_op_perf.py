"""Per-op performance model, roofline and per-module time.

- FLOPs and bytes of each family against hand-computed values (the arithmetic is written out).
- On every corpus trace with shapes: the FLOPs of each aten::mm/addmm/bmm against the formula from its
  own Input Dims, and its device_ns against an independent recomputation from the raw JSON with the
  standard library (op -> the ops nested in it on its thread -> their External ids -> runtime calls ->
  correlation -> device work).
- A hand-built trace with nn.Module events, kernels of known durations and a collector FLOPs profile:
  module_perf and module_mfu against the numbers the trace was built from.
"""

import gzip
import json
import re
from collections import defaultdict
from decimal import Decimal
from pathlib import Path

import polars as pl
import pytest

from steplens.analyze.analyses import devices, mfu, op_model, op_perf
from steplens.analyze.pipeline import analyse

from conftest import CORPUS, write_trace

BF16, F32 = "c10::BFloat16", "float"


def _model(name, dims, types, concrete=None):
    return op_model.model(name, json.dumps(dims), json.dumps(types), json.dumps(concrete or [""] * len(dims)))


@pytest.mark.parametrize("name, dims, types, concrete, flops, nbytes", [
    # mm 64x128 @ 128x32: 2*64*32*128 = 524288; bytes (64*128 + 128*32 + 64*32) * 2 = 28672
    ("aten::mm", [[64, 128], [128, 32]], [BF16, BF16], None, 524288, 28672),
    # addmm adds beta*C: + 64*32 = 526336; fp32 bytes (8192 + 4096 + 2048) * 4 + C 32 * 4 = 57472
    ("aten::addmm", [[32], [64, 128], [128, 32], [], []], [F32, F32, F32, "Scalar", "Scalar"], None, 526336, 57472),
    # bmm batch 4: 4 * 524288; bytes 4 * 14336 * 2
    ("aten::bmm", [[4, 64, 128], [4, 128, 32]], [BF16, BF16], None, 2097152, 114688),
    # baddbmm: 4 * (524288 + 2048) = 2105344; bytes 114688 + C 4*64*32*2 = 16384
    ("aten::baddbmm", [[4, 64, 32], [4, 64, 128], [4, 128, 32], [], []], [BF16] * 3 + ["Scalar"] * 2, None, 2105344, 131072),
    # linear x[2,10,128] W[32,128] b[32]: M = 20: 2*20*32*128 + 20*32 = 164480; bytes (2560 + 4096 + 640 + 32) * 2 = 14656
    ("aten::linear", [[2, 10, 128], [32, 128], [32]], [BF16] * 3, None, 164480, 14656),
    # matmul broadcasting [8,1,64,128] @ [4,128,32]: batch 8*4 = 32: 2*32*64*32*128 = 16777216;
    # bytes (65536 + 16384 + 32*64*32) * 2 = 294912
    ("aten::matmul", [[8, 1, 64, 128], [4, 128, 32]], [BF16, BF16], None, 16777216, 294912),
    # conv 2x3x32x32, 16x3x3x3, bias, stride 2, pad 1: out 16 = (32 + 2 - 2 - 1)//2 + 1, out elems 2*16*16*16 = 8192;
    # 2 * 8192 * 27 + 8192 = 450560; bytes (6144 + 432 + 16 + 8192) * 4 = 59136
    ("aten::convolution", [[2, 3, 32, 32], [16, 3, 3, 3], [16], [], [], [], [], [], []], [F32] * 3 + ["ScalarList"] * 5 + ["Int"],
     ["", "", "", "[2, 2]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1"], 450560, 59136),
    # grouped conv: 1x8x10x10, weight 8x2x3x3, groups 4, no bias: out 1x8x8x8 = 512: 2 * 512 * 18 = 18432
    ("aten::convolution", [[1, 8, 10, 10], [8, 2, 3, 3], [], [], [], [], [], [], []], [F32, F32] + [""] * 7,
     ["", "", "", "[1, 1]", "[0, 0]", "[1, 1]", "False", "[0, 0]", "4"], 18432, (800 + 144 + 512) * 4),
    # flash SDPA q/k/v [2,4,128,64] causal: 2*2*4*128*128*(64+64) / 2 = 16777216; bytes 4 tensors of 65536 elems * 2
    ("aten::_scaled_dot_product_flash_attention", [[2, 4, 128, 64]] * 3 + [[], [], [], []], [BF16] * 3 + ["Scalar"] * 4,
     ["", "", "", "0.", "True", "False", ""], 16777216, 524288),
    # memory-efficient SDPA, not causal (is_causal at index 6): 33554432
    ("aten::_scaled_dot_product_efficient_attention", [[2, 4, 128, 64]] * 3 + [[], [], [], [], []], [BF16] * 3 + [""] * 5,
     ["", "", "", "", "False", "0.", "False", ""], 33554432, 524288),
    # flash backward (grad_out first, is_causal at 11): 2*2*4*128*128*(3*64 + 2*64) / 2 = 41943040;
    # bytes: q, k, v, dO read + dq, dk, dv written = 7 * 65536 * 2
    ("aten::_scaled_dot_product_flash_attention_backward", [[2, 4, 128, 64]] * 5 + [[2, 4, 128]] + [[]] * 9,
     [BF16] * 5 + [F32] + [""] * 9, [""] * 11 + ["True"] + [""] * 3, 41943040, 917504),
    # cuDNN attention backward, not causal (is_causal at 14): 2*2*4*128*128*(3*64 + 2*64) = 83886080
    ("aten::_scaled_dot_product_cudnn_attention_backward", [[2, 4, 128, 64]] * 5 + [[2, 4, 128, 1]] + [[]] * 10,
     [BF16] * 5 + [F32] + [""] * 10, [""] * 14 + ["False", ""], 83886080, 917504),
    # layer norm x[4,512] bf16 with weight and bias: bytes 2*2048*2 + (512 + 512)*2 = 10240; FLOPs: no formula
    ("aten::layer_norm", [[4, 512], [], [512], [512], [], []], [BF16, "ScalarList", BF16, BF16, "Scalar", "Scalar"], None,
     None, 10240),
    # add [4,512] + [512] broadcast: 2048 FLOPs; bytes (2048 + 512) * 2 read + 2048 * 2 written = 9216
    ("aten::add", [[4, 512], [512], []], [BF16, BF16, "Scalar"], None, 2048, 9216),
    # copy_: no FLOPs; 2048 fp32 read, 2048 bf16 written
    ("aten::copy_", [[4, 512], [4, 512], []], [BF16, F32, "Scalar"], None, 0, 2048 * 4 + 2048 * 2),
])
def test_flops_and_bytes_by_hand(name, dims, types, concrete, flops, nbytes):
    _, got_flops, got_bytes = _model(name, dims, types, concrete)
    assert got_flops == flops and got_bytes == nbytes


@pytest.mark.parametrize("name, dims, types, concrete", [
    ("aten::mm", [[64, 128], [64, 32]], [BF16, BF16], None),  # K does not match
    ("aten::mm", [[64, 128], "x"], [BF16, BF16], None),  # malformed
    ("aten::mm", [[64, 128], [128, 32]], ["c10::SomethingNew", BF16], None),  # element size unknown
    ("aten::_scaled_dot_product_flash_attention", [[2, 4, 128, 64], [2, 4, 256, 64], [2, 4, 256, 64]] + [[]] * 4,
     [BF16] * 3 + [""] * 4, ["", "", "", "0.", "True", "False", ""]),  # causal with N_q != N_kv: not one half
    ("aten::_scaled_dot_product_flash_attention", [[2, 4, 128, 64]] * 3 + [[]] * 4, [BF16] * 3 + [""] * 4,
     ["", "", "", "", "", "", ""]),  # is_causal not recorded
    ("aten::conv2d", [[1, 3, 8, 8], [4, 3, 3, 3], [], [], [], [], []], [F32] * 2 + [""] * 5, ["", "", "", "[1]", "same", "[1]", "1"]),
    ("aten::my_custom_op", [[4, 4]], [F32], None),
    ("aten::mm", [[10 ** 200, 10 ** 200], [10 ** 200, 10 ** 200]], [BF16, BF16], None),  # beyond a float
    ("aten::add", [[-4, 512], [512]], [BF16, BF16], None),  # a negative dimension
])
def test_no_formula_or_bad_shapes_give_null_flops(name, dims, types, concrete):
    assert _model(name, dims, types, concrete)[1] is None


def _wrapper_linear_addmm_mm(linear_type: str, mm_type: str) -> pl.DataFrame:
    """op_perf of four ops on one thread, no device work: my::wrapper [-5, 195] (no model) around aten::linear
    [0, 100] holding aten::addmm [10, 60] (bf16), then aten::mm of zero length at 100."""
    mm, lin = json.dumps([[64, 128], [128, 32]]), json.dumps([[64, 128], [32, 128], [32]])
    addmm = json.dumps([[32], [64, 128], [128, 32], [], []])
    rows = [("my::wrapper", -5, 200, "[[1]]", '["float"]'), ("aten::linear", 0, 100, lin, json.dumps([linear_type] * 3)),
            ("aten::addmm", 10, 50, addmm, json.dumps([BF16] * 3 + ["Scalar"] * 2)),
            ("aten::mm", 100, 0, mm, json.dumps([mm_type] * 2))]
    ops = pl.DataFrame({"rank": [0] * 4, "source": ["s"] * 4, "event_id": [1, 2, 3, 4], "ts_ns": [r[1] for r in rows],
                        "dur_ns": [r[2] for r in rows], "name": [r[0] for r in rows], "pid": [1] * 4, "tid": [1] * 4,
                        "step": [None] * 4, "external_id": [1, 2, 3, 4], "input_dims": [r[3] for r in rows],
                        "input_types": [r[4] for r in rows], "concrete_inputs": [None] * 4})
    launched = pl.DataFrame(schema={"rank": pl.Int64, "source": pl.String, "launch_pid": pl.Int64, "launch_tid": pl.Int64,
                                    "launch_ts_ns": pl.Int64, "dur_ns": pl.Int64})
    return op_perf.op_perf(ops, launched, op_perf.Roof())


def test_nested_marks_ops_inside_another_modeled_op_only():
    """The linear holds the addmm; the mm of zero length at the linear's end sits beside it, not in it; the
    unmodeled op around everything encloses nothing."""
    perf = _wrapper_linear_addmm_mm(BF16, BF16)
    assert dict(perf.select("name", "nested").iter_rows()) == {"my::wrapper": False, "aten::linear": False,
                                                                "aten::addmm": True, "aten::mm": False}
    assert perf["device_ns"].to_list() == [0, 0, 0, 0] and perf["bound"].is_null().all()  # no device work, no roofline


def test_innermost_marks_the_op_that_ran_the_arithmetic():
    """Autocast: an fp32 aten::linear holds the bf16 aten::addmm that ran it; the mm of zero length at its end
    holds nothing; an op without FLOPs is never innermost."""
    perf = _wrapper_linear_addmm_mm(F32, F32)
    assert dict(perf.select("name", "innermost").iter_rows()) == {"my::wrapper": False, "aten::linear": False,
                                                                   "aten::addmm": True, "aten::mm": True}
    by_dtype = dict(op_perf.dtype_flops(perf).select("dtype", "flops").iter_rows())
    # addmm 2*64*32*128 + 64*32 (bf16); mm 2*64*32*128 (fp32): the linear's own count is not added
    assert by_dtype == {"bf16": 2 * 64 * 32 * 128 + 64 * 32, "fp32": 2 * 64 * 32 * 128}


def _dtype_flops(rows: list[tuple[str, str, float]]) -> pl.DataFrame:
    return pl.DataFrame({"rank": [0] * len(rows), "dtype": [r[0] for r in rows], "family": [r[1] for r in rows],
                         "flops": [r[2] for r in rows]}, schema={"rank": pl.Int64, "dtype": pl.String, "family": pl.String,
                                                                 "flops": pl.Float64})


@pytest.mark.parametrize("given, rows, facts, device, dtype, origin", [
    ("fp8", [("bf16", "gemm", 9.0)], {}, "h100-sxm", "fp8", "--dtype"),
    (None, [("fp32", "gemm", 7.0), ("bf16", "attention", 3.0)], {"dtype": "bf16"}, "a100", "fp32", "70% of the FLOPs"),
    (None, [("fp32", "conv", 7.0), ("fp32", "gemm", 3.0)], {}, "a100", "tf32", "70%"),  # convolutions on TF32 cores
    (None, [("fp32", "conv", 7.0), ("fp32", "gemm", 3.0)], {}, "v100-sxm", "fp32", "100%"),  # V100: no TF32
    # elementwise and integer ops never pick the peak: the matmuls do, else the config
    (None, [("bf16", "gemm", 1.0), ("fp32", "elementwise", 9.0)], {}, "h100-sxm", "bf16", "100%"),
    (None, [("int", "gemm", 9.0)], {"ds_config": {"bf16": {"enabled": True}}}, "h100-sxm", "bf16", "config"),
    (None, [("fp64", "gemm", 3.0), ("bf16", "gemm", 1.0)], {}, "a100", "bf16", "100%"),  # no fp64 peak in the table
    (None, [(None, "gemm", 5.0)], {"dtype": "fp16"}, "a100", "fp16", "DeepSpeed or Megatron config"),  # no op dtype: the config
    (None, [], {"ds_config": {"bf16": {"enabled": True}}}, None, "bf16", "DeepSpeed or Megatron config"),
    (None, [], {"ds_config": {"bf16": {"enabled": "auto"}, "fp16": {"enabled": True}}}, None, "fp16", "DeepSpeed or Megatron config"),
    (None, [], {"ds_config": {"train_batch_size": 8}}, None, "fp32", "DeepSpeed or Megatron config"),  # neither enabled
    (None, [], {"ds_config": {"torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}}}, None, "bf16", "config"),
    (None, [], {"bfloat16_enabled": False, "fp16_enabled": True}, None, "fp16", "DeepSpeed"),  # the log's lines
    (None, [], {"megatron_args": {"bf16": False, "fp16": True}}, None, "fp16", "Megatron config"),
    (None, [], {"megatron_args": {"bf16": False, "fp16": False}}, None, "fp32", "Megatron config"),
    (None, [], {"megatron_args": {"bf16": True}}, None, "bf16", "Megatron config"),  # a command line's --bf16
    (None, [], {"megatron_args": {"num_layers": 2}}, None, "bf16", "assumed"),
    (None, [], {}, None, "bf16", "assumed"),
])
def test_the_peaks_dtype_is_the_runs_own(given, rows, facts, device, dtype, origin):
    got, said = mfu.compute_dtype(given, _dtype_flops(rows), facts, device)
    assert got == dtype and origin in said


@pytest.mark.parametrize("kernels, device, dtype", [
    ([("cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4", "gemm", 6), ("ampere_sgemm_64x32_nn", "gemm", 4)],
     "a100", "tf32"),
    ([("sm80_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize64x64x32", "gemm", 9), ("ampere_sgemm_64x32_nn", "gemm", 1)],
     "a100", "tf32"),
    ([("ampere_sgemm_128x64_nn", "gemm", 9), ("cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4", "gemm", 1)],
     "a100", "fp32"),  # mostly SIMT fp32 GEMMs: fp32, and the note says how to say otherwise
    ([("cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4", "gemm", 9)], "v100-sxm", "fp32"),  # (no TF32 peak)
])
def test_fp32_matmuls_that_ran_on_tf32_kernels_take_the_tf32_peak(kernels, device, dtype):
    """fp32 GEMMs whose kernels are TF32 tensor-op kernels (allow_tf32 set) ran at the TF32 rate: dividing by the fp32
    peak would read 8x too high on an A100."""
    totals = pl.DataFrame({"name": [k[0] for k in kernels], "category": [k[1] for k in kernels],
                           "rank": [0] * len(kernels), "time_ns": [k[2] for k in kernels]})
    share = mfu.tf32_gemm_share(totals)
    assert share == pytest.approx(sum(k[2] for k in kernels if "s1688" in k[0] or "tf32" in k[0]) / sum(k[2] for k in kernels))
    got, said = mfu.compute_dtype(None, _dtype_flops([("fp32", "gemm", 1.0)]), {}, device, share)
    assert got == dtype
    assert ("allow_tf32" in said) == (dtype == "fp32" and device == "a100")
    assert (f"{share:.0%} of the GEMM kernel time is in TF32 tensor-op kernels" in said) == (dtype == "tf32")


def test_roofline_position_by_hand():
    """H100 SXM: bf16 989.5 TFLOP/s, tf32 494.5, fp32 67, 3.35 TB/s. 1e9 FLOPs and 1e6 bytes in 10 us:
    100 TFLOP/s, 0.1 TB/s, 1000 FLOPs/byte."""
    roof = op_perf.device_roof("NVIDIA H100 80GB HBM3", 132)
    rows = pl.DataFrame({"dtype": ["bf16", "fp32", "fp32", "bf16", "bf16"], "family": ["gemm", "gemm", "conv", "normalization", "gemm"],
                         "flops": [1e9, 1e9, 1e9, None, 1e9], "bytes": [1e6, 1e6, 1e6, 1e6, 1e8], "device_ns": [10_000] * 5})
    got = op_perf.with_roofline(rows, roof)
    assert got["achieved_tflops"].to_list()[:3] == [100.0] * 3 and got["achieved_tbps"][0] == pytest.approx(0.1)
    # bf16 ridge 989.5 / 3.35 = 295 <= 1000: compute-bound, 100 / 989.5 of the peak
    assert got["bound"].to_list() == ["compute", "compute", "compute", "memory", "memory"]
    assert got["fraction_of_peak"][0] == pytest.approx(100 / 989.5)
    assert got["fraction_of_peak"][1] == pytest.approx(100 / 67)  # fp32 matmul: against the fp32 peak
    assert got["fraction_of_peak"][2] == pytest.approx(100 / 494.5)  # fp32 convolution: TF32 by default
    assert got["fraction_of_peak"][3] == pytest.approx(0.1 / 3.35)  # no FLOPs model: bytes-bound
    assert got["fraction_of_peak"][4] == pytest.approx(10 / 3.35)  # 10 FLOPs/byte < 295: against the bandwidth


def test_unknown_device_has_no_roofline_and_says_why():
    roof = op_perf.device_roof("Some Future GPU", None)
    assert roof.bandwidth is None and "Some Future GPU" in roof.problem
    a100 = op_perf.device_roof("NVIDIA A100-PG509-200", 108)
    assert a100.bandwidth is None and "memory variant" in a100.problem
    h100 = op_perf.device_roof("NVIDIA H100 80GB HBM3", 132)
    assert h100.bandwidth == 3.35e12 and h100.flops["bf16"] == 989.5e12 and f"v{devices.PEAK_TABLE_VERSION}" in h100.label


# ---------------------------------------------------------------------------------------------
# Corpus: every trace with shapes and GEMMs, against the raw JSON

GEMMS = {"aten::mm", "aten::addmm", "aten::bmm"}
WORK_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"}
CALL_CATS = {"cuda_runtime", "runtime", "cuda_driver"}
SIZE_LIMIT = 20_000_000  # uncompressed bytes (2 cores: the two 30 MB HTA trace_diff files are left out)


def _corpus_files() -> list[Path]:
    if not CORPUS.is_dir():
        return []
    found = []
    for path in sorted(p for p in CORPUS.rglob("*") if p.name.endswith((".json", ".gz"))):
        data = _raw(path)
        if len(data) <= SIZE_LIMIT and b'"Input Dims"' in data and any(f'"{g}"'.encode() in data for g in GEMMS):
            found.append(path)
    return found


def _raw(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def _gemm_flops(name: str, dims: list):
    """2*M*N*K (+ M*N for addmm's added term), batch for bmm; None when the shapes do not multiply."""
    try:
        if name == "aten::mm" and dims[0][1] == dims[1][0]:
            return 2 * dims[0][0] * dims[1][1] * dims[0][1]
        if name == "aten::addmm" and dims[1][1] == dims[2][0]:
            return 2 * dims[1][0] * dims[2][1] * dims[1][1] + dims[1][0] * dims[2][1]
        if name == "aten::bmm" and dims[0][2] == dims[1][1] and dims[0][0] == dims[1][0]:
            return 2 * dims[0][0] * dims[0][1] * dims[1][2] * dims[0][2]
    except (IndexError, TypeError):
        pass
    return None


def _reference(path: Path) -> dict:
    """{External id of each GEMM op: (flops, device ns)} from the raw file, no steplens code."""
    doc = json.loads(_raw(path), parse_float=Decimal)
    events = [e for e in (doc if isinstance(doc, list) else doc["traceEvents"]) if isinstance(e, dict) and e.get("ph") == "X"]
    ns = lambda v: int(Decimal(v) * 1000)  # noqa: E731
    work_by_corr = defaultdict(int)
    for e in events:
        if str(e.get("cat")).lower() in WORK_CATS and "correlation" in (e.get("args") or {}) and "dur" in e:
            work_by_corr[e["args"]["correlation"]] += max(ns(e["dur"]), 0)
    ops_by_thread = defaultdict(list)
    for e in events:
        if str(e.get("cat")).lower() in ("cpu_op", "operator") and "External id" in (e.get("args") or {}) and "dur" in e:
            ops_by_thread[(e.get("pid"), e.get("tid"))].append((ns(e["ts"]), ns(e["ts"]) + ns(e["dur"]), e))
    op_ids = {o["args"]["External id"] for ops in ops_by_thread.values() for _, _, o in ops}
    corrs_by_ext, calls_by_thread = defaultdict(list), defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        if str(e.get("cat")).lower() in CALL_CATS and "correlation" in args:
            if args.get("External id") in op_ids:
                corrs_by_ext[args["External id"]].append(args["correlation"])
            else:  # older traces: the call's External id is its own correlation, naming no op; its thread and time do
                calls_by_thread[(e.get("pid"), e.get("tid"))].append((ns(e["ts"]), args["correlation"]))
    expected = {}
    for thread, thread_ops in ops_by_thread.items():
        for start, end, op in thread_ops:
            if op["name"] not in GEMMS or "Input Dims" not in op["args"]:
                continue
            inside = {o["args"]["External id"] for s, t, o in thread_ops if start <= s and t <= end}
            corrs = [c for x in inside for c in corrs_by_ext[x]] + [c for at, c in calls_by_thread[thread] if start <= at <= end]
            expected[op["args"]["External id"]] = (_gemm_flops(op["name"], op["args"]["Input Dims"]),
                                                   sum(work_by_corr[c] for c in corrs))
    return expected


@pytest.fixture(scope="module")
def corpus_op_perf(tmp_path_factory):
    results = {}
    for path in _corpus_files():
        out = tmp_path_factory.mktemp("opperf") / "out"
        analyse(path.parent, out, files=[path], jobs=1)
        launched = pl.read_parquet(out / "kernel_launches").filter(pl.col("launch_api").is_not_null())["dur_ns"].sum()
        findings = json.loads((out / "findings.json").read_text())
        families = findings["roofline"]["time_by_op_family"]
        results[path.relative_to(CORPUS).as_posix()] = (path, pl.read_parquet(out / "op_perf"), launched, families,
                                                        findings)
    return results


def test_corpus_gemm_flops_and_device_time_match_the_raw_json(corpus_op_perf):
    if not corpus_op_perf:
        pytest.skip("no corpus")
    checked = 0
    for name, (path, perf, _, _, _) in corpus_op_perf.items():
        expected = _reference(path)
        gemms = perf.filter(pl.col("name").is_in(list(GEMMS)))
        got = {x: (f, d) for x, f, d in gemms.select("external_id", "flops", "device_ns").iter_rows()}
        assert set(got) == set(expected), name
        for ext, (flops, device_ns) in expected.items():
            assert got[ext][0] == flops, (name, ext)
            assert got[ext][1] == device_ns, (name, ext, got[ext][1], device_ns)
        checked += len(expected)
    assert checked > 1000  # every GEMM of 30+ real traces


RAW_DTYPES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16"}


def test_corpus_mfu_divides_by_the_peak_of_the_dtype_its_gemms_ran_in(corpus_op_perf):
    """The raw JSON's innermost GEMMs (aten::mm/addmm/bmm holding no other GEMM on their thread), FLOPs by their first
    input's type: where one dtype holds all of them, it is the peak's dtype (no --dtype given)."""
    checked = 0
    for name, (path, _, _, _, findings) in corpus_op_perf.items():
        doc = json.loads(_raw(path), parse_float=Decimal)
        events = [e for e in (doc if isinstance(doc, list) else doc["traceEvents"]) if isinstance(e, dict)
                  and e.get("ph") == "X" and e.get("name") in GEMMS and "Input type" in (e.get("args") or {}) and "dur" in e]
        spans = defaultdict(list)
        for e in events:
            spans[(e.get("pid"), e.get("tid"))].append((Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"]), e))
        flops_by_type = defaultdict(int)
        for thread in spans.values():
            for start, end, e in thread:
                holds = any(o is not e and start <= s < end and t <= end for s, t, o in thread)
                flops = _gemm_flops(e["name"], e["args"]["Input Dims"])
                if not holds and flops:
                    flops_by_type[RAW_DTYPES.get(e["args"]["Input type"][1 if e["name"] == "aten::addmm" else 0])] += flops
        if len(flops_by_type) != 1 or None in flops_by_type:
            continue
        (dtype,) = flops_by_type
        # fp32 GEMMs whose kernels ran on TF32 tensor cores (most GEMM kernel time), on a device that has them
        gemm_ns = defaultdict(int)
        for e in (doc if isinstance(doc, list) else doc["traceEvents"]):
            if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") == "kernel" and "gemm" in str(e.get("name")).lower():
                gemm_ns[bool(re.search(r"(?i)tf32|tensorop_s1688", e["name"]))] += int(Decimal(e["dur"]) * 1000)
        devices = " ".join(str(d.get("name")) for d in (doc.get("deviceProperties") or []) if isinstance(d, dict)) \
            if isinstance(doc, dict) else ""
        if dtype == "fp32" and gemm_ns[True] > gemm_ns[False] and re.search(r"A100|H100|H200|B200|MI300", devices):
            dtype = "tf32"
        assert findings["mfu_dtype"]["dtype"] == dtype, name
        for row in findings["mfu"] if isinstance(findings["mfu"], list) else []:
            assert f"dense {dtype}," in row["peak"], name
        checked += 1
    assert checked >= 2 or not corpus_op_perf


def test_corpus_roofline_columns_are_consistent(corpus_op_perf):
    if not corpus_op_perf:
        pytest.skip("no corpus")
    for name, (_, perf, launched_ns, families, _) in corpus_op_perf.items():
        # every launched activity is counted once, under the family of its innermost op
        assert sum(f["device_ns"] for f in families) == launched_ns, name
        timed = perf.filter((pl.col("device_ns") > 0) & pl.col("flops").is_not_null())
        # achieved TFLOP/s is flops over device time, whatever the device
        assert ((timed["achieved_tflops"] - timed["flops"] / timed["device_ns"] / 1e3).abs() < 1e-9).all(), name
        assert perf.filter(pl.col("bound").is_not_null() & (pl.col("device_ns") == 0))["fraction_of_peak"].is_null().all()
    bert = corpus_op_perf.get("TraceLens/h100/gaunernst_bert-small-uncased__1016001.json.gz")
    if bert:  # H100 SXM: ridge 989.5e12 / 3.35e12 = 295 FLOPs/byte for bf16
        rows = bert[1].filter(pl.col("bound").is_not_null() & pl.col("intensity").is_not_null() & (pl.col("dtype") == "bf16"))
        assert rows.height > 0
        assert (rows.filter(pl.col("bound") == "compute")["intensity"] >= 989.5 / 3.35).all()
        assert (rows.filter(pl.col("bound") == "memory")["intensity"] < 989.5 / 3.35).all()


# ---------------------------------------------------------------------------------------------
# Modules: a hand-built trace with known per-module time


def _x(name, cat, ts, dur, pid=1, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _module_trace(path: Path) -> Path:
    """Model_0 { Linear_0 (mm 64x128x32 -> kernel 10 us), Block_0 { Linear_1 (mm -> 30 us) }, Linear_0 again (mm -> 6 us) };
    a kernel launched outside every module (4 us) belongs to none. On the autograd thread, MmBackward0
    (linked by a fwdbwd flow to Linear_1's mm) launches a 20 us kernel."""
    mm = {"Input Dims": [[64, 128], [128, 32]], "Input type": [BF16, BF16], "Concrete Inputs": ["", ""]}
    events = [_x("ProfilerStep#3", "user_annotation", 0, 1000),
              _x("nn.Module: Model_0", "python_function", 10, 500),
              _x("nn.Module: Linear_0", "python_function", 20, 50),
              _x("nn.Module: Block_0", "python_function", 100, 200),
              _x("nn.Module: Linear_1", "python_function", 110, 100),
              _x("nn.Module: Linear_0", "python_function", 400, 50)]
    launches = [(1, 25, 10), (2, 120, 30), (3, 405, 6), (4, 700, 4)]
    for corr, at, kernel_us in launches:
        events.append(_x("aten::mm", "cpu_op", at, 8, **{"External id": corr, **mm}))
        events.append(_x("cudaLaunchKernel", "cuda_runtime", at + 1, 2, **{"External id": corr, "correlation": corr}))
        events.append(_x("gemm_kernel", "kernel", 800 + corr * 50, kernel_us, pid=0, tid=7, device=0, stream=7, correlation=corr))
    events += [_x("MmBackward0", "cpu_op", 900, 50, tid=2, **{"External id": 9}),
               _x("cudaLaunchKernel", "cuda_runtime", 905, 2, tid=2, **{"External id": 9, "correlation": 5}),
               _x("gemm_kernel", "kernel", 1100, 20, pid=0, tid=7, device=0, stream=7, correlation=5),
               {"ph": "s", "id": 77, "pid": 1, "tid": 1, "ts": 120, "cat": "fwdbwd", "name": "fwdbwd"},
               {"ph": "f", "id": 77, "pid": 1, "tid": 2, "ts": 900, "cat": "fwdbwd", "name": "fwdbwd", "bp": "e"}]
    return write_trace(path, events, deviceProperties=[{"name": "NVIDIA H100 80GB HBM3", "numSms": 132}])


def test_module_time_and_flops_from_a_hand_built_trace(tmp_path):
    trace = _module_trace(tmp_path / "run" / "rank0.pt.trace.json")
    out = tmp_path / "out"
    analyse(trace.parent, out, jobs=1)
    table = pl.read_parquet(out / "module_perf")
    modules = {m: row for m, *row in table.select("module", "calls", "device_ns", "flops", "achieved_tflops").iter_rows()}
    backward = dict(table.select("module", "backward_device_ns").iter_rows())
    assert backward == {"Model_0": 20_000, "Model_0/Block_0": 20_000, "Model_0/Block_0/Linear_1": 20_000, "Model_0/Linear_0": 0}
    mm_flops = 2 * 64 * 32 * 128
    assert modules["Model_0"] == [1, 46_000, 3 * mm_flops, pytest.approx(3 * mm_flops / 46_000 / 1e3)]
    assert modules["Model_0/Linear_0"][:3] == [2, 16_000, 2 * mm_flops]  # two calls in the step
    assert modules["Model_0/Block_0"][:3] == [1, 30_000, mm_flops]
    assert modules["Model_0/Block_0/Linear_1"][:3] == [1, 30_000, mm_flops]
    perf = pl.read_parquet(out / "op_perf").sort("external_id")
    assert perf["device_ns"].to_list() == [10_000, 30_000, 6_000, 4_000]
    findings = json.loads((out / "findings.json").read_text())["roofline"]
    assert findings["top_ops"][0]["calls"] == 4 and findings["top_ops"][0]["device_ns"] == 50_000
    assert findings["modules_below_peak"][0]["fraction_of_peak"] == pytest.approx(mm_flops / 30_000 / 1e3 * 1e12 / 989.5e12)
    # every launch under its innermost op: the four mm (gemm) and MmBackward0 (no family of its own)
    assert [(f["family"], f["launches"], f["device_ns"]) for f in findings["time_by_op_family"]] == [
        ("gemm", 4, 50_000), ("other", 1, 20_000)]
    below = {m["module"]: m for m in findings["modules_below_peak"]}
    # forward + backward: 3 x the forward FLOPs over 30 us forward + 20 us backward; Linear_0 has no backward
    assert below["Model_0/Block_0"]["training_fraction_of_peak"] == pytest.approx(3 * mm_flops / 50e-6 / 989.5e12)
    assert below["Model_0/Linear_0"]["training_fraction_of_peak"] is None


def test_a_module_whose_gemms_ran_outside_every_modeled_op_gets_no_rate(tmp_path):
    """A compiled module (seen in a real xDiT Flux trace): its GEMM runs under "Torch-Compiled Region", which has no
    FLOPs formula, and its only modeled op is a copy (0 FLOPs): FLOPs over its time would read 0% of peak. A module
    whose unmodeled op is a layer norm (memory-bound, FLOPs negligible) keeps its rate, as ResNet's BatchNorm does."""
    trace = _module_trace(tmp_path / "run" / "rank0.pt.trace.json")
    events = json.loads(trace.read_text())
    copy = {"Input Dims": [[64, 128], [64, 128], []], "Input type": [BF16, BF16, "Scalar"], "Concrete Inputs": ["", "", "False"]}
    mm = {"Input Dims": [[64, 128], [128, 32]], "Input type": [BF16, BF16], "Concrete Inputs": ["", ""]}
    norm = {"Input Dims": [[64, 128], [], [128], [128], []], "Input type": [BF16, "ScalarList", BF16, BF16, "Scalar"],
            "Concrete Inputs": ["", "[128]", "", "", "1e-05"]}
    events["traceEvents"] += [
        _x("nn.Module: Wrapper_0", "python_function", 590, 260),  # the root, which the ranking leaves out
        _x("nn.Module: Compiled_0", "python_function", 600, 90),
        _x("aten::copy_", "cpu_op", 605, 5, **{"External id": 21, **copy}),
        _x("cudaLaunchKernel", "cuda_runtime", 606, 2, **{"External id": 21, "correlation": 21}),
        _x("copy_kernel", "kernel", 1200, 2, pid=0, tid=7, device=0, stream=7, correlation=21),
        _x("Torch-Compiled Region: 0/0", "cpu_op", 620, 60, **{"External id": 22}),
        _x("cudaLaunchKernel", "cuda_runtime", 625, 2, **{"External id": 22, "correlation": 22}),
        _x("Cijk_Alik_Bljk_BBS_MT256x192x64", "kernel", 1210, 40, pid=0, tid=7, device=0, stream=7, correlation=22),
        _x("nn.Module: Block_9", "python_function", 750, 90),
        _x("aten::mm", "cpu_op", 755, 8, **{"External id": 23, **mm}),
        _x("cudaLaunchKernel", "cuda_runtime", 756, 2, **{"External id": 23, "correlation": 23}),
        _x("gemm_kernel", "kernel", 1300, 10, pid=0, tid=7, device=0, stream=7, correlation=23),
        _x("aten::native_layer_norm", "cpu_op", 770, 8, **{"External id": 24, **norm}),
        _x("cudaLaunchKernel", "cuda_runtime", 771, 2, **{"External id": 24, "correlation": 24}),
        _x("vectorized_layer_norm_kernel", "kernel", 1320, 30, pid=0, tid=7, device=0, stream=7, correlation=24)]
    trace.write_text(json.dumps(events))
    out = tmp_path / "out"
    analyse(trace.parent, out, jobs=1)
    table = pl.read_parquet(out / "module_perf")
    rows = {m: row for m, *row in table.select("module", "device_ns", "unknown_flops_device_ns", "flops", "achieved_tflops").iter_rows()}
    assert rows["Wrapper_0/Compiled_0"] == [42_000, 40_000, 0.0, None]  # 40 of its 42 us: a GEMM under no modeled op
    mm_flops = 2 * 64 * 32 * 128
    assert rows["Wrapper_0/Block_9"][:3] == [40_000, 0, mm_flops]  # the layer norm's 30 us have negligible FLOPs
    assert rows["Wrapper_0/Block_9"][3] == pytest.approx(mm_flops / 40_000 / 1e3)
    assert rows["Model_0/Block_0/Linear_1"][1:3] == [0, mm_flops]  # its GEMM is its mm's
    below = {m["module"]: m for m in json.loads((out / "findings.json").read_text())["roofline"]["modules_below_peak"]}
    compiled = below["Wrapper_0/Compiled_0"]
    assert compiled["fraction_of_peak"] is None and compiled["training_fraction_of_peak"] is None
    assert compiled["unknown_flops_share"] == pytest.approx(40 / 42)
    assert below["Wrapper_0/Block_9"]["fraction_of_peak"] == pytest.approx(mm_flops / 40e-6 / 989.5e12)
    from click.testing import CliRunner
    from steplens.analyze.cli import analyze

    result = CliRunner().invoke(analyze, [str(trace.parent), "--out", str(tmp_path / "out2"), "-q"])
    text = " ".join(result.output.split())
    assert "Module furthest below peak: Wrapper_0/Block_9" in text and "Compiled_0, 0.0%" not in text
    from steplens.reports import html
    assert "96% of it" in html.render(out)  # the report says how much of its time has unknown FLOPs (40 of 42 us), rounded up


def test_report_and_summary_show_the_roofline_with_names_escaped(tmp_path):
    trace = _module_trace(tmp_path / "run" / "rank0.pt.trace.json")
    trace.write_text(trace.read_text().replace("nn.Module: Block_0", "nn.Module: <script>alert(1)</script>_0"))
    out = tmp_path / "out"
    analyse(trace.parent, out, jobs=1)
    from steplens.reports import html, markdown
    page = html.render(out)
    assert "Top modeled ops by device time" in page and "roof bf16: 989.5 TFLOP/s, 3.35 TB/s" in page  # the scatter's roof
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;_0" in page
    summary = markdown.render(out)
    assert "**Roofline**" in summary and "aten::mm" in summary and "<script>" not in summary


def test_terminal_names_the_busiest_op_and_the_module_furthest_below_peak(tmp_path):
    from click.testing import CliRunner
    from steplens.analyze.cli import analyze

    trace = _module_trace(tmp_path / "run" / "rank0.pt.trace.json")
    result = CliRunner().invoke(analyze, [str(trace.parent), "--out", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # lines are wrapped at the terminal width
    # 4 mm calls, 10 + 30 + 6 + 4 us; peak bf16 989.5 TFLOP/s over 3.35 TB/s
    assert "Busiest modeled op: aten::mm (64x128, 128x32) x4: 0.050 ms, memory-bound" in text
    assert "Module furthest below peak: Model_0/Block_0" in text


def test_the_busiest_op_says_its_calls_and_time_are_summed_over_ranks():
    """real-8r's top op: one 7.334 ms copy on each of 8 ranks read as 'x8: 58.672 ms' (eight calls on one rank)."""
    from steplens.analyze.analyses.roofline import op_line
    op = {"name": "aten::_to_copy", "shapes": "[[13899792], []]", "calls": 8, "ranks": 8, "device_ns": 8 * 7_334_000}
    assert op_line(op, "no roofline") == "aten::_to_copy (13899792) x8 over 8 ranks: 58.672 ms, no roofline"
    assert op_line({**op, "ranks": 1}, "no roofline") == "aten::_to_copy (13899792) x8: 58.672 ms, no roofline"


def test_module_mfu_joins_the_collectors_flops_profile(tmp_path):
    from steplens.analyze.analyses import module_perf
    modules = pl.DataFrame({"rank": [0, 0, 0], "step": [3, 3, 3], "module": ["Model_0", "Model_0/Linear_0", "Model_0/Block_0/Linear_1"],
                            "module_class": ["Model", "Linear", "Linear"], "depth": [0, 1, 2], "calls": [1, 2, 1],
                            "device_ns": [46_000, 16_000, 30_000], "flops": [None, None, None], "achieved_tflops": [None] * 3,
                            "backward_device_ns": [90_000, 32_000, 0]})
    profile = pl.DataFrame({"rank": [0] * 5, "source": ["c"] * 5, "path": ["", "first", "blocks", "blocks.0", "blocks.0.proj"],
                            "module_class": ["Model", "Linear", "ModuleList", "Block", "Linear"],
                            "flops_total": [3_000_000, 1_000_000, 0, 2_000_000, 2_000_000], "exact": [True] * 5})
    roof = op_perf.device_roof("NVIDIA H100 80GB HBM3", 132)
    table = module_perf.module_mfu(modules, profile, {}, roof, "bf16").sort("module")
    # sorted by module: Model_0, Model_0/Block_0/Linear_1 (the second Linear), Model_0/Linear_0 (the first)
    assert table["profile_path"].to_list() == ["", "blocks.0.proj", "first"]
    # Linear_0 called twice: 2 x 1e6 FLOPs over 16 us
    linear0 = table.filter(pl.col("module") == "Model_0/Linear_0").row(0, named=True)
    assert linear0["mfu"] == pytest.approx(2e6 / 16e-6 / 989.5e12)
    # training: 3 x forward FLOPs (backward = 2 x forward) over forward + backward time (16 + 32 us)
    assert linear0["training_flops"] == 6e6 and linear0["training_mfu"] == pytest.approx(6e6 / 48e-6 / 989.5e12)
    assert table.filter(pl.col("module") == "Model_0/Block_0/Linear_1")["training_mfu"][0] is None  # no backward time
    zero3 = module_perf.module_mfu(modules, profile, {"collector_flags": {"flops_zero3_double_counting": "x"}}, roof, "bf16")
    assert zero3["mfu"].is_null().all() and zero3["flag"].str.contains("ZeRO-3").all()
    # Two Linear instances in the trace but one in the profile: the class is not matched
    short = profile.filter(pl.col("path") != "first")
    assert "Linear" not in module_perf.module_mfu(modules, short, {}, roof, "bf16")["module_class"].to_list()


# ---------------------------------------------------------------------------------------------
# A real 2-rank DeepSpeed job (CPU, gloo) with the collector's FLOPs profile and a profiler window with
# Python stacks (nn.Module events need with_stack: with_modules alone records none in eager mode).


@pytest.fixture(scope="module")
def stack_profiled_run(tmp_path_factory):
    from conftest import _realrun  # noqa: F401  (skips without torch/deepspeed)

    pytest.importorskip("deepspeed")
    import sys
    sys.path.insert(0, str(Path(__file__).parent / "realrun"))
    from launch import run_tiny_gpt

    out_dir = tmp_path_factory.mktemp("realrun") / "stack"
    out_dir.mkdir(parents=True)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 100,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 2},
              "steplens": {"run_dir": str(out_dir), "flush_every": 4, "seq_len": 64, "flops_step": 2,
                           "profile": {"skip_first": 3, "wait": 1, "warmup": 1, "active": 1, "repeat": 1},
                           "profile_with_stack": True}}
    (out_dir / "config.json").write_text(json.dumps(config))
    run_tiny_gpt(out_dir, "--steps", "8", "--deepspeed_config", str(out_dir / "config.json"))
    analyse(out_dir, out_dir / ".steplens", jobs=1)
    return out_dir


def test_real_collector_run_joins_its_flops_profile_to_the_traced_modules(stack_profiled_run):
    out = stack_profiled_run / ".steplens"
    joined = pl.read_parquet(out / "module_mfu")
    profile = pl.read_parquet(stack_profiled_run / "collector" / "flops_profile").filter(pl.col("rank") == 0)
    params = dict(profile.select("path", "params").iter_rows())
    # Every Linear the trace shows is matched, and to a profile module of its own shape: the weight and
    # bias of the aten::linear inside it (read from the raw trace) hold exactly the profile's parameters.
    linears = joined.filter(pl.col("module_class") == "Linear")
    assert linears.height == 2 * profile.filter(pl.col("module_class") == "Linear").height  # one window step, 2 ranks
    weights = {}
    for trace in sorted((stack_profiled_run / "traces").glob("rank0.*.json.gz")):
        events = [e for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"] if e.get("ph") == "X"]
        modules = [e for e in events if str(e.get("name", "")).startswith("nn.Module: Linear_")]
        for op in (e for e in events if e.get("name") == "aten::linear"):
            owner = min((m for m in modules if m["tid"] == op["tid"] and m["ts"] <= op["ts"] <= m["ts"] + m["dur"]),
                        key=lambda m: m["dur"], default=None)
            if owner:
                dims = op["args"]["Input Dims"]
                weights[owner["name"].removeprefix("nn.Module: ")] = dims[1][0] * dims[1][1] + (dims[2][0] if dims[2] else 0)
    rank0 = linears.filter(pl.col("rank") == 0)
    assert rank0.height > 0
    for module, path in rank0.select("module", "profile_path").unique().iter_rows():
        assert weights[module.rsplit("/", 1)[-1]] == params[path], (module, path)
    # forward FLOPs = the profile's forward FLOPs of the module x its calls in the step
    totals = dict(profile.select("path", "flops_total").iter_rows())
    assert all(f == totals[p] * c for p, c, f in joined.select("profile_path", "calls", "forward_flops").iter_rows())
