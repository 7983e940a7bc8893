"""Monitor analysis: alarms on synthetic series whose spikes, NaNs and drops are known by
construction (the rules are the in-job collector's: trailing windows, cooldown 100 points); curve
alignment and comparability on the real runs in ../shared. That the job and this analysis raise the
same alarms on the same series: tests/test_alarm_rules_agree.py."""

import json
import math
import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from steplens.analyze import analyses
from steplens.analyze.importers import telemetry
from steplens.analyze.analyses import monitor
from steplens.analyze.importers.base import conform

RUNS = Path(__file__).resolve().parents[1].parent / "shared" / "deepspeed-cpu-runs"
BATCH = 16


def series(name: str, values, origin: str = "collector", segment: int = 0) -> pl.DataFrame:
    rows = [{"rank": 0, "source": f"{origin}.src", "origin": origin, "name": name, "global_samples": BATCH * (k + 1),
             "value": float(v), "segment": segment} for k, v in enumerate(values)]
    return conform(rows, "scalars")


def alarm_samples(alarms: pl.DataFrame, kind: str) -> list[int]:
    return sorted(alarms.filter(pl.col("alarm") == kind)["global_samples"].to_list())


def test_loss_spikes_and_non_finite_values_found_exactly():
    rng = np.random.default_rng(6)
    loss = 2.0 * np.exp(-np.arange(400) / 150) + 1.0 + rng.normal(0, 0.01, 400)
    spikes, nans, infs = [120, 250, 251, 390], [60, 300], [200]
    loss[spikes] += 1.0  # a trailing window on a falling loss has a wide spread early on: +0.5 at 120 is z ~ 2.9
    loss[nans], loss[infs] = math.nan, math.inf
    alarms = monitor.monitor_alarms(series("train/loss", loss), {})
    # 251 follows the alarm at 250 within the cooldown (100 points): the job would not raise it either.
    assert alarm_samples(alarms, "loss_spike") == [BATCH * (i + 1) for i in (120, 250, 390)]
    assert alarm_samples(alarms, "nan_inf") == [BATCH * (i + 1) for i in sorted(nans + infs)]
    spike = alarms.filter(pl.col("alarm") == "loss_spike").row(0, named=True)
    # The modified z against the 50 finite points before it, computed here with numpy.
    before = loss[:120][np.isfinite(loss[:120])][-50:]
    median = np.median(before)
    assert spike["score"] == pytest.approx(0.6745 * (loss[120] - median) / np.median(np.abs(before - median)))
    assert spike["score"] > monitor.SPIKE_Z and spike["threshold"] == monitor.SPIKE_Z and spike["rule"] == "loss_spike"
    assert spike["value"] == pytest.approx(loss[120]) and spike["baseline"] == pytest.approx(median)
    assert "robust z" in spike["detail"]


def test_loss_scale_is_not_a_loss():
    values = [65536.0] * 30 + [131072.0]  # the fp16 loss scale doubles: not a loss spike
    assert monitor.monitor_alarms(series("Train/Samples/loss_scale", values), {}).is_empty()


def test_grad_norm_above_a_threshold():
    norms = [0.5, 0.8, 1.2, 0.9, 3.0, 0.7] + [0.5] * 100 + [1.5]
    alarms = monitor.monitor_alarms(series("grad_norm", norms), {}, grad_norm_threshold=1.0)
    # 3.0 at point 4 is within the cooldown of the alarm at point 2; 1.5 at point 106 is past it.
    assert alarm_samples(alarms, "grad_norm_high") == [BATCH * 3, BATCH * 107]
    assert set(alarms["threshold"]) == {1.0} and set(alarms["rule"]) == {"grad_norm_high"}


