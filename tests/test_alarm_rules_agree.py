"""One implementation of the alarm rules (issue 18): the same series fed to the in-job collector (a real
collector in a torch job, evaluating at each flush on its writer thread) and to the post-hoc
`monitor_alarms` analysis raise the same alarms at the same steps. Series: hand-built ones with spikes
at known steps, and real scalars from DeepSpeed logs in ../shared (a Megatron-DeepSpeed log and a
DeepSpeed-Chat log) with conditions injected at known steps."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from steplens.analyze.analyses import monitor
from steplens.analyze.importers import deepspeed_log
from steplens.analyze.importers.base import conform

torch = pytest.importorskip("torch")
from steplens.collect import attach  # noqa: E402  (after the torch check)

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpus"
MEGATRON_LOG = CORPUS / "Megatron-DeepSpeed/random_ltd_gpt3_baseline/gpt3-0.125B-tokendropping-graduallyIncrease-lr-3.0e-4-baseline.log"
CHAT_LOG = CORPUS / "DeepSpeedExamples/deepspeed_chat_step1_sft/opt-1.3b-globalBatchSize128.log"
PREFIX = "fed/"  # the series' names in the job, apart from anything the collector logs itself


def rule_dicts(rules) -> list[dict]:
    return [dataclasses.asdict(rule) for rule in rules]


def in_job_alarms(tmp_path: Path, points: dict[str, dict[int, float]], rules: list[dict]) -> set[tuple]:
    """Run a torch job for as many steps as the series span, log each point at its step through the
    collector, and return the (rule, name, step) of the alarms its on_alarm callback got (scalar series
    only: the job's own step-time rules watch this toy job's steps, which are not the series')."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    got = []
    # flushing every 4 steps: often, so the rules run on many flushed batches, and too often for the collector to set
    # the steps its flushes ran in apart (alarm_rules.FLUSH_MARK_MIN_EVERY), which the plain series after do not know
    collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path), samples_per_step=8, flush_every=4,
                       alarms=rules, on_alarm=got.append)
    last = max(max(series) for series in points.values())
    for step in range(last + 1):
        model(torch.zeros(1, 2)).sum().backward()
        optimizer.step()
        for name, series in points.items():
            if step in series:
                collector.log(PREFIX + name, series[step])
    collector.close()
    assert collector.alarms is not None and not collector.disabled
    return {(a["rule"], a["name"][len(PREFIX):], a["step"]) for a in got if a["name"].startswith(PREFIX)}


def post_hoc_alarms(scalars: pl.DataFrame, facts: dict, rules) -> set[tuple]:
    table = monitor.monitor_alarms(scalars, facts, rules=rules)
    return set(zip(table["rule"], table["name"], table["step"]))


def series_frame(points: dict[str, dict[int, float]], batch: int) -> pl.DataFrame:
    rows = [{"rank": 0, "source": "hand", "origin": "log", "name": name, "step": step,
             "global_samples": (step + 1) * batch, "value": float(value)}
            for name, series in points.items() for step, value in series.items()]
    return conform(rows, "scalars")


def test_hand_built_series_raise_the_same_alarms_in_the_job_and_after(tmp_path):
    rng = np.random.default_rng(11)
    steps = 260
    loss = 3.0 - np.arange(steps) / 400 + rng.normal(0, 0.01, steps)
    loss[[40, 45, 170]] += 1.0  # 45: inside the cooldown of 40 (100 steps)
    loss[90] = math.nan
    step_ms = 50 + rng.normal(0, 0.3, steps)
    step_ms[[3, 120]] = 400  # 3: under min_history (8 points) before it; 120: 8x the trailing median
    rate = 900 + rng.normal(0, 1.0, steps)
    rate[200:206] = 500  # -44% sustained: fires when 2 of the last 3 are low
    memory = 10.0 + 0.02 * np.arange(steps)  # a steady leak
    points = {"train/loss": dict(enumerate(loss)), "Train/Samples/elapsed_time_ms_step": dict(enumerate(step_ms)),
              "samples_per_sec": dict(enumerate(rate)), "memory/allocated_gb": dict(enumerate(memory))}
    rules = monitor.post_hoc_rules({})
    expected = {("loss_spike", "train/loss", 40), ("loss_spike", "train/loss", 170), ("nonfinite", "train/loss", 90),
                ("slow_step", "Train/Samples/elapsed_time_ms_step", 120), ("throughput_drop", "samples_per_sec", 201)}
    # memory: the median of the first 50 points is 10 + 0.02 x 24.5 = 10.49; the first point above 1.2 x that
    # (12.588) is 10 + 0.02 s with s = 130 (12.6); still growing, again when the cooldown (100 steps) ends.
    expected |= {("memory_growth", "memory/allocated_gb", 130), ("memory_growth", "memory/allocated_gb", 230)}
    assert post_hoc_alarms(series_frame(points, 8), {}, rules) == expected
    assert in_job_alarms(tmp_path, points, rule_dicts(rules)) == expected


