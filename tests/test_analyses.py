"""The analyses against known answers: generated runs (tests/synthetic.py truth) and hand-computed cases."""

import json

import polars as pl
import pytest
from click.testing import CliRunner

from steplens.analyze.analyses import comms, devices, mfu, runner
from steplens.analyze.cli import analyze
from steplens.analyze.pipeline.ingest import ingest
from steplens.analyze.pipeline import analyse
from synthetic import generate_run

from conftest import CORPUS, write_trace


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    run = tmp_path_factory.mktemp("gen") / "run"
    generate_run(run, ranks=4, steps=5, seed=3, stragglers=[(2, 12)])
    truth = json.loads((run / "truth.json").read_text())
    out = run / ".steplens"
    findings = {}
    findings.update(analyse(run, out, jobs=1)[1])
    return out, truth, findings


def _table(out, name):
    return pl.read_parquet(out / name / "*.parquet")


def test_clock_offsets_within_10us(analysed):
    out, truth, _ = analysed
    offsets = _table(out, "clock_offsets").sort("rank")
    for rank, offset, uncertainty in offsets.select("rank", "offset_ns", "uncertainty_ns").iter_rows():
        assert abs(offset - truth["ranks"][str(rank)]["clock_offset_ns"]) <= 10_000
        assert uncertainty <= 10_000


def test_straggler_rank_and_step_exact(analysed):
    out, truth, findings = analysed
    stats = _table(out, "step_stats")
    found = stats.filter(pl.col("straggler_rank").is_not_null()).select("straggler_rank", "step").rows()
    assert found == [(s["rank"], s["step"]) for s in truth["stragglers"]]
    assert [(s["rank"], s["step"]) for s in findings["steps"]["stragglers"]] == found
    # Aligned step wall time across ranks matches the true duration once clocks are aligned.
    for step, dur in stats.select("step", "aligned_dur_ns").iter_rows():
        assert abs(dur - truth["step_true_duration_ns"][str(step)]) <= 10_000


def test_idle_split_matches_truth(analysed):
    out, truth, _ = analysed
    idle = _table(out, "gpu_idle").filter(pl.col("stream") == 7)
    for rank, info in truth["ranks"].items():
        for step, expected in info["idle"].items():
            row = idle.filter((pl.col("rank") == int(rank)) & (pl.col("step") == int(step))).row(0, named=True)
            assert row["busy_ns"] == pytest.approx(expected["compute_stream_busy_ns"], rel=0.02)
            for mine, theirs in (("host_bound_ns", "host_bound_idle_ns"), ("sync_ns", "sync_idle_ns"), ("other_ns", "other_idle_ns")):
                assert row[mine] == pytest.approx(expected[theirs], rel=0.02, abs=1000), (rank, step, mine)
            assert row["busy_ns"] + row["idle_ns"] == row["span_ns"]


def test_exposed_communication_matches_truth(analysed):
    out, truth, _ = analysed
    calls = _table(out, "collectives")
    for rank, info in truth["ranks"].items():
        per_step = dict(calls.filter(pl.col("rank") == int(rank)).group_by("step").agg(pl.col("exposed_ns").sum()).iter_rows())
        for step, expected in info["exposed_comm_ns"].items():
            assert per_step[int(step)] == pytest.approx(expected, rel=0.02, abs=1000)
        by_seq = {c["seq"]: c for c in info["collectives"]}
        mine = calls.filter(pl.col("rank") == int(rank)).select("seq", "exposed_ns", "bytes", "busbw_gbps", "dur_ns")
        for seq, exposed, nbytes, busbw, dur in mine.iter_rows():
            c = by_seq[seq]
            n = c["group_size"]
            assert exposed == c["exposed_ns"]
            assert dur == c["kernel_end_ns"] - c["kernel_start_ns"]
            # nccl-tests S: the whole output for allgather (truth records the per-rank input), else the input.
            expected = c["bytes"] * n if c["name"] == "_allgather_base" else c["bytes"]
            assert nbytes == expected
            factor = 2 * (n - 1) / n if c["name"] == "allreduce" else (n - 1) / n
            assert busbw == pytest.approx(expected / dur * factor, rel=1e-12)


