"""In-job alarms (issue 18): the shared rules against hand-computed cases, and the collector's evaluation,
sinks and watchdog on a plain torch model (the same Collector code as the DeepSpeed form). Real 2-rank
DeepSpeed jobs with injected conditions and a real pushgateway: tests/test_collect_alarms_realrun.py."""

from __future__ import annotations

import json
import math
import threading
import time

import polars as pl
import pytest
from steplens.analyze.contract import alarm_rules
from steplens.analyze.analyses import runner
from steplens.analyze.pipeline import ingest

torch = pytest.importorskip("torch")
from steplens.collect import attach  # noqa: E402  (after the torch check)

# --- the rules, by hand --------------------------------------------------------------------------------


def test_loss_spike_is_the_modified_z_against_the_trailing_window():
    """Trailing 1..8: median 4.5, MAD = median(3.5, 2.5, 1.5, .5, .5, 1.5, 2.5, 3.5) = 2. A 9 has
    z = 0.6745 * 4.5 / 2 = 1.52 (quiet); a 20, z = 0.6745 * 15.5 / 2 = 5.23 > 3.5 (alarm)."""
    (rule,) = alarm_rules.parse_rules([{"kind": "loss_spike", "window": 8}])
    engine = alarm_rules.AlarmEngine([rule])
    for step, value in enumerate(range(1, 9)):
        assert engine.scalar("train/loss", step, None, float(value), 0) == []
    assert engine.scalar("train/loss", 8, None, 9.0, 0) == []
    # The window slid: now 2..9, median 5.5, MAD 2; 20 gives 0.6745 * 14.5 / 2.
    (alarm,) = engine.scalar("train/loss", 9, 720, 20.0, 123)
    assert alarm["rule"] == "loss_spike" and alarm["step"] == 9 and alarm["global_samples"] == 720
    assert "robust z = 4.9" in alarm["detail"] and alarm["threshold"] == 3.5 and alarm["wall_ns"] == 123
    assert math.isclose(0.6745 * 14.5 / 2, 4.89, abs_tol=0.005)
    # A tag the rule does not watch, and a non-finite value, are not judged by it.
    assert engine.scalar("train/lr", 10, None, 1e9, 0) == []
    assert engine.scalar("train/loss", 10, None, math.inf, 0) == []


def test_cooldown_once_and_severity():
    rules = alarm_rules.parse_rules([
        {"kind": "grad_norm_high", "threshold": 10, "cooldown_steps": 3, "severity": "critical"},
        {"kind": "nonfinite", "once": True}])
    engine = alarm_rules.AlarmEngine(rules)
    fired = [a["step"] for step in range(10) for a in engine.scalar("grad_norm", step, None, 11.0, 0)]
    assert fired == [0, 3, 6, 9]  # cooldown 3: quiet for steps 1, 2 after an alarm at 0
    assert {a["severity"] for a in engine.scalar("grad_norm", 12, None, 11.0, 0)} == {"critical"}
    nonfinite = [a["step"] for step in range(5) for a in engine.scalar("train/loss", step, None, math.nan, 0)]
    assert nonfinite == [0]


def test_step_rules_slow_step_throughput_drop_and_stragglers():
    rules = alarm_rules.parse_rules([{"kind": "slow_step", "threshold": 3.0, "min_history": 4},
                                     {"kind": "throughput_drop", "threshold": 0.2, "recent": 2, "min_history": 4}])
    engine = alarm_rules.AlarmEngine(rules)
    # 8 samples per step; steps of 100 ms (80 samples/s); step 5 takes 301 ms (> 3 x 100), steps 6, 7 150 ms.
    durations_ms = [100, 100, 100, 100, 100, 301, 150, 150]
    alarms, samples = [], 0
    for step, ms in enumerate(durations_ms):
        samples += 8
        alarms += engine.step(step, int(ms * 1e6), samples, 0)
    assert [(a["rule"], a["step"]) for a in alarms] == [("slow_step", 5), ("throughput_drop", 6)]
    # Rates (samples/s) from step 1 on: 80 x4, 26.6, 53.3, 53.3. At step 6: the last 2 have median
    # (26.6 + 53.3) / 2 = 39.9 < 0.8 x 80 (the median of the 4 before).
    drop = alarms[1]
    assert math.isclose(drop["value"], (8 / 0.301 + 8 / 0.150) / 2, rel_tol=1e-12)
    (straggler,) = alarm_rules.parse_rules([{"kind": "straggler", "threshold": 1.5, "recent": 2}])
    engine = alarm_rules.AlarmEngine([straggler])
    # Rank 1 against the median of the others: step 1, 160 > 1.5 x 100; step 2, 170 > 1.5 x 105 = 157.5 (two
    # steps running: alarm); step 3, 151 < 157.5 breaks the streak; step 4 starts it again (one step, quiet).
    busy = [{0: 100, 1: 100, 2: 100}, {0: 100, 1: 160, 2: 100}, {0: 100, 1: 170, 2: 110}, {0: 100, 1: 151, 2: 110},
            {0: 100, 1: 200, 2: 100}]
    fired = [(a["name"], a["step"], a["rank"]) for step, b in enumerate(busy) for a in engine.ranks(step, b, 0)]
    assert fired == [("rank 1", 2, 1)]


