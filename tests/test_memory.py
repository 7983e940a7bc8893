"""Memory per rank and step (analyze/analyses/memory.py): peaks from [memory] trace events, the collector and
DeepSpeed/Megatron log lines, growth across steps, and an out-of-memory end. Every number is checked against
the raw input read here with plain json/re, or against a generated input whose answer is known."""

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from conftest import write_trace
from steplens.analyze import pipeline
from steplens.analyze.analyses import memory

QWEN_TRACE = "TraceLens/h100/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz"
MEGATRON_LOG = ("Megatron-DeepSpeed/random_ltd_gpt3_baseline/"
                "gpt3-0.125B-tokendropping-graduallyIncrease-lr-3.0e-4-baseline.log")
MIB, GIB = 2**20, 2**30


def _analysed(folder: Path, tmp_path: Path) -> tuple[Path, dict]:
    result, findings = pipeline.analyse(folder, tmp_path / "out", jobs=1)
    return result.out_dir, findings


def _linked(tmp_path: Path, *files: Path) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    for file in files:
        (folder / file.name).symlink_to(file)
    return folder


def test_trace_peak_is_the_largest_device_total_in_the_step(corpus, tmp_path):
    path = corpus / QWEN_TRACE
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "ProfilerStep#6"]
    device = [e["args"] for e in events if e.get("name") == "[memory]" and e["args"]["Device Type"] != 0
              and any(start <= e["ts"] < end for start, end in windows)]
    out_dir, findings = _analysed(_linked(tmp_path, path), tmp_path)
    rows = pl.read_parquet(out_dir / "memory_by_step").filter(pl.col("source") == "trace")
    assert rows.select("rank", "step", "peak_scope").rows() == [(0, 6, "step")]
    assert rows["peak_allocated_bytes"][0] == max(a["Total Allocated"] for a in device) == 2088508416
    assert rows["peak_reserved_bytes"][0] == max(a["Total Reserved"] for a in device)
    assert rows["samples"][0] == len(device)
    # Host allocations (Device Type 0) have their own, tiny totals: never taken as device memory.
    events_table = pl.read_parquet(out_dir / "trace_events").filter(pl.col("kind") == "memory")
    host = sum(e["args"]["Device Type"] == 0 for e in events if e.get("name") == "[memory]")
    assert events_table["total_allocated_bytes"].null_count() == host == 200
    assert findings["memory"]["peak_by_rank"][0]["peak_allocated_bytes"] == 2088508416


def test_log_lines_give_the_figures_as_printed(corpus, tmp_path):
    """see_memory_usage: GB = 2**30 (deepspeed/runtime/utils.py divides by 1024 * 1024 * 1024), rounded to
    0.01 and Max_CA to a whole number; Megatron's report_memory: MB = 2**20. Values read off the file by hand:
    line 1109 'MA 0.24 GB Max_MA 0.24 GB CA 0.25 GB Max_CA 0 GB' after 'After Building Model' (line 1108),
    line 2739 '[Rank 0] (after 10 iterations) memory (MB) | allocated: 1674.31005859375 | max allocated:
    7176.13916015625 | reserved: 8774.0 | max reserved: 8774.0'."""
    out_dir, findings = _analysed(_linked(tmp_path, corpus / MEGATRON_LOG), tmp_path)
    everything = pl.read_parquet(out_dir / "memory_usage").sort("line")
    # The throughput lines' MemAllocated / MaxMemAllocated (GB = 2**30, 2 decimals), read off the file by regex.
    text = (corpus / MEGATRON_LOG).read_text().split("\n")
    throughput = [(number, round(float(a) * GIB), round(float(m) * GIB)) for number, line in enumerate(text, start=1)
                  for a, m in re.findall(r"MemAllocated=([\d.]+)GB, MaxMemAllocated=([\d.]+)GB", line)]
    assert len(throughput) > 40 and everything.filter(pl.col("origin") == "deepspeed_throughput").select(
        "line", "allocated_bytes", "max_allocated_bytes").rows() == throughput
    usage = everything.filter(pl.col("origin") != "deepspeed_throughput")
    assert usage.select("line", "origin", "message", "step").rows() == [
        (1106, "see_memory_usage", "Before Building Model", None),
        (1109, "see_memory_usage", "After Building Model", None),
        (2739, "megatron_report_memory", "(after 10 iterations)", 9)]
    built = usage.row(1, named=True)
    assert (built["allocated_bytes"], built["max_allocated_bytes"], built["reserved_bytes"], built["max_reserved_bytes"]) == (
        round(0.24 * GIB), round(0.24 * GIB), round(0.25 * GIB), 0)
    megatron = usage.row(2, named=True)
    assert (megatron["allocated_bytes"], megatron["max_allocated_bytes"], megatron["reserved_bytes"]) == (
        round(1674.31005859375 * MIB), round(7176.13916015625 * MIB), 8774 * MIB)
    peak = findings["memory"]["peak_by_rank"]
    # Megatron reported once (after 10 iterations); the throughput lines show the running peak rising to 7.15 GiB
    # later (DeepSpeed 0.7's "0/N" lines give no optimizer step).
    assert max(m for _, _, m in throughput) == round(7.15 * GIB) > round(7176.13916015625 * MIB)
    assert peak == [{"rank": 0, "peak_allocated_bytes": round(7.15 * GIB), "step": None,
                     "source": "deepspeed_throughput", "peak_reserved_bytes": 8774 * MIB}]
    by_step = pl.read_parquet(out_dir / "memory_by_step")
    # see_memory_usage's reserved peak: CA 0.25 GiB is larger than the whole-GiB Max_CA printed as 0.
    assert by_step.filter(pl.col("label") == "After Building Model")["peak_reserved_bytes"].to_list() == [round(0.25 * GIB)]
    assert findings["memory"]["out_of_memory"] is None


