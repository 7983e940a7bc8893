"""Make the committed sample run sample_runs/deepspeed_cpu_2rank/ (about 30 s on 2 cores):

    .venv/bin/python tests/realrun/make_sample_run.py [OUT_DIR]

A real 2-rank DeepSpeed CPU job (ZeRO-2, 14 steps) with the collector on (flushes every 2 steps, FLOPs
on step 2, one active profiler step without stack, step 8, with five kept steps before it and four after) beside DeepSpeed's own csv_monitor, comms logger
(verbose) and wall_clock_breakdown output, so both kinds of input can be compared in one folder.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from launch import REPO, run_tiny_gpt

ARGS = ("--zero_stage", "2", "--steps", "14", "--flush_every", "2", "--flops_step", "2", "--profile_window", "1,1,1,1",
        "--profile_skip_first", "6", "--wall_clock_breakdown", "--csv_monitor", "--comms_logger", "verbose",
        "--log_level", "info")

README = """# deepspeed_cpu_2rank: a real DeepSpeed job with the steplens collector

Made by `.venv/bin/python tests/realrun/make_sample_run.py` (torch {torch}, deepspeed {deepspeed}, CPU, gloo), which ran

    {command}

with `DS_ACCELERATOR=cpu OMP_NUM_THREADS=1`: a tiny GPT (536,704 parameters, random tokens), ZeRO-2, 2 ranks,
micro batch 4, 14 optimizer steps.

* `collector/<table>/rank<r>-<seq>.parquet`: the collector's rows (train_steps, step_timers, scalars, comms_calls,
  flops_profile), flushed every 2 steps; `collector/manifest/rank<r>.json`: what the run was, and its status.
* `traces/rank<r>.<ns>.pt.trace.json.gz`: the torch.profiler window (step 8), standard Kineto JSON.
* DeepSpeed's own output of the same job: `csv_monitor/`, `rank_logs/` (comms logger verbose lines,
  wall_clock_breakdown timers), `comms/log_summary_rank<r>.json`.
* `script/rank<r>.json`: the training script's own step times and the engine's global_samples.

Read it with `analyze sample_runs/deepspeed_cpu_2rank` (writes `.steplens/`, not committed).
"""


def main() -> None:
    import deepspeed
    import torch

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "sample_runs" / "deepspeed_cpu_2rank"
    shutil.rmtree(out, ignore_errors=True)
    run_tiny_gpt(out, *ARGS)
    command = (out / "COMMAND.txt").read_text().strip().replace(str(REPO) + "/", "")
    (out / "COMMAND.txt").write_text(command + "\n")
    (out / "launcher.log").unlink()  # the launcher's own chatter; rank_logs/ has each rank's output
    (out / "README.md").write_text(README.format(torch=torch.__version__, deepspeed=deepspeed.__version__,
                                                 command=command))
    print(out)


if __name__ == "__main__":
    main()
