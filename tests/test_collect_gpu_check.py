"""The prepared GPU check (tests/gpu) runs its CPU part: the same job switches on CPU, packed and unpacked
as a device run comes back, analysed, and every check that needs no CUDA passes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "gpu" / "gpu_check.py"


def test_gpu_check_dry_run_passes_its_cpu_checks():
    pytest.importorskip("deepspeed")
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    results = json.loads(done.stdout[done.stdout.index("{"):])
    ran = {name: r["status"] for name, r in results.items() if isinstance(r, dict) and "status" in r}
    assert {name for name, status in ran.items() if status == "ok"} == {
        "collector_completed", "profiler_window", "flops_profile", "collector_overhead", "z3_released_windows_kept",
        "z3_released_mfu_numerators", "z3_released_after_effect", "z3_released_cupti_released",
        "z3_released_no_busbw_at_world_size_1", "z3_overhead_ratio"}
    assert {name for name, status in ran.items() if status == "skipped"} >= {
        "kernels_linked", "gemm_and_attention", "mfu_below_peak", "devices_in_manifest"}
    assert results["collector_overhead"]["detail"]["pairs"] >= 1
    effect = results["z3_released_after_effect"]["detail"]["analyze"]
    assert (effect["first_window_step"], effect["last_window_step"]) == (5, 9)  # warm-up 5, windows 6 and 9