def _memory_trace(path: Path, peaks_mib: list[float]) -> Path:
    """One ProfilerStep per peak: an allocation that takes the device total to the step's peak, then its free."""
    base_us, step_us = 1_700_000_000_000_000, 10_000
    events = []
    for step, peak in enumerate(peaks_mib):
        start = base_us + step * step_us
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                       "ts": start, "dur": step_us - 10})
        resident, block = 900 * MIB, round(peak * MIB) - 900 * MIB
        for offset, nbytes, total in ((100, block, resident + block), (5000, -block, resident)):
            events.append({"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1,
                           "ts": start + offset, "args": {"Total Reserved": 2 * GIB, "Total Allocated": total,
                                                          "Bytes": nbytes, "Device Id": 0, "Device Type": 1}})
    return write_trace(path, events)


def test_growth_beyond_the_noise_is_named_and_flat_memory_is_not(tmp_path):
    # 12 steps: the first two warm up (optimizer states), then +8 MiB per step with +-0.25 MiB jitter.
    jitter = [0.25, -0.25, 0.0, 0.25, -0.25, 0.0, 0.25, -0.25, 0.0, 0.25]
    leaking = [1000.0, 1500.0] + [1600 + 8 * k + j for k, j in enumerate(jitter)]
    _memory_trace(tmp_path / "leak" / "rank0.pt.trace.json", leaking)
    _, findings = _analysed(tmp_path / "leak", tmp_path / "a")
    judged = findings["memory"]["growth"][0]
    assert judged["growing"] and (judged["first_step"], judged["last_step"], judged["steps"]) == (2, 11, 10)
    assert judged["slope_bytes_per_step"] == pytest.approx(8 * MIB, rel=0.02)
    flat = [1000.0, 1500.0] + [1600 + j for j in jitter]
    _memory_trace(tmp_path / "flat" / "rank0.pt.trace.json", flat)
    _, findings = _analysed(tmp_path / "flat", tmp_path / "b")
    assert findings["memory"]["growth"][0]["growing"] is False
    assert findings["memory"]["peak_by_rank"][0]["peak_allocated_bytes"] == round(1600.25 * MIB)


ENGINE_LINE = "[2025-01-01 10:00:00,000] [INFO] [engine.py:1234:_configure_optimizer] Using DeepSpeed Optimizer param name adam"
TIMER_LINE = "[Rank {rank}] time (ms) | fwd: 10.5 | bwd: 20.25 | step: 5.0"


