"""GPU-time accounting on hand-built minimal traces, each with its expected numbers worked out by hand:
idle against the device-busy timeline (with and without ProfilerStep, with overlapping steps, with
work launched before the window), communication kernels that are not nccl*, exposed communication
per rank, launch queueing, and two files claiming one rank."""

import json

import polars as pl
import pytest
from click.testing import CliRunner

from steplens.analyze.cli import analyze
from steplens.analyze.pipeline import analyse
from steplens.reports import verdict

from conftest import launch_call_durations_ns, write_trace

LAUNCH = {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "dur": 2}


def _launch(ts, correlation, name="cudaLaunchKernel", dur=2):
    return {**LAUNCH, "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def _kernel(ts, dur, correlation, stream, name="gemm_kernel", **args):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": correlation, "stream": stream, "device": 0, **args}}


def _step(n, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1, "ts": ts, "dur": dur}


def _analyse(folder):
    findings = {}
    result, found_findings = analyse(folder, jobs=1)
    findings.update(found_findings)
    return folder / ".steplens", findings, result


def _table(out, name):
    return pl.read_parquet(out / name / "*.parquet")


def test_overlapping_steps_idle_only_when_no_stream_is_busy(tmp_path):
    """The issue's minimal case: step 1's kernels run 1020-1030 us and 1300-1310 us, step 2's kernel
    1150-1290 us on another stream. Step 1's span is 310 us (from its start at 1000 us: the device had done
    nothing before its first kernel); the device was busy 10 + 140 + 10 us of it, so idle 150 us (the old
    per-step figure counted 270 us)."""
    events = [
        _step(1, 1000, 100), _launch(1010, 1), _launch(1050, 2),
        _step(2, 1100, 100), _launch(1110, 3),
        _kernel(1020, 10, 1, stream=7), _kernel(1300, 10, 2, stream=7), _kernel(1150, 140, 3, stream=8),
    ]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    out, findings, _ = _analyse(tmp_path / "run")
    device = _table(out, "gpu_idle").filter(pl.col("stream") == -1)
    step1 = device.filter(pl.col("step") == 1).row(0, named=True)
    assert (step1["span_ns"], step1["busy_ns"], step1["idle_ns"]) == (310_000, 160_000, 150_000)
    step2 = device.filter(pl.col("step") == 2).row(0, named=True)
    assert (step2["span_ns"], step2["idle_ns"]) == (140_000, 0)
    window = device.filter(pl.col("step").is_null()).row(0, named=True)
    # 1000 (step 1's start) - 1310 us with 160 us busy; gaps 1000-1020 (before the first kernel, launched at 1010:
    # host-bound), 1030-1150 (step 2's kernel, launched at 1110 after 1030: host-bound) and 1290-1300 (step 1's
    # second kernel, queued at 1050 before 1290: other).
    assert (window["span_ns"], window["busy_ns"], window["idle_ns"]) == (310_000, 160_000, 150_000)
    assert (window["host_bound_ns"], window["other_ns"], window["sync_ns"]) == (140_000, 10_000, 0)
    assert (step1["host_bound_ns"], step1["other_ns"]) == (140_000, 10_000)
    assert findings["gpu_idle"]["idle_share"] == pytest.approx(150 / 310)
    assert findings["gpu_idle"]["main_cause"] == "host_bound"
    # The verdict's split counts the 140 us of step 2's span, inside step 1's, once: over the 310 us the two spans
    # cover, compute 160 us and idle 150 us (summed spans read 300 of 450 us compute)
    split = findings["step_breakdown"]["time_split"]
    assert (split["span_ns"], split["overlap_ns"]) == (310_000, 140_000)
    assert (split["compute_share"], split["idle_share"]) == (pytest.approx(160 / 310), pytest.approx(150 / 310))
    # The per-stream rows keep their meaning: step 1 on stream 7 idles 270 us between its own kernels.
    own_stream = _table(out, "gpu_idle").filter((pl.col("stream") == 7) & (pl.col("step") == 1)).row(0, named=True)
    assert own_stream["idle_ns"] == 270_000


def test_idle_under_one_percent_names_no_cause(tmp_path):
    """Back-to-back kernels (seen in real rocprofiler-sdk traces): 10 kernels of 100 us launched long before,
    each starting 0.5 us after the last ends: 4.5 us idle in a 1004.5 us span (0.45%), all of it "other"
    (queued, no sync). Idle that small has no cause worth naming; the headline gives the share alone. The step
    spans the kernels exactly (its launches came before it), so the window is theirs."""
    events = [_step(1, 100, 1004.5)] + [_launch(5 + i, i) for i in range(10)]
    events += [_kernel(100 + i * 100.5, 100, i, stream=7) for i in range(10)]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    out, findings, _ = _analyse(tmp_path / "run")
    window = _table(out, "gpu_idle").filter((pl.col("stream") == -1) & pl.col("step").is_null()).row(0, named=True)
    assert (window["span_ns"], window["idle_ns"], window["other_ns"]) == (1_004_500, 4_500, 4_500)
    assert findings["gpu_idle"]["idle_share"] == pytest.approx(4.5 / 1004.5)
    assert findings["gpu_idle"]["main_cause"] is None
    result = CliRunner().invoke(analyze, [str(tmp_path / "run"), "--out", str(tmp_path / "out"), "-q"])
    text = " ".join(result.output.split())
    assert "GPU idle: 0.4% of the profiled time (no stream busy, from the first device activity or profiled step to the last)." in text
    assert "main cause" not in text


