"""report.html, summary.md and compare: contents against known answers, escaping, and a real browser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from synthetic import generate_run

from conftest import CORPUS, write_trace
from steplens.analyze.cli import EXIT_REGRESSION, analyze, steplens
from steplens.analyze.analyses import compare, noise
from steplens.reports.data import load

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = '<script>alert("x")</script> | "quoted" & \'single\' — ünïcødé 日本 `tick` *star* [link](http://example.com)'


def _analyse(run: Path, *args) -> Path:
    result = CliRunner().invoke(analyze, [str(run), "-q", *args])
    assert result.exit_code in (0, 1), result.output
    return run / ".steplens"


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    run = tmp_path_factory.mktemp("gen") / "run"
    truth = generate_run(run, ranks=4, steps=6, seed=5, stragglers=[(1, 13)])
    return _analyse(run), truth


def _hostile_run(tmp_path: Path) -> Path:
    """One rank whose kernel, op and step-annotation names are hostile text."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "cpu_op", "name": HOSTILE, "pid": 1, "tid": 1, "ts": 5, "dur": 50},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 10, "dur": 5,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": HOSTILE, "pid": 0, "tid": 7, "ts": 100, "dur": 300,
         "args": {"correlation": 1, "stream": 7, "device": 0}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "pid": 1, "tid": 1, "ts": 20, "dur": 500},
    ]
    write_trace(tmp_path / "run" / "rank0.json", events, distributedInfo={"rank": 0, "world_size": 1})
    return _analyse(tmp_path / "run")


def test_analyze_writes_report_and_summary_with_the_truths_numbers(generated):
    out, truth = generated
    html = (out / "report.html").read_text()
    summary = (out / "summary.md").read_text()
    findings = json.loads((out / "findings.json").read_text())
    straggler = findings["steps"]["stragglers"][0]
    assert (straggler["rank"], straggler["step"]) == (1, 13)  # the generator's truth
    for text in (html, summary):
        assert "Straggler: rank 1 in step 13" in text
    slow = findings["step_time"]["slowest_step"]
    for text in (html, summary):  # the whole run's slowest step, beyond its step-to-step noise
        assert f"Slowest step: step {slow['step']} on rank {slow['rank']}" in text
    for section in ("Verdict", "Where one step's time went", "Run and environment", "Step time over the run", "CPU vs GPU",
                    "Kernels", "Collectives", "FLOPs and MFU", "Monitor curves", "Ingest issues", "Method and caveats"):
        assert f">{section}</h2>" in html.replace("&#39;", "'")
    assert html.count("<svg") >= 6  # breakdown, timeline, step series, heatmap, launch delay, busbw
    assert len(html) < 3_000_000 and len(summary.splitlines()) < 80


def test_report_escapes_trace_text(tmp_path):
    out = _hostile_run(tmp_path)
    html = (out / "report.html").read_text()
    assert "<script" not in html.replace("&lt;script", "")
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in html
    assert "ünïcødé 日本" in html
    assert "script-src" not in html and "default-src 'none'" in html  # the CSP forbids scripts and fetches
    summary = (out / "summary.md").read_text()
    assert "<script>" not in summary
    table_rows = [line for line in summary.splitlines() if "alert" in line and line.startswith("|")]
    assert table_rows and all(len(re.findall(r"(?<!\\)\|", row)) == 5 for row in table_rows)  # 4 columns, | escaped


def test_sections_without_data_say_so_in_one_line(tmp_path, corpus):
    run = tmp_path / "cpu_only"
    shutil.copytree(CORPUS / "HolisticTraceAnalysis" / "cpu_only", run)
    out = _analyse(run)
    html = (out / "report.html").read_text()
    assert "No device work in the traces" in html
    assert "No monitor scalars" in html


def test_markdown_format_prints_the_summary(generated):
    out, _ = generated
    result = CliRunner().invoke(analyze, [str(out.parent), "-q", "--format", "md"])
    assert result.exit_code == 0
    assert result.output == (out / "summary.md").read_text()


# ---------------------------------------------------------------------------------------------
# compare