def test_grad_norm_spike_without_a_threshold():
    rng = np.random.default_rng(1)
    norms = 1.0 + rng.normal(0, 0.05, 100)
    norms[70] = 8.0
    alarms = monitor.monitor_alarms(series("train/grad-norm", norms), {})
    assert alarm_samples(alarms, "grad_norm_high") == [BATCH * 71] and alarms["rule"].to_list() == ["grad_norm_spike"]


def test_throughput_drops_are_sustained_drops_of_twenty_percent():
    rng = np.random.default_rng(2)
    rate = 1000 + rng.normal(0, 2, 300)
    rate[50] = 700  # one slow point: the median of the last 3 hardly moves
    rate[100:110] = 850  # -15%: under the 20% limit
    rate[200:210] = 700  # -30% for 10 points: the alarm comes when 2 of the last 3 are low, at point 201
    alarms = monitor.monitor_alarms(series("samples_per_sec", rate), {})
    assert alarm_samples(alarms, "throughput_drop") == [BATCH * 202]
    drop = alarms.row(0, named=True)
    assert drop["rule"] == "throughput_drop" and drop["value"] == pytest.approx(np.median(rate[199:202]))
    assert drop["baseline"] == pytest.approx(np.median(rate[149:199]))  # the 50 points before the last 3


def test_slow_steps_count_as_throughput_drops():
    rng = np.random.default_rng(3)
    step_ms = 35 + rng.normal(0, 0.5, 100)
    step_ms[0] = 900  # warm-up step: too little history to judge
    step_ms[40] = 90  # 2.6x the median: under the 3x limit
    step_ms[80] = 120  # 3.4x
    alarms = monitor.monitor_alarms(series("Train/Samples/elapsed_time_ms_step", step_ms), {})
    assert alarm_samples(alarms, "throughput_drop") == [BATCH * 81] and alarms["rule"].to_list() == ["slow_step"]
    assert alarms["score"][0] == pytest.approx(120 / np.median(step_ms[30:80]))


def test_memory_growth_found_and_flat_memory_left_alone():
    rng = np.random.default_rng(4)
    leaking = 10_000 + 40 * np.arange(120) + rng.normal(0, 30, 120)  # +48% over the run
    flat = 10_000 + rng.normal(0, 30, 120)
    frame = pl.concat([series("memory/allocated_mb", leaking), series("memory/reserved_mb", flat)])
    alarms = monitor.monitor_alarms(frame, {}).filter(pl.col("alarm") == "memory_growth")
    assert alarms["name"].to_list() == ["memory/allocated_mb"]
    # The first point above 1.2 x the median of the first 50 (cooldown then holds the rest back).
    limit = 1.2 * np.median(leaking[:50])
    first = 50 + int(np.flatnonzero(leaking[50:] > limit)[0])
    assert alarms["global_samples"].to_list() == [BATCH * (first + 1)]
    assert alarms["score"][0] == pytest.approx(leaking[first] / np.median(leaking[:50]) - 1)


def test_restart_segment_replaces_overlapping_points():
    first = series("train/loss", [3.0, 2.9, 2.8, 2.7], origin="csv_monitor")
    second = series("train/loss", [2.85, 2.75, 2.65, 2.6, 2.5], origin="csv_monitor", segment=1).with_columns(
        global_samples=pl.col("global_samples") + BATCH)  # resumed from the first checkpoint
    curve = monitor.one_origin(pl.concat([first, second]))
    assert curve["global_samples"].to_list() == [BATCH * k for k in range(1, 7)]
    assert curve["value"].to_list() == [3.0, 2.85, 2.75, 2.65, 2.6, 2.5]


def test_empty_input_gives_empty_tables():
    empty = conform([], "scalars")
    tables = monitor.monitor_tables(empty, {})
    assert tables["monitor_alarms"].is_empty() and tables["run_comparability"].height == len(monitor.COMPARABILITY_FIELDS)
    for table, frame in tables.items():
        assert frame.columns == list(analyses.TABLES[table][1])


# --- on the real runs ----------------------------------------------------------------------------