def test_trace_without_steps_gets_every_analysis_that_needs_no_steps(tmp_path):
    """Old-API / unscheduled traces have no ProfilerStep: idle, launches, kernels and collectives all
    come out. Kernels 0-100 us, 150-200 us and an all-reduce 120-140 us on a second stream: 170 us busy
    of 200 us."""
    events = [
        _launch(-10, 1), _launch(-5, 2), _launch(130, 3),
        _kernel(0, 100, 1, stream=7, name="void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)"),
        _kernel(120, 20, 2, stream=9, name="ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"),
        _kernel(150, 50, 3, stream=7, name="ampere_sgemm_128x64_nn"),
    ]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 2})
    out, findings, _ = _analyse(tmp_path / "run")
    idle = _table(out, "gpu_idle")
    assert idle["step"].null_count() == idle.height == 1  # only the whole-window row
    row = idle.row(0, named=True)
    assert (row["stream"], row["span_ns"], row["busy_ns"], row["idle_ns"], row["activities"]) == (-1, 200_000, 170_000, 30_000, 3)
    assert findings["gpu_idle"]["idle_share"] == pytest.approx(30 / 200)
    assert dict(_table(out, "kernel_categories").select("category", "time_ns").iter_rows()) == {
        "elementwise": 100_000, "communication": 20_000, "gemm": 50_000}
    assert _table(out, "top_kernels").height == 3
    assert _table(out, "launch_summary")["activities"].sum() == 3
    calls = _table(out, "collectives")
    assert calls.select("op", "dur_ns", "exposed_ns").rows() == [("allreduce", 20_000, 20_000)]
    # the verdict leads with the window's idle, as there are no steps to split it by: both gaps (100-120 and 140-150)
    # end at work launched before them (at -5 and 130), so their cause is "other"
    assert verdict.first_screen(findings)[0] == (
        "GPU idle 15% of the profiled time (other); no profiled steps to split it by", "time")


def test_a_stall_that_opens_each_step_is_the_steps_idle(tmp_path):
    """A data loader holds the CPU for the first 50 us of step 2 (100-220 us) while the GPU, done with step 1's
    kernel at 95 us, waits: step 2's span opens at 100 us (its start; the device went idle at 95, in step 1)
    and runs to its end on the CPU at 220 (its kernel ends at 195), so 80 us of its 120 are idle, host-bound (the
    launch came at 150; nothing was left after 195). Step 1 had the same stall: the device did nothing before its
    kernel (55 us, launched at 50) and sat idle from 95 to the step's end at 100: 60 of its 100 us. Over both
    steps idle is 140 / 220."""
    events = [
        _step(1, 0, 100), _launch(50, 1), _kernel(55, 40, 1, stream=7),
        _step(2, 100, 120), _launch(150, 2), _kernel(155, 40, 2, stream=7),
    ]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    out, findings, _ = _analyse(tmp_path / "run")
    device = _table(out, "gpu_idle").filter((pl.col("stream") == -1) & pl.col("step").is_not_null()).sort("step")
    assert device.select("step", "span_start_ns", "span_ns", "idle_ns", "host_bound_ns").rows() == [
        (1, 0, 100_000, 60_000, 60_000), (2, 100_000, 120_000, 80_000, 80_000)]
    breakdown = _table(out, "step_breakdown").sort("step")
    assert breakdown.select("step", "span_ns", "compute_ns", "idle_ns", "host_bound_ns").rows() == [
        (1, 100_000, 40_000, 60_000, 60_000), (2, 120_000, 40_000, 80_000, 80_000)]
    split = findings["step_breakdown"]["time_split"]
    assert (split["span_ns"], split["main_idle_cause"]) == (220_000, "host_bound")
    assert split["idle_share"] == pytest.approx(140 / 220)
    # the slowest step (2, 120 us on the CPU) over time: the idle that opens it, its kernel, the idle that closes it
    assert _table(out, "step_timeline").sort("start_ns").select("step", "activity", "start_ns", "end_ns").rows() == [
        (2, "idle", 100_000, 155_000), (2, "compute", 155_000, 195_000), (2, "idle", 195_000, 220_000)]


def test_a_collective_call_is_counted_once_with_its_record_param_comms(tmp_path):
    """Two c10d::allreduce_ calls, each holding its record_param_comms (as NCCL builds record them), a
    record_param_comms on its own, and one on another thread at the same time: 4 calls, not 6."""
    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}
    events = [_step(1, 0, 1000),
              op("c10d::allreduce_", 10, 50), op("record_param_comms", 12, 40),
              op("c10d::allreduce_", 100, 50), op("record_param_comms", 100, 50),
              op("record_param_comms", 300, 5), op("record_param_comms", 300, 5, tid=2)]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 2})
    _, findings, _ = _analyse(tmp_path / "run")
    assert findings["collectives"]["comms_note"].startswith(
        "communication without NCCL/RCCL kernels: 4 collective op(s) on the CPU side")


