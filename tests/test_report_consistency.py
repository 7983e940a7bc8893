"""The verdict against the tables it comes from. The first screen (at most six lines) says the same thing in
report.html, summary.md and the terminal; each figure in it and in the verdict's sentences is checked against the
report's own table or recomputed from the raw inputs (stdlib json/gzip + Decimal, pyarrow for Parquet parts: no
steplens code), on the bundled samples and the real H200 job in ../shared/gpu-runs."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from decimal import Decimal
from html.parser import HTMLParser
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from steplens.analyze.analyses.roofline import roofline_lines

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
H200_JOB = ROOT.parent / "shared" / "gpu-runs" / "h200_zero2_gpu_check" / "job"
RUNS = {"synthetic_8rank": ROOT / "sample_runs" / "synthetic_8rank",
        "deepspeed_cpu_2rank": ROOT / "sample_runs" / "deepspeed_cpu_2rank", "h200": H200_JOB}


class _Report(HTMLParser):
    """The first screen (ul.verdict: its lines without the link text, and each link), the detailed verdict
    (ul.details), every element id, and each section's tables (h2 id -> [[header, rows]])."""

    def __init__(self):
        super().__init__()
        self.first_screen, self.links, self.details, self.ids, self.tables = [], [], [], set(), {}
        self._list, self._in_link, self._in_li, self._section, self._cell = None, False, False, None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "h2":
            self._section = attrs.get("id")
        elif tag == "ul" and attrs.get("class") in ("verdict", "details"):
            self._list = attrs["class"]
        elif tag == "li" and self._list:
            self._in_li = True
            (self.first_screen if self._list == "verdict" else self.details).append("")
        elif tag == "a" and self._list == "verdict" and self._in_li:
            self._in_link = True
            self.links.append(attrs["href"])
        elif tag == "table":
            self.tables.setdefault(self._section, []).append([[], []])
        elif tag == "tr" and self._section in self.tables:
            self.tables[self._section][-1][1].append([])
        elif tag in ("td", "th"):
            self._cell = tag

    def handle_endtag(self, tag):
        if tag == "ul":
            self._list = None
        elif tag == "li":
            self._in_li = False
        elif tag == "a":
            self._in_link = False
        elif tag in ("td", "th"):
            self._cell = None

    def handle_data(self, data):
        data = data.replace("\u00a0", " ")  # a table keeps a number and its unit together with a no-break space
        if self._in_li and not self._in_link:
            lines = self.first_screen if self._list == "verdict" else self.details
            lines[-1] += data
        if self._cell and self._section in self.tables:
            header, rows = self.tables[self._section][-1]
            if self._cell == "th":
                header.append(data)
            else:
                rows[-1].append(data)


def _parse(html: str) -> _Report:
    report = _Report()
    report.feed(html)
    report.first_screen = [line.strip() for line in report.first_screen]
    report.details = [line.strip() for line in report.details]
    return report


def _terminal_verdict(stdout: str) -> list[str]:
    """The terminal's verdict block, each line with its wrapped continuation joined back."""
    block = stdout.split("\nverdict\n", 1)[1].split("\n")
    lines = []
    for line in block:
        if line.startswith("    "):
            lines[-1] += " " + line.strip()
        elif line.startswith("  "):
            lines.append(line.strip())
        else:
            break
    return lines


@pytest.fixture(scope="module")
def analysed(tmp_path_factory) -> dict:
    """name -> (output folder, terminal stdout at 80 columns), for each run that is here."""
    results = {}
    for name, source in RUNS.items():
        if not source.is_dir():
            continue
        run = tmp_path_factory.mktemp("consistency") / name
        shutil.copytree(source, run, ignore=shutil.ignore_patterns(".steplens"))
        done = subprocess.run([str(BIN / "analyze"), str(run)], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "COLUMNS": "80"})
        assert done.returncode == 0, done.stderr
        results[name] = (run / ".steplens", done.stdout)
    return results


def _run(analysed: dict, name: str):
    if name not in analysed:
        pytest.skip(f"{RUNS[name]} is not here")
    out, stdout = analysed[name]
    return out, stdout, _parse((out / "report.html").read_text())


def _share_text(value: float) -> str:
    """The report's rule for a share: no decimals from 9.5% up, one below, 0% for nothing."""
    return "0%" if value == 0 else f"{value:.0%}" if value >= 0.095 else f"{value:.1%}"