def test_noise_verdicts_on_known_separations():
    rng = np.random.default_rng(1)
    base = rng.normal(100e6, 2e6, 40)
    slower = noise.two_run_verdict(base, rng.normal(110e6, 2e6, 40))
    assert slower["verdict"] == "regression" and slower["ci_low"] > 0 and slower["p_value"] < 0.05
    assert slower["delta"] == pytest.approx(0.10, abs=0.02)
    faster = noise.two_run_verdict(base, rng.normal(90e6, 2e6, 40))
    assert faster["verdict"] == "improvement" and faster["ci_high"] < 0
    # Throughput: less is the regression.
    assert noise.two_run_verdict(base, rng.normal(90e6, 2e6, 40), higher_is_better=True)["verdict"] == "regression"
    same = noise.two_run_verdict(base, rng.normal(100e6, 2e6, 40))
    assert same["verdict"] == "within noise" and same["ci_low"] < 0 < same["ci_high"]
    few = noise.two_run_verdict(base[:3], base[:3] * 2)
    assert few["verdict"] == "not established"


def test_noisy_small_difference_is_not_called():
    """A 3% shift under 20% noise with 8 steps each is not a finding."""
    rng = np.random.default_rng(7)
    base, new = rng.normal(100, 20, 8), rng.normal(103, 20, 8)
    assert noise.two_run_verdict(base, new)["verdict"] == "within noise"


@pytest.fixture(scope="module")
def ab_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ab")
    generate_run(root / "base", ranks=2, steps=12, seed=11)
    # The same job with rank 1 straggling (x3 compute) in every step: step time rises.
    first = 10
    generate_run(root / "slow", ranks=2, steps=12, seed=11, stragglers=[(1, s) for s in range(first, first + 12)])
    return root


def test_compare_gates_a_real_slowdown(ab_runs, tmp_path):
    runner = CliRunner()
    gated = runner.invoke(steplens, ["compare", str(ab_runs / "base"), str(ab_runs / "slow"), "--out", str(tmp_path / "c"),
                                     "--fail-on-regression", "5"])
    assert gated.exit_code == EXIT_REGRESSION, gated.output
    assert "step time: regression" in gated.output
    base, slow = load(ab_runs / "base"), load(ab_runs / "slow")
    result = compare.compare(base, slow)
    medians = [float(np.median(samples.values_ns)) for samples in compare.common_samples(base, slow)]
    assert result["verdict"]["metric"] == "step time"
    assert result["verdict"]["delta"] == pytest.approx(medians[1] / medians[0] - 1)
    metrics = {m["metric"]: m for m in result["metrics"]}
    for run, side in ((base, "base"), (slow, "new")):
        steps, ranks = run.table("step_stats").height, len(run.manifest["trace_ranks"])
        assert metrics["GPU idle share"][side] == run.findings["gpu_idle"]["idle_share"]
        assert metrics["exposed communication per step and rank (ns)"][side] == pytest.approx(
            run.table("collectives")["exposed_ns"].sum() / steps / ranks)
    html = (tmp_path / "c" / "compare.html").read_text()
    assert "Step time: regression" in html and "Mann-Whitney" in html
    # an established difference between two single runs says what it is not: a difference of configurations
    assert compare.ONE_RUN_EACH in result["warnings"] and "steplens trials" in " ".join(gated.output.split())
    same = runner.invoke(steplens, ["compare", str(ab_runs / "base"), str(ab_runs / "base"), "--out", str(tmp_path / "d"),
                                    "--fail-on-regression", "5", "--format", "md"])
    assert same.exit_code == 0 and "Step time: within noise" in same.output and "one run on each side" not in same.output