def test_launch_apis_all_counted(analysed):
    out, truth, _ = analysed
    launched = _table(out, "kernel_launches")
    apis = set(launched["launch_api"].drop_nulls())
    assert {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"} <= apis
    # No device activity is dropped: every one is in the table, and every one has its launch.
    for rank, info in truth["ranks"].items():
        mine = launched.filter(pl.col("rank") == int(rank))
        expected = sum(info["event_counts"][k] for k in ("kernel", "gpu_memcpy", "gpu_memset"))
        assert mine.height == expected == info["launch_links"]
        assert mine["launch_api"].null_count() == 0


def test_sync_points_name_the_issuing_op(analysed):
    out, _, _ = analysed
    points = _table(out, "sync_points")
    assert not points.is_empty()
    blocking = points.filter(pl.col("name") == "cudaMemcpy")
    assert set(blocking["issuing_op"]) == {"aten::_local_scalar_dense"}


def test_sync_points_name_the_step_the_call_ran_in(analysed):
    """A sync's idle can fall in the next step's device time; the row names the ProfilerStep whose
    window holds the call itself (read from the raw JSON), as the issuing annotation does."""
    import gzip
    from decimal import Decimal

    out, _, _ = analysed
    points = _table(out, "sync_points")
    assert points.filter(pl.col("issuing_op").str.starts_with("ProfilerStep#")).height > 0
    for rank, step, name, issuing, ts_ns in points.select("rank", "step", "name", "issuing_op", "ts_ns").iter_rows():
        trace = next(p for p in out.parent.iterdir() if p.name.startswith(f"rank-{rank}.") or p.name.startswith(f"rank{rank}."))
        opener = gzip.open if trace.suffix == ".gz" else open
        with opener(trace, "rt") as f:
            doc = json.load(f, parse_float=Decimal)
        events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
        base_ns = int(doc.get("baseTimeNanoseconds", 0))  # Kineto's ts count from it when it is there
        call = next(e for e in events if e["name"] == name and base_ns + Decimal(e["ts"]) * 1000 == ts_ns)
        windows = [int(e["name"].split("#")[1]) for e in events if e["name"].startswith("ProfilerStep#")
                   and Decimal(e["ts"]) <= Decimal(call["ts"]) < Decimal(e["ts"]) + Decimal(e["dur"])]
        assert [step] == windows, (rank, name, ts_ns)
        if issuing.startswith("ProfilerStep#"):
            assert issuing == f"ProfilerStep#{step}"


def _nccl_trace(tmp_path, nbytes_elems, dur_us, group=8, name="ncclDevKernel_AllReduce_Sum_bf16_RING_LL", coll="allreduce"):
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 20000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 10, "dur": 5, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 20, "ts": 100, "dur": dur_us,
         "args": {"correlation": 1, "stream": 20, "device": 0, "Collective name": coll, "In msg nelems": nbytes_elems,
                  "Out msg nelems": nbytes_elems, "dtype": "BFloat16", "Group size": group, "Process Group Name": "0", "Seq": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 20, "dur": 5, "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 100, "dur": dur_us / 4,
         "args": {"correlation": 2, "stream": 7, "device": 0}},
    ]
    return write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": group},
                       deviceProperties=[{"id": 0, "name": "NVIDIA H100 80GB HBM3", "numSms": 132}])


def test_busbw_exact_for_given_size_and_duration(tmp_path):
    _nccl_trace(tmp_path, nbytes_elems=500_000_000, dur_us=10_000)  # 1e9 bytes of bf16 in 10 ms
    ev = pl.scan_parquet(ingest(tmp_path / "run", jobs=1).out_dir / "trace_events").collect()
    call = comms.collectives(ev).row(0, named=True)
    assert call["bytes"] == 1_000_000_000
    assert call["algbw_gbps"] == pytest.approx(100.0)  # 1e9 B / 10 ms = 100 GB/s
    assert call["busbw_gbps"] == pytest.approx(100.0 * 2 * 7 / 8)  # allreduce: 2(n-1)/n
    assert (call["overlapped_ns"], call["exposed_ns"]) == (2_500_000, 7_500_000)  # the gemm covers a quarter
    assert call["regime"] == "bandwidth-bound"