def test_work_launched_before_the_window_is_an_orphan_with_no_step(tmp_path):
    """A kernel whose launch is not in the file (correlation 99, enqueued before the window) runs
    0-40 us inside step 1's CPU window: it gets no step and no launch API, is counted in
    ingest_issues, and still keeps the device busy. Step 1's span opens where the device went idle
    (40 us, the step having begun at -5 us) and ends with the step on the CPU (195 us; its kernel ended at 90).
    The window runs from the step's start (-5 us) to its end: 70 us busy of 200."""
    events = [
        _step(1, -5, 200), _launch(10, 1),
        _kernel(0, 40, 99, stream=7, name="void at::native::reduce_kernel<512, 1>(int)"),
        _kernel(60, 30, 1, stream=7),
    ]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    out, _, result = _analyse(tmp_path / "run")
    launches = _table(out, "kernel_launches").sort("ts_ns")
    assert launches.select("step", "launch_api").rows() == [(None, None), (1, "cudaLaunchKernel")]
    issues = pl.read_parquet(out / "ingest_issues" / "**" / "*.parquet").filter(pl.col("reason") == "orphan_device_activity")
    assert issues["count"].to_list() == [1] and "(40 µs of GPU time)" in issues["detail"][0]
    assert result.sources[0].status == "ingested"
    window = _table(out, "gpu_idle").filter(pl.col("step").is_null()).row(0, named=True)
    assert (window["span_ns"], window["busy_ns"], window["idle_ns"]) == (200_000, 70_000, 130_000)
    # before the orphan (launched ahead of the window) and 40-60 us (its kernel queued at 10 us): other; after: host-bound
    assert (window["other_ns"], window["host_bound_ns"]) == (25_000, 105_000)
    step1 = _table(out, "gpu_idle").filter((pl.col("step") == 1) & (pl.col("stream") == -1)).row(0, named=True)
    assert (step1["span_ns"], step1["idle_ns"], step1["activities"]) == (155_000, 125_000, 1)  # only its own launch
    assert _table(out, "kernel_categories").filter(pl.col("step").is_null())["time_ns"].sum() == 40_000


@pytest.mark.parametrize("damage", ["far_after", "far_before", "negative"])
def test_device_work_whose_time_cannot_be_used_is_counted_not_timed(tmp_path, damage):
    """The first test's trace plus one kernel whose time is damage: 1000 s after the host events (a clock glitch
    once made this window "100% idle"), 1000 s before them, or with dur -50 us ("-50000 ns of GPU time"). The
    device numbers are the first test's, worked out by hand; the kernel stays in trace_events and is counted."""
    glitch = {"far_after": (1e9, 10), "far_before": (-1e9, 10), "negative": (1200, -50)}[damage]
    events = [
        _step(1, 1000, 100), _launch(1010, 1), _launch(1050, 2),
        _step(2, 1100, 100), _launch(1110, 3),
        _kernel(1020, 10, 1, stream=7), _kernel(1300, 10, 2, stream=7), _kernel(1150, 140, 3, stream=8),
        _kernel(glitch[0], glitch[1], 77, stream=7, name="glitch_kernel"),
    ]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    out, findings, _ = _analyse(tmp_path / "run")
    window = _table(out, "gpu_idle").filter((pl.col("stream") == -1) & pl.col("step").is_null()).row(0, named=True)
    assert (window["span_ns"], window["busy_ns"], window["idle_ns"]) == (310_000, 160_000, 150_000)
    assert findings["gpu_idle"]["idle_share"] == pytest.approx(150 / 310)
    assert _table(out, "kernel_categories")["time_ns"].sum() == 160_000
    assert "glitch_kernel" not in set(_table(out, "top_kernels")["name"])
    kept = pl.read_parquet(out / "trace_events" / "*" / "*.parquet", hive_partitioning=False)
    assert kept.filter(pl.col("name") == "glitch_kernel").height == 1  # kept as written
    issues = dict(_table(out, "ingest_issues").select("reason", "count").iter_rows())
    counted = "negative_duration" if damage == "negative" else "device_activity_outside_window"
    assert issues[counted] == 1
    orphan = _table(out, "ingest_issues").filter(pl.col("reason") == "orphan_device_activity")["detail"][0]
    assert ("(0 ns of GPU time)" if damage == "negative" else "(10 µs of GPU time)") in orphan


def test_host_events_spanning_most_of_int64_judge_no_device_work(tmp_path):
    """Two CPU ops at -/+4.6e18 ns (the edges of the times a trace may hold): the window's length and its bounds
    are past int64 (wrapped, they once put every kernel outside the window). Nothing is outside: the device
    numbers are the first test's."""
    events = [
        _step(1, 1000, 100), _launch(1010, 1), _launch(1050, 2),
        _step(2, 1100, 100), _launch(1110, 3),
        _kernel(1020, 10, 1, stream=7), _kernel(1300, 10, 2, stream=7), _kernel(1150, 140, 3, stream=8),
        {"ph": "X", "cat": "cpu_op", "name": "early", "pid": 1, "tid": 2, "ts": -4_600_000_000_000_000, "dur": 1},
        {"ph": "X", "cat": "cpu_op", "name": "late", "pid": 1, "tid": 2, "ts": 4_600_000_000_000_000, "dur": 1},
    ]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    out, findings, _ = _analyse(tmp_path / "run")
    window = _table(out, "gpu_idle").filter((pl.col("stream") == -1) & pl.col("step").is_null()).row(0, named=True)
    assert (window["span_ns"], window["busy_ns"], window["idle_ns"]) == (310_000, 160_000, 150_000)
    assert "device_activity_outside_window" not in set(_table(out, "ingest_issues")["reason"])


