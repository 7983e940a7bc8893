"""Alarms that are noise: a spike needs a real change, and the step rules skip the steps the run instrumented.
Hand-computed series, and the real H200 job in ../shared/gpu-runs whose collector raised a 0.6% loss_spike and a
throughput_drop on its profiler window step (the schedule read from its raw manifest)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from steplens.analyze.contract import alarm_rules

ROOT = Path(__file__).resolve().parents[1]
H200_JOB = ROOT.parent / "shared" / "gpu-runs" / "h200_zero2_gpu_check" / "job"


def _spikes(values: list[float]) -> list[dict]:
    engine = alarm_rules.AlarmEngine(alarm_rules.parse_rules([{"kind": "loss_spike"}]))
    return [a for step, value in enumerate(values) for a in engine.scalar("train/loss", step, None, value, None)]


def test_a_spike_needs_a_change_of_five_percent_not_only_a_robust_z():
    flat = [10.0, 10.01, 9.99, 10.0, 10.01, 9.99, 10.0, 10.01, 9.99, 10.0]  # median 10.0, MAD 0.01
    # 10.06: z = 0.6745 x 0.06 / 0.01 = 4.0 > 3.5, but +0.6%: noise
    assert _spikes(flat + [10.06]) == []
    # 10.6: z = 40.5 and +6%: a spike
    [alarm] = _spikes(flat + [10.6])
    assert alarm["step"] == 10 and alarm["rule"] == "loss_spike" and "(+6.0%)" in alarm["detail"]
    assert alarm["score"] == pytest.approx(0.6745 * 0.6 / 0.01)


def _drops(rates: list[float], skip: set[int]) -> list[int]:
    rule = alarm_rules.Rule.parse({"kind": "throughput_drop"})
    engine = alarm_rules.AlarmEngine([rule], skip_steps=skip)
    samples, alarms = 0, []
    for step, rate in enumerate(rates):  # 100 samples a step; step time from the rate
        samples += 100
        alarms += engine.step(step, round(100 / rate * 1e9), samples, step)
    return [a["step"] for a in alarms]


def test_the_step_rules_skip_instrumented_steps():
    steady = [100.0] * 12
    # three slowed steps (a profiler's warm-up, window and export at steps 12-14) between steady ones
    slowed = steady + [50.0, 50.0, 50.0] + [100.0] * 5
    assert _drops(slowed, set()) == [13]  # rates 100, 50, 50: median 50 < 0.8 x 100
    assert _drops(slowed, {12, 13, 14}) == []  # the instrument's cost, neither judged nor remembered
    # a real slow-down after a skipped step still fires: at step 14 the last three judged rates are 100, 50, 50
    # (step 12 left out): median 50 < 0.8 x 100
    assert _drops(steady + [50.0] + [50.0] * 3, {12}) == [14]


@pytest.fixture(scope="module")
def h200(tmp_path_factory) -> Path:
    if not H200_JOB.is_dir():
        pytest.skip(f"{H200_JOB} is not here")
    run = tmp_path_factory.mktemp("alarms") / "job"
    shutil.copytree(H200_JOB, run)
    done = subprocess.run([sys.executable, "-m", "steplens.analyze", str(run), "-q"], capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr
    return run / ".steplens"


def test_the_h200_jobs_noise_alarms_are_not_raised_again(h200):
    schedule = json.loads((H200_JOB / "collector" / "manifest" / "rank0.json").read_text())["run"]["settings"]["profile"]
    window_step = schedule["skip_first"] + schedule["wait"] + schedule["warmup"]  # the recorded (active) step
    in_job = {(r["rule"], r["step"]): r["value"] for part in sorted((H200_JOB / "collector" / "alarms").glob("*.parquet"))
              for r in pq.read_table(part).to_pylist()}
    assert ("throughput_drop", window_step) in in_job and ("loss_spike", 10) in in_job
    rows = {(r["rule"], r["step"]): r for r in pq.read_table(h200 / "alarm_agreement").to_pylist()}
    assert rows[("throughput_drop", window_step)]["instrumented"] and not rows[("throughput_drop", window_step)]["post_hoc"]
    assert not rows[("loss_spike", 10)]["post_hoc"]  # a 0.6% change is not replayed as a spike
    findings = json.loads((h200 / "findings.json").read_text())
    assert findings["alarm_agreement"]["on_instrumented_steps"] == 1 and findings["alarm_agreement"]["only_in_job"] == 1
    monitor = pq.read_table(h200 / "monitor_alarms").to_pylist()
    assert not [r for r in monitor if r["rule"] == "loss_spike"]
    # every alarm is listed, in the report and in summary.md, not only counted
    html, summary = (h200 / "report.html").read_text(), (h200 / "summary.md").read_text()
    assert 'id="alarms"' in html and "**Alarms**" in summary
    for (rule, step), row in rows.items():
        raised = ("in the job, on an instrumented step" if row["instrumented"] else
                  "in the job only" if row["in_job"] and not row["post_hoc"] else
                  "in the replay only" if row["post_hoc"] and not row["in_job"] else "in the job and the replay")
        assert f"| {step} | {rule.replace('_', chr(92) + '_')} |" in summary and raised in summary
        assert f"<td>{raised}</td>" in html


def test_the_collectors_alarms_skip_the_steps_it_instruments():
    """In the job too: the collector's engine skips its profiler schedule's steps (warm-up, window, export) and its
    FLOPs step, computed by the one rule the analysis uses (alarm_rules.profiled_steps), and a checkpoint's step as
    it happens."""
    from types import SimpleNamespace

    pytest.importorskip("torch")
    from steplens.collect.alarms import Alarms

    settings = SimpleNamespace(profile={"skip_first": 12, "wait": 1, "warmup": 1, "active": 1, "repeat": 2},
                               alarm_timeout_s=1.0, pushgateway=None)
    collector = SimpleNamespace(settings=settings, rank=0, flops_step=5, writer=SimpleNamespace(seq=0))
    alarms = Alarms(collector, alarm_rules.parse_rules([{"kind": "throughput_drop"}]))
    # window 1: warm-up 13, active 14, export 15; window 2 (a cycle of 3 later): 16, 17, 18
    assert alarms.engine.skip_steps == {5, 13, 14, 15, 16, 17, 18}
    assert alarm_rules.profiled_steps({"skip_first": 12, "wait": 1, "warmup": 1, "active": 1, "repeat": 2}) == [
        (13, "profiler_warmup"), (14, "profiler_window"), (15, "profiler_export"),
        (16, "profiler_warmup"), (17, "profiler_window"), (18, "profiler_export")]


def test_a_hostile_series_name_is_escaped_in_the_alarms_listing(tmp_path):
    """A csv_monitor file whose tag holds markup (the tag comes from the file name): its post-hoc loss_spike is
    listed in report.html and summary.md with the name escaped, never as markup."""
    csv = tmp_path / "run" / "csv" / "Train_<img src=x onerror=alert(1)>_loss.csv"
    csv.parent.mkdir(parents=True)
    rows = [f"{8 * s},{10.0 + 0.01 * (s % 5)}" for s in range(1, 20)] + ["160,13.0"]  # +30%: a spike
    csv.write_text("step,loss\n" + "\n".join(rows) + "\n")
    done = subprocess.run([sys.executable, "-m", "steplens.analyze", str(tmp_path / "run"), "-q"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "run" / ".steplens"
    html, summary = (out / "report.html").read_text(), (out / "summary.md").read_text()
    assert "<td>Train/&lt;img src=x onerror=alert(1)&gt;/loss</td>" in html and "<img src=x" not in html
    assert "| Train/\\<img src=x onerror=alert(1)\\>/loss | post hoc (csv\\_monitor) |" in summary
    assert "Alarms: loss_spike x1" in done.stdout
