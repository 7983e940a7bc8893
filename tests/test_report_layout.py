"""Where one step's time went (step_breakdown, step_timeline), the report that shows it, and terminal
output that survives a CI log: numbers against hand-computed cases and an independent recomputation
from the raw corpus JSON (stdlib json + Decimal, no steplens code), and the report seen in Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from decimal import Decimal
from html.parser import HTMLParser
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from conftest import CORPUS, REALRUN_INSTRUMENTED, write_trace
from steplens.analyze.cli import analyze

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DLRM = CORPUS / "param" / "dlrm_kineto"
NCCL = "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)"
GEMM = "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4>(cutlass_80_tensorop_s1688gemm::Params)"


def _analyse(run: Path, *args: str) -> Path:
    result = CliRunner().invoke(analyze, [str(run), "-q", *args])
    assert result.exit_code in (0, 1), result.output
    return run / ".steplens"


def _rank_events(shift_us: int) -> list[dict]:
    """One profiled step on one rank: compute [100, 300) on stream 7, an all-reduce [250, 500) on stream
    20 (50 µs of it under compute), then nothing until compute [600, 700) launched at 550 (µs after
    shift_us, this rank's clock)."""
    def launch(ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": shift_us + ts,
                "dur": 5, "args": {"correlation": corr}}

    def kernel(name, ts, dur, stream, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": shift_us + ts, "dur": dur,
                "args": {"correlation": corr, "stream": stream, "device": 0}}

    return [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": shift_us, "dur": 1000},
        launch(50, 1), kernel(GEMM, 100, 200, 7, 1),
        launch(60, 2), kernel(NCCL, 250, 250, 20, 2),
        launch(550, 3), kernel(GEMM, 600, 100, 7, 3),
    ]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """Rank 1's clock runs 5 ms ahead of rank 0's; the all-reduce ends together on both."""
    run = tmp_path_factory.mktemp("breakdown") / "run"
    for rank, shift in ((0, 0), (1, 5000)):
        write_trace(run / f"rank{rank}.json", _rank_events(shift), distributedInfo={"rank": rank, "world_size": 2})
    return _analyse(run)


def test_step_breakdown_splits_the_step_as_computed_by_hand(two_ranks):
    table = pl.read_parquet(two_ranks / "step_breakdown").sort("rank")
    # span 0..1000 = the step on the CPU (the device did nothing before its first kernel, and nothing after 700);
    # compute = 200 + 100; the all-reduce outside compute = 300..500; idle, all host-bound: 0..100 (the first
    # launch came at 50), 500..600 (the next launch came at 550, after the GPU ran dry at 500), 700..1000.
    for row in table.iter_rows(named=True):
        assert (row["step"], row["span_ns"], row["compute_ns"], row["exposed_comm_ns"], row["idle_ns"]) == \
               (1, 1_000_000, 300_000, 200_000, 500_000)
        assert (row["host_bound_ns"], row["sync_ns"], row["other_ns"]) == (500_000, 0, 0)
    assert table["rank"].to_list() == [0, 1]


def test_step_timeline_puts_the_ranks_on_one_clock(two_ranks):
    timeline = pl.read_parquet(two_ranks / "step_timeline")
    for rank in (0, 1):  # rank 1's segments, moved back by its 5 ms offset, land on rank 0's
        segments = sorted(timeline.filter(pl.col("rank") == rank).select("activity", "start_ns", "end_ns").rows())
        assert segments == [("compute", 100_000, 300_000), ("compute", 600_000, 700_000),
                            ("exposed communication", 300_000, 500_000), ("idle", 0, 100_000), ("idle", 500_000, 600_000),
                            ("idle", 700_000, 1_000_000)]


def _raw_step_breakdown(trace: Path, step: int) -> dict[str, int]:
    """span, compute and exposed communication (ns) of one ProfilerStep, from the raw JSON. The span
    opens at the first start of the device work whose launch call (by correlation id) started inside the
    step annotation or, where the device sat idle just before it with the step begun, at the latest of
    the step's start, the end of the device work before (none: the step's start) and the end of earlier
    steps' spans; it closes at that work's last end or, if later, at the step's end (not past the next
    step's first work); compute is the part of it covered by any non-NCCL device work of the trace,
    exposed communication the part covered by NCCL kernels only."""
    doc = json.loads(trace.read_text(), parse_float=Decimal)
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    all_device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]

    def launched_in(window) -> tuple[Decimal, set]:
        lo, hi = Decimal(window["ts"]), Decimal(window["ts"]) + Decimal(window["dur"])
        return lo, {e["args"]["correlation"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                    and "correlation" in e.get("args", {}) and lo <= Decimal(e["ts"]) < hi}

    window = next(e for e in events if e.get("name") == f"ProfilerStep#{step}" and e.get("cat") == "user_annotation")
    lo, launched = launched_in(window)
    device = [(Decimal(e["ts"]) * 1000, (Decimal(e["ts"]) + Decimal(e["dur"])) * 1000, "nccl" in e["name"].lower(),
               e.get("args", {}).get("correlation") in launched) for e in all_device]
    first = min(s for s, _, _, mine in device if mine)
    last = max(e for _, e, _, mine in device if mine)
    windows = sorted((other for other in events if other.get("cat") == "user_annotation"
                      and other["name"].startswith("ProfilerStep#")), key=lambda other: Decimal(other["ts"]))

    def own_work(other) -> list[tuple[Decimal, Decimal]]:
        return [(Decimal(e["ts"]) * 1000, (Decimal(e["ts"]) + Decimal(e["dur"])) * 1000) for e in all_device
                if e.get("args", {}).get("correlation") in launched_in(other)[1]]

    def closing(other) -> Decimal:  # the end of another step's span, by the same rule
        work, later = own_work(other), [min(s for s, _ in own_work(w)) for w in windows
                                        if Decimal(w["ts"]) > Decimal(other["ts"]) and own_work(w)]
        hi = (Decimal(other["ts"]) + Decimal(other["dur"])) * 1000
        return max(max(e for _, e in work), min([hi] + later[:1]))

    earlier_ends = [closing(other) for other in windows if Decimal(other["ts"]) < lo and own_work(other)]
    ended_before = [e for s, e, _, _ in device if e <= first]
    if (not ended_before or max(ended_before) < first) and not any(s < first < e for s, e, _, _ in device):
        first = min(first, max([lo * 1000] + ([max(ended_before)] if ended_before else []) + earlier_ends))
    last = closing(window)

    def covered(intervals):
        total, reach = Decimal(0), first
        for start, end in sorted(intervals):
            start, end = max(start, reach), min(end, last)
            if end > start:
                total += end - start
                reach = end
        return total

    busy = covered([(s, e) for s, e, _, _ in device])
    compute = covered([(s, e) for s, e, comm, _ in device if not comm])
    return {"span_ns": int(last - first), "compute_ns": int(compute), "exposed_comm_ns": int(busy - compute)}


@pytest.fixture(scope="module")
def dlrm(tmp_path_factory) -> Path:
    if not DLRM.is_dir():
        pytest.skip(f"shared corpus not found at {CORPUS}")
    run = tmp_path_factory.mktemp("dlrm") / "dlrm_kineto"
    shutil.copytree(DLRM, run)
    return _analyse(run)


@pytest.mark.parametrize("batch_events", [None, 1, 5_000])
def test_step_breakdown_matches_the_raw_8_rank_trace(dlrm, batch_events, tmp_path, monkeypatch):
    """The 8 ranks' kernel launches in one part (their batch, as analyze makes it), one part a rank, or a few
    ranks a part: step_breakdown reads a part at a time, all its ranks in one pass."""
    if batch_events is not None:
        from steplens.analyze.analyses import runner

        monkeypatch.setattr(runner, "RANK_BATCH_EVENTS", batch_events)
        dlrm = shutil.copytree(dlrm, tmp_path / "out")
        runner.run(dlrm)
    parts = len(list((dlrm / "kernel_launches").glob("*.parquet")))
    assert parts == {None: 1, 1: 8}.get(batch_events, parts) and (batch_events != 5_000 or 1 < parts < 8)
    table = pl.read_parquet(dlrm / "step_breakdown")
    assert sorted(table["rank"].to_list()) == list(range(8))
    for trace in sorted(DLRM.glob("worker*.json")):
        rank = int(re.match(r"worker(\d+)", trace.name).group(1))
        row = table.filter(pl.col("rank") == rank).row(0, named=True)
        assert {k: row[k] for k in ("span_ns", "compute_ns", "exposed_comm_ns")} == _raw_step_breakdown(trace, row["step"])
        assert row["idle_ns"] == row["host_bound_ns"] + row["sync_ns"] + row["other_ns"]  # the causes split all idle


def _raw_exposed_by_op(trace: Path) -> dict[str, Decimal]:
    """Per collective (from the NCCL kernel's name), this rank's exposed time in ns: each NCCL
    kernel's duration minus the part covered by other device work (non-NCCL kernels, copies, sets) on another
    stream of its device."""
    events = [e for e in json.loads(trace.read_text(), parse_float=Decimal)["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    nccl = [e for e in events if e["cat"] == "kernel" and "nccl" in e["name"].lower()]
    compute = [e for e in events if e not in nccl]
    exposed: dict[str, Decimal] = {}
    for kernel in nccl:
        start, end = Decimal(kernel["ts"]) * 1000, (Decimal(kernel["ts"]) + Decimal(kernel["dur"])) * 1000
        others = sorted((max(Decimal(e["ts"]) * 1000, start), min((Decimal(e["ts"]) + Decimal(e["dur"])) * 1000, end))
                        for e in compute if e["args"].get("device") == kernel["args"].get("device")
                        and e["args"].get("stream") != kernel["args"].get("stream"))
        covered, reach = Decimal(0), start
        for lo, hi in others:
            lo = max(lo, reach)
            if hi > lo:
                covered, reach = covered + hi - lo, hi
        op = re.match(r"ncclKernel_([A-Za-z]+)_", kernel["name"]).group(1).lower()
        exposed[op] = exposed.get(op, Decimal(0)) + (end - start - covered)
    return exposed


def test_collective_summary_takes_the_worst_and_median_rank(dlrm):
    per_rank = {int(re.match(r"worker(\d+)", t.name).group(1)): _raw_exposed_by_op(t) for t in DLRM.glob("worker*.json")}
    summary = pl.read_parquet(dlrm / "collective_summary")
    assert sorted(summary["op"].to_list()) == sorted({op for ops in per_rank.values() for op in ops})
    for row in summary.iter_rows(named=True):
        exposed = {rank: ops[row["op"]] for rank, ops in per_rank.items() if row["op"] in ops}
        worst = max(exposed.values())
        assert row["max_rank_exposed_ns"] == worst and exposed[row["max_exposed_rank"]] == worst
        ordered = sorted(exposed.values())
        middle = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2
        assert row["median_rank_exposed_ns"] == int(middle.to_integral_value())
        assert row["ranks"] == len(exposed)
    categories = pl.read_parquet(dlrm / "category_summary")
    raw_total = sum((Decimal(e["dur"]) * 1000 for t in DLRM.glob("worker*.json")
                     for e in json.loads(t.read_text(), parse_float=Decimal)["traceEvents"]
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), Decimal(0))
    assert categories["time_ns"].sum() == raw_total and categories["share"].sum() == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------
# the report


class _Cells(HTMLParser):
    """Every table cell's text and title, and the sections (h2 id -> text) of a report."""

    def __init__(self):
        super().__init__()
        self.cells, self.headings, self._in, self._heading = [], {}, None, None

    def handle_starttag(self, tag, attrs):
        if tag == "td":
            self._in = [dict(attrs).get("title"), ""]
        elif tag == "h2":
            self._heading = dict(attrs).get("id")

    def handle_endtag(self, tag):
        if tag == "td" and self._in is not None:
            self.cells.append(tuple(self._in))
            self._in = None
        elif tag == "h2":
            self._heading = None

    def handle_data(self, data):
        if self._in is not None:
            self._in[1] += data
        if self._heading:
            self.headings[self._heading] = self.headings.get(self._heading, "") + data


def _parse(html: str) -> _Cells:
    parser = _Cells()
    parser.feed(html)
    return parser


def _section(html: str, anchor: str) -> str:
    start = html.index(f'<h2 id="{anchor}">')
    end = html.find("<h2 ", start + 1)
    return html[start:end if end > 0 else None]


def test_report_renders_values_as_text_and_caps_tables(dlrm):
    html = (dlrm / "report.html").read_text()
    cells = _parse(html).cells
    texts = [text for _, text in cells]
    for bad in ("True", "False", "None", "nan"):
        assert bad not in texts
    assert not [t for t in texts if t.startswith(("{", "["))]  # no JSON or Python reprs
    for table in re.findall(r"<tbody>(.*?)</tbody>", html, re.S):
        assert table.count("<tr>") <= 10
    # Kernel names: the base name in the cell, the full demangled name in its tooltip.
    kernels = [(title, text) for title, text in cells if title]
    assert kernels and all(len(text) <= 60 and re.sub(r" \(\d+\)$", "", text) in title for title, text in kernels)
    raw_names = {e["name"] for e in json.loads((DLRM / "worker0_step_12.1694128201545.pt.trace.json").read_text())[
        "traceEvents"] if e.get("cat") == "kernel"}
    assert {title for title, _ in kernels} <= raw_names | {
        e["name"] for t in DLRM.glob("*.json") for e in json.loads(t.read_text())["traceEvents"] if e.get("cat") == "kernel"}


def test_report_states_each_fact_once_and_finds_the_world_size(dlrm):
    html = (dlrm / "report.html").read_text()
    comparability = _section(html, "run-comparability")
    world = re.search(r"<td>world_size</td><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td>", comparability)
    assert world and world.group(2) == "8" and world.group(3) == "recorded"  # distributedInfo.world_size
    run = _section(html, "run")
    assert run.count("<dt>world size</dt>") == 1


def test_empty_parts_say_so_in_one_line(dlrm):
    html = (dlrm / "report.html").read_text()
    collectives = _section(html, "collectives")
    # dlrm's NCCL sendrecv kernels carry no message size: no busbw, so no (empty) bandwidth plot.
    assert "<svg" not in collectives and "No bandwidth plot" in collectives
    steps = _section(html, "steps")  # one profiled step: no one-column heatmap, no one-point curve
    assert "<svg" not in steps


def test_report_draws_where_the_slowest_step_went(dlrm):
    html = (dlrm / "report.html").read_text()
    stats = pl.read_parquet(dlrm / "step_stats")
    slowest = stats.sort("aligned_dur_ns", descending=True)["step"][0]
    time = _section(html, "time")
    assert f"ProfilerStep#{slowest}, the slowest profiled step" in time
    assert time.count("<svg") == 2  # the stacked bars and the timeline
    assert "ranks aligned on collective end times" in time
    for label in ("compute", "exposed communication", "host-bound idle", "sync idle", "idle"):
        assert f">{label}<" in time  # legends name every activity


def test_instrumented_run_marks_excluded_and_profiled_steps(ds_instrumented_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ds_instrumented_run, run)
    out = _analyse(run)
    html = (out / "report.html").read_text()
    steps = _section(html, "steps")
    assert steps.count("<svg") == 1 and ">profiled<" in steps and "excluded: " in steps
    job = REALRUN_INSTRUMENTED
    rows = dict(re.findall(r"<tr><td>(\d+)</td><td>[^<]*</td><td>([^<]*)</td></tr>", steps))
    # The FLOPs-profiled step and the profiler window's active step are named as left out.
    active_step = job["skip_first"] + job["window"][0] + job["window"][1]
    assert "flops profiler" in rows[str(job["flops_step"])]
    assert "profiler window" in rows[str(active_step)]
    numbers = re.search(r'<dl class="numbers">(.*?)</dl>', html, re.S).group(1)
    assert "step time (collector)" in numbers


# ---------------------------------------------------------------------------------------------
# Chromium: the bundled samples and a real 8-rank trace set, seen in a browser


SECTIONS = ("verdict", "time", "steps", "cpu-gpu", "kernels", "collectives", "mfu", "run", "issues")


def _look(driver, report: Path, shot: Path, sections: tuple[str, ...] = SECTIONS) -> dict:
    """Open the report, screenshot it, and return each section's (figures, figures drawn at a readable size)."""
    from selenium.common.exceptions import TimeoutException

    driver.get(report.resolve().as_uri())
    try:
        driver.save_screenshot(str(shot))
    except TimeoutException:  # Chromium on a loaded 2-core machine: "aborted by navigation" once; the page again
        driver.get(report.resolve().as_uri())
        driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 20_000  # a picture, not a blank page
    assert driver.execute_script("return document.scripts.length") == 0
    seen = {}
    for anchor in sections:
        heading = driver.find_element("id", anchor)
        assert heading.is_displayed()
        seen[anchor] = driver.execute_script(
            "const h = document.getElementById(arguments[0]); let n = h.nextElementSibling, svgs = 0, rendered = 0;"
            "while (n && n.tagName !== 'H2') { for (const s of n.querySelectorAll('svg')) { svgs++;"
            " const r = s.getBoundingClientRect(); if (r.width > 200 && r.height > 80) rendered++; }"
            " if (n.tagName === 'svg') svgs++; n = n.nextElementSibling; } return [svgs, rendered];", anchor)
    return seen


def test_sample_and_corpus_reports_show_where_the_time_went_in_chromium(browser, dlrm, tmp_path):
    run = tmp_path / "synthetic_8rank"
    shutil.copytree(ROOT / "sample_runs" / "synthetic_8rank", run, ignore=shutil.ignore_patterns(".steplens"))
    for out in (_analyse(run), dlrm):
        seen = _look(browser, out / "report.html", tmp_path / f"{out.parent.name}.png")
        assert seen["time"] == [2, 2]  # stacked bars and timeline, drawn at a readable size
        numbers = browser.find_element("css selector", "dl.numbers").text
        assert "ranks\n8 (ranks 0-7) of world size 8" in numbers and "GPU idle, whole traced window" in numbers
    seen = _look(browser, dlrm / "report.html", tmp_path / "dlrm.png")
    assert seen["collectives"] == [0, 0] and seen["steps"] == [0, 0]  # nothing to plot: no bare axes


def test_cpu_sample_report_in_chromium(browser, tmp_path):
    run = tmp_path / "deepspeed_cpu_2rank"
    shutil.copytree(ROOT / "sample_runs" / "deepspeed_cpu_2rank", run, ignore=shutil.ignore_patterns(".steplens"))
    seen = _look(browser, _analyse(run) / "report.html", tmp_path / "cpu.png",
                 ("verdict", "time", "steps", "collectives", "mfu", "monitor", "run", "issues"))
    assert seen["time"] == [0, 0]
    assert browser.find_element("css selector", "#time + p.empty").text.startswith("No device work in the traces")
    headings = [h.get_attribute("id") for h in browser.find_elements("css selector", "h2")]
    assert "cpu-gpu" not in headings and "kernels" not in headings  # said once, in the first section
    assert seen["steps"][1] == 1  # the step-time curve over the whole run
    # A table whose names are long in two columns beside many numbers (a module table of 170-character module and
    # class names was 1553 px wide in a 1385 px window: the page scrolled sideways) scrolls by itself, in the page.
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    wide = browser.execute_script(
        "const t = document.querySelector('table'); const row = t.querySelector('tr:last-child');"
        "for (let i = 0; i < 12; i++) { const c = document.createElement('td'); c.textContent = '0.249 ms';"
        " row.appendChild(c); }"
        "row.cells[0].textContent = row.cells[1].textContent = 'M'.repeat(60) + ' <img> (javascript:x)|'.repeat(5);"
        "return t.scrollWidth > t.clientWidth;")
    assert wide  # the table is wider than the page: it scrolls inside
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")


# ---------------------------------------------------------------------------------------------
# the terminal


def _piped(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def _fits_80(text: str) -> list[str]:
    """Lines longer than 80 columns that could have been wrapped (more than one word)."""
    return [line for line in text.splitlines() if len(line) > 80 and len(line.split()) > 1]


def test_terminal_output_fits_80_columns_when_piped(tmp_path):
    run = tmp_path / "deepspeed_cpu_2rank"
    shutil.copytree(ROOT / "sample_runs" / "deepspeed_cpu_2rank", run, ignore=shutil.ignore_patterns(".steplens"))
    full = _piped("analyze", str(run))
    assert full.returncode == 0, full.stderr
    assert full.stderr == ""  # no library warnings
    assert not [line for line in _fits_80(full.stdout) if not line.startswith(("report: ", "PR summary: "))]
    kinds = pl.read_parquet(run / ".steplens" / "ingest_issues")["reason"].n_unique()
    assert f"ingest issues ({kinds} kind(s)" in full.stdout and "profiled steps" in full.stdout
    quiet = _piped("analyze", str(run), "-q")
    assert quiet.stderr == ""
    # -q: the verdict (the report's first screen) and the findings only, no ingest summary
    assert quiet.stdout.startswith("verdict\n") and "\nfindings\n" in quiet.stdout
    verdict = quiet.stdout.split("\nfindings\n")[0].splitlines()[1:]
    assert 1 <= len([line for line in verdict if not line.startswith("    ")]) <= 6  # continuation lines indented
    assert "ingest issues" not in quiet.stdout and "events (all ranks)" not in quiet.stdout


def test_errors_and_the_runs_listing_fit_80_columns_when_piped(tmp_path):
    """An error is one message wrapped under `error: ` (a path longer than the line after it, alone); the listing
    of several runs wraps as the rest does (its lines were 83-86 columns)."""
    nothing = tmp_path / "a folder with nothing steplens reads in it, named at some length"
    nothing.mkdir()
    (nothing / "notes.txt").write_text("hello")
    categories = tmp_path / "categories.csv"
    categories.write_text("category,pattern\nmine,(?<=x)gemm\n")
    runs = tmp_path / "several"
    for name in ("a_rather_long_experiment_name_for_the_baseline", "a_rather_long_experiment_name_for_the_change"):
        write_trace(runs / name / "rank0.json", _rank_events(0), distributedInfo={"rank": 0, "world_size": 1})
    for args, status in (((str(nothing),), 2), ((str(nothing), "--kernel-categories", str(categories)), 2),
                         ((str(runs), "-q"), 0)):
        done = _piped("analyze", *args)
        assert done.returncode == status, done.stderr
        lines = (done.stdout + done.stderr).splitlines()
        assert not [line for line in lines if len(line) > 80 and len(line.split()) > 1
                    and not (line.startswith("error: ") and len(line.split()) == 2)], lines
    assert " ".join(done.stdout.split()).count("1 input(s), ranks 0, 0 error(s)") == 2


def test_an_impossible_mfu_of_any_size_fits_its_line(tmp_path):
    """A peak of 1e-300 TFLOP/s (a typo for 1e3?) makes the collector's FLOPs 10^300 times the peak: named as a
    multiple of the peak, not as a percentage of 300 digits on a 307-column line."""
    run = tmp_path / "deepspeed_cpu_2rank"
    shutil.copytree(ROOT / "sample_runs" / "deepspeed_cpu_2rank", run, ignore=shutil.ignore_patterns(".steplens"))
    done = _piped("analyze", str(run), "-q", "--peak-tflops", "1e-300")
    assert done.returncode == 0, done.stderr
    assert not [line for line in _fits_80(done.stdout) if not line.startswith(("report: ", "PR summary: "))]
    assert "x the peak" in done.stdout, done.stdout


def test_an_issue_excerpt_without_spaces_is_cut_to_fit(tmp_path):
    """A trace event nested 50,000 deep: the nesting_too_deep issue's excerpt of it has no space to wrap at (it
    printed a 127-column line); the terminal cuts it, the ingest_issues table keeps it whole."""
    steps = [{"ph": "X", "name": f"ProfilerStep#{i}", "cat": "user_annotation", "ts": 1000 + i * 10000, "dur": 9000,
              "pid": 1, "tid": 1} for i in range(3)]
    deep = '{"ph":"X","name":"x","ts":1,"dur":1,"pid":1,"tid":1,"args":' + '{"a":' * 50000 + "1" + "}" * 50000 + "}"
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.pt.trace.json").write_text('{"traceEvents":[' + json.dumps(steps)[1:-1] + "," + deep + "]}")
    done = _piped("analyze", str(run), "-j", "1")
    assert done.returncode in (0, 1), done.stderr
    assert "nesting_too_deep" in done.stdout and "…" in done.stdout
    assert not [line for line in _fits_80(done.stdout) if not line.startswith(("report: ", "PR summary: "))]
    whole = pl.read_parquet(run / ".steplens" / "ingest_issues").filter(pl.col("reason") == "nesting_too_deep")
    assert len(max(whole["detail"][0].split(), key=len)) > 60


def test_sql_help_gives_each_example_its_own_block():
    from steplens.analyze.query.sql import EXAMPLES

    result = _piped("steplens", "sql", "--help")
    assert result.returncode == 0 and not _fits_80(result.stdout)
    for title in EXAMPLES:
        block = re.search(rf"\n    # {re.escape(title)}\n((?:    .*\n)+)", result.stdout)
        assert block and block.group(1).lstrip().startswith("SELECT")
        assert "# " not in block.group(1)  # the next example's comment is not run into this one


def test_terminal_strips_control_characters_from_names(tmp_path):
    hostile = "kernel\x1b]0;pwned\x07\x1b[2J\u202eevil"
    events = _rank_events(0)
    events[-1]["name"] = hostile
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    # A file name with an escape sequence, listed among the ingest issues.
    (tmp_path / "run" / "bad\x1b[31m.json").write_text('{"traceEvents": [')
    result = _piped("analyze", str(tmp_path / "run"))
    assert "\x1b" not in result.stdout + result.stderr and "\x07" not in result.stdout and "\u202e" not in result.stdout
    assert "bad?[31m.json" in result.stdout
    # The report and the PR summary show them as the terminal does: no raw control or bidi-override character.
    out = tmp_path / "run" / ".steplens"
    for page in ("report.html", "summary.md"):
        text = (out / page).read_text()
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e]", text), page
    report = (out / "report.html").read_text()
    assert "bad?[31m.json" in report and "kernel?]0;pwned??[2J?evil" in report


def test_summary_escapes_kernel_base_names(tmp_path):
    """A base name holding markdown and HTML specials stays text in the PR comment's table."""
    events = _rank_events(0)
    events[2]["name"] = events[-1]["name"] = "void ns::evil|*_`name`#<int>(float*)"
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    summary = (_analyse(tmp_path / "run") / "summary.md").read_text()
    rows = [line for line in summary.splitlines() if "evil" in line]
    assert rows and all(len(re.findall(r"(?<!\\)\|", row)) == 5 for row in rows)  # 4 columns: the | is escaped
    assert "| evil\\|\\*\\_\\`name\\`\\# |" in rows[0]


def test_verdict_names_the_most_exposed_collective_without_a_made_up_size(dlrm):
    """The collective whose most exposed rank has the most exposed time (the Collectives table's first row), and
    that rank, recomputed from the raw traces."""
    per_rank = {int(re.match(r"worker(\d+)", t.name).group(1)): _raw_exposed_by_op(t) for t in DLRM.glob("worker*.json")}
    worst = {op: max((exposed.get(op, 0), -rank) for rank, exposed in per_rank.items())
             for op in {op for exposed in per_rank.values() for op in exposed}}
    op = sorted(worst, key=lambda name: (-worst[name][0], name))[0]
    exposed_ns, rank = worst[op][0], -worst[op][1]
    html = (dlrm / "report.html").read_text()
    line = re.search(r"<li>Most exposed communication: (.*?)</li>", html).group(1)
    assert line.startswith(f"{op} (message size not in the traces), {float(exposed_ns) / 1e6:.3g} ms not hidden behind "
                           f"compute on rank {rank} (its most exposed rank), ")
    assert "n/a" not in html.split('id="verdict"')[1].split("</ul>")[0]


def test_logs_only_report_says_once_that_traces_are_missing(tmp_path, corpus):
    """A Megatron-DeepSpeed log and nothing else: one line for every trace picture, the step-time
    curve from the log's iterations, no empty axes."""
    run = tmp_path / "megatron"
    shutil.copytree(corpus / "Megatron-DeepSpeed" / "random_ltd_gpt3_baseline", run)
    html = (_analyse(run) / "report.html").read_text()
    anchors = re.findall(r'<h2 id="([^"]+)">', html)
    assert "cpu-gpu" not in anchors and "kernels" not in anchors and "collectives" not in anchors
    assert html.count("No profiler traces in this run") == 1
    assert _section(html, "time").count("<svg") == 0
    assert _section(html, "steps").count("<svg") == 1  # the log's iteration times over the run
    iterations = sum(line.count("elapsed time per iteration") for t in run.glob("*.log") for line in t.open())
    step_time = pl.read_parquet(run / ".steplens" / "step_time")
    assert step_time.height == iterations  # every logged iteration is a point of the curve


def test_timeline_of_many_ranks_stays_small():
    """512 ranks x 30 segments: one embedded image instead of 15,360 SVG rectangles."""
    from steplens.reports import figures

    def timeline(ranks: int) -> pl.DataFrame:
        rows = [(rank, 1, ("compute", "idle", "exposed communication")[i % 3], i * 1000, i * 1000 + 900)
                for rank in range(ranks) for i in range(30)]
        return pl.DataFrame(rows, schema=["rank", "step", "activity", "start_ns", "end_ns"], orient="row")

    small, large = figures.step_gantt(timeline(8)), figures.step_gantt(timeline(512))
    assert "<image" not in small and small.count("<path") >= 8 * 30
    assert "<image" in large and len(large) < 1_000_000
    assert large.count("<text") < 60  # at most 24 rank labels, not 512


def test_no_library_warnings_on_a_real_8_rank_trace(tmp_path):
    if not DLRM.is_dir():
        pytest.skip(f"shared corpus not found at {CORPUS}")
    run = tmp_path / "dlrm"
    shutil.copytree(DLRM, run)
    result = _piped("analyze", str(run))
    assert result.returncode == 0 and result.stderr == ""  # no matplotlib "No artists with labels", no polars warnings
    assert not [line for line in _fits_80(result.stdout) if not line.startswith(("report: ", "PR summary: "))]


# ---------------------------------------------------------------------------------------------
# Layout at 1280x800 (issue 36, item 8): the bundled sample, the real H200 job and 8 real dlrm ranks


H200_JOB = CORPUS.parent / "gpu-runs" / "h200_zero2_gpu_check" / "job"
SGLANG = CORPUS / "TraceLens" / "inference_sglang_decode"

# In the page: its width against the window's, every table word whose letters fall on two lines (a
# break after a hyphen, slash or dash is a line break, not a broken word), and every pair of SVG text
# labels whose boxes overlap (within a pixel).
LAYOUT_PROBE = """
const out = {scroll_width: document.documentElement.scrollWidth, window_width: window.innerWidth, broken: [], overlapping: []};
for (const td of document.querySelectorAll('td')) {
  const walker = document.createTreeWalker(td, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (const word of node.data.matchAll(/\\S+/g)) {
      const range = document.createRange();
      let top = null;
      for (let i = 0; i < word[0].length; i++) {
        range.setStart(node, word.index + i); range.setEnd(node, word.index + i + 1);
        const box = range.getBoundingClientRect();
        if (box.width === 0) continue;
        if (top !== null && box.top > top + 2 && !/[-\\/\\u2013]/.test(word[0][i - 1])) out.broken.push(word[0]);
        top = box.top;
      }
    }
  }
}
for (const svg of document.querySelectorAll('svg')) {
  const labels = [...svg.querySelectorAll('text')].map(t => [t.textContent, t.getBoundingClientRect()]).filter(l => l[1].width > 0);
  for (let i = 0; i < labels.length; i++) for (let j = i + 1; j < labels.length; j++) {
    const [a, p] = labels[i], [b, q] = labels[j];
    if (p.left < q.right - 1 && q.left < p.right - 1 && p.top < q.bottom - 1 && q.top < p.bottom - 1) out.overlapping.push([a, b]);
  }
}
out.sections = [...document.querySelectorAll('h2')].map(h => h.id);
return out;
"""


def _copied(source: Path, to: Path) -> Path:
    """A writable copy of a read-only input folder (analyze writes RUN_DIR/.steplens)."""
    shutil.copytree(source, to, ignore=shutil.ignore_patterns(".steplens"))
    for folder, _, _ in os.walk(to):
        os.chmod(folder, 0o755)
    return to


@pytest.fixture(scope="module")
def h200(tmp_path_factory) -> Path:
    if not H200_JOB.is_dir():
        pytest.skip("../shared/gpu-runs not beside the checkout")
    return _analyse(_copied(H200_JOB, tmp_path_factory.mktemp("h200") / "job"))


def test_reports_fit_1280_columns_with_no_broken_word_or_overlapping_label_in_chromium(browser, dlrm, h200, tmp_path):
    sample = _analyse(_copied(ROOT / "sample_runs" / "synthetic_8rank", tmp_path / "synthetic_8rank"))
    browser.set_window_size(1280, 800)
    try:
        for out, name, sections in ((sample, "synthetic_8rank", ("memory",)), (h200, "h200_job", ("memory", "status")),
                                    (dlrm, "dlrm_8_ranks", ())):
            browser.get((out / "report.html").resolve().as_uri())
            seen = browser.execute_script(LAYOUT_PROBE)
            browser.save_screenshot(str(tmp_path / f"{name}-1280x800.png"))
            assert seen["scroll_width"] <= seen["window_width"], name  # no horizontal scroll
            assert seen["broken"] == [], name
            assert seen["overlapping"] == [], name
            assert set(SECTIONS + sections) <= set(seen["sections"]), name
    finally:
        browser.set_window_size(1280, 4000)


def test_roofline_names_the_busiest_ops_beside_their_point_and_the_rest_in_a_legend(h200):
    """The H200 job's ten top ops: at most three named on the plot, clear of each other; every op with a
    roofline position named exactly once, by its rank in device time (the table's # column)."""
    from steplens.reports import figures

    finding = json.loads((h200 / "findings.json").read_text())["roofline"]
    plotted = [f"{n}. {op['name'].removeprefix('aten::')}" for n, op in enumerate(finding["top_ops"], 1)
               if op.get("intensity") and op.get("achieved_tflops")]
    assert len(plotted) > figures.LABELLED_OPS
    svg = figures.roofline_scatter(finding["top_ops"], finding["roof"])
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
    assert sorted(t for t in texts if re.match(r"\d+\. ", t)) == sorted(plotted)  # each once: on the plot or in the legend
    html = (h200 / "report.html").read_text()
    mfu = _section(html, "mfu")
    rows = re.findall(r"<tr><td>(\d+)</td><td>([^<]*)</td>", mfu)
    assert [(int(n), name) for n, name in rows] == [(n, op["name"]) for n, op in enumerate(finding["top_ops"], 1)][:len(rows)]


def test_roofline_without_a_roof_for_its_dtypes_draws_no_empty_legend(tmp_path):
    """TraceLens's sglang decode trace: int ops only (no roof for their dtype), one with a position."""
    import warnings

    from steplens.reports import figures

    if not SGLANG.is_dir():
        pytest.skip(f"shared corpus not found at {CORPUS}")
    finding = json.loads((_analyse(_copied(SGLANG, tmp_path / "sglang")) / "findings.json").read_text())["roofline"]
    assert not {op["dtype"] for op in finding["top_ops"]} & set(finding["roof"]["peak_tflops"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found to put in legend"
        svg = figures.roofline_scatter(finding["top_ops"], finding["roof"])
    assert 'id="legend_1"' not in svg


def test_memory_table_is_readable_and_collapses_repeated_steps(h200):
    """From the collector's raw train_steps parquet: one row per run of consecutive steps with the same
    running peaks, human headers, sizes in binary units (3 significant digits)."""
    import pyarrow.parquet as pq

    raw = sorted((r["step"], r["max_allocated_bytes"], r["max_reserved_bytes"])
                 for r in pq.read_table(H200_JOB / "collector" / "train_steps").to_pylist())
    runs = []
    for step, allocated, reserved in raw:
        if runs and tuple(runs[-1][2:]) == (allocated, reserved) and runs[-1][1] == step - 1:
            runs[-1][1] = step
        else:
            runs.append([step, step, allocated, reserved])
    memory = _section((h200 / "report.html").read_text(), "memory")
    assert "<th>peak allocated</th>" in memory and "_bytes" not in memory and "peak_scope" not in memory
    rows = re.findall(r"<tr><td>0</td><td>([^<]*)</td><td>collector</td><td></td><td>([^<]*)</td><td>([^<]*)</td>"
                      r"<td>since the start</td><td>(\d+)</td><td>exact</td></tr>", memory)
    assert len(rows) == len(runs)

    def gib(text):
        number, unit = text.split()
        assert unit == "GiB"
        return float(number) * 2**30

    for (steps, allocated, reserved, samples), (first, last, raw_allocated, raw_reserved) in zip(rows, runs):
        assert steps == (str(first) if first == last else f"{first}–{last} ({last - first + 1} rows)")
        assert int(samples) == last - first + 1
        assert gib(allocated) == pytest.approx(raw_allocated, rel=5e-3) and gib(reserved) == pytest.approx(raw_reserved, rel=5e-3)


def test_run_section_gives_the_cuda_version_and_calls_non_trace_json_so(h200):
    """cudaRuntimeGetVersion's 1000 x major + 10 x minor, read from the raw trace; ds_config.json and the
    job's script/rank0.json are JSON files that are not traces."""
    import gzip

    from steplens.reports.html import cuda_version

    trace = next((H200_JOB / "traces").glob("*.json.gz"))
    with gzip.open(trace, "rt") as f:
        raw = json.load(f)["cuda_runtime_version"]
    run = _section((h200 / "report.html").read_text(), "run")
    assert f"<dt>CUDA runtime</dt><dd>{raw // 1000}.{raw % 1000 // 10}</dd>" in run and str(raw) not in run
    not_traces = ["ds_config.json", "script/rank0.json"]  # the job's JSON files no other importer claims
    assert all("traceEvents" not in json.loads((H200_JOB / name).read_text()) for name in not_traces)
    assert f"<td>JSON, not a trace</td><td>ignored</td><td>{len(not_traces)}</td><td>{not_traces[0]}</td>" in run
    assert "<td>kineto</td><td>ignored</td>" not in run
    assert (cuda_version("12040"), cuda_version("13000"), cuda_version("12.8.93")) == ("12.4", "13.0", "12.8.93")


def _one_corpus_trace(name: str, tmp_path: Path) -> Path:
    """A run folder holding one of HTA's corpus traces (a link to it)."""
    trace = CORPUS / "HolisticTraceAnalysis" / name
    if not trace.is_file():
        pytest.skip(f"shared corpus not found at {CORPUS}")
    run = tmp_path / "run"
    run.mkdir()
    (run / trace.name).symlink_to(trace)
    return run


def test_roofline_with_no_op_on_it_says_so_instead_of_drawing_empty_log_axes(tmp_path):
    """HTA's trace_diff test rank alone (a real V100 trace): its busiest modeled ops are copies and casts, with
    bytes but no FLOPs, so none has a point on the log-log roofline; the report says so (matplotlib raised on the
    empty log axes and the whole analyze failed)."""
    from steplens.analyze.analyses.roofline import on_the_roofline

    out = _analyse(_one_corpus_trace("trace_diff/test.json.gz", tmp_path))
    finding = json.loads((out / "findings.json").read_text())["roofline"]
    assert finding["roof"] and finding["top_ops"]
    assert not [op for op in finding["top_ops"] if op["flops"] and op["bytes"] and op["device_ns"]]
    mfu = _section((out / "report.html").read_text(), "mfu")
    assert "none has a point on it" in mfu and "Roofs: " in mfu and "<svg" not in mfu
    # the definition: both positions above zero, whatever else is present
    assert [on_the_roofline(op) for op in ({"intensity": 2.0, "achieved_tflops": 1.5}, {"intensity": 0.0, "achieved_tflops": 1.0},
            {"intensity": 3.0, "achieved_tflops": None}, {"intensity": float("nan"), "achieved_tflops": 1.0}, {})] == \
        [True, False, False, False, False]


def _raw_unlaunched_device_ns(trace: Path) -> int:
    """Summed duration (ns) of the device work (kernels, copies, sets) whose correlation id no runtime or driver
    call of the raw trace carries."""
    import gzip

    doc = json.loads(gzip.decompress(trace.read_bytes()), parse_float=Decimal)
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    called = {e["args"]["correlation"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
              and "correlation" in e.get("args", {})}
    return int(sum(Decimal(e["dur"]) * 1000 for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                   and e.get("args", {}).get("correlation") not in called))


def test_verdict_says_when_most_device_work_has_no_launch_and_no_step(tmp_path):
    """HTA's trace_compare base rank: its launch calls were cut from the file but for one kernel's, so the profiled
    steps' span is that kernel and the idle before it in the step (0.28 ms) while 1.69 ms of device work has no
    step; the headline says how much lies outside its shares."""
    from steplens.reports.verdict import first_screen

    trace = CORPUS / "HolisticTraceAnalysis" / "trace_compare" / "base.json.gz"
    findings = json.loads((_analyse(_one_corpus_trace("trace_compare/base.json.gz", tmp_path)) / "findings.json").read_text())
    split = findings["step_breakdown"]["time_split"]
    unlaunched = _raw_unlaunched_device_ns(trace)
    assert split["unstepped_device_ns"] == unlaunched > 5 * split["span_ns"]
    headline = first_screen(findings)[0][0]
    assert headline.startswith("Inside profiled steps") and \
        f"; {unlaunched / 1e6:.2f} ms more device work has no recorded launch, so no step" in headline


def test_a_column_of_sentences_keeps_a_reading_width_on_a_narrow_page(browser, tmp_path):
    """An autotuning folder at 800 px: the verdict table's detail column shrank to a word a line, cut at the edge."""
    from conftest import CORPUS

    source = CORPUS.parent / "deepspeed-cpu-runs" / "autotune1"
    if not source.is_dir():
        pytest.skip("shared autotune run not found")
    run = shutil.copytree(source, tmp_path / "autotune1")
    out = _analyse(run)
    browser.set_window_size(800, 2000)
    try:
        browser.get((out / "report.html").as_uri())
        widths = browser.execute_script(
            "return Array.from(document.querySelectorAll('td.prose')).map(c => c.getBoundingClientRect().width)")
        detail = [len(row["detail"] or "") for row in pl.read_parquet(out / "autotune_verdict").to_dicts()]
        assert max(detail) > 60 and widths and min(widths) >= 250
    finally:
        browser.set_window_size(1280, 4000)


def test_a_kernel_sharing_its_base_name_with_one_further_down_is_numbered_in_every_view():
    """Template instances share a base name. In the top five, `foo<int>` alone looked like the only foo, while
    `foo<float>` (7th) shared its name: both views number over the whole top_kernels table, so the shown row says it
    is one of several, with the same number in summary.md and report.html."""
    from steplens.reports import html
    from steplens.reports.data import kernel_labels

    names = ["void foo<int>(int*)", "void a()", "void b()", "void c()", "void d()", "void e()", "void foo<float>(float*)"]
    frame = pl.DataFrame({"name": names})
    cells = html._kernel_cells(frame, "name", limit=5)
    assert list(cells) == names[:5]  # the shown rows only
    assert str(cells[names[0]]) == kernel_labels(names)[names[0]] == "foo (1)" and cells[names[0]].full == names[0]
    assert kernel_labels(names)[names[6]] == "foo (2)" and str(cells[names[1]]) == "a"