def test_multimem_all_reduce_is_a_collective_with_exposure(tmp_path):
    """PyTorch symmetric-memory all-reduce (NVLS multimem; kernel multimem_all_reduce_kernel in
    torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu,
    https://github.com/pytorch/pytorch/blob/main/torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu)
    has no record_param_comms: op from the name, bytes unknown. 100 us, a GEMM on another stream covers
    30 us of it."""
    events = [
        _step(1, 0, 500), _launch(1, 1), _launch(5, 2),
        _kernel(10, 100, 1, stream=20, name="multimem_all_reduce_kernel"),
        _kernel(80, 60, 2, stream=7, name="nvjet_tst_64x8_64x16_4x1_v_bz_TNT"),
    ]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 8})
    out, findings, _ = _analyse(tmp_path / "run")
    call = _table(out, "collectives").row(0, named=True)
    assert (call["op"], call["bytes"], call["dur_ns"], call["overlapped_ns"], call["exposed_ns"]) == (
        "allreduce", None, 100_000, 30_000, 70_000)
    categories = dict(_table(out, "kernel_categories").select("category", "time_ns").iter_rows())
    assert categories == {"communication": 100_000, "gemm": 60_000}
    collectives = findings["collectives"]
    assert collectives["most_exposed_collective"]["op"] == "allreduce" and collectives["exposed_comm_ns"] == 70_000


def test_exposed_communication_is_per_rank_never_summed(tmp_path):
    """Rank 0 exposes 100 us, rank 1 60 us of all-reduce: the headline is rank 0's 100 us, not 160 us."""
    for rank, dur in ((0, 100), (1, 60)):
        events = [_step(1, 0, 500), _launch(1, 1),
                  _kernel(10, dur, 1, stream=20, name="ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)")]
        write_trace(tmp_path / "run" / f"rank{rank}.json", events, distributedInfo={"rank": rank, "world_size": 2})
    _, findings, _ = _analyse(tmp_path / "run")
    collectives = findings["collectives"]
    assert collectives["exposed_comm_ns"] == 100_000 and collectives["exposed_comm_rank"] == 0
    assert collectives["exposed_comm_median_rank_ns"] == 80_000
    assert collectives["most_exposed_collective"]["rank"] == 0 and collectives["most_exposed_collective"]["exposed_ns"] == 100_000


def test_blocking_copy_queue_is_never_negative_in_the_summary(tmp_path):
    """cudaMemcpy returns after its copy: the copy starts 5 us after the call began and the call
    returns 20 us later, so queue_ns = 5 - 25 = -20 us (it overlaps the call); launch_summary clips it at 0."""
    events = [
        _step(1, 0, 500), _launch(10, 1, name="cudaMemcpy", dur=25),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0, "tid": 7, "ts": 15, "dur": 18,
         "args": {"correlation": 1, "stream": 7, "device": 0}},
    ]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    out, _, _ = _analyse(tmp_path / "run")
    launch = _table(out, "kernel_launches").row(0, named=True)
    assert (launch["queue_ns"], launch["launch_delay_ns"]) == (-20_000, 5_000)
    summary = _table(out, "launch_summary").row(0, named=True)
    assert summary["launch_api"] == "cudaMemcpy" and summary["queue_ns_median"] == 0