def test_defaults_and_off():
    assert tuple(r.kind for r in alarm_rules.parse_rules(None)) == alarm_rules.DEFAULT_KINDS
    assert alarm_rules.parse_rules([]) == []
    for bad in ([{"kind": "nope"}], [{"kind": "grad_norm_high"}], [{"kind": "nonfinite", "severity": "loud"}],
                [{"kind": "loss_spike", "windw": 3}], {"kind": "nonfinite"}):
        with pytest.raises(ValueError):
            alarm_rules.parse_rules(bad)


# --- in the job --------------------------------------------------------------------------------------------


def tiny_job(run_dir, steps_losses, grad_norms=None, **settings):
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    collector = attach(model, optimizer=optimizer, run_dir=str(run_dir), samples_per_step=4, **settings)
    for step, loss in enumerate(steps_losses):
        model(torch.randn(4, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        collector.log("train/loss", loss)
        if grad_norms is not None:
            collector.log("train/grad_norm", grad_norms[step])
    return collector


LOSSES = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02, 0.98, 1.01, 9.0, 1.0, math.nan, 1.0, 1.0, 20.0]
GRAD_NORMS = [50.0 if step == 3 else 1.0 for step in range(len(LOSSES))]
# By hand: grad norm 50 > 10 at step 3; loss 9 at step 9 (8+ finite points before it, z ~ 40); NaN at 11;
# 20 at step 14 (5 steps after the spike at 9, the cooldown).
EXPECTED = {("grad_norm_high", "train/grad_norm", 3), ("loss_spike", "train/loss", 9), ("nonfinite", "train/loss", 11),
            ("loss_spike", "train/loss", 14)}
RULES = [{"kind": "nonfinite"}, {"kind": "loss_spike", "cooldown_steps": 5},
         {"kind": "grad_norm_high", "threshold": 10.0, "stop_training": True}]


def test_alarms_reach_the_callback_the_table_and_agree_with_the_replay(tmp_path, caplog):
    got = []
    collector = tiny_job(tmp_path, LOSSES, GRAD_NORMS, flush_every=5, alarms=RULES, on_alarm=got.append)
    collector.close()  # evaluates and delivers what is pending before it returns
    assert collector.stop_requested  # grad_norm_high opted in; the job itself went on
    assert {(a["rule"], a["name"], a["step"]) for a in got} == EXPECTED and len(got) == len(EXPECTED)
    assert set(got[0]) >= set(alarm_rules.ALARM_FIELDS)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("steplens alarm:")]
    assert len(logged) == len(EXPECTED)
    result = ingest.ingest(tmp_path, jobs=1)
    table = pl.read_parquet(result.out_dir / "alarms")
    assert set(zip(table["rule"], table["name"], table["step"])) == EXPECTED
    findings = runner.run(result.out_dir, runner.Options())
    counts = {k: v for k, v in findings["alarm_agreement"].items() if k not in ("listed", "replayed", "raised_in_job")}
    assert counts == {"in_job": 4, "post_hoc": 4, "agree": 4, "only_in_job": 0, "only_post_hoc": 0, "on_instrumented_steps": 0}
    assert {tuple(a) for a in findings["alarm_agreement"]["replayed"]} == EXPECTED  # every alarm the replay raised
    assert {tuple(a) for a in findings["alarm_agreement"]["raised_in_job"]} == EXPECTED  # and the job
    # Listed most severe first, then by step: all are warnings here (as configured), so by step.
    assert [(a["rule"], a["step"]) for a in findings["alarm_agreement"]["listed"]] == sorted(
        ((rule, step) for rule, _, step in EXPECTED), key=lambda key: (key[1], key[0]))


def test_the_callback_may_request_a_stop_and_alarms_can_be_off(tmp_path):
    collector = tiny_job(tmp_path / "a", LOSSES, flush_every=100, alarms=[{"kind": "nonfinite"}],
                         on_alarm=lambda alarm: "stop_training")
    collector.close()
    assert collector.stop_requested
    before = {t.name for t in threading.enumerate()}
    off = tiny_job(tmp_path / "b", LOSSES, flush_every=100, alarms=[])
    assert off.alarms is None and not {t.name for t in threading.enumerate()} - before - {"steplens-writer-rank0_0"}
    off.close()
    assert not off.stop_requested
    assert not (tmp_path / "b" / "collector" / "alarms").exists()


