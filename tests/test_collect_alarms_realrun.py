"""In-job alarms on a real 2-rank DeepSpeed CPU job (gloo) with injected conditions, delivered to a callback,
the alarms table and a real Prometheus pushgateway (Debian's prometheus-pushgateway on a loopback port).

The job (tests/realrun/train_tiny_gpt.py): backward of 1000 x the loss at GRAD_SPIKE_AT (a real grad-norm
spike), the loss NaN from NAN_AT on (the weights follow), rank 1 sleeping SLOW_MS before every forward (a
straggler). What should fire is derived from the script's own record of its losses and grad norms.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import polars as pl
import pytest
from steplens.analyze.analyses import runner
from steplens.analyze.pipeline import ingest

sys.path.insert(0, str(Path(__file__).parent / "realrun"))

STEPS, GRAD_SPIKE_AT, NAN_AT, SLOW_RANK, SLOW_MS = 16, 6, 12, 1, 150
GRAD_NORM_LIMIT = 100.0
RULES = [{"kind": "nonfinite", "severity": "critical"}, {"kind": "grad_norm_high", "threshold": GRAD_NORM_LIMIT},
         {"kind": "straggler", "threshold": 1.5, "recent": 3}, {"kind": "no_progress", "threshold": 300}]


@pytest.fixture(scope="session")
def pushgateway(tmp_path_factory):
    binary = shutil.which("prometheus-pushgateway")
    if binary is None:
        pytest.skip("prometheus-pushgateway not installed (apt-get install prometheus-pushgateway; .ci/run does)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(tmp_path_factory.mktemp("pushgateway") / "pushgateway.log", "wb")
    proc = subprocess.Popen([binary, f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(f"http://{address}/metrics", timeout=1).read()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "pushgateway did not start"
            time.sleep(0.1)
    yield address
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def alarm_run(tmp_path_factory, pushgateway) -> Path:
    pytest.importorskip("deepspeed")
    pytest.importorskip("prometheus_client")
    from launch import run_tiny_gpt

    return run_tiny_gpt(tmp_path_factory.mktemp("alarm_run") / "alarm_job", "--zero_stage", "2", "--steps", str(STEPS),
                        "--flush_every", "4", "--profile_window", "off", "--flops_step", "-1",
                        "--grad_spike_at", str(GRAD_SPIKE_AT), "--nan_loss_at", str(NAN_AT),
                        "--slow_rank", str(SLOW_RANK), "--slow_ms", str(SLOW_MS),
                        "--alarms", json.dumps(RULES), "--pushgateway", pushgateway)


def script(run: Path, rank: int) -> list[dict]:
    return json.loads((run / "script" / f"rank{rank}.json").read_text())["steps"]


def callback_alarms(run: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run / "script" / f"alarms_rank{rank}.jsonl").read_text().splitlines()]


def expected(run: Path) -> set[tuple[str, str, int]]:
    """From the script's own record: the first step whose grad norm is above the limit and the first whose
    loss or grad norm is not finite (the default cooldown of 100 steps covers the rest of the job)."""
    steps = script(run, 0)
    high = [s["step"] for s in steps if math.isfinite(s["grad_norm"]) and s["grad_norm"] > GRAD_NORM_LIMIT]
    nan_loss = [s["step"] for s in steps if not math.isfinite(s["loss"])]
    nan_norm = [s["step"] for s in steps if not math.isfinite(s["grad_norm"])]
    return {("grad_norm_high", "train/grad_norm", high[0]), ("nonfinite", "train/loss", nan_loss[0]),
            ("nonfinite", "train/grad_norm", nan_norm[0])}


def test_injected_conditions_fire_once_at_their_step_and_reach_the_callback(alarm_run):
    want = expected(alarm_run)
    assert ("grad_norm_high", "train/grad_norm", GRAD_SPIKE_AT) in want and ("nonfinite", "train/loss", NAN_AT) in want
    got = callback_alarms(alarm_run, 0)
    keys = [(a["rule"], a["name"], a["step"]) for a in got if a["name"] in ("train/loss", "train/grad_norm")]
    assert sorted(keys) == sorted(want)  # each once: the cooldown holds the NaNs after the first
    stragglers = [a for a in got if a["rule"] == "straggler"]
    assert stragglers and {a["rank"] for a in stragglers} == {SLOW_RANK}
    assert callback_alarms(alarm_run, 1) == []  # rules run on rank 0
    for rank in range(2):  # the job ran every step on both ranks
        assert [s["step"] for s in script(alarm_run, rank)] == list(range(STEPS))


def test_alarms_table_and_the_replay_in_analyze_agree(alarm_run):
    result = ingest.ingest(alarm_run, jobs=1)
    table = pl.read_parquet(result.out_dir / "alarms")
    got = callback_alarms(alarm_run, 0)
    assert sorted(zip(table["rule"], table["name"], table["step"])) == sorted((a["rule"], a["name"], a["step"]) for a in got)
    findings = runner.run(result.out_dir, runner.Options())
    agreement = pl.read_parquet(result.out_dir / "alarm_agreement")
    scalar_rows = agreement.filter(pl.col("rule") != "straggler")
    assert scalar_rows["in_job"].all() and scalar_rows["post_hoc"].all()
    # A straggler step is judged in the job once the other rank's part is on disk: the job may see fewer.
    stragglers = agreement.filter(pl.col("rule") == "straggler")
    assert stragglers.filter(pl.col("in_job") & ~pl.col("post_hoc")).is_empty()
    assert findings["alarm_agreement"]["in_job"] == len(got) and findings["alarm_agreement"]["only_in_job"] == 0


def test_alarms_reach_the_pushgateway(alarm_run, pushgateway):
    text = urllib.request.urlopen(f"http://{pushgateway}/metrics", timeout=5).read().decode()
    steps = {}
    for line in text.splitlines():
        if line.startswith("steplens_alarm_step{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.rindex("}")]))
            steps[(labels["rule"], labels["name"])] = (float(line.rsplit(" ", 1)[1]), labels)
    for rule, name, step in expected(alarm_run):
        value, labels = steps[(rule, name)]
        assert value == step and labels["job"] == "alarm_job" and labels["instance"].endswith("-rank0")


def test_the_verdict_shows_in_job_alarms_next_to_the_replay_and_where_they_agree(alarm_run, tmp_path):
    from steplens.analyze.analyses import alarm_agreement, monitor as monitor_analysis

    result = ingest.ingest(alarm_run, tmp_path / "out", jobs=1)
    findings = runner.run(result.out_dir, runner.Options())
    in_job = pl.read_parquet(result.out_dir / "alarms")
    agreement = pl.read_parquet(result.out_dir / "alarm_agreement")
    lines = alarm_agreement.alarm_lines(findings["alarm_agreement"])
    both = agreement.filter(pl.col("in_job") & pl.col("post_hoc")).height
    assert lines[0].startswith(f"In-job alarms: {in_job.height} raised while the job ran; the same rules replayed on the "
                               f"recorded rows raise {agreement['post_hoc'].sum()}; {both} agree")
    # The NaN loss is critical (as configured): listed first, seen on both sides, at the step the script made it NaN.
    first_nan = min(s["step"] for s in script(alarm_run, 0) if not math.isfinite(s["loss"]))
    assert first_nan == NAN_AT
    assert f"Alarm nonfinite (critical) on train/loss at step {NAN_AT}, in the job and in the replay: train/loss is nan" \
        in "\n".join(lines[1:3])
    # The post-hoc analysis over every scalar series flags the same NaN (monitor_alarms, its sentence).
    monitor = pl.read_parquet(result.out_dir / "monitor_alarms")
    nan_rows = monitor.filter((pl.col("alarm") == "nan_inf") & (pl.col("name") == "train/loss"))
    assert nan_rows["step"].to_list() == [NAN_AT]
    assert any(line.startswith("Monitor alarms: ") and "nonfinite x" in line
               for line in monitor_analysis.alarms_lines(findings["monitor_alarms"], findings))


def test_logged_comms_name_the_rank_that_waits_least(alarm_run, tmp_path):
    """Rank SLOW_RANK sleeps before each forward, so the other rank reaches every all_reduce early and waits for it:
    the per-rank medians, from the collector's raw comms_calls parts, are the op on the late rank and the op plus
    the wait on the early one. comms_log_stats and the sentence name the late rank as the one that waits least."""
    import statistics

    import pyarrow.parquet as pq
    from steplens.analyze.analyses import comms_log

    latencies: dict[tuple[str, int], dict[int, list[int]]] = {}
    for part in sorted((alarm_run / "collector" / "comms_calls").glob("rank*.parquet")):
        for row in pq.read_table(part, columns=["rank", "op", "msg_bytes", "latency_ns"]).to_pylist():
            latencies.setdefault((row["op"], row["msg_bytes"]), {}).setdefault(row["rank"], []).append(row["latency_ns"])
    costliest = max(latencies, key=lambda key: sum(sum(v) for v in latencies[key].values()))
    medians = {rank: statistics.median(values) for rank, values in latencies[costliest].items()}
    assert min(medians, key=medians.get) == SLOW_RANK  # the job as built: the slow rank waits least
    out = shutil.copytree(alarm_run, tmp_path / "run", ignore=shutil.ignore_patterns(".steplens"))
    result = ingest.ingest(out, jobs=1)
    findings = runner.run(result.out_dir, runner.Options())
    row = pl.read_parquet(result.out_dir / "comms_log_stats").filter(
        (pl.col("op") == costliest[0]) & (pl.col("msg_bytes") == costliest[1])).row(0, named=True)
    assert row["least_wait_rank"] == SLOW_RANK
    assert row["least_wait_median_latency_ns"] == round(medians[SLOW_RANK])
    assert row["most_wait_median_latency_ns"] == round(max(medians.values()))
    line = " ".join(comms_log.logged_lines(findings["comms_log"], findings)[0].split())
    assert f"mostly waiting: the median call takes" in line and f"on rank {SLOW_RANK}, the rank that waits least" in line