@pytest.mark.parametrize("twin", ["identical copy", "same steps", "overlapping time"])
def test_two_files_claiming_one_rank_is_an_error_not_a_merge(tmp_path, twin):
    events = [_step(1, 0, 100), _launch(1, 1), _kernel(10, 50, 1, stream=7)]
    first = write_trace(tmp_path / "run" / "a_rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    if twin == "identical copy":
        (tmp_path / "run" / "b_rank0.json").write_bytes(first.read_bytes())
    elif twin == "same steps":  # another recording of the same steps (shifted clock), still rank 0
        later = [{**e, "ts": e["ts"] + 7} for e in events]
        write_trace(tmp_path / "run" / "b_rank0.json", later, distributedInfo={"rank": 0, "world_size": 1})
    else:  # other step numbers, but 30-130 µs overlaps the first file's 0-100 µs on the same host clock
        other = [_step(2, 30, 100), _launch(31, 1), _kernel(40, 50, 1, stream=7)]
        write_trace(tmp_path / "run" / "b_rank0.json", other, distributedInfo={"rank": 0, "world_size": 1})
    result = CliRunner().invoke(analyze, [str(tmp_path / "run"), "-q"])
    assert result.exit_code == 1, result.output  # results written, one input unusable
    issues = _table(tmp_path / "run" / ".steplens", "ingest_issues").filter(pl.col("reason") == "duplicate_rank")
    assert issues.select("file", "severity").rows() == [("b_rank0.json", "error")]
    assert "a_rank0.json" in issues["detail"][0]
    events_kept = _table(tmp_path / "run" / ".steplens", "kernel_launches")
    assert events_kept.height == 1 and events_kept["source"].to_list() == ["a_rank0.json"]


def test_windows_of_one_process_share_a_rank_without_error(tmp_path):
    """Two profiler windows of one process (distinct steps): one rank, no duplicate_rank issue."""
    for n, name in ((1, "w1_rank0.json"), (5, "w2_rank0.json")):
        events = [_step(n, n * 1000, 100), _launch(n * 1000 + 1, n), _kernel(n * 1000 + 10, 50, n, stream=7)]
        write_trace(tmp_path / "run" / name, events, distributedInfo={"rank": 0, "world_size": 1})
    out, _, result = _analyse(tmp_path / "run")
    assert [s.status for s in result.sources] == ["ingested", "ingested"]
    assert _table(out, "ingest_issues").filter(pl.col("reason") == "duplicate_rank").is_empty()
    windows = _table(out, "gpu_idle").filter(pl.col("step").is_null())
    assert windows.height == 2 and sorted(windows["source"].to_list()) == ["w1_rank0.json", "w2_rank0.json"]
    # each window: the step's 100 us, its kernel busy 50 of them
    assert json.loads((out / "findings.json").read_text())["gpu_idle"]["idle_share"] == 0.5


@pytest.mark.parametrize("launches", [0, 5])
def test_launches_without_recorded_device_work_say_the_gpu_was_not_measured(tmp_path, launches):
    """A real 2023 A100 trace held 268 launch calls and not one kernel (the profiler ran without its CUDA
    activities): the headline said nothing about the GPU and 'no collectives in the traces'."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10, "dur": 500}]
    events += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 20 + 10 * k, "dur": 5,
                "args": {"correlation": k + 1}} for k in range(launches)]
    events += [{"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "pid": 1, "tid": 1, "ts": 300, "dur": 5,
                "args": {"correlation": 99}}] if launches else []
    write_trace(tmp_path / "run" / "rank0.pt.trace.json", events)
    result = CliRunner().invoke(analyze, [str(tmp_path / "run"), "--out", str(tmp_path / "out")])
    findings = json.loads((tmp_path / "out" / "findings.json").read_text())
    text = " ".join(result.output.split())
    if launches:
        assert findings["gpu_idle"]["runtime_calls_without_device_work"] == launches + 1  # 5 runtime + 1 driver call
        assert "GPU idle: not measured: the traces hold 6 CUDA/HIP runtime and driver calls" in text
        assert "no collectives in the traces" not in text
        page = (tmp_path / "out" / "report.html").read_text()
        assert "The traces hold 6 CUDA/HIP runtime and driver calls" in page and "a CPU-only run" not in page
        assert ">Collectives</h2>" not in page
    else:
        assert "runtime_calls_without_device_work" not in findings["gpu_idle"] and "GPU idle" not in text


def test_work_issued_then_queued_for_most_of_a_gap_is_not_host_bound(tmp_path):
    """Kernel 1 ends at 100 us. Kernel 2 is launched at 105 (call to 110) and starts at 112: the host issued it for
    most of the 12 us gap, host-bound. Kernel 3 is launched at 130 (call to 135) and starts only at 600 behind an
    event wait the trace shows no work for (the sglang decode trace's 463 ms): 35 us to issue, 465 us queued,
    other. The step (100-700 us on the CPU, after its first launch at 95) is 600 us: 100 busy... worked below."""
    events = [
        _step(1, 90, 610), _launch(95, 1, dur=3), _kernel(98, 2, 1, stream=7),
        _launch(105, 2, dur=5), _kernel(112, 8, 2, stream=7),  # gap 100-112: host-bound
        _launch(130, 3, dur=5), _kernel(600, 50, 3, stream=7),  # gap 120-600: other (queued 465 of 480)
    ]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    out, findings, _ = _analyse(tmp_path / "run")
    window = _table(out, "gpu_idle").filter((pl.col("stream") == -1) & pl.col("step").is_null()).row(0, named=True)
    # span 90 (the step's start) - 700 (its end) = 610 us; busy 2 + 8 + 50 = 60; idle: 90-98 host-bound (the first
    # launch, 95-98, issued it all), 100-112 host-bound, 120-600 other, 650-700 host-bound (nothing left to run)
    assert (window["span_ns"], window["busy_ns"]) == (610_000, 60_000)
    assert (window["host_bound_ns"], window["other_ns"], window["sync_ns"]) == (8_000 + 12_000 + 50_000, 480_000, 0)
    assert findings["gpu_idle"]["main_cause"] == "other"


def test_a_rocm_blocking_copy_is_a_synchronization(tmp_path):
    """ROCm's PyTorch copies to the host with hipMemcpyWithStream, which returns once the device is done: the thread
    sits in it from 100 us, the kernel it waited for ends at 110, the next launch comes at 150 (call to 152) and
    starts at 155: the 45 us gap is the synchronization's, not host-bound."""
    events = [
        _step(1, 0, 200), _launch(5, 1, name="hipLaunchKernel"), _kernel(10, 100, 1, stream=7),
        _launch(100, 2, name="hipMemcpyWithStream", dur=40),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "pid": 0, "tid": 7, "ts": 111, "dur": 1,
         "args": {"correlation": 2, "stream": 7, "device": 0}},
        _launch(150, 3, name="hipLaunchKernel"), _kernel(155, 45, 3, stream=7),
    ]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    out, _, _ = _analyse(tmp_path / "run")
    window = _table(out, "gpu_idle").filter((pl.col("stream") == -1) & pl.col("step").is_null()).row(0, named=True)
    # gaps: 0-10 (host-bound: launched at 5), 110-111 (the copy itself, issued at 100 before the gap: other),
    # 112-155 (sync: the launching thread was in hipMemcpyWithStream at 112, until 140)
    assert (window["host_bound_ns"], window["other_ns"], window["sync_ns"]) == (10_000, 1_000, 43_000)
    points = _table(out, "sync_points")
    assert points.select("name", "idle_caused_ns").rows() == [("hipMemcpyWithStream", 43_000)]


def _op(name, ts, dur, dims, types=None, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {"Input Dims": dims, "Input type": types or ["float"] * len(dims)}}


def test_a_step_that_captures_a_graph_has_no_op_shape_flops(tmp_path):
    """An H100 step that captures its matmuls into a CUDA graph (recorded, not run: no kernel of theirs runs in it)
    and a step that only replays the graph (cudaGraphLaunch, no op shapes): the traces' op shapes count neither,
    so there is no MFU, and the reason names the graph steps; a third, plain step's matmul is counted."""
    mm = [[1024, 1024], [1024, 1024]]
    events = [
        _step(1, 0, 100), _launch(1, 90, name="cudaStreamBeginCapture"), _op("aten::mm", 5, 20, mm),
        _launch(30, 91, name="cudaStreamEndCapture"),
        _step(2, 100, 100), _launch(101, 1, name="cudaGraphLaunch"), _kernel(105, 80, 1, stream=7),
    ]
    device = {"name": "NVIDIA H100 80GB HBM3", "computeMajor": 9, "computeMinor": 0, "totalGlobalMem": 85e9, "numSms": 132}
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1},
                deviceProperties=[{"id": 0, **device}])
    _, findings, _ = _analyse(tmp_path / "run")
    # step 1's matmul is left out, and named; step 2 has no op shapes to leave out
    assert findings["mfu"]["note"].startswith("the traces' op shapes cannot count the profiled step(s) 1: "
                                              "they capture or replay CUDA/HIP graphs")
    plain = events + [_step(3, 200, 100), _op("aten::mm", 205, 20, mm), _launch(206, 2), _kernel(210, 80, 2, stream=7)]
    write_trace(tmp_path / "run2" / "rank0.json", plain, distributedInfo={"rank": 0, "world_size": 1},
                deviceProperties=[{"id": 0, **device}])
    out, findings, _ = _analyse(tmp_path / "run2")
    mfu = _table(out, "mfu").filter(pl.col("numerator") == "trace_shapes")
    assert mfu["flops"].unique().to_list() == [2 * 1024**3]  # step 3's matmul alone: 2 x 1024^3