def load_run(name: str) -> tuple[pl.DataFrame, dict]:
    """Scalars from every monitor file of a run, and the facts the ingest would record for it."""
    base = RUNS / name
    if not base.is_dir():
        pytest.skip(f"shared DeepSpeed runs not found at {RUNS}")
    frames = []
    for path in sorted(p for p in base.rglob("*") if p.is_file()):
        importer = telemetry.claimant(path)
        if importer and importer.name in ("csv_monitor", "tensorboard"):
            frames.append(importer.parse(path, str(path.relative_to(base))).tables["scalars"])
    world_size = int(re.search(r"--num_gpus (\d+)", (base / "COMMAND.txt").read_text())[1])
    return pl.concat(frames), {"world_size": world_size, "ds_config": json.loads((base / "ds_config.json").read_text())}


def test_one_curve_per_tag_from_csv_and_tensorboard():
    scalars, _ = load_run("run1")
    assert set(scalars["origin"]) == {"csv_monitor", "tensorboard"}
    curve = monitor.one_origin(scalars)
    assert curve.group_by("name").agg(pl.col("origin").n_unique())["origin"].to_list() == [1] * curve["name"].n_unique()
    assert curve.height == scalars.height // 2


def test_curves_align_on_samples_not_steps():
    run1, run2 = load_run("run1"), load_run("run2")  # gas 1 vs gas 2: 8 vs 16 samples per step
    comparison = monitor.comparability({"run1": run1[1], "run2": run2[1]})
    status = dict(comparison.select("field", "status").iter_rows())
    assert status["gradient_accumulation_steps"] == status["train_batch_size"] == "different"
    assert status["world_size"] == status["train_micro_batch_size_per_gpu"] == "same"
    assert status["code_revision"] == "missing"
    with pytest.raises(ValueError, match="global_samples"):
        monitor.aligned_curves({"run1": run1, "run2": run2}, axis="step")
    curves = monitor.aligned_curves({"run1": run1, "run2": run2}).filter(pl.col("name") == "Train/Samples/lr")
    x = {run: frame["x"].to_list() for (run,), frame in curves.group_by("run")}
    assert x["run1"] == [8 * k for k in range(1, 13)] and x["run2"] == [16 * k for k in range(1, 11)]
    with_steps = monitor.with_axes(monitor.one_origin(run2[0]), run2[1])
    # the point at 16 samples ends optimizer step 0 (0-based, as the collector and step_time number them)
    assert with_steps.filter(pl.col("name") == "Train/Samples/lr")["step"].to_list() == list(range(0, 10))


def test_tokens_axis_needs_a_sequence_length():
    scalars, facts = load_run("run1")
    assert monitor.aligned_curves({"run1": (scalars, facts)}, axis="global_tokens").is_empty()
    curves = monitor.aligned_curves({"run1": (scalars, {**facts, "seq_len": 64})}, axis="global_tokens")
    assert curves.filter(pl.col("name") == "Train/Samples/lr")["x"].to_list() == [8 * 64 * k for k in range(1, 13)]


def test_alarms_on_a_real_run_name_real_points():
    scalars, facts = load_run("run1")
    tables = monitor.monitor_tables(scalars, facts)
    alarms = tables["monitor_alarms"]
    points = set(scalars.select("name", "global_samples").iter_rows())
    assert all((row["name"], row["global_samples"]) in points for row in alarms.iter_rows(named=True))
    assert "nan_inf" not in set(alarms["alarm"])  # run1 logged finite values only
    assert np.isfinite(scalars["value"].to_numpy()).all()
    status = dict(tables["run_comparability"].select("field", "status").iter_rows())
    assert status["train_batch_size"] == "recorded" and status["code_revision"] == "missing"