@pytest.mark.parametrize("error, kind, tried, capacity", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
     "of which 1.02 GiB is free.", "device", 2 * GIB, round(79.15 * GIB)),
    ("RuntimeError: HIP out of memory. Tried to allocate 20.00 MiB (GPU 0; 63.98 GiB total capacity; 61.50 GiB already "
     "allocated)", "device", 20 * MIB, round(63.98 * GIB)),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "device", None, None),
    ("MemoryError: std::bad_alloc", "host", None, None),
])
def test_out_of_memory_end_with_its_rank_and_step(tmp_path, error, kind, tried, capacity):
    # A per-rank log (rank 1 by its name): three optimizer steps close (global timer lines), then the
    # traceback: the job died in step 3.
    lines = [ENGINE_LINE] + [TIMER_LINE.format(rank=1)] * 3 + ["Traceback (most recent call last):",
                                               '  File "train.py", line 10, in <module>', error]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "rank1.log").write_text("\n".join(lines) + "\n")
    _, findings = _analysed(tmp_path / "in", tmp_path)
    oom = findings["memory"]["out_of_memory"]
    assert (oom["kind"], oom["rank"], oom["step"], oom["tried_bytes"], oom["capacity_bytes"]) == (kind, 1, 3, tried, capacity)
    assert oom["error"] == error
    from steplens.analyze.analyses.memory import memory_lines

    assert f"out of {kind} memory on rank 1 in step 3" in " ".join(memory_lines(findings["memory"]))


def test_a_cpu_collector_run_makes_no_cuda_call_and_says_no_device_memory(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from steplens.collect import attach

    def no_cuda_call(*args, **kwargs):
        raise AssertionError("a CPU job must make no cuda call")

    monkeypatch.setattr(torch.cuda, "memory_stats", no_cuda_call)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path / "run"), samples_per_step=4, flush_every=2,
                       profile=None, flops_step=None)
    for _ in range(4):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    collector.close()
    assert "memory" not in json.loads((tmp_path / "run" / "collector" / "manifest" / "rank0.json").read_text())["disabled"]
    out_dir, findings = _analysed(tmp_path / "run", tmp_path)
    steps = pl.read_parquet(out_dir / "train_steps")
    assert steps.height == 4 and steps["max_allocated_bytes"].null_count() == steps["max_reserved_bytes"].null_count() == 4
    assert findings["memory"]["device_memory_recorded"] is False and findings["memory"]["collector_without_device"]


def test_the_collector_reads_the_keys_max_memory_allocated_reads():
    """The collector takes both peaks from one memory_stats() read: the same keys torch's own functions return."""
    torch = pytest.importorskip("torch")
    import inspect

    assert '"allocated_bytes.all.peak"' in inspect.getsource(torch.cuda.max_memory_allocated)
    assert '"reserved_bytes.all.peak"' in inspect.getsource(torch.cuda.max_memory_reserved)
    collector_source = (Path(__file__).resolve().parents[1] / "collect" / "collector.py").read_text()
    assert '"allocated_bytes.all.peak"' in collector_source and '"reserved_bytes.all.peak"' in collector_source


def test_a_deepspeed_cpu_job_says_no_device_memory(ds_steady_run, tmp_path):
    """A real 2-rank DeepSpeed CPU job: the collector recorded every step and no device memory."""
    out_dir, findings = _analysed(ds_steady_run, tmp_path)
    steps = pl.read_parquet(out_dir / "train_steps")
    assert sorted(steps["rank"].unique().to_list()) == [0, 1] and steps["max_allocated_bytes"].is_null().all()
    memory = findings["memory"]
    assert memory["device_memory_recorded"] is False and memory["collector_without_device"]
    assert pl.read_parquet(out_dir / "memory_by_step").is_empty()