def test_shapes_without_a_step_time_say_so(tmp_path):
    """Op shapes but no ProfilerStep (an unscheduled profiler): MFU needs a step time, not shapes."""
    events = [_op("aten::mm", 5, 20, [[64, 64], [64, 64]]), _launch(6, 1), _kernel(10, 80, 1, stream=7)]
    device = {"name": "NVIDIA H100 80GB HBM3", "computeMajor": 9, "computeMinor": 0, "totalGlobalMem": 85e9, "numSms": 132}
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1},
                deviceProperties=[{"id": 0, **device}])
    _, findings, _ = _analyse(tmp_path / "run")
    assert findings["mfu"]["note"].startswith("no step time to divide by")


def test_a_graph_launch_queues_its_first_kernel_only():
    """One cudaGraphLaunch (100-110 us) runs three kernels back to back from 112 us; one cudaLaunchKernel (200-202)
    starts its kernel at 205. The graph's queueing is its first kernel's 2 us: its second and third wait for the
    kernel before them (the sglang decode trace read a 3.47 ms median queue inside one 9.9 ms replay)."""
    from steplens.analyze.analyses import launch

    ms = 1_000
    launched = pl.DataFrame({
        "rank": [0] * 4, "source": ["t"] * 4, "launch_pid": [1] * 4, "launch_tid": [1] * 4,
        "launch_api": ["cudaGraphLaunch"] * 3 + ["cudaLaunchKernel"], "kind": ["kernel"] * 4,
        "launch_ts_ns": [100 * ms] * 3 + [200 * ms], "api_ns": [10 * ms] * 3 + [2 * ms],
        "ts_ns": [112 * ms, 150 * ms, 180 * ms, 205 * ms], "dur_ns": [38 * ms, 30 * ms, 10 * ms, 5 * ms]})
    launched = launched.with_columns(queue_ns=pl.col("ts_ns") - pl.col("launch_ts_ns") - pl.col("api_ns"))
    summary = {r["launch_api"]: r for r in launch.launch_summary(launched).iter_rows(named=True)}
    assert (summary["cudaGraphLaunch"]["activities"], summary["cudaGraphLaunch"]["queue_ns_median"]) == (3, 2 * ms)
    assert summary["cudaGraphLaunch"]["gpu_ns_total"] == 78 * ms
    assert summary["cudaLaunchKernel"]["queue_ns_median"] == 3 * ms


def test_a_step_without_device_work_widens_nothing():
    """Step 1 (0-100 us) runs a kernel 10-50 us; step 2 (100-130 us) runs none (a capture that ran nothing): it gets
    no per-step row, and the window reaches step 1's end only, so the headline and the steps' idle agree: 60 of
    100 us (0-10 before the kernel launched at 5, 50-100 after it, host-bound)."""
    _edge_case_check([_step(1, 0, 100), _launch(5, 1), _kernel(10, 40, 1, stream=7), _step(2, 100, 30)],
                            window=(100_000, 60_000, 60_000), steps={1: (0, 100_000, 60_000)})


def test_a_step_inside_an_earlier_steps_work_is_not_stretched_to_its_end():
    """Step 1 (0-20 us) launches a kernel that runs 20-500 us; step 2 (100-400 us) launches one 120-200 us on another
    stream. Step 2's span is its kernel's 80 us: the device was busy with step 1's kernel until 500 us, so step 2 is
    not closed at its CPU end (400 us), which would lay 200 more us of step 1's time inside it."""
    _edge_case_check([_step(1, 0, 20), _launch(10, 1), _kernel(20, 480, 1, stream=7),
                             _step(2, 100, 300), _launch(110, 2), _kernel(120, 80, 2, stream=8)],
                            window=(500_000, 20_000, 20_000), steps={1: (0, 500_000, 20_000), 2: (120_000, 80_000, 0)})