@pytest.mark.parametrize("coll,kernel,size_elems,expected_bytes,factor", [
    ("_allgather_base", "ncclDevKernel_AllGather_RING_LL", 1000, 2000, 7 / 8),  # out nelems x 2 B
    ("_reduce_scatter_base", "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 1000, 2000, 7 / 8),
    ("broadcast", "ncclKernel_Broadcast_RING_LL_Sum_int8_t", 1000, 2000, 1.0),
    ("send", "ncclDevKernel_SendRecv", 1000, 2000, 1.0),
])
def test_bus_bandwidth_factors(tmp_path, coll, kernel, size_elems, expected_bytes, factor):
    _nccl_trace(tmp_path, nbytes_elems=size_elems, dur_us=1, name=kernel, coll=coll)
    ev = pl.scan_parquet(ingest(tmp_path / "run", jobs=1).out_dir / "trace_events").collect()
    call = comms.collectives(ev).row(0, named=True)
    assert call["bytes"] == expected_bytes
    assert call["busbw_gbps"] == pytest.approx(expected_bytes / 1000 * factor)
    assert call["regime"] == "latency-bound"


def test_generic_nccl_kernel_without_args_is_still_communication(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_Generic", "pid": 0, "tid": 20, "ts": 1, "dur": 5, "args": {"stream": 20}}]
    write_trace(tmp_path / "run" / "t.json", events)
    ev = pl.scan_parquet(ingest(tmp_path / "run", jobs=1).out_dir / "trace_events").collect()
    call = comms.collectives(ev).row(0, named=True)
    assert call["op"] == "unknown" and call["bytes"] is None and call["busbw_gbps"] is None


@pytest.mark.parametrize("name,sms,key", [
    ("NVIDIA H100 80GB HBM3", 132, "h100-sxm"), ("NVIDIA H100 PCIe", 114, "h100-pcie"), ("NVIDIA H100 NVL", 132, "h100-nvl"),
    ("NVIDIA H100", 132, "h100-sxm"), ("NVIDIA H100", 114, "h100-pcie"), ("NVIDIA H200", 132, "h200-sxm"),
    ("NVIDIA H200 NVL", 132, "h200-nvl"), ("NVIDIA B200", 148, "b200"), ("NVIDIA A100-PG509-200", 108, "a100"),
    ("NVIDIA A100-SXM4-80GB", 108, "a100"), ("AMD Instinct MI300X VF", 304, "mi300x"), ("AMD Instinct MI300X", 304, "mi300x"),
    ("Tesla V100-SXM2-32GB", 80, "v100-sxm"), ("Tesla V100-PCIE-16GB", 80, "v100-pcie"), ("NVIDIA L4", 58, "l4"),
    ("NVIDIA A10G", 80, "a10g"), ("NVIDIA L40S", 142, None), ("AMD Radeon Graphics", None, None),
    ("Quadro GP100", 56, None), ("NVIDIA H100", None, None),
    # Grace Hopper and Grace Blackwell superchips are not their names' H200 / B200 (other memory, other clocks)
    ("NVIDIA GH200 480GB", 132, None), ("NVIDIA GB200", 148, None), ("NVIDIA H200", 132, "h200-sxm"),
])
def test_device_matching_is_explicit(name, sms, key):
    assert devices.match_device(name, sms) == key


def test_unknown_device_gives_no_mfu_and_says_how():
    peak, problem = mfu.peak_for("AMD Radeon Graphics", "bf16")
    assert peak is None and "--peak-tflops" in problem
    peak, problem = mfu.peak_for("Tesla V100-SXM2-32GB", "bf16")
    # V100 has no bf16: the dtypes it has are named (its tensor cores' fp16 and fp32), so the user can pick one
    assert peak is None and problem.startswith("no bf16 peak for v100-sxm (its datasheet's: fp16, fp32)")
    peak, _ = mfu.peak_for("AMD Radeon Graphics", "bf16", peak_tflops=100)
    assert peak.flops == 100e12


def test_a_run_whose_traces_hold_no_gpu_work_is_told_it_ran_on_cpus():
    """DeepSpeed's cpu accelerator: traces without device properties, kernels or copies. The MFU note
    says so, not that a GPU's name is missing; without traces it says none name the device."""
    def manifest(*kind_counts):
        return {"sources": [{"path": "log.txt"}] + [{"path": f"r{i}.json", "kind_counts": c} for i, c in enumerate(kind_counts)]}

    cpu_run = manifest({"cpu_op": 10, "python_function": 5}, {"cpu_op": 7})
    gpu_run = manifest({"cpu_op": 10}, {"cpu_op": 7, "kernel": 3})
    assert (runner._device_activity(cpu_run), runner._device_activity(gpu_run)) == (False, True)
    assert runner._device_activity(manifest()) is None
    _, problem = mfu.peak_for(None, "bf16", device_activity=False)
    assert "no GPU work" in problem and "CPU run" in problem and "--peak-tflops" in problem
    _, problem = mfu.peak_for(None, "bf16", device_activity=True)
    assert problem.startswith("no device name in the traces")
    _, problem = mfu.peak_for(None, "bf16", device_activity=None)
    assert "no profiler traces" in problem
    peak, problem = mfu.peak_for(None, "bf16", peak_tflops=2.5, device_activity=False)
    assert peak.flops == 2.5e12 and problem == ""


def test_mfu_arithmetic_exact():
    shape = mfu.ModelShape(params=1e9, layers=24, hidden=16 * 128, seq_len=2048, tokens_per_step=1_048_576)
    per_token = 6e9 + 12 * 24 * 16 * 128 * 2048
    assert shape.flops_per_step() == per_token * 1_048_576
    # One kept step of 2 s; the excluded (warm-up) step of 9 s does not count.
    step_time = pl.DataFrame({"step": [0, 1], "step_time_ns": [9_000_000_000, 2_000_000_000], "excluded": [True, False]})
    peak, _ = mfu.peak_for("NVIDIA H100 80GB HBM3", "bf16")
    table, _ = mfu.step_time_mfu(step_time, pl.DataFrame(), {}, peak, world_size=8, shape=shape, recompute=True)
    assert table["step"].to_list() == [1, 1]
    rows = {r["metric"]: r for r in table.to_dicts()}
    assert rows["MFU"]["utilization"] == pytest.approx(per_token * 1_048_576 / (2.0 * 8 * 989.5e12), rel=1e-12)
    assert rows["HFU"]["utilization"] == pytest.approx(rows["MFU"]["utilization"] * 4 / 3, rel=1e-12)
    assert "6N + 12*L*d*T" in rows["MFU"]["definition"] and "989.5 TFLOP/s dense bf16" in rows["MFU"]["peak"]


def test_profiler_flops_numerator(tmp_path):
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10, "dur": 100, "args": {"flops": 4.0e10}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 200, "dur": 100, "args": {"flops": 5.895e10}},
    ]
    write_trace(tmp_path / "run" / "t.json", events, deviceProperties=[{"id": 0, "name": "NVIDIA A100-SXM4-80GB", "numSms": 108}])
    findings = {}
    findings.update(analyse(tmp_path / "run", jobs=1)[1])
    table = pl.read_parquet(tmp_path / "run" / ".steplens" / "mfu" / "part-0.parquet")
    row = table.row(0, named=True)
    # 9.895e10 FLOPs in a 1 ms step on a 312 TFLOP/s A100 = 31.7% (ten times that: above 100%, test_sanity's case)
    assert row["utilization"] == pytest.approx(9.895e10 / (1e-3 * 312e12))
    assert row["numerator"] == "profiler_flops" and row["metric"] == "HFU"