def test_a_monitor_series_skips_the_profiled_steps_it_is_numbered_by_its_samples():
    """DeepSpeed's CSV monitor numbers its points by global samples: the forward time at 72 samples (batch 8) is
    optimizer step 8. It fired slow_step there although step 8 was a profiler window step (the README: post-hoc
    alarms skip instrumented steps), and was named step 9. Hand-made series: steady 3 ms, 10.4 ms at 72 samples."""
    from steplens.analyze.analyses import monitor

    values = [3.0 + 0.01 * (k % 3) for k in range(1, 13)]
    values[8] = 10.4  # the point at 72 samples: over 3x the trailing median
    scalars = pl.DataFrame({"name": "Train/Samples/elapsed_time_ms_forward", "origin": "csv_monitor",
                            "source": "csv/Train_Samples_elapsed_time_ms_forward.csv", "rank": None, "segment": None,
                            "global_samples": [8 * k for k in range(1, 13)], "step": None, "global_tokens": None,
                            "value": values, "wall_ns": None},
                           schema_overrides={"rank": pl.Int64, "segment": pl.Int64, "step": pl.Int64,
                                             "global_tokens": pl.Int64, "wall_ns": pl.Int64})
    facts = {"train_batch_size": 8}
    fired = monitor.monitor_alarms(scalars, facts)
    assert fired.select("rule", "step", "global_samples").rows() == [("slow_step", 8, 72)]
    assert monitor.monitor_alarms(scalars, facts, instrumented=frozenset({8})).is_empty()


def test_each_alarm_of_the_run_is_counted_once_by_the_rule_that_fired():
    """The helper's slow-loader job: the in-job rules raised 5 slow_step and 1 throughput_drop, the replay of the same
    rules the same 6, and the post-hoc pass over every series 4 of those slow_steps again (its `alarm` column says
    throughput_drop for them). The verdict said "slow_step x5, throughput_drop x4"; each alarm once is 5 and 1."""
    from steplens.reports.verdict import first_screen

    timers = [("Train/Samples/elapsed_time_ms_backward_inner", 10), ("Train/Samples/elapsed_time_ms_step", 10),
              ("Train/Samples/elapsed_time_ms_backward", 11), ("Train/Samples/elapsed_time_ms_backward_allreduce", 11)]
    post_hoc = pl.DataFrame([{"rule": "slow_step", "alarm": "throughput_drop", "name": n, "step": s} for n, s in timers])
    finding = monitor.alarms_finding(post_hoc)
    assert finding["by_rule"] == {"slow_step": 4}
    assert monitor.alarms_lines(finding, {}) == ["Monitor alarms: slow_step x4 (table monitor_alarms)."]
    replayed = [("slow_step", n, s) for n, s in timers] + [("slow_step", "step_time", 11), ("throughput_drop", "samples_per_s", 17)]
    findings = {"monitor_alarms": finding, "alarm_agreement": {"replayed": replayed, "listed": []}}
    assert monitor.distinct_alarms(findings) == {"slow_step": 5, "throughput_drop": 1}
    assert ("Alarms: slow_step x5, throughput_drop x1", "alarms") in first_screen(findings)
    # the real H200 job: the job raised a loss spike at step 10 and a throughput drop at step 14 (a profiled step,
    # which neither the replay nor the verdict judges), the replay a throughput drop at step 17. The verdict said
    # "throughput_drop x1", the loss spike the job printed left out.
    h200 = {"alarm_agreement": {"replayed": [["throughput_drop", "samples_per_s", 17]],
                                "raised_in_job": [["loss_spike", "train/loss", 10]]}}
    assert monitor.distinct_alarms(h200) == {"loss_spike": 1, "throughput_drop": 1}
    # a result an older steplens wrote (counts by kind): counted as it was, not as none
    assert monitor.distinct_alarms({"monitor_alarms": {"throughput_drop": 4}}) == {"throughput_drop": 4}
    assert monitor.alarms_lines({"throughput_drop": 4}, {}) == ["Monitor alarms: throughput_drop x4 (table monitor_alarms)."]