def _edge_case_check(events, window, steps):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        write_trace(Path(tmp) / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
        out, findings, _ = _analyse(Path(tmp) / "run")
        idle = _table(out, "gpu_idle").filter(pl.col("stream") == -1)
        row = idle.filter(pl.col("step").is_null()).row(0, named=True)
        assert (row["span_ns"], row["idle_ns"], row["host_bound_ns"]) == window
        per_step = {r["step"]: (r["span_start_ns"] - idle["span_start_ns"].min(), r["span_ns"], r["idle_ns"])
                    for r in idle.filter(pl.col("step").is_not_null()).iter_rows(named=True)}
        assert per_step == steps


def test_ordinary_launch_latency_stays_host_bound():
    """A launch-bound loop: each kernel is launched 1 us after the last ends (a 2 us call) and starts 6 us after the
    call returns, as every kernel of the rank does: its 9 us gaps are the host's, though the queueing (6 us) is longer
    than the issuing (3 us). Step 100-500 us, kernels 109-200, 209-300, 309-400, 409-500: 36 us host-bound."""
    events = [_step(1, 100, 400)]
    for i in range(1, 5):
        events += [_launch(100 * i + 1, i, dur=2), _kernel(100 * i + 9, 91, i, stream=7)]
    _edge_case_check(events, window=(400_000, 36_000, 36_000), steps={1: (0, 400_000, 36_000)})


def test_the_longest_launch_call_is_named_beside_host_bound_idle(corpus, tmp_path):
    """The MI250 trace's host-bound idle is mostly one hipLaunchKernel call: its longest call and the API's median,
    recomputed from the raw JSON (each kernel's launch call found by correlation id), are the ones the idle
    sentence names; launch_summary's max and total are the calls' own."""
    import statistics

    from steplens.analyze.analyses import launch

    source = corpus / "HolisticTraceAnalysis" / "amd_trace" / "mi250_minitoy_train_ROCm6_2_kineto.json.gz"
    durations = launch_call_durations_ns(source, "hipLaunchKernel")
    run = tmp_path / "run"
    run.mkdir()
    (run / source.name).symlink_to(source)
    _, findings = analyse(run, jobs=1)
    row = pl.read_parquet(run / ".steplens" / "launch_summary" / "*.parquet").filter(
        pl.col("launch_api") == "hipLaunchKernel").row(0, named=True)
    assert (row["api_ns_max"], row["api_ns_total"]) == (max(durations), sum(durations))
    slow = findings["gpu_idle"]["slowest_launch"]
    assert (slow["launch_api"], slow["api_ns"], slow["api_ns_median"]) == ("hipLaunchKernel", max(durations),
                                                                          statistics.median(durations))
    line = " ".join(launch.gpu_idle_lines(findings["gpu_idle"], findings)[0].split())
    assert max(durations) > findings["gpu_idle"]["host_bound_ns"] / 2  # why it is named
    assert (f"the longest launch call took 6.54 ms (hipLaunchKernel, rank 0; its median "
            f"{statistics.median(durations) / 1000:.2f} µs)") in line


def test_a_step_number_marking_spans_one_after_another_is_no_step(tmp_path):
    """Four annotations all named ProfilerStep#5, one after another (200, 300, 250 and 150 us): merged they made one
    'step 5' of 1.1 ms that no step took. They are left out of the steps with a warning naming them; a number
    annotated on two threads at once is still one step."""
    events = [_step(5, 0, 200), _step(5, 300, 300), _step(5, 700, 250), _step(5, 1000, 150),
              _step(7, 2000, 100), {**_step(7, 2010, 80), "tid": 2}]
    for i, ts in enumerate((10, 310, 710, 1010, 2020)):
        events += [_launch(ts, i + 1), _kernel(ts + 5, 20, i + 1, stream=7)]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    out, findings, result = _analyse(tmp_path / "run")
    assert pl.read_parquet(out / "steps" / "*" / "*.parquet")["step"].unique().to_list() == [7]
    issues = pl.read_parquet(out / "ingest_issues" / "**" / "*.parquet").filter(pl.col("reason") == "reused_step_number")
    assert issues["count"].to_list() == [4] and issues["severity"].to_list() == ["warning"]
    assert "step 5: 4 spans, 0.15-0.3 ms each" in issues["detail"][0]
    assert _table(out, "kernel_launches").filter(pl.col("step").is_not_null())["step"].to_list() == [7]


def test_a_graph_launch_is_one_call_and_a_blocking_copy_no_launch_stall(tmp_path):
    """A cudaGraphLaunch of 60 us that runs three kernels is one call of 60 us in launch_summary's max and total (it
    was three). A 500 us cudaMemcpy, waiting while a long kernel runs, is longer than any launch but is no launch
    stall: the longest launch call named beside the host-bound idle (80 + 220 + 15 + 105 + 10 us) is the graph
    launch."""
    events = [_step(1, 0, 1130),
              _launch(10, 1, name="cudaGraphLaunch", dur=60), _kernel(80, 10, 1, stream=7), _kernel(95, 10, 1, stream=7),
              _kernel(110, 10, 1, stream=7),
              _launch(300, 2, dur=30), _kernel(340, 10, 2, stream=7),
              _launch(360, 5, dur=3), _kernel(365, 635, 5, stream=7),
              _launch(400, 3, name="cudaMemcpy", dur=500),
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "pid": 0, "tid": 7, "ts": 1000, "dur": 5,
               "args": {"correlation": 3, "stream": 7, "device": 0}},
              _launch(1100, 4, dur=3), _kernel(1110, 10, 4, stream=7)]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    out, findings, _ = _analyse(tmp_path / "run")
    summary = {row["launch_api"]: row for row in _table(out, "launch_summary").iter_rows(named=True)}
    assert (summary["cudaGraphLaunch"]["activities"], summary["cudaGraphLaunch"]["api_ns_max"],
            summary["cudaGraphLaunch"]["api_ns_total"]) == (3, 60_000, 60_000)
    assert (summary["cudaLaunchKernel"]["api_ns_median"], summary["cudaLaunchKernel"]["api_ns_p90"]) == (3_000, 30_000)
    assert (summary["cudaLaunchKernel"]["api_ns_max"], summary["cudaLaunchKernel"]["api_ns_total"]) == (30_000, 36_000)
    assert summary["cudaMemcpy"]["api_ns_max"] == 500_000
    idle = findings["gpu_idle"]
    assert (idle["main_cause"], idle["host_bound_ns"], idle["sync_ns"]) == ("host_bound", 430_000, 0)
    assert (idle["slowest_launch"]["launch_api"], idle["slowest_launch"]["api_ns"]) == ("cudaGraphLaunch", 60_000)


