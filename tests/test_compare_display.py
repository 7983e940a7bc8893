"""`steplens compare` picks its step-time source honestly and labels what it shows: shares change in percentage
points, durations carry their unit, run facts read as words, kernels by their short names, and no claim that a
step is the same work when the work is not recorded. On the real H200 job against its own traces alone."""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from steplens.reports.compare import _fmt_change, _fmt_metric, _label, _value_of

ROOT = Path(__file__).resolve().parents[1]
H200_JOB = ROOT.parent / "shared" / "gpu-runs" / "h200_zero2_gpu_check" / "job"
BIN = Path(sys.executable).parent


def test_a_share_changes_in_points_and_a_duration_relative_to_itself():
    assert _fmt_change("GPU idle share", 0.01, 0.3255) == "+31.6 pp"  # not +3155%
    assert _fmt_change("MFU (median)", 0.099, 0.063) == "-3.6 pp"
    name = "exposed communication per step and rank (ns)"
    assert _label(name) == "exposed communication per step and rank"
    assert _fmt_metric(name, 1_519_000) == "1.52 ms" and _fmt_change(name, 1_000_000, 1_500_000) == "+50.0%"


def test_run_facts_read_as_words():
    assert [_value_of('{"base": null, "new": 1}', run) for run in ("base", "new")] == ["not recorded", "1"]
    assert _value_of('{"base": 8, "new": 8}', "new") == "8"


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    if not H200_JOB.is_dir():
        pytest.skip(f"{H200_JOB} is not here")
    root = tmp_path_factory.mktemp("compare")
    shutil.copytree(H200_JOB, root / "base")
    (root / "new").mkdir()
    shutil.copytree(H200_JOB / "traces", root / "new" / "traces")
    done = subprocess.run([str(BIN / "steplens"), "compare", str(root / "base"), str(root / "new"), "--out",
                           str(root / "out")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    return root, done.stdout


def test_the_collectors_step_time_is_named_when_only_the_profiled_step_is_shared(compared):
    root, stdout = compared
    table = pq.read_table(root / "base" / ".steplens" / "step_time").to_pylist()
    kept = [r["step_time_ns"] for r in table if not r["excluded"]]
    text = " ".join(stdout.split())
    assert (f"the base run's own best, the collector's train_steps, gives a median of "
            f"{statistics.median(kept) / 1e6:.3g} ms over {len(kept)} steps") in text
    assert "step times from the profiled ProfilerSteps, the only source both runs have" in text


def test_no_same_work_claim_when_the_work_is_not_recorded_and_no_raw_json_or_signatures(compared):
    root, stdout = compared
    text = " ".join(stdout.split())
    html = (root / "out" / "compare.html").read_text()
    for page in (text, html):
        assert "a step is the same work in both runs (micro batch" not in page
        assert "are not recorded for every run: a step is assumed to be the same work" in " ".join(page.split())
        assert '{"base"' not in page and "{&#34;base&#34;" not in page and "(ns)" not in page
    assert "not recorded for the new run" in text and "['new']" not in text
    assert "base not recorded" in text or "new not recorded" in text
    assert "(char*" not in text and "at::native::" not in text  # short kernel names, not C++ signatures
    assert [line for line in stdout.splitlines() if len(line) > 80 and len(line.split()) > 1] == []


def test_a_damaged_result_is_named_by_compare_and_left_out_by_trials(tmp_path):
    """run.json fields of the wrong type (an edit, a broken copy): compare says which file and why in one line
    (exit 2); trials names the run, leaves it out and ranks the others (exit 1), never an internal error."""
    import json

    runs = tmp_path / "runs"
    for name in ("good", "bad"):
        shutil.copytree(ROOT / "sample_runs" / "synthetic_8rank", runs / name, ignore=shutil.ignore_patterns(".steplens"))
        assert subprocess.run([str(BIN / "analyze"), str(runs / name), "-q"], capture_output=True).returncode == 0
    manifest = runs / "bad" / ".steplens" / "run.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "world_size": "eight", "facts": "oops"}))
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run([str(BIN / "steplens"), "compare", str(runs / "good"), str(runs / "bad"), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "internal error" not in done.stderr
    assert " ".join(done.stderr.split()) == (f"error: {manifest.parent}: damaged result (world_size, facts of the wrong "
                                             "type or out of range); analyse the run again")
    done = subprocess.run([str(BIN / "steplens"), "trials", str(runs)], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "internal error" not in done.stderr
    assert f"warning: {manifest.parent}: damaged result" in " ".join(done.stderr.split()) and "good" in done.stdout
    # a count of processes below one is damage too (trials took a world size of -4)
    for world_size in (-4, 0):
        manifest.write_text(json.dumps({**json.loads((runs / "good" / ".steplens" / "run.json").read_text()),
                                        "world_size": world_size}))
        done = subprocess.run([str(BIN / "steplens"), "trials", str(runs)], capture_output=True, text=True, env=env)
        assert done.returncode == 1 and "damaged result (world_size of the wrong type or out of range)" in " ".join(
            done.stderr.split())


def test_compare_gives_no_median_of_two_unlike_steps(tmp_path):
    """A collector run that keeps 2 steps, 403 ms and 85.6 ms (as the bundled sample did): compare shows no median step
    time for them (step time's rule), as analyze does."""
    import json

    from test_compare_trials import _collector_run

    for side in ("base", "new"):
        _collector_run(tmp_path / side, 4, [403, 85.6])
    done = subprocess.run([str(BIN / "steplens"), "compare", str(tmp_path / "base"), str(tmp_path / "new"), "--out",
                           str(tmp_path / "out"), "--format", "json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    step = json.loads(done.stdout)["step_time"]
    assert step["base_steps"] == step["new_steps"] == 2 and step["base_median_ns"] is None is step["new_median_ns"]
    assert "<td>median step time</td><td>too few steps</td><td>too few steps</td>" in (tmp_path / "out" / "compare.html").read_text()


def test_compare_refuses_a_folder_of_runs_and_an_output_folder_of_analyze(tmp_path):
    """A folder holding two runs was analysed as one and its mixture judged ('within noise', exit 0); --out inside a
    run's .steplens was taken, and the next analyze of that run then refused its own folder."""
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        shutil.copytree(ROOT / "sample_runs" / "synthetic_8rank", runs / name, ignore=shutil.ignore_patterns(".steplens"))
    single = runs / "a"
    env = {**os.environ, "COLUMNS": "80"}
    mixed = subprocess.run([str(BIN / "steplens"), "compare", str(single), str(runs), "--out", str(tmp_path / "c")],
                           capture_output=True, text=True, env=env)
    assert mixed.returncode == 2 and f"{runs} holds 2 runs (a, b)" in " ".join(mixed.stderr.split())
    assert not (runs / ".steplens").exists()
    inside = subprocess.run([str(BIN / "steplens"), "compare", str(single), str(single), "--out",
                             str(single / ".steplens" / "cmp")], capture_output=True, text=True, env=env)
    assert inside.returncode == 2 and "a folder analyze wrote" in " ".join(inside.stderr.split())
    assert not (single / ".steplens" / "cmp").exists()


def test_a_run_compared_with_itself_lists_its_largest_kernels_the_same_way_every_time(tmp_path):
    """Every delta is 0 comparing a run with itself: the rows were picked in hash order, a different compare.md each
    time and often without the largest kernels. Ties now go by time: the largest first, the same bytes each time."""
    import polars as pl

    run = tmp_path / "run"
    shutil.copytree(ROOT / "sample_runs" / "synthetic_8rank", run, ignore=shutil.ignore_patterns(".steplens"))
    outputs = []
    for i in range(2):
        done = subprocess.run([str(BIN / "steplens"), "compare", str(run), str(run), "--out", str(tmp_path / f"c{i}"),
                               "--format", "json"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        outputs.append((tmp_path / f"c{i}" / "compare.md").read_bytes())
    assert outputs[0] == outputs[1]
    from steplens.analyze.analyses import compare as comparison
    from steplens.reports.data import load

    listed = comparison.compare(load(run), load(run))["kernels"]["name"].to_list()
    largest = pl.read_parquet(run / ".steplens" / "top_kernels").group_by("name").agg(pl.col("time_ns").sum()).sort(
        "time_ns", "name", descending=[True, False])["name"].to_list()
    assert listed == largest[:len(listed)] and len(listed) >= 2


def test_no_median_of_a_few_unlike_steps_is_compared(tmp_path):
    """A collector run that timed 2 kept steps, 403 ms and 85.6 ms (as the bundled sample did): analyze gives them no
    median, but compare printed 'median tokens/s base 3,626' (the mean of two per-step rates, a rate no step had) and
    '+2878.2%'."""
    import json

    from test_compare_trials import _collector_run

    gpu = ROOT.parent / "shared" / "gpu-runs" / "h200_zero2_gpu_check" / "job"
    if not gpu.is_dir():
        pytest.skip(f"the real GPU run is not at {gpu}")
    base, new = tmp_path / "cpu", tmp_path / "gpu"
    _collector_run(base, 4, [403, 85.6])
    shutil.copytree(gpu, new)
    done = subprocess.run([str(BIN / "steplens"), "compare", str(base), str(new), "--out", str(tmp_path / "c"),
                           "--format", "json"], capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr
    verdict = json.loads(done.stdout)["verdict"]
    assert verdict["base_n"] == 2 and verdict["base_median"] is None and verdict["delta"] is None
    assert verdict["new_median"] is not None
    text = (tmp_path / "c" / "compare.md").read_text()
    assert "too few steps" in text and "2878" not in text


def test_gpu_time_per_step_counts_the_steps_work_only(tmp_path):
    """Kernels outside every profiled step (56.5 ms in trace_diff's test trace) were added to the per-step figures:
    160.6 ms per step and rank against the steps' own 151.2."""
    import polars as pl
    from steplens.analyze.analyses import compare as comparison
    from steplens.reports.data import load

    from conftest import CORPUS

    pair = CORPUS / "HolisticTraceAnalysis" / "trace_diff"
    if not (pair / "control.json.gz").is_file():
        pytest.skip(f"corpus pair not found at {pair}")
    runs = {}
    for name in ("control", "test"):
        run = tmp_path / name
        run.mkdir()
        shutil.copy(pair / f"{name}.json.gz", run / f"{name}.json.gz")
        assert subprocess.run([str(BIN / "analyze"), str(run), "-q"], capture_output=True).returncode in (0, 1)
        runs[name] = load(run)
    result = comparison.compare(runs["control"], runs["test"])
    for side, name in (("base_ns", "control"), ("new_ns", "test")):
        events = pl.read_parquet(tmp_path / name / ".steplens" / "trace_events" / "**" / "*.parquet", hive_partitioning=True)
        steps = events.filter(pl.col("kind") == "cpu_op").select(pl.col("step").drop_nulls().n_unique()).item()
        in_steps = events.filter(pl.col("kind").is_in(["kernel", "gpu_memcpy", "gpu_memset"]) & pl.col("step").is_not_null())
        assert result["categories"][side].sum() == pytest.approx(in_steps["dur_ns"].sum() / steps, rel=1e-9)


def test_a_verdict_without_step_times_says_which_run_lacks_them_and_what_it_would_judge(tmp_path):
    """A run without steps compared with itself was 'no step-time source in common'; runs of different batch sizes
    with no common source were 'step time: not comparable' while every warning said the verdict was on throughput."""
    import json

    from conftest import CORPUS

    sources = {"alex": CORPUS / "HolisticTraceAnalysis" / "critical_path_alexnet",
               "meg": CORPUS / "Megatron-DeepSpeed" / "random_ltd_gpt3_baseline",
               "sft": CORPUS / "DeepSpeedExamples" / "deepspeed_chat_step1_sft"}
    if not all(folder.is_dir() for folder in sources.values()):
        pytest.skip("corpus runs not found")
    for name, folder in sources.items():
        (tmp_path / name).mkdir()
        for path in [*folder.glob("*.json.gz"), *folder.glob("*.log")]:
            shutil.copy(path, tmp_path / name / path.name)

    def verdict(base: str, new: str) -> dict:
        done = subprocess.run([str(BIN / "steplens"), "compare", str(tmp_path / base), str(tmp_path / new), "--out",
                               str(tmp_path / f"c-{base}-{new}"), "--format", "json"], capture_output=True, text=True)
        assert done.returncode in (0, 1), done.stderr
        return json.loads(done.stdout)["verdict"]

    alone = verdict("alex", "alex")
    assert alone["verdict"] == "not comparable" and alone["why"].startswith("neither run has step times")
    batches = verdict("meg", "sft")
    assert batches["metric"] == "throughput" and batches["verdict"] == "not comparable"


def _global_timer_ms(log: Path) -> list[float]:
    """fwd + bwd + step of each global wall_clock_breakdown line of a DeepSpeed log, read with a regex."""
    import re

    pattern = re.compile(r"time \(ms\) \| fwd: ([\d.]+) \| bwd: ([\d.]+) \|.*\| step: ([\d.]+)")
    return [sum(map(float, m.groups())) for line in log.read_text().splitlines() if (m := pattern.search(line))]


def test_step_times_of_the_same_ranks_in_both_runs(tmp_path):
    """A run with DeepSpeed's logs only (its timers printed on rank 0 alone) against the same job with the collector,
    whose timers a slower rank 1 also recorded: compare took the slowest of two ranks in one run and of one in the
    other, a change on the same job (+10% in a sweep's real job). Both sides now come from rank 0."""
    import json

    import pyarrow as pa

    sample = ROOT / "sample_runs" / "deepspeed_cpu_2rank"
    logs_only, full, slow_rank = tmp_path / "logs_only", tmp_path / "full", tmp_path / "slow_rank"
    logs_only.mkdir()
    shutil.copytree(sample / "rank_logs", logs_only / "rank_logs")
    shutil.copy(sample / "ds_config.json", logs_only)
    shutil.copytree(sample, full)
    shutil.copytree(sample, slow_rank)
    # rank 1's global timers, 1.5x rank 0's, beside rank 0's in the collector's parts
    timers = slow_rank / "collector" / "step_timers"
    rank0 = pa.concat_tables(pq.read_table(p) for p in sorted(timers.glob("rank0-*.parquet"))).to_pylist()
    slower = [{**row, "rank": 1, "ms": row["ms"] * 1.5} for row in rank0 if row["scope"] == "global"]
    pq.write_table(pa.Table.from_pylist(slower, schema=pq.read_schema(timers / "rank0-00000.parquet")),
                   timers / "rank1-00099.parquet")

    def compared(new: Path) -> dict:
        done = subprocess.run([str(BIN / "steplens"), "compare", str(logs_only), str(new), "--out",
                               str(tmp_path / f"c-{new.name}"), "--format", "json"], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    data = compared(slow_rank)
    assert data["verdict"]["source"].startswith("DeepSpeed wall_clock_breakdown")
    # the logs-only side: the global timer lines of the rank-0 log (the log knows no instrumented step) but the
    # first, a warm-up step more than twice as long as the others' median
    (log,) = (logs_only / "rank_logs").glob("*rank0.log")
    first, *rest = _global_timer_ms(log)
    assert first > 2 * statistics.median(rest)
    assert data["step_time"]["base_median_ns"] == pytest.approx(statistics.median(rest) * 1e6)
    # the collector side is rank 0's alone: the slower rank 1 changes nothing (it made the median 1.5x)
    assert data["step_time"]["new_median_ns"] == compared(full)["step_time"]["new_median_ns"]
    assert data["step_time"]["new_median_ns"] < 1.1 * data["step_time"]["base_median_ns"]
    assert any("step times of rank 0 in both runs" in w and "in the base run they cover 1 of its 2 ranks" in w
               for w in data["warnings"]), data["warnings"]


def test_compare_shows_the_loss_before_the_log_s_memory_lines(tmp_path):
    """Of the scalars both runs have, compare drew the first four by name: the log's CurrSamplesPerSec,
    MaxMemAllocated_GB, MemAllocated_GB and RunningAvgSamplesPerSec (upper case sorts first), never the loss."""
    import pyarrow.parquet as pq_

    from steplens.analyze.analyses import compare
    from steplens.reports.data import load

    run = shutil.copytree(ROOT / "sample_runs" / "deepspeed_cpu_2rank", tmp_path / "run")
    assert subprocess.run([str(BIN / "analyze"), str(run), "-q"], capture_output=True, timeout=600).returncode == 0
    names = set(pq_.read_table(run / ".steplens" / "scalars", columns=["name"]).column("name").to_pylist())
    analysed = load(run)
    shown, shared = compare.curves(analysed, analysed)
    assert shared == len(names) > compare.MAX_CURVES
    # the reviewer's order: loss, gradient norm, learning rate, throughput, memory
    assert set(shown["name"].unique()) == {"train/loss", "Train/Samples/lr", "lr", "CurrSamplesPerSec"}
    done = subprocess.run([str(BIN / "steplens"), "compare", str(run), str(run), "--out", str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    page = " ".join((tmp_path / "c" / "compare.html").read_text().split())
    assert f"4 of the {len(names)} scalars both runs have: loss, gradient norm" in page


def test_a_command_in_a_warning_reads_as_code_in_the_page_and_the_rest_stays_text():
    """compare.html showed the warnings' `steplens trials` with its backticks."""
    from steplens.reports.html import _code_spans

    assert str(_code_spans("compare them with `steplens trials` <b>first</b>")) == (
        "compare them with <code>steplens trials</code> &lt;b&gt;first&lt;/b&gt;")
    assert str(_code_spans("a `<script>` name")) == "a <code>&lt;script&gt;</code> name"


def test_what_a_step_is_reads_one_field_a_line_with_each_runs_value(compared):
    """Each field printed 'status missing, values base not recorded, new not recorded, detail not recorded for the
    base and new runs: ...', repeating the warnings above it."""
    _, stdout = compared
    block = stdout.split("What a step is in each run\n", 1)[1].split("\nKernel categories", 1)[0]
    fields = " ".join(line.strip() if line.startswith("    ") else "\n" + line.strip() for line in block.splitlines())
    fields = [field.strip() for field in fields.split("\n") if field.strip()]  # a field's wrapped lines joined
    assert fields and all(re.fullmatch(r"[a-z_]+: base .+, new .+, status (same|different|missing)(, detail .+)?", f)
                          for f in fields), fields
    assert "values base" not in block and "detail not recorded" not in block


def test_compare_writes_over_its_own_files_only(compared, tmp_path):
    """--out a folder holding the user's own compare.md: it was overwritten (exit 0); now refused, the file as it was.
    Compare's own earlier files are replaced as before."""
    root, _ = compared
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "compare.md").write_text("my notes\n")
    done = subprocess.run([str(BIN / "steplens"), "compare", str(root / "base"), str(root / "new"), "--out", str(mine)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "its compare.md is not one compare wrote" in " ".join(done.stderr.split())
    assert (mine / "compare.md").read_text() == "my notes\n" and not (mine / "compare.html").exists()
    again = subprocess.run([str(BIN / "steplens"), "compare", str(root / "base"), str(root / "new"), "--out",
                            str(root / "out")], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr


def test_trials_does_not_follow_a_link_out_of_runs_dir(tmp_path):
    """A link under RUNS_DIR to a run elsewhere: trials analysed it, writing a result into that folder (and a link to
    /etc had it scan /etc). It is named and left out (exit 1); nothing is written where it points."""
    runs, elsewhere = tmp_path / "runs", tmp_path / "elsewhere" / "run"
    shutil.copytree(ROOT / "sample_runs" / "deepspeed_cpu_2rank", runs / "good", ignore=shutil.ignore_patterns(".steplens"))
    shutil.copytree(ROOT / "sample_runs" / "deepspeed_cpu_2rank", elsewhere, ignore=shutil.ignore_patterns(".steplens"))
    (runs / "linked").symlink_to(elsewhere)
    (runs / "latest").symlink_to(runs / "good")  # within RUNS_DIR: a name for a run already ranked, skipped quietly
    (runs / ".previous").symlink_to(elsewhere)  # hidden, as hidden folders are
    done = subprocess.run([str(BIN / "steplens"), "trials", str(runs)], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 1 and "internal error" not in done.stderr
    assert f"warning: {runs / 'linked'}: a link out of {runs}, not followed" in done.stderr
    assert "latest" not in done.stderr and "previous" not in done.stderr
    assert not (elsewhere / ".steplens").exists() and "good" in done.stdout
    (runs / "linked").unlink()
    done = subprocess.run([str(BIN / "steplens"), "trials", str(runs)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_compare_on_a_full_disk_names_its_folder_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """--out on a full disk: exit 4 with 'No space left on device' alone, and .compare.html.tmp-PID left behind. The
    message names the folder; nothing half-written stays."""
    import errno

    from click.testing import CliRunner

    from steplens.analyze.cli import steplens

    run = tmp_path / "run"
    shutil.copytree(ROOT / "sample_runs" / "deepspeed_cpu_2rank", run, ignore=shutil.ignore_patterns(".steplens"))
    assert subprocess.run([str(BIN / "analyze"), str(run), "-q"], capture_output=True).returncode == 0
    written = Path.write_text

    def full_disk(self, text, *args, **kwargs):
        if self.name.startswith(".compare."):
            written(self, text[: len(text) // 2], *args, **kwargs)  # part of it reached the disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return written(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    out = tmp_path / "cmp"
    done = CliRunner().invoke(steplens, ["compare", str(run), str(run), "--out", str(out)])
    assert done.exit_code == 4, done.output
    assert f"--out {out}: cannot write there (No space left on device)" in " ".join(done.output.split())
    assert list(out.iterdir()) == []


def test_compare_writes_nothing_into_a_run_folder(tmp_path):
    """--out RUN (an input folder, not its .steplens) wrote compare.html and compare.md among the job's files; an empty
    --out wrote them into the current folder. Both are refused, exit 2, nothing written there."""
    from click.testing import CliRunner

    from steplens.analyze.cli import steplens

    run = tmp_path / "run"
    shutil.copytree(ROOT / "sample_runs" / "deepspeed_cpu_2rank", run, ignore=shutil.ignore_patterns(".steplens"))
    assert subprocess.run([str(BIN / "analyze"), str(run), "-q"], capture_output=True).returncode == 0
    before = sorted(p.name for p in run.iterdir())
    for out in (run, run / "sub", ""):
        done = CliRunner().invoke(steplens, ["compare", str(run), str(run), "--out", str(out)])
        assert done.exit_code == 2 and "a folder of its own" in " ".join(done.output.split()), done.output
    # a link to a folder is a folder (written into where it points)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    done = CliRunner().invoke(steplens, ["compare", str(run), str(run), "--out", str(tmp_path / "link")])
    assert done.exit_code == 0 and (tmp_path / "real" / "compare.md").is_file(), done.output
    assert sorted(p.name for p in run.iterdir()) == before and not list(Path.cwd().glob("compare.*"))
    os.mkfifo(tmp_path / "fifo")  # (it said 'File exists')
    done = CliRunner().invoke(steplens, ["compare", str(run), str(run), "--out", str(tmp_path / "fifo")])
    assert done.exit_code == 2 and "not a folder" in done.output
    # a run compared with itself is said to be one
    done = CliRunner().invoke(steplens, ["compare", str(run), str(run / ".steplens"), "--out", str(tmp_path / "cmp")])
    assert done.exit_code == 0 and "both sides are the same result" in " ".join(done.output.split())


def test_a_gate_that_cannot_judge_says_so(tmp_path):
    """trace_diff's control and test runs (rank 3 against rank 1: no rank in common) have no verdict; with
    --fail-on-regression the exit 0 read as a pass in a CI log. The gate now says it was not applied."""
    from conftest import CORPUS

    if not (CORPUS / "HolisticTraceAnalysis" / "trace_diff").is_dir():
        pytest.skip("shared corpus not found")
    runs = []
    for name in ("control", "test"):
        (tmp_path / name).mkdir()
        shutil.copy(CORPUS / "HolisticTraceAnalysis" / "trace_diff" / f"{name}.json.gz", tmp_path / name)
        runs.append(str(tmp_path / name))
    done = subprocess.run([str(BIN / "steplens"), "compare", *runs, "--out", str(tmp_path / "cmp"),
                           "--fail-on-regression", "5"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert "warning: --fail-on-regression 5% not applied: the verdict is 'not comparable'" in done.stderr
    # why: both have ProfilerSteps, of rank 3 and of rank 1 (it said 'no step-time source in common')
    assert ("both have step times from the profiled ProfilerSteps, but from ranks with none in common (base rank(s) 3, "
            "new rank(s) 1)") in " ".join(done.stdout.split())


def test_a_cpu_job_against_a_gpu_job_warns_that_the_devices_differ(tmp_path):
    """The bundled CPU job (its collector saw 'cpu (2 cores)', no trace names a GPU) against the real H200 job: A100
    against V100 warned, CPU against GPU did not."""
    if not H200_JOB.is_dir():
        pytest.skip("shared GPU run not found")
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    shutil.copytree(ROOT / "sample_runs" / "deepspeed_cpu_2rank", cpu, ignore=shutil.ignore_patterns(".steplens"))
    shutil.copytree(H200_JOB, gpu, ignore=shutil.ignore_patterns(".steplens"))
    done = subprocess.run([str(BIN / "steplens"), "compare", str(cpu), str(gpu), "--out", str(tmp_path / "cmp")],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode in (0, 1), done.stderr
    assert "warning: devices differ (cpu (2 cores) vs NVIDIA H200)." in done.stdout + done.stderr


def test_rank_numbers_that_are_no_ranks_are_damage():
    """run.json ranks [0, 1, 'x', None, -5, 1e30] was taken as a run of 6 ranks; ranks are integers from 0."""
    from steplens.analyze.contract.manifest import damage

    assert damage({"ranks": [0, 1, 2]}) is None
    for ranks in ([0, 1, "x"], [0, None], [-5], [1e30], [True]):
        assert damage({"ranks": ranks}) == "ranks of the wrong type or out of range", ranks


def test_a_result_read_with_its_report_deleted_and_a_run_json_of_the_users_beside_it(tmp_path):
    """Readers need the tables and findings.json: a result whose report.html and summary.md the user deleted is read
    as it is (it was refused as damaged). A run folder holding a run.json of the user's own beside .steplens/ is read
    through .steplens/ (the foreign file was named as a damaged result, and analysing again could not help)."""
    from click.testing import CliRunner

    from steplens.analyze.cli import steplens

    run = tmp_path / "run"
    shutil.copytree(ROOT / "sample_runs" / "deepspeed_cpu_2rank", run, ignore=shutil.ignore_patterns(".steplens"))
    assert subprocess.run([str(BIN / "analyze"), str(run), "-q"], capture_output=True).returncode == 0
    (run / ".steplens" / "report.html").unlink()
    (run / ".steplens" / "summary.md").unlink()
    (run / "run.json").write_text('{"name": "my run"}')
    for args in (["compare", str(run), str(run), "--out", str(tmp_path / "cmp")],
                 ["export-trace", str(run), "--out", str(tmp_path / "t.json")]):
        done = CliRunner().invoke(steplens, args)
        assert done.exit_code == 0 and "damaged" not in done.output, (args[0], done.output)