def log_points(path: Path, dense: bool = False) -> tuple[dict[str, dict[int, float]], pl.DataFrame, dict]:
    """The log's scalar series as {name: {step: value}} and as its scalars table. dense: the n-th line is
    step n in both (a job of 7,360 steps would take the toy job minutes; same series, same steps for both)."""
    if not path.is_file():
        pytest.skip(f"corpus log not found at {path}")
    imported = deepspeed_log.parse(path, path.name)
    scalars = imported.tables["scalars"].filter(pl.col("step").is_not_null())
    if dense:
        scalars = scalars.with_columns(step=pl.col("step").rank("dense").over("name").cast(pl.Int64) - 1).with_columns(
            global_samples=(pl.col("step") + 1) * imported.facts["train_batch_size"])
    points: dict[str, dict[int, float]] = {}
    for row in scalars.iter_rows(named=True):
        points.setdefault(row["name"], {})[row["step"]] = row["value"]
    return points, scalars, imported.facts


def inject(points, scalars, name: str, changes: dict[int, float]):
    """Multiply the real values of one series at the given positions (its n-th logged point)."""
    steps = sorted(points[name])
    for position, factor in changes.items():
        points[name][steps[position]] *= factor
    values = pl.DataFrame({"name": [name] * len(steps), "step": steps, "new": [points[name][s] for s in steps]})
    scalars = scalars.join(values, on=["name", "step"], how="left")
    return scalars.with_columns(value=pl.col("new").fill_null(pl.col("value"))).drop("new"), steps


def test_a_real_megatron_log_with_injected_conditions_agrees(tmp_path):
    points, scalars, facts = log_points(MEGATRON_LOG)
    # Every 10 iterations: steps 9, 19, ..., 469 (47 points). Loss x1.5 at the 30th point, the iteration
    # time x5 at the 35th: both far outside the real series' spread.
    scalars, steps = inject(points, scalars, "lm loss", {30: 1.5})
    scalars, _ = inject(points, scalars, "elapsed time per iteration (ms)", {35: 5.0})
    rules = monitor.post_hoc_rules(facts)
    after = post_hoc_alarms(scalars, facts, rules)
    assert {("loss_spike", "lm loss", steps[30]), ("slow_step", "elapsed time per iteration (ms)", steps[35])} <= after
    assert in_job_alarms(tmp_path, points, rule_dicts(rules)) == after


def test_a_real_deepspeed_chat_log_with_a_throughput_drop_agrees(tmp_path):
    points, scalars, facts = log_points(CHAT_LOG, dense=True)
    # 736 throughput lines (one every 10 steps: here steps 0..735); samples/s halved for 4 lines from the 400th.
    scalars, steps = inject(points, scalars, "CurrSamplesPerSec", {p: 0.5 for p in range(400, 404)})
    rules = monitor.post_hoc_rules(facts)
    after = post_hoc_alarms(scalars, facts, rules)
    assert ("throughput_drop", "CurrSamplesPerSec", steps[401]) in after
    assert in_job_alarms(tmp_path, points, rule_dicts(rules)) == after


@pytest.mark.parametrize("flush_every, set_apart", [(10, [10, 20, 30]), (4, [])])
def test_the_job_sets_apart_the_steps_its_flushes_ran_in_as_the_replay_does(tmp_path, flush_every, set_apart):
    """A 35-step job flushing every 10 steps: its step rules skip steps 10, 20 and 30 (the step after each flush, as
    the first_flush_step it notes and the step time's collector_flush say); flushing every 4 steps, none."""
    from steplens.analyze.contract import alarm_rules

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path), samples_per_step=8, flush_every=flush_every)
    for _ in range(35):
        model(torch.zeros(1, 2)).sum().backward()
        optimizer.step()
    skipped = sorted(collector.alarms.engine.skip_steps)
    facts = collector.run_facts
    collector.close()
    assert facts["first_flush_step"] == flush_every
    assert skipped == set_apart == list(alarm_rules.flush_steps(facts["first_flush_step"], flush_every, 34))
