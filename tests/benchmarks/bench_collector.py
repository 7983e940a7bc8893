"""Step-time overhead of the collector outside profiler windows (issue 4; target: ratio <= 1.02).

The same 2-rank DeepSpeed CPU job (tests/realrun/train_tiny_gpt.py, ZeRO-2) runs with the collector on
(its defaults: steps, timers, scalars, per-call comms; flushes every --flush-every steps; no FLOPs step and no
profiler window, which are bounded one-off costs) and off, interleaved on/off/on/off..., so drift of the
machine hits both alike. Step time is the training script's own wall clock per optimizer step
(script/rank<r>.json), the same measurement whether the collector runs or not; the first --warmup steps are
left out. Per run: the median step over ranks and steps. Printed: the ratio of the medians over runs of each
kind, and the median of the per-repeat ratios (on / off of the two runs made back to back), which is less
sensitive to other load on a shared machine.

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


def interleaved_runs(args, job, collector_on) -> None:
    medians: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="bench_collector_") as tmp:
        for repeat in range(args.repeats):
            for kind in ("on", "off") if repeat % 2 == 0 else ("off", "on"):
                extra = collector_on if kind == "on" else ("--no-collector",)
                started = time.perf_counter()
                run = run_tiny_gpt(Path(tmp) / f"{kind}{repeat}", *job, *extra)
                medians[kind].append(median_step_ms(run, args.warmup))
                print(f"repeat {repeat} collector {kind:3}: median step {medians[kind][-1]:7.2f} ms "
                      f"(job {time.perf_counter() - started:5.1f} s)", flush=True)
    on, off = statistics.median(medians["on"]), statistics.median(medians["off"])
    # Each repeat's on and off ran back to back: their ratio cancels load that drifts over minutes.
    paired = [a / b for a, b in zip(medians["on"], medians["off"])]
    print(f"\nZeRO-{args.zero_stage}, 2 ranks on CPU, {args.steps} steps per run, first {args.warmup} left out, "
          f"{args.repeats} runs each")
    print(f"median step time  collector on: {on:.2f} ms  off: {off:.2f} ms  ratio of medians: {on / off:.4f}")
    print(f"per-repeat ratios: {' '.join(f'{r:.3f}' for r in paired)}")
    print(f"overhead ratio (median of per-repeat on / off): {statistics.median(paired):.4f}  (target <= 1.02)")


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