@pytest.mark.parametrize("behaviour", ["raises", "hangs"])
def test_a_sink_that_raises_or_hangs_is_disabled_without_holding_up_the_job(tmp_path, behaviour):
    release = threading.Event()

    def sink(alarm):
        if behaviour == "raises":
            raise ConnectionError("webhook down")
        release.wait()

    timeout_s = 0.5
    started = time.monotonic()
    collector = tiny_job(tmp_path, LOSSES * 3, flush_every=2, alarms=RULES[:2], on_alarm=sink, alarm_timeout_s=timeout_s)
    closing = time.monotonic()
    collector.close()
    closed = time.monotonic()
    release.set()
    assert closed - closing < timeout_s + 10  # bounded (the sink never returns on its own), with room for a loaded machine
    assert closing - started < 30
    manifest = json.loads((tmp_path / "collector" / "manifest" / "rank0.json").read_text())
    assert manifest["alarms"]["sinks"]["callback"]["disabled"] is not None
    assert manifest["steps_completed"] == len(LOSSES) * 3 and not manifest["disabled"]
    table = pl.read_parquet(tmp_path / "collector" / "alarms")  # the other sinks went on
    assert table.height == manifest["alarms"]["raised"] > 1


def test_the_watchdog_raises_no_progress_once_per_stall(tmp_path):
    got = []
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path), flush_every=100, samples_per_step=4,
                       alarms=[{"kind": "no_progress", "threshold": 0.4}], on_alarm=got.append)
    for step in range(4):
        if step == 2:
            time.sleep(1.5)  # a hang of 1.5 s after step 1: the watchdog polls every 0.1 s
        model(torch.randn(4, 4)).sum().backward()
        optimizer.step()
    collector.close()
    assert [(a["rule"], a["step"]) for a in got] == [("no_progress", 2)]
    assert got[0]["value"] > 0.4 and got[0]["global_samples"] == 8
    result = ingest.ingest(tmp_path, jobs=1)
    agreement = pl.read_parquet(runner.run(result.out_dir, runner.Options()) and result.out_dir / "alarm_agreement")
    (row,) = agreement.rows(named=True)
    assert row["in_job"] and row["post_hoc"] and row["step"] == 2 and row["value_post_hoc"] > 1.5


def test_stragglers_from_the_other_ranks_parts_and_a_rank_that_stops_writing(tmp_path):
    """Rank 0 reads rank 1's flushed parts (written here as rank 1's own writer writes them, 1 s per step, no
    comms): rank 1 is busy ~1 s per step against rank 0's microseconds, so it is a straggler once `recent` = 2
    steps are judged, at step 1. Rank 1 then stops writing; rank 0 goes on without holding its rows."""
    from steplens.collect.parts import PartWriter

    got = []
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path), flush_every=2, samples_per_step=4,
                       alarms=[{"kind": "straggler", "threshold": 1.5, "recent": 2}], on_alarm=got.append)
    collector.world_size = 2  # as in a 2-rank job
    other, start = PartWriter(tmp_path, 1, ("train_steps",), prepare={}), time.time_ns()
    for step in range(6):
        other.add("train_steps", {"rank": 1, "source": "collector", "step": step, "micro_step": step,
                                  "start_ns": start + step * 10**9, "end_ns": start + (step + 1) * 10**9,
                                  "dur_ns": 10**9, "is_boundary": True, "global_samples": 4 * (step + 1)})
    other.flush({"status": "running"}, background=False)
    other.close()
    for step in range(46):
        model(torch.randn(4, 4)).sum().backward()
        optimizer.step()
        collector.writer.wait()  # each flush's evaluation done before the next step (steps here take microseconds)
    kept = len(collector.alarms.other_rows["train_steps"][0])
    collector.close()
    assert [(a["rule"], a["name"], a["step"], a["rank"]) for a in got] == [("straggler", "rank 1", 1, 1)]
    assert kept <= 2 * 2 + 1  # rank 0's rows since the last judged step, not the 46 steps
    result = ingest.ingest(tmp_path, jobs=1)
    runner.run(result.out_dir, runner.Options())
    agreement = pl.read_parquet(result.out_dir / "alarm_agreement")
    assert agreement.select("rule", "name", "step", "in_job", "post_hoc").rows() == [("straggler", "rank 1", 1, True, True)]
