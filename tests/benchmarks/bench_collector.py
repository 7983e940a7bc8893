"""Step-time overhead of the collector outside profiler windows (issues 4 and 18; target: ratio <= 1.02).

The same 2-rank DeepSpeed CPU job (tests/realrun/train_tiny_gpt.py, ZeRO-2) runs without the collector
(`off`) and with it in three ways (its defaults: steps, timers, scalars, per-call comms; flushes every
--flush-every steps; no FLOPs step and no profiler window, which are bounded one-off costs):

  alarms   the default alarm rules (no "alarms" key), the on_alarm callback writing a jsonl file
  hang     the default rules plus a rule that fires at every step (loss above 0), and an on_alarm
           callback that never returns: the sink is disabled after alarm_timeout_s, alarms are dropped
  raise    the same firing rule, and an on_alarm callback that raises: the sink is disabled at once

The kinds run interleaved, in a rotated order each repeat, so drift of the machine hits them alike. Step time
is the training script's own wall clock per optimizer step (script/rank<r>.json), the same measurement with
or without the collector; the first --warmup steps are left out. Per run: the median step over ranks and
steps. Printed per kind: the median over runs, the ratio of medians to `off`, and the per-repeat ratios to
the `off` run of the same repeat (median, min-max), which are less sensitive to load that drifts.

Second figure, with less noise from other load: one job that attaches the collector for --block steps, closes
it for --block steps, and so on (train_tiny_gpt.py --collector_ab); per pair of neighbouring blocks the ratio
of their median steps, then the median over pairs (the first block, warm-up, left out).

    .venv/bin/python tests/benchmarks/bench_collector.py --repeats 6 --steps 120
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "realrun"))

from launch import run_tiny_gpt  # the path is set just above

from steplens.analyze.contract import alarm_rules


def median_step_ms(run: Path, warmup: int) -> float:
    steps = []
    for record in sorted((run / "script").glob("rank*.json")):
        for step in json.loads(record.read_text())["steps"][warmup:]:
            steps.append((step["end_ns"] - step["start_ns"]) / 1e6)
    return statistics.median(steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=6, help="Runs of each kind (0: skip the interleaved runs).")
    p.add_argument("--steps", type=int, default=120, help="Optimizer steps per run.")
    p.add_argument("--warmup", type=int, default=5, help="First steps left out.")
    p.add_argument("--flush-every", type=int, default=20, help="Collector flush interval (steps).")
    p.add_argument("--zero-stage", default="2")
    p.add_argument("--block", type=int, default=10, help="Steps per block of the same-job figure.")
    p.add_argument("--ab-steps", type=int, default=400, help="Steps of the same-job run (0: skip it).")
    args = p.parse_args()

    job = ("--zero_stage", args.zero_stage, "--steps", str(args.steps))
    collector_on = ("--collector", "--flush_every", str(args.flush_every), "--flops_step", "-1", "--profile_window", "off")
    if args.repeats:
        interleaved_runs(args, job, collector_on)
    if args.ab_steps:
        same_job(args, job, collector_on)


# A rule that fires at every step (the training script logs train/loss > 0): the failing sinks are called.
FIRING_RULE = {"kind": "grad_norm_high", "match": "^train/loss$", "threshold": 0.0, "cooldown_steps": 0,
               "severity": "info"}
KINDS = {"off": ("--no-collector",), "alarms": (),
         "hang": ("--alarms", json.dumps([*({"kind": k} for k in alarm_rules.DEFAULT_KINDS), FIRING_RULE]),
                  "--alarm_sink", "hang"),
         "raise": ("--alarms", json.dumps([*({"kind": k} for k in alarm_rules.DEFAULT_KINDS), FIRING_RULE]),
                   "--alarm_sink", "raise")}


def interleaved_runs(args, job, collector_on) -> None:
    medians: dict[str, list[float]] = {kind: [] for kind in KINDS}
    kinds = list(KINDS)
    with tempfile.TemporaryDirectory(prefix="bench_collector_") as tmp:
        for repeat in range(args.repeats):
            for kind in kinds[repeat % len(kinds):] + kinds[:repeat % len(kinds)]:
                extra = KINDS[kind] if kind == "off" else (*collector_on, *KINDS[kind])
                started = time.perf_counter()
                run = run_tiny_gpt(Path(tmp) / f"{kind}{repeat}", *job, *extra)
                medians[kind].append(median_step_ms(run, args.warmup))
                print(f"repeat {repeat} {kind:6}: median step {medians[kind][-1]:7.2f} ms "
                      f"(job {time.perf_counter() - started:5.1f} s){alarm_count(run)}", flush=True)
    off = statistics.median(medians["off"])
    print(f"\nZeRO-{args.zero_stage}, 2 ranks on CPU, {args.steps} steps per run, first {args.warmup} left out, "
          f"{args.repeats} runs of each kind")
    print(f"off: median step {off:.2f} ms")
    for kind in kinds[1:]:
        # Each repeat's runs ran one after another: the ratio to that repeat's off run cancels slow drift.
        paired = [a / b for a, b in zip(medians[kind], medians["off"])]
        print(f"{kind:6}: median step {statistics.median(medians[kind]):.2f} ms, ratio of medians "
              f"{statistics.median(medians[kind]) / off:.4f}; per-repeat on/off median {statistics.median(paired):.4f} "
              f"(min {min(paired):.4f}, max {max(paired):.4f})  (target <= 1.02)")


def alarm_count(run: Path) -> str:
    """What the collector's manifest says about alarms raised and sinks disabled (rank 0)."""
    path = run / "collector" / "manifest" / "rank0.json"
    alarms = json.loads(path.read_text()).get("alarms") if path.is_file() else None
    if not isinstance(alarms, dict):
        return ""
    sinks = {name: "disabled" if sink["disabled"] else "ok" for name, sink in alarms["sinks"].items()}
    return f", alarms raised {alarms['raised']}, sinks {sinks}"


def same_job(args, job, collector_on) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_collector_ab_") as tmp:
        ab_job = (*job[:-1], str(args.ab_steps))  # job ends with the step count
        run = run_tiny_gpt(Path(tmp) / "ab", *ab_job, *collector_on, "--collector_ab", str(args.block))
        blocks: dict[int, dict] = {}
        for record in sorted((run / "script").glob("rank*.json")):
            for step in json.loads(record.read_text())["steps"]:
                block = blocks.setdefault(step["step"] // args.block, {"on": step["collector_on"], "ms": []})
                block["ms"].append((step["end_ns"] - step["start_ns"]) / 1e6)
    medians = [(b["on"], statistics.median(b["ms"])) for _, b in sorted(blocks.items())][1:]
    ratios = [(a if on_first else b) / (b if on_first else a)
              for (on_first, a), (_, b) in zip(medians[::2], medians[1::2])]
    print(f"\nsame job, collector attached and closed every {args.block} steps, {args.ab_steps} steps, "
          f"{len(ratios)} block pairs")
    print(f"median step time  collector on: {statistics.median(m for on, m in medians if on):.2f} ms  "
          f"off: {statistics.median(m for on, m in medians if not on):.2f} ms")
    print(f"overhead ratio (median over block pairs of on / off): {statistics.median(ratios):.4f}  (target <= 1.02)")


if __name__ == "__main__":
    main()