def test_the_idle_sentence_names_the_steps_idle_where_it_differs():
    """A window idle 8.1% whose profiled steps are idle 9.3% (work launched before the window fills some of its time):
    both figures, each said for what it covers; equal figures, one."""
    from steplens.analyze.analyses import launch

    idle = {"idle_share": 0.081, "main_cause": "other", "host_bound_ns": 0, "sync_ns": 0, "other_ns": 1}
    line = " ".join(launch.gpu_idle_lines(idle, {"step_breakdown": {"time_split": {"idle_share": 0.093}}})[0].split())
    assert line.startswith("GPU idle: 8.1% of the profiled time (no stream busy, from the first device activity or "
                           "profiled step to the last; 9.3% inside the profiled steps' device spans, the verdict's figure)")
    assert "main cause other: the next work was already queued" in line
    same = launch.gpu_idle_lines(idle, {"step_breakdown": {"time_split": {"idle_share": 0.0812}}})[0]
    assert "inside the profiled steps" not in same


def test_the_launch_stall_named_is_the_host_bound_ranks_and_not_a_call_that_waited_for_its_copy(tmp_path):
    """Rank 0: a cudaMemcpyAsync of 300 us (400-700) whose DtoH copy ran 690-695 us, waiting behind a long kernel
    (it returned once its copy had ended: synchronous, pageable memory), and gaps of 10 us. Rank 1: kernels launched by
    40 us calls made after the kernel before ended, each opening a 41 us gap (host-bound 3 x 41 = 123 us).
    The call named is rank 1's 40 us cudaLaunchKernel, not rank 0's 300 us copy (by hand)."""
    rank0 = [_step(1, 0, 1000), _launch(10, 1, dur=2), _kernel(20, 660, 1, stream=7),
             _launch(400, 2, name="cudaMemcpyAsync", dur=300),
             {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "pid": 0, "tid": 7, "ts": 690,
              "dur": 5, "args": {"correlation": 2, "stream": 7, "device": 0}},
             _launch(701, 3, dur=2), _kernel(705, 290, 3, stream=7)]
    rank1 = [_step(1, 0, 1000)]
    for i in range(4):  # kernels 1-201, 242-442, 483-683, 724-924: calls 201-241, 442-482, 683-723
        start = i * 241
        rank1 += [_launch(start - 40 if i else 0, 10 + i, dur=40 if i else 1), _kernel(start + 1 if i else 1, 200, 10 + i, stream=7)]
    write_trace(tmp_path / "run" / "rank0.json", rank0, distributedInfo={"rank": 0, "world_size": 2})
    write_trace(tmp_path / "run" / "rank1.json", rank1, distributedInfo={"rank": 1, "world_size": 2})
    out, findings, _ = _analyse(tmp_path / "run")
    summary = {(row["rank"], row["launch_api"]): row for row in _table(out, "launch_summary").iter_rows(named=True)}
    copy = summary[(0, "cudaMemcpyAsync")]
    assert (copy["api_ns_max"], copy["launch_ns_max"]) == (300_000, None)
    assert summary[(1, "cudaLaunchKernel")]["launch_ns_max"] == 40_000
    slow = findings["gpu_idle"]["slowest_launch"]
    assert (slow["rank"], slow["launch_api"], slow["api_ns"]) == (1, "cudaLaunchKernel", 40_000)
    from steplens.analyze.analyses import launch

    line = " ".join(launch.gpu_idle_lines(findings["gpu_idle"], findings)[0].split())
    assert "the longest launch call took 40 µs (cudaLaunchKernel, rank 1, the rank with the most host-bound idle;" in line


def test_launch_summary_counts_each_call_once_and_every_kernel_launch_as_a_stall(tmp_path):
    """Two graph launches, one of 60 us running three kernels and one of 10 us running one: per call the median is
    35 us (weighted by kernels it read 60) and the p90 60 us. A 50 us cudaLaunchKernel whose 2 us kernel ended before
    the call returned is still a launch stall (launch_ns_max), as a copy that waited for the device is not."""
    events = [_step(1, 0, 1000),
              _launch(10, 1, name="cudaGraphLaunch", dur=60), _kernel(80, 10, 1, stream=7), _kernel(95, 10, 1, stream=7),
              _kernel(110, 10, 1, stream=7),
              _launch(200, 2, name="cudaGraphLaunch", dur=10), _kernel(215, 10, 2, stream=7),
              _launch(300, 3, dur=50), _kernel(305, 2, 3, stream=7)]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    out, _, _ = _analyse(tmp_path / "run")
    summary = {row["launch_api"]: row for row in _table(out, "launch_summary").iter_rows(named=True)}
    graph = summary["cudaGraphLaunch"]
    assert (graph["activities"], graph["api_ns_median"], graph["api_ns_p90"], graph["api_ns_max"], graph["api_ns_total"]) \
        == (4, 35_000, 60_000, 60_000, 70_000)
    assert summary["cudaLaunchKernel"]["launch_ns_max"] == 50_000