def test_an_exact_figure_is_the_peak_over_a_rounded_one_as_large_within_its_rounding():
    """Megatron's exact 7176.14 MiB (7.0079 GiB) against a throughput line's MaxMemAllocated=7.01GB: the same
    peak, printed rounded up."""
    rows = pl.DataFrame({"rank": [0, 0, 0], "step": [9, 9, 3], "source": ["deepspeed_throughput", "megatron_report_memory",
                                                                          "see_memory_usage"],
                         "peak_allocated_bytes": [round(7.01 * GIB), round(7176.13916015625 * MIB), round(2.0 * GIB)],
                         "resolution_bytes": [round(0.01 * GIB), 0, round(0.01 * GIB)]})
    assert memory._peak_row(rows)["source"] == "megatron_report_memory"
    higher = rows.with_columns(peak_allocated_bytes=pl.Series([round(7.02 * GIB), round(7176.13916015625 * MIB), 0]))
    assert memory._peak_row(higher)["source"] == "deepspeed_throughput"  # 7.02 GiB: above the exact one by more than 0.01


def test_analyze_shows_the_memory_section(tmp_path):
    _memory_trace(tmp_path / "run" / "rank0.pt.trace.json", [1000.0, 1500.0] + [1600 + 8 * k for k in range(8)])
    done = subprocess.run([sys.executable, "-m", "steplens.analyze", str(tmp_path / "run"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    findings = json.loads((tmp_path / "o" / "findings.json").read_text())
    assert findings["memory"]["growth"][0]["growing"]
    assert pl.read_parquet(tmp_path / "o" / "memory_by_step").height == 10
    html = (tmp_path / "o" / "report.html").read_text()
    assert "Memory per rank and step" in html and "8.00 MiB per step" in html
    first = pl.read_parquet(tmp_path / "o" / "memory_by_step").sort("rank", "step").row(0, named=True)
    peak = first["peak_allocated_bytes"]
    unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)
    shown = f"{peak / scale:.3g}" if peak / scale < 100 else f"{peak / scale:,.0f}"  # three digits, never 1e+03
    assert f"<td>{shown}\u00a0{unit}</td>" in html  # the table in units, from its _bytes suffix (no-break space)
    assert "8.00 MiB per step" in (tmp_path / "o" / "summary.md").read_text()
    assert re.search(r"Peak memory: 1\.\d\d GiB allocated, [\d.]+ \w+ reserved on rank 0", " ".join(done.stdout.split()))


def test_sentences_stay_few_however_many_ranks():
    """64 ranks: one peak sentence naming the highest rank and the lowest peak, one growth sentence."""
    from steplens.analyze.analyses.memory import memory_lines
    peaks = [{"rank": r, "peak_allocated_bytes": (10 + r % 7) * 2**30, "peak_reserved_bytes": 20 * 2**30, "step": 5,
              "source": "collector"} for r in range(64)]
    growth = [{"rank": r, "growing": r in (3, 9), "slope_bytes_per_step": (r + 1) * 2**20, "first_step": 2, "last_step": 40,
               "first_bytes": 10 * 2**30, "last_bytes": 11 * 2**30, "noise_bytes": 2**20, "source": "collector"}
              for r in range(64)]
    lines = memory_lines({"out_of_memory": None, "device_memory_recorded": True, "collector_without_device": False,
                          "peak_by_rank": peaks, "growth": growth})
    assert len(lines) == 2
    assert lines[0].startswith("Peak memory: 16.00 GiB allocated, 20.00 GiB reserved on rank 6 (step 5, from the collector's step records)")
    assert "the lowest of the 64 ranks peaks at 10.00 GiB" in lines[0]
    assert lines[1].startswith("Memory grows on rank(s) 3, 9: up to 10.00 MiB per step on rank 9")


def test_growth_is_judged_on_the_throughput_lines_when_megatron_reported_once(tmp_path):
    """Megatron reports memory once (after the first logging interval); DeepSpeed's throughput line carries
    the running peak at every print: 1 GiB more each print, beyond the 0.01 GiB rounding."""
    lines = ["[2024-01-01 00:00:00,000] [INFO] [logging.py:96:log_dist] [Rank 0] (after 10 iterations) memory (MB) | "
             "allocated: 1024.0 | max allocated: 2048.0 | reserved: 4096.0 | max reserved: 4096.0"]
    for k in range(1, 11):
        lines.append(f"[2024-01-01 00:00:{k:02d},000] [INFO] [timer.py:264:stop] epoch=0/micro_step={10 * k}/global_step="
                     f"{10 * k}, RunningAvgSamplesPerSec=50.0, CurrSamplesPerSec=50.0, MemAllocated=1.0GB, "
                     f"MaxMemAllocated={2 + k}.0GB")
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "train.log").write_text("\n".join(lines) + "\n")
    _, findings = _analysed(folder, tmp_path)
    [judged] = findings["memory"]["growth"]
    assert (judged["source"], judged["growing"], judged["first_step"], judged["last_step"]) == ("deepspeed_throughput", True, 29, 99)
    assert judged["slope_bytes_per_step"] == pytest.approx(GIB / 10)  # 1 GiB every 10 steps


@pytest.mark.parametrize("accelerator", ["cpu", "cuda"])
def test_a_cpu_accelerators_throughput_memory_is_host_memory_and_left_out(tmp_path, accelerator):
    """DeepSpeed's cpu accelerator answers memory_allocated() with the host process's memory: not device memory."""
    lines = [f"[2024-01-01 00:00:00,000] [INFO] [real_accelerator.py:203:get_accelerator] Setting ds_accelerator to "
             f"{accelerator} (auto detect)"]
    lines += [f"[2024-01-01 00:00:0{k},000] [INFO] [timer.py:264:stop] epoch=0/micro_step={k}/global_step={k}, "
              f"RunningAvgSamplesPerSec=50.0, CurrSamplesPerSec=50.0, MemAllocated=0.45GB, MaxMemAllocated=0.85GB"
              for k in range(1, 4)]
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "train.log").write_text("\n".join(lines) + "\n")
    _, findings = _analysed(folder, tmp_path)
    recorded = findings["memory"]["device_memory_recorded"] if findings.get("memory") else False
    assert recorded is (accelerator == "cuda")