@pytest.mark.parametrize("name", list(RUNS))
def test_the_first_screen_is_at_most_six_lines_says_the_same_everywhere_and_links_its_details(analysed, name):
    out, stdout, report = _run(analysed, name)
    assert 1 <= len(report.first_screen) <= 6
    assert len(report.links) == len(report.first_screen)
    for link in report.links:  # every "details" link lands on a section (or the detailed sentences) of this page
        assert link.startswith("#") and link[1:] in report.ids
    assert _terminal_verdict(stdout) == report.first_screen
    summary = (out / "summary.md").read_text()
    first = summary.split("<details>")[0]
    bold = [re.sub(r"\\(.)", r"\1", line[4:-2]) for line in first.splitlines() if line.startswith("- **")]
    assert bold == report.first_screen
    assert report.details and "<details><summary>In detail</summary>" in summary
    assert max(len(line) for line in stdout.split("\nfindings\n")[0].splitlines()) <= 80


def _raw_trace_split(trace: Path) -> list[dict]:
    """Per ProfilerStep of one raw trace: span, compute, exposed communication and idle (ns). The span opens at the
    first start of the device work whose launch call started inside the step or, where the device sat idle just
    before that with the step begun on the CPU, at the latest of the step's start, the end of the device work before
    (none: the step's start) and the end of earlier steps' spans; it closes at the last end of that work or, if
    later, at the step's end on the CPU (but not past the next step's first work, and not where an earlier step's
    work ran on past this step's); compute is the part of it covered
    by non-NCCL device work, exposed communication the part covered by NCCL kernels only."""
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as handle:
        events = [e for e in json.load(handle, parse_float=Decimal)["traceEvents"] if e.get("ph") == "X"]
    device = [(Decimal(e["ts"]) * 1000, (Decimal(e["ts"]) + Decimal(e["dur"])) * 1000, "nccl" in e["name"].lower(),
               e.get("args", {}).get("correlation")) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    windows = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")),
                     key=lambda e: Decimal(e["ts"]))
    own = []  # (window, lo, hi, first and last of its own work), ns
    for window in windows:
        lo, hi = Decimal(window["ts"]), Decimal(window["ts"]) + Decimal(window["dur"])
        launched = {e["args"]["correlation"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                    and "correlation" in e.get("args", {}) and lo <= Decimal(e["ts"]) < hi}
        mine = [(s, e) for s, e, _, corr in device if corr in launched]
        own.append((window, lo * 1000, hi * 1000, min(s for s, _ in mine), max(e for _, e in mine)))
    steps, earlier_end, earlier_work_end = [], None, None
    for i, (window, lo, hi, first, last) in enumerate(own):
        if not any(s < first < e for s, e, _, _ in device):  # the device sat idle just before `first`
            ended_before = [e for _, e, _, _ in device if e <= first]
            if not ended_before or max(ended_before) < first:
                opened = [lo] + ([max(ended_before)] if ended_before else []) + ([earlier_end] if earlier_end else [])
                first = min(first, max(opened))
        next_first = own[i + 1][3] if i + 1 < len(own) else hi
        own_last = last
        if earlier_work_end is None or earlier_work_end <= last:  # no earlier step's work ran on past it
            last = max(last, min(hi, next_first))
        earlier_work_end = max(own_last, earlier_work_end or own_last)
        earlier_end = max(last, earlier_end or last)

        def covered(intervals):
            total, reach = Decimal(0), first
            for start, end in sorted(intervals):
                start, end = max(start, reach), min(end, last)
                if end > start:
                    total, reach = total + end - start, end
            return total

        busy, compute = covered([(s, e) for s, e, _, _ in device]), covered([(s, e) for s, e, comm, _ in device if not comm])
        steps.append({"step": int(window["name"].split("#")[1]), "span": last - first, "compute": compute,
                      "exposed": busy - compute, "idle": last - first - busy})
    return steps


def test_where_the_time_went_is_recomputed_from_the_raw_traces(analysed):
    out, _stdout, report = _run(analysed, "synthetic_8rank")
    steps = [step for trace in sorted(RUNS["synthetic_8rank"].glob("rank-*.pt.trace.json.gz"))
             for step in _raw_trace_split(trace)]
    span = sum(s["span"] for s in steps)
    shares = {key: float(sum(s[key] for s in steps) / span) for key in ("compute", "exposed", "idle")}
    longest = {}
    for s in steps:
        longest[s["step"]] = max(longest.get(s["step"], 0), s["span"])
    median_ms = float(statistics.median(longest.values())) / 1e6
    line = report.first_screen[0]
    assert line.startswith("Inside profiled steps (device span ")
    assert f"compute {_share_text(shares['compute'])}, exposed comms {_share_text(shares['exposed'])}, idle " \
           f"{_share_text(shares['idle'])} (" in line
    shown_ms = float(re.search(r"device span ([\d.]+) ms", line).group(1))
    assert abs(shown_ms - median_ms) <= 0.05 + 1e-9  # three significant digits


def test_the_collective_sentence_is_the_collectives_tables_first_row(analysed):
    _out, _stdout, report = _run(analysed, "synthetic_8rank")
    (header, rows), *_ = report.tables["collectives"]
    row = dict(zip(header, next(row for row in rows if row)))  # the header's own <tr> holds no cells
    sentence = next(line for line in report.details if line.startswith("Most exposed communication: "))
    assert sentence.startswith(f"Most exposed communication: {row['collective']} of {row['size S']}, "
                               f"{row['exposed, worst rank']} not hidden behind compute on rank {row['worst rank']} "
                               f"(its most exposed rank), {row['calls (all ranks)']} calls on 8 ranks at a median busbw "
                               f"of {float(row['median busbw GB/s']):.1f} GB/s")
    screen = next(line for line in report.first_screen if line.startswith("Exposed comms: "))
    assert screen == (f"Exposed comms: {row['collective']} of {row['size S']} costs most, {row['exposed, worst rank']} "
                      f"on rank {row['worst rank']}")


def _kept_step_times(out: Path) -> list[int]:
    table = pq.read_table(out / "step_time").to_pylist()
    return sorted(r["step_time_ns"] for r in table if not r["excluded"] and r["step_time_ns"] is not None)


def _ms_text(ns: float) -> str:
    return f"{ns / 1e6:.3g} ms"


def test_the_step_line_is_the_kept_steps_median_and_p90(analysed):
    checked = 0
    for name in ("synthetic_8rank", "h200"):
        if name not in analysed:
            continue
        out, _stdout, report = _run(analysed, name)
        kept = _kept_step_times(out)
        median = statistics.median(kept)
        p90 = kept[-(-9 * len(kept) // 10) - 1]  # nearest rank: the ceil(0.9 n)-th smallest
        line = next(line for line in report.first_screen if line.startswith("Steps: "))
        assert line.startswith(f"Steps: median {_ms_text(median)}, p90 {_ms_text(p90)} over {len(kept)} of ")
        checked += 1
    assert checked


def test_the_h200_first_screen_names_the_profilers_cost_and_the_mfu_of_its_table(analysed):
    """The MFU line is the median over steps of FLOPs / (step time x GPUs x peak), recomputed from the mfu table's
    own columns for its headline numerator; the profiled step says it ran slowed by the profiler."""
    out, _stdout, report = _run(analysed, "h200")
    rows = [r for r in pq.read_table(out / "mfu").to_pylist() if r["metric"] == "MFU"]
    numerator = rows[0]["numerator"]
    utilization = statistics.median(r["flops"] / (r["step_time_ns"] / 1e9 * r["gpus"] * r["peak_flops"])
                                    for r in rows if r["numerator"] == numerator)
    line = report.first_screen[-1]
    assert line.startswith(f"MFU: {utilization:.1%} (FLOPs profile; peak 989.5 TFLOP/s dense bf16")
    assert report.links[-1] == "#mfu"
    assert report.first_screen[0].startswith("Inside profiled steps (device span 114 ms, profiler-slowed 1.5x)")
    assert any(line.startswith("Profiling slowed the run: steps 1.2") for line in report.first_screen)


def test_hfu_below_mfu_is_named_where_the_mfu_table_shows_it(analysed):
    """Where the mfu table's medians put HFU below MFU (on the H200 job the traces' op shapes count less than the FLOPs
    profile), the findings say so with both figures and what each count holds: the job's 8 SDPA calls are causal,
    halved in the op shapes and counted in full by DeepSpeed's profiler (the whole gap), so it names that, not only
    missed work."""
    out, _stdout, report = _run(analysed, "h200")
    rows = pq.read_table(out / "mfu").to_pylist()
    medians = {}
    for metric in ("MFU", "HFU"):
        kept = [r for r in rows if r["metric"] == metric and r["utilization"] is not None
                and r["numerator"] != "profiler_flops"]
        numerator = kept[0]["numerator"]
        medians[metric] = statistics.median(r["utilization"] for r in kept if r["numerator"] == numerator)
    assert medians["HFU"] < medians["MFU"]
    line = next(line for line in report.details if line.startswith("HFU below MFU: "))
    assert f"HFU {medians['HFU']:.1%} from the traces' op shapes against MFU {medians['MFU']:.1%} from" in line
    assert "attention under a causal mask" in line and "fused or custom kernels" in line


def test_the_busiest_op_names_tensor_inputs_only_and_is_skipped_below_one_percent():
    op = {"name": "aten::addmm", "shapes": "[[16], [4, 8], [8, 16], [], []]", "calls": 3, "ranks": 1,
          "device_ns": 2_000_000, "bound": "compute", "fraction_of_peak": 0.5}
    line = roofline_lines({"top_ops": [{**op, "step_share": 0.02}]})[0]
    assert line == ("Busiest modeled op: aten::addmm (16, 4x8, 8x16) x3: 2.000 ms, compute-bound, 50.0% of peak FLOP/s; "
                    "2.0% of the profiled steps' device spans (idle included).")
    # a memory-bound op's fraction is of the memory bandwidth (op_perf.with_roofline), and the line says so
    memory = roofline_lines({"top_ops": [{**op, "bound": "memory", "fraction_of_peak": 0.042, "step_share": 0.02}]})[0]
    assert "compute-bound" not in memory and "memory-bound, 4.2% of memory bandwidth;" in memory
    assert roofline_lines({"top_ops": [{**op, "step_share": 0.009}]}) == []


@pytest.mark.parametrize("name", list(RUNS))
def test_the_first_screen_fits_a_1280_by_800_window_in_chromium(analysed, browser, name):
    out, _stdout, _report = _run(analysed, name)
    browser.get((out / "report.html").resolve().as_uri())
    bottom = browser.execute_script("const r = document.querySelector('ul.verdict').getBoundingClientRect();"
                                    "return r.bottom + window.scrollY;")
    assert bottom <= 800
    assert browser.execute_script("return document.documentElement.scrollWidth") <= 1280


@pytest.mark.parametrize("name", ["synthetic_8rank", "h200"])
def test_the_gpu_idle_sentence_and_tile_are_the_gpu_idle_tables_whole_windows(analysed, name):
    out, _stdout, report = _run(analysed, name)
    rows = [r for r in pq.read_table(out / "gpu_idle").to_pylist() if r["stream"] == -1 and r["step"] is None]
    idle = sum(r["idle_ns"] for r in rows) / sum(r["span_ns"] for r in rows)
    sentence = next(line for line in report.details if line.startswith("GPU idle: "))
    assert sentence.startswith(f"GPU idle: {idle:.1%} of the profiled time")
    # the steps' idle (the verdict's, step_breakdown's rows summed) is named beside it where the two differ
    steps = pq.read_table(out / "step_breakdown").to_pylist()
    inside = sum(r["idle_ns"] for r in steps) / sum(r["span_ns"] for r in steps)
    assert (f"; {inside:.1%} inside the profiled steps' device spans, the verdict's figure)" in sentence) == \
        (abs(inside - idle) >= 0.001)
    html = (out / "report.html").read_text()
    assert f"<dt>GPU idle, whole traced window</dt><dd>{idle:.1%}</dd>" in html


def test_the_problem_lines_are_their_tables_rows(analysed):
    """Straggler: step_stats' straggler; the profiler's after-effect: the step_time table's kept steps after the last
    window over those before the first; the alarms: alarm_agreement's replayed rows and monitor_alarms."""
    checked = 0
    if "synthetic_8rank" in analysed:
        out, _stdout, report = _run(analysed, "synthetic_8rank")
        stats = [r for r in pq.read_table(out / "step_stats").to_pylist() if r["straggler_rank"] is not None]
        worst = max(stats, key=lambda r: (r["others_waited_ns"] or 0))
        assert f"Straggler: rank {worst['straggler_rank']} in step {worst['step']}" in report.first_screen
        checked += 1
    if "h200" in analysed:
        out, _stdout, report = _run(analysed, "h200")
        rows = pq.read_table(out / "step_time").to_pylist()
        traced = [r["step"] for r in rows if r["reason"] and ("profiler_window" in r["reason"]
                                                               or "profiler_warmup" in r["reason"])]
        windows = [r["step"] for r in rows if r["reason"] and "profiler_window" in r["reason"]]
        kept = [r for r in rows if not r["excluded"]]
        before = statistics.median(r["step_time_ns"] for r in kept if r["step"] < min(traced))
        after = statistics.median(r["step_time_ns"] for r in kept if r["step"] > max(windows))
        assert (f"Profiling slowed the run: steps {after / before:.2f}x slower after the windows (CUPTI left attached?)"
                in report.first_screen)
        # each alarm once (rule, series, step): the replay's, the job's own on steps it did not instrument, the
        # post-hoc pass's over every series
        seen = {(r["rule"], r["name"], r["step"]) for r in pq.read_table(out / "alarm_agreement").to_pylist()
                if r["post_hoc"] or (r["in_job"] and not r["instrumented"])}
        seen |= {(r["rule"], r["name"], r["step"]) for r in pq.read_table(out / "monitor_alarms").to_pylist()}
        counts: dict[str, int] = {}
        for rule, _, _ in seen:
            counts[rule] = counts.get(rule, 0) + 1
        assert "Alarms: " + ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())) in report.first_screen
        checked += 1
    assert checked


def test_the_step_line_of_one_kept_step_is_that_step():
    from steplens.reports.verdict import step_headline

    summary = {"source": "profiler_steps", "steps": 1, "total_steps": 1, "max_ns": 19_912_000, "max_step": 10,
               "median_ns": 19_912_000}
    assert step_headline({"step_time": summary}) == "Step time: 19.9 ms (step 10, the only one kept of 1; profiled steps)"
    two = {**summary, "steps": 2, "total_steps": 6, "median_ns": None, "kept_steps": [{}, {}], "max_ns": 403_000_000}
    assert step_headline({"step_time": two}) == "Steps: too few for a typical time (2 of 6 kept, max 403 ms; profiled steps)"


def _binary_size(n: int) -> str:
    """A byte count as the sentences give sizes: three significant figures in the largest binary unit reached."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 100 else f"{n / scale:,.0f} {unit}"
    return f"{n} B"


def _ms3(ns: float) -> str:
    """Three significant digits, whole units from 100 up: how the report prints a duration."""
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}" if ns < 100 * scale else f"{ns / scale:,.0f} {unit}"
    return f"{ns:.0f} ns"


def test_the_other_verdict_sentences_are_their_tables_rows(analysed):
    """The slowest step against the step_time table's kept steps, the costliest logged collective against
    comms_log_stats, the peak memory against memory_by_step."""
    checked = set()
    for name in analysed:
        out, _stdout, report = _run(analysed, name)
        detail = " ".join(report.details)
        steps = pq.read_table(out / "step_time").to_pylist()
        kept = [r for r in steps if not r["excluded"] and r["step_time_ns"] is not None]
        if "Slowest step: " in detail:
            slow = max(kept, key=lambda r: (r["step_time_ns"], -r["step"]))
            assert (f"Slowest step: step {slow['step']} on rank {slow['slowest_rank']}, {_ms3(slow['step_time_ns'])} "
                    f"against a median of {_ms3(round(statistics.median(r['step_time_ns'] for r in kept)))}") in detail
            checked.add("slowest")
        if (out / "comms_log_stats").exists() and "Logged comms: " in detail:
            costliest = max(pq.read_table(out / "comms_log_stats").to_pylist(), key=lambda r: r["total_latency_ns"])
            assert f"{costliest['op']} of {_binary_size(costliest['nccl_bytes'])}" in detail
            assert f"{_ms3(costliest['total_latency_ns'])} over {costliest['calls']} calls" in detail
            checked.add("comms")
        if "Peak memory: " in detail:
            rows = [r for r in pq.read_table(out / "memory_by_step").to_pylist() if r["peak_allocated_bytes"] is not None]
            top = max(r["peak_allocated_bytes"] for r in rows)
            assert f"Peak memory: {top / 2**30:.2f} GiB allocated" in detail
            checked.add("memory")
    assert checked == {"slowest", "comms", "memory"} or len(analysed) < 3