def test_ranks_on_two_device_models_get_no_one_peak_and_are_told_so(tmp_path):
    """trace_diff's two ranks ran on an A100 and a V100: 'no device name in the traces' was wrong."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10, "dur": 100, "args": {"flops": 4.0e11}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 20, "dur": 5,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "sm80_gemm", "pid": 0, "tid": 7, "ts": 30, "dur": 50,
         "args": {"correlation": 1, "stream": 7, "device": 0}},
    ]
    for rank, name in ((0, "NVIDIA A100-SXM4-80GB"), (1, "NVIDIA H100 80GB HBM3")):
        write_trace(tmp_path / "run" / f"rank{rank}.json", events, deviceProperties=[{"id": 0, "name": name}],
                    distributedInfo={"rank": rank, "world_size": 2, "backend": "nccl"})
    findings = analyse(tmp_path / "run", jobs=1)[1]
    mixed = "the traces name 2 device models ('NVIDIA A100-SXM4-80GB', 'NVIDIA H100 80GB HBM3'), so the run has no one peak"
    assert findings["mfu"]["note"] == f"{mixed}; pass --peak-tflops (dense, per GPU) to compute MFU"
    assert findings["roofline"]["note"] == f"no roofline: {mixed}"


@pytest.mark.skipif(not CORPUS.is_dir(), reason="shared corpus not found")
@pytest.mark.parametrize("folder", [
    "HolisticTraceAnalysis/cpu_only", "HolisticTraceAnalysis/distributed_info_unavailable", "HolisticTraceAnalysis/trace_compare",
    "HolisticTraceAnalysis/mtia_inference_trace", "HolisticTraceAnalysis/cupti_profiler", "TraceLens/inference_sglang_decode",
    "HolisticTraceAnalysis/mixed_files", "param/dlrm_kineto", "HolisticTraceAnalysis/large_integer_trace",
])
def test_odd_real_runs_analyse_without_crashing(tmp_path, folder):
    result = CliRunner().invoke(analyze, [str(CORPUS / folder), "--out", str(tmp_path / "o"), "-q"])
    assert result.exit_code in (0, 1), result.output
    assert "findings" in result.output
    findings = json.loads((tmp_path / "o" / "findings.json").read_text())
    if folder.endswith("distributed_info_unavailable"):
        assert "without NCCL/RCCL kernels" in findings["collectives"]["comms_note"]
    if folder.endswith("cpu_only"):
        assert findings["collectives"]["comms_note"] == "no collectives in the traces" and findings["gpu_idle"]["idle_share"] is None


def test_cli_reports_mfu_with_definition(tmp_path):
    _nccl_trace(tmp_path, nbytes_elems=1000, dur_us=100)
    result = CliRunner().invoke(analyze, [str(tmp_path / "run"), "-q", "--params", "1e9", "--layers", "2", "--heads", "4",
                                          "--head-dim", "64", "--seq-len", "128", "--tokens-per-step", "4096"])
    assert result.exit_code == 0, result.output
    assert "MFU:" in result.output and "6N + 12*L*d*T" in result.output and "989.5 TFLOP/s dense bf16" in result.output
    # a part of the shape: the rest would come from the run's facts; this run has none, so the MFU says what is missing
    partial = CliRunner().invoke(analyze, [str(tmp_path / "run"), "-q", "--params", "1e9", "--out", str(tmp_path / "p")])
    note = json.loads((tmp_path / "p" / "findings.json").read_text())["mfu"]
    assert partial.exit_code == 0 and "lacks layers, hidden, seq_len, tokens_per_step" in json.dumps(note)
    lone = CliRunner().invoke(analyze, [str(tmp_path / "run"), "-q", "--heads", "4"])
    assert lone.exit_code == 2 and "--heads and --head-dim go together" in lone.output


def test_tokens_per_step_come_from_the_jobs_batch_and_a_sequence_length_given_on_the_command_line():
    """The helper's logs-only job: the config dump gave train_batch_size 16, --seq-len 64 was given, and MFU said the
    numerator lacked tokens_per_step. Tokens per step = 16 x 64 = 1024; PaLM's count by hand:
    (6 x 462,848 + 12 x 2 x 128 x 64) x 1024 = 3,045,064,704 FLOPs a step."""
    from steplens.analyze.analyses import mfu

    given = {"params": 462848, "layers": 2, "hidden": 128, "seq_len": 64}
    shape, origin, lacking = mfu.resolve_shape(given, {"train_batch_size": 16})
    assert lacking == "" and shape.tokens_per_step == 1024 and shape.flops_per_step() == 3_045_064_704
    assert origin == "the command line and tokens per step = the job's train_batch_size 16 x sequence length 64"
    assert mfu.resolve_shape(given, {})[2] == "tokens_per_step"
    assert mfu.resolve_shape({**given, "tokens_per_step": 4096}, {"train_batch_size": 16})[0].tokens_per_step == 4096


def test_analysis_tables_match_the_contract(analysed):
    from steplens.analyze import analyses
    out, _, _ = analysed
    for table, (_, columns) in analyses.TABLES.items():
        written = pl.read_parquet_schema(out / table / "part-0.parquet")
        assert list(written) == list(columns), table


def test_kernel_categories_and_user_patterns(tmp_path):
    from steplens.analyze.analyses import kernels
    device = pl.DataFrame({
        "rank": [0] * 7, "step": [1] * 7,
        "kind": ["kernel"] * 5 + ["gpu_memcpy", "gpu_memset"],
        "name": ["sm90_xmma_gemm_bf16bf16", "void flash_fwd_kernel<...>", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
                 "void at::native::vectorized_elementwise_kernel<4>", "my_custom_fused_op", "Memcpy HtoD", "Memset (Device)"],
        "collective": [None] * 7, "dur_ns": [100, 200, 300, 400, 500, 600, 700],
    })
    work = kernels.device_work(device)
    assert work["category"].to_list() == ["gemm", "attention", "communication", "elementwise", "other", "memcpy", "memset"]
    csv = tmp_path / "cats.csv"
    csv.write_text("category,pattern\nattention,my_custom_fused\n")
    assert kernels.device_work(device, kernels.load_categories(csv))["category"][4] == "attention"
    per_category = dict(kernels.category_time(work).select("category", "time_ns").iter_rows())
    assert per_category == {"gemm": 100, "attention": 200, "communication": 300, "elementwise": 400,
                            "other": 500, "memcpy": 600, "memset": 700}
    top = kernels.top_kernels(kernels.kernel_totals(work), limit=2)
    assert top["name"].to_list() == ["Memset (Device)", "Memcpy HtoD"]


@pytest.mark.parametrize("content, told", [
    (b"category,pattern\nmine,(?<=x)gemm\n", "look-around"),  # Python's re takes it; the analyses' regex does not
    (b"category,pattern\nmine,gemm[\n", "unclosed character class"),
    (b"name,regex\na,b\n", "needs a header row with the columns category,pattern (found: name,regex)"),
    (b"category,pattern\n\xff\xfe,x\n", "not UTF-8 text"),
    (b"category,pattern\nonly\n", "line 2: a category and a pattern are both needed"),
])
def test_a_bad_kernel_categories_file_is_named_before_anything_runs(tmp_path, content, told):
    categories = tmp_path / "my categories.csv"
    categories.write_bytes(content)
    (tmp_path / "run").mkdir()
    result = CliRunner().invoke(analyze, [str(tmp_path / "run"), "-q", "--kernel-categories", str(categories)])
    assert result.exit_code == 2, result.output  # a usage error, not an internal one (5)
    one_line = " ".join(result.output.split())
    assert f"--kernel-categories {categories}" in one_line and told in one_line, result.output
    assert not (tmp_path / "run" / ".steplens").exists()


@pytest.mark.parametrize("option, value", [("--peak-tflops", "nan"), ("--peak-tflops", "inf"), ("--peak-tflops", "0"),
                                           ("--peak-tflops", "-5"), ("--params", "-1e9"), ("--layers", "-3"),
                                           ("--hidden", "0"), ("--grad-norm-threshold", "nan")])
def test_a_number_no_run_can_have_is_refused(tmp_path, option, value):
    result = CliRunner().invoke(analyze, [str(tmp_path), "-q", option, value])
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output
    assert not (tmp_path / ".steplens").exists()


def test_collectives_name_their_call_site(analysed):
    out, _, _ = analysed
    sites = _table(out, "collectives")["issuing_op"]
    assert sites.null_count() == 0 and "record_param_comms" not in set(sites)


def test_step_missing_on_one_rank(tmp_path):
    for rank, step_numbers in ((0, [1, 2, 3]), (1, [1, 3])):
        events = []
        for i, n in enumerate(step_numbers):
            t = n * 1000
            events += [
                {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1, "ts": t, "dur": 500},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t + 10, "dur": 5,
                 "args": {"correlation": n}},
                {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": t + 20, "dur": 100,
                 "args": {"correlation": n, "stream": 7, "device": 0}},
            ]
        write_trace(tmp_path / "run" / f"rank{rank}.json", events, distributedInfo={"rank": rank, "world_size": 2})
    findings = {}
    findings.update(analyse(tmp_path / "run", jobs=1)[1])
    stats = pl.read_parquet(tmp_path / "run" / ".steplens" / "step_stats" / "part-0.parquet").sort("step")
    assert stats.select("step", "ranks").rows() == [(1, 2), (2, 1), (3, 2)]
    offsets = pl.read_parquet(tmp_path / "run" / ".steplens" / "clock_offsets" / "part-0.parquet").sort("rank")
    assert offsets["method"].to_list() == ["reference", "none (no collective kernels to match)"]
    assert findings["collectives"]["comms_note"] == "no collectives in the traces"


def test_printed_summary_and_findings_match_truth(tmp_path):
    """Every number the terminal summary prints for the bundled sample, against its truth.json."""
    import re
    import shutil
    from pathlib import Path

    sample = Path(__file__).resolve().parents[1] / "sample_runs" / "synthetic_8rank"
    run = tmp_path / "run"
    shutil.copytree(sample, run, ignore=shutil.ignore_patterns(".steplens"))
    truth = json.loads((run / "truth.json").read_text())
    result = CliRunner().invoke(analyze, [str(run)])  # not -q: that prints the findings only
    assert result.exit_code == 0, result.output
    text = re.sub(r"\n +", " ", result.output)  # facts wrapped at the console width (and the lists under a heading), joined
    events = next(line for line in text.splitlines() if line.startswith("events (all ranks): "))
    for kind in ("cpu_op", "cuda_runtime", "kernel", "gpu_memcpy", "gpu_memset", "memory"):
        total = sum(r["event_counts"][kind] for r in truth["ranks"].values())
        assert re.search(rf"(: |, ){kind}={total:,}(,|$)", events), kind  # kind=count, never parted by a wrap
    ranks_by_steps = {}
    for rank, info in truth["ranks"].items():
        ranks_by_steps.setdefault(tuple(s["step"] for s in info["steps"]), []).append(int(rank))
    for steps, ranks in ranks_by_steps.items():  # one line per set of ranks that profiled the same steps
        who = f"ranks {min(ranks)}-{max(ranks)}" if len(ranks) > 1 else f"rank {ranks[0]}"
        assert sorted(ranks) == list(range(min(ranks), max(ranks) + 1))
        assert re.search(rf"(^| ){who}: 1 window\(s\), {len(steps)} step\(s\) {steps[0]}-{steps[-1]}( |$)", text, re.M)
    s = truth["stragglers"][0]
    assert f"Straggler: rank {s['rank']} in step {s['step']};" in text
    findings = json.loads((run / ".steplens" / "findings.json").read_text())
    # Device-level host-bound idle in the steps: the compute stream's host-bound gaps (the comm stream is idle then),
    # and the device's idle before the first step's first work and after the last step's last work (its loss
    # all-reduce) until the step ends on the CPU. The gaps between steps follow a synchronization (each step ends
    # in one): sync, not host-bound.
    host_bound = sum(v["host_bound_idle_ns"] for r in truth["ranks"].values() for v in r["idle"].values())
    for r in truth["ranks"].values():
        first, last = r["steps"][0], r["steps"][-1]
        last_work_end = max([last["gpu_end_ns"]] + [c["kernel_end_ns"] for c in r["collectives"] if c["step"] == last["step"]])
        host_bound += (first["gpu_start_ns"] - first["start_ns"]) + max(0, last["end_ns"] - last_work_end)
    idle = pl.read_parquet(run / ".steplens" / "gpu_idle" / "*.parquet").filter(pl.col("stream") == -1)
    assert idle.filter(pl.col("step").is_not_null())["host_bound_ns"].sum() == host_bound
    # The headline is the whole window: the steps' idle plus the host-bound gaps between steps.
    window = idle.filter(pl.col("step").is_null())
    assert findings["gpu_idle"]["host_bound_ns"] == window["host_bound_ns"].sum() >= host_bound
    assert findings["gpu_idle"]["idle_share"] == window["idle_ns"].sum() / window["span_ns"].sum()
    assert f"GPU idle: {findings['gpu_idle']['idle_share']:.1%}" in text
    # Most exposed collective: on the rank with the most exposed time, truth's exposure per (collective, nccl-tests size).
    per_rank = {rank: sum(c["exposed_ns"] for c in r["collectives"]) for rank, r in truth["ranks"].items()}
    worst = max(per_rank, key=per_rank.get)
    collectives = findings["collectives"]
    assert collectives["exposed_comm_rank"] == int(worst) and collectives["exposed_comm_ns"] == per_rank[worst]
    # The sentence names the collective (name, nccl-tests size) whose most exposed rank has the most exposed time,
    # and that rank (the Collectives table's first row): truth's exposure per rank and collective.
    exposed = {}
    for rank, r in truth["ranks"].items():
        for c in r["collectives"]:
            size = c["bytes"] * c["group_size"] if c["name"] == "_allgather_base" else c["bytes"]
            key = (c["name"], size, int(rank))
            exposed[key] = exposed.get(key, 0) + c["exposed_ns"]
    (name, size, rank), ns = max(exposed.items(), key=lambda kv: (kv[1], -kv[0][2]))
    assert (f" of {size / 2**20:.3g} MiB, {ns / 1e6:.3g} ms not hidden behind compute on rank {rank} (its most exposed "
            "rank)") in " ".join(text.split())  # 2**20 B sizes


def test_mfu_from_the_collectors_flops_profile(tmp_path):
    """3 x the profiled forward FLOPs x micro batches x data-parallel ranks over the slowest rank's step (its cycle:
    the end of the step before to this one's end), recomputed here from the collector's own Parquet parts and manifest."""
    import shutil
    from pathlib import Path

    sample = Path(__file__).resolve().parents[1] / "sample_runs" / "deepspeed_cpu_2rank"
    run = tmp_path / "run"
    shutil.copytree(sample, run, ignore=shutil.ignore_patterns(".steplens"))
    result = CliRunner().invoke(analyze, [str(run), "-q", "--peak-tflops", "2"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((run / "collector" / "manifest" / "rank0.json").read_text())["run"]
    profile = pl.read_parquet(run / "collector" / "flops_profile")
    forward = profile.filter(pl.col("path") == "")["flops_total"].item()
    steps = pl.read_parquet(run / "collector" / "train_steps")
    ends = {(r, s): t for r, s, t in steps.group_by("rank", "step").agg(pl.col("end_ns").max()).iter_rows()}
    cycles: dict[int, int | None] = {}
    for (rank, step), end in ends.items():
        cycle = end - ends[(rank, step - 1)] if (rank, step - 1) in ends else None
        cycles[step] = None if cycle is None or cycles.get(step, 0) is None else max(cycles.get(step, 0), cycle)
    flops = 3 * forward * manifest["grad_accum"] * manifest["dp_world_size"]
    # Steps that ran instrumentation are left out: the FLOPs-profiled step and the profiler's warm-up,
    # active and trace-export steps, from the collector's settings.
    settings = manifest["settings"]
    window = settings["profile"]["skip_first"] + settings["profile"]["wait"]
    instrumented = {settings["flops_step"], *range(window, window + settings["profile"]["warmup"] + settings["profile"]["active"] + 1)}
    expected = {step: flops / (ns * 1e-9 * manifest["world_size"] * 2e12) for step, ns in cycles.items()
                if step not in instrumented and ns is not None}
    table = _table(run / ".steplens", "mfu").filter(pl.col("numerator") == "collector_flops_profile")
    assert dict(zip(table["step"], table["utilization"])) == pytest.approx(expected)
    said = " ".join(result.output.split())
    assert "MFU" in said and "the collector's FLOPs profile" in said  # the headline or beside it


def test_launch_summary_orders_launch_apis_with_equal_counts_the_same_whatever_their_input_order():
    """Two launch APIs with one activity each on one rank: sorted by rank, count, then name, so the
    table's rows do not depend on which API the hash grouping met first."""
    from steplens.analyze.analyses import launch

    rows = {"rank": [0, 0], "source": ["t", "t"], "launch_pid": [1, 1], "launch_tid": [1, 1], "launch_ts_ns": [100, 200],
            "ts_ns": [106, 205], "launch_api": ["cudaMemcpyAsync", "cudaLaunchKernel"], "kind": ["gpu_memcpy", "kernel"],
            "api_ns": [5, 7],
            "queue_ns": [1, -2], "dur_ns": [10, 20]}
    frame = pl.DataFrame(rows)
    for order in ([0, 1], [1, 0]):
        summary = launch.launch_summary(frame[order])
        assert summary["launch_api"].to_list() == ["cudaLaunchKernel", "cudaMemcpyAsync"]
        assert summary.filter(pl.col("launch_api") == "cudaLaunchKernel")["queue_ns_median"].item() == 0  # clipped at 0