def test_a_logged_figure_keeps_the_unit_and_digits_the_log_gave():
    """DeepSpeed's throughput line printed MemAllocated=0.39GB (GiB, two decimals): the peak is said as 0.39 GiB, not
    as 399.36 MiB, digits the log never had; an exact figure keeps the two-decimal binary unit that fits it."""
    from steplens.analyze.analyses.memory import memory_lines

    logged = round(0.39 * 2**30)
    peaks = [{"rank": 0, "peak_allocated_bytes": logged, "peak_reserved_bytes": None, "step": 15,
              "source": "deepspeed_throughput"},
             {"rank": 1, "peak_allocated_bytes": 300 * 2**20, "peak_reserved_bytes": None, "step": 15, "source": "collector"}]
    lines = memory_lines({"out_of_memory": None, "device_memory_recorded": True, "collector_without_device": False,
                          "peak_by_rank": peaks, "growth": []})
    assert lines[0].startswith("Peak memory: 0.39 GiB allocated on rank 0 (step 15, from DeepSpeed's throughput lines)")
    assert "the lowest of the 2 ranks peaks at 300.00 MiB" in lines[0] and "399" not in lines[0]


def test_one_rounding_step_in_a_logged_running_peak_is_not_growth(tmp_path):
    """The helper's ZeRO-1 job (gas 3, a print every step): MaxMemAllocated went 0.4, 0.4, 0.4, 0.4, 0.4, 0.41, 0.41,
    0.41 GB, one step of the 0.01 GiB print in a running peak, which can only rise; "Memory grows 2.56 MiB per step"
    was rounding. Two steps of it over the series (0.40 -> 0.42) is growth."""
    def judged(peaks: list[float]) -> dict:
        lines = [f"[2024-01-01 00:00:{k:02d},000] [INFO] [timer.py:264:stop] epoch=0/micro_step={3 * k}/global_step={k}, "
                 f"RunningAvgSamplesPerSec=350.0, CurrSamplesPerSec=350.0, MemAllocated=0.4GB, MaxMemAllocated={peak}GB"
                 for k, peak in enumerate(peaks, start=1)]
        folder = tmp_path / f"in{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        (folder / "train.log").write_text("\n".join(lines) + "\n")
        _, findings = _analysed(folder, folder.with_suffix(".out"))
        return findings["memory"]["growth"][0]

    one_step = judged([0.4] * 7 + [0.41] * 5)
    assert one_step["source"] == "deepspeed_throughput" and one_step["growing"] is False
    two_steps = judged([0.4] * 4 + [0.41] * 4 + [0.42] * 4)
    assert two_steps["growing"] is True