def test_analyze_compare_is_the_same_command(ab_runs, tmp_path):
    script = Path(sys.executable).parent / "analyze"
    done = subprocess.run([str(script), "compare", str(ab_runs / "base"), str(ab_runs / "slow"), "--out", str(tmp_path / "c")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "step time: regression" in done.stdout


# ---------------------------------------------------------------------------------------------
# A real browser (the `browser` fixture is in conftest.py)



def _screenshot(driver, screenshot: Path) -> None:
    """A screenshot once the page has loaded; again once if chromedriver answers that a navigation was still being
    attached (a race of its own, seen once in a CI run: "aborted by navigation: Not attached to an active page")."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 60).until(lambda d: d.execute_script("return document.readyState") == "complete")
    try:
        driver.save_screenshot(str(screenshot))
    except TimeoutException:
        driver.save_screenshot(str(screenshot))


def _open(driver, path: Path, screenshot: Path) -> tuple[list, list]:
    driver.get_log("performance")  # drop what earlier pages logged
    driver.get_log("browser")
    driver.get(path.resolve().as_uri())
    _screenshot(driver, screenshot)
    requests = [json.loads(entry["message"])["message"] for entry in driver.get_log("performance")]
    urls = [m["params"]["request"]["url"] for m in requests if m["method"] == "Network.requestWillBeSent"]
    return urls, driver.get_log("browser")


@pytest.mark.parametrize("sample", sorted(p.name for p in (ROOT / "sample_runs").iterdir() if p.is_dir()))
def test_bundled_sample_reports_render_offline_in_chromium(browser, sample, tmp_path):
    run = tmp_path / sample
    shutil.copytree(ROOT / "sample_runs" / sample, run, ignore=shutil.ignore_patterns(".steplens"))
    out = _analyse(run)
    urls, console = _open(browser, out / "report.html", tmp_path / "shot.png")
    assert [u for u in urls if not u.startswith(("file:", "data:"))] == []
    assert [c for c in console if c["level"] == "SEVERE"] == []
    assert (tmp_path / "shot.png").stat().st_size > 10_000  # a real picture, not a blank page
    assert browser.find_element("id", "verdict").text == "Verdict"


def test_hostile_names_render_as_text_in_chromium(browser, tmp_path):
    out = _hostile_run(tmp_path)
    urls, console = _open(browser, out / "report.html", tmp_path / "shot.png")
    # The kernel's base name in the cell, its whole hostile name as the cell's tooltip, both as text.
    assert browser.find_element("css selector", "td[title]").get_attribute("title") == HOSTILE
    assert browser.execute_script("return document.scripts.length") == 0
    assert [c for c in console if c["level"] == "SEVERE"] == []
    assert [u for u in urls if not u.startswith(("file:", "data:"))] == []



def test_compare_uses_the_step_source_both_runs_have(tmp_path, corpus):
    """The collector sample (profiler, collector and log timers) against a run that left only logs:
    the shared source is DeepSpeed's wall_clock_breakdown timers, read here independently of the importer
    (the sample's as the collector recorded them on both ranks, every flushed part: its log has rank 0's
    lines only; run5's from its log lines), with the step-time definition's exclusions (instrumented steps
    from the run's own settings, then the leading warm-up steps beyond the noise)."""
    import statistics

    runs = {}
    for name, folder in (("sample", ROOT / "sample_runs" / "deepspeed_cpu_2rank"),
                         ("run5", CORPUS.parent / "deepspeed-cpu-runs" / "run5")):
        shutil.copytree(folder, tmp_path / name, ignore=shutil.ignore_patterns(".steplens"))
        runs[name] = load(_analyse(tmp_path / name))
    result = compare.compare(runs["sample"], runs["run5"])["step_time"]
    assert "wall_clock_breakdown" in result["source"]

    def logged_steps(folder: Path) -> dict[int, float]:
        per_step: dict[int, float] = {}
        for log in (folder / "rank_logs").glob("*.log"):
            lines = [line for line in log.read_text().splitlines() if "time (ms) | fwd: " in line]
            for step, line in enumerate(lines):
                total = sum(float(v) for v in re.findall(r"\b(?:fwd|bwd|step): ([\d.]+)", line))
                per_step[step] = max(per_step.get(step, 0.0), total)
        return per_step

    def collected_steps(folder: Path) -> dict[int, float]:
        per_rank: dict[tuple[int, int], float] = {}
        for part in sorted((folder / "collector" / "step_timers").glob("rank*.parquet")):
            for row in pq.read_table(part).to_pylist():
                if row["scope"] == "global" and row["timer"] in ("fwd", "bwd", "step"):
                    per_rank[(row["rank"], row["step"])] = per_rank.get((row["rank"], row["step"]), 0.0) + row["ms"]
        per_step: dict[int, float] = {}
        for (_, step), total in per_rank.items():
            per_step[step] = max(per_step.get(step, 0.0), total)
        return per_step

    def kept_steps(per_step: dict[int, float], instrumented: set[int]) -> list[float]:
        times = [per_step[s] for s in sorted(per_step) if s not in instrumented]
        if len(times) >= 3:
            median = statistics.median(times)
            bound = median + max(3.5 * statistics.median(abs(t - median) for t in times) / 0.6745, 0.05 * median)
            warm = 0
            while warm < len(times) and times[warm] > bound:
                warm += 1
            times = times[min(warm, len(times) // 2):]
        return times

    manifest = json.loads((tmp_path / "sample" / "collector" / "manifest" / "rank0.json").read_text())["run"]["settings"]
    window = manifest["profile"]  # one window: warm-up, active, then the export step after it
    first = window["skip_first"] + window["wait"]
    sample = kept_steps(collected_steps(tmp_path / "sample"),
                        {manifest["flops_step"], *range(first, first + window["warmup"] + window["active"] + 1)})
    ds_config = json.loads((tmp_path / "run5" / "ds_config.json").read_text())
    run5 = kept_steps(logged_steps(tmp_path / "run5"), {ds_config["flops_profiler"]["profile_step"]})
    assert (result["base_steps"], result["new_steps"]) == (len(sample), len(run5))

    def median_ns(times: list[float]):  # step time's rule: no median of fewer than 3 steps more than 5% apart
        typical = len(times) >= 3 or (times and max(times) <= 1.05 * min(times))
        return pytest.approx(np.median(times) * 1e6) if typical else None

    assert result["base_median_ns"] == median_ns(sample)
    assert result["new_median_ns"] == median_ns(run5)


def test_verdict_says_how_a_killed_job_ended(tmp_path, corpus):
    """A Megatron-DeepSpeed log that ends with the launcher's SIGTERM: logs only, no traces."""
    run = tmp_path / "megatron"
    shutil.copytree(CORPUS / "Megatron-DeepSpeed", run)
    log = next(run.rglob("*.log"))
    assert "received SIGTERM" in log.read_text()[-5000:]
    out = _analyse(run)
    summary = (out / "summary.md").read_text()
    assert "The job was killed" in summary and "received SIGTERM" in summary
    html = (out / "report.html").read_text()
    assert ">How the job ended</h2>" in html and "No profiler traces in this run" in html


def _trial_run(folder: Path, step_ms: float, zero_stage: int) -> None:
    """A collector run folder: the sample's rank-0 manifest with another ds_config (its instrumented steps 2-5), and 8
    optimizer steps of a known duration (8 samples each): steps 1, 6 and 7 are timed and kept (step 0 has no step
    before it to start its cycle)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from steplens.analyze.contract import schema

    manifest = json.loads((ROOT / "sample_runs/deepspeed_cpu_2rank/collector/manifest/rank0.json").read_text())
    manifest["run"]["ds_config"]["zero_optimization"] = {"stage": zero_stage}
    (folder / "collector" / "manifest").mkdir(parents=True)
    (folder / "collector" / "manifest" / "rank0.json").write_text(json.dumps(manifest))
    start, rows = 1_000_000_000, []
    for step in range(8):
        end = start + int(step_ms * 1e6)
        rows.append({"rank": 0, "source": "collector", "step": step, "micro_step": step, "start_ns": start, "end_ns": end,
                     "dur_ns": end - start, "is_boundary": True, "global_samples": 8 * (step + 1)})
        start = end
    (folder / "collector" / "train_steps").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema.TRAIN_STEPS), folder / "collector/train_steps/rank0-00000.parquet")


def test_trials_rank_repeated_collector_runs(tmp_path):
    for i in range(4):
        _trial_run(tmp_path / f"z2_run{i}", 100 + i, zero_stage=2)
        _trial_run(tmp_path / f"z3_run{i}", 120 + i, zero_stage=3)
    result = CliRunner().invoke(steplens, ["trials", str(tmp_path), "--format", "md"])
    assert result.exit_code == 0, result.output
    # 4 trials each, fully separated: the exact one-sided Mann-Whitney p is 1/C(8,4) = 1/70.
    verdict = next(line for line in result.stdout.splitlines() if line.startswith("**"))
    assert "z2\\_run0 beats z3\\_run0" in verdict and f"p = {1 / 70:.3g}" in verdict
    first = next(line for line in result.stdout.splitlines() if line.startswith("| 1 |"))
    median_throughput = float(np.median([8 / (0.100 + i / 1000) for i in range(4)]))  # samples/s per trial
    assert "z2\\_run0,z2\\_run1,z2\\_run2,z2\\_run3" in first and f"| {median_throughput:,.4g} |" in first
    text = CliRunner().invoke(steplens, ["trials", str(tmp_path)])
    assert text.exit_code == 0 and "z2_run0 beats z3_run0" in text.stdout and "configurations" in text.stdout


def test_printed_logged_comms_line_counts_the_collectors_calls(tmp_path):
    """The terminal's 'logged comms' finding names the op that cost most and its call count, both
    recomputed here from the collector's own comms_calls parts."""
    import polars as pl

    run = tmp_path / "run"
    shutil.copytree(ROOT / "sample_runs" / "deepspeed_cpu_2rank", run, ignore=shutil.ignore_patterns(".steplens"))
    result = CliRunner().invoke(analyze, [str(run), "-q"])
    assert result.exit_code == 0, result.output
    calls = pl.read_parquet(run / "collector" / "comms_calls")
    costliest = (calls.group_by("op", "nccl_bytes").agg(pl.len().alias("calls"), pl.col("latency_ns").sum())
                 .sort("latency_ns", descending=True).row(0, named=True))
    findings = result.stdout.replace("\n    ", " ")  # a finding wraps at the console width, continued indented
    line = next(line for line in findings.splitlines() if "Logged comms:" in line)
    size = costliest["nccl_bytes"] / 2**20  # the sample's all_reduce is MiB-sized: three figures, as the logs round
    assert f"{costliest['op']} of {size:.3g} MiB costs most" in line and 1 <= size < 100
    assert f"over {costliest['calls']} calls" in line and "latencies measured" in line


def test_figure_crop_holds_what_savefig_tight_would_keep():
    """figures._svg measures its crop box with an Agg renderer instead of savefig's tight pass: the box
    must hold everything that pass keeps (a legend above the axes, long tick labels), within a point."""
    import io

    import polars as pl

    from steplens.reports import figures

    breakdown = pl.DataFrame({"rank": [0, 1, 2], "device": [0, 0, 0], "compute_ns": [5e6, 4e6, 6e6],
                              "exposed_comm_ns": [1e6, 2e6, 0.0], "host_bound_ns": [1e6, 0.0, 3e6],
                              "sync_ns": [0.0, 1e6, 0.0], "other_ns": [5e5, 5e5, 5e5]})
    captured = []
    original = figures._svg
    figures._svg = lambda fig: captured.append(fig) or original(fig)
    try:
        ours = figures.step_breakdown_bars(breakdown)
    finally:
        figures._svg = original
    buffer = io.StringIO()
    captured[0].savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    size = r'<svg[^>]*width="([\d.]+)pt" height="([\d.]+)pt"'
    width, height = map(float, re.search(size, ours).groups())
    tight_width, tight_height = map(float, re.search(size, buffer.getvalue()).groups())
    assert tight_width - 1 <= width <= tight_width + 8 and tight_height - 1 <= height <= tight_height + 8


def test_launch_delay_draws_no_unlabelled_minor_ticks_over_more_than_a_decade():
    """Fewer artists: over more than a decade matplotlib labels no minor tick of a log axis, so the histogram of
    queueing draws its labelled decades only; within a decade the minor ticks (labelled there) stay."""
    import numpy as np
    import polars as pl

    from steplens.reports import figures

    def ticks(low_ns: float, high_ns: float) -> list[str]:
        svg = figures.launch_delay(pl.DataFrame({"queue_ns": np.geomspace(low_ns, high_ns, 200)}))
        groups = re.findall(r'<g id="xtick_\d+">(.*?)\n    </g>\n', svg, re.S)
        return ["".join(re.findall(r"<text[^>]*>([^<]*)</text>", group)) for group in groups]

    wide = ticks(1e3, 5e6)  # 1 us to 5 ms: decades 1, 10, 100, 1000 us
    assert wide == ["1", "10", "100", "1000"]
    narrow = ticks(2e3, 9e3)  # 2-9 us: no decade inside, the minor ticks carry the scale
    assert len(narrow) >= 5 and any(narrow)
    # as plain numbers: math text is off, so matplotlib's default minor labels showed "$\mathdefault{2\times10^{0}}$"
    labelled = [float(label) for label in narrow if label]
    assert labelled and all(2 <= value <= 9 for value in labelled)


_DRAW_ALL = """
import json, sys
from pathlib import Path
if sys.argv[2] == "lean":
    from steplens.analyze.cli_render import import_figures
    import_figures()
import matplotlib.lines
from steplens.reports import html
svgs = []
html.render(Path(sys.argv[1]), lambda drawings: svgs.extend(html.draw(drawings)) or svgs)
print(json.dumps({"svgs": svgs, "set_doc": matplotlib.lines.Line2D.set.__doc__ or ""}))
"""


def test_analyze_skips_matplotlibs_set_docs_and_draws_the_same_figures(generated):
    """analyze's processes import matplotlib without building every Artist.set docstring
    (cli_render.skip_matplotlib_set_docs): the report's figures are the same bytes as a plain import draws."""
    out, _ = generated
    drawn = {}
    for mode in ("plain", "lean"):
        done = subprocess.run([sys.executable, "-c", _DRAW_ALL, str(out), mode], capture_output=True, text=True, check=True)
        drawn[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(drawn["plain"]["svgs"]) >= 4 and drawn["lean"]["svgs"] == drawn["plain"]["svgs"]
    assert "Supported properties" in drawn["plain"]["set_doc"] and drawn["lean"]["set_doc"] == ""


def test_a_step_from_the_logs_is_also_named_as_the_log_prints_it(tmp_path, corpus):
    """Steps are 0-based; Megatron prints "iteration N" when N are done. A real sweep's reader looked for the
    slowest "step 2109" and found it as iteration 2110: the step-time line gives both (here its longest kept step;
    the intervals after an evaluation, the log's slowest, are left out)."""
    run = tmp_path / "megatron"
    shutil.copytree(CORPUS / "Megatron-DeepSpeed", run)
    out = _analyse(run)
    findings = json.loads((out / "findings.json").read_text())
    block = findings["step_time"]
    log = next(run.rglob("*.log")).read_text()
    elapsed = {int(n): float(ms) for n, ms in re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): "
                                                          r"([\d.]+)", log)}
    assert elapsed[block["max_step"] + 1] * 1e6 == pytest.approx(block["max_ns"])  # the log's iteration step + 1
    summary = " ".join((out / "summary.md").read_text().split())
    assert f"(step {block['max_step']}, the log's iteration {block['max_step'] + 1})" in summary


def _bars_one_patch_each(ax, rows, starts, lengths, thickness, colour, label=None, horizontal=True, sticky=True,
                         rasterized=False):
    """The reference for figures._bars: matplotlib's own bar, barh and broken_barh, an artist per bar or row."""
    rows, starts, lengths = np.asarray(rows, dtype=float), np.asarray(starts, dtype=float), np.asarray(lengths)
    if sticky and horizontal:
        ax.barh(rows, lengths, left=starts, height=thickness, color=colour, label=label, linewidth=0, rasterized=rasterized)
    elif sticky:
        ax.bar(rows, lengths, bottom=starts, width=thickness, color=colour, label=label, linewidth=0, rasterized=rasterized)
    else:
        for row in np.unique(rows):
            mine = rows == row
            ax.broken_barh(list(zip(starts[mine], lengths[mine])), (row - thickness / 2, thickness), facecolors=colour,
                           linewidth=0, rasterized=rasterized)


def test_bar_figures_draw_one_collection_a_series_with_the_pixels_of_a_patch_a_bar(monkeypatch):
    """Fewer artists: the stacked bars, the idle bars and the timeline draw one collection per series (not one patch
    per bar, which grew with the ranks and was most of their drawing time), and the histogram one polygon; rendered,
    each figure has exactly the pixels matplotlib's bar/barh/broken_barh give for the same data."""
    import io

    import matplotlib.image
    import polars as pl

    from steplens.reports import figures

    ranks = 12
    generator = np.random.default_rng(7)
    breakdown = pl.DataFrame({"rank": range(ranks), "device": [0] * ranks,
                              **{c: generator.uniform(0, 5e6, ranks) for c in ("compute_ns", "exposed_comm_ns",
                                                                              "host_bound_ns", "sync_ns", "other_ns")}})
    breakdown = breakdown.with_columns(pl.when(pl.col("rank") == 3).then(0.0).otherwise(pl.col("sync_ns")).alias("sync_ns"))
    segments = [(rank, 1, ("compute", "idle", "exposed communication")[i % 3], i * 1000 + rank * 37, i * 1000 + 900)
                for rank in range(ranks) for i in range(20)]
    timeline = pl.DataFrame(segments, schema=["rank", "step", "activity", "start_ns", "end_ns"], orient="row")
    drawings = [("step_breakdown_bars", (breakdown,)), ("idle_by_cause", (breakdown,)), ("step_gantt", (timeline,)),
                ("launch_delay", (pl.DataFrame({"queue_ns": generator.lognormal(9, 1.5, 3000)}),))]

    def drawn(name, args):
        captured = []
        monkeypatch.setattr(figures, "_svg", captured.append)
        getattr(figures, name)(*args)
        monkeypatch.undo()
        return captured[0]

    def pixels(fig):
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
        buffer.seek(0)
        return matplotlib.image.imread(buffer)

    ours = {name: drawn(name, args) for name, args in drawings}
    ax = {name: fig.axes[0] for name, fig in ours.items()}
    assert [len(ax[n].collections) for n in ("step_breakdown_bars", "idle_by_cause", "step_gantt")] == [5, 3, 3]
    assert not ax["step_breakdown_bars"].patches and not ax["idle_by_cause"].patches and len(ax["launch_delay"].patches) == 1
    monkeypatch.setattr(figures, "_bars", _bars_one_patch_each)
    reference = {name: drawn(name, args) for name, args in drawings[:3]}
    assert len(reference["step_breakdown_bars"].axes[0].patches) == 5 * ranks  # the reference is patch per bar
    for name, fig in reference.items():
        assert np.array_equal(pixels(ours[name]), pixels(fig)), name
    bars = ours["launch_delay"].axes[0]
    bars.patches[0].remove()
    queue = drawings[3][1][0]["queue_ns"].to_numpy() / 1e3
    bars.hist(queue, bins=figures._log_bins(queue), color="#4c72b0")  # one Rectangle a bin, on the same axes
    redrawn = pixels(ours["launch_delay"])
    assert len(bars.patches) == 39
    monkeypatch.undo()
    assert np.array_equal(pixels(drawn(*drawings[3])), redrawn)


def test_figures_measure_their_crop_with_one_renderer_that_keeps_text_sizes(monkeypatch):
    """matplotlib caches a text's size per renderer: the crop's measuring renderer is one per dpi, so a text two
    figures share (tick labels, axis labels, legend entries) is measured once a run, and the crop stays the box
    savefig's tight pass would keep (test_figure_crop_holds_what_savefig_tight_would_keep)."""
    import polars as pl
    from matplotlib.backends.backend_agg import RendererAgg

    from steplens.reports import figures

    # rank labels no other test draws: their sizes are not in the renderer's cache yet, whatever ran before
    breakdown = pl.DataFrame({"rank": [90417, 90418], "device": [0, 0], "compute_ns": [5e6, 4e6],
                              "exposed_comm_ns": [1e6, 2e6], "host_bound_ns": [1e6, 0.0], "sync_ns": [0.0, 1e6],
                              "other_ns": [5e5, 5e5]})
    import matplotlib

    measuring = figures._measuring_renderer(matplotlib.rcParams["figure.dpi"])  # every figure's dpi
    measured = []
    original = RendererAgg.get_text_width_height_descent

    def counted(self, text, prop, ismath):
        if self is measuring:
            measured.append(text)
        return original(self, text, prop, ismath)

    monkeypatch.setattr(RendererAgg, "get_text_width_height_descent", counted)
    first = figures.step_breakdown_bars(breakdown)
    first_count = len(measured)
    assert figures.step_breakdown_bars(breakdown) == first  # the same bytes
    assert {"90417", "90418"} <= set(measured) and len(measured) == first_count  # the second figure's were all known


def test_a_figure_that_fails_becomes_a_note_and_the_rest_of_the_report_stands(tmp_path, monkeypatch):
    """A figure's bug on an input no test had (the roofline's empty log axes, once) took the whole analyze down;
    now it is a note in the figure's place (the error escaped) and a warning on stderr, every other figure and
    table is drawn, and STEPLENS_DEBUG=1 still raises it."""
    from steplens.reports import figures, html

    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parent.parent / "sample_runs" / "synthetic_8rank", run)
    healthy = CliRunner().invoke(analyze, [str(run), "--out", str(tmp_path / "healthy"), "-q"])
    page = (tmp_path / "healthy" / "report.html").read_text()
    assert healthy.exit_code == 0 and html.NOT_DRAWN not in page and "not drawn" not in healthy.output
    figures_drawn = page.count("<svg")
    assert figures_drawn >= 3

    def broken(*args):
        raise ValueError("no <b>ticks</b> & no data")

    monkeypatch.setattr(figures, "step_gantt", broken)
    monkeypatch.delenv("STEPLENS_DEBUG", raising=False)
    result = CliRunner().invoke(analyze, [str(run), "--out", str(tmp_path / "broken"), "-q"])
    page = (tmp_path / "broken" / "report.html").read_text()
    assert result.exit_code == 0, result.output
    note = "Figure step_gantt not drawn: ValueError: no &lt;b&gt;ticks&lt;/b&gt; &amp; no data"
    assert page.count(html.NOT_DRAWN) == 1 and note in page and "<b>ticks" not in page
    assert page.count("<svg") == figures_drawn - 1
    assert "report.html: Figure step_gantt not drawn: ValueError: no <b>ticks</b> & no data" in result.stderr.replace("\n", " ")
    monkeypatch.setenv("STEPLENS_DEBUG", "1")
    with pytest.raises(ValueError, match="no <b>ticks</b>"):
        html.render(tmp_path / "broken")


def test_a_step_without_a_time_has_no_legend_entry_in_the_step_time_figure():
    """The run's first cycle has no time (no step before starts it): its reason was in the legend with no point beside it."""
    import polars as pl
    from steplens.reports import figures

    table = pl.DataFrame({"step": [0, 1, 2, 3], "step_time_ns": [None, 90_000_000, 95_000_000, 100_000_000],
                          "excluded": [True, False, False, True], "reason": ["no_previous_step", None, None, "warm_up"]})
    svg = figures.step_time_series(table, [], 95_000_000)
    assert "excluded: warm up" in svg and "no previous step" not in svg


def test_a_long_markdown_cell_is_cut_at_a_word():
    """summary.md cut an alarm's detail mid-word ('robus…'); a kernel name with no space is still cut at the limit."""
    from steplens.reports.markdown import MAX_CELL, _cell

    detail = ("train/loss = 10.6391 against a trailing median of 10.5731 over 10 points; robust z = 3.6 > 3.5 "
              "(Iglewicz & Hoaglin)")
    assert _cell(detail) == "train/loss = 10.6391 against a trailing median of 10.5731 over 10 points;…"  # not "robus…"
    kernel = "void at::native::elementwise_kernel<128, 2, " + "x" * 100
    assert _cell(kernel).endswith("…") and len(_cell(kernel)) <= MAX_CELL + 20


@pytest.mark.parametrize("times", [[0, 0, 0], [None, None, None]])
def test_the_step_time_figure_of_steps_without_a_time_draws_without_a_warning(times):
    """Every step time 0 (a log of CurrSamplesPerSec=inf) or none (nan): matplotlib warned of identical y limits on
    stderr (or the figure failed on None); the figure is drawn, quietly."""
    import warnings

    import polars as pl

    from steplens.reports import figures

    table = pl.DataFrame({"step": [0, 1, 2], "step_time_ns": times, "excluded": [False, False, True],
                          "reason": [None, None, "warm_up"]}, schema_overrides={"step_time_ns": pl.Int64})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert figures.step_time_series(table, [], None).startswith("<svg")
