"""Step times of a real 2-rank DeepSpeed CPU job around the collector's flushes (flush every 4 steps).

    .venv/bin/python tests/benchmarks/bench_first_flush.py OUT_DIR [train_tiny_gpt.py args ...]

Prints each rank's step durations in ms from the collector's own train_steps parts: the step that
overlaps a flush (4, 8, 12) should look like its neighbours.
"""

import sys
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "realrun"))
from launch import run_tiny_gpt  # noqa: E402


def main() -> None:
    out_dir, *args = sys.argv[1:]
    out = run_tiny_gpt(Path(out_dir), "--steps", "16", "--flush_every", "4", "--flops_step", "-1",
                       "--profile_window", "off", *args)
    for rank in (0, 1):
        rows = [row for part in sorted((out / "collector" / "train_steps").glob(f"rank{rank}-*.parquet"))
                for row in pq.read_table(part).to_pylist()]
        print(f"rank {rank}:", [round(r["dur_ns"] / 1e6) for r in sorted(rows, key=lambda r: r["micro_step"])])


if __name__ == "__main__":
    main()
