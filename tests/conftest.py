import gzip
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpus"


@pytest.fixture
def corpus() -> Path:
    if not CORPUS.is_dir():
        pytest.skip(f"shared corpus not found at {CORPUS}")
    return CORPUS


def write_trace(path: Path, events: list, gz: bool = False, **top) -> Path:
    """A small Kineto-style trace file from a list of event dicts (and top-level keys)."""
    doc = {"schemaVersion": 1, **top, "traceEvents": events}
    data = json.dumps(doc, indent=1).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def launch_call_durations_ns(trace: Path, api: str) -> list[int]:
    """From a raw Kineto trace (json and gzip only, no steplens code): for each device activity whose launch call
    (found by its correlation id) is `api`, that call's duration in ns."""
    events = json.loads(gzip.decompress(trace.read_bytes()) if trace.name.endswith(".gz") else trace.read_bytes())
    calls = {e["args"]["correlation"]: e for e in events["traceEvents"] if e.get("ph") == "X"
             and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    return [round(float(calls[e["args"]["correlation"]]["dur"]) * 1000) for e in events["traceEvents"]
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
            and calls.get(e.get("args", {}).get("correlation"), {}).get("name") == api]


# Real 2-rank DeepSpeed CPU jobs (tests/realrun/train_tiny_gpt.py, gloo, DS_ACCELERATOR=cpu,
# OMP_NUM_THREADS=1) shared by the step-time, verdict, compare and trials tests: each is made once per
# test session, about 30 s on 2 cores. STEPLENS_REALRUN_DIR=<folder> keeps them there and reuses them.
REALRUN_STEADY_STEPS = 40
# The instrumented job: the collector's FLOPs profile on step 5 and one profiler window (skip 7,
# wait 1, warm-up 1 -> step 8, active 1 -> step 9; the traces are written before step 10).
REALRUN_INSTRUMENTED = {"steps": 16, "flops_step": 5, "skip_first": 7, "window": (1, 1, 1, 1)}


def _realrun(tmp_path_factory, name: str, *args: str) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    sys.path.insert(0, str(Path(__file__).parent / "realrun"))
    from launch import run_tiny_gpt

    if keep := os.environ.get("STEPLENS_REALRUN_DIR"):
        folder = Path(keep) / name
        if (folder / "script" / "rank0.json").exists():
            return folder
    else:
        folder = tmp_path_factory.mktemp("realrun") / name
    return run_tiny_gpt(folder, *args)


@pytest.fixture(scope="session")
def ds_steady_run(tmp_path_factory) -> Path:
    """40 optimizer steps, no profiler window and no FLOPs profile; wall_clock_breakdown timers and
    info-level logs with a step and throughput line every step (rank_logs/, launcher.log)."""
    return _realrun(tmp_path_factory, "steady", "--steps", str(REALRUN_STEADY_STEPS), "--profile_window", "off",
                    "--flops_step", "-1", "--wall_clock_breakdown", "--log_level", "info", "--steps_per_print", "1")


@pytest.fixture(scope="session")
def ds_instrumented_run(tmp_path_factory) -> Path:
    """REALRUN_INSTRUMENTED: a FLOPs-profiled step and a profiler window inside a 16-step job."""
    job = REALRUN_INSTRUMENTED
    return _realrun(tmp_path_factory, "instrumented", "--steps", str(job["steps"]), "--flops_step", str(job["flops_step"]),
                    "--profile_skip_first", str(job["skip_first"]), "--profile_window", ",".join(map(str, job["window"])))


# Issue 35: ZeRO-3, two profiler windows (repeat 2: steps 9 and 12, exports 10 and 13) with stacks and modules, a
# FLOPs step, a checkpoint after step 19, and every rank 250 ms slower per step from step 14 on (a known slow-down
# after the windows, as CUPTI left attached causes on a GPU).
REALRUN_TWO_WINDOWS = {"steps": 24, "flops_step": 3, "skip_first": 7, "window": (1, 1, 1, 2), "checkpoint": 19,
                       "slow_from": 14, "slow_ms": 250.0}


@pytest.fixture(scope="session")
def ds_two_windows_run(tmp_path_factory) -> Path:
    job = REALRUN_TWO_WINDOWS
    return _realrun(tmp_path_factory, "two_windows", "--zero_stage", "3", "--steps", str(job["steps"]),
                    "--flops_step", str(job["flops_step"]), "--profile_skip_first", str(job["skip_first"]),
                    "--profile_window", ",".join(map(str, job["window"])), "--profile_modules", "--profile_stack",
                    "--save_checkpoint_at", str(job["checkpoint"]), "--slow_all_from", str(job["slow_from"]),
                    "--slow_ms", str(job["slow_ms"]))


# Repeated jobs for `trials` and `compare`: TRIAL_REPEATS runs of each micro batch size, the collector
# configured the README's way (ds_config "steplens" block with its own run_dir per run), no profiler
# window and no FLOPs profile, so every step after the warm-up is a plain step.
TRIAL_MICRO_BATCHES = (2, 8)
TRIAL_REPEATS = 4
TRIAL_STEPS = 10


@pytest.fixture(scope="session")
def ds_trial_runs(tmp_path_factory) -> Path:
    """A folder holding mbs2_run0..3 and mbs8_run0..3 (one real 2-rank job each)."""
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    sys.path.insert(0, str(Path(__file__).parent / "realrun"))
    from launch import run_tiny_gpt

    keep = os.environ.get("STEPLENS_REALRUN_DIR")
    root = Path(keep) / "trials" if keep else tmp_path_factory.mktemp("trials")
    for micro_batch in TRIAL_MICRO_BATCHES:
        for repeat in range(TRIAL_REPEATS):
            folder = root / f"mbs{micro_batch}_run{repeat}"
            if not (folder / "script" / "rank0.json").exists():
                run_tiny_gpt(folder, "--micro_batch", str(micro_batch), "--steps", str(TRIAL_STEPS),
                             "--profile_window", "off", "--flops_step", "-1")
    return root


# A job that loses a rank: REALRUN_KILLED["rank"] SIGKILLs itself after step REALRUN_KILLED["after_step"]
# (the collector flushes every 2 steps, so that rank's last steps are lost with it); the launcher
# then kills the job. With wall_clock_breakdown and info-level logs.
REALRUN_KILLED = {"rank": 1, "after_step": 4, "steps": 8}


@pytest.fixture(scope="session")
def ds_killed_run(tmp_path_factory) -> Path:
    pytest.importorskip("deepspeed")
    sys.path.insert(0, str(Path(__file__).parent / "realrun"))
    from launch import run_tiny_gpt

    job = REALRUN_KILLED
    args = ("--steps", str(job["steps"]), "--flush_every", "2", "--kill_rank", str(job["rank"]), "--kill_at_step",
            str(job["after_step"]), "--profile_window", "off", "--flops_step", "-1", "--wall_clock_breakdown",
            "--log_level", "info", "--steps_per_print", "1")
    if keep := os.environ.get("STEPLENS_REALRUN_DIR"):
        folder = Path(keep) / "killed"
        if (folder / "collector" / "manifest" / "rank0.json").exists():
            return folder
    else:
        folder = tmp_path_factory.mktemp("realrun") / "killed"
    return run_tiny_gpt(folder, *args, check=False)


@pytest.fixture(scope="session", autouse=True)
def _release_deepspeed_shm():
    """Jobs started without run_tiny_gpt (Popen on launch.command) leave DeepSpeed's shm buffers too."""
    yield
    for name in ("launch", "tests.realrun.launch"):
        if (module := sys.modules.get(name)) is not None:
            module.release_shm()


CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="session")
def browser():
    """Headless Debian Chromium through selenium, with the page's console and network requests logged."""
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("Debian chromium and chromium-driver are not installed (.ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,4000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def python_children() -> set[int]:
    """This process's live Python descendants (the workers); not the session's Chromium, which starts and ends
    helper processes of its own at any time (one did between two looks in a CI run)."""
    import psutil

    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "python" in child.name():
                found.add(child.pid)
        except psutil.NoSuchProcess:  # ended between the listing and the look
            pass
    return found