def test_the_roofline_note_says_why_there_is_none_without_traces_or_without_gpu_work(tmp_path):
    """A log-only run said 'no device name in the traces: no memory roof', which blames a device name."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "train.log").write_text("[2024-01-01 00:00:00,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=1, skipped=0, "
                                    "lr=[0.001], mom=[(0.9, 0.999)]\n")
    assert analyse(logs, jobs=1)[1]["roofline"]["note"] == "no roofline: no profiler traces"
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10, "dur": 100}]
    write_trace(tmp_path / "cpu" / "t.json", events)
    assert analyse(tmp_path / "cpu", jobs=1)[1]["roofline"]["note"] == "no roofline: the traces hold no GPU work"


def _innermost_by_hand(ops: list[tuple], queries: list[tuple]) -> list[int]:
    """For each query (thread, lo, hi), the index into `ops` (thread, start, end; in the order searched: by start,
    the outermost first on ties) of the last op on that thread with start <= lo and end >= hi, or -1."""
    return [max((i for i, (t, s, e) in enumerate(ops) if t == qt and s <= lo and e >= hi), default=-1)
            for qt, lo, hi in queries]


@pytest.mark.parametrize("far_apart", [False, True])
def test_innermost_op_on_each_thread_matches_a_search_by_hand(far_apart):
    """launch.innermost_on_thread lays every thread on a stretch of one axis and searches them all at once
    (the threads one by one when their times are too far apart for that): the same answers as looking at
    every op of the query's thread, on nested, tied and overlapping ops, null keys, and threads without ops."""
    import random

    import numpy as np

    from steplens.analyze.analyses import launch

    rng = random.Random(7)
    keys = [(0, "a.json", 1, 1), (0, "a.json", 1, 2), (1, "b.json", 5, None), (1, None, 5, 9)]
    # nanoseconds, or units so large that 4 threads' times cannot be laid end to end in an int64
    base, unit = (-4 * 10**18, 2 * 10**15) if far_apart else (1_700_000_000_000_000_000, 1)
    rows = []
    for _ in range(400):
        start = base + rng.randrange(0, 2_000) * unit
        rows.append((rng.randrange(len(keys)), start, start + rng.choice([0, 1, 5, 50, 500]) * unit))
    rows += [rows[3], rows[3], (rows[5][0], rows[5][1], rows[5][2] + 7)]  # identical ops; a tie on start
    ops = sorted(rows, key=lambda r: (r[1], -r[2]))  # stable: identical ops keep their order
    queries = [(rng.randrange(len(keys) + 1), lo, lo + rng.choice([0, 0, 1, 30]) * unit)
               for lo in (base + rng.randrange(-5, 2_100) * unit for _ in range(300))]
    queries.append((0, None, None))
    span = max(e for _, _, e in ops) - min(s for _, s, _ in ops)
    assert (span * len(keys) >= 2**62) == far_apart

    def frame(items):  # thread len(keys): one with queries and no ops
        return pl.DataFrame([dict(zip(launch.THREAD_KEYS, (keys + [(9, "none", 0, 0)])[t]), ts_ns=s, end_ns=e)
                             for t, s, e in items], schema={"rank": pl.Int64, "source": pl.String, "pid": pl.Int64,
                                                            "tid": pl.Int64, "ts_ns": pl.Int64, "end_ns": pl.Int64})

    found = launch.innermost_on_thread(frame(ops), frame(queries))
    expected = _innermost_by_hand(ops, queries[:-1]) + [-1]  # a query without times is in no op
    assert found.tolist() == expected
    assert (np.array(expected) >= 0).sum() > 100 and (np.array(expected) == -1).sum() > 20


@pytest.mark.parametrize("unit", [1, 10**15])
def test_idle_causes_clipped_to_step_spans_match_a_sum_by_hand(unit):
    """launch._clipped_causes lays every device's gaps end to end (device by device when the times are too far
    apart for that, unit 10**15 ns): each cause's gap time inside each step span, as summed by hand."""
    import random

    from steplens.analyze.analyses import launch

    rng = random.Random(3)
    devices = [(0, "a.json", 0), (0, "a.json", 1), (1, "b.json", 0), (2, "c.json", 0)]
    base = -3 * 10**18 if unit > 1 else 0
    gaps, spans = [], []
    for d, key in enumerate(devices[:3]):  # the last device has spans and no gaps
        t = 0
        for _ in range(60):  # disjoint gaps in time order, one cause each
            t += rng.randrange(1, 40)
            length = rng.randrange(1, 30)
            gaps.append((*key, rng.choice(launch.CAUSES), base + t * unit, base + (t + length) * unit))
            t += length
    for key in devices:
        for step in range(8):
            lo = rng.randrange(0, 2_000)
            spans.append((*key, step, base + lo * unit, base + (lo + rng.randrange(0, 900)) * unit))
    gap_frame = pl.DataFrame(gaps, schema=["rank", "source", "device", "cause", "gap_start_ns", "gap_end_ns"], orient="row")
    span_frame = pl.DataFrame(spans, schema=["rank", "source", "device", "step", "span_start_ns", "span_end_ns"], orient="row")
    got = launch._clipped_causes(span_frame, gap_frame)
    for row in got.iter_rows(named=True):
        key = (row["rank"], row["source"], row["device"])
        for cause in launch.CAUSES:
            by_hand = sum(max(0, min(e, row["span_end_ns"]) - max(s, row["span_start_ns"]))
                          for *k, c, s, e in gaps if tuple(k) == key and c == cause)
            assert row[f"{cause}_ns"] == by_hand
    assert got.height == len(spans) and sum(got[f"{c}_ns"].sum() for c in launch.CAUSES) > 0


def test_most_exposed_collective_line_counts_one_call_in_the_singular():
    top = {"op": "allreduce", "bytes": None, "exposed_ns": 2_000_000, "rank": 70, "ranks": 1, "busbw_gbps": None}
    one, two = (comms.collective_lines({"most_exposed_collective": {**top, "calls": n}}, {})[0] for n in (1, 2))
    assert one.endswith("(its most exposed rank), 1 call.") and two.endswith("(its most exposed rank), 2 calls.")
